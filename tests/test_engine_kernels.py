"""torch's fused SGD and Adagrad kernels (`torch._fused_sgd_`, `torch._fused_adagrad_`), which cbopt's `fused` and
`auto` backends run for the SGD and Adagrad chains (`cbopt.engine.kernels.fused_sgd`, `fused_adagrad`): bit for bit
torch's own fused optimizers from the same state (torch's state_dict loaded, so the interchange is checked too), under
`torch.amp.GradScaler` as well (the kernel divides the grads, an inf step changes nothing); a bucket the kernel does
not compute exactly (decoupled decay, a DTensor-less rule aside) runs the chain. Their parity with the loop over 100
steps is `tests/test_backends.py` (registry cases `sgd-*-l2`, `sgd-nesterov`, `sgd-dampening`, `sgd-maximize`,
`adagrad-l2`)."""
import copy
import warnings

import pytest
import torch
from torch import optim

import cbopt
from cbopt.core.runtime import param_states
from cbopt.engine import buckets as bucketing, dispatch
from conftest import assert_same_params, assert_tensors_close, batch_loss, count_calls, EAGER, make_model, NO_COMPILE_FALLBACK, params_and_grads, sharded, train

pytestmark = [pytest.mark.usefixtures('one_thread'), NO_COMPILE_FALLBACK]

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


def fused_twins(cls: str, hypers: dict, **ours) -> tuple:
    """torch's fused `cls` after one step (its state exists), and cbopt.optim's twin (built with `ours`) on a copy of the
    model with that state loaded: `(ref, ref_opt, model, opt)`."""
    ref = make_model()
    ref_opt = getattr(optim, cls)(ref.parameters(), **hypers, fused=True)
    train(ref_opt, ref, 1)
    model = copy.deepcopy(ref)
    opt = getattr(cbopt.optim, cls)(model.named_parameters(), **hypers, **ours)
    opt.load_state_dict(ref_opt.state_dict())
    return ref, ref_opt, model, opt


@pytest.mark.parametrize('backend', ['fused', 'auto'])
@pytest.mark.parametrize('name', CONFIGS)
def test_bit_exact_with_torchs_fused_optimizer(name, backend, monkeypatch):
    """After torch's fused optimizer's first step, its state_dict loads into cbopt's twin (on a copy of the model), and
    30 more steps of each give the same params and state bit for bit: the same kernel on the same numbers."""
    cls, hypers = CONFIGS[name]
    ref, ref_opt, model, opt = fused_twins(cls, hypers, **({'fused': True} if backend == 'fused' else {}))
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
    ref, ref_opt, model, opt = fused_twins(cls, hypers, fused=True)  # (from the first scaled step: state exists)
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
    ours = [c['grad_scale'] for c in calls if c.get('found_inf') is None]  # (torch's pass it, even at inf steps;
    # ours read it on the host, on the CPU)
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


def _kernel_bucket(*numels: int, dtype=torch.float64, keys=('a', 'b')) -> bucketing.Bucket:
    "A bucket of params of these sizes, with seeded grads and state entries `keys` (tensors like the params)."
    g = torch.Generator().manual_seed(sum(numels))
    ps = [torch.randn(n, dtype=dtype, generator=g) for n in numels]
    for p in ps: p.grad = torch.randn(p.shape, dtype=dtype, generator=g)
    return bucketing.Bucket({}, ps, [{k: torch.randn(p.shape, dtype=dtype, generator=g) for k in keys} for p in ps])


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_scaled_slices_cut_large_params_join_small_ones_in_one_reused_buffer(monkeypatch, dtype) -> None:
    """Runs of at most SCALE_CHUNK elements (8 here) of flat slices: params of 3 and 5 elements fill the first run
    exactly, the 20-element one is cut into 8, 8 and 4, whose last slice the 1-element param joins, and the 7-element
    one starts a run of its own. Each slice views its param (and each state entry) in place; each run's scaled grads
    are its grads times the scale in the param's dtype, written one after another from the start of one buffer of 8
    elements, reused by every run (so a run is read before the next is made); the grads themselves are not written;
    no warning (an output of the wrong size is resized, with a warning)."""
    from cbopt.engine import kernels
    monkeypatch.setattr(kernels, 'SCALE_CHUNK', 8)
    b = _kernel_bucket(3, 5, 20, 1, 7, dtype=dtype)
    grads = [p.grad.clone() for p in b.params]
    scale = torch.tensor(0.3, dtype=torch.float32)
    expected = [[(0, 0, 3), (1, 0, 5)], [(2, 0, 8)], [(2, 8, 8)], [(2, 16, 4), (3, 0, 1)], [(4, 0, 7)]]
    got, buffers = [], set()
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        for ps, gs, a, b_ in kernels._scaled_slices(b, scale, ('a', 'b')):
            run, used = [], 0
            for p, g, sa, sb in zip(ps, gs, a, b_, strict=True):
                i = next(i for i, q in enumerate(b.params) if q.untyped_storage().data_ptr() == p.untyped_storage().data_ptr())
                start, n = p.storage_offset(), p.numel()
                run.append((i, start, n))
                for t, whole in ((p, b.params[i]), (sa, b.states[i]['a']), (sb, b.states[i]['b'])):
                    assert t.data_ptr() == whole.data_ptr() + start * whole.element_size() and t.shape == (n,)
                assert g.dtype == dtype and torch.equal(g, grads[i][start:start + n] * scale.to(dtype))
                assert g.storage_offset() == used  # one after another from the buffer's start
                buffers.add((g.untyped_storage().data_ptr(), g.untyped_storage().nbytes()))
                used += n
            got.append(run)
    assert got == expected
    assert [nbytes for _, nbytes in buffers] == [8 * torch.empty(0, dtype=dtype).element_size()]  # one, of 8
    assert all(torch.equal(p.grad, g) for p, g in zip(b.params, grads))
    one = _kernel_bucket(4, dtype=dtype)  # a bucket of one param: one run, a buffer of its size
    (ps, gs, a, b_), = kernels._scaled_slices(one, scale, ('a', 'b'))
    assert ps[0].data_ptr() == one.params[0].data_ptr() and torch.equal(gs[0], one.params[0].grad * scale.to(dtype))
    assert gs[0].untyped_storage().nbytes() == 4 * one.params[0].element_size()


