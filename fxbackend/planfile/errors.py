"""The plan file's error, and the bounds on what a file may hold."""
from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Iterator

__all__ = ["ReplayError", "MAX_INT", "MAX_DEPTH", "MAX_DIMS", "MAX_EXPR_NODES", "short",
           "errors_name"]

MAX_INT = 2 ** 62  # bound on sizes, ids and ranges read from a file (params are int64)
MAX_DEPTH = 48  # bound on the nesting of values and expressions read from a file
MAX_DIMS = 64
MAX_EXPR_NODES = 512


class ReplayError(ValueError):
    """A plan cannot be saved, loaded or replayed; the message names what was wrong."""


def short(j: Any, limit: int = 80) -> str:
    """``j`` as JSON text (its ``repr`` where JSON cannot hold it), cut to ``limit``."""
    try:
        txt = json.dumps(j)
    except (TypeError, ValueError):
        txt = repr(j)
    return txt if len(txt) <= limit else txt[:limit - 3] + "..."


@contextlib.contextmanager
def errors_name(path: str | os.PathLike) -> Iterator[None]:
    """Every error raised inside, as a :class:`ReplayError` that starts with ``path``: the
    loader's own errors as they are, a structure nested too deeply, and any other exception
    (a check the loader lacks) named by its type."""
    where = os.fspath(path)
    try:
        yield
    except ReplayError as e:
        raise ReplayError(f"{where}: {e}") from None
    except RecursionError:
        raise ReplayError(f"{where}: structures nested too deeply") from None
    except Exception as e:  # a check this loader lacks: still the project's error, named
        raise ReplayError(f"{where}: malformed plan: {type(e).__name__}: {e}") from e
