"""The progress word ops (`reshard::progress_wait` / `progress_set`, csrc/progress.c): a thread
blocked in progress_wait (sleeping, or polling first) wakes when another publishes what it
needs, a negative value is final, a timeout returns the value as it is, and a malformed word or
an out-of-range timeout or poll is refused. CPU only."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import reshard  # noqa: F401  (registers the ops)

ops = torch.ops.reshard


def _word():
    return torch.zeros(4, dtype=torch.int64)


def test_wait_wakes_when_the_value_is_published():
    w = _word()
    got = []

    def waiter():
        got.append(ops.progress_wait(w, 100, 10_000_000))

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.05)
    ops.progress_set(w, 50)  # not enough: the waiter sleeps on
    time.sleep(0.05)
    assert not got
    t0 = time.perf_counter()
    ops.progress_set(w, 120)
    th.join(5)
    assert got == [120]
    assert time.perf_counter() - t0 < 2  # woken, not timed out


@pytest.mark.parametrize("spin_us", [0, 20_000, 100_000])
def test_a_polling_wait_returns_what_was_published(spin_us):
    """A waiter that polls first (spin_us) sees a value published while it polls or after it
    has gone to sleep; a poll longer than the timeout ends at the timeout."""
    w = _word()
    got = []

    def waiter():
        got.append(ops.progress_wait(w, 100, 10_000_000, spin_us))

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.03)  # within the longest poll, past the others
    ops.progress_set(w, 120)
    th.join(5)
    assert got == [120]
    t0 = time.perf_counter()
    assert ops.progress_wait(w, 200, 20_000, spin_us) == 120
    assert 0.019 <= time.perf_counter() - t0 < 1


def test_negative_value_is_final_and_timeouts_return_the_value():
    w = _word()
    ops.progress_set(w, 7)
    t0 = time.perf_counter()
    assert ops.progress_wait(w, 8, 50_000) == 7
    assert time.perf_counter() - t0 >= 0.045
    assert ops.progress_wait(w, 7, 0) == 7
    ops.progress_set(w, -1)
    assert ops.progress_wait(w, 1 << 40, 10_000_000) == -1


def test_wait_releases_the_gil():
    w = _word()
    ticks = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1

    th = threading.Thread(target=spin)
    th.start()
    ops.progress_wait(w, 1, 200_000)
    seen = ticks[0]
    stop.set()
    th.join()
    assert seen > 1000  # the other thread ran Python while this one waited


@pytest.mark.parametrize(
    "word",
    [
        torch.zeros(3, dtype=torch.int64),
        torch.zeros(4, dtype=torch.int32),
        torch.zeros(8, dtype=torch.int64)[::2],
        torch.zeros(5, dtype=torch.int64),
    ],
    ids=["short", "int32", "strided", "long"],
)
def test_malformed_words_are_refused(word):
    with pytest.raises(RuntimeError, match="progress must be a contiguous CPU int64 tensor"):
        ops.progress_wait(word, 1, 0)
    with pytest.raises(RuntimeError, match="progress must be a contiguous CPU int64 tensor"):
        ops.progress_set(word, 1)


def test_a_misaligned_word_is_refused():
    raw = bytearray(64)  # torch refuses misaligned views of its own storages; a buffer does not
    word = next(
        w
        for w in (torch.frombuffer(raw, dtype=torch.int64, count=4, offset=k) for k in (1, 3))
        if w.data_ptr() % 8
    )
    for call in (lambda: ops.progress_set(word, 7), lambda: ops.progress_wait(word, 1, 0)):
        with pytest.raises(RuntimeError, match="progress must be 8-byte aligned"):
            call()
    assert not any(raw)


def test_a_word_whose_storage_shrank_is_refused():
    base = torch.zeros(1 << 20, dtype=torch.int64)
    word = base[-4:]
    base.untyped_storage().resize_(8)
    for call in (lambda: ops.progress_set(word, 7), lambda: ops.progress_wait(word, 1, 0)):
        with pytest.raises(RuntimeError, match="progress needs 8388608 bytes of storage"):
            call()


def test_timeout_out_of_range_is_refused():
    with pytest.raises(RuntimeError, match="timeout_us"):
        ops.progress_wait(_word(), 1, -1)
    with pytest.raises(RuntimeError, match="timeout_us"):
        ops.progress_wait(_word(), 1, 1 << 60)
    with pytest.raises(RuntimeError, match="spin_us"):
        ops.progress_wait(_word(), 1, 0, -1)
    with pytest.raises(RuntimeError, match="spin_us"):
        ops.progress_wait(_word(), 1, 0, 100_001)