@pytest.mark.parametrize('entry', ['torch_kernel', 'fused_adamw'])
def test_a_kernel_given_a_grad_scale_steps_as_torchs_clip_then_fused_adamw(monkeypatch, entry) -> None:
    """`torch_kernel(b, hyper, grad_scale=c)`, and `fused_adamw(b, hyper, grad_scale=c)` with its defaults (no
    maximize, no amsgrad), step as torch's `clip_grad_norm_` (whose coefficient is `c`) then its fused AdamW, bit for
    bit (the same kernel on the same scaled grads), float64 params cut into runs (SCALE_CHUNK 16: the 48-element
    weight is cut, the biases join others); by default (not in place) the user's grads are left as they were."""
    from conftest import assert_same_params, make_model, set_grads
    from cbopt.engine import kernels
    from cbopt.core.hypers import Hypers
    monkeypatch.setattr(kernels, 'SCALE_CHUNK', 16)
    hypers = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-5, weight_decay=0.01)
    model, ref = make_model(dtype=torch.float64), make_model(dtype=torch.float64)
    opt = cbopt.optim.AdamW(model.parameters(), **hypers, fused=True)
    opt.init_state()
    ref_opt = torch.optim.AdamW(ref.parameters(), **hypers, fused=True)
    for i in range(5):
        set_grads(model, i), set_grads(ref, i)
        given = [(p.grad, p.grad.clone()) for p in model.parameters()]
        coef = torch.clamp(0.05 / (torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05) + 1e-6), max=1.0)
        assert coef < 1  # (it clips)
        for b in bucketing.buckets(opt):
            hyper = Hypers(b.group).snapshot()
            run = getattr(kernels, entry)(b, hyper, grad_scale=coef)
            assert run is not None
            run()
        ref_opt.step()
        assert_same_params(model, ref, f'step {i}')
        for p, (g, before) in zip(model.parameters(), given): assert p.grad is g and torch.equal(g, before)
    assert [opt.state[p]['step'] for p in model.parameters()] == [5] * 4


