"""The ``channels_last_convs`` rewrite (patterns/channels_last.py): 16-bit CPU convolutional
networks run channels-last, their weights' copies kept between calls, and the caller still gets
eager's layout and values."""
from __future__ import annotations

import pytest
import torch
from expecttest import assert_expected_inline

import fxbackend
from fxbackend.patterns.channels_last import is_channels_last
from fxbackend.patterns.conv_layout import CONV_OP

from conftest import capture, rewrites

pytestmark = pytest.mark.usefixtures("no_grad")


@pytest.fixture(autouse=True)
def _native_16bit_convolutions(monkeypatch):
    """The rule is about 16-bit convolutions run as 16-bit: the class with native 16-bit
    arithmetic is pinned even under ``FXB_TEST_CPU_PROFILE`` (what a class without it does to
    the convolutions, float32 compute, is tests/test_upcast.py's).  ``make test-avx2`` still
    runs this module with the vectors limited to AVX2: oneDNN's layouts then follow its AVX2
    kernels (the 3-D test asks the host)."""
    monkeypatch.setenv("FXB_CPU_PROFILE", "amx")


class _ResBlock(torch.nn.Module):
    """conv_in -> GroupNorm -> SiLU -> conv -> + residual -> GroupNorm -> conv_out, as a UNet's
    ResnetBlock2D between its input and output convolutions."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.conv_in = torch.nn.Conv2d(4, c, 3, padding=1)
        self.norm1 = torch.nn.GroupNorm(4, c)
        self.conv = torch.nn.Conv2d(c, c, 3, padding=1)
        self.norm2 = torch.nn.GroupNorm(4, c)
        self.conv_out = torch.nn.Conv2d(c, 4, 3, padding=1)

    def forward(self, x):
        h = self.conv_in(x)
        y = self.conv(torch.nn.functional.silu(self.norm1(h)))
        return self.conv_out(self.norm2(h + y))


def _model(dtype):
    torch.manual_seed(0)
    return _ResBlock().to(dtype)


def _plan_of(graphs):
    (g,) = graphs
    (plan,) = g.all_plans()
    return plan


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_convolutional_block_runs_channels_last(dtype):
    model = _model(dtype)
    x = torch.randn(1, 4, 8, 8).to(dtype)
    torch._dynamo.reset()
    fxbackend.reset_stats()
    with fxbackend.record_graphs() as graphs:
        c = torch.compile(model, backend="fxbackend")
        out = c(x)
    assert rewrites("channels_last_convs") == 3
    plan = _plan_of(graphs)
    convs = [n for n in plan.graph.nodes if n.op == CONV_OP]
    assert len(convs) == 3
    for conv in convs:  # input, weight and result channels-last
        assert all(is_channels_last(plan.metas[s]) for s in conv.srcs[:2])
        assert is_channels_last(plan.metas[conv])
    # the three weight copies are kept between calls; the GroupNorm -> SiLU still fuses
    assert sorted(n.srcs[0].op for n in plan.cached) == ["input"] * 3
    assert fxbackend.stats()["fusions_by_rule"].get("group_norm_silu") == 1
    # eager's layout and values: the convolutions are bit-identical in channels-last; the
    # GroupNorms' float32 statistics are summed in another order over channels-last data
    want = model(x)
    assert out.is_contiguous() and out.shape == want.shape
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    # a weight updated in place (a LoRA fuse) is seen: its copy is redone
    model.conv.weight.mul_(-1)
    torch.testing.assert_close(c(x), model(x), rtol=2e-2, atol=2e-2)


def test_float32_is_left_alone():
    model = _model(torch.float32)
    x = torch.randn(1, 4, 8, 8)
    torch._dynamo.reset()
    fxbackend.reset_stats()
    torch.testing.assert_close(torch.compile(model, backend="fxbackend")(x), model(x))
    assert rewrites("channels_last_convs") == 0


def test_rule_can_be_disabled_and_then_matches_eager_bit_for_bit():
    model = _model(torch.bfloat16)
    x = torch.randn(1, 4, 8, 8).to(torch.bfloat16)
    torch._dynamo.reset()
    fxbackend.reset_stats()
    out = torch.compile(model, backend="fxbackend",
                        options={"disable_rewrites": ["channels_last_convs"],
                                 "fusion": False})(x)
    assert rewrites("channels_last_convs") == 0
    assert torch.equal(out, model(x))


def _bf16_args(*shapes):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g).bfloat16() for shape in shapes]


def _conv_view(x, w, w2):
    """A convolution whose result is read by a view that needs NCHW strides (channels merged
    with rows) and by another convolution."""
    y = torch.nn.functional.conv2d(x, w, padding=1)
    rows = y.view(1, 32, 4).softmax(-1)
    return rows, torch.nn.functional.conv2d(y, w2)


def test_view_that_needs_the_old_layout_reads_a_copy():
    args = _bf16_args((1, 4, 4, 4), (8, 4, 3, 3), (2, 8, 1, 1))
    fxbackend.reset_stats()
    c = capture(_conv_view, *args)  # bit for bit eager's (checked by capture)
    assert rewrites("channels_last_convs") == 2
    plan = c.graph.plan_for(args)
    view = next(n for n in plan.graph.nodes if n.op == "aten.view.default")
    back = view.srcs[0]
    assert back.op == "aten.clone.default" and back.srcs[0].op == CONV_OP
    assert back.params["memory_format"] == torch.contiguous_format
    # both outputs have eager's layouts
    assert all(o.is_contiguous() for o in c.out)
    assert_expected_inline(plan.graph.format(), """\
