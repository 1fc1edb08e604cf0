//! needs: common/prelude.cuh common/kv_types.cuh
// What the decode kernels (CUDA-core and tensor-core) share: the launch arguments and the paged
// K/V copy pipeline. The host's copy of Args is flashjit.jit.abi.DecodeArgs; the rendered source
// asserts that the two lay out every field alike.
// Expects from the including template: namespace cfg (HEAD_DIM PAGE_SIZE GROUP_SIZE MAX_Q_LEN
// HEADS_FIRST FUSED_MERGE STATIC_SHARE MERGE_CHUNK RING_ALIGN L2_PREFETCH SHARED_WGMMA), FJ_ITEM_INTS,
// types q_t kv_t out_t, the mask template (MaskParams, mask_kv_position) and the variant template
// (VariantParams, VARIANT_SINK, variant_sink).
namespace decode {
using namespace fj;

struct Args {
  const q_t* __restrict__ q; i64 q_stride;            // [tokens, qo_heads, D], token stride in elements
  const kv_t* __restrict__ k; const kv_t* __restrict__ v;
  i64 page_stride, slot_stride, head_stride;           // element strides of the paged cache
  const int* __restrict__ page_indices;
  // Per grid position, one record of FJ_ITEM_INTS int32 (WorkItem): (request, v_begin, v_end,
  // kv_len), (page_begin, q_begin, q_len, items of the request) and its tile-sharing group (the
  // item's index in it, the group's span begin and end, the items in it); request -1 marks
  // CUDA-graph padding.
  const int4* __restrict__ work_items;
  const int* __restrict__ req_qo_indptr; const int* __restrict__ req_work_indptr;  // the merge's
  out_t* __restrict__ out; i64 out_stride;
  float* __restrict__ lse;                              // natural-log LSE [tokens, qo_heads] or null
  float* __restrict__ tmp_o; float* __restrict__ tmp_lse;
  int* __restrict__ merge_counters;                     // FUSED_MERGE: arrivals per (request, KV head, row tile), 0 at rest
  int* __restrict__ tile_counters;                      // shared tiles claimed, per the same groups, 0 at rest
  int num_qo_heads;
  float sm_scale_log2;                                  // sm_scale * log2(e)
  // K and V scales (fp8 caches; 1 otherwise): host factor times *_scale_ptr[kv_head * stride]
  // when the pointer is set (stride 0: one per tensor, 1: one per KV head).
  const float* __restrict__ k_scale_ptr; const float* __restrict__ v_scale_ptr;
  int k_scale_stride, v_scale_stride;
  float k_scale, v_scale;
  int num_page_ids;  // page_indices' entries the plan reads (prefetch_plan; a graph keeps its capture's)
  int packed_from;   // the packed entry point's first packed own item (CtaCoords), the last records;
                     // -1: a CUDA graph's grid, a CTA per record and KV head (each record says if it packs)
};

// Per-CTA factors of one KV head: logits = (q . k_stored) * score, out = (p . v_stored) * value.
struct HeadScales {
  float score, value;
  HeadScales() = default;
  FJ_INLINE HeadScales(const Args& a, int kv_head) {
    score = a.sm_scale_log2 * kv_scale(a.k_scale, a.k_scale_ptr, a.k_scale_stride, kv_head) * Kv<kv_t>::UNIT;
    value = kv_scale(a.v_scale, a.v_scale_ptr, a.v_scale_stride, kv_head) * Kv<kv_t>::UNIT;
  }
};

// The CTA's work item, KV head and tile of query rows. A HEADS_FIRST grid runs the KV heads of one
// work item side by side (x = item * kv_heads + head, y = row tile): the cache keeps a token's
// heads next to each other (NHD), so the CTAs in flight read neighbouring bytes. Otherwise the
// grid is (item, head, row tile).
struct CtaCoords {
  int work, kv_head, row_tile;
  // The packed entry point's grid (decode/tc.cuh's attend_packed), heads first: the items before
  // a.packed_from a CTA a KV head, then the packed own items a CTA for each `pack` heads. A graph's
  // grid (packed_from < 0) gives every item a CTA a KV head.
  FJ_INLINE CtaCoords(const Args& a, int pack) {
    const int heads = a.num_qo_heads / cfg::GROUP_SIZE, x = blockIdx.x;
    const int plain = a.packed_from < 0 ? gridDim.x : a.packed_from * heads;
    const int packed = x - plain, per_item = heads / pack;
    work = packed < 0 ? x / heads : a.packed_from + packed / per_item;
    kv_head = packed < 0 ? x - work * heads : packed % per_item * pack;
    row_tile = blockIdx.y;
  }
  FJ_INLINE explicit CtaCoords(const Args& a) {
    if constexpr (cfg::HEADS_FIRST) {
      const int heads = a.num_qo_heads / cfg::GROUP_SIZE;
      work = blockIdx.x / heads;
      kv_head = blockIdx.x - work * heads;
      row_tile = blockIdx.y;
    } else {
      work = blockIdx.x;
      kv_head = blockIdx.y;
      row_tile = blockIdx.z;
    }
  }
};

// One work item: its request, the span [v_begin, v_end) it reads, and the request's geometry.
// Its tiles start at tile_begin, v_begin rounded down to a page: a span that starts inside a page
// (a sliding window) still gives the loader whole pages per thread (runs), and the positions
// before v_begin are neither read nor attended (in_span).
// The planner writes the request's geometry into every item's record, so one round of loads gives
// it all: the chain of dependent loads before a CTA's first copy (item, page id, K/V) is the
// prologue of every CTA, and at small batches most of the kernel (benchmarks/cta_timeline.py).
// With cfg::STATIC_SHARE < 100 the span is its tile-sharing group's, whose tiles the group's CTAs
// share (stream_shared_tiles); share is the item's index among the sharers. The planner makes the
// group the whole request (its items), or, for a fixed split (plan(fixed_split_tokens=...)), the
// item alone: then each CTA reads exactly its item's span, as where STATIC_SHARE is 100.
struct WorkItem {
  enum { RECORD_INT4S = 3 };  // span, geometry, the sharing group (an enum: no storage in the cubin)
  static_assert(FJ_ITEM_INTS == 4 * RECORD_INT4S, "ABI: a work-item record is not the three int4 WorkItem reads "
                                                  "(flashjit.jit.abi.ITEM_INTS)");
  int request, v_begin, v_end, tile_begin, kv_len, page_begin, q_begin, q_len, sharers, share;
  bool direct;  // the request's only item: it writes the output, not a partial for the merge
  bool first_of_request;  // VARIANT_SINK: the item whose state the sink joins (else true, unread)
  template <class A>  // decode::Args, or another family's arguments with the same work_items
  FJ_INLINE WorkItem(const A& a, int w) {
    const int4 span = __ldg(a.work_items + RECORD_INT4S * w), geometry = __ldg(a.work_items + RECORD_INT4S * w + 1);
    request = span.x; v_begin = span.y; v_end = span.z; kv_len = span.w;
    page_begin = geometry.x; q_begin = geometry.y; q_len = geometry.z;
    direct = geometry.w == 1;
    sharers = 1;
    share = 0;
    first_of_request = true;
    if constexpr (VARIANT_SINK) {  // a sink joins the state of the request's first item only
      // A request's items are consecutive records: the first is the one whose predecessor belongs
      // to another request. Record w - 1's request is loaded whatever record w holds, so that no
      // load waits for record w's fields (the compiler still issues it after the padding test).
      const int previous = w > 0 ? __ldg(reinterpret_cast<const int*>(a.work_items + RECORD_INT4S * (w - 1))) : -1;
      first_of_request = direct || previous != request;
    }
    if constexpr (cfg::STATIC_SHARE < 100) {
      const int4 group = __ldg(a.work_items + RECORD_INT4S * w + 2);
      share = group.x; v_begin = group.y; v_end = group.z; sharers = group.w;
    }
    tile_begin = v_begin - v_begin % cfg::PAGE_SIZE;
  }
  FJ_INLINE bool padding() const { return request < 0; }
  FJ_INLINE bool in_span(int vpos) const { return vpos >= v_begin && vpos < v_end; }
  FJ_INLINE int num_tiles(int tile) const { return ceil_div(v_end - tile_begin, tile); }
};

// The variant's sink logit of a query head in base 2 (-inf without a sink). The kernels load it
// as a CTA starts and use it in the epilogue: the load's latency hides behind the main loop.
FJ_INLINE float row_sink2(const VariantParams& vparams, int qo_head) {
  if constexpr (VARIANT_SINK) return variant_sink(vparams, qo_head) * FJ_LOG2E;
  return FJ_NEG_INF;
}

// The variant's sink logit joins one row's softmax as one more term of its sum. m, d: the row's
// base-2 reference and its sum relative to it (d = 0 for a row without visible keys); inv, lse2:
// its output factor (value / d) and base-2 LSE as computed without the sink. Both move to the
// larger of m and sink2, the sum takes 2^(sink2 - top), and inv and lse2 are recomputed from that
// state: one exp2 on the path to the output beside the rescale. Each row's sink enters once, in
// the state of its request's first work item: the other partials and the merges are unchanged,
// and the merge of sink-and-partial-0 with the rest is the softmax over every key and the sink.
// A row without keys gets o = 0 and lse = sink. (The CUDA-core kernel's epilogue; the tensor-core
// kernels' finish_rows merges the sink as one more state, the same math.)
FJ_INLINE void join_sink(const WorkItem& item, float sink2, float m, float d, float value, float& inv, float& lse2) {
  if constexpr (VARIANT_SINK) {
    if (!item.first_of_request || sink2 == FJ_NEG_INF) return;
    const float top = d > 0.f ? fmaxf(m, sink2) : sink2;
    const float keep = d > 0.f ? exp2_approx(m - top) : 0.f;
    const float sum = d * keep + exp2_approx(sink2 - top);
    inv = value * keep / sum;
    lse2 = top + log2_approx(sum);
  }
}

// The sink logits of a tensor-core CTA's M rows: thread t < M loads row t's as the CTA starts,
// beside its work item, and publishes it to shared memory before the epilogue's barrier
// (finish_rows reads them there); nothing uses the value before publish, so no warp waits on the
// load before its first copies. Only those M threads load: one request a CTA to the few lines
// every CTA of a step reads.
template <int M>
struct RowSinks {
  float mine;  // natural units (finish_rows converts them: a multiply here would wait on the load)
  FJ_INLINE RowSinks(const VariantParams& vparams, const CtaCoords& cta) {
    mine = FJ_NEG_INF;
    if constexpr (VARIANT_SINK)
      if (threadIdx.x < M) mine = variant_sink(vparams, cta.kv_head * cfg::GROUP_SIZE + (cta.row_tile * M + threadIdx.x) % cfg::GROUP_SIZE);
  }
  FJ_INLINE void publish(float* rows) const {
    if constexpr (VARIANT_SINK)
      if (threadIdx.x < M) rows[threadIdx.x] = mine;
  }
};

// A shared-prefix kernel's grid is mostly CTAs that start after the first wave (a request's own
// items are short), each behind a chain of loads from DRAM: its record, its page ids, then K and
// V. The first wave pulls the records and the page table (up to PREFETCH_PAGE_IDS ids) into L2 for
// them, kept there while the K/V stream passes (evict_last): each thread of the grid prefetches at
// most a few of their 128-byte lines, and nothing waits on them.
// PACK: the packed entry point's grid (CtaCoords), whose packed own items take a CTA for PACK heads
// (in an eager plan's grid; a graph's has a CTA per record and head).
enum : int { PREFETCH_PAGE_IDS = 1 << 18 };
template <int PACK = 1>
FJ_INLINE void prefetch_plan(const Args& a) {
  const int heads = a.num_qo_heads / cfg::GROUP_SIZE;
  const int records = PACK > 1 && a.packed_from >= 0 ? a.packed_from + (gridDim.x - a.packed_from * heads) / (heads / PACK)
                     : cfg::HEADS_FIRST ? gridDim.x / heads : gridDim.x;
  const int record_lines = ceil_div(records * WorkItem::RECORD_INT4S * 16, 128);
  const int id_lines = ceil_div(min(a.num_page_ids, (int)PREFETCH_PAGE_IDS) * 4, 128);
  const int threads = gridDim.x * gridDim.y * gridDim.z * blockDim.x;
  for (int line = (blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)) * blockDim.x + threadIdx.x;
       line < record_lines + id_lines; line += threads) {
    const char* at = line < record_lines ? reinterpret_cast<const char*>(a.work_items) + line * 128
                                         : reinterpret_cast<const char*>(a.page_indices) + (line - record_lines) * 128;
    asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(at));
  }
}

