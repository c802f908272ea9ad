"""float32 linears through oneDNN where the CPU profile chose it (``float32_gemm: onednn``).

``torch.addmm`` of float32 on x86-64 builds of torch is MKL's, which on some CPUs with AVX-512
runs no faster than its AVX2 kernels: on an AMD EPYC with AVX-512 oneDNN's linear
(``torch.ops.mkldnn._linear_pointwise``) on the same plain weight ran 2.2-2.9x faster at small
Flux's layer shapes (docs/BENCHMARKS.md).  The probe of ``fxbackend.cpu`` measures the two on
the machine; where oneDNN's wins by the margin:

- ``addmm_onednn_cpu`` / ``mm_onednn_cpu``: the registry kernels of ``aten.addmm.default`` /
  ``aten.mm.default`` whose second operand is a transposed contiguous weight (``linear``'s
  ``t(w)``), float32, 2-D, beta = alpha = 1: oneDNN's linear, its result copied into the step's
  output;
- :func:`onednn_gemm_into`, registered as the CPU's GEMM of the fused linear chains
  (``patterns/activation.gemm_into``: ``linear_act``, ``gated_residual`` ...), on the same
  operands.

The weight is read as it is every call (no prepacked copy), so a weight changed in any way is
used at once.  Results differ from ``torch.addmm``'s by float32 summation order only.  Elsewhere
(another decision, other operands) the torch op runs, as before.
"""
from __future__ import annotations

import torch

import fxbackend
from fxbackend.cpu import onednn_float32_linear
from fxbackend.patterns.activation import gemm_into, register_gemm

__all__ = ["onednn_gemm_into", "uses_onednn", "AddmmOneDnn", "MmOneDnn"]

#: profile -> whether its ``float32_gemm`` decision is ``onednn`` (profiles are cached objects)
_chosen: dict = {}


def uses_onednn() -> bool:
    """True when this process's CPU profile computes float32 linears through oneDNN."""
    p = fxbackend.cpu_profile()
    got = _chosen.get(p)
    if got is None:
        got = _chosen[p] = p.decide("float32_gemm").choice == "onednn"
    return got


def _weight(w: torch.Tensor) -> torch.Tensor | None:
    """The contiguous ``[N, K]`` weight of which ``w`` (``[K, N]``) is the transpose, else None."""
    if w.dim() != 2 or w.dtype != torch.float32:
        return None
    wt = w.t()
    return wt if wt.is_contiguous() else None


def _takes(x: torch.Tensor, bias: torch.Tensor | None, n: int, beta, alpha) -> bool:
    return x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" and \
        x.is_contiguous() and x.numel() > 0 and n > 0 and beta == 1 and alpha == 1 and \
        (bias is None or (bias.dtype == torch.float32 and bias.dim() == 1 and
                          bias.shape[0] == n and bias.is_contiguous()))


def _linear_into(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                 bias: torch.Tensor | None, beta, alpha) -> bool:
    """``y = addmm(bias, x, w)`` by oneDNN's linear where the operands suit it; False (nothing
    written) otherwise.  No profile check: the callers make it."""
    wt = _weight(w)
    if wt is None or not _takes(x, bias, wt.shape[0], beta, alpha) or \
            y.dtype != torch.float32 or tuple(y.shape) != (x.shape[0], wt.shape[0]):
        return False
    y.copy_(onednn_float32_linear(x, wt, bias))
    return True


def onednn_gemm_into(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                     bias: torch.Tensor | None, beta=1, alpha=1) -> bool:
    """``y = addmm(bias, x, w)`` by oneDNN's linear where the profile chose it and the operands
    suit it (module docstring); False (nothing written) otherwise."""
    return uses_onednn() and _linear_into(y, x, w, bias, beta, alpha)


register_gemm("cpu", onednn_gemm_into)


class _OneDnnLinear:
    """A registry kernel running a float32 ``addmm``/``mm`` of a transposed weight through
    oneDNN's linear (module docstring).  Workspace: none (oneDNN's result is a new tensor,
    copied into the step's output)."""

    has_bias = True

    def supports(self, node) -> bool:
        try:
            return self.why_not(node) is None
        except Exception:  # never raise from supports: decline instead
            return False

    def why_not(self, node) -> str | None:
        """None when this kernel computes ``node``, else the reason (metadata only)."""
        metas = [s.meta for s in node.srcs]
        if len(metas) != (3 if self.has_bias else 2):
            return "operands"
        bias, x, w = metas if self.has_bias else (None, *metas)
        prm = getattr(node, "params", {}) or {}
        if prm.get("beta", 1) != 1 or prm.get("alpha", 1) != 1:
            return "beta or alpha other than 1"
        tensors = [m for m in (bias, x, w, node.meta) if m is not None]
        if not all(isinstance(m, fxbackend.TensorMeta) and not m.is_symbolic for m in tensors):
            return "not concrete tensors"
        if any(m.dtype != torch.float32 or m.device.type != "cpu" for m in tensors):
            return "not float32 on the CPU"
        if len(x.shape) != 2 or len(w.shape) != 2 or not x.is_contiguous:
            return "x is not a contiguous matrix"
        k, n = w.shape
        if tuple(w.stride) != (1, k):
            return "the weight is not a transposed contiguous [N, K]"
        if bias is not None and (tuple(bias.shape) != (n,) or not bias.is_contiguous):
            return "the bias is not a contiguous [N]"
        if tuple(node.meta.shape) != (x.shape[0], n) or not node.meta.is_contiguous:
            return "the output is not a contiguous [M, N]"
        if not uses_onednn():
            return "the profile's float32_gemm is native"
        return None

    def prepare(self, node):
        return None, 0

    def execute(self, ctx, node, state, inputs, out, workspace) -> None:
        # the profile was read when the plan chose this kernel (why_not)
        bias, x, w = inputs if self.has_bias else (None, *inputs)
        prm = getattr(node, "params", {}) or {}
        beta, alpha = prm.get("beta", 1), prm.get("alpha", 1)
        if not _linear_into(out, x, w, bias, beta, alpha):
            gemm_into(out, x, w, bias, beta, alpha)  # other strides than planned: still right


class AddmmOneDnn(_OneDnnLinear):
    """``aten.addmm.default(bias, x, t(w))`` through oneDNN's linear."""
    name = "addmm_onednn_cpu"
    op = "aten.addmm.default"


class MmOneDnn(_OneDnnLinear):
    """``aten.mm.default(x, t(w))`` through oneDNN's linear."""
    name = "mm_onednn_cpu"
    op = "aten.mm.default"
    has_bias = False


fxbackend.register_kernel("cpu", AddmmOneDnn)
fxbackend.register_kernel("cpu", MmOneDnn)
