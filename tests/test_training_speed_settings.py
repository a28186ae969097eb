"""The CUDA-only training speed settings (CUDA graphs, compiled blocks): validation, overrides, one log line."""
import logging
from types import SimpleNamespace

import pytest
import torch

from seedvr2bw.training.trainer import COMPILE_ENV, CUDA_GRAPH_ENV, FluxLoraTrainer, TrainConfig


@pytest.mark.parametrize("field", ["cuda_graph", "compile_blocks"])
def test_bad_setting_names_field_and_choices(field):
    cfg = TrainConfig(**{field: "fast"})
    with pytest.raises(ValueError, match=rf"unknown {field} setting 'fast'.*auto, on, off"):
        cfg.validate()


def _fake(device="cuda", runner=None, **cfg):
    return SimpleNamespace(cfg=TrainConfig(**cfg), device=torch.device(device), block_runner=runner)


@pytest.mark.parametrize("name,env", [("cuda_graph", CUDA_GRAPH_ENV), ("compile_blocks", COMPILE_ENV)])
def test_feature_resolution_and_log(monkeypatch, caplog, name, env):
    feature = FluxLoraTrainer.gpu_feature
    monkeypatch.delenv(env, raising=False)
    with caplog.at_level(logging.INFO):
        assert feature(_fake(**{name: "auto"}), name, env, "X") is True     # auto: on for CUDA
        assert feature(_fake(**{name: "off"}), name, env, "X") is False
        assert feature(_fake("cpu", **{name: "on"}), name, env, "X") is False            # CPU: never
        assert feature(_fake(runner=object(), **{name: "on"}), name, env, "X") is False  # BlockSwap: never
        monkeypatch.setenv(env, "0")
        assert feature(_fake(**{name: "on"}), name, env, "X") is False      # the env variable wins
    lines = [r.getMessage() for r in caplog.records if "[FluxLoraTrain] X:" in r.getMessage()]
    assert len(lines) == 5 and "device cpu" in lines[2] and "BlockSwap" in lines[3] and env in lines[4]
