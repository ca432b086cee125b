"""`bash run.sh campaign [key=value ...]`: the whole GPU measurement as one command that is
simply called again until it says it is done.

The machines a GPU can be borrowed on give a window of device time (15 minutes for all
calls, each machine's start and idle waits included), commands of at most 10 minutes,
forget their files half a minute after a command ends, kill a command that outruns its
limit with everything in its process group, and hand back a few small files. So one call
runs the stages (plan.py) in campaign.stages' order until the earlier of `campaign.call_s`
seconds (counted from run.sh's start, its set-up included) and the window's end
(`campaign.window_left_s`, what the device tool said was left when the call was asked for,
less a fresh machine's start and a margin), each as a subprocess in the campaign's own
process group (a kill of the call ends it too). A stage starts only when what it needs fits
before the call's stop signal (its kind's requirement, stages.py: a bench stage its longest
line, a training stage its predicted time, predict.py); when only a later call of the
window could fit it, this call ends there; when none could, it is not started in this
window and the call goes on with the next stage. At the call's end the stage in flight gets
SIGTERM, which the trainers answer with a checkpoint and exit 75 (core/preempt.py) and the
bench by finishing its line. The report folder (report.py) is rewritten at the call's
start, after every stage, bench line, k-NN and test, and at least every
campaign.report_every_s, so a call killed at any point hands back what it measured. The
next call continues from the campaign dir (`out`, state.py) on a warm machine, or from the
report carried in (`campaign.from_report`) on a fresh one. A call prints what it did, what
is left and whether to call again.

Exit codes: 75 call again (a stage left can still run in this window), 0 nothing more to
call for (every stage ended, or what is left needs another window), 1 the same and a stage
failed (could not run), 2 bad input. The orchestrator imports no torch (except to check
for CUDA, for the preset's demo=auto, which is no demo on a GPU, and for Fashion-MNIST's size).
"""
from __future__ import annotations

import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.process import child_env
from campaign import report as R
from campaign import state as S
from campaign.bench import BenchStage
from campaign.config import YAML
from campaign.folder import ReportError, write_report
from campaign.folder import problem as report_problem
from campaign.plan import not_asked, plan
from campaign.stages import decide
from resmlp.core import cli, preempt
from resmlp.core.config import to_dict
from resmlp.core.errors import PREEMPTED_EXIT, UserError
from resmlp.core.lock import RunLock

ROOT = Path(__file__).resolve().parents[2]  # the repository: the stages run there
STARTED_ENV = "RESMLP_CAMPAIGN_STARTED"   # run.sh's start (epoch seconds): the call's clock starts there
REPORT_FILES = R.REPORT_FILES


def results_dir(cfg) -> Path:
    """The campaign dir (its report folder is made inside it unless campaign.report names another)."""
    return Path(str(cfg.out)).expanduser()


