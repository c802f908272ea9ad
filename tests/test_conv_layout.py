"""The ``conv_channels_last`` rewrite (patterns/conv_layout.py): a CPU convolution whose result
is read only as token rows (``view(B, C, H*W).transpose(1, 2)``) computes on a channels-last
copy of its input, so the rows are contiguous; everything else is left alone."""
from __future__ import annotations

import pytest
import torch

import fxbackend
from fxbackend.patterns.conv_layout import CONV_OP, channels_last_strides

from conftest import capture, rewrites, tiny_model_outputs


def _patch_embed(x, w, b, pos):
    """diffusers' PatchEmbed, written out: conv -> flatten(2) -> transpose(1, 2) -> + pos."""
    y = torch.nn.functional.conv2d(x, w, b, stride=2)
    return y.flatten(2).transpose(1, 2) + pos


def _args(c_in=4, c_out=32, hw=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, c_in, hw, hw, generator=g).to(dtype)
    w = (torch.randn(c_out, c_in, 2, 2, generator=g) * 0.3).to(dtype)
    b = torch.randn(c_out, generator=g).to(dtype)
    pos = torch.randn(1, (hw // 2) ** 2, c_out, generator=g).to(dtype)
    return [x, w, b, pos]


def _conv_nodes(plan):
    return [n for n in plan.graph.nodes if n.op == CONV_OP]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patch_embedding_convolution_runs_channels_last(dtype, no_grad):
    args = _args(dtype=dtype)
    fxbackend.reset_stats()
    c = capture(_patch_embed, *args, exact=False, rtol=1e-5, atol=1e-5)
    assert rewrites("conv_channels_last") == 1
    plan = c.graph.plan_for(args)
    (conv,) = _conv_nodes(plan)
    assert conv.srcs[0].op == "aten.clone.default"
    assert conv.srcs[0].params["memory_format"] == torch.channels_last
    assert tuple(plan.metas[conv].stride) == channels_last_strides(plan.metas[conv].shape)
    # the token rows the add reads are contiguous now, and the result is used as the CPU
    # kernel returns it (its layout check agrees), not copied into planned storage
    add = next(n for n in plan.graph.nodes if n.op == "aten.add.Tensor")
    assert all(plan.metas[s].is_contiguous for s in add.srcs)
    assert conv in plan.state.bound and plan.copies == 0
    # repeated calls keep matching eager
    for _ in range(2):
        args = _args(dtype=dtype)
        torch.testing.assert_close(c.fn(*args), _patch_embed(*args), rtol=1e-5, atol=1e-5)


def test_elementwise_steps_after_the_rows_write_rows(no_grad):
    """PixArt adds the position embedding and feeds the sum to a LayerNorm: ATen gave the sum
    the transposed layout of the convolution's tokens; it now writes contiguous rows too.  A
    returned sum keeps eager's layout."""
    def fn(x, w, b, pos):
        s = _patch_embed(x, w, b, pos)
        return torch.nn.functional.layer_norm(s * 2, s.shape[-1:])

    args = _args()
    c = capture(fn, *args, exact=False, rtol=1e-5, atol=1e-5)
    assert rewrites("conv_channels_last") == 1
    plan = c.graph.plan_for(args)
    for op in ("aten.add.Tensor", "aten.mul.Tensor"):
        n = next(n for n in plan.graph.nodes if n.op == op)
        assert plan.metas[n].is_contiguous, op

    torch._dynamo.reset()
    c = capture(_patch_embed, *args, exact=False, rtol=1e-5, atol=1e-5)
    assert c.out.stride() == _patch_embed(*args).stride()


def test_results_equal_eager_bit_for_bit_at_sd3_size(no_grad):
    """On the patch embedding of SD3's small config the channels-last convolution returns the
    same bits as eager's NCHW one where this CPU's oneDNN sums both layouts in the same order
    (eager's own channels-last convolution tells; on AVX-512 hosts it does, on AVX2-only ones
    it does not: there the result is within float32 roundings)."""
    args = _args(c_in=16, c_out=512, hw=64)
    x, w, b, _ = args
    cl = torch.channels_last
    same_bits = torch.equal(torch.nn.functional.conv2d(x, w, b, stride=2),
                            torch.nn.functional.conv2d(x.contiguous(memory_format=cl),
                                                       w.contiguous(memory_format=cl), b,
                                                       stride=2))
    fxbackend.reset_stats()
    if same_bits:
        capture(_patch_embed, *args)  # exact
    else:
        capture(_patch_embed, *args, exact=False, rtol=1e-5, atol=1e-5)
    assert rewrites("conv_channels_last") == 1


@pytest.mark.parametrize("fn", [
    # the result is read as NCHW besides the token rows
    lambda x, w, b, pos: (lambda y: (y.flatten(2).transpose(1, 2) + pos, y.relu()))(
        torch.nn.functional.conv2d(x, w, b, stride=2)),
    # read only as NCHW
    lambda x, w, b, pos: torch.nn.functional.conv2d(x, w, b, stride=2).relu(),
    # the NCHW view [B, C, H*W] is what is read (contiguous already)
    lambda x, w, b, pos: torch.nn.functional.conv2d(x, w, b, stride=2).flatten(2).exp(),
    # the result is returned: the caller gets the layout eager gives
    lambda x, w, b, pos: torch.nn.functional.conv2d(x, w, b, stride=2),
])
def test_left_alone(fn, no_grad):
    fxbackend.reset_stats()
    capture(fn, *_args(), exact=False, rtol=1e-5, atol=1e-5)
    assert rewrites("conv_channels_last") == 0


def test_declined_when_the_input_copy_costs_more(no_grad):
    """A convolution with as many elements in as out: the channels-last copy of its input would
    cost as much as it saves; the plan's report says so."""
    def fn(x, w):
        return torch.nn.functional.conv2d(x, w, padding=1).flatten(2).transpose(1, 2).exp()

    x = torch.randn(1, 8, 12, 12)
    w = torch.randn(8, 8, 3, 3) * 0.1
    fxbackend.reset_stats()
    c = capture(fn, x, w, exact=False, rtol=1e-5, atol=1e-5)
    assert rewrites("conv_channels_last") == 0
    report = c.graph.plan_for([x, w]).report()
    assert "conv_channels_last" in report and "more than half the size" in report


@pytest.mark.parametrize("family,count", [
    ("sd3", 1),     # 4 channels in, 32 out
    ("pixart", 0),  # 4 in, 16 out of a 2x2 patch: as many elements in as out (declined)
])
def test_models_patch_embedding(family, count, no_grad):
    got, want = tiny_model_outputs(family)
    assert rewrites("conv_channels_last") == count
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


# -- 1x1 convolutions next to token rows (UNet transformers' proj_in / proj_out) ---------------

def _proj_in(x, w, b):
    """Transformer2DModel's input side: 1x1 conv, then the pixels as token rows."""
    y = torch.nn.functional.conv2d(x, w, b)
    t = y.permute(0, 2, 3, 1).reshape(x.shape[0], -1, w.shape[0])
    return torch.nn.functional.layer_norm(t, t.shape[-1:]) + t


def _proj_out(t, w, b, res):
    """Transformer2DModel's output side: token rows back to NCHW (a copy), 1x1 conv, residual."""
    n, _, h, wd = res.shape
    x = t.reshape(n, h, wd, -1).permute(0, 3, 1, 2).contiguous()
    return torch.nn.functional.conv2d(x, w, b) + res


def _ops(plan):
    return [n.op for n in plan.graph.nodes if n in plan.kernels]


@pytest.mark.parametrize("bias", [True, False])
def test_1x1_convolution_read_as_rows_is_a_gemm_on_the_transposed_input(bias, no_grad):
    g = torch.Generator().manual_seed(1)
    args = [torch.randn(1, 24, 6, 10, generator=g), torch.randn(24, 24, 1, 1, generator=g) * 0.2,
            torch.randn(24, generator=g) if bias else None]
    fxbackend.reset_stats()
    c = capture(_proj_in, *args, exact=False, rtol=1e-5, atol=1e-5)
    assert rewrites("conv_channels_last") == 1
    plan = c.graph.plan_for(args)
    ops = _ops(plan)
    assert CONV_OP not in ops and ("aten.addmm.default" if bias else "aten.mm.default") in ops
    gemm = next(n for n in plan.graph.nodes if n.op in ("aten.addmm.default", "aten.mm.default"))
    assert plan.metas[gemm].is_contiguous and tuple(plan.metas[gemm].shape) == (60, 24)
    # the layer norm reads contiguous rows now
    ln = next(n for n in plan.graph.nodes if n.op == "aten.native_layer_norm.default")
    assert plan.metas[ln.srcs[0]].is_contiguous


@pytest.mark.parametrize("bias", [True, False])
def test_1x1_convolution_of_copied_rows_reads_the_rows(bias, no_grad):
    g = torch.Generator().manual_seed(2)
    args = [torch.randn(1, 60, 16, generator=g), torch.randn(8, 16, 1, 1, generator=g) * 0.2,
            torch.randn(8, generator=g) if bias else None, torch.randn(1, 8, 6, 10, generator=g)]
    fxbackend.reset_stats()
    c = capture(_proj_out, *args, exact=False, rtol=1e-5, atol=1e-5)
    assert rewrites("conv_channels_last") == 1
    ops = _ops(c.graph.plan_for(args))
    assert CONV_OP not in ops and "aten.clone.default" not in ops  # the NCHW copy is gone


def test_1x1_convolutions_of_a_batch_are_left_alone(no_grad):
    """Only one image per call becomes a GEMM (a batch would need a batched GEMM); the input
    side is then declined as any same-size convolution is."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(24, 24, 1, 1, generator=g) * 0.2
    fxbackend.reset_stats()
    capture(_proj_in, torch.randn(2, 24, 6, 10, generator=g), w, None, exact=False, rtol=1e-5,
            atol=1e-5)
    capture(_proj_out, torch.randn(2, 60, 24, generator=g), w, None,
            torch.randn(2, 24, 6, 10, generator=g), exact=False, rtol=1e-5, atol=1e-5)
    assert rewrites("conv_channels_last") == 0


def test_unet_transformers_1x1_projections_are_gemms(no_grad):
    got, want = tiny_model_outputs("unet")
    assert rewrites("conv_channels_last") == 8  # proj_in and proj_out of each of the 4 transformer blocks
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
