"""Cluster-grade runs: a stop signal ends a run at an iteration with a checkpoint and the
resumed run ends with the uninterrupted run's weights (one process, two gloo processes,
loader workers, every trainer); the SLURM launcher (sbatch parameters, a job interrupted
and requeued by submitit's local executor); torchrun's c10d rendezvous through run.sh;
the run directory's lock and the fallback to the previous checkpoint."""
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from resmlp.core.errors import PREEMPTED_EXIT, UserError
from resmlp.core.preempt import CTRL_C_REPEAT_S

ROOT = Path(__file__).resolve().parent.parent
FMNIST = Path("/usr/share/datasets/fashion-mnist")
needs_fmnist = pytest.mark.skipif(not FMNIST.exists(), reason="Debian's dataset-fashion-mnist is not installed")

# 2 epochs x 4 iterations of a tiny DINO (tests/test_dino.py's TINY on 128 images)
DINO = ["dino", "resmlp_s12", "demo=false", "model.dim=16", "model.depth=2", "data.subset=128", "batch_size=32",
        "epochs=2", "dino.out_dim=64", "dino.hidden_dim=32", "dino.bottleneck_dim=16", "dino.n_local_crops=2",
        "optim.warmup_epochs=1", "num_workers=0", "eval_every=0", "log_every=1", "dino.final_linear=false",
        "model.drop_path_rate=0.0"]
TOTAL = 8


def cli(*args):
    return [sys.executable, "-m", "resmlp.core.cli", *args]


def run_sh(*args, **env):
    """run.sh with this interpreter (no .venv build inside the tests)."""
    e = {**os.environ, "RESMLP_PYTHON": sys.executable, **env}
    return ["bash", str(ROOT / "run.sh"), *args], e


