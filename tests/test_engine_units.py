"""The engine's parts on their own (issue #14, mutation testing of `cbopt/engine/`), with hand-worked expectations:
backend settings, how CPU buckets are cut into cache-sized and same-shape chunks, the scalar-to-tensor rewrite the
compiled chain runs under (checked eagerly, against the plain ops), the per-step stats, and the whole-model
callbacks' contract errors. `test_backends.py` checks the backends against the loop over many steps."""
from __future__ import annotations

import warnings

import pytest
import torch

import cbopt
from cbopt.core.chain import per_tensor, zeros
from cbopt.engine import Backend, as_backend
from cbopt.engine import buckets as bucketing
from cbopt.engine import compiled
from cbopt.engine import flat, scalars
from cbopt.engine.flat import PAD_NUMEL, can_flatten, flat_chunks, padding, shape_chunks
from cbopt.engine.scalars import ScalarArgsAsTensors
from cbopt.core.runtime import warn_once
from conftest import NO_COMPILE_FALLBACK, assert_tensors_close

pytestmark = NO_COMPILE_FALLBACK


# -- Backend -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('field', ['compile_chunk', 'cpu_chunk_bytes', 'auto_trials'])
@pytest.mark.parametrize('bad', [0, -1, True, 1.5, '4'])
def test_backend_settings_are_positive_ints(field, bad) -> None:
    with pytest.raises(ValueError, match=rf"^Backend\.{field} must be a positive int, got {bad!r}$"):
        Backend('foreach', **{field: bad})
    assert getattr(Backend('foreach', **{field: 1}), field) == 1


def test_backend_kind_and_as_backend() -> None:
    with pytest.raises(ValueError, match=r"^unknown backend 'fast': expected one of \('auto', 'loop', 'foreach', 'fused'\)$"):
        Backend('fast')
    mine = Backend('foreach', compile_chunk=7, cpu_chunk_bytes=3, auto_trials=5)
    assert as_backend('loop', mine) == Backend('loop', compile_chunk=7, cpu_chunk_bytes=3, auto_trials=5)
    assert as_backend('fused') == Backend('fused')
    assert as_backend(mine, Backend()) is mine
    with pytest.raises(TypeError, match=r"^backend must be a str or a cbopt\.Backend, not int$"): as_backend(3)
    assert (Backend().kind, Backend().compiler, Backend().auto_trials) == ('auto', 'inductor', 2)


# -- cutting buckets ---------------------------------------------------------------------------------------------
def _bucket(*numels: int, dtype=torch.float32) -> bucketing.Bucket:
    ps = [torch.zeros(n, dtype=dtype) for n in numels]
    return bucketing.Bucket({}, ps, [{} for _ in ps])


def test_cache_chunks_by_bytes() -> None:
    """float32 params of 10, 10, 30, 5 and 20 elements (40, 40, 120, 20, 80 bytes) with 100-byte chunks: 40+40 fit,
    the 120-byte param goes alone (it is larger than a chunk), then 20+80 exactly fills one."""
    b = _bucket(10, 10, 30, 5, 20)
    chunks = bucketing.cache_chunks(b, 100)
    assert [[p.numel() for p in c.params] for c in chunks] == [[10, 10], [30], [5, 20]]
    assert all(c.states == b.states[i:i + len(c.params)] for c, i in zip(chunks, (0, 2, 3)))
    assert all(c.group is b.group for c in chunks)
    big = _bucket(30, 10)                            # a first param larger than a chunk: alone, no empty chunk before it
    assert [[p.numel() for p in c.params] for c in bucketing.cache_chunks(big, 100)] == [[30], [10]]
    exact = _bucket(10, 15, 1)                       # 40 + 60 bytes fill the first chunk exactly
    assert [[p.numel() for p in c.params] for c in bucketing.cache_chunks(exact, 100)] == [[10, 15], [1]]
    whole = bucketing.cache_chunks(b, 1 << 20)
    assert len(whole) == 1 and whole[0].params == b.params


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


def _graphs() -> int:
    from torch._dynamo.utils import counters
    return counters['stats']['unique_graphs']


def counted_lion(p, lr, mom, sqr_mom, grad_avg=None, count=None, **kwargs):
    "Lion's step and average, and a per-param 0-d tensor counting this param's steps, which scales its lr."
    if grad_avg is None: grad_avg, count = torch.zeros_like(p.data), per_tensor(lambda q: q.new_zeros(()), p.data)
    count.add_(1)
    p.data.add_(grad_avg.mul(mom).add_(p.grad.data, alpha=1 - mom).sign_().mul_(count), alpha=-lr)
    grad_avg.mul_(sqr_mom).add_(p.grad.data, alpha=1 - sqr_mom)
    return {'grad_avg': grad_avg, 'count': count}
counted_lion.state = dict(grad_avg=zeros, count=lambda p: p.new_zeros(()))


@pytest.mark.parametrize('chain', ['lion', 'counted_lion'])
def test_an_elementwise_chain_compiles_one_graph(chain) -> None:
    """An elementwise chain (cbopt.Lion; a user's Lion with a 0-d tensor state per param) over 10 params of ranks 1 to
    4 and many sizes, in runs of 4: flat params, the last run (2 params) padded to 4, so one graph whatever the shapes,
    over 4 steps; the same params and state as the loop, and the state keeps each param's shape. A transposed grad (not
    contiguous: no flat alias) steps by shape instead."""
    shapes = [(5,), (3, 4), (7,), (2, 3, 4), (4, 3), (6,), (2, 2, 2, 2), (9,), (5, 5), (3,)]
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(4)]
    def run(backend):
        ps = [torch.nn.Parameter(t.clone()) for t in start]
        opt = (cbopt.Lion(ps, lr=0.1, wd=0.1, backend=backend) if chain == 'lion' else
               cbopt.Optimizer(ps, [cbopt.weight_decay, counted_lion], lr=0.1, wd=0.1, mom=0.9, sqr_mom=0.99,
                               backend=backend))
        for gs in grads:
            for p, gr in zip(ps, gs): p.grad = gr.clone()
            opt.step()
        return ps, opt
    torch._dynamo.reset()
    before = _graphs()
    fused, opt = run(cbopt.Backend('fused', compiler='eager', compile_chunk=4))
    assert _graphs() - before == 1
    loop, loop_opt = run('loop')
    for a, b in zip(fused, loop): torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(fused, loop): torch.testing.assert_close(opt.state[a], loop_opt.state[b], rtol=1e-6, atol=1e-7)
    assert [tuple(opt.state[p]['grad_avg'].shape) for p in fused] == shapes
    if chain == 'counted_lion': assert all(opt.state[p]['count'].item() == 4 for p in fused)
    bucket = bucketing.buckets(opt)[0]
    assert can_flatten(bucket)
    fused[1].grad = torch.randn(4, 3, generator=g).t()
    assert not can_flatten(bucketing.buckets(opt)[0])
    assert not can_flatten(bucketing.buckets(cbopt.Adafactor(fused, lr=0.1))[0])  # a tensor-scope chain keeps shapes


def test_python_state_that_cannot_be_hashed_gets_a_bucket_per_param() -> None:
    ps = [torch.zeros(2, requires_grad=True) for _ in range(3)]
    opt = cbopt.Optimizer(ps, [cbopt.sgd_step], lr=0.1)
    for p in ps: p.grad = torch.ones(2)
    assert [b.params for b in bucketing.buckets(opt)] == [ps]
    opt.state[ps[0]]['tag'] = ['a']  # a list: no key can hold it
    opt.state[ps[1]]['tag'] = ['a']
    opt.state[ps[2]]['tag'] = 'a'
    assert [b.params for b in bucketing.buckets(opt)] == [[ps[0]], [ps[1]], [ps[2]]]


