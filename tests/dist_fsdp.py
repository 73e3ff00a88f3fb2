"""Workers for the FSDP2 tests (`test_fsdp.py`), run on 2 gloo processes by `distributed.spawn`: each trains tiny models
whose params are DTensors (`fully_shard`), each rank on its rows of the global batch, and returns the full tensors."""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

import cbopt
import distributed as D
from cases import case


def fsdp_model(shard_head: bool = True, make=D.make_model, mesh=None) -> nn.Module:
    """`distributed.make_model` (or `make`'s model) with each Linear sharded by FSDP2 (its params become `Shard(0)`
    DTensors: the 3-row head splits 2 + 1, unevenly), and the root, as torchtitan wraps a model. `shard_head=False`
    leaves the head plain (replicated, its grads averaged by hand as DDP would): a model mixing DTensor and plain params.
    `mesh`: FSDP2's device mesh (a 2-D one: HSDP, `(Replicate(), Shard(0))`)."""
    from torch.distributed.fsdp import fully_shard
    model = make()
    fully_shard(model[0], mesh=mesh)
    if shard_head:
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def average_plain_grads(model: nn.Module) -> None:
    "What DDP does for the params FSDP2 does not hold: average their grads over the ranks."
    from cbopt.core.dtensor import is_dtensor
    for p in model.parameters():
        if p.grad is not None and not is_dtensor(p.grad):
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def full(model: nn.Module) -> dict:
    "Every param as a whole (plain) tensor, gathered from its shards."
    return {n: (p.full_tensor() if hasattr(p, 'full_tensor') else p).detach().clone() for n, p in model.named_parameters()}


def backward(model: nn.Module, step: int, rank: int, world: int) -> None:
    "This rank's share of the loss of global batch `step`: FSDP2 averages the grads into the global batch's."
    x, y = D.batch(step)
    nn.functional.mse_loss(model(x[rank::world]), y[rank::world]).backward()


def train_cases(rank: int, world: int, ids: list, backends: list, steps: int, lr: float) -> dict:
    """Each registry case with each backend, on a fresh FSDP2 model, `steps` steps; the full params, and the warnings
    the steps gave (a chain that did not compile says so)."""
    out = {}
    for cid in ids:
        for be in backends:
            model = fsdp_model()
            opt = case(cid).build(list(model.named_parameters()), lr, be)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter('always')
                D.train(model, opt, steps, rank, world)
            out[(cid, str(be))] = {'params': full(model), 'warnings': [str(w.message) for w in caught],
                                   'dtensor_state': all(type(v).__name__ == 'DTensor' for s in opt.state.values()
                                                        for v in s.values() if torch.is_tensor(v) and v.ndim)}
    return out


def clipping(rank: int, world: int, steps: int, max_norm: float, lr: float, nan_step: int) -> dict:
    """Global-norm clipping on FSDP2 against torch's `clip_grad_norm_` + AdamW on the same sharded model, per norm type
    and backend; clipping a model mixing sharded and plain params; `SkipNonFinite` when only this rank's shard of one
    grad is NaN (rank 1's, at step `nan_step`)."""
    out = {}
    for norm_type in (2.0, float('inf')):
        ref = fsdp_model()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, betas=(0.9, 0.99), eps=1e-5, weight_decay=0.01)
        ref_norms = []
        for i in range(steps):
            backward(ref, i, rank, world)
            ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type).full_tensor().item())
            ref_opt.step()
            ref_opt.zero_grad()
        out[('torch', norm_type)] = {'params': full(ref), 'norms': ref_norms}
        for be in ('loop', 'foreach', 'fused'):
            model = fsdp_model()
            opt = cbopt.GradientClippingOptimizer(cbopt.Adam(model.named_parameters(), lr=lr, backend=be),
                                                  cbopt.GradientClipping.NORM, max_gradient=max_norm, norm_type=norm_type)
            norms, grads_kept = [], True
            for i in range(steps):
                backward(model, i, rank, world)
                before = [p.grad.to_local().clone() for p in model.parameters()]
                opt.step()
                grads_kept &= all(torch.equal(p.grad.to_local(), g) for p, g in zip(model.parameters(), before))
                norms.append(opt.last_total_grad_norm)
                opt.zero_grad()
            out[(be, norm_type)] = {'params': full(model), 'norms': [n.item() for n in norms],
                                    'plain_norms': all(type(n) is torch.Tensor for n in norms), 'grads_kept': grads_kept}
    mixed = fsdp_model(shard_head=False)  # the body sharded, the head replicated: torchrec's two kinds at once
    opt = cbopt.GradientClippingOptimizer(cbopt.Adam(mixed.named_parameters(), lr=lr),
                                          cbopt.GradientClipping.NORM, max_gradient=max_norm)
    norms = []
    for i in range(steps):
        backward(mixed, i, rank, world)
        average_plain_grads(mixed)
        opt.step()
        norms.append(opt.last_total_grad_norm.item())
        opt.zero_grad()
    out['mixed'] = {'params': full(mixed), 'norms': norms}
    out['skip'] = skip_a_nan_shard(rank, world, steps, lr, nan_step)
    out['refused'] = reading_a_partial_number(rank, world)
    out['empty_shard'] = {k: train_one_row_head(make, rank, world, steps) for k, make in EMPTY_SHARD_OPTS.items()}
    return out


