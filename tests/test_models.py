"""Tests for resmlp.models: sizes against the paper, timm/official weight compatibility,
patch-grid adaptation, ablation variants and inference folding."""
from __future__ import annotations

from pathlib import Path

import pytest
import timm
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

import resmlp.models as M
from resmlp.core.errors import UserError
from resmlp.models import (
    Affine, ResMLP, adapt_token_mixing, convert_state_dict, create_model, fold_affine,
    list_models, load_pretrained,
)

TINY = dict(dim=32, depth=2, img_size=32, patch_size=4)  # 8x8 grid


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def meta_model(name: str, **kw) -> ResMLP:
    with torch.device('meta'):  # sizes without allocating or initialising weights
        return create_model(name, **kw)


def tiny(**kw) -> ResMLP:
    torch.manual_seed(0)
    return create_model('resmlp_s12', **{**TINY, **kw})


@torch.no_grad()
def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-default values everywhere: the default init (alpha=1, beta=0, equal ls, timm's
    zero head) would hide swapped or dropped keys."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        r = torch.randn(p.shape, generator=g)
        if name.endswith(('alpha', 'norm1.weight', 'norm2.weight', 'norm.weight')):
            p.copy_(1 + 0.2 * r)
        elif name.endswith(('ls1', 'ls2', 'gamma_1', 'gamma_2')):
            p.copy_(0.2 * r)
        elif name.endswith(('beta', 'bias')):
            p.copy_(0.1 * r)
        elif 'cross_patch' in name or 'linear_tokens' in name:
            p.copy_(r / p.shape[-1])
        else:
            p.copy_(r * 0.05)
    return model


def assert_close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    err = (a - b).abs().max().item()
    scale = max(b.abs().max().item(), 1.0)
    assert err <= tol * scale, f'max abs diff {err:.3g} (scale {scale:.3g})'


# ---------------------------------------------------------------------------------------
# sizes
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize('name, kw, expected', [
    ('resmlp_s12', {}, 15_350_872),
    ('resmlp_s24', {}, 30_020_680),
    ('resmlp_s36', {}, 44_690_488),
    ('resmlp_b24', {}, 115_736_776),
    ('resmlp_b24', {'patch_size': 8}, 129_138_280),
    # class-MLP: our design (2 layers of token-linear + MLP, class token, final Aff)
    ('resmlp_s12', {'pooling': 'class_mlp'}, 17_720_164),
])
def test_param_counts_exact(name, kw, expected):
    assert n_params(meta_model(name, **kw)) == expected


@pytest.mark.parametrize('kw, paper_millions', [
    ({'norm': 'layernorm'}, 15.4),
    ({'pooling': 'class_mlp'}, 17.7),
    ({'cross_patch': 'none'}, 14.9),
    ({'cross_patch': 'mlp'}, 18.6),
    ({'cross_patch': 'conv3x3'}, 30.8),
    ({'cross_patch': 'dwconv3x3'}, 14.9),
    ({'cross_patch': 'dwsep3x3'}, 16.7),
])
def test_ablation_param_counts_match_paper_table3(kw, paper_millions):
    got = n_params(meta_model('resmlp_s12', **kw)) / 1e6
    assert abs(got - paper_millions) <= 0.05, got
    if kw.get('pooling') == 'class_mlp':
        assert abs(got - 17.7) / 17.7 < 0.03


