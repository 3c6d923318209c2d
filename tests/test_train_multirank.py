"""Training beyond one process: the deepspeed backend with 2 ranks (gloo, CPU), fed by a real plane.

Two runs of the same batches, each with one rank killed (kill -9) part-way:

* under torchrun (``--max-restarts 1``): rank 0, the rank on the plane, is killed mid-run; the
  agent takes the group down and restarts it, and it resumes from its checkpoint;
* as plain processes (env ``RANK``/``WORLD_SIZE``, as a supervisor without an agent starts them):
  rank 1 is killed while rank 0 waits for a batch, outside any collective. Rank 0 must leave by
  itself through its peer watch (exit 75, "no heartbeat from rank(s) [1]"), and the test, as the
  supervisor, restarts both ranks.

Batches are fed one at a time (batch v once version v is announced), so both runs train the same
batches in the same order whatever the kills do. Then: one announcement per version, every batch
trained once; losses and gradient norms equal the one-process torch backend's to a relative 1e-5
(observed <= 5e-7: float32 sums in another order); and the two runs announce bit-identical states at
every version: a resumed 2-rank group continues exactly (a lossy resume would differ between two
different kill points). Batches split into 2 or 3 micro-batches: with 3, rank 1 pads its share.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'astraflow[deepspeed]')")

from test_train_support import Announcements, check_record, make_batches, publish_batches, wait_exit, write_recipe

from astraflow.models import build_model, load_tokenizer
from astraflow.streams.plane import NatsOptions, Plane
from astraflow.streams.state import DoneRecord
from astraflow.streams.trajectories import TrainingBatch
from astraflow.train.batching import micro_batches, to_tensors
from astraflow.train.peers import PEER_LOST_EXIT
from astraflow.train.torch_backend import TorchBackend
from astraflow.train.vetting import suspects_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # two groups of real trainer processes
STEPS = 6
PEER_TIMEOUT = 15.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def trainer_args(recipe_file: Path, url: str, run: str, ckpt: Path) -> list[str]:
    # --run-id: torchrun's own parser takes --run for an abbreviation of its --run-path
    return ["-m", "astraflow.cli", "worker", "trainer", "--recipe", str(recipe_file), "--nats", url, "--run-id", run,
            "--id", "trainer-solver", "--checkpoint-dir", str(ckpt)]


def group_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(tmp_path.parent / "torch-ext"))
    return {**env, "OMP_NUM_THREADS": "1"}


def spawn_torchrun(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
           "--monitor-interval", "0.5", *args]
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def spawn_ranks(args: list[str], env: dict[str, str], log: Path) -> list[subprocess.Popen[bytes]]:
    """Two ranks as plain processes, as a supervisor without an agent starts them."""
    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port}
        with open(log.with_suffix(f".rank{rank}.log"), "ab") as out:
            procs.append(subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=rank_env))
    return procs


def rank_pid(agent: subprocess.Popen[bytes], rank: int) -> int:
    """The pid of the worker process of ``rank`` under a torchrun agent (its child with ``RANK=rank``)."""
    for child in Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split():
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(child)
    raise AssertionError(f"no rank {rank} under torchrun {agent.pid}")


async def feed(plane: Plane, anns: Announcements, batches: list[TrainingBatch], hold: int | None = None,
               release: asyncio.Event | None = None) -> None:
    """Batch v once version v is announced (the same training order in every run, whatever is killed when);
    batch ``hold`` only once ``release`` is set."""
    for v, b in enumerate(batches):
        await anns.wait("solver", v, timeout=240.0)
        if v == hold and release is not None:
            await release.wait()
        await publish_batches(plane, [b])


def one_rank_reference(recipe, batches: list[TrainingBatch]) -> list[tuple[dict[str, float], list[str]]]:
    """Each step's metrics and the trajectories its token check left out, on one process."""
    pcfg = recipe.policies["solver"]
    tok = load_tokenizer(pcfg.model.tokenizer)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(pcfg.trainer.seed)
        backend = TorchBackend(build_model(pcfg.model, tok), tok, pcfg.trainer.model_copy(update={"backend": "torch"}))
        return [(backend.step(b), [s.traj_id for s in suspects_of(b, backend.suspects)]) for b in batches]
    finally:
        torch.set_num_threads(threads)


