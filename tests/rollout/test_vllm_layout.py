"""tp_layout (vLLM's tensor-parallel weight layout) in one process: every TP rank's engine
parameters written by a local transfer from full HF weights, checked bitwise against
`_vllm_ref.shards` (vLLM's loader rule restated with torch slicing), poisoned so that unwritten
elements show; vocab padding rows must stay poisoned. Configs vLLM's rule does not cover raise
UnsupportedError."""

from __future__ import annotations

import itertools
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _vllm_ref

import reshard as rs
from reshard.integrations import vllm as rsvllm

transformers = pytest.importorskip("transformers")


def _llama(**kw):
    base = dict(
        vocab_size=200,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    base.update(kw)
    return transformers.LlamaConfig(**base)


def _qwen2(**kw):
    base = dict(
        vocab_size=130,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    base.update(kw)
    return transformers.Qwen2Config(**base)


def _mistral(**kw):
    base = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,  # != hidden / heads: vLLM's Llama path reads config.head_dim
    )
    base.update(kw)
    return transformers.MistralConfig(**base)


def _qwen3(**kw):
    base = dict(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # != hidden / heads: vLLM's Qwen3 reads config.head_dim
        tie_word_embeddings=False,
    )
    base.update(kw)
    return transformers.Qwen3Config(**base)


def _full_weights(cfg, seed=0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():  # norms and biases start constant: make every value distinct
            p.copy_(torch.randn_like(p))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _sync(cfg, tp, src_dtype, dtype, ranks=None):
    """Full HF weights (one storage each, rank 0) -> every TP rank's poisoned vLLM params."""
    full = {n: t.to(src_dtype) for n, t in _full_weights(cfg).items()}
    tgt = rsvllm.tp_layout(cfg, tp, ranks or [0] * tp, dtype=dtype)
    assert set(tgt.layout.tensors) == set(full), "tp_layout names must be the HF model's"
    tensors, storages, src = {}, {}, {}
    for i, (n, t) in enumerate(full.items()):
        tensors[n] = rs.replicated(t.shape, [i])
        storages[i] = rs.Storage(0, t.dtype, t.numel())
        src[i] = t.reshape(-1)
    engine = [
        {n: torch.full(shape, float("nan"), dtype=dtype) for n, shape in tgt.shapes.items()}
        for _ in range(tp)
    ]
    dst = {}
    for r in range(tp):
        dst.update(tgt.buffers(engine[r], r))
    rs.Transfer(rs.Layout(tensors, storages), tgt.layout)(src, dst)
    return cfg, full, tgt, engine


def _bits(t):
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _check(cfg, full, tgt, engine, dtype):
    tp = tgt.tp_size
    for r in range(tp):
        want = _vllm_ref.shards(full, cfg, tp, r, dtype)
        assert set(want) == set(engine[r]), "vLLM parameter names"
        # TPLayout.load (stream-then-shard: full tensors sliced on the TP rank) agrees too
        loaded = {n: torch.full(s, float("nan"), dtype=dtype) for n, s in tgt.shapes.items()}
        for n, t in full.items():
            tgt.load(n, t.to(dtype), r, loaded)
        for n, w in want.items():
            got = engine[r][n]
            assert got.shape == w.shape, (n, r)
            assert torch.equal(_bits(got), _bits(w)), f"TP rank {r} of {tp}: {n} differs"
            assert torch.equal(_bits(loaded[n]), _bits(w)), f"load(): rank {r} of {tp}: {n}"


CASES = [
    ("llama gqa kv=2", _llama, {}, (1, 2, 4, 8)),  # 4, 8 > kv heads: replicated kv heads
    ("llama gqa kv=4", _llama, {"num_key_value_heads": 4}, (2,)),  # tp < kv: kv split
    (
        "llama mha, biases, tied",
        _llama,
        {
            "num_key_value_heads": 8,
            "attention_bias": True,
            "mlp_bias": True,
            "tie_word_embeddings": True,
        },
        (2, 4),
    ),
    ("qwen2 qkv bias, tied", _qwen2, {}, (1, 2, 4)),
    ("qwen2 untied", _qwen2, {"tie_word_embeddings": False}, (2,)),
    ("mistral head_dim", _mistral, {}, (2, 4)),
    # 4 > kv heads: replicated kv heads of head_dim 16; q_norm / k_norm replicated
    ("qwen3 head_dim, qk norms", _qwen3, {}, (1, 2, 4)),
    (
        "qwen3 tied, head_dim = hidden / heads",
        _qwen3,
        {"tie_word_embeddings": True, "head_dim": 8},
        (2,),
    ),
]


@pytest.mark.parametrize("label,make,kw,tps", CASES, ids=[c[0] for c in CASES])
def test_tp_layout_matches_vllm_rule(label, make, kw, tps):
    for tp in tps:
        cfg, full, tgt, engine = _sync(make(**kw), tp, torch.float32, torch.bfloat16)
        _check(cfg, full, tgt, engine, torch.bfloat16)


def test_same_dtype_and_fp16():
    for src, dst in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)):
        cfg, full, tgt, engine = _sync(_llama(), 4, src, dst)
        _check(cfg, full, tgt, engine, dst)


