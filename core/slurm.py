"""`launcher=slurm`: submit a command as a SLURM job through submitit, requeued when it
is preempted or runs out of time, and resumed from its run directory.

    bash run.sh dino resmlp_s12 launcher=slurm slurm.nodes=2 slurm.gpus_per_node=8 \
        slurm.partition=gpu slurm.time=72:00:00 data=imagenet data.root=/data/imagenet

The job starts one process per GPU (srun), each running `resmlp.core.cli.main` with the
same arguments: the entry point torchrun starts, with torch.distributed's variables set
from SLURM's. Ahead of the time limit SLURM sends submitit's signal (SIGUSR2,
`slurm.signal_delay_s` before it); a trainer treats it as it treats SIGTERM and SIGUSR1
(core.preempt): every rank stops after the current iteration with a checkpoint of it.
Then rank 0 hands the signal to submitit, which asks `Job.checkpoint` for the job to
run next (the same arguments with resume=auto) and requeues it. A preemption comes as
SIGTERM: the run stops the same way, and SLURM requeues the job (sbatch --requeue). `slurm.cluster=local`
runs the job with submitit's local executor on this machine instead, to try it out.
"""
from __future__ import annotations

import contextlib
import re
import signal
import sys
from pathlib import Path

from resmlp.core import preempt
from resmlp.core.errors import PREEMPTED_EXIT, UserError

TRAINERS = ("dino", "supervised", "distill", "finetune", "compare")  # the commands that stop cleanly on a signal


