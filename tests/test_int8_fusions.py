"""The fusions around the INT8 ops (patterns/int8_fusions.py, cpu_kernels/int8_fusions.py,
cuda_kernels/int8_fusions.py): ``int8_gated_residual``, ``int8_linear_act_quantize``,
``int8_linear_act``, ``int8_linear_cast``, ``modulation_quantize``, ``rms_norm_quantize``,
``act_quantize`` and ``scale_quantize``.

- the numba kernels against the unfused chain (references, native ops, the unfused kernels):
  odd shapes and padding rows, every group K allows, bias/no bias, broadcast gates, scale
  variants, float32 and 16-bit rows; ``torch.equal`` where the design is bit-exact, one code
  step where the activation maths differs from torch's;
- ``why_not`` on metadata, the launchers' errors;
- the Triton kernels in the interpreter (tests/_int8_fusions_interp_check.py, a subprocess) and
  compiled to sm_90 without a GPU;
- whole graphs: small modules and tiny Flux / SD3 with ``quantize="w8a8"``: fusions per rule,
  fused output equal to the plan without the rules (or ``fusion: False``), close to float eager,
  declines with their reasons, a golden plan;
- ``cuda``-marked checks at real sizes (skipped without a GPU).

numba compiles the kernels once per dtype (cached on disk): a first run pays for it.
"""
from __future__ import annotations

import contextlib
import io
import os
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import assert_expected_inline

import fxbackend
import fxbackend.models
from fxbackend import TensorMeta
from fxbackend import fusion as _fusion
from fxbackend.cpu_kernels import int8 as cpu_i8
from fxbackend.cpu_kernels import int8_fusions as cpu_f
from fxbackend.cpu_kernels import rmsnorm as _rms
from fxbackend.cpu_kernels.activation import activate_cpu
from fxbackend.cpu_kernels.int8 import quantize_i8_convrot_cpu
from fxbackend.cpu_kernels.modulation import modulation_cpu
from fxbackend.cpu_kernels.rmsnorm import rms_norm_cpu
from fxbackend.cuda_kernels import int8_fusions as cuda_f
from fxbackend.patterns.int8 import (quantize_i8_convrot_reference,
                                     quantize_weight_i8_reference, unpack)
from fxbackend.patterns.int8_fusions import (EPILOGUES, ModulationQuantizeFusion,
                                             ReferenceQuantizeImpl,
                                             act_quantize_reference,
                                             int8_gated_residual_reference,
                                             int8_linear_glu_quantize_reference,
                                             modulation_quantize_reference, prologue_reference)

from _rope_interp_check import check_result, run_checker
from ext_util import rule_on_top

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
#: the test blocks multiply and add their Q, K and V projections to build the fused chains;
#: each projection keeps its own step here (``merge_w8a8_linears`` has its tests in
#: tests/test_quantize.py)
OPTS = {"quantize": "w8a8", "convrot_group": 16, "quantize_min_size": 0,
        "disable_rewrites": ["merge_w8a8_linears"]}
MODEL_OPTS = {k: v for k, v in OPTS.items() if k != "disable_rewrites"}
MINE = ("int8_gated_residual", "int8_linear_act_quantize", "int8_linear_glu_quantize",
        "modulation_quantize", "rms_norm_quantize", "act_quantize", "scale_quantize",
        "int8_linear_act")
#: the rules whose result differs from the native chain by the activation's float32 ulps
ACT_RULES = ("act_quantize", "int8_linear_act_quantize", "int8_linear_glu_quantize",
             "int8_linear_act")
SCALES = [(None, None), ("mul", 0.37), ("div", 3.0)]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _acts(shape, g, dtype=F32):
    x = torch.randn(*shape, generator=g) * 2
    if shape[-1] > 4:
        x[..., 3] *= 30  # an outlier channel
    return x.to(dtype)


def _codes_within_one(got, want, m, k):
    qg, sg = unpack(got, m, k)
    qw, sw = unpack(want, m, k)
    assert (qg.int() - qw.int()).abs().max() <= 1
    torch.testing.assert_close(sg, sw, rtol=1e-5, atol=0)


# -- the CPU kernels -------------------------------------------------------------------------------

def _gr_operands(layout, b, s, k, n, group, x_kind, bias, seed=0):
    g = _gen(seed)
    m = b * s
    xf = _acts((m, k), g)
    wq, ws = quantize_weight_i8_reference(torch.randn(n, k, generator=g) * 0.1, group)
    kw = dict(x_kind=x_kind, group=group)
    x_scale = None
    if x_kind == "packed":
        x = quantize_i8_convrot_reference(xf, group)
        kw.update(m=m, lead=(m,))
    elif x_kind == "int8":
        x = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
        x_scale = torch.rand(m, generator=g) * 0.05 + 0.01
    else:
        x = xf
    bvec = torch.randn(n, generator=g) if bias else None
    gate = torch.randn(b, 6 * n, generator=g)[:, 2 * n:3 * n].unsqueeze(1)  # strided chunk
    res = torch.randn(b, s, n, generator=g)
    out = torch.full((b, s, n), float("nan"))
    if layout == "strided":  # a transposed residual and output: the accumulator elsewhere
        res = torch.randn(b, n, s, generator=g).transpose(1, 2)
        out = torch.full((b, n, s), float("nan")).transpose(1, 2)
    elif layout == "gate_per_token":
        gate = torch.randn(b, s, 2, generator=g)[..., :1]
    elif layout == "residual_bcast":
        res = torch.randn(n, generator=g)
    return (x, wq, ws, x_scale, bvec), dict(gate=gate, residual=res, **kw), out


@pytest.mark.parametrize("scale_op,scale", SCALES)
@pytest.mark.parametrize("layout", ["plain", "strided", "gate_per_token", "residual_bcast"])
@pytest.mark.parametrize("x_kind,bias,shape,group", [
    ("packed", True, (2, 5, 32, 12), 16), ("packed", False, (1, 3, 256, 20), 256),
    ("int8", True, (3, 1, 16, 8), 4), ("float", True, (2, 7, 64, 36), 64),
    ("float", False, (1, 5, 12, 4), 1)])
def test_cpu_gated_residual_epilogue_is_the_unfused_chain(scale_op, scale, layout, x_kind, bias,
                                                          shape, group):
    b, s, k, n = shape
    args, kw, out = _gr_operands(layout, b, s, k, n, group, x_kind, bias)
    got = cpu_f.int8_gated_residual_cpu(*args, y_shape=(b, s, n), scale_op=scale_op,
                                        scale=scale, out=out, **kw)
    want = int8_gated_residual_reference(*args, w_kind="int8", y_shape=(b, s, n),
                                         scale_op=scale_op, scale=scale, **kw)
    assert got is out
    assert torch.equal(got, want)  # linear_i8's epilogue, then each op's own rounding


def test_cpu_gated_residual_rejects_what_it_does_not_take():
    args, kw, out = _gr_operands("plain", 2, 3, 16, 8, 4, "packed", True)
    with pytest.raises(ValueError, match="dtype"):
        cpu_f.int8_gated_residual_cpu(*args, y_shape=(2, 3, 8), out=out,
                                      **{**kw, "gate": kw["gate"].double()})
    with pytest.raises(ValueError, match="y_shape"):
        cpu_f.int8_gated_residual_cpu(*args, y_shape=(2, 3, 9), **kw)
    with pytest.raises(ValueError, match="scale_op"):
        cpu_f.int8_gated_residual_cpu(*args, y_shape=(2, 3, 8), scale_op="pow", scale=2.0, **kw)


@pytest.mark.parametrize("act", ["gelu_tanh", "gelu", "silu", "sigmoid"])
@pytest.mark.parametrize("m,k,n,group,out_group,bias", [(5, 32, 64, 16, 16, True),
                                                        (3, 16, 48, 4, 16, False),
                                                        (6, 64, 256, 64, 256, True)])
