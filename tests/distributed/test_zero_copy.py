"""Zero-copy messages on real spawned gloo ranks: a message that is one contiguous range of one
buffer in the wire dtype is sent straight from the source / received straight into the target.

Every case runs through one Transfer several times with fresh buffers, against the
independent references of tests/distributed/_scenarios.py (poisoned target padding, NaN
source padding, sources checked unchanged), and the reported zero-copy bytes are checked
against an element-by-element expectation computed from the schedule. A segment that is one
range of its source and of its target travels as a wire of its own: the planner's flag for
it is checked against both ends' element images, and both ends must flag it alike.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _workers as W  # noqa: E402

from tests._spawn import run_ranks  # noqa: E402

BUDGETS = [16, 1000, 64 << 20]


def _cases(world):
    r = list(range(world))
    cases = [
        # fp32 both sides: whole messages are one range on both sides at small budgets;
        # at 64 MiB a message spans several parameters and the reversed ranks break it up
        (("zero12", r), ("zero3", r[::-1]), "fp32", "fp32"),
        (("zero3", r), ("zero3", r[1:] + r[:1]), "fp32", "fp32"),  # the offload shape
        # many target storages and strided TP pieces: messages of several segments, some of
        # them contiguous alone (partly contiguous messages take the pack path)
        (("zero3", r), ("tp", [r]), "bf16", "bf16"),
        # bf16 on the wire from fp32 sources: sends are casts and never zero-copy
        (("zero3", r[:1]), ("zero3", r[1:]), "fp32", "bf16"),
        (("zero3", r[:1]), ("zero3", r[1:]), "fp32", "fp32"),  # the same without the cast
    ]
    return [c + (b,) for c in cases for b in BUDGETS]


@pytest.mark.parametrize("planner", ["real", "ref"])
def test_zero_copy_messages(tmp_path, planner):
    world, calls = 2, 3
    cases = _cases(world)
    res = run_ranks(W.w_zero_copy, world, tmp_path, args=(planner, cases, calls), timeout=240)
    errs = [e for r in res for case in r for e in case[0]]
    assert not errs, "\n".join(errs[:20])
    per = {repr(c): [res[rank][i] for rank in range(world)] for i, c in enumerate(cases)}
    # both kinds of message occur, so both paths (and their mix in one round) ran
    assert sum(x[2] for v in per.values() for x in v) > 0, "no zero-copy message at all"
    assert sum(x[3] for v in per.values() for x in v) > 0, "no partly contiguous message"
    if planner == "real":  # messages of several segments, some contiguous on both ends
        assert sum(x[8] for v in per.values() for x in v) > 0, "no message was cut into wires"
    received_directly = all_direct = 0
    for budget in BUDGETS:
        key = (("zero3", [0]), ("zero3", [1]), "fp32", "bf16", budget)
        sender, receiver = per[repr(key)]
        assert sender[1] == 0, f"a cast message went zero-copy (budget {budget})"
        received_directly += receiver[1]
        # without the cast every message of the sender that is one source range skips the
        # arena; when all of them do, no send arena is held at all
        sender, _ = per[repr(key[:3] + ("fp32", budget))]
        if sender[2] == sender[4]:
            assert sender[5] == 0, f"all sends zero-copy, yet {sender[5]} arena bytes held"
            all_direct += 1
    assert received_directly > 0, "bf16 targets never received a message directly"
    assert all_direct > 0, "no case where every send of a rank skipped the arena"
    # budget 16 B really cut the transfer into many tiny rounds
    assert per[repr(cases[0])][0][7] > 10
    # the arenas never exceed the plan's bound, and shrink when messages skip them
    assert all(x[5] <= x[6] for v in per.values() for x in v)
    assert any(x[5] < x[6] for v in per.values() for x in v)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_contiguous_segments_flagged_alike_on_both_ends(world):
    """No ranks needed: for layouts with replicas, idle ranks, reversed and TP targets, every
    segment's `contiguous` flag is true exactly where both ends' element images are one
    range in one dtype, and the two ends of each message flag it alike (they cut it into the
    same wires: a difference would pair receives with sends of another size)."""
    r = list(range(world))
    specs = [
        (("zero3", r), ("tp", [r[:2]])),
        (("zero12", r), ("tp", [r])),
        (("tp", [r]), ("zero3", r)),
        (("zero12", r), ("zero3", r[::-1])),
        (("rep", r[:2]), ("zero12", r)),  # two source replicas: the planner picks per element
        (("zero3", r), ("zero3", r[1:] + r[:1])),
    ]
    if world == 4:
        specs.append((("zero3", r), ("tp", [[0, 1], [2, 3]])))
    shapes = W.S.model_shapes()
    split = 0
    for src_spec, dst_spec in specs:
        for sdt, ddt in (("fp32", "fp32"), ("bf16", "bf16"), ("fp32", "bf16")):
            for budget in (16, 1000, 64 << 20):
                src, dst = W.build((src_spec, dst_spec, sdt, ddt), shapes)
                plan = W.make_plan("real", src.layout(), dst.layout(), budget)
                for rank in r:
                    *_, errs, n = W.expected_zero_copy(plan, rank, src.dtype, dst.dtype)
                    assert not errs, f"{src_spec} -> {dst_spec} {sdt}->{ddt} {budget}: {errs[:3]}"
                    split += n
    assert split > 0, "no message was cut into wires"


def test_wire_parts_cut_at_contiguous_segments():
    """The cut both ends of a message make: one wire per contiguous segment (its bytes only),
    one per run of the others (first start to last end, the padding inside it included), the
    whole message when nothing is contiguous or it has one segment."""
    import numpy as np
    import torch

    from reshard.planning.records import Message, Segment
    from reshard.rounds import wire_parts

    def seg(off, n, contiguous):
        return Segment(0, 1, torch.float32, off, n, np.zeros((0, 6), np.int64), contiguous)

    # [A 3 el, pad 4 B][B 4][C 2, pad 8 B][D 5]: A, C not contiguous; B, D contiguous
    segs = [seg(0, 3, False), seg(16, 4, True), seg(32, 2, False), seg(48, 5, True)]
    parts = wire_parts(Message(1, 0, 0, 68, segs[::-1]))  # any segment order
    assert [(p.lo, p.nbytes) for p in parts] == [(0, 12), (16, 16), (32, 8), (48, 20)]
    assert [[s.byte_offset for s in p.segments] for p in parts] == [[0], [0], [0], [0]]
    # two non-contiguous segments in a row travel together, the padding between them too
    segs = [seg(0, 3, False), seg(16, 2, False), seg(32, 4, True)]
    parts = wire_parts(Message(1, 0, 0, 48, segs))
    assert [(p.lo, p.nbytes) for p in parts] == [(0, 24), (32, 16)]
    assert [s.byte_offset for s in parts[0].segments] == [0, 16]
    # nothing contiguous, or a single segment: the whole message, trailing bytes included
    for segs in ([seg(0, 3, False), seg(16, 2, False)], [seg(0, 3, True)]):
        (part,) = wire_parts(Message(1, 0, 0, 32, segs))
        assert (part.lo, part.nbytes) == (0, 32)
