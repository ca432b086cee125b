"""The campaign's stages (bench/campaign.py runs them): what each one runs, how much time
it needs to be worth starting, what its exit code means, and what pytest's output says
test by test. No torch import.

  tests           the CUDA-only tests (`pytest -m cuda`), each test's result kept as it comes:
                  a cut call's next one runs only the tests without a result
  preset          `dino resmlp_s12` to its last epoch, graphed when the graph tests passed
  bench_fused     the bench lines of the goals first: the fused step (compiled, with and
                  without graphs, at batch 64 and the largest batch) beside the reference
                  loop, and the device k-NN
  profile_preset  bench/profile.py on the preset's (fused) step: time per phase, top kernels
  profile_224     the same on the 224 px step
  bench           the rest of the bench, in the same bench.json (no line measured twice)
  compare         the preset with campaign.compare_overrides, for compare_budget_s of stage time

Under a window (campaign.window_left_s) a stage starts only when it can end in what is left:
a bench stage keeps its lines one by one, so one that fits its longest line may start; any
other needs its whole time (a training stage its prediction, bench/campaign_predict.py; the
others their min_start_s, which is their whole run) before the call's stop signal.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from resmlp.core.config import as_list, choices, to_dict
from resmlp.core.errors import PREEMPTED_EXIT, UserError

STAGES = choices("campaign.stages")
TRAINING = ("preset", "compare")
BENCH = ("bench_fused", "bench")
PROFILE = ("profile_preset", "profile_224")


@dataclass
class Stage:
    name: str
    argv: list                # after the python executable, as campaign.json keeps it (launch() adds the rest)
    dir: Path                 # its files (both bench stages share <out>/bench)
    min_start_s: float        # no start with less left before the stop signal (tests, profiles: their whole run)
    line_s: float | None = None    # bench stages: the longest line (none starts with less left)
    budget_s: float | None = None  # compare: stage time over all calls
    config: tuple | None = None    # training stages: (command, model, overrides) of their run, for the prediction
    status: str = "pending"   # pending | running | cut (started, continues) | done | failed
    note: str = ""
    rc: int | None = None
    wall_s: float = 0.0
    runs: int = 0
    attempt: int = 1          # training stages: 2 after a fresh machine lost the first one's checkpoint
    outcomes: dict = field(default_factory=dict)  # tests: node id -> {"outcome": ..., "message": ...}
    graphs: dict | None = None  # preset: {"on": bool | None, "why": str}, decided at its first start
    restart: bool = False     # training stages: the next start begins again from epoch 0 (a fresh machine)
    prediction: dict | None = None  # training stages: the last prediction of their time, and its terms
    profile: dict | None = None     # profile stages: their profile.json, short (campaign_state.profile_figures)
    figures: dict = field(default_factory=dict)

    KEPT = ("status", "note", "rc", "wall_s", "runs", "attempt", "restart", "outcomes", "graphs", "prediction",
            "profile")

    def ended(self) -> bool:
        return self.status in ("done", "failed")

    def state(self) -> dict:
        return {k: round(self.wall_s, 1) if k == "wall_s" else getattr(self, k) for k in self.KEPT}

    def take(self, saved: dict) -> None:
        self.__dict__.update({k: v for k, v in saved.items() if k in self.KEPT})
        if self.status == "running":  # the call before was killed around it
            self.status = "cut"


def plan(cfg, campaign_dir: Path) -> tuple[dict, list[Stage]]:
    """(the profile's settings, the stages asked for, in campaign.stages' order)."""
    c = cfg.campaign
    p = to_dict(c[c.profile])
    names = [str(s) for s in as_list(c.stages)]
    if not names or len(set(names)) < len(names):
        raise UserError(f"campaign.stages={names} must name each stage once, some of {', '.join(STAGES)}")
    grace = float(p["stop_grace_s"])
    for name in names:
        if c.call_s <= p["min_start_s"][name] + grace:
            raise UserError(f"campaign.call_s={c.call_s} leaves no time for the {name} stage: it must exceed "
                            f"campaign.{c.profile}.min_start_s.{name} + stop_grace_s = "
                            f"{p['min_start_s'][name] + grace:g} s")
    d = campaign_dir
    images = ["data=imagefolder", f"data.root={d / 'images'}"] if p.get("images") else []
    preset = [*map(str, p["preset"]), *images, *map(str, as_list(c.preset_overrides))]
    compare = [*preset, *map(str, as_list(c.compare_overrides))]
    bench = ["-m", "resmlp.core.cli", "bench", f"out={d / 'bench'}", "bench.resume=true"]
    shared = [*map(str, p["bench"])]
    overrides = {  # (command, model, its key=value overrides)
        "preset": ("dino", "resmlp_s12", preset),
        "compare": ("dino", "resmlp_s12", compare),
        "bench_fused": ("bench", None, [*shared, *map(str, p["bench_fused"])]),
        "bench": ("bench", None, [*shared, *map(str, p["bench_rest"])]),
        # the preset's own step (its model, crops and batch) and the 224 px one, each profiled
        "profile_preset": ("dino", "resmlp_s12", [*map(str, p["preset"]), *map(str, as_list(c.preset_overrides)),
                                                  *map(str, p["profile_preset"])]),
        "profile_224": ("dino", "resmlp_s12", [*map(str, p["profile_224"])]),
    }
    stages = []
    for n in names:
        if n == "tests":
            argv = ["-m", "pytest", "-p", "no:cacheprovider", "-v", "-rfE", *map(str, p["tests"])]
        else:
            command, model, keys = overrides[n]
            if n in PROFILE:
                argv = ["-m", "resmlp.bench.profile", *keys, f"profile.out={d / n}"]
            elif n in BENCH:
                argv = [*bench, *keys]
            else:
                argv = ["-m", "resmlp.core.cli", command, model, f"out={d / n}", *keys]
        stages.append(Stage(n, argv, d / ("bench" if n in BENCH else n), float(p["min_start_s"][n]),
                            line_s=float(p["bench_line_s"][n]) if n in BENCH else None,
                            budget_s=float(c.compare_budget_s) if n == "compare" else None,
                            config=overrides[n] if n in TRAINING else None))
    return p, stages


def requirement(stage: Stage, p: dict, window: bool, predicted: dict | None) -> tuple[float, str]:
    """(seconds a stage needs before its stop signal to be started, why). A bench stage keeps
    its lines one by one: its longest line and start-up. Under a window every other stage
    needs its whole run: a training stage its prediction (at least min_start_s; compare at
    most what is left of its budget before its stop signal), the tests and the profiles
    their min_start_s. Without a window a training stage resumes from its checkpoint on the
    same machine: min_start_s."""
    if stage.name in BENCH:
        return max(stage.min_start_s, stage.line_s + 1), (f"its longest line, bench_line_s={stage.line_s:g}, and "
                                                          "start-up; its lines are kept one by one")
    if stage.name not in TRAINING or not window or predicted is None:
        return stage.min_start_s, f"min_start_s={stage.min_start_s:g}"
    need = max(stage.min_start_s, predicted["need_s"])
    if stage.budget_s is not None:  # it ends when its budget is spent: its stop signal comes grace s before
        need = min(need, max(stage.min_start_s, stage.budget_s - stage.wall_s - float(p["stop_grace_s"])))
    return need, f"predicted {predicted['need_s']:.0f} s"


def decide(need_s: float, left_s: float, next_call_s: float) -> str:
    """start: it fits before this call's stop signal; next_call: a later call of this window
    can give it that (this call ends, so that the order holds); window: no call of this
    window can (it is not started, and the call goes on with the next stage)."""
    if need_s <= left_s:
        return "start"
    return "next_call" if need_s <= next_call_s else "window"


def launch(stage: Stage, stages: dict, p: dict, preset_overrides: list, time_limit_s: float | None) -> list:
    """The stage's argv for this start: the tests without a result yet, the bench's time
    limit, the preset's graphs."""
    argv = list(stage.argv)
    if stage.name == "tests":
        for node in stage.outcomes:
            argv += ["--deselect", node]
    if time_limit_s is not None:
        argv.append(f"bench.time_limit_s={time_limit_s:.0f}")
    if stage.name == "preset":
        if stage.graphs is None:  # decided once: a resumed run keeps its config
            stage.graphs = graphs_decision(stages.get("tests"), str(p["graph_tests"]), preset_overrides)
        if stage.graphs["on"]:
            argv.append("dino.cuda_graphs=true")
    return argv


