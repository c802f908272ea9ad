"""Idiom rewrites: rules that recognise a computation written out in ATen nodes and replace it
with one custom-op node (the "canonicalise" step of the pipeline).

A rewrite rule is an object with ``name`` and ``rewrite(graph) -> int`` (how many instances it
replaced).  It builds the new node with :func:`fxbackend.op_create`, redirects readers with
:func:`replace_uses`, and leaves the replaced nodes in place: the engine drops nodes nobody
reads afterwards.  Rules match on dataflow (ops, use counts, shapes), never on names, and
decline (leave the graph alone) rather than raise.  They run per plan, on concrete shapes,
before fusion.
"""
from __future__ import annotations

import threading
from typing import Any

from . import registry
from .ir import Graph, Node

__all__ = ["register_rewrite", "unregister_rewrite", "rewrites", "apply_rewrites",
           "replace_uses"]

_lock = threading.RLock()
_rules: list[Any] = []


def register_rewrite(rule: Any) -> Any:
    """Register an idiom rewrite rule (instance, or class: instantiated once)."""
    if isinstance(rule, type):
        rule = rule()
    for attr in ("name", "rewrite"):
        if not hasattr(rule, attr):
            raise TypeError(f"rewrite rule {rule!r} has no {attr!r}; a rule needs name and "
                            f"rewrite(graph) -> int")
    with _lock:
        if any(r.name == rule.name for r in _rules):
            raise ValueError(f"a rewrite rule named {rule.name!r} is already registered")
        _rules.append(rule)
        registry._bump()
    return rule


def unregister_rewrite(rule: Any) -> None:
    """Remove a rule registered with :func:`register_rewrite`."""
    with _lock:
        _rules.remove(rule)
        registry._bump()


def rewrites() -> list[Any]:
    """The registered rewrite rules, in registration order."""
    return list(_rules)


def replace_uses(graph: Graph, old: Node, new: Node) -> None:
    """Make every node after ``new`` (and the graph outputs) read ``new`` where it read ``old``."""
    from .fusion import _replace_uses
    _replace_uses(graph, old, new, graph.nodes.index(new) + 1)
    if old.is_output:
        new.is_output = True
        old.is_output = False


def apply_rewrites(graph: Graph) -> dict[str, int]:
    """Run every rule once over ``graph``; returns ``{rule name: instances replaced}``."""
    done: dict[str, int] = {}
    for rule in rewrites():
        n = int(rule.rewrite(graph) or 0)
        if n:
            done[rule.name] = n
    return done
