#!/usr/bin/env python3
"""Benchmark the ``gated_residual`` fusion on the CPU: ``res + gate * linear(x)`` (adaLN-Zero's
gated residual, after the attention output projection and after the FF's last linear).

Shapes come from :data:`CONFIGS` (real model sizes at 1024x1024: Flux.1 4096 image + 512 text
tokens, hidden 3072; SD3-medium 4096 + 333 tokens, hidden 1536; PixArt-Sigma 4096 tokens,
hidden 1152).  The SD1.5 UNet has no gated residual (its transformer blocks are plain
layer-norm blocks), so it has no config here.  Two measurements per config, each the median over
``--rounds`` rounds interleaved across the implementations of each round's median call (load
changes on a shared machine hit all of them alike):

* ``epilogue`` (the part the fusion changes): the unfused chain after the GEMM, as eager runs
  it (``res + gate * y``; PixArt: ``res + gate * (y.clone() / 1.0)``, Flux/SD3 attention:
  ``y.clone()``) against Inductor on the same function and the numba kernel, twice: ``fused``
  returns a fresh output per call, as eager's and Inductor's functions do, ``fused_prealloc``
  writes one preallocated ``out``.  The two differ in cache state
  only: a fresh output reuses the block the allocator just freed, still in cache, while the
  preallocated one comes from memory each round (the fused step itself runs the kernel in place
  on the GEMM's output, which is in cache).
* ``chain``: the whole ``res + gate * F.linear(x, w, b)``: eager, Inductor, and fxbackend
  with fusion on and off (``torch.compile(backend="fxbackend")``): the GEMM dominates, so
  this shows how much of a block's linear the fusion saves end to end.

Achieved bandwidth of the epilogue: ``(y + residual read + out written) / time`` (the gate row
is negligible): the minimum traffic.  Ratios: eager / fused and inductor / fused (>1: the
fused step is faster), of the medians, and "paired": the median over rounds of each round's
inductor / fused, which cancels the load drifting between rounds (the GEMM of the chain, 90% of
its time, moves by several per cent between rounds here).  Goals: the fused step (the
epilogue with a fresh output, and the whole chain) faster than eager and not slower than
Inductor, judged on the paired ratios: their median with a distribution-free 95% interval
(:func:`median_ci`), "ahead" when it lies above 1, "behind" below, "level" when it contains 1
(a difference the rounds cannot tell from the machine's noise); the script prints the
verdicts.

Run (from the repository root)::

    .venv/bin/python scripts/bench_gated_residual.py
    .venv/bin/python scripts/bench_gated_residual.py --configs flux_single --rounds 3
    .venv/bin/python scripts/bench_gated_residual.py --no-chain --no-inductor

Raw numbers go to ``--json`` (default ``bench_results/bench_gated_residual.json``).
"""
from __future__ import annotations

import argparse
import sys
import datetime
import json
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from benchstats import describe, goal_word, paired_ratio, verdict

#: name -> (tokens, hidden, K of the linear, variant, model): variant "plain" is
#: ``res + gate * y`` (Flux/SD3 FF, Flux single-stream proj_out), "clone" adds the clone that
#: follows Flux's/SD3's attention output projection, "pixart" PixArt's clone + ``/ 1.0``
CONFIGS = {
    "flux_single": (4608, 3072, 15360, "plain", "Flux.1 single-stream proj_out (attn+mlp)"),
    "flux_attn": (4096, 3072, 3072, "clone", "Flux.1 double-stream image attention to_out"),
    "sd3_ff": (4096, 1536, 6144, "plain", "SD3-medium image FF"),
    "sd3_ctx_attn": (333, 1536, 1536, "clone", "SD3-medium text attention to_add_out"),
    "pixart_attn": (4096, 1152, 1152, "pixart", "PixArt-Sigma self-attention to_out"),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=3, help="timed calls per round (epilogue)")
    p.add_argument("--chain-configs", nargs="*", default=["sd3_ff", "pixart_attn"],
                   choices=list(CONFIGS), help="configs of the whole-chain measurement "
                   "(GEMMs of seconds on 2 cores: kept to the smaller ones by default)")
    p.add_argument("--no-chain", action="store_true")
    p.add_argument("--no-inductor", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default="bench_results/bench_gated_residual.json")
    return p.parse_args(argv)


def epilogue_fn(variant):
    if variant == "plain":
        return lambda y, gate, res: res + gate * y
    if variant == "clone":
        return lambda y, gate, res: res + gate * y.clone()
    return lambda y, gate, res: gate * (y.clone() / 1.0) + res


