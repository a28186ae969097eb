"""Calling ComfyUI's FLUX ``diffusion_model`` for training.

* Per-block gradient checkpointing through ComfyUI's own seam (``transformer_options["patches_replace"]["dit"]``,
  keys ``("double_block", i)`` / ``("single_block", i)``), so the model class is used as it is.
* FLUX blocks update tensors in place (``img += ...``) after LayerNorm saved them for backward: eager autograd
  refuses that, and a checkpoint recompute silently uses the changed tensors (wrong gradients: with ComfyUI's
  TrainLoraNode, one SGD step on a 1+1-block FLUX with checkpointing differed from one without by a median 0.20
  relative; tests/test_training_cpu.py::test_checkpointing_gradients_match guards ours). FLUX.1 blocks therefore
  run through ``double_block_forward`` /
  ``single_block_forward`` below: the same ComfyUI modules and weights, with out-of-place residual adds.
* Attention goes through ComfyUI's ``optimized_attention``; when that is the sub-quadratic or split kernel (their
  chunk size follows free memory, which differs between forward and recompute: Comfy-Org/ComfyUI#15845), we
  override it with ComfyUI's ``attention_pytorch`` (SDPA), which is deterministic in shape.
"""
from __future__ import annotations

import logging
import types

import torch
from torch.utils.checkpoint import checkpoint

from . import rope_kernel
from ..optimization.runtime.device import free_device_bytes
from . import selective_checkpoint as sc
from .lora import PinnedWeights, block_loras
from .recompute import recompute


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


def _flux1_double(b) -> bool:
    return getattr(b, "modulation", False) is True and not getattr(b, "flipped_img_txt", False) \
        and hasattr(b, "img_mod") and hasattr(b, "txt_mod")


def _flux1_single(b) -> bool:
    return getattr(b, "modulation", None) is not None and hasattr(b, "mlp_act")


def rope_pairs_torch(x, cos, sin):
    """FLUX RoPE on adjacent pairs in fp32, in torch (what ``rope_kernel.rope_pairs`` computes in one kernel)."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).to(x.dtype)


def _rotate(x, cos, sin, sign=1.0):
    if rope_kernel.usable(x, cos):
        return rope_kernel.rope_pairs(x, cos, sin, sign)
    return rope_pairs_torch(x, cos, sin if sign > 0 else -sin)


class RopeFn(torch.autograd.Function):
    """RoPE as ComfyUI's ``apply_rope1`` computes it (fp32), with an explicit backward (rotation by -angle).

    Autograd through ComfyUI's broadcasting form reduces over a size-2 axis for every q/k gradient, which
    profiled as the largest non-GEMM cost of a training step."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return _rotate(g, cos, sin, -1.0), None, None


_CS = [None, -1, None]  # (pe, pe._version, (cos, sin)) of the last call: every block of a step shares one pe


def rope_cos_sin(pe):
    """(cos, sin) of ComfyUI's ``pe``; cached for the last ``pe`` (every block of a step shares one)."""
    # ComfyUI's pe: [..., L, D/2, 2, 2] = [[cos, -sin], [sin, cos]]
    c = _CS
    if c[0] is pe and c[1] == pe._version:
        return c[2]
    cs = pe[..., 0, 0].contiguous(), pe[..., 1, 0].contiguous()
    c[0], c[1], c[2] = pe, pe._version, cs
    return cs


def _attention(q, k, v, pe, attn_mask, topts):
    from comfy.ldm.modules.attention import optimized_attention
    if pe is not None:
        if torch.compiler.is_compiling():
            # inside a compiled block: plain ops, so Inductor fuses RoPE (and its backward) with its neighbours
            cos, sin = pe[..., 0, 0], pe[..., 1, 0]
            q, k = rope_pairs_torch(q, cos, sin), rope_pairs_torch(k, cos, sin)
        else:
            cos, sin = rope_cos_sin(pe)
            q, k = RopeFn.apply(q, cos, sin), RopeFn.apply(k, cos, sin)
    return optimized_attention(q, k, v, q.shape[1], skip_reshape=True, mask=attn_mask, transformer_options=topts)


