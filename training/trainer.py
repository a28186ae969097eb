"""FLUX LoRA trainer working on ComfyUI's FLUX ``diffusion_model`` in place (nothing is copied)."""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import asdict, dataclass, fields

import torch

from ..optimization.attention.sdpa_priority import preferred_backends, sdpa_priority
from ..optimization.runtime import device_cache, knobs
from .cuda_graph import GraphedLossAndGrads
from .data import EMPTY_CAPTION
from .ema import LoraEMA
from .flux_forward import FluxTrainForward
from .frozen_base import FrozenBase, outside_inference_mode
from .lora import FluxLoraNetwork, LoraTargetSpec, is_flux_diffusion_model
from .objective import TIMESTEP_SAMPLINGS, flow_loss, flux_mu, noisy_input, sample_sigmas
from .optim import OPTIMIZERS, SCHEDULERS, build_optimizer, build_scheduler
from .quant import QuantizedBase
from .save import atomic_save_safetensors, atomic_torch_save, kohya_metadata, prune_checkpoints
from .selective_checkpoint import ENV as SELECTIVE_ENV
from .selective_checkpoint import MODES as SELECTIVE_MODES
from .staging import TrainStaging, on_device
from .validation import BestTracker, ValidationSet, holdout_indices

log = logging.getLogger(__name__)
BASE_PRECISIONS = ("auto", "bf16", "fp8", "nvfp4")
CUDA_GRAPH_MODES = ("auto", "on", "off")
CUDA_GRAPH_ENV = "SEEDVR2BW_TRAIN_CUDA_GRAPH"
COMPILE_ENV = "SEEDVR2BW_TRAIN_COMPILE"


