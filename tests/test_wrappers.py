"""The wrappers (issue #9 item 3): torchrec's GradientClippingOptimizer and WarmupOptimizer (torchrec's verified lr
sequences, from /work/shared/notes/wrappers-and-distributed.md A.5), SkipNonFinite and Accumulate, in every backend;
resume mid-warmup; fastai's GradientClip and GradientAccumulation give the same losses as cbopt's."""
from __future__ import annotations

import copy
import itertools
import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cbopt
from cbopt import GradientClipping, WarmupPolicy, WarmupStage

BACKENDS = ['loop', 'foreach', 'fused', 'auto']


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def grads(m, step):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
    m.zero_grad(set_to_none=True)
    F.mse_loss(m(x), y).backward()


def lrs_used(opt, m, n):
    "The lr of group 0 that each of n steps used, as reported and as measured on plain SGD (delta = lr * grad)."
    out = []
    for i in range(n):
        grads(m, i)
        before, g = m[0].bias.detach().clone(), m[0].bias.grad.clone()
        opt.step()
        used = opt.step_stats['lr'][0]
        assert torch.allclose(before - m[0].bias, used * g, rtol=1e-4, atol=1e-7)
        out.append(used)
    return out


# torchrec 1.8.0's lr sequences (after init, then after each step: the lr each step runs with), lr0=1 unless given
TORCHREC = {
    'linear': ([WarmupStage(WarmupPolicy.LINEAR, max_iters=10, value=0.1)], 1.0,
               [0.1, 0.19, 0.28, 0.37, 0.46, 0.55, 0.64, 0.73, 0.82, 0.91, 1.0, 1.0, 1.0]),
    'linear-poly-step': ([WarmupStage(WarmupPolicy.LINEAR, max_iters=4, value=0.0),
                          WarmupStage(WarmupPolicy.POLY, max_iters=10, value=2),
                          WarmupStage(WarmupPolicy.STEP, max_iters=16, value=0.5, decay_iters=3)], 1.0,
                         [0, .25, .5, .75, 1.0, .25, .16, .09, .04, .01, 0, .125, .0625, .0625, .0625, .03125, .03125,
                          1.0, 1.0]),
    'cosine': ([WarmupStage(WarmupPolicy.COSINE_ANNEALING_WARM_RESTARTS, max_iters=8, value=0.1, sgdr_period=4)], 1.0,
               [1.0, .8682, .55, .2318, 1.0, .8682, .55, .2318, 1.0, 1.0]),
    'interpolate': ([WarmupStage(WarmupPolicy.INTERPOLATE, max_iters=10, value=1, end_value=0,
                                 start_interpolating_iters=5)], 1.0,
                    [2.0, 1.8, 1.6, 1.4, 1.2, 1.0, 0.8, 0.6, 0.4, 0.2, 0.0, 1.0]),
    'constant-scaled': ([WarmupStage(WarmupPolicy.CONSTANT, max_iters=3, value=0.5, lr_scale=2)], 0.1,
                        [0.1, 0.1, 0.1, 0.1, 0.1]),
}


@pytest.mark.parametrize('case', TORCHREC)
def test_warmup_gives_torchrecs_lrs(case):
    stages, lr, expected = TORCHREC[case]
    m = model()
    opt = cbopt.WarmupOptimizer(cbopt.SGD(m.parameters(), lr=123.0), stages, lr=lr)
    assert opt.param_groups[0]['lr'] == lr  # the base: torchrec's lr argument replaces the groups' own
    assert lrs_used(opt, m, len(expected)) == pytest.approx(expected, abs=1e-4)
    assert opt.param_groups[0]['warmup.iter'] == len(expected)


