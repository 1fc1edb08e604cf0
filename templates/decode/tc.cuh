//! needs: common/prelude.cuh common/kv_types.cuh worklist/kernel_core.cuh common/scoring.cuh common/mma.cuh
// Paged-KV decode attention on tensor cores for 16-bit K/V (mma.sync m16n8k16, sm_80+): one CTA
// per (work item, KV head, tile of 16 query rows). The rows are the GQA group's heads times the
// request's query tokens, packed into the MMA's M dimension, so each K/V byte is read once for the
// whole group and the arithmetic costs a few instructions per key instead of tens. K and V reach
// the MMAs through ldmatrix. (fp8 caches take decode/tc_fp8.cuh.)
//
// Expects from the including template:
//   namespace cfg: HEAD_DIM PAGE_SIZE GROUP_SIZE MAX_Q_LEN WARPS COL_SPLIT STAGES K_PITCH V_PITCH Q_SMEM_BYTES
//   types q_t, kv_t, out_t (fj::half_t or fj::bfloat16_t)
//   the mask and variant templates (through common/scoring.cuh's FJ_SCORE_KEY and the sink helpers
//   of worklist/kernel_core.cuh).
//
// Each warp owns a 16-key slice of every pipeline stage (S = Q K^T, online softmax, O += P V in
// registers); the warps' states meet in shared memory at the end. With COL_SPLIT > 1, that many
// warps share a slice: each computes the same S and keeps D / COL_SPLIT columns of O (head_dim 256,
// where one warp holding all of O sits at the register limit and ptxas takes over a second).
// With SPLIT_SCORES they split S's k-steps instead of repeating them: each warp multiplies its
// share of Q (in registers) by the same dims of K, and the slice sums the COL_SPLIT partial S
// tiles in shared memory behind a barrier of its own warps (head_dim 512, where repeating S
// bounds the kernel by shared-memory reads and a chain of 32 dependent MMAs per key slice).
// A shared-prefix record (cfg::SHARED_ROW_WARPS > 1) turns this around: its rows are many (GQA
// group x members), so each warp takes 16 rows of its own and every key of a stage, and a CTA holds
// WARPS x 16 rows with one copy of each K/V tile; ordinary records of the same kernel run as above.
// On Hopper (cfg::SHARED_WGMMA, compiled for sm_90a) those 64 rows are one warpgroup's wgmma tile,
// over a ring laid out block-major for it; elsewhere a warp attends SHARED_STEP slices at a time.
// A short own item of such a kernel may take WARPS KV heads in one CTA (cfg::OWN_HEAD_PACK): warp
// g attends head kv_head + g over 16 keys a stage, the slice its threads copy, so one CTA's chain
// of loads (record, page ids, K and V) serves WARPS heads and its stream runs WARPS times longer.
// Only the entry point attend_packed() reads such records (an eager plan without them launches
// attend(), which runs the other records without the packed path's branches: 1-2% faster on the
// H200; a CUDA graph of a kernel that packs launches attend_packed() at every replay).
// Same outputs as decode/cuda_core.cuh: direct for one-item requests, else normalized fp32 partials and
// base-2 LSEs for the merge.
// Empty spans and fully masked rows give o = 0, lse = -inf: never NaN.

