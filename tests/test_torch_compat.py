"""cbopt's Optimizer is a real `torch.optim.Optimizer`: torch's LR schedulers (momentum cycling included), GradScaler,
closures, `zero_grad`, hooks, pickle and deepcopy all work on it as they do on torch.optim's own optimizers."""
import copy
import pickle

import pytest
import torch
from torch.optim import lr_scheduler

import cbopt
from conftest import batch_loss, make_model, random_grads, two_groups

N_STEPS = 12


def train_step(m, opt, i):
    "A torch training step: zero_grad, backward of batch `i`'s loss, step."
    opt.zero_grad()
    batch_loss(m, i).backward()
    opt.step()


def record(used, first):
    "A callback that records the hypers the chain actually sees for param `first` (alone, or in a bucket of params)."
    def rec(p, lr, mom, **kwargs):
        if p is first or (isinstance(p, list) and any(q is first for q in p)): used.append((lr, mom))
    return rec


def test_is_a_torch_optimizer():
    opt = cbopt.SGD(make_model().parameters(), lr=0.1)
    assert isinstance(opt, torch.optim.Optimizer)
    assert isinstance(cbopt.Adam(make_model().parameters()), torch.optim.Optimizer)


# -- LR schedulers -----------------------------------------------------------------------------------------------
SCHEDS = {
    'StepLR': lambda o: lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
    'CosineAnnealingLR': lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=N_STEPS, eta_min=1e-3),
    'LambdaLR': lambda o: lr_scheduler.LambdaLR(o, [lambda e: 0.9 ** e, lambda e: 1 / (1 + e)]),
    'OneCycleLR': lambda o: lr_scheduler.OneCycleLR(o, max_lr=[0.05, 0.1], total_steps=N_STEPS, pct_start=0.3,
                                                    base_momentum=0.8, max_momentum=0.95),
}


def make_pair(algo):
    "Our optimizer and torch's equivalent, over identical models split in two groups."
    ours_m, ref_m = make_model(), make_model()
    if algo == 'sgd':
        ours = cbopt.SGD(two_groups(ours_m), lr=0.1, mom=0.9)
        ref = torch.optim.SGD([{'params': ps} for ps in two_groups(ref_m)], lr=0.1, momentum=0.9)
    else:
        ours = cbopt.Adam(two_groups(ours_m), lr=0.01, mom=0.9, sqr_mom=0.99, eps=1e-5, wd=0.01)
        ref = torch.optim.AdamW([{'params': ps} for ps in two_groups(ref_m)], lr=0.01, betas=(0.9, 0.99), eps=1e-5,
                                weight_decay=0.01)
    return ours_m, ours, ref_m, ref


def ref_mom(g): return g['betas'][0] if 'betas' in g else g['momentum']


@pytest.mark.parametrize('algo', ['sgd', 'adamw'])
@pytest.mark.parametrize('name', SCHEDS)
def test_lr_schedulers_match_torch(name, algo):
    ours_m, ours, ref_m, ref = make_pair(algo)
    rec_m, rec_opt, _, _ = make_pair(algo)  # the same, with a callback recording the hypers it is given
    used = []
    rec_opt.cbs.append(record(used, rec_opt.params[0]))
    s_ours, s_ref, s_rec = SCHEDS[name](ours), SCHEDS[name](ref), SCHEDS[name](rec_opt)
    expected = []
    for i in range(N_STEPS):
        expected.append((ref.param_groups[0]['lr'], ref_mom(ref.param_groups[0])))
        assert [g['lr'] for g in ours.param_groups] == pytest.approx([g['lr'] for g in ref.param_groups], rel=1e-12)
        assert [h['mom'] for h in ours.hypers] == pytest.approx([ref_mom(g) for g in ref.param_groups], rel=1e-12)
        train_step(ours_m, ours, i), train_step(ref_m, ref, i), train_step(rec_m, rec_opt, i)
        s_ours.step(), s_ref.step(), s_rec.step()
        assert s_ours.get_last_lr() == pytest.approx(s_ref.get_last_lr(), rel=1e-12)
    flat = lambda pairs: [v for pair in pairs for v in pair]  # pytest.approx takes no nested tuples (pytest >= 9.2)
    assert len(used) == len(expected) and flat(used) == pytest.approx(flat(expected), rel=1e-12)  # lr, mom seen per step
    if name == 'OneCycleLR': assert len({m for _, m in used}) > 3  # momentum really cycled
    for p, q in zip(ours_m.parameters(), ref_m.parameters()): torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_reduce_lr_on_plateau_matches_torch():
    ours_m, ours, ref_m, ref = make_pair('sgd')
    s_ours, s_ref = lr_scheduler.ReduceLROnPlateau(ours, patience=1, factor=0.5), \
        lr_scheduler.ReduceLROnPlateau(ref, patience=1, factor=0.5)
    for i, metric in enumerate([1., .9, .9, .9, .8, .8, .8, .8]):
        train_step(ours_m, ours, i), train_step(ref_m, ref, i)
        s_ours.step(metric), s_ref.step(metric)
        assert [h['lr'] for h in ours.hypers] == [g['lr'] for g in ref.param_groups]
    assert ours.hypers[0]['lr'] < 0.1 / 2  # it did reduce
    for p, q in zip(ours_m.parameters(), ref_m.parameters()): torch.testing.assert_close(p, q)


