/* plan()'s host work in C: the page table's checks and lengths, the split-KV chunk search and the
 * work list, written straight into the pinned staging buffer plan() copies to the GPU; for a plan
 * that shares prefixes, the detection of the shared spans and their work list too.
 *
 * The numpy versions (flashjit/validation.py page_table and query_indptr, flashjit/serving/split_plan.py
 * choose_chunk and plan_work, flashjit/serving/shared_prefix.py and shared_plan.py) are the
 * reference: this file computes the same values in the same order, with the costs in doubles so
 * that every comparison of the chunk search comes out the same (tests/test_host_plan.py,
 * test_shared_prefix.py and test_shared_plan_native.py compare the two on random batches). Whole
 * numbers stay below 2^53, so the doubles hold them exactly; build without -ffast-math and with
 * -ffp-contract=off.
 *
 * A call returns 0, or non-zero when an input is invalid: the caller then runs the numpy checks,
 * which say what is wrong. Nothing here allocates or keeps state.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* int32 per work-item record: flashjit.jit.abi.ITEM_INTS, which the build passes as FJ_ITEM_INTS.
 * fj_fill writes the 12 fields that decode_common.cuh's WorkItem reads. */
#ifndef FJ_ITEM_INTS
#error "build with -DFJ_ITEM_INTS=<flashjit.jit.abi.ITEM_INTS> (flashjit.jit.host_library does)"
#elif FJ_ITEM_INTS != 12
#error "fj_fill writes 12-int work-item records, not FJ_ITEM_INTS (flashjit.jit.abi.ITEM_INTS)"
#endif
#define ITEM_INTS FJ_ITEM_INTS

typedef struct {
    /* inputs */
    const int32_t *indptr;         /* [batch + 1] page-table CSR offsets */
    const int32_t *last_page_len;  /* [batch] tokens in each request's last page */
    const int32_t *qo_indptr;      /* [batch + 1] query-token offsets, or NULL: q_len tokens each */
    const int64_t *span_begin;     /* [batch] first position worth reading, or NULL: 0 */
    const int64_t *span_end;       /* [batch] end of the span, or NULL: the request's kv_len */
    const int64_t *parts;          /* the split candidates (parts per longest span), increasing */
    int64_t *kv_lens;              /* [batch] out: tokens per request */
    int64_t batch, page_size, q_len, num_parts;
    int64_t ctas_per_item, max_ctas, granularity, min_chunk;
    int64_t chunk_tokens;          /* > 0 forces the chunk; 0 plans it; -1 one item per request */
    int64_t fixed_split;           /* 1: each item its own tile-sharing group; 0: its request's items */
    int64_t max_items;             /* < 0: no limit */
    int64_t item_overhead, merge_cost;
    /* outputs */
    int64_t num_page_ids;          /* fj_page_table */
    int64_t num_tokens, max_q_len; /* fj_query_indptr */
    int64_t chunk, num_work;       /* fj_plan */
} fj_plan_t;

/* The offsets (in int32 words) of the staging buffer's fields (see buffers.PlanBuffers.FIELDS), and the
 * number of ITEM_INTS-int work-item records it holds. */
typedef struct {
    int64_t work_items, num_tokens, req_qo_indptr, req_work_indptr, token_request, work_capacity;
} fj_layout_t;

/* A batch's shared spans (shared_prefix.SharedSpans, from fj_shared_groups) and what fj_shared_plan
 * derives from them for fj_shared_fill: the work list of flashjit/serving/shared_plan.py. */
