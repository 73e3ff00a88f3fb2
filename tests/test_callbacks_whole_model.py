"""Whole-model callbacks (issue #9 items 1, 2): the chain contract (position, state in the group entries, strict
load), `clip_grad_norm` / `clip_grad_value` against torch's clip functions, `skip_nonfinite` (a skipped step leaves
everything bit-identical) and `accumulate_grads` (a real big-batch gradient; resume mid-cycle), in every backend.

One test per whole-model callback (`cbopt.callbacks.whole_model`, issue #14 item 3): one-element float64 params with
hand-chosen grads, stepped by a real optimizer (the callback, then plain SGD: `p -= lr * g`), and the params and
`step_stats` worked out in the test from torch's documented rules: where the tests above check the callbacks
against torch's clip functions and a real big batch over many steps, these pin each rule on its own.
(`warmup` is pinned stage by stage against torchrec's formulas in `test_warmup.py`.)"""
from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cbopt
from cbopt import accumulate_grads, clip_grad_norm, clip_grad_value, grad_norm, skip_nonfinite

BACKENDS = ['loop', 'foreach', 'fused', 'auto']


def model(seed=0):
    "A small MLP with a float64 head, so the grads fall in two (device, dtype) buckets."
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    m[2].double()
    return m


def loss_of(m, x, y): return F.mse_loss(m[2](m[1](m[0](x)).double()), y)


def data(step, n=8):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g, dtype=torch.float64)


def grads(m, step, scale=1.0):
    m.zero_grad(set_to_none=True)
    (loss_of(m, *data(step)) * scale).backward()


def same_step(p, q, backend):
    "The SGD step: bit-exact but for `fused` (the compiled `p - lr*g` may round once, as an fma)."
    if backend == 'fused': torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    else: assert torch.equal(p, q)


def snapshot(opt, m):
    "Every param, every per-param state tensor and every group entry (hypers and whole-model state)."
    return ([p.detach().clone() for p in m.parameters()],
            {n: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for n, s in opt.named_state_dict()['state'].items()},
            [dict(g) for g in opt.state_dict()['param_groups']])


def assert_bitwise(a, b):
    pa, sa, ga = a
    pb, sb, gb = b
    for x, y in zip(pa, pb): assert torch.equal(x, y)
    assert sa.keys() == sb.keys()
    for n in sa:
        assert sa[n].keys() == sb[n].keys()
        for k in sa[n]:
            v, w = sa[n][k], sb[n][k]
            assert torch.equal(v, w) if torch.is_tensor(v) else v == w, (n, k)
    assert ga == gb


# -- the contract -------------------------------------------------------------------------------------------------
def test_position_in_the_chain():
    "Before or after the per-param callbacks; in the middle is an error naming the callback."
    m = model()
    cbopt.Optimizer(m.parameters(), [clip_grad_norm, cbopt.sgd_step, skip_nonfinite])
    with pytest.raises(ValueError, match="'clip_grad_norm' is in the middle"):
        cbopt.Optimizer(m.parameters(), [cbopt.weight_decay, clip_grad_norm, cbopt.sgd_step])
    with pytest.raises(ValueError, match="lists the whole-model callback 'skip_nonfinite' twice"):
        cbopt.Optimizer(m.parameters(), [skip_nonfinite, skip_nonfinite, cbopt.sgd_step])


def test_state_in_group_entries_hidden_from_hypers(tmp_path):
    """Whole-model state lives in the first group's entries as '<cb>.<key>': saved, read with weights_only, not a
    hyper (fastai's and schedulers' view), and its hypers are ordinary hypers of every group."""
    m = model()
    opt = cbopt.Optimizer([list(m[0].parameters()), list(m[2].parameters())], [skip_nonfinite, cbopt.sgd_step], lr=0.1)
    assert opt.param_groups[0]['skip_nonfinite.skipped_total'] == 0
    assert 'skip_nonfinite.skipped_total' not in opt.param_groups[1]
    assert dict(opt.hypers[0]) == {'lr': 0.1, 'max_consecutive': None}
    with pytest.raises(KeyError): opt.hypers[0]['skip_nonfinite.skipped_total'] = 3
    with pytest.raises(KeyError): opt.set_hyper('skip_nonfinite.skipped_total', 3)
    torch.save(opt.state_dict(), tmp_path / 'o.pt')
    sd = torch.load(tmp_path / 'o.pt', weights_only=True)
    assert sd['param_groups'][0]['skip_nonfinite.skipped_consecutive'] == 0


