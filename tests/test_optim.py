"""`cbopt.optim` against torch.optim, driven by the installed torch's own optimizer test data
(`torch.testing._internal.common_optimizers.optim_db`): every config of every class cbopt has steps as torch's class
does (loop, foreach, fused where torch has a CPU kernel), every construction error input raises torch's error type,
torch's state_dicts load mid-run, and deepcopy, hooks, zero grads, no-grad params and tensor lrs behave as torch's.
Where cbopt deliberately differs, `DIFFERENCES` says so, in this one place."""
import copy
import inspect
import io

import pytest
import torch
from torch.testing._internal.common_optimizers import OptimizerErrorEnum, optim_db

import cbopt
from cases import WITH_OPTIM
from conftest import assert_rel_close, make_model, train, two_groups

pytestmark = pytest.mark.usefixtures('one_thread')

ALL_INFOS = {info.optim_cls.__name__: info for info in optim_db if hasattr(cbopt.optim, info.optim_cls.__name__)}
INFOS = {n: info for n, info in ALL_INFOS.items() if not info.only_supports_sparse_grads}  # (dense grads: SparseAdam's
# tests are the sparse ones below)
N_STEPS = 5

# What cbopt.optim deliberately does otherwise than torch.optim, with the reason: (class or '*', what) -> why.
DIFFERENCES = {
    ('*', 'duplicate params'): "torch warns on a param listed twice in a group and keeps the copy (its loop steps the "
                               "param twice); cbopt.optim warns torch's words and steps it once (the copy dropped); "
                               "cbopt's own classes refuse it (ValueError naming the param)",
    ('*', 'capturable'): "accepted, changes nothing (CPU); torch refuses a tensor lr with capturable on CPU, cbopt does not",
    ('*', 'complex params'): "torch's fused=True refuses them, cbopt's fused steps them (on their real views)",
    ('SGD', 'sparse grads with momentum'): "torch keeps a sparse momentum buffer; cbopt refuses them before anything "
                                           "steps, naming the param and the callback (plain SGD takes them, as torch)",
}
# torch's error inputs that meet a difference above, by their message: what cbopt does instead
ERROR_DIFFERENCES = {}


def configs():
    for name, info in INFOS.items():
        for i, inp in enumerate(info.optim_inputs_func(device='cpu')):
            yield pytest.param(name, i, inp.kwargs, id=f'{name}-{i}-{inp.desc}')


def impls(name: str, config: int) -> list:
    """The implementation switches to run: loop and foreach, and fused where torch has a CPU kernel (for the first
    config only, but for AdamW, which runs torch's kernel: cbopt's fused backend compiles other chains, seconds each)."""
    if 'foreach' not in inspect.signature(getattr(torch.optim, name)).parameters:  # Muon, LBFGS: no switches
        return [dict(backend=b) for b in ('loop', 'foreach')]  # (set on cbopt's after construction)
    out = [dict(foreach=False), dict(foreach=True)]
    if 'fused' in INFOS[name].supported_impls and (config == 0 or name == 'AdamW'): out.append(dict(fused=True))
    return out


def _model(seed=0):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def _params(name, model):
    "The params the class is given: torch's Muon takes only 2-D ones (it refuses the rest), the others all."
    return [p for p in model.parameters() if p.ndim == 2] if name == 'Muon' else model.parameters()


def _grads(model, step):
    "Batch `step`'s grads, fresh; returns its loss (so it is also a closure)."
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
    for p in model.parameters(): p.grad = None
    with torch.enable_grad():
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
    return loss


def _run(opt, model, steps, start=0):
    "`steps` steps on batches `start`...; LBFGS (which needs a closure) re-evaluates the batch through one."
    for i in range(start, start + steps):
        if isinstance(opt, (torch.optim.LBFGS, cbopt.optim.LBFGS)): opt.step(lambda: _grads(model, i))
        else:
            _grads(model, i)
            opt.step()


def _kw(kwargs):
    "Copies of tensor hypers (a tensor lr), so the two optimizers never share one."
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


@pytest.mark.parametrize('name,config,kwargs', list(configs()))
def test_steps_as_torch(name, config, kwargs):
    for impl in impls(name, config):
        if 'fused' in impl and isinstance(kwargs.get('lr'), torch.Tensor): continue
        m, ref = _model(), _model()
        backend = impl.pop('backend', None)
        opt = getattr(cbopt.optim, name)(_params(name, m), **_kw(kwargs), **impl)
        assert opt.backend == ('auto' if backend else 'fused' if 'fused' in impl else 'foreach' if impl['foreach'] else 'loop')
        if backend: opt.backend = backend
        if 'fused' in impl: opt.backend = cbopt.Backend('fused', compiler='aot_eager')  # no inductor codegen: seconds
        torch_opt = getattr(torch.optim, name)(_params(name, ref), **_kw(kwargs), **impl)
        _run(opt, m, N_STEPS)
        _run(torch_opt, ref, N_STEPS)
        assert_rel_close(m, ref, RTOL.get(name, 2e-5))


# classes held to float rounding: their chain does torch's float ops in torch's order (RAdam: eps before debiasing)
RTOL = {'RAdam': 1e-6}


@pytest.mark.parametrize('kwargs', [dict(), dict(weight_decay=0.1), dict(weight_decay=0.1, decoupled_weight_decay=True)],
                         ids=['plain', 'l2', 'decoupled'])
@pytest.mark.parametrize('foreach', [False, True])
def test_radam_adds_eps_where_torch_does(kwargs, foreach):
    """torch's RAdam divides by `(sqrt(v) + eps) / sqrt(bc2)`, fastai's by `sqrt(v / bc2) + eps`: with eps=1e-3 the two
    part by ~4e-3 of the params' scale over 50 steps, so 1e-6 tells cbopt.optim.RAdam follows torch's placement."""
    m, ref = _model(), _model()
    opt = cbopt.optim.RAdam(m.parameters(), lr=1e-2, eps=1e-3, foreach=foreach, **kwargs)
    torch_opt = torch.optim.RAdam(ref.parameters(), lr=1e-2, eps=1e-3, foreach=foreach, **kwargs)
    _run(opt, m, 50)
    _run(torch_opt, ref, 50)
    assert_rel_close(m, ref, 1e-6)


@pytest.mark.parametrize('name,config,kwargs', list(configs()))
def test_loads_torchs_state_dict(name, config, kwargs):
    "A torch.optim checkpoint taken mid-run loads into cbopt.optim, which then steps on as torch does."
    m, ref = _model(), _model()
    torch_opt = getattr(torch.optim, name)(_params(name, ref), **_kw(kwargs))
    _run(torch_opt, ref, 3)
    m.load_state_dict(ref.state_dict())
    opt = getattr(cbopt.optim, name)(_params(name, m), **_kw(kwargs))
    opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    _run(opt, m, 3, start=3)
    _run(torch_opt, ref, 3, start=3)
    assert_rel_close(m, ref, 2e-5)


