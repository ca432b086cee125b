"""Preemption: a SIGTERM or SIGUSR1 (what a scheduler sends before it ends a job) stops a
training run at an iteration boundary with its state saved, instead of losing the work
since the last checkpoint.

The handler only sets a flag (`requested()`); the training loop's Cadence (core/cadence.py)
all-reduces it once per iteration, in the one host-side all-reduce that also carries its
log-by-time check (and again after each checkpoint), so that every rank stops at the same
iteration, even when the signal reached only some of them. Cadence then saves a
checkpoint at that iteration and raises `Preempted` (core/errors.py); the CLI
prints one line and exits with PREEMPTED_EXIT, and `resume=auto` continues from the saved
iteration.

Ctrl-C (SIGINT) in a trainer (`watch(ctrl_c=True)`) is the same request: the first one
stops the run at the iteration with a checkpoint, and exits CTRL_C_EXIT, as a shell
expects of an interrupted command; a second one raises KeyboardInterrupt at once (the
trainer still leaves its lock), or, during a checkpoint's write (`unbroken()`), once
the write is done. A SIGINT within CTRL_C_REPEAT_S of the first is the same Ctrl-C: under
torchrun each process gets it from the terminal and again from torchrun. Loader workers,
which a terminal's Ctrl-C reaches too, ignore it.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
CTRL_C_EXIT = 128 + signal.SIGINT  # what a shell reports for a command Ctrl-C ended
CTRL_C_REPEAT_S = 1.0
CTRL_C_NOTICE = (b"Ctrl-C: the run stops after this iteration (or the evaluation running now) with a checkpoint; "
                 b"Ctrl-C again stops it at once\n")

_received: list[int] = []
_depth = [0]  # nested watch() blocks: the outermost one starts with no signal noted
_first_ctrl_c = [0.0]  # time.monotonic() of the Ctrl-C noted
_unbroken = [0, False]  # nested unbroken() blocks, and whether a second Ctrl-C waits for their end


def _note(signum, _frame) -> None:
    _received.append(signum)


def _note_ctrl_c(signum, _frame) -> None:
    if signum in _received:
        if time.monotonic() - _first_ctrl_c[0] < CTRL_C_REPEAT_S:
            return
        if _unbroken[0]:
            _unbroken[1] = True
            return
        raise KeyboardInterrupt
    _received.append(signum)
    _first_ctrl_c[0] = time.monotonic()
    if os.environ.get("RANK", "0") == "0":
        os.write(2, CTRL_C_NOTICE)  # not print(): a handler may run inside another write to stderr


@contextlib.contextmanager
def watch(extra=(), ctrl_c: bool = False):
    """Within the block, SIGTERM, SIGUSR1 (and `extra` signals) only note a request to stop;
    with ctrl_c, so does a first SIGINT (a second raises KeyboardInterrupt). The previous
    handlers come back afterwards. Outside the main thread (where Python cannot install
    handlers) it does nothing."""
    handlers = {s: _note for s in (*SIGNALS, *extra)}
    if ctrl_c:
        handlers[signal.SIGINT] = _note_ctrl_c
    try:
        previous = {s: signal.signal(s, h) for s, h in handlers.items()}
    except ValueError:  # not the main thread
        yield
        return
    if not _depth[0]:
        _received.clear()
    _depth[0] += 1
    try:
        yield
    finally:
        _depth[0] -= 1
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def unbroken():
    """A block a second Ctrl-C does not cut (a checkpoint's write: torch.save stopped in the
    middle ends in a RuntimeError of its own); it stops the run when the block is done."""
    _unbroken[0] += 1
    try:
        yield
    finally:
        _unbroken[0] -= 1
    if not _unbroken[0] and _unbroken[1]:
        _unbroken[1] = False
        raise KeyboardInterrupt


def requested() -> bool:
    """Whether this process received a stop signal within the watch() block it is in (no
    communication). Outside one nothing is watched: a signal noted by an earlier block (its
    run has ended; received() still names it for the exit code) must not stop a later run."""
    return bool(_received) and _depth[0] > 0


def received() -> str | None:
    """The name of the first stop signal this process received, if any."""
    return signal.Signals(_received[0]).name if _received else None


def got(signum: int) -> bool:
    """Whether this process received `signum` (in the last watch() block)."""
    return signum in _received


class StopInEvaluation(Exception):
    """A stop signal that ended an evaluation between two of its batches (see
    stop_between_batches); the trainer's Cadence.evaluating saves what training there is."""


# How many of the signals received came before the trainer's evaluation now running began.
_evaluation_from = [0]


@contextlib.contextmanager
def evaluation():
    """A trainer's evaluation: a stop signal received before it began lets it finish (at an
    epoch's last iteration the trainer evaluates that epoch, then stops at its checkpoint);
    one received during it ends it between two batches (stop_between_batches)."""
    before = _evaluation_from[0]
    _evaluation_from[0] = len(_received)
    try:
        yield
    finally:
        _evaluation_from[0] = before


def stop_between_batches() -> None:
    """Between the batches of an evaluation (a feature extraction): raise StopInEvaluation
    when this process received a stop signal (within a trainer's evaluation: since it
    began), so that a long k-NN does not hold the stop back for minutes. One process only:
    several must agree where they stop, which they do at the trainer's iteration boundaries
    (Cadence)."""
    from resmlp.core import dist
    if requested() and len(_received) > _evaluation_from[0] and dist.world_size() == 1:
        raise StopInEvaluation(received())


def shield_worker(_worker_id: int = 0) -> None:
    """DataLoader worker_init_fn. A scheduler signals every process of a job, and a
    terminal's Ctrl-C every process of its foreground group, loader workers too; a worker
    that dies of it takes the training loop down mid-iteration.
    Here the stop signals are ignored, except a SIGTERM from the parent (how
    multiprocessing ends a worker), which still ends it at once."""
    for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
    if not hasattr(signal, "sigwaitinfo"):
        return
    # Blocked here, SIGTERM waits for the thread below (threads started later inherit the mask).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_end_on_parents_sigterm, args=(os.getppid(),), daemon=True,
                     name="resmlp-sigterm").start()


def _end_on_parents_sigterm(parent: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
            os._exit(0)
