//! needs: common/prelude.cuh worklist/kernel_core.cuh
// The score of one (query row, key) pair, as every attend body turns its product into a logit: the
// mask decides whether the row sees the key, the variant's logits hook transforms a visible score,
// a hidden key's logit is -inf, and the row's maximum over the tile takes the logit in. The attend
// bodies keep only their fragment layouts: which row and which key each score of a fragment holds.
//
// Expects, from the including template before it: the mask template (MaskParams,
// mask_kv_position, mask_visible) and the variant template (VariantParams, VARIANT_LOGITS,
// variant_logits).
namespace decode {
using namespace fj;

// A visible score in the kernels' base-2 units (q . k * sm_scale * log2 e) through the variant's
// logits hook, which takes and returns natural units.
FJ_INLINE float variant_logits2(const VariantParams& vparams, float score2, int q_pos, int kv_pos, int qo_head) {
  return variant_logits(vparams, score2 * FJ_LN2, q_pos, kv_pos, qo_head) * FJ_LOG2E;
}

// A query row of a CTA's tile as the mask and the variant see it: its query token in the request
// (q_idx), that token's position in the sequence (q_pos), its query head, and whether the tile holds
// a row there (a row past the request's rows sees no key).
struct QueryRow {
  int q_idx, q_pos, qo_head;
  bool valid;
};

// How the span positions a body walks become key positions: through the mask's kv_position hook,
// checked against the request's keys (the decode kernels, whose masks may skip keys), or as they
// are (MLA: the causal mask over the whole span, neither hook nor bind).
enum class SpanKeys { mapped, as_is };

// Which keys the variant's logits hook scores: the visible ones (a hidden key's logit is -inf
// whatever the hook gives), or every key, the mask choosing after it (branch-free: the CUDA-core
// kernel, a thread of which scores one key at a time).
enum class VariantKeys { visible, every };

// The mask and variant of a CTA's work item, which turn its products into logits (FJ_SCORE_KEY).
struct KeyScorer {
  const MaskParams& params;  // bound to the item's request (mask_bind)
  const VariantParams& vparams;
  const WorkItem& item;
};

}  // namespace decode

// The logit of span position vpos for QueryRow `row` into `logit` (an lvalue), and into row_max's
// running maximum: `score` (an expression in base-2 units) through the variant's logits hook where
// the mask shows the key; -inf where it hides it or the position lies outside the item's span.
// KEYS (decode::SpanKeys): how span positions become key positions; VARIANT_KEYS
// (decode::VariantKeys): which keys the hook scores, hence whether `score` is evaluated for a
// hidden key.
//
// A macro, not a function: the compiler simplifies a function on its own before it inlines it, and
// a function here compiled the attend loops into other branches and selects than the same code
// written in place (a different PTX for every decode and MLA kernel). Pasted in place, the scoring
// compiles as if each body spelled it out.
#define FJ_SCORE_KEY(KEYS, VARIANT_KEYS, scorer, row, vpos, score, logit, row_max)                           \
  {                                                                                                          \
    const decode::QueryRow& fj_row = (row);                                                                  \
    const int fj_vpos = (vpos);                                                                              \
    bool fj_visible;                                                                                         \
    int fj_kv_pos;                                                                                           \
    if constexpr (KEYS == decode::SpanKeys::as_is) {                                                         \
      fj_visible = fj_row.valid && (scorer).item.in_span(fj_vpos) &&                                         \
                   mask_visible((scorer).params, (scorer).item.request, fj_row.q_idx, (scorer).item.q_len,   \
                                fj_row.q_pos, fj_vpos, (scorer).item.kv_len);                                \
      fj_kv_pos = fj_vpos;                                                                                   \
    } else {                                                                                                 \
      fj_visible = fj_row.valid && (scorer).item.in_span(fj_vpos);                                           \
      fj_kv_pos = 0;                                                                                         \
      if (fj_visible) {                                                                                      \
        fj_kv_pos = mask_kv_position((scorer).params, (scorer).item.request, fj_vpos);                       \
        fj_visible = fj_kv_pos >= 0 && fj_kv_pos < (scorer).item.kv_len &&                                   \
                     mask_visible((scorer).params, (scorer).item.request, fj_row.q_idx, (scorer).item.q_len, \
                                  fj_row.q_pos, fj_kv_pos, (scorer).item.kv_len);                            \
      }                                                                                                      \
    }                                                                                                        \
    if constexpr (VARIANT_LOGITS && VARIANT_KEYS == decode::VariantKeys::every) {                            \
      (logit) = decode::variant_logits2((scorer).vparams, (score), fj_row.q_pos, fj_kv_pos, fj_row.qo_head); \
      (logit) = fj_visible ? (logit) : FJ_NEG_INF;                                                           \
    } else if constexpr (VARIANT_LOGITS) {                                                                   \
      (logit) = fj_visible ? decode::variant_logits2((scorer).vparams, (score), fj_row.q_pos, fj_kv_pos,     \
                                                     fj_row.qo_head)                                         \
                           : FJ_NEG_INF;                                                                     \
    } else {                                                                                                 \
      (logit) = fj_visible ? (score) : FJ_NEG_INF;                                                           \
    }                                                                                                        \
    (row_max) = fmaxf((row_max), (logit));                                                                   \
  }
