"""The ``modulation`` fusion family (patterns/modulation.py): norm without affine -> * (c + scale)
-> + shift as one step.

- the reference is the unfused chain;
- the numba CPU kernel (cpu_kernels/modulation.py) against the reference: layouts, dtypes, norms,
  with and without the ``c + scale`` add;
- the Triton kernel (cuda_kernels/modulation.py) in Triton's interpreter (one subprocess,
  tests/_modulation_interp_check.py) and, ``cuda``-marked, at Flux's size on a GPU;
- the rule on diffusers' own adaLN modules, with the torch implementation of the kernel
  interface (``ReferenceModulation``) and with the CPU kernel: fused vs unfused vs eager, what
  joins the step, what declines;
- the four diffusers test models: the rule fires once per adaLN chain.
"""
from __future__ import annotations

import os
import pathlib
import sys
import zlib

import pytest
import torch
from diffusers.models.normalization import (AdaLayerNormContinuous, AdaLayerNormZero,
                                            FP32LayerNorm, RMSNorm)

import fxbackend
import fxbackend.cpu_kernels.modulation  # noqa: F401  (registers the "cpu" rule)
import fxbackend.cuda_kernels.modulation  # noqa: F401  (registers the "cuda" rule)
import fxbackend.cpu_kernels.scale_cast  # noqa: F401  (its model count is checked here too)
from fxbackend.cpu_kernels.modulation import modulation_cpu
from fxbackend.patterns.modulation import (ModulationFusion, ReferenceModulation,
                                           modulation_reference)

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from ext_util import eager_and_compiled, rel_err, rule_on_top  # noqa: E402
from _modulation_interp_check import LAYOUTS, build  # noqa: E402
from _rope_interp_check import aot_compile, check_result, run_checker  # noqa: E402

EPS = 1e-6
# (dtype, atol, rtol, min_exact): float32 within float32 rounding of mean/rstd; 16-bit within one
# rounding, almost every element bit-equal
TOL = [("float32", 2e-6, 1e-5, 0.3), ("bfloat16", 1.6e-2, 1e-2, 0.99),
       ("float16", 2e-3, 1e-3, 0.99)]


# -- the reference ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_unfused_chain(dtype):
    g = torch.Generator().manual_seed(0)
    x, s, h = build("bc_unsqueezed", 24, dtype, g, torch)
    n = torch.nn.functional.layer_norm(x, (24,), eps=EPS)
    assert torch.equal(modulation_reference(x, s, h, EPS), n * (1 + s) + h)
    assert torch.equal(modulation_reference(x, s, h, EPS, add_c=None), n * s + h)
    r = RMSNorm(24, eps=EPS, elementwise_affine=False)(x)
    assert torch.equal(modulation_reference(x, s, h, EPS, "rms", 0.5), r * (0.5 + s) + h)


# -- the CPU kernel ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,atol,rtol,min_exact", TOL)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("norm,add_c,d", [("layer", 1.0, 67), ("layer", None, 16),
                                          ("rms", 1.0, 33), ("layer", 1.0, 1)])
