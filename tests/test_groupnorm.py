"""GroupNorm -> SiLU: the rule ``group_norm_silu`` (patterns/groupnorm.py), its numba kernel
(cpu_kernels/groupnorm.py) and Triton kernel (cuda_kernels/groupnorm.py, in the interpreter on
the CPU and, marked ``cuda``, on a GPU), whole graphs fused vs unfused vs eager, and the four
test models' fire counts.  GroupNorm alone: the op ``sd.group_norm.v1``, its rewrite rule
``group_norm`` (fires, declines), and the same kernels registered for the op, against the op's
reference on hand-built graphs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxbackend
import fxbackend.cpu_kernels.groupnorm  # noqa: F401  (registers the "cpu" rule)
import fxbackend.cuda_kernels.groupnorm  # noqa: F401  (registers the "cuda" rule)
from fxbackend import Graph, TensorMeta, models
from fxbackend.cpu_kernels.groupnorm import (GroupNormChannelsLastCPU, GroupNormCPU,
                                             group_norm_silu_cpu, why_not)
from fxbackend.patterns.groupnorm import (GROUP_NORM_CL_OP, GROUP_NORM_OP, GroupNormSiluFusion,
                                          ReferenceGroupNormSilu, group_norm_silu_reference,
                                          memory_format_of)

from _rope_interp_check import check_result, run_checker
from ext_util import compiled, eager_and_compiled, rel_err, rule_on_top, set_outputs

EPS = 1e-5
# (x dtype, weight dtype, atol, rtol): float32 to ~1e-6 relative; 16-bit within one rounding
DTYPES = [
    (torch.float32, torch.float32, 2e-6, 1e-6),
    (torch.bfloat16, torch.bfloat16, 1e-2, 2 ** -7),
    (torch.bfloat16, torch.float32, 1e-2, 2 ** -7),
    (torch.float16, torch.float16, 2e-3, 2 ** -10),
]
# (shape, groups): odd sizes, 3-D and 5-D, HxW = 1, one channel per group, one group
SHAPES = [((2, 12, 5, 7), 4), ((1, 6, 37), 3), ((3, 10, 1, 1), 5), ((2, 64, 9, 9), 32),
          ((1, 8, 3, 4, 5), 1)]


def _inputs(shape, groups, xdt, wdt, layout, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(xdt)
    if layout == "nhwc":
        x = x.to(memory_format=torch.channels_last if x.dim() == 4 else
                 torch.channels_last_3d if x.dim() == 5 else torch.contiguous_format)
    c = shape[1]
    w = (torch.randn(c, generator=g) * 0.2 + 1).to(wdt)
    b = (torch.randn(c, generator=g) * 0.2).to(wdt)
    return x, w, b


# -- the numba kernel -----------------------------------------------------------------------------

@pytest.mark.parametrize("xdt,wdt,atol,rtol", DTYPES)
@pytest.mark.parametrize("shape,groups", SHAPES)
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("silu", [True, False])
def test_cpu_kernel_matches_reference(xdt, wdt, atol, rtol, shape, groups, layout, silu):
    x, w, b = _inputs(shape, groups, xdt, wdt, layout)
    want = group_norm_silu_reference(x, w, b, groups, EPS, silu)
    out = torch.full_like(want, float("nan"))
    x_before = x.clone()
    assert group_norm_silu_cpu(x, w, b, out, groups=groups, eps=EPS, silu=silu) is out
    assert torch.equal(x, x_before)
    assert out.stride() == want.stride()
    _assert_matches(out, want, x, w, b, groups, silu, atol, rtol)


def _assert_matches(out, want, x, w, b, groups, silu, atol, rtol):
    if x.dtype != torch.float32:
        torch.testing.assert_close(out, want, atol=atol, rtol=rtol)
        return
    # float32: ~1e-6 relative to the largest value, or at least as close to the float64 truth as
    # torch is (torch's channels-last path has its own cancellation: 2e-5 off its contiguous
    # path on 2-element groups)
    truth = group_norm_silu_reference(x.double(), w.double(), b.double(), groups, EPS, silu)
    scale = want.abs().max().item()
    rel = ((out - want).abs().max() / scale).item()
    ours = (out.double() - truth).abs().max().item() / scale
    torch_err = (want.double() - truth).abs().max().item() / scale
    assert rel <= 1e-6 or ours <= torch_err + 1e-6, (rel, ours, torch_err)


def test_cpu_kernel_large_mean_and_extremes():
    # |mean| >> spread (the shifted sums keep the variance), and SiLU's exp overflow/underflow
    g = torch.Generator().manual_seed(1)
    x = 1000 + 1e-2 * torch.randn(2, 8, 6, 6, generator=g)
    w, b = torch.ones(8), torch.zeros(8)
    want = group_norm_silu_reference(x, w, b, 2, EPS)
    out = group_norm_silu_cpu(x, w, b, torch.empty_like(x), groups=2, eps=EPS)
    # one float32 ulp of the mean (6e-5) moves the output by ~6e-3 here, in torch as in the
    # kernel: compare both with the float64 truth
    truth = group_norm_silu_reference(x.double(), w.double(), b.double(), 2, EPS)
    ours = (out.double() - truth).abs().max().item()
    theirs = (want.double() - truth).abs().max().item()
    assert ours <= 1.5 * theirs, (ours, theirs)
    y = torch.tensor([-200.0, -100.0, -88.5, -87.0, -20.0, -1e-3, 0.0, 1e-30, 3.0, 50.0, 120.0])
    x = y.reshape(1, 1, -1)
    w, b = torch.ones(1), torch.zeros(1)
    want = group_norm_silu_reference(x, w, b, 1, EPS)
    out = group_norm_silu_cpu(x, w, b, torch.empty_like(x), groups=1, eps=EPS)
    torch.testing.assert_close(out, want, atol=1e-30, rtol=1e-6)


@pytest.mark.parametrize("case,why", [
    ("strided", "neither dense NCHW nor channels-last"),
    ("out_layout", "differs from x's"),
    ("float64", "x dtype torch.float64"),
    ("groups", "does not divide"),
    ("weight_dtype", "weight dtype torch.float16"),
])
def test_cpu_why_not(case, why):
    x, w, b = _inputs((2, 8, 4, 6), 4, torch.float32, torch.float32, "nchw")
    groups, out = 4, torch.empty_like(x)
    if case == "strided":
        x = x[..., ::2]
        out = torch.empty_like(x)
    elif case == "out_layout":
        out = out.to(memory_format=torch.channels_last)
    elif case == "float64":
        x, out = x.double(), out.double()
    elif case == "groups":
        groups = 3
    elif case == "weight_dtype":
        w = w.half()
    metas = [TensorMeta.of(t) for t in (x, w, b, out)]
    assert why in why_not(*metas, groups, EPS)
    with pytest.raises(ValueError, match="unsupported input"):
        group_norm_silu_cpu(x, w, b, out, groups=groups, eps=EPS)


def test_memory_format_of():
    x = torch.empty(2, 8, 4, 6)
    assert memory_format_of(x.shape, x.stride()) == "nchw"
    cl = x.to(memory_format=torch.channels_last)
    assert memory_format_of(cl.shape, cl.stride()) == "nhwc"
    assert memory_format_of(x[:, :, ::2].shape, x[:, :, ::2].stride()) is None
    one = torch.empty(1, 8, 1, 1).to(memory_format=torch.channels_last)
    assert memory_format_of(one.shape, one.stride()) == "nchw"



def test_launcher_layout_agrees_with_memory_format_of():
    # the CPU launcher asks torch's contiguity flags first; every answer must be
    # memory_format_of's, including size-1 dims with arbitrary strides and 3-D / 5-D tensors
    from hypothesis import given, settings, strategies as st

    from fxbackend.cpu_kernels.groupnorm import _layout

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.integers(1, 4), min_size=2, max_size=5), st.data())
    def check(shape, data):
        perm = data.draw(st.permutations(range(len(shape))))
        base = torch.empty([shape[i] for i in perm]).permute(
            *sorted(range(len(perm)), key=perm.__getitem__))
        assert tuple(base.shape) == tuple(shape)
        if data.draw(st.booleans()):  # now and then, a non-dense view
            d = data.draw(st.integers(0, len(shape) - 1))
            base = torch.empty([*shape[:d], 2 * shape[d], *shape[d + 1:]]).narrow(
                d, 0, 2 * shape[d])[(slice(None),) * d + (slice(None, None, 2),)]
        assert _layout(base) == memory_format_of(base.shape, base.stride())

    check()

# -- the Triton kernel in the interpreter ---------------------------------------------------------

_INTERP_CASES = [
    {"id": f"{shape}-{g}-{layout}-{x}-{w}-{silu}", "shape": list(shape), "groups": g,
     "layout": layout, "x": x, "w": w, "silu": silu, "atol": atol, "rtol": rtol}
    for shape, g in [((2, 8, 5, 3), 4), ((1, 6, 37), 3), ((2, 12, 4, 7), 4)]
    for layout in (["nchw", "nhwc"] if len(shape) == 4 else ["nchw"])
    for x, w, atol, rtol in [("float32", "float32", 2e-6, 1e-6), ("bfloat16", "float32", 1e-2,
                                                                  2 ** -7),
                             ("float16", "float16", 2e-3, 2 ** -10)]
    for silu in (True, False)
] + [
    # GroupNormCUDA, the kernel of sd.group_norm.v1 (contiguous output; channels-last declined)
    {"id": f"op-{shape}-{g}-{layout}-{x}-{w}", "shape": list(shape), "groups": g,
     "layout": layout, "x": x, "w": w, "silu": False, "atol": atol, "rtol": rtol, "op": True}
    for shape, g in [((2, 8, 5, 3), 4), ((1, 6, 37), 3)]
    for layout in (["nchw", "nhwc"] if len(shape) == 4 else ["nchw"])
    for x, w, atol, rtol in [("float32", "float32", 2e-6, 1e-6), ("bfloat16", "float32", 1e-2,
                                                                  2 ** -7),
                             ("float16", "float16", 2e-3, 2 ** -10)]
]


@pytest.fixture(scope="module")
def interp_results():
    return run_checker("_groupnorm_interp_check.py", _INTERP_CASES)


@pytest.mark.parametrize("case", _INTERP_CASES, ids=[c["id"] for c in _INTERP_CASES])
def test_triton_kernel_in_interpreter(interp_results, case):
    check_result(interp_results, case)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(2, 320, 64, 64), (2, 640, 32, 32), (2, 1280, 16, 16)])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("xdt,wdt,atol,rtol", DTYPES)
def test_triton_kernel_sd15_sizes(shape, layout, xdt, wdt, atol, rtol):
    from fxbackend.cuda_kernels.groupnorm import group_norm_silu_triton
    x, w, b = (t.cuda() for t in _inputs(shape, 32, xdt, wdt, layout))
    want = group_norm_silu_reference(x, w, b, 32, EPS)
    out = group_norm_silu_triton(x, w, b, torch.empty_like(want), groups=32, eps=EPS)
    torch.testing.assert_close(out, want, atol=atol * 4, rtol=rtol)


# -- the rule on whole graphs ---------------------------------------------------------------------

class _Resnet(torch.nn.Module):
    """ResnetBlock2D's norm -> silu [-> dropout] -> conv, then a GroupNorm alone -> conv."""

    def __init__(self, c=16, groups=4, dropout=True):
        super().__init__()
        torch.manual_seed(0)
        self.norm1 = torch.nn.GroupNorm(groups, c, eps=1e-5)
        self.norm2 = torch.nn.GroupNorm(groups, c, eps=1e-6)
        self.norm3 = torch.nn.GroupNorm(groups, c, eps=1e-6)
        for n in (self.norm1, self.norm2, self.norm3):
            n.weight.data = torch.rand(c) + 0.5
            n.bias.data = torch.randn(c) * 0.1
        self.conv1 = torch.nn.Conv2d(c, c, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(c, c, 1)
        self.drop = torch.nn.Dropout(0.1) if dropout else torch.nn.Identity()

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.drop(F.silu(self.norm2(h)))
        return self.conv2(self.norm3(h + x))


@pytest.fixture
def gn_rewrite_on_cpu(monkeypatch):
    """The registered ``group_norm`` rewrite, made to run on the CPU too (by default it leaves
    the CPU's group norms native: see ``GroupNormIdiom``)."""
    rule = next(r for r in fxbackend.rewrites() if r.name == "group_norm")
    monkeypatch.setattr(rule, "devices", ("cpu", "cuda"))
    yield rule


@pytest.fixture
def ref_rule():
    """The rule with the torch implementation, above the numba one."""
    with rule_on_top(GroupNormSiluFusion(ReferenceGroupNormSilu()), "group_norm_silu_test") as r:
        yield r


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("use_ref", [False, True])
def test_fused_equals_unfused_and_eager(layout, use_ref, request, gn_rewrite_on_cpu):
    if use_ref:
        request.getfixturevalue("ref_rule")
    name = "group_norm_silu_test" if use_ref else "group_norm_silu"
    mod = _Resnet().eval()
    x = torch.randn(2, 16, 9, 7)
    if layout == "nhwc":
        mod = mod.to(memory_format=torch.channels_last)
        x = x.to(memory_format=torch.channels_last)
    with torch.no_grad():
        ref = mod(x)
        fused = torch.compile(mod, backend="fxbackend")(x)
        s = fxbackend.stats()
        torch._dynamo.reset()
        unfused = torch.compile(mod, backend="fxbackend", options={"fusion": False})(x)
    # two GN -> SiLU chains (the second with eval dropout's clone); norm3 alone becomes
    # sd.group_norm.v1 on the numba kernel where its output is contiguous (NCHW); channels-last
    # it stays native (the op's output is contiguous)
    assert s["fusions_by_rule"] == {name: 2}
    if layout == "nchw":
        assert s["rewrites_by_rule"] == {"group_norm": 1}
        assert s["steps_by_kernel"]["group_norm_cpu"] == 1
    else:
        assert s["rewrites_by_rule"] == {}
        assert "group_norm_cpu" not in s["steps_by_kernel"]
    torch.testing.assert_close(fused, unfused, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused, ref, atol=1e-5, rtol=1e-5)
    if use_ref:
        assert torch.equal(fused, unfused)  # the reference is exactly the unfused chain


def test_chain_with_dropout_clone_is_one_step_and_groupnorm_alone_is_the_op(ref_rule,
                                                                          gn_rewrite_on_cpu):
    text = fxbackend.explain(_Resnet().eval(), torch.randn(1, 16, 4, 4))
    fired = [ln for ln in text.splitlines() if ln.startswith("fused group_norm_silu_test")]
    # gn, getitem, silu: the dropout's clone of the SiLU result is elided before fusion
    assert len(fired) == 2 and len(fired[1].split(",")) == 3, fired
    assert "0 concatenation(s) of slices, 1 clone(s)" in text
    ops = [ln for ln in text.splitlines() if GROUP_NORM_OP in ln]
    assert len(ops) == 1 and "{groups=4, eps=1e-06}" in ops[0] and "[group_norm_cpu]" in ops[0]
    assert "GroupNorm without SiLU" not in text
    # channels-last: the native output is channels-last, the op's contiguous: left, declined
    cl = torch.channels_last
    text = fxbackend.explain(_Resnet().eval().to(memory_format=cl),
                             torch.randn(1, 16, 4, 4).to(memory_format=cl))
    assert f"= {GROUP_NORM_OP}(" not in text and "GroupNorm without SiLU, not rewritten" in text


class _StatsRead(torch.nn.Module):
    """native_group_norm whose mean is also returned: the claim would drop a read output."""

    def forward(self, x, w, b):
        y, mean, _ = torch.ops.aten.native_group_norm(x, w, b, 2, 8, 12, 4, EPS)
        return F.silu(y), mean


def test_mean_read_outside_is_not_claimed(ref_rule):
    x, w, b = _inputs((2, 8, 3, 4), 4, torch.float32, torch.float32, "nchw")
    with torch.no_grad():
        out, mean = torch.compile(_StatsRead(), backend="fxbackend")(x, w, b)
    want, want_mean = _StatsRead()(x, w, b)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(mean, want_mean)
    assert "group_norm_silu_test" not in fxbackend.stats()["fusions_by_rule"]


def test_declined_layout_is_reported(ref_rule):
    class Strided(torch.nn.Module):
        def forward(self, x, w, b):
            return F.silu(F.group_norm(x[..., ::2], 4, w, b, EPS))

    ref_rule.impl = type("Declining", (ReferenceGroupNormSilu,),
                         {"why_not": lambda self, *a: why_not(*a)})()
    x, w, b = _inputs((2, 8, 4, 6), 4, torch.float32, torch.float32, "nchw")
    text = fxbackend.explain(Strided(), x, w, b)
    # Dynamo/aot may copy the slice before the norm; either it fires, or it declines by layout
    assert "fused group_norm_silu_test" in text or "neither dense NCHW" in text


# -- GroupNorm alone: the op sd.group_norm.v1 and the rewrite rule group_norm ---------------------

def _input(g, t: torch.Tensor):
    """An input node with ``t``'s exact metadata (strides included)."""
    return g.append(g.new_node("input", meta=TensorMeta.of(t), is_input=True))


def _run_op(x, w, b, groups):
    """One ``sd.group_norm.v1`` node on inputs with exactly these layouts; (result, steps)."""
    g = Graph()
    set_outputs(g, fxbackend.op_create(g, GROUP_NORM_OP, [_input(g, t) for t in (x, w, b)],
                                       {"groups": groups, "eps": EPS}))
    fxbackend.reset_stats()
    (out,) = compiled(g)(x, w, b)
    return out, dict(fxbackend.stats()["steps_by_kernel"])


@pytest.mark.parametrize("xdt,wdt,atol,rtol", DTYPES)
@pytest.mark.parametrize("shape,groups", SHAPES)
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_op_kernel_matches_reference(xdt, wdt, atol, rtol, shape, groups, layout):
    """The numba kernel as the kernel of sd.group_norm.v1 (dense NCHW x); channels-last x is
    declined (the op's output is contiguous) and runs the op's reference, exactly."""
    x, w, b = _inputs(shape, groups, xdt, wdt, layout)
    want = group_norm_silu_reference(x, w, b, groups, EPS, silu=False).contiguous()
    out, steps = _run_op(x, w, b, groups)
    assert out.is_contiguous() and out.dtype == xdt
    if memory_format_of(x.shape, x.stride()) == "nchw":  # also 1x1 spatial "channels-last"
        assert steps == {"group_norm_cpu": 1}
        _assert_matches(out, want, x, w, b, groups, False, atol, rtol)
    else:
        assert steps == {"native": 1}
        assert torch.equal(out, want)


@pytest.mark.cuda
@pytest.mark.parametrize("xdt,wdt,atol,rtol", DTYPES)
def test_op_triton_kernel_sd15_size(xdt, wdt, atol, rtol):
    x, w, b = (t.cuda() for t in _inputs((2, 320, 64, 64), 32, xdt, wdt, "nchw"))
    want = group_norm_silu_reference(x, w, b, 32, EPS, silu=False)
    out, steps = _run_op(x, w, b, 32)
    assert steps == {"group_norm_triton": 1}
    torch.testing.assert_close(out, want, atol=atol * 4, rtol=rtol)


def test_op_meta_and_errors():
    g = Graph()
    x, w, b = (_input(g, t) for t in _inputs((2, 8, 3, 4), 4, torch.bfloat16, torch.float32,
                                               "nhwc"))
    node = fxbackend.op_create(g, GROUP_NORM_OP, [x, w, b], {"groups": 4, "eps": 1e-5})
    assert (node.meta.shape, node.meta.stride, node.meta.dtype) == \
        ((2, 8, 3, 4), (96, 12, 4, 1), torch.bfloat16)
    with pytest.raises(ValueError, match="does not divide C=8"):
        fxbackend.op_create(g, GROUP_NORM_OP, [x, w, b], {"groups": 3, "eps": 1e-5})
    with pytest.raises(ValueError, match=r"takes \(x, weight, bias\)"):
        fxbackend.op_create(g, GROUP_NORM_OP, [x, w], {"groups": 4, "eps": 1e-5})
    with pytest.raises(ValueError, match=r"weight must be a floating \[8\] vector"):
        fxbackend.op_create(g, GROUP_NORM_OP, [x, x, b], {"groups": 4, "eps": 1e-5})


def test_op_kernel_supports_never_raises():
    k = GroupNormCPU()
    g = Graph()
    x, w, b = (_input(g, t) for t in _inputs((2, 8, 3, 4), 4, torch.float32, torch.float32,
                                               "nchw"))
    node = fxbackend.op_create(g, GROUP_NORM_OP, [x, w, b], {"groups": 4, "eps": 1e-5})
    assert k.supports(node) is True
    for broken in ({}, {"groups": 4, "eps": None}, {"groups": 3, "eps": 1e-5},
                   {"groups": 4, "eps": float("nan")}):
        node.params = broken
        assert k.supports(node) is False
    node.params = {"groups": 4, "eps": 1e-5}
    for srcs in ([x, w], [object(), object(), object()], []):
        node.srcs = srcs
        assert k.supports(node) is False


class _GroupNormAlone(torch.nn.Module):
    """GroupNorm alone, then a conv (a transformer block's norm -> proj_in)."""

    def __init__(self, c=16, groups=4, affine=True):
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.GroupNorm(groups, c, eps=1e-6, affine=affine)
        if affine:
            self.norm.weight.data = torch.rand(c) + 0.5
            self.norm.bias.data = torch.randn(c) * 0.1
        self.proj_in = torch.nn.Conv2d(c, c, 1)

    def forward(self, x):
        return self.proj_in(self.norm(x))


def _compile_run(mod, *inputs):
    fxbackend.reset_stats()
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(mod, backend="fxbackend")(*inputs)
        ref = mod(*inputs)
    return out, ref, fxbackend.stats()


def test_groupnorm_alone_is_rewritten_and_runs_the_kernel(gn_rewrite_on_cpu):
    out, ref, s = _compile_run(_GroupNormAlone().eval(), torch.randn(2, 16, 9, 7))
    assert s["rewrites_by_rule"] == {"group_norm": 1}
    assert s["steps_by_kernel"]["group_norm_cpu"] == 1
    assert s["fusions_by_rule"] == {}
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_groupnorm_alone_stays_native_on_the_cpu_by_default():
    # the CPU kernel is level with native_group_norm, so the rule leaves the CPU alone: the
    # step is ATen's own, eager's bits
    assert next(r for r in fxbackend.rewrites() if r.name == "group_norm").devices == ("cuda",)
    out, ref, s = _compile_run(_GroupNormAlone().eval(), torch.randn(2, 16, 9, 7))
    assert "group_norm" not in s["rewrites_by_rule"]
    assert "group_norm_cpu" not in s["steps_by_kernel"]
    assert torch.equal(out, ref)


def test_rewrite_devices_must_be_a_tuple_of_names():
    from fxbackend.patterns.groupnorm import GroupNormIdiom

    assert GroupNormIdiom(devices=("cpu", "cuda")).devices == ("cpu", "cuda")
    for bad in ("cuda", (torch.device("cuda"),)):
        with pytest.raises(TypeError, match="devices must be a tuple of device type names"):
            GroupNormIdiom(devices=bad)


@pytest.mark.parametrize("case", ["mean_read", "silu_follows", "channels_last", "no_affine"])
def test_rewrite_declines(case, gn_rewrite_on_cpu):
    """Left native: mean/rstd read; a SiLU follows (the fusion rule's chain); a channels-last
    output (the op's is contiguous); no affine weight and bias (the op needs both)."""
    x, w, b = _inputs((2, 8, 3, 4), 4, torch.float32, torch.float32, "nchw")
    if case == "mean_read":
        def fn(x, w, b):
            y, mean, _ = torch.ops.aten.native_group_norm(x, w, b, 2, 8, 12, 4, EPS)
            return y * 2, mean
        mod, inputs = fn, (x, w, b)
    elif case == "silu_follows":
        mod, inputs = (lambda x, w, b: F.silu(F.group_norm(x, 4, w, b, EPS))), (x, w, b)
    elif case == "channels_last":
        mod = _GroupNormAlone(c=8).eval().to(memory_format=torch.channels_last)
        inputs = (x.to(memory_format=torch.channels_last),)
    else:
        mod, inputs = _GroupNormAlone(c=8, affine=False).eval(), (x,)
    out, ref, s = _compile_run(mod, *inputs)
    assert "group_norm" not in s["rewrites_by_rule"]
    assert "group_norm_cpu" not in s["steps_by_kernel"]
    assert s["fusions_by_rule"] == ({"group_norm_silu": 1} if case == "silu_follows" else {})
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# -- the four test models -------------------------------------------------------------------------

def _unet_chains(cfg) -> int:
    """GroupNorm -> SiLU chains of a UNet2DConditionModel: two per ResnetBlock2D (norm1, norm2)
    plus conv_norm_out -> conv_act.  Resnets: layers_per_block per down block, two in the
    UNetMidBlock2DCrossAttn (one before, one after its single transformer), layers_per_block + 1
    per up block."""
    n_down = len(cfg["down_block_types"])
    n_up = len(cfg["up_block_types"])
    resnets = cfg["layers_per_block"] * n_down + 2 + (cfg["layers_per_block"] + 1) * n_up
    return 2 * resnets + 1


def _unet_transformers(cfg) -> int:
    """Transformer2DModels (one GroupNorm alone each, before ``proj_in``) of a
    UNet2DConditionModel: layers_per_block per CrossAttn down block, one in the
    UNetMidBlock2DCrossAttn, layers_per_block + 1 per CrossAttn up block."""
    down = sum(t.startswith("CrossAttn") for t in cfg["down_block_types"])
    up = sum(t.startswith("CrossAttn") for t in cfg["up_block_types"])
    mid = cfg.get("mid_block_type") == "UNetMidBlock2DCrossAttn"
    return cfg["layers_per_block"] * down + int(mid) + (cfg["layers_per_block"] + 1) * up


@pytest.mark.parametrize("on_cpu", [False, True])
@pytest.mark.parametrize("family", ["unet", "flux", "sd3", "pixart"])
def test_models_fire_count_and_match_eager(family, on_cpu, request):
    if on_cpu:
        if family != "unet":
            pytest.skip("no GroupNorm alone in the transformer models")
        request.getfixturevalue("gn_rewrite_on_cpu")
    ref, out, _ = eager_and_compiled(family)
    assert rel_err(out, ref) <= 1e-5
    s = fxbackend.stats()
    fired = s["fusions_by_rule"].get("group_norm_silu", 0)
    # the transformer models have no GroupNorm (LayerNorm / RMSNorm only); the tiny UNet
    # (1 layer per block, 2 down + 2 up blocks) has 8 resnets -> 16 chains, + conv_norm_out = 17;
    # its 4 Transformer2DModel GroupNorms (no SiLU) stay native on the CPU, or become
    # sd.group_norm.v1 on the numba kernel with the rewrite on for the CPU
    cfg = models.MODEL_CONFIGS[(family, "tiny")]["config"]
    want = _unet_chains(cfg) if family == "unet" else 0
    alone = _unet_transformers(cfg) if family == "unet" else 0
    rewritten = alone if on_cpu else 0
    assert fired == want
    assert s["rewrites_by_rule"].get("group_norm", 0) == rewritten
    assert s["steps_by_kernel"].get("group_norm_cpu", 0) == rewritten * s["calls"]
    assert s["steps_by_kernel"].get("group_norm_silu", 0) == want * s["calls"]
    if family == "unet":
        assert (want, alone) == (17, 4)


# -- GroupNorm alone of a channels-last image: sd.group_norm_channels_last.v1 --------------------

def _run_cl_op(x_last, w, b, groups):
    """One ``sd.group_norm_channels_last.v1`` node on ``x_last`` (``[N, *spatial, C]``)."""
    g = Graph()
    set_outputs(g, fxbackend.op_create(g, GROUP_NORM_CL_OP,
                                       [_input(g, t) for t in (x_last, w, b)],
                                       {"groups": groups, "eps": EPS}))
    fxbackend.reset_stats()
    (out,) = compiled(g)(x_last, w, b)
    return out, dict(fxbackend.stats()["steps_by_kernel"])


@pytest.mark.parametrize("xdt,wdt,atol,rtol", DTYPES)
@pytest.mark.parametrize("shape,groups", [s for s in SHAPES if len(s[0]) >= 4])
@pytest.mark.parametrize("dense", [True, False])
def test_channels_last_op_kernel_matches_reference(xdt, wdt, atol, rtol, shape, groups, dense):
    """The numba channels-last kernel runs the op for a contiguous ``[N, *spatial, C]`` x
    (a channels-last image permuted); other strides run the op's reference, exactly."""
    x, w, b = _inputs(shape, groups, xdt, wdt, "nhwc" if dense else "nchw")
    x_last = x.permute(0, *range(2, x.dim()), 1)
    want = group_norm_silu_reference(x, w, b, groups, EPS, silu=False).permute(
        0, *range(2, x.dim()), 1)
    out, steps = _run_cl_op(x_last, w, b, groups)
    assert out.is_contiguous() and out.dtype == xdt and out.shape == x_last.shape
    if x_last.is_contiguous():
        assert steps == {"group_norm_channels_last_cpu": 1}
        _assert_matches(out.movedim(-1, 1), want.movedim(-1, 1), x, w, b, groups, False, atol,
                        rtol)
    else:
        assert steps == {"native": 1}
        assert torch.equal(out, want)


def test_channels_last_op_meta_and_errors():
    g = Graph()
    x, w, b = (_input(g, t) for t in (torch.ones(2, 3, 4, 8, dtype=torch.bfloat16),
                                       torch.ones(8), torch.zeros(8)))  # [N, H, W, C=8]
    node = fxbackend.op_create(g, GROUP_NORM_CL_OP, [x, w, b], {"groups": 4, "eps": 1e-5})
    assert (node.meta.shape, node.meta.stride) == ((2, 3, 4, 8), (96, 32, 8, 1))
    with pytest.raises(ValueError, match="does not divide C=8"):
        fxbackend.op_create(g, GROUP_NORM_CL_OP, [x, w, b], {"groups": 3, "eps": 1e-5})
    with pytest.raises(ValueError, match=r"x must be \[N, \.\.\., C\]"):
        fxbackend.op_create(g, GROUP_NORM_CL_OP, [_input(g, torch.ones(8)), w, b],
                            {"groups": 4, "eps": 1e-5})
    k = GroupNormChannelsLastCPU()
    assert k.supports(node) is True
    for broken in ({}, {"groups": 3, "eps": 1e-5}, {"groups": 4, "eps": float("nan")}):
        node.params = broken
        assert k.supports(node) is False


def _conv_norm_conv(x, w, gw, gb, w1):
    """A transformer block's input in a 16-bit UNet: convolution, GroupNorm (no SiLU), 1x1
    projection."""
    y = F.conv2d(x, w, padding=1)
    return F.conv2d(F.group_norm(y, 4, gw, gb, EPS), w1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_channels_last_group_norm_alone_runs_the_kernel(no_grad, dtype):
    from conftest import capture, rewrites
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(*s, generator=g).to(dtype)
            for s in ((1, 4, 6, 6), (16, 4, 3, 3), (16,), (16,), (8, 16, 1, 1))]
    fxbackend.reset_stats()
    c = capture(_conv_norm_conv, *args, exact=False, rtol=2e-2, atol=2e-2)
    assert rewrites("channels_last_convs") == 2 and rewrites("group_norm_channels_last") == 1
    assert fxbackend.stats()["steps_by_kernel"]["group_norm_channels_last_cpu"] == 1
    plan = c.graph.plan_for(args)
    # views around the op, no copy: the convolution's result is read as [N, H, W, C]
    assert "\n".join(line.split(" = ", 1)[1].split("(")[0] for line in
                     plan.graph.format().splitlines()[5:-1]) == "\n".join([
                         "aten.clone.default", "aten.clone.default", "aten.convolution.default",
                         "aten.permute.default", GROUP_NORM_CL_OP, "aten.permute.default",
                         "aten.convolution.default", "aten.clone.default"])
    # off: torch's channels-last GroupNorm, the same values within a rounding
    torch._dynamo.reset()
    fxbackend.reset_stats()
    off = capture(_conv_norm_conv, *args, exact=False, rtol=2e-2, atol=2e-2,
                  options={"disable_rewrites": ["group_norm_channels_last"]})
    assert rewrites("group_norm_channels_last") == 0
    torch.testing.assert_close(c.out, off.out, rtol=2e-2, atol=2e-2)


def test_channels_last_group_norm_rule_leaves_float32_alone(no_grad):
    from conftest import capture, rewrites
    x = torch.randn(1, 8, 5, 5).to(memory_format=torch.channels_last)
    w, b = torch.randn(8), torch.randn(8)
    fxbackend.reset_stats()
    capture(lambda x, w, b: F.group_norm(x, 4, w, b, EPS) * 2, x, w, b, exact=False)
    assert rewrites("group_norm_channels_last") == 0