@pytest.mark.parametrize('name, kw, gmacs', [
    ('resmlp_s12', {}, 3.0), ('resmlp_s24', {}, 6.0), ('resmlp_s36', {}, 8.9),
    ('resmlp_b24', {}, 23.0), ('resmlp_b24', {'patch_size': 8}, 100.2),
    # Table 3 ablations of S12
    ('resmlp_s12', {'pooling': 'class_mlp'}, 3.0), ('resmlp_s12', {'cross_patch': 'mlp'}, 4.3),
    ('resmlp_s12', {'cross_patch': 'conv3x3'}, 6.0), ('resmlp_s12', {'cross_patch': 'dwconv3x3'}, 2.8),
    ('resmlp_s12', {'cross_patch': 'dwsep3x3'}, 3.2), ('resmlp_s12', {'cross_patch': 'none'}, 2.8),
])
def test_flops_match_paper(name, kw, gmacs):
    model = meta_model(name, **kw).eval()  # shapes are all FlopCounterMode needs
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.empty(1, 3, 224, 224, device='meta'))
    # FlopCounterMode counts 2 FLOPs per multiply-add; the paper's "FLOPs" are MACs
    measured = counter.get_total_flops() / 2 / 1e9
    assert abs(measured - gmacs) / gmacs < 0.02, measured


def test_official_layerscale_init_per_depth():
    for name, init in [('resmlp_s12', 0.1), ('resmlp_s24', 1e-5), ('resmlp_s36', 1e-6), ('resmlp_b24', 1e-6)]:
        m = create_model(name, dim=16, depth=1, img_size=32, patch_size=16)
        assert torch.allclose(m.blocks[0].ls1, torch.full((16,), init))
        assert torch.allclose(m.blocks[0].ls2, torch.full((16,), init))
    m = tiny(init_values='1e-5')  # YAML 1.1 reads 1e-5 as a string
    assert torch.allclose(m.blocks[0].ls1, torch.full((32,), 1e-5))


# ---------------------------------------------------------------------------------------
# forward API
# ---------------------------------------------------------------------------------------

def test_forward_api_shapes():
    m = tiny(num_classes=10)
    x = torch.randn(3, 3, 32, 32)
    assert m.num_features == 32 and m.grid_size == (8, 8) and m.num_patches == 64
    tokens = m.forward_features(x)
    assert tokens.shape == (3, 64, 32)
    assert m(x).shape == (3, 10)
    assert m.forward_head(tokens, pre_logits=True).shape == (3, 32)
    assert_close(m.forward_head(tokens, pre_logits=True), tokens.mean(1))
    m.reset_classifier(0)
    assert isinstance(m.head, nn.Identity) and m(x).shape == (3, 32)
    m.reset_classifier(5)
    assert m(x).shape == (3, 5)
    assert tiny(num_classes=0)(x).shape == (3, 32)
    rect = tiny(img_size=[32, 16], num_classes=0)
    assert rect.grid_size == (8, 4) and rect(torch.randn(2, 3, 32, 16)).shape == (2, 32)


def test_input_not_multiple_of_patch_raises():
    with pytest.raises(ValueError, match='multiple of the patch size'):
        tiny()(torch.randn(1, 3, 30, 32))


def test_pooled_block_features():
    m = randomize(tiny(num_classes=0)).eval()
    x = torch.randn(2, 3, 32, 32)
    feats = m.pooled_block_features(x, 2)
    assert len(feats) == 2 and all(f.shape == (2, 32) for f in feats)
    assert_close(feats[-1], m(x))  # last block, final norm, average pool
    tokens = m.blocks[0](m.patch_embed(x)[0], m.grid_size)
    assert_close(feats[0], m.norm(tokens).mean(1))  # earlier blocks get the final norm too
    with pytest.raises(ValueError):
        m.pooled_block_features(x, 3)


def test_drop_path_and_grad_checkpointing():
    m = tiny(drop_path_rate=0.2)
    assert all(type(b.drop_path).__name__ == 'DropPath' for b in m.blocks)
    m = randomize(tiny(num_classes=4))
    x = torch.randn(2, 3, 32, 32)
    m(x).square().sum().backward()
    ref = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    m.set_grad_checkpointing(True)
    m(x).square().sum().backward()
    for a, p in zip(ref, m.parameters()):
        assert_close(p.grad, a)


def test_no_weight_decay_names():
    m = tiny(pooling='class_mlp')
    names = m.no_weight_decay()
    assert {'blocks.0.norm1.alpha', 'blocks.0.norm1.beta', 'blocks.1.ls2', 'norm.alpha',
            'pool.cls_token', 'pool.layers.0.ls1'} <= names
    assert 'blocks.0.cross_patch.weight' not in names
    assert names <= {n for n, _ in m.named_parameters()}


