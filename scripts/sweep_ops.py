#!/usr/bin/env python3
"""Run torch's operator samples (its OpInfo database) through fxbackend and compare with eager.

Each sample is one call of one op (``torch.add(x, y, alpha=2)``, ...), compiled on its own with
``torch.compile(backend="fxbackend")`` after a ``torch._dynamo.reset()``.  A sample counts as

* ``ok``: fxbackend ran it (``stats()["calls"]`` grew) and its outputs (and, with ``--inplace``,
  the written input) equal eager's within the dtype's tolerance;
* ``eager only``: Dynamo compiled nothing for fxbackend to run (a graph break before the op);
* ``mismatch`` / ``error``: different outputs, or an exception.  Each is re-run with
  ``backend="aot_eager"`` (the same Dynamo and aot_autograd path, no fxbackend): where that
  fails too the failure is torch's and is listed apart, not counted against fxbackend.

Random ops (``rand``, ``dropout``, ``normal``, ...) and uninitialised ones (``empty``) are
skipped: their values cannot be compared.  The exit status is 1 when any failure is
fxbackend's.

Run (from the repository root)::

    .venv/bin/python scripts/sweep_ops.py                          # float32, 3 samples per op
    .venv/bin/python scripts/sweep_ops.py --dtype bfloat16 --dynamic
    .venv/bin/python scripts/sweep_ops.py --noncontiguous --ops interpolate,softmax
    .venv/bin/python scripts/sweep_ops.py --inplace --every 4      # every 4th op, in place
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import signal
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

#: substrings of op names whose values cannot be compared with eager's
SKIP = ("rand", "dropout", "normal", "bernoulli", "multinomial", "uniform", "empty", "exponential",
        "cauchy", "geometric", "log_normal", "item", "tolist")

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-7, torch.bfloat16: 2e-2,
             torch.float16: 2e-3}


@dataclass
class Result:
    """What one sweep found: counts, and one line per failure."""
    ops: int = 0
    samples: int = 0
    ok: int = 0
    eager_only: int = 0
    failures: list[str] = field(default_factory=list)        # fxbackend's
    torch_failures: list[str] = field(default_factory=list)  # aot_eager fails too


def _leaves(v: Any) -> list:
    if isinstance(v, (list, tuple)):
        return [x for item in v for x in _leaves(item)]
    return [v]


def difference(got: Any, want: Any, tol: float) -> str | None:
    """Why ``got`` differs from ``want`` (trees of tensors and Python values), or None."""
    g, w = _leaves(got), _leaves(want)
    if len(g) != len(w):
        return f"{len(g)} outputs, eager has {len(w)}"
    for i, (a, b) in enumerate(zip(g, w)):
        if isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                return f"output {i}: {type(a).__name__}, eager has a tensor"
            if (a.shape, a.dtype, a.layout) != (b.shape, b.dtype, b.layout):
                return (f"output {i}: {a.dtype}{list(a.shape)} {a.layout}, eager has "
                        f"{b.dtype}{list(b.shape)} {b.layout}")
            if b.layout != torch.strided:
                a, b = a.to_dense(), b.to_dense()
            try:
                torch.testing.assert_close(a, b, rtol=tol, atol=tol, equal_nan=True)
            except AssertionError as e:
                lines = [x.strip() for x in str(e).splitlines() if x.strip()]
                return f"output {i}: " + "; ".join(lines[:3])
        elif not (a == b or (isinstance(a, float) and isinstance(b, float)
                             and math.isnan(a) and math.isnan(b))):
            return f"output {i}: {a!r}, eager has {b!r}"
    return None


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    def stop(*_):
        raise _Timeout()
    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _run(fn: Callable, make_args: Callable, backend: str, dynamic: bool, inplace: bool) -> Any:
    torch._dynamo.reset()
    args = make_args()
    out = torch.compile(fn, backend=backend, dynamic=dynamic)(*args)
    return (out, args[0]) if inplace else out


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:160] if text else ''}"


def op_samples(info: Any, dtype: torch.dtype, n: int) -> list:
    """The first ``n`` CPU samples of OpInfo ``info`` in ``dtype`` (no autograd).

    Made from the OpInfo's sample function directly, with one seed per op:
    ``info.sample_inputs`` walks the Python stack and reseeds for every sample, which makes it
    several times slower under pytest than the samples take to build."""
    torch.manual_seed(0)
    return list(itertools.islice(info.sample_inputs_func(info, "cpu", dtype, False), n))


def sweep(dtype: torch.dtype = torch.float32, samples: int = 3, dynamic: bool = False,
          noncontiguous: bool = False, inplace: bool = False, ops: tuple[str, ...] = (),
          every: int = 1, offset: int = 0, timeout: int = 60,
          log: Callable[[str], None] = lambda line: None) -> Result:
    """Run the samples of torch's OpInfo database through fxbackend (see the module text).

    ``ops`` keeps ops whose name contains one of the strings; ``every``/``offset`` keep every
    ``every``-th op of the database from ``offset``; ``log`` gets one line per failure."""
    import fxbackend
    from torch.testing._internal.common_methods_invocations import op_db

    res = Result()
    tol = TOLERANCE.get(dtype, 0.0)
    for index, info in enumerate(op_db):
        if index % every != offset % every:
            continue
        name = info.name + (f".{info.variant_test_name}" if info.variant_test_name else "")
        if ops and not any(s in name for s in ops):
            continue
        if any(s in info.name for s in SKIP) or dtype not in info.supported_dtypes("cpu"):
            continue
        fn = info.inplace_variant if inplace else info.op
        if fn is None:
            continue
        try:
            cases = op_samples(info, dtype, samples)
        except Exception:
            continue
        res.ops += 1
        for k, case in enumerate(cases):
            if noncontiguous:
                try:
                    case = case.noncontiguous()
                except RuntimeError:
                    continue  # sparse inputs have no strides to change
            tag = f"{name}#{k}"

            def make_args(case=case):
                return [a.clone() if isinstance(a, torch.Tensor) else a
                        for a in (case.input, *case.args)]

            def call(*args, _fn=fn, _kw=case.kwargs):
                return _fn(*args, **_kw)

            try:
                eager_args = make_args()
                want = call(*eager_args)
                want = (want, eager_args[0]) if inplace else want
            except Exception:
                continue  # the sample is not valid for this variant
            res.samples += 1
            calls = fxbackend.stats()["calls"]
            try:
                with _time_limit(timeout):
                    got = _run(call, make_args, "fxbackend", dynamic, inplace)
                why = difference(got, want, tol)
            except _Timeout:
                why = f"no result in {timeout} s"
            except Exception as e:
                why = _first_line(e)
            if why is None:
                if fxbackend.stats()["calls"] > calls:
                    res.ok += 1
                else:
                    res.eager_only += 1
                continue
            try:
                with _time_limit(timeout):
                    ref = _run(call, make_args, "aot_eager", dynamic, inplace)
                theirs = difference(ref, want, tol)
            except Exception as e:
                theirs = _first_line(e)
            line = f"{tag}: {why}" + (f" (aot_eager: {theirs})" if theirs else "")
            (res.torch_failures if theirs else res.failures).append(line)
            log(("torch " if theirs else "FAIL  ") + line)
    torch._dynamo.reset()
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="float32", choices=sorted(
        str(d).split(".")[1] for d in TOLERANCE))
    p.add_argument("--samples", type=int, default=3, help="samples per op (default 3)")
    p.add_argument("--dynamic", action="store_true", help="torch.compile(dynamic=True)")
    p.add_argument("--noncontiguous", action="store_true", help="non-contiguous inputs")
    p.add_argument("--inplace", action="store_true", help="the ops' in-place variants")
    p.add_argument("--ops", default="", help="comma-separated substrings of op names")
    p.add_argument("--every", type=int, default=1, help="every N-th op of the database")
    p.add_argument("--offset", type=int, default=0, help="first op index modulo --every")
    p.add_argument("--timeout", type=int, default=60, help="seconds per sample")
    a = p.parse_args(argv)
    if a.every < 1 or a.samples < 1 or a.timeout < 1:
        p.error("--every, --samples and --timeout must be at least 1")
    warnings.filterwarnings("ignore")
    torch._dynamo.config.cache_size_limit = 64
    t0 = time.perf_counter()
    res = sweep(getattr(torch, a.dtype), a.samples, a.dynamic, a.noncontiguous, a.inplace,
                tuple(s for s in a.ops.split(",") if s), a.every, a.offset, a.timeout,
                log=lambda line: print(line, flush=True))
    print(f"{res.ops} ops, {res.samples} samples ({a.dtype}"
          f"{', dynamic' if a.dynamic else ''}{', non-contiguous' if a.noncontiguous else ''}"
          f"{', in place' if a.inplace else ''}) in {time.perf_counter() - t0:.0f} s: "
          f"{res.ok} ok in fxbackend, {res.eager_only} with nothing compiled, "
          f"{len(res.failures)} fxbackend failures, {len(res.torch_failures)} torch failures "
          f"(aot_eager fails too)")
    return 1 if res.failures else 0


if __name__ == "__main__":
    sys.exit(main())
