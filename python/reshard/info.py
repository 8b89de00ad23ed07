"""`python -m reshard.info`: what was built and what it runs on. Paste it into bug reports.

`python -m reshard.info --json` prints the same as one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import sys


def build_info() -> dict:
    """The build facts (reshard._ops.build_info) plus the library's path and the ISA of the C
    core's bulk casts, after the environment cap."""
    from . import _ops

    info = dict(_ops.build_info())
    info["path"] = _ops.library_path()
    level = ctypes.CDLL(info["path"]).rs_cpu_capability()
    info["cast_isa"] = _ops.CPU_CAPABILITIES[level]
    return info


def collect() -> dict:
    import torch

    import reshard

    out: dict = {
        "reshard": reshard.__version__,
        "package": os.path.dirname(reshard.__file__),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
    }
    try:
        out["build"] = build_info()
    except (ImportError, OSError, AttributeError) as exc:
        out["build"] = {"error": str(exc)}
        return out
    built = out["build"].get("torch")
    out["torch_matches_build"] = built == torch.__version__
    out["ops"] = sorted(
        name.split("::")[1]
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("reshard::")
    )
    if torch.cuda.is_available():
        out["gpus"] = [
            f"{torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))})"
            for i in range(torch.cuda.device_count())
        ]
    else:
        out["gpus"] = []
    return out


def format_text(info: dict) -> str:
    b = info.get("build", {})
    lines = [
        f"reshard         {info['reshard']}  ({info['package']})",
        f"python          {info['python']}  {info['platform']}",
        f"torch (runtime) {info['torch']}  cuda={info['torch_cuda']}  cpu={info['cpu_capability']}",
    ]
    if "error" in b:
        lines.append(f"extension       NOT LOADED: {b['error']}")
        return "\n".join(lines)
    match = "" if info["torch_matches_build"] else "   <-- MISMATCH: rebuild reshard"
    lines += [
        f"torch (built)   {b['torch']}{match}",
        f"C core          {b['c_core']}  (casts: {b['cast_isa']}; cap with RESHARD_CPU_CAPABILITY)",
        f"CUDA            {'on, archs ' + b['cuda_archs'] if b['cuda'] else 'off (CPU-only build)'}",
        f"threads         {info['threads']} intra-op (at::parallel_for, "
        f"{'OpenMP' if b['openmp'] else 'NO OpenMP: single-threaded copies'}), "
        f"{info['interop_threads']} inter-op",
        # compiled in as one token, spaces as "_" (setup.py's build_macros)
        f"build flags     {b['flags'].replace('_-', ' -')}",
        f"ops             {', '.join(info['ops'])}",
        f"GPUs            {', '.join(info['gpus']) or 'none visible'}",
        f"extension       {b['path']}",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m reshard.info", description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the same as one JSON object")
    args = ap.parse_args(argv)
    info = collect()
    text = json.dumps(info, indent=2, sort_keys=True) if args.json else format_text(info)
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `| head`: the reader took what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return 0 if "error" not in info.get("build", {}) else 1


if __name__ == "__main__":
    sys.exit(main())
