// Fused NVFP4-weight x bf16-activation GEMM for Hopper (sm_90a), large M, with the decode shared between CTAs:
// y[M, N] = x[M, K] @ dequant(W)[N, K]^T. Compiled at run time by NVRTC (dd_w4a16.py fills in the #defines and the
// wgmma wrapper); no CUDA headers.
//
// Why: every output tile of TN tokens x 128 weight rows needs the whole 128-row weight tile in bf16, and the
// num_mt = M / TN token tiles of one weight tile all need the same one. Decoding it in every CTA (session 11's
// kernel) made the decode the bottleneck. Here each k tile (64 k) of a weight tile is decoded once, by one of the
// CTAs of that weight tile, into a bf16 scratch copy of W in global memory (L2-resident while in use), and marked
// ready by a flag; every CTA then copies the bf16 weight tile by TMA, as a bf16 GEMM would. A CTA decodes about
// KT / num_mt k tiles per tile instead of KT.
//
// Persistent, warp-specialized, tiles in weight-tile-major order (the num_mt tiles of a weight tile are
// consecutive). Who decodes what: k tile kt of weight tile w is decoded by the CTA that runs tile (w, kt % num_mt).
// The decoders never wait for anything but each other, so every flag gets set as long as every CTA runs: the grid
// must be resident at once (grid <= SMs at one CTA per SM; a production launch would have to be cooperative).
// - loader warpgroup: thread 0 waits for the slot and the k tile's flag, then starts the TMA copies of the
//   activation tile and the bf16 weight tile (128-byte swizzle); warps 1-3 decode this CTA's shares, running
//   ahead of thread 0 (not paced by the ring), in the order they are first needed;
// - consumers (2 warpgroups): wgmma m64nTNk16, A = 64 weight rows each, B = the TN tokens, both in shared memory,
//   and a transposed stmatrix epilogue.
// Flags hold the call's epoch + 1 (epoch = sync[0], read at start; the last CTA to finish bumps it), so neither the
// flags nor the scratch need clearing between calls, CUDA-graph replays included.
//
// Decode, per 32-bit word q of 4 packed bytes (high nibble = the even k) and byte b: see w4a16_wgmma.cu (3 integer
// instructions and one bf16x2 multiply per two weights, exact; the 2^-10 it leaves is undone in the epilogue).

#ifndef DIAG
#define DIAG 0                       // probe-only, wrong results: 1 = no decode and no flag waits, 2 = no wgmma,
                                     // 4 = no output stores, 8 = no flag waits (decode kept),
                                     // 16 = relaxed flag polls (no acquire), 32 = one decoder thread's proxy
                                     // fence, 64 = no decoder fences, 128 = no decoder stores, 256 = no
                                     // decoder loads
