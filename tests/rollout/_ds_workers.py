"""Workers for the rollout tests on a real trainer: a small randomly initialized HF Llama (GQA)
trained under DeepSpeed ZeRO-3 with the optimizer offloaded to the CPU, on spawned gloo ranks.

References are DeepSpeed's own: `deepspeed.zero.GatheredParameters` for the bf16 weights,
`safe_get_full_fp32_param` for the fp32 masters; the vLLM shards are `_vllm_ref.shards` of those
full weights. Module level imports stay light (the spawn context re-imports this module).
"""

from __future__ import annotations

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VOCAB = 200  # padded to 256 by vLLM: the last TP rank holds real rows, then padding


def llama_config(tied):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,  # tp 4 replicates each kv head on two ranks
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )


def make_engine(rank, world, tied, persistence):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(
        LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world)
    )
    import deepspeed
    import torch
    import transformers
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config(tied))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu"},
            "stage3_param_persistence_threshold": persistence,
        },
        "zero_force_ds_cpu_optimizer": False,
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def train_step(engine, rank, step):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, VOCAB, (2, 8), generator=g)
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()


def references(engine):
    """{name: full bf16 weight}, {name: full fp32 master}: collective, every rank."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        weights = {n: p.data.detach().clone() for n, p in params}
    masters = {n: safe_get_full_fp32_param(p).detach().clone() for n, p in params}
    return weights, masters


def _bits(t):
    import torch

    t = t.detach().cpu().contiguous()
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _same(a, b):
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def check_stream(stream, live, want, receiving, tag):
    errs, seen = [], []
    for name, t in stream(live):
        seen.append(name)
        if not _same(t, want[name]):
            errs.append(f"{tag}: {name} is not bitwise the reference")
    expect = sorted(want) if receiving else []
    if sorted(seen) != expect:
        errs.append(f"{tag}: yielded {len(seen)} tensors, expected {len(expect)}")
    rep = stream.report
    if any(rep.peak_staging_bytes[k] > rep.staging_bound[k] for k in rep.staging_bound):
        errs.append(f"{tag}: staging {rep.peak_staging_bytes} above {rep.staging_bound}")
    return errs


def check_tp(engine, live, cfg, weights, tp, hosts, me, tag):
    """tp_layout targets of every TP rank this process hosts, poisoned, then one transfer."""
    import _vllm_ref
    import torch

    import reshard as rs
    from reshard.integrations import vllm as rsvllm

    tgt = rsvllm.tp_layout(cfg, tp, hosts, dtype=torch.bfloat16)
    mine = [r for r in range(tp) if hosts[r] == me]
    engine_params = {
        r: {n: torch.full(s, float("nan"), dtype=torch.bfloat16) for n, s in tgt.shapes.items()}
        for r in mine
    }
    dst = {}
    for r in mine:
        dst.update(tgt.buffers(engine_params[r], r))
    rs.Transfer(live.layout, tgt.layout)(live, dst)
    errs = []
    for r in mine:
        want = _vllm_ref.shards(weights, cfg, tp, r, torch.bfloat16)
        for n, w in want.items():
            if not _same(engine_params[r][n], w):
                errs.append(f"{tag}: tp {tp} rank {r}: {n} differs from vLLM's rule")
    return errs


def w_trainer(rank, world, tied, receivers, tp_hosts, persistence):
    import torch

    import reshard as rs
    from reshard.integrations import deepspeed as rsds

    engine = make_engine(rank, world, tied, persistence)
    cfg = llama_config(tied)
    errs = []
    params = rsds.describe(engine, "param")
    masters = rsds.describe(engine, "fp32")
    names = [n for n, _ in engine.module.named_parameters()]
    if tied and "lm_head.weight" in names:
        errs.append("tied model lists lm_head.weight separately")
    # small buckets: many buckets, the embedding (12.8 KB bf16) larger than one
    weights_stream = rs.Stream(params.layout, receivers, bucket_bytes=8 << 10)
    masters_stream = rs.Stream(masters.layout, receivers, 8 << 10, dtype=torch.bfloat16)
    receiving = rank in receivers
    for step in range(2):
        train_step(engine, rank, step)
        weights, fp32 = references(engine)
        tag = f"rank {rank} step {step}"
        errs += check_stream(weights_stream, params, weights, receiving, tag + " weights")
        want = {n: m.to(torch.bfloat16) for n, m in fp32.items()}
        errs += check_stream(masters_stream, masters, want, receiving, tag + " masters->bf16")
        for tp, hosts in tp_hosts.items():
            errs += check_tp(engine, params, cfg, weights, tp, hosts, rank, tag)
    if len(weights_stream.buckets) < 3:
        errs.append(f"expected several buckets, got {len(weights_stream.buckets)}")
    return errs
