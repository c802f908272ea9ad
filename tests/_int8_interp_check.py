"""Runs the INT8 Triton kernels (cuda_kernels/int8.py) in Triton's interpreter on CPU tensors
against the references of patterns/int8.py; used by tests/test_int8.py.  A fresh process, for
the reason tests/_rope_interp_check.py gives (``TRITON_INTERPRET=1`` must be set before Triton
is imported):

    TRITON_INTERPRET=1 python tests/_int8_interp_check.py < cases.json

stdin: a JSON list of cases, each with ``"id"`` and ``"kind"``:

- ``{"kind": "quantize", "k", "group", "dtype", "block", "lead", "special"}``: the launcher
  ``quantize_i8_convrot_triton`` (``block`` null: the kernel's own; a small block makes a row
  take the two-pass path; ``special``: rows of zeros, of values whose amax / 127 underflows,
  of subnormals and of huge values), bit-equal to ``quantize_i8_convrot_reference``;
- ``{"kind": "linear", "m", "k", "n", "group", "x_kind", "w_kind", "bias", "dtype",
  "supported"}``: the registry kernel for the weight kind (``linear_kernel`` for int8,
  ``float_weight_linear_kernel`` for float) through ``prepare``/``execute`` on a node built with
  ``op_create`` (``linear_why_not`` with the device check off accepts it exactly when
  ``supported``: small shapes that ``torch._int_mm`` on CUDA rejects are declined, yet run here
  to test the Triton phases; the workspace is what ``prepare`` asks for), bit-equal to
  ``linear_i8_reference``; ``torch._int_mm`` runs on the CPU here;
- ``{"kind": "requantize", "m", "k", "n", "group"}``: ``w_kind="float"``: the weight is
  quantized once, not again on a second call, again after ``w.copy_(new)``, each result
  bit-equal to the reference with the current weight.

stdout: one JSON line per case ``{"id", "ok", "msg"}``.  Importing this module imports neither
Triton nor fxbackend.
"""
from __future__ import annotations

import sys
import zlib

from _rope_interp_check import serve


def _gen(case, torch):
    return torch.Generator().manual_seed(zlib.crc32(case["id"].encode()))


def _x(shape, dtype, g, torch):
    x = torch.randn(*shape, generator=g) * 3
    if shape[-1] > 4:
        x[..., 3] *= 40  # an outlier channel
    return x.to(dtype)


def run_quantize(case: dict) -> dict:
    import torch
    from fxbackend.cuda_kernels.int8 import quantize_i8_convrot_triton
    from fxbackend.patterns.int8 import quantize_i8_convrot_reference

    g = _gen(case, torch)
    x = _x(tuple(case["lead"]) + (case["k"],), getattr(torch, case["dtype"]), g, torch)
    if case.get("special"):  # a zero row, an underflowing one, subnormals, huge values
        x = x.float().reshape(-1, case["k"])
        x[0] = 0.0
        x[1] = 1e-44
        x[2] *= 1e-39
        x[3] *= 1e30
        x = x.reshape(tuple(case["lead"]) + (case["k"],))
    got = quantize_i8_convrot_triton(x, case["group"], block=case["block"])
    want = quantize_i8_convrot_reference(x, case["group"])
    assert torch.equal(got, want), \
        f"{int((got != want).sum())} of {got.numel()} packed bytes differ from the reference"
    return {}


def _node(srcs, attrs):
    import fxbackend
    from fxbackend import Graph, TensorMeta

    gr = Graph()
    ins = [gr.append(gr.new_node("input", meta=TensorMeta.of(t), is_input=True)) for t in srcs]
    return fxbackend.op_create(gr, "sd.linear_i8.v1", ins, attrs)


