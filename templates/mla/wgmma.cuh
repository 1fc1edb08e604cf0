//! needs: common/prelude.cuh worklist/kernel_core.cuh common/scoring.cuh common/mma.cuh mla/mma.cuh
// Multi-head latent attention decode on Hopper's warpgroup MMAs (wgmma, sm_90a): the kernel for
// requests whose heads fill 64-row tiles (flashjit.kernels.mla.tiling.uses_wgmma). One CTA per
// (work item, 64 query rows), two warpgroups of 128 threads; each stage holds TILE = 64 latent rows.
//
//   S = Q K^T   warpgroup 0: 36 MMAs of 64 x 64 x 16, Q and K read from shared memory, where both
//               sit in 128-byte-swizzled blocks of 64 columns (operand_offset), as wgmma reads them;
//               then the online softmax in its registers (a row's 64 scores lie in one quad).
//   O += P V    O's 512 columns are split between the warpgroups, 64 x 256 fp32 each (128 registers
//               a thread). Both give their MMAs P in registers: warpgroup 0's S accumulators,
//               converted, are the A fragments; it writes P and each row's rescale factor to shared
//               memory, where warpgroup 1 loads the same fragments (ldmatrix: an ordinary load, so
//               no proxy fence, which would wait for the next stage's copies). V is the stage's
//               first 512 columns, read N-major from the same blocks (a block's rows are keys).
// Warpgroup 1 also copies the stages, a tile ahead, while warpgroup 0 scores: the copies' issue
// (36 cp.async a thread and their addresses) runs beside the score MMAs rather than before them.
// Each tile starts when its copies are in (each copying thread waits for its own, fenced to the
// async proxy that wgmma reads through) at a CTA barrier, and ends at another, after which its
// stage takes the tile after next; warpgroup 1 waits for P on a named barrier.
// fp8 latents (MLATuning.wgmma_fp8, flashjit/kernels/mla/tiling.py) land as stored; once a tile's
// copies are in, all threads convert it (mla/mma.cuh's convert, exact) into one 16-bit stage laid
// out as a 16-bit tile's copies would be, fence those writes to the async proxy, and the MMAs read
// that stage. It is free again once the tile's MMAs are done (the tile's last barrier); a stored
// stage once its tile is converted, so the copies of tile t + 1 still run beside tile t's MMAs.
// Outputs, partials, the fused merge and empty rows as in mla/mma.cuh's attend.
//
// Expects mla/mma.cuh (Args, LatentCopies, load_q, operand_offset), common/scoring.cuh and the
// wgmma wrappers (common/wgmma.cuh.j2) pasted before it.

