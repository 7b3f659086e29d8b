"""Read a decoder-only LLM (Llama, Qwen2, Mistral) from a GGUF file or a safetensors checkpoint.

``load_model(spec)`` resolves ``spec`` (``registry.resolve_model``) and returns a ``LoadedModel``:
a ``ModelConfig``, the weights as ``Weight`` records under their Hugging Face names, and the
tokenizer with its chat template (``tokenizer.Tokenizer``: the ``tokenizers`` library plus
transformers' settings, made from transformers' tokenizer and checked equal to it). Both formats
come out in the same layout:

- projections are ``[out_features, in_features]`` (``torch.nn.functional.linear`` convention);
- q/k projections are in Hugging Face order for ``rotate_half`` RoPE (llama.cpp's interleaving
  permutation of GGUF ``attn_q``/``attn_k`` rows is undone);
- GGUF block-quantized tensors (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ4_NL, IQ4_XS) stay as stored: raw
  block bytes mapped from the file in a ``uint8`` tensor of shape
  ``dtype.storage_shape(logical_shape)`` (see ``yirage.dtypes``); the kernels read them in place.
  F32/F16/BF16 stay as they are; other types (other IQ types, TQ*, ...) are refused. Safetensors float tensors keep their dtype.

The work is split into modules (this one only dispatches):

- ``loaded_model.py``: ``LoadedModel``, ``ModelConfig``, ``Weight``, and the ``ModelConfig`` built
  from a checked transformers config, RoPE frequencies from transformers' own init functions;
- ``checks.py``: the validation both formats share (hyper-parameters, tensor table, NaN/inf, tokenizer);
- ``gguf_file.py``: GGUF files (the bounds-checked reader, GGUF names and types, the q/k
  un-permutation, the tokenizer conversion, and the cache of what transformers derives from a
  file's metadata, so that a file seen before loads without importing transformers);
- ``safetensors_dir.py``: Hugging Face directories (config.json, safetensors shards, tokenizer files);
- ``tokenizer.py``: the ``Tokenizer`` both return (encode, decode, chat templates).

Validation: native kernels later index tables with sizes taken from the config, so a file is
checked completely before anything is built from it, in this order, and the first problem is one
``ModelLoadError`` naming the file, the field or tensor, the value and what was expected:

1. the container: GGUF header, metadata array lengths, tensor infos (known type, 1-4 positive
   dims, rows a whole number of blocks) and data layout (every tensor at the offset llama.cpp
   expects, inside the file, no overlap, no wraparound); GGUF strings valid UTF-8; the safetensors
   index (shards inside the model directory) and headers;
2. the hyper-parameters (layers, heads, KV heads, head dim, hidden, intermediate, vocab, context,
   sliding window, RMSNorm eps, RoPE theta/dims/scaling) for type and range, before transformers
   builds a config from them, and against the tensor table: the layer count must equal the blocks
   present, the vocab the embedding rows, every tensor the shape the config implies, each tensor
   a type its role allows;
3. the tokenizer: every token id it can produce and the special ids below the embedding rows;
4. the values: NaN/inf in float weights or in the fp16 block scales of Q8_0/Q4_1 tensors is
   refused unless ``allow_nonfinite=True`` (then a warning).

These modules only read files. They must never build compute graphs, run a model, pick a backend or
move tensors off the CPU (that is ``models/llama.py``'s and the runtime's work), never allocate
more than the file's own tensors and metadata justify (no loop or table sized by a header value
that the tensors present do not confirm), and never open a file outside the model's directory
that a model file names.
"""
from __future__ import annotations

# the public names of the model-reading modules stay importable from here
from .checks import SUPPORTED_ARCHS
from .gguf_file import _load_gguf, gguf_to_hf_name, reverse_llama_permute
from .loaded_model import LoadedModel, ModelConfig, Weight, rope_parameters
from .registry import resolve_model
from .safetensors_dir import _load_safetensors


__all__ = ["SUPPORTED_ARCHS", "LoadedModel", "ModelConfig", "Weight", "gguf_to_hf_name", "load_model",
           "reverse_llama_permute", "rope_parameters"]


def load_model(spec: str, progress: bool = True, allow_nonfinite: bool = False) -> LoadedModel:
    """Load the model named by ``spec``: a short name, a ``.gguf`` file, a Hugging Face directory or
    a hub id (see ``registry.resolve_model``). ``progress`` shows a bar on stderr while reading tensors.

    ``allow_nonfinite``: a weight holding NaN or inf (a float tensor's values, or the fp16 block
    scales of a Q8_0/Q4_1 tensor) is refused by default; True loads it anyway and logs a warning
    naming the tensors (the model will most likely produce NaN logits).

    Weight names: ``model.embed_tokens.weight``, ``model.layers.{i}.input_layernorm.weight``,
    ``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``model.layers.{i}.self_attn.{q,k,v}_proj.bias``
    (when ``config.attention_bias``), ``model.layers.{i}.post_attention_layernorm.weight``,
    ``model.layers.{i}.mlp.{gate,up,down}_proj.weight``, ``model.norm.weight`` and
    ``lm_head.weight`` (only when embeddings are not tied).

    Everything is validated before a tensor is used (see the module doc); nothing allocates more
    than the file's tensors justify.

    Raises ModelLoadError (one per problem, naming the file, the field or tensor, the value and
    the expectation): spec not found (see ``resolve_model``); not a valid/complete GGUF file
    (bad header, metadata running past the end, tensor data outside the file, overlapping or
    misplaced tensors, unknown tensor type, a string that is not UTF-8); unsupported
    architecture (the error lists the supported ones); a hyper-parameter of the wrong type, out of
    range (e.g. <= 0, NaN, inf) or inconsistent with another or with the tensors (layer count vs
    blocks present, vocab vs embedding rows, heads vs KV heads, head dim vs q_proj rows, ...);
    missing, unsupported or mis-shaped tensors; a tensor type its role does not allow (norms
    must be float; projections float or one of the block types above; other types (IQ2_XXS, ...) are
    refused); a broken ``model.safetensors.index.json`` or one naming a shard
    outside the model directory; a tokenizer that cannot be loaded or produces ids (or special
    ids) past the embedding rows; NaN/inf weights (unless ``allow_nonfinite``).
    """
    resolved = resolve_model(spec)
    if resolved.format == "gguf":
        model = _load_gguf(resolved.path, progress, allow_nonfinite)
    else:
        model = _load_safetensors(resolved.path, progress, allow_nonfinite)
    model.name = resolved.name
    return model