def _saved(sd):
    "`sd` through torch.save and torch.load(weights_only=True), as a checkpoint on disk."
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize('name,config,kwargs', list(configs()))
def test_torch_loads_cbopts_state_dict(name, config, kwargs):
    """cbopt.optim's state_dict, taken mid-run, is what its torch class saves: torch.optim loads it (weights_only) and
    steps on as cbopt does; it also loads back into cbopt.optim, as does `state_dict(format='cbopt')`."""
    models = [_model() for _ in range(4)]
    opt = getattr(cbopt.optim, name)(_params(name, models[0]), **_kw(kwargs))
    _run(opt, models[0], 3)
    for m in models[1:]: m.load_state_dict(models[0].state_dict())
    sd = _saved(opt.state_dict())
    assert 'chain' not in sd['param_groups'][0]
    torch_opt = getattr(torch.optim, name)(_params(name, models[1]), **_kw(kwargs))
    torch_opt.load_state_dict(sd)
    back = getattr(cbopt.optim, name)(_params(name, models[2]), **_kw(kwargs))
    back.load_state_dict(sd)
    ours = getattr(cbopt.optim, name)(_params(name, models[3]), **_kw(kwargs))
    ours.load_state_dict(_saved(opt.state_dict(format='cbopt')))
    for o, m in zip((opt, torch_opt, back, ours), models): _run(o, m, 3, start=3)
    for m in models[1:]: assert_rel_close(m, models[0], 2e-5)


def _stepped(opt, model):
    "`opt` after 2 steps on `model`."
    _run(opt, model, 2)
    return opt


def test_state_dict_for_a_torch_class_refuses_what_it_cannot_hold():
    "Written for a torch class that cannot hold a chain's state, hypers or flags, a state_dict is refused by name."
    cases = [  # (an optimizer, its torch class, the error)
        (lambda ps: cbopt.SGD(ps, mom=0.9, wd=0.1), torch.optim.SGD, r"param group 0 .* decays the weights decoupled "
         r"\(wd=0.1\), torch.optim.SGD by L2"),
        (lambda ps: cbopt.Adam(ps, wd=0.1, decouple_wd=False), torch.optim.AdamW, r"by L2 \(wd=0.1\), torch.optim.AdamW decoupled"),
        (lambda ps: cbopt.Adam(ps, amsgrad=True, wd=0.), torch.optim.RAdam, r"runs with amsgrad=True, which torch.optim.RAdam"),
        (lambda ps: cbopt.Lamb(ps), torch.optim.Adam, r"state 'grad_avg' of param '0' .* has no torch.optim.Adam name"),
        (lambda ps: cbopt.RAdam(ps, beta=0.5), torch.optim.RAdam, r"has the hyper beta=0.5, which torch.optim.RAdam has no"),
        (lambda ps: cbopt.Lookahead(cbopt.Adam(ps, wd=0.)), torch.optim.Adam, r"state 'slow_p' of param '0'"),
        (lambda ps: cbopt.RMSProp(ps), torch.optim.RMSprop, r"has no step count, which torch.optim.RMSprop's state must"),
        (lambda ps: cbopt.Adam(ps, wd=0.), 'torch', r"no torch.optim class of its own; name one"),
        (lambda ps: cbopt.Adam(ps, wd=0.), 'fastai', r"expected 'cbopt', 'torch' or a torch.optim class"),
    ]
    for make, cls, match in cases:
        m = _model()
        opt = make(m.parameters())
        _run(opt, m, 2)
        with pytest.raises(ValueError, match=match): opt.state_dict(format=cls)
    m = _model()
    opt = cbopt.Adam(m.parameters(), wd=0.1)
    opt.state[m[0].weight]['do_wd'] = False  # fastai's flag: torch's weight_decay has no per-param exception
    _run(opt, m, 2)
    with pytest.raises(ValueError, match=r"param '0' .* is not decayed \(fastai's do_wd=False\)"):
        opt.state_dict(format=torch.optim.AdamW)
    opt.set_hyper('wd', 0.)
    assert 'do_wd' not in opt.state_dict(format=torch.optim.AdamW)['state'][0]


def test_torch_checkpoint_with_another_weight_decay_is_rejected():
    """A torch.optim.Adam checkpoint decaying by L2 does not load into the decoupled cbopt.Adam (nor AdamW's into an L2
    chain): weight_decay would change meaning. The group is named, and what to do; nothing changes. Without decay it
    loads either way."""
    m = _model()
    torch_opt = _stepped(torch.optim.Adam(m.parameters(), weight_decay=0.1), m)
    opt = _stepped(cbopt.Adam(m.parameters(), wd=0.01), m)
    before = opt.state_dict()
    with pytest.raises(ValueError, match=r"param group 0 of the torch.optim state_dict decays the weights by L2 .*"
                                         r"weight_decay=0.1.*Build the optimizer with decouple_wd=False"):
        opt.load_state_dict(torch_opt.state_dict())
    after = opt.state_dict()
    assert after['param_groups'] == before['param_groups']
    assert all(torch.equal(v, after['state'][i][k]) for i, st in before['state'].items() for k, v in st.items()
               if torch.is_tensor(v))
    adamw = _stepped(torch.optim.AdamW(m.parameters(), weight_decay=0.1), m)
    with pytest.raises(ValueError, match=r"decays the weights decoupled .*decouple_wd=True"):
        cbopt.optim.Adam(m.parameters(), weight_decay=0.1).load_state_dict(adamw.state_dict())
    cbopt.Adam(m.parameters()).load_state_dict(_stepped(torch.optim.Adam(m.parameters()), m).state_dict())  # wd=0


@pytest.mark.parametrize('torch_cls,ours', [
    (torch.optim.SGD, lambda ps, **kw: cbopt.SGD(ps, mom=0.9, **kw)),
    (torch.optim.RMSprop, cbopt.RMSProp), (torch.optim.Adagrad, cbopt.Adagrad)])
def test_torch_checkpoint_of_an_l2_class_is_rejected_by_a_decoupled_chain(torch_cls, ours):
    """torch's SGD, RMSprop and Adagrad decay by L2 and save no flag saying so; their groups' own keys (dampening,
    centered, lr_decay) tell. Into a chain that decays decoupled (cbopt.SGD's default, cbopt.RMSProp's), such a checkpoint with a
    nonzero weight_decay is refused and nothing changes; into the L2 chain it loads and steps on as torch's."""
    m, m_ref = _model(), _model()
    torch_opt = _stepped(torch_cls(m_ref.parameters(), lr=1e-2, **({'momentum': 0.9} if torch_cls is torch.optim.SGD
                                                                   else {}), weight_decay=0.1), m_ref)
    opt = _stepped(ours(m.parameters(), lr=1e-2, wd=0.1, decouple_wd=True), m)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"param group 0 of the torch.optim state_dict decays the weights by L2 .*"
                                         r"weight_decay=0.1.*Build the optimizer with decouple_wd=False"):
        opt.load_state_dict(torch_opt.state_dict())
    assert opt.state_dict()['param_groups'] == before['param_groups']
    l2 = ours(m.parameters(), lr=1e-2, wd=0.1, decouple_wd=False)
    with torch.no_grad():
        for p, q in zip(m.parameters(), m_ref.parameters()): p.copy_(q)
    l2.load_state_dict(torch_opt.state_dict())
    _run(l2, m, 3)
    _run(torch_opt, m_ref, 3)
    for p, q in zip(m.parameters(), m_ref.parameters()): torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def error_inputs():
    for name, info in ALL_INFOS.items():
        for i, e in enumerate(info.optim_error_inputs_func(device='cpu', dtype=torch.float32)):
            yield pytest.param(name, e, id=f'{name}-{i}-{e.error_type.__name__}')


