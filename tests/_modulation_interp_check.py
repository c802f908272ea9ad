"""Runs the adaLN modulation Triton kernel (cuda_kernels/modulation.py) in Triton's interpreter on
CPU tensors against ``modulation_reference``; used by tests/test_modulation.py.  A fresh
process, for the reason tests/_rope_interp_check.py gives (``TRITON_INTERPRET=1`` must be set
before Triton is imported):

    TRITON_INTERPRET=1 python tests/_modulation_interp_check.py < cases.json

stdin: a JSON list of cases ``{"id", "layout", "d", "dtype", "norm", "add_c", "atol", "rtol",
"min_exact"}`` and optionally ``"x_dtype"``, ``"out_dtype"`` (a 16-bit x widened, a result
narrowed, around scale and shift of ``dtype``; default ``dtype``) (``add_c`` null: no
``c + scale`` in the step; layouts: :func:`build`).
stdout: one JSON line per case ``{"id", "ok", "msg", "max_abs_err", "exact_frac"}``.  bf16
rounding goes through ``_rms_rope_interp_check.patch_bf16_rounding`` (the interpreter truncates).
Importing this module imports neither Triton nor fxbackend.
"""
from __future__ import annotations

import sys
import zlib

from _rms_rope_interp_check import _compare, patch_bf16_rounding
from _rope_interp_check import serve

EPS = 1e-6


def build(layout: str, d: int, dtype, g, torch):
    """``(x, scale, shift)`` for a layout name (also used by tests/test_modulation.py)."""
    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=g) * std + 0.25).to(dtype)

    if layout == "btc":  # [B, T, C] with [B, 1, C] scale and shift (SD3, PixArt)
        return randn(2, 5, d, std=2.0), randn(2, 1, d, std=0.3), randn(2, 1, d)
    if layout == "bc_unsqueezed":  # [B, C] chunks of one [B, 6C] linear output, unsqueezed
        emb = randn(2, 6 * d, std=0.3)
        return randn(2, 5, d, std=2.0), emb[:, d:2 * d][:, None], emb[:, 3 * d:4 * d][:, None]
    if layout == "x_transposed":  # PixArt block 0: x is a transposed patch embedding
        return randn(2, d, 5, std=2.0).transpose(1, 2), randn(2, 1, d, std=0.3), randn(1, 1, d)
    if layout == "x_row_slice":  # Flux norm_out: the image tokens of a [B, T_txt + T, C] stream
        return randn(1, 9, d, std=2.0)[:, 3:], randn(1, 1, d, std=0.3), randn(1, 1, d)
    if layout == "rows2d_full":  # scale and shift per element (no broadcast), 2-D
        return randn(7, d, std=2.0), randn(7, d, std=0.3), randn(7, d)
    raise KeyError(layout)


LAYOUTS = ("btc", "bc_unsqueezed", "x_transposed", "x_row_slice", "rows2d_full")


def run_case(case: dict) -> dict:
    import torch
    from fxbackend.cuda_kernels.modulation import modulation_triton
    from fxbackend.patterns.modulation import modulation_reference

    dtype = getattr(torch, case["dtype"])
    g = torch.Generator().manual_seed(zlib.crc32(case["id"].encode()))
    x, s, h = build(case["layout"], case["d"], dtype, g, torch)
    x = x.to(getattr(torch, case.get("x_dtype", case["dtype"])))  # a widened x
    x_before = x.clone()
    out = torch.full(x.shape, float("nan"), dtype=getattr(torch, case.get("out_dtype",
                                                                            case["dtype"])))
    got = modulation_triton(x, s, h, out, norm=case["norm"], eps=EPS, add_c=case["add_c"])
    assert got is out
    want = modulation_reference(x, s, h, EPS, case["norm"], case["add_c"]).to(out.dtype)
    return _compare(out, want, x, x_before, case, torch)


def main() -> int:
    return serve(run_case, {"max_abs_err": None, "exact_frac": None}, setup=patch_bf16_rounding)


if __name__ == "__main__":
    sys.exit(main())
