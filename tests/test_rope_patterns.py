"""RoPE recognition: written-out interleaved RoPE in real graphs becomes sd.rope_apply.v1, and
the idiom-rewrite API it uses."""
from __future__ import annotations

import pytest
import torch
from diffusers.models.embeddings import apply_rotary_emb

import fxbackend
from fxbackend.patterns.rope import RopeIdiom


def _rope_fn(x, cos, sin):
    return apply_rotary_emb(x, (cos, sin), use_real_unbind_dim=-1, sequence_dim=2) * 2


def _assert_one_exact_rope(f, args, kernel, n=1):
    """``torch.compile(f)`` equals ``f`` bit for bit, with one (``n``) ``rope`` rewrite run by
    ``kernel``."""
    with torch.no_grad():
        out = torch.compile(f, backend="fxbackend")(*args)
        want = f(*args)
    for o, w in zip(out if isinstance(out, tuple) else (out,),
                    want if isinstance(want, tuple) else (want,)):
        assert torch.equal(o, w)
    stats = fxbackend.stats()
    assert stats["rewrites_by_rule"] == {"rope": n}
    assert stats["steps_by_kernel"][kernel] == n


def _inputs(b=1, h=3, s=5, d=8):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(b, h, s, d, generator=g), torch.randn(s, d, generator=g),
            torch.randn(s, d, generator=g))


def test_interleaved_rope_becomes_one_op_and_stays_exact():
    x, cos, sin = _inputs()
    with torch.no_grad():
        out = torch.compile(_rope_fn, backend="fxbackend")(x, cos, sin)
    assert torch.equal(out, _rope_fn(x, cos, sin))  # same products and sum, same order
    s = fxbackend.stats()
    assert s["rewrites_by_rule"] == {"rope": 1}
    assert s["steps_by_kernel"].get("rope_apply_cpu") == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_split_half_rope_becomes_one_op_and_stays_exact(dtype):
    def f(x, cos, sin):
        return apply_rotary_emb(x, (cos, sin), use_real_unbind_dim=-2, sequence_dim=2) - 1

    x, cos, sin = (t.to(dtype) for t in _inputs(s=7, d=10))
    with torch.no_grad():
        out = torch.compile(f, backend="fxbackend")(x, cos, sin)
    assert torch.equal(out, f(x, cos, sin))
    s = fxbackend.stats()
    if dtype == torch.float32:
        assert s["rewrites_by_rule"] == {"rope": 1}
        assert s["steps_by_kernel"]["rope_apply_cpu"] == 1
    else:
        # diffusers computes x.float() * cos with float64 tables: the products are float64,
        # which the op (float32 maths, x's dtype out) would not reproduce: declined
        assert s["rewrites_by_rule"] == {}


def test_report_shows_the_op_and_no_unbind():
    x, cos, sin = _inputs()
    text = fxbackend.explain(_rope_fn, x, cos, sin)
    assert "sd.rope_apply.v1(" in text and "{mode=interleaved, n_rot=8}" in text
    assert "aten.unbind" not in text and "aten.stack" not in text


def test_not_rewritten_when_an_intermediate_is_read_elsewhere():
    def f(x, cos, sin):
        pairs = x.reshape(*x.shape[:-1], -1, 2)
        real, imag = pairs.unbind(-1)
        rot = torch.stack([-imag, real], dim=-1).flatten(3)
        return x * cos + rot * sin, rot  # rot escapes: the idiom is not self-contained

    x, cos, sin = _inputs()
    with torch.no_grad():
        out = torch.compile(f, backend="fxbackend")(x, cos, sin)
    for o, r in zip(out, f(x, cos, sin)):
        assert torch.equal(o, r)
    assert fxbackend.stats()["rewrites_by_rule"] == {}


def test_not_rewritten_when_the_multiply_broadcasts_x():
    # cos with more rows than x: the product is larger than x, so it is not a rotation of x
    x, _, _ = _inputs(b=1, h=1, s=5)
    cos, sin = torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8)
    with torch.no_grad():
        out = torch.compile(_rope_fn, backend="fxbackend")(x, cos, sin)
    assert torch.equal(out, _rope_fn(x, cos, sin))
    assert fxbackend.stats()["rewrites_by_rule"] == {}


