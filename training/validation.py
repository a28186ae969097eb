"""Validation loss on held-out images, at fixed timesteps and fixed noise: between two evaluations only the LoRA
changes, so the value is comparable across steps, runs and a resume; the lowest one marks the checkpoint to keep.
"""
from __future__ import annotations

import torch

# spread over the range the sigmoid sampling trains most (kohya's and ai-toolkit's validation use fixed timesteps too)
SIGMAS = (0.1, 0.3, 0.5, 0.7, 0.9)
NOISE_SEED_OFFSET = 0x5EED_0000   # the validation noise never shares a stream with the training draws


def holdout_indices(n: int, share: float, seed: int) -> list[int]:
    """The indices of the ``share`` of ``n`` items held out for validation (at least one), fixed by ``seed``."""
    if not 0.0 <= share < 1.0:
        raise ValueError(f"validation_share must be at least 0 and below 1 (got {share}). Fix: use e.g. 0.1, or 0 "
                         "for no held-out images.")
    if share == 0.0:
        return []
    k = max(1, round(share * n))
    if k >= n:
        raise ValueError(f"validation_share {share} of {n} image(s) leaves none to train on. Fix: add images, "
                         "lower validation_share, or connect a separate validation dataset.")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(int(seed)))
    return sorted(perm[:k].tolist())


class ValidationSet:
    """Every (image, sigma) pair of ``dataset`` with its own noise, drawn from a generator seeded by the run's seed
    and the pair's position, so the same pairs come back at every evaluation."""

    def __init__(self, dataset, seed: int, sigmas=SIGMAS):
        if len(dataset) == 0:
            raise ValueError("the validation dataset is empty. Fix: add images to it, or disconnect it.")
        self.data, self.seed, self.sigmas = dataset, int(seed), tuple(float(s) for s in sigmas)

    def __len__(self):
        return len(self.data) * len(self.sigmas)

    def samples(self):
        """Yields ``(x0, context, pooled, noise, sigma)`` with a batch dim of 1, on the CPU in fp32."""
        for i, lat in enumerate(self.data.latents):
            cap = self.data.items[i].caption
            ctx, y = self.data.conds[cap][None], self.data.pooled[cap][None]
            for j, s in enumerate(self.sigmas):
                g = torch.Generator().manual_seed(NOISE_SEED_OFFSET + self.seed * 7919 + i * len(self.sigmas) + j)
                noise = torch.randn((1, *lat.shape), generator=g, dtype=torch.float32)
                yield lat[None].float(), ctx, y, noise, torch.tensor([s], dtype=torch.float32)


class BestTracker:
    """The validation history ``[(step, loss)]`` and the step of its lowest loss."""

    def __init__(self):
        self.history: list = []
        self.best: tuple | None = None   # (step, loss)

    def record(self, step: int, loss: float) -> bool:
        """Adds a result; True when it is the lowest so far (ties keep the earlier step)."""
        self.history.append((int(step), float(loss)))
        if self.best is None or loss < self.best[1]:
            self.best = (int(step), float(loss))
            return True
        return False

    def state_dict(self) -> dict:
        return {"history": list(self.history), "best": self.best}

    def load_state_dict(self, st: dict) -> None:
        self.history = [(int(s), float(v)) for s, v in st.get("history", [])]
        b = st.get("best")
        self.best = None if b is None else (int(b[0]), float(b[1]))
