"""Small, valid seed models for the fuzzers, built deterministically at test time.

- ``build_gguf_seed(path)``: a GGUF file with the default model's (SmolLM2-135M-Instruct)
  metadata, chat template and tokenizer (its vocabulary cut to the first ``vocab`` tokens plus
  those the chat prompt for "hi" needs, and the merges among them), but tiny random weights: 2 layers, hidden 64, 4 heads (2 KV heads,
  head_dim 16), FFN 128. Tensor types follow the default model: Q8_0 token embedding, Q4_1
  projections, F32 norms, tied output. About 0.3 MB; it loads in a fraction of a second.
- ``build_hf_seed(directory)``: a tiny Llama saved by transformers as a sharded safetensors
  checkpoint (config.json, model.safetensors.index.json, shards, generation_config.json) with a
  word-level tokenizer (tokenizer.json, ...), like tests/engines/test_generate.py's tiny models.

Both are pure functions of their arguments (same bytes every time on one machine), so a mutant
is fully described by the seed parameters plus its mutation recipe (tests/fuzz/mutate.py).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

# the tiny architecture of both seeds
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS
GGUF_VOCAB = 512  # SmolLM2's first 512 tokens, plus those the chat prompt for "hi" needs (31 tokens)
HF_VOCAB = 300


def default_gguf_path() -> Path:
    from yirage.models.registry import resolve_model

    return resolve_model("smollm2-135m-instruct").path


def build_gguf_seed(path: str | os.PathLike, vocab: int = GGUF_VOCAB, source: str | os.PathLike | None = None,
                    seed: int = 0) -> Path:
    """Write the tiny GGUF seed to ``path`` (see the module doc) and return ``path``."""
    import gguf

    path = Path(path)
    src = gguf.GGUFReader(str(source or default_gguf_path()))
    arch = src.fields["general.architecture"].contents()
    all_tokens = src.fields["tokenizer.ggml.tokens"].contents()
    all_merges = src.fields["tokenizer.ggml.merges"].contents()
    keep_ids = _vocab_subset(all_tokens, all_merges, vocab)
    tokens = [all_tokens[i] for i in keep_ids]
    kept = set(tokens)
    merges = [m for m in all_merges if (lambda a, b: a in kept and b in kept and a + b in kept)(*m.split(" ", 1))]
    token_types = src.fields["tokenizer.ggml.token_type"].contents()
    overrides = {
        f"{arch}.block_count": LAYERS, f"{arch}.embedding_length": HIDDEN,
        f"{arch}.feed_forward_length": FFN, f"{arch}.attention.head_count": HEADS,
        f"{arch}.attention.head_count_kv": KV_HEADS, f"{arch}.vocab_size": len(tokens),
        f"{arch}.rope.dimension_count": HEAD_DIM, f"{arch}.context_length": 2048,
        "general.name": "yirage fuzz seed (tiny SmolLM2)",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [token_types[i] for i in keep_ids],
        "tokenizer.ggml.merges": merges,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = overrides.get(key, field.contents())
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)

    rng = np.random.default_rng(seed)
    Q = gguf.GGMLQuantizationType

    def add(name: str, shape: tuple[int, ...], qtype, std: float = 0.1):
        data = (rng.standard_normal(shape) * std).astype(np.float32)
        if len(shape) == 1:
            data = (1.0 + data).astype(np.float32)  # norm weights near 1
        if qtype == Q.F32:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    add("token_embd.weight", (len(tokens), HIDDEN), Q.Q8_0, std=1.0)
    for i in range(LAYERS):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (HIDDEN,), Q.F32)
        add(p + "ffn_down.weight", (HIDDEN, FFN), Q.Q4_1)
        add(p + "ffn_gate.weight", (FFN, HIDDEN), Q.Q4_1)
        add(p + "ffn_up.weight", (FFN, HIDDEN), Q.Q4_1)
        add(p + "ffn_norm.weight", (HIDDEN,), Q.F32)
        add(p + "attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN), Q.Q4_1)
        add(p + "attn_output.weight", (HIDDEN, HEADS * HEAD_DIM), Q.Q4_1)
        add(p + "attn_q.weight", (HEADS * HEAD_DIM, HIDDEN), Q.Q4_1)
        add(p + "attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN), Q.Q4_1)
    add("output_norm.weight", (HIDDEN,), Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# the GPT-2 byte-level spelling of the chat prompt for "hi" (SmolLM2's default system prompt)
_PROMPT_TOKENS = ["<|im_start|>", "system", "Ċ", "You", "Ġare", "Ġa", "Ġhelpful", "ĠAI", "Ġassistant",
                  "Ġnamed", "ĠSm", "ol", "LM", ",", "Ġtrained", "Ġby", "ĠH", "ugging", "ĠFace", "<|im_end|>",
                  "user", "hi", "ass", "istant"]


def _vocab_subset(tokens: list[str], merges: list[str], first: int) -> list[int]:
    """Ids (ascending) of the first ``first`` tokens plus every token the chat prompt needs and,
    recursively, both halves of every merge that produces one of them. Keeping merges in their
    original order, BPE then splits the prompt exactly as the full vocabulary does."""
    index = {t: i for i, t in enumerate(tokens)}
    producers: dict[str, list[tuple[str, str]]] = {}
    for m in merges:
        a, b = m.split(" ", 1)
        producers.setdefault(a + b, []).append((a, b))
    keep = set(range(min(first, len(tokens))))
    todo = [t for t in _PROMPT_TOKENS if t in index]
    while todo:
        t = todo.pop()
        if index[t] in keep:  # done already, or among the first ids (whose halves come earlier)
            continue
        keep.add(index[t])
        for a, b in producers.get(t, []):
            todo += [x for x in (a, b) if x in index and index[x] not in keep]
    return sorted(keep)


def _word_tokenizer(vocab_size: int):
    """tests/conftest.py's ``tiny_tokenizer``: word-level 'w0'..'w{n-1}', no network."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w1", bos_token="w2")


def build_hf_seed(directory: str | os.PathLike, seed: int = 0) -> Path:
    """Write the tiny sharded safetensors Llama (see the module doc) into ``directory``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(vocab_size=HF_VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
                      rms_norm_eps=1e-5, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():  # larger weights than the init's 0.02, so greedy tokens depend on them
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.5)
    finally:
        torch.random.set_rng_state(state)
    model.save_pretrained(str(directory), max_shard_size="200KB")
    _word_tokenizer(HF_VOCAB).save_pretrained(str(directory))
    return directory


def hf_files(directory: str | os.PathLike) -> dict[str, str]:
    """The seed directory's files: name -> kind ('config', 'index', 'tokenizer', 'shard', 'other')."""
    out = {}
    for p in sorted(Path(directory).iterdir()):
        if p.name == "config.json":
            out[p.name] = "config"
        elif p.name == "model.safetensors.index.json":
            out[p.name] = "index"
        elif p.name == "tokenizer.json":
            out[p.name] = "tokenizer"
        elif p.suffix == ".safetensors":
            out[p.name] = "shard"
        else:
            out[p.name] = "other"
    return out


if __name__ == "__main__":  # python tests/fuzz/seeds.py OUTDIR: write both seeds there
    import sys

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "fuzz-seeds")
    print(build_gguf_seed(out / "seed.gguf"))
    print(build_hf_seed(out / "seed-hf"))
    print(json.dumps(hf_files(out / "seed-hf"), indent=1))
