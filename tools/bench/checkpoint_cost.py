"""What one of the DINO trainer's checkpoints costs on this machine's disk:
`python -m bench.checkpoint_cost [dino overrides] [--times N] [--dir D]`.

Builds the step the trainer builds (student, teacher, head, AdamW) for `dino resmlp_s12`
with the overrides (default: the Fashion-MNIST preset), runs one step at a small batch so
that AdamW holds its two moments, then writes the checkpoint as the trainer does
(core.run.Run.save: core.checkpoint.save_checkpoint, atomic with fsync, the one before
kept as checkpoint_prev.pth) N times into D (default: a temp dir under runs/), and prints
its size and the seconds of each write. The figure is this machine's disk and CPU: on a
GPU the weights come from the device first (not timed here), and another disk writes at
another rate. NOTES.md ("The preset's checkpoints under the campaign") has the
figures and the cadence chosen from them.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch


def measure(overrides: list[str], times: int, folder: Path) -> dict:
    from bench.step import EPOCH, VALUES, synthetic_crops
    from resmlp.core.checkpoint import CHECKPOINT_NAME, PREVIOUS_NAME, rng_state, save_checkpoint
    from resmlp.core.config import load_config, to_dict
    from resmlp.data.crop_plan import crop_plan
    from resmlp.ssl.step import build_dino_step

    cfg = load_config("dino", "resmlp_s12", ["demo=false", "device=cpu", "compile=false", *overrides])
    plan = crop_plan(cfg)
    device = torch.device("cpu")
    step = build_dino_step(cfg, plan, device)
    step(synthetic_crops(plan, 2, device), VALUES, EPOCH)  # AdamW's moments exist now
    state = {"student": step.raw_student.state_dict(), "teacher": step.teacher.state_dict(),
             "optimizer": step.optimizer.state_dict(), "center": step.loss_fn.center.detach(),
             "epoch": 1, "iteration": 1, "rng": rng_state(), "results": {}}
    params = sum(p.numel() for p in step.raw_student.parameters())
    seconds = []
    for _ in range(times):
        t0 = time.perf_counter()
        save_checkpoint(folder / CHECKPOINT_NAME, {"command": "dino", "config": to_dict(cfg), **state},
                        previous=folder / PREVIOUS_NAME)
        seconds.append(time.perf_counter() - t0)
    return {"student_params": params, "bytes": (folder / CHECKPOINT_NAME).stat().st_size, "seconds": seconds}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="dino key=value overrides (default: the preset)")
    parser.add_argument("--times", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir under runs/)")
    args = parser.parse_args(argv)
    folder = args.dir or Path(tempfile.mkdtemp(prefix="checkpoint_cost_", dir=Path("runs").resolve()
                                               if Path("runs").is_dir() else None))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        r = measure(args.overrides, args.times, folder)
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    s = sorted(r["seconds"])
    print(f"checkpoint of dino resmlp_s12 {' '.join(args.overrides) or '(the preset)'}: student "
          f"{r['student_params'] / 1e6:.1f}M parameters, file {r['bytes'] / 2**20:.0f} MiB; {len(s)} writes "
          f"into {folder}: median {s[len(s) // 2]:.2f} s, min {s[0]:.2f} s, max {s[-1]:.2f} s "
          f"({', '.join(f'{x:.2f}' for x in r['seconds'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
