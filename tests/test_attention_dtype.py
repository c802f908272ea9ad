"""The ``attention_dtype`` option (patterns/attention.py): float32 flash attention run in 16 bits.

Contracts under test: the rewritten step computes exactly what torch's attention computes on q,
k, v cast to the dtype (then cast back), keeps the output's layout, leaves masked attention in
float32 with a reason in the report, is off by default, and a whole model stays within the
16-bit rounding of eager.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxbackend
from fxbackend.models import build_model, make_inputs
from fxbackend.options import parse_options


def _heads(x):
    return x.view(1, 40, 2, 16).transpose(1, 2)  # [B, H, S, D] with [B, S, H, D] strides


def _attn(x):
    q = _heads(x)
    return F.scaled_dot_product_attention(q, q * 0.5, q + 1).transpose(1, 2).reshape(1, 40, 32) * 2


@pytest.mark.parametrize("name,dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_attention_runs_in_the_dtype_exactly(name, dtype):
    x = torch.randn(40, 32)
    torch._dynamo.reset()
    fxbackend.reset_stats()
    with torch.no_grad(), fxbackend.record_graphs() as graphs:
        got = torch.compile(_attn, backend="fxbackend", options={"attention_dtype": name})(x)
    q = _heads(x)
    low = F.scaled_dot_product_attention(q.to(dtype), (q * 0.5).to(dtype), (q + 1).to(dtype))
    want = low.float().transpose(1, 2).reshape(1, 40, 32) * 2
    assert torch.equal(got, want)
    assert fxbackend.stats()["rewrites_by_rule"]["attention_dtype"] == 1
    plan = graphs[0].plan_for([x])
    (attn,) = [n for n in plan.graph.nodes if "scaled_dot_product" in n.op]
    assert [s.meta.dtype for s in attn.srcs] == [dtype] * 3
    assert attn.srcs[0].meta.stride == (1280, 16, 32, 1), "q keeps its strides"


def test_masked_attention_stays_float32_with_a_reason():
    def fn(x, mask):
        q = _heads(x)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    x, mask = torch.randn(40, 32), torch.randn(40, 40)
    torch._dynamo.reset()
    text = fxbackend.explain(fn, x, mask, options={"attention_dtype": "bfloat16"})
    assert "rewrite attention_dtype declined" in text and "masked attention" in text
    assert "bf16[" not in text


def test_off_by_default_and_option_checks(monkeypatch):
    x = torch.randn(40, 32)
    torch._dynamo.reset()
    text = fxbackend.explain(_attn, x)
    assert "_to_copy" not in text and "bf16[" not in text
    with pytest.raises(ValueError, match="attention_dtype"):
        parse_options({"attention_dtype": "int8"})
    monkeypatch.setenv("FXB_ATTENTION_DTYPE", "float16")
    assert parse_options().attention_dtype == "float16"
    assert parse_options({"attention_dtype": None}).attention_dtype is None


def test_flux_within_bf16_rounding_of_eager():
    model = build_model("flux", "tiny")
    inputs = make_inputs("flux", "tiny")
    torch._dynamo.reset()
    fxbackend.reset_stats()
    with torch.no_grad():
        want = model(**inputs)[0]
        got = torch.compile(model, backend="fxbackend",
                            options={"attention_dtype": "bfloat16"})(**inputs)[0]
    assert fxbackend.stats()["rewrites_by_rule"]["attention_dtype"] == 2  # 1 double + 1 single
    cos = F.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
    assert cos > 0.999 and not torch.equal(got, want)


@pytest.mark.cuda
def test_cuda_attention_runs_in_bfloat16_exactly():
    # float32 attention on CUDA reaches the graph as the efficient (or flash) op
    x = torch.randn(40, 32, device="cuda")
    torch._dynamo.reset()
    fxbackend.reset_stats()
    with torch.no_grad():
        got = torch.compile(_attn, backend="fxbackend",
                            options={"attention_dtype": "bfloat16"})(x)
        q = _heads(x)
        low = F.scaled_dot_product_attention(q.bfloat16(), (q * 0.5).bfloat16(),
                                             (q + 1).bfloat16())
    want = low.float().transpose(1, 2).reshape(1, 40, 32) * 2
    assert fxbackend.stats()["rewrites_by_rule"].get("attention_dtype") == 1
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)  # the kernel may differ by op
