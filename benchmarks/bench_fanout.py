"""Weight fan-out: N nodes fetch every version, from the hub directly, through region leaf mirrors, or through relays.

Real nats-servers on loopback: the shipped ``jetstream/hub.conf`` and one copy of ``jetstream/leaf.conf`` per region
(its own server name, JetStream domain, ports and store; monitoring on, to read bytes out). A publisher on the hub
publishes versions with the real :class:`WeightPublisher` (a sparse bf16 delta of a fixed fraction of the elements,
like a training step's); ``mirror_domains`` names the regions' leafs, where ``ensure_region_mirrors`` made the
mirrors of the weights object stream and of the announcements. N nodes, each its own connection (spread over a few
processes), follow the announcements and fetch each version's object, every chunk checked against its digest:

* ``direct``: every node on the hub, reading the hub's object stream;
* ``mirrored``: the nodes spread over the regions, each on its region's leaf (run traffic to the hub domain, as
  ``--domain hub`` does), reading the leaf's mirror;
* ``relayed``: each region's leaf also has ``--relays`` relay servers (``jetstream/relay.conf``, each its own name,
  domain, ports and store) dialling it, each mirroring the region's mirror (``ensure_region_mirrors(...,
  hub_domain=REGION)``); the nodes spread over the relays and read their relay's mirror. A server then sends one copy
  per server or node below it, whatever N: on machines of their own, with relays of relays, the time to every node
  grows with the depth of that tree (log N).

Per version: the hub's bytes out (``/varz`` ``out_bytes``) over the object's size, i.e. the copies the hub sent (and
each leaf and relay, likewise), and the time from the announcement until every node holds the version. The nodes fetch
and check; they do not apply (applying is each node's own CPU, measured in ``bench_per_version.py``). The next version
is published once every node holds the last. Writes ``benchmarks/results/fanout.json``.

    python benchmarks/bench_fanout.py [--nodes 4 16 64] [--regions 3] [--relays 4] [--versions 6] [--elements 4000000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import re
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from result_files import write  # noqa: E402

from astraflow.streams.messages import WeightVersion  # noqa: E402
from astraflow.streams.objects import ensure_region_mirrors  # noqa: E402
from astraflow.streams.plane import NatsOptions, Plane, Topology  # noqa: E402
from astraflow.streams.server import EmbeddedServer, adapt_config, free_port  # noqa: E402
from astraflow.weights.publish import WeightPublisher  # noqa: E402

CONF = ROOT / "jetstream"
POLICY = "solver"
CHANGED = 0.25  # the fraction of elements a version changes


def leaf_config(name: str, uplink: int, relay: bool = False) -> tuple[str, dict[int, int]]:
    """``jetstream/leaf.conf`` (``relay.conf`` for a relay) as server and domain ``name``, dialling the leafnode port
    ``uplink``, with free ports for its clients and for relays that dial it."""
    shipped = "relay" if relay else "leaf"
    text = (CONF / f"{shipped}.conf").read_text()
    text = re.sub(rf"(?m)^server_name: {shipped}$", f"server_name: {name}", text)
    text = re.sub(rf"(?m)^(\s*domain:) {shipped}\b", rf"\1 {name}", text)
    return text, ({4224: -1, 7423: uplink, 7424: free_port()} if relay else {4223: -1, 7422: uplink, 7423: free_port()})


class Plant:
    """The hub, its regions' leafs and each leaf's relays (leafs of the leaf), each with monitoring on a free port."""

    def __init__(self, base: Path, regions: int, relays: int = 0) -> None:
        link = free_port()
        self.http: dict[str, int] = {}
        self.hub = self._server(base, "hub", (CONF / "hub.conf").read_text(), {4222: -1, 7422: link})
        self.leafs: list[EmbeddedServer] = []
        self.relays: list[list[EmbeddedServer]] = []  # per region
        for k in range(regions):
            text, ports = leaf_config(f"leaf{k}", link)
            self.leafs.append(self._server(base, f"leaf{k}", text, ports))
            self.relays.append([self._server(base, f"leaf{k}r{j}", *leaf_config(f"leaf{k}r{j}", ports[7423], relay=True))
                                for j in range(relays)])

    def _server(self, base: Path, name: str, text: str, ports: dict[int, int]) -> EmbeddedServer:
        self.http[name] = free_port()
        conf = adapt_config(text, base / name / "store", ports) + f"\nhttp: 127.0.0.1:{self.http[name]}\n"
        return EmbeddedServer(base / name, config_text=conf).start()

    def out_bytes(self, name: str) -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http[name]}/varz", timeout=5) as r:
            return int(json.loads(r.read())["out_bytes"])

    def stop(self) -> None:
        for s in [*(r for rs in self.relays for r in rs), *self.leafs, self.hub]:
            s.stop()


# ------------------------------------------------------------------------------------------------ nodes
async def _node(url: str, region: str | None, run: str, name: str, versions: int, out: Path) -> None:
    """Follow the announcements (in ``region``'s mirror, or on the hub) and fetch every version's object whole."""
    plane = await Plane.connect(NatsOptions(url=url, domain="hub" if region else None), run, name)
    follower = plane.follower(plane.names.weights(POLICY), WeightVersion, domain=region, start="all")
    objects = plane.objects(domain=region, wait_missing=10.0 if region else 0.0)
    held = -1
    try:
        while held < versions - 1:
            for ann in await follower.fetch(1.0):
                if ann.version <= held:
                    continue
                data = await objects.get(ann.objects[0], timeout=60.0)
                held = ann.version
                with open(out, "a") as f:
                    f.write(json.dumps({"node": name, "version": held, "at": time.time(), "bytes": len(data)}) + "\n")
    finally:
        await follower.close()
        await plane.close()


def _worker(nodes: list[tuple[str, str | None, str]], run: str, versions: int, out: str) -> None:
    async def main() -> None:
        await asyncio.gather(*(_node(url, region, run, name, versions, Path(out)) for url, region, name in nodes))

    asyncio.run(main())


# ------------------------------------------------------------------------------------------------ one run
def held(out: Path) -> dict[int, list[float]]:
    """version -> the times the nodes reported holding it."""
    got: dict[int, list[float]] = {}
    if out.exists():
        for line in out.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                got.setdefault(r["version"], []).append(r["at"])
    return got


async def measure(mode: str, n: int, regions: int, versions: int, elements: int, seed: int, relays: int = 0) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix=f"fanout-{mode}-{n}-"))
    plant = Plant(base, 0 if mode == "direct" else regions, relays if mode == "relayed" else 0)
    run = "f" + uuid.uuid4().hex[:8]
    out = base / "held.jsonl"
    procs: list[mp.process.BaseProcess] = []
    try:
        trainer = await Plane.connect(NatsOptions(url=plant.hub.url), run, "trainer")
        await trainer.ensure_topology(Topology(policies=(POLICY,)))
        domains = tuple(f"leaf{k}" for k in range(len(plant.leafs)))
        for k, leaf in enumerate(plant.leafs):  # a region's mirrors, then its relays' mirrors of those
            for server, source in ((leaf, "hub"), *((r, f"leaf{k}") for r in plant.relays[k])):
                on_it = await Plane.connect(NatsOptions(url=server.url, domain="hub"), run, "mirrors")
                await on_it.wait_for_domain(source)
                await ensure_region_mirrors(on_it, run, hub_domain=source)
                await on_it.close()
        readers = ([(plant.hub.url, None)] if mode == "direct" else  # the servers the nodes read from, regions interleaved
                   [(leaf.url, f"leaf{k}") for k, leaf in enumerate(plant.leafs)] if mode == "mirrored" else
                   [(rs[j].url, f"leaf{k}r{j}") for j in range(len(plant.relays[0])) for k, rs in enumerate(plant.relays)])
        placed = [readers[i % len(readers)] for i in range(n)]
        workers = min(4, n)
        ctx = mp.get_context("spawn")
        for w in range(workers):
            mine = [(url, region, f"node-{i}") for i, (url, region) in enumerate(placed) if i % workers == w]
            p = ctx.Process(target=_worker, args=(mine, run, versions, str(out)), daemon=True)
            p.start()
            procs.append(p)
        gen = torch.Generator().manual_seed(seed)
        state = {"w": torch.randn(elements, generator=gen)}
        pub = WeightPublisher(trainer, POLICY, keyframe_every=10**6, keep_versions=None, mirror_domains=domains)
        rows: list[dict[str, Any]] = []
        for v in range(versions):
            if v:
                picked = torch.rand(elements, generator=gen) < CHANGED
                state["w"] = state["w"] + picked * torch.randn(elements, generator=gen) * 1e-2
            before = {s: plant.out_bytes(s) for s in plant.http}
            ann = await pub.publish(state, v)
            deadline = time.monotonic() + 600
            while len(held(out).get(v, [])) < n:
                if time.monotonic() > deadline or not all(p.is_alive() or p.exitcode == 0 for p in procs):
                    raise RuntimeError(f"{mode} N={n}: v{v} held by {len(held(out).get(v, []))} of {n} nodes")
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)  # the acks and heartbeats of the last fetch counted with this version
            size = ann.objects[0].size
            sent = {s: plant.out_bytes(s) - before[s] for s in plant.http}
            rows.append({"version": v, "encoding": ann.encoding, "bytes": size, "to_all_s": max(held(out)[v]) - ann.created_at,
                         "hub_copies": sent["hub"] / size, "leaf_copies": [sent[d] / size for d in domains],
                         "relay_copies": [sent[f"{d}r{j}"] / size for d in domains for j in range(len(plant.relays[0]))]
                         if mode == "relayed" else []})
        await trainer.close()
        for p in procs:
            p.join(60)
        deltas = [r for r in rows if r["encoding"] == "delta"]
        return {"mode": mode, "nodes": n, "regions": len(domains), "relays": len(plant.relays[0]) if plant.relays else 0,
                "relay_copies_max": statistics.median(max(r["relay_copies"], default=0.0) for r in deltas),
                "delta_bytes": statistics.median(r["bytes"] for r in deltas),
                "keyframe_bytes": rows[0]["bytes"],
                "hub_copies": statistics.median(r["hub_copies"] for r in deltas),
                "leaf_copies_max": statistics.median(max(r["leaf_copies"], default=0.0) for r in deltas),
                "to_all_s": statistics.median(r["to_all_s"] for r in deltas),
                "to_all_s_max": max(r["to_all_s"] for r in deltas), "versions": rows}
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        plant.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--regions", type=int, default=3)
    ap.add_argument("--versions", type=int, default=6, help="versions per run: a keyframe, then deltas")
    ap.add_argument("--elements", type=int, default=4_000_000, help="elements of the published state")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--relays", type=int, default=4, help="relays per region (leafs of its leaf, mirroring its mirror); 0: none")
    args = ap.parse_args()
    modes = ("direct", "mirrored", "relayed") if args.relays else ("direct", "mirrored")
    console = Console()
    results = []
    with Progress(console=console) as progress:
        task = progress.add_task("fan-out", total=len(modes) * len(args.nodes))
        for n in args.nodes:
            for mode in modes:
                r = asyncio.run(measure(mode, n, args.regions, args.versions, args.elements, args.seed, args.relays))
                results.append(r)
                progress.console.print(f"{mode} N={n}: hub sent {r['hub_copies']:.2f} copies, to all {r['to_all_s']:.3f} s")
                progress.advance(task)
    table = Table(title="weight fan-out per delta version (medians)")
    for col in ("nodes", "mode", "delta", "hub copies sent", "busiest leaf copies", "busiest relay copies", "to every node"):
        table.add_column(col)
    for r in results:
        table.add_row(str(r["nodes"]), r["mode"] + (f" ({r['regions']} regions)" if r["regions"] else ""),
                      f"{r['delta_bytes'] / 2**20:.2f} MiB", f"{r['hub_copies']:.2f}",
                      f"{r['leaf_copies_max']:.2f}" if r["regions"] else "—", f"{r['relay_copies_max']:.2f}" if r["relays"] else "—",
                      f"{r['to_all_s']:.3f} s")
    console.print(table)
    write("fanout", {"changed_fraction": CHANGED, "elements": args.elements, "runs": results})


if __name__ == "__main__":
    main()