def graphs_decision(tests: Stage | None, graph_tests: str, preset_overrides: list) -> dict:
    """{"on": graph the preset?, "why": one line for the report}: on when the tests stage
    ended with every test of `graph_tests` passed (the user's own key wins)."""
    if any(str(o).startswith("dino.cuda_graphs=") for o in preset_overrides):
        return {"on": None, "why": "dino.cuda_graphs as campaign.preset_overrides sets it"}
    if tests is None or tests.status != "done":
        why = "the tests stage is not in campaign.stages" if tests is None else "the tests stage had not ended"
        return {"on": False, "why": f"without dino.cuda_graphs: {why}"}
    mine = {k: v for k, v in tests.outcomes.items() if k.split("::")[0] == graph_tests}
    bad = {k: v for k, v in mine.items() if v["outcome"] != "passed"}
    if not mine:
        return {"on": False, "why": f"without dino.cuda_graphs: no test of {graph_tests} ran"}
    if bad:
        seen = sorted({f"{v['outcome']}" + (f" ({v['message']})" if v.get("message") else "") for v in bad.values()})
        return {"on": False, "why": f"without dino.cuda_graphs: {len(bad)} of the {len(mine)} tests of {graph_tests} "
                                    f"did not pass: {'; '.join(seen)[:200]}"}
    return {"on": True, "why": f"with dino.cuda_graphs=true: the {len(mine)} tests of {graph_tests} passed"}


