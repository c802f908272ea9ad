#!/usr/bin/env python3
"""Benchmark fxbackend against eager, Inductor and aot_eager on the diffusers model table.

What it measures, for every selected model config of :data:`fxbackend.models.MODEL_CONFIGS`
(default: every family at size ``small``) and every selected backend (default ``eager``,
``inductor``, ``aot_eager``, ``fxbackend``):

* **first call**: wall time of the first call of ``torch.compile(model, backend=...)`` with
  Dynamo's caches reset just before (``torch._dynamo.reset()``), i.e. trace + compile + one run.
  For ``eager`` it is the first plain call of the freshly built model.
* **steady**: median wall time of ``--repeat`` (default 10) calls after ``--warmup`` (default 2)
  warm-up calls; ``--quick`` makes that 3 after 1.  When several backends are selected, the
  table's steady times (and the ratios) come from a second phase in which every backend,
  compiled again, is called once per round for ``--repeat`` rounds in a rotating order, so that
  a shared machine's changing load falls on all of them alike; each backend's own block of
  calls stays in the JSON as ``steady_ms_block`` (``--no-interleave``: use the blocks).  On CUDA each call is timed with CUDA events.
* **eager_fp32** (with ``--dtype bfloat16`` or ``float16``): the same model and inputs in
  float32, run eagerly: the float32 time a 16-bit model is compared with, side by side
  (``f32eager/fxb``); its max error is float32's distance from 16-bit eager.
* **max error** against eager: ``max|out - ref| / max|ref|`` (computed in float32), where
  ``ref`` is eager's output of an identically seeded model on the same inputs.
* **memory**: on CUDA ``torch.cuda.max_memory_allocated`` (after ``reset_peak_memory_stats``)
  for the first call and for the steady-state calls.  On CPU a process's peak RSS is too noisy
  to attribute, so only fxbackend reports memory, from ``fxbackend.stats()`` (reset before
  compiling): the arena bytes and the sum of the intermediates' bytes of the plans it built.

Everything runs under ``torch.no_grad()``.  Before anything is timed, every selected backend
compiles and runs a trivial function once, so Dynamo's (and each backend's) one-time import and
initialisation cost does not land on the first model; for fxbackend that includes
``fxbackend.warm_up()``, the start-up of its kernel runtimes (numba's import and JIT set-up on
the CPU, about 0.3 s per process), which a server calls once at start-up.  Inductor runs with a cold cache: a fresh
temporary ``TORCHINDUCTOR_CACHE_DIR`` for the whole run (set before torch is imported, removed
at exit); ``--inductor-warm`` keeps the default (or the environment's) cache instead.

**kernel caches**: fxbackend compiles its numba (CPU) and Triton (CUDA) kernels at plan time
and caches them on disk.  For every model, unless ``--no-kernel-cache-runs``, two child
processes share one fresh, empty kernel-cache folder (``NUMBA_CACHE_DIR`` and
``TRITON_CACHE_DIR``): each pays Dynamo's start-up as above and traces the model once with
Dynamo's ``eager`` backend (untimed), then times aot_eager's first call and fxbackend's.  In
the first child fxbackend's caches are cold (every kernel compiles), in the second they are
warm (loaded from disk), as in a new process on a deployed machine.  The table shows
fxbackend's first call over aot_eager's for both (``1st cold`` / ``1st warm``), and for the
warm child also with ``fxbackend.warm_up()``'s seconds added to the first call (``warm+su``:
a process that compiles without warming up first).  In the main
process the kernels compiled for one model stay loaded for the next.

``--dynamic`` compiles with ``dynamic=True`` and, after the main (first) resolution, also calls
the model at the config's second resolution and reports that call's time and max error.

Prints one table at the end and writes every raw number (and any backend's error with its
traceback) to ``--json`` (default ``bench_results/bench.json``, rewritten after every model).

Run (from the repository root)::

    .venv/bin/python scripts/bench.py                      # every family, size small, all backends
    .venv/bin/python scripts/bench.py --sizes tiny --repeat 3
    .venv/bin/python scripts/bench.py --families flux,sd3 --backends eager,fxbackend --quick
    .venv/bin/python scripts/bench.py --sizes tiny --dynamic
    .venv/bin/python scripts/bench.py --threads 1               # stable numbers on a busy CPU
    .venv/bin/python scripts/bench.py --device cuda --dtype bfloat16

Duration on the 2-core CPU development machine: the default run (4 small models x 4 backends,
cold Inductor cache) took about 3.5 minutes on a lightly loaded machine and about 12.5 minutes
with other jobs running (load average ~5); Inductor's cold C++ compiles are most of it (about
8-56 s per small model when quiet, up to ~90 s under load).  ``--backends
eager,aot_eager,fxbackend`` skips them (well under a minute for the small models).

Noise: timings are wall-clock.  On a shared 2-core machine torch's default 2 intra-op threads
stall whenever another process holds a core, which makes single calls 10-50x slower at random;
``--threads 1`` gives stable (if slower) numbers there.  The JSON keeps every call's time, the
median and the minimum, and the load average after each backend.
"""
from __future__ import annotations

