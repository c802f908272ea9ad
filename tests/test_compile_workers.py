"""Cold kernels compiled in worker processes (cpu_kernels/_workers.py): the kernels a worker
compiles are the ones this process would have (same bits), warm calls never start a worker,
``FXB_COMPILE_PROCESSES=0`` and a worker that cannot start compile everything in the process.

Each case runs in a fresh process with a fresh kernel cache: what ran where is per process."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from fxbackend.cpu_kernels import _numba, _workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# three cold compile calls on a plan's two compile threads (planning.run_on_passing_threads),
# then the kernels run; prints what ran where, the warnings and a digest of each output
_CHILD = r"""
import hashlib, json, sys, warnings, torch
torch.set_num_threads(2)
if sys.argv[1] == "no-python":
    sys.executable = "/nonexistent/python"
from fxbackend.planning import run_on_passing_threads
from fxbackend.cpu_kernels import _workers, activation, rmsnorm
f = torch.float32
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    run_on_passing_threads([lambda: activation.compile_kernels(f, "silu", False),
                            lambda: activation.compile_kernels(f, "gelu", False),
                            lambda: rmsnorm.compile_kernels(f, f)])
g = torch.Generator().manual_seed(0)
x = torch.randn(64, 256, generator=g) * 4
w = torch.randn(256, generator=g)
outs = [activation.activate_cpu(x.clone(), "silu"), activation.activate_cpu(x.clone(), "gelu"),
        rmsnorm.rms_norm_cpu(x, w, 1e-6)]
ref = torch.nn.functional.rms_norm(x, (256,), w, 1e-6)
# what this process's numba dispatchers compiled (misses) or loaded from the disk cache (hits)
disps = [activation._jit("silu")[0], activation._jit("gelu")[0], rmsnorm._jit()]
print(json.dumps({"counts": _workers.counts(),
                  "hits": sum(sum(d.stats.cache_hits.values()) for d in disps),
                  "misses": sum(sum(d.stats.cache_misses.values()) for d in disps),
                  "warnings": [str(c.message) for c in caught
                               if "compile worker" in str(c.message)],
                  "digests": [hashlib.sha256(o.numpy().tobytes()).hexdigest() for o in outs],
                  "rms_err": (outs[2] - ref).abs().max().item()}))
"""


def _run(cache, processes: str, mode: str = "plain") -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), FXB_COMPILE_PROCESSES=processes)
    run = subprocess.run([sys.executable, "-c", _CHILD, mode], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_cold_kernels_compile_in_a_worker_to_the_same_bits(tmp_path):
    shared = _run(tmp_path / "shared", "1")
    c = shared["counts"]
    assert c["started"] == 1 and c["workers"] >= 1 and c["here"] >= 1, c
    assert c["here"] + c["workers"] == 3 and c["warm"] == 0 and shared["warnings"] == []
    assert shared["rms_err"] <= 1e-5
    # the kernels compiled here are compiled by this process's dispatchers; the workers' are
    # loaded from the disk cache when they first run
    assert (shared["misses"], shared["hits"]) == (c["here"], c["workers"])
    here = _run(tmp_path / "here", "0")
    assert here["counts"] == {"warm": 0, "here": 3, "workers": 0, "started": 0}
    assert (here["misses"], here["hits"]) == (3, 0)
    assert here["digests"] == shared["digests"]
    # a new process with the cache the worker filled: every call warm, no worker started
    again = _run(tmp_path / "shared", "1")
    assert again["counts"] == {"warm": 3, "here": 0, "workers": 0, "started": 0}
    assert (again["misses"], again["hits"]) == (0, 3)
    assert again["digests"] == shared["digests"]


def test_a_worker_that_cannot_start_leaves_the_kernels_to_this_process(tmp_path):
    got = _run(tmp_path / "cache", "1", mode="no-python")
    assert got["counts"]["workers"] == 0 and got["counts"]["started"] == 0
    assert got["counts"]["here"] == 3
    assert len(got["warnings"]) == 1, got["warnings"]
    assert "cannot start /nonexistent/python" in got["warnings"][0]
    assert got["rms_err"] <= 1e-5


def test_a_worker_replies_with_the_error_and_takes_the_next_request():
    _numba.import_numba()
    worker = _workers._Worker()
    try:
        why = worker.call(("fxbackend.cpu_kernels.nosuch", "compile_kernels", (), {}))
        assert why is not None and why.startswith("ModuleNotFoundError"), why
        assert worker.call(("fxbackend.cpu_kernels.rmsnorm", "compile_kernels",
                            (torch.float32, torch.float32), {})) is None
    finally:
        worker.close()
    assert worker.proc.wait(timeout=30) == 0


@pytest.mark.parametrize("value", ["two", "-1", "1.5"])
def test_a_bad_worker_count_is_named(monkeypatch, value):
    monkeypatch.setenv("FXB_COMPILE_PROCESSES", value)
    with pytest.raises(ValueError, match=rf"FXB_COMPILE_PROCESSES must be an integer >= 0 "
                                         rf".*got '{value}'"):
        _workers.max_workers()


def test_worker_count_from_the_environment_and_the_threads(monkeypatch):
    monkeypatch.setenv("FXB_COMPILE_PROCESSES", "3")
    assert _workers.max_workers() == 3
    monkeypatch.setenv("FXB_COMPILE_PROCESSES", "0")
    assert _workers.max_workers() == 0
    monkeypatch.delenv("FXB_COMPILE_PROCESSES", raising=False)
    keep = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # one thread: the plan's compile pass has no second lane
        assert _workers.max_workers() == 0
    finally:
        torch.set_num_threads(keep)


def test_threads_importing_numba_at_once_all_get_it(tmp_path):
    """The compile pass's threads reach ``import_numba`` together (a marker's lookup needs
    numba's cache folder): none may find numba half-imported."""
    code = ("import sys, threading\n"
            "from fxbackend.cpu_kernels import _numba\n"
            "assert 'numba' not in sys.modules\n"
            "gate, errors = threading.Barrier(8), []\n"
            "def run():\n"
            "    gate.wait()\n"
            "    try:\n"
            "        _numba.import_numba()\n"
            "    except Exception as e:\n"
            "        errors.append(repr(e))\n"
            "threads = [threading.Thread(target=run) for _ in range(8)]\n"
            "[t.start() for t in threads]\n"
            "[t.join() for t in threads]\n"
            "print(errors)\n")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    env.pop("NUMBA_CACHE_DIR", None)
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "[]"
