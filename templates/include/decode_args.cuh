// Launch arguments shared by the decode kernels (CUDA-core and tensor-core). Mirrored by
// flashjit.kernel.DecodeArgs: keep the two in the same order.
namespace decode {
using namespace fj;

struct Args {
  const q_t* __restrict__ q; i64 q_stride;            // [tokens, qo_heads, D], token stride in elements
  const kv_t* __restrict__ k; const kv_t* __restrict__ v;
  i64 page_stride, slot_stride, head_stride;           // element strides of the paged cache
  const int* __restrict__ page_indices;
  const int* __restrict__ work_request; const int* __restrict__ work_begin; const int* __restrict__ work_end;
  const int* __restrict__ num_work;                     // device scalar: items past it are padding
  const int* __restrict__ req_kv_len; const int* __restrict__ req_page_begin;
  const int* __restrict__ req_qo_indptr; const int* __restrict__ req_work_indptr;
  out_t* __restrict__ out; i64 out_stride;
  float* __restrict__ lse;                              // natural-log LSE [tokens, qo_heads] or null
  float* __restrict__ tmp_o; float* __restrict__ tmp_lse;
  int num_qo_heads;
  float sm_scale_log2;                                  // sm_scale * log2(e)
};

FJ_INLINE i64 token_offset(const Args& a, int page, int slot) {
  return (i64)page * a.page_stride + (i64)slot * a.slot_stride;
}

}  // namespace decode