def test_strict_load_of_model_state():
    "A missing or unknown whole-model state entry is an error naming it, and the optimizer is left as it was."
    m = model()
    opt = cbopt.Optimizer(m.parameters(), [skip_nonfinite, cbopt.sgd_step], lr=0.1)
    sd = opt.state_dict()
    bad = copy.deepcopy(sd)
    del bad['param_groups'][0]['skip_nonfinite.skipped_total']
    with pytest.raises(KeyError, match="'skip_nonfinite.skipped_total' .* missing"): opt.load_state_dict(bad)
    bad = copy.deepcopy(sd)
    bad['param_groups'][0]['skip_nonfinite.other'] = 1
    with pytest.raises(KeyError, match="unknown whole-model callback state 'skip_nonfinite.other'"): opt.load_state_dict(bad)
    bad = copy.deepcopy(sd)
    bad['param_groups'][0]['skip_nonfinite.skipped_total'] = 'x'
    with pytest.raises(TypeError): opt.load_state_dict(bad)
    assert opt.param_groups[0]['skip_nonfinite.skipped_total'] == 0
    sd['param_groups'][0]['skip_nonfinite.skipped_total'] = 7
    opt.load_state_dict(sd)
    assert opt.param_groups[0]['skip_nonfinite.skipped_total'] == 7


def test_undeclared_return_is_rejected():
    def bad_cb(params, **kwargs): return {'norm': 1.0}
    bad_cb.scope = 'model'
    m = model()
    opt = cbopt.Optimizer(m.parameters(), [bad_cb, cbopt.sgd_step], lr=0.1)
    grads(m, 0)
    with pytest.raises(ValueError, match="'bad_cb' returned 'norm'"): opt.step()


def test_runs_on_buckets_not_per_param():
    "One call per step, with one TensorList per (device, dtype): the callback never loops over params."
    calls = []
    def spy(params, groups, **kwargs): calls.append(([len(tl) for tl in params], len(groups)))
    spy.scope, spy.state = 'model', {}
    m = model()
    opt = cbopt.Optimizer([list(m[0].parameters()), list(m[2].parameters())], [spy, cbopt.sgd_step], lr=0.1)
    grads(m, 0)
    opt.step()
    assert calls == [([2, 2], 2)]  # float32 body, float64 head; two groups


# -- clipping -----------------------------------------------------------------------------------------------------
def torch_reference(m, clip):
    """Copies of `m`'s params with its grads (also kept unclipped as `.grad0`), clipped by torch's function `clip`, then
    stepped by torch's SGD (lr 0.1)."""
    ref = [nn.Parameter(p.detach().clone()) for p in m.parameters()]
    for q, p in zip(ref, m.parameters()): q.grad, q.grad0 = p.grad.clone(), p.grad.clone()
    out = clip(ref)
    torch.optim.SGD(ref, lr=0.1).step()
    return ref, out


@pytest.mark.parametrize('backend', BACKENDS)
@pytest.mark.parametrize('norm_type', [2.0, 1.0, math.inf, 3.0])
def test_clip_grad_norm_is_torchs(backend, norm_type):
    "The same total norm and clipped grads as torch's clip_grad_norm_, bit for bit, over three steps (one not clipped)."
    m = model()
    opt = cbopt.Optimizer(m.named_parameters(), [clip_grad_norm, cbopt.sgd_step], lr=0.1, max_norm=0.3,
                          norm_type=norm_type, backend=backend)
    for step, scale in enumerate([1.0, 3.0, 0.01]):
        grads(m, step, scale)
        ref, total = torch_reference(m, lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.3, norm_type))
        user_grads = [p.grad for p in m.parameters()]
        opt.step()
        assert torch.equal(opt.step_stats['grad_norm'], total) and torch.equal(opt.last_total_grad_norm, total)
        for p, q, g in zip(m.parameters(), ref, user_grads):
            assert p.grad is g and torch.equal(p.grad, q.grad0)  # the grad contract: the user's grad, unclipped
            same_step(p, q, backend)