def test_cpu_kernel_matches_reference(layout, norm, add_c, d, dtype, atol, rtol, min_exact):
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(zlib.crc32(f"{layout}/{norm}/{d}/{dtype}".encode()))
    x, s, h = build(layout, d, dt, g, torch)
    x_before = x.clone()
    out = torch.full(x.shape, float("nan"), dtype=dt)
    assert modulation_cpu(x, s, h, out, norm=norm, eps=EPS, add_c=add_c) is out
    want = modulation_reference(x, s, h, EPS, norm, add_c)
    torch.testing.assert_close(out, want, atol=atol, rtol=rtol)
    if d > 1:  # one feature: torch's fp16 LayerNorm gives n ~ 1e-5 (its mean is not x), ours 0
        assert (out == want).float().mean().item() >= min_exact
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("x_dtype,out_dtype", [("bfloat16", "bfloat16"), ("float16", "float16"),
                                               ("bfloat16", "float32"), ("float32", "bfloat16")])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cpu_kernel_widened_x_and_narrowed_out(layout, x_dtype, out_dtype):
    """Wan's form: a 16-bit x widened in the step, float32 scale and shift, the float32 result
    narrowed in the step: the float32 chain on x.float(), rounded once to out's dtype."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{layout}/{x_dtype}/{out_dtype}".encode()))
    x, s, h = build(layout, 40, torch.float32, g, torch)
    x = x.to(getattr(torch, x_dtype))
    out = torch.full(x.shape, float("nan"), dtype=getattr(torch, out_dtype))
    assert modulation_cpu(x, s, h, out, norm="layer", eps=EPS, add_c=1.0) is out
    want32 = modulation_reference(x, s, h, EPS, "layer", 1.0)
    assert want32.dtype == torch.float32
    assert torch.equal(want32, modulation_reference(x.float(), s, h, EPS, "layer", 1.0))
    want = want32.to(out.dtype)
    torch.testing.assert_close(out, want, atol=2e-6 if out_dtype == "float32" else 1.6e-2,
                               rtol=1e-5 if out_dtype == "float32" else 1e-2)
    # float32 statistics in another order than torch's: 16-bit results all but never differ
    assert (out == want).float().mean().item() >= (0.3 if out_dtype == "float32" else 0.99)


def test_cpu_kernel_float32_error_at_flux_width():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 64, 3072, generator=g) * 3 + 1
    s, h = torch.randn(1, 1, 3072, generator=g) * 0.3, torch.randn(1, 1, 3072, generator=g)
    assert rel_err(modulation_cpu(x, s, h), modulation_reference(x, s, h, EPS)) < 1e-6


def test_cpu_kernel_rejects_what_it_does_not_handle():
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="dtypes"):
        modulation_cpu(x, torch.randn(2, 1, 8, dtype=torch.float64), torch.randn(2, 1, 8))
    with pytest.raises(ValueError, match="broadcast"):
        modulation_cpu(x, torch.randn(3, 1, 8), torch.randn(2, 1, 8))
    with pytest.raises(ValueError, match="norm"):
        modulation_cpu(x, torch.randn(2, 1, 8), torch.randn(2, 1, 8), norm="group")
    # a 16-bit chain is not widened: a bf16 scale with a float32 x, or fp16 out of a bf16 chain
    bf = torch.randn(2, 1, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dtypes"):
        modulation_cpu(x, bf, bf)
    with pytest.raises(ValueError, match="dtypes"):
        modulation_cpu(x.bfloat16(), bf, bf, torch.empty(2, 3, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="widened"):
        modulation_reference(x, bf, bf, EPS)


# -- the Triton kernel ------------------------------------------------------------------------

def _interp_cases():
    cases = []
    for layout in LAYOUTS:
        for dtype, atol, rtol, min_exact in TOL:
            for norm, add_c, d in (("layer", 1.0, 19), ("rms", None, 16)):
                cases.append(dict(id=f"{layout}/{dtype}/{norm}/{add_c}/{d}", layout=layout,
                                  d=d, dtype=dtype, norm=norm, add_c=add_c, atol=atol,
                                  rtol=rtol, min_exact=min_exact))
        # a widened 16-bit x and a narrowed result around float32 scale and shift (Wan)
        for x_dtype, out_dtype in (("bfloat16", "bfloat16"), ("float16", "float32")):
            atol, rtol, min_exact = {t[0]: t[1:] for t in TOL}[out_dtype]
            cases.append(dict(id=f"{layout}/{x_dtype}-float32-{out_dtype}/layer/1.0/19",
                              layout=layout, d=19, dtype="float32", x_dtype=x_dtype,
                              out_dtype=out_dtype, norm="layer", add_c=1.0, atol=atol,
                              rtol=rtol, min_exact=min_exact))
    return cases


INTERP_CASES = _interp_cases()


@pytest.fixture(scope="module")
def interp_results():
    return run_checker("_modulation_interp_check.py", INTERP_CASES)


@pytest.mark.parametrize("case", INTERP_CASES, ids=[c["id"] for c in INTERP_CASES])
def test_triton_kernel_in_the_interpreter(interp_results, case):
    check_result(interp_results, case)


def test_triton_why_not_declines_off_cuda_and_too_wide():
    from fxbackend.cuda_kernels.modulation import MAX_D, why_not
    m = fxbackend.TensorMeta.of
    x = torch.empty(2, 3, 8)
    s = torch.empty(2, 1, 8).expand(2, 3, 8)
    assert "CUDA" in why_not(m(x), m(s), m(s), m(x), "layer")
    wide = torch.empty(2, MAX_D + 1, device="meta")
    meta = fxbackend.TensorMeta(tuple(wide.shape), tuple(wide.stride()), torch.float32,
                                torch.device("cuda"))
    assert "MAX_D" in why_not(meta, meta, meta, meta, "layer")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_at_flux_size(dtype):
    from fxbackend.cuda_kernels.modulation import modulation_triton
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(1, 4096, 3072, generator=g) * 2).to(dtype).cuda()
    s = (torch.randn(1, 1, 3072, generator=g) * 0.3).to(dtype).cuda()
    h = torch.randn(1, 1, 3072, generator=g).to(dtype).cuda()
    out = modulation_triton(x, s, h)
    want = modulation_reference(x, s, h, EPS)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(out, want, **tol)


@pytest.mark.cuda
def test_triton_kernel_widened_and_narrowed_at_wan_size():
    """Wan 14B's width (5120) at 4096 tokens: bf16 x, float32 scale and shift, bf16 out."""
    from fxbackend.cuda_kernels.modulation import modulation_triton
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(1, 4096, 5120, generator=g) * 2).bfloat16().cuda()
    s = (torch.randn(1, 1, 5120, generator=g) * 0.3).cuda()
    h = torch.randn(1, 1, 5120, generator=g).cuda()
    out = modulation_triton(x, s, h, torch.empty(x.shape, dtype=torch.bfloat16, device="cuda"))
    want = modulation_reference(x, s, h, EPS).bfloat16()
    torch.testing.assert_close(out, want, atol=3e-2, rtol=1e-2)
    assert (out == want).float().mean().item() >= 0.99


