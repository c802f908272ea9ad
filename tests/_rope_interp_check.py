"""Runs the Triton RoPE kernel (cuda_kernels/rope.py) in Triton's interpreter on CPU tensors and
compares it with ``rope_reference``; used by tests/test_rope_cuda.py.

``TRITON_INTERPRET=1`` only takes effect when it is set before Triton is imported, and other
tests in a pytest process may import Triton first, so the checks run here, in a fresh process:

    TRITON_INTERPRET=1 python tests/_rope_interp_check.py < cases.json

stdin: a JSON list of cases ``{"id", "layout", "d", "n_rot", "mode", "dtype", "atol", "rtol",
"via", "rounding"}`` (``via``: "launcher" calls ``rope_apply_triton``; "execute" goes through the
registry kernel's ``prepare`` and ``execute`` on a node built with ``op_create``; ``rounding``:
"once", ``sd.rope_apply.v1``, the default, or "each_op", ``sd.rope_apply_rounded.v1``).
stdout: one JSON line per case ``{"id", "ok", "msg", "max_abs_err"}``.

It also holds what tests/test_rope_cuda.py and tests/test_rms_rope_cuda.py (and its checker,
tests/_rms_rope_interp_check.py) share: :func:`run_checker` and :func:`check_result` (the test
side of a checker), :func:`serve` (a checker's main loop), :func:`execute_once` (the registry
path) and :func:`aot_compile` (compiled mode without a GPU).  Importing this module (for
``LAYOUTS`` and those) imports neither Triton nor fxbackend.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import traceback
import zlib
from typing import Callable

B, S, H = 2, 7, 3


def _angles(rows: int, n_rot: int, torch):
    pos = torch.arange(rows, dtype=torch.float32)[:, None]
    freq = 1.0 / (10000.0 ** (torch.arange(n_rot, dtype=torch.float32) / n_rot))
    return pos * freq[None, :] + 0.3


def _tables(shape: tuple, n_rot: int, dtype, torch):
    """cos and sin of shape ``shape`` (last dim n_rot, or 1 for a feature broadcast)."""
    rows = 1
    for s in shape[:-1]:
        rows *= s
    ang = _angles(rows, n_rot, torch)[:, :shape[-1]]
    return ang.cos().reshape(shape).to(dtype), ang.sin().reshape(shape).to(dtype)


def build(layout: str, d: int, n_rot: int, dtype, torch):
    """``(x, cos, sin)`` for one layout name (see ``LAYOUTS``)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{layout}/{d}/{n_rot}".encode()))

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    if layout == "rows2d":  # [R, D] rows with one cos row each
        x = randn(S * H, d)
        cos, sin = _tables((S * H, n_rot), n_rot, dtype, torch)
    elif layout == "bhsd_cos_s":  # [B,H,S,D] against a [S, n_rot] table
        x = randn(B, H, S, d)
        cos, sin = _tables((S, n_rot), n_rot, dtype, torch)
    elif layout == "bhsd_cos_11s":  # [B,H,S,D] against [1,1,S,n_rot]
        x = randn(B, H, S, d)
        cos, sin = _tables((1, 1, S, n_rot), n_rot, dtype, torch)
    elif layout == "bshd_cos_s1":  # [B,S,H,D] against [S,1,n_rot]
        x = randn(B, S, H, d)
        cos, sin = _tables((S, 1, n_rot), n_rot, dtype, torch)
    elif layout == "bshd_as_bhsd":  # a [B,S,H,D] tensor transposed to [B,H,S,D]
        x = randn(B, S, H, d).transpose(1, 2)
        cos, sin = _tables((S, n_rot), n_rot, dtype, torch)
    elif layout == "qkv_slice_bshd":  # k of a fused [B,S,3*H*D] projection, as [B,S,H,D]
        x = randn(B, S, 3 * H * d).view(B, S, 3, H, d)[:, :, 1]
        cos, sin = _tables((S, 1, n_rot), n_rot, dtype, torch)
    elif layout == "qkv_slice_bhsd":  # the same slice transposed to [B,H,S,D]
        x = randn(B, S, 3 * H * d).view(B, S, 3, H, d)[:, :, 1].transpose(1, 2)
        cos, sin = _tables((1, 1, S, n_rot), n_rot, dtype, torch)
    elif layout == "cos_strided_f32":  # float32 tables read with feature stride 2, row stride 4n
        x = randn(B, H, S, d)
        c, s = _tables((S, 2 * n_rot), 2 * n_rot, torch.float32, torch)
        wide = torch.stack([c, s])  # [2, S, 2n]
        cos, sin = wide[0, :, ::2], wide[1, :, 1::2]
    elif layout == "cos_feature_bcast":  # one angle per row, broadcast over the features
        x = randn(B, H, S, d)
        cos, sin = _tables((S, 1), n_rot, dtype, torch)
    elif layout == "cos_rows_sin_table":  # cos per row [B,H,S,n_rot], sin a [S, n_rot] table
        x = randn(B, H, S, d)
        cos, _ = _tables((B, H, S, n_rot), n_rot, dtype, torch)
        _, sin = _tables((S, n_rot), n_rot, dtype, torch)
    elif layout == "cos_table_sin_rows":  # the mirror image: cos a table, sin per row
        x = randn(B, H, S, d)
        cos, _ = _tables((S, n_rot), n_rot, dtype, torch)
        _, sin = _tables((B, H, S, n_rot), n_rot, dtype, torch)
    else:
        raise KeyError(layout)
    return x, cos, sin


