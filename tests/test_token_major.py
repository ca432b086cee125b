"""model.token_major: the fused blocks' residual stream as (N, B, D) tokens (models/fused.py).
The same outputs and the same gradient for every parameter as the plain (B, N, D) block and
model, in float32 and under CPU bf16 autocast, on the built grid and on DINO's local-crop grid
through each grid adaptation, with drop path drawn from the same generator state; the same
state dict, folding and export; every reader of the tokens (forward_features, the pooling,
pooled_block_features); DINO's MultiCropNet on global and local crops; compiled = eager."""
from __future__ import annotations

import pytest
import torch
from test_fused import FP32_TOL, bf16_misses, block_cases, compare, outputs_and_grads, rel_err, twin_blocks
from test_models import randomize

from resmlp.core import cli
from resmlp.core.config import load_config
from resmlp.models import create_model, export_state_dict, fold_affine
from resmlp.models.from_config import build_model
from resmlp.models.resmlp import FusedResMLPBlock, ResMLPBlock

DIM = 32


def token_major_twins(norm: str, cross_patch: str, grid_adapt: str):
    plain, fused = twin_blocks(norm, cross_patch, grid_adapt)
    fused.token_major = True
    return plain, fused


def block_call(grid):
    """Feeds a (B, N, D) batch to either block: token-major ones get it as (N, B, D), and
    their output comes back as (B, N, D), so both are compared on the same tensors."""
    def call(net, t):
        if getattr(net, 'token_major', False):
            return net(t.transpose(0, 1).contiguous(), grid).transpose(0, 1)
        return net(t, grid)
    return call


@pytest.mark.parametrize('train', [True, False], ids=['drop-path', 'eval'])
@pytest.mark.parametrize('norm,cross_patch,grid,grid_adapt', list(block_cases()))
def test_a_token_major_block_is_the_plain_block_in_fp32(norm, cross_patch, grid, grid_adapt, train):
    plain, fused = token_major_twins(norm, cross_patch, grid_adapt)
    plain.train(train), fused.train(train)
    x = torch.randn(4, grid[0] * grid[1], DIM, generator=torch.Generator().manual_seed(0))
    call = block_call(grid)
    worst, errs = compare(plain, fused, call, x)
    assert worst <= FP32_TOL, errs
    if train:  # the masks matter: another generator state gives another result
        other = outputs_and_grads(plain, call, x, seed=4)[0]
        assert rel_err(other, outputs_and_grads(fused, call, x, seed=3)[0]) > 1e-2


@pytest.mark.parametrize('train', [True, False], ids=['drop-path', 'eval'])
@pytest.mark.parametrize('norm,cross_patch,grid,grid_adapt',
                         [c for c in block_cases() if c.values[1] in ('linear', 'conv3x3', 'none')])
def test_a_token_major_block_is_the_plain_block_under_bf16_autocast(norm, cross_patch, grid, grid_adapt, train):
    plain, fused = token_major_twins(norm, cross_patch, grid_adapt)
    plain.train(train), fused.train(train)
    x = torch.randn(4, grid[0] * grid[1], DIM, generator=torch.Generator().manual_seed(0))
    assert not bf16_misses(plain, fused, block_call(grid), x)


def token_major_models(**kw):
    kw = {'dim': DIM, 'depth': 2, 'num_classes': 10, **kw}
    plain = randomize(create_model('resmlp_s12', **kw), seed=2)
    fused = create_model('resmlp_s12', fused=True, token_major=True, **kw)
    fused.load_state_dict(plain.state_dict())
    return plain, fused