def test_register_rewrite_rejects_duplicates_and_malformed_rules():
    with pytest.raises(ValueError, match="already registered"):
        fxbackend.register_rewrite(RopeIdiom)

    class NoRewrite:
        name = "broken"

    with pytest.raises(TypeError, match="rewrite"):
        fxbackend.register_rewrite(NoRewrite)


def test_rewrite_rules_are_plain_extensions():
    seen = []

    class Counter_:
        name = "test_counting_rewrite"

        def rewrite(self, graph):
            seen.append(len(graph.nodes))
            return 0

    rule = fxbackend.register_rewrite(Counter_)
    try:
        with torch.no_grad():
            torch.compile(lambda x: x.sin() + 1, backend="fxbackend")(torch.randn(3))
    finally:
        fxbackend.unregister_rewrite(rule)
    assert len(seen) == 1 and seen[0] >= 3


def test_rewrite_rules_may_take_a_context_with_options_and_declines():
    got = []

    class Sines:
        name = "test_context_rewrite"

        def rewrite(self, graph, ctx):
            got.append(ctx.options.quantize)
            sines = [n for n in graph.nodes if n.op == "aten.sin.default"]
            ctx.decline(sines, "declined on purpose")
            return 0

    rule = fxbackend.register_rewrite(Sines)
    try:
        text = fxbackend.explain(lambda x: x.sin() + 1, torch.randn(3),
                                 options={"quantize": "w8a8", "quantize_min_size": 0})
    finally:
        fxbackend.unregister_rewrite(rule)
    assert got == ["w8a8"]
    assert "rewrite test_context_rewrite declined on %" in text
    assert text.count("declined on purpose") == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("unbind_dim", [-1, -2])
def test_16bit_rope_with_float_casts_becomes_one_op_and_stays_exact(dtype, unbind_dim):
    # diffusers: (x.float() * cos + x_rotated.float() * sin).to(x.dtype)
    def f(x, cos, sin):
        return apply_rotary_emb(x, (cos, sin), use_real_unbind_dim=unbind_dim, sequence_dim=2) * 2

    x, cos, sin = _inputs(s=7, d=10)
    _assert_one_exact_rope(f, (x.to(dtype), cos, sin), "rope_apply_cpu")


def test_16bit_rope_kept_in_float32_is_not_rewritten():
    # the float32 sum is the result (no cast back): the op (x's dtype out) would round it
    def f(x, cos, sin):
        pairs = x.reshape(*x.shape[:-1], -1, 2)
        real, imag = pairs.unbind(-1)
        rot = torch.stack([-imag, real], dim=-1).flatten(3)
        return x.float() * cos + rot.float() * sin

    x, cos, sin = _inputs()
    x = x.to(torch.bfloat16)
    with torch.no_grad():
        out = torch.compile(f, backend="fxbackend")(x, cos, sin)
    assert torch.equal(out, f(x, cos, sin))
    assert fxbackend.stats()["rewrites_by_rule"] == {}


def _complex_rope(x, freqs):
    # diffusers' complex form (Lumina): x [B, S, H, D], freqs [B, S, D/2] complex64
    return apply_rotary_emb(x, freqs, use_real=False) + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_complex_rope_becomes_tables_and_one_op(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 3, 16, generator=g).to(dtype)
    freqs = torch.polar(torch.ones(2, 7, 8), torch.randn(2, 7, 8, generator=g) * 3)
    with torch.no_grad():
        out = torch.compile(_complex_rope, backend="fxbackend")(x, freqs)
    ref = _complex_rope(x, freqs)
    # (a + ib)(c + id) = (ac - bd) + i(bc + ad): the same products and sums as the op
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    s = fxbackend.stats()
    assert s["rewrites_by_rule"] == {"rope": 1}
    assert s["steps_by_kernel"]["rope_apply_cpu"] == 1
    text = fxbackend.explain(_complex_rope, x, freqs)
    assert "view_as_complex" not in text and "sd.rope_tables.v1(%" in text


