"""Extensions outside the package (fxbackend/extensions.py): the ``fxbackend.extensions``
entry-point group, ``FXB_EXTENSIONS=module,module``, clear ImportErrors naming a failing
extension, and the backend loading them before it compiles.

Each test writes its extension modules to ``tmp_path``; the ``ext`` fixture puts that folder on
``sys.path``, replaces the installed entry points with a list the test controls, and afterwards
forgets the modules and unregisters whatever they registered.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import sys
import textwrap

import pytest
import torch

import fxbackend
from fxbackend import extensions

from ext_util import registry_guard, registry_snapshot, restore_registry  # noqa: F401

pytestmark = pytest.mark.usefixtures("registry_guard")

GROUP = "fxbackend.extensions"
_real_entry_points = importlib.metadata.entry_points

# An extension module: registers a custom op named after the module when imported.
OP_MODULE = """
import fxbackend

class Op:
    name = "test.{mod}.v1"

    def infer_meta(self, srcs, attrs):
        return srcs[0]

fxbackend.register_op(Op)
"""


class Ext:
    def __init__(self, tmp_path, monkeypatch) -> None:
        self.tmp_path, self.monkeypatch = tmp_path, monkeypatch
        self.entry_points: list = []
        self.queries: list = []
        self.modules: list = []

    def module(self, name: str, body: str = OP_MODULE) -> str:
        """Write extension module ``name`` (not imported yet); returns its name."""
        (self.tmp_path / f"{name}.py").write_text(textwrap.dedent(body.format(mod=name)))
        importlib.invalidate_caches()
        self.modules.append(name)
        return name

    def entry_point(self, name: str, value: str, group: str = GROUP) -> None:
        self.entry_points.append(importlib.metadata.EntryPoint(name, value, group))

    def fake_entry_points(self, **query):
        """The test's entry points for fxbackend's group; the installed ones for the rest
        (torch looks up its Dynamo backends through the same function)."""
        if query.get("group") != GROUP:
            return _real_entry_points(**query)
        self.queries.append(query)
        return importlib.metadata.EntryPoints(
            ep for ep in self.entry_points if ep.group == GROUP)


@pytest.fixture
def ext(tmp_path, monkeypatch, registry_guard):
    e = Ext(tmp_path, monkeypatch)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(extensions.importlib.metadata, "entry_points", e.fake_entry_points)
    monkeypatch.setattr(extensions, "_loaded", [])
    monkeypatch.delenv("FXB_EXTENSIONS", raising=False)
    before = registry_snapshot()
    yield e
    for name in e.modules:
        sys.modules.pop(name, None)
    restore_registry(before)  # what the extensions registered


def _op_name(module: str) -> str:
    return f"test.{module}.v1"


# -- entry points ---------------------------------------------------------------------------------

def test_an_entry_point_naming_a_module_is_imported_once(ext):
    mod = ext.module("fxb_ext_ep_mod")
    ext.entry_point("ep_mod", mod)
    assert fxbackend.get_op(_op_name(mod)) is None
    (loaded,) = fxbackend.load_extensions()
    assert "ep_mod" in loaded and mod in loaded
    assert fxbackend.get_op(_op_name(mod)) is not None
    assert ext.queries == [{"group": GROUP}]
    assert fxbackend.load_extensions() == [], "already loaded"
    assert extensions.loaded_extensions() == [loaded]


def test_an_entry_point_naming_a_callable_is_called(ext):
    mod = ext.module("fxb_ext_ep_call", """
        import fxbackend
        calls = []

        class Op:
            name = "test.{mod}.v1"

            def infer_meta(self, srcs, attrs):
                return srcs[0]

        def register():
            calls.append(1)
            fxbackend.register_op(Op)
        """)
    ext.entry_point("ep_call", f"{mod}:register")
    fxbackend.load_extensions()
    assert sys.modules[mod].calls == [1]
    assert fxbackend.get_op(_op_name(mod)) is not None
    fxbackend.load_extensions()
    assert sys.modules[mod].calls == [1]


def test_entry_points_of_other_groups_are_not_loaded(ext):
    mod = ext.module("fxb_ext_other_group")
    ext.entry_point("other", mod, group="some.other.group")
    assert fxbackend.load_extensions() == []
    assert mod not in sys.modules


@pytest.mark.parametrize("value, cause", [
    ("fxb_ext_ep_broken", "RuntimeError: broken on purpose"),
    ("fxb_ext_ep_missing", "fxb_ext_ep_missing"),
    ("fxb_ext_ep_broken:nothing_here", "nothing_here"),
])
def test_a_failing_entry_point_is_an_import_error_naming_it(ext, value, cause):
    ext.module("fxb_ext_ep_broken", "raise RuntimeError('broken on purpose')\n"
               if ":" not in value else "x = 1\n")
    ext.modules.append("fxb_ext_ep_missing")
    ext.entry_point("ep_broken", value)
    with pytest.raises(ImportError, match="ep_broken") as info:
        fxbackend.load_extensions()
    assert cause in str(info.value)
    assert extensions.loaded_extensions() == [], "a failed extension is not recorded as loaded"


# -- FXB_EXTENSIONS -------------------------------------------------------------------------------

def test_fxb_extensions_imports_each_module(ext, monkeypatch):
    a, b = ext.module("fxb_ext_env_a"), ext.module("fxb_ext_env_b")
    monkeypatch.setenv("FXB_EXTENSIONS", f"{a}, {b},")
    assert fxbackend.load_extensions() == [a, b]
    assert fxbackend.get_op(_op_name(a)) is not None and fxbackend.get_op(_op_name(b)) is not None
    assert fxbackend.load_extensions() == []


def test_without_fxb_extensions_nothing_is_imported(ext):
    mod = ext.module("fxb_ext_env_unlisted")
    assert fxbackend.load_extensions() == []
    assert mod not in sys.modules


@pytest.mark.parametrize("body, cause", [
    ("raise RuntimeError('broken on purpose')\n", "RuntimeError: broken on purpose"),
    ("import fxb_ext_no_such_dependency\n", "fxb_ext_no_such_dependency"),
    (None, "No module named"),
])
def test_a_failing_fxb_extensions_module_is_an_import_error_naming_it(ext, monkeypatch, body,
                                                                      cause):
    good = ext.module("fxb_ext_env_good")
    if body is None:
        ext.modules.append("fxb_ext_env_bad")
    else:
        ext.module("fxb_ext_env_bad", body)
    monkeypatch.setenv("FXB_EXTENSIONS", f"{good},fxb_ext_env_bad")
    with pytest.raises(ImportError, match="'fxb_ext_env_bad'.*FXB_EXTENSIONS") as info:
        fxbackend.load_extensions()
    assert cause in str(info.value)
    assert extensions.loaded_extensions() == [good]


# -- the backend loads extensions before compiling ------------------------------------------------

MUL_KERNEL_MODULE = """
import torch
import fxbackend

