"""Calling ComfyUI's FLUX ``diffusion_model`` for training.

* Per-block gradient checkpointing through ComfyUI's own seam (``transformer_options["patches_replace"]["dit"]``,
  keys ``("double_block", i)`` / ``("single_block", i)``), so the model class is used as it is.
* FLUX blocks update their inputs in place (``img += ...``). A checkpointed block recomputed from inputs that the
  first pass already changed gives wrong gradients (see notes/peer_figures_h100.md), so every block runs on its
  own copies of ``img``/``txt``.
* Attention goes through ComfyUI's ``optimized_attention``; when that is the sub-quadratic or split kernel (their
  chunk size follows free memory, which differs between forward and recompute: Comfy-Org/ComfyUI#15845), we
  override it with ComfyUI's ``attention_pytorch`` (SDPA), which is deterministic in shape.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _attention_override():
    try:
        import comfy.ldm.modules.attention as A
    except Exception:  # noqa: BLE001
        return None
    chosen = getattr(A, "optimized_attention", None)
    name = getattr(chosen, "__name__", "")
    if name in ("attention_sub_quad", "attention_split", "attention_basic"):
        sdpa = A.attention_pytorch

        def override(func, *args, **kwargs):
            return sdpa(*args, **kwargs)
        return override
    return None


class FluxTrainForward:
    """Runs ``dm(x_t, sigma, context, y, guidance)`` with per-block checkpointing and optional block runner."""

    def __init__(self, dm, gradient_checkpointing: bool = True, block_runner=None):
        self.dm = dm
        self.gradient_checkpointing = gradient_checkpointing
        self.block_runner = block_runner  # object with .before(kind, i) / .after(kind, i) (BlockSwap), or None
        self.attn_override = _attention_override()

    def _ckpt(self, fn, *tensors):
        if self.gradient_checkpointing and torch.is_grad_enabled():
            return checkpoint(fn, *tensors, use_reentrant=False, preserve_rng_state=False)
        return fn(*tensors)

    def _double(self, i):
        def replace(args, extra):
            orig = extra["original_block"]
            rest = {k: v for k, v in args.items() if k not in ("img", "txt", "vec", "pe")}
            vec, pe = args["vec"], args["pe"]

            def run(img, txt):
                a = dict(rest)
                a.update(img=img.clone(), txt=txt.clone(), vec=vec, pe=pe)
                out = orig(a)
                return out["img"], out["txt"]

            if self.block_runner is not None:
                self.block_runner.before("double", i)
            img, txt = self._ckpt(run, args["img"], args["txt"])
            return {"img": img, "txt": txt}
        return replace

    def _single(self, i):
        def replace(args, extra):
            orig = extra["original_block"]
            rest = {k: v for k, v in args.items() if k not in ("img", "vec", "pe")}
            vec, pe = args["vec"], args["pe"]

            def run(img):
                a = dict(rest)
                a.update(img=img.clone(), vec=vec, pe=pe)
                return orig(a)["img"]

            if self.block_runner is not None:
                self.block_runner.before("single", i)
            return {"img": self._ckpt(run, args["img"])}
        return replace

    def transformer_options(self) -> dict:
        dit = {}
        for i in range(len(self.dm.double_blocks)):
            dit[("double_block", i)] = self._double(i)
        for i in range(len(self.dm.single_blocks)):
            dit[("single_block", i)] = self._single(i)
        opts = {"patches_replace": {"dit": dit}}
        if self.attn_override is not None:
            opts["optimized_attention_override"] = self.attn_override
        return opts

    def __call__(self, x_t, sigma, context, y, guidance=None):
        guid = None
        if getattr(self.dm.params, "guidance_embed", False):
            g = 1.0 if guidance is None else guidance
            guid = torch.full((x_t.shape[0],), float(g), device=x_t.device, dtype=torch.float32)
        return self.dm(x_t, sigma, context, y=y, guidance=guid, transformer_options=self.transformer_options())
