"""Resuming is exact: a checkpoint written with `torch.save` and read with `torch.load(weights_only=True)` into a fresh
optimizer continues bit for bit. And a torch.optim or fastai optimizer's state_dict continues in cbopt as it would
have in torch or fastai."""
import io

import fastai.optimizer as fo
import pytest
import torch

import cbopt
from cases import CASES, WITH_FASTAI, WITH_TORCH, Case, case
from conftest import assert_rel_close, assert_same_params, make_model, train, two_groups

pytestmark = pytest.mark.usefixtures('one_thread')
LR = slice(3e-3, 3e-2)


def save_load(sd: dict) -> dict:
    "A round trip through a checkpoint file, read back as `learn.load` and DCP do: `weights_only=True`."
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


POSITIONAL = ['sgd-mom', 'adam', 'ranger']  # also given as bare tensors, named by position


@pytest.mark.parametrize('c,named', [(c, True) for c in CASES] + [(case(n), False) for n in POSITIONAL],
                         ids=[c.id for c in CASES] + [f'{n}-positional' for n in POSITIONAL])
def test_resume_is_exact(c: Case, named):
    "50 steps, checkpoint, a new optimizer loads it, 50 more steps: bit-identical params to 100 steps in one go."
    ref, model = make_model(), make_model()
    train(c.build(two_groups(ref, named), LR), ref, 100)
    opt = c.build(two_groups(model, named), LR)
    train(opt, model, 50)
    sd = save_load(opt.state_dict())
    names = [n if named else str(i) for i, (n, _) in enumerate(model.named_parameters())]
    assert [g['param_names'] for g in sd['param_groups']] == [list(g['param_names']) for g in opt.param_groups]
    assert sorted(opt.param_names) == sorted(names)  # torch's layout, with the names (a recipe may split the groups)
    assert list(sd['state']) == [i for i, p in enumerate(opt.params) if opt.state[p]]
    fresh = c.build(two_groups(model, named), LR)
    fresh.load_state_dict(sd)
    train(fresh, model, 50, start=50)
    assert_same_params(model, ref)


def continue_both(theirs_opt, theirs, ours_opt, ours, start: int, tol: dict, steps: int = 20) -> None:
    "Continue the reference optimizer and ours from the same point, checking params after every step."
    for i in range(start, start + steps):
        train(theirs_opt, theirs, 1, start=i)
        train(ours_opt, ours, 1, start=i)
        assert_rel_close(ours, theirs, **tol, msg=f"step {i}:")


# how torch's optimizer is given its params (cbopt's always gets the same params, named by FQN)
TORCH_PARAMS = {
    'param_names':        lambda m: [{'params': g, **lr} for g, lr in zip(two_groups(m, True), [{'lr': 3e-3}, {}])],
    'ids-only':           lambda m: [{'params': g, **lr} for g, lr in zip(two_groups(m), [{'lr': 3e-3}, {}])],
    'named_parameters()': lambda m: m.named_parameters(),
}


# every case with a torch reference, its params given with names; how torch's ids map to names, on two of them
TORCH_LOADS = [(c, 'param_names') for c in WITH_TORCH] + \
    [(case(n), form) for n in ('adam', 'sgd-mom-l2') for form in TORCH_PARAMS if form != 'param_names']


@pytest.mark.parametrize('c,form', TORCH_LOADS, ids=[f'{c}-{form}' for c, form in TORCH_LOADS])
def test_torch_state_continues_in_cbopt(c: Case, form):
    """The README: `load_state_dict` reads torch.optim state_dicts of the same algorithm, for every algorithm cbopt
    has in torch.optim. 20 steps of torch.optim, its state_dict into cbopt (named by FQN), 20 more steps: the same
    as torch's next 20."""
    theirs, ours = make_model(), make_model()
    topt = c.torch(TORCH_PARAMS[form](theirs), 3e-2)
    train(topt, theirs, 20)
    sd = topt.state_dict()
    assert ('param_names' in sd['param_groups'][0]) == (form != 'ids-only')
    ours.load_state_dict(theirs.state_dict())
    opt = c.build(TORCH_PARAMS[form if form == 'named_parameters()' else 'param_names'](ours), 1e-3)
    opt.load_state_dict(save_load(sd))
    assert [g['lr'] for g in opt.param_groups] == [g['lr'] for g in topt.param_groups]
    continue_both(topt, theirs, opt, ours, start=20, tol=c.torch_parity.of(torch.float32))