def test_vocab_padding_rows_stay_unwritten():
    # vocab 200 -> padded 256; tp 4: 64 rows per rank, rank 3 holds rows 192..199 then padding
    cfg, full, tgt, engine = _sync(_llama(), 4, torch.float32, torch.bfloat16)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        shard = engine[3][name]
        assert shard.shape == (64, 32)
        assert not shard[:8].isnan().any()
        assert shard[8:].isnan().all(), "padding rows were written"
        assert not engine[0][name].isnan().any()


def test_kv_replication_layout():
    # tp 8, 2 kv heads: ranks 0-3 hold kv head 0, ranks 4-7 kv head 1
    cfg = _llama()
    tgt = rsvllm.tp_layout(cfg, 8, list(range(8)))
    k = tgt.layout.tensors["model.layers.0.self_attn.k_proj.weight"]
    hd = 32 // 8
    for piece in k.pieces:
        r = tgt.layout.storages[piece.location].rank
        assert piece.start[0] == (r // 4) * hd and piece.shape[0] == hd
        assert piece.offset == 1 * hd * 32  # after this rank's one q head
    assert tgt.shapes["model.layers.0.self_attn.qkv_proj.weight"] == (3 * hd, 32)


def test_layout_ranks_follow_ranks_argument():
    tgt = rsvllm.tp_layout(_llama(), 2, [3, 1])
    for (_name, r), loc in tgt.locations.items():
        assert tgt.layout.storages[loc].rank == [3, 1][r]


@pytest.mark.parametrize(
    "cfg,tp,match",
    [
        (_llama(), 3, "does not divide num_attention_heads"),
        (
            _llama(num_attention_heads=6, num_key_value_heads=3, hidden_size=36),
            2,
            "num_key_value_heads",
        ),
        (
            _llama(num_attention_heads=12, num_key_value_heads=3, hidden_size=36),
            2,
            "num_key_value_heads",
        ),
        (_llama(intermediate_size=50), 4, "intermediate_size"),
        (
            _llama(num_attention_heads=24, num_key_value_heads=24, hidden_size=48, vocab_size=64),
            3,
            "padded vocab",
        ),
        (_llama(hidden_act="gelu"), 2, "silu"),
        (_qwen2(qk_norm=True), 2, "qk_norm"),
        (_qwen2(head_dim=16), 2, "head_dim"),
        (transformers.GPT2Config(), 1, "model_type"),
        (_llama(num_key_value_heads=0), 2, "num_key_value_heads = 0"),
        (_llama(num_key_value_heads=-2), 2, "num_key_value_heads = -2"),
        (_llama(head_dim=-4), 2, "head_dim = -4"),
        (_qwen3(attention_bias=True), 2, "qwen3 with attention_bias"),
        (_qwen3(architectures=["Qwen3ForSequenceClassification"]), 2, "architectures"),
        (_llama(architectures=["LlamaForSequenceClassification"]), 2, "architectures"),
        (_qwen2(architectures=["LlamaForCausalLM"]), 2, "architectures"),
        (_llama(architectures="LlamaForCausalLM"), 2, "architectures"),
        (_llama(quantization_config={"quant_method": "fp8"}), 2, "quantization_config"),
        # vLLM names a multimodal model's decoder language_model.model.*, HF model.language_model.*
        (transformers.LlavaConfig(text_config=_llama().to_dict()), 2, "model_type 'llava'"),
    ],
)
def test_unsupported_configs(cfg, tp, match):
    with pytest.raises(rs.UnsupportedError, match=match):
        rsvllm.tp_layout(cfg, tp, list(range(tp)))


def test_architectures_of_the_same_layout_are_covered():
    for cfg in (
        _llama(architectures=["LlamaForCausalLM"]),
        _llama(architectures=["MistralForCausalLM"]),  # vLLM's Mistral is its Llama
        _mistral(architectures=["MistralForCausalLM"]),
        _qwen2(architectures=["Qwen2ForCausalLM"]),
        _qwen3(architectures=["Qwen3ForCausalLM"]),
    ):
        rsvllm.tp_layout(cfg, 2, [0, 1])


def test_qwen3_layout_has_its_qk_norms_replicated():
    tgt = rsvllm.tp_layout(_qwen3(), 2, [0, 1])
    for norm in ("q_norm", "k_norm"):
        name = f"model.layers.1.self_attn.{norm}.weight"
        assert tgt.shapes[name] == (16,)
        assert {tgt.layout.storages[p.location].rank for p in tgt.layout.tensors[name].pieces} == {
            0,
            1,
        }
    # 2 q heads + 1 kv head each for k and v, of head_dim 16 (not hidden / heads = 8)
    assert tgt.shapes["model.layers.0.self_attn.qkv_proj.weight"] == ((2 + 2 * 1) * 16, 32)
    assert tgt.shapes["model.layers.0.self_attn.o_proj.weight"] == (32, 2 * 16)


def test_llama_qkv_bias_present_as_none_is_refused():
    """vLLM's Llama takes config.qkv_bias whenever the attribute exists: None drops the qkv
    bias while attention_bias keeps o_proj's; tp_layout laid out both."""
    cfg = _llama(attention_bias=True)
    cfg.qkv_bias = None
    with pytest.raises(rs.UnsupportedError, match="config.qkv_bias is set"):
        rsvllm.tp_layout(cfg, 2, [0, 1])


def test_load_refuses_what_vllms_loader_asserts():
    """load() copied a wrong-sized full tensor by broadcasting it (a (1,) norm became 32 equal
    values) and a TP rank past tp_size copied nothing into a vocab shard, silently."""
    tgt = rsvllm.tp_layout(_llama(), 2, [0, 0])
    params = {n: torch.full(s, float("nan")) for n, s in tgt.shapes.items()}
    with pytest.raises(ValueError, match="model.norm.weight: the full tensor has shape"):
        tgt.load("model.norm.weight", torch.ones(1), 0, params)
    with pytest.raises(ValueError, match="full tensor has shape \\(32, 32\\), got \\(32, 1\\)"):
        tgt.load("model.layers.0.self_attn.q_proj.weight", torch.ones(32, 1), 0, params)
    with pytest.raises(ValueError, match="tp_rank 2 out of range"):
        tgt.load("model.embed_tokens.weight", torch.ones(200, 32), 2, params)
    with pytest.raises(ValueError, match="'nope' is not a tensor of this layout"):
        tgt.load("nope", torch.ones(3), 0, params)
    with pytest.raises(ValueError, match="must be TP rank 0's parameter of shape \\(32,\\)"):
        tgt.load("model.norm.weight", torch.ones(32), 0, {"model.norm.weight": torch.zeros(2, 32)})
    with pytest.raises(ValueError, match="qkv_proj.weight'\\] must be TP rank 1's parameter"):
        tgt.load("model.layers.0.self_attn.k_proj.weight", torch.ones(8, 32), 1, {})
    assert all(t.isnan().all() for t in params.values()), "a refused load wrote"


def _with(cfg, **kw):
    """`cfg` with attributes set after its validation (as code that edits a loaded config does);
    a plain object where transformers refuses the value itself."""
    try:
        for k, v in kw.items():
            setattr(cfg, k, v)
        return cfg
    except Exception:  # noqa: BLE001 - transformers' strict field validation
        return types.SimpleNamespace(**{**cfg.to_dict(), **kw})


@pytest.mark.timeout(60)  # 2**45 layers were built one by one (days, unbounded memory)
@pytest.mark.parametrize(
    "change, match",
    [
        (dict(num_hidden_layers=2**45), "num_hidden_layers 35184372088832"),
        (dict(vocab_size=2**50), "vocab_size 1125899906842624"),
        (dict(hidden_size=2**62, head_dim=8), "hidden_size 4611686018427387904"),
        (dict(head_dim=2**61), "head_dim 2305843009213693952"),
    ],
)
def test_configs_beyond_the_geometry_are_refused_up_front(change, match):
    """Refused naming the config's sizes before anything is built (they failed as a
    LayoutError about a Storage's numel, or never finished)."""
    with pytest.raises(rs.UnsupportedError, match="more than 2\\*\\*53") as e:
        rsvllm.tp_layout(_with(_llama(), **change), 2, [0, 1])
    assert match in str(e.value) and "more than 2**53" in str(e.value)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(hidden_size=4, head_dim=None), "head_dim would be 0"),
        (dict(tie_word_embeddings="false"), "tie_word_embeddings = 'false'"),
        (dict(attention_bias="false"), "attention_bias = 'false'"),
        (dict(mlp_bias=1), "mlp_bias = 1"),
    ],
)
def test_config_values_that_would_mean_something_else_are_refused(change, match):
    """hidden_size < num_heads gave zero-row q/k/v; bool("false") turned a setting on."""
    with pytest.raises(rs.UnsupportedError, match=match):
        rsvllm.tp_layout(_with(_llama(), **change), 2, [0, 1])
    with pytest.raises(rs.UnsupportedError, match="qk_norm = 'false'"):
        rsvllm.tp_layout(_with(_qwen2(), qk_norm="false"), 2, [0, 1])
    # None is the config's default
    assert rsvllm.tp_layout(_with(_llama(), mlp_bias=None), 2, [0, 1]).spec.mlp_bias is False


