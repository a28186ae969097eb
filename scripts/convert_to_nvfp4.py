"""Convert a bf16/fp16/fp32/fp8 safetensors model (SeedVR2 DiT, FLUX, ...) to NVFP4 (or MXFP8, FP8) in ComfyUI's format.

    python scripts/convert_to_nvfp4.py model.safetensors model_nvfp4.safetensors [--keep REGEX ...]
        [--no-default-keep] [--format nvfp4|mxfp8|fp8] [--device auto|cpu|cuda] [--keep-dtype bf16|fp16|fp32]
        [--recipe comfy|modelopt] [--json summary.json]

Streams tensor by tensor (peak RAM ~ one tensor), writes a temp file and renames it into place (atomic), shows a
tqdm progress bar and prints a summary of quantized / kept layers and sizes.
Default keep rule (high precision): embeddings, norms, modulation/adaLN, patch-in/out and first/last layers,
any layer whose K is not a multiple of 16 (see optimization/nvfp4/surgery.py DEFAULT_KEEP_PATTERNS).
"""
import argparse
import json
import sys

import _pack  # noqa: F401
import torch

from seedvr2bw.optimization.nvfp4.convert import TARGETS, convert_file
from seedvr2bw.optimization.nvfp4.surgery import DEFAULT_KEEP_PATTERNS

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--format", choices=TARGETS, default="nvfp4")
    ap.add_argument("--keep", action="append", default=[], help="regex of layer names kept in high precision")
    ap.add_argument("--no-default-keep", action="store_true", help="drop the default keep patterns")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--keep-dtype", choices=tuple(DTYPES), default=None)
    ap.add_argument("--recipe", choices=("comfy", "modelopt"), default="comfy")
    ap.add_argument("--json", default=None, help="write the summary as JSON here")
    args = ap.parse_args(argv)

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    patterns = list(args.keep) + ([] if args.no_default_keep else list(DEFAULT_KEEP_PATTERNS))
    try:
        from tqdm import tqdm
        bar = tqdm(total=None, unit="tensor", desc="convert")
    except ImportError:
        bar = None

    def progress(i, n, name):
        if bar is not None:
            if bar.total != n:
                bar.total = n
            bar.update(1)
            bar.set_postfix_str(name[-40:])

    summary = convert_file(args.src, args.dst, target=args.format, keep=patterns, device=device,
                           recipe=args.recipe, keep_dtype=DTYPES.get(args.keep_dtype), progress=progress)
    if bar is not None:
        bar.close()
    print(summary.text())
    if summary.kept:
        print("kept in high precision:", ", ".join(summary.kept[:30]) + (" ..." if len(summary.kept) > 30 else ""))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary.as_dict(), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