namespace decode {
using namespace fj;

constexpr int D = cfg::HEAD_DIM;
constexpr int K_PITCH = cfg::K_PITCH;     // smem row bytes (D elements swizzled, or D + 8: conflict-free ldmatrix)
constexpr int V_PITCH = cfg::V_PITCH;
constexpr int WARPS = cfg::WARPS;
constexpr int NT = 32 * WARPS;
constexpr int COL_SPLIT = cfg::COL_SPLIT;  // warps per key slice, each with its share of O's columns
constexpr int SLICES = WARPS / COL_SPLIT;  // key slices per stage, one softmax state each
constexpr int M = 16;                     // query rows per CTA
constexpr int ROWS_TOTAL = cfg::GROUP_SIZE * cfg::MAX_Q_LEN;
constexpr int TILE = 16 * SLICES;         // keys per pipeline stage
constexpr int STAGES = cfg::STAGES;
constexpr bool SWIZZLE = cfg::SWIZZLE;    // the ring's rows are unpadded and swizzled (PagedKVStage)
enum : int { MERGE_ROLES = FJ_MERGE_COUNTS | FJ_MERGE_WAITS };  // a record's last field: not its heads
constexpr int KSTEPS = D / 16;            // MMA k-steps of S = Q K^T
constexpr int NTILES = D / 8 / COL_SPLIT;  // MMA n-tiles of O per warp
constexpr bool Q_IN_SMEM = cfg::Q_SMEM_BYTES > 0;  // Q's fragments in shared memory, not registers
enum : bool { SPLIT_SCORES = cfg::SPLIT_SCORES };
enum : int { QSTEPS = SPLIT_SCORES ? KSTEPS / COL_SPLIT : KSTEPS };  // S's k-steps per warp
// > 1: shared-prefix records give each warp rows of its own (enums, as HALF_BLOCK below).
enum : int { ROW_WARPS = cfg::SHARED_ROW_WARPS };
enum : bool { ROWS_BY_WARP = ROW_WARPS > 1 };
// Slices a rows-by-warp record's warp attends in one softmax step: its S chains run side by side,
// where one slice at a time leaves the warp waiting on each chain's latency.
enum : int { SHARED_STEP = cfg::SHARED_STEP };
// Rows of whole 128-byte blocks and a half (head_dim 96): the last k-steps and n-tile pairs read the
// half block, which swizzled_chunk XORs with (row / 2) % 4 rather than row % 8. (An enum: a
// constexpr variable would add a symbol to every cubin.)
enum : bool { HALF_BLOCK = D * 2 % 128 == 64 };
// Bytes between two keys' rows of a stage and between two 128-byte blocks of one row: rows side by
// side, or block-major for the warpgroup MMAs (cfg::SHARED_WGMMA: PagedKVStage::copy).
enum : int {
  K_ROW = cfg::SHARED_WGMMA ? 128 : K_PITCH, V_ROW = cfg::SHARED_WGMMA ? 128 : V_PITCH,
  ROW_BLOCK = cfg::SHARED_WGMMA ? TILE * 128 : 128
};
using mma_t = kv_t;

static_assert(sizeof(q_t) == 2 && sizeof(kv_t) == 2, "16-bit queries and K/V");
static_assert(WARPS % COL_SPLIT == 0 && (COL_SPLIT == 1 || NTILES % 8 == 0), "whole 128-byte column blocks per warp");
static_assert(D * 2 % 128 == 0 || (HALF_BLOCK && COL_SPLIT == 1), "rows of whole blocks, or one warp per slice");
static_assert(STAGES * TILE * (K_PITCH + V_PITCH) >= SLICES * M * D * 4, "the slices' reduction fits in the ring");
static_assert(!Q_IN_SMEM || cfg::Q_SMEM_BYTES == KSTEPS * 32 * 16, "one 16-byte fragment per k-step and lane");
static_assert(!ROWS_BY_WARP || (cfg::SHARED_PREFIX && ROW_WARPS == WARPS && COL_SPLIT == 1 && !Q_IN_SMEM),
              "rows by warp: shared-prefix records, one warp per slice, Q in registers");
#ifndef FJ_WGMMA
static_assert(!cfg::SHARED_WGMMA, "a wgmma kernel includes the wrappers (wgmma.cuh.j2) before this header");
#endif
static_assert(!cfg::SHARED_WGMMA || (ROWS_BY_WARP && WARPS == 4 && TILE == 64 && SWIZZLE && !HALF_BLOCK &&
                                     K_PITCH == D * 2 && V_PITCH == D * 2 && (D == 64 || D == 128)),
              "shared records on wgmma: one warpgroup of 64 rows, 64 keys a stage, rows of whole swizzled blocks");
static_assert(SLICES % SHARED_STEP == 0 && (SHARED_STEP == 1 || (ROWS_BY_WARP && !SPLIT_SCORES)),
              "whole steps of slices, several a step only with rows by warp");
static_assert(cfg::OWN_HEAD_PACK == 1 || (ROWS_BY_WARP && cfg::OWN_HEAD_PACK == WARPS && ROWS_TOTAL <= M && cfg::HEADS_FIRST &&
                                          cfg::STATIC_SHARE == 100 &&
                                          PagedKVStage<TILE, K_PITCH, V_PITCH, NT, SWIZZLE>::WARP_SLICES),
              "heads by warp: a warp's rows are one head's whole group, its slice the keys its threads copy");
static_assert(!cfg::SHARED_PREFIX || (!VARIANT_SINK && !VARIANT_LOGITS),
              "shared-prefix kernels take no variant: a shared record's rows publish no sinks");
static_assert(!SPLIT_SCORES || (COL_SPLIT > 1 && !Q_IN_SMEM && QSTEPS % 4 == 0 && !HALF_BLOCK),
              "split scores: col-split warps, Q in registers, each warp's k-steps whole 128-byte blocks of K's rows");

// The barrier of one slice's COL_SPLIT warps (named barrier 1 + slice; __syncthreads is 0).
FJ_INLINE void slice_barrier(int slice) {
  asm volatile("bar.sync %0, %1;" ::"r"(1 + slice), "r"(32 * COL_SPLIT) : "memory");
}

// A record's part in the plan: a shared-prefix record (serving/shared_plan.py; its splits field is
// -members) has members > 0, an ordinary item 0. slot: where an ordinary item's partial goes, its
// record's share field (such a kernel's tiling shares no tiles, serving/shared_plan.py); else its
// grid position. slots: an own item's request's partial slots. merge_role: where the plan merges in
// this kernel (merge_when_written, not flashjit_merge), the record's part: FJ_MERGE_COUNTS or
// FJ_MERGE_WAITS.
struct PlanPart {
  int members, slot, slots, merge_role;

