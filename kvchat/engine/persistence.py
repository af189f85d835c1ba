"""KV snapshots of sequences: save pool blocks as content-addressed chunk files, restore them.

A chain covers a token list in chunks of ``CHUNK_TOKENS`` from position 0;
chunk ``i`` is keyed by ``chunk_key(cache_fingerprint, key of chunk i-1,
its token ids)`` (LMCache-style chained prefix keys), so equal prefixes share
files across chats and processes. The partial chunk at the end of a segment
(the documents' prefix, the conversation so far) is stored as a *tail*: a
leaf chunk with fewer tokens, so a document or a finished turn is reusable in
full. Chunks are written by a background thread (blocks are copied to a
staging tensor first, so the pool may change right away); restores read and
verify every file before one byte reaches the pool.

Chunk size 256 tokens (16 blocks): for SmolLM2 in fp8 that is 3.1 MB per
file, so a 4096-token chat costs 16 files and 16 fsyncs while the 0.5 KB
safetensors header stays < 0.02% of the bytes; reuse granularity below a
chunk comes from tails.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

import torch

from kvchat.engine.block_manager import SeqBlocks
from kvchat.engine.device_copies import DeviceCopies
from kvchat.engine.disk_budget import Eviction, make_room
from kvchat.engine.disk_budget import enforce as enforce_budget
from kvchat.engine.inference import inference
from kvchat.engine.kv_pool import KVPool
from kvchat.engine.read_speed import ReadSpeed, restore_pays
from kvchat.engine.runner import Engine
from kvchat.engine.timing import DeviceTimer
from kvchat.index import get_db
from kvchat.model.int8_scheme import COMPILED_LAYER_MAX_TOKENS
from kvchat.store import chunk_refs
from kvchat.store.chunk_index import (
    ChunkRow,
    add_chunk,
    delete_chunk,
    get_chunk,
    list_tails,
    read_row,
    touch,
    with_ancestors,
)
from kvchat.store.errors import CorruptChunkError
from kvchat.store.keys import chunk_key
from kvchat.store.snapshot import ChunkData, ChunkLayout
from kvchat.store.snapshot_read import advise_will_read

CHUNK_TOKENS = 256
# pinned host bytes a CUDA save's queued chunks hold at most (a 32K-token 8B chat is ~2.2 GB of chunks: pinned
# at once, those pages were locked and then kept by torch's host cache); chunks beyond wait in pageable memory
SAVE_PINNED_BYTES = 256 * 2**20
CHUNK_HEADER_BYTES = 4096  # a chunk file's safetensors header (~0.5 KB), rounded up to a filesystem block
# chunk files read at once by a restore: one per torch thread (the cores kvchat was given), 2 to this many.
# Measured, a 4,096-token restore (16 files) warm in fresh processes on 2 cores: 4 readers 44-71 ms, 2 readers
# 29-31 ms, 1 reader 46-49 ms; with the page cache dropped 2 and 4 readers alike (118-148 ms, disk-bound here)
READ_THREADS = 4
_READERS = threading.Lock()  # one restore's readers at a time: they set torch's thread count (see restore)


def _reader_count() -> int:
    """Reader threads of a restore: one per torch thread, 2 to :data:`READ_THREADS` (two even on one thread:
    reads overlap checksums)."""
    return max(2, min(READ_THREADS, torch.get_num_threads()))


@dataclass(slots=True)
class Link:
    """One chunk of a chain: tokens ``[start, end)`` under ``key``."""

    key: str
    parent_key: str | None
    start: int
    end: int


@dataclass(slots=True)
class RestoreResult:
    """What a restore did (tokens, ms, bytes).

    Attributes:
        from_disk: tokens whose K/V were read from chunk files into the pool.
        restore_ms: wall time of lookup + read + verify + copy into the pool.
        bytes_read: chunk file bytes read.
        miss_reason: why stored K/V could not be used, if something was skipped.
    """

    from_disk: int = 0
    restore_ms: float = 0.0
    bytes_read: int = 0
    miss_reason: str | None = None
    keys: list[str] = field(default_factory=list)


def chain(fingerprint: str, token_ids: Sequence[int], ends: Sequence[int]) -> list[Link]:
    """Full chunks of ``token_ids[:max(ends)]`` plus one tail per non-aligned end in ``ends``.

    Returns the full chunks in order, then the tails (leaves), each keyed
    under the full chunk before it.
    """
    stop = max(ends, default=0)
    links, parent = [], None
    full_keys: dict[int, str | None] = {0: None}
    for start in range(0, stop - CHUNK_TOKENS + 1, CHUNK_TOKENS):
        key = chunk_key(fingerprint, parent, token_ids[start : start + CHUNK_TOKENS])
        links.append(Link(key, parent, start, start + CHUNK_TOKENS))
        parent = key
        full_keys[start + CHUNK_TOKENS] = key
    for end in sorted(set(ends)):
        start = end - end % CHUNK_TOKENS
        if end % CHUNK_TOKENS and start in full_keys:
            p = full_keys[start]
            links.append(Link(chunk_key(fingerprint, p, token_ids[start:end]), p, start, end))
    return links


def find_chain(db, fingerprint: str, token_ids: Sequence[int]) -> list[ChunkRow]:
    """Rows of the longest stored chain prefixing ``token_ids``: full chunks, then the longest matching tail."""
    rows, parent = [], None
    for start in range(0, len(token_ids) - CHUNK_TOKENS + 1, CHUNK_TOKENS):
        row = get_chunk(db, chunk_key(fingerprint, parent, token_ids[start : start + CHUNK_TOKENS]))
        if row is None:
            break
        rows.append(row)
        parent = row.key
    start = len(rows) * CHUNK_TOKENS
    for t in list_tails(db, parent, fingerprint, CHUNK_TOKENS):
        end = start + t.token_count
        if end <= len(token_ids) and chunk_key(fingerprint, parent, token_ids[start:end]) == t.key:
            rows.append(t)
            break
    return rows


def restorable_tokens(db, owner: str, token_ids: Sequence[int], fingerprint: str | None = None) -> int:
    """Tokens of ``owner``'s history ``token_ids`` a resume restores from disk.

    The longest stored chain prefixing them (:func:`find_chain`) under
    ``fingerprint`` (None: under whichever of the owner's own cache
    fingerprints covers most, when the resuming engine is not known), at most
    the whole history: opening a chat restores all of it, and a turn's restore
    stops only before the new question's last token (:meth:`KVPersist.restore`).
    """
    fingerprints = [fingerprint] if fingerprint is not None else chunk_refs.owner_fingerprints(db, owner)
    stored = max((sum(r.token_count for r in find_chain(db, fp, token_ids)) for fp in fingerprints), default=0)
    return min(stored, len(token_ids))


def document_tokens(db, owner: str, tokens: int | None, fingerprint: str | None = None) -> int:
    """Tokens of a document's prefix (``tokens`` long, None: not known; ``owner`` its id) a resume restores from disk.

    A document's chunks are its prefix's chain (full chunks from token 0) and its tails (the prefix's
    end, and for a pasted document also the system prompt's end): what a resume restores is the longest
    chain among them under ``fingerprint`` (None: any), at most ``tokens``, never their sum (the tails
    overlap). The same figure as :func:`restorable_tokens` of a chat, for an owner without token ids.
    """
    rows = {r.key: r for r in chunk_refs.owner_chunks(db, owner) if fingerprint in (None, r.fingerprint)}

    def end(row) -> int:
        n = row.token_count
        while row.parent_key is not None:
            row = rows.get(row.parent_key)
            if row is None:  # an ancestor it does not reference: not its chain
                return 0
            n += row.token_count
        return n

    longest = max(map(end, rows.values()), default=0)
    return longest if tokens is None else min(tokens, longest)


class KVPersist:
    """Saves and restores sequences of one engine; owns the background writer thread."""

    def __init__(self, engine: Engine, touch_lru: bool = True):
        """``touch_lru``: a restore stamps its chunks' LRU time (False: a restore writes nothing, as
        ``kvchat serve --no-store`` promises)."""
        self.engine = engine
        self.touch_lru = touch_lru
        spec = engine.spec
        self.fingerprint = engine.cache_fingerprint
        self.layout = ChunkLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, engine.pool.k.dtype)
        self.read_speed = ReadSpeed()  # measured: probes and restores (kvchat.engine.read_speed)
        self.errors: list[str] = []
        self.evicted = Eviction()  # summed over the budget enforcements after each save (writer thread)
        self._queue: queue.Queue = queue.Queue()
        self._pinned_lock = threading.Lock()
        self._pinned_bytes = 0  # pinned host bytes of queued chunks (CUDA saves), at most SAVE_PINNED_BYTES
        # a CPU restore's staging buffers, one per reader (_reader_count), allocated and touched now: the first
        # write into fresh pages costs a page fault per 4 KiB, measured at 11-14 ms for a reader's first 3.1 MB
        # file against 0.5-0.9 ms into used pages (2 cores, in a fresh process); CUDA restores pin a buffer per
        # reader instead. A restore with more readers than buffers (more threads since) allocates the others.
        self._cpu_staging: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        if engine.pool.k.device.type == "cpu":
            for _ in range(_reader_count()):
                self._cpu_staging.put(torch.empty(self.layout.data_bytes(CHUNK_TOKENS), dtype=torch.uint8).fill_(0))
        # the index is opened by its first use (~25 ms): a resuming front-end has already looked the chat
        # up on this thread, and bad input refused before any turn leaves no database behind
        self._thread = threading.Thread(target=self._writer, name="kvchat-snapshot-writer", daemon=True)
        self._thread.start()

    # ---- restore -------------------------------------------------------------------------
    def find(self, token_ids: Sequence[int]) -> list[ChunkRow]:
        """Rows of the longest stored chain that prefixes ``token_ids`` (see :func:`find_chain`)."""
        return find_chain(get_db(), self.fingerprint, token_ids)

    def restore(self, seq: SeqBlocks, token_ids: Sequence[int], whole: bool = False,
                recompute_from: int | None = None) -> RestoreResult:
        """Read the stored chain of ``token_ids`` into ``seq``'s blocks, beyond what it already holds.

        At most ``len(token_ids) - 1`` tokens are restored (the last one is
        recomputed for logits), all of them with ``whole`` (a prefix held for
        later turns, no logits wanted: an opened chat's history). Blocks for
        the whole chain are reserved first
        (``PoolFullError`` before any read); one worker per torch thread (2 to :data:`READ_THREADS`) then
        each read, verify and copy one file at a time into those blocks (and,
        on a CPU, dequantized into the engine's dense copy, so the first
        forward after a resume reads nothing back from the pool; not where a
        question of up to :data:`COMPILED_LAYER_MAX_TOKENS` tokens follows on
        the compiled decoder layers, which read the pool itself) through
        one staging buffer per reader, on a CPU allocated and touched when this object was made (a fresh
        buffer per file paid a first-touch page fault per 4 KiB: about 40 ms per 100 MB here); on CUDA that buffer
        is pinned and the copy runs non-blocking on the thread's side stream
        (:mod:`kvchat.engine.device_copies`), joined before the pool is read. A corrupt or missing
        chunk ends the chain there: it and the chain's later chunks (recomputed, so
        rewritten by the next save) are dropped from the index, and only the
        tokens before it are committed; the rest stay reserved, uncommitted, for
        the prefill that recomputes them. Skipped entirely when reading would
        be slower than prefilling what it spares (the tokens from ``recompute_from`` on: where computing would
        start without the files, what ``seq`` holds cut back to a chunk edge; None: what it holds), by measured
        speeds both (:func:`kvchat.engine.read_speed.restore_pays`; :attr:`read_speed` probes the chain's first
        file when its measurement is stale, and every restore that runs measures itself).
        """
        timer = DeviceTimer(self.engine.device).start()  # restore_ms counts the copies into the pool done
        res = RestoreResult()
        limit = len(token_ids) - (0 if whole else 1)
        rows = self.find(token_ids)
        have = seq.num_computed
        todo, start = [], 0
        for row in rows:
            end = start + row.token_count
            if end > have and start < limit:
                todo.append((start, min(end, limit), row))
            start = end
        if not todo:
            return res
        first, end = max(todo[0][0], have), todo[-1][1]
        nbytes = sum(r.bytes for _, _, r in todo)
        # the whole chain's reads start now: a probe of the first file (a fresh process's first restore) then
        # runs beside them instead of before them
        advise_will_read(row.path for _, _, row in todo)
        try:
            read_speed = self.read_speed.current(todo[0][2].path)
        except OSError:  # no speed to judge by: the read below finds the file missing or bad and drops it
            read_speed = None
        spared = end - min(first, have if recompute_from is None else recompute_from)
        if read_speed is not None and not restore_pays(nbytes, spared, read_speed, self.engine.prefill_tokens_per_s):
            res.miss_reason = "recomputing is faster than reading from disk"
            return res
        pool, blocks = self.engine.pool, self.engine.blocks
        # the dense copy is the read path of torch-layer chunks: filled here unless what follows is at most a short
        # chunk that reads the pool (Engine.runs_compiled: a question) or unknown yet (``whole``); a longer chunk
        # later makes it catch up from the pool (DenseKV.sync)
        tail = len(token_ids) - end
        dense = self.engine.dense
        if self.engine.compiled_decode is not None and (whole or tail <= COMPILED_LAYER_MAX_TOKENS):
            dense = None
        sink = self.engine.sink_kv(token_ids[0]) if dense is not None and self.engine.exact_sink else None
        self.engine.prepare_write(seq, first, end, dense, sink)
        staging = threading.local()
        capacity = self.layout.data_bytes(max(r.token_count for _, _, r in todo))  # read_chunk checks the counts
        copies = DeviceCopies(pool.k.device)
        taken: list[torch.Tensor] = []  # the CPU staging buffers this restore's readers hold, given back at its end

        @inference()  # a reader thread of its own: the dense copy may be an inference tensor, updated in place here
        def load(a: int, b: int, row: ChunkRow) -> None:
            if not hasattr(staging, "buf"):
                if copies.cuda:
                    staging.buf = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
                else:
                    try:
                        staging.buf = self._cpu_staging.get_nowait()
                    except queue.Empty:  # more readers than when this object was made
                        staging.buf = torch.empty(self.layout.data_bytes(CHUNK_TOKENS), dtype=torch.uint8)  # kept: any chunk fits
                    taken.append(staging.buf)
                staging.lane = copies.lane()
            lo = max(a, first)
            staging.lane.wait_buffer_free()  # the previous chunk's copy out of this buffer is done
            data = read_row(row, self.layout, out=staging.buf)  # checksum verified on these host bytes
            with staging.lane:  # CUDA: a side stream, non-blocking copies from the pinned buffer
                _write_tokens(pool, blocks, seq, data, lo - a, lo, b)
            if dense is not None:  # the CPU read path's copy, from the chunk itself: no read-back from the pool
                dense.fill(lo, data, lo - a, b - lo)

        last = first
        _READERS.acquire()  # the readers' thread setting is also the default of threads started meanwhile
        threads = torch.get_num_threads()
        try:
            # several files in flight: reads overlap checksums and faults. Each reader runs its copies on one
            # thread: the readers already fill the cores, and a pool of OpenMP workers per reader would oversubscribe
            # them (kvchat.cpu_threads.on_own_thread); measured, 4,096 tokens warm: 58-64 ms median vs 67-77 ms
            readers = _reader_count()
            with ThreadPoolExecutor(readers, initializer=torch.set_num_threads, initargs=(1,)) as ex:
                futures = [ex.submit(load, *item) for item in todo]
                for k, ((_, b, row), fut) in enumerate(zip(todo, futures)):
                    try:
                        fut.result()
                    except CorruptChunkError as exc:
                        for f in futures:
                            f.cancel()
                        # the chunks after it in the chain were not (all) verified and are recomputed now: drop
                        # them too, so this turn's snapshot rewrites them instead of keeping a bad file
                        for _, _, later in todo[k:]:
                            delete_chunk(get_db(), later.key)
                        res.miss_reason = f"{exc.kind} chunk dropped and recomputed"
                        break
                    last = b
                    res.bytes_read += row.bytes
                    res.keys.append(row.key)
        finally:
            for buf in taken:
                self._cpu_staging.put(buf)
            torch.set_num_threads(threads)
            _READERS.release()
        copies.join()  # the main stream waits for every side stream's copies before the pool is read
        if last == first:
            return res
        blocks.commit(seq, token_ids, last)
        if dense is not None:
            dense.finish(seq, last)
        if self.touch_lru:
            self._queue.put(("touch", res.keys))  # LRU stamps: one commit, off the critical path
        res.from_disk = last - first
        res.restore_ms = timer.stop()
        if res.bytes_read > 1e6:
            self.read_speed.record(res.bytes_read, res.restore_ms / 1e3)
        return res

    # ---- save ----------------------------------------------------------------------------
    def save(self, seq: SeqBlocks, token_ids: Sequence[int], segment_ends: Sequence[int], owner: str | None) -> list[str]:
        """Queue the chain of ``seq``'s computed tokens for writing; returns its keys.

        Tails are stored at every ``segment_ends`` offset not beyond the
        computed tokens (e.g. the end of the documents' prefix) and at the end
        of the computed tokens. Pool bytes are copied now, written later.
        ``owner`` (a chat or document id) gets a reference on each key; keys
        it no longer uses are released (and deleted when nobody else uses them).
        """
        done = seq.num_computed
        ends = [e for e in segment_ends if 0 < e <= done] + [done]
        links = chain(self.fingerprint, token_ids, ends)
        db = get_db()
        new = [link for link in links if get_chunk(db, link.key) is None]
        sizes = [self.layout.data_bytes(link.end - link.start) for link in new]
        pins = [False] * len(new)
        if self.engine.pool.k.is_cuda:  # pinned host copies, while those still queued stay within the bound
            with self._pinned_lock:
                pins = pinned_chunks(sizes, self._pinned_bytes)
                self._pinned_bytes += sum(n for n, pin in zip(sizes, pins) if pin)
        for link, size, pin in zip(new, sizes, pins):
            chunk, copied = _read_tokens(self.engine.pool, self.engine.blocks, seq, link.start, link.end, pin)
            self._queue.put((link, chunk, copied, size if pin else 0))
        self._queue.put(("refs", owner, [link.key for link in links]))
        return [link.key for link in links]

    def add_refs(self, owner: str, keys: Sequence[str]) -> None:
        """Queue ``owner``'s references on ``keys`` (as :meth:`save` does), chunks a save already queued or
        indexed: no pool read, no file written (a pasted document's prefix inside the chat just saved).
        ``owner`` then references exactly these keys; those never written get no reference."""
        self._queue.put(("refs", owner, list(keys)))

    def writing(self) -> bool:
        """Whether queued writes (chunks, references, LRU stamps) are not all done yet."""
        return self._queue.unfinished_tasks > 0

    def flush(self) -> None:
        """Block until every queued write is on disk and indexed."""
        self._queue.join()

    def close(self) -> None:
        """Flush and stop the writer thread."""
        self.flush()
        self._queue.put(None)
        self._thread.join()

    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if item[0] == "touch":
                    touch(get_db(), item[1])
                elif item[0] == "refs":
                    if item[1] is not None:
                        chunk_refs.set_refs(get_db(), item[1], item[2], self.fingerprint)
                    self.evicted = self.evicted.then(enforce_budget(get_db()))
                else:
                    link, data, copied, pinned = item
                    try:
                        if copied is not None:  # the device -> pinned host copy, queued on the main stream
                            copied.synchronize()
                        if self._room_for(link):
                            add_chunk(get_db(), data, key=link.key, parent_key=link.parent_key,
                                      fingerprint=self.fingerprint)
                    finally:
                        data = item = None  # its pinned pages go back to torch's host cache, then the count
                        with self._pinned_lock:
                            self._pinned_bytes -= pinned
            except OSError as exc:  # disk full, permissions: the turn's text is already saved
                self._error(f"KV snapshot not saved: {exc.strerror or exc}")
            except Exception as exc:  # noqa: BLE001 - e.g. database locked past the busy timeout, a bad budget
                # setting: report it and keep serving the queue (a dead writer would hang flush() forever)
                self._error(f"KV snapshot not saved: {exc}")
            finally:
                self._queue.task_done()

    def _error(self, line: str) -> None:
        """Record ``line`` in :attr:`errors`, once when the same failure repeats (each chunk of a save, then its refs)."""
        if not self.errors or self.errors[-1] != line:
            self.errors.append(line)

    def _room_for(self, link: Link) -> bool:
        """Whether ``link``'s chunk may be written: its parent is indexed (else nothing could reach it) and,
        after evicting older chunks, it fits the disk budget and the disk's free floor
        (:func:`kvchat.engine.disk_budget.make_room`); a chunk that does not fit cuts the snapshot there
        (one line in :attr:`errors`: a resume recomputes the rest)."""
        db = get_db()
        if link.parent_key is not None and get_chunk(db, link.parent_key) is None:
            return False
        keep = with_ancestors(db, [link.parent_key]) if link.parent_key is not None else set()
        nbytes = self.layout.data_bytes(link.end - link.start) + CHUNK_HEADER_BYTES
        evicted, refused = make_room(db, nbytes, keep)
        self.evicted = self.evicted.then(evicted)
        if refused is not None:
            self._error(f"KV snapshot stopped at token {link.start:,}: {refused}; a resume recomputes the rest")
        return refused is None


def pinned_chunks(sizes: Sequence[int], in_flight: int, limit: int = SAVE_PINNED_BYTES) -> list[bool]:
    """Which chunks of a save (their bytes, in order) are copied into pinned host memory: each one that still
    fits, with the pinned bytes already queued (``in_flight``) and those chosen before it, within ``limit``;
    the others are copied into pageable memory (a synchronous copy, no page locked)."""
    out = []
    for n in sizes:
        pin = in_flight + n <= limit
        in_flight += n if pin else 0
        out.append(pin)
    return out


def _slots(blocks, seq: SeqBlocks, start: int, end: int) -> torch.Tensor:
    """:meth:`BlockManager.slots` as an int64 tensor ``[end - start]``."""
    return torch.tensor(blocks.slots(seq, start, end), dtype=torch.long)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``[layers, blocks, block_size, ...]`` -> ``[layers, slots, ...]`` (a view)."""
    return t.flatten(1, 2)


def _rows(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Views ``[layers, tokens, w]`` of ``[layers, tokens, ...]`` tensors in one integer dtype, as wide as all allow.

    CPU gather and index-put copy one element at a time, so moving a token's
    K row (192 bytes for SmolLM2) as 24 int64 instead of 192 uint8 is what
    makes a restore fast (measured, 4096 tokens, one thread: the pool copy
    took 134 ms as uint8, 23 ms as int64).
    """
    flat = [t.flatten(2).view(torch.uint8) for t in tensors]
    for dtype in (torch.int64, torch.int32, torch.int16):
        if all(f.shape[-1] % dtype.itemsize == 0 and f.storage_offset() % dtype.itemsize == 0 for f in flat):
            return [f.view(dtype) for f in flat]
    return flat


def _read_tokens(pool: KVPool, blocks, seq: SeqBlocks, start: int, end: int,
                 pin: bool = True) -> tuple[ChunkData, object]:
    """Copy tokens ``[start, end)`` of ``seq`` out of the pool as a chunk (all layers).

    Returns ``(chunk, copied)``: on CUDA with ``pin`` the chunk's tensors are pinned host memory filled by
    non-blocking copies queued on the current stream (after every write before them), and ``copied`` is the
    CUDA event the writer thread waits on before it reads them, so the main thread never waits; otherwise
    (a CPU pool, or ``pin`` false: pageable memory, the main thread waits for the copy) ``copied`` is None
    and the copy is done.
    """
    slots = _slots(blocks, seq, start, end).to(pool.k.device)
    pinned = pin and pool.k.is_cuda

    def take(t: torch.Tensor) -> torch.Tensor:
        (rows,) = _rows(_flat(t))
        rows = rows[:, slots]
        if pinned:
            rows = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True).copy_(rows, non_blocking=True)
        return rows.cpu().view(torch.uint8).view(t.dtype).view(t.shape[0], len(slots), *t.shape[3:])

    parts = (pool.k, pool.v) if pool.k_scale is None else (pool.k, pool.v, pool.k_scale, pool.v_scale)
    chunk = ChunkData(*(take(t) for t in parts))
    copied = None
    if pinned:
        copied = torch.cuda.Event()
        copied.record()
    return chunk, copied


def _write_tokens(pool: KVPool, blocks, seq: SeqBlocks, data: ChunkData, offset: int, start: int, end: int) -> None:
    """Copy chunk rows ``offset..`` into ``seq``'s slots for tokens ``[start, end)`` (the caller marks the blocks
    written; several threads may write disjoint slots at once)."""
    slots = _slots(blocks, seq, start, end).to(pool.k.device)
    n = end - start
    for dst, src in ((pool.k, data.k), (pool.v, data.v), (pool.k_scale, data.k_scale), (pool.v_scale, data.v_scale)):
        if dst is None:
            continue
        rows_dst, rows_src = _rows(_flat(dst), src[:, offset : offset + n])
        rows_dst[:, slots] = rows_src.to(dst.device, non_blocking=True)  # CUDA: from pinned memory, on the lane


def release_owner(owner: str) -> list[str]:
    """Drop all of ``owner``'s chunk references in the data dir's index; returns the keys deleted because
    nobody else used them (:func:`kvchat.store.chunk_refs.release_owner`)."""
    return chunk_refs.release_owner(get_db(), owner)