# ---------------------------------------------------------------------------------------
# builders, registry, errors, configs
# ---------------------------------------------------------------------------------------

def test_list_models_and_timm_registry():
    assert list_models() == ['resmlp_s12', 'resmlp_s24', 'resmlp_s36', 'resmlp_b24']
    for name in list_models():
        assert timm.is_model(name)
    m = timm.create_model('resmlp_s12', num_classes=0, **TINY)
    assert isinstance(m, ResMLP) and m(torch.randn(1, 3, 32, 32)).shape == (1, 32)
    # timm's own ResMLP family is untouched
    assert not isinstance(timm.create_model('resmlp_12_224', num_classes=0, img_size=32), ResMLP)
    with pytest.raises(UserError):
        timm.create_model('resmlp_s12', pretrained=True)


@pytest.mark.parametrize('call, words', [
    (lambda: create_model('resmlp_s13'), ['resmlp_s12', 'resmlp_b24']),
    (lambda: create_model('resmlp_s12', embed_dim=3), ['img_size', 'cross_patch', 'grid_adapt']),
    (lambda: create_model('resmlp_s12', pooling='max'), ['avg', 'class_mlp']),
    (lambda: create_model('resmlp_s12', cross_patch='attn'), ['dwsep3x3', 'none']),
    (lambda: create_model('resmlp_s12', img_size=100), ['100', '16']),
    (lambda: create_model('resmlp_s12', depth='deep'), ['depth']),
    (lambda: create_model('resmlp_s12', num_classes=-1), ['num_classes']),
    (lambda: create_model('resmlp_s12', fused='yes'), ['model.fused', 'true or false']),
])
def test_bad_names_and_overrides_raise_user_error(call, words):
    with pytest.raises(UserError) as info:
        call()
    msg = str(info.value)
    assert '\n' not in msg
    for w in words:
        assert w in msg


@pytest.mark.parametrize('name', ['resmlp_s12', 'resmlp_s24', 'resmlp_s36', 'resmlp_b24'])
def test_every_registered_model_builds_from_its_config(name):
    """The command line knows exactly the registry's models, and each one's config (with
    ImageNet's data file) builds the paper's model."""
    from resmlp.core.cli import model_names
    from resmlp.core.config import load_config
    assert model_names() == list_models() and name in list_models()
    cfg = load_config('supervised', name, ['data=imagenet', 'demo=false'])
    section = {k: v for k, v in cfg.model.items()
               if v is not None and k not in ('name', 'grad_checkpointing', 'drop_path_rate')}
    assert set(section) <= set(M.OVERRIDE_KEYS)
    expected = {'resmlp_s12': 15_350_872, 'resmlp_s24': 30_020_680,
                'resmlp_s36': 44_690_488, 'resmlp_b24': 115_736_776}[name]
    assert n_params(meta_model(name, **section)) == expected


# ---------------------------------------------------------------------------------------
# weights: timm and official state_dicts
# ---------------------------------------------------------------------------------------

def official_from_timm(sd: dict) -> dict:
    """Rename timm keys to facebookresearch/deit resmlp_models.py keys (reference table)."""
    out = {}
    for k, v in sd.items():
        k = k.replace('stem.proj.', 'patch_embed.proj.')
        k = k.replace('.linear_tokens.', '.attn.').replace('.mlp_channels.', '.mlp.')
        k = k.replace('.ls1', '.gamma_1').replace('.ls2', '.gamma_2')
        if k.endswith(('.alpha', '.beta')):
            v = v.reshape(-1)
        out[k] = v
    return out


@pytest.fixture(scope='module')
def timm_s12():
    return randomize(timm.create_model('resmlp_12_224', pretrained=False), seed=1).eval()