# -- GradScaler --------------------------------------------------------------------------------------------------
def test_grad_scaler_matches_unscaled_run():
    scaled_m, plain_m = make_model(), make_model()
    scaled, plain = cbopt.Adam(scaled_m.named_parameters(), lr=0.01), cbopt.Adam(plain_m.named_parameters(), lr=0.01)
    scaler = torch.amp.GradScaler('cpu', init_scale=2. ** 12)
    assert scaler.is_enabled()
    for i in range(6):
        scaled.zero_grad(), plain.zero_grad()
        scaler.scale(batch_loss(scaled_m, i)).backward()
        batch_loss(plain_m, i).backward()
        assert scaled_m[0].weight.grad.abs().sum() > 1000 * plain_m[0].weight.grad.abs().sum()  # really scaled
        scaler.unscale_(scaled)  # unscales the grads in place, through param_groups
        for p, q in zip(scaled_m.parameters(), plain_m.parameters()): torch.testing.assert_close(p.grad, q.grad)
        scaler.step(scaled), plain.step()
        scaler.update()
    for p, q in zip(scaled_m.parameters(), plain_m.parameters()): torch.testing.assert_close(p, q)
    assert scaler.get_scale() == 2. ** 12


def test_grad_scaler_skips_step_on_inf():
    m = make_model()
    opt = cbopt.Adam(m.named_parameters(), lr=0.01)
    scaler = torch.amp.GradScaler('cpu', init_scale=2. ** 12)
    train_step(m, opt, 0)  # some state to keep
    before = copy.deepcopy((list(m.parameters()), {n: opt.state[p] for n, p in opt.named_params().items()}))
    opt.zero_grad()
    scaler.scale(batch_loss(m, 1)).backward()
    m[2].bias.grad[0] = float('inf')
    scaler.step(opt)
    scaler.update()
    for p, q in zip(m.parameters(), before[0]): torch.testing.assert_close(p, q, rtol=0, atol=0)
    for n, p in opt.named_params().items():
        assert opt.state[p]['step'] == before[1][n]['step'] == 1
        torch.testing.assert_close(opt.state[p]['grad_avg'], before[1][n]['grad_avg'], rtol=0, atol=0)
    assert scaler.get_scale() == 2. ** 11  # backed off


# -- closure and zero_grad ---------------------------------------------------------------------------------------
def test_step_with_closure():
    ours_m, ref_m = make_model(), make_model()
    ours, ref = cbopt.SGD(ours_m.parameters(), lr=0.1, mom=0.9), cbopt.SGD(ref_m.parameters(), lr=0.1, mom=0.9)
    seen = []

    def closure():
        seen.append(torch.is_grad_enabled())
        ours.zero_grad()
        loss = batch_loss(ours_m, len(seen))
        loss.backward()
        return loss
    for i in range(1, 4):
        with torch.no_grad(): loss = ours.step(closure)  # grad is enabled inside the closure even so
        assert torch.is_tensor(loss) and loss.item() == pytest.approx(batch_loss(ref_m, i).item())
        train_step(ref_m, ref, i)
    assert seen == [True] * 3
    for p, q in zip(ours_m.parameters(), ref_m.parameters()): torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert ours.step() is None


def test_zero_grad():
    m = make_model()
    opt = cbopt.SGD(m.parameters(), lr=0.1)
    batch_loss(m, 0).backward()
    grads = [p.grad for p in m.parameters()]
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is g and not g.any() for p, g in zip(m.parameters(), grads))  # zeroed in place
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in m.parameters())
    batch_loss(m, 0).backward()
    opt.zero_grad()  # torch's default: set to None
    assert all(p.grad is None for p in m.parameters())


