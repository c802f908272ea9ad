"""Runs the fused RMSNorm->RoPE Triton kernel (cuda_kernels/rms_rope.py) and the RMSNorm kernel
(cuda_kernels/rmsnorm.py) in Triton's interpreter on CPU tensors against the torch references;
used by tests/test_rms_rope_cuda.py.  A fresh process, for the reason tests/_rope_interp_check.py
gives (``TRITON_INTERPRET=1`` must be set before Triton is imported):

    TRITON_INTERPRET=1 python tests/_rms_rope_interp_check.py < cases.json

stdin: a JSON list of cases.  ``{"kind": "rms_rope", "id", "layout", "rows", "d", "n_rot",
"mode", "x", "w", "cs", "out", "scale", "w_strided", "atol", "rtol", "min_exact"}`` (dtype
names; ``cs`` the cos/sin dtype; ``scale`` null or a number) or ``{"kind": "rms_norm", "id",
"layout", "rows", "d", "x", "w" (null: no weight), "via", "atol", "rtol", "min_exact"}`` (``via``:
"launcher" calls ``rms_norm_triton``; "execute" goes through ``RmsNormCUDA.prepare``/``execute``
on a node built with ``op_create``).  stdout: one JSON line per case ``{"id", "ok", "msg",
"max_abs_err", "exact_frac"}``; ``exact_frac`` is the fraction of output elements bit-equal to
the reference.

bfloat16 rounding.  Triton's interpreter (3.9: ``InterpreterBuilder.cast_impl``) converts
float32 to bfloat16 by truncation, while compiled kernels round to nearest even
(``cvt.rn.bf16.f32``), as torch does.  The kernels round to Tn several times, so this script
routes that one conversion through torch (:func:`patch_bf16_rounding`, checked by a probe) so
that the bf16 rows test the kernels' roundings rather than the interpreter's.  float16 goes
through numpy, which rounds to nearest even already.

Importing this module imports neither Triton nor fxbackend.
"""
from __future__ import annotations

import sys
import zlib

from _rope_interp_check import _tables, execute_once, serve

B, S, H = 2, 7, 3
EPS = 1e-6


