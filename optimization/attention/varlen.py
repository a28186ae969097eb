"""Variable-length (packed) attention: one entry point, backends chosen by name.

Layout (flash-attn's): q/k/v are ``(total_tokens, heads, head_dim)``; segment ``i`` of q is
``q[cu_seqlens_q[i]:cu_seqlens_q[i+1]]`` and attends, without a mask and without causality, to segment
``i`` of k/v. Softmax scale is ``1/sqrt(head_dim)``.

Backends
--------
``reference``  one SDPA call per segment (Python loop): slow, the oracle for tests.
``sdpa``       segments of equal (q_len, k_len) are gathered into one batched SDPA call per group.
               SeedVR2's joint windows are mostly equal-sized, so this is a handful of calls per layer.
``flash_attn`` ``flash_attn.flash_attn_varlen_func`` (CUDA, fp16/bf16).
``sage``       ``sageattention.sageattn_varlen`` (CUDA, fp16/bf16).
``torch_varlen`` ``torch.nn.attention.varlen.varlen_attn`` (PyTorch >= 2.10, CUDA, fp16/bf16): the
               flash-attention varlen kernel that ships inside PyTorch, no gathers.

The grouping of ``sdpa`` needs the segment lengths on the host. A caller that runs the same layout many
times (every DiT block) builds a :class:`VarlenPlan` once with :func:`make_varlen_plan` and passes
``plan=``; without one the plan is built (and memoised) from ``cu_seqlens`` at each call.
"""
from __future__ import annotations

import importlib
import importlib.util
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from ..runtime import selftests

__all__ = [
    "VarlenPlan",
    "make_varlen_plan",
    "varlen_attention",
    "available_backends",
    "backend_unavailable_reason",
    "resolve_backend",
    "BACKENDS",
    "CHOICES",
]


# --------------------------------------------------------------------------------------------------
# Plan: host-side segment bookkeeping, built once per layout
# --------------------------------------------------------------------------------------------------
@dataclass
class VarlenGroup:
    q_len: int
    k_len: int
    q_idx: torch.Tensor  # (n, q_len) int64 token indices into q
    k_idx: torch.Tensor  # (n, k_len) int64 token indices into k/v
    q_flat: torch.Tensor  # (n*q_len,) same as q_idx.flatten(), for the scatter back
    q_start: Optional[int] = None  # set when the group's q segments are back to back (a view suffices)
    k_start: Optional[int] = None


@dataclass
class VarlenPlan:
    """Everything the backends need about one packed layout, on one device."""

    cu_seqlens_q: torch.Tensor  # int32 (n+1,) on device
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    q_lens: List[int]
    k_lens: List[int]
    total_q: int
    total_k: int
    groups: List[VarlenGroup] = field(default_factory=list)

    @property
    def num_segments(self) -> int:
        return len(self.q_lens)


def _as_list(x) -> List[int]:
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.tolist()]
    return [int(v) for v in x]


