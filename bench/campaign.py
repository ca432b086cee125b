"""`bash run.sh campaign [key=value ...]`: the whole GPU measurement as one command that is
simply called again until it says it is done.

The machines a GPU can be borrowed on give commands of about 10 minutes and forget their
files half a minute after a command ends. So one call runs the stages in order for at
most `campaign.call_s` seconds (counted from run.sh's start, its set-up included), each
as a subprocess; at the call's end the stage in flight gets SIGTERM, which the trainers
answer with a checkpoint and exit 75 (core/preempt.py) and the bench by finishing its
line. Everything stays in the campaign dir (`out`), and the next call continues from it
(`resume=auto`, `bench.resume=true`). A call prints what it did, what is left and whether
to call again, and writes the report folder: summary.json, campaign.log and each stage's
results, the only files a remote caller needs to copy back (bench/report.py).

Stages, in order of value (configs/method/campaign.yaml):
  preset   `dino resmlp_s12` (the Fashion-MNIST preset) to its last epoch, its k-NN curve
  bench    `bench` rows: the DINO step, end to end, k-NN, inference
  tests    pytest on the CUDA-only tests (`-m cuda`; on a CPU they all skip, and say so)
  compare  the preset with campaign.compare_overrides, for compare_budget_s of stage time

Exit codes: 0 every stage ended, 75 call again, 1 every stage ended and one failed (could
not run), 2 bad input. The orchestrator imports no torch (except to check for CUDA).
"""
from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from resmlp.bench.report import ReportError, write_report
from resmlp.core import preempt
from resmlp.core.config import CONFIG_DIR, as_list, to_dict
from resmlp.core.errors import PREEMPTED_EXIT, UserError
from resmlp.core.lock import RunLock

ROOT = CONFIG_DIR.parent
STAGES = ("preset", "bench", "tests", "compare")
PROFILES = ("gpu", "tiny")
STARTED_ENV = "RESMLP_CAMPAIGN_STARTED"   # run.sh's start (epoch seconds): the call's clock starts there
CUT_ENV = "RESMLP_CAMPAIGN_CUT"           # tests: a regex; the first output line it matches ends the call there
STATE = "campaign.json"
LOG = "campaign.log"
REPORT_FILES = ("summary.json", "campaign.log", "bench.json", "preset_results.json", "preset_log.jsonl",
                "compare_results.json", "compare_log.jsonl", "tests_junit.xml")


@dataclass
class Stage:
    name: str
    argv: list                # after the python executable
    dir: Path
    budget_s: float | None = None
    status: str = "pending"   # pending | cut (started, continues next call) | done | failed
    note: str = ""
    rc: int | None = None
    wall_s: float = 0.0
    runs: int = 0
    figures: dict = field(default_factory=dict)

    def ended(self) -> bool:
        return self.status in ("done", "failed")

    def state(self) -> dict:
        return {"status": self.status, "note": self.note, "rc": self.rc, "wall_s": round(self.wall_s, 1),
                "runs": self.runs}


# --------------------------------------------------------------------------- the plan

