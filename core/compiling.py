"""`compile`: torch.compile the trainer's networks, by region (one block compiled and reused
across the depth) or whole, and which of the two a run takes.

The words (auto | true | false | regions | whole) are `compile`'s limits in
configs/defaults.yaml. `compile_form` turns the word into a form for one run:
- auto: compiled where a GPU bench showed the step faster compiled (`MEASURED`), on a CUDA
  GPU only (`measured_here`); elsewhere eager, with one line that says why;
- true: compiled, on any device, in the form the measurements favour for the run;
- regions, whole: that form, as asked; false: eager.
`StepPath` is the answer a trainer prints in its first lines and keeps in results.json; where
the fast path fails at run time and a trainer falls back (ssl/fallback.py), the path it takes
then, with the line that said why (`fell_back`).

Regional compilation. Compiling a whole network traces, lowers and schedules every one of
its blocks, once per crop size: the DINO step's student sees two (global and local crops)
and its teacher one, so a 12-block ResMLP was 36 block copies for Inductor before the first
iteration (tools/bench/NOTES.md, "Issue 34 part 3", has what that cost). The blocks of a network
run the same code on parameters of the same shapes, and Dynamo treats a module's parameters
as inputs of its graph, so it compiles a block's forward once per kind of call and reuses
it for every block: per distinct input shape, grad mode and requires_grad of the
parameters, not per block (PyTorch's recipe "Reducing torch.compile cold start compilation
time with regional compilation"). The price is a call through Dynamo's guards per block and
step: with the DINO step as one CUDA graph that cost is gone, without it the step at a small
batch is bound by the host, where the whole network, one call per pass, ran faster
(docs/bench/h100-2026-11-27 against h100-2026-11-26). So DINO on a GPU compiles by region
when graphed and whole when not.

Both forms compile in place (`nn.Module.compile`): the network keeps its own modules, so
state_dict keys stay plain, DDP wraps it as it is, an EMA copy or `fold_affine`'s deep copy
is a network of its own, and CUDA graphs capture the compiled kernels as they run. By region,
what sits around the blocks (patch embedding, final norm, pooling) stays eager: a few small
kernels per step. The DINO head and loss, whose passes are over (batch x prototypes) logits,
are then compiled as functions of their own (`compiled`); whole, the head is part of its
network's graph and the loss alone is compiled that way.

Shapes are static (`dynamic=False`): one graph per crop size, each as fast as a graph made
for its shape. Every `nn.Module.compile` of a process shares one code object, and so one
Dynamo recompile limit (8 graphs; past it torch warns and runs the rest eagerly): the
DINO step makes 3 (student global and local crops, teacher), 5 while dino.init's frozen
backbone warms the head up. The head and each of the loss's functions have a code object
and a limit each: the head 2 graphs (student, teacher), 3 with the frozen backbone; the
loss's 1 each. Evaluations run the same modules eagerly (`uncompiled`): an
extraction's last, partial batch would otherwise cost a compilation of its own, for a
pass over the data that runs once per evaluation, not once per step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from resmlp.core.config import check_choice
from resmlp.core.errors import causes, raised_in

# The trainers whose step a GPU bench has timed compiled, and the form that ran fastest with
# the step as one CUDA graph and without (docs/bench/h100-2026-11-27: by region and graphed,
# the fastest DINO step at batch 64; ungraphed, the whole networks of h100-2026-11-26 beat
# it). compile=auto compiles these, on a CUDA GPU; a trainer missing here was never timed
# compiled on a GPU and stays eager under auto. Anywhere else compile=true compiles by region.
MEASURED = {"dino": {"graphed": "regions", "ungraphed": "whole"}}
HOW = {"regions": "blocks compiled by region", "whole": "networks compiled whole", None: "eager"}
# The modules whose errors are a compiler's (compiler_error)
COMPILERS = ("torch._dynamo", "torch._inductor", "torch._functorch", "triton")


def measured_here(device) -> bool:
    """Whether `device` is of the kind the MEASURED forms were timed on (a CUDA GPU): where
    compile=auto compiles. The fallback tests make a CPU take that path by replacing this."""
    return torch.device(device).type == "cuda"


def compile_form(value, device, command: str, graphed: bool = False) -> tuple[str | None, str | None]:
    """`compile`'s word for a run of `command` on `device` (graphed: its step runs as one
    CUDA graph) -> (the form: "regions", "whole" or None for eager; None, or the line that
    says why compile is off)."""
    check_choice("compile", value)   # a value handed in by code, not only by load_config
    if value is False:
        return None, "compile off: compile=false"
    cuda = measured_here(device)
    measured = MEASURED.get(command)
    if value == "auto" and not cuda:
        return None, "compile off: auto compiles on a CUDA GPU (compile=true compiles here too)"
    if value == "auto" and measured is None:
        return None, (f"compile off: no GPU bench has timed the {command} step compiled, so auto leaves it eager "
                      "(compile=true compiles it)")
    if value is True or value == "auto":
        return (measured["graphed" if graphed else "ungraphed"] if cuda and measured else "regions"), None
    return value, None


@dataclass(frozen=True)
class StepPath:
    """How a trainer's step runs: compiled (`compile`: regions, whole or None), graphed
    (`cuda_graphs`; None for a trainer without a graphed step), and for each part that is
    off the line that says why."""
    compile: str | None
    cuda_graphs: bool | None = None
    off: tuple = ()
    fell_back: tuple = ()   # the `path:` lines of the fallbacks that led here (ssl/fallback.py)

    def describe(self) -> str:
        """How the step runs, in words: "blocks compiled by region, the step as one CUDA graph"."""
        graphs = "" if self.cuda_graphs is None else \
            ", the step as one CUDA graph" if self.cuda_graphs else ", not graphed"
        return HOW[self.compile] + graphs

    def lines(self) -> list[str]:
        """The run's first lines: the path, then one line per part that is off."""
        return [f"path: {self.describe()}", *self.off]

    def record(self) -> dict:
        """results.json's `path`: what was chosen (config.yaml keeps what was asked), and the
        fallbacks' lines where the run fell back to it."""
        out = {"compile": self.compile or False}
        if self.cuda_graphs is not None:
            out["cuda_graphs"] = self.cuda_graphs
        if self.fell_back:
            out["fell_back"] = list(self.fell_back)
        return out


