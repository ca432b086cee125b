"""What `compile=true` costs before the DINO step runs at speed, cold and with a saved cache:
`python -m bench.compile_cost [dino overrides] [--modes whole,regional,warm] [--steps N] [--json F]
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
            kind of call (core/compiling.py); cold, and its compile cache saved after the
            first iteration (core/compile_cache.py), as the trainer saves it
  warm      regional, its compile cache loaded first, as a resumed, requeued or sharing run
            starts: what `regional` saved in this command, or the one in compile_cache_dir=<dir>

The cache goes to compile_cache_dir when the overrides name one (a later command's `warm`
reads it there), else to a folder this command removes at its end. Per mode: the first
iteration's seconds, the median of the next `steps` (steady), the compilation seconds
(first minus steady), torch's own total of its compile phases (with each phase, and each
function torch times, in the JSON: tracing, lowering, waiting for the kernel compiler), the
graphs and frames Dynamo compiled, the kernel files in the Inductor cache, and for `warm`
the seconds its load took and the compiled graphs found in the cache (FX graph and AOT
hits and misses). With `--interleave ROUNDS` it times the steady step only: every mode's
step built in one process and the modes taken in turn, which a machine shared with other
jobs needs for a fair comparison. The device and precision are the trainer's (device=auto:
the GPU if there is one, bf16 there). NOTES.md ("Issue 34 part 3", "Issue 42 part 3")
has the figures.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.process import child_env, module_argv

MODES = ("eager", "whole", "regional", "warm")
CACHED = ("regional", "warm")   # the modes that save (regional) or load (warm) a compile cache


def build(mode: str, overrides: list[str]):
    """The step of `mode` and its synthetic crops: (step, crops, device, precision, plan,
    batch, build seconds, config)."""
    from bench.step import autocast_for, synthetic_crops
    from resmlp.core.config import load_config
    from resmlp.data.crop_plan import crop_plan
    from resmlp.ssl.step import build_dino_step

    cfg = load_config("dino", "resmlp_s12", ["demo=false", *overrides, f"compile={'regions' if mode in CACHED else False}"])
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
    return step, crops, device, precision, plan, int(cfg.batch_size), build_s, cfg


def one_step(step, crops, device) -> float:
    """Seconds of one step, its work done (the tally read to the host)."""
    from bench.step import EPOCH, VALUES
    from bench.timing import sync
    sync(device)
    t0 = time.perf_counter()
    step([c.clone() for c in crops], VALUES, EPOCH)
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
    """One mode in this process: the build, (warm) the cache's load, the first iteration
    and `steps` more; regional saves its cache after the first iteration."""
    from torch._dynamo.utils import counters

    step, crops, device, precision, plan, batch, build_s, cfg = build(mode, overrides)
    cache, load_s = None, None
    if mode in CACHED and cfg.compile_cache_dir:
        from resmlp.core.compile_cache import CompileCache, cache_key, compiled_how
        key = cache_key(cfg, device, precision, batch, 1, compiled_how(step.student, step.teacher),
                        step.graphed is not None, plan.label())
        cache = CompileCache(cfg.compile_cache_dir, key, say=lambda text: print(text, file=sys.stderr, flush=True))
        if mode == "warm":
            t0 = time.perf_counter()
            cache.load()
            load_s = time.perf_counter() - t0
    seconds = [one_step(step, crops, device)]
    if cache is not None and mode == "regional":
        cache.save()  # as the trainer saves it after its first log line: outside the timed iterations
    seconds += [one_step(step, crops, device) for _ in range(steps)]
    steady = statistics.median(seconds[1:]) if steps else float("nan")
    try:  # torch's own seconds per compile phase and per timed function (internal helpers)
        from torch._dynamo.utils import calculate_time_spent, compile_times
        phases = {k: round(v, 2) for k, v in calculate_time_spent().items()}
        names, values = compile_times(repr="csv", aggregate=True)
        functions = {k: round(float(v), 2) for k, v in zip(names, values)}
    except ImportError:
        phases, functions = {}, {}
    found = {"load_s": load_s, "loaded": cache.loaded if cache is not None else {},
             "fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"],
             "fxgraph_miss": counters["inductor"]["fxgraph_cache_miss"],
             "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
             "aot_miss": counters["aot_autograd"]["autograd_cache_miss"]}
    return {"mode": mode, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "precision": precision, "batch": batch, "crops": plan.label(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "build_s": build_s, "first_s": seconds[0], "steady_s": steady,
            "compile_s": seconds[0] - steady, "dynamo_compile_s": phases.get("total_wall_time"), "phases": phases,
            "functions": functions,
            "graphs": int(counters["stats"]["unique_graphs"]), "frames": int(counters["frames"]["ok"]),
            "cache": found, "seconds": seconds}


def line(r: dict) -> str:
    c = r.get("cache") or {}
    load = f"cache load {c['load_s']:4.1f} s, " if c.get("load_s") is not None else ""
    cached = (f", FX graphs {c['fxgraph_hit']} from the cache / {c['fxgraph_miss']} compiled"
              if r["mode"] in CACHED else "")
    return (f"{r['mode']:>8}: build {r['build_s']:5.1f} s, {load}first iteration {r['first_s']:7.1f} s, "
            f"steady {r['steady_s']:6.3f} s, "
            f"compilation {r['compile_s']:7.1f} s (torch's compile phases {r['dynamo_compile_s'] or 0:.1f} s), "
            f"{r['graphs']} graph(s) in {r['frames']} frame(s), {r['kernels']} kernel file(s) in the Inductor cache"
            f"{cached}")


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
    named = next((o.split("=", 1)[1] for o in args.overrides if o.startswith("compile_cache_dir=")), None)
    if "warm" in modes and not named and "regional" not in modes[:modes.index("warm")]:
        print("compile_cost: --modes warm loads the cache regional saves: list regional before it, or name a "
              "folder that holds one with compile_cache_dir=<dir>", file=sys.stderr)
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
    with tempfile.TemporaryDirectory(prefix="compile_cost_saved_") as folder:
        # the regional mode's compile cache, for the warm mode: the folder named, else this one
        cached = [] if named or "warm" not in modes else [f"compile_cache_dir={folder}"]
        results = [r for r in (one_mode(m, [*args.overrides, *(cached if m in CACHED else [])], args.steps)
                               for m in modes) if r is not None]
    if results:
        r = results[0]
        print(f"dino resmlp_s12 {' '.join(args.overrides) or '(the preset)'}: {r['crops']} px, batch {r['batch']}, "
              f"{r['precision']} on {r['device']}, torch {r['torch']}, {r['threads']} threads")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if len(results) == len(modes) else 1


def one_mode(mode: str, overrides: list[str], steps: int) -> dict | None:
    """`mode` measured in a fresh process with an empty Inductor cache; its line printed.
    None (and a line saying so) when the process failed."""
    with tempfile.TemporaryDirectory(prefix="compile_cost_") as cache:
        env = child_env(TORCHINDUCTOR_CACHE_DIR=cache)  # cold: nothing compiled before
        cmd = module_argv("compile_cost", "--one", mode, "--steps", steps, *overrides)
        t0 = time.perf_counter()
        out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
        # the kernel files: C++ libraries on a CPU, Triton binaries on a GPU (warm: the cached ones written out)
        kernels = sum(1 for p in Path(cache).rglob("*") if p.suffix in (".so", ".cubin"))
    found = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not found:
        print(f"{mode:>8}: failed (exit {out.returncode})", flush=True)
        return None
    r = {**json.loads(found[-1][len("RESULT "):]), "process_s": time.perf_counter() - t0, "kernels": kernels}
    print(line(r), flush=True)
    return r


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