// Index of the (request, KV head, row tile) group in merge_counters and tile_counters.
FJ_INLINE i64 group_index(int num_qo_heads, int request, int kv_head, int row_tile, int row_tiles) {
  return ((i64)request * (num_qo_heads / cfg::GROUP_SIZE) + kv_head) * row_tiles + row_tile;
}

// Four output columns of row (token, qo_head), times inv, and its natural-log LSE (written by the
// thread of column 0) from a base-2 one.
FJ_INLINE void store_out4(out_t* out, i64 out_stride, float* lse, int num_qo_heads, int token, int qo_head,
                          int col, const float* acc, float inv, float lse2) {
  uint2 packed;
  packed.x = (u32)Convert<out_t>::from_float(acc[0] * inv) | ((u32)Convert<out_t>::from_float(acc[1] * inv) << 16);
  packed.y = (u32)Convert<out_t>::from_float(acc[2] * inv) | ((u32)Convert<out_t>::from_float(acc[3] * inv) << 16);
  *reinterpret_cast<uint2*>(out + (i64)token * out_stride + qo_head * cfg::HEAD_DIM + col) = packed;
  if (lse != nullptr && col == 0) lse[(i64)token * num_qo_heads + qo_head] = lse2 * FJ_LN2;
}

// MERGE_CHUNK partials (base-2 LSEs and values) folded into a row's running state (m, sum, acc) by
// the online-softmax rule. Partials with zero weight (empty or fully masked splits) are skipped, so
// an unwritten one cannot leak NaN.
FJ_INLINE void fold_partials(float& m, float& sum, float (&acc)[4], const float (&part_lse)[cfg::MERGE_CHUNK],
                             const float4 (&part)[cfg::MERGE_CHUNK]) {
  constexpr int MERGE_CHUNK = cfg::MERGE_CHUNK;
  float m_new = m;
#pragma unroll
  for (int j = 0; j < MERGE_CHUNK; ++j) m_new = fmaxf(m_new, part_lse[j]);
  if (m_new == FJ_NEG_INF) return;  // nothing with weight yet
  const float rescale = exp2_approx(m - m_new);  // 0 while m is -inf
  sum *= rescale;
#pragma unroll
  for (int c = 0; c < 4; ++c) acc[c] *= rescale;
#pragma unroll
  for (int j = 0; j < MERGE_CHUNK; ++j) {
    const float weight = exp2_approx(part_lse[j] - m_new);
    if (weight > 0.f) {
      acc[0] += weight * part[j].x; acc[1] += weight * part[j].y; acc[2] += weight * part[j].z; acc[3] += weight * part[j].w;
      sum += weight;
    }
  }
  m = m_new;
}

