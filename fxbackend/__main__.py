"""Command line: ``python -m fxbackend {demo,replay,inspect,precompile}``.

``demo`` (what ``make demo`` runs) builds a small diffusers Flux transformer from a config with
random weights (nothing is downloaded), compiles it with ``torch.compile(backend="fxbackend")``,
checks it against eager, and prints the backend's stats and the speed against eager.

``replay FILE --inputs INPUTS.safetensors [--device cuda] [--bench N] [--out OUT.safetensors]``
loads a saved plan (``fxbackend.save``), runs it on the inputs and prints the outputs' shapes,
the timing and the memory report.  ``inspect FILE`` prints what the file holds: inputs,
weights, symbols, custom ops, the node list and the ops each step uses.

``precompile [--dtypes float32,bfloat16] [--families flux,unet] [--no-w8a8] [--device cpu]``
fills the kernel cache ahead of the first compile (``fxbackend.precompile``).
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


def _load_inputs(path: str, plan, device) -> dict:
    """The user inputs from a safetensors file: names matching ``plan.input_names``, or
    ``0``, ``1``, ... in order; 0-dim tensors for Python-number inputs."""
    import safetensors.torch
    import fxbackend
    try:
        tensors = safetensors.torch.load_file(path)
    except Exception as e:  # safetensors' own message says what is wrong
        raise fxbackend.ReplayError(f"{path}: cannot read inputs: {e}") from None
    names = plan.input_names
    if set(tensors) != set(names) and set(tensors) != {str(i) for i in range(len(names))}:
        raise fxbackend.ReplayError(
            f"{path}: the inputs are named {sorted(tensors)}; this plan takes {names} (or "
            f"{[str(i) for i in range(len(names))]}, in that order)")
    return {k: v.to(device) for k, v in tensors.items()}


def replay(argv: list[str]) -> int:
    """Load a saved plan, run it on inputs from a safetensors file, print the outputs' shapes,
    the timing and the memory report."""
    p = argparse.ArgumentParser(prog="python -m fxbackend replay", description=replay.__doc__)
    p.add_argument("file", help="a plan saved with fxbackend.save")
    p.add_argument("--inputs", required=True,
                   help="safetensors file: one tensor per input, named as the plan's inputs "
                        "(see inspect) or 0, 1, ... in order")
    p.add_argument("--device", default=None, help="load and run on this device (default: the "
                                                  "device the plan was saved from)")
    p.add_argument("--bench", type=int, default=0, metavar="N",
                   help="time N more calls and print the median")
    p.add_argument("--out", default=None, help="write the outputs here (safetensors, named "
                                               "0, 1, ...)")
    args = p.parse_args(argv)

    import torch
    import fxbackend

    try:
        t0 = time.perf_counter()
        plan = fxbackend.load(args.file, device=args.device)
        t_load = time.perf_counter() - t0
        inputs = _load_inputs(args.inputs, plan, plan.device)

        def call():
            out = plan.run(inputs)
            if plan.device.type == "cuda":
                torch.cuda.synchronize(plan.device)
            return out

        t0 = time.perf_counter()
        outs = call()
        t_first = time.perf_counter() - t0
    except fxbackend.ReplayError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"plan: {args.file} on {plan.device} (loaded in {t_load * 1e3:.1f} ms)")
    for i, o in enumerate(outs):
        if isinstance(o, torch.Tensor):
            print(f"output {i}: {str(o.dtype).replace('torch.', '')} {list(o.shape)}")
        else:
            print(f"output {i}: {o!r}")
    print(f"first call (plan build + run): {t_first * 1e3:.1f} ms")
    if args.bench > 0:
        call()
        print(f"steady state (median of {args.bench}): {_median_ms(call, args.bench):.2f} ms")
    print("memory:")
    print(plan.memory_report())
    if args.out:
        import safetensors.torch
        tensors = {str(i): o.detach().to("cpu").contiguous() for i, o in enumerate(outs)
                   if isinstance(o, torch.Tensor)}
        safetensors.torch.save_file(tensors, args.out)
        print(f"outputs written to {args.out}")
    return 0


def inspect(argv: list[str]) -> int:
    """Print what a saved plan holds: inputs, weights, symbols, custom ops, the node list, the
    ops it uses and, for a static graph, each step a plan would run with its kernel and ops
    (no plan is built)."""
    p = argparse.ArgumentParser(prog="python -m fxbackend inspect", description=inspect.__doc__)
    p.add_argument("file", help="a plan saved with fxbackend.save")
    p.add_argument("--device", default=None, help="choose the steps for this device (default: "
                                                  "the device it was saved from)")
    p.add_argument("--no-steps", action="store_true", help="do not list the steps")
    args = p.parse_args(argv)

    import fxbackend
    from fxbackend.planfile import describe

    try:
        print(describe(args.file, device=args.device, steps=not args.no_steps))
    except fxbackend.ReplayError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def precompile(argv: list[str]) -> int:
    """Compile the kernels of the model zoo's tiny configs into the kernel cache, so that the
    first compile of a model of those families on this machine finds them there."""
    p = argparse.ArgumentParser(prog="python -m fxbackend precompile",
                                description=precompile.__doc__)
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help="comma-separated: float32, bfloat16, float16 (default float32,bfloat16)")
    p.add_argument("--families", default=None,
                   help="comma-separated model families (default: every one with a tiny config)")
    p.add_argument("--no-w8a8", action="store_true", help="skip the quantize=w8a8 kernels")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = p.parse_args(argv)

    import fxbackend
    from fxbackend.cpu_kernels._numba import numba_cache_dir
    from fxbackend.precompile import precompile as run
    print(f"kernel cache: {numba_cache_dir()}", flush=True)
    t0 = time.perf_counter()
    try:
        spent = run(args.dtypes, args.families, not args.no_w8a8, args.device,
                    log=lambda line: print(line, flush=True))
    except ValueError as e:
        p.error(str(e))
    print(f"precompiled {len(spent)} configs in {time.perf_counter() - t0:.1f} s "
          f"(fxbackend {fxbackend.__version__})")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": demo, "replay": replay, "inspect": inspect, "precompile": precompile}
    if not argv or argv[0] not in commands:
        print(f"usage: python -m fxbackend {{{','.join(commands)}}} [options]", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
