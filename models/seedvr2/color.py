"""Colour correction of the upscaled frames against the (resized) input. Pure torch.

All functions take frames as ``(N, C, H, W)`` float tensors (C = 3, RGB) and a reference of the same shape.

* ``wavelet``: the StableSR ``wavelet_reconstruction`` that the official SeedVR2 script applies when
  ``color_fix.py`` is present and numz ships (docs/SPEC.md §6 step 11): a 5-level stationary wavelet
  decomposition with a 3x3 binomial blur (dilations 1, 2, 4, 8, 16, replicate padding). The result is
  the output's high-frequency band plus the reference's low-frequency band. Linear, so it can run in
  either [0, 1] or [-1, 1] space.
* ``adain``: per-frame, per-channel mean/std transfer (StableSR ``adaptive_instance_normalization``).
* ``lab``: the same mean/std transfer done in CIE L*a*b* (sRGB, D65); inputs in [0, 1].
* ``none``: identity.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

COLOR_CORRECTION_MODES = ("wavelet", "adain", "lab", "none")

_WAVELET_KERNEL = ((0.0625, 0.125, 0.0625), (0.125, 0.25, 0.125), (0.0625, 0.125, 0.0625))


# --------------------------------------------------------------------------------------------- wavelet
def wavelet_blur(image: torch.Tensor, radius: int) -> torch.Tensor:
    """3x3 binomial blur with dilation ``radius`` and replicate padding, per channel."""
    c = image.shape[1]
    kernel = torch.tensor(_WAVELET_KERNEL, dtype=image.dtype, device=image.device)
    kernel = kernel[None, None].repeat(c, 1, 1, 1)
    padded = F.pad(image, (radius, radius, radius, radius), mode="replicate")
    return F.conv2d(padded, kernel, groups=c, dilation=radius)


def wavelet_decomposition(image: torch.Tensor, levels: int = 5):
    """Returns ``(high, low)`` with ``high + low == image`` (up to rounding)."""
    high = torch.zeros_like(image)
    low = image
    for i in range(levels):
        blurred = wavelet_blur(low, 2 ** i)
        high = high + (low - blurred)
        low = blurred
    return high, low


def wavelet_reconstruction(content: torch.Tensor, reference: torch.Tensor, levels: int = 5) -> torch.Tensor:
    """High frequencies of ``content`` (the model output) + low frequencies of ``reference`` (the input)."""
    content_high, _ = wavelet_decomposition(content, levels)
    _, reference_low = wavelet_decomposition(reference, levels)
    return content_high + reference_low


# --------------------------------------------------------------------------------------------- adain
def _mean_std(x: torch.Tensor, eps: float = 1e-5):
    n, c = x.shape[:2]
    flat = x.reshape(n, c, -1)
    mean = flat.mean(dim=2).reshape(n, c, 1, 1)
    std = (flat.var(dim=2, unbiased=False) + eps).sqrt().reshape(n, c, 1, 1)
    return mean, std


def adain_color_fix(content: torch.Tensor, reference: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Per-frame, per-channel: normalise ``content`` and give it the mean/std of ``reference``."""
    c_mean, c_std = _mean_std(content, eps)
    r_mean, r_std = _mean_std(reference, eps)
    return (content - c_mean) / c_std * r_std + r_mean


# --------------------------------------------------------------------------------------------- lab
# sRGB (D65) <-> XYZ matrices (IEC 61966-2-1) and the D65 white point.
_RGB_TO_XYZ = ((0.4124564, 0.3575761, 0.1804375),
               (0.2126729, 0.7151522, 0.0721750),
               (0.0193339, 0.1191920, 0.9503041))
_WHITE_D65 = (0.95047, 1.0, 1.08883)
_LAB_EPS = 216.0 / 24389.0
_LAB_KAPPA = 24389.0 / 27.0


def _matrix(rows, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).to(device=like.device, dtype=like.dtype)


