"""Driving reshard Transfers from a DeepSpeed training loop (RL weight sync after each step).

The geometry lives in deepspeed_live.py (describe); this module decides *when* to transfer
and runs the executor.
"""

from __future__ import annotations

import warnings

import reshard as rs
from reshard.executor import refuse

from .deepspeed_checks import check_alive, check_supported, watch_forwards
from .deepspeed_live import KINDS, describe


class SyncAfterStep:
    """Run reshard Transfers from a DeepSpeed engine after optimizer steps (RL weight sync).

        sync = rsds.SyncAfterStep(engine, {"param": (rollout_layout, rollout_buffers)}, every=1)
        for batch in data:
            loss = engine(batch); engine.backward(loss)
            sync.step()                 # engine.step(), then the transfer on the safe boundary
            report = sync.reports["param"]

    targets: {kind: (target Layout, target buffers of this rank)}. Buffers may be a callable
    returning the dict (rollout buffers that move). A transfer runs after every `every`-th
    applied step on an accumulation boundary; a step DeepSpeed skipped (fp16 loss-scale or bf16
    gradient overflow: `engine.was_step_applied()` is False) changed nothing and does not count.
    Each kind is described and planned once (moments lazily, once they exist); a kind whose
    LiveState has a reason since (storage replaced by load_checkpoint / offload_states, a
    parameter replaced on the module) is re-described and re-planned.

    The constructor communicates nothing: bad arguments raise at once; an engine check failing
    on this rank (unsupported, destroyed) warns and makes every sync() refuse on every rank.
    """

    def __init__(self, engine, targets, every=1, budget_bytes_per_peer=64 << 20, group=None):
        if not isinstance(targets, dict) or not targets:
            raise ValueError("targets must be a non-empty {kind: (layout, buffers)} dict")
        for kind, value in targets.items():
            if kind not in KINDS:
                raise ValueError(f"target kind must be one of {KINDS}, got {kind!r}")
            if not (isinstance(value, tuple) and len(value) == 2):
                raise ValueError(f"targets[{kind!r}] must be a (layout, buffers) pair")
        if int(every) < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        # The engine checks fail alike on every rank in practice, but one rank can differ (its
        # engine destroyed). The constructor communicates nothing (ranks that only receive
        # make no SyncAfterStep), so a failure here is remembered, warned about, and refused
        # through the first sync's preflight on every rank.
        self._failed = None
        try:
            check_supported(engine)
            check_alive(engine)
            watch_forwards(engine)
        except Exception as exc:  # noqa: BLE001 - refused by sync(), on every rank
            self._failed = (
                f"SyncAfterStep(engine, ...) failed on this rank: {type(exc).__name__}: {exc}"
            )
            warnings.warn(self._failed + " (every sync() will refuse)", stacklevel=2)
        self.engine = engine
        self.targets = dict(targets)
        self.every = int(every)
        self.budget = int(budget_bytes_per_peer)
        self.group = group
        self.applied_steps = 0
        self.syncs = 0
        self.reports = {}  # kind -> the Report of the latest transfer
        self._live = {}
        self._transfers = {}

    def step(self, *args, **kwargs):
        """engine.step(...), then sync() if this was the every-th applied boundary step."""
        boundary = self.engine.is_gradient_accumulation_boundary()
        out = self.engine.step(*args, **kwargs)
        if boundary and self.engine.was_step_applied():
            self.applied_steps += 1
            if self.applied_steps % self.every == 0:
                self.sync()
        return out

    def sync(self) -> dict:
        """Transfer every target now (the caller vouches for the safe boundary); {kind: Report}.

        Collective: whatever fails on this rank before a kind's transfer (the constructor's
        engine checks, the target-buffers callable, describing the kind again, planning) is
        refused through that transfer's preflight, so every rank raises the same
        PreflightError naming this rank and the cause instead of this rank raising alone while
        its peers wait in the transfer."""
        _synchronize()
        for kind, (dst_layout, dst_buffers) in self.targets.items():
            if self._failed is not None:
                refuse(None, [self._failed], group=self.group)
            failed = None
            buffers = None
            try:
                buffers = dst_buffers() if callable(dst_buffers) else dst_buffers
            except Exception as exc:  # noqa: BLE001 - refused below, on every rank
                failed = f"the {kind!r} target buffers callable raised {type(exc).__name__}: {exc}"
            # After the callable (user code), so the findings are those the transfer meets.
            live = self._live.get(kind)
            src = live
            try:
                # reasons() once per sync: a cached state with none goes in as their result
                # (_Checked); a stale one is described again and goes in whole, so preflight
                # runs the fresh state's check() on every rank
                if live is not None and not live.reasons():
                    src = _Checked(live)
                else:
                    src = live = None
                    src = live = describe(self.engine, kind, group=self.group)
                    self._live[kind] = live
                    self._transfers.pop(kind, None)
            except Exception as exc:  # noqa: BLE001 - refused below, as above
                failed = failed or (
                    f"describe(engine, {kind!r}) failed: {type(exc).__name__}: {exc}"
                )
            transfer = self._transfers.get(kind)
            if transfer is None and live is not None:
                try:
                    transfer = rs.Transfer(
                        live.layout, dst_layout, budget_bytes_per_peer=self.budget, group=self.group
                    )
                    self._transfers[kind] = transfer
                except Exception as exc:  # noqa: BLE001 - refused below, as above
                    failed = failed or (
                        f"planning the {kind!r} transfer failed: {type(exc).__name__}: {exc}"
                    )
            if failed is not None:
                # without a plan of its own (describe failed) this rank's fingerprint is not
                # compared: its peers may have planned from their fresh describe()
                if live is None or transfer is None:
                    refuse(None, [failed], group=self.group)
                transfer.refuse([failed])
            self.reports[kind] = transfer(src, buffers)
        self.syncs += 1
        return dict(self.reports)


class _Checked:
    """A LiveState whose reasons() this sync found empty just before its transfer: its buffers,
    layout and kind without the readiness hook, which would only compute them again. The kind
    is kept: the preflight compares it, so ranks whose syncs run their kinds in another order
    (exp_avg and exp_avg_sq share one plan) are refused instead of swapping the states."""

    __slots__ = ("buffers", "kind", "layout")

    def __init__(self, live):
        self.buffers = live.buffers
        self.layout = live.layout
        self.kind = live.kind


def _synchronize():
    # ZeRO-1/2 with offload returns from step() with a non_blocking H2D copy queued; reads on
    # another stream or on the host must not start before it lands.
    from deepspeed.accelerator import get_accelerator

    get_accelerator().synchronize()