  FJ_INLINE PlanPart(const Args& a, int w) {
    members = 0, slot = w, slots = 0, merge_role = 0;
    if constexpr (cfg::SHARED_PREFIX) {
      slots = __ldg(a.work_items + WorkItem::RECORD_INT4S * w + 1).w;
      const int4 tail = __ldg(a.work_items + WorkItem::RECORD_INT4S * w + 2);
      members = slots < 0 ? -slots : 0;
      slot = tail.x;
      merge_role = cfg::WAITING_MERGE ? tail.w & MERGE_ROLES : 0;
    }
  }
};

// Whether record w is a packed own item, whose CTA attends HEAD_PACK KV heads (attend_packed): an
// eager plan's grid holds them from a.packed_from on, a CTA for each HEAD_PACK heads; a graph's
// (packed_from < 0) gives every record a CTA a head, and the record's last field (past the merge
// roles) names its heads.
template <int HEAD_PACK>
FJ_INLINE bool packed_record(const Args& a, int w) {
  if constexpr (HEAD_PACK == 1) return false;
  return a.packed_from < 0 ? (__ldg(a.work_items + WorkItem::RECORD_INT4S * w + 2).w & ~MERGE_ROLES) > 1
                           : w >= a.packed_from;
}

// Once the CTA's partials are written, where the plan merges in this kernel (a shared record
// counts in its members; a request's only item, direct, writes the output and merges nothing). A
// waiting item's slot is its request's last. packed: the CTA attended HEAD_PACK KV heads from kv_head.
template <int HEAD_PACK>
FJ_INLINE void merge_here(const Args& a, const WorkItem& item, const PlanPart& part, int kv_head, bool packed) {
  if constexpr (cfg::WAITING_MERGE) {
    if (part.merge_role != 0 && !item.direct)
      merge_when_written<NT>(a, item, part.members > 0 ? part.members : 1, kv_head, packed ? HEAD_PACK : 1,
                             part.merge_role == FJ_MERGE_WAITS, part.slot + 1 - part.slots, part.slots);
  }
}

// The two query rows this thread's fragments touch, quad and quad + 8 of the CTA's 16 (or, with rows
// by warp, of the warp's): as the mask and the variant see them, and where their queries and
// partials are. A shared-prefix record's rows are the GQA groups x query tokens of `members`
// requests from item.request on, over a span every one of their queries sees whole (the planner
// shares nothing else). A view of arrays attend_records declares one by one: kept apart, they
// compile as the kernel's other locals do (one struct of arrays numbered the registers otherwise).
struct FragmentRows {
  int (&tok)[2];     // the row's query token in its request
  int (&head)[2];    // its query head
  int (&pos)[2];     // its query token's position in the sequence
  int (&token)[2];   // the row's query token in q
  int (&member)[2];  // a shared record's member of the row
  int (&slot)[2];    // shared-prefix kernels: the slot of the row's partial
  bool (&valid)[2];  // the tile holds a row there

  // The rows first_row (the thread's quad's) and first_row + 8, of KV head kv_head's group; members:
  // a shared record's (0: an ordinary item); slot_of_item: where an ordinary item's partial goes.
  FJ_INLINE void locate(const WorkItem& item, int first_row, int kv_head, bool packed, int members,
                        int slot_of_item) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = first_row + 8 * h;
      tok[h] = row / cfg::GROUP_SIZE;
      head[h] = kv_head * cfg::GROUP_SIZE + row % cfg::GROUP_SIZE;
      valid[h] = row < ROWS_TOTAL && tok[h] < item.q_len;
      pos[h] = item.kv_len - item.q_len + tok[h];
      token[h] = item.q_begin + tok[h];
      if constexpr (cfg::SHARED_PREFIX) {
        slot[h] = packed ? slot_of_item : 0;  // (a shared record's rows: their member's, in read_members)
        if (members > 0) {
          member[h] = tok[h] / item.q_len;
          tok[h] -= member[h] * item.q_len;
          valid[h] = member[h] < members;
          pos[h] = 0x3fffffff;  // past every key: the whole span is visible
        }
      }
    }
  }

  // A shared record's rows take their member's query token and partial slot: a load before the
  // query's.
  FJ_INLINE void read_members(const Args& a, const WorkItem& item) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      token[h] = valid[h] ? __ldg(a.req_qo_indptr + item.request + member[h]) + tok[h] : 0;
      slot[h] = valid[h] ? __ldg(a.req_work_indptr + item.request + member[h]) + item.q_begin : 0;
    }
  }

  // Row h as the mask and the variant see it.
  FJ_INLINE QueryRow query(int h) const { return QueryRow{tok[h], pos[h], head[h], valid[h]}; }
};

