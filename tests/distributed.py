"""Two gloo processes on CPU for the torch.distributed tests (`test_distributed.py`): `spawn(worker, ...)` runs
`worker(rank, world, *args)` in each, and returns what each rank returned. Workers live here, importable by the
spawned processes."""
from __future__ import annotations

import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import cbopt

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out: str, worker, args) -> None:
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group('gloo', rank=rank, world_size=world)
    try: torch.save(worker(rank, world, *args), os.path.join(out, f'{rank}.pt'))
    finally: dist.destroy_process_group()


def spawn(worker, *args, world: int = WORLD) -> list:
    "Run `worker(rank, world, *args)` on `world` gloo processes; each rank's return value, in rank order."
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_entry, args=(world, _free_port(), out, worker, args), nprocs=world, join=True)
        return [torch.load(os.path.join(out, f'{r}.pt'), weights_only=False) for r in range(world)]


# -- a model, data and a training loop shared by the workers and the one-process references ----------------------
def make_model(bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8, bias=bias), nn.Tanh(), nn.Linear(8, 3, bias=bias))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    "The global batch of step `step` (16 rows): each rank trains on its rows `rank::world`."
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)


def train(model, opt, steps: int, rank: int = 0, world: int = 1, start: int = 0) -> None:
    for i in range(start, start + steps):
        x, y = batch(i)
        nn.functional.mse_loss(model(x[rank::world]), y[rank::world]).backward()
        opt.step()
        opt.zero_grad()


def params(model) -> dict: return {n: p.detach().clone() for n, p in model.named_parameters()}


# -- workers ------------------------------------------------------------------------------------------------------
def ddp_and_zero(rank: int, world: int, steps: int) -> dict:
    """DDP with a cbopt.Adam over its named params (DDP's `module.` prefix), and DDP with ZeroRedundancyOptimizer of
    cbopt.Adam, each `steps` steps on this rank's share of the global batch; ZeRO's consolidated state_dict."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(make_model())
    opt = cbopt.Adam(ddp.named_parameters(), lr=1e-2, wd=0.1)
    train(ddp, opt, steps, rank, world)
    zddp = DDP(make_model())
    zero = ZeroRedundancyOptimizer(zddp.parameters(), optimizer_class=cbopt.Adam, lr=1e-2, wd=0.1)
    train(zddp, zero, steps, rank, world)
    zero.consolidate_state_dict(to=0)
    return {'ddp': params(ddp.module), 'names': opt.param_names, 'ddp_state': opt.named_state_dict(),
            'zero': params(zddp.module), 'zero_sd': zero.state_dict() if rank == 0 else None}


def zero_empty_partition(rank: int, world: int, steps: int) -> dict:
    "ZeroRedundancyOptimizer over a model of one param: rank 1 owns nothing, its cbopt.Adam has an empty group."
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = DDP(nn.Linear(6, 3, bias=False))
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cbopt.Adam, lr=1e-2)
    for i in range(steps):
        x, y = batch(i)
        nn.functional.mse_loss(model(x[rank::world]), y[rank::world]).backward()
        zero.step()
        zero.zero_grad()
    return {'weight': model.module.weight.detach().clone(), 'local_params': len(zero.optim.params)}
