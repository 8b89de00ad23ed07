"""An independent statement of how vLLM 0.33.0 / 0.34.0 load HF weights into TP rank r (what its
weight loaders narrow and where they copy), for checking `reshard.integrations.vllm`.

It slices full HF tensors with torch (`narrow`, `cat`), never through a reshard layout or plan.
Rows of a vocab shard past the real vocabulary (padding) are left as `fill`.
"""

from __future__ import annotations

import torch

STACKED = {  # vLLM's hf_to_vllm_mapper.orig_to_new_stacked for Llama / Qwen2
    ".q_proj": (".qkv_proj", "q"),
    ".k_proj": (".qkv_proj", "k"),
    ".v_proj": (".qkv_proj", "v"),
    ".gate_proj": (".gate_up_proj", 0),
    ".up_proj": (".gate_up_proj", 1),
}


def vllm_name(hf_name: str) -> tuple[str, object]:
    """(vLLM parameter name, shard id or None) of an HF parameter name."""
    for old, (new, shard) in STACKED.items():
        if old + "." in hf_name:
            return hf_name.replace(old + ".", new + "."), shard
    return hf_name, None


def shards(full: dict, cfg, tp: int, r: int, dtype, fill=float("nan")) -> dict:
    """{vLLM name: tensor} on TP rank r, from {HF name: full tensor}."""
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    # LlamaAttention / Qwen3Attention: config.head_dim or hidden // heads; Qwen2Attention
    # always hidden // heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if cfg.model_type == "qwen2":
        head_dim = cfg.hidden_size // heads
    # QKVParallelLinear.__init__
    num_heads = heads // tp
    if tp >= kv:
        num_kv_heads, replicas = 1, tp // kv
    else:
        num_kv_heads, replicas = kv // tp, 1
    parts: dict = {}
    out: dict = {}
    for hf, w in full.items():
        name, shard = vllm_name(hf)
        w = w.detach()
        if shard in ("q", "k", "v"):  # QKVParallelLinear.weight_loader, output_dim 0
            size = (num_heads if shard == "q" else num_kv_heads) * head_dim
            shard_rank = r if shard == "q" else r // replicas
            parts.setdefault(name, {})[shard] = w.narrow(0, shard_rank * size, size)
        elif shard in (0, 1):  # MergedColumnParallelLinear.weight_loader
            size = w.shape[0] // tp
            parts.setdefault(name, {})[shard] = w.narrow(0, r * size, size)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):  # RowParallelLinear, input_dim 1
            size = w.shape[1] // tp
            out[name] = w.narrow(1, r * size, size)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):  # VocabParallelEmbedding
            vocab = w.shape[0]
            padded = -(-vocab // 64) * 64
            per = padded // tp
            start, end = min(r * per, vocab), min((r + 1) * per, vocab)
            t = torch.full((per, w.shape[1]), fill, dtype=dtype)
            t[: end - start] = w[start:end].to(dtype)
            out[name] = t
        else:  # norms (Qwen3's q_norm / k_norm too), o_proj / down_proj biases: replicated
            out[name] = w
    for name, p in parts.items():
        order = ["q", "k", "v"] if "q" in p else [0, 1]
        out[name] = torch.cat([p[k] for k in order])
    return {n: t.to(dtype) for n, t in out.items()}
