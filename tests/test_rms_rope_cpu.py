"""The fused RMSNorm -> RoPE [-> * scale] CPU kernel (cpu_kernels/rms_rope.py) against
``rms_rope_reference`` (patterns/rope.py).

- per-kernel, parametrised: both modes, full and partial rotation, odd shapes, strided rows (a
  slice of a wider QKV tensor, ``[B, S, H, D]`` permuted to ``[B, H, S, D]``), the broadcast
  forms of cos/sin models use, with and without a scale, out dtype equal to and different from
  the norm's dtype Tn, ``(x, weight, cos, out dtype, atol, rtol)`` rows;
- bit for bit equal to the unfused chain of CPU kernels (rms_norm_cpu -> rope_apply_cpu ->
  torch's scale -> to(out)): every intermediate rounding is where the chain has it;
- ``why_not`` (a reason, never an exception) and the launcher's ValueErrors.

The numba kernel compiles once per dtype combination (cached on disk), so a first run of this
file pays some seconds per row of ``DTYPES``.
"""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from fxbackend import TensorMeta
from fxbackend.cpu_kernels import rms_rope
from fxbackend.cpu_kernels.rmsnorm import rms_norm_cpu
from fxbackend.cpu_kernels.rope import rope_apply_cpu
from fxbackend.patterns.rope import rms_rope_reference

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# (x dtype, weight dtype, cos/sin dtype, out dtype, atol, rtol).  The only departure from the
# reference is the order of the float32 sum of squares (<= ~1e-6 abs on float32 outputs); with
# a 16-bit norm dtype or output that can flip one rounding by one ulp, inside these tolerances.
DTYPES = [
    (F32, F32, F32, F32, 1e-5, 1e-5),
    (BF16, BF16, F32, BF16, 1.6e-2, 1.6e-2),  # out dtype == Tn
    (BF16, BF16, F32, F32, 1.6e-2, 1.6e-2),  # out wider than Tn: bf16 values
    (BF16, F32, F32, F32, 1e-5, 1e-5),  # Tn float32 from a float32 weight
    (BF16, F32, F32, BF16, 1.6e-2, 1.6e-2),  # Tn float32, out narrower
    (F16, F16, F32, F16, 2e-3, 2e-3),
    (BF16, BF16, BF16, BF16, 1.6e-2, 1.6e-2),  # cos/sin in Tn
]
IDS = ["f32", "bf16-out_bf16", "bf16-out_f32", "bf16_wf32-out_f32", "bf16_wf32-out_bf16",
       "f16", "bf16-cos_bf16"]
B, H, S = 2, 3, 7


def _freqs(shape, n_rot, dtype, gen):
    """cos/sin of real angles (any shape ending in n_rot)."""
    ang = torch.rand(*shape[:-1], n_rot, generator=gen) * 6.3
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _case(kind: str, D: int, n_rot: int, x_dtype, c_dtype, gen):
    """(x, cos, sin) for one layout."""
    def rnd(*shape):
        return (torch.randn(*shape, generator=gen) * 3).to(x_dtype)
    if kind == "bhsd":  # Flux: [B, H, S, D], cos [S, n_rot]
        return (rnd(B, H, S, D), *_freqs((S, n_rot), n_rot, c_dtype, gen))
    if kind == "bshd_cos4d":  # [B, S, H, D], cos [1, S, 1, n_rot]
        return (rnd(B, S, H, D), *_freqs((1, S, 1, n_rot), n_rot, c_dtype, gen))
    if kind == "bshd_as_bhsd":  # [B, S, H, D] permuted to [B, H, S, D]: strided rows
        return (rnd(B, S, H, D).permute(0, 2, 1, 3), *_freqs((S, n_rot), n_rot, c_dtype, gen))
    if kind == "qkv_slice":  # x = qkv[..., :D] of a wider [B, S, H, 3D] tensor
        return (rnd(B, S, H, 3 * D)[..., :D], *_freqs((S, 1, n_rot), n_rot, c_dtype, gen))
    if kind == "k_of_fused_qkv":  # the k of [B, S, 3*H*D] as [B, H, S, D]: offset + strides
        x = rnd(B, S, 3 * H * D).view(B, S, 3, H, D)[:, :, 1].transpose(1, 2)
        return (x, *_freqs((S, n_rot), n_rot, c_dtype, gen))
    if kind == "per_batch_strided_cos":  # cos [B, 1, S, n_rot]: a slice of a wider table
        c, s = _freqs((B, 1, S, n_rot + 4), n_rot + 4, c_dtype, gen)
        return rnd(B, H, S, D), c[..., 2:2 + n_rot], s[..., 2:2 + n_rot]
    if kind == "rows_1":  # one row, cos [n_rot] (1-D)
        return (rnd(1, D), *_freqs((n_rot,), n_rot, c_dtype, gen))
    if kind == "rows_13":
        return (rnd(13, D), *_freqs((13, n_rot), n_rot, c_dtype, gen))
    raise AssertionError(kind)


