"""The numba set-up every CPU kernel module shares: importing numba lazily with fxbackend's cache
dir, registering a module's jitted helpers once, and creating its kernels once.

Importing this module does not import numba (``fxbackend`` imports every kernel module at import
time); numba is imported by the first :func:`once` getter called, when a plan compiles a kernel.

Contract of :func:`once`: ``getter = once(globals(), build, requires=(...))`` returns a
thread-safe getter; its first call runs each of ``requires`` (other getters: the helper
registrations this module's kernels call), imports numba (:func:`import_numba`), binds the
module's ``prange`` global to ``numba.prange`` (numba recognises a parallel loop by the
identity of ``prange`` in the kernel's globals, so kernels are written against a module-level
``prange = range`` that is swapped here before the first compile), then runs ``build(numba)``
and keeps its result; later calls return that result.  ``build`` registers helpers (``None``)
or creates kernels with :func:`njit` (the dispatchers: each compiles per signature on its
first call).  :func:`inline` and :func:`reassoc` are the two ways kernel modules register
helpers besides ``register_jitable``.

Disk cache.  numba caches each kernel on disk keyed on the source file of the kernel function
(its path, size and modification time) and the bytecode of that function alone: a change to a
helper it inlines from another file (rope's ``_load``/``_store``, rmsnorm's ``_round_as``,
...) or to this file would not invalidate the cached kernel.  So the default cache folder
(:func:`numba_cache_dir`) is named after a digest of every kernel source file of this package:
any edit to any of them (an upgrade of fxbackend included) starts a new, empty folder, and the
folders of other versions unused for 30 days are removed (:func:`prune_old_caches`).  A
``NUMBA_CACHE_DIR`` set by the user is used as it is (clear it after editing the kernels).
"""
from __future__ import annotations

import os
import sys
import tempfile
import threading
from typing import Any, Callable

__all__ = ["numba_cache_dir", "sources_digest", "prune_old_caches", "import_numba",
           "wide_vector_features", "once",
           "njit", "inline", "reassoc", "warm_up", "concurrency_blocker"]

#: the options of every kernel: parallel, cached on disk, strict IEEE float32 (no FMA
#: contraction, no reordering: ``fastmath=False``), releasing the GIL, and IEEE division
#: (``error_model="numpy"``: x / 0 gives inf or nan, as torch's kernels do; a ``prange`` body
#: divided so already, the serial code around it raised ZeroDivisionError).  It matters twice:
#: without the zero check LLVM vectorises loops that divide (the activations: 5-10x), and
#: the helpers a kernel calls (``register_jitable``, ``overload``) are compiled once per
#: signature *and caller's flags*, so kernels that all share one error model share one
#: compiled copy of each helper: with it on every kernel the first call of small W8A8 Flux
#: with an empty cache went from 24.5 to 20.7 s in one process (147 to 97 numba
#: compilations), 16.0-16.3 to 14.4-14.5 s with the compile workers (2 threads of a Xeon with
#: AMX; docs/BENCHMARKS.md, "One error model for every CPU kernel").
KERNEL_OPTIONS = dict(parallel=True, cache=True, fastmath=False, nogil=True,
                      error_model="numpy")

# one lock for every module's set-up: re-entrant because a ``build`` may call other getters
_lock = threading.RLock()


