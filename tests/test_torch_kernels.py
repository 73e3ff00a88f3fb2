"""torch's fused SGD and Adagrad kernels (`torch._fused_sgd_`, `torch._fused_adagrad_`), which cbopt's `fused` and
`auto` backends run for the SGD and Adagrad chains (`cbopt.engine.kernels.fused_sgd`, `fused_adagrad`): bit for bit
torch's own fused optimizers from the same state (torch's state_dict loaded, so the interchange is checked too), under
`torch.amp.GradScaler` as well (the kernel divides the grads, an inf step changes nothing); a bucket the kernel does
not compute exactly (decoupled decay, a DTensor-less rule aside) runs the chain. Their parity with the loop over 100
steps is `tests/test_backends.py` (registry cases `sgd-*-l2`, `sgd-nesterov`, `sgd-dampening`, `sgd-maximize`,
`adagrad-l2`)."""
import copy

import pytest
import torch
from torch import optim

import cbopt
from conftest import assert_same_params, batch_loss, make_model, set_grads, train

pytestmark = pytest.mark.usefixtures('one_thread')

STEPS = 30
# id: (torch.optim class, its hypers): cbopt.optim's class of the same name takes them as they are
CONFIGS = {
    'sgd-l2':          ('SGD', dict(lr=0.05, weight_decay=0.1)),
    'sgd-momentum':    ('SGD', dict(lr=0.05, momentum=0.9, weight_decay=0.1)),
    'sgd-nesterov':    ('SGD', dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.1, maximize=True)),
    'sgd-dampening':   ('SGD', dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.1)),
    'adagrad':         ('Adagrad', dict(lr=0.05)),
    'adagrad-all':     ('Adagrad', dict(lr=0.05, lr_decay=0.02, weight_decay=0.1, initial_accumulator_value=0.2,
                                        eps=1e-6, maximize=True)),
}
KERNEL = {'SGD': '_fused_sgd_', 'Adagrad': '_fused_adagrad_'}


def count_calls(monkeypatch, name: str) -> list:
    "A list that gets one entry per call of torch's kernel `name`."
    calls, real = [], getattr(torch, name)
    monkeypatch.setattr(torch, name, lambda *a, **k: calls.append(k) or real(*a, **k))
    return calls


@pytest.mark.parametrize('backend', ['fused', 'auto'])
@pytest.mark.parametrize('name', CONFIGS)
def test_bit_exact_with_torchs_fused_optimizer(name, backend, monkeypatch):
    """After torch's fused optimizer's first step, its state_dict loads into cbopt's twin (on a copy of the model), and
    30 more steps of each give the same params and state bit for bit: the same kernel on the same numbers."""
    cls, hypers = CONFIGS[name]
    ref = make_model()
    ref_opt = getattr(optim, cls)(ref.parameters(), **hypers, fused=True)
    train(ref_opt, ref, 1)
    model = copy.deepcopy(ref)
    opt = getattr(cbopt.optim, cls)(model.named_parameters(), **hypers, **({'fused': True} if backend == 'fused' else {}))
    opt.load_state_dict(ref_opt.state_dict())
    calls = count_calls(monkeypatch, KERNEL[cls])
    for i in range(1, STEPS + 1):
        train(ref_opt, ref, 1, start=i), train(opt, model, 1, start=i)
        assert_same_params(model, ref, f'{name} step {i}')
    assert len(calls) == 2 * STEPS  # ours and torch's, at every step (one bucket: one group, one dtype)
    ours, theirs = opt.state_dict(), ref_opt.state_dict()  # (cbopt.optim's default: torch's names)
    for i, st in theirs['state'].items():
        assert ours['state'][i].keys() == st.keys()
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(ours['state'][i][k]).to(v.dtype), v), (i, k)


