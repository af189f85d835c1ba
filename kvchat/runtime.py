"""Build a ready engine and chat format from a ``--model`` value, with the model's fp8 K-centring calibration."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from kvchat.cpu_threads import checked_threads
from kvchat.device import check_device
from kvchat.engine.cache_identity import resolve_weight_format
from kvchat.engine.calibration import (
    CALIBRATION_TOKENS,
    KVCalibration,
    load_calibration,
    make_calibration,
    save_calibration,
)
from kvchat.engine.kv_pool import KVCacheSpec, kv_torch_dtype
from kvchat.engine.pool_size import GPUMemoryError, load_oom_line
from kvchat.engine.runner import Engine
from kvchat.engine.scratch import calibrate_k_mean
from kvchat.kernels import dispatch
from kvchat.load_steps import step
from kvchat.model.chat_format import ChatFormat, ChatTemplateError
from kvchat.model.registry import ModelInfo, resolve_model
from kvchat.model.weights import CheckpointReader
from kvchat.plan import WEIGHT_BYTES
from kvchat.settings import compute_dtype, gpu_memory
from kvchat.settings import device as env_device
from kvchat.settings import weights as env_weights
from kvchat.texts import CALIBRATION_MODULES, stdlib_text


@dataclass(slots=True)
class Runtime:
    """A loaded model: its identity, the engine, and a tokenizer for chat formats."""

    info: ModelInfo
    engine: Engine
    tokenizer: object

    def chat_format(self, settings: dict | None = None) -> ChatFormat:
        """A :class:`ChatFormat` with the chat's pinned date and template options (``settings`` as stored)."""
        settings = settings or {}
        extra = _generation_eos_ids(self.info)
        return ChatFormat(
            self.tokenizer,
            date_string=settings.get("date_string"),
            template_kwargs=settings.get("template_kwargs"),
            extra_stop_ids=extra,
        )


def _generation_eos_ids(info: ModelInfo) -> list[int]:
    path = info.path / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    return [eos] if isinstance(eos, int) else list(eos or [])