// One output row's 4 columns (token, qo_head, col) from `splits` partials, lse_0 and o_0 the first
// one's LSE and columns and each next item_stride rows on: MERGE_CHUNK partials at a time, LSEs and
// values together with no load behind another (one L2 round trip per chunk), the chunks folded in.
// The loads go through L2 (__ldcg): L1 is not coherent across CTAs.
FJ_INLINE void combine_partials4(const float* lse_0, const float* o_0, i64 item_stride, int splits, out_t* out,
                                 i64 out_stride, float* lse, int num_qo_heads, int token, int qo_head, int col) {
  constexpr int D = cfg::HEAD_DIM, MERGE_CHUNK = cfg::MERGE_CHUNK;
  float m = FJ_NEG_INF, sum = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int i0 = 0; i0 < splits; i0 += MERGE_CHUNK) {
    float part_lse[MERGE_CHUNK];
    float4 part[MERGE_CHUNK];
#pragma unroll
    for (int j = 0; j < MERGE_CHUNK; ++j) {
      const bool real = i0 + j < splits;
      part_lse[j] = real ? __ldcg(lse_0 + (i0 + j) * item_stride) : FJ_NEG_INF;
      part[j] = real ? __ldcg(reinterpret_cast<const float4*>(o_0 + (i0 + j) * item_stride * D))
                     : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    fold_partials(m, sum, acc, part_lse, part);
  }
  store_out4(out, out_stride, lse, num_qo_heads, token, qo_head, col, acc, sum > 0.f ? 1.f / sum : 0.f,
             sum > 0.f ? m + log2_approx(sum) : FJ_NEG_INF);
}

// Partial `i` (LSE and 4 values) of a cell whose first partial is at (lse_0, o_0), partials
// item_stride rows apart; -inf and zeros where it is not real. Through L2 (__ldcg): L1 is not
// coherent across CTAs.
FJ_INLINE void load_partial(const float* lse_0, const float* o_0, i64 item_stride, int i, bool real, float& part_lse,
                            float4& part) {
  part_lse = real ? __ldcg(lse_0 + i * item_stride) : FJ_NEG_INF;
  part = real ? __ldcg(reinterpret_cast<const float4*>(o_0 + i * item_stride * cfg::HEAD_DIM))
              : make_float4(0.f, 0.f, 0.f, 0.f);
}

// One output row's 4 columns and where its partials start; live: the row is the item's.
struct MergeCell {
  const float *lse_0, *o_0;
  int token, qo_head, col;
  bool live;
};

