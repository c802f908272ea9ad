#!/usr/bin/env python3
"""Achieved bandwidth of the fused RMSNorm -> RoPE Triton kernel (cuda_kernels/rms_rope.py) on a
CUDA GPU, next to its baselines:

* ``copy``: ``out.copy_(x)`` of the same x (torch's copy: the bandwidth the fused kernel can at
  best reach, as it reads x once and writes out once);
* ``unfused``: ``rms_norm_triton`` then ``rope_apply_triton`` (the two Triton kernels, one
  intermediate written and read back), then ``* scale`` in torch when the config has a scale;
* ``eager``: ``rms_rope_reference`` (plain torch, what the model runs unfused).

GB/s counts each byte once: x read + out written (+ weight + cos/sin, small), the minimum traffic
of the fused op; the copy counts x read + written.  Times are CUDA-event means over ``--iters``
launches after ``--warmup``.  Sizes come from :data:`CONFIGS` (real model shapes).  The table is
printed and written as text to ``--out`` (default ``bench_results/bench_rms_rope_cuda.txt``).
Without a GPU it prints a message and exits with status 0.

    .venv/bin/python scripts/bench_rms_rope_cuda.py
    .venv/bin/python scripts/bench_rms_rope_cuda.py --configs flux_bshd --dtype float32

``measure_bandwidth(...)`` is the importable entry (tests/test_rms_rope_cuda.py calls it).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

#: name -> (B, S, H, D, n_rot, mode, layout, scale, model).  layout "bshd": x [B,S,H,D] with
#: cos/sin [S,1,n_rot]; "bhsd_view": the same tensor seen as [B,H,S,D] (transposed, strided
#: rows) with [S,n_rot]; "qkv_bhsd": k of a fused [B,S,3*H*D] projection as [B,H,S,D].
CONFIGS = {
    # Flux.1 at 1024x1024: 24 heads x 128, 4096 image tokens, interleaved pairs, qk-RMSNorm
    "flux_bshd": (1, 4096, 24, 128, 128, "interleaved", "bshd", None, "Flux.1 1024px [B,S,H,D]"),
    "flux_bhsd_view": (1, 4096, 24, 128, 128, "interleaved", "bhsd_view", None,
                       "Flux.1 1024px, [B,S,H,D] seen as [B,H,S,D]"),
    # a fused QKV projection's k slice, split-half pairs, with the attention scale folded in
    "qkv_split_half": (1, 4096, 24, 128, 128, "split_half", "qkv_bhsd", 128 ** -0.5,
                       "k of fused QKV, split-half, * 1/sqrt(D)"),
}


def _inputs(cfg, dtype, w_dtype):
    b, s, h, d, n_rot, mode, layout, scale, _ = cfg
    g = torch.Generator(device="cuda").manual_seed(0)
    if layout == "qkv_bhsd":
        qkv = torch.randn(b, s, 3 * h * d, device="cuda", dtype=dtype, generator=g)
        x = qkv.view(b, s, 3, h, d)[:, :, 1].transpose(1, 2)
    else:
        x = torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=g)
        if layout == "bhsd_view":
            x = x.transpose(1, 2)
    table = (s, 1, n_rot) if layout == "bshd" else (s, n_rot)
    ang = torch.rand(*table, device="cuda", generator=g) * 6.28
    w = (torch.rand(d, device="cuda", generator=g) + 0.5).to(w_dtype)
    return x, w, ang.cos(), ang.sin(), mode, n_rot, scale


def _time_us(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def measure_bandwidth(config: str = "flux_bshd", dtype: torch.dtype = torch.bfloat16,
                      w_dtype: torch.dtype | None = None, iters: int = 100,
                      warmup: int = 10) -> dict:
    """Times the fused kernel and its baselines for one config (see the module docstring);
    returns ``{"config", "dtype", "bytes", "<impl>_us", "<impl>_gbs" for fused, copy, unfused,
    eager, "fused_vs_copy", "text"}``.  Needs a CUDA GPU (RuntimeError otherwise)."""
    if not torch.cuda.is_available():
        raise RuntimeError("measure_bandwidth needs a CUDA GPU")
    from fxbackend.cuda_kernels.rms_rope import rms_rope_triton
    from fxbackend.cuda_kernels.rmsnorm import rms_norm_triton
    from fxbackend.cuda_kernels.rope import rope_apply_triton
    from fxbackend.patterns.rope import rms_rope_reference

    cfg = CONFIGS[config]
    w_dtype = w_dtype or dtype
    x, w, cos, sin, mode, n_rot, scale = _inputs(cfg, dtype, w_dtype)
    out = torch.empty(x.shape, dtype=w_dtype, device="cuda")
    norm = torch.empty(x.shape, dtype=w_dtype, device="cuda")
    rot = torch.empty(x.shape, dtype=w_dtype, device="cuda")
    copy_dst = torch.empty_like(x)

    def fused():
        rms_rope_triton(x, w, cos, sin, out, eps=1e-6, mode=mode, n_rot=n_rot, scale=scale)

    def unfused():
        rms_norm_triton(x, w, 1e-6, norm)
        rope_apply_triton(norm, cos, sin, mode, n_rot, rot)
        if scale is not None:
            rot.mul_(scale)

    impls = {"fused": fused, "copy": lambda: copy_dst.copy_(x), "unfused": unfused,
             "eager": lambda: rms_rope_reference(x, w, cos, sin, 1e-6, mode, n_rot, scale)}
    x_bytes = x.numel() * x.element_size()
    fused_bytes = x_bytes + out.numel() * out.element_size() + \
        sum(t.numel() * t.element_size() for t in (w, cos, sin))
    copy_bytes = 2 * x_bytes
    res = {"config": config, "dtype": str(dtype), "w_dtype": str(w_dtype),
           "shape": tuple(x.shape), "bytes": fused_bytes,
           "device": torch.cuda.get_device_name()}
    for name, fn in impls.items():
        us = _time_us(fn, iters, warmup)
        res[f"{name}_us"] = us
        res[f"{name}_gbs"] = (copy_bytes if name == "copy" else fused_bytes) / us / 1e3
    res["fused_vs_copy"] = res["fused_gbs"] / res["copy_gbs"]
    lines = [f"{config} ({cfg[-1]}): x {list(x.shape)} {dtype}, weight {w_dtype}, "
             f"{fused_bytes / 1e6:.1f} MB moved, {res['device']}"]
    for name in impls:
        lines.append(f"  {name:8s} {res[f'{name}_us']:9.1f} us  {res[f'{name}_gbs']:7.0f} GB/s")
    lines.append(f"  fused / copy bandwidth: {res['fused_vs_copy']:.2f}; "
                 f"unfused / fused time: {res['unfused_us'] / res['fused_us']:.2f}x; "
                 f"eager / fused time: {res['eager_us'] / res['fused_us']:.2f}x")
    res["text"] = "\n".join(lines)
    return res


def main(argv=None) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchstats import cpu_header
    print(cpu_header())
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated (default: all of {', '.join(CONFIGS)})")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out", default="bench_results/bench_rms_rope_cuda.txt")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_rms_rope_cuda: no CUDA GPU; nothing measured")
        return 0
    names = [c for c in args.configs.split(",") if c]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        print(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    texts = []
    for n in names:
        res = measure_bandwidth(n, dtype, iters=args.iters, warmup=args.warmup)
        print(res["text"], flush=True)
        texts.append(res["text"])
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        f.write(f"torch {torch.__version__}\n" + "\n".join(texts) + "\n")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