def load_runtime(
    model: str | None,
    kv_dtype: str = "fp8",
    *,
    device: str | None = None,
    pool_bytes: int | None = None,
    weights: str | None = None,
    preallocate: bool = True,
    progress: Callable[[str, int, int], None] | None = None,
) -> Runtime:
    """Resolve (importing on first use), load weights, build the engine and tokenizer.

    The weights stream from the safetensors files into a model built on the
    meta device in the compute dtype (``KVCHAT_DTYPE``, :mod:`kvchat.model.weights`):
    no whole copy of them exists in host RAM besides the model itself. For an
    fp8 pool the model's K-centring calibration is loaded, or computed on this
    engine's weights and stored on first use (:func:`ensure_calibration`).
    ``weights``: ``auto|fp32|bf16|int8|int4`` (None: ``KVCHAT_WEIGHTS``), resolved for the device, the compute
    dtype and the model's stored parameters by :func:`kvchat.engine.cache_identity.resolve_weight_format`; int8
    and int4 models are loaded layer by layer (:class:`kvchat.model.quantized_load.QuantizingLoad`: each linear
    layer read quantized from the model's stored file, or read in fp32 and quantized, one at a time; a calibration
    computed here runs through each layer's fp32 weights before it is quantized), so host memory peaks near the
    quantized model, not the fp32 one.
    ``preallocate``: allocate and touch the engine's dense K/V copy (the CPU read path) for the whole context
    now, not inside the first resumed chat's TTFT (:meth:`kvchat.engine.dense_kv.DenseKV.preallocate`); the
    server, which gives every request a copy of its own, passes False.
    ``progress``: the slow steps of a start as ``(text, done, total)``: loading the weights (bytes), the
    calibration on a model's first use, compiling the Triton kernels on a GPU's first start (e.g.
    :func:`kvchat.progress.print_start_progress`; hashing a checkpoint used in place shows its own bar).

    Raises:
        kvchat.model.registry.ModelNotFoundError, kvchat.model.config.UnsupportedModelError,
        kvchat.model.importer.ModelImportError, kvchat.engine.kv_pool.KVDtypeError,
        kvchat.settings.SettingError: a bad ``KVCHAT_DEVICE`` (``device`` None), ``KVCHAT_ATTENTION``,
            ``KVCHAT_DTYPE``, ``KVCHAT_WEIGHTS`` (``weights`` None) or ``KVCHAT_KV_BUDGET_MB`` (``pool_bytes`` None);
            all but the pool budget before the weights load.
        kvchat.device.DeviceError: ``device`` names a CUDA device that does not exist here.
        kvchat.engine.pool_size.GPUMemoryError: the GPU ran out of memory while loading, or leaves the KV pool
            too little (one line with the numbers and ``--gpu-memory``).
        ValueError: int8 weights asked for on a GPU, or with a compute dtype other than fp32.
    """
    from transformers import AutoTokenizer

    kv_torch_dtype(kv_dtype)
    dev = check_device(device if device is not None else env_device())
    dispatch.backend_for(torch.empty(0, device=dev))  # KVCHAT_ATTENTION=triton where Triton cannot run fails here
    weights = weights or env_weights()
    resolve_weight_format(weights, dev.type, compute_dtype(), num_params=0)  # a bad name or int8 on a GPU: first
    info = resolve_model(model)
    step(f"loading {info.name}: tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(info.path))
    reader = CheckpointReader(info.path)
    weight_format = resolve_weight_format(weights, dev.type, compute_dtype(), num_params=reader.num_params())
    step(f"loading {info.name}: weights ({weight_format})")
    if progress is not None:
        reader.on_read = _weight_progress(reader, info.config.tie_word_embeddings, progress)
    free, total = torch.cuda.mem_get_info(dev) if dev.type == "cuda" else (0, 0)
    try:
        engine = Engine(info.config, reader, info.fingerprint, kv_dtype=kv_dtype, pool_bytes=pool_bytes,
                        device=dev, name=info.name, weight_format=weight_format, progress=progress,
                        calibration=lambda e: ensure_calibration(info, e, tokenizer, progress=progress))
    except torch.cuda.OutOfMemoryError:
        weight_bytes = reader.num_params() * WEIGHT_BYTES[weight_format]
        raise GPUMemoryError(load_oom_line(info.name, weight_bytes, free, total, gpu_memory())) from None
    runtime = Runtime(info, engine, tokenizer)
    if preallocate and engine.dense is not None:
        step("allocating the KV copy of a full context")
        engine.dense.preallocate(engine.max_context)
    if engine.exact_sink:  # every chat starts with the template's first token: its sink now, not in the first TTFT
        try:
            engine.sink_kv(runtime.chat_format().prefix_ids("", [])[0])
        except ChatTemplateError:
            pass  # reported where a chat is formatted; the sink is made on first use instead
    return runtime


def _weight_progress(reader: CheckpointReader, tied: bool, progress: Callable[[str, int, int], None]):
    """``reader.on_read`` reporting ``progress("loading weights", bytes so far, bytes the model reads)`` (a tied
    model never reads a stored ``lm_head.weight``) at each whole percent and at the end, not per tensor."""
    total = sum(e.end - e.begin for name, e in reader.entries.items() if not (tied and name == "lm_head.weight"))
    done, shown = [0], [-1]

    def on_read(nbytes: int) -> None:
        done[0] += nbytes
        percent = 100 * done[0] // max(total, 1)
        if percent > shown[0]:
            shown[0] = percent
            progress("loading weights", done[0], total)

    return on_read


def ensure_calibration(info: ModelInfo, source, tokenizer, device=None,
                       progress: Callable[[str, int, int], None] | None = None) -> KVCalibration:
    """The model's fp8 K-centring calibration: loaded if stored, else computed once (a few seconds) and stored.

    Computed over :data:`kvchat.texts.CALIBRATION_MODULES`' docstrings
    (:func:`kvchat.engine.scratch.calibrate_k_mean`, a throw-away 16-bit
    pool over the model's weights).

    Args:
        info: the model.
        source: the :class:`Engine` being built (its unquantized layers are used, :meth:`Engine.unquantized_layers`;
            nothing is built), or
            Hugging Face-named weights (benchmarks holding them: a temporary bf16-pool engine is built).
        tokenizer: its tokenizer (encodes the calibration text).
        device: where a temporary engine runs (``source`` weights only).
        progress: gets ``(text, 0, 1)`` before computing and ``(text, 1, 1)`` after; the step is also said through
            :func:`kvchat.load_steps.step` (the TUI's status line, or one line on stderr at a CLI's first start).
    Raises:
        kvchat.texts.TextSourceError: the standard library has no sources to read text from.
    """
    cfg = info.config
    shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    cal = load_calibration(info.fingerprint, shape)
    if cal is not None:
        return cal
    said = f"calibrating fp8 K centring for {info.name} (once per model)"
    step(said, first_time=True)  # the TUI's status line, or one line on stderr at a CLI's first start
    if progress is not None:
        progress(said, 0, 1)
    text = stdlib_text(CALIBRATION_MODULES)
    ids = tokenizer(text.text, add_special_tokens=False)["input_ids"][:CALIBRATION_TOKENS]
    engine = source
    if not isinstance(source, Engine):
        spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, "bf16")
        engine = Engine(cfg, source, info.fingerprint, kv_dtype="bf16", device=device, dense_kv=False,
                        pool_bytes=spec.bytes_per_block)
    cal = make_calibration(calibrate_k_mean(engine, ids), f"{text.name} ({len(ids)} tokens, sha256 {text.sha256[:12]})")
    if progress is not None:
        progress(said, 1, 1)
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the scratch pool and activations go back to the device
    try:
        save_calibration(info.fingerprint, cal)
    except OSError as exc:  # a read-only models dir: use it for this run, compute again next time
        print(f"kvchat: calibration not saved: {exc}", file=sys.stderr)
    return cal


def set_threads(n: int | None) -> None:
    """Use ``n`` CPU threads for torch (None: torch's default, one per core), at most the usable cores
    (:func:`kvchat.cpu_threads.checked_threads`, which says so on stderr).

    Raises:
        ValueError: ``n`` < 1.
    """
    n = checked_threads(n)
    if n:
        torch.set_num_threads(n)
