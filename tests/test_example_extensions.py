"""The two example extensions (tests/ext_example_op.py, tests/ext_example_fusion.py), used the
way a model would: through ``torch.compile(backend="fxbackend")`` under ``torch.no_grad()``,
against eager results, with ``fxbackend.stats()`` and ``fxbackend.explain`` as the evidence.
"""
from __future__ import annotations

import pytest
import torch

import ext_example_fusion
import ext_example_op
import fxbackend
from ext_example_op import scaled_tanh


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture
def op_ext():
    ext_example_op.register()
    yield ext_example_op
    ext_example_op.unregister()


@pytest.fixture
def fusion_ext():
    yield ext_example_fusion
    ext_example_fusion.unregister()


def _compiled(fn, **options):
    return torch.compile(fn, backend="fxbackend", options=options or None)


# -- the custom op --------------------------------------------------------------------------------

def _tanh_model(x):
    return scaled_tanh(x, 2.0) + 1


def test_op_compiled_runs_the_cpu_kernel(op_ext):
    x = torch.randn(3, 5)
    out = _compiled(_tanh_model)(x)
    torch.testing.assert_close(out, _tanh_model(x), rtol=0, atol=0)
    torch.testing.assert_close(out, ext_example_op.reference(x, 2.0) + 1, rtol=0, atol=0)
    assert fxbackend.stats()["steps_by_kernel"].get(ext_example_op.KERNEL_NAME) == 1


def test_op_without_the_extension_runs_natively():
    # negative: nothing registered with fxbackend, the torch.library op runs as an ATen call
    x = torch.randn(3, 5)
    out = _compiled(_tanh_model)(x)
    torch.testing.assert_close(out, _tanh_model(x), rtol=0, atol=0)
    assert ext_example_op.KERNEL_NAME not in fxbackend.stats()["steps_by_kernel"]


def test_op_unsupported_dtype_falls_back(op_ext):
    # the kernel supports float32 only: float64 runs the native implementation
    x = torch.randn(4, 3, dtype=torch.float64)
    out = _compiled(_tanh_model)(x)
    torch.testing.assert_close(out, _tanh_model(x), rtol=0, atol=0)
    assert ext_example_op.KERNEL_NAME not in fxbackend.stats()["steps_by_kernel"]


def test_op_explain_names_the_kernel(op_ext, capsys):
    text = fxbackend.explain(_tanh_model, torch.randn(2, 7))
    line = next(ln for ln in text.splitlines() if ext_example_op.OP_NAME in ln)
    assert "{scale=2.0}" in line and line.endswith(f"[{ext_example_op.KERNEL_NAME}]"), line
    assert text in capsys.readouterr().out


def _one_op_graph(dtype, scale=0.5):
    g = fxbackend.Graph()
    x = g.append(g.new_node("input", meta=fxbackend.TensorMeta(
        (4, 6), (6, 1), dtype, torch.device("cpu")), is_input=True))
    y = fxbackend.op_create(g, ext_example_op.OP_NAME, [x], {"scale": scale})
    y.is_output = True
    g.outputs = [y]
    return g, y


@pytest.mark.parametrize("dtype, kernel", [(torch.float32, ext_example_op.KERNEL_NAME),
                                           (torch.float64, "native")])
def test_op_hand_built_graph(op_ext, dtype, kernel):
    g, y = _one_op_graph(dtype)
    assert y.meta == fxbackend.TensorMeta((4, 6), (6, 1), dtype, torch.device("cpu"))
    cg = fxbackend.CompiledGraph(g, fxbackend.parse_options())
    x = torch.randn(4, 6, dtype=dtype)
    (out,) = cg(x)
    torch.testing.assert_close(out, ext_example_op.reference(x, 0.5), rtol=0, atol=0)
    assert fxbackend.stats()["steps_by_kernel"] == {kernel: 1}


def test_op_register_unregister_round_trip():
    ext_example_op.register()
    with pytest.raises(ValueError, match="already registered"):
        fxbackend.register_op(ext_example_op.ScaledTanh)
    ext_example_op.unregister()
    assert fxbackend.get_op(ext_example_op.OP_NAME) is None
    with pytest.raises(KeyError):
        _one_op_graph(torch.float32)


# -- the fusion rule ------------------------------------------------------------------------------

def _interleaved(x, w, b, other):
    y = x * w
    z = other.sin()  # independent work between the producer and its consumer
    return y + b, z


def _qk(x, wq, wk, bq, bk):
    q = x * wq
    k = x * wk
    return q + bq, k + bk


def _consecutive(x, w, b):
    return (x * w + b).relu()


def _args(n, shape=(4, 8)):
    torch.manual_seed(0)
    return [torch.randn(shape) for _ in range(n)]


def _check(fn, args, **options):
    got = _compiled(fn, **options)(*args)
    torch.testing.assert_close(got, fn(*args))


def test_fusion_fires_on_consecutive_chain(fusion_ext):
    rule = fusion_ext.register()
    _check(_consecutive, _args(3))
    assert fxbackend.stats()["fusions_by_rule"] == {rule.name: 1}