import argparse
import atexit
import datetime
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback

ALL_BACKENDS = ("eager", "eager_fp32", "inductor", "aot_eager", "fxbackend")
#: backends that are no torch.compile backend: the model run as it is
EAGER = ("eager", "eager_fp32")
DTYPES = ("float32", "bfloat16", "float16")


def parse_args(argv=None):
    """Parse the command line (before torch is imported, so the Inductor cache dir can be set)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="small",
                   help="comma-separated model sizes (tiny, small); default: small")
    p.add_argument("--families", default=None,
                   help="comma-separated model families (flux, sd3, pixart, unet, wan, sdxl, vae); "
                        "default: all")
    p.add_argument("--device", default=None, choices=("cpu", "cuda"),
                   help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--repeat", type=int, default=None,
                   help="steady-state calls to time (default 10, or 3 with --quick)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed calls before the steady-state ones (default 2, or 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="fewer repeats (3) and warm-ups (1)")
    p.add_argument("--backends", default=None,
                   help=f"comma-separated subset of {','.join(ALL_BACKENDS)}; default: all "
                        f"(eager_fp32 only with a 16-bit --dtype)")
    p.add_argument("--json", default=os.path.join("bench_results", "bench.json"),
                   help="where to write the raw results (default bench_results/bench.json)")
    p.add_argument("--dynamic", action="store_true",
                   help="compile with dynamic=True and also run the config's second resolution")
    p.add_argument("--inductor-warm", action="store_true",
                   help="use the default/existing Inductor cache instead of a fresh temporary one")
    p.add_argument("--fxbackend-options", default="{}",
                   help='JSON dict passed as torch.compile(options=...) to fxbackend, e.g. '
                        '\'{"fusion": false}\'')
    p.add_argument("--seed", type=int, default=0, help="weights and inputs seed (default 0)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: leave torch's default)")
    p.add_argument("--no-interleave", action="store_true",
                   help="report each backend's own block of steady calls instead of the "
                        "interleaved rounds")
    p.add_argument("--no-kernel-cache-runs", action="store_true",
                   help="skip the per-model child processes that time first calls with cold "
                        "and warm kernel caches")
    p.add_argument("--child-first-call", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.backends is None:
        args.backends = ",".join(b for b in ALL_BACKENDS
                                 if b != "eager_fp32" or args.dtype != "float32")
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in args.backends if b not in ALL_BACKENDS]
    if bad or not args.backends:
        p.error(f"unknown backend(s) {bad}; choose from {','.join(ALL_BACKENDS)}")
    # eager runs first: its first-call output is the reference of the others
    args.backends = sorted(dict.fromkeys(args.backends), key=ALL_BACKENDS.index)
    if args.repeat is None:
        args.repeat = 3 if args.quick else 10
    if args.warmup is None:
        args.warmup = 1 if args.quick else 2
    if args.repeat < 1 or args.warmup < 0:
        p.error("--repeat must be >= 1 and --warmup >= 0")
    args.sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    args.families = (None if args.families is None
                     else [f.strip() for f in args.families.split(",") if f.strip()])
    try:
        args.fxbackend_options = json.loads(args.fxbackend_options)
        assert isinstance(args.fxbackend_options, dict)
    except (ValueError, AssertionError):
        p.error("--fxbackend-options must be a JSON object")
    return args


def setup_inductor_cache(warm):
    """Point Inductor at a fresh temporary cache dir (unless ``warm``); returns (mode, dir)."""
    if warm:
        return "warm", os.environ.get("TORCHINDUCTOR_CACHE_DIR", "(default)")
    d = tempfile.mkdtemp(prefix="fxb_bench_inductor_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = d
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    return "cold", d


ARGS = parse_args() if __name__ == "__main__" else None
CACHE_MODE, CACHE_DIR = setup_inductor_cache(ARGS.inductor_warm) if ARGS else ("warm", None)

import torch  # noqa: E402  (after TORCHINDUCTOR_CACHE_DIR is set)
import torch._dynamo  # noqa: E402

import fxbackend  # noqa: E402
from fxbackend.models import MODEL_CONFIGS, build_model, families, make_inputs  # noqa: E402


# -- timing helpers -------------------------------------------------------------------------

def sync(device):
    """Wait for the device's queued work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def first_output(out):
    """The first tensor of a model's output (diffusers returns a tuple with return_dict=False)."""
    while isinstance(out, (tuple, list)):
        out = out[0]
    return out


