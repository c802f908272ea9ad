"""The plan-time pipeline: named passes over one :class:`PlanState`.

A plan is built by running :data:`PLAN_PASSES` in order over the state of one concrete graph
(:func:`run_plan_passes`); each :class:`PlanPass` names the fields of the state it reads and
writes, so a pass can be run and tested alone on a hand-built state.  The runner times every
pass (``PlanState.timings``, shown by ``fxbackend.explain``), prints the node list after each
one with ``FXB_DUMP=1``, and skips a pass whose ``when`` says it has nothing to do.  Printing
:data:`PLAN_PASSES` (or :func:`describe_passes`) names every pass in order.

Metadata has one truth: ``node.meta`` of the plan's copy of the graph (``concrete.instantiate``
puts the concrete metadata there; passes that change a layout change ``node.meta``).

What runs after the passes (arena allocation, code generation, the CUDA graph) is the runtime
plan's (``executor.Plan``, ``codegen``).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import sys
import time
from collections import Counter
from typing import Any, Callable

import torch

from . import registry, stats
from .concat import ConcatPlan, elide_identity_cats, elide_identity_clones, plan_concat
from .concrete import FAKE_LAYOUT_OPS, fake_layout_call, meta_tensor
from .cpu import cpu_report_lines
from .fold import fold_constants
from .fusion import FusionReport, apply_fusions, replace_uses_from
from .ir import Graph, Node, TensorMeta, contiguous_strides, node_deps, storage_root
from .lower import SYM_OPS
from .memory import MemoryPlan, plan_memory
from .native import call_args, out_is_copy, out_overload
from .options import Options
from .rewrite import RewriteContext, apply_rewrites
from .streams import find_regions, region_lifetimes, worth_it

__all__ = ["PlanState", "PlanPass", "PLAN_PASSES", "run_plan_passes", "describe_passes",
           "COPY_DEVICE_OP", "COPY_OPS", "FAST_OUT", "keys_of", "device_of", "plan_device"]

#: the op of copies the scheduler inserts to run a node on another device
COPY_DEVICE_OP = "fxb.copy_device.v1"
#: native ops that are a copy into fresh storage of their planned layout: they run as
#: ``planned.copy_(x)`` (no per-call allocation; the arena's pages are already mapped)
COPY_OPS = ("aten._to_copy.default", "aten.clone.default")
_META = torch.device("meta")


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


FAST_OUT = _fast_out_table()


@dataclasses.dataclass
class PlanState:
    """Everything the plan-time passes read and write for one concrete graph.  Built by
    :meth:`start`; each field is written by the pass named in its comment."""

    graph: Graph
    options: Options
    #: scalar nodes whose value is known at plan time (sizes, integer arithmetic on them)
    scalars: dict
    name: str = "graph"
    rewrites: dict = dataclasses.field(default_factory=dict)          # rewrite
    #: (rule name, [node ids], reason) of every instance a rewrite rule left alone
    rewrites_declined: list = dataclasses.field(default_factory=list)  # rewrite
    cpu_report: list = dataclasses.field(default_factory=list)         # cpu_profile
    folded: int = 0                                                    # fold_constants
    identity_cats: int = 0                                             # elide_identity_cats
    identity_clones: int = 0                                           # elide_identity_clones
    fusion_report: FusionReport = dataclasses.field(default_factory=FusionReport)  # fuse
    kernels: dict = dataclasses.field(default_factory=dict)            # select_kernels
    #: native steps whose op returns its own result (``classify_steps``)
    bound: set = dataclasses.field(default_factory=set)
    #: native steps computed from weights alone: ``{step: [weights]}`` (``classify_steps``)
    cached: dict = dataclasses.field(default_factory=dict)
    #: such steps left per call, cheaper to redo than to check: ``{step: weights' bytes}``
    recomputed: dict = dataclasses.field(default_factory=dict)
    #: ``(node id, index)`` keys that need no planned storage (``classify_steps``)
    unread: set = dataclasses.field(default_factory=set)
    concat: ConcatPlan = dataclasses.field(default_factory=ConcatPlan)  # plan_concat
    prepared: dict = dataclasses.field(default_factory=dict)           # prepare
    #: (kernel or op, state) of every prepared step, destroyed with the plan (``prepare``)
    states: list = dataclasses.field(default_factory=list)
    workspace_bytes: int = 0                                           # prepare
    ws_by_node: dict = dataclasses.field(default_factory=dict)         # prepare
    regions: list = dataclasses.field(default_factory=list)            # find_regions
    regions_off: str | None = None                                     # find_regions
    aux_workspace_bytes: int = 0                                       # find_regions
    aux_stream: Any = None                                             # find_regions
    memory: MemoryPlan | None = None                                   # plan_memory
    #: seconds each pass took (the runner)
    timings: dict = dataclasses.field(default_factory=dict)

    @property
    def aux_nodes(self) -> set:
        """The steps of auxiliary branches (they use the second workspace)."""
        return {n for r in self.regions for n in r.aux}


@dataclasses.dataclass(frozen=True)
class PlanPass:
    """One plan-time pass: ``run(state)``, what it reads and writes of the state, and
    ``when(state)``: False skips it (the runner records no time for it)."""
    name: str
    run: Callable[[PlanState], None]
    reads: tuple
    writes: tuple
    when: Callable[[PlanState], bool] | None = None

    def __repr__(self) -> str:
        return (f"{self.name} (reads {', '.join(self.reads) or 'nothing'}; "
                f"writes {', '.join(self.writes) or 'nothing'})")


# -- helpers the passes share ---------------------------------------------------------------

def device_of(n: Node) -> torch.device:
    """The device of ``n``'s (first tensor) result, else of its first tensor source."""
    m = n.meta
    if isinstance(m, tuple):
        m = next((x for x in m if isinstance(x, TensorMeta)), None)
    if isinstance(m, TensorMeta):
        return m.device
    for s in n.srcs:
        if isinstance(s.meta, TensorMeta):
            return s.meta.device
    return torch.device("cpu")


