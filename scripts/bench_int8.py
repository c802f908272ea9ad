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

* ``engines``: the CPU's int8 GEMM paths alone (``torch._int_mm``, oneDNN's and fbgemm's
  prepacked quantized linear, each with its own per-call passes) against float32 ``F.linear``
  at small Flux's shapes and one Flux.1 projection, and whether each is exact here: what the
  ``int8_gemm`` decision chooses between (``bench_engines``).
* ``accuracy``: for each of ``--models`` (default small Flux and SD3, random weights), the
  cosine similarity to the float32 output of the model compiled with ``options={"quantize":
  "w8a8"}``, without rotation (``convrot_group`` 1) and with ConvRot (``--group``; each layer
  the largest group dividing its K), three ways: no injected outliers; ``activations``:
  ``--outlier-frac`` of every linear's input channels multiplied by ``--outlier-alpha`` (a
  forward pre-hook, traced into the graph); ``compensated``: the same, with those weight columns
  divided by the factor (the float function unchanged, the weight columns small: harder).  The
  issue's goal: ConvRot at least 0.995 on small Flux.
* ``models``: whole models, steady state, interleaved rounds: float32 eager, bfloat16 eager,
  fxbackend float32, fxbackend W8A8 (ConvRot ``--group``), fxbackend W8A8 with attention in
  bfloat16 (``attention_dtype``, a separate accuracy trade-off, reported beside the goal, not
  as it), fxbackend on the bfloat16 model without and with W8A8 (``fxb_bf16``,
  ``fxb_w8a8_bf16_model``: everything but the quantized linears in bfloat16, as bfloat16 eager
  runs it), and torchao's int8 dynamic quantization under Inductor when torchao imports (else
  the reason is printed).  Goals: W8A8 at least 1.5x float32 eager and faster than bfloat16
  eager (printed for the float32 model and for the bfloat16 model).

Run (from the repository root)::

    .venv/bin/python scripts/bench_int8.py
    .venv/bin/python scripts/bench_int8.py --configs flux_qkv sd3_qkv --rounds 3 --threads 1
    .venv/bin/python scripts/bench_int8.py --sections accuracy models
    .venv/bin/python scripts/bench_int8.py --sections engines --rounds 7
    # torchao, outside the project's environment:
    #   .venv/bin/pip install --target /some/dir --no-deps torchao; PYTHONPATH=/some/dir ...

Raw numbers go to ``--json`` (default ``bench_results/bench_int8.json``).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import torch

from bench_rope import _time_impls, report_header  # scripts/ is sys.path[0] when this script runs

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
    p.add_argument("--models", nargs="*", default=["flux/small", "sd3/small"],
                   help="models of the accuracy and models sections (family/size)")
    p.add_argument("--outlier-frac", type=float, default=0.01,
                   help="fraction of each linear's input channels made outliers")
    p.add_argument("--outlier-alpha", type=float, default=50.0, help="their factor")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-torchao", action="store_true", help="skip torchao's int8 + Inductor")
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


# -- accuracy: W8A8 with and without ConvRot, activations with outlier channels -----------------

def _first(out):
    while isinstance(out, (tuple, list)):
        out = out[0]
    return out


def inject_outliers(model, frac: float, alpha: float, seed: int, compensate: bool) -> int:
    """Give the inputs of every ``nn.Linear`` outlier channels (activation outliers of real
    diffusion transformers concentrate in a few channels): a forward pre-hook multiplies
    ``frac`` of the input channels (at least 2) by ``alpha``.  Dynamo traces the hooks, so the
    compiled graph multiplies too and the quantizer sees the outliers; the float32 reference is
    the same (hooked) model.  ``compensate``: also divide those weight columns by ``alpha``, so
    the float function stays the original one; a harder case, since those weight columns then
    become small against each output channel's largest weight.  Returns the layers changed."""
    g = torch.Generator().manual_seed(seed)
    n = 0
    for mod in model.modules():
        if not isinstance(mod, torch.nn.Linear) or mod.in_features < 8:
            continue
        k = mod.in_features
        chans = torch.randperm(k, generator=g)[:max(2, int(frac * k))]
        scale = torch.ones(k)
        scale[chans] = alpha
        if compensate:
            with torch.no_grad():
                mod.weight[:, chans] /= alpha
        mod.register_buffer("_outlier_scale", scale, persistent=False)
        mod.register_forward_pre_hook(lambda m, a: (a[0] * m._outlier_scale,) + tuple(a[1:]))
        n += 1
    return n


