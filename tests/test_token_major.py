"""model.token_major: the fused blocks' residual stream as (N, B, D) tokens (models/fused.py).
The same outputs and the same gradient for every parameter as the plain (B, N, D) model, in
float32 and under CPU bf16 autocast, at 224 px and at 96 px through each grid adaptation, with
drop path drawn from the same generator state (each block variant: test_fused.py's block tests,
in both layouts); the same state dict, folding and export; every reader of the tokens
(forward_features, the pooling, pooled_block_features); DINO's MultiCropNet on global and
local crops and a DINO step; compiled = eager."""
from __future__ import annotations

import pytest
import torch
from test_fused import FP32_TOL, bf16_misses, compare, dino_steps_agree, rel_err, twin_models
from test_models import randomize

from resmlp.core import cli
from resmlp.core.config import load_config
from resmlp.models import create_model, export_state_dict, fold_affine
from resmlp.models.from_config import build_model
from resmlp.models.resmlp import FusedResMLPBlock, ResMLPBlock

DIM = 32


@pytest.mark.parametrize('size,grid_adapt', [(224, 'interpolate'), (96, 'interpolate'), (96, 'subgrid')])
@pytest.mark.parametrize('kw', [{}, {'pooling': 'class_mlp', 'norm': 'layernorm'}], ids=['avg', 'class_mlp-ln'])
def test_a_token_major_resmlp_is_the_plain_one(size, grid_adapt, kw):
    """A 224 px model fed 224 px and 96 px crops, drop path on: logits, pooled block features
    and tokens, in fp32 and bf16, and with gradient checkpointing."""
    plain, fused = twin_models(token_major=True, drop_path_rate=0.3, grid_adapt=grid_adapt, **kw)
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
    plain, fused = twin_models(token_major=True, grid_adapt='subgrid')
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
    # evaluations build the backbone from the saved weights and config: how the blocks ran
    # in training (fused, token-major, Triton kernels, a bf16 stream) is not theirs to repeat
    from resmlp.models.load import resmlp_from_state_dict
    saved = {'name': 'resmlp_s12', 'grid_adapt': 'subgrid', 'fused': True, 'token_major': True, 'kernels': 'triton',
             'residual_dtype': 'bf16'}
    backbone, _, arch = resmlp_from_state_dict(sd_fused, 'a run', saved)
    assert arch['grid_adapt'] == 'subgrid' and not {'fused', 'token_major', 'kernels', 'residual_dtype'} & set(arch)
    with torch.no_grad():
        assert rel_err(backbone.eval()(x), plain.forward_head(plain.forward_features(x), pre_logits=True)) <= FP32_TOL


def multicrop_nets_agree(device: str = 'cpu', tol: float = FP32_TOL, model: dict | None = None, **fused) -> None:
    """ssl/networks.py's MultiCropNet (the student: drop path on, 2 global 224 px and 2 local
    96 px crops, head included) of the backbone `model` sets, with plain blocks and with the
    fused blocks `fused` sets: the same head outputs, global features and gradients."""
    from resmlp.ssl.head import build_head
    from resmlp.ssl.networks import MultiCropNet
    cfg = load_config('dino', 'resmlp_s12', ['demo=false', 'dino.out_dim=64', 'dino.hidden_dim=32',
                                             'dino.bottleneck_dim=16'])
    nets = []
    for kw in ({}, {'fused': True, **fused}):
        torch.manual_seed(0)
        kw = {'dim': DIM, 'depth': 2, 'num_classes': 0, 'drop_path_rate': 0.3, 'grid_adapt': 'interpolate',
              **(model or {}), **kw}
        nets.append(MultiCropNet(create_model('resmlp_s12', **kw), build_head(DIM, cfg.dino)).to(device))
    randomize(nets[0].backbone, seed=3)
    nets[1].load_state_dict(nets[0].state_dict())
    g = torch.Generator().manual_seed(0)
    crops = [torch.randn(2, 3, s, s, generator=g).to(device) for s in (224, 224, 96, 96)]
    results = []
    for net in nets:
        first = crops[0].clone().requires_grad_(True)
        torch.manual_seed(5)
        out, feats = net([first, *crops[1:]], global_features=True)
        trained = [p for p in net.parameters() if p.requires_grad]
        probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(device)
        grads = torch.autograd.grad((out * probe).sum() + feats.square().sum(), [first, *trained])
        results.append([out, feats, *grads])
    assert len(results[0]) == len(results[1]) > 20
    for want, got in zip(*results):
        assert rel_err(got, want) <= tol


def test_the_multicrop_net_of_dino_on_global_and_local_crops():
    multicrop_nets_agree(token_major=True)


def test_a_dino_step_token_major_is_the_plain_one():
    def token_major(step):
        assert step.student.backbone.token_major and step.teacher.backbone.token_major
    dino_steps_agree(['model.fused=true', 'model.token_major=true'], token_major)


def compiled_is_eager(eager, compiled, x, sizes, tol: float = FP32_TOL) -> None:
    """A training step of `compiled` (eager's weights) gives eager's output and gradients on
    x cropped to each of `sizes`; Dynamo's caches are reset after."""
    compiled.load_state_dict(eager.state_dict())
    try:
        for size in sizes:
            worst, errs = compare(eager, compiled, lambda net, t: net(t), x[..., :size, :size])
            assert worst <= tol, errs
    finally:
        torch._dynamo.reset()


