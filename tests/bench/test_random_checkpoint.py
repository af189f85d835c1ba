"""Random checkpoints are written tensor by tensor (kvchat.safetensors_file.StreamingWriter) into the files
safetensors' own writer makes of the same tensors, with the values one seeded generator draws in order."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvchat.bench.random_checkpoint import hf_config, shard_plan, tensor_shapes, write_checkpoint
from kvchat.safetensors_file import StreamingWriter


def test_streamed_shards_are_the_files_save_file_writes(tmp_path):
    out = tmp_path / "ckpt"
    total = write_checkpoint(out, "tiny", shard_bytes=64 << 10)  # several shards
    shapes = tensor_shapes(hf_config("tiny"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = shard_plan(shapes, 2, 64 << 10)
    assert len(shards) > 2 and list(index["weight_map"]) == [n for s in shards for n in s]
    gen, seen = torch.Generator().manual_seed(0), 0
    drawn = {}
    for name, shp in shapes.items():  # the generator's draws in tensor_shapes' order
        drawn[name] = (torch.ones(shp) if name.endswith("norm.weight")
                       else torch.randn(shp, generator=gen) * 0.02).to(torch.bfloat16)
    for i, names in enumerate(shards):
        file = out / f"shard-{i + 1:05d}.safetensors"
        assert set(index["weight_map"][n] for n in names) == {file.name}
        tensors = load_file(str(file))
        assert list(sorted(tensors)) == sorted(names) and all(torch.equal(tensors[n], drawn[n]) for n in names)
        save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
        assert file.read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
        seen += sum(t.numel() * 2 for t in tensors.values())
    assert seen == total
    again = tmp_path / "again"
    write_checkpoint(again, "tiny", shard_bytes=64 << 10)
    assert all((out / f.name).read_bytes() == f.read_bytes() for f in again.glob("*.safetensors"))


def test_one_shard_is_model_safetensors(tmp_path):
    write_checkpoint(tmp_path / "one", "tiny")
    assert sorted(p.name for p in (tmp_path / "one").glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "one" / "model.safetensors.index.json").exists()


def test_a_streamed_file_of_every_dtype_is_what_save_file_writes(tmp_path):
    g = torch.Generator().manual_seed(3)
    dtypes = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.float16, torch.bfloat16, torch.int32,
              torch.float32, torch.float64, torch.int64]
    tensors = {f"{name}.{i}": (torch.randn(3, 5, generator=g) * 50).to(d)
               for i, d in enumerate(dtypes) for name in ("b", "a")}
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"scheme": "x"})
    w = StreamingWriter(tmp_path / "s.safetensors", {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()},
                        {"scheme": "x"})
    for name in reversed(list(tensors)):  # any order
        w.write(name, tensors[name])
    w.close()
    assert (tmp_path / "s.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    w = StreamingWriter(tmp_path / "y.safetensors", {"a": (torch.float32, (2,))})
    with pytest.raises(ValueError, match="announced"):
        w.write("a", torch.zeros(3))
    w.close()
    with pytest.raises(ValueError, match="one metadata key"):
        StreamingWriter(tmp_path / "z.safetensors", {}, {"a": "1", "b": "2"})