def plan_device(graph: Graph) -> torch.device:
    """The device of the graph's first tensor (the CPU when there is none)."""
    for n in graph.nodes:
        if isinstance(n.meta, TensorMeta):
            return n.meta.device
    return torch.device("cpu")


def kernel_device(st: PlanState, n: Node) -> str:
    """The device type whose kernels may run ``n`` (``options.device_type`` renames the
    CPU, so that tests can exercise placement with a device backed by CPU tensors)."""
    t = device_of(n).type
    if t == "cpu" and st.options.device_type and not n.annotations.get("placed"):
        return st.options.device_type
    return t


def keys_of(n: Node) -> list:
    """The storage keys ``(node id, output index or None)`` of ``n``'s tensor results."""
    m = n.meta
    if isinstance(m, tuple):
        return [(n.id, i) for i, x in enumerate(m) if isinstance(x, TensorMeta)]
    return [(n.id, None)] if isinstance(m, TensorMeta) else []


def read_indices(graph: Graph) -> dict:
    """``{multi-output node: indices some getitem reads}``."""
    read: dict[Node, set] = {}
    for n in graph.nodes:
        if n.op == "getitem":
            read.setdefault(n.srcs[0], set()).add(n.params["index"])
    return read


def compute_nodes(st: PlanState):
    """The nodes that are steps: not inputs, constants, getitems or plan-time scalars."""
    for n in st.graph.nodes:
        if n.is_input or n.op in ("constant", "getitem") or n.op in SYM_OPS:
            continue
        if n.is_scalar and n in st.scalars:
            continue
        yield n


def meta_result_matches(st: PlanState, n: Node) -> bool:
    """Run on meta tensors laid out as its inputs are *in this plan*, ``n``'s op returns the
    layout the plan's metadata says.  (A rewrite upstream may have changed an input's
    strides, and the result's strides can follow them, as attention's do; then the result is
    copied into planned storage of the recorded layout instead.)"""
    def val(v: Any) -> Any:
        if isinstance(v, Node):
            if v in st.scalars:
                return st.scalars[v]
            if not isinstance(v.meta, TensorMeta):
                raise LookupError(f"%{v.id} has no concrete metadata")
            return meta_tensor(v.meta)
        return _META if isinstance(v, torch.device) else v

    try:
        a, kw = call_args(n, val, val)
        out = fake_layout_call(n, a, kw) if n.op in FAKE_LAYOUT_OPS else n.target(*a, **kw)
    except Exception:  # no meta kernel (or a data-dependent input): keep the copy
        return False
    want = n.meta
    pairs = zip(out, want) if isinstance(want, tuple) and isinstance(out, (tuple, list)) \
        else [(out, want)]
    for t, m in pairs:
        if not isinstance(m, TensorMeta):
            continue
        if not layout_matches(t, m):
            return False
    return True


