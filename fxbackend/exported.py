"""The exported-plan runtime: :class:`ExportedPlan` (calling convention, weights, reports) and
:func:`load`.

What is saved is the lowered node list (``CompiledGraph.graph``: after ``lower`` and the pass
pipeline, *before* rewrites, fusion, kernel selection and memory planning, which every
:class:`~fxbackend.executor.Plan` does for its own device), the weights, and how to call it.
Loading rebuilds a :class:`~fxbackend.executor.CompiledGraph` for the load device, so rewrites,
fusions, kernel selection and memory planning rerun there: a file saved on the CPU loads on
CUDA and the other way round.  The file itself is :mod:`fxbackend.planfile`'s
(docs/FORMAT.md); plans from models are :mod:`fxbackend.exporter`'s.
"""
from __future__ import annotations

import itertools
import os
from typing import Any, Mapping, Sequence

import torch

from .concrete import data_dependent
from .executor import CompiledGraph, Plan
from .inputs import SymbolRange, check_inputs, relaid
from .ir import Node, ScalarMeta, TensorMeta, storage_root
from .options import parse_options
from .planfile import PlanParts, ReplayError, decode_plan, errors_name, read_file, save_plan
from .stages import Stages

__all__ = ["ExportedPlan", "load"]

_IDS = itertools.count()
_MISSING = object()


