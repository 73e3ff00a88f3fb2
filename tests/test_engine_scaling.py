"""`torch.amp.GradScaler` with cbopt, against torch's fused AdamW under the same scaler, over many steps with inf steps
among them: with backend `fused` (torch's `fused=True`) cbopt claims `_step_supports_amp_scaling`, so the scaler leaves the grads scaled and hands over `grad_scale` and `found_inf`; the kernel divides the grads in its
own pass, and a step with an inf changes nothing (step counts included), as torch's fused AdamW does. The other
backends (`auto` too, which still runs the kernel, on grads the scaler unscaled) let the scaler unscale and skip by
itself, as torch's non-fused optimizers do."""
import copy

import pytest
import torch

import cbopt
from conftest import assert_rel_close, assert_same_params, batch_loss, make_model

pytestmark = pytest.mark.usefixtures('one_thread')

STEPS, INF_STEPS = 14, {2, 5, 6}  # two inf steps in a row: the scale backs off twice
ADAMW = dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def scaler() -> torch.amp.GradScaler:
    "A scaler whose scale moves both ways within the run: grows after 3 good steps, halves at each inf step."
    return torch.amp.GradScaler('cpu', init_scale=2. ** 14, growth_interval=3)


def scaled_step(m, opt, sc, i: int, before_step=None) -> None:
    "One mixed-precision-style step: scaled backward of batch `i` (an inf in a grad at `INF_STEPS`), scaler step, update."
    opt.zero_grad()
    sc.scale(batch_loss(m, i)).backward()
    if i in INF_STEPS: m[2].bias.grad[0] = float('inf')
    if before_step is not None: before_step(m, opt, sc)
    sc.step(opt)
    sc.update()


def ours_adamw(m, backend: str, cls: str = 'AdamW') -> cbopt.Optimizer:
    return getattr(cbopt.optim, cls)(m.parameters(), **ADAMW, **{'fused': {'fused': True}, 'foreach': {'foreach': True},
                                                                  'loop': {'foreach': False}, 'auto': {}}[backend])


def snapshot(m, opt) -> tuple:
    return copy.deepcopy(([p.detach() for p in m.parameters()], [opt.state[p] for p in m.parameters()]))


def assert_unchanged(m, opt, before: tuple) -> None:
    "Bit for bit the params and the whole state (step counts included) of `before`."
    for p, q in zip(m.parameters(), before[0]): assert torch.equal(p, q)
    for p, st in zip(m.parameters(), before[1]):
        assert opt.state[p].keys() == st.keys()
        for k, v in st.items():
            assert torch.equal(opt.state[p][k], v) if torch.is_tensor(v) else opt.state[p][k] == v, k


@pytest.mark.parametrize('cls', ['AdamW', 'Adam'])  # Adam: L2 weight decay, torch's `_fused_adam_`
@pytest.mark.parametrize('backend', ['fused', 'auto', 'foreach', 'loop'])
def test_grad_scaler_steps_as_torchs_fused_adamw(backend, cls):
    m, ref_m = make_model(), make_model()
    ours, ref = ours_adamw(m, backend, cls), getattr(torch.optim, cls)(ref_m.parameters(), **ADAMW, fused=True)
    ours.init_state()  # (else the fused backend's first step, which creates the state, runs the chain, not the kernel)
    assert ours._step_supports_amp_scaling == (backend == 'fused') and ref._step_supports_amp_scaling
    sc, ref_sc = scaler(), scaler()
    scales = set()
    for i in range(STEPS):
        before = snapshot(m, ours)
        scaled_step(m, ours, sc, i), scaled_step(ref_m, ref, ref_sc, i)
        assert sc.get_scale() == ref_sc.get_scale()
        scales.add(sc.get_scale())
        if i in INF_STEPS:
            assert_unchanged(m, ours, before)
            if backend == 'fused': assert ours.step_stats['skipped_by'] == 'GradScaler'
        for p, q in zip(m.parameters(), ref_m.parameters()):
            assert opt_step(ours, p) == int(ref.state[q]['step'])
            # the grads are left unscaled, as torch's fused kernel leaves them (and scaler.unscale_ for the others);
            # at an inf step torch's kernel returns before touching them, while the scaler unscales them itself
            # for an optimizer that does not claim the scaling (as for torch's non-fused AdamW)
            if ours._step_supports_amp_scaling: assert torch.equal(p.grad, q.grad)
            elif i not in INF_STEPS:  # (from params that differ by rounding: within 1e-5 of the grad's own scale)
                assert (p.grad - q.grad).abs().max() <= 1e-5 * q.grad.abs().max()
        if backend in ('fused', 'auto'): assert_same_params(m, ref_m, f'step {i}')  # the same kernel (x 1/scale: exact)
        else: assert_rel_close(m, ref_m, rtol=1e-6, msg=f'step {i}')
    assert len(scales) >= 3 and opt_step(ours, m[0].weight) == STEPS - len(INF_STEPS)