@dataclass
class TrainConfig(LoraTargetSpec):
    """A training run's settings: the LoRA's (rank, alpha, double_blocks, single_blocks, type_ranks: the fields of
    ``LoraTargetSpec``, validated there) and the rest, as flat fields (the node's inputs and the resume state)."""
    steps: int = 1000
    batch_size: int = 1
    grad_accum: int = 1
    learning_rate: float = 1e-4
    optimizer: str = "adamw"
    weight_decay: float = 0.01
    prodigy_d_coef: float = 1.0
    lr_scheduler: str = "constant"
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    timestep_sampling: str = "sigmoid"
    sigmoid_scale: float = 1.0
    shift: float = 3.1582
    guidance: float = 1.0
    loss_type: str = "l2"
    seed: int = 42
    compute_dtype: str = "bf16"          # bf16 | fp32
    lora_dtype: str = "fp32"             # master weights of the LoRA
    base_precision: str = "auto"         # auto (as loaded) | bf16 | fp8 | nvfp4
    gradient_checkpointing: bool = True
    # keep each block's GEMM/attention outputs, recompute only the rest (selective_checkpoint.py): auto = as many
    # blocks as fit in free GPU memory | on = all blocks | off = full per-block checkpointing
    selective_checkpointing: str = "auto"   # env SEEDVR2BW_TRAIN_SELECTIVE_CKPT
    cuda_graph: str = "auto"             # auto (on for CUDA without BlockSwap) | on | off; env SEEDVR2BW_TRAIN_CUDA_GRAPH
    # experimental, off by default: torch.compile'd block forwards (bf16 only so far: the fp8 base fails to compile
    # and falls back; a tiny model failed with cuDNN attention). auto/on = on for CUDA without BlockSwap
    compile_blocks: str = "off"          # auto | on | off; env SEEDVR2BW_TRAIN_COMPILE
    blocks_to_swap: int = 0              # -1: the memory plan's choice (memory_plan.py); without a plan, none
    # kept activations of selective checkpointing under "auto", from the memory plan; negative: measure free memory
    selective_budget_gib: float = -1.0
    vram_budget_gib: float = 0.0         # the memory plan's VRAM (0: what ComfyUI can free on the GPU)
    caption_dropout: float = 0.0         # share of samples trained on the empty caption (seeded per step)
    ema_decay: float = 0.0               # 0: no EMA; else the LoRA's average is saved as <name>_ema.safetensors
    validation_share: float = 0.0        # held-out share of the dataset (when no validation dataset is given)
    validation_every: int = 0            # steps between validations (0: at the end only)
    keep_best: bool = False              # keep <name>-best.safetensors, the lowest validation loss so far
    reg_weight: float = 1.0              # loss weight of the regularisation (prior-preservation) images
    output_name: str = "flux_lora"
    output_dir: str = ""
    save_every: int = 0
    keep_last: int = 3
    save_dtype: str = "bf16"
    preview_every: int = 0
    preview_seeds: tuple = (1,)
    preview_steps: int = 20
    preview_guidance: float = 3.5
    tensorboard_dir: str = ""

    def validate(self):
        def bad(what, fix):
            raise ValueError(f"{what}. Fix: {fix}.")
        super().validate()
        if self.steps < 1:
            bad(f"steps must be at least 1 (got {self.steps})", "set steps, e.g. 1000-2000")
        if self.batch_size < 1 or self.grad_accum < 1:
            bad("batch size and gradient accumulation must be at least 1", "set both to 1 or more")
        if self.optimizer not in OPTIMIZERS:
            bad(f"unknown optimizer {self.optimizer!r}", f"use one of {', '.join(OPTIMIZERS)}")
        if self.lr_scheduler not in SCHEDULERS:
            bad(f"unknown LR schedule {self.lr_scheduler!r}", f"use one of {', '.join(SCHEDULERS)}")
        if self.timestep_sampling not in TIMESTEP_SAMPLINGS:
            bad(f"unknown timestep sampling {self.timestep_sampling!r}", f"use one of {', '.join(TIMESTEP_SAMPLINGS)}")
        for name in ("cuda_graph", "compile_blocks", "selective_checkpointing"):
            if str(getattr(self, name)).lower() not in CUDA_GRAPH_MODES:
                bad(f"unknown {name} setting {getattr(self, name)!r}", f"use one of {', '.join(CUDA_GRAPH_MODES)}")
        if self.base_precision not in BASE_PRECISIONS:
            bad(f"unknown base precision {self.base_precision!r}", f"use one of {', '.join(BASE_PRECISIONS)}")
        for name, lo, hi in (("caption_dropout", 0.0, 1.0), ("reg_weight", 0.0, 1000.0)):
            if not lo <= float(getattr(self, name)) <= hi:
                bad(f"{name} must be between {lo:g} and {hi:g} (got {getattr(self, name)})", f"set {name} in range")
        if not (self.ema_decay == 0 or 0 < self.ema_decay < 1):
            bad(f"ema_decay must be 0 (off) or between 0 and 1 (got {self.ema_decay})", "use e.g. 0.999, or 0")
        if not 0 <= self.validation_share < 1:
            bad(f"validation_share must be at least 0 and below 1 (got {self.validation_share})", "use e.g. 0.1")
        if self.validation_every < 0 or self.blocks_to_swap < -1:
            bad(f"validation_every must be 0 or more and blocks_to_swap -1 (auto) or more (got "
                f"{self.validation_every}, {self.blocks_to_swap})", "use 0 for 'at the end' / 'no swapping'")
        if self.learning_rate <= 0:
            bad(f"learning rate must be positive (got {self.learning_rate})", "use e.g. 1e-4 (AdamW) or 1.0 (Prodigy)")
        if not str(self.output_name).strip() or any(c in self.output_name for c in "\\:*?\"<>|"):
            bad(f"output name {self.output_name!r} is not a usable file name", "use letters, digits, - _ and /")


def _dtype(name):
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


