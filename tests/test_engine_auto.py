"""`cbopt.engine.auto`: what `auto` runs and times (DTensors untimed with foreach, each runner `auto_trials` times,
torch's kernels where they apply, grads scaled inside the kernel)."""
from __future__ import annotations

import pytest
import torch

import cbopt
from cbopt.engine import Backend
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


def test_auto_runs_dtensors_with_foreach_untimed(one_rank_mesh) -> None:
    """On CPU, auto times foreach against loop, but not for DTensors: a choice by timing could differ between ranks.
    The params step as plain ones do."""
    from cbopt.core.runtime import runtime
    w = torch.nn.Parameter(sharded(one_rank_mesh, torch.arange(4.)))
    plain = torch.nn.Parameter(torch.arange(4.))
    opt, ref = cbopt.RMSProp([w], lr=0.1), cbopt.RMSProp([plain], lr=0.1, backend="loop")  # (no torch kernel)
    for i in range(3):
        w.grad, plain.grad = sharded(one_rank_mesh, torch.full((4,), i + 1.)), torch.full((4,), i + 1.)
        opt.step()
        ref.step()
    assert runtime(opt).auto_times == {}
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