class Campaign:
    def __init__(self, cfg):
        self.cfg = cfg
        c = cfg.campaign
        self.dir = Path(str(cfg.out)).expanduser().resolve()  # the stages run from the repository root
        self.p, self.stages = plan(cfg, self.dir)
        self.others = not_asked(cfg, self.dir, self.stages)  # their files stay in the report
        self.by_name = {s.name: s for s in self.stages}
        self.report_dir = Path(str(c.report)).expanduser() if c.report else self.dir / "report"
        self.from_report = Path(str(c.from_report)).expanduser() if c.from_report else None
        why = report_problem(self.report_dir, REPORT_FILES)
        if why:
            raise UserError(f"campaign.report: {why}")
        if self.from_report and self.from_report.resolve() == self.report_dir.resolve():
            raise UserError(f"campaign.from_report and campaign.report are both {self.report_dir}: carry the last "
                            "report in under another name (tools/campaign/README.md)")
        self.carried = R.read_report(self.from_report)  # checked now, before any work
        if self.carried is not None:
            S.check_same(self.carried["state"], str(c.profile), self.stages, self.dir, self.from_report)
        now = time.time()
        started = _float(os.environ.get(STARTED_ENV))
        self.started = started if started is not None and now - float(c.call_s) < started <= now else now
        self.fresh = True  # the campaign dir held no state: this machine was started for this call (load())
        self.window_end = self.deadline = None
        self.set_deadline()  # again once load() knows the machine
        self.calls: list = []
        self.log = None
        self.restored = None      # what the call says about a report it continued from
        self.want_report = False  # set by the output reader: something was measured
        self.guard = threading.Lock()
        self.reported_at = 0.0

    # ---- state ----------------------------------------------------------------------------
    def load(self) -> None:
        self.fresh = S.read_state(self.dir) is None
        self._load()
        self.set_deadline()

    def set_deadline(self) -> None:
        """The call ends at campaign.call_s from run.sh's start or at the window's end, which
        comes first. The window's seconds were counted when the call was asked for: a fresh
        machine's start (start_s) came out of them before run.sh started, and the transfers
        around the call come out of them after (window_margin_s)."""
        c = self.cfg.campaign
        self.deadline = self.started + float(c.call_s)
        self.window_end = None
        if c.window_left_s is not None:
            start = float(self.p["start_s"]) if self.fresh else 0.0
            self.window_end = self.started + float(c.window_left_s) - start - float(self.p["window_margin_s"])
            self.deadline = min(self.deadline, self.window_end)

    def _load(self) -> None:
        saved = S.read_state(self.dir)
        if saved is None and self.carried is not None:
            self.restored = R.restore(self.from_report, self.carried, self.dir, len(self.carried["state"]["calls"]) + 1,
                                      [*self.stages, *self.others])
            saved = S.read_state(self.dir)
        elif saved is None and self.from_report is not None:
            self.restored = f"no report in {self.from_report} to continue from: a new campaign"
        if saved is None:
            return
        S.check_same(saved, str(self.cfg.campaign.profile), self.stages, self.dir, self.dir)
        for s in self.stages:
            s.take(saved.get("stages", {}).get(s.name, {}))
        self.calls = saved.get("calls", [])

    def state(self) -> dict:
        return S.state(S.read_state(self.dir), str(self.cfg.campaign.profile), self.dir, self.stages, self.calls)

    # ---- output -----------------------------------------------------------------------------
    def say(self, text: str) -> None:
        self.emit(f"campaign: {text}")

    def emit(self, line: str, stage=None) -> None:
        """One line to stdout and campaign.log; what it measured asks for a report."""
        print(line, flush=True)
        if self.log is not None:
            self.log.write(line + "\n")
            self.log.flush()
        if stage is not None:
            with self.guard:  # what the stage keeps of its output is read by report() in the main thread
                if stage.heard(line):
                    self.want_report = True

    # ---- the call ---------------------------------------------------------------------------
    def call(self) -> int:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log = open(self.dir / S.LOG, "a", buffering=1)
        device = self.device()
        earlier = sorted({c.get("device") for c in self.calls} - {None, device})
        c = self.cfg.campaign
        record = {"call": len(self.calls) + 1, "started": _iso(self.started),
                  "setup_s": round(time.time() - self.started, 1), "call_s": float(c.call_s),
                  "window_left_s": c.window_left_s, "fresh_machine": self.fresh,
                  "ends_after_s": round(self.deadline - self.started, 1),
                  "ends_by": "window" if self.window_end is not None and self.window_end < self.started + c.call_s
                  else "call_s", "device": device, "ran": [], "not_started": []}
        self.calls.append(record)
        setup = f"set-up took {record['setup_s']:.0f} s"
        if self.window_end is None:
            left = f"{self.deadline - time.time():.0f} s left of campaign.call_s={c.call_s:g} (no window; {setup})"
        else:
            window = (f"campaign.window_left_s={c.window_left_s:g} less "
                      + (f"{self.p['start_s']:g} s for this fresh machine's start and " if self.fresh else "")
                      + f"{self.p['window_margin_s']:g} s of margin: {self.window_end - self.started:.0f} s")
            left = (f"{self.deadline - time.time():.0f} s left: the call ends {record['ends_after_s']:.0f} s after "
                    f"run.sh's start, by {'the window' if record['ends_by'] == 'window' else 'campaign.call_s'} "
                    f"(campaign.call_s={c.call_s:g}; {window}; {setup})")
        self.say(f"call {record['call']} in {self.dir} (profile {self.cfg.campaign.profile}, {device}): "
                 + (f"{self.restored}. {left}" if self.restored else left))
        if earlier:
            self.say(f"warning: earlier calls ran on {', '.join(earlier)}: this call's figures come from another "
                     "card (name the device tool's kind in every call)")
        code = PREEMPTED_EXIT
        try:
            self.report(code)
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
            try:
                self.finish(code)
            finally:
                self.log.close()
        return code

    def make_images(self) -> None:
        root = self.dir / "images"
        if not (root / "train").exists():
            from bench.jpegs import make_jpeg_folder
            make_jpeg_folder(str(root), int(self.p["images"]), 36, 48)
            self.say(f"wrote {self.p['images']} synthetic JPEGs to {root} (the tiny profile's data)")

    def run_stage(self, stage, record: dict) -> bool:
        """Run (or continue) one stage in what is left of the call, if what it needs fits;
        False: the call is over."""
        grace = float(self.p["stop_grace_s"])
        end = self.deadline
        budget_left = stage.budget_left_s()
        if budget_left is not None:
            if budget_left < stage.min_start_s + grace:
                stage.status, stage.note = "done", f"its budget is spent ({stage.wall_s:.0f} s of stage time)"
                self.say(f"{stage.name}: {stage.note}")
                return True
            end = min(end, time.time() + budget_left)
        usable = end - time.time() - grace  # before its stop signal
        need, why = self.requirement(stage, say=True)
        later = self.next_call_s()
        verdict = decide(need, usable, later)
        if verdict != "start":
            record["not_started"].append({"stage": stage.name, "need_s": round(need, 1), "left_s": round(usable, 1),
                                          "next_call_s": round(later, 1), "verdict": verdict})
            if verdict == "next_call":
                stage.note = f"not started in call {record['call']}: needs {need:.0f} s ({why}), {usable:.0f} s left"
                self.say(f"{stage.name}: needs {need:.0f} s ({why}), {usable:.0f} s left before this call's stop "
                         f"signal: not started in this call; a next call of this window has up to {later:.0f} s, so "
                         "this one ends here")
                return False
            stage.note = (f"not started in call {record['call']}: needs {need:.0f} s ({why}), more than this window "
                          f"has left ({max(usable, later, 0):.0f} s)")
            self.say(f"{stage.name}: needs {need:.0f} s ({why}); {usable:.0f} s left in this call and at most "
                     f"{max(later, 0):.0f} s in a next call of this window: not started in this window")
            return True
        argv = stage.launch(usable)
        stage.dir.mkdir(parents=True, exist_ok=True)
        verb = stage.begin(need, why)
        if stage.start_note():
            self.say(f"{stage.name}: {stage.start_note()}")
        self.say(f"{stage.name} {verb} (run {stage.runs}): {shlex.join(['python', *argv])}")
        self.report(PREEMPTED_EXIT)
        t0 = time.time()
        rc, stopped_by = self.supervise(stage, argv, end)
        took = time.time() - t0
        stage.wall_s += took
        stage.rc = rc
        record["ran"].append({"stage": stage.name, "rc": rc, "wall_s": round(took, 1)})
        stage.classify(rc, stopped_by)
        stage.took(took)
        stage.after_run(took)
        note = f": {stage.note}" if stage.note else ""
        self.say(f"{stage.name}: {stage.status} after {took:.0f} s (exit {rc}){note}")
        self.report(PREEMPTED_EXIT)
        return stage.ended() and time.time() < self.deadline

    def supervise(self, stage, argv: list, end: float) -> tuple[int, str | None]:
        """Run argv until it exits, in this process group (a kill of the call ends it too);
        SIGTERM stop_grace_s before `end` (or the call's deadline, which a signal to this
        process may bring forward), SIGKILL to it and its children at it.
        The report is rewritten when the stage measured something and every report_every_s.
        Returns (exit code, what stopped it: None, 'call', 'budget')."""
        grace = float(self.p["stop_grace_s"])
        every = float(self.cfg.campaign.report_every_s)
        # The stage ignores SIGINT (a Ctrl-C reaches the whole group): this process turns it
        # into the SIGTERM a trainer answers with a checkpoint.
        interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, bufsize=1, errors="replace",
                                    # tools/ on the import path (the bench's stages), lines as they come,
                                    # and wide: pytest cuts skip reasons at the width
                                    env=child_env(PYTHONUNBUFFERED="1", COLUMNS="400"))
        finally:
            signal.signal(signal.SIGINT, interrupt)
        reader = threading.Thread(target=self._pump, args=(proc, stage), daemon=True)
        reader.start()
        stopped_by = None
        try:
            while proc.poll() is None:
                if preempt.requested():  # this call itself was asked to stop
                    self.deadline = min(self.deadline, time.time() + grace)
                hard = min(end, self.deadline)
                now = time.time()
                if stopped_by is None and now >= hard - grace:
                    stopped_by = "budget" if stage.budget_left_s() is not None and end < self.deadline else "call"
                    self.say(f"stopping the stage (SIGTERM): {'its budget' if stopped_by == 'budget' else 'the call'}"
                             f" ends in {max(0.0, hard - now):.0f} s")
                    proc.send_signal(signal.SIGTERM)
                if now >= hard:
                    self.say("the stage did not stop in time: killed (it continues from its last checkpoint)")
                    kill_tree(proc.pid)
                    break
                if self.want_report or now - self.reported_at >= every:
                    self.report(PREEMPTED_EXIT)
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                kill_tree(proc.pid)
            rc = proc.wait()
            reader.join(timeout=10)
        return rc, stopped_by

    def _pump(self, proc, stage) -> None:
        for line in proc.stdout:
            self.emit(line.rstrip("\n"), stage)

    # ---- time --------------------------------------------------------------------------------
    def requirement(self, stage, say: bool = False) -> tuple[float, str]:
        """What the stage needs to start now, with its time predicted now where its kind can."""
        predicted = stage.predict(self.p, f"campaign.{self.cfg.campaign.profile}.predict", self.say if say else None)
        return stage.requirement(self.p, self.window_end is not None, predicted)

    def next_call_s(self) -> float:
        """The most a next call could give a stage: a whole call, within what the window
        will have left once this call ends now and a fresh machine has started."""
        grace = float(self.p["stop_grace_s"])
        setup = self.calls[-1]["setup_s"] if self.calls else 0.0
        whole = float(self.cfg.campaign.call_s) - setup - grace
        if self.window_end is None:
            return whole
        after = self.window_end - time.time() - float(self.p["start_s"]) - float(self.p["window_margin_s"])
        return min(whole, after - setup - grace)

    def left_for_later(self) -> list:
        """The stages not ended that a next call of this window could run."""
        later = self.next_call_s()
        return [s for s in self.stages if not s.ended() and self.requirement(s)[0] <= later]

    def exit_code(self) -> int:
        if self.left_for_later():
            return PREEMPTED_EXIT
        return 1 if any(s.status == "failed" for s in self.stages) else 0

    # ---- summary and report ---------------------------------------------------------------
    def report(self, code: int) -> None:
        """campaign.json and the report folder, as things stand."""
        self.reported_at = time.time()
        with self.guard:
            self.want_report = False
            state = json.loads(json.dumps(self.state()))
            for s in self.stages:
                s.figures = s.read_figures()
            summary = self.summary(code, state)
        S.write_state(self.dir, state)
        try:
            write_report(self.report_dir, R.report_files(self.dir, summary, [*self.stages, *self.others]))
        except ReportError as e:
            raise UserError(f"campaign.report: {e}") from None

    def finish(self, code: int) -> None:
        self.report(code)
        self.say("stage          status   what")
        for s in self.stages:
            self.emit(f"  {s.name:<14} {s.status:<8} {s.describe()}")
        left = [s.name for s in self.stages if not s.ended()]
        if code == PREEMPTED_EXIT:
            self.say(f"left: {', '.join(left)}. CALL AGAIN within 30 s (before the machine forgets this dir) "
                     "with the same command" + ("" if self.window_end is None else
                                                " and the device time left as campaign.window_left_s"))
        elif left:
            self.say(f"left for another window: {', '.join(left)} (none fits what this window has left)"
                     + (" (a stage failed: see above)" if code else "") + "; carry this report into the next "
                     "window's first call (campaign.from_report)")
        else:
            self.say("every stage ended" + (" (one failed: see above)" if code else "") + "; nothing to call again for")
        self.say(f"report: {self.report_dir} (exit {code})")
        self.report(code)  # with the lines above in its campaign.log

    def summary(self, code: int, state: dict) -> dict:
        left = [s.name for s in self.stages if not s.ended()]
        return {"campaign": str(self.dir), "profile": str(self.cfg.campaign.profile), "exit": code,
                "call_again": code == PREEMPTED_EXIT, "left": left,
                "left_for_another_window": [] if code == PREEMPTED_EXIT else left,
                "stages": [s.summary() for s in self.stages],
                "calls": self.calls, "settings": to_dict(self.cfg.campaign), "state": state}

    def device(self) -> str:
        if self.cfg.campaign.profile != "gpu":
            return "cpu"
        import torch
        return torch.cuda.get_device_name(0)


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it (loader workers, compile workers)."""
    children: dict = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


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


def check_carried(campaign: Campaign) -> None:
    """The files the stages read that the machine only has when they were carried to it."""
    name = f"campaign.{campaign.cfg.campaign.profile}.knn_baseline"
    baseline = campaign.p.get("knn_baseline")
    if baseline and any(isinstance(s, BenchStage) for s in campaign.stages) and not (ROOT / str(baseline)).is_file():
        raise UserError(f"{name}={baseline} is not in {ROOT}: `bash run.sh campaign-carry` writes it (carry "
                        f"{Path(str(baseline)).parent} to the GPU machine), or {name}=null measures no baseline")


def run(cfg) -> int:
    campaign = Campaign(cfg)
    check_cuda(cfg)
    check_carried(campaign)
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


# Not a command of the package (core/cli.py): a tool for measuring this project, which
# borrows the command line's config (its own YAML), checks and one-line errors.
COMMAND = cli.Command("campaign.call:run", "the whole GPU measurement, one resumable call after another",
                      writes="campaign.call:results_dir", method=str(YAML),
                      ignores={**cli.NO_FEATURES, "launcher": "it runs here, on the machine it is called on"})


def main(argv: list[str] | None = None) -> int:
    """`python -m campaign [key=value ...]` (run.sh's `campaign`)."""
    return cli.main(["campaign", *(sys.argv[1:] if argv is None else argv)], commands={"campaign": COMMAND})
