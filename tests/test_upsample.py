"""The ``index_upsample`` rewrite (patterns/upsample.py): nearest-neighbour upsampling, which
reaches the backend as ``_unsafe_index`` by index tensors computed from sizes, runs as two
copies from broadcast views; bit-identical to eager.  And ``RewriteContext.constant`` /
``fold.constant_value``, which it reads the indices with."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxbackend
from fxbackend.fold import constant_value

from conftest import capture, rewrites, tiny_model_outputs

_GATHER = "aten._unsafe_index.Tensor"


def _ops(c, args):
    return [n.op for n in c.graph.plan_for(args).graph.nodes]


@pytest.mark.parametrize("shape,scale,mode", [
    ((1, 4, 5, 7), 2, "nearest"),
    ((2, 3, 8, 8), 2, "nearest"),
    ((1, 2, 3, 4), (3, 2), "nearest"),
    ((1, 2, 6, 5), (1, 3), "nearest"),
    ((1, 2, 4, 3), (2, 1), "nearest"),
    ((1, 5, 4, 4), 2, "nearest-exact"),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nearest_upsampling_is_copies(shape, scale, mode, dtype, no_grad):
    def fn(x):
        return F.interpolate(x, scale_factor=scale, mode=mode) + 1

    x = torch.randn(*shape).to(dtype)
    fxbackend.reset_stats()
    c = capture(fn, x)  # exact: bit-identical to eager
    assert rewrites("index_upsample") == 1
    ops = _ops(c, [x])
    assert _GATHER not in ops and "aten.clone.default" in ops
    for _ in range(2):  # the plan again, on new values
        x = torch.randn(*shape).to(dtype)
        assert torch.equal(c.fn(x), fn(x))


@pytest.mark.parametrize("shape,scale,mode", [
    ((1, 3, 7), 2, "nearest"),                    # 1-D (Upsample1D)
    ((2, 4, 5), 3, "nearest-exact"),
    ((1, 2, 3, 4, 5), 2, "nearest"),              # 3-D (video VAEs)
    ((1, 3, 2, 4, 4), (1, 2, 2), "nearest"),      # spatial only, frames kept
    ((1, 2, 3, 3, 2), (2, 1, 3), "nearest-exact"),
])
def test_one_and_three_dimensional_upsampling(shape, scale, mode, no_grad):
    def fn(x):
        return F.interpolate(x, scale_factor=scale, mode=mode) * 0.5

    x = torch.randn(*shape)
    fxbackend.reset_stats()
    c = capture(fn, x)  # bit-identical to eager
    assert rewrites("index_upsample") == 1 and _GATHER not in _ops(c, [x])


def test_returned_upsampling(no_grad):
    """The upsampled tensor itself is the graph's output."""
    x = torch.randn(1, 3, 4, 6)
    fxbackend.reset_stats()
    c = capture(lambda t: F.interpolate(t, scale_factor=2, mode="nearest"), x)
    assert rewrites("index_upsample") == 1 and c.out.is_contiguous()


def test_other_gathers_are_left_alone(no_grad):
    """Constant indices that are not an upsampling (rows reversed): declined, with the
    reason."""
    def fn(x):
        rows = torch.arange(2 * x.shape[2], device=x.device).flip(0)[:, None] // 2
        cols = torch.arange(2 * x.shape[3], device=x.device) // 2
        return torch.ops.aten._unsafe_index.Tensor(x, [None, None, rows, cols]) * 2

    x = torch.randn(1, 2, 3, 4)
    fxbackend.reset_stats()
    c = capture(fn, x)
    assert rewrites("index_upsample") == 0 and _GATHER in _ops(c, [x])
    assert "not a nearest-neighbour upsampling" in c.graph.plan_for([x]).report()


def test_indices_that_read_an_input_are_left_alone(no_grad):
    def fn(x, rows):
        cols = torch.arange(2 * x.shape[3], device=x.device) // 2
        return torch.ops.aten._unsafe_index.Tensor(x, [None, None, rows[:, None], cols])

    x, rows = torch.randn(1, 2, 3, 4), torch.tensor([0, 0, 1, 1, 2, 2])
    fxbackend.reset_stats()
    c = capture(fn, x, rows)
    assert rewrites("index_upsample") == 0
    assert "the indices read an input" in c.graph.plan_for([x, rows]).report()


def test_channels_last_input(no_grad):
    """ATen's decomposition gathers a channels-last input into an NCHW result (then copies it
    to channels-last): the copies read x through its strides."""
    x = torch.randn(1, 4, 5, 6).to(memory_format=torch.channels_last)
    fxbackend.reset_stats()
    c = capture(lambda t: F.interpolate(t, scale_factor=2, mode="nearest") * 3, x)
    assert rewrites("index_upsample") == 1 and _GATHER not in _ops(c, [x])