def test_config_json_dict_is_read_as_its_model_config():
    """A dict (config.json's contents) gives the same layout as the config object; keys it
    leaves out take the model type's transformers defaults."""
    cfg = _llama()
    want = rsvllm.tp_layout(cfg, 2, [0, 1]).layout
    assert rsvllm.tp_layout(cfg.to_dict(), 2, [0, 1]).layout == want
    assert rsvllm.tp_layout(cfg.to_diff_dict(), 2, [0, 1]).layout == want
    with pytest.raises(rs.UnsupportedError, match="needs its 'model_type'"):
        rsvllm.tp_layout({"hidden_size": 32}, 2, [0, 1])
    with pytest.raises(rs.UnsupportedError, match="model_type 'no-such-model'"):
        rsvllm.tp_layout({"model_type": "no-such-model"}, 2, [0, 1])
    for bad in ({"rope_scaling": {"rope_type": "yarn"}}, {"num_hidden_layers": "2"}):
        with pytest.raises(rs.UnsupportedError, match="cannot build its config from this dict"):
            rsvllm.tp_layout({**cfg.to_dict(), **bad}, 2, [0, 1])
    with pytest.raises(rs.UnsupportedError, match="model_type 'gpt2'"):
        rsvllm.tp_layout(transformers.GPT2Config().to_dict(), 1, [0])


