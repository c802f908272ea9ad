"""The native kernel: ``.out`` overload discovery and the fast ``torch.*`` bindings, generated
from the tables so that no entry goes untested."""
from __future__ import annotations

import pytest
import torch

from fxbackend.executor import _FAST_OUT
from fxbackend.native import out_is_copy, out_overload


def _resolve(name: str) -> torch._ops.OpOverload:
    _, op, overload = name.split(".")
    return getattr(getattr(torch.ops.aten, op), overload)


def _sample_args(op: torch._ops.OpOverload):
    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.rand(shape, generator=g) + 0.5  # positive: log, sqrt, pow stay finite

    name = op._schema.name.split("::")[1]
    if name in ("mm",):
        return [t(5, 3), t(3, 4)]
    if name == "bmm":
        return [t(2, 5, 3), t(2, 3, 4)]
    if name == "addmm":
        return [t(4), t(5, 3), t(3, 4)]
    if name == "baddbmm":
        return [t(2, 5, 4), t(2, 5, 3), t(2, 3, 4)]
    if name == "where":
        return [t(7) > 1.0, t(7), t(7)]
    if name == "_softmax":
        return [t(3, 7), 1, False]
    if name in ("relu", "silu", "gelu"):
        return [t(3, 7) - 1.0]  # both signs
    n_tensors = sum(1 for a in op._schema.arguments if str(a.type) == "Tensor")
    args = [t(3, 7) for _ in range(n_tensors)]
    if op._overloadname == "Tensor_Scalar":
        args.append(1.5)
    return args


@pytest.mark.parametrize("name", sorted(_FAST_OUT))
def test_fast_binding_matches_out_overload(name):
    op = _resolve(name)
    ov = out_overload(op)
    assert ov is not None, f"{name} has no .out overload"
    args = _sample_args(op)
    ref = op(*args)
    via_out = torch.empty_like(ref)
    ov[0](*args, **{ov[1][0]: via_out})
    fast = torch.empty_like(ref)
    binding = _FAST_OUT[name]
    if isinstance(binding, tuple):  # (binding, extra positional arguments)
        binding[0](*args, *binding[1], out=fast)
    else:
        binding(*args, out=fast)
    assert torch.equal(via_out, ref)
    assert torch.equal(fast, ref)


@pytest.mark.parametrize("name,outs", [
    ("aten.mul.Tensor", ("out",)),
    ("aten.native_layer_norm.default", ("out0", "out1", "out2")),
    ("aten.convolution.default", ("out",)),
    ("aten.cat.default", ("out",)),
])
def test_out_overload_found(name, outs):
    ov = out_overload(_resolve(name))
    assert ov is not None and ov[1] == outs


@pytest.mark.parametrize("name", ["aten._scaled_dot_product_flash_attention_for_cpu.default",
                                  "aten.view.default", "aten.add_.Tensor"])
def test_out_overload_absent(name):
    # no .out overload (attention), or not a functional op (view, in-place)
    assert out_overload(_resolve(name)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_numbers_in_tensor_arguments_stay_exact(dtype):
    # float32/float64 plans pass such numbers as prebuilt 0-dim tensors; the results must be
    # bitwise those of eager, for every arithmetic op and operand order
    def f(x):
        y = x * 0.64 - 1.31
        y = y / 3.0 + 2
        y = 2.5 - y
        y = torch.where(y > 0, y, 0.25)
        return y * 1e-3, (x.int() * 0.5)

    import fxbackend

    x = torch.randn(7, 5).to(dtype)
    with torch.no_grad():
        out = torch.compile(f, backend="fxbackend")(x)
    ref = f(x)
    for o, r in zip(out, ref):
        assert o.dtype == r.dtype
        assert torch.equal(o, r)
    assert fxbackend.stats()["calls"] == 1


@pytest.mark.parametrize("name,copies", [
    ("aten.convolution.default", True),           # generated .out: the op, then a copy
    ("aten.native_layer_norm.default", True),
    ("aten.native_group_norm.default", True),
    ("aten.addmm.default", False),                # a CPU kernel of its own
    ("aten.mul.Tensor", False),
    ("aten.cat.default", False),
    ("aten._scaled_dot_product_flash_attention_for_cpu.default", False),  # no .out at all
])
def test_out_is_copy_on_cpu(name, copies):
    assert out_is_copy(_resolve(name), "cpu") is copies


def test_out_is_copy_unknown_device_is_false():
    assert out_is_copy(_resolve("aten.convolution.default"), "xla") is False


_LOSSES = {
    "binary_cross_entropy": lambda x, t, r: torch.nn.functional.binary_cross_entropy(
        x, t, reduction=r),
    "huber_loss": lambda x, t, r: torch.nn.functional.huber_loss(x, t, reduction=r),
    "soft_margin_loss": lambda x, t, r: torch.nn.functional.soft_margin_loss(x, t, reduction=r),
}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss", sorted(_LOSSES))
def test_losses_whose_out_kernel_uses_out_as_scratch(loss, reduction):
    """With a reduction, these ops' CPU ``.out`` kernels resize ``out`` to the elementwise loss
    and use it as scratch.  In a plan the loss's scalar buffer sits in the hole ``s`` leaves,
    just before ``a`` and ``b``: called with ``out=``, binary_cross_entropy and huber_loss
    overwrite them (and binary_cross_entropy's loss is wrong).  The plan must give eager's
    result."""
    import fxbackend

    def f(x, t):
        s = x.sum(0)
        a = x.exp()
        b = t * 3.0
        c = a * s        # s's buffer is free from here
        l = _LOSSES[loss](x, t, reduction)
        return c * l + b + a

    g = torch.Generator().manual_seed(0)
    x = torch.rand(32, 48, generator=g) * 0.8 + 0.1
    t = torch.rand(32, 48, generator=g)
    with torch.no_grad():
        got = torch.compile(f, backend="fxbackend")(x, t)
    assert fxbackend.stats()["calls"] == 1
    torch.testing.assert_close(got, f(x, t), rtol=1e-6, atol=1e-6)
