"""The vectorisable float32 functions of ``cpu_kernels/_vmath.py`` (exp, tanh, erf, SiLU and the
FMA they are built on), jitted in a loop as the kernels call them, against float64 maths."""
from __future__ import annotations

import math

import numpy as np
import pytest

from fxbackend.cpu_kernels import _numba, _vmath


@pytest.fixture(scope="module")
def loops():
    numba = _numba.import_numba()
    _vmath.register()

    def make(fn):
        def loop(x, out):
            for i in range(x.size):
                out[i] = fn(x[i])
        return numba.njit(error_model="numpy")(loop)

    def fma_loop(a, b, c, out):
        for i in range(a.size):
            out[i] = _vmath._fma(a[i], b[i], c[i])

    return {"exp": make(_vmath._expf), "exp_normal": make(_vmath._exp_normal),
            "tanh": make(_vmath._tanhf), "erf": make(_vmath._erff),
            "silu": make(_vmath._silu), "fma": numba.njit(fma_loop)}


def _run(loop, x):
    out = np.empty_like(x)
    loop(x, out)
    return out


def _ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Distance in float32 units in the last place of ``want`` (rounded to float32)."""
    w32 = want.astype(np.float32)
    spacing = np.spacing(np.abs(w32)).astype(np.float64)
    return np.abs(got.astype(np.float64) - want) / spacing


_X = np.concatenate([np.linspace(-20, 20, 400_001, dtype=np.float32),
                     np.random.default_rng(0).standard_normal(20_000).astype(np.float32) * 4])


def test_fma_rounds_once(loops):
    a = np.array([1 + 2.0 ** -23, 3.0], np.float32)
    b = np.array([1 - 2.0 ** -23, 0.5], np.float32)
    c = np.array([-1.0, 0.25], np.float32)
    out = np.empty_like(a)
    loops["fma"](a, b, c, out)
    # a * b = 1 - 2^-46 exactly: a separate multiply rounds it to 1.0 and the sum to 0
    assert out[0] == np.float32(-(2.0 ** -46)) and out[1] == np.float32(1.75)


def test_exp_within_two_ulp_and_ieee_at_the_ends(loops):
    x = np.concatenate([_X, np.linspace(-103, 88.7, 100_001, dtype=np.float32)])
    got = _run(loops["exp"], x)
    want = np.exp(x.astype(np.float64))
    kept = x >= -87
    assert _ulps(got[kept], want[kept]).max() <= 2
    assert (got[~kept] == 0).all()  # never a subnormal (want < 1.7e-38 there)
    assert want[~kept].max() < 1.7e-38
    ends = np.array([-np.inf, -200.0, 200.0, np.inf, np.nan, 0.0, -0.0, 88.72, 88.73],
                    np.float32)
    got = _run(loops["exp"], ends)
    assert got[0] == 0 and got[1] == 0 and np.isposinf(got[2]) and np.isposinf(got[3])
    assert np.isnan(got[4]) and got[5] == 1 and got[6] == 1
    assert np.isfinite(got[7]) and np.isposinf(got[8])


def test_exp_normal_is_exp_on_its_range(loops):
    # erf's exp(-x * x) and tanh's exp(2|u|) without the clamps: the same bits as _expf on
    # [-87, 88], ends included
    x = np.concatenate([np.linspace(-87, 88, 400_001, dtype=np.float32),
                        -np.abs(_X[np.abs(_X) <= 9.3]) ** 2, 2 * np.abs(_X[np.abs(_X) <= 44]),
                        np.array([-87.0, -86.99999, -81.0, -1e-30, -0.0, 0.0, 87.99999, 88.0],
                                 np.float32)])
    assert (x >= -87).all() and (x <= 88).all()
    got = _run(loops["exp_normal"], x)
    assert np.array_equal(got, _run(loops["exp"], x))
    assert np.isfinite(got).all() and (got > 0).all()
    assert np.isnan(_run(loops["exp_normal"], np.array([np.nan], np.float32))).all()


def test_tanh_within_three_ulp(loops):
    got = _run(loops["tanh"], _X)
    want = np.tanh(_X.astype(np.float64))
    big = np.abs(want) >= 1e-30
    assert _ulps(got[big], want[big]).max() <= 3
    ends = _run(loops["tanh"], np.array([-np.inf, np.inf, np.nan, 0.0, 1e-30], np.float32))
    assert ends[0] == -1 and ends[1] == 1 and np.isnan(ends[2]) and ends[3] == 0
    assert ends[4] == np.float32(1e-30)


def test_erf_absolute_error(loops):
    got = _run(loops["erf"], _X)
    want = np.array([math.erf(v) for v in _X.astype(np.float64)])
    # Abramowitz-Stegun 7.1.26: |error| <= 1.5e-7 in exact arithmetic; in float32 the
    # cancellation in 1 - t * r * exp(-x^2) near 0 adds about 3e-7 (4.5e-7 at x = -0.034 when
    # written; torch's erf GELU is 1.1e-6 from the exact one here)
    assert np.abs(got - want).max() < 5e-7
    ends = _run(loops["erf"], np.array([-np.inf, np.inf, 0.0, 9.0, -30.0, np.nan], np.float32))
    assert ends[0] == -1 and ends[1] == 1 and ends[2] == 0 and ends[3] == 1 and ends[4] == -1
    assert np.isnan(ends[5])


def test_silu_relative_error(loops):
    got = _run(loops["silu"], _X)
    x64 = _X.astype(np.float64)
    want = x64 / (1 + np.exp(-x64))
    nz = np.abs(want) > 1e-30
    assert (np.abs(got[nz] - want[nz]) / np.abs(want[nz])).max() < 4e-7
    ends = _run(loops["silu"], np.array([-np.inf, np.inf, -200.0, 200.0], np.float32))
    assert np.isnan(ends[0]) or ends[0] == 0  # -inf / inf: as torch's x / (1 + exp(-x))
    assert np.isposinf(ends[1]) and ends[2] == 0 and ends[3] == 200


def test_wide_vector_features(monkeypatch):
    import llvmlite.binding as llvm
    monkeypatch.delenv("NUMBA_CPU_NAME", raising=False)  # its own case, below

    class Features:
        def __init__(self, s):
            self.s = s

        def flatten(self):
            return self.s

    monkeypatch.setattr(llvm, "get_host_cpu_features", lambda: Features("+avx2,+avx512f,+fma"))
    assert _numba.wide_vector_features() == "+avx2,+avx512f,+fma,-prefer-256-bit"
    monkeypatch.setattr(llvm, "get_host_cpu_features", lambda: Features("+avx2,-avx512f,+fma"))
    assert _numba.wide_vector_features() is None

    def fail():
        raise RuntimeError("no host features")
    monkeypatch.setattr(llvm, "get_host_cpu_features", fail)
    assert _numba.wide_vector_features() is None


@pytest.mark.parametrize("user", [None, "+sse2"])
def test_import_numba_sets_the_features_unless_the_user_did(user, tmp_path):
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CPU_FEATURES"}
    env["NUMBA_CACHE_DIR"] = str(tmp_path)
    if user is not None:
        env["NUMBA_CPU_FEATURES"] = user
    code = ("from fxbackend.cpu_kernels import _numba; n = _numba.import_numba(); "
            "print(repr(n.config.CPU_FEATURES)); print(repr(_numba.wide_vector_features()))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    configured, wide = res.stdout.split("\n")[:2]
    assert configured == (repr(user) if user is not None else wide)


def test_a_named_cpu_compiles_for_its_own_features(monkeypatch):
    """``NUMBA_CPU_NAME=haswell`` on an AVX-512 host: no host features are added (numba would
    add them, and the kernels would use AVX-512)."""
    import llvmlite.binding as llvm

    class Features:
        def flatten(self):
            return "+avx2,+avx512f,+fma"

    monkeypatch.setattr(llvm, "get_host_cpu_features", lambda: Features())
    monkeypatch.setenv("NUMBA_CPU_NAME", "haswell")
    assert _numba.wide_vector_features() == ""