@pytest.mark.parametrize('backend', BACKENDS)
def test_clip_grad_value_is_torchs(backend):
    m = model()
    opt = cbopt.Optimizer(m.named_parameters(), [clip_grad_value, cbopt.sgd_step], lr=0.1, clip_value=0.05, backend=backend)
    for step in range(2):
        grads(m, step)
        ref, _ = torch_reference(m, lambda ps: torch.nn.utils.clip_grad_value_(ps, 0.05))
        assert any((p.grad.abs() > 0.05).any() for p in m.parameters())  # something to clip
        opt.step()
        for p, q in zip(m.parameters(), ref):
            assert torch.equal(p.grad, q.grad0)  # the grad contract: the user's grad, unclamped
            same_step(p, q, backend)


def test_clip_hypers_are_checked():
    m = model()
    with pytest.raises(ValueError, match='Invalid max_norm value: -1'):
        cbopt.Optimizer(m.parameters(), [clip_grad_norm, cbopt.sgd_step], max_norm=-1)
    with pytest.raises(ValueError, match='Invalid clip_value value'):
        cbopt.Optimizer(m.parameters(), [clip_grad_value, cbopt.sgd_step], clip_value=float('nan'))


# -- skipping non-finite steps ------------------------------------------------------------------------------------
def adam_chain_with(*model_cbs): return [*model_cbs, *cbopt.adam_chain()]


@pytest.mark.parametrize('backend', BACKENDS)
def test_skipped_step_changes_nothing(backend):
    """A step with an inf or NaN grad leaves params, per-param state and hypers bit-identical; only the skip counts
    move; the next finite step is exactly the step the optimizer would have taken without the bad one."""
    m, ref = model(), model()
    opt = cbopt.Optimizer(m.named_parameters(), adam_chain_with(skip_nonfinite), lr=0.01, mom=0.9, sqr_mom=0.99, eps=1e-5,
                          wd=0.01, backend=backend)
    ref_opt = cbopt.Optimizer(ref.named_parameters(), cbopt.adam_chain(), lr=0.01, mom=0.9, sqr_mom=0.99, eps=1e-5, wd=0.01,
                              backend=backend)
    for step in range(2):
        grads(m, step); opt.step()
        grads(ref, step); ref_opt.step()
    for i, bad in enumerate([math.inf, math.nan, -math.inf]):
        before = snapshot(opt, m)
        grads(m, 5)
        m[2].bias.grad[1] = bad
        opt.step()
        after = snapshot(opt, m)
        assert after[2][0].pop('skip_nonfinite.skipped_total') == i + 1
        assert after[2][0].pop('skip_nonfinite.skipped_consecutive') == i + 1
        before[2][0].pop('skip_nonfinite.skipped_total'), before[2][0].pop('skip_nonfinite.skipped_consecutive')
        assert_bitwise(before, after)
        assert opt.step_stats['skipped'] is True and opt.step_stats['skipped_by'] == 'skip_nonfinite'
    grads(m, 2); opt.step()
    grads(ref, 2); ref_opt.step()
    for p, q in zip(m.parameters(), ref.parameters()): assert torch.equal(p, q)
    assert opt.step_stats['skipped'] is False
    assert (opt.step_stats['skipped_total'], opt.step_stats['skipped_consecutive']) == (3, 0)


def test_max_consecutive_raises_and_changes_nothing():
    m = model()
    opt = cbopt.Optimizer(m.parameters(), [skip_nonfinite, cbopt.sgd_step], lr=0.1, max_consecutive=2)
    for _ in range(2):
        grads(m, 0); m[0].weight.grad[0, 0] = math.nan; opt.step()
    before = snapshot(opt, m)
    grads(m, 0); m[0].weight.grad[0, 0] = math.nan
    with pytest.raises(FloatingPointError, match='3 steps in a row, more than max_consecutive=2'): opt.step()
    assert_bitwise(before, snapshot(opt, m))
    grads(m, 0); opt.step()  # a finite step goes through and resets the run
    assert opt.param_groups[0]['skip_nonfinite.skipped_consecutive'] == 0


def test_skip_drops_earlier_callbacks_state():
    "A skip leaves the state of the whole-model callbacks before it as it was (a counter before it does not move)."
    def count(params, n=0, **kwargs): return {'n': n + 1}
    count.scope, count.state = 'model', dict(n=0)
    m = model()
    opt = cbopt.Optimizer(m.parameters(), [count, skip_nonfinite, cbopt.sgd_step], lr=0.1)
    grads(m, 0); opt.step()
    grads(m, 0); m[0].bias.grad[0] = math.inf; opt.step()
    assert opt.param_groups[0]['count.n'] == 1 and opt.param_groups[0]['skip_nonfinite.skipped_total'] == 1


