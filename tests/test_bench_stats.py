"""The statistics that decide the benchmarks' goals (scripts/benchstats.py): the
distribution-free interval of a median and the ahead / level / behind verdict; and what every
benchmark prints first (the CPU profile), the side-by-side profile (scripts/profile_steps.py)."""
from __future__ import annotations

import importlib.util
import math
import pathlib
import random

import pytest
from hypothesis import given, settings, strategies as st

_PATH = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "benchstats.py"
_spec = importlib.util.spec_from_file_location("benchstats", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_median_ci_order_statistics():
    # n = 15: P(B <= 3) = 576 / 32768 = 0.0176 <= 0.025 < P(B <= 4): the 4th and 12th values
    assert bench.median_ci(list(range(15))) == (3, 11)
    assert bench.median_ci(list(range(9))) == (1, 7)  # P(B <= 1) = 10 / 512
    assert bench.median_ci([5, 1, 4, 2, 3, 6]) == (1, 6)  # n = 6: P(B = 0) = 1 / 64
    assert all(math.isnan(v) for v in bench.median_ci([1, 2, 3, 4, 5]))  # no interval


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.5, 2.0), min_size=6, max_size=60))
def test_median_ci_contains_the_median(values):
    lo, hi = bench.median_ci(values)
    m = sorted(values)[(len(values) - 1) // 2]
    assert lo <= m <= hi and lo in values and hi in values


def test_median_ci_covers_the_true_median_at_least_95_percent():
    rng = random.Random(0)
    trials, hits = 2000, 0
    for _ in range(trials):
        lo, hi = bench.median_ci([rng.gauss(1.0, 0.05) for _ in range(15)])
        hits += lo <= 1.0 <= hi
    assert hits / trials >= 0.95  # exact coverage for n = 15: 1 - 2 * 0.0176 = 0.965


def test_verdicts():
    slow = {"ind": [1.0] * 15, "f": [0.9 + 0.001 * i for i in range(15)]}
    assert bench.verdict(slow, "ind", "f")[0] == "ahead"
    assert bench.verdict({"ind": slow["f"], "f": slow["ind"]}, "ind", "f")[0] == "behind"
    noisy = {"ind": [1.0] * 15, "f": [0.97, 1.03] * 7 + [1.0]}
    word, med, lo, hi = bench.verdict(noisy, "ind", "f")
    assert word == "level" and lo < 1 < hi and med == 1.0
    assert bench.verdict({"f": [1.0] * 15}, "ind", "f")[0] == "n/a"
    # five rounds give no interval: neither a lead nor a tie is shown
    assert bench.verdict({"ind": [1.0] * 5, "f": [0.5] * 5}, "ind", "f")[0] == "too few rounds"


def test_describe_and_goal_met():
    ahead, level, behind = ("ahead", 1.2, 1.1, 1.3), ("level", 1.0, 0.9, 1.1), \
        ("behind", 0.8, 0.7, 0.9)
    assert bench.describe(ahead) == "ahead 1.200 [1.100, 1.300]"
    assert bench.goal_met(ahead, level) and bench.goal_met(ahead) and bench.goal_met(ahead, ahead)
    assert not bench.goal_met(level, ahead) and not bench.goal_met(ahead, behind)
    few = ("too few rounds", 1.2, math.nan, math.nan)
    assert not bench.goal_met(ahead, few) and not bench.goal_met(few)
    assert bench.goal_word(ahead, level) == "met" and bench.goal_word(level) == "MISSED"
    assert bench.goal_word(ahead, few).startswith("undecided")


def test_source_commit_names_the_checkout(tmp_path):
    import shutil
    import subprocess
    if shutil.which("git") is None:
        assert bench.source_commit() is None
        return
    root = _PATH.parent.parent
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                          capture_output=True, text=True)
    if head.returncode != 0:  # an exported tree, not a checkout
        assert bench.source_commit() is None
        return
    got = bench.source_commit()
    assert got.split("-")[0] == head.stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                           capture_output=True, text=True).stdout.strip()
    assert got.endswith("-dirty") == bool(dirty)
    assert bench.source_commit(str(tmp_path)) is None  # no checkout there


def test_every_benchmark_prints_the_cpu_profile():
    """Each ``scripts/bench*.py`` prints :func:`cpu_header` (the CPU profile and the decisions
    taken from it), so every table it gives says which CPU class it was measured on."""
    import ast
    scripts = [_PATH.parent / "bench.py", *sorted(_PATH.parent.glob("bench_*.py"))]
    assert len(scripts) > 10
    missing = []
    for path in scripts:
        calls = {n.func.id for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        if "cpu_header" not in calls:
            missing.append(path.name)
    assert missing == []
    header = bench.cpu_header().splitlines()
    assert header[0].startswith("# cpu profile (")
    assert any(line.startswith("# cpu decision ") for line in header)


def test_the_side_by_side_profile_runs():
    """``scripts/profile_steps.py``: the profile header, one row per op, the rows for what no
    ATen op accounts for, and fxbackend's per-step report after the warm-up calls."""
    import subprocess
    import sys
    script = _PATH.parent / "profile_steps.py"
    out = subprocess.run([sys.executable, str(script), "--family", "flux", "--size", "tiny",
                          "--backends", "eager,fxbackend", "--calls", "2", "--warmup", "1",
                          "--top", "3", "--steps", "2"],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    lines = out.splitlines()
    assert lines[0].startswith("# cpu profile (") and "flux/tiny float32" in out
    table = lines[lines.index(next(ln for ln in lines if ln.endswith("op (ms per call)"))):]
    assert table[0].split()[:3] == ["eager", "fxbackend", "last-first"]
    assert all(ln.split()[3].startswith("aten::") for ln in table[1:4])
    for label in ("(not in an ATen op)", "(wall, profiled)"):
        row = next(ln for ln in table if ln.endswith(label)).split()
        assert float(row[2]) == pytest.approx(float(row[1]) - float(row[0]), abs=2e-3)
    assert "2 profiled call(s)" in out and "top 2 steps:" in out
