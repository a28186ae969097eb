"""Loss curve rendered with PIL (no matplotlib): returns a ComfyUI IMAGE tensor [1,H,W,3]."""
from __future__ import annotations

import torch

VALIDATION_COLOUR = (230, 110, 20)


def ema(values, alpha=0.1):
    out, m = [], None
    for v in values:
        m = v if m is None else (1 - alpha) * m + alpha * v
        out.append(m)
    return out


def render_loss_curve(losses, width=768, height=384, title="FLUX LoRA training loss", validation=()):
    """The training loss (raw and smoothed) over its steps and, where given, the validation loss ``[(step, loss)]``
    on the same axes (steps count from 1)."""
    from PIL import Image, ImageDraw
    import numpy as np
    img = Image.new("RGB", (width, height), (255, 255, 255))
    d = ImageDraw.Draw(img)
    ml, mr, mt, mb = 60, 16, 28, 36
    d.rectangle([ml, mt, width - mr, height - mb], outline=(0, 0, 0))
    d.text((ml, 8), title, fill=(0, 0, 0))
    vals = [float(v) for v in losses if v == v]
    val = [(int(s), float(v)) for s, v in validation if v == v]
    if vals or val:
        lo, hi = min(vals + [v for _, v in val]), max(vals + [v for _, v in val])
        if hi - lo < 1e-12:
            hi = lo + 1e-6
        n = max([len(vals)] + [s for s, _ in val])

        def xy(i, v):   # i: 0-based step index
            x = ml + (width - ml - mr) * (i / max(1, n - 1))
            y = mt + (height - mt - mb) * (1 - (v - lo) / (hi - lo))
            return x, y
        if vals:
            raw = [xy(i, v) for i, v in enumerate(vals)]
            sm = [xy(i, v) for i, v in enumerate(ema(vals, 0.1 if len(vals) > 20 else 0.5))]
            if len(vals) > 1:
                d.line(raw, fill=(170, 190, 230), width=1)
                d.line(sm, fill=(20, 60, 200), width=2)
            else:
                d.ellipse([raw[0][0] - 2, raw[0][1] - 2, raw[0][0] + 2, raw[0][1] + 2], fill=(20, 60, 200))
            d.text((width // 2 - 60, height - mb + 18), f"last (EMA) {ema(vals)[-1]:.4g}", fill=(0, 0, 0))
        if val:
            pts = [xy(s - 1, v) for s, v in val]
            if len(pts) > 1:
                d.line(pts, fill=VALIDATION_COLOUR, width=2)
            for x, y in pts:
                d.ellipse([x - 3, y - 3, x + 3, y + 3], fill=VALIDATION_COLOUR)
            best = min(val, key=lambda sv: sv[1])
            d.text((width - mr - 230, 8), f"validation (best {best[1]:.4g} at step {best[0]})", fill=VALIDATION_COLOUR)
        d.text((4, mt - 4), f"{hi:.4g}", fill=(0, 0, 0))
        d.text((4, height - mb - 8), f"{lo:.4g}", fill=(0, 0, 0))
        d.text((ml, height - mb + 6), "step 1", fill=(0, 0, 0))
        d.text((width - mr - 70, height - mb + 6), f"step {n}", fill=(0, 0, 0))
    arr = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0)
    return arr.unsqueeze(0)
