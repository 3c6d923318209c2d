"""A live ``astraflow up recipes/arithmetic`` run with a hostile node among its own: the operator issues it a node
credential (``astraflow node add``) and it answers real tasks with well-formed lies (``tests/hostile.py``). The lies are
refused by the claim they break, the node is quarantined and its credential revoked on the running server (its
connection closed, a new one refused), ``astraflow status`` says which node and why, ``astraflow node admit`` lets it
back in and the run goes on; stopped (Ctrl-C), no honest trajectory was refused and the accounting adds up.
``benchmarks/bench_hostile_node.py`` runs it longer and measures held-out against clean runs."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from hostile import BATCHED, CLAIMS, IN_FLIGHT, Lies, attack, cli, start_up
from poison_run import until, versions

from astraflow.config import load_recipe
from astraflow.streams.credentials import Credential
from astraflow.streams.dataflow_state import DataflowState
from astraflow.streams.plane import NatsOptions, Plane

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
# what a lie that passes the dataflow may come to: trained, dropped stale in the buffer as any group may be, or still
# waiting in a batch when the operator stopped the run (the resumed run trains it); a lie told just before the run was
# stopped may still be unread (the stopped run holds its task out: the resumed run reads it)
PASSED = {"trained", "dropped:stale", BATCHED}
STEPS = 2000  # more than it gets to: the test stops the run once it has seen the node let back in (however fast it trains)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


async def connects(credential: Path) -> bool:
    try:
        plane = await Plane.connect(NatsOptions.from_credential(str(credential)), Credential.read(credential).run, "probe", wait=5)
    except PermissionError:
        return False
    await plane.close()
    return True


def stopped_after(up: subprocess.Popen[bytes], run_dir: Path, lies: Lies, log: Path,
                  meanwhile: Callable[[Path], Awaitable[None]]) -> dict[str, str]:
    """:func:`hostile.attack` on the run, ``meanwhile`` once the node stopped (it stops the run): the lies' fates."""
    try:
        fates = asyncio.run(attack(up, run_dir, 60.0, lies, timeout=400, meanwhile=meanwhile))
        assert up.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    return fates