@pytest.mark.parametrize('size,grid_adapt', [(224, 'interpolate'), (96, 'interpolate'), (96, 'subgrid')])
@pytest.mark.parametrize('kw', [{}, {'pooling': 'class_mlp', 'norm': 'layernorm'}], ids=['avg', 'class_mlp-ln'])
def test_a_token_major_resmlp_is_the_plain_one(size, grid_adapt, kw):
    """A 224 px model fed 224 px and 96 px crops, drop path on: logits, pooled block features
    and tokens, in fp32 and bf16, and with gradient checkpointing."""
    plain, fused = token_major_models(drop_path_rate=0.3, grid_adapt=grid_adapt, **kw)
    assert fused.token_major and not plain.token_major
    assert all(type(b) is FusedResMLPBlock and b.token_major for b in fused.blocks)
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))
    tokens, _ = fused.patch_embed(x)
    assert tokens.shape == (size // 16 * size // 16, 2, DIM) and tokens.is_contiguous()
    worst, errs = compare(plain, fused, lambda net, t: net(t), x)
    assert worst <= FP32_TOL, errs
    with torch.no_grad():  # the other readers of the tokens: the head's gradients are the ones above
        plain.eval(), fused.eval()
        assert fused.forward_features(x).shape == (2, (size // 16) ** 2, DIM)
        assert rel_err(fused.forward_features(x), plain.forward_features(x)) <= FP32_TOL
        for want, got in zip(plain.pooled_block_features(x, 2), fused.pooled_block_features(x, 2)):
            assert rel_err(got, want) <= FP32_TOL
        plain.train(), fused.train()
    assert not bf16_misses(plain, fused, lambda net, t: net(t), x)
    plain.set_grad_checkpointing(), fused.set_grad_checkpointing()
    worst, errs = compare(plain, fused, lambda net, t: net(t), x)
    assert worst <= FP32_TOL, errs


def test_the_same_state_dict_folding_and_export():
    plain, fused = token_major_models(grid_adapt='subgrid')
    sd_plain, sd_fused = plain.state_dict(), fused.state_dict()
    assert list(sd_fused) == list(sd_plain)
    assert all(torch.equal(sd_fused[k], v) for k, v in sd_plain.items())
    for fmt in ('timm', 'official'):
        a, b = export_state_dict(sd_plain, fmt), export_state_dict(sd_fused, fmt)
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert 'tokens (N, B, D)' in repr(fused)
    folded = fold_affine(fused)
    assert not folded.token_major and all(type(b) is ResMLPBlock for b in folded.blocks)
    assert fused.token_major and all(b.token_major for b in fused.blocks)  # the original is left as it was
    x = torch.randn(2, 3, 96, 96, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel_err(folded(x), plain.eval()(x)) <= FP32_TOL
        assert rel_err(fused.eval()(x), plain(x)) <= FP32_TOL


def test_the_multicrop_net_of_dino_on_global_and_local_crops():
    """ssl/networks.py's MultiCropNet (the student: drop path on, 2 global and 2 local crops,
    head included): the same head outputs, global features and gradients."""
    from resmlp.core.config import load_config as load
    from resmlp.ssl.head import build_head
    from resmlp.ssl.networks import MultiCropNet
    cfg = load('dino', 'resmlp_s12', ['demo=false', 'dino.out_dim=64', 'dino.hidden_dim=32',
                                      'dino.bottleneck_dim=16'])
    nets = []
    for token_major in (False, True):
        torch.manual_seed(0)
        backbone = create_model('resmlp_s12', dim=DIM, depth=2, num_classes=0, drop_path_rate=0.3,
                                grid_adapt='interpolate', fused=token_major, token_major=token_major)
        nets.append(MultiCropNet(backbone, build_head(DIM, cfg.dino)))
    randomize(nets[0].backbone, seed=3)
    nets[1].load_state_dict(nets[0].state_dict())
    g = torch.Generator().manual_seed(0)
    crops = [torch.randn(2, 3, s, s, generator=g) for s in (224, 224, 96, 96)]

    results = []
    for net in nets:
        first = crops[0].clone().requires_grad_(True)
        torch.manual_seed(5)
        out, feats = net([first, *crops[1:]], global_features=True)
        trained = [p for p in net.parameters() if p.requires_grad]
        probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
        grads = torch.autograd.grad((out * probe).sum() + feats.square().sum(), [first, *trained])
        results.append([out, feats, *grads])
    assert len(results[0]) == len(results[1]) > 20
    for want, got in zip(*results):
        assert rel_err(got, want) <= FP32_TOL

def test_a_dino_step_token_major_is_the_plain_one():
    """One DINO step (student with drop path, no-grad teacher, loss, AdamW, EMA) from the
    same weights and generator state: the same loss and the same teacher after it."""
    from test_bench import tiny_profile

    import resmlp.bench.rows as R
    from resmlp.data.crop_plan import crop_plan
    cpu = torch.device('cpu')
    steps, losses = {}, {}
    for token_major in (False, True):
        torch.manual_seed(0)
        over = ['model.fused=true', 'model.token_major=true'] if token_major else ['model.fused=false']
        cfg = R.dino_config(tiny_profile(), 'resmlp_s12', 'interpolate', over)
        steps[token_major] = R.build_our_step(cfg, cpu, 'fp32', compile=False)
        assert steps[token_major].student.backbone.token_major == token_major
    steps[True].student.load_state_dict(steps[False].student.state_dict())
    steps[True].teacher.load_state_dict(steps[False].teacher.state_dict())
    crops = R.synthetic_crops(crop_plan(cfg), 4, cpu)
    for token_major, step in steps.items():
        torch.manual_seed(1)
        losses[token_major] = [R.call_step(step, [c.clone() for c in crops]) for _ in range(2)]
    for a, b in zip(losses[True], losses[False]):
        assert rel_err(a, b) <= 1e-5
    want = steps[False].teacher.state_dict()
    for key, value in steps[True].teacher.state_dict().items():
        assert rel_err(value, want[key]) <= 1e-5, key


@pytest.mark.slow
def test_a_compiled_token_major_step_is_the_eager_one():
    """Regional compilation (core/compiling.py) of a token-major model: one compiled block
    for the depth; a training step's output and gradients equal eager's at two grids."""
    from resmlp.core.compiling import compile_regions
    plain, fused = token_major_models(dim=16, img_size=32, patch_size=8, grid_adapt='interpolate')
    compiled = token_major_models(dim=16, img_size=32, patch_size=8, grid_adapt='interpolate')[1]
    compiled.load_state_dict(fused.state_dict())
    compile_regions(compiled)
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    try:
        for size in (32, 16):
            worst, errs = compare(fused, compiled, lambda net, t: net(t), x[..., :size, :size])
            assert worst <= FP32_TOL, errs
    finally:
        torch._dynamo.reset()


def test_model_token_major_reaches_the_builder_and_needs_the_fused_block(tmp_path, capsys):
    over = ['model.dim=16', 'model.depth=1', 'data.img_size=32', 'model.patch_size=8']
    for value, token_major in ((None, False), ('true', True)):
        cfg = load_config('dino', 'resmlp_s12', over + ([f'model.token_major={value}'] if value else []))
        model = build_model(cfg.model, num_classes=3)
        assert model.token_major == token_major and model.blocks[0].token_major == token_major
    for bad, words in ((['model.token_major=maybe'], ['model.token_major', 'true']),
                       (['model.token_major=true', 'model.fused=false'], ['model.token_major', 'model.fused=true'])):
        assert cli.main(['dino', 'resmlp_s12', *bad, f'out={tmp_path / "run"}']) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and all(w in err[0] for w in words), err
    assert not (tmp_path / 'run').exists()



def test_the_bench_measures_each_lever_beside_the_fused_block(monkeypatch):
    """bench.<profile>.levers: each lever a line of the fused block of its own ("ours fused
    token-major ..."), eager, compiled and graphed, built with its model override; with
    interleave, its eager line timed with the fused block's, whose rate it is given over."""
    import resmlp.bench.rows as R
    from resmlp.bench.bench import Context
    from resmlp.core.config import load_config as load
    over = ["bench.profile=tiny", "bench.tiny.levers=[token-major]", "bench.tiny.strategies=[subgrid]"]
    p = load("bench", "resmlp_s12", [*over, "bench.tiny.compile=[false,true]", "bench.tiny.graphs=[eager,compile]",
                                     "bench.tiny.interleave=false"]).bench.tiny
    built = []
    monkeypatch.setattr(R, "_dino_ours", lambda ctx, model, strategy, batch, comp, flops, graphs=False, fused=False,
                        lever=None: built.append((bool(comp), graphs, fused, lever)) or {"images_per_s": 1.0})
    monkeypatch.setattr(R, "_dino_reference", lambda *a: {"images_per_s": 1.0})
    ctx = Context(torch.device("cpu"), "tiny", p, ["resmlp_s12"], False)
    R.dino_family(ctx)
    kinds = ("eager", "compile", "eager+graphs", "compile+graphs")
    assert [r["impl"] for r in ctx.results] == [*(f"ours {k}" for k in kinds), *(f"ours fused {k}" for k in kinds),
                                                *(f"ours fused token-major {k}" for k in kinds), "reference"]
    assert built[-4:] == [(False, False, True, "token-major"), (True, False, True, "token-major"),
                          (False, True, True, "token-major"), (True, True, True, "token-major")]
    cfg = R._step_inputs(Context(torch.device("cpu"), "tiny", p, ["resmlp_s12"], False), "resmlp_s12", "subgrid",
                         4, fused=True, lever="token-major")[0]
    assert cfg.model.token_major and cfg.model.fused
    # interleaved, as the cpu profile times it: the real steps, one timing for all
    monkeypatch.undo()
    p = load("bench", "resmlp_s12", over).bench.tiny
    ctx = Context(torch.device("cpu"), "tiny", p, ["resmlp_s12"], False)
    R.dino_family(ctx)
    rows = {r["impl"]: r for r in ctx.results}
    assert set(rows) == {"ours eager", "ours fused eager", "ours fused token-major eager", "reference"}
    assert all(r["status"] == "ok" and r["interleaved"] for r in rows.values()), rows
    lever, fused = rows["ours fused token-major eager"], rows["ours fused eager"]
    assert lever["vs_fused"] == pytest.approx(lever["images_per_s"] / fused["images_per_s"])
