"""`cbopt.LBFGS` (the whole-model callback `lbfgs`) against torch.optim.LBFGS: Rosenbrock and a tiny MLP over many
steps, with and without the strong-Wolfe line search, in every backend; torch's state_dicts loading mid-run; a
weights_only checkpoint resuming bit-exact; the grads a step leaves; the errors.

LBFGS is not in `tests/cases.py`: the conformance tests there step without a closure, which L-BFGS needs. This file
runs it through what they check (every backend, resume, torch's state_dict)."""
from __future__ import annotations

import copy
import math
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cbopt
from conftest import assert_rel_close

pytestmark = pytest.mark.usefixtures('one_thread')

BACKENDS = ['loop', 'foreach', 'fused', 'auto']
SEARCHES = [None, 'strong_wolfe']


class Rosenbrock(nn.Module):
    "Rosenbrock's valley: one 2-element param, started at (-1.5, 2) in float64."
    def __init__(self):
        super().__init__()
        self.xy = nn.Parameter(torch.tensor([-1.5, 2.0], dtype=torch.float64))

    def loss(self): return (1 - self.xy[0]) ** 2 + 100 * (self.xy[1] - self.xy[0] ** 2) ** 2


class MLP(nn.Sequential):
    "A tiny MLP regressing a smooth function of its inputs (a fixed full batch, as L-BFGS is used)."
    def __init__(self, dtype=torch.float64, hidden: int = 8):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            super().__init__(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.to(dtype)
        self.register_buffer('x', torch.randn(32, 4, generator=torch.Generator().manual_seed(1), dtype=dtype))

    def loss(self): return F.mse_loss(self(self.x), self.x.sum(1, keepdim=True).sin())


rosenbrock, mlp = Rosenbrock, MLP
MODELS = {'rosenbrock': rosenbrock, 'mlp': mlp}


def closure(m, opt):
    def evaluate():
        opt.zero_grad()
        loss = m.loss()
        loss.backward()
        return loss
    return evaluate


def hypers(line_search_fn):
    "Few iterations and a short history, so that the history wraps and steps end on each condition."
    return dict(lr=1 if line_search_fn else 0.2, max_iter=4, history_size=3, line_search_fn=line_search_fn)


def run(m, opt, steps):
    return [opt.step(closure(m, opt)).item() for _ in range(steps)]


def func_evals(opt) -> int: return opt.param_groups[0]['lbfgs.func_evals']


@pytest.mark.parametrize('backend', BACKENDS)
@pytest.mark.parametrize('line_search_fn', SEARCHES)
@pytest.mark.parametrize('model', MODELS)
def test_matches_torch(model, line_search_fn, backend):
    m, ref = MODELS[model](), MODELS[model]()
    opt = cbopt.LBFGS(m.parameters(), **hypers(line_search_fn), backend=backend)
    torch_opt = torch.optim.LBFGS(ref.parameters(), **hypers(line_search_fn))
    for _ in range(2):  # 20 steps, compared every 10
        losses, ref_losses = run(m, opt, 10), run(ref, torch_opt, 10)
        assert_rel_close(m, ref)
        torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=0)
    assert func_evals(opt) == torch_opt.state[next(ref.parameters())]['func_evals']
    assert ref.loss() < 0.5 * MODELS[model]().loss()  # it did optimize


def test_matches_torch_in_float32():
    m, ref = mlp(torch.float32), mlp(torch.float32)
    opt = cbopt.LBFGS(m.parameters(), **hypers('strong_wolfe'))
    torch_opt = torch.optim.LBFGS(ref.parameters(), **hypers('strong_wolfe'))
    run(m, opt, 15), run(ref, torch_opt, 15)
    assert_rel_close(m, ref, rtol=1e-5)


def test_default_hypers_and_torch_defaults():
    m, ref = mlp(), mlp()
    opt, torch_opt = cbopt.LBFGS(m.parameters()), torch.optim.LBFGS(ref.parameters())
    for k in torch_opt.defaults: assert opt.param_groups[0][k] == torch_opt.param_groups[0][k], k  # max_eval: 25 in both
    run(m, opt, 3), run(ref, torch_opt, 3)
    assert_rel_close(m, ref)


