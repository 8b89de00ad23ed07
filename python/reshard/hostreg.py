"""In-place page-locking of live CPU buffers (`cudaHostRegister`) for repeated syncs.

A pageable CPU source (DeepSpeed's ZeRO-3 fp32 masters, every Adam moment) must be bounced
through a pinned ring on every sync; registered in place, the same storage is DMA'd straight to
the GPU at the PCIe limit. `HostRegistry` registers each CPU buffer's whole storage once, keeps a
reference to the storage so it cannot be freed while registered, re-registers when a location's
storage changes identity, and undoes everything on `close()` / context exit / garbage collection.

    with HostRegistry() as reg:
        info = reg.sync({0: cpu_masters})   # registers once; later calls are no-ops
        ...                                 # stage_h2d(cpu_masters, ...) now goes direct

Registering is slow (page-locking gigabytes takes a large fraction of a second), so a registry
made with `background=True` registers on a thread instead: `sync` starts the work and returns
at once, syncs meanwhile bounce through the pinned ring, and a later `sync` (or `wait()`)
collects what the thread did. Page-locking changes no byte of the buffer, and the copy paths
ask the driver per call whether a buffer is page-locked, so a registration completing during a
sync is safe. Unregistering (a changed storage, `close()`) happens on the caller's thread
between syncs, after the thread finished.
"""

from __future__ import annotations

import threading
import time

import torch

__all__ = ["HostRegistry", "available"]


def available() -> bool:
    """Registration needs CUDA and reshard's CUDA build."""
    if not torch.cuda.is_available():
        return False
    from . import _ops

    return _ops.built_with_cuda()


class HostRegistry:
    """Registrations by location: {location: (storage, data_ptr, nbytes, registered_by_us)}."""

    def __init__(self, background: bool = False):
        self.background = background
        self._regs: dict = {}
        self._job = None  # a background registration: (thread, work, results)
        self._bytes = 0  # registered_bytes
        # the last pass over the buffers found every storage as registered (or not to be)
        # and nothing changed since: a sync of the same storages has nothing to do
        self._settled = False
        self.total_register_s = 0.0
        self.total_unregister_s = 0.0

    @property
    def registered_bytes(self) -> int:
        return self._bytes

    def sync(self, buffers: dict, unchanged: bool = False) -> dict:
        """Make every CPU tensor in `buffers` registered. Returns what this call did:
        {"registered": [locations], "unregistered": [locations], "already_pinned": [...],
        "seconds": float (on this thread), "registered_bytes": int (held now)}; with
        `background`, also "pending": [locations a thread is registering] and, once collected,
        "background_seconds" (the thread's time) and "error" (a registration that failed).

        unchanged: the caller knows that every location of `buffers` has the storage (address
        and bytes) it had in the previous call's, and the same locations are passed (a
        transfer's preflight proved it). After a pass that found nothing to do, such a call
        skips the pass over the buffers."""
        out = {"registered": [], "unregistered": [], "already_pinned": [], "seconds": 0.0}
        if not available():
            out["registered_bytes"] = 0
            return out
        t0 = time.perf_counter()
        self._collect(out, wait=False)
        if self._job is not None:  # still running: storage changes are handled afterwards
            out["pending"] = [w[0] for w in self._job[1]]
            self._settled = False  # these buffers were not looked at
        elif not (unchanged and self._settled):
            self._pass(buffers, out)
        out["seconds"] = time.perf_counter() - t0
        self.total_register_s += out["seconds"]
        out["registered_bytes"] = self.registered_bytes
        return out

    def _pass(self, buffers: dict, out: dict) -> None:
        """Compare every CPU buffer's storage with its location's registration; undo the
        changed ones and register what is new (on a thread with `background`)."""
        work = []
        for loc, t in buffers.items():
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.numel() == 0:
                continue
            st = t.untyped_storage()
            ptr, nbytes = st.data_ptr(), st.nbytes()
            old = self._regs.get(loc)
            if old is not None and old[1] == ptr and old[2] == nbytes:
                continue
            if old is not None:  # the location's storage changed: undo the old one first
                self._undo(loc)
                out["unregistered"].append(loc)
            work.append((loc, t, st, ptr, nbytes))
        self._settled = not work
        if work and self.background:
            results: list = []
            th = threading.Thread(
                target=_register_all,
                args=(work, torch.cuda.current_device(), results),
                name="reshard-hostreg",
                daemon=True,
            )
            self._job = (th, work, results)
            th.start()
            out["pending"] = [w[0] for w in work]
        elif work:
            results = []
            _register_all(work, None, results)
            self._merge(results, out)

    def wait(self) -> dict:
        """Wait for a background registration and collect it: what it did, as `sync` says."""
        out = {"registered": [], "already_pinned": []}
        self._collect(out, wait=True)
        out["registered_bytes"] = self.registered_bytes
        return out

    def _collect(self, out: dict, wait: bool) -> None:
        if self._job is None or (not wait and self._job[0].is_alive()):
            return
        th, _, results = self._job
        th.join()
        self._job = None
        self._merge(results, out)

    def _merge(self, results, out) -> None:
        for loc, st, ptr, nbytes, ours, err, seconds in results:
            if err is not None:
                out.setdefault("error", []).append(f"location {loc}: {err}")
            elif loc is not None:
                self._regs[loc] = (st, ptr, nbytes, ours)
                self._bytes += nbytes if ours else 0
                (out["registered"] if ours else out["already_pinned"]).append(loc)
            if seconds is not None:
                out["background_seconds"] = seconds
                self.total_register_s += seconds

    def _undo(self, loc) -> None:
        self._settled = False
        st, _, nbytes, ours = self._regs.pop(loc)
        if ours:
            self._bytes -= nbytes
            t0 = time.perf_counter()
            torch.ops.reshard.host_unregister(torch.empty(0, dtype=torch.uint8).set_(st))
            self.total_unregister_s += time.perf_counter() - t0

    def close(self) -> list:
        """Undo every registration (idempotent). Returns the locations undone."""
        self._collect({"registered": [], "already_pinned": []}, wait=True)
        done = []
        for loc in list(self._regs):
            self._undo(loc)
            done.append(loc)
        return done

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the CUDA context may be gone
            pass


def _register_all(work, device, results) -> None:
    """Registers each (location, tensor, storage, ptr, nbytes) of `work`, appending
    (location, storage, ptr, nbytes, registered by us, error, None) per item and, on a thread
    (`device` given), one final (None, ..., seconds) entry with the time it took."""
    t0 = time.perf_counter()
    if device is not None:
        torch.cuda.set_device(device)  # a new thread's current device is 0
    for loc, t, st, ptr, nbytes in work:
        try:
            ours = bool(torch.ops.reshard.host_register(t))
            results.append((loc, st, ptr, nbytes, ours, None, None))
        except RuntimeError as exc:
            results.append((loc, st, ptr, nbytes, False, str(exc), None))
    if device is not None:
        results.append((None, None, 0, 0, False, None, time.perf_counter() - t0))
