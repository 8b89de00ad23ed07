"""Planning: intersect two layouts into copy runs, pick replicas, cut rounds. Pure data.

`plan()` runs the global pass every rank runs alike and returns a frozen `Plan`: element
totals per (source storage, target storage) pair, the replica choice for tensors whose
source has replicas, rounds, segments, messages and the fingerprint. `schedule(plan, rank)`
builds one rank's copy runs from the pieces on its storages (`Plan.schedule(rank)` caches
it). See docs/planning.md for the algorithm and docs/internals.md for the schedule contract.

Modules, in the order of the algorithm: `records` (the types passed between steps and to
execution), `intersect` (batches, pieces, source regions, target templates, intersection),
`replicas` (replica choice), `totals` (the global pass), `rounds` (segments, messages,
arenas, the per-rank budget), `runs` (boxes to coalesced runs), `rank_schedule` (one rank's
schedule), `hashing` (the fingerprint), `planner` (`plan()` and `Plan`); `helpers` holds
small array functions.
"""

from .planner import Plan, plan
from .rank_schedule import schedule
from .records import ALIGN, LocalCopy, Message, RankSchedule, Segment, align, wire_dtype

__all__ = [
    "ALIGN",
    "LocalCopy",
    "Message",
    "Plan",
    "RankSchedule",
    "Segment",
    "align",
    "plan",
    "schedule",
    "wire_dtype",
]
