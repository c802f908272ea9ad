"""Write the golden plan files of the *current* format version (fxbackend.replay.FORMAT_VERSION).

    python tests/golden/make_goldens.py

Each golden is ``v<version>_<name>.fxb`` (a few KB) plus ``v<version>_<name>_io.safetensors``
with its inputs (``in.<input name>``) and the outputs the plan gave when it was written
(``out.<index>``).  ``tests/test_replay.py::test_golden_files`` loads every golden of every
version and checks its outputs: a newer loader must read the files of every earlier format
version.  So goldens are never regenerated: when the format version changes, run this script
once for the new version (it refuses to overwrite a file that exists) and commit the new files
next to the old ones.

The goldens cover: a static export with keyword arguments, a constant input and a dict/tuple
output structure (``static``); the same model exported with a dynamic, derived size (symbols,
ranges, symbolic strides; ``dynamic``, whose inputs are at another size than it was exported
at); a hand-built graph of the project's custom ops (attributes through ``serialize``;
``custom_op``).
"""
from __future__ import annotations

import os
import sys

import safetensors.torch
import torch
from torch.export import Dim

import fxbackend
from fxbackend.ir import Graph
from fxbackend.replay import FORMAT_VERSION

HERE = os.path.dirname(os.path.abspath(__file__))


class GoldenNet(torch.nn.Module):
    """Linear -> LayerNorm -> GELU(tanh) -> reshape -> Linear, scaled by a buffer, plus a
    residual; keyword input ``cond``, constant input ``flag``, dict/tuple outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.out = torch.nn.Linear(16, 8)
        self.register_buffer("gain", torch.tensor(0.75))

    def forward(self, x, *, cond, flag=True):
        h = torch.nn.functional.gelu(self.norm(self.inp(x) + cond), approximate="tanh")
        b, n, _ = h.shape
        h = h.reshape(b, n // 2, 32).reshape(b, n, 16)
        y = self.out(h) * self.gain + x
        return {"out": y, "aux": (h.mean(-1),)} if flag else y


def _golden_net() -> tuple[GoldenNet, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = GoldenNet().eval()
    gen = torch.Generator().manual_seed(1)
    return model, torch.randn(2, 6, 8, generator=gen), torch.randn(16, generator=gen)


def _custom_op_plan() -> tuple[fxbackend.ExportedPlan, dict]:
    """x -> sd.rms_norm.v1(x, w) -> sd.rope_apply.v1(., cos, sin): a hand-built graph."""
    from ext_util import contiguous_meta  # tests/ on sys.path (see below)
    g = Graph()
    x = g.append(g.new_node("input", meta=contiguous_meta((2, 3, 8)), is_input=True))
    w = g.append(g.new_node("input", meta=contiguous_meta((8,)), is_input=True, is_weight=True))
    cos = g.append(g.new_node("input", meta=contiguous_meta((3, 8)), is_input=True))
    sin = g.append(g.new_node("input", meta=contiguous_meta((3, 8)), is_input=True))
    for n, name in ((x, "x"), (w, "norm.weight"), (cos, "cos"), (sin, "sin")):
        n.annotations["name"] = name
    norm = fxbackend.op_create(g, "sd.rms_norm.v1", [x, w], {"eps": 1e-6})
    rope = fxbackend.op_create(g, "sd.rope_apply.v1", [norm, cos, sin],
                               {"mode": "interleaved", "n_rot": 8})
    norm.is_output = rope.is_output = True
    g.outputs = [rope, norm]
    gen = torch.Generator().manual_seed(2)
    weight = 1 + 0.1 * torch.randn(8, generator=gen)
    angles = torch.randn(3, 4, generator=gen)
    inputs = {"x": torch.randn(2, 3, 8, generator=gen),
              "cos": angles.cos().repeat_interleave(2, -1),
              "sin": angles.sin().repeat_interleave(2, -1)}
    return fxbackend.from_compiled(g, weights={"norm.weight": weight}), inputs


def _write(name: str, plan: fxbackend.ExportedPlan, inputs: dict) -> None:
    path = os.path.join(HERE, f"v{FORMAT_VERSION}_{name}.fxb")
    io_path = os.path.join(HERE, f"v{FORMAT_VERSION}_{name}_io.safetensors")
    for p in (path, io_path):
        if os.path.exists(p):
            raise SystemExit(f"{p} exists: goldens are never regenerated (see the docstring)")
    outs = plan.run(inputs)
    plan.save(path)
    tensors = {f"in.{k}": v.contiguous() for k, v in inputs.items()}
    tensors.update({f"out.{i}": o.contiguous() for i, o in enumerate(outs)})
    safetensors.torch.save_file(tensors, io_path)
    print(f"wrote {path} ({os.path.getsize(path)} bytes) and {io_path}")


def main() -> None:
    sys.path.insert(0, os.path.dirname(HERE))
    model, x, cond = _golden_net()
    with torch.no_grad():
        _write("static", fxbackend.export(model, (x,), {"cond": cond, "flag": True}),
               {"x": x, "cond": cond})
        dyn = fxbackend.export(model, (x,), {"cond": cond, "flag": True},
                               dynamic_shapes={"x": {1: 2 * Dim("half", min=1, max=32)},
                                               "cond": None, "flag": None})
        x10 = torch.randn(2, 10, 8, generator=torch.Generator().manual_seed(3))
        _write("dynamic", dyn, {"x": x10, "cond": cond})
        plan, inputs = _custom_op_plan()
        _write("custom_op", plan, inputs)


if __name__ == "__main__":
    main()
