//! needs: common/prelude.cuh worklist/kernel_core.cuh
// What the two tensor-core decode kernels (decode/tc.cuh: 16-bit K/V; decode/tc_fp8.cuh: fp8 K/V)
// share: the MMA and its operand moves, and the epilogue that merges the warps' softmax states.
//
// Expects from the including template: cfg::HEAD_DIM GROUP_SIZE MAX_Q_LEN WARPS; worklist/kernel_core.cuh.
namespace decode {
using namespace fj;

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

// One row's online-softmax step (base 2) once its tile's maximum is known: the running maximum m
// takes it, m_ref is the reference the tile's exponentials take (0 while nothing is visible, so
// no -inf - -inf), and the running sum is rescaled. Returns the rescale factor (0 while m was -inf).
FJ_INLINE float advance_max(float tile_max, float& m, float& m_ref, float& dsum) {
  const float m_new = fmaxf(m, tile_max);
  m_ref = m_new == FJ_NEG_INF ? 0.f : m_new;
  const float rescale = exp2_approx(m - m_ref);
  dsum *= rescale;
  m = m_new;
  return rescale;
}

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

// The 8x8 16-bit matrix whose row lane / 4, columns 2 (lane % 4) and + 1 this lane holds, transposed
// in the same layout: the C fragment of one MMA becomes a B fragment of the next.
FJ_INLINE u32 movmatrix_trans(u32 x) {
  u32 r; asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x)); return r;
}

// The CTA's M query rows from the STATES partial states in shared memory: red_o [STATES][M][D]
// (unnormalized O in head-dim order), red_m / red_d [STATES][M] (base-2 max and sum). Rows merge
// by the online-softmax rule; each thread finishes 4 columns of some rows and writes the output
// (a request's only item) or a normalized fp32 partial and its base-2 LSE for the merge kernel;
// the variant's sink (row_sinks [M] in natural units, published by RowSinks) joins the rows of
// the request's first item as one more state, so its exp2 runs beside the states' rather than
// after their sum.
// cfg::SHARED_PREFIX: members > 0, a shared-prefix record's rows, each member's partial in its
// slot req_work_indptr[member] + q_begin; else the item's partial goes to own_slot (its grid
// position in other kernels).
template <int M, int STATES>
FJ_INLINE void finish_rows(const Args& a, const WorkItem& item, const HeadScales& scales, const CtaCoords& cta,
                           const float* red_o, const float (*red_m)[M], const float (*red_d)[M],
                           const float* row_sinks, int members = 0, int own_slot = -1) {
  constexpr int D = cfg::HEAD_DIM, COLS4 = D / 4;
  for (int cell = threadIdx.x; cell < M * COLS4; cell += 32 * cfg::WARPS) {
    const int row_in = cell / COLS4, col = (cell % COLS4) * 4;
    const int row = cta.row_tile * M + row_in;
    int q_tok = row / cfg::GROUP_SIZE;
    int slot_item = cta.work;  // the partial slot the row writes
    if constexpr (cfg::SHARED_PREFIX) {
      slot_item = own_slot;
      if (members > 0) {
        const int member = q_tok / item.q_len;
        if (member >= members) continue;
        q_tok -= member * item.q_len;
        slot_item = __ldg(a.req_work_indptr + item.request + member) + item.q_begin;
      } else if (row >= cfg::GROUP_SIZE * cfg::MAX_Q_LEN || q_tok >= item.q_len) {
        continue;
      }
    } else if (row >= cfg::GROUP_SIZE * cfg::MAX_Q_LEN || q_tok >= item.q_len) {
      continue;
    }
    const int qo_head = cta.kv_head * cfg::GROUP_SIZE + row % cfg::GROUP_SIZE;
    float m_all = FJ_NEG_INF, sink2 = FJ_NEG_INF;
#pragma unroll
    for (int wi = 0; wi < STATES; ++wi) m_all = fmaxf(m_all, red_m[wi][row_in]);
    if constexpr (VARIANT_SINK) {  // the sink: a state of max sink2, sum 1 and output 0
      sink2 = item.first_of_request ? row_sinks[row_in] * FJ_LOG2E : FJ_NEG_INF;
      m_all = fmaxf(m_all, sink2);
    }
    const float m_ref = m_all == FJ_NEG_INF ? 0.f : m_all;
    float d_all = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int wi = 0; wi < STATES; ++wi) {
      const float weight = exp2_approx(red_m[wi][row_in] - m_ref);
      d_all += weight * red_d[wi][row_in];
      const float4 part = *reinterpret_cast<const float4*>(red_o + (wi * M + row_in) * D + col);
      acc[0] += weight * part.x; acc[1] += weight * part.y; acc[2] += weight * part.z; acc[3] += weight * part.w;
    }
    if constexpr (VARIANT_SINK) d_all += exp2_approx(sink2 - m_ref);  // 0 without a sink to join
    const float inv = d_all > 0.f ? scales.value / d_all : 0.f;
    const float lse2 = d_all > 0.f ? m_ref + log2_approx(d_all) : FJ_NEG_INF;
    const int token = item.q_begin + q_tok;
    if (item.direct) {
      store_out4(a.out, a.out_stride, a.lse, a.num_qo_heads, token, qo_head, col, acc, inv, lse2);
    } else {
      const i64 slot = ((i64)slot_item * cfg::MAX_Q_LEN + q_tok) * a.num_qo_heads + qo_head;
      *reinterpret_cast<float4*>(a.tmp_o + slot * D + col) = make_float4(acc[0] * inv, acc[1] * inv, acc[2] * inv, acc[3] * inv);
      if (col == 0) a.tmp_lse[slot] = lse2;
    }
  }
  if constexpr (cfg::FUSED_MERGE)
    if (!item.direct) merge_if_last<M, 32 * cfg::WARPS>(a, item, cta, threadIdx.x);
}

}  // namespace decode
