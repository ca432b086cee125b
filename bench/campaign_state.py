"""What a campaign keeps between calls, and what its report folder holds (bench/campaign.py).

On a warm machine the campaign dir holds it all: campaign.json (each stage's status, the
tests' results, the preset's graphs decision, the calls) and each stage's files. The report
folder, rewritten as the call goes, holds all of it too, flat and small: summary.json
(with campaign.json's content under "state", the profiles' phases and top kernels among
it), campaign.log, bench.json and the training stages'
results.json and log.jsonl: 7 files, so that a write a kill interrupts still leaves its
temp file within the 8 a lent machine hands back. A fresh machine continues from a carried
report (campaign.from_report): `restore` puts its files back into an empty campaign dir; a
training stage that was under way starts again from epoch 0 (its checkpoint stayed
behind), and its earlier attempts stay in its log, after which a line {"restart": n}
starts the next. No torch import.
"""
from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

from resmlp.bench.campaign_stages import BENCH, PROFILE, TRAINING, Stage
from resmlp.core.errors import UserError

STATE = "campaign.json"
LOG = "campaign.log"
RESTORED = "restored"   # in the campaign dir: the training stages' files a report brought back
PROFILE_TOP = 15        # kernels per profiled step kept in summary.json
REPORT_FILES = ("summary.json", "campaign.log", "bench.json", "preset_results.json", "preset_log.jsonl",
                "compare_results.json", "compare_log.jsonl")


def read_state(campaign_dir: Path) -> dict | None:
    path = campaign_dir / STATE
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path} ({e}); move it away to start the campaign again") from None


def write_state(campaign_dir: Path, state: dict) -> None:
    path = campaign_dir / STATE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(path)


def check_same(state: dict, profile: str, stages: list[Stage], campaign_dir: Path, where: Path) -> None:
    """A saved state is this campaign's: same profile, each stage the same command (its
    campaign dir aside: a fresh machine may put the repository elsewhere)."""
    if state.get("profile", profile) != profile:
        raise UserError(f"{where} holds a campaign of profile {state.get('profile')}; use campaign.profile="
                        f"{state.get('profile')} to continue it, or out=<new dir>")
    commands = state.get("commands", {})
    old = str(state.get("dir", campaign_dir))

    def same(a: list, b: list) -> bool:
        return [x.replace(old, "<out>") for x in a] == [x.replace(str(campaign_dir), "<out>") for x in b]
    for s in stages:
        if s.name in commands and not same(commands[s.name], s.argv):
            raise UserError(f"{where} holds a campaign whose {s.name} stage ran another command "
                            f"({shlex.join(commands[s.name])}); use the same keys to continue it, or out=<new dir>")


# --------------------------------------------------------------------------- a fresh machine

def read_report(folder: Path | None) -> dict | None:
    """The summary of a carried report folder; None when there is none yet (the first
    call: a folder that does not exist or is empty)."""
    if folder is None or not folder.is_dir() or not any(folder.iterdir()):
        return None
    path = folder / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"campaign.from_report={folder}: cannot read its summary.json ({type(e).__name__}); name "
                        "the folder a previous call's report was copied to") from None
    if not isinstance(summary.get("state"), dict):
        raise UserError(f"campaign.from_report={folder}: its summary.json holds no campaign state (a report of an "
                        "older campaign); start without campaign.from_report")
    return summary


