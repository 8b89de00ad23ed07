"""Sharded states of a transformer-shaped model: the geometry the demo, the tests and the
benchmarks share.

A `Side` is one way of laying out the model's tensors over ranks: ZeRO-3 per-parameter
partitions (`Zero3`), ZeRO-1/2 one flat buffer cut across parameters (`Zero12`), rollout
tensor-parallel splits with a fused QKV buffer (`TensorParallel`), full copies (`Replicas`),
several optimizer states of one geometry (`States`). Each gives two things built from the same
recipe by different code:

- `layout()`: the reshard geometry (`rs.flat`, `rs.split`, `rs.Piece`), which the planner reads;
- `write(name, full, bufs, rank)`: this rank's part of the logical tensor `name`, put into its
  buffers with plain torch slicing (as a trainer or a rollout engine loading a checkpoint would).

`write` is the reference: a transfer from side A to side B must leave every target buffer equal
to `B.fill(values, rank)` (every tensor written into `B.empty(rank)`), bit for bit, padding
included. Padding holds `POISON` in targets (a transfer must never write it) and NaN in sources
(a transfer must never read it).

Named model sizes (`MODELS`) and the value generator (`value`) are cheap for billions of
elements, so the same code builds a 10-element test and a 2.7B-parameter benchmark.
"""

from __future__ import annotations

import math

import torch

import reshard as rs

POISON = -1234.5  # exactly representable in fp32, bf16 and fp16

# name -> (hidden, ffn, vocab, layers). The small ones use odd sizes so TP and ZeRO cuts are
# uneven; the GPT sizes follow GPT-2/3 (vocab 50257); llama-8l is 8 layers of a 7B llama.
MODELS = {
    "gpt-nano": (130, 346, 501, 2),
    "gpt-micro": (258, 690, 2001, 4),
    "gpt-mini": (514, 1378, 8001, 4),
    "gpt-small": (770, 3074, 16001, 8),
    "gpt-125m": (768, 3072, 50257, 12),
    "gpt-350m": (1024, 4096, 50257, 24),
    "gpt-760m": (1536, 6144, 50257, 24),
    "gpt-1.3b": (2048, 8192, 50257, 24),
    "gpt-2.7b": (2560, 10240, 50257, 32),
    "llama-8l": (4096, 11008, 32000, 8),
    # the tensor counts of gpt-125m (98) and gpt-350m (194) at tiny widths: per-call costs
    # that scale with the number of buffers, not with the bytes
    "gpt-125m-thin": (34, 50, 101, 12),
    "gpt-350m-thin": (34, 50, 101, 24),
}

_PERIOD = 1_000_003  # prime: a misplaced run shows unless it moved by a multiple of this


def model_shapes(hidden=12, ffn=20, vocab=37, layers=2) -> dict[str, tuple[int, ...]]:
    """A transformer's parameter shapes. The defaults are odd on purpose: nothing divides
    evenly by 2, 3 or 4 ranks."""
    shapes = {"embed": (vocab, hidden)}
    for i in range(layers):
        p = f"l{i}."
        shapes |= {p + "ln1": (hidden,), p + "q": (hidden, hidden), p + "k": (hidden, hidden)}
        shapes |= {p + "v": (hidden, hidden), p + "o": (hidden, hidden), p + "ln2": (hidden,)}
        shapes |= {p + "fc1": (ffn, hidden), p + "fc2": (hidden, ffn)}
    shapes["norm"] = (hidden,)
    return shapes


def named_shapes(model: str) -> dict[str, tuple[int, ...]]:
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    return model_shapes(*MODELS[model])


def count_params(shapes) -> int:
    return sum(math.prod(s) for s in shapes.values())


