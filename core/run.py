"""What every training run shares: device and process group, run directory, precision,
logging (stdout, log.jsonl, TensorBoard), checkpoints and resume (the `Run`), and the
trainers' command-line entry (`command`: stop signals, the run dir's lock, out of memory).

DINO, supervised training, distillation and fine-tuning all open a `Run` and keep only
their own loop, which they write top to bottom with the shared pieces (the loop's
schedule, `Cadence`, is core/cadence.py's; the rules for which run a folder holds,
core/run_folder.py's):

    run = Run(cfg)                       # checks the run dir; creates nothing yet
    state = {"model": model, "optimizer": optimizer, ...}
    start_it, results = run.restore(**state)    # opens the run dir (inputs are checked by now)
    cadence = Cadence(run, iterations_per_epoch, start_it, results, state)
    for each batch:  ...step...; cadence.tally.add(loss, **stats)
        if cadence.log_due(it): values = cadence.read(it)        # the sync point
        if cadence.checkpoint_due(it): cadence.checkpoint(it)
        cadence.after_iteration(it)       # a SIGTERM / SIGUSR1 stops the run here, saved
    (the ranks agree on a stop and on a log line due by time in one host-side all-reduce
    per iteration, asked by log_due or after_iteration, whichever needs it first)
    at each epoch end: cadence.checkpoint(it)
"""
from __future__ import annotations

import contextlib
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from resmlp.core import dist, preempt
from resmlp.core import device as gpu
from resmlp.core.checkpoint import (CHECKPOINT_NAME, PREVIOUS_NAME, UnsafeFile, load_checkpoint, run_config,
                                    save_checkpoint, set_rng_state)
