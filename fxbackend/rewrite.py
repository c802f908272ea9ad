"""Idiom rewrites: rules that recognise a computation written out in ATen nodes and replace it
with one custom-op node (the "canonicalise" step of the pipeline).

A rewrite rule is an object with ``name`` and ``rewrite(graph) -> int`` (how many instances it
replaced), or ``rewrite(graph, ctx) -> int`` to receive a :class:`RewriteContext`: the plan's
options (a rule that only applies when the user asks for it, such as ``quantize``) and
``ctx.decline(nodes, reason)``, which puts an instance left alone, and why, in the plan's
report.  It builds the new node with :func:`fxbackend.op_create`, redirects readers with
:func:`replace_uses`, and leaves the replaced nodes in place: the engine drops nodes nobody
reads afterwards.  Rules match on dataflow (ops, use counts, shapes), never on names, and
decline (leave the graph alone) rather than raise.  They run per plan, on concrete shapes,
before fusion.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
from typing import Any, Sequence

import torch

from . import registry
from .ir import Graph, Node, TensorMeta

__all__ = ["register_rewrite", "unregister_rewrite", "rewrites", "apply_rewrites",
           "replace_uses", "RewriteContext", "AtenBuilder", "result_meta"]

_lock = threading.RLock()
_rules: list[Any] = []
_wants_ctx: dict[int, bool] = {}  # id(rule) -> its rewrite takes a RewriteContext


@dataclasses.dataclass
class RewriteContext:
    """What a rewrite rule may read besides the graph: the plan's ``options``
    (:class:`fxbackend.Options`), :meth:`constant` for the value of an input-free node, and
    :meth:`decline` to report an instance it leaves alone."""

    options: Any
    #: (rule name, [node ids], reason) of every instance declined
    declined: list = dataclasses.field(default_factory=list)
    rule: str = ""
    _constants: dict = dataclasses.field(default_factory=dict, repr=False)

    def constant(self, node: Node) -> Any:
        """The tensor ``node`` holds on every call when it reads no graph input (a constant,
        or ATen steps over constants: an index or a table computed from sizes alone), computed
        now with the op's own kernels; None when it depends on an input (or is too large to
        evaluate here: ``fxbackend.fold.MAX_BYTES``).  Read-only: do not write to it.  Values
        are kept for the rest of this rewrite pass: a rule that changes the steps a value
        came from must not ask for it again."""
        from .fold import constant_value
        return constant_value(node, self._constants)

    def decline(self, nodes: Sequence[Node] | Node, reason: str) -> None:
        """Record that the running rule leaves ``nodes`` alone because of ``reason`` (shown in
        the plan's report and by ``fxbackend.explain``)."""
        nodes = [nodes] if isinstance(nodes, Node) else list(nodes)
        self.declined.append((self.rule, [n.id for n in nodes], str(reason)))


def _takes_ctx(rule: Any) -> bool:
    try:
        params = [p for p in inspect.signature(rule.rewrite).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return len(params) >= 2


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
        _wants_ctx[id(rule)] = _takes_ctx(rule)
        registry._bump()
    return rule


def unregister_rewrite(rule: Any) -> Any:
    """Remove a rule registered with :func:`register_rewrite`: the instance it returned, or
    the class it was given (its one registered instance).  Returns the instance removed (to
    register again later); raises ValueError naming ``rule`` when none is registered."""
    with _lock:
        found = next((r for r in _rules if r is rule or
                      (isinstance(rule, type) and type(r) is rule)), None)
        if found is None:
            raise ValueError(f"unregister_rewrite: {rule!r} is not a registered rewrite rule "
                             f"(registered: {[r.name for r in _rules]})")
        _rules.remove(found)
        _wants_ctx.pop(id(found), None)
        registry._bump()
    return found


def rewrites() -> list[Any]:
    """The registered rewrite rules, in registration order."""
    return list(_rules)


def replace_uses(graph: Graph, old: Node, new: Node) -> None:
    """Make every node after ``new`` (and the graph outputs) read ``new`` where it read ``old``."""
    from .fusion import replace_uses_from
    replace_uses_from(graph, old, new, graph.nodes.index(new) + 1)
    if old.is_output:
        new.is_output = True
        old.is_output = False


def apply_rewrites(graph: Graph, ctx: RewriteContext | None = None) -> dict[str, int]:
    """Run every rule once over ``graph``, except those the options' ``disable_rewrites``
    names (a name no rule has is a ValueError); returns ``{rule name: instances replaced}``.
    ``ctx`` (default: default options) goes to the rules whose ``rewrite`` takes one."""
    if ctx is None:
        from .options import Options
        ctx = RewriteContext(Options())
    rules = rewrites()
    skip = set(getattr(ctx.options, "disable_rewrites", ()) or ())
    unknown = skip - {r.name for r in rules}
    if unknown:
        raise ValueError(f"fxbackend option 'disable_rewrites' (or FXB_DISABLE_REWRITES) names "
                         f"no registered rewrite rule: {sorted(unknown)}; registered: "
                         f"{sorted(r.name for r in rules)}")
    done: dict[str, int] = {}
    for rule in rules:
        if rule.name in skip:
            continue
        if _wants_ctx.get(id(rule), False):
            ctx.rule = rule.name
            n = int(rule.rewrite(graph, ctx) or 0)
        else:
            n = int(rule.rewrite(graph) or 0)
        if n:
            done[rule.name] = n
    return done


def result_meta(node: Node, metas: dict | None = None,
                fake: bool = False) -> TensorMeta | tuple | None:
    """``node``'s result metadata for sources laid out as ``metas`` says (else as their own
    metadata): its op run on the meta device, where views and most ops follow the same stride
    rules as on any other, or with ``fake`` on fake tensors of the sources' device (what a CPU
    convolution needs: the meta device's ignores the CPU's channels-last rule).  For an op
    with several outputs (attention's output and log-sum-exp), a tuple with one entry per
    output (None for one that is not a tensor).  None when the op cannot run so."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .native import call_args
    metas = metas or {}

    def src(s: Node) -> torch.Tensor:
        m = metas.get(s, s.meta)
        return torch.empty_strided(m.shape, m.stride, dtype=m.dtype,
                                   device=m.device if fake else "meta")

    try:
        with FakeTensorMode() if fake else contextlib.nullcontext():
            a, kw = call_args(node, src, lambda v: v)
            out = node.target(*a, **kw)
    except Exception:  # no meta/fake implementation for these arguments
        return None
    device = node.srcs[0].meta.device

    def meta(t: Any) -> TensorMeta | None:
        if not isinstance(t, torch.Tensor):
            return None
        return TensorMeta(tuple(t.shape), tuple(t.stride()), t.dtype, device, t.storage_offset())
    if isinstance(out, (tuple, list)):
        return tuple(meta(t) for t in out)
    return meta(out)


class AtenBuilder:
    """Inserts ATen nodes before ``at`` in ``graph`` for a rewrite rule:
    ``make = AtenBuilder(graph, at); y = make("addmm", [b, x, w])``, ``make("view", [y],
    {"size": [...]})``.  Each node takes its ``.default`` overload, or the one ``name`` names
    after a dot (``make("select.int", [t], {"dim": -1, "index": 0})``), one source per Tensor
    argument of its schema (in order) and every source left for its ``Tensor[]`` argument
    (``make("stack", [a, b], {"dim": -1})``), the metadata its op gives on the meta device
    (:func:`result_meta`), and is a view of its first source when the schema says the result
    aliases it (``view``, ``t``, ``permute``, ``unsqueeze``, ``expand``, ...)."""

    def __init__(self, graph: Graph, at: Node) -> None:
        self.graph, self.at = graph, at

    def __call__(self, name: str, srcs: list, params: dict | None = None) -> Node:
        base, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, base), overload or "default")
        single = sum(isinstance(a.type, torch.TensorType) for a in op._schema.arguments)
        layout = tuple((a.name, True) if isinstance(a.type, torch.TensorType)
                       else (a.name, (True,) * (len(srcs) - single))
                       for a in op._schema.arguments
                       if isinstance(a.type, torch.TensorType) or
                       str(a.type) in ("Tensor[]", "List[Tensor]"))
        alias = op._schema.returns[0].alias_info
        node = self.graph.new_node(f"aten.{base}.{overload or 'default'}", srcs, params or {},
                                   None, target=op, tensor_layout=layout,
                                   view_of=srcs[0] if alias is not None and not alias.is_write
                                   else None)
        node.meta = result_meta(node)
        self.graph.insert(self.graph.nodes.index(self.at), node)
        return node
