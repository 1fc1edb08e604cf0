//! needs: common/prelude.cuh common/kv_types.cuh worklist/kernel_core.cuh common/scoring.cuh common/mma.cuh
// Paged-KV decode attention on tensor cores for fp8 K/V (e4m3, e5m2; mma.sync m16n8k16 in f16,
// sm_80+): one CTA per (work item, KV head, tile of 8 query rows).
//
// The MMA's operands are swapped relative to decode/tc.cuh: S^T = K Q^T and O^T += V^T P^T, so
// keys and head dims fill the MMA's M = 16 and the query rows its N = 8.
// A GQA group of 4-8 rows then leaves at most half of each MMA idle rather than three quarters,
// the MMAs per key halve, and O^T costs 4 registers per 16 head dims instead of 8, which buys
// CTAs per SM: an fp8 cache is read twice as fast as a 16-bit one, so the arithmetic per byte
// has to shrink for the kernel to stay memory-bound.
//
// Expects from the including template:
//   namespace cfg: HEAD_DIM PAGE_SIZE GROUP_SIZE MAX_Q_LEN ROWS WARPS COL_SPLIT STAGES K_PITCH V_PITCH
//   types out_t (fj::half_t or fj::bfloat16_t), q_t (out_t or fj::e4m3_t), kv_t (fj::e4m3_t or fj::e5m2_t)
//   the mask and variant templates (through common/scoring.cuh's FJ_SCORE_KEY and the sink helpers
//   of worklist/kernel_core.cuh).
//
// fp8 bytes are read from shared memory with 16-byte loads (8 at head_dim 64; 8 and 4 at 96), bank-conflict free
// for the pitches of flashjit.jit.tiling.tc_row_pitches, and converted to f16 in registers. The head
// dims run in permuted orders, in blocks of BLOCK dims (lane g = lane / 4, t = lane % 4):
//   K: k-step ks of S^T takes, in lane t, the 4 consecutive bytes at k_byte(ks, t) of its key rows
//      g and g + 8 (the A fragment's k-slots 2t, 2t + 1, 2t + 8, 2t + 9). Q is read in the same
//      order, which leaves Q K^T unchanged.
//   V: row r of O^T's m-tile mt is head dim o_dim(mt, r): lane g holds rows g and g + 8, two
//      adjacent dims, for every m-tile in BLOCK / 8 consecutive bytes of each key row it reads
//      (2t, 2t + 1, 2t + 8, 2t + 9); prmt pairs the bytes of two keys for each dim.
// P goes from S^T's C fragments to O^T's B fragments by an 8x8 transpose in registers (movmatrix).
//
// Same outputs as decode/tc.cuh (finish_rows). Empty spans and fully masked rows give o = 0,
// lse = -inf: never NaN.

namespace decode {
using namespace fj;

constexpr int D = cfg::HEAD_DIM;
constexpr int K_PITCH = cfg::K_PITCH;
constexpr int V_PITCH = cfg::V_PITCH;
constexpr int WARPS = cfg::WARPS;
constexpr int NT = 32 * WARPS;
constexpr int M = cfg::ROWS;              // query rows per CTA: the MMA's N
constexpr int ROWS_TOTAL = cfg::GROUP_SIZE * cfg::MAX_Q_LEN;
constexpr int COL_SPLIT = cfg::COL_SPLIT;  // warps per 16-key slice, each with its blocks of O^T's dims
constexpr int SLICES = WARPS / COL_SPLIT;  // key slices per stage, one softmax state each
constexpr int TILE = 16 * SLICES;         // keys per pipeline stage
constexpr int STAGES = cfg::STAGES;
constexpr bool SWIZZLE = cfg::SWIZZLE;    // the ring's rows are unpadded and swizzled (PagedKVStage)
constexpr int STEPS = D / 16;             // k-steps of S^T, and m-tiles of O^T
// Head dims the lane layouts repeat over: head_dim 96 takes three blocks of 32 (8-byte K and
// 4-byte V pieces per lane), the others one of 64 or blocks of 128.
constexpr int BLOCK = D == 96 ? 32 : D < 128 ? D : 128;
constexpr int BLOCK_STEPS = BLOCK / 16;
constexpr int K_BYTES = BLOCK / 4;        // bytes of a key row one lane reads per block
constexpr int V_BYTES = BLOCK / 8;        // bytes of a value row one lane reads per block
constexpr int PART_BLOCKS = D / BLOCK / COL_SPLIT;  // blocks of head dims in one warp's part of O^T
constexpr int PART_STEPS = PART_BLOCKS * BLOCK_STEPS;  // O^T's m-tiles per warp

static_assert(sizeof(kv_t) == 1, "fp8 K/V (16-bit or e4m3 queries)");
static_assert(M == 8, "one n-tile of query rows");
static_assert(D % BLOCK == 0 && (BLOCK == 64 || BLOCK == 128 || (BLOCK == 32 && D == 96)), "head_dim 64, 96, 128, 256 or 512");
static_assert(WARPS % COL_SPLIT == 0 && (D / BLOCK) % COL_SPLIT == 0, "whole blocks of head dims per warp");
static_assert(STAGES * TILE * (K_PITCH + V_PITCH) >= SLICES * M * D * 4, "the slices' reduction fits in the ring");

// Where byte `byte` of ring row `row` (as counted mod 8) sits in the row: in a swizzled ring
// (PagedKVStage) its 16-byte chunk is XORed with the row's low 3 bits. Unpadded swizzled rows keep
// the loads below bank-conflict free (tests/test_fp8_layout.py) and every copied sector whole.
FJ_INLINE int swizzled_offset(int byte, int row) {
  return SWIZZLE ? (int)swizzled_chunk(row, byte / 16) * 16 + byte % 16 : byte;
}

// k_byte and o_dim are flashjit.jit.layouts' fp8_k_byte and fp8_o_dim: the render asserts it value by value.
FJ_INLINE constexpr int k_byte(int ks, int t) { return BLOCK * (ks / BLOCK_STEPS) + K_BYTES * t + 4 * (ks % BLOCK_STEPS); }
FJ_INLINE constexpr int o_dim(int mt, int r) {
  return BLOCK * (mt / BLOCK_STEPS) + V_BYTES * (r % 8) + 2 * (mt % BLOCK_STEPS) + r / 8;
}

// S^T = K Q^T for the warp's 16 keys: s[0..1] key g, s[2..3] key g + 8, each for query rows 2t and
// 2t + 1. Even and odd k-steps accumulate apart, halving the chain of dependent MMAs.
FJ_INLINE void scores(float* s, const u32 (*qb)[2], const unsigned char* keys, int g, int t) {
  float odd[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int b = 0; b < D / BLOCK; ++b) {
    if constexpr (K_BYTES == 8) {  // one 8-byte load per key row covers the block's 2 k-steps
      const unsigned char* row = keys + g * K_PITCH + swizzled_offset(BLOCK * b + K_BYTES * t, g);
      const uint2 k0 = *reinterpret_cast<const uint2*>(row);
      const uint2 k1 = *reinterpret_cast<const uint2*>(row + 8 * K_PITCH);
      const u32 w0[2] = {k0.x, k0.y}, w1[2] = {k1.x, k1.y};
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int ks = BLOCK_STEPS * b + j;
        u32 ka[4];
        Fp8<kv_t>::to_f16x4(w0[j], ka[0], ka[2]);
        Fp8<kv_t>::to_f16x4(w1[j], ka[1], ka[3]);
        Mma<half_t>::run(ks % 2 ? odd : s, ka, qb[ks][0], qb[ks][1]);
      }
    }
#pragma unroll
    for (int c = 0; c < K_BYTES / 16; ++c) {  // one 16-byte load per key row covers 4 k-steps
      const unsigned char* row = keys + g * K_PITCH + swizzled_offset(BLOCK * b + K_BYTES * t + 16 * c, g);
      const uint4 k0 = *reinterpret_cast<const uint4*>(row);
      const uint4 k1 = *reinterpret_cast<const uint4*>(row + 8 * K_PITCH);
      const u32 w0[4] = {k0.x, k0.y, k0.z, k0.w}, w1[4] = {k1.x, k1.y, k1.z, k1.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int ks = BLOCK_STEPS * b + 4 * c + j;
        u32 ka[4];  // A fragment: rows (keys) g, g + 8; k-slots 2t, 2t + 1 | 2t + 8, 2t + 9
        Fp8<kv_t>::to_f16x4(w0[j], ka[0], ka[2]);
        Fp8<kv_t>::to_f16x4(w1[j], ka[1], ka[3]);
        Mma<half_t>::run(ks % 2 ? odd : s, ka, qb[ks][0], qb[ks][1]);
      }
    }
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) s[e] += odd[e];
}

