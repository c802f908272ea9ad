"""Cold kernels compiled in worker processes, side by side: ``@compiles`` and
``FXB_COMPILE_PROCESSES``.

numba compiles one kernel at a time in a process (its compiler holds a global lock), and a
kernel of this package takes 1-5 s to compile, so a plan whose kernels are not in the disk
cache yet would spend most of its first call compiling them one after the other.  A plan
compiles its nodes on several threads (``planning.compile_kernels``); here a thread whose
kernel is cold, while another thread compiles in this process, hands the kernel to a worker
process, which compiles it into the shared disk cache.  This process loads it from there when
it first runs it (or calls the compile function again), in milliseconds.

Contract of :func:`compiles`: it decorates a module-level function of a kernel module that
compiles (or loads from the disk cache) kernels, whose arguments are picklable (dtypes, str,
bool, None, tuples of them) and whose result is None.  A call is **warm** when a marker file
says the same call completed with this cache folder, numba version and target CPU
(:func:`_marker`), and runs here.  Of the **cold** calls, one at a time runs here (one slot),
the others go to a worker (an idle one, a new one up to :func:`max_workers`, else the first
to finish); without workers, or when a worker cannot be started or fails (a warning, once per
process), the call runs here, after the slot's (numba's lock), so results never depend on the
workers.  Two threads with the same cold call: the second returns at once (the first completes
it before the plan's compile pass ends).  The first cold call starts a worker at once, so that
it is ready for the next.  numba keeps one index file per
kernel function, rewritten whole by each save: two processes saving signatures of one function
at the same instant can lose one entry, and that signature then compiles again where it is
next used (a slower first use, never a wrong kernel).

Workers are ``python -c`` processes (not ``multiprocessing``, which would import the user's
``__main__`` again) with the parent's environment, numba's cache folder and target CPU, one
thread each, taking one request at a time over stdin/stdout; a worker leaves after
:data:`IDLE_S` without a request, or when this process ends.  ``FXB_COMPILE_PROCESSES=N``
bounds the workers (0: every kernel compiles in this process); the default is one fewer than
the cores this process may use or ``torch.get_num_threads()``, whichever is smaller.
"""
from __future__ import annotations

import atexit
import functools
import hashlib
import os
import pickle
import select
import struct
import subprocess
import sys
import tempfile
import threading
import warnings
from typing import Callable

__all__ = ["compiles", "max_workers", "counts", "IDLE_S", "REPLY_TIMEOUT_S"]

#: seconds a worker waits for its next request before it leaves
IDLE_S = 30.0
#: seconds a request may take before its worker is given up (and the call compiles here)
REPLY_TIMEOUT_S = 600.0

_state = threading.Condition()  # guards everything below; notified when a worker frees up
_slot = threading.Lock()  # held by the cold call compiling in this process
_done: set = set()  # keys of the calls completed in this process or a worker
_key_locks: dict = {}
_idle: list = []  # workers waiting for a request
_live: list = []  # every worker started and not known to have left
_starting = 0  # workers being started
_counts = {"warm": 0, "here": 0, "workers": 0, "started": 0}
_warned = False


def counts() -> dict:
    """How this process's ``@compiles`` calls ran so far (each call counted once per
    process): ``warm`` (here, the disk cache warm), ``here`` (cold, in this process),
    ``workers`` (cold, in a worker), and ``started`` (workers started).  A copy."""
    with _state:
        return dict(_counts)


