//! needs: common/prelude.cuh common/kv_types.cuh worklist/kernel_core.cuh common/scoring.cuh common/mma.cuh
// Multi-head latent attention decode (DeepSeek-V3/R1, Kimi-K2) on tensor cores, mma.sync m16n8k16
// (sm_80+): one CTA per (work item, tile of ROWS query rows). The rows are the request's heads times
// its query tokens (row = token * heads + head), 16 per m-tile of the MMA's M.
//
// A latent row is c_kv (512 values) then k_pe (64): the key is all 576, the value the first 512.
// Each stage copies TILE latent rows into shared memory once (cp.async, STAGES in flight) and both
// products read them there:
//   S = Q K^T   warp w scores m-tile w % MT against keys [KW * (w / MT), + KW) of the stage
//               (Q from shared memory, K by ldmatrix); the KS warps of an m-tile meet once per stage
//               to agree on each row's running maximum, then write P (16-bit) to shared memory.
//   O += P V    warp w owns output columns [CW * w, + CW) of every row: P by ldmatrix, V by
//               ldmatrix.trans from the same latent rows. O stays in registers (MT x CW / 8 x 4).
// Every warp keeps the softmax state of the rows it scores: the maximum (the same in all KS warps of
// an m-tile) and its key slice's share of the row sum; the shares add up in the epilogue.
//
// fp8 latents (e4m3, e5m2) are copied as stored and converted once per stage, by all threads, into
// a 16-bit tile the MMAs read like a 16-bit cache. The c_kv scale folds into the softmax scale and
// the epilogue; the k_pe scale, where it differs, into Q's RoPE part (kpe_scale / ckv_scale).
//
// Outputs as decode/tc.cuh: a request's only work item writes its rows directly; split items write
// normalized fp32 partials and base-2 LSEs, and the last CTA of a request merges them
// (decode::merge_partials_if_last). Empty spans and rows that see no key give o = 0, lse = -inf.
//
// Expects from the including template: namespace cfg (QK_DIM LATENT_DIM HEAD_DIM PAGE_SIZE
// GROUP_SIZE MAX_Q_LEN ROWS WARPS TILE_TOKENS STAGES RING_BYTES CONVERT_BYTES Q_BYTES P_PITCH
// L2_PREFETCH RING_ALIGN MIN_CTAS), types q_t kv_t out_t, the causal mask and the "none" variant
// (through common/scoring.cuh's FJ_SCORE_KEY), and the headers its first line names.

