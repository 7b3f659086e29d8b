"""Structure of the Llama step graph: what fuses, how many launches, and that it serializes."""
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import yirage as yr
from yirage.backends import Backend
from yirage.models.llama import LlamaModel
from yirage.models.loading import load_model
from yirage.transforms.fusion import FusedKernel, schedule


def tiny_llama(tmp_path, tiny_tokenizer):
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    tiny_tokenizer(128).save_pretrained(tmp_path)
    return load_model(str(tmp_path), progress=False)


def test_decode_step_fuses_norms_residuals_and_swiglu(tmp_path, tiny_tokenizer):
    model = LlamaModel(tiny_llama(tmp_path, tiny_tokenizer), Backend.CPU, max_seq_length=32)
    g, _ = model.build_graph(1)
    steps = schedule(g)
    fused = [s for s in steps if isinstance(s, FusedKernel)]
    # per layer: [residual add +] RMSNorm * w before attention, residual add + RMSNorm * w
    # before the MLP, silu(gate) * up; plus the final residual add + RMSNorm * w
    assert len(fused) == 3 * 3 + 1
    ops_per_kernel = sorted({tuple(n.op for n in k.ops) for k in fused})
    assert ("add", "rms_norm", "mul") in ops_per_kernel and ("silu", "mul") in ops_per_kernel
    launches = g.compile("cpu").num_kernels
    assert launches == len(fused) + 3 * 10 + 1 + 2  # + per layer 7 GEMVs, 2 RoPE, attention; embedding; lm_head, argmax


def test_step_graph_json_round_trip_runs_identically(tmp_path, tiny_tokenizer):
    model = LlamaModel(tiny_llama(tmp_path, tiny_tokenizer), Backend.CPU, max_seq_length=32)
    g, tensors = model.build_graph(4)
    g2 = yr.KernelGraph.from_json(g.to_json())
    ids, start = torch.tensor([3, 9, 27, 81]), torch.tensor([0])
    caches = {id(t) for t in model.k_cache + model.v_cache}
    fresh = [t.clone() if id(t) in caches else t for t in tensors]
    a = g(inputs=[ids, start, *tensors])
    b = g2(inputs=[ids, start, *fresh])
    torch.testing.assert_close(a[0], b[0], atol=0, rtol=0)


def test_log_level_env_sets_the_logger():
    code = "import logging, yirage; print(logging.getLogger('yirage').level)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"YIRAGE_LOG_LEVEL": "DEBUG", "PATH": "/usr/bin:/bin",
                              **{k: v for k, v in __import__("os").environ.items() if k == "PYTHONPATH"}})
    assert out.stdout.strip() == str(10), out.stderr