# -- accumulation -------------------------------------------------------------------------------------------------
def big_batch_grads(m, step, k):
    "The grads of the mean loss over k micro-batches taken as one batch of k*8 samples."
    xs, ys = zip(*[data(step * k + i) for i in range(k)])
    m.zero_grad(set_to_none=True)
    loss_of(m, torch.cat(xs), torch.cat(ys)).backward()


@pytest.mark.parametrize('backend', BACKENDS)
def test_accumulation_equals_the_big_batch(backend):
    """k micro-steps of accumulate_grads step like one step on the k-times bigger batch (a real big-batch gradient,
    same up to float rounding); the calls in between change no param and no Adam state."""
    k = 4
    m, ref = model(), model()
    opt = cbopt.Optimizer(m.named_parameters(), adam_chain_with(accumulate_grads), every=k, lr=0.01, backend=backend)
    ref_opt = cbopt.Optimizer(ref.named_parameters(), cbopt.adam_chain(), lr=0.01, backend=backend)
    for step in range(3):
        for i in range(k):
            before = [p.detach().clone() for p in m.parameters()]
            grads(m, step * k + i)
            opt.step()
            assert opt.step_stats['micro_step'] == (i + 1) % k
            if i < k - 1:
                assert opt.step_stats['skipped'] is True
                for p, q in zip(before, m.parameters()): assert torch.equal(p, q)
        big_batch_grads(ref, step, k)
        ref_opt.step()
        for p, q in zip(m.parameters(), ref.parameters()): torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        for n, st in opt.named_state_dict()['state'].items():  # the sum restarts from zero after each step
            assert not st['accumulate_grads.grad_sum'].any()


def test_accumulation_is_the_mean_of_the_grads_exactly():
    "The step uses (g1 + ... + gk) / k summed in call order: bit-exact with that mean given to the plain chain."
    k = 3
    m, ref = model(), model()  # foreach: under 'auto' the plain chain would get torch's fused AdamW, which rounds apart
    opt = cbopt.Optimizer(m.named_parameters(), adam_chain_with(accumulate_grads), every=k, lr=0.01, backend='foreach')
    ref_opt = cbopt.Optimizer(ref.named_parameters(), cbopt.adam_chain(), lr=0.01, backend='foreach')
    for step in range(2):
        sums = [torch.zeros_like(p) for p in ref.parameters()]
        for i in range(k):
            grads(m, step * k + i); opt.step()
            grads(ref, step * k + i)
            if i < k - 1:
                for s, p in zip(sums, ref.parameters()): s.add_(p.grad)
        for s, p in zip(sums, ref.parameters()): p.grad.add_(s).div_(k)
        ref_opt.step()
        for p, q in zip(m.parameters(), ref.parameters()): assert torch.equal(p, q)


