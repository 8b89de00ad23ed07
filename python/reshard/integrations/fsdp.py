"""Live FSDP2 (`fully_shard`) state as reshard Layouts (docs/fsdp.md).

`describe(module, kind, optimizer=None)` says where every element of every parameter's `kind`
lives across the ranks of the FSDP2 mesh, as an `rs.Layout` identical on every rank, plus this
rank's live storage views (never copies). Tensor names are `module.named_parameters()` names,
as in the DeepSpeed integration, so layouts of both frameworks plan against each other.

- "param": the sharded parameters FSDP2 keeps between steps: DTensors whose local tensor is a
  view into each FSDPParam's padded shard (`_sharded_param_data`). Under a
  `MixedPrecisionPolicy` these stay in the parameter's own dtype (fp32): the `param_dtype` copy
  exists only while unsharded. Under `CPUOffloadPolicy` they live in CPU memory.
- "exp_avg" | "exp_avg_sq" | "max_exp_avg_sq" (amsgrad) of a torch.optim optimizer (Adam,
  AdamW, and torch's other Adam-family ones): the moment of every parameter of `module` that
  the optimizer holds state for, keyed by the sharded parameter; a DTensor with the
  parameter's placements, in its own dtype.
- any other key of the optimizer's per-parameter state ("momentum_buffer" of SGD, "sum" of
  Adagrad, "exp_inf" of Adamax, a user optimizer's own, Adam's names included): the tensor
  under that key of every parameter whose state holds it, placed like its parameter (a
  DTensor with its placements and global shape, or a plain tensor of its local shard's
  shape). Keys known to hold something else (the "step" counter, NAdam's "mu_product", Adafactor's factored variances) are refused.

The geometry is the parameters' DTensor placements (reshard.integrations.dtensor_geometry): FSDP shards
dim 0 (or `shard_placement_fn`'s dim) with torch.chunk sizes, so the last ranks hold fewer rows
or none; FSDP2 pads their shard to equal size, and that padding lies outside the local tensor,
so no piece covers it and a transfer never reads or writes it. HSDP adds a Replicate mesh dim
(replicas); FSDP2 over TP places `_StridedShard` on the data-parallel mesh dim.

`describe()` raises only for what every rank of the same program sees alike (arguments,
configuration, DTensor specs). A fault in one rank's own state (unsharded, an unshard in flight,
no optimizer state yet, a moment or state key missing or placed otherwise, an optimizer holding
none of the module's parameters or without amsgrad for max_exp_avg_sq) is kept as a reason
`check()` raises: the transfer's preflight runs it on every rank, so all ranks refuse together
instead of one raising alone while the others wait in the transfer.
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import replace

from reshard.errors import UnsupportedError

from ._module_tree import ModuleTree
from .dtensor import describe_entries
from .dtensor_geometry import (
    PlacementOp,
    check_group,
    entry,
    mesh_ranks,
    placement_ops,
    segments,
)

KINDS = ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
_MOMENTS = KINDS[1:]

# Per-parameter state keys that torch.optim keeps in another shape than the parameter: refused
# by name (the optimizer's class, which every rank shares), not by this rank's state, so that
# every rank raises alike; a user optimizer's other keys are judged by the state (`check()`).
# {key: (the torch.optim class names that keep it, or None for every optimizer, what it is)}
_NOT_PLACED = {
    "step": (None, "the step counter: one scalar per parameter"),
    "mu_product": (("NAdam",), "the product of NAdam's momentum coefficients: a scalar"),
    "eta": (("ASGD",), "ASGD's step size: a scalar"),
    "mu": (("ASGD",), "ASGD's averaging coefficient: a scalar"),
    "row_var": (("Adafactor",), "Adafactor's factored row variance (the last dim reduced)"),
    "col_var": (("Adafactor",), "Adafactor's factored column variance (a dim reduced)"),
}

__all__ = ["KINDS", "describe", "init_adam_state"]


def _fsdp_groups(module):
    """Every FSDPParamGroup of `module` or its submodules, in module order."""
    from torch.distributed.fsdp import FSDPModule

    out, seen, sharded = [], set(), False
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        sharded = True
        try:
            state = m._get_fsdp_state()
            if hasattr(state, "_fsdp_param_groups"):  # newer torch: a list per module
                groups = state._fsdp_param_groups
            else:
                groups = [g for g in (state._fsdp_param_group,) if g is not None]
        except AttributeError as exc:
            raise UnsupportedError(
                f"this torch's FSDP2 keeps its state differently ({exc}): reshard reads "
                "FSDPState._fsdp_param_group(s) as torch 2.13 keeps it"
            ) from None
        for group in groups:
            if id(group) not in seen:  # fully_shard([a, b]) shares one group
                seen.add(id(group))
                out.append(group)
    if not sharded:
        raise UnsupportedError(
            f"describe() needs a module with fully_shard() applied, got {type(module).__name__} "
            "without FSDP2 parameters"
        )
    if not any(g.fsdp_params for g in out) and next(module.parameters(), None) is None:
        # an empty layout would move nothing and say nothing: most likely the wrong module
        # (parameters all in ignored_params are named by `_params`)
        raise UnsupportedError(
            f"{type(module).__name__} has fully_shard() applied but no parameters: nothing to "
            "describe (an empty model, or another module than the one meant?)"
        )
    return out


def _fsdp_params(module):
    """Every FSDPParam managed by `module` or its submodules, in module order."""
    return [fp for g in _fsdp_groups(module) for fp in g.fsdp_params]


def _gathering(group) -> bool:
    """True while `unshard(async_op=True)` of the group was not waited for: its parameters
    still say SHARDED, but an all-gather of them is in flight and the next forward (or the
    handle's wait()) installs what it gathered, not what a transfer wrote since."""
    return getattr(group, "_all_gather_result", None) is not None


def _params(module):
    """(FSDPParamGroups, [(name, FSDPParam)] in sorted-name order) of every parameter of
    `module`; UnsupportedError for a parameter no fully_shard() under `module` manages.

    From FSDP2's own records (each FSDPParam's module and attribute name, shared ones
    included), not from what the module holds now: while unsharded the module holds the
    unsharded tensors, and FSDP2 keeps the sharded DTensor (`sharded_param`) in every state.
    So the layout is the same on every rank whatever each rank's sharded state, and a rank
    that is not ready says so in `check()` (every rank refuses together) instead of raising
    here alone. Names are `module.named_parameters()` names: the first slot of a shared one.
    """
    groups = _fsdp_groups(module)
    owner = {}
    for g in groups:
        for fp in g.fsdp_params:
            info = fp._module_info
            owner[(id(info.module), info.param_name)] = fp
            for m, n in zip(info.shared_modules, info.shared_param_names, strict=True):
                owner[(id(m), n)] = fp
    out, plain, seen = [], [], set()
    for prefix, m in _named_modules(module):
        for attr, p in m._parameters.items():
            if p is None:
                continue
            fp = owner.get((id(m), attr))
            key = id(p) if fp is None else id(fp)
            if key in seen:
                continue
            seen.add(key)
            name = f"{prefix}.{attr}" if prefix else attr
            (plain if fp is None else out).append((name, fp))
    if plain:
        raise UnsupportedError(
            f"parameters {[n for n, _ in plain[:8]]} are not managed by fully_shard() under "
            "this module: call fully_shard() on the module that owns them (e.g. the root). "
            "Parameters passed as fully_shard(ignored_params=) are not FSDP2 state: describe "
            "a submodule without them, and them with rsdt.describe (as DTensors)"
        )
    # sorted like dtensor.describe: location ids follow sorted names (docs/fsdp.md)
    return groups, sorted(out, key=operator.itemgetter(0))


def _named_modules(module):
    """`module.named_modules()` with the `_orig_mod` of every torch.compile wrapper
    (OptimizedModule) left out of the names, as torch.distributed.checkpoint leaves it out of
    its keys: the compiled and the plain module describe the same names, which a rollout
    target or a DeepSpeed layout of the same model has."""
    import sys

    # no torch.compile wrapper exists unless dynamo was imported (importing it costs seconds)
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(dynamo, "OptimizedModule", ())
    clean = {}
    for prefix, m in module.named_modules():
        parent, _, last = prefix.rpartition(".")
        if not prefix:
            clean[prefix] = ""
        elif last == "_orig_mod" and isinstance(module.get_submodule(parent), wrapper):
            clean[prefix] = clean[parent]
        else:
            clean[prefix] = f"{clean[parent]}.{last}" if clean[parent] else last
        yield clean[prefix], m


def _not_ready(module, groups, params):
    """The reasons the parameters of `module` (`params`: [(name, FSDPParam)]) must not be
    read or written now: any not in its sharded state, any group with an all-gather in flight,
    any whose module holds another object than FSDP2's sharded parameter. [] when none."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    prefix = {id(m): n for n, m in _named_modules(module)}
    bad, foreign = [], []
    for g in groups:
        if _gathering(g):
            names = [prefix.get(id(m), "?") or "(root)" for m in g.modules]
            bad.append(f"{', '.join(names)} (unshard(async_op=True) not waited for)")
    for name, fp in params:
        if fp.sharded_state != ShardedState.SHARDED:
            bad.append(f"{name} ({fp.sharded_state.name})")
            continue
        info = fp._module_info
        if info.module._parameters.get(info.param_name) is not fp.sharded_param:
            foreign.append(name)
    out = []
    if bad:
        out.append(
            f"FSDP2 parameters are not sharded: {', '.join(bad[:8])}"
            f"{' ...' if len(bad) > 8 else ''} (between forward and backward, after a "
            "forward with reshard_after_forward=False, or after unshard()): the safe boundary "
            "is after optimizer.step(), before the next forward; or wait() on an async "
            "unshard's handle and call reshard() on every FSDP module"
        )
    if foreign:
        out.append(
            f"parameters {foreign[:8]} are not FSDP2's sharded parameters (another tensor "
            "was assigned to the module attribute outside FSDP2): FSDP2 all-gathers its own "
            "sharded parameter, not this one; restore it, or load_state_dict(assign=True) "
            "(FSDP2 adopts what it assigns) and describe() again"
        )
    return out


def _ops(name, p):
    """The parameter's placements as geometry ops, cross-checked against FSDP2's own sharding.

    FSDP2 over TP shards the TP-local tensor, which DTensor expresses as `_StridedShard` on the
    data-parallel mesh dim. The storage truth is FSDP2's order (TP placements, then FSDP's
    chunk of the local tensor); where uneven sizes make that differ from the DTensor spec,
    DTensor's own redistribution would be wrong too: refuse.
    """
    spec = p._spec
    ops = placement_ops(name, spec.placements, p.ndim)
    strided = [op for op in ops if op.kind == "strided"]
    if strided:
        import numpy as np

        fsdp_order = [op for op in ops if op.kind != "strided"]
        fsdp_order += [PlacementOp(op.mesh_dim, "shard", op.dim, 1) for op in strided]
        mesh_shape = mesh_ranks(spec.mesh).shape
        for coord in np.ndindex(*mesh_shape):
            a = segments(tuple(p.shape), mesh_shape, coord, ops)
            b = segments(tuple(p.shape), mesh_shape, coord, fsdp_order)
            if a != b:
                raise UnsupportedError(
                    f"{name!r}: FSDP2 over TP with shape {tuple(p.shape)} on mesh "
                    f"{mesh_shape} stores rows that its DTensor placements {spec.placements} "
                    f"do not describe (uneven strided sharding at mesh coordinate {coord}): "
                    "use sizes the TP and FSDP degrees divide"
                )
    return ops


def _local_of(t):
    """The local tensor of a DTensor; a plain tensor is its own."""
    return getattr(t, "_local_tensor", t)


def _state_problem(name, p, state, kind):
    """Why this rank's `state[kind]` of parameter `p` (a key other than the Adam moments, held
    by its state) is not placed like `p`; None when it is: a DTensor with p's placements, mesh
    and global shape, or a plain tensor of p's local shard's shape (an optimizer stepping
    `p.to_local()`). Only this rank sees it: a reason for `check()`, never a raise."""
    import torch
    from torch.distributed.tensor import DTensor

    m = state[kind]
    local = tuple(p._local_tensor.shape)
    if isinstance(m, DTensor):
        if m._spec.placements == p._spec.placements and m._spec.mesh == p._spec.mesh:
            if tuple(m.shape) == tuple(p.shape):
                return None
        what = f"a DTensor placed {m.placements} of shape {tuple(m.shape)}"
        if m._spec.mesh != p._spec.mesh:
            mine, its = m.device_mesh.mesh.tolist(), p.device_mesh.mesh.tolist()
            what += f" on another mesh (ranks {mine}, its parameter's {its})"
    elif isinstance(m, torch.Tensor):
        if tuple(m.shape) == local:
            return None
        what = f"a {type(m).__name__} of shape {tuple(m.shape)} on this rank"
    else:
        what = f"a Python {type(m).__name__}"
    return (
        f"{name!r}: {kind} is {what}, not placed like its parameter (a DTensor placed "
        f"{p.placements} of shape {tuple(p.shape)}, or a tensor of its local shard's shape "
        f"{local}): only per-element state moves; set scalars and other state on the target"
    )


def _adam_moment(kind, optimizer) -> bool:
    """Whether `kind` of `optimizer` follows Adam's rules (every parameter with state has it,
    a DTensor; max_exp_avg_sq only in amsgrad groups): an Adam moment name of one of
    torch.optim's own optimizers, whose state torch defines. A user optimizer's state under
    these names is a key like any other: it may keep it for some parameters only (a hybrid
    optimizer), as a plain local tensor, or without amsgrad."""
    return kind in _MOMENTS and _torch_optimizer(optimizer)


def _torch_optimizer(optimizer) -> bool:
    """An optimizer of torch.optim's own classes (not a user's, even one subclassing them)."""
    module = type(optimizer).__module__
    return module == "torch.optim" or module.startswith("torch.optim.")


def _moment_problem(name, p, state, kind, opt_name, adam):
    """Why this rank's `kind` moment of parameter `p` (which has state) cannot be described;
    None when it can. adam: `_adam_moment(kind, optimizer)`. Only this rank sees its
    optimizer's state: a reason for `check()`, never a raise."""
    from torch.distributed.tensor import DTensor

    if kind not in state:
        return f"{name!r}: {opt_name} keeps no {kind!r} state for it (keys {sorted(state)})"
    if not adam:
        return _state_problem(name, p, state, kind)
    m = state[kind]
    if not isinstance(m, DTensor) or m._spec.placements != p._spec.placements:
        what = m.placements if isinstance(m, DTensor) else type(m).__name__
        return f"{name!r}: {kind} is {what}, not a DTensor placed like its parameter {p.placements}"
    if tuple(m.shape) != tuple(p.shape) or m._spec.mesh != p._spec.mesh:
        return f"{name!r}: {kind} has another shape or mesh than its parameter"
    return None


