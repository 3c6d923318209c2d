"""Rewards: code in a sandbox (time, memory, network), QA exact match and F1, and the registry."""

from __future__ import annotations

import os

import pytest

from astraflow.rollout.rewards import REWARDS, extract_code, get_reward
from astraflow.rollout.rewards.sandbox import Sandbox

TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]


def test_registry_names_the_known_rewards():
    assert {"arithmetic", "math", "reasoning_gym", "code", "qa_em", "qa_f1"} <= set(REWARDS)
    with pytest.raises(ValueError, match="registered"):
        get_reward("nope")


def test_code_reward_is_the_pass_fraction():
    code = get_reward("code")
    good = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\n"
    off_by_one = "def add(a, b):\n    return a + b + (a == 2)\n"
    assert code(good, {"tests": TESTS}) == 1.0
    assert code(off_by_one, {"tests": TESTS}) == pytest.approx(2 / 3)
    assert code("def add(a, b) return", {"tests": TESTS}) == 0.0  # does not compile
    assert extract_code("a\n```py\nx = 1\n```\nb ```python\ny = 2\n```") == "y = 2\n"


def test_sandbox_limits_time_memory_and_network():
    box = Sandbox(timeout_s=3.0, cpu_s=2, memory_mb=256)
    spin = box.run("def add(a, b):\n    return a + b\n", ["assert add(1, 1) == 2", "while True: pass", "assert True"])
    assert spin.compiled and spin.passed[0] and not spin.passed[2]  # the first test counted before the CPU limit
    sleepy = box.run("import time\ntime.sleep(60)", ["assert True"])
    assert sleepy.timed_out and sleepy.fraction == 0.0
    hog = box.run("x = bytearray(1 << 30)", ["assert True"])
    assert not hog.compiled and "MemoryError" in hog.error
    net = box.run("import socket\nsocket.create_connection(('127.0.0.1', 4222), timeout=2)", ["assert True"])
    assert not net.compiled and ("unreachable" in net.error or "refused" in net.error or "disabled" in net.error), net.error
    assert box.network_isolation in ("namespace", "socket-block")


def test_sandbox_runs_in_a_throwaway_directory():
    box = Sandbox(timeout_s=5.0)
    res = box.run("import os\nopen('x.txt', 'w').write('hi')",
                  ["assert os.path.exists('x.txt')", "assert 'PYTHONPATH' not in os.environ", "assert False, os.getcwd()"])
    assert res.passed == [True, True, False]
    here = res.error.rsplit(": ", 1)[-1]
    assert "af-sandbox-" in here and not os.path.exists(here)  # removed after the run


def test_qa_exact_match_and_f1():
    em, f1 = get_reward("qa_em"), get_reward("qa_f1")
    assert em("The Nile.", {"answer": "nile"}) == 1.0
    assert em("the river Nile", {"answers": ["Nile", "Nile River"]}) == 0.0
    assert f1("the river Nile", {"answers": ["Nile", "Nile River"]}) == pytest.approx(1.0)
    assert f1("Eiffel tower", {"answer": "the Eiffel Tower in Paris"}) == pytest.approx(2 * (1.0 * 0.5) / 1.5)
    assert f1("", {"answer": "x"}) == 0.0


def test_math_reward_works_off_the_main_thread():
    import concurrent.futures

    from astraflow.rollout.rewards import get_reward

    math = get_reward("math")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # rollout nodes score in a worker thread
        assert pool.submit(math, "The answer is $\\frac{1}{2}$", {"answer": "0.5"}).result() == 1.0
        assert pool.submit(math, "7", {"answer": "8"}).result() == 0.0