def test_cpu_linear_act_quantize_is_the_two_steps(act, m, k, n, group, out_group, bias):
    from fxbackend.cpu_kernels.int8 import linear_i8_cpu
    from fxbackend.patterns.int8_fusions import int8_linear_act_quantize_reference
    g = _gen(11)
    qx, xs = unpack(quantize_i8_convrot_reference(_acts((m, k), g), group), m, k)
    wq, ws = quantize_weight_i8_reference(torch.randn(n, k, generator=g) * 0.1, group)
    b = torch.randn(n, generator=g) if bias else None
    got = cpu_f.int8_linear_act_quantize_cpu(qx, xs, wq, ws, b, act=act, group=out_group)
    y = linear_i8_cpu(qx, wq, ws, xs, b, x_kind="int8", group=group)
    assert torch.equal(got, cpu_f.act_quantize_cpu(y, act=act, group=out_group))
    want = int8_linear_act_quantize_reference(qx, wq, ws, xs, b, act=act, x_kind="int8",
                                              w_kind="int8", group=group, out_group=out_group)
    _codes_within_one(got, want, m, n)


@pytest.mark.parametrize("act", ["gelu_tanh", "gelu", "silu", "sigmoid"])
@pytest.mark.parametrize("gate", [0, 1])
@pytest.mark.parametrize("m,k,n,group,out_group,bias,dtype", [
    (5, 32, 64, 16, 16, True, F32), (3, 16, 96, 4, 16, False, F32),
    (6, 64, 512, 64, 256, True, F32), (4, 32, 64, 16, 4, True, BF16)])
def test_cpu_linear_glu_quantize_is_the_two_steps(act, gate, m, k, n, group, out_group, bias,
                                                  dtype):
    g = _gen(12)
    qx, xs = unpack(quantize_i8_convrot_reference(_acts((m, k), g), group), m, k)
    wq, ws = quantize_weight_i8_reference(torch.randn(n, k, generator=g) * 0.1, group)
    b = torch.randn(n, generator=g) if bias else None
    got = cpu_f.int8_linear_glu_quantize_cpu(qx, xs, wq, ws, b, act=act, gate=gate,
                                             group=out_group, dtype=dtype)
    halves = cpu_i8.linear_i8_cpu(qx, wq, ws, xs, b, x_kind="int8", group=group).to(dtype) \
        .chunk(2, -1)
    # the linear, then act_quantize of the activated half times the other: bit for bit
    assert torch.equal(got, cpu_f.act_quantize_cpu(halves[gate], halves[1 - gate], act=act,
                                                   group=out_group))
    if dtype == F32:
        want = int8_linear_glu_quantize_reference(qx, wq, ws, xs, b, act=act, gate=gate,
                                                  x_kind="int8", w_kind="int8", group=group,
                                                  out_group=out_group)
        _codes_within_one(got, want, m, n // 2)


def test_cpu_linear_glu_quantize_rejects_what_it_does_not_take():
    g = _gen(13)
    qx = torch.randint(-127, 128, (3, 16), dtype=torch.int8, generator=g)
    xs = torch.rand(3, generator=g) + 0.1
    wq, ws = quantize_weight_i8_reference(torch.randn(32, 16, generator=g), 4)
    call = cpu_f.int8_linear_glu_quantize_cpu
    for kw, match in [(dict(act="silu", gate=2), "gate 2"), (dict(act="relu", gate=0), "relu"),
                      (dict(act="silu", gate=0, group=64), "group=64"),
                      (dict(act="silu", gate=0, dtype=torch.float64), "dtype")]:
        with pytest.raises(ValueError, match=match):
            call(qx, xs, wq, ws, **kw)
    with pytest.raises(ValueError, match="gate must be 0 or 1"):
        int8_linear_glu_quantize_reference(qx, wq, ws, xs, act="silu", gate=3, x_kind="int8",
                                           w_kind="int8")


def _groups(k):
    return [g for g in (1, 4, 16, 64, 256) if k % g == 0]


MOD_CASES = [((b, s, c), dt, norm, add_c, grp)
             for (b, s, c) in [(2, 5, 64), (1, 3, 48), (3, 1, 256)]
             for dt in (F32, BF16, F16) for norm in ("layer", "rms") for add_c in (1.0, None)
             for grp in _groups(c)[1:3]]


@pytest.mark.parametrize("shape,dtype,norm,add_c,group", MOD_CASES)
def test_cpu_modulation_quantize_is_the_unfused_kernels(shape, dtype, norm, add_c, group):
    g = _gen(1)
    b, s, c = shape
    x = _acts(shape, g, dtype)
    ada = torch.randn(b, 6 * c, generator=g).to(dtype)
    scale, shift = ada[:, c:2 * c].unsqueeze(1), ada[:, :c].unsqueeze(1)  # strided, broadcast
    kw = dict(norm=norm, eps=1e-6, add_c=add_c)
    got = cpu_f.modulation_quantize_cpu(x, scale, shift, group=group, **kw)
    want = quantize_i8_convrot_cpu(modulation_cpu(x, scale, shift, **kw), group)
    assert torch.equal(got, want)  # the modulation kernel's statistics, then the quantizer's
    # against torch's own LayerNorm statistics: a code may move by one step
    _codes_within_one(got, modulation_quantize_reference(x, scale, shift, 1e-6, norm, add_c,
                                                         group), b * s, c)


def test_cpu_modulation_quantize_takes_a_transposed_x_and_rejects_bad_groups():
    g = _gen(2)
    x = _acts((5, 2, 32), g).transpose(0, 1)  # strided rows
    scale, shift = torch.randn(2, 1, 32, generator=g), torch.randn(32, generator=g)
    got = cpu_f.modulation_quantize_cpu(x, scale, shift, group=16)
    assert torch.equal(got, quantize_i8_convrot_cpu(modulation_cpu(x, scale, shift), 16))
    with pytest.raises(ValueError, match="group"):
        cpu_f.modulation_quantize_cpu(x, scale, shift, group=64)
    with pytest.raises(ValueError, match="broadcast"):
        cpu_f.modulation_quantize_cpu(x, torch.randn(3, 1, 32), shift, group=16)


@pytest.mark.parametrize("dtype,w_dtype", [(F32, None), (F32, F32), (BF16, BF16), (BF16, None),
                                           (F16, F32), (BF16, F32)])
@pytest.mark.parametrize("shape,group", [((3, 5, 64), 64), ((7, 48), 16), ((2, 256), 4)])
def test_cpu_rms_norm_quantize_is_the_unfused_kernels(dtype, w_dtype, shape, group):
    g = _gen(3)
    x = _acts(shape, g, dtype)
    w = None if w_dtype is None else (torch.rand(shape[-1], generator=g) + 0.5).to(w_dtype)
    got = cpu_f.rms_norm_quantize_cpu(x, w, 1e-6, group)
    assert torch.equal(got, quantize_i8_convrot_cpu(rms_norm_cpu(x, w, 1e-6), group))


def test_cpu_rms_norm_quantize_weight_in_float_order():
    g = _gen(4)
    x, w = _acts((5, 32), g, BF16), (torch.rand(32, generator=g) + 0.5).to(BF16)
    got = cpu_f.rms_norm_quantize_cpu(x, w, 1e-6, 16, weight_in_float=True)
    # what RmsNormCPU runs for weight_in_float: its kernel with a float32 weight into x's dtype
    n = torch.empty(5, 32, dtype=BF16)
    _rms._launch(_rms._rows(x.shape, x.stride()), x, w.float(), n, 1e-6)
    assert torch.equal(got, quantize_i8_convrot_cpu(n, 16))


def _unfused_prologue_cpu(x, other, act, scale_op, scale):
    """The chain with the project's activation kernel (activate_cpu), then torch's ops."""
    v = x.contiguous().clone()
    if act is not None:
        activate_cpu(v, act)
    return prologue_reference(v, other=other, scale_op=scale_op, scale=scale).contiguous()


PRE_CASES = [(act, other, dt, (m, k), grp)
             for act in ("gelu_tanh", "gelu", "silu")
             for other in (None, "half", "bcast")
             for dt in (F32, BF16)
             for (m, k), grp in (((5, 64), 16), ((3, 256), 256))]


def _pre_operands(other, dtype, m, k, seed=5):
    g = _gen(seed)
    x = _acts((m, k), g, dtype)
    o = None
    if other == "half":  # SwiGLU / GEGLU: both operands are strided halves of one tensor
        y = _acts((m, 2 * k), g, dtype)
        x, o = y[:, k:], y[:, :k]
    elif other == "bcast":
        o = _acts((m, 1), g, dtype)
    return x, o


@pytest.mark.parametrize("act,other,dtype,mk,group", PRE_CASES)
def test_cpu_act_quantize_is_the_unfused_kernels(act, other, dtype, mk, group):
    m, k = mk
    x, o = _pre_operands(other, dtype, m, k)
    got = cpu_f.act_quantize_cpu(x, o, act=act, group=group)
    want = quantize_i8_convrot_cpu(_unfused_prologue_cpu(x, o, act, None, None), group)
    assert torch.equal(got, want)  # bit-exact to the activation kernel + quantize kernel
    # torch's own activation (Sleef/libm) differs by a few ulp: a code may move by one step
    _codes_within_one(got, act_quantize_reference(x, group, act=act, other=o), m, k)


@pytest.mark.parametrize("other", [None, "half"])
def test_cpu_sigmoid_quantize_is_close_to_torch(other):
    x, o = _pre_operands(other, F32, 6, 32)
    got = cpu_f.act_quantize_cpu(x, o, act="sigmoid", group=4)
    _codes_within_one(got, act_quantize_reference(x, 4, act="sigmoid", other=o), 6, 32)


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("scale_op,scale", SCALES[1:] + [("mul", 0.25)])
def test_cpu_scale_quantize_is_the_native_chain(dtype, scale_op, scale):
    x, _ = _pre_operands(None, dtype, 7, 64)
    got = cpu_f.act_quantize_cpu(x, scale_op=scale_op, scale=scale, group=16)
    v = prologue_reference(x, scale_op=scale_op, scale=scale)  # torch's mul/div by a scalar
    assert torch.equal(got, quantize_i8_convrot_cpu(v, 16))


def test_cpu_act_quantize_rejects_what_it_does_not_take():
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match="dtypes"):
        cpu_f.act_quantize_cpu(x, torch.randn(3, 16, dtype=BF16), act="silu", group=4)
    with pytest.raises(ValueError, match="activation"):
        cpu_f.act_quantize_cpu(x, act="tanh", group=4)
    with pytest.raises(ValueError, match="group"):
        cpu_f.act_quantize_cpu(x, act="silu", group=64)


