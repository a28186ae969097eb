// Fused NVFP4-weight x bf16-activation GEMM for Hopper (sm_90a), large M: y[M, N] = x[M, K] @ dequant(W)[N, K]^T.
// Compiled at run time by NVRTC (ws_w4a16.py fills in the #defines and the wgmma wrapper); no CUDA headers.
//
// Warp-specialized and persistent: one producer warpgroup and NCW consumer warpgroups per CTA; the CTA loops over
// output tiles of BT = 64 NCW tokens x BN weight rows, and its k iterations run through one ring across tiles.
// - Producer (copies only): cp.async of the activation tile straight into its 128-byte-swizzled slot, and of the
//   packed weight and its block scales into a small "raw" ring; each lands on an mbarrier (cp.async ... noinc).
// - Consumers: wgmma m64nBNk16 with both operands in shared memory (SS): warpgroup c multiplies tokens
//   64c..64c+63 of slot `it` by all BN weight rows. While those wgmma run, each consumer thread decodes one weight
//   row of iteration it + AHEAD from the raw ring into that slot (bf16, the same swizzled layout), fences it into
//   the async proxy and arrives on the slot's full barrier. No register the wgmma read is written meanwhile
//   (both operands are in shared memory), so ptxas keeps them asynchronous: the decode runs in their shadow.
// - Epilogue from the accumulators, staged through shared memory; the producer refills the ring meanwhile.
// The tensor cores see the shared-memory traffic of a bf16 GEMM of this tile (the decoded tile replaces the
// copied bf16 weight tile).
//
// Decode, per 32-bit word q of 4 packed bytes (high nibble = the even k) and byte b: see w4a16_wgmma.cu (3 integer
// instructions and one bf16x2 multiply per two weights, exact; the 2^-10 it leaves is undone in the epilogue).

#ifndef DIAG
#define DIAG 0                       // probe-only, wrong results: 1 = no decode, 2 = no wgmma, 4 = no output stores
#endif
#define BT (64 * MI * NCW)           // tokens per tile: MI wgmma of 64 tokens per consumer warpgroup
#define SEG (128 * NCW / BN)         // consumer threads per decoded weight row (1 or 2): each decodes 8/SEG chunks
#define CPT (8 / SEG)                // 16-byte chunks (8 k) each consumer thread decodes per k tile
#define NT (128 + 128 * NCW)         // threads per CTA: the producer warpgroup, then NCW consumer warpgroups
#define X_BYTES (BT * 128)           // activation tile: BT tokens x 64 k, 128B-swizzled
#define W_BYTES (BN * 128)           // decoded weight tile: BN rows x 64 k, 128B-swizzled
#define SLOT_BYTES (X_BYTES + W_BYTES)
#define RAW_BYTES (BN * 36)          // packed weight (BN rows x 32 B, stored chunk-major) + block scales (BN x 4 B)
#define RPT (BN / 128)               // weight rows per producer thread
#define EPI_PITCH 80                 // epilogue staging row: 32 bf16 + 16 B (pair stores of 8 rows hit 32 banks)
#define EPI_BYTES (64 * EPI_PITCH)   // per consumer warpgroup: 64 tokens x 32 weight rows

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
static __device__ __forceinline__ void cp_async4(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
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
static __device__ __forceinline__ void st_shared_u32(u32 addr, u32 v) {
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
static __device__ __forceinline__ void named_barrier(int id) {   // one consumer warpgroup
    asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory");
}
static __device__ __forceinline__ u32 ld_shared_u32(u32 addr) {
    u32 v;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr));
    return v;
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
    m0 = (first + r % gm) * BT;
    n0 = (r / gm) * BN;
}

