"""Every backend follows the per-param `loop` reference for every case of the registry (`cases.py`), params checked
after every step relative to each tensor's own scale; bucketing edge cases; state interchange; auto's choices; the
per-param fallback.

foreach is checked bit for bit over 100 steps (with the default and with tiny cache chunks). Compiling is slow on
CPU, so the compiled chain is checked for the cases that name a compiler in `Case.compiles`: with torch.compile's
`aot_eager` backend (the same dynamo graph, without inductor's codegen) over 30 steps, or through inductor over 12
steps with changing lrs; `CBOPT_SLOW=1` runs every case both ways."""
import copy
import dataclasses
import functools
import os
import types
import warnings

import pytest
import torch
from torch import nn

import cbopt
from cbopt.core.chain import chain_scope, param_chain
from cbopt.engine.kernels import has_kernel
from cbopt.engine import auto as auto_runner
from cbopt.engine import buckets as bucketing
from cbopt.engine import foreach as foreach_runner
from cases import CASES, Case, case, lion
from conftest import NO_COMPILE_FALLBACK, assert_rel_close, assert_same_params, make_model, set_grads, train, two_groups

pytestmark = [pytest.mark.usefixtures('one_thread'), NO_COMPILE_FALLBACK]
STEPS = 100
SLOW = bool(os.environ.get('CBOPT_SLOW'))
EXACT = dict(rtol=0., atol=0.)


def aot(kind: str) -> cbopt.Backend:
    "`kind`, compiling the fused chain with aot_eager: dynamo's full graph and functionalization, no C++ codegen."
    return cbopt.Backend(kind, compiler='aot_eager')


def run_vs_loop(c: Case, *backends, lr: float = 3e-2, steps: int = STEPS, rtol: float = 1e-6, atol: float = 0.):
    "Train with each of `backends` and with the loop side by side, checking every param after every step."
    ref = make_model()
    ref_opt = c.build(two_groups(ref), lr, 'loop')
    runs = [(be, make_model()) for be in backends]
    opts = [c.build(two_groups(m), lr, be) for be, m in runs]
    for i in range(steps):
        train(ref_opt, ref, 1, start=i)
        for (be, m), opt in zip(runs, opts):
            train(opt, m, 1, start=i)
            assert_rel_close(m, ref, rtol=rtol, atol=atol, msg=f"{c} {be} step {i}:")
    return opts, ref_opt


def cases_where(pred) -> list[Case]:
    return [c for c in CASES if SLOW or pred(c)]


# -- parity ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('c', CASES, ids=str)
def test_foreach_is_loop(c):
    """foreach runs the same ops in the same order: bit for bit the loop's result, also when a CPU bucket runs in
    cache-sized chunks (here 100 bytes: every chunk a param or two)."""
    tiny_chunks = cbopt.Backend('foreach', cpu_chunk_bytes=100)
    run_vs_loop(c, 'foreach', tiny_chunks, **(EXACT if c.bit_exact_foreach else {}))


def test_cache_chunks_split_cpu_buckets():
    "A CPU bucket larger than `cpu_chunk_bytes` is cut into runs of params that fit (a larger param alone)."
    model = make_model()
    opt = case('adam').build(two_groups(model), 3e-2, cbopt.Backend('foreach', cpu_chunk_bytes=100))
    set_grads(model, 0)
    bs = bucketing.buckets(opt)
    chunks = [c for b in bs for c in bucketing.cache_chunks(b, 100)]
    sizes = [[p.numel() * p.element_size() for p in c.params] for c in chunks]
    assert len(chunks) > len(bs) and all(len(c) == 1 or sum(c) <= 100 for c in sizes)
    assert [p for c in chunks for p in c.params] == [p for b in bs for p in b.params]  # every param once, in order


