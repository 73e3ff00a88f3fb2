"""Other optimizers' formats (`cbopt/state/formats.py`, `cbopt/state/torch_format.py`): torch.optim's and fastai's
state_dicts load with their names converted, and `state_dict(format=<torch class>)` writes what that class saves."""
from __future__ import annotations

import copy
import inspect

import pytest
import torch
from fastai.optimizer import Adam as FastaiAdam
from torch import nn

import cbopt
from cbopt.core.flags import split_flags
from cbopt.state import named_state_dict, read_checkpoint
from cbopt.state.formats import torch_hypers, torch_state
from conftest import (make_model, random_grads, state_snapshot, assert_same_snapshot, small_model, seeded_grads,
                      small_adam, assert_load_rejected, MODEL_NAMES, ADAM_KEYS, equal_values)


# -- torch.optim's format -----------------------------------------------------------------------------------------
def torch_adam(steps: int = 2, **kw) -> tuple[torch.optim.Optimizer, nn.Module]:
    m = small_model()
    t = torch.optim.Adam(m.parameters(), **kw)
    for i in range(steps):
        seeded_grads(list(m.parameters()), i)
        t.step()
    return t, m


# -- fastai's format ----------------------------------------------------------------------------------------------
def fastai_sd(opt) -> dict:
    "`opt`'s state as fastai's Optimizer.state_dict lays it out: state by position, one hypers dict per group."
    return {'state': [dict(opt.state.get(p, {})) for p in opt.params], 'hypers': [dict(h) for h in opt.hypers]}


# -- what torch.optim's own classes save (`state_dict(format=cls)`, cbopt.optim's default) ------------------------------
def torch_twins():
    """(name, arguments) of the torch.optim classes cbopt.optim has: their defaults, then a decaying, maximizing config
    (where the class takes those), each in the implementations the class takes (torch's `foreach`, `fused` on CPU:
    cbopt's backend)."""
    for name in cbopt.optim.__all__:
        if not hasattr(torch.optim, name): continue
        takes = inspect.signature(getattr(torch.optim, name)).parameters
        impls = [{}, *([dict(foreach=False), dict(foreach=True)] if 'foreach' in takes else []),
                 *([dict(fused=True)] if name in ('Adam', 'AdamW', 'SGD', 'Adagrad') else [])]  # torch's CPU kernels
        other = {k: v for k, v in dict(lr=0.01, weight_decay=0.1, maximize=True).items() if k in takes}
        for config in ({}, other):
            for impl in impls: yield name, {**config, **impl}


# -- other libraries' state_dicts (numerics are tested in the parity tests) ---------------------------------------
@pytest.mark.parametrize('named', [False, True], ids=['ids', 'ids+param_names'])
def test_load_torch_adamw(named):
    tm = make_model(0)
    topt = torch.optim.AdamW(tm.named_parameters() if named else tm.parameters(), lr=0.02, betas=(0.8, 0.95),
                             weight_decay=0.1, eps=1e-6)
    for i in range(3):
        random_grads(list(tm.parameters()), i)
        topt.step()
    sd = topt.state_dict()
    assert ('param_names' in sd['param_groups'][0]) == named and list(sd['state']) == [0, 1, 2, 3]
    opt = cbopt.Adam(make_model(1).named_parameters())
    opt.load_state_dict(sd)
    assert opt.param_names == MODEL_NAMES
    for p, tp in zip(opt.params, tm.parameters()):
        assert set(opt.state[p]) == ADAM_KEYS and opt.state[p]['step'] == 3
        torch.testing.assert_close(opt.state[p]['grad_avg'], topt.state[tp]['exp_avg'], rtol=0, atol=0)
        torch.testing.assert_close(opt.state[p]['sqr_avg'], topt.state[tp]['exp_avg_sq'], rtol=0, atol=0)
    h = opt.hypers[0]
    assert (h['lr'], h['mom'], h['sqr_mom'], h['wd'], h['eps']) == (0.02, 0.8, 0.95, 0.1, 1e-6)
    assert opt.named_state_dict()['param_groups'][0]['params'] == MODEL_NAMES


