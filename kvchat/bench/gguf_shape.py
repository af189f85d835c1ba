"""GGUF files for ``kvchat bench peers``: the weight type a GGUF holds, and a random-weight model of a named
shape as both a kvchat checkpoint and a llama.cpp GGUF of the same weights.

``bench peers --shape 0.8b|3b|8b`` (:data:`PEER_SHAPES`) writes a random Llama checkpoint
(:func:`kvchat.bench.random_checkpoint.write_checkpoint`, bf16, with the default model's tokenizer files, so
both engines read the same token ids), then the same tensors as an f16 GGUF (:func:`write_gguf`: llama
architecture metadata from the checkpoint's ``config.json``, the ``tokenizer.*`` keys copied from the default
model's GGUF), then quantizes that with llama.cpp's own quantizer (:func:`quantize_gguf`, Q4_K_M: what
llama.cpp users run). bf16 -> f16 is exact for these N(0, 0.02) values above f16's normal range (6e-5)
and rounds the rarer smaller ones to f16's subnormal grid; llama.cpp then re-quantizes either way.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

PEER_SHAPES = {  # --shape -> kvchat.bench.random_checkpoint.SHAPES name
    "0.8b": "0.8b-smollm2-vocab",
    "3b": "llama-3.2-3b-smollm2-vocab",
    "8b": "llama-3.1-8b-smollm2-vocab",
}
QUANT_TYPE = "Q4_K_M"  # what --shape quantizes to (llama.cpp's LLAMA_FTYPE_MOSTLY_<this>)
_DONE = "complete.json"  # written last into a shape's cache dir: its files (checkpoint and GGUF) are whole
_CHECKPOINT_DONE = "checkpoint.json"  # written once the checkpoint alone is whole


class GgufError(ValueError):
    """A GGUF that cannot be read or written as asked (the message says which file and why)."""


def gguf_weight_type(path: Path) -> str:
    """The weight type of the GGUF at ``path``: the most frequent ggml type among its 2-D tensors (e.g.
    ``Q4_1``, ``Q4_K``; a Q4_K_M file mixes Q4_K with some Q6_K and reports Q4_K).

    Raises:
        GgufError: not a readable GGUF, or it holds no 2-D tensor.
    """
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise GgufError(f"{path}: not a readable GGUF ({exc})") from None
    counts = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) == 2)
    if not counts:
        raise GgufError(f"{path}: no 2-D weight tensors")
    return counts.most_common(1)[0][0]


def llama_label(weight_type: str) -> str:
    """The backend's name in ``bench peers`` tables and JSON, e.g. ``llama.cpp (Q4_K weights, f16 KV)``."""
    return f"llama.cpp ({weight_type} weights, f16 KV)"


def _gguf_name(hf_name: str) -> str:
    """llama.cpp's tensor name for a Hugging Face Llama tensor name (convert_hf_to_gguf.py's table)."""
    table = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in table:
        return table[hf_name]
    layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
    parts = {"self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
             "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
             "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down",
             "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm"}
    return f"blk.{layer}.{parts[rest]}.weight"


