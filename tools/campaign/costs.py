"""The campaign's stages that run one of the bench's cost scripts (tools/bench), `python -m
bench.<script> [its arguments] --json <the stage's folder>/<script>.json [dino
overrides]`, which measures in its own process (and its children) and writes a list of
results. What the report keeps of each result goes into the stage's state, by run (so into
summary.json: the report has no room for another file). No torch import.

  CompileStage  compile_cost.py on the preset's model: its first iteration twice, each in a
                fresh process with an empty Inductor cache, both given one compile cache
                (campaign.<profile>.compile_cache) that is emptied at the stage's start: the
                first run fills it (cold), the second finds it (warm). Both runs are one
                stage, so that no fresh machine comes between them and takes the cache with it.
  HeadStage     head_cost.py: the trainer's step built once per dino.head_precision and
                timed side by side, each precision's rate against the first's, and its
                first loss beside the first's
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from campaign.stages import Stage


@dataclass(kw_only=True)
class CostStage(Stage):
    results: Path               # the script's --json
    cost: dict | None = None    # {run: the figures the report keeps of it}

    KEPT = (*Stage.KEPT, "cost")

    def launch(self, usable_s):
        self.results.unlink(missing_ok=True)   # a rerun's figures are its own
        return list(self.argv)

    def after_run(self, took_s):
        if self.status == "done" and self.results.is_file():
            self.cost = self.by_run(json.loads(self.results.read_text()))

    def by_run(self, results: list) -> dict:
        """{run: the figures the report keeps} of the script's results."""
        raise NotImplementedError


RUNS = ("cold", "warm")         # compile_cost.py's --modes regional,warm
COMPILE_FIGURES = ("mode", "device", "crops", "batch", "precision", "build_s", "first_s", "steady_s", "compile_s",
                   "dynamo_compile_s", "process_s", "graphs", "frames", "kernels", "cache")


@dataclass(kw_only=True)
class CompileStage(CostStage):
    cache: Path                 # the compile cache both runs share

    def launch(self, usable_s):
        shutil.rmtree(self.cache, ignore_errors=True)   # cold at every start, a rerun's too
        return super().launch(usable_s)

    def by_run(self, results):
        return {run: {k: r.get(k) for k in COMPILE_FIGURES} for run, r in zip(RUNS, results)}

    def parts(self):
        return [f"{run}: first iteration {r['first_s']:.1f} s (compilation {r['compile_s']:.1f} s, the step's build "
                f"{r['build_s']:.1f} s, the process {r.get('process_s') or 0:.0f} s), steady {r['steady_s']:.3f} s"
                for run, r in (self.cost or {}).items()]


@dataclass(kw_only=True)
class HeadStage(CostStage):
    def by_run(self, results):
        """By precision, each result's numbers and words (its timed repeats aside)."""
        return {r["head_precision"]: {k: v for k, v in r.items() if k != "head_precision" and not isinstance(v, list)}
                for r in results}

    def parts(self):
        if not self.cost:
            return []
        base, first = next(iter(self.cost.items()))
        how = (f"{first['mode']}{' + graphs' if first['graphs'] else ''}, {first['precision']}, batch {first['batch']} "
               f"({first['crops']})")
        return [f"{how}: " + ", ".join(
            f"{name} {r['images_per_s']:.0f} img/s" + ("" if name == base else
                                                       f" ({r[f'vs_{base}']:.3f}x {base}, first loss "
                                                       f"{r[f'first_loss_vs_{base}']:+.1e})")
            for name, r in self.cost.items())]