// combine_partials4 for CELLS cells at once: each chunk's loads for all of them are in flight
// together, CELLS times as many a thread (for a merge of many cells a thread, the MLA kernels').
template <int CELLS>
FJ_INLINE void combine_cells(const MergeCell (&cells)[CELLS], i64 item_stride, int splits, out_t* out, i64 out_stride,
                             float* lse, int num_qo_heads) {
  constexpr int MERGE_CHUNK = cfg::MERGE_CHUNK;
  float m[CELLS], sum[CELLS], acc[CELLS][4];
#pragma unroll
  for (int k = 0; k < CELLS; ++k) m[k] = FJ_NEG_INF, sum[k] = 0.f, acc[k][0] = acc[k][1] = acc[k][2] = acc[k][3] = 0.f;
  for (int i0 = 0; i0 < splits; i0 += MERGE_CHUNK) {
    float part_lse[CELLS][MERGE_CHUNK];
    float4 part[CELLS][MERGE_CHUNK];
#pragma unroll
    for (int k = 0; k < CELLS; ++k)
#pragma unroll
      for (int j = 0; j < MERGE_CHUNK; ++j)
        load_partial(cells[k].lse_0, cells[k].o_0, item_stride, i0 + j, cells[k].live && i0 + j < splits,
                     part_lse[k][j], part[k][j]);
#pragma unroll
    for (int k = 0; k < CELLS; ++k) fold_partials(m[k], sum[k], acc[k], part_lse[k], part[k]);
  }
#pragma unroll
  for (int k = 0; k < CELLS; ++k)
    if (cells[k].live)
      store_out4(out, out_stride, lse, num_qo_heads, cells[k].token, cells[k].qo_head, cells[k].col, acc[k],
                 sum[k] > 0.f ? 1.f / sum[k] : 0.f, sum[k] > 0.f ? m[k] + log2_approx(sum[k]) : FJ_NEG_INF);
}

// The split-KV merge fused into the decode kernel (cfg::FUSED_MERGE), for a CTA of a split request
// whose threads have written its ROWS rows' partials. Each such CTA counts itself in at its group's
// counter (request, KV head, row tile); the last to arrive combines the group's partials into the
// output, as flashjit_merge would, and sets the counter back to 0 for the next launch (CUDA-graph
// replays included). The fences order the partial writes before the count and the count before the
// reads. The last CTA's merge is on the kernel's critical path (its group finishes last), hence
// combine_partials4's chunked reads. (A pass for the maximum LSE, then one whose value loads wait
// on each weight, would cost a round trip per partial.)
//
// CELLS > 1 combines that many of a thread's cells at once (combine_cells).
//
// Not inlined: its code in the kernel body would cost registers in the main loop, where the
// 16-bit head_dim 256 kernel has none to spare. It takes scalars, as a reference to the
// kernel's parameters (or a struct by value) would go through local memory.
template <int ROWS, int THREADS, int CELLS = 1>
__device__ __noinline__ void merge_partials_if_last(const int* req_work_indptr, int* merge_counters,
                                                    int* tile_counters, const float* tmp_o, const float* tmp_lse, out_t* out,
                                                    i64 out_stride, float* lse, int num_qo_heads, int request,
                                                    int q_begin, int q_len, int kv_head, int row_tile, int tid) {
  constexpr int D = cfg::HEAD_DIM, COLS4 = D / 4, ROWS_TOTAL = cfg::GROUP_SIZE * cfg::MAX_Q_LEN;
  constexpr int ROW_TILES = ceil_div(ROWS_TOTAL, ROWS);
  const int first_item = __ldg(req_work_indptr + request);
  const int splits = __ldg(req_work_indptr + request + 1) - first_item;
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    const i64 group = group_index(num_qo_heads, request, kv_head, row_tile, ROW_TILES);
    last = atomicAdd(merge_counters + group, 1) == splits - 1;
    if (last) {  // every other CTA of the group has counted itself in, its last tile claimed
      merge_counters[group] = 0;
      tile_counters[group] = 0;
    }
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  const i64 item_stride = (i64)cfg::MAX_Q_LEN * num_qo_heads;  // between two work items' partials
  if constexpr (CELLS == 1) {
    for (int cell = tid; cell < ROWS * COLS4; cell += THREADS) {
      const int row_in = cell / COLS4, col = (cell % COLS4) * 4;
      const int row = row_tile * ROWS + row_in, q_tok = row / cfg::GROUP_SIZE;
      if (row >= ROWS_TOTAL || q_tok >= q_len) continue;
      const int qo_head = kv_head * cfg::GROUP_SIZE + row % cfg::GROUP_SIZE;
      const float* lse_0 = tmp_lse + first_item * item_stride + (i64)q_tok * num_qo_heads + qo_head;
      combine_partials4(lse_0, tmp_o + (lse_0 - tmp_lse) * D + col, item_stride, splits, out, out_stride, lse,
                        num_qo_heads, q_begin + q_tok, qo_head, col);
    }
  } else {
    const auto cell_at = [&](int cell) {  // the tile's cell `cell`: a row and 4 of its columns
      const int row_in = cell / COLS4, col = (cell % COLS4) * 4;
      const int row = row_tile * ROWS + row_in, q_tok = row / cfg::GROUP_SIZE;
      const int qo_head = kv_head * cfg::GROUP_SIZE + row % cfg::GROUP_SIZE;
      const float* lse_0 = tmp_lse + first_item * item_stride + (i64)q_tok * num_qo_heads + qo_head;
      return MergeCell{lse_0, tmp_o + (lse_0 - tmp_lse) * D + col, q_begin + q_tok, qo_head, col,
                       cell < ROWS * COLS4 && row < ROWS_TOTAL && q_tok < q_len};
    };
    for (int first = tid; first < ROWS * COLS4; first += CELLS * THREADS) {
      MergeCell cells[CELLS];
#pragma unroll
      for (int k = 0; k < CELLS; ++k) cells[k] = cell_at(first + k * THREADS);
      combine_cells(cells, item_stride, splits, out, out_stride, lse, num_qo_heads);
    }
  }
}