def _check_args(module, kind, optimizer):
    import torch

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(kind, str) or not kind or (kind not in KINDS and optimizer is None):
        raise ValueError(
            f"kind must be one of {KINDS} or a key of the optimizer's per-parameter state "
            f"(with optimizer=), got {kind!r}"
        )
    if kind in _MOMENTS and optimizer is None:
        raise ValueError(f"kind {kind!r} needs the optimizer: describe(module, kind, optimizer=)")
    if kind == "param" and optimizer is not None:
        raise ValueError("kind 'param' takes no optimizer")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if kind in _NOT_PLACED:
        keepers, what = _NOT_PLACED[kind]
        classes = [getattr(torch.optim, c, None) for c in keepers or ()]
        if keepers is None or isinstance(optimizer, tuple(c for c in classes if c)):
            raise UnsupportedError(
                f"{type(optimizer).__name__}'s {kind!r} is {what}, not a tensor placed like its "
                "parameter: describe() moves per-element state only; set it on the target's "
                "optimizer (for Adam/AdamW's step: rsfsdp.init_adam_state)"
            )


def describe(module, kind: str, optimizer=None, group=None):
    """Describe one kind of an FSDP2 module's live state.

    kind: "param" (the sharded parameters), "exp_avg", "exp_avg_sq" or "max_exp_avg_sq" (a
    torch.optim Adam/AdamW moment, the last under amsgrad=True; pass `optimizer`): the
    moments of every parameter of `module` that the optimizer holds state for; or any other
    key of the optimizer's per-parameter state (SGD's "momentum_buffer", Adagrad's "sum",
    Adamax's "exp_inf", a user optimizer's, Adam's names of a user optimizer included): the
    tensors under it, placed like their
    parameters, of every parameter whose state holds it (a parameter whose state is of another
    kind is left out, `notes` says so). Keys torch.optim keeps in another shape ("step",
    NAdam's "mu_product", Adafactor's "row_var"/"col_var", ASGD's "eta"/"mu") raise
    UnsupportedError; a user optimizer's state not placed like its parameter (a scalar, a
    factored tensor) is a `check()` reason. group: the
    process group the transfer runs over (default: the world); it must contain the FSDP2
    mesh. Call on every rank of the mesh at the safe boundary (after optimizer.step(), before
    the next forward); it communicates nothing. Returns a `LiveDTensors`: `.layout`,
    `.buffers`, `.check()`, `.reasons()`, and `.kind` (`kind`: the preflight refuses two calls
    of one plan that pair up across ranks while moving different kinds).

    It raises only for what every rank of the same program sees alike (arguments, the
    configuration, the DTensor specs). What one rank's own state may say (unsharded
    parameters, an unshard in flight, no optimizer state yet, a moment or state key missing
    or placed otherwise, an optimizer holding none of them, no amsgrad group) is a reason
    `check()` raises, so the transfer's preflight refuses on every rank, before any write,
    instead of this rank raising alone while its peers wait.
    """
    _check_args(module, kind, optimizer)
    check_group(group)
    _, params = _params(module)
    if kind == "param":
        entries = [entry(n, fp.sharded_param, _ops(n, fp.sharded_param)) for n, fp in params]
        state = _ParamState(module, params)
    else:
        import torch

        adam = _adam_moment(kind, optimizer)
        chosen, missing = _optimized(params, optimizer, kind, adam)
        opt_name = type(optimizer).__name__
        others = []  # names of parameters whose state is of another kind, without `kind`
        if not adam and not missing:
            chosen, others, missing = _holding(chosen, optimizer, kind)
        moments, problems, entries = [], [missing] if missing else [], []
        for n, fp in chosen:
            p = fp.sharded_param
            st = optimizer.state.get(p) or {}
            why = None if missing else _moment_problem(n, p, st, kind, opt_name, adam)
            if why:
                problems.append(why)
            moments.append(None if missing or why else st[kind])
            # the moment's own dtype: state need not be kept in the parameter's; a moment this
            # rank lacks is laid out in the parameter's (what init_adam_state makes)
            # (max_exp_avg_sq missing as amsgrad is off here: in exp_avg_sq's, as torch keeps it)
            m = st.get(kind, st.get("exp_avg_sq") if adam and kind == "max_exp_avg_sq" else None)
            dtype = m.dtype if isinstance(m, torch.Tensor) else p.dtype
            entries.append(replace(entry(n, p, _ops(n, p)), dtype=dtype))
        state = _MomentState(module, chosen, moments, problems, optimizer, kind)
        notes = _moment_notes(params, chosen, entries, optimizer, kind, adam, others)
        return describe_entries(f"FSDP2 {kind}", entries, state, group, notes, kind)
    return describe_entries(f"FSDP2 {kind}", entries, state, group, kind=kind)


