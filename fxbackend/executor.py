"""Plans and their execution.

A :class:`CompiledGraph` is a lowered graph plus one :class:`Plan` per input-shape signature
(a symbolic graph re-plans for new shapes without re-lowering).  A :class:`Plan` is concrete:
every node has a kernel, every intermediate an offset in one preallocated arena per device, and
the steps are generated as one straight-line Python function so that a call costs little more
than the kernel launches themselves.

Per call a plan allocates only the tensors it returns (the caller keeps them) and, for ops
without an ``.out`` overload, the temporary it copies from (a counted copy).  Inputs are never
copied.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import re
import sys
import threading
import time
import weakref
from collections import Counter
from typing import Any, Sequence

import torch

from . import registry, stats, weights
from .ir import Graph, Node, ScalarMeta, TensorMeta, contiguous_strides, node_deps, storage_root
from .lower import SYM_OPS
from .concat import ConcatPlan, elide_identity_cats, elide_identity_clones, plan_concat
from .fold import fold_constants
from .memory import MemoryPlan, buffers_of, plan_memory
from .fusion import FusionReport, apply_fusions
from .cpu import cpu_report_lines
from .rewrite import RewriteContext, apply_rewrites
from .native import call_args, out_is_copy, out_overload
from .options import Options
from .services import CancelToken, running
from .streams import find_regions, region_lifetimes, worth_it
from .cudagraphs import GraphRunner, capture_blocker

__all__ = ["CompiledGraph", "Plan", "ExecContext", "concretize", "instantiate"]

#: the op of copies the scheduler inserts to run a node on another device
_COPY_OP = "fxb.copy_device.v1"


_PLAN_TIME_SCALAR_OPS = {"aten.sym_size.int", "aten.sym_stride.int", "aten.sym_numel.default",
                         "aten.sym_storage_offset.default"}


_ASSIGNED = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) = ")
_region_pool: concurrent.futures.ThreadPoolExecutor | None = None
_region_pool_lock = threading.Lock()


def _submit_branch(fn, token: CancelToken) -> concurrent.futures.Future:
    """Run ``fn`` (the auxiliary branches of a region) on the region thread pool, under the
    plan's cancel token (so ``cpu_parallel`` in it stops when the plan is cancelled)."""
    global _region_pool
    if _region_pool is None:
        with _region_pool_lock:
            if _region_pool is None:
                # a pool of its own: a branch may call services.cpu_parallel, whose pool must
                # not be the one waiting for it
                _region_pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=2, thread_name_prefix="fxbackend-region")

    # grad and inference mode are per thread: the branch runs as the caller's thread does
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def branch():
        with running(token), torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return fn()
    return _region_pool.submit(branch)


def _record_stream(v: Any, stream: Any) -> None:
    """Tell the caching allocator that ``v`` (allocated on the auxiliary stream) is used on
    ``stream`` too, so its memory is not handed out again before ``stream`` is done with it."""
    if isinstance(v, torch.Tensor):
        if v.is_cuda:
            v.record_stream(stream)
    elif isinstance(v, (tuple, list)):
        for x in v:
            _record_stream(x, stream)


class ExecContext:
    """What an extension kernel's ``execute`` gets: ``device`` and, on CUDA, ``stream`` (the
    stream current when the step runs: launch there)."""

    __slots__ = ("device",)

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @property
    def stream(self) -> Any:
        if self.device.type == "cuda":
            return torch.cuda.current_stream(self.device)
        return None

    def __repr__(self) -> str:
        return f"ExecContext(device={self.device})"


def instantiate(graph: Graph, metas: dict, scalars: dict) -> tuple[Graph, dict, dict]:
    """A copy of ``graph`` for one plan: concrete metadata on every node, and plan-time scalar
    values substituted into params.  Per-plan passes (fusion, placement) rewrite the copy."""
    g = Graph()
    g._next_id = graph._next_id
    new: dict[Node, Node] = {}

    def mp(v: Any) -> Any:
        if isinstance(v, Node):
            return scalars[v] if v in scalars else new[v]
        if isinstance(v, (list, tuple)):
            return type(v)(mp(x) for x in v)
        if isinstance(v, dict):
            return {k: mp(x) for k, x in v.items()}
        return v

    out_metas: dict = {}
    out_scalars: dict = {}
    for n in graph.nodes:
        c = Node(n.id, n.op, [new[x] for x in n.srcs], {k: mp(v) for k, v in n.params.items()},
                 metas[n], view_of=new.get(n.view_of) if n.view_of is not None else None,
                 inplace_of=new.get(n.inplace_of) if n.inplace_of is not None else None,
                 is_input=n.is_input, is_weight=n.is_weight, is_output=n.is_output,
                 target=n.target, tensor_layout=n.tensor_layout,
                 annotations=dict(n.annotations))
        new[n] = c
        g.nodes.append(c)
        out_metas[c] = metas[n]
        if n in scalars:
            out_scalars[c] = scalars[n]
    g.outputs = [new[o] if isinstance(o, Node) else o for o in graph.outputs]
    return g, out_metas, out_scalars


class _Code:
    """A Python expression in generated code."""

    __slots__ = ("src",)

    def __init__(self, src: str) -> None:
        self.src = src

    def __repr__(self) -> str:
        return self.src