def value(index: int, shape, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """Logical tensor `index` of the state `seed`: the same in every process, cheap for
    billions of elements (a random pattern of prime period)."""
    numel = math.prod(shape)
    g = torch.Generator().manual_seed(7919 * index + 1 + 104_729 * seed)
    pattern = torch.randn(min(numel, _PERIOD), generator=g)
    if numel > pattern.numel():
        pattern = pattern.repeat(math.ceil(numel / pattern.numel()))[:numel]
    return pattern.to(dtype).view(shape)


def model_values(shapes, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 logical values of every tensor of `shapes` (a new `seed`: a new training step)."""
    return {n: value(i, s, seed=seed) for i, (n, s) in enumerate(shapes.items())}


def uneven(n: int, parts: int) -> list[int]:
    """Block sizes of `n` over `parts`, larger first (uneven TP splits)."""
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class Side:
    """Subclasses set `shapes` ({tensor name: shape}), `dtype`, `storages` ({loc: rs.Storage})
    and implement `tensor_layouts()` and `write()`."""

    shapes: dict
    dtype: torch.dtype
    storages: dict

    def layout(self) -> rs.Layout:
        return rs.Layout(self.tensor_layouts(), dict(self.storages))

    def locations(self, rank) -> list[int]:
        return sorted(loc for loc, s in self.storages.items() if s.rank == rank)

    def empty(self, rank, value=POISON, device="cpu") -> dict[int, torch.Tensor]:
        """This rank's buffers, every element `value`."""
        return {
            loc: torch.full((self.storages[loc].numel,), value, dtype=self.dtype, device=device)
            for loc in self.locations(rank)
        }

    def fill(self, values, rank, pad=POISON) -> dict[int, torch.Tensor]:
        """This rank's buffers holding `values` ({name: logical tensor}), padding `pad`."""
        bufs = self.empty(rank, pad)
        for name, full in values.items():
            self.write(name, full, bufs, rank)
        return bufs

    def write(self, name, full, bufs, rank) -> None:
        raise NotImplementedError


class Zero3(Side):
    """ZeRO-3: each tensor's flat form padded to a multiple of W and cut evenly; partition i
    (location loc0 + i) lives on `ranks[i]` and is the concatenation of chunk i of every tensor
    (padding at each chunk's end)."""

    def __init__(self, shapes, ranks, dtype=torch.float32, loc0=0):
        self.shapes, self.ranks, self.dtype = shapes, list(ranks), dtype
        w = len(self.ranks)
        self.chunk = {n: math.ceil(math.prod(s) / w) for n, s in shapes.items()}
        self.offset, off = {}, 0
        for n in shapes:
            self.offset[n] = off
            off += self.chunk[n]
        self.storages = {loc0 + i: rs.Storage(r, dtype, off) for i, r in enumerate(self.ranks)}
        self.loc0 = loc0

    def tensor_layouts(self):
        out = {}
        for n, shape in self.shapes.items():
            numel, c = math.prod(shape), self.chunk[n]
            runs = [
                (self.loc0 + i, i * c, min((i + 1) * c, numel), self.offset[n])
                for i in range(len(self.ranks))
                if i * c < numel
            ]
            out[n] = rs.flat(shape, runs)
        return out

    def partitions(self, rank) -> list[int]:
        return [i for i, r in enumerate(self.ranks) if r == rank]

    def write(self, name, full, bufs, rank):
        c, off, flat = self.chunk[name], self.offset[name], full.reshape(-1)
        for i in self.partitions(rank):
            piece = flat[i * c : (i + 1) * c]
            bufs[self.loc0 + i][off : off + piece.numel()].copy_(piece)

    def chunk_view(self, name, bufs, rank):
        """(chunk elements, this rank's chunk of tensor `name` in `bufs`, padding included, or
        None): what a per-tensor gather of ZeRO-3 state sends."""
        c, parts = self.chunk[name], self.partitions(rank)
        if not parts:
            return c, None
        return c, bufs[self.loc0 + parts[0]][self.offset[name] : self.offset[name] + c]


class Zero12(Side):
    """ZeRO-1/2: all tensors flattened into one buffer (each aligned to `align` elements),
    padded, and cut into W equal partitions (plus `tail` elements of padding on each):
    tensors straddle rank boundaries. Partition i is location loc0 + i on `ranks[i]`."""

    def __init__(self, shapes, ranks, dtype=torch.float32, loc0=0, align=4, tail=1):
        self.shapes, self.ranks, self.dtype = shapes, list(ranks), dtype
        self.start, off = {}, 0
        for n, s in shapes.items():
            self.start[n] = off
            off = -(-(off + math.prod(s)) // align) * align
        self.part = -(-off // len(self.ranks)) + tail
        self.storages = {
            loc0 + i: rs.Storage(r, dtype, self.part) for i, r in enumerate(self.ranks)
        }
        self.loc0 = loc0

    def _cuts(self, name):
        """[(partition, first element, end element, offset in the partition)] of `name`."""
        g0, numel = self.start[name], math.prod(self.shapes[name])
        out = []
        for i in range(len(self.ranks)):
            lo, hi = max(g0, i * self.part), min(g0 + numel, (i + 1) * self.part)
            if lo < hi:
                out.append((i, lo - g0, hi - g0, lo - i * self.part))
        return out

    def tensor_layouts(self):
        return {
            n: rs.flat(shape, [(self.loc0 + i, a, b, o) for i, a, b, o in self._cuts(n)])
            for n, shape in self.shapes.items()
        }

    def write(self, name, full, bufs, rank):
        flat = full.reshape(-1)
        for i, a, b, o in self._cuts(name):
            if self.ranks[i] == rank:
                bufs[self.loc0 + i][o : o + b - a].copy_(flat[a:b])


class TensorParallel(Side):
    """Rollout buffers: for each TP group (a list of ranks; several groups = data-parallel
    replicas), per rank: embed split on vocab, a fused QKV buffer (q, k, v row blocks at
    offsets), o and fc2 split on the input dim, fc1 split on the output dim, and all norms
    replicated and packed into one `norms` buffer at offsets."""

    def __init__(self, shapes, groups, dtype=torch.bfloat16, loc0=100):
        self.shapes, self.groups, self.dtype = shapes, [list(g) for g in groups], dtype
        self.layers = sorted({int(n[1 : n.index(".")]) for n in shapes if n.startswith("l")})
        self.hidden, self.ffn, self.vocab = (
            shapes["norm"][0],
            shapes["l0.fc1"][0],
            shapes["embed"][0],
        )
        self.norm_names = [n for n, s in shapes.items() if len(s) == 1]
        self.storages, self.slot = {}, {}
        loc = loc0
        for g in self.groups:
            for t, r in enumerate(g):
                (_, hs), (_, fs), (_, vs) = self._blocks(len(g), t)
                h = self.hidden
                sizes = {"embed": vs * h, "norms": h * len(self.norm_names)}
                for i in self.layers:
                    sizes |= {f"l{i}.qkv": 3 * hs * h, f"l{i}.o": h * hs}
                    sizes |= {f"l{i}.fc1": fs * h, f"l{i}.fc2": h * fs}
                for key, numel in sizes.items():
                    self.storages[loc] = rs.Storage(r, dtype, numel)
                    self.slot[(r, key)] = loc
                    loc += 1

    def _blocks(self, tp, t):
        """(start, size) of TP rank t's block of hidden, ffn and vocab."""
        out = []
        for n in (self.hidden, self.ffn, self.vocab):
            sizes = uneven(n, tp)
            out.append((sum(sizes[:t]), sizes[t]))
        return out

    def tensor_layouts(self):
        pieces: dict[str, list] = {n: [] for n in self.shapes}
        h = self.hidden
        for g in self.groups:
            for t, r in enumerate(g):
                (h0, hs), (f0, fs), (v0, vs) = self._blocks(len(g), t)
                slot = {key: loc for (rr, key), loc in self.slot.items() if rr == r}
                pieces["embed"].append(rs.Piece(slot["embed"], 0, (v0, 0), (vs, h)))
                for j, n in enumerate(self.norm_names):
                    pieces[n].append(rs.Piece(slot["norms"], j * h, (0,), (h,)))
                for i in self.layers:
                    p = f"l{i}."
                    for j, part in enumerate("qkv"):
                        pieces[p + part].append(
                            rs.Piece(slot[p + "qkv"], j * hs * h, (h0, 0), (hs, h))
                        )
                    pieces[p + "o"].append(rs.Piece(slot[p + "o"], 0, (0, h0), (h, hs)))
                    pieces[p + "fc1"].append(rs.Piece(slot[p + "fc1"], 0, (f0, 0), (fs, h)))
                    pieces[p + "fc2"].append(rs.Piece(slot[p + "fc2"], 0, (0, f0), (h, fs)))
        return {n: rs.TensorLayout(self.shapes[n], p) for n, p in pieces.items()}

    def write(self, name, full, bufs, rank):
        for g in self.groups:
            if rank not in g:
                continue
            (h0, hs), (f0, fs), (v0, vs) = self._blocks(len(g), g.index(rank))
            h = self.hidden
            if name == "embed":
                key, off, part = "embed", 0, full[v0 : v0 + vs]
            elif full.dim() == 1:
                key, off, part = "norms", self.norm_names.index(name) * h, full
            else:
                layer, kind = name.split(".")
                fused = kind in ("q", "k", "v")
                key = f"{layer}.qkv" if fused else name
                off = "qkv".index(kind) * hs * h if fused else 0
                if kind == "o":
                    part = full[:, h0 : h0 + hs]
                elif kind == "fc1":
                    part = full[f0 : f0 + fs]
                elif kind == "fc2":
                    part = full[:, f0 : f0 + fs]
                else:
                    part = full[h0 : h0 + hs]
            bufs[self.slot[(rank, key)]][off : off + part.numel()].view(part.shape).copy_(part)


class Replicas(Side):
    """Full copies of every tensor, packed at offsets into one buffer per rank in `ranks`,
    with 3 elements of padding after each tensor."""

    def __init__(self, shapes, ranks, dtype=torch.float32, loc0=50):
        self.shapes, self.ranks, self.dtype = shapes, list(ranks), dtype
        self.offset, off = {}, 0
        for n, s in shapes.items():
            self.offset[n] = off
            off += math.prod(s) + 3
        self.loc = {r: loc0 + i for i, r in enumerate(self.ranks)}
        self.storages = {self.loc[r]: rs.Storage(r, dtype, off) for r in self.ranks}

    def tensor_layouts(self):
        return {
            n: rs.TensorLayout(
                s, [rs.Piece(self.loc[r], self.offset[n], (0,) * len(s), s) for r in self.ranks]
            )
            for n, s in self.shapes.items()
        }

    def write(self, name, full, bufs, rank):
        if rank in self.loc:
            flat = full.reshape(-1)
            bufs[self.loc[rank]][self.offset[name] : self.offset[name] + flat.numel()].copy_(flat)


class States(Side):
    """Several states of one geometry (an optimizer's master, exp_avg, exp_avg_sq): `make(loc0)`
    builds each state's side at its own locations (`stride` apart); tensors are named
    "state/tensor"."""

    def __init__(self, states, make, stride):
        self.parts = {s: make(i * stride) for i, s in enumerate(states)}
        first = next(iter(self.parts.values()))
        self.dtype = first.dtype
        self.shapes = {f"{s}/{n}": shape for s in states for n, shape in first.shapes.items()}
        self.storages = {k: v for side in self.parts.values() for k, v in side.storages.items()}

    def _split(self, name):
        state, tensor = name.split("/", 1)
        return self.parts[state], tensor

    def tensor_layouts(self):
        return {
            f"{s}/{n}": tl
            for s, side in self.parts.items()
            for n, tl in side.tensor_layouts().items()
        }

    def write(self, name, full, bufs, rank):
        side, tensor = self._split(name)
        side.write(tensor, full, bufs, rank)

    def chunk_view(self, name, bufs, rank):
        side, tensor = self._split(name)
        return side.chunk_view(tensor, bufs, rank)


def source_buffers(side: Side, values, rank, device="cpu") -> dict[int, torch.Tensor]:
    """This rank's source buffers; padding is NaN so that reading it would show."""
    bufs = side.empty(rank, float("nan"), device)
    for name, full in values.items():
        side.write(name, full, bufs, rank)
    return bufs


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    it = ints[a.element_size()]

    def bits(t):  # of the values a lazily conjugated or negated view stands for
        return t.cpu().resolve_conj().resolve_neg().view(it)

    return torch.equal(bits(a), bits(b))


def mismatches(got: dict, want: dict) -> list[str]:
    """Human-readable differences between two {loc: tensor} maps (empty if bitwise equal)."""
    bad = []
    if sorted(got) != sorted(want):
        bad.append(f"locations differ: got {sorted(got)}, want {sorted(want)}")
    for loc in sorted(set(got) & set(want)):
        g, w = got[loc].cpu(), want[loc].cpu()
        if bitwise_equal(g, w):
            continue
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
