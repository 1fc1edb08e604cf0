//! needs: common/prelude.cuh
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
//
// Expects from the including template: FJ_SPLIT_CANDIDATES, FJ_PLAN_SMEM_INTS and the mask
// template (MaskParams, mask_span_begin).

// Thread 0's %clock64 after each step of a plan, for benchmarks/planner_phases.py, compiled in only
// with -DFJ_PLAN_STAMPS (the cubin built without it is unchanged): the plan's time is a chain of
// dependent steps, and the stamps show each one's share. Each plan overwrites the one before's.
#ifdef FJ_PLAN_STAMPS
__device__ unsigned long long fj_plan_stamps[FJ_PLAN_STAMPS];
#define FJ_PLAN_STAMP(i)                                                \
  do {                                                                  \
    if (threadIdx.x == 0) {                                             \
      unsigned long long now_;                                          \
      asm volatile("mov.u64 %0, %%clock64;" : "=l"(now_));              \
      fj_plan_stamps[i] = now_;                                         \
    }                                                                   \
  } while (0)
#else
#define FJ_PLAN_STAMP(i) do {} while (0)
#endif

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
constexpr unsigned ALL_LANES = 0xffffffffu;
constexpr int PARTS[] = {FJ_SPLIT_CANDIDATES};  // split_plan.SPLIT_CANDIDATES
constexpr int NUM_PARTS = sizeof(PARTS) / sizeof(PARTS[0]);
static_assert(NUM_PARTS <= 64, "a lane holds two candidates");
static_assert(WARPS == 32, "a warp's lanes hold the block's per-warp words");
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
  // Request b's span worth reading (returned) and query tokens; an inverted span is empty, inputs are
  // clamped.
  FJ_INLINE int store(const Args& a, const MaskParams& params, int b, const RequestEntry& e) {
    const int last = min(max(e.last, 1), a.page_size);
    const i64 pages = max(e.end_page - e.first_page, 0);
    const int n = (int)min(pages ? (pages - 1) * a.page_size + last : (i64)0, (i64)0x7fffffff);
    const int q = max(e.q_end - e.q_begin, 0);
    const int span_begin = mask_span_begin(params, n, q);
    const int span = max(n, span_begin) - span_begin;
    kv_len[b] = n; q_len[b] = q; begin[b] = span_begin; len[b] = span; page_begin[b] = e.first_page;
    return span;
  }
};

// One CTA on one SM, whose time is its chain of dependent steps: a step runs only in the warps whose
// data it needs (those that hold requests, the warps pricing chunks, warp 0 choosing), leaving the
// SM's issue slots to them while the rest wait at the next barrier; warp reductions are one REDUX
// each (sm_80), and block-wide steps go through one word per warp.
FJ_INLINE unsigned lane_id() { return threadIdx.x % 32; }
FJ_INLINE int warp_id() { return threadIdx.x / 32; }

__shared__ unsigned warp_words[3][WARPS];  // block_max_sum's
__shared__ int2 warp_sums[2][WARPS];         // block_scan2's; alternate scans use alternate words

// The largest x >= 0 of the block's threads, and the sum of their s in [0, 2^34): three words per
// warp, then three REDUX per warp. The sums go in 16-bit halves, whose totals fit 32 bits.
FJ_INLINE int block_max_sum(int x, i64 s, i64& sum) {
  const unsigned high = __reduce_add_sync(ALL_LANES, (unsigned)(s >> 16));
  const unsigned low = __reduce_add_sync(ALL_LANES, (unsigned)s & 0xffffu);
  x = __reduce_max_sync(ALL_LANES, x);
  if (lane_id() == 0) warp_words[0][warp_id()] = x, warp_words[1][warp_id()] = high, warp_words[2][warp_id()] = low;
  __syncthreads();
  sum = ((i64)__reduce_add_sync(ALL_LANES, warp_words[1][lane_id()]) << 16) + __reduce_add_sync(ALL_LANES, warp_words[2][lane_id()]);
  return (int)__reduce_max_sync(ALL_LANES, warp_words[0][lane_id()]);
}

FJ_INLINE int2 warp_scan2(int2 v) {  // inclusive
  for (int o = 1; o < 32; o <<= 1) {
    const int xo = __shfl_up_sync(ALL_LANES, v.x, o), yo = __shfl_up_sync(ALL_LANES, v.y, o);
    if (lane_id() >= (unsigned)o) v.x += xo, v.y += yo;
  }
  return v;
}

