"""torch.optim's elementwise algorithms as cbopt optimizers (cbopt.torch_optimizers) against the torch classes.

For every config: 40 steps on a tiny MLP with real grads follow the torch class within 1e-5 of each tensor's own
scale, params and state alike (torch's state names mapped to cbopt's), in the `loop` and `foreach` backends, foreach bit
for bit with loop and with no warning (no param-by-param fallback); the compiled chain (`fused`, traced with aot_eager)
follows torch too; a torch state_dict loads into the cbopt twin, which then goes on as torch does; cbopt's own
state_dict reads back with `torch.load(weights_only=True)` and resumes bit for bit; `init_state` creates the state
the chain would. Each algorithm also trains as a fastai `opt_func` as torch's class does in fastai's `OptimWrapper`."""
import copy
import inspect
import io
import warnings
from functools import partial

import pytest
import torch
from torch import nn, optim

import cbopt
from cbopt.state.formats import torch_state_names
from cbopt.recipes.torch_optim import ASGD, Adadelta, Adafactor, Adagrad, Adamax, Muon, NAdam, Rprop
import torch.nn.functional as F
from cases import TORCH_CONFIGS
from conftest import assert_rel_close, assert_tensor_close, make_model, set_grads, train

pytestmark = pytest.mark.usefixtures('one_thread')

STEPS, TOL = 40, 1e-5
# conftest's comparison is per tensor; its older form took `per_tensor=True` to be (else: the model's scale)
PER_TENSOR = {'per_tensor': True} if 'per_tensor' in inspect.signature(assert_rel_close).parameters else {}

STRUCTURE = ('decouple_wd', 'amsgrad', 'maximize')  # arguments that choose the chain; the others are hypers
FUSED = ['adagrad-decay-l2', 'adadelta-rho-l2', 'adamax-betas-l2', 'nadamw', 'asgd-avg-l2', 'rprop-etas',
         'adam-amsgrad', 'adafactor-all']  # one per algorithm


