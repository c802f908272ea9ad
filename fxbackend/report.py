"""The text reports of a plan: what it runs (``Plan.report``, what ``fxbackend.explain``
prints) and where its time went (``Plan.profile_report``)."""
from __future__ import annotations

from collections import Counter
from typing import Any

from . import registry
from .ir import format_node
from .planning import kernel_device

__all__ = ["plan_report", "profile_report", "pass_timings"]


def pass_timings(st: Any) -> str:
    """One line: the milliseconds of each plan-time pass that ran, in order, and in all."""
    total = sum(st.timings.values())
    parts = ", ".join(f"{name} {sec * 1e3:.1f}" for name, sec in st.timings.items())
    return f"plan-time passes ({total * 1e3:.1f} ms): {parts}"


def plan_report(plan: Any) -> str:
    """The node list with the kernel chosen for each step, then what the passes did: the
    CPU profile, concurrent regions, concatenations, folds, weight-derived steps, elided
    copies, the CUDA graph, declined kernels and rewrites, the fusion report (the time of
    each plan-time pass is :func:`pass_timings`', which ``explain`` adds)."""
    st = plan.state
    lines = [f"plan {plan.name}: {st.memory.summary()}, workspace "
             f"{st.workspace_bytes / 2**20:.2f} MB ({st.workspace_bytes} bytes)"]
    lines += st.cpu_report
    for n in st.graph.nodes:
        k = st.kernels.get(n)
        lines.append(format_node(n) + (f"  [{k.name}]" if k is not None else ""))
    if st.regions:
        for r in st.regions:
            lines.append("concurrent " + r.describe() + ": auxiliary " +
                         ", ".join(f"%{n.id}" for n in r.aux if n in st.kernels))
    elif st.options.streams:  # asked for and none: say why
        lines.append(f"concurrent regions: {st.regions_off}")
    for cat, parts in st.concat.placed.items():
        left = st.concat.copies_left(cat, lambda x: x.meta)
        lines.append(f"concatenation %{cat.id}: " + ", ".join(
            f"%{cat.srcs[j].id}" for j in sorted(parts)) + " written in place" +
            (f"; copies %{', %'.join(str(cat.srcs[j].id) for j in left)}" if left
             else "; no copy"))
    if st.folded:
        lines.append(f"constant steps folded at plan time: {st.folded}")
    if st.cached:
        nbytes = sum(n.meta.span_bytes for n in st.cached)
        lines.append(f"steps computed from weights alone, kept between calls: "
                     f"{len(st.cached)} ({nbytes / 2**20:.2f} MB, held once per model, "
                     f"checked by the weights' fingerprints every call): " +
                     ", ".join(f"%{n.id}" for n in st.cached))
    if st.recomputed:
        lines.append("steps computed from weights alone, redone every call (cheaper than "
                     "checking their weights): " + ", ".join(
                         f"%{n.id} ({n.meta.span_bytes / 2**20:.2f} MB of "
                         f"{b / 2**20:.2f} MB)" for n, b in st.recomputed.items()))
    if st.identity_cats or st.identity_clones:
        lines.append(f"copies elided (readers read the source): {st.identity_cats} "
                     f"concatenation(s) of slices, {st.identity_clones} clone(s)")
    if st.options.cuda_graphs:
        lines.append("cuda graph: " + (
            f"captured {plan._graph_runner.captures} time(s)" if plan._graph_runner
            else f"off: {plan.cuda_graph_off}"))
    lines += _declined(st)
    lines.append(st.fusion_report.format())
    return "\n".join(lines)


def _declined(st: Any) -> list[str]:
    lines = []
    for n, k in st.kernels.items():  # extension kernels that did not take a node
        if n.view_of is not None or n.inplace_of is not None or \
                not registry.kernels_for(kernel_device(st, n), n.op):
            continue
        for name, why in registry.declined_kernels(kernel_device(st, n), n, k):
            lines.append(f"kernel {name} declined %{n.id}: {why}")
    for rule, ids, why in st.rewrites_declined:
        lines.append(f"rewrite {rule} declined on " + ", ".join(f"%{i}" for i in ids) +
                     f": {why}")
    return lines


def profile_report(plan: Any, top: int = 20) -> str:
    """With ``options={"profile": True}``: where the time of the plan's calls went, per
    kernel, per (kernel, op) and for the ``top`` most expensive steps (milliseconds per call;
    wall clock around each step, synchronised on CUDA)."""
    st = plan.state
    if not st.options.profile:
        return f"plan {plan.name}: not profiled (options profile=True or FXB_PROFILE=1)"
    calls = max(plan.profiled_calls, 1)
    steps = [(sec, n) for sec, n in zip(plan.step_seconds, st.graph.nodes)
             if n in st.kernels and sec > 0]
    total = sum(sec for sec, _ in steps)
    lines = [f"plan {plan.name}: {plan.profiled_calls} profiled call(s), "
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
        by_kernel[st.kernels[n].name] += sec
        by_op[f"{st.kernels[n].name}: {n.op}"] += sec
    table("by kernel:", by_kernel)
    table("by kernel and op:", by_op)
    table(f"top {top} steps:", {format_node(n): sec for sec, n in steps})
    return "\n".join(lines)
