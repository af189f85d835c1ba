"""Block manager for the paged KV pool: pure Python, no torch.

Owns which pool block holds which tokens (vLLM's block tables, Kwon et al.
2023; structure after nano-vllm's ``block_manager.py``):

- ref counts and a free list; freed blocks keep their content hash and sit
  in the free list in LRU order, so a later prefix hit can revive them until
  they are handed out again;
- prefix caching by chained block hashes: block ``i`` of a sequence is keyed
  by ``blake2b(parent_hash || salt || token ids of block i)`` over canonical
  little-endian bytes, so keys are identical across processes (never
  Python's ``hash()``); the salt is the cache fingerprint, so different
  models or KV dtypes never share blocks;
- copy-on-write: a block that is shared (ref count > 1) or registered in the
  prefix cache is never written; the writer gets a private copy first. The
  copies are returned as ``(src, dst)`` pairs for the runner to perform.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence


class PoolFullError(RuntimeError):
    """Not enough free KV blocks for the request."""


def block_hash(parent: bytes | None, salt: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained 16-byte key of one full block (stable across processes)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(salt)
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return h.digest()


@dataclass(slots=True)
class Block:
    """One pool block's bookkeeping."""

    block_id: int
    ref_count: int = 0
    hash: bytes | None = None


@dataclass(slots=True)
class SeqBlocks:
    """A sequence's view of the pool.

    Attributes:
        block_table: pool block ids, in order; covers ``num_slots`` tokens.
        num_computed: leading tokens whose K/V are in the pool.
        num_slots: tokens that have a slot reserved (≥ ``num_computed``).
        hashes: chained hashes of the leading full, computed blocks.
    """

    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_slots: int = 0
    hashes: list[bytes] = field(default_factory=list)


class BlockManager:
    """Allocates pool blocks to sequences; see module docstring."""

    def __init__(self, num_blocks: int, block_size: int, salt: bytes = b""):
        self.block_size = block_size
        self.salt = salt
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks not referenced by any sequence (cached ones included)."""
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks covering ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def _take_free(self) -> int:
        if not self.free:
            raise PoolFullError("KV pool is full: no free block left")
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]
        block.hash = None
        block.ref_count = 1
        return block_id

    def _incref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _decref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Block ids of the longest cached chain of full blocks that prefixes ``token_ids``."""
        found, parent = [], None
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            h = block_hash(parent, self.salt, token_ids[start : start + self.block_size])
            block_id = self.cached.get(h)
            if block_id is None:
                break
            found.append(block_id)
            parent = h
        return found

    def attach_prefix(self, seq: SeqBlocks, token_ids: Sequence[int]) -> int:
        """Map prefix hits into an empty sequence; returns the number of tokens hit.

        A hit never covers the last token of ``token_ids``: it must be
        recomputed so there are logits to sample from; the block it lies in is
        copied on write later, never written in place.
        """
        assert not seq.block_table, "attach_prefix needs an empty sequence"
        hits = self.match_prefix(token_ids)
        for block_id in hits:
            self._incref(block_id)
            seq.hashes.append(self.blocks[block_id].hash)
        seq.block_table.extend(hits)
        seq.num_slots = len(hits) * self.block_size
        seq.num_computed = min(seq.num_slots, len(token_ids) - 1) if token_ids else 0
        return seq.num_computed

    def reserve(self, seq: SeqBlocks, num_tokens: int) -> list[tuple[int, int]]:
        """Make slots ``seq.num_computed .. num_tokens-1`` writable.

        Blocks in that range that are shared or registered in the prefix
        cache are replaced by private copies; new blocks are appended.

        Returns:
            ``(src, dst)`` block copies the runner must perform before writing.
        Raises:
            PoolFullError: not enough free blocks (nothing is changed then).
        """
        first = seq.num_computed // self.block_size
        last = self.blocks_needed(num_tokens)
        shared = [i for i in range(first, min(last, len(seq.block_table))) if self._must_copy(seq.block_table[i])]
        new = max(0, last - len(seq.block_table))
        if len(shared) + new > len(self.free):
            raise PoolFullError(
                f"KV pool is full: this needs {len(shared) + new} more blocks of {self.block_size} tokens, "
                f"{len(self.free)} are free; raise KVCHAT_KV_BUDGET_MB or close other chats"
            )
        copies = []
        for i in shared:
            src = seq.block_table[i]
            dst = self._take_free()
            copies.append((src, dst))
            seq.block_table[i] = dst
            self._decref(src)
        for _ in range(new):
            seq.block_table.append(self._take_free())
        del seq.hashes[first:]
        seq.num_slots = max(seq.num_slots, num_tokens)
        return copies

    def _must_copy(self, block_id: int) -> bool:
        block = self.blocks[block_id]
        return block.ref_count > 1 or block.hash is not None

    def slots(self, seq: SeqBlocks, start: int, end: int) -> list[int]:
        """Pool slots of tokens ``[start, end)``: block * block_size + offset (the one place of that arithmetic)."""
        if end <= start:
            return []
        bs = self.block_size
        first = start // bs
        flat = [s for b in self.block_span(seq, start, end) for s in range(b * bs, b * bs + bs)]
        offset = start - first * bs
        return flat[offset : offset + end - start]

    def block_span(self, seq: SeqBlocks, start: int, end: int) -> list[int]:
        """Ids of the blocks holding tokens ``[start, end)`` (``end > start``)."""
        return seq.block_table[start // self.block_size : (end - 1) // self.block_size + 1]

    def commit(self, seq: SeqBlocks, token_ids: Sequence[int], num_computed: int, register: bool = True) -> None:
        """Record that the first ``num_computed`` tokens now have K/V in the pool.

        Newly full blocks get their chained hash and, with ``register``, enter
        the prefix cache (a block whose hash is already cached by another
        block stays private). Unregistered blocks stay private and writable,
        so their tokens can be recomputed in place.
        """
        seq.num_computed = num_computed
        full = num_computed // self.block_size
        for i in range(len(seq.hashes), full):
            parent = seq.hashes[-1] if seq.hashes else None
            h = block_hash(parent, self.salt, token_ids[i * self.block_size : (i + 1) * self.block_size])
            seq.hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if register and h not in self.cached and block.hash is None:
                block.hash = h
                self.cached[h] = block.block_id

    def fork(self, seq: SeqBlocks, num_tokens: int) -> SeqBlocks:
        """A new sequence sharing ``seq``'s first ``num_tokens`` computed tokens.

        Used by regenerate and edit: the shared blocks are copied on write
        when the child appends into them.
        """
        num_tokens = min(num_tokens, seq.num_computed)
        keep = self.blocks_needed(num_tokens)
        child = SeqBlocks(list(seq.block_table[:keep]), num_tokens, num_tokens, list(seq.hashes[: num_tokens // self.block_size]))
        for block_id in child.block_table:
            self._incref(block_id)
        return child

    def free_seq(self, seq: SeqBlocks) -> None:
        """Release all of ``seq``'s blocks (cached ones stay revivable, LRU)."""
        for block_id in reversed(seq.block_table):
            self._decref(block_id)
        seq.block_table.clear()
        seq.hashes.clear()
        seq.num_computed = seq.num_slots = 0