# -- the rule -----------------------------------------------------------------------------------

class _Impl(ReferenceModulation):
    def __init__(self, decline: str | None = None) -> None:
        self.decline = decline
        self.calls = []

    def why_not(self, *a):
        return self.decline

    def run(self, x, scale, shift, out, **kw):
        self.calls.append(kw)
        super().run(x, scale, shift, out, **kw)


@pytest.fixture
def rule():
    """The rule with the torch implementation, registered for "cpu" above the numba one."""
    with rule_on_top(ModulationFusion(_Impl()), "modulation_test") as r:
        yield r


class _Zero(torch.nn.Module):
    """SD3/Flux ``AdaLayerNormZero``: ``norm(x) * (1 + scale[:, None]) + shift[:, None]``."""

    def __init__(self, d=16):
        super().__init__()
        self.norm = AdaLayerNormZero(d)
        self.emb_dim = d

    def forward(self, x, emb):
        y, *_ = self.norm(x, emb=emb)
        return y


class _Continuous(torch.nn.Module):
    """Flux/SD3 ``norm_out``: ``norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]``."""

    def __init__(self, d=16):
        super().__init__()
        self.norm = AdaLayerNormContinuous(d, d, elementwise_affine=False, eps=EPS)
        self.emb_dim = d

    def forward(self, x, emb):
        return self.norm(x, emb)


class _Single(torch.nn.Module):
    """PixArt's adaLN-single, written as diffusers' BasicTransformerBlock does."""

    def __init__(self, d=16, rms=False):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(6, d) / d ** 0.5)
        self.emb_dim = 6 * d
        self.norm = RMSNorm(d, eps=EPS, elementwise_affine=False) if rms else \
            torch.nn.LayerNorm(d, elementwise_affine=False, eps=EPS)

    def forward(self, x, emb):
        shift, scale, *_ = (self.table[None] + emb.reshape(x.shape[0], 6, -1)).chunk(6, dim=1)
        return self.norm(x) * (1 + scale) + shift


