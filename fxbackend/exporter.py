"""Plans from models: ``torch.export`` (:func:`export`) and ``torch.compile``
(:func:`record_graphs`, :func:`from_compiled`), and :func:`save`, which takes either.  The
plan's runtime and loading live in :mod:`fxbackend.exported`, the file format in
:mod:`fxbackend.planfile`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import re
import traceback
import warnings
import weakref
from typing import Any, Iterator, Mapping

import torch

from .executor import CompiledGraph
from .exported import ExportedPlan
from .inputs import SymbolRange
from .ir import Graph, Node, TensorMeta
from .lower import lower
from .options import Options, parse_options
from .pipeline import run_pipeline
from .planfile import ReplayError
from .planfile.codec import format_meta
from .planfile.document import used_symbols
from .planfile.errors import MAX_INT
from .stages import copy_node

__all__ = ["export", "from_compiled", "record_graphs", "save"]

_IDS = itertools.count()


def _tree_of_spec(spec: Any, leaf, where: str) -> Any:
    """A pytree ``TreeSpec`` as the file's JSON tree; ``leaf(i)`` encodes leaf number i."""
    counter = itertools.count()

    def walk(s):
        if s.is_leaf():
            return leaf(next(counter))
        kids = [walk(c) for c in (s.children() if hasattr(s, "children")
                                  else s.children_specs)]
        t = s.type
        if t is tuple or (isinstance(t, type) and issubclass(t, tuple) and hasattr(t, "_fields")):
            return {"tuple": kids}
        if t is list:
            return {"list": kids}
        if t is dict or (isinstance(t, type) and issubclass(t, dict)):
            keys = list(s.context)
            if not all(isinstance(k, str) for k in keys):
                raise ReplayError(f"{where}: dict keys must be strings, got {keys}")
            return {"dict": [[k, c] for k, c in zip(keys, kids)]}
        if t is type(None):
            return {"const": None}
        raise ReplayError(f"{where}: containers of type {getattr(t, '__name__', t)} are not "
                          f"supported (tuples, lists and dicts are)")

    return walk(spec)


# -- building plans --------------------------------------------------------------------------------

_CIA_TABLE: Any = None


def _decompositions() -> Any:
    """The decomposition table that gives the ATen graph aot_autograd gives the Dynamo path:
    CompositeImplicitAutograd ops decomposed (``linear`` -> ``t`` + ``addmm``, ``layer_norm`` ->
    ``native_layer_norm``, ...), no core-ATen decompositions on top (``silu``, ``gelu``,
    ``addmm`` stay), so that the same rewrites and fusions apply."""
    global _CIA_TABLE
    if _CIA_TABLE is None:
        table = torch.export.default_decompositions()
        for op in list(table.keys()):
            if not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(),
                                                                  "CompositeImplicitAutograd"):
                del table[op]
        _CIA_TABLE = table
    return _CIA_TABLE


def export(model: torch.nn.Module, args: Any = (), kwargs: dict | None = None,
           dynamic_shapes: Any = None, *, options: dict | None = None) -> ExportedPlan:
    """Export ``model`` with ``torch.export`` (non-strict: no Dynamo) and lower it to a plan.

    ``args``/``kwargs`` are example inputs, ``dynamic_shapes`` is passed to
    ``torch.export.export`` as is (``torch.export.Dim`` ranges are saved with the plan, and a
    call outside them is a :class:`ReplayError`).  Parameters, buffers and lifted constants
    are told apart from user inputs by the export signature and named as in the model's state
    dict.  ``options`` are the backend options (:class:`fxbackend.Options`).  Export the model
    in eval mode: the plan runs inference (no grad).  Runtime checks that ``torch.export`` adds
    on tensor metadata (``aten._assert_tensor_metadata``) are dropped: the plan checks its
    inputs itself.  A model that writes one of its inputs (``x.add_(1)``) gives a plan that
    writes the caller's tensor the same way; one that writes a buffer is a ReplayError.
    """
    from .extensions import load_extensions
    opts = parse_options(options)
    load_extensions()
    if not isinstance(args, (tuple, list)):
        args = (args,)
    args, kwargs = tuple(args), dict(kwargs or {})
    with torch.no_grad(), warnings.catch_warnings():
        # torch's own deprecation notice about its pytree internals, once per export
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        try:
            ep = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes,
                                     strict=False)
            ep = ep.run_decompositions(_decompositions())
        except Exception as e:  # the model's line and why, not torch's internals alone
            raise _export_error(model, e) from e
    return _from_exported_program(_without_effect_tokens(ep), args, kwargs, opts)