def _apply_matrix(m: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.einsum("ij,njhw->nihw", m, x)


def srgb_to_linear(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x <= 0.04045, x / 12.92, ((x.clamp(min=0.04045) + 0.055) / 1.055) ** 2.4)


def linear_to_srgb(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x <= 0.0031308, x * 12.92, 1.055 * x.clamp(min=0.0031308) ** (1.0 / 2.4) - 0.055)


def rgb_to_lab(rgb: torch.Tensor) -> torch.Tensor:
    """sRGB in [0, 1], (N, 3, H, W) -> L*a*b* (L in [0, 100])."""
    xyz = _apply_matrix(_matrix(_RGB_TO_XYZ, rgb), srgb_to_linear(rgb))
    white = torch.tensor(_WHITE_D65, dtype=rgb.dtype, device=rgb.device).reshape(1, 3, 1, 1)
    t = xyz / white
    f = torch.where(t > _LAB_EPS, t.clamp(min=_LAB_EPS) ** (1.0 / 3.0), (_LAB_KAPPA * t + 16.0) / 116.0)
    fx, fy, fz = f[:, 0], f[:, 1], f[:, 2]
    return torch.stack((116.0 * fy - 16.0, 500.0 * (fx - fy), 200.0 * (fy - fz)), dim=1)


def lab_to_rgb(lab: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`rgb_to_lab` (not clamped)."""
    L, a, b = lab[:, 0], lab[:, 1], lab[:, 2]
    fy = (L + 16.0) / 116.0
    fx = fy + a / 500.0
    fz = fy - b / 200.0
    f = torch.stack((fx, fy, fz), dim=1)
    f3 = f ** 3
    t = torch.where(f3 > _LAB_EPS, f3, (116.0 * f - 16.0) / _LAB_KAPPA)
    # L* has an exact inverse for y (the standard formula uses L directly for the linear part).
    ty = torch.where(L > _LAB_KAPPA * _LAB_EPS, ((L + 16.0) / 116.0) ** 3, L / _LAB_KAPPA)
    t = torch.stack((t[:, 0], ty, t[:, 2]), dim=1)
    white = torch.tensor(_WHITE_D65, dtype=lab.dtype, device=lab.device).reshape(1, 3, 1, 1)
    xyz = t * white
    m = torch.linalg.inv(torch.tensor(_RGB_TO_XYZ, dtype=torch.float64)).to(device=lab.device, dtype=lab.dtype)
    return linear_to_srgb(_apply_matrix(m, xyz))


def lab_color_fix(content: torch.Tensor, reference: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Mean/std transfer of all three L*a*b* channels, per frame; inputs and output in [0, 1]."""
    dtype = content.dtype
    c_lab = rgb_to_lab(content.float().clamp(0, 1))
    r_lab = rgb_to_lab(reference.float().clamp(0, 1))
    out = lab_to_rgb(adain_color_fix(c_lab, r_lab, eps))
    return out.clamp(0, 1).to(dtype)


# --------------------------------------------------------------------------------------------- entry
def color_correct(content: torch.Tensor, reference: torch.Tensor, mode: str = "wavelet",
                  chunk: int = 8) -> torch.Tensor:
    """Colour-correct ``content`` against ``reference``; both (N, 3, H, W) in [0, 1]. Returns [0, 1].

    Works ``chunk`` frames at a time to bound the temporary memory.
    """
    if mode not in COLOR_CORRECTION_MODES:
        raise ValueError(f"unknown color_correction {mode!r}; choose one of {', '.join(COLOR_CORRECTION_MODES)}")
    if content.shape != reference.shape:
        raise ValueError(f"colour correction needs equal shapes, got {tuple(content.shape)} and {tuple(reference.shape)}")
    if mode == "none":
        return content
    outs = []
    for i in range(0, content.shape[0], chunk):
        c = content[i:i + chunk].float()
        r = reference[i:i + chunk].to(device=c.device, dtype=torch.float32)
        if mode == "wavelet":
            o = wavelet_reconstruction(c, r)
        elif mode == "adain":
            o = adain_color_fix(c, r)
        else:
            o = lab_color_fix(c, r)
        outs.append(o.clamp(0, 1).to(content.dtype))
    return torch.cat(outs, dim=0)
