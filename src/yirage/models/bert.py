"""BERT-family encoders (BERT, MiniLM) as kernel graphs, and their sentence-transformers files.

The encoder is BERT's (Devlin et al. 2019, "BERT: Pre-training of Deep Bidirectional
Transformers"; transformers' ``modeling_bert.py`` is the reference we match): absolute position
embeddings, token types, post-LayerNorm blocks, GELU (erf) feed-forward. For ids [B, S]:

    x = LayerNorm(word[ids] + position[s] + token_type[0])
    per layer:  a = Attention(x W_qkv + b_qkv, key-padding mask) W_o + b_o
                x = LayerNorm(a + x);  x = LayerNorm(GELU(x W_i + b_i) W_o2 + b_o2 + x)

``build_encoder`` writes that as one kernel graph for B sentences packed into T token rows
(no padding inside; attention stays within each sentence); fusion makes each
``layer_norm(linear + residual)`` and each GELU one row kernel, Q, K and V one GEMM.
``read_sentence_transformer`` reads a sentence-transformers directory (Reimers & Gurevych 2019,
"Sentence-BERT"): modules.json, config.json, model.safetensors, 1_Pooling/config.json,
sentence_bert_config.json, an optional Normalize module.

This module builds graphs and reads files; it must never launch kernels or tokenize
(engines/embed.py does both).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ModelLoadError

#: config.json ``hidden_act`` -> the builder's GELU form
_ACTS = {"gelu": "none", "gelu_python": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}
#: sentence-transformers' pooling config keys, in the order its Pooling module concatenates them
POOLING_KEYS = (("pooling_mode_cls_token", "cls"), ("pooling_mode_max_tokens", "max"),
                ("pooling_mode_mean_tokens", "mean"), ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len_tokens"))


@dataclass(frozen=True)
class BertConfig:
    """The fields of a BertModel config.json that the encoder graph needs."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    gelu_approximate: str  # "none" (erf) or "tanh"

    @classmethod
    def from_json(cls, path: Path) -> "BertConfig":
        """Read ``config.json``. Raises ModelLoadError: unreadable, a model type other than
        BERT-family, a relative position embedding, an unknown activation or missing fields."""
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: cannot read the model config ({e})") from None
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"{path}: the model config must be a JSON object")
        mtype = cfg.get("model_type")
        if mtype not in ("bert",):
            raise ModelLoadError(f"{path}: model_type {mtype!r} is not supported by the embedding engine "
                                 "(supported: bert, i.e. BERT/MiniLM encoders)")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ModelLoadError(f"{path}: position_embedding_type {cfg['position_embedding_type']!r} is not "
                                 "supported (only 'absolute')")
        act = cfg.get("hidden_act", "gelu")
        if act not in _ACTS:
            raise ModelLoadError(f"{path}: hidden_act {act!r} is not supported (supported: {', '.join(_ACTS)})")
        try:
            c = cls(int(cfg["vocab_size"]), int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]),
                    int(cfg["num_attention_heads"]), int(cfg["intermediate_size"]),
                    int(cfg.get("max_position_embeddings", 512)), int(cfg.get("type_vocab_size", 2)),
                    float(cfg.get("layer_norm_eps", 1e-12)), _ACTS[act])
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{path}: bad or missing BERT config field ({e})") from None
        if c.hidden_size % c.num_heads or min(c.hidden_size, c.num_layers, c.num_heads, c.vocab_size) <= 0:
            raise ModelLoadError(f"{path}: hidden_size {c.hidden_size} must be a positive multiple of "
                                 f"num_attention_heads {c.num_heads}")
        return c


@dataclass(frozen=True)
class SentenceTransformerSpec:
    """What a sentence-transformers directory asks for around the encoder."""

    directory: Path
    config: BertConfig
    pooling: tuple[str, ...]       # modes, concatenated in this order
    normalize: bool                # a Normalize module follows the pooling
    max_seq_length: int
    embedding_dim: int


