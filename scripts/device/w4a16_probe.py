"""Device probe: where the fused W4A16 kernel loses time against cuBLAS at large M (H100).

Times, at M = 4096 on SeedVR2 shapes, one swap-AB Triton kernel in several variants against bf16 cuBLAS:
  plain    the same loop on a bf16 weight (no decode: the ceiling of this kernel structure)
  noscale  PTX decode, block scales skipped (the decode's own cost)
  perm     PTX decode + block scales read as one contiguous run per tile (weight rows permuted in the tile so
           the swizzled 128x4 scale layout becomes row-major; the output store un-permutes)
  tile_scales  PTX decode + block scales as a [BLOCK_N, BLOCK_K/16] tile of 4-byte runs (what the kernel does now)
  current  kernels.w4a16_linear (production kernel)
(Commit 57bd339 also had scales gathered per packed byte, as bf16 and as raw bytes decoded in PTX: 2-3x slower.)
Each variant is checked against the dequantized product first (noscale against its own reference).
    python scripts/device/w4a16_probe.py [--m 4096] [--shapes 3072x12288,...]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import _pack  # noqa: E402,F401
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from seedvr2bw.optimization.nvfp4 import format as fmt  # noqa: E402
from seedvr2bw.optimization.nvfp4 import kernels as K  # noqa: E402


@triton.jit
def _probe_kernel(x_ptr, p_ptr, s_ptr, wb_ptr, y_ptr, g, M, N, Kd, NCB4, TILES,
                  BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, V: tl.constexpr,
                  GROUP: tl.constexpr):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    if GROUP > 0:      # grouped order: GROUP weight tiles x all M tiles... (L2 reuse of the weight)
        m_tiles = tl.cdiv(M, BLOCK_M)
        per = GROUP * m_tiles
        grp = pid // per
        first = grp * GROUP
        size = tl.minimum(n_tiles - first, GROUP)
        pid_n = first + (pid % per) % size
        pid_m = (pid % per) // size
    else:
        pid_n = pid % n_tiles
        pid_m = pid // n_tiles
    i = tl.arange(0, BLOCK_N)
    RG: tl.constexpr = BLOCK_N // 32
    n0 = pid_n * BLOCK_N
    if V == 2:
        rn = n0 + (i % RG) * 32 + i // RG          # tile row i <-> weight row n (see the docstring)
    else:
        rn = n0 + i
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn_l = rn % N
    rm_l = rm % M
    rkp = tl.arange(0, BLOCK_K // 2)
    rk = tl.arange(0, BLOCK_K)
    rj = tl.arange(0, BLOCK_K // 16)
    HALF = Kd // 2
    p_base = p_ptr + rn_l[:, None].to(tl.int64) * HALF + rkp[None, :]
    wb_base = wb_ptr + rn_l[:, None].to(tl.int64) * Kd + rk[None, :]
    x_base = x_ptr + rm_l[None, :].to(tl.int64) * Kd + rk[:, None]
    # perm: tile rows i = r32 * RG + rg -> scale byte (r32 * 16 + (rg0 + rg) * 4 + j) of the tile's 512-byte run
    rg0 = (n0 % 128) // 32
    s_loc = (((i % RG) // 4) * NCB4 * 512 + i // RG * 16 + (rg0 + (i % RG) % 4) * 4)[:, None] \
        + (rj % 4)[None, :] + (rj // 4)[None, :] * 512
    s_tile = s_ptr + (n0 // 128).to(tl.int64) * NCB4 * 512
    s_row = ((rn_l // 128) * NCB4 * 512 + (rn_l % 32) * 16 + ((rn_l % 128) // 32) * 4)[:, None]
    s_col = (rj // 4) * 512 + rj % 4
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for t in range(0, TILES):
        k0 = t * BLOCK_K
        xt = tl.load(x_base + k0)
        if V == 0:
            w = tl.load(wb_base + k0)
        else:
            p = tl.load(p_base + k0 // 2)
            if V == 1:
                sb = tl.full((BLOCK_N, BLOCK_K // 2), 1.0, tl.bfloat16)
                hv, lv = K.e2m1_pairs_scaled(p, sb, False)
            elif V == 5:   # scales as a [BLOCK_N, BLOCK_K/16] tile whose offsets are provably 4-byte runs
                sv = tl.load(s_ptr + s_row + (k0 // 64) * 512 + s_col[None, :])
                sb = tl.reshape(tl.broadcast_to(sv.to(tl.bfloat16)[:, :, None], (BLOCK_N, BLOCK_K // 16, 8)),
                                (BLOCK_N, BLOCK_K // 2))
                hv, lv = K.e2m1_pairs_scaled(p, sb, False)
            else:
                sv = tl.load(s_tile + (k0 // 64) * 512 + s_loc)
                sb = tl.reshape(tl.broadcast_to(sv.to(tl.bfloat16)[:, :, None], (BLOCK_N, BLOCK_K // 16, 8)),
                                (BLOCK_N, BLOCK_K // 2))
                hv, lv = K.e2m1_pairs_scaled(p, sb, False)
            w = tl.reshape(tl.join(hv, lv), (BLOCK_N, BLOCK_K))
        acc = tl.dot(w, xt, acc)
    acc = acc * g
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    tl.store(y_ptr + rm[None, :].to(tl.int64) * N + rn[:, None], acc.to(tl.bfloat16), mask=mask)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--shapes", default="3072x12288,12288x3072,2560x6912")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    out = []
    variants = {"plain": 0, "noscale": 1, "perm": 2, "tile_scales": 5}
    if args.m <= 512:
        tiles = [(64, 128, 128, 4, 3, 0), (64, 128, 64, 4, 3, 0), (64, 256, 128, 4, 3, 0)]
    else:
        tiles = [(128, 256, 64, 8, 4, 0), (128, 256, 64, 8, 3, 0), (64, 256, 128, 4, 3, 0), (128, 128, 64, 8, 4, 0)]
    for shp in args.shapes.split(","):
        k, n = (int(v) for v in shp.split("x"))
        m = args.m
        gen = torch.Generator().manual_seed(0)
        w = (torch.randn(n, k, generator=gen) * 0.02).to(dev)
        t = fmt.quantize_nvfp4(w, return_tensor=True)
        wd = t.dequantize(torch.float32)[:n, :k]
        wb = wd.to(torch.bfloat16).contiguous()
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        g = float(t.global_scale)
        ref = F.linear(x.float(), wd)
        t_bf16 = do_bench(lambda: F.linear(x, wb), warmup=25, rep=200, return_mode="median")
        row = {"K": k, "N": n, "M": m, "bf16_ms": t_bf16}
        cur_cfg = (128, 256, 64, 1, 8, 4) if m > 512 else K.w4a16_config(m, n, k, dev)[:3] + (1, 4, 3)
        t_cur = do_bench(lambda: K.w4a16_linear(x, t.packed, t.block_scale, t.global_scale, n, None, config=cur_cfg),
                         warmup=25, rep=200, return_mode="median")
        row["current_ms"] = t_cur
        print(f"K={k} N={n} M={m}: cuBLAS bf16 {t_bf16:.4f} ms; current kernel {t_cur:.4f} ms "
              f"({t_bf16 / t_cur:.2f}x)", flush=True)
        for name, v in variants.items():
            for (bn, bm, bk, nw, st, grp) in tiles:
                y = torch.empty((m, n), device=dev, dtype=torch.bfloat16)
                grid = (triton.cdiv(n, bn) * triton.cdiv(m, bm),)

                def call():
                    _probe_kernel[grid](x, t.packed, t.block_scale, wb, y, 1.0 if v == 0 else g, m, n, k,
                                        t.block_scale.shape[1] // 4, k // bk, BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=bk,
                                        V=v, GROUP=grp, num_warps=nw, num_stages=st)
                try:
                    call()
                    if v == 1:
                        want = None
                    else:
                        want = ref
                    err = ((y.float() - want).norm() / want.norm()).item() if want is not None else float("nan")
                    ms = do_bench(call, warmup=25, rep=200, return_mode="median")
                    key = f"{name}_{bn}x{bm}x{bk}_w{nw}_s{st}_g{grp}"
                    row[key] = ms
                    print(f"   {key:32s} {ms:.4f} ms ({t_bf16 / ms:.2f}x bf16) err {err:.1e}", flush=True)
                except Exception as exc:  # noqa: BLE001
                    print(f"   {name} {(bn, bm, bk, nw, st, grp)} failed: {str(exc).splitlines()[0][:160]}",
                          flush=True)
        out.append(row)
        if args.json:
            json.dump(out, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
