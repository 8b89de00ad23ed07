"""The global pass: element totals per (source storage, target storage) pair for every
tensor, and the chosen jobs of tensors whose source has replicas. Every rank runs it."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..errors import LayoutError
from .helpers import expand
from .intersect import (
    Batch,
    batch_of,
    batches,
    gather,
    intersect,
    jobs_of,
    source_regions,
    templates,
)
from .records import I64, Jobs, StorageIndex
from .replicas import choose_holders


class GlobalTables(NamedTuple):
    """What the global pass keeps: storage pairs that exchange elements (`pair_src`,
    `pair_dst`: StorageIndex numbers; `pair_numel`), `direct[t]` (tensor t's source pieces do
    not overlap, so its jobs are rebuilt per rank), the jobs of the other tensors with their
    chosen holders, and how many jobs there were in all."""

    pair_src: np.ndarray
    pair_dst: np.ndarray
    pair_numel: np.ndarray
    direct: np.ndarray
    jobs: Jobs
    num_jobs: int


def global_pass(src, dst, names, index: StorageIndex, ndim) -> GlobalTables:
    gp = _GlobalPass(src, dst, names, index, ndim)
    parts = [gp.batch(b) for b in batches(src, dst, names, range(len(names)))]
    si, di, numel = gp.totals.result()
    return GlobalTables(si, di, numel, gp.direct, Jobs.concat(ndim, parts), gp.num_jobs)


class _PairTotals:
    """Element totals per storage pair, and the bytes each rank sends (replica balancing).
    A dense float64 table when the pairs are few enough (sums of integers below 2**53 are
    exact), else per-batch (key, total) parts summed at the end."""

    def __init__(self, index: StorageIndex):
        self.index = index
        self.n_dst = len(index.dst_locs)
        n = len(index.src_locs) * self.n_dst
        self.dense = n <= 1 << 22
        self.acc = np.zeros(n if self.dense else 0, np.float64)
        self.parts = []
        self.load = np.zeros(index.num_ranks, I64)  # by rank position

    def add(self, si, di, numel, account):
        """Add `numel` to pairs (si, di); `account`: count remote bytes in the senders' load
        (per storage pair, not per job)."""
        if not len(si):
            return
        key = si * self.n_dst + di
        if self.dense:
            delta = np.bincount(key, weights=numel, minlength=len(self.acc))
            self.acc += delta
            if account:
                key = np.nonzero(delta)[0]
                w = delta[key]
        else:
            key, inv = np.unique(key, return_inverse=True)
            w = np.bincount(inv, weights=numel)
            self.parts.append((key, w))
        if account:
            si, di = key // self.n_dst, key % self.n_dst
            snd = self.index.src_rank_pos[si]
            remote = snd != self.index.dst_rank_pos[di]
            nbytes = (w * self.index.dst_itemsize[di])[remote]
            self.load += np.rint(np.bincount(snd[remote], nbytes, len(self.load))).astype(I64)

    def result(self):
        """(source index, target index, total) of every pair with elements, by key."""
        if self.dense:
            keys = np.nonzero(self.acc)[0]
            vals = self.acc[keys]
        elif self.parts:
            k = np.concatenate([p[0] for p in self.parts])
            v = np.concatenate([p[1] for p in self.parts])
            keys, inv = np.unique(k, return_inverse=True)
            vals = np.bincount(inv, weights=v)
        else:
            keys, vals = np.zeros(0, I64), np.zeros(0)
        return keys // self.n_dst, keys % self.n_dst, np.rint(vals).astype(I64)


class _Jobs(NamedTuple):
    """A batch's jobs before multiplying out target replicas: region `region` of the source
    intersects template `template` in [lo, hi)."""

    region: np.ndarray
    template: np.ndarray
    lo: np.ndarray
    hi: np.ndarray


class _GlobalPass:
    def __init__(self, src, dst, names, index, ndim):
        self.src, self.dst, self.names, self.index, self.ndim = src, dst, names, index, ndim
        self.totals = _PairTotals(index)
        self.direct = np.zeros(len(names), bool)
        self.num_jobs = 0
        self.check = (index.wire_itemsize == 0).any()  # some pair has no wire dtype

    def batch(self, tids) -> Jobs:
        b = batch_of(self.src, self.names, tids, self.ndim)
        S = gather(self.src, self.names, b.tids, self.ndim)
        T = gather(self.dst, self.names, b.tids, self.ndim)
        s_ti, d_ti = b.pos[S.tensor], b.pos[T.tensor]
        vol = np.bincount(
            s_ti, weights=S.shape.prod(axis=1).astype(np.float64), minlength=len(tids)
        )
        direct = vol == b.numel
        self.direct[b.tids] = direct
        regions = source_regions(s_ti, S.start, S.shape, direct, b.numel)
        tpl = templates(d_ti, T.start, T.shape, T.strides)
        first = tpl.order[tpl.first]
        t_lo = T.start[first]
        ov = intersect(
            b.shape,
            regions.tensor,
            regions.lo,
            regions.hi,
            d_ti[first],
            t_lo,
            t_lo + T.shape[first],
        )
        self.num_jobs += int(tpl.count[ov.b].sum())
        jobs = _Jobs(ov.a, ov.b, ov.lo, ov.hi)
        s_idx = self.index.src_index(S.location)
        d_idx = self.index.dst_index(T.location)
        src_of = s_idx[regions.holders[regions.first]]  # source storage of each region's lead
        is_direct = direct[regions.tensor[jobs.region]]
        self._direct_totals(b, jobs, is_direct, src_of, tpl, d_ti, d_idx, regions)
        rep = np.nonzero(~is_direct)[0]
        if not len(rep):
            return Jobs.empty(self.ndim)
        return self._replicated_jobs(b, jobs, rep, regions, tpl, S, T, s_idx, d_idx)

    def _direct_totals(self, b: Batch, jobs: _Jobs, is_direct, src_of, tpl, d_ti, d_idx, regions):
        """Direct tensors keep totals only. Jobs of a replicated template (norms on every
        target rank) are summed per (source storage, template) first, then multiplied out
        over the template's replicas."""
        sel = slice(None) if is_direct.all() else np.nonzero(is_direct)[0]
        region = jobs.region[sel]
        if not len(region):
            return
        si, tj = src_of[region], jobs.template[sel]
        vol = (jobs.hi[sel] - jobs.lo[sel]).prod(axis=1)
        one = tpl.count[tj] == 1
        many = np.nonzero(~one)[0]
        if len(many):
            one = np.nonzero(one)[0]
            n_tpl = len(tpl.first)
            u, inv = np.unique(si[many] * n_tpl + tj[many], return_inverse=True)
            w = np.rint(np.bincount(inv, weights=vol[many])).astype(I64)
            us, ut = u // n_tpl, u % n_tpl
            owner, k = expand(tpl.count[ut])
            di = d_idx[tpl.order[tpl.first[ut[owner]] + k]]
            if self.check:
                self._check_dtypes(us[owner], di, b.tids[d_ti[tpl.order[tpl.first]][ut[owner]]])
            self.totals.add(us[owner], di, w[owner], account=True)
            si, tj, vol, region = si[one], tj[one], vol[one], region[one]
        di = d_idx[tpl.order[tpl.first][tj]]
        if self.check:
            self._check_dtypes(si, di, b.tids[regions.tensor[region]])
        self.totals.add(si, di, vol, account=True)

    def _replicated_jobs(self, b, jobs, rep, regions, tpl, S, T, s_idx, d_idx) -> Jobs:
        """Tensors with source replicas: a holder per (job, target replica), kept as jobs."""
        owner, k = expand(tpl.count[jobs.template[rep]])
        region, template = jobs.region[rep][owner], jobs.template[rep][owner]
        target = tpl.order[tpl.first[template] + k]
        lo, hi = jobs.lo[rep][owner], jobs.hi[rep][owner]
        if self.check:
            lead = regions.holders[regions.first[region]]
            self._check_dtypes(s_idx[lead], d_idx[target], b.tids[regions.tensor[region]])
        h = choose_holders(
            region, target, lo, hi, regions, S.location, T.location, self.index, self.totals.load
        )
        self.totals.add(s_idx[h], d_idx[target], (hi - lo).prod(axis=1), account=False)
        return jobs_of(h, target, lo, hi, S, T)

    def _check_dtypes(self, si, di, tensor_ids):
        """Every (source, target) storage pair that exchanges data needs a wire dtype."""
        bad = np.nonzero(self.index.pair_itemsize(si, di) == 0)[0]
        if not len(bad):
            return
        i = int(bad[0])
        sl, dl = int(self.index.src_locs[si[i]]), int(self.index.dst_locs[di[i]])
        sd, dd = self.src.storages[sl].dtype, self.dst.storages[dl].dtype
        raise LayoutError(
            f"tensor {self.names[int(tensor_ids[i])]!r}: unsupported dtype pair: source "
            f"location {sl} is {sd}, target location {dl} is {dd} (casts exist only among "
            "float32, bfloat16, float16; other dtypes must match)"
        )
