"""The probe and the one-off interventions of docs/dino_learning.md.

    python studies/dino_learning_probe.py [key=value ...]   # = bash run.sh dino resmlp_s12 [...]

runs the normal trainer and, every PROBE_EVERY (25) iterations, writes one line of
<out>/probe.jsonl about the teacher's head on that iteration's global crops: for the
pooled features and for each linear layer of the head, the size of the part that
depends on the image (`dev`: mean distance to the batch mean) against the part that
does not (`mean`: norm of the batch mean) and the layer's bias; the pairwise cosine of
the bottleneck outputs, the cosine of their mean with the head's output for an all-zero
input, how many prototypes are some crop's argmax, how often both global crops of an
image pick the same one, and the participation ratio (effective number of directions)
of the centered features and bottleneck outputs. The probe only reads: the training
itself is the command's.

Interventions for the study, by environment variable (none is a project option), made
through the trainer's extension points (resmlp.ssl.networks.DinoHooks):
    HEAD_NOBIAS=1         the head's linear biases stay at zero (not trained)
    HEAD_INIT=lecun       the head's linear weights drawn with std 1/sqrt(fan_in), not 0.02
    FEAT_SCALE=c          the pooled features multiplied by c before the head
    FEAT_BN=1             the pooled features batch-normalized (no affine) before the head
    BOTTLENECK_CENTER=1   the batch mean subtracted from the head's bottleneck output
    BOTTLENECK_BN=1       torch's BatchNorm1d (no affine) on the bottleneck output
    BACKBONE=<timm name>  a timm model as backbone (its 16 px local crops go through as they are)
    BACKBONE_NORM=gn      ... with GroupNorm(1 group) in place of its BatchNorm
    NO_PHOTOMETRIC=1      the device augmentation without color jitter and solarization
    POOLING=class_mlp     the ResMLP's pooling (a builder option the model: section lacks)
    WHITEN=a              the standardized bottleneck also decorrelated over the batch (Cholesky
                          whitening of its correlation matrix shrunk toward the identity by a)
DINOv2's KoLeo term, once the switch KOLEO=w, is the option dino.koleo_weight=w.
"""
import json
import math
import os
import sys
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from resmlp.ssl.networks import DinoHooks

EVERY = int(os.environ.get("PROBE_EVERY", "25"))


def pair_cos(v: torch.Tensor) -> float:
    v = F.normalize(v.float(), dim=-1)
    n = v.shape[0]
    return ((v @ v.t()).sum() - n).item() / (n * (n - 1))


def participation_ratio(v: torch.Tensor) -> float:
    s = torch.linalg.svdvals((v - v.mean(0)).double()) ** 2
    return (s.sum() ** 2 / (s ** 2).sum()).item()


def spread(v: torch.Tensor) -> dict:
    m = v.mean(0)
    return {"mean_norm": m.norm().item(), "dev_norm": (v - m).norm(dim=-1).mean().item(),
            "norm": v.norm(dim=-1).mean().item(), "cos": pair_cos(v)}


class Scale(nn.Module):
    def __init__(self, c: float):
        super().__init__()
        self.c = c

    def forward(self, x):
        return x * self.c


class Center(nn.Module):
    def forward(self, x):
        return x - x.mean(0, keepdim=True)


class Whiten(nn.Module):
    """After BatchStandardize: z -> z L^-T with L L^T = (1 - a) corr(z) + a I (one process)."""

    def __init__(self, a: float):
        super().__init__()
        self.a = a

    def forward(self, z):
        c = (z.t() @ z) / z.shape[0]
        c = (1 - self.a) * c + self.a * torch.eye(c.shape[0], dtype=c.dtype, device=c.device)
        return torch.linalg.solve_triangular(torch.linalg.cholesky(c), z.t(), upper=False).t()


def edit_head(head, dino_cfg):
    in_dim = head.layers[0].in_features
    linears = [m for m in head.layers if isinstance(m, nn.Linear)]
    if os.environ.get("HEAD_INIT") == "lecun":
        for m in linears:
            std = 1 / math.sqrt(m.in_features)
            nn.init.trunc_normal_(m.weight, std=std, a=-2 * std, b=2 * std)
    if os.environ.get("HEAD_NOBIAS"):
        for m in linears:
            m.bias.requires_grad_(False)
    before = []
    if os.environ.get("FEAT_BN"):
        before.append(nn.BatchNorm1d(in_dim, affine=False))
    if os.environ.get("FEAT_SCALE"):
        before.append(Scale(float(os.environ["FEAT_SCALE"])))
    after = []
    if os.environ.get("BOTTLENECK_CENTER"):
        after.append(Center())
    if os.environ.get("BOTTLENECK_BN"):
        after.append(nn.BatchNorm1d(dino_cfg.bottleneck_dim, affine=False))
    if os.environ.get("WHITEN"):
        after.append(Whiten(float(os.environ["WHITEN"])))
    if before or after:
        head.layers = nn.Sequential(*before, *head.layers, *after)
    return head