LAYOUTS = ["bhsd", "bshd_cos4d", "bshd_as_bhsd", "qkv_slice", "k_of_fused_qkv",
           "per_batch_strided_cos", "rows_1", "rows_13"]


def _fused(x, w, cos, sin, out_dtype, mode, n_rot, scale, eps=1e-6):
    out = torch.empty(x.shape, dtype=out_dtype)
    assert rms_rope.rms_rope_cpu(x, w, cos, sin, out, eps=eps, mode=mode, n_rot=n_rot,
                                 scale=scale) is out
    return out


# -- the kernel against the reference -----------------------------------------------------------

@pytest.mark.parametrize("x_dtype, w_dtype, c_dtype, out_dtype, atol, rtol", DTYPES, ids=IDS)
@pytest.mark.parametrize("mode", ["interleaved", "split_half"])
@pytest.mark.parametrize("D, n_rot", [(2, 2), (6, 4), (18, 18), (64, 32)])
@pytest.mark.parametrize("kind", LAYOUTS)
def test_cpu_kernel_matches_reference(x_dtype, w_dtype, c_dtype, out_dtype, atol, rtol, mode, D,
                                      n_rot, kind):
    gen = torch.Generator().manual_seed(D * 31 + n_rot + LAYOUTS.index(kind))
    x, cos, sin = _case(kind, D, n_rot, x_dtype, c_dtype, gen)
    w = (torch.randn(D, generator=gen) * 0.5 + 1).to(w_dtype)
    for scale in (None, 0.125):
        out = _fused(x, w, cos, sin, out_dtype, mode, n_rot, scale)
        want = rms_rope_reference(x, w, cos, sin, 1e-6, mode, n_rot, scale, out_dtype)
        assert out.dtype == out_dtype and out.shape == x.shape and out.is_contiguous()
        torch.testing.assert_close(out, want, atol=atol, rtol=rtol)
        # the layout changes nothing: strided x and broadcast cos/sin read in place
        dense = _fused(x.contiguous(), w, cos.expand(*x.shape[:-1], n_rot).contiguous(),
                       sin.expand(*x.shape[:-1], n_rot).contiguous(), out_dtype, mode, n_rot,
                       scale)
        assert torch.equal(out, dense)


@pytest.mark.parametrize("x_dtype, w_dtype, c_dtype, out_dtype, atol, rtol", DTYPES, ids=IDS)
@pytest.mark.parametrize("mode", ["interleaved", "split_half"])
def test_equals_the_unfused_cpu_kernels_bit_for_bit(x_dtype, w_dtype, c_dtype, out_dtype, atol,
                                                    rtol, mode):
    """rms_norm_cpu -> rope_apply_cpu -> torch's ``* scale`` -> ``.to(out)``: the same sum of
    squares, so every bit equal (the roundings of the chain are where the fused kernel has
    them)."""
    gen = torch.Generator().manual_seed(11)
    x, cos, sin = _case("bshd_as_bhsd", 64, 48, x_dtype, c_dtype, gen)
    w = (torch.randn(64, generator=gen) * 0.5 + 1).to(w_dtype)
    for scale in (None, 0.3):
        n = rope_apply_cpu(rms_norm_cpu(x, w, 1e-6), cos, sin, mode, 48)
        want = (n if scale is None else n * scale).to(out_dtype)
        out = _fused(x, w, cos, sin, out_dtype, mode, 48, scale)
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), scale