template <int ROWS, int THREADS>
FJ_INLINE void merge_if_last(const Args& a, const WorkItem& item, const CtaCoords& cta, int tid) {
  merge_partials_if_last<ROWS, THREADS>(a.req_work_indptr, a.merge_counters, a.tile_counters, a.tmp_o, a.tmp_lse,
                                        a.out, a.out_stride,
                                        a.lse, a.num_qo_heads, item.request, item.q_begin, item.q_len, cta.kv_head,
                                        cta.row_tile, tid);
}

// A shared-prefix plan whose working CTAs fit one wave merges in the decode kernel
// (cfg::WAITING_MERGE, each record's part in its last field: FJ_MERGE_COUNTS or FJ_MERGE_WAITS;
// serving/shared_plan.py):
// a shared record's members have partials in several CTAs' records, so no CTA can count one
// request's arrivals as merge_partials_if_last does, and the last to arrive could be a shared
// record holding many members' merges. Instead every CTA that writes partials counts itself in
// at each (request, KV head) it wrote, except each request's last own item: that one waits there
// until the request's other partials are counted, combines them with its own into the output, and
// sets the counters back to 0. Every CTA it waits for precedes it in the grid, and in one wave all
// of them are resident, so the wait holds no slot another CTA needs. One thread's release (after
// the barrier that follows the CTA's writes) and acquire order the partials before their reads.
FJ_INLINE void release_add(int* counter) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(counter) : "memory");
}
FJ_INLINE int acquire_load(const int* counter) {
  int value;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(value) : "l"(counter) : "memory");
  return value;
}

// The CTA's threads have written partials of `requests` consecutive requests from `request` (a
// shared record's members; 1 for an own item) for `heads` KV heads from kv_head (a packed item's).
// waits: the CTA is its request's last own item, whose `splits` partials are in the slots from
// first_item on and whose query tokens are from q_begin (its record says all of it: no load of the
// merge's arrays stands between its tiles and its wait). Not inlined, as merge_partials_if_last.
template <int THREADS>
__device__ __noinline__ void merge_when_written(int* merge_counters, const float* tmp_o, const float* tmp_lse,
                                                out_t* out, i64 out_stride, float* lse, int num_qo_heads,
                                                int request, int requests, int kv_head, int heads, int q_begin,
                                                int q_len, bool waits, int first_item, int splits, int tid) {
  constexpr int D = cfg::HEAD_DIM, COLS4 = D / 4, G = cfg::GROUP_SIZE;
  __syncthreads();
  if (!waits) {  // count in: one arrival per (request, KV head) written
    if (tid < requests * heads)
      release_add(merge_counters + group_index(num_qo_heads, request + tid / heads, kv_head + tid % heads, 0, 1));
    return;
  }
  if (tid < heads) {
    int* counter = merge_counters + group_index(num_qo_heads, request, kv_head + tid, 0, 1);
    while (acquire_load(counter) != splits - 1) __nanosleep(32);
    *counter = 0;
  }
  __syncthreads();
  const int rows = G * q_len;
  const i64 item_stride = (i64)cfg::MAX_Q_LEN * num_qo_heads;  // between two slots' partials
  for (int cell = tid; cell < heads * rows * COLS4; cell += THREADS) {
    const int row = cell / COLS4 % rows, col = (cell % COLS4) * 4, q_tok = row / G;
    const int qo_head = (kv_head + cell / COLS4 / rows) * G + row % G;
    const float* lse_0 = tmp_lse + first_item * item_stride + (i64)q_tok * num_qo_heads + qo_head;
    combine_partials4(lse_0, tmp_o + (lse_0 - tmp_lse) * D + col, item_stride, splits, out, out_stride, lse,
                      num_qo_heads, q_begin + q_tok, qo_head, col);
  }
}

template <int THREADS>
FJ_INLINE void merge_when_written(const Args& a, const WorkItem& item, int requests, int kv_head, int heads,
                                  bool waits, int first_item, int splits) {
  merge_when_written<THREADS>(a.merge_counters, a.tmp_o, a.tmp_lse, a.out, a.out_stride, a.lse, a.num_qo_heads,
                              item.request, requests, kv_head, heads, item.q_begin, item.q_len, waits, first_item,
                              splits, threadIdx.x);
}

// Where chunk (16 bytes) `chunk` of shared-memory row `row` sits in a swizzled ring (PagedKVStage):
// inside its 128-byte block, XORed with the row's low 3 bits, so the same chunk of eight
// consecutive rows falls in eight different 16-byte bank groups. A row of whole blocks and a half
// (16-bit head_dim 96: 192 bytes) starts 64 bytes into a block on odd rows; its last half block
// (4 chunks) is XORed with (row / 2) % 4 instead: the even rows then spread over one half of the
// banks and the odd rows over the other. Either XOR keeps chunks 2m and 2m + 1 in one aligned 32 bytes.
// (flashjit.jit.layouts.swizzled_chunk: the render asserts it value by value.)
FJ_INLINE constexpr u32 swizzled_chunk(u32 row, u32 chunk) {
  constexpr u32 ROW_CHUNKS = cfg::HEAD_DIM * sizeof(kv_t) / 16;
  if constexpr (ROW_CHUNKS % 8 == 4) {
    if (chunk >= ROW_CHUNKS - 4) return chunk ^ (row / 2 % 4);
  }
  return chunk ^ (row % 8);
}

// Byte offset of byte column_bytes of a stage's key in a block-major ring of TILE keys a stage and
// PITCH bytes a key (cfg::SHARED_WGMMA): block b of every key a TILE x 128-byte column of the stage,
// as Hopper's warpgroup MMAs read an operand (flashjit.jit.layouts.block_major_offset).
FJ_INLINE constexpr u32 block_major_offset(int tile, int pitch, int stage, int key, u32 column_bytes) {
  return stage * tile * pitch + column_bytes / 128 * tile * 128 + key * 128 + column_bytes % 128;
}

// The dynamic shared memory from its first RING_ALIGN-aligned byte: the static shared memory before
// it leaves it only 16-byte aligned, and a cp.async whose 32-byte sector lands 16 bytes off a
// 32-byte boundary fetches that sector twice (ncu).
FJ_INLINE unsigned char* aligned_ring(unsigned char* smem) {
  return smem + (cfg::RING_ALIGN - (int)(__cvta_generic_to_shared(smem) % cfg::RING_ALIGN)) % cfg::RING_ALIGN;
}