@functools.cache
def torch_fused_drift(c: Case, steps: int = STEPS, lr: float = 3e-2) -> float:
    "How far torch's own fused kernel drifts from its for-loop on the same problem, per tensor: the rounding budget."
    a, b = make_model(), make_model()
    oa, ob = c.torch(a.parameters(), lr, fused=True), c.torch(b.parameters(), lr, foreach=False)
    drift = 0.
    for i in range(steps):
        train(oa, a, 1, start=i), train(ob, b, 1, start=i)
        drift = max(drift, max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a.parameters(), b.parameters())))
    return drift


TORCH_KERNELS = ('_fused_adamw_', '_fused_adam_', '_fused_sgd_', '_fused_adagrad_')  # the torch ops cbopt registers


def count_kernel_calls(monkeypatch) -> list:
    "A list that gets the op's name at each call of one of torch's fused kernels cbopt registers."
    calls = []
    for name in TORCH_KERNELS:
        monkeypatch.setattr(torch, name, lambda *a, _k=getattr(torch, name), _n=name, **k: calls.append(_n) or _k(*a, **k))
    return calls


@pytest.mark.parametrize('backend', ['auto', 'fused'])
@pytest.mark.parametrize('c', [c for c in CASES if c.has_torch_kernel and c.torch is not None], ids=str)
def test_torch_kernel_follows_loop(c, backend, monkeypatch):
    """A chain with a torch kernel runs as torch's fused kernel (`_fused_adamw_`, `_fused_adam_` with L2,
    `_fused_sgd_`, `_fused_adagrad_`), within twice torch's own fused-vs-loop rounding drift of each tensor (and 1e-6
    of it on a calm lr): the kernels round otherwise than the loop's ops (fused multiply-adds, another order)."""
    rtol = max(1e-6, 2 * torch_fused_drift(c))  # (torch's own kernel runs there: before the counting)
    calls = count_kernel_calls(monkeypatch)
    _, ref_opt = run_vs_loop(c, backend, rtol=rtol)
    stateless = not any(ref_opt.state.values())  # (plain SGD: nothing to create, the kernel steps from the first step)
    # one call per step: the two groups, alike, share one bucket; a first step creating state runs eagerly
    assert len(calls) == STEPS - (0 if stateless else 1)
    run_vs_loop(c, backend, lr=3e-3)


@pytest.mark.parametrize('c', CASES, ids=str)
def test_auto_takes_kernel_where_flagged_and_never_compiles(c, monkeypatch):
    """`auto` takes torch's kernel exactly for the cases flagged `has_torch_kernel`, and never compiles (the README:
    'It never compiles: ask for "fused" for that'), through its trials and after."""
    calls = count_kernel_calls(monkeypatch)
    monkeypatch.setattr(torch, 'compile', lambda *a, **k: pytest.fail('auto called torch.compile'))
    model = make_model()
    train(c.build(two_groups(model), 3e-2, 'auto'), model, 2 + 2 * cbopt.Backend().auto_trials)
    assert bool(calls) == c.has_torch_kernel


@pytest.mark.parametrize('c', cases_where(lambda c: 'aot_eager' in c.compiles), ids=str)
def test_fused_compiled_chain(c):
    "The chain compiled over each bucket (graph as inductor gets it) follows the loop."
    run_vs_loop(c, aot('fused'), steps=30 if not SLOW else STEPS)


@pytest.mark.parametrize('c', cases_where(lambda c: 'inductor' in c.compiles), ids=str)
def test_fused_inductor(c):
    "Through inductor: fused kernels, still 1e-6 from the loop; lr and step changes do not recompile."
    from torch._dynamo.utils import counters
    # dynamo's caches and automatic-dynamic marks are per code object and process-wide: counted from a fresh start, as
    # a new process has it (graphs the other cases' compiles left change how many this one needs)
    torch._dynamo.reset()
    before = counters['stats']['unique_graphs']
    ours, ref = make_model(), make_model()
    opt, ref_opt = c.build(two_groups(ours), 3e-2, 'fused'), c.build(two_groups(ref), 3e-2, 'loop')
    for i in range(12):
        for o in (opt, ref_opt): o.set_hyper('lr', [1e-3 * (1 + i), 3e-3 * (1 + i)])  # per group, every step
        train(ref_opt, ref, 1, start=i), train(opt, ours, 1, start=i)
        assert_rel_close(ours, ref, msg=f"step {i}:")
    # one graph per shape (bias, weight), shared by both groups whatever their lr
    if c.inductor_graphs is not None: assert counters['stats']['unique_graphs'] - before == c.inductor_graphs


