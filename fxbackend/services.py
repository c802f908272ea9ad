"""Backend services for extension kernels.

- :func:`cpu_parallel`: run ``fn(i)`` for ``i in range(n_tasks)`` on the backend's thread pool
  (its size follows ``torch.get_num_threads()``); stops early with :class:`Cancelled` when the
  running plan is cancelled (``Plan.cancel()``, from any thread).
- :func:`cuda_context`: the device index and current stream a kernel must use.
- :func:`cuda_blas`: the current stream's cuBLAS handle.  Borrowed: never retain it, destroy it
  or change its settings (math mode, workspace, stream).
- :func:`register_warm_up` / :func:`warm_up`: one-time start-up costs of the runtimes kernels
  use (numba's import and JIT set-up, Triton's import), paid when the user chooses (a server's
  start-up) instead of inside the first compiled call.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from typing import Any, Callable

import torch

__all__ = ["cpu_parallel", "cuda_context", "cuda_blas", "Cancelled", "CancelToken",
           "current_token", "running", "register_warm_up", "warm_up",
           "register_concurrency_check", "concurrency_blocker"]


class Cancelled(RuntimeError):
    """The running plan was cancelled."""


class CancelToken:
    """Set by ``Plan.cancel()``; checked by :func:`cpu_parallel` between tasks."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()


_local = threading.local()
_pool_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_size = 0


def current_token() -> CancelToken | None:
    """The cancel token of the plan running on this thread, if any."""
    return getattr(_local, "token", None)


class running:
    """Context manager: mark ``token`` as the running plan's on this thread."""

    def __init__(self, token: CancelToken) -> None:
        self.token = token

    def __enter__(self):
        self.prev = getattr(_local, "token", None)
        _local.token = self.token
        return self.token

    def __exit__(self, *exc):
        _local.token = self.prev


def _get_pool() -> tuple[concurrent.futures.ThreadPoolExecutor, int]:
    global _pool, _pool_size
    n = max(1, torch.get_num_threads())
    with _pool_lock:
        if _pool is None or _pool_size != n:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="fxbackend")
            _pool_size = n
        return _pool, n


def cpu_parallel(fn: Callable[[int], Any], n_tasks: int) -> list:
    """Run ``fn(i)`` for every ``i < n_tasks`` on the thread pool; returns the results in order.

    At most ``torch.get_num_threads()`` tasks run at once.  The first error (or cancellation of
    the running plan, raised as :class:`Cancelled`) stops tasks not yet started and propagates.
    The pool's threads are kept: a task that launches an OpenMP-parallel kernel (torch's or
    numba's) leaves an OpenMP team on its thread, and once teams outnumber the cores every
    parallel launch of the process pays for waking its workers: launch such kernels from the
    calling thread instead.
    """
    if n_tasks < 0:
        raise ValueError(f"cpu_parallel: n_tasks must be >= 0, got {n_tasks}")
    token = current_token()
    if n_tasks == 0:
        return []
    if threading.current_thread().name.startswith("fxbackend"):
        # called from inside a pool task: run inline rather than wait on our own pool
        out = []
        for i in range(n_tasks):
            if token is not None and token.cancelled:
                raise Cancelled("the plan was cancelled")
            out.append(fn(i))
        return out
    pool, width = _get_pool()
    results: list = [None] * n_tasks
    stop = threading.Event()
    lock = threading.Lock()
    next_task = [0]
    errors: list[BaseException] = []

    def worker() -> None:
        while not stop.is_set():
            with lock:
                i = next_task[0]
                next_task[0] += 1
            if i >= n_tasks:
                return
            if token is not None and token.cancelled:
                errors.append(Cancelled("the plan was cancelled"))
                stop.set()
                return
            try:
                results[i] = fn(i)
            except BaseException as e:  # propagate the first error, stop the rest
                errors.append(e)
                stop.set()
                return

    futures = [pool.submit(worker) for _ in range(min(width, n_tasks))]
    concurrent.futures.wait(futures)
    if errors:
        raise errors[0]
    return results


@dataclasses.dataclass(frozen=True)
class CudaContext:
    """The device index and the stream a CUDA kernel must launch on."""

    device: int
    stream: Any


def cuda_context() -> CudaContext:
    """The current CUDA device index and its current stream (RuntimeError without CUDA)."""
    if not torch.cuda.is_available():
        raise RuntimeError("cuda_context(): CUDA is not available on this machine")
    dev = torch.cuda.current_device()
    return CudaContext(dev, torch.cuda.current_stream(dev))


def cuda_blas() -> int:
    """The cuBLAS handle of the current stream (borrowed: do not retain, destroy or configure
    it).  RuntimeError without CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError("cuda_blas(): CUDA is not available on this machine")
    return torch.cuda.current_blas_handle()


# device type -> {name: fn}; a dict keeps registration order and makes re-registration idempotent
_warm_ups: dict[str, dict[str, Callable[[], Any]]] = {}
_warm_lock = threading.Lock()


def register_warm_up(device: str, name: str, fn: Callable[[], Any]) -> None:
    """Register ``fn()``, the one-time start-up of a kernel runtime on ``device`` ("cpu",
    "cuda"), under ``name`` (registering a name again replaces its function).  ``fn`` must be
    idempotent and cheap after its first call; it runs only when :func:`warm_up` is called
    (kernels never rely on it: each still initialises what it needs when it compiles)."""
    if not isinstance(device, str) or not device:
        raise ValueError(f"register_warm_up: device must be a device type such as 'cpu' or "
                         f"'cuda', got {device!r}")
    if not callable(fn):
        raise TypeError(f"register_warm_up({device!r}, {name!r}): fn must be callable, got "
                        f"{type(fn).__name__}")
    with _warm_lock:
        _warm_ups.setdefault(device, {})[name] = fn


def warm_up(*devices: str) -> dict[str, float]:
    """Pay the registered one-time start-up costs now, for ``devices`` (default: "cpu", and
    "cuda" when CUDA is available), e.g. at a server's start-up so that the first compiled call
    does not carry them.  Returns ``{"device/name": seconds}`` for each warm-up run.  Optional:
    without it the same costs land on the first call that needs them."""
    if not devices:
        devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    import time
    spent: dict[str, float] = {}
    for dev in devices:
        if not isinstance(dev, str):
            raise ValueError(f"warm_up: devices are device types such as 'cpu', got {dev!r}")
        with _warm_lock:
            fns = list(_warm_ups.get(dev, {}).items())
        for name, fn in fns:
            t0 = time.perf_counter()
            fn()
            spent[f"{dev}/{name}"] = time.perf_counter() - t0
    return spent


_concurrency_checks: dict[str, Callable[[], "str | None"]] = {}


def register_concurrency_check(name: str, fn: Callable[[], "str | None"]) -> None:
    """Register ``fn() -> reason or None``: why the CPU steps of a kernel runtime must not run
    from two threads at once right now (e.g. numba's workqueue threading layer), else None.
    Plans consult every check before running branches concurrently on the CPU."""
    if not callable(fn):
        raise TypeError(f"register_concurrency_check({name!r}): fn must be callable")
    _concurrency_checks[name] = fn


def concurrency_blocker() -> str | None:
    """The first reason a registered runtime gives against concurrent CPU branches, or None."""
    for name, fn in list(_concurrency_checks.items()):
        why = fn()
        if why:
            return f"{name}: {why}"
    return None