# -- why_not on metadata ---------------------------------------------------------------------------

def _meta(shape, dtype=F32, device="cpu", stride=None):
    t = torch.empty(shape, dtype=dtype, device="meta")
    return TensorMeta(tuple(shape), tuple(stride or t.stride()), dtype, torch.device(device))


def test_why_not_on_metadata():
    cpu, cuda = cpu_f.KERNELS, cuda_f.KERNELS
    x, s = _meta((2, 5, 64)), _meta((2, 5, 64), stride=(384, 0, 1))
    out = _meta((12 * 64 + 4 * 12,), torch.int8)  # 10 rows: 12 packed rows and their scales
    mod = dict(norm="layer", eps=1e-6, add_c=1.0)
    assert cpu["modulation_quantize"].why_not(x, s, s, out, group=16, **mod) is None
    assert "group" in cpu["modulation_quantize"].why_not(x, s, s, out, group=48, **mod)
    assert "packed" in cpu["modulation_quantize"].why_not(x, s, s, _meta((7,), torch.int8),
                                                          group=16, **mod)
    assert "CUDA" in cuda["modulation_quantize"].why_not(x, s, s, out, group=16, **mod)
    xc, sc, oc = (_meta(m.shape, m.dtype, "cuda", m.stride) for m in (x, s, out))
    assert cuda["modulation_quantize"].why_not(xc, sc, sc, oc, group=16, **mod) is None
    wide = _meta((2, 8192), device="cuda")
    assert "MAX_D" in cuda["modulation_quantize"].why_not(
        wide, wide, wide, _meta((4 * 8192 + 16,), torch.int8, "cuda"), group=256, **mod)
    # act_quantize: long rows are fine on both devices (two passes on CUDA)
    xl = _meta((4, 12288), device="cuda")
    pre = dict(scale_op=None, scale=None)
    assert cuda["act_quantize"].why_not(
        xl, None, _meta((4 * 12288 + 16,), torch.int8, "cuda"), act="gelu_tanh", group=256,
        **pre) is None
    assert "dtypes" in cpu["act_quantize"].why_not(
        _meta((4, 32)), _meta((4, 32), BF16), _meta((4 * 32 + 16,), torch.int8), act="silu",
        group=4, **pre)
    y, gate = _meta((2, 5, 8)), _meta((2, 1, 8), stride=(48, 8, 1))
    gr = dict(y_shape=(2, 5, 8), scale_op=None, scale=None, dtype=F32)
    assert cpu["int8_gated_residual"].why_not(y, y, gate, y, **gr) is None
    # a 16-bit chain (the cast after the linear) is the kernel's too; mixed dtypes are not
    assert cpu["int8_gated_residual"].why_not(*(_meta((2, 5, 8), BF16),) * 4,
                                              **dict(gr, dtype=BF16)) is None
    assert "dtype" in cpu["int8_gated_residual"].why_not(y, y, _meta((2, 5, 8), BF16), y, **gr)
    assert "cuda" in cuda["int8_gated_residual"].why_not(y, y, gate, y, **gr).lower()
    assert not cuda["int8_gated_residual"].capture_safe  # float weights
    assert cuda["modulation_quantize"].capture_safe and cuda["act_quantize"].capture_safe


# -- the Triton kernels ----------------------------------------------------------------------------