// Cache offset (elements) of a token. The host keeps the strides below 2^31 (page_stride included),
// so the products are 32-bit multiplies into a 64-bit sum.
FJ_INLINE i64 token_offset(const Args& a, int page, int slot) {
  return (i64)page * (int)a.page_stride + slot * (int)a.slot_stride;
}

// Copies one pipeline stage (TILE keys x HEAD_DIM of K and of V, in 16-byte chunks) from the paged
// cache into shared-memory rows of K_PITCH and V_PITCH bytes. locate() resolves the thread's keys
// to cache offsets through the mask's kv_position and the page table; issue() starts the copies.
//
// Where the block allows it (EVEN), a thread copies one 16-byte column of LOADS consecutive keys.
// Those usually sit at consecutive positions of one page: then one page-table read and one offset
// serve them all (a "run"), which keeps the address arithmetic per stage to a few instructions.
// Otherwise (a page boundary, a mask's jump, the span's end) each key is resolved on its own.
//
// SWIZZLE: rows are unpadded and chunk c of row r sits at chunk c ^ (r % 8), within its 128 bytes;
// ldmatrix's eight rows of one column still hit eight different banks (swizzled_chunk()).
// cfg::SHARED_WGMMA (swizzled rows of whole 128-byte blocks): each stage is block-major, block b of
// every row in a TILE x 128-byte column (copy()), as Hopper's warpgroup MMAs read an operand.
// HEADS_APART: each thread's head lies head_offset elements past the CTA's (cfg::OWN_HEAD_PACK).
template <int TILE, int K_PITCH, int V_PITCH, int NT, bool SWIZZLE = false, bool HEADS_APART = false>
struct PagedKVStage {
  static constexpr int ELEMS = 16 / sizeof(kv_t);  // values per 16-byte chunk
  static constexpr int CPR = cfg::HEAD_DIM / ELEMS;
  static constexpr int CHUNKS = TILE * CPR;
  static constexpr int LOADS = ceil_div(CHUNKS, NT);
  static constexpr bool EVEN = NT % CPR == 0 && TILE % (NT / CPR) == 0;
  // Tiles start at a page boundary (WorkItem::tile_begin) and a thread's keys start at a multiple of
  // LOADS, so when LOADS divides the page they are span positions of one page. kv_position is
  // increasing there (docs/masks.md): the keys are consecutive iff the last is LOADS - 1 past the
  // first, and two kv_position calls test a run.
  static constexpr bool RUN_BY_ENDS = EVEN && cfg::PAGE_SIZE % LOADS == 0;
  // A LOADS that is no power of two (6 at head_dim 96, 3 for its fp8 rows) divides no power-of-two
  // page, so every few runs straddle a page boundary: consecutive keys over two pages then make a
  // run as well, split at the boundary (split_at: the first key on run_page_2).
  // (An enum: a static constexpr member would add a symbol to every cubin.)
  enum : bool { TWO_PAGE_RUNS = EVEN && !RUN_BY_ENDS && (LOADS & (LOADS - 1)) != 0 && 2 * cfg::PAGE_SIZE >= LOADS };
  // Each warp's threads copy exactly the 16 keys of its slice of the stage (whole key columns per
  // thread): a warp's slice may then hold a KV head of its own (cfg::OWN_HEAD_PACK).
  enum : bool { WARP_SLICES = EVEN && 32 % CPR == 0 && 32 / CPR * LOADS == 16 };
  static_assert(CPR * ELEMS == cfg::HEAD_DIM, "a K/V row is whole 16-byte chunks");

  const Args& a;
  const MaskParams& params;
  const kv_t* k_head; const kv_t* v_head;
  i64 head_offset;  // HEADS_APART: elements past k_head and v_head to this thread's head
  u32 k_ring, v_ring;  // shared-memory addresses of the K and V rings
  int tid, request, v_begin, v_end, kv_len, page_begin;  // the work item's (a reference would cost local memory)
  int phys[LOADS];  // physical token (page * PAGE_SIZE + slot) of each key, -1: zero-fill
  bool run;         // EVEN: the keys are consecutive tokens of one page: run_page's slots from run_slot
  int run_page, run_slot;  // the page index as loaded: issue() consumes it, a stage later
  int run_page_2, split_at;  // TWO_PAGE_RUNS: the run's second page, and its first key there (LOADS: none)

  // head_offset (HEADS_APART): elements from kv_head's K/V to this thread's head's, added to each
  // copy's offset (k_head and v_head stay the CTA's).
  FJ_INLINE PagedKVStage(const Args& a, const MaskParams& params, int kv_head, unsigned char* k_smem,
                         unsigned char* v_smem, int tid, const WorkItem& item, i64 head_offset = 0)
      : a(a), params(params), k_head(a.k + (i64)kv_head * a.head_stride), v_head(a.v + (i64)kv_head * a.head_stride),
        head_offset(head_offset),
        k_ring((u32)__cvta_generic_to_shared(k_smem)), v_ring((u32)__cvta_generic_to_shared(v_smem)), tid(tid),
        request(item.request), v_begin(item.v_begin), v_end(item.v_end), kv_len(item.kv_len),
        page_begin(item.page_begin) {}

  FJ_INLINE i64 heads_apart() const { return HEADS_APART ? head_offset : 0; }

  // Chunk i of this thread: its key (row) in the stage and its 16-byte column.
  FJ_INLINE bool owns(int i) const { return CHUNKS % NT == 0 || tid + i * NT < CHUNKS; }
  FJ_INLINE int key(int i) const { return EVEN ? (tid / CPR) * LOADS + i : (tid + i * NT) / CPR; }
  FJ_INLINE int column(int i) const { return EVEN ? tid % CPR : (tid + i * NT) % CPR; }

  FJ_INLINE void start_run(int first_pos) {
    run = true;
    run_page = __ldg(a.page_indices + page_begin + first_pos / cfg::PAGE_SIZE);
    run_slot = first_pos % cfg::PAGE_SIZE;
  }