class FluxLoraTrainer:
    @outside_inference_mode
    def __init__(self, dm, cfg: TrainConfig, dataset, latent_format=None, device=None, vae=None,
                 blockswap_backend=None, blockswap_pool=None, validation=None, regularization=None,
                 blockswap_config=None):
        """``validation``: a dataset evaluated instead of a held-out share; ``regularization``: prior-preservation
        images, one batch of them per micro-step at ``cfg.reg_weight``. A model in host RAM (or any model with
        blocks to swap, or a given ``blockswap_backend``) is staged onto ``device`` (``staging.py``: nothing copied
        back at the end); ``blockswap_config``: ring / prefetch / small-tensor settings of that staging."""
        if not is_flux_diffusion_model(dm):
            raise TypeError(
                f"FLUX LoRA training needs a FLUX model, got {type(dm).__module__}.{type(dm).__name__}. "
                "Fix: load a FLUX.1 model (UNETLoader / CheckpointLoaderSimple) and connect it to 'model'.")
        cfg.validate()
        device_cache.lease(self)    # the quantized base's shared device tensors go with the last trainer
        if len(dataset) == 0:
            raise ValueError("the dataset is empty. Fix: add images to the dataset folder.")
        if cfg.caption_dropout > 0 and EMPTY_CAPTION not in dataset.conds:
            raise ValueError("caption_dropout needs the empty caption's conditioning, which this dataset lacks "
                             "(encoded by an older version). Fix: encode the dataset again (encode_dataset).")
        if validation is None and cfg.validation_share > 0:
            held = holdout_indices(len(dataset), cfg.validation_share, cfg.seed)
            validation = dataset.subset(held)
            dataset = dataset.subset(sorted(set(range(len(dataset))) - set(held)))
        if cfg.keep_best and validation is None:
            raise ValueError("keep_best needs a validation loss, and this run has no validation images. Fix: set "
                             "validation_share above 0, connect a validation dataset, or turn keep_best off.")
        if regularization is not None and len(regularization) == 0:
            raise ValueError("the regularisation dataset is empty. Fix: add images to it, or disconnect it.")
        self.dm, self.cfg, self.data, self.reg = dm, cfg, dataset, regularization
        self.val = ValidationSet(validation, cfg.seed) if validation is not None else None
        self.best = BestTracker()
        self.latent_format = latent_format
        self.vae = vae
        self.device = torch.device(device) if device is not None else next(
            p.device for p in dm.parameters() if p.device.type != "meta")
        self.dtype = _dtype(cfg.compute_dtype)
        self.gen = torch.Generator().manual_seed(int(cfg.seed))
        self.base = self.network = self.quant = self.block_runner = self.forward = self.graphed = self.tb = None
        self.ema = self.staging = None
        self._closed = False
        try:
            self._build(blockswap_backend, blockswap_pool, blockswap_config)
        except BaseException:
            self.close()   # a half-built trainer leaves the model as it found it
            raise

    def _build(self, blockswap_backend, blockswap_pool, blockswap_config):
        cfg, dm = self.cfg, self.dm
        # ComfyUI's models hold inference tensors: normal aliases of them while training (no copy)
        self.base = FrozenBase(dm)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(cfg.seed))
            self.network = FluxLoraNetwork(dm, cfg, dtype=_dtype(cfg.lora_dtype), device=self.device)
        self.network.attach()
        if cfg.blocks_to_swap > 0 and not cfg.gradient_checkpointing:
            raise ValueError("blocks to swap needs gradient checkpointing (a swapped block's weights are only "
                             "on the GPU while it runs). Fix: turn gradient checkpointing on.")
        stage = blockswap_backend is not None or (self.device.type == "cuda" and (
            cfg.blocks_to_swap > 0 or not on_device(dm, self.device)))
        if cfg.base_precision in ("fp8", "nvfp4"):
            # before staging, so the arenas hold the quantized formats; each Linear is quantized on the compute
            # device where it is a GPU (the bf16 weight goes there one at a time), else where it lives
            self.quant = QuantizedBase(dm, cfg.base_precision, device=self.device,
                                       work_device=self.device if self.device.type == "cuda" else None)
        if stage:
            self.staging = TrainStaging(dm, self.device, cfg.blocks_to_swap, blockswap_backend, blockswap_pool,
                                        blockswap_config)
            self.block_runner = self.staging.block_runner
        self.forward = FluxTrainForward(dm, cfg.gradient_checkpointing, self.block_runner,
                                        compile_blocks=self.gpu_feature("compile_blocks", COMPILE_ENV,
                                                                        "compiled block forwards"),
                                        selective=self._selective_mode(),
                                        selective_budget=None if cfg.selective_budget_gib < 0
                                        else int(cfg.selective_budget_gib * 2**30))
        self.sdpa_backends, why = preferred_backends(self.device)
        log.info("[FluxLoraTrain] attention (SDPA) kernel order: %s", why)
        self.graphed = self._make_graphed()
        self.optimizer = build_optimizer(self.network.parameters(), cfg.optimizer, cfg.learning_rate,
                                         weight_decay=cfg.weight_decay, prodigy_d_coef=cfg.prodigy_d_coef)
        self.scheduler = build_scheduler(self.optimizer, cfg.lr_scheduler, cfg.steps, cfg.warmup_steps)
        if cfg.ema_decay > 0:
            self.ema = LoraEMA(self.network.named_parameters(), cfg.ema_decay)
        self.step = 0
        self.losses: list[float] = []
        self.step_times: list[float] = []
        self.previews = []
        if cfg.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(cfg.tensorboard_dir)
            except Exception as exc:  # noqa: BLE001
                log.warning("TensorBoard logging off: %s (pip install tensorboard to enable it)", exc)

    # ---------------- data ----------------
    def _sample_batch(self, data=None, micro: int = 0):
        data = data if data is not None else self.data
        keys = sorted(data.buckets)
        sizes = torch.tensor([len(data.buckets[k]) for k in keys], dtype=torch.float64)
        b = keys[int(torch.multinomial(sizes, 1, generator=self.gen))]
        idxs = data.buckets[b]
        pick = torch.randint(len(idxs), (self.cfg.batch_size,), generator=self.gen).tolist()
        sel = [idxs[i] for i in pick]
        x0 = torch.stack([data.latents[i] for i in sel])
        caps = [data.items[i].caption for i in sel]
        if self.cfg.caption_dropout > 0 and data is self.data:
            caps = [EMPTY_CAPTION if d else c for c, d in zip(caps, self.dropped(micro, len(caps)))]
        conds = [data.conds[c] for c in caps]
        T = max(c.shape[0] for c in conds)
        ctx = torch.stack([torch.nn.functional.pad(c, (0, 0, 0, T - c.shape[0])) for c in conds])
        y = torch.stack([data.pooled[c] for c in caps])
        return x0, ctx, y

    def dropped(self, micro: int, n: int) -> list:
        """Which of the ``n`` samples of micro-step ``micro`` of the coming step train on the empty caption: from a
        generator seeded by (seed, step, micro), so a resumed run drops the same ones without extra state."""
        g = torch.Generator().manual_seed((int(self.cfg.seed) * 1_000_003 + self.step * 1009 + micro) % 2**63)
        return (torch.rand(n, generator=g, dtype=torch.float64) < self.cfg.caption_dropout).tolist()

    def process_in(self, lat):
        """A dataset latent as the model takes it (ComfyUI's ``latent_format.process_in``)."""
        return self.latent_format.process_in(lat) if self.latent_format is not None else lat

    # ---------------- one optimizer step ----------------
    def gpu_feature(self, name: str, env: str, label: str) -> bool:
        """A CUDA-only speed feature: the env variable, else the config field (auto = on); one log line."""
        raw = knobs.get(env.removeprefix(knobs.PREFIX)) or ""
        mode, src = (raw, env) if raw else (str(getattr(self.cfg, name)).lower(), name)
        why = None
        if mode in ("0", "off", "false"):
            why = f"off ({src}={mode})"
        elif self.device.type != "cuda":
            why = f"off (device {self.device.type})"
        elif self.block_runner is not None:
            why = "off (BlockSwap streams blocks with host-side scheduling, which this cannot follow)"
        log.info("[FluxLoraTrain] %s: %s", label, why or f"on ({src}={mode})")
        return why is None

    def _selective_mode(self) -> str:
        """selective_checkpointing as set (the env variable wins); the per-shape decision is logged by the forward."""
        raw = knobs.get(SELECTIVE_ENV.removeprefix(knobs.PREFIX)) or ""
        mode = {"0": "off", "false": "off", "1": "on", "true": "on"}.get(raw, raw) or \
            str(self.cfg.selective_checkpointing).lower()
        if mode not in SELECTIVE_MODES:
            raise ValueError(f"{SELECTIVE_ENV}={raw!r} is not a selective checkpointing mode. Fix: use one of "
                             f"{', '.join(SELECTIVE_MODES)} (or unset it).")
        return mode

    def _make_graphed(self):
        """CUDA-graphed forward+backward (``cuda_graph.py``), captured per input shape."""
        if not self.gpu_feature("cuda_graph", CUDA_GRAPH_ENV, "CUDA graphs"):
            return None
        return GraphedLossAndGrads(self.loss_and_grads, self.device)

    def _micro_loss(self, x_t, sigma, ctx, y, target):
        pred = self.forward(x_t, sigma, ctx, y, self.cfg.guidance)
        return flow_loss(pred, target, self.cfg.loss_type) / self.cfg.grad_accum

    def loss_and_grads(self, *inputs):
        """Loss and LoRA gradients as returned tensors (what the CUDA graph captures)."""
        params = list(self.network.parameters())
        with self.network.cast_cache(self.dtype), sdpa_priority(self.sdpa_backends):
            loss = self._micro_loss(*inputs)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
        return loss.detach(), grads

    def _accumulate(self, grads, last: bool):
        """Adds one micro-step's gradients. A CUDA graph's static outputs are overwritten by its next replay, which
        comes after this step's optimizer update only when no micro-step follows (``last``): they are used as they
        are then (no copies: 608 of them cost ~0.1 s of host time per FLUX step), copied otherwise."""
        params = list(self.network.parameters())
        owned = last or self.graphed is None
        have = [(p.grad, g) for p, g in zip(params, grads) if g is not None and p.grad is not None]
        if have:
            torch._foreach_add_([a for a, _ in have], [g for _, g in have])
        for p, g in zip(params, grads):
            if g is not None and p.grad is None:
                p.grad = g if owned else g.clone()

    def _micro_step(self, inputs, last: bool, weight: float = 1.0) -> torch.Tensor:
        """One forward/backward; LoRA gradients accumulated; the loss as a device tensor (no sync here: the
        optimizer's launches then overlap the step's GPU work). An out-of-memory error with selectively
        checkpointed blocks for this shape is retried once with full per-block checkpointing (logged)."""
        for attempt in (0, 1):
            try:
                # gradients are added only once the whole backward has succeeded
                loss, grads = (self.graphed or self.loss_and_grads)(*inputs)
                if weight != 1.0:   # new tensors: safe to keep even when they came from a graph's static outputs
                    grads = [None if g is None else g * weight for g in grads]
                    loss = loss * weight
                self._accumulate(grads, last)
                return loss.clone() if self.graphed is not None else loss   # a static output: replays overwrite it
            except torch.cuda.OutOfMemoryError:
                if attempt or not self.forward.fall_back_to_full(inputs[0], inputs[2]):
                    raise
            # outside the handler: the failed attempt's tensors are released with its traceback
            log.warning("[FluxLoraTrain] out of GPU memory with selective checkpointing for input %s; retrying with "
                        "full per-block checkpointing for this shape", list(inputs[0].shape))
            torch.cuda.empty_cache()

    @outside_inference_mode
    def train_step(self) -> float:
        cfg = self.cfg
        t0 = time.perf_counter()
        total = None
        # each micro-step: a training batch, then (prior preservation) a regularisation batch at its own weight
        parts = [(self.data, 1.0)] + ([(self.reg, cfg.reg_weight)] if self.reg is not None and cfg.reg_weight else [])
        for micro in range(cfg.grad_accum):
            for k, (data, weight) in enumerate(parts):
                x0, ctx, y = self._sample_batch(data, micro)
                x0 = self.process_in(x0)
                noise = torch.randn(x0.shape, generator=self.gen, dtype=torch.float32)
                seq = (x0.shape[-2] // 2) * (x0.shape[-1] // 2)
                sigma = sample_sigmas(x0.shape[0], cfg.timestep_sampling, self.gen, sigmoid_scale=cfg.sigmoid_scale,
                                      shift=cfg.shift, image_seq_len=seq)
                x_t, target = noisy_input(x0, noise, sigma)
                dev, dt = self.device, self.dtype
                inputs = (x_t.to(dev, dt), sigma.to(dev), ctx.to(dev, dt), y.to(dev, dt), target.to(dev))
                last = micro == cfg.grad_accum - 1 and k == len(parts) - 1
                loss = self._micro_step(inputs, last=last, weight=weight)
                total = loss if total is None else total + loss
        if cfg.max_grad_norm and cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.network.parameters(), cfg.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update()
        total = float(total)   # the step's one host sync
        self.step += 1
        self.losses.append(total)
        self.step_times.append(time.perf_counter() - t0)
        if self.tb is not None:
            self.tb.add_scalar("loss", total, self.step)
            self.tb.add_scalar("lr", self.current_lr(), self.step)
        return total

    @outside_inference_mode
    @torch.no_grad()
    def validation_loss(self) -> float | None:
        """Mean loss over the validation set's fixed (image, sigma, noise) pairs with the LoRA as it is now; None
        without a validation set."""
        if self.val is None:
            return None
        total = 0.0
        dev, dt = self.device, self.dtype
        with self.network.cast_cache(self.dtype), sdpa_priority(self.sdpa_backends):
            for x0, ctx, y, noise, sigma in self.val.samples():
                x_t, target = noisy_input(self.process_in(x0), noise, sigma)
                pred = self.forward(x_t.to(dev, dt), sigma.to(dev), ctx.to(dev, dt), y.to(dev, dt), self.cfg.guidance)
                total += float(flow_loss(pred, target.to(dev), self.cfg.loss_type))
        return total / len(self.val)

    def validate(self, dataset_info=None) -> float | None:
        """Validates now, records the result and, with ``keep_best``, saves ``<name>-best.safetensors`` when it is
        the lowest so far."""
        loss = self.validation_loss()
        if loss is None:
            return None
        if self.best.record(self.step, loss) and self.cfg.keep_best:
            self.save_lora(self._out("-best.safetensors"), dataset_info,
                           {"ss_validation_loss": repr(loss), "ss_best_step": self.step})
        if self.tb is not None:
            self.tb.add_scalar("validation_loss", loss, self.step)
        log.info("[FluxLoraTrain] step %d validation loss %.5f (best %.5f at step %d)", self.step, loss,
                 self.best.best[1], self.best.best[0])
        return loss

    def current_lr(self) -> float:
        g = self.optimizer.param_groups[0]
        return float(g["lr"]) * float(g.get("d", 1.0))

    # ---------------- saving / resume ----------------
    def _out(self, suffix=""):
        return os.path.join(self.cfg.output_dir, f"{self.cfg.output_name}{suffix}")

    def save_lora(self, path=None, dataset_info=None, extra=None) -> str:
        """Writes the LoRA (and, with an EMA, its average as ``<file>_ema.safetensors`` beside it)."""
        path = path or self._out(".safetensors")
        md = kohya_metadata(self.cfg, self.network, self.step, dataset_info, extra)
        dtype = _dtype(self.cfg.save_dtype)
        if self.ema is not None:
            atomic_save_safetensors(self.network.kohya_state_dict(dtype, self.ema.weights()), ema_path(path),
                                    {**md, "ss_ema_decay": str(self.ema.decay)})
        return atomic_save_safetensors(self.network.kohya_state_dict(dtype), path, md)

    def state_dict(self) -> dict:
        st = {
            "lora": {k: v.detach().cpu().clone() for k, v in self.network.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "losses": list(self.losses),
            "validation": self.best.state_dict(),
            "generator": self.gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "config": asdict(self.cfg),
        }
        if self.ema is not None:
            st["ema"] = self.ema.state_dict()
        if torch.cuda.is_available() and self.device.type == "cuda":
            st["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        return st

    @outside_inference_mode
    def load_state_dict(self, st: dict):
        saved = st.get("config", {})
        # the held-out images follow the seed, so it must match when a share is held out
        held = ["seed"] if self.cfg.validation_share else []
        for k in [f.name for f in fields(LoraTargetSpec)] + ["optimizer", "ema_decay", "validation_share"] + held:
            if k in saved and saved[k] != getattr(self.cfg, k):
                raise ValueError(f"the resume state was trained with {k}={saved[k]!r}, this run has "
                                 f"{getattr(self.cfg, k)!r}. Fix: use the same setting, or another output name "
                                 "to start fresh.")
        self.network.load_state_dict(st["lora"])
        self.optimizer.load_state_dict(st["optimizer"])
        self.scheduler.load_state_dict(st["scheduler"])
        self.step = int(st["step"])
        self.losses = list(st.get("losses", []))
        self.best.load_state_dict(st.get("validation", {}))
        if self.ema is not None:
            if "ema" not in st:
                raise ValueError("the resume state has no EMA of the LoRA (it was trained without one). Fix: set "
                                 "ema_decay to 0 to continue it, or use another output name to start fresh.")
            self.ema.load_state_dict(st["ema"])
        self.gen.set_state(st["generator"])
        torch.set_rng_state(st["torch_rng"])
        if "cuda_rng" in st and self.device.type == "cuda":
            torch.cuda.set_rng_state(st["cuda_rng"], self.device)

    def state_path(self):
        return self._out("-state.pt")

    def save_state(self, path=None) -> str:
        return atomic_torch_save(self.state_dict(), path or self.state_path())

    @outside_inference_mode
    def load_state(self, path=None):
        # weights_only: a resume file from elsewhere must not be able to run code on load
        self.load_state_dict(torch.load(path or self.state_path(), map_location="cpu", weights_only=True))

    def save_checkpoint(self, dataset_info=None):
        p = self.save_lora(self._out(f"-step{self.step:08d}.safetensors"), dataset_info)
        self.save_state()
        prune_checkpoints(self._out("-step" + "[0-9]" * 8 + ".safetensors"), self.cfg.keep_last)
        prune_checkpoints(self._out("-step" + "[0-9]" * 8 + "_ema.safetensors"), self.cfg.keep_last)
        return p

    # ---------------- previews ----------------
    @outside_inference_mode
    @torch.no_grad()
    def sample(self, ctx, y, width_lat, height_lat, seed, steps=20, guidance=3.5):
        g = torch.Generator().manual_seed(int(seed))
        x = torch.randn((1, 16, height_lat, width_lat), generator=g).to(self.device, self.dtype)
        seq = (height_lat // 2) * (width_lat // 2)
        mu = flux_mu(seq)
        ts = torch.linspace(1, 0, steps + 1)
        ts = torch.where(ts > 0, math.exp(mu) / (math.exp(mu) + (1 / ts.clamp(min=1e-9) - 1)), ts)
        ckpt = self.forward.gradient_checkpointing
        self.forward.gradient_checkpointing = False
        try:
            with sdpa_priority(self.sdpa_backends):
                for i in range(steps):
                    s, s2 = float(ts[i]), float(ts[i + 1])
                    v = self.forward(x, torch.full((1,), s, device=self.device), ctx.to(self.device, self.dtype),
                                     y.to(self.device, self.dtype), guidance)
                    x = x + (s2 - s) * v.to(x.dtype)
        finally:
            self.forward.gradient_checkpointing = ckpt
        lat = x.float()
        if self.latent_format is not None:
            lat = self.latent_format.process_out(lat)
        return lat

    @outside_inference_mode
    def make_previews(self):
        if self.vae is None:
            return None
        it = self.data.items[0]
        shape = self.data.latents[0].shape
        imgs = []
        for seed in self.cfg.preview_seeds:
            lat = self.sample(self.data.conds[it.caption][None], self.data.pooled[it.caption][None], shape[-1],
                              shape[-2], seed, self.cfg.preview_steps, self.cfg.preview_guidance)
            imgs.append(self.vae.decode(lat).float().cpu())
        out = torch.cat([i.reshape(-1, *i.shape[-3:]) for i in imgs])
        self.previews.append((self.step, out))
        return out

    # ---------------- loop ----------------
    @outside_inference_mode
    def run(self, on_step=None, check_interrupt=None, dataset_info=None):
        """Trains to ``cfg.steps``. On any exception (ComfyUI's cancel included) the LoRA and the resume state
        trained so far are saved before the exception propagates. Returns the path of the final LoRA."""
        cfg = self.cfg
        try:
            while self.step < cfg.steps:
                if check_interrupt is not None:
                    check_interrupt()
                loss = self.train_step()
                if self.val is not None and (self.step == cfg.steps or (
                        cfg.validation_every and self.step % cfg.validation_every == 0)):
                    self.validate(dataset_info)
                if on_step is not None:
                    on_step(self.step, cfg.steps, loss, self.step_times[-1], self)
                if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.steps:
                    self.save_checkpoint(dataset_info)
                if cfg.preview_every and self.step % cfg.preview_every == 0:
                    self.make_previews()
        except BaseException:
            if self.step > 0:
                try:
                    p = self.save_lora(dataset_info=dataset_info, extra={"ss_interrupted": True})
                    self.save_state()
                    log.warning("[FluxLoraTrain] stopped at step %d; saved what was trained to %s (resume state %s)",
                                self.step, p, self.state_path())
                except Exception:  # noqa: BLE001
                    log.exception("[FluxLoraTrain] could not save on stop")
            raise
        path = self.save_lora(dataset_info=dataset_info)
        self.save_state()
        return path

    @outside_inference_mode
    def close(self):
        """Removes the LoRA (per-instance Linear forwards) and restores the base model exactly as it was (also
        after a failed construction: each part undoes what was done)."""
        if self._closed:
            return
        self._closed = True
        if self.graphed is not None:
            self.graphed.close()
        if self.network is not None:
            self.network.detach()
        if self.forward is not None:
            self.forward.close()
        if self.staging is not None:
            self.staging.close()
        self.block_runner = None
        if self.quant is not None:
            self.quant.restore()
        if self.base is not None:
            self.base.restore()
        if self.tb is not None:
            self.tb.close()


def ema_path(lora_path: str) -> str:
    """``<name>.safetensors`` -> ``<name>_ema.safetensors``: where a LoRA's EMA is saved."""
    root, ext = os.path.splitext(lora_path)
    return f"{root}_ema{ext or '.safetensors'}"