%0 = input : bf16[1,4,4,4]
%1 = input : bf16[8,4,3,3]
%2 = input : bf16[2,8,1,1]
%7 = aten.clone.default(%0) {memory_format=channels_last} : bf16[1,4,4,4]{64,1,16,4}
%8 = aten.clone.default(%1) {memory_format=channels_last} : bf16[8,4,3,3]{36,1,12,4}
%3 = aten.convolution.default(%7, %8) {stride=[1, 1], padding=[1, 1], dilation=[1, 1], transposed=False, output_padding=[0, 0], groups=1} : bf16[1,8,4,4]{128,1,32,8}
%9 = aten.clone.default(%3) {memory_format=contiguous_format} : bf16[1,8,4,4]
%4 = aten.view.default(%9) {size=[1, 32, 4]} : bf16[1,32,4]  # view_of=%9
%5 = aten._softmax.default(%4) {dim=-1, half_to_float=False} : bf16[1,32,4]  # output
%6 = aten.convolution.default(%3, %2) {stride=[1, 1], padding=[0, 0], dilation=[1, 1], transposed=False, output_padding=[0, 0], groups=1} : bf16[1,2,4,4]{32,1,8,2}
%11 = aten.clone.default(%6) {memory_format=contiguous_format} : bf16[1,2,4,4]  # output
return (%5, %11)""")


def _conv_upsample_conv(x, w1, w2):
    """A UNet decoder stage: convolution, nearest 2x upsampling (diffusers' ``Upsample2D``
    upsamples bf16 in float32), convolution."""
    y = torch.nn.functional.conv2d(x, w1, padding=1)
    up = torch.nn.functional.interpolate(y.float(), scale_factor=2, mode="nearest")
    return torch.nn.functional.conv2d(up.to(x.dtype), w2, padding=1)


def test_upsampling_between_convolutions_is_one_channels_last_copy():
    args = _bf16_args((1, 4, 4, 4), (8, 4, 3, 3), (4, 8, 3, 3))
    fxbackend.reset_stats()
    c = capture(_conv_upsample_conv, *args)  # bit for bit eager's (checked by capture)
    assert rewrites("channels_last_convs") == 2 and rewrites("index_upsample") == 1
    plan = c.graph.plan_for(args)
    nodes = plan.graph.nodes
    assert not any(n.op == "aten._unsafe_index.Tensor" for n in nodes)
    # the float32 image, its upsampled copy and the cast back stay channels-last: no copy
    # back to NCHW or into channels-last between the two convolutions (the second weight's
    # channels-last copy is there, kept between calls)
    convs = [n for n in nodes if n.op == CONV_OP]
    between = nodes[nodes.index(convs[0]) + 1: nodes.index(convs[1])]
    copies = [n for n in between if n.op == "aten.clone.default" and not n.srcs[0].is_input]
    assert len(copies) == 1 and plan.metas[copies[0]].shape == (1, 4, 2, 4, 2, 8)
    assert all(is_channels_last(plan.metas[n]) for n in between
               if n.op == "aten._to_copy.default")


def _temb_norm_proj(x, w, temb, gw, gb, w1):
    """A ResnetBlock's time-embedding add (a [1, C, 1, 1] broadcast: ATen may order the batch
    dim of a batch of one between channels and width), a GroupNorm, a 1x1 projection."""
    y = torch.nn.functional.conv2d(x, w, padding=1) + temb[:, :, None, None]
    h = torch.nn.functional.group_norm(y, 2, gw, gb)
    return torch.nn.functional.conv2d(h, w1)


def test_batch_of_one_gets_exact_channels_last_strides():
    args = _bf16_args((1, 4, 6, 6), (8, 4, 3, 3), (1, 8), (8,), (8,), (8, 8, 1, 1))
    fxbackend.reset_stats()
    c = capture(_temb_norm_proj, *args, exact=False, rtol=2e-2, atol=2e-2)
    assert rewrites("channels_last_convs") == 2
    plan = c.graph.plan_for(args)
    for conv in (n for n in plan.graph.nodes if n.op == CONV_OP):
        assert is_channels_last(plan.metas[conv])
        x = plan.metas[conv.srcs[0]]
        assert tuple(x.stride) == (x.shape[1] * x.shape[2] * x.shape[3], 1,
                                   x.shape[1] * x.shape[3], x.shape[1])
        # the layout the plan expects is the one the kernel returns: no copy of the result
        assert conv in plan.state.bound
    # only the network's input is copied into channels-last (weights aside)
    cl = [n for n in plan.graph.nodes if n.op == "aten.clone.default" and
          n.params.get("memory_format") == torch.channels_last and not n.srcs[0].is_input]
    assert not cl


def test_saved_plan_replays_and_sees_weight_updates(tmp_path):
    """A saved plan is rewritten again when loaded: channels-last, its weights' copies kept,
    and ``update_weights`` (in place) seen by the next call."""
    model = _model(torch.bfloat16)
    x = torch.randn(1, 4, 8, 8).to(torch.bfloat16)
    plan = fxbackend.export(model, (x,))
    got = plan(x)
    plan.save(tmp_path / "plan.fxb")
    fxbackend.reset_stats()
    back = fxbackend.load(tmp_path / "plan.fxb")
    assert torch.equal(back(x), got)
    assert rewrites("channels_last_convs") == 3
    assert fxbackend.stats()["weight_steps_cached"] == 3
    new = {k: -v for k, v in model.state_dict().items()}
    back.update_weights(new)
    model.load_state_dict(new)
    torch.testing.assert_close(back(x), model(x), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("family", ["vae", "sdxl"])
def test_tiny_models_in_bf16(family):
    """The table's VAE (encode and decode) and SDXL UNet in bf16: every convolution
    channels-last, outputs within a few bf16 roundings of eager (the GroupNorms' statistics
    are summed in another order; measured on the tiny VAE: 2.2e-2 with the rule, 2.6e-2
    without it, Inductor 2.4e-2; the tiny SDXL 1.6e-2, as Inductor).  (The
    VAE's output comes back channels-last, with the rule off too: that is the layout Dynamo
    recorded for it, whose fake tensors stride a batch of one unlike eager.)"""
    from fxbackend import models
    from ext_util import rel_err
    model = models.build_model(family, "tiny", dtype=torch.bfloat16)
    kw = models.make_inputs(family, "tiny", dtype=torch.bfloat16)
    torch._dynamo.reset()
    fxbackend.reset_stats()
    ref = models.run_eager(model, kw)
    out = models.run_eager(torch.compile(model, backend="fxbackend"), kw)
    convs = sum(isinstance(m, torch.nn.Conv2d) for m in model.modules())
    assert rewrites("channels_last_convs") == convs
    assert out.shape == ref.shape and rel_err(out, ref) <= 3e-2


def _video_block(x, w1, w2):
    """Two 3-D convolutions around a SiLU, the first after a causal time padding (a video
    VAE's ``CausalConv3d``: ``F.pad`` of two frames before, none after)."""
    y = torch.nn.functional.conv3d(torch.nn.functional.pad(x, (1, 1, 1, 1, 2, 0)), w1)
    return torch.nn.functional.conv3d(torch.nn.functional.silu(y), w2, padding=1)


def _conv3d_follows_channels_last() -> bool:
    """Whether this CPU's bf16 ``conv3d`` of channels-last-3d operands returns channels-last-3d
    (oneDNN's bf16 path; not where it lacks native bf16, e.g. AVX2-only CPUs), which is what
    the rule's layout planning asks of the convolution's fake implementation."""
    cl = torch.channels_last_3d
    x = torch.zeros(1, 4, 3, 6, 6, dtype=torch.bfloat16).contiguous(memory_format=cl)
    w = torch.zeros(8, 4, 3, 3, 3, dtype=torch.bfloat16).contiguous(memory_format=cl)
    return torch.nn.functional.conv3d(x, w).is_contiguous(memory_format=cl)


def test_three_dimensional_convolutions_run_channels_last_3d():
    args = _bf16_args((1, 4, 3, 6, 6), (8, 4, 3, 3, 3), (4, 8, 3, 3, 3))
    fxbackend.reset_stats()
    c = capture(_video_block, *args)  # bit for bit eager's (checked by capture)
    plan = c.graph.plan_for(args)
    if not _conv3d_follows_channels_last():
        # the host decides: its convolution would give NCHW back, so the rule declines, saying so
        assert rewrites("channels_last_convs") == 0
        assert "does not return channels-last" in plan.report()
        return
    assert rewrites("channels_last_convs") == 2
    for conv in (n for n in plan.graph.nodes if n.op == CONV_OP):
        assert all(is_channels_last(plan.metas[s]) for s in conv.srcs[:2])
        assert plan.metas[conv].stride[1] == 1  # channels innermost (NDHWC)
    assert c.out.is_contiguous()


def _conv_nhwc_out(x, w, w2):
    """A convolution whose result leaves the graph as an NHWC view (a layout eager gives as a
    permutation of NCHW: dense, not contiguous) and also feeds another convolution."""
    y = torch.nn.functional.conv2d(x, w, padding=1)
    return y.permute(0, 2, 3, 1) * 2, torch.nn.functional.conv2d(y, w2)


def test_output_in_a_permuted_dense_layout_gets_eager_strides():
    args = _bf16_args((1, 4, 4, 4), (8, 4, 3, 3), (2, 8, 1, 1))
    fxbackend.reset_stats()
    c = capture(_conv_nhwc_out, *args)  # bit for bit eager's (checked by capture)
    assert rewrites("channels_last_convs") == 2
    want = _conv_nhwc_out(*args)
    assert [o.stride() for o in c.out] == [o.stride() for o in want]
    plan = c.graph.plan_for(args)
    assert_expected_inline(plan.graph.format(), """\
%0 = input : bf16[1,4,4,4]
%1 = input : bf16[8,4,3,3]
%2 = input : bf16[2,8,1,1]
%7 = aten.clone.default(%0) {memory_format=channels_last} : bf16[1,4,4,4]{64,1,16,4}
%8 = aten.clone.default(%1) {memory_format=channels_last} : bf16[8,4,3,3]{36,1,12,4}
%3 = aten.convolution.default(%7, %8) {stride=[1, 1], padding=[1, 1], dilation=[1, 1], transposed=False, output_padding=[0, 0], groups=1} : bf16[1,8,4,4]{128,1,32,8}
%4 = aten.permute.default(%3) {dims=[0, 2, 3, 1]} : bf16[1,4,4,8]  # view_of=%3
%5 = aten.mul.Tensor(%4) {other=2} : bf16[1,4,4,8]
%6 = aten.convolution.default(%3, %2) {stride=[1, 1], padding=[0, 0], dilation=[1, 1], transposed=False, output_padding=[0, 0], groups=1} : bf16[1,2,4,4]{32,1,8,2}
%10 = aten.clone.default(%5) {memory_format=preserve_format} : bf16[1,4,4,8]{128,4,1,16}  # output
%11 = aten.clone.default(%6) {memory_format=contiguous_format} : bf16[1,2,4,4]  # output
return (%10, %11)""")


class _ConvTokens(torch.nn.Module):
    """A UNet's transformer input: convolution, the image as token rows (``permute -> view``)
    through a LayerNorm and a linear, back to an image, convolution."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.conv_in = torch.nn.Conv2d(4, c, 3, padding=1)
        self.norm = torch.nn.LayerNorm(c)
        self.proj = torch.nn.Linear(c, c)
        self.conv_out = torch.nn.Conv2d(c, 4, 3, padding=1)

    def forward(self, x):
        b, _, h, w = x.shape
        y = self.conv_in(x)
        t = self.proj(self.norm(y.permute(0, 2, 3, 1).reshape(b, h * w, -1)))
        return self.conv_out(t.reshape(b, h, w, -1).permute(0, 3, 1, 2).contiguous() + y)


def test_dynamic_compile_plans_run_channels_last():
    """``dynamic=True``: the graph's sizes are symbolic, each plan's are not, and the rule
    runs on each plan (the token rows' LayerNorm follows the new layout; its float32 mean and
    rstd, which torch's fake kernel gives in bf16, keep their traced metadata)."""
    torch.manual_seed(0)
    model = _ConvTokens().to(torch.bfloat16)
    torch._dynamo.reset()
    fxbackend.reset_stats()
    with fxbackend.record_graphs() as graphs:
        c = torch.compile(model, backend="fxbackend", dynamic=True)
        for size in (8, 12):
            x = torch.randn(1, 4, size, size).to(torch.bfloat16)
            out, want = c(x), model(x)
            assert out.stride() == want.stride()
            torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    assert rewrites("channels_last_convs") == 4  # two convolutions in each of two plans
    (g,) = graphs
    assert g.graph.is_symbolic and len(g.plans) == 2
    for plan in g.plans.values():
        assert not plan.rewrites_declined
        for conv in (n for n in plan.graph.nodes if n.op == CONV_OP):
            assert is_channels_last(plan.metas[conv])
        # the token rows need no copy: the only one of a computed value is the output's
        copies = [n for n in plan.graph.nodes
                  if n.op == "aten.clone.default" and n.srcs[0].op != "input"]
        assert [n.is_output for n in copies] == [True]