def _inputs(emb_dim=96, d=16, b=2, t=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, d, generator=g) * 2 + 0.5, torch.randn(b, emb_dim, generator=g)


def _compiled(mod, *args, options=None):
    with torch.no_grad():
        torch._dynamo.reset()
        return torch.compile(mod, backend="fxbackend", options=options)(*args)


@pytest.mark.parametrize("make", [_Zero, _Continuous, _Single, lambda: _Single(rms=True)],
                         ids=["ada_zero", "ada_continuous", "ada_single", "ada_single_rms"])
def test_rule_fuses_diffusers_adaln(rule, make):
    mod = make()
    x, emb = _inputs(mod.emb_dim)
    with torch.no_grad():
        eager = mod(x, emb)
    fused = _compiled(mod, x, emb)
    assert fxbackend.stats()["fusions_by_rule"] == {"modulation_test": 1}
    # the c + scale add is in the step (its only reader is the chain)
    assert [c["add_c"] for c in rule.impl.calls] == [1.0]
    unfused = _compiled(mod, x, emb, options={"fusion": False})
    assert rel_err(fused, eager) < 1e-6 and rel_err(unfused, eager) < 1e-6


@pytest.mark.parametrize("make", [_Zero, _Continuous, _Single],
                         ids=["ada_zero", "ada_continuous", "ada_single"])
def test_cpu_kernel_through_the_backend(make):
    mod = make()
    x, emb = _inputs(mod.emb_dim, t=11, seed=3)
    with torch.no_grad():
        eager = mod(x, emb)
    fused = _compiled(mod, x, emb)
    s = fxbackend.stats()
    assert s["fusions_by_rule"] == {"modulation": 1}
    unfused = _compiled(mod, x, emb, options={"fusion": False})
    assert rel_err(fused, eager) < 1e-6 and rel_err(fused, unfused) < 1e-6


def test_a_scale_read_elsewhere_stays_outside(rule):
    class M(torch.nn.Module):
        def forward(self, x, s, h):
            s1 = 1 + s
            return torch.nn.functional.layer_norm(x, (16,), eps=EPS) * s1 + h, s1 * 2

    x, _ = _inputs()
    s, h = torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    with torch.no_grad():
        want = M()(x, s, h)
    got = _compiled(M(), x, s, h)
    assert fxbackend.stats()["fusions_by_rule"] == {"modulation_test": 1}
    assert [c["add_c"] for c in rule.impl.calls] == [None]
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)


def test_norm_read_twice_or_statistics_read_are_not_fused(rule):
    class TwoModulations(torch.nn.Module):  # SD3.5's AdaLayerNormZeroX
        def forward(self, x, s, h):
            n = torch.nn.functional.layer_norm(x, (16,), eps=EPS)
            return n * (1 + s) + h, n * (1 + h) + s

    class Stats(torch.nn.Module):  # the mean is read: the norm's other outputs are live
        def forward(self, x, s, h):
            n, mean, _ = torch.native_layer_norm(x, [16], None, None, EPS)
            return n * (1 + s) + h + mean

    x, _ = _inputs()
    s, h = torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    for mod in (TwoModulations(), Stats()):
        fxbackend.reset_stats()
        with torch.no_grad():
            want = mod(x, s, h)
        got = _compiled(mod, x, s, h)
        assert "modulation_test" not in fxbackend.stats()["fusions_by_rule"]
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("form", ["shift_is_norm", "scale_is_widened_x"])
def test_scale_or_shift_computed_by_the_chain_declines(form):
    """A scale or shift that is a value of the chain (the norm's result; the widened x, which
    the claim with the cast would hold) is not a step input: the shipped rule declines that
    claim with its reason, and the plan gives eager's values (found by
    tests/test_graph_fuzz.py: the step read a value it did not have)."""
    def f(x, s):
        if form == "shift_is_norm":
            n = torch.nn.functional.layer_norm(x, (16,), eps=EPS)
            return x * n + n
        xf = x.bfloat16().float()
        return xf * torch.nn.functional.layer_norm(xf, (16,), eps=EPS) + s

    x, _ = _inputs()
    s = torch.randn(2, 1, 16)
    with torch.no_grad():
        want = f(x, s)
    text = fxbackend.explain(f, x, s)
    assert "the scale or shift is a value of the chain itself" in text, text
    fxbackend.reset_stats()
    got = torch.compile(f, backend="fxbackend")(x, s)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # the norm's chain alone still fuses where its scale is an input of it (the widened x)
    fused = fxbackend.stats()["fusions_by_rule"].get("modulation", 0)
    assert fused == (0 if form == "shift_is_norm" else 1)


