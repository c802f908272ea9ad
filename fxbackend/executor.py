"""Plans and their execution.

A :class:`CompiledGraph` is a lowered graph plus one :class:`Plan` per input-shape signature
(a symbolic graph re-plans for new shapes without re-lowering).  A :class:`Plan` is concrete:
every node has a kernel, every intermediate an offset in one preallocated arena per device, and
the steps are generated as one straight-line Python function so that a call costs little more
than the kernel launches themselves.

Building a plan: the concrete copy of the graph (``concrete.instantiate``), the plan-time
passes over its :class:`~fxbackend.planning.PlanState` (``planning.PLAN_PASSES``), the arenas,
the step function's source (``codegen.generate``), its compilation and, with ``cuda_graphs``,
the CUDA graph.  What is left here is the runtime: calling, cancelling, profiling and CUDA
graph replay; the reports are ``fxbackend.report``'s.

Per call a plan allocates only the tensors it returns (the caller keeps them) and, for ops
without an ``.out`` overload, the temporary it copies from (a counted copy).  Inputs are never
copied.
"""
from __future__ import annotations

import sys
import weakref
from collections import Counter
from typing import Any, Sequence

import torch

from . import registry, stats, weights  # noqa: F401  (weights: patched by bench_weights)
from .codegen import ExecContext, generate
from .concrete import concretize, describe_input, instantiate
from .cudagraphs import GraphRunner, capture_blocker
from .inputs import check_inputs
from .ir import Graph, Node, TensorMeta
from .options import Options
from .planning import FAST_OUT as _FAST_OUT  # noqa: F401  (tests check every entry)
from .planning import PlanState, plan_device, run_plan_passes
from .services import CancelToken, running

__all__ = ["CompiledGraph", "Plan", "ExecContext", "concretize", "instantiate"]


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




class _Metas:
    """``plan.metas[node]``: the node's metadata (``node.meta``, the one truth), read-only."""

    __slots__ = ()

    def __getitem__(self, n: Node) -> Any:
        return n.meta

    def get(self, n: Node, default: Any = None) -> Any:
        return n.meta if n.meta is not None else default

    def __contains__(self, n: Node) -> bool:
        return n.meta is not None