def double_block_forward(b, img, txt, vec, pe, attn_mask, topts):
    """``DoubleStreamBlock.forward`` of ComfyUI 0.3.75 without its in-place updates (autograd-safe).

    ComfyUI's version does ``img += ...`` after ``img_norm1(img)``/``img_norm2(img)`` saved ``img`` for backward:
    plain autograd refuses that, and a checkpoint recompute silently uses the changed tensor.
    Same modules, same weights, same arithmetic order otherwise (checked against the original in the tests).
    """
    attention = _attention
    img_mod1, img_mod2 = b.img_mod(vec)
    txt_mod1, txt_mod2 = b.txt_mod(vec)
    H = b.num_heads

    def qkv(stream, x, m):
        x = torch.addcmul(m.shift, stream[0](x), 1 + m.scale)
        t = stream[1].qkv(x)
        q, k, v = t.view(t.shape[0], t.shape[1], 3, H, -1).permute(2, 0, 3, 1, 4)
        q, k = stream[1].norm(q, k, v)
        return q, k, v

    iq, ik, iv = qkv((b.img_norm1, b.img_attn), img, img_mod1)
    tq, tk, tv = qkv((b.txt_norm1, b.txt_attn), txt, txt_mod1)
    attn = attention(torch.cat((tq, iq), dim=2), torch.cat((tk, ik), dim=2), torch.cat((tv, iv), dim=2),
                     pe, attn_mask, topts)
    T = txt.shape[1]
    txt_attn, img_attn = attn[:, :T], attn[:, T:]
    img = torch.addcmul(img, b.img_attn.proj(img_attn), img_mod1.gate)
    img = torch.addcmul(img, b.img_mlp(torch.addcmul(img_mod2.shift, b.img_norm2(img), 1 + img_mod2.scale)),
                        img_mod2.gate)
    txt = torch.addcmul(txt, b.txt_attn.proj(txt_attn), txt_mod1.gate)
    txt = torch.addcmul(txt, b.txt_mlp(torch.addcmul(txt_mod2.shift, b.txt_norm2(txt), 1 + txt_mod2.scale)),
                        txt_mod2.gate)
    return img, txt


def single_block_forward(b, x, vec, pe, attn_mask, topts):
    """``SingleStreamBlock.forward`` of ComfyUI 0.3.75 without the in-place ``x += ...``."""
    mod, _ = b.modulation(vec)
    h = b.linear1(torch.addcmul(mod.shift, b.pre_norm(x), 1 + mod.scale))
    qkv, mlp = torch.split(h, [3 * b.hidden_size, b.mlp_hidden_dim_first], dim=-1)
    q, k, v = qkv.view(qkv.shape[0], qkv.shape[1], 3, b.num_heads, -1).permute(2, 0, 3, 1, 4)
    q, k = b.norm(q, k, v)
    attn = _attention(q, k, v, pe, attn_mask, topts)
    out = b.linear2(torch.cat((attn, b.mlp_act(mlp)), 2))
    return torch.addcmul(x, out, mod.gate)


# torch.compile'd block forwards while a trainer compiles its blocks (FluxTrainForward(compile_blocks=True)):
# Inductor fuses the ~40 elementwise kernels per block (LayerNorm + modulation, RMSNorm, RoPE, GELU, gated
# residuals, the q/k/v concatenation) in the forward and in the backward, which profiled at ~40 % of a 1024² step
# on an H100 once the host overhead was gone (CUDA graphs). Same modules and weights; GEMMs and attention stay
# cuBLAS / SDPA.
_COMPILED = {"double": None, "single": None}