@pytest.mark.parametrize('name,err', list(error_inputs()))
def test_error_inputs(name, err):
    """Every error input torch lists raises (or warns) torch's error type with words torch's test matches, at
    construction or at the step as torch does; those
    that meet a documented difference (`ERROR_DIFFERENCES`) do what cbopt does instead."""
    inp, cls = err.optimizer_error_input, getattr(cbopt.optim, name)
    other = next((v for k, v in ERROR_DIFFERENCES.items() if k in str(err.error_regex)), None)
    if other is not None:
        error, match = other
        groups = inp.params if isinstance(inp.params, list) and all(isinstance(g, dict) for g in inp.params) else [0]
        if error is None and name == 'LBFGS' and len(groups) > 1:  # torch's refusal of several groups comes first
            error, match = ValueError, "LBFGS doesn't support per-parameter options"
        if error is None:  # accepted, and it steps
            m = _model()
            opt = cls(m.parameters() if inp.params is None else inp.params, **inp.kwargs)
            _run(opt, m, 2)
        else:
            with pytest.raises(error, match=match): cls(inp.params, **inp.kwargs)
        return
    expect = (pytest.warns if issubclass(err.error_type, Warning) else pytest.raises)(err.error_type,
                                                                                      match=err.error_regex)
    if err.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR:
        with expect: cls(inp.params, **inp.kwargs)
    else:
        opt = cls(inp.params, **inp.kwargs)
        with expect: opt.step()


@pytest.mark.parametrize('name', sorted(ALL_INFOS))
def test_signature_is_torchs(name):
    import inspect
    ours, theirs = (inspect.signature(getattr(mod, name).__init__) for mod in (cbopt.optim, torch.optim))
    ours = list(ours.parameters.values())
    lowbit = ours[-2:]  # torch's signature, then cbopt's low-bit state keywords (keyword-only, at their defaults: fp32)
    kw = inspect.Parameter.KEYWORD_ONLY
    assert [(p.name, p.kind, p.default) for p in lowbit] == [('state_precision', kw, 'fp32'),
                                                             ('min_quantize_size', kw, 4096)]
    assert [(p.name, p.kind, p.default) for p in ours[:-2]] == \
           [(p.name, p.kind, p.default) for p in theirs.parameters.values()]


@pytest.mark.parametrize('name', sorted(INFOS))
def test_zero_grads_no_grad_params_deepcopy_hooks(name):
    """Zero grads, a param without a grad, a deepcopy stepping on its own and step hooks, each as torch's class. (LBFGS
    steps through a closure; a param without a grad moves along its history there, as in torch's.)"""
    m, ref = _model(), _model()
    opt = getattr(cbopt.optim, name)(_params(name, m))
    torch_opt = getattr(torch.optim, name)(_params(name, ref))
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append('pre'))
    opt.register_step_post_hook(lambda o, a, k: calls.append('post'))

    def step(o, mod, batch):
        "One step on the grads `batch(mod)` leaves (it returns the loss: the closure, for LBFGS)."
        if name == 'LBFGS': return o.step(lambda: batch(mod))
        batch(mod)
        o.step()

    def zeros(mod):
        for p in mod.parameters(): p.grad = torch.zeros_like(p)
        return torch.tensor(0.)

    def frozen_last(mod):
        "Batch 7 with the last param given to the optimizer (the head) without a grad."
        loss = _grads(mod, 7)
        list(_params(name, mod))[-1].grad = None
        return loss

    for o, mod in ((opt, m), (torch_opt, ref)):
        step(o, mod, zeros)
        _run(o, mod, 2, start=0)
    assert calls == ['pre', 'post'] * 3
    before = list(_params(name, m))[-1].detach().clone()
    m2, opt2 = copy.deepcopy((m, opt))
    for o, mod in ((opt, m), (torch_opt, ref), (opt2, m2)): step(o, mod, frozen_last)
    if name != 'LBFGS':
        assert torch.equal(list(_params(name, m))[-1], before) and torch.equal(list(_params(name, m2))[-1], before)
    assert_rel_close(m, ref, 2e-5)
    assert_rel_close(m2, ref, 2e-5)


def _hooked_runs(cls, params) -> dict:
    """What the four state_dict hook kinds do with an optimizer of class `cls`: the observations torch's own tests make
    (a pre-hook's `opt.state['test']` shows in the dict, a post-hook's return value is the dict, load pre-hooks run in
    order with `prepend` first and a returned dict replaces the given one, load post-hooks see the loaded optimizer)."""
    out = {}
    opt = cls(params)
    h_pre = opt.register_state_dict_pre_hook(lambda o: o.state.__setitem__('test', 1))
    out['pre'] = opt.state_dict()['state'].get('test')
    def post(o, sd):
        sd = dict(sd)
        sd['seen_test'] = sd['state'].pop('test', None)
        return sd
    h_post = opt.register_state_dict_post_hook(post)
    sd = opt.state_dict()
    out['post'] = (sd['seen_test'], 'test' in sd['state'])
    out['prepend_post'] = 'seen_test' in opt.state_dict()
    h_pre.remove(), h_post.remove()
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, 'first': True}, prepend=True)
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, 'second': 'first' in sd})
    out['post_order'] = opt.state_dict()['second']
    opt = cls(params)
    sd = opt.state_dict()
    opt.register_load_state_dict_pre_hook(lambda o, sd: sd['param_groups'][0].__setitem__('lr', 0.002))
    opt.load_state_dict(sd)
    out['load_pre'] = opt.param_groups[0]['lr']
    def replace(o, sd):
        sd = copy.deepcopy(sd)
        sd['param_groups'][0]['lr'] = 0.003
        return sd
    opt.register_load_state_dict_pre_hook(replace, prepend=True)
    opt.load_state_dict(sd)
    out['load_prepend'] = opt.param_groups[0]['lr']  # the prepended hook ran first: the other one's lr wins
    opt.register_load_state_dict_post_hook(lambda o: o.state.__setitem__('loaded_lr', o.param_groups[0]['lr']))
    opt.load_state_dict(sd)
    out['load_post'] = opt.state['loaded_lr']
    sd = opt.state_dict()  # (now holding 'loaded_lr', no param's: saved and loaded back as it is)
    out['extra_saved'] = sd['state'].get('loaded_lr')
    opt.state['stale'] = 1
    sd['state']['loaded_lr'] = 0.5
    fresh = cls(params)
    fresh.load_state_dict(sd)
    out['extra_loaded'] = (fresh.state.get('loaded_lr'), 'stale' in fresh.state)
    return out


