"""``yr.PersistentKernel``: an LLM decode step as one compiled task graph (Mirage's MPK API).

Mirage's persistent kernel (MPK; Cheng et al. 2025, mirage-project/mirage
``python/mirage/mpk/persistent_kernel.py``) turns a whole decode step into one GPU kernel
whose tasks are scheduled by dependency events. yirage keeps its Python API and runs it on
every backend:

- CPU: the step's ops become tasks (GEMV row slices, attention (KV head, KV split) pairs,
  fused row kernels, ...) run by ``num_workers`` persistent threads that wait on per-op
  events instead of a fork/join per op (``runtime/task_graph.py``, scheduler in
  ``kernels/cpu/persistent.cpp``); ``mpk()`` runs the decode loop in C++ (Python is not
  called between tokens).
- GPU backends (cuda/rocm): the step's launches are captured once as a CUDA graph and
  replayed; ``mpk()`` loops in Python, one replay per token. (Not yet run on a GPU.)

Tensors: weights, KV caches and RoPE tables are attached with ``attach_input`` (the torch
tensors are used in place, never copied); ``new_tensor`` declares an activation that a
layer then writes (``output=``). Layers follow MPK's names and argument order; the
``grid_dim``/``block_dim`` arguments are accepted for MPK compatibility and checked, but on
the CPU the runtime sizes tasks itself (for its worker count). The decode state lives in
``meta_tensors = [step, tokens]``: ``step`` int64 [1] is the position of the token being
fed, ``tokens`` int64 [max_seq_length] (or [1, max_seq_length]) holds the prompt and
receives each new token at ``step + 1``.

Example (one Llama layer shown; see ``models/llama.py LlamaModel.decode_kernel``)::

    mpk = yr.PersistentKernel(max_seq_length=512, eos_token_id=2, meta_tensors=[step, tokens])
    x = mpk.attach_input(tokens, "tokens")
    h = mpk.new_tensor((1, H), yr.float32, "h0")
    mpk.embed_layer(x, mpk.attach_input(w_embed, "embed"), h)
    qkv = mpk.new_tensor((1, (Hq + 2 * Hkv) * Dh), yr.float32, "qkv")
    mpk.rmsnorm_linear_layer(h, mpk.attach_input(w_norm, "norm"), mpk.attach_input(w_qkv, "w_qkv"), qkv)
    ...
    mpk.argmax_reduce_layer(partial, next_token)
    mpk.compile()
    tokens[0, :n] = prompt; step.fill_(0)
    new = mpk(prompt_length=n)          # decode until EOS or max_seq_length
"""
from __future__ import annotations

import json
import math
import numbers
import os
from typing import Sequence

import torch

from .backends import Backend, get_backend_impl, resolve_backend
from .dtypes import DType, as_dtype
from .errors import GraphError
from .ir.graph import DTensor
from .kernel import KNGraph
from .runtime import distributed
from .runtime.task_graph import PROFILE_FIELDS, TaskGraphPlan, compiled_task_graph, default_num_workers, get_pool


class _Pending:
    """A tensor declared by ``new_tensor`` that no layer has written yet."""

    def __init__(self, dims: tuple[int, ...], dtype: DType, name: str):
        self.dims, self.dtype, self.name = dims, dtype, name
        self.value: DTensor | tuple | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.dims

    def __repr__(self) -> str:
        return f"PersistentKernel tensor {self.name!r} {self.dims} {self.dtype.value}"


def _dims3(name: str, value) -> None:
    if value is None:
        return
    if (not isinstance(value, (tuple, list)) or not 1 <= len(value) <= 3
            or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v > 0 for v in value)):
        raise GraphError(f"{name} must be a tuple of 1-3 positive integers, got {value!r}")