def test_timm_s12_equivalence_and_official_format(timm_s12):
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = timm_s12(x)
        ours = create_model('resmlp_s12').eval()
        assert load_pretrained(ours, timm_s12.state_dict()).missing == []
        got = ours(x)
        assert_close(got, want)
        assert (want - timm_s12.head.bias).abs().max() > 0.1  # the head sees the features
        official = official_from_timm(timm_s12.state_dict())
        assert M.detect_format(official) == 'official'
        ours2 = create_model('resmlp_s12').eval()
        from resmlp.models.load import unwrap
        load_pretrained(ours2, unwrap({'model': official})[0])  # deit checkpoints wrap it in 'model'
        assert_close(ours2(x), want)
        # our own keys pass through unchanged
        assert convert_state_dict(ours.state_dict()).keys() == ours.state_dict().keys()


def test_timm_s24_equivalence():
    t = randomize(timm.create_model('resmlp_24_224', pretrained=False), seed=2).eval()
    ours = create_model('resmlp_s24').eval()
    load_pretrained(ours, t.state_dict())
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(ours(x), t(x))


def test_converted_keys_and_shapes(timm_s12):
    sd = convert_state_dict(timm_s12.state_dict())
    assert sd['blocks.0.norm1.alpha'].shape == (384,)
    assert sd['blocks.3.cross_patch.weight'].shape == (196, 196)
    assert 'blocks.11.mlp.fc2.bias' in sd and 'blocks.0.ls2' in sd and 'patch_embed.proj.weight' in sd
    assert torch.equal(sd['blocks.5.ls1'], timm_s12.blocks[5].ls1)


def test_wrong_size_state_dict_raises_user_error():
    s24 = meta_model('resmlp_s24')
    s12 = meta_model('resmlp_s12')
    sd24 = {k: torch.empty(v.shape) for k, v in s24.state_dict().items()}
    with pytest.raises(UserError, match=r'unexpected \(blocks\.12\.') as info:
        load_pretrained(s12, sd24)
    assert '144 unexpected' in str(info.value)  # 12 blocks x 12 tensors and '\n' not in str(info.value)

    small, other = tiny(), tiny(dim=48)
    with pytest.raises(UserError, match='shape-mismatched') as info:
        load_pretrained(small, other.state_dict())
    assert 'patch_embed.proj.weight: [48,3,4,4] vs model [32,3,4,4]' in str(info.value)

    sd = small.state_dict()
    del sd['head.weight']
    with pytest.raises(UserError, match=r'1 missing \(head\.weight\)'):
        load_pretrained(tiny(), sd)
    report = load_pretrained(tiny(), sd, strict=False)
    assert report.missing == ['head.weight']


