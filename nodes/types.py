"""Socket types the pack's nodes pass between each other (the objects are never serialised)."""
from comfy_api.latest import io

SeedVR2DiT = io.Custom("SEEDVR2BW_DIT")          # models.seedvr2 DiT wrapped with its runtime settings
SeedVR2VAE = io.Custom("SEEDVR2BW_VAE")          # models.seedvr2 VAE with its tiling settings
BlockSwapConfig = io.Custom("SEEDVR2BW_BLOCKSWAP")  # optimization.blockswap.BlockSwapConfig
LoraDataset = io.Custom("SEEDVR2BW_LORA_DATASET")  # training.dataset description
LoraTrainingSettings = io.Custom("SEEDVR2BW_LORA_SETTINGS")



class _AnyCombo(str):
    """The socket type "COMBO" that equals every type: links into any combo widget (LoraLoader's ``lora_name``)
    whatever its file list is at validation time, which may not hold the file yet (it is written by the run)."""

    def __ne__(self, other):
        return False

    def __eq__(self, other):
        return True

    __hash__ = str.__hash__


# A name a combo input accepts: ComfyUI 0.3.75 types a Combo output by its options, 0.19.3 by the plain "COMBO"
# (which its validation refuses for a V1 combo input), so the type is a custom one whose io_type matches anything
# (set after creation: ComfyUI wraps the name given to io.Custom in a str type of its own).
ComboName = io.Custom("COMBO")
ComboName.io_type = _AnyCombo("COMBO")

CATEGORY = "SeedVR2-Blackwell"
