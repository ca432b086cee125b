"""When the fast path fails: the DINO trainer's safety net under `compile=auto` and
`dino.cuda_graphs=auto`, and the one line that stops a run whose user asked for the path
(`compile=true`, regions or whole; `dino.cuda_graphs=true`). What a user sees:
docs/performance.md, "When the fast path fails".

The calls that can fail where eager would not are few and known before they run
(`PathGuard.due`): the first call on a compiled path (Dynamo traces, Inductor and Triton
compile, and their errors come out of that call), again where dino.init's backbone joins an
ungraphed compiled step (its graphs compile anew), and the call that captures the CUDA graph.
Around those calls, and only there:

- a snapshot first (`Snapshot`, on the host: the weights, the optimizer's state, the center,
  the tally, the random states). A failure inside the call may have moved any of them (the
  center moves in the forward, before a backward that compiles lazily; the tests' faked
  capture runs the whole update), and the same iteration runs again on the next path from
  that state: no update applied twice or lost, the schedules at their iteration;
- before a capture under auto, the memory check (ssl.graphed_step.capture_room): graphs off where
  the graph's pool would not fit, rather than a capture that runs out of memory;
- after the call, with more than one process, the ranks agree (`Agreement`: one all-gather on
  a gloo group of its own, which no collective of the step uses, so that it cannot be paired
  with one a rank is stuck in), and this before the graph's first replay, whose collectives
  would hang the ranks whose capture worked if another's failed.

A failure of such a call (`classify`: an error of the compilers; in the capture any error, an
out of memory apart) then:
- auto: every rank falls back together to the path the same config takes with the failing
  part off (`next_path`: graphs off -> the ungraphed compile form; compile off -> eager),
  says so in one `path:` line, and records it (`report`: results.json's path, log.jsonl);
- asked for: stops in one line naming the failure and the key that turns it off (exit 2; an
  out of memory: core/run.py's line), before the run writes anything: the checkpoint on
  disk stays the last good one;
- where the run cannot go on in this process: a capture that left the GPU unusable (a
  synchronize fails after it: not even the state can be saved) stops with the command that
  continues from the last checkpoint (docs/performance.md says why not a restart by itself);
  a first compiled call that failed on some ranks only (the others went on into the step's
  collectives, which the failed ones never join) stops every rank in one line.
"""
from __future__ import annotations

import dataclasses
import os
import shlex
import sys

import torch
import torch.distributed as tdist

from resmlp.core import dist
from resmlp.core.checkpoint import CHECKPOINT_NAME, rng_state, set_rng_state
from resmlp.core.compiling import StepPath, compile_form, compiler_error, first_line
from resmlp.core.errors import RunFailed, UserError, causes, out_of_memory, raised_in
from resmlp.core.run import what_is_kept
from resmlp.core.run_folder import run_dir
from resmlp.ssl.graphed_step import capture_room

# The agreement's gloo group: None takes gloo's default timeout, the process group's own
# (core/dist.py). The tests shorten it: a rank left alone there stops after it.
AGREE_TIMEOUT = None
# The keys that turn each part off, by what failed
KEYS = {"compile": "compile", "graph": "dino.cuda_graphs"}


@dataclasses.dataclass(frozen=True)
class Failure:
    """A failed call of the fast path: which part (`kind`: "compile" or "graph"), what
    failed in words, the error's first line; `oom`: an out of memory; `poisoned`: the GPU
    unusable after it."""
    kind: str
    what: str
    text: str
    oom: bool = False
    poisoned: bool = False


def classify(error: BaseException, capturing: bool) -> Failure | None:
    """The failure a fallback answers, or None for an error it leaves as it is (an out of
    memory outside the capture, a bug of the step, a user error)."""
    if any(isinstance(e, (UserError, RunFailed)) for e in causes(error)):
        return None
    oom = out_of_memory(error)
    if oom is not None:
        return Failure("graph", "the CUDA graph's capture ran out of memory", oom, oom=True) if capturing else None
    if compiler_error(error):
        return Failure("compile", "compiling the step failed", first_line(error))
    if capturing:
        return Failure("graph", "the CUDA graph's capture failed", first_line(error))
    return None


def collective_error(error: BaseException) -> bool:
    """Whether a collective failed under `error`: torch.distributed's own error types, or one
    raised inside its code (gloo's 'Connection closed by peer', a timeout)."""
    return any(isinstance(e, tdist.DistError) or {"torch", "distributed"} <= set(raised_in(e)) for e in causes(error))