@pytest.mark.slow
def test_a_compiled_token_major_step_is_the_eager_one():
    """Regional compilation (core/compiling.py) of a token-major model: one compiled block
    for the depth; a training step's output and gradients equal eager's at two grids."""
    from resmlp.core.compiling import compile_regions
    kw = dict(dim=16, img_size=32, patch_size=8, grid_adapt='interpolate')
    fused, compiled = twin_models(token_major=True, **kw)[1], twin_models(token_major=True, **kw)[1]
    compile_regions(compiled)
    compiled_is_eager(fused, compiled, torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0)), (32, 16))


def fused_key_reaches_the_builder(tmp_path, capsys, key: str, value: str, want, default, bad: str) -> None:
    """model.<key>, an option of the fused blocks: unset, each block's options (FusedOptions)
    hold `key` at `default`; model.<key>=<value>, at `want`; a word not in its limits, or the key with
    model.fused=false: one line (naming the key and what to write) and no run dir."""
    over = ['model.dim=16', 'model.depth=1', 'data.img_size=32', 'model.patch_size=8']
    for given, want in ((None, default), (value, want)):
        cfg = load_config('dino', 'resmlp_s12', over + ([f'model.{key}={given}'] if given else []))
        assert getattr(build_model(cfg.model, num_classes=3).blocks[0].options, key) == want
    for args, words in (([f'model.{key}={bad}'], [f'model.{key}']),
                        ([f'model.{key}={value}', 'model.fused=false'], [f'model.{key}', 'model.fused=true'])):
        assert cli.main(['dino', 'resmlp_s12', *args, f'out={tmp_path / "run"}']) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and all(w in err[0] for w in words), err
    assert not (tmp_path / 'run').exists()


def test_model_token_major_reaches_the_builder_and_needs_the_fused_block(tmp_path, capsys):
    fused_key_reaches_the_builder(tmp_path, capsys, 'token_major', 'true', True, False, 'maybe')
    model = build_model(load_config('dino', 'resmlp_s12', ['model.dim=16', 'model.depth=1', 'data.img_size=32',
                                                           'model.patch_size=8', 'model.token_major=true']).model)
    assert model.token_major and model.patch_embed.token_major


def test_the_bench_measures_each_lever_beside_the_fused_block(monkeypatch):
    """bench.<profile>.levers: each lever a line of the fused block of its own ("ours fused
    token-major ..."), eager, compiled and graphed, built with its model override; with
    interleave, its eager line timed with the fused block's, whose rate it is given over."""
    from bench import dino as D
    from bench.bench import Context
    from bench.config import bench_profile
    from bench.step import step_flops
    over = ["bench.tiny.levers=[token-major]", "bench.tiny.strategies=[subgrid]"]
    p = bench_profile("tiny", [*over, "bench.tiny.compile=[false,true]", "bench.tiny.graphs=[eager,compile]",
                               "bench.tiny.interleave=false"])
    built = []
    monkeypatch.setattr(D, "_dino_ours", lambda ctx, model, strategy, batch, comp, flops, graphs=False, fused=False,
                        lever=None: built.append((bool(comp), graphs, fused, lever)) or {"images_per_s": 1.0})
    monkeypatch.setattr(D, "_dino_reference", lambda *a: {"images_per_s": 1.0})
    ctx = Context(torch.device("cpu"), "tiny", p, ["resmlp_s12"], False)
    D.dino_family(ctx)
    kinds = ("eager", "compile", "eager+graphs", "compile+graphs")
    assert [r["impl"] for r in ctx.results] == [*(f"ours {k}" for k in kinds), *(f"ours fused {k}" for k in kinds),
                                                *(f"ours fused token-major {k}" for k in kinds), "reference"]
    assert built[-4:] == [(False, False, True, "token-major"), (True, False, True, "token-major"),
                          (False, True, True, "token-major"), (True, True, True, "token-major")]
    cfg, _, crops = D._step_inputs(Context(torch.device("cpu"), "tiny", p, ["resmlp_s12"], False), "resmlp_s12",
                                   "subgrid", 4, fused=True, lever="token-major")
    assert cfg.model.token_major and cfg.model.fused
    assert step_flops(cfg, torch.device("cpu"), "fp32", crops) > 0  # of the plain blocks, whatever the line's
    # interleaved, as the cpu profile times it: the real steps, one timing for all
    monkeypatch.undo()
    p = bench_profile("tiny", over)
    ctx = Context(torch.device("cpu"), "tiny", p, ["resmlp_s12"], False)
    D.dino_family(ctx)
    rows = {r["impl"]: r for r in ctx.results}
    assert set(rows) == {"ours eager", "ours fused eager", "ours fused token-major eager", "reference"}
    assert all(r["status"] == "ok" and r["interleaved"] for r in rows.values()), rows
    lever, fused = rows["ours fused token-major eager"], rows["ours fused eager"]
    assert lever["vs_fused"] == pytest.approx(lever["images_per_s"] / fused["images_per_s"])
