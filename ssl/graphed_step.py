"""The whole DINO step as one CUDA graph: `dino.cuda_graphs=auto|true|false` (auto: on a CUDA
GPU wherever the step can be graphed), on one process or many.

Why: at DINO's batch on a GPU the host, not the GPU, sets the pace (README, Performance:
over 2000 kernel launches per compiled step). A CUDA graph replays every kernel of the step
(student forward and backward, teacher forward, loss and center, the gradients' all-reduce,
clipping, fused AdamW, EMA, the teacher's health statistics) with one launch.

What a replayable step needs, and how it is met here:
- Nothing that changes per iteration may be baked into the graph. The schedules live in
  0-dim device tensors (`TensorSchedule`), written by a few fill kernels queued before each
  replay (no host read, no copy from host memory): fused AdamW with capturable=True takes
  its lr as a tensor, one per learning-rate scale; AdamW's decoupled weight decay,
  p -= lr * wd * p, is applied just before the optimizer (whose own decay is then 0), the
  same arithmetic as the fused kernel's; the EMA is teacher += (1 - m) (student - teacher)
  (ema.update_teacher_by); the loss takes the temperature as a tensor (ssl/loss.py).
- What DinoStep freezes by dropping gradients (the head's last layer in the first
  epoch(s); with dino.init the whole backbone during the head warm-up, ssl/init.py) would
  change what the graph does. Instead each frozen part's gradients are multiplied by a
  `kept` tensor (0 while frozen, 1 after), its weight decay by the same, and its AdamW step
  count taken back by the `frozen` tensor: a zero gradient leaves AdamW's moments at zero
  and its update at exactly zero, so the part and its optimizer state stay bitwise as they
  were, as "no gradient" leaves them. That holds for a part that has not been stepped, and
  DINO's freezes come first in a run (a resumed run keeps dino.init's warm-up; only a
  dino.freeze_last_layer raised on resume past the epoch reached would not be exact: the
  layer's moments, no longer fed, would still move it). The backbone's learning-rate scale
  (dino.init_lr_scale) is its groups' own lr tensor; while it is frozen the teacher's
  backbone takes no EMA step (its weight tensor 0), as DinoStep moves the teacher's head
  alone. The backward still runs through the frozen backbone, which DinoStep skips: the
  price of one graph for the warm-up and the rest of the run.
- With a process group (torchrun, one process or many) the gradients are reduced here, not
  by DDP (`FlatGradients`): they are views into one flat buffer, zeroed and accumulated in
  place by the backward, and one all-reduce of the buffer (each rank's share divided by the
  world size first, as DDP does) gives every rank DDP's mean. Why not DDP inside the graph:
  its reducer keeps per-iteration host state (bucket readiness, the rebuild of its buckets
  after the first iteration, its unused-parameter and logging bookkeeping) that a replay
  does not run; PyTorch's CUDA semantics notes capture it only with DDP built on a side
  stream, its async error handling off and a run of eager iterations before the capture
  (Megatron-LM's full-iteration graph captures the reduction of its own DDP, whose gradients
  live in one contiguous buffer, and had to build it on the capture stream), and DinoStep
  rewraps DDP when dino.init's backbone joins, which a graph cannot follow. The flat buffer
  needs none of that, and the same code runs uncaptured on a CPU with gloo, where
  tests/test_ddp_graphs.py checks its gradients against DDP's. What it gives up is DDP's
  overlap of the all-reduce with the backward: one all-reduce of the gradients after it.
  The collective is captured in the graph like the forward's own (the center's mean,
  Sinkhorn-Knopp, the bottleneck norm), which NCCL allows since 2.9; every rank captures
  and replays at the same iterations.
  At build the ranks compare the buffer's layout (`check_layout`: one line where they built
  different networks, instead of an all-reduce that hangs) and take rank 0's student and
  teacher (`broadcast_weights`); at each log line the trainer checks that every `.grad`
  still views the buffer (`FlatGradients.check`).
  Under torchrun with one process the step takes this same path (an all-reduce over one
  rank), so that one-process torchrun measures its cost against a plain run, which has no
  process group and reduces nothing.
- Inputs are copied into buffers the graph reads; the outputs are buffers the next replay
  overwrites. Without a process group the gradients are allocated by the capture and
  written, not accumulated, by every replay. The center keeps one buffer, which lightly
  would replace at every update (ssl.loss.DinoLoss copies the new center into it).
The first `warmup` calls run the same code without capture, on a side stream (real
iterations: compilation, cuBLAS handles, NCCL's communicator, the optimizer's state); the
next call captures it and every later call only replays. A capture that fails, or whose
memory would not fit (`capture_room`), is the trainer's to handle (ssl/fallback.py: auto
falls back, dino.cuda_graphs=true stops in one line). The body runs uncaptured on a CPU
too (capture=False), which is how tests/test_graphs.py checks its arithmetic against
DinoStep's own and tests/test_ddp_graphs.py its reduction against DDP's.
"""
from __future__ import annotations