def layout_matches(t: Any, m: TensorMeta) -> bool:
    """``t`` is a tensor of ``m``'s shape and strides (those of dimensions of one element
    aside)."""
    return isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(m.shape) and all(
        size <= 1 or got == expected for size, got, expected in zip(m.shape, t.stride(), m.stride))


def writes_strided(st: PlanState, n: Node) -> bool:
    """``n``'s step writes correctly into an output of any strides: a native op through its
    ``.out`` overload, an extension kernel or fusion rule declaring ``strided_out = True``."""
    k = st.kernels.get(n)
    if k is None or n in st.bound or n in st.cached or isinstance(n.meta, tuple):
        return False
    if k is registry.NATIVE:
        return n.op != COPY_DEVICE_OP and isinstance(n.target, torch._ops.OpOverload) and (
            n.op == "aten._to_copy.default" or out_overload(n.target) is not None)
    return bool(getattr(k, "strided_out", False))


def _set_meta(n: Node, meta: TensorMeta) -> None:
    n.meta = meta


# -- the passes ------------------------------------------------------------------------------

def rewrite(st: PlanState) -> None:
    """Idiom rewrites (``fxbackend.rewrite``): custom ops for diffusion idioms, layouts."""
    ctx = RewriteContext(st.options)
    st.rewrites = apply_rewrites(st.graph, ctx)
    st.rewrites_declined = ctx.declined
    for rule_name, count in st.rewrites.items():
        stats.bump("rewrite:" + rule_name, count)


def cpu_profile(st: PlanState) -> None:
    """The CPU profile and its decisions, for the report of a plan with CPU tensors."""
    st.cpu_report = cpu_report_lines(st.graph)


def fold(st: PlanState) -> None:
    """Steps that read no input, computed here once (``fold.fold_constants``)."""
    st.folded = fold_constants(st.graph)


def elide_cats(st: PlanState) -> None:
    """Cats of slices that only re-assembled one tensor: their readers read it instead."""
    st.identity_cats = elide_identity_cats(st.graph, lambda n: n.meta)


def elide_clones(st: PlanState) -> None:
    """Clones of values that already had the clone's layout (their readers read the value),
    or of elementwise results that now write the clone's layout themselves."""
    st.identity_clones = elide_identity_clones(st.graph, lambda n: n.meta, _set_meta)


def drop_dead(st: PlanState) -> None:
    """Dead nodes left by the rewrites, folds and elisions (``pipeline``'s pass)."""
    from .pipeline import eliminate_dead_nodes
    eliminate_dead_nodes(st.graph, st.options)


def fuse(st: PlanState) -> None:
    """Fusion rules: runs of pure nodes replaced by fused kernels (``fusion.apply_fusions``)."""
    if st.options.eval_callback is not None:
        st.fusion_report.disabled = "a per-node evaluation callback is set"
        return
    if not st.options.fusion:
        st.fusion_report.disabled = "fusion is off (FXB_DISABLE_FUSION or options)"
        return
    apply_fusions(st.graph, lambda n: device_of(n).type, st.fusion_report)
    for rule_name, _ in st.fusion_report.fired:
        stats.bump("fusion:" + rule_name)


