"""Selective activation checkpointing for FLUX blocks: a block's GEMM and attention outputs are kept from its
forward; its backward recomputes only the cheap ops between them (norms, modulation, RoPE, GELU, residuals,
the rank-r LoRA up-projections).

Why: with per-block checkpointing every block runs its forward twice. At 1024² on an H100 the recomputed GEMMs
and attention forward are ~1/3 of the step's GEMM time and ~1/4 of its attention time; what they produce is
~0.25 GiB per block at 1024² (bf16), ~14 GiB for FLUX.1's 57 blocks. ``plan_selective_blocks`` gives that
treatment to as many blocks as fit in the free GPU memory, the rest keep full per-block checkpointing.

How: ``torch.utils.checkpoint`` (non-reentrant) with a ``context_fn`` from
``create_selective_checkpoint_contexts``: ops the policy marks MUST_SAVE return their stored forward result in
the recompute; autograd differentiates them as usual (same values, same graph), so gradients are those of full
checkpointing.
"""
from __future__ import annotations

import functools
import logging

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from . import lora_linear_op
from .linear_patch import lora_of

log = logging.getLogger(__name__)
MODES = ("auto", "on", "off")
ENV = "SEEDVR2BW_TRAIN_SELECTIVE_CKPT"

# A GEMM whose reduction dim is below this is a LoRA up-projection (K = rank): recomputing it costs little and its
# output is as large as the base GEMM's, so it is not kept.
MIN_SAVED_K = 512
HEADROOM_BYTES = 2 << 30   # kept free beyond the estimate: cuBLAS/cuDNN workspaces, allocator fragmentation


def _ops(*names):
    out = set()
    for n in names:
        pkt = getattr(torch.ops.aten, n, None)
        if pkt is not None:
            out.update(getattr(pkt, o) for o in pkt.overloads())
    return frozenset(out)


_ATTENTION = _ops("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu",
                  "_flash_attention_forward", "_efficient_attention_forward")
# by name, not by object: importing the pack a second time under another package name (ComfyUI loads it from its
# folder, scripts and tests as ``seedvr2bw``) registers the operators again, and the dispatcher then hands out new
# OpOverload objects
LORA_OP_NAMES = frozenset(op._opoverload.name() for op in (lora_linear_op.lora_linear, lora_linear_op.fp8_lora_linear))
# GEMM overloads -> the index of their left operand, whose last dim is the reduction dim K
GEMM_LHS = {op: i for names, i in ((("mm", "_scaled_mm"), 0), (("addmm",), 1)) for op in _ops(*names)}


def save_policy(ctx, func, *args, **kwargs):
    """MUST_SAVE for attention forwards, the base+LoRA operators (``lora_linear_op``) and GEMMs contracting over
    K >= MIN_SAVED_K; recompute the rest."""
    if func in _ATTENTION or func.name() in LORA_OP_NAMES:
        return CheckpointPolicy.MUST_SAVE
    i = GEMM_LHS.get(func)
    if i is not None and args[i].shape[-1] >= MIN_SAVED_K:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


context_fn = functools.partial(create_selective_checkpoint_contexts, save_policy)


def _linears(block):
    # a Linear's LoRA is not a submodule (``linear_patch.attach_lora``): only the block's own Linears are seen here
    for name, m in block.named_modules():
        if hasattr(m, "in_features") and hasattr(m, "out_features"):
            yield name, m


def saved_bytes(block, batch: int, t_img: int, t_txt: int, elem: int = 2) -> int:
    """Bytes ``save_policy`` keeps for one call of ``block`` (a FLUX.1 double or single block): the outputs of its
    token-wise Linears with K >= MIN_SAVED_K (img_*/txt_* ones see their stream's tokens, the rest all tokens;
    modulation Linears see one vector per sample), their LoRA down-projections, and the attention output with its
    fp32 log-sum-exp."""
    total, hidden, heads = 0, 0, int(getattr(block, "num_heads", 0) or 0)
    for name, m in _linears(block):
        if m.in_features < MIN_SAVED_K:
            continue
        first = name.split(".")[0]
        tokens = 1 if "mod" in first else t_img if first.startswith("img_") else t_txt \
            if first.startswith("txt_") else t_img + t_txt
        lora = lora_of(m)
        width = m.out_features + (lora.rank if lora is not None else 0)
        total += batch * tokens * width * elem
        hidden = max(hidden, m.in_features)
    hidden = int(getattr(block, "hidden_size", 0) or hidden)
    t = t_img + t_txt
    return total + batch * t * hidden * elem + batch * heads * t * 4


def plan_selective_blocks(costs: list, free_bytes: int, boundary_bytes: int) -> int:
    """How many blocks (in run order) keep their GEMM/attention outputs within ``free_bytes``: what full
    checkpointing needs on top of the model (the block boundary tensors kept for the backward and one block's
    recompute, estimated as 3x the largest block's saved outputs) and HEADROOM_BYTES stay free."""
    return blocks_within(costs, free_bytes - boundary_bytes - 3 * max(costs, default=0) - HEADROOM_BYTES)


def blocks_within(costs: list, budget: int) -> int:
    """How many of the first blocks' ``costs`` (in run order) add up to at most ``budget`` bytes."""
    n, used = 0, 0
    for c in costs:
        if used + c > budget:
            break
        used += c
        n += 1
    return n


