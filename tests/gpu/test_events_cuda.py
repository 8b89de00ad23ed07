"""reshard::event_record / event_wait: CUDA events and streams passed by handle order work as
torch's own `record` and `wait_event` do. Each ordering is checked against a writer held back by
a long sleep kernel, so a missing wait reads the old value. Skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch
from gpu_ref import require_cuda_build

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

require_cuda_build()

SLEEP_CYCLES = 200_000_000  # ~0.1 s: long enough that an unordered read runs first


def created_event():
    ev = torch.cuda.Event()
    ev.record()
    return ev


def slow_fill(stream, x, value):
    """On `stream`: sleep, then fill x with value (queued; returns at once)."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        x.fill_(value)


def test_event_wait_with_record_on_orders_the_current_stream_after_that_stream():
    dev = torch.cuda.current_device()
    side = torch.cuda.Stream()
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    slow_fill(side, x, 7.0)
    ev = created_event()
    torch.ops.reshard.event_wait(ev.cuda_event, dev, side.cuda_stream)
    seen = x.clone()  # on the current stream: after the fill only through the wait
    assert torch.equal(seen.cpu(), torch.full_like(seen, 7.0).cpu())


def test_event_wait_without_record_on_waits_for_the_event_as_recorded():
    dev = torch.cuda.current_device()
    side = torch.cuda.Stream()
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    slow_fill(side, x, 3.0)
    ev = created_event()
    ev.record(side)
    with torch.cuda.stream(side):
        x.fill_(5.0)  # queued after the record: the waiter need not wait for it
    torch.ops.reshard.event_wait(ev.cuda_event, dev)
    seen = x.clone()
    torch.cuda.synchronize()
    assert ((seen == 3.0) | (seen == 5.0)).all()  # never the 0 before the first fill
    assert torch.equal(x.cpu(), torch.full((1 << 20,), 5.0))


def test_event_record_on_the_current_stream_and_on_a_given_stream():
    dev = torch.cuda.current_device()
    side = torch.cuda.Stream()
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    slow_fill(torch.cuda.current_stream(), x, 2.0)
    ev = created_event()
    torch.ops.reshard.event_record(ev.cuda_event, dev)  # the current stream: after the fill
    side.wait_event(ev)
    with torch.cuda.stream(side):
        seen = x.clone()
    torch.cuda.synchronize()
    assert torch.equal(seen.cpu(), torch.full((1 << 20,), 2.0))

    slow_fill(side, x, 4.0)
    ev2 = created_event()
    torch.ops.reshard.event_record(ev2.cuda_event, dev, side.cuda_stream)
    torch.cuda.current_stream().wait_event(ev2)
    seen = x.clone()
    assert torch.equal(seen.cpu(), torch.full((1 << 20,), 4.0))


def test_event_ops_refuse_an_uncreated_event_and_an_unknown_device():
    dev = torch.cuda.current_device()
    with pytest.raises(RuntimeError, match="event 0: a torch.cuda.Event has no CUDA event"):
        torch.ops.reshard.event_wait(torch.cuda.Event().cuda_event, dev)
    with pytest.raises(RuntimeError, match="reshard::event_record: event 0"):
        torch.ops.reshard.event_record(0, dev)
    ev = created_event()
    n = torch.cuda.device_count()
    for op in ("event_record", "event_wait"):
        with pytest.raises(RuntimeError, match=f"reshard::{op}: device {n} is not a CUDA device"):
            getattr(torch.ops.reshard, op)(ev.cuda_event, n)
        with pytest.raises(RuntimeError, match=f"reshard::{op}: device -1 is not a CUDA device"):
            getattr(torch.ops.reshard, op)(ev.cuda_event, -1)