// ldmatrix addresses inside a stage: lane l serves row l % 8 of matrix l / 8. The 16-byte chunk of
// k-step k is 2k ^ k_chunk and that of n-tile pair n is n ^ v_chunk: the steps are even, so the
// XOR adds the lane's column, and in a swizzled ring (PagedKVStage) also flips its row's low bits.
// Written as a 128-byte block plus a chunk inside it: four distinct offsets per lane.
struct StageLanes {
  int k_ld, k_chunk, v_ld, v_chunk;
  int k_chunk_half, v_chunk_half;  // HALF_BLOCK: the chunks of the last half block

  FJ_INLINE StageLanes(int lane, int slice, int col_part) {
    const int mat = lane / 8, mrow = lane % 8, swizzle = SWIZZLE ? mrow : 0;
    // A column part starts NTILES n-tiles (whole 128-byte blocks) into V's rows.
    k_ld = (slice * 16 + mrow + (mat >> 1) * 8) * K_ROW, k_chunk = (mat & 1) ^ swizzle;  // K: [keys][dims]
    v_ld = (slice * 16 + mrow + (mat & 1) * 8) * V_ROW + col_part * NTILES / 8 * ROW_BLOCK,
    v_chunk = (mat >> 1) ^ swizzle;  // V: transposed
    const int half_swizzle = SWIZZLE ? mrow / 2 % 4 : 0;
    k_chunk_half = (mat & 1) ^ half_swizzle, v_chunk_half = (mat >> 1) ^ half_swizzle;
  }
  // The lane's chunk of k-step k of K, and of n-tile pair n of V (the last half block's from
  // k-step KSTEPS - 2 and n-tile NTILES - 4 on).
  FJ_INLINE int k_chunk_of(int k) const { return HALF_BLOCK && k >= KSTEPS - 2 ? k_chunk_half : k_chunk; }
  FJ_INLINE int v_chunk_of(int n) const { return HALF_BLOCK && n >= NTILES - 4 ? v_chunk_half : v_chunk; }
};

// S = Q K^T for ns slices of 16 keys from ks (the stage's keys at the warp's first k-step): slice i
// in s[2i + j], [0..1] rows quad and [2..3] rows quad + 8, keys 16i + 8j + pair (+1). Q is qa's
// fragments, or with Q_IN_SMEM q_frags' (written by load_queries).
FJ_INLINE void slice_scores(float (*s)[4], int ns, const unsigned char* ks, const StageLanes& lanes,
                            const u32 (*qa)[4], const uint4* q_frags, int lane) {
#pragma unroll
  for (int j = 0; j < 2 * ns; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
  for (int k = 0; k < QSTEPS; ++k) {
#pragma unroll
    for (int i = 0; i < ns; ++i) {
      u32 kb[4];
      ldmatrix_x4(kb, ks + i * 16 * K_ROW + lanes.k_ld + (k / 4) * ROW_BLOCK + ((2 * k % 8) ^ lanes.k_chunk_of(k)) * 16);
      if constexpr (Q_IN_SMEM) {
        const uint4 f = q_frags[k * 32 + lane];
        const u32 qf[4] = {f.x, f.y, f.z, f.w};
        Mma<mma_t>::run(s[2 * i], qf, kb[0], kb[1]);
        Mma<mma_t>::run(s[2 * i + 1], qf, kb[2], kb[3]);
      } else {
        Mma<mma_t>::run(s[2 * i], qa[k], kb[0], kb[1]);
        Mma<mma_t>::run(s[2 * i + 1], qa[k], kb[2], kb[3]);
      }
    }
  }
}

// SPLIT_SCORES: each warp of a slice holds S over its share of the k-steps; every warp adds the
// COL_SPLIT parts in the same order, so all hold one S. The parts go through score_parts, two rounds
// deep: [slice][round % 2][warp][j][lane] (a warp rewrites a round's buffer only after the next
// round's barrier, which every reader of it has passed).
FJ_INLINE void sum_score_parts(float (*s)[4], float4* score_parts, int& score_round, int slice, int col_part,
                               int lane) {
  float4* parts = score_parts + (slice * 2 + score_round) * COL_SPLIT * 2 * 32;
  score_round ^= 1;
#pragma unroll
  for (int j = 0; j < 2; ++j)
    parts[(col_part * 2 + j) * 32 + lane] = make_float4(s[j][0], s[j][1], s[j][2], s[j][3]);
  slice_barrier(slice);
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    float4 sum = parts[j * 32 + lane];
#pragma unroll
    for (int c = 1; c < COL_SPLIT; ++c) {
      const float4 part = parts[(c * 2 + j) * 32 + lane];
      sum.x += part.x; sum.y += part.y; sum.z += part.z; sum.w += part.w;
    }
    s[j][0] = sum.x; s[j][1] = sum.y; s[j][2] = sum.z; s[j][3] = sum.w;
  }
}