def test_affine_layer_norm_is_not_a_chain(rule):
    ln = torch.nn.LayerNorm(16)
    mod = lambda x, s, h: ln(x) * (1 + s) + h  # noqa: E731
    x, _ = _inputs()
    _compiled(mod, x, torch.randn(2, 1, 16), torch.randn(2, 1, 16))
    assert fxbackend.stats()["fusions_by_rule"] == {}


def test_rule_reports_the_kernels_decline():
    with rule_on_top(ModulationFusion(_Impl(decline="no kernel for this")),
                     "modulation_declining") as r:
        x, emb = _inputs(16)
        with torch.no_grad():
            text = fxbackend.explain(_Zero(), x, emb)
    assert "declined modulation_declining on" in text and "no kernel for this" in text
    assert r.impl.calls == []


class _WanNorm(torch.nn.Module):
    """Wan's block: a float32 modulation around a 16-bit stream,
    ``(norm(x.float()) * (1 + scale) + shift).type_as(x)``; ``keep`` also returns the float32
    result (then the narrowing cast cannot join the step)."""

    def __init__(self, d=16, keep=False):
        super().__init__()
        self.norm = FP32LayerNorm(d, eps=EPS, elementwise_affine=False)
        self.keep = keep

    def forward(self, x, scale, shift):
        y = self.norm(x.float()) * (1 + scale) + shift
        return (y.type_as(x), y * 2) if self.keep else y.type_as(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_widening_and_narrowing_casts_join_the_step(dtype):
    mod = _WanNorm()
    x, _ = _inputs(16, t=13, seed=5)
    x = x.to(dtype)
    g = torch.Generator().manual_seed(6)
    s, h = torch.randn(2, 1, 16, generator=g) * 0.3, torch.randn(2, 1, 16, generator=g)
    with torch.no_grad():
        eager = mod(x, s, h)
    fused = _compiled(mod, x, s, h)
    st = fxbackend.stats()
    assert st["fusions_by_rule"] == {"modulation": 1}
    assert st["steps_by_kernel"] == {"modulation": 1}  # no cast left outside
    assert fused.dtype == dtype
    torch.testing.assert_close(fused, eager, atol=1.6e-2, rtol=1e-2)
    assert (fused == eager).float().mean().item() >= 0.99


def test_a_narrowing_cast_of_a_result_read_elsewhere_stays_outside():
    mod = _WanNorm(keep=True)
    x, _ = _inputs(16, seed=7)
    x = x.to(torch.bfloat16)
    s, h = torch.randn(2, 1, 16) * 0.3, torch.randn(2, 1, 16)
    with torch.no_grad():
        eager = mod(x, s, h)
    fused = _compiled(mod, x, s, h)
    st = fxbackend.stats()
    assert st["fusions_by_rule"] == {"modulation": 1}
    # the widening joined, the narrowing cast runs on its own (and the float32 result is kept)
    assert st["steps_by_kernel"] == {"modulation": 1, "native": 2}
    torch.testing.assert_close(fused[0], eager[0], atol=1.6e-2, rtol=1e-2)
    torch.testing.assert_close(fused[1], eager[1], atol=2e-5, rtol=1e-5)


def test_half_precision_chain_fuses_within_one_rounding():
    mod = _Zero().to(torch.bfloat16)
    x, emb = (t.to(torch.bfloat16) for t in _inputs(16, seed=4))
    with torch.no_grad():
        eager = mod(x, emb)
    fused = _compiled(mod, x, emb)
    assert fxbackend.stats()["fusions_by_rule"] == {"modulation": 1}
    torch.testing.assert_close(fused, eager, atol=1.6e-2, rtol=1e-2)


# -- the diffusers models ---------------------------------------------------------------------

def _expected_chains(family: str, cfg) -> int:
    """adaLN chains (a norm without affine read only by ``* (1 + scale) + shift``) per model."""
    if family == "flux":
        # double-stream block: norm1 (AdaLayerNormZero) and norm1_context, norm2 and
        # norm2_context (feed-forward, modulated by the block): 4; single-stream block: its
        # AdaLayerNormZeroSingle: 1; norm_out (AdaLayerNormContinuous): 1
        return 4 * cfg.num_layers + cfg.num_single_layers + 1
    if family == "sd3":
        # per block: norm1 (x) and norm1_context, norm2 and norm2_context (3 to 4 chains):
        # - a dual-attention block's norm1 (SD35AdaLayerNormZeroX) modulates one norm twice
        #   (attn and attn2 inputs): no chain;
        # - the last block is context_pre_only: norm1_context is AdaLayerNormContinuous (still a
        #   chain) and it has no norm2_context;
        # plus norm_out (AdaLayerNormContinuous)
        n = 0
        for i in range(cfg.num_layers):
            last = i == cfg.num_layers - 1
            n += (0 if i in cfg.dual_attention_layers else 1) + 1 + 1 + (0 if last else 1)
        return n + 1
    if family == "pixart":
        # adaLN-single blocks: norm1 (attention) and norm2 (feed-forward); the cross-attention
        # reads the hidden states unnormalised; plus the final norm_out
        return 2 * cfg.num_layers + 1
    return 0  # unet: its LayerNorms have weight and bias (BasicTransformerBlock), no adaLN


@pytest.mark.parametrize("family", ["flux", "sd3", "pixart", "unet"])
def test_models_fire_once_per_adaln_chain(family):
    ref, out, model = eager_and_compiled(family)
    assert rel_err(out, ref) <= 1e-5
    want = _expected_chains(family, model.config)
    assert fxbackend.stats()["fusions_by_rule"].get("modulation", 0) == want
    assert {"flux": 6, "sd3": 7, "pixart": 5, "unet": 0}[family] == want  # the tiny configs
    # scale_cast (patterns/scale_cast.py): float32 models cast nothing to fp16/bf16
    assert fxbackend.stats()["fusions_by_rule"].get("scale_cast", 0) == 0


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiled mode only")
@pytest.mark.parametrize("dtypes", [(torch.float32,) * 4, (torch.bfloat16,) * 4,
                                    (torch.bfloat16, torch.float32, torch.float32, torch.bfloat16),
                                    (torch.float16, torch.float32, torch.float32, torch.float32)],
                         ids=["fp32", "bf16", "bf16-widened-narrowed", "fp16-widened"])
def test_triton_kernel_compiles_for_sm90_without_a_gpu(dtypes):
    """Catches what the interpreter does not check (types, constexpr dtypes, lowering) for
    each dtype combination the rule hands the kernel."""
    from fxbackend.cuda_kernels import modulation as cuda_mod
    x = torch.empty(2, 7, 64)
    s = torch.empty(2, 1, 64).expand(2, 7, 64)
    p = cuda_mod._plan(tuple(x.shape), x.stride(), s.stride(), s.stride())
    ck = aot_compile(cuda_mod._kernel(), dtypes, (*p.args, 1e-6, 1.0),
                     {"IS_RMS": False, "HAS_ADD": True, "BLOCK_R": p.block_r,
                      "BLOCK_D": p.block_d},
                     {"num_warps": p.num_warps, "enable_fp_fusion": False})
    assert ck.asm.get("cubin"), "no cubin"
