"""The callback contract (cbopt/chain.py) as users meet it: per-group chains, declared state, transient state,
two callbacks creating one entry, a callback's real errors, warnings at the user's line, backend options."""
import warnings

import pytest
import torch
from torch import nn

import cbopt
from cbopt import chain
from conftest import NO_COMPILE_FALLBACK, assert_rel_close, make_model, set_grads

pytestmark = NO_COMPILE_FALLBACK

SGD_MOM = [cbopt.weight_decay, cbopt.average_grad, cbopt.momentum_step]


def adamw_chain(): return cbopt.adam_chain()


# -- per-group chains ----------------------------------------------------------------------------------------------
def per_group(model, backend='loop'):
    "Weights by SGD with momentum (their own chain and lr), biases by AdamW (the optimizer's chain)."
    named = list(model.named_parameters())
    weights = [(n, p) for n, p in named if n.endswith('weight')]
    biases = [(n, p) for n, p in named if n.endswith('bias')]
    return cbopt.Optimizer([{'params': weights, 'cbs': SGD_MOM, 'lr': 0.05, 'mom': 0.8},
                            {'params': biases}], adamw_chain(), lr=3e-3, wd=0.01, backend=backend)


def torch_per_group(model):
    "The same with torch.optim: two optimizers, one per kind of param."
    named = list(model.named_parameters())
    sgd = torch.optim.SGD([p for n, p in named if n.endswith('weight')], lr=0.05, momentum=0.8)
    adamw = torch.optim.AdamW([p for n, p in named if n.endswith('bias')], lr=3e-3, betas=(0.9, 0.99), eps=1e-5,
                              weight_decay=0.01)
    return sgd, adamw


@pytest.mark.parametrize('backend', ['loop', 'foreach', 'auto'])
def test_per_group_chains_follow_torch(backend):
    "Each group runs its own chain with its own hypers: SGD(momentum) on weights and AdamW on biases, as torch's pair."
    ours, ref = make_model(), make_model()
    opt, (sgd, adamw) = per_group(ours, backend), torch_per_group(ref)
    with torch.no_grad():  # torch's SGD decays by L2 in the grad; ours decoupled: no decay on weights (wd=0) to match
        opt.param_groups[0]['wd'] = 0.
    for i in range(30):
        set_grads(ours, i), set_grads(ref, i)
        opt.step(), sgd.step(), adamw.step()
        assert_rel_close(ours, ref, rtol=1e-6, msg=f"step {i}:")


def test_per_group_hyper_defaults_come_from_the_groups_chain():
    opt = per_group(make_model())
    g0, g1 = opt.hypers
    assert g0['lr'] == 0.05 and g0['mom'] == 0.8 and 'sqr_mom' not in g0 and 'eps' not in g0
    assert g1['lr'] == 3e-3 and g1['mom'] == 0.9 and g1['sqr_mom'] == 0.99 and g1['eps'] == 1e-5
    assert g0['wd'] == g1['wd'] == 0.01  # given to the optimizer: every group


def test_per_group_chains_one_checkpoint_and_schedulers():
    "One optimizer: a scheduler drives both groups; one checkpoint records each group's chain and resumes exactly."
    a, b = make_model(), make_model()
    opt = per_group(a)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for i in range(4):
        set_grads(a, i)
        opt.step(), sched.step()
    assert [g['lr'] for g in opt.param_groups] == [0.05 / 4, 3e-3 / 4]
    sd = opt.state_dict()
    assert [g['chain'] for g in sd['param_groups']] == [chain.chain_name(SGD_MOM), chain.chain_name(adamw_chain())]
    named = opt.named_state_dict()
    assert set(named['state']['0.weight']) == {'grad_avg'} and set(named['state']['0.bias']) == {'grad_avg', 'sqr_avg', 'step'}
    with torch.no_grad():
        for p, q in zip(b.parameters(), a.parameters()): p.copy_(q)
    resumed = per_group(b)
    resumed.load_state_dict(sd)
    for i in range(4, 8):
        set_grads(a, i), set_grads(b, i)
        opt.step(), resumed.step()
    for p, q in zip(a.parameters(), b.parameters()): assert torch.equal(p, q)


def test_loading_another_chain_into_a_group_names_the_group():
    a = make_model()
    opt = per_group(a)
    set_grads(a, 0)
    opt.step()
    sd = opt.state_dict()
    swapped = cbopt.Optimizer([{'params': [(n, p) for n, p in a.named_parameters() if n.endswith('weight')]},
                               {'params': [(n, p) for n, p in a.named_parameters() if n.endswith('bias')], 'cbs': SGD_MOM}],
                              adamw_chain(), lr=3e-3)
    with pytest.raises(ValueError, match=r"param group 0 \('0.weight', '2.weight'\) was saved by the chain "
                                         r"\[weight_decay,average_grad,momentum_step\]"):
        swapped.load_state_dict(sd)


