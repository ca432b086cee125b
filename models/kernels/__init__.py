"""Triton kernels of the fused block (`model.kernels=triton`, models/fused.py), where no
library fuses what the block needs:

- cross_patch.py: the cross-patch linear with its per-channel scale and bias, the drop-path
  mask and the residual add in the GEMM's epilogue; its backward in two kernels whose
  epilogues also take the scale's, the bias's and A's gradients as partial sums.
- gelu_mlp.py: the channel MLP with the exact (erf) GELU in fc1's epilogue, and GELU's
  derivative with fc1's bias gradient in the epilogue of fc2's input-gradient GEMM.

Each is a torch.library operator with its autograd formula (`triton_op`, so that
torch.compile sees the kernels and CUDA graphs capture them), imported only when a model
asks for them. On a CUDA GPU they are compiled by Triton; on the CPU they run under
Triton's interpreter when TRITON_INTERPRET=1 was set before this package was imported
(the tests do, tests/test_kernels.py), as opaque custom operators there.
"""
from __future__ import annotations

from resmlp.core.errors import UserError


def load():
    """The operators' module (resmlp.models.kernels.ops), imported on first use."""
    try:
        import triton  # noqa: F401
    except ImportError:
        raise UserError("model.kernels=triton needs the triton package (torch's CUDA wheels bring it); "
                        "use model.kernels=torch") from None
    from resmlp.models.kernels import ops
    return ops