# -- the compiled chain's rewrite of Python numbers --------------------------------------------------------------
@pytest.mark.parametrize('scalars_once', [False, True])
def test_scalar_args_as_tensors_computes_the_same(scalars_once, monkeypatch) -> None:
    """Under the mode, `alpha=`, `value=`, a number `lerp` weight and clamp bounds become tensor ops: the values are
    those of the plain ops, and the in-place ops still write into their tensor and return it; with `scalars_once`
    (the compiled chain's), numbers and 0-d tensors that arithmetic on a tensor reads pass through `cbopt::scalar`."""
    g = torch.Generator().manual_seed(0)
    x, y, z = (torch.randn(5, generator=g, dtype=torch.float64) for _ in range(3))
    lo = torch.full((5,), -0.3, dtype=torch.float64)
    ops = {
        'add': lambda: x.add(y, alpha=0.7), 'sub': lambda: torch.sub(x, y, alpha=-2.),
        'addcmul': lambda: x.addcmul(y, z, value=0.25), 'addcdiv': lambda: torch.addcdiv(x, y, z.abs() + 1, value=-3.),
        'lerp': lambda: x.lerp(y, 0.3), 'torch.lerp': lambda: torch.lerp(x, y, 0.6), 'lerp-tensor': lambda: x.lerp(y, z),
        'clamp': lambda: x.clamp(-0.2, 0.5), 'clamp-min': lambda: torch.clamp(x, min=-0.1), 'clip-max': lambda: x.clip(max=0.1),
        'clamp-tensor': lambda: x.clamp(min=lo), 'mul': lambda: x.mul(2.5),
        'scalar-math': lambda: (x * (0.9 ** 3) / (1 - torch.tensor(0.3, dtype=torch.float64))).sub(y, alpha=1 / 7),
        'rsub': lambda: 1. - x / torch.tensor(3., dtype=torch.float64),
    }
    barriers, real = [], scalars.scalar
    monkeypatch.setattr(scalars, 'scalar', lambda v: barriers.append(v) or real(v))
    for name, op in ops.items():
        expected = op()
        with ScalarArgsAsTensors(scalars_once): got = op()
        torch.testing.assert_close(got, expected, rtol=1e-15, atol=0, msg=name)
    for name, op in {'add_': lambda t: t.add_(y, alpha=0.7), 'addcdiv_': lambda t: t.addcdiv_(y, z.abs() + 1, value=2.),
                     'lerp_': lambda t: t.lerp_(y, 0.3), 'clamp_': lambda t: t.clamp_(-0.2, 0.5),
                     'clip_': lambda t: t.clip_(min=0.)}.items():
        expected = op(x.clone())
        t = x.clone()
        with ScalarArgsAsTensors(scalars_once): got = op(t)
        assert got is t, name
        torch.testing.assert_close(t, expected, rtol=1e-15, atol=0, msg=name)
    assert bool(barriers) == scalars_once and all(v.dim() == 0 for v in barriers)
    barriers.clear()
    w = torch.tensor(0.3, dtype=torch.float64)  # any op's 0-d tensor arg, not only arithmetic's (schedule-free's lerp)
    with ScalarArgsAsTensors(scalars_once): got = x.lerp(y, w)
    torch.testing.assert_close(got, x.lerp(y, w), rtol=1e-15, atol=0)
    assert [v is w for v in barriers] == ([True] if scalars_once else [])
    for op, number in ((lambda: x.add(y, alpha=0.7), 0.7), (lambda: torch.sub(x, y, alpha=-2.), -2.),
                       (lambda: x.addcmul(y, z, value=0.25), 0.25), (lambda: torch.addcdiv(x, y, z + 5, value=-3.), -3.)):
        barriers.clear()  # an `alpha=`/`value=` number: once, as a float64 0-d tensor (read at Python's precision)
        with ScalarArgsAsTensors(scalars_once): op()
        assert [(v.item(), v.dtype) for v in barriers] == ([(number, torch.float64)] if scalars_once else [])
    u, v = (torch.randn(1000, generator=g) for _ in range(2))  # a number lerp weight: `u + (v - u) * w`, which a
    for w in (0.3, 0.75):                                      # compile keeps symbolic (torch's lerp: other roundings)
        with ScalarArgsAsTensors(scalars_once): got = (u.lerp(v, w), torch.lerp(u, v, w), u.clone().lerp_(v, w))
        assert all(torch.equal(r, u + (v - u) * w) for r in got), w
    assert not torch.equal(torch.lerp(u, v, 0.75), u + (v - u) * 0.75)  # (so the check above tells them apart)


# -- step stats and whole-model contract ------------------------------------------------------------------------
@pytest.mark.parametrize('backend', ['loop', 'foreach'])
def test_step_stats_name_the_lrs_used(backend) -> None:
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True)
    opt = cbopt.Optimizer([[a], [b]], [cbopt.sgd_step], lr=0.1, backend=backend)
    opt.set_hyper('lr', [0.1, 0.2])
    a.grad, b.grad = torch.ones(2), torch.ones(3)
    opt.step()
    assert opt.step_stats == {'lr': [0.1, 0.2], 'skipped': False}
    assert torch.equal(a, torch.full((2,), -0.1)) and torch.equal(b, torch.full((3,), -0.2))


def _model_cb(ret: dict, name: str):
    def cb(params, **kwargs): return ret
    cb.__name__ = cb.__qualname__ = name
    cb.scope, cb.state, cb.transient = 'model', {}, ()
    return cb


def test_whole_model_callback_hypers_per_group() -> None:
    "A callback before the chain may set its groups' hypers for this step (one dict per group); the groups keep theirs."
    a, b = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
    half = _model_cb({'hypers': [{'lr': 0.05}, {'lr': 0.5}]}, 'half')
    opt = cbopt.Optimizer([[a], [b]], [half, cbopt.sgd_step], lr=0.1)
    a.grad, b.grad = torch.ones(1), torch.ones(1)
    opt.step()
    assert (a.item(), b.item()) == pytest.approx((-0.05, -0.5)) and opt.step_stats['lr'] == [0.05, 0.5]
    assert [g['lr'] for g in opt.param_groups] == [0.1, 0.1]
    wrong = _model_cb({'hypers': [{'lr': 0.05}]}, 'wrong')
    opt = cbopt.Optimizer([[a], [b]], [wrong, cbopt.sgd_step], lr=0.1)
    with pytest.raises(ValueError, match="^whole-model callback 'wrong' returned hypers for 1 groups, not 2$"): opt.step()
    assert (a.item(), b.item()) == pytest.approx((-0.05, -0.5))


@pytest.mark.parametrize('ret', [{'skip': True}, {'hypers': [{'lr': 1.}]}])
def test_callbacks_after_the_chain_cannot_skip_or_set_hypers(ret) -> None:
    p = torch.zeros(1, requires_grad=True)
    late = _model_cb(ret, 'late')
    opt = cbopt.Optimizer([p], [cbopt.sgd_step, late], lr=0.1)
    p.grad = torch.ones(1)
    with pytest.raises(ValueError, match="^whole-model callback 'late' runs after the per-param chain: it cannot skip"):
        opt.step()


def test_warn_once_per_key() -> None:
    opt = cbopt.SGD([torch.zeros(1, requires_grad=True)])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for _ in range(3): warn_once(opt, 'a', 'first')
        warn_once(opt, 'b', 'second')
        warn_once(cbopt.SGD([torch.zeros(1, requires_grad=True)]), 'a', 'other optimizer')
    assert [str(x.message) for x in w] == ['first', 'second', 'other optimizer']
    assert all(x.filename == __file__ for x in w)  # at the caller's line, not inside cbopt


# -- grads no chain can step: refused before anything changes ---------------------------------------------------
def _opt_with_state(backend: str, clip: bool):
    """Two named params stepped once (so they have state), optionally behind a whole-model callback (another code
    path), after a param that never has a grad (the check goes on past it)."""
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    cbs = [cbopt.clip_grad_norm] * clip + [cbopt.weight_decay, cbopt.average_grad, cbopt.momentum_step]
    opt = cbopt.Optimizer([('frozen', torch.nn.Parameter(torch.ones(4))), ('a', a), ('b', b)], cbs, lr=0.1, mom=0.9, wd=0.1, backend=backend,
                          **({'max_norm': 1.} if clip else {}))
    a.grad, b.grad = torch.ones(2), torch.ones(3)
    opt.step()
    return a, b, opt


@pytest.mark.parametrize('clip', [False, True], ids=['chain', 'whole-model'])
@pytest.mark.parametrize('backend', ['loop', 'foreach'])
@pytest.mark.parametrize('bad, err, msg', [
    (lambda b: setattr(b, 'grad', torch.ones(3).to_sparse()), RuntimeError,
     r"^param 'b' has a sparse gradient, which the chain \[.*momentum_step\] does not support \(densify it with "
     r"grad\.to_dense\(\), or use torch\.optim\.SparseAdam\)$"),
    (lambda b: setattr(b.grad, 'data', torch.ones(1, 3)), RuntimeError,
     r"^param 'b' has shape \(3,\) but its grad has shape \(1, 3\)$"),
    (lambda b: setattr(b.grad, 'data', torch.ones(3, dtype=torch.long)), TypeError,
     r"^param 'b' has dtype torch\.float32 but its grad has dtype torch\.int64$"),
    (lambda b: setattr(b.grad, 'data', torch.ones(3, dtype=torch.complex64)), TypeError,
     r"^param 'b' has dtype torch\.float32 but its grad has dtype torch\.complex64$"),
], ids=['sparse', 'shape', 'int', 'complex'])
def test_a_grad_no_chain_can_step_is_rejected_and_nothing_changes(backend, clip, bad, err, msg) -> None:
    a, b, opt = _opt_with_state(backend, clip)
    a.grad = torch.ones(2)
    bad(b)
    before = ([a.detach().clone(), b.detach().clone()], {k: v.clone() if isinstance(v, torch.Tensor) else v
                                                          for p in (a, b) for k, v in opt.state[p].items()})
    with pytest.raises(err, match=msg): opt.step()
    assert all(torch.equal(x, y) for x, y in zip(before[0], [a, b]))
    after = {k: v for p in (a, b) for k, v in opt.state[p].items()}
    assert after.keys() == before[1].keys() and all(torch.equal(v, after[k]) if isinstance(v, torch.Tensor) else v == after[k]
                                                     for k, v in before[1].items())