def select_kernels(st: PlanState) -> None:
    """A kernel per step (``registry.select_kernel``), and steps with no kernel on the plan's
    device placed on the CPU (copies in and out)."""
    kernels: dict = {}
    placed: list[Node] = []
    for n in compute_nodes(st):
        if n.op.startswith("fused."):
            kernels[n] = n.annotations["rule"]
        elif n.view_of is not None or n.inplace_of is not None:
            kernels[n] = registry.NATIVE  # views and in-place writes are never intercepted
        elif st.options.force_native and registry.NATIVE.supports(n):
            kernels[n] = registry.NATIVE
        else:
            dev = kernel_device(st, n)
            try:
                kernels[n] = registry.select_kernel(dev, n)
            except NotImplementedError:
                if dev == "cpu":
                    raise
                # no kernel on the plan's device: run the node on the CPU
                kernels[n] = registry.select_kernel("cpu", n)
                placed.append(n)
    for n in placed:
        _place_on_cpu(st.graph, n, kernels)
    st.kernels = kernels


def _place_on_cpu(g: Graph, n: Node, kernels: dict) -> None:
    """Run ``n`` on the CPU: copy its tensor inputs there and its result back, as nodes of
    their own (planned like any other, counted in ``stats()["copies"]``)."""
    cpu = torch.device("cpu")
    home = n.meta.device
    n.annotations["placed"] = "cpu"
    new_srcs = []
    for s in n.srcs:
        m = s.meta
        c = g.new_node(COPY_DEVICE_OP, [s], {"device": "cpu"},
                       TensorMeta(m.shape, contiguous_strides(m.shape), m.dtype, cpu))
        g.insert(g.nodes.index(n), c)
        kernels[c] = registry.NATIVE
        new_srcs.append(c)
    n.srcs = new_srcs
    m = n.meta
    n.meta = dataclasses.replace(m, device=cpu)
    back = g.new_node(COPY_DEVICE_OP, [n], {"device": str(home)},
                      dataclasses.replace(m, device=home), is_output=n.is_output)
    n.is_output = False
    g.insert(g.nodes.index(n) + 1, back)
    kernels[back] = registry.NATIVE
    replace_uses_from(g, n, back, g.nodes.index(back) + 1)


def classify_steps(st: PlanState) -> None:
    """Which native steps return their own result (``bound``), which are computed from
    weights alone and kept between calls (``cached``), and which results need no storage
    (``unread``)."""
    st.bound = _bound_results(st)
    st.cached, st.recomputed = _weight_derived(st)
    st.bound -= set(st.cached)
    st.unread = _unread_outputs(st) | {k for n in (*st.bound, *st.cached) for k in keys_of(n)}


def _unread_outputs(st: PlanState) -> set:
    """Outputs of multi-output native ops without an ``.out`` overload that nobody reads:
    they are computed anyway, but need no storage and no copy."""
    read = read_indices(st.graph)
    keys = set()
    for n, k in st.kernels.items():
        if k is registry.NATIVE and isinstance(n.meta, tuple) and n.view_of is None \
                and not (isinstance(n.target, torch._ops.OpOverload) and out_overload(n.target)):
            keys.update((n.id, i) for i in range(len(n.meta)) if i not in read.get(n, ()))
    return keys


def _bound_results(st: PlanState) -> set:
    """Native compute steps whose op has no ``.out`` overload (attention, ``arange``, ...) or
    only the generated one that computes and then copies (``convolution``,
    ``native_layer_norm``: ``native.out_is_copy``; not ops with a ``FAST_OUT`` binding, e.g.
    relu's ``clamp_min(out=)``).  Their result is used as it comes back, allocated by the op
    per call: copying it into the arena would add a pass and save no memory (the op
    allocates it either way).  The step function drops it after its last read.

    Extension kernels with the ``compute`` capability (``fxbackend.registry``: a library call
    that allocates its result, e.g. oneDNN's float32 linear) are bound the same way: a single
    tensor result, not a view or an in-place write; their result needs no storage and no copy
    into it."""
    bound = set()
    for n, k in st.kernels.items():
        if k is not registry.NATIVE and callable(getattr(k, "compute", None)) \
                and n.view_of is None and n.inplace_of is None and not n.is_scalar \
                and isinstance(n.meta, TensorMeta):
            bound.add(n)
            continue
        if k is registry.NATIVE and n.view_of is None and n.inplace_of is None \
                and isinstance(n.target, torch._ops.OpOverload) and not n.is_scalar \
                and n.meta is not None and n.op not in (*COPY_OPS, COPY_DEVICE_OP) \
                and (not out_overload(n.target) or n.op not in FAST_OUT
                     and out_is_copy(n.target, device_of(n).type)) \
                and meta_result_matches(st, n):
            bound.add(n)
    return bound