class ExportedPlan:
    """A lowered graph with its weights and calling convention: run it, save it, swap weights.

    Built by :func:`fxbackend.export` (``torch.export``), :func:`fxbackend.from_compiled` (a
    graph that ``torch.compile(backend="fxbackend")`` compiled) or :func:`load`.  Calls go
    through a :class:`~fxbackend.executor.CompiledGraph` (``.compiled``): one :class:`Plan` per
    input-shape signature, built on first use on the plan's device.

    - ``plan(*args, **kwargs)``: the exported model's calling convention; returns the model's
      output structure (tuples, lists, dicts) for export plans, a flat list of outputs for plans
      from ``torch.compile`` (whose graph has no output structure).
    - ``plan.run(inputs)``: ``inputs`` is a list in :attr:`input_names` order or a mapping from
      those names (or ``"0"``, ``"1"``, ...); returns the flat list of outputs.
    - ``plan.update_weights(state_dict, strict=True)``, ``plan.save(path)``, ``plan.report()``,
      ``plan.memory_report()``, ``plan.graph`` (the lowered node list).

    A graph with data-dependent steps (``nonzero``: result sizes known per call only) runs
    in stages (:class:`fxbackend.stages.Stages`): ``.compiled`` is then a :class:`Stages`.

    Weights are the plan's tensors, passed to every call.  A plan from :func:`fxbackend.export`
    or :func:`fxbackend.from_compiled` shares them with the model it came from (no copy), so
    :meth:`update_weights` writes into that model's parameters too; a loaded plan owns them.
    """

    def __init__(self, compiled: CompiledGraph, *, names: dict[Node, str],
                 weights: dict[str, torch.Tensor], weight_kinds: dict[str, str],
                 symbols: dict[Any, SymbolRange], in_tree: Any = None, out_tree: Any = None,
                 source: str = "export", user_inputs: Sequence[Node] | None = None,
                 custom_modules: dict | None = None) -> None:
        self.compiled = compiled
        self.graph = compiled.graph
        self.names = dict(names)
        self.weights = weights
        self.weight_kinds = weight_kinds
        self.symbols = symbols
        self.in_tree = in_tree
        self.out_tree = out_tree
        self.source = source
        self.custom_modules = dict(custom_modules or {})
        self._slots, self.derived_inputs = self._call_slots()
        if user_inputs is None:
            user_inputs = [n for kind, n in self._slots if kind == "user"]
        self.user_inputs = list(user_inputs)
        self._position = {n: i for i, n in enumerate(self.user_inputs)}
        # input signature -> (symbol values, ((input position, strides it is copied to), ...))
        self._checked: dict = {}
        self._scalar_positions = [i for i, n in enumerate(self.user_inputs)
                                  if isinstance(n.meta, ScalarMeta)]
        # user inputs the graph writes in place (the model's own writes into its inputs)
        self._written = {storage_root(n)[0] for n in self.graph.nodes
                         if n.inplace_of is not None} & set(self.user_inputs)
        for n in self.graph.nodes:
            if n.op == "constant" and n.annotations.get("value") is not \
                    self.weights[self.names[n]]:
                n.annotations["value"] = self.weights[self.names[n]]
        steps = data_dependent(self.graph)
        if steps:  # sizes known per call only: planned and run in stages
            self.compiled = Stages(self.graph, compiled.options, compiled.name, steps)

    def _call_slots(self) -> tuple[list[tuple[str, Any]], list[Node]]:
        """What each graph input gets on a call: ``("weight", name)``, ``("derived", symbol)``
        (a scalar input that is a size of a user input's tensor) or ``("user", node)``; and
        the derived inputs."""
        tensor_dims = {}
        for n in self.graph.inputs:
            if not n.is_weight and isinstance(n.meta, TensorMeta):
                for d, s in enumerate(n.meta.shape):
                    if getattr(s, "is_Symbol", False):
                        tensor_dims.setdefault(s, (n, d))
        slots: list[tuple[str, Any]] = []
        derived = []
        for n in self.graph.inputs:
            if n.is_weight:
                slots.append(("weight", self.names[n]))
            elif n.is_scalar and getattr(n.annotations.get("expr"), "is_Symbol", False) \
                    and n.annotations["expr"] in tensor_dims:
                slots.append(("derived", n.annotations["expr"]))
                derived.append(n)
            else:
                slots.append(("user", n))
        return slots, derived

    @classmethod
    def from_parts(cls, parts: PlanParts, options: Any) -> "ExportedPlan":
        """The plan of a file's parts (:func:`fxbackend.planfile.decode_plan`), with backend
        ``options`` (an :class:`~fxbackend.options.Options`)."""
        plan = cls(CompiledGraph(parts.graph, options, f"loaded{next(_IDS)}"),
                   names=parts.names, weights=parts.weights, weight_kinds=parts.weight_kinds,
                   symbols=parts.symbols, in_tree=parts.in_tree, out_tree=parts.out_tree,
                   source=parts.source, user_inputs=parts.user_inputs,
                   custom_modules=parts.custom_modules)
        if [n.id for n in plan.derived_inputs] != [n.id for n in parts.derived_inputs]:
            raise ReplayError("the derived inputs do not match sizes of the user inputs")
        return plan

    def parts(self) -> PlanParts:
        """What a file of this plan holds (:func:`fxbackend.planfile.save_plan`)."""
        return PlanParts(self.graph, self.names, self.weights, self.weight_kinds, self.symbols,
                         self.user_inputs, self.derived_inputs, self.in_tree, self.out_tree,
                         self.source, self.custom_modules)

    # -- what it takes ------------------------------------------------------------------------
    @property
    def input_names(self) -> list[str]:
        """Names of the user inputs, in the order :meth:`run` takes a list."""
        return [self.names[n] for n in self.user_inputs]

    @property
    def device(self) -> torch.device:
        """The device the plan runs on (its inputs' and weights' device)."""
        for n in self.graph.nodes:
            if isinstance(n.meta, TensorMeta):
                return n.meta.device
        return torch.device("cpu")

    @property
    def plans(self) -> list[Plan]:
        """The plans built so far (one per input-shape signature, and stage)."""
        return self.compiled.all_plans()

    def describe_inputs(self) -> list[str]:
        """One line per user input: name and metadata (symbolic sizes with their ranges)."""
        lines = []
        for n in self.user_inputs:
            lines.append(f"{self.names[n]}: {n.meta.short()}")
        for sym, rng in sorted(self.symbols.items(), key=lambda kv: str(kv[0])):
            hi = "inf" if rng.max is None else rng.max
            lines.append(f"  {sym} in [{rng.min}, {hi}]" +
                         (f" (exported at {rng.hint})" if rng.hint is not None else ""))
        return lines

    # -- calling ------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run with the exported model's calling convention (see the class docstring)."""
        if self.in_tree is None:
            values = self._values_from_names(dict(kwargs), list(args))
        else:
            values = self._bind_call(args, kwargs)
        outs = self.run(values)
        if self.out_tree is None:
            return outs
        return _build_tree(self.out_tree, outs)

    def run(self, inputs: Sequence[Any] | Mapping[str, Any]) -> list:
        """Run on the user inputs (a list in :attr:`input_names` order, or a mapping from those
        names or from ``"0"``, ``"1"``, ...); returns the flat list of outputs."""
        if isinstance(inputs, Mapping):
            values = self._values_from_names(dict(inputs), [])
        else:
            values = list(inputs)
            if len(values) != len(self.user_inputs):
                raise ReplayError(f"expected {len(self.user_inputs)} inputs "
                                  f"{self.input_names}, got {len(values)}")
        for i in self._scalar_positions:  # a number given as a 0-dim tensor: its value
            if isinstance(values[i], torch.Tensor) and values[i].dim() == 0:
                values[i] = values[i].item()
        key = tuple((tuple(v.shape), v.stride(), v.dtype, v.device) if isinstance(v, torch.Tensor)
                    else (type(v), v if isinstance(v, (int, float, str)) else id(v))
                    for v in values)
        seen = self._checked.get(key)
        if seen is None:  # new shapes: check them (sizes, ranges, layouts) once
            checked, bind = self._check_inputs(values)  # relaid where the plan needs it
            fix = tuple((i, b.stride()) for i, (a, b) in enumerate(zip(values, checked))
                        if a is not b and isinstance(b, torch.Tensor))
            if len(self._checked) < 64:
                self._checked[key] = (bind, fix)
        else:
            bind, fix = seen
            checked = list(values) if fix else values
            for i, stride in fix:
                checked[i] = relaid(values[i], stride)
        with torch.no_grad():
            outs = self.compiled.run(self._graph_args(checked, bind))
            for i, _ in fix:  # an input the plan writes, given in another layout: write it back
                if self.user_inputs[i] in self._written:
                    values[i].copy_(checked[i])
        return outs

    def _graph_args(self, values: list, bind: dict) -> list:
        """The graph's inputs for a call: the user inputs ``values`` (checked), the sizes
        derived from them (``bind``) and the weights."""
        args = []
        for kind, x in self._slots:
            if kind == "weight":
                args.append(self.weights[x])
            elif kind == "derived":
                args.append(bind[x])
            else:
                args.append(values[self._position[x]])
        return args

    def _check_inputs(self, values: list) -> tuple[list, dict]:
        """The user inputs checked against the saved metadata and symbol ranges
        (:func:`fxbackend.inputs.check_inputs`): the values, with inputs in another layout
        than the plan's copied to the plan's where that is dense (a ReplayError where it is
        not), and the value of every symbol."""
        return check_inputs(self.user_inputs, values,
                            [f"input {self.names[n]!r}" for n in self.user_inputs],
                            ranges=self.symbols, strides="relayout", scalar_tensors=True,
                            error=ReplayError)

    def sizes_of(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict:
        """``{symbol: int}`` for a call with ``args`` and ``kwargs``, checked as a call is;
        with the sizes of data-dependent results (:class:`Stages`) too, which the steps they
        read compute, run natively."""
        values, bind = self._check_inputs(self._bind_call(args, kwargs))
        if isinstance(self.compiled, Stages):
            with torch.no_grad():
                bind = {**self.compiled.data_sizes(self._graph_args(values, bind)), **bind}
        return bind

    def _bind_call(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list:
        """Flat user inputs from a call shaped like the exported one."""
        values = [_MISSING] * len(self.user_inputs)
        positional, keywords = self.in_tree["tuple"]
        n_pos = len(positional["tuple"])
        if len(args) > n_pos:
            raise ReplayError(f"expected at most {n_pos} positional argument(s), got "
                              f"{len(args)}")
        _bind_tree(positional, tuple(args) + (_MISSING,) * (n_pos - len(args)),
                   "positional arguments", values)
        _bind_tree(keywords, dict(kwargs), "keyword arguments", values)
        missing = [self.input_names[i] for i, v in enumerate(values) if v is _MISSING]
        if missing:
            raise ReplayError(f"missing input(s) {missing}")
        return values

    def _values_from_names(self, named: dict, positional: list) -> list:
        names = self.input_names
        if len(positional) > len(names):
            raise ReplayError(f"expected at most {len(names)} inputs {names}, got "
                              f"{len(positional)}")
        values = positional + [_MISSING] * (len(names) - len(positional))
        for key, v in named.items():
            if key in names:
                i = names.index(key)
            elif isinstance(key, str) and key.isdigit() and int(key) < len(names):
                i = int(key)
            else:
                raise ReplayError(f"unknown input {key!r}; this plan takes {names}")
            if values[i] is not _MISSING:
                raise ReplayError(f"input {names[i]!r} given twice")
            values[i] = v
        missing = [names[i] for i, v in enumerate(values) if v is _MISSING]
        if missing:
            raise ReplayError(f"missing input(s) {missing}; this plan takes {names}")
        return values

    # -- weights ------------------------------------------------------------------------------
    def update_weights(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Copy new values into the plan's weights in place: addresses do not change and
        nothing is re-planned.

        Every given name must be one of the plan's weights (``strict``; otherwise unknown names
        are ignored), and with ``strict`` every parameter and buffer must be given (constants a
        model computes, such as lifted tensors, may be left out).  A shape or dtype that differs
        from the weight's is always an error naming the weight.  Everything is checked before
        anything is written.  Weights that kernels derive data from (the INT8 kernels'
        quantized copies) are re-derived by those kernels on the next call, since the write
        bumps each tensor's version counter.
        """
        todo = self._weight_updates(state_dict, strict)
        with torch.no_grad():
            for cur, v in todo:
                cur.copy_(v)
        # Data a kernel derives from a weight at plan time (quantized copies of the INT8 work)
        # is re-derived by that kernel, not here: copy_ keeps the weight's address and bumps
        # its version counter (``tensor._version``), which such a kernel compares with the one
        # it derived from.  No derived data is stored in the file or in this object.

    def _weight_updates(self, state_dict: Mapping[str, torch.Tensor], strict: bool
                        ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[(weight, new value)]`` of an :meth:`update_weights` call, every one checked."""
        if not isinstance(state_dict, Mapping):
            raise ReplayError(f"update_weights takes a mapping name -> tensor, got "
                              f"{type(state_dict).__name__}")
        unknown = sorted(k for k in state_dict if k not in self.weights)
        if strict and unknown:
            raise ReplayError(f"update_weights: unknown weight name(s) {unknown[:10]}"
                              f"{' ...' if len(unknown) > 10 else ''}; this plan's weights are "
                              f"e.g. {sorted(self.weights)[:5]}")
        if strict:
            missing = sorted(k for k, kind in self.weight_kinds.items()
                             if kind in ("parameter", "buffer") and k not in state_dict)
            if missing:
                raise ReplayError(f"update_weights: missing weight(s) {missing[:10]}"
                                  f"{' ...' if len(missing) > 10 else ''} (strict=True)")
        todo = []
        for k, v in state_dict.items():
            if k not in self.weights:
                continue
            cur = self.weights[k]
            if not isinstance(v, torch.Tensor):
                raise ReplayError(f"weight {k!r}: expected a tensor, got {type(v).__name__}")
            if tuple(v.shape) != tuple(cur.shape):
                raise ReplayError(f"weight {k!r}: expected shape {tuple(cur.shape)}, got "
                                  f"{tuple(v.shape)}")
            if v.dtype != cur.dtype:
                raise ReplayError(f"weight {k!r}: expected dtype {cur.dtype}, got {v.dtype}")
            todo.append((cur, v))
        return todo

    @property
    def weight_bytes(self) -> int:
        """Bytes of the plan's weights (each storage counted once)."""
        seen, total = set(), 0
        for t in self.weights.values():
            key = (t.data_ptr(), t.nbytes)
            if key not in seen:
                seen.add(key)
                total += t.nbytes
        return total

    # -- reports ------------------------------------------------------------------------------
    def memory_report(self) -> str:
        """Weights, and per plan built so far its arena and workspace."""
        lines = [f"weights: {len(self.weights)} tensors, {self.weight_bytes / 2**20:.2f} MB"]
        if not self.plans:
            lines.append("no plan built yet (call the plan once)")
        for p in self.plans:
            lines.append(f"plan {p.name} on {p._plan_device()}: {p.memory.summary()}, workspace "
                         f"{p.workspace_bytes / 2**20:.2f} MB ({p.workspace_bytes} bytes)")
        return "\n".join(lines)

    def report(self) -> str:
        """Inputs, weights, and each built plan's steps with their kernels and what fusion
        did."""
        head = [f"exported plan ({self.source}) on {self.device}: {len(self.user_inputs)} "
                f"input(s), {len(self.graph.nodes)} nodes"] + \
            ["  " + ln for ln in self.describe_inputs()]
        if isinstance(self.compiled, Stages):
            head.append(self.compiled.summary())
        head.append(self.memory_report())
        return "\n".join(head + [p.report() for p in self.plans])

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan to ``path`` as one file (docs/FORMAT.md).  Everything is checked
        before anything is written (a custom op without ``serialize``/``deserialize`` is a
        :class:`ReplayError` naming it, and ``path`` is left untouched); the file is written
        under a temporary name and renamed into place."""
        save_plan(path, self.parts(), self.device)


def load(path: str | os.PathLike, device: str | torch.device | None = None,
         options: dict | None = None, check: bool = True) -> ExportedPlan:
    """Read a plan written by :func:`fxbackend.save` (any format version from
    :data:`fxbackend.planfile.OLDEST_FORMAT_VERSION` on) and rebuild it for ``device``
    (default: the device it was saved from) with backend ``options``.  Kernel selection,
    rewrites, fusion and memory planning run again there, when the plan is first called.
    Raises :class:`ReplayError` for anything wrong with the file; nothing in the file is
    executed (see :mod:`fxbackend.planfile`).

    ``check`` recomputes every node's metadata on the meta device and compares it with the
    file's (the first time in a process, PyTorch imports its ``torch._dynamo`` module for its
    meta kernels: about a second; no compile runs).  ``check=False`` skips that for files you
    trust: a file whose metadata lies can then fail inside a kernel instead of at load."""
    from .extensions import load_extensions
    load_extensions()
    _, doc, blob, _ = read_file(path)
    with errors_name(path):
        parts = decode_plan(doc, blob, device, check)
        return ExportedPlan.from_parts(parts, parse_options(options))


# -- input and output trees ------------------------------------------------------------------------

def _bind_tree(tree: Any, value: Any, path: str, out: list) -> None:
    """Match a call's arguments against the saved input tree, filling ``out`` (flat user
    inputs).  A constant leaf takes its exported value; a different one is an error."""
    if not isinstance(tree, dict) or len(tree) != 1:
        raise ReplayError(f"malformed input tree at {path}")
    (tag, v), = tree.items()
    if tag == "input":
        if value is not _MISSING:
            out[v] = value
        return
    if tag == "const":
        if value is not _MISSING and not _same_constant(value, v):
            raise ReplayError(f"{path}: the plan was exported with {v!r} here, got {value!r}")
        return
    if tag in ("tuple", "list"):
        if value is _MISSING:
            items = [_MISSING] * len(v)
        elif isinstance(value, (tuple, list)):
            if len(value) != len(v):
                raise ReplayError(f"{path}: expected {len(v)} items, got {len(value)}")
            items = list(value)
        else:
            raise ReplayError(f"{path}: expected a {tag}, got {type(value).__name__}")
        for i, (t, x) in enumerate(zip(v, items)):
            _bind_tree(t, x, f"{path}[{i}]", out)
        return
    if tag == "dict":
        if value is _MISSING:
            value = {}
        if not isinstance(value, Mapping):
            raise ReplayError(f"{path}: expected a dict, got {type(value).__name__}")
        keys = [k for k, _ in v]
        extra = [k for k in value if k not in keys]
        if extra:
            raise ReplayError(f"{path}: unexpected key(s) {extra}; expected {keys}")
        for k, t in v:
            _bind_tree(t, value.get(k, _MISSING), f"{path}[{k!r}]", out)
        return
    raise ReplayError(f"malformed input tree at {path}")


def _same_constant(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b) and type(a) is type(b) or (a is None and b is None)
    except Exception:  # an exotic value: not the exported one
        return False


def _build_tree(tree: Any, outs: list) -> Any:
    (tag, v), = tree.items()
    if tag == "output":
        return outs[v]
    if tag == "const":
        return v
    if tag == "tuple":
        return tuple(_build_tree(t, outs) for t in v)
    if tag == "list":
        return [_build_tree(t, outs) for t in v]
    return {k: _build_tree(t, outs) for k, t in v}