@pytest.mark.parametrize('backend', ['loop', 'foreach'])
def test_a_float64_grad_of_a_float32_param_is_stepped(backend) -> None:
    "Another floating dtype is not refused (only another kind is): torch.optim steps it too, casting in its ops."
    p, ref = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt, torch_opt = cbopt.SGD([p], lr=0.1, backend=backend), torch.optim.SGD([ref], lr=0.1)
    for o, q in ((opt, p), (torch_opt, ref)):
        q.grad = torch.ones(3)
        q.grad.data = torch.tensor([1., 2., 3.], dtype=torch.float64)
        o.step()
    torch.testing.assert_close(p.detach(), ref.detach(), rtol=0, atol=0)


# -- params sharded as DTensors, on one rank --------------------------------------------------------------------
def _sharded(mesh, t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import Shard, distribute_tensor
    return distribute_tensor(t, mesh, [Shard(0)])


def test_auto_runs_dtensors_with_foreach_untimed(one_rank_mesh) -> None:
    """On CPU, auto times foreach against loop, but not for DTensors: a choice by timing could differ between ranks.
    The params step as plain ones do."""
    from cbopt.core.runtime import runtime
    w = torch.nn.Parameter(_sharded(one_rank_mesh, torch.arange(4.)))
    plain = torch.nn.Parameter(torch.arange(4.))
    opt, ref = cbopt.RMSProp([w], lr=0.1), cbopt.RMSProp([plain], lr=0.1, backend="loop")  # (no torch kernel)
    for i in range(3):
        w.grad, plain.grad = _sharded(one_rank_mesh, torch.full((4,), i + 1.)), torch.full((4,), i + 1.)
        opt.step()
        ref.step()
    assert runtime(opt).auto_times == {}
    torch.testing.assert_close(w.full_tensor().detach(), plain.detach(), rtol=0, atol=0)


def test_whole_model_buckets_split_dtensor_grads_and_skip_params_without_grad(one_rank_mesh) -> None:
    """A whole-model callback gets one TensorList per (device, dtypes, grad layout): a DTensor grad never shares one
    with a plain grad (foreach kernels refuse the mix); a param without a grad is left out, and the params after it
    are not."""
    none0, w, v, none1, u = (torch.nn.Parameter(torch.ones(2)) for _ in range(5))
    w.data = _sharded(one_rank_mesh, torch.ones(2))
    opt = cbopt.SGD([none0, w, v, none1, u], lr=0.1, backend='loop')
    w.grad, v.grad, u.grad = _sharded(one_rank_mesh, torch.ones(2)), torch.ones(2), torch.ones(2)
    got = [(list(tl), [g for g in tl.grad], states) for tl, states in bucketing.model_buckets(opt, opt.param_groups)]
    assert [[id(p) for p in ps] for ps, _, _ in got] == [[id(w)], [id(v), id(u)]]
    assert [[id(g) for g in gs] for _, gs, _ in got] == [[id(w.grad)], [id(v.grad), id(u.grad)]]
    assert [[id(s) for s in states] for _, _, states in got] == [[id(opt.state[w])], [id(opt.state[v]), id(opt.state[u])]]


# -- complex params: the real math on their (real, imaginary) pairs ---------------------------------------------
@pytest.mark.parametrize('backend', ['loop', 'foreach'])
def test_complex_params_step_as_torchs_on_their_real_views(backend) -> None:
    """torch.optim's Adam steps a complex param as the real param of its pairs (`|g|^2` would be the complex math);
    cbopt's chains the same way, whatever the backend, and the state stays complex, as torch's."""
    g = torch.Generator().manual_seed(0)
    start = torch.randn(3, dtype=torch.complex128, generator=g)
    grads = [torch.randn(3, dtype=torch.complex128, generator=g) for _ in range(4)]
    p, ref = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    kw = dict(lr=0.1, betas=(0.9, 0.99), eps=1e-8)
    foreach = backend == 'foreach'
    opt, torch_opt = cbopt.optim.Adam([p], **kw, foreach=foreach), torch.optim.Adam([ref], **kw)
    real = torch.nn.Parameter(torch.view_as_real(start.clone()))   # the same steps on the real pairs
    real_opt = cbopt.optim.Adam([real], **kw, foreach=foreach)
    for gr in grads:
        p.grad, ref.grad, real.grad = gr.clone(), gr.clone(), torch.view_as_real(gr.clone())
        opt.step(); torch_opt.step(); real_opt.step()
    torch.testing.assert_close(p.detach(), ref.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(torch.view_as_real(p.detach()), real.detach(), rtol=0, atol=0)
    assert opt.state[p]['grad_avg'].dtype == opt.state[p]['sqr_avg'].dtype == torch.complex128
    torch.testing.assert_close(opt.state[p]['sqr_avg'], torch_opt.state[ref]['exp_avg_sq'], rtol=1e-12, atol=0)


def _count_in_a_tensor(p, n=None, **kwargs):
    "State that is a real 0-d tensor whatever the param's dtype, as torch's tensor step counts."
    return {'n': p.new_ones((), dtype=torch.float64) if n is None else n + 1}  # (per param of a bucket)


@pytest.mark.parametrize('backend', ['loop', 'foreach'])
def test_real_state_of_a_complex_param_is_kept_as_it_is(backend) -> None:
    "Only tensors of the param's complex dtype are viewed as real pairs; a real state tensor (a count) is left alone."
    p, ref = torch.nn.Parameter(torch.tensor([1 + 2j, -1j])), torch.nn.Parameter(torch.tensor([1 + 2j, -1j]))
    opt = cbopt.Optimizer([p], [_count_in_a_tensor, cbopt.sgd_step], lr=0.1, backend=backend)
    torch_opt = torch.optim.SGD([ref], lr=0.1)
    for i in range(3):
        p.grad, ref.grad = torch.tensor([1j * i, 2. + i]), torch.tensor([1j * i, 2. + i])
        opt.step(); torch_opt.step()
    assert opt.state[p]['n'].dtype == torch.float64 and opt.state[p]['n'].item() == 3
    torch.testing.assert_close(p.detach(), ref.detach(), rtol=0, atol=0)


def test_auto_times_each_runner_auto_trials_times_then_no_more() -> None:
    "After `auto_trials` timed steps of each of foreach and loop (per layout), auto stops timing."
    from cbopt.core.runtime import runtime
    p = torch.nn.Parameter(torch.zeros(3))
    opt = cbopt.RMSProp([p], lr=0.1, backend=Backend("auto", auto_trials=3))  # (no torch kernel: auto times it)
    for _ in range(12):
        p.grad = torch.ones(3)
        opt.step()
    times = runtime(opt).auto_times
    # the first step's layout (no state yet) was timed once; the state-full one, 3 times per runner
    assert sorted(sorted(len(t) for t in v.values()) for v in times.values()) == [[0, 1], [3, 3]]


def test_transient_state_a_callback_did_not_return_is_no_error() -> None:
    "A transient entry lives one step; a step in which the callback did not create it has nothing to drop."
    def scratch(p, make=True, **kwargs): return {'scratch': p.grad * 2} if make else None
    scratch.transient = ('scratch',)
    p = torch.nn.Parameter(torch.zeros(2))
    opt = cbopt.Optimizer([p], [scratch, cbopt.sgd_step], lr=0.1, make=True, backend='loop')
    for make in (True, False, True):
        opt.set_hyper('make', make)
        p.grad = torch.ones(2)
        opt.step()
        assert 'scratch' not in opt.state[p]
    torch.testing.assert_close(p.detach(), torch.full((2,), -0.3))


def _step_by_grad_norm(p, lr, **kwargs):
    "A user's callback reading its grad's norm as a Python number: on a shard, that rank's part of it only."
    p.data.sub_(p.grad * (lr / max(float(torch.linalg.vector_norm(p.grad)), 1.0)))
_step_by_grad_norm.defaults, _step_by_grad_norm.state, _step_by_grad_norm.scope = dict(lr=0.1), {}, 'tensor'


@pytest.mark.filterwarnings('ignore:callback .* cannot run on a whole bucket')  # (foreach: it runs param by param)
@pytest.mark.parametrize('backend', ['loop', 'foreach'])
def test_a_python_number_of_a_partial_dtensor_is_rejected(one_rank_mesh, backend) -> None:
    "On DTensors, a chain that is not elementwise may not read a number of a reduction over a shard; nothing changes."
    from cbopt.core.dtensor import PartialNumberError
    w = torch.nn.Parameter(_sharded(one_rank_mesh, torch.arange(4.)))
    opt = cbopt.Optimizer([w], [_step_by_grad_norm], backend=backend)
    w.grad = _sharded(one_rank_mesh, torch.full((4,), 3.))
    with pytest.raises(PartialNumberError, match=r"^callback '_step_by_grad_norm' read a Python number \(__float__\)"):
        opt.step()
    torch.testing.assert_close(w.full_tensor().detach(), torch.arange(4.), rtol=0, atol=0)
    plain = torch.nn.Parameter(torch.arange(4.))              # a plain param: its number is its value
    opt = cbopt.Optimizer([plain], [_step_by_grad_norm], backend=backend)
    plain.grad = torch.full((4,), 3.)
    opt.step()
    torch.testing.assert_close(plain.detach(), torch.arange(4.) - 0.1 * 3. / 6.)


def test_an_undeclared_chain_is_dry_run_once_per_group() -> None:
    """The loop runs an undeclared chain once on a copy (refusing two callbacks creating one entry) the first time
    it steps a group, not at every step: a callback's calls are then one more than its params' steps."""
    calls = []
    def counted(p, **kwargs): calls.append(p.numel())
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    opt = cbopt.Optimizer([[a], [b]], [counted, cbopt.sgd_step], lr=0.1, backend='loop')
    for _ in range(3):
        a.grad, b.grad = torch.ones(2), torch.ones(3)
        opt.step()
    assert calls == [2, 2, 3, 3] + [2, 3] * 2     # step 1: each group's copy, then the group
    torch.testing.assert_close(a.detach(), torch.full((2,), -0.3))


def test_a_group_probed_by_foreach_is_not_dry_run_again_by_the_loop() -> None:
    """foreach's probe (a run on a copy of one param) checks an undeclared chain as the loop's dry run does: a group
    it probed is checked, and the loop, switched to later, runs no dry run of its own."""
    calls = []
    def counted(p, **kwargs): calls.append(1)
    a = torch.nn.Parameter(torch.zeros(2))
    opt = cbopt.Optimizer([a], [counted, cbopt.sgd_step], lr=0.1, backend='foreach')
    a.grad = torch.ones(2)
    opt.step()
    assert len(calls) == 2  # the probe's copy, then the bucket
    opt.backend = 'loop'
    opt.step()
    assert len(calls) == 3  # the param alone
    torch.testing.assert_close(a.detach(), torch.full((2,), -0.2))


def test_only_chains_with_a_users_callback_are_probed(monkeypatch) -> None:
    """foreach probes a bucket (a run of the chain on a copy) at every step only where the chain lists a callback of
    the user's, which may branch on a tensor's value at any step; cbopt's own run bucket-wise by construction
    (`test_backends.test_foreach_is_loop` runs each), under partials and `kahan` too, so they are never probed."""
    from functools import partial
    from cbopt.core.chain import is_cbopts
    from cbopt.engine import foreach as foreach_runner
    probed = []
    real = foreach_runner.probe
    monkeypatch.setattr(foreach_runner, 'probe', lambda cbs, *a: probed.append(len(cbs)) or real(cbs, *a))
    def mine(p, **kwargs): pass
    mine.state = {}
    def additive(p, lr, **kwargs): p.data.add_(p.grad, alpha=-lr)
    additive.state, additive.additive = {}, True
    assert is_cbopts(cbopt.adam_step) and is_cbopts(partial(cbopt.weight_decay, wd=0.1)) and is_cbopts(cbopt.kahan(cbopt.sgd_step))
    assert not any(map(is_cbopts, [mine, cbopt.kahan(additive), lambda p, **kw: None]))
    ps = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
    opt = cbopt.Optimizer([{'params': ps[:1]}, {'params': ps[1:], 'cbs': [mine, cbopt.sgd_step]}], [cbopt.sgd_step],
                          lr=0.1, backend='foreach')
    for _ in range(3):
        for p in ps: p.grad = torch.ones(3)
        opt.step()
    assert probed == [2, 2, 2]  # the second group's, at each step
    for p in ps: torch.testing.assert_close(p.detach(), torch.full((3,), 0.7))


def _forget_at_step_2(p, step=0, prev=None, **kwargs):
    "State that a callback sets to None on its second step (Python control flow on a Python value is allowed)."
    return {'step': step + 1, 'prev': None if step == 1 else p.grad * 1}


@pytest.mark.parametrize('backend', ['loop', 'foreach'])
def test_a_state_entry_set_to_none_is_none_in_every_backend(backend) -> None:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    opt = cbopt.Optimizer([a, b], [_forget_at_step_2, cbopt.sgd_step], lr=0.1, backend=backend)
    for i in range(2):
        a.grad, b.grad = torch.ones(2), torch.ones(3)
        opt.step()
        assert [opt.state[p]['prev'] is None for p in (a, b)] == [i == 1] * 2


def test_a_callback_returning_state_for_fewer_params_than_its_bucket_is_an_error() -> None:
    "foreach gives each param its own tensor of a returned TensorList: one of another length is refused, not cut."
    from cbopt.core.tensorlist import TensorList
    def short(p, **kwargs): return {'buf': TensorList(list(p.grad)[:1])}
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    opt = cbopt.Optimizer([a, b], [short, cbopt.sgd_step], lr=0.1, backend='foreach')
    a.grad, b.grad = torch.ones(2), torch.ones(3)
    with pytest.raises(ValueError, match='zip'): opt.step()


# -- torch's kernels: a grad scale on copies of the grads (clip_grad_norm, the grad contract) --------------------
def _kernel_bucket(*numels: int, dtype=torch.float64, keys=('a', 'b')) -> bucketing.Bucket:
    "A bucket of params of these sizes, with seeded grads and state entries `keys` (tensors like the params)."
    g = torch.Generator().manual_seed(sum(numels))
    ps = [torch.randn(n, dtype=dtype, generator=g) for n in numels]
    for p in ps: p.grad = torch.randn(p.shape, dtype=dtype, generator=g)
    return bucketing.Bucket({}, ps, [{k: torch.randn(p.shape, dtype=dtype, generator=g) for k in keys} for p in ps])


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_scaled_slices_cut_large_params_join_small_ones_in_one_reused_buffer(monkeypatch, dtype) -> None:
    """Runs of at most SCALE_CHUNK elements (8 here) of flat slices: params of 3 and 5 elements fill the first run
    exactly, the 20-element one is cut into 8, 8 and 4, whose last slice the 1-element param joins, and the 7-element
    one starts a run of its own. Each slice views its param (and each state entry) in place; each run's scaled grads
    are its grads times the scale in the param's dtype, written one after another from the start of one buffer of 8
    elements, reused by every run (so a run is read before the next is made); the grads themselves are not written;
    no warning (an output of the wrong size is resized, with a warning)."""
    from cbopt.engine import kernels
    monkeypatch.setattr(kernels, 'SCALE_CHUNK', 8)
    b = _kernel_bucket(3, 5, 20, 1, 7, dtype=dtype)
    grads = [p.grad.clone() for p in b.params]
    scale = torch.tensor(0.3, dtype=torch.float32)
    expected = [[(0, 0, 3), (1, 0, 5)], [(2, 0, 8)], [(2, 8, 8)], [(2, 16, 4), (3, 0, 1)], [(4, 0, 7)]]
    got, buffers = [], set()
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        for ps, gs, a, b_ in kernels._scaled_slices(b, scale, ('a', 'b')):
            run, used = [], 0
            for p, g, sa, sb in zip(ps, gs, a, b_, strict=True):
                i = next(i for i, q in enumerate(b.params) if q.untyped_storage().data_ptr() == p.untyped_storage().data_ptr())
                start, n = p.storage_offset(), p.numel()
                run.append((i, start, n))
                for t, whole in ((p, b.params[i]), (sa, b.states[i]['a']), (sb, b.states[i]['b'])):
                    assert t.data_ptr() == whole.data_ptr() + start * whole.element_size() and t.shape == (n,)
                assert g.dtype == dtype and torch.equal(g, grads[i][start:start + n] * scale.to(dtype))
                assert g.storage_offset() == used  # one after another from the buffer's start
                buffers.add((g.untyped_storage().data_ptr(), g.untyped_storage().nbytes()))
                used += n
            got.append(run)
    assert got == expected
    assert [nbytes for _, nbytes in buffers] == [8 * torch.empty(0, dtype=dtype).element_size()]  # one, of 8
    assert all(torch.equal(p.grad, g) for p, g in zip(b.params, grads))
    one = _kernel_bucket(4, dtype=dtype)  # a bucket of one param: one run, a buffer of its size
    (ps, gs, a, b_), = kernels._scaled_slices(one, scale, ('a', 'b'))
    assert ps[0].data_ptr() == one.params[0].data_ptr() and torch.equal(gs[0], one.params[0].grad * scale.to(dtype))
    assert gs[0].untyped_storage().nbytes() == 4 * one.params[0].element_size()


@pytest.mark.parametrize('entry', ['torch_kernel', 'fused_adamw'])
def test_a_kernel_given_a_grad_scale_steps_as_torchs_clip_then_fused_adamw(monkeypatch, entry) -> None:
    """`torch_kernel(b, hyper, grad_scale=c)`, and `fused_adamw(b, hyper, grad_scale=c)` with its defaults (no
    maximize, no amsgrad), step as torch's `clip_grad_norm_` (whose coefficient is `c`) then its fused AdamW, bit for
    bit (the same kernel on the same scaled grads), float64 params cut into runs (SCALE_CHUNK 16: the 48-element
    weight is cut, the biases join others); by default (not in place) the user's grads are left as they were."""
    from conftest import assert_same_params, make_model, set_grads
    from cbopt.engine import kernels
    from cbopt.core.hypers import Hypers
    monkeypatch.setattr(kernels, 'SCALE_CHUNK', 16)
    hypers = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-5, weight_decay=0.01)
    model, ref = make_model(dtype=torch.float64), make_model(dtype=torch.float64)
    opt = cbopt.optim.AdamW(model.parameters(), **hypers, fused=True)
    opt.init_state()
    ref_opt = torch.optim.AdamW(ref.parameters(), **hypers, fused=True)
    for i in range(5):
        set_grads(model, i), set_grads(ref, i)
        given = [(p.grad, p.grad.clone()) for p in model.parameters()]
        coef = torch.clamp(0.05 / (torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05) + 1e-6), max=1.0)
        assert coef < 1  # (it clips)
        for b in bucketing.buckets(opt):
            hyper = Hypers(b.group).snapshot()
            run = getattr(kernels, entry)(b, hyper, grad_scale=coef)
            assert run is not None
            run()
        ref_opt.step()
        assert_same_params(model, ref, f'step {i}')
        for p, (g, before) in zip(model.parameters(), given): assert p.grad is g and torch.equal(g, before)
    assert [opt.state[p]['step'] for p in model.parameters()] == [5] * 4


