"""Triton GEMMs of the VAE's 1 x 1 convs with what reads their outputs as the epilogue (imported only when Triton is
present): the upsamplers' conv with its depth-to-space (and the causal conv input's other copies), the ResNet
shortcut with the residual add and the sum's GroupNorm moments. cuBLAS writes a 1 x 1 conv's output and a pass of
its own reads it back: here the output tile goes from the accumulator to where it is read.
"""

import torch
import triton
import triton.language as tl

from .vae_kernels import group_norm_frames_cl, keep_args, store_edges

# (rows, outputs, channels a step, warps, stages) of a program. The output tile must lie in one output frame and one
# depth-to-space position: BN divides the output channels (the decoder's are 128-512)
GEMM_TILE = (128, 128, 64, 4, 3)
_tiles = {}


def tile_for(device):
    """The tile on ``device``: three stages of operands where a program may hold them (160 KiB of shared memory: an
    H100's 227), two on the consumer GPUs' 99 KiB; GEMM_TILE off CUDA."""
    if torch.device(device).type != "cuda":
        return GEMM_TILE
    key = str(device)
    if key not in _tiles:
        smem = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)
        _tiles[key] = GEMM_TILE[:4] + (3 if smem >= 160 * 1024 else 2,)
    return _tiles[key]


@triton.jit
def _frame_tile(HW, NT, BM: tl.constexpr):
    """(frame, block of the frame's pixels, block of outputs) of this program. Consecutive programs take the
    output blocks of one pixel block (its input rows are read from memory once, then from L2)."""
    pid = tl.program_id(0)
    nt = pid % NT
    mb = pid // NT
    per = tl.cdiv(HW, BM)
    return mb // per, mb % per, nt