@pytest.mark.parametrize('backend', ['loop', 'foreach'])
@pytest.mark.parametrize('stop', [2, 5], ids=['first-cycle', 'later-cycle'])
def test_resume_mid_accumulation_is_exact(backend, stop):
    """Save mid-cycle (weights_only), load into a fresh optimizer, go on: bit-identical to never stopping. (Not
    `fused`: a fresh optimizer's first step of a layout runs eagerly, which rounds apart from the compiled chain.)"""
    k, total = 3, 9
    def make(m): return cbopt.Optimizer(m.named_parameters(), adam_chain_with(skip_nonfinite, accumulate_grads), every=k,
                                        lr=0.01, backend=backend)
    m, ref = model(), model()
    opt, ref_opt = make(m), make(ref)
    for i in range(total):
        grads(ref, i); ref_opt.step()
    for i in range(stop):
        grads(m, i); opt.step()
    buf = io.BytesIO()
    torch.save({'model': m.state_dict(), 'opt': opt.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    assert ck['opt']['param_groups'][0]['accumulate_grads.micro_step'] == stop % k
    m2 = model(seed=1)
    m2.load_state_dict(ck['model'])
    opt2 = make(m2)
    opt2.load_state_dict(ck['opt'])
    for i in range(stop, total):
        grads(m2, i); opt2.step()
    assert_bitwise(snapshot(opt2, m2), snapshot(ref_opt, ref))


def test_survives_torch_distributed_checkpoint_helpers():
    """DCP's get/set_optimizer_state_dict keep only param_groups entries and per-param state (and turn cbopt's names
    into ids): the whole-model state and the accumulation buffers come back exactly, mid-cycle."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    def make(m): return cbopt.Optimizer(m.named_parameters(), adam_chain_with(skip_nonfinite, accumulate_grads), every=3,
                                        lr=0.01)
    m = model()
    opt = make(m)
    for i in range(5):
        grads(m, i); opt.step()
    grads(m, 9); m[0].bias.grad[0] = math.nan; opt.step()
    sd = get_optimizer_state_dict(m, opt)
    m2 = model(1)
    m2.load_state_dict(m.state_dict())
    opt2 = make(m2)
    set_optimizer_state_dict(m2, opt2, sd)
    assert opt2.param_groups[0]['accumulate_grads.micro_step'] == 2
    assert opt2.param_groups[0]['skip_nonfinite.skipped_total'] == 1
    for i in range(6, 9):
        grads(m, i); opt.step()
        grads(m2, i); opt2.step()
    assert_bitwise(snapshot(opt2, m2), snapshot(opt, m))


LR = 0.1


def params(*values: float) -> list[torch.Tensor]:
    "One-element float64 params."
    return [torch.tensor([v], dtype=torch.float64, requires_grad=True) for v in values]


def step(opt, ps, *grads: float) -> None:
    for p, g in zip(ps, grads): p.grad = torch.tensor([g], dtype=torch.float64)
    opt.step()


def close(ps, *expected: float) -> None:
    torch.testing.assert_close(torch.cat([p.detach() for p in ps]), torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize('backend', ['loop', 'foreach'])
def test_clip_grad_norm_scales_by_max_norm_over_the_total_norm(backend) -> None:
    "g *= min(1, max_norm / (total_norm + 1e-6)); the pre-clip norm is reported."
    ps = params(1., 2.)
    opt = cbopt.Optimizer(ps, [clip_grad_norm, cbopt.sgd_step], lr=LR, max_norm=1., backend=backend)
    step(opt, ps, 3., 4.)                                   # total 2-norm 5
    coef = 1. / (5. + 1e-6)
    close(ps, 1. - LR * 3. * coef, 2. - LR * 4. * coef)
    assert opt.step_stats['grad_norm'].item() == pytest.approx(5., rel=1e-12)
    opt.set_hyper('max_norm', 6.)                           # under the bound: the grads are kept
    step(opt, ps, 3., 4.)
    close(ps, 1. - LR * 3. * coef - LR * 3., 2. - LR * 4. * coef - LR * 4.)


@pytest.mark.parametrize('norm_type, total', [(1., 7.), (2., 5.), (math.inf, 4.)])
def test_clip_grad_norm_norm_type(norm_type, total) -> None:
    "The total norm of (3, -4) is 7, 5 and 4 in the 1-, 2- and inf-norms."
    ps = params(1., 2.)
    opt = cbopt.Optimizer(ps, [clip_grad_norm, cbopt.sgd_step], lr=LR, max_norm=2., norm_type=norm_type)
    step(opt, ps, 3., -4.)
    coef = 2. / (total + 1e-6)
    close(ps, 1. - LR * 3. * coef, 2. + LR * 4. * coef)
    assert opt.step_stats['grad_norm'].item() == pytest.approx(total, rel=1e-12)


@pytest.mark.parametrize('norm_type, total', [(1., 7.), (2., 5.), (math.inf, 4.)])
def test_grad_norm_reports_and_changes_nothing(norm_type, total) -> None:
    ps = params(1., 2.)
    opt = cbopt.Optimizer(ps, [grad_norm, cbopt.sgd_step], lr=LR, norm_type=norm_type)
    step(opt, ps, 3., -4.)
    close(ps, 1. - LR * 3., 2. + LR * 4.)
    assert opt.step_stats['grad_norm'].item() == pytest.approx(total, rel=1e-12)
    assert cbopt.Optimizer(params(1.), [grad_norm, cbopt.sgd_step]).hypers[0]['norm_type'] == 2.


def test_clip_grad_norm_defaults_are_fastais() -> None:
    opt = cbopt.Optimizer(params(1.), [clip_grad_norm, cbopt.sgd_step], lr=LR)
    assert opt.hypers[0]['max_norm'] == 1. and opt.hypers[0]['norm_type'] == 2.


@pytest.mark.parametrize('backend', ['loop', 'foreach'])
def test_clip_grad_value_clamps_each_element(backend) -> None:
    ps = params(1., 2., 3.)
    opt = cbopt.Optimizer(ps, [clip_grad_value, cbopt.sgd_step], lr=LR, clip_value=0.5, backend=backend)
    step(opt, ps, 3., -0.25, -2.)
    close(ps, 1. - LR * 0.5, 2. + LR * 0.25, 3. + LR * 0.5)
    assert cbopt.Optimizer(params(1.), [clip_grad_value, cbopt.sgd_step], lr=LR).hypers[0]['clip_value'] == 1.


@pytest.mark.parametrize('bad', [math.inf, -math.inf, math.nan])
def test_skip_nonfinite_counts_and_skips(bad) -> None:
    "A step with a non-finite grad anywhere moves nothing; the counts say how many were skipped, in a row and in all."
    ps = params(1., 2.)
    opt = cbopt.Optimizer(ps, [skip_nonfinite, cbopt.sgd_step], lr=LR)
    g0 = opt.param_groups[0]
    step(opt, ps, 1., bad)
    close(ps, 1., 2.)
    assert opt.step_stats['skipped'] and opt.step_stats['skipped_by'] == 'skip_nonfinite'
    step(opt, ps, bad, 1.)
    close(ps, 1., 2.)
    assert (g0['skip_nonfinite.skipped_total'], g0['skip_nonfinite.skipped_consecutive']) == (2, 2)
    step(opt, ps, 1., -1.)                                  # finite: steps, and the run of skips ends
    close(ps, 1. - LR, 2. + LR)
    assert not opt.step_stats['skipped']
    assert (g0['skip_nonfinite.skipped_total'], g0['skip_nonfinite.skipped_consecutive']) == (2, 0)


def test_skip_nonfinite_raises_after_max_consecutive() -> None:
    "max_consecutive skips in a row are allowed; one more raises (training has diverged), changing nothing."
    ps = params(1.)
    opt = cbopt.Optimizer(ps, [skip_nonfinite, cbopt.sgd_step], lr=LR, max_consecutive=2)
    step(opt, ps, math.inf)
    step(opt, ps, math.inf)
    with pytest.raises(FloatingPointError, match='at 3 steps in a row, more than max_consecutive=2'):
        step(opt, ps, math.inf)
    g0 = opt.param_groups[0]
    assert (g0['skip_nonfinite.skipped_total'], g0['skip_nonfinite.skipped_consecutive']) == (2, 2)
    close(ps, 1.)
    assert cbopt.Optimizer(params(1.), [skip_nonfinite, cbopt.sgd_step]).hypers[0]['max_consecutive'] is None


@pytest.mark.parametrize('backend', ['loop', 'foreach'])
def test_accumulate_grads_steps_every_n_calls_with_the_mean(backend) -> None:
    "every=3: two calls only add up; the third steps once with (g1 + g2 + g3) / 3, and the sum starts over."
    ps = params(1.)
    opt = cbopt.Optimizer(ps, [accumulate_grads, cbopt.sgd_step], lr=LR, every=3, backend=backend)
    step(opt, ps, 1.)
    step(opt, ps, 2.)
    close(ps, 1.)
    assert opt.step_stats['skipped'] and opt.param_groups[0]['accumulate_grads.micro_step'] == 2
    step(opt, ps, 6.)
    close(ps, 1. - LR * (1. + 2. + 6.) / 3.)
    assert opt.param_groups[0]['accumulate_grads.micro_step'] == 0
    for g in (3., 3., 3.): step(opt, ps, g)
    close(ps, 1. - LR * 3. - LR * 3.)                        # the first cycle's grads are gone


def test_accumulate_grads_of_one_is_plain_sgd() -> None:
    ps = params(1.)
    opt = cbopt.Optimizer(ps, [accumulate_grads, cbopt.sgd_step], lr=LR)
    assert opt.hypers[0]['every'] == 1
    step(opt, ps, 2.)
    close(ps, 1. - LR * 2.)