def _count_calls(monkeypatch, kernel: str = '_fused_adamw_') -> list:
    "A list that gets one entry per call of torch's `kernel`."
    calls, real = [], getattr(torch, kernel)
    monkeypatch.setattr(torch, kernel, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _adam_steps(backend: str, steps: int = 4, group: dict | None = None, **kw) -> torch.Tensor:
    "A 5-element param after `steps` Adam steps on fixed grads (its state created first: the kernel's case)."
    p = torch.nn.Parameter(torch.linspace(-1., 1., 5))
    opt = cbopt.Adam([{'params': [p], **(group or {})}], lr=0.1, backend=backend, **kw)
    opt.init_state()
    for i in range(steps):
        p.grad = torch.tensor([1., -2., 3., 0.5, -0.25]) * (i + 1)
        opt.step()
    return p.detach()


def test_a_tensor_valued_kernel_number_runs_the_chain(monkeypatch) -> None:
    """torch's kernels take `mom`, `sqr_mom`, `eps` and `wd` as Python floats (a tensor lr aside): a tensor given as
    one of them, here a `mom` that requires grad (as in hypergradient descent; the kernel refuses such a tensor), runs
    the chain in the fused backend, which steps as the loop."""
    calls = _count_calls(monkeypatch)
    mom = torch.tensor(0.9, requires_grad=True)
    got = _adam_steps('auto', mom=mom)
    assert calls == []
    torch.testing.assert_close(got, _adam_steps('loop', mom=mom), rtol=0, atol=0)
    assert _adam_steps('auto').shape == (5,) and len(calls) == 4  # a float mom runs the kernel


def test_an_adam_group_with_a_dampening_hyper_runs_the_chain(monkeypatch) -> None:
    """A group's `dampening` hyper reaches Adam's moment callbacks (`average_grad`, `average_sqr_grad`): False leaves
    both undamped, which torch's kernel does not compute (with eps=0.1 the update differs by a third), so the fused
    backend runs the chain for that group and steps as the loop."""
    calls = _count_calls(monkeypatch)
    undamped = dict(group={'dampening': False}, eps=0.1)
    got = _adam_steps('auto', **undamped)
    assert calls == []
    torch.testing.assert_close(got, _adam_steps('loop', **undamped), rtol=0, atol=0)
    assert (got - _adam_steps('loop', eps=0.1)).abs().max() > 1e-2  # (the dampening changes the step)


@pytest.mark.parametrize('clip', [False, True])
def test_the_kernels_tensors_go_on_the_params_device_not_the_default_one(monkeypatch, clip) -> None:
    """Under `with torch.device('meta')` (a default device, as when a model is built on meta) CPU params step with
    torch's kernel as without it: its step count and the buffer of clipped grads (`clip_grad_norm`, on copies) are
    made on the params' device."""
    calls = _count_calls(monkeypatch)

    def run(default_device: str) -> list:
        m = torch.nn.Linear(4, 3)
        grads = []
        for i in range(3):
            m.zero_grad()
            m(torch.linspace(-1, 1, 8).view(2, 4) * (i + 1)).square().sum().backward()
            grads.append([p.grad.clone() for p in m.parameters()])
        with torch.device(default_device):
            opt = cbopt.Adam(m.parameters(), lr=0.1, backend='fused')
            if clip: opt = cbopt.GradientClippingOptimizer(opt, cbopt.GradientClipping.NORM, 0.05)
            opt.init_state()
            for gs in grads:
                for p, g in zip(m.parameters(), gs): p.grad = g
                opt.step()
        return [p.detach() for p in m.parameters()]
    torch.manual_seed(0)
    expected = run('cpu')
    calls.clear()
    torch.manual_seed(0)
    got = run('meta')
    assert len(calls) == 3
    for g, e in zip(got, expected, strict=True): torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_dtensor_params_step_with_torchs_adam_kernel(one_rank_mesh, monkeypatch) -> None:
    """DTensor has a sharding rule for torch's Adam kernels (not for its SGD and Adagrad ones): params sharded as
    DTensors step with `_fused_adamw_`, as plain params do, bit for bit."""
    calls = _count_calls(monkeypatch)
    w = torch.nn.Parameter(_sharded(one_rank_mesh, torch.linspace(-1., 1., 6)))
    plain = torch.nn.Parameter(torch.linspace(-1., 1., 6))
    opts = [cbopt.Adam([q], lr=0.1, backend='fused') for q in (w, plain)]
    for o in opts: o.init_state()
    for i in range(3):
        g = torch.linspace(-2., 3., 6) * (i + 1)
        w.grad, plain.grad = _sharded(one_rank_mesh, g), g.clone()
        for o in opts: o.step()
    assert len(calls) == 6
    torch.testing.assert_close(w.full_tensor().detach(), plain.detach(), rtol=0, atol=0)


def _accumulating(**kw):
    "A whole-model callback summing the grads into its per-param state `grad_sum` (made by `zeros`, a callable)."
    def summing(params, grad_sum, **kwargs):
        for tl, sums in zip(params, grad_sum): torch._foreach_add_(list(sums), list(tl.grad))
    summing.scope, summing.state, summing.transient, summing.param_state = 'model', {}, (), dict(grad_sum=zeros)
    for k, v in kw.items(): setattr(summing, k, v)
    return summing


@pytest.mark.parametrize('when', ['first step', 'init_state', 'joins a stepped chain'])
def test_a_whole_model_callbacks_per_param_state_is_made_by_its_callable(when) -> None:
    """`param_state = dict(grad_sum=zeros)`: each param's `'summing.grad_sum'` is made by calling `zeros` on it, by
    the first step, by `init_state`, or, for a callback added to a chain whose params already have state (as a wrapper
    adds one), by the next step; the callback keeps it: the sum of the grads it saw. A param before them that never
    has a grad gets no state (by the steps) and does not keep the others from theirs."""
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3, 1))
    frozen = torch.nn.Parameter(torch.ones(4))
    late = when == 'joins a stepped chain'
    chain = [cbopt.average_grad, cbopt.momentum_step]  # (state of its own: the params have state before it joins)
    opt = cbopt.Optimizer([frozen, a, b], ([] if late else [_accumulating()]) + chain, lr=0.1)
    if when == 'init_state': opt.init_state()
    if late:
        a.grad, b.grad = torch.ones(2), torch.ones(3, 1)
        opt.step()
        opt.param_groups[0]['cbs'].insert(0, _accumulating())
    for i in range(2):
        a.grad, b.grad = torch.full((2,), i + 1.), torch.full((3, 1), 2. * (i + 1))
        opt.step()
    assert torch.equal(opt.state[a]['summing.grad_sum'], torch.full((2,), 3.))
    assert torch.equal(opt.state[b]['summing.grad_sum'], torch.full((3, 1), 6.))
    assert (when == 'init_state') == bool(opt.state.get(frozen))  # (init_state gives every param its state)


