"""The ``gated_residual`` fusion (patterns/gated_residual.py): ``addmm|mm -> view/clone ->
[* s | / s] -> mul(gate) -> add(residual)`` as one step, with the numba epilogue
(cpu_kernels/gated_residual.py) and the Triton epilogue (cuda_kernels/gated_residual.py).

- the CPU kernel against ``gated_residual_reference``: dtypes, scale ops, odd shapes, strided
  and broadcast gate/residual/out, in place; bit-exact (each step rounds as the chain does);
- ``why_not`` and the launch layout on metadata alone;
- the Triton kernel in Triton's interpreter (subprocess, tests/_gated_residual_interp_check.py),
  bit-exact against the GPU meaning (division by the reciprocal);
- whole graphs: fused vs unfused (``fusion: False``) vs eager, declines with their reasons;
- the four diffusers test models: the rule fires once per gated residual of the architecture
  and the output matches eager;
- ``cuda``-marked checks at Flux's real size (skipped without a GPU).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import fxbackend
import fxbackend.cpu_kernels.gated_residual as cpu_gr
import fxbackend.cuda_kernels.gated_residual as cuda_gr
from fxbackend import TensorMeta
from fxbackend.patterns.gated_residual import (GatedResidualFusion, ReferenceGatedResidual,
                                               epilogue_layout, gated_residual_reference)

from ext_util import eager_and_compiled, rel_err, rule_on_top
import _rope_interp_check as interp
from _gated_residual_interp_check import build as build_operands

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
SCALES = [(None, None), ("mul", 0.37), ("div", 3.0)]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _operands(layout, b, s, c, dtype, seed=0):
    """``(y, gate, residual, out)`` for one layout (the interpreter check's ``build``)."""
    return build_operands(layout, b, s, c, dtype, torch, seed)


# -- the CPU kernel -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("scale_op,scale", SCALES)
@pytest.mark.parametrize("layout,shape", [("plain", (2, 7, 19)), ("plain", (1, 1, 1)),
                                          ("strided", (2, 5, 33)), ("gate_per_token", (3, 4, 9)),
                                          ("residual_bcast", (2, 3, 130)),
                                          ("in_place", (2, 9, 17))])
def test_cpu_kernel_is_the_reference(dtype, scale_op, scale, layout, shape):
    y, gate, res, out = _operands(layout, *shape, dtype)
    want = gated_residual_reference(y, gate, res, scale_op, scale)
    if layout == "in_place":
        out = y
    assert cpu_gr.gated_residual_cpu(y, gate, res, out, scale_op=scale_op, scale=scale) is out
    assert torch.equal(out, want)  # bit-exact: every rounding of the chain, in place


MIXED = [(BF16, F32, BF16, BF16), (BF16, F32, F32, F32), (F16, F32, F16, F32),
         (F32, F32, BF16, BF16), (BF16, F32, BF16, F16)]


_MIXED_CASES = [(d, lay, shape) for d in MIXED
                for lay, shape in [("plain", (2, 7, 19)), ("plain", (2, 3, 48)),
                                   ("strided", (2, 5, 33)), ("gate_per_token", (3, 4, 9)),
                                   ("in_place", (2, 9, 40))]
                if lay != "in_place" or d[3] == d[0]]  # in place: out is y


@pytest.mark.parametrize("dtypes,layout,shape", _MIXED_CASES,
                         ids=["-".join(str(t)[6:] for t in d) + f"-{lay}-{shape[-1]}"
                              for d, lay, shape in _MIXED_CASES])
def test_cpu_kernel_mixed_dtypes_around_a_float32_gate(dtypes, layout, shape):
    """y, residual and out of their own dtypes around a float32 gate (the rule's widened and
    narrowed operands): the float32 chain on the widened values, rounded once to out's dtype,
    bit for bit, in the vector steps (C >= 16) and the scalar tail alike."""
    ty, tg, tr, to = dtypes
    y, gate, res, out = _operands(layout, *shape, F32, seed=5)
    y, gate, res = y.to(ty), gate.to(tg), res.to(tr)
    if layout == "in_place":
        out = y
    else:
        out = out.to(to)
    want = gated_residual_reference(y, gate, res).to(to)
    assert cpu_gr.gated_residual_cpu(y, gate, res, out) is out
    assert torch.equal(out, want)


def test_cpu_kernel_takes_2d_and_4d_outputs():
    g = _gen(1)
    y = torch.randn(11, 13, generator=g)
    gate = torch.randn(13, generator=g)
    res = torch.randn(11, 13, generator=g)
    out = torch.empty(11, 13)
    cpu_gr.gated_residual_cpu(y, gate, res, out, scale_op="mul", scale=0.5)
    assert torch.equal(out, gated_residual_reference(y, gate, res, "mul", 0.5))
    y4 = torch.randn(2, 3, 5, 7, generator=g)
    gate4 = torch.randn(2, 1, 1, 7, generator=g)  # per sample: tokens (3, 5) merge into one dim
    res4 = torch.randn(2, 3, 5, 7, generator=g)
    out4 = torch.empty_like(y4)
    cpu_gr.gated_residual_cpu(y4, gate4, res4, out4)
    assert torch.equal(out4, gated_residual_reference(y4, gate4, res4))


def _wide(g, dtype, *shape):
    """Normals scaled by random powers of two: [2**-30, 2**30] (fp16: [2**-4, 2**4], so the
    products stay finite), in ``dtype``."""
    k = 4 if dtype == F16 else 30
    return (torch.randn(*shape, generator=g) * torch.exp2(
        torch.randint(-k, k + 1, shape, generator=g).float())).to(dtype)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("c", [16, 48, 1157])
@pytest.mark.parametrize("scale_op,scale", SCALES)
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_cpu_kernel_vector_rows_are_bit_exact(dtype, scale_op, scale, c, threads):
    # float32 and bf16 rows with unit feature stride run in 16-lane vector steps plus a scalar
    # tail (c % 16), fp16 rows in the scalar loop: against the unfused chain with values of
    # many magnitudes, a per-sample gate [B, 1, C] (B > 1), residual and out rows strided
    # wider than C, in place, and with the rows split over threads (b * s * c of 1157 is over
    # two tasks of _MIN_TASK_ELEMS)
    g = _gen(11)
    b, s = 3, 40
    y = _wide(g, dtype, b, s, c)
    gate = _wide(g, dtype, b, 6 * c)[:, 2 * c:3 * c].unsqueeze(1)
    res = _wide(g, dtype, b, s, c + 7)[..., :c]
    out = torch.full((b, s, c + 3), float("nan"), dtype=dtype)[..., :c]
    t = y if scale_op is None else y * scale if scale_op == "mul" else y / scale
    # -(gate * t) as the residual: the unfused chain gives exact zeros, an FMA (or a product
    # not rounded to dtype) its rounding error
    cancel = -(gate * t)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for r in (res, cancel):
            want = r + gate * t
            cpu_gr.gated_residual_cpu(y, gate, r, out, scale_op=scale_op, scale=scale)
            assert torch.equal(out, want)
            y2 = y.clone()
            cpu_gr.gated_residual_cpu(y2, gate, r, y2, scale_op=scale_op, scale=scale)
            assert torch.equal(y2, want)
        assert not out.any()  # the cancelling residual: zeros
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("scale_op,scale", SCALES)
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_cpu_kernel_16bit_every_bit_pattern(dtype, scale_op, scale):
    # every 16-bit pattern as y (subnormals, infinities, NaNs, the largest finite values)
    # against random patterns of gate and residual: the vector steps' conversions and
    # roundings (and the tail's) are eager's, NaN for NaN
    g = _gen(12)
    bits = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16)
    y = torch.cat([bits, bits[:64 * 1027 - 2 ** 16]]).view(dtype).reshape(1, 64, 1027)
    gate = torch.randint(-2 ** 15, 2 ** 15, (2, 1027), generator=g, dtype=torch.int32)
    gate = gate.to(torch.int16).view(dtype)[1:].unsqueeze(1)
    res = torch.randint(-2 ** 15, 2 ** 15, (1, 64, 1027), generator=g, dtype=torch.int32)
    res = res.to(torch.int16).view(dtype)
    want = gated_residual_reference(y, gate, res, scale_op, scale)
    out = cpu_gr.gated_residual_cpu(y, gate, res, torch.empty_like(y), scale_op=scale_op,
                                     scale=scale)
    assert ((out == want) | (out.isnan() & want.isnan())).all()


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("scale_op,scale", SCALES)
@pytest.mark.parametrize("layout,shape", [("plain", (2, 7, 19)), ("strided", (2, 5, 33)),
                                          ("in_place", (3, 4, 1157))])