namespace mla {
using namespace fj;
using decode::KeyScorer;
using decode::Mma;
using decode::QueryRow;
using decode::SpanKeys;
using decode::VariantKeys;
using decode::WorkItem;
static_assert(!VARIANT_LOGITS && !VARIANT_SINK, "MLA kernels render the \"none\" variant: no logits or sink hooks");

struct Args {
  const q_t* __restrict__ q_nope; i64 q_nope_stride, q_nope_head_stride;  // [tokens, heads, 512], element strides
  const q_t* __restrict__ q_pe; i64 q_pe_stride, q_pe_head_stride;        // [tokens, heads, 64]
  const kv_t* __restrict__ ckv; i64 ckv_page_stride, ckv_slot_stride;     // [pages, page_size, 512]
  const kv_t* __restrict__ kpe; i64 kpe_page_stride, kpe_slot_stride;     // [pages, page_size, 64]
  const int* __restrict__ page_indices;
  const int4* __restrict__ work_items;      // decode::WorkItem records (flashjit.jit.abi.WORK_ITEM_FIELDS)
  const int* __restrict__ req_work_indptr;  // the fused merge's
  out_t* __restrict__ out; i64 out_stride;  // [tokens, heads, 512], heads packed
  float* __restrict__ lse;                  // natural-log LSE [tokens, heads] or null
  float* __restrict__ tmp_o; float* __restrict__ tmp_lse;
  int* __restrict__ merge_counters; int* __restrict__ tile_counters;
  int num_heads;
  float sm_scale_log2;                      // sm_scale * log2(e)
  // fp8 latents: host factor times *_scale_ptr[0] when the pointer is set (1 and null otherwise).
  const float* __restrict__ ckv_scale_ptr; const float* __restrict__ kpe_scale_ptr;
  float ckv_scale, kpe_scale;
};

constexpr int QK = cfg::QK_DIM, LATENT = cfg::LATENT_DIM;
constexpr int ROW_BYTES = QK * 2;                    // a 16-bit row of Q or of the latents the MMAs read
constexpr int M = cfg::ROWS, MT = M / 16;            // rows per CTA, m-tiles
constexpr int WARPS = cfg::WARPS, NT = 32 * WARPS;
constexpr int KS = WARPS / MT;                       // warps scoring one m-tile
constexpr int TILE = cfg::TILE_TOKENS, KW = TILE / KS, NTQ = KW / 8;  // keys per stage, per scoring warp, n-tiles
constexpr int CW = LATENT / WARPS, NTV = CW / 8;     // output columns per warp, n-tiles
constexpr int STAGES = cfg::STAGES;
constexpr int ROWS_TOTAL = cfg::GROUP_SIZE * cfg::MAX_Q_LEN;
constexpr bool FP8 = Kv<kv_t>::FP8;
using mma_t = q_t;                                   // fp8 latents are converted to the query type
constexpr int STORED_ROW_BYTES = QK * (int)sizeof(kv_t);
constexpr int STORED_CHUNKS = STORED_ROW_BYTES / 16;  // 16-byte chunks per stored latent row
constexpr int LATENT_CHUNKS = LATENT * (int)sizeof(kv_t) / 16;
constexpr int STAGE_BYTES = TILE * STORED_ROW_BYTES;

static_assert(sizeof(q_t) == 2 && sizeof(out_t) == 2, "16-bit queries and output");
static_assert(FP8 || sizeof(kv_t) == 2, "16-bit or fp8 latents");
static_assert(M % 16 == 0 && WARPS % MT == 0 && KS >= 1, "whole m-tiles, each scored by whole warps");
static_assert(KW % 8 == 0 && TILE % 16 == 0, "whole n-tiles of keys per scoring warp, whole k-steps of P");
static_assert(CW % 16 == 0, "output n-tiles in pairs (ldmatrix.x4.trans)");
static_assert(QK % 32 == 0 && LATENT % 8 == 0, "k-steps in pairs");
static_assert(STAGES * STAGE_BYTES == cfg::RING_BYTES, "the ring is the tiling's");
static_assert(M * ROW_BYTES == cfg::Q_BYTES && (FP8 ? TILE * ROW_BYTES : 0) == cfg::CONVERT_BYTES, "the tiling's buffers");
static_assert(cfg::P_PITCH >= TILE * 2 && cfg::P_PITCH % 16 == 0, "P rows hold a stage's keys, 16-byte aligned");
static_assert(cfg::HEAD_DIM == LATENT && QK == LATENT + cfg::ROPE_DIM, "the merge and the output run over the latent width");
static_assert(cfg::FUSED_MERGE && cfg::HEADS_FIRST, "split requests merge in the kernel; x is the work item");

template <typename T> struct IsBf16 { static constexpr bool value = false; };
template <> struct IsBf16<bfloat16_t> { static constexpr bool value = true; };

// Chunk (16 bytes) `chunk` of 16-bit row `row`: XOR-swizzled by the row's low 3 bits within its
// 128 bytes (rows are 1152 bytes, 9 x 128), so the 8 rows of one ldmatrix matrix hit 8 bank groups.
FJ_INLINE constexpr int swizzled(int row, int chunk) { return chunk ^ (row & 7); }

// Where chunk `chunk` of 16-bit row `row` lies in a buffer of ROWS_IN rows (Q's, or a stage's):
// rows of 1152 bytes, swizzled; or, for the wgmma kernel (cfg::WGMMA), nine blocks of 64 columns,
// each ROWS_IN rows of 128 bytes with the same swizzle, which is wgmma's 128-byte-swizzled layout
// of a K-major operand (Q, K and P) and of an N-major one (V: its rows are keys) alike.
// (Both are flashjit.jit.layouts' mla_swizzled and mla_operand_offset: the render asserts it value
// by value, and the loader's and the warps' constants below.)
template <int ROWS_IN>
FJ_INLINE constexpr int operand_offset(int row, int chunk) {
  if constexpr (cfg::WGMMA) return (chunk / 8) * (ROWS_IN * 128) + row * 128 + swizzled(row, chunk % 8) * 16;
  return row * ROW_BYTES + swizzled(row, chunk) * 16;
}

// The address of that chunk in a buffer at base (the row's start added first, as the mma.sync
// kernel's stores have always computed it).
template <int ROWS_IN>
FJ_INLINE unsigned char* operand_at(unsigned char* base, int row, int chunk) {
  if constexpr (cfg::WGMMA) return base + operand_offset<ROWS_IN>(row, chunk);
  return base + row * ROW_BYTES + swizzled(row, chunk) * 16;
}

// Copies one stage of latent rows from the paged cache: TPK threads per row, each CPT chunks of it
// (16-byte columns TPK apart, so the TPK threads read consecutive bytes), KPP rows per pass. One
// page-table read per thread and pass, resolved a stage ahead (locate) of the copies (issue).
// 16-bit rows land swizzled (operand_offset), ready for ldmatrix or wgmma; fp8 rows land as
// stored, for convert().
template <int THREADS>  // the threads that copy: the CTA's, or one warpgroup's (mla/wgmma.cuh)
struct LatentCopies {
  static constexpr int TPK = FP8 ? 4 : 8;
  static constexpr int KPP = THREADS / TPK, PASSES = ceil_div(TILE, KPP), CPT = STORED_CHUNKS / TPK;
  static constexpr int ELEMS = 16 / (int)sizeof(kv_t);
  static_assert(STORED_CHUNKS % TPK == 0 && THREADS % TPK == 0, "whole chunks per thread");

