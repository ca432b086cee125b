"""The stages a campaign runs (call.py), in campaign.stages' order: which kind each
one is (stages.py) and with what keys from the profile's settings
(tools/campaign/campaign.yaml). No torch import.

  default_command `dino resmlp_s12` as a user types it for one short epoch, then its resume
                  (the compile cache loaded, the graph captured again): does the default work
  device_tests    the CUDA tests of the graphed step, compiling and the device checks
  tests           the other CUDA-only tests (`pytest -m cuda`), the Triton kernels' aside
  profile_preset  tools/bench/profile.py on the preset's (fused) step: time per phase, every kernel
                  by class against its floor
  profile_224     the same on the 224 px step
  preset          `dino resmlp_s12` to its last epoch, as a user types it (without graphs
                  when a graph test failed)
  torchrun        the bench's torchrun row: the step in a one-process torchrun job and in-process
  compile         tools/bench/compile_cost.py on the preset's model: the first iteration cold, then warm
  e2e             the bench's e2e row: real-size JPEGs through the loader and the step
  bench_knn       the bench's device k-NN, and beside it the baseline file's (knn_baseline)
  bench_linear    the bench's linear probe at ImageNet's size: the default's L2 selection and refit,
                  DINO's protocol beside
  kernel_tests    the Triton kernels' CUDA tests (tests/test_kernels.py), before the levers
  levers          the bench lines of the fused block's levers, each compiled and graphed beside
                  the fused block and the reference loop, at batch 64 and the largest batch
  bench_fused     the rest of the goals' step lines: the fused step compiled without graphs
                  at batch 64 and the largest batch, beside the graphed one and the reference
  head_preset     tools/bench/head_cost.py: the preset's step per dino.head_precision
  head_224        the same at 224 px, batch 64
  autotune        the bench line of the max-autotune lever: its step and its first calls' time
  profile_knn     tools/bench/profile.py's k-NN phases at the bench's sizes: where that k-NN's time goes
  bench           the rest of the bench, in the same bench.json (no line measured twice)
  compare         the preset with campaign.compare_overrides, for compare_budget_s of stage time
"""
from __future__ import annotations

from pathlib import Path

from campaign.bench import BenchStage, ProfileStage
from campaign.costs import CompileStage, HeadStage
from campaign.stages import Stage
from campaign.tests import TestsStage
from campaign.training import DefaultStage, PresetStage, TrainingStage
from resmlp.core.config import as_list, to_dict
from resmlp.core.errors import UserError


def plan(cfg, campaign_dir: Path) -> tuple[dict, list[Stage]]:
    """(the profile's settings, the stages asked for, in campaign.stages' order). The names
    campaign.stages may hold are its `limits:` entry's; table() gives each its kind."""
    c = cfg.campaign
    p, kinds = table(cfg, campaign_dir)
    names = [str(s) for s in as_list(c.stages)]
    if not names or len(set(names)) < len(names):
        raise UserError(f"campaign.stages={names} must name each stage once, some of {', '.join(kinds)}")
    grace = float(p["stop_grace_s"])
    for name in names:
        if c.call_s <= p["min_start_s"][name] + grace:
            raise UserError(f"campaign.call_s={c.call_s} leaves no time for the {name} stage: it must exceed "
                            f"campaign.{c.profile}.min_start_s.{name} + stop_grace_s = "
                            f"{p['min_start_s'][name] + grace:g} s")
    stages = [kinds[n](n) for n in names]
    # the tests stage that runs the graph tests (graph_tests) decides on the preset's graphs
    tests = next((s for s in stages if isinstance(s, TestsStage) and str(p["graph_tests"]) in s.argv), None)
    for s in stages:
        if isinstance(s, PresetStage):
            s.tests = tests
    return p, stages


def not_asked(cfg, campaign_dir: Path, stages: list[Stage]) -> list[Stage]:
    """The stages of the other kinds: an earlier call may have run them, and their files stay
    in the report (and come back from it) while campaign.stages leaves them out."""
    asked = {s.name for s in stages}
    return [make(n) for n, make in table(cfg, campaign_dir)[1].items() if n not in asked]