def _weight_derived(st: PlanState) -> tuple[dict, dict]:
    """Native steps whose value depends on weights alone (weight inputs, constants and
    plan-time numbers, through views and other such steps): ``{step: [weight inputs]}``.

    Such a step (a weight's channels-last copy for a convolution, a weight cast to another
    dtype) is computed on the first call and again only when one of its weights changes (the
    model-wide cells of ``fxbackend.weights``, checked by fingerprint every call; see
    ARCHITECTURE.md, Plans).  Left per call: seeded-random ops, in-place and multi-output
    steps, results that are returned or written in place, steps whose op does not return the
    planned layout, every step under ``cuda_graphs`` (a replay could not skip or redo it),
    and copy-like steps cheaper to redo than to check (:func:`_cheaper_to_redo`; returned as
    the second dict, ``{step: bytes of its weights}``)."""
    if st.options.cuda_graphs:
        return {}, {}
    g = st.graph
    written = {storage_root(n) for n in g.nodes if n.inplace_of is not None}
    returned = {storage_root(o) for o in g.outputs if isinstance(o, Node)}
    roots: dict[Node, frozenset] = {}
    cached: dict[Node, list] = {}
    redo: dict[Node, int] = {}
    for n in g.nodes:
        if n.is_input:
            if n.is_weight and n not in st.scalars and n not in written:
                roots[n] = frozenset([n])
            elif n in st.scalars:
                roots[n] = frozenset()
            continue
        if n.op == "constant" or n.op in SYM_OPS or (n.is_scalar and n in st.scalars):
            roots[n] = frozenset()
            continue
        deps = node_deps(n)
        if not all(d in roots for d in deps) or st.kernels.get(n) is not registry.NATIVE \
                or n.inplace_of is not None or not isinstance(n.target, torch._ops.OpOverload) \
                or torch.Tag.nondeterministic_seeded in n.target.tags:
            continue
        mine = frozenset().union(*(roots[d] for d in deps))
        if n.view_of is not None:
            roots[n] = mine
            continue
        m = n.meta
        if not mine or not isinstance(m, TensorMeta) or m.is_symbolic or \
                storage_root(n) in returned or storage_root(n) in written or \
                not meta_result_matches(st, n):
            continue
        weight_bytes = sum(w.meta.span_bytes for w in mine)
        if _cheaper_to_redo(n, weight_bytes):
            redo[n] = weight_bytes
            continue
        roots[n] = mine
        cached[n] = sorted(mine, key=lambda w: g.inputs.index(w))
    return cached, redo


#: ops whose work is one pass over their result (copies, casts, concatenations, pads)
_COPY_LIKE = frozenset({"aten.clone.default", "aten._to_copy.default", "aten.copy.default",
                        "aten.cat.default", "aten.stack.default", "aten.constant_pad_nd.default",
                        "aten.repeat.default", "aten.index_select.default",
                        "aten.flip.default", "aten.roll.default"})


def _cheaper_to_redo(n: Node, weight_bytes: int) -> bool:
    """A copy-like or pointwise step that reads a small part of its weights: redoing it
    costs about twice its result's bytes (a read and a write), keeping it costs a fingerprint
    of every byte of its weights every call.  SD3's crop of its positional embedding (2 MB of
    an 18.9 MB buffer) is one; a weight's cast or channels-last copy (result as large as the
    weight, or larger) is kept."""
    return (n.op in _COPY_LIKE or torch.Tag.pointwise in n.target.tags) and \
        weight_bytes > 2 * n.meta.span_bytes


def concat_in_place(st: PlanState) -> None:
    """Parts of concatenations that their producers write in place (``fxbackend.concat``),
    and the layouts that gives them (before kernels compile: they see the layout)."""
    st.concat = plan_concat(st.graph, lambda n: n.meta,
                            lambda n: st.kernels.get(n) is registry.NATIVE,
                            st.unread.__contains__, lambda n: writes_strided(st, n))
    for n, m in st.concat.relayout.items():
        n.meta = m


