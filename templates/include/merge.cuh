// Merge of split-KV partial states: for each (query token, qo head) of a request that was cut
// into several work items, combine the normalized fp32 partials by their base-2 LSEs:
//   M = max lse_i,  o = sum 2^(lse_i - M) o_i / sum 2^(lse_i - M),  lse = M + log2(sum).
// Partials with zero weight (empty or fully masked splits) are skipped, never multiplied,
// so an unwritten partial cannot leak NaN. Requests with one work item were written directly.
// Expects cfg::HEAD_DIM, cfg::MAX_Q_LEN and out_t from the including template.

namespace merge {
using namespace fj;
constexpr int D = cfg::HEAD_DIM;
constexpr int COLS = 4;  // columns per thread; blockDim.x == D / COLS

struct Args {
  const float* __restrict__ tmp_o; const float* __restrict__ tmp_lse;
  const int* __restrict__ token_request; const int* __restrict__ req_qo_indptr;
  const int* __restrict__ req_work_indptr;
  out_t* __restrict__ out; i64 out_stride;
  float* __restrict__ lse;  // natural-log LSE [tokens, qo_heads] or null
  int num_qo_heads;
};

FJ_INLINE void combine(const Args& a) {
  const int token = blockIdx.x, head = blockIdx.y, col = threadIdx.x * COLS;
  const int request = __ldg(a.token_request + token);
  const int w0 = __ldg(a.req_work_indptr + request), w1 = __ldg(a.req_work_indptr + request + 1);
  if (w1 - w0 <= 1) return;
  const int q_tok = token - __ldg(a.req_qo_indptr + request);
  const float* tmp_o = a.tmp_o;
  const float* tmp_lse = a.tmp_lse;
  auto slot = [&](int w) { return ((i64)w * cfg::MAX_Q_LEN + q_tok) * a.num_qo_heads + head; };

  float m = FJ_NEG_INF;
  for (int w = w0; w < w1; ++w) m = fmaxf(m, tmp_lse[slot(w)]);
  const float m_ref = m == FJ_NEG_INF ? 0.f : m;
  float acc[COLS] = {0.f, 0.f, 0.f, 0.f}, sum = 0.f;
  for (int w = w0; w < w1; ++w) {
    const float weight = exp2_approx(tmp_lse[slot(w)] - m_ref);
    if (weight > 0.f) {
      const float4 part = *reinterpret_cast<const float4*>(tmp_o + slot(w) * D + col);
      acc[0] += weight * part.x; acc[1] += weight * part.y;
      acc[2] += weight * part.z; acc[3] += weight * part.w;
      sum += weight;
    }
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  uint2 packed;
  packed.x = (u32)Convert<out_t>::from_float(acc[0] * inv) | ((u32)Convert<out_t>::from_float(acc[1] * inv) << 16);
  packed.y = (u32)Convert<out_t>::from_float(acc[2] * inv) | ((u32)Convert<out_t>::from_float(acc[3] * inv) << 16);
  *reinterpret_cast<uint2*>(a.out + (i64)token * a.out_stride + head * D + col) = packed;
  if (a.lse != nullptr && threadIdx.x == 0)
    a.lse[(i64)token * a.num_qo_heads + head] = sum > 0.f ? (m_ref + log2_approx(sum)) * FJ_LN2 : FJ_NEG_INF;
}

}  // namespace merge
