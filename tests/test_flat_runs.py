"""The compiled elementwise chain's per-step inputs (`cbopt/engine/compiled.py`: `flat_inputs`, `Pack`): flat aliases
of params and state kept between steps and made again when a tensor is replaced, small params packed into one flat
param, grads never held after a step. Checked against the loop backend over many steps, with params and state
replaced midway as users and checkpoints replace them."""
from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import cbopt
from cbopt.core.chain import zeros
from cbopt.engine import compiled, flat
from cbopt.core.runtime import runtime
from conftest import NO_COMPILE_FALLBACK, assert_tensors_close

pytestmark = NO_COMPILE_FALLBACK

BIG = (130, 130)  # more than PACK_NUMEL elements: stepped alone
SHAPES = [(5,), BIG, (3, 4), (7,), (2, 3, 4), (200, 90), (6,), (9,)]


def rebinding_lion(p, lr, mom, sqr_mom, grad_avg=None, **kwargs):
    "Lion whose average is a new tensor each step (out of place): the rebound entry goes back to each param."
    if grad_avg is None: grad_avg = torch.zeros_like(p.data)
    p.data.add_(grad_avg.mul(mom).add(p.grad, alpha=1 - mom).sign(), alpha=-lr)
    return {'grad_avg': grad_avg * sqr_mom + p.grad * (1 - sqr_mom)}
rebinding_lion.state = dict(grad_avg=zeros)


def _make(kind: str, ps: list, backend) -> cbopt.Optimizer:
    if kind == 'lion': return cbopt.Lion(ps, lr=0.01, wd=0.1, backend=backend)
    return cbopt.Optimizer(ps, [cbopt.weight_decay, rebinding_lion], lr=0.01, wd=0.1, mom=0.9, sqr_mom=0.99,
                           backend=backend)


def _graphs() -> int:
    return torch._dynamo.utils.counters['stats']['unique_graphs']


@pytest.mark.parametrize('kind', ['lion', 'rebinding'])
def test_flat_runs_match_the_loop_as_params_and_state_are_replaced(kind) -> None:
    """12 steps of the fused backend (runs of 4) against the loop, fresh grads every step; after step 4 a big and a
    small param get new memory (`p.data = p.data.clone()`), after step 8 the state is saved and loaded back (new state
    tensors): the kept aliases follow (the params and state equal the loop's), one graph is compiled though the lr
    changes at every step, the small params step packed, an entry updated in place stays the same tensor, and no kept
    alias holds a grad after a step."""
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=g) for s in SHAPES]
    grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(12)]
    torch._dynamo.reset()
    before = _graphs()
    runs = {}
    for backend in (cbopt.Backend('fused', compiler='eager', compile_chunk=4), 'loop'):
        ps = [torch.nn.Parameter(t.clone()) for t in start]
        opt = _make(kind, ps, backend)
        for step, gs in enumerate(grads):
            for p, gr in zip(ps, gs): p.grad = gr.clone()
            opt.set_hyper('lr', 0.01 / (1 + step))
            opt.step()
            if step == 3:
                for i in (1, 3): ps[i].data = ps[i].data.clone()
            if step == 7: opt.load_state_dict(opt.state_dict())
            if step == 9 and kind == 'lion' and backend != 'loop':
                avgs = [opt.state[p]['grad_avg'] for p in ps]
        if backend != 'loop':
            kept = runtime(opt).flat_aliases
            assert _graphs() - before == 1
            (aliases,) = kept.values()
            small = [i for i, s in enumerate(SHAPES) if torch.Size(s).numel() <= flat.PACK_NUMEL]
            assert aliases['pack'].members == small and len(small) == 6
            assert all(v[0].grad is None for k, v in aliases.items() if k != 'pack')
            assert aliases['pack'].param.grad is None
            if kind == 'lion': assert all(opt.state[p]['grad_avg'] is a for p, a in zip(ps, avgs))
            else:  # each param its own rebound entry, of its shape, in memory of its own
                ptrs = {opt.state[p]['grad_avg'].untyped_storage().data_ptr() for p in ps}
                assert len(ptrs) == len(ps)
                assert [tuple(opt.state[p]['grad_avg'].shape) for p in ps] == SHAPES
        runs[backend if backend == 'loop' else 'fused'] = ps, opt
    (fused, f_opt), (loop, l_opt) = runs['fused'], runs['loop']
    for a, b in zip(fused, loop):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * b.abs().max().item())
        torch.testing.assert_close(f_opt.state[a]['grad_avg'], l_opt.state[b]['grad_avg'], rtol=1e-6,
                                   atol=1e-6 * l_opt.state[b]['grad_avg'].abs().max().item())


