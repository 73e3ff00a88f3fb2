"""Complex params step as torch.optim steps them: the math on their real views (`torch.view_as_real`), the state in
the params' complex dtype. cbopt.optim against torch on every optim_db config of the classes torch supports complex
for (loop, foreach, fused); every registry optimizer on complex params against itself on the same numbers held as
real params of shape (..., 2), bit for bit; Adafactor and Muon refuse complex params, as torch's do."""
import copy

import pytest
import torch
from torch.testing._internal.common_optimizers import optim_db

import cbopt
from cases import CASES, Case
from conftest import assert_tensors_close

pytestmark = pytest.mark.usefixtures('one_thread')

CLOSURE = ('LBFGS',)  # steps with a closure: its own test below (test_lbfgs_steps_complex_params_as_torch)
COMPLEX = {info.optim_cls.__name__: info for info in optim_db if hasattr(cbopt.optim, info.optim_cls.__name__)
           and info.supports_complex and info.optim_cls.__name__ not in CLOSURE}
REFUSED = [info.optim_cls.__name__ for info in optim_db  # (SparseAdam refuses them as torch's: test_optim's errors)
           if hasattr(cbopt.optim, info.optim_cls.__name__) and not info.supports_complex
           and not info.only_supports_sparse_grads]
STEPS = 8
FUSED = ('AdamW', 'NAdam')  # fused: torch's kernel on the real views; a compiled chain (with 0-d state)


def complex_params(seed: int = 0) -> list[torch.Tensor]:
    "A complex weight and bias (leaves), the same for the same seed."
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 4, dtype=torch.complex64, generator=g).requires_grad_(),
            torch.randn(4, dtype=torch.complex64, generator=g).requires_grad_()]


def complex_grads(ps: list[torch.Tensor], step: int) -> None:
    "Grads of a real loss of the complex params (Wirtinger, as autograd gives them), different at every step."
    x = torch.randn(4, dtype=torch.complex64, generator=torch.Generator().manual_seed(100 + step))
    for p in ps: p.grad = None
    with torch.enable_grad(): ((ps[0] @ x + ps[1][:3]).abs().pow(2).sum() + ps[1].real.sum()).backward()


def run(opt, ps: list, steps: int = STEPS, start: int = 0) -> None:
    for i in range(start, start + steps):
        complex_grads(ps, i)
        opt.step()


def configs():
    for name, info in COMPLEX.items():
        for i, inp in enumerate(info.optim_inputs_func(device='cpu')):
            if isinstance(inp.kwargs.get('lr'), torch.Tensor): continue  # (tensor lrs: tests/test_optim.py)
            yield pytest.param(name, i, inp.kwargs, id=f'{name}-{i}-{inp.desc}')


@pytest.mark.parametrize('name,config,kwargs', list(configs()))
def test_complex_steps_as_torch(name, config, kwargs):
    """cbopt.optim on complex params follows torch's class (its loop or foreach; torch's fused kernels refuse complex
    params, so cbopt's fused backend is checked against torch's loop), and the state is complex, as torch's."""
    impls = [dict(foreach=False), dict(foreach=True)] + ([dict(fused=True)] if config == 0 and name in FUSED else [])
    for impl in impls:
        ours, theirs = complex_params(), complex_params()
        fused = impl.pop('fused', False)
        opt = getattr(cbopt.optim, name)(ours, **kwargs, **impl)
        if fused: opt.backend = cbopt.Backend('fused', compiler='aot_eager')  # (every class; no inductor codegen: seconds)
        torch_opt = getattr(torch.optim, name)(theirs, **kwargs, **(impl or {'foreach': False}))
        run(opt, ours)
        run(torch_opt, theirs)
        assert_tensors_close(ours, theirs, rtol=2e-5)
        for p, q in zip(ours, theirs):
            for k, v in torch_opt.state[q].items():
                if torch.is_tensor(v) and v.shape == q.shape: assert v.is_complex()
            assert all(v.is_complex() for v in opt.state[p].values() if torch.is_tensor(v) and v.shape == p.shape)


@pytest.mark.parametrize('name', sorted(COMPLEX))
def test_complex_state_dicts_load_both_ways(name):
    "A torch checkpoint of complex params loads into cbopt.optim and cbopt's into torch; both step on alike."
    a, b, c = complex_params(), complex_params(), complex_params()
    torch_opt, opt = getattr(torch.optim, name)(a), getattr(cbopt.optim, name)(b)
    run(torch_opt, a, 3)
    run(opt, b, 3)
    with torch.no_grad():
        for p, q, r in zip(a, b, c): q.copy_(p), r.copy_(p)
    opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    torch_back = getattr(torch.optim, name)(c)
    torch_back.load_state_dict(copy.deepcopy(opt.state_dict()))
    for o, ps in ((torch_opt, a), (opt, b), (torch_back, c)): run(o, ps, 3, start=3)
    assert_tensors_close(b, a, rtol=2e-5)
    assert_tensors_close(c, a, rtol=2e-5)