typedef struct {
    /* inputs */
    const int64_t *first, *count;          /* [groups] members first .. first + count - 1, outermost level first */
    const int64_t *begin_page, *end_page;  /* [groups] the shared span, in pages */
    const int64_t *shared_pages;           /* [batch] pages of each request its groups read */
    int64_t *slots;                        /* [batch] out: each request's slots of its groups' chunks */
    int64_t *offsets;                      /* [groups] out: each group's first slot in its members' ranges */
    int64_t groups, group_size;            /* GQA group */
    int64_t row_tiles, row_warps;          /* the shared kernel's CTAs per record and 16-row tiles per CTA */
    int64_t head_pack;                     /* KV heads one CTA of a short own item attends (1: one) */
    int64_t merge_waits;                   /* 1: the kernel merges a plan of one wave (tiling.waiting_merge) */
    /* outputs (fj_plan_t's chunk and num_work hold the rest) */
    int64_t num_shared, num_slots;         /* shared records; partial slots of all requests */
    int64_t num_packed;                    /* own items of head_pack heads a CTA (fj_shared_fill packs them) */
    int64_t merges_in_kernel;              /* 1: the plan's working CTAs fit one wave, and the kernel merges */
} fj_shared_t;

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
enum { TILE_COST_BASE = 5 };  /* shared_plan.TILE_COST_BASE */
enum { HEAD_PACK_MAX_TILES = 2 };  /* shared_plan.HEAD_PACK_MAX_TILES */
enum { MERGE_COUNTS = 1 << 8, MERGE_WAITS = 1 << 9 };  /* abi's: a record's part in a merge in the kernel */
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* The span of request b, as plan_work clamps it: [begin, end) with end >= begin (end >= 0 from 0). */
static void span(const fj_plan_t *p, int64_t b, int64_t *begin, int64_t *end) {
    int64_t e = p->span_end ? p->span_end[b] : p->kv_lens[b];
    int64_t s = p->span_begin ? p->span_begin[b] : 0;
    *begin = s;
    *end = max64(e, s);
}

/* Request b's own span where it shares: from the end of its groups' pages to kv_len. */
static int64_t own_begin(const fj_plan_t *p, const fj_shared_t *s, int64_t b) {
    return min64(s->shared_pages[b] * p->page_size, p->kv_lens[b]);
}

/* Query tokens of request b. */
static int64_t queries(const fj_plan_t *p, int64_t b) {
    return p->qo_indptr ? (int64_t)p->qo_indptr[b + 1] - p->qo_indptr[b] : p->q_len;
}

/* Members one shared record holds (shared_plan.members_per_record): their rows fill the row tiles.
 * Members without queries hold no rows: one a record, as numpy's division by zero gives. */
static int64_t members_per_record(const fj_plan_t *p, const fj_shared_t *s, int64_t g) {
    int64_t rows = s->group_size * queries(p, s->first[g]);
    return rows > 0 ? max64(1, s->row_tiles * s->row_warps * 16 / rows) : 1;
}

/* shared_plan.record_tiles of group g's full runs: 16-row tiles per CTA, 1 to row_warps. */
static int64_t record_tiles(const fj_plan_t *p, const fj_shared_t *s, int64_t g) {
    int64_t rows = min64(members_per_record(p, s, g), s->count[g]) * s->group_size * queries(p, s->first[g]);
    return min64(max64(ceil_div(ceil_div(rows, 16), s->row_tiles), 1), s->row_warps);
}

/* shared_plan.weighted_spans: group g's span length priced at its records' cost per key. */
static int64_t weighted_span(const fj_plan_t *p, const fj_shared_t *s, int64_t g) {
    int64_t len = (s->end_page[g] - s->begin_page[g]) * p->page_size;
    return ceil_div(len * (TILE_COST_BASE + record_tiles(p, s, g)), TILE_COST_BASE + 1);
}

/* shared_plan.shared_chunks: group g's span cut evenly into the pieces its weighted length makes
 * of p->chunk, rounded up to the granularity. */
static int64_t span_chunk(const fj_plan_t *p, const fj_shared_t *s, int64_t g) {
    int64_t len = (s->end_page[g] - s->begin_page[g]) * p->page_size;
    int64_t pieces = ceil_div(weighted_span(p, s, g), p->chunk);
    return ceil_div(ceil_div(len, pieces), p->granularity) * p->granularity;
}

/* Records of one chunk of group g: its members in runs of members_per_record. */
static int64_t member_runs(const fj_plan_t *p, const fj_shared_t *s, int64_t g) {
    return ceil_div(s->count[g], members_per_record(p, s, g));
}

/* kv_lens from the page table; 1 if page_size is not in 1..INT32_MAX, indptr does not start at 0
 * or decreases, a last_page_len is outside 1..page_size (0 allowed for a request without pages),
 * or a request holds more tokens than the kernel's int32 positions reach. */
static int fj_page_table(fj_plan_t *p) {
    if (p->indptr[0] != 0 || p->page_size < 1 || p->page_size > INT32_MAX) return 1;
    for (int64_t b = 0; b < p->batch; ++b) {
        int64_t pages = (int64_t)p->indptr[b + 1] - p->indptr[b], last = p->last_page_len[b];
        if (pages < 0 || last < 0 || last > p->page_size || (last < 1 && pages > 0)) return 1;
        p->kv_lens[b] = pages ? (pages - 1) * p->page_size + last : 0;
        if (p->kv_lens[b] > INT32_MAX) return 1;
    }
    p->num_page_ids = p->indptr[p->batch];
    return 0;
}

