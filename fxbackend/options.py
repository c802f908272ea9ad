"""Backend options: ``torch.compile(m, backend="fxbackend", options={...})``.

Environment switches (read when a plan is built) override the defaults, and explicit options
override both.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

__all__ = ["Options", "parse_options", "QUANTIZE_MODES", "CONVROT_GROUPS", "ATTENTION_DTYPES"]

#: the values of the ``quantize`` option
QUANTIZE_MODES = ("w8a8",)
#: the ConvRot groups (orders of the regular Hadamard matrices) of ``convrot_group``
CONVROT_GROUPS = (1, 4, 16, 64, 256)
#: the values of the ``attention_dtype`` option
ATTENTION_DTYPES = ("bfloat16", "float16")


def _env_flag(name: str) -> bool | None:
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    return v.strip().lower() not in ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class Options:
    """What a plan is built with.

    - ``fusion``: run fusion rules (default True; ``FXB_DISABLE_FUSION=1`` turns it off).
    - ``force_native``: run every node with its native ATen kernel (``FXB_FORCE_NATIVE=1``).
    - ``dump``: print the node list after each pass and the memory summary (``FXB_DUMP=1``).
    - ``streams``: overlap independent branches on an auxiliary CUDA stream (``FXB_STREAMS``);
      None: decide per plan.
    - ``cuda_graphs``: capture each CUDA plan into one CUDA graph (``FXB_CUDA_GRAPHS=1``).
    - ``validate_inputs``: check shapes and dtypes of every call, also behind Dynamo's guards.
    - ``device_type``: select kernels for CPU tensors as if they lived on a device of this type
      (a test-only device backed by CPU tensors, to exercise placement without a GPU).
    - ``quantize``: ``"w8a8"`` rewrites eligible linear layers (float32 weights that are graph
      inputs) into INT8 ``sd.linear_i8.v1`` steps (``FXB_QUANTIZE=w8a8``); None: off.  The
      plan's report names each layer left in float and why.
    - ``convrot_group``: the largest ConvRot rotation group of ``quantize`` (1, 4, 16, 64 or
      256; 1 = no rotation; default 256); a layer whose K it does not divide takes the largest
      smaller group that does.
    - ``quantize_min_size``: the smallest linear layer ``quantize`` rewrites, in multiply-adds
      of its GEMM (``M * K * N``); None (default): on the CPU, the profile's ``w8a8_layers``
      decision (``fxbackend.cpu.w8a8_limits``: a layer too small for the int8 GEMM to repay
      its quantize and epilogue passes and its weight check stays in float32, and the report
      says so), no limit elsewhere; 0: every eligible layer (``FXB_QUANTIZE_MIN_SIZE``).
    - ``attention_dtype``: ``"bfloat16"`` or ``"float16"`` runs float32 flash attention in
      that dtype (q, k, v cast, the output cast back; ``patterns/attention.py``;
      ``FXB_ATTENTION_DTYPE``); None (default): attention keeps the model's dtype.  Changes
      results by about the 16-bit rounding.
    - ``concat_in_place``: producers write straight into the result of a concatenation where
      its layout allows, and cats that re-assemble slices of one tensor are elided
      (``fxbackend.concat``; default True, ``FXB_CONCAT_IN_PLACE=0`` turns it off).
    - ``disable_rewrites``: names of rewrite rules not to run (``FXB_DISABLE_REWRITES=a,b``;
      a string of comma-separated names or a sequence of names; default none), for A/B
      measurements and to rule a rewrite out when debugging.  A name no registered rule has
      is an error when the plan is built.
    - ``profile``: time every step (``FXB_PROFILE=1``); ``Plan.profile_report()`` /
      ``CompiledGraph.profile_report()`` say where the time went.  Steps run one at a time
      (no concurrent regions, no CUDA graph; CUDA synchronises around each step).
    - ``eval_callback``: ``fn(node, value)`` called after every step (a profiling or debugging
      hook that must see every node: it turns fusion off).  ``value`` may be a view of arena
      storage that later steps reuse: valid during the callback only (clone to keep it).
    """

    fusion: bool = True
    force_native: bool = False
    dump: bool = False
    streams: bool | None = None
    cuda_graphs: bool = False
    validate_inputs: bool = False
    eval_callback: Any = None
    device_type: str | None = None
    quantize: str | None = None
    convrot_group: int = 256
    quantize_min_size: int | None = None
    concat_in_place: bool = True
    attention_dtype: str | None = None
    profile: bool = False
    disable_rewrites: tuple = ()


def _names(v: Any, what: str) -> tuple:
    """A tuple of names from a comma-separated string or a sequence of strings."""
    if isinstance(v, str):
        return tuple(n.strip() for n in v.split(",") if n.strip())
    if isinstance(v, (list, tuple, set, frozenset)) and all(isinstance(n, str) for n in v):
        return tuple(sorted(v)) if isinstance(v, (set, frozenset)) else tuple(v)
    raise ValueError(f"fxbackend option {what!r} must be a comma-separated str or a sequence "
                     f"of rule names, got {v!r}")


def _min_size(v: Any, what: str) -> int:
    """A non-negative int from an int or a decimal string, else ValueError naming ``what``."""
    if isinstance(v, str):
        try:
            v = int(v.strip())
        except ValueError:
            pass
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{what} must be a non-negative int (multiply-adds) or None, got {v!r}")
    return v


def parse_options(options: Mapping[str, Any] | None = None) -> Options:
    """Options from the environment, then ``options``; an unknown key is a ValueError."""
    fields = {f.name: f for f in dataclasses.fields(Options)}
    values: dict[str, Any] = {}
    env = {
        "fusion": (lambda: None if _env_flag("FXB_DISABLE_FUSION") is None
                   else not _env_flag("FXB_DISABLE_FUSION")),
        "force_native": lambda: _env_flag("FXB_FORCE_NATIVE"),
        "dump": lambda: _env_flag("FXB_DUMP"),
        "streams": lambda: _env_flag("FXB_STREAMS"),
        "cuda_graphs": lambda: _env_flag("FXB_CUDA_GRAPHS"),
        "quantize": lambda: os.environ.get("FXB_QUANTIZE") or None,
        "quantize_min_size": lambda: _min_size(os.environ["FXB_QUANTIZE_MIN_SIZE"],
                                               "FXB_QUANTIZE_MIN_SIZE")
        if os.environ.get("FXB_QUANTIZE_MIN_SIZE", "").strip() else None,
        "concat_in_place": lambda: _env_flag("FXB_CONCAT_IN_PLACE"),
        "profile": lambda: _env_flag("FXB_PROFILE"),
        "attention_dtype": lambda: os.environ.get("FXB_ATTENTION_DTYPE") or None,
        "disable_rewrites": lambda: _names(os.environ["FXB_DISABLE_REWRITES"],
                                           "disable_rewrites")
        if os.environ.get("FXB_DISABLE_REWRITES") else None,
    }
    for name, read in env.items():
        v = read()
        if v is not None:
            values[name] = v
    for key, v in dict(options or {}).items():
        if key not in fields:
            raise ValueError(f"unknown fxbackend option {key!r}; valid options are: "
                             f"{', '.join(sorted(fields))}")
        if key == "device_type":
            if v is not None and not isinstance(v, str):
                raise ValueError(f"fxbackend option 'device_type' must be a str, got {v!r}")
        elif key == "eval_callback":
            if v is not None and not callable(v):
                raise ValueError(f"fxbackend option 'eval_callback' must be callable(node, "
                                 f"value), got {v!r}")
        elif key == "streams":
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"fxbackend option 'streams' must be True, False or None, "
                                 f"got {v!r}")
        elif key in ("quantize", "attention_dtype"):
            pass  # checked below, with the environment's value
        elif key == "disable_rewrites":
            v = _names(v, key)
        elif key == "quantize_min_size":
            v = None if v is None else _min_size(v, "fxbackend option 'quantize_min_size'")
        elif key == "convrot_group":
            if isinstance(v, bool) or v not in CONVROT_GROUPS:
                raise ValueError(f"fxbackend option 'convrot_group' must be one of "
                                 f"{CONVROT_GROUPS}, got {v!r}")
        elif not isinstance(v, bool):
            raise ValueError(f"fxbackend option {key!r} must be a bool, got {v!r}")
        values[key] = v
    q = values.get("quantize")
    if q is not None and q not in QUANTIZE_MODES:
        raise ValueError(f"fxbackend option 'quantize' (or FXB_QUANTIZE) must be one of "
                         f"{QUANTIZE_MODES} or None, got {q!r}")
    a = values.get("attention_dtype")
    if a is not None and a not in ATTENTION_DTYPES:
        raise ValueError(f"fxbackend option 'attention_dtype' (or FXB_ATTENTION_DTYPE) must be "
                         f"one of {ATTENTION_DTYPES} or None, got {a!r}")
    return Options(**values)