def test_cpu_kernel_with_a_bias_is_the_reference(dtype, scale_op, scale, layout, shape):
    # the bias the fused step moves out of a float32 addmm: round(y + bias) stands for y
    # (vector steps and the scalar tail; any dtype, though the rule passes float32 only)
    y, gate, res, out = _operands(layout, *shape, dtype)
    bias = torch.randn(shape[-1], generator=_gen(5)).to(dtype)
    want = gated_residual_reference(y, gate, res, scale_op, scale, bias=bias)
    if layout == "in_place":
        out = y
    cpu_gr.gated_residual_cpu(y, gate, res, out, scale_op=scale_op, scale=scale, bias=bias)
    assert torch.equal(out, want)


def test_cpu_kernel_without_a_bias_keeps_signed_zeros():
    # no bias is a bias of negative zeros inside the kernel: y + -0.0 is y, -0.0 included
    y = torch.tensor([[-0.0, 0.0, -0.0, 0.0] * 5])
    gate = torch.ones(20)
    res = torch.full((1, 20), -0.0)
    out = cpu_gr.gated_residual_cpu(y, gate, res, torch.empty_like(y))
    want = res + gate * y
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))


def test_cpu_kernel_rejects_what_it_does_not_take():
    y = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="dtype"):
        cpu_gr.gated_residual_cpu(y, torch.randn(2, 1, 4, dtype=F16), y, torch.empty_like(y))
    with pytest.raises(ValueError, match="scale_op"):
        cpu_gr.gated_residual_cpu(y, y, y, torch.empty_like(y), scale_op="pow", scale=2.0)
    for bad in (torch.randn(5), torch.randn(4, dtype=F16), torch.randn(8)[::2],
                torch.randn(1, 4)):
        with pytest.raises(ValueError, match=r"bias must be a contiguous \[4\] torch.float32"):
            cpu_gr.gated_residual_cpu(y, y, y, torch.empty_like(y), bias=bad)