#: what torch.export's errors on Python code that reads tensor data mean: (text in the error or
#: its type's name, the cause); one row per way a model's code reads data torch.export traces
_TRACE_ERRORS = [
    (".numpy() is not supported",
     "the model converts a tensor to numpy (.numpy()), reading its values in Python: what it "
     "does next depends on tensor data, which one traced graph cannot hold"),
    ("unhashable type: non-nested SymInt",
     "the model hashes a traced integer (a set member or dict key): a value read from a tensor "
     "(.tolist(), .item()) or a dynamic size, which torch.export traces symbolically and "
     "cannot hash"),
    ("GuardOnDataDependentSymNode",
     "the model branches in Python on a value read from a tensor (data-dependent control "
     "flow), which one traced graph cannot hold"),
    ("data-dependent",
     "the model uses a value read from a tensor where torch.export needs a known integer "
     "(data-dependent control flow or sizes)"),
]


def _export_error(model: Any, e: Exception) -> ReplayError:
    """A ReplayError for ``torch.export``'s failure ``e`` on ``model``: the line of the model's
    code that raised it (the innermost frame outside torch and fxbackend), the cause where
    :data:`_TRACE_ERRORS` knows it (its type's name is in ``text``), and torch's own message."""
    skip = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (torch.__file__, __file__))
    where = None
    for fs in reversed(traceback.extract_tb(e.__traceback__)):
        if not fs.filename.startswith(skip) and not fs.filename.startswith("<"):
            code = (fs.line or "").strip()
            name = fs.filename.split("site-packages" + os.sep)[-1]
            where = f"{name}:{fs.lineno} in {fs.name}: {code}"
            break
    text = f"{type(e).__name__}: {e}"
    why = next((cause for key, cause in _TRACE_ERRORS if key in text), None)
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return ReplayError(f"export: torch.export cannot trace {type(model).__name__}"
                       + (f": {why}" if why else "")
                       + (f"; at {where}" if where else "") + f" (torch.export: {first})")


def _without_effect_tokens(ep: Any) -> Any:
    """``ep`` with its effect tokens removed: ops with side effects (``linalg.inv``'s error
    check, ...) are ordered by tokens threaded through the graph's inputs and outputs; a plan
    runs its steps in order, so each ``with_effects`` becomes a plain call of its op."""
    from torch.export.graph_signature import InputKind
    if not any(spec.kind == InputKind.TOKEN for spec in ep.graph_signature.input_specs):
        return ep
    try:
        from torch.export._remove_effect_tokens_pass import _remove_effect_tokens
    except ImportError as e:  # a private pass of torch's: say what is missing, not a stack
        raise ReplayError("export: the model calls ops with side effects (effect tokens) and "
                          "this torch has no pass to remove their tokens") from e
    return _remove_effect_tokens(ep)