def test_warmup_keeps_discriminative_lrs_and_composes_with_a_scheduler():
    "lr=None: each group's own lr is its base; a torch scheduler scales the base, the warmup multiplies it."
    m = model()
    inner = cbopt.SGD([list(m[0].parameters()), list(m[2].parameters())], lr=slice(0.01, 0.1))
    opt = cbopt.WarmupOptimizer(inner, [WarmupStage(WarmupPolicy.LINEAR, max_iters=4, value=0.5)], lr=None)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for t in range(6):
        grads(m, t)
        opt.step()
        mult = min(0.5 + 0.5 * t / 4, 1.0)
        assert opt.step_stats['lr'] == pytest.approx([0.01 * 0.5 ** t * mult, 0.1 * 0.5 ** t * mult])
        sched.step()


def test_invsqrt_first_is_a_clear_error():
    m = model()
    with pytest.raises(ValueError, match='INVSQRT cannot be the first stage'):
        cbopt.WarmupOptimizer(cbopt.SGD(m.parameters()), [WarmupStage(WarmupPolicy.INVSQRT, max_iters=5)])


@pytest.mark.parametrize('backend', ['loop', 'foreach'])
def test_resume_mid_warmup_is_exact(backend):
    "The counter is saved with the groups: it loads into a fresh wrapper, no init_state() step, bit-exact."
    stages = [WarmupStage(WarmupPolicy.LINEAR, max_iters=6, value=0.1), WarmupStage(WarmupPolicy.STEP, max_iters=12, value=0.5, decay_iters=2)]
    def make(m): return cbopt.WarmupOptimizer(cbopt.Adam(m.named_parameters(), backend=backend), stages, lr=0.01)
    m, ref = model(), model()
    opt, ref_opt = make(m), make(ref)
    for i in range(10):
        grads(ref, i); ref_opt.step()
    for i in range(5):
        grads(m, i); opt.step()
    buf = io.BytesIO()
    torch.save({'m': m.state_dict(), 'o': opt.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    m2 = model(1)
    m2.load_state_dict(ck['m'])
    opt2 = make(m2)
    opt2.load_state_dict(ck['o'])
    assert opt2.param_groups[0]['warmup.iter'] == 5
    for i in range(5, 10):
        grads(m2, i); opt2.step()
    for p, q in zip(m2.parameters(), ref.parameters()): assert torch.equal(p, q)
    sd, rsd = opt2.state_dict(), ref_opt.state_dict()
    assert sd['param_groups'] == rsd['param_groups']
    for n in sd['state']:
        for k, v in sd['state'][n].items(): assert torch.equal(v, rsd['state'][n][k]) if torch.is_tensor(v) else v == rsd['state'][n][k]


# -- every wrapper, every backend -----------------------------------------------------------------------------------
WRAPPERS = {
    'clip-norm': (lambda o: cbopt.GradientClippingOptimizer(o, GradientClipping.NORM, max_gradient=0.05),
                  lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.05)),
    'clip-norm-inf': (lambda o: cbopt.GradientClippingOptimizer(o, GradientClipping.NORM, max_gradient=0.05, norm_type='inf'),
                      lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.05, math.inf)),
    'clip-value': (lambda o: cbopt.GradientClippingOptimizer(o, GradientClipping.VALUE, max_gradient=0.02),
                   lambda ps: torch.nn.utils.clip_grad_value_(ps, 0.02)),
    'clip-none': (lambda o: cbopt.GradientClippingOptimizer(o), lambda ps: None),
    'skip': (lambda o: cbopt.SkipNonFinite(o, max_consecutive=3), lambda ps: None),
}


