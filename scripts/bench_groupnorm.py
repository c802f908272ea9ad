#!/usr/bin/env python3
"""Benchmark GroupNorm -> SiLU (and GroupNorm alone) on the CPU: eager, Inductor and the fused
numba kernel of the ``group_norm_silu`` rule (``cpu_kernels/groupnorm.py``).

Shapes come from :data:`CONFIGS`: the resnet GroupNorms of Stable Diffusion 1.5's UNet at 512 px
(64x64 latents, batch 2 for classifier-free guidance, 32 groups, eps 1e-5).  For each config and
layout (``nchw``; ``nhwc`` = ``torch.channels_last``) and chain (``gn_silu``: ``F.silu(
F.group_norm(...))`` as ResnetBlock2D runs it; ``gn``: ``F.group_norm`` alone, as before a
transformer's ``proj_in``) it times, on the CPU, in ``--rounds`` rounds interleaved across the
implementations (load changes on a shared machine hit all of them alike), ``--calls`` calls per
round after ``--warmup`` warm-up calls; the reported time is the median of every timed call:

* ``eager``: the function above (``native_group_norm`` then ``silu``: two passes over memory
  plus the group norm's own two reads);
* ``inductor``: ``torch.compile`` (default Inductor) of the same function;
* ``kernel``: the numba kernel as a plan step runs it, into a fresh ``out`` per call (as
  eager's and Inductor's functions allocate theirs; ``kernel_prealloc``, shown as information,
  writes one preallocated ``out``, last written a round ago):
  ``GroupNormSiluCPU.run`` (the ``group_norm_silu`` fusion) for ``gn_silu``,
  ``GroupNormCPU.execute`` (the kernel of ``sd.group_norm.v1``, made by the rewrite
  ``group_norm``) for ``gn``.  The backend runs ``gn`` rows natively on the CPU (the rewrite
  ``group_norm`` runs on CUDA only: this kernel was level with ``native_group_norm``, 0.90-1.19x
  eager), so the CPU's GroupNorm alone is ``eager``; those rows are marked "not used by the
  backend" and left out of the goals (``nhwc``: the op's output is contiguous, so it times the
  fusion kernel's launcher without SiLU instead).

Achieved bandwidth: ``(bytes of x + bytes of out) / time`` (the minimum traffic).  Errors:
``max|impl - eager| / max|eager|``.  Ratios: eager / kernel and inductor / kernel (>1: the
kernel is faster), of the medians, and paired: each round's median call of one over the
other's, their median and 95% interval (``scripts/benchstats.py``).  Goals (float32), on the
rows the backend runs: the kernel faster than eager (interval above 1) and not slower than
Inductor (interval not below 1).

Run (from the repository root)::

    .venv/bin/python scripts/bench_groupnorm.py
    .venv/bin/python scripts/bench_groupnorm.py --configs sd15_down0 --layouts nchw --rounds 2

Raw numbers go to ``--json`` (default ``bench_results/bench_groupnorm.json``).
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
import torch.nn.functional as F
from benchstats import describe, goal_met, goal_word, verdict

#: name -> (N, C, H, W, groups, eps, where): SD1.5 UNet (block_out_channels 320/640/1280/1280,
#: norm_num_groups 32, resnet eps 1e-5), 512x512 images -> 64x64 latents, batch 2 (CFG)
CONFIGS = {
    "sd15_down0": (2, 320, 64, 64, 32, 1e-5, "SD1.5 down block 0 / up block 3 resnets"),
    "sd15_down1": (2, 640, 32, 32, 32, 1e-5, "SD1.5 down block 1 / up block 2 resnets"),
    "sd15_down2": (2, 1280, 16, 16, 32, 1e-5, "SD1.5 down block 2 / up block 1 resnets"),
}
LAYOUTS = ("nchw", "nhwc")
CHAINS = ("gn_silu", "gn")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--chains", default=",".join(CHAINS))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--calls", type=int, default=5, help="timed calls per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-inductor", action="store_true")
    p.add_argument("--json", default="bench_results/bench_groupnorm.json")
    return p.parse_args(argv)


def eager_fn(groups: int, eps: float, silu: bool):
    def fn(x, w, b):
        y = F.group_norm(x, groups, w, b, eps)
        return F.silu(y) if silu else y
    return fn


def bench_one(name, cfg, layout, chain, args, dtype) -> dict:
    from types import SimpleNamespace

    from fxbackend.cpu_kernels.groupnorm import GroupNormCPU, GroupNormSiluCPU, compile_kernels
    n, c, h, w_, groups, eps, where = cfg
    silu = chain == "gn_silu"
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(n, c, h, w_, generator=g) * 2 + 0.5).to(dtype)
    if layout == "nhwc":
        x = x.to(memory_format=torch.channels_last)
    w = torch.randn(c, generator=g) * 0.1 + 1
    b = torch.randn(c, generator=g) * 0.1
    out = torch.empty_like(x)
    eager = eager_fn(groups, eps, silu)
    impls = {"eager": lambda: eager(x, w, b)}
    res = {"config": name, "where": where, "layout": layout, "chain": chain,
           "shape": [n, c, h, w_], "groups": groups, "dtype": str(dtype).replace("torch.", ""),
           "errors": {}, "compile_s": {}, "ms": {}, "gbps": {}}
    if not args.no_inductor:
        torch._dynamo.reset()
        ind = torch.compile(eager, dynamic=False)
        t0 = time.perf_counter()
        ind(x, w, b)
        res["compile_s"]["inductor"] = time.perf_counter() - t0
        impls["inductor"] = lambda: ind(x, w, b)
    kern = GroupNormSiluCPU()
    t0 = time.perf_counter()
    compile_kernels(x.dtype, w.dtype, b.dtype)
    res["compile_s"]["kernel"] = time.perf_counter() - t0

    if chain == "gn" and layout == "nchw":
        op_kernel = GroupNormCPU()
        node = SimpleNamespace(params={"groups": groups, "eps": eps})  # what execute reads

        res["note"] = ("not used by the backend on the CPU (GroupNorm alone stays native; the "
                       "rewrite group_norm runs on CUDA)")

        def run_into(o):
            op_kernel.execute(None, node, None, [x, w, b], o, None)
            return o
    else:
        if chain == "gn":
            res["note"] = ("used by the backend for bf16/fp16 (sd.group_norm_channels_last.v1);"
                           " float32 channels-last GroupNorm alone stays native")

        def run_into(o):
            kern.run(x, w, b, o, groups=groups, eps=eps, silu=silu)
            return o
    impls["kernel"] = lambda: run_into(torch.empty_like(x))
    impls["kernel_prealloc"] = lambda: run_into(out)

    with torch.no_grad():
        want = eager(x, w, b).float()
        scale = want.abs().max().item()
        for k, f in impls.items():
            got = f().float()
            res["errors"][k] = (got - want).abs().max().item() / scale
        times = {k: [] for k in impls}
        for _ in range(args.rounds):
            for k, f in impls.items():
                for _ in range(args.warmup):
                    f()
                for _ in range(args.calls):
                    t0 = time.perf_counter()
                    f()
                    times[k].append(time.perf_counter() - t0)
    nbytes = 2 * x.numel() * x.element_size()
    for k, ts in times.items():
        med = statistics.median(ts)
        res["ms"][k] = med * 1e3
        res["gbps"][k] = nbytes / med / 1e9
    # each round's median call per implementation, for the paired verdicts (benchstats)
    per_round = {k: [statistics.median(ts[i:i + args.calls])
                     for i in range(0, len(ts), args.calls)] for k, ts in times.items()}
    res["verdict"] = {o: verdict(per_round, o, "kernel") for o in ("eager", "inductor")
                      if o in per_round}
    return res


def main(argv=None) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchstats import cpu_header
    print(cpu_header())
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    results = []
    print(f"threads={torch.get_num_threads()} dtype={args.dtype} rounds={args.rounds} "
          f"calls={args.calls}")
    hdr = (f"{'config':<11} {'layout':<5} {'chain':<8} {'impl':<9} {'ms':>8} {'GB/s':>7} "
           f"{'err':>9}")
    print(hdr)
    goals_met = True
    for name in args.configs.split(","):
        for layout in args.layouts.split(","):
            for chain in args.chains.split(","):
                r = bench_one(name, CONFIGS[name], layout, chain, args, dtype)
                results.append(r)
                for k in r["ms"]:
                    print(f"{name:<11} {layout:<5} {chain:<8} {k:<9} {r['ms'][k]:8.3f} "
                          f"{r['gbps'][k]:7.1f} {r['errors'][k]:9.2e}")
                ratios = {f"{k}/kernel": r["ms"][k] / r["ms"]["kernel"] for k in r["ms"]
                          if k != "kernel"}
                r["ratios"] = ratios
                v = r["verdict"]
                ok = goal_met(v["eager"], v.get("inductor"))
                if "note" not in r:  # rows the backend runs
                    goals_met &= ok
                print("    " + "  ".join(f"{k} {x:.2f}x" for k, x in ratios.items())
                      + "  paired: " + ", ".join(f"{o} {describe(x)}" for o, x in v.items())
                      + f"  (goal {goal_word(v['eager'], v.get('inductor'))})"
                      + (f"  [{r['note']}]" if "note" in r else ""))
    print(f"goals (kernel faster than eager: paired ratio's 95% interval above 1; not slower "
          f"than Inductor: not below 1) {'met' if goals_met else 'NOT met'} on every row the "
          f"backend runs")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"date": datetime.datetime.now().isoformat(), "host": platform.node(),
                   "torch": torch.__version__, "threads": torch.get_num_threads(),
                   "args": vars(args), "results": results}, f, indent=1)
    print(f"raw results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