def _meta(shape, stride=None, dtype=F32, device="cpu"):
    t = torch.empty(shape, dtype=dtype, device="meta")
    return TensorMeta(tuple(shape), tuple(stride or t.stride()), dtype, torch.device(device))


def test_why_not_and_layout_on_metadata():
    y = _meta((2, 8, 16))
    gate = _meta((2, 1, 16), (96, 16, 1))
    assert cpu_gr.why_not(y, gate, y, y) is None
    lay = epilogue_layout((2, 8, 16), (2, 1, 16), (96, 16, 1), (2, 8, 16), (128, 16, 1),
                          (128, 16, 1))
    assert (lay.nb, lay.ns, lay.c, lay.g, lay.r, lay.o) == \
        (2, 8, 16, (96, 0, 1), (128, 16, 1), (128, 16, 1))
    assert "dtype" in cpu_gr.why_not(y, _meta((2, 1, 16), dtype=BF16), y, y)
    # mixed only around a float32 gate
    yb = _meta((2, 8, 16), dtype=BF16)
    assert cpu_gr.why_not(yb, gate, yb, yb) is None
    assert "float32 gate" in cpu_gr.why_not(y, _meta((2, 1, 16), dtype=BF16), yb, y)
    assert "cuda" in cpu_gr.why_not(y, gate, y, _meta((2, 8, 16), device="cuda"))
    # three leading dims that do not merge: the gate moves along dims 0 and 2, not 1
    y4 = _meta((2, 3, 5, 7))
    assert "leading dims" in cpu_gr.why_not(y4, _meta((2, 1, 5, 7)), y4, y4)
    assert "not a tensor" in cpu_gr.why_not(y, None, y, y)
    # the CUDA kernel declines CPU tensors, takes CUDA ones (metadata only: no GPU needed)
    assert "cuda" in cuda_gr.why_not(y, gate, y, y).lower()
    yc = _meta((2, 8, 16), device="cuda")
    assert cuda_gr.why_not(yc, _meta((2, 1, 16), (96, 16, 1), device="cuda"), yc, yc) is None


# -- the Triton kernel in the interpreter --------------------------------------------------------

