"""The result of one check, and the context the checks share."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..runtime import knobs

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
STATUSES = (PASS, WARN, FAIL, SKIP)

FAULT_ENV = knobs.KNOB["DIAG_FAULT"].var
# Faults a test (or a curious user) can force; each one must turn the matching check into FAIL.
KNOWN_FAULTS = {
    "nvfp4_wrong": "NVFP4 quantize/dequantize and every NVFP4 GEMM path return corrupted values",
    "pin_fail": "allocating page-locked (pinned) host memory fails",
}


@dataclass
class CheckResult:
    """One line of the report: ``status`` with the number behind it (``value`` ``unit``) and a ``detail``
    sentence that says what was measured and, for WARN/FAIL, what to do. ``data`` holds extra numbers for
    the JSON report."""
    name: str
    status: str
    value: Any = None
    unit: str = ""
    detail: str = ""
    section: str = ""
    data: dict = field(default_factory=dict)
    elapsed_s: float = 0.0

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {STATUSES}")

    def to_dict(self) -> dict:
        return _json_safe(asdict(self))


def _json_safe(obj):
    if isinstance(obj, float):
        return None if (math.isnan(obj) or math.isinf(obj)) else obj
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    return str(obj)


def parse_faults(spec: str | None = None, extra=()) -> frozenset[str]:
    """Faults from ``SEEDVR2BW_DIAG_FAULT`` (``a|b`` or ``a,b``) plus ``extra``; an unknown name raises."""
    spec = (knobs.get("DIAG_FAULT") or "") if spec is None else spec
    names = {n.strip().lower() for n in spec.replace("|", ",").split(",") if n.strip()}
    names |= {n.strip().lower() for n in extra if n and n.strip()}
    unknown = names - set(KNOWN_FAULTS)
    if unknown:
        raise ValueError(f"unknown diagnostic fault(s) {sorted(unknown)}; known: {', '.join(sorted(KNOWN_FAULTS))}")
    return frozenset(names)


@dataclass
class DiagContext:
    """What every check gets: the device, the run mode, forced faults, and ``measured`` (numbers one check
    leaves for later ones, e.g. the pinned bandwidth and the bf16 GEMM rate used by the IO-vs-compute model)."""
    device: Any  # torch.device
    quick: bool = False
    faults: frozenset = frozenset()
    measured: dict = field(default_factory=dict)
    pack_root: Path = Path(__file__).resolve().parents[2]

    @property
    def is_cuda(self) -> bool:
        return getattr(self.device, "type", str(self.device)) == "cuda"

    def fault(self, name: str) -> bool:
        if name not in KNOWN_FAULTS:
            raise KeyError(name)
        return name in self.faults
