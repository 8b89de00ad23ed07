"""Compare geometry and planning with an older commit: same layouts, same plans.

    python tests/plan_ab.py REV [--examples N]

Loads the geometry and planning code of git revision REV (`layout.py` and `plan.py`, or the
packages `layout/` and `planning/`, with the modules they import) into a throwaway package, then (1) calls the old and the current builders (`flat`, `split`,
`replicated`, `nest`) with the same random arguments and compares the pieces they produce,
and (2) plans the random layout pairs of tests/test_plan.py (small and large) with both
planners and compares everything a plan says: fingerprint, rounds, budgets, bytes per pair,
`describe()`, staging bounds, every rank's schedule (descriptor tables included) and all
runs; also with a per-rank budget and with small planning batches. A restructuring of
geometry or planning must keep every one of these identical. Not a pytest module: it needs
a git checkout and is run by hand before landing such a change.
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import test_plan as tp  # noqa: E402  (the layout strategies)

import reshard as rs  # noqa: E402


def load_old(rev: str):
    """(layout module, planner module) of `rev`, as the package `reshard_old`: the single
    modules layout.py and plan.py, or the packages layout/ and planning/."""
    root = Path(tempfile.mkdtemp(prefix="reshard_old_"))
    paths = subprocess.run(
        [
            "git",
            "-C",
            str(HERE),
            "ls-tree",
            "-r",
            "--full-tree",
            "--name-only",
            rev,
            "python/reshard/",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    wanted = ("errors.py", "staging_bound.py", "layout.py", "plan.py", "layout/", "planning/")
    for path in paths:
        rel = path[len("python/reshard/") :]
        if not rel.startswith(wanted):
            continue
        dest = root / "reshard_old" / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(
            subprocess.run(
                ["git", "-C", str(HERE), "show", f"{rev}:{path}"], check=True, capture_output=True
            ).stdout
        )
    (root / "reshard_old" / "__init__.py").write_text("")
    sys.path.insert(0, str(root))
    layout = importlib.import_module("reshard_old.layout")
    planner = "reshard_old.planning" if (root / "reshard_old" / "planning").is_dir() else None
    return layout, importlib.import_module(planner or "reshard_old.plan")


def table(tl):
    """(location, offset, start, shape, strides) arrays of a TensorLayout, old or new."""
    t = getattr(tl, "table", None)
    return tuple(t) if t is not None else tl._arrays()


def same_tl(a, b):
    return a.shape == b.shape and all(
        np.array_equal(x, y) for x, y in zip(table(a), table(b), strict=True)
    )


def to_old(layout, old):
    def convert(name, tl):
        if hasattr(old.TensorLayout, "from_table"):
            t = old.PieceTable.of(len(tl.shape), *table(tl))
            return old.TensorLayout.from_table(tl.shape, t, name=name, covered=True)
        return old.TensorLayout._from_arrays(tl.shape, *table(tl), name=name, covered=True)

    tens = {name: convert(name, tl) for name, tl in layout.tensors.items()}
    st_ = {loc: old.Storage(s.rank, s.dtype, s.numel) for loc, s in layout.storages.items()}
    return old.Layout(tens, st_)


def plan_key(p):
    ranks = p.ranks()
    return {
        "fingerprint": p.fingerprint,
        "rounds": p.num_rounds,
        "budget": (p.budget_bytes_per_peer, p.budget_bytes_per_rank),
        "pairs": p.pair_bytes(),
        "local": p.local_bytes(),
        "storage_pairs": p.num_storage_pairs,
        "describe": p.describe(),
        "repr": repr(p),
        "staging": [
            (r, p.staging_bytes(r), p.staging_bytes(r, transport="gloo", host_ring_bytes=7))
            for r in ranks
        ],
        "schedules": [(r, tp._schedule_key(p.schedule(r))) for r in ranks],
        "runs": p.runs.tolist(),
    }


def batch_constant(package):
    """(module, name) of the batch size of a planner: the single module plan.py or a
    planning package (`package`, default the current one)."""
    if package is not None and hasattr(package, "_BATCH_PIECES"):
        return package, "_BATCH_PIECES"
    name = package.__name__ if package is not None else "reshard.planning"
    return importlib.import_module(f"{name}.intersect"), "BATCH_PIECES"


def compare_plans(src, dst, budget, rank_budget, old_layout, old_plan, batch):
    old_src, old_dst = to_old(src, old_layout), to_old(dst, old_layout)
    kw = {} if rank_budget is None else {"budget_bytes_per_rank": rank_budget}
    results = []
    for make, (mod, attr), a, b in (
        (old_plan.plan, batch_constant(old_plan), old_src, old_dst),
        (rs.plan, batch_constant(None), src, dst),
    ):
        saved = getattr(mod, attr)
        setattr(mod, attr, batch or saved)
        try:
            results.append(plan_key(make(a, b, budget, **kw)))
        except ValueError as exc:  # LayoutError included: both must refuse alike
            results.append(("refused", type(exc).__name__, str(exc)))
        finally:
            setattr(mod, attr, saved)
    assert results[0] == results[1], diff(*results)


def diff(a, b):
    if not isinstance(a, dict) or not isinstance(b, dict):
        return f"old {a!r}\nnew {b!r}"
    return "\n".join(f"{k}: old {a[k]!r}\n   new {b.get(k)!r}" for k in a if a[k] != b.get(k))


def random_builder_args(rng):
    d = int(rng.integers(1, 4))
    shape = tuple(int(x) for x in rng.integers(0, 7, d))
    return d, shape


def compare_builders(old, rng, n):
    for _ in range(n):
        d, shape = random_builder_args(rng)
        numel = int(np.prod(shape))
        cuts = sorted(int(x) for x in rng.integers(0, numel + 1, int(rng.integers(0, 5))))
        edges = [0, *cuts, numel]
        runs = [
            (i, a, b, int(rng.integers(0, 3))) for i, (a, b) in enumerate(zip(edges, edges[1:]))
        ]
        assert same_tl(rs.flat(shape, runs), old.flat(shape, runs)), ("flat", shape, runs)
        dim = int(rng.integers(0, d))
        parts = int(rng.integers(1, 4))
        cut = sorted(int(x) for x in rng.integers(0, shape[dim] + 1, parts - 1))
        sizes = [b - a for a, b in zip([0, *cut], [*cut, shape[dim]])]
        locs = [[int(x) for x in rng.integers(0, 9, int(rng.integers(1, 3)))] for _ in sizes]
        offs = [int(x) for x in rng.integers(0, 5, len(sizes))]
        new_s = rs.split(shape, dim, sizes, locs, offsets=offs)
        old_s = old.split(shape, dim, sizes, locs, offsets=offs)
        assert same_tl(new_s, old_s), ("split", shape, dim, sizes, locs, offs)
        reps = [int(x) for x in rng.integers(0, 9, int(rng.integers(1, 4)))]
        assert same_tl(rs.replicated(shape, reps), old.replicated(shape, reps))
        # nest: each split holder ZeRO-partitioned over a few storages
        inner_new, inner_old = {}, {}
        extent = {}
        for p in new_s.pieces:
            end = p.offset + int(np.prod(p.shape))
            extent[p.location] = max(extent.get(p.location, 0), end)
        for loc, v in extent.items():
            v += int(rng.integers(0, 2))
            w = int(rng.integers(1, 4))
            part = -(-v // w) if v else 0
            fr = [(100 + 10 * loc + i, i * part, min(v, (i + 1) * part), 1) for i in range(w)]
            fr = [r for r in fr if r[1] < r[2]]
            inner_new[loc] = rs.flat((v,), fr) if v else rs.replicated((0,), [loc])
            inner_old[loc] = old.flat((v,), fr) if v else old.replicated((0,), [loc])
        assert same_tl(rs.nest(new_s, inner_new), old.nest(old_s, inner_old)), ("nest", shape)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rev", help="git revision whose planner is the reference")
    ap.add_argument("--examples", type=int, default=300)
    args = ap.parse_args()
    old_layout, old_plan = load_old(args.rev)
    compare_builders(old_layout, np.random.default_rng(0), args.examples)
    print(f"builders: {args.examples} random argument sets, identical pieces")
    count = [0]

    @settings(
        max_examples=args.examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        st.one_of(tp.layout_pair(), tp.layout_pair(big=True)),
        st.one_of(st.none(), st.integers(16, 1 << 14)),
        st.sampled_from([None, None, 2, 5]),
    )
    def check(case, rank_budget, batch):
        src, dst, budget = case
        compare_plans(src, dst, budget, rank_budget, old_layout, old_plan, batch)
        count[0] += 1

    check()
    print(f"plans: {count[0]} random layout pairs, identical fingerprints, schedules and runs")


if __name__ == "__main__":
    main()
