// The split-KV planner on the GPU (flashjit_plan): the page table to the work list, in one CTA.
//
// CUDA-graph mode launches it at the start of a step, so that each replay re-plans for the lengths
// the page table holds then, and the host computes nothing per step. It computes what the host
// planner does (flashjit/serving/split_plan.py, serving/native/host_plan.c) and writes it in the
// same layout (buffers.PlanBuffers.FIELDS): the chunk with the smallest estimated makespan, then one
// WorkItem record per item and the merge's per-request arrays. The GPU tests compare the two
// planners record for record. The makespan's doubles use the _rn intrinsics, which the compiler
// never fuses into FMAs: every cost, so every comparison, comes out as on the host.
//
// The inputs come from the device's page-table buffer, where a host-side plan() copies them, or
// where the caller wrote them in place; they are clamped rather than trusted (a negative page
// count is an empty request, a last-page length outside the page is clamped to it).
namespace plan {
using namespace fj;

struct Args {
  const int* __restrict__ batch;          // [1] requests in this step (at most batch_capacity)
  const int* __restrict__ indptr;         // [batch + 1] page-table CSR offsets
  const int* __restrict__ last_page_len;  // [batch]
  const int* __restrict__ qo_indptr;      // [batch + 1] query-token offsets
  int* __restrict__ work_items;           // the work list: what the decode and merge kernels read
  int* __restrict__ num_tokens;
  int* __restrict__ req_qo_indptr;
  int* __restrict__ req_work_indptr;
  int* __restrict__ token_request;
  int* __restrict__ chunk_out;            // [1] the chunk chosen, and [1] the work items made (for tests)
  int* __restrict__ num_work_out;
  int page_size;
  int batch_capacity, work_capacity, token_capacity;
  int ctas_per_item, max_ctas, granularity, min_chunk;
  int chunk_tokens;                       // > 0 forces the chunk, 0 plans it, -1 one item per request
  int fixed_split;                        // 1: each item its own tile-sharing group (WorkItem), 0: its request
  int item_overhead, merge_cost;
};

constexpr int THREADS = 1024, WARPS = THREADS / 32;
constexpr int PARTS[] = {FJ_SPLIT_CANDIDATES};  // split_plan.SPLIT_CANDIDATES
constexpr int NUM_PARTS = sizeof(PARTS) / sizeof(PARTS[0]);
// Dynamic shared memory, per request (plus one): its span's length and begin, kv_len, query tokens,
// first page, and the offsets of its work items and query tokens. The host sizes it by this count.
static_assert(FJ_PLAN_SMEM_INTS == 7, "ABI: plan::Requests keeps 7 ints per request, not "
                                      "flashjit.jit.abi.PLAN_SMEM_INTS");

FJ_INLINE i64 ceil_div64(i64 a, i64 b) { return (a + b - 1) / b; }

// One request's page-table entries, as loaded.
struct RequestEntry {
  int first_page, end_page, last, q_begin, q_end;
};

// The requests as the planner sees them, in shared memory: read from the page table once.
struct Requests {
  int *len, *begin, *kv_len, *q_len, *page_begin, *work_at, *tokens_at;  // work_at, tokens_at: [batch + 1] offsets
  FJ_INLINE Requests(int* smem, int capacity) {
    const int n = capacity + 1;
    len = smem; begin = smem + n; kv_len = smem + 2 * n; q_len = smem + 3 * n; page_begin = smem + 4 * n;
    work_at = smem + 5 * n; tokens_at = smem + 6 * n;
  }
  // Request b's entries: b below the buffer's capacity, so the loads need not wait for the batch
  // size (they go out beside its load; entries past the batch are never used).
  FJ_INLINE static RequestEntry fetch(const Args& a, int b) {
    return {__ldg(a.indptr + b), __ldg(a.indptr + b + 1), __ldg(a.last_page_len + b), __ldg(a.qo_indptr + b),
            __ldg(a.qo_indptr + b + 1)};
  }
  // Request b's span worth reading and query tokens; an inverted span is empty, inputs are clamped.
  FJ_INLINE void store(const Args& a, const MaskParams& params, int b, const RequestEntry& e) {
    const int last = min(max(e.last, 1), a.page_size);
    const i64 pages = max(e.end_page - e.first_page, 0);
    const int n = (int)min(pages ? (pages - 1) * a.page_size + last : (i64)0, (i64)0x7fffffff);
    const int q = max(e.q_end - e.q_begin, 0);
    const int span_begin = mask_span_begin(params, n, q);
    kv_len[b] = n; q_len[b] = q; begin[b] = span_begin; len[b] = max(n, span_begin) - span_begin;
    page_begin[b] = e.first_page;
  }
};

// Block-wide reductions and scans, through one word per warp.
__shared__ i64 warp_values[WARPS];
__shared__ int warp_sums[2][WARPS];

FJ_INLINE i64 block_max(i64 x) {
  for (int o = 16; o > 0; o >>= 1) x = max(x, (i64)__shfl_xor_sync(0xffffffffu, x, o));
  if (threadIdx.x % 32 == 0) warp_values[threadIdx.x / 32] = x;
  __syncthreads();
  i64 m = 0;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) m = max(m, warp_values[w]);
  __syncthreads();
  return m;
}

