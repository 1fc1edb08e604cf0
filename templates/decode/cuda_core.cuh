//! needs: common/prelude.cuh common/kv_types.cuh worklist/kernel_core.cuh common/scoring.cuh
// Paged-KV decode attention on CUDA cores, one CTA per (work item, KV head, row tile).
//
// Expects from the including template:
//   namespace cfg: HEAD_DIM PAGE_SIZE GROUP_SIZE MAX_Q_LEN VEC CHUNKS_PER_ROW BDX ROWS
//                  ROWS_PAD BDZ TILE_TOKENS STAGES
//   types q_t out_t (fj::half_t or fj::bfloat16_t), kv_t (those, fj::e4m3_t or fj::e5m2_t)
//   the mask and variant templates (their hooks reach it through common/scoring.cuh's FJ_SCORE_KEY,
//   the sink through worklist/kernel_core.cuh's row_sink2 and join_sink).
//
// A work item is (request, [v_begin, v_end)) over the span the planner chose for the request.
// A request with one work item writes its output directly; otherwise each item writes a
// normalized fp32 partial output and a base-2 LSE, which the request's last CTA to finish combines
// (merge_if_last; flashjit_merge when cfg::FUSED_MERGE is off).
// Empty spans and fully masked rows give o = 0, lse = -inf: never NaN.

namespace decode {
using namespace fj;

constexpr int D = cfg::HEAD_DIM;
constexpr int VEC = cfg::VEC;
constexpr int CPR = cfg::CHUNKS_PER_ROW;
constexpr int BDX = cfg::BDX;
constexpr int ROWS = cfg::ROWS;
constexpr int ROWS_PAD = cfg::ROWS_PAD;
constexpr int BDZ = cfg::BDZ;
constexpr int NT = BDX * ROWS_PAD * BDZ;
constexpr int ROWS_TOTAL = cfg::GROUP_SIZE * cfg::MAX_Q_LEN;
constexpr int TILE = cfg::TILE_TOKENS;
constexpr int TPZ = TILE / BDZ;  // tokens each z-slice scores per stage
constexpr int STAGES = cfg::STAGES;
constexpr int ROW_BYTES = D * sizeof(kv_t);
constexpr int SMEM_BYTES = STAGES * TILE * ROW_BYTES;

static_assert(VEC * CPR == D, "a K/V row is a whole number of 16-byte chunks");
static_assert(BDX >= CPR && (BDX & (BDX - 1)) == 0 && BDX <= 32, "row lanes: a power of two within a warp");
static_assert(NT % 32 == 0, "whole warps, so full-mask shuffles are defined");
static_assert(TILE % BDZ == 0, "every z-slice scores the same number of tokens");
static_assert(BDZ == 1 || NT * VEC * 4 <= SMEM_BYTES, "reduction scratch fits in the K ring");

FJ_INLINE void attend(const Args& a, const MaskParams& unbound, const VariantParams& vparams) {
  // 128-byte aligned: the rows are whole 16-byte chunks of ROW_BYTES, so each 32-byte sector a pair
  // of copies moves lands whole (one split across a 32-byte boundary is fetched twice: ncu).
  __shared__ __align__(128) unsigned char k_smem[SMEM_BYTES];
  __shared__ __align__(128) unsigned char v_smem[SMEM_BYTES];
  __shared__ float red_m[BDZ * ROWS_PAD], red_d[BDZ * ROWS_PAD];

  const CtaCoords cta(a);
  const int w = cta.work, kv_head = cta.kv_head;
  const WorkItem item(a, w);
  if (item.padding()) return;  // a CUDA-graph grid's position past the plan's items
  const MaskParams params = mask_bind(unbound, item.request);
  const int tx = threadIdx.x, ty = threadIdx.y, tz = threadIdx.z;
  const int tid = (tz * ROWS_PAD + ty) * BDX + tx;


  // This thread's query row: rows are (token, head-in-group), heads fastest.
  const int row = cta.row_tile * ROWS + ty;
  const int q_tok = row / cfg::GROUP_SIZE;
  const int qo_head = kv_head * cfg::GROUP_SIZE + row % cfg::GROUP_SIZE;
  const bool row_valid = ty < ROWS && row < ROWS_TOTAL && q_tok < item.q_len;
  const int q_pos = item.kv_len - item.q_len + q_tok;
  const HeadScales scales(a, kv_head);
  const float sink2 = row_sink2(vparams, qo_head);  // used in the epilogue: loaded now, its latency hidden

  float q[VEC];
  if (row_valid && tx < CPR) {
    const q_t* q_row = a.q + (i64)(item.q_begin + q_tok) * a.q_stride + qo_head * D;
    uint4 raw = *reinterpret_cast<const uint4*>(q_row + tx * VEC);
    unpack8<q_t>(raw, q);
#pragma unroll
    for (int i = 0; i < VEC; ++i) q[i] *= scales.score;
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) q[i] = 0.f;
  }

