"""What a campaign's report folder holds (call.py rewrites it as a call goes), and how
a fresh machine continues from one carried in. No torch import.

The folder holds it all, flat and small: summary.json (with campaign.json's content under
"state", the profiles' phases and top kernels among it), campaign.log, bench.json and the
training stages' results.json and log.jsonl: 7 files, so that a write a kill interrupts
still leaves its temp file within the 8 a lent machine hands back. Each stage's kind says
which of its files go in and what it takes back from them (stages.py).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from campaign.stages import Stage
from campaign.state import LOG, write_state
from resmlp.core.errors import UserError

REPORT_FILES = ("summary.json", "campaign.log", "bench.json", "preset_results.json", "preset_log.jsonl",
                "compare_results.json", "compare_log.jsonl")


def report_files(campaign_dir: Path, summary: dict, stages: list[Stage]) -> dict:
    """The report folder's files: {name: a Path to copy, bytes, or a dict}, in the order
    write_report writes them: summary.json last, so that a report cut by a kill never holds
    a summary whose figures come from a stage file it lacks (the next call restores from both)."""
    files = {}
    for s in stages:
        files.update(s.report_files())
    files.update({"campaign.log": campaign_dir / LOG, "summary.json": summary})
    assert set(files) <= set(REPORT_FILES)
    return files


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


def restore(folder: Path, summary: dict, campaign_dir: Path, call: int, stages: list[Stage]) -> str:
    """Put a carried report back into an empty campaign dir: its state, and each stage's
    files and what its kind makes of them; returns what the call says about it."""
    state = summary["state"]
    campaign_dir.mkdir(parents=True, exist_ok=True)
    if (folder / "campaign.log").is_file():
        shutil.copyfile(folder / "campaign.log", campaign_dir / LOG)
    figures = {s["name"]: s for s in summary.get("stages", [])}
    saved = state.get("stages", {})
    ended = [n for n, s in saved.items() if s["status"] in ("done", "failed")]
    words = [f"ended: {', '.join(ended)}" if ended else "no stage had ended"]
    for stage in stages:
        if stage.name not in saved:
            continue
        stage.take(saved[stage.name])
        said = stage.continue_from_report(folder, figures.get(stage.name, {}), call)
        saved[stage.name] = stage.state()
        if said:
            words.append(said)
    write_state(campaign_dir, state)
    calls = len(state.get("calls", []))
    return (f"the campaign dir was empty (a fresh machine): continuing from the report in {folder} ({calls} call(s)); "
            f"{'; '.join(words)}; nothing it holds is measured again")
