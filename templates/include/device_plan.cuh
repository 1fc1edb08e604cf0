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

// Block-wide reductions and scans, through one word per warp, which warps combine with a word
// per lane and a few shuffles. Shared-memory loads and shuffles share the SM's one pipe, so with
// 1024 threads the cost is what every warp issues: warps that hold no request skip their own
// round, and no thread loads more than a word.
static_assert(WARPS == 32, "a warp's lanes hold the block's per-warp words");
__shared__ int warp_max[WARPS];
__shared__ int2 warp_sums[2][WARPS];  // alternate scans use alternate words (no barrier between)

FJ_INLINE unsigned lane_id() { return threadIdx.x % 32; }

FJ_INLINE int warp_max_of(int x) {
  for (int o = 16; o > 0; o >>= 1) x = max(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// The largest x of the block's threads, non-negative; busy: whether this warp holds any x > 0
// (warp-uniform). Once per plan: its words are never reused.
FJ_INLINE int block_max(int x, bool busy) {
  if (busy) x = warp_max_of(x);
  if (lane_id() == 0) warp_max[threadIdx.x / 32] = x;
  __syncthreads();
  return warp_max_of(warp_max[lane_id()]);
}

FJ_INLINE int2 warp_scan2(int2 v) {  // inclusive
  for (int o = 1; o < 32; o <<= 1) {
    const int xo = __shfl_up_sync(0xffffffffu, v.x, o), yo = __shfl_up_sync(0xffffffffu, v.y, o);
    if (lane_id() >= (unsigned)o) v.x += xo, v.y += yo;
  }
  return v;
}

// Inclusive prefix sums of x and of y over the block's threads in order, and the block's totals;
// busy as for block_max. round counts the calls: consecutive calls write different words, and the
// barrier of the call in between orders a call's reads before the words' next writes.
FJ_INLINE int2 block_scan2(int x, int y, bool busy, int2& total, int round) {
  const int warp = threadIdx.x / 32;
  const int2 mine = busy ? warp_scan2(make_int2(x, y)) : make_int2(0, 0);
  if (lane_id() == 31) warp_sums[round & 1][warp] = mine;
  __syncthreads();
  const int2 warps = warp_scan2(warp_sums[round & 1][lane_id()]);
  total = make_int2(__shfl_sync(0xffffffffu, warps.x, 31), __shfl_sync(0xffffffffu, warps.y, 31));
  if (!busy) return mine;
  const int before_x = __shfl_sync(0xffffffffu, warps.x, (warp + 31) % 32);
  const int before_y = __shfl_sync(0xffffffffu, warps.y, (warp + 31) % 32);
  return warp ? make_int2(mine.x + before_x, mine.y + before_y) : mine;
}

FJ_INLINE unsigned round_up(unsigned x, unsigned g) { return (x + g - 1) / g * g; }

// Lane k's candidates PARTS[k] and PARTS[k + 32] (past the end: the last). A lane-dependent index
// reads the array from global memory: the planner loads them with the page table, whose round trip
// hides theirs.
FJ_INLINE int2 lane_candidates() {
  return make_int2(PARTS[min((int)lane_id(), NUM_PARTS - 1)], PARTS[min((int)lane_id() + 32, NUM_PARTS - 1)]);
}

// n / c and n % c for n < 2^31 and a fixed c >= 1, from magic = 0xffffffff / c: the high word of
// n * magic is the quotient or one less (magic > 2^32 / c - 1), which the remainder corrects. One
// multiply in the makespan's inner loop instead of a division.
struct FixedDivisor {
  unsigned c, magic;
  FJ_INLINE explicit FixedDivisor(unsigned divisor) : c(divisor), magic(0xffffffffu / divisor) {}
  FJ_INLINE unsigned quotient(unsigned n, unsigned& rest) const {
    unsigned q = __umulhi(n, magic);
    rest = n - q * c;
    if (rest >= c) ++q, rest -= c;
    return q;
  }
};

// a + b for a, b <= SATURATED, saturating there: a count past any work capacity (the host keeps
// capacities far below) only needs to stay past it.
constexpr int SATURATED = 1 << 30;
FJ_INLINE int saturating_add(int a, int b) { return (int)min((unsigned)a + (unsigned)b, (unsigned)SATURATED); }

// split_plan.makespans for one chunk, reduced over the requests by the 32 lanes of a warp; total:
// the requests' summed span lengths. Integer parts in 32 bits (lengths and chunks are below 2^31,
// so len + chunk and twice a remainder fit), which give the host's exact values: floor(len / chunk
// + 1/2) is the quotient plus one where twice the remainder reaches the chunk. Item counts
// saturate: one past the capacity prices the chunk at +inf whatever its exact value.
__device__ double makespan(const Args& a, const Requests& r, int batch, int chunk, double share, i64 total) {
  const FixedDivisor divisor((unsigned)chunk);
  i64 lane_items = 0, lane_long = 0;
  for (int b = lane_id(); b < batch; b += 32) {
    unsigned rest;
    const unsigned len = (unsigned)r.len[b], whole = divisor.quotient(len, rest);
    lane_items += whole + (rest != 0 || len == 0);
    lane_long += whole + (2 * rest >= divisor.c);
  }
  int items = (int)min(lane_items, (i64)SATURATED), long_items = (int)min(lane_long, (i64)SATURATED);
  for (int o = 16; o > 0; o >>= 1) {
    items = saturating_add(items, __shfl_xor_sync(0xffffffffu, items, o));
    long_items = saturating_add(long_items, __shfl_xor_sync(0xffffffffu, long_items, o));
  }
  if (items > a.work_capacity) return __longlong_as_double(0x7ff0000000000000ll);  // +inf
  const double fluid = __dmul_rn((double)(total + (i64)items * a.item_overhead), share);
  const double waves = ceil(__ddiv_rn(__dmul_rn((double)long_items, (double)a.ctas_per_item), (double)a.max_ctas));
  const double quantized = __dmul_rn(waves, (double)(chunk + a.item_overhead));
  return __dadd_rn(fluid > quantized ? fluid : quantized, items > batch ? (double)a.merge_cost : 0.0);
}

// split_plan.choose_chunk. Lane k of every warp holds candidates k and k + 32 and whether the host
// prices them; warp w prices the priced candidates w, w + WARPS, ... (in the host's order) with all
// its lanes, and warp 0 takes the first minimum.
__device__ int choose_chunk(const Args& a, const Requests& r, int batch, int longest, int2 candidates) {
  static_assert(NUM_PARTS <= 64, "two candidates per lane");
  const unsigned g = a.granularity, lane = lane_id();
  if (longest <= a.min_chunk) return (int)round_up(max(longest, 1), g);
  const unsigned floor_chunk = max(round_up(a.min_chunk, g), g);
  const int max_parts = max(1, a.max_ctas / a.ctas_per_item);
  auto chunk_of = [&](int parts) { return max(round_up(((unsigned)longest + parts - 1) / parts, g), floor_chunk); };
  const int parts_low = candidates.x, parts_high = candidates.y;
  const unsigned chunk_low = chunk_of(parts_low), chunk_high = chunk_of(parts_high);
  const unsigned last_low = __shfl_sync(0xffffffffu, chunk_low, 31);
  const unsigned previous_low = __shfl_up_sync(0xffffffffu, chunk_low, 1);
  const unsigned high_up = __shfl_up_sync(0xffffffffu, chunk_high, 1), previous_high = lane ? high_up : last_low;
  // The host's loop stops past max_parts and after the floor, and skips a repeated chunk.
  auto priced = [&](int k, int parts, unsigned chunk, unsigned previous) {
    return k < NUM_PARTS && parts <= max_parts && (k == 0 || (previous != chunk && previous != floor_chunk));
  };
  const bool low_priced = priced(lane, parts_low, chunk_low, previous_low);
  const bool high_priced = priced(lane + 32, parts_high, chunk_high, previous_high);
  const unsigned low_mask = __ballot_sync(0xffffffffu, low_priced), high_mask = __ballot_sync(0xffffffffu, high_priced);
  const unsigned below = (1u << lane) - 1;
  const int num_low = __popc(low_mask), num_priced = num_low + __popc(high_mask);
  const int low_rank = __popc(low_mask & below), high_rank = num_low + __popc(high_mask & below);
  auto nth_chunk = [&](int n) {  // the n-th priced candidate's chunk, n warp-uniform
    const unsigned low_hit = __ballot_sync(0xffffffffu, low_priced && low_rank == n);
    const unsigned high_hit = __ballot_sync(0xffffffffu, high_priced && high_rank == n);
    const unsigned from_low = __shfl_sync(0xffffffffu, chunk_low, low_hit ? __ffs(low_hit) - 1 : 0);
    const unsigned from_high = __shfl_sync(0xffffffffu, chunk_high, high_hit ? __ffs(high_hit) - 1 : 0);
    return low_hit ? from_low : from_high;
  };
  __shared__ double costs[NUM_PARTS];
  __shared__ int best;
  if ((int)threadIdx.x / 32 < num_priced) {  // a pricing warp
    i64 total = 0;  // the same for every candidate
    for (int b = lane; b < batch; b += 32) total += r.len[b];
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    const double share = __ddiv_rn((double)a.ctas_per_item, (double)a.max_ctas);
    for (int n = threadIdx.x / 32; n < num_priced; n += WARPS) {
      const double cost = makespan(a, r, batch, (int)nth_chunk(n), share, total);
      if (lane == 0) costs[n] = cost;
    }
  }
  __syncthreads();
  if (threadIdx.x < 32) {  // the first minimum, two candidates per lane
    int index = -1;
    double cost = 0.0;
    for (int n = lane; n < num_priced; n += 32)
      if (index < 0 || costs[n] < cost) index = n, cost = costs[n];
    for (int o = 16; o > 0; o >>= 1) {
      const int other = __shfl_xor_sync(0xffffffffu, index, o);
      const double other_cost = __shfl_xor_sync(0xffffffffu, cost, o);
      if (other >= 0 && (index < 0 || other_cost < cost || (other_cost == cost && other < index)))
        index = other, cost = other_cost;
    }
    const unsigned chunk = nth_chunk(index);  // index >= 0: the first candidate is always priced
    if (lane == 0) best = (int)chunk;
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
  const int2 candidates = lane_candidates();
  RequestEntry first{};  // the entries of this thread's first request, fetched before the batch is known
  if (threadIdx.x < a.batch_capacity) first = Requests::fetch(a, threadIdx.x);
  const int batch = min(max(__ldg(a.batch), 0), a.batch_capacity);
  int longest = 0;
  for (int b = threadIdx.x; b < batch; b += THREADS) {
    r.store(a, params, b, b < THREADS ? first : Requests::fetch(a, b));
    longest = max(longest, r.len[b]);
  }
  const bool busy = (int)(threadIdx.x / 32 * 32) < batch;  // this warp's first round holds requests
  longest = block_max(longest, busy);  // its barrier also publishes the requests
  int chunk = a.chunk_tokens > 0 ? a.chunk_tokens : a.chunk_tokens < 0 ? max(longest, 1)
                                                                          : choose_chunk(a, r, batch, longest, candidates);
  int round = 0;
  for (int pass = 0; pass < 2; ++pass) {  // a second pass only when a forced chunk overflows the capacity
    int work_carry = 0, token_carry = 0;
    for (int base = 0; base < batch; base += THREADS) {
      const int b = base + threadIdx.x;
      const int items = b < batch ? max((int)(((unsigned)r.len[b] + chunk - 1) / (unsigned)chunk), 1) : 0;
      const int tokens = b < batch ? r.q_len[b] : 0;
      int2 total;
      const int2 ends = block_scan2(items, tokens, base + (int)(threadIdx.x / 32 * 32) < batch, total, round++);
      if (b < batch) r.work_at[b + 1] = work_carry + ends.x, r.tokens_at[b + 1] = token_carry + ends.y;
      work_carry += total.x;
      token_carry += total.y;
    }
    if (work_carry <= a.work_capacity || pass) break;
    chunk = max(longest, 1);  // one item per request: batch <= batch_capacity <= work_capacity
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
    if (b < batch)  // each request names itself on its query tokens (within the capacity)
      for (int t = r.tokens_at[b], end = min(r.tokens_at[b + 1], num_tokens); t < end; ++t) a.token_request[t] = b;
  }
  if (threadIdx.x == 0) *a.num_tokens = num_tokens, *a.chunk_out = chunk, *a.num_work_out = num_work;
}

}  // namespace plan