import hashlib
import warnings

import torch
import torch.distributed as tdist

from resmlp.core import dist
from resmlp.core.config import check_choice
from resmlp.core.errors import RunFailed, UserError
from resmlp.ssl.clip import clip_per_parameter
from resmlp.ssl.ema import update_teacher_by

WARMUP = 3   # uncaptured calls before the capture (torch's own examples use 3)
# The graph's pool is carved into segments as the capture allocates, and some of their room is
# lost between blocks: the capture is tried only where the device has this much more than the
# uncaptured steps' own need.
POOL_MARGIN = 1.25
GIB = 2 ** 30


def capturable(device) -> bool:
    """Whether a step on `device` can be captured: a CUDA GPU. The fallback tests make a CPU
    take the graphed path (with torch.cuda's graph and streams faked) by replacing this."""
    return torch.device(device).type == "cuda"


def use_cuda_graphs(value, device: torch.device, scaler_enabled: bool,
                    grad_checkpointing: bool = False) -> tuple[bool, str | None]:
    """dino.cuda_graphs (its words in configs/method/dino.yaml's limits) -> (graphed, None or
    the line that says why not). auto: on a CUDA GPU wherever the step can be graphed (any
    number of processes, dino.init too); not with fp16's GradScaler, and not with
    model.grad_checkpointing, which no GPU run has graphed. true where it cannot be is a
    UserError."""
    check_choice("dino.cuda_graphs", value)   # a value handed in by code, not only by load_config
    if value is False:
        return False, "graphs off: dino.cuda_graphs=false"
    need = why = None
    if not capturable(device):
        need, why = "a CUDA GPU", "graphs off: CUDA graphs need a CUDA GPU"
    elif scaler_enabled:
        need = "bf16 or fp32 (fp16's GradScaler reads its scale on the host)"
        why = ("graphs off: fp16 needs GradScaler, which reads its scale on the host (precision=bf16 is graphed, "
               "on a GPU that has bf16: sm 8.0 or later)")
    elif grad_checkpointing and value == "auto":
        why = ("graphs off: model.grad_checkpointing has not run in a CUDA graph on a GPU yet "
               "(dino.cuda_graphs=true tries it)")
    if need and value is True:
        raise UserError(f"dino.cuda_graphs=true needs {need}; set dino.cuda_graphs=false or auto")
    return why is None, why


class TensorSchedule:
    """The per-iteration values as 0-dim fp32 tensors on the device. `set` queues one fill
    kernel per value (numbers travel as kernel arguments: no copy, no sync). The backbone
    learns at `lr_scale` times the rate and is frozen in the first `warmup_epochs` epochs
    (dino.init); the head's last layer is frozen in the first `freeze_last_epochs`."""

    NAMES = ("lr", "backbone_lr", "lr_wd", "last_lr_wd", "backbone_lr_wd", "ema_weight", "backbone_ema_weight",
             "teacher_temp", "last_kept", "last_frozen", "backbone_kept", "backbone_frozen")

    def __init__(self, device: torch.device, lr_scale: float = 1.0, freeze_last_epochs: int = 0,
                 warmup_epochs: int = 0):
        self.lr_scale, self.freeze_last_epochs, self.warmup_epochs = lr_scale, freeze_last_epochs, warmup_epochs
        for name in self.NAMES:
            setattr(self, name, torch.zeros((), device=device))

    def set(self, values, epoch: int) -> None:
        """The schedules' `values` of an iteration (ssl.step.StepValues) at `epoch`."""
        last, backbone = epoch < self.freeze_last_epochs, epoch < self.warmup_epochs
        lr, weight_decay, momentum = values.lr, values.wd, values.momentum
        lr_b = lr * self.lr_scale
        # products and differences in float64 here: 1 - m in fp32 on the device would lose
        # five digits of the EMA's weight
        filled = {"lr": lr, "backbone_lr": lr_b, "lr_wd": lr * weight_decay,
                  "last_lr_wd": 0.0 if last else lr * weight_decay,
                  "backbone_lr_wd": 0.0 if backbone else lr_b * weight_decay,
                  "ema_weight": 1.0 - momentum, "backbone_ema_weight": 0.0 if backbone else 1.0 - momentum,
                  "teacher_temp": values.teacher_temp, "last_kept": float(not last), "last_frozen": float(last),
                  "backbone_kept": float(not backbone), "backbone_frozen": float(backbone)}
        for name in self.NAMES:
            getattr(self, name).fill_(filled[name])