def plan(cfg, campaign_dir: Path) -> tuple[dict, list[Stage]]:
    """(the profile's settings, the stages asked for with their command lines)."""
    c = cfg.campaign
    if c.profile not in PROFILES:
        raise UserError(f"campaign.profile={c.profile!r} is not one of {', '.join(PROFILES)}")
    p = to_dict(c[c.profile])
    for key in ("stop_grace_s", "min_start_s", "bench_line_s"):
        if not isinstance(p[key], (int, float)) or p[key] < 0:
            raise UserError(f"campaign.{c.profile}.{key}={p[key]!r} must be a number >= 0")
    if c.call_s <= p["min_start_s"] + p["stop_grace_s"]:
        raise UserError(f"campaign.call_s={c.call_s} leaves no time for a stage: it must exceed "
                        f"min_start_s + stop_grace_s = {p['min_start_s'] + p['stop_grace_s']} s")
    names = [str(s) for s in as_list(c.stages)]
    unknown = [s for s in names if s not in STAGES]
    if unknown or not names:
        raise UserError(f"campaign.stages={names} must name some of {', '.join(STAGES)}")
    images = ["data=imagefolder", f"data.root={campaign_dir / 'images'}"] if p.get("images") else []
    preset = [*[str(a) for a in p["preset"]], *images, *[str(a) for a in as_list(c.preset_overrides)]]
    argvs = {
        "preset": ["-m", "resmlp.core.cli", "dino", "resmlp_s12", f"out={campaign_dir / 'preset'}", *preset],
        "bench": ["-m", "resmlp.core.cli", "bench", f"out={campaign_dir / 'bench'}", "bench.resume=true",
                  *[str(a) for a in p["bench"]]],
        "tests": ["-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={campaign_dir / 'tests' / 'junit.xml'}",
                  *[str(a) for a in p["tests"]]],
        "compare": ["-m", "resmlp.core.cli", "dino", "resmlp_s12", f"out={campaign_dir / 'compare'}", *preset,
                    *[str(a) for a in as_list(c.compare_overrides)]],
    }
    stages = [Stage(n, argvs[n], campaign_dir / n,
                    budget_s=float(c.compare_budget_s) if n == "compare" else None)
              for n in STAGES if n in names]
    return p, stages


# --------------------------------------------------------------------------- one call

def results_dir(cfg) -> Path:
    """The campaign dir (its report folder is made inside it unless campaign.report names another)."""
    return Path(str(cfg.out)).expanduser()