@pytest.mark.parametrize('line_search_fn', SEARCHES)
def test_loads_torchs_state_dict_mid_run(line_search_fn):
    "torch's history (kept under its first param) becomes the group entries 'lbfgs.*', and the run goes on as torch's."
    ref = mlp()
    torch_opt = torch.optim.LBFGS(ref.parameters(), **hypers(line_search_fn))
    run(ref, torch_opt, 5)
    m = copy.deepcopy(ref)
    opt = cbopt.LBFGS(m.named_parameters(), **hypers(line_search_fn))
    run(m, opt, 2)  # a run of its own first: the load replaces its history
    m.load_state_dict(ref.state_dict())
    sd = torch_opt.state_dict()
    opt.load_state_dict(sd)
    assert len(opt.param_groups[0]['lbfgs.old_dirs']) == len(torch_opt.state[next(ref.parameters())]['old_dirs'])
    run(m, opt, 8), run(ref, torch_opt, 8)  # torch's LBFGS changes its state in place: the loaded copy must not follow
    assert_rel_close(m, ref)
    assert func_evals(opt) == torch_opt.state[next(ref.parameters())]['func_evals']


@pytest.mark.parametrize('line_search_fn', SEARCHES)
def test_torch_loads_its_state_dict_mid_run(line_search_fn):
    "`state_dict(format=torch.optim.LBFGS)` puts the history under the first param, where torch's LBFGS reads it."
    m = mlp()
    opt = cbopt.LBFGS(m.parameters(), **hypers(line_search_fn))
    run(m, opt, 5)
    ref = copy.deepcopy(m)
    torch_opt = torch.optim.LBFGS(ref.parameters(), **hypers(line_search_fn))
    buf = io.BytesIO()
    torch.save(opt.state_dict(format=torch.optim.LBFGS), buf)
    buf.seek(0)
    torch_opt.load_state_dict(torch.load(buf, weights_only=True))
    assert len(torch_opt.state[ref[0].weight]['old_dirs']) == hypers(line_search_fn)['history_size']
    run(m, opt, 8), run(ref, torch_opt, 8)
    assert_rel_close(m, ref)
    assert func_evals(opt) == torch_opt.state[ref[0].weight]['func_evals']


def test_loads_torchs_state_dict_before_any_history():
    "A torch checkpoint taken before a step, or after one that stopped at once (tolerance_grad), has no history."
    ref = mlp()
    fresh = torch.optim.LBFGS(ref.parameters()).state_dict()
    stopped = torch.optim.LBFGS(ref.parameters(), tolerance_grad=1e9)
    run(ref, stopped, 1)
    assert sorted(stopped.state[next(ref.parameters())]) == ['func_evals', 'n_iter']
    for sd in (fresh, stopped.state_dict()):
        m = mlp()
        opt = cbopt.LBFGS(m.parameters(), **hypers(None))
        run(m, opt, 2)
        opt.load_state_dict(sd)
        assert opt.param_groups[0]['lbfgs.d'] is None and opt.param_groups[0]['lbfgs.old_dirs'] == []
        assert opt.param_groups[0]['max_iter'] == 20 and opt.param_groups[0]['lr'] == 1  # torch's hypers came too


@pytest.mark.parametrize('backend', BACKENDS)
def test_resumes_bit_exact_from_a_weights_only_checkpoint(backend):
    m = mlp()
    opt = cbopt.LBFGS(m.named_parameters(), **hypers('strong_wolfe'), backend=backend)
    run(m, opt, 4)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    saved = copy.deepcopy(m)
    run(m, opt, 6)
    buf.seek(0)
    for into_used in (False, True):  # into a fresh optimizer, and into one with a history of its own
        m2 = copy.deepcopy(saved)
        opt2 = cbopt.LBFGS(m2.named_parameters(), **hypers('strong_wolfe'), backend=backend)
        if into_used: run(m2, opt2, 3); m2.load_state_dict(saved.state_dict())
        buf.seek(0)
        opt2.load_state_dict(torch.load(buf, weights_only=True))
        run(m2, opt2, 6)
        for p, q in zip(m2.parameters(), m.parameters()): assert torch.equal(p, q)
        assert func_evals(opt2) == func_evals(opt)


FLAT = ('d', 'prev_flat_grad', 'old_dirs', 'old_stps')  # LBFGS's history vectors: flat over the params, in order


def by_name(entries: dict, names: list, shapes: dict) -> dict:
    "Each flat history vector (`lbfgs.<key>`, or a list of them) cut into its params' slices, by name."
    def cut(v):
        sizes = [shapes[n].numel() for n in names]
        return dict(zip(names, v.split(sizes)))
    return {k: [cut(v) for v in entries[f'lbfgs.{k}']] if k.startswith('old') else cut(entries[f'lbfgs.{k}'])
            for k in FLAT}


