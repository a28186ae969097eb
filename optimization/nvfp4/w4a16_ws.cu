// Fused NVFP4-weight x bf16-activation GEMM for Hopper (sm_90a), large M: y[M, N] = x[M, K] @ dequant(W)[N, K]^T.
// Compiled at run time by NVRTC (ws_w4a16.py fills in the #defines and the wgmma wrapper); no CUDA headers.
//
// Warp-specialized and persistent. A CTA loops over output tiles of TN tokens x BN = 128 weight rows; its k
// iterations run through one ring of STAGES slots across tiles. Two kinds of warpgroups, meeting only at mbarriers:
// - the loader (warpgroup 0): per k iteration, one thread starts the TMA copy of the activation tile (128-byte
//   swizzle; rows past M come back as zeros and are never stored), and every thread decodes its weight row into
//   bf16 in the same slot, in the layout a bf16 weight tile would have, fenced into the async proxy. The packed
//   weight tile (TMA, 128 rows x 32 B) and its 512 B of block scales (bulk copy) come RSTAGES - 1 iterations ahead
//   through a raw ring of the loader's own (no global load is ever in flight at its proxy fence or mbarrier
//   arrive, which would wait for it);
// - consumers (2 warpgroups): wgmma m64nTNk16, A = 64 decoded weight rows each, B = the TN tokens, both in shared
//   memory; nothing but wgmma in their k loop, so the wgmma stay asynchronous back to back. The epilogue goes
//   through shared memory (stmatrix, transposed) so each token's 64 outputs leave as one 128-byte run.
// The tensor cores see the shared-memory traffic of a bf16 GEMM of this tile: the decoded tile replaces the copied
// bf16 weight tile. 384 threads, so ptxas may give each up to 168 registers (128 accumulators per consumer).
//
// Decode, per 32-bit word q of 4 packed bytes (high nibble = the even k) and byte b: see w4a16_wgmma.cu (3 integer
// instructions and one bf16x2 multiply per two weights, exact; the 2^-10 it leaves is undone in the epilogue).

#ifndef DIAG
#define DIAG 0                       // probe-only, wrong results: 1 = no decode, 2 = no wgmma, 4 = no output stores
#endif
#define NCW 2                        // consumer warpgroups
#define BN 128                       // weight rows per tile: 64 per consumer warpgroup, one per loader thread
#define NT 384                       // threads: the loader warpgroup, then the consumers
#define X_BYTES (TN * 128)           // activation tile: TN tokens x 64 k, 128B-swizzled
#define W_BYTES (BN * 128)           // decoded weight tile: BN rows x 64 k, 128B-swizzled
#define SLOT_BYTES (X_BYTES + W_BYTES)
#define R_BYTES (128 * 32 + 512)     // raw ring slot: the packed weight tile + its block scales
#define EPI_BYTES (EPI_TOK * 128)    // per consumer warpgroup: EPI_TOK tokens x 64 weight rows, bf16

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;

static __device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}
struct __align__(64) TensorMap { u64 v[16]; };   // CUtensorMap, filled by the host (cuTensorMapEncodeTiled)

