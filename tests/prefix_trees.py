"""Batches whose requests share prompt pages, as page lists: their page tables, and random trees of
prompts, samples and samples' children (the shared-prefix tests of serving/ and worklist/)."""

from __future__ import annotations

import random

import numpy as np

PAGE = 4


def page_table(lists, last_page_len=None):
    """indptr, page ids, kv_lens and last_page_len of page lists (every last page full unless
    last_page_len says otherwise)."""
    indptr = np.cumsum([0] + [len(pages) for pages in lists])
    ids = np.concatenate([np.asarray(p, dtype=np.int32) for p in lists]) if indptr[-1] else np.zeros(0, np.int32)
    last = [PAGE if p else 0 for p in lists] if last_page_len is None else last_page_len
    kv = np.array([max(0, (len(p) - 1) * PAGE + l) if p else 0 for p, l in zip(lists, last)])
    return indptr, ids, kv, np.array(last)


def random_tree(rng: random.Random, batch: int):
    """Page lists with random sharing: prompts, samples of each, children of some samples; partial
    last pages, a request that is a prefix of another, requests alone."""
    next_id = iter(range(10 ** 6))
    fresh = lambda n: [next(next_id) for _ in range(n)]  # noqa: E731
    lists = []
    while len(lists) < batch:
        prompt = fresh(rng.randint(0, 6))
        for _ in range(rng.choice([1, 1, 2, 3, 5])):
            beam = prompt + fresh(rng.randint(0, 3))
            for _ in range(rng.choice([1, 2, 3])):
                lists.append(beam + fresh(rng.randint(0, 3)))
    lists = lists[:batch]
    if rng.random() < 0.3 and len(lists) > 1 and lists[0]:
        lists[1] = lists[0][:rng.randint(1, len(lists[0]))]  # a prefix of its neighbour
    last = [rng.randint(1, PAGE) if p else 0 for p in lists]
    return lists, last
