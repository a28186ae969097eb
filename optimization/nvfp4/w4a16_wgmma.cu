// Fused NVFP4-weight x bf16-activation GEMM for Hopper (sm_90a): y[M, N] = x[M, K] @ dequant(W)[N, K]^T.
// Compiled at run time by NVRTC (wgmma_w4a16.py fills in the #defines and the wgmma wrapper); no CUDA headers.
//
// "Swap AB": each warpgroup computes y^T for 64 weight rows x BM tokens with wgmma m64nBMk16, the decoded weight
// as the A operand *in registers* (decoded straight into the wgmma fragment layout: no shared-memory round trip,
// no register shuffles) and the activations as the B operand from 128-byte-swizzled shared memory.
//
// Decode, per 32-bit word q of 4 packed bytes (high nibble = the even k) and byte b, in 3 integer instructions:
//   z = prmt(q, q << 4, [b, sign(b), b+4, sign(b+4)])  -> [byte b, its high nibble's sign x8, lo nibble << 4, sign x8]
//   v = (z << 2) & 0x81C081C0                           -> bf16x2 [hi, lo] = E2M1 value x 2^-126, exact
// (the 3 magnitude bits land on the bf16's lowest exponent bits + top mantissa bit; code 1 = 0.5 becomes the
// subnormal 2^-127, so one multiply by scale x 2^116 gives value x scale x 2^-10 exactly, for every code).
// The E4M3 block scale becomes bf16 the same way: code << 4 is scale x 2^-120 (subnormal scales included), times
// 2^118 twice. The 2^-10 is undone in the epilogue with the global scale (a power of two: sums are unchanged).
//
// Pipeline: STAGES shared-memory slots filled by cp.async PREF = STAGES - 1 k tiles ahead, with two mbarriers per
// slot instead of a CTA-wide barrier: full[s] completes when every thread's copies into s have landed (each thread
// arrives through cp.async.mbarrier.arrive.noinc), empty[s] when every thread's wgmma reading s are done. Each
// warpgroup runs on its own, and the copies of tile t + PREF are issued while tile t's wgmma run. Each k tile's 4
// wgmma are waited for before the next tile is decoded: with one group left in flight while the next tile's A
// registers are written, ptxas serializes every wgmma (C7513); decoding one k16 step per wgmma needs a
// wgmma.fence per step, and warpgroups taking turns on the tensor cores need named barriers: both measured slower
// (docs/BENCHMARKS.md, session 8).

#ifndef DIAG
#define DIAG 0                       // probe-only (scripts/device/wgmma_probe.py --part bound), wrong results:
#endif                               // 2 = constant A instead of the decode, 4 = no output stores
#define BN (64 * WG)                 // weight rows per CTA
#define NT (128 * WG)                // threads per CTA
#define B_BYTES (BM * 128)           // activation tile: BM tokens x 64 k (bf16), 128B-swizzled
#define A_BYTES (BN * 32)            // packed weight tile: BN rows x 64 k (4 bit)
#define S_GROUPS ((BN + 127) / 128)  // 128-row groups of the swizzled block-scale layout in the tile
#define S_BYTES (512 * S_GROUPS)     // their block scales for this k tile (512 B per group)
#define STAGE_BYTES ((B_BYTES + A_BYTES + S_BYTES + 1023) / 1024 * 1024)
#define PREF (STAGES - 1)         // k tiles copied ahead (a slot is free once the wgmma reading it is done)

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;

static __device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}
static __device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
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
// arrive on bar once this thread's earlier cp.async copies have landed (counted in the barrier's arrivals)
static __device__ __forceinline__ void cp_async_mbar_arrive(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
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
// byte b of q -> bf16x2 [value of the high nibble, value of the low nibble] x 2^-126
static __device__ __forceinline__ u32 e2m1x2(u32 q, u32 q4, const int b) {
    const u32 z = prmt(q, q4, b | ((b | 8) << 4) | ((b + 4) << 8) | (((b + 4) | 8) << 12));
    return (z << 2) & 0x81C081C0u;
}
// two E4M3 scales (bytes 0, 1 of s) -> bf16x2 [s0, s1] x 2^116
static __device__ __forceinline__ u32 scale_pair(u32 s) {
    const u32 two118 = 0x7A807A80u;
    return bf16x2_mul(bf16x2_mul(prmt(s, 0u, 0x4140u) << 4, two118), two118);
}
static __device__ __forceinline__ u64 desc_b(u32 addr) {
    // wgmma shared-memory descriptor: start >> 4, leading offset (unused for swizzled K-major) 1, stride between
    // 8-row groups 1024 B, 128-byte swizzle
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
static __device__ __forceinline__ u16 f32_to_bf16(float v) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(r) : "f"(v));
    return r;
}