def _triton_cases() -> list:
    cases = []
    for dt in ("float32", "bfloat16", "float16"):
        for op, sc in SCALES:
            for lay in ("plain", "in_place", "strided", "gate_per_token"):
                cases.append(dict(id=f"{lay}-{dt}-{op}", layout=lay, b=2, s=5, c=37, dtype=dt,
                                  scale_op=op, scale=sc))
    # around a float32 gate: y, residual, out of their own dtypes
    for ty, tr, to in (("bfloat16", "bfloat16", "bfloat16"), ("float16", "float32", "float32"),
                       ("bfloat16", "float32", "float16")):
        for lay in ("plain", "strided"):
            cases.append(dict(id=f"{lay}-y_{ty}-r_{tr}-o_{to}", layout=lay, b=2, s=5, c=37,
                              dtype="float32", y_dtype=ty, residual_dtype=tr, out_dtype=to,
                              scale_op=None, scale=None))
    return cases


TRITON_CASES = _triton_cases()


@pytest.fixture(scope="module")
def triton_results():
    return interp.run_checker("_gated_residual_interp_check.py", TRITON_CASES)


@pytest.mark.parametrize("case", TRITON_CASES, ids=[c["id"] for c in TRITON_CASES])
def test_triton_kernel_in_interpreter(triton_results, case):
    interp.check_result(triton_results, case)


def test_gpu_meaning_of_div_differs_from_cpu_by_at_most_one_ulp():
    y, gate, res, _ = _operands("plain", 4, 64, 64, F32, seed=5)
    a = gated_residual_reference(y, gate, res, "div", 3.0)
    b = gated_residual_reference(y, gate, res, "div", 3.0, div_reciprocal=True)
    torch.testing.assert_close(a, b, rtol=2.0**-22, atol=1e-6)


# -- whole graphs -------------------------------------------------------------------------------

class _Block(torch.nn.Module):
    """``res + gate * proj(x)`` as diffusers writes it; ``variant`` picks the spelling."""

    def __init__(self, c_in=24, c=20, bias=True, variant="flux", dtype=F32):
        super().__init__()
        self.proj = torch.nn.Linear(c_in, c, bias=bias)
        g = _gen(3)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(c, c_in, generator=g) * c_in ** -0.5)
            if bias:
                self.proj.bias.copy_(torch.randn(c, generator=g) * 0.1)
        self.to(dtype)
        self.variant = variant

    def forward(self, x, ada, res):
        y = self.proj(x)
        if self.variant == "flux":  # gate_msa.unsqueeze(1) * attn_output
            gate = ada.chunk(6, dim=1)[2]
            return res + gate.unsqueeze(1) * y
        if self.variant == "clone":  # SD3/Flux attention: a clone after the projection
            gate = ada.chunk(6, dim=1)[2]
            return res + gate.unsqueeze(1) * y.clone()
        if self.variant == "pixart":  # gate [B, 1, C] from a chunk; clone, / rescale factor
            gate = ada.unflatten(1, (6, -1)).chunk(6, dim=1)[2]
            return (gate * (y.clone() / 2.0)) + res
        if self.variant == "mul_scale":
            gate = ada.chunk(6, dim=1)[5]
            return res + gate.unsqueeze(1) * (y * 0.125)
        raise KeyError(self.variant)


def _block_inputs(dtype=F32, b=2, s=7, c_in=24, c=20, seed=0):
    g = _gen(seed)
    return (torch.randn(b, s, c_in, generator=g).to(dtype),
            torch.randn(b, 6 * c, generator=g).to(dtype),
            torch.randn(b, s, c, generator=g).to(dtype))


def _compiled(mod, args, options=None):
    torch._dynamo.reset()
    fxbackend.reset_stats()
    with torch.no_grad():
        out = torch.compile(mod, backend="fxbackend", options=options)(*args)
    return out, dict(fxbackend.stats()["fusions_by_rule"])


def _bias_after_gemm(mod):
    """A copy of ``mod`` whose projection is ``mm``, then ``+ bias`` (rounded): the fused step's
    meaning for a float32 addmm, whose bias the epilogue adds."""
    import copy

    m = copy.deepcopy(mod)
    m.proj.forward = lambda x: F.linear(x, m.proj.weight) + m.proj.bias
    return m


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("variant,bias,c_in", [("flux", True, 24), ("clone", True, 24),
                                               ("pixart", True, 24), ("mul_scale", True, 24),
                                               ("flux", False, 24), ("flux", True, 1536),
                                               ("pixart", True, 1536)])