// Inclusive prefix sums of x and of y over the threads of the first busy_warps warps in order, and
// their totals, in those warps (the others only meet the barrier). round counts the calls:
// consecutive calls write different words, and the barrier of the call in between orders a call's
// reads before the words' next writes.
FJ_INLINE int2 block_scan2(int x, int y, int busy_warps, int2& total, int round) {
  const bool busy = warp_id() < busy_warps;
  int2* sums = warp_sums[round & 1];
  int2 mine = make_int2(0, 0);
  if (busy) {
    mine = warp_scan2(make_int2(x, y));
    if (lane_id() == 31) sums[warp_id()] = mine;
  }
  __syncthreads();
  if (!busy) return mine;
  const int2 word = (int)lane_id() < busy_warps ? sums[lane_id()] : make_int2(0, 0);
  total = make_int2(__reduce_add_sync(ALL_LANES, word.x), __reduce_add_sync(ALL_LANES, word.y));
  const bool before = (int)lane_id() < warp_id();
  return make_int2(mine.x + __reduce_add_sync(ALL_LANES, before ? word.x : 0),
                   mine.y + __reduce_add_sync(ALL_LANES, before ? word.y : 0));
}

// n / c and n % c for n < 2^31 and a fixed c >= 1, from magic = 0xffffffff / c: the high word of
// n * magic is the quotient or one less (magic > 2^32 / c - 1), which the remainder corrects. One
// multiply per request instead of a division.
struct FixedDivisor {
  unsigned c, magic;
  FixedDivisor() = default;  // for shared memory
  FJ_INLINE explicit FixedDivisor(unsigned divisor) : c(divisor), magic(0xffffffffu / divisor) {}
  FJ_INLINE FixedDivisor(unsigned divisor, unsigned its_magic) : c(divisor), magic(its_magic) {}
  FJ_INLINE unsigned quotient(unsigned n, unsigned& rest) const {
    unsigned q = __umulhi(n, magic);
    rest = n - q * c;
    if (rest >= c) ++q, rest -= c;
    return q;
  }
  FJ_INLINE unsigned ceil_quotient(unsigned n) const {
    unsigned rest;
    const unsigned q = quotient(n, rest);
    return q + (rest != 0);
  }
  FJ_INLINE unsigned round_up(unsigned n) const { return ceil_quotient(n) * c; }  // n + c - 1 below 2^32
};

// FixedDivisor's magic of each of PARTS, computed by the compiler.
struct PartMagics {
  unsigned of[NUM_PARTS];
  __host__ __device__ constexpr PartMagics() : of() {
    for (int k = 0; k < NUM_PARTS; ++k) of[k] = 0xffffffffu / PARTS[k];
  }
};
constexpr PartMagics PART_MAGICS{};

// Lane k's candidates PARTS[k] and PARTS[k + 32] (past the end: the last), and their magics. A
// lane-dependent index reads the arrays from global memory: the planner loads them with the page
// table, whose round trip hides theirs.
struct LaneCandidates {
  int parts_low, parts_high;
  unsigned magic_low, magic_high;
  FJ_INLINE LaneCandidates() {
    const int low = min((int)lane_id(), NUM_PARTS - 1), high = min((int)lane_id() + 32, NUM_PARTS - 1);
    parts_low = PARTS[low], parts_high = PARTS[high];
    magic_low = PART_MAGICS.of[low], magic_high = PART_MAGICS.of[high];
  }
  FJ_INLINE FixedDivisor divisor(int half) const {
    return half ? FixedDivisor(parts_high, magic_high) : FixedDivisor(parts_low, magic_low);
  }
};

// What choose_chunk derives from the parameters alone: thread 0 works it out while the page table's
// loads are in flight, rather than every pricing warp after them.
struct ChunkConstants {
  unsigned granularity, granularity_magic, floor_chunk;
  int max_parts;
  double share;  // a CTA slot's share of the GPU's, for the fluid bound
};
__shared__ ChunkConstants chunk_constants;

