"""Activation-side LoRA for ComfyUI's FLUX ``diffusion_model`` (no model copy, no base weight gradients).

Each targeted ``Linear`` gets a per-instance ``forward`` (``linear_patch.linear_forward``) that adds
``up(down(x)) * alpha / rank`` to its output (base ``addmm`` + LoRA ``mm`` + ``addmm`` on one 2-D view; a forward
hook cost a hook dispatch and a reshape/view pair per call). The base weight keeps ``requires_grad=False``, so
autograd never computes a full dW for it (ComfyUI's own ``TrainLoraNode`` rebuilds ``W + s*up@down`` and pays
that dW on every step). ``detach`` gives the untouched model back.

Targets are kohya's defaults (``networks/lora_flux.py``): the 10 Linears of every double block and the 3 of
every single block (19*10 + 38*3 = 304 modules on FLUX.1). Names follow kohya: ``lora_unet_<path with _>``.
"""
from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from .linear_patch import attach_lora, detach_lora, foreign_forward, lora_of

# (path inside a block, kohya "type" used for per-type ranks)
DOUBLE_TARGETS = (
    ("img_mod.lin", "img_mod"),
    ("img_attn.qkv", "img_attn"),
    ("img_attn.proj", "img_attn"),
    ("img_mlp.0", "img_mlp"),
    ("img_mlp.2", "img_mlp"),
    ("txt_mod.lin", "txt_mod"),
    ("txt_attn.qkv", "txt_attn"),
    ("txt_attn.proj", "txt_attn"),
    ("txt_mlp.0", "txt_mlp"),
    ("txt_mlp.2", "txt_mlp"),
)
SINGLE_TARGETS = (
    ("linear1", "single"),
    ("linear2", "single"),
    ("modulation.lin", "single_mod"),
)
LAYER_TYPES = ("img_attn", "txt_attn", "img_mlp", "txt_mlp", "img_mod", "txt_mod", "single", "single_mod")


def parse_indices(spec: str | None, count: int, what: str) -> list[int]:
    """``"all"``/empty -> every index; ``"none"`` -> none; ``"0,1,8-12"`` -> those. Raises ValueError with the fix."""
    if spec is None:
        return list(range(count))
    spec = str(spec).strip().lower()
    if spec in ("", "all", "*"):
        return list(range(count))
    if spec in ("none", "-"):
        return []
    out = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"(\d+)\s*-\s*(\d+)", part)
        try:
            if m:
                a, b = int(m.group(1)), int(m.group(2))
                rng = range(min(a, b), max(a, b) + 1)
            else:
                rng = [int(part)]
        except ValueError:
            raise ValueError(f"{what}: cannot read {part!r}. Fix: use 'all', 'none' or indices like '0,1,8-12'.")
        for i in rng:
            if not 0 <= i < count:
                raise ValueError(f"{what}: index {i} is out of range; this model has {count} ({0}-{count - 1}). "
                                 f"Fix: use indices in that range.")
            out.add(i)
    return sorted(out)


@dataclass
class LoraTargetSpec:
    """What the LoRA trains: rank and alpha, the blocks (``parse_indices`` syntax) and per-type ranks.

    ``trainer.TrainConfig`` extends it, so a run's LoRA settings are defined and validated here only."""
    rank: int = 16
    alpha: float = 16.0
    double_blocks: str = "all"
    single_blocks: str = "all"
    type_ranks: dict = field(default_factory=dict)  # layer type -> rank (0 disables that type)

    def rank_for(self, layer_type: str) -> int:
        return int(self.type_ranks.get(layer_type, self.rank))

    def validate(self) -> None:
        """Raises ValueError naming the fix; the block selections are checked against a model by
        ``FluxLoraNetwork`` (they need its block counts)."""
        if int(self.rank) < 1:
            raise ValueError(f"LoRA rank must be at least 1 (got {self.rank}). Fix: set rank to 1 or more "
                             "(16 is a common choice for FLUX).")
        if float(self.alpha) <= 0:
            raise ValueError(f"LoRA alpha must be positive (got {self.alpha}). Fix: set alpha (e.g. equal to rank).")
        for t, r in self.type_ranks.items():
            if t not in LAYER_TYPES:
                raise ValueError(f"unknown layer type {t!r} in per-type ranks. Fix: use one of {', '.join(LAYER_TYPES)}.")
            if int(r) < 0:
                raise ValueError(f"per-type rank for {t} is {r}. Fix: use 0 (disable) or a positive rank.")