NO_STEP_COUNT = ('rmsprop-l2',)  # fastai's RMSProp counts no steps, which torch.optim.RMSprop's state must have


@pytest.mark.parametrize('c', WITH_TORCH, ids=str)
def test_cbopt_state_continues_in_torch(c: Case):
    """The reverse: 20 steps of cbopt, `state_dict(format=<its torch twin's class>)` (through weights_only) into the
    torch.optim twin, 20 more steps: as cbopt's next 20. A chain whose state torch's class cannot hold is refused."""
    theirs, ours = make_model(), make_model()
    opt = c.build(TORCH_PARAMS['param_names'](ours), 1e-3)
    train(opt, ours, 20)
    theirs.load_state_dict(ours.state_dict())
    topt = c.torch(TORCH_PARAMS['param_names'](theirs), 3e-2)
    if c.id in NO_STEP_COUNT:
        with pytest.raises(ValueError, match=r"has no step count, which torch.optim.RMSprop's state must have"):
            opt.state_dict(format=type(topt))
        return
    topt.load_state_dict(save_load(opt.state_dict(format=type(topt))))
    assert [g['lr'] for g in topt.param_groups] == [g['lr'] for g in opt.param_groups]
    continue_both(opt, ours, topt, theirs, start=20, tol=c.torch_parity.of(torch.float32))


@pytest.mark.parametrize('c', WITH_FASTAI, ids=str)
def test_fastai_state_continues_in_cbopt(c: Case):
    """The README: `load_state_dict` reads fastai's state_dicts. 20 steps of fastai's optimizer, its state_dict
    (state listed by position) into cbopt, 20 more steps: as in fastai."""
    theirs, ours = make_model(), make_model()
    ref = c.fastai(two_groups(theirs), LR)
    train(ref, theirs, 20)
    ours.load_state_dict(theirs.state_dict())
    opt = c.build(two_groups(ours, named=True), 1e-3)
    opt.load_state_dict(ref.state_dict())  # in memory: a load that kept fastai's tensors would corrupt both runs
    assert [h['lr'] for h in opt.hypers] == pytest.approx([h['lr'] for h in ref.hypers])
    continue_both(ref, theirs, opt, ours, start=20, tol=c.fastai_parity.of(torch.float32))


LOOKAHEAD = {'ranger': lambda m, ps: m.ranger(ps, LR, sqr_mom=0.95),  # cases.py's 'ranger'
             'lookahead-sgd': lambda m, ps: m.Lookahead(m.SGD(ps, LR, wd=0.1), k=4)}  # an inner opt with no state


@pytest.mark.parametrize('steps', [20, 21], ids=['at-sync', 'mid-cycle'])
@pytest.mark.parametrize('name', LOOKAHEAD)
def test_fastai_lookahead_state_continues_in_cbopt(name, steps):
    "fastai's Lookahead keeps `count` and `slow_weights` beside the inner optimizer's state: cbopt reads them."
    theirs, ours = make_model(), make_model()
    ref = LOOKAHEAD[name](fo, two_groups(theirs))
    train(ref, theirs, steps)  # 20 steps leave the fast weights past a sync (k=6: 2 steps, k=4: 0), 21 steps one more
    ours.load_state_dict(theirs.state_dict())
    opt = LOOKAHEAD[name](cbopt, two_groups(ours, named=True))
    opt.load_state_dict(ref.state_dict())
    assert [opt.state[p].get('la_step') for p in opt.params] == [steps] * len(opt.params)
    continue_both(ref, theirs, opt, ours, start=steps, tol=dict(rtol=1e-6))


@pytest.mark.parametrize('src,dst', [('ranger', 'radam'), ('radam', 'ranger')])
def test_fastai_lookahead_mismatch_raises(src, dst):
    "A Lookahead checkpoint does not load into a plain optimizer, nor the reverse: the state keys differ."
    theirs, ours = make_model(), make_model()
    ref = fo.Lookahead(fo.RAdam(two_groups(theirs), LR)) if src == 'ranger' else fo.RAdam(two_groups(theirs), LR)
    train(ref, theirs, 8)
    opt = cbopt.Lookahead(cbopt.RAdam(two_groups(ours), LR)) if dst == 'ranger' else cbopt.RAdam(two_groups(ours), LR)
    with pytest.raises(ValueError, match='different algorithm'): opt.load_state_dict(ref.state_dict())
    assert not any(opt.state.values())  # a failed load leaves the optimizer as it was