def numba_cache_dir() -> str:
    """Where numba caches compiled kernels: ``$NUMBA_CACHE_DIR`` when set, else
    ``$XDG_CACHE_HOME/fxbackend/numba/<sources digest>`` (default ``~/.cache/fxbackend/numba/
    <digest>``; see "Disk cache" in the module docstring)."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return os.environ["NUMBA_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fxbackend", "numba", sources_digest())


_digest: str | None = None


def sources_digest() -> str:
    """16 hex digits of a SHA-256 over the names and bytes of this package's ``*.py`` files
    (the kernels and the helpers they inline), computed once per process."""
    global _digest
    if _digest is None:
        import hashlib
        here = os.path.dirname(os.path.abspath(__file__))
        h = hashlib.sha256()
        for name in sorted(os.listdir(here)):
            if name.endswith(".py"):
                h.update(name.encode() + b"\0")
                with open(os.path.join(here, name), "rb") as f:
                    h.update(f.read())
        _digest = h.hexdigest()[:16]
    return _digest


#: a cache folder of another kernel version unused this long is removed
PRUNE_AFTER_S = 30 * 24 * 3600


def prune_old_caches(path: str, now: float | None = None) -> None:
    """Mark the cache folder ``path`` as used (its modification time), and remove its sibling
    folders of other kernel versions (named by :func:`sources_digest`: 16 hex digits) not used
    for :data:`PRUNE_AFTER_S`; other entries are left alone.  Never raises."""
    import re
    import shutil
    import time
    now = time.time() if now is None else now
    try:
        os.utime(path, (now, now))
        parent, mine = os.path.split(os.path.normpath(path))
        for name in os.listdir(parent):
            full = os.path.join(parent, name)
            if name != mine and re.fullmatch(r"[0-9a-f]{16}", name) and os.path.isdir(full) \
                    and now - os.path.getmtime(full) > PRUNE_AFTER_S:
                shutil.rmtree(full, ignore_errors=True)
    except OSError:
        return


def import_numba():
    """Import numba with a writable cache dir: unless the user set ``NUMBA_CACHE_DIR``, it is
    set (before the import) to :func:`numba_cache_dir` (not site-packages, which may be
    read-only), or a per-user temporary folder when that cannot be created.  Thread-safe: a
    second thread waits for the first's set-up (it would otherwise find numba half-imported)."""
    with _lock:
        if not os.environ.get("NUMBA_CACHE_DIR"):
            path = numba_cache_dir()
            try:
                os.makedirs(path, exist_ok=True)
            except OSError:
                path = os.path.join(tempfile.gettempdir(), f"fxbackend-numba-{os.getuid()}",
                                    sources_digest())
                os.makedirs(path, exist_ok=True)
            prune_old_caches(path)
            os.environ["NUMBA_CACHE_DIR"] = path
            if "numba" in sys.modules:  # imported before: its config is already read
                sys.modules["numba"].config.CACHE_DIR = path
        import numba
        if numba.config.CPU_FEATURES is None:
            numba.config.CPU_FEATURES = wide_vector_features()
        return numba


def wide_vector_features() -> str | None:
    """The CPU features numba compiles for: on a CPU with AVX-512, the host's features with
    LLVM's preference for 256-bit vectors turned off (``-prefer-256-bit``), so loops vectorise
    over 512-bit registers; None (numba's default, the host's) elsewhere or when the host's
    features cannot be read; ``""`` (the named CPU's own features only) when ``NUMBA_CPU_NAME``
    is set, so that ``NUMBA_CPU_NAME=haswell`` compiles AVX2 kernels on any host.

    LLVM prefers 256-bit vectors on AVX-512 CPUs because early ones lowered their clock for
    512-bit instructions.  On the development CPU (AVX-512 with AMX, one thread) the 512-bit
    loops ran the tanh / erf GELU passes 1.16x / 1.25x, GroupNorm -> SiLU 1.12-1.18x,
    modulation 1.07-1.18x and RoPE on SD3-sized heads 1.5x faster; the memory-bound passes over
    50 MB (gated residual, scale -> cast, RoPE on Flux-sized heads) were level.  Applied by
    :func:`import_numba` when nobody set numba's ``CPU_FEATURES`` (``NUMBA_CPU_FEATURES``): it
    takes effect if numba had not compiled anything in the process before, and numba's disk
    cache keys kernels on the features."""
    if os.environ.get("NUMBA_CPU_NAME"):
        # numba adds the host's features to a named CPU's unless told otherwise: with
        # NUMBA_CPU_NAME=haswell on an AVX-512 host its kernels would still use AVX-512
        return ""
    try:
        import llvmlite.binding as llvm
        features = llvm.get_host_cpu_features().flatten()
    except Exception:
        return None
    if "+avx512f" not in features.split(","):
        return None
    return features + ",-prefer-256-bit"