class Campaign:
    def __init__(self, cfg):
        self.cfg = cfg
        self.dir = Path(str(cfg.out)).expanduser().resolve()  # the stages run from the repository root
        self.p, self.stages = plan(cfg, self.dir)
        self.report_dir = Path(str(cfg.campaign.report)).expanduser() if cfg.campaign.report else self.dir / "report"
        now = time.time()
        started = _float(os.environ.get(STARTED_ENV))
        self.started = started if started is not None and now - float(cfg.campaign.call_s) < started <= now else now
        self.deadline = self.started + float(cfg.campaign.call_s)
        cut = os.environ.get(CUT_ENV)
        self.cut = re.compile(cut) if cut else None
        self.calls: list = []
        self.log = None

    # ---- state ----------------------------------------------------------------------------
    def load(self) -> None:
        path = self.dir / STATE
        if not path.exists():
            return
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read {path} ({e}); move it away to start the campaign again") from None
        commands = saved.get("commands", {})
        for s in self.stages:
            if s.name in commands and commands[s.name] != s.argv:
                raise UserError(f"{self.dir} holds a campaign whose {s.name} stage ran another command "
                                f"({shlex.join(commands[s.name])}); use the same keys to continue it, or out=<new dir>")
            s.__dict__.update({k: v for k, v in saved.get("stages", {}).get(s.name, {}).items()
                               if k in ("status", "note", "rc", "wall_s", "runs")})
            if s.status == "running":  # the call before was killed around it
                s.status = "cut"
        self.calls = saved.get("calls", [])

    def save(self) -> None:
        saved = {}
        path = self.dir / STATE
        if path.exists():
            saved = json.loads(path.read_text())
        commands = {**saved.get("commands", {}), **{s.name: s.argv for s in self.stages}}
        stages = {**saved.get("stages", {}), **{s.name: s.state() for s in self.stages}}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"commands": commands, "stages": stages, "calls": self.calls}, indent=2))
        tmp.replace(path)

    # ---- output -----------------------------------------------------------------------------
    def say(self, text: str) -> None:
        self.emit(f"campaign: {text}")

    def emit(self, line: str) -> None:
        """One line to stdout and campaign.log; a match of the injected cut ends the call here."""
        print(line, flush=True)
        if self.log is not None:
            self.log.write(line + "\n")
            self.log.flush()
        if self.cut is not None and self.cut.search(line):
            self.cut = None
            self.deadline = min(self.deadline, time.time() + float(self.p["stop_grace_s"]))

    # ---- the call ---------------------------------------------------------------------------
    def call(self) -> int:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log = open(self.dir / LOG, "a", buffering=1)
        record = {"call": len(self.calls) + 1, "started": _iso(self.started),
                  "setup_s": round(time.time() - self.started, 1), "call_s": float(self.cfg.campaign.call_s),
                  "ran": []}
        self.calls.append(record)
        self.say(f"call {record['call']} in {self.dir} (profile {self.cfg.campaign.profile}), "
                 f"{self.deadline - time.time():.0f} s left of {self.cfg.campaign.call_s:g} "
                 f"(set-up took {record['setup_s']:.0f} s)")
        try:
            if self.p.get("images"):
                self.make_images()
            for stage in self.stages:
                if stage.ended():
                    continue
                if not self.run_stage(stage, record):
                    break
        finally:
            record["wall_s"] = round(time.time() - self.started, 1)
            code = self.exit_code()
            record["exit"] = code
            self.save()
            try:
                self.finish(code)
            finally:
                self.log.close()
        return code

    def make_images(self) -> None:
        root = self.dir / "images"
        if not (root / "train").exists():
            from resmlp.bench.jpegs import make_jpeg_folder
            make_jpeg_folder(str(root), int(self.p["images"]), 36, 48)
            self.say(f"wrote {self.p['images']} synthetic JPEGs to {root} (the tiny profile's data)")

    def run_stage(self, stage: Stage, record: dict) -> bool:
        """Run (or continue) one stage in what is left of the call; False: the call is over."""
        p = self.p
        left = self.deadline - time.time()
        end = self.deadline
        if stage.budget_s is not None:
            budget_left = stage.budget_s - stage.wall_s
            if budget_left < p["min_start_s"]:
                stage.status, stage.note = "done", f"its budget of {stage.budget_s:g} s is spent"
                self.say(f"{stage.name}: {stage.note}")
                return True
            end = min(end, time.time() + budget_left)
        if min(left, end - time.time()) < p["min_start_s"]:
            self.say(f"{stage.name}: {left:.0f} s left, under campaign.{self.cfg.campaign.profile}.min_start_s="
                     f"{p['min_start_s']:g}: not started in this call")
            return False
        argv = list(stage.argv)
        if stage.name == "bench":
            limit = end - time.time() - p["stop_grace_s"] - p["bench_line_s"]
            if limit < 1:
                self.say(f"bench: too little time left for a line; not started in this call")
                return False
            argv.append(f"bench.time_limit_s={limit:.0f}")
        stage.dir.mkdir(parents=True, exist_ok=True)
        stage.status, stage.runs = "running", stage.runs + 1
        self.save()
        verb = "continues" if stage.runs > 1 else "starts"
        self.say(f"{stage.name} {verb} (run {stage.runs}): {shlex.join(['python', *argv])}")
        t0 = time.time()
        rc, stopped_by = self.supervise(argv, end, budget=stage.budget_s is not None)
        took = time.time() - t0
        stage.wall_s += took
        stage.rc = rc
        record["ran"].append({"stage": stage.name, "rc": rc, "wall_s": round(took, 1)})
        self.classify(stage, rc, stopped_by)
        self.say(f"{stage.name}: {stage.status} after {took:.0f} s (exit {rc}){': ' + stage.note if stage.note else ''}")
        return stage.ended() and time.time() < self.deadline

    def supervise(self, argv: list, end: float, budget: bool) -> tuple[int, str | None]:
        """Run argv until it exits; SIGTERM stop_grace_s before `end` (or the call's deadline,
        which an injected cut or a signal to this process may bring forward), SIGKILL at it.
        Returns (exit code, what stopped it: None, 'call', 'budget')."""
        grace = float(self.p["stop_grace_s"])
        proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1, errors="replace", start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})  # lines as they come, into the log
        reader = threading.Thread(target=self._pump, args=(proc,), daemon=True)
        reader.start()
        stopped_by = None
        try:
            while proc.poll() is None:
                if preempt.requested():  # this call itself was asked to stop
                    self.deadline = min(self.deadline, time.time() + grace)
                hard = min(end, self.deadline)
                now = time.time()
                if stopped_by is None and now >= hard - grace:
                    stopped_by = "budget" if budget and end < self.deadline else "call"
                    self.say(f"stopping the stage (SIGTERM): {'its budget' if stopped_by == 'budget' else 'the call'}"
                             f" ends in {max(0.0, hard - now):.0f} s")
                    proc.send_signal(signal.SIGTERM)
                if now >= hard:
                    self.say("the stage did not stop in time: killed (it continues from its last checkpoint)")
                    os.killpg(proc.pid, signal.SIGKILL)
                    break
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
            reader.join(timeout=10)
        return rc, stopped_by

    def _pump(self, proc) -> None:
        for line in proc.stdout:
            self.emit(line.rstrip("\n"))

    def classify(self, stage: Stage, rc: int, stopped_by: str | None) -> None:
        """What an exit code means for the stage: done, cut (continue next call) or failed."""
        stage.note = ""
        if stage.name == "tests":
            if rc in (0, 1, 5):
                stage.status = "done"
            elif stopped_by or rc < 0:
                stage.status = "cut"  # pytest has no checkpoint: the next call runs it again
            else:
                stage.status, stage.note = "failed", f"pytest could not run (exit {rc}): see campaign.log"
            return
        if rc == 0 or (stage.name == "bench" and rc == 1):
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

    def exit_code(self) -> int:
        if not all(s.ended() for s in self.stages):
            return PREEMPTED_EXIT
        return 1 if any(s.status == "failed" for s in self.stages) else 0

    # ---- summary and report ---------------------------------------------------------------
    def finish(self, code: int) -> None:
        for s in self.stages:
            s.figures = figures(s)
        summary = self.summary(code)
        sources = {"summary.json": summary, "campaign.log": self.dir / LOG,
                   "bench.json": self.dir / "bench" / "bench.json",
                   "preset_results.json": self.dir / "preset" / "results.json",
                   "preset_log.jsonl": self.dir / "preset" / "log.jsonl",
                   "compare_results.json": self.dir / "compare" / "results.json",
                   "compare_log.jsonl": self.dir / "compare" / "log.jsonl",
                   "tests_junit.xml": self.dir / "tests" / "junit.xml"}
        assert tuple(sources) == REPORT_FILES
        self.say("stage    status   " + "what")
        for s in self.stages:
            self.emit(f"  {s.name:<8} {s.status:<8} {describe(s)}")
        left = [s.name for s in self.stages if not s.ended()]
        if code == PREEMPTED_EXIT:
            self.say(f"left: {', '.join(left)}. CALL AGAIN within 30 s (before the machine forgets this dir) "
                     f"with the same command")
        else:
            self.say("every stage ended" + (" (one failed: see above)" if code else "") + "; nothing to call again for")
        self.say(f"report: {self.report_dir} (exit {code})")
        try:
            write_report(self.report_dir, sources)
        except ReportError as e:
            raise UserError(f"campaign.report: {e}") from None

    def summary(self, code: int) -> dict:
        return {"campaign": str(self.dir), "profile": str(self.cfg.campaign.profile), "exit": code,
                "call_again": code == PREEMPTED_EXIT,
                "left": [s.name for s in self.stages if not s.ended()],
                "stages": [{"name": s.name, **s.state(), "budget_s": s.budget_s, "command": ["python", *s.argv],
                            **s.figures} for s in self.stages],
                "calls": self.calls, "settings": to_dict(self.cfg.campaign)}


