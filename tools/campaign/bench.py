"""The campaign's bench and profile stages. No torch import.

A bench stage runs `bench` into the bench.json it shares with the other bench stages
(bench.resume): its lines are kept one by one, so it may start when its longest line fits,
under a time limit that leaves its stop signal for the line in flight, and a line one stage
measured is not measured again by the other. Its figures count the shared bench.json's lines
and, for what the stage is about (`shows`), pick some out: each lever line beside the fused
block's and the reference loop's, the k-NN lines beside their baseline's. A profile stage
runs tools/bench/profile.py on one step; its profile.json (every kernel kept, by class, the numbers short) goes into its state
(so into summary.json: the report has no room for another file).
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from campaign.stages import Stage

NAME_CHARS = 160        # of a kernel's name in summary.json (C++ templates run to thousands)


@dataclass(kw_only=True)
class BenchStage(Stage):
    line_s: float             # its longest line (none starts with less left)
    shows: tuple = ()         # which lines of bench.json its figures show (SHOWS)

    @property
    def results(self) -> Path:
        return self.dir / "bench.json"

    def continue_from_report(self, folder, figures, call):
        if (folder / self.results.name).is_file():
            self.results.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(folder / self.results.name, self.results)
        return f"{self.name} measures only the lines bench.json lacks" if self.status == "cut" else None

    def requirement(self, p, window, predicted):
        return max(self.min_start_s, self.line_s + 1), (f"its longest line, bench_line_s={self.line_s:g}, and "
                                                        "start-up; its lines are kept one by one")

    def launch(self, usable_s):
        return [*self.argv, f"bench.time_limit_s={usable_s - self.line_s:.0f}"]  # >= 1: the requirement holds it

    def heard(self, line):
        return line.startswith("[bench] ")

    def classify(self, rc, stopped_by):
        super().classify(0 if rc == 1 else rc, stopped_by)
        if rc == 1:
            self.note = "some bench lines failed (bench.json has their errors)"

    def figures_from_files(self):
        if not self.results.exists():
            return {}
        b = json.loads(self.results.read_text())
        status: dict = {}
        for r in b.get("rows", []):
            status[r["status"]] = status.get(r["status"], 0) + 1
        ok = [r for r in b.get("rows", []) if r["status"] == "ok"]
        return {"bench_runs": b.get("runs"), "lines": status, "left": b.get("left"),
                "goals": [s["text"] + ("" if s["met"] is None else " [met]" if s["met"] else " [open]")
                          for s in b.get("summary", [])],
                **{what: SHOWS[what](ok) for what in self.shows}}

    def report_files(self):
        return {self.results.name: self.results}

    def parts(self):
        f = self.figures
        if not f.get("lines"):
            return []
        parts = [f"bench.json (every bench stage's): lines {f['lines']}, {f.get('left') or 0} left"]
        for r in f.get("levers", []):
            ratios = [f"{r[k]:.2f}x {what}" for k, what in (("vs_fused", "the fused block"),
                                                            ("vs_ref", "the reference")) if r.get(k) is not None]
            parts.append(f"{r['lever']} {r['kind']} b{r['batch']}: {r['images_per_s']:.0f} img/s"
                         + "".join(f", {x}" for x in ratios)
                         + ("" if r.get("pct_peak") is None else f", {r['pct_peak']:.1f}% of the matmul rate")
                         + ("" if r.get("capture_s") is None else f", its first calls {r['capture_s']:.0f} s"))
        for r in f.get("knn", []):
            parts.append(f"k-NN {r['backend']} {r['seconds']:.3f} s for {r['queries']} queries"
                         + ("" if r.get("baseline_seconds") is None else
                            f" ({Path(str(r['baseline'])).name}: {r['baseline_seconds']:.3f} s, ours "
                            f"{r['vs_baseline']:.2f}x, {'the same' if r['same_as_baseline'] else 'other'} votes)"))
        for r in f.get("linear", []):
            parts.append(f"linear {r['protocol']} on {r['n_train']} x {r['dim']}, {r['classes']} classes: "
                         + (f"{r['seconds']:.1f} s ({r['l2s']} L2s {r['selection_s']:.1f} s, the refit "
                            f"{r['refit_s']:.1f} s; {r['passes']} passes), L2 {r['l2']:g}, top-1 {r['top1']:.2f}"
                            if r["protocol"] == "lbfgs" else
                            f"{r['seconds_full']:.1f} s for all epochs ({r['epoch_s']:.2f} s each)")
                         + ("" if r.get("mem_gb") is None else f", {r['mem_gb']:.2f} GB"))
        return parts


FUSED = "ours fused "     # tools/bench/dino.py's impl of a fused block's line: "ours fused [<lever> ]<kind>"


def lever_figures(rows: list) -> list:
    """Each lever line of the fused block (tools/bench/dino.py LEVERS: "ours fused <lever> <kind>")
    beside the fused block's line of the same kind and the reference loop's, at the same model,
    strategy and batch: img/s and their ratios, the share of the measured matmul rate, and the
    seconds of its first calls (a graphed line's: its compilation and capture)."""
    dino = [r for r in rows if r["row"] == "dino"]

    def beside(r, impl):
        return next((x for x in dino if x["impl"] == impl and all(x.get(k) == r.get(k)
                                                                   for k in ("model", "strategy", "batch"))), None)
    out = []
    for r in dino:
        lever, _, kind = r["impl"].removeprefix(FUSED).rpartition(" ")
        if not r["impl"].startswith(FUSED) or not lever:
            continue
        fused, ref = beside(r, FUSED + kind), beside(r, "reference")
        out.append({"lever": lever, "kind": kind, "model": r["model"], "batch": r.get("batch"),
                    "images_per_s": r["images_per_s"],
                    "fused_images_per_s": fused and fused["images_per_s"],
                    "vs_fused": fused and r["images_per_s"] / fused["images_per_s"],
                    "vs_ref": ref and r["images_per_s"] / ref["images_per_s"], "pct_peak": r.get("pct_peak"),
                    "capture_s": r.get("capture_s"), "first_s": r.get("first_s"), "wall_s": r.get("wall_s"),
                    "run": r.get("run")})
    return out


def fields_of(row: str, *keys: str):
    """The figures of a family's lines: these keys of each of its lines (None where it has none)."""
    def figures(rows: list) -> list:
        return [{k: r.get(k) for k in (*keys, "run")} for r in rows if r["row"] == row]
    return figures


# The k-NN lines: seconds (for its queries, and scaled to all of them), and where a baseline
# file ran beside (bench.<profile>.knn.baseline) its seconds for the same queries, ours' speed
# over it and whether both voted alike.
knn_figures = fields_of("knn", "backend", "device", "n_train", "dim", "queries", "seconds", "seconds_full", "top1",
                        "baseline", "baseline_seconds", "vs_baseline", "same_as_baseline")
# The linear probe's lines: each protocol's seconds (DINO's: for all its epochs, counted at its
# last timed one's), the lbfgs line's selection and refit, passes, L2 chosen and top-1.
linear_figures = fields_of("linear", "protocol", "device", "n_train", "dim", "classes", "seconds", "selection_s",
                           "refit_s", "seconds_full", "epoch_s", "l2s", "iterations", "passes", "l2", "converged",
                           "top1", "mem_gb")

SHOWS = {"levers": lever_figures, "knn": knn_figures, "linear": linear_figures}


@dataclass
class ProfileStage(Stage):
    profile: dict | None = None  # its profile.json, short (profile_figures)

    KEPT = (*Stage.KEPT, "profile")

    def after_run(self, took_s):
        if self.status == "done":
            self.profile = profile_figures(self.dir / "profile.json")

    def parts(self):
        prof = self.profile
        if not prof:
            return []
        parts = [f"{name} {v['ms']:.1f} ms ({v['images_per_s']:.0f} img/s)" for name, v in prof["phases"].items()]
        knn = prof.get("knn")
        if knn:
            big = sorted(knn["phases"].items(), key=lambda kv: -kv[1]["device_ms"])[:3]
            parts.append(f"k-NN {knn['seconds']:.3f} s (first call {knn['first_s']:.3f} s, by phase "
                         f"{knn['phased_s']:.3f} s: " + ", ".join(f"{n} {v['device_ms']:.0f} ms" for n, v in big) + ")")
        for key in (k for k in prof if k.startswith("kernels_")):
            k = prof[key]
            classes = ", ".join(f"{c} {v['ms']:.2f} ms" + ("" if v.get("floor_ms") is None else
                                                           f" (floor {v['floor_ms']:.2f})")
                                for c, v in k["classes"].items() if c != "all" and v["ms"])
            parts.append(f"{key[8:]}: busy {k['busy_ms']:.1f} of {k['wall_ms']:.1f} ms per call, "
                         f"{k['kernels_per_call']:.0f} kernels, {len(k['top'])} kept: {classes}")
        return parts


def profile_figures(path: Path) -> dict | None:
    """tools/bench/profile.py's profile.json for the report: its config, the time of each phase,
    the measured rates, the k-NN's figures where it ran, and per profiled step (or k-NN) the
    wall and busy time per call, the launches, the classes against their floors and every
    kernel the profile kept, with its class (names cut to NAME_CHARS)."""
    if not path.is_file():
        return None
    r = json.loads(path.read_text())
    out = {"config": r.get("config"), "phases": r.get("phases", {})}
    if "rates" in r:
        out["rates"] = {k: {f: v[f] for f in ("tflops", "tb_per_s", "size", "mbytes", "dtype", "spread") if f in v}
                        for k, v in r["rates"].items()}
    if "knn" in r:   # its phases, rounds and timings: a few lines
        out["knn"] = r["knn"]
    for key in sorted(k for k in r if k.startswith("kernels_")):
        k = r[key]
        out[key] = {**{f: _short(k[f]) for f in ("wall_ms", "busy_ms", "kernels_per_call", "flops_per_call")},
                    "classes": _short(k["classes"]),
                    "top": [{"name": x["name"][:NAME_CHARS], "class": x["class"], "ms_per_call": _short(x["ms_per_call"]),
                             "count": _short(x["count"]), "gb_per_call": _short(x["gb_per_call"])} for x in k["top"]]}
    return out


def _short(value):
    """Numbers to 4 significant digits, in dicts too: the report carries every kernel."""
    if isinstance(value, dict):
        return {k: _short(v) for k, v in value.items()}
    if isinstance(value, float):
        return float(f"{value:.4g}")
    return value