def max_workers() -> int:
    """The most workers this process runs at once: ``FXB_COMPILE_PROCESSES`` when set (an int
    >= 0; ValueError naming the variable otherwise), else the number of cores this process may
    run on or ``torch.get_num_threads()``, whichever is smaller, minus one."""
    raw = os.environ.get("FXB_COMPILE_PROCESSES", "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            n = -1
        if n < 0:
            raise ValueError(f"FXB_COMPILE_PROCESSES must be an integer >= 0 (worker processes "
                             f"that compile kernels; 0: none), got {raw!r}")
        return n
    import torch
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(0, min(cores, torch.get_num_threads()) - 1)


def _marker(key: tuple) -> str | None:
    """The marker file of a completed call: in numba's cache folder, named after the call and
    what numba's disk cache keys a kernel on besides its source (numba's version, the folder,
    the target CPU's name and features); None when numba caches nowhere."""
    from ._numba import import_numba
    cfg = import_numba().config
    if not cfg.CACHE_DIR:
        return None
    target = (sys.modules["numba"].__version__, cfg.CACHE_DIR, cfg.CPU_NAME, cfg.CPU_FEATURES)
    digest = hashlib.sha256(repr(key + target).encode()).hexdigest()[:24]
    return os.path.join(cfg.CACHE_DIR, "fxbackend-compiled", digest)


def _mark(path: str) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w"):
            pass
    except OSError:  # a cache folder not writable: the next process compiles again
        return


def compiles(fn: Callable[..., None]) -> Callable[..., None]:
    """Decorate a kernel module's compile function (module docstring: its contract and how
    its cold calls share out between this process and worker processes)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        key = (fn.__module__, fn.__qualname__, repr(args), repr(sorted(kwargs.items())))
        with _state:
            if key in _done:  # loaded here, or in the disk cache for this process's first run
                return None
            lock = _key_locks.setdefault(key, threading.Lock())
        if not lock.acquire(blocking=False):
            # another thread is on it, here or in a worker: done before the compile pass ends
            return None
        try:
            with _state:
                if key in _done:
                    return None
            marker = _marker(key)
            if marker is None:  # no disk cache to share: everything compiles here
                return fn(*args, **kwargs)
            if os.path.exists(marker):
                fn(*args, **kwargs)
                kind = "warm"
            elif _slot.acquire(blocking=False):
                try:
                    _prestart()  # a worker gets ready for the next cold call meanwhile
                    fn(*args, **kwargs)
                finally:
                    _slot.release()
                kind = "here"
            else:
                kind = "workers" if _in_worker(fn, args, kwargs) else "here"
                if kind == "here":
                    fn(*args, **kwargs)  # after the slot's call (numba's lock)
            _mark(marker)
            with _state:
                _done.add(key)
                _counts[kind] += 1
        finally:
            lock.release()
        return None

    wrapper.__wrapped__ = fn
    return wrapper


# -- workers ------------------------------------------------------------------------------------

_WORKER = "from fxbackend.cpu_kernels._workers import _serve; _serve()"


class _Worker:
    """One worker process and its pipes (started by the constructor)."""

    def __init__(self) -> None:
        cfg = sys.modules["numba"].config
        env = dict(os.environ, FXB_COMPILE_PROCESSES="0", OMP_NUM_THREADS="1",
                   NUMBA_NUM_THREADS="1", NUMBA_CACHE_DIR=cfg.CACHE_DIR)
        if os.environ.get("NUMBA_CPU_NAME") is None and cfg.CPU_NAME:
            env["NUMBA_CPU_NAME"] = cfg.CPU_NAME
        if cfg.CPU_FEATURES is not None:
            env["NUMBA_CPU_FEATURES"] = cfg.CPU_FEATURES
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env,
                                     close_fds=True)

    def call(self, request: tuple) -> str | None:
        """Run one request; None when it completed, else why not: the error the request raised
        in the worker, or the worker's failure (it is then closed)."""
        try:
            data = pickle.dumps(request)
            self.proc.stdin.write(struct.pack("<Q", len(data)) + data)
            self.proc.stdin.flush()
            fd = self.proc.stdout.fileno()
            if not select.select([fd], [], [], REPLY_TIMEOUT_S)[0]:
                self.proc.kill()
                return f"no reply in {REPLY_TIMEOUT_S:.0f} s ({self._gone()})"
            head = _read(fd, 8)
            if len(head) < 8:
                return f"the worker exited ({self._gone()})"
            reply = pickle.loads(_read(fd, struct.unpack("<Q", head)[0]))
        except (OSError, ValueError, pickle.PickleError, EOFError) as e:
            return f"{type(e).__name__}: {e} ({self._gone()})"
        return reply

    def _gone(self) -> str:
        """Close the worker; its exit status and the end of what it wrote to stderr."""
        self.close()
        try:
            self.proc.wait(timeout=5)
            self.log.seek(0)
            tail = self.log.read()[-2000:].decode(errors="replace").strip()
        except Exception:  # a worker that does not exit, a log that cannot be read
            tail = ""
        return f"exit status {self.proc.returncode}" + (f": {tail}" if tail else "")

    def close(self) -> None:
        try:
            self.proc.stdin.close()  # the worker leaves at the end of its input
        except OSError:
            pass


def _start() -> _Worker | None:
    """Start a worker reserved in ``_starting``; None (and a warning) when it cannot be."""
    global _starting
    try:
        worker = _Worker()
    except OSError as e:
        worker = None
        _warn(f"cannot start {sys.executable}: {e}")
    with _state:
        _starting -= 1
        if worker is not None:
            _live.append(worker)
            _counts["started"] += 1
        _state.notify_all()
    return worker


def _prestart() -> None:
    """Start a worker in the background when none is running or starting (the first cold call
    of a compile pass: the next is likely to want one)."""
    global _starting
    with _state:
        if _live or _starting or _warned or max_workers() == 0:
            return
        _starting += 1

    def run() -> None:
        worker = _start()
        if worker is not None:
            with _state:
                _idle.append(worker)
                _state.notify_all()

    threading.Thread(target=run, name="fxbackend-compile-worker-start", daemon=True).start()


def _take() -> _Worker | None:
    """An idle worker, a new one, or (all busy, none may be added) the first to be free; None
    when none can be had."""
    global _starting
    limit = max_workers()
    with _state:
        while True:
            while _idle and _idle[-1].proc.poll() is not None:  # left after IDLE_S
                _live.remove(_idle.pop())
            if _idle:
                return _idle.pop()
            if _warned or limit == 0:
                return None
            if len(_live) + _starting < limit:
                _starting += 1
                break
            _state.wait()
    return _start()


def _in_worker(fn: Callable, args: tuple, kwargs: dict) -> bool:
    """Run ``fn(*args, **kwargs)`` in a worker; False when no worker took it."""
    worker = _take()
    if worker is None:
        return False
    why = worker.call((fn.__module__, fn.__qualname__, args, kwargs))
    with _state:
        if why is None:
            _idle.append(worker)
        elif worker in _live:
            _live.remove(worker)
        _state.notify_all()
    if why is not None:
        worker.close()
        _warn(f"{fn.__module__}.{fn.__qualname__}: {why}")
    return why is None


def _warn(why: str) -> None:
    """Warn once per process that workers failed; no worker is used after that."""
    global _warned
    with _state:
        first, _warned = not _warned, True
        _state.notify_all()
    if first:
        warnings.warn(f"fxbackend: a kernel compile worker failed; kernels compile in this "
                      f"process from now on ({why})", RuntimeWarning, stacklevel=3)


@atexit.register
def _close_all() -> None:
    with _state:
        for worker in _live:
            worker.close()
        _live.clear()
        _idle.clear()


def _read(fd: int, n: int) -> bytes:
    """``n`` bytes from ``fd``, fewer at its end."""
    chunks = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            break
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _serve() -> None:
    """A worker's loop: requests ``(module, name, args, kwargs)`` from stdin, each run
    undecorated, replies (None, or the error) to stdout; leaves at the end of its input or
    after :data:`IDLE_S` without one.  Anything else printed goes to stderr."""
    import importlib
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    while select.select([0], [], [], IDLE_S)[0]:
        head = _read(0, 8)
        if len(head) < 8:
            return
        module, name, args, kwargs = pickle.loads(_read(0, struct.unpack("<Q", head)[0]))
        try:
            getattr(importlib.import_module(module), name).__wrapped__(*args, **kwargs)
            reply = None
        except BaseException as e:  # the parent compiles it again and sees the error there
            reply = f"{type(e).__name__}: {e}"
        data = pickle.dumps(reply)
        out.write(struct.pack("<Q", len(data)) + data)
        out.flush()
