"""Values (issue 29, classes 1 and 3): no silently wrong number (inf and nan refused by every
limit, a NaN loss that names a checkpoint only when there is one, local crops larger than the
global ones refused), and every user error one line, exit 2, before any work, nothing
created: list typos and unknown interpolations, numbers past what the code holds, a data.root
that is a file, a checkpoint.pth that is a folder, slurm keys without launcher=slurm, the
local executor's setup lines, and a torchrun launch that would fail (bad port, a host that
does not resolve, a rendezvous that never answers). KoLeo over several processes is in
test_dino_centering.py."""
import math
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from omegaconf import ListConfig, OmegaConf

from resmlp.core.cli import main
from resmlp.core.config import (CONFIG_DIR, WHOLE_MAX, Limit, _load_yaml, _take_rules, available, load_config,
                                method_config)
from resmlp.core.errors import RunFailed, UserError

ROOT = Path(__file__).resolve().parent.parent
FMNIST = Path("/usr/share/datasets/fashion-mnist")
needs_fmnist = pytest.mark.skipif(not FMNIST.exists(), reason="Debian's dataset-fashion-mnist is not installed")
RANDOM = "timm:resmlp_12_224?random"
TINY = ["demo=false", "model.dim=16", "model.depth=2", "data.subset=64", "batch_size=32", "epochs=1",
        "dino.out_dim=64", "dino.hidden_dim=32", "dino.bottleneck_dim=16", "dino.n_local_crops=2",
        "optim.warmup_epochs=0", "num_workers=0", "eval_every=0", "log_every=1", "dino.final_linear=false",
        "model.drop_path_rate=0.0"]


def refused(argv, tmp_path, capsys, monkeypatch) -> str:
    """Run the CLI in tmp_path with out=<tmp>/run: exit 2, one line on stderr, nothing made."""
    monkeypatch.chdir(tmp_path)
    before = sorted(tmp_path.iterdir())
    assert main([*argv, f"out={tmp_path / 'run'}"]) == 2, argv
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert sorted(tmp_path.iterdir()) == before, argv  # no run dir, no runs/
    return err[0]


def every_limit():
    """(command, key, limit) of every `limits:` entry of every method file."""
    for command in available("method"):
        cfg = OmegaConf.merge(_load_yaml(CONFIG_DIR / "defaults.yaml"), method_config(command))
        for key, limit in _take_rules(cfg, command)[0].items():
            yield command, key, limit


# ---- 1. numbers that are silently wrong ------------------------------------------------------------
def test_no_numeric_limit_takes_inf_or_nan_and_no_whole_one_goes_past_int64():
    numeric = [(c, k, lim) for c, k, lim in every_limit() if isinstance(lim, Limit)]
    assert len(numeric) > 50
    for command, key, limit in numeric:
        for v in (math.inf, -math.inf, math.nan):
            assert not limit.allows(v), (command, key, v)
        if limit.whole:
            top = limit.high if limit.high is not None else WHOLE_MAX
            assert top <= WHOLE_MAX and limit.allows(int(top)) and not limit.allows(int(top) + 1), (command, key)


@pytest.mark.parametrize("argv,says", [
    (["dino", "resmlp_s12", "optim.lr=.inf"], "optim.lr=inf is not allowed: optim.lr must be a finite number > 0"),
    (["dino", "resmlp_s12", "optim.lr=.nan"], "optim.lr=nan is not allowed"),
    (["knn", RANDOM, "T=.inf"], "knn.temperature=inf is not allowed"),
    (["supervised", "resmlp_s12", "aug.mixup=-.inf"], "aug.mixup=-inf is not allowed"),
    (["dino", "resmlp_s12", "data.mean=[.inf,0.5,0.5]"], "data.mean must be finite"),  # a key with no limit
    (["dino", "resmlp_s12", f"optim.lr={10**30}"], "at most 9223372036854775807"),  # a whole number past int64
])
def test_inf_and_nan_are_refused_before_any_work(argv, says, tmp_path, capsys, monkeypatch):
    assert says in refused(argv, tmp_path, capsys, monkeypatch)