#endif
#define NCW 2                        // consumer warpgroups
#define BN 128                       // weight rows per tile: 64 per consumer warpgroup
#define NT 384                       // threads: the loader warpgroup, then the consumers
#define X_BYTES (TN * 128)           // activation tile: TN tokens x 64 k, 128B-swizzled
#define W_BYTES (BN * 128)           // weight tile: BN rows x 64 k, 128B-swizzled
#define SLOT_BYTES (X_BYTES + W_BYTES)
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
static __device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
static __device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
static __device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
static __device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
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
static __device__ __forceinline__ u64 desc_sw128(u32 addr) {
    // wgmma shared-memory descriptor, K-major, 128-byte swizzle: start >> 4, leading offset (unused) 1, stride
    // between 8-row groups 1024 B
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
static __device__ __forceinline__ uint4 ld_shared_v4(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
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

static __device__ __forceinline__ u32 ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
static __device__ __forceinline__ u32 ld_relaxed(const u32* p) {
    u32 v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
static __device__ __forceinline__ void st_release(u32* p, u32 v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
static __device__ __forceinline__ void fence_async_global() {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
static __device__ __forceinline__ void st_global_v4(void* p, u32 a, u32 b, u32 c, u32 d) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
#ifndef CLUSTER
#define CLUSTER 1                    // 2: CTA pairs share the token tile, each TMA-multicasts half of it to both
#endif
static __device__ __forceinline__ void tma_load_2d_mc(u32 dst, const TensorMap* map, int k, int row, u32 bar,
                                                      u16 mask) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%2, %3}], [%4], %5;\n"
                 ::"r"(dst), "l"((u64)map), "r"(k), "r"(row), "r"(bar), "h"(mask) : "memory");
}
static __device__ __forceinline__ void mbar_arrive_peer(u32 bar, u32 peer) {   // the same barrier in CTA `peer`
    asm volatile("{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
                 "mbarrier.arrive.shared::cluster.b64 _, [ra];\n}\n" ::"r"(bar), "r"(peer) : "memory");
}
static __device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
static __device__ __forceinline__ void decoder_barrier() {  // loader warps 1-3
    asm volatile("bar.sync 3, 96;\n" ::: "memory");
}

// generated by dd_w4a16.wgmma_call: static __device__ void wgmma_ss(float* d, u64 desc_a, u64 desc_b, u32 acc)
//%%WGMMA%%

// this CTA's tile j -> (first token, first weight row), weight-tile-major so the num_mt tiles of a weight tile
// are consecutive. CLUSTER 2: the cluster's "pair tiles" (token tile, pair of weight tiles) are in that order, and
// CTA rank r of the pair takes weight tile 2 p + r
static __device__ __forceinline__ void tile_coords(int j, int num_mt, int& m0, int& n0) {
#if CLUSTER == 1
    const int tile = blockIdx.x + j * gridDim.x;
    m0 = (tile % num_mt) * TN;
    n0 = (tile / num_mt) * BN;
#else
    const int pt = (blockIdx.x >> 1) + j * (gridDim.x >> 1);
    m0 = (pt % num_mt) * TN;
    n0 = ((pt / num_mt) * 2 + (blockIdx.x & 1)) * BN;
#endif
}

// k tile kt of the weight tile at row n0 -> bf16 (x 2^-10) in the scratch copy, then its flag. The 96 decoder
// threads (loader warps 1-3, d = 0..95): item d + 96 i is row (d / 8 + 12 i), 8-k chunk (d % 8), so a warp writes
// 4 whole 128-byte rows per store
static __device__ __forceinline__ void decode_share(const u8* __restrict__ wp, const u8* __restrict__ wsc,
                                                    u16* __restrict__ scratch, u32* __restrict__ flag, u32 target,
                                                    int n0, int kt, int K, int ncb4, int d) {
    const int ch = d & 7, half = K >> 1;
    u32 q[11], sv[11];
#pragma unroll
    for (int i = 0; i < 11; ++i) {
        const int r = (d >> 3) + 12 * i, n = n0 + min(r, BN - 1);
        if (DIAG & 256) {                            // probe: no loads
            q[i] = (u32)(n * 0x9E3779B9u + kt);
            sv[i] = 0x38383838u;
        } else {
            q[i] = __ldg((const u32*)(wp + (size_t)n * half + kt * 32 + ch * 4));
            sv[i] = __ldg((const u32*)(wsc + (size_t)(n >> 7) * ncb4 * 512 + (n & 31) * 16 + ((n & 127) >> 5) * 4
                                       + kt * 512));
        }
    }
    const u32 two118 = 0x7A807A80u;
    const u32 sel = (u32)(ch >> 1) * 0x101u | 0x4040u;     // scale byte ch / 2 into both halves
#pragma unroll
    for (int i = 0; i < 11; ++i) {
        const int r = (d >> 3) + 12 * i;
        if (r < BN && (!(DIAG & 128) || q[i] == 0x12345678u)) {   // DIAG 128, probe: (almost) no stores
            const u32 f = bf16x2_mul(bf16x2_mul(prmt(sv[i], 0u, sel) << 4, two118), two118);
            const u32 q4 = q[i] << 4;
            st_global_v4(scratch + (size_t)(n0 + r) * K + kt * 64 + ch * 8, bf16x2_mul(e2m1x2(q[i], q4, 0), f),
                         bf16x2_mul(e2m1x2(q[i], q4, 1), f), bf16x2_mul(e2m1x2(q[i], q4, 2), f),
                         bf16x2_mul(e2m1x2(q[i], q4, 3), f));
        }
    }
    if (!(DIAG & 96)) fence_async_global();         // these generic stores -> other CTAs' TMA reads
    decoder_barrier();
    if (d == 0) {
        if (DIAG & 32) fence_async_global();
        if (!(DIAG & 64)) __threadfence();
        st_release(flag, target);
    }
}

// CLUSTER 2 must be launched with a cluster dimension of (2, 1, 1) (dd_w4a16.py: cuLaunchKernelEx)
extern "C" __global__ void __launch_bounds__(NT, 1) KERNEL_NAME(
    const __grid_constant__ TensorMap xmap, const __grid_constant__ TensorMap wmap, const u8* __restrict__ wp,
    const u8* __restrict__ wsc, const float* __restrict__ g, const u16* __restrict__ bias, u16* __restrict__ y,
    u16* __restrict__ scratch, u32* __restrict__ flags, u32* __restrict__ sync, int M, int N, int K, int ncb4) {
    extern __shared__ __align__(1024) u8 smem_raw[];
    u8* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);   // 1024-aligned (the swizzle atom)
    const u32 slots = smem_addr(smem);
    const u32 epis = slots + STAGES * SLOT_BYTES;
    // full[s]: both TMA copies of slot s landed; empty[s]: the wgmma reading slot s are done
    __shared__ __align__(8) u64 bars[2 * STAGES];
    const u32 full0 = smem_addr(bars), empty0 = full0 + 8 * STAGES;

    const int tid = threadIdx.x;
    const int KT = K >> 6;                               // k tiles per output tile
    const int num_mt = (M + TN - 1) / TN, num_nt = N / BN;
    const int units = num_mt * num_nt / CLUSTER, unit = blockIdx.x / CLUSTER, nunits = gridDim.x / CLUSTER;
    const int my_tiles = (units - unit + nunits - 1) / nunits;
    const u32 peer = (blockIdx.x & 1) ^ 1;              // CLUSTER 2: the other CTA's rank in the pair

    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full0 + 8 * s, 1);                 // thread 0's expect_tx; the TMA bytes complete it
            mbar_init(empty0 + 8 * s, 4 * NCW * CLUSTER);   // every consumer warp (of both CTAs) done with the slot
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
#if CLUSTER > 1
    cluster_sync();                                      // the peer's barriers exist before anything reaches them