def next_path(path: StepPath, failure: Failure, cfg, device: torch.device) -> StepPath:
    """The path after `failure`: compile off (eager, graphed as before), or graphs off and
    the networks in the form an ungraphed step takes (that of dino.cuda_graphs=false)."""
    if failure.kind == "compile":
        return dataclasses.replace(path, compile=None)
    form = None if path.compile is None else compile_form(cfg.compile, device, "dino", graphed=False)[0]
    return dataclasses.replace(path, compile=form, cuda_graphs=False)


def continuing_command(cfg, key: str) -> str:
    """The command line that continues this run with `key` (e.g. dino.cuda_graphs=false): the
    one it was started with, from run.sh's arguments, where they are this process's."""
    argv = sys.argv[1:]
    if argv[:1] != [str(cfg.command)]:
        return f"the same command with {key} added"
    name = key.split("=")[0] + "="
    env = [f"{k}={os.environ[k]}" for k in ("NPROC_PER_NODE", "NNODES") if k in os.environ]
    return f"`{' '.join([*env, 'bash run.sh', shlex.join(a for a in argv if not a.startswith(name)), key])}`"


class Snapshot:
    """What a step's call may change, copied to the host before a call that may fail, and
    put back (`restore`) before the same iteration runs on another path."""

    def __init__(self, step):
        self.state = _to_host({"student": step.raw_student.state_dict(), "teacher": step.teacher.state_dict(),
                               "loss": step.loss_fn.state_dict(), "optimizer": step.optimizer.state_dict(),
                               "scaler": step.scaler.state_dict()})
        tally = step.tally
        self.tally = ({k: v.clone() for k, v in tally.sums.items()}, tally.steps, tally.last_loss)
        self.rng = rng_state()

    def restore(self, step) -> None:
        s = self.state
        step.raw_student.load_state_dict(s["student"])
        step.teacher.load_state_dict(s["teacher"])
        step.loss_fn.load_state_dict(s["loss"])
        step.optimizer.load_state_dict(s["optimizer"])
        step.scaler.load_state_dict(s["scaler"])
        step.tally.sums, step.tally.steps, step.tally.last_loss = self.tally
        set_rng_state(self.rng)


def _to_host(value):
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(v) for v in value)
    return value


class Agreement:
    """Every rank's failure (or None) of a guarded call, on every rank: one all-gather over
    a gloo group made for it (module docstring). A rank that does not come within the
    group's timeout, or is gone, stops this one in one line."""

    def __init__(self):
        self.world = dist.world_size()
        self.group = tdist.new_group(backend="gloo", timeout=AGREE_TIMEOUT) if self.world > 1 else None

    def __call__(self, mine: Failure | None) -> list:
        if self.group is None:
            return [mine]
        out = [None] * self.world
        try:
            tdist.all_gather_object(out, mine, group=self.group)
        except Exception as error:  # noqa: BLE001 - a rank stuck in the step's collectives, or gone
            if mine is None:
                raise UserError(f"path: another process did not finish the step's first compiled or captured call "
                                f"with this one ({first_line(error)}): its own line says why; stopping") from None
            raise UserError(f"path: {mine.what}: {mine.text}; the other processes did not reach the same point "
                            f"(they went on into the step's collectives), so they cannot fall back together: "
                            f"stopping; {KEYS[mine.kind]}=false turns it off") from None
        return out


