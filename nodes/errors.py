"""Every exception type the pack raises gets one short, stable module name, ``seedvr2bw``.

ComfyUI's error panel prints an exception's type as ``type.__module__ + "." + qualname``; inside ComfyUI a
custom node's modules are named after their folder path (``/home/u/ComfyUI/custom_nodes/<folder>.models.seedvr2
.pipeline``), so the type alone fills the panel's line and cuts the message off. ``seedvr2bw.SeedVR2InputError``
fits and does not depend on where the pack is installed. The classes stay defined where they are; only the name
they report changes, once, here (``nodes/__init__.py`` imports this module before the nodes).
"""
from __future__ import annotations

from ..models.seedvr2.dit.loader import DiTCheckpointError
from ..models.seedvr2.dit.nadit import DiTInterrupted
from ..models.seedvr2.dit.sequence_parallel import TooFewWindows
from ..models.seedvr2.embeddings import MissingEmbeddingError
from ..models.seedvr2.files import ModelFileError
from ..models.seedvr2.memory import SeedVR2MemoryError
from ..models.seedvr2.pipeline import SeedVR2Cancelled, SeedVR2InputError
from ..models.seedvr2.vae.loader import NotASeedVR2VAE
from ..models.seedvr2.vae.posterior import VAECancelled
from ..models.seedvr2.vae.row_parallel import TooFewRows
from ..models.seedvr2.video.container import SeekMismatch, VideoFileError
from ..models.seedvr2.video.workers import JobCancelled, WorkerError
from ..optimization.gguf.format import GGUFError
from ..optimization.gguf.reader import GGUFPackageMissing
from ..training.data import DatasetError
from ..training.memory_plan import TrainMemoryError
from ..training.save import OutputNameError

SHORT_MODULE = "seedvr2bw"

USER_ERRORS = (
    SeedVR2InputError, SeedVR2MemoryError, SeedVR2Cancelled, DiTCheckpointError, DiTInterrupted, NotASeedVR2VAE, VAECancelled,
    ModelFileError, MissingEmbeddingError, VideoFileError, GGUFError, GGUFPackageMissing, DatasetError,
    OutputNameError, TrainMemoryError, WorkerError, JobCancelled, TooFewWindows, TooFewRows, SeekMismatch,
)

for _cls in USER_ERRORS:
    _cls.__module__ = SHORT_MODULE
