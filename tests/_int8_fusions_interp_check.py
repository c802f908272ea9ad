"""Runs the Triton kernels of cuda_kernels/int8_fusions.py in Triton's interpreter on CPU tensors
against the unfused chains; used by tests/test_int8_fusions.py.  A fresh process, for the reason
tests/_rope_interp_check.py gives (``TRITON_INTERPRET=1`` must be set before Triton is
imported); bf16 conversions round to nearest even as on a GPU
(``_rms_rope_interp_check.patch_bf16_rounding``).

    TRITON_INTERPRET=1 python tests/_int8_fusions_interp_check.py < cases.json

stdin: a JSON list of cases, each with ``"id"`` and ``"kind"``:

- ``{"kind": "gr", "b", "s", "k", "n", "group", "x_kind", "bias", "layout", "scale_op",
  "scale"}``: ``int8_gated_residual_triton`` (an int8 weight) bit-equal to
  ``int8_gated_residual_reference(..., div_reciprocal=True)`` (the GPU meaning of the chain);
  layouts "plain" (a [B, 1, N] gate chunk, the accumulator in the output), "strided" (a
  transposed residual and output: the accumulator in a separate buffer), "gate_per_token";
- ``{"kind": "lactq", "m", "k", "n", "group", "out_group", "act", "bias", "block"}``:
  ``int8_linear_act_quantize_triton`` bit-equal to the unfused Triton pair
  (``linear_i8_triton`` then ``act_quantize_triton``);
- ``{"kind": "gluq", "m", "k", "n", "group", "out_group", "act", "gate", "bias", "block"}``:
  ``int8_linear_glu_quantize_triton`` bit-equal to the unfused Triton pair (``linear_i8_triton``
  then ``act_quantize_triton`` of the activated half with the other half as its multiplier);
- ``{"kind": "lcast", "m", "k", "n", "group", "dtype", "bias"}``: the CUDA ``int8_linear_cast``
  kernel's step (the GEMM, then the epilogue storing bfloat16/float16) bit-equal to the float32
  epilogue cast by torch;
- ``{"kind": "modq", "shape", "dtype", "norm", "add_c", "group", "layout"}``:
  ``modulation_quantize_triton`` bit-equal to ``quantize_i8_convrot_triton(modulation_triton(
  ...))``, the unfused Triton chain; layout "chunk" (scale/shift strided [B, 1, C] chunks of an
  adaLN output) or "strided_x" (a transposed x);
- ``{"kind": "rmsq", "shape", "dtype", "w_dtype", "group"}``: ``rms_norm_quantize_triton``
  bit-equal to ``quantize_i8_convrot_triton(rms_norm_triton(...))``;
- ``{"kind": "preq", "m", "k", "dtype", "act", "other", "scale_op", "scale", "group",
  "block"}``: ``act_quantize_triton`` against the unfused chain (``activate_triton``, then the
  multiplier and the scale in torch, then ``quantize_i8_convrot_triton``): bit-equal, except
  sigmoid (no unfused Triton kernel: codes within one step, scales within 1e-6 relative);
  ``other``: None, "half" (the two strided halves of one [M, 2K] tensor, SwiGLU) or "bcast" (a
  [M, 1] multiplier); ``block``: a small block makes a row take the two-pass path.

Every case also runs the rule's kernel record (``KERNELS[rule].run``, what a plan's step calls)
on the same operands and checks that it writes what the direct call wrote.

stdout: one JSON line per case ``{"id", "ok", "msg"}``.  Importing this module imports neither
Triton nor fxbackend.
"""
from __future__ import annotations

import sys
import zlib

from _rms_rope_interp_check import patch_bf16_rounding
from _rope_interp_check import serve


def _gen(case, torch):
    return torch.Generator().manual_seed(zlib.crc32(case["id"].encode()))


def _acts(shape, dtype, g, torch):
    x = torch.randn(*shape, generator=g) * 2
    if shape[-1] > 4:
        x[..., 3] *= 30  # an outlier channel
    return x.to(dtype)


def _diff(got, want) -> str:
    n = int((got != want).sum())
    return f"{n} of {got.numel()} differ"