  const Args& a;
  u32 ring;
  int row, sub, request, v_begin, v_end, page_begin;
  i64 ckv_at[PASSES], kpe_at[PASSES];
  bool real[PASSES];

  FJ_INLINE LatentCopies(const Args& a, unsigned char* ring_smem, int tid, const WorkItem& item)
      : a(a), ring((u32)__cvta_generic_to_shared(ring_smem)), row(tid / TPK), sub(tid % TPK), request(item.request),
        v_begin(item.v_begin), v_end(item.v_end), page_begin(item.page_begin) {}

  FJ_INLINE void locate(int tile_v0) {
#pragma unroll
    for (int p = 0; p < PASSES; ++p) {
      const int key = p * KPP + row, pos = tile_v0 + key;
      real[p] = key < TILE && pos >= v_begin && pos < v_end;
      ckv_at[p] = kpe_at[p] = 0;
      if (real[p]) {
        const int page = __ldg(a.page_indices + page_begin + pos / cfg::PAGE_SIZE), slot = pos % cfg::PAGE_SIZE;
        ckv_at[p] = (i64)page * (int)a.ckv_page_stride + slot * (int)a.ckv_slot_stride;
        kpe_at[p] = (i64)page * (int)a.kpe_page_stride + slot * (int)a.kpe_slot_stride;
      }
    }
  }

