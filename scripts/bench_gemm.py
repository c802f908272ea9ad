#!/usr/bin/env python3
"""Benchmark the float32 linears of the small test models on the CPU: ``torch.addmm`` (MKL on
x86-64 builds) against oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``), the two
``float32_gemm`` choices of the CPU profile (``fxbackend/cpu.py``).

The shapes are the ``aten.addmm`` / ``aten.mm`` calls of one eager forward of each selected
model (``--families``, ``--size``, default ``small``, its first resolution), with how often each occurs.  Per
shape three implementations, each writing a ``[M, N]`` output:

* ``addmm``: ``torch.addmm(b, x, w.t(), out=y)``, as fxbackend's native step runs it;
* ``onednn+copy``: oneDNN's linear, its new result copied into ``y``, as the
  ``addmm_onednn_cpu`` kernel (``cpu_kernels/gemm.py``) runs it;
* ``onednn``: oneDNN's linear alone (what the copy costs).

Each of ``--rounds`` rounds times every shape once per implementation, in an order rotated each
round, the best of ``--calls`` back-to-back calls; a model's time per round is the sum over its
shapes of time times count (a forward's linears).  Ratios are paired (the median over rounds of
each round's ratio, with its 95% interval: ``scripts/benchstats.verdict``): ``addmm`` over
``onednn+copy`` above 1 means the kernel the profile may choose is faster.  The first lines
printed are the CPU profile and its decisions.

Run (from the repository root)::

    .venv/bin/python scripts/bench_gemm.py
    .venv/bin/python scripts/bench_gemm.py --families sd3 --rounds 12 --per-shape
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchstats import cpu_header, verdict  # noqa: E402

import fxbackend  # noqa: E402,F401  (the profile)
from fxbackend.cpu import onednn_float32_linear, onednn_float32_linear_available  # noqa: E402
from fxbackend.models import build_model, make_inputs  # noqa: E402

IMPLS = ("addmm", "onednn+copy", "onednn")


class _Shapes(TorchDispatchMode):
    """Counts the ``(M, K, N, has bias)`` of every float32 addmm/mm of a transposed weight."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default):
            bias = func is torch.ops.aten.addmm.default
            x, w = (args[1], args[2]) if bias else (args[0], args[1])
            if x.dtype == torch.float32 and w.t().is_contiguous():
                self.counts[(x.shape[0], x.shape[1], w.shape[1], bias)] += 1
        return func(*args, **(kwargs or {}))


def model_shapes(family: str, size: str = "small") -> collections.Counter:
    """The float32 linear shapes of one eager forward of ``(family, size)``."""
    model, inputs = build_model(family, size), make_inputs(family, size)
    mode = _Shapes()
    with torch.no_grad(), mode:
        model(**inputs)
    return mode.counts


def implementations(m: int, k: int, n: int, bias: bool) -> dict:
    """The three calls (module docstring) on random operands of one shape."""
    g = torch.Generator().manual_seed(m * 7 + k * 3 + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    y = torch.empty(m, n)
    if bias:
        def addmm():
            torch.addmm(b, x, w.t(), out=y)
    else:
        def addmm():
            torch.mm(x, w.t(), out=y)
    return {"addmm": addmm,
            "onednn+copy": lambda: y.copy_(onednn_float32_linear(x, w, b)),
            "onednn": lambda: onednn_float32_linear(x, w, b)}


def best_of(fn, calls: int) -> float:
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default="flux,sd3", help="comma-separated model families")
    p.add_argument("--size", default="small", help="model size (small, tiny)")
    p.add_argument("--rounds", type=int, default=8, help="interleaved rounds (6 or more for an "
                                                          "interval)")
    p.add_argument("--calls", type=int, default=3, help="back-to-back calls per timing (best)")
    p.add_argument("--per-shape", action="store_true", help="also print every shape's medians")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.calls < 1:
        p.error("--rounds and --calls must be at least 1")
    print(cpu_header())
    print(f"bench_gemm: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds, best of {args.calls} calls")
    if not onednn_float32_linear_available():
        print("this torch has no oneDNN float32 linear: nothing to compare")
        return 1
    for family in args.families.split(","):
        shapes = model_shapes(family, args.size)
        calls = {s: implementations(*s) for s in shapes}
        for fns in calls.values():  # one warm-up call each
            for fn in fns.values():
                fn()
        per_round = {i: [] for i in IMPLS}
        per_shape = {s: {i: [] for i in IMPLS} for s in shapes}
        for r in range(args.rounds):
            order = IMPLS[r % 3:] + IMPLS[:r % 3]
            total = dict.fromkeys(IMPLS, 0.0)
            for s, fns in calls.items():
                for i in order:
                    t = best_of(fns[i], args.calls)
                    per_shape[s][i].append(t)
                    total[i] += t * shapes[s]
            for i in IMPLS:
                per_round[i].append(total[i] * 1e3)
        macs = sum(m * k * n * c for (m, k, n, _), c in shapes.items())
        med = {i: sorted(v)[len(v) // 2] for i, v in per_round.items()}
        print(f"[{family}/{args.size}] {sum(shapes.values())} linears, {len(shapes)} shapes, "
              f"{macs / 1e9:.2f} G multiply-adds; ms per forward (median): " +
              ", ".join(f"{i} {med[i]:.1f}" for i in IMPLS))
        for num, den in (("addmm", "onednn+copy"), ("onednn", "onednn+copy")):
            word, ratio, lo, hi = verdict(per_round, num, den)
            print(f"[{family}/{args.size}] {num} / {den}: {word} {ratio:.3f} [{lo:.3f}, {hi:.3f}]")
        if args.per_shape:
            for (m, k, n, bias), c in sorted(shapes.items(), key=lambda kv: -kv[0][0] * kv[0][1]
                                             * kv[0][2] * kv[1]):
                t = {i: sorted(v)[len(v) // 2] * 1e3 for i, v in per_shape[(m, k, n, bias)].items()}
                print(f"  [{m}, {k}] x [{k}, {n}]{' + bias' if bias else ''} x{c}: " +
                      ", ".join(f"{i} {t[i]:.3f} ms" for i in IMPLS) +
                      f"; addmm / onednn+copy {t['addmm'] / t['onednn+copy']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
