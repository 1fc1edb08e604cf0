//! needs:
// flashjit prelude: self-contained, no CUDA or C++ headers, so NVRTC 12 and 13 parse it
// identically and fast. Fixed-width types, 16-bit float conversions, cp.async, math helpers.
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#define FJ_INLINE __device__ __forceinline__

// Per-CTA %globaltimer stamps for benchmarks/cta_timeline.py, compiled in only with -DFJ_TIMELINE:
// 0 entry, 1 first tile resident, 2 last tile consumed, 3 exit, of CTA (x, y, z) in grid order;
// slot 4 is the SM the CTA ran on (written at entry).
#ifdef FJ_TIMELINE
#define FJ_TIMELINE_CTAS 65536
__device__ unsigned long long fj_timeline[FJ_TIMELINE_CTAS][5];
#define FJ_STAMP(i)                                                                                   \
  do {                                                                                                \
    const unsigned cta_ = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);             \
    if (threadIdx.x + threadIdx.y + threadIdx.z == 0 && cta_ < FJ_TIMELINE_CTAS) {                    \
      unsigned long long now_;                                                                        \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now_));                                         \
      fj_timeline[cta_][i] = now_;                                                                    \
      if (i == 0) {                                                                                   \
        unsigned sm_;                                                                                 \
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm_));                                               \
        fj_timeline[cta_][4] = sm_;                                                                   \
      }                                                                                               \
    }                                                                                                 \
  } while (0)
#else
#define FJ_STAMP(i) do {} while (0)
#endif

// Programmatic dependent launch (sm_90 and later; nothing below). The engine launches every entry
// point with programmatic stream serialization (kernel.PreparedLaunch), so its CTAs may start
// while the stream's previous kernel finishes: each entry point calls this before its first global
// access (FJ_STAMP's diagnostic stamps aside, and the merge's reads of the plan's arrays, which the
// decode kernel it waits for does not write), to wait for that kernel's writes, then lets the next
// kernel in the stream start launching, whose CTAs wait the same way while this one runs.
FJ_INLINE void wait_for_previous_kernel() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Orders this thread's writes to shared memory (stores, cp.async copies) before reads of the async
// proxy (wgmma's operands) in threads that a later barrier orders after it (sm_90 and later).
FJ_INLINE void fence_async_proxy() {
#if __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

#define FJ_NEG_INF __int_as_float(0xff800000u)
#define FJ_LN2 0.69314718055994530942f
#define FJ_LOG2E 1.44269504088896340736f

namespace fj {

// 16-bit float storage types. Values are moved as raw bits and converted in registers.
struct half_t { u16 bits; };
struct bfloat16_t { u16 bits; };

template <typename T> struct Convert;

template <> struct Convert<half_t> {
  FJ_INLINE static float to_float(u16 h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
  FJ_INLINE static u16 from_float(float f) { u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
  // Two packed values (low half first) to floats.
  FJ_INLINE static void unpack2(u32 w, float& lo, float& hi) {
    lo = to_float((u16)(w & 0xffffu)); hi = to_float((u16)(w >> 16));
  }
};

template <> struct Convert<bfloat16_t> {
  FJ_INLINE static float to_float(u16 b) { return __uint_as_float(((u32)b) << 16); }
  FJ_INLINE static u16 from_float(float f) { u16 b; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(f)); return b; }
  FJ_INLINE static void unpack2(u32 w, float& lo, float& hi) {
    lo = __uint_as_float(w << 16); hi = __uint_as_float(w & 0xffff0000u);
  }
};

// Eight 16-bit values (one 16-byte vector) to floats.
template <typename T>
FJ_INLINE void unpack8(const uint4& v, float* out) {
  Convert<T>::unpack2(v.x, out[0], out[1]);
  Convert<T>::unpack2(v.y, out[2], out[3]);
  Convert<T>::unpack2(v.z, out[4], out[5]);
  Convert<T>::unpack2(v.w, out[6], out[7]);
}

template <typename T>
FJ_INLINE uint4 pack8(const float* in) {
  uint4 v;
  v.x = (u32)Convert<T>::from_float(in[0]) | ((u32)Convert<T>::from_float(in[1]) << 16);
  v.y = (u32)Convert<T>::from_float(in[2]) | ((u32)Convert<T>::from_float(in[3]) << 16);
  v.z = (u32)Convert<T>::from_float(in[4]) | ((u32)Convert<T>::from_float(in[5]) << 16);
  v.w = (u32)Convert<T>::from_float(in[6]) | ((u32)Convert<T>::from_float(in[7]) << 16);
  return v;
}

FJ_INLINE float exp2_approx(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
FJ_INLINE float log2_approx(float x) { float y; asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }

// cap * tanh(x / cap), the soft-capping of attention variants, through the hardware's tanh (one
// special-function op, relative error at most 2^-11, saturating to +-1 for any finite x). The
// reciprocal of the loop-invariant cap is hoisted out of the key loop, so a score costs two
// multiplies and the tanh: the kernel's other special-function op per score is its exp2.
FJ_INLINE float tanh_approx(float x) { float y; asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
FJ_INLINE float soft_cap(float x, float cap) { return cap * tanh_approx(x * (1.f / cap)); }

// 16-byte global->shared copy that bypasses L1. src_bytes == 0 writes zeros and reads nothing.
// L2_PREFETCH (0, 128 or 256): bytes the L2 fetches around the copy (0: no hint).
// dst: a shared-memory address (__cvta_generic_to_shared), which a loop can compute once.
template <int L2_PREFETCH = 128>
FJ_INLINE void cp_async_16(u32 dst, const void* gmem, bool pred) {
  int src_bytes = pred ? 16 : 0;
  if constexpr (L2_PREFETCH == 256)
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(gmem), "r"(src_bytes));
  else if constexpr (L2_PREFETCH == 128)
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(gmem), "r"(src_bytes));
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(gmem), "r"(src_bytes));
}
FJ_INLINE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> FJ_INLINE void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

template <int A, int B> struct Max { static constexpr int value = A > B ? A : B; };
template <int A, int B> struct Min { static constexpr int value = A < B ? A : B; };
__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int pow2_ceil(int x) { return x <= 1 ? 1 : 2 * pow2_ceil((x + 1) / 2); }

}  // namespace fj
