"""``fxbackend.precompile`` / ``python -m fxbackend precompile``: the kernels of the tiny model
configs land in the kernel cache, so that a later process compiling a model of those families
compiles no kernel of its own."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import fxbackend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: a child that compiles small Flux in float32 and prints how many kernels numba compiled and
#: saved to the cache (a cache miss compiles and saves; a hit loads)
_COUNT_SAVES = """
import json, torch, fxbackend
from numba.core import caching
from fxbackend import models
saved = []
real = caching.Cache.save_overload
def save(self, sig, data):
    saved.append(self._name)
    return real(self, sig, data)
caching.Cache.save_overload = save
model = models.build_model("flux", "small")
with torch.no_grad():
    torch.compile(model, backend="fxbackend")(**models.make_inputs("flux", "small"))
print(json.dumps(saved))
"""


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
    after = _child(_COUNT_SAVES, cache)
    assert after.returncode == 0, after.stderr[-3000:]
    saved = json.loads(after.stdout.strip().splitlines()[-1])
    assert saved == [], saved  # every kernel small Flux's plan uses was in the cache


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="dtypes must be among float32, bfloat16, float16"):
        fxbackend.precompile(dtypes="float64")
    with pytest.raises(ValueError, match="families must be among .*flux"):
        fxbackend.precompile(families=["flux", "nosuch"])
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        fxbackend.precompile(device="tpu")
    run = _child("", "", "-m", "fxbackend", "precompile", "--dtypes", "int8")
    assert run.returncode == 2 and "dtypes must be among" in run.stderr
