#!/usr/bin/env python3
"""Benchmark the adaLN ``modulation`` fusion on the CPU: eager, Inductor and the numba kernel.

The function timed is the chain as diffusers' ``AdaLayerNormZero`` writes it::

    F.layer_norm(x, (C,), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]

with ``scale``/``shift`` ``[B, C]`` chunks of one adaLN linear output (``[B, 6C]``) and x
``[B, T, C]``; shapes from :data:`CONFIGS` (real configs at 1024x1024: 4096 image tokens).
Implementations, timed in ``--rounds`` rounds interleaved across them (load changes on a shared
machine hit all alike), ``--calls`` calls per round after ``--warmup``; the reported time is the
median of every timed call:

* ``eager``: the function above;
* ``inductor``: ``torch.compile`` (default Inductor) of the same function (compiled first);
* ``kernel``: ``ModulationCPU.run`` as the fused plan step calls it (expanded scale/shift
  views, a preallocated ``out``);
* ``fxbackend``: ``torch.compile(backend="fxbackend")`` of the same function (the rule fires;
  includes the executor and a fresh output per call, as eager and Inductor allocate theirs).

Achieved bandwidth: ``(bytes of x read + out written + scale + shift) / time`` (the minimum
traffic).  Ratios: eager / kernel and inductor / kernel (>1: the kernel is faster).  Goals: the
fused kernel faster than eager and not slower than Inductor.

Run (from the repository root)::

    .venv/bin/python scripts/bench_modulation.py
    .venv/bin/python scripts/bench_modulation.py --configs flux_img --rounds 3 --dtype bfloat16
    .venv/bin/python scripts/bench_modulation.py --threads 1

Raw numbers go to ``--json`` (default ``bench_results/bench_modulation.json``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch

#: name -> (B, T, C, model): tokens and hidden size of the adaLN-modulated streams
CONFIGS = {
    "flux_img": (1, 4096, 3072, "Flux.1 image stream (24 heads x 128), 1024x1024"),
    "flux_txt": (1, 512, 3072, "Flux.1 text stream (T5 512 tokens)"),
    "sd3_img": (1, 4096, 1536, "SD3-medium image stream (24 heads x 64), 1024x1024"),
    "sd3_txt": (1, 333, 1536, "SD3-medium text stream (77 CLIP + 256 T5)"),
    "pixart": (1, 4096, 1152, "PixArt-Sigma 1024 (16 heads x 72)"),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch (and numba) threads")
    p.add_argument("--no-inductor", action="store_true")
    p.add_argument("--json", default=os.path.join("bench_results", "bench_modulation.json"))
    return p.parse_args(argv)


def eager_fn(x, emb):
    c = x.shape[-1]
    shift, scale = emb[:, :c], emb[:, c:2 * c]
    return torch.nn.functional.layer_norm(x, (c,), eps=1e-6) * (1 + scale[:, None]) + \
        shift[:, None]


def bench_config(name, args, dtype) -> dict:
    import fxbackend
    from fxbackend.cpu_kernels.modulation import ModulationCPU

    b, t, c, model = CONFIGS[name]
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(b, t, c, generator=g) * 2 + 0.5).to(dtype)
    emb = (torch.randn(b, 6 * c, generator=g) * 0.3).to(dtype)
    kernel = ModulationCPU()
    kernel.compile(*(fxbackend.TensorMeta.of(v) for v in (x, x, x, x)), "layer", True)
    out = torch.empty_like(x)
    s = emb[:, c:2 * c][:, None].expand(x.shape)
    h = emb[:, :c][:, None].expand(x.shape)

    def run_kernel(x, emb):
        kernel.run(x, s, h, out, norm="layer", eps=1e-6, add_c=1.0)
        return out

    impls = {"eager": eager_fn, "kernel": run_kernel}
    res = {"config": name, "model": model, "shape": [b, t, c], "dtype": str(dtype)}
    with torch.no_grad():
        if not args.no_inductor:
            t0 = time.perf_counter()
            ind = torch.compile(eager_fn)
            ind(x, emb)
            res["inductor_compile_s"] = time.perf_counter() - t0
            impls["inductor"] = ind
        fxbackend.reset_stats()
        fxb = torch.compile(eager_fn, backend="fxbackend")
        fxb(x, emb)
        res["fxbackend_fusions"] = dict(fxbackend.stats()["fusions_by_rule"])
        impls["fxbackend"] = fxb
        want = eager_fn(x, emb)
        res["kernel_max_rel_err"] = ((run_kernel(x, emb).float() - want.float()).abs().max()
                                     / want.float().abs().max()).item()
        times = {k: [] for k in impls}
        for _ in range(args.rounds):
            for k, fn in impls.items():
                for _ in range(args.warmup):
                    fn(x, emb)
                for _ in range(args.calls):
                    t0 = time.perf_counter()
                    fn(x, emb)
                    times[k].append(time.perf_counter() - t0)
    nbytes = (2 * x.numel() + 2 * b * c) * x.element_size()
    for k, ts in times.items():
        ms = statistics.median(ts) * 1e3
        res[k] = {"median_ms": ms, "gb_s": nbytes / ms / 1e6, "times_s": ts}
    return res


def main(argv=None) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchstats import cpu_header
    print(cpu_header())
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": platform.platform(), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "dtype": args.dtype, "results": []}
    for name in args.configs:
        report["results"].append(bench_config(name, args, dtype))
    print_table(report)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    print(f"raw numbers: {args.json}")
    return 0


def print_table(report) -> None:
    print(f"adaLN modulation, CPU {report['dtype']}, {report['threads']} threads, "
          f"torch {report['torch']}")
    impls = ["eager", "inductor", "kernel", "fxbackend"]
    print(f"{'config':10s} {'shape':>16s} " + " ".join(f"{k:>18s}" for k in impls) +
          "  eager/kern  ind/kern  goals")
    for r in report["results"]:
        cells = []
        for k in impls:
            v = r.get(k)
            cells.append(f"{v['median_ms']:8.3f}ms {v['gb_s']:5.1f}GB/s" if v else f"{'-':>18s}")
        e = r["eager"]["median_ms"] / r["kernel"]["median_ms"]
        i = r["inductor"]["median_ms"] / r["kernel"]["median_ms"] if "inductor" in r else None
        ok = e > 1 and (i is None or i >= 1)
        print(f"{r['config']:10s} {'x'.join(map(str, r['shape'])):>16s} " + " ".join(cells) +
              f"  {e:9.2f}x  " + (f"{i:7.2f}x" if i else "      -") +
              f"  {'met' if ok else 'NOT met'}  (fusions {r['fxbackend_fusions']}, "
              f"err {r['kernel_max_rel_err']:.1e})")


if __name__ == "__main__":
    sys.exit(main())
