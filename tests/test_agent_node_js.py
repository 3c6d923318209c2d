"""A JavaScript agent carries every rollout of a live run, generating through the run's own engines, and the policy learns.

``astraflow up`` runs the arithmetic recipe (embedded server, secure by default) with
``workflow: {type: openai_agent, agent: external}`` and one rollout node, which pulls no task and
serves sessions. ``examples/node/agent.js`` joins with the run's rollout credential, pulls every
task, opens a session per task on the node's advertised endpoint, generates with the official
``openai`` npm client (streamed), reports rewards, and acks. The held-out reward must rise.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from learning import held_out_rose
from node_example import NODE, installed

from astraflow.streams.messages import Heartbeat, RolloutStats, Trajectory, TrajectoryBundle, TrajectoryGroup
from astraflow.streams.plane import NatsOptions, Plane

STEPS = 40


def ignore(subject: str, reason: str) -> None:  # a message of the other kind, followed by the other follower
    pass


async def until(pred, timeout: float, what: str, every: float = 0.2):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while (value := pred()) in (None, False):
        assert loop.time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(every)
    return value


def credential_url(path) -> str | None:
    try:
        return json.loads(path.read_text())["url"] or None
    except (OSError, ValueError, KeyError):
        return None


@pytest.mark.slow
async def test_a_javascript_agent_does_every_rollout_and_the_policy_learns(repo_root, tmp_path):
    example = installed()
    run_dir = tmp_path / "js-run"
    cmd = [sys.executable, "-m", "astraflow.cli", "up", str(repo_root / "recipes" / "arithmetic"), "--run-dir", str(run_dir),
           "--set", "workflow={type: openai_agent, agent: external}", "--set", "rollout.nodes=1",
           "--set", f"trainer.steps={STEPS}", "--set", "sft.steps=200", "--timeout", "500"]
    up_log = (tmp_path / "up.log").open("w")
    up = subprocess.Popen(cmd, stdout=up_log, stderr=subprocess.STDOUT)
    agent = None
    try:
        creds = run_dir / "credentials"
        await until(lambda: credential_url(creds / "admin.json"), 120, "the run's credentials")
        admin = NatsOptions.from_credential(str(creds / "admin.json"))
        watch = await Plane.connect(admin, json.loads((creds / "admin.json").read_text())["run"], "test-watch", wait=30)
        beats: list[Heartbeat] = []
        trajs: list[Trajectory] = []
        hb = await watch.on_heartbeats(beats.append)

        async def collect(t: Trajectory) -> None:
            trajs.append(t)

        async def collect_group(g: TrajectoryGroup | TrajectoryBundle) -> None:  # a task's samples (or tasks') as one message
            trajs.extend(g.trajectories)

        endpoint = await until(lambda: next((b.stats.endpoint for b in beats if isinstance(b.stats, RolloutStats) and b.stats.endpoint),
                                            None), 300, "the node's advertised endpoint")
        every_node = watch.names.traj("solver") + ".>"  # each node publishes under its own name
        follow = await watch.follow(every_node, Trajectory, collect, on_bad=ignore)  # the topology exists now
        follow_groups = await watch.follow(every_node, TrajectoryGroup, collect_group, on_bad=ignore)
        follow_bundles = await watch.follow(every_node, TrajectoryBundle, collect_group, on_bad=ignore)
        # the node's facade takes the node's own credential's password as its bearer token
        agent = subprocess.Popen([NODE, "agent.js", "--credential", str(creds / "nodes" / "rollout-0.json"), "--facade", endpoint,
                                  "--agent-id", "js-1", "--stream"], cwd=example, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        rc = await asyncio.to_thread(up.wait, 560)
        out, err = await asyncio.to_thread(agent.communicate, timeout=120)
        await follow.stop()
        await follow_groups.stop()
        await follow_bundles.stop()
        await hb.stop()
        await watch.close()
    finally:
        for p in (up, agent):
            if p is not None and p.poll() is None:
                p.kill()
        up_log.close()
    assert rc == 0, (tmp_path / "up.log").read_text()[-3000:]
    assert agent.returncode == 0, err[-3000:]
    stats = json.loads(out.strip().splitlines()[-1])
    summary = json.loads((run_dir / "summary.json").read_text())
    print("JS agent:", stats, "held-out reward:", summary["held_out_reward"], "wall_s:", summary["wall_s"])
    assert held_out_rose(summary, by=0.05), summary  # greedy held-out reward, disjoint prompts
    assert stats["tasks"] >= STEPS * 8 and stats["rejected"] == 0  # every batch the trainer took (8 groups) came from the agent
    assert len(trajs) >= STEPS * 64 and {t.meta.get("agent") for t in trajs} == {"js-1"}  # all rollouts were the agent's
    assert all(t.meta["runtime"] == "node" and t.meta["calls"] == 1 and t.finish_reason != "error" for t in trajs)
    versions = {int(v) for t in trajs for v in t.token_versions()}
    assert len(versions) > STEPS // 2  # per-token versions recorded by the node as the weights moved
    assert all(t.behaviour_logprobs().max() <= 0 and len(t.completion()) > 0 for t in trajs)