def restore(folder: Path, summary: dict, campaign_dir: Path, call: int) -> str:
    """Put a carried report back into an empty campaign dir; returns what it says about it."""
    state = summary["state"]
    campaign_dir.mkdir(parents=True, exist_ok=True)
    copy = [("campaign.log", campaign_dir / LOG), ("bench.json", campaign_dir / "bench" / "bench.json")]
    copy += [(f"{n}_{f}", campaign_dir / RESTORED / f"{n}_{f}")
             for n in TRAINING for f in ("log.jsonl", "results.json")]
    for name, target in copy:
        if (folder / name).is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(folder / name, target)
    figures = {s["name"]: s for s in summary.get("stages", [])}
    stages = state.get("stages", {})
    ended = [n for n, s in stages.items() if s["status"] in ("done", "failed")]
    words = [f"ended: {', '.join(ended)}" if ended else "no stage had ended"]
    for name in TRAINING:
        s = stages.get(name)
        if s is not None and s["status"] == "pending":
            words.append(f"{name} has not started yet")
        if s is None or s["status"] not in ("running", "cut"):
            continue
        if s.get("restart"):  # an earlier fresh machine lost its checkpoint, and it has not started since
            words.append(f"{name} starts again from epoch 0 (attempt {s['attempt']}, not started since call "
                         f"{call - 1} or earlier)")
            continue
        lost = figures.get(name, {}).get("epochs_trained", 0)
        s["attempt"] = s.get("attempt", 1) + 1
        s["status"], s["restart"] = "cut", True
        s["note"] = f"attempt {s['attempt']} from epoch 0 (call {call}): the checkpoint of epoch {lost:g} stayed behind"
        log = campaign_dir / RESTORED / f"{name}_log.jsonl"
        log.parent.mkdir(parents=True, exist_ok=True)  # a call killed before the stage reported carries no log
        text = log.read_text() if log.exists() else ""
        log.write_text(text + ("" if not text or text.endswith("\n") else "\n")
                       + json.dumps({"restart": s["attempt"], "call": call, "from_epoch": 0, "lost_epochs": lost})
                       + "\n")
        words.append(f"{name} starts again from epoch 0 (its checkpoint of epoch {lost:g} stayed on the old machine)")
    for name in BENCH:
        if stages.get(name, {}).get("status") in ("running", "cut"):
            words.append(f"{name} measures only the lines bench.json lacks")
    tests = stages.get("tests", {})
    if tests.get("status") in ("running", "cut"):
        words.append(f"tests runs only the tests without a result ({len(tests.get('outcomes', {}))} have one)")
    write_state(campaign_dir, state)
    calls = len(state.get("calls", []))
    return (f"the campaign dir was empty (a fresh machine): continuing from the report in {folder} ({calls} call(s)); "
            f"{'; '.join(words)}; nothing it holds is measured again")


# --------------------------------------------------------------------------- figures

def training_log(campaign_dir: Path, name: str) -> bytes | None:
    """The stage's log.jsonl with its earlier attempts first (a report brought them back)."""
    parts = [p.read_bytes() for p in (campaign_dir / RESTORED / f"{name}_log.jsonl", campaign_dir / name / "log.jsonl")
             if p.is_file()]
    return b"".join(parts) if parts else None


def training_results(campaign_dir: Path, name: str) -> Path:
    live = campaign_dir / name / "results.json"
    return live if live.is_file() else campaign_dir / RESTORED / f"{name}_results.json"


def figures(stage: Stage, campaign_dir: Path) -> dict:
    try:
        if stage.name in TRAINING:
            return train_figures(training_log(campaign_dir, stage.name), training_results(campaign_dir, stage.name))
        if stage.name in BENCH:
            return bench_figures(stage.dir / "bench.json")
        return test_figures(stage.outcomes)
    except (OSError, ValueError, KeyError, TypeError) as e:  # a file cut short by a kill: say so, go on
        return {"figures_error": f"{type(e).__name__}: {e}"}


def train_figures(log: bytes | None, results: Path) -> dict:
    attempts: list = [[]]
    for line in (log or b"").decode(errors="replace").splitlines():
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
    if results.is_file():
        r = json.loads(results.read_text())
        out["results"] = {k: r.get(k) for k in ("epochs", "knn_top1", "linear_top1", "init_knn_top1",
                                                "train_images_per_s", "device", "wall_time_s", "timing")}
    return out


def _attempt(records: list) -> dict:
    out: dict = {}
    trained = [r for r in records if "loss" in r]
    if trained:
        out["epochs_trained"] = round(trained[-1]["epoch"], 2)
        out["images_per_s_last"] = round(trained[-1].get("images_per_s", 0.0), 1)
    out["knn_curve"] = [[r["epoch"], round(r["knn_top1"], 2)] for r in records if "knn_top1" in r]
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


