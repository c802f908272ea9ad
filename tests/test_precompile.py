"""``fxbackend.precompile`` / ``python -m fxbackend precompile``: the kernels of the tiny model
configs land in the kernel cache, so that a later process compiling a model of those families
compiles no kernel of its own (counted by ``scripts/bench_first_call.py``: an empty cache
compiles 8 for small Flux)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import fxbackend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def _child(code: str, cache: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache)
    return subprocess.run([sys.executable, *(["-c", code] if code else []), *args], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_precompiled_kernels_serve_a_full_size_model(tmp_path):
    cache = str(tmp_path / "kernels")
    run = _child("", cache, "-m", "fxbackend", "precompile", "--dtypes", "float32",
                 "--families", "flux", "--no-w8a8")
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"kernel cache: {cache}" in run.stdout and "flux/float32: " in run.stdout
    assert "precompiled 1 configs" in run.stdout
    assert any(name.endswith(".nbi") for _, _, names in os.walk(cache) for name in names)
    # small Flux's first call in a new process, counting the kernels numba compiles and saves
    after = _child("", cache, os.path.join(ROOT, "scripts", "bench_first_call.py"), "--cache",
                   cache, "--families", "flux", "--dtypes", "float32")
    assert after.returncode == 0, after.stderr[-3000:]
    line = after.stdout.strip().splitlines()[-1]
    assert line.startswith("flux/float32: first call") and "kernels compiled 0 " in line, line


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="dtypes must be among float32, bfloat16, float16"):
        fxbackend.precompile(dtypes="float64")
    with pytest.raises(ValueError, match="families must be among .*flux"):
        fxbackend.precompile(families=["flux", "nosuch"])
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        fxbackend.precompile(device="tpu")
    run = _child("", "", "-m", "fxbackend", "precompile", "--dtypes", "int8")
    assert run.returncode == 2 and "dtypes must be among" in run.stderr