def _rule_run(rule: str, got, *args, **kw) -> None:
    """The rule's kernel (``cuda_kernels/int8_fusions.KERNELS[rule].run``, what a plan's step
    runs) on ``args`` writes what the direct call wrote into ``got`` (``kw["out"]``: its output,
    one of ``args``)."""
    import torch
    from fxbackend.cuda_kernels.int8_fusions import KERNELS
    out = kw.pop("out")
    KERNELS[rule].run(*args, **kw)
    assert torch.equal(out, got), f"the {rule} kernel: " + _diff(out, got)


def run_gr(case: dict) -> dict:
    import torch
    from fxbackend.cuda_kernels.int8_fusions import int8_gated_residual_triton
    from fxbackend.patterns.int8 import quantize_i8_convrot_reference, \
        quantize_weight_i8_reference
    from fxbackend.patterns.int8_fusions import int8_gated_residual_reference

    g = _gen(case, torch)
    b, s, k, n, group = case["b"], case["s"], case["k"], case["n"], case["group"]
    m = b * s
    xf = _acts((m, k), torch.float32, g, torch)
    wq, ws = quantize_weight_i8_reference(torch.randn(n, k, generator=g) * 0.1, group)
    bias = torch.randn(n, generator=g) if case["bias"] else None
    x_kind, x_scale, extra = case["x_kind"], None, {}
    if x_kind == "packed":
        x = quantize_i8_convrot_reference(xf, group)
        extra = dict(m=m, lead=(m,))
    elif x_kind == "int8":
        x = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
        x_scale = torch.rand(m, generator=g) * 0.05 + 0.01
    else:
        x = xf
    gate = torch.randn(b, 6 * n, generator=g)[:, 2 * n:3 * n].unsqueeze(1)
    res = torch.randn(b, s, n, generator=g)
    out = torch.full((b, s, n), float("nan"))
    if case["layout"] == "strided":
        res = torch.randn(b, n, s, generator=g).transpose(1, 2)
        out = torch.full((b, n, s), float("nan")).transpose(1, 2)
    elif case["layout"] == "gate_per_token":
        gate = torch.randn(b, s, 2, generator=g)[..., :1]
    op, sc = case["scale_op"], case["scale"]
    got = int8_gated_residual_triton(x, wq, ws, x_scale, bias, gate=gate, residual=res,
                                     x_kind=x_kind, group=group, y_shape=(b, s, n),
                                     scale_op=op, scale=sc, out=out, **extra)
    want = int8_gated_residual_reference(x, wq, ws, x_scale, bias, gate=gate, residual=res,
                                         x_kind=x_kind, w_kind="int8", group=group,
                                         y_shape=(b, s, n), scale_op=op, scale=sc,
                                         div_reciprocal=True, **extra)
    assert got is out and torch.equal(got, want), _diff(got, want)
    from fxbackend.cuda_kernels.int8 import DEVICE
    from fxbackend.patterns.int8_fusions import direct_gemm
    out2 = torch.full_like(out, float("nan"))
    acc, xs = direct_gemm(DEVICE, x_kind, group, b * s, k, n, x, x_scale, wq, out2)
    _rule_run("int8_gated_residual", got, acc, xs, ws, bias, out2, gate, res, out=out2,
              y_shape=(b, s, n), scale_op=op, scale=sc, dtype=torch.float32)
    return {}


def _int8_linear(case: dict, torch) -> tuple:
    """``(qx, x_scale, w, w_scale, bias)`` of an int8 linear for the case's ``m``, ``k``,
    ``n``, ``group`` and ``bias``: rotated rows with an outlier channel, a per-channel weight."""
    from fxbackend.patterns.int8 import quantize_i8_convrot_reference, \
        quantize_weight_i8_reference, unpack

    g = _gen(case, torch)
    m, k, n, group = case["m"], case["k"], case["n"], case["group"]
    qx, xs = unpack(quantize_i8_convrot_reference(_acts((m, k), torch.float32, g, torch), group),
                    m, k)
    wq, ws = quantize_weight_i8_reference(torch.randn(n, k, generator=g) * 0.1, group)
    bias = torch.randn(n, generator=g) if case["bias"] else None
    return qx, xs, wq, ws, bias


