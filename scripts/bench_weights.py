#!/usr/bin/env python3
"""What keeping weight-derived values current costs (``fxbackend.weights``).

Two measurements, one model config each (``fxbackend.models``):

* ``--check``: the per-call cost of the weight check.  Every call of a plan with weight-derived
  steps (channels-last weight copies, casts, W8A8's quantized weights) computes the key of each
  weight they read, a fingerprint of its bytes.  The script compiles the model, warms it up,
  then times ``--repeat`` calls while summing the seconds spent in ``weights.weight_key``;
  it prints the median call, the check's seconds per call, their ratio and the bytes
  fingerprinted per call.
* ``--freeze``: the per-call price of the check as a whole: the model against a copy whose
  weights ``fxbackend.freeze_weights`` marked (keys by version counter, no fingerprint),
  compiled alike and called in ``--repeat`` interleaved rounds; the paired ratio.
* ``--memory``: resident memory of one backend after compiling and running the model at
  ``--resolutions`` (one child process per backend: eager, inductor, fxbackend), as the growth of
  the process's RSS over the built model, and for fxbackend the bytes the shared cells hold
  (``weights.held_bytes``: one copy per derived value for all resolutions).

Run (from the repository root)::

    .venv/bin/python scripts/bench_weights.py --check --family unet --dtype bfloat16
    .venv/bin/python scripts/bench_weights.py --check --family flux --options quantize=w8a8
    .venv/bin/python scripts/bench_weights.py --freeze --family unet --dtype bfloat16 --repeat 20
    .venv/bin/python scripts/bench_weights.py --memory --family unet --dtype bfloat16
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch


def _options(pairs: list[str]) -> dict:
    out = {}
    for p in pairs:
        k, _, v = p.partition("=")
        out[k] = v
    return out


def check(args) -> None:
    import fxbackend
    from fxbackend import executor, models, weights
    dtype = getattr(torch, args.dtype)
    model = models.build_model(args.family, args.size, dtype=dtype)
    inputs = models.make_inputs(args.family, args.size, dtype=dtype)
    spent = [0.0, 0, 0]  # seconds, calls, bytes

    real = weights.weight_key

    def timed(t):
        t0 = time.perf_counter()
        k = real(t)
        spent[0] += time.perf_counter() - t0
        spent[1] += 1
        spent[2] += t.numel() * t.element_size()
        return k
    weights.weight_key = timed
    executor.weights.weight_key = timed  # the name the generated step functions call
    import fxbackend.patterns.int8 as int8
    int8.weight_key = timed
    with torch.no_grad():
        c = torch.compile(model, backend="fxbackend", options=_options(args.options))
        for _ in range(2):
            c(**inputs)
        spent[:] = [0.0, 0, 0]
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            c(**inputs)
            times.append(time.perf_counter() - t0)
    call = statistics.median(times)
    per_call = spent[0] / args.repeat
    print(json.dumps({"model": f"{args.family}/{args.size}", "dtype": args.dtype,
                      "options": args.options, "median_call_ms": round(call * 1e3, 2),
                      "check_ms_per_call": round(per_call * 1e3, 3),
                      "check_share": round(per_call / call, 4),
                      "keys_per_call": spent[1] // args.repeat,
                      "bytes_per_call": spent[2] // args.repeat}))


def freeze_ab(args) -> None:
    """The model checked by fingerprint (the default) against a copy whose weights
    ``fxbackend.freeze_weights`` marked, each compiled once, called in ``--repeat`` interleaved
    rounds: medians and the paired ratio (checked over frozen: >1, frozen is faster)."""
    import copy

    import fxbackend
    from benchstats import describe, verdict
    from fxbackend import models
    dtype = getattr(torch, args.dtype)
    checked = models.build_model(args.family, args.size, dtype=dtype)
    frozen = copy.deepcopy(checked)
    fxbackend.freeze_weights(frozen)
    inputs = models.make_inputs(args.family, args.size, dtype=dtype)
    fns, outs = {}, {}
    with torch.no_grad():
        for name, model in (("checked", checked), ("frozen", frozen)):
            torch._dynamo.reset()
            fns[name] = torch.compile(model, backend="fxbackend", options=_options(args.options))
            outs[name] = fns[name](**inputs)[0]
            fns[name](**inputs)
        times = {k: [] for k in fns}
        for _ in range(args.repeat):
            for k, f in fns.items():
                t0 = time.perf_counter()
                f(**inputs)
                times[k].append((time.perf_counter() - t0) * 1e3)
    print(json.dumps({"model": f"{args.family}/{args.size}", "dtype": args.dtype,
                      "options": args.options, "rounds": args.repeat,
                      "median_ms": {k: round(statistics.median(v), 2) for k, v in times.items()},
                      "checked_over_frozen": describe(verdict(times, "checked", "frozen")),
                      "same_output": bool(torch.equal(outs["checked"], outs["frozen"]))}))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_child(args) -> None:
    import gc
    import fxbackend
    from fxbackend import models
    try:
        from fxbackend import weights
    except ImportError:  # a version before fxbackend.weights: nothing to count
        weights = None
    dtype = getattr(torch, args.dtype)
    model = models.build_model(args.family, args.size, dtype=dtype)
    res = [tuple(int(x) for x in r.split("x")) for r in args.resolutions.split(",")]
    all_inputs = [models.make_inputs(args.family, args.size, resolution=r, dtype=dtype)
                  for r in res]
    with torch.no_grad():
        model(**all_inputs[0])  # eager's one-time allocations, for every backend alike
        gc.collect()
        base = _rss()
        f = model if args.backend == "eager" else torch.compile(model, backend=args.backend)
        for kw in all_inputs:
            f(**kw)
            f(**kw)
        gc.collect()
        grown = _rss() - base
    held = weights.held_bytes() if args.backend == "fxbackend" and weights else None
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"backend": args.backend, "resolutions": args.resolutions,
                      "rss_growth_mb": round(grown / 2**20, 1),
                      "derived_held_mb": None if held is None else round(held / 2**20, 2),
                      "weights_mb": round(params / 2**20, 2)}))


def memory(args) -> None:
    for backend in args.backends.split(","):
        cmd = [sys.executable, __file__, "--memory-child", "--backend", backend,
               "--family", args.family, "--size", args.size, "--dtype", args.dtype,
               "--resolutions", args.resolutions]
        r = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        print(lines[-1] if lines else f"{backend}: failed\n{r.stderr[-2000:]}", flush=True)


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchstats import cpu_header
    print(cpu_header())
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--freeze", action="store_true",
                    help="time the model against a copy under fxbackend.freeze_weights")
    ap.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", default="fxbackend", help=argparse.SUPPRESS)
    ap.add_argument("--backends", default="eager,inductor,fxbackend")
    ap.add_argument("--family", default="unet")
    ap.add_argument("--size", default="small")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--options", nargs="*", default=[], help="backend options, key=value")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--resolutions", default="40x40,36x36,32x48,48x48")
    args = ap.parse_args()
    if args.memory_child:
        memory_child(args)
        return
    if args.check:
        check(args)
    if args.freeze:
        freeze_ab(args)
    if args.memory:
        memory(args)


if __name__ == "__main__":
    main()
