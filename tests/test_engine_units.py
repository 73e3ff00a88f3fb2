"""The engine's parts on their own (issue #14, mutation testing of `cbopt/engine/`), with hand-worked expectations:
backend settings, how CPU buckets are cut into cache-sized and same-shape chunks, the scalar-to-tensor rewrite the
compiled chain runs under (checked eagerly, against the plain ops), the per-step stats, and the whole-model
callbacks' contract errors. `test_backends.py` checks the backends against the loop over many steps."""
from __future__ import annotations

import warnings

import pytest
import torch

import cbopt
from cbopt.engine import Backend, as_backend
from cbopt.engine import buckets as bucketing
from cbopt.engine.compiled import ScalarArgsAsTensors, can_flatten, flat_chunks, shape_chunks
from cbopt.engine.runtime import warn_once


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
    "Flat params go in runs of `chunk` in their order, the last one shorter: GPT-2's 148 params in 4 x 32 + 20."
    assert [len(c) for c in flat_chunks(148, 32)] == [32] * 4 + [20]
    assert [i for c in flat_chunks(148, 32) for i in c] == list(range(148))
    assert flat_chunks(3, 32) == [[0, 1, 2]] and flat_chunks(4, 2) == [[0, 1], [2, 3]]


def _graphs() -> int:
    from torch._dynamo.utils import counters
    return counters['stats']['unique_graphs']


def test_an_elementwise_chain_compiles_one_graph_per_chunk_length() -> None:
    """cbopt.Lion (every callback elementwise) over 10 params of ranks 1 to 4 and many sizes, in chunks of 4: flat
    params, so two graphs (chunks of 4 and of 2) whatever the shapes, over 4 steps; the same params as the loop, and
    its state keeps each param's shape. A transposed grad (not contiguous: no flat alias) steps by shape instead."""
    shapes = [(5,), (3, 4), (7,), (2, 3, 4), (4, 3), (6,), (2, 2, 2, 2), (9,), (5, 5), (3,)]
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(4)]
    def run(backend):
        ps = [torch.nn.Parameter(t.clone()) for t in start]
        opt = cbopt.Lion(ps, lr=0.1, wd=0.1, backend=backend)
        for gs in grads:
            for p, gr in zip(ps, gs): p.grad = gr.clone()
            opt.step()
        return ps, opt
    before = _graphs()
    fused, opt = run(cbopt.Backend('fused', compiler='eager', compile_chunk=4))
    assert _graphs() - before == 2
    loop, _ = run('loop')
    for a, b in zip(fused, loop): torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert [tuple(opt.state[p]['grad_avg'].shape) for p in fused] == shapes
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
def test_scalar_args_as_tensors_computes_the_same() -> None:
    """Under the mode, `alpha=`, `value=`, a number `lerp` weight and clamp bounds become tensor ops: the values are
    those of the plain ops, and the in-place ops still write into their tensor and return it."""
    g = torch.Generator().manual_seed(0)
    x, y, z = (torch.randn(5, generator=g, dtype=torch.float64) for _ in range(3))
    lo = torch.full((5,), -0.3, dtype=torch.float64)
    ops = {
        'add': lambda: x.add(y, alpha=0.7), 'sub': lambda: torch.sub(x, y, alpha=-2.),
        'addcmul': lambda: x.addcmul(y, z, value=0.25), 'addcdiv': lambda: torch.addcdiv(x, y, z.abs() + 1, value=-3.),
        'lerp': lambda: x.lerp(y, 0.3), 'torch.lerp': lambda: torch.lerp(x, y, 0.6), 'lerp-tensor': lambda: x.lerp(y, z),
        'clamp': lambda: x.clamp(-0.2, 0.5), 'clamp-min': lambda: torch.clamp(x, min=-0.1), 'clip-max': lambda: x.clip(max=0.1),
        'clamp-tensor': lambda: x.clamp(min=lo), 'mul': lambda: x.mul(2.5),
    }
    for name, op in ops.items():
        expected = op()
        with ScalarArgsAsTensors(): got = op()
        torch.testing.assert_close(got, expected, rtol=1e-15, atol=0, msg=name)
    for name, op in {'add_': lambda t: t.add_(y, alpha=0.7), 'addcdiv_': lambda t: t.addcdiv_(y, z.abs() + 1, value=2.),
                     'lerp_': lambda t: t.lerp_(y, 0.3), 'clamp_': lambda t: t.clamp_(-0.2, 0.5),
                     'clip_': lambda t: t.clip_(min=0.)}.items():
        expected = op(x.clone())
        t = x.clone()
        with ScalarArgsAsTensors(): got = op(t)
        assert got is t, name
        torch.testing.assert_close(t, expected, rtol=1e-15, atol=0, msg=name)


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
