"""A stage of the campaign (call.py runs them): the part every kind of stage shares,
and when one may start. No torch import.

Each kind is a class that owns its command line, what its exit code means, what it takes
back from a carried report and the figures it puts in the report:

  TestsStage     the CUDA-only tests, each test's result kept as it comes (tests.py)
  BenchStage     bench lines, kept one by one in a bench.json (bench.py)
  ProfileStage   tools/bench/profile.py on one step: time per phase, every kernel by class (bench.py)
  CompileStage   tools/bench/compile_cost.py's first iteration, cold then warm (costs.py)
  HeadStage      tools/bench/head_cost.py: the step per dino.head_precision (costs.py)
  TrainingStage  a DINO run to its last epoch, its time predicted before it starts; the
                 preset's PresetStage also decides on CUDA graphs (training.py)

plan.py says which stage of campaign.stages is of which kind, with what keys.

Under a window (campaign.window_left_s) a stage starts only when it can end in what is left:
a bench stage keeps its lines one by one, so one that fits its longest line may start; any
other needs its whole time (a training stage its prediction, predict.py; the
others their min_start_s, which is their whole run) before the call's stop signal. What a
start needed and what the run took are kept side by side (`expected`), so that every
estimate is checked by the window that runs it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from resmlp.core.errors import PREEMPTED_EXIT


@dataclass
class Stage:
    name: str
    argv: list                # after the python executable, as campaign.json keeps it (launch() adds the rest)
    dir: Path                 # its files, inside the campaign dir
    min_start_s: float        # no start with less left before the stop signal (tests, profiles: their whole run)
    status: str = "pending"   # pending | running | cut (started, continues) | done | failed
    note: str = ""
    rc: int | None = None
    wall_s: float = 0.0
    runs: int = 0
    figures: dict = field(default_factory=dict)  # what the report shows of its files (read_figures)
    # what its last start needed (need_s, why: its requirement, an estimate or a prediction)
    # and what that run took (took_s): the report holds both, to judge the estimates by
    expected: dict | None = None

    KEPT = ("status", "note", "rc", "wall_s", "runs", "expected")  # what campaign.json keeps between calls

    # ---- state ------------------------------------------------------------------------------
    def ended(self) -> bool:
        return self.status in ("done", "failed")

    def state(self) -> dict:
        return {k: round(self.wall_s, 1) if k == "wall_s" else getattr(self, k) for k in self.KEPT}

    def take(self, saved: dict) -> None:
        self.__dict__.update({k: v for k, v in saved.items() if k in self.KEPT})
        if self.status == "running":  # the call before was killed around it
            self.status = "cut"

    def continue_from_report(self, folder: Path, figures: dict, call: int) -> str | None:
        """On a fresh machine, after take() of the carried state: put back the files this
        stage keeps from the report `folder` (`figures`: its entry in summary.json); what
        the call should say about it (None: nothing)."""
        return None

    # ---- its time ---------------------------------------------------------------------------
    def budget_left_s(self) -> float | None:
        """What is left of a budget of stage time over all calls (None: the kind has none)."""
        return None

    def predict(self, p: dict, constants_name: str, say=None) -> dict | None:
        """The stage's time from its config, for the kinds that can tell (None: min_start_s stands)."""
        return None

    def requirement(self, p: dict, window: bool, predicted: dict | None) -> tuple[float, str]:
        """(seconds the stage needs before its stop signal to be started, why)."""
        return self.min_start_s, f"min_start_s={self.min_start_s:g}"

    # ---- a run ------------------------------------------------------------------------------
    def begin(self, need_s: float, why: str) -> str:
        """Mark a run as started, with what it needed to start; the verb for the call's line."""
        self.status, self.runs, self.note = "running", self.runs + 1, ""
        self.expected = {"need_s": round(need_s, 1), "why": why}
        return "starts" if self.runs == 1 else "continues"

    def took(self, seconds: float) -> None:
        self.expected = {**(self.expected or {}), "took_s": round(seconds, 1)}

    def launch(self, usable_s: float) -> list:
        """The argv for this start, `usable_s` seconds before its stop signal."""
        return list(self.argv)

    def start_note(self) -> str | None:
        """A line for the call about how this start was decided (None: nothing to say)."""
        return None

    def heard(self, line: str) -> bool:
        """A line of its output: True when it measured something (the report is rewritten)."""
        return False

    def classify(self, rc: int, stopped_by: str | None) -> None:
        """What an exit code means: done, cut (continue next call) or failed. A stop the
        call asked for (stopped_by) ends in the trainers' exit 75 or a signal."""
        self.note = ""
        if rc == 0:
            self.status = "done"
        elif rc == PREEMPTED_EXIT or (stopped_by and rc < 0):
            self.status = "cut"
        else:
            self.status, self.note = "failed", f"exit {rc}: see campaign.log"

    def after_run(self, took_s: float) -> None:
        """Take what a finished run left behind (classify has set the status)."""

    # ---- the report -------------------------------------------------------------------------
    def read_figures(self) -> dict:
        try:
            return self.figures_from_files()
        except (OSError, ValueError, KeyError, TypeError) as e:  # a file cut short by a kill: say so, go on
            return {"figures_error": f"{type(e).__name__}: {e}"}

    def figures_from_files(self) -> dict:
        return {}

    def report_files(self) -> dict:
        """The report folder's files this stage adds: {name: a Path to copy, or bytes}."""
        return {}

    def summary(self) -> dict:
        """Its entry in summary.json."""
        return {"name": self.name, **self.state(), "command": ["python", *self.argv], **self.figures}

    def describe(self) -> str:
        """One line of the call's closing table."""
        e = self.expected or {}
        time = [f"needed {e['need_s']:.0f} s to start ({e['why']}), took {e['took_s']:.0f} s"] if "took_s" in e else []
        return "; ".join([*self.parts(), *time, *([self.note] if self.note else [])]) or "-"

    def parts(self) -> list:
        return []


def decide(need_s: float, left_s: float, next_call_s: float) -> str:
    """start: it fits before this call's stop signal; next_call: a later call of this window
    can give it that (this call ends, so that the order holds); window: no call of this
    window can (it is not started, and the call goes on with the next stage)."""
    if need_s <= left_s:
        return "start"
    return "next_call" if need_s <= next_call_s else "window"