def _moment_notes(params, chosen, entries, optimizer, kind, adam, others=()):
    """What this rank's own optimizer state chose of its moments' layout, where that need not
    be its peers' choice: trainable parameters it holds without state (left out), parameters
    whose state is of another kind without `kind` (`others`, left out), moments in another
    dtype than their parameters. Not faults (every rank may agree), but when the ranks'
    layouts differ these say how, by name (`LiveDTensors.notes`)."""
    groups = optimizer.param_groups
    if adam and kind == "max_exp_avg_sq":  # only amsgrad groups keep it
        groups = [g for g in groups if g.get("amsgrad")] or groups
    held = {id(q) for g in groups for q in g["params"]}
    described = {n for n, _ in chosen}.union(others)
    left_out = [
        n
        for n, fp in params
        if n not in described and fp.sharded_param.requires_grad and id(fp.sharded_param) in held
    ]
    notes = []
    if left_out:
        notes.append(
            f"{kind} of {len(chosen)} parameters laid out; left out, as this rank's optimizer "
            f"holds no state for them though they require grad: {left_out[:8]}"
            f"{' ...' if len(left_out) > 8 else ''}"
        )
    if others:
        notes.append(
            f"{kind} of {len(chosen)} parameters laid out; left out, as this rank's optimizer "
            f"state for them is of another kind, without {kind!r}: {list(others[:8])}"
            f"{' ...' if len(others) > 8 else ''}"
        )
    by_dtype = {}
    for (n, fp), e in zip(chosen, entries, strict=True):
        if e.dtype != fp.sharded_param.dtype:
            by_dtype.setdefault((e.dtype, fp.sharded_param.dtype), []).append(n)
    for (dtype, pdtype), names in by_dtype.items():
        notes.append(
            f"{kind} laid out in {dtype} (its parameters' is {pdtype}) for {names[:8]}"
            f"{' ...' if len(names) > 8 else ''}"
        )
    return notes


