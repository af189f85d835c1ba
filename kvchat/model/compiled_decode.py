"""A decode step or a short chunk of a :class:`kvchat.model.transformer.Transformer` on the CPU through the
compiled decoder layers (:class:`kvchat.kernels.cpu_decode.DecodeLayers`): the embedding, RoPE angles, final
norm and LM head in torch, every decoder layer in one C call.

The engine runs every chunk of up to :data:`kvchat.model.int8_scheme.COMPILED_LAYER_MAX_TOKENS` tokens after
position 0 here (:meth:`kvchat.engine.runner.Engine.runs_compiled`), cold or resumed alike, and names that in
its cache fingerprint. It runs where the model computes in float32 with int8 group weights in every layer
(:class:`kvchat.model.quant.Int8GroupLinear`, the CPU's default ``--weights auto``) or int4 ones
(:class:`kvchat.model.quant.Int4GroupLinear`, ``--weights int4``), has no per-head q/k norm
(Qwen3), and the pool is one the compiled attention reads; :func:`compiled_decode` returns None otherwise
and the engine keeps the torch layers. Measured in docs/performance.md ("a decode layer in one compiled call").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvchat.kernels import cpu_decode
from kvchat.model.quant import Int4GroupLinear, Int8GroupLinear
from kvchat.model.transformer import Transformer

if TYPE_CHECKING:  # the engine owns the pool and hands it in
    from kvchat.engine.kv_pool import KVPool


def _weight(layer) -> cpu_decode.GroupWeight | None:
    bias = None if getattr(layer, "bias", None) is None else layer.bias.detach()
    if type(layer) is Int8GroupLinear:
        return cpu_decode.GroupWeight(layer.q, layer.scale, layer.offset, bias)
    if type(layer) is Int4GroupLinear:
        return cpu_decode.GroupWeight(layer.packed, layer.scale, layer.minimum, bias, bits=4)
    return None


class CompiledDecode:
    """``model``'s decode step with its layers compiled (see the module doc): call it; :meth:`chunk` runs a short
    chunk of one sequence on the same layers.

    Args:
        model: the loaded model (its embedding, RoPE, final norm and LM head run in torch).
        layers: its decoder layers over the engine's pool (:func:`compiled_decode` builds them).
    """

    def __init__(self, model: Transformer, layers: cpu_decode.DecodeLayers):
        self.model, self.layers = model, layers

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor,
                 sink: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """float32 logits ``[R, vocab_size]`` of one decode step; the new tokens' K/V written to the pool.

        Args as :class:`kvchat.engine.decode_buffers.DecodeView` holds them: int64 ``input_ids``,
        ``positions`` and ``slot_mapping`` ``[R]``, int32 ``block_table`` ``[R, width]`` and ``seq_lens``
        ``[R]``, ``sink`` float32 ``[R, num_layers, num_kv_heads, head_dim]`` x2 or None.
        Raises:
            ValueError: what :meth:`kvchat.kernels.cpu_decode.DecodeLayers.run` refuses.
        """
        return self.model.logits(self._hidden(input_ids, positions, slot_mapping, block_table, seq_lens, sink, 1))

    def chunk(self, input_ids: torch.Tensor, start: int, slot_mapping: torch.Tensor, block_table: torch.Tensor,
              sink: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """The final-norm hidden states float32 ``[T, hidden]`` of ``T`` new tokens of one sequence at positions
        ``start .. start + T - 1`` (tokens before ``start`` in the pool); their K/V written to the pool.

        Args:
            input_ids, slot_mapping: int64 ``[T]``. block_table: int32 ``[1, width]`` covering ``start + T``
                tokens. sink: float32 ``[1, num_layers, num_kv_heads, head_dim]`` x2 or None.
        Raises:
            ValueError: what :meth:`kvchat.kernels.cpu_decode.DecodeLayers.run` refuses.
        """
        t = input_ids.shape[0]
        positions = torch.arange(start, start + t)
        lens = torch.tensor([start + t], dtype=torch.int32)
        return self._hidden(input_ids, positions, slot_mapping, block_table, lens, sink, t)

    def _hidden(self, input_ids, positions, slot_mapping, block_table, seq_lens, sink, tokens) -> torch.Tensor:
        model = self.model
        x = F.embedding(input_ids, model.embed_tokens).contiguous()
        cos, sin = model.rope(positions, torch.float32)
        self.layers.run(x, cos, sin, slot_mapping, block_table, seq_lens, sink, tokens)
        return model.norm(x)


def compiled_decode(model: Transformer, pool: KVPool) -> CompiledDecode | None:
    """The compiled decode step of ``model`` (weights loaded and quantized, K shifts set: their addresses are
    taken now) over ``pool``, or None where it does not run (see the module doc; ``KVCHAT_CPU_KERNEL=0``
    among them)."""
    cfg = model.cfg
    if cfg.qk_norm or model.embed_tokens.dtype != torch.float32:
        return None
    if not cpu_decode.available():
        return None
    tensors = []
    for i, block in enumerate(model.layers):
        att, mlp = block.self_attn, block.mlp
        weights = [_weight(m) for m in (att.qkv, att.o_proj, mlp.gate_up, mlp.down_proj)]
        if None in weights:
            return None
        shift = None if att.k_shift is None else att.k_shift.detach().float().contiguous()
        tensors.append(cpu_decode.LayerTensors(block.input_layernorm.weight.detach(),
                                               block.post_attention_layernorm.weight.detach(),
                                               *weights, shift, pool.layer(i)))
    shape = dict(heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, hidden=cfg.hidden_size,
                 inter=cfg.intermediate_size)
    if not cpu_decode.DecodeLayers.takes(tensors, **shape):
        return None
    att = model.layers[0].self_attn
    return CompiledDecode(model, cpu_decode.DecodeLayers(tensors, eps=cfg.rms_norm_eps, sm_scale=att.sm_scale, **shape))
