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
  hub_domain=REGION)``); the nodes spread over the relays and read their relay's mirror;
* ``tree``: relays of relays, ``--relays`` below each server and as many levels as keep every server to ``--relays``
  copies (a relay dials the one above it and mirrors its mirror); the nodes read the bottom level.

A server then sends one copy per server or node below it, whatever N, and the time to every node grows with the
depth of the tree (log N) where each server has a link of its own. On one machine every server shares loopback and
the cores; ``--link MB_PER_S`` gives each its own uplink (``links.py``: a paced forwarder in front of its ports, the
keyframe every node starts from sent unpaced), and ``--unpaced K`` adds K deltas with the links unpaced, what the
cores and the hops take alone.

Per version: the hub's bytes out (``/varz`` ``out_bytes``) over the object's size, i.e. the copies the hub sent (and
each leaf and relay, likewise), and the time from the announcement until every node holds the version. The nodes fetch
and check; they do not apply (applying is each node's own CPU, measured in ``bench_per_version.py``). The next version
is published once every node holds the last. Writes ``benchmarks/results/fanout.json`` (``fanout_links.json`` with
``--link``) and its figure.

    python benchmarks/bench_fanout.py [--nodes 4 16 64] [--regions 3] [--relays 4] [--versions 6] [--elements 4000000]
    python benchmarks/bench_fanout.py --link 8 --modes direct mirrored tree --regions 1 --nodes 4 16 64 256 \\
        --elements 500000 --versions 4 --unpaced 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import socket
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

import links  # noqa: E402
import pool_model  # noqa: E402
from result_files import write  # noqa: E402

from astraflow.streams.messages import WeightVersion  # noqa: E402
from astraflow.streams.objects import ensure_region_mirrors  # noqa: E402
from astraflow.streams.plane import NatsOptions, Plane, Topology  # noqa: E402
from astraflow.streams.server import EmbeddedServer, adapt_config, renamed_config  # noqa: E402
from astraflow.weights.publish import WeightPublisher  # noqa: E402

CONF = ROOT / "jetstream"
POLICY = "solver"
CHANGED = 0.25  # the fraction of elements a version changes


SHIPPED = {  # per kind of server: its shipped config, its client port, the leafnode port it dials, the one it listens on
    "hub": ("hub", 4222, None, 7422),
    "leaf": ("leaf", 4223, 7422, 7423),
    "relay": ("relay", 4224, 7423, 7424),
}


def server_config(kind: str, name: str) -> str:
    """``jetstream/{hub,leaf,relay}.conf``, a leaf or relay as server and domain ``name``."""
    shipped = SHIPPED[kind][0]
    text = (CONF / f"{shipped}.conf").read_text()
    return text if kind == "hub" else renamed_config(text, shipped, name)


class Ports:
    """Listening ports picked below the kernel's ephemeral range (``ip_local_port_range``), one after another: a plant
    of many servers picks hundreds before it binds them, and the nodes' connections would take ephemeral ones between."""

    def __init__(self) -> None:
        try:
            low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            low = 32768
        self.next = random.randrange(10_000, max(10_001, low - 4_000))

    def __call__(self) -> int:
        while True:
            port, self.next = self.next, self.next + 1
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port


class Plant:
    """The hub; each region's leaf; below each leaf a tree of relays (leafs of the server above, each mirroring its
    mirrors), ``fanout`` below each server and ``levels`` deep. Each server has monitoring on a free port. With ``link``
    (bytes/s) every server's egress passes an emulated uplink of its own (``links.py``)."""

    def __init__(self, base: Path, regions: int, fanout: int = 0, levels: int = 0, link: float | None = None) -> None:
        self.http: dict[str, int] = {}
        self.urls: dict[str, str] = {}  # where clients reach each server (through its link, if any)
        self.parent: dict[str, str] = {}  # a leaf or relay -> the server it dials and mirrors
        self.leafs = [f"leaf{k}" for k in range(regions)]
        self.bottom: list[list[str]] = []  # per region: the servers its nodes read from
        self.servers: dict[str, EmbeddedServer] = {}
        self._front: mp.process.BaseProcess | None = None
        free_port = Ports()
        plan: list[tuple[str, str]] = [("hub", "hub")]  # (name, kind), each after the server it dials
        for leaf in self.leafs:
            self.parent[leaf] = "hub"
            plan.append((leaf, "leaf"))
            level = [leaf]
            for _ in range(levels):
                below = [f"{up}r{j}" for up in level for j in range(fanout)]
                for name in below:
                    self.parent[name] = name.rsplit("r", 1)[0]
                    plan.append((name, "relay"))
                level = below
            self.bottom.append(level)
        self.relays = [name for name, kind in plan if kind == "relay"]
        # every listening port: the server's own, and the one others dial (the same without links)
        listen: dict[str, dict[int, int]] = {}
        forwards: list[tuple[int, int, str]] = []
        dial: dict[str, int] = {}  # the leafnode port the servers below each one dial
        for name, kind in plan:
            _, client, _, leafnodes = SHIPPED[kind]
            listen[name] = {client: free_port(), leafnodes: free_port()}
            public = {shipped: free_port() if link else own for shipped, own in listen[name].items()}
            forwards += [(public[shipped], own, name) for shipped, own in listen[name].items()]
            self.urls[name], dial[name] = f"nats://127.0.0.1:{public[client]}", public[leafnodes]
        ctx = mp.get_context("spawn")
        self.link, self.rate = link, ctx.Value("d", 0.0)  # the links' rate: not paced until pace()
        try:
            if link:
                self._front = ctx.Process(target=links.run, args=(forwards, self.rate), daemon=True)
                self._front.start()
                links.wait_listening([public for public, _, _ in forwards])
            for name, kind in plan:
                ports = dict(listen[name])
                uplink = SHIPPED[kind][2]
                if uplink is not None:
                    ports[uplink] = dial[self.parent[name]]
                self.http[name] = free_port()
                conf = adapt_config(server_config(kind, name), base / name / "store", ports)
                conf += f"\nhttp: 127.0.0.1:{self.http[name]}\n"
                self.servers[name] = EmbeddedServer(base / name, config_text=conf).start()
        except BaseException:
            self.stop()
            raise

    def pace(self, paced: bool = True) -> None:
        """From now on every server's egress leaves at the link's rate, or (``paced`` False) as fast as this machine
        sends it (a no-op without links)."""
        if self.link:
            self.rate.value = self.link if paced else 0.0

    @property
    def depth(self) -> int:
        """Servers from the hub to a node, the hub included."""
        return 1 + (len(self.bottom[0][0].split("r")) if self.bottom else 0)

    def out_bytes(self, name: str) -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http[name]}/varz", timeout=5) as r:
            return int(json.loads(r.read())["out_bytes"])

    def stop(self) -> None:
        for s in reversed(self.servers.values()):
            s.stop()
        if self._front is not None:
            self._front.kill()


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