def _optimized(params, optimizer, kind, adam):
    """([(name, FSDPParam)] whose `kind` moments are described, why this rank has none or
    None).

    By the state, not by requires_grad: torch's step gives state only to parameters that got a
    gradient (never to frozen ones, though AdamW(model.parameters()) holds them), and keeps it
    for a parameter frozen after training. The optimizer may hold other modules' parameters
    too (a submodule described under the whole model's optimizer). An optimizer with no state
    yet on this rank is not raised here (the peers may have stepped): its parameters are those
    its first step would give state to (as `init_adam_state`), and the reason goes to
    `check()`. adam: `_adam_moment(kind, optimizer)`."""
    opt_name = type(optimizer).__name__
    if kind in _MOMENTS and _torch_optimizer(optimizer) and "betas" not in optimizer.defaults:
        # by the optimizer's class, not by its state (the state is this rank's alone): torch's
        # optimizers without betas (SGD, Adagrad, ...) keep no Adam moment
        raise UnsupportedError(
            f"{opt_name} keeps no {kind!r} state: Adam moments come from an Adam-family "
            "optimizer (Adam, AdamW)"
        )
    groups = optimizer.param_groups
    if adam and kind == "max_exp_avg_sq":  # only amsgrad groups keep it
        amsgrad = [g for g in groups if g.get("amsgrad")]
        if not amsgrad:
            # hyperparameters are this rank's too (optimizer.load_state_dict replaces them):
            # laid out as an amsgrad optimizer's would be, refused by check()
            return _first_step(params, groups, optimizer.state), (
                f"{opt_name} keeps no 'max_exp_avg_sq' on this rank: Adam/AdamW keep it only "
                "with amsgrad=True, which no param group of this optimizer sets"
            )
        groups = amsgrad
    held = {id(q) for g in groups for q in g["params"]}
    mine = [(n, fp) for n, fp in params if id(fp.sharded_param) in held]
    if not mine:
        # e.g. load_state_dict(assign=True) on this rank alone replaced the parameters: laid
        # out as the module's trainable parameters, refused by check()
        first = [(n, fp) for n, fp in params if fp.sharded_param.requires_grad] or params
        where = " in an amsgrad group" if adam and kind == "max_exp_avg_sq" else ""
        return first, (
            f"the optimizer holds none of this module's FSDP2 sharded parameters on this rank"
            f"{where} (built before "
            "fully_shard(), for another module, or the parameters were replaced since, e.g. "
            "load_state_dict(assign=True)?)"
        )
    state = optimizer.state
    out = [(n, fp) for n, fp in mine if state.get(fp.sharded_param)]
    if out:
        return out, None
    first = [(n, fp) for n, fp in mine if fp.sharded_param.requires_grad] or mine
    made = (
        "Adam moments exist after the first optimizer.step() that saw a gradient, or after "
        "rsfsdp.init_adam_state()"
        if adam
        else "its per-parameter state exists after the first optimizer.step() that saw a "
        "gradient (or the state torch's first step makes, given by hand)"
    )
    return first, (
        f"{opt_name} has no optimizer state yet on this rank for the {len(mine)} parameters "
        f"of this module it holds: {made}; then describe() again"
    )


