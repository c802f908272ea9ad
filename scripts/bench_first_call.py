#!/usr/bin/env python3
"""First call of a compiled model in a new process, with an empty or a given kernel cache.

For each selected model (``--families``, size ``small``) and each ``--dtypes`` entry (plus
``--w8a8``: float32 with ``quantize="w8a8"``), a child process builds the model, pays
``fxbackend.warm_up()`` (untimed), and times the first call of ``torch.compile(model,
backend="fxbackend")``: Dynamo, the plan and the kernels it compiles or loads, and one run.
``--cache empty`` gives every child a fresh kernel cache (``NUMBA_CACHE_DIR`` and
``TRITON_CACHE_DIR`` in a new temporary folder: every kernel compiles); ``--cache DIR`` uses
``DIR`` for every child, e.g. one filled by ``python -m fxbackend precompile`` with the same
``NUMBA_CACHE_DIR``.  Prints the CPU profile, then one line per model: seconds, and how many
kernels numba compiled and saved to the cache in that call (in the process or its compile
workers: ``FXB_COMPILE_PROCESSES``, ``cpu_kernels/_workers.py``) and how many of the kernels'
compile calls ran in a worker.

Run (from the repository root)::

    .venv/bin/python scripts/bench_first_call.py --cache empty --families flux,unet --w8a8
    NUMBA_CACHE_DIR=/tmp/k .venv/bin/python -m fxbackend precompile
    .venv/bin/python scripts/bench_first_call.py --cache /tmp/k --families flux,unet --w8a8
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_CHILD = """
import json, os, sys, time, torch, fxbackend
from fxbackend import models
from fxbackend.cpu_kernels import _workers
family, dtype, options = sys.argv[1], getattr(torch, sys.argv[2]), json.loads(sys.argv[3])
def saved():  # numba's compiled kernels in the cache folder, by this process or its workers
    return {os.path.join(d, n) for d, _, names in os.walk(os.environ["NUMBA_CACHE_DIR"])
            for n in names if n.endswith(".nbc")}
model = models.build_model(family, "small", dtype=dtype)
inputs = models.make_inputs(family, "small", dtype=dtype)
fxbackend.warm_up("cpu")
before = saved()
compiled = torch.compile(model, backend="fxbackend", options=options)
with torch.no_grad():
    t0 = time.perf_counter()
    compiled(**inputs)
    first = time.perf_counter() - t0
print(json.dumps({"first_call_s": first, "kernels_compiled": len(saved() - before),
                  "in_workers": _workers.counts()["workers"]}))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", required=True,
                   help="'empty' (a fresh kernel cache per child) or a kernel cache folder")
    p.add_argument("--families", default="flux,sd3,unet")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--w8a8", action="store_true", help="also float32 with quantize=w8a8")
    args = p.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchstats import cpu_header
    print(cpu_header(), flush=True)
    if args.cache != "empty" and not os.path.isdir(args.cache):
        p.error(f"--cache {args.cache!r}: not a folder (or 'empty')")
    runs = [(f, d, {}) for f in args.families.split(",") for d in args.dtypes.split(",")]
    if args.w8a8:
        runs += [(f, "float32", {"quantize": "w8a8"}) for f in args.families.split(",")]
    for family, dtype, options in runs:
        with tempfile.TemporaryDirectory() as fresh:
            cache = fresh if args.cache == "empty" else args.cache
            env = dict(os.environ, NUMBA_CACHE_DIR=cache,
                       TRITON_CACHE_DIR=os.path.join(cache, "triton"))
            run = subprocess.run([sys.executable, "-c", _CHILD, family, dtype,
                                  json.dumps(options)], env=env, cwd=root, capture_output=True,
                                 text=True)
        name = f"{family}/{dtype}" + ("/w8a8" if options else "")
        if run.returncode != 0:
            print(f"{name}: ERROR {run.stderr.strip().splitlines()[-1:]}", flush=True)
            continue
        got = json.loads(run.stdout.strip().splitlines()[-1])
        print(f"{name}: first call {got['first_call_s']:.1f} s, kernels compiled "
              f"{got['kernels_compiled']} ({got['in_workers']} compile calls in worker "
              f"processes; cache: {args.cache})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
