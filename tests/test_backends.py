"""Every backend follows the per-param `loop` reference (fp32, 1e-6 relative to the model's scale, params checked
after every step), for the prebuilt optimizers and for chains written here; bucketing edge cases; state interchange;
the per-param fallback.

foreach is checked bit for bit over 100 steps. Compiling is slow on CPU, so most compiled-chain checks trace with
torch.compile's `aot_eager` backend (the same dynamo graph, without inductor's codegen) over 30 steps, and three
small chains go through inductor; `CBOPT_SLOW=1` runs every optimizer both ways."""
import os
import warnings

import pytest
import torch
from torch import nn

import cbopt
from cbopt import engine
from cbopt.engine import buckets as bucketing, foreach as foreach_runner, runtime
from conftest import PREBUILT, assert_rel_close, make_model, set_grads, train, two_groups

STEPS = 100
SLOW = bool(os.environ.get('CBOPT_SLOW'))


def aot(kind: str) -> cbopt.Backend:
    "`kind`, compiling the fused chain with aot_eager: dynamo's full graph and functionalization, no C++ codegen."
    return cbopt.Backend(kind, compiler='aot_eager')


def lion(p, lr, mom, sqr_mom, wd, grad_avg=None, **kwargs):
    "A user-written Lion step (Chen et al. 2023), as one callback."
    if grad_avg is None: grad_avg = torch.zeros_like(p.grad.data)
    p.data.mul_(1 - lr * wd)
    p.data.add_(torch.sign(grad_avg.lerp(p.grad.data, 1 - mom)), alpha=-lr)
    grad_avg.lerp_(p.grad.data, 1 - sqr_mom)
    return {'grad_avg': grad_avg}


def clip_by_norm(p, max_norm, **kwargs):
    "A user-written per-param grad clip: no Python `if` on a tensor, so it runs bucket-wise."
    n = torch.linalg.vector_norm(p.grad.data)
    p.grad.data.mul_(torch.where(n > max_norm, max_norm / (n + 1e-12), 1.))


USER = {'lion': lambda ps, lr, backend: cbopt.Optimizer(ps, [cbopt.weight_decay, lion], backend=backend, lr=lr / 10,
                                                         mom=0.9, sqr_mom=0.99, wd=0.1),
        'clip-adam': lambda ps, lr, backend: cbopt.Optimizer(ps, [clip_by_norm, cbopt.average_grad,
                                                                  cbopt.average_sqr_grad, cbopt.step_stat,
                                                                  cbopt.adam_step], backend=backend, lr=lr,
                                                             max_norm=0.05)}


def build(name: str, ps, lr: float, backend: str):
    "A prebuilt optimizer of conftest's `PREBUILT` (or a chain of `USER`) on `ps`, stepping with `backend`."
    if name in USER: return USER[name](ps, lr, backend)
    opt = PREBUILT[name](cbopt, ps, lr)
    opt.backend = backend
    return opt


def run_vs_loop(name: str, backend: str, lr: float = 3e-2, steps: int = STEPS, rtol: float = 1e-6):
    "Train with `backend` and with the loop side by side, checking params after every step."
    ours, ref = make_model(), make_model()
    opt, ref_opt = build(name, two_groups(ours), lr, backend), build(name, two_groups(ref), lr, 'loop')
    for i in range(steps):
        train(ref_opt, ref, 1, start=i)
        train(opt, ours, 1, start=i)
        assert_rel_close(ours, ref, rtol=rtol, msg=f"{name} {backend} step {i}:")
    return opt, ref_opt


# -- parity ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('name', [*PREBUILT, *USER])
def test_foreach_is_loop(name):
    "foreach runs the same ops in the same order: bit for bit the loop's result."
    run_vs_loop(name, 'foreach', rtol=0)


def torch_fused_drift(steps: int = STEPS, lr: float = 3e-2) -> float:
    "How far torch's own fused AdamW drifts from its per-param AdamW on the same problem: the rounding budget."
    a, b = make_model(), make_model()
    oa = torch.optim.AdamW(a.parameters(), lr, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, fused=True)
    ob = torch.optim.AdamW(b.parameters(), lr, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, foreach=False)
    drift = 0.
    for i in range(steps):
        train(oa, a, 1, start=i), train(ob, b, 1, start=i)
        drift = max(drift, max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a.parameters(), b.parameters())))
    return drift