/* 1 if qo_indptr does not start at 0 or decreases, or batch x q_len query tokens exceed int32.
 * Sets num_tokens and max_q_len (at least 1). */
static int fj_query_indptr(fj_plan_t *p) {
    int64_t most = 1;
    if (p->qo_indptr) {
        if (p->qo_indptr[0] != 0) return 1;
        for (int64_t b = 0; b < p->batch; ++b) {
            int64_t n = (int64_t)p->qo_indptr[b + 1] - p->qo_indptr[b];
            if (n < 0) return 1;
            most = max64(most, n);
        }
        p->num_tokens = p->qo_indptr[p->batch];
    } else {
        if (p->batch) most = max64(most, p->q_len);
        if (p->q_len > INT32_MAX || p->batch * p->q_len > INT32_MAX) return 1;
        p->num_tokens = p->batch * p->q_len;
    }
    p->max_q_len = most;
    return 0;
}

/* Both of the above, in one call from Python: 0 when the page table and the query offsets pass. */
int fj_read(fj_plan_t *p) { return fj_page_table(p) || fj_query_indptr(p); }

/* A span of len positions cut into chunks of `chunk` (len, chunk < 2^31): adds its items (ceil(len /
 * chunk), one for an empty span) and its items at least half a chunk long (floor(len / chunk + 1/2)),
 * each times `times`, from one division of doubles (several times the speed of two 64-bit integer
 * divisions). The quotient is correctly rounded, within len / chunk * 2^-53 of the exact one; an
 * exact quotient that is not whole, or whole plus a half, lies at least 1 / (2 chunk) from one that
 * is, farther than that error, so the floors, the comparison and the half's addition stay exact. */
static void count_items(int64_t len, double whole, int64_t times, int64_t *items, int64_t *long_items) {
    const double q = (double)len / whole;
    const int64_t floor_q = (int64_t)q;  /* q >= 0: truncation is the floor */
    *items += times * (floor_q + ((double)floor_q != q) + (len == 0));
    *long_items += times * (int64_t)(q + 0.5);
}

/* Whether an own item of len positions takes s->head_pack KV heads a CTA (shared_plan.item_heads). */
static int packs_heads(const fj_plan_t *p, const fj_shared_t *s, int64_t len) {
    return s->head_pack > 1 && len <= HEAD_PACK_MAX_TILES * p->granularity;
}

/* Request b's own span as the chunk estimate prices it (shared_plan.plan_shared_work): a span short
 * enough to pack counts head_pack times its length for every head_pack-th such span in batch order
 * (*packs counts them) and -1, not at all, for the others. */
static int64_t priced_own_span(const fj_plan_t *p, const fj_shared_t *s, int64_t b, int64_t *packs) {
    const int64_t len = p->kv_lens[b] - own_begin(p, s, b);
    if (!packs_heads(p, s, len)) return len;
    return (*packs)++ % s->head_pack == 0 ? s->head_pack * len : -1;
}

/* plan.makespans for one chunk: the fluid and the quantized bound, the merge when split. s NULL:
 * over the requests' spans; else over their own spans and each group's span once per member run
 * (shared_plan.plan_shared_work's list of lengths, without a cap on the items). */
static double makespan(const fj_plan_t *p, const fj_shared_t *s, int64_t chunk) {
    int64_t items = 0, long_items = 0, total = 0, spans = p->batch, packs = 0;
    const double whole = (double)chunk;
    for (int64_t b = 0; b < p->batch; ++b) {
        int64_t begin, end, len;
        if (s) {
            if ((len = priced_own_span(p, s, b, &packs)) < 0) {
                --spans;  /* priced with another's */
                continue;
            }
        } else {
            span(p, b, &begin, &end);
            len = end - begin;
        }
        count_items(len, whole, 1, &items, &long_items);
        total += len;
    }
    for (int64_t g = 0; s && g < s->groups; ++g) {  /* a group's span is never empty */
        int64_t len = weighted_span(p, s, g), runs = member_runs(p, s, g);
        count_items(len, whole, runs, &items, &long_items);
        total += runs * len;
        spans += runs;
    }
    if (!s && p->max_items >= 0 && items > p->max_items) return INFINITY;
    double share = (double)p->ctas_per_item / (double)p->max_ctas;
    double fluid = (double)(total + items * p->item_overhead) * share;
    double quantized = ceil((double)long_items * (double)p->ctas_per_item / (double)p->max_ctas)
                       * (double)(chunk + p->item_overhead);
    return (fluid > quantized ? fluid : quantized) + (items > spans ? (double)p->merge_cost : 0.0);
}

