"""Activation-side LoRA for ComfyUI's FLUX ``diffusion_model`` (no model copy, no base weight gradients).

Each targeted ``Linear`` gets a per-instance ``forward`` (``linear_forward``) that adds
``up(down(x)) * alpha / rank`` to its output (base ``addmm`` + LoRA ``mm`` + ``addmm`` on one 2-D view; a forward
hook cost a hook dispatch and a reshape/view pair per call). The base weight keeps ``requires_grad=False``, so
autograd never computes a full dW for it (ComfyUI's own ``TrainLoraNode`` rebuilds ``W + s*up@down`` and pays
that dW on every step). ``detach`` gives the untouched model back.

Targets are kohya's defaults (``networks/lora_flux.py``): the 10 Linears of every double block and the 3 of
every single block (19*10 + 38*3 = 304 modules on FLUX.1). Names follow kohya: ``lora_unet_<path with _>``.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from .lora_linear_op import lora_linear

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
    rank: int = 16
    alpha: float = 16.0
    double_blocks: str = "all"
    single_blocks: str = "all"
    type_ranks: dict = field(default_factory=dict)  # layer type -> rank (0 disables that type)

    def rank_for(self, layer_type: str) -> int:
        return int(self.type_ranks.get(layer_type, self.rank))


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
        self.enabled = True
        self._cache = None
        self._pinned = False  # _cache holds flux_forward._BlockCheckpoint's inputs for this block call

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

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        h = torch.nn.functional.linear(x, self.lora_down.weight.to(dt))
        return torch.nn.functional.linear(h, self.lora_up.weight.to(dt)) * self.scale

    def merged_delta_weight(self) -> torch.Tensor:
        return (self.lora_up.weight.float() @ self.lora_down.weight.float()) * self.scale


def _comfy_cast(lin) -> bool:
    """ComfyUI's Linear casts/patches its weight per call (``comfy_cast_weights``, weight/bias functions): then
    the base product goes through its own forward."""
    return bool(getattr(lin, "comfy_cast_weights", False) or getattr(lin, "weight_function", None)
                or getattr(lin, "bias_function", None))


def linear_forward(self, x):
    """Per-instance ``forward`` of a trained block Linear: base product plus the LoRA (``_lora``), on one 2-D view
    of ``x``. With an enabled LoRA the bf16/fp32 base, and the fp8 base on FP8 tensor cores (``_q_with_lora``),
    run as one operator with it (``lora_linear_op``); otherwise the base (``addmm``, the ``quant`` autograd
    function set as ``_q_base``, or ComfyUI's own cast forward) and then ``LoraModule.add_to``.

    Replaces a forward hook: no hook dispatch in ``Module.__call__``, no reshape/view pair per hook."""
    d = self.__dict__
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    qb = d.get("_q_base")
    lora = d.get("_lora")
    if lora is not None and not lora.enabled:
        lora = None
    if qb is not None:
        with_lora = d.get("_q_with_lora")   # the quantized base and the LoRA as one operator, where it applies
        if with_lora is not None and lora is not None:
            y = with_lora(self, x2, lora)
            if y is not None:
                return y.view(*shape[:-1], y.shape[-1])
        y = qb(self, x2)
    elif d.get("_l_comfy_op") and _comfy_cast(self):  # read per call: ComfyUI toggles it (lowvram, patches)
        y = type(self).forward(self, x2)
    else:
        p = self._parameters  # skips Module.__getattr__ (two lookups per call)
        w, b = p["weight"], p.get("bias")
        if lora is not None and x2.dtype == w.dtype:
            # base and LoRA as one operator (lora_linear_op.py: no copy of the base output, one kept output)
            down_t, up_t = lora.compute_weights(x2.dtype)
            y = lora_linear(x2, w, b, down_t, up_t, lora.scale)[0]
            return y.view(*shape[:-1], y.shape[-1])
        y = torch.mm(x2, w.t()) if b is None else torch.addmm(b, x2, w.t())
    if lora is not None:
        y = lora.add_to(x2, y)
    return y.view(*shape[:-1], y.shape[-1])


def install_forward(lin):
    """Makes ``linear_forward`` the instance's forward (idempotent; shared by the LoRA and the quantized base)."""
    import types
    if "forward" not in lin.__dict__:
        lin._l_comfy_op = hasattr(lin, "comfy_cast_weights")
        lin.forward = types.MethodType(linear_forward, lin)


def uninstall_forward(lin):
    """Gives the instance its class forward back once neither the LoRA nor a quantized base uses it."""
    d = lin.__dict__
    if "_lora" not in d and "_q_base" not in d:
        d.pop("forward", None)
        d.pop("_l_comfy_op", None)


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
        if int(spec.rank) < 1:
            raise ValueError(f"LoRA rank must be at least 1 (got {spec.rank}). Fix: set rank to 1 or more "
                             "(16 is a common choice for FLUX).")
        if float(spec.alpha) <= 0:
            raise ValueError(f"LoRA alpha must be positive (got {spec.alpha}). Fix: set alpha (e.g. equal to rank).")
        for t, r in spec.type_ranks.items():
            if t not in LAYER_TYPES:
                raise ValueError(f"unknown layer type {t!r} in per-type ranks. Fix: use one of {', '.join(LAYER_TYPES)}.")
            if int(r) < 0:
                raise ValueError(f"per-type rank for {t} is {r}. Fix: use 0 (disable) or a positive rank.")
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
            if "forward" in lin.__dict__ and lin.__dict__["forward"].__func__ is not linear_forward:
                raise RuntimeError(f"{name}: the Linear already has a per-instance forward (another trainer or "
                                   "patch is active). Fix: close the other trainer first.")
            lin.__dict__["_lora"] = self.loras[name]  # not a submodule: the Linear's state dict stays as it is
            install_forward(lin)
        self._attached = True
        return self

    def detach(self):
        if not self._attached:
            return
        for lin in self.targets.values():
            lin.__dict__.pop("_lora", None)
            uninstall_forward(lin)
        self._attached = False

    def cast_cache(self, dtype):
        """Context: cast (if needed) and transpose every LoRA weight once (autograd-connected) for one
        forward/backward: one cast and one transpose per weight and step instead of one per call."""
        import contextlib

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

    def set_enabled(self, flag: bool):
        for m in self.loras.values():
            m.enabled = flag

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ---- kohya state dict ----
    def kohya_state_dict(self, dtype=torch.bfloat16) -> dict:
        sd = {}
        for name, m in self.loras.items():
            sd[f"{name}.lora_down.weight"] = m.lora_down.weight.detach().to("cpu", dtype).contiguous()
            sd[f"{name}.lora_up.weight"] = m.lora_up.weight.detach().to("cpu", dtype).contiguous()
            sd[f"{name}.alpha"] = torch.tensor(float(m.alpha), dtype=dtype)
        return sd

    def load_kohya_state_dict(self, sd: dict, strict: bool = True):
        missing = []
        for name, m in self.loras.items():
            try:
                down, up = sd[f"{name}.lora_down.weight"], sd[f"{name}.lora_up.weight"]
            except KeyError:
                missing.append(name)
                continue
            if down.shape != m.lora_down.weight.shape or up.shape != m.lora_up.weight.shape:
                raise ValueError(f"LoRA {name}: file has rank {down.shape[0]}, this run uses rank {m.rank}. "
                                 "Fix: resume with the same rank/per-type ranks as the saved LoRA.")
            with torch.no_grad():
                m.lora_down.weight.copy_(down)
                m.lora_up.weight.copy_(up)
        if strict and missing:
            raise ValueError(f"{len(missing)} LoRA modules are missing from the file (e.g. {missing[0]}). "
                             "Fix: resume with the same block selection as the saved LoRA.")