def _holding(chosen, optimizer, kind):
    """Of the parameters with state (`chosen`), for a key other than the Adam moments:
    ([(name, FSDPParam)] laid out, [name] left out, why this rank has none or None).

    A key held by some parameters only follows the moments' rule, by the state: a parameter
    whose state is of another kind has none and is left out (a note says so): a param group
    whose hyperparameters keep no such state (RMSprop's momentum=0), a hybrid optimizer's
    other rule, Adafactor's factored state of matrices beside the "variance" of vectors. One
    whose state holds what a holder's of its param group and number of dims holds except
    `kind` lost it: laid out, and `check()` says so, as of a moment missing. When none holds
    it, all are laid out and `check()` refuses."""
    state = optimizer.state
    group_of = {id(q): i for i, g in enumerate(optimizer.param_groups) for q in g["params"]}

    def like(fp):  # what a parameter's state is compared with: its group, its dims, its keys
        p = fp.sharded_param
        return group_of.get(id(p)), p.ndim, frozenset(state[p]) - {kind}

    holders = {like(fp) for _, fp in chosen if kind in state[fp.sharded_param]}
    if not holders:
        keys = set().union(*(state[fp.sharded_param] for _, fp in chosen))
        why = (
            f"{type(optimizer).__name__} keeps no {kind!r} state on this rank for any of the "
            f"{len(chosen)} parameters of this module it has state for (their keys: "
            f"{sorted(keys, key=str)})"
        )
        return chosen, [], why
    laid, left = [], []
    for n, fp in chosen:
        if kind in state[fp.sharded_param] or like(fp) in holders:
            laid.append((n, fp))
        else:
            left.append(n)
    return laid, left, None


