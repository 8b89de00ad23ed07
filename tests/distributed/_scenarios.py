"""The shared scenarios (reshard.scenarios: model shapes, values, ZeRO / TP / replica sides with
their independent references) plus what only the tests need: random layouts for fuzzing.

A random side follows the same contract as the shared ones: `layout()` from the reshard
builders, `write()` by plain torch indexing, so `fill(values, rank)` is the reference.
"""

from __future__ import annotations

import math

import reshard as rs
from reshard.scenarios import (  # noqa: F401 - re-exported for the test modules
    POISON,
    Replicas,
    Side,
    TensorParallel,
    Zero3,
    Zero12,
    bitwise_equal,
    mismatches,
    model_shapes,
    model_values,
    source_buffers,
    uneven,
)


def random_shapes(rng, n_tensors=3) -> dict[str, tuple]:
    return {
        f"t{i}": tuple(int(x) for x in rng.integers(1, 8, size=int(rng.integers(1, 4))))
        for i in range(n_tensors)
    }


class RandomFlat(Side):
    """Each tensor's flat range cut at random points; each piece on a random rank (and, with
    replicate, sometimes on a second one too) at the next offset of that rank's one storage,
    with random gaps (padding) in between."""

    def __init__(self, shapes, ranks, rng, dtype, loc0, replicate=False):
        self.shapes, self.dtype = shapes, dtype
        self.loc = {r: loc0 + i for i, r in enumerate(ranks)}
        fill = dict.fromkeys(ranks, 0)
        self.runs = {}
        for name, shape in shapes.items():
            n = math.prod(shape)
            cuts = sorted({0, n, *(int(x) for x in rng.integers(0, n + 1, size=3))})
            runs = []
            for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
                owners = {ranks[int(rng.integers(len(ranks)))]}
                if replicate and rng.random() < 0.5:
                    owners.add(ranks[int(rng.integers(len(ranks)))])
                for r in sorted(owners):
                    fill[r] += int(rng.integers(0, 3))  # a gap: padding
                    runs.append((self.loc[r], lo, hi, fill[r]))
                    fill[r] += hi - lo
            self.runs[name] = runs
        self.storages = {
            self.loc[r]: rs.Storage(r, dtype, fill[r] + int(rng.integers(0, 3))) for r in ranks
        }

    def tensor_layouts(self):
        return {n: rs.flat(self.shapes[n], runs) for n, runs in self.runs.items()}

    def write(self, name, full, bufs, rank):
        flat = full.reshape(-1)
        for where, lo, hi, off in self.runs[name]:
            if where == self.loc.get(rank):
                bufs[where][off : off + hi - lo].copy_(flat[lo:hi])


class RandomBlocks(Side):
    """Each tensor split along a random dim into random blocks (zero-size blocks allowed), each
    block stored row-major at a random offset of a random rank's one storage."""

    def __init__(self, shapes, ranks, rng, dtype, loc0):
        self.shapes, self.dtype = shapes, dtype
        self.loc = {r: loc0 + i for i, r in enumerate(ranks)}
        fill = dict.fromkeys(ranks, 0)
        self.blocks = {}
        for name, shape in shapes.items():
            dim = int(rng.integers(len(shape)))
            cuts = sorted({0, shape[dim], *(int(x) for x in rng.integers(0, shape[dim] + 1, 2))})
            blocks = []
            for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
                r = ranks[int(rng.integers(len(ranks)))]
                start = [0] * len(shape)
                start[dim] = lo
                box = list(shape)
                box[dim] = hi - lo
                fill[r] += int(rng.integers(0, 3))
                blocks.append((self.loc[r], fill[r], tuple(start), tuple(box)))
                fill[r] += math.prod(box)
            self.blocks[name] = blocks
        self.storages = {self.loc[r]: rs.Storage(r, dtype, fill[r]) for r in ranks}

    def tensor_layouts(self):
        return {
            n: rs.TensorLayout(self.shapes[n], [rs.Piece(*b) for b in blocks])
            for n, blocks in self.blocks.items()
        }

    def write(self, name, full, bufs, rank):
        for where, off, start, box in self.blocks[name]:
            if where == self.loc.get(rank):
                idx = tuple(slice(s, s + b) for s, b in zip(start, box, strict=True))
                part = full[idx].reshape(-1)
                bufs[where][off : off + part.numel()].copy_(part)
