"""What the nats-server's CPU goes on: a round trip, or a message.

Part 1 (always): a fresh embedded nats-server with JetStream on file storage, as ``astraflow up`` starts it,
and one client that does each kind of operation ``--ops`` times, each awaited before the next (one round
trip each), then JetStream publishes pipelined ``k`` deep (``k`` sent, then their acks awaited together).
The server's CPU is read from ``/proc/PID/stat`` before and after each kind: CPU µs per operation.

Part 2 (``--up SECONDS``): ``astraflow up`` on ``recipes/arithmetic/inprocess.yaml`` (one node, from
``--checkpoint``), and after ``--warmup`` seconds ``strace`` on its nats-server for SECONDS: the reads the
server does on each client's socket (each one a wake-up of the server by that client), per trained
version, told apart by the reply inbox each client names (``_INBOX_{user}``). Needs ``strace``.

Run: ``python benchmarks/bench_server_cost.py [--ops 2000] [--up 15 --checkpoint DIR]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats
from nats.js import api
from proc_stats import cpu_s
from rich.console import Console
from rich.table import Table

from astraflow.streams.server import EmbeddedServer

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "arithmetic" / "inprocess.yaml"
console = Console()


async def per_op(n: int) -> list[dict[str, float | str]]:
    """Server CPU µs and wall µs per operation, for each kind."""
    with tempfile.TemporaryDirectory() as d:
        server = EmbeddedServer(d).start()
        assert server.proc is not None
        pid = server.proc.pid
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        file = api.StorageType.FILE
        await js.add_stream(api.StreamConfig(name="S", subjects=["s.>"], storage=file))
        await js.add_stream(api.StreamConfig(name="W", subjects=["w.>"], storage=file, retention=api.RetentionPolicy.WORK_QUEUE))
        kv = await js.create_key_value(api.KeyValueConfig(bucket="kv", history=1, storage=file))
        work = await js.pull_subscribe("w.>", "w", stream="W")
        payload = b"x" * 200

        async def work_item(i: int) -> None:
            await js.publish("w.t", payload)
            (m,) = await work.fetch(1, timeout=5)
            await m.ack()

        kinds: list[tuple[str, Callable[[int], Awaitable[object]]]] = [
            ("round trip alone (PING/PONG)", lambda i: nc.flush()),
            ("JetStream publish, acked", lambda i: js.publish("s.a", payload)),
            ("KV put, 130 B", lambda i: kv.put(f"k{i % 64}", payload[:130])),
            ("KV put, 8 KB (the dataflow's state)", lambda i: kv.put("state", b"s" * 8000)),
            ("stream get (last by subject)", lambda i: js.get_last_msg("S", "s.a")),
            ("consumer info", lambda i: js.consumer_info("W", "w")),
            ("work item: publish, fetch, ack", work_item),
        ]
        rows: list[dict[str, float | str]] = []
        for name, op in kinds:
            await nc.flush()
            c0, t0 = cpu_s(pid), time.perf_counter()
            for i in range(n):
                await op(i)
            await nc.flush()
            rows.append({"op": name, "server_us": 1e6 * (cpu_s(pid) - c0) / n, "wall_us": 1e6 * (time.perf_counter() - t0) / n})
        for depth in (1, 8, 64):
            m = max(depth, n - n % depth)
            await nc.flush()
            c0, t0 = cpu_s(pid), time.perf_counter()
            for _ in range(m // depth):
                await asyncio.gather(*(js.publish("s.a", payload) for _ in range(depth)))
            rows.append({"op": f"JetStream publish, {depth} pipelined (per message)", "server_us": 1e6 * (cpu_s(pid) - c0) / m,
                         "wall_us": 1e6 * (time.perf_counter() - t0) / m})
        await nc.close()
        server.proc.terminate()
        server.proc.wait(10)
    return rows


READ = re.compile(r'^\d+\s+read\((\d+), "(.*?)"')
INBOX = re.compile(r"(?:PUB|SUB) \S+ _INBOX_([A-Za-z0-9-]+)\.|SUB _INBOX_([A-Za-z0-9-]+)\.")


def wakeups(trace: Path, run: str) -> tuple[int, dict[str, Counter[str]]]:
    """(versions announced, per client: the server's reads of its socket by what each began with). A read that
    begins inside a message (a continuation of a large one) is counted apart: it is not a wake-up of its own."""
    by_fd: dict[str, Counter[str]] = defaultdict(Counter)
    owner: dict[str, str] = {}
    versions = 0
    for line in trace.read_text(errors="replace").splitlines():
        m = READ.match(line)
        if m is None:
            continue
        fd, data = m.groups()
        if data.startswith(f"HPUB af.{run}.weights."):
            versions += 1
        if (who := INBOX.search(data)) is not None:
            owner.setdefault(fd, who.group(1) or who.group(2))
        head = re.match(r"(H?PUB|SUB|UNSUB|PING|PONG)\s*(\S*)", data)
        if head is None:
            by_fd[fd]["(rest of a large message)"] += 1
            continue
        subject = re.sub(r"\d{2,}|[0-9A-Za-z_-]{16,}", "*", head.group(2))
        by_fd[fd][f"{head.group(1)} {'.'.join(subject.split('.')[:5])}"] += 1
    return versions, {owner.get(fd, f"fd {fd}"): c for fd, c in by_fd.items()}


def up_wakeups(seconds: float, warmup: float, checkpoint: Path, keep: Path | None) -> dict[str, object]:
    if shutil.which("strace") is None:
        raise SystemExit("--up needs strace")
    base = Path(keep or tempfile.mkdtemp(prefix="server_cost_"))
    run_dir = base / "up"
    base.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "astraflow.cli", "up", str(RECIPE), "--run-dir", str(run_dir), "--set", f"model.pretrained={checkpoint}",
           "--set", "sft.steps=0", "--set", "trainer.steps=1000000", "--set", "rollout.nodes=1"]
    with open(base / "up.log", "w") as log:
        up = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    try:
        time.sleep(warmup)
        server = subprocess.run(["pgrep", "-f", f"nats-server -c {run_dir}/"], capture_output=True, text=True).stdout.split()
        if not server:
            raise SystemExit(f"no nats-server of the run found; see {base / 'up.log'}")
        trace = base / "server.strace"
        subprocess.run(["timeout", str(seconds), "strace", "-f", "-s", "160", "-e", "trace=read", "-p", server[0], "-o", str(trace)],
                       capture_output=True)
    finally:
        os.killpg(up.pid, signal.SIGINT)
        up.wait(120)
    versions, clients = wakeups(trace, run_dir.name)
    return {"seconds": seconds, "versions": versions,
            "clients": {who: {k: round(v / max(versions, 1), 2) for k, v in c.most_common()} for who, c in clients.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=2000, help="operations of each kind")
    ap.add_argument("--up", type=float, default=0.0, help="also trace a running `astraflow up` for this many seconds")
    ap.add_argument("--warmup", type=float, default=45.0, help="seconds of `up` before the trace")
    ap.add_argument("--checkpoint", type=Path, default=None, help="the SFT checkpoint `up` starts from (bench_trl.py --keep makes one)")
    ap.add_argument("--keep", type=Path, default=None, help="keep the run directory and the trace here")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = asyncio.run(per_op(args.ops))
    table = Table(title=f"nats-server CPU per operation ({args.ops} each, one client, file storage)")
    for col in ("operation", "server CPU µs", "client wall µs"):
        table.add_column(col, justify="left" if col == "operation" else "right")
    for r in rows:
        table.add_row(str(r["op"]), f"{r['server_us']:.0f}", f"{r['wall_us']:.0f}")
    console.print(table)
    out: dict[str, object] = {"per_op": rows}
    if args.up:
        if args.checkpoint is None:
            raise SystemExit("--up needs --checkpoint")
        traced = up_wakeups(args.up, args.warmup, args.checkpoint, args.keep)
        out["up"] = traced
        console.print(f"`astraflow up`: {traced['versions']} versions in {args.up:.0f} s of trace")
        for who, kinds in traced["clients"].items():  # type: ignore[union-attr]
            starts = sum(v for k, v in kinds.items() if not k.startswith("("))
            console.print(f"  {who}: {starts:.1f} wake-ups a version  " + ", ".join(f"{k} {v}" for k, v in list(kinds.items())[:8]))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
