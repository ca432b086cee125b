"""DINO's multi-crop: which views each image gives (the crop plan) and where they are made.

ResMLP's cross-patch layer is patches x patches, so a local crop with fewer patches cannot
pass through it unchanged; `dino.local_crops` picks what the plan does about it, and the
plan tells the model side what that asks of it (`CropPlan.grid_adapt`, the ResMLP's
`grid_adapt`):

    resize       local crops cut at the local scale, resized to the global size
    interpolate  local crops at data.local_size; the model resamples its cross-patch weights
    subgrid      local crops at data.local_size; the model takes the centred sub-block of them
    none         no local crops; the two global crops at `none_global_crops_scale`

The trainer computes the plan once and hands it to the networks (resmlp.ssl.networks),
the step and the views; the benchmark and `run.sh data data.preview=N` do the same.
With `dino.augment=device` the trainer's data path is, in short:

    plan = crop_plan(cfg)
    path = dino_path(cfg, device, scaler_enabled=False)   # the step's: compiled how, graphed or not
    views = build_views(cfg, plan, out_dtype=torch.bfloat16, device=device, path=path)
    loader, sampler = build_train_loader(dataset, views.transform, batch_per_rank, cfg.seed, workers,
                                         pin_memory=True, keyed=views.keyed, collate_fn=views.collate)
    for batch in loader:  # SourceBatch: images (B, 3, H, W) padded, sizes (B, 2), keys, ...
        crops = views.to_device(batch, device)
        # = GpuMultiCrop(batch.decode_on(device), cfg.seed, batch.keys, batch.sizes)

The keys (the sampler's epoch * N + index) make a sample's crops depend only on (seed,
epoch, index): the same for any number of processes, batch composition and resume.
`out_dtype=torch.bfloat16` halves the crops' memory (the step's first layer would cast
them anyway).

`build_views` turns a plan into the data path the trainer (and the benchmark and
`run.sh data data.preview=N`) runs: with `dino.augment=device` the loader workers only
decode each whole image (resmlp.data.decode; with `data.decode=gpu` JPEGs are decoded on
the GPU) and GpuMultiCrop makes every view of the batch on the device; with `workers`
each image's views are made in the loader workers (torchvision, PIL) and only copied over.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from resmlp.core.compiling import StepPath
from resmlp.core.errors import UserError


@dataclass(frozen=True)
class CropPlan:
    global_size: int
    local_size: int
    n_local: int
    global_scale: tuple[float, float]
    local_scale: tuple[float, float]
    strategy: str        # dino.local_crops, for messages and reports
    grid_adapt: str      # what the backbone does with a smaller patch grid (ResMLP.grid_adapt)

    @property
    def n_crops(self) -> int:
        return 2 + self.n_local

    @property
    def sizes(self) -> list[int]:
        return [self.global_size] * 2 + [self.local_size] * self.n_local

    def label(self) -> str:
        """'2x224+8x96': the views of one image."""
        return f"2x{self.global_size}" + (f"+{self.n_local}x{self.local_size}" if self.n_local else "")


def crop_plan(cfg) -> CropPlan:
    """The views of each image for the config's strategy, checked against the model."""
    d = cfg.dino
    g = int(cfg.data.img_size)
    local, n_local = int(cfg.data.local_size), int(d.n_local_crops)
    global_scale = tuple(d.global_crops_scale)
    if d.local_crops == "resize":
        local = g
    elif d.local_crops == "none":
        n_local, global_scale = 0, tuple(d.none_global_crops_scale)
    if n_local and local > g:
        raise UserError(f"data.local_size={local} is larger than data.img_size={g}: local crops are the small "
                        f"views; set data.local_size to at most {g} (or dino.n_local_crops=0)")
    if n_local and local % cfg.model.patch_size:
        raise UserError(f"data.local_size={local} is not a multiple of model.patch_size={cfg.model.patch_size}")
    grid_adapt = d.local_crops if d.local_crops in ("interpolate", "subgrid") else "none"
    return CropPlan(g, local, n_local, global_scale, tuple(d.local_crops_scale), d.local_crops, grid_adapt)


@dataclass
class DinoViews:
    """The data path of a plan: `transform` runs per image in the loader workers and
    `collate` makes their batch (None: torch's default); `to_device(batch)` turns a
    loader batch into the list of crops on the device."""
    plan: CropPlan
    transform: object
    batch_augment: object | None   # GpuMultiCrop when the views are made on the device
    seed: int
    collate: object = None

    @property
    def keyed(self) -> bool:
        """The loader must hand out sample keys (the device augmentation draws by them)."""
        return self.batch_augment is not None

    def to_device(self, batch, device: torch.device) -> list[torch.Tensor]:
        if self.batch_augment is None:
            return [c.to(device, non_blocking=True) for c in batch[0]]
        return self.batch_augment(*self._device_args(batch, device))

    def draw(self, batch, device: torch.device) -> tuple[list[torch.Tensor], list[dict]]:
        """(crops, what was drawn for each view): to_device's crops with their boxes,
        flips and photometric ops (GpuMultiCrop.draw), for `run.sh data data.preview=N`."""
        if self.batch_augment is None:
            raise UserError("the crop parameters are drawn on the device path only (dino.augment=device)")
        args = self._device_args(batch, device)
        return self.batch_augment(*args), self.batch_augment.draw(*args)

    def _device_args(self, batch, device):
        return (batch.decode_on(device), self.seed, batch.keys.to(device, non_blocking=True),
                batch.sizes.to(device, non_blocking=True))


def build_views(cfg, plan: CropPlan, out_dtype: torch.dtype = torch.float32, device: torch.device | None = None,
                path: StepPath | None = None, on_compile_error=None) -> DinoViews:
    """The trainer's data path for `plan`. On the device the crops come in `out_dtype`
    (the step's autocast dtype: its first layer would cast them anyway), and the
    augmentation is compiled when the step is: `path`, the step's (ssl.step.dino_path; None:
    eager); `on_compile_error`: GpuMultiCrop's. `device`: where the views go (data.decode=gpu
    needs a CUDA one)."""
    from resmlp.data.datasets import dataset_info
    decode = cfg.data.decode
    if decode == "gpu" and not dataset_info(cfg.data).files:
        raise UserError(f"data.decode=gpu decodes image files on the GPU, and data={cfg.data.name} holds its images "
                        "decoded in memory: nothing would be decoded there; use data.decode=cpu")
    if cfg.dino.augment == "device":
        from resmlp.data.decode import SourceDecoder, collate_sources, source_side
        from resmlp.data.gpu_augment import GpuMultiCrop
        if decode == "gpu" and (device is None or torch.device(device).type != "cuda"):
            raise UserError("data.decode=gpu decodes JPEGs with CUDA and this run has no CUDA device; "
                            "use data.decode=cpu")
        compiled = path is not None and path.compile is not None
        augment = GpuMultiCrop.from_plan(plan, cfg.data, compile=compiled, out_dtype=out_dtype,
                                         on_compile_error=on_compile_error)
        transform = SourceDecoder(source_side(cfg.data), defer_jpeg=decode == "gpu")
        return DinoViews(plan, transform, augment, int(cfg.seed), collate_sources)
    if decode == "gpu":
        raise UserError("data.decode=gpu feeds the device augmentation: it needs dino.augment=device")
    from resmlp.data import build_multicrop_transform
    transform = build_multicrop_transform(cfg.data, plan.global_size, plan.local_size, plan.n_local,
                                          plan.global_scale, plan.local_scale)
    return DinoViews(plan, transform, None, int(cfg.seed))
