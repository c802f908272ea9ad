"""Loading extensions that live outside the package.

Extensions register ops, kernels and fusion rules when imported.  They come from the
entry-point group ``fxbackend.extensions`` (an entry point naming a module is imported; one
naming a callable is called with no arguments) and from ``FXB_EXTENSIONS=module,module``.
A failing import is an ImportError naming the extension.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import threading

__all__ = ["load_extensions", "loaded_extensions"]

_lock = threading.RLock()
_loaded: list[str] = []
_loading: set[str] = set()  # being imported now: an extension that loads extensions skips them


def loaded_extensions() -> list[str]:
    """Names of the extensions loaded so far, in load order."""
    return list(_loaded)


def load_extensions() -> list[str]:
    """Load every extension not loaded yet (entry points, then ``FXB_EXTENSIONS``); returns the
    names loaded by this call.  Called by the backend before it compiles a graph."""
    new: list[str] = []

    def load(key: str, what: str, loader) -> None:
        if key in _loaded or key in _loading:
            return
        _loading.add(key)
        try:
            loader()
        except Exception as e:
            raise ImportError(f"fxbackend extension {what} failed to load: "
                              f"{type(e).__name__}: {e}") from e
        finally:
            _loading.discard(key)
        _loaded.append(key)
        new.append(key)

    def run_entry_point(ep) -> None:
        obj = ep.load()
        if callable(obj):
            obj()

    with _lock:
        for ep in importlib.metadata.entry_points(group="fxbackend.extensions"):
            key = f"entry point {ep.name} ({ep.value})"
            load(key, key, lambda ep=ep: run_entry_point(ep))
        for mod in os.environ.get("FXB_EXTENSIONS", "").split(","):
            mod = mod.strip()
            if mod:
                load(mod, f"{mod!r} (from FXB_EXTENSIONS)",
                     lambda mod=mod: importlib.import_module(mod))
    return new