class _Once:
    def __init__(self, module_globals: dict, build: Callable[[Any], Any],
                 requires: tuple) -> None:
        self._globals = module_globals
        self._build = build
        self._requires = requires
        self._done = False
        self._value: Any = None

    def __call__(self) -> Any:
        if self._done:
            return self._value
        for getter in self._requires:
            getter()
        with _lock:
            if not self._done:
                numba = import_numba()
                if "prange" in self._globals:
                    self._globals["prange"] = numba.prange
                self._value = self._build(numba)
                self._done = True
        _start_runtime()
        return self._value


def once(module_globals: dict, build: Callable[[Any], Any],
         requires: tuple = ()) -> Callable[[], Any]:
    """A getter running ``build(numba)`` once, lazily (see the module docstring)."""
    return _Once(module_globals, build, tuple(requires))


def njit(fn: Callable, **options) -> Any:
    """``numba.njit`` of a kernel with :data:`KERNEL_OPTIONS` (``options`` added or overriding).
    numba must be imported (call from a :func:`once` build)."""
    return sys.modules["numba"].njit(**{**KERNEL_OPTIONS, **options})(fn)


def inline(*fns: Callable) -> None:
    """Register helpers inlined into their callers in numba's IR: LLVM then sees the bounds of
    the slices they index and vectorizes their loops (rope's rows: 1.3-1.6x faster than a call
    per row)."""
    from numba.extending import overload
    for fn in fns:
        overload(fn, inline="always", strict=False)((lambda f: lambda *args: f)(fn))


def reassoc(*fns: Callable) -> None:
    """Register helpers compiled as functions of their own with LLVM's ``reassoc`` flag alone,
    so that their float32 sums vectorise into partial sums while everything else (including
    the kernels that call them) keeps strict IEEE semantics."""
    from numba.extending import overload
    for fn in fns:
        overload(fn, jit_options={"fastmath": {"reassoc"}}, strict=False)(
            (lambda f: lambda *args: f)(fn))


def _probe_kernel(a):  # pragma: no cover - compiled by numba
    s = 0.0
    for i in prange(a.shape[0]):
        s += a[i]
    return s


prange = range  # swapped for numba.prange by ``_probe``'s getter, as in every kernel module
_probe = once(globals(), lambda numba: njit(_probe_kernel))


_runtime_started = False


def _start_runtime() -> None:
    """Start numba's parallel runtime once, keeping torch's intra-op thread count.

    The runtime starts on the first parallel launch.  With the ``omp`` threading layer, where
    numba and torch load the same OpenMP library (a torch linked against the system's libgomp;
    the PyPI wheels bundle their own copy, and the two runtimes are then separate), its start
    sets that runtime's thread count to ``NUMBA_NUM_THREADS``: a process that had called
    ``torch.set_num_threads(1)`` would run every later torch op on all cores.  Every kernel
    getter (:func:`once`) calls this before returning its kernels, so no kernel of ours
    launches first, and torch's count is put back whichever runtime was touched."""
    global _runtime_started
    if _runtime_started:
        return
    import numpy as np
    import torch
    with _lock:
        if _runtime_started:
            return
        _runtime_started = True  # before the probe: its own getter calls back here
        keep = torch.get_num_threads()
        try:
            _probe()(np.zeros(1, np.float32))
        finally:
            if torch.get_num_threads() != keep:
                torch.set_num_threads(keep)


def warm_up() -> None:
    """Pay numba's one-time start-up in this process: its import (about 0.15 s here) and the
    set-up of its JIT and parallel runtime on the first kernel it loads (about 0.17 s), by
    loading (or, with a cold cache, compiling once) a tiny parallel kernel with the options of
    every kernel; torch's thread count is kept (:func:`_start_runtime`).  Registered as the CPU
    warm-up of ``fxbackend.warm_up``."""
    _start_runtime()


def concurrency_blocker() -> str | None:
    """Why numba kernels must not be launched from two threads at once, or None: its
    ``workqueue`` threading layer is not thread-safe (``tbb`` and ``omp`` are).  Runs
    :func:`warm_up` first, since numba picks its layer at the first parallel launch."""
    warm_up()
    layer = sys.modules["numba"].threading_layer()
    if layer == "workqueue":
        return "numba's workqueue threading layer is not thread-safe (install tbb or use omp)"
    return None
