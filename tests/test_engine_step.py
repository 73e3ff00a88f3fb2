"""`cbopt.engine.step`: one optimizer step through the engine, with hand-worked expectations: the per-step stats,
grads no chain can step (refused before anything changes), complex params, transient and `None` state, a group in
eval mode. `test_backends.py` checks the backends against the loop over many steps."""
from __future__ import annotations

import pytest
import torch

import cbopt
from conftest import NO_COMPILE_FALLBACK, sharded

pytestmark = NO_COMPILE_FALLBACK


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


def _step_by_grad_norm(p, lr, **kwargs):
    "A user's callback reading its grad's norm as a Python number: on a shard, that rank's part of it only."
    p.data.sub_(p.grad * (lr / max(float(torch.linalg.vector_norm(p.grad)), 1.0)))
_step_by_grad_norm.defaults, _step_by_grad_norm.state, _step_by_grad_norm.scope = dict(lr=0.1), {}, 'tensor'


def _forget_at_step_2(p, step=0, prev=None, **kwargs):
    "State that a callback sets to None on its second step (Python control flow on a Python value is allowed)."
    return {'step': step + 1, 'prev': None if step == 1 else p.grad * 1}


@pytest.mark.parametrize('backend', ['loop', 'foreach'])
def test_step_stats_name_the_lrs_used(backend) -> None:
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True)
    opt = cbopt.Optimizer([[a], [b]], [cbopt.sgd_step], lr=0.1, backend=backend)
    opt.set_hyper('lr', [0.1, 0.2])
    a.grad, b.grad = torch.ones(2), torch.ones(3)
    opt.step()
    assert opt.step_stats == {'lr': [0.1, 0.2], 'skipped': False}
    assert torch.equal(a, torch.full((2,), -0.1)) and torch.equal(b, torch.full((3,), -0.2))


@pytest.mark.parametrize('clip', [False, True], ids=['chain', 'whole-model'])
@pytest.mark.parametrize('backend', ['loop', 'foreach'])
@pytest.mark.parametrize('bad, err, msg', [
    (lambda b: setattr(b, 'grad', torch.ones(3).to_sparse()), RuntimeError,
     r"^param 'b' has a sparse gradient: '\w+' in the chain \[.*momentum_step\] does not support sparse gradients "
     r"\(densify it with "
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


@pytest.mark.filterwarnings('ignore:callback .* cannot run on a whole bucket')  # (foreach: it runs param by param)
@pytest.mark.parametrize('backend', ['loop', 'foreach'])
def test_a_python_number_of_a_partial_dtensor_is_rejected(one_rank_mesh, backend) -> None:
    "On DTensors, a chain that is not elementwise may not read a number of a reduction over a shard; nothing changes."
    from cbopt.core.dtensor import PartialNumberError
    w = torch.nn.Parameter(sharded(one_rank_mesh, torch.arange(4.)))
    opt = cbopt.Optimizer([w], [_step_by_grad_norm], backend=backend)
    w.grad = sharded(one_rank_mesh, torch.full((4,), 3.))
    with pytest.raises(PartialNumberError, match=r"^callback '_step_by_grad_norm' read a Python number \(__float__\)"):
        opt.step()
    torch.testing.assert_close(w.full_tensor().detach(), torch.arange(4.), rtol=0, atol=0)
    plain = torch.nn.Parameter(torch.arange(4.))              # a plain param: its number is its value
    opt = cbopt.Optimizer([plain], [_step_by_grad_norm], backend=backend)
    plain.grad = torch.full((4,), 3.)
    opt.step()
    torch.testing.assert_close(plain.detach(), torch.arange(4.) - 0.1 * 3. / 6.)


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
