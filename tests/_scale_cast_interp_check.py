"""Runs the scale -> cast Triton kernel (cuda_kernels/scale_cast.py) in Triton's interpreter on
CPU tensors against ``scale_cast_reference``; used by tests/test_scale_cast.py (a fresh process:
see tests/_rope_interp_check.py).  stdin: a JSON list of ``{"id", "x", "out", "shape",
"transposed", "c"}``; stdout: one JSON line per case ``{"id", "ok", "msg", "exact_frac"}``.
bf16 rounding goes through ``_rms_rope_interp_check.patch_bf16_rounding``."""
from __future__ import annotations

import sys
import zlib

from _rms_rope_interp_check import patch_bf16_rounding
from _rope_interp_check import serve


def run_case(case: dict) -> dict:
    import torch
    from fxbackend.cuda_kernels.scale_cast import scale_cast_triton
    from fxbackend.patterns.scale_cast import scale_cast_reference

    g = torch.Generator().manual_seed(zlib.crc32(case["id"].encode()))
    x = (torch.randn(*case["shape"], generator=g) * 3).to(getattr(torch, case["x"]))
    if case["transposed"]:
        x = x.transpose(0, 1)
    out = torch.empty_strided(x.shape, x.stride(), dtype=getattr(torch, case["out"]))
    scale_cast_triton(x, case["c"], out)
    want = scale_cast_reference(x, case["c"], out.dtype)
    exact = (out == want).float().mean().item()
    assert torch.equal(out, want), f"only {exact:.4f} of the elements are bit-equal"
    return {"exact_frac": exact}


def main() -> int:
    return serve(run_case, {"exact_frac": None}, setup=patch_bf16_rounding)


if __name__ == "__main__":
    sys.exit(main())
