// Paged-KV decode attention on tensor cores (mma.sync m16n8k16, sm_80+): one CTA per
// (work item, KV head, tile of 16 query rows). The rows are the GQA group's heads times the
// request's query tokens, packed into the MMA's M dimension, so each K/V byte is read once for the
// whole group and the arithmetic costs a few instructions per key instead of tens.
//
// Expects from the including template:
//   namespace cfg: HEAD_DIM PAGE_SIZE GROUP_SIZE MAX_Q_LEN WARPS STAGES K_PITCH V_PITCH
//   types q_t out_t (fj::half_t or fj::bfloat16_t), kv_t (those, fj::e4m3_t or fj::e5m2_t)
//   MaskParams, mask_kv_position(), mask_visible() from the mask template; decode_common.cuh.
//
// 16-bit K/V reach the MMAs through ldmatrix. fp8 K/V are read with plain vector loads and
// converted to f16 in registers, in layouts chosen so every load is 8 bytes and bank-conflict
// free (K_PITCH = 32 mod 64 bytes, V_PITCH = 16 mod 64):
//   K: the MMA's k index runs over the head dims in a permuted order (Q is loaded in the same
//      order, which leaves Q K^T unchanged): lane column t = lane % 4 finds its four values of
//      k-step ks (pair, pair + 1, pair + 8, pair + 9) in 4 consecutive bytes, k_dim(ks, t).
//   V: output column n of n-tile nt (n = lane / 4 for the loading lane) is head dim v_dim(nt, n);
//      a lane loads its dims from the 4 key rows it needs and transposes bytes with prmt.
//
// Each warp owns a 16-key slice of every pipeline stage (S = Q K^T, online softmax, O += P V in
// registers); the warps' states meet in shared memory at the end. Same outputs as decode.cuh:
// direct for one-item requests, else normalized fp32 partials and base-2 LSEs for the merge.
// Empty spans and fully masked rows give o = 0, lse = -inf: never NaN.