def compile_kernels(st: PlanState) -> None:
    """The ``compile`` capability: ahead-of-time work per node, at plan time, in parallel
    across nodes (ops and kernels sharing state must make it thread-safe)."""
    from .ops import get_op
    jobs = []
    for n, k in st.kernels.items():
        for owner in (get_op(n.op), k if k is not registry.NATIVE else None):
            fn = getattr(owner, "compile", None)
            if callable(fn):
                jobs.append((fn, n))
    # every owner's first node first: the nodes of one kernel mostly compile the same thing
    # (done once), so the threads start on distinct kernels, which compile side by side
    # (numba's cold kernels in worker processes: cpu_kernels/_workers.py)
    rank: Counter = Counter()
    order = []
    for i, (fn, n) in enumerate(jobs):
        owner = getattr(fn, "__func__", fn)
        order.append((rank[owner], i))
        rank[owner] += 1
    jobs = [jobs[i] for _, i in sorted(order)]
    run_on_passing_threads([lambda fn=fn, n=n: fn(n) for fn, n in jobs])


def run_on_passing_threads(jobs: list[Callable[[], Any]]) -> None:
    """Run the ``jobs`` on up to ``torch.get_num_threads()`` threads that exit when they are
    done; the first error propagates once all have stopped (later jobs are not started).

    Not on a kept pool: a compile job may run a kernel (numba compiles by calling it), and an
    OpenMP runtime keeps a team of workers for every thread that ever ran a parallel region.
    With more workers than cores, libgomp stops spinning between regions, and every later
    parallel launch of the process (our kernels and torch's alike) waits for its workers to
    wake: a step of a few microseconds took 0.1-0.3 ms.  A thread that exits takes its teams
    with it."""
    if len(jobs) <= 1:
        for job in jobs:
            job()
        return
    width = min(len(jobs), max(1, torch.get_num_threads()))
    with concurrent.futures.ThreadPoolExecutor(width, thread_name_prefix="fxbackend-compile") \
            as pool:  # leaving the block joins the threads
        futures = [pool.submit(job) for job in jobs]
        concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
        for f in futures:
            f.cancel()  # the jobs not started yet, once one failed
    for f in futures:
        if not f.cancelled() and f.exception() is not None:
            raise f.exception()


def prepare(st: PlanState) -> None:
    """``prepare(node) -> (state, workspace_bytes)`` of every extension step, before any
    storage exists (metadata only).  The workspace is the largest request, not the sum."""
    from .ops import get_op
    for n, k in st.kernels.items():
        owner = get_op(n.op) if k is registry.NATIVE and n.target is None else k
        if owner is registry.NATIVE or owner is None:
            continue
        fn = getattr(owner, "prepare", None)
        state, ws = fn(n) if fn is not None else (None, 0)
        if not isinstance(ws, int) or ws < 0:
            raise ValueError(f"{getattr(owner, 'name', owner)}.prepare(%{n.id}) returned "
                             f"workspace_bytes={ws!r}; expected an int >= 0")
        st.states.append((owner, state))
        st.workspace_bytes = max(st.workspace_bytes, ws)
        st.ws_by_node[n] = ws
        st.prepared[n] = state


def regions(st: PlanState) -> None:
    """The fork/join regions the plan runs concurrently (``fxbackend.streams``), or why
    none."""
    st.regions, st.regions_off = _find_regions(st)