extern "C" __global__ void __launch_bounds__(NT, 1) KERNEL_NAME(
    const u16* __restrict__ x, const u8* __restrict__ wp, const u8* __restrict__ wsc, const float* __restrict__ g,
    const u16* __restrict__ bias, u16* __restrict__ y, int M, int N, int K, int ldx, int ncb4) {
    extern __shared__ __align__(1024) u8 smem_raw[];
    u8* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);   // 1024-aligned (the swizzle atom)
    const u32 slots = smem_addr(smem);
    const u32 raws = slots + STAGES * SLOT_BYTES;
    const u32 epis = raws + RSTAGES * RAW_BYTES;
    // full[s]: slot s holds its activations and its decoded weights; empty[s]: the wgmma reading slot s are done;
    // rawfull[r]: raw slot r landed; rawempty[r]: raw slot r was decoded
    __shared__ __align__(8) u64 bars[2 * STAGES + 2 * RSTAGES];
    const u32 full0 = smem_addr(bars), empty0 = full0 + 8 * STAGES;
    const u32 rawfull0 = empty0 + 8 * STAGES, rawempty0 = rawfull0 + 8 * RSTAGES;

    const int tid = threadIdx.x;
    const int KT = K >> 6;                               // k tiles per output tile
    const int num_mt = (M + BT - 1) / BT, num_nt = N / BN;
    const int my_tiles = (num_mt * num_nt - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
    const int total = my_tiles * KT;                     // k iterations of this CTA, over all its tiles

    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full0 + 8 * s, 128 + 128 * NCW);   // producer copies landed + every consumer's decode stored
            mbar_init(empty0 + 8 * s, 4 * NCW);          // every consumer warp's wgmma reading the slot done
        }
