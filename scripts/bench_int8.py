#!/usr/bin/env python3
"""Benchmark INT8 W8A8 with ConvRot (``sd.linear_i8.v1``, ``patterns/int8.py``) on the CPU.

Sections (``--sections``; each a function ``bench_<name>(args) -> list of result dicts`` in
:data:`SECTIONS`, its rows printed by ``print_<name>``):

* ``kernels``: the linear layers of real configs (:data:`CONFIGS`: Flux.1 and SD3-medium
  projections at 1024x1024, rows capped at ``--rows``), float32 activations ``x [M, K]``, a
  weight quantized ahead of time (``quantize_weight_i8_reference``, ConvRot ``--group``) and a
  float32 bias.  Implementations, timed in ``--rounds`` rounds interleaved across them (load
  changes on a shared machine hit all alike), ``--calls`` calls per round after ``--warmup``
  (the timing loop is ``_time_impls`` of ``scripts/bench_rope.py``); the time is the median of
  every timed call:

  - ``eager``: ``F.linear(x, w, b)`` in float32 (the baseline);
  - ``kernel``: the registry kernel of ``sd.linear_i8.v1 {x_kind="float", w_kind="int8"}`` on
    the CPU (``linear_i8_cpu``), through ``prepare``/``execute`` as a plan step runs it, into a
    preallocated output and workspace: rotate + quantize x, ``torch._int_mm``, epilogue;
  - ``int_mm``: ``torch._int_mm`` alone on x already quantized (the GEMM the kernel calls);
  - ``quantize``: the kernel's first phase alone (rotate + quantize x into the packed layout).

  Reported: median ms, GOP/s (``2*M*N*K`` over the time; for ``quantize``, its share of the
  kernel's time), and the ratios eager / kernel and eager / int_mm (>1: faster than float32).
  The issue's goal for the quantized layers alone: at least 4x faster than float32 eager.

Run (from the repository root)::

    .venv/bin/python scripts/bench_int8.py
    .venv/bin/python scripts/bench_int8.py --configs flux_qkv sd3_qkv --rounds 3 --threads 1

Raw numbers go to ``--json`` (default ``bench_results/bench_int8.json``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import sys
import time

import torch

from bench_rope import _time_impls  # scripts/ is sys.path[0] when this script runs

#: name -> (K, N, model): a linear layer ``[M, K] @ [N, K].T`` of a real config (M: the tokens
#: of a 1024x1024 image, 4096, capped by ``--rows``)
CONFIGS = {
    "flux_qkv": (3072, 3072, "Flux.1 attention to_q/to_k/to_v (hidden 3072)"),
    "flux_ff_up": (3072, 12288, "Flux.1 feed-forward up (3072 -> 4 x 3072)"),
    "flux_ff_down": (12288, 3072, "Flux.1 feed-forward down (12288 -> 3072)"),
    "flux_single_out": (15360, 3072, "Flux.1 single-stream proj_out (3072 + 12288 -> 3072)"),
    "sd3_qkv": (1536, 1536, "SD3-medium attention to_q/to_k/to_v (hidden 1536)"),
    "sd3_ff_up": (1536, 6144, "SD3-medium feed-forward up (1536 -> 6144)"),
    "sd3_ff_down": (6144, 1536, "SD3-medium feed-forward down (6144 -> 1536)"),
}
TOKENS = 4096
KERNEL_IMPLS = ("eager", "kernel", "int_mm", "quantize")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sections", nargs="*", default=list(SECTIONS), choices=list(SECTIONS))
    p.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--rows", type=int, default=1024, help="rows M (tokens), at most 4096")
    p.add_argument("--group", type=int, default=256, help="ConvRot group (1 = no rotation)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=3, help="timed calls per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch (and numba) threads")
    p.add_argument("--json", default=os.path.join("bench_results", "bench_int8.json"))
    return p.parse_args(argv)


def _linear_step(x, wq, ws, b, group):
    """``run()`` of the registry kernel on one ``sd.linear_i8.v1`` node (a plan step's call),
    its output, and the kernel's name; the kernel compiled and prepared as a plan does."""
    import fxbackend
    from fxbackend import Graph, TensorMeta, registry

    g = Graph()
    srcs = [g.append(g.new_node("input", meta=TensorMeta.of(t), is_input=True))
            for t in (x, wq, ws, b)]
    node = fxbackend.op_create(g, "sd.linear_i8.v1", srcs,
                               {"x_kind": "float", "w_kind": "int8", "group": group,
                                "has_bias": True})
    kernel = registry.select_kernel("cpu", node)
    if kernel is registry.NATIVE:
        from fxbackend.cpu_kernels.int8 import linear_why_not
        sys.exit(f"no CPU kernel takes the node: {linear_why_not(node)}")
    kernel.compile(node)
    state, ws_bytes = kernel.prepare(node)
    workspace = torch.empty(ws_bytes, dtype=torch.uint8)
    out = torch.empty(node.meta.shape, dtype=torch.float32)
    ctx = fxbackend.ExecContext(torch.device("cpu"))
    inputs = [x, wq, ws, b]

    def run():
        kernel.execute(ctx, node, state, inputs, out, workspace)
        return out

    return run, out, kernel.name


def bench_kernels(args) -> list:
    """The ``kernels`` section (module docstring): one result dict per config."""
    from fxbackend.cpu_kernels.int8 import quantize_i8_convrot_cpu
    from fxbackend.patterns.int8 import (linear_i8_reference, packed_nbytes,
                                         quantize_i8_convrot_reference,
                                         quantize_weight_i8_reference, unpack)

    results = []
    m = min(args.rows, TOKENS)
    for name in args.configs:
        k, n, model = CONFIGS[name]
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(m, k, generator=gen)
        w = torch.randn(n, k, generator=gen) * k ** -0.5
        b = torch.randn(n, generator=gen) * 0.1
        wq, ws = quantize_weight_i8_reference(w, args.group)
        qx, _ = unpack(quantize_i8_convrot_reference(x, args.group), m, k)
        packed = torch.empty(packed_nbytes(m, k), dtype=torch.int8)
        t0 = time.perf_counter()
        run_kernel, out, kname = _linear_step(x, wq, ws, b, args.group)
        run_kernel()
        first_call = time.perf_counter() - t0
        want = linear_i8_reference(x, wq, ws, None, b, x_kind="float", w_kind="int8",
                                   group=args.group)
        res = {"config": name, "model": model, "M": m, "K": k, "N": n, "group": args.group,
               "kernel_impl": kname, "kernel_first_call_s": first_call,
               "bit_exact_to_reference": bool(torch.equal(out, want)),
               "rel_err_vs_float32": ((out - (x @ w.T + b)).abs().max() /
                                      (x @ w.T + b).abs().max()).item()}
        impls = {"eager": lambda: torch.nn.functional.linear(x, w, b),
                 "kernel": run_kernel,
                 "int_mm": lambda: torch._int_mm(qx, wq.t()),
                 "quantize": lambda: quantize_i8_convrot_cpu(x, args.group, packed)}
        _time_impls(res, impls, args, (x, wq, ws, b, out))
        med = res["median_ms"]
        ops = 2 * m * n * k
        res["gops"] = {impl: ops / (med[impl] * 1e-3) / 1e9 for impl in ("eager", "kernel",
                                                                            "int_mm")}
        res["speedup_int_mm_vs_eager"] = med["eager"] / med["int_mm"]
        res["quantize_share_of_kernel"] = med["quantize"] / med["kernel"]
        del res["times_s"]  # per-call lists: long; medians and minima stay
        results.append(res)
        print(f"done {name}: " + ", ".join(f"{i} {v:.2f} ms" for i, v in med.items()),
              file=sys.stderr)
    return results


def print_kernels(report, results) -> None:
    print(f"\nsd.linear_i8.v1 on the CPU (x float32 quantized in the step, w int8 ahead of "
          f"time, bias), {report['threads']} threads, torch {report['torch']}; median ms "
          f"(GOP/s)")
    head = f"{'config':16s} {'M x K x N':>18s} {'grp':>4s}"
    print(head + "".join(f"{i:>18s}" for i in KERNEL_IMPLS) +
          f"{'eager/kern':>11s}{'eager/imm':>10s}{'quant%':>7s}  exact  goal >= 4x")
    for r in results:
        cells = []
        for impl in KERNEL_IMPLS:
            ms = r["median_ms"][impl]
            cells.append(f"{ms:9.2f} ({r['gops'][impl]:5.0f})" if impl in r["gops"]
                         else f"{ms:9.2f}        ")
        se = r["speedup_vs_eager"]
        mkn = f"{r['M']} x {r['K']} x {r['N']}"
        print(f"{r['config']:16s} {mkn:>18s} {r['group']:4d}" +
              "".join(f"{c:>18s}" for c in cells) + f"{se:10.2f}x"
              f"{r['speedup_int_mm_vs_eager']:9.2f}x{100 * r['quantize_share_of_kernel']:6.0f}%"
              f"  {'yes' if r['bit_exact_to_reference'] else 'NO':5s}"
              f"  {'MET' if se >= 4 else 'not met'}")


#: section name -> (bench function, print function)
SECTIONS = {"kernels": (bench_kernels, print_kernels)}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": platform.platform(), "cpu_count": os.cpu_count(),
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "argv": sys.argv[1:], "sections": {}}
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    for section in args.sections:
        bench, _ = SECTIONS[section]
        report["sections"][section] = bench(args)
        out.write_text(json.dumps(report, indent=1))  # after each section: partial runs kept
    for section in args.sections:
        SECTIONS[section][1](report, report["sections"][section])
    print(f"raw numbers: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
