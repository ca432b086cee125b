"""The campaign's tests stages: the CUDA-only tests (`pytest -m cuda`; the Triton kernels' in a
stage of their own, before the levers), each test's result kept as it comes from pytest's
output, so that a cut call's next one runs only the tests without a result. No torch import.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from campaign.stages import Stage


@dataclass
class TestsStage(Stage):
    __test__ = False  # pytest: a class of the campaign, not a test
    outcomes: dict = field(default_factory=dict)  # node id -> {"outcome": ..., "message": ...}

    KEPT = (*Stage.KEPT, "outcomes")

    def continue_from_report(self, folder, figures, call):
        if self.status == "cut":
            return f"{self.name} runs only the tests without a result ({len(self.outcomes)} have one)"
        return None

    def launch(self, usable_s):
        argv = list(self.argv)
        for node in self.outcomes:
            argv += ["--deselect", node]
        return argv

    def heard(self, line):
        return note_test_line(line, self.outcomes)

    def classify(self, rc, stopped_by):
        self.note = ""
        if rc in (0, 1, 5):  # all passed, some failed, none left to run
            self.status = "done"
            failed = sum(v["outcome"] in ("failed", "error") for v in self.outcomes.values())
            self.note = f"{failed} test(s) failed: see their messages" if failed else ""
        elif stopped_by or rc < 0:
            self.status = "cut"  # the tests with a result are not run again
        else:
            self.status, self.note = "failed", f"pytest could not run (exit {rc}): see campaign.log"

    def passed_all(self, path: str) -> tuple[int, dict]:
        """(how many tests of the file `path` ran, those of them that did not pass)."""
        mine = {k: v for k, v in self.outcomes.items() if k.split("::")[0] == path}
        return len(mine), {k: v for k, v in mine.items() if v["outcome"] != "passed"}

    def figures_from_files(self):
        out = {k: sum(v["outcome"] == k for v in self.outcomes.values())
               for k in ("passed", "failed", "error", "skipped")}
        out["tests"] = len(self.outcomes)
        out["failed_tests"] = [f"{k}: {v.get('message', '')}" for k, v in self.outcomes.items()
                               if v["outcome"] in ("failed", "error")]
        out["skip_reasons"] = sorted({v.get("message", "") for v in self.outcomes.values()
                                      if v["outcome"] == "skipped"})
        return out

    def parts(self):
        f = self.figures
        if not f.get("tests"):
            return []
        return [f"{f['passed']} passed, {f['failed'] + f['error']} failed, {f['skipped']} skipped"
                + (f" ({'; '.join(f['skip_reasons'])[:120]})" if f["skipped"] else "")]


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
