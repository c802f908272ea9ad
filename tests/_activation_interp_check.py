"""Runs the Triton activation kernels (cuda_kernels/activation.py) in Triton's interpreter on CPU
tensors against ``linear_act_reference``; used by tests/test_activation.py.

    TRITON_INTERPRET=1 python tests/_activation_interp_check.py < cases.json

stdin: a JSON list of cases ``{"id", "m", "k", "n", "act", "gated", "gate", "bias", "dtype",
"atol", "rtol"}``; stdout: one JSON line per case (``_rope_interp_check.serve``).
"""
from __future__ import annotations

import sys

import _rope_interp_check as interp


def run_case(case: dict) -> dict:
    import torch
    from fxbackend.cuda_kernels.activation import LinearActCUDA
    from fxbackend.patterns.activation import linear_act_reference

    dtype = getattr(torch, case["dtype"])
    g = torch.Generator().manual_seed(case["m"] * 1000 + case["n"])
    m, k, n = case["m"], case["k"], case["n"]
    n2 = 2 * n if case["gated"] else n
    x = (torch.randn(m, k, generator=g) * 2).to(dtype)
    w = torch.randn(n2, k, generator=g).to(dtype).t()  # t(W): the strided layout of the chain
    bias = torch.randn(n2, generator=g).to(dtype) if case["bias"] else None
    gate = case["gate"] if case["gated"] else None
    y = torch.empty(m, n2, dtype=dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    LinearActCUDA().run(x, w, bias, y if gate is not None else out, out, act=case["act"],
                        gate=gate, beta=1, alpha=1)
    want = linear_act_reference(x, w, bias, case["act"], gate)
    err = ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()
    scale = want.float().abs().max().item()  # atol relative to the output's magnitude
    torch.testing.assert_close(out, want, atol=case["atol"] * scale, rtol=case["rtol"])
    return {"max_rel_err": err}


if __name__ == "__main__":
    sys.exit(interp.serve(run_case, {"max_rel_err": None}))