def opt_step(opt, p) -> int: return int(opt.state[p]['step'])


def test_fused_unscales_in_the_kernel_not_in_a_pass_of_its_own(monkeypatch):
    """The scaler only checks the grads for infs (its unscaling multiplier is 1) and the kernel gets the scale: the
    unscaling costs no pass over the grads."""
    kernel, check = torch._fused_adamw_, torch._amp_foreach_non_finite_check_and_unscale_
    given, inv_scales = [], []
    monkeypatch.setattr(torch, '_fused_adamw_', lambda *a, **k: given.append(k['grad_scale']) or kernel(*a, **k))
    monkeypatch.setattr(torch, '_amp_foreach_non_finite_check_and_unscale_',
                        lambda grads, found, inv: inv_scales.append(inv.item()) or check(grads, found, inv))
    m = make_model()
    opt, sc = ours_adamw(m, 'fused'), scaler()
    opt.init_state()
    for i in range(4): scaled_step(m, opt, sc, i)
    assert set(inv_scales) == {1.0} and len(given) == 3  # steps 0, 1 and 3 (2 has an inf)
    assert all(g is not None and g.item() in (2. ** 14, 2. ** 13) for g in given)


def test_whole_model_callbacks_see_unscaled_grads():
    """Clipping under the scaler: cbopt unscales before its whole-model callbacks read the grads, so
    `scaler.step(clipped)` is torch's recipe `scaler.unscale_(opt); clip_grad_norm_(...); scaler.step(opt)`; the same
    recipe on cbopt's optimizer (the scaler hands over no scale then, only `found_inf`) gives the same numbers."""
    def torch_recipe(m, opt, sc): sc.unscale_(opt), torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05, foreach=True)
    def unscale_first(m, opt, sc): sc.unscale_(opt)
    runs = []
    for before_step in (None, unscale_first):
        m, ref_m = make_model(), make_model()
        clipped = cbopt.GradientClippingOptimizer(ours_adamw(m, 'fused'), cbopt.GradientClipping.NORM, 0.05)
        clipped.init_state()
        ref = torch.optim.AdamW(ref_m.parameters(), **ADAMW, fused=True)
        sc, ref_sc = scaler(), scaler()
        for i in range(STEPS):
            before = snapshot(m, clipped)
            scaled_step(m, clipped, sc, i, before_step), scaled_step(ref_m, ref, ref_sc, i, torch_recipe)
            if i in INF_STEPS: assert_unchanged(m, clipped, before)
            else: assert clipped.step_stats['grad_norm'] > 0.05  # it clipped
            assert_same_params(m, ref_m, f'step {i}')  # the same ops in the same order
        runs.append(m)
    assert_same_params(*runs)


def test_torchs_kernel_stores_the_divided_grads():
    """Why `clip_grad_norm`'s coefficient goes to torch's kernel as its `grad_scale` (1 / coefficient) only with
    `in_place=True`: the kernel stores the divided grads back into the grads it is given (ATen's CPU kernel,
    `FusedAdamKernel.cpp`), which is right for GradScaler's scale and for clipping in place (tests/test_clip_in_place.py
    relies on it), but by default would clip the user's `p.grad` (the grad contract). If this fails, torch changed:
    the default clipped fused step can drop its scaled copies (`cbopt.engine.kernels._scaled_slices`), and the in-place
    one must write the clipped grads itself."""
    g = torch.Generator().manual_seed(0)
    p, grad = torch.randn(100, generator=g), torch.randn(100, generator=g)
    given, m, v = grad.clone(), torch.zeros(100), torch.zeros(100)
    torch._fused_adamw_([p], [grad], [m], [v], [], [torch.tensor(1.)], lr=1e-3, beta1=0.9, beta2=0.999,
                        weight_decay=0., eps=1e-8, amsgrad=False, maximize=False, grad_scale=torch.tensor(4.))
    assert torch.equal(grad, given / 4)


def test_in_backward_refuses_the_scaler():
    "InBackward steps in backward, on the scaled grads, before the scaler can act: scaler.step says so."
    m = make_model()
    inb, sc = cbopt.InBackward(cbopt.Adam(m.parameters(), lr=0.01)), scaler()
    sc.scale(batch_loss(m, 0)).backward()
    with pytest.raises(TypeError, match='InBackward steps each param during backward.*GradScaler'): sc.step(inb)
