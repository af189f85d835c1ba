"""The engine: a paged KV pool and the runs over it.

- :mod:`.kv_pool`: the pool's layout (``KVCacheSpec``) and tensors (``KVPool``).
- :mod:`.block_manager`: block tables, prefix cache, ref counts (pure Python).
- :mod:`.runner`: prefill / extend / decode over the pool (``Engine``), the only code that runs the model.
- :mod:`.dense_kv`: the CPU read path's contiguous copy of the running chat's K/V.
- :mod:`.decode_buffers`, :mod:`.decode_graphs`: decode's persistent device inputs (batch and context
  buckets) and the CUDA graphs replayed over them.
- :mod:`.session`, :mod:`.sampling`, :mod:`.turn`: one conversation's turns, sampling, turn stats.
- :mod:`.cache_identity`, :mod:`.calibration`: what a cached K/V is valid for; fp8 K-centring.
- :mod:`.persistence`, :mod:`.disk_budget`, :mod:`.cache_miss`: snapshots to and from disk, the budget,
  why a restore fell short; :mod:`.device_copies`: a GPU restore's pinned buffers and side streams.
"""