def test_a_lying_node_is_quarantined_cut_off_and_let_back_in(tmp_path: Path):
    run_dir = tmp_path / ("hostile" + uuid.uuid4().hex[:6])
    log = tmp_path / "up.log"
    up = start_up(run_dir, {"trainer.steps": STEPS, "eval.every": STEPS}, log, timeout=600)
    lies, seen = Lies(), {}

    async def while_it_runs(credential: Path) -> None:
        """Cut off: a new connection is refused; status names it; admitted, it connects again."""
        seen["refused"] = not await connects(credential)
        admin = run_dir / "credentials" / "admin.json"
        plane = await Plane.connect(NatsOptions.from_credential(str(admin)), Credential.read(admin).run, "test-admin", wait=10)
        state = await plane.state.get(DataflowState)  # before it is admitted again (what the store has at the end)
        lies.quarantine = state.quarantined.get("hostile") if state is not None else None
        await plane.close()
        status = await asyncio.to_thread(cli, "status", "--credential", str(run_dir / "credentials" / "admin.json"))
        seen["status"] = status.stdout
        admitted = await asyncio.to_thread(cli, "node", "admit", "hostile", "--run-dir", str(run_dir))
        seen["admit"] = admitted.returncode, admitted.stdout + admitted.stderr
        for _ in range(60):  # the dataflow's next audit lifts it, the launcher's next turn restores the credential
            if seen.setdefault("back", await connects(credential)):
                break
            seen.pop("back")
            await asyncio.sleep(0.5)
        at = len(versions(run_dir))

        async def went_on() -> bool:
            return len(versions(run_dir)) >= at + 5

        await until(went_on, "training to go on", 120)
        up.send_signal(signal.SIGINT)  # as an operator stops it: the roles drain, the accounting is recorded

    fates = stopped_after(up, run_dir, lies, log, while_it_runs)
    q = lies.quarantine
    assert q is not None and q.node == "hostile" and lies.cut_off is not None, (lies, log.read_text()[-3000:])
    after = load_recipe(run_dir / "recipe.yaml").dataflow.quarantine_after
    assert sum(q.failures.values()) == after and set(q.failures) <= {c.removeprefix("invalid:") for c in CLAIMS.values()} | {"logprobs"}, q
    assert seen["refused"] and "quarantined nodes" in seen["status"] and "hostile" in seen["status"], seen
    assert seen["admit"][0] == 0 and seen.get("back"), seen
    told = Counter(lies.told.values())
    assert {"logprobs", "reward", "prompt", "range"} <= set(told), lies
    for t, kind in lies.told.items():  # each claim lie by its claim, until the node was quarantined; then as quarantined
        assert fates[t] in (CLAIMS[kind], "invalid:quarantined") if kind in CLAIMS else fates[t] != "?", (t, kind, fates[t])
    assert sum(1 for f in fates.values() if f in CLAIMS.values()) >= after - q.failures.get("logprobs", 0)  # what tipped it over
    summary = json.loads((run_dir / "summary.json").read_text())
    acc = summary["accounting"]["solver"]
    refused = Counter({f: n for f, n in acc["fates"].items() if f.startswith("invalid:")})
    assert refused == Counter(f for f in fates.values() if f.startswith("invalid:"))  # no honest trajectory refused
    assert summary["outcome"] == "stopped" and acc["adds_up"] and versions(run_dir) == list(range(len(versions(run_dir))))
    text = log.read_text()
    assert "node hostile revoked (quarantined)" in text and "quarantined: hostile" in text and "node hostile let back in" in text
    # made-up logprobs pass the dataflow (trained, or dropped stale in the buffer as any group may be); the trainer leaves
    # out the rows whose tokens the model contradicts: at least the random letters (half of each such group), never more
    # than the liar sent
    told_logprobs = [t for t, kind in lies.told.items() if kind == "logprobs" and fates[t] != "invalid:quarantined"]
    assert told_logprobs and {fates[t] for t in told_logprobs} <= PASSED, (told_logprobs, fates)
    suspects = sum(r.get("suspect_trajectories", 0) for r in metrics(run_dir))
    trained_lies = sum(1 for t in told_logprobs if fates[t] == "trained")
    g = load_recipe(run_dir / "recipe.yaml").dataflow.group_size
    assert trained_lies * (g // 2) <= suspects <= trained_lies * g, (suspects, trained_lies)


def test_a_node_that_only_makes_up_logprobs_is_quarantined_on_the_trainers_word(tmp_path: Path):
    """Every lie passes the dataflow (the answer, or random letters, rewarded truly, with logprobs of -0.01 a token).
    The trainer's token check leaves the letters out of its steps and names them, with the node their subject names,
    in its announcements; the dataflow counts them against the node and quarantines it; the launcher cuts it off."""
    run_dir = tmp_path / ("faker" + uuid.uuid4().hex[:6])
    log = tmp_path / "up.log"
    up = start_up(run_dir, {"trainer.steps": STEPS, "eval.every": STEPS}, log, timeout=600)
    lies = Lies(kinds=("logprobs",))

    async def stop(credential: Path) -> None:
        up.send_signal(signal.SIGINT)

    fates = stopped_after(up, run_dir, lies, log, stop)
    q, after = lies.quarantine, load_recipe(run_dir / "recipe.yaml").dataflow.quarantine_after
    assert q is not None and q.failures == {"logprobs": after} and lies.cut_off is not None, (lies, log.read_text()[-3000:])
    assert "trainer's token check" in q.reason and "node hostile revoked (quarantined)" in log.read_text()
    assert set(fates.values()) <= PASSED | {"invalid:quarantined", IN_FLIGHT}, fates  # no claim of it was false
    suspects = sum(r.get("suspect_trajectories", 0) for r in metrics(run_dir))
    assert suspects >= after * load_recipe(run_dir / "recipe.yaml").dataflow.group_size // 2  # the letters, left out
    acc = json.loads((run_dir / "summary.json").read_text())["accounting"]["solver"]
    assert acc["adds_up"] and set(acc["fates"]) <= {"trained", "dropped:stale", "invalid:quarantined"}, acc
