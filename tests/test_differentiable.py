"""`differentiable=True` in `cbopt.optim` against torch.optim's differentiable optimizers, driven by the installed
torch's `optim_db` (as tests/test_optim.py is): for every class torch supports it for and every config torch lists
for that class, the step is recorded by autograd (float64 `torch.autograd.gradcheck` of the step as a function of
the param, its grad and its state before it, as torch's own differentiable tests check theirs), the step's outputs
and their vector-Jacobian products are torch's, gradients of an unrolled loss reach tensor hypers (lr,
weight_decay, betas: by finite differences for every class, and torch's where torch's step gives them), the numbers
are those of the plain step, and complex params step as torch's. torch's refusals (fused, foreach) hold, and its
state_dict entry round-trips."""
import inspect

import pytest
import torch
from torch.autograd import gradcheck
from torch.testing._internal.common_optimizers import optim_db

import cbopt

pytestmark = pytest.mark.usefixtures('one_thread')

F64 = torch.float64
INFOS = {i.optim_cls.__name__: i for i in optim_db
         if hasattr(cbopt.optim, i.optim_cls.__name__) and 'differentiable' in i.supported_impls}
NOT_CONTINUOUS = ('step', 'eta', 'mu')  # state torch keeps as float tensors that are counts or follow from the count
SCALE = {'grad_avg': 1e-2}  # RMSprop's centered mean: square_avg - grad_avg ** 2 must stay positive (torch's tests too)


def configs() -> list:
    return [pytest.param(name, inp.kwargs, id=f'{name}-{i}-{inp.desc}') for name, info in INFOS.items()
            for i, inp in enumerate(info.optim_inputs_func(device='cpu'))]


def test_every_class_torch_makes_differentiable_is_tested():
    "The classes here are exactly cbopt.optim's whose torch twin takes `differentiable` (and optim_db says so)."
    takes = {n for n in cbopt.optim.__all__ if 'differentiable' in inspect.signature(getattr(torch.optim, n)).parameters}
    assert takes == set(INFOS) and len(INFOS) == 11


def _start_state(name: str, kwargs: dict, n: int = 4, seed: int = 0) -> tuple:
    """A param, a grad and a mid-run state: torch's state names and counts from 3 steps of torch's own class (every
    entry its config keeps; float64, as torch keeps counts when that is the default dtype), each continuous entry
    then a leaf that requires grad, of values in [0.5, 1): away from where the step is not smooth (Rprop's sign
    flips, square roots near 0), so that finite differences are a fair reference, as torch's tests start from
    `torch.rand` state."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g, dtype=F64)
    default = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    try:
        warm = getattr(torch.optim, name)([p], **kwargs)
        for _ in range(3):
            p.grad = torch.randn(n, generator=g, dtype=F64)
            warm.step()
    finally: torch.set_default_dtype(default)
    state = {k: v.detach().clone() if k in NOT_CONTINUOUS else
             (SCALE.get(k, 1.) * (0.5 + 0.5 * torch.rand(v.shape, generator=g, dtype=F64))).requires_grad_()
             for k, v in warm.state[p].items()}
    leaf = lambda t: t.detach().clone().requires_grad_()
    return leaf(p), leaf(torch.randn(n, generator=g, dtype=F64)), state


def _stepped(cls: type, kwargs: dict, state: dict, p: torch.Tensor, grad: torch.Tensor, *tensors) -> tuple:
    """One step of `cls` (differentiable) on a clone of `p` with `grad` and `state` (its continuous entries given as
    `tensors`, which gradcheck perturbs): the param after the step, then the state entries that require grad, by
    torch's names in sorted order (so cbopt's and torch's line up)."""
    cont = sorted(k for k, v in state.items() if v.requires_grad)
    given = {**state, **dict(zip(cont, tensors))}
    q = p.clone()
    q.grad = grad
    opt = cls([q], **kwargs, differentiable=True)
    opt.state[q].update({k: v.clone() for k, v in given.items()})
    opt.step()
    after = opt.state[q]
    return (q, *(after[k] for k in cont))


