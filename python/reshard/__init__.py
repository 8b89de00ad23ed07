"""reshard: move live, sharded training state between layouts without a whole-model gather.

See README.md for the quick start and docs/ for the design. `import reshard` loads the
compiled extension when it is built, so `torch.ops.reshard.*` are callable after it; without
a build the pure-data half (layout, plan) still works and the ops say how to build. Execution
names are resolved lazily, on first use.
"""

# Loads reshard._C (registering torch.ops.reshard.* and their fake impls) when it is built.
from ._ops import copy_runs
from .errors import (
    LayoutError,
    NotReadyError,
    PreflightError,
    TransferError,
    UnsupportedError,
)

# Geometry and planning are pure data and import eagerly.
from .layout import Layout, Piece, Storage, TensorLayout, flat, nest, replicated, split
from .planning import Plan, plan

__version__ = "0.1.0"

_LAZY = {
    # execution
    "execute": "executor",
    "Transfer": "executor",
    "Report": "report",
    "Stream": "stream",
}

__all__ = sorted(
    [
        *_LAZY,
        "Layout",
        "copy_runs",
        "Piece",
        "Plan",
        "Storage",
        "TensorLayout",
        "flat",
        "nest",
        "plan",
        "replicated",
        "split",
        "LayoutError",
        "NotReadyError",
        "PreflightError",
        "TransferError",
        "UnsupportedError",
    ]
)


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'reshard' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