  FJ_INLINE void locate(int tile_v0) {
    if constexpr (RUN_BY_ENDS) {
      const int first = tile_v0 + key(0), last = first + LOADS - 1;
      if (first >= v_begin && last < v_end) {
        const int p0 = mask_kv_position(params, request, first), p1 = mask_kv_position(params, request, last);
        if (p0 >= 0 && p1 < kv_len && p1 - p0 == LOADS - 1 && p0 / cfg::PAGE_SIZE == p1 / cfg::PAGE_SIZE) {
          start_run(p0);
          return;
        }
      }
    }
    run = false;
    int pos[LOADS];
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
      const int vpos = tile_v0 + key(i);
      pos[i] = owns(i) && vpos >= v_begin && vpos < v_end ? mask_kv_position(params, request, vpos) : -1;
    }
    if constexpr (TWO_PAGE_RUNS) {
      const int page_0 = pos[0] / cfg::PAGE_SIZE, page_1 = pos[LOADS - 1] / cfg::PAGE_SIZE;
      bool consecutive = pos[0] >= 0 && pos[LOADS - 1] < kv_len && page_1 - page_0 <= 1;
#pragma unroll
      for (int i = 1; i < LOADS; ++i) consecutive = consecutive && pos[i] == pos[0] + i;
      if (consecutive) {
        start_run(pos[0]);
        split_at = page_1 == page_0 ? LOADS : cfg::PAGE_SIZE - run_slot;
        run_page_2 = page_1 == page_0 ? run_page : __ldg(a.page_indices + page_begin + page_1);
        return;
      }
    } else if constexpr (EVEN && !RUN_BY_ENDS) {
      bool consecutive = pos[0] >= 0 && pos[LOADS - 1] < kv_len && pos[0] / cfg::PAGE_SIZE == pos[LOADS - 1] / cfg::PAGE_SIZE;
#pragma unroll
      for (int i = 1; i < LOADS; ++i) consecutive = consecutive && pos[i] == pos[0] + i;
      if (consecutive) {
        start_run(pos[0]);
        return;
      }
    }
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
      phys[i] = -1;
      if (pos[i] >= 0 && pos[i] < kv_len)
        phys[i] = __ldg(a.page_indices + page_begin + pos[i] / cfg::PAGE_SIZE) * cfg::PAGE_SIZE + pos[i] % cfg::PAGE_SIZE;
    }
  }

  FJ_INLINE void copy(int stage, int i, const kv_t* k_src, const kv_t* v_src, bool pred) {
    const u32 row = stage * TILE + key(i), column_bytes = (SWIZZLE ? swizzled_chunk(row, column(i)) : column(i)) * 16;
    if constexpr (cfg::SHARED_WGMMA) {  // block-major: the chunk's block, then its row's 128 bytes in it
      const u32 at = block_major_offset(TILE, K_PITCH, stage, key(i), column_bytes);
      cp_async_16<cfg::L2_PREFETCH>(k_ring + at, k_src, pred);
      cp_async_16<cfg::L2_PREFETCH>(v_ring + at, v_src, pred);
      return;
    }
    cp_async_16<cfg::L2_PREFETCH>(k_ring + row * K_PITCH + column_bytes, k_src, pred);
    cp_async_16<cfg::L2_PREFETCH>(v_ring + row * V_PITCH + column_bytes, v_src, pred);
  }

  FJ_INLINE void issue(int stage) {
    if constexpr (TWO_PAGE_RUNS) {
      if (run) {
        const i64 column_offset = column(0) * ELEMS + heads_apart();
        const i64 first = token_offset(a, run_page, run_slot) + column_offset;
        const i64 second = token_offset(a, run_page_2, 0) + column_offset;  // slot 0 of the next page
#pragma unroll
        for (int i = 0; i < LOADS; ++i) {
          const i64 at = i < split_at ? first + i * (int)a.slot_stride : second + (i - split_at) * (int)a.slot_stride;
          copy(stage, i, k_head + at, v_head + at, true);
        }
        return;
      }
    }
    if (EVEN && run) {
      const i64 offset = token_offset(a, run_page, run_slot) + column(0) * ELEMS + heads_apart();
      const kv_t* k_src = k_head + offset;
      const kv_t* v_src = v_head + offset;
#pragma unroll
      for (int i = 0; i < LOADS; ++i) copy(stage, i, k_src + i * (int)a.slot_stride, v_src + i * (int)a.slot_stride, true);
      return;
    }
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
      if (!owns(i)) continue;
      const bool pred = phys[i] >= 0;
      const i64 at = pred ? token_offset(a, phys[i] / cfg::PAGE_SIZE, phys[i] % cfg::PAGE_SIZE) + column(i) * ELEMS +
                                heads_apart()
                          : 0;
      copy(stage, i, k_head + at, v_head + at, pred);
    }
  }
};

// The ring: STAGES - 1 stages in flight while one is consumed. The next stage's page lookups are
// issued one iteration before its copies, so page-table latency stays off the copy path.
// prepare() runs once the first stages' copies are issued: the CTA's setup that the copies do not
// need (Q and its conversion, the scales) then overlaps their flight instead of delaying the first
// page lookup by a round trip (a Q conversion waits for Q's load). consume(stage, t) runs between
// two barriers with tile t resident in `stage`. stride: the positions a stage advances (TILE, or
// fewer where the stage's keys are several heads' positions: cfg::OWN_HEAD_PACK).
template <int STAGES, int TILE, class Stage, class Prepare, class Consume>
FJ_INLINE void stream_tiles(Stage& loader, int v_begin, int num_tiles, Prepare&& prepare, Consume&& consume,
                            int stride = TILE) {
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < num_tiles) {
      loader.locate(v_begin + s * stride);
      loader.issue(s);
    }
    cp_async_commit();
  }
  if (STAGES - 1 < num_tiles) loader.locate(v_begin + (STAGES - 1) * stride);
  prepare();
  for (int t = 0; t < num_tiles; ++t) {
    const int ahead = t + STAGES - 1;
    if (ahead < num_tiles) {
      loader.issue(ahead % STAGES);
      if (ahead + 1 < num_tiles) loader.locate(v_begin + (ahead + 1) * stride);
    }
    cp_async_commit();
    cp_async_wait<STAGES - 1>();
    if constexpr (cfg::SHARED_WGMMA) fence_async_proxy();  // this thread's copies, before wgmma reads them
    __syncthreads();
    if (t == 0) FJ_STAMP(1);
    consume(t % STAGES, t);
    __syncthreads();
  }
  FJ_STAMP(2);
  cp_async_wait<0>();
}

