"""Load a model with int8 or int4 linear layers one matrix at a time, never the whole model in fp32.

The model is built on the ``meta`` device (no memory). Everything but the quantized linear layers (the
embedding, the norms, a layer that keeps fp32 weights, RoPE) gets fp32 storage, the compute dtype of the
quantized formats, and is read first. Then each linear layer is put in place one at a time: its tensors read
from the model's stored file (:func:`kvchat.model.quant.quantized_path`, plain reads into fresh tensors, no
memory map), or, where there is none yet, its weight read in fp32 from the checkpoint (fused q/k/v and gate/up
rows concatenated, as :func:`kvchat.model.transformer.build_model` reads them), quantized
(:func:`kvchat.model.quant.quantize_weight`) and freed before the next is read; the stored file is then
written once with every layer's tensors, one at a time. Peak host memory: the quantized model, the fp32 embedding and norms,
and one fp32 matrix in flight (one decoder layer's while calibration runs through it), against four bytes a
parameter for the fp32 model (~30 GB for an 8B model, against ~5 GB of int4 weights).

The bits are those of quantizing the fp32 model as loaded: the same fp32 values go into the same function, and
the stored file holds the same tensors under the same names with the same ``scheme`` metadata
(``tests/model/test_quantized_load.py`` compares both against a quantized fp32 model).

The fp8 K-centring calibration is computed on the unquantized weights
(:func:`kvchat.engine.scratch.calibrate_k_mean`): :meth:`QuantizingLoad.unquantized_layers` hands over each
decoder layer with its fp32 weights and quantizes it once the calibration has run every chunk through it,
which computes the numbers of a whole-model forward chunk by chunk (a layer's chunk reads only that layer's
K/V of earlier chunks). A stored file that turns out unusable part way (a tensor not finite, the file
truncated) is dropped whole: every layer is quantized again from the checkpoint and the file rewritten, as
when it is absent.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from kvchat.load_steps import step
from kvchat.model import quant
from kvchat.model.config import ModelConfig
from kvchat.model.fingerprint import WeightFileError
from kvchat.model.transformer import Block, Linear, Transformer, fill_rows, has_lm_head, hf_sources, rope_inv_freq
from kvchat.model.weights import CheckpointReader, weight_reader
from kvchat.safetensors_file import SAFETENSORS_DTYPES, StreamingWriter
from kvchat.store.atomic_write import write_atomic
from kvchat.store.safetensors_header import HeaderError, read_header_file


def open_stored(path: Path, scheme: str, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> CheckpointReader | None:
    """A reader of the stored quantized tensors at ``path``, or None when the file is absent, unreadable, of
    another ``scheme`` (its ``scheme`` metadata), or does not hold exactly ``shapes`` (``{tensor name: (shape,
    dtype)}``). Only the header is read here; each tensor's data is checked as it is read
    (:meth:`QuantizingLoad._read_stored`); offsets that are not two integers spanning exactly a tensor's bytes
    inside the file's data refuse the file (:class:`kvchat.model.weights.CheckpointReader`)."""
    try:
        header, _, _ = read_header_file(path)
        meta = header.pop("__metadata__", None) or {}
        if meta.get("scheme") != scheme or set(header) != set(shapes):
            return None
        for name, entry in header.items():
            shape, dtype = shapes[name]
            if tuple(entry["shape"]) != shape or SAFETENSORS_DTYPES.get(entry["dtype"]) != dtype:
                return None
        return CheckpointReader(path)  # its offsets checked there, as every checkpoint's
    except (OSError, HeaderError, WeightFileError, KeyError, TypeError, ValueError):
        return None


