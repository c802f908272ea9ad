"""Ahead-of-time kernel compilation: ``fxbackend.precompile()`` / ``python -m fxbackend
precompile``.

A plan compiles the kernels its fused steps use at plan time (numba on the CPU, Triton on CUDA)
and caches them on disk, so only the first process on a machine pays for them: with an empty
cache the first call of a small Flux spends most of its ~20 s compiling.  ``precompile`` pays
that ahead of time, at install or deployment, by compiling the tiny configs of the model zoo
(``fxbackend.models``) in the dtypes asked for, with and without W8A8: a kernel is compiled per
dtype and argument kind, not per shape, so a later plan of a full-size model of the same
families finds its kernels in the cache.  The cache is this machine's (numba compiles for the
host's vectors and keys its cache on the CPU; ``NUMBA_CACHE_DIR`` / ``TRITON_CACHE_DIR`` move
it), so precompile where the models will run.
"""
from __future__ import annotations

import time
import warnings
from typing import Callable, Sequence

import torch

__all__ = ["precompile", "DTYPES"]

#: the dtypes precompile takes, by name
DTYPES = ("float32", "bfloat16", "float16")


def _names(value, allowed: Sequence, what: str) -> list:
    """``value`` (a comma-separated str or a sequence) as a list of names from ``allowed``."""
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else list(value)
    items = [v for v in items if v != ""]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise ValueError(f"precompile: {what} must be among {', '.join(map(str, allowed))}, "
                         f"got {value!r}")
    return items


def precompile(dtypes: Sequence[str] | str = ("float32", "bfloat16"),
               families: Sequence[str] | str | None = None, w8a8: bool = True,
               device: str = "cpu", log: Callable[[str], None] | None = None) -> dict:
    """Compile the kernels of the tiny model configs of ``families`` (default: every family
    with a tiny config) in each of ``dtypes`` (names: float32, bfloat16, float16), and in
    each also with ``quantize="w8a8"`` (every eligible layer) unless ``w8a8`` is False, on
    ``device`` ("cpu" or "cuda"), so that they land in the kernel cache (module docstring).
    ``log(line)`` is called after each config.  Returns ``{"family/dtype[/w8a8]": seconds}``.
    ValueError names a bad argument."""
    from . import models
    dtypes = _names(dtypes, DTYPES, "dtypes")
    tiny = [f for f in models.families() if (f, "tiny") in models.MODEL_CONFIGS]
    families = tiny if families is None else _names(families, tiny, "families")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"precompile: device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("precompile: device 'cuda' asked for, but CUDA is not available")
    runs = [(f, d, None) for f in families for d in dtypes]
    if w8a8:
        runs += [(f, d, "w8a8") for f in families for d in dtypes]
    spent: dict = {}
    for family, dtype_name, quantize in runs:
        name = f"{family}/{dtype_name}" + (f"/{quantize}" if quantize else "")
        dtype = getattr(torch, dtype_name)
        t0 = time.perf_counter()
        model = models.build_model(family, "tiny", dtype=dtype, device=device)
        inputs = models.make_inputs(family, "tiny", dtype=dtype, device=device)
        options = {"quantize": quantize, "quantize_min_size": 0} if quantize else {}
        torch._dynamo.reset()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Dynamo's notes on diffusers' code: not the user's
            torch.compile(model, backend="fxbackend", options=options)(**inputs)
        spent[name] = time.perf_counter() - t0
        if log is not None:
            log(f"{name}: {spent[name]:.1f} s")
    torch._dynamo.reset()
    return spent