def tree_levels(n: int, regions: int, fanout: int) -> int:
    """Relay levels below each leaf so that no server has more than ``fanout`` nodes: the least L with
    fanout^(L+1) >= the nodes of a region."""
    per_region, levels = -(-n // regions), 0
    while fanout ** (levels + 1) < per_region:
        levels += 1
    return levels


def plant_for(mode: str, n: int, regions: int, fanout: int) -> tuple[int, int, int]:
    """(regions, fanout, levels) of the servers for ``mode`` with ``n`` nodes."""
    if mode == "direct":
        return 0, 0, 0
    if mode == "mirrored":
        return regions, 0, 0
    return regions, fanout, 1 if mode == "relayed" else tree_levels(n, regions, fanout)


async def measure(mode: str, n: int, regions: int, versions: int, elements: int, seed: int, relays: int = 0,
                  link: float | None = None, unpaced: int = 0) -> dict[str, Any]:
    """Publish ``versions`` (a keyframe, then deltas) and, with ``link``, ``unpaced`` more deltas with the links
    unpaced: what this machine's cores and the servers' hops take without the links."""
    base = Path(tempfile.mkdtemp(prefix=f"fanout-{mode}-{n}-"))
    regions, fanout, levels = plant_for(mode, n, regions, relays)
    for attempt in range(3):  # ports are picked free before the servers bind them: another process may take one between
        try:
            plant = Plant(base / f"try{attempt}", regions, fanout, levels, link=link)
            break
        except (RuntimeError, OSError):  # a server or a link that could not bind its port
            if attempt == 2:
                raise
    run = "f" + uuid.uuid4().hex[:8]
    out = base / "held.jsonl"
    procs: list[mp.process.BaseProcess] = []
    try:
        trainer = await Plane.connect(NatsOptions(url=plant.urls["hub"]), run, "trainer")
        await trainer.ensure_topology(Topology(policies=(POLICY,)))
        for name, source in plant.parent.items():  # each leaf's mirrors of the hub's, each relay's of its parent's
            on_it = await Plane.connect(NatsOptions(url=plant.urls[name], domain="hub"), run, "mirrors")
            await on_it.wait_for_domain(source)
            await ensure_region_mirrors(on_it, run, hub_domain=source)
            await on_it.close()
        readers = ([(plant.urls["hub"], None)] if mode == "direct" else  # the servers the nodes read from, regions interleaved
                   [(plant.urls[ss[j]], ss[j]) for j in range(len(plant.bottom[0])) for ss in plant.bottom])
        placed = [readers[i % len(readers)] for i in range(n)]
        workers = min(4, n)
        ctx = mp.get_context("spawn")
        for w in range(workers):
            mine = [(url, region, f"node-{i}") for i, (url, region) in enumerate(placed) if i % workers == w]
            p = ctx.Process(target=_worker, args=(mine, run, versions + unpaced, str(out)), daemon=True)
            p.start()
            procs.append(p)
        gen = torch.Generator().manual_seed(seed)
        state = {"w": torch.randn(elements, generator=gen)}
        pub = WeightPublisher(trainer, POLICY, keyframe_every=10**6, keep_versions=None, mirror_domains=tuple(plant.leafs))
        rows: list[dict[str, Any]] = []
        for v in range(versions + unpaced):
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
            plant.pace(v + 1 < versions)  # the keyframe every node starts from goes out unpaced (measured: the deltas)
            size = ann.objects[0].size
            sent = {s: plant.out_bytes(s) - before[s] for s in plant.http}
            rows.append({"version": v, "encoding": ann.encoding, "bytes": size, "to_all_s": max(held(out)[v]) - ann.created_at,
                         "paced": bool(link) and 0 < v < versions,
                         "hub_copies": sent["hub"] / size, "leaf_copies": [sent[d] / size for d in plant.leafs],
                         "relay_copies": [sent[r] / size for r in plant.relays]})
        await trainer.close()
        for p in procs:
            p.join(60)
        deltas = [r for r in rows[:versions] if r["encoding"] == "delta"]
        floor = [r["to_all_s"] for r in rows[versions:] if r["encoding"] == "delta"]
        return {"mode": mode, "nodes": n, "regions": regions, "relays": fanout, "relay_levels": levels,
                "relay_servers": len(plant.relays), "depth": plant.depth, "link_bytes_per_s": link,
                "relay_copies_max": statistics.median(max(r["relay_copies"], default=0.0) for r in deltas),
                "delta_bytes": statistics.median(r["bytes"] for r in deltas),
                "keyframe_bytes": rows[0]["bytes"],
                "hub_copies": statistics.median(r["hub_copies"] for r in deltas),
                "leaf_copies_max": statistics.median(max(r["leaf_copies"], default=0.0) for r in deltas),
                "to_all_s": statistics.median(r["to_all_s"] for r in deltas),
                "to_all_s_max": max(r["to_all_s"] for r in deltas),
                "unpaced_to_all_s": statistics.median(floor) if floor else None, "versions": rows}
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        plant.stop()


def plot(results: list[dict[str, Any]], link: float | None, path: Path) -> None:
    """Time to every node, and the copies the busiest server sent, against the node count, per layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (when, copies) = plt.subplots(1, 2, figsize=(11, 5))
    for mode, style in (("direct", "-o"), ("mirrored", "-s"), ("relayed", "-^"), ("tree", "-D")):
        pts = sorted((r for r in results if r["mode"] == mode), key=lambda r: r["nodes"])
        if not pts:
            continue
        n = [r["nodes"] for r in pts]
        line = when.plot(n, [r["to_all_s"] for r in pts], style, label=LAYOUTS[mode])[0]
        copies.plot(n, [max(r["hub_copies"], r["leaf_copies_max"], r["relay_copies_max"]) for r in pts], style, label=LAYOUTS[mode])
        if link:
            when.plot(n, [pool_model.on_links(r) for r in pts], ":", color=line.get_color(), label="  the model (pool_model.fanout)")
        if all(r.get("unpaced_to_all_s") for r in pts):
            when.plot(n, [r["unpaced_to_all_s"] for r in pts], "--", color=line.get_color(), alpha=0.5,
                      label="  the links unpaced (this machine's cores and hops)")
    when.set_yscale("log")
    for ax, title, unit in ((when, "from the announcement to every node", "s (median over delta versions)"),
                            (copies, "copies the busiest server sent per version", "copies")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("nodes")
        ax.set_ylabel(unit)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    fig.legend(*when.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.suptitle("Weight fan-out" + (f", every server on an emulated uplink of {link / 1e6:g} MB/s" if link else
                                     f", all servers sharing loopback and {os.cpu_count()} cores"), fontsize=10)
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


LAYOUTS = {"direct": "every node reads the hub", "mirrored": "nodes read their region's leaf",
           "relayed": "nodes read a relay below the leaf", "tree": "nodes read the bottom of a relay tree"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--regions", type=int, default=3)
    ap.add_argument("--versions", type=int, default=6, help="versions per run: a keyframe, then deltas")
    ap.add_argument("--elements", type=int, default=4_000_000, help="elements of the published state")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--relays", type=int, default=4, help="relays below each leaf (and, in a tree, below each relay); 0: none")
    ap.add_argument("--modes", nargs="+", choices=("direct", "mirrored", "relayed", "tree"), default=None,
                    help="default: direct, mirrored, and relayed when --relays; tree: as many relay levels as keep every "
                    "server to --relays nodes or servers below it")
    ap.add_argument("--link", type=float, default=None, metavar="MB_PER_S",
                    help="give every server an emulated uplink of this many MB/s (links.py); writes fanout_links.json")
    ap.add_argument("--unpaced", type=int, default=0, metavar="K",
                    help="with --link: K more deltas per run with the links unpaced (what the cores and hops take alone)")
    args = ap.parse_args()
    modes = args.modes or (("direct", "mirrored", "relayed") if args.relays else ("direct", "mirrored"))
    if args.relays < 2 and {"relayed", "tree"} & set(modes):
        ap.error("relayed and tree need --relays 2 or more")
    link = args.link * 1e6 if args.link else None
    console = Console()
    results, failed = [], []
    with Progress(console=console) as progress:
        task = progress.add_task("fan-out", total=len(modes) * len(args.nodes))
        for n in args.nodes:
            for mode in modes:
                try:
                    r = asyncio.run(measure(mode, n, args.regions, args.versions, args.elements, args.seed, args.relays, link,
                                            args.unpaced if link else 0))
                except (RuntimeError, OSError) as e:  # a node never got a version, or the plant never came up: recorded
                    failed.append({"mode": mode, "nodes": n, "error": str(e)})
                    progress.console.print(f"[red]{mode} N={n} failed[/]: {e}")
                    progress.advance(task)
                    continue
                results.append(r)
                progress.console.print(f"{mode} N={n}: hub sent {r['hub_copies']:.2f} copies, to all {r['to_all_s']:.3f} s "
                                       f"(servers to a node: {r['depth']})")
                progress.advance(task)
    table = Table(title="weight fan-out per delta version (medians)" + (f", uplinks of {args.link:g} MB/s" if link else ""))
    for col in ("nodes", "mode", "delta", "hub copies sent", "busiest leaf copies", "busiest relay copies", "to every node"):
        table.add_column(col)
    for r in results:
        table.add_row(str(r["nodes"]), r["mode"] + (f" ({r['regions']} regions)" if r["regions"] else ""),
                      f"{r['delta_bytes'] / 2**20:.2f} MiB", f"{r['hub_copies']:.2f}",
                      f"{r['leaf_copies_max']:.2f}" if r["regions"] else "—", f"{r['relay_copies_max']:.2f}" if r["relays"] else "—",
                      f"{r['to_all_s']:.3f} s")
    console.print(table)
    name = "fanout_links" if link else "fanout"
    plot(results, link, ROOT / "benchmarks" / "figures" / f"{name.replace('_', '-')}.png")
    write(name, {"changed_fraction": CHANGED, "elements": args.elements, "link_bytes_per_s": link,
                 "runs": results, "failed": failed})


if __name__ == "__main__":
    main()