def patch_bf16_rounding() -> None:
    """Make the interpreter's float32 -> bfloat16 conversion round to nearest even (see the
    module docstring).  RuntimeError when the interpreter's internals have changed."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter as ti

    orig = ti.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            a = np.array(src.data, dtype=np.float32, copy=True)
            bits = torch.from_numpy(a).to(torch.bfloat16).view(torch.int16).numpy()
            return ti.TensorHandle(bits.view(np.uint16), tl.bfloat16)
        return orig(self, src, dst_type)

    ti.InterpreterBuilder.cast_impl = cast_impl
    # probe: 1 + 2^-8 + 2^-12 rounds up to 1 + 2^-7 (truncation gives 1); 1 + 2^-8 is a tie
    # that rounds to even (1)
    probe = np.array([1 + 2**-8 + 2**-12, 1 + 2**-8, -(1 + 3 * 2**-8)], dtype=np.float32)
    got = ti.InterpreterBuilder.create_fp_trunc(
        object.__new__(ti.InterpreterBuilder), ti.TensorHandle(probe, tl.float32), tl.bfloat16)
    want = torch.from_numpy(probe).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    if not np.array_equal(np.asarray(got.data), want):
        raise RuntimeError("patch_bf16_rounding: Triton's interpreter changed; the float32 -> "
                           "bfloat16 conversion is not routed through the patch")


def _x(layout: str, rows: int, d: int, dtype, g, torch):
    """x and the shape of one cos/sin table for this layout."""
    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    if layout == "rows":  # [R, D], one table row per row
        return randn(rows, d), (rows,)
    if layout == "bshd_s1":  # [B,S,H,D] against [S,1,n]
        return randn(B, S, H, d), (S, 1)
    if layout == "bshd_as_bhsd":  # a [B,S,H,D] tensor permuted to [B,H,S,D], against [S,n]
        return randn(B, S, H, d).transpose(1, 2), (S,)
    if layout == "qkv_bhsd":  # k of a fused [B,S,3*H*D] projection as [B,H,S,D], vs [1,1,S,n]
        return randn(B, S, 3 * H * d).view(B, S, 3, H, d)[:, :, 1].transpose(1, 2), (1, 1, S)
    raise KeyError(layout)


def _weight(d: int, dtype, strided: bool, g, torch):
    w = torch.rand(2 * d if strided else d, generator=g) * 1.5 + 0.25
    return (w[::2] if strided else w).to(dtype)


def _compare(out, want, x, x_before, case, torch) -> dict:
    assert out.dtype == want.dtype and out.shape == want.shape, (out.dtype, want.dtype)
    err = (out.float() - want.float()).abs().max().item() if out.numel() else 0.0
    exact = (out == want).float().mean().item() if out.numel() else 1.0
    torch.testing.assert_close(out, want, atol=case["atol"], rtol=case["rtol"])
    assert exact >= case["min_exact"], \
        f"only {exact:.4f} of the elements are bit-equal to the reference (want >= " \
        f"{case['min_exact']}): a rounding step differs"
    assert torch.equal(x, x_before), "x was written"
    return {"max_abs_err": err, "exact_frac": exact}


def run_rms_rope(case: dict) -> dict:
    import torch
    from fxbackend.cuda_kernels.rms_rope import rms_rope_triton
    from fxbackend.patterns.rope import rms_rope_reference

    dt = {k: getattr(torch, case[k]) for k in ("x", "w", "cs", "out")}
    mode, d, n_rot, scale = case["mode"], case["d"], case["n_rot"], case["scale"]
    g = torch.Generator().manual_seed(zlib.crc32(case["id"].encode()))
    x, lead = _x(case["layout"], case.get("rows", 0), d, dt["x"], g, torch)
    w = _weight(d, dt["w"], case.get("w_strided", False), g, torch)
    cos, sin = _tables(lead + (n_rot,), n_rot, dt["cs"], torch)
    x_before = x.clone()
    out = torch.full(x.shape, float("nan"), dtype=dt["out"])
    got = rms_rope_triton(x, w, cos, sin, out, eps=EPS, mode=mode, n_rot=n_rot, scale=scale)
    assert got is out
    want = rms_rope_reference(x, w, cos, sin, EPS, mode, n_rot, scale, dt["out"])
    return _compare(out, want, x, x_before, case, torch)


def run_rms_norm(case: dict) -> dict:
    import torch
    from fxbackend.cuda_kernels.rmsnorm import rms_norm_triton
    from fxbackend.patterns.rmsnorm import rms_norm_out_dtype, rms_norm_reference

    xdt = getattr(torch, case["x"])
    wdt = None if case["w"] is None else getattr(torch, case["w"])
    d = case["d"]
    g = torch.Generator().manual_seed(zlib.crc32(case["id"].encode()))
    x, _ = _x(case["layout"], case.get("rows", 0), d, xdt, g, torch)
    w = None if wdt is None else _weight(d, wdt, case.get("w_strided", False), g, torch)
    x_before = x.clone()
    out = torch.full(x.shape, float("nan"), dtype=rms_norm_out_dtype(xdt, wdt))
    if case.get("via", "launcher") == "execute":
        from fxbackend.cuda_kernels.rmsnorm import RmsNormCUDA
        execute_once(RmsNormCUDA(), "sd.rms_norm.v1", [x] if w is None else [x, w],
                     {"eps": EPS}, out)
    else:
        assert rms_norm_triton(x, w, EPS, out) is out
    want = rms_norm_reference(x, w, EPS)
    return _compare(out, want, x, x_before, case, torch)


def main() -> int:
    def run(case: dict) -> dict:
        return (run_rms_rope if case["kind"] == "rms_rope" else run_rms_norm)(case)

    return serve(run, {"max_abs_err": None, "exact_frac": None}, setup=patch_bf16_rounding)


if __name__ == "__main__":
    sys.exit(main())
