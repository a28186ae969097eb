"""Tiny SeedVR2 DiT files in every layout users have, written from the golden tiny models (tests/data/golden):
shared by the loader tests (tests/test_dit_*.py, tests/test_comfy_layout.py) and the ComfyUI node tests
(tests/comfyui/test_dit_file_formats.py).

* ``write_gguf_dit``: numz's GGUF files (the `gguf` package's writer and quantizer);
* ``write_int8_dit``: ComfyUI's ``int8_tensorwise`` ConvRot layers (comfy-kitchen's quantizer where it imports);
* ``write_comfy_layout_dit``: ComfyUI's converted fp16 files with the conditioning baked in;
* ``write_fp8_dit``: numz's fp8 e4m3fn files, optionally with the last block kept fp16 (``…_mixed_block35_fp16``);
* ``write_plain_dit``: fp32 / fp16 / bf16 safetensors, or the official ``.pth`` pickle;
* ``write_unknown_comfy_quant_dit``: a ComfyUI-layout file whose ``comfy_quant`` names a format nobody supports;
* ``write_pickle_with_code``: a ``.pth`` whose pickle would run code (it creates a marker file when unpickled).
NVFP4 and MXFP8 files come from the pack's converter (``optimization.nvfp4.convert.convert_file``).
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file

GOLDEN = Path(__file__).resolve().parent / "data" / "golden"
MANIFEST = json.loads((GOLDEN / "manifest.json").read_text())
INT8_GROUP = 64  # the tiny model's K is 64 or 256: ConvRot groups of 64 here (256 in the real files)


def run_golden_case(model, variant: str, case: str):
    """(output, golden output) of ``model`` on one golden DiT case, shaped alike."""
    inp = load_file(GOLDEN / MANIFEST["dit"]["cases"][case]["inputs_file"])
    with torch.no_grad():
        out = model(inp["vid"].reshape(-1, inp["vid"].shape[-1]), inp["txt"], inp["vid_shape"], inp["txt_shape"],
                    inp["timestep"])
    ref = load_file(GOLDEN / MANIFEST["dit"]["tiny_models"][variant]["results"][case]["outputs_file"])["out"]
    return out.reshape(ref.shape), ref


def rel_l2(a, ref) -> float:
    return float((a.double() - ref.double()).norm() / ref.double().norm())


def golden_weights(variant: str) -> Path:
    return GOLDEN / MANIFEST["dit"]["tiny_models"][variant]["weights_file"]


def golden_state_dict(variant: str) -> dict:
    return load_file(str(golden_weights(variant)))


# ----------------------------------------------------------------------------------------- GGUF (numz)
def write_gguf_dit(path, variant: str, qtype, extra: dict | None = None) -> dict:
    """The tiny golden DiT as a GGUF file, the way numz's files are made: official key names, 2-D linear weights
    quantized where their rows fit whole blocks, everything else F32; ``extra`` tensors (e.g. baked conditioning)
    stored as they are. Returns the fp32 state dict."""
    import gguf
    sd = golden_state_dict(variant)
    w = gguf.GGUFWriter(str(path), "seedvr2")
    for key, value in sd.items():
        arr = value.float().numpy()
        if qtype is not None and arr.ndim == 2 and arr.shape[1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
            w.add_tensor(key, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(key, arr)
    for key, value in (extra or {}).items():
        w.add_tensor(key, value.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sd


# ----------------------------------------------------------------------------------------- ComfyUI int8 ConvRot
def int8_convrot(w: torch.Tensor, group: int = INT8_GROUP):
    """(int8 codes, per-channel scale) of ``w``: comfy-kitchen's quantizer where it imports (checked equal to ours),
    else ours (the same bytes: tests/test_comfy_layouts.py)."""
    from seedvr2bw.optimization.nvfp4.int8 import quantize_int8_convrot
    try:
        import comfy_kitchen
        from comfy_kitchen.tensor import QuantizedTensor, get_layout_class
    except Exception:  # noqa: BLE001 - optional reference
        return quantize_int8_convrot(w, group)
    with comfy_kitchen.registry.use_backend("eager"):
        qt = QuantizedTensor.from_float(w, "TensorWiseINT8Layout", is_weight=True, per_channel=True, convrot=True,
                                        convrot_groupsize=group)
    qdata, scale = get_layout_class("TensorWiseINT8Layout").get_plain_tensors(qt)
    q, s = quantize_int8_convrot(w, group)
    assert torch.equal(q, qdata) and torch.equal(s, scale)
    return qdata, scale


def write_int8_dit(path, variant: str, group: int = INT8_GROUP) -> None:
    """Every block linear as ComfyUI's ``int8_tensorwise`` ConvRot layer, the rest kept (the converter's keep rule)."""
    from seedvr2bw.optimization.nvfp4 import checkpoint as ckpt
    from seedvr2bw.optimization.nvfp4.surgery import make_keep_rule
    sd = golden_state_dict(variant)
    keep = make_keep_rule(None)
    out = {}
    for key, value in sd.items():
        layer = key[: -len(".weight")]
        if key.endswith(".weight") and value.dim() == 2 and value.shape[1] % group == 0 and not keep(
                layer, SimpleNamespace(in_features=value.shape[1])):
            q, s = int8_convrot(value, group)
            out.update({key: q, f"{layer}.weight_scale": s, f"{layer}.comfy_quant": ckpt.comfy_quant_tensor(
                {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": group})})
        else:
            out[key] = value
    ckpt.save_state_dict(str(path), out)


def write_unknown_comfy_quant_dit(src, path, layer: str = "blocks.0.attn.proj_out.vid",
                                  fmt: str = "convrot_w4a4") -> None:
    """``src`` (a ComfyUI-layout quantized file) with ``layer``'s ``comfy_quant`` naming the format ``fmt``."""
    from seedvr2bw.optimization.nvfp4 import checkpoint as ckpt
    sd = load_file(str(src))
    sd[f"{layer}.comfy_quant"] = ckpt.comfy_quant_tensor({"format": fmt})
    ckpt.save_state_dict(str(path), sd)