def test_bad_arguments():
    with pytest.raises(ValueError, match="one per TP rank"):
        rsvllm.tp_layout(_llama(), 2, [0])
    with pytest.raises(ValueError, match="tp_size"):
        rsvllm.tp_layout(_llama(), 0, [])
    with pytest.raises(ValueError, match="ranks must be a list"):
        rsvllm.tp_layout(_llama(), 2, None)


def test_buffers_names_parameters_that_share_memory():
    """Two engine parameters over the same bytes: the transfer's preflight refused them by
    location number only ("target locations 10 and 12 alias"); buffers() names them."""
    tgt = rsvllm.tp_layout(_llama(), 2, [0, 0])
    params = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in tgt.shapes.items()}
    a, b = "model.layers.0.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight"
    flat = torch.zeros(64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"{a} and {b} share memory"):
        tgt.buffers(dict(params, **{a: flat[:32], b: flat[16:48]}), 0)
    with pytest.raises(ValueError, match=f"{a} and {b} share memory"):
        tgt.buffers(dict(params, **{a: flat[:32], b: flat[:32]}), 0)
    # freed storages all sit at address 0: the transfer's preflight names them as freed
    freed = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in tgt.shapes.items()}
    for n in (a, b):
        freed[n].untyped_storage().resize_(0)
    # (an iterator: a failure's report would repr a dict's freed tensors, which crashes torch)
    assert len(tgt.buffers(iter(freed.items()), 0)) == len(tgt.shapes)
    # adjacent views of one flat buffer (as engines pack parameters) are fine
    assert len(tgt.buffers(dict(params, **{a: flat[:32], b: flat[32:]}), 0)) == len(tgt.shapes)