def rope_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """A q or k projection ``[heads * head_dim, in]`` with each head's rows reordered from Hugging Face's
    rotate-half RoPE layout (pairs ``i, i + d/2``) to llama.cpp's interleaved one (pairs ``2i, 2i + 1``):
    convert_hf_to_gguf.py's ``LlamaModel.permute``, so both engines compute the same attention."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(checkpoint: Path) -> list:
    """:class:`kvchat.model.fingerprint.TensorEntry` of every tensor in the checkpoint's safetensors files: the
    files in name order, each file's tensors by name (the GGUF's tensor order)."""
    from kvchat.model.fingerprint import read_tensor_entries

    return [e for file in sorted(checkpoint.glob("*.safetensors"))
            for e in sorted(read_tensor_entries(file), key=lambda e: e.name)]


def write_gguf(checkpoint: Path, out: Path, vocab_gguf: Path) -> int:
    """Write the Llama checkpoint at ``checkpoint`` (``config.json`` + safetensors) as an f16 GGUF at ``out``
    (norm weights f32, as llama.cpp's converter writes them), tensor by tensor: each read with plain reads
    (:class:`kvchat.model.weights.CheckpointReader`), converted and written before the next is read, so host
    memory holds one tensor and its fp32 and f16 copies (~2 GB for an 8B shape's embedding), never the model;
    with the ``tokenizer.*`` keys of ``vocab_gguf``. Returns the bytes written.

    Raises:
        GgufError: the config is not a Llama one, or its vocabulary size differs from ``vocab_gguf``'s.
    """
    import numpy as np
    import torch
    from gguf import GGUFReader, GGUFWriter, LlamaFileType

    from kvchat.model.weights import CheckpointReader
    from kvchat.safetensors_file import SAFETENSORS_DTYPES

    cfg = json.loads((checkpoint / "config.json").read_text())
    if cfg.get("model_type") != "llama":
        raise GgufError(f"{checkpoint}: model_type {cfg.get('model_type')!r}, only llama is written")
    vocab = GGUFReader(str(vocab_gguf))
    tokens = vocab.fields["tokenizer.ggml.tokens"]
    if len(tokens.data) != cfg["vocab_size"]:
        raise GgufError(f"{vocab_gguf} has {len(tokens.data)} tokens, the checkpoint's vocab_size is {cfg['vocab_size']}")
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = GGUFWriter(str(out), "llama")
    w.add_name(checkpoint.name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_rope_dimension_count(cfg["hidden_size"] // heads)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(LlamaFileType.MOSTLY_F16)
    for key, field in vocab.fields.items():
        if key.startswith("tokenizer."):
            w.add_key_value(key, field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None)
    entries = _tensors(checkpoint)
    for e in entries:
        dtype = np.float32 if len(e.shape) == 1 else np.float16
        w.add_tensor_info(_gguf_name(e.name), e.shape, np.dtype(dtype), int(np.prod(e.shape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    reader = CheckpointReader(checkpoint)  # plain reads: a memory map would keep every page read resident
    try:
        for e in entries:
            t = torch.empty(e.shape, dtype=SAFETENSORS_DTYPES[e.dtype])
            reader.read_into(e.name, t)
            t = t.float().numpy()
            if e.name.endswith(("q_proj.weight", "k_proj.weight")):
                t = rope_permute(t, heads if "q_proj" in e.name else kv_heads)
            w.write_tensor_data(t.astype(np.float32 if t.ndim == 1 else np.float16))
            del t
    finally:
        reader.close()
    w.close()
    return out.stat().st_size


def quantize_gguf(src: Path, dst: Path, threads: int, kind: str = QUANT_TYPE) -> None:
    """``llama_model_quantize`` of ``src`` into ``dst`` as ``kind`` (a ``LLAMA_FTYPE_MOSTLY_*`` suffix).

    Raises:
        ImportError: llama-cpp-python is not installed; GgufError: the quantizer failed.
    """
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise GgufError(f"llama_model_quantize {src} -> {kind} failed ({rc})")


def shape_model(shape: str, cache: Path, vocab_gguf: Path | None, tokenizer_dir: Path,
                threads: int) -> tuple[Path, Path | None]:
    """The random-weight model of ``--shape`` ``shape`` in ``cache/<shape>/`` (written once; a later call
    reuses it): returns (kvchat checkpoint dir, quantized GGUF or None). ``vocab_gguf``: the default model's GGUF
    (its vocabulary), None for the checkpoint alone (``bench peers --skip-llama``: no GGUF written, none
    returned); ``tokenizer_dir``: the default model's dir (tokenizer files).

    Disk: the checkpoint (2 bytes a weight), then the f16 GGUF beside it (2 bytes a weight) while llama.cpp
    quantizes it (~0.6), the f16 file deleted at once: an 8B shape peaks at ~35 GB and keeps ~20 GB.

    Raises:
        GgufError: ``shape`` is not a :data:`PEER_SHAPES` name, or writing failed;
        ImportError: llama-cpp-python is not installed (the quantizer).
    """
    from kvchat.bench.random_checkpoint import write_checkpoint

    if shape not in PEER_SHAPES:
        raise GgufError(f"--shape {shape!r}: one of {', '.join(PEER_SHAPES)}")
    root = cache / shape
    model, f16, quant = root / PEER_SHAPES[shape], root / "f16.gguf", root / f"{QUANT_TYPE}.gguf"
    if not (root / _DONE).is_file() and not (root / _CHECKPOINT_DONE).is_file():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        write_checkpoint(model, PEER_SHAPES[shape], tokenizer_from=tokenizer_dir)
        (root / _CHECKPOINT_DONE).write_text(json.dumps({"shape": PEER_SHAPES[shape]}))
    if vocab_gguf is None:
        return model, None
    if not (root / _DONE).is_file():
        for part in (f16, quant):
            part.unlink(missing_ok=True)
        try:
            write_gguf(model, f16, vocab_gguf)
            quantize_gguf(f16, quant, threads)
        finally:
            f16.unlink(missing_ok=True)  # only the quantized file runs; f16 is 2 bytes a weight
        (root / _DONE).write_text(json.dumps({"shape": PEER_SHAPES[shape], "gguf": quant.name}))
    return model, quant
