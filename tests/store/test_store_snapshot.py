"""KV chunk files: bit-exact round trips, safetensors compatibility, hostile headers, crash points."""

from __future__ import annotations

import json
import os
import stat
import struct
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from kvchat.bench.page_cache import drop_file_cache, resident_fraction
from kvchat.index import kv_dir
from kvchat.store.errors import CorruptChunkError
from kvchat.store.keys import chunk_key
from kvchat.store.snapshot import ChunkData, ChunkLayout, publish_chunk, stage_chunk
from kvchat.store.snapshot_read import MAX_HEADER_BYTES, advise_will_read, read_chunk, verify_chunk_file

torch.set_num_threads(1)
FP8 = torch.float8_e4m3fn
DTYPES = [FP8, torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def random_chunk(layout: ChunkLayout, num_tokens: int, seed: int = 0) -> ChunkData:
    """Random bit patterns (NaN/inf included) in the layout's dtype; positive fp32 scales for fp8."""
    g = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, num_tokens, layout.num_kv_heads, layout.head_dim)

    def bits(dtype, shp):
        n = dtype.itemsize * (int(torch.tensor(shp).prod()) if shp else 1)
        return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).view(dtype).reshape(shp)

    data = ChunkData(bits(layout.dtype, shape), bits(layout.dtype, shape))
    if layout.dtype == FP8:
        data.k_scale = torch.rand(shape[:3], generator=g) + 1e-3
        data.v_scale = torch.rand(shape[:3], generator=g) + 1e-3
    return data


def write(data: ChunkData, key: str = "ab" * 16, parent: str | None = None, fp: str = "fp1"):
    staged = stage_chunk(data, key=key, parent_key=parent, fingerprint=fp, root=kv_dir())
    publish_chunk(staged)
    return staged


def read(staged, layout, tokens, parent=None, fp="fp1", checksum=None, out=None):
    return read_chunk(staged.final_path, layout, key=staged.key, parent_key=parent, fingerprint=fp,
                      token_count=tokens, checksum=checksum, out=out)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    flat_a, flat_b = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(flat_a, flat_b)


# The autouse `home` fixture only sets an env var; every example uses its own key, so sharing it is safe.
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layers=st.integers(1, 4), tokens=st.integers(0, 33), heads=st.integers(1, 4), dim=st.integers(1, 24),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31), parent=st.sampled_from([None, "cd" * 16]))
def test_round_trip_bit_exact(layers, tokens, heads, dim, dtype, seed, parent):
    layout = ChunkLayout(layers, heads, dim, dtype)
    data = random_chunk(layout, tokens, seed)
    key = chunk_key("fp1", parent, [seed, tokens, layers, heads, dim, DTYPES.index(dtype)])
    staged = write(data, key=key, parent=parent)
    back = read(staged, layout, tokens, parent=parent, checksum=staged.checksum)
    for name in ("k", "v", "k_scale", "v_scale"):
        a, b = getattr(data, name), getattr(back, name)
        assert (a is None and b is None) or same_bits(a, b), name
    assert staged.nbytes == staged.final_path.stat().st_size
    data_bytes = staged.nbytes - 8 - struct.unpack("<Q", staged.final_path.read_bytes()[:8])[0]
    assert verify_chunk_file(staged.final_path, key=key, checksum=staged.checksum) == data_bytes
    assert layout.data_bytes(tokens) == data_bytes, "a restore sizes its staging buffer from the layout"


def test_read_into_reused_staging_buffer():
    layout = ChunkLayout(2, 3, 8, torch.bfloat16)
    first, second = (write(random_chunk(layout, 7, seed=s), key=f"{s:032x}") for s in (1, 2))
    out = torch.empty(10_000, dtype=torch.uint8)
    a = read(first, layout, 7, out=out)
    assert a.k.data_ptr() == out.data_ptr() or a.v.data_ptr() == out.data_ptr()
    b = read(second, layout, 7, out=out)
    assert same_bits(b.k, random_chunk(layout, 7, seed=2).k) and same_bits(a.v, b.v)  # a now aliases b
    with pytest.raises(ValueError, match="staging buffer"):
        read(first, layout, 7, out=torch.empty(10, dtype=torch.uint8))