def _triton_cases() -> list:
    cases = []
    for x_kind, bias, layout, (op, sc), group in [
            ("packed", True, "plain", SCALES[0], 16), ("int8", False, "strided", SCALES[2], 4),
            ("float", True, "gate_per_token", SCALES[1], 64), ("packed", False, "plain",
                                                               SCALES[2], 1)]:
        cases.append(dict(id=f"gr-{x_kind}-{layout}-{op}", kind="gr", b=2, s=5, k=64, n=24,
                          group=group, x_kind=x_kind, bias=bias, layout=layout, scale_op=op,
                          scale=sc))
    for act, (m, k, n), group, out_group, bias, block in [
            ("gelu_tanh", (5, 32, 64), 16, 16, True, None),
            ("silu", (3, 16, 48), 4, 16, False, 16),  # two passes
            ("gelu", (6, 64, 256), 64, 256, True, None)]:
        cases.append(dict(id=f"lactq-{act}-{n}-{block}", kind="lactq", m=m, k=k, n=n,
                          group=group, out_group=out_group, act=act, bias=bias, block=block))
    for act, gate, (m, k, n), group, out_group, bias, block in [
            ("gelu", 1, (5, 32, 128), 16, 64, True, None),  # GEGLU
            ("silu", 0, (3, 16, 96), 4, 16, False, 16),  # packed SwiGLU, two passes
            ("sigmoid", 1, (6, 64, 64), 64, 4, True, None)]:
        cases.append(dict(id=f"gluq-{act}-{gate}-{n}-{block}", kind="gluq", m=m, k=k, n=n,
                          group=group, out_group=out_group, act=act, gate=gate, bias=bias,
                          block=block))
    for dt, (m, k, n), group, bias in [("bfloat16", (5, 32, 48), 16, True),
                                       ("float16", (17, 64, 40), 64, False)]:
        cases.append(dict(id=f"lcast-{dt}-{m}", kind="lcast", m=m, k=k, n=n, group=group,
                          dtype=dt, bias=bias))
    for dt, norm, add_c, layout, group, shape in [
            ("float32", "layer", 1.0, "chunk", 16, (2, 5, 64)),
            ("bfloat16", "rms", None, "strided_x", 4, (2, 3, 48)),
            ("float16", "layer", None, "chunk", 256, (1, 3, 256)),
            ("float32", "rms", 1.0, "chunk", 1, (3, 2, 20)),
            ("float32", "layer", None, "vector", 16, (2, 5, 64))]:  # affine LayerNorm
        cases.append(dict(id=f"modq-{dt}-{norm}-{group}-{layout}", kind="modq", shape=shape, dtype=dt,
                          norm=norm, add_c=add_c, group=group, layout=layout))
    for dt, w_dt, group, shape in [("float32", "float32", 64, (3, 5, 64)),
                                   ("bfloat16", None, 16, (7, 32)),
                                   ("bfloat16", "bfloat16", 4, (5, 48))]:
        cases.append(dict(id=f"rmsq-{dt}-{w_dt}", kind="rmsq", shape=shape, dtype=dt,
                          w_dtype=w_dt, group=group))
    for act, other, dt, (op, sc), block, group, (m, k) in [
            ("gelu_tanh", None, "float32", SCALES[0], None, 16, (5, 64)),
            ("gelu", None, "bfloat16", SCALES[0], None, 4, (3, 32)),
            ("silu", "half", "float32", SCALES[0], 16, 16, (5, 64)),  # SwiGLU, two passes
            ("gelu_tanh", "bcast", "float16", SCALES[0], 64, 64, (3, 256)),
            ("sigmoid", "half", "float32", SCALES[0], None, 4, (3, 32)),
            (None, None, "float32", SCALES[2], None, 16, (6, 64)),
            (None, None, "bfloat16", SCALES[1], 16, 4, (5, 48))]:
        cases.append(dict(id=f"preq-{act}-{other}-{dt}-{op}-{block}", kind="preq", m=m, k=k,
                          dtype=dt, act=act, other=other, scale_op=op, scale=sc, group=group,
                          block=block))
    return cases


TRITON_CASES = _triton_cases()


@pytest.fixture(scope="module")
def triton_results():
    return run_checker("_int8_fusions_interp_check.py", TRITON_CASES)


@pytest.mark.parametrize("case", TRITON_CASES, ids=[c["id"] for c in TRITON_CASES])
def test_triton_kernel_in_interpreter(triton_results, case):
    check_result(triton_results, case)


_COMPILED_ONLY = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                    reason="compiled mode only")
_PTR = {F32: "*fp32", BF16: "*bf16", torch.int8: "*i8", torch.int32: "*i32"}


def _compile_sm90(kernel, ptrs: tuple, ints: list, floats: list, constexprs: dict,
                  num_warps: int):
    """The jitted kernel through Triton's ahead-of-time path to an sm_90 cubin (needs ptxas,
    not a GPU), as tests/test_int8.py does."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    sig = {name: _PTR[dt] for name, dt in zip(names, ptrs)}
    sig.update({name: "i32" for name in ints})
    sig.update({name: "fp32" for name in floats})
    sig.update({name: "constexpr" for name in constexprs})
    src = ASTSource(kernel, sig, constexprs=constexprs,
                    attrs={(i,): [["tt.divisibility", 16]] for i in range(len(ptrs))})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "enable_fp_fusion": False})


def _lead_ints(*prefixes):
    return [f"{p}s{i}" for p in prefixes for i in range(4)]


@_COMPILED_ONLY
def test_triton_kernels_compile_for_sm90_without_a_gpu():
    ck = _compile_sm90(cuda_f._gr_kernel(), (torch.int32, F32, F32, F32, F32, F32, F32),
                       ["n_rows", "ns", "C", "gsb", "gss", "gsc", "rsb", "rss", "rsc", "osb",
                        "oss", "osc"], ["scale"],
                       {"HAS_BIAS": True, "HAS_SCALE": True, "BLOCK_R": 4, "BLOCK_C": 512}, 4)
    assert ck.asm.get("cubin") and "fma" not in ck.asm["ptx"]
    ck = _compile_sm90(cuda_f._modq(), (BF16, BF16, BF16, torch.int8, F32),
                       ["n_rows", "D", "size1", "size2", "size3"] + _lead_ints("x", "s", "h") +
                       ["x_sf", "s_sf", "h_sf"], ["eps", "c", "inv"],
                       {"IS_RMS": False, "HAS_ADD": True, "NST": 4, "BLOCK_D": 4096}, 8)
    ptx = ck.asm["ptx"]
    assert ck.asm.get("cubin") and "fma" not in ptx and "div.rn.f32" in ptx
    ck = _compile_sm90(cuda_f._actq(), (torch.int32, F32, F32, F32, torch.int8, F32),
                       ["n_rows", "N"], ["inv"],
                       {"ACT": 1, "HAS_BIAS": True, "NST": 4, "BLOCK": 4096,
                        "ONE_PASS": False}, 8)
    assert ck.asm.get("cubin") and "fma" not in ck.asm["ptx"]
    ck = _compile_sm90(cuda_f._gluq(), (torch.int32, F32, F32, F32, torch.int8, F32),
                       ["n_rows", "N", "H", "g0"], ["inv"],
                       {"ACT": 1, "HAS_BIAS": True, "NST": 4, "BLOCK": 1024,
                        "ONE_PASS": True}, 4)
    assert ck.asm.get("cubin") and "fma" not in ck.asm["ptx"]
    ck = _compile_sm90(cuda_f._preq(), (BF16, BF16, torch.int8, F32),
                       ["n_rows", "K", "size1", "size2", "size3"] + _lead_ints("x", "o") +
                       ["x_sf", "o_sf"], ["scale", "inv"],
                       {"ACT": 1, "HAS_O": True, "OP": 1, "NST": 4, "BLOCK": 4096,
                        "ONE_PASS": False}, 8)
    assert ck.asm.get("cubin") and "fma" not in ck.asm["ptx"]


# -- whole graphs ----------------------------------------------------------------------------------

@contextlib.contextmanager
def _without(*names, device="cpu"):
    """The shipped rules ``names`` unregistered for the block (plans built inside do without
    them), registered again on the way out."""
    removed = [r for r in _fusion.fusions_for(device) if r.name in names]
    for r in removed:
        _fusion.unregister_fusion(device, r)
    try:
        yield
    finally:
        for r in removed:
            _fusion.register_fusion(device, r)


def _compiled(mod, args, options=OPTS):
    torch._dynamo.reset()
    fxbackend.reset_stats()
    with torch.no_grad():
        out = torch.compile(mod, backend="fxbackend", options=options)(*args)
    return out, dict(fxbackend.stats()["fusions_by_rule"])


def _explain(mod, args, options=OPTS) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), torch.no_grad():
        fxbackend.explain(mod, *args, options=options)
    return buf.getvalue()


def _cos(a, b) -> float:
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def _init(mod, seed=3):
    g = _gen(seed)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return mod.eval()


class _Gated(nn.Module):
    """``res + gate * proj(x)`` in diffusers' spellings (as tests/test_gated_residual.py)."""

    def __init__(self, c_in=32, c=24, bias=True, variant="flux"):
        super().__init__()
        self.proj = nn.Linear(c_in, c, bias=bias)
        self.variant = variant
        _init(self)

    def forward(self, x, ada, res):
        y = self.proj(x)
        if self.variant == "flux":
            return res + ada.chunk(6, dim=1)[2].unsqueeze(1) * y
        if self.variant == "clone":
            return res + ada.chunk(6, dim=1)[2].unsqueeze(1) * y.clone()
        if self.variant == "pixart":
            gate = ada.unflatten(1, (6, -1)).chunk(6, dim=1)[2]
            return (gate * (y.clone() / 3.0)) + res
        if self.variant == "mul_scale":
            return res + ada.chunk(6, dim=1)[5].unsqueeze(1) * (y * 0.125)
        raise KeyError(self.variant)