@pytest.mark.parametrize('saved_as', ['state_dict', 'named_state_dict', 'torch.optim.LBFGS'])
@pytest.mark.parametrize('line_search_fn', SEARCHES)
def test_resumes_from_a_checkpoint_of_params_in_another_order(line_search_fn, saved_as):
    """A checkpoint loads by name: an LBFGS over the same named params listed in another order gets the flat history
    (`d`, `prev_flat_grad`, `old_dirs`, `old_stps`: the params' slices concatenated in the saving optimizer's order)
    in its own order, each param's slice bit for bit, and goes on as the uninterrupted run; from torch's LBFGS too."""
    m = mlp()
    if saved_as == 'torch.optim.LBFGS': opt = torch.optim.LBFGS(m.named_parameters(), **hypers(line_search_fn))
    else: opt = cbopt.LBFGS(m.named_parameters(), **hypers(line_search_fn))
    run(m, opt, 4)
    sd = copy.deepcopy(opt.named_state_dict() if saved_as == 'named_state_dict' else opt.state_dict())
    saved = copy.deepcopy(m)
    run(m, opt, 6)
    m2 = copy.deepcopy(saved)
    named = list(m2.named_parameters())
    opt2 = cbopt.LBFGS([named[i] for i in (2, 0, 3, 1)], **hypers(line_search_fn))
    opt2.load_state_dict(sd)
    shapes = dict(named)
    theirs = sd['state'][0] if saved_as == 'torch.optim.LBFGS' else sd['param_groups'][0]
    if saved_as == 'torch.optim.LBFGS': theirs = {f'lbfgs.{k}': v for k, v in theirs.items()}
    want = by_name(theirs, [n for n, _ in m.named_parameters()], shapes)
    got = by_name(opt2.param_groups[0], opt2.param_names, shapes)
    for k in FLAT:
        if k.startswith('old'):
            assert len(got[k]) == len(want[k]) == hypers(line_search_fn)['history_size'], k
            for g, w in zip(got[k], want[k]):
                for n in w: assert torch.equal(g[n], w[n]), (k, n)
        else:
            for n in want[k]: assert torch.equal(got[k][n], want[k][n]), (k, n)
    run(m2, opt2, 6)
    assert_rel_close(m2, m, rtol=1e-9)  # (dot products summed in another order: rounding apart)


def test_a_history_of_a_group_of_other_params_is_refused():
    """A checkpoint whose history is kept in a group of only some of the params (grouped otherwise) cannot be put in
    this group's order: refused, naming the entry, and nothing changes."""
    m = mlp()
    opt = cbopt.LBFGS(m.named_parameters(), **hypers(None))
    run(m, opt, 3)
    sd = opt.state_dict()
    g = sd['param_groups'][0]
    sd['param_groups'] = [{**g, 'params': g['params'][:2], 'param_names': g['param_names'][:2]},
                          {k: v for k, v in g.items() if not k.startswith('lbfgs.')} | {'params': g['params'][2:],
                                                                                     'param_names': g['param_names'][2:]}]
    named = list(m.named_parameters())
    opt2 = cbopt.LBFGS(named[::-1], **hypers(None))
    with pytest.raises(ValueError, match=r"state 'lbfgs.d' \(group 0\) is flat over the params of the state_dict's "
                                         r"group 0, which are not this group's"):
        opt2.load_state_dict(sd)
    assert func_evals(opt2) == 0 and opt2.param_groups[0]['lbfgs.old_dirs'] == []


def test_a_checkpoint_is_a_snapshot():
    "The saved history does not change as training goes on (torch's LBFGS shares its live lists with its state_dict)."
    m = mlp()
    opt = cbopt.LBFGS(m.parameters(), **hypers(None))
    run(m, opt, 3)
    sd = opt.state_dict()
    kept = copy.deepcopy(sd)
    run(m, opt, 3)
    g, k = sd['param_groups'][0], kept['param_groups'][0]
    assert torch.equal(g['lbfgs.d'], k['lbfgs.d']) and len(g['lbfgs.old_dirs']) == len(k['lbfgs.old_dirs'])
    assert all(torch.equal(a, b) for a, b in zip(g['lbfgs.old_dirs'], k['lbfgs.old_dirs']))


