"""Video/text weight pairs, named as the official ``MMModule`` names them (``.vid``/``.txt`` or ``.all``)."""
from __future__ import annotations

from typing import Callable

from torch import nn


class MMPair(nn.Module):
    """Holds ``vid`` and ``txt`` copies of a sub-module, or one ``all`` copy when the block shares weights.

    ``vid_only`` marks the official "video-only" modules of the 3B last block: the weights exist (in
    ``.all``) but the text stream does not pass through them.
    """

    def __init__(self, factory: Callable[[], nn.Module], shared: bool, vid_only: bool = False):
        super().__init__()
        self.shared = shared
        self.vid_only = vid_only
        if shared:
            self.all = factory()
        else:
            self.vid = factory()
            self.txt = factory()

    def for_vid(self) -> nn.Module:
        return self.all if self.shared else self.vid

    def for_txt(self) -> nn.Module:
        return self.all if self.shared else self.txt