def _gated_inputs(b=2, s=7, c_in=32, c=24, seed=0):
    g = _gen(seed)
    return (torch.randn(b, s, c_in, generator=g), torch.randn(b, 6 * c, generator=g),
            torch.randn(b, s, c, generator=g))


@pytest.mark.parametrize("variant,bias", [("flux", True), ("clone", True), ("pixart", True),
                                          ("mul_scale", True), ("flux", False)])
def test_gated_block_fused_equals_unfused(variant, bias):
    mod = _Gated(bias=bias, variant=variant)
    args = _gated_inputs()
    fused, fires = _compiled(mod, args)
    unfused, none = _compiled(mod, args, {**OPTS, "fusion": False})
    with torch.no_grad():
        eager = mod(*args)
    assert fires == {"int8_gated_residual": 1} and none == {}
    assert torch.equal(fused, unfused)
    assert _cos(fused, eager) > 0.999


def test_gated_declines_a_linear_read_elsewhere():
    class TwoUses(_Gated):
        def forward(self, x, ada, res):
            gate = ada.chunk(6, dim=1)[2].unsqueeze(1)  # first: the chain is then consecutive
            y = self.proj(x)
            return res + gate * y, y

    mod = TwoUses()
    args = _gated_inputs()
    (out, y), fires = _compiled(mod, args)
    assert "int8_gated_residual" not in fires
    (want, want_y), _ = _compiled(mod, args, {**OPTS, "fusion": False})
    assert torch.equal(out, want) and torch.equal(y, want_y)
    text = _explain(mod, args)
    assert "declined int8_gated_residual" in text and "is a graph output" in text


class _AdaBlock(nn.Module):
    """adaLN modulation feeding three projections (one shared quantize step), a GELU(tanh)
    feed-forward and a gated residual: the chains of a Flux/SD3 block."""

    def __init__(self, c=32, norm="layer", expose=False):
        super().__init__()
        self.norm = nn.LayerNorm(c, elementwise_affine=False, eps=1e-6) if norm == "layer" \
            else nn.RMSNorm(c, eps=1e-6, elementwise_affine=False)
        self.q, self.k, self.v = nn.Linear(c, c), nn.Linear(c, c), nn.Linear(c, c)
        self.ff1, self.ff2 = nn.Linear(c, 2 * c), nn.Linear(2 * c, c)
        self.expose = expose
        _init(self)

    def forward(self, x, ada):
        shift, scale, gate = ada.chunk(3, dim=1)
        h = self.norm(x) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)
        a = self.q(h) * self.k(h) + self.v(h)
        y = x + gate.unsqueeze(1) * self.ff2(F.gelu(self.ff1(a), approximate="tanh"))
        return (y, h) if self.expose else y


def _ada_inputs(b=2, s=5, c=32, seed=1):
    g = _gen(seed)
    return torch.randn(b, s, c, generator=g), torch.randn(b, 3 * c, generator=g)


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_block_fires_each_rule_and_equals_the_plan_without_them(norm):
    mod = _AdaBlock(norm=norm)
    args = _ada_inputs()
    fused, fires = _compiled(mod, args)
    # two gated residuals: x + gate * ff2(...), and q(h) * k(h) + v(h) (k's output is the
    # "gate" of q's linear, v's the "residual": the same chain, fused bit-exactly)
    assert fires == {"modulation_quantize": 1, "int8_linear_act_quantize": 1,
                     "int8_gated_residual": 2}
    with _without("int8_linear_act_quantize"):
        two_step, fires_two = _compiled(mod, args)
    with _without(*ACT_RULES):
        no_act, fires_na = _compiled(mod, args)
    with _without(*MINE):
        plain, fires_plain = _compiled(mod, args)
    assert fires_two == {"modulation_quantize": 1, "act_quantize": 1, "int8_gated_residual": 2}
    assert torch.equal(fused, two_step)  # linear_i8 -> act -> quantize = the two fused steps
    assert fires_na == {"modulation_quantize": 1, "int8_gated_residual": 2}
    assert fires_plain == {"modulation": 1}
    assert torch.equal(no_act, plain)  # modulation_quantize, int8_gated_residual: bit-exact
    assert (fused - plain).abs().max() <= 1e-3 * plain.abs().max()  # the activation's ulps
    with torch.no_grad():
        assert _cos(fused, mod(*args)) > 0.999


class _LnProj(nn.Module):
    """A LayerNorm with weight and bias feeding three projections: a UNet transformer block's
    norm -> to_q / to_k / to_v."""

    def __init__(self, c=64):
        super().__init__()
        self.norm = nn.LayerNorm(c)
        self.q, self.k, self.v = nn.Linear(c, c, bias=False), nn.Linear(c, c), nn.Linear(c, c)
        _init(self)
        with torch.no_grad():  # a weight and bias away from 1 and 0
            self.norm.weight.copy_(torch.rand(c, generator=_gen(5)) + 0.5)
            self.norm.bias.copy_(torch.randn(c, generator=_gen(6)))

    def forward(self, x):
        h = self.norm(x)
        return self.q(h) + self.k(h) * self.v(h)


def test_affine_layer_norm_feeds_the_quantize_step():
    mod = _LnProj()
    args = (torch.randn(2, 37, 64, generator=_gen(2)) * 3 + 1,)
    opts = dict(OPTS, convrot_group=16)
    fused, fires = _compiled(mod, args, opts)
    assert fires.get("modulation_quantize") == 1
    with _without("modulation_quantize"):
        plain, fires_plain = _compiled(mod, args, opts)
    assert "modulation_quantize" not in fires_plain
    # the fused row is (x - mean) * rstd * w + b rounded step by step, ATen's LayerNorm
    # x * rstd - mean * rstd folded: a few ulp apart before the codes, so a code may move by one
    assert (fused - plain).abs().max() <= 2e-3 * plain.abs().max()
    with torch.no_grad():
        ref = mod(*args)
    assert _cos(fused, ref) > 0.999 and abs(_cos(fused, ref) - _cos(plain, ref)) < 1e-4
    text = _explain(mod, args, opts)
    assert "fused.modulation_quantize" in text


def test_modulation_output_read_in_float_is_declined_with_the_reason():
    mod = _AdaBlock(expose=True)
    args = _ada_inputs()
    (y, h), fires = _compiled(mod, args)
    assert "modulation_quantize" not in fires and fires["modulation"] == 1
    text = _explain(mod, args)
    assert "declined modulation_quantize" in text and "graph output" in text
    with torch.no_grad():
        want_y, want_h = mod(*args)
    assert _cos(y, want_y) > 0.999 and _cos(h, want_h) > 0.999999