FJ_INLINE void set_chunk_constants(const Args& a) {
  const FixedDivisor by_granularity((unsigned)a.granularity);
  chunk_constants = {by_granularity.c, by_granularity.magic, max(by_granularity.round_up(a.min_chunk), by_granularity.c),
                     max(1, a.max_ctas / a.ctas_per_item), __ddiv_rn((double)a.ctas_per_item, (double)a.max_ctas)};
}

// The chunk the requests are cut into, as a FixedDivisor for the scan: a forced chunk's set by
// thread 0 as the plan starts, a chosen one's by choose_chunk (a plan of one item per request
// divides nothing).
__shared__ FixedDivisor plan_chunk;

// Counts saturate at SATURATED: past any work capacity (3 x capacity int4 records are indexed in
// 32 bits), so a saturated count prices its chunk at +inf as the exact one would.
constexpr unsigned SATURATED = 1u << 30;

// Each slice's item counts per candidate, saturated, for warp 0 to add up: plain stores and one pass
// of loads, rather than shared atomics and their carry words.
struct SliceCounts {
  unsigned of[2][WARPS][64];  // [items, long items][slice][candidate]
  FJ_INLINE unsigned sum(int which, int n, int slices) const {  // saturated: exact below SATURATED
    unsigned long long total = 0;
#pragma unroll 8
    for (int s = 0; s < slices; ++s) total += of[which][s][n];
    return (unsigned)min(total, (unsigned long long)SATURATED);
  }
};
__shared__ SliceCounts slice_counts;

// split_plan.makespans for one chunk from its counts (items <= SATURATED), in the host's doubles:
// the _rn intrinsics are never fused into FMAs, so every cost, hence every comparison, is the host's.
FJ_INLINE double makespan(const Args& a, int batch, unsigned chunk, unsigned items, unsigned long_items, i64 total,
                          double share) {
  if (items > (unsigned)a.work_capacity) return __longlong_as_double(0x7ff0000000000000ll);  // +inf
  const double fluid = __dmul_rn((double)(total + (i64)items * a.item_overhead), share);
  const double waves = ceil(__ddiv_rn(__dmul_rn((double)long_items, (double)a.ctas_per_item), (double)a.max_ctas));
  const double quantized = __dmul_rn(waves, (double)(chunk + a.item_overhead));
  return __dadd_rn(fluid > quantized ? fluid : quantized, items > (unsigned)batch ? (double)a.merge_cost : 0.0);
}