#pragma unroll
        for (int r = 0; r < RSTAGES; ++r) {
            mbar_init(rawfull0 + 8 * r, 128);
            mbar_init(rawempty0 + 8 * r, 4 * NCW);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (tid < 128) {
        // ============================ producer: copies only ============================
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
        const int half = K >> 1;
        const int lq = tid & 7, lr = tid >> 3;           // activation chunk lq of rows lr + 16 i
        const u32 x_dst = lr * 128 + ((lq ^ (lr & 7)) << 4);
        int u = 0;
#pragma unroll 1
        for (int j = 0; j < my_tiles; ++j) {
            int m0, n0;
            tile_coords(blockIdx.x + j * gridDim.x, num_mt, num_nt, m0, n0);
            // activation rows m0 + lr + 16 i; rows past M re-read row M-1 (never stored)
            const u8* xrow0 = (const u8*)(x + (size_t)(m0 + lr) * ldx) + lq * 16;
            const u8* xlast = (const u8*)(x + (size_t)(M - 1) * ldx) + lq * 16;
            const size_t xstep = (size_t)16 * ldx * 2;
            const int rows_left = M - m0 - lr;
            const u8* wsrc[RPT];
            const u8* ssrc[RPT];
#pragma unroll
            for (int r = 0; r < RPT; ++r) {
                const int n = n0 + tid + 128 * r;
                wsrc[r] = wp + (size_t)n * half;
                ssrc[r] = wsc + (size_t)(n >> 7) * ncb4 * 512 + (n & 31) * 16 + ((n & 127) >> 5) * 4;
            }
#pragma unroll 1
            for (int kt = 0; kt < KT; ++kt, ++u) {
                // the packed weight rows tid + 128 r and their block scales -> raw slot u % RSTAGES
                const int rs = u % RSTAGES;
                if (u >= RSTAGES) mbar_wait(rawempty0 + 8 * rs, ((u / RSTAGES) - 1) & 1);
                const u32 rb = raws + rs * RAW_BYTES;
#pragma unroll
                for (int r = 0; r < RPT; ++r) {
                    const int p = tid + 128 * r;
                    cp_async16(rb + p * 16, wsrc[r] + kt * 32);
                    cp_async16(rb + (BN + p) * 16, wsrc[r] + kt * 32 + 16);
                    cp_async4(rb + BN * 32 + p * 4, ssrc[r] + kt * 512);
                }
                cp_async_mbar_arrive(rawfull0 + 8 * rs);
                // the activation tile -> slot u % STAGES
                const int slot = u % STAGES;
                if (u >= STAGES) mbar_wait(empty0 + 8 * slot, ((u / STAGES) - 1) & 1);
                const u32 sb = slots + slot * SLOT_BYTES;
#pragma unroll
                for (int i = 0; i < BT / 16; ++i)
                    cp_async16(sb + x_dst + i * 16 * 128, (16 * i < rows_left ? xrow0 + i * xstep : xlast) + kt * 128);
                cp_async_mbar_arrive(full0 + 8 * slot);
            }
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");   // no copy outlives its thread
    } else {
        // ============== consumers: wgmma on slot it, decode of slot it + AHEAD in its shadow ==============
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));
        const int c = (tid - 128) >> 7, t = tid & 127;
        const int warp = t >> 5, lane = t & 31;
        const int p = (c * 128 + t) % BN;                // the weight row of the tile this thread decodes,
        const int seg = (c * 128 + t) / BN;              // its k chunks seg * CPT .. seg * CPT + CPT - 1
        const float mult = g[0] * 1024.f;

        // decode iteration u's weight row p (raw slot u % RSTAGES) into slot u % STAGES, in three steps so the
        // chunks can go between the wgmma issues: begin (wait for the raw copies and the free slot, load),
        // chunks(h) (k chunks 2h, 2h+1), end (fence into the async proxy, arrive)
        u32 q[CPT], sc[CPT / 2], row = 0, dec_slot = 0;
        auto decode_begin = [&](int u) {
            const int rs = u % RSTAGES;
            dec_slot = u % STAGES;
            mbar_wait(rawfull0 + 8 * rs, (u / RSTAGES) & 1);
            if (u >= STAGES) mbar_wait(empty0 + 8 * dec_slot, ((u / STAGES) - 1) & 1);
            const u32 rb = raws + rs * RAW_BYTES;
            const uint4 v0 = ld_shared_v4(rb + (seg * (CPT / 4) * BN + p) * 16);
            uint4 v1 = v0;
            if (CPT == 8) v1 = ld_shared_v4(rb + (BN + p) * 16);
            const u32 s = ld_shared_u32(rb + BN * 32 + p * 4) >> (16 * seg);   // E4M3 scales of its k16 steps
            __syncwarp();
            if (lane == 0) mbar_arrive(rawempty0 + 8 * rs);
            const u32 f01 = scale_pair(s);
            sc[0] = prmt(f01, f01, 0x1010u); sc[1] = prmt(f01, f01, 0x3232u);
            if (CPT == 8) {
                const u32 f23 = scale_pair(s >> 16);
                sc[CPT / 2 - 2] = prmt(f23, f23, 0x1010u); sc[CPT / 2 - 1] = prmt(f23, f23, 0x3232u);
            }
            q[0] = v0.x; q[1] = v0.y; q[2] = v0.z; q[3] = v0.w;
            if (CPT == 8) { q[CPT - 4] = v1.x; q[CPT - 3] = v1.y; q[CPT - 2] = v1.z; q[CPT - 1] = v1.w; }
            row = slots + dec_slot * SLOT_BYTES + X_BYTES + p * 128;
        };
        auto decode_chunks = [&](const int h) {                           // k16 step h's share of the chunks
            if (DIAG & 1) return;
#pragma unroll
            for (int i = h * CPT / 4; i < (h + 1) * CPT / 4; ++i) {       // chunk i: k 8 (seg CPT + i) .. + 7
                const u32 q4 = q[i] << 4, f = sc[i >> 1];
                st_shared_v4(row + (((seg * CPT + i) ^ (p & 7)) << 4), bf16x2_mul(e2m1x2(q[i], q4, 0), f),
                             bf16x2_mul(e2m1x2(q[i], q4, 1), f), bf16x2_mul(e2m1x2(q[i], q4, 2), f),
                             bf16x2_mul(e2m1x2(q[i], q4, 3), f));
            }
        };
        auto decode_end = [&]() {
            fence_async_smem();                                            // decoded stores -> the tensor cores
            mbar_arrive(full0 + 8 * dec_slot);
        };

        float d[MI * BN / 2];                            // MI accumulator sets of 64 tokens x BN weight rows
#pragma unroll
        for (int i = 0; i < MI * BN / 2; ++i) d[i] = 0.f;
#pragma unroll 1
        for (int u = 0; u < AHEAD && u < total; ++u) {
            decode_begin(u);
#pragma unroll
            for (int h = 0; h < 4; ++h) decode_chunks(h);
            decode_end();
        }
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
                const bool dec = it + AHEAD < total;
                wgmma_fence();
#pragma unroll
                for (int s = 0; s < 4; ++s) {          // wgmma k16 step s, then two chunks of the decode ahead
                    if (!(DIAG & 2)) {
#pragma unroll
                        for (int mi = 0; mi < MI; ++mi)
                            wgmma_ss(d + mi * BN / 2, desc_sw128(sb + (c * MI + mi) * 64 * 128 + s * 32),
                                     desc_sw128(sb + X_BYTES + s * 32), (kt | s) != 0);
                    }
                    if (dec) {
                        if (s == 0) decode_begin(it + AHEAD);
                        decode_chunks(s);
                    }
                }
                wgmma_commit();
                if (dec) decode_end();
                wgmma_wait<1>();
                if (kt > 0 && lane == 0) mbar_arrive(empty0 + 8 * ((it - 1) % STAGES));
            }
            wgmma_wait<0>();
            if (lane == 0) mbar_arrive(empty0 + 8 * ((it - 1) % STAGES));
            // epilogue: d[i] is (token 16 warp + lane/4 + 8 ((i/2)%2), weight row 8 (i/4) + 2 (lane%4) + i%2).
            // Staged through shared memory 32 weight rows at a time (the ring has the rest), so each warp's global
            // stores are 64-byte runs of 8 tokens instead of 16-byte runs of 8 tokens
            const u32 stage = epis + c * EPI_BYTES;
            const int srow = warp * 16 + (lane >> 2), scol = 2 * (lane & 3);
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
                const float* dm = d + mi * BN / 2;
                const int mt0 = m0 + (c * MI + mi) * 64;
