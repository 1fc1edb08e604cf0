//! needs: common/prelude.cuh
// K/V storage types: how one 16-byte chunk of a cache row turns into MMA operands or floats.
// 16-bit caches are used as stored; fp8 caches (OCP e4m3 / e5m2) are converted pairwise to f16 in
// registers, and their scales fold into the softmax scale and the epilogue, never per element.
//
// Expects from the including template: cfg::ARCH (e.g. 80, 90, 120).
namespace fj {

struct e4m3_t { unsigned char bits; };
struct e5m2_t { unsigned char bits; };

FJ_INLINE u32 prmt(u32 a, u32 b, u32 select) {
  u32 r; asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(select)); return r;
}

// Four fp8 values (byte 0 first) to two f16x2 words: lo <- bytes 0, 1; hi <- bytes 2, 3.
// The f16 values are the fp8 values divided by UNIT (the scales multiply it back once).
template <typename T> struct Fp8;

template <> struct Fp8<e5m2_t> {
  static constexpr float UNIT = 1.f;
  // e5m2 is an f16 with the low mantissa byte cut off: moving each byte up is exact on every arch.
  FJ_INLINE static void to_f16x4(u32 w, u32& lo, u32& hi) { lo = prmt(w, 0u, 0x1404u); hi = prmt(w, 0u, 0x3424u); }
};

template <> struct Fp8<e4m3_t> {
  static constexpr bool NATIVE = cfg::ARCH >= 89;  // cvt.rn.f16x2.e4m3x2: sm_89 and later
  // Without it the bits are re-biased in place (exponent bias 7 -> 15), which divides by 2^8.
  static constexpr float UNIT = NATIVE ? 1.f : 256.f;
  FJ_INLINE static void to_f16x4(u32 w, u32& lo, u32& hi) {
    if constexpr (NATIVE) {
      asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}"
          : "=r"(lo), "=r"(hi) : "r"(w));
    } else {
      const u32 a = prmt(w, 0u, 0x1404u), b = prmt(w, 0u, 0x3424u);  // each byte in its half's top byte
      lo = (a & 0x80008000u) | ((a & 0x7f007f00u) >> 1);               // sign stays, exponent+mantissa down 1
      hi = (b & 0x80008000u) | ((b & 0x7f007f00u) >> 1);
    }
  }
  // Two values (byte 0 first) to one f16x2 word, exactly; the queries' conversion, which has no UNIT.
  FJ_INLINE static u32 to_f16x2(unsigned short w) {  // NATIVE only (load_query_pair asserts it)
    u32 r; asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(w)); return r;
  }
};

// What the kernels ask of a K/V storage type.
//   mma_t      the 16-bit type the tensor-core kernel multiplies in
//   UNIT       stored value = true value / UNIT (folded into the scales)
//   load8()    eight consecutive values from shared memory as floats
template <typename T> struct Kv {
  using mma_t = T;
  static constexpr bool FP8 = false;
  static constexpr float UNIT = 1.f;
  FJ_INLINE static void load8(const unsigned char* p, float* out) {
    unpack8<T>(*reinterpret_cast<const uint4*>(p), out);
  }
};

template <typename T> struct KvFp8 {
  using mma_t = half_t;
  static constexpr bool FP8 = true;
  static constexpr float UNIT = Fp8<T>::UNIT;
  FJ_INLINE static void load8(const unsigned char* p, float* out) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    const u32 words[2] = {raw.x, raw.y};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      u32 lo, hi;
      Fp8<T>::to_f16x4(words[i], lo, hi);
      Convert<half_t>::unpack2(lo, out[4 * i], out[4 * i + 1]);
      Convert<half_t>::unpack2(hi, out[4 * i + 2], out[4 * i + 3]);
    }
  }
};
template <> struct Kv<e4m3_t> : KvFp8<e4m3_t> {};
template <> struct Kv<e5m2_t> : KvFp8<e5m2_t> {};

// Two query values (packed bits of Q) as the MMA's operand type; into f16 they saturate at
// +-65504 rather than overflow to inf (bf16 queries against an fp8 or f16 cache).
template <typename Q, typename M> struct QueryPair;
template <> struct QueryPair<half_t, half_t> { FJ_INLINE static u32 convert(u32 w) { return w; } };
template <> struct QueryPair<bfloat16_t, bfloat16_t> { FJ_INLINE static u32 convert(u32 w) { return w; } };
template <> struct QueryPair<half_t, bfloat16_t> {
  FJ_INLINE static u32 convert(u32 w) {
    float lo, hi;
    Convert<half_t>::unpack2(w, lo, hi);
    return (u32)Convert<bfloat16_t>::from_float(lo) | ((u32)Convert<bfloat16_t>::from_float(hi) << 16);
  }
};
template <> struct QueryPair<bfloat16_t, half_t> {
  FJ_INLINE static u32 convert(u32 w) {
    float lo, hi;
    Convert<bfloat16_t>::unpack2(w, lo, hi);
    lo = fminf(fmaxf(lo, -65504.f), 65504.f);
    hi = fminf(fmaxf(hi, -65504.f), 65504.f);
    return (u32)Convert<half_t>::from_float(lo) | ((u32)Convert<half_t>::from_float(hi) << 16);
  }
};

// Two consecutive query values at p as the MMA's operand type. e4m3 queries (a framework that
// quantizes them for an fp8 cache, as vLLM does for FA3) become f16 exactly; their scale is K's.
template <typename M, typename Q> FJ_INLINE u32 load_query_pair(const Q* p) {
  if constexpr (sizeof(Q) == 1) {
    static_assert(sizeof(M) == 2 && Fp8<Q>::NATIVE, "e4m3 queries need cvt.rn.f16x2.e4m3x2 (sm_89 and later)");
    return Fp8<Q>::to_f16x2(*reinterpret_cast<const unsigned short*>(p));
  } else {
    return QueryPair<Q, M>::convert(*reinterpret_cast<const u32*>(p));
  }
}

// A per-tensor or per-KV-head scale: host factor times the device value (if any). Device scales
// are read at launch, so they can change between CUDA-graph replays.
FJ_INLINE float kv_scale(float host, const float* device, int head_stride, int kv_head) {
  return device != nullptr ? host * __ldg(device + kv_head * head_stride) : host;
}

}  // namespace fj