def classify(stage: Stage, rc: int, stopped_by: str | None) -> None:
    """What an exit code means for the stage: done, cut (continue next call) or failed."""
    stage.note = ""
    if stage.name == "tests":
        if rc in (0, 1, 5):  # all passed, some failed, none left to run
            stage.status = "done"
            failed = sum(v["outcome"] in ("failed", "error") for v in stage.outcomes.values())
            stage.note = f"{failed} test(s) failed: see their messages" if failed else ""
        elif stopped_by or rc < 0:
            stage.status = "cut"  # the tests with a result are not run again
        else:
            stage.status, stage.note = "failed", f"pytest could not run (exit {rc}): see campaign.log"
        return
    if rc == 0 or (stage.name in BENCH and rc == 1):
        stage.status = "done"
        if rc == 1:
            stage.note = "some bench lines failed (bench.json has their errors)"
    elif rc == PREEMPTED_EXIT or (stopped_by and rc < 0):
        if stopped_by == "budget":
            stage.status, stage.note = "done", f"stopped when its budget of {stage.budget_s:g} s was spent"
        else:
            stage.status = "cut"
    else:
        stage.status = "failed"
        stage.note = f"exit {rc}: see campaign.log"


# --------------------------------------------------------------------------- pytest's output

# `pytest -v`: "tests/test_x.py::test_y[a] PASSED   [ 40%]", "... SKIPPED (reason)   [ 50%]"
RESULT = re.compile(r"^(\S+?\.py::.+?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?: \((.*)\))?(?:\s+\[\s*\d+%\])?\s*$")
# `-rfE`'s summary: "FAILED tests/test_x.py::test_y - AssertionError: ..."
SUMMARY = re.compile(r"^(FAILED|ERROR) (\S+?\.py::\S.*?)(?: - (.*))?$")


def note_test_line(line: str, outcomes: dict) -> bool:
    """Record what one line of pytest's output says about a test; True if it said something."""
    m = RESULT.match(line)
    if m:
        node, word, reason = m.groups()
        entry = {"outcome": word.lower()}
        if reason:
            entry["message"] = reason[:300]
        outcomes[node] = entry  # a teardown ERROR after PASSED replaces it
        return True
    m = SUMMARY.match(line)
    if m and m.group(2) in outcomes:
        outcomes[m.group(2)]["message"] = (m.group(3) or "")[:300]
        return True
    return False