from resmlp.core.config import save_config, to_dict
from resmlp.core.errors import Finished, RunFailed, UserError, causes
from resmlp.core.files import read_regular, refuse_links_in
from resmlp.core.lock import RunLock, release_all
from resmlp.core.log import JsonlLogger
from resmlp.core.plain_config import read_config_yaml
from resmlp.core.report import write_json
from resmlp.core.run_folder import (INPUTS_NAME, config_differences, input_changed, other_run, record_inputs,
                                    run_dir, settings_differences, started_from)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Run:
    """One run's surroundings. Make it first thing in a trainer:

        run = Run(cfg)                       # process group, device, seed; checks the run dir
        start_it, results = run.restore(**state)  # opens the run dir; loads the checkpoint to continue from
        with run.autocast(): loss = ...
        run.save({...}); run.log({...}, step); run.finish(results)

    The run directory (its lock, config.yaml, logs) is created only by `open()`, which
    `restore` calls once the trainer has built its data and networks: a command that
    fails its checks leaves nothing behind. An existing one may be someone else's: a
    symbolic link among its entries is refused before anything in it is read or written
    (core/files.py), and its config.yaml is read as plain data (core/plain_config.py).
    """

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.device = dist.setup(cfg.device)
        self.rank, self.world_size = dist.rank(), dist.world_size()
        self.is_main = self.rank == 0
        # The same seed on every rank (as DINO does): models built on each rank start equal,
        # also those DDP does not broadcast (the teacher). Data randomness is keyed per image.
        seed_everything(int(cfg.seed))
        if self.device.type == "cuda":
            # Training shapes are fixed: let cuDNN time its algorithms once (as DINO does);
            # the default heuristic picks a slow kernel for the stride-16 patch embedding.
            torch.backends.cudnn.benchmark = True
        if self.device.type == "cpu":
            # OpenMP threads that share cores with loader workers spin against them: on a
            # busy 2-core machine a DINO step ran 5x slower with 2 threads than with 1.
            torch.set_num_threads(max(1, dist.cpu_cores() // self.world_size - int(cfg.num_workers)))
        if cfg.batch_size % self.world_size:
            raise UserError(f"batch_size={cfg.batch_size} is not divisible by the {self.world_size} processes")
        self.batch_per_rank = cfg.batch_size // self.world_size
        self.amp_dtype, self.use_scaler = self._precision(cfg.precision)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.use_scaler)
        self.dir = run_dir(cfg)
        self.ckpt_path, self.prev_path = self.dir / CHECKPOINT_NAME, self.dir / PREVIOUS_NAME
        self.lock = RunLock(self.dir)
        refuse_links_in(self.dir)  # a folder from elsewhere: nothing is written through a link in it
        self._checked_resume = self._check_run_dir()
        self._agree(self.lock.problem)  # a live run holds the directory: stop before any work
        if self._checked_resume:
            self._agree(self._input_problem)  # rank 0 hashes the input file
            self._stop_if_finished()
        # read before any work: a refused checkpoint (core.checkpoint: not weights only) leaves the dir as it was
        self._resume = self._latest_checkpoint() if self._checked_resume else None
        self.logger: JsonlLogger | None = None
        self.started = time.time()
        self.interactive = sys.stderr.isatty() and self.is_main
        self.cadence = None  # the loop's Cadence (core/cadence.py), once made (its timing goes into results.json)

    # ---- setup -------------------------------------------------------------------------
    def start_lines(self, path) -> list[str]:
        """The run's first lines: its device, the device's memory and the precision, then
        how its step runs (`path`, a core.compiling.StepPath)."""
        return [*device_lines(self.device, self.world_size, str(self.cfg.precision), self.amp_dtype), *path.lines()]

    def _precision(self, precision: str):
        dtype = dist.amp_dtype(precision, self.device)
        if dtype == torch.float16 and self.device.type != "cuda":
            raise UserError("precision=fp16 needs a GPU; use precision=fp32 or bf16 on the CPU")
        # fp32 runs without autocast; fp16 needs the GradScaler (its gradients underflow)
        return (None if dtype == torch.float32 else dtype), dtype == torch.float16

    def _agree(self, check) -> None:
        """Rank 0 runs `check` (None, or what is wrong); every rank raises its UserError."""
        problem = check() if self.is_main else None
        problem = dist.broadcast_object(problem)
        if problem:
            raise UserError(problem)

    def open(self) -> None:
        """Create the run directory, take its lock and write config.yaml (rank 0), and open
        the logs. Called by `restore`, after the trainer's inputs have passed their checks."""
        if self.logger is not None:
            return

        def take() -> str | None:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                warning = self.lock.acquire()
            except UserError as e:
                return str(e)
            except OSError as e:
                return f"cannot create the run directory {self.dir} ({e.strerror}); choose another out="
            if warning:
                self.print(warning)
            save_config(self.cfg, self.dir / "config.yaml")
            if not (self._checked_resume and (self.dir / INPUTS_NAME).exists()):  # a resumed run keeps its start's
                record_inputs(self.dir, self.cfg)
            return None

        self._agree(take)
        self.logger = JsonlLogger(self.dir if self.is_main else None, fresh=not self._checked_resume)

    def _check_run_dir(self):
        """Refuse to resume (or overwrite) a run dir that holds another model or data, or a
        run started from other weights (INPUT_KEYS)."""
        saved_cfg = self.dir / "config.yaml"
        if not (self.ckpt_path.exists() or self.prev_path.exists()):
            return None
        if self.cfg.resume == "never":
            raise UserError(f"{self.dir} already holds a checkpoint; pass resume=auto to continue it, "
                            "or out=<another dir>")
        saved = read_config_yaml(saved_cfg) if saved_cfg.exists() else \
            run_config(self._latest_checkpoint(quiet=True)[0]) or {}
        current = to_dict(self.cfg)
        diffs = config_differences(saved, current)
        if diffs:
            raise UserError(f"{self.dir} holds a run with another config ({'; '.join(diffs[:4])}); "
                            "use out=<new dir>, or the old values to resume")
        key, was, now = started_from(saved, current)
        if now is not None and now != was:
            started = f"started from {was}" if was else f"started without {key}"
            asked = f"{key}={OmegaConf.select(self.cfg, key)}"
            raise UserError(other_run(self.dir, f"a run of its own ({started}) and {asked} asks for another start",
                                      f"drop {key} to continue that run" if key == "dino.init" else ""))
        self._saved = saved
        return True

    def _input_problem(self) -> str | None:
        """The line that refuses a run dir whose run started from the file named now when it
        held other weights (input_changed): resuming would mix the two, and its results are
        not those of the weights there now."""
        changed = input_changed(self.dir, self.cfg)
        if changed is None:
            return None
        key, why = changed
        if (self.dir / "results.json").exists():
            return other_run(self.dir, f"a finished run from {why}")
        return other_run(self.dir, f"an unfinished run from {why}",
                         f"drop {key} to continue that run" if key == "dino.init" else "")

    def _stop_if_finished(self) -> None:
        """Resuming a run that has ended (its results.json is there, for at least these
        epochs) would only evaluate it again and write over its figures: raise Finished, when
        it is the run asked for (settings_differences). A finished run with other settings
        is refused, naming the first difference and a folder beside it. More epochs than it
        ran continue its training."""
        try:
            done = json.loads(read_regular(self.dir / "results.json"))
        except (OSError, ValueError):
            return  # no results yet: the run (or its final evaluation) goes on
        if not isinstance(done, dict) or int(done.get("epochs") or 0) < int(self.cfg.epochs):
            return
        diffs = settings_differences(self._saved, to_dict(self.cfg))
        if diffs:
            more = f" and {len(diffs) - 1} more" if len(diffs) > 1 else ""
            raise UserError(other_run(self.dir, f"a finished run with other settings ({diffs[0]}{more})"))
        raise Finished(f"{self.dir} holds a finished run ({done.get('epochs')} epochs, results.json): nothing to "
                       f"do, its results stay as they are; evaluate it with `bash run.sh knn {self.dir}` "
                       "(or linear, viz), or train another with out=<another dir>")

    def _latest_checkpoint(self, quiet: bool = False) -> tuple[dict, Path]:
        """The newest readable of checkpoint.pth and checkpoint_prev.pth, and its path. A
        latest one that is missing (a kill between a save's two renames) or cannot be read
        (cut short by a full disk, damaged) falls back to the previous with a warning."""
        problems = [] if self.ckpt_path.exists() else [f"{self.ckpt_path} is missing"]
        for path in (p for p in (self.ckpt_path, self.prev_path) if p.exists()):
            try:
                state = load_checkpoint(path, map_location="cpu")
                if "iteration" not in state or "rng" not in state:
                    raise UserError(f"{path} is not a run checkpoint (no iteration or RNG state)")
            except UnsafeFile:
                raise  # refused, not damaged: the previous one is no more to be trusted
            except UserError as e:
                problems.append(str(e))
                continue
            if problems and not quiet:
                self.print(f"warning: {problems[0]}; resuming from the previous checkpoint {path} instead")
            return state, path
        raise UserError(f"no readable checkpoint in {self.dir} ({'; '.join(problems)}); move the "
                        "checkpoint files away to start again, or use out=<another dir>")

    def resume_state(self) -> dict | None:
        """The checkpoint to continue from (resume=auto and one exists), else None."""
        if not self._checked_resume:
            return None
        state, path = self._resume or self._latest_checkpoint()
        self._resume = None   # the run holds it from here
        self.print(f"resuming from {path} (epoch {state.get('epoch')}, iteration {state.get('iteration')})")
        return state

    def restore(self, **state) -> tuple[int, dict]:
        """Open the run dir; on resume, load the checkpoint's entry of each name into the
        object given for it (anything with load_state_dict; a tensor is copied into), and
        the RNG states. Returns (iteration to start at, the saved results); (0, {}) for a
        fresh run."""
        self.open()
        saved = self.resume_state()
        if saved is None:
            return 0, {}
        self.logger.rewind(saved.get("log_bytes"), int(saved["iteration"]))
        for name, obj in state.items():
            if obj is None or saved.get(name) is None:
                continue
            if isinstance(obj, torch.Tensor):
                obj.copy_(saved[name].to(obj.device))
            else:
                obj.load_state_dict(saved[name])
        set_rng_state(saved["rng"])
        return int(saved["iteration"]), saved.get("results", {})

    # ---- during training ---------------------------------------------------------------
    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def print(self, *args) -> None:
        if self.is_main:
            print(*args, flush=True)

    def log(self, record: dict, step: int | None = None) -> None:
        self.open()
        self.logger.write(record, step)

    def log_image(self, tag: str, image, step: int) -> None:
        """An (H, W, 3) uint8 picture into TensorBoard (rank 0; nothing without TensorBoard)."""
        self.open()
        if self.logger.tb is not None:
            self.logger.tb.add_image(tag, image, step, dataformats="HWC")

    def stop_nonfinite(self, value: float, where: str) -> None:
        raise RunFailed(f"loss is {value} at {where}; stopped. Lower the learning rate or (DINO) the teacher "
                        f"temperature, or use precision=fp32; {what_is_kept(self.ckpt_path)}")

    def save(self, state: dict, name: str = CHECKPOINT_NAME) -> None:
        """Write a checkpoint atomically (rank 0); the latest one's predecessor is kept as
        checkpoint_prev.pth."""
        self.open()
        if self.is_main:
            with preempt.unbroken():
                save_checkpoint(self.dir / name, {"command": self.cfg.command, "config": to_dict(self.cfg),
                                                  "log_bytes": self.logger.size(), **state},
                                previous=self.prev_path if name == CHECKPOINT_NAME else None)
        dist.barrier()

    def memory_mb(self) -> dict:
        """Peak GPU memory since the last reset: allocated by tensors, and reserved by the
        caching allocator (what the GPU really lost to this process)."""
        if self.device.type != "cuda":
            return {"peak_mem_mb": 0.0, "peak_reserved_mb": 0.0}
        return {"peak_mem_mb": round(torch.cuda.max_memory_allocated(self.device) / 2**20, 1),
                "peak_reserved_mb": round(torch.cuda.max_memory_reserved(self.device) / 2**20, 1)}

    def reset_peak_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def finish(self, results: dict) -> dict:
        results = {"wall_time_s": round(time.time() - self.started, 1), "device": device_name(self.device),
                   "precision": dist.PRECISIONS[self.amp_dtype or torch.float32], "world_size": self.world_size,
                   **results}
        if self.cadence is not None and "timing" not in results:
            results["timing"] = self.cadence.timing_report()
        self.open()
        if self.is_main:
            write_json(self.dir / "results.json", results)
        self.logger.close()
        self.lock.release()
        return results


def command(train):
    """The CLI entry `run(cfg)` of a trainer `train(cfg)`: a stop signal or a first Ctrl-C
    ends it at an iteration boundary with its state saved (core.preempt); it leaves the process group
    and the run directory's lock on any exit, and turns running out of GPU memory into one
    line that says what to change."""
    def run(cfg) -> int:
        try:
            with dist.leaving():
                try:
                    with preempt.watch(ctrl_c=True):
                        train(cfg)
                except Exception as e:  # noqa: BLE001 - the GPU's out of memory (also under a failed capture's error)
                    if not any(isinstance(c, torch.OutOfMemoryError) for c in causes(e)):
                        raise
                    raise UserError(out_of_memory_message(cfg)) from None  # read while the group still says its size
                except KeyboardInterrupt:  # a second Ctrl-C (core.preempt)
                    raise KeyboardInterrupt(f"stopped at once by a second Ctrl-C; the same command continues from "
                                            f"the last checkpoint in {run_dir(cfg)}, if there is one") from None
        finally:
            release_all()
        return 0
    return run


def out_of_memory_message(cfg) -> str:
    """What to change when a trainer ran out of GPU memory, in any phase (the capture of a
    CUDA graph too), with the peak it reached."""
    world = dist.world_size()
    per_gpu = cfg.batch_size // max(1, world)
    graphs = OmegaConf.select(cfg, "dino.cuda_graphs", default=None) not in (None, False)
    return (f"CUDA out of memory with {per_gpu} images per GPU (batch_size={cfg.batch_size} over {world} "
            f"process{'es' if world > 1 else ''}{peak_memory()}): lower batch_size, "
            + ("set dino.cuda_graphs=false (the graph keeps a memory pool of its own), " if graphs else "")
            + f"set model.grad_checkpointing=true, or add GPUs (NPROC_PER_NODE / NNODES); "
            f"{what_is_kept(run_dir(cfg) / CHECKPOINT_NAME)}")


def peak_memory() -> str:
    """'; peak 71.2 GiB allocated of the GPU's 79.1 GiB': this process's peak since the last
    reset (core.run.Run.reset_peak_memory: the training's, after the k-NN at init), or
    nothing where CUDA never started."""
    if not torch.cuda.is_initialized():
        return ""
    gib = 2 ** 30
    return (f"; peak {torch.cuda.max_memory_allocated() / gib:.1f} GiB allocated of the GPU's "
            f"{torch.cuda.mem_get_info()[1] / gib:.1f} GiB")


def what_is_kept(checkpoint: Path) -> str:
    """The end of a failed run's message: the checkpoint it continues from, only if there is one."""
    if checkpoint.exists():
        return f"the last good checkpoint {checkpoint} is intact: the same command again resumes from it"
    return "no checkpoint was written before it stopped: the same command again starts over"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({dist.cpu_cores()} cores)"


def device_lines(device: torch.device, world_size: int, asked: str, amp: torch.dtype | None) -> list[str]:
    """'device: <the device, its memory>; precision <what autocast runs in>' and, where
    bf16 was asked of a GPU without it, a warning (core.device.has_bf16)."""
    dtype = amp or torch.float32
    cuda = device.type == "cuda"
    where = gpu.describe_gpu(device) if cuda else device_name(device)
    where += f", {world_size} processes" if world_size > 1 else ""
    how = dist.PRECISIONS[dtype] + (" with GradScaler" if dtype == torch.float16 else "")
    first = "{}.{}".format(*gpu.BF16_FROM)
    if asked == "auto":
        how += (" (auto: this GPU has bf16)" if dtype == torch.bfloat16 else
                f" (auto: bf16 needs sm {first} or later)" if cuda else " (auto: no autocast on the CPU)")
    lines = [f"device: {where}; precision {how}"]
    if cuda and dtype == torch.bfloat16 and not gpu.has_bf16(device):
        lines.append(f"warning: precision=bf16 on a GPU before sm {first} runs emulated, slowly; precision=auto "
                     "takes fp16 with GradScaler there")
    return lines


def progress(iterable, total: int, desc: str, enabled: bool):
    """A tqdm bar with ETA on a terminal; the bare iterable otherwise (trainers print lines)."""
    if not enabled:
        return iterable
    from tqdm import tqdm
    return tqdm(iterable, total=total, desc=desc, dynamic_ncols=True, leave=False)
