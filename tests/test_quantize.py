"""The ``quantize`` option (patterns/quantize.py): eligible linears become one shared
``sd.quantize_i8_convrot.v1`` per input plus ``sd.linear_i8.v1`` steps, ineligible ones stay in
float with the reason in the plan's report, and a weight changed in place is re-quantized."""
from __future__ import annotations

import io
import contextlib

import pytest
import torch
import torch.nn as nn

import fxbackend
import fxbackend.models
from fxbackend.patterns.int8 import linear_i8_reference, quantize_i8_convrot_reference


class _Attn(nn.Module):
    """Three projections of one normalised input, a projection whose K is not a multiple of the
    group, and one whose weight is a user input (not a parameter)."""

    def __init__(self, d=64, odd=36):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d, bias=False)
        self.odd = nn.Linear(odd, d)

    def forward(self, x, y, w_user):
        h = self.norm(x)
        a = self.q(h) * self.k(h) + self.v(h)
        return a + self.odd(y) + y[..., :4].sum() + torch.nn.functional.linear(a, w_user)


def _inputs(seed=0, d=64, odd=36):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 5, d, generator=g), torch.randn(2, 5, odd, generator=g),
            torch.randn(d, d, generator=g) * 0.1)


def _explain(model, args, **opts):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        fxbackend.explain(model, *args, options=opts)
    return buf.getvalue()


def test_shared_quantize_per_input_and_declines_with_reasons():
    torch.manual_seed(0)
    m = _Attn().eval()
    args = _inputs()
    # steps as rewritten, each linear a step of its own (q and k would share one GEMM)
    text = _explain(m, args, quantize="w8a8", convrot_group=16, quantize_min_size=0, fusion=False,
                    disable_rewrites=["merge_w8a8_linears"])
    steps = [ln for ln in text.splitlines() if ln.startswith("%")]
    quantizes = [ln for ln in steps if "sd.quantize_i8_convrot.v1" in ln]
    # q, k, v share one (group 16); odd's K = 36 takes the largest group dividing it, 4
    assert len(quantizes) == 2
    assert "{group=16}" in quantizes[0] and "{group=4}" in quantizes[1]
    assert sum("sd.linear_i8.v1" in ln for ln in steps) == 4
    assert "is a user input, not a parameter or buffer" in text
    with torch.no_grad():
        ref = m(*args)
        out = torch.compile(m, backend="fxbackend",
                            options={"quantize": "w8a8", "convrot_group": 16, "quantize_min_size": 0})(*args)
    cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item()
    assert cos > 0.999


def test_quantized_step_equals_the_references():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32).eval()
    x = torch.randn(7, 64)
    with torch.no_grad():
        out = torch.compile(lin, backend="fxbackend",
                            options={"quantize": "w8a8", "convrot_group": 64, "quantize_min_size": 0})(x)
    packed = quantize_i8_convrot_reference(x, 64)
    want = linear_i8_reference(packed, lin.weight, bias=lin.bias, x_kind="packed",
                               w_kind="float", group=64, m=7, lead=(7,),
                               w_qmax=fxbackend.cpu.int8_weight_max())  # the engine's codes
    assert torch.equal(out, want)


def test_without_the_option_nothing_is_quantized():
    m = _Attn().eval()
    text = _explain(m, _inputs())
    assert "linear_i8" not in text and "quantize_w8a8" not in text