@pytest.mark.parametrize('backend', BACKENDS)
@pytest.mark.parametrize('name', WRAPPERS)
def test_wrapper_steps_as_torch_clip_then_inner(name, backend):
    """Each wrapper of a stepped Adam (state carried over) steps exactly as torch's clip function followed by an
    unwrapped copy of that Adam; it is a torch.optim.Optimizer a scheduler drives."""
    wrapper, clip = WRAPPERS[name]
    m = model()
    inner = cbopt.Adam(m.named_parameters(), lr=0.01, backend=backend)
    grads(m, 0); inner.step()
    ref_m, ref = copy.deepcopy(m), None
    ref = cbopt.Adam(ref_m.named_parameters(), lr=0.01, backend=backend)
    ref.load_state_dict(inner.state_dict())
    opt = wrapper(inner)
    assert isinstance(opt, torch.optim.Optimizer) and opt.backend == backend
    sched, ref_sched = (torch.optim.lr_scheduler.StepLR(o, 1, 0.5) for o in (opt, ref))
    for step in range(1, 4):
        grads(m, step); grads(ref_m, step)
        user_grads = [p.grad.clone() for p in m.parameters()]
        clip(list(ref_m.parameters()))
        opt.step(); ref.step()
        sched.step(); ref_sched.step()
        for p, q, g in zip(m.parameters(), ref_m.parameters(), user_grads):
            assert torch.equal(p.grad, g)  # the grad contract: the step left the user's grads as they were
            torch.testing.assert_close(p, q, rtol=0, atol=0) if backend != 'fused' else torch.testing.assert_close(p, q)


@pytest.mark.parametrize('backend', BACKENDS)
def test_accumulate_wrapper_steps_every_k(backend):
    "Accumulate(opt, every=2): unchanged params on odd calls; then the inner step with the mean grad."
    m = model()
    opt = cbopt.Accumulate(cbopt.SGD(m.parameters(), lr=0.1), every=2)
    grads(m, 0); g0 = [p.grad.clone() for p in m.parameters()]
    before = [p.detach().clone() for p in m.parameters()]
    opt.step()
    for p, q in zip(m.parameters(), before): assert torch.equal(p, q)
    grads(m, 1)
    expected = [q - 0.1 * ((p.grad + a) / 2) for p, q, a in zip(m.parameters(), before, g0)]
    user_grads = [p.grad.clone() for p in m.parameters()]
    opt.step()
    for p, g in zip(m.parameters(), user_grads): assert torch.equal(p.grad, g)  # the grad contract
    for p, e in zip(m.parameters(), expected): torch.testing.assert_close(p.detach(), e, rtol=1e-6, atol=1e-7)
    assert opt.step_stats['micro_step'] == 0 and opt.step_stats['skipped'] is False


def test_wrappers_stack_and_report():
    "Wrappers stack (outermost first in the chain); step_stats reports the lr used, the norm and the skips."
    m = model()
    opt = cbopt.SkipNonFinite(cbopt.WarmupOptimizer(cbopt.GradientClippingOptimizer(
        cbopt.Adam(m.parameters(), lr=0.01), GradientClipping.NORM, max_gradient=0.1),
        [WarmupStage(WarmupPolicy.LINEAR, max_iters=2, value=0.5)], lr=None))
    assert cbopt.chain_name(opt.cbs).startswith('skip_nonfinite,warmup,clip_grad_norm,weight_decay')
    grads(m, 0); opt.step()
    st = opt.step_stats
    assert st['lr'] == [0.005] and st['skipped'] is False and st['skipped_total'] == 0 and st['iter'] == 1
    assert torch.is_tensor(st['grad_norm'])
    grads(m, 1); m[0].weight.grad[0, 0] = math.nan; opt.step()
    assert opt.step_stats['skipped'] and opt.step_stats['skipped_total'] == 1
    assert opt.param_groups[0]['warmup.iter'] == 1  # the skipped step did not count


# -- fastai -------------------------------------------------------------------------------------------------------
def _learn(opt_func, cbs, bs=8):
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from fastai.learner import Learner
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 5, generator=g), torch.randn(64, 3, generator=g)
    ds = list(zip(x, y))
    dls = DataLoaders(DataLoader(ds, bs=bs, shuffle=False), DataLoader(ds[:16], bs=bs), device='cpu')
    learn = Learner(dls, model(), loss_func=F.mse_loss, opt_func=opt_func, cbs=cbs)
    with learn.no_logging(), learn.no_bar(): learn.fit(2, lr=0.01)
    return learn


def _fit(opt_func, cbs, bs=8):
    learn = _learn(opt_func, cbs, bs)
    return [float(v) for v in learn.recorder.losses], learn.recorder.values


