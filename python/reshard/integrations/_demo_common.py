"""The per-rank sync lines and the verdict every integration demo prints."""

from __future__ import annotations

KIB = 1 << 10


def print_sync(rank: int, what: str, rep: dict, held: int, bound: int) -> None:
    print(
        f"  rank {rank} {what:10s}: sent {rep['sent'] / KIB:8.1f} KiB, received "
        f"{rep['received'] / KIB:8.1f} KiB, local {rep['local'] / KIB:8.1f} KiB, "
        f"{rep['rounds']} rounds, {rep['total_s'] * 1e3:6.1f} ms, staging held "
        f"{held} B <= bound {bound} B"
    )


def verdict(results: list[dict], over: list[tuple[int, str]], equal_to: str, wall: float) -> int:
    """Prints the mismatches and staging-bound breaches, or OK; returns the exit code."""
    bad = [b for x in results for b in x["bad"]]
    if bad or over:
        for b in bad[:20]:
            print("  MISMATCH " + b)
        for r, what in over:
            print(f"  rank {r} {what}: staging held above the plan's bound")
        print(f"FAILED ({len(bad)} mismatches; wall {wall:.1f} s)")
        return 1
    checked = sum(x["elements_checked"] for x in results)
    print(f"OK: {checked} target elements bitwise equal to {equal_to} (wall {wall:.1f} s)")
    return 0
