"""Compilation paid once (core/compile_cache.py): a compiled run saves what torch compiled
after its first log line, and its next start loads it and compiles nothing. Whose caches
load, and what a failing save or load does: test_cache_trust.py.

Torch keeps caches of its own on disk (/tmp/torchinductor_$USER), which alone would make a
second compilation in this machine warm. Every compiled start here therefore gets an empty
one (torch._inductor.utils.fresh_cache) and a reset Dynamo, with no artifacts recorded: a
graph found in torch's caches can only have come from the run's compile cache. What was
found is read from torch's own counters (FX graph and AOTAutograd cache hits and misses),
not from the time it took.
"""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache

from resmlp.core.cache_trust import signed_with, user_secret
from resmlp.core.compile_cache import (CompileCache, cache_folder, cache_key, compiled_how, key_id,
                                       open_compile_cache)
from resmlp.core.compiling import compile_regions
from resmlp.core.config import load_config
from resmlp.core.run import Run
from resmlp.core.run_folder import run_dir

FMNIST = Path("/usr/share/datasets/fashion-mnist")
needs_fmnist = pytest.mark.skipif(not FMNIST.exists(), reason="Debian's dataset-fashion-mnist is not installed")
# test_dino's tiny run, compiled; one epoch of 2 iterations, then a second one resumed
TINY = ["demo=false", "model.dim=16", "model.depth=2", "data.subset=64", "batch_size=32", "epochs=1",
        "dino.out_dim=64", "dino.hidden_dim=32", "dino.bottleneck_dim=16", "dino.n_local_crops=2",
        "optim.warmup_epochs=0", "num_workers=0", "eval_every=0", "log_every=1", "dino.final_linear=false",
        "model.drop_path_rate=0.0", "device=cpu", "compile=true", "dino.augment=workers"]
CPU = torch.device("cpu")


def new_start():
    """This process as a new start finds torch: no compiled frames, no artifacts recorded
    to save, counters at zero (torch's on-disk caches: fresh_cache)."""
    from torch.compiler._cache import CacheArtifactManager
    torch._dynamo.reset()
    CacheArtifactManager.clear()
    counters.clear()


def found() -> dict:
    """What torch's caches gave the compilations since new_start()."""
    return {"fx_hit": counters["inductor"]["fxgraph_cache_hit"], "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
            "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
            "aot_miss": counters["aot_autograd"]["autograd_cache_miss"]}


@pytest.fixture(scope="module")
def compiled_run(tmp_path_factory, short_knn):
    """A compiled tiny DINO run of one epoch, then the same command for two (a resume in
    place), each a new start: (run dir, {epochs: (found, printed lines)})."""
    from resmlp.ssl import train as dino_train
    out = tmp_path_factory.mktemp("compiled") / "run"
    starts = {}
    for epochs in (1, 2):
        new_start()
        printed = io.StringIO()
        with fresh_cache(dir=str(tmp_path_factory.mktemp("torch_caches"))), contextlib.redirect_stdout(printed):
            dino_train.train(load_config("dino", "resmlp_s12", [*TINY, f"out={out}", f"epochs={epochs}", *short_knn]))
        starts[epochs] = (found(), printed.getvalue().splitlines())
    new_start()
    return out, starts


@needs_fmnist
@pytest.mark.slow
def test_a_compiled_run_continued_in_place_starts_warm(compiled_run):
    out, starts = compiled_run
    (cold, cold_lines), (warm, warm_lines) = starts[1], starts[2]
    folder = out / "compile_cache"
    assert f"compile cache: none in {folder} yet; the first iteration compiles, then saves it there" in cold_lines
    assert cold["fx_miss"] > 0 and cold["aot_miss"] > 0 and cold["fx_hit"] == cold["aot_hit"] == 0
    saved = [i for i, line in enumerate(cold_lines) if line.startswith("compile cache: saved ")]
    first_log = next(i for i, line in enumerate(cold_lines) if line.startswith("ep 1/1 it 1/2 "))
    assert len(saved) == 1 and saved[0] == first_log + 1   # after the first log line, once: nothing new after
    (record,) = folder.glob("*.json")
    written = json.loads(record.read_text())
    held = written["artifacts"]
    assert held == {"aot_autograd": cold["aot_miss"], "inductor": cold["fx_miss"]}
    assert signed_with(user_secret(create=False), written)   # signed with this user's secret (core/cache_trust.py)

    # the resumed start: every graph the cold one compiled comes from the run dir's cache
    assert any(line.startswith("resuming from ") for line in warm_lines)
    assert (f"compile cache: loaded {sum(held.values())} compiled artifacts (aot_autograd {held['aot_autograd']}, "
            f"inductor {held['inductor']}) from {record.with_suffix('.bin')}") in warm_lines
    assert warm == {"fx_hit": cold["fx_miss"], "fx_miss": 0, "aot_hit": cold["aot_miss"], "aot_miss": 0}
    assert not any(line.startswith("compile cache: saved ") for line in warm_lines)   # nothing new to save

    # a checkpoint carries weights and the run's state, never compile artifacts
    state = torch.load(out / "checkpoint.pth", map_location="cpu", weights_only=False)
    assert not any("compile" in str(k) or isinstance(v, (bytes, bytearray)) for k, v in state.items())