def make_varlen_plan(cu_seqlens_q, cu_seqlens_k=None, device=None) -> VarlenPlan:
    """Build the plan for a layout. ``cu_seqlens_*`` may be tensors (any device) or int sequences."""
    cq = _as_list(cu_seqlens_q)
    ck = cq if cu_seqlens_k is None else _as_list(cu_seqlens_k)
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q has {len(cq) - 1} segments, cu_seqlens_k has {len(ck) - 1}")
    if device is None:
        device = cu_seqlens_q.device if isinstance(cu_seqlens_q, torch.Tensor) else torch.device("cpu")
    q_lens = [b - a for a, b in zip(cq[:-1], cq[1:])]
    k_lens = [b - a for a, b in zip(ck[:-1], ck[1:])]

    # Group segments by (q_len, k_len); each group becomes one batched SDPA call.
    by_shape: Dict[Tuple[int, int], List[int]] = OrderedDict()
    for i, (lq, lk) in enumerate(zip(q_lens, k_lens)):
        if lq == 0:
            continue  # an empty query segment produces nothing
        by_shape.setdefault((lq, lk), []).append(i)

    groups = []
    for (lq, lk), seg in by_shape.items():
        qs = torch.tensor([cq[i] for i in seg], dtype=torch.int64)
        ks = torch.tensor([ck[i] for i in seg], dtype=torch.int64)
        q_idx = qs[:, None] + torch.arange(lq)[None, :]
        k_idx = ks[:, None] + torch.arange(lk)[None, :]
        # Segments stored back to back (e.g. a single segment) can be read as a view, no gather.
        q_start = int(qs[0]) if bool((qs == qs[0] + lq * torch.arange(len(seg))).all()) else None
        k_start = int(ks[0]) if bool((ks == ks[0] + lk * torch.arange(len(seg))).all()) else None
        groups.append(
            VarlenGroup(
                q_len=lq,
                k_len=lk,
                q_idx=q_idx.to(device),
                k_idx=k_idx.to(device),
                q_flat=q_idx.flatten().to(device),
                q_start=q_start,
                k_start=k_start,
            )
        )
    return VarlenPlan(
        cu_seqlens_q=torch.tensor(cq, dtype=torch.int32, device=device),
        cu_seqlens_k=torch.tensor(ck, dtype=torch.int32, device=device),
        max_seqlen_q=max(q_lens) if q_lens else 0,
        max_seqlen_k=max(k_lens) if k_lens else 0,
        q_lens=q_lens,
        k_lens=k_lens,
        total_q=cq[-1],
        total_k=ck[-1],
        groups=groups,
    )


_PLAN_MEMO: "OrderedDict[tuple, VarlenPlan]" = OrderedDict()


def _plan_from_args(cu_q, cu_k) -> VarlenPlan:
    key = (tuple(_as_list(cu_q)), tuple(_as_list(cu_k)), str(cu_q.device) if isinstance(cu_q, torch.Tensor) else "cpu")
    plan = _PLAN_MEMO.get(key)
    if plan is None:
        plan = make_varlen_plan(cu_q, cu_k)
        _PLAN_MEMO[key] = plan
        while len(_PLAN_MEMO) > 16:
            _PLAN_MEMO.popitem(last=False)
    return plan


# --------------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------------
def _reference(q, k, v, plan: VarlenPlan) -> torch.Tensor:
    out = torch.empty_like(q)
    cq, ck = _as_list(plan.cu_seqlens_q), _as_list(plan.cu_seqlens_k)
    for i in range(plan.num_segments):
        qa, qb, ka, kb = cq[i], cq[i + 1], ck[i], ck[i + 1]
        if qb == qa:
            continue
        # (L, H, D) -> (H, L, D): heads act as the batch
        o = F.scaled_dot_product_attention(
            q[qa:qb].transpose(0, 1), k[ka:kb].transpose(0, 1), v[ka:kb].transpose(0, 1)
        )
        out[qa:qb] = o.transpose(0, 1)
    return out


def _gather(x: torch.Tensor, idx: torch.Tensor, start: Optional[int]) -> torch.Tensor:
    n, length = idx.shape
    if start is not None:
        return x[start : start + n * length].view(n, length, *x.shape[1:])
    return x[idx]  # (n, L, H, D)


def _sdpa(q, k, v, plan: VarlenPlan) -> torch.Tensor:
    whole = len(plan.groups) == 1 and plan.groups[0].q_start == 0 and not _has_empty(plan)
    out = None if whole else (torch.zeros_like(q) if _has_empty(plan) else torch.empty_like(q))
    for g in plan.groups:
        o = F.scaled_dot_product_attention(
            _gather(q, g.q_idx, g.q_start).transpose(1, 2),  # (n, H, Lq, D)
            _gather(k, g.k_idx, g.k_start).transpose(1, 2),
            _gather(v, g.k_idx, g.k_start).transpose(1, 2),
        ).transpose(1, 2)
        if whole:  # one group of back-to-back segments covering everything: no scatter needed
            return o.reshape(q.shape)
        # Unique indices: the scatter back is deterministic.
        out.index_copy_(0, g.q_flat, o.reshape(-1, *q.shape[1:]))
    return out