def _cosine(a, b) -> float:
    a, b = _first(a).double().flatten(), _first(b).double().flatten()
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


def bench_accuracy(args) -> list:
    """Cosine similarity to the float32 output of W8A8 (fxbackend ``quantize`` option) without
    rotation (group 1) and with ConvRot (``--group``, each layer the largest group dividing its
    K), on models with outlier channels injected (and, for reference, without)."""
    from fxbackend import models
    results = []
    for fam, size in [tuple(m.split("/")) for m in args.models]:
        for outliers in ("none", "activations", "compensated"):
            model = models.build_model(fam, size, seed=args.seed)
            layers = 0 if outliers == "none" else inject_outliers(
                model, args.outlier_frac, args.outlier_alpha, args.seed,
                compensate=outliers == "compensated")
            inputs = models.make_inputs(fam, size, seed=args.seed)
            row = {"model": f"{fam}/{size}", "outliers": outliers, "layers_with_outliers": layers}
            with torch.no_grad():
                ref = models.run_eager(model, inputs)
                for label, group in (("no_rotation", 1), ("convrot", args.group)):
                    torch._dynamo.reset()
                    fn = torch.compile(model, backend="fxbackend",
                                       options={"quantize": "w8a8", "convrot_group": group})
                    row[label] = _cosine(models.run_eager(fn, inputs), ref)
            results.append(row)
            print(f"[accuracy] {row}", flush=True)
    return results


def print_accuracy(report, results) -> None:
    print(f"\nW8A8 accuracy: cosine similarity to float32.  Outliers: {ARGS_OUTLIERS[0]} of the "
          f"input channels of every linear x {ARGS_OUTLIERS[1]}; 'activations': the inputs "
          f"only, 'compensated': those weight columns / {ARGS_OUTLIERS[1]} too (float function "
          f"unchanged)")
    print(f"{'model':12s} {'outliers':>12s} {'no rotation':>12s} {'ConvRot':>9s}")
    for r in results:
        print(f"{r['model']:12s} {r['outliers']:>12s} {r['no_rotation']:12.6f} "
              f"{r['convrot']:9.6f}")
    for r in results:
        if r["model"] == "flux/small" and r["outliers"] != "none":
            print(f"goal: ConvRot >= 0.995 on small Flux, {r['outliers']} outliers: "
                  f"{'met' if r['convrot'] >= 0.995 else 'MISSED'} ({r['convrot']:.6f})")


# -- whole models: float32 / bfloat16 eager, fxbackend float32 and W8A8, torchao ----------------

def _torchao_int8(model):
    """torchao's int8 dynamic-activation int8-weight quantization under Inductor, or the reason
    it is unavailable."""
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    except Exception as exc:  # not installed here: reported, not fatal
        return None, f"torchao not available ({type(exc).__name__}: {exc})"
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    return torch.compile(model), None