class LoraModule(nn.Module):
    """One down/up pair. Parameters are kept in ``dtype`` (fp32 master weights by default)."""

    def __init__(self, name: str, in_features: int, out_features: int, rank: int, alpha: float,
                 dtype=torch.float32, device=None):
        super().__init__()
        self.name = name
        self.rank = int(rank)
        self.alpha = float(alpha)
        self.scale = self.alpha / self.rank
        self.lora_down = nn.Linear(in_features, rank, bias=False, dtype=dtype, device=device)
        self.lora_up = nn.Linear(rank, out_features, bias=False, dtype=dtype, device=device)
        # kohya init: down kaiming-uniform, up zero -> the LoRA starts as the identity change
        nn.init.kaiming_uniform_(self.lora_down.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_up.weight)
        self._cache = None
        self._pinned = False  # _cache holds the block checkpoint's inputs for this block call (PinnedWeights)

    def compute_weights(self, dtype):
        """(down.T, up.T) in the compute dtype, transposed for ``mm``/``addmm``. Within a training step the cast
        and the transpose are done once and shared by every call, the checkpoint recompute included
        (``FluxLoraNetwork.cast_cache``)."""
        c = self._cache
        if c is not None:
            if c[0].dtype == dtype:
                return c
            if self._pinned:  # a checkpointed block's explicit inputs: stay connected to them in any dtype
                return c[0].to(dtype), c[1].to(dtype)
        d, u = self.lora_down.weight, self.lora_up.weight
        if d.dtype != dtype:
            d, u = d.to(dtype), u.to(dtype)
        return d.t(), u.t()

    def add_to(self, x2: torch.Tensor, out2: torch.Tensor) -> torch.Tensor:
        """``out2 + scale * (x2 @ down.T) @ up.T`` on 2-D views: one ``mm`` and one ``addmm`` (the scale rides on
        ``alpha``, so no pass over the output and none in the backward when scale == 1)."""
        dt = out2.dtype
        down_t, up_t = self.compute_weights(dt)
        if x2.dtype != dt:
            x2 = x2.to(dt)
        return torch.addmm(out2, torch.mm(x2, down_t), up_t, alpha=self.scale)


def is_flux_diffusion_model(dm) -> bool:
    try:
        from comfy.ldm.flux.model import Flux
        if isinstance(dm, Flux):
            return True
    except Exception:  # noqa: BLE001 - ComfyUI absent: fall back to the structure
        pass
    return (hasattr(dm, "double_blocks") and hasattr(dm, "single_blocks") and hasattr(dm, "img_in")
            and hasattr(dm, "txt_in") and hasattr(dm, "final_layer"))


def _get(module: nn.Module, path: str) -> nn.Module | None:
    cur = module
    for p in path.split("."):
        if not hasattr(cur, p) and not (isinstance(cur, (nn.Sequential, nn.ModuleList)) and p.isdigit()):
            return None
        cur = cur[int(p)] if p.isdigit() else getattr(cur, p)
    return cur