def test_a_step_holds_no_grad_and_a_replaced_param_is_let_go() -> None:
    """After a fused step and `p.grad = None` (zero_grad), the grads' memory is freed: the step's flat aliases of them
    are dropped. The aliases of params and state are kept from step to step (not made again), but a param given new
    memory has its old memory freed at the next step (its kept alias is made again)."""
    ps = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = cbopt.Lion(ps, lr=0.01, backend=cbopt.Backend('fused', compiler='eager', compile_chunk=4))
    kept = []
    for _ in range(3):
        for p in ps: p.grad = torch.randn_like(p)
        opt.step()
        (aliases,) = runtime(opt).flat_aliases.values() or [{}]  # (none at the first step: it runs eagerly)
        kept.append({k: (v[0], dict(v[1])) for k, v in aliases.items() if k != 'pack'})
    assert kept[1].keys() == kept[2].keys() == {id(p) for p in ps}
    for k, (q, st) in kept[2].items():
        assert q is kept[1][k][0] and all(v is kept[1][k][1][n] for n, v in st.items())
    del kept, aliases  # (they hold the memory)
    grads = [StorageWeakRef(p.grad.untyped_storage()) for p in ps]
    opt.zero_grad(set_to_none=True)
    assert all(w.expired() for w in grads)
    old = StorageWeakRef(ps[1].untyped_storage())
    ps[1].data = ps[1].data.clone()
    for p in ps: p.grad = torch.randn_like(p)
    before = ps[1].detach().clone()
    opt.step()
    assert old.expired() and not torch.equal(ps[1], before)  # stepped in its new memory


@pytest.mark.parametrize('kind', ['nadam', 'schedule_free_sgd'])
def test_small_params_with_a_0d_state_entry_step_packed(kind) -> None:
    """NAdam's `mu_product` and schedule-free's `weight_sum` and `lr_max`, a 0-d tensor per param: the small params
    step packed while each such entry holds one value for all of them (the pack's own 0-d entry, its result copied
    back to each), and apart once one param's differs (step 6 on: NAdam's `mu_product` halved, schedule-free's
    `lr_max` raised, for one small param); 12 steps against the loop, params and state."""
    g = torch.Generator().manual_seed(1)
    start = [torch.randn(s, generator=g) for s in SHAPES]
    grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(12)]
    small = [i for i, s in enumerate(SHAPES) if torch.Size(s).numel() <= flat.PACK_NUMEL]
    key = 'mu_product' if kind == 'nadam' else 'lr_max'
    runs = {}
    for backend in (cbopt.Backend('fused', compiler='eager', compile_chunk=4), 'loop'):
        ps = [torch.nn.Parameter(t.clone()) for t in start]
        opt = (cbopt.NAdam(ps, lr=0.01, backend=backend) if kind == 'nadam' else
               cbopt.ScheduleFreeSGD(ps, lr=0.5, warmup_steps=3, backend=backend).train())
        packs = []
        for step, gs in enumerate(grads):
            for p, gr in zip(ps, gs): p.grad = gr.clone()
            if step == 6: opt.state[ps[small[1]]][key].mul_(0.5 if kind == 'nadam' else 4.)
            opt.step()
            if backend != 'loop': packs.append([a.get('pack') for a in runtime(opt).flat_aliases.values()])
        if backend != 'loop':  # (step 0 runs eagerly, creating the state; 1 to 5 packed, 6 on apart)
            assert all(len(pk) == 1 and pk[0] is not None and pk[0].members == small for pk in packs[1:6])
            assert all(pk == [None] for pk in packs[6:])
        runs[backend if backend == 'loop' else 'fused'] = ps, opt
    (fused, f_opt), (loop, l_opt) = runs['fused'], runs['loop']
    for a, b in zip(fused, loop):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * b.abs().max().item())
        for k, v in l_opt.state[b].items():
            if isinstance(v, torch.Tensor):
                assert f_opt.state[a][k].shape == v.shape, k
                torch.testing.assert_close(f_opt.state[a][k], v, rtol=1e-6, atol=1e-6 * v.abs().max().item())
            else: assert f_opt.state[a][k] == v, k


