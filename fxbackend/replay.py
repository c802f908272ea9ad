"""Saving and replaying plans: the public names, in one place.

The code lives in :mod:`fxbackend.planfile` (the file format: container, codec, op resolution,
load-time checks, ``describe``), :mod:`fxbackend.exported` (:class:`ExportedPlan` and
:func:`load`) and :mod:`fxbackend.exporter` (plans from models, and :func:`save`, which also
takes a graph ``torch.compile`` compiled).  ``docs/FORMAT.md`` describes the file byte by byte.
"""
from __future__ import annotations

from .exported import ExportedPlan, load
from .exporter import save
from .inputs import SymbolRange
from .planfile import (FORMAT_VERSION, MAGIC, OLDEST_FORMAT_VERSION, ReplayError, describe,
                       portable_attention, read_sections, write_sections)

__all__ = ["ReplayError", "ExportedPlan", "SymbolRange", "save", "load", "describe",
           "read_sections", "write_sections", "portable_attention", "FORMAT_VERSION",
           "OLDEST_FORMAT_VERSION", "MAGIC"]