@pytest.mark.parametrize('clip', [False, True])
def test_the_kernels_tensors_go_on_the_params_device_not_the_default_one(monkeypatch, clip) -> None:
    """Under `with torch.device('meta')` (a default device, as when a model is built on meta) CPU params step with
    torch's kernel as without it: its step count and the buffer of clipped grads (`clip_grad_norm`, on copies) are
    made on the params' device."""
    calls = count_calls(monkeypatch)

    def run(default_device: str) -> list:
        m = torch.nn.Linear(4, 3)
        grads = []
        for i in range(3):
            m.zero_grad()
            m(torch.linspace(-1, 1, 8).view(2, 4) * (i + 1)).square().sum().backward()
            grads.append([p.grad.clone() for p in m.parameters()])
        with torch.device(default_device):
            opt = cbopt.Adam(m.parameters(), lr=0.1, backend='fused')
            if clip: opt = cbopt.GradientClippingOptimizer(opt, cbopt.GradientClipping.NORM, 0.05)
            opt.init_state()
            for gs in grads:
                for p, g in zip(m.parameters(), gs): p.grad = g
                opt.step()
        return [p.detach() for p in m.parameters()]
    torch.manual_seed(0)
    expected = run('cpu')
    calls.clear()
    torch.manual_seed(0)
    got = run('meta')
    assert len(calls) == 3
    for g, e in zip(got, expected, strict=True): torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_dtensor_params_step_with_torchs_adam_kernel(one_rank_mesh, monkeypatch) -> None:
    """DTensor has a sharding rule for torch's Adam kernels (not for its SGD and Adagrad ones): params sharded as
    DTensors step with `_fused_adamw_`, as plain params do, bit for bit."""
    calls = count_calls(monkeypatch)
    w = torch.nn.Parameter(sharded(one_rank_mesh, torch.linspace(-1., 1., 6)))
    plain = torch.nn.Parameter(torch.linspace(-1., 1., 6))
    opts = [cbopt.Adam([q], lr=0.1, backend='fused') for q in (w, plain)]
    for o in opts: o.init_state()
    for i in range(3):
        g = torch.linspace(-2., 3., 6) * (i + 1)
        w.grad, plain.grad = sharded(one_rank_mesh, g), g.clone()
        for o in opts: o.step()
    assert len(calls) == 6
    torch.testing.assert_close(w.full_tensor().detach(), plain.detach(), rtol=0, atol=0)


def test_fused_sgd_with_its_defaults_is_torchs_fused_sgd_with_l2() -> None:
    """`fused_sgd(b, hyper)` with its defaults (no momentum, L2 decay, no maximize) steps as torch's fused SGD with
    `weight_decay`, bit for bit."""
    from conftest import assert_same_params, make_model, set_grads
    from cbopt.engine import kernels
    from cbopt.core.hypers import Hypers
    model, ref = make_model(), make_model()
    opt = cbopt.optim.SGD(model.parameters(), lr=0.05, weight_decay=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, weight_decay=0.1, fused=True)
    for i in range(3):
        set_grads(model, i), set_grads(ref, i)
        for b in bucketing.buckets(opt):
            run = kernels.fused_sgd(b, Hypers(b.group).snapshot())
            assert run is not None
            run()
        ref_opt.step()
        assert_same_params(model, ref, f'step {i}')


def test_a_tensor_lr_steps_with_torchs_kernel(monkeypatch) -> None:
    """A 0-d tensor lr on the params' device is what torch's fused kernels take too: cbopt's Adam steps with
    `_fused_adamw_`, bit for bit torch's fused Adam given the same tensor lr."""
    calls = count_calls(monkeypatch)
    start, grads = params_and_grads([(4, 3), (5,)], 4, seed=6)
    ps, qs = [torch.nn.Parameter(t.clone()) for t in start], [torch.nn.Parameter(t.clone()) for t in start]
    opt = cbopt.Adam(ps, lr=torch.tensor(0.01), mom=0.9, sqr_mom=0.999, eps=1e-8, wd=0., backend='fused')
    ref = torch.optim.Adam(qs, lr=torch.tensor(0.01), fused=True)
    for gs in grads:
        for p, q, gr in zip(ps, qs, gs): p.grad, q.grad = gr.clone(), gr.clone()
        opt.step(), ref.step()
    assert_tensors_close(ps, qs, rtol=0)
    assert len(calls) == len(grads) - 1  # ours from the second step (the first makes the state; torch's is _fused_adam_)


@pytest.mark.parametrize('wd', [0., 0.1])
def test_decoupled_adagrad_runs_its_chain_unless_it_has_no_decay(wd, monkeypatch) -> None:
    """torch's Adagrad kernel decays by L2 only: cbopt's Adagrad with `decouple_wd=True` steps with it only at zero
    decay, else with its chain (as the loop backend), over 4 steps."""
    calls = count_calls(monkeypatch, '_fused_adagrad_')
    start, grads = params_and_grads([(4, 3), (5,)], 4, seed=7)
    ps, qs = [torch.nn.Parameter(t.clone()) for t in start], [torch.nn.Parameter(t.clone()) for t in start]
    opt = cbopt.Adagrad(ps, lr=0.1, wd=wd, decouple_wd=True, backend=EAGER)
    ref = cbopt.Adagrad(qs, lr=0.1, wd=wd, decouple_wd=True, backend='loop')
    for gs in grads:
        for p, q, gr in zip(ps, qs, gs): p.grad, q.grad = gr.clone(), gr.clone()
        opt.step(), ref.step()
    assert_tensors_close(ps, qs)
    assert len(calls) == (0 if wd else len(grads) - 1)


@pytest.mark.parametrize('make, kernel', [(lambda ps, b: cbopt.SGD(ps, lr=0.1, mom=0.9, backend=b), '_fused_sgd_'),
                                          (lambda ps, b: cbopt.Adagrad(ps, lr=0.1, backend=b), '_fused_adagrad_')],
                         ids=['sgd', 'adagrad'])
