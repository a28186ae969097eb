"""The frozen base model as autograd can use it, whatever mode ComfyUI created it in.

ComfyUI runs every prompt inside ``torch.inference_mode()``, so the models its loaders build (and the GPU copies
its model manager makes) hold *inference tensors*. Autograd refuses to save those for backward, and their
``requires_grad`` cannot be set outside inference mode. ``FrozenBase`` therefore gives each such parameter and
buffer of the model, for the duration of training, a normal tensor that aliases the same storage (zero-copy: no
memory is added), frozen; ``restore()`` puts inference tensors over whatever storage the parameters hold then
(BlockSwap or a model-manager move may have replaced it), with their ``requires_grad`` as it was. Parameters that
were normal tensors are only frozen and given their flag back.

``outside_inference_mode`` is the decorator for the trainer's entry points: grad mode on, inference mode off,
whatever the caller (ComfyUI's executor) had.
"""
from __future__ import annotations

import functools

import torch
from torch import nn


def alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s storage (same offset, shape, strides), of the current mode's kind: normal outside
    inference mode, an inference tensor inside. No copy."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def outside_inference_mode(fn):
    """Runs ``fn`` with inference mode off and gradients on (ComfyUI's executor has both the other way)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.inference_mode(False), torch.enable_grad():
            return fn(*args, **kwargs)
    return wrapper


class FrozenBase:
    """Freezes every parameter of ``model``; inference tensors among its parameters and buffers are replaced by
    normal aliases until ``restore()``. Tied parameters stay tied (one alias per tensor)."""

    def __init__(self, model: nn.Module):
        # (module, table, name, alias or None, requires_grad before) in visiting order
        self._entries: list[tuple] = []
        made: dict[int, nn.Parameter | torch.Tensor] = {}
        with torch.inference_mode(False):
            for mod in model.modules():
                for table_name in ("_parameters", "_buffers"):
                    table = getattr(mod, table_name)
                    for name, t in list(table.items()):
                        if t is None:
                            continue
                        is_param = table_name == "_parameters"
                        rg = bool(t.requires_grad) if is_param else False
                        if t.is_inference():
                            new = made.get(id(t))
                            if new is None:
                                a = alias(t.detach())
                                new = nn.Parameter(a, requires_grad=False) if is_param else a
                                made[id(t)] = new
                            table[name] = new
                            self._entries.append((mod, table, name, new, rg))
                        else:
                            if is_param and t.requires_grad:
                                t.requires_grad_(False)
                            self._entries.append((mod, table, name, None, rg))
        self._restored = False

    @property
    def aliased(self) -> int:
        """How many parameters and buffers are training through a normal alias (they were inference tensors)."""
        return len({id(e[3]) for e in self._entries if e[3] is not None})

    def restore(self) -> None:
        """Inference tensors back where they were replaced (over the storage each alias holds now), every
        parameter's ``requires_grad`` as before. A slot that something else replaced meanwhile is left alone."""
        if self._restored:
            return
        back: dict[int, nn.Parameter | torch.Tensor] = {}
        for mod, table, name, new, rg in reversed(self._entries):
            cur = table.get(name)
            if new is None:
                if cur is not None and table is mod._parameters and cur.requires_grad != rg:
                    cur.requires_grad_(rg)
                continue
            if cur is not new:
                continue
            t = back.get(id(new))
            if t is None:
                with torch.inference_mode():   # inference tensors, and requires_grad may be set on them here
                    a = alias(new.detach())
                    t = nn.Parameter(a, requires_grad=rg) if isinstance(new, nn.Parameter) else a
                back[id(new)] = t
            table[name] = t
        self._entries = []
        self._restored = True
