"""Code generation: the planned state and its buffers -> the source of a plan's step function.

:func:`generate` takes a :class:`~fxbackend.planning.PlanState` after every plan-time pass, the
arena tensors and the workspaces, and returns a :class:`Generated`: the source of one
straight-line Python function ``run(args)`` and the namespace of its constants.  It changes
nothing of the state; what it counts (steps per kernel, copies) comes back in the result.

Each node is classified once (:meth:`StepWriter.kind`) and written by the small emitter of its
kind (``_emit_<kind>``).  The kinds:

- ``input``, ``constant``, ``scalar``: no step: inputs are unpacked from ``args``;
  constants and plan-time numbers (sizes, arithmetic on them) are constants of the function;
- ``getitem``: an output of a multi-output step: its name (or a constant), else
  ``v = parent[i]`` (a per-call ``split``);
- ``view``: of planned storage, taken once at plan time (a constant); else per call;
- ``fused_copy``: a fused kernel writing a terminal copy's destination;
- ``inplace``: an in-place write (``copy_`` into an input, ...), ``op(dest, ...)``;
- ``bind``: ``v = op(...)``, the op's own result (numbers known per call only, ops without
  metadata, results the caller gets and the op allocates anyway);
- ``cached``: a weight-derived value, recomputed only when a weight key changes;
- ``bound``: a step whose result is used as it comes back (``PlanState.bound``): a native op's,
  or an extension kernel's ``compute`` (the kernel returns a new tensor, no storage planned);
- ``concat``: a concatenation whose parts were written in place (only the rest is copied);
- ``owned``: a step writing storage it owns (planned, or allocated per call when returned):
  the copies of a step placed on the CPU; a kernel's (or a custom op's reference)
  ``execute``; a native op as ``op.out(..., out=<arena view>)``, ``out.copy_(x)`` for
  conversions, or a counted copy of the functional result.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import re
import threading
import time
from collections import Counter
from typing import Any

import torch

from . import registry, weights
from .ir import Node, TensorMeta, storage_root
from .lower import SYM_OPS
from .memory import buffers_of
from .native import call_args, out_overload
from .services import CancelToken, running
from .step_guards import _AddressWatch, _Computed
from .planning import COPY_DEVICE_OP, COPY_OPS, FAST_OUT, PlanState, device_of, keys_of, \
    plan_device, read_indices

__all__ = ["generate", "Generated", "Code", "render", "buffer_view", "derivation", "ExecContext"]

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

_ASSIGNED = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) = ")


class Code:
    """A Python expression in generated code."""

    __slots__ = ("src",)

    def __init__(self, src: str) -> None:
        self.src = src

    def __repr__(self) -> str:
        return self.src


def render(v: Any) -> str:
    """The source of ``v``: a :class:`Code`, a plain value, or a list/tuple/dict of them."""
    if isinstance(v, Code):
        return v.src
    if v is None or (isinstance(v, (bool, int, str)) and not isinstance(v, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(render(x) for x in v) + "]"
    if isinstance(v, tuple):
        return "(" + "".join(render(x) + ", " for x in v) + ")"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k!r}: {render(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot render {v!r}")


def _args_src(a: list, kw: dict) -> str:
    parts = [render(x) if not isinstance(x, Code) else x.src for x in a]
    parts += [f"{k}={render(v)}" for k, v in kw.items()]
    return ", ".join(parts)


def buffer_view(st: PlanState, arenas: dict, by_id: dict, key: tuple) -> torch.Tensor:
    """The arena view of storage key ``(node id, index)``: its planned offset, dtype,
    shape and strides."""
    m = by_id[key[0]].meta
    if key[1] is not None:
        m = m[key[1]]
    off = st.memory.offsets[key]
    arena = arenas[str(m.device)]
    typed = arena[off: off + m.span_bytes + m.storage_offset * m.itemsize].view(m.dtype)
    return typed.as_strided(m.shape, m.stride, typed.storage_offset() + m.storage_offset)


def derivation(st: PlanState, n: Node) -> tuple:
    """A hashable description of how the cached step ``n`` computes its value from its
    weights (``st.cached[n]``, by position): ops, params, constants (by fingerprint) and
    result layouts, down to the weights.  Plans of other input shapes that derive the same
    value from the same weights describe it alike and share one value."""
    index = {w: i for i, w in enumerate(st.cached[n])}

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
        if x in st.scalars:
            return ("number", repr(st.scalars[x]))
        if x.op == "constant":
            return ("constant", freeze(x.annotations["value"]))
        m = x.meta
        layout = (m.dtype, tuple(m.shape), tuple(m.stride), m.storage_offset) \
            if isinstance(m, TensorMeta) else None
        return (x.op, freeze(x.params), tuple(describe(s) for s in x.srcs), layout)

    return describe(n)


def _weight_cell(ws: tuple, what: int, held: dict) -> "weights.DerivedCell":
    """The model-wide cell of a weight-derived step (``fxbackend.weights.cell``), held by
    the plan's ``held`` while the plan lives."""
    return weights.cell(ws, what, held)