class FluxLoraNetwork(nn.Module):
    """The set of LoRA modules injected into a FLUX ``diffusion_model``.

    ``loras`` is keyed by the kohya name without prefix dots, e.g. ``lora_unet_double_blocks_0_img_attn_qkv``.
    """

    def __init__(self, dm: nn.Module, spec: LoraTargetSpec, dtype=torch.float32, device=None):
        super().__init__()
        if not is_flux_diffusion_model(dm):
            raise TypeError(
                f"FLUX LoRA training needs a FLUX model, got {type(dm).__module__}.{type(dm).__name__}. "
                "Fix: load a FLUX.1 checkpoint (UNETLoader / CheckpointLoaderSimple with a FLUX model) and connect it.")
        spec.validate()
        self.spec = spec
        d_idx = parse_indices(spec.double_blocks, len(dm.double_blocks), "double block selection")
        s_idx = parse_indices(spec.single_blocks, len(dm.single_blocks), "single block selection")
        self.loras = nn.ModuleDict()
        self.targets: dict[str, nn.Module] = {}
        for kind, idxs, table in (("double_blocks", d_idx, DOUBLE_TARGETS), ("single_blocks", s_idx, SINGLE_TARGETS)):
            blocks = getattr(dm, kind)
            for i in idxs:
                for path, ltype in table:
                    rank = spec.rank_for(ltype)
                    if rank <= 0:
                        continue
                    lin = _get(blocks[i], path)
                    if lin is None or not isinstance(lin, nn.Linear):
                        continue  # e.g. FLUX.2-style blocks without per-block modulation
                    name = f"lora_unet_{kind}_{i}_{path.replace('.', '_')}"
                    dev = device if device is not None else lin.weight.device
                    if dev.type == "meta":
                        dev = None
                    self.loras[name] = LoraModule(name, lin.in_features, lin.out_features, rank, spec.alpha,
                                                  dtype=dtype, device=dev)
                    self.targets[name] = lin
        if len(self.loras) == 0:
            raise ValueError("the block selection and per-type ranks leave no layer to train. "
                             "Fix: select at least one block and give at least one layer type a rank above 0.")
        self._attached = False

    def attach(self):
        if self._attached:
            return self
        for name, lin in self.targets.items():
            lin.weight.requires_grad_(False)
            if getattr(lin, "bias", None) is not None:
                lin.bias.requires_grad_(False)
            if foreign_forward(lin):
                raise RuntimeError(f"{name}: the Linear already has a per-instance forward (another trainer or "
                                   "patch is active). Fix: close the other trainer first.")
            attach_lora(lin, self.loras[name])
        self._attached = True
        return self

    def detach(self):
        if not self._attached:
            return
        for lin in self.targets.values():
            detach_lora(lin)
        self._attached = False

    def cast_cache(self, dtype):
        """Context: cast (if needed) and transpose every LoRA weight once (autograd-connected) for one
        forward/backward: one cast and one transpose per weight and step instead of one per call."""
        @contextlib.contextmanager
        def ctx():
            mods = list(self.loras.values())
            for m in mods:  # plain attributes: __dict__ directly (Module.__setattr__ is slow)
                m.__dict__["_cache"] = None
                m.__dict__["_cache"] = m.compute_weights(dtype)
            try:
                yield
            finally:
                for m in mods:
                    m.__dict__["_cache"] = None
        return ctx()

    # ---- kohya state dict ----
    def kohya_state_dict(self, dtype=torch.bfloat16, weights: dict | None = None) -> dict:
        """kohya keys of the LoRA's weights, or of ``weights`` (this network's ``state_dict`` names -> tensors, e.g.
        an EMA of them) where given."""
        sd = {}
        for name, m in self.loras.items():
            for part in ("lora_down", "lora_up"):
                w = getattr(m, part).weight if weights is None else weights[f"loras.{name}.{part}.weight"]
                sd[f"{name}.{part}.weight"] = w.detach().to("cpu", dtype).contiguous()
            sd[f"{name}.alpha"] = torch.tensor(float(m.alpha), dtype=dtype)
        return sd


def block_loras(block) -> list:
    """The LoRA modules on ``block``'s Linears, in module order."""
    out = []
    for m in block.modules():
        lo = lora_of(m)
        if lo is not None:
            out.append(lo)
    return out


class PinnedWeights:
    """Context: the given LoRA modules use exactly the given (down.T, up.T) tensors (``ws``, two per module) inside,
    in any compute dtype: a checkpointed block's explicit inputs, so the block's recompute stays connected to them."""

    def __init__(self, loras, ws):
        self.loras, self.ws = loras, ws

    def __enter__(self):
        ds = [m.__dict__ for m in self.loras]  # plain attributes: skip Module.__setattr__
        self.old = [(d["_cache"], d["_pinned"]) for d in ds]
        ws = self.ws
        for i, d in enumerate(ds):
            d["_cache"], d["_pinned"] = (ws[2 * i], ws[2 * i + 1]), True

    def __exit__(self, *exc):
        for m, (c, p) in zip(self.loras, self.old):
            m.__dict__["_cache"], m.__dict__["_pinned"] = c, p