def test_flat_inputs_are_kept_while_the_plan_and_the_memory_hold() -> None:
    """The flat inputs of a bucket (aliases, pack) are kept in its plan and used again at each step while its params
    and their param-shaped state keep their memory; a state entry replaced in its dict (the plan still holds: same
    dict, keys and metadata) or a param given new memory makes them again. 10 steps against the loop."""
    g = torch.Generator().manual_seed(3)
    start = [torch.randn(s, generator=g) for s in SHAPES]
    grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(10)]
    runs, kept = {}, []
    for backend in (cbopt.Backend('fused', compiler='eager', compile_chunk=4), 'loop'):
        ps = [torch.nn.Parameter(t.clone()) for t in start]
        opt = cbopt.Lion(ps, lr=0.01, wd=0.1, backend=backend)
        for step, gs in enumerate(grads):
            for p, gr in zip(ps, gs): p.grad = gr.clone()
            if step == 4: opt.state[ps[5]]['grad_avg'] = opt.state[ps[5]]['grad_avg'].clone()  # a big param's
            if step == 7: ps[0].data = ps[0].data.clone()  # a packed param
            opt.step()
            if backend != 'loop': kept.append(runtime(opt).bucket_plan.buckets[0].known['flat_inputs'] if step else None)
        runs[backend if backend == 'loop' else 'fused'] = ps, opt
    assert [kept[i] is kept[i - 1] for i in range(2, 10)] == [True, True, False, True, True, False, True, True]
    (fused, f_opt), (loop, l_opt) = runs['fused'], runs['loop']
    for a, b in zip(fused, loop):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * b.abs().max().item())
        torch.testing.assert_close(f_opt.state[a]['grad_avg'], l_opt.state[b]['grad_avg'], rtol=1e-6,
                                   atol=1e-6 * l_opt.state[b]['grad_avg'].abs().max().item())


def test_a_decay_from_zero_is_one_graph_for_every_wd() -> None:
    """The decay callbacks (`l2_reg`, `weight_decay`, `proximal_decay`) with wd = 0 still run under torch.compile (a
    multiply by 1, free in the fused loop; `decays`): dynamo traces the chain once (no restart of its analysis on a
    float specialised to 0: one AOT trace), and a schedule that makes wd nonzero at step 4 does not recompile. 8
    steps, equal to the loop's, which skips the decays while wd is 0."""
    chain = [cbopt.l2_reg, cbopt.weight_decay, cbopt.lion_step, cbopt.lion_avg, cbopt.proximal_decay]
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=g) for s in SHAPES]
    grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(8)]
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    finals = {}
    for backend in (cbopt.Backend('fused', compiler='aot_eager', compile_chunk=4), 'loop'):
        ps = [torch.nn.Parameter(t.clone()) for t in start]
        opt = cbopt.Optimizer(ps, chain, lr=0.01, wd=0., backend=backend)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for step, gs in enumerate(grads):
                for p, gr in zip(ps, gs): p.grad = gr.clone()
                if step == 4: opt.set_hyper('wd', 0.1)
                opt.step()
        finals[str(backend)] = ps
    assert counters['stats']['unique_graphs'] == 1 and counters['aot_autograd']['total'] == 1
    fused, loop = finals.values()
    assert_tensors_close(fused, loop, rtol=1e-6)
    assert not any(torch.equal(p, q) for p, q in zip(loop, start))