def _run_block(kind, eager, *args):
    fn = _COMPILED[kind]
    if fn is None:
        return eager(*args)
    try:
        return fn(*args)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - a compiler failure on this setup: train uncompiled instead
        if torch.cuda.is_current_stream_capturing():
            raise
        logging.getLogger(__name__).warning(
            "[FluxLoraTrain] compiled block forwards failed (%s: %s); continuing uncompiled (compile_blocks off / "
            "SEEDVR2BW_TRAIN_COMPILE=0 skips the attempt)", type(exc).__name__, str(exc).splitlines()[0][:200]
            if str(exc) else "")
        compile_block_forwards(False)
        return eager(*args)


def _double_method(self, img, txt, vec, pe, attn_mask=None, transformer_options={}, **kw):
    return _run_block("double", double_block_forward, self, img, txt, vec, pe, attn_mask, transformer_options)


def _single_method(self, x, vec, pe, attn_mask=None, transformer_options={}, **kw):
    return _run_block("single", single_block_forward, self, x, vec, pe, attn_mask, transformer_options)


def compile_block_forwards(enable: bool):
    """Turns the compiled block forwards on (compiled lazily, once per block type and shape) or off."""
    if enable:
        if _COMPILED["double"] is None:
            _COMPILED["double"] = torch.compile(double_block_forward, dynamic=False)
            _COMPILED["single"] = torch.compile(single_block_forward, dynamic=False)
    else:
        _COMPILED["double"] = _COMPILED["single"] = None


class _BlockCheckpoint(torch.autograd.Function):
    """Per-block checkpoint with little host work: the forward runs under ``no_grad`` (no autograd graph, no
    saved-tensor pack hooks), the backward recomputes the block with grad and differentiates it with one
    ``torch.autograd.grad`` call. The block's LoRA weights (the per-step cast/transposed tensors, or the master
    weights' views outside ``cast_cache``) are explicit inputs, so their gradients flow back through this node
    even where no block input requires grad (the first block: FLUX's embedders are frozen). Same arithmetic as
    ``torch.utils.checkpoint`` (non-reentrant), which saves and detaches every tensor the block's autograd graph
    would keep, once in the forward and again in the recompute.

    Used when the block's closed-over inputs (``vec``, ``pe``, mask) need no gradient and no BlockSwap runner is
    attached (its prefetch order looks at ``torch.is_grad_enabled()``); otherwise ``torch.utils.checkpoint``."""

    @staticmethod
    def forward(ctx, run, loras, n_in, *args):
        ctx.run, ctx.loras, ctx.n_in = run, loras, n_in
        ctx.save_for_backward(*args)
        with torch.no_grad(), PinnedWeights(loras, args[n_in:]):
            out = run(*args[:n_in])
        return out

    @staticmethod
    def backward(ctx, *gs):
        saved = ctx.saved_tensors
        n = ctx.n_in
        ins = [t.detach().requires_grad_(t.requires_grad) for t in saved[:n]]
        ws = [t.detach().requires_grad_(t.requires_grad) for t in saved[n:]]
        with recompute, torch.enable_grad(), PinnedWeights(ctx.loras, ws):
            out = ctx.run(*ins)
        outs = out if isinstance(out, tuple) else (out,)
        o_g = [(o, g) for o, g in zip(outs, gs) if g is not None and o.requires_grad]
        need = [t for t in ins + ws if t.requires_grad]
        grads = iter(torch.autograd.grad([o for o, _ in o_g], need, [g for _, g in o_g], allow_unused=True)
                     if o_g and need else [None] * len(need))
        return (None, None, None) + tuple(next(grads) if t.requires_grad else None for t in ins + ws)


def _shape_key(x_t, context):
    return tuple(x_t.shape), tuple(context.shape), x_t.dtype


