"""model.fused: FusedResMLPBlock (models/fused.py) against the plain ResMLPBlock. The same
outputs and the same gradient for every parameter, in float32 and under CPU bf16 autocast,
on the built grid and on a smaller one through each grid adaptation, in either token layout
(model.token_major; tests/test_token_major.py has the rest of it), with drop path drawn
from the same generator state; the same state dict, folding and export; a compiled step
equal to the eager one; the config key through every trainer's builder."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_models import randomize

from resmlp.core import cli
from resmlp.core.config import load_config
from resmlp.core.run_folder import config_differences
from resmlp.models import CROSS_PATCHES, create_model, export_state_dict, fold_affine
from resmlp.models.from_config import build_model
from resmlp.models.fused import FusedOptions
from resmlp.models.resmlp import FusedResMLPBlock, ResMLPBlock

DIM = 32
BUILT = (14, 14)   # a 224 px model, patch 16
# (name, grid fed, grid_adapt): the built grid, and DINO's 96 px local crop (6 x 6 patches)
GRIDS = [('224', (14, 14), 'interpolate'), ('96-interpolate', (6, 6), 'interpolate'),
         ('96-subgrid', (6, 6), 'subgrid')]
FP32_TOL = 1e-5    # the issue's: the same function to float32 rounding
BF16_TOL = 3e-2    # a few bf16 roundings (2**-8 each) of the largest value


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the largest value (the scale of bf16's rounding too)."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12)).item()


def twin_blocks(norm: str, cross_patch: str, grid_adapt: str, drop_path: float = 0.5, **fused_kw):
    """A plain block and a fused one (of `fused_kw`: token_major, ...) with the same parameters."""
    plain = ResMLPBlock(DIM, BUILT, 4.0, 0.1, drop_path, norm, cross_patch, grid_adapt)
    randomize(plain, seed=1)
    fused = FusedResMLPBlock(DIM, BUILT, 4.0, 0.1, drop_path, norm, cross_patch, grid_adapt,
                             options=FusedOptions(**fused_kw))
    fused.load_state_dict(plain.state_dict())
    return plain, fused


def block_call(grid):
    """Feeds a (B, N, D) batch to either block: token-major ones (model.token_major) get it as
    (N, B, D) and their output comes back as (B, N, D), so both are compared on the same tensors."""
    def call(net, t):
        if getattr(net, 'token_major', False):
            return net(t.transpose(0, 1).contiguous(), grid).transpose(0, 1)
        return net(t, grid)
    return call


LAYOUTS = pytest.mark.parametrize('token_major', [False, True], ids=['BND', 'NBD'])


def outputs_and_grads(net, call, x: torch.Tensor, seed: int, autocast: bool = False) -> list[torch.Tensor]:
    """[output, d loss / d input, d loss / d each parameter], drop path drawn after manual_seed(seed)."""
    x = x.clone().requires_grad_(True)
    torch.manual_seed(seed)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        y = call(net, x)
    probe = torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(y.device)
    grads = torch.autograd.grad((y.float() * probe).sum(), [x, *net.parameters()])
    return [y.detach(), *grads]


def compare(plain, fused, call, x, seed=3) -> tuple[float, dict]:
    """float32: the largest relative error over the output and every gradient, and each one."""
    want = outputs_and_grads(plain, call, x, seed)
    got = outputs_and_grads(fused, call, x, seed)
    names = ['output', 'input', *(n for n, _ in plain.named_parameters())]
    errs = {n: rel_err(g, w) for n, g, w in zip(names, got, want)}
    assert len(got) == len(want) == len(names) and all(g.dtype == w.dtype for g, w in zip(got, want))
    return max(errs.values()), errs


def bf16_misses(plain, fused, call, x, seed=3) -> dict:
    """Under bf16 autocast (on x's device), the output and gradients of the fused net against the exact
    (float32) ones: {name: (fused's error, plain's)} for those off by more than BF16_TOL and
    more than twice the plain net under the same autocast. A gradient that sums many terms
    which cancel is far off in both: measured up to 6% for the plain block's norm1.beta
    (fused: 0.7%). The class-MLP pool, plain code either way, has scalar gradients of that
    kind that bf16 blocks upstream move by up to 3.1% (plain) and 5.0% (fused): 2 x BF16_TOL."""
    exact = outputs_and_grads(plain, call, x, seed)
    plain_bf16 = outputs_and_grads(plain, call, x, seed, autocast=True)
    fused_bf16 = outputs_and_grads(fused, call, x, seed, autocast=True)
    # the residual stream keeps the plain block's dtype (float32 after the first block)
    assert all(f.dtype == p.dtype for f, p in zip(fused_bf16, plain_bf16))
    names = ['output', 'input', *(n for n, _ in plain.named_parameters())]
    errs = {n: (rel_err(f, e), rel_err(p, e)) for n, e, p, f in zip(names, exact, plain_bf16, fused_bf16)}
    return {n: e for n, e in errs.items()
            if e[0] > max(BF16_TOL * (2 if n.startswith('pool.') else 1), 2 * e[1])}


COSINE_MIN = 0.995  # a bf16 stream's gradients against the exact ones (measured worst 0.998; plain's 0.999)


def bf16_stream_misses(plain, fused, call, x, seed=3) -> dict:
    """model.residual_dtype=bf16 under bf16 autocast against the exact (float32) plain net:
    {name: (error, measure)} for the output off by more than BF16_TOL (relative) and for each
    gradient whose cosine with the exact one is under COSINE_MIN. The stream carries the
    gradients in bf16 too, so a gradient that sums many terms which cancel (a cross-patch
    bias's, norm1.beta's) is further off entry by entry than the plain block's (6% against
    2.5% measured) while it keeps its direction: hence the cosine."""
    exact = outputs_and_grads(plain, call, x, seed)
    got = outputs_and_grads(fused, call, x, seed, autocast=True)
    names = ['output', 'input', *(n for n, _ in plain.named_parameters())]
    misses = {} if rel_err(got[0], exact[0]) <= BF16_TOL else {'output': (rel_err(got[0], exact[0]), 'rel')}
    for name, g, e in zip(names[1:], got[1:], exact[1:]):
        cos = F.cosine_similarity(g.float().flatten(), e.float().flatten(), dim=0).item()
        if cos < COSINE_MIN:
            misses[name] = (cos, 'cos')
    return misses


def block_cases():
    for norm in ('affine', 'layernorm'):
        for cp in CROSS_PATCHES:
            for name, grid, adapt in GRIDS:
                if cp == 'mlp' and grid != BUILT:
                    continue  # the MLP cross-patch takes only its own grid (plain and fused alike)
                yield pytest.param(norm, cp, grid, adapt, id=f'{norm}-{cp}-{name}')


@LAYOUTS
@pytest.mark.parametrize('train', [True, False], ids=['drop-path', 'eval'])
@pytest.mark.parametrize('norm,cross_patch,grid,grid_adapt', list(block_cases()))
def test_a_fused_block_is_the_plain_block_in_fp32(norm, cross_patch, grid, grid_adapt, train, token_major):
    """In either token layout (model.token_major): the masks drawn per image, not per token."""
    plain, fused = twin_blocks(norm, cross_patch, grid_adapt, token_major=token_major)
    plain.train(train), fused.train(train)
    x = torch.randn(4, grid[0] * grid[1], DIM, generator=torch.Generator().manual_seed(0))
    call = block_call(grid)
    worst, errs = compare(plain, fused, call, x)
    assert worst <= FP32_TOL, errs
    if train:  # the masks matter: another generator state gives another result
        other = outputs_and_grads(plain, call, x, seed=4)[0]
        assert rel_err(other, outputs_and_grads(fused, call, x, seed=3)[0]) > 1e-2


@LAYOUTS
@pytest.mark.parametrize('train', [True, False], ids=['drop-path', 'eval'])
@pytest.mark.parametrize('norm,cross_patch,grid,grid_adapt',
                         [c for c in block_cases() if c.values[1] in ('linear', 'conv3x3', 'none')])
def test_a_fused_block_is_the_plain_block_under_bf16_autocast(norm, cross_patch, grid, grid_adapt, train, token_major):
    plain, fused = twin_blocks(norm, cross_patch, grid_adapt, token_major=token_major)
    plain.train(train), fused.train(train)
    x = torch.randn(4, grid[0] * grid[1], DIM, generator=torch.Generator().manual_seed(0))
    assert not bf16_misses(plain, fused, block_call(grid), x)


@LAYOUTS
@pytest.mark.parametrize('norm,cross_patch,grid,grid_adapt',
                         [c for c in block_cases() if c.values[1] in ('linear', 'conv3x3', 'none')])
def test_a_bf16_stream_block_is_the_plain_block_within_bf16(norm, cross_patch, grid, grid_adapt, token_major):
    """model.residual_dtype=bf16: under autocast the block's output is bfloat16, within bf16's
    tolerance of the exact one, and every gradient keeps its direction (drop path on, the same
    masks); without autocast the block is the float32 one (nothing to round)."""
    plain, fused = twin_blocks(norm, cross_patch, grid_adapt, token_major=token_major, residual_dtype='bf16')
    x = torch.randn(4, grid[0] * grid[1], DIM, generator=torch.Generator().manual_seed(0))
    call = block_call(grid)
    assert not bf16_stream_misses(plain, fused, call, x)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        assert call(fused, x).dtype == torch.bfloat16 and call(plain, x).dtype == torch.float32
    worst, errs = compare(plain, fused, call, x)
    assert worst <= FP32_TOL, errs
    fused.eval(), plain.eval()
    with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16):  # the teacher's path
        got = call(fused, x)
        assert got.dtype == torch.bfloat16 and rel_err(got, call(plain, x)) <= BF16_TOL


def twin_models(token_major: bool = False, kernels: str = 'torch', residual_dtype: str = 'fp32', **kw):
    """A plain model and a fused one (with these fused-block options) with the same parameters."""
    torch.manual_seed(0)
    kw = {'dim': DIM, 'depth': 2, 'num_classes': 10, **kw}
    plain = randomize(create_model('resmlp_s12', **kw), seed=2)
    fused = create_model('resmlp_s12', fused=True, token_major=token_major, kernels=kernels,
                         residual_dtype=residual_dtype, **kw)
    fused.load_state_dict(plain.state_dict())
    return plain, fused


@pytest.mark.parametrize('size,grid_adapt', [(224, 'interpolate'), (96, 'interpolate'), (96, 'subgrid')])
@pytest.mark.parametrize('kw', [{}, {'pooling': 'class_mlp', 'norm': 'layernorm'}], ids=['avg', 'class_mlp-ln'])
def test_a_fused_resmlp_is_the_plain_one(size, grid_adapt, kw):
    """A 224 px model fed 224 px and DINO's 96 px crops, drop path on, in fp32 and bf16; and
    with gradient checkpointing, whose recomputation draws the same masks again."""
    plain, fused = twin_models(drop_path_rate=0.3, grid_adapt=grid_adapt, **kw)
    assert all(type(b) is FusedResMLPBlock for b in fused.blocks) and fused.fused
    assert all(type(b) is ResMLPBlock for b in plain.blocks) and not plain.fused
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))
    worst, errs = compare(plain, fused, lambda net, t: net(t), x)
    assert worst <= FP32_TOL, errs
    assert not bf16_misses(plain, fused, lambda net, t: net(t), x)
    plain.set_grad_checkpointing(), fused.set_grad_checkpointing()
    worst, errs = compare(plain, fused, lambda net, t: net(t), x)
    assert worst <= FP32_TOL, errs


@pytest.mark.parametrize('size,grid_adapt', [(224, 'interpolate'), (96, 'interpolate'), (96, 'subgrid')])
def test_a_bf16_stream_resmlp_is_the_plain_one_within_bf16(size, grid_adapt):
    """model.residual_dtype=bf16 in a model fed 224 px and 96 px crops, drop path on, token-major
    as the fastest path would run: every block's output is bfloat16 under autocast, the
    features after the final norm float32, the output within bf16's tolerance of the exact one
    and every gradient in its direction."""
    plain, fused = twin_models(drop_path_rate=0.3, grid_adapt=grid_adapt, residual_dtype='bf16', token_major=True)
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))
    dtypes = []
    hooks = [b.register_forward_hook(lambda m, i, out: dtypes.append(out.dtype)) for b in fused.blocks]
    assert not bf16_stream_misses(plain, fused, lambda net, t: net(t), x)
    for h in hooks:
        h.remove()
    assert dtypes == [torch.bfloat16] * len(fused.blocks)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        assert fused.forward_features(x).dtype == torch.float32


def test_no_grad_forwards_use_the_exact_gelu_epilogue_on_the_cpu():
    """The teacher's and the evaluation's path: torch._addmm_activation's GELU is the exact
    erf GELU on the CPU (on CUDA it is the tanh approximation, which fused.py avoids); the
    check can fail, since tanh's differs from erf's by far more than the tolerance."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(64, 32, generator=g), torch.randn(128, 32, generator=g) / 4, torch.randn(128, generator=g)
    pre = F.linear(x, w, b)  # about N(0, 3): GELU's curved part, where tanh and erf differ most
    got = torch._addmm_activation(b, x, w.t(), use_gelu=True)
    assert (got - F.gelu(pre)).abs().max() <= FP32_TOL
    assert (F.gelu(pre, approximate='tanh') - F.gelu(pre)).abs().max() > 10 * FP32_TOL
    plain, fused = twin_models(grid_adapt='subgrid')
    plain.eval(), fused.eval()
    for size in (224, 96):
        with torch.no_grad():
            x = torch.randn(4, 3, size, size, generator=g)
            assert rel_err(fused(x), plain(x)) <= FP32_TOL
        with torch.inference_mode():
            assert rel_err(fused(x), plain(x)) <= FP32_TOL


