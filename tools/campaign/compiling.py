"""The campaign's compile stage: bench/compile_cost.py on the preset's model, its first
iteration twice, each in a fresh process with an empty Inductor cache, both given one
compile cache (campaign.<profile>.compile_cache) that is emptied at the stage's start: the
first run fills it (cold), the second finds it (warm). Both runs are one stage, so that no
fresh machine comes between them and takes the cache with it. Its results, short, go into
its state (so into summary.json). No torch import.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from campaign.stages import Stage

RESULTS = "compile_cost.json"   # compile_cost.py's --json, in the stage's folder
KEPT_FIGURES = ("mode", "device", "crops", "batch", "precision", "build_s", "first_s", "steady_s", "compile_s",
                "dynamo_compile_s", "process_s", "graphs", "frames", "kernels", "cache")
RUNS = ("cold", "warm")


@dataclass(kw_only=True)
class CompileStage(Stage):
    cache: Path                 # the compile cache both runs share
    cost: dict | None = None    # {"cold": ..., "warm": ...}: compile_cost.py's figures of each run

    KEPT = (*Stage.KEPT, "cost")

    def launch(self, usable_s):
        shutil.rmtree(self.cache, ignore_errors=True)   # cold at every start, a rerun's too
        (self.dir / RESULTS).unlink(missing_ok=True)
        return list(self.argv)

    def after_run(self, took_s):
        if self.status == "done":
            self.cost = cost_figures(self.dir / RESULTS)

    def parts(self):
        return [f"{run}: first iteration {r['first_s']:.1f} s (compilation {r['compile_s']:.1f} s, the step's build "
                f"{r['build_s']:.1f} s, the process {r.get('process_s') or 0:.0f} s), steady {r['steady_s']:.3f} s"
                for run, r in (self.cost or {}).items()]


def cost_figures(path: Path) -> dict | None:
    """compile_cost.py's results, each run's figures that the report keeps, by run."""
    if not path.is_file():
        return None
    results = json.loads(path.read_text())
    return {run: {k: r.get(k) for k in KEPT_FIGURES} for run, r in zip(RUNS, results)}
