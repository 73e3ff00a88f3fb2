"""`cbopt.engine.auto`: what `auto` runs and times (DTensors untimed with foreach, each runner `auto_trials` times,
torch's kernels where they apply, grads scaled inside the kernel)."""
from __future__ import annotations

import warnings

import pytest
import torch

import cbopt
from cbopt.engine import Backend
from cbopt.engine.flat import PACK_NUMEL as PACK
from conftest import count_calls, make_model, NO_COMPILE_FALLBACK, set_grads, sharded

pytestmark = NO_COMPILE_FALLBACK


def _adam_steps(backend: str, steps: int = 4, group: dict | None = None, **kw) -> torch.Tensor:
    "A 5-element param after `steps` Adam steps on fixed grads (its state created first: the kernel's case)."
    p = torch.nn.Parameter(torch.linspace(-1., 1., 5))
    opt = cbopt.Adam([{'params': [p], **(group or {})}], lr=0.1, backend=backend, **kw)
    opt.init_state()
    for i in range(steps):
        p.grad = torch.tensor([1., -2., 3., 0.5, -0.25]) * (i + 1)
        opt.step()
    return p.detach()


def test_auto_runs_dtensors_with_foreach_untimed(one_rank_mesh, monkeypatch) -> None:
    """On CPU, auto times foreach against loop (and the compiled chain, for a large elementwise bucket: any size here),
    but not for DTensors: a choice by timing could differ between ranks. The params step as plain ones do."""
    from cbopt.core.runtime import runtime
    from cbopt.engine import auto
    monkeypatch.setattr(auto, 'COMPILE_NUMEL', 1)
    calls = _count_compiled(monkeypatch)
    w = torch.nn.Parameter(sharded(one_rank_mesh, torch.arange(4.)))
    plain = torch.nn.Parameter(torch.arange(4.))
    opt, ref = cbopt.RMSProp([w], lr=0.1), cbopt.RMSProp([plain], lr=0.1, backend="loop")  # (no torch kernel)
    for i in range(3):
        w.grad, plain.grad = sharded(one_rank_mesh, torch.full((4,), i + 1.)), torch.full((4,), i + 1.)
        opt.step()
        ref.step()
    assert runtime(opt).auto_times == {} and calls == []
    torch.testing.assert_close(w.full_tensor().detach(), plain.detach(), rtol=0, atol=0)


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


def test_a_tensor_valued_kernel_number_runs_the_chain(monkeypatch) -> None:
    """torch's kernels take `mom`, `sqr_mom`, `eps` and `wd` as Python floats (a tensor lr aside): a tensor given as
    one of them, here a `mom` that requires grad (as in hypergradient descent; the kernel refuses such a tensor), runs
    the chain in the fused backend, which steps as the loop."""
    calls = count_calls(monkeypatch)
    mom = torch.tensor(0.9, requires_grad=True)
    got = _adam_steps('auto', mom=mom)
    assert calls == []
    torch.testing.assert_close(got, _adam_steps('loop', mom=mom), rtol=0, atol=0)
    assert _adam_steps('auto').shape == (5,) and len(calls) == 4  # a float mom runs the kernel


def test_an_adam_group_with_a_dampening_hyper_runs_the_chain(monkeypatch) -> None:
    """A group's `dampening` hyper reaches Adam's moment callbacks (`average_grad`, `average_sqr_grad`): False leaves
    both undamped, which torch's kernel does not compute (with eps=0.1 the update differs by a third), so the fused
    backend runs the chain for that group and steps as the loop."""
    calls = count_calls(monkeypatch)
    undamped = dict(group={'dampening': False}, eps=0.1)
    got = _adam_steps('auto', **undamped)
    assert calls == []
    torch.testing.assert_close(got, _adam_steps('loop', **undamped), rtol=0, atol=0)
    assert (got - _adam_steps('loop', eps=0.1)).abs().max() > 1e-2  # (the dampening changes the step)


def test_auto_scales_the_grads_inside_torchs_kernel(monkeypatch) -> None:
    """`auto`, as `fused`, hands `clip_grad_norm`'s coefficient to torch's kernel: no separate multiply of the grads
    (`_foreach_mul`), the user's grads left as they were."""
    calls = count_calls(monkeypatch)
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


