"""Dataset for FLUX LoRA training: images + captions, aspect-ratio buckets, cached latents and conditioning.

Latents come from ComfyUI's VAE (``vae.encode(pixels)``, pixels ``[B,H,W,3]`` in 0..1) and conditioning from
ComfyUI's CLIP (``clip.tokenize`` + ``clip.encode_from_tokens(..., return_pooled=True)``), i.e. exactly what
inference sees (T5 padded to ComfyUI's 256 tokens, CLIP-L pooled). Both are cached in one safetensors file per
(dataset files + captions + buckets + encoder fingerprints); a later run with the same inputs reuses it.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
CACHE_VERSION = "fluxlora-cache-2"   # 2: the empty caption is encoded too (caption dropout)
EMPTY_CAPTION = ""


class DatasetError(ValueError):
    pass


@dataclass
class DatasetSpec:
    """What the dataset node produces (no tensors are encoded yet)."""
    folder: str | None = None
    images: torch.Tensor | None = None           # IMAGE batch [B,H,W,3] (alternative to folder)
    captions: list = field(default_factory=list)  # per image, for the IMAGE batch input
    caption_for_all: str = ""                      # used when an image has no caption (or for all with override)
    caption_prefix: str = ""                       # e.g. a trigger word
    resolution: int = 1024
    bucket_step: int = 64
    enable_buckets: bool = True
    repeats: int = 1
    cache_dir: str | None = None

    def describe(self) -> str:
        src = self.folder if self.folder else f"IMAGE batch of {0 if self.images is None else self.images.shape[0]}"
        return f"{src} @ {self.resolution}px"


@dataclass
class Item:
    key: str          # stable id (file name or batch index)
    caption: str
    bucket: tuple     # (width, height) in pixels
    digest: str       # content hash
    loader: object    # callable -> float tensor [H,W,3] in 0..1


def _read_caption(path: Path) -> str | None:
    txt = path.with_suffix(".txt")
    if txt.is_file():
        return txt.read_text(encoding="utf-8", errors="replace").strip()
    return None


def make_buckets(resolution: int, step: int = 64, max_ratio: float = 4.0):
    """kohya-style buckets: width/height multiples of ``step``, area <= resolution², aspect up to ``max_ratio``."""
    area = resolution * resolution
    out = set()
    w = step
    while w <= resolution * max_ratio ** 0.5 + 1:
        h = (area // w) // step * step
        if h >= step and max(w / h, h / w) <= max_ratio:
            out.add((w, h))
        w += step
    out.add((resolution // step * step, resolution // step * step))
    return sorted(out)


def pick_bucket(width: int, height: int, spec: DatasetSpec):
    if not spec.enable_buckets:
        r = spec.resolution // spec.bucket_step * spec.bucket_step
        return (r, r)
    ar = width / height
    return min(make_buckets(spec.resolution, spec.bucket_step), key=lambda b: abs(math.log((b[0] / b[1]) / ar)))


def resize_crop(img: torch.Tensor, bucket) -> torch.Tensor:
    """[H,W,3] float -> [bh,bw,3]: scale to cover the bucket, centre crop."""
    bw, bh = bucket
    h, w = img.shape[0], img.shape[1]
    s = max(bw / w, bh / h)
    nw, nh = max(bw, round(w * s)), max(bh, round(h * s))
    x = img.permute(2, 0, 1).unsqueeze(0)
    if (nh, nw) != (h, w):
        x = torch.nn.functional.interpolate(x, size=(nh, nw), mode="bicubic", align_corners=False,
                                            antialias=True).clamp(0, 1)
    top, left = (nh - bh) // 2, (nw - bw) // 2
    return x[0, :, top:top + bh, left:left + bw].permute(1, 2, 0).contiguous()


def _load_image_file(path: Path) -> torch.Tensor:
    from PIL import Image, ImageOps
    import numpy as np
    with Image.open(path) as im:
        im = ImageOps.exif_transpose(im).convert("RGB")
        return torch.from_numpy(np.asarray(im, dtype=np.float32) / 255.0)


def collect_items(spec: DatasetSpec) -> list[Item]:
    items: list[Item] = []
    prefix = (spec.caption_prefix.strip() + " ") if spec.caption_prefix.strip() else ""
    if spec.resolution < 64 or spec.resolution % 16:
        raise DatasetError(f"resolution {spec.resolution} is not usable. Fix: use a multiple of 16 of at least 64 "
                           "(512, 768 or 1024 for FLUX).")
    if spec.folder:
        folder = Path(spec.folder).expanduser()
        if not folder.is_dir():
            raise DatasetError(f"dataset folder {str(folder)!r} does not exist. Fix: give the path of a folder "
                               "holding the training images (absolute, or relative to ComfyUI's input folder).")
        files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_EXTS and p.is_file())
        if not files:
            raise DatasetError(f"dataset folder {str(folder)!r} holds no images ({', '.join(IMAGE_EXTS)}). "
                               "Fix: put the training images (with same-name .txt captions) in that folder.")
        from PIL import Image
        missing = []
        for p in files:
            try:
                with Image.open(p) as im:
                    im.verify()
                with Image.open(p) as im:
                    w, h = im.size
            except Exception as exc:  # noqa: BLE001
                raise DatasetError(f"image {str(p)!r} cannot be read ({type(exc).__name__}: {exc}). "
                                   "Fix: re-save it as PNG/JPEG or remove it from the folder.")
            cap = _read_caption(p)
            if cap is None or cap == "":
                if spec.caption_for_all.strip():
                    cap = spec.caption_for_all.strip()
                else:
                    missing.append(p.name)
                    continue
            digest = hashlib.sha256(p.read_bytes()).hexdigest()
            items.append(Item(p.name, prefix + cap, pick_bucket(w, h, spec), digest,
                              (lambda p=p: _load_image_file(p))))
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise DatasetError(f"{len(missing)} image(s) in {str(folder)!r} have no caption: {shown}. "
                               "Fix: add a same-name .txt file next to each image, or set 'caption for all'.")
    elif spec.images is not None:
        imgs = spec.images
        if imgs.ndim != 4 or imgs.shape[-1] not in (3, 4) or imgs.shape[0] == 0:
            raise DatasetError(f"the IMAGE input has shape {tuple(imgs.shape)}; expected [batch, height, width, 3]. "
                               "Fix: connect a Load Image / image batch node.")
        caps = [c.strip() for c in spec.captions]
        n = imgs.shape[0]
        if len(caps) not in (0, 1, n):
            raise DatasetError(f"{len(caps)} captions for {n} images. Fix: give one caption per line per image, "
                               "one caption for all, or use 'caption for all'.")
        for i in range(n):
            cap = caps[i] if len(caps) == n else (caps[0] if len(caps) == 1 else "")
            if not cap:
                cap = spec.caption_for_all.strip()
            if not cap:
                raise DatasetError(f"image {i} of the IMAGE batch has no caption. Fix: enter captions (one line per "
                                   "image) or set 'caption for all'.")
            t = imgs[i, :, :, :3].float().contiguous()
            digest = hashlib.sha256(t.numpy().tobytes()).hexdigest()
            items.append(Item(f"batch_{i:05d}", prefix + cap, pick_bucket(t.shape[1], t.shape[0], spec), digest,
                              (lambda t=t: t)))
    else:
        raise DatasetError("the dataset has neither a folder nor images. Fix: set a folder path or connect images.")
    return items


def fingerprint(obj) -> str:
    """Cheap identity of an encoder: class + a few parameter values (so a different VAE/CLIP changes the key)."""
    if obj is None:
        return "none"
    fp = getattr(obj, "cache_fingerprint", None)
    if fp is not None:
        return str(fp)
    mod = None
    for attr in ("first_stage_model", "cond_stage_model"):
        if hasattr(obj, attr):
            mod = getattr(obj, attr)
            break
    if mod is None and isinstance(obj, torch.nn.Module):
        mod = obj
    h = hashlib.sha256(type(obj).__name__.encode())
    if mod is not None:
        params = list(mod.state_dict().items())
        h.update(str(len(params)).encode())
        for k, v in params[:2] + params[-2:]:
            h.update(k.encode())
            h.update(str(tuple(v.shape)).encode())
            flat = v.detach().flatten()
            h.update(flat[:64].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class EncodedDataset:
    """Encoded latents (raw VAE output, per item) and conditioning (per unique caption), grouped by bucket."""

    def __init__(self, items, latents, conds, pooled, cache_path=None, from_cache=False):
        self.items = items
        self.latents = latents          # list of [C,h,w] float tensors (cpu)
        self.conds = conds              # caption -> [T, D]
        self.pooled = pooled            # caption -> [P]
        self.cache_path = cache_path
        self.from_cache = from_cache
        self.buckets: dict = {}
        for i, it in enumerate(items):
            self.buckets.setdefault(tuple(latents[i].shape), []).append(i)

    def __len__(self):
        return len(self.items)

    def subset(self, indices) -> "EncodedDataset":
        """The items at ``indices`` (their conditioning shared, not copied): a held-out validation share."""
        idx = sorted(int(i) for i in indices)
        return EncodedDataset([self.items[i] for i in idx], [self.latents[i] for i in idx], self.conds, self.pooled,
                              self.cache_path, self.from_cache)


def encode_dataset(spec: DatasetSpec, vae, clip, cache_dir: str | None = None, progress=None,
                   check_interrupt=None) -> EncodedDataset:
    items = collect_items(spec)
    key_src = {
        "v": CACHE_VERSION, "vae": fingerprint(vae), "clip": fingerprint(clip), "res": spec.resolution,
        "step": spec.bucket_step, "buckets": spec.enable_buckets,
        "items": [(it.key, it.digest, it.caption, list(it.bucket)) for it in items],
    }
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:24]
    cache_dir = cache_dir or spec.cache_dir
    path = Path(cache_dir) / f"fluxlora_{key}.safetensors" if cache_dir else None
    # the empty caption is encoded with the rest, so caption dropout works with cached conditioning
    caps = sorted(set(it.caption for it in items) | {EMPTY_CAPTION})
    if path is not None and path.is_file():
        from safetensors.torch import load_file
        try:
            sd = load_file(str(path))
            latents = [sd[f"latent.{i}"] for i in range(len(items))]
            conds = {c: sd[f"cond.{j}"] for j, c in enumerate(caps)}
            pooled = {c: sd[f"pooled.{j}"] for j, c in enumerate(caps)}
            return EncodedDataset(items, latents, conds, pooled, str(path), from_cache=True)
        except Exception:  # noqa: BLE001 - stale/corrupt cache: re-encode
            pass
    latents, conds, pooled = [], {}, {}
    total = len(items) + len(caps)
    done = 0
    for it in items:
        if check_interrupt:
            check_interrupt()
        img = resize_crop(it.loader(), it.bucket)
        with torch.no_grad():
            lat = vae.encode(img.unsqueeze(0))
        latents.append(lat[0].float().cpu().contiguous())
        done += 1
        if progress:
            progress(done, total)
    for c in caps:
        if check_interrupt:
            check_interrupt()
        with torch.no_grad():
            tokens = clip.tokenize(c)
            cond, pool = clip.encode_from_tokens(tokens, return_pooled=True)
        conds[c] = cond[0].float().cpu().contiguous()
        pooled[c] = pool[0].float().cpu().contiguous() if pool is not None else torch.zeros(768)
        done += 1
        if progress:
            progress(done, total)
    if path is not None:
        from safetensors.torch import save_file
        sd = {f"latent.{i}": t for i, t in enumerate(latents)}
        for j, c in enumerate(caps):
            sd[f"cond.{j}"] = conds[c]
            sd[f"pooled.{j}"] = pooled[c]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file(sd, str(tmp), metadata={"key": json.dumps(key_src)[:60000]})
        os.replace(tmp, path)
    return EncodedDataset(items, latents, conds, pooled, str(path) if path else None, from_cache=False)