  FJ_INLINE void issue(int stage) {
#pragma unroll
    for (int p = 0; p < PASSES; ++p) {
      const int key = p * KPP + row;
      if (KPP * PASSES > TILE && key >= TILE) continue;
      const u32 stage_dst = ring + stage * STAGE_BYTES;
#pragma unroll
      for (int j = 0; j < CPT; ++j) {
        const int c = sub + TPK * j;
        const kv_t* src = c < LATENT_CHUNKS ? a.ckv + ckv_at[p] + c * ELEMS
                                            : a.kpe + kpe_at[p] + (c - LATENT_CHUNKS) * ELEMS;
        const int at = FP8 ? key * STORED_ROW_BYTES + c * 16 : operand_offset<TILE>(key, c);
        cp_async_16<cfg::L2_PREFETCH>(stage_dst + at, src, real[p]);
      }
    }
  }
};

// Q's rows into shared memory (16-bit, at operand_offset), zeros for rows past the request's. With fp8
// latents Q's RoPE part is multiplied by pe_ratio = kpe_scale / ckv_scale on the way, so that one
// scale serves the whole 576-wide score.
FJ_INLINE void load_q(const Args& a, const WorkItem& item, int row_tile, unsigned char* q_smem, float pe_ratio,
                      int tid) {
  constexpr int CHUNKS = ROW_BYTES / 16, NOPE_CHUNKS = LATENT / 8;
  const u32 q_base = (u32)__cvta_generic_to_shared(q_smem);
  for (int i = tid; i < M * CHUNKS; i += NT) {
    const int r = i / CHUNKS, c = i % CHUNKS;
    const int row = row_tile * M + r, tok = row / cfg::GROUP_SIZE, head = row % cfg::GROUP_SIZE;
    const bool valid = row < ROWS_TOTAL && tok < item.q_len;
    const i64 token = item.q_begin + tok;
    const int at = operand_offset<M>(r, c);
    if (c < NOPE_CHUNKS) {
      const q_t* src = valid ? a.q_nope + token * a.q_nope_stride + head * a.q_nope_head_stride + c * 8 : a.q_nope;
      cp_async_16<cfg::L2_PREFETCH>(q_base + at, src, valid);
    } else if constexpr (!FP8) {
      const q_t* src = valid ? a.q_pe + token * a.q_pe_stride + head * a.q_pe_head_stride + (c - NOPE_CHUNKS) * 8
                             : a.q_pe;
      cp_async_16<cfg::L2_PREFETCH>(q_base + at, src, valid);
    } else {
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (valid) {
        float x[8];
        unpack8<q_t>(__ldg(reinterpret_cast<const uint4*>(
            a.q_pe + token * a.q_pe_stride + head * a.q_pe_head_stride + (c - NOPE_CHUNKS) * 8)), x);
#pragma unroll
        for (int e = 0; e < 8; ++e) x[e] *= pe_ratio;
        v = pack8<q_t>(x);
      }
      *reinterpret_cast<uint4*>(q_smem + at) = v;
    }
  }
  cp_async_commit();
}

// fp8 latents of one stage (as stored) to the 16-bit tile the MMAs read, each chunk where a 16-bit
// stage's copies put it (operand_offset: ldmatrix's swizzled rows, or wgmma's blocks).
// A template, so that 16-bit specializations, which never call it, never instantiate Fp8<kv_t>.
template <typename Stored>
FJ_INLINE void convert(const unsigned char* stored, unsigned char* tile, int tid) {
  for (int i = tid; i < TILE * STORED_CHUNKS; i += NT) {
    const int key = i / STORED_CHUNKS, c = i % STORED_CHUNKS;
    const uint4 raw = *reinterpret_cast<const uint4*>(stored + key * STORED_ROW_BYTES + c * 16);
    const u32 words[4] = {raw.x, raw.y, raw.z, raw.w};
    u32 h[8];  // f16 pairs of values (2e, 2e + 1)
#pragma unroll
    for (int j = 0; j < 4; ++j) Fp8<Stored>::to_f16x4(words[j], h[2 * j], h[2 * j + 1]);
    if constexpr (IsBf16<mma_t>::value) {  // exact: every fp8 value is a bf16 value
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        float lo, hi;
        Convert<half_t>::unpack2(h[e], lo, hi);
        h[e] = Mma<mma_t>::pack(lo, hi);
      }
    }
    *reinterpret_cast<uint4*>(operand_at<TILE>(tile, key, 2 * c)) = make_uint4(h[0], h[1], h[2], h[3]);
    *reinterpret_cast<uint4*>(operand_at<TILE>(tile, key, 2 * c + 1)) = make_uint4(h[4], h[5], h[6], h[7]);
  }
}

