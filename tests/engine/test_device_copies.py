"""Restore and save through pinned memory and side streams (kvchat/engine/device_copies.py, persistence.py):
the CPU path stays plain copies; on a GPU (skipped without one) a saved chunk restores byte for byte."""

from __future__ import annotations

import pytest
import torch
from turn_helpers import prefill

from kvchat.engine.device_copies import DeviceCopies

gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_on_a_cpu_lanes_are_plain_synchronous_copies():
    copies = DeviceCopies(torch.device("cpu"))
    assert not copies.cuda and copies.ready is None
    lane = copies.lane()
    dst, src = torch.zeros(8), torch.arange(8.0)
    lane.wait_buffer_free()
    with lane:
        dst[:] = src.to("cpu", non_blocking=True)
    copies.join()
    assert torch.equal(dst, src)


@gpu_only
def test_lanes_copy_from_pinned_buffers_and_the_main_stream_waits():
    dev = torch.device("cuda", torch.cuda.current_device())
    pool = torch.zeros(4, 1 << 20, device=dev)
    pool.add_(1)  # queued on the main stream: the lanes start after it
    copies = DeviceCopies(dev)
    lanes = [copies.lane() for _ in range(2)]
    pinned = [torch.full((1 << 20,), float(i + 2)).pin_memory() for i in range(4)]
    for i, buf in enumerate(pinned):
        lane = lanes[i % 2]
        lane.wait_buffer_free()
        with lane:
            pool[i] += buf.to(dev, non_blocking=True)
    copies.join()
    assert pool.sum(1).tolist() == [float((i + 3) << 20) for i in range(4)]


@gpu_only
def test_a_chat_saved_from_a_gpu_pool_restores_byte_for_byte(smol_info):
    from kvchat.engine.block_manager import SeqBlocks
    from kvchat.engine.persistence import CHUNK_TOKENS, KVPersist, _read_tokens
    from kvchat.engine.read_speed import ReadSpeed
    from kvchat.engine.runner import Engine
    from kvchat.model.registry import load_weights

    engine = Engine(smol_info.config, load_weights(smol_info), smol_info.fingerprint, kv_dtype="fp8",
                    pool_bytes=2**26, device="cuda", dtype="bf16")
    persist = KVPersist(engine)
    ids = torch.randint(0, smol_info.config.vocab_size, (2 * CHUNK_TOKENS + 40,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    seq = SeqBlocks()
    prefill(engine, seq, ids)
    persist.save(seq, ids, [], None)
    persist.flush()
    assert not persist.errors
    persist.read_speed = ReadSpeed.fixed(float("inf"))  # always read (a GPU prefills 600 tokens faster than any disk)
    fresh = SeqBlocks()
    res = persist.restore(fresh, ids)
    assert res.from_disk == len(ids) - 1 and res.miss_reason is None
    (a, copied_a), (b, copied_b) = (_read_tokens(engine.pool, engine.blocks, s, 0, len(ids) - 1) for s in (seq, fresh))
    copied_a.synchronize()
    copied_b.synchronize()
    assert a.k.is_pinned() and all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                                   for x, y in zip((a.k, a.v, a.k_scale, a.v_scale), (b.k, b.v, b.k_scale, b.v_scale)))
    persist.close()