def forge_last(b: TrainingBatch) -> TrainingBatch:
    """``b`` with its last trajectory's logprobs made up (-0.05 a token): the token check leaves it out."""
    t = b.trajectories[-1]
    forged = t.model_copy(update={"logprobs": np.full(len(t.logprobs) // 4, -0.05, "<f4").tobytes()})
    return replace(b, trajectories=[*b.trajectories[:-1], forged])


def rank_of_last(b: TrainingBatch, tokens: int, pad: int) -> int:
    """The rank that runs ``b``'s last row (micro-batch i on rank i mod 2)."""
    last = len(b.trajectories) - 1
    return next(i % 2 for i, mb in enumerate(micro_batches(to_tensors(b, pad), tokens)) if last in mb.rows.tolist())


def log_tail(*paths: Path) -> str:
    return "\n".join(p.read_text()[-2500:] for p in paths if p.exists())


async def test_two_ranks_match_one_rank_and_resume_exactly_after_a_rank_is_killed(nats_server, tmp_path):
    recipe_file, recipe = write_recipe(tmp_path / "recipe.yaml", steps=STEPS, backend="deepspeed", zero_stage=2,
                                       micro_batch_tokens=36, peer_timeout=PEER_TIMEOUT)
    batches = [forge_last(b) for b in make_batches(recipe, "solver", STEPS)]
    reference = one_rank_reference(recipe, batches)
    # 2 micro-batches (one per rank) and 3 (rank 1 pads its share with a zero-weight stand-in: ZeRO-2 reduces at every backward)
    assert {m["micro_batches"] for m, _ in reference} == {2.0, 3.0}
    assert all(left_out == [b.trajectories[-1].traj_id] for (_, left_out), b in zip(reference, batches))
    assert {rank_of_last(b, 36, load_tokenizer("byt5").pad_token_id) for b in batches} == {0, 1}  # a forged row on each rank
    env = group_env(tmp_path)
    records = {}
    for launcher in ("torchrun", "plain"):
        run = f"mr{launcher}{os.getpid()}"
        plane = await Plane.connect(NatsOptions(url=nats_server.url), run, "test")
        await plane.ensure_topology(recipe.topology())
        anns = await Announcements(plane).start()
        release = asyncio.Event()
        feeder = asyncio.create_task(feed(plane, anns, batches, hold=3, release=release))
        log, ckpt = tmp_path / f"{launcher}.log", tmp_path / f"ckpt-{launcher}"
        args = trainer_args(recipe_file, nats_server.url, run, ckpt)
        procs: list[subprocess.Popen[bytes]] = []
        try:
            if launcher == "torchrun":
                release.set()
                agent = spawn_torchrun(args, env, log)
                procs = [agent]
                await anns.wait("solver", 2, timeout=240.0)
                os.kill(rank_pid(agent, 0), 9)  # rank 0 dies mid-run; the agent must restart the whole group
                assert await wait_exit(agent, timeout=300.0) == 0, log_tail(log)
                assert "restored checkpoint" in log.read_text()  # the agent restarted the group, which resumed
            else:
                procs = spawn_ranks(args, env, log)
                await anns.wait("solver", 3, timeout=240.0)  # batch 3 is held back: rank 0 waits on the plane
                procs[1].kill()  # the follower dies while rank 0 is in no collective
                assert await wait_exit(procs[1]) == -9
                rank0_log = log.with_suffix(".rank0.log")
                assert await wait_exit(procs[0], timeout=PEER_TIMEOUT + 60) == PEER_LOST_EXIT, log_tail(rank0_log)
                assert "no heartbeat from rank(s) [1]" in rank0_log.read_text()
                procs = spawn_ranks(args, env, log)  # the supervisor restarts the group from the checkpoint
                release.set()
                for p in procs:
                    assert await wait_exit(p, timeout=300.0) == 0, log_tail(*(log.with_suffix(f".rank{r}.log") for r in (0, 1)))
            await asyncio.wait_for(feeder, 30.0)
            assert (await plane.state.get(DoneRecord, "solver")).version == STEPS
            record = await anns.settle("solver", STEPS)
            check_record(record, batches, STEPS)  # one announcement per version, every batch trained once
            records[launcher] = record
        finally:
            feeder.cancel()
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            await anns.close()
            await plane.close()

    for ann, (ref, left_out) in zip(records["torchrun"][1:], reference):  # 2 ranks vs 1 rank, the same batches in order
        assert ann.metrics["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7), f"v{ann.version}"
        assert ann.metrics["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), f"v{ann.version}"
        assert [s.traj_id for s in ann.suspects] == left_out, f"v{ann.version}"  # whichever rank ran the row
    # exact resume: two different kills, the same states at every version
    assert [a.state_digest for a in records["torchrun"]] == [a.state_digest for a in records["plain"]]