// One query row's outputs from this thread: N column pairs col0 + 8n (+1), pair(n) giving their
// unnormalized values, times inv. A request's only item writes the output (and the natural-log
// LSE, where writes_lse and an lse tensor is given); a split item its normalized fp32 partial and
// base-2 LSE in its slot, for the fused merge.
template <int N, class Pair>
FJ_INLINE void store_row(const Args& a, const WorkItem& item, int w, int tok, int head, int col0, float inv,
                         float lse2, bool writes_lse, Pair&& pair) {
  const i64 token = item.q_begin + tok;
  if (item.direct) {
    out_t* dst = a.out + token * a.out_stride + head * LATENT + col0;
#pragma unroll
    for (int n = 0; n < N; ++n) {
      const float2 v = pair(n);
      *reinterpret_cast<u32*>(dst + 8 * n) = Mma<mma_t>::pack(v.x * inv, v.y * inv);
    }
    if (a.lse != nullptr && writes_lse) a.lse[token * a.num_heads + head] = lse2 * FJ_LN2;
  } else {
    const i64 slot = ((i64)w * cfg::MAX_Q_LEN + tok) * a.num_heads + head;
    float* dst = a.tmp_o + slot * LATENT + col0;
#pragma unroll
    for (int n = 0; n < N; ++n) {
      const float2 v = pair(n);
      *reinterpret_cast<float2*>(dst + 8 * n) = make_float2(v.x * inv, v.y * inv);
    }
    if (writes_lse) a.tmp_lse[slot] = lse2;
  }
}

// A split item's CTA, its partials written: the last of its request's row tile merges them.
FJ_INLINE void merge_if_split(const Args& a, const WorkItem& item, int row_tile, int tid) {
  if (!item.direct)
    decode::merge_partials_if_last<M, NT, cfg::MERGE_CELLS>(
        a.req_work_indptr, a.merge_counters, a.tile_counters, a.tmp_o, a.tmp_lse, a.out, a.out_stride, a.lse,
        a.num_heads, item.request, item.q_begin, item.q_len, 0, row_tile, tid);
}

// S = Q K^T over this warp's KW keys of a stage (kv): s[n][0..1] row quad, s[n][2..3] row quad + 8,
// keys 8n + pair (+1). q_row: the lane's ldmatrix row of Q (a_row), k_key: its first key. With one
// n-tile per warp the odd k-steps accumulate apart (CHAINS = 2), halving the chain of dependent
// MMAs; with more, the n-tiles' chains interleave already.
FJ_INLINE void stage_scores(float (*s)[4], const unsigned char* q_row, const unsigned char* kv, int a_row, int a_sub,
                            int k_key, int k_sub) {
  constexpr int CHAINS = NTQ == 1 ? 2 : 1;
  float s_odd[CHAINS == 2 ? NTQ : 1][4];
#pragma unroll
  for (int n = 0; n < NTQ; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
  s_odd[0][0] = s_odd[0][1] = s_odd[0][2] = s_odd[0][3] = 0.f;
#pragma unroll
  for (int kp = 0; kp < QK / 32; ++kp) {  // two k-steps (32 dims) per round
    u32 qa0[4], qa1[4];
    decode::ldmatrix_x4(qa0, q_row + swizzled(a_row, 4 * kp + a_sub) * 16);
    decode::ldmatrix_x4(qa1, q_row + swizzled(a_row, 4 * kp + 2 + a_sub) * 16);
#pragma unroll
    for (int n = 0; n < NTQ; ++n) {
      const int key = k_key + 8 * n;
      u32 kb[4];  // dims 32kp + 0..7, 8..15 (k-step 2kp), 16..23, 24..31 (k-step 2kp + 1)
      decode::ldmatrix_x4(kb, kv + key * ROW_BYTES + swizzled(key, 4 * kp + k_sub) * 16);
      Mma<mma_t>::run(s[n], qa0, kb[0], kb[1]);
      Mma<mma_t>::run(CHAINS == 2 ? s_odd[0] : s[n], qa1, kb[2], kb[3]);
    }
  }
  if constexpr (CHAINS == 2) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[0][e] += s_odd[0][e];
  }
}

// O's rows rescaled by the factors the scoring warps published for the stage (rescale_rows: 1 where
// a row's running maximum held).
FJ_INLINE void rescale_outputs(float (*o)[NTV][4], const float* rescale_rows, int quad) {
  float rescale[MT][2];
  bool grew = false;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      rescale[mt][h] = rescale_rows[mt * 16 + quad + 8 * h];
      grew = grew || rescale[mt][h] != 1.f;
    }
  if (__any_sync(0xffffffffu, grew)) {  // after the first tiles the running maxima rarely grow
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < NTV; ++n) {
        o[mt][n][0] *= rescale[mt][0]; o[mt][n][1] *= rescale[mt][0];
        o[mt][n][2] *= rescale[mt][1]; o[mt][n][3] *= rescale[mt][1];
      }
  }
}

