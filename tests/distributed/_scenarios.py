"""Sharded states of a small transformer-shaped model, with independent references.

Each `Side` is one way of laying out the model's tensors over ranks (ZeRO-3 per-parameter
partitions, ZeRO-1/2 one flat buffer cut across parameters, tensor-parallel splits with a fused
QKV buffer, full replicas). A Side gives two things built from the same recipe but by
different code:
- `layout()`: the reshard geometry (rs.flat / rs.split / rs.Piece ...), which the planner reads;
- `fill(values, rank)`: the buffers this rank holds, assembled with plain torch slicing and cat.
`fill` is the reference: a transfer from side A to side B must leave every target buffer equal
to `B.fill(values, rank)` cast to B's dtype, bit for bit, padding included (padding holds a
poison value that the transfer must never overwrite; source padding holds NaN, which the
transfer must never read).
"""

from __future__ import annotations

import math

import torch

import reshard as rs

POISON = -1234.5  # exactly representable in fp32, bf16 and fp16


def model_shapes(hidden=12, ffn=20, vocab=37, layers=2) -> dict[str, tuple]:
    """Odd sizes on purpose: nothing divides evenly by 2, 3 or 4 ranks."""
    shapes = {"embed": (vocab, hidden)}
    for i in range(layers):
        p = f"l{i}."
        shapes |= {
            p + "ln1": (hidden,),
            p + "q": (hidden, hidden),
            p + "k": (hidden, hidden),
            p + "v": (hidden, hidden),
            p + "o": (hidden, hidden),
            p + "ln2": (hidden,),
            p + "fc1": (ffn, hidden),
            p + "fc2": (hidden, ffn),
        }
    shapes["norm"] = (hidden,)
    return shapes


def model_values(shapes, seed=0) -> dict[str, torch.Tensor]:
    """fp32 logical values, the same in every process (seeded CPU generator per tensor)."""
    out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        out[name] = torch.randn(shape, generator=g, dtype=torch.float32)
    return out


def uneven(n: int, parts: int) -> list[int]:
    """Block sizes of `n` over `parts`, larger first (like torch.chunk-ish uneven TP splits)."""
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class Side:
    """Base: subclasses set self.storages {loc: rs.Storage} and implement layouts/fill."""

    dtype: torch.dtype

    def layout(self) -> rs.Layout:
        return rs.Layout(self.tensor_layouts(), dict(self.storages))

    def locations(self, rank) -> list[int]:
        return sorted(loc for loc, s in self.storages.items() if s.rank == rank)

    def empty(self, rank, value=POISON) -> dict[int, torch.Tensor]:
        return {
            loc: torch.full((self.storages[loc].numel,), value, dtype=self.dtype)
            for loc in self.locations(rank)
        }


class Zero3(Side):
    """ZeRO-3: each parameter's flat form padded to a multiple of W and cut evenly; rank r's
    buffer is the concatenation of its pieces of every parameter (padding at the ends)."""

    def __init__(self, shapes, ranks, dtype=torch.float32, loc0=0):
        self.shapes, self.ranks, self.dtype = shapes, list(ranks), dtype
        w = len(self.ranks)
        self.chunk = {n: math.ceil(math.prod(s) / w) for n, s in shapes.items()}
        self.offset, off = {}, 0
        for n in shapes:
            self.offset[n] = off
            off += self.chunk[n]
        self.loc = {r: loc0 + i for i, r in enumerate(self.ranks)}
        self.storages = {self.loc[r]: rs.Storage(r, dtype, off) for r in self.ranks}

    def tensor_layouts(self):
        out = {}
        for n, shape in self.shapes.items():
            numel, c = math.prod(shape), self.chunk[n]
            runs = []
            for i, r in enumerate(self.ranks):
                lo, hi = i * c, min((i + 1) * c, numel)
                if lo < hi:
                    runs.append((self.loc[r], lo, hi, self.offset[n]))
            out[n] = rs.flat(shape, runs)
        return out

    def fill(self, values, rank, pad=POISON):
        if rank not in self.loc:
            return {}
        i = self.ranks.index(rank)
        parts = []
        for n in self.shapes:
            c = self.chunk[n]
            piece = values[n].reshape(-1)[i * c : (i + 1) * c]
            parts += [piece, torch.full((c - piece.numel(),), pad)]
        return {self.loc[rank]: torch.cat(parts).to(self.dtype)}