def cbopt_run(name: str, backend, steps: int = STEPS, model=None, start: int = 0):
    "The cbopt twin of case `name` trained `steps` steps on `model` (a fresh `make_model` by default), warnings as errors."
    model = model if model is not None else make_model()
    opt = TORCH_CONFIGS[name][0](model.named_parameters(), backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # a foreach fallback or a compile failure warns
        train(opt, model, steps, start)
    return model, opt


def torch_run(name: str, steps: int = STEPS):
    "The torch.optim reference of case `name`, trained `steps` steps on a fresh `make_model`."
    model = make_model()
    opt = TORCH_CONFIGS[name][1](model.parameters())
    train(opt, model, steps)
    return model, opt


def assert_state_close(ours, ref, model) -> None:
    """Every state entry torch keeps that cbopt keeps too (under its cbopt name) is within TOL of torch's, relative to
    its own scale; step counts equal. torch's ASGD `eta` and `mu` are not kept (computed from the step)."""
    chains = {p: g['cbs'] for g in ours.param_groups for p in g['params']}
    for i, p in enumerate(model.parameters()):
        theirs, mine = ref.state_dict()['state'][i], ours.state[p]
        for k, v in theirs.items():
            k = torch_state_names(chains[p]).get(k, k)
            if k not in mine:
                assert k in ('step', 'eta', 'mu'), f"torch state {k!r} has no cbopt counterpart"
                continue
            if k == 'step': assert mine[k] == int(v), f"param {i}: step {mine[k]} != torch's {int(v)}"
            else: assert_tensor_close(mine[k], v, f"param {i} state {k!r}", TOL)


def assert_same(a, b) -> None:
    "The same params, bit for bit."
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"param {n} differs"


@pytest.mark.parametrize('name', TORCH_CONFIGS)
def test_loop_and_foreach_follow_torch(name):
    "40 steps: loop within 1e-5 of torch (params and state), foreach bit-exact with loop and bucket-wise (no warning)."
    ref, ref_opt = torch_run(name)
    start = make_model()
    for p, q in zip(ref.parameters(), start.parameters()):  # parity on params that barely moved would prove little
        assert (p - q).abs().max() > 1e-2 * q.abs().max()
    loop, loop_opt = cbopt_run(name, 'loop')
    assert_rel_close(loop, ref, rtol=TOL, msg=f'{name} loop vs torch:', **PER_TENSOR)
    assert_state_close(loop_opt, ref_opt, loop)
    each, each_opt = cbopt_run(name, 'foreach')
    assert_same(each, loop)
    for p, q in zip(each.parameters(), loop.parameters()):
        st, st_loop = each_opt.state[p], loop_opt.state[q]
        assert st.keys() == st_loop.keys()
        assert all(torch.equal(v, st_loop[k]) if torch.is_tensor(v) else v == st_loop[k] for k, v in st.items())


@pytest.mark.parametrize('name', FUSED)
def test_fused_follows_torch(name):
    """The compiled chain (aot_eager: dynamo's graph, no codegen) follows torch over 10 steps, with no fallback warning.
    Only the weight matrices are optimized, on both sides: one compiled graph per algorithm (seconds each on CPU)."""
    models = [make_model(), make_model()]
    weights = [[(n, p) for n, p in m.named_parameters() if p.ndim == 2] for m in models]
    ours = TORCH_CONFIGS[name][0](weights[0], backend=cbopt.Backend('fused', compiler='aot_eager'))
    ref = TORCH_CONFIGS[name][1]([p for _, p in weights[1]])
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # a compile failure warns (and runs foreach)
        train(ours, models[0], 10)
    train(ref, models[1], 10)
    assert_rel_close(models[0], models[1], rtol=TOL, msg=f'{name} fused vs torch:', **PER_TENSOR)
    assert not torch.equal(models[0][0].weight, make_model()[0].weight)


def test_asgd_averaged_params_are_torchs_ax():
    "ASGD's averaged params (`param_avg` by FQN, torch's `ax`) differ from the params once averaging starts, as torch's."
    ref, ref_opt = torch_run('asgd-avg-l2')
    for backend in ('loop', 'foreach'):
        model, opt = cbopt_run('asgd-avg-l2', backend)
        avgs = {n: st['param_avg'] for n, st in opt.named_state_dict()['state'].items()}
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            ax = ref_opt.state[q]['ax']
            assert (avgs[n] - p).abs().max() > 1e-3 * p.abs().max()  # an average, not a copy of the params
            assert (avgs[n] - ax).abs().max() <= TOL * ax.abs().max()


@pytest.mark.parametrize('name', TORCH_CONFIGS)
def test_torch_state_dict_loads_and_continues(name):
    "A torch.optim state_dict after 20 steps (read back with weights_only) loads into the twin, which goes on as torch."
    ref, ref_opt = torch_run(name, steps=20)
    buf = io.BytesIO()
    torch.save(ref_opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    model = copy.deepcopy(ref)
    opt = TORCH_CONFIGS[name][0](model.named_parameters(), backend='loop')
    opt.load_state_dict(sd)
    train(ref_opt, ref, 20, start=20)
    train(opt, model, 20, start=20)
    assert_rel_close(model, ref, rtol=TOL, msg=f'{name} resumed from torch:', **PER_TENSOR)
    assert_state_close(opt, ref_opt, model)


@pytest.mark.parametrize('name', TORCH_CONFIGS)
def test_cbopt_state_dict_continues_in_torch(name):
    """The reverse: the twin's `state_dict(format=<torch class>)` after 20 steps (through weights_only) loads into
    torch's class, which goes on as the twin does."""
    model = make_model()
    opt = TORCH_CONFIGS[name][0](model.named_parameters(), backend='loop')
    train(opt, model, 20)
    ref = copy.deepcopy(model)
    ref_opt = TORCH_CONFIGS[name][1](ref.parameters())
    buf = io.BytesIO()
    torch.save(opt.state_dict(format=type(ref_opt)), buf)
    buf.seek(0)
    ref_opt.load_state_dict(torch.load(buf, weights_only=True))
    train(ref_opt, ref, 20, start=20)
    train(opt, model, 20, start=20)
    assert_rel_close(ref, model, rtol=TOL, msg=f'{name} resumed in torch:', **PER_TENSOR)
    assert_state_close(opt, ref_opt, model)


def default_twin(name: str):
    "The cbopt optimizer of case `name` built with its defaults but for the arguments that choose its chain."
    make = TORCH_CONFIGS[name][0]
    if not isinstance(make, partial): return make
    return partial(make.func, **{k: v for k, v in make.keywords.items() if k in STRUCTURE})


@pytest.mark.parametrize('name', TORCH_CONFIGS)
def test_torch_state_dict_sets_every_hyper(name):
    """Into a twin built with its defaults, a torch state_dict loads every hyper of torch's group (ASGD's `alpha`,
    Rprop's `etas` and `step_sizes` included): it then goes on as torch does."""
    ref, ref_opt = torch_run(name, steps=20)
    model = copy.deepcopy(ref)
    opt = default_twin(name)(model.named_parameters(), backend='loop')
    opt.load_state_dict(ref_opt.state_dict())
    want = TORCH_CONFIGS[name][0](make_model().named_parameters()).param_groups[0]
    assert {k: opt.param_groups[0][k] for k in want if k not in ('params', 'param_names', 'chain')} == \
        {k: v for k, v in want.items() if k not in ('params', 'param_names', 'chain')}
    train(ref_opt, ref, 20, start=20)
    train(opt, model, 20, start=20)
    assert_rel_close(model, ref, rtol=TOL, msg=f'{name} resumed from torch:', **PER_TENSOR)


@pytest.mark.parametrize('flag', ['amsgrad', 'maximize'])
def test_torch_state_dict_of_another_flag_is_refused(flag):
    "A torch checkpoint whose flag chooses another algorithm (amsgrad, maximize) is refused by name; nothing changes."
    ref = make_model()
    ref_opt = optim.Adam(ref.parameters(), **{flag: True})
    train(ref_opt, ref, 3)
    model = copy.deepcopy(ref)
    opt = cbopt.Adam(model.named_parameters(), decouple_wd=False)
    train(opt, model, 2)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=f"group 0 of the torch.optim state_dict has {flag}=True.*build it with {flag}=True"):
        opt.load_state_dict(ref_opt.state_dict())
    after = opt.state_dict()
    assert after['param_groups'] == before['param_groups']
    assert all(torch.equal(v, after['state'][n][k]) if torch.is_tensor(v) else v == after['state'][n][k]
               for n, st in before['state'].items() for k, v in st.items())


MAXIMIZE = FUSED + ['adamw-amsgrad', 'adafactor']  # one config per algorithm, and both Adams


def train_keeping_grads(opt, model, steps: int, start: int = 0) -> None:
    "`train`, checking that every step leaves the user's grads as they were (the grad contract, as torch.optim)."
    for i in range(start, start + steps):
        set_grads(model, i)
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        for p, g in zip(model.parameters(), grads): assert torch.equal(p.grad, g), "a step changed the user's grad"


@pytest.mark.parametrize('name', MAXIMIZE)
def test_maximize_follows_torch(name):
    """`maximize=True` against torch's: 40 steps within 1e-5, loop and foreach (bit for bit the loop), the user's
    grads unchanged by every step; then torch's maximizing state_dict loads into the maximizing twin and goes on."""
    ours, theirs = partial(TORCH_CONFIGS[name][0], maximize=True), partial(TORCH_CONFIGS[name][1], maximize=True)
    ref = make_model()
    ref_opt = theirs(ref.parameters())
    train(ref_opt, ref, STEPS)
    runs = {}
    for backend in ('loop', 'foreach'):
        model = make_model()
        with warnings.catch_warnings():
            warnings.simplefilter('error')
            train_keeping_grads(ours(model.named_parameters(), backend=backend), model, STEPS)
        runs[backend] = model
    assert_rel_close(runs['loop'], ref, rtol=TOL, msg=f'{name} maximize vs torch:', **PER_TENSOR)
    assert_same(runs['foreach'], runs['loop'])
    minimized = torch_run(name)[0]
    assert all((p - q).abs().max() > 1e-2 * q.abs().max() for p, q in zip(ref.parameters(), minimized.parameters()))
    half, half_opt = make_model(), None
    half_opt = theirs(half.parameters())
    train(half_opt, half, 20)
    model = copy.deepcopy(half)
    opt = ours(model.named_parameters(), backend='loop')
    opt.load_state_dict(half_opt.state_dict())
    train(opt, model, 20, start=20)
    assert_rel_close(model, ref, rtol=TOL, msg=f'{name} maximize resumed from torch:', **PER_TENSOR)


FACTORIES = {  # every prebuilt optimizer (fastai's and torch's), with hypers that make every callback act
    'SGD': partial(cbopt.SGD, lr=0.01, mom=0.9, wd=0.1, decouple_wd=False), 'RMSProp': partial(cbopt.RMSProp, mom=0.8),
    'Adam': partial(cbopt.Adam, lr=0.01), 'RAdam': partial(cbopt.RAdam, lr=0.01, wd=0.1),
    'QHAdam': partial(cbopt.QHAdam, lr=0.01), 'Larc': partial(cbopt.Larc, lr=0.01, wd=0.1),
    'Lamb': partial(cbopt.Lamb, lr=0.01, wd=0.1), 'ranger': partial(cbopt.ranger, lr=0.01),
    **{name: make for name, (make, _) in TORCH_CONFIGS.items() if name in MAXIMIZE}}


@pytest.mark.parametrize('backend', ['loop', 'foreach'])
@pytest.mark.parametrize('name', FACTORIES)
def test_maximize_is_minimizing_the_negated_loss(name, backend):
    """On every prebuilt optimizer, `maximize=True` on the grads g is, bit for bit, the same optimizer on -g (torch's
    definition: the grad is negated before anything, L2 included); and the user's grads stay as they were."""
    up, down = make_model(), make_model()
    opt_up = FACTORIES[name](up.named_parameters(), maximize=True, backend=backend)
    opt_down = FACTORIES[name](down.named_parameters(), backend=backend)
    assert cbopt.negate_grad in opt_up.cbs and cbopt.negate_grad not in opt_down.cbs
    train_keeping_grads(opt_up, up, 10)
    for i in range(10):
        set_grads(down, i)
        for p in down.parameters(): p.grad = -p.grad
        opt_down.step()
    assert_same(up, down)
    assert not torch.equal(up[0].weight, make_model()[0].weight)


@pytest.mark.parametrize('amsgrad', [False, True])
def test_maximize_adamw_runs_torchs_fused_kernel(monkeypatch, amsgrad):
    """A maximizing AdamW, with or without amsgrad, still runs as torch's fused kernel (with its flags) under fused and
    auto, within 1e-5 of torch's."""
    calls, kernel = [], torch._fused_adamw_
    monkeypatch.setattr(torch, '_fused_adamw_', lambda *a, **k: calls.append((k['maximize'], k['amsgrad'])) or kernel(*a, **k))
    ref = make_model()
    train(optim.AdamW(ref.parameters(), lr=0.01, maximize=True, amsgrad=amsgrad, foreach=False), ref, STEPS)
    for backend in ('fused', 'auto'):
        model, calls[:] = make_model(), []
        train_keeping_grads(cbopt.Adam(model.named_parameters(), lr=0.01, sqr_mom=0.999, eps=1e-8, maximize=True,
                                       amsgrad=amsgrad, backend=backend), model, STEPS)
        assert calls == [(True, amsgrad)] * (STEPS - 1)  # the first step, creating the state, runs eagerly
        assert_rel_close(model, ref, rtol=TOL, msg=f'{backend}:', **PER_TENSOR)


def test_amsgrad_max_is_used():
    "AMSGrad's running maximum differs from the second moment by the end (so the parity above tests it), in every param."
    _, opt = cbopt_run('adam-amsgrad', 'loop')
    for st in opt.state.values(): assert (st['max_sqr_avg'] > st['sqr_avg'] * 1.01).any()


@pytest.mark.parametrize('backend', ['loop', 'foreach'])
def test_adafactor_factors_the_last_two_dims(backend):
    """Params of 3 dims are factored over their last two (torch's `row_var`, `col_var` shapes), 0-d and 1-d ones kept
    in full; one bucket per rank, so foreach runs bucket-wise with no warning; 40 steps within 1e-5 of torch."""
    g = torch.Generator().manual_seed(0)
    shapes = [(2, 3, 4), (5, 3), (), (7,), (2, 3, 4)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt, topt = Adafactor(ours, lr=0.05, wd=0.1, backend=backend), optim.Adafactor(ref, lr=0.05, weight_decay=0.1)
    for i in range(STEPS):
        grads = [torch.randn(s, generator=g) + p.detach() for s, p in zip(shapes, ours)]
        for p, q, gr in zip(ours, ref, grads): p.grad, q.grad = gr.clone(), gr.clone()
        with warnings.catch_warnings():
            warnings.simplefilter('error')
            opt.step()
        topt.step()
    for p, q in zip(ours, ref):
        assert (p - q).abs().max() <= TOL * q.abs().max()
        assert {k: v.shape for k, v in opt.state[p].items() if torch.is_tensor(v)} == \
            {k: v.shape for k, v in topt.state[q].items() if k != 'step'}


def test_fresh_torch_adagrad_state_loads():
    "torch's Adagrad creates its state at construction (step 0, the initial accumulator): that state loads and trains as torch."
    ref = make_model()
    ref_opt = optim.Adagrad(ref.parameters(), lr=0.05, initial_accumulator_value=0.3)
    model = copy.deepcopy(ref)
    opt = Adagrad(model.named_parameters(), lr=0.05, initial_accumulator_value=0.3)
    opt.load_state_dict(ref_opt.state_dict())
    train(ref_opt, ref, 10)
    train(opt, model, 10)
    assert_rel_close(model, ref, rtol=TOL, **PER_TENSOR)


@pytest.mark.parametrize('name', TORCH_CONFIGS)
def test_state_dict_weights_only_resume_bit_exact(name):
    """Saved after 20 foreach steps, read back with weights_only, loaded into a fresh optimizer on a copy of the
    model: 20 more loop steps give, bit for bit, the params and state of 40 uninterrupted loop steps."""
    full, full_opt = cbopt_run(name, 'loop')
    half, half_opt = cbopt_run(name, 'foreach', steps=20)
    buf = io.BytesIO()
    torch.save(half_opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert [n for g in sd['param_groups'] for n in g['param_names']] == [n for n, _ in half.named_parameters()]
    model = copy.deepcopy(half)
    opt = TORCH_CONFIGS[name][0](model.named_parameters(), backend='loop')
    opt.load_state_dict(sd)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        train(opt, model, 20, start=20)
    assert_same(model, full)
    assert opt.named_state_dict()['state'].keys() == full_opt.named_state_dict()['state'].keys()
    for n, st in opt.named_state_dict()['state'].items():
        for k, v in st.items():
            w = full_opt.named_state_dict()['state'][n][k]
            assert torch.equal(v, w) if torch.is_tensor(v) else v == w, f"{name}: state {k!r} of {n} differs"


@pytest.mark.parametrize('name', TORCH_CONFIGS)
def test_init_state_is_the_state_before_a_first_step(name):
    "`init_state` (the declared state) changes nothing: training after it is bit for bit training without it."
    ref, ref_opt = cbopt_run(name, 'loop', steps=5)
    model = make_model()
    opt = TORCH_CONFIGS[name][0](model.named_parameters(), backend='loop')
    opt.init_state()
    assert_same(model, make_model())
    train(opt, model, 5)
    assert_same(model, ref)
    for p, q in zip(model.parameters(), ref.parameters()): assert opt.state[p].keys() == ref_opt.state[q].keys()


def test_torch_constructor_checks():
    "The hypers only these algorithms have are checked with torch's messages."
    ps = make_model().parameters
    with pytest.raises(ValueError, match='Invalid lr_decay value'): Adagrad(ps(), lr_decay=-1)
    with pytest.raises(ValueError, match='Invalid initial_accumulator_value'): Adagrad(ps(), initial_accumulator_value=-1)
    with pytest.raises(ValueError, match='Invalid momentum_decay value'): NAdam(ps(), momentum_decay=-1)
    with pytest.raises(ValueError, match='Invalid eta values'): Rprop(ps(), etas=(1.2, 0.5))
    for msg, bad in [('beta2_decay should be <= 0', dict(beta2_decay=0.5)), ('epsilon1', dict(eps=(-1., 1e-3))),
                     ('epsilon2', dict(eps=(None, -1.))), ('Clipping threshold d', dict(d=0.5))]:
        with pytest.raises(ValueError, match=msg): Adafactor(ps(), **bad)
    for cls, torch_cls in [(Adagrad, optim.Adagrad), (Adadelta, optim.Adadelta), (Adamax, optim.Adamax),
                           (NAdam, optim.NAdam), (ASGD, optim.ASGD), (Rprop, optim.Rprop), (Adafactor, optim.Adafactor),
                           (Muon, optim.Muon)]:
        assert inspect.signature(cls).parameters['lr'].default == inspect.signature(torch_cls).parameters['lr'].default


@pytest.mark.parametrize('opt', [Adagrad, Adadelta, Adamax, NAdam, ASGD, Rprop, Adafactor], ids=lambda f: f.__name__)
def test_fastai_opt_func(opt):
    "As a fastai `opt_func`, each trains a Learner as torch's class does through fastai's `OptimWrapper`."
    Learner = pytest.importorskip('fastai.learner').Learner
    from fastai.callback.progress import ProgressCallback
    from fastai.data.core import DataLoaders
    from fastai.optimizer import OptimWrapper
    from fastcore.basics import noop
    from torch.utils.data import TensorDataset
    g = torch.Generator().manual_seed(1)
    x = torch.randn(48, 6, generator=g)
    y = torch.randn(48, 3, generator=g)

    def fit(opt_func):
        dls = DataLoaders.from_dsets(TensorDataset(x[:32], y[:32]), TensorDataset(x[32:], y[32:]), bs=8, shuffle=False)
        learn = Learner(dls, make_model(), torch.nn.MSELoss(), opt_func=opt_func)
        learn.remove_cb(ProgressCallback)
        learn.logger = noop
        learn.fit(1, lr=0.01)
        return learn

    ours, ref = fit(opt), fit(partial(OptimWrapper, opt=getattr(optim, opt.__name__)))
    assert isinstance(ours.opt, cbopt.Optimizer) and len(ours.recorder.losses) == 4
    assert_rel_close(ours.model, ref.model, rtol=TOL, **PER_TENSOR)


# -- Muon ----------------------------------------------------------------------------------------------------------
def matrices_model(seed: int = 0) -> nn.Module:
    "`make_model` without biases: only matrices, a tall one (8x6) and a wide one (3x8), as torch's Muon takes."
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(6, 8, bias=False), nn.Tanh(), nn.Linear(8, 3, bias=False))


MUON = {  # id: (cbopt hypers, torch hypers)
    'muon':     ({}, {}),
    'muon-all': (dict(lr=0.02, wd=0.05, mom=0.8, nesterov=False, ns_coefficients=(3.0, -3.2, 1.2), eps=1e-6,
                      ns_steps=3, adjust_lr_fn='match_rms_adamw'),
                 dict(lr=0.02, weight_decay=0.05, momentum=0.8, nesterov=False, ns_coefficients=(3.0, -3.2, 1.2),
                      eps=1e-6, ns_steps=3, adjust_lr_fn='match_rms_adamw')),
}


def negated(train_fn):
    "`train_fn(opt, model, steps, start)` on the negated grads: minimizing -loss, the reference of maximize=True."
    def run(opt, model, steps, start=0):
        for i in range(start, start + steps):
            set_grads(model, i)
            for p in model.parameters(): p.grad = -p.grad
            opt.step()
    return run


@pytest.mark.parametrize('maximize', [False, True], ids=['min', 'max'])
@pytest.mark.parametrize('name', MUON)
def test_muon_follows_torch(name, maximize):
    """A bare list of matrices: 40 steps of loop within 1e-5 of torch.optim.Muon (params and `momentum_buffer`), foreach
    bit for bit the loop with no warning, the user's grads kept; maximize=True is torch's Muon on the negated grads."""
    ours, theirs = MUON[name]
    ref = matrices_model()
    ref_opt = optim.Muon(ref.parameters(), **theirs)
    (negated(train) if maximize else train)(ref_opt, ref, STEPS)
    runs = {}
    for backend in ('loop', 'foreach'):
        model = matrices_model()
        opt = Muon(list(model.parameters()), **ours, maximize=maximize, backend=backend)
        assert len(opt.param_groups) == 1
        with warnings.catch_warnings():
            warnings.simplefilter('error')
            train_keeping_grads(opt, model, STEPS)
        runs[backend] = model, opt
    (loop, loop_opt), (each, _) = runs['loop'], runs['foreach']
    assert_rel_close(loop, ref, rtol=TOL, msg=f'{name} vs torch:', **PER_TENSOR)
    assert_state_close(loop_opt, ref_opt, loop)
    assert_same(each, loop)
    for p, q in zip(loop.parameters(), matrices_model().parameters()): assert (p - q).abs().max() > 1e-2 * q.abs().max()


@pytest.mark.parametrize('name', MUON)
def test_muon_state_dict_continues_in_torch(name):
    "cbopt.Muon's `state_dict(format=torch.optim.Muon)` loads into a default torch Muon, which goes on as cbopt's."
    ours, _ = MUON[name]
    model = matrices_model()
    opt = Muon(list(model.parameters()), **ours, backend='loop')
    train(opt, model, 20)
    ref = copy.deepcopy(model)
    ref_opt = optim.Muon(ref.parameters())
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict(format=optim.Muon)))
    train(ref_opt, ref, 20, start=20)
    train(opt, model, 20, start=20)
    assert_rel_close(ref, model, rtol=TOL, **PER_TENSOR)


