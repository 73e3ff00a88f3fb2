"""`cbopt.InBackward`: params step in their post-accumulate-grad hooks. The reference is always the wrapped optimizer
stepping normally after backward, on a copy of the model and the same batches."""
import copy
import functools
import weakref

import pytest
import torch
from torch import nn

import cbopt
from conftest import assert_moved, assert_rel_close, assert_same_params, make_model, set_grads, train, two_groups

pytestmark = pytest.mark.usefixtures('one_thread')
FUSED = cbopt.Backend('fused', compiler='aot_eager')


def adam(model, backend='loop'): return cbopt.Adam(model.named_parameters(), lr=1e-2, wd=0.1, backend=backend)
def sgd(model, backend='loop'): return cbopt.SGD(two_groups(model, named=True), lr=slice(1e-2, 3e-2), mom=0.8, wd=0.05, backend=backend)
def ranger(model, backend='loop'): return cbopt.ranger(model.named_parameters(), lr=5e-2, k=2, backend=backend)


def combined(model, backend='loop'):
    "Two chains in one optimizer (per-group chains), as a CombinedOptimizer builds it."
    return cbopt.CombinedOptimizer([('enc', cbopt.Adam(model[0].named_parameters(), lr=1e-2, backend=backend)),
                                    ('head', cbopt.SGD(model[2].named_parameters(), lr=3e-2, mom=0.8, backend=backend))])


BUILDERS = {'adam': adam, 'sgd': sgd, 'ranger': ranger, 'combined': combined}


CASES = [(n, b) for n in BUILDERS for b in ['loop', 'foreach', 'auto', FUSED]
         if b is not FUSED or n in ('adam', 'sgd')]  # compiling costs seconds per chain: one kernel chain, one compiled


@pytest.mark.parametrize('name,backend', CASES, ids=[f"{n}-{getattr(b, 'kind', b)}" for n, b in CASES])
def test_equal_to_stepping_after_backward(name, backend):
    """Bit for bit the wrapped optimizer's params and state, and every grad freed by backward. In backward a param
    steps by the loop (or torch's kernel where the backend uses it), so only a compiled chain (fused, no kernel) may
    differ from the normal step, by its rounding."""
    build = BUILDERS[name]
    ref, ours = make_model(), make_model()
    start = copy.deepcopy(ours)
    ref_opt, opt = build(ref, backend), cbopt.InBackward(build(ours, backend))
    assert isinstance(opt, torch.optim.Optimizer) and opt.backend_options == ref_opt.backend_options
    for i in range(5):
        set_grads(ref, i)
        ref_opt.step()
        set_grads(ours, i)  # backward steps every param
        assert all(p.grad is None for p in ours.parameters())
        opt.step()
        opt.zero_grad()
    compiled = backend is FUSED and name != 'adam'
    if compiled: assert_rel_close(ours, ref, rtol=1e-6)
    else: assert_same_params(ours, ref, f'{name} {backend}')
    assert_moved(ours, start)
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert sd['param_groups'] == ref_sd['param_groups'] and sd['state'].keys() == ref_sd['state'].keys()
    if not compiled:
        for n, st in ref_sd['state'].items():
            assert st.keys() == sd['state'][n].keys()
            for k, v in st.items(): assert torch.equal(torch.as_tensor(sd['state'][n][k]), torch.as_tensor(v)), (n, k)


@pytest.mark.parametrize('backend', ['auto', 'loop'])
def test_torch_kernel_in_backward_where_the_backend_uses_it(backend, monkeypatch):
    "cbopt's AdamW steps each param with torch's fused kernel in backward under `auto` (after the first step), not under `loop`."
    calls, kernel = [], torch._fused_adamw_
    monkeypatch.setattr(torch, '_fused_adamw_', lambda *a, **k: calls.append(len(a[0])) or kernel(*a, **k))
    model = make_model()
    train(cbopt.InBackward(adam(model, backend)), model, 3)
    assert calls == ([1] * 8 if backend == 'auto' else [])  # 4 params, one at a time, on steps 2 and 3


def test_step_does_not_step_again():
    "After backward stepped every param, `step()` changes nothing but still runs the step hooks; zero_grad is harmless."
    model = make_model()
    opt = cbopt.InBackward(adam(model))
    calls = []
    opt.register_step_post_hook(lambda o, a, k: calls.append(o))
    set_grads(model, 0)
    after_backward = copy.deepcopy(model)
    opt.step()
    opt.zero_grad()
    assert_same_params(model, after_backward)
    assert calls == [opt]
    assert not torch.equal(model[0].weight, make_model()[0].weight)  # backward did step


