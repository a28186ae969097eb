"""The per-instance ``forward`` of a trained block Linear, shared by the LoRA (``lora.py``) and the quantized
frozen base (``quant.py``), and the instance attributes through which they plug into it.

A Linear gets at most one LoRA (``attach_lora``) and one quantized base (``attach_base``); either installs
``linear_forward`` as the instance's ``forward``, and the class forward comes back once neither is left.
"""
from __future__ import annotations

import types

import torch

from .lora_linear_op import lora_linear


def _comfy_cast(lin) -> bool:
    """ComfyUI's Linear casts/patches its weight per call (``comfy_cast_weights``, weight/bias functions): then
    the base product goes through its own forward."""
    return bool(getattr(lin, "comfy_cast_weights", False) or getattr(lin, "weight_function", None)
                or getattr(lin, "bias_function", None))


def linear_forward(self, x):
    """Per-instance ``forward`` of a trained block Linear: base product plus the LoRA (``_lora``), on one 2-D view
    of ``x``. With a LoRA the bf16/fp32 base, and the fp8 base on FP8 tensor cores (``_q_with_lora``), run as one
    operator with it (``lora_linear_op``); otherwise the base (``addmm``, the ``quant`` autograd function set as
    ``_q_base``, or ComfyUI's own cast forward) and then ``LoraModule.add_to``.

    Replaces a forward hook: no hook dispatch in ``Module.__call__``, no reshape/view pair per hook."""
    d = self.__dict__
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    qb = d.get("_q_base")
    lora = d.get("_lora")
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


def _install(lin):
    if "forward" not in lin.__dict__:
        lin._l_comfy_op = hasattr(lin, "comfy_cast_weights")
        lin.forward = types.MethodType(linear_forward, lin)


def _uninstall(lin):
    d = lin.__dict__
    if "_lora" not in d and "_q_base" not in d:
        d.pop("forward", None)
        d.pop("_l_comfy_op", None)


def foreign_forward(lin) -> bool:
    """Whether ``lin`` has a per-instance forward that is not ``linear_forward`` (another trainer or patch)."""
    f = lin.__dict__.get("forward")
    return f is not None and getattr(f, "__func__", None) is not linear_forward


def attach_lora(lin, lora) -> None:
    """``lora`` (a ``lora.LoraModule``) adds to ``lin``'s output; not a submodule, so ``lin``'s state dict stays."""
    lin.__dict__["_lora"] = lora
    _install(lin)


def detach_lora(lin) -> None:
    lin.__dict__.pop("_lora", None)
    _uninstall(lin)


def lora_of(lin):
    """The LoRA attached to ``lin``, or None."""
    return lin.__dict__.get("_lora")


def attach_base(lin, base, with_lora=None) -> None:
    """``base(lin, x2)`` computes ``lin``'s frozen product; ``with_lora(lin, x2, lora)`` the product plus the LoRA
    as one operator, or None where it does not apply."""
    lin.__dict__["_q_base"] = base
    if with_lora is not None:
        lin.__dict__["_q_with_lora"] = with_lora
    _install(lin)


def detach_base(lin) -> None:
    lin.__dict__.pop("_q_base", None)
    lin.__dict__.pop("_q_with_lora", None)
    _uninstall(lin)
