"""`cbopt.engine.compiled`: the compiled chain (one graph per elementwise chain, its fallback to foreach with one
warning, DTensor params of a chain over whole tensors, what `torch.compile` is asked for)."""
from __future__ import annotations

import warnings

import pytest
import torch

import cbopt
from cbopt.core.chain import per_tensor, zeros
from cbopt.engine import buckets as bucketing
from cbopt.engine import compiled
from cbopt.engine.flat import can_flatten
from conftest import NO_COMPILE_FALLBACK, sharded

pytestmark = NO_COMPILE_FALLBACK


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


def _breaks_graphs(p, **kwargs):
    "A callback torch.compile cannot put in one graph (an explicit graph break); eagerly, nothing."
    torch._dynamo.graph_break()


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
    w = torch.nn.Parameter(sharded(one_rank_mesh, torch.linspace(-1., 1., 6)))
    plain = torch.nn.Parameter(torch.linspace(-1., 1., 6))
    opt = cbopt.Lamb([w], lr=0.1, backend=cbopt.Backend('fused', compiler='eager'))
    ref = cbopt.Lamb([plain], lr=0.1, backend='loop')
    for i in range(3):
        g = torch.linspace(-2., 3., 6) * (i + 1)
        w.grad, plain.grad = sharded(one_rank_mesh, g), g.clone()
        opt.step(), ref.step()
    torch.testing.assert_close(w.full_tensor().detach(), plain.detach(), rtol=1e-6, atol=0)


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


@pytest.mark.parametrize('failure', ['compiler', 'device'])
def test_a_device_failure_is_raised_not_stepped_again_with_foreach(failure, monkeypatch) -> None:
    """The fallback to foreach hands back the params of the chunk that raised, which only a compiler's error leaves
    untouched: a device's failure (a CUDA launch error, `torch.AcceleratorError`) may come after some of the chunk's
    kernels ran, so it propagates rather than stepping those params again with foreach."""
    ps = [torch.nn.Parameter(torch.linspace(-1., 1., n)) for n in (3, 4)]
    opt = cbopt.Optimizer(ps, [cbopt.sgd_step], lr=0.1, backend=cbopt.Backend('fused', compiler='eager'))
    for p in ps: p.grad = torch.ones_like(p)
    opt.step()  # (the first step of a layout runs foreach: the next one compiles)
    err = torch.AcceleratorError('CUDA error: an illegal memory access was encountered') if failure == 'device' \
        else RuntimeError('inductor: unsupported op')

    def chain(*args, **kwargs):
        def fn(ps, ts, pystate, hyper): raise err
        return fn
    fallbacks = []
    real_foreach = compiled.foreach_bucket
    monkeypatch.setattr(compiled, 'compiled_chain', chain)
    monkeypatch.setattr(compiled, 'foreach_bucket', lambda *a: fallbacks.append(a) or real_foreach(*a))
    before = [p.detach().clone() for p in ps]
    if failure == 'device':
        with pytest.raises(torch.AcceleratorError): opt.step()
        assert not fallbacks
    else:
        with pytest.warns(UserWarning, match='could not be compiled'): opt.step()
        assert len(fallbacks) == 1
        for p, b in zip(ps, before): torch.testing.assert_close(p.detach(), b - 0.1, rtol=0, atol=0)


def bf16_cubic_step(p, lr, **kwargs):
    """A step on fp32 params computed in bf16, tensor by tensor, as Muon's Newton-Schulz iteration is: eager mode
    rounds each bf16 op, which inductor must do too."""
    u = p.grad.data.bfloat16()
    p.data.sub_((u * u * u + u * u).float(), alpha=lr)
bf16_cubic_step.state = {}


def test_bf16_math_in_an_fp32_chain_rounds_as_eager() -> None:
    """Inductor computes a run of bf16 ops in fp32 and rounds once at the end unless told to round each as eager does
    (`emulate_precision_casts`, in `cbopt._torch.chain_settings`): the compiled chain asks for it whatever the params' dtype, so a chain that computes
    in bf16 on fp32 params (Muon's Newton-Schulz iteration: 3e-3 of the largest weight off the loop after 20 steps on
    the CPU, 0.06 on an H200, without it) follows the loop backend."""
    ps = {b: [torch.nn.Parameter(torch.linspace(-1., 1., 300).view(20, 15))] for b in ('loop', 'fused')}
    opts = {b: cbopt.Optimizer(ps[b], [bf16_cubic_step], lr=0.01, backend=b) for b in ps}
    for i in range(6):
        for b in ps:
            ps[b][0].grad = torch.linspace(-3., 2., 300).view(20, 15).sin() * (i + 1)
            opts[b].step()
    torch.testing.assert_close(ps['fused'][0].detach(), ps['loop'][0].detach(), rtol=1e-6, atol=1e-6)  # (0.036 without)