class MulKernel:
    name, op = "{mod}", "aten.mul.Tensor"
    calls = 0

    def supports(self, node):
        return len(node.srcs) == 2 and node.srcs[0].meta.shape == node.srcs[1].meta.shape

    def execute(self, ctx, node, state, inputs, out, workspace):
        MulKernel.calls += 1
        torch.mul(inputs[0], inputs[1], out=out)

fxbackend.register_kernel("cpu", MulKernel())
"""


def test_torch_compile_loads_fxb_extensions_before_compiling(ext, monkeypatch):
    mod = ext.module("fxb_ext_backend_mul", MUL_KERNEL_MODULE)
    monkeypatch.setenv("FXB_EXTENSIONS", mod)
    fn = lambda x, y: (x * y).sin()  # noqa: E731
    x, y = torch.randn(3, 5), torch.randn(3, 5)
    assert mod not in sys.modules
    with torch.no_grad():
        r = torch.compile(fn, backend="fxbackend")(x, y)
    torch.testing.assert_close(r, fn(x, y))
    assert mod in extensions.loaded_extensions()
    assert sys.modules[mod].MulKernel.calls == 1
    assert fxbackend.stats()["steps_by_kernel"] == {mod: 1, "native": 1}


def test_torch_compile_with_a_failing_extension_names_it(ext, monkeypatch):
    ext.module("fxb_ext_backend_broken", "raise RuntimeError('broken on purpose')\n")
    monkeypatch.setenv("FXB_EXTENSIONS", "fxb_ext_backend_broken")
    with torch.no_grad(), pytest.raises(Exception, match="fxb_ext_backend_broken") as info:
        torch.compile(lambda x: x.sin(), backend="fxbackend")(torch.randn(3))
    chain, e = [], info.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or getattr(e, "inner_exception", None)
    assert any(isinstance(c, ImportError) for c in chain)