def test_add_param_group_with_its_own_chain():
    m = make_model()
    opt = cbopt.Optimizer(list(m[0].parameters()), adamw_chain(), lr=1e-3)
    opt.add_param_group({'params': list(m[2].parameters()), 'cbs': [cbopt.sgd_step], 'lr': 0.1})
    assert set(opt.hypers[0]) == {'lr', 'wd', 'mom', 'sqr_mom', 'eps'} and set(opt.hypers[1]) == {'lr'}
    before = [p.detach().clone() for p in m[2].parameters()]
    set_grads(m, 0)
    opt.step()
    for p, b in zip(m[2].parameters(), before): torch.testing.assert_close(p, b.add(p.grad, alpha=-0.1), rtol=0, atol=0)
    assert not opt.state[m[2].weight]


def test_callback_appended_to_cbs_runs_in_default_groups():
    "fastai style: `opt.cbs.append(cb)` after construction runs in every group that has no chain of its own."
    seen = []
    def record(p, lr, **kw): seen.append(lr)
    record.state = {}
    m = make_model()
    opt = cbopt.SGD([list(m[0].parameters()), list(m[2].parameters())], lr=0.1)
    opt.cbs.append(record)
    set_grads(m, 0)
    opt.backend = 'loop'
    opt.step()
    assert seen == [0.1] * 4


# -- declared state ------------------------------------------------------------------------------------------------
def test_declared_state_is_what_the_chain_creates():
    "Every built-in callback's declaration matches the state its first step creates (checked through check_callback)."
    p = torch.randn(3, 2)
    assert chain.init_chain_state(adamw_chain(), p).keys() == {'grad_avg', 'sqr_avg', 'step'}
    st = chain.init_chain_state(cbopt.lookahead(SGD_MOM), p)
    assert torch.equal(st['slow_p'], p) and st['la_step'] == 0 and not st['grad_avg'].any()
    assert chain.is_declared(adamw_chain()) and not chain.is_declared([_fastai_momentum, cbopt.momentum_step])


def _fastai_momentum(p, mom, grad_avg=None, **kwargs):
    "A fastai-style callback: it declares nothing (its state is found by a dry run)."
    if grad_avg is None: grad_avg = torch.zeros_like(p.grad)
    grad_avg.mul_(mom).add_(p.grad)
    return {'grad_avg': grad_avg}


def test_an_entry_made_by_the_first_step():
    """torch SGD's dampened momentum buffer (`at_first_step`): absent before the first step, as in torch's state, so
    the first step keeps the grad whole; its template (zeros) where a checkpoint's entries are asked for."""
    p = torch.randn(3, 2)
    cbs = [cbopt.dampened_grad_avg, cbopt.momentum_step]
    assert chain.is_declared(cbs) and chain.chain_scope(cbs) == 'element'
    assert chain.init_chain_state(cbs, p) == {}
    st = chain.init_chain_state(cbs, p, template=True)
    assert st.keys() == {'grad_avg'} and st['grad_avg'].shape == p.shape and not st['grad_avg'].any()
    with pytest.raises(TypeError, match='initializer'): chain.at_first_step(0.)


def test_scopes():
    assert chain.chain_scope(adamw_chain()) == 'element'
    assert chain.chain_scope(cbopt.adam_chain(cbopt.lamb_step)) == 'tensor'
    assert chain.chain_scope([cbopt.larc_layer_lr, cbopt.larc_step]) == 'tensor'
    assert chain.chain_scope([_fastai_momentum, cbopt.momentum_step]) is None  # undeclared: unknown
    def bad(p, **kw): pass
    bad.state, bad.scope = {}, 'row'
    with pytest.raises(ValueError, match="callback 'bad' declares scope 'row'"): cbopt.Optimizer([torch.zeros(1, requires_grad=True)], [bad])


def test_transient_state_lives_one_step():
    "Larc's layer lr is used in its step only: never in the state afterwards, never in a checkpoint; old ones load."
    m = make_model()
    opt = cbopt.Larc(m.parameters(), lr=0.1)
    for backend in ('loop', 'foreach'):
        opt.backend = backend
        set_grads(m, 0)
        opt.step()
        assert all('local_lr' not in opt.state[p] for p in opt.params)
    sd = opt.state_dict()
    assert all('local_lr' not in s for s in sd['state'].values())
    for s in sd['state'].values(): s['local_lr'] = torch.tensor(0.5)  # as cbopt saved it before transient state
    cbopt.Larc(m.parameters(), lr=0.1).load_state_dict(sd)


def ema_a(p, grad_avg=None, **kw):
    grad_avg = torch.zeros_like(p.grad) if grad_avg is None else grad_avg
    grad_avg.mul_(0.5).add_(p.grad)
    return {'grad_avg': grad_avg}