def test_torch_param_names_must_match():
    tm = nn.Sequential(make_model(0))  # names '0.0.weight', ... do not match ours
    topt = torch.optim.AdamW(tm.named_parameters())
    random_grads(list(tm.parameters()), 0)
    topt.step()
    opt = cbopt.Adam(make_model(1).named_parameters())
    before = state_snapshot(opt)
    with pytest.raises(KeyError, match="unknown param '0.0.weight'.*'0.weight'"): opt.load_state_dict(topt.state_dict())
    assert_same_snapshot(state_snapshot(opt), before)


def test_load_fastai_optimizer():
    fm = make_model(0)
    fopt = FastaiAdam(list(fm.parameters()), lr=0.02, wd=0.1)
    for i in range(3):
        random_grads(list(fm.parameters()), i)
        fopt.step()
    opt = cbopt.Adam(make_model(1).named_parameters(), lr=0.5)
    opt.load_state_dict(fopt.state_dict())
    for p, fp in zip(opt.params, fm.parameters()):
        assert set(opt.state[p]) == ADAM_KEYS and opt.state[p]['step'] == 3
        torch.testing.assert_close(opt.state[p]['grad_avg'], fopt.state[fp]['grad_avg'], rtol=0, atol=0)
    assert opt.hypers[0]['lr'] == 0.02 and opt.hypers[0]['wd'] == 0.1
    assert list(opt.named_state_dict()['state']) == MODEL_NAMES


def test_a_checkpoint_without_any_whole_model_entry_is_rejected_and_torchs_keeps_ours() -> None:
    """cbopt's own checkpoint must hold every whole-model entry of this optimizer's chain (one with none of them,
    hand-edited or of another chain, is refused naming the first missing); torch.optim's and fastai's formats have no
    such entries, so a load from them keeps this optimizer's (the skipped-step counts here)."""
    def skipping() -> tuple[cbopt.Optimizer, nn.Module]:
        m = small_model()
        opt = cbopt.SkipNonFinite(cbopt.Adam(list(m.named_parameters()), lr=0.01, wd=0))
        for i, bad in enumerate((False, True)):
            seeded_grads(opt.params, i)
            if bad: opt.params[0].grad[0, 0] = float('inf')
            opt.step()
        return opt, m
    opt, _ = skipping()
    none = opt.named_state_dict()
    for k in [k for k in none['param_groups'][0] if k.startswith('skip_nonfinite.')]: del none['param_groups'][0][k]
    assert_load_rejected(opt, none, KeyError, "whole-model callback state 'skip_nonfinite.skipped_total' (group 0) is missing "
                                 "from the state_dict")
    t, m = torch_adam(lr=0.01)
    opt.load_state_dict(t.state_dict())
    assert opt.param_groups[0]['skip_nonfinite.skipped_total'] == opt.param_groups[0]['skip_nonfinite.skipped_consecutive'] == 1
    for p, q in zip(opt.params, m.parameters()): assert torch.equal(opt.state[p]['grad_avg'], t.state[q]['exp_avg'])
    opt.load_state_dict(fastai_sd(skipping()[0]) | {'hypers': [dict(h) for h in opt.hypers]})
    assert opt.param_groups[0]['skip_nonfinite.skipped_total'] == 1


def test_torch_state_dict_is_renamed() -> None:
    "torch's ids become FQNs, exp_avg/exp_avg_sq become grad_avg/sqr_avg, betas mom/sqr_mom, a tensor step an int."
    t, m = torch_adam(lr=0.02, betas=(0.8, 0.95), weight_decay=0.1, eps=1e-6, decoupled_weight_decay=True)  # AdamW's
    opt = small_adam(steps=0)
    ck = read_checkpoint(t.state_dict())
    assert ck.origin == 'torch' and [s.name for s in ck.params] == [None] * 4
    assert torch_hypers(0, ck.groups[0], opt.param_groups[0]['cbs']) == {'lr': 0.02, 'mom': 0.8, 'sqr_mom': 0.95,
                                                                         'wd': 0.1, 'eps': 1e-6}
    st = torch_state(ck.params[2].state, opt.param_groups[0]['cbs'])
    assert set(st) == {'grad_avg', 'sqr_avg', 'step'} and st['step'] == 2 and type(st['step']) is int
    assert torch.equal(st['grad_avg'], t.state[m[1].weight]['exp_avg'])
    assert torch.equal(st['sqr_avg'], t.state[m[1].weight]['exp_avg_sq'])