def _has_empty(plan: VarlenPlan) -> bool:
    covered = sum(g.q_len * g.q_idx.shape[0] for g in plan.groups)
    return covered != plan.total_q


def _half_dtype(x: torch.Tensor) -> torch.dtype:
    # flash/sage run in fp16/bf16 only; fp32 input goes through bf16 (what the official SeedVR2 does).
    return x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def _flash_attn(q, k, v, plan: VarlenPlan) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    dt = _half_dtype(q)
    out = flash_attn_varlen_func(
        q.to(dt), k.to(dt), v.to(dt),
        plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q, plan.max_seqlen_k,
        dropout_p=0.0, softmax_scale=1.0 / math.sqrt(q.shape[-1]), causal=False,
    )
    if isinstance(out, tuple):
        out = out[0]
    return out.to(q.dtype)


def _sage(q, k, v, plan: VarlenPlan) -> torch.Tensor:
    from sageattention import sageattn_varlen

    dt = _half_dtype(q)
    out = sageattn_varlen(
        q.to(dt).contiguous(), k.to(dt).contiguous(), v.to(dt).contiguous(),
        plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q, plan.max_seqlen_k,
        is_causal=False, sm_scale=1.0 / math.sqrt(q.shape[-1]),
    )
    return out.to(q.dtype)


_VARLEN_TAKES_SCALE: Optional[bool] = None


def _torch_varlen(q, k, v, plan: VarlenPlan) -> torch.Tensor:
    global _VARLEN_TAKES_SCALE
    from torch.nn.attention.varlen import varlen_attn

    if _VARLEN_TAKES_SCALE is None:
        import inspect

        _VARLEN_TAKES_SCALE = "scale" in inspect.signature(varlen_attn).parameters
    dt = _half_dtype(q)
    # the kernel wants each of q/k/v with a contiguous last dim and (tokens, heads, dim) layout
    args = [t.to(dt).contiguous() for t in (q, k, v)]
    kw = {"scale": 1.0 / math.sqrt(q.shape[-1])} if _VARLEN_TAKES_SCALE else {}
    out = varlen_attn(*args, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q, plan.max_seqlen_k, **kw)
    if isinstance(out, tuple):
        out = out[0]
    return out.to(q.dtype)


# every backend, fastest first: the one list of names (nodes, knobs, the policy, "auto" all use it)
BACKENDS: Dict[str, Callable] = {
    "flash_attn": _flash_attn,
    "torch_varlen": _torch_varlen,
    "sage": _sage,
    "sdpa": _sdpa,
    "reference": _reference,
}
CHOICES: Tuple[str, ...] = ("auto", *BACKENDS)

_MODULE_OF = {"flash_attn": "flash_attn", "sage": "sageattention", "torch_varlen": "torch.nn.attention.varlen"}
_IMPORT_ERRORS: Dict[str, Optional[str]] = {}


def _import_error(name: str) -> Optional[str]:
    mod = _MODULE_OF.get(name)
    if mod is None:
        return None
    if name not in _IMPORT_ERRORS:
        try:
            if name == "torch_varlen":
                # part of torch itself, so present means usable; importing it costs ~2 s (it pulls in sympy and
                # torch._dynamo), paid at the first call instead of whenever availability is asked
                if importlib.util.find_spec(mod) is None:
                    raise ModuleNotFoundError(f"No module named {mod!r} (needs torch >= 2.10)")
            else:
                importlib.import_module(mod)
            _IMPORT_ERRORS[name] = None
        except Exception as exc:  # noqa: BLE001 - a broken install is "unavailable", with the reason
            _IMPORT_ERRORS[name] = f"`import {mod}` failed: {type(exc).__name__}: {exc}"
    return _IMPORT_ERRORS[name]


