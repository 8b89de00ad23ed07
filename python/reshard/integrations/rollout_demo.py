"""The rollout mode of `python -m reshard.demo --mode rollout`: trainer -> inference engine.

Per rank: a small randomly initialized HF `transformers` Llama (GQA: 8 query heads, 2 kv heads;
built from a config, nothing downloaded) trained under DeepSpeed ZeRO-3 with the optimizer
offloaded to CPU. After every step the weights go to the rollout side in both shapes engines
take:
- full tensors by name (an engine's `load_weights`): an `rs.Stream` of every parameter to rank 0,
  bucket by bucket; rank 0 copies each into its 'engine' (a dict of HF-named tensors);
- pre-sharded: one `rs.Transfer` into vLLM's TP=2 layout (`integrations.vllm.tp_layout`: fused
  qkv / gate_up, vocab padded to 64, kv heads split), hosted by ranks 0 and 1 (or 0 alone).
Checks, without reshard: the engine's tensors bitwise equal DeepSpeed's `GatheredParameters`;
each TP rank's parameters bitwise equal what vLLM's loader makes of those full weights
(`TPLayout.load`: torch slicing); vocab padding rows never written. Runs inside a process group
the demo set up (gloo on CPU, NCCL on GPUs).
"""

from __future__ import annotations

import logging
import math

import torch

from ._demo_common import KIB, deepspeed_env, print_syncs_and_verdict, summary

BUCKET_BYTES = 256 << 10  # small on purpose: the demo model streams in several buckets
TP = 2
HEADS = 8
HIDDEN_MULTIPLE = 64  # 8 heads of a head_dim that is a multiple of 8
DEFAULT_HIDDEN = 256


def check_args(cfg) -> str | None:
    """Why the Llama cannot be built from cfg's sizes as given (an argparse-style message), or
    None: sizes are used as given, never rounded."""
    if cfg["hidden"] % HIDDEN_MULTIPLE:
        return (
            f"argument --hidden: must be a multiple of {HIDDEN_MULTIPLE} for --mode rollout "
            f"({HEADS} attention heads, head_dim a multiple of 8), got {cfg['hidden']}"
        )
    if cfg["ffn"] % TP:
        return (
            f"argument --ffn: must be a multiple of {TP} for --mode rollout (vLLM's TP={TP} "
            f"splits the MLP evenly), got {cfg['ffn']}"
        )
    return None


def _config(cfg):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=cfg["vocab"],
        hidden_size=cfg["hidden"],
        intermediate_size=cfg["ffn"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )


def _bits(t):
    t = t.detach().cpu().contiguous()
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _engine(rank, world, backend, cfg):
    """The HF Llama under a real ZeRO-3 engine with its optimizer offloaded to CPU, as a
    launcher would make it; returns (engine, HF config)."""
    deepspeed_env(rank, world, backend)
    import deepspeed
    import transformers
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)
    hf = _config(cfg)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu"},
            "stage3_param_persistence_threshold": 0,
        },
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine, hf


def _vllm_targets(tgt, hosts, rank, device):
    """The 'engine' parameters of the TP ranks this process hosts, NaN-poisoned, and the
    {location: buffer} the Transfer writes: ({tp rank: {name: tensor}}, buffers)."""
    vllm_params = {
        r: {
            n: torch.full(s, float("nan"), dtype=torch.bfloat16, device=device)
            for n, s in tgt.shapes.items()
        }
        for r in range(TP)
        if hosts[r] == rank
    }
    dst = {}
    for r, params in vllm_params.items():
        dst.update(tgt.buffers(params, r))
    return vllm_params, dst