def _interleaved_ms(impls: dict, rounds: int, calls: int) -> dict:
    """Median ms of each implementation over ``rounds`` rounds of ``calls`` calls each, the
    implementations taking turns within every round."""
    import statistics
    times = {k: [] for k in impls}
    for _ in range(rounds):
        for k, fn in impls.items():
            for _ in range(calls):
                t0 = time.perf_counter()
                fn()
                times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_models(args) -> list:
    """Steady-state ms of whole models, implementations interleaved in rounds."""
    from fxbackend import models
    results = []
    for fam, size in [tuple(m.split("/")) for m in args.models]:
        inputs = models.make_inputs(fam, size, seed=args.seed)
        inputs16 = models.make_inputs(fam, size, seed=args.seed, dtype=torch.bfloat16)
        impls, notes = {}, {}
        torch._dynamo.reset()
        with torch.no_grad():
            eager = models.build_model(fam, size, seed=args.seed)
            impls["eager_f32"] = lambda m=eager: models.run_eager(m, inputs)
            eager16 = models.build_model(fam, size, seed=args.seed, dtype=torch.bfloat16)
            impls["eager_bf16"] = lambda m=eager16: models.run_eager(m, inputs16)
            fxb = torch.compile(models.build_model(fam, size, seed=args.seed),
                                backend="fxbackend")
            impls["fxb_f32"] = lambda m=fxb: models.run_eager(m, inputs)
            q = torch.compile(models.build_model(fam, size, seed=args.seed), backend="fxbackend",
                              options={"quantize": "w8a8", "convrot_group": args.group})
            impls["fxb_w8a8"] = lambda m=q: models.run_eager(m, inputs)
            qa = torch.compile(models.build_model(fam, size, seed=args.seed), backend="fxbackend",
                               options={"quantize": "w8a8", "convrot_group": args.group,
                                        "attention_dtype": "bfloat16"})
            impls["fxb_w8a8_bf16_attention"] = lambda m=qa: models.run_eager(m, inputs)
            f16 = torch.compile(models.build_model(fam, size, seed=args.seed,
                                                   dtype=torch.bfloat16), backend="fxbackend")
            impls["fxb_bf16"] = lambda m=f16: models.run_eager(m, inputs16)
            q16 = torch.compile(models.build_model(fam, size, seed=args.seed,
                                                   dtype=torch.bfloat16), backend="fxbackend",
                                options={"quantize": "w8a8", "convrot_group": args.group})
            impls["fxb_w8a8_bf16_model"] = lambda m=q16: models.run_eager(m, inputs16)
            if not args.no_torchao:
                tao, why = _torchao_int8(models.build_model(fam, size, seed=args.seed))
                if tao is not None:
                    impls["torchao_int8_inductor"] = lambda m=tao: models.run_eager(m, inputs)
                else:
                    notes["torchao_int8_inductor"] = why
            ref = _first(impls["eager_f32"]())
            cos = {}
            for name, fn in impls.items():  # compiles everything before timing
                cos[name] = _cosine(fn(), ref)
            ms = _interleaved_ms(impls, args.rounds, max(1, args.calls // 3))
        row = {"model": f"{fam}/{size}", "ms": ms, "cosine_to_f32": cos, "notes": notes,
               "ratio_vs_eager_f32": {k: ms["eager_f32"] / v for k, v in ms.items()}}
        results.append(row)
        print(f"[models] {row['model']}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items()),
              flush=True)
    return results


def print_models(report, results) -> None:
    print("\nWhole models, steady state (median ms; ratio = float32 eager / implementation)")
    for r in results:
        print(f"{r['model']}:")
        for k, v in r["ms"].items():
            print(f"  {k:24s} {v:9.1f} ms  {r['ratio_vs_eager_f32'][k]:6.2f}x  cosine to f32 "
                  f"{r['cosine_to_f32'][k]:.6f}")
        for k, why in r["notes"].items():
            print(f"  {k:24s} {why}")
        ms = r["ms"]
        if "fxb_w8a8" in ms:
            print(f"  goals: W8A8 >= 1.5x float32 eager: "
                  f"{'met' if ms['eager_f32'] / ms['fxb_w8a8'] >= 1.5 else 'MISSED'}; "
                  f"faster than bfloat16 eager: "
                  f"{'met' if ms['fxb_w8a8'] < ms['eager_bf16'] else 'MISSED'}")
        if "fxb_w8a8_bf16_model" in ms:
            print(f"  W8A8 of the bfloat16 model (its attention and other ops in bfloat16, as "
                  f"bfloat16 eager runs them): faster than bfloat16 eager: "
                  f"{'met' if ms['fxb_w8a8_bf16_model'] < ms['eager_bf16'] else 'MISSED'} "
                  f"({ms['eager_bf16'] / ms['fxb_w8a8_bf16_model']:.2f}x)")
        if "fxb_w8a8_bf16_attention" in ms:
            print(f"  with attention_dtype='bfloat16' (attention in bf16, not W8A8 alone): "
                  f"faster than bfloat16 eager: "
                  f"{'yes' if ms['fxb_w8a8_bf16_attention'] < ms['eager_bf16'] else 'no'}")


#: name -> (M, K, N) of the ``engines`` section: small Flux's layers (1024 image and 77 text
#: tokens, hidden 384, feed-forward 1536), then a Flux.1 projection at 1024 rows
ENGINE_SHAPES = {"flux_small_qkv": (1101, 384, 384), "flux_small_ff_up": (1101, 384, 1536),
                 "flux_small_ff_down": (1101, 1536, 384), "flux_qkv": (1024, 3072, 3072)}
ENGINE_IMPLS = ("float32", "int_mm", "onednn_linear", "quantized_linear")


def bench_engines(args) -> list:
    """The ``engines`` section: the CPU's int8 GEMM paths (``fxbackend.cpu``: ``torch._int_mm``
    and the prepacked engines, each call with its own passes: oneDNN's shift to unsigned bytes,
    fbgemm's float codes, and their new float32 result) against float32 ``F.linear`` on
    :data:`ENGINE_SHAPES`, 8-bit activation and 7-bit weight codes, in interleaved rounds;
    each path's result checked against the float64 product (``exact``).  The profile's
    ``int8_gemm`` decision is printed beside them."""
    import statistics
    from fxbackend import cpu

    results = []
    for name, (m, k, n) in ENGINE_SHAPES.items():
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * k ** -0.5
        qx = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=g)
        qw = torch.randint(-63, 64, (n, k), dtype=torch.int8, generator=g)
        want = (qx.double() @ qw.double().t()).float()
        acc = torch.empty(m, n, dtype=torch.int32)
        impls = {"float32": lambda: torch.nn.functional.linear(x, w)}
        outs = {"int_mm": acc}
        impls["int_mm"] = lambda: torch._int_mm(qx, qw.t(), out=acc)
        for engine in ("onednn_linear", "quantized_linear"):
            if getattr(cpu, f"{engine}_available")():
                packed = getattr(cpu, f"{engine}_pack")(qw)
                gemm = getattr(cpu, f"{engine}_gemm")
                impls[engine] = lambda gemm=gemm, packed=packed: gemm(qx, packed)
                outs[engine] = gemm(qx, packed)  # a new float32 tensor per call
        times = {i: [] for i in impls}
        for f in impls.values():
            for _ in range(args.warmup):
                f()
        exact = {i: bool(torch.equal(outs[i].float(), want)) for i in outs}
        for _ in range(args.rounds):
            for i, f in impls.items():
                for _ in range(args.calls):
                    t0 = time.perf_counter()
                    f()
                    times[i].append(time.perf_counter() - t0)
        med = {i: statistics.median(v) * 1e3 for i, v in times.items()}
        results.append({"config": name, "M": m, "K": k, "N": n, "median_ms": med,
                        "exact": exact, "loadavg": os.getloadavg(),
                        "speedup_vs_float32": {i: med["float32"] / v for i, v in med.items()
                                               if i != "float32"}})
        print(f"done {name}: " + ", ".join(f"{i} {v:.2f} ms" for i, v in med.items()),
              file=sys.stderr)
    return results


def print_engines(report, results) -> None:
    from fxbackend import cpu
    print(f"\nint8 GEMM paths on the CPU against float32 F.linear, {report['threads']} "
          f"threads, torch {report['torch']}; median ms (x float32; exact to the float64 "
          f"product)")
    print(cpu.cpu_profile().decide("int8_gemm"))
    print(f"{'config':20s} {'M x K x N':>18s}" + "".join(f"{i:>24s}" for i in ENGINE_IMPLS))
    for r in results:
        cells = []
        for impl in ENGINE_IMPLS:
            if impl not in r["median_ms"]:
                cells.append("-")
                continue
            ms = r["median_ms"][impl]
            if impl == "float32":
                cells.append(f"{ms:.2f}")
            else:
                cells.append(f"{ms:.2f} ({r['speedup_vs_float32'][impl]:.2f}x"
                             f"{'' if r['exact'][impl] else ', NOT exact'})")
        mkn = f"{r['M']} x {r['K']} x {r['N']}"
        print(f"{r['config']:20s} {mkn:>18s}" + "".join(f"{c:>24s}" for c in cells))


#: (fraction, factor) of the injected outliers, for the printout
ARGS_OUTLIERS = [0.01, 50.0]

#: section name -> (bench function, print function)
SECTIONS = {"kernels": (bench_kernels, print_kernels),
            "engines": (bench_engines, print_engines),
            "accuracy": (bench_accuracy, print_accuracy),
            "models": (bench_models, print_models)}


def main(argv=None) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchstats import cpu_header
    print(cpu_header())
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = report_header(sections={})
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    ARGS_OUTLIERS[:] = [args.outlier_frac, args.outlier_alpha]
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