// O += P V over this warp's columns of every m-tile: P from shared memory (ldmatrix rows p_row),
// V from the stage's latent rows (kv; ldmatrix.trans keys v_key, chunks from v_chunk).
FJ_INLINE void accumulate_values(float (*o)[NTV][4], const unsigned char* p_smem, const unsigned char* kv, int p_row,
                                 int a_sub, int v_key, int v_chunk) {
#pragma unroll
  for (int kk = 0; kk < TILE / 16; ++kk) {
    u32 pa[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      decode::ldmatrix_x4(pa[mt], p_smem + (mt * 16 + p_row) * cfg::P_PITCH + (2 * kk + a_sub) * 16);
    const int key = 16 * kk + v_key;
    const unsigned char* v_row = kv + key * ROW_BYTES;
#pragma unroll
    for (int n = 0; n < NTV; n += 2) {
      u32 vb[4];  // keys 0..7 and 8..15 of n-tile n, then of n-tile n + 1
      decode::ldmatrix_x4_trans(vb, v_row + swizzled(key, v_chunk + n) * 16);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        Mma<mma_t>::run(o[mt][n], pa[mt], vb[0], vb[1]);
        Mma<mma_t>::run(o[mt][n + 1], pa[mt], vb[2], vb[3]);
      }
    }
  }
}

// The query a row of the CTA's tile stands for (row: its index among the ROWS_TOTAL rows): its
// token, head and position, and whether the item has it (a tile's last rows may be past them).
FJ_INLINE QueryRow query_row(int row, const WorkItem& item) {
  QueryRow r;
  r.q_idx = row / cfg::GROUP_SIZE;
  r.qo_head = row % cfg::GROUP_SIZE;
  r.valid = row < ROWS_TOTAL && r.q_idx < item.q_len;
  r.q_pos = item.kv_len - item.q_len + r.q_idx;
  return r;
}