def _check_step(step, rank, engine, engine_weights, vllm_params, tgt):
    """References without reshard (DeepSpeed's gather; vLLM's loader on the full weights)
    against the streamed weights and the TP parameters: (bad, checked, named parameters)."""
    import deepspeed

    bad, checked = [], 0
    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        full = {n: p.data.detach().clone() for n, p in params}
    for n, w in engine_weights.items() if rank == 0 else ():
        checked += w.numel()
        if not torch.equal(_bits(w), _bits(full[n])):
            bad.append(f"step {step}: streamed {n} differs from GatheredParameters")
    for r, got in vllm_params.items():
        want = {n: torch.full(s, float("nan"), dtype=torch.bfloat16) for n, s in tgt.shapes.items()}
        for n, t in full.items():
            tgt.load(n, t.cpu(), r, want)
        for n, w in want.items():
            checked += w.numel()
            if not torch.equal(_bits(got[n]), _bits(w)):
                bad.append(f"step {step}: TP rank {r} {n} differs from vLLM's loader")
    return bad, checked, params


def run_rank(rank, world, backend, cfg):
    """One rank of the demo (process group already initialized); a JSON-able result."""
    import reshard as rs
    from reshard.integrations import deepspeed as rsds
    from reshard.integrations import vllm as rsvllm

    engine, hf = _engine(rank, world, backend, cfg)
    device = engine.device
    live = rsds.describe(engine, "param")
    stream = rs.Stream(live.layout, receivers=[0], bucket_bytes=BUCKET_BYTES, device=device)
    hosts = [0, 1 % world]
    tgt = rsvllm.tp_layout(hf, TP, hosts, dtype=torch.bfloat16)
    vllm_params, dst = _vllm_targets(tgt, hosts, rank, device)
    tp_sync = rs.Transfer(live.layout, tgt.layout, budget_bytes_per_peer=cfg["budget"])
    engine_weights = {}  # rank 0's 'inference engine': HF-named full tensors
    g = torch.Generator().manual_seed(1000 + rank)
    bad, checked, stream_reports, tp_reports = [], 0, [], []
    for step in range(cfg["steps"]):
        tokens = torch.randint(0, hf.vocab_size, (2, 16), generator=g).to(device)
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        for name, tensor in stream(live):  # every rank iterates; rank 0 receives
            if name not in engine_weights:
                engine_weights[name] = torch.empty_like(tensor)
            engine_weights[name].copy_(tensor)  # what load_weights does
        stream_reports.append(stream.report)
        tp_reports.append(tp_sync(live, dst))
        b, c, params = _check_step(step, rank, engine, engine_weights, vllm_params, tgt)
        bad += b
        checked += c
    engine.destroy()
    return {
        "bad": bad,
        "params": sum(math.prod(getattr(p, "ds_shape", p.shape)) for _, p in params),
        "elements_checked": checked,
        "buckets": len(stream.buckets),
        "buffer_bytes": stream.buffer_bytes if rank == 0 else 0,
        "model_bytes": sum(2 * math.prod(getattr(p, "ds_shape", p.shape)) for _, p in params),
        "stream_first_s": stream_reports[0].seconds["total"],
        "reports": {"stream": summary(stream_reports[-1]), "tp": summary(tp_reports[-1])},
        "hosts": hosts,
    }


def print_report(results, world, backend, cfg, wall):
    r0 = results[0]
    print(
        f"reshard demo (rollout): HF Llama (GQA 8/2 heads), DeepSpeed ZeRO-3 + CPU optimizer "
        f"offload, {world} ranks ({backend}), {r0['params'] / 1e6:.2f}M params, "
        f"{cfg['steps']} training steps; after each step:"
    )
    print(
        f"  rs.Stream -> rank 0 (load_weights by name): {r0['buckets']} buckets of "
        f"{BUCKET_BYTES // KIB} KiB; receiver buffer {r0['buffer_bytes'] / KIB:.0f} KiB for a "
        f"{r0['model_bytes'] / KIB:.0f} KiB model"
    )
    print(f"  tp_layout: vLLM TP={TP} weights on ranks {r0['hosts']} (one Transfer, in place)")
    equal_to = "DeepSpeed's GatheredParameters and to vLLM's loader applied to them"
    return print_syncs_and_verdict(results, equal_to, wall)