def timed_call(fn, device):
    """Run ``fn()`` once; return ``(output, seconds)`` of wall time including device sync."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def steady_times_ms(fn, device, repeat):
    """Time ``repeat`` calls of ``fn`` (CUDA events on CUDA); returns (last output, [ms])."""
    times, out = [], None
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return out, times


def rel_err(out, ref):
    """``max|out - ref| / max|ref|`` in float32 (inf on a shape mismatch)."""
    out, ref = first_output(out), first_output(ref)
    if out.shape != ref.shape:
        return float("inf")
    out, ref = out.detach().float(), ref.detach().float()
    denom = ref.abs().max().item()
    return (out - ref).abs().max().item() / (denom if denom > 0 else 1.0)


def loadavg():
    """The 1/5/15-minute load averages (None where the OS has none): context for noisy timings."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


# -- start-up ---------------------------------------------------------------------------------

#: seconds of each of fxbackend's runtime warm-ups (``fxbackend.warm_up``) in this process
RUNTIME_WARM_UP = {}


def warm_up_backends(backends, device, dtype, fxb_options):
    """Pay one-time costs before timing: Dynamo's initialisation (a trivial aot_eager compile),
    each selected backend's imports and set-up (a trivial compile with it; for fxbackend also
    ``fxbackend.warm_up``, the start-up of its kernel runtimes, recorded in
    :data:`RUNTIME_WARM_UP`), and eager's kernel libraries (a linear, a conv and an attention
    on ``device``/``dtype``).  Returns seconds."""
    t0 = time.perf_counter()
    if "fxbackend" in backends:
        import fxbackend
        RUNTIME_WARM_UP.update(fxbackend.warm_up(device.type))

    def trivial(x, w):
        return torch.nn.functional.gelu(x @ w).sin() + 1.0

    x = torch.randn(8, 16, device=device, dtype=dtype)
    w = torch.randn(16, 16, device=device, dtype=dtype)
    with torch.no_grad():
        torch.nn.functional.conv2d(torch.randn(1, 4, 8, 8, device=device, dtype=dtype),
                                   torch.randn(4, 4, 3, 3, device=device, dtype=dtype), padding=1)
        q = torch.randn(1, 2, 8, 16, device=device, dtype=dtype)
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
        trivial(x, w)
        for b in dict.fromkeys(["aot_eager"] + [b for b in backends if b not in EAGER]):
            torch._dynamo.reset()
            kw = {"options": fxb_options} if b == "fxbackend" and fxb_options else {}
            try:
                torch.compile(trivial, backend=b, **kw)(x, w)
            except Exception as e:  # reported again, per model, when it matters
                print(f"warm-up of backend {b} failed: {type(e).__name__}: {e}", file=sys.stderr)
    sync(device)
    torch._dynamo.reset()
    return time.perf_counter() - t0


# -- one backend on one model -----------------------------------------------------------------

def fxb_stats_snapshot():
    """The fxbackend counters worth keeping (the per-kernel step counts included)."""
    s = fxbackend.stats()
    return {k: v for k, v in s.items()}