@dataclasses.dataclass
class Generated:
    """What :func:`generate` returns: the source of ``_make(<names>)`` (which returns the
    step function), the namespace to call it with, and what the steps count."""
    source: str
    names: list
    ns: dict
    lines: list
    step_counts: Counter
    copies: int
    #: derivation id -> the cached step it describes
    cache_nodes: dict


class StepWriter:
    """Writes the step function of one planned state (module docstring).  ``arenas``: the
    arena tensor of each device; ``held``: the plan's dict of model-wide cells;
    ``step_seconds``: the plan's per-step timings (``options.profile``); ``cancel_token``: the
    plan's (the region threads run under it); ``aux_stream``: the CUDA auxiliary stream."""

    def __init__(self, st: PlanState, arenas: dict, held: dict, step_seconds: list,
                 cancel_token: Any) -> None:
        self.st, self.arenas, self.cancel_token = st, arenas, cancel_token
        self.g = st.graph
        self.by_id = {n.id: n for n in self.g.nodes}
        self.ns: dict[str, Any] = {"empty_strided": torch.empty_strided,
                                   "_wkey": weights.weight_key, "_wcell": _weight_cell,
                                   "_wmark": weights.mark_derived,
                                   "_held": held}
        self.step_seconds = step_seconds
        self.wkeys: dict[Node, str] = {}  # weight -> the name of its key, computed once a call
        self.consts: dict[int, str] = {}
        self.counter = itertools.count()
        self.expr: dict[Node, Any] = {}  # node -> Code (or a tuple of Code: multi outputs)
        self.plan_time: dict[Node, Any] = {}  # node -> value known at plan time
        self.lines: list[str] = []
        self.per_call = set(st.memory.per_call)
        self.bound_keys = {k for n in st.bound for k in keys_of(n)}
        self.holders: dict[tuple, list[str]] = {}  # bound storage -> the names holding it
        self.read_index = read_indices(self.g)
        self.aux_nodes = st.aux_nodes
        self.step_counts: Counter = Counter()
        self.copies = 0
        self.cache_nodes: dict[int, Node] = {}

    # -- helpers --------------------------------------------------------------------------
    def const(self, v: Any) -> Code:
        """``v`` as a constant of the step function (plain numbers and strings inline)."""
        if isinstance(v, (bool, int, float, str, type(None))) and not isinstance(v, float):
            return Code(repr(v))
        k = id(v)
        if k not in self.consts:
            self.consts[k] = name = f"c{next(self.counter)}"
            self.ns[name] = v
            self.ns.setdefault("_keep", []).append(v)
        return Code(self.consts[k])

    def value_of(self, v: Any) -> Any:
        if isinstance(v, Node):
            return self.const(self.plan_time[v]) if v in self.plan_time else self.expr[v]
        return self.const(v)

    def src_of(self, v: Node) -> Any:
        return self.const(self.plan_time[v]) if v in self.plan_time else self.expr[v]

    def fn_of(self, n: Node) -> Code:
        return self.const(n.target._op if hasattr(n.target, "_op") else n.target)

    def storage(self, n: Node, index: int | None) -> tuple[Any, Any]:
        """(code, plan-time tensor or None) of an owner buffer."""
        key = (n.id, index)
        if key in self.per_call:
            m = n.meta if index is None else n.meta[index]
            name = f"v{n.id}" if index is None else f"v{n.id}_{index}"
            self.lines.append(f"{name} = empty_strided({tuple(m.shape)!r}, "
                              f"{tuple(m.stride)!r}, dtype={self.const(m.dtype).src}, "
                              f"device={self.const(m.device).src})")
            return Code(name), None
        if key in self.st.memory.offsets:
            t = buffer_view(self.st, self.arenas, self.by_id, key)
            return self.const(t), t
        return None, None  # an output nobody reads and nobody returns

    def hold(self, n: Node, name: str) -> None:
        owner, index = storage_root(n)
        if (owner.id, index) in self.bound_keys:
            self.holders.setdefault((owner.id, index), []).append(name)

    def count(self, n: Node, kernel: Any = None) -> None:
        self.step_counts[(kernel or self.st.kernels[n]).name] += 1

    # -- classification -------------------------------------------------------------------
    def kind(self, n: Node) -> str:
        """The kind of step ``n`` is (module docstring)."""
        st = self.st
        if n.is_input:
            return "input"
        if n.op == "constant":
            return "constant"
        if n.op in SYM_OPS or (n.is_scalar and n in st.scalars):
            return "scalar"
        if n.op == "getitem":
            return "getitem"
        if n.view_of is not None:
            return "view"
        if n.op.startswith("fused.") and n.inplace_of is not None:
            return "fused_copy"
        if n.inplace_of is not None:
            return "inplace"
        if n.is_scalar or n.meta is None:
            return "bind"
        if n in st.cached:
            return "cached"
        if n in st.bound:
            return "bound"
        kernel = st.kernels[n]
        if not isinstance(n.meta, tuple) and kernel is registry.NATIVE and \
                (n.id, None) in self.per_call and n.target is not None and \
                n.op != "aten._to_copy.default" and \
                not (isinstance(n.target, torch._ops.OpOverload) and out_overload(n.target)):
            return "bind"  # returned to the caller and computed fresh anyway: hand it over
        if n in st.concat.placed:
            return "concat"
        return "owned"

    # -- emitters, one per kind -----------------------------------------------------------
    def _emit_input(self, n: Node) -> None:
        pass

    def _emit_constant(self, n: Node) -> None:
        self.plan_time[n] = n.annotations["value"]
        self.expr[n] = self.const(self.plan_time[n])

    def _emit_scalar(self, n: Node) -> None:
        self.plan_time[n] = self.st.scalars[n]
        self.expr[n] = self.const(self.plan_time[n])

    def _emit_getitem(self, n: Node) -> None:
        parent, idx = n.srcs[0], n.params["index"]
        if parent in self.plan_time:
            self.plan_time[n] = self.plan_time[parent][idx]
            self.expr[n] = self.const(self.plan_time[n])
        elif isinstance(self.expr[parent], tuple):
            self.expr[n] = self.expr[parent][idx]
        else:
            self.lines.append(f"v{n.id} = {self.expr[parent].src}[{idx}]")
            self.expr[n] = Code(f"v{n.id}")
            self.hold(n, f"v{n.id}")

    def _emit_view(self, n: Node) -> None:
        if all(s in self.plan_time for s in n.srcs) and self.st.kernels[n] is registry.NATIVE:
            # a view of planned storage never changes: take it once, here
            pt = self.plan_time
            a, kw = call_args(n, lambda s: pt[s], lambda v: pt[v] if isinstance(v, Node) else v)
            self.plan_time[n] = n.target(*a, **kw)
            self.expr[n] = self.const(self.plan_time[n])
            return
        self._emit_bind(n)

    def _emit_bind(self, n: Node) -> None:
        """Per call: ``v = op(...)``, the op's own result is the node's value."""
        a, kw = call_args(n, self.src_of, self.value_of)
        self.lines.append(f"v{n.id} = {self.fn_of(n).src}({_args_src(a, kw)})")
        self.expr[n] = Code(f"v{n.id}")
        self.count(n)
        if n.view_of is not None:
            self.hold(n, f"v{n.id}")

    def _emit_fused_copy(self, n: Node) -> None:
        # a terminal copy: the fused kernel writes the copy's destination
        dest = self.src_of(n.inplace_of)
        self.lines.append(self.extension_call(n, self.st.kernels[n],
                                              [self.src_of(s) for s in n.srcs], [dest]))
        self.expr[n] = dest
        self.count(n)

    def _emit_inplace(self, n: Node) -> None:
        a, kw = call_args(n, self.src_of, self.value_of)
        self.lines.append(f"{self.fn_of(n).src}({_args_src(a, kw)})")
        self.expr[n] = self.expr[n.inplace_of] if n.inplace_of not in self.plan_time \
            else self.const(self.plan_time[n.inplace_of])
        self.count(n)

    def _emit_cached(self, n: Node) -> None:
        """The model's value, computed again only when a weight it reads changed (planning's
        ``_weight_derived``; ``fxbackend.weights``: checked by fingerprint every call), and
        marked as derived (``weights.mark_derived``: a kernel keying a value of its own on it,
        W8A8's quantized weight, checks it by serial number, not by fingerprint)."""
        a, kw = call_args(n, self.src_of, self.value_of)
        ws = self.st.cached[n]
        for w in ws:
            if w not in self.wkeys:
                self.wkeys[w] = f"_wk{w.id}"
                self.lines.append(f"_wk{w.id} = _wkey({self.expr[w].src})")
        what = weights.what_id(derivation(self.st, n))
        self.lines += [
            f"_c = _wcell(({''.join(self.expr[w].src + ', ' for w in ws)}), {what}, _held)",
            f"_k = ({''.join(self.wkeys[w] + ', ' for w in ws)})",
            "_p = _c._pair",
            "if _p[0] != _k:",
            f"    _p = (_k, {self.const(n.target._op).src}({_args_src(a, kw)}))",
            "    _c.set(*_p)",
            f"    _wmark(_p[1], ({''.join(self.expr[w].src + ', ' for w in ws)}))",
            f"v{n.id} = _p[1]"]
        self.cache_nodes[what] = n
        self.expr[n] = Code(f"v{n.id}")
        self.holders.setdefault((n.id, None), []).append(f"v{n.id}")
        self.count(n)

    def _emit_bound(self, n: Node) -> None:
        self.count(n)
        kernel = self.st.kernels[n]
        if kernel is not registry.NATIVE:  # an extension kernel's ``compute``: one tensor
            self.lines.append(self.extension_call(n, kernel, [self.src_of(s) for s in n.srcs],
                                                  None, result=f"v{n.id}"))
            self.expr[n] = Code(f"v{n.id}")
            self.holders.setdefault((n.id, None), []).append(f"v{n.id}")
            return
        a, kw = call_args(n, self.src_of, self.value_of)
        call = f"{self.const(n.target._op).src}({_args_src(a, kw)})"
        if not isinstance(n.meta, tuple):
            self.lines.append(f"v{n.id} = {call}")
            self.expr[n] = Code(f"v{n.id}")
            self.holders.setdefault((n.id, None), []).append(f"v{n.id}")
            return
        self.lines.append(f"_r = {call}")
        codes = []
        for i in range(len(n.meta)):
            if i in self.read_index.get(n, ()):
                self.lines.append(f"v{n.id}_{i} = _r[{i}]")
                codes.append(Code(f"v{n.id}_{i}"))
                self.holders.setdefault((n.id, i), []).append(f"v{n.id}_{i}")
            else:
                codes.append(None)
        self.lines.append("del _r")  # unread outputs go now
        self.expr[n] = tuple(codes)

    def _emit_concat(self, n: Node) -> None:
        # some parts already live in this cat's buffer: copy only the others
        code, t = self.storage(n, None)
        self.expr[n], self.plan_time[n] = code, t
        left = self.st.concat.copies_left(n, lambda x: x.meta)
        for j in left:
            d, start, length = self.st.concat.dest[(n, j)]
            self.lines.append(f"{self.const(t.narrow(d, start, length)).src}"
                              f".copy_({render(self.src_of(n.srcs[j]))})")
        if left:
            self.count(n)

    def _emit_owned(self, n: Node) -> None:
        """A compute step that owns fresh storage: a placement copy, an extension kernel or
        a native op."""
        multi = isinstance(n.meta, tuple)
        if multi:
            outs = [self.storage(n, i) if isinstance(m, TensorMeta) else (None, None)
                    for i, m in enumerate(n.meta)]
        else:
            outs = [self.storage(n, None)]
        codes = [c for c, _ in outs]
        if all(t is not None for _, t in outs):
            self.plan_time[n] = tuple(t for _, t in outs) if multi else outs[0][1]
        self.expr[n] = tuple(codes) if multi else codes[0]
        self.count(n)
        kernel = self.st.kernels[n]
        if n.op == COPY_DEVICE_OP:  # a copy the scheduler inserted for placement
            if codes[0] is not None:
                self.lines.append(f"{codes[0].src}.copy_({render(self.src_of(n.srcs[0]))})")
                self.copies += 1
            return
        if kernel is not registry.NATIVE or n.target is None:
            if kernel is registry.NATIVE:  # a custom op's reference execute
                from .ops import get_op
                kernel = get_op(n.op)
            self.lines.append(self.extension_call(n, kernel, [self.src_of(s) for s in n.srcs],
                                                  codes))
            return
        self._native_into(n, codes)

    def _native_into(self, n: Node, codes: list) -> None:
        """A native op writing planned storage ``codes``: its ``.out`` overload (or the faster
        ``torch.*`` binding of it), ``copy_`` for conversions, else a counted copy."""
        a, kw = call_args(n, self.src_of, self.value_of)
        ov = out_overload(n.target) if isinstance(n.target, torch._ops.OpOverload) else None
        if n.op in COPY_OPS and codes[0] is not None:
            # a conversion (or a clone) into planned storage is exactly copy_ (dtype, device,
            # layout: the planned storage has the layout the op would give)
            self.lines.append(f"{codes[0].src}.copy_({render(a[0])})")
        elif ov is not None and all(c is not None for c in codes):
            fast = FAST_OUT.get(n.op) if not kw or n.op == "aten.gelu.default" else None
            if fast is not None:
                a, kw = call_args(n, self.src_of, self.value_of,
                                  lambda v: self.scalar_operand(n, v))
            if isinstance(fast, tuple):  # (binding, extra positional arguments)
                fast, extra = fast
                a = list(a) + [self.const(x) for x in extra]
            fn = self.const(fast or ov[0]._op)
            outkw = ", ".join(f"{name}={c.src}" for name, c in zip(ov[1], codes))
            args_src = _args_src(a, kw)
            self.lines.append(f"{fn.src}({args_src}{', ' if args_src else ''}{outkw})")
        else:
            call = f"{self.fn_of(n).src}({_args_src(a, kw)})"
            if isinstance(n.meta, tuple):
                self.lines.append(f"_r = {call}")
                for i, c in enumerate(codes):
                    if c is not None:
                        self.lines.append(f"{c.src}.copy_(_r[{i}])")
                        self.copies += 1
            elif codes[0] is not None:
                self.lines.append(f"{codes[0].src}.copy_({call})")
                self.copies += 1
            else:
                self.lines.append(call)

    def scalar_operand(self, n: Node, v: Any) -> Any:
        """A number passed to a Tensor argument of a float32/float64 op, as a 0-dim CPU tensor
        of the op's dtype made once: ATen would wrap the number into a tensor on every call.

        Exact: for these dtypes the op converts a wrapped number to its own dtype too, and a
        0-dim CPU tensor takes the same scalar path.  Lower-precision dtypes keep the number
        (their kernels compute with it in float32)."""
        m = n.meta
        if type(v) not in (int, float) or not isinstance(m, TensorMeta):
            return None
        if m.dtype not in (torch.float32, torch.float64):
            return None
        if any(s.meta.dtype != m.dtype for s in n.srcs):
            return None
        return self.const(torch.tensor(v, dtype=m.dtype))

    def extension_call(self, n: Node, kernel: Any, srcs: list, codes: list | None,
                       result: str | None = None) -> str:
        """``kernel.execute(ctx, node, state, inputs, out, workspace)`` for step ``n`` (``codes``
        None: ``result = kernel.compute(ctx, node, state, inputs, workspace)``), preceded by
        the ``update_args`` watch where the kernel or its op has one."""
        state = self.st.prepared.get(n)
        ctx = ExecContext(device_of(n))
        srcs = "[" + ", ".join(render(c) for c in srcs) + "]"
        ws = "_ws_aux" if n in self.aux_nodes else "_ws"
        const = self.const
        if codes is None:
            call = (f"{result} = {const(_Computed(kernel, n)).src}({const(ctx).src}, "
                    f"{const(n).src}, {const(state).src}, {srcs}, {ws})")
        else:
            out = codes[0].src if len(codes) == 1 else \
                "(" + ", ".join(c.src for c in codes) + ",)"
            call = (f"{const(kernel.execute).src}({const(ctx).src}, {const(n).src}, "
                    f"{const(state).src}, {srcs}, {out}, {ws})")
        from .ops import get_op
        owners = [o for o in (kernel, get_op(n.op)) if callable(getattr(o, "update_args", None))]
        if not owners:
            return call
        # the update_args capability: told when an input's address differs from the last call
        watch = _AddressWatch(n, state, [o.update_args for o in dict.fromkeys(owners)])
        return f"{const(watch).src}({srcs}); " + call

    # -- the whole function ---------------------------------------------------------------
    def node_lines(self) -> dict:
        """``{node: its lines}``, with the evaluation callback and profiling around each."""
        callback = self.st.options.eval_callback
        profile = self.st.options.profile
        sync = False
        if profile:
            self.ns["_pc"] = time.perf_counter
            self.ns["_prof"] = self.step_seconds
            sync = plan_device(self.g).type == "cuda"
            if sync:
                self.ns["_sync"] = torch.cuda.synchronize
        if callback is not None:
            self.ns["_cb"] = callback
        out: dict = {}
        for i, n in enumerate(self.g.nodes):
            mark = len(self.lines)
            getattr(self, "_emit_" + self.kind(n))(n)
            if callback is not None and not n.is_input and n in self.expr:
                self.lines.append(f"_cb({self.const(n).src}, {render(self.expr[n])})")
            if profile and n in self.st.kernels and len(self.lines) > mark:
                self.lines.insert(mark, "_sync(); _t = _pc()" if sync else "_t = _pc()")
                self.lines.append(("_sync(); " if sync else "") + f"_prof[{i}] += _pc() - _t")
            out[n] = self.lines[mark:]
            del self.lines[mark:]
        return out

    def region_lines(self, k: int, region: Any, node_lines: dict) -> list[str]:
        """The code of one fork/join region: the auxiliary branches on the region thread
        (CPU) or the auxiliary stream (CUDA), the main branch here, then the join."""
        free_lines = [ln for n in region.free for ln in node_lines[n]]
        aux_lines = [ln for n in region.aux for ln in node_lines[n]]
        main_lines = [ln for n in region.branches[region.main] for ln in node_lines[n]]
        defined = list(dict.fromkeys(m.group(1) for ln in aux_lines
                                     if (m := _ASSIGNED.match(ln)) and m.group(1) != "_r"))
        if not aux_lines:
            return free_lines + main_lines
        ns = self.ns
        if plan_device(self.g).type == "cuda":
            ns["_aux_stream"] = self.st.aux_stream
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

    def body(self) -> list[str]:
        """Every line of ``run(args)``: unpack the inputs, the steps (regions forked and
        joined), each bound result dropped after its last read, return the outputs."""
        g = self.g
        inputs = g.inputs
        for i, n in enumerate(inputs):
            if n in self.st.scalars:
                self.expr[n] = self.const(self.st.scalars[n])
                self.plan_time[n] = self.st.scalars[n]
            else:
                self.expr[n] = Code(f"a{i}")
        if inputs:
            self.lines.append(", ".join(f"a{i}" for i in range(len(inputs))) +
                              (", = args" if len(inputs) == 1 else " = args"))
        per_node = self.node_lines()
        dels: dict[int, list[str]] = {}
        if self.holders:  # drop each bound result after its last read (after its region)
            life = {b.key: b.end for b in buffers_of(g, lambda n: n.meta)[0]}
            for key, names in self.holders.items():
                if key in life:
                    dels.setdefault(life[key], []).extend(names)

        def del_lines(first: int, last: int) -> list[str]:
            names = [v for t in range(first, last) for v in dels.get(t, ())]
            return [f"del {', '.join(names)}"] if names else []

        lines, pos = self.lines, 0
        for k, region in enumerate(self.st.regions):
            for t in range(pos, region.start):
                lines += per_node[g.nodes[t]] + del_lines(t, t + 1)
            lines += self.region_lines(k, region, per_node)
            lines += del_lines(region.start, region.end)
            pos = region.end
        for t in range(pos, len(g.nodes)):
            lines += per_node[g.nodes[t]] + del_lines(t, t + 1)
        outs = [(self.const(self.plan_time[o]).src if o in self.plan_time
                 else render(self.expr[o])) if isinstance(o, Node) else self.const(o).src
                for o in g.outputs]
        lines.append("return [" + ", ".join(outs) + "]")
        return lines


def generate(st: PlanState, arenas: dict, workspaces: dict, held: dict, step_seconds: list,
             cancel_token: Any) -> Generated:
    """The step function of the planned state ``st`` (module docstring): ``workspaces`` maps
    ``_ws`` (and ``_ws_aux`` with regions) to the workspace tensors."""
    w = StepWriter(st, arenas, held, step_seconds, cancel_token)
    lines = w.body()
    w.ns.update(workspaces)
    # constants become closure cells of the step function: cheaper to load than globals
    names = [k for k in w.ns if not k.startswith("__") and k != "_keep"]
    source = ("def _make(" + ", ".join(names) + "):\n"
              "    def run(args):\n" + "\n".join("        " + ln for ln in lines) +
              "\n    return run\n")
    return Generated(source, names, w.ns, lines, w.step_counts, w.copies, w.cache_nodes)