def ema_b(p, grad_avg=None, **kw):
    grad_avg = torch.zeros_like(p.grad) if grad_avg is None else grad_avg
    grad_avg.mul_(0.9).add_(p.grad)
    return {'grad_avg': grad_avg}


def test_two_declared_callbacks_creating_one_entry_is_rejected_at_construction():
    def avg2(p, **kw): pass
    avg2.state = dict(grad_avg=chain.zeros)
    with pytest.raises(ValueError, match=r"callbacks 'average_grad' and 'avg2' both create the state entry 'grad_avg'"):
        cbopt.Optimizer([torch.zeros(2, requires_grad=True)], [cbopt.average_grad, avg2, cbopt.momentum_step])
    avg2.shared = ('grad_avg',)
    with pytest.raises(ValueError, match='both create'):  # sharing takes both to declare it
        cbopt.Optimizer([torch.zeros(2, requires_grad=True)], [cbopt.average_grad, avg2, cbopt.momentum_step])


def test_declared_sharing_is_allowed():
    def avg2(p, **kw): pass
    avg2.state, avg2.shared = dict(grad_avg=chain.zeros), ('grad_avg',)
    shared_avg = lambda p, **kw: cbopt.average_grad(p, **kw)
    shared_avg.defaults, shared_avg.state, shared_avg.shared = dict(mom=0.9), dict(grad_avg=chain.zeros), ('grad_avg',)
    cbopt.Optimizer([torch.zeros(2, requires_grad=True)], [shared_avg, avg2, cbopt.momentum_step])


@pytest.mark.parametrize('backend', ['loop', 'foreach', 'auto'])
def test_undeclared_callbacks_creating_one_entry_fail_before_any_change(backend):
    m = make_model()
    opt = cbopt.Optimizer(m.parameters(), [ema_a, ema_b, cbopt.momentum_step], lr=0.1, backend=backend)
    set_grads(m, 0)
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(ValueError, match=r"callbacks 'ema_a' and 'ema_b' both create the state entry 'grad_avg'"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before)) and not any(opt.state[p] for p in opt.params)


# -- errors and warnings -------------------------------------------------------------------------------------------
def wrong_shape(p, **kw):
    "A real bug: adds a tensor of the wrong shape."
    p.grad.add_(torch.ones(7))


@pytest.mark.parametrize('backend', ['loop', 'foreach', 'fused', 'auto'])
def test_a_callbacks_real_error_is_raised_as_itself(backend):
    "No 'cannot run on a whole bucket' warning first: the RuntimeError, and (bucket backends) before any change."
    m = make_model()
    opt = cbopt.Optimizer(m.parameters(), [wrong_shape, cbopt.sgd_step], lr=0.1, backend=backend)
    set_grads(m, 0)
    before = [p.detach().clone() for p in m.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        with pytest.raises(RuntimeError, match='size'): opt.step()
    if backend != 'loop': assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before))


def branchy(p, grad_avg=None, **kw):
    "Python control flow on a tensor value: cannot run bucket-wise."
    if p.grad.abs().max() > 0: p.data.sub_(p.grad, alpha=0.1)
branchy.state = {}


@pytest.mark.parametrize('backend', ['foreach', 'auto'])
def test_fallback_warning_points_at_the_users_line(backend):
    m = make_model()
    opt = cbopt.Optimizer(m.parameters(), [branchy], backend=backend)
    set_grads(m, 0)
    with pytest.warns(UserWarning, match="callback 'branchy' cannot run on a whole bucket") as w:
        opt.step()
    assert w[0].filename == __file__
    assert str(w[0].message) == ("callback 'branchy' cannot run on a whole bucket of params (e.g. Python control flow "
                                 "on a tensor value); its buckets run param by param")


def test_backend_options_are_per_optimizer():
    ps = list(make_model().parameters())
    a = cbopt.Adam(ps, backend=cbopt.Backend('foreach', cpu_chunk_bytes=1 << 10))
    b = cbopt.Adam(ps)
    assert a.backend == 'foreach' and a.backend_options.cpu_chunk_bytes == 1 << 10 and b.backend_options == cbopt.Backend()
    a.backend = 'loop'  # a kind name keeps the settings
    assert a.backend_options == cbopt.Backend('loop', cpu_chunk_bytes=1 << 10)
    with pytest.raises(ValueError, match="unknown backend 'fast'"): cbopt.Backend('fast')
    with pytest.raises(ValueError, match='auto_trials must be a positive int'): cbopt.Backend(auto_trials=0)
    with pytest.raises(TypeError, match='backend must be a str or a cbopt.Backend'): cbopt.Adam(ps, backend=3)


def test_lookahead_refuses_an_in_backward_optimizer():
    m = make_model()
    with pytest.raises(TypeError, match=r"InBackward\(Lookahead\(opt\)\)"): cbopt.Lookahead(cbopt.InBackward(cbopt.SGD(m.parameters())))