def test_safetensors_library_reads_our_files():
    layout = ChunkLayout(3, 2, 8, FP8)
    data = random_chunk(layout, 5)
    staged = write(data, key="12" * 16, parent="34" * 16)
    with safe_open(staged.final_path, framework="pt") as f:
        assert sorted(f.keys()) == ["k", "k_scale", "v", "v_scale"]
        assert f.metadata()["key"] == "12" * 16 and f.metadata()["parent_key"] == "34" * 16
        for name in f.keys():
            assert same_bits(f.get_tensor(name), getattr(data, name))


def test_permissions_and_no_leftovers():
    staged = write(random_chunk(ChunkLayout(1, 1, 4, torch.float16), 2))
    assert stat.S_IMODE(staged.final_path.stat().st_mode) == 0o600
    for d in (kv_dir(), staged.final_path.parent):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert os.listdir(staged.final_path.parent) == [staged.final_path.name]


def test_chunk_key_properties():
    k = chunk_key("fp", None, [1, 2, 3])
    assert len(k) == 32 and int(k, 16) >= 0
    assert k == chunk_key("fp", None, (1, 2, 3))
    others = {chunk_key("fp2", None, [1, 2, 3]), chunk_key("fp", "", [1, 2, 3]), chunk_key("fp", k, [1, 2, 3]),
              chunk_key("fp", None, [1, 2]), chunk_key("fp", None, [1, 2, 3, 0]), chunk_key("f", "p", [1, 2, 3])}
    assert k not in others and len(others) == 6
    with pytest.raises(ValueError):
        chunk_key("fp", None, [-1])
    with pytest.raises(ValueError, match="hex"):
        write(random_chunk(ChunkLayout(1, 1, 1, torch.float16), 1), key="../" + "a" * 29)


def test_chunk_key_identical_across_processes():
    code = ("from kvchat.store.keys import chunk_key; "
            "print(chunk_key('fp-x', None, range(300)), chunk_key('fp-x', 'ab' * 16, [49152, 0, 7]))")
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed}).stdout
        for seed in ("1", "2")
    }
    assert outs == {f"{chunk_key('fp-x', None, range(300))} {chunk_key('fp-x', 'ab' * 16, [49152, 0, 7])}\n"}


LAYOUT = ChunkLayout(2, 2, 4, FP8)


@pytest.fixture
def good():
    return write(random_chunk(LAYOUT, 3))


