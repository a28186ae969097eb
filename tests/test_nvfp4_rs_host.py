"""CPU checks of the sm_90a RS W4A16 kernel (optimization/nvfp4/w4a16_rs.cu, rs_w4a16.py): the work split (data-
parallel rounds + stream-K tail, emulated from the kernel's own rules: every k tile of every tile done once, every
stream-K wait on a lower-numbered CTA's first item, at most one partial sum per CTA), the tile choice, the shared
memory budget, the launch arguments, and a compile of every shipped config: NVRTC (what runs on users' GPUs, when
the nvidia-cuda-nvrtc wheel is installed) and nvcc (when present) must report no spills and no serialized wgmma.
The kernel itself runs in tests/gpu/test_nvfp4_rs_gpu.py."""
import ctypes

import pytest
import torch

from sm90_compile import assert_no_spills_or_serialized_wgmma, needs_nvcc, nvcc_report, nvrtc_report
from seedvr2bw.optimization.nvfp4 import rs_w4a16 as R


class Sched:
    """The kernel's struct Sched, line for line."""

    def __init__(self, num_nt, kt, dp_tiles, sk_tiles, g_sk, cta, grid):
        self.num_nt, self.KT, self.dp_tiles, self.sk_tiles, self.g_sk, self.grid = num_nt, kt, dp_tiles, sk_tiles, \
            g_sk, grid
        self.dp_items = (dp_tiles - cta + grid - 1) // grid if cta < dp_tiles else 0
        self.u0 = self.range_start(cta) if cta < g_sk else 0
        self.u1 = self.range_start(cta + 1) if cta < g_sk else 0
        self.t_first = self.u0 // kt
        self.t_last = (self.u1 - 1) // kt if self.u1 > self.u0 else self.t_first - 1
        self.cta = cta

    def range_start(self, b):
        return b * self.sk_tiles * self.KT // self.g_sk

    def items(self):
        return self.dp_items + (self.t_last - self.t_first + 1)

    def item(self, i):
        if i < self.dp_items:
            return self.cta + i * self.grid, 0, self.KT
        t = self.t_last - (i - self.dp_items)
        t0 = t * self.KT
        return self.dp_tiles + t, max(self.u0, t0) - t0, min(self.u1, t0 + self.KT) - t0


def emulate(n_tiles, kt, sms, stream_k=True):
    """Run the split as the kernel would; returns the CTAs' work and checks the stream-K protocol."""
    dp, sk, g_sk = R.split(n_tiles, kt, sms) if stream_k else (n_tiles, 0, 1)
    grid = min(n_tiles, sms) if sk == 0 else sms
    done = {}
    partials = {}                       # cta -> tile of its partial sum
    for cta in range(grid):
        sc = Sched(1, kt, dp, sk, g_sk, cta, grid)
        for i in range(sc.items()):
            tile, kb, ke = sc.item(i)
            assert 0 <= kb < ke <= kt and 0 <= tile < n_tiles
            for k in range(kb, ke):
                assert (tile, k) not in done
                done[(tile, k)] = cta
            if i >= sc.dp_items:
                if ke < kt:
                    assert cta not in partials, "a CTA writes at most one partial sum"
                    assert i == sc.dp_items, "the partial is the CTA's first stream-K item"
                    partials[cta] = tile
                elif kb > 0:
                    assert i == sc.items() - 1, "the tile a CTA finishes is its last item"
                    t0 = (tile - dp) * kt
                    b = cta - 1
                    while True:                 # the kernel's wait loop
                        assert partials.get(b) == tile, (cta, b)
                        del partials[b]
                        if sc.range_start(b) <= t0:
                            break
                        b -= 1
    assert len(done) == n_tiles * kt
    assert not partials, "every partial sum is consumed"
    return dp, sk, g_sk


@pytest.mark.parametrize("n_tiles,kt,sms", [(320, 108, 132), (864, 40, 132), (384, 192, 132), (384, 48, 132),
                                            (6, 32, 5), (6, 32, 4), (6, 32, 132), (16, 32, 3), (20, 32, 7),
                                            (1, 64, 132), (96, 192, 132), (133, 16, 132), (131, 300, 132)])