@pytest.mark.parametrize('name', sorted(INFOS))
def test_state_dict_hooks_as_torchs(name):
    """The four state_dict hook kinds (`register_state_dict_pre_hook`/`post_hook`, `register_load_state_dict_pre_hook`/
    `post_hook`, with `prepend`) behave as torch's class's: cbopt.Optimizer overrides state_dict and load_state_dict,
    so it runs them itself."""
    ours = _hooked_runs(getattr(cbopt.optim, name), list(_params(name, _model())))
    theirs = _hooked_runs(getattr(torch.optim, name), list(_params(name, _model())))
    assert ours == theirs
    assert ours['pre'] == 1 and ours['post'] == (1, False) and ours['load_prepend'] == 0.002 and ours['post_order']


@pytest.mark.parametrize('name', sorted(n for n, info in INFOS.items() if 'fused' in info.supported_impls))
def test_fused_on_meta_params_raises_as_torch(name):
    """fused=True on params built on the meta device: torch's RuntimeError at the step (its words), nothing stepped;
    once the model is materialised the same optimizer steps, as torch's."""
    for cls in (getattr(torch.optim, name), getattr(cbopt.optim, name)):
        with torch.device('meta'): model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
        opt = cls(model.parameters(), fused=True)
        with torch.device('meta'):
            for p in model.parameters(): p.grad = torch.rand_like(p)
        with pytest.raises(RuntimeError, match="`fused=True` requires all the params to be floating point Tensors"):
            opt.step()
        opt.zero_grad(set_to_none=True)
        model.to_empty(device='cpu')  # (uninitialised memory: values given, as a real model would load them)
        for p in model.parameters():
            with torch.no_grad(): p.copy_(torch.linspace(-1., 1., p.numel()).view_as(p))
            p.grad = torch.rand_like(p)
        opt.step()
        assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize('shape', [(), (1,), (1, 1)])
@pytest.mark.parametrize('impl', [dict(foreach=False), dict(foreach=True, capturable=True), dict(fused=True)])
def test_tensor_lr_of_any_one_element_shape(shape, impl, monkeypatch):
    """A tensor lr of any 1-element shape steps whole buckets, in torch's fused kernel under fused (one call per step);
    with foreach, as torch, only with capturable=True (torch's error otherwise)."""
    calls, kernel = [], torch._fused_adamw_
    monkeypatch.setattr(torch, '_fused_adamw_', lambda *a, **k: (calls.append(1), kernel(*a, **k))[1])
    m, ref = _model(), _model()
    lr = torch.full(shape, 1e-2)
    if impl.get('foreach'):
        with pytest.raises(ValueError, match='lr as a Tensor is not supported for capturable=False and foreach=True'):
            cbopt.optim.AdamW(m.parameters(), lr=lr, foreach=True)
    opt = cbopt.optim.AdamW(m.parameters(), lr=lr, **impl)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=torch.tensor(1e-2), foreach=False)
    _run(opt, m, N_STEPS)
    _run(torch_opt, ref, N_STEPS)
    lr.fill_(3e-3)  # changed in place, as a scheduler of a tensor lr does
    torch_opt.param_groups[0]['lr'].fill_(3e-3)
    _run(opt, m, 2, start=N_STEPS)
    _run(torch_opt, ref, 2, start=N_STEPS)
    assert_rel_close(m, ref, 2e-5)
    assert len(calls) == (N_STEPS + 2 - 1 if 'fused' in impl else 0)  # (the first step, creating the state, is eager)


def test_both_switches_are_refused():
    "(differentiable=True and its refusals: tests/test_differentiable.py)"
    with pytest.raises(RuntimeError, match="`fused` and `foreach` cannot be `True` together"):
        cbopt.optim.SGD(_model().parameters(), foreach=True, fused=True)


def test_group_flags_and_torch_names():
    "A torch group dict with torch's names runs as torch's."
    m, ref = _model(), _model()
    groups = lambda mod: [{'params': [mod[0].weight], 'alpha': 0.9, 'weight_decay': 0.1, 'centered': True},
                          {'params': [p for p in mod.parameters() if p is not mod[0].weight]}]
    opt = cbopt.optim.RMSprop(groups(m), momentum=0.5, centered=True)
    torch_opt = torch.optim.RMSprop(groups(ref), momentum=0.5, centered=True)
    _run(opt, m, N_STEPS)
    _run(torch_opt, ref, N_STEPS)
    assert_rel_close(m, ref, 2e-5)


def test_muon_group_dicts_take_torchs_names():
    "torch's Muon names in group dicts (weight_decay, momentum, ns_coefficients) run as torch's, per group."
    m, ref = _model(), _model()
    groups = lambda mod: [{'params': [mod[0].weight], 'weight_decay': 0.2, 'momentum': 0.8,
                           'ns_coefficients': (3.4, -4.7, 2.0)}, {'params': [mod[2].weight]}]
    opt, torch_opt = cbopt.optim.Muon(groups(m), lr=0.02), torch.optim.Muon(groups(ref), lr=0.02)
    _run(opt, m, N_STEPS)
    _run(torch_opt, ref, N_STEPS)
    assert_rel_close(m, ref, 2e-5)
    assert (opt.hypers[0]['wd'], opt.hypers[0]['mom'], opt.hypers[0]['ns_b']) == (0.2, 0.8, -4.7)


def test_is_a_full_cbopt_optimizer():
    m = _model()
    opt = cbopt.optim.AdamW(m.named_parameters(), lr=1e-2, betas=(0.8, 0.9))
    assert isinstance(opt, cbopt.Optimizer) and isinstance(opt, torch.optim.Optimizer)
    _run(opt, m, 2)
    assert sorted(opt.named_state_dict()['state']) == ['0.bias', '0.weight', '2.bias', '2.weight']
    assert opt.hypers[0]['mom'] == 0.8 and opt.param_groups[0]['betas'] == (0.8, 0.9) if 'betas' in opt.param_groups[0] else True
    assert repr(opt).startswith('AdamW (\nParameter Group 0\n')


# -- the defaults table of docs/guides/torch-optim.md ------------------------------------------------------------------------------------
RECIPES = {'SGD': 'SGD', 'Adam': 'Adam', 'AdamW': 'Adam', 'RMSprop': 'RMSProp', 'RAdam': 'RAdam', 'NAdam': 'NAdam',
           'Adagrad': 'Adagrad', 'Adadelta': 'Adadelta', 'Adamax': 'Adamax', 'ASGD': 'ASGD', 'Rprop': 'Rprop',
           'Adafactor': 'Adafactor', 'Muon': 'Muon', 'LBFGS': 'LBFGS', 'SparseAdam': None}  # (None: no cbopt recipe)