def test_torch_rmsprop_state_dict_loads() -> None:
    "torch counts RMSprop's steps, which cbopt's RMSProp does not keep: the extra `step` is dropped, not an error."
    m = small_model()
    t = torch.optim.RMSprop(m.parameters(), lr=0.01, alpha=0.9, eps=1e-8)
    seeded_grads(list(m.parameters()), 0)
    t.step()
    opt = cbopt.RMSProp(small_model().named_parameters(), lr=0.5, sqr_mom=0.5)
    opt.load_state_dict(t.state_dict())
    assert opt.hypers[0]['sqr_mom'] == 0.9 and opt.hypers[0]['lr'] == 0.01
    for p, q in zip(opt.params, m.parameters()):
        assert set(split_flags(opt.state[p])[0]) == {'sqr_avg'}
        assert torch.equal(opt.state[p]['sqr_avg'], t.state[q]['square_avg'])


def test_torch_state_dict_errors() -> None:
    t, _ = torch_adam()
    opt = small_adam(groups=True)
    assert_load_rejected(opt, t.state_dict(), ValueError, "the torch state_dict has 1 param groups, this optimizer 2 (its params "
                                             "have no names to match them by, so they are matched by position, in the same groups)")
    opt = small_adam()
    sd = t.state_dict()
    sd['param_groups'][0]['params'] = [0, 1, 2]
    assert_load_rejected(opt, sd, ValueError, "param group 0 has 3 params in the torch state_dict, 4 here (its params have no "
                                 "names to match them by, so they are matched by position)")
    sd = t.state_dict()
    sd['state'][7] = sd['state'].pop(3)
    assert_load_rejected(opt, sd, KeyError, "unknown param 7 in the state_dict's state: no group of the state_dict lists it")


def test_torch_state_with_param_names() -> None:
    """torch's `param_names` must be a named optimizer's (matched by name); a positional (unnamed) optimizer takes
    the ids in order whatever their names."""
    m = small_model()
    t = torch.optim.Adam(m.named_parameters())
    seeded_grads(list(m.parameters()), 0)
    t.step()
    sd = t.state_dict()
    sd['param_groups'][0]['param_names'] = ['a', 'b', 'c', 'd']
    opt = small_adam(steps=0)
    assert_load_rejected(opt, sd, KeyError, "unknown param 'a' in the state_dict: this optimizer has no such param (it has "
                               "'0.weight', '0.bias', '1.weight', '1.bias')")
    plain = cbopt.Adam(small_model().parameters())
    plain.load_state_dict(sd)
    assert all(plain.state[p]['step'] == 1 for p in plain.params)


def test_torch_groups_are_read_with_the_chain_their_params_load_into() -> None:
    """A torch.optim checkpoint grouped otherwise: each torch group's flags are checked against the chain of the group
    its params land in here (not the group at its index), an empty torch group against the last group, and a flag
    that differs names the torch group."""
    m = small_model()
    named = list(m.named_parameters())
    t = torch.optim.SGD([{'params': named[:2], 'maximize': True}, {'params': named[2:]}], lr=0.1, momentum=0.9)
    t.add_param_group({'params': [], 'param_names': [], 'lr': 0.3, 'maximize': True})  # torch keeps an empty group
    for i in range(2):
        seeded_grads(list(m.parameters()), i)
        t.step()
    maximizing = cbopt.SGD([torch.zeros(1, requires_grad=True)], mom=0.9, maximize=True).cbs
    ours = dict(small_model().named_parameters())
    opt = cbopt.SGD([{'params': [(n, ours[n]) for n, _ in named[2:]]},
                     {'params': [(n, ours[n]) for n, _ in named[:2]], 'cbs': maximizing}], lr=0.5, mom=0.9)
    opt.load_state_dict(t.state_dict())
    assert [h['lr'] for h in opt.hypers] == [0.1, 0.1]
    with torch.no_grad():
        for n, p in named: ours[n].copy_(p)
    for i in range(2, 5):  # each param goes on as in torch, the maximized ones too
        seeded_grads(list(m.parameters()), i)
        t.step()
        for (n, p) in named: ours[n].grad = p.grad.clone()
        opt.step()
    for n, p in named: torch.testing.assert_close(ours[n], p, rtol=1e-6, atol=0)
    sd = t.state_dict()
    sd['param_groups'][1]['maximize'] = True
    assert_load_rejected(cbopt.SGD(small_model().named_parameters(), lr=0.1, mom=0.9), sd, ValueError,
            "param group 0 of the torch.optim state_dict has maximize=True, but this optimizer's chain [weight_decay,average_grad,momentum_step] "
            "runs as maximize=False: build it with maximize=True")