def test_split_covers_every_k_tile_once_and_the_waits_are_safe(n_tiles, kt, sms):
    dp, sk, g_sk = emulate(n_tiles, kt, sms)
    assert dp + sk == n_tiles
    if sk:
        assert dp % sms == 0 and sk < sms and sk < g_sk <= sms
        assert sk * kt // g_sk >= R.MIN_SK_UNITS
    emulate(n_tiles, kt, sms, stream_k=False)


def test_split_random():
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        n_tiles, kt, sms = (int(v) for v in (torch.randint(1, 2000, (1,), generator=gen),
                                              torch.randint(1, 300, (1,), generator=gen),
                                              torch.randint(2, 200, (1,), generator=gen)))
        emulate(n_tiles, kt, sms)


def test_stream_k_only_where_it_beats_a_round():
    assert R.split(384, 48, 132) == (384, 0, 1)          # 120 tail tiles x 48 k tiles: no faster than a round
    assert R.split(320, 108, 132) == (264, 56, 132)      # 6912 x 2560 at M = 4096: 56 tiles over 132 CTAs
    assert R.split(264, 108, 132) == (264, 0, 1)         # whole rounds


@pytest.mark.parametrize("m", [1024, 2048, 4096, 8192, 16384, 33000])
@pytest.mark.parametrize("k,n", [(2560, 6912), (6912, 2560), (3072, 12288), (12288, 3072), (3072, 9216),
                                 (3072, 3072)])
def test_configs_fit_the_sm(m, k, n):
    tn, stages = R.config_for(m, n, k)
    assert tn in R.TILE_TOKENS and stages >= 3
    R.check_config(tn, stages)
    assert R.smem_bytes(tn, stages) + 1024 <= 227 * 1024  # + the barriers' static block


def test_224_tokens_where_256_leave_the_last_round_mostly_idle():
    assert R.config_for(4096, 2560, 6912)[0] in (224, 256)
    assert R.config_for(4096, 3072, 3072)[0] == 256


def test_launch_arguments_outlive_their_builder():
    t = [torch.empty(64, dtype=torch.uint8) for _ in range(5)]
    maps = [(ctypes.c_uint64 * 16)(*range(i, i + 16)) for i in range(3)]
    arr = R.launch_args(*maps, *t, (300, 1024, 320, 5, 264, 56, 132))
    del maps
    churn = [ctypes.c_int(-1) for _ in range(20000)]
    ints = [ctypes.cast(arr[i], ctypes.POINTER(ctypes.c_int)).contents.value for i in range(8, 15)]
    ptrs = [ctypes.cast(arr[i], ctypes.POINTER(ctypes.c_void_p)).contents.value for i in range(3, 8)]
    first = ctypes.cast(arr[0], ctypes.POINTER(ctypes.c_uint64 * 16)).contents
    assert ints == [300, 1024, 320, 5, 264, 56, 132] and len(churn) == 20000
    assert ptrs == [v.data_ptr() for v in t] and list(first) == list(range(16))


def test_kernel_source():
    name, src = R.kernel_source(256, 4, True)
    assert name in src and "#define TN 256" in src and "//%%WGMMA%%" not in src
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in src
    assert "u64 desc, u32 acc)" in src and '"r"(acc)' in src and "static __device__ __forceinline__ u32 e2m1x2(" in src


SHIPPED = sorted({(*R.config_for(m, n, k), bias) for m in (1024, 4096, 16384)
                  for k, n in [(2560, 6912), (6912, 2560), (3072, 12288), (12288, 3072), (3072, 3072)]
                  for bias in (False, True)})


@pytest.mark.parametrize("cfg", SHIPPED)
def test_nvrtc_compiles_without_spills_or_serialized_wgmma(cfg):
    """The compile users get (NVRTC, as torch.cuda._compile_kernel does). Its ptxas once reused one A register set
    for the next and serialized every wgmma (C7513) where nvcc's, on the same source, did not; the kernel keeps the
    sets live against that, and this checks it on every shipped config."""
    assert_no_spills_or_serialized_wgmma(nvrtc_report(R.kernel_source(*cfg)[1]))


@needs_nvcc
@pytest.mark.parametrize("cfg", SHIPPED[:2])
def test_nvcc_compiles_without_spills_or_serialized_wgmma(cfg, tmp_path):
    assert_no_spills_or_serialized_wgmma(nvcc_report(R.kernel_source(*cfg)[1], tmp_path))
