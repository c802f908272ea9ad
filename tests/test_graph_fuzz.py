"""Whole-graph fuzzing: random straight-line programs (``tests/graph_fuzz.py``) compiled with
fxbackend against eager.

Each drawn program is compiled seven ways (default options, fusion off, streams forced on: the
CPU thread pool runs independent branches; ``dynamic=True``; inputs with reversed strides;
bf16 and fp16 inputs) and run twice per compile, so the second call reuses the plan and its
arena.  Every output and every input the program writes must equal eager's: within 1e-5 in
float32 (fused kernels may sum in another order), within torch's tolerance for the dtype in 16
bits; with streams on the results must be bit for bit those of the same plan with streams
off.  The same programs are also exported, saved and replayed.  A failure prints the program's
source.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import fxbackend
from graph_fuzz import draw_program, source

#: examples per variant; ``FUZZ_EXAMPLES=600 make test`` (or pytest on this file) runs a longer,
#: randomised search instead of the fixed one
_EXAMPLES = os.environ.get("FUZZ_EXAMPLES")
_SETTINGS = settings(max_examples=int(_EXAMPLES or 40), derandomize=_EXAMPLES is None,
                     deadline=None, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

@dataclasses.dataclass(frozen=True)
class _Variant:
    options: dict = dataclasses.field(default_factory=dict)  # the backend's
    dynamic: bool | None = None  # torch.compile's
    strided: bool = False  # every input of two or more dims with its strides reversed
    dtype: torch.dtype = torch.float32  # of the inputs


_VARIANTS = {"default": _Variant(), "unfused": _Variant(options={"fusion": False}),
             "streams": _Variant(options={"streams": True}),
             # symbolic sizes (those the program does not pin), planned per shape
             "dynamic": _Variant(dynamic=True), "strided": _Variant(strided=True),
             "bfloat16": _Variant(dtype=torch.bfloat16),
             "float16": _Variant(dtype=torch.float16)}


def _function(program):
    text = source(program)
    scope: dict = {"torch": torch}
    exec(compile(text, "<graph_fuzz>", "exec"), scope)
    return scope["program"], text


def _inputs(program, seed: int, variant: _Variant = _Variant()) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if not variant.strided:
        return [torch.randn(s, generator=g).to(variant.dtype) for s in program.inputs]
    return [torch.randn(s[::-1], generator=g).to(variant.dtype)
            .permute(*range(len(s) - 1, -1, -1)) for s in program.inputs]


def _compare(got, want, what: str, text: str, exact: bool = False) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} values, eager has {len(want)}\n{text}"
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and a.dtype == b.dtype, (
            f"{what} {i}: {a.dtype}{list(a.shape)}, eager {b.dtype}{list(b.shape)}\n{text}")
        try:
            # float32 within 1e-5 (another summation order); 16-bit within torch's defaults
            # for the dtype (one rounding)
            tol = 0.0 if exact else 1e-5 if b.dtype == torch.float32 else None
            torch.testing.assert_close(a, b, rtol=tol, atol=tol, equal_nan=True)
        except AssertionError as e:
            raise AssertionError(f"{what} {i} differs from eager: {e}\n{text}") from None


@pytest.mark.parametrize("variant", list(_VARIANTS))
@_SETTINGS
@given(program=draw_program())
def test_random_programs_match_eager(variant, program):
    fn, text = _function(program)
    torch._dynamo.reset()
    v = _VARIANTS[variant]
    compiled = torch.compile(fn, backend="fxbackend", options=v.options, dynamic=v.dynamic)
    # the same plan run one branch after another: what streams must reproduce exactly
    serial = (torch.compile(fn, backend="fxbackend", options={"streams": False})
              if variant == "streams" else None)
    calls = fxbackend.stats()["calls"]
    with torch.no_grad():
        for seed in (0, 1):  # the second call runs the cached plan on new values
            args = _inputs(program, seed, v)
            eager_args = [a.clone() for a in args]
            want = fn(*eager_args)
            got = compiled(*args)
            _compare(got, want, f"call {seed}: output", text)
            _compare(args, eager_args, f"call {seed}: input", text)
            if serial is not None:
                serial_args = _inputs(program, seed)
                _compare(got, serial(*serial_args), f"call {seed}: streams off, output", text,
                         exact=True)
                _compare(args, serial_args, f"call {seed}: streams off, input", text, exact=True)
    if program.computes:  # a program of views alone may give Dynamo nothing to compile
        assert fxbackend.stats()["calls"] >= calls + 2, f"fxbackend ran nothing\n{text}"


class _Module(torch.nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


@_SETTINGS
@given(program=draw_program())
def test_random_programs_replay_as_eager(program, tmp_path_factory):
    """The same programs exported (``fxbackend.export``), saved, loaded and run twice: eager's
    outputs, and eager's values in the inputs the program writes."""
    fn, text = _function(program)
    path = tmp_path_factory.mktemp("fuzz") / "program.fxb"
    with torch.no_grad():
        fxbackend.export(_Module(fn).eval(), tuple(_inputs(program, 0))).save(path)
        plan = fxbackend.load(path)
        for seed in (0, 1):
            args = _inputs(program, seed)
            eager_args = [a.clone() for a in args]
            want = fn(*eager_args)
            _compare(plan(*args), want, f"call {seed}: output", text)
            _compare(args, eager_args, f"call {seed}: input", text)