def run_backend(backend, family, size, args, device, dtype, refs):
    """Build the model and inputs, compile with ``backend``, and measure it.

    ``refs`` holds eager reference outputs by resolution (filled by the eager backend, or
    computed here when eager is not selected).  Returns the result dict (raw numbers)."""
    res = {"backend": backend}
    entry = MODEL_CONFIGS[(family, size)]
    resolutions = [tuple(r) for r in entry["inputs"]["resolutions"]]
    res1 = resolutions[0]
    res2 = resolutions[1] if len(resolutions) > 1 else None

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    dtype = backend_dtype(backend, dtype)
    model = build_model(family, size, dtype=dtype, device=device, seed=args.seed)
    inputs = make_inputs(family, size, resolution=res1, dtype=dtype, device=device, seed=args.seed)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    if backend == "fxbackend":
        fxbackend.reset_stats()
    if backend in EAGER:
        fn_model = model
    else:
        kw = {"options": args.fxbackend_options} if backend == "fxbackend" and \
            args.fxbackend_options else {}
        fn_model = torch.compile(model, backend=backend, dynamic=True if args.dynamic else None,
                                 **kw)

    def call():
        return fn_model(**inputs)

    try:
        with torch.no_grad():
            if device.type == "cuda":
                sync(device)
                torch.cuda.reset_peak_memory_stats(device)
                res["mem_baseline_bytes"] = torch.cuda.memory_allocated(device)
            out, res["first_call_s"] = timed_call(call, device)
            if device.type == "cuda":
                res["peak_mem_first_bytes"] = torch.cuda.max_memory_allocated(device)
            if backend == "eager":
                refs[res1] = first_output(out).detach().clone()
            elif res1 not in refs:
                refs[res1] = reference(family, size, res1, args, device, dtype)
            err_first = rel_err(out, refs[res1])
            del out
            for _ in range(args.warmup):
                call()
            if device.type == "cuda":
                sync(device)
                torch.cuda.reset_peak_memory_stats(device)
            out, times = steady_times_ms(call, device, args.repeat)
            if device.type == "cuda":
                res["peak_mem_steady_bytes"] = torch.cuda.max_memory_allocated(device)
            res["steady_ms_all"] = times
            res["steady_ms"] = statistics.median(times)
            res["steady_ms_min"] = min(times)  # less sensitive to other load than the median
            res["max_err"] = max(err_first, rel_err(out, refs[res1]))
            res["max_err_first_call"] = err_first
            res["out_shape"] = list(first_output(out).shape)
            del out
            counters = torch._dynamo.utils.counters
            res["dynamo_unique_graphs"] = counters["stats"].get("unique_graphs", 0)
            res["graph_breaks"] = sum(counters["graph_break"].values())
            if counters["graph_break"]:
                res["graph_break_reasons"] = {k: v for k, v in counters["graph_break"].items()}
            if backend == "fxbackend":
                st = fxb_stats_snapshot()
                res["fxbackend_stats"] = st
                res["arena_bytes"] = st["arena_bytes"]
                res["intermediate_bytes"] = st["intermediate_bytes"]
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
        return res

    if args.dynamic and res2 is not None:
        res["resolution2"] = list(res2)
        try:
            with torch.no_grad():
                inputs = make_inputs(family, size, resolution=res2, dtype=dtype, device=device,
                                     seed=args.seed)
                out2, res["first_call_res2_s"] = timed_call(call, device)
                if backend == "eager":
                    refs[res2] = first_output(out2).detach().clone()
                elif res2 not in refs:
                    refs[res2] = reference(family, size, res2, args, device, dtype)
                res["max_err_res2"] = rel_err(out2, refs[res2])
                del out2
                _, t2 = steady_times_ms(call, device, max(1, min(3, args.repeat)))
                res["steady_ms_res2"] = statistics.median(t2)
                res["dynamo_unique_graphs_after_res2"] = \
                    torch._dynamo.utils.counters["stats"].get("unique_graphs", 0)
                if backend == "fxbackend":
                    st = fxbackend.stats()
                    res["fxbackend_replans_after_res2"] = st["replans"]
                    res["fxbackend_plans_after_res2"] = st["plans_built"]
        except Exception as e:
            res["error_res2"] = f"{type(e).__name__}: {e}"
            res["traceback_res2"] = traceback.format_exc()
    del fn_model, model, inputs
    torch._dynamo.reset()
    return res