// TMA: box (64 k, TN rows) at (k, row) -> shared dst, completing `bytes` on the mbarrier
static __device__ __forceinline__ void tma_load_2d(u32 dst, const TensorMap* map, int k, int row, u32 bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
                 ::"r"(dst), "l"((u64)map), "r"(k), "r"(row), "r"(bar) : "memory");
}
static __device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
static __device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
static __device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
static __device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
static __device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
static __device__ __forceinline__ void fence_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
static __device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
static __device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
static __device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile("{\n.reg .pred done;\nWAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
static __device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}
static __device__ __forceinline__ u32 bf16x2_mul(u32 a, u32 b) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    return d;
}
// byte b of q -> bf16x2 [lo half: the high nibble (even k), hi half: the low nibble] x 2^-126, exact
static __device__ __forceinline__ u32 e2m1x2(u32 q, u32 q4, const int b) {
    const u32 z = prmt(q, q4, b | ((b | 8) << 4) | ((b + 4) << 8) | (((b + 4) | 8) << 12));
    return (z << 2) & 0x81C081C0u;
}
// two E4M3 scales (bytes 0, 1 of s) -> bf16x2 [s0, s1] x 2^116
static __device__ __forceinline__ u32 scale_pair(u32 s) {
    const u32 two118 = 0x7A807A80u;
    return bf16x2_mul(bf16x2_mul(prmt(s, 0u, 0x4140u) << 4, two118), two118);
}
static __device__ __forceinline__ u64 desc_sw128(u32 addr) {
    // wgmma shared-memory descriptor, K-major, 128-byte swizzle: start >> 4, leading offset (unused) 1, stride
    // between 8-row groups 1024 B
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
static __device__ __forceinline__ void st_shared_v4(u32 addr, u32 a, u32 b, u32 c, u32 d) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
static __device__ __forceinline__ uint4 ld_shared_v4(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}
static __device__ __forceinline__ u32 ld_shared_u32(u32 addr) {
    u32 v;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr));
    return v;
}
// four 8x8 bf16 matrices of the mma fragment layout, stored transposed: lane l names row l % 8 of matrix l / 8
static __device__ __forceinline__ void stmatrix_x4_trans(u32 addr, u32 a, u32 b, u32 c, u32 d) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
static __device__ __forceinline__ void named_barrier(int id) {   // one consumer warpgroup
    asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory");
}
static __device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// generated by ws_w4a16.wgmma_call: static __device__ void wgmma_ss(float* d, u64 desc_a, u64 desc_b, u32 acc)
//%%WGMMA%%

// output tile j of this CTA -> (first token, first weight row); bands of GROUP_M token tiles walk N together, so
// the CTAs running at once share activation rows and weight rows in L2
static __device__ __forceinline__ void tile_coords(int tile, int num_mt, int num_nt, int& m0, int& n0) {
    const int band = tile / (GROUP_M * num_nt);
    const int first = band * GROUP_M;
    const int gm = min(GROUP_M, num_mt - first);
    const int r = tile - band * GROUP_M * num_nt;
    m0 = (first + r % gm) * TN;
    n0 = (r / gm) * BN;
}

extern "C" __global__ void __launch_bounds__(NT, 1) KERNEL_NAME(
    const __grid_constant__ TensorMap xmap, const __grid_constant__ TensorMap wmap, const u8* __restrict__ wsc, const float* __restrict__ g,
    const u16* __restrict__ bias, u16* __restrict__ y, int M, int N, int K, int ldx, int ncb4) {
    extern __shared__ __align__(1024) u8 smem_raw[];
    u8* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);   // 1024-aligned (the swizzle atom)
    const u32 slots = smem_addr(smem);
    const u32 raws = slots + STAGES * SLOT_BYTES;
    const u32 epis = raws + RSTAGES * R_BYTES;
    // full[s]: slot s holds its activations and its decoded weights; empty[s]: the wgmma reading slot s are done
    __shared__ __align__(8) u64 bars[2 * STAGES + RSTAGES];
    const u32 full0 = smem_addr(bars), empty0 = full0 + 8 * STAGES, raw0 = empty0 + 8 * STAGES;

    const int tid = threadIdx.x;
    const int KT = K >> 6;                               // k tiles per output tile
    const int num_mt = (M + TN - 1) / TN, num_nt = N / BN;
    const int my_tiles = (num_mt * num_nt - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;

    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full0 + 8 * s, 129);               // the TMA bytes landed + each loader thread's decode stored
            mbar_init(empty0 + 8 * s, 4 * NCW);          // every consumer warp's wgmma reading the slot done
        }
