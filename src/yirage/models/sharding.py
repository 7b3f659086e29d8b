"""Tensor-parallel shards of a Llama-family decoder's weights (Megatron-LM's split, Shoeybi et al. 2019).

Each rank of ``world_size`` keeps

- column-parallel q/k/v projections: the output rows of its heads; its share of the KV heads,
  each with the q heads that read it (GQA groups stay whole on one rank); where there are fewer
  KV heads than ranks, ``world_size / num_kv_heads`` ranks share (replicate) a KV head and split
  its q heads;
- column-parallel gate/up projections: a contiguous run of the intermediate rows;
- row-parallel o/down projections: the input columns matching its heads / intermediate rows,
  their biases on rank 0 only (so that the sum over ranks adds them once);
- a vocab-parallel LM head: the rows ``vocab`` of ``lm_head.weight`` (or of the tied embedding
  table) as ``lm_head.shard.weight``, in whole groups of 16 rows where the vocabulary allows
  (the CPU's row-group layouts); the graphs place each rank's logits at its offset and sum them
  (an allgather of disjoint slices), so every rank has all the logits;
- a vocab-parallel embedding (Megatron's ``VocabParallelEmbedding``): the same rows ``vocab`` of
  ``model.embed_tokens.weight`` (for a tied table the very tensor the head reads); a token's row
  is looked up through ``vocab_lookup``'s tables (its local row, and a mask that is 0 for a token
  another rank holds), so each rank's embedding is the token's row or zeros, and the graphs sum
  them over the ranks (an allreduce: x + 0 is exact, so the sum equals one process's row);
- everything else (norms, biases of q/k/v) replicated.

The partial outputs of o and down are summed over the ranks by the graph's ``allreduce``
(``models/llama.py``). Block-quantized weights (GGUF: 32 or 256 values a block) are cut along
their input dim (o, down) only on block boundaries; a plan that would cut a block is refused
with the sizes. The shares are as even as whole KV heads and whole blocks allow: SmolLM2's 3 KV
heads on 2 ranks are 2 heads (6 q heads) and 1 head (3 q heads).

This module must never read files, build graphs or talk to other ranks; it slices tensors the
loader already mapped.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import DistributedError
from ..ir.ops import ROW_GROUP
from .loaded_model import ModelConfig, Weight


@dataclass(frozen=True)
class TensorParallelShard:
    """Rank ``rank`` of ``world_size``'s share: half-open ranges of the q heads, KV heads and
    intermediate rows (``ffn``) it keeps."""

    rank: int
    world_size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    ffn: tuple[int, int]
    vocab: tuple[int, int] = (0, 0)

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


def _even_split(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part ``index`` of ``n`` units in ``parts`` contiguous runs, the first
    ``n % parts`` one unit longer."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


def _block_of(weights: dict[str, Weight], pattern: str) -> int:
    """The largest quantization block (values) among the weights whose name matches ``pattern``;
    1 for float weights."""
    sizes = [w.dtype.block[0] for n, w in weights.items() if re.fullmatch(pattern, n) and w.dtype.is_quantized]
    return max(sizes, default=1)


def plan_shard(cfg: ModelConfig, weights: dict[str, Weight], rank: int, world_size: int) -> TensorParallelShard:
    """The share of rank ``rank`` of ``world_size`` (see the module docstring).

    Raises:
        DistributedError: ``world_size`` cannot split the model, the message giving the sizes: more
            ranks than KV heads without ``world_size`` a multiple of ``num_kv_heads`` and each
            KV group's q heads divisible by the ranks sharing it; a head split that would cut a
            quantization block of o_proj's input; fewer intermediate blocks than ranks.
    """
    hq, hkv, dh, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    group = hq // hkv
    W = world_size
    if hkv >= W:
        kv = _even_split(hkv, W, rank)
        q = (kv[0] * group, kv[1] * group)
    else:
        if W % hkv or group % (W // hkv):
            raise DistributedError(f"tensor_parallel_size {W} cannot split {hq} attention heads with {hkv} KV heads: "
                                 f"with fewer KV heads than ranks, the ranks must be a multiple of the KV heads "
                                 f"({hkv}) and each KV head's {group} q heads divisible by the ranks sharing it")
        share = W // hkv
        kv = (rank // share, rank // share + 1)
        per = group // share
        q = (rank * per, rank * per + per)
    o_block = _block_of(weights, r"model\.layers\.\d+\.self_attn\.o_proj\.weight")
    if (q[0] * dh) % o_block or (q[1] * dh) % o_block:
        raise DistributedError(f"tensor_parallel_size {W}: rank {rank}'s q heads {q[0]}..{q[1] - 1} are o_proj input "
                             f"columns {q[0] * dh}..{q[1] * dh - 1} (head_dim {dh}), which would cut its "
                             f"quantization blocks of {o_block} values")
    d_block = _block_of(weights, r"model\.layers\.\d+\.mlp\.down_proj\.weight")
    blocks = inter // d_block
    if blocks < W or inter % d_block:
        raise DistributedError(f"tensor_parallel_size {W} cannot split intermediate_size {inter} in down_proj's "
                             f"quantization blocks of {d_block} values ({blocks} blocks)")
    f = _even_split(blocks, W, rank)
    V = cfg.vocab_size
    unit = ROW_GROUP if V % ROW_GROUP == 0 and V // ROW_GROUP >= W else 1
    if V // unit < W:
        raise DistributedError(f"tensor_parallel_size {W} cannot split a vocabulary of {V} rows")
    v = _even_split(V // unit, W, rank)
    return TensorParallelShard(rank, W, q, kv, (f[0] * d_block, f[1] * d_block), (v[0] * unit, v[1] * unit))


def _rows(w: Weight, start: int, end: int) -> Weight:
    return Weight(w.data[start:end], w.dtype, (end - start, *w.shape[1:]))


def _cols(w: Weight, start: int, end: int) -> Weight:
    """Input columns [start, end) of a 2-D weight; on block boundaries when quantized (checked
    by ``plan_shard``)."""
    per, nbytes = w.dtype.block if w.dtype.is_quantized else (1, 1)
    data = w.data[:, start // per * nbytes:end // per * nbytes]
    return Weight(data.contiguous(), w.dtype, (w.shape[0], end - start))


_LAYER = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.(\w+)_proj\.(weight|bias)")


def vocab_lookup(shard: TensorParallelShard, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables of a vocab-parallel embedding lookup on rank ``shard.rank``: (rows int64
    [vocab_size]: token t's row in the rank's table, t - ``shard.vocab[0]`` for the tokens it
    holds and 0 for the others; mask float32 [vocab_size, 1]: 1.0 for the tokens it holds, 0.0
    for the others). The embedding of ids is ``table[rows[ids]] * mask[ids]``, summed over the
    ranks; 12 bytes a vocabulary entry (0.6 MB for SmolLM2's 49152)."""
    v0, v1 = shard.vocab
    rows = torch.zeros(vocab_size, dtype=torch.int64)
    rows[v0:v1] = torch.arange(v1 - v0, dtype=torch.int64)
    mask = torch.zeros(vocab_size, 1, dtype=torch.float32)
    mask[v0:v1] = 1.0
    return rows, mask