def one_row_head() -> nn.Module:
    "A model whose head has one row: on 2 ranks, rank 1's shards of its weight and bias are empty."
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


EMPTY_SHARD_OPTS = {  # what must also work where a rank's shard is empty
    'clip inf': lambda ps: cbopt.GradientClippingOptimizer(cbopt.Adam(ps, lr=1e-2), cbopt.GradientClipping.NORM,
                                                           max_gradient=0.1, norm_type='inf'),
    'skip': lambda ps: cbopt.SkipNonFinite(cbopt.Adam(ps, lr=1e-2, backend='foreach')),
    'lamb': lambda ps: cbopt.Lamb(ps, lr=1e-2, backend='foreach'),
}


def train_one_row_head(make, rank: int = 0, world: int = 1, steps: int = 3, sharded: bool = True) -> dict:
    "`make(named params)` trained on `one_row_head` (sharded by FSDP2 or not), on the first output column's targets."
    from torch.distributed.fsdp import fully_shard
    model = one_row_head()
    if sharded:
        for m in (model[0], model[2], model): fully_shard(m)
    opt = make(list(model.named_parameters()))
    for i in range(steps):
        x, y = D.batch(i)
        nn.functional.mse_loss(model(x[rank::world]), y[rank::world, :1]).backward()
        opt.step()
        opt.zero_grad()
    return full(model)


def step_by_grad_norm(p, lr, **kwargs):
    "A user's callback reading its grad's norm as a Python number: on a shard, this rank's part of it only."
    p.data.sub_(p.grad * (lr / max(float(torch.linalg.vector_norm(p.grad)), 1.0)))
step_by_grad_norm.defaults, step_by_grad_norm.state, step_by_grad_norm.scope = dict(lr=0.1), {}, 'tensor'


def reading_a_partial_number(rank: int, world: int) -> dict:
    "Per backend: the error `step_by_grad_norm` gets on FSDP2, and whether the params stayed as they were."
    from cbopt.core.dtensor import PartialNumberError
    out = {}
    for be in ('loop', 'foreach', 'fused'):
        model = fsdp_model()
        opt = cbopt.Optimizer(model.named_parameters(), [step_by_grad_norm], backend=be)
        backward(model, 0, rank, world)
        before = full(model)
        try: opt.step()
        except PartialNumberError as e: out[be] = {'error': str(e)}
        else: out[be] = {'error': None}
        out[be]['unchanged'] = all(torch.equal(full(model)[n], p) for n, p in before.items())
    return out


def skip_a_nan_shard(rank: int, world: int, steps: int, lr: float, nan_step: int) -> dict:
    "`SkipNonFinite(cbopt.Adam)` on FSDP2, with a NaN in rank 1's shard of the head's weight grad at step `nan_step`."
    model = fsdp_model()
    opt = cbopt.SkipNonFinite(cbopt.Adam(model.named_parameters(), lr=lr))
    skipped = []
    for i in range(steps):
        backward(model, i, rank, world)
        if i == nan_step and rank == 1: model[2].weight.grad.to_local()[0, 0] = float('nan')
        opt.step()
        skipped.append(opt.step_stats['skipped'])
        opt.zero_grad()
    return {'params': full(model), 'skipped': skipped, 'total': opt.step_stats['skipped_total']}


