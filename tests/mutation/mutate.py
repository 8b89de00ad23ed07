"""Mutation check: plant one-line bugs, one at a time, in a throwaway copy of the repository
and run the tests that should catch each. Every surviving bug is a missing test.

    python tests/mutation/mutate.py            # every mutant (builds nothing: Python only)
    python tests/mutation/mutate.py --list     # names, files, tests
    python tests/mutation/mutate.py --only commit_step,zero_copy_gap

Run it from a built checkout (`python setup.py build_clib build_ext --inplace`): the copy
reuses the compiled extension. A mutant is found by its code text anywhere under its glob
(so modules may move); a site that is missing or ambiguous is reported as such and makes
the run fail, never a silent pass. Exit status: 0 when every mutant was caught.
Not collected by pytest (no test_ prefix); `make mutate` runs it.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = "python/reshard/**/*.py"
HOSTILE = "tests/distributed/test_hostile_ranks.py"
LOCAL_HOSTILE = "tests/test_hostile_local.py"
REPEAT = "tests/distributed/test_repeated_calls.py"
REPEAT_LOCAL = f"{REPEAT}::test_repeated_calls_recheck_every_buffer_in_process"
FSDP = "tests/fsdp/test_fsdp.py"
FSDP_KINDS = "tests/fsdp/test_fsdp_state_kinds.py"


@dataclass(frozen=True)
class Mutant:
    name: str
    where: str  # a glob under the repository root
    find: str  # exact code text, unique across the glob
    replace: str
    tests: tuple[str, ...]  # pytest arguments (node ids or files, -k expressions)
    why: str


MUTANTS = (
    # ---------------------------------------------------------------- preflight
    Mutant(
        "target_target_alias",
        PKG,
        "            hit = first_overlap(written_bytes[a], written_bytes[b])",
        "            hit = None",
        (f"{HOSTILE}::test_non_collective_failures_become_collective",),
        "two target locations that overlap where both are written are not refused",
    ),
    Mutant(
        "target_source_alias",
        PKG,
        "            hit = first_overlap(wb, np.array([[lo, hi]], np.int64))",
        "            hit = None",
        ("tests/distributed/test_executor.py::test_preflight_failures_are_collective",),
        "a target inside a source buffer is not refused",
    ),
    Mutant(
        "local_copy_extents",
        PKG,
        "        if s0 < d1 and d0 < s1:",
        "        if False:",
        (f"{LOCAL_HOSTILE}::test_local_copy_source_and_target_share_memory",),
        "a local copy whose source and target extents overlap reaches the op (TransferError)",
    ),
    Mutant(
        "commit_step",
        PKG,
        "        _all_gather_rows([1], group, world_size, device, timeout_s)",
        "        pass",
        (f"{HOSTILE}::test_a_rank_arriving_after_its_peers_gave_up_writes_nothing",),
        "a rank arriving after its peers gave up writes its targets",
    ),
    Mutant(
        "fingerprint_ignored",
        PKG,
        "    if all(row[0] for row in rows) and not fp_bad and not kind_bad:",
        "    if all(row[0] for row in rows) and not kind_bad:",
        ("tests/distributed/test_executor.py::test_preflight_failures_are_collective",),
        "ranks with different plans go ahead",
    ),
    Mutant(
        "kind_ignored",
        PKG,
        "    if all(row[0] for row in rows) and not fp_bad and not kind_bad:",
        "    if all(row[0] for row in rows) and not fp_bad:",
        (
            "tests/distributed/test_rank_faults.py::"
            "test_calls_of_one_plan_moving_different_states_do_not_pair_up",
        ),
        "two calls of one plan moving different states (exp_avg against exp_avg_sq) pair up",
    ),
    Mutant(
        "interrupt_not_collective",
        PKG,
        "        if got.interrupt is not None:  # every rank has heard of it: stop as it asked",
        "        if False:",
        (
            "tests/distributed/test_rank_faults.py::test_an_interrupt_in_one_ranks_hook_refuses_on_every_rank",
        ),
        "an interrupt in one rank's readiness hook is swallowed into the PreflightError",
    ),
    Mutant(
        "commit_skipped_for_late_rank",
        PKG,
        "    return max(entered_us) - min(entered_us) >= COMMIT_SPREAD * timeout_s * 1e6",
        "    return False",
        (f"{HOSTILE}::test_a_rank_arriving_after_its_peers_gave_up_writes_nothing",),
        "a rank arriving after its peers gave up skips the commit and writes its targets",
    ),
    Mutant(
        "placement_without_address",
        PKG,
        "(loc, t.data_ptr(), t.numel() * t.element_size(), t.get_device())",
        "(loc, t.numel() * t.element_size(), t.get_device())",
        (f"{REPEAT}::test_repeated_calls_recheck_every_buffer_in_process",),
        "a repeated call whose targets moved onto a source skips the aliasing check",
    ),
    Mutant(
        "placement_checks_always_skipped",
        PKG,
        "    if where == ctx.verified_placement:",
        "    if ctx.verified_placement is not None:",
        (f"{REPEAT}::test_repeated_calls_recheck_every_buffer_in_process",),
        "a repeated call skips the memory checks whatever buffers it was given",
    ),
    Mutant(
        "buffer_key_without_facts",
        PKG,
        "    return grad, inference, cuda, tuple(src), tuple(dst), facts",
        "    return grad, inference, cuda, tuple(src), tuple(dst), facts[0]",
        (
            REPEAT_LOCAL,
            f"{LOCAL_HOSTILE}::"
            "test_storage_reallocated_at_the_same_address_is_seen_on_a_repeated_call",
        ),
        "a buffer retyped, truncated, moved or reallocated in place passes a repeated call",
    ),
    Mutant(
        "buffer_key_grad_mode",
        PKG,
        "    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()",
        "    grad, inference = True, torch.is_inference_mode_enabled()",
        (REPEAT_LOCAL,),
        "a target that requires grad, passed under no_grad, is written under grad mode",
    ),
    Mutant(
        "buffer_key_inference_mode",
        PKG,
        "    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()",
        "    grad, inference = torch.is_grad_enabled(), False",
        (f"{LOCAL_HOSTILE}::test_leaving_inference_mode_is_seen_on_a_repeated_call",),
        "an inference tensor target, passed in inference mode, is written outside it",
    ),
    Mutant(
        "same_buffers_always",
        PKG,
        "    return Cleared(got.src, got.dst, str(fingerprint), timeout_s, seconds, got.short)",
        "    return Cleared(got.src, got.dst, str(fingerprint), timeout_s, seconds, True)",
        (f"{REPEAT}::test_same_buffers_means_cleared_on_every_rank",),
        "the rounds are told the buffers are the last cleared call's when they are not",
    ),
    Mutant(
        "registry_told_unchanged_always",
        PKG,
        "        unchanged = key is not None and key is self._registered_key",
        "        unchanged = key is not None",
        (
            "tests/test_hostreg_cpu.py::"
            "test_transfer_tells_the_registry_unchanged_only_for_the_storages_it_last_saw",
        ),
        "a storage swapped under a registered location is not re-registered (stale DMA source)",
    ),
    Mutant(
        "dtensor_locals_unchecked",
        PKG,
        "            if self._key is not None and _locals_key(locals_, self._mine) == self._key:",
        "            if self._key is not None:",
        (f"{FSDP}::test_state_changed_in_place_on_one_rank_is_refused_everywhere",),
        "a DTensor local tensor given new storage in place (.data =) still passes check()",
    ),
    Mutant(
        "module_tree_unchecked",
        PKG,
        "        for m, mod_names, mods, param_names, params in self.tree:",
        "        for m, mod_names, mods, param_names, params in ():",
        (
            f"{FSDP}::test_readiness_and_errors",
            "tests/deepspeed/test_deepspeed_state_changes.py::"
            "test_replaced_parameters_are_refused_and_resynced",
        ),
        "a parameter replaced on the module since describe() (FSDP2: load_state_dict("
        "assign=True); DeepSpeed: engine.module) passes check(): wrong data",
    ),
    Mutant(
        "deepspeed_sync_failure_local",
        PKG,
        "                    refuse(None, [failed], group=self.group)",
        "                    raise RuntimeError(failed)",
        (
            "tests/deepspeed/test_deepspeed_state_changes.py::"
            "test_sync_after_step_failure_on_one_rank_fails_every_rank",
        ),
        "a re-describe failing on one rank raises there alone; its peers wait for the timeout",
    ),
    Mutant(
        "fsdp_moments_unchecked",
        PKG,
        "        if not all(state.get(p, _EMPTY).get(kind) is m for p, m in pairs):",
        "        if False:",
        (f"{FSDP}::test_state_changed_in_place_on_one_rank_is_refused_everywhere",),
        "a moment replaced in the optimizer's state since describe() passes check()",
    ),
    Mutant(
        "fsdp_state_key_shape_unchecked",
        PKG,
        "            if tuple(m.shape) == tuple(p.shape):",
        "            if True:",
        (f"{FSDP_KINDS}::test_user_optimizer_state_by_key",),
        "a state key's DTensor placed like its parameter but of another global shape passes",
    ),
    Mutant(
        "fsdp_state_key_lost_left_out",
        PKG,
        "        if kind in state[fp.sharded_param] or like(fp) in holders:",
        "        if kind in state[fp.sharded_param]:",
        (f"{FSDP_KINDS}::test_faults_of_one_rank_by_key_are_refused_everywhere",),
        "a parameter that lost its state key on one rank is left out of that rank's layout "
        "instead of refused",
    ),
    Mutant(
        "storage_extent",
        PKG,
        "        short = _storage_shortfall(t)",
        "        short = None",
        (f"{LOCAL_HOSTILE}::test_storage_smaller_than_its_view_is_refused",),
        "a freed or shrunk storage reaches the kernels",
    ),
    Mutant(
        "requires_grad_target",
        PKG,
        "    if t.requires_grad and torch.is_grad_enabled():",
        "    if False:",
        (f"{LOCAL_HOSTILE}::test_versions_move_and_grad_targets_are_refused_in_process",),
        "a leaf that requires grad is written under grad mode",
    ),
    Mutant(
        "copy_support_16_bytes",
        PKG,
        "        if size in (1, 2, 4, 8):",
        "        if size in (1, 2, 4, 8, 16):",
        (f"{LOCAL_HOSTILE}::test_sixteen_byte_elements_are_refused_before_any_write",),
        "complex128 passes preflight and fails mid-copy",
    ),
    Mutant(
        "row_overflow",
        PKG,
        "    fits = (room >= 0) & ((count <= 1) | (stride <= np.maximum(room, 0) // reps))",
        "    fits = room >= 0",
        (f"{HOSTILE}::test_non_collective_failures_become_collective",),
        "a repeated row reaching past its buffer (or overflowing int64) passes preflight",
    ),
    Mutant(
        "double_write",
        PKG,
        "            hit = _overlapping_writes(np.concatenate(tables), 2)",
        "            hit = None",
        (f"{LOCAL_HOSTILE}::test_a_schedule_that_writes_an_element_twice_is_refused",),
        "a schedule writing one target element twice passes preflight",
    ),
    Mutant(
        "timeout_nan",
        PKG,
        "    if not math.isfinite(timeout) or timeout <= 0:",
        "    if timeout <= 0:",
        (f"{LOCAL_HOSTILE}::test_bad_timeouts",),
        "nan / inf timeouts are accepted",
    ),
    Mutant(
        "dtype_check",
        PKG,
        "    if t.dtype != want:",
        "    if False:",
        (
            "tests/distributed/test_local.py",
            f"{LOCAL_HOSTILE}::test_property_hostile_input_in_process",
        ),
        "a buffer of the wrong dtype is accepted",
    ),
    # ---------------------------------------------------------------- executor
    Mutant(
        "zero_copy_gap",
        PKG,
        " or (r[1:, 0] != ends[:-1]).any()",
        "",
        (f"{HOSTILE}::test_multi_segment_message_into_a_padded_target",),
        "a message with padding between segments is received straight into a padded target",
    ),
    Mutant(
        "zero_copy_shift",
        PKG,
        "    if (shift != shift[0]).any():\n        return None\n",
        "",
        ("tests/distributed/test_zero_copy.py",),
        "a message whose segments land at different shifts is received as one range",
    ),
    Mutant(
        "single_arena",
        PKG,
        "        return self.arenas[side][round_index % 2]",
        "        return self.arenas[side][0]",
        ("tests/distributed/test_executor.py::test_layouts_dtypes_budgets",),
        "round k+1 is packed into the arena round k is still sending from",
    ),
    Mutant(
        "arenas_always_free",
        PKG,
        "        if (other.index - rnd.index) % 2 == 0 and (",
        "        if False and (",
        ("tests/distributed/test_executor.py::test_layouts_dtypes_budgets",),
        "round k+2 is packed into (or received into) an arena round k still uses",
    ),
    Mutant(
        "contiguous_across_dtypes",
        PKG,
        "seg = Segment(sl, dl, wires(sl, dl), boff, hi - lo, descs[s], same and contiguous[s])",
        "seg = Segment(sl, dl, wires(sl, dl), boff, hi - lo, descs[s], contiguous[s])",
        (
            "tests/distributed/test_zero_copy.py::test_contiguous_segments_flagged_alike_on_both_ends",
        ),
        "a segment cast on the way (fp32 -> bf16) is flagged as a byte image of both buffers",
    ),
    Mutant(
        "group_lock",
        PKG,
        "    if group is None:\n        return in_process\n",
        "    return contextlib.nullcontext()\n",
        (f"{HOSTILE}::test_concurrent_calls_on_one_transfer_are_serialized",),
        "two threads' calls on one group (one Transfer) interleave",
    ),
    Mutant(
        "in_process_lock",
        PKG,
        "    if group is None:\n        return in_process\n",
        "    if group is None:\n        return contextlib.nullcontext()\n",
        (f"{LOCAL_HOSTILE}::test_reentrant_call_from_a_hook_is_refused",),
        "a Transfer without a process group runs a call inside a call",
    ),
    Mutant(
        "reentrant_call",
        PKG,
        "        if self._owner == threading.get_ident():",
        "        if False:",
        (f"{LOCAL_HOSTILE}::test_reentrant_call_from_a_hook_is_refused",),
        "a call from inside a call waits for itself forever",
    ),
    Mutant(
        "version_bump",
        PKG,
        "        torch.autograd.graph.increment_version(written)",
        "        pass",
        (f"{HOSTILE}::test_writes_move_version_counters_and_grad_targets_are_refused",),
        "zero-copy receives write targets without autograd noticing",
    ),
    Mutant(
        "local_failure_not_collective",
        PKG,
        "    except BaseException as exc:  # noqa: BLE001 - collective: every rank must hear of it",
        "    except ArithmeticError as exc:  # noqa: BLE001",
        (f"{HOSTILE}::test_non_collective_failures_become_collective",),
        "a Python type error on one rank raises there alone; its peers wait for the timeout",
    ),
    # ---------------------------------------------------------------- planner
    Mutant(
        "coalesce_target_contiguity",
        PKG,
        "        & (b[DO] == a[DO] + a[LEN])\n    )",
        "    )",
        ("tests/test_plan.py",),
        "runs contiguous in the source but not in the target are merged",
    ),
    Mutant(
        "coalesce_strided_gap",
        PKG,
        "        & ((a[CNT] == 1) | ((a[SS] == gs) & (a[DS] == gd)))",
        "        & ((a[CNT] == 1) | (a[SS] == gs))",
        (
            "tests/test_plan.py",
            f"{LOCAL_HOSTILE}::test_strided_run_is_not_extended_across_a_different_target_gap",
        ),
        "a strided run is extended by a row at another target gap",
    ),
    Mutant(
        "staging_bound_single_buffer",
        PKG,
        "    arenas = arenas_per_direction(num_rounds) * (",
        "    arenas = min(1, int(num_rounds)) * (",
        ("tests/test_plan.py", "tests/distributed/test_local.py"),
        "plan.staging_bytes counts one arena per direction while the executor keeps two",
    ),
    Mutant(
        "wire_dtype_widening",
        PKG,
        "        if dst == torch.float32:\n            return src",
        "        if dst == torch.float32:\n            return dst",
        ("tests/test_plan.py",),
        "fp16/bf16 -> fp32 travels as fp32 (twice the bytes)",
    ),
    # ---------------------------------------------------------------- DeepSpeed hook
    Mutant(
        "sync_after_skipped_step",
        PKG,
        "        if boundary and self.engine.was_step_applied():",
        "        if boundary:",
        ("tests/deepspeed/test_deepspeed.py", "-k", "sync_after_step or skip or overflow"),
        "SyncAfterStep counts steps DeepSpeed skipped (fp16 overflow) as applied",
    ),
    Mutant(
        "leaf_module_hooks_ignored",
        PKG,
        '        *(getattr(opt, "_leaf_module_hooks", None) or []),',
        "",
        ("tests/deepspeed/test_deepspeed_leaf_modules.py",),
        "a destroyed ZeRO-3 engine whose params all sit in leaf modules passes as alive",
    ),
    Mutant(
        "refresh_local_part_not_agreed",
        PKG,
        '    _agree(engine, failed, what, f"in DeepSpeed\'s local refresh, before its gather; {changed}")',
        "    if failed is not None:\n        raise failed",
        ("tests/deepspeed/test_deepspeed_refresh_failures.py",),
        "a refresh failing in DeepSpeed's local part on one rank leaves its peers in the gather",
    ),
    Mutant(
        "read_only_target_unchecked",
        PKG,
        '                why = "" if st.resizable() else _ops.unwritable_reason(t)',
        '                why = ""',
        (f"{LOCAL_HOSTILE}::test_a_target_in_read_only_memory_is_refused_before_any_write",),
        "a target in read-only memory is written (the process dies)",
    ),
    Mutant(
        "freed_target_not_rechecked",
        PKG,
        "        if key is not None and key is self.key and not self.freed:",
        "        if key is not None and key is self.key:",
        (
            f"{LOCAL_HOSTILE}::"
            "test_a_read_only_mapping_at_a_verified_targets_address_is_seen_on_a_repeated_call",
        ),
        "a read-only mapping at a freed, verified target's address passes the short path",
    ),
    Mutant(
        "unpickled_layout_unchecked",
        PKG,
        "        check_tensors([restored[name] for name in names], names)",
        "        pass",
        ("tests/test_layout.py", "-k", "unpickled_layout"),
        "a tampered pickle of a Layout (a gap) loads and plans: targets left unwritten",
    ),
    # ---------------------------------------------------------------- executor, stream
    Mutant(
        "interrupt_after_agreement_unmarked",
        PKG,
        "    return isinstance(exc.__context__, PreflightError) and exc.__context__ is not outer",
        "    return True",
        ("tests/distributed/test_rank_faults.py", "-k", "after_the_agreement"),
        "an interrupt after the preflight's agreement leaves the group usable (out of step)",
    ),
    Mutant(
        "stream_device_misfit_not_refused",
        PKG,
        "            if self.device_problem is not None:\n                self._refuse_device(bound[0])",
        "            pass",
        ("tests/rollout/test_stream.py", "-k", "device_one_rank_lacks"),
        "a Stream device one rank lacks is not refused on every rank",
    ),
    Mutant(
        "stream_tables_left_out_of_bound",
        PKG,
        '    out["host"] += DESC_ROW_BYTES * rows',
        "    pass",
        ("tests/rollout/test_stream.py", "-k", "descriptor_tables"),
        "a Stream's stated bound leaves out its descriptor tables",
    ),
    # ---------------------------------------------------------------- FSDP2, DTensor, vLLM
    Mutant(
        "user_adam_names_as_torch_adam",
        PKG,
        "    return kind in _MOMENTS and _torch_optimizer(optimizer)",
        "    return kind in _MOMENTS",
        (f"{FSDP_KINDS}::test_user_optimizer_state_under_adam_names",),
        "a user optimizer's exp_avg is held to torch Adam's rules (refused without betas)",
    ),
    Mutant(
        "mesh_order_ignored",
        PKG,
        "        if ranks.shape[d] > 1 and not bool((np.diff(ranks, axis=d) > 0).all()):",
        "        if False:",
        (f"{FSDP}::test_mistaken_inputs_are_named",),
        "a mesh numbering its ranks out of order moves shards swapped",
    ),
    Mutant(
        "vllm_name_twice_kept_last",
        PKG,
        "            for name, n in twice.items()",
        "            for name, n in {}.items()",
        ("tests/rollout/test_vllm_layout.py::test_buffers_refuses_a_name_given_twice",),
        "a TP rank's parameter given twice as different tensors: the last one is used silently",
    ),
)

_IGNORE = shutil.ignore_patterns(
    ".git",
    "build",
    "dist",
    "bin",
    "__pycache__",
    ".hypothesis",
    ".pytest_cache",
    "*.egg-info",
    ".whl",
)


def _locate(root, m):
    hits = []
    for path in sorted(glob.glob(os.path.join(root, m.where), recursive=True)):
        with open(path, encoding="utf-8") as f:
            n = f.read().count(m.find)
        hits += [path] * n
    return hits


def _pytest(root, args, timeout):
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "python"), PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - t0, ""
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    return proc.returncode, time.monotonic() - t0, tail[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated mutant names")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run")
    ap.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip running each test selection unmutated first",
    )
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only.split(",")]
    if args.only and len(chosen) != len(args.only.split(",")):
        print(f"unknown mutant in --only {args.only!r}", file=sys.stderr)
        return 2
    if args.list:
        for m in chosen:
            print(f"{m.name:32s} {' '.join(m.tests)}\n    {m.why}")
        return 0
    if not glob.glob(os.path.join(REPO, "python/reshard/_C*.so")):
        print(
            "build the extension first: python setup.py build_clib build_ext --inplace",
            file=sys.stderr,
        )
        return 2

    work = tempfile.mkdtemp(prefix="reshard-mutate-")
    root = os.path.join(work, "repo")
    shutil.copytree(REPO, root, ignore=_IGNORE, symlinks=True)
    print(f"copy of {REPO} in {root}")
    rows, baseline = [], {}
    try:
        for m in chosen:
            hits = _locate(root, m)
            if len(hits) != 1:
                status = "SITE NOT FOUND" if not hits else f"SITE AMBIGUOUS ({len(hits)})"
                rows.append((m, status, 0.0, ", ".join(sorted(set(hits))) or m.where))
                print(f"{m.name}: {status}", flush=True)
                continue
            if not args.no_baseline and m.tests not in baseline:
                rc, sec, tail = _pytest(root, m.tests, args.timeout)
                baseline[m.tests] = rc
                if rc != 0:
                    print(f"baseline of {' '.join(m.tests)} fails ({rc}): {tail}", flush=True)
            if baseline.get(m.tests, 0) != 0:
                rows.append((m, "BASELINE FAILS", 0.0, ""))
                continue
            path = hits[0]
            with open(path, encoding="utf-8") as f:
                original = f.read()
            try:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(original.replace(m.find, m.replace, 1))
                rc, sec, tail = _pytest(root, m.tests, args.timeout)
            finally:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(original)
            if rc == 5:
                status = "NO TESTS RAN"
            elif rc == 0:
                status = "SURVIVED"
            elif rc == "timeout":
                status = "caught (timeout)"
            else:
                status = "caught"
            rows.append((m, status, sec, os.path.relpath(path, root)))
            print(f"{m.name}: {status} in {sec:.0f} s ({tail})", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print("\n| mutant | file | result | seconds |\n| --- | --- | --- | --- |")
    for m, status, sec, where in rows:
        print(f"| {m.name} | {where} | {status} | {sec:.0f} |")
    bad = [m.name for m, status, _, _ in rows if not status.startswith("caught")]
    print(
        f"\n{len(rows) - len(bad)} of {len(rows)} caught" + (f"; not caught: {bad}" if bad else "")
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