def _defaults(f) -> str:
    "A callable's hyper defaults as the table writes them (not params, flags, None, the backend or low-bit state's)."
    import inspect
    out = []
    for p in inspect.signature(f).parameters.values():
        if p.name in ('self', 'params', 'backend', 'kwargs', 'state_precision', 'min_quantize_size'): continue
        if p.default is inspect.Parameter.empty: continue
        if isinstance(p.default, bool) or p.default is None or callable(p.default): continue  # (Muon's muon_params)
        out.append(f'`{p.name}={p.default!r}`')
    return ', '.join(out)


def defaults_table() -> str:
    """The table of docs/guides/torch-optim.md: torch.optim's (and so cbopt.optim's) defaults, cbopt's recipe's, and
    fastai's where it has one."""
    import fastai.optimizer as fastai_optim
    rows = ['| torch.optim / cbopt.optim | its defaults | cbopt recipe (fastai names) | its defaults | fastai | its defaults |',
            '|---|---|---|---|---|---|']
    for name, recipe in RECIPES.items():
        if recipe is None:
            rows.append(f"| `{name}` | {_defaults(getattr(torch.optim, name).__init__)} | - | - | - | - |")
            continue
        fa = getattr(fastai_optim, recipe, None)
        rows.append(f"| `{name}` | {_defaults(getattr(torch.optim, name).__init__)} | `cbopt.{recipe}` | "
                    f"{_defaults(getattr(cbopt, recipe))} | {'`' + recipe + '`' if fa else '-'} | {_defaults(fa) if fa else '-'} |")
    return '\n'.join(rows)


def test_docs_defaults_table_matches_the_code():
    from pathlib import Path
    page = (Path(__file__).parent.parent / 'docs' / 'guides' / 'torch-optim.md').read_text()
    assert defaults_table() in page, "regenerate the page's table: print(tests.test_optim.defaults_table())"
    assert set(RECIPES) == set(cbopt.optim.__all__)


@pytest.mark.parametrize('flags', [{}, dict(amsgrad=True), dict(maximize=True), dict(amsgrad=True, maximize=True)],
                         ids=['plain', 'amsgrad', 'maximize', 'amsgrad-maximize'])
def test_l2_adam_fused_is_torchs_fused_adam(flags, monkeypatch):
    """Adam with L2 `weight_decay` and `fused=True` runs torch's `_fused_adam_` (the L2 term inside the kernel), one call
    per step once the state exists: bit for bit torch's `Adam(fused=True)` over 40 steps, the grads left as they were."""
    calls, kernel = [], torch._fused_adam_
    monkeypatch.setattr(torch, '_fused_adam_', lambda *a, **k: (calls.append((k['maximize'], k['amsgrad'])), kernel(*a, **k))[1])
    m, ref = _model(), _model()
    kw = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, fused=True, **flags)
    opt, torch_opt = cbopt.optim.Adam(m.parameters(), **kw), torch.optim.Adam(ref.parameters(), **kw)
    opt.init_state()  # (else the first step, creating the state, runs the chain eagerly)
    for i in range(40):
        _grads(m, i), _grads(ref, i)
        grads = [p.grad.clone() for p in m.parameters()]
        opt.step(), torch_opt.step()
        assert all(torch.equal(p.grad, g) for p, g in zip(m.parameters(), grads))
    for p, q in zip(m.parameters(), ref.parameters()): assert torch.equal(p, q)
    assert calls == [(flags.get('maximize', False), flags.get('amsgrad', False))] * 80


# -- live state and groups as torch shows them -------------------------------------------------------------------------
def _described(v):
    "What torch code sees of a state value: its kind, and a tensor's dtype, device and shape."
    return (type(v).__name__, v.dtype, v.device, tuple(v.shape)) if isinstance(v, torch.Tensor) else (type(v).__name__,)


@pytest.mark.parametrize('name,config,kwargs', [c for c in configs() if c.values[0] != 'LBFGS'])
def test_live_state_is_torchs(name, config, kwargs):
    """After N steps beside the torch class on the same batches, `opt.state[p]` has torch's keys, each value of
    torch's kind (`step` a 0-d float32 CPU tensor), dtype, device and shape, and torch's values."""
    for impl in impls(name, config)[:2]:
        m, ref = _model(), _model()
        backend = impl.pop('backend', None)
        opt = getattr(cbopt.optim, name)(_params(name, m), **_kw(kwargs), **impl)
        if backend: opt.backend = backend
        torch_opt = getattr(torch.optim, name)(_params(name, ref), **_kw(kwargs), **impl)
        _run(opt, m, N_STEPS)
        _run(torch_opt, ref, N_STEPS)
        assert len(opt.state) == len(torch_opt.state)
        for p, q in zip(_params(name, m), _params(name, ref)):
            ours, theirs = opt.state[p], torch_opt.state[q]
            assert {k: _described(v) for k, v in ours.items()} == {k: _described(v) for k, v in theirs.items()}
            for k, v in theirs.items():
                torch.testing.assert_close(ours[k], v, rtol=1e-4, atol=1e-6, msg=lambda m: f'{name} {k}: {m}')


def test_live_state_writes_reach_the_step():
    "Writes through torch's names reach the engine's state: a zeroed `exp_avg`, a `step` set back, a whole new dict."
    m, ref = _model(), _model()
    opt, torch_opt = cbopt.optim.Adam(m.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)
    _run(opt, m, 3)
    _run(torch_opt, ref, 3)
    for o, mod in ((opt, m), (torch_opt, ref)):
        w, b = mod[0].weight, mod[0].bias
        o.state[w]['exp_avg'].zero_()
        o.state[w]['step'] = torch.tensor(1.)
        o.state[b] = {k: v.clone() * 0.5 if k != 'step' else torch.tensor(7.) for k, v in o.state[b].items()}
    assert opt.state[m[0].bias]['step'] == 7 and cbopt.core.runtime.param_states(opt)[m[0].bias]['step'] == 7
    _run(opt, m, 2, start=3)
    _run(torch_opt, ref, 2, start=3)
    assert_rel_close(m, ref, 2e-5)
    assert float(opt.state[m[0].weight]['step']) == 3. and 'grad_avg' in opt.state[m[0].weight]  # (cbopt's name: an alias)
    assert list(opt.state[m[0].weight]) == ['exp_avg', 'exp_avg_sq', 'step']


