"""Two policies, two trainer processes, one server: no lockstep. One trainer is frozen (SIGSTOP)
while the other trains all its batches; then it resumes. Both export metrics (Prometheus and
heartbeats) with loss parts, diagnostics, grad norm, tokens/s and the time spent waiting."""

from __future__ import annotations

import asyncio
import signal
import urllib.request

import pytest
from test_train_support import Announcements, make_batches, publish_batches, spawn_trainer, wait_exit, write_recipe

from astraflow.streams.messages import Heartbeat, TrainerStats
from astraflow.streams.plane import NatsOptions, Plane
from astraflow.streams.server import free_port
from astraflow.streams.state import DoneRecord

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]  # real trainer processes


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


async def test_one_trainer_per_policy_none_waits_for_another(nats_server, run_id, tmp_path):
    recipe_file, recipe = write_recipe(tmp_path / "recipe.yaml", policies=("solver", "verifier"), steps=4, loss="decoupled_ppo")
    plane = await Plane.connect(NatsOptions(url=nats_server.url), run_id, "test")
    await plane.ensure_topology(recipe.topology())
    anns = await Announcements(plane).start()
    beats: dict[str, Heartbeat] = {}
    beat_seen = asyncio.Event()

    def on_beat(hb: Heartbeat) -> None:
        if not isinstance(hb.stats, TrainerStats):
            return
        beats[hb.policy] = hb
        if "solver" in beats and "loss" in hb.stats.step and hb.policy == "solver":
            beat_seen.set()

    await plane.on_heartbeats(on_beat)
    solver_batches = make_batches(recipe, "solver", 4, seed=1)
    verifier_batches = make_batches(recipe, "verifier", 4, seed=2)
    await publish_batches(plane, solver_batches[:1] + verifier_batches)
    port = free_port()
    solver = spawn_trainer(recipe_file, nats_server.url, run_id, "solver", tmp_path / "solver.log", metrics_port=port)
    verifier = spawn_trainer(recipe_file, nats_server.url, run_id, "verifier", tmp_path / "verifier.log")
    try:
        await anns.wait("solver", 1)
        solver.send_signal(signal.SIGSTOP)  # frozen mid-run, holding nothing
        assert await wait_exit(verifier) == 0, (tmp_path / "verifier.log").read_text()[-3000:]
        await anns.wait("verifier", 4, timeout=30)
        assert anns.version("solver") == 1  # frozen all along
        solver.send_signal(signal.SIGCONT)

        # while the solver waits for data: its metrics, scraped and in heartbeats
        await asyncio.wait_for(beat_seen.wait(), 30)
        text = await asyncio.to_thread(_scrape, port)
        for name in ("loss", "pg_loss", "grad_norm", "tokens_per_s", "clip_frac", "tis_weight_mean", "wait_frac", "entropy"):
            assert f'astraflow_trainer_{name}{{policy="solver",worker="trainer-solver"}}' in text, name
        assert 'astraflow_trainer_version{policy="solver",worker="trainer-solver"} 1.0' in text
        assert "astraflow_trainer_wait_seconds_total" in text and "astraflow_trainer_trained_tokens_total" in text
        stats = beats["solver"].stats
        assert isinstance(stats, TrainerStats) and {"loss", "grad_norm", "tokens_per_s"} <= set(stats.step) and 0 < stats.wait_frac <= 1

        await publish_batches(plane, solver_batches[1:])
        assert await wait_exit(solver) == 0, (tmp_path / "solver.log").read_text()[-3000:]
        for policy, batches in (("solver", solver_batches), ("verifier", verifier_batches)):
            record = await anns.settle(policy, 4)
            assert [a.version for a in record] == [0, 1, 2, 3, 4]
            assert sorted(b for a in record for b in a.batch_ids) == sorted(b.batch_id for b in batches)
            assert (await plane.state.get(DoneRecord, policy)).version == 4
    finally:
        for p in (solver, verifier):
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
        await anns.close()
        await plane.close()