def test_after_a_reevaluating_step_the_grads_are_the_last_evaluations() -> None:
    """The grad contract with a closure: a callback re-evaluates the model (new grads), a clip after it scales them out
    of place for the step; after the step each grad is the last evaluation's, unclipped (as torch's LBFGS leaves it),
    and the step took the clipped one."""
    def evaluating(params, closure=None, **kwargs): closure()
    evaluating.scope, evaluating.state, evaluating.transient, evaluating.uses_closure = 'model', {}, (), True
    p = torch.nn.Parameter(torch.tensor([2., -1.]))
    opt = cbopt.Optimizer([p], [evaluating, cbopt.clip_grad_norm, cbopt.sgd_step], lr=0.1, max_norm=1.)
    def closure():
        opt.zero_grad()
        loss = (p * p).sum() * 3
        loss.backward()
        return loss
    opt.step(closure)
    grad = torch.tensor([12., -6.])
    assert torch.equal(p.grad, grad)
    torch.testing.assert_close(p.detach(), torch.tensor([2., -1.]) - 0.1 * grad / grad.norm())


def test_a_callback_after_the_chain_keeps_its_declared_state() -> None:
    """A whole-model callback listed after the per-param chain returns its declared state (kept in the group,
    reported in `step_stats`) and transient entries (reported only)."""
    def counting(params, count, **kwargs): return {'count': count + 1, 'norm': 1.5}
    counting.scope, counting.state, counting.transient = 'model', dict(count=0), ('norm',)
    p = torch.nn.Parameter(torch.zeros(2))
    opt = cbopt.Optimizer([p], [cbopt.sgd_step, counting], lr=0.1)
    for i in range(2):
        p.grad = torch.ones(2)
        opt.step()
        assert opt.step_stats['count'] == i + 1 and opt.step_stats['norm'] == 1.5
    assert opt.param_groups[0]['counting.count'] == 2 and 'counting.norm' not in opt.param_groups[0]