# ----------------------------------------------------------------------------------------- plain and fp8
def write_comfy_layout_dit(path, positive: torch.Tensor, negative: torch.Tensor | None, variant: str = "3b",
                           prefix: str = "") -> None:
    """The tiny DiT in fp16 with the conditioning baked in, as ComfyUI's converter writes it."""
    sd = {prefix + k: v.half() for k, v in golden_state_dict(variant).items()}
    sd[prefix + "positive_conditioning"] = positive
    if negative is not None:
        sd[prefix + "negative_conditioning"] = negative
    save_file(sd, str(path))


def write_plain_dit(path, variant: str = "3b", dtype: torch.dtype = torch.float32) -> None:
    """The tiny DiT in ``dtype``; a ``.pth`` name writes the official pickle (a plain dict of tensors)."""
    sd = {k: v.to(dtype) for k, v in golden_state_dict(variant).items()}
    if str(path).endswith((".pth", ".pt")):
        torch.save(sd, str(path))
    else:
        save_file(sd, str(path))


def write_fp8_dit(path, variant: str = "3b", keep_last_block: bool = True) -> int:
    """numz's fp8 layout: the block linears' weights in float8_e4m3fn, every other tensor fp16; with
    ``keep_last_block`` the last block stays fp16 (``…_fp8_e4m3fn_mixed_block35_fp16``). Returns the last block's
    index."""
    sd = golden_state_dict(variant)
    last = max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    out = {}
    for key, value in sd.items():
        in_last = key.startswith(f"blocks.{last}.")
        if key.startswith("blocks.") and key.endswith(".weight") and value.dim() == 2 and not (
                keep_last_block and in_last):
            out[key] = value.to(torch.float8_e4m3fn)
        else:
            out[key] = value.half()
    save_file(out, str(path))
    return last


# ----------------------------------------------------------------------------------------- files that must not load
class RunsCode:
    """Unpickling this runs ``open(marker, "w")``: a stand-in for a pickle that carries code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def write_pickle_with_code(path, marker, variant: str = "3b") -> None:
    """The tiny DiT's tensors in a ``.pth`` whose pickle also holds code that would create ``marker``."""
    sd = dict(golden_state_dict(variant))
    torch.save({"state_dict": sd, "hook": RunsCode(marker)}, str(path))
