"""RMSNorm's CPU kernel (cpu_kernels/rmsnorm.py) for ``sd.rms_norm.v1`` (patterns/rmsnorm.py).

- per-kernel, parametrised against ``rms_norm_reference`` on hand-built graphs run by
  ``CompiledGraph``: odd row counts and head sizes, strided rows (a head slice of a fused QKV
  output, ``[B, S, H, D]`` seen as ``[B, H, S, D]``, x broadcast over a dim), with and without a
  weight, ``(x dtype, weight dtype, atol, rtol)`` rows;
- the kernel is selected for the node the idiom makes of ``F.rms_norm`` under torch.compile;
- plan-time compilation, strides other than planned, the launcher's errors, and declining
  (``supports`` False, never raising; the reference runs natively).

The numba kernel compiles once per dtype combination (cached on disk), so a first run of this
file pays some seconds of compilation; the rows below reuse few combinations.
"""
from __future__ import annotations

import pytest
import torch

import fxbackend
from fxbackend import Graph, TensorMeta
from fxbackend.cpu_kernels import rmsnorm as cpu_rms
from fxbackend.patterns.rmsnorm import rms_norm_reference

from ext_util import compiled, set_outputs

OP = "sd.rms_norm.v1"
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# (x dtype, weight dtype, atol, rtol).  The kernel sums the squares in another float32 order
# than torch (measured: <= 1.5e-6 abs / 3.6e-7 rel on float32 outputs); a 16-bit output may
# then round one way where the reference rounds the other: one ulp (bf16 2**-8, fp16 2**-11
# relative to the binade), inside these tolerances.
DTYPES = [(F32, F32, 1e-5, 1e-5), (BF16, BF16, 1.6e-2, 1.6e-2), (BF16, F32, 1e-5, 1e-5),
          (F16, F16, 2e-3, 2e-3)]
IDS = ["f32-f32", "bf16-bf16", "bf16-f32", "f16-f16"]


def _input(g, t: torch.Tensor):
    """An input node with ``t``'s exact metadata (strides and storage offset included)."""
    return g.append(g.new_node("input", meta=TensorMeta.of(t), is_input=True))


def _run(x, w, eps=1e-6):
    """One ``sd.rms_norm.v1`` node on inputs with exactly these layouts; (result, steps)."""
    g = Graph()
    ts = [x] if w is None else [x, w]
    set_outputs(g, fxbackend.op_create(g, OP, [_input(g, t) for t in ts], {"eps": eps}))
    fxbackend.reset_stats()
    (out,) = compiled(g)(*ts)
    return out, dict(fxbackend.stats()["steps_by_kernel"])


def _x(kind: str, D: int, dtype, gen) -> torch.Tensor:
    """x for one layout (values of a few units, as activations before a norm)."""
    def rnd(*shape):
        return (torch.randn(*shape, generator=gen) * 3).to(dtype)
    B, H, S = 2, 3, 7
    if kind in ("rows_1", "rows_7", "rows_13"):
        return rnd(int(kind[5:]), D)
    if kind == "bhsd":
        return rnd(B, H, S, D)
    if kind == "bshd_as_bhsd":  # [B, S, H, D] permuted to [B, H, S, D]: strided rows
        return rnd(B, S, H, D).permute(0, 2, 1, 3)
    if kind == "qkv_slice":  # x = qkv[..., :D]: a row stride of 3D and the q of a fused QKV
        return rnd(B, S, 3 * D)[..., :D]
    if kind == "k_of_fused_qkv":  # the k of [B, S, 3*H*D] as [B, H, S, D]: offset + strides
        return rnd(B, S, 3 * H * D).view(B, S, 3, H, D)[:, :, 1].transpose(1, 2)
    if kind == "expanded":  # broadcast over the batch (stride 0)
        return rnd(1, S, D).expand(B, S, D)
    if kind == "one_row_1d":
        return rnd(D)
    raise AssertionError(kind)


