"""fxbackend: a ``torch.compile`` backend for diffusion-model inference.

``torch.compile(model, backend="fxbackend", options={...})`` lowers each graph Dynamo captures
to a flat node list, plans its intermediates into one arena and runs every step through the
kernel registry.  ``fxbackend.export`` / ``save`` / ``load`` save a plan as one file and replay it
without Dynamo or the model's code (docs/FORMAT.md).  See ARCHITECTURE.md.
"""
from __future__ import annotations

from . import services
from ._version import __version__
from .cpu import CpuProfile, cpu_profile
from .dynamo import compile_fx_graph, explain, fxbackend_backend
from .executor import CompiledGraph, ExecContext, Plan
from .extensions import load_extensions
from .fusion import check_claim, graph_delay, register_fusion, unregister_fusion
from .ir import Graph, Node, ScalarMeta, TensorMeta, contiguous_strides
from .ops import get_op, op_create, register_op, unregister_op
from .options import Options, parse_options
from .rewrite import register_rewrite, replace_uses, rewrites, unregister_rewrite
from .registry import (register_kernel, select_kernel, supports_native_op, supports_op,
                       unregister_kernel)
from .replay import ExportedPlan, ReplayError, load, save
from .exporter import export, from_compiled, record_graphs
from .services import warm_up
from .precompile import precompile
from .stats import reset_stats, stats
from .weights import freeze_weights

__all__ = ["fxbackend_backend", "compile_fx_graph", "explain", "CompiledGraph", "Plan",
           "ExecContext", "Graph", "Node", "TensorMeta", "ScalarMeta", "contiguous_strides",
           "Options", "parse_options", "register_op", "unregister_op", "get_op", "op_create",
           "register_kernel", "unregister_kernel", "select_kernel", "supports_op",
           "supports_native_op", "register_fusion", "unregister_fusion", "graph_delay",
           "check_claim",
           "register_rewrite", "unregister_rewrite", "rewrites", "replace_uses", "load_extensions",
           "services", "stats", "reset_stats", "backend", "warm_up", "precompile", "export", "save",
           "load", "from_compiled", "record_graphs", "ExportedPlan", "ReplayError",
           "cpu_profile", "CpuProfile", "freeze_weights"]

#: the Dynamo backend callable (also registered by name through the entry point)
backend = fxbackend_backend

# The project's own patterns and kernels register through the same public API as any
# extension (heavy dependencies such as numba and triton load lazily, when a kernel compiles).
from . import patterns as _patterns  # noqa: E402,F401
from . import cpu_kernels as _cpu_kernels  # noqa: E402,F401
from . import cuda_kernels as _cuda_kernels  # noqa: E402,F401