@pytest.mark.parametrize('grouped', [False, True], ids=['one group', 'a group per param'])
def test_auto_runs_what_fused_runs_where_torch_has_the_kernel(grouped, monkeypatch) -> None:
    """Where torch's kernel computes the chain (the bench's Adam cases: one group, or one per param, alike), auto
    knows it is the fastest there is and makes fused's kernel calls, on the same params, no trial timed after the
    first step (which creates the state, with the chain), and steps bit for bit as fused does."""
    from cbopt.core.runtime import runtime
    calls = []
    kernel = torch._fused_adamw_
    monkeypatch.setattr(torch, '_fused_adamw_', lambda ps, *a, **k: calls.append([id(p) for p in ps]) or kernel(ps, *a, **k))
    runs = {}
    for backend in ('auto', 'fused'):
        model = make_model()
        params = [{'params': [p]} for p in model.parameters()] if grouped else model.parameters()
        opt = cbopt.Adam(params, lr=0.01, wd=0.1, backend=backend)
        calls.clear()
        for i in range(4):
            set_grads(model, i)
            opt.step()
        names = {id(p): n for n, p in model.named_parameters()}
        runs[backend] = ([[names[i] for i in c] for c in calls], [p.detach().clone() for p in model.parameters()],
                         runtime(opt).auto_times)
    (auto_calls, auto_params, times), (fused_calls, fused_params, _) = runs['auto'], runs['fused']
    assert auto_calls == fused_calls == [['0.weight', '0.bias', '2.weight', '2.bias']] * 3
    assert all(torch.equal(a, f) for a, f in zip(auto_params, fused_params))
    assert sum(len(t) for v in times.values() for t in v.values()) == 1  # (the first step's only)


def _lion_vs_loop(backend, steps: int = 8, model=None) -> tuple:
    "`make_model`'s params (83 elements) after `steps` Lion steps with `backend`, its optimizer, and the loop's params."
    out = []
    for be in (backend, 'loop'):
        m = model() if model else make_model()
        opt = cbopt.Lion(m.parameters(), lr=0.01, wd=0.1, backend=be)
        for i in range(steps):
            set_grads(m, i)
            opt.step()
        out.append((m, opt))
    return out[0][1], [p.detach() for p in out[0][0].parameters()], [p.detach() for p in out[1][0].parameters()]


def _count_compiled(monkeypatch) -> list:
    "A list that gets one entry (the bucket's size) per call of the compiled chain that `auto` makes."
    from cbopt.engine import auto
    calls, real = [], auto.compiled_bucket
    monkeypatch.setattr(auto, 'compiled_bucket', lambda opt, b, *a: calls.append(len(b.params)) or real(opt, b, *a))
    return calls


def test_auto_compiles_a_large_bucket_of_an_elementwise_chain(monkeypatch) -> None:
    """Lion (elementwise, no torch kernel) on a CPU bucket of at least `COMPILE_NUMEL` elements (lowered here to the
    model's 83): auto creates the state eagerly, then makes the compiled chain a candidate, compiles it once (untimed),
    times it `auto_trials` times beside foreach and the loop, and steps within the fused runner's tolerance of the loop
    (tests/test_backends.py's 1e-6), whichever it picks."""
    from cbopt.core.runtime import runtime
    from cbopt.engine import auto
    monkeypatch.setattr(auto, 'COMPILE_NUMEL', 83)
    calls = _count_compiled(monkeypatch)
    opt, got, ref = _lion_vs_loop('auto')
    times = [v for v in runtime(opt).auto_times.values() if 'compiled' in v]
    assert len(times) == 1 and all(len(t) == 2 for t in times[0].values()), runtime(opt).auto_times
    assert len(calls) >= 3 and set(calls) == {4}  # (the compile, 2 timed trials; more if it won)
    for a, b in zip(got, ref): torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