def minutes(value) -> int:
    """SLURM's time formats (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) in minutes."""
    text = str(value).strip()
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if not m or (m.group(1) is None and m.group(4) is not None and m.group(3) is None):
        raise UserError(f"slurm.time={value!r} is not a time: use minutes or [days-]hours:minutes:seconds")
    days, a, b, c = (int(g) if g is not None else None for g in m.groups())
    if days is not None:  # D-HH, D-HH:MM, D-HH:MM:SS
        seconds = days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    elif c is not None:   # HH:MM:SS
        seconds = a * 3600 + b * 60 + c
    elif b is not None:   # MM:SS
        seconds = a * 60 + b
    else:                 # minutes
        seconds = a * 60
    if seconds <= 0:
        raise UserError(f"slurm.time={value!r} must be longer than zero")
    return -(-seconds // 60)


def tasks_per_node(s) -> int:
    return int(s.tasks_per_node or max(1, s.gpus_per_node))


def executor_parameters(cfg) -> dict:
    """What the config asks of the job, as submitit AutoExecutor parameters."""
    s = cfg.slurm
    if s.cluster == "local" and s.nodes > 1:
        raise UserError("slurm.cluster=local runs the job on this machine: slurm.nodes must be 1")
    return {
        "name": f"resmlp_{cfg.command}", "nodes": int(s.nodes), "tasks_per_node": tasks_per_node(s),
        "gpus_per_node": int(s.gpus_per_node) if s.gpus_per_node else None,
        "cpus_per_task": int(s.cpus_per_task or cfg.num_workers + 1), "timeout_min": minutes(s.time),
        "mem_gb": s.mem_gb, "slurm_partition": s.partition, "slurm_account": s.account, "slurm_qos": s.qos,
        "slurm_constraint": s.constraint, "slurm_signal_delay_s": int(s.signal_delay_s),
        # the shell lines the job runs first: sbatch's script on SLURM, the shell that starts
        # the job on this machine under submitit's local executor
        "slurm_setup": list(s.setup) or None, "local_setup": list(s.setup) or None,
        # requeue-able whatever the cluster's default: a preempted job comes back
        "slurm_additional_parameters": {"requeue": True},
    }


def submit(cfg, argv: list[str], main):
    """Submit `argv` (a command line of resmlp.core.cli) as a job that runs `main(argv)`
    (the CLI's entry, passed in: the CLI is the layer above) in each of its processes;
    print its id and where its logs go; return the submitit job."""
    from resmlp.core.run_folder import run_dir
    from resmlp.core.lock import RunLock
    try:
        import submitit
    except ImportError:
        raise UserError("launcher=slurm needs submitit: pip install submitit (it is in requirements.txt)") from None
    directory = run_dir(cfg).resolve()  # the job may start in another working directory
    problem = RunLock(directory).problem()
    if problem:
        raise UserError(problem)
    folder = Path(cfg.slurm.folder).expanduser().resolve() if cfg.slurm.folder else directory / "slurm"
    timeouts = int(cfg.slurm.max_timeouts)
    # SLURM's files go in a folder per job id; the local executor would make a folder named
    # "%j" literally (it fills the id into file names only), so its files sit in `folder`.
    per_job = folder / "%j" if cfg.slurm.cluster == "slurm" else folder
    try:
        executor = submitit.AutoExecutor(folder=per_job, cluster=cfg.slurm.cluster,
                                         slurm_max_num_timeout=timeouts, local_max_num_timeout=timeouts)
        executor.update_parameters(**executor_parameters(cfg))
        # out_ok: the run dir passed its checks here; the job finds submitit's slurm/ folder in it
        job = executor.submit(Job([*job_argv(argv), "out_ok=true", "launcher=local", f"out={directory}"], main))
    except (RuntimeError, ValueError, OSError) as e:  # submitit's submission errors are RuntimeErrors
        raise UserError(f"could not submit the job: {str(e).strip().splitlines()[0]}") from None
    s = cfg.slurm
    print(f"submitted {cfg.command} as job {job.job_id} ({s.nodes} node(s) x {tasks_per_node(s)} process(es)); "
          f"run dir {directory}\nlogs: {job.paths.stdout} and {job.paths.stderr} (rank 0; the other ranks' "
          f"beside them)\na preempted or timed-out job is requeued and resumes from the run dir", flush=True)
    return job


def job_argv(argv: list[str]) -> list[str]:
    """The command line each process of the job runs: the submitted one without the keys
    that only the submission reads (launcher, slurm.*), which launcher=local refuses."""
    return [a for a in argv if "=" not in a or a.split("=", 1)[0].lstrip("+").split(".")[0] not in ("launcher", "slurm")]


class Job:
    """What a submitted job runs: the CLI's `main` with `argv`, in each of its processes.
    submitit calls `checkpoint` when the job is to be requeued, for the job to run next."""

    def __init__(self, argv: list[str], main):
        self.argv, self.main = list(argv), main

    def __call__(self) -> int:
        import submitit
        env = submitit.JobEnvironment()
        if env.num_tasks > 1:  # MASTER_ADDR (the first node), MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK
            submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        requeue_signal = getattr(signal, "SIG" + submitit.JobEnvironment.USR_SIG)
        trainer = bool(self.argv) and self.argv[0] in TRAINERS
        # A trainer stops on submitit's signal as on SIGTERM; other commands leave it to submitit
        # (they are requeued at once and start over).
        with preempt.watch(extra=(requeue_signal,)) if trainer else contextlib.nullcontext():
            code = self.main(self.argv)
        if code == PREEMPTED_EXIT:
            if env.global_rank == 0 and preempt.got(requeue_signal):
                # The time limit is near. submitit's handler is back in place: it calls
                # self.checkpoint() and requeues the job (and exits), or says why it will not.
                # (A SIGTERM is a preemption, which SLURM requeues itself, or a scancel.)
                signal.raise_signal(requeue_signal)
            sys.exit(code)
        if code:
            raise RuntimeError(f"`{' '.join(self.argv)}` ended with exit code {code}; its message is above")
        return code

    def checkpoint(self, *args, **kwargs):
        import submitit
        argv = self.argv if self.argv[-1:] == ["resume=auto"] else [*self.argv, "resume=auto"]
        return submitit.helpers.DelayedSubmission(Job(argv, self.main))
