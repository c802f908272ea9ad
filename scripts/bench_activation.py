"""Benchmark: Linear -> activation (``linear_act``) and Linear -> GEGLU (``linear_glu``) on the CPU.

For each shape (feed-forwards of real configs) and float32, three implementations of the same
function, interleaved in rounds (median ms; GB/s counts the GEMM output written once and the
activation pass's reads/writes, TFLOP/s the GEMM):

- eager: ``addmm`` then ``gelu`` (GEGLU: ``chunk``, ``gelu(gate)``, ``hidden * ...``), as the
  model runs it;
- inductor: ``torch.compile`` of the same function (default backend);
- fused: the ``linear_act_cpu`` kernel (torch's addmm into the output/workspace, one numba pass),
  with a fresh output (and GEGLU workspace) per call as eager's and Inductor's functions
  allocate theirs; ``fused_prealloc`` writes one preallocated pair instead (shown, not a goal:
  buffers last written a round ago have left the caches, while a block the allocator just
  freed is still in them, which made the same kernel up to 1 ms slower per call at SD1.5's
  first GEGLU).

The GEMM is torch's in all three and takes most of the time, so GEGLU configs also time the
pass alone, the kernel this backend adds, against the same function of the GEMM's result
(``h, g = (y + b).chunk(2)``, ``h * act(g)``) run eagerly and compiled by Inductor (one pointwise
kernel); GB/s counts its reads of y and write of the output.

Rows are capped (``--rows``, default 1024) because a 2-core CPU needs seconds for a full
4608-token Flux GEMM; the per-row cost is the same.  Goals printed: fused faster than eager and
not slower than Inductor, judged on the per-round ratios (other / fused): their median and
its 95% interval (``scripts/benchstats.py``: "ahead" above 1, "level" containing 1, "behind"
below).  Raw results go to ``bench_results/activation.json``.

    .venv/bin/python scripts/bench_activation.py [--rows 1024] [--rounds 7] [--threads 1]
        [--configs unet_geglu,sd3_ff]
"""
from __future__ import annotations

import argparse
import sys
import os
import json
import pathlib
import statistics
import time

import torch
from benchstats import describe, goal_word, verdict

import fxbackend.cpu_kernels.activation  # noqa: F401
from fxbackend.cpu_kernels.activation import LinearActCPU, compile_kernels, glu_cpu
from fxbackend.patterns.activation import act_reference

#: (name, tokens, K, N, act, gated): feed-forward GEMMs of real configs
CONFIGS = [
    ("flux_ff (Flux.1, 4096+512 tokens, 3072 -> 12288, gelu tanh)", 4608, 3072, 12288,
     "gelu_tanh", False),
    ("sd3_ff (SD3-medium, 4096+333 tokens, 1536 -> 6144, gelu tanh)", 4429, 1536, 6144,
     "gelu_tanh", False),
    ("unet_geglu_320 (SD1.5 64x64 latents, 320 -> 2x1280, GEGLU erf)", 4096, 320, 1280,
     "gelu", True),
    ("unet_geglu_640 (SD1.5 32x32, 640 -> 2x2560, GEGLU erf)", 1024, 640, 2560, "gelu", True),
    ("unet_geglu_1280 (SD1.5 16x16, 1280 -> 2x5120, GEGLU erf)", 256, 1280, 5120, "gelu", True),
]


def eager_fn(act, gated):
    if gated:
        def f(b, x, w):
            h, g = torch.addmm(b, x, w).chunk(2, dim=-1)
            return h * act_reference(g, act)
    else:
        def f(b, x, w):
            return act_reference(torch.addmm(b, x, w), act)
    return f


def median_ms(fn, rounds_out, key):
    t0 = time.perf_counter()
    fn()
    rounds_out[key].append((time.perf_counter() - t0) * 1e3)