@pytest.mark.parametrize("decline", [None, "no kernel for this"])
def test_modulation_rule_with_the_torch_reference_impl(decline):
    mod = _AdaBlock()
    args = _ada_inputs()
    impl = ReferenceQuantizeImpl(decline)
    with _without(*ACT_RULES), \
            rule_on_top(ModulationQuantizeFusion(impl), "modulation_quantize_test"):
        out, fires = _compiled(mod, args)
        text = _explain(mod, args) if decline else ""
        with _without("modulation_quantize_test", "modulation", "modulation_quantize"):
            unfused, _ = _compiled(mod, args)
    if decline:
        assert "modulation_quantize_test" not in fires and "no kernel for this" in text
        assert fires["modulation_quantize"] == 1  # the shipped rule takes the chain instead
    else:
        assert fires["modulation_quantize_test"] == 1 and impl.calls >= 1
        # the reference impl: torch's LayerNorm, then the quantize reference = the native chain
        assert torch.equal(out, unfused)


class _Glu(nn.Module):
    """A packed SwiGLU / GEGLU feed-forward and a rescale before a projection."""

    def __init__(self, c=32, act="silu"):
        super().__init__()
        self.up, self.down, self.last = nn.Linear(c, 4 * c), nn.Linear(2 * c, c), nn.Linear(c, c)
        self.act = act
        _init(self)

    def forward(self, x):
        a, b = self.up(x).chunk(2, dim=-1)
        h = F.silu(a) * b if self.act == "silu" else b * F.gelu(a)
        return self.last(self.down(h) / 4.0)


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_glu_and_scale_fire_and_stay_close(act):
    mod = _Glu(act=act)
    x = _acts((2, 5, 32), _gen(6))
    out, fires = _compiled(mod, (x,))
    assert fires == {"int8_linear_glu_quantize": 1, "scale_quantize": 1}
    with _without("int8_linear_glu_quantize"):
        two_step, fires_two = _compiled(mod, (x,))
    # linear_i8 -> GLU -> quantize in one step = the linear, then act_quantize, bit for bit
    assert fires_two == {"act_quantize": 1, "scale_quantize": 1}
    assert torch.equal(out, two_step)
    with _without(*ACT_RULES):
        no_act, _ = _compiled(mod, (x,))
    unfused, _ = _compiled(mod, (x,), {**OPTS, "fusion": False})
    assert torch.equal(no_act, unfused)  # scale_quantize is the native chain, bit for bit
    assert (out - unfused).abs().max() <= 1e-3 * unfused.abs().max()
    with torch.no_grad():
        assert _cos(out, mod(x)) > 0.999


def test_rms_norm_with_weight_before_a_projection():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.proj = nn.RMSNorm(64, eps=1e-6), nn.Linear(64, 48)
            _init(self)
            with torch.no_grad():
                self.norm.weight.add_(1.0)

        def forward(self, x):
            return self.proj(self.norm(x))

    mod = M()
    x = _acts((3, 5, 64), _gen(7))
    out, fires = _compiled(mod, (x,))
    assert fires == {"rms_norm_quantize": 1}
    with _without("rms_norm_quantize"):
        want, _ = _compiled(mod, (x,))
    assert torch.equal(out, want)


def test_golden_plan_of_a_small_block():
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self, c=8):
            super().__init__()
            self.norm = nn.LayerNorm(c, elementwise_affine=False, eps=1e-6)
            self.proj, self.out = nn.Linear(c, c), nn.Linear(c, c)

        def forward(self, x, ada):
            shift, scale, gate = ada.chunk(3, dim=1)
            h = self.norm(x) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)
            h = F.gelu(self.proj(h), approximate="tanh")
            return x + gate.unsqueeze(1) * self.out(h)

    text = _explain(Block().eval(), (torch.randn(1, 3, 8), torch.randn(1, 24)),
                    {"quantize": "w8a8", "convrot_group": 4, "quantize_min_size": 0})
    text = re.sub(r"^plan graph\d+", "plan graph", text)  # a process-wide counter
    # the host's CPU and the passes' times vary: not part of the golden text
    text = "".join(ln for ln in text.splitlines(keepends=True)
                   if not ln.startswith(("cpu profile", "cpu decision", "plan-time")))
    assert_expected_inline(text, """\
plan graph: arena 0.00 MB (sum of intermediates 0.00 MB), workspace 0.00 MB (96 bytes)
%0 = input : f32[1,24]
%1 = input : f32[1,3,8]
%2 = weight : f32[8,8]
%3 = weight : f32[8]
%4 = weight : f32[8,8]
%5 = weight : f32[8]
%6 = aten.split.Tensor(%0) {split_size=8, dim=1} : (f32[1,8], f32[1,8], f32[1,8])  # view_of=%0  [native]
%7 = getitem(%6) {index=0} : f32[1,8]
%8 = getitem(%6) {index=1} : f32[1,8]
%9 = getitem(%6) {index=2} : f32[1,8]
%12 = aten.unsqueeze.default(%8) {dim=1} : f32[1,1,8]  # view_of=%8  [native]
%15 = aten.unsqueeze.default(%7) {dim=1} : f32[1,1,8]  # view_of=%7  [native]
%33 = fused.modulation_quantize(%1, %12, %15) : i8[48]  [modulation_quantize]
%22 = aten.unsqueeze.default(%9) {dim=1} : f32[1,1,8]  # view_of=%9  [native]
%34 = fused.int8_linear_act_quantize(%33, %2, %3) : i8[48]  [int8_linear_act_quantize]
%35 = fused.int8_gated_residual(%34, %4, %5, %22, %1) : f32[1,3,8]  # output  [int8_gated_residual]
fused modulation_quantize: %10, %11, %13, %14, %16, %17, %29
fused int8_linear_act_quantize: %30, %20, %21, %23, %31
fused int8_gated_residual: %32, %26, %27, %28
""")


# -- the diffusers test models ---------------------------------------------------------------------

def _expected(family: str, cfg) -> dict:
    if family == "flux":
        n, single = cfg.num_layers, cfg.num_single_layers
        embedders = 3 if cfg.guidance_embeds else 2  # timestep, [guidance,] pooled text
        return {
            # image/text attention out-projections and FFs, one proj_out per single block
            "int8_gated_residual": 4 * n + single,
            # each embedder's linear_1 -> SiLU, the image and text FFs' up-projection -> GELU
            "int8_linear_act_quantize": embedders + 2 * n,
            # norm1, norm1_context, norm2, norm2_context per block, single norms, norm_out
            "modulation_quantize": 4 * n + single + 1,
            # SiLU(temb) (temb: a sum of embeddings) before every adaLN linear
            "act_quantize": 2 * n + single + 1,
            # each single block's proj_mlp -> GELU, written into its concatenation slot
            "int8_linear_act": single,
        }
    n, dual = cfg.num_layers, len(cfg.dual_attention_layers)
    return {
        "int8_gated_residual": 2 * n + dual + 2 * (n - 1),
        # norm1 (a dual-attention block's modulates one norm twice: the engine declines it),
        # norm1_context, norm2, norm2_context (not in the last, context_pre_only block),
        # norm_out
        "modulation_quantize": (n - dual) + n + n + (n - 1) + 1,
        # the timestep and text embedders' linear_1 -> SiLU, the image and context FFs' GELU
        "int8_linear_act_quantize": 2 + (2 * n - 1),
        # SiLU(temb) before every adaLN linear (norm1, norm1_context per block, norm_out)
        "act_quantize": 2 * n + 1,
        "int8_linear_act": 0,
    }


@pytest.fixture(scope="module", params=["flux", "sd3"])
def tiny_model_runs(request):
    family = request.param
    model = fxbackend.models.build_model(family, "tiny")
    inputs = fxbackend.models.make_inputs(family, "tiny")

    def run(*without):
        with _without(*without):
            torch._dynamo.reset()
            fxbackend.reset_stats()
            with torch.no_grad():
                # the models as users run them: Q, K and V merged into one GEMM
                out = fxbackend.models.run_eager(
                    torch.compile(model, backend="fxbackend", options=MODEL_OPTS), inputs)
            return out, dict(fxbackend.stats()["fusions_by_rule"])

    with torch.no_grad():
        eager = fxbackend.models.run_eager(model, inputs)
    runs = {"all": run(), "no_act": run(*ACT_RULES), "none": run(*MINE)}
    torch._dynamo.reset()
    return family, model, eager, runs