#pragma unroll
                for (int ch = 0; ch < BN / 32; ++ch) {
#pragma unroll
                    for (int gi = 0; gi < 4; ++gi) {
                        const int i0 = 4 * (4 * ch + gi);
                        float bias0 = 0.f, bias1 = 0.f;
                        if (HAS_BIAS) {
                            const u32 bb = *(const u32*)(bias + n0 + 8 * (4 * ch + gi) + scol);
                            bias0 = __uint_as_float(bb << 16);
                            bias1 = __uint_as_float(bb & 0xFFFF0000u);
                        }
#pragma unroll
                        for (int h = 0; h < 2; ++h)
                            st_shared_u32(stage + (srow + 8 * h) * EPI_PITCH + (gi * 8 + scol) * 2,
                                          pack_bf16x2(dm[i0 + 2 * h] * mult + bias0,
                                                      dm[i0 + 2 * h + 1] * mult + bias1));
                    }
                    named_barrier(1 + c);
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const int idx = t + 128 * r, row = idx >> 2, q = idx & 3;
                        const uint4 v = ld_shared_v4(stage + row * EPI_PITCH + q * 16);
                        const int m = mt0 + row;
                        if (m < M && (!(DIAG & 4) || v.x == 12345u))
                            *(uint4*)(y + (size_t)m * N + n0 + 32 * ch + 8 * q) = v;
                    }
                    named_barrier(1 + c);
                }
            }
        }
    }
}