// Scale, mask and variant (KeyScorer), the online-softmax update (O rescaled where a row's max grew)
// and P: the scores of nj n-tiles of 8 keys from key0 (s[j], MMA C fragments) become P's A
// fragments, 16 keys each. score_scale: S's units to base-2 logits; pair: the lane's first key.
// o, m, dsum: the rows' online-softmax state (O's fragments of the warp's column part, each row's
// running maximum in base 2 and its sum so far).
FJ_INLINE void probabilities(float (*s)[4], int nj, int key0, u32 (*pa)[4], const KeyScorer& scorer,
                             const FragmentRows& rows, float score_scale, int pair, float (*o)[4], float* m,
                             float* dsum) {
  // (row maxima reduced over the row's 4 lanes)
  float tile_max[2] = {FJ_NEG_INF, FJ_NEG_INF};
#pragma unroll
  for (int j = 0; j < nj; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      FJ_SCORE_KEY(SpanKeys::mapped, VariantKeys::visible, scorer, rows.query(e >> 1), key0 + 8 * j + pair + (e & 1),
                   s[j][e] * score_scale, s[j][e], tile_max[e >> 1]);
  }
  float m_ref[2], rescale[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
    tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
    rescale[h] = advance_max(tile_max[h], m[h], m_ref[h], dsum[h]);
  }
  // After the first tiles the running max rarely grows: skip O's rescale when no row's did.
  if (__any_sync(0xffffffffu, rescale[0] != 1.f || rescale[1] != 1.f)) {
#pragma unroll
    for (int n = 0; n < NTILES; ++n) {
      o[n][0] *= rescale[0]; o[n][1] *= rescale[0];
      o[n][2] *= rescale[1]; o[n][3] *= rescale[1];
    }
  }
  // P (the C fragments of S) is the A fragment of O += P V, 16 keys a slice.
#pragma unroll
  for (int j = 0; j < nj; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[j][e] = exp2_approx(s[j][e] - m_ref[e >> 1]);
      dsum[e >> 1] += s[j][e];
    }
    pa[j / 2][2 * (j % 2)] = Mma<mma_t>::pack(s[j][0], s[j][1]);
    pa[j / 2][2 * (j % 2) + 1] = Mma<mma_t>::pack(s[j][2], s[j][3]);
  }
}

// O += P V for ns slices of 16 keys of a stage, from `past` slices after the warp's own, over the
// warp's NTILES n-tiles of O.
FJ_INLINE void accumulate_values(float (*o)[4], const u32 (*pa)[4], int ns, const unsigned char* v_smem, int stage,
                                 int past, const StageLanes& lanes) {
  const unsigned char* vs = v_smem + stage * TILE * V_PITCH + past * 16 * V_ROW;
#pragma unroll
  for (int i = 0; i < ns; ++i) {
#pragma unroll
    for (int n = 0; n < NTILES; n += 2) {
      u32 vb[4];
      ldmatrix_x4_trans(vb, vs + i * 16 * V_ROW + lanes.v_ld + (n / 8) * ROW_BLOCK + ((n % 8) ^ lanes.v_chunk_of(n)) * 16);
      Mma<mma_t>::run(o[n], pa[i], vb[0], vb[1]);
      Mma<mma_t>::run(o[n + 1], pa[i], vb[2], vb[3]);
    }
  }
}

#ifdef FJ_WGMMA
// Stage `stage`, tile t, of a rows-by-warp record on the warpgroup MMAs (cfg::SHARED_WGMMA):
// the CTA's warps are one warpgroup, its 64 rows one M tile. S (64 rows x the stage's keys) and O
// (64 x D) land in the registers where each warp's mma.sync fragments of its 16 rows would, so
// probabilities() and the epilogue serve both; Q and P are the A operands, in registers; K
// (K-major) and V (N-major) are read from the block-major stage by descriptor.
FJ_INLINE void attend_stage_wgmma(const unsigned char* k_smem, const unsigned char* v_smem, int stage, int t,
                                  const u32 (*qa)[4], const KeyScorer& scorer, const FragmentRows& rows,
                                  float score_scale, int pair, float (&o)[NTILES][4], float* m, float* dsum) {
  const int key0 = scorer.item.tile_begin + t * TILE;
  if (key0 >= scorer.item.v_end) return;  // (keys of the stage past the span are zero-filled: P = 0 there)
  const u32 k_at = (u32)__cvta_generic_to_shared(k_smem + stage * TILE * K_PITCH);
  const u32 v_at = (u32)__cvta_generic_to_shared(v_smem + stage * TILE * V_PITCH);
  float s[TILE / 8][4];
  float(&s_all)[TILE / 2] = reinterpret_cast<float(&)[TILE / 2]>(s);
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < KSTEPS; ++k)
    wgmma_rs_kmajor(s_all, qa[k], smem_operand(k_at + k / 4 * ROW_BLOCK + k % 4 * 32, 16), k > 0);
  wgmma_commit();
  wgmma_wait<0>();
  hold_registers(s_all);
  u32 pa[TILE / 16][4];
  probabilities(s, TILE / 8, key0, pa, scorer, rows, score_scale, pair, o, m, dsum);
  float(&o_all)[NTILES * 4] = reinterpret_cast<float(&)[NTILES * 4]>(o);
  wgmma_fence();