def test_torch_state_and_hypers_read_one_entry_at_a_time() -> None:
    """torch's step (a float tensor, or a plain number) becomes an int; a None entry is skipped, not the rest after it;
    a callback's own torch state names win over the common table (RMSprop's `momentum_buffer` is its `mom_buf`, SGD's
    is `grad_avg`); a whole-model entry (a '.' in its name) is kept as it is; a torch tuple hyper of another length
    than its names is refused."""
    m = small_model()
    t = torch.optim.RMSprop(m.parameters(), lr=0.01, momentum=0.9, centered=True)
    seeded_grads(list(m.parameters()), 0)
    t.step()
    rms = cbopt.optim.RMSprop(small_model().parameters(), lr=0.01, momentum=0.9, centered=True)
    rms.load_state_dict(t.state_dict())
    for p, q in zip(rms.params, m.parameters()):
        assert torch.equal(rms.state[p]['mom_buf'], t.state[q]['momentum_buffer'])
        assert torch.equal(rms.state[p]['grad_avg'], t.state[q]['grad_avg'])
    sgd = cbopt.SGD(small_model().parameters(), mom=0.9).param_groups[0]['cbs']
    buf = torch.ones(2)
    assert torch_state({'exp_avg': None, 'momentum_buffer': buf, 'step': torch.tensor(3.)}, sgd) == \
        {'grad_avg': buf, 'step': 3}
    assert torch_state({'step': 4.0}, sgd) == {'step': 4} and type(torch_state({'step': 4.0}, sgd)['step']) is int
    cbs = small_adam(steps=0).param_groups[0]['cbs']
    assert torch_hypers(0, {'lr': 0.1, 'skip_nonfinite.skipped_total': 2, 'betas': (0.8, 0.9)}, cbs) == \
        {'lr': 0.1, 'skip_nonfinite.skipped_total': 2, 'mom': 0.8, 'sqr_mom': 0.9}
    with pytest.raises(ValueError, match=r'betas \(torch.optim group 0\) must be a sequence of 2 values \(mom, sqr_mom\)'):
        torch_hypers(0, {'betas': (0.8, 0.9, 0.99)}, cbs)


def test_torch_none_state_is_skipped() -> None:
    "torch saves some optional state as None (e.g. a momentum buffer before its first step): nothing to load."
    m = small_model()
    t = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    seeded_grads(list(m.parameters()), 0)
    t.step()
    sd = t.state_dict()
    sd['state'][3]['momentum_buffer'] = None
    opt = cbopt.SGD(small_model().named_parameters(), lr=0.1, mom=0.9)
    ck = read_checkpoint(sd)
    cbs = opt.param_groups[0]['cbs']
    assert torch_state(ck.params[3].state, cbs) == {} and set(torch_state(ck.params[0].state, cbs)) == {'grad_avg'}
    opt.load_state_dict(sd)
    assert split_flags(opt.state[opt.params[3]])[0] == {}


def test_fastai_state_dict_errors() -> None:
    opt = small_adam(groups=True)
    sd = fastai_sd(opt)
    assert read_checkpoint(sd).origin == 'fastai'
    assert_load_rejected(opt, {**sd, 'hypers': sd['hypers'][:1]}, ValueError, "the fastai state_dict has 1 param groups, this "
            "optimizer 2 (its params have no names to match them by, so they are matched by position, in the same groups)")
    assert_load_rejected(opt, {**sd, 'state': sd['state'][:3]}, ValueError,
            "the fastai state_dict has state for 3 params, this optimizer has 4")
    assert_load_rejected(opt, {**sd, 'slow_weights': [[torch.zeros(1)]], 'count': 1}, ValueError,
            "the fastai state_dict has slow weights for 1 params, state for 4")