def test_a_callback_that_uses_the_closure_gets_it_and_the_loss() -> None:
    """`uses_closure = True` (as `lbfgs`): the callback gets `closure`, which re-evaluates the model (its grads are
    the user's after the step), and `loss`, the closure's first value; without the flag it gets neither."""
    seen = []
    def evaluating(params, closure=None, loss=None, **kwargs): seen.append((loss, None if closure is None else closure()))
    evaluating.scope, evaluating.state, evaluating.transient = 'model', {}, ()
    for flag in (True, False):
        evaluating.uses_closure = flag
        p = torch.nn.Parameter(torch.tensor([2.]))
        opt = cbopt.Optimizer([p], [evaluating, cbopt.sgd_step], lr=0.1)
        def closure():
            opt.zero_grad()
            loss = (p * p).sum()
            loss.backward()
            return loss
        seen.clear()
        opt.step(closure)
        if flag:
            (loss, again), = seen
            assert loss.item() == 4. and again.item() == 4.  # (the step comes after)
        else: assert seen == [(None, None)]
        torch.testing.assert_close(p.detach(), torch.tensor([2. - 0.1 * 4.]))
    evaluating.uses_closure = True
    with pytest.raises(RuntimeError, match=r"^evaluating re-evaluates the model several times per step: call "
                                           r"opt\.step\(closure\)"):
        opt.step()


def test_fused_sgd_with_its_defaults_is_torchs_fused_sgd_with_l2() -> None:
    """`fused_sgd(b, hyper)` with its defaults (no momentum, L2 decay, no maximize) steps as torch's fused SGD with
    `weight_decay`, bit for bit."""
    from conftest import assert_same_params, make_model, set_grads
    from cbopt.engine import kernels
    from cbopt.core.hypers import Hypers
    model, ref = make_model(), make_model()
    opt = cbopt.optim.SGD(model.parameters(), lr=0.05, weight_decay=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, weight_decay=0.1, fused=True)
    for i in range(3):
        set_grads(model, i), set_grads(ref, i)
        for b in bucketing.buckets(opt):
            run = kernels.fused_sgd(b, Hypers(b.group).snapshot())
            assert run is not None
            run()
        ref_opt.step()
        assert_same_params(model, ref, f'step {i}')


def _breaks_graphs(p, **kwargs):
    "A callback torch.compile cannot put in one graph (an explicit graph break); eagerly, nothing."
    torch._dynamo.graph_break()


def test_a_chain_that_cannot_compile_runs_foreach_with_one_warning() -> None:
    """The compiled backend (dynamo's eager compiler here: no code generation) on a chain that does not compile with
    `fullgraph=True`: one warning naming the failure, and every param steps with foreach, as the loop, at each step."""
    ps, ref = [torch.nn.Parameter(torch.linspace(-1., 1., n)) for n in (3, 4)], [torch.linspace(-1., 1., n) for n in (3, 4)]
    opt = cbopt.Optimizer(ps, [_breaks_graphs, cbopt.sgd_step], lr=0.1, backend=cbopt.Backend('fused', compiler='eager'))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for i in range(3):
            for p, r in zip(ps, ref):
                p.grad = torch.linspace(0., 1., p.numel()) * (i + 1)
                r.sub_(0.1 * p.grad)
            opt.step()
            for p, r in zip(ps, ref): torch.testing.assert_close(p.detach(), r, rtol=0, atol=0)
    msgs = [str(x.message) for x in w if 'could not be compiled' in str(x.message)]
    assert len(msgs) == 1 and msgs[0].endswith('running it with the foreach backend'), msgs


def test_dtensor_params_of_a_chain_over_whole_tensors_run_foreach_in_the_compiled_backend(one_rank_mesh) -> None:
    """A chain that reduces over whole params (LAMB's norms) is not compiled on shards: the compiled backend runs
    foreach on DTensors, stepping as plain params do."""
    w = torch.nn.Parameter(_sharded(one_rank_mesh, torch.linspace(-1., 1., 6)))
    plain = torch.nn.Parameter(torch.linspace(-1., 1., 6))
    opt = cbopt.Lamb([w], lr=0.1, backend=cbopt.Backend('fused', compiler='eager'))
    ref = cbopt.Lamb([plain], lr=0.1, backend='loop')
    for i in range(3):
        g = torch.linspace(-2., 3., 6) * (i + 1)
        w.grad, plain.grad = _sharded(one_rank_mesh, g), g.clone()
        opt.step(), ref.step()
    torch.testing.assert_close(w.full_tensor().detach(), plain.detach(), rtol=1e-6, atol=0)


def test_a_group_in_eval_mode_refuses_to_step_its_grads() -> None:
    """Schedule-free's rule: a group in eval mode (`train_mode=False`: its params are the averaged weights) must not
    step; a step with grads there raises and changes nothing, a group in eval mode without grads is no error."""
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = cbopt.SGD([[a], [b]], lr=0.1)
    opt.param_groups[1]['train_mode'] = False
    a.grad = torch.ones(2)
    opt.step()  # (group 1 has no grad)
    b.grad = torch.ones(2)
    with pytest.raises(RuntimeError, match=r"^param group 1 is in eval mode \(its params are the averaged weights\): "
                                           r"call opt.train\(\) before opt.step\(\)"):
        opt.step()
    assert torch.equal(a.detach(), torch.full((2,), 0.9)) and torch.equal(b.detach(), torch.ones(2))


