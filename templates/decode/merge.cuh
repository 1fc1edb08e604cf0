//! needs: common/prelude.cuh
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
// SPLIT_LANES-th partial. One pass: each split lane keeps a running max of its partials' LSEs and
// loads BATCH of them (LSE and columns) at once, none waiting on another's value; the lanes'
// states meet in shared memory, rescaled to the largest max.
enum : int { BATCH = 4 };  // partials a split lane loads at once (an enum: no symbol in the cubin)

// Which partials a block combines: read from the plan's arrays, which the decode kernel before
// this one does not write, so the entry point reads them before it waits for that kernel.
struct Target {
  int w0, w1;  // the request's partials; w1 - w0 <= 1: nothing to merge (or padding)
  i64 slot0;   // the (query token, qo head) offset inside each partial
};

FJ_INLINE Target locate(const Args& a) {
  const int token = blockIdx.x, head = blockIdx.y;
  if (token >= __ldg(a.num_tokens)) return Target{0, 0, 0};
  const int request = __ldg(a.token_request + token);
  const int q_tok = token - __ldg(a.req_qo_indptr + request);
  return Target{__ldg(a.req_work_indptr + request), __ldg(a.req_work_indptr + request + 1),
                (i64)q_tok * a.num_qo_heads + head};
}

FJ_INLINE void combine(const Args& a, const Target& target) {
  __shared__ float4 part_acc[SPLIT_LANES][LANES];
  __shared__ float part_m[SPLIT_LANES], part_sum[SPLIT_LANES];
  const int token = blockIdx.x, head = blockIdx.y, lane = threadIdx.x, split_lane = threadIdx.y;
  const int w0 = target.w0, w1 = target.w1;
  if (w1 - w0 <= 1) return;
  const i64 item_stride = (i64)cfg::MAX_Q_LEN * a.num_qo_heads, slot0 = target.slot0;
  auto slot = [=](int w) { return w * item_stride + slot0; };  // of work item w's partial

  float m = FJ_NEG_INF, sum = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int w = w0 + split_lane; w < w1; w += BATCH * SPLIT_LANES) {
    float lse[BATCH];
    float4 part[BATCH];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int at = w + b * SPLIT_LANES;
      lse[b] = at < w1 ? __ldg(a.tmp_lse + slot(at)) : FJ_NEG_INF;
      part[b] = at < w1 ? __ldg(reinterpret_cast<const float4*>(a.tmp_o + slot(at) * D) + lane)
                        : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      // A partial with zero weight (empty or fully masked split: LSE -inf) is skipped, never
      // multiplied, so an unwritten one cannot leak NaN.
      if (!(lse[b] > FJ_NEG_INF)) continue;
      if (lse[b] > m) {  // a new max: what the lane holds so far is rescaled to it
        const float scale = exp2_approx(m - lse[b]);
        acc.x *= scale; acc.y *= scale; acc.z *= scale; acc.w *= scale;
        sum *= scale;
        m = lse[b];
      }
      const float weight = exp2_approx(lse[b] - m);
      acc.x += weight * part[b].x; acc.y += weight * part[b].y; acc.z += weight * part[b].z; acc.w += weight * part[b].w;
      sum += weight;
    }
  }
  part_acc[split_lane][lane] = acc;
  if (lane == 0) { part_m[split_lane] = m; part_sum[split_lane] = sum; }
  __syncthreads();
  if (split_lane != 0) return;
  float m_all = FJ_NEG_INF;
#pragma unroll
  for (int s = 0; s < SPLIT_LANES; ++s) m_all = fmaxf(m_all, part_m[s]);
  const float m_ref = m_all == FJ_NEG_INF ? 0.f : m_all;
  acc = make_float4(0.f, 0.f, 0.f, 0.f);
  sum = 0.f;
#pragma unroll
  for (int s = 0; s < SPLIT_LANES; ++s) {
    const float weight = exp2_approx(part_m[s] - m_ref);  // 0 for a lane with no partial
    const float4 other = part_acc[s][lane];
    acc.x += weight * other.x; acc.y += weight * other.y; acc.z += weight * other.z; acc.w += weight * other.w;
    sum += weight * part_sum[s];
  }
  const float values[4] = {acc.x, acc.y, acc.z, acc.w};
  decode::store_out4(a.out, a.out_stride, a.lse, a.num_qo_heads, token, head, lane * COLS, values,
                     sum > 0.f ? 1.f / sum : 0.f, sum > 0.f ? m_ref + log2_approx(sum) : FJ_NEG_INF);
}

}  // namespace merge