def test_leaves_the_grads_of_the_last_evaluation():
    "As torch's: after a step each param holds the grad of the closure's last evaluation."
    m, ref = mlp(), mlp()
    opt = cbopt.LBFGS(m.parameters(), **hypers('strong_wolfe'))
    torch_opt = torch.optim.LBFGS(ref.parameters(), **hypers('strong_wolfe'))
    run(m, opt, 3), run(ref, torch_opt, 3)
    for p, q in zip(m.parameters(), ref.parameters()): assert torch.equal(p.grad, q.grad)


def test_errors_name_the_culprit_and_change_nothing():
    m = mlp()
    opt = cbopt.LBFGS(m.parameters())
    before = [p.detach().clone() for p in m.parameters()]
    m.loss().backward()
    with pytest.raises(RuntimeError, match=r"lbfgs re-evaluates the model .* call opt.step\(closure\)"): opt.step()
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before)) and func_evals(opt) == 0
    ps = list(m.parameters())
    with pytest.raises(ValueError, match="LBFGS doesn't support per-parameter options"):
        cbopt.LBFGS([{'params': ps[:2]}, {'params': ps[2:]}])
    with pytest.raises(ValueError, match="line_search_fn='wolfe' is not supported"): cbopt.LBFGS(ps, line_search_fn='wolfe')
    with pytest.raises(ValueError, match="Invalid history_size value: 0"): cbopt.LBFGS(ps, history_size=0)
    with pytest.raises(TypeError, match="'max_iter'"): cbopt.LBFGS(ps, max_iter=2.5)
    with pytest.raises(ValueError, match="Invalid learning rate: -1"): cbopt.LBFGS(ps, lr=-1)
    # a history of other params (a smaller model with the same names): refused by the load, which changes nothing
    small = MLP(hidden=3)
    o2 = cbopt.LBFGS(small.named_parameters(), **hypers(None))
    run(small, o2, 2)
    opt = cbopt.LBFGS(m.named_parameters())
    with pytest.raises(ValueError, match=r"state 'lbfgs.d' \(group 0\) has shape \(19,\) in the state_dict, but this "
                                         r"group's params have 49 elements: it is the state of other params"):
        opt.load_state_dict(o2.state_dict())
    assert func_evals(opt) == 0 and opt.param_groups[0]['lbfgs.d'] is None
    # and one set by hand, at the step, before anything changes
    opt.param_groups[0].update({k: v for k, v in o2.param_groups[0].items() if k.startswith('lbfgs.')})
    with pytest.raises(ValueError, match=r"its state 'd' has shape \(19,\), but the params have 49 elements"):
        opt.step(closure(m, opt))
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before)) and func_evals(opt) == func_evals(o2)


def test_fastai_learner_gets_a_clear_error():
    "fastai's Learner calls step() without a closure: LBFGS says what it needs instead of stepping wrongly."
    from fastai.data.core import DataLoaders
    from fastai.learner import Learner
    x = torch.randn(16, 4)
    ds = list(zip(x, x.sum(1, keepdim=True)))
    dls = DataLoaders.from_dsets(ds, ds, bs=8, device='cpu')
    learn = Learner(dls, nn.Linear(4, 1), nn.MSELoss(), opt_func=cbopt.LBFGS)
    learn.logger = lambda *a: None
    with pytest.raises(RuntimeError, match=r"call opt.step\(closure\).*a fastai Learner steps without a closure"):
        learn.fit(1)


@pytest.mark.parametrize('kw', [dict(tolerance_grad=math.inf), dict(tolerance_grad=-math.inf),
                                dict(tolerance_change=math.inf), dict(tolerance_grad=-1.0)])
def test_accepts_what_torchs_accepts(kw):
    """torch's LBFGS takes any tolerance (inf: stop at once; -inf: never stop on the grad): cbopt.optim's too, stepping
    as torch's and returning the same type."""
    m, ref = _lbfgs_model(), _lbfgs_model()
    opt, torch_opt = cbopt.optim.LBFGS(m.parameters(), **kw), torch.optim.LBFGS(ref.parameters(), **kw)
    for o, mod in ((opt, m), (torch_opt, ref)):
        out = o.step(lambda: _lbfgs_loss(o, mod))
        assert isinstance(out, torch.Tensor)
    for p, q in zip(m.parameters(), ref.parameters()): torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _lbfgs_model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def _lbfgs_loss(opt, model):
    opt.zero_grad()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss
