"""FLUX LoRA training nodes (V3): dataset, settings, train.

The train node works on the MODEL that ComfyUI's loaders produce (ModelPatcher -> ``.model.diffusion_model``),
caches latents/conditioning through the connected VAE/CLIP, writes a kohya-format LoRA into ``models/loras``
and outputs its name so ComfyUI's own LoraLoader can apply it.
"""
from __future__ import annotations

import dataclasses
import logging
import os

import torch
from comfy_api.latest import io

from ..training.data import DatasetSpec, collect_items, encode_dataset
from ..training.optim import OPTIMIZERS, SCHEDULERS
from ..training.objective import TIMESTEP_SAMPLINGS
from ..training.lora import LAYER_TYPES, is_flux_diffusion_model
from ..training.memory_plan import GiB, DeviceBudget, PlanRequest, flux_dims, plan_training
from ..training.plot import render_loss_curve
from ..training.save import check_overwrite, resolve_output_name
from ..training.trainer import BASE_PRECISIONS, FluxLoraTrainer, TrainConfig
from .types import CATEGORY, ComboName, LoraDataset, LoraTrainingSettings

log = logging.getLogger(__name__)


def _parse_type_ranks(text: str) -> dict:
    out = {}
    for part in (text or "").replace(";", ",").split(","):
        part = part.strip()
        if not part:
            continue
        if "=" not in part:
            raise ValueError(f"per-type ranks: cannot read {part!r}. Fix: write e.g. 'img_mod=0, txt_mlp=8' "
                             f"with types from {', '.join(LAYER_TYPES)}.")
        k, v = (s.strip() for s in part.split("=", 1))
        try:
            out[k] = int(v)
        except ValueError:
            raise ValueError(f"per-type ranks: {part!r} is not type=integer. Fix: write e.g. 'img_mod=0'.")
    return out


class FluxLoraDatasetNode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="SeedVR2BW_FluxLoraDataset",
            display_name="FLUX LoRA Dataset",
            category=f"{CATEGORY}/training",
            description="Images with same-name .txt captions (a folder), or an IMAGE batch with captions. "
                        "Images are sorted into aspect-ratio buckets of about resolution² pixels.",
            inputs=[
                io.String.Input("folder", default="", tooltip="Folder of images + .txt captions (absolute, or "
                                "relative to ComfyUI's input folder). Leave empty to use the images input."),
                io.String.Input("caption_for_all", default="", multiline=True,
                                tooltip="Caption for images that have no .txt file."),
                io.String.Input("trigger_word", default="", tooltip="Put in front of every caption."),
                io.Int.Input("resolution", default=1024, min=256, max=2048, step=64),
                io.Boolean.Input("aspect_buckets", default=True),
                io.Image.Input("images", optional=True),
                io.String.Input("captions", default="", multiline=True, optional=True,
                                tooltip="For the images input: one caption per line (or one for all)."),
            ],
            outputs=[LoraDataset.Output(display_name="dataset")],
        )

    @classmethod
    def execute(cls, folder, caption_for_all, trigger_word, resolution, aspect_buckets, images=None,
                captions="") -> io.NodeOutput:
        folder = (folder or "").strip()
        if folder and not os.path.isabs(folder):
            import folder_paths
            folder = os.path.join(folder_paths.get_input_directory(), folder)  # as the tooltip says: input folder
        if not folder and images is None:
            raise ValueError("FLUX LoRA Dataset: no folder and no images. Fix: enter a folder of images with .txt "
                             "captions, or connect an IMAGE batch and captions.")
        caps = [c for c in (captions or "").splitlines() if c.strip()]
        spec = DatasetSpec(folder=folder or None, images=None if folder else images, captions=caps,
                           caption_for_all=caption_for_all, caption_prefix=trigger_word, resolution=resolution,
                           enable_buckets=aspect_buckets)
        collect_items(spec)  # validate now: a clear error on this node rather than later
        return io.NodeOutput(spec)


class FluxLoraSettingsNode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="SeedVR2BW_FluxLoraSettings",
            display_name="FLUX LoRA Training Settings",
            category=f"{CATEGORY}/training",
            inputs=[
                io.Int.Input("steps", default=1500, min=1, max=100000, tooltip="Optimizer steps."),
                io.Int.Input("rank", default=16, min=1, max=256),
                io.Float.Input("alpha", default=16.0, min=0.01, max=1024.0, step=0.5),
                io.Combo.Input("optimizer", options=list(OPTIMIZERS), default="adamw"),
                io.Float.Input("learning_rate", default=1e-4, min=1e-7, max=10.0, step=1e-5,
                               tooltip="AdamW: ~1e-4. Prodigy: 1.0 (it adapts the step itself)."),
                io.Combo.Input("lr_scheduler", options=list(SCHEDULERS), default="constant"),
                io.Int.Input("warmup_steps", default=0, min=0, max=10000),
                io.Int.Input("batch_size", default=1, min=1, max=64),
                io.Int.Input("grad_accumulation", default=1, min=1, max=64),
                io.Float.Input("max_grad_norm", default=1.0, min=0.0, max=100.0, step=0.1,
                               tooltip="0 disables clipping (recommended with Prodigy)."),
                io.Combo.Input("timestep_sampling", options=list(TIMESTEP_SAMPLINGS), default="sigmoid"),
                io.Float.Input("shift", default=3.1582, min=0.1, max=10.0, step=0.01,
                               tooltip="Used by timestep_sampling=shift."),
                io.Float.Input("guidance", default=1.0, min=0.0, max=10.0, step=0.1,
                               tooltip="FLUX-dev guidance input while training (1.0 recommended)."),
                io.Combo.Input("base_precision", options=list(BASE_PRECISIONS), default="auto",
                               tooltip="Frozen base: as loaded, bf16, fp8 (FP8 tensor cores on sm_89+) or nvfp4."),
                io.Boolean.Input("gradient_checkpointing", default=True),
                io.String.Input("double_blocks", default="all", tooltip="e.g. all, none, 0-7,12"),
                io.String.Input("single_blocks", default="all", tooltip="e.g. all, none, 0-19"),
                io.String.Input("per_type_ranks", default="",
                                tooltip=f"e.g. img_mod=0, txt_mlp=8. Types: {', '.join(LAYER_TYPES)}"),
                io.Int.Input("seed", default=42, min=0, max=2**31 - 1),
                io.Int.Input("save_every", default=250, min=0, max=100000, tooltip="0: only the final save."),
                io.Int.Input("keep_last", default=3, min=0, max=1000),
                io.Int.Input("preview_every", default=0, min=0, max=100000),
                io.String.Input("preview_seeds", default="1"),
                io.Boolean.Input("tensorboard", default=False),
                io.Int.Input("blocks_to_swap", default=-1, min=-1, max=57,
                             tooltip="FLUX blocks kept in host RAM and streamed to the GPU. -1: the memory plan's "
                                     "choice from the free VRAM (0 when everything fits)."),
                io.Combo.Input("selective_checkpointing", options=["auto", "on", "off"], default="auto",
                               optional=True,
                               tooltip="Keep each block's GEMM/attention outputs and recompute only the rest: "
                                       "faster, ~0.25 GiB per block at 1024². auto: as many blocks as fit in free "
                                       "GPU memory. off: full per-block checkpointing (least memory)."),
                io.Float.Input("caption_dropout", default=0.0, min=0.0, max=1.0, step=0.01, optional=True,
                               tooltip="Share of samples trained on the empty caption (works with cached text)."),
                io.Float.Input("ema_decay", default=0.0, min=0.0, max=0.99999, step=0.0001, optional=True,
                               tooltip="0: off. Else an average of the LoRA is saved as <name>_ema.safetensors "
                                       "(e.g. 0.999)."),
                io.Float.Input("validation_share", default=0.0, min=0.0, max=0.5, step=0.05, optional=True,
                               tooltip="Share of the dataset held out for validation loss (unless a validation "
                                       "dataset is connected to the train node)."),
                io.Int.Input("validation_every", default=0, min=0, max=100000, optional=True,
                             tooltip="Steps between validations (0: at the end only)."),
                io.Boolean.Input("keep_best", default=False, optional=True,
                                 tooltip="Keep <name>-best.safetensors: the LoRA of the lowest validation loss."),
                io.Float.Input("reg_weight", default=1.0, min=0.0, max=100.0, step=0.05, optional=True,
                               tooltip="Loss weight of the regularisation images (train node's reg_dataset)."),
                io.Float.Input("vram_budget_gib", default=0.0, min=0.0, max=1024.0, step=0.5, optional=True,
                               tooltip="VRAM the memory plan may use. 0: what ComfyUI can free on the GPU."),
            ],
            outputs=[LoraTrainingSettings.Output(display_name="settings")],
        )

    @classmethod
    def execute(cls, steps, rank, alpha, optimizer, learning_rate, lr_scheduler, warmup_steps, batch_size,
                grad_accumulation, max_grad_norm, timestep_sampling, shift, guidance, base_precision,
                gradient_checkpointing, double_blocks, single_blocks, per_type_ranks, seed, save_every, keep_last,
                preview_every, preview_seeds, tensorboard, blocks_to_swap,
                selective_checkpointing="auto", caption_dropout=0.0, ema_decay=0.0, validation_share=0.0,
                validation_every=0, keep_best=False, reg_weight=1.0, vram_budget_gib=0.0) -> io.NodeOutput:
        if optimizer == "prodigy" and learning_rate < 0.1:
            log.warning("[FluxLoraTrain] Prodigy adapts its own step: learning_rate should be 1.0 (got %g)",
                        learning_rate)
        seeds = tuple(int(s) for s in str(preview_seeds).replace(" ", "").split(",") if s)
        cfg = TrainConfig(rank=rank, alpha=alpha, steps=steps, optimizer=optimizer, learning_rate=learning_rate,
                          lr_scheduler=lr_scheduler, warmup_steps=warmup_steps, batch_size=batch_size,
                          grad_accum=grad_accumulation, max_grad_norm=max_grad_norm,
                          timestep_sampling=timestep_sampling, shift=shift, guidance=guidance,
                          base_precision=base_precision, gradient_checkpointing=gradient_checkpointing,
                          double_blocks=double_blocks, single_blocks=single_blocks,
                          type_ranks=_parse_type_ranks(per_type_ranks), seed=seed, save_every=save_every,
                          keep_last=keep_last, preview_every=preview_every, preview_seeds=seeds or (1,),
                          tensorboard_dir="tb" if tensorboard else "", blocks_to_swap=blocks_to_swap,
                          selective_checkpointing=selective_checkpointing, caption_dropout=caption_dropout,
                          ema_decay=ema_decay, validation_share=validation_share, validation_every=validation_every,
                          keep_best=keep_best, reg_weight=reg_weight, vram_budget_gib=vram_budget_gib)
        cfg.validate()
        return io.NodeOutput(cfg)