def _linear_inputs(case, torch):
    from fxbackend.patterns.int8 import quantize_i8_convrot_reference, \
        quantize_weight_i8_reference

    g = _gen(case, torch)
    m, k, n, group = case["m"], case["k"], case["n"], case["group"]
    dt = getattr(torch, case.get("dtype", "float32"))
    x = _x((m, k), dt, g, torch)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dt)
    attrs = {"x_kind": case["x_kind"], "w_kind": case["w_kind"], "group": group}
    srcs = []
    if case["x_kind"] == "packed":
        srcs.append(quantize_i8_convrot_reference(x, group))
        attrs.update(m=m, lead=(m,))
    elif case["x_kind"] == "int8":
        srcs.append(torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g))
    else:
        srcs.append(x)
    if case["w_kind"] == "int8":
        wq, ws = quantize_weight_i8_reference(w, group)
        srcs += [wq, ws]
    else:
        srcs.append(w)
    if case["x_kind"] == "int8":
        srcs.append(torch.rand(m, generator=g) * 0.05 + 0.01)
    if case.get("bias"):
        srcs.append(torch.randn(n, generator=g).to(dt))
        attrs["has_bias"] = True
    return srcs, attrs


def _reference(srcs, attrs):
    from fxbackend.patterns.int8 import linear_i8_reference, linear_srcs
    s = linear_srcs(srcs, attrs)
    return linear_i8_reference(**s, x_kind=attrs["x_kind"], w_kind=attrs["w_kind"],
                               group=attrs["group"], m=attrs.get("m", -1),
                               lead=attrs.get("lead", ()))


def _execute(kernel, node, state, ws_bytes, srcs, torch):
    import fxbackend
    out = torch.full(node.meta.shape, float("nan"))
    ws = torch.empty(ws_bytes, dtype=torch.uint8)
    kernel.execute(fxbackend.ExecContext(torch.device("cpu")), node, state, srcs, out, ws)
    return out


def _kernel_for(w_kind: str):
    """The registry kernel for the weight kind: ``linear_kernel`` (int8) or
    ``float_weight_linear_kernel`` (float)."""
    from fxbackend.cuda_kernels.int8 import float_weight_linear_kernel, linear_kernel
    return linear_kernel if w_kind == "int8" else float_weight_linear_kernel


def run_linear(case: dict) -> dict:
    import torch
    from fxbackend.cuda_kernels.int8 import linear_why_not

    srcs, attrs = _linear_inputs(case, torch)
    node = _node(srcs, attrs)
    why = linear_why_not(node, any_device=True)
    # shapes torch._int_mm on CUDA rejects are declined; the Triton phases still run here
    # (the interpreter's GEMM is the CPU's)
    assert (why is None) == case["supported"], f"supports: {why}"
    kernel = _kernel_for(case["w_kind"])
    state, ws_bytes = kernel.prepare(node)
    out = _execute(kernel, node, state, ws_bytes, srcs, torch)
    want = _reference(srcs, attrs)
    assert torch.equal(out, want), \
        f"{int((out != want).sum())} of {out.numel()} outputs differ; max abs err " \
        f"{(out - want).abs().max().item()}"
    return {}


def run_requantize(case: dict) -> dict:
    import torch
    case = {**case, "x_kind": "float", "w_kind": "float", "bias": False}
    srcs, attrs = _linear_inputs(case, torch)
    node = _node(srcs, attrs)
    kernel = _kernel_for("float")
    state, ws_bytes = kernel.prepare(node)
    counts = []
    for step in range(3):
        if step == 2:
            with torch.no_grad():
                srcs[1].copy_(torch.randn(srcs[1].shape, generator=_gen(case, torch)))
        out = _execute(kernel, node, state, ws_bytes, srcs, torch)
        assert torch.equal(out, _reference(srcs, attrs)), f"call {step}: not the reference"
        counts.append(state.weight.quantized)
    assert counts == [1, 1, 2], f"quantizations after each call: {counts} (want [1, 1, 2])"
    return {}


def main() -> int:
    runners = {"quantize": run_quantize, "linear": run_linear, "requantize": run_requantize}
    return serve(lambda case: runners[case["kind"]](case), {})


if __name__ == "__main__":
    sys.exit(main())
