"""Every ``SEEDVR2BW_*`` environment variable the pack reads, in one table, parsed one way.

``get("NVFP4_GEMM")`` returns the parsed value of ``SEEDVR2BW_NVFP4_GEMM`` (the knob's default when it is unset).
Each knob is parsed on its first ``get`` and kept for the rest of the process, so hot paths pay a dict lookup; a
bad value raises a ``ValueError`` that names the variable and what it accepts. Tests change the environment and
call ``reset()``, or use ``override(NAME=value)``. This is the only product module that reads ``os.environ``;
``external(name)`` reads the few variables other programs own (``TRITON_INTERPRET``, ``WSL_DISTRO_NAME``, ``PWD``).
README.md's settings table is generated from ``KNOBS`` (``scripts/gen_settings_table.py``).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator, Mapping

PREFIX = "SEEDVR2BW_"
GiB = 1024 ** 3

_ON = ("1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")


@dataclass(frozen=True)
class Knob:
    name: str                       # the variable is PREFIX + name
    kind: str                       # switch | auto_switch | size | count | name | choice | text
    default: object
    doc: str                        # one line, for README.md
    choices: tuple[str, ...] = ()   # kind "choice": the accepted values
    aliases: tuple[tuple[str, str], ...] = ()   # kind "choice": (spelling, value), e.g. ("0", "off")

    @property
    def var(self) -> str:
        return PREFIX + self.name

    def values_text(self, names: tuple[str, ...] = ()) -> str:
        """The accepted values, for README.md; ``names``: what a knob of kind "name" accepts (its owner's list)."""
        if self.kind == "name":
            return "`auto` (default), " + ", ".join(f"`{n}`" for n in names)
        if self.kind == "switch":
            return f"`on` / `off` (default `{'on' if self.default else 'off'}`)"
        if self.kind == "auto_switch":
            return "`auto` (default), `on`, `off`"
        if self.kind == "size":
            return "`auto` (default) or a size such as `8G`, `512M`"
        if self.kind == "count":
            return "`auto` (default) or a whole number"
        if self.kind == "choice":
            unset = "unset (default), " if self.default is None else ""
            return unset + ", ".join(f"`{c}`" + (" (default)" if c == self.default else "") for c in self.choices)
        return "unset (default) or text"


KNOBS: tuple[Knob, ...] = (
    # hardware policy: each one overrides the policy's choice of the same name (still self-tested)
    Knob("PROFILE", "name", None, "hardware profile to assume instead of the detected one"),
    Knob("NVFP4_GEMM", "name", None, "NVFP4 GEMM path; a path that fails its self-test falls back down the chain"),
    Knob("FP8_GEMM", "auto_switch", None, "FP8 tensor-core GEMMs (fp8 linears, FLUX LoRA training)"),
    Knob("ATTENTION", "name", None, "attention backend of the DiT"),
    Knob("PINNED_POOL_BYTES", "size", None, "cap on page-locked host memory (BlockSwap)"),
    Knob("COPY_STREAMS", "count", None, "CUDA copy streams for BlockSwap"),
    Knob("TF32", "auto_switch", None, "TF32 matmuls and convolutions inside the pack's model calls"),
    Knob("CUDNN_BENCHMARK", "auto_switch", None, "cuDNN autotuning inside the pack's model calls"),
    Knob("VAE_CHANNELS_LAST", "auto_switch", None, "the VAE's activations stored channels-last 3-D (NDHWC): "
         "cuDNN's convolutions without layout transposes; auto: on wherever cuDNN runs them"),
    # kernels
    Knob("SDPA", "choice", "auto", "which F.scaled_dot_product_attention kernel goes first (FLUX training)",
         choices=("auto", "cudnn", "flash", "default")),
    Knob("FUSED", "switch", True, "fused Triton kernels of the DiT (norm+modulate, residual, q/k norm+RoPE) and the "
         "VAE's GroupNorm (self-tested per GPU)"),
    Knob("VAE_FOLD_BIASES", "switch", True, "the VAE ResNet convs' biases added by the fused kernels that read "
         "their outputs (GroupNorm, residual) instead of in a pass of their own, rounded where that pass rounds"),
    Knob("VAE_STREAM_CONV", "switch", True, "the VAE decoder's 3-channel output conv as a GEMM per frame and a "
         "tap-sum kernel (fused kernels) instead of cuDNN, which runs it 4x slower than reading its input"),
    Knob("VAE_GEMM_EPILOGUE", "switch", True, "the VAE's 1x1 convs (upsamplers, ResNet shortcuts) as Triton GEMMs "
         "that write their outputs where they are read (depth-to-space, residual add) instead of cuBLAS and a pass "
         "of their own"),
    Knob("VAE_HEAD_SUM", "auto_switch", None, "the VAE's causal convs at a clip's first chunk: the replicated "
         "first frame's temporal taps summed (exact in 16 bits as two parts) instead of convolving two more copies; "
         "auto: on for 16-bit weights on a GPU"),
    Knob("QKV_KERNEL", "choice", None, "force one variant of the fused q/k norm+RoPE kernel (default: the fastest "
         "that passes its self-test)", choices=("v3", "v2", "v1")),
    Knob("FUSED_GELU", "switch", True, "the 7B MLP's GELU in the cuBLASLt epilogue"),
    Knob("WGMMA", "switch", True, "NVFP4 fidelity path, 65 <= M <= 256 on sm_90: the CUDA wgmma W4A16 kernel "
         "(off: the Triton one)"),
    Knob("RS_KERNEL", "switch", True, "NVFP4 fidelity path, M >= 1024 on sm_90: the RS W4A16 kernel (off: "
         "dequantize + cuBLAS)"),
    Knob("W4A16_ASM", "switch", True, "decode E2M1 with the PTX byte tables in the Triton W4A16 and dequantize "
         "kernels (off: arithmetic decode)"),
    Knob("NVFP4_FAST_LAUNCH", "switch", True, "per-shape launch plans of the NVFP4 / FP8 linears (off: every "
         "call through Triton's launcher)"),
    # diagnostics and training
    Knob("DIAG_FAULT", "text", None, "force diagnostic faults to test the report: `nvfp4_wrong`, `pin_fail`, or "
         "both comma-separated"),
    Knob("TRAIN_CUDA_GRAPH", "text", None, "FLUX LoRA training: CUDA graphs; `0` / `off` turns them off, any other "
         "value on (CUDA only); unset: the node setting"),
    Knob("TRAIN_COMPILE", "text", None, "FLUX LoRA training: torch.compile of the blocks; `0` / `off` turns it off, "
         "any other value on (CUDA only); unset: the node setting"),
    Knob("TRAIN_SELECTIVE_CKPT", "choice", None, "FLUX LoRA training: selective activation checkpointing; unset: "
         "the node setting", choices=("auto", "on", "off"),
         aliases=(("0", "off"), ("false", "off"), ("1", "on"), ("true", "on"))),
)
KNOB: dict[str, Knob] = {k.name: k for k in KNOBS}
EXTERNAL = ("TRITON_INTERPRET", "WSL_DISTRO_NAME", "PWD")

_values: dict[str, object] = {}
_overrides: dict[str, object] = {}
_MISSING = object()


def _bad(knob: Knob, raw: str, expected: str) -> ValueError:
    return ValueError(f"{knob.var}={raw!r} is not {expected}. Fix: set it to one of those or unset it.")


def parse_size(text: str) -> int:
    """'8G', '512M', '1.5GiB', '123' -> bytes (ValueError otherwise)."""
    v = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1024, "M": 1024 ** 2, "G": GiB, "T": 1024 ** 4}.get(v[-1:], 1)
    return int(float(v.rstrip("KMGT")) * mult)


