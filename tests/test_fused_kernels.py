"""CPU checks of the fused Triton kernels through the Triton interpreter (TRITON_INTERPRET=1), against the
torch references, on tiny shapes; and the dispatch rules. Each kernel check runs in a subprocess so that
the interpreter flag is set before Triton is imported. Skips the kernel checks when Triton is absent."""
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from seedvr2bw.optimization import fused
from seedvr2bw.optimization.fused import reference
from seedvr2bw.optimization.runtime import knobs

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None

_PRELUDE = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, {root!r})
    from pack_import import import_pack
    import_pack()
    import torch
    from seedvr2bw.optimization.fused import kernels as k, reference as ref, vae_kernels as vk
    g = torch.Generator().manual_seed(0)
    def rnd(*s, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(dtype)
    def rel(a, b):
        a, b = a.double(), b.double()
        return float((a - b).norm() / b.norm())
""")


def _run(body: str):
    code = _PRELUDE.format(root=str(ROOT)) + textwrap.dedent(body)
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")


@needs_triton
def test_norm_modulate_kernels_interpreted():
    out = _run("""
        n, d = 7, 80
        x, o = rnd(n, d), rnd(n, d)
        sc, sh, gt = rnd(2, d, dtype=torch.float32), rnd(2, d, dtype=torch.float32), rnd(2, d, dtype=torch.float32)
        sid = torch.tensor([0, 0, 1, 1, 1, 0, 1], dtype=torch.int32)
        y = k.norm_modulate(x, sc, sh, 1e-5, sid)[1]
        assert rel(y, ref.norm_modulate(x, sc, sh, 1e-5, sid)) < 8e-3
        y1 = k.norm_modulate(x, sc[:1], sh[:1], 1e-5)[1]
        assert rel(y1, ref.norm_modulate(x, sc[:1], sh[:1], 1e-5)) < 8e-3
        xr, y = k.norm_modulate(x, sc, sh, 1e-5, sid, res_o=o, res_g=gt)
        xr2, y2 = ref.residual_norm_modulate(x, o, gt, sc, sh, 1e-5, sid)
        assert rel(xr, xr2) < 8e-3 and rel(y, y2) < 8e-3
        assert rel(k.gated_residual(x, o, gt, sid), ref.gated_residual(x, o, gt, sid)) < 8e-3
        assert rel(k.silu_mul(x, o), ref.silu_mul(x, o)) < 8e-3
        print("ok")
    """)
    assert "ok" in out


@needs_triton
def test_group_norm_frames_kernel_interpreted():
    # 99 values per plane in blocks of 32 (a 3-value tail), 3 groups of 2 channels, 3 frames, 2 samples; the
    # offset mean checks that the pairwise combination does not cancel
    out = _run("""
        # fp32: x - mean keeps ~1e-5 of 40 +- 0.5. bf16: mean and rstd are rounded to bf16 as torch's CUDA kernel
        # does (the CPU reference does not), so a mean near 0 keeps that rounding below the tolerance
        for dt, tol, mean in ((torch.float32, 2e-5, 40.0), (torch.bfloat16, 8e-3, 0.1)):
            x = (rnd(2, 6, 3, 9, 11, dtype=torch.float32) * 0.5 + mean).to(dt)
            w, b = rnd(6, dtype=dt) + 1, rnd(6, dtype=dt)
            for silu in (False, True):
                got = vk.group_norm_frames(x, 3, w, b, 1e-6, silu=silu, block=32)
                want = ref.group_norm_frames(x, 3, w, b, 1e-6, silu=silu)
                assert got.shape == x.shape and got.dtype == dt
                assert rel(got, want) < tol, (dt, silu, rel(got, want))
        # one frame's statistics must not leak into another's: a frame scaled by 1000 normalises the same
        x = rnd(1, 4, 2, 5, 7, dtype=torch.float32)
        x2 = x.clone()
        x2[:, :, 1] *= 1000
        w, b = torch.ones(4), torch.zeros(4)
        a = vk.group_norm_frames(x, 2, w, b, 0.0, block=16)
        c = vk.group_norm_frames(x2, 2, w, b, 0.0, block=16)
        assert rel(a, c) < 1e-5
        print("ok")
    """)
    assert "ok" in out


@needs_triton
def test_group_norm_frames_channels_last_kernel_interpreted():
    # channels-last 3-D input and output; 6 channels in 3 groups (a group narrower than its power-of-2 tile),
    # 99 rows per frame in blocks of 16 (a 3-row tail), 3 frames, 2 samples; fp32 equals the NCDHW kernel's
    out = _run("""
        cl = torch.channels_last_3d
        for dt, tol, mean in ((torch.float32, 2e-5, 40.0), (torch.bfloat16, 8e-3, 0.1)):
            x = (rnd(2, 6, 3, 9, 11, dtype=torch.float32) * 0.5 + mean).to(dt).contiguous(memory_format=cl)
            w, b = rnd(6, dtype=dt) + 1, rnd(6, dtype=dt)
            for silu in (False, True):
                got = vk.group_norm_frames_cl(x, 3, w, b, 1e-6, silu=silu, block_rows=16)
                want = ref.group_norm_frames(x.contiguous(), 3, w, b, 1e-6, silu=silu)
                assert got.shape == x.shape and got.dtype == dt and got.is_contiguous(memory_format=cl)
                assert rel(got, want) < tol, (dt, silu, rel(got, want))
                if dt == torch.float32:
                    same = vk.group_norm_frames(x.contiguous(), 3, w, b, 1e-6, silu=silu, block=32)
                    assert rel(got, same) < tol
        x = rnd(1, 4, 2, 5, 7, dtype=torch.float32)
        x2 = x.clone()
        x2[:, :, 1] *= 1000
        w, b = torch.ones(4), torch.zeros(4)
        a = vk.group_norm_frames_cl(x.contiguous(memory_format=cl), 2, w, b, 0.0, block_rows=16)
        c = vk.group_norm_frames_cl(x2.contiguous(memory_format=cl), 2, w, b, 0.0, block_rows=16)
        assert rel(a, c) < 1e-5
        # the default program count (no block_rows), 3 frames of 99 pixels: the same numbers as blocks of 16
        x = (rnd(1, 8, 3, 9, 11, dtype=torch.float32) + 1).contiguous(memory_format=cl)
        w, b = torch.ones(8), torch.zeros(8)
        assert rel(vk.group_norm_frames_cl(x, 4, w, b, 1e-6),
                   vk.group_norm_frames_cl(x, 4, w, b, 1e-6, block_rows=16)) < 2e-5
        # into a causal conv's input: the body of a buffer with 2 frames in front and a halo row above and below;
        # the same pass writes the first frame into those 2 (head) and the last 2 frames into a tensor kept for
        # the next chunk, exactly what fused.fill_edges writes after the body
        from seedvr2bw.optimization import fused
        y = vk.group_norm_frames_cl(x, 4, w, b, 1e-6, silu=True)
        for head, keep_n in ((2, 2), (0, 1), (2, 0)):
            buf = torch.full((1, 8, 5, 11, 11), float("nan")).contiguous(memory_format=cl)
            body = buf[:, :, 2:, 1:10]
            keep = torch.full((1, 8, keep_n, 9, 11), float("nan")).contiguous(memory_format=cl) if keep_n else None
            vk.group_norm_frames_cl(x, 4, w, b, 1e-6, silu=True, out=body, head=head, keep=keep)
            want = torch.full_like(buf, float("nan"))
            want[:, :, 2:, 1:10] = y
            fused.fill_edges(want[:, :, 2:, 1:10], head, None)
            assert torch.equal(buf.nan_to_num(7.0), want.nan_to_num(7.0)), (head, keep_n)
            if keep_n:
                assert torch.equal(keep, y[:, :, 3 - keep_n:]), (head, keep_n)
        print("ok")
    """)
    assert "ok" in out


@needs_triton
def test_residual_with_moments_interpreted():
    # the residual pass also takes the sum's GroupNorm moments (2 samples, 3 frames of 99 pixels, 6 channels, x's own
    # bias or not): the sum bit-equal to the plain pass, the norm from those moments the norm's own; through
    # fused.residual_bias the next fused.group_norm_frames of the sum uses them, unless the sum changed since
    out = _run("""
        import torch.nn as nn
        from seedvr2bw.optimization import fused
        cl = torch.channels_last_3d
        for dt, tol in ((torch.float32, 2e-5), (torch.bfloat16, 8e-3)):
            h, x = (rnd(2, 6, 3, 9, 11, dtype=dt, scale=3.0).contiguous(memory_format=cl) for _ in range(2))
            bias, xb = rnd(6, dtype=dt), rnd(6, dtype=torch.float32)
            w, b = rnd(6, dtype=dt) + 1, rnd(6, dtype=dt)
            for x_bias in (None, xb):
                plain = vk.residual_bias_cl(h.clone(), x, bias, x_bias)
                y, m = vk.residual_bias_cl(h.clone(), x, bias, x_bias, moments=True)
                assert torch.equal(y, plain), dt
                got = vk.group_norm_frames_cl(y, 3, w, b, 1e-6, silu=True, moments=m)
                want = vk.group_norm_frames_cl(y, 3, w, b, 1e-6, silu=True)
                assert rel(got, want) < tol, (dt, rel(got, want))
            norm = nn.GroupNorm(3, 6, eps=1e-6).to(dt)
            with torch.no_grad():
                norm.weight.copy_(w); norm.bias.copy_(b)
            fused.enabled = lambda *t: True
            y = fused.residual_bias(h.clone(), x, bias)
            want = ref.group_norm_frames(y.contiguous(), 3, w, b, 1e-6)
            assert rel(fused.group_norm_frames(y, norm, False), want) < tol
            y.mul_(4.0)                                 # written since: its moments are taken again
            want = ref.group_norm_frames(y.contiguous(), 3, w, b, 1e-6)
            assert rel(fused.group_norm_frames(y, norm, False), want) < tol
        print("ok")
    """)
    assert "ok" in out


@needs_triton
def test_group_norm_channels_last_band_statistics_interpreted():
    # a frame's rows in two bands (as a row split runs them): each band's kernel, with the other band's statistics
    # merged in through ``combine``, gives that band of the whole frame's GroupNorm (float32; 12 channels in 4
    # groups, bands of 5 and 4 rows of 13 pixels, program blocks of 16 pixels with tails)
    out = _run("""
        cl = torch.channels_last_3d
        x = (rnd(2, 12, 3, 9, 13, dtype=torch.float32) * 0.7 + 2).contiguous(memory_format=cl)
        w, b = rnd(12, dtype=torch.float32) + 1, rnd(12, dtype=torch.float32)
        want = ref.group_norm_frames(x.contiguous(), 4, w, b, 1e-6, silu=True)
        bands = [x[:, :, :, :5].contiguous(memory_format=cl), x[:, :, :, 5:].contiguous(memory_format=cl)]
        local = []
        def own(stats, n):
            local.append((stats, n))
            return stats[:, None], torch.tensor([float(n)])
        for band in bands:
            vk.group_norm_frames_cl(band, 4, w, b, 1e-6, silu=True, block_rows=16, combine=own)
        def both(stats, n):
            return torch.stack([s for s, _ in local], dim=1), torch.tensor([float(m) for _, m in local])
        got = [vk.group_norm_frames_cl(band, 4, w, b, 1e-6, silu=True, block_rows=16, combine=both) for band in bands]
        assert rel(torch.cat(got, dim=3), want) < 2e-5, rel(torch.cat(got, dim=3), want)
        print("ok")
    """)
    assert "ok" in out


@needs_triton
def test_conv_bias_folding_kernels_interpreted():
    # a conv's bias left to what reads its output gives the same bits as adding it in a pass of its own: the
    # channels-last GroupNorm of x with in_bias equals it of x + bias (rounded to x's dtype), 6 channels in 3 groups
    # with a 3-row tail; the one-pass residual equals h.add_(bias).add_(x) (5 channels: a narrower tile). In float32
    # and float16: the interpreter rounds to bfloat16 by truncation where GPUs and torch round to nearest even.
    out = _run("""
        cl = torch.channels_last_3d
        for dt in (torch.float32, torch.float16):
            x = (rnd(2, 6, 3, 9, 11, dtype=torch.float32) * 0.5 + 3).to(dt).contiguous(memory_format=cl)
            w, b, ib = rnd(6, dtype=dt) + 1, rnd(6, dtype=dt), rnd(6, dtype=dt) * 4
            xb = (x + ib.view(1, -1, 1, 1, 1)).contiguous(memory_format=cl)
            for silu in (False, True):
                got = vk.group_norm_frames_cl(x, 3, w, b, 1e-6, silu=silu, block_rows=16, in_bias=ib)
                assert torch.equal(got, vk.group_norm_frames_cl(xb, 3, w, b, 1e-6, silu=silu, block_rows=16)), (dt, silu)
                if dt == torch.float32:
                    assert rel(got, ref.group_norm_frames(xb.contiguous(), 3, w, b, 1e-6, silu=silu)) < 2e-5
            h = rnd(1, 5, 2, 7, 3, dtype=dt).contiguous(memory_format=cl)
            r = rnd(1, 5, 2, 7, 3, dtype=dt).contiguous(memory_format=cl)
            bias, r_bias = rnd(5, dtype=dt) * 3, rnd(5, dtype=dt) * 3
            # r's own conv bias left out of it too: (h + bias) + (r + r_bias)
            want_rb = (h + bias.view(1, -1, 1, 1, 1)) + (r + r_bias.view(1, -1, 1, 1, 1))
            assert torch.equal(vk.residual_bias_cl(h.clone(), r, bias, r_bias), want_rb), dt
            want = h.clone().add_(bias.view(1, -1, 1, 1, 1)).add_(r)
            # into the body of a downsampling conv's buffer: a prepended frame, a zero row below, a column right
            buf = torch.full((1, 5, 3, 8, 4), float("nan"), dtype=dt).contiguous(memory_format=cl)
            got = vk.residual_bias_cl(h.clone(), r, bias, out=buf[:, :, 1:, :7, :3])
            assert torch.equal(got, want) and torch.isnan(buf[:, :, 0]).all(), dt
            assert torch.isnan(buf[:, :, :, 7]).all() and torch.isnan(buf[..., 3]).all(), dt
            got = vk.residual_bias_cl(h, r, bias)
            assert got.data_ptr() == h.data_ptr() and torch.equal(got, want), dt
            # a conv's bias added after it (cuDNN on NDHWC): torch's broadcast add, 5 and 300 channels (a tail)
            for c in (5, 300):
                y = rnd(1, c, 2, 3, 5, dtype=dt).contiguous(memory_format=cl)
                bb = rnd(c, dtype=dt) * 3
                want_y = y + bb.view(1, -1, 1, 1, 1)
                assert torch.equal(vk.bias_add_cl(y, bb), want_y) and torch.equal(y, want_y), (dt, c)
        print("ok")
    """)
    assert "ok" in out


@needs_triton
def test_depth_to_space_kernel_interpreted():
    # the upsampler's depth-to-space with its 1 x 1 conv's bias (and without) equals torch's add then strided copy,
    # bit for bit (float32, float16: see above), into a window of a larger buffer (2 prepended frames, a halo row
    # above and below), spatial x2 with and without x2 in time, the first chunk's duplicate frame dropped or not; 12
    # output channels in tiles of 8 (a channel tail).
    out = _run("""
        from seedvr2bw.optimization import fused
        cl = torch.channels_last_3d
        for dt in (torch.float32, torch.float16):
            for rt, drop in ((1, False), (2, False), (2, True)):
                c, t, h, w = 12, 3, 5, 4
                y = rnd(1, 4 * rt * c, t, h, w, dtype=dt).contiguous(memory_format=cl)
                bias = rnd(4 * rt * c, dtype=dt) * 3
                tout = t * rt - int(drop)
                buf = torch.full((1, c, tout + 2, 2 * h + 2, 2 * w), float("nan"), dtype=dt).contiguous(memory_format=cl)
                body = buf[:, :, 2:, 1:1 + 2 * h]
                for bb in (bias, None):
                    want = body.clone()
                    fused.enabled = lambda *t: False            # the torch path
                    fused.depth_to_space(y, bb, want, 2, rt, drop)
                    vk.depth_to_space_cl(y, bb, body, 2, rt, drop)
                    assert torch.equal(body, want), (dt, rt, drop, bb is None)
                assert torch.isnan(buf[:, :, :2]).all() and torch.isnan(buf[:, :, :, 0]).all()
                # with the conv input's other copies: the first frame in front (head 2), the last 2 kept
                keep = torch.full((1, c, 2, 2 * h, 2 * w), float("nan"), dtype=dt).contiguous(memory_format=cl)
                vk.depth_to_space_cl(y, bias, body, 2, rt, drop, 2, keep)
                assert torch.equal(buf[:, :, :2, 1:1 + 2 * h], body[:, :, :1].expand(-1, -1, 2, -1, -1)), (dt, rt)
                assert torch.equal(keep, body[:, :, -2:]) and torch.isnan(buf[:, :, :, 0]).all(), (dt, rt, drop)
        print("ok")
    """)
    assert "ok" in out


@needs_triton
def test_gemm_epilogue_kernels_interpreted():
    # the upsampler's 1 x 1 conv with its depth-to-space as the GEMM's epilogue (gemm_kernels.conv1x1_d2s) equals the
    # float32 conv then torch's depth-to-space, rounded once (float16: the interpreter's dot misreads bfloat16), into
    # a window of a larger buffer, x2 in space with and without x2 in time, the first chunk's duplicate dropped or
    # not, with the conv input's other copies (head, keep); 8 x 7 = 56 pixels a frame in blocks of 16 (a masked
    # tail), 2 samples, 2 output blocks a position. And the ResNet shortcut with the residual add as the epilogue
    # (gemm_kernels.shortcut_residual): h + bias + (W x + x_bias), its moments those the GroupNorm takes of the sum.
    out = _run("""
        import torch.nn.functional as F
        from seedvr2bw.optimization import fused
        from seedvr2bw.optimization.fused import gemm_kernels as gk
        cl = torch.channels_last_3d
        dt = torch.float16
        tile = (16, 16, 16, 4, 1)
        assert gk.fits(32, 32, tile) and not gk.fits(32, 24, tile) and not gk.fits(24, 32, tile)
        cin, c, t, h, w = 32, 32, 3, 8, 7
        x = rnd(2, cin, t, h, w, dtype=dt).contiguous(memory_format=cl)
        for rt, drop in ((1, False), (2, False), (2, True)):
            n = 4 * rt * c
            wt, bias = rnd(n, cin, dtype=dt, scale=cin ** -0.5), rnd(n, dtype=dt)
            y = F.conv3d(x.float(), wt.float().view(n, cin, 1, 1, 1), bias.float())
            tout = t * rt - int(drop)
            want = torch.empty(2, c, tout, 2 * h, 2 * w, dtype=torch.float32).contiguous(memory_format=cl)
            fused.enabled = lambda *t: False            # the torch path
            fused.depth_to_space(y.contiguous(memory_format=cl), None, want, 2, rt, drop)
            buf = torch.full((2, c, tout + 2, 2 * h + 2, 2 * w), float("nan"), dtype=dt).contiguous(memory_format=cl)
            body = buf[:, :, 2:, 1:1 + 2 * h]
            keep = torch.full((2, c, 2, 2 * h, 2 * w), float("nan"), dtype=dt).contiguous(memory_format=cl)
            gk.conv1x1_d2s(x, wt, bias, body, 2, rt, drop, 2, keep, tile=tile)
            assert rel(body, want) < 1e-3, (rt, drop, rel(body, want))
            assert torch.equal(buf[:, :, :2, 1:1 + 2 * h], body[:, :, :1].expand(-1, -1, 2, -1, -1)), (rt, drop)
            assert torch.equal(keep, body[:, :, -2:]) and torch.isnan(buf[:, :, :, 0]).all(), (rt, drop)
        hh = rnd(2, c, t, h, w, dtype=dt).contiguous(memory_format=cl)
        ws, xb, b = rnd(c, cin, dtype=dt, scale=cin ** -0.5), rnd(c, dtype=torch.float32), rnd(c, dtype=dt)
        want = hh.float() + b.float().view(1, -1, 1, 1, 1) + F.conv3d(x.float(), ws.float().view(c, cin, 1, 1, 1), xb)
        gw, gb = rnd(c, dtype=dt) + 1, rnd(c, dtype=dt)
        got, moments = gk.shortcut_residual(hh.clone(), x, ws, xb, b, tile=tile)
        assert got.is_contiguous(memory_format=cl) and rel(got, want) < 1e-3, rel(got, want)
        a = vk.group_norm_frames_cl(got, 4, gw, gb, 1e-6, moments=moments)
        assert rel(a, vk.group_norm_frames_cl(got, 4, gw, gb, 1e-6)) < 1e-3
        print("ok")
    """)
    assert "ok" in out


@needs_triton
def test_streamed_conv_interpreted():
    # the decoder's conv_out (3 outputs; also 4) as a GEMM per frame and the tap-sum kernel, in temporal chunks that
    # pass the state on, with bands of rows (planes of 1.5 rows and of whole frames), two samples, with and without a
    # bias: the causal conv of the whole clip (first frame replicated twice in front). float32: the order of the sums
    # only; bfloat16: rounded once (the interpreter truncates where a GPU rounds to nearest: within 3 x rounding).
    out = _run("""
        import math
        import torch.nn.functional as F
        from seedvr2bw.optimization import fused
        cl = torch.channels_last_3d
        for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, None)):
            for o in (3, 4):
                x = rnd(2, 8, 6, 7, 5, dtype=dt)
                w, b = rnd(o, 8, 3, 3, 3, dtype=dt, scale=0.2), rnd(o, dtype=dt)
                xe = torch.cat([x[:, :, :1], x[:, :, :1], x], 2).float()
                for bias in (b, None):
                    want = F.conv3d(xe, w.float(), None if bias is None else bias.float(), padding=(0, 1, 1))
                    floor = rel(want.to(dt), want)
                    xc = x.contiguous(memory_format=cl)
                    for mb in (math.inf, 27 * o * 4 * 5 * 3.5, 1.0):
                        y1, s = fused.stream_conv3d(xc[:, :, :3], w, bias, None, True, mb)
                        y2, s = fused.stream_conv3d(xc[:, :, 3:4], w, bias, s, True, mb)
                        y3, s = fused.stream_conv3d(xc[:, :, 4:], w, bias, s, False, mb)
                        y = torch.cat([y1, y2, y3], 2)
                        assert s is None and y1.is_contiguous(memory_format=cl) and y.dtype == dt
                        assert rel(y, want) <= (tol or 3 * floor), (dt, o, bias is None, mb, rel(y, want), floor)
        print("ok")
    """)
    assert "ok" in out


@needs_triton
def test_norm_planes_interpreted():
    # the streamed conv's GEMM with its input's GroupNorm + SiLU applied as it loads x (stream_kernels.norm_planes):
    # float16 (the interpreter's dot misreads bfloat16), two samples, 3 frames, 12 channels in 3 groups (a K tile of
    # 16 with a masked tail): the planes of the normalised frames the GroupNorm kernels write (the same rounding),
    # within float32 sums
    out = _run("""
        from seedvr2bw.optimization import fused
        from seedvr2bw.optimization.fused import stream_kernels as sk
        cl = torch.channels_last_3d
        dt = torch.float16
        x = (rnd(2, 12, 3, 5, 7, dtype=torch.float32) * 2 + 0.5).to(dt).contiguous(memory_format=cl)
        norm = torch.nn.GroupNorm(3, 12, eps=1e-6).to(dt)
        with torch.no_grad():
            norm.weight.copy_(rnd(12, dtype=dt) + 1)
            norm.bias.copy_(rnd(12, dtype=dt))
        w = rnd(3, 12, 3, 3, 3, dtype=dt, scale=0.2)
        taps = w.permute(2, 3, 4, 0, 1).reshape(81, 12)
        mean, rstd = vk.group_norm_stats_cl(x, 3, 1e-6)
        y = vk.group_norm_frames_cl(x, 3, norm.weight, norm.bias, 1e-6, silu=True)
        rows = x.permute(0, 2, 3, 4, 1)
        for b in range(2):
            for t in range(3):
                got = sk.norm_planes(rows[b, t].reshape(35, 12), mean, rstd, norm.weight, norm.bias,
                                     sk.padded_taps(taps), 81, b * 3 + t, 3, 3, silu=True)
                want = taps.float() @ y.permute(0, 2, 3, 4, 1)[b, t].reshape(35, 12).float().t()
                assert rel(got, want) < 1e-6, (b, t, rel(got, want))
        # and the whole streamed conv with the norm, against the norm written out then the streamed conv
        ya, sa = fused.stream_conv3d(x, w, None, norm=norm)
        yb, sb = fused.stream_conv3d(y, w, None)
        assert rel(ya, yb) < 1e-3 and all(rel(p, q) < 1e-6 for p, q in zip(sa, sb)), rel(ya, yb)
        print("ok")
    """)
    assert "ok" in out


@needs_triton
def test_streamed_conv_in_the_model_interpreted():
    # CausalConv3d.streams: conv_out (3 outputs) through norm_silu_conv in temporal chunks (TemporalCache) equals the
    # cuDNN-shaped path (its extended input buffer); a conv to 8 channels, the knob off, or NCDHW input do not stream
    out = _run("""
        from seedvr2bw.optimization import fused
        from seedvr2bw.optimization.runtime import knobs
        from seedvr2bw.models.seedvr2.vae.causal_conv import CausalConv3d, TemporalCache
        from seedvr2bw.models.seedvr2.vae.norm import norm_silu_conv
        torch.manual_seed(0)
        conv, wide = CausalConv3d(8, 3, 3, padding=1), CausalConv3d(8, 8, 3, padding=1)
        norm = torch.nn.GroupNorm(4, 8, eps=1e-6)
        x = torch.randn(1, 8, 7, 6, 5).contiguous(memory_format=torch.channels_last_3d)
        fused.enabled = lambda *t: True
        got = {}
        with torch.no_grad():
            for on in (True, False):
                with knobs.override(VAE_STREAM_CONV=on):
                    assert conv.streams(x) == on and not wide.streams(x) and not conv.streams(x.contiguous())
                    cache, parts = TemporalCache(), []
                    for a, b in ((0, 3), (3, 5), (5, 7)):
                        cache.next_chunk(last=b == 7) if a else None
                        parts.append(norm_silu_conv(x[:, :, a:b], norm, conv, cache))
                    got[on] = torch.cat(parts, 2)
        assert rel(got[True], got[False]) < 1e-5, rel(got[True], got[False])
        print("ok")
    """)
    assert "ok" in out


@needs_triton
def test_split_softmax_attention_interpreted():
    # the VAE mid block's one head of 512 (here 64, 40 queries and 300 keys, in query blocks of 16 and a tail): the
    # split numerator's parts sum to exp(scale * (s - max)) to about 16 bits, and the attention is the float64
    # result rounded to bf16, closer to it than a flash-style pass that rounds the probabilities once (emulated)
    out = _run("""
        from seedvr2bw.optimization.attention.wide_head import gemm_attention
        s = rnd(7, 300, dtype=torch.float32, scale=5.0)
        hl, l = vk.softmax_split(s, 0.25, torch.bfloat16)
        e = torch.exp((s - s.amax(1, keepdim=True)) * 0.25)
        assert rel(hl[:, :300].float() + hl[:, 300:].float(), e) < 2e-5 and rel(l, e.sum(1)) < 1e-6
        assert torch.equal(hl[:, :300], e.to(torch.bfloat16))
        q, kk, v = rnd(2, 40, 64, scale=3.0), rnd(2, 300, 64), rnd(2, 300, 64)
        want = torch.softmax(q.double() @ kk.double().transpose(1, 2) / 8, -1) @ v.double()
        got = gemm_attention(q, kk, v, chunk_bytes=16 * 300 * 8)
        floor = rel(want.to(torch.bfloat16), want)
        p = torch.softmax(q.float() @ kk.float().transpose(1, 2) / 8, -1)
        once = (p.to(torch.bfloat16).float() @ v.float()).to(torch.bfloat16)
        assert got.dtype == torch.bfloat16 and rel(got, want) <= 1.05 * floor < rel(once, want), (rel(got, want), floor)
        print("ok")
    """)
    assert "ok" in out


@needs_triton
def test_resnet_block_with_folded_biases_interpreted():
    # the VAE's ResNet block on the fused channels-last path with its conv biases folded (SEEDVR2BW_VAE_FOLD_BIASES:
    # conv1's into norm2's kernels, conv2's into the residual kernel), with and without a shortcut conv, large
    # biases: within bf16 rounding of the float32 torch path, as without folding (the bits are compared on a GPU:
    # a CPU convolution adds its bias before rounding, torch's cuDNN path after, as the folded kernels do)
    out = _run("""
        from seedvr2bw.optimization import fused
        from seedvr2bw.optimization.runtime import knobs
        from seedvr2bw.models.seedvr2.vae.norm import fold_biases
        from seedvr2bw.models.seedvr2.vae.resnet import ResnetBlock3D
        torch.manual_seed(0)
        for cin, cout in ((8, 8), (8, 12)):
            blk = ResnetBlock3D(cin, cout, groups=4, eps=1e-6)
            with torch.no_grad():
                for conv in (blk.conv1, blk.conv2):
                    conv.bias.normal_(0, 2.0)
            x = torch.randn(1, cin, 3, 6, 5)
            xbias = (torch.randn(cin) * 2).bfloat16()     # x's own conv bias, left out of x (an upsampler's)
            with torch.no_grad():
                want = blk(x.clone())
                want_b = blk(x + xbias.float().view(1, -1, 1, 1, 1))
                fused.enabled = lambda *t: True
                bf = blk.to(torch.bfloat16)
                xb = x.bfloat16().contiguous(memory_format=torch.channels_last_3d)
                got = {}
                for fold in (False, True):
                    with knobs.override(VAE_FOLD_BIASES=fold):
                        assert fold_biases(xb, bf.conv1, bf.conv2) == fold == bf.takes_input_bias(xb)
                        got[fold] = bf(xb.clone())
                        # without folding the block adds x_bias first; folded, norm1 and the residual (through the
                        # shortcut's weight, where there is one) take it
                        got[fold, "x_bias"] = bf(xb.clone(), x_bias=xbias)
                fused.enabled = lambda *t: False
                blk.float()
            for fold in (False, True):
                assert rel(got[fold], want) < 2e-2 and rel(got[fold, "x_bias"], want_b) < 2e-2, (cin, cout, fold)
        print("ok")
    """)
    assert "ok" in out


@needs_triton
@pytest.mark.parametrize("rope", [True, False])
def test_qkv_pack_kernel_interpreted(rope):
    out = _run(f"""
        h, hd, m = 3, 128, 6
        qkv = rnd(m, 3 * h * hd)
        wq, wk = rnd(hd, scale=0.2) + 1, rnd(hd, scale=0.2) + 1
        ang = torch.rand(m, 30, generator=g) * 6
        cos, sin = (ang.cos(), ang.sin()) if {rope} else (None, None)
        dst = torch.tensor([5, 1, 7, 0, 3, 2])
        outs = [torch.full((9, h, hd), float("nan"), dtype=torch.bfloat16) for _ in range(6)]
        k.qkv_norm_rope_pack(qkv, h, hd, wq, wk, 1e-5, cos, sin, dst, *outs[:3])
        ref.qkv_norm_rope_pack(qkv, h, hd, wq, wk, 1e-5, cos, sin, dst, *outs[3:])
        for a, b in zip(outs[:3], outs[3:]):
            assert rel(a[dst], b[dst]) < 8e-3, rel(a[dst], b[dst])
        # a source index (text copies): rows 0,1 written twice each
        src = torch.tensor([0, 1, 0, 1])
        dst2 = torch.tensor([8, 6, 4, 0])
        outs = [torch.full((9, h, hd), float("nan"), dtype=torch.bfloat16) for _ in range(6)]
        k.qkv_norm_rope_pack(qkv, h, hd, wq, wk, 1e-5, cos, sin, dst2, *outs[:3], src=src)
        ref.qkv_norm_rope_pack(qkv, h, hd, wq, wk, 1e-5, cos, sin, dst2, *outs[3:], src=src)
        for a, b in zip(outs[:3], outs[3:]):
            assert rel(a[dst2], b[dst2]) < 8e-3
        # v2 (grid rows x 3, one (3, N_all, H, D) output)
        for (d_, s_), split in [(a, b) for a in ((dst, None), (dst2, src)) for b in (False, True)]:
            got = torch.full((3, 9, h, hd), float("nan"), dtype=torch.bfloat16)
            want = torch.full((3, 9, h, hd), float("nan"), dtype=torch.bfloat16)
            k.qkv_norm_rope_pack_v2(qkv, h, hd, wq, wk, 1e-5, cos, sin, d_, got, src=s_, split=split)
            ref.qkv_norm_rope_pack(qkv, h, hd, wq, wk, 1e-5, cos, sin, d_, *want, src=s_)
            for a, b in zip(got, want):
                assert rel(a[d_], b[d_]) < 8e-3, rel(a[d_], b[d_])
        print("ok")
    """)
    assert "ok" in out


def test_reference_qk_norm_rope_matches_model_path():
    """The reference's pair rotation equals the model's apply_rope (exact fp32 path) after its qk-norm."""
    from seedvr2bw.models.seedvr2.dit.norm import rms_norm
    from seedvr2bw.models.seedvr2.dit.rope import apply_rope, make_rope_table

    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 2, 128, generator=g, dtype=torch.float64).float()
    w = torch.rand(128, generator=g) + 0.5
    ang = torch.rand(5, 30, generator=g).repeat_interleave(2, -1) * 5
    t = make_rope_table(ang, "cpu")
    want = apply_rope(rms_norm(x, w, 1e-5), t)
    got = reference.qk_norm_rope(x, w, 1e-5, t.cos_pair, t.sin_pair)
    assert torch.allclose(got, want, atol=1e-5)


def test_reference_norm_modulate_matches_model_path():
    from seedvr2bw.models.seedvr2.dit.modulation import modulate_in
    from seedvr2bw.models.seedvr2.dit.norm import rms_norm

    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 16, generator=g)
    e = torch.randn(1, 16, 3, generator=g)
    shift, scale = torch.randn(16, generator=g), torch.randn(16, generator=g)
    want = modulate_in(rms_norm(x, None, 1e-5), e, shift, scale, [9])
    got = reference.norm_modulate(x, e[0, :, 1] + scale, e[0, :, 0] + shift, 1e-5)
    assert torch.allclose(got, want, atol=1e-5)


def test_dispatch_off_on_cpu_and_fp32():
    assert not fused.enabled(torch.zeros(2, 2, dtype=torch.bfloat16))
    assert not fused.enabled(torch.zeros(2, 2))


def test_dispatch_env_switch(monkeypatch):
    monkeypatch.setenv("SEEDVR2BW_FUSED", "0")
    assert not knobs.get("FUSED")
    monkeypatch.setenv("SEEDVR2BW_FUSED", "1")
    assert knobs.get("FUSED")


def test_sample_ids():
    assert fused.sample_ids([5], "cpu") is None
    assert fused.sample_ids([2, 3], "cpu").tolist() == [0, 0, 1, 1, 1]


def test_linear_gelu_matches_gelu_tanh():
    g = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(7, 12, generator=g), torch.randn(20, 12, generator=g), torch.randn(20, generator=g)
    want = torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b), approximate="tanh")
    assert torch.equal(fused.linear_gelu(x, w, b), want)  # CPU: the plain torch expression


def test_block_wrappers_fall_back_exactly():
    """On CPU the fused entry points of the block are bit-identical to the previous torch code."""
    from seedvr2bw.models.seedvr2.dit.modulation import (gated_residual, gated_residual_fused,
                                                          gated_residual_norm_modulate, modulate_in,
                                                          norm_modulate_in)
    from seedvr2bw.models.seedvr2.dit.norm import rms_norm

    g = torch.Generator().manual_seed(6)
    for dt in (torch.float32, torch.bfloat16):
        x, o = torch.randn(10, 16, generator=g).to(dt), torch.randn(10, 16, generator=g).to(dt)
        e = torch.randn(2, 16, 3, generator=g).to(dt)
        sh, sc, gt = (torch.randn(16, generator=g).to(dt) for _ in range(3))
        lens = [4, 6]
        assert torch.equal(norm_modulate_in(x, e, sh, sc, lens, 1e-5), modulate_in(rms_norm(x, None, 1e-5), e, sh, sc, lens))
        r, m = gated_residual_norm_modulate(x, o, e, gt, e, sh, sc, lens, 1e-5)
        r2 = gated_residual(x, o, e, gt, lens)
        assert torch.equal(r, r2)
        assert torch.equal(m, modulate_in(rms_norm(r2, None, 1e-5), e, sh, sc, lens))
        assert torch.equal(gated_residual_fused(x, o, e, gt, lens), r2)


@needs_triton
def test_selftest_passes_interpreted():
    out = _run("""
        from seedvr2bw.optimization import fused
        ok, why = fused.check_kernels(k, vk, torch.device("cpu"), 1e-2)
        assert ok, why
        print("ok", why)
    """)
    assert "ok" in out


@needs_triton
@pytest.mark.parametrize("variant", ["3b", "7b"])
def test_tiny_model_fused_path_interpreted(variant):
    """The whole tiny golden model in bf16 with every fused op forced on (interpreted on CPU) against the
    same model on the torch path: the wiring (packing, RoPE rows, text copies, gates) is right."""
    out = _run(f"""
        import json
        from pathlib import Path
        from safetensors.torch import load_file
        from seedvr2bw.optimization import fused
        from seedvr2bw.models.seedvr2.dit import load_dit
        golden = Path({str(ROOT / "tests" / "data" / "golden")!r})
        man = json.loads((golden / "manifest.json").read_text())["dit"]
        tiny = man["tiny_models"]["{variant}"]
        model = load_dit(golden / tiny["weights_file"], device="cpu", dtype=torch.bfloat16, attention_backend="sdpa")
        inp = load_file(golden / man["cases"]["image"]["inputs_file"])
        T, H, W, C = inp["vid"].shape
        args = (inp["vid"].reshape(-1, C), inp["txt"], inp["vid_shape"], inp["txt_shape"], inp["timestep"])
        with torch.no_grad():
            base = model(*args)
            fused.enabled = lambda *t: True
            got = model(*args)
        err = rel(got, base)
        assert err < 2e-2, err
        print("ok", err)
    """)
    assert "ok" in out