def read_sentence_transformer(directory: Path) -> SentenceTransformerSpec:
    """Read the module list, pooling config and sequence length of a sentence-transformers
    directory. Raises ModelLoadError: missing/invalid modules.json entries, a module other than
    Transformer/Pooling/Normalize, a missing or unsupported pooling config, a bad config.json."""
    directory = Path(directory)
    config = BertConfig.from_json(directory / "config.json")
    modules = _read_json(directory / "modules.json", default=None)
    if modules is None:  # a plain Hugging Face BERT directory: mean pooling, like sentence-transformers does
        raise ModelLoadError(f"{directory}: no modules.json; the embedding engine loads sentence-transformers "
                             "directories (modules.json, 1_Pooling/config.json, ...)")
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] if isinstance(m, dict) else "" for m in modules]
    unknown = [k for k in kinds if k not in ("Transformer", "Pooling", "Normalize")]
    if unknown or "Transformer" not in kinds:
        raise ModelLoadError(f"{directory}/modules.json: modules {kinds} are not supported (supported: "
                             "Transformer, Pooling, Normalize)")
    pool_dirs = [m.get("path", "") for m, k in zip(modules, kinds) if k == "Pooling"]
    if not pool_dirs:
        raise ModelLoadError(f"{directory}/modules.json: no Pooling module (the engine needs its pooling config)")
    pool_path = directory / pool_dirs[0] / "config.json"
    if not pool_path.is_file():
        raise ModelLoadError(f"{directory}: the pooling config {pool_dirs[0]}/config.json is missing")
    pool_cfg = _read_json(pool_path)
    modes = tuple(mode for key, mode in POOLING_KEYS if pool_cfg.get(key))
    others = [k for k in ("pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken") if pool_cfg.get(k)]
    if others or not modes:
        raise ModelLoadError(f"{pool_path}: pooling {others or 'none'} is not supported (supported: cls, max, "
                             "mean, mean_sqrt_len_tokens)")
    st_cfg = _read_json(directory / "sentence_bert_config.json", default={})
    max_len = st_cfg.get("max_seq_length") or config.max_position_embeddings
    max_len = min(int(max_len), config.max_position_embeddings)
    return SentenceTransformerSpec(directory, config, modes, "Normalize" in kinds, max_len,
                                   config.hidden_size * len(modes))


def _read_json(path: Path, default=...):
    if not path.is_file() and default is not ...:
        return default
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read it as JSON ({e})") from None


