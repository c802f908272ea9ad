"""Backend services for extension kernels (fxbackend/services.py): cpu_parallel (pool width,
result order, errors, cancellation through Plan.cancel) and the CUDA context and cuBLAS handle.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

import fxbackend
from fxbackend import services
from fxbackend.services import Cancelled

from ext_util import LikeFirst, compiled, graph_of, reg, registry_guard, set_outputs  # noqa: F401

pytestmark = pytest.mark.usefixtures("registry_guard")


@pytest.fixture
def num_threads():
    """``num_threads(n)`` sets torch's thread count for the test; restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


class Concurrency:
    """Counts how many tasks run at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = self.peak = 0
        self.threads: set = set()

    def __enter__(self):
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
            self.threads.add(threading.get_ident())

    def __exit__(self, *exc):
        with self.lock:
            self.now -= 1


# -- cpu_parallel ---------------------------------------------------------------------------------

def test_results_come_back_in_task_order(num_threads):
    num_threads(2)

    def task(i):
        time.sleep((8 - i) * 0.002)  # later tasks finish first
        return i * i

    assert services.cpu_parallel(task, 8) == [i * i for i in range(8)]


def test_one_torch_thread_means_tasks_never_overlap(num_threads):
    num_threads(1)
    c = Concurrency()

    def task(i):
        with c:
            time.sleep(0.002)
        return i

    assert services.cpu_parallel(task, 12) == list(range(12))
    assert c.peak == 1 and len(c.threads) == 1
    assert threading.get_ident() not in c.threads, "tasks run on the backend's pool"


def test_the_pool_follows_torch_get_num_threads(num_threads):
    num_threads(1)
    services.cpu_parallel(lambda i: i, 3)
    num_threads(2)
    both = threading.Barrier(2, timeout=10)  # breaks unless two tasks run at once
    c = Concurrency()

    def task(i):
        with c:
            if i < 2:
                both.wait()
            time.sleep(0.002)

    services.cpu_parallel(task, 10)
    assert c.peak == 2, "at most torch.get_num_threads() tasks at once"


def test_the_first_error_propagates_and_stops_the_rest(num_threads):
    num_threads(1)
    ran = []

    def task(i):
        ran.append(i)
        if i in (2, 5):
            raise ValueError(f"task {i} failed")
        return i

    with pytest.raises(ValueError, match="task 2 failed"):
        services.cpu_parallel(task, 10)
    assert ran == [0, 1, 2]


def test_an_error_propagates_from_several_threads(num_threads):
    num_threads(2)

    def task(i):
        if i == 3:
            raise KeyError("task 3")
        return i

    with pytest.raises(KeyError, match="task 3"):
        services.cpu_parallel(task, 20)


def test_no_tasks_and_a_negative_count():
    called = []
    assert services.cpu_parallel(called.append, 0) == []
    with pytest.raises(ValueError, match="n_tasks must be >= 0, got -1"):
        services.cpu_parallel(called.append, -1)
    assert called == []


class Slow(LikeFirst):
    """A copy whose kernel fans out slow tasks with cpu_parallel."""

    name = "test.sv_slow.v1"


class ParallelCopy:
    name, op = "sv_parallel_copy", Slow.name

    def __init__(self, n_tasks: int, delay: float) -> None:
        self.n_tasks, self.delay = n_tasks, delay
        self.lock = threading.Lock()
        self.ran: list = []
        self.started = threading.Event()

    def supports(self, node):
        return True

    def execute(self, ctx, node, state, inputs, out, workspace):
        def task(i):
            self.started.set()
            time.sleep(self.delay)
            with self.lock:
                self.ran.append(i)

        services.cpu_parallel(task, self.n_tasks)
        out.copy_(inputs[0])


def test_cancelling_the_plan_stops_cpu_parallel_early(reg, num_threads):
    num_threads(2)
    reg.op(Slow)
    k = reg.kernel("cpu", ParallelCopy(n_tasks=40, delay=0.02))
    g, (x,) = graph_of((4, 3))
    set_outputs(g, fxbackend.op_create(g, Slow.name, [x], {}))
    cg = compiled(g)
    t = torch.randn(4, 3)
    plan = cg.plan_for((t,))

    def cancel_once_running():
        assert k.started.wait(10)
        plan.cancel()

    canceller = threading.Thread(target=cancel_once_running)
    canceller.start()
    try:
        with pytest.raises(Cancelled, match="cancelled"):
            cg(t)
    finally:
        canceller.join()
    assert 0 < len(k.ran) < 40, "tasks already running finish, the rest never start"

    k.ran.clear()  # a cancellation ends that call only
    assert torch.equal(cg(t)[0], t)
    assert sorted(k.ran) == list(range(40))


# -- CUDA -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("service", [services.cuda_context, services.cuda_blas])
def test_cuda_services_raise_without_cuda(monkeypatch, service):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        service()


@pytest.mark.cuda
def test_cuda_services_follow_the_current_stream():
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        ctx = services.cuda_context()
        assert ctx.device == torch.cuda.current_device()
        assert ctx.stream == torch.cuda.current_stream() == side
        assert services.cuda_blas() == torch.cuda.current_blas_handle()
    assert services.cuda_context().stream == torch.cuda.default_stream()


# -- warm-up ----------------------------------------------------------------------------------

def test_warm_up_runs_registered_start_ups_once_per_call(monkeypatch):
    monkeypatch.setattr(services, "_warm_ups", {})
    calls = []
    services.register_warm_up("cpu", "a", lambda: calls.append("a"))
    services.register_warm_up("cpu", "b", lambda: calls.append("b"))
    services.register_warm_up("cpu", "a", lambda: calls.append("a2"))  # same name: replaced
    services.register_warm_up("cuda", "c", lambda: calls.append("c"))
    spent = fxbackend.warm_up("cpu")
    assert calls == ["a2", "b"]
    assert list(spent) == ["cpu/a", "cpu/b"] and all(v >= 0 for v in spent.values())
    assert fxbackend.warm_up("meta") == {}  # nothing registered: nothing to do


def test_warm_up_rejects_bad_arguments():
    with pytest.raises(ValueError, match="device must be a device type"):
        services.register_warm_up("", "x", lambda: None)
    with pytest.raises(TypeError, match="fn must be callable"):
        services.register_warm_up("cpu", "x", 3)
    with pytest.raises(ValueError, match="device types such as 'cpu'"):
        fxbackend.warm_up(torch.device("cpu"))


def test_cpu_warm_up_starts_numba():
    from fxbackend.cpu_kernels import _numba
    spent = fxbackend.warm_up("cpu")
    assert "cpu/numba" in spent
    import sys
    assert "numba" in sys.modules
    probe = _numba._probe()
    assert probe.signatures, "the probe kernel is compiled (or loaded from the disk cache)"
    n = len(probe.signatures)
    fxbackend.warm_up("cpu")
    assert len(probe.signatures) == n == 1  # idempotent: nothing compiles again


_THREADS_SCRIPT = r"""
import sys, torch
torch.set_num_threads(1)
import fxbackend

seen = [torch.get_num_threads()]
if sys.argv[1] == "warm_up":
    fxbackend.warm_up("cpu")
else:  # a compiled call whose first numba kernel starts the parallel runtime
    x = torch.randn(8, 64)
    w = torch.randn(64)
    g = torch.compile(lambda x: torch.nn.functional.rms_norm(x, (64,), w, 1e-6),
                      backend="fxbackend")
    g(x)
seen.append(torch.get_num_threads())
print(seen)
"""


@pytest.mark.parametrize("how", ["warm_up", "compiled_call"])
def test_numba_runtime_start_keeps_torch_threads(how):
    # numba's omp layer shares the process's OpenMP runtime with torch; its start used to set
    # the thread count to NUMBA_NUM_THREADS, so torch.set_num_threads(1) was silently undone.
    # A fresh process: the runtime starts once per process.
    import os
    import subprocess
    import sys
    env = dict(os.environ, NUMBA_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT, how], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[1, 1]"