LAYOUTS = ("rows2d", "bhsd_cos_s", "bhsd_cos_11s", "bshd_cos_s1", "bshd_as_bhsd",
           "qkv_slice_bshd", "qkv_slice_bhsd", "cos_strided_f32", "cos_feature_bcast",
           "cos_rows_sin_table", "cos_table_sin_rows")


def execute_once(kernel, op: str, inputs: list, params: dict, out) -> None:
    """``out = op(*inputs) {params}`` through the registry kernel's ``prepare`` (state planned
    from the metadata of a node built with ``op_create``) and ``execute``; asserts that execute
    did not re-plan."""
    import fxbackend
    from fxbackend import Graph, TensorMeta

    g = Graph()
    srcs = [g.append(g.new_node("input", meta=TensorMeta.of(t), is_input=True)) for t in inputs]
    node = fxbackend.op_create(g, op, srcs, params)
    state, ws = kernel.prepare(node)
    assert ws == 0 and len(state.launches) == 1
    kernel.execute(fxbackend.ExecContext(inputs[0].device), node, state, inputs, out, None)
    assert len(state.launches) == 1, "execute re-planned although the metadata was right"


def run_case(case: dict) -> dict:
    import torch
    from fxbackend.cuda_kernels.rope import rope_apply_triton
    from fxbackend.patterns.rope import rope_reference

    dtype = getattr(torch, case["dtype"])
    mode, n_rot = case["mode"], case["n_rot"]
    rounding = case.get("rounding", "once")
    x, cos, sin = build(case["layout"], case["d"], n_rot, dtype, torch)
    x_before = x.clone()
    out = torch.full(x.shape, float("nan"), dtype=dtype)
    if case.get("via", "launcher") == "execute":
        from fxbackend.cuda_kernels.rope import RopeApplyCUDA, RopeApplyRoundedCUDA
        kernel = RopeApplyRoundedCUDA() if rounding == "each_op" else RopeApplyCUDA()
        execute_once(kernel, kernel.op, [x, cos, sin], {"mode": mode, "n_rot": n_rot}, out)
    else:
        assert rope_apply_triton(x, cos, sin, mode, n_rot, out, rounding) is out
    want = rope_reference(x, cos, sin, mode, n_rot, rounding)
    err = (out.float() - want.float()).abs().max().item()
    torch.testing.assert_close(out, want, atol=case["atol"], rtol=case["rtol"])
    assert torch.equal(out[..., n_rot:], x[..., n_rot:]), "features >= n_rot are not copied exactly"
    assert torch.equal(x, x_before), "x was written"
    return {"max_abs_err": err}