def test_fusion_variant_without_optimize_does_not_fire_on_interleaved(fusion_ext):
    rule = fusion_ext.register(fusion_ext.MulAdd())
    assert getattr(rule, "optimize", None) is None
    _check(_interleaved, _args(4))
    assert fxbackend.stats()["fusions_by_rule"].get(rule.name, 0) == 0


def test_fusion_with_optimize_fires_on_interleaved(fusion_ext):
    rule = fusion_ext.register()
    _check(_interleaved, _args(4))
    assert fxbackend.stats()["fusions_by_rule"] == {rule.name: 1}


def test_fusion_interleaved_chains_q_k(fusion_ext):
    plain = fusion_ext.register(fusion_ext.MulAdd())
    _check(_qk, _args(5))
    assert fxbackend.stats()["fusions_by_rule"].get(plain.name, 0) == 0
    fusion_ext.unregister()
    torch._dynamo.reset()
    rule = fusion_ext.register()
    _check(_qk, _args(5))
    assert fxbackend.stats()["fusions_by_rule"] == {rule.name: 2}


def test_fusion_fires_in_every_plan_of_a_dynamic_graph(fusion_ext):
    rule = fusion_ext.register()
    fn = torch.compile(_interleaved, backend="fxbackend", dynamic=True)
    for n in (3, 5, 7):
        args = _args(4, (n, 8))
        torch.testing.assert_close(fn(*args), _interleaved(*args))
    s = fxbackend.stats()
    assert s["graphs_compiled"] == 1 and s["plans_built"] == 3
    assert s["fusions_by_rule"] == {rule.name: 3}  # fusion runs per plan


def test_fusion_broadcast_bias(fusion_ext):
    rule = fusion_ext.register()
    x, w = _args(2)
    b = torch.randn(8)
    _check(_interleaved, [x, w, b, torch.randn(3)])
    assert fxbackend.stats()["fusions_by_rule"] == {rule.name: 1}


def test_fusion_declines_when_product_is_reused(fusion_ext):
    # negative: the engine, not the rule, refuses a claim whose intermediate is read elsewhere
    rule = fusion_ext.register()

    def fn(x, w, b):
        y = x * w
        return y + b, y.cos()

    text = fxbackend.explain(fn, *_args(3))
    assert f"declined {rule.name} on" in text and "outside the match" in text
    assert f"fused {rule.name}" not in text
    _check(fn, _args(3))
    assert fxbackend.stats()["fusions_by_rule"].get(rule.name, 0) == 0


def test_fusion_optimize_refused_by_dependency(fusion_ext):
    # negative: the node in between reads the product, graph_delay refuses, nothing fires
    rule = fusion_ext.register()

    def fn(x, w, b):
        y = x * w
        z = y.sin()
        return y + b, z

    _check(fn, _args(3))
    assert fxbackend.stats()["fusions_by_rule"].get(rule.name, 0) == 0


def test_fusion_off_by_option(fusion_ext):
    rule = fusion_ext.register()
    _check(_interleaved, _args(4), fusion=False)
    assert fxbackend.stats()["fusions_by_rule"].get(rule.name, 0) == 0


def test_fusion_explain_shows_the_fused_step(fusion_ext, capsys):
    rule = fusion_ext.register()
    text = fxbackend.explain(_interleaved, *_args(4))
    assert text in capsys.readouterr().out
    lines = text.splitlines()
    fused = [ln for ln in lines if ln.endswith(f"[{rule.name}]")]
    assert len(fused) == 1 and f"fused.{rule.name}(" in fused[0], text
    assert any(ln.startswith(f"fused {rule.name}: %") for ln in lines), text
    # the node list is in execution order: the independent sin now comes before the fused step
    sin = next(i for i, ln in enumerate(lines) if "aten.sin.default" in ln)
    assert sin < lines.index(fused[0])
    assert "aten.mul.Tensor" not in text.split("fused " + rule.name + ":")[0]


def test_fusion_explain_without_optimize(fusion_ext):
    rule = fusion_ext.register(fusion_ext.MulAdd())
    text = fxbackend.explain(_interleaved, *_args(4))
    assert f"[{rule.name}]" not in text and "no fusion rule matched" in text
    assert "aten.mul.Tensor" in text and "aten.add.Tensor" in text


def test_both_extensions_together(op_ext, fusion_ext):
    rule = fusion_ext.register()

    def fn(x, w, b, other):
        y = x * w
        z = scaled_tanh(other, 3.0)
        return y + b, z

    _check(fn, _args(4))
    s = fxbackend.stats()
    assert s["fusions_by_rule"] == {rule.name: 1}
    assert s["steps_by_kernel"].get(op_ext.KERNEL_NAME) == 1
    assert s["steps_by_kernel"].get(rule.name) == 1


def test_examples_use_public_api_only():
    import ast
    import pathlib
    for mod in (ext_example_op, ext_example_fusion):
        tree = ast.parse(pathlib.Path(mod.__file__).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("fxbackend."), (mod.__name__, node.module)
                if node.module == "fxbackend":
                    assert {a.name for a in node.names} <= set(fxbackend.__all__)
            if isinstance(node, ast.Import):
                assert all(not a.name.startswith("fxbackend.") for a in node.names)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == "fxbackend":
                assert node.attr in fxbackend.__all__, (mod.__name__, node.attr)