def test_in_place_weight_update_is_requantized_like_a_fresh_compile():
    torch.manual_seed(0)
    model = fxbackend.models.build_model("flux", "tiny")
    inputs = fxbackend.models.make_inputs("flux", "tiny")
    opts = {"quantize": "w8a8", "convrot_group": 16, "quantize_min_size": 0}
    with torch.no_grad():
        fn = torch.compile(model, backend="fxbackend", options=opts)
        before = fxbackend.models.run_eager(fn, inputs)[0].clone()
        w = model.transformer_blocks[0].attn.to_q.weight  # a LoRA-style swap, in place
        w.copy_(w * 0.5 + 0.01)
        after = fxbackend.models.run_eager(fn, inputs)[0]
        torch._dynamo.reset()
        fresh = fxbackend.models.run_eager(torch.compile(model, backend="fxbackend",
                                                         options=opts), inputs)[0]
    assert not torch.equal(before, after)
    assert torch.equal(after, fresh)


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_tiny_models_quantize_every_linear_and_stay_close(family):
    model = fxbackend.models.build_model(family, "tiny")
    inputs = fxbackend.models.make_inputs(family, "tiny")
    with torch.no_grad():
        ref = fxbackend.models.run_eager(model, inputs)[0]
        fxbackend.reset_stats()
        # each linear a step of its own here (the count below); merged as by default below
        opts = {"quantize": "w8a8", "convrot_group": 16, "quantize_min_size": 0}
        out = fxbackend.models.run_eager(
            torch.compile(model, backend="fxbackend",
                          options=dict(opts, disable_rewrites=["merge_w8a8_linears"])),
            inputs)[0]
        s = fxbackend.stats()
        torch._dynamo.reset()
        fxbackend.reset_stats()
        merged = fxbackend.models.run_eager(torch.compile(model, backend="fxbackend",
                                                          options=opts), inputs)[0]
    assert fxbackend.stats()["rewrites_by_rule"]["merge_w8a8_linears"] >= 3  # Q, K and V
    assert torch.equal(merged, out)
    n_linear = sum(isinstance(mod, nn.Linear) for mod in model.modules())
    assert s["rewrites_by_rule"]["quantize_w8a8"] == n_linear
    fused = s["fusions_by_rule"]  # integer GEMMs that the int8 fusions absorbed
    assert s["steps_by_kernel"]["linear_i8_cpu"] + sum(
        fused.get(r, 0) for r in ("int8_gated_residual", "int8_linear_act_quantize",
                                  "int8_linear_act", "int8_linear_cast")) == n_linear
    assert s["steps_by_kernel"]["quantize_i8_convrot_cpu"] < n_linear  # shared by Q, K, V
    cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item()
    assert cos > 0.999


@pytest.mark.parametrize("k,group,want", [(3072, 256, 256), (384, 256, 64), (36, 256, 4),
                                          (3072, 16, 16), (6, 256, 1), (1920, 1, 1)])
def test_group_for_takes_the_largest_group_dividing_k(k, group, want):
    from fxbackend.patterns.quantize import group_for
    assert group_for(k, group) == want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_layer_is_the_float32_step_rounded_once(dtype):
    # a 16-bit linear quantizes its 16-bit input and weight exactly as the float32 step would
    # the same values, then rounds the float32 result to the layer's dtype once
    torch.manual_seed(0)
    lin = nn.Linear(64, 32).to(dtype).eval()
    x = torch.randn(7, 64).to(dtype)
    with torch.no_grad():
        out = torch.compile(lin, backend="fxbackend",
                            options={"quantize": "w8a8", "convrot_group": 64, "quantize_min_size": 0})(x)
    packed = quantize_i8_convrot_reference(x.float(), 64)
    want = linear_i8_reference(packed, lin.weight.float(), bias=lin.bias.float(),
                               x_kind="packed", w_kind="float", group=64, m=7, lead=(7,),
                               w_qmax=fxbackend.cpu.int8_weight_max())
    assert out.dtype == dtype and torch.equal(out, want.to(dtype))


def test_16_bit_model_quantizes_its_layers():
    torch.manual_seed(0)
    m = _Attn().to(torch.bfloat16).eval()
    args = tuple(a.to(torch.bfloat16) for a in _inputs())
    text = _explain(m, args, quantize="w8a8", convrot_group=16, quantize_min_size=0,
                    disable_rewrites=["merge_w8a8_linears"])  # q and k: a step each
    declined = [ln for ln in text.splitlines() if "quantize_w8a8 declined" in ln]
    assert len(declined) == 1 and "is a user input" in declined[0]  # the rest are quantized
    # each 16-bit linear's step writes bf16: its cast is in the fused step (q(h) * k(h) + v(h)
    # is an int8 gated residual, the others int8_linear_cast)
    steps = [ln for ln in text.splitlines() if ln.startswith("%")]
    assert not any("sd.linear_i8.v1" in ln for ln in steps)
    if fxbackend.cpu_profile().decide("bfloat16").choice == "native":  # else the attention's
        assert not any("_to_copy" in ln for ln in steps)  # bmm computes in float32, cast back
    assert text.count("fused int8_linear_cast") == 3
    assert text.count("fused int8_gated_residual") == 1
    with torch.no_grad():
        ref = m.float()(*[a.float() for a in args])
        m.to(torch.bfloat16)
        out = torch.compile(m, backend="fxbackend",
                            options={"quantize": "w8a8", "convrot_group": 16, "quantize_min_size": 0})(*args)
    assert out.dtype == torch.bfloat16
    cos = torch.nn.functional.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0)
    assert cos.item() > 0.999