def test_fastai_gradient_clip_and_accumulation_same_losses():
    from fastai.callback.training import GradientAccumulation, GradientClip
    theirs = _fit(cbopt.Adam, [GradientClip(max_norm=0.1)])
    ours = _fit(lambda ps, **kw: cbopt.GradientClippingOptimizer(cbopt.Adam(ps, **kw), GradientClipping.NORM, 0.1), [])
    assert ours == theirs
    theirs = _fit(cbopt.Adam, [GradientAccumulation(n_acc=16)])
    ours = _fit(lambda ps, **kw: cbopt.Accumulate(cbopt.Adam(ps, **kw), every=2), [])
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-6, atol=0)
    assert ours[0] != _fit(cbopt.Adam, [])[0]  # accumulation changed the run


# -- torch's fused kernel under the wrappers ------------------------------------------------------------------------
KERNEL_WRAPPERS = {
    'accumulate': (lambda o: cbopt.Accumulate(o, every=2), 2),
    'clip-norm': (lambda o: cbopt.GradientClippingOptimizer(o, GradientClipping.NORM, max_gradient=0.05), 1),
    'clip-then-accumulate': (lambda o: cbopt.Accumulate(cbopt.GradientClippingOptimizer(
        o, GradientClipping.NORM, max_gradient=0.05), every=2), 2),
}


@pytest.mark.parametrize('backend', ['fused', 'auto'])
@pytest.mark.parametrize('name', KERNEL_WRAPPERS)
def test_fused_adam_kernel_runs_under_wrappers(name, backend, monkeypatch):
    """Adam under a whole-model wrapper still runs torch's `_fused_adamw_` (the wrapper's per-param buffers, such as
    'accumulate_grads.grad_sum', are not the chain's state), once per bucket and real step, and matches the loop."""
    wrapper, every = KERNEL_WRAPPERS[name]
    calls = []
    real = torch._fused_adamw_
    monkeypatch.setattr(torch, '_fused_adamw_', lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    m, ref_m = model(), model()
    opt = wrapper(cbopt.Adam(m.named_parameters(), lr=0.01, backend=backend))
    ref = wrapper(cbopt.Adam(ref_m.named_parameters(), lr=0.01, backend='loop'))
    opt.init_state(); ref.init_state()  # else the first step, which creates the state, runs the chain itself
    start = copy.deepcopy(m)
    steps = 8
    for step in range(steps):
        grads(m, step); grads(ref_m, step)
        opt.step(); ref.step()
    assert len(calls) == steps // every  # one bucket (one group, fp32): one kernel call per real step, none skipped
    for (n, p), q, p0 in zip(m.named_parameters(), ref_m.parameters(), start.parameters()):
        assert (p - p0).abs().max() > 1e-3, n
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6 * q.abs().max().item(), msg=n)


# -- composition in any order ---------------------------------------------------------------------------------------
COMPOSABLE = {
    'lookahead': lambda o: cbopt.Lookahead(o, k=3, alpha=0.5),
    'clip': lambda o: cbopt.GradientClippingOptimizer(o, GradientClipping.NORM, max_gradient=0.05),
    'accumulate': lambda o: cbopt.Accumulate(o, every=2),
}