def _from_exported_program(ep: Any, args: tuple, kwargs: dict, opts: Options) -> ExportedPlan:
    from torch.export.graph_signature import ConstantArgument, InputKind, OutputKind
    gm = ep.graph_module
    sig = ep.graph_signature
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(n)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(sig.input_specs):
        raise ReplayError(f"export: {len(placeholders)} graph inputs but "
                          f"{len(sig.input_specs)} input specs")
    _inputs_written_in_place(gm, placeholders, sig)
    weights: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    user_leaves: list = []  # per flat user input (pytree leaf): ("input", ph) or ("const", v)
    kept = []
    for ph, spec in zip(placeholders, sig.input_specs):
        if spec.kind == InputKind.USER_INPUT:
            if isinstance(spec.arg, ConstantArgument):
                if ph.users:
                    raise ReplayError(f"export: constant input {spec.arg.name} is read by the "
                                      f"graph")
                if spec.arg.value is not None and not isinstance(spec.arg.value,
                                                                 (bool, int, float, str)):
                    raise ReplayError(f"export: input {spec.arg.name} is a constant "
                                      f"{type(spec.arg.value).__name__}; a plan keeps only "
                                      f"plain constants")
                gm.graph.erase_node(ph)
                user_leaves.append(("const", spec.arg.value))
                continue
            user_leaves.append(("input", ph))
            kept.append((ph, None))
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            name = spec.target
            if spec.kind == InputKind.PARAMETER:
                t, kind = ep.state_dict[name], "parameter"
            elif spec.kind == InputKind.BUFFER and spec.persistent:
                t, kind = ep.state_dict[name], "buffer"
            else:
                t, kind = ep.constants[name], "constant"
            if not isinstance(t, torch.Tensor):
                raise ReplayError(f"export: {name} is not a tensor ({type(t).__name__})")
            weights[name] = t.detach()
            kinds[name] = kind
            kept.append((ph, name))
        else:
            raise ReplayError(f"export: inputs of kind {spec.kind.name} ({spec.arg}) are not "
                              f"supported by replay")
    gm.graph.lint()
    gm.recompile()
    mask = [name is not None for _, name in kept]
    name = f"export{next(_IDS)}"
    graph = lower(gm, mask)
    graph = run_pipeline(graph, opts, name)
    names: dict[Node, str] = {}
    by_placeholder = {}
    for node, (ph, wname) in zip(graph.inputs, kept):
        names[node] = wname if wname is not None else ph.name
        node.annotations["source"] = names[node]
        by_placeholder[ph] = node
    user_inputs = [by_placeholder[ph] for kind, ph in user_leaves if kind == "input"]
    leaf_map = []
    k = 0
    for kind, v in user_leaves:
        if kind == "input":
            leaf_map.append({"input": k})
            k += 1
        else:
            leaf_map.append({"const": v})
    in_tree = _tree_of_spec(ep.call_spec.in_spec, lambda i: leaf_map[i], "export inputs")
    try:
        out_tree = _tree_of_spec(ep.call_spec.out_spec, lambda i: {"output": i},
                                 "export outputs")
    except ReplayError:
        out_tree = None  # a container replay does not rebuild: outputs come back as a list
    # only the symbols the node list uses: after run_decompositions torch.export also reports
    # ranges of symbols no node uses (one per size of the base of an example input that is a
    # view, freqs.unsqueeze(2)), which no input binds, so that they have no sample value
    used = {str(s) for s in used_symbols(graph)}
    symbols = {}
    for sym, vr in ep.range_constraints.items():
        if getattr(sym, "is_Symbol", False) and str(sym) in used:
            lo = int(vr.lower) if _finite(vr.lower) else 0
            hi = int(vr.upper) if _finite(vr.upper) else None
            symbols[sym] = SymbolRange(lo, hi)
    plan = ExportedPlan(CompiledGraph(graph, opts, name), names=names, weights=weights,
                        weight_kinds=kinds, symbols=symbols, in_tree=in_tree, out_tree=out_tree,
                        source="torch.export", user_inputs=user_inputs)
    if symbols:  # the example inputs give each symbol a sample value, for checks at load
        bind = plan.sizes_of(args, kwargs)
        plan.symbols = {s: dataclasses.replace(r, hint=bind.get(s)) for s, r in symbols.items()}
    return plan