@pytest.mark.parametrize("family,dtype", [("flux", torch.float32), ("sd3", torch.float32),
                                          ("flux", torch.bfloat16)])
def test_the_prepacked_engines_give_the_same_model_outputs(family, dtype, monkeypatch):
    """Under the AVX2 class (no VNNI) W8A8's int8 GEMM runs through a prepacked engine:
    oneDNN's or fbgemm's, whose float32 result the linear's epilogue and every fused kernel
    after it read as the accumulator.  Same 7-bit codes, same float32 sums: the whole
    model's outputs are bit-identical, and close to eager's."""
    from fxbackend import cpu
    from fxbackend.cpu_kernels import int8 as cpu_int8
    if not (cpu.onednn_linear_available() and cpu.quantized_linear_available()):
        pytest.skip("this torch lacks one of the two quantized linear engines")
    monkeypatch.setenv("FXB_CPU_PROFILE", "avx2")
    torch.manual_seed(0)
    model = fxbackend.models.build_model(family, "tiny", dtype=dtype)
    inputs = fxbackend.models.make_inputs(family, "tiny", dtype=dtype)
    opts = {"quantize": "w8a8", "convrot_group": 16, "quantize_min_size": 0}
    outs, fused, workspace = {}, {}, {}
    for engine in ("onednn_linear", "quantized_linear"):
        monkeypatch.setattr(cpu, "onednn_linear_available", lambda e=engine: e == "onednn_linear")
        monkeypatch.setattr(cpu_int8, "_engines", {})
        assert fxbackend.cpu_profile().decide("int8_gemm").choice == engine
        torch._dynamo.reset()
        fxbackend.reset_stats()
        with torch.no_grad():
            outs[engine] = fxbackend.models.run_eager(
                torch.compile(model, backend="fxbackend", options=opts), inputs)[0]
        fused[engine] = fxbackend.stats()["fusions_by_rule"]
        workspace[engine] = fxbackend.stats()["workspace_bytes"]
    # the engines return new tensors: no fused step reserves the int32 accumulator, which a
    # GEMM writing its accumulator (``torch._int_mm``) has in the step's workspace
    monkeypatch.setattr(cpu_int8.DEVICE, "gemm_writes_acc", lambda w_kind: True)
    torch._dynamo.reset()
    fxbackend.reset_stats()
    with torch.no_grad():
        reserved = fxbackend.models.run_eager(
            torch.compile(model, backend="fxbackend", options=opts), inputs)[0]
    assert fxbackend.stats()["fusions_by_rule"] == fused["onednn_linear"]
    assert torch.equal(reserved, outs["quantized_linear"])
    assert workspace["onednn_linear"] == workspace["quantized_linear"] < \
        fxbackend.stats()["workspace_bytes"]
    assert fused["onednn_linear"] == fused["quantized_linear"]
    assert sum(fused["onednn_linear"].get(r, 0) for r in (
        "int8_gated_residual", "int8_linear_act_quantize", "int8_linear_act",
        "int8_linear_cast")) > 0  # kernels reading the accumulator after the GEMM ran
    assert outs["onednn_linear"].dtype == dtype
    assert torch.equal(outs["onednn_linear"], outs["quantized_linear"])
    with torch.no_grad():
        ref = fxbackend.models.run_eager(fxbackend.models.build_model(family, "tiny"),
                                         fxbackend.models.make_inputs(family, "tiny"))[0]
    cos = torch.nn.functional.cosine_similarity(outs["onednn_linear"].float().flatten(),
                                                ref.flatten(), dim=0).item()
    assert cos > 0.999


