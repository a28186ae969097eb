"""The file upscaler of the CLI and the multi-GPU workers (models/seedvr2/upscaler.py): what a sequence-parallel
worker says when the resident models or a chunk do not fit its GPU."""
import numpy as np
import pytest
import torch

from seedvr2bw.models.seedvr2 import upscaler as U
from seedvr2bw.models.seedvr2.memory import SeedVR2MemoryError
from seedvr2bw.models.seedvr2.pipeline import UpscaleSettings


def _oom(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")


def test_sequence_parallel_models_that_do_not_fit_say_what_to_do(monkeypatch):
    monkeypatch.setattr(U, "load_dit", _oom)
    up = U.FileUpscaler("dit.safetensors", "vae.safetensors", "cuda:1", torch.bfloat16, group=object())
    with pytest.raises(SeedVR2MemoryError, match=r"cuda:1: sequence parallel keeps both models on every GPU.*"
                                                 r"Tried to allocate 2.00 GiB\)\. Fix: multi_gpu 'chunks'"):
        up.chunk_upscaler(UpscaleSettings())(np.zeros((5, 8, 8, 3), np.float32))
    assert up.dit is None     # a later call tries again, it does not run on half a load


def test_a_sequence_parallel_chunk_out_of_memory_says_what_to_do(monkeypatch):
    up = U.FileUpscaler("dit.safetensors", "vae.safetensors", "cuda:0", torch.bfloat16, group=object())
    monkeypatch.setattr(up, "load", lambda: None)
    monkeypatch.setattr(U.P, "upscale", _oom)
    with pytest.raises(SeedVR2MemoryError, match=r"cuda:0: sequence parallel ran out of GPU memory on chunks of 5 "
                                                 r"frames of 16x8 .*Fix: more GPUs"):
        up.chunk_upscaler(UpscaleSettings())(np.zeros((5, 8, 16, 3), np.float32))
    solo = U.FileUpscaler("dit.safetensors", "vae.safetensors", "cpu", torch.float32)
    monkeypatch.setattr(solo, "load", lambda: None)
    with pytest.raises(torch.OutOfMemoryError):      # not sequence parallel: the error as it came
        solo.chunk_upscaler(UpscaleSettings())(np.zeros((5, 8, 16, 3), np.float32))
