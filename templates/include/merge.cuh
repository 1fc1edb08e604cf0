// Merge of split-KV partial states: for each (query token, qo head) of a request cut into
// several work items, combine the normalized fp32 partials by their base-2 LSEs:
//   M = max lse_i,  o = sum 2^(lse_i - M) o_i / sum 2^(lse_i - M),  lse = M + log2(sum).
// Partials with zero weight (empty or fully masked splits) are skipped, never multiplied,
// so an unwritten partial cannot leak NaN. A request of one work item has its output written by
// the decode kernel and is skipped.
// Expects cfg::HEAD_DIM, cfg::MAX_Q_LEN, cfg::MERGE_THREADS and out_t from the including template.
// The host's copy of Args is flashjit.jit.abi.MergeArgs; the rendered source asserts their layouts match.

namespace merge {
using namespace fj;
constexpr int D = cfg::HEAD_DIM;
constexpr int COLS = 4;                  // columns per thread
constexpr int LANES = D / COLS;          // threads across one row
constexpr int SPLIT_LANES = cfg::MERGE_THREADS / LANES;  // partials read in parallel

struct Args {
  const float* __restrict__ tmp_o; const float* __restrict__ tmp_lse;
  const int* __restrict__ token_request; const int* __restrict__ req_qo_indptr;
  const int* __restrict__ req_work_indptr;
  const int* __restrict__ num_tokens;  // device scalar: blocks past it are CUDA-graph padding
  out_t* __restrict__ out; i64 out_stride;
  float* __restrict__ lse;  // natural-log LSE [tokens, qo_heads] or null
  int num_qo_heads;
};

// One block per (query token, qo head); threadIdx.x picks 4 columns, threadIdx.y every
// SPLIT_LANES-th partial, and the lanes' sums meet in shared memory.
FJ_INLINE void combine(const Args& a) {
  __shared__ float4 part_acc[SPLIT_LANES][LANES];
  __shared__ float part_sum[SPLIT_LANES];
  const int token = blockIdx.x, head = blockIdx.y, lane = threadIdx.x, split_lane = threadIdx.y;
  if (token >= __ldg(a.num_tokens)) return;
  const int request = __ldg(a.token_request + token);
  const int w0 = __ldg(a.req_work_indptr + request), w1 = __ldg(a.req_work_indptr + request + 1);
  if (w1 - w0 <= 1) return;
  const int q_tok = token - __ldg(a.req_qo_indptr + request);
  const i64 item_stride = (i64)cfg::MAX_Q_LEN * a.num_qo_heads, slot0 = (i64)q_tok * a.num_qo_heads + head;
  auto slot = [=](int w) { return w * item_stride + slot0; };  // of work item w's partial

  float m = FJ_NEG_INF;
  for (int w = w0; w < w1; ++w) m = fmaxf(m, __ldg(a.tmp_lse + slot(w)));
  const float m_ref = m == FJ_NEG_INF ? 0.f : m;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float sum = 0.f;
  for (int w = w0 + split_lane; w < w1; w += SPLIT_LANES) {
    const float weight = exp2_approx(__ldg(a.tmp_lse + slot(w)) - m_ref);
    if (weight > 0.f) {
      const float4 part = __ldg(reinterpret_cast<const float4*>(a.tmp_o + slot(w) * D) + lane);
      acc.x += weight * part.x; acc.y += weight * part.y; acc.z += weight * part.z; acc.w += weight * part.w;
      sum += weight;
    }
  }
  part_acc[split_lane][lane] = acc;
  if (lane == 0) part_sum[split_lane] = sum;
  __syncthreads();
  if (split_lane != 0) return;
  for (int s = 1; s < SPLIT_LANES; ++s) {
    const float4 other = part_acc[s][lane];
    acc.x += other.x; acc.y += other.y; acc.z += other.z; acc.w += other.w;
    sum += part_sum[s];
  }
  const float values[4] = {acc.x, acc.y, acc.z, acc.w};
  decode::store_out4(a.out, a.out_stride, a.lse, a.num_qo_heads, token, head, lane * COLS, values,
                     sum > 0.f ? 1.f / sum : 0.f, sum > 0.f ? m_ref + log2_approx(sum) : FJ_NEG_INF);
}

}  // namespace merge
