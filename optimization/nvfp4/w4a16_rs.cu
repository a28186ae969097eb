// Fused NVFP4-weight x bf16-activation GEMM for Hopper (sm_90a), large M: y[M, N] = x[M, K] @ dequant(W)[N, K]^T.
// Compiled at run time by NVRTC (rs_w4a16.py fills in the #defines and the wgmma wrapper); no CUDA headers.
//
// Swap AB as in w4a16_wgmma.cu: each consumer warpgroup computes y^T for 64 weight rows x TN tokens with wgmma
// m64nTNk16, the weight decoded straight into the A-operand registers (RS: the decoded weight never touches shared
// or global memory) and the activations as the B operand, TMA-copied into 128-byte-swizzled shared memory.
//
// Persistent and warp-specialized, one CTA per SM (384 threads):
// - producer warpgroup (40 registers): one thread runs the ring of STAGES slots; per k tile (64 k) it copies the
//   activation tile (TN tokens, TMA), the packed weight tile (128 rows x 32 bytes, TMA) and its 512 bytes of block
//   scales (one bulk copy: the 128x4 swizzled scale layout keeps a 128-row x 64-k tile contiguous);
// - two consumer warpgroups (232 registers) run the wgmma and the decode. Per k tile, 4 k16 steps s: issue wgmma s,
//   commit, wait until at most 3 groups are pending, decode step s + 1 into its own 4 A registers (step 0 of the
//   next k tile after step 3). The decode thus runs in the shadow of 3 queued wgmma groups, and each A register set
//   is rewritten only after the wgmma that read it has completed (4 sets, groups complete in order). Each set is
//   also read right before it is rewritten, which keeps the 4 sets in distinct registers: NVRTC's ptxas otherwise
//   may give one set the registers of another that a pending wgmma still reads, and then serializes every wgmma.
//   The slot of k tile t - 1 is released at step 2 of k tile t (its last wgmma is done by then).
// - epilogue (both consumer warpgroups): accumulators x global scale x 2^10 (+ bias) -> bf16, stmatrix.trans into
//   a staging tile, one TMA store (L2 evict_first); the next tile starts while it runs.
//
// Work split: tiles of 128 weight rows x TN tokens, token-tile-major (the weight tiles of one token tile are
// consecutive, so the activation tile is re-read from L2 while hot). The first DP_TILES tiles go round-robin to the
// G CTAs (data-parallel rounds). The rest, SK_TILES < G tiles that would leave most SMs idle in a last round, are
// split by k tiles ("stream-K"): their SK_TILES x KT k tiles are cut into G_SK equal contiguous ranges, one per
// CTA. A CTA whose range holds the end of a tile finishes it: it waits for the fp32 partial sums of the CTAs that
// did the tile's earlier k tiles (flags), adds them, and stores. The others write their partial to a workspace slot
// of their own and set their flag. A CTA does its range's tiles last to first, so the partial it writes is its first
// item and the tile it finishes its last: every wait is for a lower-numbered CTA's first item, which that CTA reaches
// without waiting for anyone. CTAs start in index order and the grid is at most one CTA per SM, so a waiting CTA's
// predecessors are running (or done) and the waits end.
//
// Decode, per 32-bit word q of 4 packed bytes (high nibble = the even k) and byte b: see sm90_common.cuh (3 integer
// instructions and one bf16x2 multiply per two weights, exact, subnormal block scales included; the 2^-10 it leaves
// is undone in the epilogue together with the global scale).

#define BN 128                       // weight rows per tile: 64 per consumer warpgroup
#define NT 384                       // threads: the producer warpgroup, then the two consumer warpgroups
#define X_BYTES (TN * 128)           // activation tile: TN tokens x 64 k, bf16, 128B-swizzled
#define W_BYTES (BN * 32)            // packed weight tile: BN rows x 64 k, 4 bit, row-major (32 B a row)
#define S_BYTES 512                  // block scales of the tile: 128 rows x 4 (swizzled 32 x 16 B)
#define SLOT_BYTES ((X_BYTES + W_BYTES + S_BYTES + 1023) / 1024 * 1024)
#define EPI_BYTES (TN * 128)         // per consumer warpgroup: the TN tokens x 64 weight rows of a tile, bf16
#define PART_FLOATS (256 * TN / 2)   // a partial tile in the workspace: 256 consumer threads x TN/2 accumulators