namespace decode {
using namespace fj;

constexpr int D = cfg::HEAD_DIM;
constexpr int K_PITCH = cfg::K_PITCH;     // smem row bytes (16-bit: D + 8 elements, conflict-free ldmatrix)
constexpr int V_PITCH = cfg::V_PITCH;
constexpr int WARPS = cfg::WARPS;
constexpr int NT = 32 * WARPS;
constexpr int M = 16;                     // query rows per CTA
constexpr int ROWS_TOTAL = cfg::GROUP_SIZE * cfg::MAX_Q_LEN;
constexpr int TILE = 16 * WARPS;          // keys per pipeline stage
constexpr int STAGES = cfg::STAGES;
constexpr int KSTEPS = D / 16;            // MMA k-steps of S = Q K^T
constexpr int NTILES = D / 8;             // MMA n-tiles of O
constexpr bool FP8 = Kv<kv_t>::FP8;
using mma_t = typename Kv<kv_t>::mma_t;

static_assert(sizeof(q_t) == 2, "16-bit queries");
static_assert(STAGES * TILE * (K_PITCH + V_PITCH) >= WARPS * M * D * 4, "the warps' reduction fits in the ring");
static_assert(!FP8 || (K_PITCH % 64 == 32 && V_PITCH % 64 == 16), "fp8 pitches: conflict-free loads");

// fp8 layouts (see the top of the file).
FJ_INLINE int k_dim(int ks, int t) { return 32 * (ks / 2) + 8 * t + 4 * (ks % 2); }
FJ_INLINE int v_dim(int nt, int n) { return 64 * (nt / 8) + 8 * n + nt % 8; }
// Head dim of column `col` (0..7) of O's n-tile nt.
FJ_INLINE int out_dim(int nt, int col) { return FP8 ? v_dim(nt, col) : 8 * nt + col; }

template <typename T> struct Mma;
template <> struct Mma<bfloat16_t> {
  FJ_INLINE static void run(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  FJ_INLINE static u32 pack(float lo, float hi) {
    u32 r; asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
  }
};
template <> struct Mma<half_t> {
  FJ_INLINE static void run(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  FJ_INLINE static u32 pack(float lo, float hi) {
    u32 r; asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
  }
};

FJ_INLINE void ldmatrix_x4(u32* r, const void* smem) {
  u32 addr = (u32)__cvta_generic_to_shared(smem);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
FJ_INLINE void ldmatrix_x4_trans(u32* r, const void* smem) {
  u32 addr = (u32)__cvta_generic_to_shared(smem);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// S = Q K^T for the warp's 16 keys (s[j]: keys 8j..8j+7) from one stage of fp8 K. Even and odd
// k-steps accumulate apart, halving the chain of dependent MMAs.
template <typename KV>  // a template, so 16-bit kernels never instantiate it
FJ_INLINE void scores_fp8(float (*s)[4], const u32 (*qa)[4], const unsigned char* keys, int lane) {
  const unsigned char* row = keys + (lane / 4) * K_PITCH + 8 * (lane % 4);
  float odd[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
  for (int i = 0; i < D / 32; ++i) {  // one 8-byte load per key row covers 2 k-steps
    const uint2 k0 = *reinterpret_cast<const uint2*>(row + 32 * i);
    const uint2 k1 = *reinterpret_cast<const uint2*>(row + 8 * K_PITCH + 32 * i);
    u32 lo, hi;
    Fp8<KV>::to_f16x4(k0.x, lo, hi);
    Mma<mma_t>::run(s[0], qa[2 * i], lo, hi);
    Fp8<KV>::to_f16x4(k1.x, lo, hi);
    Mma<mma_t>::run(s[1], qa[2 * i], lo, hi);
    Fp8<KV>::to_f16x4(k0.y, lo, hi);
    Mma<mma_t>::run(odd[0], qa[2 * i + 1], lo, hi);
    Fp8<KV>::to_f16x4(k1.y, lo, hi);
    Mma<mma_t>::run(odd[1], qa[2 * i + 1], lo, hi);
  }
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] += odd[j][e];
}

// O += P V for the warp's 16 keys from one stage of fp8 V. The lane's keys are pair, pair + 1
// (its b0 half) and pair + 8, pair + 9 (b1); prmt pairs the two keys' bytes of each head dim.
// 8-byte loads keep the registers of head_dim 256 within bounds.
template <typename KV>
FJ_INLINE void accumulate_fp8(float (*o)[4], const u32* pa, const unsigned char* values, int lane) {
  const unsigned char* rows = values + ((lane % 4) * 2) * V_PITCH + 8 * (lane / 4);
#pragma unroll
  for (int i = 0; i < D / 64; ++i) {  // each load: 8 dims of the lane's column in 8 n-tiles
    u32 r[4][2];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint2 w = *reinterpret_cast<const uint2*>(rows + ((k & 1) + 8 * (k >> 1)) * V_PITCH + 64 * i);
      r[k][0] = w.x; r[k][1] = w.y;
    }
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int nt = 8 * i + 4 * c;  // the word's 4 dims: n-tiles nt..nt+3
      u32 b0[4], b1[4];
      Fp8<KV>::to_f16x4(prmt(r[0][c], r[1][c], 0x5140u), b0[0], b0[1]);
      Fp8<KV>::to_f16x4(prmt(r[0][c], r[1][c], 0x7362u), b0[2], b0[3]);
      Fp8<KV>::to_f16x4(prmt(r[2][c], r[3][c], 0x5140u), b1[0], b1[1]);
      Fp8<KV>::to_f16x4(prmt(r[2][c], r[3][c], 0x7362u), b1[2], b1[3]);
#pragma unroll
      for (int e = 0; e < 4; ++e) Mma<mma_t>::run(o[nt + e], pa, b0[e], b1[e]);
    }
  }
}

FJ_INLINE void attend(const Args& a, const MaskParams& params) {
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* k_smem = smem;
  unsigned char* v_smem = smem + STAGES * TILE * K_PITCH;
  __shared__ float red_m[WARPS][M], red_d[WARPS][M];

  const int w = blockIdx.x;
  if (w >= __ldg(a.num_work)) return;
  const int kv_head = blockIdx.y;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int quad = lane / 4, pair = (lane % 4) * 2;  // MMA fragment coordinates

  const WorkItem item(a, w);
  const HeadScales scales(a, kv_head);

  // The two query rows this thread's fragments touch: quad and quad + 8.
  int row_tok[2], row_head[2], row_pos[2];
  bool row_valid[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = blockIdx.z * M + quad + 8 * h;
    row_tok[h] = row / cfg::GROUP_SIZE;
    row_head[h] = kv_head * cfg::GROUP_SIZE + row % cfg::GROUP_SIZE;
    row_valid[h] = row < ROWS_TOTAL && row_tok[h] < item.q_len;
    row_pos[h] = item.kv_len - item.q_len + row_tok[h];
  }

  // Q as MMA A-fragments, loaded once: a[k][0..3] = Q[quad|quad+8][16k + pair (+8)] (for fp8
  // K in k_dim's order).
  u32 qa[KSTEPS][4];
#pragma unroll
  for (int k = 0; k < KSTEPS; ++k) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int h = r & 1, col = FP8 ? k_dim(k, lane % 4) + (r >> 1) * 2 : 16 * k + pair + (r >> 1) * 8;
      qa[k][r] = row_valid[h]
          ? QueryPair<q_t, mma_t>::convert(
                *reinterpret_cast<const u32*>(a.q + (i64)(item.q_begin + row_tok[h]) * a.q_stride
                                              + row_head[h] * D + col))
          : 0u;
    }
  }

  const kv_t* k_head = a.k + (i64)kv_head * a.head_stride;
  const kv_t* v_head = a.v + (i64)kv_head * a.head_stride;
  PagedKVStage<TILE, K_PITCH, V_PITCH, NT> loader{a, params, k_head, v_head, k_smem, v_smem,
                                                 tid, item.request, item.v_end, item.kv_len, item.page_begin};

  float o[NTILES][4];
#pragma unroll
  for (int n = 0; n < NTILES; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m[2] = {FJ_NEG_INF, FJ_NEG_INF}, dsum[2] = {0.f, 0.f};

  // ldmatrix addresses (bytes) inside a stage: lane l serves row l % 8 of matrix l / 8.
  const int mat = lane / 8, mrow = lane % 8;
  const int k_ld = (warp * 16 + mrow + (mat >> 1) * 8) * K_PITCH + (mat & 1) * 16;  // K: [keys][dims]
  const int v_ld = (warp * 16 + mrow + (mat & 1) * 8) * V_PITCH + (mat >> 1) * 16;  // V: transposed

  stream_tiles<STAGES, TILE>(loader, item.v_begin, ceil_div(item.v_end - item.v_begin, TILE), [&](int stage, int t) {
    const int key0 = item.v_begin + t * TILE + warp * 16;  // this warp's first key
    if (key0 < item.v_end) {
      const unsigned char* ks = k_smem + stage * TILE * K_PITCH;
      const unsigned char* vs = v_smem + stage * TILE * V_PITCH;
      // S = Q K^T for 16 keys: s[j][0..1] rows quad, s[j][2..3] rows quad+8, keys 8j + pair (+1).
      float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
      if constexpr (FP8) {
        scores_fp8<kv_t>(s, qa, ks + warp * 16 * K_PITCH, lane);
      } else {
#pragma unroll
        for (int k = 0; k < KSTEPS; ++k) {
          u32 kb[4];
          ldmatrix_x4(kb, ks + k_ld + 32 * k);
          Mma<mma_t>::run(s[0], qa[k], kb[0], kb[1]);
          Mma<mma_t>::run(s[1], qa[k], kb[2], kb[3]);
        }
      }
      // Scale, mask, and the online-softmax update, per row (reduced over the row's 4 lanes).
      float tile_max[2] = {FJ_NEG_INF, FJ_NEG_INF};
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e >> 1, vpos = key0 + 8 * j + pair + (e & 1);
          bool visible = row_valid[h] && vpos < item.v_end;
          if (visible) {
            const int pos = mask_kv_position(params, item.request, vpos);
            visible = pos >= 0 && pos < item.kv_len &&
                      mask_visible(params, item.request, row_tok[h], item.q_len, row_pos[h], pos, item.kv_len);
          }
          s[j][e] = visible ? s[j][e] * scales.score : FJ_NEG_INF;
          tile_max[h] = fmaxf(tile_max[h], s[j][e]);
        }
      }
      float m_ref[2], rescale[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
        const float m_new = fmaxf(m[h], tile_max[h]);
        m_ref[h] = m_new == FJ_NEG_INF ? 0.f : m_new;
        rescale[h] = exp2_approx(m[h] - m_ref[h]);
        dsum[h] *= rescale[h];
        m[h] = m_new;
      }
      // After the first tiles the running max rarely grows: skip O's rescale when no row's did.
      if (__any_sync(0xffffffffu, rescale[0] != 1.f || rescale[1] != 1.f)) {
#pragma unroll
        for (int n = 0; n < NTILES; ++n) {
          o[n][0] *= rescale[0]; o[n][1] *= rescale[0];
          o[n][2] *= rescale[1]; o[n][3] *= rescale[1];
        }
      }
      // P (the C fragments of S) is the A fragment of O += P V.
      u32 pa[4];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[j][e] = exp2_approx(s[j][e] - m_ref[e >> 1]);
          dsum[e >> 1] += s[j][e];
        }
        pa[2 * j] = Mma<mma_t>::pack(s[j][0], s[j][1]);
        pa[2 * j + 1] = Mma<mma_t>::pack(s[j][2], s[j][3]);
      }
      if constexpr (FP8) {
        accumulate_fp8<kv_t>(o, pa, vs + warp * 16 * V_PITCH, lane);
      } else {
#pragma unroll
        for (int n = 0; n < NTILES; n += 2) {
          u32 vb[4];
          ldmatrix_x4_trans(vb, vs + v_ld + 16 * n);
          Mma<mma_t>::run(o[n], pa, vb[0], vb[1]);
          Mma<mma_t>::run(o[n + 1], pa, vb[2], vb[3]);
        }
      }
    }
  });

  // Merge the warps' states: row sums over the quad's lanes, then through shared memory.
  float* red_o = reinterpret_cast<float*>(smem);  // [WARPS][M][D]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    dsum[h] += __shfl_xor_sync(0xffffffffu, dsum[h], 1);
    dsum[h] += __shfl_xor_sync(0xffffffffu, dsum[h], 2);
    if (lane % 4 == 0) { red_m[warp][quad + 8 * h] = m[h]; red_d[warp][quad + 8 * h] = dsum[h]; }
    float* red_row = red_o + (warp * M + quad + 8 * h) * D;