/* plan.choose_chunk: the candidate chunk with the smallest makespan, the first of equals. */
static int64_t choose_chunk(const fj_plan_t *p, const fj_shared_t *s, int64_t longest) {
    int64_t g = p->granularity;
    if (longest <= p->min_chunk) return ceil_div(max64(longest, 1), g) * g;
    int64_t floor_chunk = max64(ceil_div(p->min_chunk, g) * g, g);
    int64_t max_parts = max64(1, p->max_ctas / p->ctas_per_item);
    int64_t best = 0, previous = 0;
    double best_cost = 0.0;
    for (int64_t i = 0; i < p->num_parts && p->parts[i] <= max_parts; ++i) {
        int64_t chunk = max64(ceil_div(ceil_div(longest, p->parts[i]), g) * g, floor_chunk);
        if (chunk != previous) {
            double cost = makespan(p, s, chunk);
            if (!best || cost < best_cost) best = chunk, best_cost = cost;
            previous = chunk;
        }
        if (chunk == floor_chunk) break;
    }
    return best;
}

/* split_plan.plan_work's sizes: chunk, num_work. Call fj_read (for kv_lens, unless span_end is given) first. */
int fj_plan(fj_plan_t *p) {
    int64_t longest = 0, items = 0;
    for (int64_t b = 0; b < p->batch; ++b) {
        int64_t begin, end;
        span(p, b, &begin, &end);
        longest = max64(longest, end - begin);
    }
    if (p->chunk_tokens > 0) p->chunk = p->chunk_tokens;
    else if (p->chunk_tokens < 0) p->chunk = max64(1, longest);
    else p->chunk = choose_chunk(p, NULL, longest);
    for (int64_t b = 0; b < p->batch; ++b) {
        int64_t begin, end;
        span(p, b, &begin, &end);
        items += max64(ceil_div(end - begin, p->chunk), 1);
    }
    p->num_work = items;
    return 0;
}

/* The work-item records and the merges' per-request arrays, into the staging buffer at layout's
 * offsets. A record is decode_common.cuh's WorkItem: (request, v_begin, v_end, kv_len, page_begin,
 * q_begin, q_len, items of the request, then its tile-sharing group: index, span, items in it);
 * the records past num_work get request -1 (padding). */
int fj_fill(const fj_plan_t *p, int32_t *staging, const fj_layout_t *at) {
    int64_t w = 0;
    int32_t *records = staging + at->work_items;
    staging[at->num_tokens] = (int32_t)p->num_tokens;
    staging[at->req_work_indptr] = 0;
    staging[at->req_qo_indptr] = 0;
    for (int64_t b = 0; b < p->batch; ++b) {
        int64_t begin, end;
        span(p, b, &begin, &end);
        int64_t items = max64(ceil_div(end - begin, p->chunk), 1);
        int64_t q_begin = p->qo_indptr ? p->qo_indptr[b] : b * p->q_len;
        int64_t q_end = p->qo_indptr ? p->qo_indptr[b + 1] : (b + 1) * p->q_len;
        for (int64_t i = 0; i < items; ++i, ++w) {
            int64_t first = begin + i * p->chunk;
            int32_t *record = records + ITEM_INTS * w;
            record[0] = (int32_t)b;
            record[1] = (int32_t)first;
            record[2] = (int32_t)min64(first + p->chunk, end);
            record[3] = (int32_t)p->kv_lens[b];
            record[4] = p->indptr[b];
            record[5] = (int32_t)q_begin;
            record[6] = (int32_t)(q_end - q_begin);
            record[7] = (int32_t)items;
            record[8] = p->fixed_split ? 0 : (int32_t)i;
            record[9] = p->fixed_split ? record[1] : (int32_t)begin;
            record[10] = p->fixed_split ? record[2] : (int32_t)end;
            record[11] = p->fixed_split ? 1 : (int32_t)items;
        }
        staging[at->req_work_indptr + b + 1] = (int32_t)w;
        staging[at->req_qo_indptr + b + 1] = (int32_t)q_end;
        for (int64_t t = q_begin; t < q_end; ++t) staging[at->token_request + t] = (int32_t)b;
    }
    for (; w < at->work_capacity; ++w) records[ITEM_INTS * w] = -1;
    return 0;
}