// O^T += V^T P^T for the warp's 16 keys, in the PART_BLOCKS blocks of head dims from block b0 (its
// column part). The lane reads keys 2t, 2t + 1 (the A fragment's k-slots of its first half) and
// 2t + 8, 2t + 9 (second half) at its V_BYTES dims of each block.
FJ_INLINE void accumulate(float (*o)[4], const u32* pb, const unsigned char* values, int g, int t, int b0) {
  constexpr int WORDS = V_BYTES / 4;
#pragma unroll
  for (int pb_i = 0; pb_i < PART_BLOCKS; ++pb_i) {
    const int b = b0 + pb_i;
    u32 w[4][WORDS];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int row = 2 * t + (k & 1) + 8 * (k >> 1);
      const unsigned char* p = values + row * V_PITCH + swizzled_offset(BLOCK * b + V_BYTES * g, row);
      if constexpr (WORDS == 4) {
        const uint4 x = *reinterpret_cast<const uint4*>(p);
        w[k][0] = x.x; w[k][1] = x.y; w[k][2] = x.z; w[k][3] = x.w;
      } else if constexpr (WORDS == 1) {  // head_dim 96: 4 bytes of each key row per block
        w[k][0] = *reinterpret_cast<const u32*>(p);
      } else {
        const uint2 x = *reinterpret_cast<const uint2*>(p);
        w[k][0] = x.x; w[k][1] = x.y;
      }
    }
#pragma unroll
    for (int i = 0; i < BLOCK_STEPS; ++i) {  // m-tile: bytes 2i (dim o_dim(mt, g)) and 2i + 1 (row g + 8)
      const u32 pick = i % 2 ? 0x7362u : 0x5140u;  // bytes (2i, 2i + 1) of key x and key y: x y x y
      u32 va[4];
      Fp8<kv_t>::to_f16x4(prmt(w[0][i / 2], w[1][i / 2], pick), va[0], va[1]);
      Fp8<kv_t>::to_f16x4(prmt(w[2][i / 2], w[3][i / 2], pick), va[2], va[3]);
      Mma<half_t>::run(o[BLOCK_STEPS * pb_i + i], va, pb[0], pb[1]);
    }
  }
}

FJ_INLINE void attend(const Args& a, const MaskParams& unbound, const VariantParams& vparams) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = aligned_ring(smem_raw);
  unsigned char* k_smem = smem;
  unsigned char* v_smem = smem + STAGES * TILE * K_PITCH;
  __shared__ float red_m[SLICES][M], red_d[SLICES][M], row_sinks[M];

  const CtaCoords cta(a);
  const int w = cta.work, kv_head = cta.kv_head;
  const RowSinks<M> sinks(vparams, cta);
  const WorkItem item(a, w);
  if (item.padding()) return;  // a CUDA-graph grid's position past the plan's items
  const MaskParams params = mask_bind(unbound, item.request);
  const int tid = threadIdx.x, lane = tid % 32;
  const int slice = tid / 32 / COL_SPLIT, col_part = tid / 32 % COL_SPLIT;  // the warp's keys, and O^T's blocks
  const int g = lane / 4, t = lane % 4;  // MMA fragment coordinates

  // The query rows of this lane's S^T and O^T columns: 2t + c.
  constexpr int COLS = 2;
  QueryRow col[COLS];
#pragma unroll
  for (int c = 0; c < COLS; ++c) {
    const int row = cta.row_tile * M + 2 * t + c;
    col[c].q_idx = row / cfg::GROUP_SIZE;
    col[c].qo_head = kv_head * cfg::GROUP_SIZE + row % cfg::GROUP_SIZE;
    col[c].valid = row < ROWS_TOTAL && col[c].q_idx < item.q_len;
    col[c].q_pos = item.kv_len - item.q_len + col[c].q_idx;
  }
  const KeyScorer scorer{params, vparams, item};

  PagedKVStage<TILE, K_PITCH, V_PITCH, NT, SWIZZLE> loader(a, params, kv_head, k_smem, v_smem, tid, item);

  // Q as B fragments, loaded once the first copies are in flight (stream_tiles' prepare):
  // qb[ks] = Q[row g][k_byte(ks, t) + 0..1 | 2..3], in f16.
  u32 qb[STEPS][2];
  HeadScales scales;
  const auto prepare = [&] {
    scales = HeadScales(a, kv_head);
    const int row = cta.row_tile * M + g, tok = row / cfg::GROUP_SIZE;
    const bool valid = row < ROWS_TOTAL && tok < item.q_len;
    const q_t* q_row = a.q + (i64)(item.q_begin + tok) * a.q_stride + (kv_head * cfg::GROUP_SIZE + row % cfg::GROUP_SIZE) * D;
#pragma unroll
    for (int ks = 0; ks < STEPS; ++ks)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        qb[ks][h] = valid ? load_query_pair<half_t>(q_row + k_byte(ks, t) + 2 * h)
                          : 0u;
  };

  // O^T, the warp's part: o[mt][0..1] dim o_dim(mt0 + mt, g), o[mt][2..3] dim o_dim(mt0 + mt, g + 8);
  // rows 2t, 2t + 1
  float o[PART_STEPS][4];
  const int mt0 = col_part * PART_STEPS;
