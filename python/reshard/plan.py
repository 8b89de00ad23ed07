"""Planning: intersect two layouts into copy runs, pick replicas, cut rounds. Pure data.

`plan()` keeps only global, small tables: element totals per (source storage, target
storage) pair, the replica choice for tensors whose source has replicas, rounds, segments
and messages. `Plan.schedule(rank)` builds that rank's copy runs (numpy arrays, one row per
run) from the pieces on its storages, lazily, in an element order both ends of a pair
derive alike. See docs/planning.md for the algorithm and docs/internals.md for the
schedule contract.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import torch

from .errors import LayoutError
from .layout import Layout

__all__ = ["LocalCopy", "Message", "Plan", "RankSchedule", "Segment", "plan"]

_I64 = np.int64
_ALIGN = 16
# Budgets are byte counts held in int64 tables (and hashed as int64): anything at or above
# 2**62 is no limit at all next to the 2**53 elements a layout can hold, so it is refused.
_MAX_BUDGET = 1 << 62
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# Jobs (piece intersections) are processed in batches of about this many source pieces so
# that peak memory stays bounded on models with millions of pieces.
_BATCH_PIECES = 1 << 15

# Run table columns.
SL, SO, SS, DL, DO, DS, LEN, CNT = range(8)


def wire_dtype(src: torch.dtype, dst: torch.dtype) -> torch.dtype | None:
    """The dtype a (source storage, target storage) pair travels in, or None if unsupported.

    Equal dtypes travel as themselves; fp32 with bf16/fp16 travels as the 16-bit one (narrow
    on the sender, widen on the receiver); fp16<->bf16 travels as the target dtype.
    """
    if src == dst:
        return src
    if src in _FLOATS and dst in _FLOATS:
        if src == torch.float32:
            return dst
        if dst == torch.float32:
            return src
        return dst
    return None


@dataclasses.dataclass(frozen=True, eq=False)
class LocalCopy:
    """Runs whose source and target storages both belong to this rank: desc src -> dst."""

    src_location: int
    dst_location: int
    desc: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class Segment:
    """A 16-byte aligned piece of a message holding `numel` elements of `wire_dtype`.

    Sender: desc maps src storage -> segment. Receiver: desc maps segment -> dst storage.
    """

    src_location: int
    dst_location: int
    wire_dtype: torch.dtype
    byte_offset: int
    numel: int
    desc: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class Message:
    """One point-to-point message of a round at arena[arena_offset : arena_offset+nbytes]."""

    peer: int
    round: int
    arena_offset: int
    nbytes: int
    segments: list


@dataclasses.dataclass(eq=False)
class RankSchedule:
    rank: int
    num_rounds: int
    local: list
    sends: list
    recvs: list
    send_arena_bytes: int
    recv_arena_bytes: int


def _expand(counts):
    """For ranges of `counts`: (owner index, position within the range) of every element."""
    counts = np.asarray(counts, _I64)
    total = int(counts.sum())
    owner = np.repeat(np.arange(len(counts), dtype=_I64), counts)
    first = np.cumsum(counts) - counts
    return owner, np.arange(total, dtype=_I64) - first[owner]


def _segments_of(flags):
    """Start index of each maximal segment, given `flags[i]`: element i continues i-1."""
    n = len(flags)
    new = np.ones(n, bool)
    if n > 1:
        new[1:] = ~flags[1:]
    return np.nonzero(new)[0]


class Plan:
    """A deterministic transfer plan: replica choice, rounds, and per-rank schedules.

    Build it with `plan(src, dst, budget_bytes_per_peer)`. Every rank computes the same plan
    and the same `fingerprint` from the same layouts. `plan()` keeps only global, small
    tables (element totals per storage pair, segments, messages); the copy runs of one rank
    are built by `schedule(rank)`, from the pieces on that rank's storages.
    """

    def __init__(self, src, dst, budget, names, planner):
        self.src = src
        self.dst = dst
        self.budget_bytes_per_peer = budget
        self.budget_bytes_per_rank = None  # set by plan() when the caller capped the rank
        self._tensors = names
        self._planner = planner
        self._stats = planner.stats
        self._build_rounds(planner.pair_si, planner.pair_di, planner.pair_numel)
        self._cache = {}
        self._runs = None
        self.fingerprint = self._fingerprint()

    # -- global structure ------------------------------------------------------------------
    def _build_rounds(self, si, di, numel):
        """Groups (sender, receiver, src storage, dst storage) with their element totals ->
        segments and messages. `si`, `di` index the planner's sorted storage locations."""
        pl = self._planner
        snd, rcv = pl.s_rank[si], pl.d_rank[di]
        order = np.lexsort((di, si, rcv, snd))
        si, di, numel, snd, rcv = si[order], di[order], numel[order], snd[order], rcv[order]
        local = snd == rcv
        # local element totals per (rank, target storage), for local_bytes()
        self._local_groups = (snd[local], di[local], numel[local])
        r = ~local
        si, di, numel, snd, rcv = si[r], di[r], numel[r], snd[r], rcv[r]
        item = pl.wire_item[pl.s_cls[si], pl.d_cls[di]]
        self._g = dict(sl=pl.s_locs[si], dl=pl.d_locs[di], snd=snd, rcv=rcv, numel=numel, item=item)
        # group id of a storage pair (si * nD + di), for mapping one rank's runs to groups
        g_key = si * len(pl.d_locs) + di
        self._g_key_order = np.argsort(g_key, kind="stable")
        self._g_keys = g_key[self._g_key_order]
        self._wires = {}  # (src location, dst location) -> wire dtype, filled by schedule()

        # Cut each (sender, receiver) stream into rounds of at most `cap` bytes; every
        # segment starts 16-byte aligned inside its message.
        cap = self.budget_bytes_per_peer - self.budget_bytes_per_peer % _ALIGN
        segs = []  # (group, round, byte_offset, elem_lo, elem_hi)
        msgs = []  # (sender, receiver, round, nbytes)
        ng = len(numel)
        pair_new = np.ones(ng, bool)
        if ng > 1:
            pair_new[1:] = (snd[1:] != snd[:-1]) | (rcv[1:] != rcv[:-1])
        rnd = pos = 0
        snd_l, rcv_l = snd.tolist(), rcv.tolist()
        for g, (n, w, new) in enumerate(zip(numel.tolist(), item.tolist(), pair_new.tolist())):
            if new:
                if g:
                    msgs.append((snd_l[g - 1], rcv_l[g - 1], rnd, _align(pos)))
                rnd = pos = 0
            e = 0
            while e < n:
                start = _align(pos)
                room = (cap - start) // w
                if room <= 0:
                    msgs.append((snd_l[g], rcv_l[g], rnd, _align(pos)))
                    rnd, pos = rnd + 1, 0
                    continue
                take = min(n - e, room)
                segs.append((g, rnd, start, e, e + take))
                pos = start + take * w
                e += take
        if ng:
            msgs.append((snd_l[-1], rcv_l[-1], rnd, _align(pos)))
        self._segs = np.array(segs, _I64).reshape(-1, 5)
        m = np.array(msgs, _I64).reshape(-1, 4)
        self.num_rounds = int(m[:, 2].max()) + 1 if len(m) else 0
        # Arena offsets: within (rank, round), messages laid out by peer order.
        send_off = np.zeros(len(m), _I64)
        recv_off = np.zeros(len(m), _I64)
        self._send_arena = {}
        self._recv_arena = {}
        for who, off, arena in ((0, send_off, self._send_arena), (1, recv_off, self._recv_arena)):
            peer = m[:, 1 - who]
            o = np.lexsort((peer, m[:, 2], m[:, who]))
            if not len(o):
                continue
            w, r, nb = m[o, who], m[o, 2], m[o, 3]
            brk = np.ones(len(o), bool)
            brk[1:] = (w[1:] != w[:-1]) | (r[1:] != r[:-1])
            csum = np.cumsum(nb)
            base = np.maximum.accumulate(np.where(brk, csum - nb, 0))
            off[o] = csum - nb - base
            tot = csum - base
            for rank in np.unique(w).tolist():
                arena[rank] = int(tot[w == rank].max())
        self._msgs = np.column_stack([m, send_off, recv_off]) if len(m) else np.zeros((0, 6), _I64)

    def _fingerprint(self) -> str:
        """sha256 of a canonical encoding of the inputs (budget, storages, every tensor's
        pieces in name order) and of the global tables (groups, segments, messages, and the
        jobs of replicated-source tensors). Independent of Python's `hash` and of batching."""
        h = hashlib.sha256(b"reshard-plan-v2\0")

        def put(arr):
            a = np.asarray(arr)
            a = a.astype(a.dtype.newbyteorder("<") if a.size else "<i8", copy=False)
            a = np.ascontiguousarray(a)
            h.update(f"{a.dtype.str}{a.shape}".encode())
            if a.size:
                h.update(memoryview(a.reshape(-1)).cast("B"))

        put([self.budget_bytes_per_peer, self.num_rounds])
        names = self._tensors
        h.update("\0".join(names).encode())
        for layout in (self.src, self.dst):
            locs = sorted(layout.storages)
            put(locs)
            put([[layout.storages[x].rank, layout.storages[x].numel] for x in locs])
            h.update("\0".join(str(layout.storages[x].dtype) for x in locs).encode())
            tls = [layout.tensors[n] for n in names]
            put([len(tl.shape) for tl in tls])
            put([x for tl in tls for x in tl.shape])
            put([len(tl) for tl in tls])
            # one sha256 per field, all fed in one pass over chunks of tensors
            fields = [hashlib.sha256() for _ in range(5)]
            for c in range(0, len(tls), 4096):
                arrs = [tl._arrays() for tl in tls[c : c + 4096]]
                for k, fh in enumerate(fields):
                    a = np.concatenate([x[k].ravel() for x in arrs]).astype("<i8", copy=False)
                    fh.update(memoryview(a).cast("B"))
            for fh in fields:
                h.update(fh.digest())
        g = self._g
        for k in ("sl", "dl", "snd", "rcv", "numel", "item"):
            put(g[k])
        put(np.column_stack(self._local_groups) if len(self._local_groups[0]) else [])
        put(self._segs)
        put(self._msgs)
        put(self._planner.table)
        return h.hexdigest()

    # -- public surface --------------------------------------------------------------------
    def staging_bytes(self, rank, transport="nccl", host_ring_bytes=0) -> dict:
        """The exact staging the executor holds on `rank`, in bytes.

        Formula (double buffering): ``arenas = min(2, num_rounds) * (send_arena_bytes +
        recv_arena_bytes)`` where ``send_arena_bytes`` is the max over rounds of the bytes
        this rank sends in that round (sum over peers of each message's nbytes; each message
        is a run of 16-byte aligned segments, so nbytes <= budget_bytes_per_peer rounded down
        to 16) and ``recv_arena_bytes`` likewise for what it receives. The arenas live on the
        transport's device: ``transport="nccl"`` -> ``{"device": arenas, "host_pinned":
        host_ring_bytes, "host": 0}``; ``transport="gloo"`` -> ``{"device": 0, "host_pinned":
        0, "host": arenas}``. Local copies stage nothing.
        """
        if transport not in ("nccl", "gloo"):
            raise ValueError(f"transport must be 'nccl' or 'gloo', got {transport!r}")
        arenas = min(2, self.num_rounds) * (
            self._send_arena.get(rank, 0) + self._recv_arena.get(rank, 0)
        )
        if transport == "nccl":
            return {"device": arenas, "host_pinned": int(host_ring_bytes), "host": 0}
        return {"device": 0, "host_pinned": 0, "host": arenas}

    @property
    def num_storage_pairs(self) -> int:
        """(source storage, target storage) pairs that exchange elements, local ones included."""
        return len(self._g["sl"]) + len(self._local_groups[0])

    @property
    def runs(self) -> np.ndarray:
        """All copy runs, int64 [n, 8]: (src_location, src_offset, src_stride, dst_location,
        dst_offset, dst_stride, length, count), by sender rank, then (source storage, target
        storage). Materialized on first use from every rank's sender side: for tests and
        small plans; a large job only ever builds its own rank's runs (`schedule`)."""
        if self._runs is None:
            parts = [self._planner.rank_runs(r)[0] for r in self.ranks()]
            self._runs = np.concatenate([np.zeros((8, 0), _I64), *parts], axis=1).T
        return self._runs

    def ranks(self) -> list:
        """Every rank that owns a source or target storage."""
        return sorted(
            {s.rank for s in self.src.storages.values()}
            | {s.rank for s in self.dst.storages.values()}
        )

    def pair_bytes(self) -> dict:
        """{(sender, receiver): wire bytes} over all rounds (remote pairs only)."""
        g = self._g
        out = {}
        for s, r, n, w in zip(
            g["snd"].tolist(), g["rcv"].tolist(), g["numel"].tolist(), g["item"].tolist()
        ):
            out[(s, r)] = out.get((s, r), 0) + n * w
        return out

    def local_bytes(self) -> dict:
        """{rank: bytes copied locally (target dtype)}."""
        rank, di, numel = self._local_groups
        out = {}
        for r, n, item in zip(rank.tolist(), numel.tolist(), self._planner.d_item[di].tolist()):
            out[r] = out.get(r, 0) + n * item
        return out

    def describe(self, max_pairs=16) -> str:
        pairs = self.pair_bytes()
        local = self.local_bytes()
        sent, recv = {}, {}
        for (s, r), b in pairs.items():
            sent[s] = sent.get(s, 0) + b
            recv[r] = recv.get(r, 0) + b
        remote = sum(pairs.values())
        n_local, n_remote = len(self._local_groups[0]), len(self._g["sl"])
        lines = [
            f"reshard plan {self.fingerprint[:16]}: {len(self._tensors)} tensors, "
            f"{n_local + n_remote} storage pairs ({n_local} local, {n_remote} remote), "
            f"budget {_fmt(self.budget_bytes_per_peer)}/peer"
            + (
                f" (from {_fmt(self.budget_bytes_per_rank)}/rank)"
                if self.budget_bytes_per_rank is not None
                else ""
            )
            + f", {self.num_rounds} rounds",
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
        for rank in self.ranks():
            st = self.staging_bytes(rank)["device"]
            lines.append(
                f"{rank:<6} {_fmt(sent.get(rank, 0)):<11} {_fmt(recv.get(rank, 0)):<11} "
                f"{_fmt(local.get(rank, 0)):<11} {_fmt(st)}"
            )
        if pairs:
            rounds = {}
            for s, r, k in self._msgs[:, :3].tolist():
                rounds[(s, r)] = max(rounds.get((s, r), 0), k + 1)
            top = sorted(pairs, key=lambda p: (-pairs[p], p))[:max_pairs]
            lines.append(f"rank pairs (largest {len(top)} of {len(pairs)}):")
            for p in top:
                lines.append(f"  {p[0]} -> {p[1]}: {_fmt(pairs[p])} in {rounds[p]} rounds")
        return "\n".join(lines)

    def __repr__(self):
        return (
            f"Plan({len(self._tensors)} tensors, "
            f"{self.num_storage_pairs} storage pairs, "
            f"{self.num_rounds} rounds, fingerprint={self.fingerprint[:16]})"
        )

    # -- per rank --------------------------------------------------------------------------
    def schedule(self, rank) -> RankSchedule:
        """What `rank` does: local copies, and per round the messages it sends/receives.
        Built on first call from the pieces on this rank's storages only, then cached."""
        rank = int(rank)
        if rank in self._cache:
            return self._cache[rank]
        out_runs, in_runs = self._planner.rank_runs(rank)
        pl = self._planner
        d_rank = pl.d_rank[_lookup(pl.d_locs, out_runs[DL], _I64)]
        is_local = d_rank == rank
        local = []
        runs = out_runs[:, is_local]
        if runs.shape[1]:
            # runs are sorted by (source storage, target storage): one LocalCopy per pair
            starts = _segments_of(_rows_equal(runs[SL], runs[DL]))
            for a, b in zip(starts.tolist(), np.append(starts[1:], runs.shape[1]).tolist()):
                desc = np.ascontiguousarray(runs[[SO, SS, DO, DS, LEN, CNT], a:b].T)
                local.append(LocalCopy(int(runs[SL, a]), int(runs[DL, a]), desc))
        sends = self._messages(rank, True, out_runs[:, ~is_local])
        recvs = self._messages(rank, False, in_runs)
        sched = RankSchedule(
            rank=rank,
            num_rounds=self.num_rounds,
            local=local,
            sends=sends,
            recvs=recvs,
            send_arena_bytes=self._send_arena.get(rank, 0),
            recv_arena_bytes=self._recv_arena.get(rank, 0),
        )
        self._cache[rank] = sched
        return sched

    def _wire(self, sl, dl):
        w = self._wires.get((sl, dl))
        if w is None:
            w = wire_dtype(self.src.storages[sl].dtype, self.dst.storages[dl].dtype)
            self._wires[(sl, dl)] = w
        return w

    def _messages(self, rank, sender_side, runs):
        """This rank's messages of one side; `runs` are its remote runs of that side, sorted
        by (source storage, target storage) and, inside a pair, in stream order."""
        out = [[] for _ in range(self.num_rounds)]
        g = self._g
        ng = len(g["sl"])
        gsel = np.nonzero((g["snd"] if sender_side else g["rcv"]) == rank)[0]
        # group of each run, and the stream position of each group's first run
        pl = self._planner
        key = _lookup(pl.s_locs, runs[SL], _I64) * len(pl.d_locs)
        key += _lookup(pl.d_locs, runs[DL], _I64)
        at = np.minimum(np.searchsorted(self._g_keys, key), max(ng - 1, 0))
        if runs.shape[1] and (not ng or (self._g_keys[at] != key).any()):
            raise RuntimeError(f"reshard internal error: rank {rank} has runs of no group")
        run_g = self._g_key_order[at]
        rnum = runs[LEN] * runs[CNT]
        rpos = np.cumsum(rnum) - rnum
        brk = _segments_of(_rows_equal(run_g))
        pos0 = np.zeros(ng, _I64)
        pos0[run_g[brk]] = rpos[brk]
        # Both ends rebuilt their runs independently; they must add up to the global totals
        have = np.zeros(ng, _I64)
        if len(brk):
            have[run_g[brk]] = np.add.reduceat(rnum, brk)
        want = np.zeros(ng, _I64)
        want[gsel] = g["numel"][gsel]
        if (have != want).any():
            raise RuntimeError(
                f"reshard internal error: rank {rank}'s runs disagree with the plan's totals"
            )
        if not len(gsel):
            return out
        segs = self._segs[np.isin(self._segs[:, 0], gsel)]
        descs = self._slice(segs, sender_side, runs, rpos, rnum, pos0)
        m = self._msgs
        col = 0 if sender_side else 1
        msel = np.nonzero(m[:, col] == rank)[0]
        by_key = {}
        for s, (grp, rnd, boff, lo, hi) in enumerate(segs.tolist()):
            peer = int(g["rcv"][grp] if sender_side else g["snd"][grp])
            seg = Segment(
                int(g["sl"][grp]),
                int(g["dl"][grp]),
                self._wire(int(g["sl"][grp]), int(g["dl"][grp])),
                boff,
                hi - lo,
                descs[s],
            )
            by_key.setdefault((peer, rnd), []).append(seg)
        for i in msel.tolist():
            snd, rcv, rnd, nbytes, soff, roff = m[i].tolist()
            peer = rcv if sender_side else snd
            out[rnd].append(
                Message(
                    peer, rnd, soff if sender_side else roff, nbytes, by_key.get((peer, rnd), [])
                )
            )
        for lst in out:
            lst.sort(key=lambda msg: msg.peer)
        return out

    def _slice(self, segs, sender_side, runs, rpos, rnum, pos0):
        """Per segment, the desc of the run pieces falling in its element range."""
        grp = segs[:, 0]
        glo = pos0[grp] + segs[:, 3]
        ghi = pos0[grp] + segs[:, 4]
        first = np.searchsorted(rpos + rnum, glo, side="right")
        last = np.searchsorted(rpos, ghi, side="left")
        owner, k = _expand(last - first)
        ri = first[owner] + k
        run = np.take(runs, ri, axis=1).T
        p0 = rpos[ri]
        lo = np.maximum(glo[owner], p0) - p0  # element range inside the run
        hi = np.minimum(ghi[owner], p0 + rnum[ri]) - p0
        L = run[:, LEN]
        pieces = []
        # head: partial first row
        r0, c0 = lo // L, lo % L
        m = c0 != 0
        ln = np.minimum(L - c0, hi - lo)
        pieces.append((m, r0, c0, ln, np.ones_like(L), lo))
        # body: whole rows
        ra = -(-lo // L)
        rb = hi // L
        m = rb > ra
        pieces.append((m, ra, np.zeros_like(L), L, rb - ra, ra * L))
        # tail: partial last row
        m = (hi % L != 0) & (rb >= ra)
        pieces.append((m, rb, np.zeros_like(L), hi % L, np.ones_like(L), rb * L))
        rows = []
        for m, row, col, ln, cnt, q in pieces:
            i = np.nonzero(m)[0]
            r = run[i]
            so = r[:, SO] + row[i] * r[:, SS] + col[i]
            do = r[:, DO] + row[i] * r[:, DS] + col[i]
            spos = p0[i] + q[i] - glo[owner[i]]  # position inside the segment
            one = cnt[i] == 1
            if sender_side:
                d = np.column_stack(
                    [
                        so,
                        np.where(one, ln[i], r[:, SS]),
                        spos,
                        np.where(one, ln[i], L[i]),
                        ln[i],
                        cnt[i],
                    ]
                )
            else:
                d = np.column_stack(
                    [
                        spos,
                        np.where(one, ln[i], L[i]),
                        do,
                        np.where(one, ln[i], r[:, DS]),
                        ln[i],
                        cnt[i],
                    ]
                )
            rows.append((owner[i], spos, d))
        own = np.concatenate([r[0] for r in rows])
        pos = np.concatenate([r[1] for r in rows])
        desc = np.concatenate([r[2] for r in rows]).astype(_I64)
        o = np.lexsort((pos, own))
        own, desc = own[o], desc[o]
        bounds = np.searchsorted(own, np.arange(len(segs) + 1))
        return [np.ascontiguousarray(desc[bounds[s] : bounds[s + 1]]) for s in range(len(segs))]


def _wire_itemsize(src, dst):
    w = wire_dtype(src, dst)
    return 0 if w is None else w.itemsize  # 0: a pair no run uses (the planner checked)


def _lookup(sorted_keys, values, dtype):
    """Index of each value in `sorted_keys` (all present), as `dtype`: a direct table when
    the keys are small ints (storage locations usually are), else a binary search."""
    if len(sorted_keys) and 0 <= sorted_keys[0] and sorted_keys[-1] < 4 * len(sorted_keys) + 4096:
        table = np.zeros(int(sorted_keys[-1]) + 1, dtype)
        table[sorted_keys] = np.arange(len(sorted_keys), dtype=dtype)
        return table[values]
    return np.searchsorted(sorted_keys, values).astype(dtype)


def _align(x):
    return -(-x // _ALIGN) * _ALIGN


def _fmt(n):
    n = int(n)
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


# -- planning -------------------------------------------------------------------------------


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
    if not isinstance(src, Layout) or not isinstance(dst, Layout):
        raise LayoutError("plan(src, dst): both must be reshard.Layout")
    if isinstance(budget_bytes_per_peer, bool) or not isinstance(budget_bytes_per_peer, int):
        raise ValueError(f"budget_bytes_per_peer must be an int, got {budget_bytes_per_peer!r}")
    if not _ALIGN <= budget_bytes_per_peer < _MAX_BUDGET:
        raise ValueError(
            f"budget_bytes_per_peer must be >= {_ALIGN} (one aligned segment) and below 2**62, "
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
    if budget_bytes_per_rank is not None and not 0 <= budget_bytes_per_rank < _MAX_BUDGET:
        raise ValueError(
            f"budget_bytes_per_rank must be in 0 .. 2**62, got {budget_bytes_per_rank}"
        )
    dst._check_no_aliasing()
    planner = _Planner(src, dst, names).run()
    budget = budget_bytes_per_peer
    if budget_bytes_per_rank is not None:
        cap = _per_peer_budget(planner, budget_bytes_per_rank)
        if cap is not None:
            budget = min(budget, cap)
    p = Plan(src, dst, budget, names, planner)
    p.budget_bytes_per_rank = budget_bytes_per_rank
    return p


def _per_peer_budget(planner, budget_bytes_per_rank):
    """The per-peer budget that keeps every rank's double-buffered send + receive arenas
    within `budget_bytes_per_rank`: each arena holds at most one message per peer of at most
    the per-peer budget, so 2 * (send peers + receive peers) * per-peer <= the rank budget.
    None when no message crosses ranks (no arenas)."""
    snd = planner.s_rank[planner.pair_si]
    rcv = planner.d_rank[planner.pair_di]
    remote = (snd != rcv) & (planner.pair_numel > 0)
    pairs = np.unique(np.stack([snd[remote], rcv[remote]]), axis=1)
    if not pairs.shape[1]:
        return None  # nothing crosses ranks: nothing is staged
    # send peers + receive peers of each rank (pairs are unique)
    ranks, peers = np.unique(pairs.ravel(), return_counts=True)
    i = int(np.argmax(peers))
    rank, peers = int(ranks[i]), int(peers[i])
    per_peer = budget_bytes_per_rank // (2 * peers)
    per_peer -= per_peer % _ALIGN
    if per_peer < _ALIGN:
        raise ValueError(
            f"budget_bytes_per_rank={budget_bytes_per_rank} is too small for this plan: rank "
            f"{rank} exchanges messages with {peers} peers (send + receive), which needs at "
            f"least 2 * {peers} * {_ALIGN} = {2 * peers * _ALIGN} bytes (one 16-byte segment "
            "per peer, double buffered)"
        )
    return per_peer


class _Planner:
    """The geometry behind a Plan. `run()` is the global pass: it intersects every tensor's
    source regions with its target templates but keeps only element totals per (source
    storage, target storage) pair (and the jobs of tensors whose source has replicas, whose
    holder choice is global). `rank_runs(rank)` redoes the intersection for the pieces on
    one rank's storages and turns those jobs into runs."""

    def __init__(self, src, dst, names):
        self.src, self.dst, self.names = src, dst, names
        self.D = max([1] + [len(src.tensors[n].shape) for n in names])
        s_locs = sorted(src.storages)
        d_locs = sorted(dst.storages)
        self.s_locs = np.array(s_locs, _I64)
        self.d_locs = np.array(d_locs, _I64)
        self.s_rank = np.array([src.storages[x].rank for x in s_locs], _I64)
        self.d_rank = np.array([dst.storages[x].rank for x in d_locs], _I64)
        self.d_item = np.array([dst.storages[x].dtype.itemsize for x in d_locs], _I64)
        # dtype classes: few distinct dtypes, many storages
        sdt = sorted({s.dtype for s in src.storages.values()}, key=str)
        ddt = sorted({s.dtype for s in dst.storages.values()}, key=str)
        self.s_cls = np.array([sdt.index(src.storages[x].dtype) for x in s_locs], _I64)
        self.d_cls = np.array([ddt.index(dst.storages[x].dtype) for x in d_locs], _I64)
        self.wire_item = np.array([[_wire_itemsize(a, b) for b in ddt] for a in sdt], _I64).reshape(
            len(sdt), len(ddt)
        )
        self.bad_pair = self.wire_item == 0
        # replica balancing keeps the bytes each rank sends, indexed by the rank's position
        # among the ranks present (ranks are any int64, so not a table indexed by rank)
        ranks = np.unique(np.concatenate([self.s_rank, self.d_rank]))
        self.s_rid = np.searchsorted(ranks, self.s_rank)
        self.d_rid = np.searchsorted(ranks, self.d_rank)
        self.load = np.zeros(len(ranks), _I64)
        self.stats = {"jobs": 0}
        # direct[t]: tensor t's source pieces do not overlap (each element has one holder),
        # so its jobs are rebuilt per rank; the jobs of the others are kept in `table`
        self.direct = np.zeros(len(names), bool)
        self.table = np.zeros((0, 4 + 3 * self.D), _I64)
        nS, nD = len(s_locs), len(d_locs)
        self._dense = nS * nD <= 1 << 22
        self._acc = np.zeros(nS * nD if self._dense else 0, np.float64)
        self._acc_parts = []

    def _batches(self, tids):
        """Tensors in batches of about _BATCH_PIECES pieces, so temporaries stay small."""
        batches, cur, size = [], [], 0
        for t in tids:
            name = self.names[t]
            cur.append(t)
            size += len(self.src.tensors[name]) + len(self.dst.tensors[name])
            if size >= _BATCH_PIECES:
                batches.append(cur)
                cur, size = [], 0
        if cur:
            batches.append(cur)
        return batches

    # -- global pass -----------------------------------------------------------------------
    def run(self):
        table = []
        for b in self._batches(range(len(self.names))):
            rows = self._global_batch(b)
            if len(rows):
                table.append(rows)
        if table:
            self.table = np.concatenate(table)
        if self._dense:
            keys = np.nonzero(self._acc)[0]
            vals = self._acc[keys]
        elif self._acc_parts:
            k = np.concatenate([p[0] for p in self._acc_parts])
            v = np.concatenate([p[1] for p in self._acc_parts])
            keys, inv = np.unique(k, return_inverse=True)
            vals = np.bincount(inv, weights=v)
        else:
            keys, vals = np.zeros(0, _I64), np.zeros(0)
        nD = len(self.d_locs)
        self.pair_si, self.pair_di = keys // nD, keys % nD
        # float64 sums of integers below 2**53 are exact
        self.pair_numel = np.rint(vals).astype(_I64)
        self._acc = self._acc_parts = None
        return self

    def _add(self, si, di, numel, account):
        """Add element totals to storage pairs (si, di); `account`: count remote bytes in
        the senders' load (replica balancing)."""
        if not len(si):
            return
        nD = len(self.d_locs)
        key = si * nD + di
        if self._dense:
            delta = np.bincount(key, weights=numel, minlength=len(self._acc))
            self._acc += delta
            if account:
                key = np.nonzero(delta)[0]
                w = delta[key]
        else:
            key, inv = np.unique(key, return_inverse=True)
            w = np.bincount(inv, weights=numel)
            self._acc_parts.append((key, w))
        if account:  # per storage pair, not per job
            si, di = key // nD, key % nD
            snd = self.s_rid[si]
            remote = snd != self.d_rid[di]
            nbytes = (w * self.d_item[di])[remote]
            self.load += np.rint(np.bincount(snd[remote], nbytes, len(self.load))).astype(_I64)

    def _setup(self, tids):
        """Per-batch tensor tables: position of each global tensor id, dim-0 key base, numel."""
        D = self.D
        shapes = []
        for t in tids:
            shp = self.src.tensors[self.names[t]].shape
            shapes.append((1,) * (D - len(shp)) + tuple(shp))
        shapes = np.array(shapes, _I64).reshape(len(tids), D)
        tpos = np.zeros(max(tids) + 1, _I64)
        tpos[tids] = np.arange(len(tids))
        numel = shapes.prod(axis=1)
        # dim-0 key base per tensor, so one sorted sweep covers every tensor of the batch. An
        # empty tensor has no pieces here and takes no key range, so the bases stay within
        # the elements of the batch (below 2**53) however long its dim 0 is.
        dim0 = np.where(numel > 0, shapes[:, 0], 0)
        base = np.cumsum(dim0) - dim0
        return tpos, base, numel

    def _templates(self, d_ti, d_start, d_box, d_str):
        """Distinct target (box, strides) per tensor; replicas of a template differ only in
        storage and base offset. Returns (dorder, tstart, t_cnt)."""
        dorder = np.lexsort(
            tuple(d_str.T[::-1]) + tuple(d_box.T[::-1]) + tuple(d_start.T[::-1]) + (d_ti,)
        )
        tstart = _segments_of(
            _rows_equal(d_ti[dorder], d_start[dorder], d_box[dorder], d_str[dorder])
        )
        return dorder, tstart, np.diff(np.append(tstart, len(dorder)))

    def _global_batch(self, tids):
        tids = np.asarray(tids, _I64)
        tpos, base, numel = self._setup(tids)
        S = self._gather(self.src, tids)  # (tid, loc, off, start, box, strides)
        T = self._gather(self.dst, tids)
        s_ti, s_loc, s_start, s_box = tpos[S[0]], S[1], S[3], S[4]
        d_ti, d_loc, d_start, d_box = tpos[T[0]], T[1], T[3], T[4]
        svol = np.bincount(s_ti, weights=s_box.prod(axis=1).astype(np.float64), minlength=len(tids))
        direct = svol == numel
        self.direct[tids] = direct

        # -- source regions: distinct boxes, each with its replica holders ---------------
        # A direct tensor's pieces are its regions (one holder each); only the others are
        # grouped by box.
        dpc = np.nonzero(direct[s_ti])[0]
        rep = np.nonzero(~direct[s_ti])[0]
        order = rep[
            np.lexsort(tuple(s_box[rep].T[::-1]) + tuple(s_start[rep].T[::-1]) + (s_ti[rep],))
        ]
        rs_ = _segments_of(_rows_equal(s_ti[order], s_start[order], s_box[order]))
        hold = np.concatenate([dpc, order])  # holders of region r: hold[rstart[r] : +r_cnt[r]]
        rstart = np.concatenate([np.arange(len(dpc), dtype=_I64), len(dpc) + rs_])
        r_cnt = np.diff(np.append(rstart, len(hold)))
        r_ti = s_ti[hold[rstart]]
        r_lo = s_start[hold[rstart]]
        r_hi = r_lo + s_box[hold[rstart]]
        vol = np.bincount(
            r_ti, weights=(r_hi - r_lo).prod(axis=1).astype(np.float64), minlength=len(tids)
        )
        overlapping = np.nonzero(vol > numel)[0]
        if len(overlapping):
            r_ti, r_lo, r_hi, rstart, r_cnt = _disjoint_regions(
                overlapping, r_ti, r_lo, r_hi, rstart, r_cnt
            )

        # -- target templates, intersected with the source regions ------------------------
        dorder, tstart, t_cnt = self._templates(d_ti, d_start, d_box, T[5])
        first = dorder[tstart]
        t_ti, t_lo = d_ti[first], d_start[first]
        pr, pt, lo, hi = _intersect(base, r_ti, r_lo, r_hi, t_ti, t_lo, t_lo + d_box[first])
        self.stats["jobs"] += int(t_cnt[pt].sum())
        jvol = (hi - lo).prod(axis=1)
        d_idx = _lookup(self.d_locs, d_loc, _I64)
        s_idx = _lookup(self.s_locs, s_loc, _I64)

        # direct tensors: totals only. Jobs of a replicated template are summed per
        # (source storage, template) first, then multiplied out over the replicas.
        check = self.bad_pair.any()  # some storage pair has no wire dtype: name a tensor
        jd = direct[r_ti[pr]]
        jd = slice(None) if jd.all() else np.nonzero(jd)[0]
        pd = pr[jd]
        if len(pd):
            si, tj, vj = s_idx[hold[rstart[pd]]], pt[jd], jvol[jd]
            one = t_cnt[tj] == 1
            many = np.nonzero(~one)[0]
            if len(many):
                one = np.nonzero(one)[0]
                nT = len(tstart)
                u, inv = np.unique(si[many] * nT + tj[many], return_inverse=True)
                w = np.rint(np.bincount(inv, weights=vj[many])).astype(_I64)
                us, ut = u // nT, u % nT
                owner, k = _expand(t_cnt[ut])
                di = d_idx[dorder[tstart[ut[owner]] + k]]
                if check:
                    self._check_dtypes(us[owner], di, tids[t_ti[ut[owner]]])
                self._add(us[owner], di, w[owner], account=True)
                si, tj, vj, pd = si[one], tj[one], vj[one], pd[one]
            di = d_idx[first[tj]]
            if check:
                self._check_dtypes(si, di, tids[r_ti[pd]])
            self._add(si, di, vj, account=True)

        # replicated source: a holder per (job, target replica), kept as job rows
        c = np.nonzero(~direct[r_ti[pr]])[0]
        if not len(c):
            return np.zeros((0, 4 + 3 * self.D), _I64)
        owner, k = _expand(t_cnt[pt[c]])
        jr, jt = pr[c][owner], pt[c][owner]
        pj = dorder[tstart[jt] + k]
        jlo, jhi = lo[c][owner], hi[c][owner]
        if check:
            self._check_dtypes(s_idx[hold[rstart[jr]]], d_idx[pj], tids[r_ti[jr]])
        h = self._choose(jr, pj, jlo, jhi, rstart, r_cnt, hold, s_loc, d_loc)
        self._add(s_idx[h], d_idx[pj], (jhi - jlo).prod(axis=1), account=False)
        return _job_rows(h, pj, jlo, jhi, S, T)

    # -- one rank --------------------------------------------------------------------------
    def rank_runs(self, rank):
        """(out, in): this rank's runs as sender (local copies included) and as receiver of
        remote data, each int64 [8, n] sorted by (source storage, target storage) and, in a
        pair, by the target offset of each job's first element. That order depends only on
        the job set of the pair, which both ends build alike, so sender and receiver walk
        the same element sequence whatever else each of them sees."""
        s_mine = self.s_rank == rank
        d_mine = self.d_rank == rank
        out, inn = [], []
        for b in self._batches(np.nonzero(self.direct)[0].tolist()):
            o, i = self._rank_batch(np.asarray(b, _I64), s_mine, d_mine)
            out += o
            inn += i
        tab = self.table
        if len(tab):
            si = _lookup(self.s_locs, tab[:, 0], _I64)
            di = _lookup(self.d_locs, tab[:, 2 + self.D], _I64)
            out.append(tab[s_mine[si]])
            inn.append(tab[d_mine[di] & ~s_mine[si]])
        return self._to_runs(out), self._to_runs(inn)

    def _to_runs(self, parts):
        D = self.D
        rows = np.concatenate([np.zeros((0, 4 + 3 * D), _I64), *parts])
        o = np.lexsort((rows[:, 3 + D], rows[:, 2 + D], rows[:, 0]))
        r = rows[o].T
        runs = _box_runs(
            r[0], r[1], r[2 : 2 + D].T, r[2 + D], r[3 + D], r[4 + D : 4 + 2 * D].T, r[4 + 2 * D :].T
        )
        return _coalesce(runs)

    def _rank_batch(self, tids, s_mine, d_mine):
        tpos, base, _ = self._setup(tids)
        S = self._gather(self.src, tids)  # (tid, loc, off, start, box, strides)
        T = self._gather(self.dst, tids)
        s_ti, s_start, s_box = tpos[S[0]], S[3], S[4]
        d_ti, d_start, d_box = tpos[T[0]], T[3], T[4]
        mine_s = s_mine[_lookup(self.s_locs, S[1], _I64)]
        mine_d = d_mine[_lookup(self.d_locs, T[1], _I64)]
        out, inn = [], []
        a = np.nonzero(mine_s)[0]
        if len(a) and len(d_ti):
            # as sender: my pieces x every target template, multiplied out over replicas
            dorder, tstart, t_cnt = self._templates(d_ti, d_start, d_box, T[5])
            first = dorder[tstart]
            a_lo, t_lo = s_start[a], d_start[first]
            a_hi, t_hi = a_lo + s_box[a], t_lo + d_box[first]
            pa, pt, lo, hi = _intersect(base, s_ti[a], a_lo, a_hi, d_ti[first], t_lo, t_hi)
            owner, k = _expand(t_cnt[pt])
            pj = dorder[tstart[pt[owner]] + k]
            out.append(_job_rows(a[pa[owner]], pj, lo[owner], hi[owner], S, T))
        b = np.nonzero(mine_d)[0]
        mine_t = np.zeros(len(tids), bool)  # tensors with a target piece here
        mine_t[d_ti[b]] = True
        c = np.nonzero(~mine_s & mine_t[s_ti])[0]
        if len(b) and len(c):
            # as receiver: my target pieces x every source piece of another rank
            c_lo, b_lo = s_start[c], d_start[b]
            c_hi, b_hi = c_lo + s_box[c], b_lo + d_box[b]
            pc, pb, lo, hi = _intersect(base, s_ti[c], c_lo, c_hi, d_ti[b], b_lo, b_hi)
            inn.append(_job_rows(c[pc], b[pb], lo, hi, S, T))
        return out, inn

    def _gather(self, layout, tids):
        """Pieces of tensors `tids` stacked: (tid, loc, off, start, box, strides), dims padded
        in front to D (extent 1, stride 0); empty pieces dropped. One concatenation per
        ndim, so the cost per tensor is a list append, not numpy calls."""
        by_d = {}
        for t in tids.tolist():
            tl = layout.tensors[self.names[t]]
            by_d.setdefault(len(tl.shape), []).append((t, tl))
        parts = []
        for d, items in sorted(by_d.items()):
            arrs = [tl._arrays() for _, tl in items]
            cols = [np.concatenate([a[k] for a in arrs]) for k in range(5)]
            counts = np.array([len(tl._loc) for _, tl in items], _I64)
            tid = np.repeat(np.array([t for t, _ in items], _I64), counts)
            loc, off, start, box, strides = cols
            n = len(loc)
            start, box, strides = (a.reshape(n, d) for a in (start, box, strides))
            keep = (box > 0).all(axis=1)
            if keep.all():
                keep = slice(None)  # a view, not a copy
            pad = self.D - d

            def p(a, fill, keep=keep, pad=pad):
                a = a[keep]
                if pad:
                    a = np.concatenate([np.full((len(a), pad), fill, _I64), a], axis=1)
                return a

            parts.append((tid[keep], loc[keep], off[keep], p(start, 0), p(box, 1), p(strides, 0)))
        return [np.concatenate([pt[k] for pt in parts]) for k in range(6)]

    def _choose(self, pr, pj, lo, hi, rstart, r_cnt, hold, s_loc, d_loc):
        """Pick one source piece (holder) per job: local first, then least-loaded sender."""
        cnt = r_cnt[pr]
        h = hold[rstart[pr]].copy()
        srank = self.s_rid[np.searchsorted(self.s_locs, s_loc)]
        drank = self.d_rid[np.searchsorted(self.d_locs, d_loc)]
        jr = drank[pj]
        nbytes = (hi - lo).prod(axis=1) * self.d_item[np.searchsorted(self.d_locs, d_loc[pj])]
        single = cnt == 1
        remote1 = single & (srank[h] != jr)
        np.add.at(self.load, srank[h[remote1]], nbytes[remote1])
        multi = np.nonzero(~single)[0]
        if not len(multi):
            return h
        owner, k = _expand(cnt[multi])
        cand = hold[rstart[pr[multi]][owner] + k]
        is_local = srank[cand] == jr[multi][owner]
        # first local holder per job, if any
        first_local = np.full(len(multi), -1, _I64)
        li = np.nonzero(is_local)[0]
        uq, at = np.unique(owner[li], return_index=True)
        first_local[uq] = cand[li[at]]
        has = first_local >= 0
        h[multi[has]] = first_local[has]
        rem = multi[~has]
        if not len(rem):
            return h
        # greedy: largest jobs first, each to the holder rank with the least load so far
        o = np.lexsort((rem, -nbytes[rem]))
        rem = rem[o]
        load = self.load.tolist()
        holders_start = rstart[pr[rem]].tolist()
        holders_cnt = cnt[rem].tolist()
        hold_l = hold
        sr = srank
        nb = nbytes[rem].tolist()
        choice = np.empty(len(rem), _I64)
        for i in range(len(rem)):
            a = holders_start[i]
            best, best_load = -1, None
            for c in hold_l[a : a + holders_cnt[i]].tolist():
                r = int(sr[c])
                if best_load is None or load[r] < best_load:
                    best, best_load, best_r = c, load[r], r
            choice[i] = best
            load[best_r] += nb[i]
        self.load = np.array(load, _I64)
        h[rem] = choice
        return h

    def _check_dtypes(self, si, di, tensor_ids):
        """Every (source, target) storage pair that exchanges data needs a wire dtype."""
        bad = np.nonzero(self.bad_pair[self.s_cls[si], self.d_cls[di]])[0]
        if not len(bad):
            return
        i = int(bad[0])
        sl, dl = int(self.s_locs[si[i]]), int(self.d_locs[di[i]])
        sd, dd = self.src.storages[sl].dtype, self.dst.storages[dl].dtype
        raise LayoutError(
            f"tensor {self.names[int(tensor_ids[i])]!r}: unsupported dtype pair: source "
            f"location {sl} is {sd}, target location {dl} is {dd} (casts exist only among "
            "float32, bfloat16, float16; other dtypes must match)"
        )


def _job_rows(h, pj, lo, hi, S, T):
    """Jobs (box [lo, hi) from source piece h to target piece pj; S, T: gathered pieces)
    as rows (sl, so, Ss[D], dl, do, Sd[D], E[D]), the inputs of _box_runs."""
    _, s_loc, s_off, s_start, _, s_str = S
    _, d_loc, d_off, d_start, _, d_str = T
    so = s_off[h] + (s_str[h] * (lo - s_start[h])).sum(axis=1)
    do = d_off[pj] + (d_str[pj] * (lo - d_start[pj])).sum(axis=1)
    return np.column_stack([s_loc[h], so, s_str[h], d_loc[pj], do, d_str[pj], hi - lo])


def _rows_equal(*cols):
    """flags[i]: row i equals row i-1 in every column (1-D or 2-D column blocks)."""
    n = len(cols[0])
    same = np.zeros(n, bool)
    if n > 1:
        same[1:] = True
        for c in cols:
            c = c.reshape(n, -1)
            same[1:] &= (c[1:] == c[:-1]).all(axis=1)
    return same


def _intersect(base, a_ti, a_lo, a_hi, b_ti, b_lo, b_hi):
    """All pairs (i, j) of boxes a_i, b_j of the same tensor that intersect, with the
    intersection. Output-sensitive: pairs are enumerated from dim-0 overlaps found by
    binary search (one box's dim-0 start lies inside the other's range), then filtered.
    The order of the pairs carries no meaning: callers sort what needs an order."""
    ak0 = base[a_ti] + a_lo[:, 0]
    ak1 = base[a_ti] + a_hi[:, 0]
    bk0 = base[b_ti] + b_lo[:, 0]
    bk1 = base[b_ti] + b_hi[:, 0]
    ao = np.argsort(ak0, kind="stable")
    bo = np.argsort(bk0, kind="stable")
    ak0s, bk0s = ak0[ao], bk0[bo]
    # a starts inside [b0, b1)
    x0 = np.searchsorted(ak0s, bk0, "left")
    x1 = np.searchsorted(ak0s, bk1, "left")
    oj, k = _expand(x1 - x0)
    pa, pb = ao[x0[oj] + k], oj
    # b starts strictly inside (a0, a1)
    y0 = np.searchsorted(bk0s, ak0, "right")
    y1 = np.searchsorted(bk0s, ak1, "left")
    oi, k = _expand(y1 - y0)
    pa = np.concatenate([pa, oi])
    pb = np.concatenate([pb, bo[y0[oi] + k]])
    lo = np.maximum(a_lo[pa], b_lo[pb])
    hi = np.minimum(a_hi[pa], b_hi[pb])
    ok = (hi > lo).all(axis=1)
    if ok.all():
        return pa, pb, lo, hi
    return pa[ok], pb[ok], lo[ok], hi[ok]


def _disjoint_regions(tensors, r_ti, r_lo, r_hi, rstart, r_cnt):
    """Make the distinct source boxes of `tensors` disjoint (partially overlapping replicas).

    Each box keeps only what earlier boxes did not claim; the pieces it keeps are read from its
    own holders. Quadratic in the boxes of such a tensor; only unusual layouts get here.
    """
    bad = np.isin(r_ti, tensors)
    keep = np.nonzero(~bad)[0]
    new_ti, new_lo, new_hi, new_rs, new_rc = [], [], [], [], []
    claimed = {}
    for r in np.nonzero(bad)[0].tolist():
        t = int(r_ti[r])
        prev = claimed.setdefault(t, [])
        parts = [(r_lo[r].tolist(), r_hi[r].tolist())]
        for clo, chi in prev:
            nxt = []
            for plo, phi in parts:
                nxt.extend(_box_minus(plo, phi, clo, chi))
            parts = nxt
        prev.append((r_lo[r].tolist(), r_hi[r].tolist()))
        for plo, phi in parts:
            new_ti.append(t)
            new_lo.append(plo)
            new_hi.append(phi)
            new_rs.append(int(rstart[r]))
            new_rc.append(int(r_cnt[r]))
    D = r_lo.shape[1]
    return (
        np.concatenate([r_ti[keep], np.array(new_ti, _I64)]),
        np.concatenate([r_lo[keep], np.array(new_lo, _I64).reshape(-1, D)]),
        np.concatenate([r_hi[keep], np.array(new_hi, _I64).reshape(-1, D)]),
        np.concatenate([rstart[keep], np.array(new_rs, _I64)]),
        np.concatenate([r_cnt[keep], np.array(new_rc, _I64)]),
    )


def _box_minus(plo, phi, clo, chi):
    if any(ph <= cl or ch <= pl for pl, ph, cl, ch in zip(plo, phi, clo, chi)):
        return [(plo, phi)]
    out = []
    plo, phi = list(plo), list(phi)
    for k in range(len(plo)):
        if plo[k] < clo[k]:
            hi = list(phi)
            hi[k] = clo[k]
            out.append((list(plo), hi))
            plo[k] = clo[k]
        if phi[k] > chi[k]:
            lo = list(plo)
            lo[k] = chi[k]
            out.append((lo, list(phi)))
            phi[k] = chi[k]
    return out


def _box_runs(sl, so, Ss, dl, do, Sd, E):
    """Strided copy of boxes -> runs, columnar int64 [8, n] (see SL..CNT).

    Dims are ordered by source stride, dims contiguous in both storages merge into the run
    length, the largest remaining dim becomes the count, any others are enumerated.
    """
    m, D = E.shape
    if m == 0:
        return np.zeros((8, 0), _I64)
    if D >= 2:
        # fast path: boxes that are at most 2-D in the last two dims, unit inner stride on
        # both sides (ZeRO ranges, row/column splits): one run each, no reordering
        fast = (Ss[:, -1] == 1) & (Sd[:, -1] == 1)
        if D > 2:
            fast &= (E[:, :-2] == 1).all(axis=1)
        if fast.all():
            return _box_runs_2d(sl, so, Ss[:, -2], dl, do, Sd[:, -2], E[:, -2], E[:, -1])
        if fast.any():
            f, g = np.nonzero(fast)[0], np.nonzero(~fast)[0]
            a = _box_runs_2d(sl[f], so[f], Ss[f, -2], dl[f], do[f], Sd[f, -2], E[f, -2], E[f, -1])
            b = _box_runs(sl[g], so[g], Ss[g], dl[g], do[g], Sd[g], E[g])
            # keep planning order: interleave back by job index
            src_idx = np.concatenate(
                [np.repeat(f, 1), np.repeat(g, _runs_per_box(E[g], Ss[g], Sd[g]))]
            )
            o = np.argsort(src_idx, kind="stable")
            return np.take(np.concatenate([a, b], axis=1), o, axis=1)
    big = E > 1
    key_s = np.where(big, Ss, -1)
    if D > 1 and not (key_s[:, :-1] >= key_s[:, 1:]).all():
        # two stable passes = a per-row lexsort by (src stride, dst stride), descending
        key_d = np.where(big, Sd, -1)
        o1 = np.argsort(-key_d, axis=1, kind="stable")
        o2 = np.argsort(-np.take_along_axis(key_s, o1, axis=1), axis=1, kind="stable")
        order = np.take_along_axis(o1, o2, axis=1)
        E = np.take_along_axis(E, order, axis=1)
        Ss = np.take_along_axis(Ss, order, axis=1)
        Sd = np.take_along_axis(Sd, order, axis=1)
    # virtual innermost dim D carries the run length
    W = np.concatenate([E, np.ones((m, 1), _I64)], axis=1)
    WS = np.concatenate([Ss, np.ones((m, 1), _I64)], axis=1)
    WD = np.concatenate([Sd, np.ones((m, 1), _I64)], axis=1)
    ar = np.arange(m)
    tgt = np.full(m, D, _I64)
    for k in range(D - 1, -1, -1):
        e = W[:, k]
        te, ts, td = W[ar, tgt], WS[ar, tgt], WD[ar, tgt]
        can = (e > 1) & (WS[:, k] == ts * te) & (WD[:, k] == td * te)
        ci = np.nonzero(can)[0]
        W[ci, tgt[ci]] *= e[ci]
        W[ci, k] = 1
        mv = (e > 1) & ~can
        tgt[mv] = k
    length = W[:, D]
    outer = W[:, :D]
    cdim = np.argmax(outer, axis=1)  # largest remaining dim becomes the count
    count = outer[ar, cdim]
    css, csd = WS[ar, cdim], WD[ar, cdim]
    rest = outer.copy()
    rest[ar, cdim] = 1
    nruns = rest.prod(axis=1)
    if (nruns == 1).all():
        own = ar
        so2, do2 = so, do
    else:
        own, t = _expand(nruns)
        so2, do2 = so[own].copy(), do[own].copy()
        for k in range(D - 1, -1, -1):
            ek = rest[own, k]
            dig = t % ek
            t = t // ek
            so2 += dig * WS[own, k]
            do2 += dig * WD[own, k]
    L, C = length[own], count[own]
    one = C == 1
    out = np.empty((8, len(own)), _I64)
    out[SL], out[SO], out[DL], out[DO], out[LEN], out[CNT] = sl[own], so2, dl[own], do2, L, C
    out[SS] = np.where(one, L, css[own])
    out[DS] = np.where(one, L, csd[own])
    return out


def _box_runs_2d(sl, so, ss0, dl, do, sd0, e0, e1):
    """Boxes of e0 rows of e1 contiguous elements, row strides ss0 / sd0."""
    contig = (e0 == 1) | ((ss0 == e1) & (sd0 == e1))
    out = np.empty((8, len(sl)), _I64)
    out[SL], out[SO], out[DL], out[DO] = sl, so, dl, do
    out[LEN] = np.where(contig, e0 * e1, e1)
    out[CNT] = np.where(contig, 1, e0)
    out[SS] = np.where(contig, out[LEN], ss0)
    out[DS] = np.where(contig, out[LEN], sd0)
    return out


def _runs_per_box(E, Ss, Sd):
    """How many runs the general path of _box_runs emits per box (for re-interleaving)."""
    r = _box_runs(
        np.arange(len(E), dtype=_I64),
        np.zeros(len(E), _I64),
        Ss,
        np.zeros(len(E), _I64),
        np.zeros(len(E), _I64),
        Sd,
        E,
    )
    return np.bincount(r[SL], minlength=len(E))


def _normalize(runs):
    """Runs whose rows are contiguous in both storages become one longer row (in place)."""
    c = (runs[CNT] > 1) & (runs[SS] == runs[LEN]) & (runs[DS] == runs[LEN])
    if c.any():
        runs[LEN, c] *= runs[CNT, c]
        runs[CNT, c] = 1
        runs[SS, c] = runs[LEN, c]
        runs[DS, c] = runs[LEN, c]
    return runs


def _coalesce(runs):
    """Merge neighbouring runs (in planning order, which follows both storages): single rows
    contiguous in both storages join; rows of one length at one constant pair of gaps chain
    into a strided run. No sort: neighbours in planning order are where merges are.
    Modifies `runs` (always a fresh table of the caller's) in place."""
    if runs.shape[1] < 2:
        return runs
    runs = _normalize(runs)
    # (a) contiguous single rows
    a, b = runs[:, :-1], runs[:, 1:]
    link = (
        (a[CNT] == 1)
        & (b[CNT] == 1)
        & (a[SL] == b[SL])
        & (a[DL] == b[DL])
        & (b[SO] == a[SO] + a[LEN])
        & (b[DO] == a[DO] + a[LEN])
    )
    if link.any():
        st = _segments_of(np.concatenate([[False], link]))
        merged = np.take(runs, st, axis=1)
        merged[LEN] = np.add.reduceat(runs[LEN], st)
        one = merged[CNT] == 1  # strided runs are never merged here; keep their strides
        merged[SS, one] = merged[LEN, one]
        merged[DS, one] = merged[LEN, one]
        runs = merged
    if runs.shape[1] < 2:
        return runs
    # (b) equal-length rows whose positions form one arithmetic progression in both
    a, b = runs[:, :-1], runs[:, 1:]
    gs = b[SO] - (a[SO] + (a[CNT] - 1) * a[SS])
    gd = b[DO] - (a[DO] + (a[CNT] - 1) * a[DS])
    basic = (
        (a[SL] == b[SL])
        & (a[DL] == b[DL])
        & (a[LEN] == b[LEN])
        & (gs > 0)
        & (gd > 0)
        & ((a[CNT] == 1) | ((a[SS] == gs) & (a[DS] == gd)))
        & ((b[CNT] == 1) | ((b[SS] == gs) & (b[DS] == gd)))
    )
    if not basic.any():
        return runs
    # a single row linked on both sides must see the same gap on both
    prev_basic = np.concatenate([[False], basic[:-1]])
    prev_gs = np.concatenate([[0], gs[:-1]])
    prev_gd = np.concatenate([[0], gd[:-1]])
    link = basic & ((a[CNT] > 1) | ~prev_basic | ((prev_gs == gs) & (prev_gd == gd)))
    st = _segments_of(np.concatenate([[False], link]))
    merged = np.take(runs, st, axis=1)
    merged[CNT] = np.add.reduceat(runs[CNT], st)
    multi = merged[CNT] > 1
    nxt = np.minimum(st + 1, runs.shape[1] - 1)
    first_multi = runs[CNT, st] > 1
    merged[SS] = np.where(
        multi, np.where(first_multi, runs[SS, st], runs[SO, nxt] - runs[SO, st]), merged[SS]
    )
    merged[DS] = np.where(
        multi, np.where(first_multi, runs[DS, st], runs[DO, nxt] - runs[DO, st]), merged[DS]
    )
    return _normalize(merged)
