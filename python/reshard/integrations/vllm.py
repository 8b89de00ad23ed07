"""vLLM's tensor-parallel weight layout of HF decoder models, as a reshard target.

    tgt = tp_layout(hf_config, tp_size, ranks, dtype=torch.bfloat16)  # ranks[i]: TP rank i's process
    tgt.layout                            # rs.Layout over the HF parameter names
    tgt.buffers(named_params, tp_rank)    # {location: view} of one TP rank's engine parameters

A transfer from any source layout of the HF parameters (e.g. a DeepSpeed ZeRO-3 engine's
`describe(engine, "param").layout`) into `tgt.layout` writes every TP rank's shards straight into
its vLLM parameters, in vLLM's own kernel layout, with no full tensor materialized anywhere.

The rule, read from vLLM 0.33.0 and 0.34.0 (the same rule; `model_executor/layers/linear.py`,
`model_executor/layers/vocab_parallel_embedding.py`, `model_executor/models/llama.py`,
`qwen2.py`, `qwen3.py`, `mistral.py`, `registry.py`; docs/rollout.md cites the lines), for TP
rank r of tp:
- `qkv_proj` (fused from q/k/v_proj) rows `[q_r | k_r | v_r]`: q heads split evenly; k and v heads
  split evenly when tp <= num_kv_heads, else rank r holds kv head `r // (tp / num_kv_heads)`
  (replicated across tp / num_kv_heads ranks). The qkv bias follows the same rows.
- `gate_up_proj` (fused from gate/up_proj) rows `[gate_r | up_r]`, bias likewise.
- `o_proj`, `down_proj`: split along the input dim (columns); their biases replicated.
- `embed_tokens`, `lm_head`: vocab padded to a multiple of 64, split evenly in rows; rank r
  holds rows `[r * p, min((r + 1) * p, vocab))` at the start of its shard, the padding rows
  after them are never written. Tied embeddings: one tensor (`model.embed_tokens.weight`).
- norms replicated on every rank (Qwen3's q_norm / k_norm, of head_dim, too).
Configs this rule does not cover raise `UnsupportedError` naming the setting.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

import reshard as rs
from reshard.errors import UnsupportedError
from reshard.layout import MAX_ELEMENTS

__all__ = ["TPLayout", "tp_layout"]

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
# model_type -> the vLLM architectures (config.architectures, which picks vLLM's model class)
# whose layout is the rule of that model type; vLLM's MistralForCausalLM is its Llama
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "LLaMAForCausalLM", "MistralForCausalLM"),
    "mistral": ("LlamaForCausalLM", "LLaMAForCausalLM", "MistralForCausalLM"),
    "qwen2": ("Qwen2ForCausalLM",),
    "qwen3": ("Qwen3ForCausalLM",),
}
MODEL_TYPES = tuple(ARCHITECTURES)
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
FUSED.update(gate_proj="gate_up_proj", up_proj="gate_up_proj")


@dataclass
class TPLayout:
    """vLLM's TP layout of one model: `.layout` (HF names) and where each shard lives.

    shapes: {vLLM parameter name: shape of that parameter on every TP rank}.
    locations: {(vLLM parameter name, tp_rank): storage location in `.layout`}.
    """

    layout: rs.Layout
    tp_size: int
    ranks: list
    dtype: torch.dtype
    shapes: dict = field(repr=False)
    locations: dict = field(repr=False)
    spec: _Spec = field(repr=False, default=None)

    def load(self, name, full, tp_rank, params) -> None:
        """What vLLM's weight loader does with a full HF tensor on TP rank `tp_rank`: copy the
        rows (or columns) of that rank into its parameter in `params` ({vLLM name: tensor}),
        with plain torch slicing. The stream-then-shard path (full tensors to every TP rank,
        each taking its part); a transfer into `layout` writes the same elements directly.
        """
        tp_rank = self._check_load(name, full, tp_rank, params)
        s, tp = self.spec, self.tp_size
        hd = s.head_dim
        q_rows = s.heads // tp * hd
        kv_rows, rep = (s.kv_heads // tp * hd, 1) if tp < s.kv_heads else (hd, tp // s.kv_heads)
        inter = s.intermediate // tp
        full = full.detach()
        # detached, as vLLM's loaders write param.data: a parameter that requires grad (an
        # nn.Module's) is written in place, not refused by autograd
        dst = params[_vllm_name(name)].detach()
        fused = (
            ("q_proj", 0, q_rows, tp_rank),
            ("k_proj", q_rows, kv_rows, tp_rank // rep),
            ("v_proj", q_rows + kv_rows, kv_rows, tp_rank // rep),
            ("gate_proj", 0, inter, tp_rank),
            ("up_proj", inter, inter, tp_rank),
        )
        for hf, first, size, shard_rank in fused:
            if f".{hf}." in name:
                dst.narrow(0, first, size).copy_(full.narrow(0, shard_rank * size, size))
                return
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            cols = full.shape[1] // tp
            dst.copy_(full.narrow(1, tp_rank * cols, cols))
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            per = _padded_vocab(s.vocab) // tp
            lo, hi = min(tp_rank * per, s.vocab), min((tp_rank + 1) * per, s.vocab)
            dst[: hi - lo].copy_(full[lo:hi])
        else:  # norms and row-parallel biases: replicated
            dst.copy_(full)

    def _check_load(self, name, full, tp_rank, params) -> int:
        """What vLLM's loader asserts (shapes), so that `copy_` never broadcasts a wrong-sized
        tensor into a parameter, and a rank outside the TP group or a meta tensor never
        silently copies nothing. Returns tp_rank as an int."""
        tp_rank = _check_tp_rank(tp_rank, self.tp_size)
        tl = self.layout.tensors.get(name) if isinstance(name, str) else None
        if tl is None:
            raise ValueError(
                f"{name!r} is not a tensor of this layout (HF parameter names, e.g. "
                f"{next(iter(self.layout.tensors))!r})"
            )
        if not isinstance(full, torch.Tensor) or tuple(full.shape) != tuple(tl.shape):
            got = tuple(full.shape) if isinstance(full, torch.Tensor) else type(full).__name__
            raise ValueError(f"{name}: the full tensor has shape {tuple(tl.shape)}, got {got}")
        vname = _vllm_name(name)
        t = params.get(vname) if isinstance(params, Mapping) else None
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != self.shapes[vname]:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else t
            raise ValueError(
                f"params[{vname!r}] must be TP rank {tp_rank}'s parameter of shape "
                f"{self.shapes[vname]}, got {got}"
            )
        # copy_ from or into a meta tensor (a model not materialized) is no error in torch:
        # nothing would be loaded, silently
        meta = [w for w, x in (("full", full), (f"params[{vname!r}]", t)) if x.is_meta]
        if meta:
            raise ValueError(f"{name}: {' and '.join(meta)} on the meta device holds no data")
        return tp_rank

    def buffers(self, named_params, tp_rank: int) -> dict:
        """{location: flat view} of TP rank `tp_rank`'s parameters, for a transfer's targets.

        named_params: that rank's `model.named_parameters()` (an iterable of (name, tensor) or a
        mapping), vLLM names. Raises ValueError naming every parameter that is missing or whose
        shape, dtype or contiguity differs from the layout, and every two that share memory
        (call it once at setup, on every process that hosts a TP rank). Parameters the layout
        does not know are left alone.
        """
        tp_rank = _check_tp_rank(tp_rank, self.tp_size)
        params, twice = _named(named_params)
        out, problems, views = {}, [], []
        for name, shape in self.shapes.items():
            t = params.get(name)
            if t is None:
                problems.append(f"{name}: missing")
                continue
            if not isinstance(t, torch.Tensor):
                problems.append(f"{name}: expected a tensor, got {type(t).__name__}")
                continue
            t = t.data if isinstance(t, torch.nn.Parameter) else t
            bad = []
            if tuple(t.shape) != shape:
                bad.append(f"shape {tuple(t.shape)}, vLLM's TP layout has {shape}")
            if t.dtype != self.dtype:
                bad.append(f"dtype {t.dtype}, the layout was built for {self.dtype}")
            if not t.is_contiguous():
                bad.append("not contiguous")
            if bad:
                problems.append(f"{name}: " + "; ".join(bad))
            else:
                out[self.locations[(name, tp_rank)]] = t.view(-1)
                views.append((name, t))
        problems += _shared_memory(views)
        problems += [
            f"{name}: given {n} times, as different tensors (one TP rank's parameters, once "
            "each: named_parameters() of one engine)"
            for name, n in twice.items()
            if name in self.shapes
        ]
        if problems:
            raise ValueError(
                f"TP rank {tp_rank}: {len(problems)} engine parameter(s) do not match "
                f"tp_layout(tp_size={self.tp_size}): "
                + "; ".join(problems)
                + _names_hint(params, self.shapes)
            )
        return out


def _names_hint(params, shapes) -> str:
    """What the names of `params` suggest was passed instead of one engine's parameters:
    the HF model's (unfused q/k/v, gate/up), or names under another prefix; '' when
    nothing."""
    names = [n for n in params if isinstance(n, str)]
    hf = sorted(n for n in names if _vllm_name(n) != n and _vllm_name(n) in shapes)
    if hf:
        return (
            f" (named_params holds HF names, e.g. {hf[0]!r}: buffers() takes the engine's "
            "own parameters, vLLM names with q/k/v fused into qkv_proj and gate/up into "
            "gate_up_proj, each TP rank's shard)"
        )
    if names and not any(n in shapes for n in names):
        return (
            f" (no name of named_params is the layout's: given e.g. {names[0]!r}, the layout "
            f"has e.g. {next(iter(shapes))!r}; another prefix?)"
        )
    return ""


def _named(named_params):
    """({name: tensor}, {name: count} of the names given more than once with different
    tensors) of `named_params`: pairs of (name, tensor) or a mapping. A name given twice is
    not resolved by order (dict() would keep the last silently): two engines' parameters
    concatenated would write one rank's shards into the other's."""
    if isinstance(named_params, Mapping):
        return dict(named_params.items()), {}
    params, seen = {}, {}
    try:
        for name, t in named_params:
            if name in params and params[name] is not t:
                seen[name] = seen.get(name, 1) + 1
            params[name] = t
    except (TypeError, ValueError):
        raise ValueError(
            "named_params must be model.named_parameters() (pairs of name and tensor) or a "
            f"mapping, got {type(named_params).__name__}"
        ) from None
    return params, seen


def _shared_memory(views) -> list[str]:
    """'a and b share memory' for each pair of (name, tensor) whose bytes overlap: the
    transfer would write both, one over the other (its preflight refuses that too, by
    location number; here the parameters are named)."""
    spans = sorted(
        (str(t.device), t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name)
        for name, t in views
        # meta tensors and freed storages (all at address 0) are the preflight's to refuse
        if t.device.type != "meta" and t.numel() and t.untyped_storage().nbytes()
    )
    out, last = [], None  # last: (device, end, name) of the span reaching furthest so far
    for dev, lo, hi, name in spans:
        if last is not None and last[0] == dev and lo < last[1]:
            out.append(f"{last[2]} and {name} share memory (one would overwrite the other)")
        if last is None or last[0] != dev or hi > last[1]:
            last = (dev, hi, name)
    return out


def _int(value) -> int | None:
    """`value` as an int when it is an integer (numpy's too, as everywhere a rank is taken),
    else None (bools included)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def _check_tp_rank(tp_rank, tp_size) -> int:
    r = _int(tp_rank)
    if r is None:
        raise ValueError(f"tp_rank must be an int, got {tp_rank!r} ({type(tp_rank).__name__})")
    if not 0 <= r < tp_size:
        raise ValueError(f"tp_rank {r} out of range for tp_size {tp_size}")
    return r


def _vllm_name(hf_name: str) -> str:
    """The vLLM parameter an HF parameter loads into (q/k/v and gate/up are fused)."""
    for hf, vllm in FUSED.items():
        if f".{hf}." in hf_name:
            return hf_name.replace(f".{hf}.", f".{vllm}.")
    return hf_name


@dataclass(frozen=True)
class _Spec:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool = False  # q_norm / k_norm of head_dim, replicated (Qwen3)


def _spec(cfg) -> _Spec:
    cfg = _decoder_config(cfg)
    hidden, heads = _positive(cfg, "hidden_size"), _positive(cfg, "num_attention_heads")
    layers = _positive(cfg, "num_hidden_layers")
    inter, vocab = _positive(cfg, "intermediate_size"), _positive(cfg, "vocab_size")
    kv = _optional_positive(cfg, "num_key_value_heads") or heads
    if heads % kv:
        raise UnsupportedError(f"num_attention_heads {heads} is not a multiple of kv heads {kv}")
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedError(f"hidden_act {act!r}: vLLM's Llama/Qwen2 MLP supports only silu")
    head_dim = _optional_positive(cfg, "head_dim")
    if head_dim is None and hidden < heads:
        # vLLM's head_dim would be hidden_size // num_heads = 0: attention without elements
        raise UnsupportedError(
            f"hidden_size {hidden} < num_attention_heads {heads}: head_dim would be 0"
        )
    biases = {"qwen2": _qwen2_biases, "qwen3": _qwen3_biases}.get(cfg.model_type, _llama_biases)
    qkv_bias, o_bias, mlp_bias, qk_norm = biases(cfg, head_dim, hidden // heads)
    return _Spec(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv,
        head_dim=head_dim or hidden // heads,
        intermediate=inter,
        vocab=vocab,
        tied=_flag(cfg, "tie_word_embeddings"),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        qk_norm=qk_norm,
    )


def _flag(cfg, key) -> bool:
    """config.key as a bool (absent or None: False). Anything else is refused: bool("false")
    would silently turn a setting on."""
    v = getattr(cfg, key, None)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise UnsupportedError(f"config.{key} = {v!r}: true or false is required")
    return v


def _decoder_config(cfg):
    """The config of a decoder-only model type tp_layout covers, whose `architectures` (what
    picks vLLM's model class) has that model type's layout. A dict (config.json's contents)
    becomes the transformers config of its model_type, so keys it leaves out take that
    model's defaults, as vLLM would load them. A multimodal config is refused by its own
    model_type: vLLM names its decoder's parameters differently (`language_model.*`)."""
    if isinstance(cfg, Mapping):
        cfg = _config_from_dict(cfg)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in MODEL_TYPES:
        raise UnsupportedError(
            f"model_type {model_type!r}: tp_layout covers {MODEL_TYPES} decoders (vLLM's "
            "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)"
        )
    quant = getattr(cfg, "quantization_config", None)
    if quant is not None:
        # vLLM then loads into quantized parameters (packed or fp8 weights plus scales)
        raise UnsupportedError(
            f"quantization_config {quant!r}: tp_layout covers unquantized weights only"
        )
    archs = getattr(cfg, "architectures", None)
    if archs is not None:
        ok = ARCHITECTURES[model_type]
        if not isinstance(archs, (list, tuple)) or not all(a in ok for a in archs):
            raise UnsupportedError(
                f"architectures {archs!r} with model_type {model_type!r}: vLLM picks its model "
                f"class by architecture; tp_layout covers {list(ok)} for this model type"
            )
    return cfg


def _config_from_dict(d: Mapping):
    model_type = d.get("model_type")
    if not isinstance(model_type, str):
        raise UnsupportedError(
            f"a config dict needs its 'model_type' (as in config.json), got {model_type!r}"
        )
    import transformers

    try:
        return transformers.AutoConfig.for_model(**d)
    except Exception as exc:  # noqa: BLE001 - an unknown model_type, or a value its config refuses
        raise UnsupportedError(
            f"model_type {model_type!r}: transformers cannot build its config from this dict "
            f"({type(exc).__name__}: {exc})"
        ) from None


def _positive(cfg, key) -> int:
    v = getattr(cfg, key, None)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise UnsupportedError(f"config.{key} = {v!r}: a positive int is required")
    return v


def _optional_positive(cfg, key) -> int | None:
    """config.key, which HF leaves None (or out) for its default; else a positive int."""
    return None if getattr(cfg, key, None) is None else _positive(cfg, key)


def _qwen2_biases(cfg, head_dim, default_head_dim):
    """(qkv, o, mlp biases, qk_norm) of vLLM's Qwen2, whose attention always uses
    hidden_size // num_heads (config.head_dim ignored); its optional qk_norm is not HF
    Qwen2's."""
    if head_dim not in (None, default_head_dim):
        raise UnsupportedError(
            f"qwen2 with head_dim {head_dim} != hidden_size // num_attention_heads: vLLM's "
            "Qwen2 ignores config.head_dim"
        )
    if _flag(cfg, "qk_norm"):
        raise UnsupportedError("qwen2 with qk_norm: set config.qk_norm to false")
    return True, False, False, False


def _qwen3_biases(cfg, head_dim, default_head_dim):
    """(qkv, o, mlp biases, qk_norm) of vLLM's Qwen3: config.head_dim honoured (else
    hidden_size // num_heads), q_norm / k_norm always. HF's Qwen3 gives o_proj a bias with
    attention_bias, vLLM's never: refused."""
    if _flag(cfg, "attention_bias"):
        raise UnsupportedError(
            "qwen3 with attention_bias: HF's Qwen3 then has an o_proj bias, vLLM's Qwen3 none"
        )
    return False, False, False, True


def _llama_biases(cfg, head_dim, default_head_dim):
    """(qkv, o, mlp biases, qk_norm) of vLLM's Llama for an HF Llama/Mistral config."""
    for key in ("qkv_bias", "bias"):
        # vLLM's Llama takes config.qkv_bias whenever it exists (None: no qkv bias, while
        # attention_bias still gives o_proj one); config.bias only when truthy
        if hasattr(cfg, key) if key == "qkv_bias" else getattr(cfg, key, None) is not None:
            raise UnsupportedError(
                f"config.{key} is set: vLLM's Llama reads it for non-HF-Llama models; "
                "tp_layout covers HF Llama/Mistral configs (attention_bias, mlp_bias)"
            )
    if getattr(cfg, "ada_rms_norm_t_cond", False):
        raise UnsupportedError("mistral with ada_rms_norm_t_cond adds layers tp_layout lacks")
    attention_bias = _flag(cfg, "attention_bias")
    return attention_bias, attention_bias, _flag(cfg, "mlp_bias"), False


def _check_tp(s: _Spec, tp: int):
    """vLLM's divisibility asserts, as UnsupportedErrors."""
    if s.heads % tp:
        raise UnsupportedError(f"tp_size {tp} does not divide num_attention_heads {s.heads}")
    if tp >= s.kv_heads and tp % s.kv_heads:
        raise UnsupportedError(
            f"tp_size {tp} is not a multiple of num_key_value_heads {s.kv_heads} (vLLM replicates "
            "kv heads only evenly)"
        )
    if tp < s.kv_heads and s.kv_heads % tp:
        raise UnsupportedError(f"tp_size {tp} does not divide num_key_value_heads {s.kv_heads}")
    if s.intermediate % tp:
        raise UnsupportedError(f"tp_size {tp} does not divide intermediate_size {s.intermediate}")
    padded = _padded_vocab(s.vocab)
    if padded % tp:
        raise UnsupportedError(
            f"tp_size {tp} does not divide the padded vocab {padded} (vocab_size {s.vocab} "
            f"rounded up to a multiple of {VOCAB_PADDING})"
        )
    total = _total_elements(s, tp)
    if total > MAX_ELEMENTS:
        # checked before building: a config with 2**40 layers would otherwise be built layer
        # by layer for hours, and a huge vocab or hidden fail deep inside the geometry
        raise UnsupportedError(
            f"the TP shards of this config hold {total} elements in all (num_hidden_layers "
            f"{s.layers}, hidden_size {s.hidden}, head_dim {s.head_dim}, intermediate_size "
            f"{s.intermediate}, "
            f"vocab_size {s.vocab}, tp_size {tp}), more than 2**53 (the limit of reshard's "
            "geometry)"
        )


def _total_elements(s: _Spec, tp: int) -> int:
    """Elements of every vLLM parameter on every TP rank (what the layout's storages hold)."""
    hd, hidden = s.head_dim, s.hidden
    qkv = s.heads // tp * hd + 2 * max(1, s.kv_heads // tp) * hd
    inter = s.intermediate // tp
    layer = (qkv + 3 * inter) * hidden + hidden * (s.heads // tp * hd)  # qkv, gate_up, down, o
    layer += 2 * hidden + qkv * s.qkv_bias + hidden * s.o_bias + (2 * inter + hidden) * s.mlp_bias
    layer += 2 * hd * s.qk_norm
    vocab = _padded_vocab(s.vocab) // tp * hidden * (1 if s.tied else 2)
    return tp * (s.layers * layer + vocab + hidden)


def _padded_vocab(vocab: int) -> int:
    return -(-vocab // VOCAB_PADDING) * VOCAB_PADDING


def tp_layout(hf_config, tp_size: int, ranks, dtype=torch.bfloat16) -> TPLayout:
    """vLLM's tensor-parallel layout of a Llama / Mistral / Qwen2 / Qwen3 model (GQA included).

    hf_config: the model's `transformers` config, or config.json's contents as a dict. tp_size: vLLM's tensor-parallel size.
    ranks: `ranks[i]` is the rank (in the transfer's process group) of the process hosting
    TP rank i (one process may host several). dtype: the engine's parameter dtype.
    Tensors are the HF parameter names (`model.layers.0.self_attn.q_proj.weight`, ...), so any
    source layout of the HF model (e.g. a DeepSpeed `describe()`) transfers into it.
    """
    tp = _int(tp_size)
    if tp is None or tp < 1:
        raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
    tp_size = tp
    if isinstance(ranks, (set, frozenset, Mapping, str)):
        # a set's order is not the caller's: TP ranks would land on other processes
        raise ValueError(f"ranks must be a list of ranks, one per TP rank, got {ranks!r}")
    try:
        # at most one more than needed: an endless iterator is refused, not read forever
        ranks = list(itertools.islice(ranks, tp_size + 1))
    except TypeError:
        raise ValueError(f"ranks must be a list of ranks, one per TP rank, got {ranks!r}") from None
    if len(ranks) != tp_size:
        many = f"more than {tp_size}" if len(ranks) > tp_size else len(ranks)
        raise ValueError(f"ranks has {many} entries, tp_size is {tp_size}: one per TP rank")
    for i, r in enumerate(ranks):
        ranks[i] = _int(r)
        if ranks[i] is None or ranks[i] < 0:
            raise ValueError(f"ranks must be non-negative ints, got {r!r} ({type(r).__name__})")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    s = _spec(hf_config)
    _check_tp(s, tp_size)
    return _Builder(s, tp_size, ranks, dtype).build()


class _Builder:
    def __init__(self, spec, tp, ranks, dtype):
        self.s, self.tp, self.ranks, self.dtype = spec, tp, ranks, dtype
        self.storages, self.tensors, self.shapes, self.locations = {}, {}, {}, {}

    def param(self, vname, shape):
        """One vLLM parameter: a storage per TP rank; returns their locations by TP rank."""
        numel = 1
        for n in shape:
            numel *= n
        locs = []
        for r in range(self.tp):
            loc = len(self.storages)
            self.storages[loc] = rs.Storage(self.ranks[r], self.dtype, numel)
            self.locations[(vname, r)] = loc
            locs.append(loc)
        self.shapes[vname] = tuple(shape)
        return locs

    def rows(self, name, shape, locs, first_row):
        """HF tensor `name` split evenly by rows, block r at row `first_row` of TP rank r."""
        row = 1
        for n in shape[1:]:
            row *= n
        per = shape[0] // self.tp
        self.tensors[name] = rs.split(
            shape, 0, [per] * self.tp, locs, offsets=[first_row * row] * self.tp, name=name
        )

    def kv_rows(self, name, shape, locs, first_row):
        """k or v of the fused qkv: split like q when tp <= kv heads, else one head per rank,
        each head replicated on tp / kv_heads consecutive ranks."""
        s = self.s
        if self.tp <= s.kv_heads:
            self.rows(name, shape, locs, first_row)
            return
        rep = self.tp // s.kv_heads
        row = 1
        for n in shape[1:]:
            row *= n
        holders = [[locs[r] for r in range(h * rep, (h + 1) * rep)] for h in range(s.kv_heads)]
        self.tensors[name] = rs.split(
            shape,
            0,
            [s.head_dim] * s.kv_heads,
            holders,
            offsets=[[first_row * row] * rep for _ in range(s.kv_heads)],
            name=name,
        )

    def columns(self, name, shape, locs):
        per = shape[1] // self.tp
        self.tensors[name] = rs.split(shape, 1, [per] * self.tp, locs, name=name)

    def replicated(self, name, vname, shape):
        self.tensors[name] = rs.replicated(shape, self.param(vname, shape), name=name)

    def vocab(self, name, vname):
        s = self.s
        per = _padded_vocab(s.vocab) // self.tp
        locs = self.param(vname, (per, s.hidden))
        sizes = [max(0, min(per, s.vocab - r * per)) for r in range(self.tp)]
        self.tensors[name] = rs.split((s.vocab, s.hidden), 0, sizes, locs, name=name)

    def build(self) -> TPLayout:
        s, tp = self.s, self.tp
        hd, hidden = s.head_dim, s.hidden
        q_rows = s.heads // tp * hd  # per TP rank
        kv_rows = max(1, s.kv_heads // tp) * hd
        inter = s.intermediate // tp
        self.vocab("model.embed_tokens.weight", "model.embed_tokens.weight")
        for i in range(s.layers):
            p = f"model.layers.{i}"
            for kind in ("weight", "bias") if s.qkv_bias else ("weight",):
                tail = (hidden,) if kind == "weight" else ()
                locs = self.param(f"{p}.self_attn.qkv_proj.{kind}", (q_rows + 2 * kv_rows, *tail))
                self.rows(f"{p}.self_attn.q_proj.{kind}", (s.heads * hd, *tail), locs, 0)
                kv_shape = (s.kv_heads * hd, *tail)
                self.kv_rows(f"{p}.self_attn.k_proj.{kind}", kv_shape, locs, q_rows)
                self.kv_rows(f"{p}.self_attn.v_proj.{kind}", kv_shape, locs, q_rows + kv_rows)
            if s.qk_norm:  # one RMSNorm weight over head_dim, shared by every head
                for norm in ("q_norm", "k_norm"):
                    name = f"{p}.self_attn.{norm}.weight"
                    self.replicated(name, name, (hd,))
            o_shape = (hidden, s.heads * hd)
            locs = self.param(f"{p}.self_attn.o_proj.weight", (hidden, q_rows))
            self.columns(f"{p}.self_attn.o_proj.weight", o_shape, locs)
            if s.o_bias:
                name = f"{p}.self_attn.o_proj.bias"
                self.replicated(name, name, (hidden,))
            for kind in ("weight", "bias") if s.mlp_bias else ("weight",):
                tail = (hidden,) if kind == "weight" else ()
                locs = self.param(f"{p}.mlp.gate_up_proj.{kind}", (2 * inter, *tail))
                self.rows(f"{p}.mlp.gate_proj.{kind}", (s.intermediate, *tail), locs, 0)
                self.rows(f"{p}.mlp.up_proj.{kind}", (s.intermediate, *tail), locs, inter)
            locs = self.param(f"{p}.mlp.down_proj.weight", (hidden, inter))
            self.columns(f"{p}.mlp.down_proj.weight", (hidden, s.intermediate), locs)
            if s.mlp_bias:
                name = f"{p}.mlp.down_proj.bias"
                self.replicated(name, name, (hidden,))
            for norm in ("input_layernorm", "post_attention_layernorm"):
                name = f"{p}.{norm}.weight"
                self.replicated(name, name, (hidden,))
        self.replicated("model.norm.weight", "model.norm.weight", (hidden,))
        if not s.tied:
            self.vocab("lm_head.weight", "lm_head.weight")
        return TPLayout(
            layout=rs.Layout(self.tensors, self.storages),
            tp_size=tp,
            ranks=list(self.ranks),
            dtype=self.dtype,
            shapes=self.shapes,
            locations=self.locations,
            spec=self.s,
        )