@pytest.mark.parametrize('c', CASES, ids=str)
def test_tensor_scope_flag(c):
    "The registry's `tensor_scope` says what the chain declares (declared chains only: user chains declare nothing)."
    opt = c.build(two_groups(make_model()), 3e-2)
    scopes = {chain_scope(g['cbs']) for g in opt.param_groups}
    if c.splits_groups and c.tensor_scope: assert scopes == {'tensor', 'element'}  # Muon's matrices, AdamW's rest
    else: assert scopes == {'tensor'} if c.tensor_scope else scopes <= {'element', None}


# -- bucketing edge cases ----------------------------------------------------------------------------------------
@functools.cache  # the loop's run is every backend's reference: computed once per case (nothing mutates it after)
def edge_case_run(c: Case, backend: str):
    "Params without a grad on some steps, a frozen group but for one force_train weight, do_wd=False on biases, an empty group."
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    groups = [list(model[0].parameters()), list(model[2].parameters()), list(model[4].parameters()), []]
    opt = c.build(groups, 1e-2, backend)
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


def bit_exact(c: Case, backend: str) -> bool:
    """Whether `backend` gives the loop's result bit for bit on `c`: foreach where flagged; auto where no torch kernel
    may step a bucket (one registered for a chain may take only some buckets: fastai's SGD, decoupled, at do_wd=False)."""
    if backend == 'foreach': return c.bit_exact_foreach
    chains = [g['cbs'] for g in c.build([nn.Parameter(torch.zeros(1))], 1e-2, 'loop').param_groups]
    return backend == 'auto' and not c.has_torch_kernel and not any(has_kernel(param_chain(cbs)) for cbs in chains)


@pytest.mark.parametrize('backend', ['foreach', 'auto'])
@pytest.mark.parametrize('c', CASES, ids=str)
def test_edge_cases(c, backend):
    ours, opt = edge_case_run(c, backend)
    ref, ref_opt = edge_case_run(c, 'loop')
    exact = bit_exact(c, backend)
    assert_rel_close(ours, ref, **(EXACT if exact else {}))
    assert [opt.state[p].keys() for p in opt.params] == [ref_opt.state[p].keys() for p in ref_opt.params]
    assert set(opt.state[ours[0].bias]) == {'do_wd'}  # frozen (Muon: both halves of the given group 0): never stepped


@pytest.mark.parametrize('backend', ['foreach', 'auto'])
@pytest.mark.parametrize('c', CASES, ids=str)
def test_mixed_dtypes(c, backend):
    "fp32, bf16 and fp16 params in one group: one bucket each; fp32 bit for bit, half types within a few of their ulps."
    exact = bit_exact(c, backend)
    for a, b in zip(mixed_dtypes_run(c, backend), mixed_dtypes_run(c, 'loop')):
        tol = (0 if exact else 1e-6) if a.dtype == torch.float32 else 8 * torch.finfo(a.dtype).eps
        tol *= b.abs().max().item()
        assert (a.float() - b.float()).abs().max().item() <= tol, a.dtype


@functools.cache
def mixed_dtypes_run(c: Case, backend: str) -> list:
    torch.manual_seed(0)
    ps = [torch.randn(5, 3, dtype=dt, requires_grad=True) for dt in (torch.float32, torch.bfloat16, torch.float16)]
    opt = c.build(ps, 1e-2, backend)
    for i in range(10):
        for j, p in enumerate(ps): p.grad = torch.sin(p.detach().float() * (i + j + 1)).to(p.dtype)
        opt.step()
    return ps


