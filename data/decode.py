"""Fast decoding in the loader workers: file bytes -> uint8 tensors, shrunk only where
enough detail is left.

File datasets (image folders) normally yield decoded PIL images. A transform that says
`reads_files = True` gets the file's bytes instead (imagefolder.serve_encoded, an `EncodedImage`)
and decodes them itself, with libjpeg-turbo (torchvision.io.decode_jpeg: no PIL image,
no colour conversion pass) or, for large JPEGs, PIL's draft mode (libjpeg scales the
DCT by 1/2, 1/4 or 1/8 while decoding, so a 12-megapixel photo costs little more than a
small one). In-memory datasets (Fashion-MNIST, CIFAR, STL-10) still yield PIL images;
every transform here takes both.

`decode_rgb(item, min_short, max_long)` is the one rule: the image as a uint8 (3, h, w)
tensor, reduced at decode time only while its short side stays >= min_short, and then,
if its long side is still above max_long, resized (antialiased bicubic) to fit. It also
returns the file's own (height, width), so a box on the decoded image can be mapped
back to the file's pixels.

Two users:
- the DINO device path: `SourceDecoder` (one image -> `Source`) and `collate_sources`
  (a batch -> `SourceBatch`: the images top-left in one zero-padded uint8 tensor, with
  each image's valid height and width, so GpuMultiCrop crops every image whole);
  with `defer_jpeg=True` (data.decode=gpu) JPEGs stay encoded and `SourceBatch.decode_on`
  decodes them batched on the GPU;
- evaluation transforms (`Decoded`): decode, then the usual torchvision v2 transform on
  the uint8 tensor instead of a PIL image (its resize is several times faster there).
"""
from __future__ import annotations

import functools
import io
import math
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image

from resmlp.core.errors import UserError
from resmlp.data.images import to_rgb

# Padded batches are rounded up to this many pixels per side, so that the device sees
# a handful of distinct shapes rather than one per batch.
PAD_MULTIPLE = 32
# What libjpeg decodes (PIL names a camera's multi-picture JPEG "MPO"; its first picture
# is the photo, which both decoders return).
JPEG_FORMATS = ("JPEG", "MPO")


class EncodedImage:
    """An image file's bytes, as a file dataset yields them to a transform that reads files."""
    __slots__ = ("path", "data")

    def __init__(self, path: str, data: bytes):
        self.path, self.data = path, data

    def __repr__(self) -> str:
        return f"EncodedImage({self.path!r}, {len(self.data)} bytes)"


def read_encoded(path: str) -> EncodedImage:
    try:
        with open(path, "rb") as f:
            return EncodedImage(path, f.read())
    except OSError as e:
        raise _unreadable(path, e) from e


def _unreadable(path: str, e: Exception) -> UserError:
    text = " ".join(str(e).split())
    return UserError(f"cannot read image {path} ({type(e).__name__}: {text}); replace or delete it, "
                     f"or set data.skip_corrupt=true to skip unreadable images")


def reads_files(transform) -> bool:
    return bool(getattr(transform, "reads_files", False))


# --------------------------------------------------------------------------- decoding

def source_side(data_cfg) -> int:
    """data.source_side, or its default: twice the eval resize (512 at img_size 224)."""
    side = data_cfg.source_side  # its values: the limit in configs/defaults.yaml
    if side is None:
        return 2 * int(round(int(data_cfg.img_size) / 0.875))
    return side


def _pil_to_tensor(img: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.array(to_rgb(img), dtype=np.uint8, copy=True)).permute(2, 0, 1)


def _fit(x: torch.Tensor, max_long: int | None) -> torch.Tensor:
    h, w = x.shape[-2:]
    if max_long is None or max(h, w) <= max_long:
        return x
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as F
    f = max_long / max(h, w)
    size = [max(1, min(max_long, round(h * f))), max(1, min(max_long, round(w * f)))]
    return F.resize(x, size, interpolation=InterpolationMode.BICUBIC, antialias=True)


def _draft_request(width: int, height: int, min_short: int | None):
    """The size to ask PIL's draft for (the result is at least that big), or None when no
    power-of-two reduction keeps the short side >= min_short."""
    if not min_short:
        return None
    short = min(width, height)
    if short < 2 * min_short:
        return None
    f = min_short / short
    return (max(1, math.ceil(width * f)), max(1, math.ceil(height * f)))


