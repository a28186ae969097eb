"""Configuration of the SeedVR2 causal video VAE ("video_vae_v3").

The real values are those of SeedVR `models/video_vae_v3/s8_c16_t4_inflation_sd3.yaml` (docs/SPEC.md §5). A tiny model
(the golden vectors) has the same topology with other widths; `config_from_state_dict` reads the widths from the
tensors. The GroupNorm group count is the one thing no tensor records, so it must be given unless the real value
(32) divides every width.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Tuple


@dataclass(frozen=True)
class VAEConfig:
    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 16
    block_out_channels: Tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2          # encoder; the decoder uses layers_per_block + 1 per up block
    norm_num_groups: int = 32
    norm_eps: float = 1e-6
    temporal_scale_num: int = 2        # number of 2x temporal down/up samplers
    mid_attention: bool = True
    scaling_factor: float = 0.9152     # applied by the pipeline, exposed on the model
    shift_factor: float = 0.0
    # Official causal slicing (`set_causal_slicing(split_size=4)`): encode the first frame + 4 frames, then 4 frames
    # at a time; decode latent chunks of split_size // 4. None = one pass. Both are exact (docs/SPEC.md §5).
    split_size: Optional[int] = 4
    # Official memory limits (`set_memory_limit(0.5, 0.5)`, GiB). Convs whose padded input is larger are computed in
    # spatial bands; GroupNorms over larger tensors in group chunks. Both are exact.
    conv_max_mem: Optional[float] = 0.5
    norm_max_mem: Optional[float] = 0.5

    @property
    def spatial_factor(self) -> int:
        return 2 ** (len(self.block_out_channels) - 1)

    @property
    def temporal_factor(self) -> int:
        return 2 ** self.temporal_scale_num


# The released SeedVR2 VAE (250,648,227 parameters, docs/SPEC.md §0).
SEEDVR2_VAE = VAEConfig()


def config_from_state_dict(sd: Mapping[str, "object"], norm_num_groups: Optional[int] = None, **overrides) -> VAEConfig:
    """Derive the widths of a SeedVR2-topology VAE from its tensors (shapes only, so meta tensors work)."""
    def shape(k):
        return tuple(sd[k].shape)

    boc = []
    i = 0
    while f"encoder.down_blocks.{i}.resnets.0.conv1.weight" in sd:
        boc.append(shape(f"encoder.down_blocks.{i}.resnets.0.conv1.weight")[0])
        i += 1
    if not boc:
        raise ValueError("not a SeedVR2 VAE state dict: no encoder.down_blocks.*.resnets.0.conv1.weight")
    layers = 0
    while f"encoder.down_blocks.0.resnets.{layers}.conv1.weight" in sd:
        layers += 1
    # A temporal upsampler expands C to 8C (2x time, 2x2 space), a spatial-only one to 4C.
    t_num = 0
    for j in range(len(boc) - 1):
        k = f"decoder.up_blocks.{j}.upsamplers.0.upscale_conv.weight"
        if k in sd and shape(k)[0] == 8 * shape(k)[1]:
            t_num += 1
    if norm_num_groups is None:
        if all(c % 32 == 0 for c in boc):
            norm_num_groups = 32
        else:
            raise ValueError(
                f"cannot infer the GroupNorm group count for widths {boc} (no tensor records it); pass norm_num_groups"
            )
    kw = dict(
        in_channels=shape("encoder.conv_in.weight")[1],
        out_channels=shape("decoder.conv_out.weight")[0],
        latent_channels=shape("decoder.conv_in.weight")[1],
        block_out_channels=tuple(boc),
        layers_per_block=layers,
        norm_num_groups=norm_num_groups,
        temporal_scale_num=t_num,
        mid_attention="encoder.mid_block.attentions.0.to_q.weight" in sd,
    )
    kw.update(overrides)
    return VAEConfig(**kw)