def test_the_same_state_dict_folding_and_export():
    plain, fused = twin_models(grid_adapt='subgrid')
    sd_plain, sd_fused = plain.state_dict(), fused.state_dict()
    assert list(sd_fused) == list(sd_plain)
    assert all(sd_fused[k].shape == v.shape and torch.equal(sd_fused[k], v) for k, v in sd_plain.items())
    other_plain, other_fused = twin_models(grid_adapt='subgrid')
    randomize(other_fused, seed=5)
    other_plain.load_state_dict(other_fused.state_dict())            # fused -> plain
    other_fused.load_state_dict(randomize(other_plain, seed=6).state_dict())  # plain -> fused
    assert all(torch.equal(a, b) for a, b in zip(other_plain.state_dict().values(), other_fused.state_dict().values()))
    for fmt in ('timm', 'official'):
        a, b = export_state_dict(sd_plain, fmt), export_state_dict(sd_fused, fmt)
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert 'Aff1 + ls1 through the cross-patch linear' in repr(fused) and 'fused:' not in repr(plain)
    folded = fold_affine(fused)
    assert all(type(b) is ResMLPBlock for b in folded.blocks) and not folded.fused
    assert all(type(b) is FusedResMLPBlock for b in fused.blocks)  # the original is left as it was
    x = torch.randn(2, 3, 96, 96, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel_err(folded(x), fold_affine(plain)(x)) <= FP32_TOL
        assert rel_err(folded(x), plain.eval()(x)) <= FP32_TOL


@pytest.mark.slow
def test_a_compiled_fused_step_is_the_eager_one():
    """torch.compile (inductor on the CPU here) of a fused model: a training step's output
    and gradients, and a no-grad forward through the GELU epilogue, equal eager. Drop path
    is off: compiled code draws its masks from inductor's own random stream."""
    plain, fused = twin_models(dim=16, img_size=32, patch_size=8, grid_adapt='interpolate')
    compiled = torch.compile(fused)
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    try:
        for size in (32, 16):
            xs = x[..., :size, :size]
            worst, errs = compare(fused, compiled, lambda net, t: net(t), xs)
            assert worst <= FP32_TOL, errs
            with torch.no_grad():
                assert rel_err(compiled(xs), plain(xs)) <= FP32_TOL
    finally:
        torch._dynamo.reset()


def dino_steps_agree(overrides: list[str], check=None) -> None:
    """One DINO step (student with drop path, no-grad teacher, loss, AdamW, EMA) of the plain
    blocks and of the blocks `overrides` make, from the same weights and generator state: the
    same losses and the same teacher after two. `check(step)`: on the second step, once built."""
    import kit
    from resmlp.data.crop_plan import crop_plan
    cpu = torch.device('cpu')
    steps, losses = {}, {}
    for other, over in ((False, ['model.fused=false']), (True, overrides)):
        torch.manual_seed(0)
        cfg = kit.small_dino_config('interpolate', over)
        steps[other] = kit.dino_step(cfg, cpu, 'fp32', compile=False)
    assert isinstance(steps[False].student.backbone.blocks[0], ResMLPBlock)
    if check:
        check(steps[True])
    steps[True].student.load_state_dict(steps[False].student.state_dict())
    steps[True].teacher.load_state_dict(steps[False].teacher.state_dict())
    crops = kit.synthetic_crops(crop_plan(cfg), 4, cpu)
    for other, step in steps.items():
        torch.manual_seed(1)
        losses[other] = [kit.call_step(step, [c.clone() for c in crops]) for _ in range(2)]
    for a, b in zip(losses[True], losses[False]):
        assert rel_err(a, b) <= 1e-5
    want = steps[False].teacher.state_dict()
    for key, value in steps[True].teacher.state_dict().items():
        assert rel_err(value, want[key]) <= 1e-5, key


def test_a_dino_step_fused_is_the_plain_one():
    def fused(step):
        assert type(step.student.backbone.blocks[0]) is FusedResMLPBlock
    dino_steps_agree(['model.fused=true'], fused)


@pytest.mark.parametrize('command', ['dino', 'supervised', 'finetune', 'distill'])
def test_model_fused_reaches_every_trainers_builder(command):
    """Default true; false builds the plain blocks; the trainers build through build_model."""
    extra = ['checkpoint=x'] if command == 'finetune' else ['distill.teacher=x'] if command == 'distill' else []
    for value, block in ((None, FusedResMLPBlock), ('false', ResMLPBlock), ('true', FusedResMLPBlock)):
        over = ['model.dim=16', 'model.depth=1', 'data.img_size=32', 'model.patch_size=8', *extra]
        cfg = load_config(command, 'resmlp_s12', over + ([f'model.fused={value}'] if value else []))
        assert type(build_model(cfg.model, num_classes=3).blocks[0]) is block


def test_a_bad_model_fused_is_one_line_and_it_may_change_on_resume(tmp_path, capsys):
    assert cli.main(['dino', 'resmlp_s12', 'model.fused=maybe', f'out={tmp_path / "run"}']) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and 'model.fused' in err[0] and 'true' in err[0], err
    assert not (tmp_path / 'run').exists()
    saved = {'command': 'dino', 'model': {'name': 'resmlp_s12', 'fused': False}, 'data': {}}
    now = {'command': 'dino', 'model': {'name': 'resmlp_s12', 'fused': True}, 'data': {}}
    assert config_differences(saved, now) == []
    assert config_differences(saved, {**now, 'model': {'name': 'resmlp_s24', 'fused': True}})


@pytest.mark.cuda
@pytest.mark.parametrize('size,grid_adapt', [(224, 'interpolate'), (96, 'interpolate'), (96, 'subgrid')])
def test_a_fused_resmlp_is_the_plain_one_on_cuda(size, grid_adapt):
    """On the GPU, as on the CPU: the output and every gradient in fp32 and under bf16
    autocast, drop path drawn from the same CUDA generator state; the no-grad forward of the
    teacher and the evaluation; and fc1's GELU exact (erf), with and without gradients: CUDA's
    _addmm_activation would give the tanh approximation. fp32 to 1e-4: cuBLAS picks other
    kernels for the fused GEMMs (addmm with the residual, the folded shapes)."""
    from resmlp.models.fused import _linear_gelu
    assert not torch.backends.cuda.matmul.allow_tf32  # torch's default: fp32 matmuls in fp32
    g = torch.Generator().manual_seed(1)
    h, w, b = (torch.randn(*shape, generator=g).cuda() / d for shape, d in (((64, 32), 1), ((128, 32), 4), ((128,), 1)))
    want = F.gelu(F.linear(h, w, b))
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            assert (_linear_gelu(h.requires_grad_(grad), w, b) - want).abs().max() <= FP32_TOL
    plain, fused = (m.cuda() for m in twin_models(drop_path_rate=0.3, grid_adapt=grid_adapt))
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0)).cuda()
    worst, errs = compare(plain, fused, lambda net, t: net(t), x)
    assert worst <= 1e-4, errs
    assert not bf16_misses(plain, fused, lambda net, t: net(t), x)
    plain.eval(), fused.eval()
    with torch.no_grad():
        assert rel_err(fused(x), plain(x)) <= FP32_TOL