def interleaved_steady(family, size, args, device, dtype, backends):
    """Steady-state times of ``backends`` measured side by side: each is compiled afresh (its
    first call already timed by :func:`run_backend`; later compiles hit warm caches), warmed up,
    then ``args.repeat`` rounds call every backend once, in an order rotated each round, so
    that slow drifts of a shared machine's load land on every backend alike.  Returns
    ``{backend: [ms per round]}`` (a backend that fails here is left out)."""
    res1 = tuple(MODEL_CONFIGS[(family, size)]["inputs"]["resolutions"][0])
    torch._dynamo.reset()
    calls = {}
    with torch.no_grad():
        for b in backends:
            bdtype = backend_dtype(b, dtype)
            inputs = make_inputs(family, size, resolution=res1, dtype=bdtype, device=device,
                                 seed=args.seed)
            model = build_model(family, size, dtype=bdtype, device=device, seed=args.seed)
            kw = {"options": args.fxbackend_options} if b == "fxbackend" and \
                args.fxbackend_options else {}
            fn = model if b in EAGER else torch.compile(
                model, backend=b, dynamic=True if args.dynamic else None, **kw)
            try:
                for _ in range(max(1, args.warmup)):
                    fn(**inputs)
            except Exception as e:  # already reported by run_backend
                print(f"[{family}/{size}] interleaved: {b} left out ({type(e).__name__})",
                      flush=True)
                continue
            calls[b] = (lambda fn=fn, inputs=inputs: fn(**inputs))
        times = {b: [] for b in calls}
        order = list(calls)
        for r in range(args.repeat):
            for b in order[r % len(order):] + order[:r % len(order)]:
                times[b].append(steady_times_ms(calls[b], device, 1)[1][0])
    del calls
    torch._dynamo.reset()
    return times


def backend_dtype(backend, dtype):
    """The dtype ``backend`` runs the model in: float32 for ``eager_fp32`` (the float32 time
    a 16-bit model is compared with), else ``dtype``."""
    return torch.float32 if backend == "eager_fp32" else dtype


def reference(family, size, resolution, args, device, dtype):
    """Eager output of a freshly built (identically seeded) model at ``resolution``."""
    model = build_model(family, size, dtype=dtype, device=device, seed=args.seed)
    inputs = make_inputs(family, size, resolution=resolution, dtype=dtype, device=device,
                         seed=args.seed)
    with torch.no_grad():
        out = first_output(model(**inputs)).detach().clone()
    del model
    return out


# -- first calls with cold and warm kernel caches (child processes) -------------------------

def child_first_call(args):
    """Child mode: time aot_eager's and fxbackend's first call of one model; print JSON."""
    family, size = args.child_first_call.split("/")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    warm_up_backends(["aot_eager", "fxbackend"], device, dtype, args.fxbackend_options)
    res1 = tuple(MODEL_CONFIGS[(family, size)]["inputs"]["resolutions"][0])
    out = {}
    # untimed: one Dynamo trace of this model (backend "eager"), so one-time costs of the
    # model's code (lazy imports, first tracing of its modules) land on neither timed backend
    for b in ("eager", "aot_eager", "fxbackend"):
        model = build_model(family, size, dtype=dtype, device=device, seed=args.seed)
        inputs = make_inputs(family, size, resolution=res1, dtype=dtype, device=device,
                             seed=args.seed)
        torch._dynamo.reset()
        kw = {"options": args.fxbackend_options} if b == "fxbackend" and \
            args.fxbackend_options else {}
        fn = torch.compile(model, backend=b, **kw)
        with torch.no_grad():
            _, t = timed_call(lambda: fn(**inputs), device)
        if b != "eager":
            out[b] = t
        del fn, model
    out["fxbackend_warm_up_s"] = sum(RUNTIME_WARM_UP.values())
    print("CHILD_RESULT " + json.dumps(out), flush=True)


def kernel_cache_runs(family, size, args):
    """Run :func:`child_first_call` twice in fresh processes sharing one new kernel-cache
    folder: cold, then warm.  Returns ``{"cold": {...}, "warm": {...}}`` (or an error)."""
    import subprocess
    folder = tempfile.mkdtemp(prefix="fxb_bench_kernels_")
    env = dict(os.environ, NUMBA_CACHE_DIR=os.path.join(folder, "numba"),
               TRITON_CACHE_DIR=os.path.join(folder, "triton"))
    argv = [sys.executable, os.path.abspath(__file__), "--child-first-call", f"{family}/{size}",
            "--dtype", args.dtype, "--seed", str(args.seed),
            "--fxbackend-options", json.dumps(args.fxbackend_options)]
    if args.device:
        argv += ["--device", args.device]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    out = {}
    try:
        for mode in ("cold", "warm"):
            p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("CHILD_RESULT ")),
                        None)
            if p.returncode != 0 or line is None:
                return {"error": f"{mode} child exited {p.returncode}: {p.stderr[-800:]}"}
            out[mode] = json.loads(line[len("CHILD_RESULT "):])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return out


# -- reporting --------------------------------------------------------------------------------