#pragma unroll
  for (int mt = 0; mt < PART_STEPS; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.f;
  float m[COLS], dsum[COLS];
#pragma unroll
  for (int c = 0; c < COLS; ++c) m[c] = FJ_NEG_INF, dsum[c] = 0.f;

  stream_item_tiles<STAGES, TILE, M>(loader, a, item, cta, prepare, [&](int stage, int tile) {
    const int key0 = item.tile_begin + tile * TILE + slice * 16;  // this warp's first key
    if (key0 >= item.v_end) return;
    float s[4] = {0.f, 0.f, 0.f, 0.f};
    scores(s, qb, k_smem + (stage * TILE + slice * 16) * K_PITCH, g, t);

    // Scale, mask, and the online-softmax update, per column (reduced over the 8 lanes of a t).
    float tile_max[COLS];
#pragma unroll
    for (int c = 0; c < COLS; ++c) tile_max[c] = FJ_NEG_INF;
#pragma unroll
    for (int e = 0; e < 4; ++e)
      FJ_SCORE_KEY(SpanKeys::mapped, VariantKeys::visible, scorer, col[e & 1], key0 + g + 8 * (e >> 1),
                   s[e] * scales.score, s[e], tile_max[e & 1]);
    float m_ref[COLS], rescale[COLS];
    bool grew = false;
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
#pragma unroll
      for (int mask = 4; mask < 32; mask *= 2) tile_max[c] = fmaxf(tile_max[c], __shfl_xor_sync(0xffffffffu, tile_max[c], mask));
      rescale[c] = advance_max(tile_max[c], m[c], m_ref[c], dsum[c]);
      grew |= rescale[c] != 1.f;
    }
    // After the first tiles the running max rarely grows: skip O's rescale when no column's did.
    if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
      for (int mt = 0; mt < PART_STEPS; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mt][e] *= rescale[e & 1];
    }
    // P^T's B fragment: key rows 2t, 2t + 1 (pb[0]) and 2t + 8, 2t + 9 (pb[1]) of query row g.
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[e] = exp2_approx(s[e] - m_ref[e & 1]);
      dsum[e & 1] += s[e];
    }
    const u32 pb[2] = {movmatrix_trans(Mma<half_t>::pack(s[0], s[1])), movmatrix_trans(Mma<half_t>::pack(s[2], s[3]))};
    accumulate(o, pb, v_smem + (stage * TILE + slice * 16) * V_PITCH, g, t, col_part * PART_BLOCKS);
  });

  // Merge the slices' states: column sums over the 8 lanes of a t, then through shared memory. The
  // warps of a slice hold the same m and sum.
  float* red_o = reinterpret_cast<float*>(smem);  // [SLICES][M][D]
#pragma unroll
  for (int c = 0; c < COLS; ++c) {
    const int row = 2 * t + c;
#pragma unroll
    for (int mask = 4; mask < 32; mask *= 2) dsum[c] += __shfl_xor_sync(0xffffffffu, dsum[c], mask);
    if (g == 0 && col_part == 0) { red_m[slice][row] = m[c]; red_d[slice][row] = dsum[c]; }
    float* red_row = red_o + (slice * M + row) * D;
#pragma unroll
    for (int mt = 0; mt < PART_STEPS; ++mt)  // C fragment: dims o_dim(mt0 + mt, g) and + 1 (row g + 8)
      *reinterpret_cast<float2*>(red_row + o_dim(mt0 + mt, g)) = make_float2(o[mt][c], o[mt][2 + c]);
  }
  sinks.publish(row_sinks);
  __syncthreads();

  finish_rows<M, SLICES>(a, item, scales, cta, red_o, red_m, red_d, row_sinks);
}

}  // namespace decode