def test_tiny_models_fire_each_rule_and_stay_exact(tiny_model_runs):
    family, model, eager, runs = tiny_model_runs
    (out, fires), (no_act, _), (plain, plain_fires) = runs["all"], runs["no_act"], runs["none"]
    want = _expected(family, model.config)
    assert {k: fires.get(k, 0) for k in want} == want
    assert not any(k in plain_fires for k in MINE)
    assert torch.equal(no_act, plain)  # int8_gated_residual and modulation_quantize: bit-exact
    assert _cos(out, eager) > 0.999 and _cos(out, plain) > 0.99999


# -- on a GPU --------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("norm,add_c", [("layer", 1.0), ("rms", None)])
def test_cuda_modulation_quantize_at_flux_size(dtype, norm, add_c):
    from fxbackend.cuda_kernels.int8 import quantize_i8_convrot_triton
    from fxbackend.cuda_kernels.modulation import modulation_triton
    g = _gen(8)
    x = _acts((1, 4096, 3072), g, dtype).cuda()
    ada = torch.randn(1, 6 * 3072, generator=g).to(dtype).cuda()
    scale, shift = ada[:, 3072:6144].unsqueeze(1), ada[:, :3072].unsqueeze(1)
    kw = dict(norm=norm, eps=1e-6, add_c=add_c)
    got = cuda_f.modulation_quantize_triton(x, scale, shift, group=256, **kw)
    assert torch.equal(got, quantize_i8_convrot_triton(modulation_triton(x, scale, shift, **kw),
                                                       256))


@pytest.mark.cuda
@pytest.mark.parametrize("act,k", [("gelu_tanh", 12288), ("silu", 3072)])
def test_cuda_act_quantize_at_flux_size(act, k):
    from fxbackend.cuda_kernels.activation import activate_triton
    from fxbackend.cuda_kernels.int8 import quantize_i8_convrot_triton
    x = _acts((1024, k), _gen(9)).cuda()
    got = cuda_f.act_quantize_triton(x, act=act, group=256)
    want = quantize_i8_convrot_triton(activate_triton(x.clone(), act), 256)
    assert torch.equal(got, want)


@pytest.mark.cuda
@pytest.mark.parametrize("scale_op,scale", SCALES)
def test_cuda_gated_residual_at_flux_size(scale_op, scale):
    b, s, k, n, group = 1, 1024, 3072, 3072, 256
    args, kw, _ = _gr_operands("plain", b, s, k, n, group, "packed", True, seed=10)
    cu = lambda t: t if t is None else t.cuda()  # noqa: E731
    args = tuple(cu(t) for t in args)
    kw = {k_: (cu(v) if isinstance(v, torch.Tensor) else v) for k_, v in kw.items()}
    got = cuda_f.int8_gated_residual_triton(*args, y_shape=(b, s, n), scale_op=scale_op,
                                            scale=scale, **kw)
    want = int8_gated_residual_reference(*args, w_kind="int8", y_shape=(b, s, n),
                                         scale_op=scale_op, scale=scale, div_reciprocal=True,
                                         **kw)
    assert torch.equal(got, want)


@pytest.mark.cuda
def test_cuda_block_fused_equals_the_plan_without_the_rules():
    mod = _AdaBlock(c=256).cuda()
    args = tuple(t.cuda() for t in _ada_inputs(b=2, s=512, c=256))
    with _without("act_quantize", device="cuda"):
        fused, fires = _compiled(mod, args)
        with _without(*MINE, device="cuda"):
            plain, _ = _compiled(mod, args)
    assert fires == {"modulation_quantize": 1, "int8_gated_residual": 1}
    assert torch.equal(fused, plain)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_linear_cast_is_the_pair_bit_for_bit(dtype):
    # a 16-bit layer under quantize="w8a8": sd.linear_i8.v1 (float32) -> cast, fused into one
    # step whose epilogue rounds each float32 value once into the 16-bit output
    mod = _LnProj().to(dtype)
    args = ((torch.randn(2, 37, 64, generator=_gen(2)) * 3 + 1).to(dtype),)
    fused, fires = _compiled(mod, args)
    # q(h) + k(h) * v(h): k's linear with its cast, the multiply and the add are a gated
    # residual (v's output the gate, q's the residual)
    assert fires.get("int8_linear_cast") == 2 and fires.get("int8_gated_residual") == 1
    assert fused.dtype == dtype
    with _without("int8_linear_cast", "int8_gated_residual"):
        pair, fires_pair = _compiled(mod, args)
    assert "int8_linear_cast" not in fires_pair and "int8_gated_residual" not in fires_pair
    assert torch.equal(fused, pair)
    with torch.no_grad():
        assert _cos(fused.float(), mod.float()(args[0].float())) > 0.999


def test_int8_linear_cast_declines_a_cast_with_other_options():
    (spec,) = [e for e in EPILOGUES if e.name == "int8_linear_cast"]
    ch = dict(linear=None, cast=type("N", (), {"params": {"dtype": torch.bfloat16,
                                                          "memory_format": torch.channels_last},
                                              "meta": None})())
    ch["linear"] = type("N", (), {"meta": TensorMeta((4, 8), (8, 1), torch.float32, torch.device("cpu"))})()
    assert "memory_format" in spec.why_not(ch, cpu_f.KERNELS["int8_linear_cast"], cpu_i8.DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_geglu_fuses_linear_cast_glu_quantize_bit_for_bit(dtype):
    mod = _Glu(act="gelu").to(dtype)
    x = _acts((2, 5, 32), _gen(8), dtype)
    fused, fires = _compiled(mod, (x,))
    assert fires.get("int8_linear_glu_quantize") == 1 and fused.dtype == dtype
    with _without("int8_linear_glu_quantize"):
        steps, fires_steps = _compiled(mod, (x,))
    assert "int8_linear_glu_quantize" not in fires_steps and fires_steps.get("act_quantize") == 1
    assert torch.equal(fused, steps)


def test_glu_read_elsewhere_is_left_to_act_quantize():
    class M(_Glu):
        def forward(self, x):
            y = self.up(x)
            a, b = y.chunk(2, dim=-1)
            return self.down(b * F.gelu(a)), y

    mod = M()
    x = _acts((2, 5, 32), _gen(9))
    (out, y), fires = _compiled(mod, (x,))
    assert "int8_linear_glu_quantize" not in fires and fires.get("act_quantize") == 1
    with torch.no_grad():
        want_out, want_y = mod(x)
    assert _cos(out, want_out) > 0.999 and _cos(y, want_y) > 0.9999


class _Ff16(nn.Module):
    """A 16-bit feed-forward: fc1 -> GELU(tanh) -> fc2 (a quantized linear each)."""

    def __init__(self, c=64, act="gelu_tanh"):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(c, 2 * c), nn.Linear(2 * c, c)
        self.act = act
        _init(self)

    def forward(self, x):
        h = self.fc1(x)
        h = F.gelu(h, approximate="tanh") if self.act == "gelu_tanh" else F.silu(h)
        return self.fc2(h)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ["gelu_tanh", "silu"])
def test_16_bit_feed_forward_fuses_linear_cast_act_quantize_bit_for_bit(dtype, act):
    mod = _Ff16(act=act).to(dtype)
    args = ((torch.randn(3, 7, 64, generator=_gen(4)) * 2).to(dtype),)
    fused, fires = _compiled(mod, args)
    assert fires.get("int8_linear_act_quantize") == 1 and fused.dtype == dtype
    with _without("int8_linear_act_quantize"):
        steps, fires_steps = _compiled(mod, args)
    assert "int8_linear_act_quantize" not in fires_steps  # linear_cast, then act_quantize
    assert fires_steps.get("int8_linear_cast") == 2 and fires_steps.get("act_quantize") == 1
    assert torch.equal(fused, steps)