  PagedKVStage<TILE, ROW_BYTES, ROW_BYTES, NT> loader(a, params, kv_head, k_smem, v_smem, tid, item);
  const KeyScorer scorer{params, vparams, item};
  const QueryRow query{q_tok, q_pos, qo_head, row_valid};
  float m = FJ_NEG_INF, dsum = 0.f, o[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) o[i] = 0.f;

  stream_tiles<STAGES, TILE>(loader, item.tile_begin, item.num_tiles(TILE), [] {}, [&](int stage, int t) {
    float s[TPZ];
    float tile_max = FJ_NEG_INF;
#pragma unroll
    for (int j = 0; j < TPZ; ++j) {
      const int tok = tz * TPZ + j;
      float dot = 0.f;
      if (tx < CPR) {
        float kf[VEC];
        Kv<kv_t>::load8(k_smem + (stage * TILE + tok) * ROW_BYTES + tx * VEC * sizeof(kv_t), kf);
#pragma unroll
        for (int i = 0; i < VEC; ++i) dot = fmaf(q[i], kf[i], dot);
      }
#pragma unroll
      for (int off = BDX / 2; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
      FJ_SCORE_KEY(SpanKeys::mapped, VariantKeys::every, scorer, query, item.tile_begin + t * TILE + tok, dot, s[j],
                   tile_max);
    }

    // Online softmax in the log2 domain; a finite reference keeps all-masked tiles NaN-free.
    const float m_new = fmaxf(m, tile_max);
    const float m_ref = m_new == FJ_NEG_INF ? 0.f : m_new;
    const float rescale = exp2_approx(m - m_ref);
    dsum *= rescale;
#pragma unroll
    for (int i = 0; i < VEC; ++i) o[i] *= rescale;
#pragma unroll
    for (int j = 0; j < TPZ; ++j) {
      const float p = exp2_approx(s[j] - m_ref);
      dsum += p;
      if (tx < CPR) {
        float vf[VEC];
        Kv<kv_t>::load8(v_smem + (stage * TILE + tz * TPZ + j) * ROW_BYTES + tx * VEC * sizeof(kv_t), vf);
#pragma unroll
        for (int i = 0; i < VEC; ++i) o[i] = fmaf(p, vf[i], o[i]);
      }
    }
    m = m_new;
  });

  bool holds_row = row_valid;  // this thread holds its row's final state and writes it
  if (BDZ > 1) {  // merge the z-slices' states through shared memory
    __syncthreads();
    float* red_o = reinterpret_cast<float*>(k_smem);
    if (tx == 0) { red_m[tz * ROWS_PAD + ty] = m; red_d[tz * ROWS_PAD + ty] = dsum; }
#pragma unroll
    for (int i = 0; i < VEC; ++i) red_o[tid * VEC + i] = o[i];
    __syncthreads();
    holds_row = holds_row && tz == 0;
    if (tz == 0) {
      float m_all = FJ_NEG_INF;
#pragma unroll
      for (int z = 0; z < BDZ; ++z) m_all = fmaxf(m_all, red_m[z * ROWS_PAD + ty]);
      const float m_ref = m_all == FJ_NEG_INF ? 0.f : m_all;
      dsum = 0.f;
#pragma unroll
      for (int i = 0; i < VEC; ++i) o[i] = 0.f;
#pragma unroll
      for (int z = 0; z < BDZ; ++z) {
        const float weight = exp2_approx(red_m[z * ROWS_PAD + ty] - m_ref);
        dsum += weight * red_d[z * ROWS_PAD + ty];
        const int src = ((z * ROWS_PAD + ty) * BDX + tx) * VEC;
#pragma unroll
        for (int i = 0; i < VEC; ++i) o[i] += weight * red_o[src + i];
      }
      m = m_all;
    }
  }

  if (holds_row) {
    float inv = dsum > 0.f ? scales.value / dsum : 0.f;
    float lse2 = dsum > 0.f ? m + log2_approx(dsum) : FJ_NEG_INF;
    join_sink(item, sink2, m, dsum, scales.value, inv, lse2);
#pragma unroll
    for (int i = 0; i < VEC; ++i) o[i] *= inv;
    const int token = item.q_begin + q_tok;
    if (item.direct) {
      if (tx < CPR)
        *reinterpret_cast<uint4*>(a.out + (i64)token * a.out_stride + qo_head * D + tx * VEC) = pack8<out_t>(o);
      if (a.lse != nullptr && tx == 0) a.lse[(i64)token * a.num_qo_heads + qo_head] = lse2 * FJ_LN2;
    } else {
      const i64 slot = ((i64)w * cfg::MAX_Q_LEN + q_tok) * a.num_qo_heads + qo_head;
      if (tx < CPR) {
        float4* dst = reinterpret_cast<float4*>(a.tmp_o + slot * D + tx * VEC);
        dst[0] = make_float4(o[0], o[1], o[2], o[3]);
        dst[1] = make_float4(o[4], o[5], o[6], o[7]);
      }
      if (tx == 0) a.tmp_lse[slot] = lse2;
    }
  }
  if constexpr (cfg::FUSED_MERGE)
    if (!item.direct) merge_if_last<ROWS, NT>(a, item, cta, tid);
}

}  // namespace decode
