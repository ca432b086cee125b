"""What `compile=true` costs before the DINO step runs at speed:
`python -m resmlp.bench.compile_cost [dino overrides] [--modes whole,regional] [--steps N] [--json F]
[--interleave ROUNDS]`.

Builds the trainer's step (resmlp.ssl.step.build_dino_step) for `dino resmlp_s12` with the
overrides (default: the Fashion-MNIST preset: ResMLP-S12 at 32 px, patch 4, 2 global crops
+ 8 local crops of 16 px, the preset's head and batch; on a CPU pass e.g. batch_size=8) and
times its iterations on synthetic crops, once per mode, each in a fresh process with an
empty Inductor cache (a fresh machine's cold start):

  eager     no compilation (what the first iteration costs anyway: allocations, cuBLAS)
  whole     torch.compile of each whole network, the student and the teacher (the code
            before core/compiling.py)
  regional  compile=true as the trainer runs it: each block compiled in place, once per
            kind of call (core/compiling.py)

Per mode: the first iteration's seconds, the median of the next `steps` (steady), the
compilation seconds (first minus steady), torch's own total of its compile phases (with
each phase, and each function torch times, in the JSON: tracing, lowering, waiting for
the kernel compiler), the graphs and frames Dynamo compiled, and the kernels built into
the cache. With `--interleave ROUNDS` it times the steady step only: every mode's step
built in one process and the modes taken in turn, which a machine shared with other jobs
needs for a fair comparison. The device and precision are the trainer's (device=auto:
the GPU if there is one, bf16 there). bench/NOTES.md ("Issue 34 part 3") has the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

MODES = ("eager", "whole", "regional")


def build(mode: str, overrides: list[str]):
    """The step of `mode` and its synthetic crops: (step, crops, device, precision, plan,
    batch, build seconds)."""
    from resmlp.bench.rows import autocast_for, synthetic_crops
    from resmlp.core.config import load_config
    from resmlp.data.crop_plan import crop_plan
    from resmlp.ssl.step import build_dino_step

    cfg = load_config("dino", "resmlp_s12", ["demo=false", *overrides, f"compile={mode == 'regional'}"])
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                          "cpu" if cfg.device == "auto" else cfg.device)
    precision = str(cfg.precision) if cfg.precision != "auto" else "bf16" if device.type == "cuda" else "fp32"
    plan = crop_plan(cfg)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    step = build_dino_step(cfg, plan, device, autocast=autocast_for(device, precision))
    if mode == "whole":  # what ssl/step.py did before regional compilation
        step.student, step.teacher = torch.compile(step.student), torch.compile(step.teacher)
    build_s = time.perf_counter() - t0
    crops = synthetic_crops(plan, int(cfg.batch_size), device)
    return step, crops, device, precision, plan, int(cfg.batch_size), build_s


def one_step(step, crops, device) -> float:
    """Seconds of one step, its work done (the tally read to the host)."""
    from resmlp.bench.rows import LR, MOMENTUM, TEACHER_TEMP, WD
    from resmlp.bench.timing import sync
    sync(device)
    t0 = time.perf_counter()
    step([c.clone() for c in crops], LR, WD, MOMENTUM, TEACHER_TEMP, 1)
    step.read()
    return time.perf_counter() - t0


def interleaved(modes: list[str], overrides: list[str], rounds: int) -> dict:
    """The steady step of each mode, the steps built side by side in this process and timed
    in turn (`rounds` times each, after one call that compiles): on a machine shared with
    other jobs, what they do falls on every mode alike. {mode: seconds per round}."""
    built = {m: build(m, overrides) for m in modes}
    for step, crops, device, *_ in built.values():
        one_step(step, crops, device)
    times = {m: [] for m in modes}
    for _ in range(rounds):
        for m, (step, crops, device, *_) in built.items():
            times[m].append(one_step(step, crops, device))
    return times


def measure(mode: str, overrides: list[str], steps: int) -> dict:
    """One mode in this process: the build, the first iteration and `steps` more."""
    from torch._dynamo.utils import counters

    step, crops, device, precision, plan, batch, build_s = build(mode, overrides)
    seconds = [one_step(step, crops, device) for _ in range(1 + steps)]
    steady = statistics.median(seconds[1:]) if steps else float("nan")
    try:  # torch's own seconds per compile phase and per timed function (internal helpers)
        from torch._dynamo.utils import calculate_time_spent, compile_times
        phases = {k: round(v, 2) for k, v in calculate_time_spent().items()}
        names, values = compile_times(repr="csv", aggregate=True)
        functions = {k: round(float(v), 2) for k, v in zip(names, values)}
    except ImportError:
        phases, functions = {}, {}
    return {"mode": mode, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "precision": precision, "batch": batch, "crops": plan.label(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "build_s": build_s, "first_s": seconds[0], "steady_s": steady,
            "compile_s": seconds[0] - steady, "dynamo_compile_s": phases.get("total_wall_time"), "phases": phases,
            "functions": functions,
            "graphs": int(counters["stats"]["unique_graphs"]), "frames": int(counters["frames"]["ok"]),
            "seconds": seconds}


def line(r: dict) -> str:
    return (f"{r['mode']:>8}: build {r['build_s']:5.1f} s, first iteration {r['first_s']:7.1f} s, "
            f"steady {r['steady_s']:6.3f} s, "
            f"compilation {r['compile_s']:7.1f} s (torch's compile phases {r['dynamo_compile_s'] or 0:.1f} s), "
            f"{r['graphs']} graph(s) in {r['frames']} frame(s), {r['kernels']} kernel(s) built")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="dino key=value overrides (default: the preset)")
    parser.add_argument("--modes", default="whole,regional", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--steps", type=int, default=3, help="iterations after the first (the steady median)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                        help="instead: the steady step of each mode, built in one process and timed in turn")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process: one mode
    args = parser.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(measure(args.one, args.overrides, args.steps)), flush=True)
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        print(f"compile_cost: --modes {','.join(bad)} is not one of {', '.join(MODES)}", file=sys.stderr)
        return 2
    if args.interleave:
        times = interleaved(modes, args.overrides, args.interleave)
        for mode, t in times.items():
            print(f"{mode:>8}: steady {statistics.median(t):.3f} s (median of {len(t)} interleaved; "
                  f"{min(t):.3f}-{max(t):.3f})", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(times, f, indent=1)
        return 0
    results = []
    for mode in modes:
        with tempfile.TemporaryDirectory(prefix="compile_cost_") as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}  # cold: nothing compiled before
            cmd = [sys.executable, "-m", "resmlp.bench.compile_cost", "--one", mode, "--steps", str(args.steps),
                   *args.overrides]
            t0 = time.perf_counter()
            out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
            # the kernels compiled: C++ libraries on a CPU, Triton binaries on a GPU
            kernels = sum(1 for p in Path(cache).rglob("*") if p.suffix in (".so", ".cubin"))
        found = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        if out.returncode or not found:
            print(f"{mode:>8}: failed (exit {out.returncode})", flush=True)
            continue
        r = {**json.loads(found[-1][len("RESULT "):]), "process_s": time.perf_counter() - t0, "kernels": kernels}
        results.append(r)
        print(line(r), flush=True)
    if results:
        r = results[0]
        print(f"dino resmlp_s12 {' '.join(args.overrides) or '(the preset)'}: {r['crops']} px, batch {r['batch']}, "
              f"{r['precision']} on {r['device']}, torch {r['torch']}, {r['threads']} threads")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if len(results) == len(modes) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
