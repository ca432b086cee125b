"""What the kernels share: the GEMM step in each input precision, tile sizes, how an
operator is registered, and where the kernels can run."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import custom_op, triton_op, wrap_triton

from resmlp.core.errors import UserError

# How a kernel's tl.dot rounds its inputs: float32 exactly (torch's default matmul precision,
# "highest") or as TF32, or the autocast dtype the torch path's GEMMs would get.
DOT_IEEE, DOT_TF32, DOT_BF16, DOT_FP16 = 0, 1, 2, 3


def interpreted(kernel) -> bool:
    """Whether Triton's interpreter runs `kernel` (TRITON_INTERPRET=1 when it was defined)."""
    return type(kernel).__name__ == "InterpretedFunction"


@triton.jit
def _probe():
    pass


# Triton's interpreter holds bfloat16 as raw 16-bit integers: its tl.dot multiplies those bits,
# and its float32 -> bfloat16 cast truncates. Under it the kernels round to bfloat16 themselves
# (round_bf16) and multiply in float32: the same values as the GPU's bf16 tensor-core dot.
INTERPRETED = tl.constexpr(interpreted(_probe))


@triton.jit
def round_bf16(x):
    """float32 x rounded to the nearest bfloat16 (ties to even), still float32."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def cast(x, ty: tl.constexpr):
    """float32 x as a value of ty, rounded to nearest (also under the interpreter)."""
    if INTERPRETED:
        if ty == tl.bfloat16:
            x = round_bf16(x)
    return x.to(ty)


@triton.jit
def mma(a, b, acc, DOT: tl.constexpr):
    """acc + a @ b with a and b rounded as DOT says, accumulated in float32."""
    if DOT == 2:
        if INTERPRETED:
            acc = tl.dot(round_bf16(a.to(tl.float32)), round_bf16(b.to(tl.float32)), acc)
        else:
            acc = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    elif DOT == 3:
        acc = tl.dot(a.to(tl.float16), b.to(tl.float16), acc)
    elif DOT == 1:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32")
    else:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return acc


@torch._dynamo.assume_constant_result
def _fp32_matmul_exact() -> bool:
    """torch's float32 matmul precision is "highest": read when a compiled graph is made (a
    string is no tensor Dynamo can trace; asked each call, it would break the graph)."""
    return torch.get_float32_matmul_precision() == "highest"


def dot_mode(device: torch.device) -> int:
    """The GEMM precision of the torch path at this point: autocast's dtype where autocast is
    on, else float32 at torch's float32 matmul precision."""
    if torch.is_autocast_enabled(device.type):
        dtype = torch.get_autocast_dtype(device.type)
        if dtype in (torch.bfloat16, torch.float16):
            return DOT_BF16 if dtype == torch.bfloat16 else DOT_FP16
    return DOT_IEEE if _fp32_matmul_exact() else DOT_TF32


def tile(n: int, low: int = 16, high: int = 64) -> int:
    """A power-of-two tile side for an axis of n, within [low, high] (tl.dot needs 16)."""
    return max(low, min(high, triton.next_power_of_2(n)))


# Launch settings legal on any GPU Triton supports. GPU-tuning-dependent: the campaign's
# bench lines (model.kernels=triton) measure them; nothing here was tuned on a GPU yet.
NUM_WARPS, NUM_STAGES = 4, 2
# The wgrad kernels split their long reduction axis until about this many programs run.
SPLIT_PROGRAMS = 512


def launcher(kernel):
    """kernel[grid](...) as the operator's body calls it: through wrap_triton, so that
    torch.compile traces it, unless the interpreter runs it (then there is nothing to trace)."""
    return kernel if interpreted(kernel) else wrap_triton(kernel)


def register(name: str, kernel, fake):
    """The operator resmlp::<name> of a body that launches `kernel`: a triton_op (torch.compile
    sees and schedules its kernels; its body is its own fake implementation), or under the
    interpreter an opaque custom_op with `fake` for the shapes (compiled graphs then call it)."""
    def register_body(body):
        if not interpreted(kernel):
            return triton_op(f"resmlp::{name}", body, mutates_args=())
        op = custom_op(f"resmlp::{name}", body, mutates_args=())
        op.register_fake(fake)
        return op
    return register_body


def check_device(kernel, t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not interpreted(kernel):
        raise UserError(f"model.kernels=triton runs on CUDA GPUs, not on {t.device.type}: use model.kernels=torch "
                        "(on the CPU the kernels run only under Triton's interpreter, TRITON_INTERPRET=1, for tests)")