class PathGuard:
    """DinoStep's calls that compile or capture, run under the safety net (module docstring).
    `report(line, path)`: the trainer's, for each fallback (the line, and the path taken)."""

    def __init__(self, step, cfg, report):
        self.step, self.cfg, self.report = step, cfg, report
        self.asked = {"compile": cfg.compile != "auto", "graph": cfg.dino.cuda_graphs is True}
        self.seen: set = set()   # the compiled paths whose first call has run
        self.agree = Agreement()

    def due(self, epoch: int) -> bool:
        return self._risk(epoch) is not None

    def _risk(self, epoch: int) -> str | None:
        step = self.step
        if step.graphed is not None and step.graphed.capture_due:
            return "capture"
        if step.path.compile is not None and self._key(epoch) not in self.seen:
            return "compile"
        return None

    def _key(self, epoch: int) -> tuple:
        # ungraphed, the backbone's requires_grad follows dino.init's warm-up: its graphs compile anew
        step = self.step
        return step.path, step.graphed is None and epoch < step.head_warmup_epochs

    def __call__(self, crops, values, epoch: int):
        while (risk := self._risk(epoch)) is not None:
            snapshot = Snapshot(self.step)
            out, failure = self._try(risk, crops, values, epoch)
            failures = self.agree(failure)
            if not any(failures):
                if risk == "compile":
                    self.seen.add(self._key(epoch))
                    return out
                return self.step.graphed.run()   # the first replay, once every rank holds its graph
            self._fall_back(risk, failures, snapshot)
        return self.step.update(crops, values, epoch)

    def _try(self, risk: str, crops, values, epoch: int) -> tuple:
        """(the call's outputs, None) or (None, its failure); an error no fallback answers,
        or any where the user asked for the path, is raised."""
        step = self.step
        try:
            if risk == "compile":
                return step.update(crops, values, epoch), None
            step.graphed.load(crops, values, epoch)
            room = None if self.asked["graph"] else capture_room(step.graphed.device)
            if room is not None:
                return None, Failure("graph", "the CUDA graph would not fit in memory", room)
            step.graphed.capture_graph()
            return None, None
        except Exception as error:  # noqa: BLE001 - classify picks what a fallback answers
            if self.agree.world > 1 and collective_error(error):   # a peer that stopped, or never came
                raise UserError("path: another process stopped in the step's first compiled or captured call "
                                f"({first_line(error)}): its own line says why; stopping") from None
            failure = classify(error, capturing=risk == "capture")
            if failure is None:
                raise
            if self.asked[failure.kind]:
                if failure.oom:
                    raise   # core/run.py's line: batch_size, dino.cuda_graphs=false, grad checkpointing
                raise UserError(asked_line(self.cfg, failure)) from None
            if risk == "capture":
                failure = dataclasses.replace(failure, poisoned=not usable(step.graphed.device))
            return None, failure

    def _fall_back(self, risk: str, failures: list, snapshot: Snapshot) -> None:
        failed = [(r, f) for r, f in enumerate(failures) if f is not None]
        rank, failure = failed[0]
        where = f" on rank {rank}" if len(failed) < len(failures) else ""
        if any(f.poisoned for _, f in failed):   # under auto: the one way on is a new process, without it
            raise UserError(f"path: {failure.what}{where}: {failure.text}; it left the GPU unusable to the process, "
                            "so the run cannot go on or save its state: "
                            f"{continuing_command(self.cfg, KEYS[failure.kind] + '=false')} continues it "
                            f"({what_is_kept(run_dir(self.cfg) / CHECKPOINT_NAME)})")
        if risk == "compile" and len(failed) < len(failures):
            raise UserError(f"path: {failure.what}{where}: {failure.text}, and not on the other processes, which "
                            "went on into the step's collectives: they cannot fall back together, so all stop; "
                            "compile=false trains eager")
        snapshot.restore(self.step)
        path = next_path(self.step.path, failure, self.cfg, next(self.step.raw_student.parameters()).device)
        line = f"path: {failure.what}{where}: {failure.text}; continuing {path.describe()}"
        path = dataclasses.replace(path, fell_back=(*path.fell_back, line))
        self.step.take_path(path)
        self.report(line, path)


def usable(device: torch.device) -> bool:
    """Whether the GPU still works for this process after a failed capture: a synchronize
    raises the error a poisoned context keeps."""
    try:
        torch.cuda.synchronize(device)
    except Exception:  # noqa: BLE001 - any error here means it does not
        return False
    return True


def asked_line(cfg, failure: Failure) -> str:
    """The line that stops a run whose user asked for the part that failed."""
    key = KEYS[failure.kind]
    value = cfg.compile if failure.kind == "compile" else True
    asked = f"{key}={str(value).lower() if isinstance(value, bool) else value}"
    instead = "trains eager" if failure.kind == "compile" else "trains without the graph"
    return (f"{failure.what}: {failure.text} ({asked} asks for it); {key}=false {instead}, {key}=auto falls back by "
            f"itself; {what_is_kept(run_dir(cfg) / CHECKPOINT_NAME)}")


def augmentation_fallback(cfg, say):
    """The device augmentation's `on_compile_error` (data/gpu_augment.py): its compilation is
    the first in a run (the first batch, before the step), and it holds no state, so under
    compile=auto it runs eager from then on after one line; asked for, the run stops in one
    line, before it writes anything."""
    def fall_back(error: BaseException) -> None:
        failure = Failure("compile", "compiling the device augmentation failed", first_line(error))
        if cfg.compile != "auto":
            raise UserError(asked_line(cfg, failure)) from None
        say(f"path: {failure.what}: {failure.text}; continuing with it eager")
    return fall_back