def test_numpy_ints_are_tp_sizes_and_ranks():
    """np.int64 ranks were refused as 'ranks must be non-negative ints, got 0' (a numpy int
    prints as a plain one); Stream and plan() take them."""
    want = rsvllm.tp_layout(_llama(), 2, [1, 0])
    tgt = rsvllm.tp_layout(_llama(), np.int64(2), np.array([1, 0]))
    assert tgt.layout == want.layout and tgt.tp_size == 2 and type(tgt.tp_size) is int
    assert tgt.ranks == [1, 0] and all(type(r) is int for r in tgt.ranks)
    params = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in tgt.shapes.items()}
    assert tgt.buffers(params, np.int32(1)).keys() == want.buffers(params, 1).keys()
    full = torch.randn(32)
    tgt.load("model.norm.weight", full, np.int64(1), params)
    assert torch.equal(params["model.norm.weight"], full.to(torch.bfloat16))
    for bad in (1.0, "1", True, torch.tensor(1)):
        with pytest.raises(ValueError, match="tp_rank must be an int"):
            tgt.buffers(params, bad)
    with pytest.raises(ValueError, match="ranks must be non-negative ints, got 1.0 \\(float\\)"):
        rsvllm.tp_layout(_llama(), 2, [0, 1.0])


@pytest.mark.timeout(30)
def test_ranks_that_are_unordered_or_endless_are_refused():
    """A set's iteration order placed TP ranks on processes the caller did not name; an
    endless iterator was read forever."""
    for ranks in ({3, 1}, frozenset((0, 1)), {0: 1, 1: 0}, "01"):
        with pytest.raises(ValueError, match="ranks must be a list"):
            rsvllm.tp_layout(_llama(), 2, ranks)
    with pytest.raises(ValueError, match="ranks has more than 2 entries, tp_size is 2"):
        rsvllm.tp_layout(_llama(), 2, itertools.count())
    assert rsvllm.tp_layout(_llama(), 2, iter([1, 0])).ranks == [1, 0]