@pytest.mark.parametrize('name', ['sgd-momentum', 'adagrad-all'])
def test_grad_scaler_as_torchs_fused_optimizer(name, monkeypatch):
    """Under GradScaler the kernel gets the scale (the scaler only checks for infs: its unscaling multiplier is 1) and
    divides the grads in its pass, leaving them unscaled as torch's fused optimizer does; an inf step changes nothing;
    params bit for bit torch's fused optimizer's under the same scaler."""
    cls, hypers = CONFIGS[name]
    ref = make_model()
    ref_opt = getattr(optim, cls)(ref.parameters(), **hypers, fused=True)
    train(ref_opt, ref, 1)  # (the state exists: the kernel steps ours from the first scaled step)
    model = copy.deepcopy(ref)
    opt = getattr(cbopt.optim, cls)(model.named_parameters(), **hypers, fused=True)
    opt.load_state_dict(ref_opt.state_dict())
    assert opt._step_supports_amp_scaling and ref_opt._step_supports_amp_scaling
    calls = count_calls(monkeypatch, KERNEL[cls])
    scalers = [torch.amp.GradScaler('cpu', init_scale=2. ** 14, growth_interval=3) for _ in range(2)]
    for i in range(1, 12):
        before = copy.deepcopy(([p.detach() for p in model.parameters()], [opt.state[p] for p in model.parameters()]))
        for m, o, sc in ((model, opt, scalers[0]), (ref, ref_opt, scalers[1])):
            o.zero_grad()
            sc.scale(batch_loss(m, i)).backward()
            if i in (3, 4): m[2].bias.grad[0] = float('inf')
            sc.step(o)
            sc.update()
        assert scalers[0].get_scale() == scalers[1].get_scale()
        assert_same_params(model, ref, f'{name} step {i}')
        for p, q in zip(model.parameters(), ref.parameters()): assert torch.equal(p.grad, q.grad)  # unscaled alike
        if i in (3, 4):
            assert opt.step_stats['skipped_by'] == 'GradScaler'
            for p, q in zip(model.parameters(), before[0]): assert torch.equal(p, q)
            for p, st in zip(model.parameters(), before[1]):
                assert all(torch.equal(opt.state[p][k], v) if torch.is_tensor(v) else opt.state[p][k] == v
                           for k, v in st.items())
    ours = [c['grad_scale'] for c in calls if 'found_inf' not in c]  # (torch's calls pass it, even at inf steps)
    assert len(ours) == 9 and None not in ours and len({s.item() for s in ours}) >= 3  # the scale moved both ways


def test_fastai_sgd_runs_the_kernel_only_without_decoupled_decay(monkeypatch):
    """cbopt.SGD decays decoupled by default (fastai's), which torch's kernel cannot: its buckets at zero decay (the
    default wd=0, or params flagged do_wd=False) run the kernel, the others the chain; the loop's result either way."""
    calls = count_calls(monkeypatch, '_fused_sgd_')
    for wd, no_wd_bias, expected in ((0., False, 1), (0.1, False, 0), (0.1, True, 1)):  # (buckets the kernel takes)
        model, ref = make_model(), make_model()
        opt, ref_opt = (cbopt.SGD(m.named_parameters(), lr=0.05, mom=0.9, wd=wd, backend=be)
                        for m, be in ((model, 'auto'), (ref, 'loop')))
        if no_wd_bias:
            for o, m in ((opt, model), (ref_opt, ref)): o.state[m[2].bias]['do_wd'] = False
        calls.clear()
        for i in range(5):
            train(opt, model, 1, start=i), train(ref_opt, ref, 1, start=i)
        # the first step creates the momentum buffer (the chain runs); then one call per bucket the kernel takes
        assert len(calls) == expected * 4, (wd, no_wd_bias)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert (p - q).abs().max() <= 1e-6 * q.abs().max()


def test_kernel_refuses_what_it_does_not_compute(monkeypatch):
    """Buckets outside the kernel's math run the chain: momentum set to 0 on a momentum chain (whose buffer still
    becomes the grad, which the kernel would leave as it is), bfloat16 params (the kernel computes in float32)."""
    calls = count_calls(monkeypatch, '_fused_sgd_')
    model, ref = make_model(), make_model()
    opt, ref_opt = (cbopt.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, **kw) for m, kw in
                    ((model, {'fused': True}), (ref, {'foreach': False})))
    train(opt, model, 2), train(ref_opt, ref, 2)
    for o in (opt, ref_opt): o.param_groups[0]['mom'] = 0.
    calls.clear()
    train(opt, model, 2, start=2), train(ref_opt, ref, 2, start=2)
    assert not calls
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p - q).abs().max() <= 1e-6 * q.abs().max()
        assert torch.equal(opt.state[p]['grad_avg'], p.grad)  # the buffer is the last grad (plus L2: none here)
    half = make_model(dtype=torch.bfloat16)
    opt = cbopt.optim.SGD(half.parameters(), lr=0.05, momentum=0.9, fused=True)
    train(opt, half, 3)
    assert not calls