// generated by wgmma_w4a16.wgmma_call: static __device__ void wgmma_bm(float* d, u32 a0..a3, u64 desc)
//%%WGMMA%%

extern "C" __global__ void __launch_bounds__(NT, MINB) KERNEL_NAME(
    const u16* __restrict__ x, const u8* __restrict__ wp, const u8* __restrict__ wsc, const float* __restrict__ g,
    const u16* __restrict__ bias, u16* __restrict__ y, float* __restrict__ part, int M, int N, int K, int ldx,
    int ncb4, int tiles) {
    extern __shared__ __align__(1024) u8 smem_raw[];
    u8* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);   // 1024-aligned (the swizzle atom);
                                                                                // an offset keeps it a shared pointer
    const int tid = threadIdx.x;
    const int n0 = blockIdx.x * BN;
    const int m0 = blockIdx.y * BM;
    const int kt0 = blockIdx.z * tiles;
    const int half = K >> 1;

    // ---- producer: every thread copies its share of one k tile into one slot
    // per-thread copy sources and destinations, k-invariant: chunk q = tid % 8 of rows tid / 8 + j * NT / 8
    // (NT / 8 is a multiple of 8, so every row of this thread has the same swizzle)
    const int lq = tid & 7, lr = tid >> 3;
    const u8* xrow[BM * 8 / NT];
#pragma unroll
    for (int j = 0; j < BM * 8 / NT; ++j) {
        const int m = min(m0 + lr + j * (NT / 8), M - 1);          // rows past M re-read row M-1 (never stored)
        xrow[j] = (const u8*)(x + (size_t)m * ldx) + lq * 16;
    }
    const u32 x_dst = lr * 128 + ((lq ^ (lr & 7)) << 4);
    const u8* wrow = wp + (size_t)(n0 + (tid >> 1)) * half + (tid & 1) * 16;   // BN rows x 2 chunks (BN * 2 == NT)
    const u32 w_dst = B_BYTES + tid * 16;
    const u8* srow = wsc + (size_t)((n0 >> 7) + (tid >> 5)) * ncb4 * 512 + (tid & 31) * 16;  // 512 B per group

    auto load_tile = [&](int slot, int kt) {
        const u32 sb = smem_addr(smem + slot * STAGE_BYTES);
#pragma unroll
        for (int j = 0; j < BM * 8 / NT; ++j)
            cp_async16(sb + x_dst + j * (NT / 8) * 128, xrow[j] + kt * 128);
        cp_async16(sb + w_dst, wrow + kt * 32);
        if (tid < 32 * S_GROUPS) cp_async16(sb + B_BYTES + A_BYTES + tid * 16, srow + kt * 512);
    };

    // ---- consumer geometry (wgmma fragment layout)
    const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int c = lane & 3;
    const int r0 = wg * 64 + warp * 16 + (lane >> 2);           // this thread's rows r0 and r0 + 8 in the tile
    const int gr0 = n0 + r0, gr1 = gr0 + 8;
    const int s_off0 = (r0 >> 7) * 512 + (gr0 & 31) * 16 + ((gr0 & 127) >> 5) * 4;
    const int s_off1 = (r0 >> 7) * 512 + (gr1 & 31) * 16 + ((gr1 & 127) >> 5) * 4;
    const u32 sel_c = c | ((c + 4) << 4);

    float d[BM / 2];
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) d[i] = 0.f;

    // full[s]: every thread's copies into slot s have landed; empty[s]: every thread's wgmma reading it are done
    __shared__ __align__(8) u64 bars[2 * STAGES];
    const u32 full0 = smem_addr(bars), empty0 = full0 + 8 * STAGES;
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full0 + 8 * s, NT);
            mbar_init(empty0 + 8 * s, NT);
        }
    }
    __syncthreads();