@pytest.mark.parametrize('name,kwargs', configs())
def test_step_is_torchs_differentiable_step(name, kwargs):
    """Per config: the differentiable step's outputs are torch's, their vector-Jacobian products (for the param, the
    grad and each continuous state entry) are torch's, and gradcheck passes on cbopt's step (its analytical Jacobian
    is the finite-difference one)."""
    p, grad, state = _start_state(name, kwargs)
    cont = [state[k] for k in sorted(k for k, v in state.items() if v.requires_grad)]
    inputs = (p, grad, *cont)
    ours = _stepped(getattr(cbopt.optim, name), kwargs, state, *inputs)
    theirs = _stepped(getattr(torch.optim, name), kwargs, state, *inputs)
    assert len(ours) == len(theirs) >= 1
    for a, b in zip(ours, theirs): torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    g = torch.Generator().manual_seed(1)
    cot = [torch.randn(t.shape, generator=g, dtype=F64) for t in ours]
    vjp = lambda outs: torch.autograd.grad(outs, inputs, cot, retain_graph=True, allow_unused=True,
                                                  materialize_grads=True)
    for a, b in zip(vjp(ours), vjp(theirs)): torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert any(v.abs().sum() > 0 for v in vjp(ours))  # (the graph reaches the inputs)
    assert gradcheck(lambda *xs: _stepped(getattr(cbopt.optim, name), kwargs, state, *xs), inputs, fast_mode=True)


# the tensor hypers each class's unrolled loss is differentiated by (torch's tests: SGD's lr and weight_decay, Adam's
# and AdamW's lr, weight_decay and betas); every class's lr at least, Rprop's etas (its lr only starts step_size)
HYPERS = {'SGD': dict(lr=0.01, weight_decay=0.9), 'Adam': dict(lr=0.01, weight_decay=0.5, betas=(0.9, 0.99)),
          'AdamW': dict(lr=0.01, weight_decay=0.5, betas=(0.9, 0.99)), 'RMSprop': dict(lr=0.01),
          'Adagrad': dict(lr=0.01), 'Adadelta': dict(lr=0.5), 'Adamax': dict(lr=0.01), 'NAdam': dict(lr=0.01),
          'RAdam': dict(lr=0.01), 'ASGD': dict(lr=0.01), 'Rprop': dict(etas=(0.5, 1.2))}
# where torch's own differentiable step does not give these gradients, cbopt's are checked by finite differences
# only: why torch's cannot be the reference
TORCH_CANNOT = {
    'SGD': "with momentum, torch's SGD starts its buffer from grad.detach() (no gradient through the first grad; "
           "cbopt's keeps it) and writes in place into the buffer its tensor-lr step saved for backward (a "
           "version-counter error on the next step): compared to torch without momentum",
    'NAdam': "writes in place into exp_avg that its step saved for backward (version-counter error)",
    'Rprop': "writes in place into step_size that its step saved for backward (version-counter error)",
    'ASGD': "reads its eta with .item() (_get_value): its lr gradient is 0",
    'Adadelta': "takes a tensor lr as add_'s alpha: TypeError", 'Adagrad': "addcdiv_'s value: TypeError",
    'Adamax': "addcdiv_'s value: TypeError", 'RMSprop': "addcdiv_'s value: TypeError"}


def _leaves(hypers: dict) -> list: return [t for v in hypers.values() for t in (v if isinstance(v, tuple) else (v,))]


def _unrolled(cls: type, extra: dict, hypers: dict, state: dict, p0: torch.Tensor, steps: int = 3) -> torch.Tensor:
    """The loss after `steps` differentiable steps on a clone of `p0`, each on the grad (create_graph, MAML-style) of
    the loss at the current param, from `state`, with the tensor hypers `hypers` (betas a pair of tensors)."""
    p = p0.clone()
    opt = cls([p], **extra, **hypers, differentiable=True)
    opt.state[p].update({k: v.clone() for k, v in state.items()})
    target = torch.linspace(-1, 1, p.numel(), dtype=F64)
    loss = lambda: ((p - target) ** 2 * torch.arange(1, p.numel() + 1, dtype=F64)).sum()
    for _ in range(steps):
        (p.grad,) = torch.autograd.grad(loss(), p, create_graph=True)
        opt.step()
    return loss()