@pytest.mark.parametrize('name', MUON)
def test_muon_torch_state_dict_and_resume(name):
    """torch.optim.Muon's state_dict (weights_only) loads every hyper into a default cbopt.Muon, which goes on as torch;
    cbopt's own state_dict resumes bit for bit."""
    ours, theirs = MUON[name]
    ref = matrices_model()
    ref_opt = optim.Muon(ref.parameters(), **theirs)
    train(ref_opt, ref, 20)
    buf = io.BytesIO()
    torch.save(ref_opt.state_dict(), buf)
    buf.seek(0)
    model = copy.deepcopy(ref)
    opt = Muon(list(model.parameters()), backend='loop')
    opt.load_state_dict(torch.load(buf, weights_only=True))
    want = Muon(list(matrices_model().parameters()), **ours).param_groups[0]
    assert all(opt.param_groups[0][k] == v for k, v in want.items() if k not in ('params', 'param_names', 'chain'))
    train(ref_opt, ref, 20, start=20)
    train(opt, model, 20, start=20)
    assert_rel_close(model, ref, rtol=TOL, **PER_TENSOR)
    full, half = matrices_model(), matrices_model()
    full_opt, half_opt = Muon(list(full.parameters()), **ours), Muon(list(half.parameters()), **ours, backend='foreach')
    train(full_opt, full, 40)
    train(half_opt, half, 20)
    buf = io.BytesIO()
    torch.save(half_opt.state_dict(), buf)
    buf.seek(0)
    resumed = Muon(list(half.parameters()), **ours)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    train(resumed, half, 20, start=20)
    assert_same(half, full)