// Inclusive prefix sums of x and of y over the block's threads in order, and the block's totals:
// the two scans share their barriers.
FJ_INLINE int2 block_scan2(int x, int y, int2& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int o = 1; o < 32; o <<= 1) {
    const int xo = __shfl_up_sync(0xffffffffu, x, o), yo = __shfl_up_sync(0xffffffffu, y, o);
    if (lane >= o) x += xo, y += yo;
  }
  if (lane == 31) warp_sums[0][warp] = x, warp_sums[1][warp] = y;
  __syncthreads();
  int2 before = make_int2(0, 0);
  total = make_int2(0, 0);
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    const int wx = warp_sums[0][w], wy = warp_sums[1][w];
    if (w < warp) before.x += wx, before.y += wy;
    total.x += wx; total.y += wy;
  }
  __syncthreads();
  return make_int2(x + before.x, y + before.y);
}

// split_plan.makespans for one chunk, reduced over the requests by a group of LANES lanes of a
// warp (lane: this thread's index in it). Integer parts in 32 bits (lengths and chunks are below
// 2^31, so len + chunk and twice a remainder fit), which give the host's exact values:
// floor(len / chunk + 1/2) is the quotient plus one where twice the remainder reaches the chunk.
template <int LANES>
__device__ double makespan(const Args& a, const Requests& r, int batch, int chunk, double share, int lane) {
  const unsigned c = (unsigned)chunk;
  i64 items = 0, long_items = 0, total = 0;
  for (int b = lane; b < batch; b += LANES) {
    const unsigned len = (unsigned)r.len[b], whole = len / c, rest = len - whole * c;
    items += len ? whole + (rest != 0) : 1;
    long_items += whole + (2 * rest >= c);
    total += len;
  }
  for (int o = LANES / 2; o > 0; o >>= 1) {
    items += __shfl_xor_sync(0xffffffffu, items, o);
    long_items += __shfl_xor_sync(0xffffffffu, long_items, o);
    total += __shfl_xor_sync(0xffffffffu, total, o);
  }
  if (items > a.work_capacity) return __longlong_as_double(0x7ff0000000000000ll);  // +inf
  const double fluid = __dmul_rn((double)(total + items * a.item_overhead), share);
  const double waves = ceil(__ddiv_rn(__dmul_rn((double)long_items, (double)a.ctas_per_item), (double)a.max_ctas));
  const double quantized = __dmul_rn(waves, (double)(chunk + a.item_overhead));
  return __dadd_rn(fluid > quantized ? fluid : quantized, items > batch ? (double)a.merge_cost : 0.0);
}

// split_plan.choose_chunk: every candidate is priced at once, by a half-warp each (no warp prices
// two in turn), and warp 0 takes the first minimum by shuffles.
__device__ int choose_chunk(const Args& a, const Requests& r, int batch, i64 longest) {
  constexpr int LANES = 16, GROUPS = THREADS / LANES;
  static_assert(NUM_PARTS <= GROUPS && NUM_PARTS <= 64, "a half-warp per candidate, two per lane of warp 0");
  const i64 g = a.granularity;
  if (longest <= a.min_chunk) return (int)(ceil_div64(max(longest, (i64)1), g) * g);
  const i64 floor_chunk = max(ceil_div64(a.min_chunk, g) * g, g);
  const int max_parts = max(1, a.max_ctas / a.ctas_per_item);
  const double share = __ddiv_rn((double)a.ctas_per_item, (double)a.max_ctas);
  __shared__ double costs[NUM_PARTS];
  __shared__ int chunks[NUM_PARTS];
  const int i = threadIdx.x / LANES, lane = threadIdx.x % LANES;
  if (threadIdx.x / 32 < (NUM_PARTS + 1) / 2) {  // whole warps: makespan's shuffles take all 32 lanes
    const int part = min(i, NUM_PARTS - 1);  // an odd count's spare half-warp prices the last again
    const i64 chunk = max(ceil_div64(ceil_div64(longest, PARTS[part]), g) * g, floor_chunk);
    const i64 previous = part ? max(ceil_div64(ceil_div64(longest, PARTS[part - 1]), g) * g, floor_chunk) : 0;
    // The host's loop stops past max_parts and after the floor, and skips a repeated chunk.
    const bool priced = PARTS[part] <= max_parts && (part == 0 || (previous != chunk && previous != floor_chunk));
    const double cost = makespan<LANES>(a, r, batch, (int)chunk, share, lane);  // priced or not: no divergence
    if (lane == 0 && i < NUM_PARTS) {
      costs[i] = cost;
      chunks[i] = priced ? (int)chunk : 0;
    }
  }
  __syncthreads();
  __shared__ int best;
  if (threadIdx.x < 32) {
    // The first priced candidate of least cost: the least (unpriced, cost, index), two per lane.
    int index = -1;
    double cost = 0.0;
    for (int k = threadIdx.x; k < NUM_PARTS; k += 32) {
      if (chunks[k] && (index < 0 || costs[k] < cost)) index = k, cost = costs[k];
    }
    for (int o = 16; o > 0; o >>= 1) {
      const int other = __shfl_xor_sync(0xffffffffu, index, o);
      const double other_cost = __shfl_xor_sync(0xffffffffu, cost, o);
      if (other >= 0 && (index < 0 || other_cost < cost || (other_cost == cost && other < index)))
        index = other, cost = other_cost;
    }
    if (threadIdx.x == 0) best = index < 0 ? 0 : chunks[index];
  }
  __syncthreads();
  return best;
}

