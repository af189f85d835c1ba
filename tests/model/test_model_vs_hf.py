"""Our Llama-family runner against transformers' own implementation (the oracle).

Random-weight configs of every supported model type, GQA groups 1, 3 and 4,
odd lengths, run as prefill + extend (over a cached prefix) + decode, all
through the paged pool.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from kvchat.engine.block_manager import SeqBlocks
from kvchat.engine.runner import Engine
from kvchat.model.config import ModelConfig, UnsupportedModelError

# The pool rounds every K/V (fp16: 11 significant bits, bf16: 8) while the
# fp32 oracle keeps them exact. Observed on these peaked random models: max
# |diff| / logit range 3.5e-3 (fp16 pool) and 3.1e-2 (bf16 pool), scaling by
# 8x with the 3 bits, i.e. pure rounding. Tolerances sit ~3x above that;
# a wrong llama3 RoPE scaling alone gives ~3e-2 on the fp16 pool.
REL_TOL = {"fp16": 1e-2, "bf16": 8e-2}


def hf_config(model_type: str, heads: int, kv_heads: int):
    common = dict(
        vocab_size=211,
        hidden_size=heads * 16,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        # Large init so attention is peaked: at the default 0.02 scores are
        # near-uniform and a wrong RoPE or mask hides inside the tolerance.
        initializer_range=0.25,
    )
    if model_type == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        return transformers.LlamaConfig(**common, rope_parameters=rope)
    if model_type == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None)
    if model_type == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.Qwen3Config(**common, head_dim=24)


def run_ours(hf_model, ids: list[int], kv_dtype: str, n_prefill: int, n_extend: int, dense_kv: bool) -> torch.Tensor:
    """Logits for every position: prefill [0, n_prefill), extend to n_extend, decode the rest.

    ``dense_kv`` picks the read path: the CPU contiguous copy or the paged reference kernels.
    """
    cfg = ModelConfig.from_hf(hf_model.config.to_dict())
    engine = Engine(cfg, dict(hf_model.state_dict()), "test", kv_dtype=kv_dtype, pool_bytes=2**22, device="cpu",
                    dense_kv=dense_kv)
    seq = SeqBlocks()
    rows = [engine.score(seq, ids[:n_prefill]), engine.score(seq, ids[:n_extend])]
    rows += [engine.decode(seq, ids[: n + 1])[None] for n in range(n_extend, len(ids))]
    return torch.cat(rows)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("kv_dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("dense_kv", [True, False], ids=["dense", "paged"])
def test_logits_match_transformers(model_type, heads, kv_heads, kv_dtype, dense_kv):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(model_type, heads, kv_heads)).eval()
    if model_type == "qwen2":
        with torch.no_grad():  # give the qkv biases non-zero values so they are really tested
            for layer in hf.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    ids = torch.randint(0, 211, (45,)).tolist()  # odd length: 2 blocks + 13
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = run_ours(hf, ids, kv_dtype, n_prefill=19, n_extend=33, dense_kv=dense_kv)
    err = (ours - ref).abs().max().item()
    assert err <= REL_TOL[kv_dtype] * ref.abs().max().item(), f"max |diff| {err}"


def test_unsupported_model_type_is_named():
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        ModelConfig.from_hf({"model_type": "gpt2"})


def test_smollm2_matches_transformers(smol_info):
    """The real default model: our runner on a bf16 pool vs transformers' fp32 forward, same weights."""
    from kvchat.model.registry import load_weights

    torch.manual_seed(3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(smol_info.path), dtype=torch.float32).eval()
    engine = Engine(smol_info.config, load_weights(smol_info), "smol", kv_dtype="bf16", pool_bytes=2**24, device="cpu")
    ids = torch.randint(0, smol_info.config.vocab_size, (53,)).tolist()
    seq = SeqBlocks()
    ours = torch.cat([engine.score(seq, ids[:37]), engine.score(seq, ids)])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    err = (ours - ref).abs().max().item()
    assert err <= REL_TOL["bf16"] * ref.abs().max().item(), f"max |diff| {err}"
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95
