"""The compiled elementwise chain's per-step inputs (`cbopt/engine/compiled.py`: `flat_inputs`, `Pack`): flat aliases
of params and state kept between steps and made again when a tensor is replaced, small params packed into one flat
param, grads never held after a step. Checked against the loop backend over many steps, with params and state
replaced midway as users and checkpoints replace them."""
from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import cbopt
from cbopt.core.chain import per_tensor, zeros
from cbopt.core.runtime import runtime
from cbopt.engine import buckets as bucketing
from cbopt.engine import flat
from cbopt.engine.flat import PAD_NUMEL, can_flatten, flat_chunks, padding, shape_chunks
from conftest import assert_tensors_close, EAGER, NO_COMPILE_FALLBACK, params_and_grads

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


def assert_fused_follows_loop(runs: dict) -> None:
    "`runs['fused']` and `runs['loop']` (params, optimizer) agree to 1e-6 of each tensor's largest value: params, `grad_avg`."
    (fused, f_opt), (loop, l_opt) = runs['fused'], runs['loop']
    for a, b in zip(fused, loop):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * b.abs().max().item())
        torch.testing.assert_close(f_opt.state[a]['grad_avg'], l_opt.state[b]['grad_avg'], rtol=1e-6,
                                   atol=1e-6 * l_opt.state[b]['grad_avg'].abs().max().item())


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
    assert_fused_follows_loop(runs)


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
    `lr_max` raised, for one small param), each param-shaped entry then in memory of its own; 12 steps against the
    loop, params and state."""
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
            for i in small:  # apart: the dropped pack's adopted entries got memory of their own (`Pack.release`)
                assert all(v.untyped_storage().nbytes() == v.numel() * v.element_size()
                           for v in opt.state[ps[i]].values() if isinstance(v, torch.Tensor) and v.ndim)
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
    assert_fused_follows_loop(runs)


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


SMALL_AND_LARGE = [(130, 130), (5,), (3, 4), (7,), (2, 2, 2), (1,), (6,)]  # one param above PACK_NUMEL, six packed


def _rebinding_sgd(p, lr, mom, grad_avg=None, n=None, **kwargs):
    """SGD with momentum and lr / n at the n-th step, its average and its count (a 0-d tensor per param) new tensors at
    every step (out of place), as a user's callback may make them."""
    if grad_avg is None: grad_avg, n = torch.zeros_like(p.data), per_tensor(lambda q: q.new_zeros(()), p.data)
    grad_avg, n = grad_avg * mom + p.grad.data, n + 1
    p.data.add_(grad_avg / n, alpha=-lr)
    return {'grad_avg': grad_avg, 'n': n}
_rebinding_sgd.state = dict(grad_avg=zeros, n=lambda p: p.new_zeros(()))


def _spreading_count(p, n=None, count_steps=0, **kwargs):
    "A 0-d count per param that becomes param-shaped at its second step: a count per element from then on."
    if n is None: n = per_tensor(lambda q: q.new_zeros(()), p.data)
    return {'n': p.grad.data * 0 + n + 1 if count_steps else n + 1, 'count_steps': count_steps + 1}
_spreading_count.state = dict(n=lambda p: p.new_zeros(()), count_steps=0)