def _find_regions(st: PlanState) -> tuple[list, str | None]:
    want = st.options.streams
    if want is False:
        return [], "off (options streams=False or FXB_STREAMS=0)"
    if st.options.eval_callback is not None:
        return [], "off: a per-node evaluation callback is set"
    if st.options.profile:
        return [], "off: profiling times one step at a time"
    if any(n.annotations.get("placed") for n in st.graph.nodes):
        return [], "off: steps placed on another device"
    dev = plan_device(st.graph)
    if want is None and dev.type != "cuda":
        # the default gate (streams.worth_it) never overlaps off CUDA: every CPU plan would
        # pay the region scan for nothing
        return [], "no region worth overlapping (options streams=True forces them)"
    metas = lambda n: n.meta  # noqa: E731
    found = find_regions(st.graph, st.kernels, metas)
    if want is None:
        found = [r for r in found if worth_it(r, metas, dev)]
    if not found:
        return [], ("no fork/join region with independent branches" if want
                    else "no region worth overlapping (options streams=True forces them)")
    if dev.type == "cpu":
        from .services import concurrency_blocker
        why = concurrency_blocker()
        if why is not None:
            return [], f"off: {why}"
    elif dev.type == "cuda":
        st.aux_stream = torch.cuda.Stream(dev)
    aux = {n for r in found for n in r.aux}
    st.aux_workspace_bytes = max([st.ws_by_node.get(n, 0) for n in aux] + [0])
    return found, None


def memory(st: PlanState) -> None:
    """Offsets of every intermediate in one arena per device (``memory.plan_memory``)."""
    st.memory = plan_memory(st.graph, metas=lambda n: n.meta, skip_key=st.unread.__contains__,
                            regions=region_lifetimes(st.regions), aliases=st.concat.aliases)


def _changed_graph(st: PlanState) -> bool:
    return bool(st.rewrites or st.folded or st.identity_cats or st.identity_clones)


#: the plan-time pipeline, in order
PLAN_PASSES: list[PlanPass] = [
    PlanPass("rewrite", rewrite, ("graph", "options"), ("graph", "rewrites",
                                                         "rewrites_declined")),
    PlanPass("cpu_profile", cpu_profile, ("graph",), ("cpu_report",)),
    PlanPass("fold_constants", fold, ("graph",), ("graph", "folded")),
    PlanPass("elide_identity_cats", elide_cats, ("graph",), ("graph", "identity_cats"),
             when=lambda st: st.options.concat_in_place),
    PlanPass("elide_identity_clones", elide_clones, ("graph",), ("graph", "identity_clones"),
             when=lambda st: st.options.concat_in_place),
    PlanPass("eliminate_dead_nodes", drop_dead, ("graph",), ("graph",), when=_changed_graph),
    PlanPass("fuse", fuse, ("graph", "options"), ("graph", "fusion_report")),
    PlanPass("select_kernels", select_kernels, ("graph", "options"), ("graph", "kernels")),
    PlanPass("classify_steps", classify_steps, ("graph", "kernels", "scalars", "options"),
             ("bound", "cached", "recomputed", "unread")),
    PlanPass("concat_in_place", concat_in_place,
             ("graph", "kernels", "unread", "bound", "cached"), ("graph", "concat"),
             when=lambda st: st.options.concat_in_place),
    PlanPass("compile_kernels", compile_kernels, ("kernels",), ()),
    PlanPass("prepare", prepare, ("kernels",),
             ("prepared", "states", "workspace_bytes", "ws_by_node")),
    PlanPass("find_regions", regions, ("graph", "kernels", "options", "ws_by_node"),
             ("regions", "regions_off", "aux_workspace_bytes", "aux_stream")),
    PlanPass("plan_memory", memory, ("graph", "unread", "regions", "concat"), ("memory",)),
]


def describe_passes(passes: list[PlanPass] | None = None) -> str:
    """One line per pass, in order: its name, what it reads and writes."""
    return "\n".join(f"{i + 1:2d}. {p!r}" for i, p in enumerate(passes or PLAN_PASSES))


def run_plan_passes(st: PlanState, passes: list[PlanPass] | None = None) -> PlanState:
    """Run ``passes`` (default :data:`PLAN_PASSES`) in order over ``st``: each timed into
    ``st.timings``, skipped where its ``when`` is False, and with ``options.dump`` the node
    list printed after it."""
    for p in passes if passes is not None else PLAN_PASSES:
        if p.when is not None and not p.when(st):
            continue
        t0 = time.perf_counter()
        p.run(st)
        st.timings[p.name] = time.perf_counter() - t0
        if st.options.dump:
            extra = f"\n{st.fusion_report.format()}" if p.name == "fuse" else ""
            print(f"[fxbackend] {st.name} after {p.name}:\n{st.graph.format()}{extra}",
                  file=sys.stderr)
    return st
