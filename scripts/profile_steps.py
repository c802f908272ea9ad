#!/usr/bin/env python3
"""Where a model's time goes, backend against backend: the ATen ops each backend calls, side
by side, per call.

For one model config (``fxbackend.models``), each of ``--backends`` is compiled and warmed up,
then ``--calls`` calls run under ``torch.profiler`` (CPU).  The ops' self times are summed per
op name (with ``--shapes``: per op name and input shapes) and divided by the calls; one table
gives each op's milliseconds per call under every backend and the last one's difference to
the first.
What no ATen op accounts for (fxbackend's numba kernels, Inductor's generated C++ kernels,
the executors' own work) is the row ``(not in an ATen op)``: the profiled wall time per call
less the ops' sum.  The profiler adds a few microseconds per op to every backend alike; the
timings of ``scripts/bench.py`` are the ones to compare speed by, this says where it differs.

``--steps K`` also prints fxbackend's own per-step profile (``options={"profile": True}``:
per kernel, per (kernel, op) and the ``K`` costliest steps), from a separate compile.

Run (from the repository root)::

    .venv/bin/python scripts/profile_steps.py --family sd3
    .venv/bin/python scripts/profile_steps.py --family unet --dtype bfloat16 --shapes --top 30
    .venv/bin/python scripts/profile_steps.py --family flux --backends fxbackend --steps 20
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import torch


def _compiled(backend: str, model, options: dict):
    if backend == "eager":
        return model
    if backend == "fxbackend":
        return torch.compile(model, backend="fxbackend", options=options)
    return torch.compile(model, backend=backend)


def op_times(fn, inputs: dict, calls: int, warmup: int, shapes: bool) -> tuple[dict, float]:
    """``({op key: self milliseconds per call}, profiled wall milliseconds per call)`` of
    ``fn(**inputs)`` over ``calls`` profiled calls after ``warmup`` plain ones."""
    from torch.profiler import ProfilerActivity, profile
    with torch.no_grad():
        for _ in range(warmup):
            fn(**inputs)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=shapes) as prof:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(**inputs)
            wall = (time.perf_counter() - t0) * 1e3 / calls
    per = collections.defaultdict(float)
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        key = f"{e.name} {e.input_shapes}" if shapes else e.name
        per[key] += e.self_cpu_time_total / 1e3 / calls
    return dict(per), wall


def side_by_side(results: dict[str, tuple[dict, float]], top: int) -> list[str]:
    """The table's lines: the ``top`` ops with the largest time under any backend, then the
    rest, the time outside ATen ops and the wall time, each per call."""
    names = list(results)
    keys = set().union(*(r[0] for r in results.values()))
    order = sorted(keys, key=lambda k: -max(r[0].get(k, 0.0) for r in results.values()))
    width = 12
    lines = ["".join(f"{n:>{width}}" for n in names)
             + (f"{'last-first':>{width}}" if len(names) > 1 else "") + "  op (ms per call)"]

    def row(values: list[float], label: str) -> str:
        cells = "".join(f"{v:>{width}.3f}" for v in values)
        if len(values) > 1:
            cells += f"{values[-1] - values[0]:>+{width}.3f}"
        return f"{cells}  {label}"

    shown = order[:top]
    for k in shown:
        lines.append(row([results[n][0].get(k, 0.0) for n in names], k))
    rest = [sum(v for k, v in results[n][0].items() if k not in shown) for n in names]
    lines.append(row(rest, f"(the other {max(len(order) - len(shown), 0)} ops)"))
    outside = [results[n][1] - sum(results[n][0].values()) for n in names]
    lines.append(row(outside, "(not in an ATen op)"))
    lines.append(row([results[n][1] for n in names], "(wall, profiled)"))
    return lines


def fxbackend_steps(model, inputs: dict, options: dict, calls: int, warmup: int,
                    top: int) -> str:
    """fxbackend's own per-step profile report of ``calls`` calls (a compile of its own)."""
    import fxbackend
    torch._dynamo.reset()
    fn = torch.compile(model, backend="fxbackend", options={**options, "profile": True})
    with torch.no_grad():
        with fxbackend.record_graphs() as graphs:
            fn(**inputs)
        for _ in range(warmup - 1):
            fn(**inputs)
        for g in graphs:
            g.reset_profile()
        for _ in range(calls):
            fn(**inputs)
    return "\n".join(g.profile_report(top) for g in graphs)


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchstats import cpu_header, source_commit
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="sd3")
    ap.add_argument("--size", default="small")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--backends", default="inductor,fxbackend",
                    help="comma-separated: eager, inductor, fxbackend (the first is the base)")
    ap.add_argument("--fxbackend-options", default="{}", help="JSON options for fxbackend")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=20, help="ops shown by name")
    ap.add_argument("--shapes", action="store_true", help="ops keyed by input shapes too")
    ap.add_argument("--steps", type=int, default=0,
                    help="also fxbackend's per-step profile with this many costliest steps")
    args = ap.parse_args()
    import fxbackend  # noqa: F401  (registers the backend)
    from fxbackend import models
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        ap.error(f"--dtype: not a torch dtype: {args.dtype!r}")
    try:
        options = json.loads(args.fxbackend_options)
    except json.JSONDecodeError as e:
        ap.error(f"--fxbackend-options: not JSON ({e})")
    backends = [b for b in args.backends.split(",") if b]
    bad = [b for b in backends if b not in ("eager", "inductor", "fxbackend")]
    if bad or not backends:
        ap.error(f"--backends: expected eager, inductor or fxbackend, got {bad or 'none'}")
    print(cpu_header())
    print(f"# commit {source_commit()}; {args.family}/{args.size} {args.dtype}, "
          f"{args.calls} profiled calls after {args.warmup}, fxbackend options {options}")
    model = models.build_model(args.family, args.size, dtype=dtype)
    inputs = models.make_inputs(args.family, args.size, dtype=dtype)
    results = {}
    for b in backends:
        torch._dynamo.reset()
        results[b] = op_times(_compiled(b, model, options), inputs, args.calls, args.warmup,
                              args.shapes)
    print("\n".join(side_by_side(results, args.top)))
    if args.steps:
        print()
        print(fxbackend_steps(model, inputs, options, args.calls, args.warmup, args.steps))


if __name__ == "__main__":
    main()