def backend_unavailable_reason(name: str, device=None) -> Optional[str]:
    """None when ``name`` can run on ``device``, else a sentence saying why not."""
    if name not in BACKENDS:
        return f"unknown attention backend {name!r}; known: {sorted(BACKENDS)} or 'auto'"
    device = torch.device(device) if device is not None else torch.device("cpu")
    if name in ("reference", "sdpa"):
        return None
    if device.type != "cuda":
        return f"{name} needs a CUDA device (got {device})"
    if not torch.cuda.is_available():
        return f"{name} needs CUDA, which this torch build/machine lacks"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"{name} needs compute capability >= 8.0 (got {major}.x)"
    return _import_error(name)


def available_backends(device=None) -> List[str]:
    """Backends that can run on ``device``, fastest first."""
    return [n for n in BACKENDS if backend_unavailable_reason(n, device) is None]


def backend_selftest(name: str, device) -> Optional[str]:
    """Run ``name`` once on a small packed problem against ``reference``; None when it agrees (bf16
    tolerance), else the reason. Once per (backend, device)."""
    ok, why = selftests.run("attention", device, name, _check_backend)
    return None if ok else why


def _check_backend(name: str, device) -> Tuple[bool, str]:
    try:
        g = torch.Generator().manual_seed(0)
        lens = [37, 37, 5, 64]
        q, k, v = (torch.randn(sum(lens), 2, 64, generator=g).to(device, torch.bfloat16) for _ in range(3))
        cu = torch.tensor([0, 37, 74, 79, 143], dtype=torch.int32, device=device)
        ref = _reference(q.float(), k.float(), v.float(), make_varlen_plan(cu, cu, device=device))
        out = BACKENDS[name](q, k, v, make_varlen_plan(cu, cu, device=device)).float()
        err = float((out - ref).norm() / ref.norm())
        return (True, f"rel-L2 {err:.2e}") if err < 2e-2 else (False, f"self-test rel-L2 {err:.2e} vs reference")
    except Exception as exc:  # noqa: BLE001 - a kernel that fails is simply not used by "auto"
        return False, f"self-test failed: {type(exc).__name__}: {exc}"


def resolve_backend(name: str = "auto", device=None) -> str:
    """Turn ``auto`` into a concrete backend for ``device``; reject a named backend that cannot run.

    ``auto``: CUDA -> flash_attn if installed, else PyTorch's own varlen flash kernel (torch_varlen) if it
    exists and passes a one-time self-test, else sdpa; any other device -> sdpa. Sage is never picked
    automatically: it quantizes q/k (INT8) and the user should opt in.
    """
    if name in (None, "auto"):
        device = torch.device(device) if device is not None else torch.device("cpu")
        if device.type == "cuda":
            for cand in ("flash_attn", "torch_varlen"):
                if backend_unavailable_reason(cand, device) is None and backend_selftest(cand, device) is None:
                    return cand
        return "sdpa"
    why = backend_unavailable_reason(name, device)
    if why is not None:
        raise RuntimeError(f"attention backend {name!r} cannot run on {device}: {why}. "
                           f"Available here: {available_backends(device)}")
    return name


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    backend: str = "auto",
    plan: Optional[VarlenPlan] = None,
) -> torch.Tensor:
    """Non-causal packed attention, scale ``1/sqrt(head_dim)``; returns ``(total_q, heads, head_dim)``.

    ``plan`` (from :func:`make_varlen_plan`) skips re-reading ``cu_seqlens`` on the host; when given,
    ``cu_seqlens_*``/``max_seqlen_*`` must describe the same layout (they are not re-checked).
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q/k/v must be (tokens, heads, head_dim); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    name = resolve_backend(backend, q.device) if backend in (None, "auto") else backend
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(BACKENDS)} or 'auto'")
    if plan is None:
        plan = _plan_from_args(cu_seqlens_q, cu_seqlens_k)
        if plan.cu_seqlens_q.device != q.device:
            plan = make_varlen_plan(cu_seqlens_q, cu_seqlens_k, device=q.device)
    return BACKENDS[name](q, k, v, plan)