def test_grads_set_by_hand_step_in_step():
    "A grad given by hand (not by backward) is stepped by `step()`, as the wrapped optimizer would, once."
    ref, ours = make_model(), make_model()
    ref_opt, opt = adam(ref), cbopt.InBackward(adam(ours))
    for m in (ref, ours):
        for p in m.parameters(): p.grad = torch.full_like(p, 0.5)
    ref_opt.step()
    opt.step()
    opt.step()  # grads are still there: the normal optimizer would step again too
    ref_opt.step()
    assert_same_params(ours, ref)


def test_lr_scheduler():
    "A scheduler on the InBackward optimizer gives the lrs and params of the same scheduler on the normal step, without warning."
    ref, ours = make_model(), make_model()
    ref_opt, opt = sgd(ref), cbopt.InBackward(sgd(ours))
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=10) for o in (ref_opt, opt)]
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # e.g. "lr_scheduler.step() before optimizer.step()"
        for i in range(6):
            train(ref_opt, ref, 1, start=i)
            train(opt, ours, 1, start=i)
            for s in scheds: s.step()
    assert [(g['lr'], g['mom']) for g in opt.param_groups] == [(g['lr'], g['mom']) for g in ref_opt.param_groups]
    assert_same_params(ours, ref)


def test_checkpoints_load_both_ways():
    "Its state_dict is the wrapped optimizer's: a normal checkpoint resumes in backward and back, bit for bit."
    ref, ours = make_model(), make_model()
    ref_opt, opt = adam(ref), cbopt.InBackward(adam(ours))
    train(ref_opt, ref, 3)
    train(opt, ours, 3)
    ours2, ref2 = copy.deepcopy(ours), copy.deepcopy(ref)
    into_inbwd, into_normal = cbopt.InBackward(adam(ref2)), adam(ours2)
    into_inbwd.load_state_dict(ref_opt.state_dict())
    into_normal.load_state_dict(opt.state_dict())
    for o, m in ((ref_opt, ref), (opt, ours), (into_inbwd, ref2), (into_normal, ours2)): train(o, m, 3, start=3)
    assert_same_params(ref2, ref)
    assert_same_params(ours2, ref)
    assert_same_params(ours, ref)


def test_closure():
    "`step(closure)`: the closure's backward steps the params, `step` returns its loss."
    ref, ours = make_model(), make_model()
    ref_opt, opt = adam(ref), cbopt.InBackward(adam(ours))
    from conftest import batch_loss
    def closure(m, o):
        o.zero_grad()
        loss = batch_loss(m, 0)
        loss.backward()
        return loss
    assert ref_opt.step(functools.partial(closure, ref, ref_opt)).item() == opt.step(functools.partial(closure, ours, opt)).item()
    assert_same_params(ours, ref)


def test_refuses_whole_model_callbacks():
    "A callback that needs every grad at once (`scope == 'model'`) is refused by name, as is wrapping twice."
    def clip_all(p, **kwargs): pass
    clip_all.state = {}
    model = make_model()
    opt = cbopt.Optimizer([{'params': model[0].parameters(), 'cbs': [clip_all, cbopt.sgd_step]},
                           {'params': model[2].parameters()}], [cbopt.sgd_step], lr=0.1)
    clip_all.scope = 'model'  # declared after building: the core's scope check is another change
    with pytest.raises(ValueError, match=r"'clip_all' \(group 0\) need every grad at once"): cbopt.InBackward(opt)
    ok_model = make_model()
    ok = cbopt.InBackward(cbopt.SGD(ok_model.named_parameters()))
    with pytest.raises(ValueError, match='clip_all'):  # (by InBackward, or by the core's chain check)
        ok.add_param_group({'params': [nn.Parameter(torch.ones(2))], 'cbs': [clip_all, cbopt.sgd_step]})
    assert len(ok.param_groups) == 1
    ok.cbs.append(clip_all)  # fastai-style, after building: refused when a hook would run it
    with pytest.raises(ValueError, match=r"'clip_all' \(group 0\) need every grad"): set_grads(ok_model, 0)
    clipped = cbopt.Optimizer(make_model().named_parameters(), [cbopt.clip_grad_norm, cbopt.sgd_step], lr=0.1, max_norm=1.)
    with pytest.raises(ValueError, match=r"'clip_grad_norm' \(group 0\) need every grad at once"): cbopt.InBackward(clipped)
    with pytest.raises(TypeError, match="wraps a cbopt optimizer"): cbopt.InBackward(torch.optim.SGD(model.parameters()))
    with pytest.raises(TypeError, match="already steps in backward"): cbopt.InBackward(cbopt.InBackward(adam(make_model())))