@pytest.mark.parametrize('name', REFUSED)
def test_refused_where_torch_refuses(name):
    """torch's Adafactor and Muon refuse complex params at the step, and so do cbopt.optim's (torch's words), before
    anything changes, a real param beside them stepping while they have no grad; cbopt's own classes refuse them at
    construction, naming the param."""
    ps = complex_params()[:1] if name == 'Muon' else complex_params()  # (Muon takes matrices only)
    real = torch.nn.Parameter(torch.randn(3, 4))
    opt = getattr(cbopt.optim, name)([real, *ps])
    real.grad = torch.ones_like(real)
    opt.step()
    for p in ps: p.grad = torch.ones_like(p)
    before = [t.detach().clone() for t in (real, *ps)]
    with pytest.raises(RuntimeError, match=f"^{name} does not support complex parameters$"): opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, (real, *ps)))
    with pytest.raises(TypeError, match=r"param '0' \(group 0\) is complex \(torch.complex64\), which '\w+' does not "
                                        r"support"):
        getattr(cbopt, name)(ps)


def complex_loss(ps: list[torch.Tensor]) -> torch.Tensor:
    "A real loss of the complex params with a minimum (so that L-BFGS has somewhere to go)."
    x = torch.randn(4, dtype=torch.complex64, generator=torch.Generator().manual_seed(7))
    return (ps[0] @ x + ps[1][:3] - 1j).abs().pow(2).sum() + (ps[1] - 0.5).abs().pow(2).sum()


@pytest.mark.parametrize('line_search_fn', [None, 'strong_wolfe'])
@pytest.mark.parametrize('backend', ['loop', 'foreach'])
def test_lbfgs_steps_complex_params_as_torch(backend, line_search_fn):
    """cbopt.optim.LBFGS on complex params is torch's: both work on the flat vector of the params' real views. Over
    6 steps (each up to 20 iterations) the params and the loss follow torch's; its checkpoint loads into torch's."""
    ours, theirs = complex_params(), complex_params()
    opt = cbopt.optim.LBFGS(ours, history_size=5, line_search_fn=line_search_fn)
    opt.backend = backend
    torch_opt = torch.optim.LBFGS(theirs, history_size=5, line_search_fn=line_search_fn)
    def closure(ps, o):
        def evaluate():
            o.zero_grad()
            loss = complex_loss(ps)
            loss.backward()
            return loss
        return evaluate
    for _ in range(6):
        assert opt.step(closure(ours, opt)).item() == pytest.approx(torch_opt.step(closure(theirs, torch_opt)).item(),
                                                                    rel=1e-5)
    assert_tensors_close(ours, theirs, rtol=2e-5)
    assert complex_loss(ours).item() < complex_loss(complex_params()).item() / 100
    back = complex_params()
    with torch.no_grad():
        for p, q in zip(back, theirs): p.copy_(q)
    torch_back = torch.optim.LBFGS(back, history_size=5, line_search_fn=line_search_fn)
    torch_back.load_state_dict(copy.deepcopy(opt.state_dict()))
    for o, ps in ((torch_opt, theirs), (torch_back, back)): o.step(closure(ps, o))
    assert_tensors_close(back, theirs, rtol=2e-5)


def as_real_params(ps: list) -> list[torch.Tensor]:
    "The complex params' numbers as real leaves of shape (..., 2)."
    return [torch.view_as_real(p.detach()).clone().requires_grad_() for p in ps]


@pytest.mark.parametrize('c', CASES, ids=str)  # (the cases that refuse complex params: their `gaps` say so)
@pytest.mark.parametrize('backend', ['loop', 'foreach'])
def test_registry_on_complex_params_is_the_real_math(c: Case, backend):
    """Every registry optimizer (fastai's, torch's, the modern ones, Lookahead, Kahan, user chains) steps a complex
    param exactly as it steps the same numbers held as a real param of shape (..., 2) with the grad's real view."""
    ours = complex_params()
    real = as_real_params(ours)
    opt = c.build([ours], 1e-2, backend=backend)
    ref = c.build([real], 1e-2, backend='loop')
    for i in range(STEPS):
        complex_grads(ours, i)
        for r, p in zip(real, ours): r.grad = torch.view_as_real(p.grad).clone()
        opt.step()
        ref.step()
    for p, r in zip(ours, real): assert torch.equal(torch.view_as_real(p.detach()), r.detach()), f"{c.id}"
    assert not torch.equal(ours[0].detach(), complex_params()[0].detach())
    for p, r in zip(ours, real):
        for k, v in opt.state[p].items():
            if torch.is_tensor(v) and v.shape == p.shape:
                assert v.is_complex() and torch.equal(torch.view_as_real(v), ref.state[r][k]), f"{c.id} state {k!r}"