class Net(nn.Module):
    "An embedding, a hidden layer and an output head: what Muon's users give AdamW and Muon."
    def __init__(self):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.embed, self.hidden, self.head = nn.Embedding(10, 6), nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x): return self.head(torch.tanh(self.hidden(self.embed(x))))


def test_muon_on_a_whole_model_is_muon_and_adamw():
    """`cbopt.Muon(model.named_parameters())` steps the hidden matrices as torch.optim.Muon and every other param (the
    embedding, the head, the biases) as torch.optim.AdamW, side by side over 40 steps, in one optimizer."""
    def batches(model, opts, steps):
        for i in range(steps):
            g = torch.Generator().manual_seed(i)
            x, y = torch.randint(0, 10, (16,), generator=g), torch.randn(16, 3, generator=g)
            for p in model.parameters(): p.grad = None
            with torch.enable_grad(): F.mse_loss(model(x), y).backward()
            for o in opts: o.step()
    ours, ref = Net(), Net()
    opt = Muon(ours.named_parameters(), lr=0.02, adamw=dict(lr=0.01, wd=0.1))
    assert [g['param_names'] for g in opt.param_groups] == \
        [['hidden.weight'], ['embed.weight', 'hidden.bias', 'head.weight', 'head.bias']]
    muon_ps = [ref.hidden.weight]
    rest = [p for p in ref.parameters() if p is not ref.hidden.weight]
    batches(ref, [optim.Muon(muon_ps, lr=0.02), optim.AdamW(rest, lr=0.01, weight_decay=0.1)], STEPS)
    batches(ours, [opt], STEPS)
    for (n, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert (p - q).abs().max() <= TOL * q.abs().max(), n
    for (n, p), q in zip(ours.named_parameters(), Net().parameters()): assert not torch.equal(p, q), n


def test_muon_params_by_name_or_predicate():
    "Which params Muon steps: by FQN or by a predicate; a param that is not a matrix, or an unknown name, is an error."
    net = Net()
    by_name = Muon(net.named_parameters(), muon_params=['hidden.weight', 'head.weight'])
    assert by_name.param_groups[0]['param_names'] == ['hidden.weight', 'head.weight']
    by_pred = Muon(net.named_parameters(), muon_params=lambda n, p: p.ndim == 2)
    assert by_pred.param_groups[0]['param_names'] == ['embed.weight', 'hidden.weight', 'head.weight']
    with pytest.raises(ValueError, match="Muon only supports 2D parameters, but 'hidden.bias'"):
        Muon(net.named_parameters(), muon_params=['hidden.bias'])
    with pytest.raises(KeyError, match="hidden.wieght"): Muon(net.named_parameters(), muon_params=['hidden.wieght'])
    with pytest.raises(ValueError, match="Adjust learning rate function x"): Muon(net.named_parameters(), adjust_lr_fn='x')


def test_muon_fastai_opt_func():
    """As a fastai `opt_func`: a Learner (unnamed params: matrices to Muon, the rest to AdamW) trains as the same
    optimizer stepped by hand on the same batches."""
    Learner = pytest.importorskip('fastai.learner').Learner
    from fastai.callback.progress import ProgressCallback
    from fastai.data.core import DataLoaders
    from fastcore.basics import noop
    from torch.utils.data import TensorDataset
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 6, generator=g), torch.randn(32, 3, generator=g)
    dls = DataLoaders.from_dsets(TensorDataset(x, y), TensorDataset(x[:8], y[:8]), bs=8, shuffle=False)
    # wd=0 on the AdamW groups: a Learner turns weight decay off on biases (wd_bn_bias=False)
    learn = Learner(dls, make_model(), nn.MSELoss(), opt_func=partial(Muon, adamw=dict(lr=0.01, wd=0.)))
    learn.remove_cb(ProgressCallback)
    learn.logger = noop
    learn.fit(1, lr=0.02)
    assert [len(g['params']) for g in learn.opt.param_groups] == [2, 2]
    model = make_model()
    opt = Muon(model.parameters(), lr=0.02, adamw=dict(lr=0.02, wd=0.))  # fit's lr is set on every group
    for i in range(4):
        for p in model.parameters(): p.grad = None
        with torch.enable_grad(): F.mse_loss(model(x[8 * i:8 * i + 8]), y[8 * i:8 * i + 8]).backward()
        opt.step()
    assert_same(learn.model, model)