#pragma unroll
    for (int p = 0; p < PREF; ++p) {
        if (p < tiles) {
            load_tile(p, kt0 + p);
            cp_async_mbar_arrive(full0 + 8 * p);
        }
    }

    // decode k tile t's weights from its slot into the 16 A registers (4 k16 steps x a0..a3)
    auto decode = [&](int slot, u32* a) {
        const u8* st = smem + slot * STAGE_BYTES;
        const uint4 v0 = *(const uint4*)(st + B_BYTES + r0 * 32);
        const uint4 v1 = *(const uint4*)(st + B_BYTES + r0 * 32 + 16);
        const uint4 w0 = *(const uint4*)(st + B_BYTES + (r0 + 8) * 32);
        const uint4 w1 = *(const uint4*)(st + B_BYTES + (r0 + 8) * 32 + 16);
        // byte c of each 4-byte chunk (chunk j = k 8j..8j+7): the k pairs 2c, 2c+1 of this thread's fragment
        u32 qa[2], qb[2];
        qa[0] = prmt(prmt(v0.x, v0.y, sel_c), prmt(v0.z, v0.w, sel_c), 0x5410u);
        qa[1] = prmt(prmt(v1.x, v1.y, sel_c), prmt(v1.z, v1.w, sel_c), 0x5410u);
        qb[0] = prmt(prmt(w0.x, w0.y, sel_c), prmt(w0.z, w0.w, sel_c), 0x5410u);
        qb[1] = prmt(prmt(w1.x, w1.y, sel_c), prmt(w1.z, w1.w, sel_c), 0x5410u);
        const u32 sa = *(const u32*)(st + B_BYTES + A_BYTES + s_off0);   // scales of k16 steps 0..3, row r0
        const u32 sb = *(const u32*)(st + B_BYTES + A_BYTES + s_off1);   // row r0 + 8
        const u32 fa01 = scale_pair(sa), fa23 = scale_pair(sa >> 16);
        const u32 fb01 = scale_pair(sb), fb23 = scale_pair(sb >> 16);
        u32 pa[4], pb[4];
        pa[0] = prmt(fa01, fa01, 0x1010u); pa[1] = prmt(fa01, fa01, 0x3232u);
        pa[2] = prmt(fa23, fa23, 0x1010u); pa[3] = prmt(fa23, fa23, 0x3232u);
        pb[0] = prmt(fb01, fb01, 0x1010u); pb[1] = prmt(fb01, fb01, 0x3232u);
        pb[2] = prmt(fb23, fb23, 0x1010u); pb[3] = prmt(fb23, fb23, 0x3232u);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32 qa4 = qa[h] << 4, qb4 = qb[h] << 4;
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int s = 2 * h + j;                         // k16 step: chunks 2s (a0, a1) and 2s+1 (a2, a3)
                a[4 * s + 0] = bf16x2_mul(e2m1x2(qa[h], qa4, 2 * j), pa[s]);
                a[4 * s + 1] = bf16x2_mul(e2m1x2(qb[h], qb4, 2 * j), pb[s]);
                a[4 * s + 2] = bf16x2_mul(e2m1x2(qa[h], qa4, 2 * j + 1), pa[s]);
                a[4 * s + 3] = bf16x2_mul(e2m1x2(qb[h], qb4, 2 * j + 1), pb[s]);
            }
        }
    };

    // the refill of the slot tile t - 1 used is issued after this tile's wgmma, in their shadow
    auto step = [&](int t, u32* a) {
        const int slot = t % STAGES;
        mbar_wait(full0 + 8 * slot, (t / STAGES) & 1);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");   // cp.async data -> wgmma's proxy
        if (DIAG & 2) {
#pragma unroll
            for (int i = 0; i < 16; ++i) a[i] = 0x3F803F80u ^ (u32)t;
        } else {
            decode(slot, a);
        }
        const u32 b0 = smem_addr(smem + slot * STAGE_BYTES);
        wgmma_fence();
#pragma unroll
        for (int s = 0; s < 4; ++s)
            wgmma_bm(d, a[4 * s], a[4 * s + 1], a[4 * s + 2], a[4 * s + 3], desc_b(b0 + s * 32));
        wgmma_commit();
        const int u = t + PREF;
        if (u < tiles) {
            const int us = u % STAGES;
            if (u >= STAGES) mbar_wait(empty0 + 8 * us, (u / STAGES - 1) & 1);
            load_tile(us, kt0 + u);
            cp_async_mbar_arrive(full0 + 8 * us);
        }
        wgmma_wait<0>();
        mbar_arrive(empty0 + 8 * slot);
    };

    u32 a[16];
    for (int t = 0; t < tiles; ++t) step(t, a);
    // ---- epilogue: d[i] is (row 16 warp + lane/4 + 8 ((i/2)%2), token 8 (i/4) + 2 (lane%4) + i%2)
    const float mult = SPLIT ? 1024.f : g[0] * 1024.f;
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) {
        const int n = gr0 + 8 * ((i >> 1) & 1);
        const int m = m0 + 8 * (i >> 2) + 2 * c + (i & 1);
        if (m < M && n < N && (!(DIAG & 4) || d[i] == 12345.f)) {   // DIAG 4: a store the compiler keeps
            float v = d[i] * mult;
            if (SPLIT) {
                part[((size_t)blockIdx.z * M + m) * N + n] = v;
            } else {
                if (HAS_BIAS) v += __uint_as_float((u32)bias[n] << 16);
                y[(size_t)m * N + n] = f32_to_bf16(v);
            }
        }
    }
}
