"""Partial rollouts on an engine that installs versions while its requests run (vLLM; the real engine is checked by
``tests/test_vllm_cpu.py``): where each request's version switched, and one thread driving the engine while the others
hand it their calls."""

from __future__ import annotations

import threading
import time

from astraflow.rollout.engines.switches import InFlight, sampled_before, token_versions
from astraflow.rollout.engines.turns import EngineTurns


def test_a_requests_count_is_found_under_vllms_suffixed_id_and_not_under_a_longer_one():
    generated = {"cmpl-a-1-0123abcd": 7, "cmpl-a-10-89abcdef": 3, "plain": 2}
    assert sampled_before(generated, "cmpl-a-1") == 7
    assert sampled_before(generated, "cmpl-a-10") == 3
    assert sampled_before(generated, "plain") == 2  # request id randomisation off: the caller's id itself
    assert sampled_before(generated, "cmpl-a-2") == 0  # not held by the worker: it was still waiting, nothing sampled
    assert sampled_before(generated, "cmpl-a") == 0  # a prefix of other ids is not one of them


def test_token_versions_follow_each_switch_from_its_boundary():
    assert token_versions(4, 5, []) == [4] * 5
    assert token_versions(4, 5, [(5, 2)]) == [4, 4, 5, 5, 5]
    assert token_versions(4, 5, [(5, 2), (6, 4)]) == [4, 4, 5, 5, 6]
    assert token_versions(4, 3, [(5, 3)]) == [4, 4, 4]  # finished before the install: all the old version's
    assert token_versions(4, 3, [(5, 0)]) == [5, 5, 5]  # waiting at the install: all the new version's


def test_an_install_reaches_the_requests_open_at_it_and_no_later_ones():
    inflight = InFlight()
    with inflight.lock:
        inflight.start(["r1", "r2"])
    with inflight.lock:
        inflight.record(5, {"r1-0123abcd": 3})
    with inflight.lock:
        inflight.start(["r3"])  # after the install: it starts under the new version and sees no switch
    assert inflight.finish("r1") == [(5, 3)]
    assert inflight.finish("r2") == [(5, 0)]
    assert inflight.finish("r3") == []
    assert inflight.switched == 1
    with inflight.lock:
        inflight.record(6, {})  # nothing open: not a switch
    assert inflight.switched == 1


def test_a_requests_boundary_is_read_under_the_id_the_engine_says_it_used():
    """A server that ignores the request's own id names it otherwise; its reply's id is what the worker reported."""
    inflight = InFlight()
    with inflight.lock:
        inflight.start(["cmpl-mine-0"])
        inflight.record(6, {"cmpl-theirs-0-0123abcd": 4})
    assert inflight.finish("cmpl-mine-0", served_as="cmpl-theirs-0") == [(6, 4)]


def driven(turns: EngineTurns, steps: int, log: list[str]) -> threading.Thread:
    """A generation holding the engine for ``steps`` steps, its safe points between them."""
    holding = threading.Event()

    def generation() -> None:
        with turns.driving():
            holding.set()
            for i in range(steps):
                time.sleep(0.01)
                log.append(f"step{i}")
                turns.between_steps()
        log.append("released")

    t = threading.Thread(target=generation)
    t.start()
    holding.wait(5)
    return t


def test_a_mid_generation_call_runs_between_steps_by_the_driver_and_returns_its_result():
    turns, log = EngineTurns(), []
    gen = driven(turns, 30, log)
    caller = []
    assert turns.call(lambda: caller.append(threading.current_thread()) or "read", mid_generation=True) == "read"
    assert "released" not in log and caller == [gen]  # the driver ran it, between two of its steps
    assert turns.call(lambda: turns.call(lambda: "inner"), mid_generation=True) == "inner"  # the holder's own call: at once
    gen.join(5)


def test_a_call_that_must_not_interrupt_a_generation_waits_for_its_end_and_errors_reach_the_caller():
    turns, log = EngineTurns(), []
    gen = driven(turns, 10, log)

    def install() -> None:
        log.append("install")
        raise ValueError("bad version")

    try:
        turns.call(install, mid_generation=False)
    except ValueError as e:
        assert "bad version" in str(e)
    else:
        raise AssertionError("the call's error did not reach its caller")
    gen.join(5)
    assert log.index("install") == log.index("step9") + 1  # after the last step, as the driver let go
    assert turns.call(lambda: 42) == 42  # free again: a call runs at once on its own thread
