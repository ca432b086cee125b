"""What a campaign keeps between calls on one machine (call.py): campaign.json in the
campaign dir, with each stage's state (what its kind keeps: status, the tests' results, the
preset's graphs decision, ...), the command each stage ran, and the calls. The report folder
is report.py's. No torch import.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

from campaign.stages import Stage
from resmlp.core.errors import UserError

STATE = "campaign.json"
LOG = "campaign.log"


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


def state(saved: dict | None, profile: str, campaign_dir: Path, stages: list[Stage], calls: list) -> dict:
    """campaign.json's content now: stages this call does not run keep what `saved` had."""
    saved = saved or {}
    old = saved.get("dir", str(campaign_dir))
    kept = {k: [x.replace(old, str(campaign_dir)) for x in v] for k, v in saved.get("commands", {}).items()}
    return {"profile": profile, "dir": str(campaign_dir),
            "commands": {**kept, **{s.name: s.argv for s in stages}},
            "stages": {**saved.get("stages", {}), **{s.name: s.state() for s in stages}},
            "calls": calls}
