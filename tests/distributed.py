"""Two gloo processes on CPU for the torch.distributed tests (`test_distributed.py`, `test_fsdp.py`): `spawn(worker,
...)` runs `worker(rank, world, *args)` on every rank and returns what each rank returned, in rank order. Workers live
in modules the ranks can import (this one, `dist_fsdp.py`).

The ranks are started once per test process and kept (`Ranks`): starting them costs seconds (importing torch and
cbopt), a task milliseconds. They are forked from multiprocessing's fork server, a fresh process (not a copy of the
test process, its threads and state) that imports torch and cbopt once for all the ranks. They meet through a file (no port to pick, so no port to race for), on the loopback
interface, one thread each. Nothing can hang: a task that does not finish in `TIMEOUT` seconds, a rank that dies and
a rank that raises all fail the test with the rank's traceback, and the ranks are then replaced, since the survivors
may be stuck in a collective (which gloo itself abandons after `COLLECTIVE_TIMEOUT`)."""
from __future__ import annotations

import atexit
import io
import os
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import cbopt

WORLD = 2
TIMEOUT = 240.0            # seconds a task may take on all ranks, start-up included (a loaded 2-core machine is slow)
COLLECTIVE_TIMEOUT = 60.0  # gloo gives up on a collective after this long, so a rank whose peer failed does not hang
GRACE = 5.0                # after one rank fails, how long the others get to report before they are replaced


def _serve(rank: int, world: int, init_file: str, tasks, results) -> None:
    "A rank: join the group, then run each task sent to it and send back its result (torch.save'd) or its traceback."
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=world,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT))
    results.put((rank, 'ready', None))
    try:
        while (task := tasks.get()) is not None:
            worker, args = task
            try:
                buf = io.BytesIO()
                torch.save(worker(rank, world, *args), buf)
                results.put((rank, 'ok', buf.getvalue()))
            except BaseException:
                results.put((rank, 'error', traceback.format_exc()))
    finally: dist.destroy_process_group()


class Ranks:
    "`world` gloo processes kept for many tasks: `run(worker, *args)` runs `worker(rank, world, *args)` on each."
    def __init__(self, world: int):
        ctx = mp.get_context('forkserver')
        ctx.set_forkserver_preload([__name__])  # one clean process imports torch and cbopt once; the ranks fork from it
        self.world, self.dir = world, tempfile.TemporaryDirectory(prefix='cbopt-dist-')
        self.tasks, self.results = [ctx.SimpleQueue() for _ in range(world)], ctx.Queue()
        env = {'OMP_NUM_THREADS': '1', **({'GLOO_SOCKET_IFNAME': 'lo'} if sys.platform == 'linux' else {}),
               'PYTHONPATH': os.pathsep.join(p for p in sys.path if p)}  # the fork server ignores our sys.path otherwise
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the fork server, started with the first ranks, and the ranks inherit the environment
        try:
            self.procs = [ctx.Process(target=_serve, daemon=True, name=f'cbopt-rank{r}',
                                      args=(r, world, os.path.join(self.dir.name, 'rendezvous'), self.tasks[r], self.results))
                          for r in range(world)]
            for p in self.procs: p.start()
        finally:
            for k, v in saved.items():
                if v is None: os.environ.pop(k)
                else: os.environ[k] = v
        self.ready = False

    def _collect(self, what: str, deadline: float) -> list:
        "Each rank's report, in rank order; raises (naming `what` and the rank) on an error, a dead rank or the deadline."
        got: dict[int, tuple] = {}
        failed_at = None
        while len(got) < self.world:
            now = time.monotonic()
            limit = min(deadline, failed_at + GRACE) if failed_at is not None else deadline
            if now > limit: break
            try: rank, kind, value = self.results.get(timeout=min(1.0, max(limit - now, 0.01)))
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in got]
                if dead and failed_at is None: failed_at = time.monotonic()
                continue
            got[rank] = (kind, value)
            if kind == 'error' and failed_at is None: failed_at = time.monotonic()
        errors = [f'rank {r}:\n{v}' for r, (k, v) in sorted(got.items()) if k == 'error']
        dead = [f'rank {r} died (exit code {p.exitcode})' for r, p in enumerate(self.procs) if r not in got and not p.is_alive()]
        if errors or dead: raise RuntimeError(f'{what} failed on {self.world} gloo ranks:\n' + '\n'.join(errors + dead))
        if len(got) < self.world:
            raise TimeoutError(f'{what} did not finish in {TIMEOUT:.0f} s on ranks {sorted(set(range(self.world)) - set(got))}')
        return [got[r][1] for r in range(self.world)]

    def run(self, worker: Callable, *args) -> list:
        deadline = time.monotonic() + TIMEOUT
        try:
            if not self.ready:
                self._collect('starting the ranks', deadline)
                self.ready = True
            for q in self.tasks: q.put((worker, args))
            out = self._collect(getattr(worker, '__name__', repr(worker)), deadline)
        except BaseException:
            self.close(force=True)
            raise
        return [torch.load(io.BytesIO(b), weights_only=False) for b in out]

    def close(self, force: bool = False) -> None:
        "Stop the ranks (politely: each leaves the group), or kill them (`force`: they may be stuck in a collective)."
        if not force:
            for q in self.tasks: q.put(None)
        for p in self.procs:
            p.join(timeout=0 if force else 10)
            if p.is_alive(): p.kill()
            p.join()
        self.dir.cleanup()