@pytest.mark.parametrize('c', WITH_OPTIM, ids=str)
def test_registry_drop_in_follows_torch(c):
    """Every registry case with a drop-in twin (`cases.Case.optim`): cbopt.optim's class, built with torch's names,
    follows torch's class step for step over 30 steps on two param groups, within the case's torch tolerance."""
    ours, theirs = make_model(), make_model()
    groups = lambda m: [{'params': ps, 'lr': lr} for ps, lr in zip(two_groups(m), (3e-3, 3e-2))]
    opt, ref = c.optim(groups(ours), 3e-2), c.torch(groups(theirs), 3e-2)
    for i in range(30):
        train(ref, theirs, 1, start=i)
        train(opt, ours, 1, start=i)
        assert_rel_close(ours, theirs, **c.torch_parity.of(torch.float32), msg=f"{c.id} step {i}:")
    stepped = {id(p) for g in opt.param_groups for p in g['params']}  # (torch's Muon: the matrices only)
    for (n, p), p0 in zip(ours.named_parameters(), make_model().parameters()):
        if id(p) in stepped: assert (p - p0).abs().max() > 1e-2 * p0.abs().max(), f"{c.id}: {n} barely moved"


def _group_entries(g):
    "A group's entries but its params (and their names, which torch keeps only for named params)."
    return {k: v for k, v in g.items() if k not in ('params', 'param_names')}


