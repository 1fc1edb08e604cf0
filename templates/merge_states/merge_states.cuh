//! needs: common/prelude.cuh
// merge_states: the exact online-softmax merge of n partial attention states per (token, head) row:
//   M = max lse_i,  o = sum e^(lse_i - M) o_i / sum e^(lse_i - M),  lse = M + ln(sum)   (natural log).
// A state of weight zero (lse = -inf: an empty or fully masked part) is skipped, never multiplied,
// so its o may hold anything, NaN included. A row whose states all have zero weight gives o = 0 and
// lse = -inf.
// Each row's head_dim values are cut into 16-byte vectors, one per thread (its "lane"); a block
// holds blockDim.x / lanes whole rows. Addresses are element strides from the host, which checks that
// every row starts on 16 bytes.
// Expects state_t (fj::half_t, fj::bfloat16_t or float) from the including template. The host's
// copy of Args is flashjit.jit.abi.MergeStatesArgs; the rendered source asserts their layouts match.

namespace merge_states {
using namespace fj;

template <typename T> struct Vector;  // one 16-byte vector of T in floats

template <> struct Vector<float> {
  static constexpr int N = 4;
  FJ_INLINE static void load(const void* p, float* out) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(p));
    out[0] = v.x; out[1] = v.y; out[2] = v.z; out[3] = v.w;
  }
  FJ_INLINE static void store(void* p, const float* in) {
    *reinterpret_cast<float4*>(p) = make_float4(in[0], in[1], in[2], in[3]);
  }
};

template <typename T> struct Vector16 {
  static constexpr int N = 8;
  FJ_INLINE static void load(const void* p, float* out) { unpack8<T>(__ldg(reinterpret_cast<const uint4*>(p)), out); }
  FJ_INLINE static void store(void* p, const float* in) { *reinterpret_cast<uint4*>(p) = pack8<T>(in); }
};
template <> struct Vector<half_t> : Vector16<half_t> {};
template <> struct Vector<bfloat16_t> : Vector16<bfloat16_t> {};

struct Args {
  const state_t* __restrict__ o;  // state s of row (token, head): o + s*o_state + token*o_token + head*o_head
  const float* __restrict__ lse;
  state_t* __restrict__ out;      // row (token, head): out + token*out_token + head*out_head
  float* __restrict__ out_lse;    // null: not written
  i64 o_state, o_token, o_head;   // element strides
  i64 lse_state, lse_token, lse_head;
  i64 out_token, out_head, out_lse_token, out_lse_head;
  int num_states, num_tokens, num_heads, head_dim;
};

FJ_INLINE void combine(const Args& a) {
  typedef Vector<state_t> V;
  const int lanes = a.head_dim / V::N;
  const int rows_per_block = blockDim.x / lanes;
  const int lane = threadIdx.x % lanes, slot = threadIdx.x / lanes;
  const i64 row = (i64)blockIdx.x * rows_per_block + slot;
  if (slot >= rows_per_block || row >= (i64)a.num_tokens * a.num_heads) return;
  const i64 token = row / a.num_heads, head = row % a.num_heads;
  const float* lse = a.lse + token * a.lse_token + head * a.lse_head;
  const state_t* o = a.o + token * a.o_token + head * a.o_head + lane * V::N;

  float m = FJ_NEG_INF;
  for (int s = 0; s < a.num_states; ++s) m = fmaxf(m, __ldg(lse + s * a.lse_state));
  float acc[V::N];
#pragma unroll
  for (int i = 0; i < V::N; ++i) acc[i] = 0.f;
  float sum = 0.f;
  if (m != FJ_NEG_INF) {  // else every weight is zero (and e^(-inf - -inf) would be NaN)
#pragma unroll 4
    for (int s = 0; s < a.num_states; ++s) {
      const float weight = __expf(__ldg(lse + s * a.lse_state) - m);
      if (weight > 0.f) {  // the same for every lane of the row: no divergence within it
        float part[V::N];
        V::load(o + s * a.o_state, part);
#pragma unroll
        for (int i = 0; i < V::N; ++i) acc[i] += weight * part[i];
        sum += weight;
      }
    }
  }
  const float scale = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
  for (int i = 0; i < V::N; ++i) acc[i] *= scale;
  V::store(a.out + token * a.out_token + head * a.out_head + lane * V::N, acc);
  if (a.out_lse != nullptr && lane == 0)
    a.out_lse[token * a.out_lse_token + head * a.out_lse_head] = sum > 0.f ? m + __logf(sum) : FJ_NEG_INF;
}

}  // namespace merge_states