LAYOUTS = ["rows_1", "rows_7", "rows_13", "bhsd", "bshd_as_bhsd", "qkv_slice", "k_of_fused_qkv",
           "expanded", "one_row_1d"]


# -- the kernel against the reference -----------------------------------------------------------

@pytest.mark.parametrize("x_dtype, w_dtype, atol, rtol", DTYPES, ids=IDS)
@pytest.mark.parametrize("D", [2, 6, 7, 18, 64])
@pytest.mark.parametrize("kind", LAYOUTS)
def test_cpu_kernel_matches_reference(x_dtype, w_dtype, atol, rtol, D, kind):
    gen = torch.Generator().manual_seed(D * 7 + LAYOUTS.index(kind))
    x = _x(kind, D, x_dtype, gen)
    w = (torch.randn(D, generator=gen) * 0.5 + 1).to(w_dtype)
    out, steps = _run(x, w)
    assert steps == {"rms_norm_cpu": 1}
    want = rms_norm_reference(x, w, 1e-6)
    assert out.dtype == want.dtype and out.shape == x.shape and out.is_contiguous()
    torch.testing.assert_close(out, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("x_dtype, atol, rtol", [(F32, 1e-5, 1e-5), (BF16, 1.6e-2, 1.6e-2)],
                         ids=["f32", "bf16"])
@pytest.mark.parametrize("kind", ["rows_13", "bshd_as_bhsd", "qkv_slice"])
def test_cpu_kernel_without_weight(x_dtype, atol, rtol, kind):
    gen = torch.Generator().manual_seed(5)
    x = _x(kind, 18, x_dtype, gen)
    out, steps = _run(x, None, eps=1e-5)
    assert steps == {"rms_norm_cpu": 1}
    want = rms_norm_reference(x, None, 1e-5)
    assert out.dtype == x_dtype
    torch.testing.assert_close(out, want, atol=atol, rtol=rtol)


def test_cpu_kernel_is_close_to_exact_on_wide_rows():
    """Wide rows (a hidden size, not a head): the float32 sum keeps the reference's accuracy
    (each within a few float32 ulps of the float64 result)."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(5, 3072, generator=gen) * torch.logspace(-3, 3, 5)[:, None]
    w = torch.randn(3072, generator=gen)
    out = cpu_rms.rms_norm_cpu(x, w, 1e-6)
    exact = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)) * w
    ref = rms_norm_reference(x, w, 1e-6)
    err, ref_err = ((out - exact).abs().max().item(), (ref - exact).abs().max().item())
    assert err <= 2 * ref_err + 1e-6, (err, ref_err)


def test_torch_compile_selects_the_kernel():
    D = 64
    fn = lambda x, w: torch.nn.functional.rms_norm(x, (D,), w, eps=1e-6)  # noqa: E731
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(2, 9, D, generator=gen), torch.randn(D, generator=gen)
    out = torch.compile(fn, backend="fxbackend", fullgraph=True)(x, w)
    assert fxbackend.stats()["steps_by_kernel"].get("rms_norm_cpu") == 1
    torch.testing.assert_close(out, fn(x, w), atol=1e-5, rtol=1e-5)


def test_kernel_compiles_at_plan_time():
    """The ``compile`` capability runs when the plan is built, before the first call."""
    x, w = torch.randn(3, 10).to(F16), torch.randn(10).to(F16)
    g = Graph()
    set_outputs(g, fxbackend.op_create(g, OP, [_input(g, x), _input(g, w)], {"eps": 1e-6}))
    compiled(g).plan_for([x, w])
    sigs = [tuple(str(a) for a in sig[:3]) for sig in cpu_rms._jit().signatures]
    assert ("array(uint16, 1d, C)", "array(uint16, 1d, C)", "array(uint16, 1d, C)") in sigs


def test_other_strides_than_planned_are_read_correctly():
    """``run`` (behind Dynamo's guards) does not validate strides: the kernel rebuilds its row
    table when the call's strides differ from the planned metadata."""
    x_planned = torch.randn(2, 3, 7, 10)
    x_strided = torch.randn(2, 7, 3, 10).transpose(1, 2)
    w = torch.randn(10)
    g = Graph()
    set_outputs(g, fxbackend.op_create(g, OP, [_input(g, x_planned), _input(g, w)],
                                       {"eps": 1e-6}))
    cg = compiled(g)
    for x in (x_planned, x_strided, x_planned):
        (out,) = cg.run([x, w])
        torch.testing.assert_close(out, rms_norm_reference(x, w, 1e-6), atol=1e-5, rtol=1e-5)


def test_launcher_direct_call_and_empty_input():
    w = torch.randn(8)
    assert cpu_rms.rms_norm_cpu(torch.randn(3, 0, 8), w, 1e-6).shape == (3, 0, 8)
    x = torch.randn(4, 8)
    out = torch.empty(4, 8)
    assert cpu_rms.rms_norm_cpu(x, w, 1e-6, out=out) is out
    torch.testing.assert_close(out, rms_norm_reference(x, w, 1e-6), atol=1e-5, rtol=1e-5)


def test_zero_row_with_zero_eps_gives_torchs_nan():
    # eps = 0 is accepted; an all-zero row then divides by zero: IEEE (nan, as torch's
    # x * rsqrt(0)), not an error
    x = torch.randn(3, 8)
    x[1] = 0
    w = torch.randn(8)
    out = cpu_rms.rms_norm_cpu(x, w, 0.0)
    ref = rms_norm_reference(x, w, 0.0)
    assert torch.isnan(ref[1]).all() and torch.isnan(out[1]).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("case, match", [
    ("x_float64", "x dtype torch.float64"),
    ("w_float64", "weight dtype torch.float64"),
    ("w_strided", "weight is strided"),
    ("w_shape", r"weight shape \(4,\) \(want \(8,\)\)"),
    ("x_features_strided", "x's features are strided"),
    ("eps_negative", "eps -1.0"),
    ("out_dtype", "out must be a contiguous CPU tensor of shape .* and dtype torch.float32"),
    ("out_strided", "out must be a contiguous CPU tensor"),
])
def test_launcher_errors(case, match):
    x, w, eps, out = torch.randn(4, 8), torch.randn(8), 1e-6, None
    if case == "x_float64":
        x = x.double()
    elif case == "w_float64":
        w = w.double()
    elif case == "w_strided":
        w = torch.randn(16)[::2]
    elif case == "w_shape":
        w = torch.randn(4)
    elif case == "x_features_strided":
        x = torch.randn(8, 4).t()
    elif case == "eps_negative":
        eps = -1.0
    elif case == "out_dtype":
        out = torch.empty(4, 8, dtype=BF16)
    elif case == "out_strided":
        out = torch.empty(8, 4).t()
    with pytest.raises(ValueError, match=match):
        cpu_rms.rms_norm_cpu(x, w, eps, out=out)


# -- declining: supports() is False, the reference runs -------------------------------------------

def test_strided_weight_declines_and_runs_native():
    x, w = torch.randn(5, 8), torch.randn(16)[::2]
    out, steps = _run(x, w)
    assert steps == {"native": 1}
    torch.testing.assert_close(out, rms_norm_reference(x, w, 1e-6), rtol=0, atol=0)


def test_supports_never_raises():
    k = cpu_rms.RmsNormCPU()
    g = Graph()
    x, w = _input(g, torch.randn(4, 8)), _input(g, torch.randn(8))
    node = fxbackend.op_create(g, OP, [x, w], {"eps": 1e-6})
    assert k.supports(node)
    for broken in ({}, {"eps": None}, {"eps": "1e-6"}, {"eps": float("nan")}):
        node.params = broken
        assert k.supports(node) is False
    node.params = {"eps": 1e-6}
    node.srcs = [x, w, w]
    assert k.supports(node) is False
    node.srcs = [object(), object()]
    assert k.supports(node) is False
    node.srcs = []
    assert k.supports(node) is False
