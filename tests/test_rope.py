"""RoPE: the op ``sd.rope_apply.v1`` (patterns/rope.py) and its CPU kernel (cpu_kernels/rope.py).

- validation: malformed nodes are ValueErrors at graph-build time (``op_create``);
- the reference: ``rope_reference`` is diffusers' ``apply_rotary_emb`` for both pairings;
- the CPU kernel, per-kernel parametrised against the reference on hand-built graphs run by
  ``CompiledGraph``: both modes, full and partial rotation, odd shapes, strided rows (a head
  slice of a fused QKV output, ``[B, S, H, D]`` seen as ``[B, H, S, D]``), the broadcast forms
  of cos/sin models use, ``(dtype, atol, rtol)`` rows;
- declining: ``supports`` returns False (never raises) and the op's reference runs (native).

The numba kernels compile once per dtype combination and are cached on disk (see the kernel's
docstring), so a first run of this file pays some seconds of compilation.
"""
from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch

import fxbackend
from fxbackend import TensorMeta
from fxbackend.cpu_kernels import rope as cpu_rope
from fxbackend.patterns.rope import rope_reference

from ext_util import compiled, graph_of, set_outputs

OP = "sd.rope_apply.v1"
CPU = torch.device("cpu")
DTYPES = [(torch.float32, 1e-6, 1e-5), (torch.bfloat16, 1e-2, 1e-2), (torch.float16, 1e-3, 1e-3)]


# -- helpers ------------------------------------------------------------------------------------

def _input(g, t: torch.Tensor):
    """An input node with ``t``'s exact metadata (strides and storage offset included)."""
    return g.append(g.new_node("input", meta=TensorMeta.of(t), is_input=True))


def _view(g, src, overload, *args):
    """An ATen view node of ``src`` (metadata from running ``overload`` on the meta device)."""
    m = src.meta
    t = torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta")
    meta = dataclasses.replace(TensorMeta.of(overload(t, *args)), device=CPU)
    positional = [a.name for a in overload._schema.arguments][1:]
    return g.append(g.new_node(str(overload), [src], dict(zip(positional, args)), meta,
                               target=overload, tensor_layout=(("self", True),), view_of=src))


def _run_rope(x, cos, sin, mode, n_rot, op=OP):
    """One ``op`` node (``sd.rope_apply.v1`` or its rounded form) on inputs with exactly these
    layouts; (result, steps)."""
    from fxbackend import Graph
    g = Graph()
    xs = [_input(g, t) for t in (x, cos, sin)]
    set_outputs(g, fxbackend.op_create(g, op, xs, {"mode": mode, "n_rot": n_rot}))
    fxbackend.reset_stats()
    (out,) = compiled(g)(x, cos, sin)
    return out, dict(fxbackend.stats()["steps_by_kernel"])


def _freqs(shape, n_rot, dtype=torch.float32, gen=None):
    """cos/sin of real angles (any shape ending in n_rot)."""
    ang = torch.rand(*shape[:-1], n_rot, generator=gen) * 6.3
    return ang.cos().to(dtype), ang.sin().to(dtype)


# -- (a) op validation at graph-build time ------------------------------------------------------

def _nodes(x_shape, cos_shape, sin_shape=None, x_stride=None):
    g, _ = graph_of()
    x_meta = TensorMeta(tuple(x_shape), x_stride or TensorMeta.of(torch.empty(x_shape)).stride,
                        torch.float32, CPU)
    x = g.append(g.new_node("input", meta=x_meta, is_input=True))
    c = g.append(g.new_node("input", meta=TensorMeta.of(torch.empty(cos_shape)), is_input=True))
    s = g.append(g.new_node("input", meta=TensorMeta.of(torch.empty(sin_shape or cos_shape)),
                            is_input=True))
    return g, [x, c, s]