def _first_step(params, groups, state):
    """The module's parameters the optimizer holds that have state, else those its first step
    would give state to (as `_optimized`)."""
    held = {id(q) for g in groups for q in g["params"]}
    mine = [(n, fp) for n, fp in params if id(fp.sharded_param) in held] or params
    out = [(n, fp) for n, fp in mine if state.get(fp.sharded_param)]
    return out or [(n, fp) for n, fp in mine if fp.sharded_param.requires_grad] or mine


class _Unchanged:
    """What a passing check relied on, re-checked by identity: the module tree (every
    module's registered submodules and parameters are the same objects under the same names)
    and every FSDPParam still in its sharded state with no all-gather in flight. `__call__`
    is True only when the full checks (`_ParamState.full`) would pass as they did when it was
    taken; False sends the caller to them, which say what changed."""

    def __init__(self, module):
        from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

        self.sharded = ShardedState.SHARDED
        self.groups = _fsdp_groups(module)
        self.fsdp_params = [fp for g in self.groups for fp in g.fsdp_params]
        self.tree = ModuleTree(module)

    def __call__(self) -> bool:
        sharded = self.sharded
        if not all(fp.sharded_state == sharded for fp in self.fsdp_params):
            return False
        if any(map(_gathering, self.groups)):
            return False
        return self.tree.unchanged()