FJ_INLINE void attend(const Args& a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* ring = decode::aligned_ring(smem_raw);
  unsigned char* converted = ring + cfg::RING_BYTES;
  unsigned char* q_smem = converted + cfg::CONVERT_BYTES;
  unsigned char* p_smem = q_smem + cfg::Q_BYTES;
  __shared__ float red_max[KS][M], rescale_rows[M], red_sum[KS][M], red_m[M];

  const int w = blockIdx.x, row_tile = blockIdx.y;
  const WorkItem item(a, w);
  if (item.padding()) return;  // a CUDA-graph grid's position past the plan's items
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int quad = lane / 4, pair = (lane % 4) * 2;
  const int mt_q = warp % MT, ks = warp / MT;  // the m-tile and key slice this warp scores

  const float ckv_scale = kv_scale(a.ckv_scale, a.ckv_scale_ptr, 0, 0);
  const float kpe_scale = kv_scale(a.kpe_scale, a.kpe_scale_ptr, 0, 0);
  const float score_scale = a.sm_scale_log2 * ckv_scale * Kv<kv_t>::UNIT;
  const float value_scale = ckv_scale * Kv<kv_t>::UNIT;

  load_q(a, item, row_tile, q_smem, kpe_scale / ckv_scale, tid);

  // The two rows of this warp's m-tile that its fragments touch: quad and quad + 8.
  int row_of[2];
  QueryRow rows[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_of[h] = mt_q * 16 + quad + 8 * h;
    rows[h] = query_row(row_tile * M + row_of[h], item);
  }
  const MaskParams causal{};  // (the causal mask reads no parameter)
  const VariantParams no_variant{};
  const KeyScorer scorer{causal, no_variant, item};
  float m[2] = {FJ_NEG_INF, FJ_NEG_INF}, dsum[2] = {0.f, 0.f};
  float o[MT][NTV][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int n = 0; n < NTV; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;

  // ldmatrix lanes: lane l serves row l % 8 of matrix l / 8.
  const int a_row = mt_q * 16 + (lane & 7) + 8 * ((lane >> 3) & 1), a_sub = lane >> 4;  // Q and P: A fragments
  const int k_key = ks * KW + (lane & 7), k_sub = lane >> 3;                             // K: 8 keys x 32 dims
  const int v_key = (lane & 7) + 8 * ((lane >> 3) & 1), v_chunk = warp * CW / 8 + (lane >> 4);  // V, transposed
  const int p_row = (lane & 7) + 8 * ((lane >> 3) & 1);
  const unsigned char* q_row = q_smem + a_row * ROW_BYTES;

  LatentCopies<NT> loader(a, ring, tid, item);
  const int num_tiles = ceil_div(item.v_end - item.v_begin, TILE);
  decode::stream_tiles<STAGES, TILE>(loader, item.v_begin, num_tiles, [] {}, [&](int stage, int t) {
    const unsigned char* kv = ring + stage * STAGE_BYTES;
    if constexpr (FP8) {
      convert<kv_t>(kv, converted, tid);
      __syncthreads();
      kv = converted;
    }
    const int tile_v0 = item.v_begin + t * TILE;

    float s[NTQ][4];
    stage_scores(s, q_row, kv, a_row, a_sub, k_key, k_sub);
    // Scale and mask; each row's maximum over the stage, agreed by the m-tile's KS warps.
    float tile_max[2] = {FJ_NEG_INF, FJ_NEG_INF};
#pragma unroll
    for (int n = 0; n < NTQ; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        FJ_SCORE_KEY(SpanKeys::as_is, VariantKeys::visible, scorer, rows[e >> 1],
                     tile_v0 + ks * KW + 8 * n + pair + (e & 1), s[n][e] * score_scale, s[n][e], tile_max[e >> 1]);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
    }
    if constexpr (KS > 1) {
      if (lane % 4 == 0) { red_max[ks][row_of[0]] = tile_max[0]; red_max[ks][row_of[1]] = tile_max[1]; }
      __syncthreads();
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int j = 0; j < KS; ++j) tile_max[h] = fmaxf(tile_max[h], red_max[j][row_of[h]]);
    }
    float m_ref[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float rescale = decode::advance_max(tile_max[h], m[h], m_ref[h], dsum[h]);
      if (ks == 0 && lane % 4 == 0) rescale_rows[row_of[h]] = rescale;
    }
    // P into shared memory, in the layout the A fragments of O += P V read.
#pragma unroll
    for (int n = 0; n < NTQ; ++n) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float p0 = exp2_approx(s[n][2 * h] - m_ref[h]), p1 = exp2_approx(s[n][2 * h + 1] - m_ref[h]);
        dsum[h] += p0 + p1;
        *reinterpret_cast<u32*>(p_smem + row_of[h] * cfg::P_PITCH + (ks * KW + 8 * n + pair) * 2) =
            Mma<mma_t>::pack(p0, p1);
      }
    }
    __syncthreads();

    // O += P V over this warp's columns, for every m-tile.
    rescale_outputs(o, rescale_rows, quad);
    accumulate_values(o, p_smem, kv, p_row, a_sub, v_key, v_chunk);
  });

  // The rows' sums over the key slices, and their maxima, for every warp's columns.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    dsum[h] += __shfl_xor_sync(0xffffffffu, dsum[h], 1);
    dsum[h] += __shfl_xor_sync(0xffffffffu, dsum[h], 2);
    if (lane % 4 == 0) {
      red_sum[ks][row_of[h]] = dsum[h];
      if (ks == 0) red_m[row_of[h]] = m[h];
    }
  }
  __syncthreads();
  const int col0 = warp * CW + pair;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = mt * 16 + quad + 8 * h, row = row_tile * M + r;
      const int tok = row / cfg::GROUP_SIZE, head = row % cfg::GROUP_SIZE;
      if (row >= ROWS_TOTAL || tok >= item.q_len) continue;
      float total = 0.f;
#pragma unroll
      for (int j = 0; j < KS; ++j) total += red_sum[j][r];
      const float inv = total > 0.f ? value_scale / total : 0.f;
      const float lse2 = total > 0.f ? red_m[r] + log2_approx(total) : FJ_NEG_INF;
      store_row<NTV>(a, item, w, tok, head, col0, inv, lse2, warp == 0 && lane % 4 == 0,
                     [&](int n) { return make_float2(o[mt][n][2 * h], o[mt][n][2 * h + 1]); });
    }
  }
  merge_if_split(a, item, row_tile, tid);
}

}  // namespace mla