/* The smallest and largest of n page ids (n >= 1), for plan()'s check of the ids it copied back. */
void fj_id_range(const int32_t *ids, int64_t n, int64_t *low_high) {
    int32_t low = ids[0], high = ids[0];
    for (int64_t i = 1; i < n; ++i) {
        low = ids[i] < low ? ids[i] : low;
        high = ids[i] > high ? ids[i] : high;
    }
    low_high[0] = low;
    low_high[1] = high;
}

/* Pages requests b and b + 1 share from their first page on (prefix[b], b < batch - 1), at most
 * the full pages every query of either sees (causal: those before its first query position), and
 * 0 between requests of different query counts. The numpy reference is
 * flashjit/serving/shared_prefix.py (neighbour_prefixes); the comparison stops at the first
 * differing page, so a batch without sharing costs one comparison per neighbour. Returns how many
 * neighbours share a page. qo_indptr NULL: q_len tokens each. */
int64_t fj_neighbour_prefixes(const int32_t *indptr, const int32_t *ids, const int64_t *kv_lens,
                              const int32_t *qo_indptr, int64_t q_len, int64_t batch, int64_t page_size,
                              int64_t causal, int64_t *prefix) {
    int64_t sharing = 0, prev_visible = 0, prev_q = 0;
    for (int64_t b = 0; b < batch; ++b) {
        const int64_t q = qo_indptr ? qo_indptr[b + 1] - qo_indptr[b] : q_len;
        const int64_t pages = indptr[b + 1] - indptr[b];
        int64_t visible = (causal ? kv_lens[b] - q + 1 : kv_lens[b]);
        visible = visible > 0 ? min64(visible / page_size, pages) : 0;
        if (b > 0) {
            int64_t shared = 0;
            const int64_t limit = min64(prev_visible, visible);
            if (q == prev_q && limit > 0) {
                const int32_t *left = ids + indptr[b - 1], *right = ids + indptr[b];
                /* Blocks of 64 ids by memcmp (vectorized), then id by id within the first that differs. */
                while (shared + 64 <= limit && !memcmp(left + shared, right + shared, 64 * sizeof(int32_t)))
                    shared += 64;
                while (shared < limit && left[shared] == right[shared]) ++shared;
            }
            prefix[b - 1] = shared;
            sharing += shared > 0;
        }
        prev_visible = visible;
        prev_q = q;
    }
    return sharing;
}

/* The nested groups of the neighbours' shared prefixes (prefix[batch - 1], from fj_neighbour_prefixes;
 * overwritten: it ends holding each pair's pages shared by its groups), as
 * shared_prefix.spans_from_prefixes makes them: level by level, each maximal run of pairs still
 * sharing pages is a group of the run's requests over the fewest pages they share beyond the
 * enclosing groups'. Writes up to capacity groups (first, count, begin, end, level; outermost level
 * first) and shared[batch], each request's pages read by its groups; returns the number of groups,
 * or -1 when more than capacity were found. */
int64_t fj_shared_groups(int64_t *prefix, int64_t batch, int64_t max_levels, int64_t capacity, int64_t *first,
                         int64_t *count, int64_t *begin, int64_t *end, int64_t *level, int64_t *shared, int64_t *done) {
    const int64_t pairs = batch - 1;
    int64_t groups = 0;
    for (int64_t b = 0; b < pairs; ++b) done[b] = 0;
    for (int64_t depth = 0; depth < max_levels; ++depth) {
        int64_t found = 0;
        for (int64_t b = 0; b < pairs;) {
            if (prefix[b] - done[b] <= 0) { ++b; continue; }
            int64_t stop = b, least = prefix[b] - done[b];
            while (stop < pairs && prefix[stop] - done[stop] > 0) {
                least = min64(least, prefix[stop] - done[stop]);
                ++stop;
            }
            if (groups == capacity) return -1;
            first[groups] = b; count[groups] = stop - b + 1;
            begin[groups] = done[b]; end[groups] = done[b] + least; level[groups] = depth;
            ++groups;
            ++found;
            for (int64_t i = b; i < stop; ++i) done[i] += least;
            b = stop;
        }
        if (!found) break;
    }
    for (int64_t b = 0; b < batch; ++b)
        shared[b] = max64(b > 0 ? done[b - 1] : 0, b < pairs ? done[b] : 0);
    return groups;
}