def test_one_inbackward_per_param_and_remove_hooks():
    "A second InBackward on the same params is refused (each param would step twice) until the first removes its hooks."
    ref, ours = make_model(), make_model()
    first = cbopt.InBackward(adam(ours))
    with pytest.raises(ValueError, match="param '0.weight' already steps in backward"): cbopt.InBackward(adam(ours))
    first.remove_hooks()
    set_grads(ours, 0)
    assert all(p.grad is not None for p in ours.parameters())  # not stepped in backward any more
    first.step()  # steps them as the normal optimizer does
    ref_opt = adam(ref)
    train(ref_opt, ref, 1)
    assert_same_params(ours, ref)
    second = cbopt.InBackward(adam(make_model()))
    assert second is not first


def test_frozen_params_step_in_backward_once_unfrozen():
    "A param frozen when the optimizer was built (no hook possible) is hooked by `freeze_to` when it becomes trainable."
    ref, ours = make_model(), make_model()
    for m in (ref, ours): m[0].requires_grad_(False)
    ref_opt, opt = sgd(ref), cbopt.InBackward(sgd(ours))
    train(ref_opt, ref, 2)
    train(opt, ours, 2)
    for o in (ref_opt, opt): o.unfreeze()
    set_grads(ours, 2)
    assert all(p.grad is None for p in ours.parameters())
    opt.step()
    train(ref_opt, ref, 1, start=2)
    assert_same_params(ours, ref)


def grad_bytes_tracker(model: nn.Module) -> dict:
    """Hooks (registered before the optimizer's, so each runs while its own grad exists) that record the bytes of the
    grads alive at once, through weakrefs: a grad counts until it is really freed."""
    alive, out = [], {'max': 0}
    def hook(p):
        alive.append((weakref.ref(p.grad), p.grad.numel() * p.grad.element_size()))
        out['max'] = max(out['max'], sum(n for r, n in alive if r() is not None))
    for p in model.parameters(): p.register_post_accumulate_grad_hook(hook)
    return out


def test_grads_never_all_alive():
    """On a model of a few MB (16 layers of 256x256), at most one param's grad is alive at any time in backward, where
    the normal step holds them all: more than 90% of the grads' bytes saved."""
    def mlp(): return nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(16)])
    torch.manual_seed(0)
    ref = mlp()
    ours = copy.deepcopy(ref)
    total = sum(p.numel() * p.element_size() for p in ref.parameters())
    largest = max(p.numel() * p.element_size() for p in ref.parameters())
    peaks = []
    x = torch.randn(32, 256)
    for m, opt in ((ref, adam(ref)), (ours, None)):
        tracker = grad_bytes_tracker(m)
        if opt is None: opt = cbopt.InBackward(adam(m))
        m(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        peaks.append(tracker['max'])
    assert peaks[0] == total
    assert peaks[1] == largest
    assert peaks[1] <= 0.1 * total, (peaks, total)
    assert_same_params(ours, ref)


def test_copy_steps_its_own_params():
    "A deep copy of (model, optimizer) steps the copied params in backward, and leaves the original's alone."
    model = make_model()
    opt = cbopt.InBackward(adam(model))
    train(opt, model, 1)
    model2, opt2 = copy.deepcopy((model, opt))
    before = copy.deepcopy(model)
    ref = copy.deepcopy(model)
    ref_opt = adam(ref)
    ref_opt.load_state_dict(opt.state_dict())
    train(opt2, model2, 2, start=1)
    train(ref_opt, ref, 2, start=1)
    assert all(p.grad is None for p in model2.parameters())
    assert_same_params(model2, ref)
    assert_same_params(model, before)


@pytest.mark.parametrize('how', ['stepped', 'loaded'])
@pytest.mark.parametrize('name', list(BUILDERS))
def test_wrapping_keeps_the_state(name, how):
    """`InBackward(opt)` on an optimizer that has already stepped (or that just loaded a checkpoint) goes on from its
    state: the next steps equal a twin's, the same optimizer stepped normally throughout, bit for bit (params and
    state). A wrapper that started from fresh state (zero moments, step 1 again) would part at once."""
    build = BUILDERS[name]
    ref, ours = make_model(), make_model()
    ref_opt, opt = build(ref), build(ours)
    train(ref_opt, ref, 3)
    train(opt, ours, 3)
    if how == 'loaded':  # a fresh optimizer on the same params, loading the stepped one's checkpoint
        sd = opt.state_dict()
        opt = build(ours)
        opt.load_state_dict(sd)
    wrapped = cbopt.InBackward(opt)
    for i in range(3, 6):
        train(ref_opt, ref, 1, start=i)
        set_grads(ours, i)  # backward steps every param
        wrapped.step()
    assert_same_params(ours, ref, f'{name} {how}:')
    sd, ref_sd = wrapped.state_dict(), ref_opt.state_dict()
    assert sd['state'].keys() == ref_sd['state'].keys()
    for n, st in ref_sd['state'].items():
        for k, v in st.items(): assert torch.equal(torch.as_tensor(sd['state'][n][k]), torch.as_tensor(v)), (n, k)