def test_buckets_split_what_must_differ():
    "One bucket per (group or groups alike, dtype, flags, Python state), in group order."
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].to(torch.float64)
    opt = cbopt.Adam([list(m.parameters()) for m in model])
    opt.state[model[0].bias]['do_wd'] = False
    for p in model.parameters(): p.grad = torch.ones_like(p)
    model[2].bias.grad = None
    bs = bucketing.buckets(opt)
    assert [[n for n, p in model.named_parameters() if any(p is q for q in b.params)] for b in bs] == \
        [['0.weight', '2.weight'], ['0.bias'], ['1.weight', '1.bias']]  # (groups 0 and 2 are alike: one bucket)
    opt.step()
    model[2].bias.grad = torch.ones_like(model[2].bias)
    assert len(bucketing.buckets(opt)) == 4  # 2.bias has not stepped yet: step 0, no state, its own bucket


def test_buckets_split_on_python_state_values():
    """Two params of one group with the same dtype, flags and state keys, one of which skipped a step: their step
    counts differ, so they go in separate buckets, and each steps with its own count (RAdam's rectification and bias
    corrections depend on it) exactly as the loop does."""
    def make():
        torch.manual_seed(0)
        w, b = torch.randn(3, 4, requires_grad=True), torch.randn(3, requires_grad=True)
        return w, b, case('radam').build([w, b], 3e-2, 'foreach')
    (w, b, opt), (rw, rb, ref) = make(), make()
    ref.backend = 'loop'
    for i in range(12):
        for ps, o in (((w, b), opt), ((rw, rb), ref)):
            g = torch.Generator().manual_seed(i)
            for p in ps: p.grad = torch.randn(p.shape, generator=g)
            if i == 1: ps[1].grad = None  # b skips the second step
        if i >= 2:  # as the step is about to bucket them: same state keys, only the step count's value differs
            assert set(opt.state[w]) == set(opt.state[b]) and (opt.state[w]['step'], opt.state[b]['step']) == (i, i - 1)
            assert [bk.params for bk in bucketing.buckets(opt)] == [[w], [b]]
        opt.step(), ref.step()
    for p, q in ((w, rw), (b, rb)): assert torch.equal(p, q)
    assert (ref.state[rw]['step'], ref.state[rb]['step']) == (12, 11)


# -- state interchange -------------------------------------------------------------------------------------------
def interchange_backends(c: Case) -> list:
    """foreach for every case; the fused runner for torch's kernel and for the chain the quick suite compiles both ways
    (the compiled runner writes every chain's state the same way, and each compile costs seconds); all under SLOW."""
    fused = c.has_torch_kernel or {'aot_eager', 'inductor'} <= set(c.compiles) or SLOW
    return ['foreach'] + (['fused'] if fused else [])


@pytest.mark.parametrize('c,first', [(c, be) for c in CASES for be in interchange_backends(c)],
                         ids=[f'{c}-{be}' for c in CASES for be in interchange_backends(c)])
def test_state_interchange(c, first):
    "Save under `first` and resume under loop, save under loop and resume under `first`: the loop's trajectory."
    first = aot(first) if first == 'fused' else first
    ref, ours, ours2 = make_model(), make_model(), make_model()
    ref_opt, opt = c.build(two_groups(ref), 3e-3, 'loop'), c.build(two_groups(ours), 3e-3, first)
    train(ref_opt, ref, 10), train(opt, ours, 10)
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert {k: set(v) for k, v in sd['state'].items()} == {k: set(v) for k, v in ref_sd['state'].items()}
    with torch.no_grad():
        for a, b in zip(ours2.parameters(), ref.parameters()): a.copy_(b)
    resumed, again = c.build(two_groups(ours), 3e-3, 'loop'), c.build(two_groups(ours2), 3e-3, first)
    resumed.load_state_dict(sd), again.load_state_dict(ref_sd)
    for i in range(10, 30):
        train(ref_opt, ref, 1, start=i), train(resumed, ours, 1, start=i), train(again, ours2, 1, start=i)
        assert_rel_close(ours, ref, msg=f"saved under {first}, resumed under loop, step {i}:")
        assert_rel_close(ours2, ref, msg=f"saved under loop, resumed under {first}, step {i}:")