def _render(v: Any) -> str:
    if isinstance(v, _Code):
        return v.src
    if v is None or (isinstance(v, (bool, int, str)) and not isinstance(v, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_render(x) for x in v) + "]"
    if isinstance(v, tuple):
        return "(" + "".join(_render(x) + ", " for x in v) + ")"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k!r}: {_render(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot render {v!r}")


def _describe_input(graph: Graph, i: int, node: Node) -> str:
    name = node.annotations.get("source") or node.annotations.get("name") or f"arg{i}"
    kind = "weight" if node.is_weight else "input"
    return f"{kind} {i} ({name})"


def concretize(graph: Graph, args: Sequence[Any]) -> tuple[dict, dict]:
    """Concrete metadata of every node for these inputs: ``(metas, scalars)``.

    ``scalars`` holds the values of scalar nodes known at plan time (sizes and integer
    arithmetic on them).  Raises ValueError naming the first input whose count, kind, dtype,
    device or shape does not fit the graph.
    """
    inputs = graph.inputs
    if len(args) != len(inputs):
        raise ValueError(f"expected {len(inputs)} inputs, got {len(args)}")
    bind: dict = {}
    for i, (node, a) in enumerate(zip(inputs, args)):
        what = _describe_input(graph, i, node)
        m = node.meta
        if isinstance(m, TensorMeta):
            if not isinstance(a, torch.Tensor):
                raise ValueError(f"{what}: expected a tensor {m.short()}, got {type(a).__name__}")
            if a.dtype != m.dtype:
                raise ValueError(f"{what}: expected dtype {m.dtype}, got {a.dtype}")
            if a.device.type != m.device.type:
                raise ValueError(f"{what}: expected a tensor on {m.device}, got {a.device}")
            if a.dim() != len(m.shape):
                raise ValueError(f"{what}: expected {len(m.shape)} dims {m.short()}, "
                                 f"got shape {tuple(a.shape)}")
            for d, (want, got) in enumerate(zip(m.shape, a.shape)):
                if type(want) is int:
                    if want != got:
                        raise ValueError(f"{what}: expected shape {m.short()}, got "
                                         f"{tuple(a.shape)} (dim {d})")
                elif getattr(want, "is_Symbol", False):
                    if bind.setdefault(want, got) != got:
                        raise ValueError(f"{what}: dim {d} is {got}, but the same symbolic size "
                                         f"{want} is {bind[want]} elsewhere")
        elif isinstance(m, ScalarMeta):
            if isinstance(a, torch.Tensor) or not isinstance(a, (int, float, bool)):
                raise ValueError(f"{what}: expected a Python {m.kind.__name__}, got "
                                 f"{type(a).__name__}")
            expr = node.annotations.get("expr")
            if expr is not None and getattr(expr, "is_Symbol", False):
                if bind.setdefault(expr, a) != a:
                    raise ValueError(f"{what}: is {a}, but the symbolic size {expr} is "
                                     f"{bind[expr]} elsewhere")
    if not graph.is_symbolic:
        return {n: n.meta for n in graph.nodes}, {}
    return _propagate(graph, args)


_META = torch.device("meta")
#: native ops that are a copy into fresh storage of their planned layout: they run as
#: ``planned.copy_(x)`` (no per-call allocation; the arena's pages are already mapped)
_COPY_OPS = ("aten._to_copy.default", "aten.clone.default")
#: ops whose result layout the plan checks with their fake-tensor implementation instead of
#: the meta device: the meta device's convolution returns NCHW for a channels-last input, while
#: the CPU's returns channels-last (as the fake implementation, which Dynamo recorded, says)
_FAKE_LAYOUT_OPS = frozenset({"aten.convolution.default"})


def _release_plan(release: dict) -> None:
    """A plan's finalizer: its counters leave the stats, its kernels' states are destroyed.
    Never raises (a finalizer's errors would only be printed)."""
    key = release.get("stats_key")
    if key is not None:
        stats.release_plan(key)
    for kernel, state in release.get("states", ()):
        destroy = getattr(kernel, "destroy", None)
        if destroy is not None:
            try:
                destroy(state)
            except Exception:
                pass


def _weight_cell(ws: tuple, what: int, held: dict) -> "weights.DerivedCell":
    """The model-wide cell of a weight-derived step (``fxbackend.weights.cell``), held by
    the plan's ``held`` while the plan lives."""
    return weights.cell(ws, what, held)


def _map_tree(v: Any, f) -> Any:
    if isinstance(v, (list, tuple)):
        return type(v)(_map_tree(x, f) for x in v)
    return f(v)


def _meta_tensor(m: TensorMeta) -> torch.Tensor:
    return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta")


def _fake_layout_call(n: Node, args: tuple, kwargs: dict) -> Any:
    """``n``'s op on fake tensors of its device laid out as the meta tensors ``args`` (see
    ``_FAKE_LAYOUT_OPS``), its results as meta tensors of the same layouts."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    metas = [m for m in _walk_metas(n.meta) if isinstance(m, TensorMeta)]
    device = metas[0].device if metas else torch.device("cpu")

    def layouts(v):
        if isinstance(v, torch.Tensor):
            return tuple(v.shape), tuple(v.stride()), v.dtype
        return tuple(layouts(x) for x in v) if isinstance(v, (list, tuple)) else v

    def to_meta(v, like):
        if isinstance(like, torch.Tensor):
            return torch.empty_strided(v[0], v[1], dtype=v[2], device="meta")
        if isinstance(like, (list, tuple)):
            return tuple(to_meta(a, b) for a, b in zip(v, like))
        return v

    with FakeTensorMode():
        def fake(t):
            if isinstance(t, torch.Tensor):
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            return t
        r = n.target(*[_map_tree(x, fake) for x in args],
                      **{k: _map_tree(v, fake) for k, v in kwargs.items()})
        shapes = layouts(r)
    return to_meta(shapes, r)


def _walk_metas(m: Any):
    if isinstance(m, tuple):
        for x in m:
            yield from _walk_metas(x)
    else:
        yield m


def _propagate(graph: Graph, args: Sequence[Any]) -> tuple[dict, dict]:
    """Run the graph on the meta device to get concrete shapes for these inputs."""
    vals: dict[Node, Any] = {}
    metas: dict[Node, Any] = {}
    scalars: dict[Node, Any] = {}
    it = iter(args)

    def val(v):
        if isinstance(v, Node):
            if v not in vals:
                raise NotImplementedError(
                    f"%{v.id} ({v.op}) depends on tensor data; fxbackend cannot plan "
                    f"data-dependent shapes")
            return vals[v]
        if isinstance(v, torch.device):  # factories (arange, full, ...) build on meta too
            return _META
        return v

    def to_meta(x, like):
        if isinstance(x, torch.Tensor):
            m = TensorMeta.of(x)
            return dataclasses.replace(m, device=like.device if isinstance(like, TensorMeta)
                                       else m.device)
        if isinstance(x, (list, tuple)):
            likes = like if isinstance(like, tuple) else (None,) * len(x)
            return tuple(to_meta(a, b) for a, b in zip(x, likes))
        return ScalarMeta(type(x)) if isinstance(x, (int, float, bool)) else None

    for n in graph.nodes:
        if n.is_input:
            a = next(it)
            if isinstance(a, torch.Tensor):
                vals[n] = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
                metas[n] = TensorMeta.of(a)
            else:
                vals[n] = a
                scalars[n] = a
                metas[n] = n.meta
            continue
        if n.op == "constant":
            vals[n] = _meta_tensor(n.meta)
            metas[n] = n.meta
            continue
        if n.op == "getitem":
            parent = vals.get(n.srcs[0])
            if parent is None:
                raise NotImplementedError(f"%{n.id}: cannot plan after data-dependent %{n.srcs[0].id}")
            vals[n] = parent[n.params["index"]]
            metas[n] = metas[n.srcs[0]][n.params["index"]]
            continue
        if n.op in SYM_OPS:
            v = SYM_OPS[n.op](*[_map_tree(a, val) for a in n.params["args"]])
            vals[n] = scalars[n] = v
            metas[n] = n.meta
            continue
        if n.is_scalar and n.op not in _PLAN_TIME_SCALAR_OPS:
            metas[n] = n.meta  # data-dependent: known per call only
            continue
        if n.target is None:  # a custom op: its infer_meta gives the concrete metadata
            from .ops import get_op, infer_node_meta
            op = get_op(n.op)
            if op is None:
                raise NotImplementedError(f"%{n.id}: no custom op named {n.op} is registered")
            m = infer_node_meta(op, [metas[x] for x in n.srcs], n.params)
            metas[n] = dataclasses.replace(m, device=n.meta.device)
            vals[n] = _meta_tensor(m)
            continue
        a, kw = call_args(n, val, val)
        try:
            out = _fake_layout_call(n, a, kw) if n.op in _FAKE_LAYOUT_OPS else n.target(*a, **kw)
        except NotImplementedError as e:
            # no meta kernel (``histogram``, ...): fake tensors, as Dynamo traced it (their
            # fallback runs the op's own kernel on zeros where its output sizes allow)
            try:
                out = _fake_layout_call(n, a, kw)
            except Exception as e2:
                raise NotImplementedError(f"cannot re-plan %{n.id} ({n.op}) for new shapes on "
                                          f"the meta device: {e}; with fake tensors: {e2}") from e
        except Exception as e:  # say which node
            raise NotImplementedError(f"cannot re-plan %{n.id} ({n.op}) for new shapes on the "
                                      f"meta device: {e}") from e
        if isinstance(out, torch.Tensor) and _same_layout(out, n.meta) and \
                tuple(out.stride()) != tuple(n.meta.stride):
            # the recorded strides where they differ only on size-1 dims (which torch's
            # meta and fake functions stride differently): later ops choose their layouts
            # (suggest_memory_format) from them, as they did when the graph was recorded; a
            # view stays a view of the same storage
            out = out.as_strided(n.meta.shape, n.meta.stride, out.storage_offset()) \
                if n.view_of is not None else _meta_tensor(n.meta)
        vals[n] = out
        if n.is_scalar:
            scalars[n] = out
            metas[n] = n.meta
        else:
            metas[n] = to_meta(out, n.meta)
            if not _same_kind(metas[n], n.meta):
                raise NotImplementedError(f"re-planning %{n.id} ({n.op}) for new shapes gave "
                                          f"{metas[n]}, where the graph has {n.meta}")
    return metas, scalars


def _same_kind(new: Any, traced: Any) -> bool:
    """``new`` has ``traced``'s structure: a tensor where it has a tensor, tuples as long."""
    if isinstance(traced, TensorMeta):
        return isinstance(new, TensorMeta)
    if isinstance(traced, tuple):
        return isinstance(new, tuple) and len(new) == len(traced) and \
            all(_same_kind(a, b) for a, b in zip(new, traced))
    return True


def _same_layout(t: torch.Tensor, m: Any) -> bool:
    """``t`` (a meta tensor) has the concrete metadata ``m``'s dtype and shape, and its strides
    on every dim longer than 1."""
    return isinstance(m, TensorMeta) and not m.is_symbolic and t.dtype == m.dtype and \
        tuple(t.shape) == tuple(m.shape) and \
        all(sz <= 1 or a == b for sz, a, b in zip(m.shape, t.stride(), m.stride))


def _fast_out_table() -> dict[str, Any]:
    """Functional ATen ops whose ``torch.*`` binding, called with the same arguments plus
    ``out=``, runs the op's ``.out`` overload: the Python binding parses its arguments faster
    than a generic ``OpOverload`` call, which matters for graphs of many small ops.
    ``tests/test_native.py`` checks every entry against its ``.out`` overload."""
    table = {}
    unary = ["sin", "cos", "exp", "log", "rsqrt", "sqrt", "sigmoid", "tanh", "neg", "abs",
             "reciprocal", "erf", "exp2", "log1p", "expm1", "floor", "ceil", "sign"]
    for name in unary:
        table[f"aten.{name}.default"] = getattr(torch, name)
    for name in ["add", "sub", "mul", "div", "eq", "ne", "lt", "le", "gt", "ge"]:
        table[f"aten.{name}.Tensor"] = getattr(torch, name)
    for name in ["maximum", "minimum", "atan2"]:
        table[f"aten.{name}.default"] = getattr(torch, name)
    table["aten.pow.Tensor_Scalar"] = table["aten.pow.Tensor_Tensor"] = torch.pow
    table["aten.where.self"] = torch.where
    for name in ["mm", "bmm", "addmm", "baddbmm", "_softmax"]:
        table[f"aten.{name}.default"] = getattr(torch, name)
    table["aten.silu.default"] = torch._C._nn.silu
    table["aten.gelu.default"] = torch._C._nn.gelu
    # ATen's relu is clamp_min(self, 0); its binding takes out=, relu's does not
    table["aten.relu.default"] = (torch.clamp_min, (0,))
    return table


_FAST_OUT = _fast_out_table()


class _AddressWatch:
    """Calls ``update_args(node, state, inputs)`` when a step's input addresses change."""

    __slots__ = ("node", "state", "callbacks", "last")

    def __init__(self, node: Node, state: Any, callbacks: list) -> None:
        self.node, self.state, self.callbacks, self.last = node, state, callbacks, None

    def __call__(self, inputs: list) -> None:
        ptrs = tuple(t.data_ptr() for t in inputs)
        if ptrs != self.last:
            if self.last is not None:
                for cb in self.callbacks:
                    cb(self.node, self.state, inputs)
            self.last = ptrs


class Plan:
    """A graph made concrete for one input signature: kernels, arena offsets, generated steps.

    Call it with the graph's inputs (``plan(*inputs)``); it validates them and returns the list
    of outputs.  :meth:`run` skips the validation (the Dynamo path, behind Dynamo's guards).
    """

    def __init__(self, graph: Graph, options: Options, metas: dict, scalars: dict,
                 name: str = "graph") -> None:
        self.source_graph = graph
        self.options = options
        self.graph, self.metas, self.scalars = instantiate(graph, metas, scalars)
        self.name = name
        self.generation = registry.generation()
        self.step_counts: Counter = Counter()
        self.copies = 0
        self.cancel_token = CancelToken()
        self.fusion_report = FusionReport()
        rewrite_ctx = RewriteContext(options)
        self.rewrites = apply_rewrites(self.graph, rewrite_ctx)
        #: (rule name, [node ids], reason) of every instance a rewrite rule left alone
        self.rewrites_declined = rewrite_ctx.declined
        if self.rewrites:
            for n in self.graph.nodes:  # new nodes, and nodes a rule gave other metadata
                self.metas[n] = n.meta
            for rule_name, count in self.rewrites.items():
                stats.bump("rewrite:" + rule_name, count)
        #: the CPU profile and the decisions taken from it (a plan with CPU tensors)
        self.cpu_report = cpu_report_lines(self.graph)
        #: steps that read no input, computed here once (``fold.fold_constants``)
        self.folded = fold_constants(self.graph)
        if self.folded:
            for n in self.graph.nodes:
                self.metas.setdefault(n, n.meta)
        #: cats of slices that only re-assembled one tensor (their readers read it instead)
        self.identity_cats = (elide_identity_cats(self.graph, self.metas.__getitem__)
                              if options.concat_in_place else 0)
        #: clones of values that already had the clone's layout (their readers read the value),
        #: or of elementwise results that now write the clone's layout themselves
        self.identity_clones = (elide_identity_clones(self.graph, self.metas.__getitem__,
                                                      self._set_meta)
                                if options.concat_in_place else 0)
        if self.rewrites or self.folded or self.identity_cats or self.identity_clones:
            from .pipeline import eliminate_dead_nodes
            eliminate_dead_nodes(self.graph, options)
        if options.eval_callback is not None:
            self.fusion_report.disabled = "a per-node evaluation callback is set"
        elif not options.fusion:
            self.fusion_report.disabled = "fusion is off (FXB_DISABLE_FUSION or options)"
        else:
            apply_fusions(self.graph, lambda n: self._device_of(n).type, self.fusion_report)
            for n in self.graph.nodes:
                if n.op.startswith("fused."):
                    self.metas[n] = n.meta
            for rule_name, _ in self.fusion_report.fired:
                stats.bump("fusion:" + rule_name)
        if options.dump:
            print(f"[fxbackend] {name} after fusion:\n{self.graph.format()}\n"
                  f"{self.fusion_report.format()}", file=sys.stderr)
        self.kernels = self._select_kernels()
        self.workspace_bytes = 0
        self.workspace = None
        #: bytes of the second workspace, used by the steps of auxiliary branches
        self.aux_workspace_bytes = 0
        self._ws_by_node: dict = {}
        self._aux_nodes: set = set()
        self._states: list = []
        # released by a finalizer, not __del__: weakref.finalize runs at the latest at
        # interpreter exit, before module globals are torn down (no noise at shutdown)
        self._release = {"stats_key": None, "states": self._states}
        weakref.finalize(self, _release_plan, self._release)
        #: options.profile: seconds spent in each step (by node index), over profiled_calls
        self.step_seconds: list[float] = []
        self.profiled_calls = 0
        #: native steps whose op has no ``.out`` overload: their own result is the value
        self._bound = self._bound_results()
        #: native steps computed from weights alone, kept between calls (``_weight_derived``)
        self.cached = self._weight_derived()
        #: the model-wide cells (fxbackend.weights) of the cached steps this plan used
        self._held: dict = {}
        self._cache_nodes: dict[int, Node] = {}  # derivation id -> its step
        self._bound -= set(self.cached)
        unread = self._unread_outputs() | {k for n in (*self._bound, *self.cached)
                                           for k in self._keys_of(n)}
        #: parts of concatenations that their producers write in place (fxbackend.concat)
        self.concat = (plan_concat(self.graph, self.metas.__getitem__,
                                   lambda n: self.kernels.get(n) is registry.NATIVE,
                                   unread.__contains__, self._writes_strided)
                       if options.concat_in_place else ConcatPlan())
        for n, m in self.concat.relayout.items():  # before compile: kernels see the layout
            n.meta = self.metas[n] = m
        self._compile_nodes()
        self._prepared = self._prepare_steps()
        self.regions, self.regions_off = self._find_regions()
        self.memory: MemoryPlan = plan_memory(self.graph, metas=lambda n: self.metas[n],
                                              skip_key=unread.__contains__,
                                              regions=region_lifetimes(self.regions),
                                              aliases=self.concat.aliases)
        self.arenas = {dev: torch.empty(nbytes, dtype=torch.uint8, device=dev)
                       for dev, nbytes in self.memory.arena_bytes.items()}
        self.step_seconds.extend([0.0] * len(self.graph.nodes))
        self._build()
        #: the CUDA graph of this plan (options cuda_graphs), and why there is none
        self._graph_runner: GraphRunner | None = None
        self.cuda_graph_off: str | None = None
        if options.cuda_graphs and options.profile:
            self.cuda_graph_off = "profiling times each step on the host"
        elif options.cuda_graphs:
            why = capture_blocker(self.graph.nodes, self.kernels,
                                  lambda n: n.is_scalar and n not in self.scalars,
                                  self._plan_device().type, options.eval_callback is not None)
            if why is None:
                self._graph_runner = GraphRunner(
                    self._run, [n.is_weight for n in self.graph.inputs], self._plan_device())
            else:
                self.cuda_graph_off = why
        self._stats_key = stats.register_plan_counts({"steps": self.step_counts,
                                                      "copies": self.copies})
        self._release["stats_key"] = self._stats_key
        stats.bump("plans_built")
        stats.bump("arena_bytes", self.memory.total_arena)
        stats.bump("intermediate_bytes", self.memory.sum_intermediates)
        stats.bump("workspace_bytes", self.workspace_bytes)
        stats.bump("concurrent_regions", len(self.regions))
        stats.bump("concat_parts_in_place", self.concat.parts_in_place)
        stats.bump("identity_cats", self.identity_cats)
        stats.bump("identity_clones", self.identity_clones)
        stats.bump("constants_folded", self.folded)
        stats.bump("weight_steps_cached", len(self.cached))
        if options.dump:
            print(f"[fxbackend] {name}: {self.memory.summary()}, "
                  f"workspace {self.workspace_bytes / 2**20:.2f} MB", file=sys.stderr)

    # -- building -------------------------------------------------------------------------
    def _compute_nodes(self):
        for n in self.graph.nodes:
            if n.is_input or n.op in ("constant", "getitem") or n.op in SYM_OPS:
                continue
            if n.is_scalar and n in self.scalars:
                continue
            yield n

    def _select_kernels(self) -> dict:
        kernels: dict = {}
        placed: list[Node] = []
        for n in self._compute_nodes():
            if n.op.startswith("fused."):
                kernels[n] = n.annotations["rule"]
            elif n.view_of is not None or n.inplace_of is not None:
                kernels[n] = registry.NATIVE  # views and in-place writes are never intercepted
            elif self.options.force_native and registry.NATIVE.supports(n):
                kernels[n] = registry.NATIVE
            else:
                dev = self._kernel_device(n)
                try:
                    kernels[n] = registry.select_kernel(dev, n)
                except NotImplementedError:
                    if dev == "cpu":
                        raise
                    # no kernel on the plan's device: run the node on the CPU
                    kernels[n] = registry.select_kernel("cpu", n)
                    placed.append(n)
        for n in placed:
            self._place_on_cpu(n, kernels)
        return kernels

    def _kernel_device(self, n: Node) -> str:
        """The device type whose kernels may run ``n`` (``options.device_type`` renames the
        CPU, so that tests can exercise placement with a device backed by CPU tensors)."""
        t = self._device_of(n).type
        if t == "cpu" and self.options.device_type and not n.annotations.get("placed"):
            return self.options.device_type
        return t

    def _place_on_cpu(self, n: Node, kernels: dict) -> None:
        """Run ``n`` on the CPU: copy its tensor inputs there and its result back, as nodes
        of their own (planned like any other, counted in ``stats()["copies"]``)."""
        g = self.graph
        cpu = torch.device("cpu")
        home = self.metas[n].device
        n.annotations["placed"] = "cpu"
        new_srcs = []
        for s in n.srcs:
            m = self.metas[s]
            c = g.new_node(_COPY_OP, [s], {"device": "cpu"},
                           TensorMeta(m.shape, contiguous_strides(m.shape), m.dtype, cpu))
            g.insert(g.nodes.index(n), c)
            self.metas[c] = c.meta
            kernels[c] = registry.NATIVE
            new_srcs.append(c)
        n.srcs = new_srcs
        m = self.metas[n]
        n.meta = self.metas[n] = dataclasses.replace(m, device=cpu)
        back = g.new_node(_COPY_OP, [n], {"device": str(home)},
                          dataclasses.replace(m, device=home), is_output=n.is_output)
        n.is_output = False
        g.insert(g.nodes.index(n) + 1, back)
        self.metas[back] = back.meta
        kernels[back] = registry.NATIVE
        from .fusion import _replace_uses
        _replace_uses(g, n, back, g.nodes.index(back) + 1)

    def _compile_nodes(self) -> None:
        """The ``compile`` capability: ahead-of-time work per node, at plan time, in parallel
        across nodes (ops and kernels sharing state must make it thread-safe)."""
        from .ops import get_op
        jobs = []
        for n, k in self.kernels.items():
            for owner in (get_op(n.op), k if k is not registry.NATIVE else None):
                fn = getattr(owner, "compile", None)
                if callable(fn):
                    jobs.append((fn, n))
        if len(jobs) == 1:
            jobs[0][0](jobs[0][1])
        elif jobs:
            from .services import cpu_parallel
            cpu_parallel(lambda i: jobs[i][0](jobs[i][1]), len(jobs))

    def _unread_outputs(self) -> set:
        """Outputs of multi-output native ops without an ``.out`` overload that nobody reads:
        they are computed anyway, but need no storage and no copy."""
        read = self._read_indices()
        keys = set()
        for n, k in self.kernels.items():
            if k is registry.NATIVE and isinstance(self.metas[n], tuple) and n.view_of is None \
                    and not (isinstance(n.target, torch._ops.OpOverload) and out_overload(n.target)):
                keys.update((n.id, i) for i in range(len(self.metas[n]))
                            if i not in read.get(n, ()))
        return keys

    def _read_indices(self) -> dict:
        """``{multi-output node: indices some getitem reads}``."""
        read: dict[Node, set] = {}
        for n in self.graph.nodes:
            if n.op == "getitem":
                read.setdefault(n.srcs[0], set()).add(n.params["index"])
        return read

    def _bound_results(self) -> set:
        """Native compute steps whose op has no ``.out`` overload (attention, ``arange``, ...)
        or only the generated one that computes and then copies (``convolution``,
        ``native_layer_norm``: ``native.out_is_copy``; not ops with a ``_FAST_OUT`` binding,
        e.g. relu's ``clamp_min(out=)``).  Their result is used as it comes back,
        allocated by the op per call: copying it into the arena would add a pass and save no
        memory (the op allocates it either way).  The step function drops it after its last
        read."""
        bound = set()
        for n, k in self.kernels.items():
            if k is registry.NATIVE and n.view_of is None and n.inplace_of is None \
                    and isinstance(n.target, torch._ops.OpOverload) and not n.is_scalar \
                    and n.meta is not None and n.op not in (*_COPY_OPS, _COPY_OP) \
                    and (not out_overload(n.target) or n.op not in _FAST_OUT
                         and out_is_copy(n.target, self._device_of(n).type)) \
                    and self._meta_result_matches(n):
                bound.add(n)
        return bound

    def _weight_derived(self) -> dict:
        """Native steps whose value depends on weights alone (weight inputs, constants and
        plan-time numbers, through views and other such steps): ``{step: [weight inputs]}``.

        Such a step (a weight's channels-last copy for a convolution, a weight cast to another
        dtype) is computed on the first call and again only when one of its weights changes:
        the step function compares ``(data_ptr(), _version)`` of each weight with those the
        value was computed from (an in-place ``copy_``, e.g. a LoRA fuse, bumps the version; a
        new tensor has another address; one that reuses a freed tensor's address with the
        same version count is not detected, as for the INT8 kernels' quantized weights).  A
        tensor created in inference mode has no version counter: its steps run on every
        call.  The values stay with the plan while it lives.  The value is the op's own result, held by the
        plan (not arena storage).  Left per call: seeded-random ops, in-place and
        multi-output steps, results that are returned or written in place, steps whose op
        does not return the planned layout, and every step under ``cuda_graphs`` (a replay
        could not skip or redo it)."""
        if self.options.cuda_graphs:
            return {}
        g = self.graph
        written = {storage_root(n) for n in g.nodes if n.inplace_of is not None}
        returned = {storage_root(o) for o in g.outputs if isinstance(o, Node)}
        roots: dict[Node, frozenset] = {}
        cached: dict[Node, list] = {}
        for n in g.nodes:
            if n.is_input:
                if n.is_weight and n not in self.scalars and n not in written:
                    roots[n] = frozenset([n])
                elif n in self.scalars:
                    roots[n] = frozenset()
                continue
            if n.op == "constant" or n.op in SYM_OPS or (n.is_scalar and n in self.scalars):
                roots[n] = frozenset()
                continue
            deps = node_deps(n)
            if not all(d in roots for d in deps) or self.kernels.get(n) is not registry.NATIVE \
                    or n.inplace_of is not None or not isinstance(n.target, torch._ops.OpOverload)\
                    or torch.Tag.nondeterministic_seeded in n.target.tags:
                continue
            mine = frozenset().union(*(roots[d] for d in deps))
            if n.view_of is not None:
                roots[n] = mine
                continue
            m = self.metas.get(n)
            if not mine or not isinstance(m, TensorMeta) or m.is_symbolic or \
                    storage_root(n) in returned or storage_root(n) in written or \
                    not self._meta_result_matches(n):
                continue
            roots[n] = mine
            cached[n] = sorted(mine, key=lambda w: g.inputs.index(w))
        return cached

    def _derivation(self, n: Node) -> tuple:
        """A hashable description of how the cached step ``n`` computes its value from its
        weights (``self.cached[n]``, by position): ops, params, constants (by fingerprint)
        and result layouts, down to the weights.  Plans of other input shapes that derive the
        same value from the same weights describe it alike and share one value."""
        index = {w: i for i, w in enumerate(self.cached[n])}

        def freeze(v: Any) -> Any:
            if isinstance(v, Node):
                return describe(v)
            if isinstance(v, (list, tuple)):
                return tuple(freeze(x) for x in v)
            if isinstance(v, dict):
                return tuple(sorted((k, freeze(x)) for k, x in v.items()))
            if isinstance(v, torch.Tensor):
                return ("tensor", v.dtype, tuple(v.shape), v.stride(), weights.fingerprint(v))
            return v if isinstance(v, (bool, int, str, type(None))) else repr(v)

        def describe(x: Node) -> Any:
            if x in index:
                return ("weight", index[x])
            if x in self.scalars:
                return ("number", repr(self.scalars[x]))
            if x.op == "constant":
                return ("constant", freeze(x.annotations["value"]))
            m = self.metas.get(x)
            layout = (m.dtype, tuple(m.shape), tuple(m.stride), m.storage_offset) \
                if isinstance(m, TensorMeta) else None
            return (x.op, freeze(x.params), tuple(describe(s) for s in x.srcs), layout)

        return describe(n)

    def _writes_strided(self, n: Node) -> bool:
        """``n``'s step writes correctly into an output of any strides: a native op through its
        ``.out`` overload, an extension kernel or fusion rule declaring ``strided_out = True``."""
        k = self.kernels.get(n)
        if k is None or n in self._bound or n in self.cached or \
                isinstance(self.metas[n], tuple):
            return False
        if k is registry.NATIVE:
            return n.op != _COPY_OP and isinstance(n.target, torch._ops.OpOverload) and (
                n.op == "aten._to_copy.default" or out_overload(n.target) is not None)
        return bool(getattr(k, "strided_out", False))

    def _meta_result_matches(self, n: Node) -> bool:
        """Run on meta tensors laid out as its inputs are *in this plan*, ``n``'s op returns
        the layout the plan's metadata says.  (A rewrite upstream may have changed an input's
        strides, and the result's strides can follow them, as attention's do; then the result
        is copied into planned storage of the recorded layout instead.)"""
        def val(v: Any) -> Any:
            if isinstance(v, Node):
                if v in self.scalars:
                    return self.scalars[v]
                m = self.metas.get(v)
                if not isinstance(m, TensorMeta):
                    raise LookupError(f"%{v.id} has no concrete metadata")
                return _meta_tensor(m)
            return _META if isinstance(v, torch.device) else v

        try:
            a, kw = call_args(n, val, val)
            out = _fake_layout_call(n, a, kw) if n.op in _FAKE_LAYOUT_OPS else n.target(*a, **kw)
        except Exception:  # no meta kernel (or a data-dependent input): keep the copy
            return False
        want = self.metas[n]
        pairs = zip(out, want) if isinstance(want, tuple) and isinstance(out, (tuple, list)) \
            else [(out, want)]
        for t, m in pairs:
            if not isinstance(m, TensorMeta):
                continue
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(m.shape) or any(
                    size > 1 and st != want_st
                    for size, st, want_st in zip(m.shape, t.stride(), m.stride)):
                return False
        return True

    def _keys_of(self, n: Node) -> list:
        m = self.metas[n]
        if isinstance(m, tuple):
            return [(n.id, i) for i, x in enumerate(m) if isinstance(x, TensorMeta)]
        return [(n.id, None)] if isinstance(m, TensorMeta) else []

    def _buffer(self, key: tuple) -> torch.Tensor:
        owner = self._by_id[key[0]]
        m = self.metas[owner]
        if key[1] is not None:
            m = m[key[1]]
        off = self.memory.offsets[key]
        arena = self.arenas[str(m.device)]
        typed = arena[off: off + m.span_bytes + m.storage_offset * m.itemsize].view(m.dtype)
        return typed.as_strided(m.shape, m.stride, typed.storage_offset() + m.storage_offset)

    def _build(self) -> None:
        g = self.graph
        self._by_id = {n.id: n for n in g.nodes}
        ns: dict[str, Any] = {"empty_strided": torch.empty_strided, "_wkey": weights.weight_key,
                              "_wcell": _weight_cell, "_held": self._held}
        wkeys: dict[Node, str] = {}  # weight -> the name of its key, computed once per call
        consts: dict[int, str] = {}
        counter = itertools.count()

        def const(v: Any) -> _Code:
            if isinstance(v, (bool, int, float, str, type(None))) and not isinstance(v, float):
                return _Code(repr(v))
            k = id(v)
            if k not in consts:
                consts[k] = name = f"c{next(counter)}"
                ns[name] = v
                ns.setdefault("_keep", []).append(v)
            return _Code(consts[k])

        expr: dict[Node, Any] = {}  # node -> _Code (or tuple of _Code for multi outputs)
        plan_time: dict[Node, Any] = {}  # node -> value known at plan time
        lines: list[str] = []
        per_call = set(self.memory.per_call)
        inputs = g.inputs
        for i, n in enumerate(inputs):
            if n in self.scalars:
                expr[n] = const(self.scalars[n])
                plan_time[n] = self.scalars[n]
            else:
                expr[n] = _Code(f"a{i}")
        if inputs:
            lines.append(", ".join(f"a{i}" for i in range(len(inputs))) +
                         (", = args" if len(inputs) == 1 else " = args"))

        def value_of(v: Any) -> Any:
            if isinstance(v, Node):
                if v in plan_time:
                    return const(plan_time[v])
                return expr[v]
            return const(v)

        def src_of(v: Node) -> Any:
            return plan_time_code(v) if v in plan_time else expr[v]

        def plan_time_code(v: Node) -> _Code:
            return const(plan_time[v])

        def storage(n: Node, index: int | None) -> tuple[Any, Any]:
            """(code, plan-time tensor or None) of an owner buffer."""
            key = (n.id, index)
            if key in per_call:
                m = self.metas[n] if index is None else self.metas[n][index]
                name = f"v{n.id}" if index is None else f"v{n.id}_{index}"
                lines.append(f"{name} = empty_strided({tuple(m.shape)!r}, {tuple(m.stride)!r}, "
                             f"dtype={const(m.dtype).src}, device={const(m.device).src})")
                return _Code(name), None
            if key in self.memory.offsets:
                t = self._buffer(key)
                return const(t), t
            return None, None  # an output nobody reads and nobody returns

        bound_keys = {k for n in self._bound for k in self._keys_of(n)}
        holders: dict[tuple, list[str]] = {}  # bound storage -> the names that hold it

        def hold(n: Node, name: str) -> None:
            owner, index = storage_root(n)
            if (owner.id, index) in bound_keys:
                holders.setdefault((owner.id, index), []).append(name)

        def bind_result(n: Node, kernel: Any) -> None:
            """Per call: ``v = op(...)``, the op's own result is the node's value."""
            a, kw = call_args(n, src_of, value_of)
            fn = const(n.target._op if hasattr(n.target, "_op") else n.target)
            lines.append(f"v{n.id} = {fn.src}({self._args_src(a, kw)})")
            expr[n] = _Code(f"v{n.id}")
            self.step_counts[kernel.name] += 1
            if n.view_of is not None:
                hold(n, f"v{n.id}")

        read_index = self._read_indices()

        def emit(n: Node) -> None:
                if n.is_input:
                    return
                if n.op == "constant":
                    plan_time[n] = n.annotations["value"]
                    expr[n] = const(plan_time[n])
                    return
                if n.op in SYM_OPS or (n.is_scalar and n in self.scalars):
                    plan_time[n] = self.scalars[n]
                    expr[n] = const(plan_time[n])
                    return
                if n.op == "getitem":
                    parent = n.srcs[0]
                    idx = n.params["index"]
                    if parent in plan_time:
                        plan_time[n] = plan_time[parent][idx]
                        expr[n] = const(plan_time[n])
                    elif isinstance(expr[parent], tuple):
                        expr[n] = expr[parent][idx]
                    else:
                        lines.append(f"v{n.id} = {expr[parent].src}[{idx}]")
                        expr[n] = _Code(f"v{n.id}")
                        hold(n, f"v{n.id}")
                    return
                kernel = self.kernels[n]
                if n.view_of is not None:
                    deps_plan_time = all(s in plan_time for s in n.srcs)
                    if deps_plan_time and kernel is registry.NATIVE:
                        # a view of planned storage never changes: take it once, here
                        a2, kw2 = call_args(n, lambda s: plan_time[s],
                                            lambda v: plan_time[v] if isinstance(v, Node) else v)
                        plan_time[n] = n.target(*a2, **kw2)
                        expr[n] = const(plan_time[n])
                        return
                    bind_result(n, kernel)
                    return
                if n.op.startswith("fused.") and n.inplace_of is not None:
                    # a terminal copy: the fused kernel writes the copy's destination
                    dest = src_of(n.inplace_of)
                    lines.append(self._extension_call(n, kernel, [src_of(s) for s in n.srcs],
                                                      [dest], const))
                    expr[n] = dest
                    self.step_counts[kernel.name] += 1
                    return
                if n.inplace_of is not None:
                    a, kw = call_args(n, src_of, value_of)
                    fn = const(n.target._op if hasattr(n.target, "_op") else n.target)
                    lines.append(f"{fn.src}({self._args_src(a, kw)})")
                    expr[n] = expr[n.inplace_of] if n.inplace_of not in plan_time \
                        else const(plan_time[n.inplace_of])
                    self.step_counts[kernel.name] += 1
                    return
                if n.is_scalar or n.meta is None:
                    bind_result(n, kernel)
                    return
                if n in self.cached:
                    # the model's value, computed again only when a weight it reads changed
                    # (_weight_derived; fxbackend.weights: checked by fingerprint every call)
                    a, kw = call_args(n, src_of, value_of)
                    ws = self.cached[n]
                    for w in ws:
                        if w not in wkeys:
                            wkeys[w] = f"_wk{w.id}"
                            lines.append(f"_wk{w.id} = _wkey({expr[w].src})")
                    what = weights.what_id(self._derivation(n))
                    lines.append(f"_c = _wcell(({''.join(expr[w].src + ', ' for w in ws)}), "
                                 f"{what}, _held)")
                    lines.append(f"_k = ({''.join(wkeys[w] + ', ' for w in ws)})")
                    lines.append("_p = _c._pair")
                    lines.append("if _p[0] != _k:")
                    lines.append(f"    _p = (_k, {const(n.target._op).src}("
                                 f"{self._args_src(a, kw)}))")
                    lines.append("    _c.set(*_p)")
                    lines.append(f"v{n.id} = _p[1]")
                    self._cache_nodes[what] = n
                    expr[n] = _Code(f"v{n.id}")
                    holders.setdefault((n.id, None), []).append(f"v{n.id}")
                    self.step_counts[kernel.name] += 1
                    return
                if n in self._bound:
                    a, kw = call_args(n, src_of, value_of)
                    call = f"{const(n.target._op).src}({self._args_src(a, kw)})"
                    self.step_counts[kernel.name] += 1
                    if isinstance(self.metas[n], tuple):
                        lines.append(f"_r = {call}")
                        codes = []
                        for i in range(len(self.metas[n])):
                            if i in read_index.get(n, ()):
                                lines.append(f"v{n.id}_{i} = _r[{i}]")
                                codes.append(_Code(f"v{n.id}_{i}"))
                                holders.setdefault((n.id, i), []).append(f"v{n.id}_{i}")
                            else:
                                codes.append(None)
                        lines.append("del _r")  # unread outputs go now
                        expr[n] = tuple(codes)
                    else:
                        lines.append(f"v{n.id} = {call}")
                        expr[n] = _Code(f"v{n.id}")
                        holders.setdefault((n.id, None), []).append(f"v{n.id}")
                    return
                # a compute node that owns fresh storage
                multi = isinstance(self.metas[n], tuple)
                if (not multi and kernel is registry.NATIVE and (n.id, None) in per_call
                        and n.target is not None and n.op != "aten._to_copy.default"
                        and not (isinstance(n.target, torch._ops.OpOverload) and out_overload(n.target))):
                    # returned to the caller and computed fresh anyway: hand that result over
                    bind_result(n, kernel)
                    return
                if n in self.concat.placed:
                    # some parts already live in this cat's buffer: copy only the others
                    code, t = storage(n, None)
                    expr[n], plan_time[n] = code, t
                    left = self.concat.copies_left(n, self.metas.__getitem__)
                    for j in left:
                        d, start, length = self.concat.dest[(n, j)]
                        lines.append(f"{const(t.narrow(d, start, length)).src}"
                                     f".copy_({_render(src_of(n.srcs[j]))})")
                    if left:
                        self.step_counts[kernel.name] += 1
                    return
                if multi:
                    outs = [storage(n, i) if isinstance(m, TensorMeta) else (None, None)
                            for i, m in enumerate(self.metas[n])]
                else:
                    outs = [storage(n, None)]
                codes = [c for c, _ in outs]
                if all(t is not None for _, t in outs):
                    plan_time[n] = tuple(t for _, t in outs) if multi else outs[0][1]
                expr[n] = tuple(codes) if multi else codes[0]
                self.step_counts[kernel.name] += 1
                if n.op == _COPY_OP:  # a copy the scheduler inserted for placement
                    if codes[0] is not None:
                        lines.append(f"{codes[0].src}.copy_({_render(src_of(n.srcs[0]))})")
                        self.copies += 1
                    return
                if kernel is not registry.NATIVE or n.target is None:
                    if kernel is registry.NATIVE:  # a custom op's reference execute
                        from .ops import get_op
                        kernel = get_op(n.op)
                    lines.append(self._extension_call(n, kernel, [src_of(s) for s in n.srcs],
                                                      codes, const))
                    return
                a, kw = call_args(n, src_of, value_of)
                ov = out_overload(n.target) if isinstance(n.target, torch._ops.OpOverload) else None
                if n.op in _COPY_OPS and codes[0] is not None:
                    # a conversion (or a clone) into planned storage is exactly copy_ (dtype,
                    # device, layout: the planned storage has the layout the op would give)
                    lines.append(f"{codes[0].src}.copy_({_render(a[0])})")
                elif ov is not None and all(c is not None for c in codes):
                    fast = _FAST_OUT.get(n.op) if not kw or n.op == "aten.gelu.default" else None
                    if fast is not None:
                        a, kw = call_args(n, src_of, value_of,
                                          lambda v: self._scalar_operand(n, v, const))
                    if isinstance(fast, tuple):  # (binding, extra positional arguments)
                        fast, extra = fast
                        a = list(a) + [const(x) for x in extra]
                    fn = const(fast or ov[0]._op)
                    outkw = ", ".join(f"{name}={c.src}" for name, c in zip(ov[1], codes))
                    args_src = self._args_src(a, kw)
                    lines.append(f"{fn.src}({args_src}{', ' if args_src else ''}{outkw})")
                else:
                    fn = const(n.target._op if hasattr(n.target, "_op") else n.target)
                    call = f"{fn.src}({self._args_src(a, kw)})"
                    if multi:
                        lines.append(f"_r = {call}")
                        for i, c in enumerate(codes):
                            if c is not None:
                                lines.append(f"{c.src}.copy_(_r[{i}])")
                                self.copies += 1
                    elif codes[0] is not None:
                        lines.append(f"{codes[0].src}.copy_({call})")
                        self.copies += 1
                    else:
                        lines.append(call)
        callback = self.options.eval_callback
        self._aux_nodes = {n for r in self.regions for n in r.aux}
        node_lines: dict = {}
        if self.options.profile:
            ns["_pc"] = time.perf_counter
            ns["_prof"] = self.step_seconds
            sync = self._plan_device().type == "cuda"
            if sync:
                ns["_sync"] = torch.cuda.synchronize
        for i, n in enumerate(g.nodes):
            mark = len(lines)
            emit(n)
            if callback is not None and not n.is_input and n in expr:
                lines.append(f"_cb({const(n).src}, {_render(expr[n])})")
            if self.options.profile and n in self.kernels and len(lines) > mark:
                lines.insert(mark, "_sync(); _t = _pc()" if sync else "_t = _pc()")
                lines.append(("_sync(); " if sync else "") + f"_prof[{i}] += _pc() - _t")
            node_lines[n] = lines[mark:]
            del lines[mark:]
        if callback is not None:
            ns["_cb"] = callback
        # drop each bound result after its last read (after the region, inside one)
        dels: dict[int, list[str]] = {}
        if holders:
            life = {b.key: b.end for b in buffers_of(g, lambda n: self.metas[n])[0]}
            for key, names in holders.items():
                if key in life:
                    dels.setdefault(life[key], []).extend(names)

        def del_lines(first: int, last: int) -> list[str]:
            names = [v for t in range(first, last) for v in dels.get(t, ())]
            return [f"del {', '.join(names)}"] if names else []

        pos = 0
        for k, region in enumerate(self.regions):
            for t in range(pos, region.start):
                lines.extend(node_lines[g.nodes[t]])
                lines.extend(del_lines(t, t + 1))
            lines.extend(self._region_lines(k, region, node_lines, ns))
            lines.extend(del_lines(region.start, region.end))
            pos = region.end
        for t in range(pos, len(g.nodes)):
            lines.extend(node_lines[g.nodes[t]])
            lines.extend(del_lines(t, t + 1))

        outs = []
        self._lines = lines
        for o in g.outputs:
            if isinstance(o, Node):
                outs.append(const(plan_time[o]).src if o in plan_time else _render(expr[o]))
            else:
                outs.append(const(o).src)
        lines.append("return [" + ", ".join(outs) + "]")
        # one workspace tensor per plan (empty when no step asks for scratch)
        dev = next(iter(self.arenas), None) or self._plan_device()
        ns["_ws"] = self.workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8,
                                                 device=dev)
        if self.regions:
            ns["_ws_aux"] = self.aux_workspace = torch.empty(self.aux_workspace_bytes,
                                                             dtype=torch.uint8, device=dev)
        # constants become closure cells of the step function: cheaper to load than globals
        names = [k for k in ns if not k.startswith("__") and k != "_keep"]
        self.source = ("def _make(" + ", ".join(names) + "):\n"
                       "    def run(args):\n" + "\n".join("        " + ln for ln in lines) +
                       "\n    return run\n")
        code = compile(self.source, f"<fxbackend plan {self.name}>", "exec")
        scope: dict[str, Any] = {}
        exec(code, scope)
        self._run = scope["_make"](*[ns[k] for k in names])
        self._ns = ns

    def _region_lines(self, k: int, region: Any, node_lines: dict, ns: dict) -> list[str]:
        """The generated code of one fork/join region: the auxiliary branches on the region
        thread (CPU) or the auxiliary stream (CUDA), the main branch here, then the join."""
        aux = region.aux
        main = region.branches[region.main]
        free_lines = [ln for n in region.free for ln in node_lines[n]]
        aux_lines = [ln for n in aux for ln in node_lines[n]]
        main_lines = [ln for n in main for ln in node_lines[n]]
        defined = list(dict.fromkeys(m.group(1) for ln in aux_lines
                                     if (m := _ASSIGNED.match(ln)) and m.group(1) != "_r"))
        if not aux_lines:
            return free_lines + main_lines
        if self._plan_device().type == "cuda":
            ns["_aux_stream"] = self._aux_stream
            ns["_cur_stream"] = torch.cuda.current_stream
            ns["_on_stream"] = torch.cuda.stream
            ns["_record"] = _record_stream
            out = free_lines + [f"_main_s{k} = _cur_stream()",
                   f"_aux_stream.wait_stream(_main_s{k})",  # fork
                   "with _on_stream(_aux_stream):"]
            out += ["    " + ln for ln in aux_lines]
            out += main_lines
            out.append(f"_main_s{k}.wait_stream(_aux_stream)")  # join
            # storage allocated on the auxiliary stream and read on the main one
            out += [f"_record({v}, _main_s{k})" for v in defined]
            return out
        ns["_submit"] = _submit_branch
        ns["_wait"] = concurrent.futures.wait
        ns["_token"] = self.cancel_token
        out = free_lines + [f"def _aux{k}():"]
        out += ["    " + ln for ln in aux_lines]
        out.append("    return (" + "".join(f"{v}, " for v in defined) + ")")
        out.append(f"_f{k} = _submit(_aux{k}, _token)")  # fork
        out.append("try:")
        out += ["    " + ln for ln in main_lines] or ["    pass"]
        out.append("finally:")
        out.append(f"    _wait([_f{k}])")  # never leave a branch running behind an error
        out.append(("".join(f"{v}, " for v in defined) or "_") + f" = _f{k}.result()")  # join
        return out

    def _scalar_operand(self, n: Node, v: Any, const) -> Any:
        """A number passed to a Tensor argument of a float32/float64 op, as a 0-dim CPU tensor
        of the op's dtype made once: ATen would wrap the number into a tensor on every call.

        Exact: for these dtypes the op converts a wrapped number to its own dtype too, and a
        0-dim CPU tensor takes the same scalar path.  Lower-precision dtypes keep the number
        (their kernels compute with it in float32)."""
        m = self.metas[n]
        if type(v) not in (int, float) or not isinstance(m, TensorMeta):
            return None
        if m.dtype not in (torch.float32, torch.float64):
            return None
        if any(self.metas[s].dtype != m.dtype for s in n.srcs):
            return None
        return const(torch.tensor(v, dtype=m.dtype))

    def _plan_device(self) -> torch.device:
        for n in self.graph.nodes:
            m = self.metas.get(n)
            if isinstance(m, TensorMeta):
                return m.device
        return torch.device("cpu")

    def _set_meta(self, n: Node, meta: TensorMeta) -> None:
        """Give ``n`` other metadata (a plan-time layout decision) in the node and the plan."""
        n.meta = meta
        self.metas[n] = meta

    def _device_of(self, n: Node) -> torch.device:
        m = self.metas.get(n)
        if isinstance(m, tuple):
            m = next((x for x in m if isinstance(x, TensorMeta)), None)
        if isinstance(m, TensorMeta):
            return m.device
        for s in n.srcs:
            sm = self.metas.get(s)
            if isinstance(sm, TensorMeta):
                return sm.device
        return torch.device("cpu")

    @staticmethod
    def _args_src(a: list, kw: dict) -> str:
        parts = [_render(x) if not isinstance(x, _Code) else x.src for x in a]
        parts += [f"{k}={_render(v)}" for k, v in kw.items()]
        return ", ".join(parts)

    def _prepare_steps(self) -> dict:
        """``prepare(node) -> (state, workspace_bytes)`` of every extension step, before any
        storage exists (metadata only).  The workspace is the largest request, not the sum."""
        from .ops import get_op
        prepared = {}
        for n, k in self.kernels.items():
            owner = get_op(n.op) if k is registry.NATIVE and n.target is None else k
            if owner is registry.NATIVE or owner is None:
                continue
            prepare = getattr(owner, "prepare", None)
            state, ws = prepare(n) if prepare is not None else (None, 0)
            if not isinstance(ws, int) or ws < 0:
                raise ValueError(f"{getattr(owner, 'name', owner)}.prepare(%{n.id}) returned "
                                 f"workspace_bytes={ws!r}; expected an int >= 0")
            self._states.append((owner, state))
            self.workspace_bytes = max(self.workspace_bytes, ws)
            self._ws_by_node[n] = ws
            prepared[n] = state
        return prepared

    def _find_regions(self) -> tuple[list, str | None]:
        """The fork/join regions this plan runs concurrently (``fxbackend.streams``), and why
        none when there are none."""
        want = self.options.streams
        if want is False:
            return [], "off (options streams=False or FXB_STREAMS=0)"
        if self.options.eval_callback is not None:
            return [], "off: a per-node evaluation callback is set"
        if self.options.profile:
            return [], "off: profiling times one step at a time"
        if any(n.annotations.get("placed") for n in self.graph.nodes):
            return [], "off: steps placed on another device"
        dev = self._plan_device()
        if want is None and dev.type != "cuda":
            # the default gate (streams.worth_it) never overlaps off CUDA: every CPU plan would
            # pay the region scan for nothing
            return [], "no region worth overlapping (options streams=True forces them)"
        metas = lambda n: self.metas[n]  # noqa: E731
        regions = find_regions(self.graph, self.kernels, metas)
        if want is None:
            regions = [r for r in regions if worth_it(r, metas, dev)]
        if not regions:
            return [], ("no fork/join region with independent branches" if want
                        else "no region worth overlapping (options streams=True forces them)")
        if dev.type == "cpu":
            from .services import concurrency_blocker
            why = concurrency_blocker()
            if why is not None:
                return [], f"off: {why}"
        elif dev.type == "cuda":
            self._aux_stream = torch.cuda.Stream(dev)
        aux = {n for r in regions for n in r.aux}
        self.aux_workspace_bytes = max([self._ws_by_node.get(n, 0) for n in aux] + [0])
        return regions, None

    def _extension_call(self, n: Node, kernel: Any, srcs: list, codes: list, const) -> str:
        state = self._prepared.get(n)
        ctx = ExecContext(self._device_of(n))
        srcs = "[" + ", ".join(_render(c) for c in srcs) + "]"
        out = codes[0].src if len(codes) == 1 else "(" + ", ".join(c.src for c in codes) + ",)"
        ws = "_ws_aux" if n in self._aux_nodes else "_ws"
        call = (f"{const(kernel.execute).src}({const(ctx).src}, {const(n).src}, "
                f"{const(state).src}, {srcs}, {out}, {ws})")
        from .ops import get_op
        owners = [o for o in (kernel, get_op(n.op)) if callable(getattr(o, "update_args", None))]
        if not owners:
            return call
        # the update_args capability: told when an input's address differs from the last call
        watch = _AddressWatch(n, state, [o.update_args for o in dict.fromkeys(owners)])
        return f"{const(watch).src}({srcs}); " + call

    # -- running --------------------------------------------------------------------------
    def run(self, args: list) -> list:
        """Execute without validating inputs; returns the list of outputs."""
        stats.record_plan_call(self._stats_key)
        if self.options.profile:
            self.profiled_calls += 1
        run = self._graph_runner or self._run
        if not self._prepared:
            return run(args)
        self.cancel_token.clear()
        with running(self.cancel_token):
            return run(args)

    def cancel(self) -> None:
        """Cancel the running call (from any thread): services such as ``cpu_parallel`` stop
        early with :class:`fxbackend.services.Cancelled`."""
        self.cancel_token.cancel()

    def derived_values(self) -> dict:
        """``{cached step: its value}`` for the weight-derived steps this plan has run (the
        model-wide values of ``fxbackend.weights``, shared with the model's other plans)."""
        return {self._cache_nodes[key[1]]: c.value for key, c in self._held.items()
                if key[1] in self._cache_nodes and c.value is not None}

    def report(self) -> str:
        """The node list with the kernel chosen for each step, then what fusion did."""
        lines = [f"plan {self.name}: {self.memory.summary()}, workspace "
                 f"{self.workspace_bytes / 2**20:.2f} MB ({self.workspace_bytes} bytes)"]
        lines += self.cpu_report
        from .ir import format_node
        for n in self.graph.nodes:
            k = self.kernels.get(n)
            lines.append(format_node(n) + (f"  [{k.name}]" if k is not None else ""))
        if self.regions:
            for r in self.regions:
                lines.append("concurrent " + r.describe() + ": auxiliary " +
                             ", ".join(f"%{n.id}" for n in r.aux if n in self.kernels))
        elif self.options.streams:  # asked for and none: say why
            lines.append(f"concurrent regions: {self.regions_off}")
        for cat, parts in self.concat.placed.items():
            left = self.concat.copies_left(cat, self.metas.__getitem__)
            lines.append(f"concatenation %{cat.id}: " + ", ".join(
                f"%{cat.srcs[j].id}" for j in sorted(parts)) + " written in place" +
                (f"; copies %{', %'.join(str(cat.srcs[j].id) for j in left)}" if left
                 else "; no copy"))
        if self.folded:
            lines.append(f"constant steps folded at plan time: {self.folded}")
        if self.cached:
            nbytes = sum(self.metas[n].span_bytes for n in self.cached)
            lines.append(f"steps computed from weights alone, kept between calls: "
                         f"{len(self.cached)} ({nbytes / 2**20:.2f} MB, held once per model, "
                         f"checked by the weights' fingerprints every call): " +
                         ", ".join(f"%{n.id}" for n in self.cached))
        if self.identity_cats or self.identity_clones:
            lines.append(f"copies elided (readers read the source): {self.identity_cats} "
                         f"concatenation(s) of slices, {self.identity_clones} clone(s)")
        if self.options.cuda_graphs:
            lines.append("cuda graph: " + (
                f"captured {self._graph_runner.captures} time(s)" if self._graph_runner
                else f"off: {self.cuda_graph_off}"))
        for n, k in self.kernels.items():  # extension kernels that did not take a node
            if n.view_of is not None or n.inplace_of is not None or \
                    not registry.kernels_for(self._kernel_device(n), n.op):
                continue
            for name, why in registry.declined_kernels(self._kernel_device(n), n, k):
                lines.append(f"kernel {name} declined %{n.id}: {why}")
        for rule, ids, why in self.rewrites_declined:
            lines.append(f"rewrite {rule} declined on " + ", ".join(f"%{i}" for i in ids) +
                         f": {why}")
        lines.append(self.fusion_report.format())
        return "\n".join(lines)

    def profile_report(self, top: int = 20) -> str:
        """With ``options={"profile": True}``: where the time of this plan's calls went, per
        kernel, per (kernel, op) and for the ``top`` most expensive steps (milliseconds per
        call; wall clock around each step, synchronised on CUDA)."""
        if not self.options.profile:
            return f"plan {self.name}: not profiled (options profile=True or FXB_PROFILE=1)"
        calls = max(self.profiled_calls, 1)
        steps = [(sec, n) for sec, n in zip(self.step_seconds, self.graph.nodes)
                 if n in self.kernels and sec > 0]
        total = sum(sec for sec, _ in steps)
        lines = [f"plan {self.name}: {self.profiled_calls} profiled call(s), "
                 f"{total / calls * 1e3:.2f} ms per call in {len(steps)} steps"]
        if not steps:
            return lines[0]

        def table(title: str, rows: dict) -> None:
            lines.append(title)
            for key, sec in sorted(rows.items(), key=lambda kv: -kv[1])[:top]:
                lines.append(f"  {sec / calls * 1e3:9.3f} ms  {100 * sec / total:5.1f}%  {key}")

        by_kernel: Counter = Counter()
        by_op: Counter = Counter()
        for sec, n in steps:
            by_kernel[self.kernels[n].name] += sec
            by_op[f"{self.kernels[n].name}: {n.op}"] += sec
        table("by kernel:", by_kernel)
        table("by kernel and op:", by_op)
        from .ir import format_node
        table(f"top {top} steps:", {format_node(n): sec for sec, n in steps})
        return "\n".join(lines)

    def __call__(self, *args: Any) -> list:
        """Validate ``args`` against this plan's signature, then execute."""
        inputs = self.graph.inputs
        if len(args) != len(inputs):
            raise ValueError(f"plan {self.name} expects {len(inputs)} inputs, got {len(args)}")
        for i, (n, a) in enumerate(zip(inputs, args)):
            m = self.metas[n]
            what = _describe_input(self.graph, i, n)
            if isinstance(m, TensorMeta):
                if not isinstance(a, torch.Tensor):
                    raise ValueError(f"{what}: expected a tensor {m.short()}, got "
                                     f"{type(a).__name__}")
                if a.dtype != m.dtype:
                    raise ValueError(f"{what}: expected dtype {m.dtype}, got {a.dtype}")
                if tuple(a.shape) != tuple(m.shape):
                    raise ValueError(f"{what}: expected shape {tuple(m.shape)}, got "
                                     f"{tuple(a.shape)}")
                if a.device.type != m.device.type:
                    raise ValueError(f"{what}: expected device {m.device}, got {a.device}")
                if any(sz > 1 and st != want for sz, st, want in zip(a.shape, a.stride(), m.stride)):
                    raise ValueError(f"{what}: expected strides {tuple(m.stride)}, got "
                                     f"{a.stride()}")
            elif n in self.scalars and a != self.scalars[n]:
                raise ValueError(f"{what}: this plan was built for {self.scalars[n]}, got {a}")
        return self.run(list(args))


class CompiledGraph:
    """A lowered graph and its plans, one per input-shape signature.

    Calling it (``cg(*inputs)``) validates the inputs, builds or reuses the plan for their
    signature and runs it.  Plans built under an older registry generation are rebuilt.
    """

    def __init__(self, graph: Graph, options: Options, name: str = "graph") -> None:
        self.graph = graph
        self.options = options
        self.name = name
        self.symbolic = graph.is_symbolic
        self.plans: dict[Any, Plan] = {}
        self._static: Plan | None = None
        #: callables ``fn(compiled_graph, args)`` told the arguments of each :meth:`run`
        #: (``fxbackend.record_graphs`` keeps the tensors a Dynamo graph is called with, to
        #: save them); empty: nothing is told
        self.observers: list = []
        inputs = graph.inputs
        # the inputs whose shapes (or values) vary between signatures
        self._varying = [i for i, n in enumerate(inputs)
                         if n.is_scalar or (isinstance(n.meta, TensorMeta) and n.meta.is_symbolic)]

    def _key(self, args: Sequence[Any]) -> tuple:
        key = []
        for i in self._varying:
            a = args[i]
            key.append((tuple(a.shape), a.stride(), a.dtype, a.device)
                       if isinstance(a, torch.Tensor) else a)
        return tuple(key)

    def plan_for(self, args: Sequence[Any]) -> Plan:
        """The plan for these inputs (validated), building it when needed."""
        if not self.symbolic:
            plan = self._static
            if plan is None or plan.generation != registry.generation():
                metas, scalars = concretize(self.graph, args)
                plan = self._static = Plan(self.graph, self.options, metas, scalars, self.name)
            return plan
        if len(args) != len(self.graph.inputs):
            raise ValueError(f"{self.name} expects {len(self.graph.inputs)} inputs, got {len(args)}")
        key = self._key(args)
        plan = self.plans.get(key)
        if plan is None or plan.generation != registry.generation():
            metas, scalars = concretize(self.graph, args)
            if plan is None and self.plans:  # a new signature (not a registry rebuild)
                stats.bump("replans")
            plan = self.plans[key] = Plan(self.graph, self.options, metas, scalars,
                                          f"{self.name}[{len(self.plans)}]")
        return plan

    def run(self, args: list) -> list:
        """The fast path (behind Dynamo's guards): validate only when a plan is built, unless
        the ``validate_inputs`` option asks for every call."""
        if self.observers:
            for observer in list(self.observers):
                observer(self, args)
        if self.options.validate_inputs:
            return self.plan_for(args)(*args)
        if not self.symbolic:
            plan = self._static
            if plan is None or plan.generation != registry.generation():
                plan = self.plan_for(args)
            return plan.run(args)
        return self.plan_for(args).run(args)

    def __call__(self, *args: Any) -> list:
        return self.plan_for(args)(*args)

    def profile_report(self, top: int = 20) -> str:
        """:meth:`Plan.profile_report` of every plan this graph built (``options.profile``)."""
        plans = ([self._static] if self._static is not None else []) + list(self.plans.values())
        if not plans:
            return f"{self.name}: no plan built yet"
        return "\n\n".join(p.profile_report(top) for p in plans)