def _gather_graph(result_stride, device="cpu", x_stride=(24, 12, 4, 1)):
    """A hand-built graph: ``_unsafe_index(x, [None, None, rows, cols])`` of a 1x2x3x4 input
    by constant 2x upsampling indices, with the input's and the result's strides given."""
    from fxbackend.ir import Graph, TensorMeta
    g = Graph()
    xm = TensorMeta((1, 2, 3, 4), x_stride, torch.float32, torch.device(device), 0)
    x = g.append(g.new_node("input", meta=xm, is_input=True))
    idx = []
    for value in (torch.arange(6)[:, None] // 2, torch.arange(8) // 2):
        c = g.append(g.new_node("constant", meta=TensorMeta.of(value), is_weight=True))
        c.annotations["value"] = value
        idx.append(c)
    meta = TensorMeta((1, 2, 6, 8), result_stride, torch.float32, torch.device(device), 0)
    n = g.append(g.new_node(_GATHER, [x, *idx], {}, meta,
                            target=torch.ops.aten._unsafe_index.Tensor,
                            tensor_layout=(("self", True), ("indices", (False, False, True,
                                                                         True)))))
    n.is_output = True
    g.outputs = [n]
    return g


_NCHW, _NHWC = (24, 12, 4, 1), (24, 1, 8, 2)


@pytest.mark.parametrize("x_stride,stride,fires", [
    (_NCHW, (96, 48, 8, 1), True), (_NCHW, (96, 1, 16, 2), False),
    (_NHWC, (96, 48, 8, 1), True), (_NHWC, (96, 1, 16, 2), True)])
def test_result_layout(x_stride, stride, fires):
    """A contiguous result is written by the NCHW copies (from x of any layout); a
    channels-last result of a channels-last x by one NHWC copy; a channels-last result of an
    NCHW x is declined."""
    from fxbackend.patterns.upsample import IndexUpsample
    from fxbackend.rewrite import RewriteContext
    g = _gather_graph(stride, x_stride=x_stride)
    want = g.outputs[0].meta
    ctx = RewriteContext(options=None, rule="index_upsample")
    assert IndexUpsample().rewrite(g, ctx) == int(fires)
    out = g.outputs[0]
    assert (out.op == _GATHER) != fires
    if not fires:
        assert ctx.declined and "neither contiguous" in ctx.declined[0][2]
        return
    assert out.meta.shape == (1, 2, 6, 8) and out.meta.stride == want.stride
    assert out.op == ("aten.view.default" if stride == (96, 48, 8, 1) else
                      "aten.permute.default")
    # values: run the rewritten graph's nodes with torch on a real x
    x = torch.randn(1, 3, 4, 2).permute(0, 3, 1, 2) if x_stride == _NHWC \
        else torch.randn(1, 2, 3, 4)
    vals = {g.nodes[0]: x}
    for n in g.nodes[1:]:
        if n.op == "constant":
            vals[n] = n.annotations["value"]
        else:
            from fxbackend.native import call_args
            a, kw = call_args(n, vals.__getitem__, lambda v: v)
            vals[n] = n.target(*a, **kw)
    assert torch.equal(vals[out], F.interpolate(x, scale_factor=2, mode="nearest"))
    assert tuple(vals[out].stride()) == tuple(want.stride)
    assert sum(n.op == "aten.clone.default" for n in g.nodes) == \
        (1 if x_stride == _NHWC and stride != (96, 48, 8, 1) else 2)


def test_other_devices_are_left_alone():
    """The rule is the CPU's: a gather on another device stays (no decline either)."""
    from fxbackend.patterns.upsample import IndexUpsample
    from fxbackend.rewrite import RewriteContext
    g = _gather_graph((96, 48, 8, 1), device="cuda")
    ctx = RewriteContext(options=None, rule="index_upsample")
    assert IndexUpsample().rewrite(g, ctx) == 0 and g.outputs[0].op == _GATHER
    assert not ctx.declined


def test_unet_upsampler(no_grad):
    got, want = tiny_model_outputs("unet")
    assert rewrites("index_upsample") == 1  # the tiny UNet's one up block with an upsampler
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_constant_value():
    from fxbackend.ir import Graph, TensorMeta
    g = Graph()
    value = torch.arange(6, dtype=torch.float32)
    c = g.append(g.new_node("constant", meta=TensorMeta.of(value), is_weight=True))
    c.annotations["value"] = value
    x = g.append(g.new_node("input", meta=TensorMeta.of(value), is_input=True))
    op = torch.ops.aten.mul.Tensor
    layout = (("self", True), ("other", True))
    sq = g.append(g.new_node("aten.mul.Tensor", [c, c], {}, TensorMeta.of(value), target=op,
                             tensor_layout=layout))
    mixed = g.append(g.new_node("aten.mul.Tensor", [sq, x], {}, TensorMeta.of(value),
                                target=op, tensor_layout=layout))
    cache: dict = {}
    assert torch.equal(constant_value(sq, cache), value * value)
    assert sq in cache and constant_value(c) is value
    assert constant_value(mixed, cache) is None and constant_value(x) is None
    assert len(g.nodes) == 4  # the graph is not changed


def test_disable_rewrites_option(no_grad, monkeypatch):
    """``disable_rewrites`` (or FXB_DISABLE_REWRITES) keeps the named rules from running; a
    name no rule has is an error naming it."""
    def fn(x):
        return F.interpolate(x, scale_factor=2, mode="nearest") - 1

    x = torch.randn(1, 2, 3, 4)
    fxbackend.reset_stats()
    c = capture(fn, x, options={"disable_rewrites": "index_upsample"})
    assert rewrites("index_upsample") == 0 and _GATHER in _ops(c, [x])
    monkeypatch.setenv("FXB_DISABLE_REWRITES", "identity_arith, index_upsample")
    assert fxbackend.parse_options().disable_rewrites == ("identity_arith", "index_upsample")
    monkeypatch.delenv("FXB_DISABLE_REWRITES")
    with pytest.raises(Exception, match="no registered rewrite rule.*index_upsampel"):
        capture(fn, x, options={"disable_rewrites": ["index_upsampel"]})
    with pytest.raises(ValueError, match="disable_rewrites"):
        fxbackend.parse_options({"disable_rewrites": 1})