class PersistentKernel:
    """A decode step compiled as one persistent task graph (Mirage's ``PersistentKernel``).

    Args:
        world_size: the ranks of a tensor-parallel step (default 1: one process). With
            world_size > 1 the ranks' group is ``runtime.distributed.active()``, else the one
            torchrun describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``:
            joined here); its size and rank must be ``world_size`` and ``mpi_rank``.
            ``allreduce_layer`` sums over it (a host step between task segments on the CPU).
        mpi_rank: this process's rank, in [0, world_size) (mpi4py is not read yet).
        num_workers: worker threads on the CPU, the caller included; default: the cores this
            process may use (``os.sched_getaffinity``).
        num_local_schedulers: 1 or None: the CPU runtime has one scheduler (a shared task
            queue handing tasks out in dependency order).
        num_remote_schedulers: 0 (GraphError otherwise).
        max_seq_length: KV cache length in tokens; ``mpk()`` stops when ``tokens`` is full.
        eos_token_id: an int, a list of ints, or None: ``mpk()`` stops after producing one.
        meta_tensors: ``[step, tokens]``: step int64 [1] CPU, tokens int64 [max_seq_length]
            or [1, max_seq_length], both contiguous; updated in place by ``mpk()``.
        profiler_tensor: None, or int64 [capacity, 6] (CPU): each task's
            (worker, step, task, start_ns, end_ns, op) until full; ``write_trace`` turns it
            into a Chrome/Perfetto trace.
        spec_decode_config: None (speculative decoding is not supported yet).
        backend: a backend name or None (``yr.get_backend()``).
        adaptive_workers: let the CPU pool time fewer workers now and then and keep the
            fastest width (off by default: workers redo or take over the tasks of a
            preempted worker, so a core taken by another process no longer stalls a step;
            see kernels/cpu/persistent.cpp).

    Raises GraphError for any argument outside these ranges; BackendUnavailableError for an
    unavailable backend.
    """

    def __init__(self, world_size: int = 1, mpi_rank: int = 0, num_workers: int | None = None,
                 num_local_schedulers: int | None = None, num_remote_schedulers: int = 0,
                 max_seq_length: int | None = None, eos_token_id=None, meta_tensors=None,
                 profiler_tensor: torch.Tensor | None = None, spec_decode_config=None, backend=None,
                 adaptive_workers: bool = False):
        self.group = _rank_group(world_size, mpi_rank)
        self.world_size, self.mpi_rank = world_size, mpi_rank
        if num_remote_schedulers != 0:
            raise GraphError(f"num_remote_schedulers={num_remote_schedulers!r}: remote schedulers need several "
                             "devices, which are not supported yet; pass 0")
        if num_local_schedulers not in (None, 1):
            raise GraphError(f"num_local_schedulers={num_local_schedulers!r}: the CPU runtime has one scheduler "
                             "(a shared task queue); pass 1 or leave it out")
        if spec_decode_config is not None:
            raise GraphError("spec_decode_config: speculative decoding is not supported yet; pass None")
        if num_workers is not None and (isinstance(num_workers, bool) or not isinstance(num_workers, numbers.Integral)
                                        or not 1 <= num_workers <= 1024):
            raise GraphError(f"num_workers must be an integer in 1..1024 or None, got {num_workers!r}")
        if (isinstance(max_seq_length, bool) or not isinstance(max_seq_length, numbers.Integral)
                or max_seq_length <= 0):
            raise GraphError(f"max_seq_length must be a positive integer, got {max_seq_length!r}")
        self.max_seq_length = int(max_seq_length)
        eos = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, numbers.Integral)
                                               else list(eos_token_id))
        if not all(isinstance(e, numbers.Integral) and not isinstance(e, bool) for e in eos):
            raise GraphError(f"eos_token_id must be an int, a list of ints or None, got {eos_token_id!r}")
        self.eos_token_ids = [int(e) for e in eos]
        self.step, self.tokens = self._check_meta(meta_tensors)
        self.backend = resolve_backend(backend)
        self.impl = get_backend_impl(self.backend)
        self.num_workers = int(num_workers) if num_workers is not None else default_num_workers()
        self.adaptive_workers = bool(adaptive_workers)
        self.profiler_tensor = profiler_tensor
        self.kn_graph = KNGraph(self.backend.value)
        self._ids_t = torch.zeros(1, dtype=torch.int64, device=self.impl.torch_device)
        self._ids = self.kn_graph.new_input((1,), DType.int64, "input_token")
        self._step_t = (self.step if self.step is not None
                        else torch.zeros(1, dtype=torch.int64, device=self.impl.torch_device))
        self._pos = self.kn_graph.new_input((1,), DType.int64, "step")
        self._attached: list[torch.Tensor] = [self._ids_t, self._step_t]
        self._by_tensor: dict[int, DTensor] = {}
        self._names: set[str] = set()
        self._token_out: DTensor | None = None
        self._outputs: list[DTensor] = []
        self._plan = None

    # ---- tensors --------------------------------------------------------------------------
    def _check_meta(self, meta):
        if meta is None:
            return None, None
        if not isinstance(meta, (list, tuple)) or len(meta) != 2 or not all(isinstance(t, torch.Tensor) for t in meta):
            raise GraphError("meta_tensors must be [step, tokens]: two torch tensors")
        step, tokens = meta
        if step.dtype != torch.int64 or step.numel() != 1 or not step.is_contiguous() or step.device.type != "cpu":
            raise GraphError(f"meta_tensors[0] (step) must be a contiguous int64 CPU tensor of one element, got "
                             f"{tuple(step.shape)} {step.dtype} on {step.device}")
        if (tokens.dtype != torch.int64 or tokens.numel() != self.max_seq_length or not tokens.is_contiguous()
                or tokens.device.type != "cpu" or tokens.dim() not in (1, 2)):
            raise GraphError(f"meta_tensors[1] (tokens) must be a contiguous int64 CPU tensor [max_seq_length] or "
                             f"[1, max_seq_length] = [{self.max_seq_length}], got {tuple(tokens.shape)} {tokens.dtype}")
        return step.view(1), tokens.view(-1)

    def _name(self, name) -> str:
        if not isinstance(name, str) or not name:
            raise GraphError(f"a tensor needs a non-empty string name, got {name!r}")
        if name in self._names:
            raise GraphError(f"a tensor named {name!r} already exists in this PersistentKernel")
        self._names.add(name)
        return name

    def attach_input(self, torch_tensor: torch.Tensor, name: str | None = None, dtype=None) -> DTensor:
        """Use ``torch_tensor`` (row-major contiguous, on the backend's device) in place as an
        input of the step, under ``name``. ``dtype``: a block-quantized type (``yr.q8_0``,
        ``yr.q4_1``, ``yr.q4_0``, ``yr.q5_0``, ``yr.q5_1``, ``yr.q2_k`` .. ``yr.q6_k``, ``yr.iq4_nl``, ``yr.iq4_xs``; see
        ``yirage.dtypes``) for a weight given as its raw uint8 blocks
        [N, K/weights_per_block*bytes_per_block] (the logical shape is then [N, K]); otherwise
        the tensor's own dtype.

        Returns the tensor's handle. Attaching ``meta_tensors[1]`` (tokens) gives the handle
        ``embed_layer`` reads the current token from. Raises GraphError for a non-contiguous
        tensor, a tensor on another device, a repeated name or a bad dtype.
        """
        if not isinstance(torch_tensor, torch.Tensor):
            raise GraphError(f"attach_input needs a torch tensor, got {type(torch_tensor).__name__}")
        name = self._name(name)
        if not torch_tensor.is_contiguous():
            raise GraphError(f"attach_input({name!r}): the tensor must be row-major contiguous")
        if torch_tensor.device.type != self.impl.torch_device.type:
            raise GraphError(f"attach_input({name!r}): the tensor is on {torch_tensor.device}, the backend "
                             f"'{self.backend.value}' runs on {self.impl.torch_device.type}")
        if self.tokens is not None and torch_tensor.data_ptr() == self.tokens.data_ptr():
            return self._ids  # the token stream: embed_layer reads tokens[step] through input_token
        if dtype is not None:
            dt = as_dtype(dtype)
            if not dt.is_quantized or torch_tensor.dtype != torch.uint8 or torch_tensor.dim() != 2:
                raise GraphError(f"attach_input({name!r}, dtype={dtype!r}): dtype is for block-quantized weights "
                                 "given as a 2-D uint8 tensor of blocks")
            per, nbytes = dt.block
            blocks, rem = divmod(torch_tensor.shape[1], nbytes)
            if rem:
                raise GraphError(f"attach_input({name!r}): {torch_tensor.shape[1]} bytes per row is not a whole "
                                 f"number of {dt.value} blocks ({nbytes} bytes)")
            shape = (torch_tensor.shape[0], blocks * per)
        else:
            dt, shape = as_dtype(torch_tensor.dtype), tuple(torch_tensor.shape)
        t = self.kn_graph.new_input(shape, dt, name)
        self._attached.append(torch_tensor)
        return t

    def new_tensor(self, dims: Sequence[int], dtype=DType.float32, name: str | None = None,
                   io_category: str = "cpu_tensor", strides=None) -> _Pending:
        """Declare an activation of shape ``dims`` that a layer will write (``output=``).

        ``io_category``: 'cpu_tensor' or 'cuda_tensor' (memory of this device: yirage
        allocates it); 'nvshmem_tensor' needs several devices and raises GraphError.
        ``strides``, if given, must be row-major."""
        name = self._name(name)
        if io_category == "nvshmem_tensor":
            raise GraphError(f"new_tensor({name!r}): nvshmem tensors need several devices (not supported yet)")
        if io_category not in ("cpu_tensor", "cuda_tensor"):
            raise GraphError(f"new_tensor({name!r}): io_category must be 'cpu_tensor' or 'cuda_tensor', "
                             f"got {io_category!r}")
        dims = tuple(dims)
        if not dims or not all(isinstance(d, numbers.Integral) and not isinstance(d, bool) and d > 0 for d in dims):
            raise GraphError(f"new_tensor({name!r}): dims must be positive integers, got {dims!r}")
        if strides is not None and tuple(strides) != tuple(math.prod(dims[i + 1:]) for i in range(len(dims))):
            raise GraphError(f"new_tensor({name!r}): only row-major strides are supported, got {strides!r}")
        return _Pending(dims, as_dtype(dtype), name)

    def _read(self, t, what: str):
        if isinstance(t, _Pending):
            if t.value is None:
                raise GraphError(f"{what}: {t} is read before any layer wrote it")
            return t.value
        if isinstance(t, DTensor):
            return t
        raise GraphError(f"{what}: expected a tensor handle from attach_input/new_tensor, got {type(t).__name__}")

    def _write(self, out, value: DTensor, what: str) -> DTensor:
        if out is None:
            return value
        if not isinstance(out, _Pending):
            raise GraphError(f"{what}: output must be a tensor from new_tensor, got {type(out).__name__}")
        if out.value is not None:
            raise GraphError(f"{what}: {out} was already written by another layer")
        if out.dtype != value.dtype and out.dtype.is_float and value.dtype.is_float:
            value = self.kn_graph.cast(value, out.dtype)  # a layer writes its output in the output's dtype
        if math.prod(out.dims) != math.prod(value.shape) or out.dtype != value.dtype:
            raise GraphError(f"{what}: output {out} does not fit the layer's result {tuple(value.shape)} "
                             f"{value.dtype.value}")
        out.value = value if tuple(value.shape) == out.dims else self.kn_graph.reshape(value, out.dims)
        return out.value

    @property
    def input_token(self) -> DTensor:
        """Handle of the current token id (int64 [1]): ``tokens[step]`` in the decode loop, the
        ``token`` argument of ``run_step``. ``embed_layer`` reads it."""
        return self._ids

    def _rows(self, x: DTensor) -> DTensor:
        """x as [1, n] (a decode step works on one token)."""
        if x.shape[0] != 1 and len(x.shape) != 1:
            raise GraphError(f"the persistent kernel decodes one token per step: expected [1, n], got {x.shape}")
        return x if len(x.shape) == 2 else self.kn_graph.reshape(x, (1, x.shape[0]))

    # ---- layers (MPK names) -------------------------------------------------------------
    def embed_layer(self, input, weight, output, grid_dim=None, block_dim=None, input_source: int = 0,
                    scale: float | None = None, vocab_rows=None, vocab_mask=None):
        """output [1, H] = row ``tokens[step]`` of weight [V, H] (float32 or a block-quantized
        type, decoded to float32), times ``scale`` when given (Gemma 3: sqrt(H), in the output's
        dtype). ``input`` is the handle of the attached tokens tensor (or an attached int64 [1]
        tensor of token ids); ``input_source`` must be 0.

        A vocab-parallel embedding (``world_size > 1``; Megatron's ``VocabParallelEmbedding``):
        ``weight`` [n, H] holds this rank's n rows of the vocabulary, ``vocab_rows`` (int64
        [V]: each token's row in ``weight``) and ``vocab_mask`` (float32 [V, 1]: 1 for the tokens
        this rank holds, 0 for the others) are attached handles; the output is then
        ``weight[vocab_rows[t]] * vocab_mask[t]``, zeros for a token another rank holds, and the
        caller sums it over the ranks (``allreduce_layer``). GraphError when only one of the two
        is given or their shapes or dtypes differ from these."""
        _dims3("grid_dim", grid_dim), _dims3("block_dim", block_dim)
        if input_source != 0:
            raise GraphError("embed_layer: input_source must be 0 (the token at the current step)")
        ids = self._read(input, "embed_layer input")
        if ids.dtype != DType.int64:
            raise GraphError(f"embed_layer: input must be int64 token ids, got {ids.dtype.value}")
        g = self.kn_graph
        ids = g.reshape(ids, (1,)) if ids.shape != (1,) else ids
        table = self._read(weight, "embed_layer weight")
        if (vocab_rows is None) != (vocab_mask is None):
            raise GraphError("embed_layer: vocab_rows and vocab_mask come together (a vocab-parallel embedding)")
        if vocab_rows is None:
            h = g.embedding(ids, table)
        else:
            rows = self._read(vocab_rows, "embed_layer vocab_rows")
            mask = self._read(vocab_mask, "embed_layer vocab_mask")
            if (rows.dtype != DType.int64 or len(rows.shape) != 1 or mask.dtype != DType.float32
                    or tuple(mask.shape) != (rows.shape[0], 1)):
                raise GraphError(f"embed_layer: vocab_rows must be int64 [V] and vocab_mask float32 [V, 1], got "
                                 f"{rows.dtype.value} {tuple(rows.shape)} and {mask.dtype.value} {tuple(mask.shape)}")
            h = g.embedding(g.index_select(rows, 0, ids), table)
            m = g.embedding(ids, mask)
            h = g.mul(h, m if m.dtype == h.dtype else g.cast(m, h.dtype))
        if scale is not None:
            if isinstance(output, _Pending) and output.dtype != h.dtype and output.dtype.is_float:
                h = self.kn_graph.cast(h, output.dtype)  # scaled in the output's dtype, as transformers does
            h = self.kn_graph.scale(h, scale)
        return self._write(output, h, "embed_layer")

    def rmsnorm_layer(self, input, weight, output, grid_dim=None, block_dim=None, eps: float = 1e-6):
        """output = RMSNorm(input) * weight (Zhang & Sennrich 2019), over the last dim."""
        _dims3("grid_dim", grid_dim), _dims3("block_dim", block_dim)
        x = self._rows(self._read(input, "rmsnorm_layer input"))
        n = self.kn_graph.mul(self.kn_graph.rms_norm(x, (x.shape[-1],), eps), self._read(weight, "rmsnorm weight"))
        return self._write(output, n, "rmsnorm_layer")

    def linear_layer(self, input, weight, output, grid_dim=None, block_dim=None, bias=None):
        """output [1, N] = input [1, K] @ weight[N, K]^T (+ bias)."""
        _dims3("grid_dim", grid_dim), _dims3("block_dim", block_dim)
        x = self._rows(self._read(input, "linear_layer input"))
        b = self._read(bias, "linear bias") if bias is not None else None
        return self._write(output, self.kn_graph.linear(x, self._read(weight, "linear weight"), b), "linear_layer")

    def rmsnorm_linear_layer(self, input, weight_norm, weight_linear, output, grid_dim=None, block_dim=None,
                             eps: float = 1e-6, bias=None):
        """output = linear(RMSNorm(input) * weight_norm, weight_linear) (+ bias).

        ``weight_linear`` may also be a list of weights sharing the normalized input (e.g.
        separate q, k and v projections); ``output`` (and ``bias``) are then lists of the same
        length, one result each. Returns the output handle(s)."""
        _dims3("grid_dim", grid_dim), _dims3("block_dim", block_dim)
        x = self._rows(self._read(input, "rmsnorm_linear_layer input"))
        g = self.kn_graph
        n = g.mul(g.rms_norm(x, (x.shape[-1],), eps), self._read(weight_norm, "rmsnorm_linear weight_norm"))
        if isinstance(weight_linear, (list, tuple)):
            outs = output if isinstance(output, (list, tuple)) else None
            biases = bias if bias is not None else [None] * len(weight_linear)
            if outs is None or len(outs) != len(weight_linear) or len(biases) != len(weight_linear):
                raise GraphError("rmsnorm_linear_layer: a list of weights needs a list of outputs (and biases) "
                                 "of the same length")
            return [self._write(o, g.linear(n, self._read(w, "linear weight"),
                                            self._read(b, "bias") if b is not None else None), "rmsnorm_linear_layer")
                    for w, b, o in zip(weight_linear, biases, outs)]
        b = self._read(bias, "bias") if bias is not None else None
        return self._write(output, g.linear(n, self._read(weight_linear, "linear weight"), b), "rmsnorm_linear_layer")

    def attention_layer(self, input, k_cache, v_cache, q_norm, k_norm, cos_pos_embed, sin_pos_embed, output,
                        grid_dim=None, block_dim=None, scale: float | None = None, eps: float = 1e-6,
                        window: int | None = None):
        """Causal GQA attention of the current token over the KV cache, with RoPE.

        input: the q, k, v projections, either fused [1, (Hq + 2 Hkv) Dh] (MPK's layout) or a
        tuple (q [1, Hq Dh], k [1, Hkv Dh], v [1, Hkv Dh]); k_cache, v_cache: [S, Hkv, Dh] or
        [1, S, Hkv, Dh] (written at row ``step``); q_norm, k_norm: per-head RMSNorm weights
        [Dh] (Qwen3) or None; cos/sin_pos_embed: [S, Dh] (Hugging Face rotate-half tables) or
        [S, Dh/2], or None for no RoPE; output [1, Hq Dh]. ``scale`` defaults to Dh^-0.5.
        ``window``: None or 0 attends every position 0 .. step; ``W >= 1`` a sliding window, the
        positions ``step - W < j <= step`` (transformers' sliding-window causal mask; see
        ``KernelGraph.attention``); on the CPU the flash-decoding tasks then split and read only
        those W positions. GraphError for a non-integer or negative window."""
        _dims3("grid_dim", grid_dim), _dims3("block_dim", block_dim)
        g = self.kn_graph
        kc, vc = self._read(k_cache, "k_cache"), self._read(v_cache, "v_cache")
        if len(kc.shape) == 4:
            kc, vc = g.reshape(kc, kc.shape[1:]), g.reshape(vc, vc.shape[1:])
        if len(kc.shape) != 3:
            raise GraphError(f"attention_layer: k_cache must be [S, Hkv, Dh] or [1, S, Hkv, Dh], got {kc.shape}")
        S, Hkv, Dh = kc.shape
        Hq = math.prod(self._read(output, "attention output").shape if isinstance(output, DTensor)
                       else output.dims) // Dh if output is not None else None
        if isinstance(input, (tuple, list)):
            q, k, v = (self._rows(self._read(t, "attention input")) for t in input)
            Hq = q.shape[-1] // Dh
        else:
            x = self._rows(self._read(input, "attention input"))
            if Hq is None:
                raise GraphError("attention_layer: a fused qkv input needs an output to tell the q heads")
            if x.shape[-1] != (Hq + 2 * Hkv) * Dh:
                raise GraphError(f"attention_layer: fused qkv input has {x.shape[-1]} columns, expected "
                                 f"(Hq + 2 Hkv) Dh = {(Hq + 2 * Hkv) * Dh}")
            heads = g.reshape(x, (Hq + 2 * Hkv, Dh))
            q, k, v = (g.slice_rows(heads, a, b) for a, b in ((0, Hq), (Hq, Hq + Hkv), (Hq + Hkv, Hq + 2 * Hkv)))
        q, k, v = g.reshape(q, (1, Hq, Dh)), g.reshape(k, (1, Hkv, Dh)), g.reshape(v, (1, Hkv, Dh))
        if (q_norm is None) != (k_norm is None):
            raise GraphError("attention_layer: give both q_norm and k_norm, or neither")
        if q_norm is not None:
            q = g.mul(g.rms_norm(q, (Dh,), eps), self._read(q_norm, "q_norm"))
            k = g.mul(g.rms_norm(k, (Dh,), eps), self._read(k_norm, "k_norm"))
        if (cos_pos_embed is None) != (sin_pos_embed is None):
            raise GraphError("attention_layer: give both cos_pos_embed and sin_pos_embed, or neither")
        if cos_pos_embed is not None:
            cos, sin = self._rope_table(cos_pos_embed, Dh), self._rope_table(sin_pos_embed, Dh)
            q, k = g.rope(q, cos, sin, self._pos), g.rope(k, cos, sin, self._pos)
        a = g.attention(q, k, v, kc, vc, self._pos, scale, window=window)
        return self._write(output, g.reshape(a, (1, Hq * Dh)), "attention_layer")

    def _rope_table(self, t, Dh: int) -> DTensor:
        table = self._read(t, "rope table")
        if len(table.shape) != 2 or table.shape[1] not in (Dh, Dh // 2):
            raise GraphError(f"attention_layer: RoPE tables must be [S, Dh] or [S, Dh/2] (Dh = {Dh}), got {table.shape}")
        if table.shape[1] == Dh:  # the Hugging Face table repeats its first half: keep that half
            src = self._attached[self.kn_graph.inputs.index(table.id)]
            half = src[:, : Dh // 2].contiguous()
            self._attached.append(half)
            return self.kn_graph.new_input(tuple(half.shape), as_dtype(half.dtype), None)
        return table

    def _with_residual(self, y: DTensor, residual, post_norm, eps: float, what: str) -> DTensor:
        """residual + y, or residual + RMSNorm(y) * post_norm (one fused row kernel either way)."""
        g = self.kn_graph
        if post_norm is not None:
            y = g.mul(g.rms_norm(y, (y.shape[-1],), eps), self._read(post_norm, f"{what} post_norm"))
        return g.add(self._rows(self._read(residual, "residual")), y)

    def linear_with_residual_layer(self, input, weight, residual, output, grid_dim=None, block_dim=None,
                                   post_norm=None, eps: float = 1e-6):
        """output = residual + input @ weight^T; with ``post_norm`` (a weight [N]), output =
        residual + RMSNorm(input @ weight^T) * post_norm (Gemma 3's post-attention norm, applied
        before the residual add; RMSNorm with ``eps``)."""
        _dims3("grid_dim", grid_dim), _dims3("block_dim", block_dim)
        y = self.kn_graph.linear(self._rows(self._read(input, "input")), self._read(weight, "weight"))
        return self._write(output, self._with_residual(y, residual, post_norm, eps, "linear_with_residual_layer"),
                           "linear_with_residual_layer")

    def _gated_mlp_with_residual(self, activation: str, input, weight, residual, output, post_norm, eps: float,
                                 what: str):
        g = self.kn_graph
        if isinstance(input, (tuple, list)):
            gate, up = (self._rows(self._read(t, "input")) for t in input)
        else:
            x = self._rows(self._read(input, "input"))
            inter = x.shape[-1] // 2
            halves = g.reshape(x, (2, inter))
            gate, up = (g.reshape(g.slice_rows(halves, i, i + 1), (1, inter)) for i in (0, 1))
        act = g.silu(gate) if activation == "silu" else g.gelu_tanh(gate)
        y = g.linear(g.mul(act, up), self._read(weight, "weight"))
        return self._write(output, self._with_residual(y, residual, post_norm, eps, what), what)

    def silu_mul_linear_with_residual_layer(self, input, weight, residual, output, grid_dim=None, block_dim=None,
                                            post_norm=None, eps: float = 1e-6):
        """output = residual + (SiLU(gate) * up) @ weight^T (SwiGLU, Shazeer 2020); input is
        [1, 2I] (gate then up, MPK's layout) or a tuple (gate [1, I], up [1, I]). ``post_norm``
        (a weight [N]): RMSNorm (``eps``) times it on the MLP output before the residual add."""
        _dims3("grid_dim", grid_dim), _dims3("block_dim", block_dim)
        return self._gated_mlp_with_residual("silu", input, weight, residual, output, post_norm, eps,
                                             "silu_mul_linear_with_residual_layer")

    def gelu_mul_linear_with_residual_layer(self, input, weight, residual, output, grid_dim=None, block_dim=None,
                                            post_norm=None, eps: float = 1e-6):
        """output = residual + (GELU_tanh(gate) * up) @ weight^T, GELU with the tanh approximation
        (``KernelGraph.gelu_tanh``; GeGLU, Shazeer 2020; Gemma 3's MLP, transformers'
        ``gelu_pytorch_tanh``); input as ``silu_mul_linear_with_residual_layer``'s. ``post_norm``
        (a weight [N]): output = residual + RMSNorm(MLP output) * post_norm (Gemma 3's
        post-feedforward norm, before the residual add; RMSNorm with ``eps``)."""
        _dims3("grid_dim", grid_dim), _dims3("block_dim", block_dim)
        return self._gated_mlp_with_residual("gelu_tanh", input, weight, residual, output, post_norm, eps,
                                             "gelu_mul_linear_with_residual_layer")

    def allreduce_layer(self, input, buffer, output, grid_dim=None, block_dim=None):
        """output [1, N] = the sum of input [1, N] over the ranks (``world_size``; the identity on
        one process): after a row-parallel linear, as Mirage's ``allreduce_layer``. ``buffer`` is
        accepted for Mirage's signature (None, or a tensor from ``new_tensor``); the transport
        (gloo or shared memory, ``runtime.distributed``) keeps its own."""
        _dims3("grid_dim", grid_dim), _dims3("block_dim", block_dim)
        if buffer is not None and not isinstance(buffer, (_Pending, DTensor)):
            raise GraphError(f"allreduce_layer: buffer must be None or a tensor handle, got {type(buffer).__name__}")
        x = self._rows(self._read(input, "allreduce_layer input"))
        return self._write(output, self.kn_graph.allreduce(x), "allreduce_layer")

    def allgather_layer(self, input, output, offset: int, grid_dim=None, block_dim=None):
        """output [1, N] = every rank's input [1, n_r] placed at its ``offset`` (this rank's),
        zeros elsewhere, summed over the ranks: the gather of disjoint slices (a vocab-parallel
        LM head's logits) as a pad and an allreduce. GraphError when input does not fit output at
        ``offset``."""
        _dims3("grid_dim", grid_dim), _dims3("block_dim", block_dim)
        x = self._rows(self._read(input, "allgather_layer input"))
        if not isinstance(output, _Pending) or len(output.dims) != 2:
            raise GraphError("allgather_layer: output must be a [1, N] tensor from new_tensor")
        N, n = output.dims[-1], x.shape[-1]
        if isinstance(offset, bool) or not isinstance(offset, numbers.Integral) or not 0 <= offset <= N - n:
            raise GraphError(f"allgather_layer: offset {offset!r} must place the input's {n} values inside the "
                             f"output's {N}")
        g = self.kn_graph
        return self._write(output, g.allreduce(g.pad(x, [(0, 0), (int(offset), N - int(offset) - n)])),
                           "allgather_layer")

    def argmax_partial_layer(self, input, output, grid_dim=None, block_dim=None):
        """First half of the greedy sampler: per-chunk maxima of input [1, V]. ``output`` is
        a pair of tensors (values, indices) from ``new_tensor``; the chunk size is the
        runtime's (about 4 chunks per worker)."""
        _dims3("grid_dim", grid_dim), _dims3("block_dim", block_dim)
        if not isinstance(output, (tuple, list)) or len(output) != 2 or not all(isinstance(o, _Pending) for o in output):
            raise GraphError("argmax_partial_layer: output must be a pair (values, indices) from new_tensor")
        x = self._rows(self._read(input, "argmax input"))
        for o in output:
            o.value = ("argmax_partial", x)
        return tuple(output)

    def argmax_reduce_layer(self, input, output, grid_dim=None, block_dim=None):
        """Second half of the greedy sampler: the index of the maximum (first one; NaN
        wins, as torch.argmax). Its output is the next token: ``mpk()`` writes it to
        ``tokens[step + 1]``."""
        _dims3("grid_dim", grid_dim), _dims3("block_dim", block_dim)
        if (not isinstance(input, (tuple, list)) or len(input) != 2
                or not all(isinstance(i, _Pending) and isinstance(i.value, tuple) for i in input)):
            raise GraphError("argmax_reduce_layer: input must be the (values, indices) pair of argmax_partial_layer")
        return self.argmax_layer(input[0].value[1], output)

    def argmax_layer(self, input, output, grid_dim=None, block_dim=None):
        """output [1] or [1, 1] int64 = argmax of input [1, V]: the next token."""
        _dims3("grid_dim", grid_dim), _dims3("block_dim", block_dim)
        if self._token_out is not None:
            raise GraphError("the step already has an argmax layer (the next token)")
        x = self._rows(self._read(input, "argmax input"))
        tok = self.kn_graph.argmax(x, -1)
        if output is not None and (not isinstance(output, _Pending) or output.dtype != DType.int64
                                   or math.prod(output.dims) != 1):
            raise GraphError("argmax layer: output must be an int64 tensor of one element from new_tensor")
        self._token_out = self._write(output, tok, "argmax layer")
        return self._token_out

    def mark_output(self, t) -> None:
        """Also return ``t`` (e.g. the logits, for sampling in Python) from ``run_step``."""
        self._outputs.append(self._read(t, "mark_output"))

    # ---- compile and run ------------------------------------------------------------------
    def compile(self, **kwargs) -> None:
        """Fuse and compile the step for the backend and build its task graph (CPU) or
        capture it (GPU). Raises GraphError if the step has no argmax layer or is compiled
        twice; ToolchainError when the backend's code cannot be built."""
        if self._plan is not None:
            raise GraphError("this PersistentKernel is already compiled")
        if kwargs:
            raise GraphError(f"compile: unknown arguments {sorted(kwargs)}")
        if self._token_out is None:
            raise GraphError("the step needs an argmax layer (argmax_layer or argmax_partial/reduce_layer): "
                             "its output is the next token")
        g = self.kn_graph
        for t in self._outputs:
            g.mark_output(t)
        g.mark_output(self._token_out)
        cg = g.compile(self.backend.value)
        if hasattr(self.impl, "bind_library_task") and self.impl.codegen == "cpp":
            self._plan = compiled_task_graph(cg, self._attached, get_pool(self.num_workers, self.adaptive_workers))
            if self.profiler_tensor is not None:
                self._plan.set_profiler(self.profiler_tensor)
        else:
            if self.profiler_tensor is not None:
                raise GraphError(f"profiler_tensor: task profiling exists on the CPU backend only, not "
                                 f"'{self.backend.value}'")
            self._plan = cg.plan(self._attached)
            self._plan.capture()
        self._meta = None

    @property
    def plan(self):
        if self._plan is None:
            raise GraphError("call compile() first")
        return self._plan

    @property
    def num_tasks(self) -> int:
        """Tasks per decode step (CPU task graph), or 0 on backends without one."""
        return self.plan.num_tasks if isinstance(self.plan, TaskGraphPlan) else 0

    def run_step(self, token: int, position: int) -> list[torch.Tensor]:
        """One decode step for ``token`` at ``position``: the marked outputs then the next
        token [1] int64 (tensors owned by the kernel: copy to keep). Raises
        IndexOutOfRangeError for a token id or position outside the tables/cache."""
        plan = self.plan
        self._ids_t.fill_(int(token))
        self._step_t.fill_(int(position))
        return plan.run()

    def __call__(self, prompt_length: int = 1, max_new_tokens: int | None = None) -> int:
        """Decode in place: from ``step`` on, feed ``tokens[step]``, write the argmax to
        ``tokens[step + 1]`` (prompt positions below ``prompt_length`` keep their tokens:
        the prompt is fed one token per step) until an EOS token, ``max_new_tokens`` new
        tokens or the end of ``tokens``. Returns the number of new tokens written.

        Raises GraphError without meta_tensors; IndexOutOfRangeError for a token id
        outside the embedding table."""
        if self.tokens is None:
            raise GraphError("mpk() needs meta_tensors=[step, tokens]; use run_step() otherwise")
        plan = self.plan
        start = int(self.step[0])
        limit = self.max_seq_length - 1 - start if max_new_tokens is None else int(max_new_tokens)
        steps = max(0, prompt_length - 1 - start) + max(0, limit)
        if isinstance(plan, TaskGraphPlan) and plan.segments == 1 and len(plan._segments) == 1:
            meta = self._meta_block(prompt_length)
            plan.run_steps(steps, meta)
        else:
            for _ in range(steps):
                s = int(self.step[0])
                if s + 1 >= self.max_seq_length:
                    break
                tok = int(self.run_step(int(self.tokens[s]), s)[-1][0])
                if s + 1 >= prompt_length:
                    self.tokens[s + 1] = tok
                self.step[0] = s + 1
                if s + 1 >= prompt_length and tok in self.eos_token_ids:
                    break
        return max(0, int(self.step[0]) + 1 - max(prompt_length, start + 1))

    def _meta_block(self, prompt_length: int) -> torch.Tensor:
        self._eos_t = torch.tensor(self.eos_token_ids or [-1], dtype=torch.int64)
        out_tok = self.plan.outputs[-1]
        status = self.plan._status
        return torch.tensor([
            self.tokens.data_ptr(), self.max_seq_length, self.step.data_ptr(), self._ids_t.data_ptr(),
            self._step_t.data_ptr(), out_tok.data_ptr(), status.data_ptr() if status is not None else 0,
            status.shape[0] if status is not None else 0, self._eos_t.data_ptr(), len(self.eos_token_ids),
            int(prompt_length)], dtype=torch.int64)

    # ---- profiling ------------------------------------------------------------------------
    def trace_events(self) -> list[dict]:
        """The profiler rows as Chrome trace events ('X' events, one track per worker, times
        in microseconds from the first task)."""
        if self.profiler_tensor is None:
            raise GraphError("no profiler_tensor was given to this PersistentKernel")
        return chrome_trace_events(self.profiler_tensor, self.plan.profiled_rows(), self.plan.task_names)

    def write_trace(self, path) -> int:
        """Write the profile as a Chrome/Perfetto JSON trace to ``path``; returns the number
        of task events."""
        events = self.trace_events()
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ns"}, f)
        return sum(e["ph"] == "X" for e in events)


def chrome_trace_events(profile: torch.Tensor, rows: int, task_names: list[str]) -> list[dict]:
    """Chrome trace events of the first ``rows`` rows of a profiler tensor (columns
    ``runtime.task_graph.PROFILE_FIELDS``)."""
    data = profile[:rows].tolist()
    if not data:
        return []
    col = {f: i for i, f in enumerate(PROFILE_FIELDS)}
    t0 = min(r[col["start_ns"]] for r in data)
    workers = sorted({r[col["worker"]] for r in data})
    events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": w, "args": {"name": f"worker {w}"}}
              for w in workers]
    for r in data:
        task = r[col["task"]]
        events.append({"name": task_names[task] if 0 <= task < len(task_names) else f"task {task}", "ph": "X",
                       "pid": 0, "tid": r[col["worker"]], "ts": (r[col["start_ns"]] - t0) / 1000.0,
                       "dur": (r[col["end_ns"]] - r[col["start_ns"]]) / 1000.0,
                       "args": {"step": r[col["step"]], "task": task, "op": r[col["op"]]}})
    return events


__all__ = ["PersistentKernel", "chrome_trace_events", "Backend"]


def _rank_group(world_size, mpi_rank):
    """The process group of a ``world_size`` > 1 kernel (see ``PersistentKernel``), None for one
    process; GraphError for values out of range, no group, or a group of another size or rank."""
    if (isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size < 1
            or isinstance(mpi_rank, bool) or not isinstance(mpi_rank, numbers.Integral)
            or not 0 <= mpi_rank < world_size):
        raise GraphError(f"world_size={world_size!r}, mpi_rank={mpi_rank!r}: world_size must be a positive integer "
                         "and mpi_rank an integer in [0, world_size)")
    if world_size == 1:
        return None
    group = distributed.active()
    if group is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        group = distributed.ProcessGroup.from_env().init()   # torchrun's group
    if group is None:
        raise GraphError(f"world_size={world_size}: no process group to run over; launch the ranks with torchrun "
                         "(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or join "
                         "yirage.runtime.distributed.ProcessGroup first")
    if (group.world_size, group.rank) != (world_size, mpi_rank):
        raise GraphError(f"world_size={world_size}, mpi_rank={mpi_rank} disagree with the process group "
                         f"(world_size {group.world_size}, rank {group.rank})")
    return group
