"""The ``torch.compile`` entry point: ``torch.compile(model, backend="fxbackend")``.

Dynamo's graph is normalised with aot_autograd (inference, functionalised, boxed calling
convention) and each resulting ATen graph is lowered and compiled into a
:class:`~fxbackend.executor.CompiledGraph`.  Graphs that need autograd (training) are not this
backend's job: they run through aot_autograd's default path and ``stats()["fallback_graphs"]``
counts them.
"""
from __future__ import annotations

import itertools
from typing import Any, Sequence

import torch

from . import stats
from .executor import CompiledGraph
from .extensions import load_extensions
from .lower import lower
from .options import Options, parse_options
from .pipeline import run_pipeline

__all__ = ["fxbackend_backend", "compile_fx_graph", "boxed_runner", "explain"]

_graph_ids = itertools.count()
#: callables told about every CompiledGraph made (explain() listens here)
_listeners: list = []


def _needs_autograd(example_inputs: Sequence[Any]) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)


def _is_weight(x: Any) -> bool:
    return isinstance(x, torch.nn.Parameter) or getattr(x, "_dynamo_static_input_type", None) \
        is not None


def compile_fx_graph(aten_gm: torch.fx.GraphModule, options: Options,
                     weight_mask: Sequence[bool] | None = None,
                     input_names: Sequence[str] | None = None) -> CompiledGraph:
    """Lower an ATen FX graph and run the pipeline; returns its :class:`CompiledGraph`."""
    name = f"graph{next(_graph_ids)}"
    graph = lower(aten_gm, weight_mask)
    if input_names is not None and len(input_names) == len(graph.inputs):
        for n, src in zip(graph.inputs, input_names):
            n.annotations["source"] = src
    graph = run_pipeline(graph, options, name)
    stats.bump("graphs_compiled")
    stats.bump("nodes_lowered", sum(1 for n in graph.nodes if not n.is_input))
    compiled = CompiledGraph(graph, options, name)
    for listener in list(_listeners):
        listener(compiled)
    return compiled


def boxed_runner(compiled: CompiledGraph):
    """``compiled`` in aot_autograd's boxed calling convention (takes the argument list and
    clears it, so inputs can be freed early)."""
    run = compiled.run

    def boxed(args: list):
        out = run(args)
        args.clear()
        return out

    boxed._boxed_call = True
    boxed.fxbackend_compiled = compiled
    return boxed


def fxbackend_backend(gm: torch.fx.GraphModule, example_inputs: list, options: dict | None = None,
                      mode: str | None = None, **kwargs: Any):
    """Dynamo backend.  ``options``: see :class:`fxbackend.options.Options`.

    ``mode`` is accepted for ``torch.compile`` compatibility and ignored.
    """
    if kwargs:
        raise ValueError(f"fxbackend got unexpected arguments {sorted(kwargs)}; pass settings "
                         f"as options={{...}}")
    opts = parse_options(options)
    load_extensions()
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch._aot_autograd.utils import make_boxed_func

    if _needs_autograd(example_inputs):
        stats.bump("fallback_graphs")
        from torch._dynamo.backends.debugging import boxed_nop
        return aot_autograd(fw_compiler=boxed_nop)(gm, example_inputs)

    weight_mask = [_is_weight(x) for x in example_inputs]
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]

    def fw_compiler(aten_gm: torch.fx.GraphModule, fake_inputs: list):
        return boxed_runner(compile_fx_graph(aten_gm, opts, weight_mask, names))

    # Ops with side effects (``linalg.inv``'s error check, ...) are ordered by effect tokens.
    # Unlifted, the graph makes and sinks its own tokens: the placeholders stay the model's
    # inputs (the weight mask and names line up) and callers pass no token arguments.
    import torch._functorch.config as functorch_config
    with functorch_config.patch(unlift_effect_tokens=True):
        return aot_module_simplified(gm, example_inputs, fw_compiler=fw_compiler,
                                     keep_inference_input_mutations=True)


def explain(model_or_fn: Any, *args: Any, options: dict | None = None, **kwargs: Any) -> str:
    """Compile ``model_or_fn`` with fxbackend, call it once on ``args``/``kwargs`` (no grad),
    and return (and print) the report of every graph: the node list with the kernel chosen for
    each step, each fusion fired, and each match declined with why.

    Resets Dynamo's caches first, so that every graph is compiled (and reported) afresh.
    """
    torch._dynamo.reset()
    seen: list[CompiledGraph] = []
    _listeners.append(seen.append)
    try:
        compiled = torch.compile(model_or_fn, backend=fxbackend_backend, options=options)
        with torch.no_grad():
            compiled(*args, **kwargs)
    finally:
        _listeners.remove(seen.append)
    parts = []
    for cg in seen:
        plans = cg.all_plans()
        for plan in plans:
            from .report import pass_timings
            parts.append(plan.report() + "\n" + pass_timings(plan.state))
    text = "\n\n".join(parts) if parts else "no graph was compiled"
    print(text)
    return text
