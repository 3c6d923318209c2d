"""Weight transfer end to end: publish -> fetch -> apply, keyframe vs delta, hub vs leaf mirror.

Starts the shipped ``jetstream/hub.conf`` + ``jetstream/leaf.conf`` on loopback (two real
nats-servers, JetStream domains ``hub`` and ``leaf``), mirrors the run's weights bucket and
announcements onto the leaf, and runs, side by side in one run:

* a trainer on the hub: a Qwen2 model built from a config (no download), fp32 master weights,
  real AdamW steps at ``--lr`` (1e-6 by default) on random tokens, published in bf16 by
  ``WeightPublisher`` (forced keyframes and deltas alternate);
* a RaaS node on the hub and one connected only to the leaf (reading the mirror), each with an
  ``hf`` engine, following with ``WeightSync`` (fetch, digest checks, apply in place).

Per version it times the publish (encode, put chunks, announce; retention runs in the
background) and, for each node, fetch + apply (until the engine holds the version, digests
checked). The leaf node goes first, right after the publish, so its figure includes the mirror
catching up. The read path is measured apart:
``get_object`` vs nats-py's ``ObjectStore.get`` on the same object, per chunk size, in MB/s.

    python benchmarks/bench_weight_transfer.py [--quick] [--preset 10m|25m|100m] [--reps 3]

The last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import nats
import torch
from rich.console import Console
from rich.table import Table

from astraflow.rollout.engines.hf import HFEngine
from astraflow.streams.objects import ensure_region_mirrors, get_object, object_stream, put_object
from astraflow.streams.plane import NatsOptions, Plane, Topology
from astraflow.streams.server import start_region_pair
from astraflow.weights.publish import WeightPublisher
from astraflow.weights.sync import WeightSync

CONF = Path(__file__).resolve().parent.parent / "jetstream"
PRESETS = {  # (hidden, layers, heads, kv_heads, intermediate, vocab)
    "tiny": (64, 2, 4, 2, 128, 1000),
    "10m": (256, 4, 4, 2, 1024, 16384),
    "25m": (384, 6, 6, 2, 1536, 32000),
    "100m": (768, 12, 12, 4, 2048, 32000),  # bench_delta.py's model
}


def build_model(preset: str, seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    h, layers, heads, kv, inter, vocab = PRESETS[preset]
    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                      intermediate_size=inter, vocab_size=vocab, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).float()


async def until_version(sync: WeightSync, version: int, timeout: float = 60.0) -> float:
    t0 = time.perf_counter()
    await sync.wait_for(version, timeout=timeout)
    return time.perf_counter() - t0


async def transfer(hub_url: str, leaf_url: str, preset: str, lr: float, reps: int) -> dict:
    """Median publish and per-node fetch+apply times for forced keyframes and deltas."""
    run = "bw" + uuid.uuid4().hex[:6]
    trainer_plane = await Plane.connect(NatsOptions(url=hub_url), run, "trainer")
    await trainer_plane.ensure_topology(Topology(policies=("solver",)))
    hub_plane = await Plane.connect(NatsOptions(url=hub_url), run, "raas-hub")
    leaf_plane = await Plane.connect(NatsOptions(url=leaf_url, domain="hub"), run, "raas-leaf")
    await leaf_plane.wait_for_domain("hub")
    streams = await ensure_region_mirrors(leaf_plane, run, hub_domain="hub")

    model = build_model(preset)
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(params.values(), lr=lr, weight_decay=0.01)
    vocab = PRESETS[preset][5]
    pub = WeightPublisher(trainer_plane, "solver", keyframe_every=10**9, keep_versions=4, mirror_domains=("leaf",))
    hub_node = WeightSync(hub_plane, "solver", HFEngine(build_model(preset, seed=1), None))
    leaf_node = WeightSync(leaf_plane, "solver", HFEngine(build_model(preset, seed=2), None), domain=streams.domain or "leaf")

    rows: dict[str, list[dict]] = {"keyframe": [], "delta": []}
    kinds = ["keyframe"] + ["delta", "keyframe"] * reps + ["delta"]  # v0 warms up; then alternate
    for version, kind in enumerate(kinds):
        if version:
            tokens = torch.randint(0, vocab, (2, 32))
            model(input_ids=tokens, labels=tokens).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        ann = await pub.publish(model.state_dict(), version, force_keyframe=kind == "keyframe")
        t_pub = time.perf_counter() - t0
        assert ann.encoding == kind, (version, ann.encoding, kind)
        t_leaf = await until_version(leaf_node, version)  # first: its time includes any mirror lag
        t_hub = await until_version(hub_node, version)
        assert hub_node.digest == leaf_node.digest == ann.state_digest
        if version:
            rows[kind].append({"bytes": ann.objects[0].size, "publish_s": t_pub, "hub_s": t_hub, "leaf_s": t_leaf})
    model_bytes = sum(t.numel() * 2 for t in model.state_dict().values())  # what travels (tied tensors twice)
    bad = {k: v for k, v in (hub_node.stats | leaf_node.stats).items() if k in ("fallbacks", "failures", "corrupt", "missing")}
    assert not any(bad.values()), bad
    for plane in (leaf_plane, hub_plane, trainer_plane):
        await plane.close()

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[kind])

    out = {"params": sum(p.numel() for p in model.parameters()), "model_bytes": model_bytes}
    for kind in rows:
        out[kind] = {k: med(kind, k) for k in ("bytes", "publish_s", "hub_s", "leaf_s")}
        out[kind]["e2e_hub_s"] = out[kind]["publish_s"] + out[kind]["hub_s"]
        out[kind]["e2e_leaf_s"] = out[kind]["publish_s"] + out[kind]["leaf_s"]
    return out


async def read_path(hub_url: str, leaf_url: str, size_mb: int, chunk_sizes: list[int]) -> list[dict]:
    """get_object (hub, leaf mirror) vs nats-py ObjectStore.get (hub only: it cannot read a mirror)."""
    run = "rp" + uuid.uuid4().hex[:6]
    hub = await Plane.connect(NatsOptions(url=hub_url), run, "w")
    await hub.ensure_topology(Topology(policies=("solver",)))
    leaf = await Plane.connect(NatsOptions(url=leaf_url, domain="hub"), run, "r")
    await leaf.wait_for_domain("hub")
    await ensure_region_mirrors(leaf, run, hub_domain="hub")
    # the object functions themselves, on plain nats-py connections (the chunk size is what is swept)
    hub_nc, leaf_nc = await nats.connect(hub_url), await nats.connect(leaf_url)
    hub_js, leaf_js = hub_nc.jetstream(timeout=30), leaf_nc.jetstream(domain="leaf", timeout=30)
    bucket = hub.names.object_bucket
    obs = await hub_js.object_store(bucket)
    data = os.urandom(size_mb << 20)
    out = []
    for cs in chunk_sizes:
        name = f"blob-{cs}"
        t0 = time.perf_counter()
        ref = await put_object(hub_js, bucket, name, data, cs)
        t_put = time.perf_counter() - t0
        times: dict[str, list[float]] = {"ours_hub": [], "ours_leaf": [], "natspy_hub": []}
        for _ in range(3):
            t0 = time.perf_counter()
            assert len(await get_object(hub_js, bucket, ref)) == len(data)
            times["ours_hub"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert len(await get_object(leaf_js, bucket, ref, stream=object_stream(bucket), wait_missing=30)) == len(data)
            times["ours_leaf"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert len((await obs.get(name)).data or b"") == len(data)
            times["natspy_hub"].append(time.perf_counter() - t0)
        row = {"chunk_mib": cs / (1 << 20), "put_mbps": size_mb / t_put}
        row.update({f"{k}_mbps": size_mb / min(v) for k, v in times.items()})
        out.append(row)
    for nc in (leaf_nc, hub_nc):
        await nc.close()
    await leaf.close()
    await hub.close()
    return out


def render(report: dict, console: Console) -> None:
    t = Table(title=f"publish -> fetch -> apply: {report['params'] / 1e6:.1f}M params ({report['model_bytes'] / 1e6:.0f} MB bf16), "
                    f"AdamW lr {report['lr']:g}, hub + leaf on loopback, median of {report['reps']}")
    for col in ("version", "payload", "publish", "fetch+apply hub", "fetch+apply leaf mirror", "end to end hub", "end to end leaf"):
        t.add_column(col, justify="right" if col != "version" else "left")
    for kind in ("keyframe", "delta"):
        r = report[kind]
        t.add_row(kind, f"{r['bytes'] / 1e6:.2f} MB", f"{r['publish_s'] * 1e3:.0f} ms", f"{r['hub_s'] * 1e3:.0f} ms",
                  f"{r['leaf_s'] * 1e3:.0f} ms", f"{r['e2e_hub_s'] * 1e3:.0f} ms", f"{r['e2e_leaf_s'] * 1e3:.0f} ms")
    k, d = report["keyframe"], report["delta"]
    t.add_row(
        "keyframe / delta",
        f"{k['bytes'] / d['bytes']:.1f}x",
        f"{k['publish_s'] / d['publish_s']:.1f}x",
        f"{k['hub_s'] / d['hub_s']:.1f}x",
        f"{k['leaf_s'] / d['leaf_s']:.1f}x",
        f"{k['e2e_hub_s'] / d['e2e_hub_s']:.1f}x",
        f"{k['e2e_leaf_s'] / d['e2e_leaf_s']:.1f}x",
    )
    console.print(t)
    r = Table(title=f"read path: one {report['read_mb']} MB object, best of 3, MB/s")
    for col in ("chunk", "put_object", "get_object hub", "get_object leaf mirror", "nats-py ObjectStore.get hub", "ours / nats-py"):
        r.add_column(col, justify="right")
    for row in report["read_path"]:
        r.add_row(f"{row['chunk_mib']:g} MiB", f"{row['put_mbps']:.0f}", f"{row['ours_hub_mbps']:.0f}", f"{row['ours_leaf_mbps']:.0f}",
                  f"{row['natspy_hub_mbps']:.0f}", f"{row['ours_hub_mbps'] / row['natspy_hub_mbps']:.2f}x")
    console.print(r)


async def main(args: argparse.Namespace) -> dict:
    preset = "tiny" if args.quick else args.preset
    reps = 1 if args.quick else args.reps
    read_mb = 8 if args.quick else args.read_mb
    chunks = [1 << 20] if args.quick else [1 << 20, 2 << 20, 4 << 20]
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        hub, leaf = start_region_pair(CONF, d)
        try:
            report = await transfer(hub.url, leaf.url, preset, args.lr, reps)
            report["read_path"] = await read_path(hub.url, leaf.url, read_mb, chunks)
        finally:
            leaf.stop()
            hub.stop()
    report |= {"preset": preset, "lr": args.lr, "reps": reps, "read_mb": read_mb, "threads": args.threads}
    render(report, Console())
    return report


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, one repetition, 8 MB read path")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="25m")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--reps", type=int, default=3, help="keyframe/delta pairs timed (medians reported)")
    ap.add_argument("--read-mb", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    print(json.dumps(asyncio.run(main(ap.parse_args()))))
