"""Shared test helpers: a capture backend that keeps fxbackend's CompiledGraph objects.

``capture(fn, *args)`` compiles ``fn`` with Dynamo + aot_autograd into fxbackend (the same path
as ``backend="fxbackend"``, see fxbackend/dynamo.py), runs it once, checks the result against
eager, and returns a :class:`Captured` holding every CompiledGraph built and its node list text.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import pytest
import torch

import fxbackend
from fxbackend.dynamo import boxed_runner, compile_fx_graph
from fxbackend.options import parse_options


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test starts with no cached Dynamo frames and zeroed fxbackend counters."""
    torch._dynamo.reset()
    fxbackend.reset_stats()
    yield
    torch._dynamo.reset()


#: ``FXB_CPU_PROFILE`` as the run was started with (None: unset)
_OUTER_PROFILE = os.environ.get("FXB_CPU_PROFILE")


@pytest.fixture(autouse=True, scope="session")
def _pinned_profile():
    """The pinned class (below) for the whole session, so that module-scoped fixtures, which
    are set up before any test's own fixtures, build their plans with the same decisions as the
    tests that read them (and as the fresh processes those tests start)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("FXB_CPU_PROFILE", os.environ.get("FXB_TEST_CPU_PROFILE", "amx"))
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def _every_fast_path(request, monkeypatch, _pinned_profile):
    """Tests run every fast path whatever the host (``FXB_CPU_PROFILE=amx``: W8A8's int8 GEMM,
    native 16-bit GEMMs), so the kernels and fusions they check run on every CPU class: on a
    CPU without them the same kernels are only slower.  What each CPU class decides is
    ``tests/test_cpu_profile.py``'s and ``tests/test_gemm.py``'s (marked ``cpu_profile``: they
    set the profile themselves, and see the environment's otherwise, the host's when it sets
    none).  ``FXB_TEST_CPU_PROFILE`` names another class to pin (``make test-avx2`` runs the
    CPU-dependent tests so, with the vectors limited to AVX2)."""
    if "cpu_profile" in request.keywords:
        if _OUTER_PROFILE is None:
            monkeypatch.delenv("FXB_CPU_PROFILE", raising=False)
        else:
            monkeypatch.setenv("FXB_CPU_PROFILE", _OUTER_PROFILE)
    yield


@pytest.fixture
def no_grad():
    """Run the test under ``torch.no_grad()`` (inference, as the backend's plans are)."""
    with torch.no_grad():
        yield


def rewrites(rule: str) -> int:
    """How many instances the rewrite rule named ``rule`` replaced since the last
    ``fxbackend.reset_stats()``."""
    return fxbackend.stats()["rewrites_by_rule"].get(rule, 0)


def tiny_model_outputs(family: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(compiled, eager)`` first outputs of the tiny ``family`` model on its inputs; the
    fxbackend counters are reset just before the compiled call."""
    import fxbackend.models as models
    m = models.build_model(family, "tiny")
    inp = models.make_inputs(family, "tiny")
    want = models.run_eager(m, inp)
    fxbackend.reset_stats()
    return models.run_eager(torch.compile(m, backend="fxbackend"), inp), want


@dataclasses.dataclass
class Captured:
    compiled: list  # CompiledGraph, one per fw graph, in compile order
    formats: list  # compiled.graph.format() at compile time (after the pipeline)
    fn: Callable  # the torch.compile'd function (call it again to reuse the plans)
    out: Any = None  # the first call's result

    @property
    def graph(self):
        assert len(self.compiled) == 1, f"expected one graph, got {len(self.compiled)}"
        return self.compiled[0]

    @property
    def text(self) -> str:
        assert len(self.formats) == 1, f"expected one graph, got {len(self.formats)}"
        return self.formats[0]


def _clone(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, (list, tuple)):
        return type(v)(_clone(x) for x in v)
    return v


def assert_same(got: Any, want: Any, exact: bool = True, **tol: Any) -> None:
    """Tree-compare results (tensors bit-exact unless ``exact=False``)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"got {type(got).__name__}, want a tensor"
        assert got.dtype == want.dtype and got.shape == want.shape, (got, want)
        if exact:
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        else:
            torch.testing.assert_close(got, want, equal_nan=True, **tol)
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), (got, want)
        for g, w in zip(got, want):
            assert_same(g, w, exact, **tol)
    else:
        assert got == want, (got, want)


def make_capture_backend(sink: Captured, options: dict | None = None):
    """A Dynamo backend that lowers through aot_autograd into fxbackend and records the graphs."""
    from torch._functorch.aot_autograd import aot_module_simplified

    opts = parse_options(options)

    def backend(gm: torch.fx.GraphModule, example_inputs: list):
        def fw_compiler(aten_gm: torch.fx.GraphModule, fake_inputs: list):
            compiled = compile_fx_graph(aten_gm, opts)
            sink.compiled.append(compiled)
            sink.formats.append(compiled.graph.format())
            return boxed_runner(compiled)

        return aot_module_simplified(gm, example_inputs, fw_compiler=fw_compiler,
                                     keep_inference_input_mutations=True)

    return backend


def capture(fn: Callable, *args: Any, dynamic: bool | None = None, options: dict | None = None,
            check: bool = True, exact: bool = True, **tol: Any) -> Captured:
    """Compile ``fn`` into fxbackend (fullgraph), call it once on ``args`` and compare the result
    (and any mutated inputs) with eager run on clones of ``args``."""
    sink = Captured([], [], None)
    compiled_fn = torch.compile(fn, backend=make_capture_backend(sink, options), dynamic=dynamic,
                                fullgraph=True)
    sink.fn = compiled_fn
    eager_args = _clone(args)
    sink.out = compiled_fn(*args)
    if check:
        want = fn(*eager_args)
        assert_same(sink.out, want, exact, **tol)
        assert_same(list(args), list(eager_args), exact, **tol)  # input mutations too
    return sink