namespace mla {

constexpr int SWIZZLE_ATOM = WGMMA_SWIZZLE_ATOM;   // the 128-byte swizzle's repeat: 8 rows of 128 bytes
constexpr int Q_BLOCK = M * 128, KV_BLOCK = TILE * 128;  // bytes of one 64-column block of Q, of a stage
constexpr int WG_THREADS = 128, HALF = LATENT / 2;  // a warpgroup, and its share of O's columns
constexpr int S_REGS = TILE / 2, O_REGS = HALF / 2;
static_assert(cfg::WGMMA && M == 64 && TILE == 64 && NT == 2 * WG_THREADS && STAGES == 2,
              "the wgmma kernel: 64 rows, 64 keys a stage, two warpgroups, two stages");
static_assert(cfg::RING_ALIGN == SWIZZLE_ATOM && STAGE_BYTES % SWIZZLE_ATOM == 0 && cfg::Q_BYTES % SWIZZLE_ATOM == 0 &&
              cfg::CONVERT_BYTES % SWIZZLE_ATOM == 0, "every operand block starts on a swizzle atom");
static_assert(cfg::P_PITCH == 128 && QK % 64 == 0 && LATENT == 512, "P rows of 64 keys; 64-column blocks");

FJ_INLINE void barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
FJ_INLINE void barrier_wait(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
constexpr int P_READY = 1;  // the named barrier on which warpgroup 1 waits for P

// S = Q K^T of warpgroup 0's 64 rows and a stage's 64 keys, Q and the stage read from shared memory
// (q_at, kv_at) as 128-byte-swizzled blocks of 64 columns.
FJ_INLINE void stage_scores_wgmma(float (&s)[S_REGS], u32 q_at, u32 kv_at) {
#pragma unroll
  for (int i = 0; i < S_REGS; ++i) s[i] = 0.f;
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < QK / 16; ++k) {  // 16 dims a step: 32 bytes into the step's 64-column block
    const u32 step = (k % 4) * 32;
    wgmma_m64n64_ss(s, smem_operand(q_at + (k / 4) * Q_BLOCK + step, 16),
                    smem_operand(kv_at + (k / 4) * KV_BLOCK + step, 16), k > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  hold_registers(s);
}

FJ_INLINE void attend_wgmma(const Args& a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* ring = decode::aligned_ring(smem_raw);
  unsigned char* converted = ring + cfg::RING_BYTES;  // fp8: the 16-bit stage the MMAs read
  unsigned char* q_smem = converted + cfg::CONVERT_BYTES;
  unsigned char* p_smem = q_smem + cfg::Q_BYTES;
  __shared__ float rescale_rows[M], row_sum[M], row_max[M];

  const int w = blockIdx.x, row_tile = blockIdx.y;
  const WorkItem item(a, w);
  if (item.padding()) return;  // a CUDA-graph grid's position past the plan's items
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int group = __shfl_sync(0xffffffffu, warp / 4, 0);  // the warpgroup, visibly uniform to the compiler
  const int quad = lane / 4, pair = (lane % 4) * 2;
  const int first_row = (warp % 4) * 16 + quad;  // this thread's accumulator rows: first_row and first_row + 8
  const int p_row = (warp % 4) * 16 + (lane & 7) + 8 * ((lane >> 3) & 1), p_sub = lane >> 4;  // ldmatrix's lanes

  const float ckv_scale = kv_scale(a.ckv_scale, a.ckv_scale_ptr, 0, 0);
  const float value_scale = ckv_scale * Kv<kv_t>::UNIT;
  const float score_scale = a.sm_scale_log2 * value_scale;
  load_q(a, item, row_tile, q_smem, FP8 ? kv_scale(a.kpe_scale, a.kpe_scale_ptr, 0, 0) / ckv_scale : 1.f, tid);

  QueryRow rows[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) rows[h] = query_row(row_tile * M + first_row + 8 * h, item);
  const MaskParams causal{};  // (the causal mask reads no parameter)
  const VariantParams no_variant{};
  const KeyScorer scorer{causal, no_variant, item};
  float m[2] = {FJ_NEG_INF, FJ_NEG_INF}, dsum[2] = {0.f, 0.f};
  float o[O_REGS];
#pragma unroll
  for (int i = 0; i < O_REGS; ++i) o[i] = 0.f;

  const u32 ring_at = (u32)__cvta_generic_to_shared(ring), q_at = (u32)__cvta_generic_to_shared(q_smem);
  const u32 converted_at = (u32)__cvta_generic_to_shared(converted);
  LatentCopies<WG_THREADS> copies(a, ring, tid - WG_THREADS, item);  // warpgroup 1's
  const int num_tiles = ceil_div(item.v_end - item.v_begin, TILE);
  if (group == 1 && num_tiles > 0) {
    copies.locate(item.v_begin);
    copies.issue(0);
    if (num_tiles > 1) copies.locate(item.v_begin + TILE);
  }
  cp_async_commit();
  for (int t = 0; t < num_tiles; ++t) {
    cp_async_wait<0>();  // this thread's copies of tile t (and of Q)
    if constexpr (FP8) {
      __syncthreads();  // every thread's copies of tile t
      convert<kv_t>(ring + (t % STAGES) * STAGE_BYTES, converted, tid);
    }
    fence_async_proxy();  // the copies (16-bit) or the converted tile, and Q, to wgmma's proxy
    __syncthreads();
    const u32 kv_at = FP8 ? converted_at : ring_at + (t % STAGES) * STAGE_BYTES;
    float rescale[2];
    u32 pa[TILE / 16][4];  // P as the A fragments of the 16-key steps
    if (group == 0) {
      // S: s[4j + e] is row first_row (e < 2) or first_row + 8, key 8j + pair + e % 2.
      float s[S_REGS];
      stage_scores_wgmma(s, q_at, kv_at);
      const int tile_v0 = item.v_begin + t * TILE;
      float tile_max[2] = {FJ_NEG_INF, FJ_NEG_INF};
#pragma unroll
      for (int i = 0; i < S_REGS; ++i)
        FJ_SCORE_KEY(SpanKeys::as_is, VariantKeys::visible, scorer, rows[(i >> 1) & 1],
                     tile_v0 + 8 * (i >> 2) + pair + (i & 1), s[i] * score_scale, s[i], tile_max[(i >> 1) & 1]);
      float m_ref[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
        rescale[h] = decode::advance_max(tile_max[h], m[h], m_ref[h], dsum[h]);
        if (lane % 4 == 0) rescale_rows[first_row + 8 * h] = rescale[h];
      }
      // P: the A fragment of key step kk holds keys 16kk + pair (+1) in registers 0 (row first_row)
      // and 1 (row + 8), keys 16kk + 8 + pair in 2 and 3: n-tile j = 2kk + j % 2 of S. Its copy in
      // shared memory, rows of 64 keys with the operands' swizzle, is warpgroup 1's.
#pragma unroll
      for (int j = 0; j < TILE / 8; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float p0 = exp2_approx(s[4 * j + 2 * h] - m_ref[h]), p1 = exp2_approx(s[4 * j + 2 * h + 1] - m_ref[h]);
          dsum[h] += p0 + p1;
          const u32 packed = decode::Mma<mma_t>::pack(p0, p1);
          pa[j / 2][2 * (j % 2) + h] = packed;
          const int r = first_row + 8 * h;
          *reinterpret_cast<u32*>(p_smem + r * cfg::P_PITCH + swizzled(r, j) * 16 + pair * 2) = packed;
        }
      }
      barrier_arrive(P_READY, NT);
    } else {
      if (t + 1 < num_tiles) {  // into the stage tile t - 1 left
        copies.issue((t + 1) % STAGES);
        if (t + 2 < num_tiles) copies.locate(item.v_begin + (t + 2) * TILE);
      }
      cp_async_commit();
      barrier_wait(P_READY, NT);
      rescale[0] = rescale_rows[first_row];
      rescale[1] = rescale_rows[first_row + 8];
#pragma unroll
      for (int kk = 0; kk < TILE / 16; ++kk)
        decode::ldmatrix_x4(pa[kk], p_smem + p_row * cfg::P_PITCH + swizzled(p_row, 2 * kk + p_sub) * 16);
    }
    if (__any_sync(0xffffffffu, rescale[0] != 1.f || rescale[1] != 1.f)) {  // after the first tiles maxima rarely grow
#pragma unroll
      for (int i = 0; i < O_REGS; ++i) o[i] *= rescale[(i >> 1) & 1];
    }
    // O's columns [HALF * group, + HALF): the stage's 64-column blocks 4 group to 4 group + 3.
    wgmma_fence();
    const u32 v_at = kv_at + group * (HALF / 64) * KV_BLOCK;
#pragma unroll
    for (int kk = 0; kk < TILE / 16; ++kk)  // 16 keys a step: 16 rows of 128 bytes
      wgmma_rs_nmajor(o, pa[kk], smem_operand(v_at + kk * 16 * 128, KV_BLOCK), 1);
    wgmma_commit();
    wgmma_wait<0>();
    hold_registers(o);
    __syncthreads();
  }
  cp_async_wait<0>();

  // Each row's sum over its quad and its maximum, from warpgroup 0 to both.
  if (group == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      dsum[h] += __shfl_xor_sync(0xffffffffu, dsum[h], 1);
      dsum[h] += __shfl_xor_sync(0xffffffffu, dsum[h], 2);
      if (lane % 4 == 0) row_sum[first_row + 8 * h] = dsum[h], row_max[first_row + 8 * h] = m[h];
    }
  }
  __syncthreads();
  const int col0 = group * HALF + pair;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = first_row + 8 * h, row = row_tile * M + r;
    const int tok = row / cfg::GROUP_SIZE, head = row % cfg::GROUP_SIZE;
    if (row >= ROWS_TOTAL || tok >= item.q_len) continue;
    const float total = row_sum[r];
    const float inv = total > 0.f ? value_scale / total : 0.f;
    const float lse2 = total > 0.f ? row_max[r] + log2_approx(total) : FJ_NEG_INF;
    store_row<HALF / 8>(a, item, w, tok, head, col0, inv, lse2, group == 0 && lane % 4 == 0,
                        [&](int j) { return make_float2(o[4 * j + 2 * h], o[4 * j + 2 * h + 1]); });
  }
  merge_if_split(a, item, row_tile, tid);
}

}  // namespace mla
