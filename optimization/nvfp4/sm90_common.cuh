// Device helpers shared by the Hopper NVFP4 kernels (w4a16_wgmma.cu, w4a16_rs.cu): their Python builders put this
// text in front of the kernel's own (NVRTC gets one source, no include paths).
//
// Decode, per 32-bit word q of 4 packed bytes (high nibble = the even k) and byte b, in 3 integer instructions:
//   z = prmt(q, q << 4, [b, sign(b), b+4, sign(b+4)])  -> [byte b, its high nibble's sign x8, lo nibble << 4, sign x8]
//   v = (z << 2) & 0x81C081C0                           -> bf16x2 [hi, lo] = E2M1 value x 2^-126, exact
// (the 3 magnitude bits land on the bf16's lowest exponent bits + top mantissa bit; code 1 = 0.5 becomes the
// subnormal 2^-127, so one multiply by scale x 2^116 gives value x scale x 2^-10 exactly, for every code).
// The E4M3 block scale becomes bf16 the same way: code << 4 is scale x 2^-120 (subnormal scales and zero included),
// times 2^118 twice. The 2^-10 is undone in the epilogue with the global scale (a power of two: sums are unchanged).

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;

static __device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
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
// two E4M3 scales (bytes 0, 1 of s) -> bf16x2 [s0, s1] x 2^116, exact (zero and subnormal scales included)
static __device__ __forceinline__ u32 scale_pair(u32 s) {
    const u32 two118 = 0x7A807A80u;
    return bf16x2_mul(bf16x2_mul(prmt(s, 0u, 0x4140u) << 4, two118), two118);
}
static __device__ __forceinline__ u64 desc_sw128(u32 addr) {
    // wgmma shared-memory descriptor, K-major, 128-byte swizzle: start >> 4, leading offset (unused) 1, stride
    // between 8-row groups 1024 B
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