@pytest.mark.parametrize("x_shape, cos_shape, sin_shape, x_stride, attrs, match", [
    ((2, 4, 7), (4, 6), None, None, {"mode": "interleaved", "n_rot": 6},
     r"head size .* must be even, got 7"),
    ((2, 4, 8), (4, 10), None, None, {"mode": "interleaved", "n_rot": 10},
     r"n_rot must be even and in 1\.\.8 .* got 10"),
    ((2, 4, 8), (4, 5), None, None, {"mode": "split_half", "n_rot": 5},
     r"n_rot must be even .* got 5"),
    ((2, 4, 8), (4, 8), None, None, {"mode": "neox", "n_rot": 8},
     r"mode must be one of \('interleaved', 'split_half'\), got 'neox'"),
    ((2, 4, 8), (3, 8), None, None, {"mode": "interleaved", "n_rot": 8},
     r"cos of shape \(3, 8\) does not broadcast to \(2, 4, 8\)"),
    ((2, 4, 8), (4, 8), (4, 6), None, {"mode": "interleaved", "n_rot": 8},
     r"sin of shape \(4, 6\) does not broadcast to \(2, 4, 8\)"),
    ((2, 4, 8), (4, 4, 8), None, None, {"mode": "split_half", "n_rot": 8},
     r"cos of shape \(4, 4, 8\) does not broadcast"),
    ((2, 4, 8), (4, 8), None, (1, 2, 8), {"mode": "interleaved", "n_rot": 8},
     r"features must be contiguous \(last stride 1\), got strides \(1, 2, 8\)"),
], ids=["odd_head", "n_rot_gt_D", "odd_n_rot", "unknown_mode", "cos_no_broadcast",
        "sin_no_broadcast", "cos_too_many_rows", "strided_features"])
def test_op_validation_errors_at_graph_build(x_shape, cos_shape, sin_shape, x_stride, attrs,
                                             match):
    g, srcs = _nodes(x_shape, cos_shape, sin_shape, x_stride)
    before = list(g.nodes)
    with pytest.raises(ValueError, match=match):
        fxbackend.op_create(g, OP, srcs, attrs)
    assert g.nodes == before, "a rejected node is not added"


# -- (b) the reference is diffusers' apply_rotary_emb ------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unbind_dim, mode", [(-1, "interleaved"), (-2, "split_half")])
@pytest.mark.parametrize("sequence_dim", [2, 1])
def test_reference_is_diffusers_apply_rotary_emb(dtype, unbind_dim, mode, sequence_dim):
    from diffusers.models.embeddings import apply_rotary_emb
    gen = torch.Generator().manual_seed(0)
    B, H, S, D = 2, 3, 7, 16
    shape = (B, H, S, D) if sequence_dim == 2 else (B, S, H, D)
    x = torch.randn(shape, generator=gen).to(dtype)
    cos, sin = _freqs((S, D), D, gen=gen)
    want = apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=unbind_dim,
                            sequence_dim=sequence_dim)
    bc = (lambda t: t[:, None, :]) if sequence_dim == 1 else (lambda t: t)
    got = rope_reference(x, bc(cos), bc(sin), mode, D)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# -- (c) the CPU kernel against the reference ---------------------------------------------------

B, H, S = 2, 3, 7