@pytest.mark.parametrize('why', ['small', 'tensor scope'])
def test_auto_does_not_compile_a_small_bucket_or_a_chain_over_whole_tensors(why, monkeypatch) -> None:
    """Below `COMPILE_NUMEL` (one element short here; the test suite's models and the bench's tiny sets are far below
    the default), and for a chain that reduces over whole params (Lamb's norms: no flat graph), auto never compiles:
    foreach and the loop only, as before, and the loop's numbers exactly."""
    from cbopt.core.runtime import runtime
    from cbopt.engine import auto
    monkeypatch.setattr(auto, 'COMPILE_NUMEL', 84 if why == 'small' else 1)
    calls = _count_compiled(monkeypatch)
    if why == 'small': opt, got, ref = _lion_vs_loop('auto')
    else:
        got, ref = [], []
        for be, out in (('auto', got), ('loop', ref)):
            m = make_model()
            opt = cbopt.Lamb(m.parameters(), lr=0.01, backend=be)
            for i in range(6):
                set_grads(m, i)
                opt.step()
            out += [p.detach() for p in m.parameters()]
    assert calls == []
    assert all(set(v) == {'foreach', 'loop'} for v in runtime(opt).auto_times.values())
    for a, b in zip(got, ref): torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_default_threshold_keeps_small_models_uncompiled(monkeypatch) -> None:
    """With the default `COMPILE_NUMEL`, Lion on a small model (a 6-256-3 MLP, as the suite's and the quick bench's
    models are: thousands of elements) keeps today's choice, foreach or the loop: no compile in CI."""
    from cbopt.engine import auto
    assert auto.COMPILE_NUMEL >= 1 << 20
    calls = _count_compiled(monkeypatch)
    _lion_vs_loop('auto', model=lambda: torch.nn.Sequential(torch.nn.Linear(6, 256), torch.nn.Tanh(), torch.nn.Linear(256, 3)))
    assert calls == []


def _steps_as_plain_sgd(opt, ps: list, ref: list, steps: int) -> None:
    """Step `opt` (plain SGD, lr 0.1, on `ps`) `steps` times, warnings as errors, each step's params exactly those of
    `p - 0.1 * grad` on `ref` (every param stepped once, none twice)."""
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        for i in range(steps):
            for p, r in zip(ps, ref):
                p.grad = torch.linspace(0., 1., p.numel()) * (i + 1)
                r.add_(p.grad, alpha=-0.1)
            opt.step()
            for p, r in zip(ps, ref): torch.testing.assert_close(p.detach(), r, rtol=0, atol=0)


def _breaks_graphs(p, **kwargs):
    "An elementwise callback that torch.compile cannot put in one graph (an explicit graph break); eagerly, nothing."
    torch._dynamo.graph_break()


_breaks_graphs.scope, _breaks_graphs.state = 'element', {}


def test_a_chain_that_does_not_compile_drops_the_candidate_quietly(monkeypatch) -> None:
    """An elementwise chain above the threshold that dynamo cannot compile in one graph: auto tries once, warns
    nothing (it was not asked to compile), steps the bucket with foreach (every param once: the loop's numbers), and
    never tries again."""
    from cbopt.core.runtime import runtime
    from cbopt.engine import auto
    monkeypatch.setattr(auto, 'COMPILE_NUMEL', 1)
    calls = _count_compiled(monkeypatch)
    ps = [torch.nn.Parameter(torch.linspace(-1., 1., n)) for n in (3, 4)]
    ref = [p.detach().clone() for p in ps]
    opt = cbopt.Optimizer(ps, [_breaks_graphs, cbopt.sgd_step], lr=0.1, backend=Backend('auto', compiler='eager'))
    _steps_as_plain_sgd(opt, ps, ref, 8)
    assert calls == [2]
    assert all(set(v) == {'foreach', 'loop'} for v in runtime(opt).auto_times.values())


def test_a_compile_failure_after_some_chunks_ran_steps_only_the_rest(monkeypatch) -> None:
    """A compiled call that fails on a later chunk (`CompileFailed.rest`: the params it did not touch): auto steps
    only those with foreach, so that every param steps once, none twice, and drops the candidate."""
    from cbopt.engine import auto, compiled
    monkeypatch.setattr(auto, 'COMPILE_NUMEL', 1)
    ps = [torch.nn.Parameter(torch.linspace(-1., 1., PACK + 1 + n)) for n in range(4)]  # (not packed: one place each)
    ref = [p.detach().clone() for p in ps]
    opt = cbopt.Optimizer(ps, [cbopt.sgd_step], lr=0.1, backend=Backend('auto', compiler='eager', compile_chunk=2))
    tries = []

    def chain(*args, **kwargs):
        def fn(qs, ts, pystate, hyper):
            tries.append(len(qs))
            if len(tries) > 1: raise RuntimeError('inductor: unsupported op')
            for q in qs: q.add_(q.grad, alpha=-0.1)  # (the first chunk steps)
            return [{} for _ in qs], {}
        return fn
    monkeypatch.setattr(compiled, 'compiled_chain', chain)
    _steps_as_plain_sgd(opt, ps, ref, 6)
    assert tries == [2, 2]
