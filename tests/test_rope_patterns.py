"""RoPE recognition: written-out interleaved RoPE in real graphs becomes sd.rope_apply.v1, and
the idiom-rewrite API it uses."""
from __future__ import annotations

import pytest
import torch
from diffusers.models.embeddings import apply_rotary_emb

import fxbackend
from fxbackend import models
from fxbackend.patterns.rope import RopeIdiom


def _rope_fn(x, cos, sin):
    return apply_rotary_emb(x, (cos, sin), use_real_unbind_dim=-1, sequence_dim=2) * 2


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


def test_flux_every_rope_becomes_the_op():
    model = models.build_model("flux", "tiny")
    inputs = models.make_inputs("flux", "tiny")
    with torch.no_grad():
        ref = models.run_eager(model, inputs)
        out = models.run_eager(torch.compile(model, backend="fxbackend"), inputs)
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    s = fxbackend.stats()
    # tiny Flux: one double-stream and one single-stream block, q and k each
    assert s["rewrites_by_rule"] == {"rope": 4}
    assert s["steps_by_kernel"]["rope_apply_cpu"] == 4


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
