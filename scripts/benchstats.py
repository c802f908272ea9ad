"""Statistics of the side-by-side benchmarks in this directory: rounds interleave the
implementations, so each round's ratio of two of them cancels the load a shared machine drifts
through between rounds; a goal is judged on the median of those ratios with a distribution-free
95% interval (:func:`verdict`)."""
from __future__ import annotations

import math
import os
import statistics


def paired_ratio(per_round: dict, num: str, den: str) -> float:
    """The median over rounds of ``num``'s time / ``den``'s time in the same round: a shared
    machine's load drifts between rounds, and the two calls of one round see the same load."""
    if num not in per_round or den not in per_round:
        return float("nan")
    return statistics.median(a / b for a, b in zip(per_round[num], per_round[den]))


def median_ci(values: list, level: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval for the median of ``values`` (independent
    rounds): the order statistics ``(x[k], x[n-1-k])`` with the largest k whose binomial(n, 1/2)
    tail ``P(B <= k)`` stays at most ``(1 - level) / 2``; ``(nan, nan)`` for fewer than 6
    values (no such k)."""
    xs = sorted(values)
    n = len(xs)
    tail, k, cdf = (1 - level) / 2, -1, 0.0
    for j in range(n):
        cdf += math.comb(n, j) / 2 ** n
        if cdf > tail:
            break
        k = j
    if k < 0:
        return float("nan"), float("nan")
    return xs[k], xs[n - 1 - k]


def verdict(per_round: dict, num: str, den: str) -> tuple[str, float, float, float]:
    """``(word, paired median, ci low, ci high)`` for ``num / den`` per round (``num`` the
    reference's time, ``den`` the fused step's): "ahead" when the 95% interval of the median
    lies above 1, "behind" when below, else "level" (no difference the rounds can show);
    "too few rounds" with fewer than 6 (no interval: neither a lead nor a tie is shown)."""
    if num not in per_round or den not in per_round:
        return "n/a", float("nan"), float("nan"), float("nan")
    ratios = [a / b for a, b in zip(per_round[num], per_round[den])]
    lo, hi = median_ci(ratios)
    if math.isnan(lo):
        return "too few rounds", statistics.median(ratios), lo, hi
    word = "ahead" if lo > 1 else "behind" if hi < 1 else "level"
    return word, statistics.median(ratios), lo, hi


def describe(v: tuple) -> str:
    """A :func:`verdict` as text: ``word median [low, high]``."""
    return f"{v[0]} {v[1]:.3f} [{v[2]:.3f}, {v[3]:.3f}]"


def goal_met(vs_eager: tuple, vs_inductor: tuple | None = None) -> bool:
    """The kernel benchmarks' goal on two verdicts (other's time / the kernel's): faster than
    eager ("ahead") and, when measured, not slower than Inductor (neither "behind" nor
    undecided)."""
    return vs_eager[0] == "ahead" and (vs_inductor is None or vs_inductor[0] in ("ahead", "level"))


def goal_word(vs_eager: tuple, vs_inductor: tuple | None = None) -> str:
    """:func:`goal_met` as the word a benchmark prints: "met", "MISSED", or "undecided (fewer
    than 6 rounds)" when a verdict had too few rounds to give an interval."""
    if any(v is not None and v[0] == "too few rounds" for v in (vs_eager, vs_inductor)):
        return "undecided (fewer than 6 rounds)"
    return "met" if goal_met(vs_eager, vs_inductor) else "MISSED"


def source_commit(path: str | None = None) -> str | None:
    """The git commit of the checkout holding ``path`` (default: this script's), with
    ``-dirty`` when tracked files differ from it; ``None`` outside a git checkout or without
    git.  Saved in the ``--json`` files so a table's figures can be traced to their code."""
    import subprocess
    here = path or os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here,
                              capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def cpu_header() -> str:
    """The CPU profile the figures come from and the decisions taken from it
    (``fxbackend.cpu_profile()``): the first lines every benchmark prints, so a table says
    which CPU class it was measured on."""
    return "\n".join("# " + line for line in cpu_lines())


def cpu_lines() -> list[str]:
    """The lines of :func:`cpu_header` without the comment marks (``--json`` files keep them)."""
    import fxbackend
    return list(fxbackend.cpu_profile().report_lines())
