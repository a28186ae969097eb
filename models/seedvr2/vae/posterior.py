"""What the VAE's entry points share with the spatial tiler (tiling.py): the posterior, the stop check."""
from __future__ import annotations

from typing import Callable, Optional

import torch


class VAECancelled(RuntimeError):
    """Raised when `should_stop()` returned True between two chunks or tiles."""


def check_stop(should_stop: Optional[Callable[[], bool]]) -> None:
    if should_stop is not None and should_stop():
        raise VAECancelled("VAE run cancelled")


class LatentDistribution:
    """Diagonal Gaussian posterior (diffusers `DiagonalGaussianDistribution`): moments split into mean (first half
    of the channels) and logvar (second half), logvar clamped to [-30, 20]."""

    def __init__(self, moments: torch.Tensor):
        self.moments = moments
        c = moments.shape[1] // 2
        self.mean = moments[:, :c]
        self.logvar = moments[:, c:].clamp(-30.0, 20.0)

    @property
    def std(self) -> torch.Tensor:
        return torch.exp(0.5 * self.logvar)

    def sample(self, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """mean + std * N(0, 1): what the official pipeline uses as the LQ latent (docs/SPEC.md §5, §6 step 4)."""
        noise = torch.randn(self.mean.shape, generator=generator, device=self.mean.device, dtype=self.mean.dtype)
        return self.mean + self.std * noise

    def mode(self) -> torch.Tensor:
        return self.mean

    def __iter__(self):
        return iter((self.mean, self.logvar))