@pytest.mark.parametrize('backend', ['loop', 'foreach'])
@pytest.mark.parametrize('order', list(itertools.permutations(COMPOSABLE)), ids='-'.join)
def test_wrappers_compose_in_any_order(order, backend):
    """Lookahead, clipping and accumulation wrap each other in any order (innermost first in `order`): the whole-model
    callbacks stay at the start of the chain, the outer one first, and the steps are those of torch's clip_grad_norm_
    and a hand-made mean of two grads around a plain Lookahead(Adam)."""
    m, ref_m = model(), model()
    opt = cbopt.Adam(m.named_parameters(), lr=0.01, backend=backend)
    for name in order: opt = COMPOSABLE[name](opt)
    ref = cbopt.Lookahead(cbopt.Adam(ref_m.named_parameters(), lr=0.01, backend=backend), k=3, alpha=0.5)
    clip_first = order.index('clip') > order.index('accumulate')  # clipping is outer: it clips each micro-batch
    names = cbopt.chain_name(opt.cbs).split(',')
    assert names[:2] == (['clip_grad_norm', 'accumulate_grads'] if clip_first else ['accumulate_grads', 'clip_grad_norm'])
    assert names[2] == 'lookahead_keep' and names[-1] == 'lookahead_step'
    start, pending = copy.deepcopy(m), []
    for step in range(12):
        grads(m, step); grads(ref_m, step)
        opt.step()
        if clip_first: torch.nn.utils.clip_grad_norm_(ref_m.parameters(), 0.05)
        pending.append([p.grad.clone() for p in ref_m.parameters()])
        if len(pending) < 2: continue
        for p, g0, g1 in zip(ref_m.parameters(), *pending): p.grad = (g1 + g0) / 2
        pending = []
        if not clip_first: torch.nn.utils.clip_grad_norm_(ref_m.parameters(), 0.05)
        ref.step()
    for (n, p), q, p0 in zip(m.named_parameters(), ref_m.parameters(), start.parameters()):
        assert (p - p0).abs().max() > 1e-3, n
        torch.testing.assert_close(p, q, msg=n)


def test_a_whole_model_wrapper_refuses_an_in_backward_optimizer():
    "InBackward steps each param alone during backward, so a whole-model callback around it could never run: an error."
    m = model()
    inbwd = cbopt.InBackward(cbopt.Adam(m.parameters()))
    try:
        for wrapper in COMPOSABLE.values():
            with pytest.raises(TypeError, match="InBackward"): wrapper(inbwd)
    finally: inbwd.remove_hooks()


def test_fastai_records_step_stats_per_batch():
    """`RecordStepStats` in a real Learner records, per step, the lr each group used after warmup (torchrec's LINEAR
    formula on the lr fastai set), the pre-clip norm (torch's get_total_norm of the grads the step got, taken by a
    callback of our own before the step) and the skips of an accumulation; it pickles with the Learner."""
    import pickle
    from fastai.callback.core import Callback
    from cbopt.integrations.fastai import RecordStepStats

    class TorchNorm(Callback):
        "The grads each step gets, and their total norm by torch."
        def before_fit(self): self.grads, self.norms = [], []
        def before_step(self):
            self.grads.append([p.grad.clone() for p in self.learn.model.parameters()])
            self.norms.append(float(torch.nn.utils.get_total_norm(self.grads[-1])))

    def clipped_warmup(ps, **kw):
        clipped = cbopt.GradientClippingOptimizer(cbopt.Adam(ps, **kw), GradientClipping.VALUE, 0.05, track_grad_norm=True)
        return cbopt.WarmupOptimizer(clipped, [WarmupStage(WarmupPolicy.LINEAR, max_iters=8, value=0.25)], lr=None)
    learn = _learn(clipped_warmup, [RecordStepStats(), TorchNorm()])
    rec = learn.record_step_stats
    assert len(rec.lrs) == 16 and rec.skipped == [False] * 16
    assert [len(lrs) for lrs in rec.lrs] == [1] * 16
    assert [lrs[0] for lrs in rec.lrs] == pytest.approx([0.01 * (0.25 + 0.75 * min(i, 8) / 8) for i in range(16)], rel=1e-12)
    assert rec.grad_norms == pytest.approx(learn.torch_norm.norms, rel=1e-6)
    assert len(set(rec.grad_norms)) == 16  # real, changing norms
    fig = rec.plot()
    assert list(fig.axes[0].lines[0].get_ydata()) == [lrs[0] for lrs in rec.lrs]
    assert type(pickle.loads(pickle.dumps(RecordStepStats()))) is RecordStepStats  # learn.export pickles its callbacks

    learn = _learn(lambda ps, **kw: cbopt.Accumulate(cbopt.GradientClippingOptimizer(cbopt.Adam(ps, **kw),
                                                     GradientClipping.NORM, 0.1), every=2), [RecordStepStats(), TorchNorm()])
    rec = learn.record_step_stats
    assert rec.skipped == [True, False] * 8
    assert rec.grad_norms[::2] == [None] * 8  # a micro-step ends before the clipping: no norm
    grads = learn.torch_norm.grads  # the clipping sees the mean of two micro-batches' grads
    means = [float(torch.nn.utils.get_total_norm([(b + a) / 2 for a, b in zip(grads[i], grads[i + 1])])) for i in range(0, 16, 2)]
    assert rec.grad_norms[1::2] == pytest.approx(means, rel=1e-6)


