"""Activations after a linear: the ``linear_act`` / ``linear_glu`` fusion rules
(patterns/activation.py), the numba CPU kernel (cpu_kernels/activation.py) and the Triton kernel
(cuda_kernels/activation.py, in Triton's interpreter; real sizes when a GPU is present).

Tolerances: float32 to 1e-5 (the GEMM is the same call; the activation differs from torch's by a
few ulp: torch's vectorised Sleef/oneDNN functions vs the written-out ones); 16-bit within one
rounding of the output dtype."""
from __future__ import annotations

import pytest
import torch
from diffusers.models.attention import FeedForward

import fxbackend
import fxbackend.cpu_kernels.activation  # noqa: F401  (registers the CPU rules)
import fxbackend.cuda_kernels.activation  # noqa: F401  (registers the CUDA rules)
from fxbackend.cpu_kernels.activation import (LinearActCPU, activate_cpu, cast_activate_cpu,
                                              glu_cpu)
from fxbackend.patterns.activation import (ACTS, LinearActFusion, ReferenceLinearAct,
                                           act_reference, linear_act_reference)

from ext_util import eager_and_compiled, rule_on_top
import _rope_interp_check as interp

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
#: (atol, rtol) per dtype: float32 as the brief asks, 16-bit one unit in the last place
TOL = {F32: (1e-5, 1e-5), BF16: (2.0 ** -7, 2.0 ** -7), F16: (2.0 ** -10, 2.0 ** -10)}
SHAPES = [(1, 5, 3), (7, 33, 19), (130, 64, 257)]  # (M, K, N): odd, a row of one, > one chunk


def _operands(m, k, n2, dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 2).to(dtype)
    w = torch.randn(n2, k, generator=g).to(dtype).t()  # t(W), strided as in the chain
    b = torch.randn(n2, generator=g).to(dtype) if bias else None
    return x, w, b


# -- the CPU kernel against the reference -----------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("act", ACTS)
def test_activation_accuracy_against_torch(act, dtype):
    # dense values over the range that matters, incl. the tails (|x| up to 12)
    x = torch.cat([torch.linspace(-12, 12, 200_001), torch.randn(10_000) * 3]).to(dtype)
    got = activate_cpu(x.clone(), act)
    want = act_reference(x, act)
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err < (1e-6 if dtype == F32 else TOL[dtype][0]), err
    if dtype != F32:  # at most one rounding apart, nearly all equal (erf: torch's 16-bit
        # gelu goes through oneDNN's erf, ours is the A&S formula of its vectorised path)
        assert (got == want).float().mean() > (0.95 if act == "gelu" else 0.99)