def ratio(a, b):
    """``a / b`` or None when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def model_ratios(backends):
    """The table's ratios from one model's per-backend results (None where unavailable)."""
    def get(b, k):
        r = backends.get(b)
        return None if r is None or "error" in r else r.get(k)
    return {
        "fxbackend_first_over_aot_eager_first": ratio(get("fxbackend", "first_call_s"),
                                                      get("aot_eager", "first_call_s")),
        "eager_steady_over_fxbackend_steady": ratio(get("eager", "steady_ms"),
                                                    get("fxbackend", "steady_ms")),
        "inductor_steady_over_fxbackend_steady": ratio(get("inductor", "steady_ms"),
                                                       get("fxbackend", "steady_ms")),
        "eager_fp32_steady_over_fxbackend_steady": ratio(get("eager_fp32", "steady_ms"),
                                                         get("fxbackend", "steady_ms")),
    }


def cache_ratios(runs):
    """fxbackend first call / aot_eager first call in the cold and the warm child."""
    out = {f"fxbackend_first_over_aot_eager_first_{m}":
           ratio(runs.get(m, {}).get("fxbackend"), runs.get(m, {}).get("aot_eager"))
           for m in ("cold", "warm")}
    warm = runs.get("warm", {})
    fxb, su = warm.get("fxbackend"), warm.get("fxbackend_warm_up_s")
    out["fxbackend_first_plus_warm_up_over_aot_eager_first_warm"] = \
        ratio(None if fxb is None or su is None else fxb + su, warm.get("aot_eager"))
    return out


def fmt(v, spec, missing="-"):
    """Format a number or return ``missing``."""
    return missing if v is None else format(v, spec)


def print_table(results, args, device):
    """Print the one summary table (rows: model configs)."""
    backends = args.backends
    cols = []  # (header group, header, width, getter)

    def be(b, key, spec, scale=1.0):
        def get(row):
            r = row["backends"].get(b)
            if r is None:
                return "-"
            if "error" in r:
                return "error"
            v = r.get(key)
            return fmt(None if v is None else v * scale, spec)
        return get

    for b in backends:
        cols.append((b, "first s", 8, be(b, "first_call_s", ".2f")))
        cols.append((b, "steady ms", 10, be(b, "steady_ms", ".1f")))
        if device.type == "cuda":
            cols.append((b, "peak MB", 8, be(b, "peak_mem_steady_bytes", ".0f", 2 ** -20)))

    def rat(key, spec=".2f"):
        def get(row):
            return fmt(row["ratios"].get(key), spec)
        return get

    cols.append(("ratios", "fxb/aot 1st", 11, rat("fxbackend_first_over_aot_eager_first")))
    if not args.no_kernel_cache_runs and "fxbackend" in backends:
        cols.append(("ratios", "1st cold", 8,
                     rat("fxbackend_first_over_aot_eager_first_cold")))
        cols.append(("ratios", "1st warm", 8,
                     rat("fxbackend_first_over_aot_eager_first_warm")))
        cols.append(("ratios", "warm+su", 7,
                     rat("fxbackend_first_plus_warm_up_over_aot_eager_first_warm")))
    cols.append(("ratios", "eager/fxb", 9, rat("eager_steady_over_fxbackend_steady")))
    cols.append(("ratios", "ind/fxb", 7, rat("inductor_steady_over_fxbackend_steady")))
    if "eager_fp32" in backends:
        cols.append(("ratios", "f32eager/fxb", 12,
                     rat("eager_fp32_steady_over_fxbackend_steady")))
    if "fxbackend" in backends:
        def mem(row):
            r = row["backends"].get("fxbackend", {})
            if "error" in r:
                return "error"
            a, i = r.get("arena_bytes"), r.get("intermediate_bytes")
            return "-" if a is None else f"{a / 2**20:.1f}/{i / 2**20:.1f}"
        cols.append(("fxbackend", "arena/interm MB", 15, mem))
        cols.append(("fxbackend", "max err", 8, be("fxbackend", "max_err", ".1e")))
        if args.dynamic:
            def err2(row):
                r = row["backends"].get("fxbackend", {})
                if "error" in r or "error_res2" in r:
                    return "error"
                return fmt(r.get("max_err_res2"), ".1e")
            cols.append(("fxbackend", "err res2", 8, err2))

    name_w = max([len("model")] + [len(r["model"]) for r in results]) + 2
    widths = [max(w, len(h)) for _, h, w, _ in cols]
    # group header: the group's name over its first column, centred over its span
    groups, line1 = [], " " * name_w
    i = 0
    while i < len(cols):
        j = i
        while j < len(cols) and cols[j][0] == cols[i][0]:
            j += 1
        span = sum(widths[i:j]) + 2 * (j - i - 1)
        line1 += "| " + cols[i][0].center(span) + " "
        groups.append((i, j))
        i = j
    line2 = "model".ljust(name_w)
    for (i, j) in groups:
        line2 += "| " + "  ".join(cols[k][1].rjust(widths[k]) for k in range(i, j)) + " "
    print(line1.rstrip())
    print(line2.rstrip())
    print("-" * len(line2.rstrip()))
    for row in results:
        line = row["model"].ljust(name_w)
        for (i, j) in groups:
            line += "| " + "  ".join(cols[k][3](row).rjust(widths[k]) for k in range(i, j)) + " "
        print(line.rstrip())


def write_json(path, payload):
    """Write ``payload`` to ``path`` atomically (creating its folder)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    os.replace(tmp, path)


