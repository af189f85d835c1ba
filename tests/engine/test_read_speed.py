"""The read speed behind restore-vs-recompute (kvchat.engine.read_speed): measured by a timed probe of a real
file and by restores, never assumed, and probed again once stale, so a slow first measurement cannot switch
restores off for the rest of a long-lived process. Clocks are fake: no real timing."""

from __future__ import annotations

import pytest

from kvchat.engine.read_speed import PROBE_BYTES, STALE_S, ReadSpeed, probe_read, restore_pays

# Llama-3-8B with an fp8 pool: 32 layers x 8 KV heads x 128 x 2 (K, V) bytes + 32 x 8 x 2 fp32 scales per token
BYTES_PER_TOKEN_8B = 32 * 8 * 128 * 2 + 32 * 8 * 2 * 4
H200_PREFILL_8B = 20_000.0  # tokens/s of an 8B bf16 prefill chunk on an H200 (order of magnitude)


class Ticks:
    """A fake clock: returns ``now``; each call advances it by ``step`` (a read that takes ``step`` s)."""

    def __init__(self, now: float = 0.0, step: float = 0.0):
        self.now, self.step = now, step

    def __call__(self) -> float:
        t = self.now
        self.now += self.step
        return t


def test_probe_reads_the_first_bytes_of_a_real_file_and_times_them(tmp_path):
    small, big = tmp_path / "small", tmp_path / "big"
    small.write_bytes(b"x" * 1000)
    big.write_bytes(b"y" * (PROBE_BYTES + 5))
    assert probe_read(small, clock=Ticks(5.0, 0.25)) == (1000, 0.25)
    assert probe_read(big, clock=Ticks(0.0, 2.0)) == (PROBE_BYTES, 2.0)
    with pytest.raises(OSError):
        probe_read(tmp_path / "missing")


def test_no_assumed_speed_a_first_decision_probes(tmp_path):
    f = tmp_path / "chunk"
    f.write_bytes(b"\0" * 3000)
    probes = []
    speed = ReadSpeed(clock=Ticks(100.0), probe=lambda p: probes.append(p) or (3000, 0.001))
    assert speed.bytes_per_s is None
    assert speed.current(f) == pytest.approx(3e6)
    assert probes == [f]


def test_a_slow_measurement_is_probed_again_once_stale_so_restores_come_back():
    """A long-lived process on an H200: its first restore read a cold disk slowly (recompute wins); later the
    disk reads faster than an 8B prefill, and a restore is chosen again; then slower again, and it is not."""
    clock = Ticks(0.0)
    disk = {"bytes_per_s": 0.0}
    probes = []

    def probe(path):
        probes.append(path)
        return PROBE_BYTES, PROBE_BYTES / disk["bytes_per_s"]

    speed = ReadSpeed(clock=clock, probe=probe)
    tokens = 4096
    nbytes = tokens * BYTES_PER_TOKEN_8B
    breakeven = BYTES_PER_TOKEN_8B * H200_PREFILL_8B  # ~1.36 GB/s: faster disks restore, slower ones recompute

    def pays() -> bool:
        return restore_pays(nbytes, tokens, speed.current("snapshot"), H200_PREFILL_8B)

    speed.record(nbytes, nbytes / 0.3e9)  # the first restore, 300 MB/s off a cold disk
    clock.now = 10.0
    assert not pays() and probes == [], "a fresh measurement is used as is"
    disk["bytes_per_s"] = 3e9  # an NVMe, or the page cache, well above the break-even
    clock.now = 10.0 + STALE_S + 1
    assert pays(), "the stale slow measurement is probed again: restores are not switched off for good"
    assert probes == ["snapshot"] and speed.bytes_per_s == pytest.approx(3e9) and 3e9 > breakeven
    disk["bytes_per_s"] = 0.5e9
    clock.now += STALE_S / 2
    assert pays() and len(probes) == 1, "within the staleness window no probe"
    clock.now += STALE_S
    assert not pays() and len(probes) == 2, "a disk slower than recomputing is measured and recomputed"


def test_fixed_speed_never_probes():
    speed = ReadSpeed.fixed(float("inf"))
    speed.probe = None  # would raise if called
    assert speed.current("any") == float("inf")


@pytest.mark.parametrize("read_bytes_per_s, restore", [(2e9, True), (1e9, False)])
def test_restore_pays_compares_read_time_with_prefill_time(read_bytes_per_s, restore):
    # 4,096 tokens of an 8B fp8 chat: 276 MB; an H200 prefills them in 0.2 s; read at 2 GB/s 0.14 s, at 1 GB/s 0.28 s
    tokens = 4096
    assert restore_pays(tokens * BYTES_PER_TOKEN_8B, tokens, read_bytes_per_s, H200_PREFILL_8B) is restore


def test_an_empty_file_measures_nothing_and_never_stops_restores(tmp_path):
    """A probe of an empty (damaged) chunk file reads 0 bytes: no speed of 0 B/s is recorded (it divided by zero
    in the rule, then refused every restore until stale); the read drops the file instead."""
    empty = tmp_path / "chunk"
    empty.write_bytes(b"")
    speed = ReadSpeed(clock=Ticks(10.0, 0.001))
    assert speed.current(empty) is None
    speed.record(5_000_000, 0.001)
    speed.record(0, 0.001)  # a restore that read nothing
    assert speed.bytes_per_s == pytest.approx(5e9)
