"""`plan()` and the `Plan` it returns: the global pass, the rounds and the fingerprint, as
frozen data every rank computes alike. A rank's own work is `schedule(plan, rank)`."""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from .. import staging_bound
from ..errors import LayoutError
from ..layout import Layout
from .hashing import fingerprint
from .helpers import check_nbytes, check_rank
from .rank_schedule import rank_runs, schedule
from .records import ALIGN, I64, Jobs, RankSchedule, StorageIndex
from .rounds import Rounds, cut_rounds, per_peer_budget
from .totals import global_pass

# Budgets are byte counts held in int64 tables (and hashed as int64): anything at or above
# 2**62 is no limit at all next to the 2**53 elements a layout can hold, so it is refused.
MAX_BUDGET = 1 << 62


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """A deterministic transfer plan: replica choice, rounds, and what each rank needs to
    build its schedule. Every rank computes the same plan and the same `fingerprint` from the
    same layouts. Only global, small tables are kept (element totals per storage pair,
    segments, messages, the jobs of tensors with source replicas); the copy runs of one rank
    are built by `schedule(rank)` from the pieces on that rank's storages.

    Fields: the layouts `src`, `dst`; `tensors` (the target's tensor names, sorted) and
    `ndim` (the most dims of any of them); the budgets (`budget_bytes_per_peer` is the
    effective one); `storages` (both layouts' storages numbered); `direct[t]` (tensor t's
    source pieces do not overlap: its jobs are rebuilt per rank); `replicated_jobs` (the jobs
    of the other tensors, holders chosen); `rounds`; `num_jobs`; `fingerprint`.
    """

    src: Layout
    dst: Layout
    tensors: tuple
    ndim: int
    budget_bytes_per_peer: int
    budget_bytes_per_rank: int | None
    storages: StorageIndex
    direct: np.ndarray
    replicated_jobs: Jobs
    rounds: Rounds
    num_jobs: int
    fingerprint: str
    _cache: dict = dataclasses.field(default_factory=dict, repr=False)

    def __setstate__(self, state):
        # unpickled or deep-copied arrays are writable again: read-only, as plan() made them
        self.__dict__.update(state)
        _read_only(self.storages, self.direct, self.replicated_jobs, self.rounds)

    @property
    def num_rounds(self) -> int:
        return self.rounds.num_rounds

    def schedule(self, rank) -> RankSchedule:
        """`schedule(plan, rank)` (what `rank` does), built on first call and then cached."""
        rank = check_rank(rank)
        key = ("schedule", rank)
        if key not in self._cache:
            self._cache[key] = schedule(self, rank)
        return self._cache[key]

    def staging_bytes(self, rank, transport="nccl", host_ring_bytes=0) -> dict:
        """The exact staging the executor holds on `rank`, in bytes: `staging_bound.staging_bytes`
        of this rank's arena sizes (double buffering; each message is a run of 16-byte aligned
        segments, so its nbytes <= budget_bytes_per_peer rounded down to 16). Under
        ``transport="nccl"`` -> ``{"device": arenas, "host_pinned": host_ring_bytes, "host":
        0}``; under ``transport="gloo"`` -> ``{"device": 0, "host_pinned": 0, "host": arenas}``.
        Local copies stage nothing.
        """
        rank = check_rank(rank)
        host_ring_bytes = check_nbytes(host_ring_bytes, "host_ring_bytes")
        r = self.rounds
        return staging_bound.staging_bytes(
            self.num_rounds,
            r.send_arena.get(rank, 0),
            r.recv_arena.get(rank, 0),
            transport=transport,
            host_ring_bytes=host_ring_bytes,
        )

    @property
    def num_storage_pairs(self) -> int:
        """(source storage, target storage) pairs that exchange elements, local ones included."""
        return len(self.rounds.groups.src_loc) + len(self.rounds.local.rank)

    @property
    def runs(self) -> np.ndarray:
        """All copy runs, int64 [n, 8]: (src_location, src_offset, src_stride, dst_location,
        dst_offset, dst_stride, length, count), by sender rank, then (source storage, target
        storage). Materialized on first use from every rank's sender side: for tests and
        small plans; a large job only ever builds its own rank's runs (`schedule`)."""
        if "runs" not in self._cache:
            parts = [rank_runs(self, r)[0] for r in self.ranks()]
            self._cache["runs"] = np.concatenate([np.zeros((8, 0), I64), *parts], axis=1).T
        return self._cache["runs"]

    def ranks(self) -> list:
        """Every rank that owns a source or target storage."""
        return sorted(
            {s.rank for s in self.src.storages.values()}
            | {s.rank for s in self.dst.storages.values()}
        )

    def pair_bytes(self) -> dict:
        """{(sender, receiver): wire bytes} over all rounds (remote pairs only)."""
        g = self.rounds.groups
        out = {}
        for s, r, n, w in zip(
            g.sender.tolist(), g.receiver.tolist(), g.numel.tolist(), g.itemsize.tolist()
        ):
            out[(s, r)] = out.get((s, r), 0) + n * w
        return out

    def local_bytes(self) -> dict:
        """{rank: bytes copied locally (target dtype)}."""
        loc = self.rounds.local
        item = self.storages.dst_itemsize[loc.dst].tolist()
        out = {}
        for r, n, w in zip(loc.rank.tolist(), loc.numel.tolist(), item):
            out[r] = out.get(r, 0) + n * w
        return out

    def describe(self, max_pairs=16) -> str:
        """Human-readable: bytes per rank and per rank pair, rounds, staging per rank."""
        return _describe(self, max_pairs)

    def __repr__(self):
        return (
            f"Plan({len(self.tensors)} tensors, "
            f"{self.num_storage_pairs} storage pairs, "
            f"{self.num_rounds} rounds, fingerprint={self.fingerprint[:16]})"
        )


