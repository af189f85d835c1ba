"""Paged waste: allocated minus used KV slots over a mix of chats, through the real BlockManager.

The mix (seeded, so every run builds the same chats) is an assumption about
how a workstation's chats look, not a measurement of users:

- every chat starts with the same system prompt (:data:`SYSTEM_TOKENS` tokens);
- :data:`DOC_SHARE` of the chats then hold one of a few shared documents
  (:data:`DOC_TOKENS`), the rest none;
- then 1–12 turns (skewed to few), each a user message of 15–200 tokens and
  an answer of 40–700 tokens; a chat stops before it passes the model's
  context.

Each chat grows turn by turn as the engine grows it (``attach_prefix`` on its
first turn, then ``reserve`` + ``commit`` per turn), and every chat stays
live, so the pool holds all of them at the end. Then, per held block, the
filled slots are the most any of its chats uses; waste is allocated − filled
(the unused tail of each chat's last block). Tokens that several chats share
through prefix caching (system prompt, documents) are stored once; that
saving is reported separately. The contiguous baseline is one buffer of the
model's full context per chat (a non-paged cache sized for the worst case).
"""

from __future__ import annotations

import random

SYSTEM_TOKENS = 40
DOC_SHARE = 0.3
DOC_TOKENS = (1200, 2500, 5000)
MAX_TURNS = 12
USER_TOKENS = (15, 200)
ANSWER_TOKENS = (40, 700)
DEFAULT_MIX_CHATS = 200
VOCAB = 49152
MIX_DESCRIPTION = (f"seeded mix: {SYSTEM_TOKENS}-token shared system prompt, {DOC_SHARE:.0%} of chats on one of "
                   f"{len(DOC_TOKENS)} shared documents of {'/'.join(map(str, DOC_TOKENS))} tokens, 1-{MAX_TURNS} "
                   f"turns of {USER_TOKENS[0]}-{USER_TOKENS[1]} + {ANSWER_TOKENS[0]}-{ANSWER_TOKENS[1]} tokens")


def chat_mix(num_chats: int, seed: int, max_context: int) -> list[tuple[int | None, list[int]]]:
    """The mix's chats as ``(document index or None, token counts after each turn)``.

    Token counts include the system prompt and the document; they increase
    strictly and never pass ``max_context``.
    """
    rng = random.Random(seed)
    out = []
    for _ in range(num_chats):
        doc = rng.randrange(len(DOC_TOKENS)) if rng.random() < DOC_SHARE else None
        length = SYSTEM_TOKENS + (DOC_TOKENS[doc] if doc is not None else 0)
        turns = 1 + min(MAX_TURNS - 1, int(rng.expovariate(1 / 3)))
        ends = []
        for _ in range(turns):
            step = rng.randint(*USER_TOKENS) + rng.randint(*ANSWER_TOKENS)
            if length + step > max_context:
                break
            length += step
            ends.append(length)
        out.append((doc, ends or [min(length + USER_TOKENS[0], max_context)]))
    return out


def _random_ids(key: str, n: int) -> list[int]:
    rng = random.Random(key)
    return [rng.randrange(VOCAB) for _ in range(n)]


def _build_chats(num_chats: int, seed: int, max_context: int) -> list[tuple[list[int], list[int]]]:
    """``(token ids, turn ends)`` per chat: shared system ids, shared document ids, then the chat's own ids."""
    system = _random_ids(f"system:{seed}", SYSTEM_TOKENS)
    docs = [_random_ids(f"doc{i}:{seed}", n) for i, n in enumerate(DOC_TOKENS)]
    chats = []
    for i, (doc, ends) in enumerate(chat_mix(num_chats, seed, max_context)):
        head = system + (docs[doc] if doc is not None else [])
        chats.append((head + _random_ids(f"chat{i}:{seed}", ends[-1] - len(head)), ends))
    return chats


def measure_paged_waste(num_chats: int, seed: int, max_context: int, block_size: int) -> dict:
    """Run the mix through a real :class:`kvchat.engine.block_manager.BlockManager`; slots are tokens.

    Returns:
        ``{mix, chats, seed, block_size, max_context, tokens_in_use,
        allocated_slots, filled_slots, internal_waste_slots,
        internal_waste_pct, shared_saved_slots, contiguous_max_context_slots,
        contiguous_waste_pct, lengths: {min, median, max}}``.
    """
    import statistics

    from kvchat.engine.block_manager import BlockManager, SeqBlocks

    chats = _build_chats(num_chats, seed, max_context)
    need = sum(-(-len(ids) // block_size) for ids, _ in chats)
    bm = BlockManager(need + 1, block_size, salt=b"bench-paged-waste")
    seqs = []
    for ids, ends in chats:
        seq = SeqBlocks()
        for i, end in enumerate(ends):
            if i == 0:
                bm.attach_prefix(seq, ids[:end])
            bm.reserve(seq, end)
            bm.commit(seq, ids[:end], end)
        seqs.append((seq, len(ids)))
    filled: dict[int, int] = {}
    for seq, n in seqs:
        for i, block_id in enumerate(seq.block_table):
            filled[block_id] = max(filled.get(block_id, 0), min(block_size, n - i * block_size))
    held = sum(1 for b in bm.blocks if b.ref_count > 0)
    allocated, used = held * block_size, sum(filled.values())
    in_use = sum(len(ids) for ids, _ in chats)
    contiguous = num_chats * max_context
    lengths = [len(ids) for ids, _ in chats]
    return {
        "mix": MIX_DESCRIPTION, "chats": num_chats, "seed": seed, "block_size": block_size, "max_context": max_context,
        "tokens_in_use": in_use, "allocated_slots": allocated, "filled_slots": used,
        "internal_waste_slots": allocated - used, "internal_waste_pct": 100 * (allocated - used) / allocated,
        "shared_saved_slots": in_use - used, "contiguous_max_context_slots": contiguous,
        "contiguous_waste_pct": 100 * (contiguous - in_use) / contiguous,
        "lengths": {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths)},
    }