def shard_weights(weights: dict[str, Weight], cfg: ModelConfig, shard: TensorParallelShard) -> dict[str, Weight]:
    """The weights rank ``shard.rank`` keeps: row slices (views of the loader's tensors) of
    q/k/v/gate/up and their biases, column slices (copies) of o/down, o/down biases on rank 0
    only, the LM head's rows ``shard.vocab`` as ``lm_head.shard.weight`` (``lm_head.weight``
    itself dropped), the embedding table's rows ``shard.vocab`` as ``model.embed_tokens.weight``
    (a tied table's: the same view as the head's), every other weight as it is."""
    dh = cfg.head_dim
    rows = {"q": (shard.q_heads[0] * dh, shard.q_heads[1] * dh), "k": (shard.kv_heads[0] * dh, shard.kv_heads[1] * dh),
            "gate": shard.ffn, "up": shard.ffn}
    rows["v"] = rows["k"]
    cols = {"o": rows["q"], "down": shard.ffn}
    out: dict[str, Weight] = {}
    table = _rows(weights["model.embed_tokens.weight"], *shard.vocab)
    out["model.embed_tokens.weight"] = table
    out["lm_head.shard.weight"] = (_rows(weights["lm_head.weight"], *shard.vocab) if "lm_head.weight" in weights
                                   else table)
    for name, w in weights.items():
        if name in ("lm_head.weight", "model.embed_tokens.weight"):
            continue
        m = _LAYER.fullmatch(name)
        if m is None:
            out[name] = w
            continue
        proj, kind = m.group(2), m.group(3)
        if proj in rows:
            out[name] = _rows(w, *rows[proj])
        elif proj in cols and kind == "weight":
            out[name] = _cols(w, *cols[proj])
        elif proj in cols:   # a row-parallel bias: added once, by rank 0
            if shard.rank == 0:
                out[name] = w
        else:
            out[name] = w
    return out