def test_dtensor_params_of_sgd_and_adagrad_do_not_reach_their_kernels(make, kernel, one_rank_mesh, monkeypatch) -> None:
    """DTensor has no sharding rule for torch's SGD and Adagrad kernels: params sharded as DTensors step with the
    chain (compiled), as plain params do with the kernel."""
    calls = count_calls(monkeypatch, kernel)
    w = torch.nn.Parameter(sharded(one_rank_mesh, torch.linspace(-1., 1., 6)))
    plain = torch.nn.Parameter(torch.linspace(-1., 1., 6))
    opts = [make([w], EAGER), make([plain], EAGER)]
    for i in range(3):
        g = torch.linspace(-2., 3., 6) * (i + 1)
        w.grad, plain.grad = sharded(one_rank_mesh, g), g.clone()
        for o in opts: o.step()
    assert len(calls) == 2  # the plain param's steps after its first
    torch.testing.assert_close(w.full_tensor().detach(), plain.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize('name', ['adamw', 'sgd-momentum', 'adagrad-all'])
def test_grad_scaler_found_inf_on_the_device_as_torchs_fused_optimizer(name, monkeypatch):
    """On a GPU (the CPU standing in for one here: `HOST_READ_DEVICES` emptied), a step whose buckets all take torch's
    kernel hands GradScaler's `found_inf` to the kernel and never reads it (`step_stats['skipped']` is that flag), the
    step counts counted on the device: params, grads and step counts bit for bit torch's fused optimizer's under the
    same scaler, inf steps included. Without the scaler afterwards, the counts are numbers again and both go on alike;
    a checkpoint taken in between holds numbers."""
    monkeypatch.setattr(dispatch, 'HOST_READ_DEVICES', ())
    cls, hypers = {'adamw': ('AdamW', dict(lr=0.05, betas=(0.8, 0.95), weight_decay=0.1)), **CONFIGS}[name]
    ref, ref_opt, model, opt = fused_twins(cls, hypers, fused=True)  # (from the first scaled step: state exists)
    scalers = [torch.amp.GradScaler('cpu', init_scale=2. ** 14, growth_interval=3) for _ in range(2)]
    for i in range(1, 9):
        for m, o, sc in ((model, opt, scalers[0]), (ref, ref_opt, scalers[1])):
            o.zero_grad()
            sc.scale(batch_loss(m, i)).backward()
            if i in (3, 4): m[2].bias.grad[0] = float('inf')
            sc.step(o)
            sc.update()
        assert torch.is_tensor(opt.step_stats['skipped']) and bool(opt.step_stats['skipped']) == (i in (3, 4))
        assert_same_params(model, ref, f'{name} step {i}')
        for p, q in zip(model.parameters(), ref.parameters()): assert torch.equal(p.grad, q.grad)
    raw = param_states(opt)
    if 'step' in raw[opt.params[0]]:
        assert all(torch.is_tensor(raw[p]['step']) and raw[p]['step'].dtype == torch.float32 for p in opt.params)
        theirs = ref_opt.state_dict()['state']
        assert [st['step'] for st in opt.state_dict()['state'].values()] == [st['step'] for st in theirs.values()]
    train(opt, model, 2, start=9), train(ref_opt, ref, 2, start=9)
    assert_same_params(model, ref, f'{name} after the scaler')
    assert all(type(raw[p].get('step', 0)) is int for p in opt.params)


def test_in_backward_steps_counts_left_on_the_device(monkeypatch):
    """State that stepped under GradScaler on a device (counts as float32 tensors there) steps on in `InBackward`'s
    hook with torch's kernel, the counts counted on the device: as the same optimizer stepping after backward."""
    monkeypatch.setattr(dispatch, 'HOST_READ_DEVICES', ())
    m, ref = make_model(), make_model()
    opt, ref_opt = (cbopt.Adam(x.parameters(), lr=1e-2, backend='fused') for x in (m, ref))  # (fused: GradScaler's
    for model, o in ((m, opt), (ref, ref_opt)):  # fused protocol, found_inf handed to the step)
        train(o, model, 1)
        sc = torch.amp.GradScaler('cpu', init_scale=2. ** 8)
        o.zero_grad()
        sc.scale(batch_loss(model, 1)).backward()
        sc.step(o)
    assert all(torch.is_tensor(param_states(opt)[p]['step']) for p in opt.params)
    inb = cbopt.InBackward(opt)
    opt.zero_grad()  # (the scaled step's grads: backward would add to them)
    for i in range(2, 4):
        batch_loss(m, i).backward()
        inb.step()
        train(ref_opt, ref, 1, start=i)
    assert_same_params(m, ref)
    assert [float(param_states(opt)[p]['step']) for p in opt.params] == [4.] * 4