_ranks: dict[int, Ranks] = {}


def spawn(worker: Callable, *args, world: int = WORLD) -> list:
    "Run `worker(rank, world, *args)` on `world` gloo processes (kept for the next call); each rank's return value, in rank order."
    if world not in _ranks or not all(p.is_alive() for p in _ranks[world].procs): _ranks[world] = Ranks(world)
    try: return _ranks[world].run(worker, *args)
    except BaseException:
        _ranks.pop(world, None)
        raise


@atexit.register
def _close_all() -> None:
    for r in _ranks.values(): r.close()
    _ranks.clear()


# -- a model, data and a training loop shared by the workers and the one-process references ----------------------
def make_model(bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8, bias=bias), nn.Tanh(), nn.Linear(8, 3, bias=bias))


LOWBIT_MIN = 768  # min_quantize_size of `lowbit_model`'s state: its weights are quantized, its biases fp32


def lowbit_model() -> nn.Module:
    """A model for low-bit state (`state_precision=`), 6-256-3 on `batch`'s data. On 2 ranks, FSDP2 splits both weights
    on block boundaries of 8-bit and 4-bit state: the first into shards of 128 rows of 6 (768 elements, 3 blocks of
    256), the head's 3 rows of 256 unevenly, 2 + 1; each shard of the head (512, 256 elements) is under `LOWBIT_MIN`,
    the head (768) is not."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 256), nn.Tanh(), nn.Linear(256, 3))


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
    """DDP with a cbopt.Adam over its named params (DDP's `module.` prefix), DDP with cbopt.ZeroRedundancyOptimizer of
    cbopt.Adam, and DDP with torch's own ZeroRedundancyOptimizer given cbopt.Adam, each `steps` steps on this rank's
    share of the global batch; cbopt's ZeRO's consolidated state_dict."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(make_model())
    opt = cbopt.Adam(ddp.named_parameters(), lr=1e-2, wd=0.1)
    train(ddp, opt, steps, rank, world)
    zddp = DDP(make_model())
    zero = cbopt.ZeroRedundancyOptimizer(zddp.parameters(), optimizer_class=cbopt.Adam, lr=1e-2, wd=0.1)
    train(zddp, zero, steps, rank, world)
    zero.consolidate_state_dict(to=0)
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO  # torch's own, given cbopt.Adam
    tddp = DDP(make_model())
    tzero = TorchZeRO(tddp.parameters(), optimizer_class=cbopt.Adam, lr=1e-2, wd=0.1)
    train(tddp, tzero, steps, rank, world)
    return {'ddp': params(ddp.module), 'names': opt.param_names, 'ddp_state': opt.named_state_dict(),
            'zero': params(zddp.module), 'zero_sd': zero.state_dict() if rank == 0 else None,
            'torch_zero': params(tddp.module)}


def zero_named_resume(rank: int, world: int, steps: int, more: int, path: str) -> dict:
    """ZeRO over cbopt.Adam whose ranks name their params (`zero.optim.name_params`): `steps` steps, the consolidated
    state_dict saved by rank 0 to `path`; then a fresh ZeRO on every rank loads it (weights_only) and trains `more`."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    def make(model):
        zero = cbopt.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cbopt.Adam, lr=1e-2, wd=0.1)
        zero.optim.name_params(model)
        return zero
    ddp = DDP(make_model())
    zero = make(ddp)
    train(ddp, zero, steps, rank, world)
    zero.consolidate_state_dict(to=0)
    if rank == 0: torch.save(zero.state_dict(), path)
    dist.barrier()
    ddp2 = DDP(make_model())
    with torch.no_grad():
        for p, q in zip(ddp2.parameters(), ddp.parameters()): p.copy_(q)
    zero2 = make(ddp2)
    names = zero2.optim.param_names
    other = torch.load(path, weights_only=True)
    other['param_groups'][0]['chain'] = 'average_grad,momentum_step'  # another algorithm's checkpoint: refused
    try: zero2.load_state_dict(other)
    except ValueError as e: refused = str(e)
    misnamed = torch.load(path, weights_only=True)  # 0.weight's and 0.bias's names swapped: another model's order
    names0 = misnamed['param_groups'][0]['param_names']
    names0[0], names0[1] = names0[1], names0[0]
    try: zero2.load_state_dict(misnamed)
    except ValueError as e: refused_names = str(e)
    zero2.load_state_dict(torch.load(path, weights_only=True))
    loaded = zero2.optim.named_state_dict()
    train(ddp2, zero2, more, rank, world, start=steps)
    return {'names': names, 'names_after_load': zero2.optim.param_names, 'loaded': loaded, 'final': params(ddp2.module),
            'refused': refused, 'refused_names': refused_names}


# a ZeRO checkpoint of `make_model()` with one thing wrong, late in the order: the last param (3, owned by rank 1:
# ZeRO splits the params by size, rank 0 holding 0.weight) or the group's entries, read after every param's state
def _retyped(sd): sd['state'][3]['sqr_avg'] = sd['state'][3]['sqr_avg'].long()
def _reshaped(sd): sd['state'][3]['grad_avg'] = torch.zeros(5)
def _unknown_entry(sd): sd['param_groups'][0]['warmup.iter'] = 3
def _param_too_many(sd): sd['param_groups'][0]['params'].append(4)
BAD_ZERO_CHECKPOINTS = {
    'dtype': (_retyped, "'3'"), 'shape': (_reshaped, "'3'"),
    'missing entry': (lambda sd: sd['state'][3].pop('sqr_avg'), "'3'"),
    'no state': (lambda sd: sd['state'].pop(3), "'3'"),
    'hyper': (lambda sd: sd['param_groups'][0].update(eps=-1.0), 'eps'),
    'chain': (lambda sd: sd['param_groups'][0].update(chain='average_grad,momentum_step'), 'param group 0'),
    'whole-model entry': (_unknown_entry, "'warmup.iter'"),
    'group size': (_param_too_many, 'param group 0'),
}


def zero_refuses_bad_checkpoints(rank: int, world: int, steps: int, more: int) -> dict:
    """Two identical ZeRO runs over cbopt.Adam (`a`, `b`) train `steps` steps; `a`'s consolidated checkpoint then; both
    train `more` steps (so that any value loaded would show), then `a` is given each of `BAD_ZERO_CHECKPOINTS`; both
    take one more step. What `a` held before and after the loads, each load's error, and both runs' params and state."""
    import copy
    from torch.nn.parallel import DistributedDataParallel as DDP
    runs = []
    for _ in range(2):
        model = DDP(make_model())
        runs.append((model, cbopt.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cbopt.Adam, lr=1e-2, wd=0.1)))
    (model_a, zero_a), (model_b, zero_b) = runs
    for model, zero in runs: train(model, zero, steps, rank, world)
    zero_a.consolidate_state_dict(to=0)
    sd = [zero_a.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(sd, src=0)
    for model, zero in runs: train(model, zero, more, rank, world, start=steps)
    def held(zero) -> dict:  # this rank's state and hypers, and ZeRO's own groups
        return {'local': zero.optim.named_state_dict(), 'zero_groups': [{k: v for k, v in g.items() if k != 'params'}
                                                                        for g in zero.param_groups]}
    before, errors = held(zero_a), {}
    for what, (spoil, _) in BAD_ZERO_CHECKPOINTS.items():
        bad = copy.deepcopy(sd[0])
        spoil(bad)
        try: zero_a.load_state_dict(bad)
        except Exception as e: errors[what] = f'{type(e).__name__}: {e}'
        else: errors[what] = None
    after = held(zero_a)
    for model, zero in runs: train(model, zero, 1, rank, world, start=steps + more)
    return {'errors': errors, 'before': before, 'after': after, 'a': params(model_a.module), 'b': params(model_b.module),
            'state_a': zero_a.optim.named_state_dict(), 'state_b': zero_b.optim.named_state_dict()}


def zero_refuses_what_it_cannot_run(rank: int, world: int) -> dict:
    "cbopt.ZeroRedundancyOptimizer given a torch optimizer class, or overlap_with_ddp=True: the errors."
    errors = {}
    for what, kw in {'torch class': dict(optimizer_class=torch.optim.Adam),
                     'overlap': dict(optimizer_class=cbopt.Adam, overlap_with_ddp=True)}.items():
        try: cbopt.ZeroRedundancyOptimizer(make_model().parameters(), lr=1e-2, **kw)
        except (TypeError, ValueError) as e: errors[what] = f'{type(e).__name__}: {e}'
    return errors


def zero_add_param_group(rank: int, world: int) -> dict:
    """cbopt.ZeroRedundancyOptimizer over the first layer, then `add_param_group` with the second, a step: this rank's
    optimizer's names, and each of its params' global position."""
    model = make_model()
    zero = cbopt.ZeroRedundancyOptimizer(model[0].parameters(), optimizer_class=cbopt.Adam, lr=1e-2)
    zero.add_param_group({'params': list(model[2].parameters()), 'lr': 1e-3})
    train(model, zero, 1, rank, world)
    index = {p: i for i, p in enumerate(p for g in zero.param_groups for p in g['params'])}
    return {'names': zero.optim.param_names, 'positions': [str(index[p]) for p in zero.optim.params],
            'lrs': [g['lr'] for g in zero.optim.param_groups], 'stepped': all(zero.optim.state[p] for p in zero.optim.params)}


def zero_empty_partition(rank: int, world: int, steps: int) -> dict:
    "ZeroRedundancyOptimizer over a model of one param: rank 1 owns nothing, its cbopt.Adam has an empty group."
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = DDP(nn.Linear(6, 3, bias=False))
    zero = cbopt.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cbopt.Adam, lr=1e-2)
    for i in range(steps):
        x, y = batch(i)
        nn.functional.mse_loss(model(x[rank::world]), y[rank::world]).backward()
        zero.step()
        zero.zero_grad()
    return {'weight': model.module.weight.detach().clone(), 'local_params': len(zero.optim.params)}


def zero_momentum_writes(rank: int, world: int, built_with: str) -> list:
    """ZeroRedundancyOptimizer of cbopt.SGD built with momentum given as `built_with` (torch's `momentum` or cbopt's
    `mom`), then written on ZeRO's groups under each name in turn, as a scheduler (OneCycleLR: `momentum`) or fastai
    (`mom`) does, a step after each: the `mom` each rank's optimizer steps with."""
    torch.manual_seed(0)
    model = make_model()
    zero = cbopt.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cbopt.SGD, lr=1e-2, **{built_with: 0.9})
    seen = []
    for i, (name, value) in enumerate([('momentum', 0.5), ('mom', 0.3), ('momentum', 0.7), ('mom', 0.2)]):
        zero.param_groups[0][name] = value
        x, y = batch(i)
        nn.functional.mse_loss(model(x), y).backward()
        zero.step()
        zero.zero_grad()
        seen.append(zero.optim.param_groups[0]['mom'])
    return seen


