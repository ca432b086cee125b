"""`compile=true`: torch.compile one block and reuse it across the depth (regional compilation).

Compiling a whole network traces, lowers and schedules every one of its blocks, once per
crop size: the DINO step's student sees two (global and local crops) and its teacher one,
so a 12-block ResMLP was 36 block copies for Inductor before the first iteration
(bench/NOTES.md, "Issue 34 part 3", has what that cost). The blocks of a network run the
same code on parameters of the same shapes, and Dynamo treats a module's parameters as
inputs of its graph, so it compiles a block's forward once per kind of call and reuses it
for every block: per distinct input shape, grad mode and requires_grad of the
parameters, not per block (PyTorch's recipe "Reducing torch.compile cold start
compilation time with regional compilation").

`compile_regions(net)` compiles in place (`nn.Module.compile`): the network keeps its own
modules, so state_dict keys stay plain, DDP wraps it as it is, an EMA copy or
`fold_affine`'s deep copy is a network of its own, and CUDA graphs capture the compiled
kernels as they run. What sits around the blocks (patch embedding, final norm, pooling)
stays eager: a few small kernels per step. The DINO head and loss, whose passes are over
(batch x prototypes) logits, are compiled as functions of their own (`compiled`).

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

import torch
import torch.nn as nn


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
    targets = regions(net) or [net]
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
