"""fxbackend: a ``torch.compile`` backend for diffusion-model inference.

``torch.compile(model, backend="fxbackend", options={...})`` lowers each graph Dynamo captures
to a flat node list, plans its intermediates into one arena and runs every step through the
kernel registry.  See ARCHITECTURE.md.
"""
from __future__ import annotations

from .dynamo import compile_fx_graph, fxbackend_backend
from .executor import CompiledGraph, Plan
from .ir import Graph, Node, ScalarMeta, TensorMeta
from .options import Options, parse_options
from .registry import register_kernel, select_kernel, unregister_kernel
from .stats import reset_stats, stats

__all__ = ["fxbackend_backend", "compile_fx_graph", "CompiledGraph", "Plan", "Graph", "Node",
           "TensorMeta", "ScalarMeta", "Options", "parse_options", "register_kernel",
           "unregister_kernel", "select_kernel", "stats", "reset_stats", "backend"]

#: the Dynamo backend callable (also registered by name through the entry point)
backend = fxbackend_backend
__version__ = "0.1.0"
