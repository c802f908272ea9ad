#!/usr/bin/env python3
"""Benchmark concurrent branches: fxbackend with ``streams`` on against off, on the same plan.

Cases (shapes from :data:`MOE` and :data:`FLUX_BLOCK`, real configs; ``--scale`` divides the
hidden sizes for a quick CPU run):

* ``moe``: an MoE layer with a shared expert (diffusers HiDream's layout: routed experts weighted
  by a softmax gate, plus a shared expert, meeting at ``routed + shared``) at 1-8 tokens, where
  every matmul is memory-bound and one branch alone leaves the device idle;
* ``flux_double``: one Flux double-stream block (``FluxTransformerBlock``) at 256-4096 image
  tokens plus 512 text tokens: the image and text streams run side by side until joint
  attention.

For each case and size: the same module compiled twice, ``options={"streams": False}`` and
``{"streams": True}``; median ms of ``--rounds`` interleaved rounds of ``--calls`` calls
(CUDA events on CUDA); outputs compared byte for byte.  Ratio off / on (> 1: streams faster).
On the CPU the auxiliary branches run on the region thread next to the intra-op thread pool,
so this mostly measures the executor's overhead; the point of streams is the GPU.

``--cuda-graphs`` (CUDA only) adds small Flux end to end with ``cuda_graphs`` off / on.

    .venv/bin/python scripts/bench_streams.py --scale 8            # CPU, quick
    python scripts/bench_streams.py --device cuda                  # GPU, real sizes
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fxbackend  # noqa: E402

#: HiDream-I1's MoE feed-forward (hidden 2560, 4 routed experts of 6912... here the shared
#: expert's width; diffusers ``HiDreamImageFeedForwardSwiGLU`` / ``MoEGate``)
MOE = {"hidden": 2560, "inner": 6912, "experts": 4, "tokens": [1, 2, 4, 8]}
#: Flux.1 double-stream block: 24 heads x 128 = 3072 wide, 512 text tokens
FLUX_BLOCK = {"dim": 3072, "heads": 24, "head_dim": 128, "text": 512,
              "tokens": [256, 1024, 4096]}


class MoE(nn.Module):
    """Routed experts (SwiGLU) weighted by a softmax gate, plus a shared expert."""

    def __init__(self, d: int, h: int, experts: int):
        super().__init__()
        self.gate = nn.Linear(d, experts, bias=False)
        self.w1 = nn.ModuleList(nn.Linear(d, h, bias=False) for _ in range(experts + 1))
        self.w3 = nn.ModuleList(nn.Linear(d, h, bias=False) for _ in range(experts + 1))
        self.w2 = nn.ModuleList(nn.Linear(h, d, bias=False) for _ in range(experts + 1))
        self.experts = experts

    def ffn(self, i, x):
        return self.w2[i](F.silu(self.w1[i](x)) * self.w3[i](x))

    def forward(self, x):
        w = F.softmax(self.gate(x), dim=-1)
        routed = sum(w[..., i:i + 1] * self.ffn(i, x) for i in range(self.experts))
        return routed + self.ffn(self.experts, x)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--cases", nargs="*", default=["moe", "flux_double"])
    p.add_argument("--scale", type=int, default=1, help="divide hidden sizes by this")
    p.add_argument("--max-tokens", type=int, default=None, help="skip larger token counts")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cuda-graphs", action="store_true")
    p.add_argument("--json", default=os.path.join("bench_results", "bench_streams.json"))
    return p.parse_args(argv)


def timed(fn, device, calls):
    out = []
    for _ in range(calls):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def compare(make_module, make_inputs, device, args, extra_options=None):
    """Median ms of streams off / on (interleaved), regions found, byte-identical or not."""
    module = make_module().to(device).eval()
    inputs = make_inputs()
    fns = {}
    with torch.no_grad():
        for mode in (False, True):
            torch._dynamo.reset()
            fxbackend.reset_stats()
            fn = torch.compile(module, backend="fxbackend",
                               options={"streams": mode, **(extra_options or {})})
            out = fn(*inputs)
            fns[mode] = (fn, out.clone() if isinstance(out, torch.Tensor) else out[0].clone())
            if mode:
                regions = fxbackend.stats()["concurrent_regions"]
        times = {False: [], True: []}
        for _ in range(args.rounds):
            for mode in (False, True):
                times[mode] += timed(lambda: fns[mode][0](*inputs), device, args.calls)
    same = torch.equal(fns[False][1], fns[True][1])
    off, on = statistics.median(times[False]), statistics.median(times[True])
    return {"off_ms": off, "on_ms": on, "ratio": off / on, "regions": regions,
            "byte_identical": same}


def bench_moe(args, device):
    d, h = MOE["hidden"] // args.scale, MOE["inner"] // args.scale
    rows = []
    for t in MOE["tokens"]:
        r = compare(lambda: MoE(d, h, MOE["experts"]),
                    lambda: (torch.randn(t, d, device=device),), device, args)
        r.update(case="moe", tokens=t, hidden=d, inner=h)
        rows.append(r)
        yield r


def bench_flux_double(args, device):
    from diffusers.models.transformers.transformer_flux import FluxTransformerBlock
    heads = FLUX_BLOCK["heads"] // args.scale
    dim = heads * FLUX_BLOCK["head_dim"]
    text = FLUX_BLOCK["text"] // args.scale

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = FluxTransformerBlock(dim=dim, num_attention_heads=heads,
                                              attention_head_dim=FLUX_BLOCK["head_dim"])

        def forward(self, img, txt, temb):
            return self.block(img, txt, temb)[1]

    for t in FLUX_BLOCK["tokens"]:
        if args.max_tokens and t > args.max_tokens:
            continue
        r = compare(Block, lambda: (torch.randn(1, t, dim, device=device),
                                    torch.randn(1, text, dim, device=device),
                                    torch.randn(1, dim, device=device)), device, args)
        r.update(case="flux_double", tokens=t, text_tokens=text, dim=dim)
        yield r


def bench_cuda_graphs(args, device):
    from fxbackend import models
    model = models.build_model("flux", "small", device=device)
    inputs = models.make_inputs("flux", "small", device=device)
    res = {}
    with torch.no_grad():
        for mode in (False, True):
            torch._dynamo.reset()
            fn = torch.compile(model, backend="fxbackend", options={"cuda_graphs": mode})
            models.run_eager(fn, inputs)
            ms = statistics.median(timed(lambda: models.run_eager(fn, inputs), device,
                                         args.rounds * args.calls))
            res[mode] = ms
    return {"case": "flux_small_cuda_graphs", "off_ms": res[False], "on_ms": res[True],
            "steps_per_s_off": 1e3 / res[False], "steps_per_s_on": 1e3 / res[True]}


def main(argv=None):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchstats import cpu_header
    print(cpu_header())
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = {"date": datetime.datetime.now().isoformat(), "device": str(device),
              "torch": torch.__version__, "machine": platform.machine(),
              "threads": torch.get_num_threads(), "scale": args.scale, "rows": []}
    print(f"{device}, {torch.get_num_threads()} threads, hidden sizes / {args.scale}; median ms "
          f"of {args.rounds} interleaved rounds x {args.calls} calls")
    print(f"{'case':12s} {'tokens':>6s} {'off ms':>9s} {'on ms':>9s} {'off/on':>7s} "
          f"{'regions':>7s} {'identical':>9s}")
    gens = {"moe": bench_moe, "flux_double": bench_flux_double}
    for case in args.cases:
        for r in gens[case](args, device):
            report["rows"].append(r)
            print(f"{case:12s} {r['tokens']:6d} {r['off_ms']:9.3f} {r['on_ms']:9.3f} "
                  f"{r['ratio']:7.3f} {r['regions']:7d} {str(r['byte_identical']):>9s}",
                  flush=True)
    if args.cuda_graphs and device.type == "cuda":
        r = bench_cuda_graphs(args, device)
        report["rows"].append(r)
        print(f"flux/small cuda graphs off {r['off_ms']:.2f} ms ({r['steps_per_s_off']:.1f} "
              f"steps/s), on {r['on_ms']:.2f} ms ({r['steps_per_s_on']:.1f} steps/s)")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    print(f"raw numbers: {args.json}")


if __name__ == "__main__":
    main()