def chain_fn(variant, bias_after_gemm=False):
    """The whole chain ``ep(F.linear(x, w, b), gate, res)``; ``bias_after_gemm``: the linear as
    ``F.linear(x, w) + b`` (the fused step's meaning in float32)."""
    ep = epilogue_fn(variant)

    def fn(x, w, b, ada, res):
        gate = ada.chunk(6, dim=1)[2].unsqueeze(1)
        y = F.linear(x, w) + b if bias_after_gemm else F.linear(x, w, b)
        return ep(y, gate, res)
    return fn


def _median_ms(fn, args, rounds_out, calls):
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(*args)
        times.append((time.perf_counter() - t0) * 1e3)
    rounds_out.append(statistics.median(times))


def _interleave(impls: dict, args: dict, rounds: int, calls: int) -> tuple[dict, dict]:
    """``(median ms per implementation, {implementation: [median ms of each round]})``."""
    times = {k: [] for k in impls}
    for fn_name, fn in impls.items():  # warm-up (and compile) every implementation once
        fn(*args[fn_name])
    for _ in range(rounds):
        for k, fn in impls.items():
            _median_ms(fn, args[k], times[k], calls)
    return {k: statistics.median(v) for k, v in times.items()}, times


def bench_epilogue(name, args):
    from fxbackend.cpu_kernels import gated_residual as gr
    from fxbackend.patterns.gated_residual import exact_scale
    s, c, _, variant, model = CONFIGS[name]
    g = torch.Generator().manual_seed(0)
    y = torch.randn(1, s, c, generator=g)
    gate = torch.randn(1, 6 * c, generator=g)[:, 2 * c:3 * c].unsqueeze(1)
    res = torch.randn(1, s, c, generator=g)
    out = torch.empty_like(y)
    # the scale as the rule hands it to the kernel (PixArt's "/ 1.0" made exact and cheaper)
    scale = exact_scale(*(("div", 1.0) if variant == "pixart" else (None, None)))
    gr.compile_kernels(torch.float32)
    ep = epilogue_fn(variant)
    impls = {"eager": ep,
             "fused": lambda y, gate, res: gr.gated_residual_cpu(
                 y, gate, res, torch.empty_like(y), scale_op=scale[0], scale=scale[1]),
             "fused_prealloc": lambda y, gate, res: gr.gated_residual_cpu(
                 y, gate, res, out, scale_op=scale[0], scale=scale[1])}
    if not args.no_inductor:
        impls["inductor"] = torch.compile(ep)
    t0 = time.perf_counter()
    want = ep(y, gate, res)
    if "inductor" in impls:
        impls["inductor"](y, gate, res)
    compile_s = time.perf_counter() - t0
    assert torch.equal(impls["fused"](y, gate, res), want), "fused epilogue differs from eager"
    impls["fused_prealloc"](y, gate, res)
    assert torch.equal(out, want), "fused epilogue differs from eager"
    ms, per_round = _interleave(impls, {k: (y, gate, res) for k in impls}, args.rounds,
                                args.calls)
    nbytes = 3 * y.numel() * 4
    return {"config": name, "model": model, "tokens": s, "hidden": c, "variant": variant,
            "ms": ms, "gbps": {k: nbytes / v / 1e6 for k, v in ms.items()},
            "paired": {"inductor/fused": paired_ratio(per_round, "inductor", "fused"),
                       "inductor/fused_prealloc": paired_ratio(per_round, "inductor",
                                                               "fused_prealloc")},
            "verdict": {"inductor/fused": verdict(per_round, "inductor", "fused"),
                        "eager/fused": verdict(per_round, "eager", "fused")},
            "rounds_ms": per_round, "inductor_compile_s": compile_s}


def bench_chain(name, args):
    import fxbackend
    import fxbackend.cpu_kernels.gated_residual  # noqa: F401  (registers the rule)
    s, c, k, variant, model = CONFIGS[name]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, s, k, generator=g)
    w = torch.randn(c, k, generator=g) * k ** -0.5
    b = torch.randn(c, generator=g) * 0.1
    ada = torch.randn(1, 6 * c, generator=g)
    res = torch.randn(1, s, c, generator=g)
    fn = chain_fn(variant)
    torch._dynamo.reset()
    impls = {"eager": fn,
             "fxb_fused": torch.compile(fn, backend="fxbackend"),
             "fxb_unfused": torch.compile(fn, backend="fxbackend", options={"fusion": False})}
    if not args.no_inductor:
        impls["inductor"] = torch.compile(fn)
    a = (x, w, b, ada, res)
    want = fn(*a)
    fxbackend.reset_stats()
    got = impls["fxb_fused"](*a)
    fires = fxbackend.stats()["fusions_by_rule"].get("gated_residual", 0)
    # the fused step runs the float32 addmm as mm and adds the bias in the epilogue: exactly
    # that chain, and eager's (the BLAS adds its products to the bias) within float32 rounding
    moved = chain_fn(variant, bias_after_gemm=True)(*a)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert fires == 1 and torch.equal(got, moved) and err < 1e-5, (fires, err)
    ms, per_round = _interleave(impls, {k: a for k in impls}, args.rounds, 1)
    return {"config": name, "model": model, "tokens": s, "hidden": c, "k": k,
            "variant": variant, "ms": ms, "gflops": 2 * s * c * k / 1e9, "max_rel_err": err,
            "paired": {"inductor/fxb_fused": paired_ratio(per_round, "inductor", "fxb_fused")},
            "verdict": {"inductor/fxb_fused": verdict(per_round, "inductor", "fxb_fused"),
                        "eager/fxb_fused": verdict(per_round, "eager", "fxb_fused")},
            "rounds_ms": per_round}