def rewrite_header(path, edit):
    """Replace the JSON header of ``path`` with ``edit(header)`` (a dict, or raw bytes) keeping the data."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    new = edit(json.loads(raw[8:8 + n]))
    new = new if isinstance(new, bytes) else json.dumps(new).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def expect_corrupt(staged, kind, **kw):
    with pytest.raises(CorruptChunkError) as ei:
        read(staged, kw.pop("layout", LAYOUT), kw.pop("tokens", 3), **kw)
    assert ei.value.kind == kind and "\n" not in str(ei.value)


def test_huge_header_length_rejected_before_reading(good):
    raw = good.final_path.read_bytes()
    good.final_path.write_bytes(struct.pack("<Q", 2**62) + raw[8:])
    expect_corrupt(good, "header")
    good.final_path.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES + 8) + raw[8:])
    expect_corrupt(good, "header")


@pytest.mark.parametrize("edit,kind", [
    (lambda h: {**h, "k": {**h["k"], "dtype": "BF16"}}, "mismatch"),
    (lambda h: {**h, "k": {**h["k"], "shape": [2, 3, 2, 2, 2]}}, "mismatch"),
    (lambda h: {**h, "extra": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, "mismatch"),
    (lambda h: {**h, "k": {**h["k"], "data_offsets": [0, 10**12]}}, "mismatch"),
    (lambda h: b"{not json" + b" " * 7, "header"),
    (lambda h: b'{"__metadata__": {}, "__metadata__": {}}', "header"),
    (lambda h: {**h, "__metadata__": {**h["__metadata__"], "evil": "1"}}, "header"),
    (lambda h: {**h, "__metadata__": {**h["__metadata__"], "token_count": 3}}, "header"),
    (lambda h: {**h, "__metadata__": {**h["__metadata__"], "fingerprint": "other"}}, "mismatch"),
    (lambda h: {**h, "__metadata__": {**h["__metadata__"], "format_version": "0"}}, "header"),
    (lambda h: [1, 2], "header"),
    (lambda h: b"\xff\xfe" * 8, "header"),
])
def test_lying_header_rejected(good, edit, kind):
    rewrite_header(good.final_path, edit)
    expect_corrupt(good, kind)
    with pytest.raises(CorruptChunkError):
        verify_chunk_file(good.final_path, key=good.key, fingerprint="fp1")


def test_bad_data_and_wrong_expectations(good):
    expect_corrupt(good, "mismatch", fp="fp2")
    expect_corrupt(good, "mismatch", parent="cd" * 16)
    expect_corrupt(good, "mismatch", tokens=4)
    expect_corrupt(good, "mismatch", layout=ChunkLayout(2, 2, 4, torch.bfloat16))
    expect_corrupt(good, "mismatch", checksum="xxh3_64:0000000000000000")
    raw = bytearray(good.final_path.read_bytes())
    raw[-5] ^= 0x10
    good.final_path.write_bytes(bytes(raw))
    expect_corrupt(good, "checksum")
    with pytest.raises(CorruptChunkError, match="checksum"):
        verify_chunk_file(good.final_path, key=good.key)
    good.final_path.write_bytes(bytes(raw[:-1]))
    expect_corrupt(good, "truncated")
    good.final_path.write_bytes(bytes(raw[:5]))
    expect_corrupt(good, "truncated")
    good.final_path.unlink()
    expect_corrupt(good, "missing")


@pytest.mark.fault
def test_another_chunk_of_same_shape_is_detected(good):
    other = write(random_chunk(LAYOUT, 3, seed=1), key="ef" * 16)
    os.replace(other.final_path, good.final_path)
    expect_corrupt(good, "mismatch")


@pytest.mark.fault
@pytest.mark.parametrize("point", ["chunk_mid_write", "chunk_after_fsync"])
def test_crash_while_writing_leaves_no_final_file(home, point):
    code = ("import torch; from kvchat.store.snapshot import *; from kvchat.index import kv_dir; "
            "d = ChunkData(torch.zeros(2, 16, 3, 8, dtype=torch.float16), torch.ones(2, 16, 3, 8, dtype=torch.float16)); "
            "publish_chunk(stage_chunk(d, key='ab' * 16, parent_key=None, fingerprint='fp', root=kv_dir()))")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KVCHAT_CRASH_AT": point})
    assert proc.returncode == -9
    names = os.listdir(kv_dir() / "ab")
    assert len(names) == 1 and names[0].startswith(".") and names[0].endswith(".tmp")


def test_files_advised_before_a_restore_are_read_ahead(tmp_path):
    """advise_will_read starts the kernel reading a file whose pages were dropped; a missing file is skipped."""
    path = tmp_path / "chunk.safetensors"
    path.write_bytes(os.urandom(4 << 20))
    if drop_file_cache(path) != 0.0:
        pytest.skip("this file system keeps the pages of a dropped file (or cannot say)")
    advise_will_read([tmp_path / "missing.safetensors", path])
    deadline = time.monotonic() + 5
    while resident_fraction(path) < 1.0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert resident_fraction(path) == 1.0