def bench(name, m, k, n, act, gated, rounds):
    g = torch.Generator().manual_seed(0)
    n2 = 2 * n if gated else n
    x = torch.randn(m, k, generator=g)
    # weights at nn.Linear's scale (std 1/sqrt(K)), so the GEMM result is O(1) as in a model:
    # unscaled randn weights gave results of std sqrt(K), whose erf / exp underflow to
    # subnormals that made torch's and earlier versions of this kernel's passes several
    # times slower (a microcode assist per lane), which no trained model exercises
    w = (torch.randn(n2, k, generator=g) / k ** 0.5).t()
    b = torch.randn(n2, generator=g) * 0.1
    f = eager_fn(act, gated)
    ind = torch.compile(f)
    impl = LinearActCPU()
    compile_kernels(torch.float32, act)
    out = torch.empty(m, n)
    y = torch.empty(m, n2) if gated else out
    gate = 1 if gated else None

    def fused():
        o = torch.empty(m, n)
        impl.run(x, w, b, torch.empty(m, n2) if gated else o, o, act=act, gate=gate, beta=1,
                 alpha=1)
        return o

    def fused_prealloc():
        impl.run(x, w, b, y, out, act=act, gate=gate, beta=1, alpha=1)

    want = f(b, x, w)
    ind(b, x, w)  # compile
    err = ((fused() - want).abs().max() / want.abs().max()).item()
    fused_prealloc()
    assert torch.equal(out, fused()), "preallocated and fresh outputs differ"
    ts = {"eager": [], "inductor": [], "fused": [], "fused_prealloc": []}
    calls = {"eager": lambda: f(b, x, w), "inductor": lambda: ind(b, x, w), "fused": fused,
             "fused_prealloc": fused_prealloc}
    if gated:  # the pass alone, on the GEMM's result (see the module docstring)
        def pass_fn(y_, b_):
            h, g_ = (y_ + b_).chunk(2, dim=-1)
            return h * act_reference(g_, act)
        y_pass = x @ w
        ind_pass = torch.compile(pass_fn)
        ind_pass(y_pass, b)
        glu_cpu(y_pass, out, act, gate, b)
        want_pass = pass_fn(y_pass, b)
        pass_err = ((out - want_pass).abs().max() / want_pass.abs().max()).item()
        ts.update({"eager_pass": [], "inductor_pass": [], "fused_pass": []})
        calls.update({"eager_pass": lambda: pass_fn(y_pass, b),
                      "inductor_pass": lambda: ind_pass(y_pass, b),
                      "fused_pass": lambda: glu_cpu(y_pass, torch.empty(m, n), act, gate, b)})
    for _ in range(rounds):
        for key, call in calls.items():
            median_ms(call, ts, key)
    med = {k_: statistics.median(v) for k_, v in ts.items()}
    # bytes: GEMM output written once + the activation pass (fused: read y, write out)
    nbytes = 4 * (m * n2 + m * n2 + m * n)
    flops = 2 * m * k * n2
    row = {"name": name, "m": m, "k": k, "n": n, "act": act, "gated": gated,
           "max_rel_err_vs_eager": err, "ms": med,
           "gbps": {k_: nbytes / v / 1e6 for k_, v in med.items()},
           "tflops": {k_: flops / v / 1e9 for k_, v in med.items()}}
    print(f"{name}\n  rows {m}: eager {med['eager']:.2f} ms, inductor {med['inductor']:.2f} ms, "
          f"fused {med['fused']:.2f} ms ({row['tflops']['fused']:.3f} TFLOP/s, "
          f"{row['gbps']['fused']:.1f} GB/s); eager/fused {med['eager'] / med['fused']:.3f}x, "
          f"inductor/fused {med['inductor'] / med['fused']:.3f}x; max rel err {err:.2e}; "
          f"preallocated output {med['fused_prealloc']:.2f} ms "
          f"(inductor/prealloc {med['inductor'] / med['fused_prealloc']:.3f}x)")
    row["verdict"] = {o: verdict(ts, o, "fused") for o in ("eager", "inductor")}
    print(f"  goals: {_goal(row['verdict'])}")
    if gated:
        pass_bytes = 4 * (m * n2 + m * n)
        row["pass"] = {"ms": {k_: med[k_ + "_pass"] for k_ in ("eager", "inductor", "fused")},
                       "max_rel_err_vs_eager": pass_err}
        row["pass"]["gbps"] = {k_: pass_bytes / v / 1e6 for k_, v in row["pass"]["ms"].items()}
        pm = row["pass"]["ms"]
        print(f"  pass alone: eager {pm['eager']:.3f} ms, inductor {pm['inductor']:.3f} ms, "
              f"fused {pm['fused']:.3f} ms ({row['pass']['gbps']['fused']:.1f} GB/s); "
              f"eager/fused {pm['eager'] / pm['fused']:.3f}x, "
              f"inductor/fused {pm['inductor'] / pm['fused']:.3f}x; max rel err {pass_err:.2e}")
        row["pass"]["verdict"] = {o: verdict(ts, o + "_pass", "fused_pass")
                                  for o in ("eager", "inductor")}
        print(f"  goals (pass): {_goal(row['pass']['verdict'])}")
    return row


def _goal(v: dict) -> str:
    """The goal line of a row's verdicts (scripts/benchstats.py): faster than eager ("ahead")
    and not slower than Inductor (not "behind")."""
    return (f"vs eager {describe(v['eager'])}, vs inductor {describe(v['inductor'])}: "
            f"{goal_word(v['eager'], v['inductor'])}")


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchstats import cpu_header
    print(cpu_header())
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch (and numba) threads")
    ap.add_argument("--configs", default=None,
                    help="comma-separated prefixes of the configs to run (default: all)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    wanted = args.configs.split(",") if args.configs else None
    rows = [bench(name, min(m, args.rows), k, n, act, gated, args.rounds)
            for name, m, k, n, act, gated in CONFIGS
            if wanted is None or any(name.startswith(w) for w in wanted)]
    path = pathlib.Path(__file__).resolve().parent.parent / "bench_results" / "activation.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=1))
    print(f"raw results: {path}")


if __name__ == "__main__":
    main()
