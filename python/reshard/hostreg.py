"""In-place page-locking of live CPU buffers (`cudaHostRegister`) for repeated syncs.

A pageable CPU source (DeepSpeed's ZeRO-3 fp32 masters, every Adam moment) must be bounced
through a pinned ring on every sync; registered in place, the same storage is DMA'd straight to
the GPU at the PCIe limit. `HostRegistry` registers each CPU buffer's whole storage once, keeps a
reference to the storage so it cannot be freed while registered, re-registers when a location's
storage changes identity, and undoes everything on `close()` / context exit / garbage collection.

    with HostRegistry() as reg:
        info = reg.sync({0: cpu_masters})   # registers once; later calls are no-ops
        ...                                 # stage_h2d(cpu_masters, ...) now goes direct
"""

from __future__ import annotations

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

    def __init__(self):
        self._regs: dict = {}
        self.total_register_s = 0.0
        self.total_unregister_s = 0.0

    @property
    def registered_bytes(self) -> int:
        return sum(nb for _, _, nb, ours in self._regs.values() if ours)

    def sync(self, buffers: dict) -> dict:
        """Make every CPU tensor in `buffers` registered. Returns what this call did:
        {"registered": [locations], "unregistered": [locations], "already_pinned": [...],
        "seconds": float, "registered_bytes": int (held now)}."""
        out = {"registered": [], "unregistered": [], "already_pinned": [], "seconds": 0.0}
        if not available():
            out["registered_bytes"] = 0
            return out
        t0 = time.perf_counter()
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
            ours = bool(torch.ops.reshard.host_register(t))
            self._regs[loc] = (st, ptr, nbytes, ours)
            (out["registered"] if ours else out["already_pinned"]).append(loc)
        out["seconds"] = time.perf_counter() - t0
        self.total_register_s += out["seconds"]
        out["registered_bytes"] = self.registered_bytes
        return out

    def _undo(self, loc) -> None:
        st, _, _, ours = self._regs.pop(loc)
        if ours:
            t0 = time.perf_counter()
            torch.ops.reshard.host_unregister(torch.empty(0, dtype=torch.uint8).set_(st))
            self.total_unregister_s += time.perf_counter() - t0

    def close(self) -> list:
        """Undo every registration (idempotent). Returns the locations undone."""
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