#pragma unroll
  for (int i = 0; i < TILE / 16; ++i)  // keys 16i..16i + 15, D columns in blocks of 64 keys' rows
    wgmma_rs_nmajor(o_all, pa[i], smem_operand(v_at + i * 16 * 128, ROW_BLOCK), 1);
  wgmma_commit();
  wgmma_wait<0>();
  hold_registers(o_all);
}
#endif

// The end of a record whose warps hold rows of their own (a shared record's rows by warp, or a packed
// item's head): each warp finishes its rows from its registers. A packed item that is its request's
// only one (a shared record never is) writes the output; every other record its partials.
template <int HEAD_PACK>
FJ_INLINE void finish_rows_by_warp(const Args& a, const WorkItem& item, const FragmentRows& rows, float (*o)[4],
                                   const float* m, float* dsum, float value_scale, int lane, int pair) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    dsum[h] += __shfl_xor_sync(0xffffffffu, dsum[h], 1);
    dsum[h] += __shfl_xor_sync(0xffffffffu, dsum[h], 2);
    if (!rows.valid[h]) continue;
    const float inv = dsum[h] > 0.f ? value_scale / dsum[h] : 0.f;
    if (HEAD_PACK > 1 && item.direct) {
      const int token = item.q_begin + rows.tok[h];
      out_t* row_out = a.out + (i64)token * a.out_stride + rows.head[h] * D + pair;
#pragma unroll
      for (int n = 0; n < NTILES; ++n)
        *reinterpret_cast<u32*>(row_out + 8 * n) = (u32)Convert<out_t>::from_float(o[n][2 * h] * inv) |
                                                   ((u32)Convert<out_t>::from_float(o[n][2 * h + 1] * inv) << 16);
      if (a.lse != nullptr && lane % 4 == 0)
        a.lse[(i64)token * a.num_qo_heads + rows.head[h]] =
            dsum[h] > 0.f ? (m[h] + log2_approx(dsum[h])) * FJ_LN2 : FJ_NEG_INF;
      continue;
    }
    const i64 at = ((i64)rows.slot[h] * cfg::MAX_Q_LEN + rows.tok[h]) * a.num_qo_heads + rows.head[h];
#pragma unroll
    for (int n = 0; n < NTILES; ++n)
      *reinterpret_cast<float2*>(a.tmp_o + at * D + 8 * n + pair) = make_float2(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
    if (lane % 4 == 0) a.tmp_lse[at] = dsum[h] > 0.f ? m[h] + log2_approx(dsum[h]) : FJ_NEG_INF;
  }
}

// The slices' states, for finish_rows: each row's sum over the quad's lanes, then every slice's m,
// sum (the warps of a slice hold the same) and O in shared memory, red_o laid out [SLICES][M][D].
FJ_INLINE void publish_slice_states(const float (*o)[4], const float* m, float* dsum, float* red_o, float (*red_m)[M],
                                    float (*red_d)[M], int slice, int col_part, int lane) {
  const int quad = lane / 4, pair = (lane % 4) * 2;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    dsum[h] += __shfl_xor_sync(0xffffffffu, dsum[h], 1);
    dsum[h] += __shfl_xor_sync(0xffffffffu, dsum[h], 2);
    if (lane % 4 == 0 && col_part == 0) {
      red_m[slice][quad + 8 * h] = m[h];
      red_d[slice][quad + 8 * h] = dsum[h];
    }
    float* red_row = red_o + (slice * M + quad + 8 * h) * D + col_part * NTILES * 8;
#pragma unroll
    for (int n = 0; n < NTILES; ++n) {
      *reinterpret_cast<float2*>(red_row + 8 * n + pair) = make_float2(o[n][2 * h], o[n][2 * h + 1]);
    }
  }
}