// split_plan.choose_chunk for a longest span past min_chunk, its result in plan_chunk when the
// block leaves. The host prices chunk_candidates: PARTS up to max_parts, duplicates and the floor's
// repeats dropped. Candidates are non-increasing, so the dropped ones repeat their predecessor's
// chunk and cost, and pricing the whole prefix of PARTS up to max_parts picks the same first
// minimum. Lane k of a pricing warp counts candidate k's items (or k + 32's, in a second warp per
// slice when more than 32 are priced) over its slice of the requests, into slice_counts; then warp
// 0 adds them up, prices every candidate and takes the first minimum.
__device__ void choose_chunk(const Args& a, const Requests& r, int batch, int longest, i64 total,
                             const LaneCandidates& candidates) {
  const ChunkConstants k = chunk_constants;
  const FixedDivisor by_granularity(k.granularity, k.granularity_magic);
  const unsigned lane = lane_id();
  auto chunk_of = [&](int half) {
    return max(by_granularity.round_up(candidates.divisor(half).ceil_quotient(longest)), k.floor_chunk);
  };
  auto priced = [&](int n, int parts) { return n < NUM_PARTS && parts <= k.max_parts; };
  const int halves = priced(32, PARTS[min(32, NUM_PARTS - 1)]) ? 2 : 1;
  // Slices of 32 requests, or of a 16th or 32nd of the batch where the warps run out: pricing in
  // every warp measured slower, each warp issuing its own set-up (a division among it).
  const int most = WARPS / halves;
  const bool many = batch > 32 * most;
  const int slices = many ? most : (batch + 31) >> 5;
  const int per_slice = !many ? 32 : halves == 2 ? (batch + 15) >> 4 : (batch + 31) >> 5;

  if (warp_id() < slices * halves) {
    const int half = halves == 2 ? warp_id() & 1 : 0, slice = warp_id() >> (halves - 1), n = lane + 32 * half;
    const int parts = half ? candidates.parts_high : candidates.parts_low;
    const int first = slice * per_slice, end = min(batch, first + per_slice);
    unsigned long long items = 0, long_items = 0;
    if (priced(n, parts) && first < end) {
      const FixedDivisor divisor(chunk_of(half));
#pragma unroll 4
      for (int b = first; b < end; ++b) {  // every lane reads the same length: one broadcast load
        unsigned rest;
        const unsigned len = (unsigned)r.len[b], whole = divisor.quotient(len, rest);
        items += whole + (rest != 0 || len == 0);  // an empty span is one (empty) item
        long_items += whole + (2 * rest >= divisor.c);
      }
    }
    slice_counts.of[0][slice][n] = (unsigned)min(items, (unsigned long long)SATURATED);
    slice_counts.of[1][slice][n] = (unsigned)min(long_items, (unsigned long long)SATURATED);
  }
  __syncthreads();

  if (warp_id() == 0) {
    double cost = __longlong_as_double(0x7ff0000000000000ll);  // +inf: unpriced
    unsigned index = 0, chunk = 0;
    for (int half = 0; half < halves; ++half) {
      const int n = lane + 32 * half, parts = half ? candidates.parts_high : candidates.parts_low;
      if (!priced(n, parts)) continue;
      const unsigned c = chunk_of(half);
      const double price = makespan(a, batch, c, slice_counts.sum(0, n, slices), slice_counts.sum(1, n, slices), total, k.share);
      if (half == 0 || price < cost) cost = price, index = n, chunk = c;
    }
    const FixedDivisor mine(max(chunk, 1u));  // its division overlaps the reductions below
    // The first minimum: costs are non-negative, so their bits order as unsigned integers.
    const unsigned high = (unsigned)__double2hiint(cost), low = (unsigned)__double2loint(cost);
    const unsigned least_high = __reduce_min_sync(ALL_LANES, high);
    const unsigned least_low = __reduce_min_sync(ALL_LANES, high == least_high ? low : 0xffffffffu);
    const unsigned best = __reduce_min_sync(ALL_LANES, high == least_high && low == least_low ? index : 64u);
    if (index == best && (best != 0 || lane == 0)) plan_chunk = mine;
  }
  __syncthreads();
}

// The last request whose work items begin at or before w0, for w0 below the plan's items (warp-
// uniform): a 32-way search of work_at[0..batch], which strictly increases (every request has an item).
FJ_INLINE int request_of(const int* work_at, int batch, int w0) {
  int low = 0, count = batch + 1;  // the answer is in [low, low + count)
  while (count > 1) {
    const int step = (count + 31) / 32, probe = low + (int)lane_id() * step;
    const bool at_or_before = probe < low + count && work_at[probe] <= w0;
    const int k = __popc(__ballot_sync(ALL_LANES, at_or_before)) - 1;  // work_at[low] <= w0: k >= 0
    low += k * step;
    count = min(step, count - k * step);
  }
  return low;
}