class FluxLoraTrainNode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="SeedVR2BW_FluxLoraTrain",
            display_name="FLUX LoRA Train",
            category=f"{CATEGORY}/training",
            description="Trains a LoRA on the connected FLUX model (frozen base, activation-side LoRA) and saves "
                        "it in kohya format into models/loras. Cancel saves what was trained; 'resume' continues "
                        "from the saved state of the same output name.",
            inputs=[
                io.Model.Input("model"),
                io.Vae.Input("vae"),
                io.Clip.Input("clip"),
                LoraDataset.Input("dataset"),
                LoraTrainingSettings.Input("settings"),
                io.String.Input("output_name", default="flux_lora",
                                tooltip="File name inside models/loras (sub-folders allowed)."),
                io.Boolean.Input("resume", default=True,
                                 tooltip="Continue from <output_name>-state.pt when it exists."),
                io.Boolean.Input("overwrite", default=False, optional=True,
                                 tooltip="Replace an existing LoRA of this name (without it, training stops with "
                                         "an error rather than replace it, unless 'resume' continues it)."),
                LoraDataset.Input("validation_dataset", optional=True,
                                  tooltip="Images for the validation loss (instead of a held-out share)."),
                LoraDataset.Input("reg_dataset", optional=True,
                                  tooltip="Regularisation (prior-preservation) images, trained at reg_weight."),
            ],
            outputs=[
                ComboName.Output(display_name="lora_name"),
                io.String.Output(display_name="lora_path"),
                io.Image.Output(display_name="loss_plot"),
                io.Image.Output(display_name="previews"),
            ],
            hidden=[io.Hidden.unique_id],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, model, vae, clip, dataset, settings, output_name, resume, overwrite=False,
                validation_dataset=None, reg_dataset=None) -> io.NodeOutput:
        import comfy.model_management as mm
        import comfy.utils
        import folder_paths
        node_id = getattr(getattr(cls, "hidden", None), "unique_id", None)
        dm = getattr(getattr(model, "model", None), "diffusion_model", None)
        if dm is None or not is_flux_diffusion_model(dm):
            raise TypeError(f"FLUX LoRA Train needs a FLUX model, got {type(dm).__name__ if dm is not None else type(model).__name__}. "
                            "Fix: load a FLUX.1 model (Load Diffusion Model / Load Checkpoint) and connect it.")
        lora_dir = folder_paths.get_folder_paths("loras")[0]
        out_dir, base = resolve_output_name(lora_dir, output_name)
        cfg = dataclasses.replace(settings, output_name=base, output_dir=out_dir)
        lora_file = os.path.join(out_dir, base + ".safetensors")
        resuming = check_overwrite(lora_file, os.path.join(out_dir, base + "-state.pt"), resume, overwrite)
        if cfg.tensorboard_dir:
            rel = os.path.relpath(os.path.join(out_dir, base), lora_dir)
            cfg.tensorboard_dir = os.path.join(folder_paths.get_output_directory(), "flux_lora_tb", rel)
        plan = _memory_plan(dm, cfg, dataset, model.load_device)   # before anything is encoded or loaded
        log.info("%s", plan.line())
        cfg = plan.apply(cfg)
        cache_dir = os.path.join(folder_paths.get_output_directory(), "flux_lora_cache")
        pbar = comfy.utils.ProgressBar(cfg.steps, node_id=node_id)

        def encode(spec):
            return None if spec is None else encode_dataset(
                spec, vae, clip, cache_dir=cache_dir, check_interrupt=mm.throw_exception_if_processing_interrupted)
        data, val, reg = encode(dataset), encode(validation_dataset), encode(reg_dataset)
        device = model.load_device
        _host_model(model, device)
        if device.type == "cpu":
            cfg.compute_dtype = "fp32"
        if cfg.base_precision == "bf16" and dm.dtype not in (torch.bfloat16,):
            log.info("[FluxLoraTrain] base stored as %s; training computes in bf16", dm.dtype)
        trainer = FluxLoraTrainer(dm, cfg, data, latent_format=model.model.latent_format, device=device, vae=vae,
                                  validation=val, regularization=reg)
        info = {"num_images": len(data), "resolution": dataset.resolution,
                "buckets": {f"{k[-1] * 8}x{k[-2] * 8}": len(v) for k, v in data.buckets.items()},
                "captions": {}}
        try:
            if resuming:
                trainer.load_state()
                log.info("[FluxLoraTrain] resumed %s at step %d", trainer.state_path(), trainer.step)
            server = None
            try:
                from server import PromptServer
                server = PromptServer.instance
            except Exception:  # noqa: BLE001
                pass

            def on_step(step, total, loss, dt, tr):
                pbar.update_absolute(step, total)
                if server is not None and node_id is not None:
                    try:
                        server.send_progress_text(f"step {step}/{total}  loss {loss:.4f}  {dt:.2f} s/step  "
                                                  f"lr {tr.current_lr():.2e}", node_id)
                    except Exception:  # noqa: BLE001
                        pass
                if step % 50 == 0 or step == total:
                    log.info("[FluxLoraTrain] step %d/%d loss %.4f %.3f s/step", step, total, loss, dt)

            path = trainer.run(on_step=on_step, check_interrupt=mm.throw_exception_if_processing_interrupted,
                               dataset_info=info)
        finally:
            trainer.close()
        plot = render_loss_curve(trainer.losses, validation=trainer.best.history)
        if trainer.previews:
            previews = torch.cat([p for _, p in trainer.previews]).clamp(0, 1)
        else:
            previews = torch.zeros(1, 64, 64, 3)
        lora_name = os.path.relpath(path, lora_dir).replace(os.sep, "/")
        return io.NodeOutput(lora_name, path, plot, previews, ui={"text": [f"saved {lora_name} ({trainer.step} steps)"]})