def main(argv=None):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchstats import cpu_header
    print(cpu_header())
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = {"date": datetime.datetime.now().isoformat(), "torch": torch.__version__,
              "machine": platform.machine(), "threads": torch.get_num_threads(),
              "epilogue": [], "chain": []}
    print(f"CPU float32, {torch.get_num_threads()} threads, median ms over {args.rounds} "
          f"interleaved rounds")
    print(f"{'epilogue':14s} {'tokens':>6s} {'C':>5s} {'eager':>8s} {'inductor':>9s} "
          f"{'fused':>8s} {'GB/s e/i/f':>18s} {'eager/f':>8s} {'ind/f':>6s} "
          f"{'prealloc':>9s} {'ind/pre':>8s} {'paired ind/f, ind/pre':>22s}")
    goals = []
    for name in args.configs:
        r = bench_epilogue(name, args)
        report["epilogue"].append(r)
        ms, gb = r["ms"], r["gbps"]
        ind = ms.get("inductor", float("nan"))
        print(f"{name:14s} {r['tokens']:6d} {r['hidden']:5d} {ms['eager']:8.2f} {ind:9.2f} "
              f"{ms['fused']:8.2f} {gb['eager']:5.1f}/{gb.get('inductor', float('nan')):5.1f}/"
              f"{gb['fused']:5.1f} {ms['eager'] / ms['fused']:8.2f} {ind / ms['fused']:6.2f} "
              f"{ms['fused_prealloc']:9.2f} {ind / ms['fused_prealloc']:8.2f} "
              f"{r['paired']['inductor/fused']:11.3f} "
              f"{r['paired']['inductor/fused_prealloc']:10.3f}")
        goals.append(("epilogue", name, r["verdict"]["eager/fused"],
                      r["verdict"]["inductor/fused"]))
    if not args.no_chain:
        print(f"\n{'chain':14s} {'GFLOP':>6s} {'eager':>9s} {'inductor':>9s} {'fxb unf.':>9s} "
              f"{'fxb fused':>9s} {'eager/f':>8s} {'unf./f':>7s} {'ind/f':>6s} "
              f"{'paired ind/f':>13s} {'max rel err':>12s}")
        for name in args.chain_configs:
            r = bench_chain(name, args)
            report["chain"].append(r)
            ms = r["ms"]
            print(f"{name:14s} {r['gflops']:6.1f} {ms['eager']:9.1f} "
                  f"{ms.get('inductor', float('nan')):9.1f} {ms['fxb_unfused']:9.1f} "
                  f"{ms['fxb_fused']:9.1f} {ms['eager'] / ms['fxb_fused']:8.3f} "
                  f"{ms['fxb_unfused'] / ms['fxb_fused']:7.3f} "
                  f"{ms.get('inductor', float('nan')) / ms['fxb_fused']:6.3f} "
                  f"{r['paired']['inductor/fxb_fused']:13.3f} {r['max_rel_err']:12.1e}")
            goals.append(("chain", name, r["verdict"]["eager/fxb_fused"],
                          r["verdict"]["inductor/fxb_fused"]))
    print("\ngoals: the fused step faster than eager, not slower than Inductor. Per-round "
          "ratios (other's time / fused),\ntheir median and its 95% interval: ahead (interval "
          "above 1), level (contains 1), behind (below 1).\nEpilogue: the fresh-output column "
          "(what eager's and Inductor's functions return; the preallocated one is cold-cache\n"
          "information, not the step's case: the step runs the epilogue in place on the GEMM's "
          "output)")
    for part, name, ve, vi in goals:
        print(f"  {part:8s} {name:14s} eager: {describe(ve)}   inductor: {describe(vi)}   "
              f"{goal_word(ve, vi)}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    print(f"raw numbers: {args.json}")


if __name__ == "__main__":
    main()