def one_cycle_run(zero_or_opt, model, steps: int) -> list:
    "`steps` steps on the whole batch under OneCycleLR (momentum cycled): the `mom` each step used."
    opt = getattr(zero_or_opt, 'optim', zero_or_opt)  # ZeRO: the rank's optimizer, which the step used
    sched = torch.optim.lr_scheduler.OneCycleLR(zero_or_opt, max_lr=0.1, total_steps=steps)
    moms = []
    for i in range(steps):
        x, y = batch(i)
        nn.functional.mse_loss(model(x), y).backward()
        zero_or_opt.step()
        zero_or_opt.zero_grad()
        moms.append(opt.param_groups[0]['mom'])
        sched.step()
    return moms


def zero_one_cycle(rank: int, world: int, built_with: str, steps: int) -> dict:
    """cbopt.ZeroRedundancyOptimizer of cbopt.SGD, momentum given as `built_with` (`momentum` or `mom`), under torch's
    OneCycleLR, every rank on the whole batch: the `mom` each step used, and the params."""
    model = make_model()
    zero = cbopt.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cbopt.SGD, lr=1e-2, **{built_with: 0.9})
    return {'moms': one_cycle_run(zero, model, steps), 'params': params(model)}


# -- distributed checkpoints (DCP): saved on one world size, loaded on another ------------------------------------
def make_dcp_opt(model, lowbit: str | None = None) -> cbopt.Optimizer:
    """AdamW under a linear warmup and 3-step accumulation: whole-model callbacks whose state (the warmup count, the
    accumulation count in the group entries, the grad sums in the per-param state) must survive a checkpoint.
    `lowbit`: its `state_precision` (params of `LOWBIT_MIN` elements and more; `lowbit_model`'s weights)."""
    low = {'state_precision': lowbit, 'min_quantize_size': LOWBIT_MIN} if lowbit else {}
    adam = cbopt.Adam(model.named_parameters(), lr=1e-2, wd=0.1, **low)
    warm = cbopt.WarmupOptimizer(adam, [cbopt.WarmupStage(cbopt.WarmupPolicy.LINEAR, max_iters=10, value=0.1)], lr=None)
    return cbopt.Accumulate(warm, every=3)