def _gelu_tanh_f64(x: torch.Tensor) -> torch.Tensor:
    """The tanh GELU in float64 as x * sigmoid(2z) (no cancellation in the negative tail)."""
    x = x.double()
    z = (2 / torch.pi) ** 0.5 * (x + 0.044715 * x ** 3)
    return x * torch.sigmoid(2 * z)


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest relative error of ``got`` where ``want`` is not (nearly) zero."""
    m = want.abs() > 1e-30
    return ((got - want).abs()[m] / want.abs()[m]).max().item()


def test_float32_tanh_gelu_keeps_relative_accuracy_in_the_negative_tail():
    # float32 results come from x / (1 + exp(-2z)): no cancellation of 1 + tanh(z), so tiny
    # negative values keep their relative accuracy where torch's float32 form returns 0
    x = torch.linspace(-12, 12, 240_001)
    want = _gelu_tanh_f64(x)
    nz = want.abs() > 1e-30
    got = activate_cpu(x.clone(), "gelu_tanh").double()
    # the float32 rounding of z, amplified by exp where |z| ~ 40: about 1e-5 relative
    assert _max_rel(got, want) < 2e-5
    assert (got[nz] < 0).sum() == (want[nz] < 0).sum()  # no tail value flushed to 0
    assert got[0] < 0 and torch.nn.functional.gelu(x[:1], approximate="tanh").item() == 0
    strided = x[:240_000].clone().view(1200, 200)[:, :150]  # rows of a concatenation
    want_strided = _gelu_tanh_f64(strided)
    assert _max_rel(activate_cpu(strided, "gelu_tanh").double(), want_strided) < 2e-5
    ends = activate_cpu(torch.tensor([float("inf"), float("nan"), 0.0, -0.0, 1e30]),
                        "gelu_tanh")
    assert ends[0] == float("inf") and ends[1].isnan() and ends[2] == 0 and ends[4] == 1e30


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_16bit_tanh_gelu_rounds_as_torch_in_the_negative_tail(dtype):
    # 16-bit results keep torch's 0.5 x (1 + tanh(z)): its roundings of the small negative
    # values are what a 16-bit model compared bit for bit with eager gets.  On [-9, -2] that
    # form rounds as torch in about 98% of the values (its tanh and torch's Sleef tanh differ
    # by an ulp here and there, which the cancellation in 1 + tanh amplifies); the float32
    # form x / (1 + exp(-2z)) would in 33% (bf16) / 87% (fp16)
    x = torch.linspace(-9, -2, 7001).to(dtype)
    got = activate_cpu(x.clone(), "gelu_tanh")
    want = act_reference(x, "gelu_tanh")
    assert (got == want).float().mean() > 0.95


def test_float32_gelu_tanh_is_one_function_in_every_pass():
    # in place, in place plus bias, gated and the INT8 act_quantize's activation give the same
    # float32 values for the same inputs (one element function for float32 results)
    import fxbackend.cpu_kernels.int8_fusions as cpu_f
    g = torch.Generator().manual_seed(3)
    y = torch.randn(64, 96, generator=g) * 4
    a = activate_cpu(y.clone(), "gelu_tanh")
    b = activate_cpu(y.clone(), "gelu_tanh", torch.zeros(96))
    ones = torch.ones(64, 96)
    out = torch.empty(64, 96)
    glu_cpu(torch.cat([y, ones], 1), out, "gelu_tanh", 0)
    assert torch.equal(a, b) and torch.equal(a, out)
    fused = cpu_f.act_quantize_cpu(y, act="gelu_tanh")
    assert torch.equal(fused, cpu_f.act_quantize_cpu(a))  # codes and scales of the same values


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("gated,gate", [(False, None), (True, 1), (True, 0)])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_cpu_kernel_matches_reference(m, k, n, gated, gate, act, dtype):
    n2 = 2 * n if gated else n
    x, w, b = _operands(m, k, n2, dtype, bias=(n % 2 == 1))
    out = torch.full((m, n), float("nan"), dtype=dtype)
    y = torch.empty(m, n2, dtype=dtype) if gated else out
    LinearActCPU().run(x, w, b, y, out, act=act, gate=gate, beta=1, alpha=1)
    want = linear_act_reference(x, w, b, act, gate)
    atol, rtol = TOL[dtype]
    scale = want.float().abs().max().item()
    torch.testing.assert_close(out, want, atol=atol * scale, rtol=rtol)


def test_glu_kernel_reads_strided_halves_of_one_buffer():
    y = torch.randn(3, 2 * 5)
    out = torch.empty(3, 5)
    glu_cpu(y, out, "gelu", 1)
    torch.testing.assert_close(out, y[:, :5] * torch.nn.functional.gelu(y[:, 5:]),
                               atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("m,n,ld", [(1, 7, 7), (37, 24, 40), (300, 100, 103)])
def test_in_place_pass_on_strided_rows(m, n, ld, act, dtype):
    # rows of n at stride ld (a strided slice of a concatenation): exactly the contiguous
    # result on the rows, the elements between rows untouched
    base = torch.randn(m, ld).to(dtype)
    view = base[:, :n]
    want = activate_cpu(view.contiguous(), act)
    rest = base[:, n:].clone()
    activate_cpu(view, act)
    assert torch.equal(view, want) and torch.equal(base[:, n:], rest)
    with pytest.raises(ValueError, match="unit column stride"):
        activate_cpu(torch.randn(4, 6).t(), act)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("m,n,ld", [(1, 7, 7), (37, 24, 40), (300, 100, 100)])
def test_bias_added_in_the_pass(m, n, ld, act, dtype):
    # act(y + bias) per row, bias over the columns: the float32 sum, then the activation, on
    # contiguous and strided rows; GLU: both halves get their half of the bias
    base = torch.randn(m, ld).to(dtype)
    bias = torch.randn(n).to(dtype)
    view = base[:, :n]
    want = act_reference((view.float() + bias.float()).to(dtype), act) if dtype == F32 else \
        act_reference(view.float() + bias.float(), act).to(dtype)
    rest = base[:, n:].clone()
    activate_cpu(view, act, bias)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(view, want, atol=atol * 4, rtol=rtol)
    assert torch.equal(base[:, n:], rest)
    y = torch.randn(m, 2 * n).to(dtype)
    b2 = torch.randn(2 * n).to(dtype)
    out = torch.empty(m, n, dtype=dtype)
    glu_cpu(y, out, act, 0, b2)
    yb = y.float() + b2.float()
    want = act_reference(yb[:, :n], act).to(dtype).float() * yb[:, n:]
    torch.testing.assert_close(out, want.to(dtype), atol=atol * 4, rtol=rtol)


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_rounded_chain_matches_reference(m, k, n, act, dtype, bias):
    # a float32 GEMM rounded to 16 bits, then the activation (compute_in_float32's chain):
    # float32 workspace, the 16-bit output on contiguous rows and on rows at a larger stride
    x, w, b = _operands(m, k, n, F32, bias=bias)
    want = linear_act_reference(x, w, b, act, out_dtype=dtype)
    assert want.dtype == dtype
    atol, rtol = TOL[dtype]
    scale = want.float().abs().max().item()
    for ld in (n, n + 3):
        base = torch.full((m, ld), 7.0, dtype=dtype)
        out = base[:, :n]
        y = torch.full((m, n), float("nan"))
        LinearActCPU().run(x, w, b, y, out, act=act, gate=None, beta=1, alpha=1)
        torch.testing.assert_close(out, want, atol=atol * scale, rtol=rtol)
        assert (base[:, n:] == 7).all()  # nothing written between the rows
    # the pass alone rounds before the activation: exactly act(round(y)) up to its own rounding
    y = torch.randn(m, n) * 3
    out = cast_activate_cpu(y, torch.empty(m, n, dtype=dtype), act)
    torch.testing.assert_close(out, act_reference(y.to(dtype), act), atol=atol, rtol=rtol)


def test_rounded_pass_checks_its_operands():
    y = torch.randn(4, 6)
    for bad_y, bad_out in ((y.bfloat16(), torch.empty(4, 6, dtype=BF16)),  # y not float32
                           (y.t(), torch.empty(6, 4, dtype=BF16)),  # y not contiguous
                           (y, torch.empty(4, 6)),  # out not 16-bit
                           (y, torch.empty(4, 5, dtype=BF16)),  # shapes differ
                           (y, torch.empty(6, 4, dtype=BF16).t())):  # column stride
        with pytest.raises(ValueError, match="cast_activate_cpu: y must be"):
            cast_activate_cpu(bad_y, bad_out, "silu")
    with pytest.raises(ValueError, match="bias must be a contiguous"):
        cast_activate_cpu(y, torch.empty(4, 6, dtype=BF16), "silu", torch.randn(6).bfloat16())


@pytest.mark.cpu_profile
@pytest.mark.parametrize("name", ["feed_forward", "silu", "geglu"])
def test_rounded_chains_fuse_where_16bit_gemms_compute_in_float32(name, monkeypatch):
    # FXB_CPU_PROFILE=avx2: bf16 GEMMs compute in float32 and round; linear_act fuses across
    # the rounding (tanh GELU, SiLU), GEGLU (gated) has no rounding kernel and stays unfused;
    # values as the unfused plan's and bf16 eager's up to one bf16 rounding
    monkeypatch.setenv("FXB_CPU_PROFILE", "avx2")
    make, rule = {"feed_forward": (lambda: _ff("gelu-approximate"), "linear_act"),
                  "silu": (lambda: _LinearAct("silu"), "linear_act"),
                  "geglu": (lambda: _ff("geglu"), None)}[name]
    torch.manual_seed(1)
    mod = make().to(BF16)
    x = torch.randn(2, 11, 16).to(BF16)
    with torch.no_grad():
        ref = mod(x)
        torch._dynamo.reset()
        fxbackend.reset_stats()
        fused = torch.compile(mod, backend="fxbackend")(x)
        stats = fxbackend.stats()
        torch._dynamo.reset()
        unfused = torch.compile(mod, backend="fxbackend", options={"fusion": False})(x)
    assert stats["rewrites_by_rule"].get("compute_in_float32", 0) >= 1
    fires = {k: v for k, v in stats["fusions_by_rule"].items() if k.startswith("linear_")}
    assert fires == ({rule: 1} if rule else {})
    atol, rtol = TOL[BF16]
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(fused, unfused, atol=atol * scale, rtol=rtol)
    torch.testing.assert_close(fused, ref, atol=2 * atol * scale, rtol=2 * rtol)
    if rule:
        text = fxbackend.explain(mod, x)
        assert "fused.linear_act" in text and "aten.gelu" not in text and \
            "aten.silu" not in text, text


def test_bias_of_the_pass_is_checked():
    y = torch.randn(4, 6)
    for bad in (torch.randn(5), torch.randn(6, 1), torch.randn(12)[::2],
                torch.randn(6, dtype=torch.float64)):
        with pytest.raises(ValueError, match="bias must be a contiguous"):
            activate_cpu(y, "silu", bad)
    with pytest.raises(ValueError, match="bias must be a contiguous"):
        glu_cpu(y, torch.empty(4, 3), "silu", 1, torch.randn(3))


def test_float32_linear_act_adds_the_bias_in_the_pass(monkeypatch):
    # float32 with a [N] bias: mm, then act(y + bias) in the pass (no addmm); 16-bit: addmm
    calls = []
    real_mm, real_addmm = torch.mm, torch.addmm
    monkeypatch.setattr(torch, "mm", lambda *a, **k: calls.append("mm") or real_mm(*a, **k))
    monkeypatch.setattr(torch, "addmm",
                        lambda *a, **k: calls.append("addmm") or real_addmm(*a, **k))
    for dtype, want_call in ((F32, "mm"), (BF16, "addmm")):
        for gate in (None, 1):
            calls.clear()
            n2 = 2 * 19 if gate is not None else 19
            x, w, b = _operands(7, 33, n2, dtype)
            out = torch.empty(7, 19 if gate is not None else n2, dtype=dtype)
            y = torch.empty(7, n2, dtype=dtype) if gate is not None else out
            LinearActCPU().run(x, w, b, y, out, act="gelu_tanh", gate=gate, beta=1, alpha=1)
            assert calls == [want_call]
            atol, rtol = TOL[dtype]
            want = linear_act_reference(x, w, b, "gelu_tanh", gate)
            scale = want.float().abs().max().item()
            torch.testing.assert_close(out, want, atol=atol * scale, rtol=rtol)
    calls.clear()
    x, w, b = _operands(7, 33, 19, F32)
    out = torch.empty(7, 19)
    LinearActCPU().run(x, w, b, out, out, act="silu", gate=None, beta=0.5, alpha=1)
    assert calls == ["addmm"]  # beta != 1: the chain's own addmm
    torch.testing.assert_close(out, linear_act_reference(x, w, b, "silu", None, beta=0.5))


def test_linear_act_output_placed_in_a_strided_concat_slice():
    # Flux's single-stream block: cat([attn, gelu_tanh(proj_mlp(x))], -1) -> proj_out
    def fn(x, a, w, b, w2):
        mlp = torch.nn.functional.gelu(torch.addmm(b, x, w), approximate="tanh")
        return torch.cat([torch.sin(a), mlp], dim=-1) @ w2

    args = (torch.randn(9, 8), torch.randn(9, 4), torch.randn(8, 12), torch.randn(12),
            torch.randn(16, 3))
    with torch.no_grad(), fxbackend.record_graphs() as graphs:
        fxbackend.reset_stats()
        got = torch.compile(fn, backend="fxbackend")(*args)
    plan = graphs[0].plan_for(list(args))
    (fused,) = [n for n in plan.graph.nodes if n.op == "fused.linear_act"]
    assert fused in plan.concat.relayout and plan.metas[fused].stride == (16, 1)
    assert plan.concat.parts_in_place == 2
    torch.testing.assert_close(got, fn(*args), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
    off = torch.compile(fn, backend="fxbackend", options={"concat_in_place": False})
    with torch.no_grad():
        assert torch.equal(off(*args), got)


# -- the rules on whole graphs ----------------------------------------------------------------

class _SwiGLU(torch.nn.Module):
    """A packed SwiGLU: ``up, gate = proj(x).chunk(2, -1); silu(gate) * up``."""

    def __init__(self, d=16, inner=24):
        super().__init__()
        self.proj = torch.nn.Linear(d, 2 * inner)
        self.out = torch.nn.Linear(inner, d)

    def forward(self, x):
        up, gate = self.proj(x).chunk(2, dim=-1)
        return self.out(torch.nn.functional.silu(gate) * up)


class _LinearAct(torch.nn.Module):
    def __init__(self, act, bias=True, d=16, inner=40):
        super().__init__()
        self.proj = torch.nn.Linear(d, inner, bias=bias)
        self.act = act

    def forward(self, x):
        return act_reference(self.proj(x), self.act) * 2


def _ff(kind):
    torch.manual_seed(0)
    return FeedForward(16, mult=3, activation_fn=kind).eval()


MODULES = {  # name: (module factory, rule, fires)
    "ff_gelu_tanh": (lambda: _ff("gelu-approximate"), "linear_act", 1),
    "ff_gelu": (lambda: _ff("gelu"), None, 0),  # declined on the CPU: oneDNN's GELU is faster
    # GEGLU's erf GELU on a strided half: fused (level with Inductor, ahead of eager)
    "ff_geglu": (lambda: _ff("geglu"), "linear_glu", 1),
    "swiglu_packed": (lambda: _SwiGLU(), "linear_glu", 1),
    "silu_no_bias": (lambda: _LinearAct("silu", bias=False), "linear_act", 1),
    "gelu_tanh": (lambda: _LinearAct("gelu_tanh"), "linear_act", 1),
}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_fused_vs_unfused_vs_eager(name):
    make, rule, fires = MODULES[name]
    torch.manual_seed(1)
    mod = make()
    x = torch.randn(2, 11, 16)
    with torch.no_grad():
        ref = mod(x)
        torch._dynamo.reset()
        fxbackend.reset_stats()
        fused = torch.compile(mod, backend="fxbackend")(x)
        assert fxbackend.stats()["fusions_by_rule"] == ({rule: fires} if fires else {})
        torch._dynamo.reset()
        unfused = torch.compile(mod, backend="fxbackend", options={"fusion": False})(x)
    torch.testing.assert_close(fused, unfused, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(fused, ref, atol=1e-5, rtol=1e-5)


def test_clone_and_views_join_the_step():
    text = fxbackend.explain(_ff("gelu-approximate"), torch.randn(1, 9, 16))
    assert "aten.gelu" not in text and "aten.clone" not in text, text
    text = fxbackend.explain(_SwiGLU(), torch.randn(1, 9, 16))
    for op in ("aten.silu", "aten.split", "getitem"):
        assert op not in text, text
    text = fxbackend.explain(_ff("geglu"), torch.randn(1, 9, 16))
    for op in ("aten.gelu", "aten.split", "getitem", "aten.mul"):
        assert op not in text, text
    # a plain erf GELU is recognised and declined on the CPU, with the kernel's reason
    text = fxbackend.explain(_ff("gelu"), torch.randn(1, 9, 16))
    assert "declined linear_act on" in text and "erf GELU: torch's" in text, text


def test_activation_read_twice_is_not_fused():
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = self.proj(x)
            return torch.nn.functional.silu(y), y  # the GEMM result is an output

    fxbackend.reset_stats()
    with torch.no_grad():
        a, b = torch.compile(Two(), backend="fxbackend")(torch.randn(3, 8))
    assert "linear_act" not in fxbackend.stats()["fusions_by_rule"]
    torch.testing.assert_close(a, torch.nn.functional.silu(b))


def test_rule_declines_with_the_kernels_reason():
    class No(ReferenceLinearAct):
        def why_not(self, *a):
            return "no kernel for this"

    with rule_on_top(LinearActFusion(No()), "linear_act_test"):
        text = fxbackend.explain(_ff("gelu-approximate"), torch.randn(1, 9, 16))
    assert "declined linear_act_test" in text and "no kernel for this" in text, text


# -- the four diffusers models ------------------------------------------------------------------

# Expected fires per rule on the tiny configs (fxbackend/models.py):
# - flux: gelu_tanh feed-forwards: the double block's ff and ff_context (2) and the single
#   block's proj_mlp (1); silu after a linear: timestep_embedder.linear_1, guidance_embedder.
#   linear_1 and text_embedder (PixArtAlphaTextProjection, act silu) linear_1 (3): 6 linear_act.
# - sd3: layer 0 ff + ff_context, layer 1 (context_pre_only: no ff_context) ff: 3 gelu_tanh;
#   timestep_embedder.linear_1 and text_embedder.linear_1 -> silu: 2; 5 linear_act.
# - pixart: 2 blocks' ff + caption_projection (gelu_tanh): 3; timestep_embedder.linear_1 ->
#   silu: 1.  (AdaLayerNormSingle's linear_2 -> silu is not fused: linear_2's output, the
#   embedded timestep, is also read by the output layer's modulation.)  4 linear_act.
# - unet: GEGLU in every transformer block: down (1 block x 1 layer), mid (1), up
#   CrossAttnUpBlock2D (layers_per_block + 1 = 2): 4 GEGLU chains (erf GELU), 4 linear_glu;
#   time_embedding.linear_1 -> silu: 1 linear_act.  (The resnets' silu(temb) comes before
#   their linear, not after.)
MODEL_FIRES = {"flux": {"linear_act": 6}, "sd3": {"linear_act": 5},
               "pixart": {"linear_act": 4}, "unet": {"linear_act": 1, "linear_glu": 4}}


@pytest.mark.parametrize("family", sorted(MODEL_FIRES))
def test_models_fire_and_match_eager(family):
    torch._dynamo.reset()
    fxbackend.reset_stats()
    ref, out, _ = eager_and_compiled(family)
    fires = {k: v for k, v in fxbackend.stats()["fusions_by_rule"].items()
             if k in ("linear_act", "linear_glu")}
    assert fires == MODEL_FIRES[family]
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-5, err


# -- Triton: interpreter (no GPU) and real sizes ------------------------------------------------

def _interp_cases():
    cases = []
    for act in ACTS:
        for gated, gate in [(False, None), (True, 1), (True, 0)]:
            for dtype in ("float32", "bfloat16"):
                for m, k, n in [(3, 8, 5), (5, 16, 37)]:
                    atol, rtol = TOL[getattr(torch, dtype)]
                    cases.append({"id": f"{act}-{gated}{gate}-{dtype}-{m}x{k}x{n}", "m": m,
                                  "k": k, "n": n, "act": act, "gated": gated, "gate": gate,
                                  "bias": n % 2 == 1, "dtype": dtype, "atol": atol * 4,
                                  "rtol": rtol})
    return cases


@pytest.fixture(scope="module")
def interp_results():
    return interp.run_checker("_activation_interp_check.py", _interp_cases())


@pytest.mark.parametrize("case", _interp_cases(), ids=lambda c: c["id"])
def test_triton_kernel_in_interpreter(interp_results, case):
    interp.check_result(interp_results, case)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("act,gate", [("gelu_tanh", None), ("gelu", 1), ("silu", 0)])
def test_cuda_real_size(act, gate, dtype):
    from fxbackend.cuda_kernels.activation import LinearActCUDA
    m, k, n = 4608, 3072, 12288 if gate is None else 5120
    n2 = 2 * n if gate is not None else n
    x, w, b = (t.cuda() for t in _operands(m, k, n2, dtype))
    out = torch.empty(m, n, dtype=dtype, device="cuda")
    y = torch.empty(m, n2, dtype=dtype, device="cuda") if gate is not None else out
    LinearActCUDA().run(x, w, b, y, out, act=act, gate=gate, beta=1, alpha=1)
    want = linear_act_reference(x, w, b, act, gate)
    atol, rtol = TOL[dtype]
    scale = want.float().abs().max().item()
    torch.testing.assert_close(out, want, atol=atol * scale, rtol=rtol)