# -- low-bit state (`state_precision=`) on shards --------------------------------------------------------------------
MISALIGNED = '0.bias'  # on 2 ranks, shards of 128 elements: half an 8-bit block each (4-bit's blocks are 128)


def lowbit_groups(named) -> list:
    """`lowbit_model`'s named params for `cbopt.Adam`: all but `MISALIGNED` in one group (`min_quantize_size` the
    optimizer's), `MISALIGNED` in a group that quantizes any size (`min_quantize_size=1`)."""
    named = list(named)  # ('0.bias#0', '0.bias#1': its halves, in the one-process reference of test_fsdp.py)
    return [{'params': [(n, p) for n, p in named if n.split('#')[0] != MISALIGNED]},
            {'params': [(n, p) for n, p in named if n.split('#')[0] == MISALIGNED], 'min_quantize_size': 1}]


def make_lowbit_opt(named, prec: str, backend, lr: float) -> cbopt.Optimizer:
    "AdamW's chain over `lowbit_groups` with `state_precision=prec` (a group's own `min_quantize_size` kept)."
    from cbopt.recipes.fastai import adam_chain
    return cbopt.Optimizer(lowbit_groups(named), adam_chain(), lr=lr, mom=0.9, sqr_mom=0.99, eps=1e-5, wd=0.1,
                           state_precision=prec, min_quantize_size=D.LOWBIT_MIN, backend=backend)


def lowbit_grads(step: int, shapes: dict) -> dict:
    "Seeded grads for params of `shapes` (name -> shape) at step `step`, the same on every rank and in one process."
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def train_lowbit(rank: int, world: int, runs: list, steps: int, lr: float) -> dict:
    """Adam with each `(state_precision, backend, hsdp)` of `runs` on FSDP2's shards of `lowbit_model` (`hsdp`: on a
    (1, world) mesh, its params `(Replicate(), Shard(0))`), `steps` steps of
    `lowbit_grads` (each rank given its shards of them: the one-process reference gets the very same numbers, where
    FSDP2's reduction of a batch's grads would round them otherwise): the full params, the state as a checkpoint holds
    it (whole tensors' parts, gathered), the state dequantized, and what this rank stores: each param's state sizes,
    whether its blocks line up with the whole tensor's; and what it stores once its checkpoint is loaded back."""
    from cbopt.core.dtensor import shard_like
    from cbopt.state.lowbit import blocks_line_up
    out = {}
    from torch.distributed.device_mesh import init_device_mesh
    for prec, be, hsdp in runs:
        mesh = init_device_mesh('cpu', (1, world), mesh_dim_names=('replicate', 'shard')) if hsdp else None
        model = fsdp_model(make=D.lowbit_model, mesh=mesh)
        opt = make_lowbit_opt(model.named_parameters(), prec, be, lr)
        named = dict(model.named_parameters())
        for i in range(steps):
            for n, g in lowbit_grads(i, {n: p.shape for n, p in named.items()}).items(): named[n].grad = shard_like(g, named[n])
            opt.step()
            opt.zero_grad()
        out[(prec, str(be), hsdp)] = {
            'placements': str(model[0].weight.placements),
            'params': full(model), 'state': D.whole(opt.named_state_dict()),
            'dequantized': D.whole(opt.named_state_dict(dequantize=True)),
            'stored': stored_parts(opt, named), 'line_up': {n: blocks_line_up(p, prec) for n, p in named.items()}}
        again = make_lowbit_opt(model.named_parameters(), prec, be, lr)  # its checkpoint, loaded back on these ranks
        again.load_state_dict(opt.state_dict())
        out[(prec, str(be), hsdp)]['reloaded'] = stored_parts(again, named)
    return out


def stored_parts(opt: cbopt.Optimizer, named: dict) -> dict:
    "The low-bit parts this rank stores for each param (plain tensors: its shard's blocks), copied."
    return {n: {k: v.clone() for k, v in opt.state[p].items() if type(v) is torch.Tensor} for n, p in named.items()}
