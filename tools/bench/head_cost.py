"""What dino.head_precision changes in the DINO step:
`python -m bench.head_cost [dino overrides] [--precisions fp32,tf32,bf16] [--mode regional|eager]
[--steps N] [--repeats R] [--json F]`.

The trainer's step (compile_cost.build: `dino resmlp_s12` with the overrides, default the
Fashion-MNIST preset; `--mode regional` is compile=true as the trainer runs it, with its
heads and loss compiled; dino.cuda_graphs as the overrides say) built once per precision of
the head's prototype layer (ssl/head.py), side by side in this process from the same
seed, and timed in alternating repeats (timing.py's measure_interleaved: what other jobs
do falls on every precision alike). Per precision: images per second, its ratio to fp32's,
and the first step's loss beside fp32's (same weights, same crops). On a GPU these are the
lines that decide the default (tests/test_head.py holds each precision's loss to fp32's);
on a CPU tf32 is fp32 (a CPU has no TF32), so only bf16's figure means anything there.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch


def measure(precisions: list[str], overrides: list[str], mode: str, steps: int, repeats: int) -> list[dict]:
    from bench.compile_cost import build
    from bench.step import EPOCH, VALUES
    from bench.timing import measure_interleaved
    built = {p: build(mode, [*overrides, f"dino.head_precision={p}"]) for p in precisions}
    first, calls, warmup = {}, {}, 2
    for p, (step, crops, device, *_rest) in built.items():
        torch.manual_seed(1)   # the same drop-path draws
        first[p] = float(step([c.clone() for c in crops], VALUES, EPOCH)[0])
        calls[p] = (lambda s=step, c=crops: s(c, VALUES, EPOCH))
        if step.graphed is not None:   # its warm-up calls and capture before the timed ones
            warmup = max(warmup, step.graphed.calls_to_steady_state + 1)
    device, precision, plan, batch = next(iter(built.values()))[2:6]
    times = measure_interleaved(calls, device, warmup=warmup, calls=steps, repeats=repeats)
    base = times[precisions[0]].seconds
    return [{"head_precision": p, "device": device.type, "precision": precision, "mode": mode,
             "graphs": built[p][0].graphed is not None, "batch": batch, "crops": plan.label(),
             "images_per_s": batch / t.seconds, **t.as_dict(),
             f"vs_{precisions[0]}": base / t.seconds, "first_loss": first[p],
             f"first_loss_vs_{precisions[0]}": first[p] / first[precisions[0]] - 1}
            for p, t in times.items()]


def main(argv: list[str]) -> int:
    from resmlp.core.config import choices
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="dino key=value overrides (default: the preset)")
    parser.add_argument("--precisions", default="fp32,tf32,bf16", help="comma-separated; the first is the base")
    parser.add_argument("--mode", default="regional", help="regional (compile=true) or eager")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=5, help="alternating repeats (the median)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    words = list(choices("dino.head_precision"))
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    bad = [p for p in precisions if p not in words]
    if bad or not precisions or args.mode not in ("regional", "eager"):
        print(f"head_cost: --precisions {','.join(bad) or '(none)'} is not one of {', '.join(words)}" if bad or
              not precisions else f"head_cost: --mode {args.mode} is not regional or eager", file=sys.stderr)
        return 2
    results = measure(precisions, args.overrides, args.mode, args.steps, args.repeats)
    r = results[0]
    print(f"head_cost: {r['device']} {r['precision']} {r['mode']}{' + graphs' if r['graphs'] else ''}, batch "
          f"{r['batch']} ({r['crops']}); median of {args.repeats} alternating repeats of {args.steps} steps")
    for r in results:
        print(f"{r['head_precision']:>6}: {r['images_per_s']:9.1f} img/s  {r[f'vs_{precisions[0]}']:.3f}x "
              f"{precisions[0]}  first loss {r['first_loss']:.6f} ({r[f'first_loss_vs_{precisions[0]}']:+.1e})",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