# --------------------------------------------------------------------------- what each stage gave

def figures(stage: Stage) -> dict:
    try:
        if stage.name in ("preset", "compare"):
            return train_figures(stage.dir)
        if stage.name == "bench":
            return bench_figures(stage.dir / "bench.json")
        return test_figures(stage.dir / "junit.xml")
    except (OSError, ValueError, ET.ParseError) as e:  # a file cut short by a kill: say so, go on
        return {"figures_error": f"{type(e).__name__}: {e}"}


def train_figures(run_dir: Path) -> dict:
    out: dict = {}
    log = run_dir / "log.jsonl"
    if log.exists():
        records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        trained = [r for r in records if "loss" in r]
        if trained:
            out["epochs_trained"] = round(trained[-1]["epoch"], 2)
            out["images_per_s_last"] = round(trained[-1].get("images_per_s", 0.0), 1)
        out["knn_curve"] = [[r["epoch"], round(r["knn_top1"], 2)] for r in records if "knn_top1" in r]
    results = run_dir / "results.json"
    if results.exists():
        r = json.loads(results.read_text())
        out["results"] = {k: r.get(k) for k in ("epochs", "knn_top1", "linear_top1", "init_knn_top1",
                                                "train_images_per_s", "device", "timing")}
    return out


def bench_figures(path: Path) -> dict:
    if not path.exists():
        return {}
    b = json.loads(path.read_text())
    status: dict = {}
    for r in b.get("rows", []):
        status[r["status"]] = status.get(r["status"], 0) + 1
    return {"bench_runs": b.get("runs"), "lines": status, "left": b.get("left"),
            "goals": [s["text"] + ("" if s["met"] is None else " [met]" if s["met"] else " [open]")
                      for s in b.get("summary", [])]}


