"""The one safetensors header parser: what the safetensors library writes parses to its own view, and a damaged
header is refused the same way by the KV chunk reader and the weight fingerprint."""

from __future__ import annotations

import os
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvchat.model.fingerprint import WeightFileError, read_tensor_entries
from kvchat.store.safetensors_header import HeaderError, read_header


def _header(path, max_bytes=None):
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_header(fd, max_bytes)
    finally:
        os.close(fd)


def test_a_file_the_library_wrote_parses_as_the_library_reads_it(tmp_path):
    path = tmp_path / "t.safetensors"
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    save_file(tensors, str(path), metadata={"format": "pt"})
    header, start, size = _header(path)
    assert size == path.stat().st_size
    raw = path.read_bytes()
    with safe_open(str(path), "pt") as f:
        assert header["__metadata__"] == f.metadata()
        for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
            begin, end = header[name]["data_offsets"]
            assert header[name]["shape"] == list(f.get_tensor(name).shape)
            assert raw[start + begin:start + end] == f.get_tensor(name).view(torch.uint8).numpy().tobytes()
    assert [(e.name, e.shape, e.end - e.begin) for e in read_tensor_entries(path)] == [("a", (2, 3), 24), ("b", (4,), 8)]


@pytest.mark.parametrize("raw,kind,words", [
    (b"\x01\x02", "truncated", "2 bytes, shorter than the header length"),
    (struct.pack("<Q", 0) + b"{}", "header", "header length 0"),
    (struct.pack("<Q", 100) + b"{}", "truncated", "header of 100 bytes but file has 10"),
    (struct.pack("<Q", 9) + b"{not json", "header", "bad JSON"),
    (struct.pack("<Q", 16) + b'{"a": 1, "a": 2}', "header", "duplicate keys"),
    (struct.pack("<Q", 6) + b"[1, 2]", "header", "not a JSON object"),
])
def test_a_damaged_header_is_refused_alike_by_every_reader(tmp_path, raw, kind, words):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(raw)
    with pytest.raises(HeaderError, match=words) as refused:
        _header(path)
    assert refused.value.kind == kind
    with pytest.raises(WeightFileError, match=f"not a readable safetensors file.*{words}"):
        read_tensor_entries(path)


def test_a_header_longer_than_the_readers_bound_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "long.safetensors"
    path.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(HeaderError, match="outside 1..64") as refused:
        _header(path, max_bytes=64)
    assert refused.value.kind == "header"