def parse_value(knob: Knob, raw: str | None):
    """The value of ``knob`` for the variable's text ``raw`` (None: unset)."""
    text = "" if raw is None else raw.strip()
    low = text.lower()
    if knob.kind == "text":
        return low or knob.default
    if low == "" or (low == "auto" and knob.kind in ("auto_switch", "size", "count", "name")):
        return knob.default
    if knob.kind in ("switch", "auto_switch"):
        if low in _ON:
            return True
        if low in _OFF:
            return False
        raise _bad(knob, raw, "on/off (1/0, true/false)")
    if knob.kind == "size":
        try:
            return parse_size(text)
        except ValueError:
            raise _bad(knob, raw, "a size such as 8G or 512M") from None
    if knob.kind == "count":
        try:
            return int(text)
        except ValueError:
            raise _bad(knob, raw, "a whole number") from None
    if knob.kind == "name":
        return low
    low = dict(knob.aliases).get(low, low)
    if low not in knob.choices:
        raise _bad(knob, raw, f"one of {', '.join(knob.choices)}")
    return low


def get(name: str):
    """The parsed value of knob ``name`` (without the prefix)."""
    value = _values.get(name, _MISSING)
    if value is _MISSING:
        value = _overrides[name] if name in _overrides else parse_value(KNOB[name], os.environ.get(PREFIX + name))
        _values[name] = value
    return value


def parse(environ: Mapping[str, str]) -> dict:
    """Every knob's value for the variables in ``environ`` (what ``get`` returns for that environment)."""
    return {k.name: parse_value(k, environ.get(k.var)) for k in KNOBS}


def reset() -> None:
    """Forget every parsed value: the next ``get`` reads the environment again."""
    _values.clear()


@contextlib.contextmanager
def override(**values) -> Iterator[None]:
    """Knob values for the duration of a ``with`` block (tests, benchmarks), instead of the environment's."""
    unknown = set(values) - set(KNOB)
    if unknown:
        raise KeyError(f"unknown knob(s) {sorted(unknown)}")
    saved = dict(_overrides)
    _overrides.update(values)
    reset()
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)
        reset()


def external(name: str) -> str | None:
    """A variable another program owns (read as it is now, not a knob)."""
    if name not in EXTERNAL:
        raise KeyError(f"{name} is not one of the external variables {EXTERNAL}")
    return os.environ.get(name)


def child_environment(defaults: Mapping[str, str], base: Mapping[str, str] | None = None) -> dict:
    """The environment of a process this one starts: ``base`` (default: this process's) with ``defaults`` added
    where unset (a value the user set is kept)."""
    out = dict(os.environ if base is None else base)
    for k, v in defaults.items():
        out.setdefault(k, v)
    return out


def markdown_table(names: Mapping[str, tuple[str, ...]]) -> str:
    """README.md's settings table; ``names``: for each knob of kind "name", the values its owner accepts."""
    rows = ["| variable | values | what it does |", "| --- | --- | --- |"]
    rows += [f"| `{k.var}` | {k.values_text(tuple(names.get(k.name, ())))} | {k.doc} |" for k in KNOBS]
    return "\n".join(rows)