def _inputs_written_in_place(gm: torch.fx.GraphModule, placeholders: list, sig: Any) -> None:
    """Turn the exported graph's input mutations (its ``USER_INPUT_MUTATION`` outputs: the new
    value of an input the model writes, ``x.add_(1)``) into ``aten.copy_`` of the value into
    that input at the end of the graph, as aot_autograd's inference graphs write them: the
    plan writes the caller's tensor as the model does, and its outputs are the model's own.
    Other state written during the forward (buffers) is refused with a ReplayError."""
    from torch.export.graph_signature import InputKind, OutputKind
    out = gm.graph.output_node()
    values = list(out.args[0])
    if len(values) != len(sig.output_specs):
        raise ReplayError(f"export: {len(values)} graph outputs but {len(sig.output_specs)} "
                          f"output specs")
    by_name = {spec.arg.name: ph for ph, spec in zip(placeholders, sig.input_specs)
               if spec.kind == InputKind.USER_INPUT}
    kept = []
    for v, spec in zip(values, sig.output_specs):
        if spec.kind == OutputKind.USER_OUTPUT:
            kept.append(v)
        elif spec.kind == OutputKind.USER_INPUT_MUTATION and spec.target in by_name:
            ph = by_name[spec.target]
            with gm.graph.inserting_before(out):
                write = gm.graph.call_function(torch.ops.aten.copy_.default, (ph, v))
            write.meta["val"] = ph.meta["val"]  # copy_ returns its destination
        else:
            raise ReplayError(f"export: the model writes {spec.target or spec.arg} during its "
                              f"forward ({spec.kind.name}); a replayed plan cannot")
    if len(kept) != len(values):
        out.args = (tuple(kept),)


def _finite(v: Any) -> bool:
    """``v`` (a bound of an export range constraint) is a finite integer in range.  torch's
    ``int_oo`` says ``is_finite`` True, and ``int()`` of it raises AttributeError; sympy's
    ``oo`` raises TypeError: both are infinite here."""
    try:
        from torch.utils._sympy.numbers import IntInfinity, NegativeIntInfinity
        if isinstance(v, (IntInfinity, NegativeIntInfinity)):
            return False
    except ImportError:  # an older torch without int_oo
        pass
    try:
        return bool(getattr(v, "is_finite", True)) and abs(int(v)) < MAX_INT
    except (TypeError, ValueError, OverflowError, AttributeError):
        return False


#: per CompiledGraph recorded by record_graphs(): input index -> the tensor its first call got,
#: for the inputs that hold model state (weights, tensors read from the model or from globals)
_FIRST_CALL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _is_state(n: Node) -> bool:
    """A graph input that holds model state rather than a user input: a weight, or a tensor
    Dynamo read from the module's attributes (``l_self_...``) or from a global (``g_...``)."""
    if n.is_weight:
        return True
    src = n.annotations.get("source") or ""
    return isinstance(n.meta, TensorMeta) and (src.startswith("l_self_") or src.startswith("g_"))


def _remember_first_call(cg: CompiledGraph, args: list) -> None:
    _FIRST_CALL[cg] = {i: a for i, (n, a) in enumerate(zip(cg.graph.inputs, args))
                       if _is_state(n) and isinstance(a, torch.Tensor)}
    if _remember_first_call in cg.observers:
        cg.observers.remove(_remember_first_call)


@contextlib.contextmanager
def record_graphs() -> Iterator[list[CompiledGraph]]:
    """Record the graphs ``torch.compile(backend="fxbackend")`` compiles inside the block, and
    the weights each one is first called with::

        with fxbackend.record_graphs() as graphs:
            out = compiled_model(**inputs)      # compiles (a cached compile records nothing)
        plan = fxbackend.from_compiled(graphs[0], model)

    Each Dynamo graph is one :class:`CompiledGraph`; graph breaks give several (one file
    each)."""
    from . import dynamo
    seen: list[CompiledGraph] = []

    def listener(cg: CompiledGraph) -> None:
        seen.append(cg)
        cg.observers.append(_remember_first_call)

    dynamo._listeners.append(listener)
    try:
        yield seen
    finally:
        dynamo._listeners.remove(listener)


def _sanitize(s: str) -> str:
    return re.sub(r"[^0-9a-zA-Z_]", "_", s).lower()