# -- auto --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('slow', ['loop', 'foreach'])
def test_auto_keeps_the_faster_runner(slow, monkeypatch):
    """On CPU, auto times foreach and loop on each bucket layout for `auto_trials` steps each, then keeps the faster.
    auto's clock is a fake one that each runner's call advances, by 1 s for the `slow` one and 1 ms for the other, so
    the outcome does not depend on the machine's load: after the trials, auto only calls the other, and the results
    stay the loop's bit for bit."""
    calls, clock = [], [0.]
    def wrap(name, run):
        def timed(*a):
            calls.append(name)
            clock[0] += 1. if name == slow else 1e-3
            return run(*a)
        return timed
    monkeypatch.setattr(auto_runner, 'time', types.SimpleNamespace(perf_counter=lambda: clock[0]))
    for name, run in list(auto_runner.RUNNERS.items()): monkeypatch.setitem(auto_runner.RUNNERS, name, wrap(name, run))
    trials = cbopt.Backend().auto_trials
    ours, ref = make_model(), make_model()
    c = case('rmsprop')
    opt, ref_opt = c.build([*ours.parameters()], 3e-2, 'auto'), c.build([*ref.parameters()], 3e-2, 'loop')
    # one bucket; step 1's layout has no state yet (one trial), the next 2*trials steps are the trials of the state-full one
    train(opt, ours, 1 + 2 * trials), train(ref_opt, ref, 1 + 2 * trials)
    assert sorted(calls) == sorted(['foreach'] * (trials + 1) + ['loop'] * trials)
    del calls[:]
    train(opt, ours, 4, start=1 + 2 * trials), train(ref_opt, ref, 4, start=1 + 2 * trials)
    assert calls == [{'loop': 'foreach', 'foreach': 'loop'}[slow]] * 4
    assert_same_params(ours, ref)


def test_wrappers_keep_the_backend():
    ps = list(make_model().parameters())
    assert cbopt.Lookahead(cbopt.SGD(ps, backend='loop')).backend == 'loop'
    assert cbopt.ranger(ps, backend='fused').backend == 'fused'
    assert cbopt.Adam(ps).backend == 'auto'


def test_unknown_backend():
    with pytest.raises(ValueError, match='backend'): cbopt.SGD(make_model().parameters(), backend='fast')


# -- fallback ----------------------------------------------------------------------------------------------------
def grad_avg_then_branch(p, grad_avg=None, **kwargs):
    "Mutates state, then takes a Python branch on a tensor value: cannot run bucket-wise."
    if grad_avg is None: grad_avg = torch.zeros_like(p.grad.data)
    grad_avg.mul_(0.9).add_(p.grad.data)
    if grad_avg.abs().max() > 1e-3: grad_avg.mul_(0.5)
    return {'grad_avg': grad_avg}


def centralize_grad(p, **kwargs):
    "Gradient centralisation, as the demo writes it: a Python branch on the param's shape (its number of dims)."
    g = p.grad.data
    if g.ndim > 1: g.sub_(g.mean(dim=tuple(range(1, g.ndim)), keepdim=True))


BRANCHING = {'tensor-value': [cbopt.weight_decay, grad_avg_then_branch, cbopt.momentum_step],
             'param-shape': [cbopt.weight_decay, centralize_grad, cbopt.average_grad, cbopt.momentum_step]}