@pytest.mark.parametrize('backend', ['auto', 'fused'])
def test_adamw_uses_torch_kernel(backend, monkeypatch):
    "cbopt's AdamW runs as torch._fused_adamw_, within torch's own fused-vs-loop rounding drift (and 1e-6 on a calm lr)."
    calls, rtol = [], max(1e-6, 2 * torch_fused_drift())
    kernel = torch._fused_adamw_
    monkeypatch.setattr(torch, '_fused_adamw_', lambda *a, **k: calls.append(1) or kernel(*a, **k))
    run_vs_loop('adam', backend, rtol=rtol)
    assert len(calls) == 2 * (STEPS - 1)  # two groups; the first step (creating the state) runs eagerly
    run_vs_loop('adam', backend, lr=3e-3)


@pytest.mark.parametrize('name', ['sgd-mom', 'rmsprop', 'adam-l2', 'qhadam', 'lamb', 'lars', 'lookahead-sgd', 'lion']
                         if not SLOW else [*PREBUILT, *USER])
def test_fused_compiled_chain(name):
    "The chain compiled over each bucket (graph as inductor gets it) follows the loop."
    run_vs_loop(name, aot('fused'), steps=30 if not SLOW else STEPS)


@pytest.mark.parametrize('name', ['lion', 'radam', 'larc'] if not SLOW else [*PREBUILT, *USER])
def test_fused_inductor(name):
    "Through inductor: fused kernels, still 1e-6 from the loop; lr and step changes do not recompile."
    from torch._dynamo.utils import counters
    before = counters['stats']['unique_graphs']
    ours, ref = make_model(), make_model()
    opt, ref_opt = build(name, two_groups(ours), 3e-2, 'fused'), build(name, two_groups(ref), 3e-2, 'loop')
    for i in range(12):
        for o in (opt, ref_opt): o.set_hyper('lr', [1e-3 * (1 + i), 3e-3 * (1 + i)])  # per group, every step
        train(ref_opt, ref, 1, start=i), train(opt, ours, 1, start=i)
        assert_rel_close(ours, ref, msg=f"step {i}:")
    # one graph per shape (bias, weight), shared by both groups whatever their lr; RAdam's branch (r > 5) flips once
    expected = {'lion': 2, 'radam': 4}.get(name)
    if expected is not None: assert counters['stats']['unique_graphs'] - before == expected


# -- bucketing edge cases ----------------------------------------------------------------------------------------
def edge_case_run(backend: str, name: str):
    "Params without a grad on some steps, a frozen group but for one force_train weight, do_wd=False on biases, an empty group."
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    groups = [list(model[0].parameters()), list(model[2].parameters()), list(model[4].parameters()), []]
    opt = build(name, groups, 1e-2, backend)
    for p in (model[0].bias, model[4].bias): opt.state[p]['do_wd'] = False
    opt.state[model[0].weight]['force_train'] = True
    opt.freeze_to(1)  # group 0 frozen: its bias gets no grad, its force_train weight does
    g = torch.Generator().manual_seed(0)
    for i in range(20):
        x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
        for p in model.parameters(): p.grad = None
        with torch.enable_grad():
            h = model[3](model[2](model[1](model[0](x))))
            torch.nn.functional.mse_loss(model[4](h), y).backward()
        if i % 3 == 1: model[4].weight.grad = None  # no grad this step
        opt.step()
    return model, opt


@pytest.mark.parametrize('backend', ['foreach', 'auto'])
@pytest.mark.parametrize('name', ['adam', 'lamb', 'sgd-mom', 'ranger', 'lion'])
def test_edge_cases(name, backend):
    ours, opt = edge_case_run(backend, name)
    ref, ref_opt = edge_case_run('loop', name)
    assert_rel_close(ours, ref, rtol=0 if backend == 'foreach' else 1e-6)
    assert [opt.state[p].keys() for p in opt.params] == [ref_opt.state[p].keys() for p in ref_opt.params]
    assert 'grad_avg' not in opt.state[ours[0].bias]  # frozen: never stepped