@functools.lru_cache(maxsize=None)
def _tv_decode_jpeg():
    """(torchvision.io.decode_jpeg, its RGB mode), or None where torchvision has no image
    codecs (it deprecates them in favour of TorchCodec): PIL then decodes, with the same
    libjpeg-turbo and the same pixels, a little slower."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError:
        return None
    return decode_jpeg, ImageReadMode.RGB


def _as_stored(width: int, height: int, min_short: int | None, max_long: int | None) -> bool:
    """decode_rgb(item, min_short, max_long) gives a JPEG of this size at its own size: no
    reduction while decoding, no resize after."""
    return _draft_request(width, height, min_short) is None and (max_long is None or max(width, height) <= max_long)


def jpeg_header(data: bytes):
    """The opened (not decoded) PIL image of `data`; raises what PIL raises on garbage."""
    return Image.open(io.BytesIO(data))


def decode_rgb(item, min_short: int | None = None, max_long: int | None = None):
    """(uint8 (3, h, w) RGB tensor, (file height, file width)) of a PIL image or an
    EncodedImage; see the module doc for min_short and max_long."""
    if isinstance(item, Image.Image):
        x = _pil_to_tensor(item)
        return _fit(x, max_long), (int(x.shape[1]), int(x.shape[2]))
    if not isinstance(item, EncodedImage):
        raise TypeError(f"decode_rgb takes a PIL image or an EncodedImage, not {type(item).__name__}")
    try:
        im = jpeg_header(item.data)
        width, height = im.size
        jpeg = im.format in JPEG_FORMATS
        request = _draft_request(width, height, min_short) if jpeg else None
        if jpeg and request is None and _tv_decode_jpeg() is not None:
            im.close()
            decode_jpeg, rgb = _tv_decode_jpeg()
            x = decode_jpeg(torch.frombuffer(bytearray(item.data), dtype=torch.uint8), mode=rgb)
        else:
            with im:
                if request is not None:
                    im.draft("RGB", request)
                im.load()  # a truncated file fails here
                x = _pil_to_tensor(im)
    except UserError:
        raise
    except Exception as e:  # PIL and libjpeg raise OSError, RuntimeError, SyntaxError, ...
        raise _unreadable(item.path, e) from e
    return _fit(x, max_long), (height, width)


class Decoded:
    """A torchvision v2 transform run on the fast-decoded uint8 tensor instead of a PIL
    image (torchvision's tensor resize is much cheaper than PIL's). `min_short`: the
    decode may shrink a large JPEG while its short side stays at least this."""
    reads_files = True

    def __init__(self, transform, min_short: int | None = None):
        self.transform, self.min_short = transform, min_short

    @property
    def transforms(self):
        return getattr(self.transform, "transforms", [self.transform])

    def __call__(self, item):
        return self.transform(decode_rgb(item, self.min_short)[0])

    def __repr__(self) -> str:
        return f"Decoded(min_short={self.min_short}, {self.transform!r})"


# --------------------------------------------------------------------------- DINO sources

class Source(NamedTuple):
    """One image as the device path's loader delivers it: decoded pixels (3, h, w), or
    with data.decode=gpu the JPEG's bytes (decoded on the device); (h, w) of the image
    the crops are cut from; (height, width) of the file."""
    pixels: torch.Tensor | None
    jpeg: torch.Tensor | None
    size: tuple
    file_size: tuple


class SourceDecoder:
    """Loader-side transform of the DINO device path: the whole image, decoded at most
    `side` px on its long side (a larger one keeps a short side of at least side / 2
    unless it is more elongated than 2:1), never cropped."""
    reads_files = True

    def __init__(self, side: int, defer_jpeg: bool = False):
        if int(side) < 2:
            raise UserError(f"the source side must be >= 2 px, got {side}")
        self.side, self.defer_jpeg = int(side), bool(defer_jpeg)

    def __call__(self, item) -> Source:
        if self.defer_jpeg and isinstance(item, EncodedImage):
            deferred = self._deferred(item)
            if deferred is not None:
                return deferred
        x, file_size = decode_rgb(item, self.side // 2, self.side)
        return Source(x, None, (int(x.shape[1]), int(x.shape[2])), file_size)

    def _deferred(self, item: EncodedImage) -> Source | None:
        """The bytes alone, for JPEGs the GPU decoder takes as they are: baseline colour
        JPEGs that the CPU path would decode at their own size too (no reduction, no
        resize: the two paths give images of one size). Anything else is decoded here."""
        try:
            with jpeg_header(item.data) as im:
                width, height = im.size
                plain = (im.format == "JPEG" and im.mode == "RGB" and not im.info.get("progressive")
                         and not im.info.get("progression") and _as_stored(width, height, self.side // 2, self.side))
        except Exception:  # noqa: BLE001 - decode_rgb names the file
            return None
        if not plain:
            return None
        return Source(None, torch.frombuffer(bytearray(item.data), dtype=torch.uint8), (height, width),
                      (height, width))

    def __repr__(self) -> str:
        return f"SourceDecoder(side={self.side}{', JPEGs decoded on the device' if self.defer_jpeg else ''})"


class SourceBatch(NamedTuple):
    """A batch of the DINO device path. images: uint8 (k, 3, H, W) (channels-last memory),
    the images decoded in the workers top-left on zeros, k = B unless some JPEGs wait for the device (then
    pixel_slots says which batch positions they are); sizes: int64 (B, 2) valid (h, w);
    file_sizes: int64 (B, 2) the files' (height, width); labels, keys: (B,); jpegs /
    jpeg_slots: the JPEGs to decode on the device and their batch positions."""
    images: torch.Tensor
    sizes: torch.Tensor
    file_sizes: torch.Tensor
    labels: torch.Tensor
    keys: torch.Tensor
    pixel_slots: list
    jpegs: list
    jpeg_slots: list

    def decode_on(self, device: torch.device) -> torch.Tensor:
        """uint8 (B, 3, H, W) on `device`: the worker-decoded images copied over and the
        waiting JPEGs decoded there (torchvision.io.decode_jpeg, one batched call)."""
        if not self.jpegs:
            return self.images.to(device, non_blocking=True)
        from torchvision.io import ImageReadMode, decode_jpeg
        n, (h, w) = len(self.pixel_slots) + len(self.jpegs), self.images.shape[-2:]
        out = torch.zeros(n, 3, h, w, dtype=torch.uint8, device=device)
        if self.pixel_slots:
            pixels = self.images.to(device, non_blocking=True)
            for row, slot in enumerate(self.pixel_slots):
                out[slot].copy_(pixels[row])
        decoded = decode_jpeg(self.jpegs, mode=ImageReadMode.RGB, device=device)
        for slot, img in zip(self.jpeg_slots, decoded):
            out[slot, :, :img.shape[1], :img.shape[2]].copy_(img)
        return out


def _padded(n: int) -> int:
    return max(PAD_MULTIPLE, -(-n // PAD_MULTIPLE) * PAD_MULTIPLE)


def collate_sources(samples) -> SourceBatch:
    """[(Source, label, key)] -> SourceBatch (runs in the loader workers).

    The batch is held channels-last ((k, H, W, 3) memory, seen as (k, 3, H, W)): both
    decoders hand out pixels that way, so each image goes in with a plain copy (into
    channels-first memory it would be a transposing copy, several times slower), and
    only the padding is zeroed, so every byte is written once."""
    sources = [s[0] for s in samples]
    if not all(isinstance(s, Source) for s in sources):
        raise TypeError("collate_sources takes (Source, label, key) samples (SourceDecoder's output)")
    sizes = torch.tensor([s.size for s in sources], dtype=torch.int64)
    H, W = _padded(int(sizes[:, 0].max())), _padded(int(sizes[:, 1].max()))
    pixel_slots = [i for i, s in enumerate(sources) if s.pixels is not None]
    hwc = torch.empty(len(pixel_slots), H, W, 3, dtype=torch.uint8)
    for row, i in enumerate(pixel_slots):
        x = sources[i].pixels
        h, w = x.shape[1:]
        hwc[row, :h, :w] = x.permute(1, 2, 0)
        hwc[row, :h, w:] = 0
        hwc[row, h:] = 0
    jpeg_slots = [i for i, s in enumerate(sources) if s.pixels is None]
    return SourceBatch(hwc.permute(0, 3, 1, 2), sizes,
                       torch.tensor([s.file_size for s in sources], dtype=torch.int64),
                       torch.tensor([int(s[1]) for s in samples], dtype=torch.int64),
                       torch.tensor([int(s[2]) for s in samples], dtype=torch.int64),
                       pixel_slots, [sources[i].jpeg for i in jpeg_slots], jpeg_slots)