def regions(net: nn.Module) -> list[nn.Module]:
    """The repeated blocks of `net`: every element of each `blocks` container (ModuleList or
    Sequential) among its modules, whatever the block's class (ResMLP's, timm's ViT and
    Mixer blocks). Empty when it has none (a convnet)."""
    found = []
    for module in net.modules():
        blocks = getattr(module, "blocks", None)
        if isinstance(blocks, (nn.ModuleList, nn.Sequential)):
            found.extend(blocks)
    return found


def compile_regions(net: nn.Module) -> list[nn.Module]:
    """Compile each block of `net` in place (module docstring); a network without blocks is
    compiled whole, in place too. Returns the modules compiled."""
    return compile_as(net, "regions")


def compile_as(net: nn.Module, form: str | None) -> list[nn.Module]:
    """Compile `net` in place in `form` (compile_form's): by region, whole, or not at all
    (None), undoing any earlier form first (a trainer that falls back from one form to
    another). Returns the modules compiled."""
    for module in net.modules():
        if module._compiled_call_impl is not None:   # nn.Module.compile's own slot: eager again
            module._compiled_call_impl = None
    if form is None:
        return []
    targets = (regions(net) or [net]) if form == "regions" else [net]
    for module in targets:
        module.compile(dynamic=False)
    if any(p.is_cuda for p in net.parameters()):
        _start_compile_workers()
    return targets


def _start_compile_workers() -> None:
    """Inductor's pool of Triton compile processes, started now rather than at the first
    compilation, so that it comes up while the trainer does its k-NN at init (a no-op where
    torch has no such pool)."""
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:
        return
    maybe_warm_pool()


def uncompiled():
    """A context in which compiled modules run their eager code and nothing compiles."""
    return torch.compiler.set_stance("force_eager")


def compiled(fn):
    """`fn` (a function, not a module) compiled as a region of its own: its code object has
    its own recompile limit, apart from the blocks', and the same static shapes. What the
    DINO step compiles besides the blocks (compile=true): its heads (ssl/networks.py) and
    its loss (ssl/loss.py)."""
    return torch.compile(fn, dynamic=False)


def compiler_error(error: BaseException) -> bool:
    """Whether a compiler raised `error` (or what it was raised from): an exception type of
    Dynamo, Inductor, AOTAutograd or Triton (Dynamo's BackendCompilerFailed wraps the
    backend's own), or one raised inside their code (a Triton kernel's launch). What a run
    under compile=auto falls back from (ssl/fallback.py, the device augmentation)."""
    for e in causes(error):
        parts = raised_in(e)
        if type(e).__module__.startswith(COMPILERS) or "triton" in parts or \
                ("torch" in parts and any(p in parts for p in ("_dynamo", "_inductor", "_functorch"))):
            return True
    return False


def first_line(error: BaseException) -> str:
    """'RuntimeError: its first line', of the backend's own error where Dynamo wrapped it."""
    inner = getattr(error, "inner_exception", None)
    error = inner if isinstance(inner, BaseException) else error
    text = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