@needs_fmnist
@pytest.mark.slow
def test_a_nan_loss_names_the_checkpoint_only_when_there_is_one(tmp_path, monkeypatch):
    from resmlp.ssl import train as dino_train
    from resmlp.ssl.loss import DinoLoss
    real, calls = DinoLoss.forward, {"n": 0, "nan_from": 1}  # the first step: no checkpoint yet

    def poisoned(self, *a, **k):
        calls["n"] += 1
        loss = real(self, *a, **k)
        return loss * float("nan") if calls["n"] >= calls["nan_from"] else loss

    monkeypatch.setattr(DinoLoss, "forward", poisoned)
    with pytest.raises(RunFailed) as first:
        dino_train.train(load_config("dino", "resmlp_s12", [*TINY, f"out={tmp_path / 'a'}"]))
    assert "no checkpoint was written" in str(first.value) and "intact" not in str(first.value)
    assert not (tmp_path / "a" / "checkpoint.pth").exists()
    calls.update(n=0, nan_from=2)  # after the checkpoint of iteration 1
    with pytest.raises(RunFailed) as second:
        dino_train.train(load_config("dino", "resmlp_s12", [*TINY, f"out={tmp_path / 'b'}", "ckpt_every=1"]))
    assert f"the last good checkpoint {tmp_path / 'b' / 'checkpoint.pth'} is intact" in str(second.value)


@pytest.mark.parametrize("strategy", ["interpolate", "subgrid"])
def test_local_crops_larger_than_the_global_ones_are_refused(strategy, tmp_path, capsys, monkeypatch):
    line = refused(["dino", "resmlp_s12", *TINY, "data.img_size=32", "model.patch_size=8", "data.local_size=48",
                    f"dino.local_crops={strategy}"], tmp_path, capsys, monkeypatch)
    assert "data.local_size=48 is larger than data.img_size=32" in line


def test_compare_refuses_them_before_its_first_path_trains(tmp_path, capsys, monkeypatch):
    from resmlp.supervised import compare
    monkeypatch.setattr(compare, "run_step", lambda *a: pytest.fail("trained a path"))
    line = refused(["compare", "resmlp_s12", "demo=false", "compare.common=[data.local_size=48]"], tmp_path, capsys,
                   monkeypatch)
    assert "the dino path" in line and "data.local_size=48 is larger than data.img_size=32" in line


# ---- 3. one line before any work -------------------------------------------------------------------
@pytest.mark.parametrize("argv,says", [
    (["knn", RANDOM, "knn.k=[10,"], "bad value in 'knn.k=[10,': not a value"),
    (["knn", RANDOM, "k=10,,20"], "bad value in 'knn.k=[10,,20]': not a value"),
    (["knn", RANDOM, "k=[10,"], "bad value in 'knn.k=[10,': not a value"),
    (["knn", RANDOM, "knn.k=10,,20"], "knn.k=10,,20 is not allowed"),
    (["knn", RANDOM, "out=runs/x_${nosuch}"], "Interpolation key 'nosuch' not found"),
    (["dino", "resmlp_s12", "seed=99999999999999999999999"], "seed must be a whole number in [0, 4294967295]"),
    (["dino", "resmlp_s12", "epochs=99999999999999999999"], "epochs must be a whole number in [1, 10000]"),
    (["dino", "resmlp_s12", "batch_size=99999999999999999999"], "at most 9223372036854775807"),
    (["linear", RANDOM, "linear.epochs=10001"], "linear.epochs must be a whole number in [1, 10000]"),
    (["finetune", RANDOM, "finetune.min_steps=-1"], "finetune.min_steps must be a whole number in [0, 10000000]"),
])
def test_typos_and_numbers_past_what_the_code_holds_are_one_line(argv, says, tmp_path, capsys, monkeypatch):
    assert says in refused(argv, tmp_path, capsys, monkeypatch)


@needs_fmnist
@pytest.mark.slow
def test_the_largest_seed_the_limit_takes_trains(tmp_path, capsys):
    assert main(["dino", "resmlp_s12", *TINY, "seed=4294967295", "data.subset=32", f"out={tmp_path}"]) == 0


def test_a_data_root_that_is_a_file_says_so(tmp_path, capsys, monkeypatch):
    (tmp_path / "images.tar").write_bytes(b"x")
    for data in ("imagefolder", "fashion_mnist", "cifar10"):
        line = refused(["data", f"data={data}", f"data.root={tmp_path / 'images.tar'}"], tmp_path, capsys,
                       monkeypatch)
        assert f"data.root={tmp_path / 'images.tar'} is a file, not a folder" in line, line


def test_a_checkpoint_that_is_a_folder_says_so(tmp_path, capsys, monkeypatch):
    (tmp_path / "cut" / "checkpoint.pth").mkdir(parents=True)  # a run dir whose checkpoint.pth is a folder
    line = refused(["knn", str(tmp_path / "cut")], tmp_path, capsys, monkeypatch)
    assert f"{tmp_path / 'cut' / 'checkpoint.pth'} is a folder, not a checkpoint file" in line, line