def run_lactq(case: dict) -> dict:
    import torch
    from fxbackend.cuda_kernels.int8 import linear_i8_triton
    from fxbackend.cuda_kernels.int8_fusions import act_quantize_triton, \
        int8_linear_act_quantize_triton
    from fxbackend.patterns.int8 import int_dot

    qx, xs, wq, ws, bias = _int8_linear(case, torch)
    group = case["group"]
    act, og = case["act"], case["out_group"]
    got = int8_linear_act_quantize_triton(qx, xs, wq, ws, bias, act=act, group=og,
                                          block=case["block"])
    y = linear_i8_triton(qx, wq, ws, xs, bias, x_kind="int8", group=group)
    want = act_quantize_triton(y, act=act, group=og, block=case["block"])
    assert torch.equal(got, want), _diff(got, want)
    out = torch.empty_like(got)
    _rule_run("int8_linear_act_quantize", got, int_dot(qx, wq), xs, ws, bias, out,
              out=out, act=act, group=og, dtype=torch.float32)
    return {}


def run_gluq(case: dict) -> dict:
    import torch
    from fxbackend.cuda_kernels.int8 import linear_i8_triton
    from fxbackend.cuda_kernels.int8_fusions import act_quantize_triton, \
        int8_linear_glu_quantize_triton
    from fxbackend.patterns.int8 import int_dot

    qx, xs, wq, ws, bias = _int8_linear(case, torch)
    group = case["group"]
    act, gate, og = case["act"], case["gate"], case["out_group"]
    got = int8_linear_glu_quantize_triton(qx, xs, wq, ws, bias, act=act, gate=gate, group=og,
                                          block=case["block"])
    halves = linear_i8_triton(qx, wq, ws, xs, bias, x_kind="int8", group=group).chunk(2, -1)
    want = act_quantize_triton(halves[gate], halves[1 - gate], act=act, group=og,
                               block=case["block"])
    assert torch.equal(got, want), _diff(got, want)
    out = torch.empty_like(got)
    _rule_run("int8_linear_glu_quantize", got, int_dot(qx, wq), xs, ws, bias, out,
              out=out, act=act, gate=gate, group=og, dtype=torch.float32)
    return {}


def run_lcast(case: dict) -> dict:
    """``int8_linear_cast``'s CUDA step (GEMM, then the epilogue storing 16-bit values) equals
    the float32 epilogue rounded by torch."""
    import torch
    from fxbackend.cuda_kernels.int8 import epilogue_triton, int_mm
    from fxbackend.cuda_kernels.int8_fusions import KERNELS
    from fxbackend.patterns.int8 import int_dot, quantize_i8_convrot_reference, \
        quantize_weight_i8_reference, unpack

    g = _gen(case, torch)
    m, k, n, group = case["m"], case["k"], case["n"], case["group"]
    dt = getattr(torch, case["dtype"])
    qx, xs = unpack(quantize_i8_convrot_reference(_acts((m, k), torch.float32, g, torch), group),
                    m, k)
    wq, ws = quantize_weight_i8_reference(torch.randn(n, k, generator=g) * 0.1, group)
    bias = torch.randn(n, generator=g).to(dt) if case["bias"] else None
    got = torch.empty(m, n, dtype=dt)
    acc = torch.empty(m, n, dtype=torch.int32)
    int_mm(qx, wq, acc)
    KERNELS["int8_linear_cast"].run(acc, xs, ws, bias, got)
    acc = int_dot(qx, wq)
    y = torch.empty(m, n)
    epilogue_triton(acc, y, xs, ws, bias)
    want = y.to(dt)
    assert torch.equal(got, want), _diff(got.float(), want.float())
    return {}


def run_modq(case: dict) -> dict:
    import torch
    from fxbackend.cuda_kernels.int8 import quantize_i8_convrot_triton
    from fxbackend.cuda_kernels.int8_fusions import modulation_quantize_triton
    from fxbackend.cuda_kernels.modulation import modulation_triton

    g = _gen(case, torch)
    dt = getattr(torch, case["dtype"])
    b, s, c = case["shape"]
    x = _acts((b, s, c), dt, g, torch)
    if case["layout"] == "strided_x":
        x = _acts((s, b, c), dt, g, torch).transpose(0, 1)
    ada = torch.randn(b, 6 * c, generator=g).to(dt)
    scale = ada[:, c:2 * c].unsqueeze(1)
    shift = ada[:, :c].unsqueeze(1)
    if case["layout"] == "vector":  # an affine LayerNorm's weight and bias: [C] for all rows
        scale, shift = scale[0, 0], shift[0, 0]
    kw = dict(norm=case["norm"], eps=1e-6, add_c=case["add_c"])
    got = modulation_quantize_triton(x, scale, shift, group=case["group"], **kw)
    want = quantize_i8_convrot_triton(modulation_triton(x, scale, shift, **kw), case["group"])
    assert torch.equal(got, want), _diff(got, want)
    out = torch.empty_like(got)
    _rule_run("modulation_quantize", got, x, scale.expand(x.shape), shift.expand(x.shape), out,
              out=out, group=case["group"], **kw)
    return {}


