"""Command line: ``python -m fxbackend demo`` (what ``make demo`` runs).

``demo`` builds a small diffusers Flux transformer from a config with random weights (nothing is
downloaded), compiles it with ``torch.compile(backend="fxbackend")``, checks it against eager,
and prints the backend's stats and the speed against eager.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time


def _median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def demo(argv: list[str]) -> int:
    """Compile a diffusers model with fxbackend, compare with eager, print stats and speed."""
    p = argparse.ArgumentParser(prog="python -m fxbackend demo", description=demo.__doc__)
    p.add_argument("--family", default="flux", help="flux, sd3, pixart or unet")
    p.add_argument("--size", default="small", help="tiny or small")
    p.add_argument("--repeat", type=int, default=10, help="timed calls per backend")
    p.add_argument("--dynamic", action="store_true", help="compile with dynamic=True")
    args = p.parse_args(argv)

    import torch
    import fxbackend
    from fxbackend import models

    if (args.family, args.size) not in models.MODEL_CONFIGS:
        p.error(f"unknown model {args.family}/{args.size}; known: "
                f"{', '.join(f'{f}/{s}' for f, s in models.MODEL_CONFIGS)}")
    print(f"model: {models.describe(args.family, args.size)}")
    model = models.build_model(args.family, args.size)
    inputs = models.make_inputs(args.family, args.size)
    with torch.no_grad():
        # pay Dynamo's one-time start-up before timing the compile
        torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))
        ref = models.run_eager(model, inputs)
        fxbackend.reset_stats()
        compiled = torch.compile(model, backend="fxbackend", dynamic=args.dynamic or None)
        t0 = time.perf_counter()
        out = models.run_eager(compiled, inputs)
        first = time.perf_counter() - t0
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        print(f"first call (compile + run): {first:.2f} s")
        print(f"max|out-ref|/max|ref| against eager: {err:.3g}")
        for _ in range(2):
            models.run_eager(model, inputs)
            models.run_eager(compiled, inputs)
        t_eager = _median_ms(lambda: models.run_eager(model, inputs), args.repeat)
        t_fxb = _median_ms(lambda: models.run_eager(compiled, inputs), args.repeat)
    s = fxbackend.stats()
    print("stats:")
    for k, v in s.items():
        if k.endswith("_bytes"):
            v = f"{v / 2**20:.2f} MB"
        print(f"  {k}: {v}")
    print(f"steady state (median of {args.repeat}): eager {t_eager:.1f} ms, "
          f"fxbackend {t_fxb:.1f} ms, speed-up x{t_eager / t_fxb:.2f}")
    ok = err <= 1e-5
    print("OK: matches eager" if ok else "MISMATCH against eager")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": demo}
    if not argv or argv[0] not in commands:
        print(f"usage: python -m fxbackend {{{','.join(commands)}}} [options]", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