def _host_model(model, device):
    """The model's weights in host RAM, unpatched, and ComfyUI's GPU emptied: the trainer stages the base onto the
    GPU as the memory plan says (resident blocks copied in, the others streamed, nothing copied back), so a card
    smaller than the model never holds it whole."""
    import comfy.model_management as mm
    mm.free_memory(1e30, device)   # the models ComfyUI holds there (this one too) go back to their offload device
    if getattr(model, "patches", None):
        log.warning("[FluxLoraTrain] the connected model carries weight patches (e.g. a LoRA applied to it); the "
                    "LoRA trains on the model as loaded, without them")


def _memory_plan(dm, cfg, spec, device):
    """The run's memory plan from the VRAM ComfyUI can free on ``device`` (or the settings' budget) and free host
    RAM; raises ``TrainMemoryError`` before anything is loaded when nothing fits."""
    vram = None
    if device.type == "cuda":
        from .staging import comfy_budget
        vram = comfy_budget(device)
    if cfg.vram_budget_gib > 0:   # also on the CPU: a budget to plan for (tests, dry runs)
        vram = int(cfg.vram_budget_gib * GiB) if vram is None else min(vram, int(cfg.vram_budget_gib * GiB))
    budget = DeviceBudget.of(device, vram)
    images = len(collect_items(spec))
    req = PlanRequest(resolution=spec.resolution, batch_size=cfg.batch_size, grad_accum=cfg.grad_accum, rank=cfg.rank,
                      base_precision=cfg.base_precision, blocks_to_swap=cfg.blocks_to_swap,
                      selective=str(cfg.selective_checkpointing).lower(),
                      gradient_checkpointing=cfg.gradient_checkpointing,
                      cache_bytes=images * 16 * (spec.resolution // 8) ** 2 * 4)
    return plan_training(flux_dims(dm), req, budget)


NODES = [FluxLoraDatasetNode, FluxLoraSettingsNode, FluxLoraTrainNode]
