#!/usr/bin/env python3
"""Benchmark the ``scale_cast`` fusion on the CPU: eager, Inductor and the numba kernel.

The function timed is a scale then a cast to 16 bits, as a pipeline writes it when it hands a
float32 tensor to a half-precision consumer (e.g. ``(latents * scaling_factor).to(dtype)``)::

    (x * c).to(torch.bfloat16)        and        (x * c).to(torch.float16)

with x float32 and c a Python number; shapes from :data:`CONFIGS` (real configs at 1024x1024).
Implementations, timed in ``--rounds`` rounds interleaved across them (load changes on a shared
machine hit all alike), ``--calls`` calls per round after ``--warmup`` (the timing loop is
``_time_impls`` of ``scripts/bench_rope.py``); the reported time is the median of every timed
call:

* ``eager``: the function above (it writes and re-reads a float32 intermediate);
* ``inductor``: ``torch.compile`` (default Inductor) of the same function (compiled first, its
  compile time reported);
* ``kernel``: the CPU kernel object registered for the ``scale_cast`` rule
  (``ScaleCastCPU``, found through ``fxbackend.fusion.fusions_for("cpu")``), compiled as the
  plan compiles it and ``run(x, out, c=c)`` as the fused step calls it, into a fresh ``out``
  per call as eager's and Inductor's functions allocate theirs (the goals' column);
  ``kernel_prealloc`` into one preallocated ``out`` (information: a large fresh output costs
  its page faults on every side, 64 MB for the VAE row, where one written a call ago does
  not, which made this column up to twice as fast as Inductor's function there);
* ``fxbackend``: ``torch.compile(backend="fxbackend")`` of the same function (the rule fires:
  ``fxbackend.stats()["fusions_by_rule"]`` is printed; includes the executor and a fresh output
  per call, as eager and Inductor allocate theirs).

Achieved bandwidth: ``(bytes of x read once + out written once) / time`` (the minimum
traffic).  Ratios: eager / kernel and inductor / kernel (>1: the kernel is faster).  Goals: the
fused kernel faster than eager and not slower than Inductor.

Run (from the repository root)::

    .venv/bin/python scripts/bench_scale_cast.py
    .venv/bin/python scripts/bench_scale_cast.py --threads 1
    .venv/bin/python scripts/bench_scale_cast.py --configs flux --out-dtypes bfloat16 --rounds 3

Raw numbers go to ``--json`` (default ``bench_results/bench_scale_cast.json``).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import torch

from bench_rope import _time_impls, report_header  # scripts/ is sys.path[0] when this script runs

#: name -> (x shape, c, model): float32 activations scaled then cast to 16 bits
CONFIGS = {
    "flux": ((1, 4096, 3072), 0.3611, "Flux.1 latents/hidden, 1024x1024 (4096 tok x 3072)"),
    "sd3": ((1, 4096, 1536), 1.5305, "SD3-medium hidden, 1024x1024 (4096 tok x 1536)"),
    "vae_dec": ((1, 128, 512, 512), 0.18215, "VAE decoder activation (128 ch at 512x512)"),
}
IMPLS = ("eager", "inductor", "kernel", "kernel_prealloc", "fxbackend")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--out-dtypes", nargs="*", default=["bfloat16", "float16"],
                   choices=["bfloat16", "float16"], help="the cast's target dtypes")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=5, help="timed calls per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch (and numba) threads")
    p.add_argument("--no-inductor", action="store_true")
    p.add_argument("--json", default=os.path.join("bench_results", "bench_scale_cast.json"))
    return p.parse_args(argv)


def make_fn(c: float, out_dtype: torch.dtype):
    """``(x * c).to(out_dtype)`` with c and the dtype baked in (constants to dynamo, as a
    model's scaling factor is)."""
    def scale_cast(x):
        return (x * c).to(out_dtype)
    return scale_cast


def registered_kernel():
    """The kernel object the ``scale_cast`` rule runs on the CPU."""
    import fxbackend
    from fxbackend.fusion import fusions_for
    rule = next((r for r in fusions_for("cpu") if r.name == "scale_cast"), None)
    if rule is None:
        sys.exit(f"no scale_cast rule registered for cpu (fxbackend {fxbackend.__file__})")
    return rule.impl


def bench_config(name, out_dtype, args) -> dict:
    import fxbackend

    shape, c, model = CONFIGS[name]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    out = torch.empty(shape, dtype=out_dtype)
    fn = make_fn(c, out_dtype)
    kernel = registered_kernel()
    res = {"config": name, "model": model, "shape": list(shape), "c": c,
           "out_dtype": str(out_dtype).replace("torch.", ""), "kernel_impl": kernel.name,
           "compile_s": {}}
    why = kernel.why_not(fxbackend.TensorMeta.of(x), fxbackend.TensorMeta.of(out))
    if why is not None:
        sys.exit(f"{kernel.name} declines {name}: {why}")
    t0 = time.perf_counter()
    kernel.compile(fxbackend.TensorMeta.of(x), fxbackend.TensorMeta.of(out))
    kernel.run(x, out, c=c)
    res["compile_s"]["kernel_first_call"] = time.perf_counter() - t0

    def run_kernel():
        o = torch.empty(shape, dtype=out_dtype)
        kernel.run(x, o, c=c)
        return o

    def run_kernel_prealloc():
        kernel.run(x, out, c=c)
        return out

    impls = {"eager": lambda: fn(x)}
    with torch.no_grad():
        torch._dynamo.reset()  # one code object for every config: no stale/automatic-dynamic
        if not args.no_inductor:
            ind = torch.compile(fn, dynamic=False)
            t0 = time.perf_counter()
            ind(x)
            res["compile_s"]["inductor"] = time.perf_counter() - t0
            impls["inductor"] = lambda: ind(x)
        impls["kernel"] = run_kernel
        impls["kernel_prealloc"] = run_kernel_prealloc
        fxb = torch.compile(fn, backend="fxbackend", dynamic=False)
        fxbackend.reset_stats()
        t0 = time.perf_counter()
        fxb(x)
        res["compile_s"]["fxbackend"] = time.perf_counter() - t0
        res["fxbackend_fusions"] = dict(fxbackend.stats()["fusions_by_rule"])
        impls["fxbackend"] = lambda: fxb(x)
        want = fn(x).float()
        # bit-exact is the contract (patterns/scale_cast.py): report the max abs difference
        res["max_abs_diff"] = {k: (f().float() - want).abs().max().item()
                               for k, f in impls.items()}
        _time_impls(res, impls, args, (x, out))
    return res


def main(argv=None) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchstats import cpu_header
    print(cpu_header())
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = report_header(results=[])
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.configs:
        for dt in args.out_dtypes:
            r = bench_config(name, getattr(torch, dt), args)
            report["results"].append(r)
            print(f"done {name} -> {dt}: " + ", ".join(
                f"{k} {v:.2f} ms" for k, v in r["median_ms"].items()), file=sys.stderr)
            out.write_text(json.dumps(report, indent=1))  # after each config: partial runs kept
    print_table(report)
    print(f"raw numbers: {out}")
    return 0


def print_table(report) -> None:
    print(f"\nscale_cast (x float32 * c -> 16 bits), CPU, {report['threads']} threads, "
          f"torch {report['torch']}; median ms (GB/s: x read + out written)")
    print(f"{'config':8s} {'shape':>16s} {'out':>8s} " + "".join(f"{k:>19s}" for k in IMPLS) +
          f"{'eager/kern':>11s}{'ind/kern':>9s}  goals")
    for r in report["results"]:
        row = [f"{r['median_ms'][k]:9.2f} ({r['gbps'][k]:5.1f})" if k in r["median_ms"]
               else "-" for k in IMPLS]
        se, si = r["speedup_vs_eager"], r.get("speedup_vs_inductor")
        goals = ("faster than eager " + ("MET" if se > 1 else "NOT met") +
                 ", not slower than inductor " +
                 ("not measured" if si is None else "MET" if si >= 1 else "NOT met"))
        print(f"{r['config']:8s} {'x'.join(map(str, r['shape'])):>16s} {r['out_dtype']:>8s} " +
              "".join(f"{cell:>19s}" for cell in row) + f"{se:10.2f}x" +
              (f"{si:8.2f}x" if si is not None else f"{'-':>9s}") + f"  {goals}")
    for r in report["results"]:
        cs = r["compile_s"]
        print(f"  {r['config']} -> {r['out_dtype']}: fusions_by_rule {r['fxbackend_fusions']}; "
              f"max |diff| vs eager " + ", ".join(f"{k} {v:g}" for k, v in
                                                  r["max_abs_diff"].items()) +
              "; compile " + ", ".join(f"{k} {v:.2f} s" for k, v in cs.items()))


if __name__ == "__main__":
    sys.exit(main())