def test_muon_freeze_to_counts_the_given_groups():
    """cbopt.Muon splits each given group into its matrices (Muon) and the rest (AdamW): `freeze_to(n)` counts the given
    groups, freezing both halves of each, and so do `freeze()`, a new group and a wrapper."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 3))
    given = [list(model[0].named_parameters(prefix='0')), list(model[2].named_parameters(prefix='2'))]
    opt = Muon(given, muon_params=lambda n, p: p.ndim == 2)
    assert len(opt.param_groups) == 4 and opt.layers == [0, 0, 1, 1] and opt.n_layers == 2
    opt.freeze_to(1)
    assert [p.requires_grad for p in model[0].parameters()] == [False, False]
    assert all(p.requires_grad for p in model[2].parameters())
    opt.unfreeze()
    opt.freeze()  # = freeze_to(-1): the last given group trains
    assert [p.requires_grad for p in (*model[0].parameters(), *model[2].parameters())] == [False, False, True, True]
    wrapped = cbopt.Lookahead(opt)
    assert wrapped.layers == [0, 0, 1, 1] and wrapped.frozen_idx == 1
    wrapped.add_param_group({'params': list(model[4].parameters())})
    assert wrapped.layers == [0, 0, 1, 1, 2] and wrapped.n_layers == 3
    wrapped.freeze_to(2)
    assert not any(p.requires_grad for p in (*model[0].parameters(), *model[2].parameters()))
    assert all(p.requires_grad for p in model[4].parameters())
    with pytest.raises(ValueError, match="split_groups: 2 layer indices for 5 param groups"): wrapped.split_groups([0, 1], 2)
