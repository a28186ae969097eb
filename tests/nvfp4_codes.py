"""NVFP4 weights holding every E2M1 code and every kind of E4M3 block scale, for the GPU kernels' bit-exact decode
tests (tests/gpu/test_nvfp4_wgmma_gpu.py, test_nvfp4_rs_gpu.py)."""
import torch

from seedvr2bw.optimization.nvfp4 import format as fmt

# E4M3 block scales of every kind: zero, smallest subnormal, subnormals, smallest normal, normals, the largest
SCALES = [0.0, 2.0 ** -9, 3 * 2.0 ** -9, 2.0 ** -7, 2.0 ** -6, 0.4375, 1.0, 1.125, 13.0, 240.0, 448.0]


def weight_of_every_code(n: int, k: int, g: float, seed: int) -> fmt.NVFP4Tensor:
    """[n, k] packed bytes at random, rows 0 and 1 holding all 256 byte values; block scales drawn from SCALES."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    packed[0, :128] = torch.arange(128, dtype=torch.uint8)
    packed[1, :128] = torch.arange(128, 256, dtype=torch.uint8)
    s = torch.tensor(SCALES)[torch.randint(0, len(SCALES), (n, k // 16), generator=gen)].to(torch.float8_e4m3fn)
    return fmt.NVFP4Tensor(packed, fmt.swizzle_block_scales(s), torch.tensor(g, dtype=torch.float32), (n, k))