def test_complex_rope_not_rewritten_when_freqs_broadcast_x():
    def f(x, freqs):
        xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs).flatten(-2)

    x = torch.randn(1, 5, 8)
    freqs = torch.polar(torch.ones(3, 5, 4), torch.randn(3, 5, 4))  # more rows than x
    with torch.no_grad():
        out = torch.compile(f, backend="fxbackend")(x, freqs)
    assert torch.equal(out, f(x, freqs))
    assert fxbackend.stats()["rewrites_by_rule"] == {}


def test_rope_tables_op_rejects_real_freqs():
    from fxbackend.patterns.rope import RopeTables
    m = fxbackend.TensorMeta((5, 4), (4, 1), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="complex64"):
        RopeTables().infer_meta([m], {"part": "cos"})
    c = fxbackend.TensorMeta((5, 4), (4, 1), torch.complex64, torch.device("cpu"))
    with pytest.raises(ValueError, match="part"):
        RopeTables().infer_meta([c], {"part": "tan"})
    assert RopeTables().infer_meta([c], {"part": "sin"}).shape == (5, 8)
    c128 = fxbackend.TensorMeta((5, 4), (4, 1), torch.complex128, torch.device("cpu"))
    assert RopeTables().infer_meta([c128], {"part": "cos"}).dtype == torch.float64


# -- Lumina 2's form: complex128 frequencies ------------------------------------------------------

def _freqs64(b=2, s=7, half=8, seed=1):
    """Frequencies as Lumina 2 builds them (``get_1d_rotary_pos_embed`` in float64): complex128."""
    g = torch.Generator().manual_seed(seed)
    ang = torch.randn(b, s, half, generator=g, dtype=torch.float64) * 3
    return torch.polar(torch.ones_like(ang), ang)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["f32", "bf16", "fp16"])
def test_complex128_rope_becomes_the_float64_op_bit_for_bit(dtype):
    """view_as_complex(x.float()) * complex128 freqs is a complex128 product: float64 maths,
    rounded once at type_as(x).  sd.rope_apply_f64.v1 computes exactly that."""
    x = torch.randn(2, 7, 3, 16, generator=torch.Generator().manual_seed(2)).to(dtype)
    freqs = _freqs64()
    _assert_one_exact_rope(_complex_rope, (x, freqs), "rope_apply_f64_cpu")
    text = fxbackend.explain(_complex_rope, x, freqs)
    assert "sd.rope_apply_f64.v1(%" in text and "sd.rope_tables.v1(%" in text
    assert "view_as_complex" not in text


def test_complex128_rope_kept_in_float64_is_not_rewritten():
    # no cast back: the float64 result is the output, which no op of x's dtype gives
    def f(x, freqs):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs.unsqueeze(2)).flatten(3)

    x, freqs = torch.randn(2, 7, 3, 16), _freqs64()
    with torch.no_grad():
        out = torch.compile(f, backend="fxbackend")(x, freqs)
    assert out.dtype == torch.float64 and torch.equal(out, f(x, freqs))
    assert fxbackend.stats()["rewrites_by_rule"] == {}


# -- rotation matrices: Flux's reference code, ComfyUI, HiDream ------------------------------------

def _matrix_rope(xq, xk, freqs_cis):
    """RoPE as the original Flux code, ComfyUI and diffusers' HiDream write it (2x2 matrices
    per pair: ``freqs_cis`` [..., D/2, 2, 2])."""
    from diffusers.models.transformers.transformer_hidream_image import apply_rope
    q, k = apply_rope(xq, xk, freqs_cis)
    return q * 2, k + 1