class _Projections(nn.Module):
    """Attention's Q, K and V projections of one normalised input (split into heads and
    normalised per head, as Flux does), an MLP projection of the same input (wider, with a
    GELU), and a projection of another input."""

    def __init__(self, d=64, heads=4, qk_norm=True):
        super().__init__()
        self.heads, self.qk_norm = heads, qk_norm
        self.norm = nn.LayerNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.qn, self.kn = nn.RMSNorm(d // heads, eps=1e-6), nn.RMSNorm(d // heads, eps=1e-6)
        self.mlp = nn.Linear(d, 4 * d)
        self.out = nn.Linear(5 * d, d)

    def forward(self, x):
        h = self.norm(x)
        b, t, d = h.shape
        q, k = self.q(h).view(b, t, self.heads, -1), self.k(h).view(b, t, self.heads, -1)
        if self.qk_norm:  # Flux, SD3; a UNet's attention reads q and k as they come
            q, k = self.qn(q), self.kn(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v(h).view(b, t, self.heads, -1).transpose(1, 2)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        a = a.transpose(1, 2).reshape(b, t, d)
        return self.out(torch.cat([a, torch.nn.functional.gelu(self.mlp(h))], dim=-1))


_MERGE = {"quantize": "w8a8", "convrot_group": 16, "quantize_min_size": 0}
_NO_MERGE = dict(_MERGE, disable_rewrites=["merge_w8a8_linears"])


def _run(model, x, opts):
    torch._dynamo.reset()
    with torch.no_grad():
        return torch.compile(model, backend="fxbackend", options=opts)(x)


@pytest.mark.parametrize("dtype,qk_norm", [(torch.float32, True), (torch.bfloat16, True),
                                           (torch.float32, False)])
def test_projections_of_one_input_run_as_one_gemm_with_the_same_result(dtype, qk_norm):
    torch.manual_seed(0)
    m = _Projections(qk_norm=qk_norm).to(dtype).eval()
    x = torch.randn(2, 9, 64, dtype=dtype)
    steps = [ln for ln in _explain(m, (x,), **_MERGE).splitlines() if ln.startswith("%")]
    linears = [ln for ln in steps if "sd.linear_i8.v1" in ln or "int8_linear" in ln]
    # q, k and v: one step of width 3 * 64 (a bf16 layer's cast in it); the wider MLP
    # projection and the output projection keep steps of their own
    short = "f32" if dtype == torch.float32 else "bf16"
    assert sum(f": {short}[18,192]" in ln for ln in linears) == 1, linears
    assert len(linears) == 3, linears
    assert sum("aten.slice.Tensor" in ln and "{192,1}" in ln for ln in steps) == 3
    assert sum("aten.cat.default" in ln and "{dim=0}" in ln for ln in steps) == 2  # W, bias
    merged, separate = _run(m, x, _MERGE), _run(m, x, _NO_MERGE)
    # the same codes and per-channel scales per output column: the same bits
    assert torch.equal(merged, separate)


def test_merged_projections_see_weight_changes_and_fingerprint_only_the_weights(monkeypatch):
    torch.manual_seed(0)
    m = _Projections().eval()
    x = torch.randn(2, 9, 64)
    seen = []
    real = fxbackend.weights._FINGERPRINTS.get("cpu", fxbackend.weights.torch_fingerprint)
    monkeypatch.setitem(fxbackend.weights._FINGERPRINTS, "cpu",
                        lambda t: seen.append(tuple(t.shape)) or real(t))
    torch._dynamo.reset()
    with torch.no_grad():
        fn = torch.compile(m, backend="fxbackend", options=_MERGE)
        before = fn(x).clone()
        seen.clear()
        fn(x)
        # the concatenated weight is checked through the three weights it came from, never
        # read itself per call (its quantized form is keyed by serial number)
        assert (192, 64) not in seen and seen.count((64, 64)) >= 3
        m.k.weight.data.mul_(0.5)  # a write through .data: no version counter moves
        m.v.bias.data.add_(0.25)
        after = fn(x)
    assert not torch.equal(before, after)
    assert torch.equal(after, _run(m, x, _NO_MERGE))


class _ReturnsAProjection(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return self.q(x), self.k(x) * 2


def test_merge_declines_a_projection_that_is_returned():
    torch.manual_seed(0)
    m = _ReturnsAProjection().eval()
    x = torch.randn(2, 9, 64)
    text = _explain(m, (x,), **_MERGE)
    assert "merge_w8a8_linears declined" in text and "is a graph output" in text
    steps = [ln for ln in text.splitlines() if ln.startswith("%")]
    assert sum("sd.linear_i8.v1" in ln for ln in steps) == 2
    for got, want in zip(_run(m, x, _MERGE), _run(m, x, _NO_MERGE)):
        assert torch.equal(got, want)
