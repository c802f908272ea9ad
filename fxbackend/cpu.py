"""The CPU profile: what the CPU a plan runs on can do, and the choices made from it.

x86-64 CPUs differ where this backend's fast paths live.  On an AVX2-only CPU (no AVX-512, no
VNNI, no native bf16) torch's bf16 ``mm`` runs ~170x slower than float32 and ``torch._int_mm``
~100x slower; with AVX-512 VNNI ``torch._int_mm`` is several times faster than float32, and
with AVX-512 BF16 or AMX a bf16 GEMM is faster still.  Every choice that depends on the CPU
class is made here, from :func:`cpu_profile`, and shown in the plan report with its reason.

The profile holds:
- ``isa``: torch's ``torch.backends.cpu.get_cpu_capability()`` (``AVX2``, ``AVX512``, ...);
- ``features``: the CPU flags that matter (:data:`FEATURES`), read from ``/proc/cpuinfo``;
- ``vendor``: ``/proc/cpuinfo``'s ``vendor_id`` (MKL picks its code path by vendor);
- ``threads``: ``torch.get_num_threads()``;
- ``probes``: measured speeds where the features do not settle a choice (below).

``FXB_CPU_PROFILE`` set to one of :data:`CLASSES` (``avx2``, ``avx512``, ``avx512_vnni``,
``avx512_bf16``, ``amx``) replaces the detected features by that class's, so that every decision
can be made, shown and tested on any host.  Under an override no probe runs (a probe measures
the real CPU, which the override does not describe): a choice the class's features do not
settle takes the class's conservative answer (float32, not the fast path that may crawl).
A class names no vendor: under an override the vendor is ``unknown``.
The override changes decisions only; to run the kernels with narrower vectors too, also set
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 NUMBA_CPU_NAME=haswell``.

Decisions (:meth:`CpuProfile.decide`), each a :class:`Decision` with its reason:
- ``int8_gemm``: how ``sd.linear_i8.v1`` (W8A8) multiplies int8 by int8 on this CPU:
  ``int_mm`` (``torch._int_mm``) where VNNI or AMX-INT8 dot products exist and it is exact
  (:func:`int_mm_exact`, checked under an override too: never a path that is wrong here);
  without them (AVX2-only CPUs, where ``torch._int_mm`` crawls) a quantized linear engine with
  the weight prepacked once (:data:`PREPACKED`): ``onednn_linear`` (oneDNN's, the activation codes
  shifted to unsigned bytes, the float32 result written straight into the layer's output) or
  ``quantized_linear`` (fbgemm's, float codes in, a float32 result copied back as int32).
  Both multiply unsigned by signed bytes into 16-bit pair sums that saturate, so the weight
  takes 7-bit codes (:func:`int8_weight_max`: 63) and every pair sum stays exact.  A probe
  measures the paths against float32 where it may run, and a path is taken only when it beats
  float32 by :data:`MARGIN`; otherwise ``float32``: the ``quantize="w8a8"`` rewrite declines
  every linear on the CPU with the reason, since no int8 path here beats the float32 GEMM it
  would replace.  Without probes (an override, ``FXB_CPU_PROBES=0``) oneDNN's is taken where
  torch has it: it was the faster of the two at small Flux's shapes on an AVX2-only EPYC
  (docs/BENCHMARKS.md).
- ``w8a8_layers``: which CPU linear layers W8A8 rewrites (:func:`w8a8_limits`): those where
  the int8 GEMM saves at least what a W8A8 layer adds to it (its quantize and epilogue passes,
  its weight check): the float32 GEMM's time (its multiply-adds at the probe's float32 speed:
  ``torch.mm``'s, or oneDNN's under ``float32_gemm: onednn``) times ``1 - 1/s``, ``s`` the
  chosen int8 GEMM's measured speed-up over it.  A
  smaller layer stays in float32 with that reason; ``options={"quantize_min_size": 0}``
  rewrites every layer.
- ``float32_gemm``: how float32 linears (``addmm``/``mm`` of a transposed weight, and the
  GEMMs of the fused linear chains) compute: ``native`` (``torch.addmm``: MKL on x86-64
  builds) or ``onednn`` (oneDNN's linear on the plain weight, read every call: no derived
  copy), taken where the probe measures oneDNN's at least :data:`MARGIN` faster, and on AMD
  CPUs with AVX-512 unless the probe measures it :data:`MARGIN` slower (MKL, which picks its
  code path by vendor, runs no AVX-512 code there; oneDNN's linear does).  Otherwise, and
  without probes or vendor (an override, ``FXB_CPU_PROBES=0`` on another vendor): ``native``.
- ``bfloat16`` / ``float16``: how 16-bit GEMMs and convolutions compute: ``native`` where the
  CPU has the 16-bit dot products (AVX-512 BF16 or AMX-BF16; AVX-512 FP16 or AMX-FP16) or the
  probe measures the 16-bit op faster than the float32 op plus the casts; otherwise ``float32``:
  the ``compute_in_float32`` rewrite (``patterns/upcast.py``) computes them in float32 from
  weight copies upcast once and rounds the result once to the model's dtype.

Probes (:func:`run_probes`): a few small timed ops (well under a second in all), run at plan
time the first time a decision needs them, never inside a call, and cached on disk per CPU model,
feature set, torch version, thread count and the vector-limiting environment, in
``$XDG_CACHE_HOME/fxbackend/cpu/probes.json`` (default ``~/.cache/...``) next to the kernel
cache.  Each figure is the median of :data:`PROBE_PASSES` passes (a burst of other work spoils
one pass, not the figure); figures measured while the machine was busy (other processes took
more CPU time during the probes than the cores this process leaves free, or a 1-minute load
average of a core's worth per core or more) are used by that process only, never saved.  The
report's summary line says when and at what load the probes in use were measured.
``FXB_CPU_PROBES=0`` turns them off (undecided choices then take the conservative answer).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import tempfile
import threading
import time
from typing import Callable

import torch

# the engines' checks and calls (their own module); the decisions below read them through this
# module's names, which the tests replace
from .cpu_engines import (int_mm_exact, onednn_float32_linear, onednn_float32_linear_available,
                          onednn_linear_available, onednn_linear_gemm, onednn_linear_pack,
                          quantized_linear_available, quantized_linear_gemm,
                          quantized_linear_pack)

__all__ = ["CpuProfile", "Decision", "cpu_profile", "CLASSES", "FEATURES", "run_probes",
           "probe_cache_path", "cpu_report_lines", "int8_weight_max", "quantized_linear_pack",
           "quantized_linear_gemm", "quantized_linear_available", "int_mm_exact",
           "onednn_linear_available", "onednn_linear_pack", "onednn_linear_gemm", "PREPACKED",
           "onednn_float32_linear_available", "onednn_float32_linear",
           "w8a8_limits", "W8A8Limits"]

#: the CPU flags (as ``/proc/cpuinfo`` names them) that the decisions read
FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
            "avx_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16",
            "amx_fp16")

_AVX2 = frozenset({"avx2", "fma"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
_VNNI = _AVX512 | {"avx512_vnni"}
_BF16 = _VNNI | {"avx512_bf16"}
#: ``FXB_CPU_PROFILE`` values: the features each class has
CLASSES: dict[str, frozenset] = {
    "avx2": _AVX2,
    "avx512": _AVX512,
    "avx512_vnni": _VNNI,
    "avx512_bf16": _BF16,
    "amx": _BF16 | {"avx512_fp16", "amx_tile", "amx_int8", "amx_bf16"},
}
_ISA = {"avx2": "AVX2"}  # every other class: AVX512

#: the features that make each fast path native (no probe needed)
_INT8_DOT = ("amx_int8", "avx512_vnni")
_NATIVE_16 = {"bfloat16": ("amx_bf16", "avx512_bf16"), "float16": ("amx_fp16", "avx512_fp16")}
#: a measured path must beat the other by this factor to be taken (the probes are small and
#: the machine may be busy: a tie keeps the conservative path)
MARGIN = 1.2


@dataclasses.dataclass(frozen=True)
class Decision:
    """One choice made from the profile: ``choice`` and the ``reason`` shown in reports."""
    name: str
    choice: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name}: {self.choice} ({self.reason})"


@dataclasses.dataclass(frozen=True)
class CpuProfile:
    """What the CPU can do (module docstring).  ``source`` says where the features came from:
    ``"detected"`` or ``"FXB_CPU_PROFILE=<class>"``."""
    isa: str
    features: frozenset
    threads: int
    model: str
    source: str
    probes_enabled: bool = True
    #: ``/proc/cpuinfo``'s ``vendor_id`` (``"AuthenticAMD"``, ``"GenuineIntel"``), or
    #: ``"unknown"`` (another OS, or an override: a class names features, not a vendor)
    vendor: str = "unknown"

    @property
    def overridden(self) -> bool:
        return self.source != "detected"

    def has(self, *names: str) -> bool:
        """True when the CPU has any of the features ``names``."""
        return any(n in self.features for n in names)

    def probes(self) -> dict:
        """The measured probes (:func:`run_probes`), or ``{}`` under an override or with
        ``FXB_CPU_PROBES=0``."""
        if self.overridden or not self.probes_enabled:
            return {}
        return run_probes(self)

    def decide(self, name: str) -> Decision:
        """The decision ``name`` (one of :data:`DECISIONS`)."""
        return _decide(self, name)

    def decisions(self) -> list[Decision]:
        """Every decision, in a fixed order."""
        return [self.decide(n) for n in DECISIONS]

    def summary(self) -> str:
        """One line: the class, ISA, features and threads."""
        feats = " ".join(f for f in FEATURES if f in self.features) or "none of note"
        vendor = "" if self.vendor == "unknown" else f" ({self.vendor})"
        return (f"cpu profile ({self.source}): {self.model}{vendor}, ISA {self.isa}, "
                f"{self.threads} thread(s), features: {feats}")

    def report_lines(self) -> list[str]:
        """The summary (with when and under what load the probes were measured, where they
        ran), then one line per decision (as the plan report shows them)."""
        decisions = [f"cpu decision {d}" for d in self.decisions()]
        return [self.summary() + _probe_note(self.probes())] + decisions


DECISIONS = ("int8_gemm", "w8a8_layers", "float32_gemm", "bfloat16", "float16")


def cpu_report_lines(graph) -> list[str]:
    """:meth:`CpuProfile.report_lines` for a graph with a CPU tensor among its values, else
    ``[]`` (a plan on another device takes no decision from the CPU)."""
    def on_cpu(meta) -> bool:
        if isinstance(meta, (tuple, list)):
            return any(on_cpu(m) for m in meta)
        device = getattr(meta, "device", None)
        return device is not None and torch.device(device).type == "cpu"

    if any(on_cpu(n.meta) for n in list(graph.inputs) + list(graph.nodes)):
        return cpu_profile().report_lines()
    return []


def _decide(p: CpuProfile, name: str) -> Decision:
    if name == "int8_gemm":
        return _decide_int8(p)
    if name == "w8a8_layers":
        return _decide_w8a8_layers(p)
    if name == "float32_gemm":
        return _decide_float32_gemm(p)
    if name in _NATIVE_16:
        if p.has(*_NATIVE_16[name]):
            have = [f for f in _NATIVE_16[name] if f in p.features]
            return Decision(name, "native", f"the CPU has {' and '.join(have)}")
        probes = p.probes()
        gemm, conv = probes.get(f"{name}_mm_speedup"), probes.get(f"{name}_conv_speedup")
        if gemm is not None and conv is not None:
            if min(gemm, conv) >= MARGIN:
                return Decision(name, "native", f"{name} GEMM measured {gemm:.2f}x and "
                                                f"convolution {conv:.2f}x float32 compute here")
            return Decision(name, "float32", f"GEMMs and convolutions compute in float32 "
                                             f"(native {name} GEMM measured {gemm:.2f}x, "
                                             f"convolution {conv:.2f}x the float32 compute)")
        return Decision(name, "float32", f"no native {name} dot products on this CPU: GEMMs "
                                         f"and convolutions compute in float32")
    raise ValueError(f"cpu_profile().decide: unknown decision {name!r}; one of {DECISIONS}")



#: the vendor whose CPUs with AVX-512 get oneDNN's float32 linear without a probe's margin:
#: MKL (torch.addmm's GEMM on x86-64 builds) picks its code path by vendor, and on AMD CPUs
#: with AVX-512 names no AVX-512 path (``MKL_VERBOSE=1``: "Intel(R) Architecture processors"
#: on a Zen 4 EPYC) where oneDNN's linear runs its AVX-512 kernels (``brg_matmul:avx512_core``)
_ONEDNN_VENDOR = "AuthenticAMD"


def _decide_float32_gemm(p: CpuProfile) -> Decision:
    name = "float32_gemm"
    speed = p.probes().get("float32_onednn_speedup")
    measured = "" if speed is None else f"; measured {speed:.2f}x torch.addmm"
    if p.vendor == _ONEDNN_VENDOR and p.has("avx512f") and \
            onednn_float32_linear_available() and (speed is None or speed * MARGIN >= 1):
        # the probe measured 1.04-1.15x on a Zen 4 EPYC (small SD3 1.05x faster, small Flux
        # level), 2.16x on a Zen 5 one (docs/BENCHMARKS.md)
        return Decision(name, "onednn", f"float32 linears through oneDNN's: MKL runs no "
                                        f"AVX-512 code on {p.vendor} CPUs{measured}")
    if speed is None:
        return Decision(name, "native", "torch.addmm (no probe measured oneDNN's linear)")
    if speed >= MARGIN and onednn_float32_linear_available():
        return Decision(name, "onednn", f"float32 linears through oneDNN's: measured "
                                        f"{speed:.2f}x torch.addmm on this CPU")
    return Decision(name, "native", f"torch.addmm (oneDNN's linear measured {speed:.2f}x it "
                                    f"here)")



def int8_weight_max(p: CpuProfile | None = None) -> int:
    """The largest weight code W8A8 may use with profile ``p`` (default: this CPU's): 127
    with VNNI or AMX-INT8 dot products that the int8 kernels use (``torch._int_mm`` exact
    here), 63 otherwise (the quantized linear engines' AVX2 kernels add two u8 x s8 products
    in saturating 16 bits: 255 * 63 * 2 < 2^15; so do oneDNN's on a CPU with VNNI under
    ``ONEDNN_MAX_CPU_ISA=AVX2``)."""
    p = cpu_profile() if p is None else p
    return 127 if p.has(*_INT8_DOT) and int_mm_exact() else 63


#: the int8 GEMM paths that take a weight prepacked with 7-bit codes where the CPU has no
#: VNNI or AMX-INT8, and how reports name them
PREPACKED = {"onednn_linear": "oneDNN's quantized linear (u8 activations, 7-bit weights)",
             "quantized_linear": "fbgemm's quantized linear (7-bit weights)"}
_ENGINE_NAMES = {"onednn_linear": "oneDNN", "quantized_linear": "fbgemm"}


def _decide_int8(p: CpuProfile) -> Decision:
    name = "int8_gemm"
    # an override names features, never a path that computes wrong results here: torch._int_mm
    # is checked for exactness (a product of a few microseconds) whatever the profile says
    if p.has(*_INT8_DOT) and int_mm_exact():
        have = [f for f in _INT8_DOT if f in p.features]
        return Decision(name, "int_mm", f"torch._int_mm: the CPU has {' and '.join(have)}")
    lacks = "no VNNI or AMX-INT8" if not p.has(*_INT8_DOT) else \
        "torch._int_mm is not exact here (its int8 kernels saturate)"
    available = {"onednn_linear": onednn_linear_available(),
                 "quantized_linear": quantized_linear_available()}
    probes = p.probes()
    speed = {"onednn_linear": probes.get("onednn_linear_speedup"),
             "quantized_linear": probes.get("quantized_linear_speedup"),
             "int_mm": probes.get("int_mm_speedup")}
    if None not in speed.values():
        exact = int_mm_exact()
        paths = [(speed[c], c) for c in PREPACKED if available[c]] + \
            ([(speed["int_mm"], "int_mm")] if exact else [])
        best = max(paths, default=(0.0, "float32"))
        measured = ", ".join(
            [f"{_ENGINE_NAMES[c]} {speed[c]:.2f}x" for c in PREPACKED] +
            [f"torch._int_mm {speed['int_mm']:.2f}x" + ("" if exact else " (not exact here)")])
        if best[0] >= MARGIN:
            what = PREPACKED.get(best[1], "torch._int_mm")
            return Decision(name, best[1], f"{what}: measured {best[0]:.2f}x float32 on this "
                                           f"CPU ({measured})")
        return Decision(name, "float32", f"no int8 GEMM beats float32 here ({measured} "
                                         f"float32): W8A8 declines")
    for choice, what in PREPACKED.items():  # the order measured on an AVX2-only EPYC
        if available[choice]:
            return Decision(name, choice, f"{lacks}: {what}")
    return Decision(name, "float32", f"{lacks} and no quantized linear engine, so int8 GEMM "
                                     f"is slower than float32 here: W8A8 declines")


#: what a W8A8 layer adds to its int8 GEMM however fast that is: the quantize pass over x,
#: the epilogue pass over the result, the per-call check of the float weight and three kernel
#: launches.  0.2-0.4 ms a layer in the small UNet's and Flux's per-step profiles (float32
#: against W8A8, ``[1-1600, 64-1920] x [64-2304]`` layers) on 2 threads of an AMD EPYC with
#: AVX-512 VNNI; a layer whose GEMM time W8A8 saves is less cannot repay it
W8A8_LAYER_COST_S = 2e-4
#: the float32 GEMM's ns per multiply-add where no probe measured it (about 100 GFLOP/s, the
#: probe's figure on that EPYC)
_F32_NS_PER_MAC = 0.02
#: the int8 GEMM's speed-up over float32 where no probe measured it, by ``int8_gemm`` choice:
#: the lower ends of what ``scripts/bench_int8.py --sections engines`` measured at small Flux's
#: shapes (``torch._int_mm`` with VNNI 6.8-9.0x; oneDNN's engine on AVX2 kernels 2.0-2.2x,
#: fbgemm's about as fast on an AVX2-only CPU)
_INT8_DEFAULT_SPEEDUP = {"int_mm": 6.0, "onednn_linear": 2.0, "quantized_linear": 2.0}


@dataclasses.dataclass(frozen=True)
class W8A8Limits:
    """Which CPU linear layers W8A8 may gain on (:func:`w8a8_limits`): ``[M, K] x [K, N]``
    with ``M*K*N >= min_macs``, those where the GEMM time the int8 GEMM saves (the float32
    GEMM's, ``ns_per_mac`` each, times ``1 - 1 / speedup``) is at least
    :data:`W8A8_LAYER_COST_S`; ``source``: "measured" (the probes') or "default" (where they
    did not run)."""
    min_macs: int
    ns_per_mac: float
    source: str
    speedup: float = _INT8_DEFAULT_SPEEDUP["int_mm"]

    def why_not(self, m: int, k: int, n: int) -> str | None:
        """None when the layer may gain, else why not."""
        macs = m * k * n
        if macs >= self.min_macs:
            return None
        f32_ms = macs * self.ns_per_mac * 1e-6
        return (f"its float32 GEMM takes about {f32_ms:.3f} ms here (M*K*N={macs:,}) and the "
                f"int8 GEMM ({self.speedup:.1f}x) would save {f32_ms * (1 - 1 / self.speedup):.3f}"
                f" ms of it, less than the {W8A8_LAYER_COST_S * 1e3:.1f} ms a W8A8 layer adds "
                f"(quantize and epilogue passes, weight check, kernel launches)")


def w8a8_limits(p: CpuProfile | None = None) -> W8A8Limits | None:
    """The CPU linear layers W8A8 may gain on with profile ``p`` (default: this CPU's), from
    the float32 GEMM speed the probes measured (``torch.mm``'s, or oneDNN's where the
    ``float32_gemm`` decision takes it: the GEMM the layer would otherwise run) and the
    chosen int8 GEMM's speed-up over it, or the defaults above under an override or with
    probes off; None where the ``int8_gemm`` decision is ``float32`` (no layer gains)."""
    p = cpu_profile() if p is None else p
    engine = p.decide("int8_gemm").choice
    if engine == "float32":
        return None
    probes = p.probes()
    ns, speedup = probes.get("float32_mm_ns_per_mac"), probes.get(f"{engine}_speedup")
    if ns is not None and p.decide("float32_gemm").choice == "onednn":
        ns /= probes["float32_onednn_speedup"]
        speedup = None if speedup is None else speedup / probes["float32_onednn_speedup"]
    if ns is None or speedup is None:
        ns, speedup, source = _F32_NS_PER_MAC, _INT8_DEFAULT_SPEEDUP[engine], "default"
    else:
        source = "measured"
    # an int8 GEMM the decision took is faster than float32 by its margin at least; a slower
    # one against oneDNN's float32 still gains on the largest layers only
    speedup = max(speedup, MARGIN)
    saved_per_mac = ns * 1e-9 * (1 - 1 / speedup)
    return W8A8Limits(int(W8A8_LAYER_COST_S / saved_per_mac), ns, source, speedup)


def _decide_w8a8_layers(p: CpuProfile) -> Decision:
    limits = w8a8_limits(p)
    if limits is None:
        return Decision("w8a8_layers", "none", "no int8 GEMM beats float32 here (int8_gemm)")
    return Decision("w8a8_layers", f"M*K*N >= {limits.min_macs / 1e6:.1f}M",
                    f"float32 GEMM {limits.ns_per_mac:.3f} ns per multiply-add, int8 GEMM "
                    f"{limits.speedup:.1f}x faster ({limits.source}): in a smaller layer it "
                    f"saves less than the {W8A8_LAYER_COST_S * 1e3:.1f} ms a W8A8 layer adds")


def _cpuinfo() -> tuple[frozenset, str, str]:
    """The CPU's flags among :data:`FEATURES`, its model name and its vendor, from
    ``/proc/cpuinfo`` (empty, ``"unknown CPU"`` and ``"unknown"`` elsewhere)."""
    flags: set = set()
    model, vendor = "unknown CPU", "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "flags" and not flags:
                    flags = set(value.split())
                elif key == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key == "vendor_id" and vendor == "unknown":
                    vendor = value.strip() or "unknown"
                if flags and model != "unknown CPU" and vendor != "unknown":
                    break
    except OSError:
        pass
    return frozenset(f for f in FEATURES if f in flags), model, vendor


def _isa() -> str:
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:
        return "unknown"


def cpu_profile() -> CpuProfile:
    """The profile of this process's CPU (module docstring): detected, or the class named by
    ``FXB_CPU_PROFILE``; read again whenever the environment or the thread count changes.
    Raises ValueError naming the variable and the accepted values for an unknown class."""
    return _profile(os.environ.get("FXB_CPU_PROFILE", "").strip().lower(),
                    os.environ.get("FXB_CPU_PROBES", "1").strip() not in ("0", "false", "no"),
                    torch.get_num_threads())


@functools.lru_cache(maxsize=None)
def _profile(override: str, probes: bool, threads: int) -> CpuProfile:
    features, model, vendor = _cpuinfo()
    isa = _isa()
    if override:
        if override not in CLASSES:
            raise ValueError(f"FXB_CPU_PROFILE={override!r}: expected one of "
                             f"{', '.join(CLASSES)}")
        return CpuProfile(_ISA.get(override, "AVX512"), CLASSES[override], threads, model,
                          f"FXB_CPU_PROFILE={override}", probes)
    if isa in ("AVX2", "DEFAULT"):  # torch limited to AVX2 (ATEN_CPU_CAPABILITY): no 512-bit
        features = features - {f for f in features if f.startswith(("avx512", "amx"))}
    return CpuProfile(isa, features, threads, model, "detected", probes, vendor)


# ---------------------------------------------------------------------------------------------
# probes

_probe_lock = threading.Lock()
_probed: dict[str, dict] = {}
#: the environment that limits the vectors: part of the cache key (MKL's: on Intel CPUs MKL's
#: float32 GEMM runs its AVX-512 code unless limited, 66 against 101 ms for a 1024 x 3072 x
#: 3072 linear on 2 threads of a Xeon with AMX)
_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "NUMBA_CPU_NAME",
           "MKL_ENABLE_INSTRUCTIONS")


def probe_cache_path() -> str:
    """The probes' file: ``$XDG_CACHE_HOME/fxbackend/cpu/probes.json``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fxbackend", "cpu", "probes.json")


#: a probe measured while the machine's 1-minute load average per core was at least this is
#: used by the process that measured it but not saved: a busy machine slows the candidate and
#: its rival unevenly (the int8 GEMM measured 1.1x float32 during a test run, 3.0x on the quiet
#: machine: 2 cores of an AMX Xeon), and a saved figure decides for every later process
BUSY_LOAD_PER_CORE = 1.0


#: other processes' CPU time during the probes, in cores beyond those this process's threads
#: leave free, from which the probes count as measured on a busy machine: one other busy
#: process on 2 cores of an AMX Xeon took 0.5-0.7 of a core from them and moved the int8
#: GEMM's figure from 3.5-3.9x float32 to 1.1x and oneDNN's float32 linear's from 0.9-1.0x to
#: 0.3-2.8x; a quiet machine reads 0.00-0.04
BUSY_OTHER_CORES = 0.25
#: how many times the probes run; each figure is the median of its passes (0.1 s a pass there)
PROBE_PASSES = 3
#: how many times the passes are measured again while other processes take CPU time from them
#: (the quietest measurement is kept)
BUSY_RETRIES = 2


def _cpu_seconds() -> tuple[float, float] | None:
    """``(busy, own)``: CPU seconds since boot of all the machine's CPUs (the time the
    hypervisor gave other machines included) and of this process, or None where the OS gives
    no ``/proc/stat``."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
        hz = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    if len(ticks) < 8:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
    t = os.times()
    return (user + nice + system + irq + softirq + steal) / hz, t.user + t.system


def _measure_passes(threads: int) -> tuple[dict, float | None]:
    """The probes' figures, each the median of :data:`PROBE_PASSES` passes of :func:`_measure`,
    and how many cores other processes took from this one's ``threads`` meanwhile (their CPU
    time per second beyond the cores left free; None where :func:`_cpu_seconds` gives none)."""
    before, start = _cpu_seconds(), time.perf_counter()
    passes = [_measure() for _ in range(PROBE_PASSES)]
    after, wall = _cpu_seconds(), time.perf_counter() - start
    out = {k: sorted(p[k] for p in passes)[len(passes) // 2] for k in passes[0]}
    if before is None or after is None or wall <= 0:
        return out, None
    others = ((after[0] - before[0]) - (after[1] - before[1])) / wall
    free = max((os.cpu_count() or 1) - threads, 0)
    return out, max(others - free, 0.0)


def _load_per_core() -> float | None:
    """The 1-minute load average per core, or None where the OS does not give one."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (OSError, AttributeError):
        return None


def _probe_note(entry: dict) -> str:
    """What the summary line says of the probes ``entry``: when and at what load they were
    measured, and whether they were saved; ``""`` without probes."""
    if not entry:
        return ""
    note = f"; probes measured {entry.get('measured', '?')}"
    load, others = entry.get("load_per_core"), entry.get("other_cores")
    if load is not None:
        note += f" at load {load:.2f} per core"
    if others is not None:
        note += f", {others:.2f} of a core taken by other processes"
    if entry.get("saved") is False:
        note += " (not saved: the machine was busy, measured again in the next process)"
    return note


def _key(p: CpuProfile) -> str:
    text = json.dumps([p.model, sorted(p.features), p.isa, torch.__version__, p.threads,
                       [os.environ.get(v, "") for v in _LIMITS], _PROBE_VERSION])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _speedup(candidate: Callable[[], object], rival: Callable[[], object], rounds: int = 4,
             budget_s: float = 0.3) -> float:
    """How many times faster ``candidate`` runs than ``rival`` (>1: faster): the ratio of
    :func:`_best_seconds`."""
    t_candidate, t_rival = _best_seconds(candidate, rival, rounds, budget_s)
    return t_rival / t_candidate


def _best_seconds(candidate: Callable[[], object], rival: Callable[[], object], rounds: int = 4,
                  budget_s: float = 0.3) -> list:
    """``[candidate's, rival's]`` best seconds of ``rounds`` calls of each, interleaved so that
    a load on the machine hits both, after one warm-up call each; stops early past
    ``budget_s`` (a crawling path needs no more samples to be seen as slow)."""
    candidate()
    rival()
    best = [float("inf"), float("inf")]
    start = time.perf_counter()
    for _ in range(rounds):
        for i, fn in enumerate((candidate, rival)):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return best


_PROBE_VERSION = 8
#: the figures every cached entry must hold (an entry without one is measured again)
_PROBED_KEYS = {"int_mm_speedup", "quantized_linear_speedup", "onednn_linear_speedup",
                "bfloat16_mm_speedup",
                "bfloat16_conv_speedup", "float16_mm_speedup", "float16_conv_speedup",
                "float32_mm_ns_per_mac", "float32_onednn_speedup"}


def _measure() -> dict:
    """The probes' raw figures: the speed of each candidate path against its float32 rival
    (>1: the candidate is faster), and the float32 GEMM's nanoseconds per multiply-add
    (``float32_mm_ns_per_mac``).  Shapes: a [256, 512] x [512, 512] GEMM, and a 3x3
    convolution of 32 channels on 32x32 in channels-last (the layout the plans give 16-bit
    convolutions); the quantized linear engine on [256, 1024] x [1024, 1024]."""
    g = torch.Generator().manual_seed(0)
    out: dict = {}
    with torch.no_grad():
        m, k, n = 256, 512, 512
        x = torch.randn(m, k, generator=g)
        w = torch.randn(n, k, generator=g)
        qx = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
        qw = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        t_int, t_f32 = _best_seconds(lambda: torch._int_mm(qx, qw.t()),
                                     lambda: torch.mm(x, w.t()))
        out["int_mm_speedup"] = t_f32 / t_int
        out["float32_mm_ns_per_mac"] = t_f32 / (m * k * n) * 1e9
        # float32 linears: torch.addmm (MKL on x86-64 builds, on some AVX-512 CPUs no faster than
        # its AVX2 kernels) against oneDNN's, at a diffusion transformer's layer shape
        xf, wf = torch.randn(512, 384, generator=g), torch.randn(1536, 384, generator=g)
        bf = torch.randn(1536, generator=g)
        out["float32_onednn_speedup"] = _speedup(
            lambda: onednn_float32_linear(xf, wf, bf), lambda: torch.addmm(bf, xf, wf.t())) \
            if onednn_float32_linear_available() else 0.0
        # the engines on a larger GEMM: their per-call costs (the shifted or float codes, the
        # new output) are a larger share of a small one than in a model
        m, k, n = 256, 1024, 1024
        xl, wl = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
        ql = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
        q7 = torch.randint(-63, 64, (n, k), dtype=torch.int8, generator=g)  # as W8A8 packs
        engines = {"quantized_linear": (quantized_linear_available, quantized_linear_pack,
                                        quantized_linear_gemm),
                   "onednn_linear": (onednn_linear_available, onednn_linear_pack,
                                     onednn_linear_gemm)}
        for name, (available, pack, gemm) in engines.items():
            out[f"{name}_speedup"] = 0.0
            if available():
                packed = pack(q7)
                out[f"{name}_speedup"] = _speedup(lambda: gemm(ql, packed),
                                                  lambda: torch.mm(xl, wl.t()))
        cl = torch.channels_last
        xc = torch.randn(1, 32, 32, 32, generator=g).to(memory_format=cl)
        wc = torch.randn(32, 32, 3, 3, generator=g).to(memory_format=cl)
        for dtype in (torch.bfloat16, torch.float16):
            name = str(dtype).removeprefix("torch.")
            x16, w16 = x.to(dtype), w.to(dtype)
            w32 = w16.float()  # the plan upcasts a weight once
            out[f"{name}_mm_speedup"] = _speedup(
                lambda: torch.mm(x16, w16.t()),
                lambda: torch.mm(x16.float(), w32.t()).to(dtype))
            xc16, wc16 = xc.to(dtype), wc.to(dtype)
            wc32 = wc16.float()
            out[f"{name}_conv_speedup"] = _speedup(
                lambda: torch.conv2d(xc16, wc16, padding=1),
                lambda: torch.conv2d(xc16.float(), wc32, padding=1).to(dtype))
    return out


def run_probes(p: CpuProfile) -> dict:
    """The probes for profile ``p`` (module docstring): from the disk cache, else measured now
    and saved, unless the machine was busy (:data:`BUSY_OTHER_CORES`, measured again up to
    :data:`BUSY_RETRIES` times and the quietest kept; :data:`BUSY_LOAD_PER_CORE`): then this
    process uses them and the next one measures again.
    A cache that cannot be read or written is measured around, never fatal."""
    key = _key(p)
    with _probe_lock:
        if key in _probed:
            return _probed[key]
        path = probe_cache_path()
        try:
            with open(path) as f:
                saved = json.load(f)
        except (OSError, ValueError):
            saved = {}
        entry = saved.get(key) if isinstance(saved, dict) else None
        if not isinstance(entry, dict) or not _PROBED_KEYS <= entry.keys():
            before = _load_per_core()
            entry, others = _measure_passes(p.threads)
            for _ in range(BUSY_RETRIES):  # other work is often a burst: measure again
                if others is None or others < BUSY_OTHER_CORES:
                    break
                again = _measure_passes(p.threads)
                if again[1] is not None and again[1] < others:
                    entry, others = again
            entry["measured"] = time.strftime("%Y-%m-%d %H:%M:%S")
            loads = [x for x in (before, _load_per_core()) if x is not None]
            if loads:
                entry["load_per_core"] = round(max(loads), 2)
            if others is not None:
                entry["other_cores"] = round(others, 2)
            busy = (bool(loads) and max(loads) >= BUSY_LOAD_PER_CORE) or \
                (others is not None and others >= BUSY_OTHER_CORES)
            if busy:
                entry["saved"] = False
            else:
                saved = saved if isinstance(saved, dict) else {}
                saved[key] = entry
                try:
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
                    with os.fdopen(fd, "w") as f:
                        json.dump(saved, f, indent=1, sort_keys=True)
                    os.replace(tmp, path)
                except OSError:
                    pass
        _probed[key] = entry
        return entry