@pytest.mark.parametrize('backend', ['foreach', 'auto'])
@pytest.mark.parametrize('name', ['adam', 'sgd-mom', 'lamb'])
def test_mixed_dtypes(name, backend):
    "fp32, bf16 and fp16 params in one group: one bucket each; fp32 bit for bit, half types within a few of their ulps."
    def run(be):
        torch.manual_seed(0)
        ps = [torch.randn(5, 3, dtype=dt, requires_grad=True) for dt in (torch.float32, torch.bfloat16, torch.float16)]
        opt = build(name, ps, 1e-2, be)
        for i in range(10):
            for j, p in enumerate(ps): p.grad = torch.sin(p.detach().float() * (i + j + 1)).to(p.dtype)
            opt.step()
        return ps
    for a, b in zip(run(backend), run('loop')):
        tol = (0 if backend == 'foreach' else 1e-6) if a.dtype == torch.float32 else 8 * torch.finfo(a.dtype).eps
        tol *= b.abs().max().item()
        assert (a.float() - b.float()).abs().max().item() <= tol, a.dtype


def test_buckets_split_what_must_differ():
    "One bucket per (group, dtype, flags, Python state), in group order."
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].to(torch.float64)
    opt = cbopt.Adam([list(m.parameters()) for m in model])
    opt.state[model[0].bias]['do_wd'] = False
    for p in model.parameters(): p.grad = torch.ones_like(p)
    model[2].bias.grad = None
    bs = bucketing.buckets(opt)
    assert [[n for n, p in model.named_parameters() if any(p is q for q in b.params)] for b in bs] == \
        [['0.weight'], ['0.bias'], ['1.weight', '1.bias'], ['2.weight']]
    opt.step()
    model[2].bias.grad = torch.ones_like(model[2].bias)
    assert len(bucketing.buckets(opt)) == 5  # 2.bias has not stepped yet: step 0, no state, its own bucket


# -- state interchange -------------------------------------------------------------------------------------------
@pytest.mark.parametrize('name,first', [('adam', 'fused'), ('lion', 'fused'), ('lamb', 'foreach')])
def test_state_interchange(name, first):
    "Save under `first` and resume under loop, save under loop and resume under `first`: the loop's trajectory."
    ref, ours, ours2 = make_model(), make_model(), make_model()
    ref_opt, opt = build(name, two_groups(ref), 3e-3, 'loop'), build(name, two_groups(ours), 3e-3, aot(first))
    train(ref_opt, ref, 10), train(opt, ours, 10)
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert {k: set(v) for k, v in sd['state'].items()} == {k: set(v) for k, v in ref_sd['state'].items()}
    with torch.no_grad():
        for a, b in zip(ours2.parameters(), ref.parameters()): a.copy_(b)
    resumed, again = build(name, two_groups(ours), 3e-3, 'loop'), build(name, two_groups(ours2), 3e-3, aot(first))
    resumed.load_state_dict(sd), again.load_state_dict(ref_sd)
    for i in range(10, 30):
        train(ref_opt, ref, 1, start=i), train(resumed, ours, 1, start=i), train(again, ours2, 1, start=i)
        assert_rel_close(ours, ref, msg=f"saved under {first}, resumed under loop, step {i}:")
        assert_rel_close(ours2, ref, msg=f"saved under loop, resumed under {first}, step {i}:")


# -- fallback ----------------------------------------------------------------------------------------------------
def grad_avg_then_branch(p, grad_avg=None, **kwargs):
    "Mutates state, then takes a Python branch on a tensor value: cannot run bucket-wise."
    if grad_avg is None: grad_avg = torch.zeros_like(p.grad.data)
    grad_avg.mul_(0.9).add_(p.grad.data)
    if grad_avg.abs().max() > 1e-3: grad_avg.mul_(0.5)
    return {'grad_avg': grad_avg}


