"""Packed variable-length attention with named backends (see ``varlen.py``).

The models call :func:`varlen_attention` only; they never import flash-attn or SageAttention.
"""
from .varlen import (  # noqa: F401
    BACKENDS,
    CHOICES,
    VarlenPlan,
    available_backends,
    backend_unavailable_reason,
    make_varlen_plan,
    resolve_backend,
    varlen_attention,
)
