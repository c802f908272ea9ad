"""The ``scale_cast`` fusion family (patterns/scale_cast.py): ``mul(x, c) -> cast to fp16/bf16``
as one step: the numba kernel and the Triton kernel (interpreter) bit-exact against the
reference, and the rule through the backend (fused vs eager, the copy form, declines).  The
four diffusers test models (float32) have no such chain: tests/test_modulation.py checks the rule
fires 0 times there while it compiles them."""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch

import fxbackend
import fxbackend.cpu_kernels.scale_cast  # noqa: F401  (registers the "cpu" rule)
import fxbackend.cuda_kernels.scale_cast  # noqa: F401  (registers the "cuda" rule)
from fxbackend.cpu_kernels.scale_cast import scale_cast_cpu
from fxbackend.patterns.scale_cast import scale_cast_reference

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from _rope_interp_check import check_result, run_checker  # noqa: E402

PAIRS = [("float32", "bfloat16"), ("float32", "float16"), ("bfloat16", "float16"),
         ("float16", "bfloat16"), ("bfloat16", "bfloat16")]


@pytest.mark.parametrize("x_dt,out_dt", PAIRS)
@pytest.mark.parametrize("shape,transposed", [((3, 1000, 7), False), ((33, 65), True),
                                              ((70001,), False)])
def test_cpu_kernel_is_bit_exact(x_dt, out_dt, shape, transposed):
    g = torch.Generator().manual_seed(len(shape))
    x = (torch.randn(*shape, generator=g) * 3).to(getattr(torch, x_dt))
    if transposed:
        x = x.transpose(0, 1)
    out = torch.empty_strided(x.shape, x.stride(), dtype=getattr(torch, out_dt))
    scale_cast_cpu(x, 0.18215, out)
    assert torch.equal(out, scale_cast_reference(x, 0.18215, out.dtype))


def _hard_float32_cases() -> torch.Tensor:
    """Float32 values at every kind of 16-bit rounding boundary: every fp16 and bf16 value,
    the midpoints between neighbours (ties: to even) and one float32 ulp either side, the
    overflow edges, subnormals, signed zeros, infinities and NaN."""
    f16 = torch.arange(0, 2 ** 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    bf16 = torch.arange(0, 2 ** 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    vals = [f16.float(), bf16.float()]
    for v in (f16.float(), bf16.float()):
        v = v[v.isfinite()].unique()
        mid = (v[:-1].double() + v[1:].double()) / 2  # exact in float64, rounds in float32
        m32 = mid.float()
        vals += [m32, torch.nextafter(m32, torch.tensor(float("inf"))),
                 torch.nextafter(m32, torch.tensor(float("-inf")))]
    edge = torch.tensor([65504.0, 65519.99, 65520.0, 65536.0, 3.0e38, 6.0e-8, 2.9e-8, 3.0e-8,
                         5.96e-8, 1e-45, -0.0, 0.0, float("inf"), float("-inf"), float("nan")])
    vals += [edge, -edge]
    return torch.cat(vals)


@pytest.mark.parametrize("out_dt", [torch.float16, torch.bfloat16])
def test_cpu_conversions_at_every_boundary(out_dt):
    # the kernels' float32 -> 16-bit stores (rope's conversions, shared by every CPU kernel)
    # round as torch does, at every value class; and every 16-bit pattern loads exactly
    x = _hard_float32_cases()
    got = scale_cast_cpu(x, 1.0, torch.empty(x.shape, dtype=out_dt))
    want = x.to(out_dt)
    assert ((got == want) | (got.isnan() & want.isnan())).all()
    bits = torch.arange(0, 2 ** 16, dtype=torch.int32).to(torch.int16).view(out_dt)
    back = scale_cast_cpu(bits, 1.0, torch.empty(bits.shape, dtype=out_dt))
    assert ((back == bits) | (back.isnan() & bits.isnan())).all()


def test_cpu_kernel_rejects_other_layouts():
    x = torch.randn(8, 10)[:, :5]
    with pytest.raises(ValueError, match="dense"):
        scale_cast_cpu(x, 2.0, torch.empty(8, 5, dtype=torch.float16))


INTERP = [dict(id=f"{a}->{b}/{t}", x=a, out=b, shape=[9, 37], transposed=t, c=0.3)
          for a, b in PAIRS for t in (False, True)]


@pytest.fixture(scope="module")
def interp_results():
    return run_checker("_scale_cast_interp_check.py", INTERP)


@pytest.mark.parametrize("case", INTERP, ids=[c["id"] for c in INTERP])
def test_triton_kernel_in_the_interpreter(interp_results, case):
    check_result(interp_results, case)


@pytest.mark.parametrize("out_dt", [torch.bfloat16, torch.float16])
def test_rule_fuses_scale_then_cast(out_dt):
    f = lambda x: (x * 0.18215).to(out_dt)  # noqa: E731
    x = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        got = torch.compile(f, backend="fxbackend")(x)
    assert fxbackend.stats()["fusions_by_rule"] == {"scale_cast": 1}
    assert torch.equal(got, f(x))


def test_rule_fuses_the_copy_form():
    def f(x, dst):
        dst.copy_(x * 0.5)
        return dst

    x, dst = torch.randn(4, 33), torch.zeros(4, 33, dtype=torch.bfloat16)
    want = (x * 0.5).to(torch.bfloat16)
    with torch.no_grad():
        got = torch.compile(f, backend="fxbackend")(x, dst)
    assert fxbackend.stats()["fusions_by_rule"] == {"scale_cast": 1}
    assert torch.equal(got, want) and torch.equal(dst, want)


def test_rule_declines_non_dense_layouts_with_a_reason():
    f = lambda x: (x[:, ::2] * 3.0).to(torch.float16)  # noqa: E731
    x = torch.randn(6, 10)
    with torch.no_grad():
        text = fxbackend.explain(f, x)
        got = torch.compile(f, backend="fxbackend")(x)
    assert "declined scale_cast" in text and "dense" in text
    assert torch.equal(got, f(x))


def test_bit_level_fp16_conversions_at_every_boundary():
    # rope's bit-level float32 <-> fp16 conversions, which the kernels compile to where the CPU
    # has no hardware conversion (rope._hardware_half() False), round and load as torch does
    import numba
    import numpy as np

    from fxbackend.cpu_kernels import rope

    to16, to32 = numba.njit(rope._f32_to_f16), numba.njit(rope._f16_to_f32)

    @numba.njit
    def both(x, h, back):
        for i in range(x.shape[0]):
            h[i] = to16(x[i])
        for i in range(back.shape[0]):
            back[i] = to32(np.uint16(i))

    x = _hard_float32_cases()
    h = np.empty(x.numel(), np.uint16)
    back = np.empty(2 ** 16, np.float32)
    both(x.numpy(), h, back)
    got = torch.from_numpy(h.view(np.int16)).view(torch.float16)
    want = x.to(torch.float16)
    assert ((got == want) | (got.isnan() & want.isnan())).all()
    bits = torch.arange(0, 2 ** 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    b = torch.from_numpy(back)
    assert ((b == bits.float()) | (b.isnan() & bits.isnan())).all()