def load_bert_weights(directory: Path, config: BertConfig) -> dict[str, torch.Tensor]:
    """The encoder's weights from ``model.safetensors`` as contiguous float32 tensors, with Q, K
    and V of each layer packed into one ``l{i}.qkv.w`` [3H, H] / ``l{i}.qkv.b`` [3H].

    Raises ModelLoadError: no model.safetensors, a missing tensor or one of the wrong shape,
    or a tensor holding NaN or inf.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(directory) / "model.safetensors"
    try:
        raw = load_file(str(path))
    except (OSError, SafetensorError) as e:
        raise ModelLoadError(f"{path}: cannot read the weights ({e})") from None
    raw = {k.removeprefix("bert."): v for k, v in raw.items()}
    H, I = config.hidden_size, config.intermediate_size

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = raw.get(name)
        if t is None:
            raise ModelLoadError(f"{path}: tensor {name!r} is missing")
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"{path}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        t = t.float().contiguous()
        if not bool(torch.isfinite(t).all()):
            raise ModelLoadError(f"{path}: tensor {name!r} holds NaN or inf values")
        return t

    e = "embeddings."
    w = {"word": get(e + "word_embeddings.weight", (config.vocab_size, H)),
         "position": get(e + "position_embeddings.weight", (config.max_position_embeddings, H)),
         "token_type": get(e + "token_type_embeddings.weight", (config.type_vocab_size, H)),
         "emb_ln.w": get(e + "LayerNorm.weight", (H,)), "emb_ln.b": get(e + "LayerNorm.bias", (H,))}
    for i in range(config.num_layers):
        p = f"encoder.layer.{i}."
        qkv = [p + f"attention.self.{n}." for n in ("query", "key", "value")]
        w[f"l{i}.qkv.w"] = torch.cat([get(n + "weight", (H, H)) for n in qkv]).contiguous()
        w[f"l{i}.qkv.b"] = torch.cat([get(n + "bias", (H,)) for n in qkv]).contiguous()
        for key, name, shape_w in (("attn_out", "attention.output.dense", (H, H)), ("inter", "intermediate.dense", (I, H)),
                                   ("out", "output.dense", (H, I))):
            w[f"l{i}.{key}.w"] = get(p + name + ".weight", shape_w)
            w[f"l{i}.{key}.b"] = get(p + name + ".bias", (shape_w[0],))
        for key, name in (("attn_ln", "attention.output.LayerNorm"), ("out_ln", "output.LayerNorm")):
            w[f"l{i}.{key}.w"] = get(p + name + ".weight", (H,))
            w[f"l{i}.{key}.b"] = get(p + name + ".bias", (H,))
    return w


_LINEARS = ("qkv", "attn_out", "inter", "out")
_DTYPES = {torch.float32: "float32", torch.int8: "int8", torch.bfloat16: "bfloat16"}


def weight_order(config: BertConfig, int8: bool = False) -> list[str]:
    """The weight names in the order ``build_encoder`` declares them as graph inputs (with
    ``int8``, each linear's ``.w`` is replaced by ``.wq`` (int8 [K, N]) and ``.ws`` (scales [N]))."""
    names = ["word", "emb_ln.w", "emb_ln.b"]
    for i in range(config.num_layers):
        for k in ("qkv", "attn_out", "attn_ln", "inter", "out", "out_ln"):
            ws = ("wq", "ws", "b") if int8 and k in _LINEARS else ("w", "b")
            names += [f"l{i}.{k}.{x}" for x in ws]
    return names


def quantize_weights(weights: dict[str, torch.Tensor], config: BertConfig) -> dict[str, torch.Tensor]:
    """``weights`` plus the int8 form of every linear layer: ``.wq`` int8 [K, N] (transposed, the
    layout ``linear_w8a8`` reads) and ``.ws`` float32 [N], symmetric per output channel
    (scale = max|w[n, :]| / 127, round half to even)."""
    from ..ir.ops import quantize_rows_int8

    out = dict(weights)
    for i in range(config.num_layers):
        for k in _LINEARS:
            q, s = quantize_rows_int8(weights[f"l{i}.{k}.w"])
            out[f"l{i}.{k}.wq"] = q.t().contiguous()
            out[f"l{i}.{k}.ws"] = s.reshape(-1).contiguous()
    return out


def linear_weights_to(weights: dict[str, torch.Tensor], config: BertConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``weights`` with every linear layer's ``.w`` [N, K] converted to ``dtype`` (round to
    nearest even for bfloat16), the float32 copies dropped; biases, norms and embeddings kept."""
    out = dict(weights)
    for i in range(config.num_layers):
        for k in _LINEARS:
            out[f"l{i}.{k}.w"] = weights[f"l{i}.{k}.w"].to(dtype).contiguous()
    return out


#: int8 activations are quantized per token and per group of this many features (a multiple of 4
#: dividing the hidden and intermediate sizes; 0: the whole row). On all-MiniLM-L6-v2 whole-row
#: scales gave cosine 0.986 to float32 on the empty string (its LayerNorm outputs have outlier
#: channels that set the scale of the whole row); groups of 64: 0.994 (tests/engines/test_embed.py).
INT8_GROUP = 64


def int8_group(config: "BertConfig") -> int:
    """The activation group size ``build_encoder`` uses for ``config`` (INT8_GROUP when it
    divides both K of the linear layers, else whole rows)."""
    H, I = config.hidden_size, config.intermediate_size
    return INT8_GROUP if H % INT8_GROUP == 0 and I % INT8_GROUP == 0 else 0


def build_encoder(g, config: BertConfig, batch: int, tokens: int, weights: dict[str, torch.Tensor],
                  int8: bool = False):
    """Declare the encoder on kernel graph ``g`` for ``batch`` sentences packed back to back into
    ``tokens`` rows (no padding between sentences; rows past the last sentence are bucket padding).

    Graph inputs, in order: ids int64 [T] (token ids; padding rows any valid id), pos int64 [T]
    (each token's position in its sentence), offsets int64 [B + 1] (first row of each sentence,
    then the end; see ``attention_varlen``), pos_type float32 [max_pos, H] (position embeddings
    plus token type 0), then the weights in ``weight_order(config)`` (shapes as in ``weights``).
    Marks one output: the last hidden states float32 [T, H]. With ``int8``, every linear layer is
    ``linear_w8a8`` with activation groups of ``int8_group(config)`` features (``weights`` then
    holds ``quantize_weights``' int8 forms).
    """
    H, T = config.hidden_size, tokens
    ids = g.new_input((T,), dtype="int64", name="ids")
    pos = g.new_input((T,), dtype="int64", name="pos")
    offsets = g.new_input((batch + 1,), dtype="int64", name="offsets")
    pos_type = g.new_input((config.max_position_embeddings, H), name="pos_type")
    w = {n: g.new_input(tuple(weights[n].shape), dtype=_DTYPES[weights[n].dtype], name=n)
         for n in weight_order(config, int8)}
    eps = config.layer_norm_eps
    x = g.layer_norm(g.add(g.embedding(ids, w["word"]), g.embedding(pos, pos_type)), (H,), w["emb_ln.w"],
                     w["emb_ln.b"], eps)
    for i in range(config.num_layers):
        def p(k):
            return w[f"l{i}.{k}"]

        def linear(v, k):
            if int8 and k in _LINEARS:
                return g.linear_w8a8(v, p(k + ".wq"), p(k + ".ws"), p(k + ".b"), group_size=int8_group(config))
            return g.linear(v, p(k + ".w"), p(k + ".b"))
        a = g.attention_varlen(linear(x, "qkv"), offsets, config.num_heads)
        x = g.layer_norm(g.add(linear(a, "attn_out"), x), (H,), p("attn_ln.w"), p("attn_ln.b"), eps)
        f = g.gelu(linear(x, "inter"), approximate=config.gelu_approximate)
        x = g.layer_norm(g.add(linear(f, "out"), x), (H,), p("out_ln.w"), p("out_ln.b"), eps)
    g.mark_output(x)
    return x