def finish(proc: subprocess.Popen, timeout: int = 600) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def logged_iteration(run_dir: Path) -> int:
    try:
        lines = (run_dir / "log.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    return max((json.loads(line).get("iteration", 0) for line in lines if line.strip()), default=0)


def wait_for_training(proc: subprocess.Popen, run_dir: Path, timeout: float = 300) -> None:
    """Until the run has logged its first iteration (its loop is running)."""
    deadline = time.time() + timeout
    while logged_iteration(run_dir) < 1:
        assert proc.poll() is None, f"the run ended before training: {proc.communicate()[1][-2000:]}"
        assert time.time() < deadline, "the run did not start training"
        time.sleep(0.1)


def weights(run_dir: Path, keys=("student", "teacher")) -> dict:
    ckpt = torch.load(run_dir / "checkpoint.pth", weights_only=False)
    return {"iteration": ckpt["iteration"], **{k: ckpt[k] for k in keys}}


def assert_same_weights(a: dict, b: dict) -> None:
    assert a["iteration"] == b["iteration"]
    for key in a:
        if key == "iteration":
            continue
        for name, value in a[key].items():
            assert torch.equal(value, b[key][name]), f"{key}.{name} differs"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Every trainer with each iteration 2.5 s longer (the Cadence every loop ends an iteration
# with), however fast the machine: room to press Ctrl-C twice, CTRL_C_REPEAT_S apart, within
# one iteration, and for a signal sent once iteration 1 is logged to land before the last one
# (the tiny run's loop ends moments after its first log line: a test process scheduled a
# little late saw the run end unstopped).
SLOW_STEPS = ("import sys, time\n"
              "from resmlp.core import cadence\n"
              "real = cadence.Cadence.after_iteration\n"
              "cadence.Cadence.after_iteration = lambda self, *a, **k: time.sleep(2.5) or real(self, *a, **k)\n"
              "from resmlp.core.cli import main\n"
              "sys.exit(main(sys.argv[1:]))\n")


def slow_cli(*args):
    return [sys.executable, "-c", SLOW_STEPS, *args]


def slow_workers(folder: Path) -> str:
    """An interpreter for torchrun's PYTHON_EXEC: its workers (`PYTHON_EXEC -u -m
    resmlp.core.cli ARGS`) run ARGS with SLOW_STEPS."""
    exe = folder / "slow_python"
    exe.write_text('#!/bin/sh\n[ "$1 $2 $3" = "-u -m resmlp.core.cli" ] || { echo "slow_python: $*" >&2; exit 3; }\n'
                   f'shift 3\nexec {shlex.quote(sys.executable)} -u -c {shlex.quote(SLOW_STEPS)} "$@"\n')
    exe.chmod(0o755)
    return str(exe)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The tiny DINO run, start to end: its weights are what every interrupted run must end with."""
    out = tmp_path_factory.mktemp("uninterrupted")
    done = subprocess.run(cli(*DINO, f"out={out}"), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


# ---- a stop signal: checkpoint at the iteration, distinct exit code, resume to the same weights ----
@needs_fmnist
def test_sigterm_mid_epoch_saves_the_iteration_and_resumes_to_the_same_weights(tmp_path, uninterrupted):
    out = tmp_path / "cut"
    proc = subprocess.Popen(slow_cli(*DINO, f"out={out}"), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    wait_for_training(proc, out)
    proc.send_signal(signal.SIGTERM)
    cut = finish(proc)
    assert cut.returncode == PREEMPTED_EXIT, cut.stderr[-2000:]
    assert "Traceback" not in cut.stderr
    message = cut.stderr.strip().splitlines()[-1]
    stopped_at = torch.load(out / "checkpoint.pth", weights_only=False)["iteration"]
    assert message.startswith(f"stopped by SIGTERM after iteration {stopped_at} of {TOTAL}")
    assert 1 <= stopped_at < TOTAL
    assert logged_iteration(out) == stopped_at     # no iteration ran past the checkpoint
    assert not (out / "run.lock").exists()         # released on the way out

    resumed = subprocess.run(cli(*DINO, f"out={out}"), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"iteration {stopped_at})" in resumed.stdout
    assert_same_weights(weights(uninterrupted), weights(out))


@needs_fmnist
def test_sigterm_to_every_process_of_the_run_spares_its_loader_workers(tmp_path):
    """A scheduler signals the whole process tree: a loader worker that died of it would
    take the loop down with a traceback instead of a checkpoint."""
    out = tmp_path / "tree"
    proc = subprocess.Popen(slow_cli(*DINO, f"out={out}", "num_workers=2"), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for_training(proc, out)
    os.killpg(proc.pid, signal.SIGTERM)
    cut = finish(proc)
    assert cut.returncode == PREEMPTED_EXIT, cut.stderr[-3000:]
    assert "Traceback" not in cut.stderr and "stopped by SIGTERM" in cut.stderr
    assert 1 <= torch.load(out / "checkpoint.pth", weights_only=False)["iteration"] < TOTAL


def worker_pid(parent: int, rank: int, timeout: float = 120) -> int:
    """The pid of torchrun's worker process of `rank` (Linux /proc)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
                env = (p / "environ").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            if ppid == parent and f"RANK={rank}".encode() in env:
                return int(p.name)
        time.sleep(0.2)
    raise AssertionError(f"no worker of rank {rank} under pid {parent}")


@needs_fmnist
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds torchrun's workers through /proc")
def test_two_processes_stop_together_when_one_is_signalled_and_resume_to_the_same_weights(tmp_path):
    """Two gloo processes: SIGUSR1 reaches rank 1 only; both stop after the same iteration,
    rank 0 saves it. The uninterrupted run starts with a fixed master (MASTER_ADDR form),
    the interrupted (with SLOW_STEPS) and the resumed ones with torchrun's c10d rendezvous
    (RDZV_ENDPOINT)."""
    args = [*DINO, "device=cpu"]
    cmd, env = run_sh(*args, f"out={tmp_path / 'whole'}", NPROC_PER_NODE="2", MASTER_PORT=str(free_port()))
    whole = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert whole.returncode == 0, whole.stderr[-3000:]

    out = tmp_path / "cut"
    cmd, env = run_sh(*args, f"out={out}", NPROC_PER_NODE="2", RDZV_ENDPOINT=f"127.0.0.1:{free_port()}",
                      PYTHON_EXEC=slow_workers(tmp_path))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rank1 = worker_pid(proc.pid, 1)   # run.sh execs torchrun: the workers are its children
    wait_for_training(proc, out)
    os.kill(rank1, signal.SIGUSR1)
    cut = finish(proc)
    assert cut.returncode != 0 and re.search(rf"exitcode\s*:\s*{PREEMPTED_EXIT}\b", cut.stderr)  # torchrun's summary
    assert "stopped by a stop signal to another process after iteration" in cut.stderr, cut.stderr[-3000:]
    stopped_at = torch.load(out / "checkpoint.pth", weights_only=False)["iteration"]
    assert 1 <= stopped_at < TOTAL and logged_iteration(out) == stopped_at

    cmd, env = run_sh(*args, f"out={out}", NPROC_PER_NODE="2", RDZV_ENDPOINT=f"127.0.0.1:{free_port()}")
    resumed = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"iteration {stopped_at})" in resumed.stdout
    assert_same_weights(weights(tmp_path / "whole"), weights(out))


# ---- the ranks agree on a stop and on a log line by time in one host all-reduce per iteration ----------
# The loop below is the trainers' (ssl/train.py, supervised/train.py) on a Cadence with no network:
# 2 epochs of 6 iterations, mid-epoch checkpoints at 4 and 8, log lines by count only at 1 and 12,
# and a line by time (log_every_s=20) that only rank 1's slow clock (7 s an iteration) calls for.
AGREE_CFG = {"epochs": 2, "log_every": 1000, "log_every_s": 20, "ckpt_every": 4, "ckpt_epochs": 1, "eval_every": 0}
# Host all-reduces at each iteration: one; a checkpoint asks again after its write (4, 8 and the
# epoch ends 6, 12), where a signal may have come; 12 logs by count, so only its checkpoint asks.
ASKS = {1: 1, 2: 1, 3: 1, 4: 2, 5: 1, 6: 2, 7: 1, 8: 2, 9: 1, 10: 1, 11: 1, 12: 1}
TIMED_LINES = [1, 4, 7, 10, 12]


def _agreeing_loop(rank: int, out_dir: str, signal_before: int = 0, signal_in_save: int = 0, slow: bool = False) -> dict:
    """The trainers' loop on rank `rank`; a `slow` rank's clock calls for lines by time, and it
    gets SIGTERM before iteration `signal_before`'s log_due, or during the write of iteration
    `signal_in_save`'s checkpoint. Counts the host-side all-reduces per iteration (those over
    core.dist's host group; in a single process, any)."""
    import torch.distributed as tdist
    from omegaconf import OmegaConf

    from resmlp.core import dist, preempt
    from resmlp.core.cadence import Cadence
    from resmlp.core.errors import Preempted
    at, asks, logged, saved = [0], {}, [], []
    real = tdist.all_reduce

    def counting(t, *args, group=None, **kwargs):
        if group is dist._host_group:  # the host flags' group (the device tally's reads go over the default one)
            asks[at[0]] = asks.get(at[0], 0) + 1
        return real(t, *args, group=group, **kwargs)
    tdist.all_reduce = counting

    def save(state):
        saved.append(state["iteration"])
        if slow and state["iteration"] == signal_in_save:
            signal.raise_signal(signal.SIGTERM)

    run = SimpleNamespace(cfg=OmegaConf.create(AGREE_CFG), started=0.0, dir=Path(out_dir), is_main=rank == 0,
                          memory_mb=dict, save=save)
    stopped, now = None, [0.0]
    try:
        with preempt.watch():
            cadence = Cadence(run, iterations_per_epoch=6, start_it=0, results={}, state={})
            cadence.clock, cadence.logged_at = (lambda: now[0]), 0.0
            for _epoch in range(2):
                for _batch in range(6):
                    cadence.tally.add(torch.tensor(1.0))
                    at[0] += 1
                    it = at[0]
                    cadence.count(1)
                    now[0] += 7.0 if slow else 0.0
                    if slow and it == signal_before:
                        signal.raise_signal(signal.SIGTERM)
                    if cadence.log_due(it):
                        cadence.log_record(it)
                        logged.append(it)
                    if cadence.checkpoint_due(it):
                        cadence.checkpoint(it)
                    cadence.after_iteration(it)
                cadence.read(it)
                cadence.checkpoint(it)
    except Preempted as e:
        stopped = [at[0], str(e)]
    finally:
        tdist.all_reduce = real
    return {"asks": {str(k): v for k, v in asks.items()}, "logged": logged, "saved": saved, "stopped": stopped}


def _agreeing_rank(rank: int, store: str, out_dir: str, signal_before: int, signal_in_save: int) -> None:
    import torch.distributed as tdist

    from resmlp.core import dist
    tdist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    dist._host_group = tdist.new_group(backend="gloo")  # the group dist.setup makes beside NCCL
    with dist.leaving():
        seen = _agreeing_loop(rank, out_dir, signal_before, signal_in_save, slow=rank == 1)
    Path(out_dir, f"{rank}.json").write_text(json.dumps(seen))


@pytest.mark.parametrize("signal_before,signal_in_save,stop,saves", [
    (0, 0, None, [4, 6, 8, 12]),  # no signal: the whole run
    (9, 0, 9, [4, 6, 8, 9]),      # mid-epoch: the iteration's one all-reduce carries it
    (0, 4, 4, [4]),               # during a checkpoint's write: its own ask stops there, no second write
    (6, 0, 6, [4, 6]),            # at an epoch's end: after the epoch's work, at its checkpoint
])
def test_two_ranks_agree_on_a_stop_and_a_timed_log_line_in_one_host_all_reduce_per_iteration(
        tmp_path, signal_before, signal_in_save, stop, saves):
    import torch.multiprocessing as mp
    mp.spawn(_agreeing_rank, args=(str(tmp_path / "store"), str(tmp_path), signal_before, signal_in_save),
             nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    last = stop or 12
    for seen in ranks:
        assert {int(k): v for k, v in seen["asks"].items()} == {i: n for i, n in ASKS.items() if i <= last}
        assert seen["logged"] == [i for i in TIMED_LINES if i <= last]  # rank 0 logs by rank 1's clock
        assert seen["saved"] == saves
        assert (seen["stopped"] or [None])[0] == stop  # every rank stops after the same iteration
    if stop:
        assert ranks[0]["stopped"][1].startswith(f"stopped by a stop signal to another process after iteration {stop} "
                                                 "of 12, with a checkpoint of it")


def test_a_single_process_agrees_with_no_all_reduce(tmp_path):
    """A world of one: the flags are its own, no collective runs (no process group either)."""
    seen = _agreeing_loop(0, str(tmp_path), signal_before=9, slow=True)
    assert seen["asks"] == {} and seen["stopped"][0] == 9 and seen["saved"] == [4, 6, 8, 9]
    assert seen["logged"] == [1, 4, 7] and seen["stopped"][1].startswith("stopped by SIGTERM after iteration 9")


def test_run_sh_passes_the_rendezvous_or_the_master_to_torchrun(tmp_path):
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "$@"\n')  # stands in for the interpreter: prints what it was given
    fake.chmod(0o755)
    cmd, env = run_sh("dino", "resmlp_s12", "epochs=1", RESMLP_PYTHON=str(fake), NPROC_PER_NODE="4",
                      NNODES="2", RDZV_ENDPOINT="node7:29400", RDZV_ID="job42")
    rdzv = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True).stdout.splitlines()[-1]
    assert rdzv.startswith("-m torch.distributed.run --nproc_per_node=4 --nnodes=2 --rdzv_backend=c10d "
                           "--rdzv_endpoint=node7:29400 --rdzv_id=job42 --rdzv_conf=join_timeout=300 "
                           "-m resmlp.core.cli dino")
    assert "master_addr" not in rdzv and "node_rank" not in rdzv
    cmd, env = run_sh("dino", "resmlp_s12", RESMLP_PYTHON=str(fake), NPROC_PER_NODE="4", NNODES="2",
                      NODE_RANK="1", MASTER_ADDR="node0")
    fixed = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True).stdout.splitlines()[-1]
    assert "--node_rank=1 --master_addr=node0 --master_port=29500" in fixed and "rdzv" not in fixed


# ---- the supervised loop (supervised, distill, finetune) ------------------------------------------
SUPERVISED = ["model.dim=32", "model.depth=2", "data.subset=128", "batch_size=32", "num_workers=0", "demo=false",
              "log_every=1", "eval_every=0", "epochs=2", "eval_limit=100", "eval_batch_size=100",
              "model.drop_path_rate=0.1"]  # the rest is the full recipe: mixup, RandAugment, erasing


@needs_fmnist
@pytest.mark.parametrize("command", ["supervised", "distill", "finetune"])
def test_supervised_loop_stops_on_sigusr1_and_resumes_to_the_same_weights(tmp_path, command, uninterrupted):
    if command == "supervised":
        args = ["supervised", "resmlp_s12", *SUPERVISED]
    elif command == "distill":  # the teacher: a classifier of this test's own, trained for an epoch
        teacher = tmp_path / "teacher"
        made = subprocess.run(cli("supervised", "resmlp_s12", *SUPERVISED, "epochs=1", f"out={teacher}"), cwd=ROOT,
                              capture_output=True, text=True, timeout=900)
        assert made.returncode == 0, made.stderr[-2000:]
        args = ["distill", "resmlp_s12", *SUPERVISED, f"teacher={teacher}"]
    else:  # fine-tuning the tiny DINO run (the model and data come from it)
        args = ["finetune", str(uninterrupted), *[a for a in SUPERVISED if not a.startswith("model.")],
                "finetune.min_steps=0"]  # the epochs as given: TOTAL steps
    whole = subprocess.run(cli(*args, f"out={tmp_path / 'whole'}"), cwd=ROOT, capture_output=True, text=True,
                           timeout=900)
    assert whole.returncode == 0, whole.stderr[-2000:]

    out = tmp_path / "cut"
    proc = subprocess.Popen(slow_cli(*args, f"out={out}"), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    wait_for_training(proc, out)
    proc.send_signal(signal.SIGUSR1)
    cut = finish(proc)
    assert cut.returncode == PREEMPTED_EXIT, cut.stderr[-2000:]
    assert "stopped by SIGUSR1 after iteration" in cut.stderr and "Traceback" not in cut.stderr
    stopped_at = torch.load(out / "checkpoint.pth", weights_only=False)["iteration"]
    assert 1 <= stopped_at < TOTAL

    resumed = subprocess.run(cli(*args, f"out={out}"), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"iteration {stopped_at})" in resumed.stdout
    assert_same_weights(weights(tmp_path / "whole", keys=("model",)), weights(out, keys=("model",)))


# ---- Ctrl-C: the first as SIGTERM (exit 130), a second stops at once ----------------------------------
def ctrl_c(proc: subprocess.Popen) -> None:
    """What a terminal does: SIGINT to every process of its foreground group, loader workers too."""
    os.killpg(proc.pid, signal.SIGINT)


def clean(stderr: str) -> bool:
    return "Traceback" not in stderr and "Exception ignored" not in stderr and "KeyboardInterrupt" not in stderr


def test_a_first_ctrl_c_is_noted_and_a_second_stops_at_once(monkeypatch):
    from resmlp.core import preempt
    monkeypatch.setattr(preempt, "CTRL_C_REPEAT_S", 0.2)
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN where the suite was started in the background
    with preempt.watch(ctrl_c=True):
        signal.raise_signal(signal.SIGINT)
        assert preempt.requested() and preempt.received() == "SIGINT"
        signal.raise_signal(signal.SIGINT)   # the same Ctrl-C again (torchrun passes it on)
        time.sleep(0.3)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before
    # the block has ended: its Ctrl-C names the exit code but stops no later run outside a block
    assert preempt.received() == "SIGINT" and not preempt.requested()


@needs_fmnist
@pytest.mark.slow
@pytest.mark.parametrize("command", ["dino", "supervised"])
def test_ctrl_c_stops_at_the_iteration_with_a_checkpoint_and_resumes(tmp_path, command, request):
    """DINO ends with the uninterrupted run's weights (whose loader has no workers: their
    number sets the CPU threads, and so the rounding); the supervised run's loader workers
    get the Ctrl-C too, and ignore it."""
    if command == "dino":
        args = [*DINO]
    else:
        args = ["supervised", "resmlp_s12", *SUPERVISED, "num_workers=2"]
    out = tmp_path / "cut"
    proc = subprocess.Popen(slow_cli(*args, f"out={out}"), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for_training(proc, out)
    ctrl_c(proc)
    cut = finish(proc)
    assert cut.returncode == 130 and clean(cut.stderr), cut.stderr[-3000:]
    stopped_at = torch.load(out / "checkpoint.pth", weights_only=False)["iteration"]
    assert 1 <= stopped_at < TOTAL and logged_iteration(out) == stopped_at
    err = cut.stderr.strip().splitlines()
    assert err[0].startswith("Ctrl-C: the run stops after this iteration") and len(err) == 2, err
    assert err[-1].startswith(f"stopped by SIGINT after iteration {stopped_at} of {TOTAL}, with a checkpoint")
    assert not (out / "run.lock").exists()

    resumed = subprocess.run(cli(*args, f"out={out}"), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"iteration {stopped_at})" in resumed.stdout
    if command == "dino":
        assert_same_weights(weights(request.getfixturevalue("uninterrupted")), weights(out))


@needs_fmnist
@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_and_a_rerun_without_a_checkpoint_starts_a_clean_log(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(slow_cli(*DINO, f"out={out}", "num_workers=2"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for_training(proc, out)
    ctrl_c(proc)
    while not proc.stderr.readline().startswith("Ctrl-C:"):   # the first is noted
        assert proc.poll() is None
    time.sleep(CTRL_C_REPEAT_S + 0.2)
    ctrl_c(proc)
    cut = finish(proc)
    assert cut.returncode == 130 and clean(cut.stderr), cut.stderr[-3000:]
    assert cut.stderr.strip().splitlines()[-1].startswith("stopped at once by a second Ctrl-C; the same command")
    assert not (out / "run.lock").exists() and not (out / "checkpoint.pth").exists()
    assert logged_iteration(out) == 1

    again = subprocess.run(cli(*DINO, f"out={out}", "epochs=1"), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-2000:]
    lines = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in lines if "loss" in r] == [1, 2, 3, 4]


def test_a_second_ctrl_c_while_a_checkpoint_is_written_stops_the_run_once_it_is(tmp_path, monkeypatch):
    from resmlp.core import preempt
    monkeypatch.setattr(preempt, "CTRL_C_REPEAT_S", 0.0)
    written = []
    with preempt.watch(ctrl_c=True):
        signal.raise_signal(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            with preempt.unbroken():
                signal.raise_signal(signal.SIGINT)
                written.append("the whole checkpoint")
    assert written == ["the whole checkpoint"]


# ---- the SLURM launcher ------------------------------------------------------------------------------
def test_slurm_time_in_every_slurm_format():
    from resmlp.core.slurm import minutes
    assert [minutes(t) for t in (90, "90", "1:30:00", "2-00:00:00", "1-12", "1-0:30", "30:30")] == \
        [90, 90, 90, 2880, 2160, 1470, 31]
    for bad in ("soon", "0", "1:2:3:4", "-5"):
        with pytest.raises(UserError, match="slurm.time"):
            minutes(bad)


def test_slurm_submission_asks_for_what_the_config_says(tmp_path):
    """Through a stand-in `sbatch` (it keeps the script it is given): the job's resources,
    the requeue, the signal before the time limit, and the command each process runs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text('#!/bin/sh\ncp "$1" "$KEEP_SBATCH"\necho "Submitted batch job 4242"\n')
    (bin_dir / "srun").write_text("#!/bin/sh\n")  # submitit looks for it to know it is on a SLURM cluster
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    script = tmp_path / "job.sbatch"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "KEEP_SBATCH": str(script)}
    out = tmp_path / "run"
    done = subprocess.run(cli("dino", "resmlp_s12", "launcher=slurm", "slurm.nodes=2", "slurm.gpus_per_node=8",
                              "slurm.partition=gpu", "slurm.account=vision", "slurm.time=2-12:00:00",
                              "slurm.signal_delay_s=300", "num_workers=9", f"out={out}", "epochs=3"),
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "job 4242" in done.stdout and f"{out}/slurm/4242/4242_0_log.out" in done.stdout

    flags = dict(line[len("#SBATCH --"):].partition("=")[::2] for line in script.read_text().splitlines()
                 if line.startswith("#SBATCH --"))
    assert {k: flags[k] for k in ("nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task", "partition",
                                  "account", "time", "signal", "requeue")} == {
        "nodes": "2", "ntasks-per-node": "8", "gpus-per-node": "8", "cpus-per-task": "10", "partition": "gpu",
        "account": "vision", "time": str(60 * 60), "signal": "USR2@300", "requeue": ""}
    assert "srun" in script.read_text() and "submitit.core._submit" in script.read_text()

    import submitit
    job = submitit.helpers.DelayedSubmission.load(out / "slurm" / "4242" / "4242_submitted.pkl").function
    assert job.argv[:2] == ["dino", "resmlp_s12"] and job.argv[-2:] == ["launcher=local", f"out={out}"]
    assert "epochs=3" in job.argv and "demo" not in " ".join(job.argv)  # the GPU node decides on the demo
    assert job.checkpoint().function.argv == [*job.argv, "resume=auto"]


@needs_fmnist
def test_slurm_job_interrupted_and_requeued_ends_with_the_same_weights(tmp_path, uninterrupted):
    """submitit's local executor runs the job on this machine as SLURM would: SIGUSR2 (what
    SLURM sends before the time limit) stops it with a checkpoint, submitit requeues it,
    and the requeued job resumes and finishes."""
    from resmlp.core import cli as resmlp_cli
    from resmlp.core.slurm import submit
    out = tmp_path / "job"
    argv = [*DINO, f"out={out}", "launcher=slurm", "slurm.cluster=local", "slurm.gpus_per_node=0", "slurm.time=30"]
    _, cfg = resmlp_cli.build(argv)
    job = submit(cfg, argv, resmlp_cli.main)
    deadline = time.time() + 300
    while logged_iteration(out) < 1:
        assert job.state == "RUNNING" and time.time() < deadline, job.stderr()
        time.sleep(0.1)
    task = json.loads((out / "run.lock").read_text())["pid"]  # the job's process holds the run dir
    os.kill(task, signal.SIGUSR2)
    assert job.result() == 0
    log = job.stdout() + job.stderr()
    assert "stopped by SIGUSR2 after iteration" in log and "Requeued job" in log and "resuming from" in log
    assert_same_weights(weights(uninterrupted), weights(out))


# ---- the run directory: one live run, the previous checkpoint ---------------------------------------------
def tiny_config(out, *extra):
    from resmlp.core.config import load_config
    return load_config("dino", "resmlp_s12", [*DINO[2:], f"out={out}", *extra])


def test_a_live_run_holds_its_directory(tmp_path):
    from resmlp.core.lock import LOCK_NAME, this_process
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_NAME).write_text(json.dumps(this_process()))  # this test process: alive, and not the CLI's
    done = subprocess.run(cli(*DINO, f"out={out}"), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"pid {os.getpid()} on {socket.gethostname()}" in lines[0] and "in use" in lines[0]
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # nothing written beside it


def test_a_dead_runs_lock_is_taken_over_with_a_warning(tmp_path, capsys):
    from resmlp.core.run import Run
    from resmlp.core.lock import LOCK_NAME, this_process
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_NAME).write_text(json.dumps({**this_process(), "pid": gone.pid, "started": "1"}))
    run = Run(tiny_config(out))
    run.restore()
    assert "was left by a run that is gone" in capsys.readouterr().out
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
    run.finish({})
    assert not (out / LOCK_NAME).exists()


def test_lock_of_another_host(tmp_path, monkeypatch):
    """Another host's pid cannot be checked: its lock holds, and the message says which file
    to delete if that run is dead; a requeued SLURM job recognises its own earlier lock."""
    from resmlp.core.lock import LOCK_NAME, RunLock
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": "node17", "pid": 4, "slurm_job": "991"}))
    monkeypatch.setenv("SLURM_JOB_ID", "990")
    with pytest.raises(UserError, match=f"pid 4 on node17.*delete {tmp_path / LOCK_NAME}"):
        RunLock(tmp_path).acquire()
    monkeypatch.setenv("SLURM_JOB_ID", "991")
    assert "taking it over" in RunLock(tmp_path).acquire()


def test_unreadable_latest_checkpoint_falls_back_to_the_previous(tmp_path, capsys):
    from resmlp.core.checkpoint import rng_state
    from resmlp.core.run import Run
    out = tmp_path / "run"
    run = Run(tiny_config(out))
    run.restore()
    for it in (1, 2):
        run.save({"iteration": it, "epoch": 0, "rng": rng_state()})
    assert torch.load(out / "checkpoint_prev.pth", weights_only=False)["iteration"] == 1
    assert not list(out.glob("*.tmp"))
    run.finish({})
    latest = (out / "checkpoint.pth").read_bytes()
    (out / "checkpoint.pth").write_bytes(latest[: len(latest) // 2])  # a write cut short
    capsys.readouterr()
    assert Run(tiny_config(out)).resume_state()["iteration"] == 1
    printed = capsys.readouterr().out
    assert "warning: " in printed and "checkpoint_prev.pth instead" in printed

    (out / "checkpoint.pth").unlink()  # killed between the two renames of a save
    assert Run(tiny_config(out)).resume_state()["iteration"] == 1
    assert "checkpoint.pth is missing; resuming from the previous" in capsys.readouterr().out
    (out / "checkpoint_prev.pth").write_text("garbage")
    (out / "checkpoint.pth").write_bytes(latest[:100])
    with pytest.raises(UserError, match="no readable checkpoint in"):
        Run(tiny_config(out)).resume_state()