/* shared_plan.plan_shared_work's sizes over the groups of s: p->chunk (the own spans', priced by
 * makespan with each group's span once per member run at its records' cost per key; a group's
 * chunk is span_chunk), p->num_work (the shared
 * records, then every request's own items), s->num_shared and s->num_slots; and s->slots and
 * s->offsets for fj_shared_fill. Call fj_read first; p's ctas_per_item, max_ctas and granularity
 * are the shared kernel's; p->chunk_tokens > 0 forces the chunk. */
int fj_shared_plan(fj_plan_t *p, fj_shared_t *s) {
    int64_t longest = 0, records = 0, own = 0, slots = 0, packs = 0;
    for (int64_t b = 0; b < p->batch; ++b) {
        longest = max64(longest, priced_own_span(p, s, b, &packs));
        s->slots[b] = 0;
    }
    for (int64_t g = 0; g < s->groups; ++g)
        longest = max64(longest, weighted_span(p, s, g));
    p->chunk = p->chunk_tokens > 0 ? p->chunk_tokens : choose_chunk(p, s, longest);
    /* A group's slots follow those of its enclosing groups, which come first in s. */
    for (int64_t g = 0; g < s->groups; ++g) {
        int64_t chunks = ceil_div((s->end_page[g] - s->begin_page[g]) * p->page_size, span_chunk(p, s, g));
        s->offsets[g] = s->slots[s->first[g]];
        for (int64_t m = s->first[g]; m < s->first[g] + s->count[g]; ++m) s->slots[m] += chunks;
        records += chunks * member_runs(p, s, g);
    }
    int64_t packed = 0;
    for (int64_t b = 0; b < p->batch; ++b) {
        const int64_t len = p->kv_lens[b] - own_begin(p, s, b), items = max64(ceil_div(len, p->chunk), 1);
        own += items;
        slots += s->slots[b] + items;
        packed += (items - 1) * packs_heads(p, s, p->chunk) + packs_heads(p, s, len - (items - 1) * p->chunk);
    }
    s->num_shared = records;
    s->num_slots = slots;
    s->num_packed = packed;
    p->num_work = records + own;
    /* The CTAs that attend: a packed item's CTA per head_pack heads, the others' each. */
    const int64_t ctas = (p->num_work - packed) * p->ctas_per_item + packed * (p->ctas_per_item / s->head_pack);
    s->merges_in_kernel = s->merge_waits && ctas <= p->max_ctas;
    return 0;
}

static void put_record(int32_t *record, int64_t request, int64_t v_begin, int64_t v_end, int64_t kv_len,
                       int64_t page_begin, int64_t q_begin, int64_t q_len, int64_t splits, int64_t index,
                       int32_t last) {
    record[0] = (int32_t)request;
    record[1] = (int32_t)v_begin;
    record[2] = (int32_t)v_end;
    record[3] = (int32_t)kv_len;
    record[4] = (int32_t)page_begin;
    record[5] = (int32_t)q_begin;
    record[6] = (int32_t)q_len;
    record[7] = (int32_t)splits;
    record[8] = (int32_t)index;
    record[9] = (int32_t)v_begin;  /* a tile-sharing group of one: the item's own span */
    record[10] = (int32_t)v_end;
    record[11] = last;  /* a shared-prefix record's heads a CTA and part in the merge (abi.RECORD_HEADS) */
}

/* The work list of fj_shared_plan into the staging buffer, as shared_plan.SharedTables.write puts
 * it: per group, per chunk, per member run a shared record (request = first member, kv_len = the
 * span's end, q_begin = the chunk's slot offset, splits = -members); then each request's own items,
 * each naming its slot, those of s->head_pack heads a CTA (the short ones) after all the others;
 * then the merges' arrays, and padding records (request -1). */