def _matrix_inputs(dtype, b=1, s=10, h=2, d=12, matrices="rotation"):
    """q and k [B, S, H, D] and [B, S, 1, D/2, 2, 2] matrices: HiDream's rotations (``rope``
    of positions, float32), or any values."""
    from diffusers.models.transformers.transformer_hidream_image import rope
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(b, s, h, d, generator=g).to(dtype) for _ in range(2))
    if matrices == "rotation":
        pos = (torch.arange(b * s, dtype=torch.float64).view(b, s) * 7) % 11
        f = rope(pos, d, 10000).unsqueeze(2)
    else:
        f = torch.randn(b, s, 1, d // 2, 2, 2, generator=g)
    return q, k, f


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["f32", "bf16", "fp16"])
@pytest.mark.parametrize("matrices", ["rotation", "any"])
def test_matrix_rope_becomes_the_op_bit_for_bit(dtype, matrices):
    """Each of q and k becomes one interleaved sd.rope_apply.v1 whose tables come from the
    matrices' entries, bit for bit eager's even for matrices that are no rotation (the tables
    take each entry where the matrix form uses it, so nothing about F is assumed)."""
    args = _matrix_inputs(dtype, matrices=matrices)
    if matrices == "rotation":
        f = args[2]
        assert torch.equal(f[..., 0, 0], f[..., 1, 1]) and torch.equal(f[..., 0, 1], -f[..., 1, 0])
    _assert_one_exact_rope(_matrix_rope, args, "rope_apply_cpu", n=2)
    text = fxbackend.explain(_matrix_rope, *args)
    assert text.count("sd.rope_apply.v1(%") == 2 and "{mode=interleaved, n_rot=12}" in text


def test_matrix_rope_on_part_of_the_head_stays_exact():
    # HiDream rotates the first half of the head when its tables are shorter: chunk, rope, cat
    def f(q, k, fc):
        q1, q2 = q.chunk(2, dim=-1)
        k1, k2 = k.chunk(2, dim=-1)
        q1, k1 = _matrix_rope(q1, k1, fc)
        return torch.cat([q1, q2], -1), torch.cat([k1, k2], -1)

    q, k, _ = _matrix_inputs(torch.bfloat16, d=16)
    _, _, fc = _matrix_inputs(torch.bfloat16, d=8)
    _assert_one_exact_rope(f, (q, k, fc), "rope_apply_cpu", n=2)


@pytest.mark.parametrize("case", ["float64_matrices", "even_features_twice",
                                  "pair_read_elsewhere"])
def test_matrix_rope_declines(case):
    q, k, fc = _matrix_inputs(torch.float32)
    if case == "float64_matrices":  # float64 products: not the op's float32 maths
        fc = fc.double()

    def f(q, k, fc):
        q_ = q.reshape(*q.shape[:-1], -1, 1, 2)
        if case == "pair_read_elsewhere":
            out = fc[..., 0] * q_[..., 0] + fc[..., 1] * q_[..., 1]
            return out.reshape(*q.shape), q_ * 2  # q_ escapes
        if case == "even_features_twice":  # x[2i+1] unread: no rotation of the pairs
            return (fc[..., 0] * q_[..., 0] + fc[..., 1] * q_[..., 0]).reshape(*q.shape), k
        return _matrix_rope(q, k, fc)

    with torch.no_grad():
        got = torch.compile(f, backend="fxbackend")(q, k, fc)
        want = f(q, k, fc)
    for g_, w in zip(got, want):
        assert torch.equal(g_, w)
    assert "rope" not in fxbackend.stats()["rewrites_by_rule"]


def test_unregister_rewrite_by_class_and_unknown_rule():
    class Noop:
        name = "test_unregister_noop"

        def rewrite(self, graph):
            return 0

    instance = fxbackend.register_rewrite(Noop)
    assert fxbackend.unregister_rewrite(Noop) is instance  # the class finds its instance
    assert all(r.name != "test_unregister_noop" for r in fxbackend.rewrite.rewrites())
    with pytest.raises(ValueError, match="not a registered rewrite rule"):
        fxbackend.unregister_rewrite(Noop)
    with pytest.raises(ValueError, match="not a registered rewrite rule"):
        fxbackend.unregister_rewrite(instance)


# -- Wan's form: strided slice writes into an empty tensor ----------------------------------------