def test_auto_scales_the_grads_inside_torchs_kernel(monkeypatch) -> None:
    """`auto`, as `fused`, hands `clip_grad_norm`'s coefficient to torch's kernel: no separate multiply of the grads
    (`_foreach_mul`), the user's grads left as they were."""
    calls = _count_calls(monkeypatch)
    real = torch._foreach_mul
    monkeypatch.setattr(torch, '_foreach_mul', lambda *a, **k: pytest.fail('the grads were scaled outside the kernel'))
    m = torch.nn.Linear(4, 3)
    opt = cbopt.GradientClippingOptimizer(cbopt.Adam(m.parameters(), lr=0.1, backend='auto'),
                                          cbopt.GradientClipping.NORM, 0.05)
    opt.init_state()
    for i in range(2):
        m.zero_grad()
        m(torch.linspace(-1, 1, 8).view(2, 4) * (i + 1)).square().sum().backward()
        given = [p.grad.clone() for p in m.parameters()]
        opt.step()
        assert opt.step_stats['grad_norm'] > 0.05  # (it clipped)
        assert all(torch.equal(p.grad, g) for p, g in zip(m.parameters(), given))
    assert len(calls) == 2 and real is not torch._foreach_mul


def test_a_step_gradscaler_found_infs_in_changes_nothing_and_says_so() -> None:
    """GradScaler sets `opt.found_inf` (and the scale) before calling `opt.step()`: a nonzero one skips the step
    (params and state unchanged), reported in `step_stats` with each group's lr."""
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = cbopt.Adam([{'params': [a], 'lr': 0.1}, {'params': [b], 'lr': 0.2}])
    a.grad, b.grad = torch.ones(2), torch.ones(2)
    opt.found_inf, opt.grad_scale = torch.tensor(1.), torch.tensor(4.)
    opt.step()
    assert opt.step_stats == {'lr': [0.1, 0.2], 'skipped': True, 'skipped_by': 'GradScaler'}
    assert torch.equal(a.detach(), torch.ones(2)) and torch.equal(b.detach(), torch.ones(2)) and not opt.state[a]


# -- the compiled chain's Python, compiled with dynamo's `eager` backend (no code generation: a second or two each) --

EAGER = cbopt.Backend('fused', compiler='eager', compile_chunk=4)
SMALL_AND_LARGE = [(130, 130), (5,), (3, 4), (7,), (2, 2, 2), (1,), (6,)]  # one param above PACK_NUMEL, six packed


def _params_and_grads(shapes: list, steps: int, seed: int = 0) -> tuple[list, list]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes], [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]


def _rebinding_sgd(p, lr, mom, grad_avg=None, n=None, **kwargs):
    """SGD with momentum and lr / n at the n-th step, its average and its count (a 0-d tensor per param) new tensors at
    every step (out of place), as a user's callback may make them."""
    if grad_avg is None: grad_avg, n = torch.zeros_like(p.data), per_tensor(lambda q: q.new_zeros(()), p.data)
    grad_avg, n = grad_avg * mom + p.grad.data, n + 1
    p.data.add_(grad_avg / n, alpha=-lr)
    return {'grad_avg': grad_avg, 'n': n}
_rebinding_sgd.state = dict(grad_avg=zeros, n=lambda p: p.new_zeros(()))


def test_a_packed_chain_that_rebinds_its_state_gives_each_param_its_own() -> None:
    """A chain that makes its state anew at each step (a param-shaped average; a 0-d count, one value for all, which
    goes with the pack), on packed small params: each param gets its own part of the packed results, of its shape and
    in memory of its own, as torch's SGD with momentum computes them (lr / n at step n)."""
    start, grads = _params_and_grads(SMALL_AND_LARGE, 4, seed=1)
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


def _spreading_count(p, n=None, count_steps=0, **kwargs):
    "A 0-d count per param that becomes param-shaped at its second step: a count per element from then on."
    if n is None: n = per_tensor(lambda q: q.new_zeros(()), p.data)
    return {'n': p.grad.data * 0 + n + 1 if count_steps else n + 1, 'count_steps': count_steps + 1}
_spreading_count.state = dict(n=lambda p: p.new_zeros(()), count_steps=0)


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
    start, grads = _params_and_grads(shapes, 3, seed=2)
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


# -- the step traced by an outer torch.compile (`traced.py`) ------------------------------------------------------

def _two_groups(make, lrs=(0.01, 0.02), seed=4) -> tuple[list, object]:
    "Two groups of two params each (the second group's last param never gets a grad), made from one seed."
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((3, 2), (4,), (5,), (2,))]
    return ps, make([{'params': ps[:2], 'lr': lrs[0]}, {'params': ps[2:], 'lr': lrs[1]}])


def _set_grads(ps: list, i: int) -> None:
    for j, p in enumerate(ps[:3]): p.grad = torch.linspace(-1., 2., p.numel()).view(p.shape) * (i + 1) + j


def test_the_traced_step_run_eagerly_steps_as_torch() -> None:
    """What dynamo traces (`can_trace`, then `traced_step`), run eagerly: per param, each group with its own lr, as
    torch's Adam over 4 steps (a param without a grad left alone); the counts become 0-d float64 tensors, and an
    eager step after it goes on from them."""
    from cbopt.engine import traced
    ps, opt = _two_groups(lambda gs: cbopt.Adam(gs, sqr_mom=0.999, eps=1e-8, wd=0.1, decouple_wd=False, backend='loop'))
    qs, ref = _two_groups(lambda gs: torch.optim.Adam(gs, weight_decay=0.1))
    untouched = ps[3].detach().clone()
    for i in range(5):
        _set_grads(ps, i)
        _set_grads(qs, i)
        if i < 4:
            assert traced.can_trace(opt)
            traced.traced_step(opt)
            assert opt.step_stats == {'lr': [0.01, 0.02], 'skipped': False}
        else: opt.step()
        ref.step()
        assert_tensors_close(ps, qs, msg=f'step {i}')
        if i < 4:
            steps = [opt.state[p]['step'] for p in ps[:3]]
            assert all(s.dtype == torch.float64 and s.ndim == 0 and s.item() == i + 1 for s in steps), steps
    assert torch.equal(ps[3], untouched) and not opt.state[ps[3]]
    assert_tensors_close([opt.state[p]['sqr_avg'] for p in ps[:3]], [ref.state[q]['exp_avg_sq'] for q in qs[:3]])


def _refusing(case: str, mesh=None):
    if case == 'radam': return _two_groups(lambda gs: cbopt.RAdam(gs, backend='loop'))  # `if r > 5` on the count
    if case == 'clip':  # a whole-model callback
        return _two_groups(lambda gs: cbopt.Optimizer(gs, [cbopt.clip_grad_norm, cbopt.sgd_step], max_norm=1.))
    ps, opt = _two_groups(lambda gs: cbopt.Adam(gs, backend='loop'))
    if case == 'found_inf': opt.found_inf = torch.zeros(())
    if case == 'grad_scale': opt.grad_scale = torch.ones(())
    if case == 'eval': opt.param_groups[1]['train_mode'] = False
    return ps, opt


@pytest.mark.parametrize('case', ['radam', 'clip', 'found_inf', 'grad_scale', 'eval', 'dtensor', 'adam'])
def test_can_trace_refuses_what_only_the_eager_step_does_and_changes_nothing(case, one_rank_mesh) -> None:
    """`can_trace` (run as dynamo traces a step) refuses a chain reading a Python value of a tensor, a whole-model
    callback, GradScaler's flags, a group in eval mode and DTensor params, and then changes nothing (no state, no
    param moved); it accepts Adam and creates its state, the count a 0-d float64 tensor, without stepping."""
    from cbopt.engine import traced
    if case == 'dtensor':
        ps = [torch.nn.Parameter(_sharded(one_rank_mesh, torch.linspace(-1., 1., 6)))]
        opt = cbopt.Adam(ps, backend='loop')
        ps[0].grad = _sharded(one_rank_mesh, torch.ones(6))
    else:
        ps, opt = _refusing(case)
        _set_grads(ps, 0)
    before = [p.detach().clone() for p in ps]
    assert traced.can_trace(opt) is (case == 'adam')
    for p, b in zip(ps, before): assert torch.equal(p.detach(), b)
    if case != 'adam': assert not any(opt.state[p] for p in ps)
    else:
        assert [sorted(opt.state[p]) for p in ps] == [['grad_avg', 'sqr_avg', 'step']] * 3 + [[]]
        assert all(torch.equal(opt.state[p]['step'], torch.zeros((), dtype=torch.float64)) for p in ps[:3])