def dino_cfg(tmp_path, *extra):
    return load_config("dino", "resmlp_s12", [*TINY, f"out={tmp_path / 'run'}", *extra])


def open_for(cfg, lines: list):
    """open_compile_cache as ssl/train.py calls it, for the run `cfg` describes (its step
    built, nothing compiled yet): the cache and the lines it printed."""
    from resmlp.data.crop_plan import crop_plan
    from resmlp.ssl.step import build_dino_step
    run = Run(cfg)
    run.print = lines.append
    plan = crop_plan(cfg)
    step = build_dino_step(cfg, plan, run.device)
    return open_compile_cache(cfg, run, (step.student, step.teacher), step.graphed is not None, plan.label())


@needs_fmnist
@pytest.mark.slow
def test_compile_cache_dir_shares_one_cache_between_run_dirs(compiled_run, tmp_path):
    out, starts = compiled_run
    shared = out / "compile_cache"
    lines = []
    new_start()
    with fresh_cache(dir=str(tmp_path)):
        cache = open_for(dino_cfg(tmp_path, f"compile_cache_dir={shared}"), lines)
    (record,) = shared.glob("*.json")
    assert cache.loaded == json.loads(record.read_text())["artifacts"] and cache.bin == record.with_suffix(".bin")
    assert lines == [f"compile cache: loaded {sum(cache.loaded.values())} compiled artifacts (aot_autograd "
                     f"{cache.loaded['aot_autograd']}, inductor {cache.loaded['inductor']}) from {cache.bin}"]
    # without compile_cache_dir the other run dir reads its own folder, empty
    lines.clear()
    with fresh_cache(dir=str(tmp_path)):
        assert open_for(dino_cfg(tmp_path), lines).loaded == {}
    assert lines == [f"compile cache: none in {tmp_path / 'run' / 'compile_cache'} yet; the first iteration "
                     "compiles, then saves it there"]


def key_of(tmp_path, *extra, precision="fp32", compiled="regional", graphs=False, batch=32, world=1) -> dict:
    from resmlp.data.crop_plan import crop_plan
    cfg = dino_cfg(tmp_path, *extra)
    return cache_key(cfg, CPU, precision, batch, world, compiled, graphs, crop_plan(cfg).label())


def test_the_key_holds_what_the_compiled_graphs_depend_on_and_nothing_else(tmp_path):
    base = key_of(tmp_path)
    assert base["device"].startswith("cpu: ") and base["torch"] == torch.__version__ and "triton" in base
    assert base["crops"] == "2x32+2x16" and base["model"]["dim"] == 16 and base["compile"] == "regional"
    # a run of other weights, schedule, length or folders compiles the same graphs
    for same in ("optim.lr=0.1", "epochs=7", "seed=3", "dino.teacher_temp=0.07", "dino.init=/some/run",
                 f"compile_cache_dir={tmp_path}", f"out={tmp_path / 'elsewhere'}", "log_every=5"):
        assert key_id(key_of(tmp_path, same)) == key_id(base), same
    changed = {"model.dim=32": "model.dim", "model.depth=3": "model.depth", "model.fused=false": "model.fused",
               "model.grad_checkpointing=true": "model.grad_checkpointing", "data.img_size=64": "crops",
               "dino.n_local_crops=4": "crops", "dino.augment=device": "augment"}
    for override, field in changed.items():
        assert field in fields_between(base, key_of(tmp_path, override)), override
    for kwargs, field in (({"precision": "bf16"}, "precision"), ({"compiled": "whole"}, "compile"),
                          ({"graphs": True}, "graphs"), ({"batch": 16}, "batch_per_process"),
                          ({"world": 2}, "processes")):
        assert fields_between(base, key_of(tmp_path, **kwargs)) == [field], kwargs


def fields_between(a: dict, b: dict) -> list[str]:
    """The (dotted) fields in which two keys differ."""
    from resmlp.core.compile_cache import differences
    return [d.split(": ")[0] for d in differences(a, b)]