def dcp_save_and_load(model, opt, path: str, load: bool, flat: bool = False) -> None:
    """torch's recipe: `get_state_dict` (keyed by the model's names), then `dcp.save` to `path`; or `dcp.load` from
    `path` into that state_dict, then `set_state_dict`. `flat`: with `flatten_optimizer_state_dict=True` (torchtitan's)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    msd, osd = get_state_dict(model, opt, options=options)
    sd = {'model': msd, 'optim': osd}
    if not load: return dcp.save(sd, checkpoint_id=path)
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=options)


def perturbed_model(lowbit: str | None = None) -> nn.Module:
    """`make_model()` (`lowbit_model()` where `lowbit` is a precision) with other values: a load that left a param or its
    state as it was would show."""
    model = lowbit_model() if lowbit else make_model()
    with torch.no_grad():
        for p in model.parameters(): p.mul_(-2).add_(0.5)
    return model


def wrapped(kind: str, model: nn.Module) -> nn.Module:
    "`model` under DDP (`'ddp'`) or FSDP2 (`'fsdp'`: each Linear, then the root, as `dist_fsdp.fsdp_model`)."
    if kind == 'ddp':
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model)
    from torch.distributed.fsdp import fully_shard
    for layer in (model[0], model[2]): fully_shard(layer)
    return fully_shard(model)


def whole(sd: dict) -> dict:
    "A named_state_dict with every DTensor gathered into its whole tensor (a collective: every rank calls it)."
    from cbopt.core.dtensor import as_like
    def full(v):
        if not hasattr(v, 'full_tensor'): return v
        if v.dtype == torch.float8_e4m3fn:  # (fp8 codes: gathered as their bytes, gloo has no float8)
            return as_like(v.to_local().view(torch.uint8), v).full_tensor().view(v.dtype)
        return v.full_tensor()
    return {**sd, 'state': {n: {k: full(v) for k, v in s.items()} for n, s in sd['state'].items()}}


def whole_params(model: nn.Module) -> dict:
    "Each param by its name in the unwrapped model, whole (a DTensor gathered)."
    model = getattr(model, 'module', model)
    return {n: (p.full_tensor() if hasattr(p, 'full_tensor') else p).detach().clone() for n, p in model.named_parameters()}


def dcp_save(rank: int, world: int, kind: str, path: str, steps: int, more: int, flat: bool = False,
             lowbit: str | None = None) -> dict:
    """The model under DDP or FSDP2 (`kind`) trains `steps` steps, saves a DCP checkpoint to `path` (each rank its
    share; `flat`: flattened), then trains `more` steps on. `lowbit`: `lowbit_model` with that `state_precision`."""
    model = wrapped(kind, lowbit_model() if lowbit else make_model())
    opt = make_dcp_opt(model, lowbit)
    train(model, opt, steps, rank, world)
    saved = {'params': whole_params(model), 'state': whole(opt.named_state_dict())}
    dcp_save_and_load(model, opt, path, load=False, flat=flat)
    train(model, opt, more, rank, world, start=steps)
    return {**saved, 'final': whole_params(model)}


def dcp_load(rank: int, world: int, kind: str, path: str, steps: int, more: int, lowbit: str | None = None) -> dict:
    """A model of other values under DDP or FSDP2 (`kind`) loads the DCP checkpoint at `path` (saved after `steps`
    steps), then trains `more` steps. `lowbit`: `lowbit_model` with that `state_precision`."""
    model = wrapped(kind, perturbed_model(lowbit))
    opt = make_dcp_opt(model, lowbit)
    dcp_save_and_load(model, opt, path, load=True)
    loaded = {'params': whole_params(model), 'state': whole(opt.named_state_dict())}
    train(model, opt, more, rank, world, start=steps)
    return {**loaded, 'final': whole_params(model)}


def state_bytes_per_rank(rank: int, world: int, shapes) -> dict:
    "The bench's memory part on this rank: the bytes of the state cbopt.Adam holds here under DDP, ZeRO and FSDP2."
    from cbopt.cli.bench.memory import measure_rank
    return measure_rank(shapes)
