"""`cbopt.engine.model_stage`: whole-model callbacks (those around the per-param chains): their hypers per group,
their contract errors, their per-param state, re-evaluating steps and the closure, GradScaler's found infs."""
from __future__ import annotations

import pytest
import torch

import cbopt
from cbopt.core.chain import zeros
from conftest import NO_COMPILE_FALLBACK

pytestmark = NO_COMPILE_FALLBACK


def _model_cb(ret: dict, name: str):
    def cb(params, **kwargs): return ret
    cb.__name__ = cb.__qualname__ = name
    cb.scope, cb.state, cb.transient = 'model', {}, ()
    return cb


def _accumulating(**kw):
    "A whole-model callback summing the grads into its per-param state `grad_sum` (made by `zeros`, a callable)."
    def summing(params, grad_sum, **kwargs):
        for tl, sums in zip(params, grad_sum): torch._foreach_add_(list(sums), list(tl.grad))
    summing.scope, summing.state, summing.transient, summing.param_state = 'model', {}, (), dict(grad_sum=zeros)
    for k, v in kw.items(): setattr(summing, k, v)
    return summing


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