def _layout(kind: str, D: int, n_rot: int, dtype, gen):
    """(x, cos, sin) for one layout (cos/sin float32, as diffusers models give them)."""
    if kind == "bhsd":  # Flux-style: contiguous [B, H, S, D], cos [S, n_rot]
        return (torch.randn(B, H, S, D, generator=gen).to(dtype), *_freqs((S, n_rot), n_rot))
    if kind == "bhsd_cos4d":  # cos [1, 1, S, n_rot] (diffusers' cos[None, None])
        return (torch.randn(B, H, S, D, generator=gen).to(dtype),
                *_freqs((1, 1, S, n_rot), n_rot, gen=gen))
    if kind == "bshd":  # sequence_dim=1: [B, S, H, D] with cos [S, 1, n_rot]
        return (torch.randn(B, S, H, D, generator=gen).to(dtype),
                *_freqs((S, 1, n_rot), n_rot, gen=gen))
    if kind == "bshd_as_bhsd":  # [B, S, H, D] transposed to [B, H, S, D]: strided rows
        x = torch.randn(B, S, H, D, generator=gen).to(dtype).transpose(1, 2)
        return (x, *_freqs((S, n_rot), n_rot, gen=gen))
    if kind == "qkv_slice":  # the k of a fused [B, S, 3*H*D] projection: offset + row stride
        qkv = torch.randn(B, S, 3 * H * D, generator=gen).to(dtype)
        x = qkv.view(B, S, 3, H, D)[:, :, 1].transpose(1, 2)
        return (x, *_freqs((S, n_rot), n_rot, gen=gen))
    if kind == "per_batch_strided_cos":  # cos [B, 1, S, n_rot] a slice of a wider table
        x = torch.randn(B, H, S, D, generator=gen).to(dtype)
        c, s = _freqs((B, 1, S, n_rot + 4), n_rot + 4, gen=gen)
        return x, c[..., 2:2 + n_rot], s[..., 2:2 + n_rot]
    if kind == "expanded_x":  # x broadcast over the batch (stride 0), cos [S, n_rot]
        x = torch.randn(1, H, S, D, generator=gen).to(dtype).expand(B, H, S, D)
        return (x, *_freqs((S, n_rot), n_rot, gen=gen))
    if kind == "rows_2d":  # [rows, D] with a row stride (a flat slice)
        x = torch.randn(S, 2 * D, generator=gen).to(dtype)[:, D:]
        return (x, *_freqs((S, n_rot), n_rot, gen=gen))
    raise AssertionError(kind)


LAYOUTS = ["bhsd", "bhsd_cos4d", "bshd", "bshd_as_bhsd", "qkv_slice", "per_batch_strided_cos",
           "expanded_x", "rows_2d"]


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("mode", ["interleaved", "split_half"])
@pytest.mark.parametrize("D, rot", [(6, "full"), (6, "partial"), (10, "full"), (10, "partial"),
                                    (40, "partial")])