def _hypers(name: str) -> dict:
    leaf = lambda v: torch.tensor(v, dtype=F64, requires_grad=True)
    return {k: tuple(map(leaf, v)) if isinstance(v, tuple) else leaf(v) for k, v in HYPERS[name].items()}


@pytest.mark.parametrize('name', sorted(HYPERS))
def test_hypergradients(name):
    """An unrolled loss after 3 differentiable steps: its gradient with respect to the tensor hypers is the finite-
    difference one (gradcheck, float64), and not zero; where torch's differentiable step gives it (`TORCH_CANNOT`),
    the loss and its gradients with respect to the start param, state and hypers are torch's."""
    kwargs = {'momentum': 0.9} if name == 'SGD' else {}
    p, _, state = _start_state(name, kwargs)
    hypers = _hypers(name)
    rebuild = lambda *ts: {k: v for k, v in zip(hypers, _regroup(hypers, ts))}
    assert gradcheck(lambda *ts: _unrolled(getattr(cbopt.optim, name), kwargs, rebuild(*ts), state, p), _leaves(hypers))
    leaves = [p, *(v for v in state.values() if v.requires_grad), *_leaves(hypers)]
    grads = torch.autograd.grad(_unrolled(getattr(cbopt.optim, name), kwargs, hypers, state, p), _leaves(hypers))
    assert all(g.abs() > 0 for g in grads)
    if name in TORCH_CANNOT and name != 'SGD': return
    kwargs = {}
    ours, theirs = (_unrolled(getattr(m, name), kwargs, hypers, state, p) for m in (cbopt.optim, torch.optim))
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=0)
    for a, b in zip(*(torch.autograd.grad(out, leaves, allow_unused=True, materialize_grads=True)
                      for out in (ours, theirs)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-12)


def _regroup(hypers: dict, ts: tuple) -> list:
    "The flat tensors `ts` back in the shape of `hypers`' values (a pair for betas)."
    out, ts = [], list(ts)
    for v in hypers.values():
        n = len(v) if isinstance(v, tuple) else 1
        out.append(tuple(ts[:n]) if isinstance(v, tuple) else ts[0])
        ts = ts[n:]
    return out


@pytest.mark.parametrize('name,kwargs', configs())
def test_differentiable_step_computes_the_plain_step(name, kwargs):
    """The same config with differentiable=True (on a non-leaf clone, recording) and without: the same params and
    state after 3 steps, in float32 as in float64."""
    for dtype, tol in ((torch.float32, 1e-6), (F64, 1e-13)):
        g = torch.Generator().manual_seed(3)
        start = torch.randn(2, 3, generator=g, dtype=dtype)
        grads = [torch.randn(2, 3, generator=g, dtype=dtype) for _ in range(3)]
        plain, graph = start.clone(), start.clone().requires_grad_().clone()  # (a non-leaf: what a recorded step updates)
        runs = [(plain, getattr(cbopt.optim, name)([plain], **kwargs)),
                (graph, getattr(cbopt.optim, name)([graph], **kwargs, differentiable=True))]
        for q, opt in runs:
            for gr in grads:
                q.grad = gr.clone()
                opt.step()
        assert graph.grad_fn is not None and plain.grad_fn is None
        torch.testing.assert_close(graph.detach(), plain, rtol=tol, atol=tol)
        (_, a), (_, b) = runs
        assert sorted(a.state[plain]) == sorted(b.state[graph])
        for k in a.state[plain]:
            x, y = a.state[plain][k], b.state[graph][k]
            torch.testing.assert_close(y.detach() if isinstance(y, torch.Tensor) else y, x, rtol=tol, atol=tol)


def _torch_error(fn) -> BaseException:
    with pytest.raises(Exception) as e: fn()
    return e.value


@pytest.mark.parametrize('name', sorted(INFOS))
def test_refusals_are_torchs(name):
    """What torch refuses with differentiable=True cbopt refuses alike (type and words): fused with it (at
    construction), foreach=True with it (at the step; SGD's takes it, and steps as torch's); a leaf param that
    requires grad cannot be stepped in place under autograd (and a step that meets one changes nothing). Without
    differentiable, a non-leaf param is refused (cbopt's words); with it, it is taken."""
    cls, ref = getattr(cbopt.optim, name), getattr(torch.optim, name)
    leaf = lambda: torch.randn(3, dtype=F64, requires_grad=True)
    if 'fused' in INFOS[name].supported_impls:
        err = _torch_error(lambda: ref([leaf()], fused=True, differentiable=True))
        with pytest.raises(type(err), match=str(err)): cls([leaf()], fused=True, differentiable=True)

    def step(c, p, **kw):
        opt = c([p], **kw)
        p.grad = torch.ones_like(p)
        opt.step()
        return p
    start = leaf()
    try: expected = step(ref, start.clone(), foreach=True, differentiable=True)
    except AssertionError as err:  # (torch's foreach code refuses autograd, but SGD's)
        with pytest.raises(AssertionError, match=str(err)): step(cls, start.clone(), foreach=True, differentiable=True)
    else: torch.testing.assert_close(step(cls, start.clone(), foreach=True, differentiable=True), expected)
    err = _torch_error(lambda: step(ref, leaf(), differentiable=True))  # (in place on a leaf that requires grad)
    with pytest.raises(type(err), match='leaf Variable that requires grad'): step(cls, leaf(), differentiable=True)
    fine, bad = leaf().clone(), leaf()  # all or nothing: the param before the leaf is not stepped either
    opt = cls([fine, bad], differentiable=True)
    fine.grad, bad.grad = torch.ones_like(fine), torch.ones_like(bad)
    before, history = fine.detach().clone(), fine.grad_fn
    with pytest.raises(RuntimeError, match="leaf Variable.*param '1'"): opt.step()
    assert torch.equal(fine.detach(), before) and fine.grad_fn is history
    with pytest.raises(ValueError, match='not a leaf tensor'): cls([leaf().clone()])
    opt = cls([leaf().clone()], differentiable=True)
    opt.add_param_group({'params': [leaf().clone()]})  # (the optimizer's flag holds for its added groups too)


@pytest.fixture
def f64_default():
    "float64 as the default dtype, so that torch keeps its step counts in float64 (its differentiable math uses them)."
    default = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    yield
    torch.set_default_dtype(default)


@pytest.mark.parametrize('name', sorted(INFOS))
def test_flag_is_kept_and_round_trips(name, f64_default):
    """As torch's: `defaults['differentiable']` and every group's entry say True; the state_dict keeps it, torch's
    class loads it (and steps on alike), and a fresh cbopt differentiable optimizer loads torch's state_dict."""
    def run(cls, p, steps=2):
        opt = cls([p], differentiable=True)
        for i in range(steps):
            p.grad = torch.full_like(p, 0.1 * (i + 1))
            opt.step()
        return opt
    start = torch.randn(4, dtype=F64, requires_grad=True)
    ours, theirs = start.clone(), start.clone()
    opt, ref = run(getattr(cbopt.optim, name), ours), run(getattr(torch.optim, name), theirs)
    assert opt.defaults['differentiable'] is True and all(g['differentiable'] is True for g in opt.param_groups)
    sd = opt.state_dict()
    assert [g['differentiable'] for g in sd['param_groups']] == [True]
    p1, p2 = ours.detach().clone().requires_grad_().clone(), ours.detach().clone().requires_grad_().clone()
    loaded_ref, loaded = getattr(torch.optim, name)([p1], differentiable=True), getattr(cbopt.optim, name)([p2], differentiable=True)
    loaded_ref.load_state_dict(sd)
    loaded.load_state_dict(ref.state_dict())
    assert loaded_ref.param_groups[0]['differentiable'] is True and loaded.param_groups[0]['differentiable'] is True
    for q, o in ((p1, loaded_ref), (p2, loaded)):
        q.grad = torch.full_like(q, 0.3)
        o.step()
    torch.testing.assert_close(p2, p1, rtol=1e-12, atol=1e-14)


def test_group_flag_without_the_optimizers_is_kept():
    """torch records autograd by the optimizer's flag (`defaults['differentiable']`), and keeps a group dict's own
    `differentiable` as an entry: so does cbopt (the group steps as the others, under no_grad, and saves its flag)."""
    ps = [torch.randn(3, requires_grad=True), torch.randn(2, requires_grad=True)]
    opt = cbopt.optim.Adam([{'params': [ps[0]], 'differentiable': True}, {'params': [ps[1]]}])
    ref = torch.optim.Adam([{'params': [ps[0]], 'differentiable': True}, {'params': [ps[1]]}])
    assert [g['differentiable'] for g in opt.state_dict()['param_groups']] == \
        [g['differentiable'] for g in ref.state_dict()['param_groups']] == [True, False]
    for p in ps: p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in ps]
    opt.step()
    assert all(p.grad_fn is None and not torch.equal(p, b) for p, b in zip(ps, before))


