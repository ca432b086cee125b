"""When a training loop logs, checkpoints, evaluates and stops, and the per-step values it
reads at those points: `DeviceTally` (sums kept on the device between reads), `Means` (the
host's means over reads), `Cadence` (the schedule, the run's clock, the stop on a signal,
and the resume tests' fault injection, KILL_AT_ENV).

Its own file because it is the part of every trainer's loop that is not the trainer's:
trainers make a Cadence over their `Run` (core/run.py), and the steps (ssl/step.py,
supervised/step.py) hold a DeviceTally without knowing of either.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import TYPE_CHECKING

import torch

from resmlp.core import dist, preempt
from resmlp.core.checkpoint import rng_state
from resmlp.core.errors import Preempted

if TYPE_CHECKING:  # the annotation alone: core/run.py imports nothing of this file, so no loop
    from resmlp.core.run import Run

# Fault injection for the resume tests: the process kills itself after this iteration.
KILL_AT_ENV = "RESMLP_KILL_AT_ITERATION"


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
    epoch and the last (a write costs seconds for a large head: tools/bench/checkpoint_cost.py); evaluations
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
        self.ckpt_epochs = int(plan.get("ckpt_epochs", cfg.ckpt_epochs))
        self.log_every_s = float(cfg.log_every_s)
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
