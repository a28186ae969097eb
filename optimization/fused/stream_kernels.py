"""Triton kernels of the VAE's streamed causal conv (imported only when Triton is present): a 3 x 3 x 3 conv to a few
channels (the decoder's conv_out, 128 -> 3) run one input frame at a time (``fused.stream_conv3d``): the GEMM to
per-tap planes with the GroupNorm + SiLU that feeds it applied on load, and the tap sum with its causal state.
"""

import torch
import triton
import triton.language as tl


# --------------------------------------------------------------------------------------------------
# a causal 3 x 3 x 3 conv to a few channels (the decoder's conv_out, 128 -> 3), one input frame at a time
# --------------------------------------------------------------------------------------------------
# cuDNN runs a 3-output-channel conv at about 18 TFLOP/s (its tiles are built for wide outputs), 4x longer than
# reading its input. Here one GEMM per input frame gives every pixel its 27 taps x O per-tap products in float32
# (27*O planes of the frame, ``stream_conv3d``), and this kernel sums the 9 spatial taps of each plane where an
# output pixel reads them. A frame's planes feed three output frames (temporal taps 0, 1, 2): the sums of taps 0 and 1
# wait in a small float32 state (2 x O planes) for the frames that need them, so each frame's GEMM runs once, across
# temporal chunks too, and the conv never needs its input frames extended in time.
@triton.jit
def _stream_taps_kernel(P, STATE, NEW, B, Y, HW, PHW, Q0, R0, NROWS, WIDTH, HEIGHT, O, FIRST: tl.constexpr,
                        KEEP: tl.constexpr, HAS_B: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    # output rows R0 .. R0 + NROWS of the frame, a tile of (BR rows, BC columns) and one output channel a program:
    # every load is a run of a plane's row (a tile of pixels with the outputs side by side loaded at half the rate);
    # P holds the planes of the frame's rows from Q0 on (PHW values a plane)
    r = R0 + tl.program_id(0) * BR + tl.arange(0, BR)[:, None]
    c = tl.program_id(1) * BC + tl.arange(0, BC)[None, :]
    o = tl.program_id(2)
    inside = (r < R0 + NROWS) & (c < WIDTH)
    g0 = tl.zeros([BR, BC], tl.float32)     # temporal tap 0: this frame as the oldest of an output's three
    g1 = tl.zeros([BR, BC], tl.float32)
    g2 = tl.zeros([BR, BC], tl.float32)     # tap 2: this frame as the newest (the output of this frame)
    for i in tl.static_range(3):
        rr = r + i - 1
        for j in tl.static_range(3):
            cc = c + j - 1
            m = inside & (rr >= 0) & (rr < HEIGHT) & (cc >= 0) & (cc < WIDTH)
            src = (rr - Q0).to(tl.int64) * WIDTH + cc
            k = ((i * 3 + j) * O + o).to(tl.int64)
            g0 += tl.load(P + k * PHW + src, mask=m, other=0.0)
            g1 += tl.load(P + (9 * O + k) * PHW + src, mask=m, other=0.0)
            g2 += tl.load(P + (18 * O + k) * PHW + src, mask=m, other=0.0)
    p = r.to(tl.int64) * WIDTH + c
    at = o * HW + p
    if FIRST:          # the clip's first frame stands for the two replicated frames before it as well
        s0 = g0 + g1
        s1 = g0
    else:              # s0: taps 0 and 1 of the two frames before; s1: tap 0 of the frame before
        s0 = tl.load(STATE + at, mask=inside, other=0.0)
        s1 = tl.load(STATE + O * HW + at, mask=inside, other=0.0)
    y = s0 + g2
    if HAS_B:
        y += tl.load(B + o).to(tl.float32)
    tl.store(Y + p * O + o, y.to(Y.dtype.element_ty), mask=inside)
    if KEEP:
        tl.store(NEW + at, s1 + g1, mask=inside)
        tl.store(NEW + O * HW + at, g0, mask=inside)


def stream_taps(planes, state, new, bias, y, height, width, first_row=0, rows=(0, None)):
    """Output rows ``rows`` = (r0, r1) of one input frame of a causal 3 x 3 x 3 conv with zero padding 1
    (``stream_conv3d``). ``planes`` (27*O, n*W) float32: the per-tap products of the frame's rows ``first_row`` ..
    (those rows read: r0 - 1 .. r1, where inside the frame); plane (a*9 + i*3 + j)*O + o holds temporal tap a,
    kernel row i, column j, output o. ``state`` (2, O, H*W) float32 from the frame before, or None at the clip's first
    frame (which the causal conv replicates twice in front of it). Writes the output rows (the taps of this and the two
    frames before, plus ``bias``, rounded once) into ``y`` ((H, W, O) dense: the frame of a channels-last output), and
    the next frame's state into ``new`` (None: not kept)."""
    o = planes.shape[0] // 27
    r0, r1 = rows[0], height if rows[1] is None else rows[1]
    # tiles of 1024 pixels, 2 x 512 at 720p (0.17 ms a 720p frame on an H100; a [pixels, outputs] tile: 0.35)
    bc = min(512, triton.next_power_of_2(width))
    br = max(1, 1024 // bc)
    grid = (triton.cdiv(r1 - r0, br), triton.cdiv(width, bc), o)
    _stream_taps_kernel[grid](planes, planes if state is None else state, planes if new is None else new,
                              planes if bias is None else bias, y, height * width, planes.shape[1], first_row, r0,
                              r1 - r0, width, height, o, FIRST=state is None, KEEP=new is not None,
                              HAS_B=bias is not None, BR=br, BC=bc, num_warps=4)


@triton.jit
def _norm_planes_kernel(X, MEAN, RSTD, W, BIAS, TT, P, NPIX, C, CG, G, T, BT, NK, SILU: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # the planes of NPIX pixels (rows of X) of frame BT (b * T + t) of a conv's input GroupNorm(x) [+ SiLU], the
    # norm applied to x as it is loaded (rounded as ``_gn_cl_apply_kernel`` rounds it): P[k, pixel] = sum over
    # channels of TT[c, k] * norm(x)[pixel, c], float32
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < NPIX
    ks = tl.arange(0, BN)
    b = BT // T
    t = BT % T
    acc = tl.zeros([BM, BN], tl.float32)
    for c0 in range(0, C, BK):
        cols = c0 + tl.arange(0, BK)
        cmask = cols < C
        stat = (b * G + cols // CG) * T + t
        a = tl.load(RSTD + stat, mask=cmask, other=0.0) * tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        sh = tl.load(BIAS + cols, mask=cmask, other=0.0).to(tl.float32) - tl.load(MEAN + stat, mask=cmask,
                                                                                   other=0.0) * a
        x = tl.load(X + rows.to(tl.int64)[:, None] * C + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                    other=0.0).to(tl.float32)
        y = (x * a[None, :] + sh[None, :]).to(X.dtype.element_ty)
        if SILU:
            yf = y.to(tl.float32)
            y = (yf / (1.0 + tl.exp(-yf))).to(X.dtype.element_ty)
        acc = tl.dot(y, tl.load(TT + cols[:, None] * BN + ks[None, :], mask=cmask[:, None], other=0.0), acc)
    tl.store(P + ks[None, :].to(tl.int64) * NPIX + rows[:, None], acc, mask=rmask[:, None] & (ks[None, :] < NK))


def padded_taps(taps):
    """``norm_planes``' form of a conv's taps (K, C): transposed to (C, K) and zero-padded to a power of two >= 16."""
    k, c = taps.shape
    out = taps.new_zeros((c, max(16, triton.next_power_of_2(k))))
    out[:, :k] = taps.t()
    return out


def norm_planes(x_frame, mean, rstd, weight, bias, taps_t, nk, bt, t, groups, silu):
    """The per-tap planes (nk, pixels) float32 of GroupNorm(x) [+ SiLU] for the pixels of ``x_frame`` (a run of dense
    (pixels, C) rows of frame ``bt`` = b * T + t of a channels-last x, whose statistics are ``group_norm_stats_cl``'s
    ``mean``, ``rstd``) against the taps ``taps_t`` (``padded_taps``, x's dtype): ``stream_conv3d``'s GEMM with the
    norm that feeds it applied as its input is loaded, so no normalised copy of x is written (H100, a 720p frame of
    128 channels: 0.30 ms, against 0.21 for cuBLAS's GEMM after the norm's own pass of 0.25)."""
    npix, c = x_frame.shape
    out = torch.empty((nk, npix), device=x_frame.device, dtype=torch.float32)
    bk = max(16, min(64, triton.next_power_of_2(c)))      # tl.dot takes K >= 16
    grid = (triton.cdiv(npix, 64),)
    _norm_planes_kernel[grid](x_frame, mean, rstd, weight, bias, taps_t, out, npix, c, c // groups, groups, t, bt, nk,
                              SILU=silu, BM=64, BN=taps_t.shape[1], BK=bk, num_warps=4, num_stages=2)
    return out
