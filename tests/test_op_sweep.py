"""torch's operator samples (OpInfo) through fxbackend against eager: ``scripts/sweep_ops.py``
on a slice of the database per test (every op once across the static tests, one sample each;
a sparser slice with dynamic shapes, bf16 and non-contiguous inputs).  A failure that
``aot_eager`` shares is torch's and is not counted; any of fxbackend's fails the test and
names the op and sample.

The same samples check the contract a plan relies on when it calls an op's ``.out`` overload
into arena storage: it writes only into ``out``, at the functional result's shape, strides and
values."""
from __future__ import annotations

import importlib.util
import pathlib
import sys
import warnings

import pytest
import torch

from fxbackend.native import out_overload

_PATH = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "sweep_ops.py"
_spec = importlib.util.spec_from_file_location("sweep_ops", _PATH)
sweep_ops = importlib.util.module_from_spec(_spec)
sys.modules["sweep_ops"] = sweep_ops  # its dataclass looks its module up
_spec.loader.exec_module(sweep_ops)

_EVERY = 4


def _check(res) -> None:
    assert not res.failures, "\n".join(res.failures)
    assert res.samples > 20
    # the samples ran in fxbackend (not eager after a graph break)
    assert res.ok >= 0.85 * (res.samples - len(res.torch_failures)), res


@pytest.mark.parametrize("offset", range(_EVERY))
def test_operator_samples_float32(offset):
    _check(sweep_ops.sweep(torch.float32, samples=1, every=_EVERY, offset=offset))


@pytest.mark.parametrize("kind", ["dynamic", "bfloat16", "noncontiguous", "inplace"])
def test_operator_samples_variants(kind):
    kw = dict(dynamic=kind == "dynamic", noncontiguous=kind == "noncontiguous",
              inplace=kind == "inplace")
    dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
    every = _EVERY if kind == "inplace" else 3 * _EVERY  # fewer ops have in-place variants
    _check(sweep_ops.sweep(dtype, samples=1, every=every, offset=1, **kw))


#: ops whose results are random, or (``_ctc_loss``'s log_alpha) partly uninitialised: their
#: values cannot be compared, only where they were written
_VALUES_UNCOMPARABLE = ("multinomial", "normal", "bernoulli", "rand", "_ctc_loss", "uniform",
                        "exponential", "cauchy", "geometric", "log_normal", "empty")
_PAD = 64  # elements of sentinel before and after each out buffer


def _sampled_aten_calls(dtype):
    """``{overload: [(args, kwargs, results)]}``: the ATen calls (up to 3 per overload) that
    torch's operator samples make on the CPU in ``dtype``, with their arguments and results
    copied when the call returned (composite ops may change their parts' results in place
    afterwards)."""
    from torch.testing._internal.common_methods_invocations import op_db
    from torch.utils._python_dispatch import TorchDispatchMode

    def snap(v):
        return v.clone() if isinstance(v, torch.Tensor) and v.layout == torch.strided else v

    calls: dict = {}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen = calls.setdefault(func, [])
            if len(seen) < 3:
                res = [snap(o) for o in out] if isinstance(out, (tuple, list)) else [snap(out)]
                seen.append(([snap(a) for a in args], dict(kwargs or {}), res))
            return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated ops' warnings, thousands of them
        for info in op_db:
            if dtype not in info.supported_dtypes("cpu"):
                continue
            try:
                cases = sweep_ops.op_samples(info, dtype, 3)
            except Exception:
                continue
            for c in cases:
                try:
                    with Record():
                        info.op(c.input, *c.args, **c.kwargs)
                except Exception:
                    pass  # a sample the op refuses: nothing to learn from it
    return calls


def _extent(t: torch.Tensor) -> int:
    return 1 + sum((d - 1) * s for d, s in zip(t.shape, t.stride())) if t.numel() else 0