class _ParamState:
    """() -> (the described parameters' local tensors, [reason they must not be used now]).

    Reasons: a parameter not sharded or being gathered now, or replaced since describe()
    (re-fully_shard or an assign-load replaces FSDP2's sharded parameter itself). The local
    tensors are the described sharded DTensors' in every state (FSDP2 keeps them while
    unsharded), so a state described while unsharded is usable once resharded."""

    def __init__(self, module, chosen):
        self.module = module
        self.chosen = chosen
        self.described = [fp.sharded_param for _, fp in chosen]
        self.unchanged = None  # an _Unchanged taken when the full checks last passed

    def full(self) -> list:
        try:
            groups, now = _params(self.module)
        except UnsupportedError as exc:
            return [str(exc)]
        by_name = dict(now)
        replaced = [
            n
            for (n, fp), p in zip(self.chosen, self.described, strict=True)
            if by_name.get(n) is not fp or fp.sharded_param is not p
        ]
        if replaced:
            return [
                f"parameters {replaced[:8]} were replaced since describe() "
                "(load_state_dict(assign=True)?): describe() again"
            ]
        return _not_ready(self.module, groups, now)

    def reasons(self) -> list:
        if self.unchanged is not None and self.unchanged():
            return []
        why = self.full()
        self.unchanged = None if why else _Unchanged(self.module)
        return why

    def __call__(self):
        return [p._local_tensor for p in self.described], self.reasons()


