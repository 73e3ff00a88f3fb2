"""`python -m cbopt bench --only memory`: the optimizer state each rank holds under DDP, ZeRO and FSDP2.

Two gloo processes on CPU take one `cbopt.Adam` step on GPT-2 small's params (`params.gpt2_shapes`) in each mode, with
torch's own wrappers: `DistributedDataParallel` (every rank keeps the whole state), `ZeroRedundancyOptimizer`
(`cbopt.ZeroRedundancyOptimizer`, torch's for cbopt optimizers: each rank keeps the state of the params it owns) and
FSDP2's `fully_shard` (each rank keeps its shard of every param's state, as DTensors). Each rank then counts the bytes
of the state tensors it holds (a DTensor's local shard). Bytes need no timing, so a busy machine does not change
them.
"""
from __future__ import annotations

import json
import os
import tempfile
from datetime import timedelta

import torch

__all__ = ['MODES', 'state_bytes', 'measure_rank', 'state_memory', 'memory_rows']

MODES = ('DDP', 'ZeRO', 'FSDP2')


def state_bytes(opt: torch.optim.Optimizer) -> int:
    "The bytes of the state tensors `opt` holds in this process (a DTensor's local shard: what this rank stores)."
    total = 0
    for s in opt.state.values():
        for v in s.values():
            if isinstance(v, torch.Tensor):
                local = v.to_local() if hasattr(v, 'to_local') else v
                total += local.numel() * local.element_size()
    return total


def _module(shapes) -> torch.nn.Module:
    "A module holding params of `shapes` (named as GPT-2's, dots as underscores) with fixed random values."
    g = torch.Generator().manual_seed(0)
    m = torch.nn.Module()
    for name, shape in shapes: m.register_parameter(name.replace('.', '_'), torch.nn.Parameter(torch.randn(shape, generator=g) * 0.02))
    return m


def _step(opt, params) -> None:
    "One step with a fixed grad on every param (the state exists afterwards)."
    for p in params: p.grad = torch.full_like(p, 1e-3)
    opt.step()


def measure_rank(shapes, modes=MODES) -> dict:
    """On a rank of an initialised process group: for each mode, one cbopt.Adam step over params of `shapes` under it,
    and the bytes of the state this rank then holds (`{mode: bytes}`)."""
    import cbopt
    res = {}
    if 'DDP' in modes:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(_module(shapes))
        opt = cbopt.Adam(model.named_parameters())
        _step(opt, model.parameters())
        res['DDP'] = state_bytes(opt)
        del model, opt
    if 'ZeRO' in modes:
        model = _module(shapes)
        zero = cbopt.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cbopt.Adam)
        _step(zero, model.parameters())
        res['ZeRO'] = state_bytes(zero.optim)
        del model, zero
    if 'FSDP2' in modes:
        from torch.distributed.fsdp import fully_shard
        model = fully_shard(_module(shapes))
        opt = cbopt.Adam(model.named_parameters())
        _step(opt, model.parameters())
        res['FSDP2'] = state_bytes(opt)
    return res


def _rank(rank: int, world: int, init_file: str, out: str, shapes) -> None:
    "One process of `state_memory`: join the group, measure, write this rank's bytes to `out`."
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=world,
                            timeout=timedelta(minutes=10))
    try:
        res = measure_rank(shapes)
        with open(os.path.join(out, f'{rank}.json'), 'w') as f: json.dump(res, f)
    finally: dist.destroy_process_group()


def state_memory(shapes, world: int = 2) -> dict:
    """Each mode's optimizer-state bytes per rank (`{mode: [bytes of rank 0, rank 1, ...]}`) for cbopt.Adam over
    params of `shapes` on `world` gloo processes, and the state bytes of one unsharded process."""
    import sys
    import torch.multiprocessing as mp
    # the processes fork from multiprocessing's fork server, a fresh process that imports torch and cbopt once for all
    # of them; it is given our sys.path (it would ignore it otherwise), so it imports this very cbopt
    mp.get_context('forkserver').set_forkserver_preload([__name__])
    env = {'OMP_NUM_THREADS': '1', 'PYTHONPATH': os.pathsep.join(p for p in sys.path if p)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with tempfile.TemporaryDirectory(prefix='cbopt-bench-memory-') as out:
            error = None
            try: mp.start_processes(_rank, args=(world, os.path.join(out, 'rendezvous'), out, shapes), nprocs=world,
                                    start_method='forkserver')
            except Exception as e: error = f'{type(e).__name__}: {e}'
            ranks = []
            for r in range(world):
                path = os.path.join(out, f'{r}.json')
                ranks.append(json.load(open(path)) if os.path.exists(path) else {})
    finally:
        for k, v in saved.items():
            if v is None: os.environ.pop(k)
            else: os.environ[k] = v
    numel = sum(torch.Size(s).numel() for _, s in shapes)
    return {'world': world, 'tensors': len(shapes), 'numel': numel, 'param_bytes': 4 * numel,
            'per_rank': {m: [r.get(m) for r in ranks] for m in MODES}, 'error': error}


def memory_rows(res: dict) -> tuple[list[str], list[list[str]]]:
    "The table: per mode, each rank's state in MB, and as a share of one process's state (that of DDP's rank 0)."
    full = res['per_rank']['DDP'][0]
    header = ['mode', *[f'rank {r} state MB' for r in range(res['world'])], 'largest rank / one process']
    rows = []
    for mode, per in res['per_rank'].items():
        if any(b is None for b in per):
            rows.append([mode, *['failed' if b is None else f'{b / 1e6:.1f}' for b in per], '-'])
            continue
        rows.append([mode, *[f'{b / 1e6:.1f}' for b in per], f'{max(per) / full:.0%}' if full else '-'])
    return header, rows