class _Arena:
    """One byte buffer holding strided tensors the way a plan's arena does: every tensor a view
    into the same storage, each between ``_PAD`` elements of sentinel."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.spans, size = [], 0
        for t in tensors:
            es = t.element_size()
            start = -(-(size + _PAD * es) // 64) * 64
            self.spans.append((start, es))
            size = start + (_extent(t) + _PAD) * es
        self.buf = torch.empty(size + 64, dtype=torch.uint8)
        self.regions = []
        for t, (start, es) in zip(tensors, self.spans):
            n = _extent(t)
            region = self.buf[start - _PAD * es:start + (n + _PAD) * es].view(t.dtype)
            region.fill_(self.fill(t.dtype))
            self.regions.append(region)

    @staticmethod
    def fill(dtype: torch.dtype):
        return False if dtype == torch.bool else 7

    def view(self, i: int, t: torch.Tensor) -> torch.Tensor:
        return self.regions[i][_PAD:].as_strided(t.shape, t.stride())

    def edges_intact(self, i: int, dtype: torch.dtype) -> bool:
        edge = torch.full((_PAD,), self.fill(dtype), dtype=dtype)
        r = self.regions[i]
        return torch.equal(r[:_PAD], edge) and torch.equal(r[-_PAD:], edge)


def _out_contract_violation(func, args, kwargs, results) -> str | None:
    """Call ``func``'s ``.out`` overload with its outs (the functional results' shapes and
    strides) and its strided tensor inputs all views of one sentinel-filled buffer, as in a
    plan's arena; why it breaks the contract a plan relies on (accepts the views, writes only
    inside each ``out``, keeps its shape, strides and storage, the functional values), or
    None."""
    ov, names = out_overload(func)
    # as_strided's offsets count from its input's storage, so its inputs keep their own
    ins = [] if "as_strided" in str(func) else [
        i for i, a in enumerate(args)
        if isinstance(a, torch.Tensor) and a.layout == torch.strided and a.device.type == "cpu"]
    arena = _Arena(list(results) + [args[i] for i in ins])
    views = [arena.view(k, r) for k, r in enumerate(results)]
    call = list(args)
    for k, i in enumerate(ins):
        call[i] = arena.view(len(results) + k, args[i])
        call[i].copy_(args[i])
    try:
        ov(*call, **kwargs, **dict(zip(names, views)))
    except Exception as e:
        # the functional op gave ``results`` for these arguments: an out kernel that refuses
        # views of one storage (linalg_qr's Q and R) fails a model that eager runs
        return f"refuses outs inside one buffer: {sweep_ops._first_line(e)}"
    random = any(s in str(func) for s in _VALUES_UNCOMPARABLE)
    for i, (r, v) in enumerate(zip(results, views)):
        if not arena.edges_intact(i, r.dtype):
            return f"out {i} written outside its buffer"
        if (v.shape, v.stride()) != (r.shape, r.stride()):
            return (f"out {i} resized: {list(r.shape)}{r.stride()} -> "
                    f"{list(v.shape)}{v.stride()}")
        if r.numel() and v.data_ptr() != arena.buf.data_ptr() + arena.spans[i][0]:
            return f"out {i} given new storage"
        if not random and not torch.equal(torch.nan_to_num(v.double() if r.is_floating_point()
                                                           else v),
                                          torch.nan_to_num(r.double() if r.is_floating_point()
                                                           else r)):
            return f"out {i} differs from the functional op's result"
    return None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_out_overloads_write_only_into_out(dtype):
    """Every functional ATen op that torch's operator samples reach and whose ``.out`` overload
    a plan calls: the overload writes only into ``out`` (a view inside the arena), at the
    functional result's shape and strides, with its values.  An op that breaks this must be
    called functionally (``native._OUT_NOT_FUNCTIONAL``)."""
    calls = _sampled_aten_calls(dtype)
    assert len(calls) > 300, "the operator samples reached too few ATen ops"
    checked, bad = 0, []
    for func, recs in calls.items():
        if func._schema.is_mutable or out_overload(func) is None:
            continue
        for args, kwargs, results in recs:
            if not all(isinstance(r, torch.Tensor) and r.layout == torch.strided
                       for r in results):
                continue
            checked += 1
            why = _out_contract_violation(func, args, kwargs, results)
            if why:
                bad.append(f"{func}: {why}")
                break
    assert checked > 300
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("fn", [torch.svd_lowrank, torch.pca_lowrank], ids=lambda f: f.__name__)
def test_low_rank_factorisations_match_eager(fn):
    """``svd_lowrank`` and ``pca_lowrank`` (their OpInfo samples break the graph on a
    Generator, so the sweep compiles nothing of them): ``linalg_qr`` with Q and R planned in
    one arena failed an internal assert.  With the same seed the plan draws eager's random
    projection, so its factors are eager's."""
    import fxbackend

    a = torch.randn(5, 7, 3, generator=torch.Generator().manual_seed(0)) @ \
        torch.randn(5, 3, 7, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)
    want = fn(a, q=3)
    torch._dynamo.reset()
    calls = fxbackend.stats()["calls"]
    torch.manual_seed(2)
    got = torch.compile(lambda x: fn(x, q=3), backend="fxbackend")(a)
    assert fxbackend.stats()["calls"] > calls, "nothing ran in fxbackend"
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    u, s, v = got
    torch.testing.assert_close(u @ torch.diag_embed(s) @ v.mT,
                               a - a.mean(-2, keepdim=True) if fn is torch.pca_lowrank else a,
                               rtol=1e-4, atol=1e-4)