def test_fastai_lookahead_slow_weights_become_slow_p() -> None:
    "fastai's Lookahead keeps one step count and the slow weights per group; each param gets its own `slow_p`, `la_step`."
    m = small_model()
    opt = cbopt.Lookahead(cbopt.SGD(m.named_parameters(), lr=0.1))
    slow = [[torch.full(p.shape, float(i)) for i, p in enumerate(m.parameters())]]
    sd = {'state': [{} for _ in range(4)], 'hypers': [dict(h) for h in opt.hypers], 'slow_weights': slow, 'count': 3}
    ck = read_checkpoint(sd)
    assert ck.origin == 'fastai'
    for i, saved in enumerate(ck.params):
        assert saved.state['la_step'] == 3 and torch.equal(saved.state['slow_p'], slow[0][i])


def test_fastai_lookahead_over_sgd_with_flags_loads_its_slow_weights() -> None:
    """fastai's own Lookahead over its plain SGD, whose states hold only the flags its Learner sets (`do_wd`): every
    param takes its slow weights and fastai's count, and the two step on alike."""
    from fastai.optimizer import SGD as FastaiSGD, Lookahead as FastaiLookahead
    theirs, ours = small_model(), small_model()
    fastai_opt = FastaiLookahead(FastaiSGD(list(theirs.parameters()), lr=0.1, wd=0.1), k=3)
    opt = cbopt.Lookahead(cbopt.SGD(list(ours.named_parameters()), lr=0.1, wd=0.1), k=3)
    for o in (fastai_opt, opt):
        for p in (theirs if o is fastai_opt else ours).parameters(): o.state[p]['do_wd'] = p.ndim > 1
    def run(o, m, steps, start):
        for i in range(start, start + steps):
            seeded_grads(list(m.parameters()), i)
            o.step()
    run(fastai_opt, theirs, 4, 0)
    ours.load_state_dict(theirs.state_dict())
    opt.load_state_dict(fastai_opt.state_dict())
    slow = [w for g in fastai_opt.slow_weights for w in g]
    assert all(torch.equal(opt.state[p]['slow_p'], w) and opt.state[p]['la_step'] == 4 for p, w in zip(opt.params, slow))
    run(fastai_opt, theirs, 4, 4), run(opt, ours, 4, 4)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert (p - q).abs().max() <= 1e-6 * q.abs().max()


def test_a_fastai_style_chain_expects_the_state_its_first_step_makes_for_the_params_flags() -> None:
    """A chain with an undeclared (fastai-style) callback expects, for a param with no state yet, what a first step
    makes for that param's flags (here: a decay average kept for decayed params only), plus the per-param state its
    whole-model callbacks declare (`Accumulate`'s grad sums): its own checkpoint loads into a fresh one, exactly."""
    def decay_avg(p, lr, wd, do_wd=True, decay_avg=None, **kwargs):  # fastai-style: no declarations
        if not do_wd: return None
        avg = p.data.mul(wd) if decay_avg is None else decay_avg.mul(0.9).add(p.data, alpha=0.1 * wd)
        p.data.sub_(avg, alpha=lr)
        return {'decay_avg': avg}
    def make() -> cbopt.Optimizer:
        opt = cbopt.Accumulate(cbopt.Optimizer(list(small_model().named_parameters()), [decay_avg, cbopt.sgd_step], lr=0.1,
                                               wd=0.01), every=1)
        for p in opt.params: opt.state[p]['do_wd'] = p.ndim > 1
        return opt
    src, dst = make(), make()
    for i in range(2):
        seeded_grads(src.params, i)
        src.step()
    assert [sorted(split_flags(src.state[p])[0]) for p in src.params] == \
        [['accumulate_grads.grad_sum', 'decay_avg'], ['accumulate_grads.grad_sum']] * 2
    dst.load_state_dict(src.state_dict())
    for p, q in zip(dst.params, src.params):
        assert dst.state[p].keys() == src.state[q].keys()
        assert all(torch.equal(v, src.state[q][k]) if torch.is_tensor(v) else v == src.state[q][k]
                   for k, v in dst.state[p].items())