@pytest.mark.parametrize("kind", LAYOUTS)
def test_cpu_kernel_matches_reference(dtype, atol, rtol, mode, D, rot, kind):
    n_rot = D if rot == "full" else (D // 2) & ~1  # partial: about D/2, even
    gen = torch.Generator().manual_seed(D * 31 + n_rot)
    x, cos, sin = _layout(kind, D, n_rot, dtype, gen)
    out, steps = _run_rope(x, cos, sin, mode, n_rot)
    assert steps == {"rope_apply_cpu": 1}
    want = rope_reference(x, cos, sin, mode, n_rot)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    torch.testing.assert_close(out, want, atol=atol, rtol=rtol)
    # the untouched features pass through bit for bit
    assert torch.equal(out[..., n_rot:], x[..., n_rot:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["interleaved", "split_half"])
def test_cpu_kernel_cos_sin_in_x_dtype(dtype, mode):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, H, 10, generator=gen).to(dtype)
    cos, sin = _freqs((S, 1, 10), 10, dtype, gen=gen)
    out, steps = _run_rope(x, cos, sin, mode, 10)
    assert steps == {"rope_apply_cpu": 1}
    torch.testing.assert_close(out, rope_reference(x, cos, sin, mode, 10), atol=1e-2, rtol=1e-2)


def _exhaustive_x(dtype, gen) -> torch.Tensor:
    """x for the bit-exactness tests, ``[rows, 4, D]``: float32 values over 60 decades, or
    every finite bit pattern of a 16-bit dtype."""
    if dtype == torch.float32:
        return torch.randn(64, 4, 24, generator=gen) * torch.logspace(-30, 30, 24)
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    x = bits[torch.isfinite(bits.float())]
    return x[: x.numel() // 64 * 64].reshape(-1, 4, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_kernel_is_bit_exact(dtype):
    """Same float32 maths in the same order (no FMA), round to nearest even once: every bit
    equal to the reference; for 16-bit x over every finite bit pattern (so both conversions
    are checked exhaustively on the way in and widely on the way out)."""
    gen = torch.Generator().manual_seed(2)
    x = _exhaustive_x(dtype, gen)
    cos, sin = _freqs((x.shape[1], x.shape[2]), x.shape[2], gen=gen)
    cos[0, :2] = 1e-38  # products that land in the 16-bit subnormals
    for mode in ("interleaved", "split_half"):
        out, _ = _run_rope(x, cos, sin, mode, x.shape[-1])
        want = rope_reference(x, cos, sin, mode, x.shape[-1])
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), mode


# -- sd.rope_apply_rounded.v1: each product rounded to x's dtype ----------------------------------

ROUNDED = "sd.rope_apply_rounded.v1"


def _chain_16bit(x, cos, sin, mode, n_rot):
    """The rotation as torch ops in x's dtype (each product and the sum rounded), the meaning of
    the rounded op: x * cos + rotate(x) * sin on the first n_rot features."""
    rot, rest = x[..., :n_rot], x[..., n_rot:]
    if mode == "interleaved":
        a, b = rot.unflatten(-1, (-1, 2)).unbind(-1)
        rotated = torch.stack([-b, a], dim=-1).flatten(-2)
    else:
        a, b = rot.chunk(2, dim=-1)
        rotated = torch.cat([-b, a], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


def _bit_exact_cases(test):
    """The dtypes, modes, head sizes and layouts of the variants' bit-for-bit kernel tests."""
    for name, values, kw in (
            ("kind", ["bhsd", "bshd", "qkv_slice", "per_batch_strided_cos"], {}),
            ("D, n_rot", [(6, 6), (10, 4), (40, 40)], {}),
            ("mode", ["interleaved", "split_half"], {}),
            ("dtype", [torch.bfloat16, torch.float16, torch.float32],
             {"ids": lambda v: str(v).replace("torch.", "")})):
        test = pytest.mark.parametrize(name, values, **kw)(test)
    return test


@_bit_exact_cases
def test_rounded_op_is_the_chain_in_x_dtype_bit_for_bit(dtype, mode, D, n_rot, kind):
    """Tables in x's dtype, as Wan's are: the CPU kernel, the reference and torch's ops in that
    dtype agree in every bit; for float32 the rounded op is sd.rope_apply.v1."""
    gen = torch.Generator().manual_seed(D * 7 + n_rot)
    x, cos, sin = _layout(kind, D, n_rot, dtype, gen)
    cos, sin = cos.to(dtype), sin.to(dtype)
    out, steps = _run_rope(x, cos, sin, mode, n_rot, ROUNDED)
    assert steps == {"rope_apply_rounded_cpu": 1}
    want = _chain_16bit(x, cos, sin, mode, n_rot)
    assert torch.equal(rope_reference(x, cos, sin, mode, n_rot, "each_op"), want)
    assert torch.equal(out, want)
    if dtype == torch.float32:
        assert torch.equal(out, rope_reference(x, cos, sin, mode, n_rot))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounded_op_over_every_16bit_pattern(dtype):
    """Every finite bit pattern of x against float32-valued 16-bit tables, subnormal products
    included: the kernel's roundings are torch's."""
    gen = torch.Generator().manual_seed(3)
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    x = bits[torch.isfinite(bits.float())]
    x = x[: x.numel() // 64 * 64].reshape(-1, 4, 16)
    cos, sin = (t.to(dtype) for t in _freqs((4, 16), 16, gen=gen))
    cos[0, :2] = torch.finfo(dtype).tiny
    for mode in ("interleaved", "split_half"):
        out, _ = _run_rope(x, cos, sin, mode, 16, ROUNDED)
        want = _chain_16bit(x, cos, sin, mode, 16)
        assert torch.equal(out.view(torch.int16), want.view(torch.int16)), mode


def test_rounded_op_differs_from_the_single_rounding_in_16bit():
    """The two ops are different functions in bf16 (why the rounded one exists)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(64, 32, generator=gen).to(torch.bfloat16)
    cos, sin = (t.to(torch.bfloat16) for t in _freqs((64, 32), 32, gen=gen))
    once, _ = _run_rope(x, cos, sin, "interleaved", 32)
    each, _ = _run_rope(x, cos, sin, "interleaved", 32, ROUNDED)
    assert not torch.equal(once, each)


def test_rounded_launcher_rejects_an_unknown_rounding():
    x = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="rounding"):
        cpu_rope.rope_apply_cpu(x, x, x, "interleaved", 8, rounding="twice")
    with pytest.raises(ValueError, match="rounding"):
        rope_reference(x, x, x, "interleaved", 8, rounding="twice")


# -- sd.rope_apply_f64.v1: float64 maths, rounded once (Lumina 2's complex128 product) ------------

F64 = "sd.rope_apply_f64.v1"


def _float64_like(t: torch.Tensor, gen) -> torch.Tensor:
    """A float64 table with ``t``'s shape and strides and values finer than float32's."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=torch.float64)
    return out.copy_(t.double() + torch.rand(t.shape, generator=gen, dtype=torch.float64) * 1e-9)


def _complex128_chain(x, freqs):
    """Lumina 2's eager RoPE: ``view_as_complex(x.float()) * freqs`` (complex128), back to x's
    dtype with ``type_as``."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs).flatten(-2).type_as(x)


@_bit_exact_cases
def test_f64_op_kernel_is_the_reference_bit_for_bit(dtype, mode, D, n_rot, kind):
    """Float64 tables in the layouts models give: the CPU kernel's float64 products and sums,
    rounded once in the store, are the reference's in every bit."""
    gen = torch.Generator().manual_seed(D * 5 + n_rot)
    x, cos, sin = _layout(kind, D, n_rot, dtype, gen)
    cos, sin = _float64_like(cos, gen), _float64_like(sin, gen)
    out, steps = _run_rope(x, cos, sin, mode, n_rot, F64)
    assert steps == {"rope_apply_f64_cpu": 1}
    want = rope_reference(x, cos, sin, mode, n_rot, compute=torch.float64)
    assert out.dtype == dtype and torch.equal(out, want)
    assert torch.equal(out[..., n_rot:], x[..., n_rot:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda v: str(v).replace("torch.", ""))
def test_f64_op_is_the_complex128_product_bit_for_bit(dtype):
    """The op on the tables of complex128 frequencies (each real and imaginary part twice) is
    Lumina 2's eager product, for 16-bit x over every finite bit pattern, where float32 maths
    (sd.rope_apply.v1 on the same tables) is not: why the op exists.  Float32 maths differs at
    40% of float32 outputs; at 16-bit ones only where a float32 rounding moves a result across
    a 16-bit rounding boundary (measured at [4096, 64, 128]: 879 of 33.5M bf16 outputs, 5415
    fp16 ones), too rarely for this test's few thousand values to show."""
    gen = torch.Generator().manual_seed(6)
    x = _exhaustive_x(dtype, gen)
    d = x.shape[-1]
    ang = torch.rand(4, d // 2, generator=gen, dtype=torch.float64) * 6.3
    freqs = torch.polar(torch.ones_like(ang), ang)
    cos, sin = (torch.view_as_real(freqs)[..., i].repeat_interleave(2, -1) for i in (0, 1))
    out, steps = _run_rope(x, cos, sin, "interleaved", d, F64)
    assert steps == {"rope_apply_f64_cpu": 1}
    want = _complex128_chain(x, freqs)
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
    if dtype == torch.float32:
        in_float32 = rope_reference(x, cos.float(), sin.float(), "interleaved", d)
        assert not torch.equal(in_float32, want)


def test_f64_op_declines_float32_tables_and_runs_native():
    # float32 tables are a meaningful f64 node (converted exactly), but not the kernel's types
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(B, H, S, 8, generator=gen)
    cos, sin = _freqs((S, 8), 8, gen=gen)
    out, steps = _run_rope(x, cos, sin, "interleaved", 8, F64)
    assert steps == {"native": 1}
    assert torch.equal(out, rope_reference(x, cos, sin, "interleaved", 8, compute=torch.float64))
    with pytest.raises(ValueError, match="compute"):
        rope_reference(x, cos, sin, "interleaved", 8, "each_op", torch.float64)


def test_a_flux_q_from_fused_qkv_through_view_nodes():
    """The realistic graph: qkv [B, S, 3*H*D] -> slice -> view -> transpose -> rope; the kernel
    reads the strided view in place (no copy step)."""
    aten = torch.ops.aten
    Bq, Sq, Hq, Dq = 1, 9, 2, 16
    from fxbackend import Graph
    g = Graph()
    qkv_t = torch.randn(Bq, Sq, 3 * Hq * Dq)
    cos_t, sin_t = _freqs((Sq, Dq), Dq)
    qkv, cos, sin = (_input(g, t) for t in (qkv_t, cos_t, sin_t))
    k = _view(g, qkv, aten.slice.Tensor, -1, Hq * Dq, 2 * Hq * Dq)
    k = _view(g, k, aten.view.default, [Bq, Sq, Hq, Dq])
    k = _view(g, k, aten.transpose.int, 1, 2)
    assert k.meta.stride == (Sq * 3 * Hq * Dq, Dq, 3 * Hq * Dq, 1)
    set_outputs(g, fxbackend.op_create(g, OP, [k, cos, sin], {"mode": "interleaved",
                                                              "n_rot": Dq}))
    (out,) = compiled(g)(qkv_t, cos_t, sin_t)
    kx = qkv_t.view(Bq, Sq, 3, Hq, Dq)[:, :, 1].transpose(1, 2)
    torch.testing.assert_close(out, rope_reference(kx, cos_t, sin_t, "interleaved", Dq),
                               rtol=0, atol=0)
    steps = fxbackend.stats()["steps_by_kernel"]
    assert steps.get("rope_apply_cpu") == 1 and fxbackend.stats()["copies"] == 0


def test_kernel_compiles_at_plan_time():
    """The kernel's ``compile`` capability runs when the plan is built, before the first call."""
    from fxbackend import Graph
    x = torch.randn(2, 5, 12).to(torch.float16)
    cos, sin = _freqs((5, 8), 8)
    g = Graph()
    srcs = [_input(g, t) for t in (x, cos, sin)]
    set_outputs(g, fxbackend.op_create(g, OP, srcs, {"mode": "split_half", "n_rot": 8}))
    cg = compiled(g)
    cg.plan_for([x, cos, sin])
    sigs = [tuple(str(a) for a in sig[:4]) for sig in cpu_rope._jit().signatures]
    assert ("array(uint16, 1d, C)", "array(float32, 1d, C)", "array(float32, 1d, C)",
            "array(uint16, 1d, C)") in sigs


def test_other_strides_than_planned_are_read_correctly():
    """The unvalidated fast path (``run``, behind Dynamo's guards) does not check strides: the
    kernel rebuilds its row table when the call's strides differ from the planned metadata
    (never reading out of bounds)."""
    from fxbackend import Graph
    x_planned = torch.randn(B, H, S, 10)
    x_strided = torch.randn(B, S, H, 10).transpose(1, 2)
    cos, sin = _freqs((S, 10), 10)
    g = Graph()
    srcs = [_input(g, t) for t in (x_planned, cos, sin)]
    set_outputs(g, fxbackend.op_create(g, OP, srcs, {"mode": "interleaved", "n_rot": 10}))
    cg = compiled(g)
    for x in (x_planned, x_strided, x_planned):
        (out,) = cg.run([x, cos, sin])
        torch.testing.assert_close(out, rope_reference(x, cos, sin, "interleaved", 10),
                                   rtol=0, atol=0)


def test_launcher_direct_call_and_empty_input():
    x = torch.randn(3, 0, 8)
    cos, sin = _freqs((8,), 8)
    assert cpu_rope.rope_apply_cpu(x, cos, sin, "interleaved", 8).shape == (3, 0, 8)
    x = torch.randn(8)  # a single row: no leading dims
    torch.testing.assert_close(cpu_rope.rope_apply_cpu(x, cos, sin, "interleaved", 8),
                               rope_reference(x, cos, sin, "interleaved", 8), rtol=0, atol=0)
    x = torch.randn(4, 8)
    out = torch.empty_like(x)
    assert cpu_rope.rope_apply_cpu(x, cos, sin, "split_half", 8, out=out) is out
    torch.testing.assert_close(out, rope_reference(x, cos, sin, "split_half", 8), rtol=0, atol=0)
    with pytest.raises(ValueError, match="unsupported input: x dtype torch.float64"):
        cpu_rope.rope_apply_cpu(x.double(), cos, sin, "split_half", 8)


# -- (d) declining: supports() is False, the reference runs ----------------------------------

@pytest.mark.parametrize("case", ["float64_x", "float64_cos", "strided_cos_features",
                                  "cos_feature_broadcast"])
def test_unsupported_cases_decline_and_run_native(case):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(B, H, S, 8, generator=gen)
    cos, sin = _freqs((S, 8), 8, gen=gen)
    if case == "float64_x":
        x = x.double()
    elif case == "float64_cos":
        cos, sin = cos.double(), sin.double()
    elif case == "strided_cos_features":  # [S, 8] with feature stride S (a transposed table)
        cos, sin = cos.t().contiguous().t(), sin.t().contiguous().t()
        assert cos.stride() == (1, S)
    elif case == "cos_feature_broadcast":  # one value per row, broadcast over features
        cos, sin = cos[:, :1], sin[:, :1]
    out, steps = _run_rope(x, cos, sin, "interleaved", 8)
    assert steps == {"native": 1}
    torch.testing.assert_close(out, rope_reference(x, cos, sin, "interleaved", 8), rtol=0,
                               atol=0)


def test_supports_never_raises():
    k = cpu_rope.RopeApplyCPU()
    g, srcs = _nodes((2, 4, 8), (4, 8))
    node = fxbackend.op_create(g, OP, srcs, {"mode": "interleaved", "n_rot": 8})
    assert k.supports(node)
    for broken in ({"mode": "interleaved"}, {}, {"mode": None, "n_rot": "8"}):
        node.params = broken
        assert k.supports(node) is False
    node.params = {"mode": "interleaved", "n_rot": 8}
    node.srcs = node.srcs[:2]
    assert k.supports(node) is False
    node.srcs = [object(), object(), object()]
    assert k.supports(node) is False


def test_numba_cache_dir_default(monkeypatch, tmp_path):
    from fxbackend.cpu_kernels import _numba
    digest = _numba.sources_digest()
    assert re.fullmatch(r"[0-9a-f]{16}", digest)
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cpu_rope.numba_cache_dir() == str(tmp_path / "fxbackend" / "numba" / digest)
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cpu_rope.numba_cache_dir() == str(tmp_path / ".cache" / "fxbackend" / "numba" /
                                             digest)
    monkeypatch.setenv("NUMBA_CACHE_DIR", "/somewhere/else")
    assert cpu_rope.numba_cache_dir() == "/somewhere/else"


def test_numba_cache_digest_follows_every_kernel_source(tmp_path, monkeypatch):
    # numba keys a cached kernel on its own file only: an edit to a helper file it inlines
    # (rope's conversions, ...) must still give a new cache folder
    import shutil

    from fxbackend.cpu_kernels import _numba
    pkg = os.path.dirname(_numba.__file__)
    copy = tmp_path / "cpu_kernels"
    shutil.copytree(pkg, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(_numba, "__file__", str(copy / "_numba.py"))
    monkeypatch.setattr(_numba, "_digest", None)
    first = _numba.sources_digest()
    assert first == _numba.sources_digest()
    with open(copy / "rope.py", "a") as f:
        f.write("\n# an edit\n")
    monkeypatch.setattr(_numba, "_digest", None)
    assert _numba.sources_digest() != first


def test_old_kernel_cache_folders_are_pruned(tmp_path):
    from fxbackend.cpu_kernels import _numba
    now = 2_000_000_000.0
    root = tmp_path / "numba"
    mine, recent, old = (root / d for d in ("0123456789abcdef", "aaaaaaaaaaaaaaaa",
                                            "bbbbbbbbbbbbbbbb"))
    other = root / "not-a-version"
    for d in (mine, recent, old, other):
        (d / "sub").mkdir(parents=True)
    os.utime(mine, (0, 0))
    os.utime(recent, (now - 86400, now - 86400))
    os.utime(old, (now - _numba.PRUNE_AFTER_S - 1, now - _numba.PRUNE_AFTER_S - 1))
    os.utime(other, (0, 0))
    _numba.prune_old_caches(str(mine), now=now)
    assert mine.is_dir() and os.path.getmtime(mine) == now  # marked as used
    assert recent.is_dir() and other.is_dir() and not old.exists()
    _numba.prune_old_caches(str(tmp_path / "gone" / "0123456789abcdef"), now=now)  # no raise


def test_module_import_does_not_import_numba():
    """fxbackend imports its kernels at import time: numba must load only when one compiles
    (for every numba kernel module: rope's, rmsnorm's, rms_rope's)."""
    import subprocess
    import sys
    code = ("import sys, fxbackend, fxbackend.cpu_kernels.rope, fxbackend.cpu_kernels.rmsnorm, "
            "fxbackend.cpu_kernels.rms_rope; print('numba' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"



# -- the numpy arrays the CPU kernels get (cpu_kernels/rope.py ``_flat``) -------------------------

def test_flat_arrays_are_kept_per_tensor_and_follow_its_storage():
    import gc
    import weakref
    t = torch.arange(12, dtype=torch.float32).bfloat16()
    a = cpu_rope._flat(t, 12)
    assert cpu_rope._flat(t, 12) is a  # the second call is a lookup
    assert a.dtype.name == "int16" and torch.equal(torch.from_numpy(a.copy()).view(
        torch.bfloat16), t)  # bf16 as its bits, the same memory
    a[0] = torch.tensor([5.0]).bfloat16().view(torch.int16).item()
    assert t[0].item() == 5.0
    assert cpu_rope._flat(t, 6) is not a and cpu_rope._flat(t, 6).shape == (6,)
    # new storage behind the same tensor object: a new array on it
    t.data = torch.full((12,), 7.0).bfloat16()
    b = cpu_rope._flat(t, 12)
    assert b is not a and torch.equal(torch.from_numpy(b.copy()).view(torch.bfloat16), t)
    # the arrays do not keep the tensor alive; its entry goes with it
    f = torch.ones(4)
    cpu_rope._flat(f, 4)
    key, gone = id(f), weakref.ref(f)
    del f, t
    gc.collect()
    assert gone() is None and key not in cpu_rope._FLAT_CACHE


def test_kernel_threads_follow_torch_per_python_thread():
    """numba's thread count for the CPU kernels follows torch's: set again after
    ``torch.set_num_threads`` changes it, and set in a new Python thread (numba's count is per
    thread) before its first kernel there."""
    import threading

    import numba
    old = torch.get_num_threads()
    try:
        for threads in (1, 2, old):
            torch.set_num_threads(threads)
            want = min(threads, numba.config.NUMBA_NUM_THREADS)
            assert cpu_rope._set_threads() == want
            assert numba.get_num_threads() == want
        torch.set_num_threads(1)  # a new thread starts at numba's default (all cores)
        assert cpu_rope._set_threads() == 1
        got = []
        worker = threading.Thread(target=lambda: got.append((cpu_rope._set_threads(),
                                                             numba.get_num_threads())))
        worker.start()
        worker.join()
        assert got == [(1, 1)]
    finally:
        torch.set_num_threads(old)
