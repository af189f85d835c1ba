"""Write a Hugging Face-layout Llama checkpoint with random weights (benchmarks and tests of loading).

``config.json`` comes from transformers' ``LlamaConfig``; the weights are
written shard by shard with safetensors (HF tensor names, the stored dtype
chosen), each tensor drawn from N(0, 0.02) on ``device``, so an 8B checkpoint
is written without ever holding it whole in host RAM; a word-level tokenizer
(``tokenizers``) with a ChatML-like template makes it loadable by
:func:`kvchat.runtime.load_runtime`. Random weights give meaningless text,
which loading and memory figures do not care about.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

SHAPES = {  # name -> LlamaConfig fields
    # a random ~0.84B-parameter model (the 1.64 GB bf16 measurement was of a 0.82B one)
    "0.8b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False),
    # ~66M parameters, 0.13 GB in bf16: the load-memory test
    "test": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False),
    # ~183M parameters, 0.37 GB in bf16, 0.73 GB in fp32, most of it in the layers: the quantized load's peak-memory
    # test
    "peak-test": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=16,
                      num_key_value_heads=4, vocab_size=4096, tie_word_embeddings=False),
    # a few hundred KB: warms a process's imports before a measured load
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # ~13M parameters with SmolLM2's vocabulary, rows of 256 (a k-quant block): the GGUF round-trip tests
    "tiny-smollm2-vocab": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=False),
    # bench peers --shape (kvchat.bench.gguf_shape.PEER_SHAPES): Llama shapes with SmolLM2's 49,152-token
    # vocabulary, so the default model's tokenizer serves both engines. No llama3 RoPE scaling: the same
    # plain RoPE on both sides (llama.cpp would need a rope_freqs tensor for it).
    # 0.82B parameters with tied embeddings, as the 0.8B of the prefill comparison
    "0.8b-smollm2-vocab": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                               num_key_value_heads=8, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0),
    # Llama-3.2-3B's shape
    "llama-3.2-3b-smollm2-vocab": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                       num_attention_heads=24, num_key_value_heads=8, vocab_size=49152,
                                       tie_word_embeddings=True, rope_theta=500000.0),
    # Llama-3.1-8B's shape
    "llama-3.1-8b-smollm2-vocab": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                       num_attention_heads=32, num_key_value_heads=8, vocab_size=49152,
                                       tie_word_embeddings=False, rope_theta=500000.0),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")  # an imported model's
_WORDS = ["<|im_start|>", "<|im_end|>", "<unk>", "system", "user", "assistant", "\n", " "] + [f"w{i}" for i in range(248)]
_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def hf_config(shape: str, max_position: int = 8192) -> dict:
    """``config.json``'s content for a named shape (see :data:`SHAPES`)."""
    from transformers import LlamaConfig

    return LlamaConfig(max_position_embeddings=max_position, **SHAPES[shape]).to_dict()


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every weight a Llama checkpoint of ``cfg`` stores."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    out = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    if not cfg.get("tie_word_embeddings"):
        out["lm_head.weight"] = (cfg["vocab_size"], h)
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,)}
    return out


def write_checkpoint(out: Path, shape: str, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                     device: str = "cpu", shard_bytes: int = 2 << 30, max_position: int = 8192,
                     tokenizer_from: Path | None = None) -> int:
    """Write a random checkpoint of ``shape`` into ``out`` (created); returns the weight files' total bytes.

    ``tokenizer_from``: a model dir whose tokenizer files (those of :data:`TOKENIZER_FILES` it has) are
    copied (the shape's vocabulary must be its size), else the word-level tokenizer.

    Norm weights are 1 (as a trained model's are near 1); every other tensor N(0, 0.02) in ``dtype``, drawn in
    :func:`tensor_shapes`' order from one generator seeded with ``seed``. Shards of at most ``shard_bytes``
    (tensors in that order, a new shard where the next would pass the limit) with a
    ``model.safetensors.index.json`` when there is more than one. Each tensor is written to its place as it is
    drawn (:class:`kvchat.safetensors_file.StreamingWriter`, the files ``save_file`` would write), so host
    memory holds one tensor (in fp32 while drawn), whatever the model's size.
    """
    from kvchat.safetensors_file import StreamingWriter

    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(shape, max_position)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    shapes = tensor_shapes(cfg)
    shards = shard_plan(shapes, dtype.itemsize, shard_bytes)
    files = ["model.safetensors"] if len(shards) == 1 else [f"shard-{i + 1:05d}.safetensors" for i in range(len(shards))]
    writers = {}
    for file, names in zip(files, shards):
        w = StreamingWriter(out / file, {n: (dtype, shapes[n]) for n in names}, {"format": "pt"})
        writers |= {n: w for n in names}
    gen = torch.Generator(device).manual_seed(seed)
    total = 0
    try:
        for name, shp in shapes.items():
            if name.endswith("norm.weight"):
                t = torch.ones(shp, dtype=dtype)
            else:
                t = (torch.randn(shp, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype).cpu()
            writers[name].write(name, t)
            total += t.numel() * t.element_size()
            del t
    finally:
        for w in set(writers.values()):
            w.close()
    if len(shards) > 1:
        weight_map = {name: file for file, names in zip(files, shards) for name in names}
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if tokenizer_from is None:
        _write_tokenizer(out)
    else:
        for name in TOKENIZER_FILES:
            if (tokenizer_from / name).is_file():
                shutil.copyfile(tokenizer_from / name, out / name)
    return total


def shard_plan(shapes: dict[str, tuple[int, ...]], itemsize: int, shard_bytes: int) -> list[list[str]]:
    """The tensors of each shard, in ``shapes``' order: a new shard starts where the next tensor would take the
    current one past ``shard_bytes`` (a tensor larger than that gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shp in shapes.items():
        nbytes = math.prod(shp) * itemsize
        if size and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_tokenizer(out: Path) -> None:
    """A word-level tokenizer (whitespace split) with ChatML-like special tokens and chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(_WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "unk_token": "<unk>",
        "bos_token": None, "chat_template": _TEMPLATE}))
