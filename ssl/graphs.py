"""The whole DINO step as one CUDA graph: `dino.cuda_graphs=true` (default false).

Why: at DINO's batch on an H100 the host, not the GPU, sets the pace (README, Performance:
over 2000 kernel launches per compiled step). A CUDA graph replays every kernel of the step
(student forward and backward, teacher forward, loss and center, clipping, fused AdamW, EMA,
the teacher's health statistics) with one launch.

What a replayable step needs, and how it is met here:
- Nothing that changes per iteration may be baked into the graph. The schedules live in
  0-dim device tensors (`TensorSchedule`), written by a few fill kernels queued before each
  replay (no host read, no copy from host memory): fused AdamW with capturable=True takes
  its lr as a tensor; AdamW's decoupled weight decay, p -= lr * wd * p, is applied just
  before the optimizer (whose own decay is then 0), the same arithmetic as the fused
  kernel's; the EMA is teacher += (1 - m) (student - teacher) (ema.update_teacher_by);
  lightly's DINOLoss takes the temperature as a tensor.
- DINO freezes the head's last layer in the first epoch(s) by dropping its gradient, which
  would change what the graph does. Instead the layer's weights and AdamW state are put
  back after the update while the `frozen` tensor is 1 (torch.where and masked_fill:
  bitwise), which leaves the layer and its optimizer state as untouched as "no gradient".
- Inputs are copied into buffers the graph reads; the outputs are buffers the next replay
  overwrites. Gradients are allocated by the capture and written, not accumulated, by
  every replay. lightly's center keeps one buffer (DinoStep.forward_loss).
The first `warmup` calls run the same code without capture, on a side stream (real
iterations: compilation, cuBLAS handles, the optimizer's state); the next call captures it
and every later call only replays. The body runs uncaptured on a CPU too (capture=False),
which is how tests/test_dino.py checks its arithmetic against DinoStep's own.
Untested on a GPU so far: tests/test_device_ready.py has the CUDA tests (graphed = eager to
bf16 tolerance, one capture, no host sync), bench/NOTES.md the line that times it.
"""
from __future__ import annotations

import warnings

import torch

from resmlp.core.config import check_choice
from resmlp.core.errors import UserError
from resmlp.ssl.ema import update_teacher_by
from resmlp.ssl.clip import clip_per_parameter

WARMUP = 3   # uncaptured calls before the capture (torch's own examples use 3)


def use_cuda_graphs(value, device: torch.device, world_size: int, scaler_enabled: bool,
                    continuing: bool = False) -> bool:
    """dino.cuda_graphs (its words in configs/method/dino.yaml's limits): true, false or
    auto (on where it can be: one CUDA process, no GradScaler, not continuing from
    dino.init). true where it cannot be is a UserError."""
    check_choice("dino.cuda_graphs", value)   # a value handed in by code, not only by load_config
    if value is False:
        return False
    why = None
    if device.type != "cuda":
        why = "a CUDA GPU"
    elif world_size > 1:
        why = "a single process (DDP's gradient hooks are not captured here)"
    elif scaler_enabled:
        why = "bf16 or fp32 (fp16's GradScaler reads its scale on the host)"
    elif continuing:
        why = "a run without dino.init (its head warm-up and the backbone's learning-rate scale are not graphed)"
    if why and value is True:
        raise UserError(f"dino.cuda_graphs=true needs {why}; set dino.cuda_graphs=false or auto")
    return why is None