#pragma unroll
        for (int r = 0; r < RSTAGES; ++r) mbar_init(raw0 + 8 * r, 1);   // thread 0's expect_tx; the copies' bytes
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (tid < 128) {
        // ========================= loader: activation copies, weight decode =========================
        const int p = tid;                               // the weight row of the tile this thread decodes
        const int total = my_tiles * KT;
        auto issue_raw = [&](int v) {                    // thread 0: iteration v's packed tile and scales
            int m0, n0;
            tile_coords(blockIdx.x + (v / KT) * gridDim.x, num_mt, num_nt, m0, n0);
            const int kt = v % KT, r = v % RSTAGES;
            const u32 rb = raws + r * R_BYTES, bar = raw0 + 8 * r;
            mbar_expect_tx(bar, R_BYTES);
            tma_load_2d(rb, &wmap, kt * 32, n0, bar);
            bulk_load(rb + 4096, wsc + ((size_t)(n0 >> 7) * ncb4 + kt) * 512, 512, bar);
        };
        if (tid == 0) {
            asm volatile("prefetch.tensormap [%0];\n" ::"l"((u64)&xmap) : "memory");
            asm volatile("prefetch.tensormap [%0];\n" ::"l"((u64)&wmap) : "memory");
            for (int v = 0; v < RSTAGES - 1 && v < total; ++v) issue_raw(v);
        }
        int u = 0;
#pragma unroll 1
        for (int j = 0; j < my_tiles; ++j) {
            int m0, n0;
            tile_coords(blockIdx.x + j * gridDim.x, num_mt, num_nt, m0, n0);
#pragma unroll 1
            for (int kt = 0; kt < KT; ++kt, ++u) {
                // every loader thread is done reading raw slot (u - 1) % RSTAGES: refill it
                asm volatile("bar.sync 3, 128;\n" ::: "memory");
                if (tid == 0 && u + RSTAGES - 1 < total) issue_raw(u + RSTAGES - 1);
                const int slot = u % STAGES;
                if (u >= STAGES) mbar_wait(empty0 + 8 * slot, ((u / STAGES) - 1) & 1);
                const u32 sb = slots + slot * SLOT_BYTES;
                if (tid == 0) {
                    mbar_expect_tx(full0 + 8 * slot, X_BYTES);
                    tma_load_2d(sb, &xmap, kt * 64, m0, full0 + 8 * slot);
                }
                const u32 rb = raws + (u % RSTAGES) * R_BYTES;
                mbar_wait(raw0 + 8 * (u % RSTAGES), (u / RSTAGES) & 1);
                if (!(DIAG & 1)) {
                    const uint4 c0 = ld_shared_v4(rb + p * 32), c1 = ld_shared_v4(rb + p * 32 + 16);
                    const u32 s = ld_shared_u32(rb + 4096 + (p & 31) * 16 + (p >> 5) * 4);   // its 4 block scales
                    u32 q[8], sc[4];
                    const u32 f01 = scale_pair(s), f23 = scale_pair(s >> 16);
                    sc[0] = prmt(f01, f01, 0x1010u); sc[1] = prmt(f01, f01, 0x3232u);
                    sc[2] = prmt(f23, f23, 0x1010u); sc[3] = prmt(f23, f23, 0x3232u);
                    q[0] = c0.x; q[1] = c0.y; q[2] = c0.z; q[3] = c0.w;
                    q[4] = c1.x; q[5] = c1.y; q[6] = c1.z; q[7] = c1.w;
                    const u32 row = sb + X_BYTES + p * 128;
#pragma unroll
                    for (int i = 0; i < 8; ++i) {        // chunk i: k 8 i .. 8 i + 7
                        const u32 q4 = q[i] << 4, f = sc[i >> 1];
                        st_shared_v4(row + ((i ^ (p & 7)) << 4), bf16x2_mul(e2m1x2(q[i], q4, 0), f),
                                     bf16x2_mul(e2m1x2(q[i], q4, 1), f), bf16x2_mul(e2m1x2(q[i], q4, 2), f),
                                     bf16x2_mul(e2m1x2(q[i], q4, 3), f));
                    }
                }
                fence_async_smem();                      // decoded stores -> the tensor cores
                mbar_arrive(full0 + 8 * slot);
            }
        }
    } else {
        // ============================ consumers: wgmma, epilogue ============================
        const int c = (tid - 128) >> 7, t = tid & 127;
        const int warp = t >> 5, lane = t & 31;
        const float mult = g[0] * 1024.f;
        float d[TN / 2];                                 // 64 weight rows x TN tokens
        int it = 0;
#pragma unroll 1
        for (int j = 0; j < my_tiles; ++j) {
            int m0, n0;
            tile_coords(blockIdx.x + j * gridDim.x, num_mt, num_nt, m0, n0);
#pragma unroll 1
            for (int kt = 0; kt < KT; ++kt, ++it) {
                const int slot = it % STAGES;
                mbar_wait(full0 + 8 * slot, (it / STAGES) & 1);
                const u32 sb = slots + slot * SLOT_BYTES;
                wgmma_fence();
#pragma unroll
                for (int s = 0; s < 4; ++s) {
                    if (!(DIAG & 2))
                        wgmma_ss(d, desc_sw128(sb + X_BYTES + c * 64 * 128 + s * 32), desc_sw128(sb + s * 32),
                                 (kt | s) != 0);
                }
                wgmma_commit();
                wgmma_wait<1>();
                if (kt > 0 && lane == 0) mbar_arrive(empty0 + 8 * ((it - 1) % STAGES));
            }
            wgmma_wait<0>();
            if (lane == 0) mbar_arrive(empty0 + 8 * ((it - 1) % STAGES));
            if (DIAG & 2) {
#pragma unroll
                for (int i = 0; i < TN / 2; ++i) d[i] = 0.f;
            }
            // epilogue: d[i] is (weight row 16 warp + lane/4 + 8 ((i/2)%2), token 8 (i/4) + 2 (lane%4) + i%2): per
            // 8 tokens two 8x8 matrices of the mma fragment layout. stmatrix.trans puts them in the staging buffer as
            // [token][64 weight rows] (16-byte chunks XOR-swizzled by token % 8), then each token's 128 bytes go out
            const int r0 = 16 * warp + (lane >> 2);
            float b0 = 0.f, b1 = 0.f;
            if (HAS_BIAS) {
                b0 = __uint_as_float((u32)bias[n0 + 64 * c + r0] << 16);
                b1 = __uint_as_float((u32)bias[n0 + 64 * c + r0 + 8] << 16);
            }
            const u32 stage = epis + c * EPI_BYTES;
            const int ml = lane & 7, mk = lane >> 3;     // this lane's row of matrix mk in an stmatrix.x4
#pragma unroll
            for (int e = 0; e < TN / EPI_TOK; ++e) {
#pragma unroll
                for (int jj = 0; jj < EPI_TOK / 8; jj += 2) {
                    const int jg = e * (EPI_TOK / 8) + jj;   // 8-token group of the tile
                    const float* da = d + 4 * jg;
                    const float* db = d + 4 * (jg + 1);
                    const int tok = 8 * (jj + (mk >> 1)) + ml, chunk = 2 * warp + (mk & 1);
                    stmatrix_x4_trans(stage + tok * 128 + ((chunk ^ ml) << 4),
                                      pack_bf16x2(da[0] * mult + b0, da[1] * mult + b0),
                                      pack_bf16x2(da[2] * mult + b1, da[3] * mult + b1),
                                      pack_bf16x2(db[0] * mult + b0, db[1] * mult + b0),
                                      pack_bf16x2(db[2] * mult + b1, db[3] * mult + b1));
                }
                named_barrier(1 + c);
#pragma unroll
                for (int r = 0; r < EPI_TOK * 8 / 128; ++r) {
                    const int idx = t + 128 * r, tok = idx >> 3, cp = idx & 7;
                    const uint4 v = ld_shared_v4(stage + tok * 128 + (cp << 4));
                    const int m = m0 + e * EPI_TOK + tok;
                    if (m < M && (!(DIAG & 4) || v.x == 12345u))
                        *(uint4*)(y + (size_t)m * N + n0 + 64 * c + 8 * (cp ^ (tok & 7))) = v;
                }
                named_barrier(1 + c);
            }
        }
    }
}