def test_block_fused_equals_unfused_and_eager(variant, bias, c_in, dtype):
    mod = _Block(c_in=c_in, bias=bias, variant=variant, dtype=dtype)
    args = _block_inputs(dtype, c_in=c_in)
    fused, fires = _compiled(mod, args)
    unfused, none = _compiled(mod, args, {"fusion": False})
    with torch.no_grad():
        eager = mod(*args)
        moved = _bias_after_gemm(mod)(*args) if bias else eager
    assert fires == {"gated_residual": 1} and none == {}
    assert torch.equal(unfused, eager)
    if bias and dtype == F32:
        # mm, then the epilogue adds the bias: exactly that meaning, and eager's addmm (the
        # BLAS adds its partial products to the bias) within float32 rounding
        assert torch.equal(fused, moved)
        torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(fused, eager)  # the same GEMM, then the chain's roundings


def test_rule_declines_a_linear_read_elsewhere():
    class TwoUses(_Block):
        def forward(self, x, ada, res):
            y = self.proj(x)
            return res + ada.chunk(6, dim=1)[2].unsqueeze(1) * y, y

    mod = TwoUses()
    args = _block_inputs()
    (out, y), fires = _compiled(mod, args)
    with torch.no_grad():
        want, want_y = mod(*args)
    assert fires == {} and torch.equal(out, want) and torch.equal(y, want_y)
    text = fxbackend.explain(TwoUses(), *args)
    assert "declined gated_residual" in text and "is a graph output" in text


class _Wan(_Block):
    """Wan's gated residuals on a 16-bit stream with a float32 gate: the attention's
    ``(res.float() + y * gate).type_as(res)`` (the multiply promotes) and the feed-forward's
    ``(res.float() + y.float() * gate).type_as(res)``; ``keep`` also returns the float32 sum
    (the narrowing cast then stays outside); ``promote`` adds the 16-bit residual without
    widening it (the add promotes)."""

    def __init__(self, form="attn", keep=False, promote=False, dtype=BF16):
        super().__init__(dtype=dtype)
        self.form, self.keep, self.promote = form, keep, promote

    def forward(self, x, ada, res):
        gate = ada.float().chunk(6, dim=1)[2].unsqueeze(1)
        y = self.proj(x)
        if self.form == "ff":
            y = y.float()
        r = res if self.promote else res.float()
        total = r + y * gate
        return (total.type_as(res), total * 2) if self.keep else total.type_as(res)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("form,promote", [("attn", False), ("ff", False), ("attn", True)])
def test_16bit_stream_with_a_float32_gate_fuses_bit_for_bit(form, promote, dtype):
    mod = _Wan(form, promote=promote, dtype=dtype)
    args = _block_inputs(dtype)
    fused, fires = _compiled(mod, args)
    with torch.no_grad():
        eager = mod(*args)
    assert fires == {"gated_residual": 1}
    assert fused.dtype == dtype and torch.equal(fused, eager)
    # the residual's .float() and the narrowing cast are in the step: the gate's .float() is
    # the one cast left in the plan
    plan = fxbackend.explain(mod, *args).split("plan graph0")[-1]
    assert plan.count("aten._to_copy") == 1 and "fused.gated_residual" in plan


def test_a_narrowed_result_read_elsewhere_keeps_its_cast_outside():
    mod = _Wan(keep=True)
    args = _block_inputs(BF16)
    (fused, kept), fires = _compiled(mod, args)
    with torch.no_grad():
        want, want_kept = mod(*args)
    assert fires == {"gated_residual": 1}
    assert torch.equal(fused, want) and torch.equal(kept, want_kept)


def test_rule_declines_mixed_dtypes_with_a_reason():
    class Mixed(_Block):  # a bf16 gate against a float32 linear: the multiply promotes, but
        def forward(self, x, ada, res):  # only a float32 gate is taken
            return res.float() + ada.chunk(6, dim=1)[2].unsqueeze(1) * self.proj(x.float())

    mod = Mixed()
    args = _block_inputs(BF16)
    text = fxbackend.explain(mod, *args)
    assert "declined gated_residual" in text and "dtypes differ" in text


class _Impl(ReferenceGatedResidual):
    def __init__(self, decline=None):
        self.decline, self.calls = decline, 0

    def why_not(self, *a):
        return self.decline

    def run(self, *a, **kw):
        self.calls += 1
        super().run(*a, **kw)


