"""A prompt prefilled once for several sequences: an API request's ``n`` choices.

The first sequence to run the prompt publishes its blocks and the last token's logits; each other sequence
with the same token ids then forks those blocks (:meth:`kvchat.engine.block_manager.BlockManager.fork`:
shared, copied on write when it appends into the last one) and samples its first token from the same
logits with its own sampler, so it computes nothing of the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvchat.engine.block_manager import BlockManager, SeqBlocks


@dataclass(eq=False)
class SharedPrompt:
    """The published prompt (empty until :meth:`publish`).

    Attributes:
        token_ids: the prompt's ids.
        blocks: the publishing sequence's block table (it keeps growing as that sequence decodes; its
            blocks are released when it ends, after which nothing is taken from it).
        logits: float32 ``[vocab_size]`` of the prompt's last token (a copy).
    """

    token_ids: list[int] | None = None
    blocks: SeqBlocks | None = None
    logits: torch.Tensor | None = None

    def publish(self, token_ids: list[int], blocks: SeqBlocks, logits: torch.Tensor) -> None:
        """Offer the prompt just prefilled by a sequence (the first publisher wins)."""
        if self.blocks is None:
            self.token_ids, self.blocks, self.logits = list(token_ids), blocks, logits.clone()

    def take(self, blocks: BlockManager, token_ids: list[int]) -> tuple[SeqBlocks, torch.Tensor] | None:
        """A fork of the published prompt's blocks and its logits, for a sequence whose ids are
        ``token_ids``; None when nothing is published, the ids differ, or the publisher's blocks are gone."""
        if self.blocks is None or self.token_ids != token_ids or self.blocks.num_computed < len(token_ids):
            return None
        return blocks.fork(self.blocks, len(token_ids)), self.logits