def test_load_dino_style_checkpoint_backbone_only():
    src = randomize(tiny(num_classes=0))
    ckpt = {'teacher': {**{f'backbone.{k}': v for k, v in src.state_dict().items()},
                        'head.mlp.0.weight': torch.zeros(8, 32)},
            'student': {}}
    dst = tiny(num_classes=7)
    from resmlp.models.load import unwrap
    load_pretrained(dst, unwrap(ckpt)[0], ignore_head=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert_close(dst.forward_head(dst.forward_features(x), pre_logits=True), src(x))


# ---------------------------------------------------------------------------------------
# patch-grid adaptation
# ---------------------------------------------------------------------------------------

def test_grid_adapt_none_raises_with_both_sizes():
    m = tiny()
    with pytest.raises(ValueError, match=r'input grid 4x4 .* 8x8 patch grid; set grid_adapt=interpolate or subgrid'):
        m(torch.randn(1, 3, 16, 16))


@pytest.mark.parametrize('mode', ['interpolate', 'subgrid'])
def test_grid_adapt_forward_and_gradients(mode):
    m = randomize(tiny(num_classes=0, grid_adapt=mode))
    x = torch.randn(2, 3, 16, 16)
    assert m.forward_features(x).shape == (2, 16, 32)
    m(x).square().sum().backward()
    for blk in m.blocks:
        g = blk.cross_patch.weight.grad
        assert g is not None and g.abs().sum() > 0 and blk.cross_patch.bias.grad.abs().sum() > 0
    if mode == 'subgrid':  # only the centered 4x4 rows/columns get gradient
        g = m.blocks[0].cross_patch.weight.grad.reshape(8, 8, 8, 8)
        assert g[2:6, 2:6, 2:6, 2:6].abs().sum() > 0
        assert g[0].abs().sum() == 0 and g[:, :, :, 7].abs().sum() == 0


def test_grid_adapt_on_built_grid_is_identity():
    x = torch.randn(2, 3, 32, 32)
    ref = randomize(tiny()).eval()
    with torch.no_grad():
        want = ref(x)
        for mode in ('interpolate', 'subgrid'):
            ref.grid_adapt = mode
            assert torch.equal(ref(x), want)
    w, b = torch.randn(64, 64), torch.randn(64)
    for mode in ('interpolate', 'subgrid'):
        w2, b2 = adapt_token_mixing(w, b, (8, 8), (8, 8), mode)
        assert torch.equal(w2, w) and torch.equal(b2, b)
    # the resampling itself (not only the shortcut) is the identity at equal size
    assert_close(M.resmlp._resample_token_axis(w, (8, 8), (8, 8)), w, 1e-6)


def test_subgrid_picks_centered_block():
    w = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)
    b = torch.arange(64, dtype=torch.float32)
    w2, b2 = adapt_token_mixing(w, b, (8, 8), (4, 4), 'subgrid')
    idx = torch.tensor([r * 8 + c for r in range(2, 6) for c in range(2, 6)])
    assert torch.equal(w2, w[idx][:, idx]) and torch.equal(b2, b[idx])
    with pytest.raises(ValueError, match='no larger'):
        adapt_token_mixing(w, b, (8, 8), (10, 10), 'subgrid')


def test_resampling_matrix_matches_interpolate():
    # the adapted weights are built as R @ A @ R^T (compile-friendly); R must be exactly
    # the antialiased bicubic resampling
    t = torch.randn(5, 64)
    direct = torch.nn.functional.interpolate(
        t.reshape(5, 1, 8, 8), size=(3, 5), mode='bicubic', align_corners=False, antialias=True)
    assert_close(M.resmlp._resample_token_axis(t, (8, 8), (3, 5)), direct.reshape(5, 15), 1e-6)
    w, b = torch.randn(64, 64), torch.randn(64)
    w2, b2 = adapt_token_mixing(w, b, (8, 8), (4, 4), 'interpolate')
    rows = torch.nn.functional.interpolate(w.reshape(64, 1, 8, 8), size=(4, 4), mode='bicubic',
                                           antialias=True).reshape(64, 16)
    both = torch.nn.functional.interpolate(rows.t().reshape(16, 1, 8, 8), size=(4, 4), mode='bicubic',
                                           antialias=True).reshape(16, 16).t()
    assert_close(w2, both * 4, 1e-5)


def test_interpolate_keeps_row_sums():
    w = torch.full((64, 64), 0.3)
    b = torch.full((64,), 0.7)
    for dst in [(4, 4), (3, 5), (12, 12)]:
        w2, b2 = adapt_token_mixing(w, b, (8, 8), dst, 'interpolate')
        n = dst[0] * dst[1]
        assert w2.shape == (n, n) and b2.shape == (n,)
        assert_close(w2.sum(1), torch.full((n,), 0.3 * 64), 1e-5)
        assert_close(b2, torch.full((n,), 0.7), 1e-5)
    # a smooth A keeps its row sums approximately too
    yy, xx = torch.meshgrid(torch.arange(8.), torch.arange(8.), indexing='ij')
    smooth = torch.outer(torch.ones(64), (torch.sin(yy / 3) + torch.cos(xx / 4)).reshape(-1))
    w2, _ = adapt_token_mixing(smooth, b, (8, 8), (4, 4), 'interpolate')
    assert abs(w2.sum(1).mean() / smooth.sum(1).mean() - 1) < 0.05