@pytest.mark.parametrize('torch_cls', [torch.optim.Adam, torch.optim.AdamW])
def test_a_torch_checkpoint_of_the_other_decay_names_both_decays(torch_cls) -> None:
    """A torch Adam (L2) checkpoint into a decoupled chain, or AdamW's (decoupled) into an L2 one, is refused saying
    how torch's decays, with the chain that does not and what to build instead, whole."""
    w = torch.nn.Parameter(torch.ones(2))
    w.grad = torch.ones(2)
    theirs = torch_cls([w], weight_decay=0.1)
    theirs.step()
    decoupled = torch_cls is torch.optim.AdamW
    ours = cbopt.optim.Adam([w], weight_decay=0.1) if decoupled else cbopt.Adam([w], wd=0.01)
    kind, chain = (("decoupled (AdamW's: the param shrinks by lr * weight_decay)", 'l2_reg') if decoupled else
                   ("by L2 (weight_decay * param added to the grad)", 'weight_decay'))
    with pytest.raises(ValueError) as e: ours.load_state_dict(theirs.state_dict())
    assert str(e.value) == (
        f"param group 0 of the torch.optim state_dict decays the weights {kind}, weight_decay=0.1, but this optimizer's "
        f"chain [{chain},average_grad,average_sqr_grad,step_stat,adam_step] does not: loading it would change what "
        f"weight_decay means. Build the optimizer with decouple_wd={decoupled} (cbopt.optim's class of the same name "
        f"for torch's), or set the group's weight_decay to 0 in the state_dict")


def test_a_torch_class_checkpoint_has_the_group_entries_torchs_class_saves() -> None:
    """cbopt.optim's `state_dict()` (`format=` its torch class) gives each group exactly the entries torch's class
    saves for the same arguments: defaults or not, in each implementation (`foreach`/`fused` from
    cbopt's backend, `None` for `auto`), AdamW's `decoupled_weight_decay=True` (a flag its constructor does not take),
    and `initial_lr` once an LR scheduler is attached."""
    checked = set()
    for name, kwargs in torch_twins():
        groups = []
        for lib in (torch.optim, cbopt.optim):
            ps = [(n, p) for n, p in small_model().named_parameters() if name != 'Muon' or p.ndim == 2]  # (Muon: matrices)
            opt = getattr(lib, name)(ps, **kwargs)
            torch.optim.lr_scheduler.StepLR(opt, step_size=2)
            groups.append(opt.state_dict()['param_groups'])
        theirs, ours = groups
        assert equal_values(ours, theirs), (name, kwargs, ours, theirs)
        checked.add((name, kwargs.get('foreach'), kwargs.get('fused')))
    assert {('Adam', None, True), ('AdamW', True, None), ('SGD', False, None), ('LBFGS', None, None)} <= checked


def test_a_torch_class_checkpoint_holds_the_state_torchs_class_saves() -> None:
    """Its state is torch's, param by param: a param that never had a grad has none (nor do the params after it lose
    theirs), a whole-model callback's per-param state (`Accumulate`'s grad sums) is left out, fastai's `do_wd` flag is
    not written; the numbers are those torch's class has after the same steps."""
    def run(opt, ps, steps=3):
        for i in range(steps):
            seeded_grads(ps[1:], i)  # '0.weight' never gets a grad
            opt.step()
    for name, kw, wrap in (('AdamW', dict(lr=0.01, weight_decay=0.1), lambda o: cbopt.Accumulate(o, every=1)),
                           ('Rprop', dict(lr=0.01), lambda o: o)):  # Rprop: no weight decay, so do_wd says nothing
        theirs, ours = list(small_model().parameters()), list(small_model().parameters())
        torch_opt = getattr(torch.optim, name)(theirs, **kw)
        opt = wrap(getattr(cbopt.optim, name)(ours, **kw))
        for p in ours: opt.state[p]['do_wd'] = name == 'AdamW' or p.ndim > 1  # as fastai's Learner sets it (wd_bn_bias=False)
        run(torch_opt, theirs), run(opt, ours)
        want, got = torch_opt.state_dict()['state'], opt.state_dict(format=getattr(torch.optim, name))['state']
        assert sorted(got) == sorted(want) == [1, 2, 3]
        for i in want:
            assert got[i].keys() == want[i].keys(), (name, i)
            for k, v in want[i].items():
                scale = v.abs().max().clamp(min=1e-12)
                assert (torch.as_tensor(got[i][k], dtype=v.dtype) - v).abs().max() <= 1e-6 * scale, (name, i, k)