def test_number_tensor_is_a_float64_count_on_the_params_device() -> None:
    from cbopt.engine.traced import number_tensor
    t = number_tensor(2 ** 53, torch.zeros(2, device='meta'))
    assert (t.dtype, t.device, t.shape) == (torch.float64, torch.device('meta'), torch.Size([]))
    assert number_tensor(2 ** 53, torch.zeros(2)).item() == 2 ** 53
    x = torch.ones(())
    assert number_tensor(x, torch.zeros(2)) is x


def test_an_outer_compiled_step_is_traced_whole_and_a_closure_runs_eagerly() -> None:
    """torch's compiled-optimizer recipe with dynamo's `eager` backend: the step traced into the caller's graph
    (fullgraph: no break) as torch's Adam steps; with a closure the step runs eagerly (one graph break), the closure
    called once a step and its loss returned."""
    ps, opt = _two_groups(lambda gs: cbopt.Adam(gs, sqr_mom=0.999, eps=1e-8, wd=0., backend='loop'))
    qs, ref = _two_groups(lambda gs: torch.optim.Adam(gs))
    whole = torch.compile(lambda: opt.step(), backend='eager', fullgraph=True)
    calls = []
    def closure():
        calls.append(1)
        return torch.tensor(float(len(calls)))
    with_closure = torch.compile(lambda: opt.step(closure), backend='eager')
    for i in range(4):
        _set_grads(ps, i)
        _set_grads(qs, i)
        if i % 2: assert with_closure().item() == len(calls) == (i + 1) // 2
        else: whole()
        ref.step()
        assert_tensors_close(ps, qs, msg=f'step {i}')


def test_torch_compile_is_asked_for_one_graph_and_the_scalars_pass(monkeypatch) -> None:
    """The options the compiled chain gives torch.compile: the whole chain in one graph (`fullgraph=True`: a graph
    break is a failure, so the foreach fallback); for inductor, `ScalarsOnce` as its post-grad pass (run on the graph,
    it merges that graph's `scalar`s) and no size asserts (dynamo's guards check the sizes); for any other backend
    none (its backends ignore inductor's options, with a warning). (torch.compile recorded, not run.)"""
    from torch.fx.experimental.proxy_tensor import make_fx
    seen = []
    def compile_(fn, backend, fullgraph, options):
        seen.append((backend, fullgraph, options))
        return fn
    monkeypatch.setattr(torch, 'compile', compile_)
    monkeypatch.setattr(compiled, '_COMPILED', {})
    ps = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 2))]
    for compiler in ('inductor', 'eager'):
        opt = cbopt.Adamax(ps, lr=0.01, backend=cbopt.Backend('fused', compiler=compiler))
        for _ in range(2):
            for p in ps: p.grad = torch.ones_like(p)
            opt.step()
    (ind_backend, ind_full, options), (eager_backend, eager_full, eager_options) = seen
    assert (ind_backend, ind_full, eager_backend, eager_full, eager_options) == ('inductor', True, 'eager', True, None)
    assert options.pop('size_asserts') is False
    scalar = torch.ops.cbopt.scalar.default
    graph = make_fx(lambda x, a: x * scalar(a * 2) + x * scalar(a + 1))(torch.ones(3), torch.tensor(0.5)).graph
    options.pop('post_grad_custom_post_pass')(graph)  # (two independent values: one call of `scalars`)
    assert not options
    assert [str(n.target) for n in graph.nodes if str(n.target).startswith('cbopt.')] == ['cbopt.scalars.default']


# -- found by the engine's mutation sample (eighth session: docs/mutation.md) --------------------------------------
@pytest.mark.parametrize('small', [0, 1, 2])
def test_flat_runs_with_no_one_or_two_small_params(small) -> None:
    """The compiled chain's flat inputs over buckets of large params with 0, 1 or 2 small ones: small params are packed
    only when there are two or more (one alone gains nothing from a pack), and every case steps as the loop over 4
    steps (Lion)."""
    shapes = [(130, 130), (129, 131)] + [(3,), (2, 2)][:small]
    start, grads = _params_and_grads(shapes, 4, seed=3)
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
    start, grads = _params_and_grads([(4, 3), (5,), (6,), (2, 3)], 3, seed=4)
    ps = [torch.nn.Parameter(t.clone()) for t in start]
    opt = cbopt.Lion([{'params': ps[:2]}, {'params': ps[2:], 'lr': 0.01}], lr=0.1, backend=EAGER)
    for gs in grads:
        for p, gr in zip(ps, gs): p.grad = gr.clone()
        opt.step()
    kept = cbopt.core.runtime.runtime(opt).flat_aliases
    assert len(kept) == 2
    assert sorted(sorted(k for k in v if k != 'pack') for v in kept.values()) == sorted([sorted(map(id, ps[:2])),
                                                                                        sorted(map(id, ps[2:]))])


def test_a_tensor_lr_steps_with_torchs_kernel(monkeypatch) -> None:
    """A 0-d tensor lr on the params' device is what torch's fused kernels take too: cbopt's Adam steps with
    `_fused_adamw_`, bit for bit torch's fused Adam given the same tensor lr."""
    calls = _count_calls(monkeypatch)
    start, grads = _params_and_grads([(4, 3), (5,)], 4, seed=6)
    ps, qs = [torch.nn.Parameter(t.clone()) for t in start], [torch.nn.Parameter(t.clone()) for t in start]
    opt = cbopt.Adam(ps, lr=torch.tensor(0.01), mom=0.9, sqr_mom=0.999, eps=1e-8, wd=0., backend='fused')
    ref = torch.optim.Adam(qs, lr=torch.tensor(0.01), fused=True)
    for gs in grads:
        for p, q, gr in zip(ps, qs, gs): p.grad, q.grad = gr.clone(), gr.clone()
        opt.step(), ref.step()
    assert_tensors_close(ps, qs, rtol=0)
    assert len(calls) == len(grads) - 1  # ours from the second step (the first makes the state; torch's is _fused_adam_)


@pytest.mark.parametrize('wd', [0., 0.1])
def test_decoupled_adagrad_runs_its_chain_unless_it_has_no_decay(wd, monkeypatch) -> None:
    """torch's Adagrad kernel decays by L2 only: cbopt's Adagrad with `decouple_wd=True` steps with it only at zero
    decay, else with its chain (as the loop backend), over 4 steps."""
    calls = _count_calls(monkeypatch, '_fused_adagrad_')
    start, grads = _params_and_grads([(4, 3), (5,)], 4, seed=7)
    ps, qs = [torch.nn.Parameter(t.clone()) for t in start], [torch.nn.Parameter(t.clone()) for t in start]
    opt = cbopt.Adagrad(ps, lr=0.1, wd=wd, decouple_wd=True, backend=EAGER)
    ref = cbopt.Adagrad(qs, lr=0.1, wd=wd, decouple_wd=True, backend='loop')
    for gs in grads:
        for p, q, gr in zip(ps, qs, gs): p.grad, q.grad = gr.clone(), gr.clone()
        opt.step(), ref.step()
    assert_tensors_close(ps, qs)
    assert len(calls) == (0 if wd else len(grads) - 1)


@pytest.mark.parametrize('make, kernel', [(lambda ps, b: cbopt.SGD(ps, lr=0.1, mom=0.9, backend=b), '_fused_sgd_'),
                                          (lambda ps, b: cbopt.Adagrad(ps, lr=0.1, backend=b), '_fused_adagrad_')],
                         ids=['sgd', 'adagrad'])
def test_dtensor_params_of_sgd_and_adagrad_do_not_reach_their_kernels(make, kernel, one_rank_mesh, monkeypatch) -> None:
    """DTensor has no sharding rule for torch's SGD and Adagrad kernels: params sharded as DTensors step with the
    chain (compiled), as plain params do with the kernel."""
    calls = _count_calls(monkeypatch, kernel)
    w = torch.nn.Parameter(_sharded(one_rank_mesh, torch.linspace(-1., 1., 6)))
    plain = torch.nn.Parameter(torch.linspace(-1., 1., 6))
    opts = [make([w], EAGER), make([plain], EAGER)]
    for i in range(3):
        g = torch.linspace(-2., 3., 6) * (i + 1)
        w.grad, plain.grad = _sharded(one_rank_mesh, g), g.clone()
        for o in opts: o.step()
    assert len(calls) == 2  # the plain param's steps after its first
    torch.testing.assert_close(w.full_tensor().detach(), plain.detach(), rtol=1e-6, atol=1e-7)