def test_slurm_keys_without_launcher_slurm_are_refused_and_the_job_runs_without_them(tmp_path, capsys,
                                                                                     monkeypatch):
    from resmlp.core.slurm import job_argv
    line = refused(["dino", "resmlp_s12", "slurm.nodes=2"], tmp_path, capsys, monkeypatch)
    assert "does not read slurm.nodes (launcher=local runs it here" in line and "launcher=slurm" in line
    assert job_argv(["knn", "slurm.pth", "launcher=slurm", "slurm.nodes=2", "+slurm.qos=x", "k=5"]) == \
        ["knn", "slurm.pth", "k=5"]


@needs_fmnist
@pytest.mark.slow
def test_the_local_executor_runs_the_setup_lines_and_makes_no_literal_job_folder(tmp_path):
    from resmlp.core import cli
    from resmlp.core.slurm import submit
    out, mark = tmp_path / "job", tmp_path / "setup-ran"
    argv = ["data", f"out={out}", "launcher=slurm", "slurm.cluster=local", "slurm.gpus_per_node=0",
            "slurm.time=5", f"slurm.setup=['echo $SUBMITIT_EXECUTOR > {mark}']"]
    _, cfg = cli.build(argv)
    job = submit(cfg, argv, cli.main)
    assert job.result() == 0, job.stderr()
    assert mark.read_text().strip() == "local"
    assert not list(out.rglob("%j")) and Path(job.paths.stdout).parent == out / "slurm"


# ---- torchrun through run.sh: one line before any process starts ----------------------------------------
def run_sh(tmp_path, timeout=120, **env):
    e = {**os.environ, "RESMLP_PYTHON": sys.executable, "NPROC_PER_NODE": "2", **env}
    start = time.monotonic()
    done = subprocess.run(["bash", str(ROOT / "run.sh"), "dino", "resmlp_s12", *TINY, "device=cpu",
                           f"out={tmp_path / 'run'}"], cwd=tmp_path, env=e, capture_output=True, text=True,
                          timeout=timeout)
    return done, time.monotonic() - start


@pytest.mark.parametrize("env,says", [
    ({"MASTER_PORT": "notaport"}, "MASTER_PORT='notaport' is not a port"),
    ({"RDZV_ENDPOINT": "127.0.0.1:99999"}, "the port of RDZV_ENDPOINT='127.0.0.1:99999' is not a port"),
    ({"RDZV_ENDPOINT": "nosuchhost.invalid:29400"}, "host 'nosuchhost.invalid' cannot be resolved"),
    ({"NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK='2' must be a whole number in 0..1"),
    ({"RDZV_ENDPOINT": "localhost:29400", "RDZV_TIMEOUT": "soon"}, "RDZV_TIMEOUT='soon' must be a whole number"),
])
def test_a_launch_torchrun_would_fail_is_one_line(env, says, tmp_path):
    done, _ = run_sh(tmp_path, **env)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1 and says in err[0], done.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_unreachable_rendezvous_gives_up_after_its_timeout(tmp_path):
    # TEST-NET-1 (RFC 5737): never this machine, never answers
    done, took = run_sh(tmp_path, NNODES="2", RDZV_ENDPOINT="192.0.2.1:29400", RDZV_TIMEOUT="2")
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1, done.stderr
    assert "nothing answered at RDZV_ENDPOINT=192.0.2.1:29400 within 2 s (RDZV_TIMEOUT)" in err[0]
    assert "waiting up to 2 s" in done.stdout and took < 60
    assert list(tmp_path.iterdir()) == []


def test_a_node_waits_for_the_rendezvous_host_and_knows_its_own_addresses():
    from resmlp.core.launch import is_this_machine, wait_for
    assert is_this_machine(["127.0.0.1"]) and not is_this_machine(["192.0.2.1"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    said = []
    assert not wait_for("127.0.0.1", port, 0.5, say=lambda *a, **k: said.append(a))
    assert len(said) == 1

    def host_later():  # the host's torchrun starts its store a moment after this node
        time.sleep(1.0)
        server.listen()

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    threading.Thread(target=host_later).start()
    try:
        assert wait_for("127.0.0.1", port, 30, say=lambda *a, **k: None)
    finally:
        server.close()


@pytest.mark.parametrize("k, want", [("knn.k=[10,20]", [10, 20]), ("knn.k=10", 10)])
def test_the_dino_trainer_takes_one_k_or_a_list(k, want):
    """dino.yaml promises that a list reports each k: its default must not refuse one."""
    got = load_config("dino", "resmlp_s12", ["demo=false", k]).knn.k
    assert (list(got) if isinstance(got, ListConfig) else got) == want
