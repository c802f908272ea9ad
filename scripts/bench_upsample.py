#!/usr/bin/env python3
"""Benchmark the ``index_upsample`` rewrite on the CPU: nearest 2x upsampling, eager, Inductor,
and fxbackend with the rule and without it.

The function timed is diffusers' ``Upsample2D`` without its convolution::

    F.interpolate(x, scale_factor=2.0, mode="nearest")

with x float32 NCHW of the shapes in :data:`CONFIGS` (the small UNet of ``fxbackend.models``
and SD1.5's decoder at 512x512, batch 2 for classifier-free guidance), and one 5-D video
latent (``NCDHW``: ``upsample_nearest3d``, every dim doubled).  Implementations,
interleaved in ``--rounds`` rounds (a shared machine's load hits all alike), median ms:

* ``eager``: the function (ATen's ``upsample_nearest2d`` kernel);
* ``inductor``: ``torch.compile`` of it (default Inductor: one generated loop);
* ``fxbackend``: ``torch.compile(backend="fxbackend")``: the gather ATen's decomposition gives
  (``_unsafe_index``) rewritten as two broadcast copies;
* ``fxbackend_gather``: the same with ``options={"disable_rewrites": "index_upsample"}`` (the
  gather as ATen runs it).

Every implementation returns a fresh tensor per call.  Results are checked bit-identical to
eager.  Ratios: eager / fxbackend and inductor / fxbackend (>1: fxbackend is faster); GB/s
counts x read once and the output written once.

Run (from the repository root)::

    .venv/bin/python scripts/bench_upsample.py --threads 1
"""
from __future__ import annotations

import argparse
import sys
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

import fxbackend

#: (name, x shape)
CONFIGS = [
    ("unet_small_20", (1, 256, 20, 20)),
    ("unet_small_10", (1, 256, 10, 10)),
    ("sd15_8", (2, 1280, 8, 8)),
    ("sd15_16", (2, 1280, 16, 16)),
    ("sd15_32", (2, 640, 32, 32)),
    ("video_3d", (1, 128, 4, 16, 16)),  # a 5-D (frames, height, width) latent: all three 2x
]


def upsample(x):
    return F.interpolate(x, scale_factor=2.0, mode="nearest")


def upsample_gather(x):
    """:func:`upsample` again, a code object of its own (Dynamo keeps each code object's
    compiled entries, and their count, apart)."""
    return F.interpolate(x, scale_factor=2.0, mode="nearest")


def bench(name, shape, rounds):
    torch._dynamo.reset()  # each config compiles afresh (no recompile limit across configs)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    want = upsample(x)
    impls = {"eager": upsample, "inductor": torch.compile(upsample, dynamic=False)}
    fxbackend.reset_stats()
    on = torch.compile(upsample, backend="fxbackend", dynamic=False)
    assert torch.equal(on(x), want)
    fired = fxbackend.stats()["rewrites_by_rule"].get("index_upsample", 0)
    off = torch.compile(upsample_gather, backend="fxbackend", dynamic=False,
                        options={"disable_rewrites": "index_upsample"})
    assert torch.equal(off(x), want)
    impls["fxbackend"], impls["fxbackend_gather"] = on, off
    for f in impls.values():
        assert torch.equal(f(x), want)
    times = {k: [] for k in impls}
    for _ in range(rounds):
        for k, f in impls.items():
            t0 = time.perf_counter()
            f(x)
            times[k].append((time.perf_counter() - t0) * 1e3)
    ms = {k: statistics.median(v) for k, v in times.items()}
    nbytes = (x.numel() + want.numel()) * x.element_size()
    return {"config": name, "shape": list(shape), "ms": ms, "rule_fired": fired,
            "gbps": {k: nbytes / v / 1e6 for k, v in ms.items()}}


def main(argv=None):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchstats import cpu_header
    print(cpu_header())
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="*", default=[c[0] for c in CONFIGS],
                   choices=[c[0] for c in CONFIGS])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default="bench_results/bench_upsample.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"CPU float32, {torch.get_num_threads()} threads, median ms over {args.rounds} "
          f"interleaved rounds")
    print(f"{'config':14s} {'x':>18s} {'eager':>8s} {'inductor':>9s} {'fxb':>8s} "
          f"{'fxb gather':>10s} {'GB/s fxb':>9s} {'eager/fxb':>10s} {'ind/fxb':>8s} "
          f"{'gather/fxb':>11s}")
    rows = []
    for name, shape in CONFIGS:
        if name not in args.configs:
            continue
        r = bench(name, shape, args.rounds)
        rows.append(r)
        ms = r["ms"]
        print(f"{name:14s} {str(tuple(shape)):>18s} {ms['eager']:8.3f} {ms['inductor']:9.3f} "
              f"{ms['fxbackend']:8.3f} {ms['fxbackend_gather']:10.3f} "
              f"{r['gbps']['fxbackend']:9.1f} {ms['eager'] / ms['fxbackend']:10.2f} "
              f"{ms['inductor'] / ms['fxbackend']:8.2f} "
              f"{ms['fxbackend_gather'] / ms['fxbackend']:11.2f}"
              + ("" if r["rule_fired"] == 1 else "  (rule did not fire)"))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"threads": torch.get_num_threads(), "rows": rows}, f, indent=1)
    print(f"raw numbers: {args.json}")


if __name__ == "__main__":
    main()