@pytest.mark.parametrize('branch', BRANCHING)
@pytest.mark.parametrize('backend', ['foreach', 'fused', 'auto'])
def test_fallback_per_param_warns_once(backend, branch):
    """A callback with Python control flow on a tensor value or on a param's shape is caught by the probe: its
    buckets run param by param (never half on the bucket), bit for bit the loop's, with one warning naming it."""
    cbs = BRANCHING[branch]
    make = lambda m, be: cbopt.Optimizer(two_groups(m), cbs, backend=be, lr=1e-2, wd=0.1)
    ours, ref = make_model(), make_model()
    opt, ref_opt = make(ours, aot(backend)), make(ref, 'loop')
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for i in range(5):
            train(ref_opt, ref, 1, start=i), train(opt, ours, 1, start=i)
            assert_same_params(ours, ref, msg=f"step {i}:")
    msgs = [str(x.message) for x in w if cbs[1].__name__ in str(x.message)]
    assert len(msgs) == 1, msgs


@dataclasses.dataclass
class ScaledGrad:
    "A callback written as a dataclass instance: unhashable (a dataclass sets `__hash__ = None`), as users write them."
    factor: float = 0.5
    def __call__(self, p, **kwargs): p.grad = p.grad.data * self.factor
ScaledGrad.state = {}


@dataclasses.dataclass
class PlainStep:
    "An additive step as a dataclass instance, for `kahan`."
    def __call__(self, p, lr, **kwargs): p.data.add_(p.grad.data, alpha=-lr)
PlainStep.state, PlainStep.additive = {}, True


@pytest.mark.parametrize('backend', ['foreach', 'fused', 'auto'])
def test_an_unhashable_callback_runs_in_every_backend(backend):
    """A dataclass instance as a callback (unhashable): every backend runs it (the compiled chain and the kernel
    lookup key it by identity), bit for bit the loop over 5 steps; so does `kahan` of one."""
    for cbs in ([ScaledGrad(), cbopt.average_grad, cbopt.momentum_step], cbopt.kahan_chain([PlainStep()])):
        ours, ref = make_model(), make_model()
        opt, ref_opt = (cbopt.Optimizer(two_groups(m), cbs, lr=1e-2, backend=be) for m, be in ((ours, aot(backend)), (ref, 'loop')))
        with warnings.catch_warnings():
            warnings.simplefilter('error')  # (no fallback: the chain compiles)
            for i in range(5):
                train(ref_opt, ref, 1, start=i), train(opt, ours, 1, start=i)
                assert_same_params(ours, ref, msg=f"{backend} {cbopt.chain_name(cbs)} step {i}:")


def decayed_step(p, lr, mom, scale=None, **kwargs):
    "A user's callback keeping a 0-d float64 running product, updated in place (as torch's NAdam keeps `mu_product`)."
    if scale is None: scale = torch.ones((), dtype=torch.float64)
    scale.mul_(mom)
    p.data.add_(p.grad.data * (-lr * (1 - scale)))
    return {'scale': scale}
decayed_step.state = dict(scale=lambda p: torch.ones((), dtype=torch.float64))


@pytest.mark.parametrize('chain', ['nadam', 'users'])
def test_a_0d_float64_state_updated_in_place_keeps_its_updates_compiled(chain):
    """torch 2.13's AOT drops in-place updates of 0-d float64 graph inputs: NAdam's `mu_product` stayed at its first
    value in the fused backend on float64 params. The compiled chain and the traced step (an outer torch.compile)
    now hand the chain copies of such entries: float64 params and state, fused and traced, as the loop over 6 steps."""
    def make(ps, backend):
        if chain == 'nadam': return cbopt.NAdam(ps, lr=1e-2, backend=backend)
        return cbopt.Optimizer(ps, [decayed_step], lr=1e-2, mom=0.9, backend=backend)
    runs = {}
    for how in ('loop', 'fused', 'traced'):
        model = make_model(dtype=torch.float64)
        opt = make(model.parameters(), aot('fused') if how == 'fused' else 'loop')
        step = torch.compile(opt.step, backend='aot_eager') if how == 'traced' else opt.step
        for i in range(6):
            set_grads(model, i)
            step()
        key = 'mu_product' if chain == 'nadam' else 'scale'
        runs[how] = model, [opt.state[p][key].item() for p in model.parameters()]
    (ref, ref_values) = runs['loop']
    assert len(set(ref_values)) == 1 and ref_values[0] < 0.6  # (0.9 ** 6 for the user's; NAdam's momentum product)
    for how in ('fused', 'traced'):
        model, values = runs[how]
        assert values == pytest.approx(ref_values, rel=1e-12), how
        assert_rel_close(model, ref, rtol=1e-12, msg=f"{how}:")