def build_backbone(model_cfg):
    name = os.environ.get("BACKBONE")
    if not name:
        from resmlp.models import create_model
        from resmlp.models.from_config import model_kwargs
        return create_model(model_cfg.name, num_classes=0, **model_kwargs(model_cfg), pooling=os.environ["POOLING"])
    import timm
    kwargs = {}
    if os.environ.get("BACKBONE_NORM") == "gn":
        from timm.layers import GroupNorm1
        kwargs["norm_layer"] = GroupNorm1
    model = timm.create_model(name, num_classes=0, **kwargs)
    model.grid_adapt = "none"  # the trainer asks for the attribute; a convnet takes any crop size
    return model


def without_photometric(views, cfg):
    from resmlp.data.gpu_augment import GpuMultiCrop
    if views.batch_augment is None:
        sys.exit("NO_PHOTOMETRIC=1 changes the device augmentation: it needs dino.augment=device")
    views.batch_augment = GpuMultiCrop.from_plan(views.plan, cfg.data, compile=views.batch_augment.compiled,
                                                 out_dtype=views.batch_augment.out_dtype,
                                                 jitter_prob=0.0, solarize_prob=0.0)


def probe(step, cfg):
    teacher, head = step.teacher, step.teacher.head
    path = os.path.join(str(cfg.out), "probe.jsonl")
    state = {"calls": 0, "x": None, "busy": False}

    def on_backbone(module, inputs, output):
        state["x"] = output.detach()

    @torch.no_grad()
    def on_head(module, inputs, output):
        if state["busy"]:  # the probe's own call of the head below
            return
        state["calls"] += 1
        if (state["calls"] - 1) % EVERY:
            return
        state["busy"] = True
        x = state["x"].float()
        layers = head.layers
        linears = [m for m in layers if isinstance(m, nn.Linear)]
        rec = {"it": state["calls"] - 1, "x": spread(x)}
        h = x
        for m in layers:
            inp, h = h, m(h)
            if isinstance(m, nn.Linear):
                w_part = inp @ m.weight.t()
                rec[f"lin{linears.index(m)}"] = {
                    "out": spread(h), "w_dev": (w_part - w_part.mean(0)).norm(dim=-1).mean().item(),
                    "w_mean": w_part.mean(0).norm().item(),
                    "bias": m.bias.norm().item() if m.bias is not None else 0.0, "W": m.weight.norm().item()}
        z = h
        was = layers.training
        layers.eval()
        zero = layers(torch.zeros(2, x.shape[1]))[:1]
        layers.train(was)
        state["busy"] = False
        rec["z_cos_zero_input"] = F.cosine_similarity(z.mean(0, keepdim=True), zero).item()
        rec["zn_cos"] = pair_cos(z)
        rec["x_pr"], rec["z_pr"] = participation_ratio(x), participation_ratio(z)
        t = head.last_layer(F.normalize(z, dim=-1)) - step.loss_fn.center.reshape(1, -1)
        a, b = t.chunk(2)
        rec["agree"] = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        rec["distinct"] = len(set(t.argmax(-1).tolist()))
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    teacher.backbone.register_forward_hook(on_backbone)
    head.layers.register_forward_hook(on_head)


def hooks() -> DinoHooks:
    env = os.environ
    head_switches = ("HEAD_INIT", "HEAD_NOBIAS", "FEAT_BN", "FEAT_SCALE", "BOTTLENECK_CENTER", "BOTTLENECK_BN",
                     "WHITEN")
    return DinoHooks(backbone=build_backbone if env.get("BACKBONE") or env.get("POOLING") else None,
                     head=edit_head if any(env.get(k) for k in head_switches) else None,
                     views=without_photometric if env.get("NO_PHOTOMETRIC") else None,
                     step=probe)


if __name__ == "__main__":
    from resmlp.core.cli import main
    from resmlp.core.run import command
    from resmlp.ssl.train import train
    sys.exit(main(["dino", "resmlp_s12", *sys.argv[1:]], run=command(partial(train, hooks=hooks()))))