def _describe(p: Plan, max_pairs) -> str:
    pairs, local = p.pair_bytes(), p.local_bytes()
    sent, recv = {}, {}
    for (s, r), b in pairs.items():
        sent[s] = sent.get(s, 0) + b
        recv[r] = recv.get(r, 0) + b
    remote = sum(pairs.values())
    n_local, n_remote = len(p.rounds.local.rank), len(p.rounds.groups.src_loc)
    per_rank = (
        "" if p.budget_bytes_per_rank is None else f" (from {_fmt(p.budget_bytes_per_rank)}/rank)"
    )
    lines = [
        f"reshard plan {p.fingerprint[:16]}: {len(p.tensors)} tensors, "
        f"{n_local + n_remote} storage pairs ({n_local} local, {n_remote} remote), "
        f"budget {_fmt(p.budget_bytes_per_peer)}/peer{per_rank}, {p.num_rounds} rounds",
        f"bytes: local {_fmt(sum(local.values()))}, remote {_fmt(remote)} on the wire "
        f"over {len(pairs)} rank pairs",
    ]
    if sent:
        busiest = max(sorted(sent), key=lambda r: sent[r])
        lines.append(
            f"busiest sender: rank {busiest} sends {_fmt(sent[busiest])} (mean over "
            f"{len(sent)} senders {_fmt(remote // len(sent))})"
        )
    lines.append("rank   send        recv        local       staging(nccl device)")
    for rank in p.ranks():
        st = p.staging_bytes(rank)["device"]
        lines.append(
            f"{rank:<6} {_fmt(sent.get(rank, 0)):<11} {_fmt(recv.get(rank, 0)):<11} "
            f"{_fmt(local.get(rank, 0)):<11} {_fmt(st)}"
        )
    if pairs:
        m = p.rounds.messages
        rounds = {}
        for s, r, k in zip(m.sender.tolist(), m.receiver.tolist(), m.round.tolist()):
            rounds[(s, r)] = max(rounds.get((s, r), 0), k + 1)
        top = sorted(pairs, key=lambda q: (-pairs[q], q))[:max_pairs]
        lines.append(f"rank pairs (largest {len(top)} of {len(pairs)}):")
        for q in top:
            lines.append(f"  {q[0]} -> {q[1]}: {_fmt(pairs[q])} in {rounds[q]} rounds")
    return "\n".join(lines)