// PACKED: the records may be packed own items (attend_packed).
template <bool PACKED>
FJ_INLINE void attend_records(const Args& a, const MaskParams& unbound, const VariantParams& vparams) {
  enum : int { HEAD_PACK = PACKED ? cfg::OWN_HEAD_PACK : 1 };  // KV heads a packed item's CTA attends
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = aligned_ring(smem_raw);
  unsigned char* k_smem = smem;
  unsigned char* v_smem = smem + STAGES * TILE * K_PITCH;
  unsigned char* q_smem = smem + STAGES * TILE * (K_PITCH + V_PITCH);  // Q_IN_SMEM or SPLIT_SCORES: after the ring
  __shared__ float red_m[SLICES][M], red_d[SLICES][M], row_sinks[M];
  // SPLIT_SCORES: each slice's partial S tiles after the ring (decode_tiling's score_parts).
  float4* score_parts = reinterpret_cast<float4*>(q_smem);

  const CtaCoords cta = HEAD_PACK > 1 ? CtaCoords(a, HEAD_PACK) : CtaCoords(a);
  const int w = cta.work;
  const RowSinks<M> sinks(vparams, cta);
  const WorkItem item(a, w);
  if (item.padding()) return;  // a CUDA-graph grid's position past the plan's items
  const MaskParams params = mask_bind(unbound, item.request);
  const int tid = threadIdx.x, lane = tid % 32;
  const int slice = tid / 32 / COL_SPLIT, col_part = tid / 32 % COL_SPLIT;  // the warp's keys, and O's columns
  const int k_first = SPLIT_SCORES ? col_part * QSTEPS : 0;  // the warp's first k-step of S
  const int quad = lane / 4, pair = (lane % 4) * 2;  // MMA fragment coordinates

  // packed: the CTA attends HEAD_PACK heads from a multiple of HEAD_PACK, warp g head kv_head + g;
  // in a graph's grid a packed record's other CTAs have nothing to do.
  const bool packed = packed_record<HEAD_PACK>(a, w);
  if (packed && cta.kv_head % HEAD_PACK != 0) return;
  const int kv_head = packed ? cta.kv_head + tid / 32 : cta.kv_head;  // the head this warp attends
  const HeadScales scales(a, kv_head);
  const PlanPart part(a, w);
  // The CTA's first row: a shared record's rows by warp hold ROW_WARPS tiles of 16 per row tile.
  const bool rows_by_warp = ROWS_BY_WARP && part.members > 0;
  const int first_row = rows_by_warp ? (cta.row_tile * ROW_WARPS + tid / 32) * M : cta.row_tile * M;
  int row_tok[2], row_head[2], row_pos[2], row_token[2], row_member[2], row_slot[2];
  bool row_valid[2];
  FragmentRows rows{row_tok, row_head, row_pos, row_token, row_member, row_slot, row_valid};
  rows.locate(item, first_row + quad, kv_head, packed, part.members, part.slot);

  // Q as MMA A-fragments, loaded once: a[k][0..3] = Q[quad|quad+8][16k + pair (+8)]. Loaded first:
  // unlike the fp8 kernel's, this Q needs no conversion, so it does not hold the first page lookup
  // back, and loading it late (in stream_tiles' prepare()) costs head_dim 256 about 2%. A shared-
  // prefix kernel loads it late: a shared record's query addresses wait on a load of their own (the
  // member's query offset), which would hold the first page lookup back by a round trip (its first
  // tile landed 0.8 µs later on the H200). Q_IN_SMEM: the warps write the fragments of their share of
  // the k-steps to q_frags[k][lane] (every warp serves the same rows), read back at each k-step; the
  // loop's first barrier comes before the first read.
  const auto q_fragment = [&](int k, int r) -> u32 {
    const int h = r & 1, col = 16 * k + pair + (r >> 1) * 8;
    return rows.valid[h] ? QueryPair<q_t, mma_t>::convert(*reinterpret_cast<const u32*>(
                               a.q + (i64)rows.token[h] * a.q_stride + rows.head[h] * D + col))
                         : 0u;
  };
  u32 qa[Q_IN_SMEM ? 1 : QSTEPS][4];
  uint4* q_frags = reinterpret_cast<uint4*>(q_smem);
  const auto load_queries = [&] {
    if constexpr (cfg::SHARED_PREFIX) {
      if (part.members > 0) rows.read_members(a, item);
    }
    if constexpr (Q_IN_SMEM) {
      for (int k = tid / 32; k < KSTEPS; k += WARPS)
        q_frags[k * 32 + lane] = make_uint4(q_fragment(k, 0), q_fragment(k, 1), q_fragment(k, 2), q_fragment(k, 3));
    } else {
#pragma unroll
      for (int k = 0; k < QSTEPS; ++k)
#pragma unroll
        for (int r = 0; r < 4; ++r) qa[k][r] = q_fragment(k_first + k, r);
    }
  };
  if constexpr (!cfg::SHARED_PREFIX) load_queries();  // (shared-prefix kernels: in prepare())

  using Loader = PagedKVStage<TILE, K_PITCH, V_PITCH, NT, SWIZZLE, (HEAD_PACK > 1)>;
  Loader loader(a, params, cta.kv_head, k_smem, v_smem, tid, item, (i64)(kv_head - cta.kv_head) * a.head_stride);

  float o[NTILES][4];
#pragma unroll
  for (int n = 0; n < NTILES; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m[2] = {FJ_NEG_INF, FJ_NEG_INF}, dsum[2] = {0.f, 0.f};
  const StageLanes lanes(lane, slice, col_part);
  const KeyScorer scorer{params, vparams, item};

  int score_round = 0;  // SPLIT_SCORES: which of score_parts' two buffers this round writes
  // The 16 keys of slice g of a stage and the ns - 1 after it, in one softmax step (a warp's own
  // slice, ns = 1; or, with rows by warp, every slice of the stage SHARED_STEP at a time: independent
  // chains of S's MMAs and one max and rescale for them all). ns is a constant at each call: the
  // arrays keep SHARED_STEP entries, and the loops past ns fold away.
  // by_head: a packed item's stage, 16 positions of each warp's head (a constant at each call).
  const auto attend_keys = [&](int stage, int t, int g, int ns, bool by_head = false) {
    const int key0 = item.tile_begin + (by_head ? t * 16 : t * TILE + g * 16);  // the slice's first key
    if (key0 < item.v_end) {  // (keys of the stage past the span are zero-filled: P = 0 there)
      // (k_first: a multiple of 4 k-steps, so the warp's share starts k_first / 4 blocks in.)
      const unsigned char* ks = k_smem + stage * TILE * K_PITCH + (g - slice) * 16 * K_ROW + k_first / 4 * ROW_BLOCK;
      float s[2 * SHARED_STEP][4];
      slice_scores(s, ns, ks, lanes, qa, q_frags, lane);
      if constexpr (SPLIT_SCORES) sum_score_parts(s, score_parts, score_round, slice, col_part, lane);
      u32 pa[SHARED_STEP][4];
      probabilities(s, 2 * ns, key0, pa, scorer, rows, scales.score, pair, o, m, dsum);
      accumulate_values(o, pa, ns, v_smem, stage, g - slice, lanes);
    }
  };
  const auto prepare = [&] {
    if constexpr (cfg::SHARED_PREFIX) load_queries();
  };
  const auto consume = [&](int stage, int t) {
    if constexpr (ROWS_BY_WARP) {
      if (rows_by_warp) {
        if constexpr (cfg::SHARED_WGMMA) {
#ifdef FJ_WGMMA
          attend_stage_wgmma(k_smem, v_smem, stage, t, qa, scorer, rows, scales.score, pair, o, m, dsum);
#endif
        } else {
#pragma unroll 1
          for (int g = 0; g < SLICES; g += SHARED_STEP) attend_keys(stage, t, g, SHARED_STEP);
        }
        return;
      }
    }
    attend_keys(stage, t, slice, 1);
  };
  bool streamed = false;
  if constexpr (HEAD_PACK > 1) {
    // A packed item's stage holds 16 positions of each warp's head, warp g's at keys 16g.. of the
    // stage: its positions start 16g before the item's tiles. (A loop of its own: the other
    // records' loop keeps its constants.)
    if (packed) {
      stream_tiles<STAGES, TILE>(loader, item.tile_begin - 16 * slice, ceil_div(item.v_end - item.tile_begin, 16),
                                 prepare, [&](int stage, int t) { attend_keys(stage, t, slice, 1, true); }, 16);
      streamed = true;
    }
  }
  if (!streamed) stream_item_tiles<STAGES, TILE, M>(loader, a, item, cta, prepare, consume);

  if constexpr (ROWS_BY_WARP) {
    if (rows_by_warp || packed) {  // each warp's rows are whole: it finishes them from its registers
      finish_rows_by_warp<HEAD_PACK>(a, item, rows, o, m, dsum, scales.value, lane, pair);
      merge_here<HEAD_PACK>(a, item, part, cta.kv_head, packed);
      return;
    }
  }

  float* red_o = reinterpret_cast<float*>(smem);  // [SLICES][M][D]
  publish_slice_states(o, m, dsum, red_o, red_m, red_d, slice, col_part, lane);
  sinks.publish(row_sinks);
  __syncthreads();

  finish_rows<M, SLICES>(a, item, scales, cta, red_o, red_m, red_d, row_sinks, part.members, part.slot);
  merge_here<HEAD_PACK>(a, item, part, cta.kv_head, packed);
}

FJ_INLINE void attend(const Args& a, const MaskParams& params, const VariantParams& vparams) {
  attend_records<false>(a, params, vparams);
}

FJ_INLINE void attend_packed(const Args& a, const MaskParams& params, const VariantParams& vparams) {
  attend_records<true>(a, params, vparams);
}

}  // namespace decode