@pytest.mark.parametrize('name,config,kwargs', [c for c in configs() if c.values[0] != 'LBFGS'])
def test_param_groups_and_state_dict_are_torchs(name, config, kwargs):
    """`opt.param_groups` hold torch's entries with torch's values, and `state_dict()` is torch's class's, entry for
    entry (state kinds, dtypes and values; group entries), after N steps beside it."""
    m, ref = _model(), _model()
    opt = getattr(cbopt.optim, name)(_params(name, m), **_kw(kwargs))
    torch_opt = getattr(torch.optim, name)(_params(name, ref), **_kw(kwargs))
    _run(opt, m, N_STEPS)
    _run(torch_opt, ref, N_STEPS)
    for ours, theirs in zip(opt.param_groups, torch_opt.param_groups):
        assert _group_entries(ours) == _group_entries(theirs)
    sd, torch_sd = opt.state_dict(), torch_opt.state_dict()
    assert [_group_entries(g) for g in sd['param_groups']] == [_group_entries(g) for g in torch_sd['param_groups']]
    assert sorted(sd['state']) == sorted(torch_sd['state'])
    for i, st in torch_sd['state'].items():
        assert {k: _described(v) for k, v in sd['state'][i].items()} == {k: _described(v) for k, v in st.items()}
        for k, v in st.items(): torch.testing.assert_close(sd['state'][i][k], v, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize('name,config,kwargs', [c for c in configs() if c.values[0] != 'LBFGS'])
def test_state_dict_deterministic(name, config, kwargs):
    """torch's `test_state_dict_deterministic`, in cbopt's terms: a state_dict taken mid-run (deep-copied), loaded into a
    fresh optimizer over a copy of the model, steps on exactly as the original; both state_dicts then agree."""
    m = _model()
    opt = getattr(cbopt.optim, name)(_params(name, m), **_kw(kwargs))
    _run(opt, m, 3)
    m2 = copy.deepcopy(m)
    sd = copy.deepcopy(opt.state_dict())
    opt2 = getattr(cbopt.optim, name)(_params(name, m2), **_kw(kwargs))
    opt2.load_state_dict(sd)
    _run(opt, m, 3, start=3)
    _run(opt2, m2, 3, start=3)
    for p, q in zip(m.parameters(), m2.parameters()): assert torch.equal(p, q)
    a, b = opt.state_dict(), opt2.state_dict()
    assert a['param_groups'] == b['param_groups'] and sorted(a['state']) == sorted(b['state'])
    for i, st in a['state'].items():
        assert st.keys() == b['state'][i].keys() and all(torch.equal(torch.as_tensor(v), torch.as_tensor(b['state'][i][k]))
                                                         for k, v in st.items())


@pytest.mark.parametrize('name', [n for n in sorted(INFOS) if n != 'LBFGS'])
def test_dcp_flattened_state_dict_round_trips(name):
    """torch's DCP helpers with `flatten_optimizer_state_dict=True` (torchtitan's checkpoint path) read the live
    optimizer's state and group entries: a flattened state_dict taken mid-run loads into a fresh optimizer (single
    process: no process group needed), which steps on as the original."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    m = _model()
    ps = lambda mod: _params(name, mod)
    opt = getattr(cbopt.optim, name)(ps(m))
    _run(opt, m, 3)
    sd = get_optimizer_state_dict(m, opt, options=flat)
    assert 'param_groups.0.weight.lr' in sd and (name == 'SGD' or any(k.startswith('state.0.weight.') for k in sd))
    m2 = copy.deepcopy(m)
    opt2 = getattr(cbopt.optim, name)(ps(m2))
    set_optimizer_state_dict(m2, opt2, copy.deepcopy(sd), options=flat)
    _run(opt, m, 2, start=3)
    _run(opt2, m2, 2, start=3)
    for p, q in zip(m.parameters(), m2.parameters()): assert torch.equal(p, q)


PER_GROUP = [  # (class, constructor keywords, each group's own entries): flags that choose another algorithm per group
    ('Adam', dict(lr=1e-2, weight_decay=0.1), [dict(maximize=True), dict(amsgrad=True, decoupled_weight_decay=True)]),
    ('AdamW', dict(lr=1e-2, amsgrad=True), [dict(amsgrad=False, maximize=True), {}]),
    ('SGD', dict(lr=1e-2, momentum=0.9), [dict(nesterov=True), dict(momentum=0.), dict(dampening=0.5, maximize=True)]),
    ('SGD', dict(lr=1e-2), [dict(momentum=0.9, nesterov=True), {}]),
    ('RMSprop', dict(lr=1e-2), [dict(centered=True), dict(momentum=0.5, maximize=True)]),
    ('NAdam', dict(lr=1e-2, weight_decay=0.1), [dict(decoupled_weight_decay=True), dict(maximize=True)]),
    ('RAdam', dict(lr=1e-2, weight_decay=0.1), [dict(decoupled_weight_decay=True), dict(maximize=True)]),
    ('Adagrad', dict(lr=1e-2), [dict(maximize=True), {}]),
    ('Adamax', dict(lr=1e-2), [dict(maximize=True), {}]),
    ('Rprop', dict(lr=1e-2), [dict(maximize=True), {}]),
    ('Adam', dict(lr=1e-2), [dict(fused=True, foreach=False), dict(fused=False, foreach=False)]),  # torchtitan's groups
]


def _split(mod, own):
    "One group per param of `mod` (cycling over `own`'s entries)."
    return [{'params': [p], **own[i % len(own)]} for i, p in enumerate(mod.parameters())]


@pytest.mark.parametrize('name,kwargs,own', PER_GROUP, ids=[f'{n}-{i}' for i, (n, _, _) in enumerate(PER_GROUP)])
def test_per_group_flags_run_their_own_algorithm(name, kwargs, own):
    """A group's own `maximize`, `amsgrad`, `nesterov`, `centered`, `decoupled_weight_decay` (or momentum) runs the
    algorithm they say, as torch's does: each group its own chain. Its entries are torch's, and `state_dict()` carries
    them: torch loads it and steps on as cbopt does, and so does a fresh cbopt optimizer."""
    m, ref = _model(), _model()
    opt = getattr(cbopt.optim, name)(_split(m, own), **kwargs)
    torch_opt = getattr(torch.optim, name)(_split(ref, own), **kwargs)
    _run(opt, m, N_STEPS)
    _run(torch_opt, ref, N_STEPS)
    assert_rel_close(m, ref, 2e-5)
    for ours, theirs in zip(opt.param_groups, torch_opt.param_groups):
        assert _group_entries(ours) == _group_entries(theirs)
    models = [copy.deepcopy(m) for _ in range(2)]
    sd = _saved(opt.state_dict())
    torch_opt2 = getattr(torch.optim, name)(_split(models[0], [{}]), **kwargs)
    torch_opt2.load_state_dict(sd)  # (its groups' flags come from the state_dict)
    back = getattr(cbopt.optim, name)(_split(models[1], own), **kwargs)
    back.load_state_dict(sd)
    for o, mod in ((opt, m), (torch_opt2, models[0]), (back, models[1])): _run(o, mod, 3, start=N_STEPS)
    for mod in models: assert_rel_close(mod, m, 2e-5)


def test_groups_answer_to_cbopts_names_and_take_torchs_writes():
    """A live group's torch entries and cbopt's hyper names are one: OneCycleLR cycling momentum (`betas[0]`), a write
    of `mom` through `opt.hypers`, and `add_param_group` with its own flags, each as with torch's class; a flag written
    into a live group later is refused (it would not change the chain)."""
    m, ref = _model(), _model()
    opt = cbopt.optim.AdamW(list(m.parameters())[:2], lr=1e-2)
    torch_opt = torch.optim.AdamW(list(ref.parameters())[:2], lr=1e-2)
    for o, mod in ((opt, m), (torch_opt, ref)):
        o.add_param_group({'params': list(mod.parameters())[2:], 'maximize': True, 'betas': (0.8, 0.9)})
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=20) for o in (opt, torch_opt)]
    for i in range(6):
        for o, mod, s in zip((opt, torch_opt), (m, ref), scheds):
            _run(o, mod, 1, start=i)
            s.step()
    assert_rel_close(m, ref, 2e-5)
    for ours, theirs in zip(opt.param_groups, torch_opt.param_groups): assert _group_entries(ours) == _group_entries(theirs)
    assert opt.hypers[1]['mom'] == opt.param_groups[1]['betas'][0] != 0.8
    opt.hypers[0]['mom'] = 0.5
    assert opt.param_groups[0]['betas'] == (0.5, 0.999) and 'mom' not in dict.keys(opt.param_groups[0])
    with pytest.raises(ValueError, match=r"maximize=False set on a param group that runs maximize=True"):
        opt.param_groups[1]['maximize'] = False
    opt.param_groups[0]['foreach'] = True  # (an implementation switch: kept)
    assert opt.state_dict()['param_groups'][0]['foreach'] is True


@pytest.mark.parametrize('name', ['SGD', 'Adam', 'Adagrad'])
def test_repeated_param_warns_and_steps_once(name):
    """A param listed twice in one group: torch's warning (its words), and cbopt.optim steps it once, as torch's class
    given the param once does (torch's own loop would step it twice: `DIFFERENCES`)."""
    m, ref = _model(), _model()
    with pytest.warns(UserWarning, match='a parameter group with duplicate parameters'):
        opt = getattr(cbopt.optim, name)([*m.parameters(), next(m.parameters())], lr=0.1)
    assert len(opt.param_groups[0]['params']) == len(list(m.parameters()))
    twin = getattr(torch.optim, name)(ref.parameters(), lr=0.1)
    for step in range(3):
        _grads(m, step), _grads(ref, step)
        opt.step(), twin.step()
    for p, q in zip(m.parameters(), ref.parameters()): torch.testing.assert_close(p, q)
    with pytest.raises(ValueError, match='same tensor'):  # cbopt's own classes refuse it
        cbopt.SGD([*m.parameters(), next(m.parameters())], lr=0.1)


def test_named_and_unnamed_groups_refused_as_torch():
    "torch's error for a group without names added to an optimizer with names (and the reverse), in its words."
    m = _model()
    named = cbopt.optim.SGD(m[0].named_parameters(), lr=0.1)
    with pytest.raises(ValueError, match='cannot add param group without names'):
        named.add_param_group({'params': list(m[2].parameters())})
    unnamed = cbopt.optim.SGD(m[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match='cannot add param group with names'):
        unnamed.add_param_group({'params': list(m[2].named_parameters())})
    unnamed.add_param_group({'params': list(m[2].parameters())})


SPARSE = [n for n, info in ALL_INFOS.items() if info.supports_sparse or info.only_supports_sparse_grads]


def sparse_configs():
    """torch's configs of the classes that take sparse grads, as torch's sparse test reads them: its `metadata_for_sparse`
    keyword overrides (Adagrad's and SGD's `weight_decay=0`...) applied, differentiable and fused left out."""
    for name in SPARSE:
        info = ALL_INFOS[name]
        updates = info.metadata_for_sparse[0]
        for i, inp in enumerate(info.optim_inputs_func(device='cpu')):
            kw = {k: v for k, v in inp.kwargs.items() if k not in updates and k not in ('differentiable', 'fused')}
            if name != 'SparseAdam': kw.update(updates)
            yield pytest.param(name, kw, id=f'{name}-{i}-{inp.desc}')


def _sparse_grads(params, step):
    "Batch `step`'s sparse grads: uncoalesced (an index given twice), rows 0 and 2 of 2-D params, entries of 1-D ones."
    g = torch.Generator().manual_seed(300 + step)
    for p in params:
        i = torch.tensor([[0, 2, 0]])
        p.grad = torch.sparse_coo_tensor(i, torch.randn(3, *p.shape[1:], generator=g, dtype=p.dtype), p.shape)


@pytest.mark.parametrize('foreach', [False, True])
@pytest.mark.parametrize('name,kwargs', list(sparse_configs()))
def test_sparse_grads_step_as_torch(name, kwargs, foreach):
    """Sparse grads (uncoalesced, as torch's test gives them) step as torch's class steps them, state included, bit for
    bit (the same ops: torch's single-tensor path, which its foreach path falls back to for them), beside dense-grad
    params in the same optimizer."""
    if name == 'SparseAdam' and foreach: pytest.skip('SparseAdam has no foreach switch')
    impl = {} if name == 'SparseAdam' else dict(foreach=foreach)
    ps, ref = _model(), _model()
    opt, twin = getattr(cbopt.optim, name)(ps.parameters(), **_kw(kwargs), **impl), \
        getattr(torch.optim, name)(ref.parameters(), **_kw(kwargs), **impl)
    for step in range(N_STEPS):
        for m, o in ((ps, opt), (ref, twin)):
            _sparse_grads(m.parameters(), step)
            if name != 'SparseAdam': m[2].bias.grad = m[2].bias.grad.to_dense()  # (a dense grad beside the sparse)
            o.step()
    assert_rel_close(ps, ref, 0, 0)
    for p, q in zip(ps.parameters(), ref.parameters()):
        ours, theirs = opt.state[p], twin.state[q]
        assert sorted(ours) == sorted(theirs)
        for k in theirs: torch.testing.assert_close(ours[k], theirs[k], rtol=0, atol=0)
    again = getattr(torch.optim, name)(ref.parameters(), **_kw(kwargs), **impl)
    again.load_state_dict(opt.state_dict())  # torch's class loads it


def test_sparse_grads_refused_as_torch_and_nothing_changes():
    """torch's refusals of sparse grads, in its words where its classes have them (Adagrad's weight decay, fused, a
    dense grad for SparseAdam), and a chain that does not take them; each before anything is stepped."""
    cases = [(lambda ps: cbopt.optim.Adagrad(ps, weight_decay=0.1), 'weight_decay option is not compatible'),
             (lambda ps: cbopt.optim.Adagrad(ps, fused=True), '`fused` does not support sparse grad'),
             (lambda ps: cbopt.optim.SGD(ps, lr=0.1, momentum=0.9), "'average_grad' .* does not support sparse"),
             (lambda ps: cbopt.optim.Adam(ps), "'average_grad' .* does not support sparse")]
    for make, match in cases:
        m = _model()
        opt, before = make(m.parameters()), copy.deepcopy(m)
        _sparse_grads(list(m.parameters())[1:], 0)  # the first param's grad dense, stepped first
        m[0].weight.grad = torch.ones_like(m[0].weight)
        with pytest.raises(RuntimeError, match=match): opt.step()
        assert_rel_close(m, before, 0, 0)
        assert not opt.state
    m = _model()
    opt = cbopt.optim.SparseAdam(m.parameters())
    _sparse_grads(m.parameters(), 0)
    m[2].bias.grad = m[2].bias.grad.to_dense()
    with pytest.raises(RuntimeError, match='does not support dense gradients'): opt.step()
    assert not opt.state
    for p in m.parameters(): p.grad = torch.ones_like(p)  # all dense: refused at the first param, which is unchanged
    with pytest.raises(RuntimeError, match='SparseAdam does not support dense gradients'): opt.step()
    assert not opt.state


def test_lbfgs_state_shows_its_history_as_torchs():
    """`opt.state` of cbopt.optim.LBFGS is torch's LBFGS's: empty before the first step, then the history (kept in the
    group's entries) under the first param by torch's names, with torch's values (but torch's scratch `al`), the other
    params listing nothing; an entry written there reaches the group, as the step reads it."""
    m, ref = _model(), _model()
    opt, twin = cbopt.optim.LBFGS(m.parameters(), max_iter=4), torch.optim.LBFGS(ref.parameters(), max_iter=4)
    assert len(opt.state) == len(twin.state) == 0 and not opt.state[next(m.parameters())]
    for step in range(3): _run(opt, m, 1, start=step), _run(twin, ref, 1, start=step)
    first, theirs = next(m.parameters()), twin.state[next(ref.parameters())]
    assert len(opt.state) == len(twin.state) == 1 and list(opt.state) == [first]
    ours = opt.state[first]
    assert sorted(ours) == sorted(k for k in theirs if k != 'al')
    for k in ours:
        a, b = ours[k], theirs[k]
        a, b = (list(map(torch.as_tensor, x)) if isinstance(x, list) else torch.as_tensor(x) for x in (a, b))
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, check_dtype=False)  # (cbopt keeps `ro`, `t` floats)
    ours['n_iter'] = 7
    assert opt.param_groups[0]['lbfgs.n_iter'] == 7 and opt.state_dict()['state'][0]['n_iter'] == 7


@pytest.mark.parametrize('impl', [dict(foreach=False), dict(foreach=True)])
def test_adamw_group_with_l2_decay_steps_as_torchs(impl):
    """A group of AdamW with `decoupled_weight_decay=False` decays by L2, as in torch's AdamW (its own chain), beside a
    decoupled group; its state_dict says so, per group."""
    m, ref = _model(), _model()
    groups = lambda mod: [{'params': list(mod[0].parameters())},
                          {'params': list(mod[2].parameters()), 'decoupled_weight_decay': False}]
    opt = cbopt.optim.AdamW(groups(m), lr=0.05, weight_decay=0.3, **impl)
    twin = torch.optim.AdamW(groups(ref), lr=0.05, weight_decay=0.3, **impl)
    _run(opt, m, N_STEPS), _run(twin, ref, N_STEPS)
    assert_rel_close(m, ref, 1e-6)
    assert [g['decoupled_weight_decay'] for g in opt.state_dict()['param_groups']] == [True, False]


def test_group_foreach_and_fused_choose_its_runner(monkeypatch):
    """A group's own `foreach`/`fused` (torchtitan writes them into every group) choose the runner that steps it, as
    torch's per-group flags do, the other groups the optimizer's backend; written into a live group, they apply at the
    next step; numbers as torch's class's."""
    import cbopt.engine.dispatch as dispatch
    calls, runners = [], dict(dispatch.RUNNERS)
    for k, run in runners.items():
        monkeypatch.setitem(dispatch.RUNNERS, k, lambda opt, b, hyper, k=k, run=run: (calls.append(k), run(opt, b, hyper)))
    m, ref = _model(), _model()
    groups = lambda mod: [{'params': list(mod[0].parameters()), 'foreach': False},
                          {'params': list(mod[2].parameters()), 'fused': True}]
    opt = cbopt.optim.AdamW(groups(m), lr=0.05, foreach=True)
    twin = torch.optim.AdamW(groups(ref), lr=0.05, foreach=True)
    _run(opt, m, 2), _run(twin, ref, 2)
    assert calls == ['loop', 'fused'] * 2
    opt.param_groups[0]['foreach'] = True  # as the constructor's: the optimizer's backend again
    twin.param_groups[0]['foreach'] = True
    calls.clear()
    _run(opt, m, 1, start=2), _run(twin, ref, 1, start=2)
    assert calls == ['foreach', 'fused']
    assert_rel_close(m, ref, 1e-6)
    assert [(g['foreach'], g['fused']) for g in opt.state_dict()['param_groups']] == [(True, None), (True, True)]
    titan = cbopt.optim.AdamW([{'params': list(_model().parameters()), 'foreach': True, 'fused': False}])
    assert titan.backend == 'auto' and list(titan.group_backends().values()) == ['foreach']
    assert cbopt.optim.AdamW(_model().parameters(), foreach=True).group_backends() is None  # (the default: no work)
