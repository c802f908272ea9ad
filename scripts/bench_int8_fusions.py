#!/usr/bin/env python3
"""Benchmark the fusions around the INT8 ops (``patterns/int8_fusions.py``) on the CPU, float32.

Each fused step of :data:`CONFIGS` (Flux.1 and SD3-medium widths; the rows are the tokens of a
1024x1024 image capped at ``--rows``) against two baselines, timed in ``--rounds`` rounds
interleaved across the implementations (load changes on a shared machine hit all of them alike;
``_time_impls`` of ``scripts/bench_rope.py``), ``--calls`` calls per round after ``--warmup``;
the time is the median of every timed call:

- ``fused`` (``kernel`` in the JSON): the step's fused kernel (``cpu_kernels/int8_fusions.py``)
  into preallocated outputs;
- ``unfused``: the steps the plan runs without the rule, into preallocated buffers:
  ``modulation_cpu`` / ``rms_norm_cpu`` / torch's native activation, multiply or scalar op
  (``aten.*.out``), then ``quantize_i8_convrot_cpu``; for the gated residual, ``linear_i8``'s
  epilogue kernel and torch's native clone/mul/add;
- ``eager``: the float32 chain the unquantized model runs in eager torch (the same work without
  quantization: ``norm * (1 + scale) + shift``, ``gelu(x)``, ...; for the gated residual's
  epilogue ``res + gate * y.clone()`` on a float y, for the whole step
  ``res + gate * F.linear(x, w, b).clone()``, GEMM included).

Steps (``kind``):

- ``gr_epilogue``: ``int8_gated_residual`` after the integer GEMM: int32 accumulator -> output
  (``x_scale * w_scale + bias``, gate, residual) in one pass vs linear_i8's epilogue then
  clone/mul/add; ``gr_step``: the same with ``torch._int_mm`` included (both sides);
- ``lactq``: ``int8_linear_act_quantize`` (``torch._int_mm``, then one pass: epilogue, GELU,
  quantize) against the two fused steps it replaces (``sd.linear_i8.v1`` then
  ``fused.act_quantize``: ``unfused`` here) and float32 eager ``gelu(F.linear(x, w, b))``;
- ``gluq``: ``int8_linear_glu_quantize`` (``torch._int_mm``, then one pass over both halves:
  epilogue, ``hidden * gelu(gate)``, quantize) against ``sd.linear_i8.v1`` then
  ``fused.act_quantize`` and float32 eager ``hidden * gelu(gate)`` of ``F.linear(x, w, b)``;
- ``modq``: ``modulation_quantize`` (LayerNorm, ``* (1 + scale) + shift``, ConvRot quantize);
- ``rmsq``: ``rms_norm_quantize`` (RMSNorm with a weight, quantize);
- ``actq``: ``act_quantize`` (GELU(tanh) of the FF hidden, or SiLU(gate) * up, quantize);
- ``scaleq``: ``scale_quantize`` (``x / 3``, quantize).

GB/s: the minimum traffic of the step over its time (every implementation divided by the same
bytes): float32 inputs read once and the packed int8 output written once (quantize steps), or
the int32 accumulator and the residual read and the output written (gated residual; for
``lactq`` and ``gluq``, the accumulator read and the packed output written).  Ratios:
unfused / fused and eager / fused (>1: the fused step is faster).  Outputs are checked: fused
equals the unfused kernels bit for bit (``act_quantize``: against the project's activation
kernel followed by the quantize kernel; torch's native activation differs by a few ulp).

Run (from the repository root)::

    .venv/bin/python scripts/bench_int8_fusions.py
    .venv/bin/python scripts/bench_int8_fusions.py --configs flux_modq sd3_actq --rounds 3
    .venv/bin/python scripts/bench_int8_fusions.py --threads 1 --rows 512

Raw numbers go to ``--json`` (default ``bench_results/bench_int8_fusions.json``).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import torch
import torch.nn.functional as F

from bench_rope import _time_impls, report_header  # scripts/ is sys.path[0] when this script runs

TOKENS = 4096
#: name -> (kind, K (features of the quantized rows, or of the linear), N (gated residual's
#: output features), variant, model)
CONFIGS = {
    "flux_attn_out": ("gr", 3072, 3072, "clone", "Flux.1 image attention to_out + gate + res"),
    "flux_ff_down": ("gr", 12288, 3072, "plain", "Flux.1 FF down + gate + residual"),
    "sd3_ff_down": ("gr", 6144, 1536, "plain", "SD3-medium FF down + gate + residual"),
    "flux_ff_up": ("lactq", 3072, 12288, "gelu_tanh", "Flux.1 FF up -> GELU(tanh) -> quantize"),
    "sd3_ff_up": ("lactq", 1536, 6144, "gelu_tanh", "SD3-medium FF up -> GELU(tanh) -> quantize"),
    "sdxl_geglu": ("gluq", 1280, 10240, "gelu", "SDXL (1280 wide) FF GEGLU proj -> quantize"),
    "flux_modq": ("modq", 3072, None, "layer", "Flux.1 norm1 (adaLN) -> Q/K/V quantize"),
    "sd3_modq": ("modq", 1536, None, "layer", "SD3-medium norm1 (adaLN) -> Q/K/V quantize"),
    "flux_rmsq": ("rmsq", 3072, None, "weight", "RMSNorm(3072) with weight -> quantize"),
    "flux_actq": ("actq", 12288, None, "gelu_tanh", "Flux.1 FF GELU(tanh) -> quantize"),
    "sd3_actq": ("actq", 6144, None, "gelu_tanh", "SD3-medium FF GELU(tanh) -> quantize"),
    "flux_swiglu": ("actq", 3072, None, "swiglu", "SwiGLU(silu(a) * b) at 3072 -> quantize"),
    "flux_scaleq": ("scaleq", 3072, None, "div", "x / 3 at Flux's 3072 -> quantize"),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--rows", type=int, default=1024, help="rows M (tokens), at most 4096")
    p.add_argument("--group", type=int, default=256, help="ConvRot group")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=3, help="timed calls per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch (and numba) threads")
    p.add_argument("--json", default=os.path.join("bench_results", "bench_int8_fusions.json"))
    return p.parse_args(argv)


def _packed(m, k):
    from fxbackend.patterns.int8 import packed_nbytes
    return torch.empty(packed_nbytes(m, k), dtype=torch.int8)


def _linear_operands(k: int, n: int, args, g) -> tuple:
    """``(m, x, w, b, wq, ws, qx, xs)``: a float linear's operands at ``min(rows, TOKENS)``
    rows and their int8 forms (the weight per output channel, x rotated and per row at
    ``--group``)."""
    from fxbackend.patterns.int8 import (quantize_i8_convrot_reference,
                                         quantize_weight_i8_reference, unpack)
    m = min(args.rows, TOKENS)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * k ** -0.5
    b = torch.randn(n, generator=g) * 0.1
    wq, ws = quantize_weight_i8_reference(w, args.group)
    qx, xs = unpack(quantize_i8_convrot_reference(x, args.group), m, k)
    return m, x, w, b, wq, ws, qx, xs


def _gr_setup(cfg, args, g) -> dict:
    """The gated residual: GEMM operands already quantized (both sides run the same GEMM)."""
    from fxbackend.cpu_kernels import int8 as i8
    from fxbackend.cpu_kernels import int8_fusions as f
    _, k, n, variant, _ = cfg
    m, x, w, b, wq, ws, qx, xs = _linear_operands(k, n, args, g)
    gate = torch.randn(1, 6 * n, generator=g)[:, 2 * n:3 * n].unsqueeze(1)
    res = torch.randn(1, m, n, generator=g)
    acc = torch.empty(m, n, dtype=torch.int32)
    torch._int_mm(qx, wq.t(), out=acc)
    yf = torch.randn(1, m, n, generator=g)  # a float linear output (the eager epilogue's input)
    out_f = torch.empty(1, m, n)
    y = torch.empty(m, n)
    clone = variant == "clone"
    i8.compile_kernels(None, torch.float32)
    f.compile_kernels("gr", torch.float32)

    def fused_epilogue():  # acc -> out (the plan writes acc into out and converts in place:
        # the same traffic)
        f._gr_launch(acc, xs, ws, b, gate, res, out_f, (1, m, n), None, None)
        return out_f

    def unfused_epilogue():  # linear_i8's epilogue, then the native ops of the chain
        i8._epilogue(acc, y, xs, ws, b, m, n)
        yv = y.view(1, m, n)
        return res + gate * (yv.clone() if clone else yv)

    def eager_epilogue():
        return res + gate * (yf.clone() if clone else yf)

    def fused_step():
        acc_o = out_f.view(torch.int32).view(m, n)
        torch._int_mm(qx, wq.t(), out=acc_o)
        f._gr_launch(acc_o, xs, ws, b, gate, res, out_f, (1, m, n), None, None)
        return out_f

    def unfused_step():
        acc_y = y.view(torch.int32)
        torch._int_mm(qx, wq.t(), out=acc_y)
        i8._epilogue(acc_y, y, xs, ws, b, m, n)
        yv = y.view(1, m, n)
        return res + gate * (yv.clone() if clone else yv)

    def eager_step():
        yv = F.linear(x.view(1, m, k), w, b)
        return res + gate * (yv.clone() if clone else yv)

    def check(fused, unfused):
        return bool(torch.equal(fused(), unfused()))

    tensors = (acc, res, out_f)
    return {"gr_epilogue": ({"kernel": fused_epilogue, "unfused": unfused_epilogue,
                             "eager": eager_epilogue}, tensors,
                            lambda: check(fused_epilogue, unfused_epilogue), (m, k, n)),
            "gr_step": ({"kernel": fused_step, "unfused": unfused_step, "eager": eager_step},
                        tensors, lambda: check(fused_step, unfused_step), (m, k, n))}


def _lactq_setup(cfg, args, g) -> dict:
    """linear_i8 -> GELU(tanh) -> quantize: one step vs the two fused steps it replaces."""
    from fxbackend.cpu_kernels import int8 as i8
    from fxbackend.cpu_kernels import int8_fusions as f
    from fxbackend.patterns.int8 import run_linear
    _, k, n, act, _ = cfg
    m, x, w, b, wq, ws, qx, xs = _linear_operands(k, n, args, g)
    acc = torch.empty(m, n, dtype=torch.int32)
    y = torch.empty(m, n)
    q_f, q_u = _packed(m, n), _packed(m, n)
    i8.compile_kernels(None, torch.float32)
    f.compile_kernels("actq", torch.float32)
    f.compile_kernels("pre", torch.float32)

    def fused():  # the plan's step: the accumulator in workspace, then one pass
        torch._int_mm(qx, wq.t(), out=acc)
        f._actq_launch(acc, xs, ws, b, q_f, act, args.group)
        return q_f

    def unfused():  # sd.linear_i8.v1 (int8 x), then fused.act_quantize
        run_linear(i8.DEVICE, "int8", args.group, m, k, n, qx, xs, wq, ws, b, y, None)
        return f.act_quantize_cpu(y, None, q_u, act=act, group=args.group)

    def eager():
        return F.gelu(F.linear(x, w, b), approximate="tanh")

    return {"lactq": ({"kernel": fused, "unfused": unfused, "eager": eager}, (acc, q_f),
                      lambda: bool(torch.equal(fused(), unfused())), (m, k, n))}


def _gluq_setup(cfg, args, g) -> dict:
    """linear_i8 -> split -> hidden * gelu(gate) -> quantize (diffusers' GEGLU): one step vs
    the two fused steps it replaces."""
    from fxbackend.cpu_kernels import int8 as i8
    from fxbackend.cpu_kernels import int8_fusions as f
    from fxbackend.patterns.int8 import run_linear
    _, k, n, act, _ = cfg
    m, x, w, b, wq, ws, qx, xs = _linear_operands(k, n, args, g)
    acc = torch.empty(m, n, dtype=torch.int32)
    y = torch.empty(m, n)
    q_f, q_u = _packed(m, n // 2), _packed(m, n // 2)
    i8.compile_kernels(None, torch.float32)
    f.compile_kernels("gluq", torch.float32)
    f.compile_kernels("pre", torch.float32)

    def fused():  # the plan's step: the accumulator in workspace, then one pass
        torch._int_mm(qx, wq.t(), out=acc)
        f._gluq_launch(acc, xs, ws, b, q_f, act, 1, args.group)
        return q_f

    def unfused():  # sd.linear_i8.v1 (int8 x), then fused.act_quantize(gate, hidden)
        run_linear(i8.DEVICE, "int8", args.group, m, k, n, qx, xs, wq, ws, b, y, None)
        hidden, gate = y.chunk(2, -1)
        return f.act_quantize_cpu(gate, hidden, q_u, act=act, group=args.group)

    def eager():
        hidden, gate = F.linear(x, w, b).chunk(2, -1)
        return hidden * F.gelu(gate)

    return {"gluq": ({"kernel": fused, "unfused": unfused, "eager": eager}, (acc, q_f),
                     lambda: bool(torch.equal(fused(), unfused())), (m, k, n))}


def _quantize_setup(cfg, args, g) -> dict:
    """A quantize-feeding fusion: fused kernel, the unfused plan's steps (the norm kernel or
    the native activation / scalar op, then the quantize kernel), the float eager chain."""
    from fxbackend.cpu_kernels import int8 as i8
    from fxbackend.cpu_kernels import int8_fusions as f
    from fxbackend.cpu_kernels.activation import activate_cpu
    from fxbackend.cpu_kernels.modulation import modulation_cpu
    from fxbackend.cpu_kernels.rmsnorm import rms_norm_cpu
    kind, k, _, variant, _ = cfg
    m = min(args.rows, TOKENS)
    grp = args.group if k % args.group == 0 else 1
    x = torch.randn(1, m, k, generator=g) * 2
    q_f, q_u = _packed(m, k), _packed(m, k)
    tmp = torch.empty(1, m, k)
    aten = torch.ops.aten
    i8.compile_kernels(torch.float32, None, epilogue=False)
    check = None
    tensors = (x, q_f)
    if kind == "modq":
        ada = torch.randn(1, 6 * k, generator=g)
        scale, shift = ada[:, k:2 * k].unsqueeze(1), ada[:, :k].unsqueeze(1)
        f.compile_kernels("mod", torch.float32)
        fused = lambda: f.modulation_quantize_cpu(x, scale, shift, q_f, group=grp)  # noqa
        unfused = lambda: i8.quantize_i8_convrot_cpu(  # noqa: E731
            modulation_cpu(x, scale, shift, tmp), grp, q_u)
        eager = lambda: F.layer_norm(x, (k,), eps=1e-6) * (1 + scale) + shift  # noqa: E731
    elif kind == "rmsq":
        w = torch.rand(k, generator=g) + 0.5
        f.compile_kernels("rms", torch.float32, (torch.float32, torch.float32))
        fused = lambda: f.rms_norm_quantize_cpu(x, w, 1e-6, grp, q_f)  # noqa: E731
        unfused = lambda: i8.quantize_i8_convrot_cpu(  # noqa: E731
            rms_norm_cpu(x, w, 1e-6, tmp), grp, q_u)
        eager = lambda: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w  # noqa
    elif kind == "actq" and variant == "swiglu":
        y = torch.randn(1, m, 2 * k, generator=g) * 2
        a, b = y[..., :k], y[..., k:]
        f.compile_kernels("pre", torch.float32)
        fused = lambda: f.act_quantize_cpu(a, b, q_f, act="silu", group=grp)  # noqa: E731

        def unfused():  # the plan without the rule: native silu and mul, then quantize
            aten.silu.out(a, out=tmp)
            aten.mul.out(tmp, b, out=tmp)
            return i8.quantize_i8_convrot_cpu(tmp, grp, q_u)

        eager = lambda: F.silu(a) * b  # noqa: E731

        def check():  # bit-exact to the activation kernel's chain
            v = activate_cpu(a.contiguous(), "silu") * b
            return bool(torch.equal(fused(), i8.quantize_i8_convrot_cpu(v, grp)))

        tensors = (a, b, q_f)
    elif kind == "actq":
        f.compile_kernels("pre", torch.float32)
        fused = lambda: f.act_quantize_cpu(x, None, q_f, act=variant, group=grp)  # noqa: E731

        def unfused():  # the plan without the rule: native gelu (tanh), then quantize
            aten.gelu.out(x, approximate="tanh", out=tmp)
            return i8.quantize_i8_convrot_cpu(tmp, grp, q_u)

        eager = lambda: F.gelu(x, approximate="tanh")  # noqa: E731

        def check():
            v = activate_cpu(x.clone(), variant)
            return bool(torch.equal(fused(), i8.quantize_i8_convrot_cpu(v, grp)))
    else:  # scaleq
        f.compile_kernels("pre", torch.float32)
        fused = lambda: f.act_quantize_cpu(x, None, q_f, scale_op="div", scale=3.0,  # noqa
                                           group=grp)
        unfused = lambda: i8.quantize_i8_convrot_cpu(  # noqa: E731
            torch.div(x, 3.0, out=tmp), grp, q_u)
        eager = lambda: x / 3.0  # noqa: E731
    if check is None:
        def check():
            return bool(torch.equal(fused(), unfused()))
    return {kind: ({"kernel": fused, "unfused": unfused, "eager": eager}, tensors, check,
                   (m, k, grp))}


def bench(args) -> list:
    results = []
    for name in args.configs:
        cfg = CONFIGS[name]
        g = torch.Generator().manual_seed(0)
        setup = {"gr": _gr_setup, "lactq": _lactq_setup, "gluq": _gluq_setup}.get(
            cfg[0], _quantize_setup)
        steps = setup(cfg, args, g)
        for step, (impls, tensors, check, shape) in steps.items():
            res = {"config": name, "step": step, "model": cfg[4], "shape": shape,
                   "fused_equals_unfused_kernels": check()}
            _time_impls(res, impls, args, tensors)
            del res["times_s"]
            med = res["median_ms"]
            res["unfused_over_fused"] = med["unfused"] / med["kernel"]
            res["eager_over_fused"] = med["eager"] / med["kernel"]
            results.append(res)
            print(f"done {name}/{step}: " + ", ".join(f"{i} {v:.2f} ms" for i, v in med.items()),
                  file=sys.stderr)
    return results


def print_table(report, results) -> None:
    print(f"\nINT8 fusions on the CPU, float32, {report['threads']} threads, torch "
          f"{report['torch']}; median ms over interleaved rounds (GB/s of the minimum traffic)")
    print(f"{'config':14s} {'step':12s} {'shape':>16s} {'fused':>15s} {'unfused':>15s} "
          f"{'eager f32':>15s} {'unf/fused':>9s} {'eager/f':>8s} exact")
    for r in results:
        med, gb = r["median_ms"], r["gbps"]
        m, k, n = r["shape"]
        shape = f"{m}x{k}" + (f"x{n}" if r["step"] in ("gr_epilogue", "gr_step", "lactq",
                                                       "gluq")
                              else f" g{n}")
        eager = f"{med['eager']:7.2f} ({gb['eager']:5.1f})"
        ef = f"{r['eager_over_fused']:7.2f}x"
        print(f"{r['config']:14s} {r['step']:12s} {shape:>16s} "
              f"{med['kernel']:7.2f} ({gb['kernel']:5.1f}) "
              f"{med['unfused']:7.2f} ({gb['unfused']:5.1f}) {eager:>15s} "
              f"{r['unfused_over_fused']:8.2f}x {ef:>8s} "
              f"{'yes' if r['fused_equals_unfused_kernels'] else 'NO'}")


def main(argv=None) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchstats import cpu_header
    print(cpu_header())
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import fxbackend  # noqa: F401  (registers the kernels)
    report = report_header()
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    report["results"] = bench(args)
    out.write_text(json.dumps(report, indent=1))
    print_table(report, report["results"])
    print(f"raw numbers: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
