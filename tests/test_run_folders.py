"""A run folder belongs to its inputs, and evaluations keep their history (issue 36).

Default run dirs name the weights a command starts from (core.run_folder.default_run_name); a
finished run is "nothing to do" only with the settings asked for now, and is refused in one
line otherwise (core.run_folder.settings_differences); an unfinished one is still continued. knn,
linear and viz append every result to evaluations.jsonl, viz's figures go to a folder named by
their settings, under epoch<N>/ for a run still training (eval/command.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from resmlp.core.cli import main
from resmlp.core.config import load_config, save_config, to_dict
from resmlp.core.run_folder import run_dir, settings_differences
from resmlp.core.outdir import input_key, input_name

from test_folder import labeled

TINY = ["demo=false", "model.dim=16", "model.depth=2", "data.img_size=16", "model.patch_size=4", "num_workers=0"]
# the supervised recipe without its randomness-heavy parts: one short epoch on the 12 images
FINETUNE = ["epochs=1", "batch_size=4", "log_every=1", "eval_every=0", "optim.warmup_epochs=0", "aug.mixup=0",
            "aug.cutmix=0", "aug.auto_augment=null", "aug.re_prob=0", "aug.scale=[0.9,1]", "num_workers=0",
            "demo=false"]


def dino_run(runs: Path, name: str, lab: Path, seed: int) -> Path:
    """A DINO run dir still training (config.yaml and an epoch-3 checkpoint, no results.json)
    on the labeled folder `lab`, its networks at random weights of `seed`."""
    from resmlp.core.checkpoint import save_checkpoint
    from resmlp.models.from_config import build_model
    cfg = load_config("dino", "resmlp_s12", [*TINY, "data=imagefolder", f"data.root={lab}", f"out={runs / name}"])
    torch.manual_seed(seed)
    nets = {k: {f"backbone.{n}": v for n, v in build_model(cfg.model, num_classes=0).state_dict().items()}
            for k in ("teacher", "student")}
    save_config(cfg, runs / name / "config.yaml")
    save_checkpoint(runs / name / "checkpoint.pth", {"command": "dino", "config": to_dict(cfg), "epoch": 3,
                                                      "iteration": 24, **nets})
    return runs / name


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


# ---- the names ---------------------------------------------------------------------------

def test_default_folders_name_the_weights_each_command_starts_from(tmp_path):
    (tmp_path / "fm1").mkdir()
    assert input_name(tmp_path / "fm1") == input_name(tmp_path / "fm1" / "checkpoint.pth") == "fm1"
    assert input_name(tmp_path / "w" / "teacher.v2.pth") == "teacher.v2"
    assert input_name("timm:resmlp_12_224.fb_dino?random") == "resmlp_12_224.fb_dino"
    assert input_key(tmp_path / "fm1") == input_key(tmp_path / "fm1" / "checkpoint.pth")

    def default(command, model, *extra):
        return run_dir(load_config(command, model, ["demo=false", *extra])).name

    assert default("finetune", "resmlp_s12", f"checkpoint={tmp_path / 'fm1'}") == \
        "finetune_resmlp_s12_fashion_mnist_from_fm1"
    assert default("distill", "resmlp_s12", "distill.teacher=timm:regnety_002") == \
        "distill_resmlp_s12_fashion_mnist_from_regnety_002"
    assert default("dino", "resmlp_s12", f"dino.init={tmp_path / 'fm1'}") == "dino_resmlp_s12_fashion_mnist_from_fm1"
    assert default("dino", "resmlp_s12") == "dino_resmlp_s12_fashion_mnist"          # nothing read: as before
    assert default("supervised", "resmlp_s12") == "supervised_resmlp_s12_fashion_mnist"
    from resmlp.supervised.compare import compare_dir
    given = load_config("compare", "resmlp_s12", ["demo=false", "compare.teacher=timm:regnety_002"])
    assert compare_dir(given).name == "compare_resmlp_s12_fashion_mnist_from_regnety_002"
    trained = load_config("compare", "resmlp_s12", ["demo=false", "compare.teacher=regnety_002"])
    assert compare_dir(trained).name == "compare_resmlp_s12_fashion_mnist"     # trained here, named by compare


def test_settings_that_change_a_result_differ_and_runtime_keys_do_not(tmp_path):
    (tmp_path / "fm1").mkdir()
    a = to_dict(load_config("finetune", "resmlp_s12", ["demo=false", f"checkpoint={tmp_path / 'fm1'}"]))
    same = to_dict(load_config("finetune", "resmlp_s12", [
        "demo=false", f"checkpoint={tmp_path / 'fm1' / 'checkpoint.pth'}", "num_workers=1", "log_every=3",
        f"out={tmp_path / 'elsewhere'}", "model.grad_checkpointing=true"]))
    assert settings_differences(a, same) == []
    other = to_dict(load_config("finetune", "resmlp_s12", ["demo=false", f"checkpoint={tmp_path / 'fm2'}",
                                                           "optim.lr=0.5"]))
    assert settings_differences(a, other) == [
        f"checkpoint: {tmp_path / 'fm1' / 'checkpoint.pth'} -> {tmp_path / 'fm2'}", "optim.lr: 0.001 -> 0.5"]
    # dino.init left out: the run's own start; `auto` now: what the run chose then
    d = to_dict(load_config("dino", "resmlp_s12", ["demo=false", f"dino.init={tmp_path / 'fm1'}"]))
    d["dino"]["init_head"] = True
    assert settings_differences(d, to_dict(load_config("dino", "resmlp_s12", ["demo=false"]))) == []


def test_the_step_as_one_cuda_graph_is_how_a_run_ran_not_what_it_computed():
    """dino.cuda_graphs is a runtime key as compile is: a finished run is the run asked for
    whatever it says, also as the text 'false' a config.yaml kept before its limit was a list."""
    was = to_dict(load_config("dino", "resmlp_s12", ["demo=false"]))
    was["dino"]["cuda_graphs"] = "false"
    now = to_dict(load_config("dino", "resmlp_s12", ["demo=false", "dino.cuda_graphs=true"]))
    assert settings_differences(was, now) == []


# ---- fine-tuned, then probed, in turn ------------------------------------------------------

@pytest.mark.slow
def test_two_checkpoints_fine_tuned_then_probed_each_keep_their_own_results(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)    # the default runs/ is the current folder's
    lab = labeled(tmp_path / "lab")
    runs = tmp_path / "runs"
    fm = {n: dino_run(runs, n, lab, seed) for n, seed in (("fm1", 1), ("fm2", 2))}
    done = {}
    for name in ("fm2", "fm1"):     # the issue's order: fm1 after fm2 found fm2's run
        assert main(["finetune", f"runs/{name}", *FINETUNE]) == 0
        out = capsys.readouterr().out
        assert "nothing to do" not in out
        done[name] = runs / f"finetune_resmlp_s12_imagefolder_from_{name}"
        res = json.loads((done[name] / "results.json").read_text())
        assert res["init"]["checkpoint"] == str(fm[name]), res["init"]
    assert json.loads((done["fm1"] / "results.json").read_text())["init"]["weights_hash"] != \
        json.loads((done["fm2"] / "results.json").read_text())["init"]["weights_hash"]

    # the same command again: its own finished run, nothing to do, nothing touched
    before = {p: p.read_bytes() for p in done["fm1"].rglob("*") if p.is_file()}
    assert main(["finetune", "runs/fm1/checkpoint.pth", *FINETUNE, "num_workers=1"]) == 0
    assert "holds a finished run" in capsys.readouterr().out
    # other settings: one line naming the first difference and the folder beside it, exit 2
    assert main(["finetune", "runs/fm1", *FINETUNE, "optim.lr=0.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "other settings (optim.lr: 0.001 -> 0.5)" in err, err
    assert f"pass out={Path('runs') / done['fm1'].name}_2 " in err
    assert {p: p.read_bytes() for p in done["fm1"].rglob("*") if p.is_file()} == before
    assert not Path(f"{done['fm1']}_2").exists()
    # out= naming fm2's run for fm1's weights: not fm2's result taken for fm1's, refused
    assert main(["finetune", "runs/fm1", *FINETUNE, f"out={done['fm2']}"]) == 2
    assert f"started from {fm['fm2'] / 'checkpoint.pth'}" in capsys.readouterr().err

    # probed in turn, with default folders: each result beside its own checkpoint
    for name in ("fm2", "fm1"):
        assert main(["linear", str(done[name]), "linear.epochs=2", "num_workers=0"]) == 0
    for name in ("fm1", "fm2"):
        lin = json.loads((done[name] / "linear.json").read_text())
        assert lin["checkpoint"]["spec"] == str(done[name])
        [entry] = lines(done[name] / "evaluations.jsonl")
        assert entry["command"] == "linear" and entry["results"]["top1"] == lin["top1"]

    # an unfinished run is still continued by the same command
    (done["fm1"] / "results.json").unlink()
    assert main(["finetune", "runs/fm1", *FINETUNE]) == 0
    assert "resuming from" in capsys.readouterr().out and (done["fm1"] / "results.json").exists()


# ---- evaluations keep their history ---------------------------------------------------------

def test_knn_twice_with_other_settings_keeps_both_results(tmp_path, capsys):
    lab = labeled(tmp_path / "lab")
    run = dino_run(tmp_path / "runs", "fm1", lab, 1)
    assert main(["knn", str(run), "k=3", "few_labels=[2]", "tries=2", "num_workers=0"]) == 0
    assert main(["knn", str(run), "k=5", "T=0.1", "num_workers=0"]) == 0
    first, second = lines(run / "evaluations.jsonl")
    assert first["config"]["knn"]["k"] == 3 and first["results"]["few_labels"]   # the few-label table kept
    assert second["config"]["knn"]["k"] == 5 and second["config"]["knn"]["temperature"] == 0.1
    assert first["name"] != second["name"] and first["name"].startswith(f"imagefolder-{lab.name}-")
    last = json.loads((run / "knn.json").read_text())                       # knn.json: the last result
    assert last["config"]["knn"]["k"] == 5 and last["results"] == second["results"]["results"]
    # the run's own results.json is not an evaluator's to write
    assert not (run / "results.json").exists()
    # the same settings again: a third entry, the earlier two as they were
    assert main(["knn", str(run), "k=3", "few_labels=[2]", "tries=2", "num_workers=0"]) == 0
    again = lines(run / "evaluations.jsonl")
    assert again[:2] == [first, second] and again[2]["name"] == first["name"]


def test_viz_on_a_run_still_training_says_so_first_and_marks_the_epoch(tmp_path, capsys):
    lab = labeled(tmp_path / "lab")
    run = dino_run(tmp_path / "runs", "fm1", lab, 1)            # a fresh checkpoint, no results.json
    capsys.readouterr()
    assert main(["viz", str(run), "viz.figures=[sparsity]", "viz.dpi=30"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(f"note: {run} is still training (no results.json yet)"), out
    [folder] = [p.parent for p in (run / "viz").rglob("viz.json")]
    assert folder.parent == run / "viz" / "epoch3" and (folder / "sparsity.png").is_file()
    # other settings (another labeled set's crop): another folder, the first one's figures kept
    drawn = (folder / "sparsity.png").read_bytes()
    assert main(["viz", str(run), "viz.figures=[sparsity]", "viz.dpi=30", "data.crop_ratio=1.0"]) == 0
    folders = sorted(p.parent for p in (run / "viz").rglob("viz.json"))
    assert len(folders) == 2 and (folder / "sparsity.png").read_bytes() == drawn
    assert [e["dir"] for e in lines(run / "evaluations.jsonl")] == [str(folder), str(*set(folders) - {folder})]
    # once it has finished, figures go to viz/<name>/ without a note
    (run / "results.json").write_text(json.dumps({"epochs": 3}))
    capsys.readouterr()
    assert main(["viz", str(run), "viz.figures=[sparsity]", "viz.dpi=30"]) == 0
    assert "still training" not in capsys.readouterr().out
    assert (run / "viz" / folder.name / "sparsity.png").is_file()


# ---- the same path, other weights ------------------------------------------------------------

def sha256(path: Path) -> str:
    import hashlib
    return hashlib.sha256(path.read_bytes()).hexdigest()


def files_of(folder: Path) -> dict:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_spec_names_its_weights_by_their_bytes(tmp_path):
    from resmlp.core.weights import WeightsSpec
    run = tmp_path / "fm1"
    run.mkdir()
    (run / "checkpoint.pth").write_bytes(b"a" * 100)
    first = WeightsSpec.parse(run).identity()
    assert first == {"file": str(run.resolve() / "checkpoint.pth"), "bytes": 100,
                     "sha256": sha256(run / "checkpoint.pth")}
    assert WeightsSpec.parse(run / "checkpoint.pth").identity() == first       # the same file, either way named
    (run / "checkpoint.pth").write_bytes(b"b" * 100)                            # rewritten in place, same size
    assert WeightsSpec.parse(run).identity()["sha256"] != first["sha256"]
    assert WeightsSpec.parse("timm:resmlp_12_224?random").identity() == {"timm": "timm:resmlp_12_224?random"}
    assert WeightsSpec.parse(tmp_path / "gone.pth").identity() is None          # the loader says it is missing


def test_each_trainer_records_the_weights_its_input_key_names(tmp_path):
    from resmlp.core.run_folder import INPUTS_NAME, input_changed, record_inputs
    teacher = tmp_path / "teacher.pth"
    teacher.write_bytes(b"one")
    keys = {"distill": "distill.teacher", "finetune": "checkpoint", "dino": "dino.init"}
    cfgs = {c: load_config(c, "resmlp_s12", ["demo=false", f"{k}={teacher}"]) for c, k in keys.items()}
    for command, cfg in cfgs.items():
        record_inputs(tmp_path / command, cfg)
        assert json.loads((tmp_path / command / INPUTS_NAME).read_text())[keys[command]]["sha256"] == sha256(teacher)
        assert input_changed(tmp_path / command, cfg) is None
    teacher.write_bytes(b"two")
    for command, cfg in cfgs.items():
        key, why = input_changed(tmp_path / command, cfg)
        assert key == keys[command] and why.startswith(f"{teacher} as it was then") and sha256(teacher)[:12] in why
    # dino without dino.init: the run's own start, nothing compared; a fresh start keeps no stale record
    plain = load_config("dino", "resmlp_s12", ["demo=false"])
    assert input_changed(tmp_path / "dino", plain) is None
    record_inputs(tmp_path / "dino", plain)
    assert not (tmp_path / "dino" / INPUTS_NAME).exists()


@pytest.mark.slow
def test_a_checkpoint_rewritten_in_place_is_not_taken_for_the_one_a_run_started_from(tmp_path, monkeypatch, capsys):
    from resmlp.core.run_folder import INPUTS_NAME
    monkeypatch.chdir(tmp_path)
    lab = labeled(tmp_path / "lab")
    fm1 = dino_run(tmp_path / "runs", "fm1", lab, 1)
    ckpt = fm1 / "checkpoint.pth"
    old_bytes = ckpt.read_bytes()
    finetune = ["finetune", "runs/fm1", *FINETUNE, "finetune.min_steps=0"]   # its 3 steps
    assert main(finetune) == 0
    done = tmp_path / "runs" / "finetune_resmlp_s12_imagefolder_from_fm1"
    assert json.loads((done / INPUTS_NAME).read_text()) == {
        "checkpoint": {"file": str(ckpt), "bytes": ckpt.stat().st_size, "sha256": sha256(ckpt)}}
    capsys.readouterr()
    assert main(finetune) == 0                      # unchanged: nothing to do
    assert "holds a finished run" in capsys.readouterr().out

    dino_run(tmp_path / "runs", "fm1", lab, 2)                                  # fm1 retrained: other weights there
    new = sha256(ckpt)
    before = files_of(done)
    for state in ("finished", "unfinished"):
        assert main(finetune) == 2, state
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "nothing to do" not in err, err
        was = json.loads((done / INPUTS_NAME).read_text())["checkpoint"]["sha256"]
        assert f"holds a{'n' if state == 'unfinished' else ''} {state} run from {ckpt} as it was then (its weights " \
               f"changed since: sha256 {was[:12]} then, {new[:12]} now); pass out={Path('runs') / done.name}_2 to " \
               "start this one beside it" in err, err
        assert files_of(done) == before and not Path(f"{done}_2").exists()
        if state == "finished":                                                 # a run killed before its end
            results = (done / "results.json").read_bytes()
            (done / "results.json").unlink()
            before = files_of(done)
    (done / "results.json").write_bytes(results)

    ckpt.write_bytes(old_bytes)                                                 # the weights it read, back
    assert main(finetune) == 0
    assert "holds a finished run" in capsys.readouterr().out
    # a run dir from before runs kept their inputs: taken as started from the weights there now
    dino_run(tmp_path / "runs", "fm1", lab, 2)
    (done / INPUTS_NAME).unlink()
    assert main(finetune) == 0
    assert "holds a finished run" in capsys.readouterr().out


DINO_INIT = ["data=imagefolder", "epochs=1", "batch_size=4", "dino.out_dim=64", "dino.hidden_dim=32",
             "dino.bottleneck_dim=16", "dino.n_local_crops=2", "data.local_size=8", "eval_every=0", "knn.k=3",
             "dino.head_warmup_epochs=0"]


@pytest.mark.slow
def test_dino_init_from_a_file_rewritten_since_is_refused_finished_or_not(tmp_path, capsys):
    lab = labeled(tmp_path / "lab")
    fm1 = dino_run(tmp_path / "runs", "fm1", lab, 1)
    run = tmp_path / "runs" / "cont"
    args = ["dino", "resmlp_s12", *TINY, *DINO_INIT, f"data.root={lab}", f"dino.init={fm1}", f"out={run}"]
    assert main(args) == 0
    assert main(args) == 0 and "holds a finished run" in capsys.readouterr().out     # unchanged: nothing to do
    dino_run(tmp_path / "runs", "fm1", lab, 2)                                         # other weights, same path
    for state in ("finished", "unfinished"):
        before = files_of(run)
        assert main(args) == 2, state
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and f"run from {fm1 / 'checkpoint.pth'} as it was then (its weights changed" in err
        assert ("drop dino.init to continue that run, or pass" in err) == (state == "unfinished"), err
        assert files_of(run) == before and not Path(f"{run}_2").exists()
        (run / "results.json").unlink(missing_ok=True)


def test_compare_reuses_a_finished_path_only_while_its_input_holds_the_same_weights(tmp_path):
    from resmlp.core.run_folder import record_inputs
    from resmlp.core.errors import UserError
    from resmlp.supervised.compare import finished, plan, sub_config, weights_key
    lab = labeled(tmp_path / "lab")
    cfg = load_config("compare", "resmlp_s12", [*TINY, "data=imagefolder", f"data.root={lab}",
                                                "compare.teacher=timm:regnety_002?random", f"out={tmp_path / 'cmp'}"])
    step = next(s for s in plan(cfg) if s.key == "linear")                # linear/ probes dino/'s checkpoint
    dino = dino_run(tmp_path, "cmp/dino", lab, 1)
    sub = sub_config(cfg, step)
    save_config(sub, step.dir / "config.yaml")
    record_inputs(step.dir, sub, weights_key(step))
    (step.dir / "results.json").write_text(json.dumps({"top1": 50.0}))
    assert finished(step, sub) == {"top1": 50.0}
    dino_run(tmp_path, "cmp/dino", lab, 2)                                # dino/ trained again
    with pytest.raises(UserError, match=f"a finished linear run \\(linear/\\) from {dino / 'checkpoint.pth'} as "
                                        f"it was then .*; pass out={tmp_path / 'cmp'}_2 to start"):
        finished(step, sub)


def test_knn_on_a_checkpoint_rewritten_in_place_evaluates_the_new_weights(tmp_path):
    # evaluators have no "nothing to do": each run reads the file, and the feature cache is keyed
    # by the weights it loaded (models.load.weights_hash), not by the path
    lab = labeled(tmp_path / "lab")
    run = dino_run(tmp_path / "runs", "fm1", lab, 1)
    assert main(["knn", str(run), "k=3", "num_workers=0"]) == 0
    dino_run(tmp_path / "runs", "fm1", lab, 2)
    assert main(["knn", str(run), "k=3", "num_workers=0"]) == 0
    first, second = lines(run / "evaluations.jsonl")
    assert first["checkpoint"]["weights_hash"] != second["checkpoint"]["weights_hash"]
    assert len(list((run / "features").glob("train-*"))) == 2