// The last index b in [0, n) with values[b] <= x (values increasing from values[0] <= x).
FJ_INLINE int last_at_most(const int* values, int n, int x) {
  int low = 0, high = n - 1;
  while (low < high) {
    const int mid = (low + high + 1) / 2;
    if (values[mid] <= x) low = mid; else high = mid - 1;
  }
  return low;
}

// The whole plan: one round of loads from the page table (issued with the batch size's), the rest
// in shared memory.
__device__ void build(const Args& a, const MaskParams& params) {
  extern __shared__ int smem[];
  Requests r(smem, a.batch_capacity);
  RequestEntry first{};  // the entries of this thread's first request, fetched before the batch is known
  if (threadIdx.x < a.batch_capacity) first = Requests::fetch(a, threadIdx.x);
  const int batch = min(max(__ldg(a.batch), 0), a.batch_capacity);
  i64 longest = 0;
  for (int b = threadIdx.x; b < batch; b += THREADS) {
    r.store(a, params, b, b < THREADS ? first : Requests::fetch(a, b));
    longest = max(longest, (i64)r.len[b]);
  }
  longest = block_max(longest);  // its barrier also publishes the requests
  int chunk = a.chunk_tokens > 0 ? a.chunk_tokens : a.chunk_tokens < 0 ? (int)max(longest, (i64)1)
                                                                          : choose_chunk(a, r, batch, longest);
  for (int pass = 0; pass < 2; ++pass) {  // a second pass only when a forced chunk overflows the capacity
    int work_carry = 0, token_carry = 0;
    for (int base = 0; base < batch; base += THREADS) {
      const int b = base + threadIdx.x;
      const int items = b < batch ? max((int)ceil_div64(r.len[b], chunk), 1) : 0, tokens = b < batch ? r.q_len[b] : 0;
      int2 total;
      const int2 ends = block_scan2(items, tokens, total);
      if (b < batch) r.work_at[b + 1] = work_carry + ends.x, r.tokens_at[b + 1] = token_carry + ends.y;
      work_carry += total.x;
      token_carry += total.y;
    }
    if (work_carry <= a.work_capacity || pass) break;
    chunk = (int)max(longest, (i64)1);  // one item per request: batch <= batch_capacity <= work_capacity
  }
  if (threadIdx.x == 0) r.work_at[0] = r.tokens_at[0] = 0;
  __syncthreads();
  const int num_work = r.work_at[batch], num_tokens = min(r.tokens_at[batch], a.token_capacity);

  int4* records = reinterpret_cast<int4*>(a.work_items);
  for (int w = threadIdx.x; w < a.work_capacity; w += THREADS) {
    if (w >= num_work) {  // padding: a grid position past this plan's items
      records[3 * w] = make_int4(-1, 0, 0, 0);
      continue;
    }
    const int b = last_at_most(r.work_at, batch + 1, w), i = w - r.work_at[b];
    const int begin = r.begin[b], end = begin + r.len[b], first = begin + i * chunk;
    const int last = (int)min((i64)first + chunk, (i64)end), items = r.work_at[b + 1] - r.work_at[b];
    records[3 * w] = make_int4(b, first, last, r.kv_len[b]);
    records[3 * w + 1] = make_int4(r.page_begin[b], r.tokens_at[b], r.q_len[b], items);
    records[3 * w + 2] = a.fixed_split ? make_int4(0, first, last, 1) : make_int4(i, begin, end, items);
  }
  for (int b = threadIdx.x; b <= batch; b += THREADS) {
    a.req_work_indptr[b] = r.work_at[b];
    a.req_qo_indptr[b] = r.tokens_at[b];
  }
  for (int t = threadIdx.x; t < num_tokens; t += THREADS) a.token_request[t] = last_at_most(r.tokens_at, batch + 1, t);
  if (threadIdx.x == 0) *a.num_tokens = num_tokens, *a.chunk_out = chunk, *a.num_work_out = num_work;
}

}  // namespace plan