def _model_weights(model: torch.nn.Module) -> list[tuple[str, str, torch.Tensor, str]]:
    """``(state-dict name, Dynamo source suffix, tensor, kind)`` for every parameter and
    buffer (``kind``: ``parameter`` or ``buffer``)."""
    out = []
    for kind, items in (("parameter", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, t in items:
            *path, leaf = name.split(".")
            suffix = "".join(f"modules_{p}_" for p in path) + f"{kind}s_{leaf}_"
            out.append((name, _sanitize(suffix), t, kind))
    return out


def _tensor_key(t: torch.Tensor) -> tuple:
    """Tensors with equal keys are the same values in the same memory."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or _tensor_key(a) == _tensor_key(b)


def from_compiled(compiled: CompiledGraph | Graph, model: torch.nn.Module | None = None,
                  weights: Mapping[str, torch.Tensor] | None = None,
                  options: dict | None = None) -> ExportedPlan:
    """A plan from a graph that ``torch.compile(backend="fxbackend")`` compiled (recorded with
    :func:`record_graphs`), or from a hand-built :class:`Graph` (``options`` apply then).

    Where each weight input's tensor comes from, first match wins: ``weights`` (keyed by the
    input's source name, ``annotations["source"]`` or ``["name"]``); the tensor the graph's
    first recorded call got; the parameter or buffer of ``model`` its Dynamo source name
    (``l_self_..._modules_attn_modules_to_q_parameters_weight_``) names.  With ``model``, a
    weight is named as in the model's state dict (``attn.to_q.weight``), found by identity of
    the recorded tensor or by the source name; without, by its source name.  Tensors Dynamo
    read from module attributes or globals (``l_self_...``, ``g_...``, not parameters) become
    constants with their recorded values.  Constant nodes keep their tensors.  User inputs keep
    Dynamo's names made readable (``l_kwargs_hidden_states_`` -> ``hidden_states``), in the
    graph's order.  A symbolic size gets the range ``[2, inf)`` (Dynamo specialises sizes 0 and
    1); Dynamo's other guards are not saved.
    """
    if isinstance(compiled, Graph):
        compiled = CompiledGraph(compiled, parse_options(options), f"graph{next(_IDS)}")
    graph = compiled.graph
    index = {n: i for i, n in enumerate(graph.inputs)}
    recorded = _FIRST_CALL.get(compiled, {})

    def source(n: Node) -> str:
        return n.annotations.get("source") or n.annotations.get("name") or \
            f"arg{index.get(n, n.id)}"

    names: dict[Node, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    candidates = _model_weights(model) if model is not None else []
    by_storage = {}
    for c in candidates:
        by_storage.setdefault(_tensor_key(c[2]), c)
    unmatched = []
    state_inputs = []
    for n in graph.nodes:
        if n.op == "constant":
            src = source(n)
            t, name, kind = n.annotations["value"], src, "constant"
        elif n.is_input and _is_state(n):
            src = source(n)
            t = weights.get(src) if weights is not None else None
            if t is None:
                t = recorded.get(index[n])
            name, kind = src, ("parameter" if n.is_weight else "constant")
            match = None
            if n.is_weight and t is not None:
                match = by_storage.get(_tensor_key(t))
            if n.is_weight and match is None:
                low = _sanitize(src)
                hits = [c for c in candidates if low.endswith(c[1]) and
                        (len(low) == len(c[1]) or low[-len(c[1]) - 1] == "_")]
                match = max(hits, key=lambda c: len(c[1])) if hits else None
            if match is not None:
                name, kind = match[0], match[3]
                t = match[2] if t is None else t
            if t is None:
                if n.is_weight:
                    unmatched.append(src)
                continue  # a tensor that is not a weight and was not recorded: a user input
            t = t.detach()
        else:
            continue
        m = n.meta
        if not isinstance(t, torch.Tensor) or (isinstance(m, TensorMeta) and not m.is_symbolic
                                               and (tuple(t.shape) != tuple(m.shape)
                                                    or t.dtype != m.dtype)):
            got = f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) \
                else type(t).__name__
            raise ReplayError(f"weight {source(n)!r}: expected {format_meta(m)}, got {got}")
        if name in tensors and not _same_tensor(tensors[name], t):
            raise ReplayError(f"two weight inputs are named {name!r}")
        names[n] = name
        tensors[name] = t
        kinds[name] = kind
        if n.is_input and not n.is_weight:
            state_inputs.append(n)
    if unmatched:
        raise ReplayError(f"cannot tell which tensors the weight input(s) {unmatched[:5]}"
                          f"{' ...' if len(unmatched) > 5 else ''} are: record the compile with "
                          f"fxbackend.record_graphs(), or pass model= (the compiled module) or "
                          f"weights={{source name: tensor}}")
    hints = _hints_from_plans(compiled)
    if state_inputs:  # constants from here on: the plan passes them as weights
        graph = _copy_graph(graph)
        by_id = {n.id: n for n in graph.nodes}
        for n in state_inputs:
            by_id[n.id].is_weight = True
        names = {by_id[n.id]: v for n, v in names.items()}
        compiled = CompiledGraph(graph, compiled.options, compiled.name)
    used = set(names.values())
    for n in graph.inputs:
        if n.is_weight:
            continue
        src = source(n)
        pretty = re.sub(r"^l_(?:kwargs_|args_)?", "", src).rstrip("_") or src
        if pretty in used:
            pretty = src
        used.add(pretty)
        names[n] = pretty
    symbols = {}
    for n in graph.inputs:
        syms = set()
        if isinstance(n.meta, TensorMeta):
            for e in (*n.meta.shape, *n.meta.stride):
                syms |= set(getattr(e, "free_symbols", ()))
        syms |= set(getattr(n.annotations.get("expr"), "free_symbols", ()))
        for s in syms:
            symbols[s] = SymbolRange(2, None)
    symbols = {s: dataclasses.replace(r, hint=hints.get(s)) for s, r in symbols.items()}
    return ExportedPlan(compiled, names=names, weights=tensors, weight_kinds=kinds,
                        symbols=symbols, source="torch.compile")


def _copy_graph(graph: Graph) -> Graph:
    """A copy of ``graph``'s node list (nodes and params copied, metadata and targets shared)."""
    g = Graph()
    g._next_id = graph._next_id
    new: dict[Node, Node] = {}
    for n in graph.nodes:
        new[n] = g.append(copy_node(n, new))
    g.outputs = [new[o] if isinstance(o, Node) else o for o in graph.outputs]
    return g


def _hints_from_plans(cg: CompiledGraph) -> dict:
    """Sample values of the symbols, from a plan already built for concrete inputs."""
    for plan in list(cg.plans.values()):
        by_id = {c.id: c for c in plan.graph.nodes}
        bind = {}
        for n in cg.graph.inputs:
            c = by_id.get(n.id)
            if c is None:
                continue
            if isinstance(n.meta, TensorMeta) and isinstance(plan.metas.get(c), TensorMeta):
                for s, v in zip(n.meta.shape, plan.metas[c].shape):
                    if getattr(s, "is_Symbol", False):
                        bind[s] = int(v)
            expr = n.annotations.get("expr")
            if getattr(expr, "is_Symbol", False) and c in plan.scalars:
                bind[expr] = int(plan.scalars[c])
        return bind
    return {}

def save(plan: ExportedPlan | CompiledGraph | Graph, path: str | os.PathLike, *,
         model: torch.nn.Module | None = None,
         weights: Mapping[str, torch.Tensor] | None = None) -> None:
    """Write ``plan`` to ``path`` as one file (docs/FORMAT.md).

    ``plan`` is an :class:`~fxbackend.exported.ExportedPlan`, or a :class:`CompiledGraph` from
    ``torch.compile`` (then ``model`` or ``weights`` name its weights, as in
    :func:`from_compiled`).  Everything is checked before anything is written (a custom op
    without ``serialize``/``deserialize`` is a :class:`ReplayError` naming it, and ``path`` is
    left untouched); the file is written under a temporary name and renamed into place.
    """
    if isinstance(plan, (CompiledGraph, Graph)):
        plan = from_compiled(plan, model=model, weights=weights)
    if not isinstance(plan, ExportedPlan):
        raise TypeError(f"save takes an ExportedPlan or a CompiledGraph, got "
                        f"{type(plan).__name__}")
    plan.save(path)