def test_shape_chunks() -> None:
    """Same-shape params in chunks of at most `chunk`, preferring a size from chunk/2 to chunk that divides their
    count: 1000 params with chunk 32 go in 40 chunks of 25; 7 (no divisor in 2..4) in 4 + 3; 2 in one chunk of 2."""
    chunks = shape_chunks([(3,)] * 1000, 32)
    assert [len(c) for c in chunks] == [25] * 40 and [i for c in chunks for i in c] == list(range(1000))
    shapes = [(3,), (2, 2), (3,), (3,), (3,), (2, 2), (3,), (3,), (3,)]
    assert shape_chunks(shapes, 4) == [[0, 2, 3, 4], [6, 7, 8], [1, 5]]
    assert shape_chunks([(5,)] * 6, 4) == [[0, 1, 2], [3, 4, 5]]     # 3 divides 6: no remainder chunk
    assert shape_chunks([(5,)] * 8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_flat_chunks() -> None:
    "Flat params go in runs of `chunk` in their order, the last one shorter: GPT-2's 148 params in 18 x 8 + 4."
    assert [len(c) for c in flat_chunks(148, 8)] == [8] * 18 + [4]
    assert [i for c in flat_chunks(148, 8) for i in c] == list(range(148))
    assert flat_chunks(3, 32) == [[0, 1, 2]] and flat_chunks(4, 2) == [[0, 1], [2, 3]]


def test_padding_is_scratch_of_the_same_kinds() -> None:
    """A short run's padding: fresh zeros of `PAD_NUMEL` elements for the param, its grad and its param-shaped state
    (a bfloat16 state stays one), and a copy of any other state tensor, so that nothing the chain does to them reaches the
    params it pads for."""
    p = torch.arange(6, dtype=torch.float64)
    p.grad = torch.ones(6, dtype=torch.float64)
    state = {'avg': torch.full((6,), 3., dtype=torch.bfloat16), 'count': torch.tensor(5)}
    params, states = padding(p, state, 2)
    assert len(params) == len(states) == 2 and params[0] is not params[1] and states[0]['count'] is not states[1]['count']
    for q, st in zip(params, states):
        assert q.shape == q.grad.shape == st['avg'].shape == (PAD_NUMEL,) and not q.any() and not q.grad.any()
        assert (q.dtype, q.grad.dtype, st['avg'].dtype) == (torch.float64, torch.float64, torch.bfloat16)
        assert st['count'] is not state['count'] and st['count'].item() == 5
        st['count'].add_(1)
    assert state['count'].item() == 5


def test_a_packed_chain_that_rebinds_its_state_gives_each_param_its_own() -> None:
    """A chain that makes its state anew at each step (a param-shaped average; a 0-d count, one value for all, which
    goes with the pack), on packed small params: each param gets its own part of the packed results, of its shape and
    in memory of its own, as torch's SGD with momentum computes them (lr / n at step n)."""
    start, grads = params_and_grads(SMALL_AND_LARGE, 4, seed=1)
    ps = [torch.nn.Parameter(t.clone()) for t in start]
    qs = [torch.nn.Parameter(t.clone()) for t in start]
    opt = cbopt.Optimizer(ps, [_rebinding_sgd], lr=0.1, mom=0.9, backend=EAGER)
    ref = torch.optim.SGD(qs, lr=0.1, momentum=0.9)
    for i, gs in enumerate(grads):
        for p, q, gr in zip(ps, qs, gs): p.grad, q.grad = gr.clone(), gr.clone()
        ref.param_groups[0]['lr'] = 0.1 / (i + 1)
        opt.step()
        ref.step()
        assert_tensors_close(ps, qs, msg=f'step {i}')
    (kept,) = cbopt.core.runtime.runtime(opt).flat_aliases.values()
    assert sorted(kept['pack'].members) == [1, 2, 3, 4, 5, 6]
    assert_tensors_close([opt.state[p]['grad_avg'] for p in ps], [ref.state[q]['momentum_buffer'] for q in qs])
    assert all(torch.equal(opt.state[p]['n'], torch.tensor(4.)) for p in ps)
    for key in ('grad_avg', 'n'): assert len({opt.state[p][key].data_ptr() for p in ps}) == len(ps), key


def test_a_shared_0d_entry_made_param_shaped_is_each_params_own_part() -> None:
    """A 0-d state entry of packed small params (one value for all: it goes with the pack) that the chain rebinds to a
    param-shaped tensor: each param gets its own part, of its own shape, as it would stepped alone."""
    ps = [torch.nn.Parameter(torch.zeros(s)) for s in SMALL_AND_LARGE]
    opt = cbopt.Optimizer(ps, [_spreading_count, cbopt.sgd_step], lr=0.1, backend=EAGER)
    for _ in range(3):
        for p in ps: p.grad = torch.ones_like(p)
        opt.step()
    for p in ps: assert torch.equal(opt.state[p]['n'], torch.full(p.shape, 3.)), p.shape


def test_pack_fits_only_the_same_params_sizes_keys_and_dtypes() -> None:
    "A kept `Pack` serves a step only if the small params are the same ones, of the same sizes, state keys and dtypes."
    qs = [torch.zeros(3), torch.zeros(2)]
    ts = [{'a': torch.zeros(3), 'n': torch.zeros(())}, {'a': torch.zeros(2), 'n': torch.zeros(())}]
    pack = flat.Pack([0, 2], qs, ts, ('n',))
    assert pack.fits([0, 2], qs, ts, ('n',))
    assert not pack.fits([0, 1], qs, ts, ('n',))                                   # other params
    assert not pack.fits([0, 2], [torch.zeros(2), torch.zeros(3)], ts, ('n',))      # other sizes
    assert not pack.fits([0, 2], qs, ts, ())                                       # 'n' no longer shared
    assert not pack.fits([0, 2], qs, [{'b': t['a'], 'n': t['n']} for t in ts], ('n',))  # other keys
    assert not pack.fits([0, 2], qs, [ts[0], {'a': torch.zeros(2, dtype=torch.float64), 'n': ts[1]['n']}], ('n',))


def test_a_bucket_that_cannot_be_flattened_steps_by_shape() -> None:
    """Compiled steps of a bucket with a transposed (not contiguous) grad, which cannot step as flat aliases: by
    shape, as torch's Adamax."""
    shapes = [(4, 3), (4, 3), (5,)]
    start, grads = params_and_grads(shapes, 3, seed=2)
    ps = [torch.nn.Parameter(t.clone()) for t in start]
    qs = [torch.nn.Parameter(t.clone()) for t in start]
    opt, ref = cbopt.Adamax(ps, lr=0.01, backend=EAGER), torch.optim.Adamax(qs, lr=0.01)
    for gs in grads:
        for p, q, gr in zip(ps, qs, gs): p.grad, q.grad = gr.clone(), gr.clone()
        ps[0].grad = gs[0].t().contiguous().t()  # (3, 4) memory seen as (4, 3)
        assert not can_flatten(bucketing.buckets(opt)[0])
        opt.step()
        ref.step()
        assert_tensors_close(ps, qs)
    assert_tensors_close([opt.state[p]['inf_norm'] for p in ps], [ref.state[q]['exp_inf'] for q in qs])


@pytest.mark.parametrize('small', [0, 1, 2])
def test_flat_runs_with_no_one_or_two_small_params(small) -> None:
    """The compiled chain's flat inputs over buckets of large params with 0, 1 or 2 small ones: small params are packed
    only when there are two or more (one alone gains nothing from a pack), and every case steps as the loop over 4
    steps (Lion)."""
    shapes = [(130, 130), (129, 131)] + [(3,), (2, 2)][:small]
    start, grads = params_and_grads(shapes, 4, seed=3)
    ps, qs = [torch.nn.Parameter(t.clone()) for t in start], [torch.nn.Parameter(t.clone()) for t in start]
    opt, ref = (cbopt.Lion(xs, lr=0.1, wd=0.1, backend=b) for xs, b in ((ps, EAGER), (qs, 'loop')))
    for i, gs in enumerate(grads):
        for p, q, gr in zip(ps, qs, gs): p.grad, q.grad = gr.clone(), gr.clone()
        opt.step(), ref.step()
        assert_tensors_close(ps, qs, msg=f'step {i}')
    (kept,) = cbopt.core.runtime.runtime(opt).flat_aliases.values()
    assert (sorted(kept['pack'].members) if 'pack' in kept else None) == ([2, 3] if small == 2 else None)


def test_each_bucket_keeps_its_own_flat_aliases() -> None:
    """Two buckets (two groups) keep their flat aliases apart, each under its own layout: one bucket's step does not
    drop the other's, which would make them again at every step."""
    start, grads = params_and_grads([(4, 3), (5,), (6,), (2, 3)], 3, seed=4)
    ps = [torch.nn.Parameter(t.clone()) for t in start]
    opt = cbopt.Lion([{'params': ps[:2]}, {'params': ps[2:], 'lr': 0.01}], lr=0.1, backend=EAGER)
    for gs in grads:
        for p, gr in zip(ps, gs): p.grad = gr.clone()
        opt.step()
    kept = cbopt.core.runtime.runtime(opt).flat_aliases
    assert len(kept) == 2
    assert sorted(sorted(k for k in v if k != 'pack') for v in kept.values()) == sorted([sorted(map(id, ps[:2])),
                                                                                        sorted(map(id, ps[2:]))])


def test_steady_packed_steps_read_no_shared_value(monkeypatch) -> None:
    """The shared 0-d entries of packed small params (NAdam's `mu_product`) are read (`_one_value`: on a GPU a wait for
    it) when the pack is made and after something wrote them since its last step, never on a steady step."""
    reads = []
    real = flat._one_value
    monkeypatch.setattr(flat, '_one_value', lambda ts: reads.append(len(ts)) or real(ts))
    g = torch.Generator().manual_seed(1)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    opt = cbopt.NAdam(ps, lr=0.01, backend=cbopt.Backend('fused', compiler='eager', compile_chunk=4))
    per_step = []
    for step in range(6):
        for p in ps: p.grad = torch.randn(p.shape, generator=g)
        if step == 4: opt.state[ps[0]]['mu_product'].mul_(1.)  # (written: read again, though the value is the same)
        reads.clear()
        opt.step()
        per_step.append(len(reads))
    assert per_step[1] > 0 and per_step[2] == per_step[3] == per_step[5] == 0 and per_step[4] > 0, per_step


def test_packed_state_lives_in_the_pack_and_follows_every_change() -> None:
    """The small params' state lives in their pack's buffer after the first packed step (each entry its part of it:
    a steady step copies nothing into or out of it, only the params' and grads' buffers), and stays right through
    what users and checkpoints do between steps: an entry written in place, one entry replaced by a new tensor, a
    state saved and loaded (new tensors), a small param that skips a step (another layout), one made big (other
    small params: a new pack, the old one's buffer freed). 12 steps against the loop, params and state."""
    start, grads = params_and_grads(SHAPES, 12, seed=3)
    big = torch.randn(BIG, generator=torch.Generator().manual_seed(4))
    small = [i for i, s in enumerate(SHAPES) if torch.Size(s).numel() <= flat.PACK_NUMEL]
    m = small[3]  # (made big at step 9)
    runs = {}
    for backend in (cbopt.Backend('fused', compiler='eager', compile_chunk=4), 'loop'):
        ps = [torch.nn.Parameter(t.clone()) for t in start]
        opt = cbopt.Lion(ps, lr=0.01, wd=0.1, backend=backend)
        fused = backend != 'loop'
        for step, gs in enumerate(grads):
            if step == 9:
                ps[m].data, opt.state[ps[m]]['grad_avg'] = big.clone(), big.cos()
                if fused:
                    old = runtime(opt).flat_aliases[bucketing.buckets(opt)[0].layout]['pack'].state['grad_avg']
                    old = StorageWeakRef(old.untyped_storage())
            for p, gr in zip(ps, gs): p.grad = gr.clone() if p.shape == gr.shape else big.sin() * step
            if step == 6: ps[small[1]].grad = None  # (skips a step: another bucket layout, its own pack)
            spied = step == 3 and fused  # (a steady step: the layout packed at step 1, its entries adopted)
            if spied:
                pack = runtime(opt).flat_aliases[bucketing.buckets(opt)[0].layout]['pack']
                buf = pack.state['grad_avg'].untyped_storage().data_ptr()
                assert all(opt.state[ps[i]]['grad_avg'].untyped_storage().data_ptr() == buf for i in small)
                del pack
                calls, real_cat, real_copy = [], torch.cat, torch._foreach_copy_
                def cat(ts, *a, out=None, **k): calls.append(out); return real_cat(ts, *a, out=out, **k)
                def copy(dst, src): calls.append(src[0]); return real_copy(dst, src)
                torch.cat, torch._foreach_copy_ = cat, copy
            try: opt.step()
            finally:
                if spied: torch.cat, torch._foreach_copy_ = real_cat, real_copy
            if spied:  # the params' buffer filled and copied back, nothing of the state's
                assert len(calls) == 2 and not any(t.untyped_storage().data_ptr() == buf for t in calls), calls
            if step == 3: opt.state[ps[small[0]]]['grad_avg'].mul_(0.5)  # in place: into the pack's buffer
            if step == 4: opt.state[ps[small[2]]]['grad_avg'] = opt.state[ps[small[2]]]['grad_avg'] * 2  # replaced
            if step == 7: opt.load_state_dict(opt.state_dict())
            if step == 9 and fused: assert old.expired()  # (no entry holds the dropped pack's buffer)
        runs[backend if backend == 'loop' else 'fused'] = ps, opt
    assert_fused_follows_loop(runs)