def profile_figures(path: Path) -> dict | None:
    """bench/profile.py's profile.json, short, for the stage's state (so in summary.json: the
    report has no room for an eighth file): its config, the time of each phase, and per
    profiled step the wall and device-busy time per call, the launches and the top kernels."""
    if not path.is_file():
        return None
    r = json.loads(path.read_text())
    out = {"config": r.get("config"), "phases": r.get("phases", {})}
    for key in sorted(k for k in r if k.startswith("kernels_")):
        k = r[key]
        out[key] = {**{f: round(k[f], 3) for f in ("wall_ms", "busy_ms", "kernels_per_call")},
                    "top": [{"name": x["name"][:160], "ms_per_call": round(x["ms_per_call"], 4), "count": x["count"]}
                            for x in k["top"][:PROFILE_TOP]]}
    return out


def test_figures(outcomes: dict) -> dict:
    out = {k: sum(v["outcome"] == k for v in outcomes.values()) for k in ("passed", "failed", "error", "skipped")}
    out["tests"] = len(outcomes)
    out["failed_tests"] = [f"{k}: {v.get('message', '')}" for k, v in outcomes.items()
                           if v["outcome"] in ("failed", "error")]
    out["skip_reasons"] = sorted({v.get("message", "") for v in outcomes.values() if v["outcome"] == "skipped"})
    return out


def describe(s: Stage) -> str:
    f, parts = s.figures, []
    if s.name in TRAINING:
        if s.attempt > 1:
            parts.append(f"attempt {s.attempt}")
        if "epochs_trained" in f:
            parts.append(f"{f['epochs_trained']:g} epochs trained")
        if f.get("knn_curve"):
            parts.append(f"k-NN {f['knn_curve'][-1][1]:.2f} at epoch {f['knn_curve'][-1][0]}")
        if "results" in f:
            t = f["results"].get("timing") or {}
            parts.append(f"final k-NN {f['results']['knn_top1']:.2f}; training {t.get('train_s', 0):.0f} s over "
                         f"{len(t.get('starts', []))} start(s), uninterrupted about "
                         f"{t.get('uninterrupted_s', 0):.0f} s")
        if s.prediction:  # beside what its last run took, to judge the constants by
            took = s.prediction.get("took_s")
            parts.append(f"predicted {s.prediction['need_s']:.0f} s" + (f", took {took:.0f} s" if took else ""))
        if s.graphs:
            parts.append(s.graphs["why"])
    elif s.name in BENCH and f:
        parts.append(f"bench.json (both bench stages'): lines {f['lines']}, {f.get('left') or 0} left")
    elif s.name in PROFILE and s.profile:
        prof = s.profile
        parts += [f"{name} {v['ms']:.1f} ms ({v['images_per_s']:.0f} img/s)" for name, v in prof["phases"].items()]
        for key in (k for k in prof if k.startswith("kernels_")):
            k, top = prof[key], prof[key]["top"][:1]
            parts.append(f"{key[8:]}: device busy {k['busy_ms']:.1f} of {k['wall_ms']:.1f} ms per call, "
                         f"{k['kernels_per_call']:.0f} kernels" + (f", top {top[0]['name'][:60]} "
                                                                   f"{top[0]['ms_per_call']:.2f} ms" if top else ""))
    elif s.name == "tests" and f.get("tests"):
        parts.append(f"{f['passed']} passed, {f['failed'] + f['error']} failed, {f['skipped']} skipped"
                     + (f" ({'; '.join(f['skip_reasons'])[:120]})" if f["skipped"] else ""))
    if s.note:
        parts.append(s.note)
    return "; ".join(parts) or "-"


def report_files(campaign_dir: Path, summary: dict) -> dict:
    """The report folder's files: {name: a Path to copy, bytes, or a dict}."""
    files = {"summary.json": summary, "campaign.log": campaign_dir / LOG,
             "bench.json": campaign_dir / "bench" / "bench.json"}
    for name in TRAINING:
        files[f"{name}_results.json"] = training_results(campaign_dir, name)
        log = training_log(campaign_dir, name)
        if log is not None:
            files[f"{name}_log.jsonl"] = log
    assert set(files) <= set(REPORT_FILES)
    return files