def test_empty_input_and_compile_kernels():
    rms_rope.compile_kernels(F16, F16, F32, F32, F32)
    sigs = [tuple(str(a) for a in sig[:6]) for sig in rms_rope._jit().signatures]
    # x, w, tn (the norm's dtype: w's), cos, sin, out
    assert ("array(uint16, 1d, C)", "array(uint16, 1d, C)", "array(uint16, 1d, C)",
            "array(float32, 1d, C)", "array(float32, 1d, C)", "array(float32, 1d, C)") in sigs
    x = torch.randn(2, 0, 8)
    cos = sin = torch.ones(8)
    assert _fused(x, torch.ones(8), cos, sin, F32, "interleaved", 8, None).shape == (2, 0, 8)


# -- what the kernel does not handle ------------------------------------------------------------

def _meta(shape, dtype=F32, stride=None):
    t = torch.empty(shape, dtype=dtype)
    m = TensorMeta.of(t)
    return m if stride is None else dataclasses.replace(m, stride=tuple(stride))


GOOD = dict(x_meta=_meta((2, 3, 5, 8)), w_meta=_meta((8,)), cos_meta=_meta((5, 8)),
            sin_meta=_meta((5, 8)), out_dtype=F32, mode="interleaved", n_rot=8)


@pytest.mark.parametrize("change, reason", [
    (dict(x_meta=_meta((2, 3, 5, 8), torch.float64)), "x dtype torch.float64"),
    (dict(w_meta=None), "weight is not a tensor"),
    (dict(w_meta=_meta((8,), torch.float64)), "weight dtype torch.float64"),
    (dict(w_meta=_meta((1, 8))), r"weight shape \(1, 8\)"),
    (dict(w_meta=_meta((8,), stride=(2,))), "weight is strided"),
    (dict(out_dtype=torch.float64), "out dtype torch.float64"),
    (dict(out_dtype="float32"), "out dtype float32"),
    (dict(x_meta=_meta((2, 3, 5, 8), BF16), w_meta=_meta((8,), BF16),
          cos_meta=_meta((5, 8), F16)), r"cos/sin dtype torch.float16 \(float32 or the norm's "
                                        r"dtype torch.bfloat16\)"),
    (dict(x_meta=_meta((2, 3, 5, 8), BF16), cos_meta=_meta((5, 8), BF16)),
     r"cos/sin dtype torch.bfloat16 \(float32 or the norm's dtype torch.float32\)"),
    (dict(mode="neox"), "mode 'neox'"),
    (dict(n_rot=10), "n_rot"),
    (dict(n_rot=3), "n_rot"),
    (dict(x_meta=_meta((2, 3, 5, 7)), w_meta=_meta((7,)), n_rot=6), "head size"),
    (dict(x_meta=_meta((2, 3, 5, 8), stride=(120, 40, 1, 5))), "x's features are strided"),
    (dict(cos_meta=_meta((4, 8))), "do not broadcast"),
    (dict(sin_meta=_meta((5, 6))), "n_rot contiguous values"),
    (dict(cos_meta=_meta((5, 8), stride=(1, 5))), "n_rot contiguous values"),
    (dict(x_meta=dataclasses.replace(_meta((2, 8)), device=torch.device("meta"))),
     "not on the CPU"),
    (dict(x_meta="x"), "inputs are not tensors"),
    (dict(cos_meta=object()), "inputs are not tensors"),
])
def test_why_not_gives_the_reason(change, reason):
    assert rms_rope.why_not(**GOOD) is None
    why = rms_rope.why_not(**{**GOOD, **change})
    assert isinstance(why, str)
    assert re.search(reason, why), why