def run_rmsq(case: dict) -> dict:
    import torch
    from fxbackend.cuda_kernels.int8 import quantize_i8_convrot_triton
    from fxbackend.cuda_kernels.int8_fusions import rms_norm_quantize_triton
    from fxbackend.cuda_kernels.rmsnorm import rms_norm_triton

    g = _gen(case, torch)
    dt = getattr(torch, case["dtype"])
    x = _acts(tuple(case["shape"]), dt, g, torch)
    w = None if case["w_dtype"] is None else \
        (torch.rand(x.shape[-1], generator=g) + 0.5).to(getattr(torch, case["w_dtype"]))
    got = rms_norm_quantize_triton(x, w, 1e-6, case["group"])
    want = quantize_i8_convrot_triton(rms_norm_triton(x, w, 1e-6), case["group"])
    assert torch.equal(got, want), _diff(got, want)
    from fxbackend.patterns.rmsnorm import rms_norm_out_dtype
    out = torch.empty_like(got)
    _rule_run("rms_norm_quantize", got, x, w, out, out=out, eps=1e-6,
              norm_dtype=rms_norm_out_dtype(x.dtype, None if w is None else w.dtype),
              weight_in_float=False, group=case["group"])
    return {}


def run_preq(case: dict) -> dict:
    import torch
    from fxbackend.cuda_kernels.activation import activate_triton
    from fxbackend.cuda_kernels.int8 import quantize_i8_convrot_triton
    from fxbackend.cuda_kernels.int8_fusions import act_quantize_triton
    from fxbackend.patterns.int8 import unpack
    from fxbackend.patterns.int8_fusions import prologue_reference

    g = _gen(case, torch)
    dt = getattr(torch, case["dtype"])
    m, k, group = case["m"], case["k"], case["group"]
    x = _acts((m, k), dt, g, torch)
    other = None
    if case["other"] == "half":  # SwiGLU: both operands are strided halves of one tensor
        y = _acts((m, 2 * k), dt, g, torch)
        x, other = y[:, k:], y[:, :k]
    elif case["other"] == "bcast":
        other = _acts((m, 1), dt, g, torch)
    act, op, sc = case["act"], case["scale_op"], case["scale"]
    got = act_quantize_triton(x, other, act=act, scale_op=op, scale=sc, group=group,
                              block=case["block"])
    if act in (None, "sigmoid"):
        v = prologue_reference(x, act=act, other=other, scale_op=op, scale=sc,
                               div_reciprocal=True)
    else:
        v = activate_triton(x.contiguous().clone(), act)
        v = prologue_reference(v, other=other, scale_op=op, scale=sc, div_reciprocal=True)
    want = quantize_i8_convrot_triton(v.contiguous(), group)
    if act == "sigmoid":  # torch's sigmoid against the kernel's 1 / (1 + exp(-x))
        qg, sg = unpack(got, m, k)
        qw, sw = unpack(want, m, k)
        assert (qg.int() - qw.int()).abs().max() <= 1, "codes differ by more than one step"
        torch.testing.assert_close(sg, sw, rtol=1e-6, atol=0)
    else:
        assert torch.equal(got, want), _diff(got, want)
    out = torch.empty_like(got)
    _rule_run("act_quantize", got, x, None if other is None else other.expand(x.shape), out,
              out=out, act=act, scale_op=op, scale=sc, group=group)
    return {}


def main() -> int:
    runners = {"gr": run_gr, "lactq": run_lactq, "gluq": run_gluq, "lcast": run_lcast, "modq": run_modq,
               "rmsq": run_rmsq, "preq": run_preq}
    return serve(lambda case: runners[case["kind"]](case), {}, setup=patch_bf16_rounding)


if __name__ == "__main__":
    sys.exit(main())