#pragma unroll
    for (int n = 0; n < NTILES; ++n) {
      if constexpr (FP8) {
        red_row[out_dim(n, pair)] = o[n][2 * h];
        red_row[out_dim(n, pair + 1)] = o[n][2 * h + 1];
      } else {
        *reinterpret_cast<float2*>(red_row + 8 * n + pair) = make_float2(o[n][2 * h], o[n][2 * h + 1]);
      }
    }
  }
  __syncthreads();

  // Each thread finishes 4 columns of some rows.
  constexpr int COLS4 = D / 4;
  for (int cell = tid; cell < M * COLS4; cell += NT) {
    const int row_in = cell / COLS4, col = (cell % COLS4) * 4;
    const int row = blockIdx.z * M + row_in;
    const int q_tok = row / cfg::GROUP_SIZE;
    if (row >= ROWS_TOTAL || q_tok >= item.q_len) continue;
    const int qo_head = kv_head * cfg::GROUP_SIZE + row % cfg::GROUP_SIZE;
    float m_all = FJ_NEG_INF;
#pragma unroll
    for (int wi = 0; wi < WARPS; ++wi) m_all = fmaxf(m_all, red_m[wi][row_in]);
    const float m_ref = m_all == FJ_NEG_INF ? 0.f : m_all;
    float d_all = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int wi = 0; wi < WARPS; ++wi) {
      const float weight = exp2_approx(red_m[wi][row_in] - m_ref);
      d_all += weight * red_d[wi][row_in];
      const float4 part = *reinterpret_cast<const float4*>(red_o + (wi * M + row_in) * D + col);
      acc[0] += weight * part.x; acc[1] += weight * part.y; acc[2] += weight * part.z; acc[3] += weight * part.w;
    }
    const float inv = d_all > 0.f ? scales.value / d_all : 0.f;
    const float lse2 = d_all > 0.f ? m_ref + log2_approx(d_all) : FJ_NEG_INF;
    const int token = item.q_begin + q_tok;
    if (item.direct) {
      uint2 packed;
      packed.x = (u32)Convert<out_t>::from_float(acc[0] * inv) | ((u32)Convert<out_t>::from_float(acc[1] * inv) << 16);
      packed.y = (u32)Convert<out_t>::from_float(acc[2] * inv) | ((u32)Convert<out_t>::from_float(acc[3] * inv) << 16);
      *reinterpret_cast<uint2*>(a.out + (i64)token * a.out_stride + qo_head * D + col) = packed;
      if (a.lse != nullptr && col == 0) a.lse[(i64)token * a.num_qo_heads + qo_head] = lse2 * FJ_LN2;
    } else {
      const i64 slot = ((i64)w * cfg::MAX_Q_LEN + q_tok) * a.num_qo_heads + qo_head;
      *reinterpret_cast<float4*>(a.tmp_o + slot * D + col) = make_float4(acc[0] * inv, acc[1] * inv, acc[2] * inv, acc[3] * inv);
      if (col == 0) a.tmp_lse[slot] = lse2;
    }
  }
}

}  // namespace decode