class FluxTrainForward:
    """Runs ``dm(x_t, sigma, context, y, guidance)`` with per-block checkpointing.

    While training, FLUX.1 blocks get the autograd-safe forwards as per-instance ``forward`` (undone by
    ``close``), and blocks are always called as modules, so module hooks on a block (BlockSwap's runner
    materialises a swapped block's weights in its pre-hook, also during the backward recompute) still fire.
    """

    def __init__(self, dm, gradient_checkpointing: bool = True, block_runner=None, compile_blocks: bool = False,
                 selective: str = "off", selective_budget: int | None = None):
        self.dm = dm
        # "auto" keeps blocks' outputs within this many bytes (the memory plan's figure); None: measure free memory
        self.selective_budget = selective_budget
        # selective checkpointing (selective_checkpoint.py): "on" every block, "auto" as many as fit in free GPU
        # memory (decided once per input shape), "off" none
        self.selective = selective
        self._selective_n = {}   # input-shape key -> number of blocks (in run order) checkpointed selectively
        self._n_sel = 0          # that number for the call in progress
        self.compile_blocks = compile_blocks
        compile_block_forwards(compile_blocks)
        self.gradient_checkpointing = gradient_checkpointing
        self.block_runner = block_runner
        self.attn_override = _attention_override()
        self.fast_checkpoint = True  # _BlockCheckpoint where it applies; False: torch.utils.checkpoint everywhere
        self._patched = []
        self._loras = {}  # id(block) -> its LoRA modules (read at the first checkpointed call)
        for b in dm.double_blocks:
            if _flux1_double(b) and "forward" not in b.__dict__:
                b.forward = types.MethodType(_double_method, b)
                self._patched.append(b)
        for b in dm.single_blocks:
            if _flux1_single(b) and "forward" not in b.__dict__:
                b.forward = types.MethodType(_single_method, b)
                self._patched.append(b)

    @property
    def compiled(self) -> bool:
        """Whether blocks run compiled now (False after a compiler failure turned it off)."""
        return self.compile_blocks and _COMPILED["double"] is not None

    @property
    def selective_by_shape(self) -> dict:
        """Input-shape key -> how many blocks (in run order) are checkpointed selectively for it, as decided."""
        return dict(self._selective_n)

    @property
    def selective_now(self) -> int:
        """How many blocks the call in progress checkpoints selectively."""
        return self._n_sel

    def set_selective(self, mode: str) -> None:
        """Selective checkpointing ``mode`` (auto/on/off) from now on; the per-shape decisions are made again."""
        self.selective = mode
        self._selective_n = {}

    def close(self):
        _CS[0], _CS[1], _CS[2] = None, -1, None
        if self.compile_blocks:
            compile_block_forwards(False)
        for b in self._patched:
            b.__dict__.pop("forward", None)
        self._patched = []

    def run_block(self, fn, *tensors, block=None, closed=(), order=0):
        """``fn(*tensors)`` for ``block`` (``order``-th in run order; ``closed``: the tensors ``fn`` closes over),
        checkpointed as set: selectively, by ``_BlockCheckpoint``, by ``torch.utils.checkpoint``, or not at all."""
        if self.gradient_checkpointing and torch.is_grad_enabled():
            if order < self._n_sel:
                return checkpoint(fn, *tensors, use_reentrant=False, preserve_rng_state=False,
                                  context_fn=sc.context_fn)
            if block is not None and self.fast_checkpoint and self.block_runner is None and \
                    not any(getattr(t, "requires_grad", False) for t in closed):
                loras = self._loras.get(id(block))
                if loras is None:
                    loras = self._loras[id(block)] = block_loras(block)
                dt = tensors[0].dtype
                ws = [w for m in loras for w in m.compute_weights(dt)]
                return _BlockCheckpoint.apply(fn, loras, len(tensors), *tensors, *ws)
            return checkpoint(fn, *tensors, use_reentrant=False, preserve_rng_state=False)
        return fn(*tensors)

    def _double(self, i):
        def replace(args, extra):
            # ComfyUI's ``original_block`` closes over the loop variable ``block`` (late binding): called again
            # during the backward recompute it would run the *last* block. Call our own block directly.
            block = self.dm.double_blocks[i]
            vec, pe, mask = args["vec"], args["pe"], args.get("attn_mask")
            topts = dict(args.get("transformer_options") or {})  # block_index etc. as of this block

            copy = block not in self._patched  # other FLUX variants: the original block on its own input copies

            def run(img, txt):
                if copy:
                    img, txt = img.clone(), txt.clone()
                return block(img=img, txt=txt, vec=vec, pe=pe, attn_mask=mask, transformer_options=topts)

            img, txt = self.run_block(run, args["img"], args["txt"], block=block, closed=(vec, pe, mask), order=i)
            return {"img": img, "txt": txt}
        return replace

    def _single(self, i):
        def replace(args, extra):
            block = self.dm.single_blocks[i]
            vec, pe, mask = args["vec"], args["pe"], args.get("attn_mask")
            topts = dict(args.get("transformer_options") or {})  # block_index etc. as of this block

            copy = block not in self._patched

            def run(img):
                return block(img.clone() if copy else img, vec=vec, pe=pe, attn_mask=mask, transformer_options=topts)

            return {"img": self.run_block(run, args["img"], block=block, closed=(vec, pe, mask),
                                      order=len(self.dm.double_blocks) + i)}
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

    def selective_blocks(self, x_t, context) -> int:
        """Blocks (in run order) checkpointed selectively for inputs of these shapes; decided at the first call
        of a shape (so a CUDA graph's warm-up and capture agree) and logged once."""
        if self.selective == "off" or not self.gradient_checkpointing:
            return 0
        key = _shape_key(x_t, context)
        n = self._selective_n.get(key)
        if n is None:
            blocks = list(self.dm.double_blocks) + list(self.dm.single_blocks)
            if self.selective == "on":
                n, why = len(blocks), "selective_checkpointing=on"
            elif x_t.device.type != "cuda" and self.selective_budget is None:
                n, why = 0, f"auto: device {x_t.device.type}"
            else:
                p = getattr(self.dm, "patch_size", 2)
                b, t_img, t_txt = x_t.shape[0], (x_t.shape[-2] // p) * (x_t.shape[-1] // p), context.shape[1]
                elem = x_t.element_size()
                costs = [sc.saved_bytes(blk, b, t_img, t_txt, elem) for blk in blocks]
                if self.selective_budget is not None:
                    n = sc.blocks_within(costs, self.selective_budget)
                    why = f"memory plan: {sum(costs[:n]) / 2**30:.2f} of {self.selective_budget / 2**30:.2f} GiB kept"
                else:
                    free = free_device_bytes(x_t.device)
                    n = sc.plan_selective_blocks(costs, free,
                                                 len(blocks) * b * (t_img + t_txt) * self.dm.hidden_size * elem)
                    why = f"auto: {sum(costs[:n]) / 2**30:.1f} GiB kept of {free / 2**30:.1f} GiB free"
            self._selective_n[key] = n
            logging.getLogger(__name__).info(
                "[FluxLoraTrain] selective checkpointing for input %s: %d of %d blocks keep their GEMM/attention "
                "outputs (%s; %s=off for full per-block checkpointing)", list(x_t.shape), n, len(blocks), why, sc.ENV)
        return n

    def fall_back_to_full(self, x_t, context) -> bool:
        """After an out-of-memory error: full per-block checkpointing for this input shape from now on.
        Returns whether anything changed (False: the error did not come from selective checkpointing)."""
        key = _shape_key(x_t, context)
        if not self._selective_n.get(key):
            return False
        self._selective_n[key] = 0
        return True

    def __call__(self, x_t, sigma, context, y, guidance=None):
        self._n_sel = self.selective_blocks(x_t, context) if torch.is_grad_enabled() else 0
        guid = None
        if getattr(self.dm.params, "guidance_embed", False):
            g = 1.0 if guidance is None else guidance
            guid = torch.full((x_t.shape[0],), float(g), device=x_t.device, dtype=torch.float32)
        return self.dm(x_t, sigma, context, y=y, guidance=guid, transformer_options=self.transformer_options())