def test_tensorlist_bool_raises():
    tl = cbopt.TensorList([torch.ones(2), torch.zeros(3)])
    with pytest.raises(cbopt.BucketError): bool(tl.abs().max() > 0)
    assert [t.shape for t in tl.pow(2).mean().sqrt()] == [(), ()]


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
            assert_same_params(ours, ref)
            if i == 1: after_two = len(calls)  # layouts: stateless on step 1, with `grad_avg` from step 2 on
    assert after_two == 2 * len(bucketing.buckets(opt)) and len(calls) == after_two


@pytest.mark.parametrize('backend', ['loop', 'foreach', 'fused'])
@pytest.mark.parametrize('c', CASES, ids=str)
def test_step_leaves_the_users_grads(c, backend):
    "The grad contract: a step never writes into `p.grad` (torch.optim leaves it as it was), L2 and maximize included."
    torch.manual_seed(0)
    ps = [torch.randn(4, 3, requires_grad=True), torch.randn(3, requires_grad=True)]
    opt = c.build(ps, 1e-2, backend)
    for i in range(3):
        grads = [torch.randn_like(p) for p in ps]
        for p, g in zip(ps, grads): p.grad = g
        kept = [g.clone() for g in grads]
        opt.step()
        assert all(p.grad is g for p, g in zip(ps, grads))
        assert all(torch.equal(g, k) for g, k in zip(grads, kept))


def test_l2_grad_left_as_torch_leaves_it():
    "cbopt's L2 (`decouple_wd=False`) steps as torch's SGD `weight_decay` and, like it, keeps `p.grad` unchanged."
    torch.manual_seed(0)
    a, b = torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)
    with torch.no_grad(): b.copy_(a)
    ours = cbopt.SGD([a], lr=0.1, mom=0.9, wd=0.1, decouple_wd=False)
    ref = torch.optim.SGD([b], lr=0.1, momentum=0.9, weight_decay=0.1)
    for i in range(10):
        g = torch.randn(5)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step(); ref.step()
        assert torch.equal(a.grad, g) and torch.equal(b.grad, g)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


# -- a chain changed in place ------------------------------------------------------------------------------------
REPLACED_CHAINS = {'kernel': lambda: cbopt.adam_chain(),  # AdamW, then Adam: torch's fused kernels under fused/auto
                   'compiled': lambda: [cbopt.weight_decay, lion]}  # no kernel: fused compiles it


@pytest.mark.parametrize('where', ['optimizer', 'group'])
@pytest.mark.parametrize('chain', list(REPLACED_CHAINS))
@pytest.mark.parametrize('backend', ['loop', 'foreach', 'fused', 'auto'])
def test_a_callback_replaced_in_place_runs_at_the_next_step(backend, chain, where):
    """`opt.cbs[0] = l2_reg` (or in a group's own chain: `opt.param_groups[1]['cbs'][0] = ...`), the same length,
    after steps that made every backend's plans, kernels or compiled graphs for the old chain: the next steps run the
    new chain, as an optimizer built with it from the start and given the same state does."""
    hypers = dict(lr=1e-2, wd=0.1, mom=0.9, sqr_mom=0.99)

    def build(model, be, new: bool):
        cbs, own = REPLACED_CHAINS[chain](), REPLACED_CHAINS[chain]()
        if new: (cbs if where == 'optimizer' else own)[0] = cbopt.l2_reg
        body, head = two_groups(model)
        return cbopt.Optimizer([{'params': body}, {'params': head, **({'cbs': own} if where == 'group' else {})}],
                               cbs, backend=aot(be) if be == 'fused' else be, **hypers)

    ours, ref = make_model(), make_model()
    opt, ref_opt = build(ours, backend, False), build(ref, 'loop', False)
    warm = 2 + 2 * cbopt.Backend().auto_trials  # auto has settled on its runner
    train(opt, ours, warm)
    train(ref_opt, ref, warm)
    (opt.cbs if where == 'optimizer' else opt.param_groups[1]['cbs'])[0] = cbopt.l2_reg
    new_ref = build(ref, 'loop', True)
    for p in ref.parameters(): new_ref.state[p] = ref_opt.state[p]
    train(opt, ours, 3, start=warm)
    train(new_ref, ref, 3, start=warm)
    # a kernel or a compiled graph rounds otherwise than the loop; the old chain would be ~1e-3 off
    tol = EXACT if backend in ('loop', 'foreach') else dict(rtol=1e-5, atol=1e-7)
    assert_rel_close(ours, ref, **tol, msg=f"{backend} {chain} {where}:")



