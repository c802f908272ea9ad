"""The registration generation: a counter bumped by every change to what is registered
(kernels, custom ops, fusion and rewrite rules).  A plan records the generation it was built
under and is rebuilt when the counter has moved on.

Its own module so that the op table (:mod:`fxbackend.ops`) and the kernel registry
(:mod:`fxbackend.registry`, which reads the op table) both bump it without importing each
other both ways.
"""
from __future__ import annotations

import threading

__all__ = ["generation", "bump"]

_lock = threading.Lock()
_generation = 0


def generation() -> int:
    """A counter bumped by every registration change; plans built under an older one rebuild."""
    return _generation


def bump() -> None:
    """Move the counter on (every registration and unregistration calls this)."""
    global _generation
    with _lock:
        _generation += 1