@pytest.mark.parametrize('backend', ['foreach', 'fused', 'auto'])
def test_fallback_per_param_warns_once(backend):
    "A callback with tensor control flow runs param by param (once, never half on the bucket), warning once by name."
    def make(m, be):
        return cbopt.Optimizer(two_groups(m), [cbopt.weight_decay, grad_avg_then_branch, cbopt.momentum_step],
                               backend=be, lr=1e-2, wd=0.1)
    ours, ref = make_model(), make_model()
    opt, ref_opt = make(ours, aot(backend)), make(ref, 'loop')
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for i in range(5):
            train(ref_opt, ref, 1, start=i), train(opt, ours, 1, start=i)
            assert_rel_close(ours, ref, rtol=0)
    msgs = [str(x.message) for x in w if 'grad_avg_then_branch' in str(x.message)]
    assert len(msgs) == 1, msgs


def test_tensorlist_bool_raises():
    tl = cbopt.TensorList([torch.ones(2), torch.zeros(3)])
    with pytest.raises(cbopt.BucketError): bool(tl.abs().max() > 0)
    assert [t.shape for t in tl.pow(2).mean().sqrt()] == [(), ()]


def test_unknown_backend():
    with pytest.raises(ValueError, match='backend'): cbopt.SGD(make_model().parameters(), backend='fast')


def test_auto_times_foreach_and_loop_on_cpu():
    "On CPU auto tries foreach and loop on each bucket layout, then keeps the faster; results stay the loop's."
    trials_n = cbopt.Backend().auto_trials
    opt, _ = run_vs_loop('rmsprop', 'auto', steps=2 + 2 * trials_n, rtol=0)
    trials = [t for t in runtime.runtime(opt).auto_times.values() if sum(map(len, t.values())) > 1]
    assert trials and all(len(t['foreach']) == len(t['loop']) == trials_n for t in trials)


def test_wrappers_keep_the_backend():
    ps = list(make_model().parameters())
    assert cbopt.Lookahead(cbopt.SGD(ps, backend='loop')).backend == 'loop'
    assert cbopt.ranger(ps, backend='fused').backend == 'fused'
    assert cbopt.Adam(ps).backend == 'auto'


@pytest.mark.parametrize('name', ['adam', 'lamb', 'ranger', 'sgd-mom'])
def test_foreach_runs_cpu_buckets_in_cache_sized_chunks(name):
    "A CPU bucket larger than FOREACH_CHUNK_BYTES runs chunk by chunk (cache reuse between ops): still bit-exact."
    small = cbopt.Backend('foreach', cpu_chunk_bytes=100)
    model = make_model()
    opt = build(name, two_groups(model), 3e-2, small)
    set_grads(model, 0)
    sizes = [[p.numel() * p.element_size() for p in c.params] for b in bucketing.buckets(opt) for c in bucketing.cache_chunks(b, 100)]
    assert len(sizes) > len(bucketing.buckets(opt))
    assert all(len(c) == 1 or sum(c) <= 100 for c in sizes)
    run_vs_loop(name, small, rtol=0)


def test_fallback_probes_a_layout_once(monkeypatch):
    "After a bucket layout fails its probe, later steps go straight to the per-param loop (no probe per step)."
    calls = []
    real = foreach_runner.probe
    monkeypatch.setattr(foreach_runner, 'probe', lambda *a: calls.append(1) or real(*a))
    ours, ref = make_model(), make_model()
    make = lambda m, be: cbopt.Optimizer(two_groups(m), [cbopt.weight_decay, grad_avg_then_branch, cbopt.momentum_step],
                                         backend=be, lr=1e-2, wd=0.1)
    opt, ref_opt = make(ours, 'foreach'), make(ref, 'loop')
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for i in range(5):
            train(ref_opt, ref, 1, start=i), train(opt, ours, 1, start=i)
            assert_rel_close(ours, ref, rtol=0)
            if i == 1: after_two = len(calls)  # layouts: stateless on step 1, with `grad_avg` from step 2 on
    assert after_two == 2 * len(bucketing.buckets(opt)) and len(calls) == after_two
