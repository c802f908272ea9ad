"""The ``attention_kv_contiguous`` rewrite (patterns/attention.py): torch's CPU flash attention
gets its keys and values in contiguous ``[B, H, S, D]`` rows (a copy, or the layout of a cast
that only attention reads); q, the output's layout and every result bit stay as they were."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxbackend
from fxbackend.patterns.attention import CPU_ATTENTION_OP

from conftest import capture, rewrites, tiny_model_outputs


def _heads(x, h=4):
    b, s, c = x.shape
    return x.view(b, s, h, c // h).transpose(1, 2)  # [B, H, S, D] with [B, S, H, D] strides


def _attn_step(plan):
    (n,) = [n for n in plan.graph.nodes if n.op == CPU_ATTENTION_OP]
    return n


def _self_attn(x, wq, wk, wv):
    q, k, v = _heads(x @ wq), _heads(x @ wk), _heads(x @ wv)
    o = F.scaled_dot_product_attention(q, k, v)
    return o.transpose(1, 2).reshape(x.shape)


def _args(b=2, s=37, c=64):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, s, c, generator=g)] + \
        [torch.randn(c, c, generator=g) * c ** -0.5 for _ in range(3)]


def test_keys_and_values_become_contiguous_bit_for_bit(no_grad):
    args = _args()
    fxbackend.reset_stats()
    c = capture(_self_attn, *args)  # exact against eager
    assert rewrites("attention_kv_contiguous") == 1
    plan = c.graph.plan_for(args)
    attn = _attn_step(plan)
    q, k, v = (plan.metas[s] for s in attn.srcs[:3])
    assert k.is_contiguous and v.is_contiguous
    assert not q.is_contiguous, "q keeps its [B, S, H, D] strides"
    assert [s.op for s in attn.srcs[1:3]] == ["aten.clone.default"] * 2
    # the output keeps q's layout: the reshape after it stays a view, nothing is copied back
    assert plan.copies == 0


def test_contiguous_keys_and_values_are_left_alone(no_grad):
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v) * 2

    args = [torch.randn(1, 2, 9, 8) for _ in range(3)]
    fxbackend.reset_stats()
    capture(fn, *args)
    assert rewrites("attention_kv_contiguous") == 0


def test_one_copy_when_keys_are_values(no_grad):
    def fn(x):
        kv = _heads(x * 2)
        return F.scaled_dot_product_attention(_heads(x), kv, kv)

    x = torch.randn(1, 11, 16)
    fxbackend.reset_stats()
    c = capture(fn, x)
    assert rewrites("attention_kv_contiguous") == 1
    plan = c.graph.plan_for([x])
    attn = _attn_step(plan)
    assert attn.srcs[1] is attn.srcs[2] and attn.srcs[1].op == "aten.clone.default"


def test_masked_attention_keeps_its_mask(no_grad):
    def fn(x, mask):
        q = _heads(x)
        return F.scaled_dot_product_attention(q, q * 0.5, q + 1, attn_mask=mask)

    x, mask = torch.randn(1, 13, 16), torch.randn(13, 13)
    fxbackend.reset_stats()
    c = capture(fn, x, mask)
    assert rewrites("attention_kv_contiguous") == 1
    attn = _attn_step(c.graph.plan_for([x, mask]))
    assert len(attn.srcs) == 4 and attn.srcs[3].is_input


def test_16bit_casts_write_the_rows_themselves(no_grad):
    """With ``attention_dtype``, k's and v's casts take the contiguous layout: no second copy."""
    args = _args(b=1)
    fxbackend.reset_stats()
    c = capture(_self_attn, *args, options={"attention_dtype": "bfloat16"}, check=False)
    assert rewrites("attention_kv_contiguous") == 1
    attn = _attn_step(c.graph.plan_for(args))
    assert [s.op for s in attn.srcs[:3]] == ["aten._to_copy.default"] * 3
    assert [s.meta.is_contiguous for s in attn.srcs[:3]] == [False, True, True]
    # the same numbers as attention in bf16 on the same casts
    x, wq, wk, wv = args
    q, k, v = (_heads(x @ w).to(torch.bfloat16) for w in (wq, wk, wv))
    want = F.scaled_dot_product_attention(q, k, v).float().transpose(1, 2).reshape(x.shape)
    torch.testing.assert_close(c.out, want, rtol=0, atol=0)


@pytest.mark.parametrize("family,count", [("flux", 2), ("sd3", 1), ("pixart", 4), ("unet", 8)])
def test_models(family, count, no_grad):
    """Counts in the README's table (tiny configs); SD3's joint attention concatenates q, k
    and v into contiguous rows already, only its dual-attention layer's self-attention is
    rewritten."""
    got, want = tiny_model_outputs(family)
    assert rewrites("attention_kv_contiguous") == count
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