class QuantizingLoad:
    """One model loaded with quantized linear layers (see the module doc): :attr:`model` after
    :meth:`finish`; :meth:`unquantized_layers` in between for a calibration.

    Attributes:
        model: the :class:`kvchat.model.transformer.Transformer` being loaded (its quantized linear layers are
            in place only after :meth:`finish`).
        from_stored: the quantized tensors came from the stored file (False: quantized in this load).
    """

    def __init__(self, cfg: ModelConfig, weights, device: torch.device, bits: int, kernel: str | None = None,
                 path: Path | None = None):
        """Build the model on the meta device and read everything but the quantized linear layers.

        Args:
            weights: a ``{name: tensor}`` mapping or a :mod:`kvchat.model.weights` reader (Hugging Face names).
            bits, kernel: the weight scheme (:func:`kvchat.model.quant.weight_scheme`).
            path: the stored file of the quantized tensors (read when it holds this scheme for exactly these
                layers, else written at :meth:`finish`; with a read-only models dir quantized again next
                time); None: quantize, store nothing.
        Raises:
            ValueError: no such scheme here (:func:`kvchat.model.quant.weight_scheme`).
            KeyError: a tensor the config requires is missing.
        """
        kernel, self.scheme = quant.weight_scheme(bits, kernel)
        self.bits, self.path, self.device = bits, path, device
        self.src = src = weight_reader(weights)
        with torch.device("meta"):
            model = Transformer(cfg)
        own_head = has_lm_head(cfg, src)
        if not own_head:
            model.lm_head.weight = None  # shares the embedding
        self.sources = hf_sources(cfg, own_head)
        self.layers: dict[str, tuple[nn.Module, str, Linear, str]] = {}  # quantized linears: parent, attr, module, kind
        shapes = {}
        for name, parent, attr, lin in quant.linear_modules(model):
            kind = quant.layer_kind(name, lin.in_features, kernel, bits)
            if kind is not None:
                self.layers[name] = (parent, attr, lin, kind)
                shapes.update(quant.stored_shapes(name, lin.out_features, lin.in_features, kind))
                setattr(parent, attr, None)  # no storage: the quantized layer takes its place
        model.to_empty(device=device)  # fp32 storage for the rest (meta modules are built in fp32)
        self.model = model
        with torch.no_grad():
            for param, names in self.sources.items():
                if param.rpartition(".")[0] not in self.layers:
                    fill_rows(src, model.get_parameter(param), names)
            if not own_head and quant.HEAD not in self.layers:
                model.lm_head.weight = model.embed_tokens
        model.inv_freq = rope_inv_freq(cfg).to(device)
        self.stored = open_stored(path, self.scheme, shapes) if path is not None else None
        self.shapes = shapes
        self.from_stored = self.stored is not None
        self.tensors: dict[str, torch.Tensor] = {}  # quantized in this load: what the stored file gets
        self._placed: list[str] = []
        self._said = False

    def unquantized_layers(self) -> Iterator[Block]:
        """The decoder layers in order, each with its linear layers' fp32 weights as loaded while the caller holds
        it; each is quantized (or its stored tensors read) when the caller asks for the next one, so one layer's
        fp32 weights exist at a time. A layer already quantized is not handed out again."""
        for i, block in enumerate(self.model.layers):
            names = [n for n in self.layers if n.startswith(f"layers.{i}.")]
            if any(n in self._placed for n in names):
                continue
            for name in names:
                parent, attr, _, _ = self.layers[name]
                setattr(parent, attr, self._fp32_linear(name))
            yield block
            for name in names:
                parent, attr, _, _ = self.layers[name]
                self._place(name, getattr(parent, attr).weight)

    def finish(self) -> Transformer:
        """Put every linear layer not yet in place in place, write the stored file if this load quantized, and
        return the model (``eval`` mode)."""
        for name in self.layers:
            if name not in self._placed:
                parent, attr, _, _ = self.layers[name]
                current = getattr(parent, attr)
                self._place(name, current.weight if isinstance(current, Linear) else None)
        if self.stored is not None:
            self.stored.close()
        elif self.path is not None:
            try:
                write_atomic(self.path, self._write_stored)
            except OSError:
                pass  # a read-only models dir: quantized again on the next load (seconds for a small model)
        self.tensors = {}
        return self.model.eval()

    def _write_stored(self, tmp: Path) -> None:
        """Write this load's quantized tensors (the layers' own buffers) to ``tmp`` one at a time: the file
        ``save_file`` writes (:class:`kvchat.safetensors_file.StreamingWriter`), without its copy of them all."""
        writer = StreamingWriter(tmp, {n: (t.dtype, tuple(t.shape)) for n, t in self.tensors.items()},
                                 {"scheme": self.scheme})
        try:
            for name, t in self.tensors.items():
                writer.write(name, t.cpu())
        finally:
            writer.close()

    def _fp32_linear(self, name: str) -> Linear:
        """The layer ``name`` as a new fp32 :class:`Linear` with its weight (and bias) read from the checkpoint
        (the meta module stays as it is: nothing keeps the fp32 weight once the layer is replaced)."""
        meta = self.layers[name][2]
        with torch.device(self.device):
            lin = Linear(meta.in_features, meta.out_features, bias=meta.bias is not None)
        with torch.no_grad():
            if name == quant.HEAD and f"{name}.weight" not in self.sources:
                lin.weight = self.model.embed_tokens
            else:
                fill_rows(self.src, lin.weight, self.sources[f"{name}.weight"])
            if lin.bias is not None:
                fill_rows(self.src, lin.bias, self.sources[f"{name}.bias"])
        return lin

    def _place(self, name: str, weight: torch.Tensor | None) -> None:
        """Replace the layer ``name`` by its quantized layer: from the stored file, else quantized from ``weight``
        (its fp32 weight; None: read from the checkpoint here)."""
        parent, attr, lin, kind = self.layers[name]
        tensors = self._read_stored(name, kind) if self.stored is not None else None
        if tensors is None:
            if weight is None:
                fp32 = self._fp32_linear(name)
                weight, bias = fp32.weight, fp32.bias
            else:
                bias = getattr(parent, attr).bias
            if not self._said:
                self._said = True
                step(f"quantizing {len(self.layers)} weight matrices to int{self.bits}"
                     + (" (once per model)" if self.path is not None else ""), first_time=self.path is not None)
            tensors = quant.quantize_weight(name, weight.detach(), kind)
            self.tensors.update(tensors)
        else:
            bias = None
            if f"{name}.bias" in self.sources:
                bias = torch.empty(lin.out_features, device=self.device)
                fill_rows(self.src, bias, self.sources[f"{name}.bias"])
            for hf in self.sources.get(f"{name}.weight", ()):
                self.src.skip(hf)
        on_device = {k: t.to(self.device) for k, t in tensors.items()}
        setattr(parent, attr, quant.quantized_layer(name, kind, on_device, None if bias is None else bias.detach()))
        self._placed.append(name)

    def _read_stored(self, name: str, kind: str) -> dict[str, torch.Tensor] | None:
        """The layer's tensors from the stored file, each read into a fresh tensor (aligned as torch allocates:
        the int8 kernel crashes on a weight at an odd offset); None, with the file dropped and the layers placed
        so far quantized again (:meth:`_drop_stored`), when one is truncated or not finite."""
        out = {}
        try:
            for key in quant.KINDS[kind]:
                shape, dtype = self.shapes[name + key]
                t = torch.empty(shape, dtype=dtype)
                self.stored.read_into(name + key, t)
                if t.is_floating_point() and not bool(t.isfinite().all()):
                    raise WeightFileError(f"{name + key} is not finite")
                out[name + key] = t
        except (OSError, WeightFileError):
            self._drop_stored()
            return None
        return out

    def _drop_stored(self) -> None:
        """Stop reading the stored file; quantize again the layers already placed from it."""
        self.stored.close()
        self.stored, self.from_stored = None, False
        placed, self._placed = self._placed, []
        for name in placed:
            self._place(name, None)