def _fmt(n):
    n = int(n)
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def plan(
    src: Layout,
    dst: Layout,
    budget_bytes_per_peer: int = 64 << 20,
    *,
    budget_bytes_per_rank: int | None = None,
) -> Plan:
    """Plan moving every tensor of `dst` from its layout in `src` (a subset of src's tensors).

    Each target element is read from exactly one source replica: one on the target's own
    rank when there is one, otherwise the replica whose rank has sent the fewest bytes so far
    (largest jobs first), so no single rank funnels the transfer. Every target replica is
    written. Runs are coalesced; messages per (sender, receiver) and round hold at most
    `budget_bytes_per_peer` bytes (16-byte aligned segments), a run larger than that is cut
    across rounds.

    `budget_bytes_per_rank` (optional) caps every rank's total staging instead: with many
    peers a per-peer budget multiplies (a rank of a 256-rank all-to-all holds up to
    2 * 2 * 255 * budget_bytes_per_peer of arenas). The per-peer budget then becomes
    ``min(budget_bytes_per_peer, floor16(budget_bytes_per_rank / (2 * P)))`` where P is the
    largest number of peers any rank sends to plus receives from, so that
    ``staging_bytes(rank)`` (arenas, double-buffered) is <= budget_bytes_per_rank on every
    rank; `plan.budget_bytes_per_peer` is that effective value. A cap that leaves less than
    16 bytes per peer is a ValueError.
    """
    budget_bytes_per_peer = _integral(budget_bytes_per_peer)
    budget_bytes_per_rank = _integral(budget_bytes_per_rank)
    names = _check_inputs(src, dst, budget_bytes_per_peer, budget_bytes_per_rank)
    dst.check_no_aliasing()
    ndim = max([1] + [len(src.tensors[n].shape) for n in names])
    index = StorageIndex.of(src, dst)
    tables = global_pass(src, dst, names, index, ndim)
    budget = budget_bytes_per_peer
    if budget_bytes_per_rank is not None:
        cap = per_peer_budget(
            index, tables.pair_src, tables.pair_dst, tables.pair_numel, budget_bytes_per_rank
        )
        if cap is not None:
            budget = min(budget, cap)
    try:
        rounds = cut_rounds(tables.pair_src, tables.pair_dst, tables.pair_numel, index, budget)
    except ValueError as e:
        if budget == budget_bytes_per_peer:
            raise
        raise ValueError(
            f"{e} (budget_bytes_per_rank={budget_bytes_per_rank} leaves this per-peer budget)"
        ) from None
    _read_only(index, tables.direct, tables.jobs, rounds)
    return Plan(
        src=src,
        dst=dst,
        tensors=tuple(names),
        ndim=ndim,
        budget_bytes_per_peer=budget,
        budget_bytes_per_rank=budget_bytes_per_rank,
        storages=index,
        direct=tables.direct,
        replicated_jobs=tables.jobs,
        rounds=rounds,
        num_jobs=tables.num_jobs,
        fingerprint=fingerprint(src, dst, names, budget, rounds, tables.jobs),
    )


def _read_only(*records):
    """Make every array inside `records` (arrays, tuples, dataclasses) read-only: a Plan is
    shared by every Transfer and schedule built from it."""
    for r in records:
        if isinstance(r, np.ndarray):
            r.flags.writeable = False
        elif isinstance(r, tuple):
            _read_only(*r)
        elif dataclasses.is_dataclass(r):
            _read_only(*(getattr(r, f.name) for f in dataclasses.fields(r)))


def _integral(value):
    """A numpy integer (a size read from an array) as an int; anything else as it is, for
    `_check_inputs` to judge."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
        return int(value)
    return value


def _check_inputs(src, dst, budget_bytes_per_peer, budget_bytes_per_rank) -> list:
    """The target's tensor names (sorted), after checking the arguments."""
    if not isinstance(src, Layout) or not isinstance(dst, Layout):
        raise LayoutError("plan(src, dst): both must be reshard.Layout")
    if isinstance(budget_bytes_per_peer, bool) or not isinstance(budget_bytes_per_peer, int):
        raise ValueError(f"budget_bytes_per_peer must be an int, got {budget_bytes_per_peer!r}")
    if not ALIGN <= budget_bytes_per_peer < MAX_BUDGET:
        raise ValueError(
            f"budget_bytes_per_peer must be >= {ALIGN} (one aligned segment) and below 2**62, "
            f"got {budget_bytes_per_peer}"
        )
    names = sorted(dst.tensors)
    for name in names:
        if name not in src.tensors:
            raise LayoutError(f"target tensor {name!r} has no source (not in the source layout)")
        if src.tensors[name].shape != dst.tensors[name].shape:
            raise LayoutError(
                f"tensor {name!r}: source shape {src.tensors[name].shape} != target shape "
                f"{dst.tensors[name].shape}"
            )
    if budget_bytes_per_rank is not None and (
        isinstance(budget_bytes_per_rank, bool) or not isinstance(budget_bytes_per_rank, int)
    ):
        raise ValueError(f"budget_bytes_per_rank must be an int, got {budget_bytes_per_rank!r}")
    if budget_bytes_per_rank is not None and not 0 <= budget_bytes_per_rank < MAX_BUDGET:
        raise ValueError(
            f"budget_bytes_per_rank must be in 0 .. 2**62, got {budget_bytes_per_rank}"
        )
    return names
