#!/usr/bin/env python3
"""Executor overhead: per-call time of a graph of ~2,000 tiny elementwise ops.

The model is a generated, straight-line ``forward`` of ``--ops`` (default 2,000) elementwise
ATen ops on a tensor of ``--numel`` (default 64) float32 values: a random (seeded) mix of
``sin``, ``cos``, ``tanh``, ``sigmoid``, ``relu``, ``neg``, multiply/add/subtract by a scalar and
tensor-tensor ``mul``/``add``/``sub``.  About one op in six reads an older value instead of the
latest one, so the graph branches (forks that are merged again later), and every value is
consumed, so nothing is dead code.  With tensors this small each op's arithmetic is negligible:
the per-call time is the cost of dispatching/launching 2,000 ops, which is what an executor adds
on top of the kernels.

Compared, per call (median over ``--calls`` calls after ``--warmup`` warm-up calls, repeated
``--rounds`` rounds, taking the median of the round medians; the backends' rounds are
interleaved so that load changes on a shared machine hit all of them alike):

* ``eager``: the module called directly,
* ``aot_eager``: ``torch.compile(module, backend="aot_eager")`` (Dynamo + aot_autograd; the
  ATen graph runs as the FX GraphModule's generated Python code),
* ``fxbackend``: ``torch.compile(module, backend="fxbackend")``,
* optionally ``inductor`` (``--backends eager,aot_eager,fxbackend,inductor``), which fuses the
  whole chain into one kernel and so is not an overhead comparison.

Each backend compiles its own copy of the module (a separate code object), so no
``torch._dynamo.reset()`` is needed between them; the compile time reported is the first call's
wall time.  Dynamo's one-time initialisation is paid before anything is timed (a trivial
``aot_eager`` compile).  The script checks that Dynamo captured exactly one graph with no graph
break (no ``torch._dynamo.config`` change is needed for that: Dynamo has no graph-size limit),
and reports the outputs' max error against eager.  Everything runs under ``torch.no_grad()``;
torch's thread count is left at its default.

The goal is ``fxbackend / eager <= 1.0``.

Run (from the repository root)::

    .venv/bin/python scripts/bench_overhead.py
    .venv/bin/python scripts/bench_overhead.py --ops 500 --calls 100 --rounds 3
    .venv/bin/python scripts/bench_overhead.py --device cuda --json bench_results/overhead_cuda.json

Raw numbers go to ``--json`` (default ``bench_results/overhead.json``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import linecache
import os
import platform
import random
import statistics
import sys
import time
import traceback

import torch
import torch._dynamo

import fxbackend

ALL_BACKENDS = ("eager", "aot_eager", "fxbackend", "inductor")

UNARY = {  # name -> expression template on one operand
    "sin": "torch.sin({a})", "cos": "torch.cos({a})", "tanh": "torch.tanh({a})",
    "sigmoid": "torch.sigmoid({a})", "relu": "torch.relu({a})", "neg": "-{a}",
}
SCALAR = {"mul_s": "{a} * {c}", "add_s": "{a} + {c}", "sub_s": "{a} - {c}"}
BINARY = {"mul": "{a} * {b}", "add": "{a} + {b}", "sub": "{a} - {b}"}


def parse_args(argv=None):
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", type=int, default=2000, help="number of elementwise ops (default 2000)")
    p.add_argument("--numel", type=int, default=64, help="elements of the tensor (default 64)")
    p.add_argument("--calls", type=int, default=200, help="timed calls per round (default 200)")
    p.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    p.add_argument("--warmup", type=int, default=20, help="untimed calls first (default 20)")
    p.add_argument("--backends", default="eager,aot_eager,fxbackend",
                   help=f"comma-separated subset of {','.join(ALL_BACKENDS)} "
                        f"(default eager,aot_eager,fxbackend)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="default cpu")
    p.add_argument("--seed", type=int, default=0, help="seed of the op mix (default 0)")
    p.add_argument("--fxbackend-options", default="{}",
                   help="JSON dict passed as torch.compile(options=...) to fxbackend")
    p.add_argument("--json", default=os.path.join("bench_results", "overhead.json"),
                   help="where to write the raw results (default bench_results/overhead.json)")
    args = p.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if "eager" not in args.backends:
        args.backends.insert(0, "eager")  # the reference and the ratios' denominator
    bad = [b for b in args.backends if b not in ALL_BACKENDS]
    if bad:
        p.error(f"unknown backend(s) {bad}; choose from {','.join(ALL_BACKENDS)}")
    args.backends = sorted(dict.fromkeys(args.backends), key=ALL_BACKENDS.index)
    if args.ops < 1 or args.calls < 1 or args.rounds < 1 or args.warmup < 0:
        p.error("--ops, --calls and --rounds must be >= 1, --warmup >= 0")
    try:
        args.fxbackend_options = json.loads(args.fxbackend_options)
        assert isinstance(args.fxbackend_options, dict)
    except (ValueError, AssertionError):
        p.error("--fxbackend-options must be a JSON object")
    return args


def generate_program(n_ops, seed):
    """Return ``(source_lines, op_counts)``: a straight-line body of exactly ``n_ops`` ops.

    Values are ``v0`` (the input), ``v1``, ...; each op normally reads the latest value, but with
    probability ~1/6 it reads a recent older one (a fork); binary ops prefer a value nobody has
    read yet as their second operand (a merge), else the input or a recent value.  Whatever is still unread at the end is added
    into the result, so every op is live."""
    rng = random.Random(seed)
    lines, counts = [], {}
    unread = set()  # values (other than the latest) that no op has read yet
    cur, n = 0, 0

    def emit(kind, template, **kw):
        nonlocal n
        n += 1
        lines.append(f"v{n} = " + template.format(**kw))
        counts[kind] = counts.get(kind, 0) + 1
        return n

    while n + len(unread) < n_ops:
        a = cur
        if n > 4 and rng.random() < 1 / 6:  # fork: branch off a recent older value
            a = rng.randrange(max(0, n - 30), n)
            unread.add(cur)
        unread.discard(a)
        r = rng.random()
        if r < 0.5 or n + len(unread) + 1 >= n_ops:
            kind = rng.choice(sorted(UNARY))
            new = emit(kind, UNARY[kind], a=f"v{a}")
        elif r < 0.75:
            kind = rng.choice(sorted(SCALAR))
            c = round(rng.uniform(0.5, 1.5), 3)
            new = emit(kind, SCALAR[kind], a=f"v{a}", c=c)
        else:
            kind = rng.choice(sorted(BINARY))
            if unread and rng.random() < 0.8:
                b = rng.choice(sorted(unread))
            elif rng.random() < 0.3:  # re-read the input: keeps the output input-dependent
                b = 0
            else:
                b = rng.randrange(max(0, n - 30), n + 1)
            unread.discard(b)
            new = emit(kind, BINARY[kind], a=f"v{a}", b=f"v{b}")
        cur = new
    for b in sorted(unread):  # merge whatever is still unread: every op is live
        cur = emit("add", BINARY["add"], a=f"v{cur}", b=f"v{b}")
    assert n == n_ops, (n, n_ops)
    lines.append(f"return v{cur}")
    return lines, counts


class OpChain(torch.nn.Module):
    """A module whose ``forward(v0)`` is the generated straight-line program.

    Each instance gets its own code object (compiled from the same source), so Dynamo caches of
    different instances never interact."""

    _instances = 0

    def __init__(self, lines):
        super().__init__()
        OpChain._instances += 1
        filename = f"<opchain_{OpChain._instances}>"
        src = "def forward(v0):\n" + "".join(f"    {ln}\n" for ln in lines)
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        scope = {"torch": torch}
        exec(compile(src, filename, "exec"), scope)
        self._fn = scope["forward"]

    def forward(self, x):
        """Run the generated program on ``x``."""
        return self._fn(x)


def sync(device):
    """Wait for the device (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_round_ms(fn, x, calls, device):
    """Median per-call milliseconds over ``calls`` back-to-back timed calls."""
    times = []
    for _ in range(calls):
        sync(device)
        t0 = time.perf_counter()
        fn(x)
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rel_err(out, ref):
    """``max|out - ref| / max|ref|``."""
    denom = ref.abs().max().item()
    return (out.float() - ref.float()).abs().max().item() / (denom if denom > 0 else 1.0)


def loadavg():
    """The 1/5/15-minute load averages, or None: context for noisy timings."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def main(args):
    """Build, compile, time and report; returns the JSON payload."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchstats import cpu_header
    print(cpu_header())
    device = torch.device(args.device)
    lines, op_counts = generate_program(args.ops, args.seed)
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(args.seed)).to(device)
    meta = {
        "started": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv,
        "torch": torch.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "device": str(device),
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else platform.processor() or platform.machine()),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "ops": args.ops, "numel": args.numel, "calls": args.calls, "rounds": args.rounds,
        "warmup": args.warmup, "seed": args.seed, "op_counts": op_counts,
        "fxbackend_options": args.fxbackend_options, "loadavg_start": loadavg(),
    }
    print(f"executor overhead: {args.ops} elementwise ops on {args.numel} float32 values, "
          f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.rounds} rounds x {args.calls} calls (median of round medians); "
          f"load average {meta['loadavg_start']} on {os.cpu_count()} CPUs")

    t0 = time.perf_counter()
    with torch.no_grad():  # Dynamo's one-time initialisation, not charged to any backend
        torch.compile(lambda a: torch.sin(a) + 1.0, backend="aot_eager")(x)
    torch._dynamo.reset()
    meta["dynamo_warmup_s"] = time.perf_counter() - t0

    results, fns = {}, {}
    ref = None
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        for b in args.backends:
            r = results[b] = {"backend": b}
            module = OpChain(lines).to(device)
            try:
                if b == "eager":
                    fn = module
                else:
                    kw = {"options": args.fxbackend_options} if b == "fxbackend" and \
                        args.fxbackend_options else {}
                    fn = torch.compile(module, backend=b, **kw)
                if b == "fxbackend":
                    fxbackend.reset_stats()
                graphs0 = torch._dynamo.utils.counters["stats"].get("unique_graphs", 0)
                breaks0 = sum(torch._dynamo.utils.counters["graph_break"].values())
                sync(device)
                t0 = time.perf_counter()
                out = fn(x)
                sync(device)
                r["compile_s" if b != "eager" else "first_call_s"] = time.perf_counter() - t0
                if b != "eager":
                    r["dynamo_graphs"] = \
                        torch._dynamo.utils.counters["stats"].get("unique_graphs", 0) - graphs0
                    r["graph_breaks"] = \
                        sum(torch._dynamo.utils.counters["graph_break"].values()) - breaks0
                if ref is None:
                    ref = out.clone()
                    if not torch.isfinite(ref).all():
                        print("warning: the eager output has non-finite values", file=sys.stderr)
                r["max_err"] = rel_err(out, ref)
                for _ in range(args.warmup):
                    fn(x)
                fns[b] = fn
            except Exception as e:
                r["error"] = f"{type(e).__name__}: {e}"
                r["traceback"] = traceback.format_exc()
                tail = "\n".join(r["traceback"].strip().splitlines()[-6:])
                print(f"{b}: ERROR {r['error'][:300]}\n{tail}", flush=True)

        for rnd in range(args.rounds):  # interleaved rounds
            for b, fn in fns.items():
                try:
                    results[b].setdefault("round_median_ms", []).append(
                        time_round_ms(fn, x, args.calls, device))
                except Exception as e:
                    results[b]["error"] = f"{type(e).__name__}: {e}"
                    results[b]["traceback"] = traceback.format_exc()
            fns = {b: f for b, f in fns.items() if "error" not in results[b]}
        if "fxbackend" in results and "error" not in results["fxbackend"]:
            st = fxbackend.stats()
            results["fxbackend"]["fxbackend_stats"] = st
            calls = st.get("calls") or 0
            if calls:
                results["fxbackend"]["steps_per_call"] = \
                    sum(st["steps_by_kernel"].values()) / calls

    eager_ms = None
    for b, r in results.items():
        if "round_median_ms" in r and "error" not in r:
            r["per_call_ms"] = statistics.median(r["round_median_ms"])
            r["per_op_us"] = r["per_call_ms"] * 1e3 / args.ops
            if b == "eager":
                eager_ms = r["per_call_ms"]
    for r in results.values():
        if eager_ms and "per_call_ms" in r:
            r["ratio_to_eager"] = r["per_call_ms"] / eager_ms
    meta["loadavg_end"] = loadavg()
    payload = {"meta": meta, "results": results}
    folder = os.path.dirname(os.path.abspath(args.json))
    os.makedirs(folder, exist_ok=True)
    with open(args.json + ".tmp", "w") as f:
        json.dump(payload, f, indent=1, default=str)
    os.replace(args.json + ".tmp", args.json)

    print(f"\n{'backend':<10} {'compile s':>9} {'per call ms':>11} {'us/op':>6} "
          f"{'/eager':>7} {'graphs':>6} {'breaks':>6} {'max err':>8}  round medians ms")
    for b, r in results.items():
        if "error" in r:
            print(f"{b:<10} error: {r['error'][:100]}")
            continue
        comp = r.get("compile_s")
        print(f"{b:<10} {('-' if comp is None else f'{comp:.2f}'):>9} {r['per_call_ms']:>11.3f} "
              f"{r['per_op_us']:>6.2f} {r['ratio_to_eager']:>7.3f} "
              f"{str(r.get('dynamo_graphs', '-')):>6} {str(r.get('graph_breaks', '-')):>6} "
              f"{r['max_err']:>8.1e}  " + " ".join(f"{v:.3f}" for v in r["round_median_ms"]))
    fx = results.get("fxbackend", {})
    if "ratio_to_eager" in fx:
        verdict = "meets" if fx["ratio_to_eager"] <= 1.0 else "misses"
        extra = (f"; {fx['steps_per_call']:.0f} executor steps per call"
                 if "steps_per_call" in fx else "")
        print(f"\nfxbackend / eager = {fx['ratio_to_eager']:.3f} ({verdict} the goal <= 1.0)"
              f"{extra}")
    for b, r in results.items():
        if r.get("dynamo_graphs", 1) != 1 or r.get("graph_breaks", 0):
            print(f"warning: {b} captured {r.get('dynamo_graphs')} graph(s) with "
                  f"{r.get('graph_breaks')} graph break(s), expected one graph", file=sys.stderr)
    print(f"load average at the end {meta['loadavg_end']}; raw results: {args.json}")
    return payload


if __name__ == "__main__":
    main(parse_args())