// stream_tiles over the tiles of a sharing group's span (the whole request's), shared by the CTAs
// of its items (share of sharers; cfg::STATIC_SHARE < 100). CTAs with the same work finish far
// apart (the memory system serves some SMs faster), so a fixed split leaves the fast ones idle in
// the tail. Here each CTA first reads a static run of STATIC_SHARE % of its fair share, then claims
// pool tiles one at a time from the group's counter: the fast CTAs read more of the pool. The
// partials stay exact, whatever tiles each CTA read (the merge weighs them by their LSEs), but
// which tiles each read, and so the rounding of the output, depends on timing; a CTA left without
// tiles writes an empty partial. A group of one item (a direct item, or any item of a fixed
// split), or a fair share of at most STAGES + 1 tiles, reads its tiles statically: the same tiles,
// in the same order, at every launch.
//
// Thread 0 decides the tile of each sequence number j (SharedTiles::tile) and publishes it in
// tiles[j % SLOTS]; the other threads only read that, so the scheme costs them one register.
// It claims the tile of sequence t + 1 + STAGES at the start of iteration t (the atomic's latency
// hides behind consume) and publishes it before the iteration's last barrier, one iteration before
// locate() needs it. Claims come out increasing, and once a static tile is past the end so is the
// pool, so the first tile past the end (-1) ends the stream.
struct SharedTiles {
  static constexpr int SLOTS = 8;  // sequence numbers in use at once: t .. t + 1 + STAGES
  int tiles[SLOTS];                // tile of sequence number j at j % SLOTS; -1: past the end
  int total, head, first, pool;    // the group's tiles; this CTA's static run [first, first + head); pool start

  FJ_INLINE bool shares() const { return pool < total; }
  // Tile of sequence number j, given the pool claim taken for it (if j >= head and shares()).
  FJ_INLINE int tile(int j, int claim) const {
    const int t = j < head ? first + j : shares() ? pool + claim : total;
    return t < total ? t : -1;
  }
};

template <int STAGES, int TILE, class Stage, class Prepare, class Consume>
FJ_INLINE void stream_shared_tiles(Stage& loader, const WorkItem& item, int* counter, Prepare&& prepare,
                                   Consume&& consume) {
  constexpr int SLOTS = SharedTiles::SLOTS;
  static_assert(SLOTS >= STAGES + 2, "a slot is not reused while read");
  __shared__ SharedTiles shared;
  if (threadIdx.x == 0) {
    const int total = item.num_tiles(TILE), fair = ceil_div(total, item.sharers);
    const int head = item.sharers == 1 || fair <= STAGES + 1 ? fair : max(STAGES + 1, fair * cfg::STATIC_SHARE / 100);
    shared.total = total; shared.head = head; shared.first = item.share * head; shared.pool = item.sharers * head;
#pragma unroll
    for (int j = 0; j <= STAGES; ++j) shared.tiles[j] = shared.tile(j, total);  // static (or past the end)
  }
  __syncthreads();
  const auto position = [&](int tile) { return item.tile_begin + tile * TILE; };
#pragma unroll
  for (int j = 0; j < STAGES - 1; ++j) {
    if (shared.tiles[j] >= 0) {
      loader.locate(position(shared.tiles[j]));
      loader.issue(j);
    }
    cp_async_commit();
  }
  if (shared.tiles[STAGES - 1] >= 0) loader.locate(position(shared.tiles[STAGES - 1]));
  prepare();
  for (int t = 0;; ++t) {
    const int tile = shared.tiles[t % SLOTS];
    if (tile < 0) break;
    const int next = t + 1 + STAGES;  // the sequence number thread 0 claims for now
    int claim = 0;
    if (threadIdx.x == 0 && next >= shared.head && shared.shares()) claim = atomicAdd(counter, 1);
    const int ahead = t + STAGES - 1;
    if (shared.tiles[ahead % SLOTS] >= 0) {
      loader.issue(ahead % STAGES);
      const int after = shared.tiles[(ahead + 1) % SLOTS];
      if (after >= 0) loader.locate(position(after));
    }
    cp_async_commit();
    cp_async_wait<STAGES - 1>();
    __syncthreads();
    if (t == 0) FJ_STAMP(1);
    consume(t % STAGES, tile);
    if (threadIdx.x == 0) shared.tiles[next % SLOTS] = shared.tile(next, claim);
    __syncthreads();
  }
  FJ_STAMP(2);
  cp_async_wait<0>();
}

// A tensor-core CTA's tiles: its item's (stream_tiles), or with cfg::STATIC_SHARE < 100 its sharing
// group's, shared with the group's other CTAs (stream_shared_tiles). ROWS: query rows per CTA.
template <int STAGES, int TILE, int ROWS, class Stage, class Prepare, class Consume>
FJ_INLINE void stream_item_tiles(Stage& loader, const Args& a, const WorkItem& item, const CtaCoords& cta,
                                 Prepare&& prepare, Consume&& consume) {
  if constexpr (cfg::STATIC_SHARE < 100) {
    constexpr int ROW_TILES = ceil_div(cfg::GROUP_SIZE * cfg::MAX_Q_LEN, ROWS);
    int* counter = a.tile_counters + group_index(a.num_qo_heads, item.request, cta.kv_head, cta.row_tile, ROW_TILES);
    stream_shared_tiles<STAGES, TILE>(loader, item, counter, prepare, consume);
  } else {
    stream_tiles<STAGES, TILE>(loader, item.tile_begin, item.num_tiles(TILE), prepare, consume);
  }
}

}  // namespace decode