int fj_shared_fill(const fj_plan_t *p, const fj_shared_t *s, int32_t *staging, const fj_layout_t *at) {
    int64_t w = 0, slot = 0;
    int32_t *records = staging + at->work_items;
    const int64_t chunk = p->chunk;
    /* A merge in the kernel: each request's last own item waits, every other record counts in. */
    const int32_t counts = s->merges_in_kernel ? MERGE_COUNTS : 0, waits = s->merges_in_kernel ? MERGE_WAITS : 0;
    for (int64_t g = 0; g < s->groups; ++g) {
        const int64_t first = s->first[g], stop = first + s->count[g];
        const int64_t span_begin = s->begin_page[g] * p->page_size, end = s->end_page[g] * p->page_size;
        const int64_t per_record = members_per_record(p, s, g), q = queries(p, first), step = span_chunk(p, s, g);
        for (int64_t begin = span_begin, k = s->offsets[g]; begin < end; begin += step, ++k) {
            const int64_t v_end = min64(begin + step, end);
            for (int64_t m = first; m < stop; m += per_record, ++w)
                put_record(records + ITEM_INTS * w, m, begin, v_end, end, p->indptr[m], k, q,
                           -min64(per_record, stop - m), 0, 1 | counts);
        }
    }
    staging[at->num_tokens] = (int32_t)p->num_tokens;
    staging[at->req_work_indptr] = 0;
    staging[at->req_qo_indptr] = 0;
    int64_t packed_w = p->num_work - s->num_packed;  /* the packed own items, last in the grid */
    for (int64_t b = 0; b < p->batch; ++b) {
        const int64_t begin = own_begin(p, s, b), kv_len = p->kv_lens[b];
        const int64_t items = max64(ceil_div(kv_len - begin, chunk), 1), splits = s->slots[b] + items;
        const int64_t q_begin = p->qo_indptr ? p->qo_indptr[b] : b * p->q_len;
        const int64_t q_end = p->qo_indptr ? p->qo_indptr[b + 1] : (b + 1) * p->q_len;
        for (int64_t i = 0; i < items; ++i) {
            const int64_t first = begin + i * chunk;
            const int64_t end = min64(first + chunk, kv_len);
            const int packs = packs_heads(p, s, end - first);
            int32_t *record = records + ITEM_INTS * (packs ? packed_w++ : w++);
            put_record(record, b, first, end, kv_len, p->indptr[b], q_begin, q_end - q_begin, splits,
                       slot + s->slots[b] + i, (int32_t)(packs ? s->head_pack : 1) | (i + 1 == items ? waits : counts));
        }
        slot += splits;
        staging[at->req_work_indptr + b + 1] = (int32_t)slot;
        staging[at->req_qo_indptr + b + 1] = (int32_t)q_end;
        for (int64_t t = q_begin; t < q_end; ++t) staging[at->token_request + t] = (int32_t)b;
    }
    for (w = packed_w; w < at->work_capacity; ++w) records[ITEM_INTS * w] = -1;
    return 0;
}

/* fj_neighbour_prefixes and fj_shared_groups over the page table fj_read read (p) and its page ids,
 * in one call from Python. scratch holds 16 * batch values: prefix [B], first, count, begin, end and
 * level [2B each: a laminar family of runs over B - 1 pairs has fewer than 2B members], shared [B],
 * done [B], then fj_shared_plan's slots [B] and offsets [2B]; s's arrays are pointed into it.
 * Returns the number of groups, 0 when nothing is shared. */
int64_t fj_shared_spans(const fj_plan_t *p, const int32_t *ids, int64_t causal, int64_t max_levels, int64_t *scratch,
                        fj_shared_t *s) {
    const int64_t batch = p->batch;
    int64_t *first = scratch + batch, *count = scratch + 3 * batch, *begin = scratch + 5 * batch;
    int64_t *end = scratch + 7 * batch, *level = scratch + 9 * batch, *shared = scratch + 11 * batch;
    s->first = first, s->count = count, s->begin_page = begin, s->end_page = end, s->shared_pages = shared;
    s->slots = scratch + 13 * batch, s->offsets = scratch + 14 * batch;
    if (!fj_neighbour_prefixes(p->indptr, ids, p->kv_lens, p->qo_indptr, p->q_len, batch, p->page_size, causal,
                               scratch)) {
        for (int64_t b = 0; b < batch; ++b) shared[b] = 0;  /* no groups: fj_shared_plan plans every request alone */
        return s->groups = 0;
    }
    s->groups = fj_shared_groups(scratch, batch, max_levels, 2 * batch, first, count, begin, end, level, shared,
                                 scratch + 12 * batch);
    return s->groups;
}