# -- hooks -------------------------------------------------------------------------------------------------------
def test_step_hooks():
    m = make_model()
    opt = cbopt.SGD(m.parameters(), lr=0.1)
    calls = []

    def closure():
        opt.zero_grad()
        loss = batch_loss(m, 0)
        loss.backward()
        return loss
    w0 = m[0].weight.detach().clone()
    h1 = opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(('pre', o is opt)))
    h2 = opt.register_step_pre_hook(lambda o, args, kwargs: (args, {'closure': closure}))  # args[0] is opt
    h3 = opt.register_step_post_hook(lambda o, args, kwargs: calls.append(('post', not torch.equal(m[0].weight, w0),
                                                                           'closure' in kwargs)))
    loss = opt.step()
    assert calls == [('pre', True), ('post', True, True)]
    assert torch.is_tensor(loss)  # the step ran the closure the pre hook handed it
    for h in (h1, h2, h3): h.remove()
    opt.step()
    assert len(calls) == 2


def test_state_dict_hooks():
    m = make_model()
    opt = cbopt.SGD(m.named_parameters(), lr=0.1, mom=0.9)
    train_step(m, opt, 0)
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append('pre'))
    opt.register_state_dict_post_hook(lambda o, sd: sd['param_groups'][0].update(note='in place'))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, 'extra': 1})  # a returned dict replaces the state_dict
    sd = opt.state_dict()
    assert calls == ['pre'] and sd['extra'] == 1 and sd['param_groups'][0]['note'] == 'in place'
    assert [n for g in sd['param_groups'] for n in g['param_names']] == [n for n, _ in m.named_parameters()]

    def pre(o, sd):
        calls.append(('load-pre', o.param_groups[0]['lr']))
        return {'state': sd['state'], 'param_groups': [{**g, 'lr': 0.5} for g in sd['param_groups']]}
    opt.register_load_state_dict_pre_hook(pre)
    opt.register_load_state_dict_post_hook(lambda o: calls.append(('load-post', o.param_groups[0]['lr'])))
    opt.load_state_dict(sd)
    assert calls[1:] == [('load-pre', 0.1), ('load-post', 0.5)]  # the pre hook's dict was the one loaded
    assert opt.hypers[0]['lr'] == 0.5


# -- pickle and deepcopy -----------------------------------------------------------------------------------------
@pytest.mark.parametrize('how', ['deepcopy', 'pickle'])
def test_copy_steps_identically_and_independently(how):
    m = make_model()
    opt = cbopt.Adam(m.named_parameters(), lr=0.01)
    opt.register_step_post_hook(lambda *a: None)  # hooks (often lambdas) must not stop pickling
    opt.state[opt.params[1]]['do_wd'] = False
    for i in range(3): random_grads(opt.params, i), opt.step()
    twin = copy.deepcopy(opt) if how == 'deepcopy' else pickle.loads(pickle.dumps(opt))
    assert isinstance(twin, cbopt.Optimizer) and twin.param_names == opt.param_names and twin.hypers == opt.hypers
    assert all(p is not q and not p.data_ptr() == q.data_ptr() for p, q in zip(opt.params, twin.params))
    assert all(set(twin.state[q]) == set(opt.state[p]) for p, q in zip(opt.params, twin.params))
    assert twin.state[twin.params[1]]['do_wd'] is False
    calls = []
    twin.register_step_pre_hook(lambda *a: calls.append(1))  # the copy's hooks work
    frozen = [p.detach().clone() for p in opt.params]
    for i in range(3, 6): random_grads(twin.params, i), twin.step()
    assert calls == [1, 1, 1]
    for p, f in zip(opt.params, frozen): torch.testing.assert_close(p, f, rtol=0, atol=0)  # original untouched
    assert all(opt.state[p]['step'] == 3 for p in opt.params)
    for i in range(3, 6): random_grads(opt.params, i), opt.step()
    for p, q in zip(opt.params, twin.params): torch.testing.assert_close(p, q, rtol=0, atol=0)
    for p, q in zip(opt.params, twin.params):
        for k, v in opt.state[p].items():
            if torch.is_tensor(v): torch.testing.assert_close(v, twin.state[q][k], rtol=0, atol=0)
            else: assert v == twin.state[q][k]


@pytest.mark.parametrize('how', ['deepcopy', 'pickle'])
def test_copy_with_a_scheduler_attached(how):
    "LR schedulers patch `opt.step` on the instance, bound to the original: a copy must step itself (as torch's do)."
    m = make_model()
    opt = cbopt.SGD(m.parameters(), lr=0.1)
    lr_scheduler.StepLR(opt, step_size=2)
    twin = copy.deepcopy(opt) if how == 'deepcopy' else pickle.loads(pickle.dumps(opt))
    random_grads(twin.params, 0), random_grads(opt.params, 0)
    w, t = opt.params[0].detach().clone(), twin.params[0].detach().clone()
    twin.step()
    torch.testing.assert_close(opt.params[0], w, rtol=0, atol=0)
    torch.testing.assert_close(twin.params[0], t - 0.1 * twin.params[0].grad)