class FlatGradients:
    """The gradients of `params` as views into one flat buffer, reduced in one all-reduce to
    their mean over the process group: what DDP's buckets give, without its hooks (module
    docstring). The views stay the parameters' `.grad` for good: the step zeroes the buffer
    (`zero`) instead of dropping them."""

    def __init__(self, params: list[torch.Tensor], names: list[str] | None = None):
        kept = [(n, p) for n, p in zip(names or [str(i) for i in range(len(params))], params) if p.requires_grad]
        self.names, self.params = [n for n, _ in kept], [p for _, p in kept]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise RuntimeError(f"FlatGradients holds one dtype; the parameters have {sorted(map(str, dtypes))}")
        self.flat = torch.zeros(sum(p.numel() for p in self.params), dtype=dtypes.pop(),
                                device=self.params[0].device)
        offset = 0
        for p in self.params:
            p.grad = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.pointers = [p.grad.data_ptr() for p in self.params]
        self.world_size = dist.world_size()

    def layout(self) -> tuple:
        """(tensors, values, dtype, a hash of every name, shape and dtype): what two ranks
        must share for one all-reduce of the buffer to add like to like."""
        text = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in zip(self.names, self.params))
        return len(self.params), self.flat.numel(), str(self.flat.dtype), hashlib.sha256(text.encode()).hexdigest()[:12]

    def check(self) -> None:
        """Every parameter's `.grad` still the view of the buffer it was given (a host-side
        look at pointers): a gradient replaced or dropped since would be left out of the
        all-reduce, and the ranks would drift apart."""
        for name, p, pointer in zip(self.names, self.params, self.pointers):
            if p.grad is None or p.grad.data_ptr() != pointer:
                raise RunFailed(f"the gradient of {name} no longer views the flat buffer the step all-reduces "
                                f"({'dropped' if p.grad is None else 'replaced'} since the step was built), so the "
                                "processes may have drifted apart; stopped before a checkpoint. Something outside "
                                "the step changed it (a hook, zero_grad(set_to_none=True)); dino.cuda_graphs=false "
                                "reduces with DDP instead")

    def zero(self) -> None:
        self.flat.zero_()

    def all_reduce(self) -> None:
        if self.world_size > 1:  # each rank's share first, as DDP divides before it sums
            self.flat.div_(self.world_size)
        tdist.all_reduce(self.flat)


def broadcast_weights(*nets: torch.nn.Module) -> None:
    """Rank 0's weights (parameters and buffers) on every rank, as DDP makes them when it
    wraps a network."""
    for net in nets:
        for t in net.state_dict().values():
            tdist.broadcast(t, src=0)


def check_layout(flat: FlatGradients) -> None:
    """The ranks compare their flat buffers' layouts (one small all-gather) before anything
    is broadcast or reduced: ranks that built different networks (another config, other
    code) would otherwise hang in the all-reduce, or add unlike gradients. One line on a
    mismatch."""
    layouts = [None] * dist.world_size()
    tdist.all_gather_object(layouts, flat.layout())
    if len(set(layouts)) == 1:
        return
    said = "; ".join(f"rank {r}: {n} tensors, {v} values, {d}, layout {h}" for r, (n, v, d, h) in enumerate(layouts))
    raise UserError(f"the {len(layouts)} processes built different networks to train ({said}): every process must "
                    "start with the same code and config (model.*, dino.*); their gradients cannot be all-reduced")


