"""The plan fingerprint: sha256 of a canonical encoding of the inputs (budget, storages,
every tensor's pieces in name order) and of the global tables (storage-pair groups,
segments, messages, and the jobs of replicated-source tensors). Independent of Python's
`hash` and of batching, so it is the same across processes, hash seeds and machines."""

from __future__ import annotations

import hashlib

import numpy as np

# Tensors whose piece fields are hashed per chunk: bounds the temporary concatenations.
_CHUNK = 4096


class _Hasher:
    def __init__(self):
        self.h = hashlib.sha256(b"reshard-plan-v2\0")

    def put(self, arr):
        """An array with its dtype and shape, little-endian (an empty one as int64)."""
        a = np.asarray(arr)
        a = a.astype(a.dtype.newbyteorder("<") if a.size else "<i8", copy=False)
        a = np.ascontiguousarray(a)
        self.h.update(f"{a.dtype.str}{a.shape}".encode())
        if a.size:
            self.h.update(memoryview(a.reshape(-1)).cast("B"))

    def text(self, strings):
        self.h.update("\0".join(strings).encode())

    def layout(self, layout, names):
        locs = sorted(layout.storages)
        self.put(locs)
        self.put([[layout.storages[x].rank, layout.storages[x].numel] for x in locs])
        self.text(str(layout.storages[x].dtype) for x in locs)
        tls = [layout.tensors[n] for n in names]
        self.put([len(tl.shape) for tl in tls])
        self.put([x for tl in tls for x in tl.shape])
        self.put([len(tl) for tl in tls])
        # one sha256 per piece field, all fed in one pass over chunks of tensors
        fields = [hashlib.sha256() for _ in range(5)]
        for c in range(0, len(tls), _CHUNK):
            tables = [tl.table for tl in tls[c : c + _CHUNK]]
            for k, fh in enumerate(fields):
                a = np.concatenate([t[k].ravel() for t in tables]).astype("<i8", copy=False)
                fh.update(memoryview(a).cast("B"))
        for fh in fields:
            self.h.update(fh.digest())


def fingerprint(src, dst, names, budget_bytes_per_peer, rounds, replicated_jobs) -> str:
    h = _Hasher()
    h.put([budget_bytes_per_peer, rounds.num_rounds])
    h.text(names)
    h.layout(src, names)
    h.layout(dst, names)
    g = rounds.groups
    for a in (g.src_loc, g.dst_loc, g.sender, g.receiver, g.numel, g.itemsize):
        h.put(a)
    local = rounds.local
    h.put(np.column_stack(local) if len(local.rank) else [])
    h.put(rounds.segment_rows)
    h.put(rounds.message_rows)
    h.put(replicated_jobs.packed())
    return h.h.hexdigest()
