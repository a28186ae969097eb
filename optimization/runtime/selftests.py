"""One memo of on-device self-tests: (feature, variant, device) -> (ok, reason), each run at most once per
process, never raising (a self-test that crashes failed, its exception is the reason).

A feature either passes its check to ``run(feature, device, variant, fn)`` or registers it by name
(``register``) for code that must not import the feature (the hardware policy runs "nvfp4" and "fp8" by name).
``reset()`` forgets results (tests).
"""
from __future__ import annotations

from typing import Callable

import torch

Result = tuple[bool, str]
Check = Callable[[str, torch.device], Result]      # (variant, device) -> (ok, reason)

_REGISTERED: dict[str, Check] = {}
_MEMO: dict[tuple[str, str, str], Result] = {}


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message``, the reason a failed self-test gives."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def guard(fn: Callable[..., Result]) -> Callable[..., Result]:
    """``fn`` that returns (False, its exception) instead of raising."""
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure means "feature off", with this reason
            return False, first_line(exc)
    wrapped.__name__ = fn.__name__
    wrapped.__doc__ = fn.__doc__
    return wrapped


def register(feature: str, check: Check) -> None:
    _REGISTERED[feature] = check


def run(feature: str, device, variant: str = "", check: Check | None = None) -> Result:
    """The memoized result of ``check`` (default: the registered one) for ``variant`` on ``device``."""
    key = (feature, variant, str(torch.device(device)))
    hit = _MEMO.get(key)
    if hit is not None:
        return hit
    check = check or _REGISTERED.get(feature)
    if check is None:
        return False, f"no self-test registered for {feature!r}"
    _MEMO[key] = (False, "self-test running")       # a check that calls the feature itself sees it off
    result = guard(check)(variant, torch.device(device))
    _MEMO[key] = result
    return result


def status(feature: str, device, variant: str = "") -> Result | None:
    """The result if the self-test has run, else None."""
    return _MEMO.get((feature, variant, str(torch.device(device))))


def reset(feature: str | None = None) -> None:
    for key in [k for k in _MEMO if feature is None or k[0] == feature]:
        del _MEMO[key]