@pytest.mark.parametrize('clipping', [GradientClipping.NONE, GradientClipping.VALUE])
@pytest.mark.parametrize('norm_type', [2.0, 'inf'])
def test_track_grad_norm(clipping, norm_type):
    """torchrec's `track_grad_norm`: with VALUE or NONE the pre-clip norm is computed (torch's get_total_norm of the
    grads the step got) only when asked; the steps are the same either way."""
    m, m2 = model(), model()
    tracked = cbopt.GradientClippingOptimizer(cbopt.Adam(m.parameters(), lr=0.01), clipping, 0.05, norm_type,
                                              track_grad_norm=True)
    plain = cbopt.GradientClippingOptimizer(cbopt.Adam(m2.parameters(), lr=0.01), clipping, 0.05, norm_type)
    for step in range(3):
        grads(m, step); grads(m2, step)
        expected = torch.nn.utils.get_total_norm([p.grad for p in m.parameters()], float(norm_type))
        tracked.step(); plain.step()
        assert torch.equal(tracked.last_total_grad_norm, expected) and plain.last_total_grad_norm is None
        for p, q in zip(m.parameters(), m2.parameters()): assert torch.equal(p, q)


@pytest.mark.parametrize('chunk', [16, 1 << 20], ids=['cut-into-runs-of-16', 'default-runs'])
def test_clipped_fused_adam_is_torchs_clip_then_fused_adamw(chunk, monkeypatch):
    """Clipping under torch's fused kernel folds the coefficient into the kernel's pass (scaled copies of cache-sized
    runs of the grads, params cut where a run ends): bit for bit torch's clip_grad_norm_(foreach=True) then its fused
    AdamW, the kernel called once per run, and the user's grads left as they were."""
    from cbopt.engine import kernels
    monkeypatch.setattr(kernels, 'SCALE_CHUNK', chunk)
    calls = []
    real = torch._fused_adamw_
    monkeypatch.setattr(torch, '_fused_adamw_', lambda *a, **k: (calls.append(len(a[0])), real(*a, **k))[1])
    m, ref_m = model(), model()
    opt = cbopt.GradientClippingOptimizer(cbopt.Adam(m.parameters(), lr=0.01, backend='fused'), GradientClipping.NORM, 0.05)
    opt.init_state()
    ref = torch.optim.AdamW(ref_m.parameters(), lr=0.01, betas=(0.9, 0.99), eps=1e-5, weight_decay=0.01, fused=True)
    for step in range(6):
        grads(m, step); grads(ref_m, step)
        user_grads = [p.grad.clone() for p in m.parameters()]
        torch.nn.utils.clip_grad_norm_(ref_m.parameters(), 0.05, foreach=True)
        calls.clear()
        opt.step()
        ours = list(calls)
        ref.step()
        assert opt.step_stats['grad_norm'] > 0.05  # it clipped
        for p, q, g in zip(m.parameters(), ref_m.parameters(), user_grads):
            assert torch.equal(p, q) and torch.equal(p.grad, g)
    numel = sum(p.numel() for p in m.parameters())
    assert len(ours) == 1 if chunk >= numel else len(ours) >= math.ceil(numel / chunk)  # runs of at most `chunk`
