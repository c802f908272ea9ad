"""The plan file: one file per plan, loaded anywhere, run without Dynamo or the model's code.

``docs/FORMAT.md`` describes the file byte by byte.  The modules, each depending only on those
before it: :mod:`.errors` (:class:`ReplayError`, bounds), :mod:`.container` (the binary
layout: header, JSON and weights sections), :mod:`.codec` (values, symbolic sizes, metadata),
:mod:`.resolve` (what an op name may resolve to), :mod:`.graphs` (the node list),
:mod:`.checks` (load-time checks), :mod:`.portable` (moving a graph to another device type),
:mod:`.document` (a plan's parts from and to a file) and :mod:`.summary` (:func:`describe`,
what ``inspect`` prints).  The runtime that calls a loaded plan is :mod:`fxbackend.exported`;
this package never imports it, nor :mod:`fxbackend.exporter`.

Contracts:
- Loading never executes code from the file: no pickle, no ``eval``, no parsing of expressions
  by sympy.  An op name resolves only against ATen/prims overloads (``torch.ops.aten``,
  ``torch.ops.prims``), the symbolic-int helpers of :data:`fxbackend.lower.SYM_OPS`,
  ``getitem``, and custom ops registered with :func:`fxbackend.register_op`.  Anything else is a
  :class:`ReplayError` naming the op (and the extension module the file says provides it,
  which is never imported automatically).
- Every failure to read a file is a :class:`ReplayError` (a ``ValueError``) whose message names
  what was wrong: bad header, truncated file, corrupted or malformed JSON, unknown op, weights
  missing or misshaped, a format version newer than this loader.
- Saving checks everything first and writes nothing when it fails (a custom op without the
  ``serialize``/``deserialize`` capabilities, a Python callable without a schema, a value the
  format cannot hold); the file is written to a temporary name and renamed into place.
- A loaded plan's metadata is checked against the ops themselves (every node's shape, strides
  and dtype are recomputed on the meta device and must match the file).
"""
from __future__ import annotations

from .container import (FORMAT_VERSION, MAGIC, OLDEST_FORMAT_VERSION, read_file,
                        read_sections, write_sections)
from .summary import describe
from .document import PlanParts, decode_plan, encode_plan, save_plan
from .errors import ReplayError, errors_name
from .portable import portable_attention

__all__ = ["ReplayError", "errors_name", "FORMAT_VERSION", "OLDEST_FORMAT_VERSION", "MAGIC",
           "read_file", "read_sections", "write_sections", "PlanParts", "decode_plan",
           "encode_plan", "save_plan", "portable_attention", "describe"]
