"""Where one layer's keys and values live in transformers' PagedAttentionCache, for both layouts the
adapter serves.

transformers 5.17: flat per-position caches (`key_cache[j]`, [slots, kv_heads, head_dim]) shared by
the j-th layer of every layer group, groups from `layer_index_to_group_indices`, windows from
`sliding_windows`. transformers 5.18 and later: one byte tensor carved by a cache allocator per
attention type (`layer_to_allocator`); a block holds a page of keys and a page of values for every
layer of its allocator, and each layer reads its slots through its own shifted view of the tensor.
Either way a read or write index entry names a slot of the layer's view, so page p of a layer is
slots [p * block_size, (p + 1) * block_size) of that view.
"""

from __future__ import annotations

import typing

import torch

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


class LayerCache(typing.NamedTuple):
    group: int                # this layer's entry of read_index and write_index
    first_in_group: bool      # the group's first layer (it runs first in every forward)
    ring: int | None          # a sliding window's ring of that many slots; None for full attention
    block_size: int           # tokens per cache page
    keys: torch.Tensor        # [slots, kv_heads, head_dim], indexed by read and write index entries
    values: torch.Tensor      # the same for values, as long as keys
    sentinel: int             # a ring's read-index entry standing for a new token
    layer_type: str           # the key of cu_seq_lens_k for this layer

    def pages(self, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """keys and values as [pages, page_size, kv_heads, head_dim] (page_size divides the slots)."""
        return (self.keys.view(-1, page_size, *self.keys.shape[1:]),
                self.values.view(-1, page_size, *self.values.shape[1:]))


def new_layout(cache) -> bool:
    return hasattr(cache, "layer_to_allocator")


def layer_cache(cache, layer: int) -> LayerCache:
    """The layer's cache in either layout."""
    if new_layout(cache):
        return _allocator_layer(cache, layer)
    group, in_group = cache.layer_index_to_group_indices[layer]
    window = cache.sliding_windows[layer]
    ring = window if window > 1 else None
    return LayerCache(group, in_group == 0, ring, cache.block_size, cache.key_cache[in_group],
                      cache.value_cache[in_group], cache.sentinel_index, SLIDING_ATTENTION if ring else FULL_ATTENTION)


def _allocator_layer(cache, layer: int) -> LayerCache:
    allocator = cache.layer_to_allocator[layer]
    window = getattr(allocator, "sliding_window", None) if allocator.layer_type == SLIDING_ATTENTION else None
    ring = window if window is not None and window > 1 else None
    # The allocator's per-layer views start at the layer's page within a block; the value view starts
    # one page later, so it ends one page sooner: both are cut to the whole pages they share.
    keys, values = allocator._kv_token_views[layer]
    block = allocator.tokens_per_page
    slots = min(keys.shape[0], values.shape[0]) // block * block
    return LayerCache(allocator.index, allocator.layer_indices[0] == layer, ring, block, keys[:slots], values[:slots],
                      allocator.sentinel_index, allocator.layer_type)