def test_why_not_never_raises():
    class Weird:  # metadata whose attributes raise
        def __getattr__(self, name):
            raise RuntimeError("no")
    for bad in (None, 3, Weird(), dataclasses.replace(_meta((8,)), shape=None)):
        for key in ("x_meta", "w_meta", "cos_meta", "sin_meta"):
            assert isinstance(rms_rope.why_not(**{**GOOD, key: bad}), str)
    assert isinstance(rms_rope.why_not(**{**GOOD, "n_rot": None}), str)


@pytest.mark.parametrize("case, match", [
    ("x_float64", "unsupported input: x dtype torch.float64"),
    ("cos_f16_for_bf16", "unsupported input: cos/sin dtype torch.float16"),
    ("bad_layout", "unsupported input: x's features are strided"),
    ("cos_no_broadcast", "unsupported input: cos/sin do not broadcast"),
    ("weight_none", "weight must be a tensor"),
    ("out_float64", "unsupported input: out dtype torch.float64"),
    ("out_shape", r"out must be a contiguous CPU tensor of x's shape \(2, 5, 8\)"),
    ("out_strided", "out must be a contiguous CPU tensor"),
    ("eps_negative", "unsupported input: eps -1.0"),
    ("scale_tensor", "unsupported input: scale tensor"),
    ("mode", "unsupported input: mode 'rotate'"),
])
def test_launcher_errors(case, match):
    x, w = torch.randn(2, 5, 8), torch.randn(8)
    cos, sin = _freqs((5, 8), 8, F32, torch.Generator().manual_seed(0))
    out = torch.empty(2, 5, 8)
    kw = dict(eps=1e-6, mode="interleaved", n_rot=8, scale=None)
    if case == "x_float64":
        x = x.double()
    elif case == "cos_f16_for_bf16":
        x, w, cos = x.to(BF16), w.to(BF16), cos.to(F16)
    elif case == "bad_layout":
        x = torch.randn(2, 8, 5).transpose(1, 2)
    elif case == "cos_no_broadcast":
        cos = sin = torch.ones(4, 8)
    elif case == "weight_none":
        w = None
    elif case == "out_float64":
        out = out.double()
    elif case == "out_shape":
        out = torch.empty(10, 8)
    elif case == "out_strided":
        out = torch.empty(8, 5, 2).permute(2, 1, 0)
    elif case == "eps_negative":
        kw["eps"] = -1.0
    elif case == "scale_tensor":
        kw["scale"] = torch.tensor(2.0)
    elif case == "mode":
        kw["mode"] = "rotate"
    with pytest.raises(ValueError, match=match):
        rms_rope.rms_rope_cpu(x, w, cos, sin, out, **kw)


# -- compilation --------------------------------------------------------------------------------
# (that importing this module does not import numba is tested with rope's, in tests/test_rope.py)

def test_compile_kernels_from_several_threads():
    """Plans compile their nodes in parallel: concurrent plan-time compiles (rope's, rmsnorm's
    and this kernel's, on the shared lock) all succeed."""
    from concurrent.futures import ThreadPoolExecutor

    from fxbackend.cpu_kernels import rmsnorm, rope
    jobs = [lambda: rms_rope.compile_kernels(BF16, BF16, F32, F32, BF16),
            lambda: rms_rope.compile_kernels(F32, F32, F32, F32, F32),
            lambda: rmsnorm.compile_kernels(BF16, BF16),
            lambda: rope.compile_kernels(BF16, F32, F32)] * 3
    with ThreadPoolExecutor(4) as pool:
        for f in [pool.submit(j) for j in jobs]:
            f.result()