@pytest.mark.parametrize('backend', ['loop', 'foreach', 'fused', 'auto'])
def test_a_param_group_replaced_by_a_copy_runs_at_the_next_step(backend):
    """`opt.param_groups[1] = copy(group)` with another lr (the same params and chain), after steps that made every
    backend's bucket plan and graphs: the next steps use the new dict's lr, as a twin whose group was changed in
    place does (the plan is made again for a group that is another object, even with an equal chain)."""
    ours, ref = make_model(), make_model()
    opt, ref_opt = (cbopt.Adam(two_groups(m), lr=1e-2, wd=0.1, backend=aot(be) if be == 'fused' else be)
                    for m, be in ((ours, backend), (ref, 'loop')))
    warm = 2 + 2 * cbopt.Backend().auto_trials
    train(opt, ours, warm)
    train(ref_opt, ref, warm)
    replaced = copy.copy(opt.param_groups[1])
    replaced['lr'] = 0.1
    opt.param_groups[1] = replaced
    ref_opt.param_groups[1]['lr'] = 0.1
    train(opt, ours, 3, start=warm)
    train(ref_opt, ref, 3, start=warm)
    tol = EXACT if backend in ('loop', 'foreach') else dict(rtol=1e-5, atol=1e-7)
    assert_rel_close(ours, ref, **tol, msg=f"{backend}:")

TORCH_SWITCHES = {'loop': dict(foreach=False), 'foreach': dict(foreach=True), 'fused': dict(fused=True), 'auto': {}}


@pytest.mark.parametrize('build', [lambda ps, kind: cbopt.SGD(ps, lr=0.1, mom=0.9, backend=kind),
                                   lambda ps, kind: cbopt.Adam(ps, lr=1e-2, wd=0.1, backend=kind),
                                   lambda ps, kind: cbopt.optim.AdamW(ps, lr=1e-2, **TORCH_SWITCHES[kind])],
                         ids=['SGD', 'Adam', 'optim.AdamW'])
def test_grad_dtype_steps_alike_in_every_backend(build):
    """bf16 params whose `grad_dtype` is float32 (torch 2.13), given fp32 grads, one large and several small (packed by
    the fused backend): every backend steps them as the loop does, bit for bit (fused runs such buckets with foreach:
    torch.compile does not trace a tensor whose grad has another dtype), with no warning."""
    def run(kind):
        torch.manual_seed(0)
        ps = [nn.Parameter(torch.randn(n, dtype=torch.bfloat16)) for n in (3000, 8, 8, 8)]
        for p in ps: p.grad_dtype = torch.float32
        opt = build(ps, kind)
        for i in range(3):
            for j, p in enumerate(ps): p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * i + j))
            opt.step()
        return ps
    ref = run('loop')
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        for kind in ('foreach', 'auto', 'fused'):
            for p, q in zip(run(kind), ref): assert torch.equal(p, q), kind
