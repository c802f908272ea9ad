"""Counters since the last :func:`reset_stats`, read with :func:`stats`.

Per-call work is counted once per call (a plan's per-call counts are multiplied out when the
stats are read), so counting costs the executor one increment per call.
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Any

__all__ = ["stats", "reset_stats", "bump", "record_plan_call", "register_plan_counts"]

_lock = threading.Lock()
_counters: Counter = Counter()
_plan_calls: Counter = Counter()
_plan_counts: dict[int, dict[str, Counter]] = {}
_next_plan = [0]


def bump(name: str, n: int = 1) -> None:
    """Add ``n`` to counter ``name``."""
    with _lock:
        _counters[name] += n


def set_max(name: str, value: int) -> None:
    """Keep the largest value seen for ``name`` (e.g. arena bytes of the largest plan)."""
    with _lock:
        _counters[name] = max(_counters[name], value)


def register_plan_counts(per_call: dict[str, Counter]) -> int:
    """Remember what one call of a plan executes; returns the key for :func:`record_plan_call`."""
    with _lock:
        key = _next_plan[0]
        _next_plan[0] += 1
        _plan_counts[key] = per_call
    return key


def record_plan_call(key: int) -> None:
    _plan_calls[key] += 1


def release_plan(key: int) -> None:
    """A plan is dropped: fold what its calls executed into the totals and forget it."""
    with _lock:
        per = _plan_counts.pop(key, None)
        n = _plan_calls.pop(key, 0)
        if per is None or not n:
            return
        for name, c in per["steps"].items():
            _counters["steps:" + name] += c * n
        _counters["copies"] += per["copies"] * n
        _counters["calls"] += n


def reset_stats() -> None:
    """Zero every counter."""
    with _lock:
        _counters.clear()
        _plan_calls.clear()


def stats() -> dict[str, Any]:
    """Counters since :func:`reset_stats`:

    ``graphs_compiled``, ``nodes_lowered``, ``fallback_graphs`` (graphs handed to aot_autograd's
    default path, e.g. because they need autograd), ``plans_built``, ``replans`` (plans built for a
    new input-shape signature of an already compiled graph), ``calls``, ``steps_by_kernel``
    (steps executed, by kernel name), ``fusions_by_rule``, ``copies`` (counted copies executed),
    ``rewrites_by_rule`` (idioms replaced by custom ops, per plan built),
    ``arena_bytes``, ``intermediate_bytes`` and ``workspace_bytes`` (summed over plans built),
    ``concurrent_regions`` (fork/join regions whose branches run side by side, summed over
    plans built), ``concat_parts_in_place`` (parts of concatenations their producers write in
    place), ``identity_cats`` (cats of slices elided), ``identity_clones`` (clones of values
    already in the clone's layout elided), ``constants_folded`` (steps that read no input,
    computed once when the plan was built) and ``weight_steps_cached`` (steps computed from
    weights alone, kept between calls until a weight changes), summed over plans built.
    """
    with _lock:
        out: dict[str, Any] = {k: _counters.get(k, 0) for k in (
            "graphs_compiled", "nodes_lowered", "fallback_graphs", "plans_built", "replans",
            "arena_bytes", "intermediate_bytes", "workspace_bytes", "concurrent_regions",
            "concat_parts_in_place", "identity_cats", "identity_clones", "constants_folded",
            "weight_steps_cached")}
        steps: Counter = Counter()
        fusions: Counter = Counter()
        copies = 0
        calls = 0
        for key, n in _plan_calls.items():
            per = _plan_counts.get(key)
            if per is None:
                continue
            calls += n
            for name, c in per["steps"].items():
                steps[name] += c * n
            copies += per["copies"] * n
        rewrites: Counter = Counter()
        for k, v in _counters.items():
            if k.startswith("fusion:"):
                fusions[k[len("fusion:"):]] += v
            elif k.startswith("rewrite:"):
                rewrites[k[len("rewrite:"):]] += v
        for k, v in _counters.items():  # plans already dropped
            if k.startswith("steps:"):
                steps[k[len("steps:"):]] += v
        out["calls"] = calls + _counters.get("calls", 0)
        out["steps_by_kernel"] = dict(steps)
        out["copies"] = copies + _counters.get("copies", 0)
        out["fusions_by_rule"] = dict(fusions)
        out["rewrites_by_rule"] = dict(rewrites)
        return out