def test_int8_linear_act_quantize_cpu_rounds_to_the_chain_dtype():
    g = _gen(9)
    m, k, n = 5, 32, 48
    qx, xs = unpack(quantize_i8_convrot_reference(torch.randn(m, k, generator=g), 16), m, k)
    wq, ws = quantize_weight_i8_reference(torch.randn(n, k, generator=g) * 0.2, 16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    got = cpu_f.int8_linear_act_quantize_cpu(qx, xs, wq, ws, bias, act="gelu_tanh", group=16,
                                             dtype=torch.bfloat16)
    y = cpu_i8.linear_i8_cpu(qx, wq, ws, xs, bias, x_kind="int8").to(torch.bfloat16)
    want = cpu_f.act_quantize_cpu(y, act="gelu_tanh", group=16)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="dtype"):
        cpu_f.int8_linear_act_quantize_cpu(qx, xs, wq, ws, act="silu", dtype=torch.float64)


class _Gated16(nn.Module):
    """``res + gate * proj(x)`` (adaLN-Zero's end) in a 16-bit model."""

    def __init__(self, c=64):
        super().__init__()
        self.proj = nn.Linear(c, c)
        _init(self)

    def forward(self, x, gate, res):
        return res + gate.unsqueeze(1) * self.proj(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_gated_residual_fuses_the_cast_bit_for_bit(dtype):
    g = _gen(7)
    mod = _Gated16().to(dtype)
    args = tuple(t.to(dtype) for t in (torch.randn(2, 9, 64, generator=g) * 2,
                                       torch.randn(2, 64, generator=g),
                                       torch.randn(2, 9, 64, generator=g)))
    fused, fires = _compiled(mod, args)
    assert fires.get("int8_gated_residual") == 1 and fused.dtype == dtype
    with _without("int8_gated_residual"):
        steps, fires_steps = _compiled(mod, args)
    assert fires_steps.get("int8_linear_cast") == 1  # then the native mul and add in 16 bits
    assert torch.equal(fused, steps)


# -- int8_linear_act ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("act", ["gelu_tanh", "gelu", "silu"])
@pytest.mark.parametrize("m,k,n,bias,strided", [(5, 32, 64, True, False), (3, 16, 48, False, True),
                                                (1, 64, 256, True, True)])
def test_cpu_linear_act_is_the_pair(dtype, act, m, k, n, bias, strided):
    # linear_i8's epilogue, rounded to the chain's dtype, then the project's activation kernel
    # (activate_cpu) rounded to it: bit for bit; into rows of any stride (a concatenation slot)
    from fxbackend.patterns.int8_fusions import _act_torch
    g = _gen(13)
    qx, xs = unpack(quantize_i8_convrot_reference(_acts((m, k), g), 16), m, k)
    wq, ws = quantize_weight_i8_reference(torch.randn(n, k, generator=g) * 0.1, 16)
    b = (torch.randn(n, generator=g) if bias else None)
    out = None
    if strided:
        whole = torch.full((m, n + 24), float("nan"), dtype=dtype)
        out = whole[:, 8:8 + n]
    got = cpu_f.int8_linear_act_cpu(qx, xs, wq, ws, b, act=act, out=out, dtype=dtype)
    y = cpu_i8.linear_i8_cpu(qx, wq, ws, xs, b, x_kind="int8").to(dtype)
    want = activate_cpu(y.clone(), act)
    assert torch.equal(got, want)
    if strided:
        assert got.data_ptr() == out.data_ptr()
        assert whole[:, :8].isnan().all() and whole[:, 8 + n:].isnan().all()
    tol = {F32: 1e-5, BF16: 2e-2, F16: 2e-3}[dtype]
    torch.testing.assert_close(got.float(), _act_torch(y, act).float(), rtol=tol, atol=tol)


def test_cpu_linear_act_sigmoid_and_errors():
    g = _gen(14)
    m, k, n = 4, 16, 32
    qx, xs = unpack(quantize_i8_convrot_reference(_acts((m, k), g), 16), m, k)
    wq, ws = quantize_weight_i8_reference(torch.randn(n, k, generator=g) * 0.1, 16)
    got = cpu_f.int8_linear_act_cpu(qx, xs, wq, ws, act="sigmoid")
    y = cpu_i8.linear_i8_cpu(qx, wq, ws, xs, None, x_kind="int8")
    torch.testing.assert_close(got, torch.sigmoid(y), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="dtype"):
        cpu_f.int8_linear_act_cpu(qx, xs, wq, ws, act="silu", dtype=torch.float64)
    with pytest.raises(ValueError, match="activation 'relu'"):
        cpu_f.int8_linear_act_cpu(qx, xs, wq, ws, act="relu")
    with pytest.raises(ValueError, match="does not hold"):
        cpu_f.int8_linear_act_cpu(qx, xs, wq, ws, act="silu", out=torch.empty(m, n + 1))
    # rows that do not collapse to one stride: written through a temporary, still right
    odd = torch.empty(m, 2, n)[:, 0:1, :]  # [m, 1, n] with row stride 2n: collapses
    bad = torch.empty(2, m // 2, 2 * n).transpose(0, 1)[:, :, :n]  # [m/2, 2, n]: does not
    assert cpu_f.int8_linear_act_cpu(qx, xs, wq, ws, act="silu", out=odd).data_ptr() == \
        odd.data_ptr()
    got2 = cpu_f.int8_linear_act_cpu(qx, xs, wq, ws, act="silu", out=bad)
    assert torch.equal(got2.reshape(m, n), activate_cpu(y.clone(), "silu"))
    assert torch.equal(odd.reshape(m, n), activate_cpu(y.clone(), "silu"))


class _SingleMlp(nn.Module):
    """Flux's single-stream block's tail: the MLP's GELU concatenated with another projection,
    then one projection of both."""

    def __init__(self, c=64):
        super().__init__()
        self.mlp, self.attn, self.out = nn.Linear(c, 2 * c), nn.Linear(c, c), nn.Linear(3 * c, c)
        _init(self)

    def forward(self, x):
        h = F.gelu(self.mlp(x), approximate="tanh")
        return self.out(torch.cat([self.attn(x), h], dim=-1))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_int8_linear_act_writes_its_concatenation_slot(dtype):
    mod = _SingleMlp().to(dtype)
    args = ((torch.randn(2, 9, 64, generator=_gen(15)) * 2).to(dtype),)
    fused, fires = _compiled(mod, args)
    assert fires.get("int8_linear_act") == 1
    with torch.no_grad(), fxbackend.record_graphs() as graphs:
        torch._dynamo.reset()
        torch.compile(mod, backend="fxbackend", options=OPTS)(*args)
    plan = graphs[0].all_plans()[0]
    (step,) = [n for n in plan.graph.nodes if n.op == "fused.int8_linear_act"]
    (cat,) = [n for n in plan.graph.nodes if n.op == "aten.cat.default"]
    assert cat.id in {c.id for c in plan.concat.placed}, plan.report()
    assert plan.metas[step].stride[-2] == 3 * 64  # its rows are the concatenation's
    with _without("int8_linear_act"):
        pair, fires_pair = _compiled(mod, args)
    assert "int8_linear_act" not in fires_pair
    # the activation maths (a few float32 ulp from torch's) may move a code of the next quantize
    # step by one: close, not equal, in float32; 16-bit rounding hides the difference
    if dtype == F32:
        torch.testing.assert_close(fused, pair, rtol=2e-2, atol=2e-2)
    else:
        assert torch.equal(fused, pair)
    with torch.no_grad():
        assert _cos(fused.float(), mod.float()(args[0].float())) > 0.999
