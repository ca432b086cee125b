"""What every training run shares: device and process group, run directory, precision,
logging (stdout, log.jsonl, TensorBoard), checkpoints and resume, and the loop's cadence.

DINO, supervised training, distillation and fine-tuning all open a `Run` and keep only
their own loop, which they write top to bottom with the shared pieces:

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
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from resmlp.core import dist, preempt
from resmlp.core.checkpoint import (CHECKPOINT_NAME, PREVIOUS_NAME, UnsafeFile, load_checkpoint, rng_state,
                                    save_checkpoint, set_rng_state)
from resmlp.core.config import save_config, to_dict
from resmlp.core.errors import Finished, Preempted, RunFailed, UserError
from resmlp.core.lock import RunLock, release_all
from resmlp.core.outdir import beside, input_key, input_name
from resmlp.core.report import write_json
from resmlp.core.weights import WeightsSpec

# Fault injection for the resume tests: the process kills itself after this iteration.
KILL_AT_ENV = "RESMLP_KILL_AT_ITERATION"

# Sections whose change makes a saved checkpoint unusable for this run, and the keys in
# them that may change on resume (memory settings: the weights do not depend on them).
RESUME_MUST_MATCH = ("command", "model", "data")
# data.decode: where JPEGs are decoded (the same pixels up to a rounding step); data.preview:
# only `run.sh data` reads it; model.fused, model.token_major, model.kernels: the same
# parameters and function (models/fused.py); model.residual_dtype: the same parameters, the
# function to bf16 rounding.
RESUME_MAY_CHANGE = ("model.grad_checkpointing", "model.fused", "model.token_major", "model.kernels",
                     "model.residual_dtype", "data.decode", "data.preview")
# What a command starts from: the key naming the weights it reads (run dir, checkpoint file
# or timm:<name>). Its default run dir names them, and a run dir holding a run that started
# from other weights is neither continued nor taken for this one. null (dino.init left out):
# the run's own start, whatever it was.
INPUT_KEYS = {"finetune": "checkpoint", "distill": "distill.teacher", "dino": "dino.init"}
# What a run dir keeps of the weights it started from: the identity of each input
# (core.weights: WeightsSpec.identity, the sha256 of a file), written when the run starts.
# The path alone would take a checkpoint retrained or replaced in place for the one the run
# read.
INPUTS_NAME = "inputs.json"
# Keys that do not change what a run computes: a finished run with other values of these is
# still the run asked for ("nothing to do"; compare reuses it). demo and recipe name where the
# values came from, not what they are; demo_overrides and demo_data_overrides are what run
# dirs saved before the demo became a recipe file hold in their place.
RUNTIME_KEYS = ("out", "name", "resume", "out_ok", "num_workers", "log_every", "log_every_s", "ckpt_every",
                "ckpt_epochs", "eval_every", "eval_batch_size", "device", "compile", "compile_cache_dir",
                "dino.cuda_graphs", "demo", "recipe", "demo_overrides", "demo_data_overrides", "launcher", "slurm",
                "save_rank_weights", "features.batch_size", "features.cache", "features.cache_dir", "data.download",
                "weights_trust", *RESUME_MAY_CHANGE)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def default_run_name(cfg: DictConfig, start=None) -> str:
    """<command>_<model>_<data>, and _from_<its weights' name> (core.outdir.input_name) for a
    command that starts from weights (`start`; default: its INPUT_KEYS entry): two runs of
    one command from two checkpoints never share a default folder."""
    if start is None and cfg.command in INPUT_KEYS:
        start = OmegaConf.select(cfg, INPUT_KEYS[cfg.command], default=None)
    name = f"{cfg.command}_{cfg.model.name}_{cfg.data.name}"
    return f"{name}_from_{input_name(start)}" if start else name


def run_dir(cfg: DictConfig) -> Path:
    if cfg.out:
        return Path(cfg.out).expanduser()
    return Path("runs") / (cfg.name or default_run_name(cfg))


def config_differences(saved: dict, current: dict, keys=RESUME_MUST_MATCH, skip=RESUME_MAY_CHANGE) -> list[str]:
    """Human-readable 'key: old -> new' lines for the sections that must not change (the
    dotted keys in `skip` aside)."""
    diffs = []

    def walk(a, b, prefix):
        if prefix in skip:
            return
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                walk(a.get(k, "<unset>"), b.get(k, "<unset>"), f"{prefix}.{k}" if prefix else k)
        elif a != b:
            diffs.append(f"{prefix}: {a} -> {b}")

    for k in keys:
        walk(saved.get(k, "<unset>"), current.get(k, "<unset>"), k)
    return diffs


def started_from(saved: dict, current: dict) -> tuple[str, str | None, str | None]:
    """(the command's input key, the weights the saved run started from, those asked for
    now), as input_key gives them; the key is "" for a command that reads none."""
    key = INPUT_KEYS.get(str(current.get("command")), "")
    if not key:
        return "", None, None
    pick = lambda c: OmegaConf.select(OmegaConf.create(c), key, default=None)  # noqa: E731
    return key, input_key(pick(saved)), input_key(pick(current))


def _named_input(cfg, key: str | None = None) -> tuple[str, str | None]:
    """(the input key: `key`, else the command's INPUT_KEYS entry; the weights it names now,
    or None). cfg: a config or its dict."""
    cfg = OmegaConf.create(cfg) if isinstance(cfg, dict) else cfg
    key = key or INPUT_KEYS.get(str(OmegaConf.select(cfg, "command", default="")), "")
    return key, (OmegaConf.select(cfg, key, default=None) if key else None)


def record_inputs(directory, cfg, key: str | None = None) -> None:
    """Write INPUTS_NAME into the run dir: the identity of the weights cfg starts from (its
    `key`, default the command's INPUT_KEYS entry; a stale record of an earlier start is
    removed when it names none)."""
    key, spec = _named_input(cfg, key)
    path = Path(directory) / INPUTS_NAME
    identity = WeightsSpec.parse(spec).identity() if spec is not None else None
    if identity is None:
        path.unlink(missing_ok=True)
        return
    write_json(path, {key: identity})


def input_changed(directory, cfg, key: str | None = None) -> tuple[str, str] | None:
    """(input key, why) when the run in `directory` started from a file that holds other
    weights now than then: the path is the same (started_from compares paths), the bytes
    are not. None when they are the same, when cfg names no input (the run's own start),
    or when either side is unknown: a run dir written before runs kept INPUTS_NAME is taken
    as started from the weights there now (refusing it would strand every older run, and
    nothing tells), and a file missing now is the loader's to name. `key`: as record_inputs."""
    key, spec = _named_input(cfg, key)
    if spec is None:
        return None
    try:
        was = json.loads((Path(directory) / INPUTS_NAME).read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(was, dict) or was.get("sha256") is None:   # nothing to compare: no file hashed
        return None
    now = WeightsSpec.parse(spec).identity()
    if now is None or was["sha256"] == now.get("sha256"):
        return None
    return key, (f"{now['file']} as it was then (its weights changed since: sha256 {str(was['sha256'])[:12]} "
                 f"then, {now['sha256'][:12]} now)")


def settings_of(config: dict) -> dict:
    """A copy of a resolved config without its RUNTIME_KEYS: what the results depend on."""
    out = OmegaConf.to_container(OmegaConf.create(config))
    for key in RUNTIME_KEYS:
        head, _, last = key.rpartition(".")
        section = out.get(head) if head else out
        if isinstance(section, dict):
            section.pop(last, None)
    return out


def settings_differences(saved: dict, current: dict) -> list[str]:
    """'key: old -> new' for every key that changes what a run computes: RUNTIME_KEYS aside,
    the input compared as the weights it names (a null one: the run's own start), and a
    key asked as `auto` taking whatever the run chose."""
    key, was, now = started_from(saved, current)
    saved, current = settings_of(saved), settings_of(current)
    if key:  # the input: compared as the weights it names
        head, _, last = key.rpartition(".")
        for c, v in ((saved, was), (current, now if now is not None else was)):
            (c.setdefault(head, {}) if head else c)[last] = v
    diffs = config_differences(saved, current, keys=sorted({*saved, *current}), skip=())
    return [d for d in diffs if not d.endswith("-> auto")]


def other_run(directory, what: str, fix: str = "") -> str:
    """The one line that refuses a run dir holding another run: `what` it holds, and where
    this one can go instead."""
    return f"{directory} holds {what}; {fix + ', or ' if fix else ''}pass out={beside(directory)} to start this one " \
           "beside it"


class JsonlLogger:
    """log.jsonl plus TensorBoard scalars, written by rank 0 only."""

    def __init__(self, directory: Path | None, fresh: bool = False):
        """fresh: a run that starts at iteration 0, whose directory may hold the logs of an
        earlier start stopped before its first checkpoint: log.jsonl starts empty, and
        TensorBoard hides their events (a purge from step 0)."""
        self.file = None
        self.tb = None
        self.directory = directory
        if directory is None:
            return
        self.file = open(directory / "log.jsonl", "w" if fresh else "a", buffering=1)
        self._open_tb(purge_step=0 if fresh and any((directory / "tb").glob("events.*")) else None)

    def _open_tb(self, purge_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(self.directory / "tb"), purge_step=purge_step)
        except ImportError:  # TensorBoard is optional at run time
            self.tb = None

    def size(self) -> int | None:
        """Bytes of log.jsonl written so far (a checkpoint keeps it: see rewind)."""
        if self.file is None:
            return None
        self.file.flush()
        return os.fstat(self.file.fileno()).st_size

    def rewind(self, size: int | None, step: int) -> None:
        """Back to the log as it was when a checkpoint was saved: log.jsonl cut to `size`
        bytes and TensorBoard's events after `step` hidden, since the resumed run logs the
        iterations after the checkpoint again (each is then in the log once)."""
        if self.file is None or size is None:
            return
        if self.size() > size:
            os.ftruncate(self.file.fileno(), size)  # append mode: the next line goes at the new end
        if self.tb is not None:
            self.tb.close()
            self._open_tb(purge_step=step + 1)

    def write(self, record: dict, step: int | None = None) -> None:
        if self.file is None:
            return
        record = {k: (float(v) if isinstance(v, (np.floating, torch.Tensor)) else v)
                  for k, v in record.items()}
        self.file.write(json.dumps(record) + "\n")
        if self.tb is not None and step is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("epoch", "iteration"):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


class Run:
    """One run's surroundings. Make it first thing in a trainer:

        run = Run(cfg)                       # process group, device, seed; checks the run dir
        start_it, results = run.restore(**state)  # opens the run dir; loads the checkpoint to continue from
        with run.autocast(): loss = ...
        run.save({...}); run.log({...}, step); run.finish(results)

    The run directory (its lock, config.yaml, logs) is created only by `open()`, which
    `restore` calls once the trainer has built its data and networks: a command that
    fails its checks leaves nothing behind.
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
        self.cadence: "Cadence | None" = None  # the loop's, once made (its timing goes into results.json)

    # ---- setup -------------------------------------------------------------------------
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
        saved = OmegaConf.to_container(OmegaConf.load(saved_cfg)) if saved_cfg.exists() else \
            self._latest_checkpoint(quiet=True)[0].get("config", {})
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
            done = json.loads((self.dir / "results.json").read_text())
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
        results = {"wall_time_s": round(time.time() - self.started, 1),
                   "device": device_name(self.device), "world_size": self.world_size, **results}
        if self.cadence is not None and "timing" not in results:
            results["timing"] = self.cadence.timing_report()
        self.open()
        if self.is_main:
            write_json(self.dir / "results.json", results)
        self.logger.close()
        self.lock.release()
        return results


class DeviceTally:
    """Per-step scalars summed on the device between reads, so that the loop never waits
    for the GPU: `add` queues a few tiny kernels, `read` is the one host sync."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.steps = 0
        self.last_loss: torch.Tensor | None = None

    @torch.no_grad()
    def add(self, loss: torch.Tensor, **stats: torch.Tensor) -> None:
        loss = loss.detach().float()
        values = {"loss": loss, "nonfinite": (~torch.isfinite(loss)).float(),
                  **{k: v.detach().float() for k, v in stats.items()}}
        for k, v in values.items():
            if k in self.sums:
                self.sums[k].add_(v)
            else:
                self.sums[k] = v.clone()
        self.steps += 1
        self.last_loss = loss

    def read(self) -> dict:
        """Means over every process of the steps since the last read, this process's
        `last_loss`, and `nonfinite`: how many of those steps, on all processes together,
        had a non-finite loss (every rank reads at the same iterations, so all agree to
        stop). Resets the sums."""
        if not self.steps:
            return {"steps": 0, "nonfinite": 0}
        names = list(self.sums)
        packed = dist.all_reduce_sum(torch.stack([self.sums[k].reshape(()) for k in names]))
        values = packed.tolist() + [self.last_loss.item()]  # <- the sync
        steps, self.sums, self.steps, self.last_loss = self.steps, {}, 0, None
        n = steps * dist.world_size()
        out = {k: v / n for k, v in zip(names, values) if k != "nonfinite"}
        return {**out, "last_loss": values[-1], "nonfinite": int(values[names.index("nonfinite")]), "steps": steps}


class Means:
    """Host-side means of what DeviceTally.read() returned, weighted by its steps."""

    def __init__(self):
        self.sums, self.steps = {}, 0

    def add(self, values: dict) -> None:
        n = values["steps"]
        for k, v in values.items():
            if k not in ("steps", "nonfinite", "last_loss"):
                self.sums[k] = self.sums.get(k, 0.0) + v * n
        self.steps += n

    def take(self) -> dict:
        """The means so far, and start again."""
        out = {k: v / self.steps for k, v in self.sums.items()} if self.steps else {}
        self.sums, self.steps = {}, 0
        return out


class Cadence:
    """When a training loop logs, checkpoints and evaluates, and the reads of its device
    tally in between: one schedule for every trainer.

    log lines after the run's first iteration (as DINO's and timm's loops log their first:
    the run shows it trains as soon as its step is compiled), every cfg.log_every
    iterations and at the last one, and after any iteration that ends cfg.log_every_s
    seconds or more after the last line (slow steps still show progress; the ranks agree in
    the iteration's host-side all-reduce, beside the stop signal: see agree); extra checkpoints every
    cfg.ckpt_every iterations inside an epoch, and at the end of every cfg.ckpt_epochs-th
    epoch and the last (a write costs seconds for a large head: bench/checkpoint_cost.py); evaluations
    every cfg.eval_every epochs except the last (the trainer's final report covers it).
    A read that finds a non-finite loss stops the run before anything is saved. A stop
    signal (core.preempt) ends the run after the current iteration with a checkpoint of
    it. `state` names what a checkpoint holds (objects with a state_dict, tensors, plain
    values) and `results` the trainer's running results; both are saved as they are then.

    It also keeps the run's clock in results["timing"], saved with every checkpoint, so a
    run stopped and resumed many times still tells what one uninterrupted run takes:
    training seconds and images summed over every start (each start's first iteration,
    where torch.compile compiles and the loader starts, left out; the checkpoint writes
    counted in, as a user waits for them, and also summed apart in checkpoint_s; the write
    a resumed run continues from is saved before it is summed), evaluation seconds
    (the trainer wraps them in `evaluating()`), and per start its start-up (from `Run()`
    to here) and its first iteration. Make it right before the loop.
    """

    def __init__(self, run: "Run", iterations_per_epoch: int, start_it: int, results: dict, state: dict,
                 tally: DeviceTally | None = None, plan: dict | None = None):
        cfg = run.cfg
        plan = plan or {}  # the trainer's epochs / eval_every / ckpt_epochs where its loop runs other than cfg's
        self.run, self.ipe = run, iterations_per_epoch
        self.total = int(plan.get("epochs", cfg.epochs)) * iterations_per_epoch
        self.results, self.state = results, state
        self.log_every, self.ckpt_every = int(cfg.log_every), int(cfg.ckpt_every)
        self.eval_every = int(plan.get("eval_every", cfg.eval_every))
        self.ckpt_epochs = int(plan.get("ckpt_epochs", cfg.get("ckpt_epochs", 1)))
        self.log_every_s = float(cfg.get("log_every_s", 0) or 0)
        self.clock = time.monotonic  # the log's clock (a test swaps in its own)
        self.logged_at = self.clock()
        self.tally = tally if tally is not None else DeviceTally()
        self.since_log, self.epoch = Means(), Means()
        self.last_read = start_it
        self.saved_at = start_it  # the iteration the checkpoint on disk holds
        self.agreed_at, self.stop_agreed = None, False  # the last agree(): its iteration, whether to stop
        self.kill_at = int(os.environ.get(KILL_AT_ENV, "0"))
        self.interval_started, self.images_since = time.time(), 0
        run.cadence = self  # Run.finish reports the timing
        self.timing = results.setdefault("timing", {"train_s": 0.0, "train_images": 0, "eval_s": 0.0, "starts": []})
        self.start = {"at_iteration": start_it, "startup_s": round(time.time() - run.started, 2),
                      "first_iteration_s": None}
        self.timing["starts"].append(self.start)
        # the loop's clock since it was last banked (checkpoints bank it), evaluations paused out
        self.clock_from, self.paused, self.images = time.time(), 0.0, 0

    def log_due(self, it: int) -> bool:
        if it % self.log_every == 0 or it == self.total or it == 1:
            return True
        if not self.log_every_s:
            return False
        return self.agree(it, late=self.clock() - self.logged_at >= self.log_every_s)  # every rank logs, or none

    def agree(self, it: int, late: bool = False) -> bool:
        """The iteration's one host-side all-reduce (a sync point across ranks; none in a
        single process): whether any rank received a stop signal, kept as iteration `it`'s
        answer for after_iteration, and whether any rank is `late` for a log line, returned.
        log_due asks it when its clock decides, else after_iteration does: one per iteration."""
        self.stop_agreed, late = dist.any_ranks(preempt.requested(), late)
        self.agreed_at = it
        return late

    def checkpoint_due(self, it: int) -> bool:
        """A mid-epoch checkpoint (epoch ends always save)."""
        return bool(self.ckpt_every) and it % self.ckpt_every == 0 and it % self.ipe != 0

    def eval_due(self, epoch: int) -> bool:
        """After `epoch` (1-based) is done."""
        return bool(self.eval_every) and epoch % self.eval_every == 0 and epoch != self.total // self.ipe

    def read(self, it: int) -> None:
        """Bring the device tally to the host (the sync point); stop on a non-finite loss."""
        values = self.tally.read()
        if values["nonfinite"]:
            self.run.stop_nonfinite(values["last_loss"], f"an iteration in {self.last_read + 1}..{it} "
                                                         f"(epoch {(it - 1) // self.ipe + 1})")
        self.last_read = it
        self.since_log.add(values)
        self.epoch.add(values)

    def log_record(self, it: int) -> dict:
        """read(), then the means since the last log line with the rate and memory; the
        caller adds its own fields and passes the record to run.log."""
        self.read(it)
        dt = time.time() - self.interval_started
        record = {"epoch": it / self.ipe, "iteration": it, **self.since_log.take(),
                  "images_per_s": self.images_since / max(dt, 1e-9),
                  "elapsed_s": round(time.time() - self.run.started, 1), **self.run.memory_mb()}
        self.interval_started, self.images_since = time.time(), 0
        self.logged_at = self.clock()
        return record

    def count(self, images: int) -> None:
        """After each iteration: `images` trained (the log's rate and the timing)."""
        self.images_since += images
        if self.start["first_iteration_s"] is None:
            now = time.time()
            self.start["first_iteration_s"] = round(now - self.clock_from - self.paused, 2)
            self.clock_from, self.paused = now, 0.0
        else:
            self.images += images

    @contextlib.contextmanager
    def evaluating(self, final: bool = False):
        """Time an evaluation apart from training (final=True: the end-of-run one). A stop
        signal that ends it early (preempt.stop_between_batches) stops the run here, with a
        checkpoint of the iterations trained since the last one."""
        t0 = time.time()
        try:
            with preempt.evaluation():
                yield
        except preempt.StopInEvaluation as e:
            it = self.last_read
            if it != self.saved_at:
                self._save(it)
            kept = (f"after iteration {it} of {self.total}, with a checkpoint of it in {self.run.dir}: run the same "
                    "command again (resume=auto) to continue" if it else
                    "before training began, nothing to keep: the same command starts the run again")
            raise Preempted(f"stopped by {e} during an evaluation {kept}") from None
        finally:
            dt = time.time() - t0
            self.paused += dt
            if final:
                self.timing["final_eval_s"] = round(dt, 2)
            else:
                self.timing["eval_s"] = round(self.timing["eval_s"] + dt, 2)

    def _bank_time(self) -> None:
        if self.start["first_iteration_s"] is None:
            return
        now = time.time()
        self.timing["train_s"] = round(self.timing["train_s"] + now - self.clock_from - self.paused, 3)
        self.timing["train_images"] += self.images
        self.clock_from, self.paused, self.images = now, 0.0, 0

    def timing_report(self) -> dict:
        """results["timing"] as of the last checkpoint, with the training rate and what one
        uninterrupted run would take (the first start's start-up and first iteration, the
        training, the evaluations)."""
        t = dict(self.timing)
        t["train_images_per_s"] = round(t["train_images"] / t["train_s"], 1) if t["train_s"] else None
        first = t["starts"][0]
        t["uninterrupted_s"] = round(first["startup_s"] + (first["first_iteration_s"] or 0.0) + t["train_s"]
                                     + t["eval_s"] + t.get("final_eval_s", 0.0), 1)
        return t

    def checkpoint(self, it: int) -> None:
        """Save (at an epoch's end only every ckpt_epochs epochs and at the last), then stop
        here if a stop signal came, with a checkpoint of `it` (see stop_if_signalled)."""
        if it % self.ipe or (it // self.ipe) % self.ckpt_epochs == 0 or it == self.total:
            self._save(it)
        self.stop_if_signalled(it)

    def _save(self, it: int) -> None:
        """read() (never save weights a non-finite loss may have reached), then save the
        state_dict of every object in `state` (tensors as they are), the position and the RNGs."""
        self.read(it)
        self._bank_time()  # the write's seconds fall into the next banked interval: training time
        t0 = time.time()
        self.run.save({**{k: _state_of(v) for k, v in self.state.items()}, "epoch": it // self.ipe,
                       "iteration": it, "rng": rng_state(), "results": self.results})
        self.timing["checkpoint_s"] = round(self.timing.get("checkpoint_s", 0.0) + time.time() - t0, 3)
        self.timing["checkpoints"] = self.timing.get("checkpoints", 0) + 1
        self.saved_at = it

    def after_iteration(self, it: int) -> None:
        if self.kill_at and it == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        # checkpoint(it) has just asked; at an epoch's end the trainer's epoch-end checkpoint
        # asks, after the epoch's evaluation, which a stop here would skip for good
        if self.saved_at != it and it % self.ipe:
            self.stop_if_signalled(it, fresh=False)

    def stop_if_signalled(self, it: int, fresh: bool = True) -> None:
        """If any rank received SIGTERM / SIGUSR1: every rank stops after iteration `it`
        with a checkpoint of it (every rank calls this at the same iterations). fresh=False
        takes this iteration's agree() if log_due asked it; a checkpoint asks anew, since a
        signal may have come during its write or the epoch's evaluation."""
        if fresh or self.agreed_at != it:
            self.agree(it)
        if not self.stop_agreed:
            return
        if self.saved_at != it:
            self._save(it)
        why = preempt.received() or "a stop signal to another process"
        raise Preempted(f"stopped by {why} after iteration {it} of {self.total}, with a checkpoint of it in "
                        f"{self.run.dir}: run the same command again (resume=auto) to continue"
                        if self.run.is_main else "")


def _state_of(obj):
    if obj is None or isinstance(obj, (int, float, str, dict, list)):
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    return obj.state_dict()


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
                except torch.OutOfMemoryError:  # read while the process group still says its size
                    raise UserError(out_of_memory_message(cfg)) from None
                except KeyboardInterrupt:  # a second Ctrl-C (core.preempt)
                    raise KeyboardInterrupt(f"stopped at once by a second Ctrl-C; the same command continues from "
                                            f"the last checkpoint in {run_dir(cfg)}, if there is one") from None
        finally:
            release_all()
        return 0
    return run


def out_of_memory_message(cfg) -> str:
    world = dist.world_size()
    per_gpu = cfg.batch_size // max(1, world)
    return (f"CUDA out of memory with {per_gpu} images per GPU (batch_size={cfg.batch_size} over {world} "
            f"process{'es' if world > 1 else ''}): lower batch_size, add GPUs (NPROC_PER_NODE / NNODES), or set "
            f"model.grad_checkpointing=true; {what_is_kept(run_dir(cfg) / CHECKPOINT_NAME)}")


def what_is_kept(checkpoint: Path) -> str:
    """The end of a failed run's message: the checkpoint it continues from, only if there is one."""
    if checkpoint.exists():
        return f"the last good checkpoint {checkpoint} is intact: the same command again resumes from it"
    return "no checkpoint was written before it stopped: the same command again starts over"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({dist.cpu_cores()} cores)"


def progress(iterable, total: int, desc: str, enabled: bool):
    """A tqdm bar with ETA on a terminal; the bare iterable otherwise (trainers print lines)."""
    if not enabled:
        return iterable
    from tqdm import tqdm
    return tqdm(iterable, total=total, desc=desc, dynamic_ncols=True, leave=False)