@triton.jit
def _gemm_rows(X, W, BT, J, N0, HW, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """float32 [BM, BN] tile: pixels J*BM.. of frame BT of X (pixels, K) against the rows N0.. of W (N, K);
    K a multiple of BK. Returns (tile, the pixels, their mask)."""
    p = J * BM + tl.arange(0, BM)
    pmask = p < HW
    rows = BT.to(tl.int64) * HW + p
    ks = tl.arange(0, BK)
    ns = N0 + tl.arange(0, BN)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(X + rows[:, None] * K + (k0 + ks)[None, :], mask=pmask[:, None], other=0.0)
        w = tl.load(W + ns[None, :].to(tl.int64) * K + (k0 + ks)[:, None])
        acc = tl.dot(a, w, acc)
    return acc, p, pmask


@triton.jit
def _conv1x1_d2s_kernel(X, W, B, OUT, HW, WIDTH, T, K, C, NT, S, RT, OB, OT, OH, HEAD, KP, K0, KB, KT, KH,
                        DROP: tl.constexpr, HAS_B: tl.constexpr, HAS_K: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr):
    bt, j, nt = _frame_tile(HW, NT, BM)
    n0 = nt * BN
    q = n0 // C                          # ((sx * S + sy) * RT + st): which output pixel and frame
    st = q % RT
    sy = (q // RT) % S
    sx = q // (RT * S)
    b = bt // T
    f = (bt % T) * RT + st               # output frame before the first chunk's duplicate is dropped
    if (not DROP) or f != 1:             # (the duplicate is not computed)
        if DROP and f > 1:
            f -= 1
        acc, p, pmask = _gemm_rows(X, W, bt, j, n0, HW, K, BM, BN, BK)
        cols = n0 - q * C + tl.arange(0, BN)
        if HAS_B:
            acc += tl.load(B + q * C + cols).to(tl.float32)[None, :]
        v = acc.to(OUT.dtype.element_ty)
        h = p // WIDTH
        w = p - h * WIDTH
        mask = pmask[:, None] & (cols < C)[None, :]
        dst = b.to(tl.int64) * OB + f.to(tl.int64) * OT + (h * S + sx) * OH + (w * S + sy) * C
        tl.store(OUT + dst[:, None] + cols[None, :], v, mask=mask)
        store_edges(OUT, dst[:, None] + cols[None, :], v, mask, f, HEAD, OT, KP, K0, KB, KT, b.to(tl.int64),
               ((h * S + sx) * KH + (w * S + sy) * C)[:, None] + cols[None, :], HAS_K=HAS_K)


def fits(cin, cout, tile=GEMM_TILE):
    """Whether a 1 x 1 conv of ``cin`` to ``cout`` channels (``cout`` the channels of one output position) runs here:
    the channels divide into the tile."""
    return cin % tile[2] == 0 and cout % tile[1] == 0


def conv1x1_d2s(x, weight, bias, out, s, rt, drop, head=0, keep=None, tile=GEMM_TILE):
    """``fused.conv1x1_depth_to_space`` in one kernel: x (B, CIN, T, H, W) dense channels-last 3-D, ``weight``
    (s*s*rt*C, CIN, 1, 1, 1) contiguous, ``bias`` (s*s*rt*C,) or None, added to the float32 accumulator (one
    rounding); ``out`` (B, C, T*rt - drop, H*s, W*s), channels and a row's pixels dense, samples, frames and rows at
    any stride. ``head``, ``keep``: ``vae_kernels.group_norm_frames_cl``'s."""
    b, k, t, h, w = x.shape
    n = weight.shape[0]
    c = n // (s * s * rt)
    bm, bn, bk, warps, stages = tile
    if c % bn or k % bk:
        raise ValueError(f"conv1x1_d2s: {k} input and {c} output channels do not divide into the tile {tile[:3]}")
    nt = n // bn
    grid = (b * t * triton.cdiv(h * w, bm) * nt,)
    _conv1x1_d2s_kernel[grid](x, weight, weight if bias is None else bias, out, h * w, w, t, k, c, nt, s, rt,
                              out.stride(0), out.stride(2), out.stride(3), head, *keep_args(keep, out, out.shape[2]),
                              DROP=bool(drop), HAS_B=bias is not None, HAS_K=keep is not None, BM=bm, BN=bn, BK=bk,
                              num_warps=warps, num_stages=stages)
    return out


@triton.jit
def _shortcut_residual_kernel(X, W, XB, H, B, PART, HW, K, C, NT, NBLK, BM: tl.constexpr, BN: tl.constexpr,
                              BK: tl.constexpr):
    # h + bias + (W x + x_bias) of a tile, written into h, and the sum's (mean, M2) per channel over the tile's
    # pixels: the partial moments ``residual_bias_cl`` gives (blocks of BM pixels of a frame)
    bt, j, nt = _frame_tile(HW, NT, BM)
    n0 = nt * BN
    acc, p, pmask = _gemm_rows(X, W, bt, j, n0, HW, K, BM, BN, BK)
    cols = n0 + tl.arange(0, BN)
    # rounded where the shortcut's sum with its bias and the residual add round (the GEMM's own rounding is gone)
    s = (acc + tl.load(XB + cols).to(tl.float32)[None, :]).to(H.dtype.element_ty).to(tl.float32)
    off = (bt.to(tl.int64) * HW + p)[:, None] * C + cols[None, :]
    mask = pmask[:, None] & (cols < C)[None, :]
    h = tl.load(H + off, mask=mask, other=0.0).to(tl.float32)
    h = (h + tl.load(B + cols).to(tl.float32)[None, :]).to(H.dtype.element_ty).to(tl.float32)
    y = (h + s).to(H.dtype.element_ty)
    tl.store(H + off, y, mask=mask)
    n = tl.minimum(HW - j * BM, BM).to(tl.float32)
    yf = tl.where(mask, y.to(tl.float32), 0.0)
    mean = tl.sum(yf, axis=0) / n
    d = tl.where(mask, yf - mean[None, :], 0.0)
    idx = ((bt.to(tl.int64) * NBLK + j) * C + cols) * 2
    tl.store(PART + idx, mean)
    tl.store(PART + idx + 1, tl.sum(d * d, axis=0))


def shortcut_residual(h, x, weight, x_bias, bias, tile=GEMM_TILE):
    """h + ``bias`` + (the 1 x 1 conv ``weight`` (C, CIN, 1, 1, 1) of x, plus ``x_bias`` (C,)), written into h: the
    ResNet block's output where the width changes, x (B, CIN, T, H, W) and h (B, C, T, H, W) dense channels-last
    3-D. Returns (h, moments): the sum's per-frame partial statistics in ``residual_bias_cl``'s form, from the same
    kernel, so the GroupNorm that reads it next skips its pass."""
    b, k, t, hh, w = x.shape
    c = weight.shape[0]
    bm, bn, bk, warps, stages = tile
    if c % bn or k % bk:
        raise ValueError(f"shortcut_residual: {k} input and {c} output channels do not divide into the tile "
                         f"{tile[:3]}")
    nt = c // bn
    nblk = triton.cdiv(hh * w, bm)
    part = torch.empty((b, t, nblk, c, 2), device=h.device, dtype=torch.float32)
    _shortcut_residual_kernel[(b * t * nblk * nt,)](x, weight, x_bias, h, bias, part, hh * w, k, c, nt, nblk, BM=bm,
                                                    BN=bn, BK=bk, num_warps=warps, num_stages=stages)
    return h, (part, bm)


def selftest_errors(device, tile=GEMM_TILE):
    """Relative errors of both kernels against torch in float32 on small random bf16 inputs on ``device`` (their
    self-test: ``fused.gemm_epilogues``): the depth-to-space x2 in time and space with the first chunk's duplicate
    dropped, the shortcut's sum and its moments (the GroupNorm of the sum from them against its own pass)."""
    g = torch.Generator(device="cpu").manual_seed(4321)
    cl = torch.channels_last_3d

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=torch.bfloat16)

    def rel(a, b):
        a, b = a.double(), b.double()
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    cin, c = tile[2], tile[1]
    x = rnd(1, cin, 2, 5, 6).contiguous(memory_format=cl)
    w, b = rnd(8 * c, cin, 1, 1, 1, scale=cin ** -0.5), rnd(8 * c, scale=0.1)
    y = torch.nn.functional.conv3d(x.float(), w.float(), b.float())
    want = y.view(1, 2, 2, 2, c, 2, 5, 6).permute(0, 4, 5, 3, 6, 1, 7, 2).reshape(1, c, 4, 10, 12)[:, :, [0, 2, 3]]
    out = torch.empty(1, c, 3, 10, 12, device=device, dtype=x.dtype, memory_format=cl)
    errs = {"conv1x1_d2s": rel(conv1x1_d2s(x, w.view(8 * c, cin), b, out, 2, 2, True, tile=tile), want)}
    h, ws, xb, hb = rnd(1, c, 2, 5, 6).contiguous(memory_format=cl), w[:c], rnd(c, scale=0.1), b[:c]
    want = h.float() + hb.float().view(1, -1, 1, 1, 1) + torch.nn.functional.conv3d(x.float(), ws.float(), xb.float())
    got, moments = shortcut_residual(h.clone(), x, ws.view(c, cin), xb, hb, tile=tile)
    gw, gb = rnd(c, scale=0.3) + 1, rnd(c, scale=0.3)
    errs["shortcut_residual"] = max(rel(got, want), rel(group_norm_frames_cl(got, 4, gw, gb, 1e-6, moments=moments),
                                                        group_norm_frames_cl(got, 4, gw, gb, 1e-6)))
    return errs