def test_a_cache_for_other_settings_is_ignored_with_one_line_naming_what_differs(tmp_path):
    folder = tmp_path / "cache"
    folder.mkdir()
    ours = key_of(tmp_path)
    for theirs in (key_of(tmp_path, "model.dim=32"), key_of(tmp_path, "model.dim=32", precision="bf16")):
        (folder / f"{key_id(theirs)}.json").write_text(json.dumps({"key": theirs, "bytes": 3, "sha256": "0"}))
        (folder / f"{key_id(theirs)}.bin").write_bytes(b"abc")
    lines = []
    assert CompileCache(folder, ours, say=lines.append).load() == {}
    assert lines == [f"compile cache: {folder} holds caches for other settings only (the nearest: model.dim: 32 -> "
                     "16): ignored; the first iteration compiles, then saves one for these beside them"]


def test_the_cache_folder_is_the_run_dir_or_the_one_named_never_the_weights_a_run_starts_from(tmp_path):
    weights_run = tmp_path / "pretrained"
    for start in (f"dino.init={weights_run}", f"dino.init={weights_run / 'checkpoint.pth'}"):
        cfg = load_config("dino", "resmlp_s12", [*TINY, start])
        assert cache_folder(cfg, run_dir(cfg)) == run_dir(cfg) / "compile_cache" != weights_run / "compile_cache"
        assert weights_run not in cache_folder(cfg, run_dir(cfg)).parents
    cfg = load_config("finetune", "resmlp_s12", ["demo=false", f"checkpoint={weights_run}"])
    assert weights_run not in cache_folder(cfg, run_dir(cfg)).parents
    cfg = load_config("finetune", "resmlp_s12", ["demo=false", f"checkpoint={weights_run}",
                                                 f"compile_cache_dir={tmp_path / 'shared'}", f"out={tmp_path / 'ft'}"])
    assert cache_folder(cfg, run_dir(cfg)) == tmp_path / "shared"


def test_a_compile_cache_dir_that_is_a_file_is_one_line_and_nothing_written(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("x")
    lines = []
    cache = CompileCache(path, key_of(tmp_path), say=lines.append)
    assert cache.load() == {} and not cache.save() and path.read_text() == "x"
    assert lines == [f"compile cache: {path} is not a folder: nothing read or saved there; set compile_cache_dir "
                     "to a folder"]


def test_compiled_how_tells_eager_regional_and_whole_apart():
    from resmlp.models.resmlp import ResMLP

    def tiny():
        return ResMLP(img_size=16, patch_size=4, dim=16, depth=2, num_classes=0)
    eager, regional, whole, module_whole = tiny(), tiny(), tiny(), tiny()
    compile_regions(regional)
    module_whole.compile()
    assert compiled_how(eager) is None and compiled_how(regional) == "regional"
    assert compiled_how(torch.compile(whole)) == "whole" and compiled_how(module_whole) == "whole"
    assert compiled_how(eager, regional) == "regional"


@pytest.mark.slow
def test_a_later_compilation_is_saved_again_and_nothing_new_writes_nothing(tmp_path):
    """dino.init compiles its frozen-backbone graphs first and the others after the head's
    warm-up: a save after new compilations holds them all; one with nothing new writes nothing."""
    folder, lines = tmp_path / "cache", []
    new_start()
    with fresh_cache(dir=str(tmp_path)):
        cache = CompileCache(folder, key_of(tmp_path), say=lines.append)
        torch.compile(lambda x: x.sin() + 1)(torch.randn(8))
        assert cache.save()
        first = json.loads(cache.record.read_text())
        written = cache.bin.stat().st_mtime_ns
        assert not cache.save() and cache.bin.stat().st_mtime_ns == written
        torch.compile(lambda x: x.cos() * 2)(torch.randn(8))
        assert cache.save()
    second = json.loads(cache.record.read_text())
    assert first["artifacts"]["inductor"] == 1 and second["artifacts"]["inductor"] == 2
    assert [line.split(" (")[0] for line in lines] == [f"compile cache: saved {sum(r['artifacts'].values())} compiled "
                                                      "artifacts" for r in (first, second)]
    # a new start loads both
    new_start()
    with fresh_cache(dir=str(tmp_path)):
        assert CompileCache(folder, key_of(tmp_path), say=lines.append).load() == second["artifacts"]
    new_start()


def test_compile_cost_refuses_warm_without_a_cache_to_load(capsys):
    """tools/bench/compile_cost.py's warm mode loads what its regional mode saved (or a folder's):
    asked alone, it is one line and exit 2, before any process starts."""
    from bench import compile_cost
    assert compile_cost.main(["--modes", "warm,regional"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "compile_cost: --modes warm loads the cache regional saves: list regional before it, or name a folder "
        "that holds one with compile_cache_dir=<dir>"]
