"""The docs' runnable snippets run, so README.md and docs/*.md cannot go stale silently.

Convention: an HTML comment on the line right before a ```python fence marks the block:

    <!-- doctest: cpu -->                 the block runs as it stands
    <!-- doctest: cpu, setup=NAME -->     SETUPS[NAME] runs first and defines the names the
                                          block uses without defining them (layouts, buffers,
                                          a model); CHECKS[NAME], if any, runs after it

Each marked block runs in a fresh Python process (CPU, at most a world-1 gloo group, never
DeepSpeed), so a process group or a model it builds never leaks into other tests. A block that
raises, or a check after it that fails, fails its test. Unmarked blocks (DeepSpeed engines,
several ranks, vLLM / SGLang workers, CUDA) are not run here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"^<!-- doctest: cpu(?:, setup=(?P<setup>[a-z_0-9]+))? -->$")

# A world-1 gloo group on a file store in the test's own directory (no port).
_GROUP = """
import torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + os.environ["DOCTEST_STORE"],
                        rank=0, world_size=1)
"""

SETUPS = {
    "layouts": """
import torch
import reshard as rs
src_layout = rs.Layout({"w": rs.split((8, 6), 0, [3, 5], [0, 1])},
                       {0: rs.Storage(0, torch.float32, 18), 1: rs.Storage(0, torch.float32, 30)})
dst_layout = rs.Layout({"w": rs.split((8, 6), 1, [2, 4], [7, 8])},
                       {7: rs.Storage(0, torch.bfloat16, 16), 8: rs.Storage(0, torch.bfloat16, 32)})
full = torch.randn(8, 6)
src_buffers = {0: full[:3].flatten().clone(), 1: full[3:].flatten().clone()}
dst_buffers = {7: torch.empty(16, dtype=torch.bfloat16), 8: torch.empty(32, dtype=torch.bfloat16)}
""",
    "copy_runs": """
import torch
import reshard as rs
src = torch.arange(10, dtype=torch.float32)
dst = torch.zeros(6, dtype=torch.bfloat16)
desc = [[0, 4, 0, 3, 2, 2], [9, 0, 5, 0, 1, 1]]
""",
    "fsdp": _GROUP
    + """
import torch
import reshard as rs
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from reshard.integrations import fsdp as rsfsdp

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).sum()

mesh = init_device_mesh("cpu", (1,))
torch.manual_seed(0)
model = module = Net()
fully_shard(model.fc1, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = [torch.randn(4, 6) for _ in range(2)]
model(data[0]).backward(); opt.step(); opt.zero_grad()
dt = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
_names = rsfsdp.describe(model, "param").layout.tensors
rollout_layout = rs.Layout(
    {n: rs.replicated(t.shape, [100 + i]) for i, (n, t) in enumerate(_names.items())},
    {100 + i: rs.Storage(0, torch.bfloat16, int(torch.Size(t.shape).numel()))
     for i, t in enumerate(_names.values())},
)
rollout_buffers = {loc: torch.full((s.numel,), float("nan"), dtype=torch.bfloat16)
                   for loc, s in rollout_layout.storages.items()}
""",
    "rollout": """
import types
import torch
import transformers
import reshard as rs
from reshard.integrations import vllm as rsvllm

hf_config = transformers.LlamaConfig(
    vocab_size=200, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64)
torch.manual_seed(0)
_hf = {n: torch.randn(t.shape)  # the HF parameters, by name (their vLLM layout names them)
       for n, t in rsvllm.tp_layout(hf_config, 1, [0]).layout.tensors.items()}
live = types.SimpleNamespace(  # a trainer's state on rank 0: one fp32 storage per parameter
    layout=rs.Layout({n: rs.replicated(p.shape, [i]) for i, (n, p) in enumerate(_hf.items())},
                     {i: rs.Storage(0, torch.float32, p.numel()) for i, p in enumerate(_hf.values())}),
    buffers={i: p.flatten().clone() for i, p in enumerate(_hf.values())},
)
tp_size, ranks, tp_rank = 1, [0], 0

class _Engine:  # what the snippet feeds: load_weights of full tensors, vLLM's parameters
    def __init__(self):
        self.loaded = {}
        self.params = {n: torch.nn.Parameter(torch.full(s, float("nan"), dtype=torch.bfloat16),
                                             requires_grad=False)
                       for n, s in rsvllm.tp_layout(hf_config, 1, [0]).shapes.items()}
    def load_weights(self, weights):
        self.loaded.update((n, t.clone()) for n, t in weights)
    def named_parameters(self):
        return iter(self.params.items())

rollout = model = _Engine()
""",
}

CHECKS = {
    "layouts": """
assert torch.equal(dst_buffers[7], full[:, :2].flatten().bfloat16())
assert torch.equal(dst_buffers[8], full[:, 2:].flatten().bfloat16())
""",
    "copy_runs": """
assert dst.tolist() == [0.0, 1.0, 0.0, 4.0, 5.0, 9.0], dst
""",
    "fsdp": """
for b in rollout_buffers.values():
    assert not b.isnan().any(), "a rollout buffer was not written"
""",
    "rollout": """
if "stream" in globals():  # the block streamed full tensors by name
    assert sorted(rollout.loaded) == sorted(_hf)
    for n, p in _hf.items():
        assert torch.equal(rollout.loaded[n], p.bfloat16()), n
for n, p in model.params.items():  # vocab rows past 200 are vLLM's padding, never written
    real = p[:200] if n.endswith(("embed_tokens.weight", "lm_head.weight")) else p
    assert not real.isnan().any(), n
""",
}


def marked_blocks():
    """(id, setup name or None, code) of every marked python block."""
    out = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            m = MARK.match(line.strip())
            if not m:
                continue
            where = f"{path.relative_to(ROOT)}:{i + 1}"
            assert i + 1 < len(lines) and lines[i + 1].strip() == "```python", (
                f"{where}: a doctest marker must be right before a ```python fence"
            )
            end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == "```")
            out.append((where, m["setup"], "\n".join(lines[i + 2 : end]) + "\n"))
    return out


BLOCKS = marked_blocks()


def test_markers_are_found_and_their_setups_exist():
    assert len(BLOCKS) >= 7, [b[0] for b in BLOCKS]
    for where, setup, _ in BLOCKS:
        assert setup is None or setup in SETUPS, f"{where}: unknown setup {setup!r}"


@pytest.mark.parametrize("where,setup,code", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_doc_snippet_runs(where, setup, code, tmp_path):
    script = "import os\n"
    if setup:
        script += textwrap.dedent(SETUPS[setup]) + "\n"
    script += f"# ---- {where}\n{code}\n"
    if setup in CHECKS:
        script += "# ---- checks\n" + textwrap.dedent(CHECKS[setup])
    (tmp_path / "snippet.py").write_text(script)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "python"), *filter(None, [env.get("PYTHONPATH")])]
    )
    env["DOCTEST_STORE"] = str(tmp_path / "store")
    env.pop("WORLD_SIZE", None)  # in-process snippets must not look launched
    done = subprocess.run(
        [sys.executable, str(tmp_path / "snippet.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (
        f"the snippet at {where} failed (exit {done.returncode}):\n"
        f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    )