class TensorSchedule:
    """The per-iteration values as 0-dim fp32 tensors on the device. `set` queues one
    fill kernel per value (numbers travel as kernel arguments: no copy, no sync)."""

    NAMES = ("lr", "lr_wd", "ema_weight", "teacher_temp", "frozen")

    def __init__(self, device: torch.device):
        for name in self.NAMES:
            setattr(self, name, torch.zeros((), device=device))
        self.frozen_mask = torch.zeros((), dtype=torch.bool, device=device)

    def set(self, lr: float, weight_decay: float, momentum: float, teacher_temp: float, frozen: bool) -> None:
        # products and differences in float64 here: 1 - m in fp32 on the device would lose
        # five digits of the EMA's weight
        values = (lr, lr * weight_decay, 1.0 - momentum, teacher_temp, float(frozen))
        for name, v in zip(self.NAMES, values):
            getattr(self, name).fill_(v)
        self.frozen_mask.fill_(bool(frozen))


class GraphedStep:
    """DinoStep's update with tensor schedules, captured once and replayed (module
    docstring). `captures` counts captures: 1 after the warm-up, forever."""

    def __init__(self, step, capture: bool | None = None, warmup: int = WARMUP):
        self.step = step
        opt = step.optimizer
        self.device = opt.param_groups[0]["params"][0].device
        self.capture = self.device.type == "cuda" if capture is None else bool(capture)
        self.warmup = int(warmup)
        self.sched = TensorSchedule(self.device)
        head = step.raw_student.head
        last = getattr(head, "last_layer", None)
        self.last = [p for p in last.parameters() if p.requires_grad] if last is not None else []
        self.freeze_epochs = getattr(head, "freeze_last_layer", 0) if self.last else 0
        self.decay = [p for g in opt.param_groups if g.get("name") == "decay" for p in g["params"]]
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
            g["lr"] = self.sched.lr
            g["capturable"] = self.device.type == "cuda"
            g["weight_decay"] = 0.0

    def __call__(self, crops, lr: float, weight_decay: float, momentum: float, teacher_temp: float, epoch: int):
        self.sched.set(lr, weight_decay, momentum, teacher_temp, epoch < self.freeze_epochs)
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
        if not self.capture:
            self.out = self._update(zero_grad=True)
        elif self.calls < self.warmup:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self.out = self._update(zero_grad=True)
            torch.cuda.current_stream(self.device).wait_stream(side)
        else:
            if self.graph is None:
                self.step.optimizer.zero_grad(set_to_none=True)  # the capture allocates them
                self.graph = torch.cuda.CUDAGraph()
                # thread_local: the loader's pin-memory thread allocates pinned host memory
                # while we capture; in the default global mode that call would break the capture
                with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                    self.out = self._update(zero_grad=False)
                self.captures += 1
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
            warnings.filterwarnings("ignore", message="To copy construct from a tensor")  # lightly's temperature
            # The warm-up runs on a side stream and the capture on the graph's own, as capture
            # requires, so the gradient accumulators meet a stream other than the one they were
            # made on; the graphed steps are tested equal to eager ones (tests/test_graphs.py)
            warnings.filterwarnings("ignore", message="The AccumulateGrad node's stream does not match")
            loss, t_out, center, stats = step.forward_loss(self.inputs, sched.teacher_temp)
            if zero_grad:
                step.optimizer.zero_grad(set_to_none=True)
            loss.backward()
        clip_per_parameter(step.raw_student.parameters(), step.clip_grad)
        with torch.no_grad():
            before = [p.detach().clone() for p in self.last]
            if self.decay:
                torch._foreach_add_(self.decay, torch._foreach_mul(self.decay, -sched.lr_wd))
            step.optimizer.step()
            for p, old in zip(self.last, before):
                p.copy_(torch.where(sched.frozen_mask, old, p))
                state = step.optimizer.state[p]
                state["exp_avg"].masked_fill_(sched.frozen_mask, 0.0)
                state["exp_avg_sq"].masked_fill_(sched.frozen_mask, 0.0)
                state["step"].sub_(sched.frozen)  # while frozen it stays at 0, as if never stepped
            update_teacher_by(step.teacher, step.raw_student, sched.ema_weight)
        t_out = t_out.detach()
        return {"loss": loss.detach(), "t_out": t_out, "center": center,
                "stats": {k: v.detach() for k, v in stats.items()}}
