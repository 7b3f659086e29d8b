"""torch.compile under tensor parallelism (issue 45 item 5): a DTensor MLP, its first linear
column-parallel and its second row-parallel (``parallelize_module`` with ``ColwiseParallel`` /
``RowwiseParallel``), compiled with yirage on 2 gloo ranks on 127.0.0.1 (1 thread each), equals
the unsharded model in eager; the linears run in yirage partitions, and the collective DTensor
inserts (``_c10d_functional.all_reduce`` and its ``wait_tensor``) stays a torch op between them."""
from __future__ import annotations

import datetime
import os

import pytest
import torch

from yirage.engines.tensor_parallel import free_port

pytestmark = pytest.mark.slow

WORLD = 2


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 256)
        self.down = torch.nn.Linear(256, 64)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _rank(rank: int, port: int, cache: str, results) -> None:
    """One rank: the unsharded model's output (eager), then the tensor-parallel one compiled with
    yirage; puts (rank, max abs difference, the ops left in torch with their reasons, how many
    yirage partitions ran) on ``results``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import yirage as yr

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # a rank that dies makes the other's collective fail within a minute, never hang the suite
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        torch.manual_seed(0)   # the same weights and input on every rank
        model, x = MLP().eval(), torch.randn(8, 64)
        with torch.no_grad():
            want = model(x)
            tp = parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
            compiled = yr.compile(tp, options={"cache_dir": os.path.join(cache, str(rank))})
            got = compiled(x)
        reports = compiled._yirage_backend.reports
        ran = sum(p.runs_in == "yirage" for r in reports for p in r.partitions)
        in_torch = [(t.op, t.reason) for r in reports for t in r.torch_ops]   # one GraphReport per graph
        results.put((rank, float((got - want).abs().max()), in_torch, ran))
    finally:
        dist.destroy_process_group()


def test_a_dtensor_mlp_compiles_and_equals_eager_on_two_ranks(tmp_path):
    pytest.importorskip("torch.distributed.tensor.parallel")
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.SimpleQueue()
    torch.multiprocessing.start_processes(_rank, args=(free_port(), str(tmp_path), results), nprocs=WORLD,
                                         start_method="spawn")
    got = sorted(results.get() for _ in range(WORLD))
    assert [r[0] for r in got] == list(range(WORLD))
    for rank, err, in_torch, ran in got:
        assert err <= 1e-5, f"rank {rank}: max abs difference {err} from the unsharded model"
        assert ran >= 1, f"rank {rank}: no yirage partition ran"
        ops = {op for op, _ in in_torch}
        assert "_c10d_functional.all_reduce.default" in ops, in_torch
        assert all(op.startswith(("_c10d_functional.", "_dtensor.")) for op in ops), in_torch
        assert all("torch.distributed runs it" in why for _, why in in_torch), in_torch