def selected_models(args):
    """The (family, size) keys to run, in table order; exits on an unknown name."""
    if not args.families:  # every family that has the size asked for
        return [(f, s) for s in args.sizes for f in families() if (f, s) in MODEL_CONFIGS]
    fams = args.families
    keys = [(f, s) for s in args.sizes for f in fams if (f, s) in MODEL_CONFIGS]
    unknown = [(f, s) for s in args.sizes for f in fams if (f, s) not in MODEL_CONFIGS]
    if unknown:
        sys.exit(f"unknown model config(s) {unknown}; known: {sorted(MODEL_CONFIGS)}")
    return keys


def main(args):
    """Run the benchmark described by ``args``; returns the JSON payload."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchstats import cpu_header, cpu_lines, source_commit
    print(cpu_header())
    t_start = time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    keys = selected_models(args)
    import diffusers

    meta = {
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv, "commit": source_commit(),
        "cpu_profile": cpu_lines(),
        "torch": torch.__version__, "diffusers": diffusers.__version__,
        "python": platform.python_version(), "platform": platform.platform(),
        "device": str(device),
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else platform.processor() or platform.machine()),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "loadavg_start": loadavg(),
        "dtype": args.dtype, "repeat": args.repeat, "warmup": args.warmup,
        "dynamic": args.dynamic, "backends": args.backends, "seed": args.seed,
        "fxbackend_options": args.fxbackend_options,
        "inductor_cache": CACHE_MODE, "inductor_cache_dir": CACHE_DIR,
        "models": [f"{f}/{s}" for f, s in keys],
    }
    print(f"fxbackend bench (commit {meta['commit']}): torch {torch.__version__}, device {device} "
          f"({meta['device_name']}), "
          f"dtype {args.dtype}, {torch.get_num_threads()} threads, repeat {args.repeat} after "
          f"{args.warmup} warm-up(s){', dynamic=True' if args.dynamic else ''}; "
          f"load average {meta['loadavg_start']} on {os.cpu_count()} CPUs")
    if "inductor" in args.backends:
        print(f"inductor cache: {CACHE_MODE}"
              + (f" (fresh temporary TORCHINDUCTOR_CACHE_DIR={CACHE_DIR}, removed at exit)"
                 if CACHE_MODE == "cold" else f" (TORCHINDUCTOR_CACHE_DIR={CACHE_DIR})"))
    la = meta["loadavg_start"]
    if device.type == "cpu" and la and la[0] > (os.cpu_count() or 1) and \
            torch.get_num_threads() > 1:
        print(f"warning: load average {la[0]} exceeds the {os.cpu_count()} CPUs; multi-threaded "
              f"CPU kernels then stall unpredictably (10x swings between calls): consider "
              f"--threads 1 for stable numbers", flush=True)
    meta["warmup_s"] = warm_up_backends(args.backends, device, dtype, args.fxbackend_options)
    meta["fxbackend_runtime_warm_up_s"] = dict(RUNTIME_WARM_UP)
    print(f"start-up warm-up (Dynamo + backends' one-time costs): {meta['warmup_s']:.1f} s"
          + ("; of which fxbackend.warm_up(): " +
             ", ".join(f"{k} {v:.2f} s" for k, v in RUNTIME_WARM_UP.items())
             if RUNTIME_WARM_UP else ""), flush=True)

    results = []
    payload = {"meta": meta, "results": results}
    for family, size in keys:
        row = {"model": f"{family}/{size}", "family": family, "size": size,
               "resolution": list(MODEL_CONFIGS[(family, size)]["inputs"]["resolutions"][0]),
               "backends": {}}
        results.append(row)
        refs = {}
        for b in args.backends:
            t0 = time.perf_counter()
            r = run_backend(b, family, size, args, device, dtype, refs)
            r["wall_s"] = time.perf_counter() - t0
            r["loadavg_after"] = loadavg()
            row["backends"][b] = r
            if "error" in r:
                tail = "\n".join(r["traceback"].strip().splitlines()[-6:])
                print(f"[{row['model']}] {b}: ERROR {r['error'][:300]}\n{tail}", flush=True)
            else:
                msg = (f"[{row['model']}] {b}: first {r['first_call_s']:.2f} s, steady "
                       f"{r['steady_ms']:.1f} ms, max err {r['max_err']:.2e}")
                if r.get("graph_breaks"):
                    msg += f", {r['graph_breaks']} graph break(s)"
                if "peak_mem_steady_bytes" in r:
                    msg += f", peak {r['peak_mem_steady_bytes'] / 2**20:.0f} MB"
                if "arena_bytes" in r:
                    msg += (f", arena {r['arena_bytes'] / 2**20:.1f} MB / intermediates "
                            f"{r['intermediate_bytes'] / 2**20:.1f} MB")
                if "max_err_res2" in r:
                    msg += (f"; res2 {tuple(r['resolution2'])}: first {r['first_call_res2_s']:.2f}"
                            f" s, max err {r['max_err_res2']:.2e}")
                if "error_res2" in r:
                    msg += f"; res2 ERROR {r['error_res2'][:300]}"
                print(msg + f"  [{r['wall_s']:.0f} s]", flush=True)
        ok = [b for b in args.backends if "error" not in row["backends"][b]]
        if len(ok) > 1 and not args.no_interleave:
            t0 = time.perf_counter()
            inter = interleaved_steady(family, size, args, device, dtype, ok)
            for b, ts in inter.items():
                row["backends"][b]["steady_ms_block"] = row["backends"][b]["steady_ms"]
                row["backends"][b]["steady_ms_interleaved_all"] = ts
                row["backends"][b]["steady_ms"] = statistics.median(ts)
            print(f"[{row['model']}] interleaved steady ms: " +
                  ", ".join(f"{b} {statistics.median(ts):.1f}" for b, ts in inter.items()) +
                  f"  [{time.perf_counter() - t0:.0f} s]", flush=True)
        row["ratios"] = model_ratios(row["backends"])
        if not args.no_kernel_cache_runs and "fxbackend" in args.backends:
            t0 = time.perf_counter()
            runs = kernel_cache_runs(family, size, args)
            row["kernel_cache_runs"] = runs
            row["ratios"].update(cache_ratios(runs))
            if "error" in runs:
                print(f"[{row['model']}] kernel-cache runs: ERROR {runs['error']}", flush=True)
            else:
                print(f"[{row['model']}] first calls in new processes (aot_eager / fxbackend): "
                      f"cold kernel cache {runs['cold']['aot_eager']:.2f} / "
                      f"{runs['cold']['fxbackend']:.2f} s, warm "
                      f"{runs['warm']['aot_eager']:.2f} / {runs['warm']['fxbackend']:.2f} s"
                      f"  [{time.perf_counter() - t0:.0f} s]", flush=True)
        meta["total_s"] = time.perf_counter() - t_start
        write_json(args.json, payload)

    meta["total_s"] = time.perf_counter() - t_start
    meta["loadavg_end"] = loadavg()
    write_json(args.json, payload)
    print()
    print_table(results, args, device)
    print(f"\nratios: fxb/aot 1st = fxbackend first call / aot_eager first call (1st cold / "
          f"1st warm: the same in new processes with cold / warm kernel caches); eager/fxb and "
          f"ind/fxb = steady-state speed-up of fxbackend over eager / inductor (>1: fxbackend "
          f"faster); f32eager/fxb = float32 eager's steady time over fxbackend's (the 16-bit "
          f"model against the same model in float32). arena/interm MB: fxbackend arena vs. "
          f"sum of intermediates.")
    print(f"total {meta['total_s']:.0f} s; load average at the end {meta['loadavg_end']} on "
          f"{os.cpu_count()} CPUs (timings are wall-clock: other load inflates them); "
          f"raw results: {args.json}")
    return payload


if __name__ == "__main__":
    if ARGS.child_first_call:
        child_first_call(ARGS)
    else:
        main(ARGS)