class _ImplWithoutBias(_Impl):
    adds_bias = False

    def run(self, *a, **kw):
        assert "bias" not in kw
        super().run(*a, **kw)


def test_rule_keeps_the_addmm_for_an_impl_that_does_not_add_the_bias():
    with rule_on_top(GatedResidualFusion(_ImplWithoutBias()), "gated_residual_test") as rule:
        mod = _Block(c_in=1536)
        args = _block_inputs(c_in=1536)
        out, fires = _compiled(mod, args)
    with torch.no_grad():
        assert torch.equal(out, mod(*args))  # eager's addmm itself
    assert fires == {"gated_residual_test": 1} and rule.impl.calls == 1


def test_bias_in_epilogue_only_for_float32_contiguous_bias_and_unit_beta_alpha():
    import types

    from fxbackend.patterns.gated_residual import bias_in_epilogue

    lin = _meta((8, 20))

    def node(meta):
        return types.SimpleNamespace(meta=meta)

    assert bias_in_epilogue(node(_meta((20,))), lin, {})
    assert bias_in_epilogue(node(_meta((20,))), lin, {"beta": 1, "alpha": 1})
    assert not bias_in_epilogue(None, lin, {})  # mm: no bias
    assert not bias_in_epilogue(node(_meta((20,))), lin, {"beta": 0.5})
    assert not bias_in_epilogue(node(_meta((20,))), lin, {"alpha": 2})
    assert not bias_in_epilogue(node(_meta((20,), dtype=BF16)), _meta((8, 20), dtype=BF16), {})
    assert not bias_in_epilogue(node(_meta((8, 20))), lin, {})  # a full [M, N] bias
    assert not bias_in_epilogue(node(_meta((20,), (2,))), lin, {})  # strided
    assert not bias_in_epilogue(node(_meta((1,))), lin, {})  # broadcast over the columns


@pytest.mark.parametrize("decline", [None, "no kernel for this"])
def test_rule_with_the_torch_reference_impl(decline):
    with rule_on_top(GatedResidualFusion(_Impl(decline)), "gated_residual_test") as rule:
        mod = _Block(variant="pixart")
        args = _block_inputs()
        out, fires = _compiled(mod, args)
        text = fxbackend.explain(mod, *args) if decline else ""
    with torch.no_grad():
        assert torch.equal(out, mod(*args))
    if decline:
        assert "gated_residual_test" not in fires and "no kernel for this" in text
        assert fires == {"gated_residual": 1}  # the shipped rule takes the chain instead
    else:
        assert fires == {"gated_residual_test": 1} and rule.impl.calls == 1


def test_non_contiguous_output_goes_through_workspace():
    # the residual add's output follows a channels-first residual's layout ([B, C, S]
    # transposed): the GEMM result cannot be written into it, so it is staged in workspace
    mod = _Block()
    x, ada, res = _block_inputs()
    res = res.transpose(1, 2).contiguous().transpose(1, 2)
    out, fires = _compiled(mod, (x, ada, res))
    with torch.no_grad():
        assert torch.equal(out, mod(x, ada, res))
    assert fires == {"gated_residual": 1}


# -- the diffusers models -----------------------------------------------------------------------

def _expected_fires(family: str, cfg) -> int:
    if family == "flux":
        # a double-stream block gates four residuals (image attention's to_out, text attention's
        # to_add_out, image and text FF); a single-stream block one (proj_out over [attn, mlp])
        return 4 * cfg.num_layers + cfg.num_single_layers
    if family == "sd3":
        # every JointTransformerBlock gates image attention and image FF, plus attn2 in a
        # dual-attention layer; the text stream's attention and FF are gated except in the last
        # block (context_pre_only)
        n, dual = cfg.num_layers, len(cfg.dual_attention_layers)
        return 2 * n + dual + 2 * (n - 1)
    if family == "pixart":
        # adaLN-single: gate_msa on self-attention (with clone and / rescale_output_factor) and
        # gate_mlp on the FF; the cross-attention residual has no gate
        return 2 * cfg.num_layers
    return 0  # the UNet's transformer blocks are layer-norm blocks without gates


@pytest.mark.parametrize("family", ["flux", "sd3", "pixart", "unet"])
def test_model_fires_once_per_gated_residual(family):
    ref, out, model = eager_and_compiled(family)  # the eager run counts no fusions
    assert rel_err(out, ref) <= 1e-5
    fires = fxbackend.stats()["fusions_by_rule"].get("gated_residual", 0)
    assert fires == _expected_fires(family, model.config)