class Plan:
    """A graph made concrete for one input signature: kernels, arena offsets, generated steps.

    Call it with the graph's inputs (``plan(*inputs)``); it validates them and returns the list
    of outputs.  :meth:`run` skips the validation (the Dynamo path, behind Dynamo's guards).
    ``plan.state`` is the :class:`~fxbackend.planning.PlanState` its passes built.
    """

    metas = _Metas()

    def __init__(self, graph: Graph, options: Options, metas: dict, scalars: dict,
                 name: str = "graph") -> None:
        self.source_graph = graph
        self.options = options
        g, _, scalars = instantiate(graph, metas, scalars)
        self.name = name
        self.generation = registry.generation()
        self.cancel_token = CancelToken()
        self.state = st = PlanState(g, options, scalars, name)
        #: the model-wide cells (fxbackend.weights) of the cached steps this plan used
        self._held: dict = {}
        # released by a finalizer, not __del__: weakref.finalize runs at the latest at
        # interpreter exit, before module globals are torn down (no noise at shutdown)
        self._release = {"stats_key": None, "states": st.states}
        weakref.finalize(self, _release_plan, self._release)
        #: options.profile: seconds spent in each step (by node index), over profiled_calls
        self.step_seconds: list[float] = []
        self.profiled_calls = 0
        #: the inputs' names in error messages (made on the first checked call)
        self._labels: list[str] | None = None
        run_plan_passes(st)
        self.arenas = {dev: torch.empty(nbytes, dtype=torch.uint8, device=dev)
                       for dev, nbytes in st.memory.arena_bytes.items()}
        self.step_seconds.extend([0.0] * len(g.nodes))
        self._compile_steps()
        #: the CUDA graph of this plan (options cuda_graphs), and why there is none
        self._graph_runner: GraphRunner | None = None
        self.cuda_graph_off = self._cuda_graph()
        self._count()

    def _compile_steps(self) -> None:
        """Generate the step function's source (``codegen.generate``) and compile it."""
        st = self.state
        dev = next(iter(self.arenas), None) or plan_device(st.graph)
        # one workspace tensor per plan (empty when no step asks for scratch)
        self.workspace = torch.empty(st.workspace_bytes, dtype=torch.uint8, device=dev)
        workspaces = {"_ws": self.workspace}
        if st.regions:
            self.aux_workspace = workspaces["_ws_aux"] = torch.empty(
                st.aux_workspace_bytes, dtype=torch.uint8, device=dev)
        gen = generate(st, self.arenas, workspaces, self._held, self.step_seconds,
                       self.cancel_token)
        self.source, self._lines, self._ns = gen.source, gen.lines, gen.ns
        self.step_counts: Counter = gen.step_counts
        self.copies = gen.copies
        self._cache_nodes = gen.cache_nodes
        code = compile(self.source, f"<fxbackend plan {self.name}>", "exec")
        scope: dict[str, Any] = {}
        exec(code, scope)
        self._run = scope["_make"](*[gen.ns[k] for k in gen.names])

    def _cuda_graph(self) -> str | None:
        """Capture set-up for ``options.cuda_graphs``: the runner, or why there is none."""
        st, options = self.state, self.options
        if not options.cuda_graphs:
            return None
        if options.profile:
            return "profiling times each step on the host"
        why = capture_blocker(st.graph.nodes, st.kernels,
                              lambda n: n.is_scalar and n not in st.scalars,
                              plan_device(st.graph).type, options.eval_callback is not None)
        if why is None:
            self._graph_runner = GraphRunner(
                self._run, [n.is_weight for n in st.graph.inputs], plan_device(st.graph))
        return why

    def _count(self) -> None:
        st = self.state
        self._stats_key = stats.register_plan_counts({"steps": self.step_counts,
                                                      "copies": self.copies})
        self._release["stats_key"] = self._stats_key
        stats.bump("plans_built")
        stats.bump("arena_bytes", st.memory.total_arena)
        stats.bump("intermediate_bytes", st.memory.sum_intermediates)
        stats.bump("workspace_bytes", st.workspace_bytes)
        stats.bump("concurrent_regions", len(st.regions))
        stats.bump("concat_parts_in_place", st.concat.parts_in_place)
        stats.bump("identity_cats", st.identity_cats)
        stats.bump("identity_clones", st.identity_clones)
        stats.bump("constants_folded", st.folded)
        stats.bump("weight_steps_cached", len(st.cached))
        if self.options.dump:
            print(f"[fxbackend] {self.name}: {st.memory.summary()}, "
                  f"workspace {st.workspace_bytes / 2**20:.2f} MB", file=sys.stderr)

    # -- what the passes built ------------------------------------------------------------
    graph = property(lambda self: self.state.graph)
    scalars = property(lambda self: self.state.scalars)
    kernels = property(lambda self: self.state.kernels)
    cached = property(lambda self: self.state.cached)
    memory = property(lambda self: self.state.memory)
    regions = property(lambda self: self.state.regions)
    regions_off = property(lambda self: self.state.regions_off)
    concat = property(lambda self: self.state.concat)
    fusion_report = property(lambda self: self.state.fusion_report)
    workspace_bytes = property(lambda self: self.state.workspace_bytes)
    aux_workspace_bytes = property(lambda self: self.state.aux_workspace_bytes)
    rewrites = property(lambda self: self.state.rewrites)
    rewrites_declined = property(lambda self: self.state.rewrites_declined)
    folded = property(lambda self: self.state.folded)
    identity_cats = property(lambda self: self.state.identity_cats)
    identity_clones = property(lambda self: self.state.identity_clones)
    cpu_report = property(lambda self: self.state.cpu_report)
    timings = property(lambda self: self.state.timings)

    def _plan_device(self) -> torch.device:
        return plan_device(self.state.graph)

    # -- running --------------------------------------------------------------------------
    def run(self, args: list) -> list:
        """Execute without validating inputs; returns the list of outputs."""
        stats.record_plan_call(self._stats_key)
        if self.options.profile:
            self.profiled_calls += 1
        run = self._graph_runner or self._run
        if not self.state.prepared:
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
        """The node list with the kernel chosen for each step, then what the passes did
        (``fxbackend.report.plan_report``)."""
        from .report import plan_report
        return plan_report(self)

    def profile_report(self, top: int = 20) -> str:
        """With ``options={"profile": True}``: where the time of this plan's calls went, per
        kernel, per (kernel, op) and for the ``top`` most expensive steps
        (``fxbackend.report.profile_report``)."""
        from .report import profile_report
        return profile_report(self, top)

    def reset_profile(self) -> None:
        """Forget the profiled calls so far (``options.profile``): a report after warm-up
        calls then leaves out the first call's one-time work."""
        self.step_seconds[:] = [0.0] * len(self.step_seconds)  # in place: the steps hold it
        self.profiled_calls = 0

    def __call__(self, *args: Any) -> list:
        """Validate ``args`` against this plan's signature, then execute: the count, then
        ``inputs.check_inputs`` (the validator of ``concretize`` and of replayed plans) with
        strides checked and the plan-time numbers fixed; a ValueError names the input."""
        inputs = self.graph.inputs
        if len(args) != len(inputs):
            raise ValueError(f"plan {self.name} expects {len(inputs)} inputs, got {len(args)}")
        if self._labels is None:
            self._labels = [describe_input(self.graph, i, n) for i, n in enumerate(inputs)]
        check_inputs(inputs, args, self._labels, strides="check", fixed=self.scalars)
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

    def all_plans(self) -> list[Plan]:
        """Every plan built so far: the static graph's one, or one per signature seen."""
        return ([self._static] if self._static is not None else []) + list(self.plans.values())

    def profile_report(self, top: int = 20) -> str:
        """:meth:`Plan.profile_report` of every plan this graph built (``options.profile``)."""
        plans = self.all_plans()
        if not plans:
            return f"{self.name}: no plan built yet"
        return "\n\n".join(p.profile_report(top) for p in plans)

    def reset_profile(self) -> None:
        """:meth:`Plan.reset_profile` of every plan this graph built."""
        for p in self.all_plans():
            p.reset_profile()