class _MomentState:
    """() -> (the `kind` moments' local tensors, None where this rank had none, [reason]).

    Reasons: the module's (`_ParamState`), what this rank lacked at describe() (no state, a
    moment missing or placed otherwise: it has no buffer there, so only a new describe() can
    use it), a moment replaced since (optimizer.load_state_dict), the optimizer gone."""

    def __init__(self, module, chosen, moments, problems, optimizer, kind):
        self.params = _ParamState(module, chosen)
        self.moments = moments
        # (parameter, moment) of the moments this rank had, and their names
        have = [
            (n, fp.sharded_param, m)
            for (n, fp), m in zip(chosen, moments, strict=True)
            if m is not None
        ]
        self.named = [n for n, _, _ in have]
        self.pairs = [(p, m) for _, p, m in have]
        self.problems = problems
        self.kind = kind
        self.opt_name = type(optimizer).__name__
        # held weakly: an optimizer the training loop replaced is gone, not written in its place
        self.optimizer = weakref.ref(optimizer)

    def reasons(self) -> list:
        optimizer = self.optimizer()
        if optimizer is None:
            return [
                f"the {self.opt_name} whose {self.kind} was described no longer exists (a new "
                "optimizer was made?): describe() again with the one that trains"
            ]
        why = self.params.reasons()
        if self.problems:
            why = [*why, *self.problems]
        state, kind = optimizer.state, self.kind
        pairs = self.pairs
        if not all(state.get(p, _EMPTY).get(kind) is m for p, m in pairs):
            replaced = [
                n
                for n, (p, m) in zip(self.named, pairs, strict=True)
                if state.get(p, _EMPTY).get(kind) is not m
            ]
            why = [
                *why,
                f"{kind} of {replaced[:8]} replaced since describe() "
                "(optimizer.load_state_dict?): describe() again",
            ]
        return why

    def __call__(self):
        locals_ = [None if m is None else _local_of(m) for m in self.moments]
        return locals_, self.reasons()


_EMPTY: dict = {}


def _step_count(step) -> float:
    import numbers

    import torch

    if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_complex():
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, numbers.Real):
        raise TypeError(
            f"step must be an integer (the source's optimizer step count), got "
            f"{type(step).__name__} {step!r}"
        )
    if not float(step).is_integer():
        raise ValueError(f"step must be an integer (a step count), got {step!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step!r}")
    return float(step)


def init_adam_state(optimizer, step, params=None) -> None:
    """Give a torch.optim Adam/AdamW's parameters their state, with the step counter = step.

    params: the parameters to give state (default: every parameter the optimizer holds that
    requires grad: those torch's first step gives state to, as they get a gradient; a frozen
    one gets none). Pass a source's set when it differs, e.g. to include parameters frozen
    after training, whose moments the source keeps: the moments' layout (`describe()`) covers
    exactly the parameters with state, and a transfer needs the target's to match. Missing
    state is made as torch makes it on the first step (`zeros_like(param)`: a DTensor placed
    like the parameter; `max_exp_avg_sq` too in amsgrad groups), so that `describe(...,
    "exp_avg")` has a target to write before the optimizer ever stepped (elastic resize,
    migration from another framework). Existing moments are kept. Every parameter with state
    afterwards has its step counter set: the step is not part of any layout, so set it to the
    source's step count, or bias correction differs. Nothing changes when an argument is
    refused.
    """
    import torch

    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise UnsupportedError(
            f"init_adam_state() supports torch.optim.Adam/AdamW, got {type(optimizer).__name__}"
        )
    count = _step_count(step)
    from torch.optim.optimizer import _get_scalar_dtype

    for group in optimizer.param_groups:
        if group.get("capturable") or group.get("fused"):
            raise UnsupportedError(
                "init_adam_state() writes a CPU step counter: use capturable=False, fused=False"
            )
    held = [(p, g) for g in optimizer.param_groups for p in g["params"]]
    if params is None:
        wanted = {id(p) for p, _ in held if p.requires_grad}
    else:
        if isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of parameters, got one tensor")
        params = list(params)
        ids = {id(p) for p, _ in held}
        foreign = [i for i, p in enumerate(params) if id(p) not in ids]
        if foreign:
            raise ValueError(
                f"params {foreign[:8]} (positions in params) are not held by the optimizer"
            )
        wanted = {id(p) for p in params}
    state = optimizer.state
    with torch.no_grad():
        for p, group in held:
            if id(p) in wanted and not state.get(p):  # torch's own order (Adam._init_group)
                st = state[p]
                st["step"] = None
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group.get("amsgrad"):
                    st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if state.get(p):
                state[p]["step"] = torch.tensor(count, dtype=_get_scalar_dtype())