#else
    __syncthreads();
#endif

    if (tid < 128) {
        // ============ loader: warp 0 (thread 0) flags and TMA copies; warps 1-3 this CTA's decode shares ============
        const u32 target = *(volatile u32*)sync + 1u;
        if (tid == 0) {
            asm volatile("prefetch.tensormap [%0];\n" ::"l"((u64)&xmap) : "memory");
            asm volatile("prefetch.tensormap [%0];\n" ::"l"((u64)&wmap) : "memory");
            int u = 0;
#pragma unroll 1
            for (int j = 0; j < my_tiles; ++j) {
                int m0, n0;
                tile_coords(j, num_mt, m0, n0);
                const u32* tflags = flags + (n0 / BN) * KT;
#pragma unroll 1
                for (int kt = 0; kt < KT; ++kt, ++u) {
                    const int slot = u % STAGES;
                    if (u >= STAGES) mbar_wait(empty0 + 8 * slot, ((u / STAGES) - 1) & 1);
                    if (!(DIAG & 9)) {
                        if (DIAG & 16) {
                            while (ld_relaxed(tflags + kt) != target) {
                            }
                        } else {
                            while (ld_acquire(tflags + kt) != target) {
                            }
                        }
                        fence_async_global();            // the flag's data -> this CTA's TMA reads
                    }
                    const u32 sb = slots + slot * SLOT_BYTES;
                    mbar_expect_tx(full0 + 8 * slot, X_BYTES + W_BYTES);
#if CLUSTER == 1
                    tma_load_2d(sb, &xmap, kt * 64, m0, full0 + 8 * slot);
#else
                    // this CTA's half of the shared activation tile, into both CTAs' slot
                    tma_load_2d_mc(sb + (blockIdx.x & 1) * (X_BYTES / 2), &xmap, kt * 64,
                                   m0 + (blockIdx.x & 1) * (TN / 2), full0 + 8 * slot, (u16)3);
#endif
                    tma_load_2d(sb + X_BYTES, &wmap, kt * 64, n0, full0 + 8 * slot);
                }
            }
        } else if (tid >= 32 && !(DIAG & 1)) {
            // decoders: this CTA's shares, ordered by when they are first needed: by the first round of the
            // persistent schedule that runs a tile of their weight tile, then by k. (In tile order, a weight tile
            // whose token tiles straddle two rounds would wait for the later round's CTAs to finish their own
            // earlier shares.)
            const int d = tid - 32;
            auto first_round = [&](int j) {                  // the round of the first tile of tile j's weight tile
                const int u = unit + j * nunits;
                return (u - u % num_mt) / nunits;
            };
            int j0 = 0;
#pragma unroll 1
            while (j0 < my_tiles) {
                int j1 = j0 + 1;
                while (j1 < my_tiles && first_round(j1) == first_round(j0)) ++j1;
#pragma unroll 1
                for (int kt = 0; kt < KT; ++kt) {
#pragma unroll 1
                    for (int j = j0; j < j1; ++j) {
                        int m0, n0;
                        tile_coords(j, num_mt, m0, n0);
                        if (kt % num_mt == m0 / TN)
                            decode_share(wp, wsc, scratch, flags + (n0 / BN) * KT + kt, target, n0, kt, K, ncb4, d);
                    }
                }
                j0 = j1;
            }
        }
    } else {
        const int c = (tid - 128) >> 7, t = tid & 127;
        const int warp = t >> 5, lane = t & 31;
        const float mult = g[0] * 1024.f;
        float d[TN / 2];                                 // 64 weight rows x TN tokens
        int it = 0;
#pragma unroll 1
        for (int j = 0; j < my_tiles; ++j) {
            int m0, n0;
            tile_coords(j, num_mt, m0, n0);
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
                if (kt > 0 && lane == 0) {
                    mbar_arrive(empty0 + 8 * ((it - 1) % STAGES));
                    if (CLUSTER > 1) mbar_arrive_peer(empty0 + 8 * ((it - 1) % STAGES), peer);
                }
            }
            wgmma_wait<0>();
            if (lane == 0) {
                mbar_arrive(empty0 + 8 * ((it - 1) % STAGES));
                if (CLUSTER > 1) mbar_arrive_peer(empty0 + 8 * ((it - 1) % STAGES), peer);
            }
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
    // the last CTA to finish moves the epoch on, so the next call's flags mean "decoded in that call"
#if CLUSTER > 1
    cluster_sync();                                      // no arrive or copy reaches an exited peer
#else
    __syncthreads();
#endif
    if (tid == 0) {
        __threadfence();
        if (atomicAdd(sync + 1, 1u) == gridDim.x - 1) {
            sync[1] = 0u;
            __threadfence();
            atomicAdd(sync, 1u);
        }
    }
}