def test_figures(path: Path) -> dict:
    if not path.exists():
        return {}
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    out = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    out["passed"] = out["tests"] - out["failures"] - out["errors"] - out["skipped"]
    out["failed"] = [f"{c.get('classname')}::{c.get('name')}: {(c[0].get('message') or '').splitlines()[0][:200]}"
                     for c in suite.iter("testcase") if len(c) and c[0].tag in ("failure", "error")]
    reasons = {(c[0].get("message") or "") for c in suite.iter("testcase") if len(c) and c[0].tag == "skipped"}
    out["skip_reasons"] = sorted(reasons)
    return out


def describe(s: Stage) -> str:
    f, parts = s.figures, []
    if s.name in ("preset", "compare"):
        if "epochs_trained" in f:
            parts.append(f"{f['epochs_trained']:g} epochs trained")
        if f.get("knn_curve"):
            parts.append(f"k-NN {f['knn_curve'][-1][1]:.2f} at epoch {f['knn_curve'][-1][0]}")
        if "results" in f:
            t = f["results"].get("timing") or {}
            parts.append(f"final k-NN {f['results']['knn_top1']:.2f}; training {t.get('train_s', 0):.0f} s over "
                         f"{len(t.get('starts', []))} start(s), uninterrupted about {t.get('uninterrupted_s', 0):.0f} s")
    elif s.name == "bench" and f:
        parts.append(f"lines {f['lines']}, {f.get('left') or 0} left")
    elif s.name == "tests" and f:
        parts.append(f"{f['passed']} passed, {f['failures'] + f['errors']} failed, {f['skipped']} skipped"
                     + (f" ({'; '.join(f['skip_reasons'])[:120]})" if f["skipped"] else ""))
    if s.note:
        parts.append(s.note)
    return "; ".join(parts) or "-"


def _float(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="seconds")


def check_cuda(cfg) -> None:
    if cfg.campaign.profile != "gpu":
        return
    import torch
    if not torch.cuda.is_available():
        raise UserError("campaign.profile=gpu measures a GPU and none is visible; campaign.profile=tiny runs "
                        "every stage at test size on this CPU")


def run(cfg) -> int:
    campaign = Campaign(cfg)
    check_cuda(cfg)
    lock = RunLock(campaign.dir)
    try:
        campaign.dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the campaign dir {campaign.dir} ({e.strerror}); choose another out=") from None
    warning = lock.acquire()
    if warning:
        print(f"campaign: {warning}", flush=True)
    try:
        campaign.load()
        with preempt.watch((signal.SIGINT,)):
            return campaign.call()
    finally:
        lock.release()
