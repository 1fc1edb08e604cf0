"""StateSlots: the partial states of all ranks in one byte buffer, laid out for one collective.

Slot r holds rank r's state: o [tokens, heads, head_dim] (the query dtype), then lse [tokens, heads]
(float32), each padded to 16 bytes, so that one all-gather (or all-to-all) moves both, the shard's
decode writes straight into its slot, and merge_states reads every slot in place through strides.
"""

from __future__ import annotations

import dataclasses

ALIGN = 16  # merge_states reads 16-byte vectors: every slot and every o row starts on 16 bytes


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@dataclasses.dataclass
class StateSlots:
    """slots of (o, lse) of shape (tokens, heads, head_dim) and dtype, over `buffer` ([slots, slot_bytes] uint8)."""

    buffer: object
    tokens: int
    heads: int
    head_dim: int
    dtype: object

    @classmethod
    def allocate(cls, slots: int, tokens: int, heads: int, head_dim: int, dtype, device) -> "StateSlots":
        import torch

        element = torch.empty((), dtype=dtype).element_size()
        slot_bytes = _padded(tokens * heads * head_dim * element) + _padded(tokens * heads * 4)
        return cls(torch.empty(slots, max(slot_bytes, ALIGN), dtype=torch.uint8, device=device), tokens, heads,
                   head_dim, dtype)

    def fits(self, slots: int, tokens: int, heads: int, head_dim: int, dtype, device) -> bool:
        return (self.buffer.shape[0] == slots and (self.tokens, self.heads, self.head_dim) == (tokens, heads, head_dim)
                and self.dtype == dtype and self.buffer.device == device)

    @property
    def _o_bytes(self) -> int:
        return self.tokens * self.heads * self.head_dim * self.buffer.new_empty((), dtype=self.dtype).element_size()

    def o(self):
        """[slots, tokens, heads, head_dim] view of every slot's o."""
        import torch

        n = self._o_bytes
        return self.buffer[:, :n].view(self.dtype).view(self.buffer.shape[0], self.tokens, self.heads, self.head_dim) \
            if n else torch.empty(self.buffer.shape[0], self.tokens, self.heads, self.head_dim, dtype=self.dtype,
                                  device=self.buffer.device)

    def lse(self):
        """[slots, tokens, heads] float32 view of every slot's lse."""
        import torch

        start, n = _padded(self._o_bytes), self.tokens * self.heads * 4
        if not n:
            return torch.empty(self.buffer.shape[0], self.tokens, self.heads, device=self.buffer.device)
        return self.buffer[:, start:start + n].view(torch.float32).view(self.buffer.shape[0], self.tokens, self.heads)