def test_do_wd_flags_of_a_chain_without_weight_decay_say_nothing_to_torch() -> None:
    """A chain with no `wd` hyper at all (momentum SGD listed by hand) has nothing to say with fastai's `do_wd=False`:
    its checkpoint for torch's SGD is the one torch's SGD saves after the same steps."""
    theirs, ours = small_model(), small_model()
    torch_opt = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9)
    opt = cbopt.Optimizer(list(ours.named_parameters()), [cbopt.average_grad, cbopt.momentum_step], lr=0.1, mom=0.9)
    assert 'wd' not in opt.hypers[0]
    for p in opt.params: opt.state[p]['do_wd'] = p.ndim > 1  # as fastai's Learner sets it (wd_bn_bias=False)
    for i in range(3):
        seeded_grads(list(theirs.parameters()), i), seeded_grads(opt.params, i)
        torch_opt.step(), opt.step()
    want, got = torch_opt.state_dict(), opt.state_dict(format=torch.optim.SGD)
    assert got['param_groups'][0]['weight_decay'] == want['param_groups'][0]['weight_decay'] == 0
    assert sorted(got['state']) == sorted(want['state']) == [0, 1, 2, 3]
    for i, s in want['state'].items():
        v = s['momentum_buffer']
        assert got['state'][i].keys() == s.keys() and (got['state'][i]['momentum_buffer'] - v).abs().max() <= 1e-6 * v.abs().max()


def test_a_checkpoint_packed_by_torchs_own_state_dict_is_cbopts() -> None:
    """torch.optim.Optimizer's own `state_dict` of a cbopt optimizer (what torch tools that copy its groups make) holds
    each group's live chain (the callbacks, under `chain`; a group's `cbs` is its alias) and cbopt's names: it is read
    as cbopt's, its chain by name (another chain is refused), its groups' entries without `params` and `param_names`,
    and it loads exactly; so does a copy holding the chain under `cbs`."""
    src = small_adam(groups=True, wd=0.1)
    src.set_hyper('lr', 0.02)
    sd = torch.optim.Optimizer.state_dict(src)
    assert all(list(g['chain']) == list(src.cbs) and 'cbs' not in g for g in sd['param_groups'])
    chain = named_state_dict(src)['param_groups'][0]['chain']
    for groups in (sd['param_groups'], [{**{k: v for k, v in g.items() if k != 'chain'}, 'cbs': g['chain']}
                                        for g in sd['param_groups']]):
        ck = read_checkpoint({**sd, 'param_groups': groups})
        assert ck.origin == 'cbopt'
        assert ck.groups == [{**{k: v for k, v in g.items() if k not in ('params', 'param_names', 'cbs')}, 'chain': chain}
                             for g in groups]
    dst = small_adam(steps=1, groups=True)
    dst.load_state_dict(sd)
    assert dst.hypers == src.hypers and [h['lr'] for h in dst.hypers] == [0.02, 0.02]
    for p, q in zip(dst.params, src.params):
        assert dst.state[p].keys() == src.state[q].keys()
        assert all(torch.equal(v, src.state[q][k]) if torch.is_tensor(v) else v == src.state[q][k]
                   for k, v in dst.state[p].items())
    lamb = cbopt.Lamb(list(small_model().named_parameters()), lr=0.01)
    seeded_grads(lamb.params, 0)
    lamb.step()
    assert_load_rejected(lamb, torch.optim.Optimizer.state_dict(src), ValueError,
            f"param '0.weight' (group 0) was saved by the chain [{chain}], but runs "
            f"[{named_state_dict(lamb)['param_groups'][0]['chain']}] here: its state belongs to another algorithm")