def capture_room(device: torch.device) -> str | None:
    """Whether the graph's memory pool would fit, from what the uncaptured steps used: None,
    or the reason it would not. The pool holds what one step allocates beyond what the run
    keeps between steps (the peak since the trainer reset it, less what is allocated now);
    the device has what is free, and the cache the capture empties first."""
    peak, held = torch.cuda.max_memory_allocated(device), torch.cuda.memory_allocated(device)
    free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - held
    need = peak - held
    if need * POOL_MARGIN <= free:
        return None
    return (f"the uncaptured steps peaked at {peak / GIB:.1f} GiB, {need / GIB:.1f} GiB above what the run holds "
            f"between steps, and the device has {free / GIB:.1f} GiB left for the graph's own pool")


class GraphedStep:
    """DinoStep's update with tensor schedules, captured once and replayed (module
    docstring). `captures` counts captures: 1 after the warm-up, forever. `reduce`: the
    gradients all-reduced over the process group (default: when there is one). The step's
    student runs as it is, never through DDP."""

    def __init__(self, step, capture: bool | None = None, warmup: int = WARMUP, reduce: bool | None = None):
        self.step = step
        opt = step.optimizer
        self.device = opt.param_groups[0]["params"][0].device
        self.capture = capturable(self.device) if capture is None else bool(capture)
        self.warmup = int(warmup)
        student = step.raw_student
        head, last = student.head, getattr(student.head, "last_layer", None)
        freeze_last = getattr(head, "freeze_last_layer", 0) if last is not None else 0
        scales = {g["lr_scale"] for g in opt.param_groups if "lr_scale" in g}   # dino.init's backbone groups
        self.sched = TensorSchedule(self.device, scales.pop() if scales else 1.0, freeze_last,
                                    int(step.head_warmup_epochs))
        # the parts that freeze (the trainable ones; the weight-normed layer's fixed norm is not)
        self.last = [p for p in last.parameters() if p.requires_grad] if freeze_last else []
        self.backbone = [p for p in student.backbone.parameters() if p.requires_grad] \
            if self.sched.warmup_epochs else []
        # weight decay by part: each its own lr * wd (the backbone's at its scale), 0 while frozen
        last_ids, rates = {id(p) for p in self.last}, {}
        for g in opt.param_groups:
            for p in g["params"] if g.get("name") == "decay" else ():
                rate = self.sched.backbone_lr_wd if "lr_scale" in g else \
                    self.sched.last_lr_wd if id(p) in last_ids else self.sched.lr_wd
                rates.setdefault(id(rate), (rate, []))[1].append(p)
        self.decay = list(rates.values())
        step.student, step.ddp = student, None   # never DDP in the graph: the reduction is ours
        self.reduce = dist.is_dist() if reduce is None else bool(reduce)
        self.flat = None
        if self.reduce:
            names, params = zip(*student.named_parameters())
            self.flat = FlatGradients(list(params), list(names))
            check_layout(self.flat)   # before the broadcast: unlike tensors would hang it
            # rank 0's student and teacher everywhere (DDP broadcasts the student alone)
            broadcast_weights(student, step.teacher)
        self.calls, self.captures = 0, 0
        self.graph, self.inputs, self.out = None, None, None

    @property
    def calls_to_steady_state(self) -> int:
        """Calls before the first that only replays (the warm-up and the capture)."""
        return self.warmup + 1 if self.capture else 0

    def _install(self) -> None:
        """The optimizer reads lr from the schedule and leaves the decay to `_update`. Done
        at the first call, after any checkpoint was loaded (which restores plain numbers)."""
        for g in self.step.optimizer.param_groups:
            g["lr"] = self.sched.backbone_lr if "lr_scale" in g else self.sched.lr
            g["capturable"] = self.device.type == "cuda"
            g["weight_decay"] = 0.0

    @property
    def capture_due(self) -> bool:
        """Whether the next call captures (the warm-up done, no graph yet)."""
        return self.capture and self.graph is None and self.calls >= self.warmup

    def check(self) -> None:
        """The gradients still view the flat buffer (FlatGradients.check), where there is one."""
        if self.flat is not None:
            self.flat.check()

    def __call__(self, crops, values, epoch: int):
        self.load(crops, values, epoch)
        if self.capture_due:
            self.capture_graph()
        return self.run()

    def load(self, crops, values, epoch: int) -> None:
        """This iteration's schedule values (ssl.step.StepValues) and crops into the tensors
        the step reads."""
        self.sched.set(values, epoch)
        if self.inputs is None:
            self._install()
            self.inputs = [c.detach().clone() for c in crops]
        else:
            shapes = [tuple(c.shape) for c in crops]
            if shapes != [tuple(c.shape) for c in self.inputs]:
                raise RuntimeError(f"dino.cuda_graphs: crops of shapes {shapes} after "
                                   f"{[tuple(c.shape) for c in self.inputs]}; a graph needs one batch shape")
            for buf, c in zip(self.inputs, crops):
                buf.copy_(c)

    def capture_graph(self) -> None:
        """Capture the step (nothing runs: the kernels are recorded). On failure the graph
        is dropped and the stream it captured on left, and the error raised."""
        if self.flat is None:
            self.step.optimizer.zero_grad(set_to_none=True)  # the capture allocates them
        stream = torch.cuda.current_stream(self.device)
        self.graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the loader's pin-memory thread allocates pinned host memory
            # while we capture (and NCCL's watchdog queries its events); in the default
            # global mode those calls would break the capture
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.out = self._update(zero_grad=False)
        except BaseException:
            self.graph = None   # its pool goes with it
            torch.cuda.set_stream(stream)   # a failed capture_end skips the graph's own return to it
            raise
        self.captures += 1

    def run(self):
        """The step: uncaptured (warm-up, or on a CPU) or the graph's replay; its outputs."""
        if not self.capture:
            self.out = self._update(zero_grad=True)
        elif self.graph is None:   # the warm-up
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self.out = self._update(zero_grad=True)
            torch.cuda.current_stream(self.device).wait_stream(side)
        else:
            self.graph.replay()
        self.calls += 1
        out = self.out
        self.step.tally.add(out["loss"], **out["stats"])
        return out["loss"], out["t_out"], out["center"]

    def _update(self, zero_grad: bool) -> dict:
        """DinoStep.__call__'s arithmetic with every per-iteration value read from the
        schedule's tensors: what the graph holds."""
        step, sched = self.step, self.sched
        with warnings.catch_warnings():
            # The warm-up runs on a side stream and the capture on the graph's own, as capture
            # requires, so the gradient accumulators meet a stream other than the one they were
            # made on; the graphed steps are tested equal to eager ones (tests/test_graphs.py)
            warnings.filterwarnings("ignore", message="The AccumulateGrad node's stream does not match")
            loss, t_out, center, stats = step.forward_loss(self.inputs, sched.teacher_temp)
            if self.flat is not None:
                self.flat.zero()   # in the graph too: the backward accumulates into the views
            elif zero_grad:
                step.optimizer.zero_grad(set_to_none=True)
            loss.backward()
        if self.flat is not None:
            self.flat.all_reduce()
        clip_per_parameter(step.raw_student.parameters(), step.clip_grad)
        with torch.no_grad():
            frozen = [(part, kept, flag) for part, kept, flag in ((self.last, sched.last_kept, sched.last_frozen),
                                                                  (self.backbone, sched.backbone_kept,
                                                                   sched.backbone_frozen)) if part]
            for part, kept, _ in frozen:
                torch._foreach_mul_([p.grad for p in part], kept)
            for rate, params in self.decay:
                torch._foreach_add_(params, torch._foreach_mul(params, -rate))
            step.optimizer.step()
            for part, _, flag in frozen:  # while frozen the count stays, as if never stepped
                torch._foreach_add_([step.optimizer.state[p]["step"] for p in part], flag, alpha=-1)
            student, teacher = step.raw_student, step.teacher
            if self.backbone:
                update_teacher_by(teacher.head, student.head, sched.ema_weight)
                update_teacher_by(teacher.backbone, student.backbone, sched.backbone_ema_weight)
            else:
                update_teacher_by(teacher, student, sched.ema_weight)
        t_out = t_out.detach()
        return {"loss": loss.detach(), "t_out": t_out, "center": center,
                "stats": {k: v.detach() for k, v in stats.items()}}
