"""Replica choice: which source piece (holder) each job of a replicated source reads from."""

from __future__ import annotations

import numpy as np

from .helpers import expand
from .intersect import Regions
from .records import I64, StorageIndex


def choose_holders(
    job_region, job_target, lo, hi, regions: Regions, src_loc, dst_loc, index: StorageIndex, load
):
    """One holder (source piece index) per job [lo, hi) of region `job_region` into target
    piece `job_target`: a holder on the target's own rank if there is one, else the holder
    whose rank has sent the fewest bytes so far, largest jobs first (ties: the first holder).
    Jobs with a single remote holder count first. `src_loc`/`dst_loc`: locations of the
    batch's source/target pieces. `load[p]`: bytes sent by the rank at position p
    (StorageIndex rank positions), updated in place."""
    cnt = regions.count[job_region]
    h = regions.holders[regions.first[job_region]].copy()
    srank = index.src_rank_pos[np.searchsorted(index.src_locs, src_loc)]
    drank = index.dst_rank_pos[np.searchsorted(index.dst_locs, dst_loc)]
    jr = drank[job_target]
    item = index.dst_itemsize[np.searchsorted(index.dst_locs, dst_loc[job_target])]
    nbytes = (hi - lo).prod(axis=1) * item
    single = cnt == 1
    remote1 = single & (srank[h] != jr)
    np.add.at(load, srank[h[remote1]], nbytes[remote1])
    multi = np.nonzero(~single)[0]
    if not len(multi):
        return h
    owner, k = expand(cnt[multi])
    cand = regions.holders[regions.first[job_region[multi]][owner] + k]
    is_local = srank[cand] == jr[multi][owner]
    # first local holder per job, if any
    first_local = np.full(len(multi), -1, I64)
    li = np.nonzero(is_local)[0]
    uq, at = np.unique(owner[li], return_index=True)
    first_local[uq] = cand[li[at]]
    has = first_local >= 0
    h[multi[has]] = first_local[has]
    rem = multi[~has]
    if len(rem):
        rem = rem[np.lexsort((rem, -nbytes[rem]))]
        h[rem] = _least_loaded(rem, nbytes, job_region, regions, srank, load)
    return h


def _least_loaded(jobs, nbytes, job_region, regions: Regions, srank, load):
    """In the order of `jobs` (largest first), each job's holder on the rank with the least
    load so far; the chosen holders, in that order."""
    loads = load.tolist()
    holders_start = regions.first[job_region[jobs]].tolist()
    holders_cnt = regions.count[job_region[jobs]].tolist()
    nb = nbytes[jobs].tolist()
    # plain lists: a numpy scalar per holder made 256 replicas x 10**5 jobs take 10 s
    holders = regions.holders.tolist()
    holder_rank = srank[regions.holders].tolist()
    choice = np.empty(len(jobs), I64)
    for i in range(len(jobs)):
        a = holders_start[i]
        ranks = holder_rank[a : a + holders_cnt[i]]
        held = [loads[r] for r in ranks]
        k = held.index(min(held))  # the first holder of the least loaded rank
        choice[i] = holders[a + k]
        loads[ranks[k]] += nb[i]
    load[:] = loads
    return choice