def _wan_rope(x, freqs_cos, freqs_sin, order="wan"):
    """RoPE as diffusers' WanAttnProcessor writes it ([B, S, H, D] x, [1, S, 1, D] tables
    whose values come in equal pairs); ``order`` "swapped" writes the same maths with every
    product's factors and the odd features' sum in the other order."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    if order == "wan":
        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x1 * sin + x2 * cos
    else:
        out[..., 0::2] = cos * x1 - sin * x2
        out[..., 1::2] = cos * x2 + sin * x1
    return out.type_as(x)


def _wan_inputs(b=1, s=6, h=2, d=12, dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    ang = torch.randn(s, d // 2, generator=g).repeat_interleave(2, dim=-1)[None, :, None]
    return (torch.randn(b, s, h, d, generator=g).to(dtype), ang.cos(), ang.sin())


@pytest.mark.parametrize("order", ["wan", "swapped"])
def test_wan_strided_rope_becomes_one_op_and_stays_exact(order):
    x, c, s_ = _wan_inputs()

    def f(x, c, s_):
        return _wan_rope(x, c, s_, order) + 1

    # exact: x1*c - x2*s is x1*c + (-x2)*s
    _assert_one_exact_rope(f, (x, c, s_), "rope_apply_cpu")
    text = fxbackend.explain(f, x, c, s_)
    assert "{mode=interleaved, n_rot=12}" in text and "slice_scatter" not in text


def test_wan_strided_rope_with_unpaired_tables_stays_exact():
    # tables whose even and odd values differ: the op's tables repeat the values the chain
    # reads (cos at even features, sin at odd ones), so the result is still the chain's
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, 3, 8, generator=g)
    c, s_ = torch.randn(1, 5, 1, 8, generator=g), torch.randn(1, 5, 1, 8, generator=g)
    with torch.no_grad():
        out = torch.compile(_wan_rope, backend="fxbackend")(x, c, s_)
    assert torch.equal(out, _wan_rope(x, c, s_))
    assert fxbackend.stats()["rewrites_by_rule"] == {"rope": 1}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("order", ["wan", "swapped"])
def test_wan_strided_rope_in_16bit_becomes_the_rounded_op_bit_for_bit(dtype, order):
    """x and tables in one 16-bit dtype (Wan run in bf16): each product and the sum round to
    it, so the chain is sd.rope_apply_rounded.v1 and the result keeps every bit."""
    x, c, s_ = _wan_inputs(dtype=dtype)
    c, s_ = c.to(dtype), s_.to(dtype)

    def f(x, c, s_):
        return _wan_rope(x, c, s_, order) * 2

    _assert_one_exact_rope(f, (x, c, s_), "rope_apply_rounded_cpu")
    text = fxbackend.explain(f, x, c, s_)
    assert "sd.rope_apply_rounded.v1" in text and "slice_scatter" not in text


@pytest.mark.parametrize("case", ["bf16_x_float32_tables", "half_read_elsewhere",
                                  "sum_not_rotation"])
def test_wan_strided_rope_declines(case):
    # bf16 x with float32 tables: the products promote to float32 and the writes round back,
    # which is neither op's rounding
    x, c, s_ = _wan_inputs(dtype=torch.bfloat16 if case.startswith("bf16") else torch.float32)

    def f(x, c, s_):
        if case == "half_read_elsewhere":
            x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
            out = torch.empty_like(x)
            out[..., 0::2] = x1 * c[..., 0::2] - x2 * s_[..., 1::2]
            out[..., 1::2] = x1 * s_[..., 1::2] + x2 * c[..., 0::2]
            return out, x1 * 2  # x1 escapes
        if case == "sum_not_rotation":  # the odd features take x1 * c: not a rotation
            x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
            out = torch.empty_like(x)
            out[..., 0::2] = x1 * c[..., 0::2] - x2 * s_[..., 1::2]
            out[..., 1::2] = x1 * c[..., 0::2] + x2 * s_[..., 1::2]
            return out
        return _wan_rope(x, c, s_)

    with torch.no_grad():
        got = torch.compile(f, backend="fxbackend")(x, c, s_)
        want = f(x, c, s_)
    for g_, w in zip(got if isinstance(got, tuple) else (got,),
                     want if isinstance(want, tuple) else (want,)):
        assert torch.equal(g_, w)
    assert "rope" not in fxbackend.stats()["rewrites_by_rule"]
