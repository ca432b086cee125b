"""The campaign's training stages: `dino resmlp_s12` to its last epoch (the preset), or the
preset with other keys for a budget of stage time (compare), and the default command for one
short epoch with its resume, first of all (DefaultStage). No torch import (except for
Fashion-MNIST's size).

Under a window one starts only when its predicted time fits (predict.py).
A stop signal makes the trainer save a checkpoint and exit 75; the next call on the same
machine resumes from it. A fresh machine continues from a carried report: the stage that
was under way starts again from epoch 0 (its checkpoint stayed behind), and its earlier
attempts stay in its log, after which a line {"restart": n} starts the next. The preset
runs as a user types it, without CUDA graphs only when a graph test failed in this
campaign (PresetStage).
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from campaign.predict import measured, predict, schedule, train_images
from campaign.stages import Stage
from campaign.tests import TestsStage
from resmlp.core.config import load_config

RESTORED = "restored"   # in the campaign dir: the training stages' files a report brought back
FILES = ("log.jsonl", "results.json")


@dataclass(kw_only=True)
class TrainingStage(Stage):
    config: tuple             # (command, model, overrides) of its run, for the prediction
    budget_s: float | None = None  # stage time over all calls (compare); None: to its last epoch
    attempt: int = 1          # 2 after a fresh machine lost the first one's checkpoint
    restart: bool = False     # the next start begins again from epoch 0 (a fresh machine)
    prediction: dict | None = None  # the last prediction of its time, and its terms

    KEPT = (*Stage.KEPT, "attempt", "restart", "prediction")

    # ---- its files --------------------------------------------------------------------------
    def restored(self, file: str) -> Path:
        return self.dir.parent / RESTORED / f"{self.name}_{file}"

    def log(self) -> bytes | None:
        """Its log.jsonl with its earlier attempts first (a report brought them back)."""
        parts = [p.read_bytes() for p in (self.restored("log.jsonl"), self.dir / "log.jsonl") if p.is_file()]
        return b"".join(parts) if parts else None

    def results(self) -> Path:
        live = self.dir / "results.json"
        return live if live.is_file() else self.restored("results.json")

    def continue_from_report(self, folder, figures, call):
        for file in FILES:
            if (folder / f"{self.name}_{file}").is_file():
                self.restored(file).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(folder / f"{self.name}_{file}", self.restored(file))
        if self.status == "pending":
            return f"{self.name} has not started yet"
        if self.status != "cut":
            return None
        if self.restart:  # an earlier fresh machine lost its checkpoint, and it has not started since
            return (f"{self.name} starts again from epoch 0 (attempt {self.attempt}, not started since call "
                    f"{call - 1} or earlier)")
        lost = figures.get("epochs_trained", 0)
        self.attempt, self.restart = self.attempt + 1, True
        self.note = f"attempt {self.attempt} from epoch 0 (call {call}): the checkpoint of epoch {lost:g} stayed behind"
        log = self.restored("log.jsonl")
        log.parent.mkdir(parents=True, exist_ok=True)  # a call killed before the stage reported carries no log
        text = log.read_text() if log.exists() else ""
        log.write_text(text + ("" if not text or text.endswith("\n") else "\n")
                       + json.dumps({"restart": self.attempt, "call": call, "from_epoch": 0, "lost_epochs": lost})
                       + "\n")
        return f"{self.name} starts again from epoch 0 (its checkpoint of epoch {lost:g} stayed on the old machine)"

    # ---- its time ---------------------------------------------------------------------------
    def budget_left_s(self):
        return None if self.budget_s is None else self.budget_s - self.wall_s

    def predict(self, p, constants_name, say=None):
        """Its time from its config, and from its own log where an attempt of this campaign
        measured a term (predict.py); kept in its state."""
        command, model, overrides = self.config
        cfg = load_config(command, model, overrides)
        images = train_images(cfg, p.get("images"))
        if images is None:
            if say:
                say(f"{self.name}: no prediction of its time (the size of data={cfg.data.name} is not known here): "
                    "min_start_s stands for it")
            self.prediction = None
            return None
        sched = schedule(cfg, images)
        resumes = self.status == "cut" and not self.restart  # from its checkpoint, on this machine
        from_epoch = float(self.figures.get("epochs_trained", 0.0)) if resumes else 0.0
        seen = measured(self.log(), sched["images_per_epoch"], sched["eval_every"])
        self.prediction = predict(sched, p["predict"], seen, constants_name, from_epoch)
        if say:
            sources = sorted({f"{v}" for v in self.prediction["from"].values()})
            say(f"{self.name}: predicted {self.prediction['need_s']:.0f} s = {self.prediction['text']} "
                f"(from {'; '.join(sources)})")
        return self.prediction

    def requirement(self, p, window, predicted):
        """Under a window its whole run: its prediction (at least min_start_s; with a budget at
        most what is left of it before its stop signal). Without a window it resumes from its
        checkpoint on the same machine: min_start_s."""
        if not window or predicted is None:
            return super().requirement(p, window, predicted)
        need = max(self.min_start_s, predicted["need_s"])
        if self.budget_s is not None:  # it ends when its budget is spent: its stop signal comes grace s before
            need = min(need, max(self.min_start_s, self.budget_s - self.wall_s - float(p["stop_grace_s"])))
        return need, f"predicted {predicted['need_s']:.0f} s"

    # ---- a run ------------------------------------------------------------------------------
    def begin(self, need_s, why):
        verb = super().begin(need_s, why)
        if self.runs > 1 and self.restart:
            verb = f"starts again from epoch 0 (attempt {self.attempt})"
        self.restart = False
        return verb

    def heard(self, line):
        return "knn top1=" in line

    def classify(self, rc, stopped_by):
        super().classify(rc, stopped_by)
        if self.status == "cut" and stopped_by == "budget":
            self.status, self.note = "done", f"stopped when its budget of {self.budget_s:g} s was spent"

    def after_run(self, took_s):
        if self.prediction is not None and self.status == "done":
            self.prediction["took_s"] = round(took_s, 1)  # its whole run, against what was predicted

    # ---- the report -------------------------------------------------------------------------
    def figures_from_files(self):
        attempts: list = [[]]
        for line in (self.log() or b"").decode(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # the last line, cut short by a kill
            if "restart" in record:
                attempts.append([])
            else:
                attempts[-1].append(record)
        out = _attempt(attempts[-1])
        if len(attempts) > 1:
            out["earlier_attempts"] = [_attempt(a) for a in attempts[:-1]]
        if self.results().is_file():
            r = json.loads(self.results().read_text())
            out["results"] = {k: r.get(k) for k in ("epochs", "knn_top1", "linear_top1", "init_knn_top1",
                                                    "train_images_per_s", "device", "wall_time_s", "timing")}
        return out

    def summary(self):
        return {**super().summary(), "budget_s": self.budget_s}

    def report_files(self):
        files = {f"{self.name}_results.json": self.results()}
        log = self.log()
        if log is not None:
            files[f"{self.name}_log.jsonl"] = log
        return files

    def parts(self):
        f, parts = self.figures, []
        if self.attempt > 1:
            parts.append(f"attempt {self.attempt}")
        if "epochs_trained" in f:
            parts.append(f"{f['epochs_trained']:g} epochs trained")
        if f.get("knn_curve"):
            parts.append(f"k-NN {f['knn_curve'][-1][1]:.2f} at epoch {f['knn_curve'][-1][0]}")
        if "results" in f:
            t = f["results"].get("timing") or {}
            parts.append(f"final k-NN {f['results']['knn_top1']:.2f}; training {t.get('train_s', 0):.0f} s over "
                         f"{len(t.get('starts', []))} start(s), uninterrupted about "
                         f"{t.get('uninterrupted_s', 0):.0f} s")
        return parts


def _attempt(records: list) -> dict:
    out: dict = {}
    trained = [r for r in records if "loss" in r]
    if trained:
        out["epochs_trained"] = round(trained[-1]["epoch"], 2)
        out["images_per_s_last"] = round(trained[-1].get("images_per_s", 0.0), 1)
    out["knn_curve"] = [[r["epoch"], round(r["knn_top1"], 2)] for r in records if "knn_top1" in r]
    return out


@dataclass(kw_only=True)
class PresetStage(TrainingStage):
    """The preset: the command a user types, its graphs as dino.cuda_graphs' default decides,
    except after a graph test failed in this campaign (dino.cuda_graphs=false then: a capture
    that fails must not cost the window its preset); decided at its first start and kept (a
    resumed run keeps its config)."""
    tests: TestsStage | None = None  # the campaign's tests stage, if campaign.stages has one
    graph_tests: str = ""
    user_overrides: list = ()       # campaign.preset_overrides: the user's own dino.cuda_graphs wins
    graphs: dict | None = None      # {"add": the key added, or None, "why": str}

    KEPT = (*TrainingStage.KEPT, "graphs")

    def launch(self, usable_s):
        if self.graphs is None:
            self.graphs = graphs_decision(self.tests, self.graph_tests, list(self.user_overrides))
        return [*self.argv, *([self.graphs["add"]] if self.graphs["add"] else [])]

    def start_note(self):
        return self.graphs["why"]

    def parts(self):
        return [*super().parts(), *([self.graphs["why"]] if self.graphs else [])]


def graphs_decision(tests: TestsStage | None, graph_tests: str, preset_overrides: list) -> dict:
    """{"add": a key for the preset's command or None, "why": one line for the report}:
    dino.cuda_graphs=false when the tests stage ended with a test of `graph_tests` that did
    not pass; else nothing (the user's own key wins too)."""
    if any(str(o).startswith("dino.cuda_graphs=") for o in preset_overrides):
        return {"add": None, "why": "dino.cuda_graphs as campaign.preset_overrides sets it"}
    if tests is None or tests.status != "done":
        why = "the tests stage is not in campaign.stages" if tests is None else "the tests stage had not ended"
        return {"add": None, "why": f"the default command ({why})"}
    ran, bad = tests.passed_all(graph_tests)
    if not ran:
        return {"add": None, "why": f"the default command (no test of {graph_tests} ran)"}
    if bad:
        seen = sorted({f"{v['outcome']}" + (f" ({v['message']})" if v.get("message") else "") for v in bad.values()})
        return {"add": "dino.cuda_graphs=false", "why": f"with dino.cuda_graphs=false: {len(bad)} of the {ran} tests "
                                                        f"of {graph_tests} did not pass: {'; '.join(seen)[:200]}"}
    return {"add": None, "why": f"the default command: the {ran} tests of {graph_tests} passed"}


# --------------------------------------------------------------------------- the default command

START = re.compile(r"^\[starts\] start (\d+) of \d+: (.*)$")   # campaign/starts.py's MARK
# The lines of a start the report keeps, by kind: its device and precision, the path its step
# takes (and any fallback from it), its compile cache, a resume, warnings and errors: a user's
# one line, or a traceback's last (an exception's name and message)
LINES = {"device": r"device: ", "path": r"(path|compile off|graphs off): ", "compile_cache": r"compile cache: ",
         "notes": r"resuming from |warning: |error: |[\w.]+(Error|Exception|Failed)(: |$)"}
MAX_LINES = 12   # of a kind per start: a line repeated every epoch does not fill the report
# what the report keeps of a start's results.json: its own timing (timing.starts' last), its peak
# memory, and under "results" what the run chose and reached
TIMING = ("at_iteration", "startup_s", "first_iteration_s")
MEMORY = ("peak_mem_mb", "peak_reserved_mb")
RESULTS = ("path", "precision", "device", "knn_top1", "train_images_per_s")


@dataclass(kw_only=True)
class DefaultStage(Stage):
    """The default command, `dino resmlp_s12`, as a user types it (the campaign adds out= and
    the short length): one epoch, then its resume for a second (campaign/starts.py: each start
    with an empty Inductor cache, so the second compiles from what the first saved in its
    compile cache, and captures its graph again). First in the order: a GPU window says in its
    first minutes whether the default works. Per start the report keeps the lines it printed
    about its device, its path, its compile cache (and a resume, warnings, errors) and, from
    its results.json, its start-up and first iteration, peak memory, k-NN and path; in the
    stage's state, since the run dir stays on the machine. Both starts run again at every
    start of the stage (its min_start_s is their whole time)."""
    starts: list = field(default_factory=list)  # per start: its command, the lines kept, its results' figures

    KEPT = (*Stage.KEPT, "starts")

    def launch(self, usable_s):
        shutil.rmtree(self.dir, ignore_errors=True)   # the first start cold, a rerun's too
        self.dir.mkdir(parents=True)
        self.starts = []
        return list(self.argv)

    def heard(self, line):
        m = START.match(line)
        if m:
            self.starts.append({"start": int(m.group(1)), "command": m.group(2), "lines": {}})
            return True
        kind = next((k for k, pattern in LINES.items() if re.match(pattern, line)), None)
        if kind is None or not self.starts:
            return False
        kept = self.starts[-1]["lines"].setdefault(kind, [])
        if len(kept) < MAX_LINES:
            kept.append(line[:300])
        return True

    def classify(self, rc, stopped_by):
        super().classify(rc, stopped_by)
        errors = [(s["start"], line) for s in self.starts for line in s["lines"].get("notes", [])
                  if not line.startswith(("resuming from ", "warning: "))]
        if self.status == "failed" and errors:
            self.note = f"start {errors[-1][0]} exit {rc}: {errors[-1][1]}"

    def after_run(self, took_s):
        self.starts = self.with_results()   # the run dir stays on this machine: the state keeps its figures

    def with_results(self) -> list:
        """Each start's entry with the figures of the results.json it left (starts.py --keep)."""
        out = []
        for entry in self.starts:
            path = self.dir / f"start{entry['start']}_results.json"
            if path.is_file():
                r = json.loads(path.read_text())
                timing = (r.get("timing") or {}).get("starts") or [{}]
                entry = {**entry, **{k: timing[-1].get(k) for k in TIMING}, **{k: r.get(k) for k in MEMORY},
                         "results": {k: r.get(k) for k in RESULTS}}
            out.append(entry)
        return out

    def figures_from_files(self):
        return {"starts": self.with_results()}

    def parts(self):
        parts, path = [], []
        for s in self.figures.get("starts", []):
            lines = s["lines"]
            said = lines.get("path", [])[:1] if lines.get("path", [])[:1] != path else []   # the first, or another
            path = lines.get("path", [])[:1]
            if s.get("first_iteration_s") is not None:
                said.append(f"first iteration {s['first_iteration_s']:.1f} s (start-up {s['startup_s']:.0f} s)")
            if s.get("peak_mem_mb"):   # none on a CPU
                said.append(f"peak {s['peak_mem_mb'] / 1024:.1f} GiB allocated, {s['peak_reserved_mb'] / 1024:.1f} "
                            "reserved")
            said += [line for line in lines.get("compile_cache", []) if " loaded " in line or " saved " in line][:1]
            parts.append(f"start {s['start']}: " + (", ".join(said) or "no figures"))
        return parts
