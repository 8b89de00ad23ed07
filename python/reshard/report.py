"""What one transfer did on one rank: bytes per peer, rounds, time per phase, staging held."""

from __future__ import annotations

from dataclasses import dataclass, field

# Every report carries every phase, so code that reads `report.seconds["h2d"]` never needs a
# `.get`: phases a transport does not have stay 0.0.
PHASES = (
    "plan",
    "preflight",
    "exchange",
    "pack",
    "h2d",
    "transport",
    "d2h",
    "unpack",
    "local",
    "total",
)
STAGING_KINDS = ("device", "host_pinned", "host")


def _zero_phases() -> dict[str, float]:
    return dict.fromkeys(PHASES, 0.0)


def _zero_staging() -> dict[str, int]:
    return dict.fromkeys(STAGING_KINDS, 0)


@dataclass
class Report:
    """One rank's account of one transfer (returned by `execute` and `Transfer.__call__`).

    bytes_sent / bytes_received: wire bytes per peer (group ranks), local copies excluded:
        what travels (a message's padding between its wires does not), as `plan.pair_bytes`.
    local_bytes: bytes copied source -> target on this rank without transport (target dtype).
    zero_copy_bytes: of the wire bytes sent + received, those that went straight from a source
        buffer or into a target buffer (a message that is one contiguous range of the same
        dtype there), skipping the pack / unpack copy and the arenas.
    seconds: host wall time per phase (PHASES); "plan" is non-zero only on the call that
        planned; "exchange" is the collective part of "preflight" (it includes waiting for
        the slowest rank to arrive). Phases overlap (pack of round k+1 runs while round k is in flight), so they
        need not add up to "total".
    peak_staging_bytes: staging actually held by the executor during the call, by kind;
        never above `staging_bound` (= plan.staging_bytes(rank, ...)).
    host_registration: what a Transfer built with register_host_sources /
        register_host_targets did to page-lock CPU buffers on this call (reshard.hostreg;
        the targets' account under "targets"); None when neither was asked for.
    """

    rank: int
    world_size: int
    transport: str  # "gloo" | "nccl" | "local" (no process group)
    rounds: int
    fingerprint: str
    bytes_sent: dict[int, int] = field(default_factory=dict)
    bytes_received: dict[int, int] = field(default_factory=dict)
    local_bytes: int = 0
    zero_copy_bytes: int = 0
    seconds: dict[str, float] = field(default_factory=_zero_phases)
    peak_staging_bytes: dict[str, int] = field(default_factory=_zero_staging)
    staging_bound: dict[str, int] = field(default_factory=_zero_staging)
    host_registration: dict | None = None

    @property
    def total_bytes_sent(self) -> int:
        return sum(self.bytes_sent.values())

    @property
    def total_bytes_received(self) -> int:
        return sum(self.bytes_received.values())

    @property
    def gbps(self) -> float:
        """(sent + received + local) bytes per second of total wall time, in GB/s (1e9)."""
        moved = self.total_bytes_sent + self.total_bytes_received + self.local_bytes
        total = self.seconds.get("total", 0.0)
        return moved / total / 1e9 if total > 0 else 0.0

    def summary(self) -> str:
        """A few human-readable lines (the demo prints this)."""
        s = self.seconds
        phases = " ".join(f"{p}={s[p] * 1e3:.2f}ms" for p in PHASES if p != "total" and s[p])
        held = ", ".join(
            f"{k} {self.peak_staging_bytes[k]}/{self.staging_bound[k]} B" for k in STAGING_KINDS
        )
        return (
            f"rank {self.rank}/{self.world_size} [{self.transport}] {self.rounds} rounds: "
            f"sent {self.total_bytes_sent} B to {len(self.bytes_sent)} peers, received "
            f"{self.total_bytes_received} B from {len(self.bytes_received)} peers "
            f"({self.zero_copy_bytes} B of both zero-copy), local {self.local_bytes} B in "
            f"{s['total'] * 1e3:.2f} ms ({self.gbps:.3f} GB/s)\n"
            f"  phases: {phases or '-'}\n"
            f"  staging held/bound: {held}"
        )
