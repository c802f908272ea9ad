"""Runs the GroupNorm [-> SiLU] Triton kernel (cuda_kernels/groupnorm.py) in Triton's interpreter
on CPU tensors against the torch reference; used by tests/test_groupnorm.py.  A fresh process,
for the reason tests/_rope_interp_check.py gives (``TRITON_INTERPRET=1`` must be set before
Triton is imported):

    TRITON_INTERPRET=1 python tests/_groupnorm_interp_check.py < cases.json

stdin: a JSON list of cases ``{"id", "shape", "groups", "layout" ("nchw"|"nhwc"), "x", "w"
(dtype names), "silu", "atol", "rtol"}``, and optionally ``"op": true``: run the kernel as the
``sd.group_norm.v1`` kernel does (``GroupNormCUDA``: ``supports`` on the metadata as if on CUDA,
then ``execute`` into a contiguous output; channels-last x must be declined and still come out
right through ``execute``'s reference path).  stdout: one JSON line per case ``{"id", "ok", "msg",
"max_abs_err", "rel_err"}`` (``rel_err`` = max|out - ref| / max|ref|).  bf16 conversions go
through ``_rms_rope_interp_check.patch_bf16_rounding`` (the interpreter truncates otherwise).
Importing this module imports neither Triton nor fxbackend.
"""
from __future__ import annotations

import sys
import zlib

from _rms_rope_interp_check import patch_bf16_rounding
from _rope_interp_check import serve

EPS = 1e-5


def run_case(case: dict) -> dict:
    import torch
    from fxbackend.cuda_kernels.groupnorm import group_norm_silu_triton
    from fxbackend.patterns.groupnorm import group_norm_silu_reference

    xdt, wdt = getattr(torch, case["x"]), getattr(torch, case["w"])
    g = torch.Generator().manual_seed(zlib.crc32(case["id"].encode()))
    shape, groups = tuple(case["shape"]), case["groups"]
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(xdt)
    if case["layout"] == "nhwc":
        x = x.to(memory_format=torch.channels_last)
    c = shape[1]
    w = (torch.randn(c, generator=g) * 0.2 + 1).to(wdt)
    b = (torch.randn(c, generator=g) * 0.2).to(wdt)
    x_before = x.clone()
    want = group_norm_silu_reference(x, w, b, groups, EPS, case["silu"])
    if case.get("op"):
        want = want.contiguous()  # the op's output is contiguous
        out = torch.full_like(want, float("nan"))
        _run_op_kernel(x, w, b, out, groups, case["layout"])
    else:
        out = torch.full_like(want, float("nan"))
        assert group_norm_silu_triton(x, w, b, out, groups=groups, eps=EPS,
                                      silu=case["silu"]) is out
    err = (out.float() - want.float()).abs().max().item()
    torch.testing.assert_close(out, want, atol=case["atol"], rtol=case["rtol"])
    assert out.stride() == want.stride()
    assert torch.equal(x, x_before), "x was written"
    return {"max_abs_err": err, "rel_err": err / want.float().abs().max().item()}


def _run_op_kernel(x, w, b, out, groups, layout) -> None:
    """``GroupNormCUDA`` on a stand-in node of ``sd.group_norm.v1`` (metadata moved to CUDA for
    ``supports``; the interpreter runs the launch on the CPU tensors)."""
    from types import SimpleNamespace

    import torch
    from fxbackend import TensorMeta
    from fxbackend.cuda_kernels.groupnorm import GroupNormCUDA

    def on_cuda(t):
        m = TensorMeta.of(t)
        return TensorMeta(m.shape, m.stride, m.dtype, torch.device("cuda"), m.storage_offset)

    node = SimpleNamespace(srcs=[SimpleNamespace(meta=on_cuda(t)) for t in (x, w, b)],
                           meta=on_cuda(out), params={"groups": groups, "eps": EPS})
    kernel = GroupNormCUDA()
    assert kernel.supports(node) is (layout == "nchw"), "supports: NCHW only"
    kernel.execute(None, node, None, [x, w, b], out, None)


def main() -> int:
    return serve(run_case, {"max_abs_err": None, "rel_err": None}, setup=patch_bf16_rounding)


if __name__ == "__main__":
    sys.exit(main())