def test_buffers_names_every_mismatch():
    tgt = rsvllm.tp_layout(_llama(), 2, [0, 0])
    params = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in tgt.shapes.items()}
    bufs = tgt.buffers(params, 1)
    assert len(bufs) == len(tgt.shapes)
    assert all(view.dim() == 1 for view in bufs.values())
    # views, never copies
    first = tgt.locations[("model.norm.weight", 1)]
    assert bufs[first].data_ptr() == params["model.norm.weight"].data_ptr()
    bad = dict(params)
    del bad["model.norm.weight"]
    bad["lm_head.weight"] = torch.zeros(3, 3, dtype=torch.bfloat16)
    bad["model.layers.0.mlp.down_proj.weight"] = params[
        "model.layers.0.mlp.down_proj.weight"
    ].float()
    with pytest.raises(ValueError) as err:
        tgt.buffers(bad.items(), 0)
    msg = str(err.value)
    assert "model.norm.weight: missing" in msg
    assert "lm_head.weight: shape (3, 3)" in msg
    assert "down_proj.weight: dtype torch.float32" in msg
    with pytest.raises(ValueError, match="out of range"):
        tgt.buffers(params, 2)
    with pytest.raises(ValueError, match="model.norm.weight: expected a tensor, got ndarray"):
        tgt.buffers(dict(params, **{"model.norm.weight": np.zeros(4)}), 0)
    with pytest.raises(ValueError, match="named_params must be"):
        tgt.buffers(None, 0)


def test_buffers_refuses_a_name_given_twice():
    """Two TP ranks' named parameters concatenated (or a name repeated): dict() kept the last
    tensor of each name silently, so one rank's shards went into the other's parameters."""
    tgt = rsvllm.tp_layout(_llama(), 2, [0, 0])
    ranks = [
        [(n, torch.zeros(s, dtype=torch.bfloat16)) for n, s in tgt.shapes.items()] for _ in range(2)
    ]
    with pytest.raises(ValueError, match="model.norm.weight: given 2 times, as different"):
        tgt.buffers(ranks[0] + ranks[1], 0)
    # the same tensor twice is one parameter; a repeated name the layout does not know is ignored
    extra = [ranks[0][-1], ("model.rotary_emb.inv_freq", torch.ones(2))] * 2
    assert len(tgt.buffers(ranks[0] + extra, 0)) == len(tgt.shapes)


def test_buffers_says_what_the_names_suggest():
    """The HF model's parameters, or an engine's under another prefix, were reported as a list
    of every parameter missing or misshapen, without saying why."""
    tgt = rsvllm.tp_layout(_llama(), 2, [0, 0])
    hf = {n: torch.zeros(tl.shape, dtype=torch.bfloat16) for n, tl in tgt.layout.tensors.items()}
    with pytest.raises(ValueError, match="named_params holds HF names, e.g. 'model.layers.0.mlp"):
        tgt.buffers(hf, 0)
    prefixed = {f"model.{n}": torch.zeros(s, dtype=torch.bfloat16) for n, s in tgt.shapes.items()}
    with pytest.raises(ValueError, match="given e.g. 'model.model.embed_tokens.weight'.*prefix"):
        tgt.buffers(prefixed, 0)


def test_load_into_parameters_that_require_grad_and_from_meta():
    """An nn.Module's parameters (requires_grad) made load() raise autograd's in-place error;
    a meta tensor, full or target, loaded nothing without a word."""
    tgt = rsvllm.tp_layout(_llama(), 2, [0, 0])
    full = _full_weights(_llama())
    want = _vllm_ref.shards(full, _llama(), 2, 1, torch.float32)
    params = {n: torch.nn.Parameter(torch.full(s, float("nan"))) for n, s in tgt.shapes.items()}
    for n, t in full.items():
        tgt.load(n, t, 1, params)
    for n, w in want.items():
        assert torch.equal(_bits(params[n].detach()), _bits(w)), n
    a = "model.norm.weight"
    plain = {n: torch.zeros(s) for n, s in tgt.shapes.items()}
    with pytest.raises(ValueError, match="model.norm.weight: full on the meta device"):
        tgt.load(a, torch.ones(32, device="meta"), 0, plain)
    meta = dict(plain, **{a: torch.zeros(32, device="meta")})
    with pytest.raises(ValueError, match="params\\['model.norm.weight'\\] on the meta device"):
        tgt.load(a, torch.ones(32), 0, meta)