class Zero12(Side):
    """ZeRO-1/2: all parameters flattened into one buffer (each aligned to `align` elements),
    padded, and cut into W equal partitions: parameters straddle rank boundaries."""

    def __init__(self, shapes, ranks, dtype=torch.float32, loc0=0, align=4):
        self.shapes, self.ranks, self.dtype = shapes, list(ranks), dtype
        self.start, off = {}, 0
        for n, s in shapes.items():
            self.start[n] = off
            off += math.prod(s)
            off = -(-off // align) * align
        w = len(self.ranks)
        self.part = -(-off // w) + 1  # +1: a little tail padding on every rank
        self.total = off
        self.loc = {r: loc0 + i for i, r in enumerate(self.ranks)}
        self.storages = {self.loc[r]: rs.Storage(r, dtype, self.part) for r in self.ranks}

    def tensor_layouts(self):
        out = {}
        for n, shape in self.shapes.items():
            g0, numel = self.start[n], math.prod(shape)
            runs = []
            for i, r in enumerate(self.ranks):
                lo = max(g0, i * self.part)
                hi = min(g0 + numel, (i + 1) * self.part)
                if lo < hi:
                    runs.append((self.loc[r], lo - g0, hi - g0, lo - i * self.part))
            out[n] = rs.flat(shape, runs)
        return out

    def fill(self, values, rank, pad=POISON):
        if rank not in self.loc:
            return {}
        i = self.ranks.index(rank)
        flat = torch.full((self.part * len(self.ranks),), pad)
        for n in self.shapes:
            v = values[n].reshape(-1)
            flat[self.start[n] : self.start[n] + v.numel()] = v
        return {self.loc[rank]: flat[i * self.part : (i + 1) * self.part].to(self.dtype)}


class TensorParallel(Side):
    """Rollout buffers: for each TP group (a list of ranks; several groups = data-parallel
    replicas), per rank: embed split on vocab, a fused QKV buffer (q, k, v row blocks at
    offsets), o and fc2 split on the input dim, fc1 split on the output dim, and all norms
    replicated and packed into one `norms` buffer at offsets."""

    def __init__(self, shapes, groups, dtype=torch.bfloat16, loc0=100):
        self.shapes, self.groups, self.dtype = shapes, [list(g) for g in groups], dtype
        self.layers = sorted({int(n[1 : n.index(".")]) for n in shapes if n.startswith("l")})
        self.hidden = shapes["norm"][0]
        self.ffn = shapes["l0.fc1"][0]
        self.vocab = shapes["embed"][0]
        self.norm_names = [n for n, s in shapes.items() if len(s) == 1]
        self.storages, self.slot = {}, {}
        loc = loc0
        h, f = self.hidden, self.ffn
        for g in self.groups:
            hs, fs, vs = uneven(h, len(g)), uneven(f, len(g)), uneven(self.vocab, len(g))
            for t, r in enumerate(g):
                sizes = {"embed": vs[t] * h, "norms": h * len(self.norm_names)}
                for i in self.layers:
                    sizes |= {f"l{i}.qkv": 3 * hs[t] * h, f"l{i}.o": h * hs[t]}
                    sizes |= {f"l{i}.fc1": fs[t] * h, f"l{i}.fc2": h * fs[t]}
                for key, numel in sizes.items():
                    self.storages[loc] = rs.Storage(r, dtype, numel)
                    self.slot[(r, key)] = loc
                    loc += 1

    def tensor_layouts(self):
        pieces: dict[str, list] = {n: [] for n in self.shapes}
        h = self.hidden
        for g in self.groups:
            hs, fs, vs = uneven(h, len(g)), uneven(self.ffn, len(g)), uneven(self.vocab, len(g))
            for t, r in enumerate(g):
                h0, f0, v0 = sum(hs[:t]), sum(fs[:t]), sum(vs[:t])
                pieces["embed"].append(rs.Piece(self.slot[(r, "embed")], 0, (v0, 0), (vs[t], h)))
                for j, n in enumerate(self.norm_names):
                    pieces[n].append(rs.Piece(self.slot[(r, "norms")], j * h, (0,), (h,)))
                for i in self.layers:
                    qkv = self.slot[(r, f"l{i}.qkv")]
                    for j, part in enumerate("qkv"):
                        pieces[f"l{i}.{part}"].append(
                            rs.Piece(qkv, j * hs[t] * h, (h0, 0), (hs[t], h))
                        )
                    o, fc1 = self.slot[(r, f"l{i}.o")], self.slot[(r, f"l{i}.fc1")]
                    fc2 = self.slot[(r, f"l{i}.fc2")]
                    pieces[f"l{i}.o"].append(rs.Piece(o, 0, (0, h0), (h, hs[t])))
                    pieces[f"l{i}.fc1"].append(rs.Piece(fc1, 0, (f0, 0), (fs[t], h)))
                    pieces[f"l{i}.fc2"].append(rs.Piece(fc2, 0, (0, f0), (h, fs[t])))
        return {n: rs.TensorLayout(self.shapes[n], p) for n, p in pieces.items()}

    def fill(self, values, rank, pad=POISON):
        out = {}
        h = self.hidden
        for g in self.groups:
            if rank not in g:
                continue
            t = g.index(rank)
            hs, fs, vs = uneven(h, len(g)), uneven(self.ffn, len(g)), uneven(self.vocab, len(g))
            h0, f0, v0 = sum(hs[:t]), sum(fs[:t]), sum(vs[:t])
            hsl, fsl = slice(h0, h0 + hs[t]), slice(f0, f0 + fs[t])
            bufs = {
                "embed": values["embed"][v0 : v0 + vs[t]],
                "norms": torch.cat([values[n] for n in self.norm_names]),
            }
            for i in self.layers:
                p = f"l{i}."
                bufs[p + "qkv"] = torch.cat([values[p + x][hsl] for x in "qkv"])
                bufs[p + "o"] = values[p + "o"][:, hsl]
                bufs[p + "fc1"] = values[p + "fc1"][fsl]
                bufs[p + "fc2"] = values[p + "fc2"][:, fsl]
            for key, v in bufs.items():
                out[self.slot[(rank, key)]] = v.contiguous().reshape(-1).to(self.dtype)
        return out


class Replicas(Side):
    """Full copies of every tensor, packed at offsets into one buffer per rank in `ranks`."""

    def __init__(self, shapes, ranks, dtype=torch.float32, loc0=50):
        self.shapes, self.ranks, self.dtype = shapes, list(ranks), dtype
        self.offset, off = {}, 0
        for n, s in shapes.items():
            self.offset[n] = off
            off += math.prod(s) + 3  # gaps between tensors: padding that must stay untouched
        self.loc = {r: loc0 + i for i, r in enumerate(self.ranks)}
        self.storages = {self.loc[r]: rs.Storage(r, dtype, off) for r in self.ranks}

    def tensor_layouts(self):
        return {
            n: rs.TensorLayout(
                s,
                [rs.Piece(self.loc[r], self.offset[n], (0,) * len(s), s) for r in self.ranks],
            )
            for n, s in self.shapes.items()
        }

    def fill(self, values, rank, pad=POISON):
        if rank not in self.loc:
            return {}
        parts = []
        for n in self.shapes:
            parts += [values[n].reshape(-1), torch.full((3,), pad)]
        return {self.loc[rank]: torch.cat(parts).to(self.dtype)}


def source_buffers(side: Side, values, rank) -> dict[int, torch.Tensor]:
    """This rank's source buffers; padding is NaN so that reading it would show."""
    return side.fill(values, rank, pad=float("nan"))


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    it = ints[a.element_size()]
    return torch.equal(a.view(it), b.view(it))


def mismatches(got: dict, want: dict) -> list[str]:
    """Human-readable differences between two {loc: tensor} maps (empty if bitwise equal)."""
    bad = []
    if sorted(got) != sorted(want):
        bad.append(f"locations differ: got {sorted(got)}, want {sorted(want)}")
    for loc in sorted(set(got) & set(want)):
        g, w = got[loc], want[loc]
        if not bitwise_equal(g, w):
            if g.shape == w.shape and g.dtype == w.dtype:
                idx = torch.nonzero(g.float().ne(w.float()) & ~(g.isnan() & w.isnan()))
                first = idx[:5].flatten().tolist()
                bad.append(
                    f"location {loc}: {idx.numel()} elements differ, first at {first}: "
                    f"got {[g[i].item() for i in first]}, want {[w[i].item() for i in first]}"
                )
            else:
                bad.append(
                    f"location {loc}: got {g.dtype}{tuple(g.shape)}, want {w.dtype}{tuple(w.shape)}"
                )
    return bad


# ----------------------------------------------------------------- random layouts (fuzzing)


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

    def fill(self, values, rank, pad=POISON):
        if rank not in self.loc:
            return {}
        loc = self.loc[rank]
        buf = torch.full((self.storages[loc].numel,), pad)
        for name, runs in self.runs.items():
            flat = values[name].reshape(-1)
            for where, lo, hi, off in runs:
                if where == loc:
                    buf[off : off + hi - lo] = flat[lo:hi]
        return {loc: buf.to(self.dtype)}


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

    def fill(self, values, rank, pad=POISON):
        if rank not in self.loc:
            return {}
        loc = self.loc[rank]
        buf = torch.full((self.storages[loc].numel,), pad)
        for name, blocks in self.blocks.items():
            for where, off, start, box in blocks:
                if where == loc:
                    idx = tuple(slice(s, s + b) for s, b in zip(start, box, strict=True))
                    part = values[name][idx].reshape(-1)
                    buf[off : off + part.numel()] = part
        return {loc: buf.to(self.dtype)}
