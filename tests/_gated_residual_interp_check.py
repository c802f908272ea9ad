"""Runs the gated residual Triton epilogue (cuda_kernels/gated_residual.py) in Triton's
interpreter on CPU tensors against ``gated_residual_reference(..., div_reciprocal=True)`` (the
GPU meaning of the chain); used by tests/test_gated_residual.py.  A fresh process, for the
reason tests/_rope_interp_check.py gives (``TRITON_INTERPRET=1`` must be set before Triton is
imported); bf16 conversions are made to round to nearest even as on a GPU
(``_rms_rope_interp_check.patch_bf16_rounding``).

    TRITON_INTERPRET=1 python tests/_gated_residual_interp_check.py < cases.json

stdin: a JSON list of cases ``{"id", "layout", "b", "s", "c", "dtype", "scale_op", "scale"}``,
optionally with ``"y_dtype"``, ``"residual_dtype"``, ``"out_dtype"`` (default ``dtype``);
stdout: one JSON line per case ``{"id", "ok", "msg", "max_abs_err", "exact"}``.  Importing this
module imports neither Triton nor fxbackend.
"""
from __future__ import annotations

import sys
import zlib

from _rms_rope_interp_check import patch_bf16_rounding
from _rope_interp_check import serve

LAYOUTS = ("plain", "in_place", "strided", "gate_per_token")


def build(layout: str, b: int, s: int, c: int, dtype, torch, seed: int | None = None):
    """``(y, gate, residual, out)`` for one layout: the gate a strided chunk of an adaLN output
    broadcast over tokens; "strided": a transposed residual and out; "in_place": out is y (the
    caller passes y as out; ``out`` here is a copy of y); "gate_per_token": a [B, S, 1] gate
    broadcast over the features; "residual_bcast": a [C] residual (a bias-like add).  ``seed``:
    the generator's seed (None: one derived from the case).  Also the operands of
    tests/test_gated_residual.py's CPU tests."""
    if seed is None:
        seed = zlib.crc32(f"{layout}/{b}/{s}/{c}".encode())
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    y = randn(b, s, c)
    gate = randn(b, 6 * c)[:, 2 * c:3 * c].unsqueeze(1)
    res = randn(b, s, c)
    out = torch.full((b, s, c), float("nan"), dtype=dtype)
    if layout == "in_place":
        out = y.clone()
    elif layout == "strided":
        res = randn(b, c, s).transpose(1, 2)
        out = torch.full((b, c, s), float("nan"), dtype=dtype).transpose(1, 2)
    elif layout == "gate_per_token":
        gate = randn(b, s, 2)[..., :1]
    elif layout == "residual_bcast":
        res = randn(c)
    return y, gate, res, out


def run_case(case: dict) -> dict:
    import torch
    from fxbackend.cuda_kernels.gated_residual import gated_residual_triton
    from fxbackend.patterns.gated_residual import gated_residual_reference

    dtype = getattr(torch, case["dtype"])
    y, gate, res, out = build(case["layout"], case["b"], case["s"], case["c"], dtype, torch)
    # y, residual and out of their own dtypes (around a float32 gate), when the case says so
    y = y.to(getattr(torch, case.get("y_dtype", case["dtype"])))
    res = res.to(getattr(torch, case.get("residual_dtype", case["dtype"])))
    out = out.to(getattr(torch, case.get("out_dtype", case["dtype"])))
    op, scale = case["scale_op"], case["scale"]
    want = gated_residual_reference(y, gate, res, op, scale,
                                    div_reciprocal=True).to(out.dtype)
    if case["layout"] == "in_place":
        out = y
    assert gated_residual_triton(y, gate, res, out, scale_op=op, scale=scale) is out
    err = (out.float() - want.float()).abs().max().item()
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    return {"max_abs_err": err, "exact": True}


def main() -> int:
    return serve(run_case, {"max_abs_err": None, "exact": None}, setup=patch_bf16_rounding)


if __name__ == "__main__":
    sys.exit(main())