def serve(run: Callable[[dict], dict], result: dict,
          setup: Callable[[], None] | None = None) -> int:
    """A checker's main: the cases from stdin, one JSON line per case on stdout: ``{"id", "ok",
    "msg"}``, then ``result``'s keys (their defaults) updated with what ``run(case)`` returns;
    an exception fails that case alone.  ``setup`` runs once before the cases (Triton imported
    by then is fine).  Status 2 unless TRITON_INTERPRET=1 was set before Triton was imported."""
    if os.environ.get("TRITON_INTERPRET") != "1" or "triton" in sys.modules:
        print("run with TRITON_INTERPRET=1 in the environment", file=sys.stderr)
        return 2
    cases = json.load(sys.stdin)
    if setup is not None:
        setup()
    for case in cases:
        res = {"id": case["id"], "ok": True, "msg": "", **result}
        try:
            res.update(run(case))
        except Exception as e:  # reported per case; the test shows it
            res.update(ok=False, msg=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        print(json.dumps(res), flush=True)
    return 0


def run_checker(script: str, cases: list) -> dict:
    """Runs the checker ``script`` (a file next to this one) on ``cases`` in a fresh process
    with ``TRITON_INTERPRET=1`` (one Triton import for all of them); its results by case id.
    For a test module's fixture."""
    here = pathlib.Path(__file__).parent
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(here / script)], input=json.dumps(cases),
                          capture_output=True, text=True, env=env, timeout=300, cwd=here)
    assert proc.returncode == 0, \
        f"interpreter run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return {r["id"]: r for r in map(json.loads, proc.stdout.splitlines())}


def check_result(results: dict, case: dict) -> None:
    """Asserts that the checker reported ``case`` and that it passed."""
    res = results.get(case["id"])
    assert res is not None, f"the interpreter run reported nothing for {case['id']}"
    assert res["ok"], res["msg"]


_PTR = {"float32": "*fp32", "bfloat16": "*bf16", "float16": "*fp16"}


def aot_compile(kernel, ptrs: tuple, values: tuple, constexprs: dict, options: dict):
    """Compiles the jitted ``kernel`` the way a launch specialises it (ints equal to 1 become
    constants, ints and pointers divisible by 16 get that attribute; floats are fp32) through
    Triton's ahead-of-time API (``triton.compile`` on an ``ASTSource``, as
    ``triton/tools/compile.py`` does) for sm_90; needs ptxas, not a GPU.  ``ptrs``: the torch
    dtypes of the leading pointer arguments; ``values``: the scalar arguments that follow;
    ``options``: the launch's (``num_warps``, ``enable_fp_fusion``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    scalars = dict(zip(names[len(ptrs):], values))
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(names):
        if i < len(ptrs):
            sig[name] = _PTR[str(ptrs[i]).removeprefix("torch.")]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in scalars:
            v = scalars[name]
            if isinstance(v, float):
                sig[name] = "fp32"
            elif v == 1:
                sig[name], consts[name] = "constexpr", 1
            else:
                sig[name] = "i32" if -2**31 <= v < 2**31 else "i64"
                if v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "constexpr"
    consts.update(constexprs)
    src = ASTSource(kernel, sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def main() -> int:
    # the interpreter truncates float32 -> bf16; the GPU rounds to nearest even, which the
    # rounded op's bit-for-bit cases need (see _rms_rope_interp_check.patch_bf16_rounding)
    from _rms_rope_interp_check import patch_bf16_rounding
    return serve(run_case, {"max_abs_err": None}, setup=patch_bf16_rounding)


if __name__ == "__main__":
    sys.exit(main())