// The whole plan: one round of loads from the page table (issued with the batch size's), the rest
// in shared memory.
__device__ void build(const Args& a, const MaskParams& params) {
  FJ_PLAN_STAMP(0);
  extern __shared__ int smem[];
  Requests r(smem, a.batch_capacity);
  const LaneCandidates candidates;
  RequestEntry prefetched{};  // this thread's first request's entries, fetched before the batch is known
  if (threadIdx.x < a.batch_capacity) prefetched = Requests::fetch(a, threadIdx.x);
  const int batch_read = __ldg(a.batch);
  if (threadIdx.x == 0) {  // before anything waits for the loads
    r.work_at[0] = r.tokens_at[0] = 0;
    if (a.chunk_tokens == 0) set_chunk_constants(a);
    if (a.chunk_tokens > 0) plan_chunk = FixedDivisor((unsigned)a.chunk_tokens);
  }
  const int batch = min(max(batch_read, 0), a.batch_capacity);
  int longest = 0;
  i64 total = 0;  // the spans' summed length
  for (int b = threadIdx.x; b < batch; b += THREADS) {
    const int len = r.store(a, params, b, b < THREADS ? prefetched : Requests::fetch(a, b));
    longest = max(longest, len);
    total += len;
  }
  FJ_PLAN_STAMP(1);
  longest = block_max_sum(longest, total, total);  // its barrier also publishes the requests
  FJ_PLAN_STAMP(2);
  // A chunk past every span makes one item a request, which needs no division.
  bool one_item = a.chunk_tokens < 0 || (a.chunk_tokens == 0 && longest <= a.min_chunk);
  unsigned chunk = max(longest, 1);
  if (a.chunk_tokens == 0 && one_item) {
    chunk = FixedDivisor(chunk_constants.granularity, chunk_constants.granularity_magic).round_up(chunk);
  } else if (!one_item) {
    if (a.chunk_tokens == 0) choose_chunk(a, r, batch, longest, total, candidates);
    chunk = plan_chunk.c;
  }
  FJ_PLAN_STAMP(3);
  int round = 0, num_work, num_tokens;
  for (int pass = 0; pass < 2; ++pass) {  // a second pass only when a forced chunk overflows the capacity
    int2 carry = make_int2(0, 0);  // in the warps holding this round's requests
    for (int base = 0; base < batch; base += THREADS) {
      const int b = base + threadIdx.x, busy_warps = min(WARPS, (batch - base + 31) / 32);
      int items = 0, tokens = 0;
      if (warp_id() < busy_warps && b < batch) {
        items = one_item ? 1 : max((int)plan_chunk.ceil_quotient((unsigned)r.len[b]), 1);
        tokens = r.q_len[b];
      }
      int2 round_total = make_int2(0, 0);
      const int2 ends = block_scan2(items, tokens, busy_warps, round_total, round++);
      if (b < batch) r.work_at[b + 1] = carry.x + ends.x, r.tokens_at[b + 1] = carry.y + ends.y;
      carry = make_int2(carry.x + round_total.x, carry.y + round_total.y);
    }
    __syncthreads();
    num_work = r.work_at[batch], num_tokens = min(r.tokens_at[batch], a.token_capacity);
    if (num_work <= a.work_capacity || pass) break;
    chunk = max(longest, 1), one_item = true;  // batch <= batch_capacity <= work_capacity
  }
  FJ_PLAN_STAMP(4);

  int4* records = reinterpret_cast<int4*>(a.work_items);
  for (int w0 = warp_id() * 32; w0 < a.work_capacity; w0 += THREADS) {
    const int w = w0 + lane_id();
    int b = 0;
    if (w0 < num_work) {
      // Items w0..w0 + 31 belong to requests b0..b0 + 31 (each has an item): item w to b0 plus the
      // number of those requests whose items end at or before it.
      const int b0 = request_of(r.work_at, batch, w0), next = b0 + 1 + (int)lane_id();
      const unsigned ends = (unsigned)((next <= batch ? r.work_at[next] : 0x7fffffff) - w0);  // >= 1
      const unsigned boundaries = __reduce_or_sync(ALL_LANES, ends < 32 ? 1u << ends : 0u);
      b = b0 + __popc(boundaries & ((2u << lane_id()) - 1));
    }
    if (w >= a.work_capacity) continue;
    if (w >= num_work) {  // padding: a grid position past this plan's items
      records[3 * w] = make_int4(-1, 0, 0, 0);
      continue;
    }
    const int i = w - r.work_at[b], items = r.work_at[b + 1] - r.work_at[b];
    const int begin = r.begin[b], end = begin + r.len[b], first = begin + i * chunk;
    const int last = (int)min((i64)first + chunk, (i64)end);
    records[3 * w] = make_int4(b, first, last, r.kv_len[b]);
    records[3 * w + 1] = make_int4(r.page_begin[b], r.tokens_at[b], r.q_len[b], items);
    records[3 * w + 2] = a.fixed_split ? make_int4(0, first, last, 1) : make_int4(i, begin, end, items);
  }
  FJ_PLAN_STAMP(5);
  for (int b = threadIdx.x; b <= batch; b += THREADS) {
    a.req_work_indptr[b] = r.work_at[b];
    a.req_qo_indptr[b] = r.tokens_at[b];
    if (b < batch)  // each request names itself on its query tokens (within the capacity)
      for (int t = r.tokens_at[b], end = min(r.tokens_at[b + 1], num_tokens); t < end; ++t) a.token_request[t] = b;
  }
  if (threadIdx.x == 0) *a.num_tokens = num_tokens, *a.chunk_out = chunk, *a.num_work_out = num_work;
  FJ_PLAN_STAMP(6);
}

}  // namespace plan
