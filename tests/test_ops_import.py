"""`import reshard` and the compiled ops: after the import `torch.ops.reshard.*` are callable;
without a build geometry and planning still work and every op use says how to build.

Both run in a fresh interpreter: the test session itself has the extension loaded already.
"""

import os
import shutil
import subprocess
import sys
import textwrap

import torch

import reshard
from reshard import _ops


def _run(code: str, pythonpath: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


PACKAGE_ROOT = os.path.dirname(os.path.dirname(reshard.__file__))


def test_import_reshard_makes_torch_ops_callable():
    res = _run(
        """
        import torch
        import reshard

        src = torch.arange(10.0)
        dst = torch.full((10,), -1.0)
        desc = torch.tensor([[1, 3, 0, 2, 2, 3]])  # src[1:3], [4:6], [7:9] -> dst[0:2], [2:4], [4:6]
        torch.ops.reshard.copy_runs(src, desc, dst)
        print(dst.tolist())
        """,
        PACKAGE_ROOT,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[0] == str([1.0, 2.0, 4.0, 5.0, 7.0, 8.0, -1.0, -1.0, -1.0, -1.0])


def test_fake_impls_registered_at_import():
    res = _run(
        """
        import torch
        import reshard
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            torch.ops.reshard.copy_runs(
                torch.empty(8), torch.empty((3, 6), dtype=torch.int64), torch.empty(8)
            )
        print("ok")
        """,
        PACKAGE_ROOT,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def test_without_the_extension_planning_works_and_ops_say_how_to_build(tmp_path):
    pkg = tmp_path / "reshard"
    shutil.copytree(os.path.dirname(reshard.__file__), pkg, ignore=shutil.ignore_patterns("*.so"))
    assert not list(pkg.glob("*.so"))
    res = _run(
        """
        import torch
        import reshard as rs

        assert not rs._ops.is_built()
        src = rs.Layout(
            tensors={"w": rs.split((8, 4), dim=0, sizes=[4, 4], locations=[0, 1])},
            storages={i: rs.Storage(rank=i, dtype=torch.float32, numel=16) for i in (0, 1)},
        )
        dst = rs.Layout(
            tensors={"w": rs.replicated((8, 4), locations=[0, 1])},
            storages={i: rs.Storage(rank=i, dtype=torch.float32, numel=32) for i in (0, 1)},
        )
        plan = rs.plan(src, dst)
        print("staging", plan.staging_bytes(0))

        def refused(call):
            try:
                call()
            except (RuntimeError, ImportError) as exc:
                print(type(exc).__name__, exc)
            else:
                print("NO ERROR")

        args = (torch.ones(4), torch.zeros((0, 6), dtype=torch.int64), torch.ones(4))
        refused(lambda: torch.ops.reshard.copy_runs(*args))
        refused(lambda: rs.copy_runs(*args))
        refused(lambda: torch.ops.reshard.stage_h2d(args[0], args[1], torch.ones(4), args[2]))
        refused(lambda: rs.Transfer)
        """,
        str(tmp_path),
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().split("\n")
    assert lines[0].startswith("staging ")
    refusals = lines[1:]
    assert [line.split()[0] for line in refusals] == [
        "RuntimeError",
        "RuntimeError",
        "RuntimeError",
        "ImportError",
    ]
    for line in refusals:
        assert _ops.BUILD_COMMAND in line, line
        assert "No module named 'reshard._C'" in line, line


def test_stand_in_schemas_match_the_built_ops():
    """The stand-ins registered without a build carry exactly the built op set's schemas."""
    built = {str(getattr(torch.ops.reshard, s.split("(")[0]).default._schema) for s in _ops.SCHEMAS}
    assert built == {f"reshard::{s}" for s in _ops.SCHEMAS}
    names = {s.split("(")[0] for s in _ops.SCHEMAS}
    registered = {
        op.split("::")[1]
        for op in torch._C._dispatch_get_all_op_names()
        if op.startswith("reshard::")
    }
    assert registered == names


def test_info_runs_without_the_extension(tmp_path):
    pkg = tmp_path / "reshard"
    shutil.copytree(os.path.dirname(reshard.__file__), pkg, ignore=shutil.ignore_patterns("*.so"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    res = subprocess.run(
        [sys.executable, "-m", "reshard.info"], capture_output=True, text=True, env=env, timeout=120
    )
    assert res.returncode == 1
    assert "NOT LOADED" in res.stdout and _ops.BUILD_COMMAND in res.stdout


def test_an_unknown_cpu_capability_is_reported_not_silently_ignored():
    code = """
        import warnings
        warnings.simplefilter("error")
        try:
            import reshard
        except RuntimeWarning as w:
            print("warned:", w)
        else:
            print("silent")
        """

    def run(value):
        env = {**os.environ, "PYTHONPATH": PACKAGE_ROOT, "RESHARD_CPU_CAPABILITY": value}
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )

    bad = run("AVX2")
    assert "warned: RESHARD_CPU_CAPABILITY='AVX2' is not one of default, avx2, avx512" in bad.stdout
    good = run("avx2")
    assert good.stdout.strip() == "silent", good.stderr