@pytest.mark.parametrize('name', sorted(INFOS))
def test_complex_params_step_as_torchs(name, f64_default):
    """A complex param steps on its real view, as in every backend, in the graph: the param and state after two
    differentiable steps, and the gradient of a loss after them with respect to the start param and grad, are torch's
    (its gradient after one step where torch's own two-step graph fails its version check: Rprop, Adamax)."""
    steps = 1 if name in ('Rprop', 'Adamax') else 2
    def run(cls):
        p0 = torch.tensor([1 + 1j, 2 - 1j, 0.5j], dtype=torch.complex128, requires_grad=True)
        g0 = torch.tensor([0.3 + 0.2j, -0.1 + 0.4j, 0.7 - 0.1j], dtype=torch.complex128, requires_grad=True)
        p = p0.clone()
        opt = cls([p], lr=0.1, differentiable=True)
        for i in range(steps):
            p.grad = g0 * (i + 1)
            opt.step()
        return p, dict(opt.state[p]), torch.autograd.grad(p.abs().sum(), [p0, g0])
    (p, st, grads), (ref, ref_st, ref_grads) = run(getattr(cbopt.optim, name)), run(getattr(torch.optim, name))
    torch.testing.assert_close(p, ref, rtol=1e-12, atol=1e-14)
    assert sorted(st) == sorted(ref_st)
    for k, v in ref_st.items():
        if k != 'step': torch.testing.assert_close(st[k].to(v.dtype), v, rtol=1e-12, atol=1e-14)
        if v.is_complex(): assert st[k].is_complex()
    for a, b in zip(grads, ref_grads, strict=True): torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)


def test_sparse_grad_is_refused_before_anything_changes():
    """torch's differentiable Adagrad steps a sparse grad; cbopt's differentiable step (functionalized) cannot (a
    difference from torch), and says so, naming the param, with nothing changed."""
    p = torch.randn(4, 2, dtype=F64, requires_grad=True).clone()
    opt = cbopt.optim.Adagrad([p], lr=0.1, differentiable=True)
    p.grad = torch.sparse_coo_tensor([[0, 2]], torch.ones(2, 2, dtype=F64), (4, 2))
    before, state = p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}
    with pytest.raises(RuntimeError, match="param '0' has a sparse gradient, which a differentiable step"): opt.step()
    assert torch.equal(p.detach(), before) and sorted(opt.state[p]) == sorted(state)
    assert all(torch.equal(opt.state[p][k], v) for k, v in state.items())