// the shared helpers (u32 ..., prmt, e2m1x2, scale_pair, desc_sw128, mbarriers, wgmma fences): sm90_common.cuh
struct __align__(64) TensorMap { u64 v[16]; };   // CUtensorMap, filled by the host (cuTensorMapEncodeTiled)

// TMA: box at (inner coordinate c0, row c1) -> shared dst, completing its bytes on the mbarrier
static __device__ __forceinline__ void tma_load_2d(u32 dst, const TensorMap* map, int c0, int c1, u32 bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
                 ::"r"(dst), "l"((u64)map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}
// a contiguous block of `bytes` (multiple of 16) from global memory
static __device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
static __device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
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
// TMA store of the box at (inner coordinate c0, row c1) from shared src with L2 policy pol (rows past the tensor's
// end are dropped)
static __device__ __forceinline__ void tma_store_2d(const TensorMap* map, int c0, int c1, u32 src, u64 pol) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group.L2::cache_hint [%0, {%1, %2}], [%3], %4;\n"
                 ::"l"((u64)map), "r"(c0), "r"(c1), "r"(src), "l"(pol) : "memory");
}
static __device__ __forceinline__ u64 policy_evict_first() {
    u64 p;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
    return p;
}
static __device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
static __device__ __forceinline__ void bulk_wait_read() {      // this thread's stores have read their sources
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
static __device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
static __device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
static __device__ __forceinline__ u32 ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
static __device__ __forceinline__ void st_release(u32* p, u32 v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
static __device__ __forceinline__ void consumers_barrier() {     // both consumer warpgroups
    asm volatile("bar.sync 3, 256;\n" ::: "memory");
}
static __device__ __forceinline__ void named_barrier(int id) {   // one consumer warpgroup
    asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory");
}
static __device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// generated by rs_w4a16.py (wgmma_w4a16.wgmma_call): static __device__ void wgmma_bm(float* d, u32 a0..a3, u64 desc)
//%%WGMMA%%

// the work a CTA does, in order: its data-parallel tiles, then its stream-K range's tiles last to first
struct Sched {
    int num_nt, KT, dp_items, dp_tiles, sk_tiles, g_sk;
    int u0, u1, t_first, t_last;     // this CTA's stream-K range of k tiles [u0, u1), its tiles (of the SK tiles)

    __device__ void init(int num_nt_, int KT_, int dp_tiles_, int sk_tiles_, int g_sk_, int cta) {
        num_nt = num_nt_, KT = KT_, dp_tiles = dp_tiles_, sk_tiles = sk_tiles_, g_sk = g_sk_;
        dp_items = cta < dp_tiles ? (dp_tiles - cta + gridDim.x - 1) / gridDim.x : 0;
        u0 = cta < g_sk ? range_start(cta) : 0;
        u1 = cta < g_sk ? range_start(cta + 1) : 0;
        t_first = u0 / KT;
        t_last = u1 > u0 ? (u1 - 1) / KT : t_first - 1;
    }
    __device__ int range_start(int b) const { return (int)((long long)b * sk_tiles * KT / g_sk); }
    __device__ int items() const { return dp_items + (t_last - t_first + 1); }
    // item i -> tile coordinates, k tiles [kb, ke); fin: this CTA stores the tile; prior: other CTAs did its
    // k tiles [0, kb) (only when fin)
    __device__ void item(int i, int& m0, int& n0, int& kb, int& ke) const {
        int tile;
        if (i < dp_items) {
            tile = blockIdx.x + i * gridDim.x;
            kb = 0;
            ke = KT;
        } else {
            const int t = t_last - (i - dp_items), t0 = t * KT;
            kb = max(u0, t0) - t0;
            ke = min(u1, t0 + KT) - t0;
            tile = dp_tiles + t;
        }
        m0 = (tile / num_nt) * TN;
        n0 = (tile % num_nt) * BN;
    }
};

extern "C" __global__ void __launch_bounds__(NT, 1) KERNEL_NAME(
    const __grid_constant__ TensorMap xmap, const __grid_constant__ TensorMap wmap,
    const __grid_constant__ TensorMap ymap, const u8* __restrict__ wsc, const float* __restrict__ g,
    const u16* __restrict__ bias, float* __restrict__ ws, u32* __restrict__ flags, int M, int N, int K, int ncb4,
    int dp_tiles, int sk_tiles, int g_sk) {
    extern __shared__ __align__(1024) u8 smem_raw[];
    u8* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);   // 1024-aligned (the swizzle atom)
    const u32 slots = smem_addr(smem);
    const u32 epis = slots + STAGES * SLOT_BYTES;
    // full[s]: the three copies into slot s landed; empty[s]: every consumer warp is done with slot s
    __shared__ __align__(8) u64 bars[2 * STAGES];
    const u32 full0 = smem_addr(bars), empty0 = full0 + 8 * STAGES;

    const int tid = threadIdx.x;
    Sched sc;
    sc.init(N / BN, K >> 6, dp_tiles, sk_tiles, g_sk, blockIdx.x);
    const int n_items = sc.items();

    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full0 + 8 * s, 1);                     // the producer's expect_tx; the copies' bytes complete it
            mbar_init(empty0 + 8 * s, 8);                    // the 8 consumer warps
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (tid < 128) {
        // ===================================== producer =====================================
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (tid == 0) {
            asm volatile("prefetch.tensormap [%0];\n" ::"l"((u64)&xmap) : "memory");
            asm volatile("prefetch.tensormap [%0];\n" ::"l"((u64)&wmap) : "memory");
            int slot = 0, phase = 0, u = 0;
#pragma unroll 1
            for (int i = 0; i < n_items; ++i) {
                int m0, n0, kb, ke;
                sc.item(i, m0, n0, kb, ke);
                const u8* srow = wsc + (size_t)(n0 >> 7) * ncb4 * 512;
#pragma unroll 1
                for (int kt = kb; kt < ke; ++kt, ++u) {
                    if (u >= STAGES) mbar_wait(empty0 + 8 * slot, phase ^ 1);
                    const u32 sb = slots + slot * SLOT_BYTES, bar = full0 + 8 * slot;
                    mbar_expect_tx(bar, X_BYTES + W_BYTES + S_BYTES);
                    tma_load_2d(sb, &xmap, kt * 64, m0, bar);
                    tma_load_2d(sb + X_BYTES, &wmap, kt * 32, n0, bar);
                    bulk_load(sb + X_BYTES + W_BYTES, srow + kt * 512, S_BYTES, bar);
                    if (++slot == STAGES) {
                        slot = 0;
                        phase ^= 1;
                    }
                }
            }
        }
    } else {
        // ===================================== consumers =====================================
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
        const int c = (tid >> 7) - 1, t = tid & 127, ct = tid - 128;
        const int warp = t >> 5, lane = t & 31, q = lane & 3;
        const int rl = 16 * warp + (lane >> 2);          // this thread's rows rl, rl + 8 of the warpgroup's 64
        const int r0 = 64 * c + rl;                      // ... of the 128-row tile
        const u32 sel_c = q | ((q + 4) << 4);
        const u32 s_off0 = X_BYTES + W_BYTES + (r0 & 31) * 16 + ((r0 >> 5) & 3) * 4;
        const u32 s_off1 = X_BYTES + W_BYTES + ((r0 + 8) & 31) * 16 + (((r0 + 8) >> 5) & 3) * 4;
        const u32 w_off0 = X_BYTES + r0 * 32, w_off1 = w_off0 + 8 * 32;
        const float mult = g[0] * 1024.f;
        int total = 0;                                   // k tiles this CTA runs
        for (int i = 0; i < n_items; ++i) {
            int m0, n0, kb, ke;
            sc.item(i, m0, n0, kb, ke);
            total += ke - kb;
        }

        float d[TN / 2];                                 // 64 weight rows x TN tokens
        u32 a[16] = {};                                  // A registers of the 4 k16 steps of a k tile
        u32 qa[2], qb[2], pa[4], pb[4];                  // this k tile's packed bytes and scale pairs
        u32 live = 0;                                    // see decode: never 0x9E3779B9 in practice, stored if so

        // a k tile's packed bytes of rows r0, r0 + 8 and their block scales, from slot base sb. (Loading them two
        // steps earlier into registers of their own measured 2-6 % slower: rs_probe, f27fdb7.)
        auto prep = [&](u32 sb) {
            const uint4 v0 = ld_shared_v4(sb + w_off0), v1 = ld_shared_v4(sb + w_off0 + 16);
            const uint4 w0 = ld_shared_v4(sb + w_off1), w1 = ld_shared_v4(sb + w_off1 + 16);
            // byte q of each 4-byte chunk (chunk j = k 8j..8j+7): the k pairs 2q, 2q+1 of this thread's fragment
            qa[0] = prmt(prmt(v0.x, v0.y, sel_c), prmt(v0.z, v0.w, sel_c), 0x5410u);
            qa[1] = prmt(prmt(v1.x, v1.y, sel_c), prmt(v1.z, v1.w, sel_c), 0x5410u);
            qb[0] = prmt(prmt(w0.x, w0.y, sel_c), prmt(w0.z, w0.w, sel_c), 0x5410u);
            qb[1] = prmt(prmt(w1.x, w1.y, sel_c), prmt(w1.z, w1.w, sel_c), 0x5410u);
            const u32 sa = ld_shared_u32(sb + s_off0), sv = ld_shared_u32(sb + s_off1);
            const u32 fa01 = scale_pair(sa), fa23 = scale_pair(sa >> 16);
            const u32 fb01 = scale_pair(sv), fb23 = scale_pair(sv >> 16);
            pa[0] = prmt(fa01, fa01, 0x1010u); pa[1] = prmt(fa01, fa01, 0x3232u);
            pa[2] = prmt(fa23, fa23, 0x1010u); pa[3] = prmt(fa23, fa23, 0x3232u);
            pb[0] = prmt(fb01, fb01, 0x1010u); pb[1] = prmt(fb01, fb01, 0x3232u);
            pb[2] = prmt(fb23, fb23, 0x1010u); pb[3] = prmt(fb23, fb23, 0x3232u);
        };
        // k16 step s of the prepped k tile -> a[4s .. 4s + 3] (chunks 2s: a0, a1; 2s + 1: a2, a3)
        auto decode = [&](const int s) {
            const int h = s >> 1, j = s & 1;
            const u32 qa4 = qa[h] << 4, qb4 = qb[h] << 4;
            // read the set's old values right before overwriting them: each set is then live from one decode to
            // the next, so ptxas keeps the 4 sets in distinct registers (it otherwise may give a set the registers
            // of one a pending wgmma still reads, and then serializes every wgmma: C7513). 2 LOP3 per set.
            live ^= a[4 * s] ^ a[4 * s + 1] ^ a[4 * s + 2] ^ a[4 * s + 3];
            a[4 * s + 0] = bf16x2_mul(e2m1x2(qa[h], qa4, 2 * j), pa[s]);
            a[4 * s + 1] = bf16x2_mul(e2m1x2(qb[h], qb4, 2 * j), pb[s]);
            a[4 * s + 2] = bf16x2_mul(e2m1x2(qa[h], qa4, 2 * j + 1), pa[s]);
            a[4 * s + 3] = bf16x2_mul(e2m1x2(qb[h], qb4, 2 * j + 1), pb[s]);
        };
        auto release = [&](int slot) {                   // every wgmma reading the slot is done
            if (lane == 0) mbar_arrive(empty0 + 8 * slot);
        };

        // the ring position of the current k tile (slot, the fill's phase) and of the previous one
        int slot = 0, phase = 0, pslot = 0;
        if (total > 0) {
            mbar_wait(full0, 0);
            prep(slots);
            decode(0);
        }
        int it = 0;
#pragma unroll 1
        for (int i = 0; i < n_items; ++i) {
            int m0, n0, kb, ke;
            sc.item(i, m0, n0, kb, ke);
#pragma unroll 1
            for (int kt = kb; kt < ke; ++kt, ++it) {
                // descriptor of the slot's token tile; k16 step s starts 32 bytes further (the start field is
                // address >> 4 and stays below 2^14 for any shared address, so adding 2 s never carries out)
                const u64 db = desc_sw128(slots + slot * SLOT_BYTES);
                const int nslot = slot + 1 == STAGES ? 0 : slot + 1, nphase = phase ^ (nslot == 0);
#pragma unroll
                for (int s = 0; s < 4; ++s) {
                    const u32 acc = (kt != kb) | (s != 0);
                    wgmma_fence();
                    wgmma_bm(d, a[4 * s], a[4 * s + 1], a[4 * s + 2], a[4 * s + 3], db + 2 * s, acc);
                    wgmma_commit();
                    wgmma_wait<3>();                     // the group 4 commits back is done: its A set is free
                    if (s == 2 && kt > kb) release(pslot);  // the previous k tile's last wgmma is done
                    if (s < 3) {
                        decode(s + 1);
                    } else if (it + 1 < total) {
                        mbar_wait(full0 + 8 * nslot, nphase);
                        prep(slots + nslot * SLOT_BYTES);
                        decode(0);
                    }
                }
                pslot = slot;
                slot = nslot;
                phase = nphase;
            }
            wgmma_wait<0>();
            release(pslot);

            if (i >= sc.dp_items) {
                // a partial tile in the workspace: float4 v of consumer thread ct at (v * 256 + ct) * 4 floats, so
                // that a warp's accesses are 512 contiguous bytes
                float* mine = ws + (size_t)blockIdx.x * PART_FLOATS + ct * 4;
                if (ke < sc.KT) {
                    // stream-K, not the tile's end: this CTA's partial sum to its workspace slot, then its flag
#pragma unroll
                    for (int v = 0; v < TN / 2; v += 4)
                        *(float4*)(mine + v * 256) = make_float4(d[v], d[v + 1], d[v + 2], d[v + 3]);
                    __threadfence();
                    consumers_barrier();
                    if (ct == 0) st_release(flags + blockIdx.x, 1u);
                    continue;
                }
                if (kb > 0) {
                    // stream-K, the tile's end: add the partials of the CTAs that did its k tiles [0, kb), each a
                    // lower-numbered CTA (its range ends where the next one's starts)
                    const int t0 = ((m0 / TN) * sc.num_nt + n0 / BN - sc.dp_tiles) * sc.KT;   // the tile's first unit
#pragma unroll 1
                    for (int b = blockIdx.x - 1; b >= 0; --b) {
                        // one thread polls, gently (256 threads a CTA polling the L2 slowed the partials' writes:
                        // 2x the time at M = 1024), and the barrier passes its acquire on to the others
                        if (ct == 0) {
                            while (ld_acquire(flags + b) != 1u) __nanosleep(100);
                        }
                        consumers_barrier();
                        const float* part = ws + (size_t)b * PART_FLOATS + ct * 4;
#pragma unroll
                        for (int v = 0; v < TN / 2; v += 4) {
                            const float4 p4 = *(const float4*)(part + v * 256);
                            d[v] += p4.x;
                            d[v + 1] += p4.y;
                            d[v + 2] += p4.z;
                            d[v + 3] += p4.w;
                        }
                        consumers_barrier();             // every thread has read b's partial: its flag goes back
                        if (ct == 0) flags[b] = 0u;      // to 0 for the next launch
                        if (sc.range_start(b) <= t0) break;
                    }
                }
            }
            // epilogue: d[i] is (weight row rl + 8 ((i/2)%2), token 8 (i/4) + 2 (lane%4) + i%2): per 8 tokens two 8x8
            // matrices of the mma fragment layout. stmatrix.trans puts them in this warpgroup's staging buffer as
            // [token][64 weight rows], 128 bytes a token, 16-byte chunks XOR-swizzled by token % 8 (TMA's 128-byte
            // swizzle); one thread then stores the whole TN x 64 tile by TMA and the warpgroup goes on with the next
            // tile while the copy runs (its staging buffer is reused only after the copy has read it).
            float b0 = 0.f, b1 = 0.f;
            if (HAS_BIAS) {
                b0 = __uint_as_float((u32)bias[n0 + r0] << 16);
                b1 = __uint_as_float((u32)bias[n0 + r0 + 8] << 16);
            }
            if (t == 0) bulk_wait_read();                // the previous tile's store has read the staging buffer
            named_barrier(1 + c);
            const u32 stage = epis + c * EPI_BYTES;
            const int ml = lane & 7, mk = lane >> 3;     // this lane's row of matrix mk in an stmatrix.x4
#pragma unroll
            for (int jg = 0; jg < TN / 8; jg += 2) {     // 8-token groups jg, jg + 1
                const float* da = d + 4 * jg;
                const float* dn = d + 4 * (jg + 1);
                const int tok = 8 * (jg + (mk >> 1)) + ml, chunk = 2 * warp + (mk & 1);
                stmatrix_x4_trans(stage + tok * 128 + ((chunk ^ ml) << 4),
                                  pack_bf16x2(da[0] * mult + b0, da[1] * mult + b0),
                                  pack_bf16x2(da[2] * mult + b1, da[3] * mult + b1),
                                  pack_bf16x2(dn[0] * mult + b0, dn[1] * mult + b0),
                                  pack_bf16x2(dn[2] * mult + b1, dn[3] * mult + b1));
            }
            fence_proxy_async();                         // these shared-memory writes -> the TMA store's reads
            named_barrier(1 + c);
            if (t == 0 && live != 0x9E3779B9u) {
                tma_store_2d(&ymap, n0 + 64 * c, m0, stage, policy_evict_first());   // not read again
                bulk_commit();
            }
        }
        if (t == 0) bulk_wait_all();                     // the last store is done before the CTA's memory goes
    }
}