def test_lbfgs_history_goes_under_torchs_first_param_past_other_whole_model_callbacks() -> None:
    """With a whole-model callback that torch has no state for (`grad_norm`) before `lbfgs`, torch's LBFGS checkpoint
    still loads its history into the group, and `state_dict(format=torch.optim.LBFGS)` still puts it under the first
    param: each side then steps on as the other (grad_norm changes no grad)."""
    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    x = torch.randn(16, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    def run(m, opt, steps):
        def closure():
            opt.zero_grad()
            loss = m(x).pow(2).mean()
            loss.backward()
            return loss
        for _ in range(steps): opt.step(closure)
    hypers = dict(lr=0.2, max_iter=4, history_size=3)
    ours = lambda m: cbopt.wrappers.whole_model.wrap(cbopt.LBFGS(m.named_parameters(), **hypers), cbopt.grad_norm)
    a, b = mlp(), mlp()
    torch_opt, opt = torch.optim.LBFGS(a.parameters(), **hypers), ours(b)
    run(a, torch_opt, 3)
    run(b, opt, 1)
    b.load_state_dict(a.state_dict())
    opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    history = torch_opt.state[a[0].weight]
    assert len(opt.param_groups[0]['lbfgs.old_dirs']) == len(history['old_dirs']) == 3
    assert opt.param_groups[0]['lbfgs.func_evals'] == history['func_evals']
    c = mlp()
    c.load_state_dict(b.state_dict())
    back = torch.optim.LBFGS(c.parameters(), **hypers)
    back.load_state_dict(opt.state_dict(format=torch.optim.LBFGS))
    assert list(back.state_dict()['state']) == [0]
    run(a, torch_opt, 3), run(b, opt, 3), run(c, back, 3)
    for m in (b, c):
        for p, q in zip(m.parameters(), a.parameters()):
            assert (p - q).abs().max() <= 1e-9 * q.abs().max()


def test_a_hyper_torchs_class_has_no_entry_for_is_rejected_unless_at_its_default() -> None:
    """A hyper the torch class has no entry for is refused, but at its callback's default (a 1-element tensor by its
    value); a scheduler's `initial_lr` is saved as torch's scheduler leaves it, even where a callback reads it."""
    opt = cbopt.optim.RAdam(list(small_model().named_parameters()))  # cbopt.optim's RAdam has fastai's `beta`, default 0
    for beta in (0.0, torch.tensor(0.), torch.tensor([0.])):
        opt.set_hyper('beta', beta)
        assert 'beta' not in opt.state_dict()['param_groups'][0]
    for beta in (0.5, torch.tensor(0.5)):
        opt.set_hyper('beta', beta)
        with pytest.raises(ValueError) as e: opt.state_dict()
        assert str(e.value) == (f"param group 0 (chain [{named_state_dict(opt)['param_groups'][0]['chain']}]) has the "
                                f"hyper beta={beta!r}, which torch.optim.RAdam has no entry for: it would be lost")
    def restarting_sgd(p, lr, initial_lr, **kwargs):  # reads the scheduler's base lr
        p.data.add_(p.grad, alpha=-min(lr, initial_lr))
    sgd = cbopt.Optimizer(list(small_model().named_parameters()), [restarting_sgd], lr=0.1)
    torch.optim.lr_scheduler.StepLR(sgd, step_size=2)
    theirs = torch.optim.SGD(list(small_model().named_parameters()), lr=0.1)
    torch.optim.lr_scheduler.StepLR(theirs, step_size=2)
    assert equal_values(sgd.state_dict(format=torch.optim.SGD)['param_groups'], theirs.state_dict()['param_groups'])


def test_lbfgs_of_one_param_keeps_its_history_under_it() -> None:
    "torch's LBFGS over a single param (Rosenbrock's point) keeps the history under it: so does cbopt's state_dict."
    sds = []
    for make in (torch.optim.LBFGS, cbopt.LBFGS):
        xy = nn.Parameter(torch.tensor([-1.5, 2.0], dtype=torch.float64))
        opt = make([xy], max_iter=3)
        def closure():
            opt.zero_grad()
            loss = (1 - xy[0]) ** 2 + 100 * (xy[1] - xy[0] ** 2) ** 2
            loss.backward()
            return loss
        opt.step(closure)
        sds.append(opt.state_dict() if make is torch.optim.LBFGS else opt.state_dict(format=torch.optim.LBFGS))
    theirs, ours = (sd['state'] for sd in sds)
    assert list(ours) == list(theirs) == [0] and sorted(ours[0]) == sorted(k for k in theirs[0] if k != 'al')
    assert ours[0]['n_iter'] == theirs[0]['n_iter'] and len(ours[0]['old_dirs']) == len(theirs[0]['old_dirs']) > 0


def test_a_torch_class_checkpoint_names_the_backend_that_ran_in_torchs_flags() -> None:
    """torch's `foreach` entry is True for the foreach backend, False for the loop, torch's default (None) otherwise;
    `fused` True for the fused backend only. (One test, no backend in its name: the mutation runs' loop-backend filter
    would leave it out.)"""
    for backend, foreach in (('foreach', True), ('loop', False), ('fused', None)):
        sd = small_adam(steps=0, backend=backend).state_dict(format=torch.optim.Adam)
        assert all(g['foreach'] is foreach for g in sd['param_groups']), backend
        assert all(g['fused'] is (True if backend == 'fused' else None) for g in sd['param_groups']), backend