def test_grid_adapt_runtime_switch_and_larger_grid():
    m = randomize(tiny(num_classes=0, pooling='class_mlp'))
    assert m.grid_adapt == 'none'
    m.grid_adapt = 'interpolate'
    assert all(b.cross_patch.grid_adapt == 'interpolate' for b in m.blocks)
    assert all(layer.grid_adapt == 'interpolate' for layer in m.pool.layers)
    assert m(torch.randn(2, 3, 16, 16)).shape == (2, 32)
    assert m(torch.randn(2, 3, 48, 40)).shape == (2, 32)  # larger, non-square grid
    m.grid_adapt = 'subgrid'
    assert m(torch.randn(2, 3, 24, 16)).shape == (2, 32)
    with pytest.raises(UserError, match='interpolate'):
        m.grid_adapt = 'crop'


def test_other_grids_for_cross_patch_variants():
    x = torch.randn(1, 3, 16, 16)
    for kind in ('conv3x3', 'dwconv3x3', 'dwsep3x3', 'none'):
        assert tiny(cross_patch=kind, num_classes=0)(x).shape == (1, 32)
    with pytest.raises(ValueError, match='cross_patch=mlp'):
        tiny(cross_patch='mlp', grid_adapt='interpolate')(x)


# ---------------------------------------------------------------------------------------
# ablation variants
# ---------------------------------------------------------------------------------------

VARIANTS = ([{'cross_patch': c} for c in M.CROSS_PATCHES]
            + [{'norm': 'layernorm'}, {'pooling': 'class_mlp'},
               {'pooling': 'class_mlp', 'norm': 'layernorm', 'cross_patch': 'dwsep3x3'}])


@pytest.mark.parametrize('kw', VARIANTS, ids=lambda kw: '-'.join(kw.values()))
def test_variants_forward_backward(kw):
    # randomized: with equal LayerScale values a LayerNorm cancels the class-MLP mixing
    # bias exactly (it shifts all channels alike), which would read as a dead parameter
    m = randomize(tiny(num_classes=5, drop_path_rate=0.1, **kw))
    out = m(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 5)
    out.logsumexp(1).sum().backward()
    no_grad = [n for n, p in m.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert no_grad == []


# ---------------------------------------------------------------------------------------
# inference folding
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize('kw', VARIANTS + [{'num_classes': 0}], ids=lambda kw: '-'.join(map(str, kw.values())))
def test_fold_affine_is_exact_and_smaller(kw):
    m = randomize(tiny(**{'num_classes': 6, **kw})).eval()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    f = fold_affine(m)
    assert not f.training and f.folded
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert_close(f(x), m(x))
    assert n_params(f) < n_params(m)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())  # original intact
    if kw.get('cross_patch', 'linear') == 'linear' and kw.get('pooling', 'avg') == 'avg' \
            and kw.get('norm', 'affine') == 'affine' and kw.get('num_classes', 6):
        assert not any(isinstance(mod, Affine) for mod in f.modules())
        # 3 channel vectors per block (norm2 + ls2) and the final Aff go away
        assert n_params(m) - n_params(f) == 2 * 3 * 32 + 2 * 32
    with pytest.raises(ValueError):
        f.pooled_block_features(x, 1)


def test_fold_affine_keeps_grid_adaptation():
    m = randomize(tiny(grid_adapt='interpolate')).eval()
    f = fold_affine(m)
    x = torch.randn(2, 3, 16, 24)
    with torch.no_grad():
        assert_close(f(x), m(x))


def test_fold_affine_s12_full_size(timm_s12):
    m = create_model('resmlp_s12').eval()
    load_pretrained(m, timm_s12.state_dict())
    f = fold_affine(m)
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        assert_close(f(x), m(x))
    assert n_params(m) - n_params(f) == 12 * 3 * 384 + 2 * 384
