"""model.kernels=triton: the fused block's Triton kernels (models/kernels/) against float64
references and against the plain block. Outputs and every gradient equal to the plain block
in float32 (1e-5) and within bf16's tolerance under autocast, at 224 px and at 96 px through
interpolate and subgrid, in both token layouts, with drop path drawn from the same generator
state; DINO's MultiCropNet on global and local crops; compiled = eager.

Without a GPU the kernels run under Triton's interpreter, which must be switched on before
they are defined: this file then runs itself in a subprocess with TRITON_INTERPRET=1
(test_the_kernels_under_the_interpreter), so that no other test sees the interpreter, and
skips its kernel cases in this process. With a GPU it runs them here, on CUDA. The shapes are
tiny (dim 32, patch 32: 49 and 9 tokens) because the interpreter runs every program in numpy.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_fused import (BF16_TOL, bf16_misses, bf16_stream_misses, block_call, compare, outputs_and_grads, rel_err,
                        twin_models)
from test_models import randomize
from test_token_major import compiled_is_eager, fused_key_reaches_the_builder, multicrop_nets_agree

from resmlp.core import cli
from resmlp.core.errors import UserError
from resmlp.models import create_model
from resmlp.models.from_config import build_model
from resmlp.models.fused import FusedOptions
from resmlp.models.resmlp import FusedResMLPBlock, ResMLPBlock

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETER else "cpu"
RUNS_KERNELS = INTERPRETER or DEVICE == "cuda"
# A kernel case needs a GPU (`pytest -m cuda`, the campaign's tests stage, selects it there) or
# the interpreter: without a GPU, test_the_kernels_under_the_interpreter runs it.
kernel_case = (lambda case: case) if INTERPRETER else pytest.mark.cuda
# cuBLAS picks other kernels for the torch path's GEMMs than for the plain block's (test_fused)
FP32_TOL = 1e-4 if DEVICE == "cuda" else 1e-5
DIM, PATCH = 32, 32
BUILT = (7, 7)  # a 224 px model at patch 32; DINO's 96 px local crop is 3 x 3
GRIDS = [("224", (7, 7), "interpolate"), ("96-interpolate", (3, 3), "interpolate"), ("96-subgrid", (3, 3), "subgrid")]
ROOT = Path(__file__).resolve().parent.parent


def test_the_kernels_under_the_interpreter():
    """The kernel cases of this file, in a process of their own under TRITON_INTERPRET=1."""
    if RUNS_KERNELS:
        pytest.skip("this process runs the kernel cases itself")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", __file__],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert " passed" in out and " failed" not in out, out[-2000:]
    print(f"interpreter cases: {out.strip().splitlines()[-1]} ({time.perf_counter() - t0:.0f} s with the start)")


# ---- the operators against float64 ---------------------------------------------------------

def _grads(fn, inputs, probe_seed=7):
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*inputs)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(probe_seed)).to(out.device)
    return [out.detach(), *torch.autograd.grad((out.float() * probe).sum(), inputs)]


def _close(got, want, tol, what):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype or tol > FP32_TOL, (what, i, g.dtype, w.dtype)
        assert rel_err(g, w) <= tol, (what, i, rel_err(g, w))


@kernel_case
@pytest.mark.parametrize("token_major", [False, True], ids=["BND", "NBD"])
@pytest.mark.parametrize("norm", ["affine", "layernorm"])
@pytest.mark.parametrize("drop", [False, True], ids=["", "mask"])
def test_cross_patch_kernels_are_the_formula(token_major, norm, drop):
    """Z = X + m (s (A @ U) + c) and its gradients for A, X (and U), s and c, against float64
    autograd; 70 tokens, 5 images, 48 channels: several row, image and chunk tiles, ragged."""
    from resmlp.models.kernels import load
    ops = load()
    n, b, d = 70, 5, 48
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g) / n ** 0.5
    x = torch.randn(n, b, d, generator=g) if token_major else torch.randn(b, n, d, generator=g)
    s, c = torch.randn(d, generator=g), torch.randn(n, d, generator=g)
    mask = (torch.rand(b, generator=g) > 0.4).float() / 0.6 if drop else None
    m = None if mask is None else (mask.view(1, b, 1) if token_major else mask.view(b, 1, 1))
    ln = norm == "layernorm"

    def reference(a, x, s, c):
        u = F.layer_norm(x, (d,)) if ln else x
        p = torch.mm(a, u.reshape(n, -1)).view(u.shape) if token_major else torch.matmul(a, u)
        t = s * p + (c.unsqueeze(1) if token_major else c)
        return x + (t if m is None else m.to(t.dtype) * t)

    def kernel(a, x, s, c):
        u = F.layer_norm(x, (d,)) if ln else None
        return ops.cross_patch_residual(a, x, u, s, c, mask, token_major)
    on = [t.to(DEVICE) for t in (a, x, s, c)]
    want = _grads(reference, [t.double() for t in on])
    got = _grads(kernel, on)
    _close(got, [w.float() for w in want], FP32_TOL, "fp32")
    again = _grads(kernel, on)
    assert all(torch.equal(x, y) for x, y in zip(got, again))  # partial sums in a fixed order: the same bits
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        got = _grads(kernel, on)
    assert got[0].dtype == torch.float32  # the residual keeps the fp32 stream's dtype
    _close(got, [w.float() for w in want], BF16_TOL, "bf16")


@kernel_case
def test_gelu_mlp_kernels_are_the_formula():
    """fc2(GELU(fc1(x))) with the exact GELU and its gradients for x, W1, b1, W2, b2, against
    float64 autograd; 70 rows, 48 -> 80 -> 48: ragged row and hidden tiles."""
    from resmlp.models.kernels import load
    ops = load()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 35, 48, generator=g)
    w1, b1 = torch.randn(80, 48, generator=g) / 4, torch.randn(80, generator=g)
    w2, b2 = torch.randn(48, 80, generator=g) / 6, torch.randn(48, generator=g)
    on = [t.to(DEVICE) for t in (x, w1, b1, w2, b2)]
    want = _grads(lambda x, w1, b1, w2, b2: F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2), [t.double() for t in on])
    got = _grads(ops.gelu_mlp_forward, on)
    _close(got, [w.float() for w in want], FP32_TOL, "fp32")
    tanh = _grads(lambda x, w1, b1, w2, b2: F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2),
                  [t.double() for t in on])
    assert rel_err(tanh[0], want[0]) > 10 * FP32_TOL  # the check tells erf from tanh
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        got = _grads(ops.gelu_mlp_forward, on)
    assert got[0].dtype == torch.bfloat16
    _close(got, [w.float() for w in want], BF16_TOL, "bf16")


# ---- the block and the model against the plain ones ---------------------------------------

def kernel_twins(norm: str, cross_patch: str, grid_adapt: str, token_major: bool, residual_dtype: str = "fp32"):
    """A plain block and a fused one with the kernels, the same parameters, built at 224 px."""
    args = (DIM, BUILT, 4.0, 0.1, 0.5, norm, cross_patch, grid_adapt)
    plain = randomize(ResMLPBlock(*args), seed=1).to(DEVICE)
    options = FusedOptions(token_major=token_major, kernels="triton", residual_dtype=residual_dtype)
    fused = FusedResMLPBlock(*args, options=options).to(DEVICE)
    fused.load_state_dict(plain.state_dict())
    return plain, fused


def block_cases():
    for name, grid, adapt in GRIDS:
        for token_major in (False, True):
            yield pytest.param("affine", "linear", grid, adapt, token_major, True,
                               id=f"affine-{name}-{'NBD' if token_major else 'BND'}")
    yield pytest.param("layernorm", "linear", (3, 3), "subgrid", True, True, id="layernorm-96-subgrid-NBD")
    yield pytest.param("affine", "linear", (7, 7), "interpolate", False, False, id="affine-224-BND-eval")
    yield pytest.param("affine", "conv3x3", (3, 3), "subgrid", True, True, id="conv3x3-96-NBD")
    yield pytest.param("affine", "none", (7, 7), "interpolate", False, True, id="none-224-BND")


@kernel_case
@pytest.mark.parametrize("norm,cross_patch,grid,grid_adapt,token_major,train", list(block_cases()))
def test_a_triton_block_is_the_plain_block(norm, cross_patch, grid, grid_adapt, token_major, train):
    """Built at 224 px (patch 32) and fed its own grid or a 96 px crop's; fp32 and bf16; drop
    path on (train) from the same generator state, whose masks must matter."""
    plain, fused = kernel_twins(norm, cross_patch, grid_adapt, token_major)
    plain.train(train), fused.train(train)
    x = torch.randn(2, grid[0] * grid[1], DIM, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    call = block_call(grid)
    worst, errs = compare(plain, fused, call, x)
    assert worst <= FP32_TOL, errs
    if train:
        other = outputs_and_grads(plain, call, x, seed=4)[0]
        assert rel_err(other, outputs_and_grads(fused, call, x, seed=3)[0]) > 1e-2
    assert not bf16_misses(plain, fused, call, x)


@kernel_case
@pytest.mark.parametrize("norm", ["affine", "layernorm"])
@pytest.mark.parametrize("token_major", [False, True], ids=["BND", "NBD"])
def test_a_triton_block_with_a_bf16_stream_is_the_plain_block_within_bf16(norm, token_major):
    """model.residual_dtype=bf16 with the kernels: under autocast the kernel writes a bfloat16
    stream, within bf16's tolerance of the exact block (test_fused's bf16_stream_misses);
    without autocast the float32 one."""
    plain, fused = kernel_twins(norm, "linear", "subgrid", token_major, residual_dtype="bf16")
    x = torch.randn(2, 9, DIM, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    call = block_call((3, 3))
    assert not bf16_stream_misses(plain, fused, call, x)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        assert call(fused, x).dtype == torch.bfloat16
    worst, errs = compare(plain, fused, call, x)
    assert worst <= FP32_TOL, errs


def triton_models(**kw):
    return [m.to(DEVICE) for m in twin_models(kernels="triton", patch_size=PATCH, **kw)]


@kernel_case
@pytest.mark.parametrize("size,grid_adapt", [(224, "interpolate"), (96, "interpolate"), (96, "subgrid")])
@pytest.mark.parametrize("token_major", [False, True], ids=["BND", "NBD"])
def test_a_triton_resmlp_is_the_plain_one(size, grid_adapt, token_major):
    plain, fused = triton_models(drop_path_rate=0.3, grid_adapt=grid_adapt, token_major=token_major)
    assert all(b.options.kernels == "triton" for b in fused.blocks) and "Triton kernels" in repr(fused)
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    worst, errs = compare(plain, fused, lambda net, t: net(t), x)
    assert worst <= FP32_TOL, errs
    assert not bf16_misses(plain, fused, lambda net, t: net(t), x)
    plain.eval(), fused.eval()
    with torch.no_grad():  # the teacher's and the evaluations' path
        assert rel_err(fused(x), plain(x)) <= FP32_TOL


@kernel_case
def test_every_lever_together_is_the_plain_model_within_bf16():
    """Token-major, the kernels and a bf16 stream at once (the bench's together line) on a
    96 px crop through subgrid, drop path on: within bf16's tolerance under autocast, the
    plain model's function in float32."""
    plain, fused = triton_models(drop_path_rate=0.3, grid_adapt="subgrid", token_major=True, residual_dtype="bf16")
    x = torch.randn(2, 3, 96, 96, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    assert not bf16_stream_misses(plain, fused, lambda net, t: net(t), x)
    worst, errs = compare(plain, fused, lambda net, t: net(t), x)
    assert worst <= FP32_TOL, errs


@kernel_case
def test_the_multicrop_net_of_dino_with_triton_kernels():
    """DINO's student on 2 global (224 px) and 2 local (96 px) crops, drop path on, head
    included, token-major: the same head outputs, global features and gradients."""
    multicrop_nets_agree(DEVICE, FP32_TOL, {"patch_size": PATCH}, token_major=True, kernels="triton")


@kernel_case
def test_a_compiled_triton_step_is_the_eager_one():
    """Regional compilation of a triton model: on a GPU Inductor schedules the triton_op
    kernels; under the interpreter the operators are opaque and AOTAutograd traces them
    through their fake implementations and autograd formulas. Drop path off: compiled code
    draws its own masks."""
    from resmlp.core.compiling import regions
    fused, compiled = (triton_models(grid_adapt="subgrid", token_major=True)[1] for _ in range(2))
    tokens = torch.randn(9, 2, DIM, device=DEVICE, requires_grad=True)
    for autocast in (False, True):  # one graph per block: nothing in the operators' calls breaks it
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            explained = torch._dynamo.explain(fused.blocks[0])(tokens, (3, 3))
        torch._dynamo.reset()
        assert explained.graph_break_count == 0, explained.break_reasons
    backend = "inductor" if DEVICE == "cuda" else "aot_eager"  # no Inductor CPU code for a Triton kernel
    for block in regions(compiled):
        block.compile(dynamic=False, backend=backend)
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    compiled_is_eager(fused, compiled, x, (224, 96), FP32_TOL)


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRETER, reason="CUDA graphs need a GPU")
def test_the_kernels_run_inside_a_cuda_graph():
    """The DINO step's whole-step capture (ssl/graphed_step.py) replays the kernels: a graphed
    forward and backward give the plain model's output and gradients."""
    plain, fused = triton_models(grid_adapt="subgrid", token_major=True)
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    static = torch.zeros_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: Triton compiles, the .grad tensors are made
        for _ in range(2):
            fused(static).sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused(static)
        out.sum().backward()
    static.copy_(x)
    fused.zero_grad(set_to_none=False)
    graph.replay()
    torch.cuda.synchronize()
    want = plain(x)
    want.sum().backward()
    assert rel_err(out, want) <= FP32_TOL
    for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
        assert rel_err(p.grad, q.grad) <= FP32_TOL, name


# ---- the key -------------------------------------------------------------------------------

def test_model_kernels_reaches_the_builder_and_runs_only_where_it_can(tmp_path, capsys):
    fused_key_reaches_the_builder(tmp_path, capsys, "kernels", "triton", "triton", "torch", "cuda")
    if not RUNS_KERNELS:  # compiled Triton kernels and CPU tensors: one line that says what to use
        model = create_model("resmlp_s12", dim=16, depth=1, img_size=32, patch_size=8, fused=True, kernels="triton")
        with pytest.raises(UserError, match="model.kernels=torch"):
            model(torch.randn(1, 3, 32, 32))


def test_the_bench_measures_the_kernels_and_max_autotune_as_levers(monkeypatch):
    """bench.<profile>.levers: triton and bf16-residual lines of their own, then with token-major
    all together; max-autotune only where the blocks compile, in Inductor's max-autotune mode."""
    import torch._inductor.config as inductor

    from bench import dino as D
    from bench.bench import Context
    from bench.config import bench_profile
    p = bench_profile("tiny", ["bench.tiny.levers=[token-major,triton,bf16-residual,max-autotune]",
                               "bench.tiny.strategies=[subgrid]", "bench.tiny.compile=[false,true]",
                               "bench.tiny.graphs=[eager,compile]", "bench.tiny.fused=[true]", "bench.tiny.interleave=false"])
    modes = []
    monkeypatch.setattr(D, "_dino_ours", lambda ctx, model, strategy, batch, comp, flops, graphs=False, fused=False,
                        lever=None: modes.append((lever, D.lever_overrides(lever))) or {"images_per_s": 1.0})
    monkeypatch.setattr(D, "_dino_reference", lambda *a: {"images_per_s": 1.0})
    ctx = Context(torch.device("cpu"), "tiny", p, ["resmlp_s12"], False)
    D.dino_family(ctx)
    kinds = ("eager", "compile", "eager+graphs", "compile+graphs")
    want = [*(f"ours fused {lever}{k}" for lever in ("", "token-major ", "triton ", "bf16-residual ") for k in kinds),
            "ours fused max-autotune compile", "ours fused max-autotune compile+graphs",
            *(f"ours fused token-major+triton+bf16-residual {k}" for k in kinds), "reference"]
    assert [r["impl"] for r in ctx.results] == want
    assert ("token-major+triton+bf16-residual",
            ["model.token_major=true", "model.kernels=triton", "model.residual_dtype=bf16"]) in modes
    assert not inductor.max_autotune
    with D.inductor_mode("max-autotune"):
        assert inductor.max_autotune and not inductor.triton.cudagraphs
    with D.inductor_mode("triton"):
        assert not inductor.max_autotune
    assert not inductor.max_autotune