# -- on a GPU -----------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("scale_op,scale", SCALES)
def test_triton_kernel_at_flux_size(dtype, scale_op, scale):
    y, gate, res, out = (t.cuda() for t in _operands("plain", 1, 4608, 3072, dtype))
    want = gated_residual_reference(y, gate, res, scale_op, scale, div_reciprocal=True)
    cuda_gr.gated_residual_triton(y, gate, res, out, scale_op=scale_op, scale=scale)
    assert torch.equal(out, want)
    unfused = res + gate * (y if scale_op is None else y * scale if scale_op == "mul"
                            else y / scale)
    assert torch.equal(out, unfused)  # CUDA eager divides by the reciprocal as well


@pytest.mark.cuda
@pytest.mark.parametrize("variant", ["flux", "pixart"])
def test_block_on_cuda_fused_equals_unfused(variant):
    mod = _Block(c_in=3072, c=3072, variant=variant).cuda()
    args = tuple(t.cuda() for t in _block_inputs(s=512, c_in=3072, c=3072))
    fused, fires = _compiled(mod, args)
    unfused, _ = _compiled(mod, args, {"fusion": False})
    assert fires == {"gated_residual": 1} and torch.equal(fused, unfused)


@pytest.mark.cuda
@pytest.mark.parametrize("form", ["attn", "ff"])
def test_wan_form_on_cuda_fused_equals_unfused_and_eager(form):
    """Wan 14B's width: a bf16 stream with a float32 gate, 1024 tokens."""
    mod = _Wan(form)
    mod.proj = torch.nn.Linear(5120, 5120).to(BF16)
    mod = mod.cuda()
    args = tuple(t.cuda() for t in _block_inputs(BF16, s=512, c_in=5120, c=5120))
    fused, fires = _compiled(mod, args)
    unfused, _ = _compiled(mod, args, {"fusion": False})
    with torch.no_grad():
        eager = mod(*args)
    assert fires == {"gated_residual": 1}
    assert torch.equal(fused, unfused) and torch.equal(fused, eager)


@pytest.mark.parametrize("op,s,want", [
    ("div", 1.0, (None, None)), ("mul", 1.0, (None, None)), ("div", 4.0, ("mul", 0.25)),
    ("div", 0.5, ("mul", 2.0)), ("mul", 0.5, ("mul", 0.5)), ("div", 3.0, ("div", 3.0)),
    ("div", 2.0 ** 130, ("div", 2.0 ** 130)), (None, None, (None, None)),
])
def test_exact_scale_simplifies_only_where_exact(op, s, want):
    from fxbackend.patterns.gated_residual import exact_scale
    assert exact_scale(op, s) == want
    if want[0] is not None and op is not None and abs(s) < 2.0 ** 100:
        y = torch.randn(10_000) * 1e3
        ref = y / s if op == "div" else y * s
        got = y * want[1] if want[0] == "mul" else y / want[1]
        assert torch.equal(ref, got)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiled mode only")
@pytest.mark.parametrize("dtypes,scale_op", [
    ((F32,) * 4, "div"), ((BF16,) * 4, "mul"), ((F16,) * 4, None),
    ((BF16, F32, BF16, BF16), None), ((BF16, F32, F32, F32), None), ((F16, F32, F16, BF16), None)],
    ids=["fp32-div", "bf16-mul", "fp16", "bf16-f32gate-bf16", "bf16-f32gate-f32",
         "fp16-f32gate-bf16out"])
def test_triton_kernel_compiles_for_sm90_without_a_gpu(dtypes, scale_op):
    """Catches what the interpreter does not check (types, constexpr dtypes, lowering) for
    each dtype combination (y, gate, residual, out) the rule hands the epilogue."""
    grid, args, block_r, block_c = cuda_gr._plan((2, 7, 64), (2, 1, 64), (384, 64, 1),
                                                 (2, 7, 64), (448, 64, 1), (448, 64, 1))
    ck = interp.aot_compile(cuda_gr._kernel(), dtypes, (*args, 0.5),
                            {"HAS_SCALE": scale_op is not None, "BLOCK_R": block_r,
                             "BLOCK_C": block_c},
                            {"num_warps": cuda_gr.NUM_WARPS, "enable_fp_fusion": False})
    assert ck.asm.get("cubin"), "no cubin"