def table(cfg, campaign_dir: Path) -> tuple[dict, dict]:
    """(the profile's settings, {stage name: its maker}), each maker with its kind and keys."""
    c = cfg.campaign
    p = to_dict(c[c.profile])
    d = campaign_dir
    keys = {k: [str(x) for x in v] for k, v in p.items() if isinstance(v, list)}  # key=value lists
    mine = [*map(str, as_list(c.preset_overrides))]
    images = ["data=imagefolder", f"data.root={d / 'images'}"] if p.get("images") else []
    preset = [*keys["preset"], *images, *mine]
    # one of the settings the bench's lines are measured with, so every bench stage's (one bench.json)
    baseline = [f"bench.{c.profile}.knn.baseline={p['knn_baseline']}"] if p.get("knn_baseline") else []

    def training(kind, name, overrides, **more):
        config = ("dino", "resmlp_s12", overrides)
        return kind(name, ["-m", "resmlp.core.cli", *config[:2], f"out={d / name}", *overrides], d / name,
                    float(p["min_start_s"][name]), config=config, **more)

    def bench(name, overrides, shows=()):  # the bench stages share one bench.json
        return BenchStage(name, ["-m", "bench", f"out={d / 'bench'}", "bench.resume=true",
                                 *keys["bench"], *baseline, *overrides], d / "bench", float(p["min_start_s"][name]),
                          line_s=float(p["bench_line_s"][name]), shows=shows)

    def profile(name, overrides):
        return ProfileStage(name, ["-m", "bench.profile", *overrides, f"profile.out={d / name}"], d / name,
                            float(p["min_start_s"][name]))

    def cost(kind, name, script, overrides, **more):  # bench/<script>.py, its results in the stage's folder
        results = d / name / f"{script}.json"
        return kind(name, ["-m", f"bench.{script}", *keys[script], "--json", str(results), *overrides],
                    d / name, float(p["min_start_s"][name]), results=results, **more)

    def compile_cost(name):  # the preset's model and settings (its run's keys aside), one cache for both runs
        cache = d / "compile_cache"
        keys_of_cache = [k.replace("<cache>", str(cache)) for k in keys["compile_cache"]]
        return cost(CompileStage, name, "compile_cost", [*preset, *keys_of_cache], cache=cache)

    def default_command(name):  # the command as a user types it, twice (campaign/starts.py): then its resume
        run = d / name / "run"
        command = ["-m", "resmlp.core.cli", "dino", "resmlp_s12", f"out={run}", *keys[name], *images,
                   *keys["default_length"]]
        return DefaultStage(name, ["-m", "campaign.starts", "--out", str(d / name), "--keep", str(run / "results.json"),
                                   "--then", *keys["default_resume"], "--", *command], d / name,
                            float(p["min_start_s"][name]))

    def tests(name):
        return TestsStage(name, ["-m", "pytest", "-p", "no:cacheprovider", "-v", "-rfE", *keys[name]], d / name,
                          float(p["min_start_s"][name]))

    return p, {
        "default_command": default_command,
        "device_tests": tests,
        "tests": tests,
        # the preset's own step (its model, crops and batch) and the 224 px one, each profiled
        "profile_preset": lambda n: profile(n, [*keys["preset"], *mine, *keys["profile_preset"]]),
        "profile_224": lambda n: profile(n, keys["profile_224"]),
        "preset": lambda n: training(PresetStage, n, preset, graph_tests=str(p["graph_tests"]), user_overrides=mine),
        "torchrun": lambda n: bench(n, keys["torchrun"]),
        "compile": compile_cost,
        "e2e": lambda n: bench(n, keys["e2e"]),
        "bench_knn": lambda n: bench(n, keys["bench_knn"], shows=("knn",)),
        "bench_linear": lambda n: bench(n, keys["bench_linear"], shows=("linear",)),
        "kernel_tests": tests,
        "levers": lambda n: bench(n, keys["levers"], shows=("levers",)),
        "bench_fused": lambda n: bench(n, keys["bench_fused"]),
        # the head's precisions on the preset's step (the preset's keys, as compile's) and on the 224 px one
        "head_preset": lambda n: cost(HeadStage, n, "head_cost", [*preset, *keys["head_preset"]]),
        "head_224": lambda n: cost(HeadStage, n, "head_cost", keys["head_224"]),
        "autotune": lambda n: bench(n, keys["autotune"], shows=("levers",)),
        "profile_knn": lambda n: profile(n, keys["profile_knn"]),
        "bench": lambda n: bench(n, keys["bench_rest"]),
        "compare": lambda n: training(TrainingStage, n, [*preset, *map(str, as_list(c.compare_overrides))],
                                      budget_s=float(c.compare_budget_s)),
    }
