"""Loading checkpoints, one rule at a time (issue #14, mutation testing of `cbopt/state/`): each way a state_dict
can be wrong gives its own whole message (what the user reads to fix it) and changes nothing; each conversion a
load makes (torch's tensor step counts, torch's and fastai's names, numbers of another type) gives the value worked
out here. `test_state_dict.py` and `test_resume.py` check that real checkpoints resume exactly."""
from __future__ import annotations

import copy
import inspect
import re
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import cbopt
from cbopt.core.flags import split_flags
from cbopt.core.names import canonical_names
from cbopt.state import named_state_dict, prepare_load, read_checkpoint
from cbopt.state.formats import torch_hypers, torch_state


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))  # 0.weight (2, 3), 0.bias, 1.weight (1, 2), 1.bias


def grads(ps, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in ps: p.grad = torch.randn(p.shape, generator=g)


def adam(steps: int = 2, groups: bool = False, **kw) -> cbopt.Optimizer:
    m = model()
    named = list(m.named_parameters())
    opt = cbopt.Adam([named[:2], named[2:]] if groups else named, lr=0.01, **kw)
    for i in range(steps):
        grads(opt.params, i)
        opt.step()
    return opt


def snapshot(opt) -> tuple:
    return ({n: copy.deepcopy(dict(opt.state[p])) for n, p in zip(opt.param_names, opt.params) if p in opt.state},
            [dict(h) for h in opt.hypers])


def refused(opt, sd, exc, message: str) -> None:
    "Loading `sd` raises `exc` with exactly `message` and leaves `opt` as it was."
    before = snapshot(opt)
    with pytest.raises(exc) as e: opt.load_state_dict(sd)
    got = e.value.args[0] if exc is KeyError else str(e.value)
    assert got == message
    after = snapshot(opt)
    assert after[1] == before[1] and after[0].keys() == before[0].keys()
    for n in before[0]:
        for k, v in before[0][n].items():
            assert torch.equal(v, after[0][n][k]) if torch.is_tensor(v) else v == after[0][n][k]


# -- what a state_dict is -----------------------------------------------------------------------------------------
def test_not_a_state_dict() -> None:
    opt = adam()
    refused(opt, [1, 2], TypeError, "expected a state_dict with a 'state' entry, got list")
    refused(opt, {'param_groups': []}, TypeError, "expected a state_dict with a 'state' entry, got dict")
    refused(opt, {'state': {}}, ValueError, "the state_dict has no 'param_groups'")
    refused(opt, {'state': [{}] * 4}, ValueError, "the state_dict has no 'param_groups'")  # fastai's state, no 'hypers'
    sd = opt.named_state_dict()
    sd['param_groups'][0]['params'][1] = 1.5
    refused(opt, sd, ValueError, "group 0 of the state_dict lists params that are neither names (str) nor torch ids (int)")
    assert read_checkpoint(opt.named_state_dict()).origin == read_checkpoint(opt.state_dict()).origin == 'cbopt'


# -- cbopt's own format -------------------------------------------------------------------------------------------
def test_group_errors() -> None:
    opt = adam(groups=True)
    sd = opt.named_state_dict()
    one = copy.deepcopy(sd)
    one['param_groups'] = one['param_groups'][:1]
    refused(opt, one, KeyError, "param '1.weight' (group 1) is missing from the state_dict")
    positional = copy.deepcopy(opt.state_dict())  # no names: matched by position, in the same groups
    for g in positional['param_groups']: del g['param_names']
    positional['param_groups'] = positional['param_groups'][:1]
    positional['state'] = {k: v for k, v in positional['state'].items() if k < 2}
    refused(opt, positional, ValueError, "the state_dict has 1 param groups, this optimizer 2 (its params have no names "
                                         "to match them by, so they are matched by position, in the same groups)")
    moved = copy.deepcopy(sd)  # another grouping loads by name
    moved['param_groups'][1]['params'].remove('1.bias')
    moved['param_groups'][0]['params'].append('1.bias')
    other = adam(groups=True)
    other.load_state_dict(moved)
    assert all(torch.equal(other.state[p]['sqr_avg'], opt.state[q]['sqr_avg']) for p, q in zip(other.params, opt.params))
    ghost = copy.deepcopy(sd)
    ghost['param_groups'][1]['params'].append('ghost')
    refused(opt, ghost, KeyError, "unknown param 'ghost' in the state_dict: this optimizer has no such param (it has "
                                  "'0.weight', '0.bias', '1.weight', '1.bias')")
    gone = copy.deepcopy(sd)
    gone['param_groups'][1]['params'].remove('1.bias')
    refused(opt, gone, KeyError, "param '1.bias' (group 1) is missing from the state_dict")
    twice = copy.deepcopy(opt.state_dict())
    twice['param_groups'][1]['params'].append(0)
    refused(opt, twice, ValueError, "param 0 is listed twice in the state_dict's groups")
    ghost_state = copy.deepcopy(sd)
    ghost_state['state']['ghost'] = {}
    refused(opt, ghost_state, KeyError, "unknown param 'ghost' in the state_dict's state: no group of the state_dict lists it")


def test_name_errors_name_the_param_and_this_optimizers_first_four() -> None:
    """A name the checkpoint gives twice once wrapper prefixes are removed is refused; an unknown one is named with
    this optimizer's first four names, and '...' when it has more."""
    opt = adam()
    sd = opt.named_state_dict()
    sd['param_groups'][0]['params'][1] = '_orig_mod.0.weight'  # torch.compile's prefix: '0.weight' again
    refused(opt, sd, ValueError, "param '0.weight' appears twice in the state_dict")
    torch.manual_seed(0)
    big = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2), nn.Linear(2, 1, bias=False))  # 5 params: one more than shown
    opt = cbopt.Adam(list(big.named_parameters()), lr=0.01)
    grads(opt.params, 0)
    opt.step()
    sd = opt.named_state_dict()
    sd['param_groups'][0]['params'][4] = 'ghost'
    sd['state']['ghost'] = sd['state'].pop('2.weight')
    refused(opt, sd, KeyError, "unknown param 'ghost' in the state_dict: this optimizer has no such param (it has "
                               "'0.weight', '0.bias', '1.weight', '1.bias', ...)")


def test_a_regrouped_checkpoint_gives_each_group_the_hypers_of_its_params_groups() -> None:
    """Groups in another order and of other sizes than the checkpoint's: each group takes the hypers of the checkpoint
    group its params were in, whatever the order of the entries in the checkpoint's group dicts (a dict's order means
    nothing); a whole-model callback's state (kept in the first group listing it) is neither a hyper nor a
    disagreement to warn of when that group's params come from several checkpoint groups."""
    def opt(groups: list[list[str]], lrs: list[float]) -> cbopt.Optimizer:
        named = dict(model().named_parameters())
        return cbopt.SkipNonFinite(cbopt.Adam([{'params': [(n, named[n]) for n in g], 'lr': lr}
                                               for g, lr in zip(groups, lrs)]))
    src = opt([['0.weight'], ['0.bias', '1.weight'], ['1.bias']], [0.1, 0.2, 0.3])
    for seed, bad in ((0, False), (1, True), (2, False)):  # the step with a NaN grad is skipped and counted
        grads(src.params, seed)
        if bad: src.params[0].grad[0, 0] = float('nan')
        src.step()
    sd = src.named_state_dict()
    assert sd['param_groups'][0]['skip_nonfinite.skipped_total'] == 1
    sd['param_groups'] = [dict(reversed(list(g.items()))) for g in sd['param_groups']]  # 'params' and 'chain' first
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        dst = opt([['1.bias'], ['0.bias', '1.weight'], ['0.weight']], [0.5, 0.6, 0.7])
        dst.load_state_dict(sd)
        assert [h['lr'] for h in dst.hypers] == [0.3, 0.2, 0.1]
        merged = opt([list(dict(model().named_parameters()))], [0.5])  # from checkpoint groups that agree on all hypers
        src.set_hyper('lr', 0.1)
        merged.load_state_dict(src.named_state_dict())
        assert merged.hypers[0]['lr'] == 0.1
    for o in (dst, merged):
        assert o.param_groups[0]['skip_nonfinite.skipped_total'] == 1
    twice = src.named_state_dict()
    twice['param_groups'][1]['skip_nonfinite.skipped_total'] = 0
    refused(dst, twice, ValueError, "whole-model callback state 'skip_nonfinite.skipped_total' is in several groups of "
                                    "the state_dict, which groups its params otherwise than this optimizer: cannot tell "
                                    "whose it is")
    unknown = src.named_state_dict()
    unknown['param_groups'][2]['accumulate_grads.micro_step'] = 1
    refused(dst, unknown, KeyError, "unknown whole-model callback state 'accumulate_grads.micro_step' in the state_dict's "
                                    "any group: this optimizer keeps ['skip_nonfinite.skipped_consecutive', "
                                    "'skip_nonfinite.skipped_total'] there")
    plain = adam(groups=True).named_state_dict()
    plain['param_groups'][0]['accumulate_grads.micro_step'] = 1
    refused(adam(groups=True), plain, KeyError, "unknown whole-model callback state 'accumulate_grads.micro_step' in "
                                                "the state_dict's group 0: this optimizer keeps none there")
    for o in (dst, merged):
        assert all(torch.equal(o.state[o.named_params()[n]]['grad_avg'], src.state[p]['grad_avg'])
                   for n, p in src.named_params().items())


def test_whole_model_state_is_checked_and_converted_entry_by_entry() -> None:
    """A whole-model callback's state in a checkpoint's group: a missing entry and one of another kind are refused by
    name; a count saved as a float or a 1-element tensor loads as the int the callback keeps."""
    def skipping() -> cbopt.Optimizer:
        opt = cbopt.SkipNonFinite(cbopt.Adam(list(model().named_parameters()), lr=0.01))
        for i, bad in enumerate((False, True)):
            grads(opt.params, i)
            if bad: opt.params[0].grad[0, 0] = float('inf')
            opt.step()
        return opt
    src, opt = skipping(), skipping()
    missing = src.named_state_dict()
    del missing['param_groups'][0]['skip_nonfinite.skipped_total']
    refused(opt, missing, KeyError, "whole-model callback state 'skip_nonfinite.skipped_total' (group 0) is missing "
                                    "from the state_dict")
    text = src.named_state_dict()
    text['param_groups'][0]['skip_nonfinite.skipped_total'] = 'one'
    refused(opt, text, TypeError, "whole-model callback state 'skip_nonfinite.skipped_total' (group 0) is a str in the state_dict, "
                                  "a number here")
    for saved in (4.0, torch.tensor(4)):
        sd = src.named_state_dict()
        sd['param_groups'][0]['skip_nonfinite.skipped_total'] = saved
        opt.load_state_dict(sd)
        total = opt.param_groups[0]['skip_nonfinite.skipped_total']
        assert type(total) is int and total == 4, saved


def test_a_checkpoint_without_any_whole_model_entry_is_rejected_and_torchs_keeps_ours() -> None:
    """cbopt's own checkpoint must hold every whole-model entry of this optimizer's chain (one with none of them,
    hand-edited or of another chain, is refused naming the first missing); torch.optim's and fastai's formats have no
    such entries, so a load from them keeps this optimizer's (the skipped-step counts here)."""
    def skipping() -> tuple[cbopt.Optimizer, nn.Module]:
        m = model()
        opt = cbopt.SkipNonFinite(cbopt.Adam(list(m.named_parameters()), lr=0.01, wd=0))
        for i, bad in enumerate((False, True)):
            grads(opt.params, i)
            if bad: opt.params[0].grad[0, 0] = float('inf')
            opt.step()
        return opt, m
    opt, _ = skipping()
    none = opt.named_state_dict()
    for k in [k for k in none['param_groups'][0] if k.startswith('skip_nonfinite.')]: del none['param_groups'][0][k]
    refused(opt, none, KeyError, "whole-model callback state 'skip_nonfinite.skipped_total' (group 0) is missing "
                                 "from the state_dict")
    t, m = torch_adam(lr=0.01)
    opt.load_state_dict(t.state_dict())
    assert opt.param_groups[0]['skip_nonfinite.skipped_total'] == opt.param_groups[0]['skip_nonfinite.skipped_consecutive'] == 1
    for p, q in zip(opt.params, m.parameters()): assert torch.equal(opt.state[p]['grad_avg'], t.state[q]['exp_avg'])
    opt.load_state_dict(fastai_sd(skipping()[0]) | {'hypers': [dict(h) for h in opt.hypers]})
    assert opt.param_groups[0]['skip_nonfinite.skipped_total'] == 1


def last_flat_grads(params, last=None, history=None, **kwargs):
    """A whole-model callback keeping the grads flat over its group's params in their order (`flat_state`, as L-BFGS's
    history): the last ones, and a list of the two before them (None until the second step)."""
    flat = torch.cat([g.flatten() for tl in params for g in tl.grad])
    return {'last': flat, 'history': None if last is None else [*(history or [])[-1:], last]}
last_flat_grads.scope = 'model'
last_flat_grads.state = dict(last=None, history=None)
last_flat_grads.flat_state = ('last', 'history')

FLAT = ('last_flat_grads.last', 'last_flat_grads.history')


def flat_opt(order: list[str], steps: int = 0) -> cbopt.Optimizer:
    """Group 0: the params named in `order`, running `last_flat_grads`; group 1: the rest. Each param gets the grads of
    its name, whatever the order."""
    named = dict(model().named_parameters())
    rest = [(n, p) for n, p in named.items() if n not in order]
    opt = cbopt.Optimizer([{'params': [(n, named[n]) for n in order], 'cbs': [last_flat_grads, cbopt.sgd_step]},
                           *([{'params': rest}] if rest else [])], [cbopt.sgd_step], lr=0.1)
    for i in range(steps):
        grads(named.values(), i)
        opt.step()
    return opt


def test_flat_whole_model_state_loads_in_this_groups_order() -> None:
    """A whole-model entry flat over the group's params (`cb.flat_state`), saved by a group listing them in one order,
    loads into the same group listing them in another (by name) as that group's own run makes it, each param's slice
    moved; the other group is not part of it; an entry not created yet (None) stays None, the others are still
    moved. A fastai-layout checkpoint (by position) carrying them loads them as they are. Before any step the entries
    are None and load as None."""
    orders = (['0.weight', '0.bias', '1.weight'], ['1.weight', '0.weight', '0.bias'], ['0.bias', '1.weight', '0.weight'])
    for steps in (1, 3):  # after one step `history` is None, `last` is not
        saved = flat_opt(orders[0], steps=steps)
        for order in orders:
            want = flat_opt(order, steps=steps).param_groups[0]
            for sd in (saved.state_dict(), saved.named_state_dict()):
                got = flat_opt(order, steps=2)
                got.load_state_dict(sd)
                g = got.param_groups[0]
                assert torch.equal(g[FLAT[0]], want[FLAT[0]]), (steps, order)
                if steps == 1: assert g[FLAT[1]] is None
                else:
                    assert type(g[FLAT[1]]) is list and len(g[FLAT[1]]) == 2
                    assert all(torch.equal(a, b) for a, b in zip(g[FLAT[1]], want[FLAT[1]])), order
                assert all(k not in got.param_groups[1] for k in FLAT)
    # fastai's layout (params by position, no order within a group to undo) carrying them in its hypers: as they are
    fastai = {'state': [{} for _ in saved.params],
              'hypers': [{k: v for k, v in g.items() if k not in ('params', 'param_names', 'cbs', 'chain')}
                         for g in saved.param_groups]}
    same = flat_opt(['0.weight', '0.bias', '1.weight'])
    same.load_state_dict(fastai)
    assert torch.equal(same.param_groups[0][FLAT[0]], saved.param_groups[0][FLAT[0]])
    fresh = flat_opt(['1.weight', '0.weight', '0.bias'])
    fresh.load_state_dict(flat_opt(['0.weight', '0.bias', '1.weight']).state_dict())
    assert fresh.param_groups[0][FLAT[0]] is None and fresh.param_groups[0][FLAT[1]] is None


def test_flat_whole_model_state_of_other_params_is_rejected() -> None:
    """A flat entry of another length than the group's params, one that is not a tensor, or one saved by a group of
    other params (grouped otherwise: it cannot be put in this group's order) is refused naming the entry and group,
    and the load changes nothing."""
    opt = flat_opt(['1.weight', '0.weight', '0.bias'])  # not stepped: a stepped one's own entries are checked first
    sd = flat_opt(['0.weight', '0.bias', '1.weight'], steps=2).named_state_dict()
    short = copy.deepcopy(sd)
    short['param_groups'][0][FLAT[0]] = short['param_groups'][0][FLAT[0]][:-1]
    for o in (opt, flat_opt(['0.weight', '0.bias', '1.weight'])):  # (in the order saved: still checked, the last key too)
        refused(o, short, ValueError, f"whole-model callback state {FLAT[0]!r} (group 0) has shape (9,) in the "
                                      f"state_dict, but this group's params have 10 elements: it is the state of other params")
    numbers = copy.deepcopy(sd)
    numbers['param_groups'][0][FLAT[1]] = [1.0, 2.0]
    refused(opt, numbers, ValueError, f"whole-model callback state {FLAT[1]!r} (group 0) has shape () in the "
                                      f"state_dict, but this group's params have 10 elements: it is the state of other params")
    names = ['0.weight', '0.bias', '1.weight', '1.bias']
    regrouped = flat_opt(names, steps=2).named_state_dict()  # one group, its group split in two by hand:
    g = regrouped['param_groups'][0]                            # the entries stay in the first, flat over all four
    regrouped['param_groups'] = [{**g, 'params': names[:2]}, {k: v for k, v in g.items() if k not in FLAT} | {'params': names[2:]}]
    refused(flat_opt(names[::-1]), regrouped, ValueError,
            f"whole-model callback state {FLAT[1]!r} (group 0) is flat over the params of the state_dict's group 0, which "
            f"are not this group's: it cannot be put in their order")
    # first of one checkpoint group, then of another, at positions 0 and 1 of theirs: still other params than its own
    mixed = flat_opt(['0.bias', '1.weight'], steps=2).named_state_dict()  # its flat entries: of the right length
    entries = {k: mixed['param_groups'][0][k] for k in FLAT}
    mixed['param_groups'] = [{'lr': 0.1, 'params': names[:2], **entries}, {'lr': 0.1, 'params': names[2:]}]  # no chains
    refused(flat_opt(['0.bias', '1.weight']), mixed, ValueError,
            f"whole-model callback state {FLAT[1]!r} (group 0) is flat over the params of the state_dict's group 0, which "
            f"are not this group's: it cannot be put in their order")


def test_flat_whole_model_state_in_several_groups_is_rejected_before_anything_changes() -> None:
    """A callback with state flat over its group's params (`flat_state`) listed by two groups would keep one vector over
    both groups' params in the first's entries, which no checkpoint could load back (whose params, in what order):
    refused, naming the callback and the groups, when the optimizer is made, when a group listing it is added (the
    optimizer unchanged), and at the step when a shared chain gets it later (fastai-style), before anything changes."""
    named = list(model().named_parameters())
    flat_chain = [last_flat_grads, cbopt.sgd_step]
    message = ("last_flat_grads keeps state flat over its group's params (last, history), but param groups [0, 1] list "
               "it: give it one group (its own chain in a group dict), or make one group of those params")
    with pytest.raises(ValueError) as e: cbopt.Optimizer([named[:2], named[2:]], flat_chain, lr=0.1)
    assert str(e.value) == message
    opt = cbopt.Optimizer([{'params': named[:2], 'cbs': flat_chain}], [cbopt.sgd_step], lr=0.1)
    with pytest.raises(ValueError) as e: opt.add_param_group({'params': named[2:], 'cbs': flat_chain})
    assert str(e.value) == message
    assert len(opt.param_groups) == 1 and len(opt.params) == 2
    opt.add_param_group({'params': named[2:]})  # the optimizer's own chain: allowed, and both groups step
    shared = cbopt.Optimizer([named[:2], named[2:]], [cbopt.sgd_step], lr=0.1)
    grads([p for _, p in named], 0)
    shared.cbs.insert(0, last_flat_grads)  # (fastai's way of adding a callback: every group without its own chain)
    before = [p.detach().clone() for _, p in named]
    with pytest.raises(ValueError) as e: shared.step()
    assert str(e.value) == message
    assert all(torch.equal(p, b) for (_, p), b in zip(named, before)) and not any(shared.state[p] for _, p in named)
    shared.cbs.pop(0)
    shared.step()
    assert not any(torch.equal(p, b) for (_, p), b in zip(named, before))


def test_canonical_names_drop_wrapper_prefixes() -> None:
    """torch.compile's and the checkpoint wrappers' prefixes go wherever they are; DDP's `module.` only when it starts
    every name, and never leaving a name empty."""
    assert canonical_names(['module._orig_mod.0.weight', 'module.0._checkpoint_wrapped_module.bias']) == ['0.weight', '0.bias']
    assert canonical_names(['module.weight', 'head.weight']) == ['module.weight', 'head.weight']
    assert canonical_names(['module.', 'module.weight']) == ['module.', 'module.weight']
    assert canonical_names([]) == []


def test_another_chain_is_rejected_per_group() -> None:
    opt = adam(groups=True)
    sd = cbopt.SGD(model().named_parameters(), lr=0.1, mom=0.9).named_state_dict()
    sd['param_groups'] = [{**sd['param_groups'][0], 'params': ['0.weight', '0.bias']},
                          {**sd['param_groups'][0], 'params': ['1.weight', '1.bias']}]
    chain = opt.named_state_dict()['param_groups'][0]['chain']
    theirs = sd['param_groups'][0]['chain']
    refused(opt, sd, ValueError, f"param group 0 ('0.weight', '0.bias') was saved by the chain [{theirs}], but runs "
                                 f"[{chain}] here: its state belongs to another algorithm")
    del sd['param_groups'][0]['chain'], sd['param_groups'][1]['chain']  # no chain named: the state keys tell
    sd['state'] = {'0.weight': {'grad_avg': torch.zeros(2, 3)}}
    refused(opt, sd, ValueError, "param '0.weight' has state keys ['grad_avg'] in the state_dict but "
                                 "['grad_avg', 'sqr_avg', 'step'] here: it was saved by a different algorithm")


def test_state_value_errors() -> None:
    opt = adam()
    sd = opt.named_state_dict()
    cases = [
        ('sqr_avg', [1.], TypeError, "state 'sqr_avg' of param '1.bias' is a list in the state_dict, a Tensor here"),
        ('sqr_avg', torch.zeros(2), ValueError, "state 'sqr_avg' of param '1.bias' has shape (2,) in the state_dict, (1,) here"),
        ('sqr_avg', torch.zeros(1, dtype=torch.int32), TypeError,
         "state 'sqr_avg' of param '1.bias' has dtype torch.int32 in the state_dict, torch.float32 here"),
        ('sqr_avg', torch.zeros(1, dtype=torch.complex64), TypeError,
         "state 'sqr_avg' of param '1.bias' has dtype torch.complex64 in the state_dict, torch.float32 here"),
        ('sqr_avg', 0.5, TypeError, "state 'sqr_avg' of param '1.bias' is a float in the state_dict, a Tensor here"),
        ('step', 'two', TypeError, "state 'step' of param '1.bias' is a str in the state_dict, a number here"),
        ('step', torch.ones(2), TypeError, "state 'step' of param '1.bias' is a Tensor in the state_dict, a number here"),
    ]
    for key, value, exc, message in cases:
        bad = copy.deepcopy(sd)
        bad['state']['1.bias'][key] = value
        refused(opt, bad, exc, message)


def test_a_number_saved_for_a_0d_tensor_state_loads_as_that_tensor() -> None:
    """Schedule-free's running sums are 0-d float64 tensors (older checkpoints saved Python floats): a number loads as
    such a tensor, of this optimizer's dtype; a bool is no number there. A 1-element state of another shape takes no
    number (`sqr_avg` of a (1,) bias in test_state_value_errors)."""
    def schedule_free() -> cbopt.Optimizer:
        opt = cbopt.ScheduleFreeSGD(list(model().named_parameters()), lr=0.1)
        opt.train()
        for i in range(2):
            grads(opt.params, i)
            opt.step()
        return opt
    src, opt = schedule_free(), schedule_free()
    sd = src.named_state_dict()
    sums = {n: s['weight_sum'].item() for n, s in sd['state'].items()}
    for s, v in zip(sd['state'].values(), sums.values()): s['weight_sum'] = v
    flagged = copy.deepcopy(sd)
    flagged['state']['0.bias']['weight_sum'] = True
    refused(opt, flagged, TypeError, "state 'weight_sum' of param '0.bias' is a bool in the state_dict, a Tensor here")
    opt.load_state_dict(sd)
    for n, p in opt.named_params().items():
        got = opt.state[p]['weight_sum']
        assert torch.is_tensor(got) and got.shape == () and got.dtype == torch.float64 and got.item() == sums[n]


def test_a_regrouped_checkpoint_is_checked_param_by_param_against_its_chains() -> None:
    """A checkpoint grouped otherwise, whose groups ran different chains: each param is checked against the chain
    its own checkpoint group ran, and the first saved by another chain than its group's here is named."""
    sd = adam(groups=True).named_state_dict()
    sd['param_groups'][1]['chain'] = cbopt.Lamb(list(model().named_parameters())).named_state_dict()['param_groups'][0]['chain']
    opt = adam()  # one group of the four params: '1.weight' and '1.bias' come from the Lamb group
    refused(opt, sd, ValueError, f"param '1.weight' (group 0) was saved by the chain [{sd['param_groups'][1]['chain']}], "
                                 f"but runs [{sd['param_groups'][0]['chain']}] here: its state belongs to another algorithm")


def test_a_transposed_state_of_as_many_elements_is_rejected() -> None:
    opt = adam()
    sd = opt.named_state_dict()
    sd['state']['0.weight']['grad_avg'] = sd['state']['0.weight']['grad_avg'].t().contiguous()
    refused(opt, sd, ValueError, "state 'grad_avg' of param '0.weight' has shape (3, 2) in the state_dict, (2, 3) here")


def test_numbers_load_as_the_type_the_optimizer_keeps() -> None:
    "A step count saved as a float, a 1-element tensor or a numpy number loads as the int this optimizer keeps."
    src = adam(steps=3)
    for saved in (3.0, torch.tensor(3.), torch.tensor([3]), np.int64(3)):
        sd = src.named_state_dict()
        for s in sd['state'].values(): s['step'] = saved
        opt = adam(steps=1)
        opt.load_state_dict(sd)
        assert all(type(opt.state[p]['step']) is int and opt.state[p]['step'] == 3 for p in opt.params), saved


def test_loaded_tensors_take_the_params_dtype_and_are_copies() -> None:
    src = adam()
    sd = src.named_state_dict()
    sd['state']['0.weight']['grad_avg'] = sd['state']['0.weight']['grad_avg'].double()
    opt = adam(steps=0)
    opt.load_state_dict(sd)
    got = opt.state[opt.params[0]]['grad_avg']
    assert got.dtype == torch.float32 and torch.equal(got, sd['state']['0.weight']['grad_avg'].float())
    sd['state']['0.weight']['grad_avg'].add_(1)          # the checkpoint changes after the load: the optimizer does not
    assert torch.equal(got, src.state[src.params[0]]['grad_avg'])


def test_missing_state_restarts_only_by_choice() -> None:
    """A param with state here and none in the checkpoint is an error naming it, even in a checkpoint of a fresh
    optimizer (no state at all, as fastai's lr_find saves); after `clear_state()` (the choice) it loads."""
    opt = adam()
    sd = opt.named_state_dict()
    del sd['state']['1.bias']
    refused(opt, sd, ValueError, "the state_dict has no state for param '1.bias', which has state here "
                                 "(['grad_avg', 'sqr_avg', 'step']): loading it would silently restart '1.bias'; "
                                 "call clear_state() first")
    fresh = adam(steps=0).named_state_dict()
    with pytest.raises(ValueError, match=r"^the state_dict has no state for param '0\.weight'"): prepare_load(opt, fresh)
    opt.clear_state()
    state, hypers = prepare_load(opt, fresh)
    assert all(s == {} for s in state.values()) and len(state) == 4 and hypers[0]['lr'] == 0.01


def test_state_for_a_param_that_keeps_none() -> None:
    opt = cbopt.SGD(model().named_parameters(), lr=0.1)  # plain SGD: no state
    sd = opt.named_state_dict()
    sd['state']['1.bias'] = {'grad_avg': torch.zeros(1)}
    refused(opt, sd, ValueError, "the state_dict has state ['grad_avg'] for param '1.bias', but this optimizer keeps "
                                 "no state for it")


def test_hypers_of_a_checkpoint_are_checked_initial_lr_too() -> None:
    """Every hyper of a checkpoint's groups is checked as construction checks it: a NaN lr is refused; the
    `initial_lr` torch's LR schedulers add is a hyper no callback has a rule for, so only its type is checked (a number
    loads as it is, a list is refused as it would be by `set_hyper`)."""
    opt = adam()
    sd = opt.named_state_dict()
    sd['param_groups'][0]['lr'] = float('nan')
    refused(opt, sd, ValueError, "Invalid learning rate: nan (group 0) (expected lr >= 0, finite)")
    sd['param_groups'][0]['lr'] = 0.5
    sd['param_groups'][0]['initial_lr'] = [0.25]
    refused(opt, sd, TypeError, "hyper 'initial_lr' (group 0) got a list: hypers are numbers (or 0-d tensors)")
    with pytest.raises(TypeError, match=re.escape("hyper 'initial_lr' got a list")): opt.set_hyper('initial_lr', [[0.25]])
    sd['param_groups'][0]['initial_lr'] = 0.25  # what torch's LR schedulers add: loaded as it is
    opt.load_state_dict(sd)
    assert opt.param_groups[0]['lr'] == 0.5 and opt.param_groups[0]['initial_lr'] == 0.25


def test_flags_stay_the_receiving_optimizers() -> None:
    "do_wd and force_train are the model's (fastai's Learner sets them): a load keeps this optimizer's."
    src, opt = adam(), adam()
    src.state[src.params[1]]['do_wd'] = False
    opt.state[opt.params[2]]['force_train'] = True
    opt.load_state_dict(src.named_state_dict())
    assert 'do_wd' not in opt.state[opt.params[1]] and opt.state[opt.params[2]]['force_train'] is True
    assert split_flags({'do_wd': False, 'step': 3, 'force_train': True}) == ({'step': 3}, {'do_wd': False, 'force_train': True})


def test_named_state_dict_is_a_plain_snapshot() -> None:
    opt = adam()
    opt.param_groups[0]['lr'] = np.float32(0.5)
    opt.state[opt.params[0]]['step'] = np.int64(2)
    opt.state[opt.params[1]]['step'] = torch.tensor(2.)  # a step count as a step traced by torch.compile leaves it
    sd = named_state_dict(opt)
    assert type(sd['param_groups'][0]['lr']) is float
    assert [(type(sd['state'][n]['step']), sd['state'][n]['step']) for n in ('0.weight', '0.bias')] == [(int, 2)] * 2
    assert sd['param_groups'][0]['params'] == ['0.weight', '0.bias', '1.weight', '1.bias']
    assert set(sd['param_groups'][0]) == {'lr', 'mom', 'sqr_mom', 'eps', 'wd', 'chain', 'params'}
    t = sd['state']['0.weight']['grad_avg']
    assert t is not opt.state[opt.params[0]]['grad_avg'] and torch.equal(t, opt.state[opt.params[0]]['grad_avg'])
    fresh = adam(steps=0)
    assert named_state_dict(fresh)['state'] == {}


# -- torch.optim's format -----------------------------------------------------------------------------------------
def torch_adam(steps: int = 2, **kw) -> tuple[torch.optim.Optimizer, nn.Module]:
    m = model()
    t = torch.optim.Adam(m.parameters(), **kw)
    for i in range(steps):
        grads(list(m.parameters()), i)
        t.step()
    return t, m


def test_torch_state_dict_is_renamed() -> None:
    "torch's ids become FQNs, exp_avg/exp_avg_sq become grad_avg/sqr_avg, betas mom/sqr_mom, a tensor step an int."
    t, m = torch_adam(lr=0.02, betas=(0.8, 0.95), weight_decay=0.1, eps=1e-6, decoupled_weight_decay=True)  # AdamW's
    opt = adam(steps=0)
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
    m = model()
    t = torch.optim.RMSprop(m.parameters(), lr=0.01, alpha=0.9, eps=1e-8)
    grads(list(m.parameters()), 0)
    t.step()
    opt = cbopt.RMSProp(model().named_parameters(), lr=0.5, sqr_mom=0.5)
    opt.load_state_dict(t.state_dict())
    assert opt.hypers[0]['sqr_mom'] == 0.9 and opt.hypers[0]['lr'] == 0.01
    for p, q in zip(opt.params, m.parameters()):
        assert set(split_flags(opt.state[p])[0]) == {'sqr_avg'}
        assert torch.equal(opt.state[p]['sqr_avg'], t.state[q]['square_avg'])


def test_torch_state_dict_errors() -> None:
    t, _ = torch_adam()
    opt = adam(groups=True)
    refused(opt, t.state_dict(), ValueError, "the torch state_dict has 1 param groups, this optimizer 2 (its params "
                                             "have no names to match them by, so they are matched by position, in the same groups)")
    opt = adam()
    sd = t.state_dict()
    sd['param_groups'][0]['params'] = [0, 1, 2]
    refused(opt, sd, ValueError, "param group 0 has 3 params in the torch state_dict, 4 here (its params have no "
                                 "names to match them by, so they are matched by position)")
    sd = t.state_dict()
    sd['state'][7] = sd['state'].pop(3)
    refused(opt, sd, KeyError, "unknown param 7 in the state_dict's state: no group of the state_dict lists it")


def test_torch_state_with_param_names() -> None:
    """torch's `param_names` must be a named optimizer's (matched by name); a positional (unnamed) optimizer takes
    the ids in order whatever their names."""
    m = model()
    t = torch.optim.Adam(m.named_parameters())
    grads(list(m.parameters()), 0)
    t.step()
    sd = t.state_dict()
    sd['param_groups'][0]['param_names'] = ['a', 'b', 'c', 'd']
    opt = adam(steps=0)
    refused(opt, sd, KeyError, "unknown param 'a' in the state_dict: this optimizer has no such param (it has "
                               "'0.weight', '0.bias', '1.weight', '1.bias')")
    plain = cbopt.Adam(model().parameters())
    plain.load_state_dict(sd)
    assert all(plain.state[p]['step'] == 1 for p in plain.params)


def test_torch_groups_are_read_with_the_chain_their_params_load_into() -> None:
    """A torch.optim checkpoint grouped otherwise: each torch group's flags are checked against the chain of the group
    its params land in here (not the group at its index), an empty torch group against the last group, and a flag
    that differs names the torch group."""
    m = model()
    named = list(m.named_parameters())
    t = torch.optim.SGD([{'params': named[:2], 'maximize': True}, {'params': named[2:]}], lr=0.1, momentum=0.9)
    t.add_param_group({'params': [], 'param_names': [], 'lr': 0.3, 'maximize': True})  # torch keeps an empty group
    for i in range(2):
        grads(list(m.parameters()), i)
        t.step()
    maximizing = cbopt.SGD([torch.zeros(1, requires_grad=True)], mom=0.9, maximize=True).cbs
    ours = dict(model().named_parameters())
    opt = cbopt.SGD([{'params': [(n, ours[n]) for n, _ in named[2:]]},
                     {'params': [(n, ours[n]) for n, _ in named[:2]], 'cbs': maximizing}], lr=0.5, mom=0.9)
    opt.load_state_dict(t.state_dict())
    assert [h['lr'] for h in opt.hypers] == [0.1, 0.1]
    with torch.no_grad():
        for n, p in named: ours[n].copy_(p)
    for i in range(2, 5):  # each param goes on as in torch, the maximized ones too
        grads(list(m.parameters()), i)
        t.step()
        for (n, p) in named: ours[n].grad = p.grad.clone()
        opt.step()
    for n, p in named: torch.testing.assert_close(ours[n], p, rtol=1e-6, atol=0)
    sd = t.state_dict()
    sd['param_groups'][1]['maximize'] = True
    refused(cbopt.SGD(model().named_parameters(), lr=0.1, mom=0.9), sd, ValueError,
            "param group 0 of the torch.optim state_dict has maximize=True, but this optimizer's chain [weight_decay,average_grad,momentum_step] "
            "runs as maximize=False: build it with maximize=True")


def test_torch_state_and_hypers_read_one_entry_at_a_time() -> None:
    """torch's step (a float tensor, or a plain number) becomes an int; a None entry is skipped, not the rest after it;
    a callback's own torch state names win over the common table (RMSprop's `momentum_buffer` is its `mom_buf`, SGD's
    is `grad_avg`); a whole-model entry (a '.' in its name) is kept as it is; a torch tuple hyper of another length
    than its names is refused."""
    m = model()
    t = torch.optim.RMSprop(m.parameters(), lr=0.01, momentum=0.9, centered=True)
    grads(list(m.parameters()), 0)
    t.step()
    rms = cbopt.optim.RMSprop(model().parameters(), lr=0.01, momentum=0.9, centered=True)
    rms.load_state_dict(t.state_dict())
    for p, q in zip(rms.params, m.parameters()):
        assert torch.equal(rms.state[p]['mom_buf'], t.state[q]['momentum_buffer'])
        assert torch.equal(rms.state[p]['grad_avg'], t.state[q]['grad_avg'])
    sgd = cbopt.SGD(model().parameters(), mom=0.9).param_groups[0]['cbs']
    buf = torch.ones(2)
    assert torch_state({'exp_avg': None, 'momentum_buffer': buf, 'step': torch.tensor(3.)}, sgd) == \
        {'grad_avg': buf, 'step': 3}
    assert torch_state({'step': 4.0}, sgd) == {'step': 4} and type(torch_state({'step': 4.0}, sgd)['step']) is int
    cbs = adam(steps=0).param_groups[0]['cbs']
    assert torch_hypers(0, {'lr': 0.1, 'skip_nonfinite.skipped_total': 2, 'betas': (0.8, 0.9)}, cbs) == \
        {'lr': 0.1, 'skip_nonfinite.skipped_total': 2, 'mom': 0.8, 'sqr_mom': 0.9}
    with pytest.raises(ValueError, match=r'betas \(torch.optim group 0\) must be a sequence of 2 values \(mom, sqr_mom\)'):
        torch_hypers(0, {'betas': (0.8, 0.9, 0.99)}, cbs)


def test_torch_none_state_is_skipped() -> None:
    "torch saves some optional state as None (e.g. a momentum buffer before its first step): nothing to load."
    m = model()
    t = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    grads(list(m.parameters()), 0)
    t.step()
    sd = t.state_dict()
    sd['state'][3]['momentum_buffer'] = None
    opt = cbopt.SGD(model().named_parameters(), lr=0.1, mom=0.9)
    ck = read_checkpoint(sd)
    cbs = opt.param_groups[0]['cbs']
    assert torch_state(ck.params[3].state, cbs) == {} and set(torch_state(ck.params[0].state, cbs)) == {'grad_avg'}
    opt.load_state_dict(sd)
    assert split_flags(opt.state[opt.params[3]])[0] == {}


# -- fastai's format ----------------------------------------------------------------------------------------------
def fastai_sd(opt) -> dict:
    "`opt`'s state as fastai's Optimizer.state_dict lays it out: state by position, one hypers dict per group."
    return {'state': [dict(opt.state.get(p, {})) for p in opt.params], 'hypers': [dict(h) for h in opt.hypers]}


def test_fastai_state_dict_errors() -> None:
    opt = adam(groups=True)
    sd = fastai_sd(opt)
    assert read_checkpoint(sd).origin == 'fastai'
    refused(opt, {**sd, 'hypers': sd['hypers'][:1]}, ValueError, "the fastai state_dict has 1 param groups, this "
            "optimizer 2 (its params have no names to match them by, so they are matched by position, in the same groups)")
    refused(opt, {**sd, 'state': sd['state'][:3]}, ValueError,
            "the fastai state_dict has state for 3 params, this optimizer has 4")
    refused(opt, {**sd, 'slow_weights': [[torch.zeros(1)]], 'count': 1}, ValueError,
            "the fastai state_dict has slow weights for 1 params, state for 4")


def test_fastai_lookahead_slow_weights_become_slow_p() -> None:
    "fastai's Lookahead keeps one step count and the slow weights per group; each param gets its own `slow_p`, `la_step`."
    m = model()
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
    theirs, ours = model(), model()
    fastai_opt = FastaiLookahead(FastaiSGD(list(theirs.parameters()), lr=0.1, wd=0.1), k=3)
    opt = cbopt.Lookahead(cbopt.SGD(list(ours.named_parameters()), lr=0.1, wd=0.1), k=3)
    for o in (fastai_opt, opt):
        for p in (theirs if o is fastai_opt else ours).parameters(): o.state[p]['do_wd'] = p.ndim > 1
    def run(o, m, steps, start):
        for i in range(start, start + steps):
            grads(list(m.parameters()), i)
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
        opt = cbopt.Accumulate(cbopt.Optimizer(list(model().named_parameters()), [decay_avg, cbopt.sgd_step], lr=0.1,
                                               wd=0.01), every=1)
        for p in opt.params: opt.state[p]['do_wd'] = p.ndim > 1
        return opt
    src, dst = make(), make()
    for i in range(2):
        grads(src.params, i)
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


def same(a, b) -> bool:
    "Equal values of the same types, tensors (torch.equal) and tuples included."
    if torch.is_tensor(a) or torch.is_tensor(b): return torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict): return type(b) is dict and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)): return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


def test_a_torch_class_checkpoint_has_the_group_entries_torchs_class_saves() -> None:
    """cbopt.optim's `state_dict()` (`format=` its torch class) gives each group exactly the entries torch's class
    saves for the same arguments: defaults or not, in each implementation (`foreach`/`fused` from
    cbopt's backend, `None` for `auto`), AdamW's `decoupled_weight_decay=True` (a flag its constructor does not take),
    and `initial_lr` once an LR scheduler is attached."""
    checked = set()
    for name, kwargs in torch_twins():
        groups = []
        for lib in (torch.optim, cbopt.optim):
            ps = [(n, p) for n, p in model().named_parameters() if name != 'Muon' or p.ndim == 2]  # (Muon: matrices)
            opt = getattr(lib, name)(ps, **kwargs)
            torch.optim.lr_scheduler.StepLR(opt, step_size=2)
            groups.append(opt.state_dict()['param_groups'])
        theirs, ours = groups
        assert same(ours, theirs), (name, kwargs, ours, theirs)
        checked.add((name, kwargs.get('foreach'), kwargs.get('fused')))
    assert {('Adam', None, True), ('AdamW', True, None), ('SGD', False, None), ('LBFGS', None, None)} <= checked


def test_a_torch_class_checkpoint_holds_the_state_torchs_class_saves() -> None:
    """Its state is torch's, param by param: a param that never had a grad has none (nor do the params after it lose
    theirs), a whole-model callback's per-param state (`Accumulate`'s grad sums) is left out, fastai's `do_wd` flag is
    not written; the numbers are those torch's class has after the same steps."""
    def run(opt, ps, steps=3):
        for i in range(steps):
            grads(ps[1:], i)  # '0.weight' never gets a grad
            opt.step()
    for name, kw, wrap in (('AdamW', dict(lr=0.01, weight_decay=0.1), lambda o: cbopt.Accumulate(o, every=1)),
                           ('Rprop', dict(lr=0.01), lambda o: o)):  # Rprop: no weight decay, so do_wd says nothing
        theirs, ours = list(model().parameters()), list(model().parameters())
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
    theirs, ours = model(), model()
    torch_opt = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9)
    opt = cbopt.Optimizer(list(ours.named_parameters()), [cbopt.average_grad, cbopt.momentum_step], lr=0.1, mom=0.9)
    assert 'wd' not in opt.hypers[0]
    for p in opt.params: opt.state[p]['do_wd'] = p.ndim > 1  # as fastai's Learner sets it (wd_bn_bias=False)
    for i in range(3):
        grads(list(theirs.parameters()), i), grads(opt.params, i)
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
    src = adam(groups=True, wd=0.1)
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
    dst = adam(steps=1, groups=True)
    dst.load_state_dict(sd)
    assert dst.hypers == src.hypers and [h['lr'] for h in dst.hypers] == [0.02, 0.02]
    for p, q in zip(dst.params, src.params):
        assert dst.state[p].keys() == src.state[q].keys()
        assert all(torch.equal(v, src.state[q][k]) if torch.is_tensor(v) else v == src.state[q][k]
                   for k, v in dst.state[p].items())
    lamb = cbopt.Lamb(list(model().named_parameters()), lr=0.01)
    grads(lamb.params, 0)
    lamb.step()
    refused(lamb, torch.optim.Optimizer.state_dict(src), ValueError,
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
    opt = cbopt.optim.RAdam(list(model().named_parameters()))  # cbopt.optim's RAdam has fastai's `beta`, default 0
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
    sgd = cbopt.Optimizer(list(model().named_parameters()), [restarting_sgd], lr=0.1)
    torch.optim.lr_scheduler.StepLR(sgd, step_size=2)
    theirs = torch.optim.SGD(list(model().named_parameters()), lr=0.1)
    torch.optim.lr_scheduler.StepLR(theirs, step_size=2)
    assert same(sgd.state_dict(format=torch.optim.SGD)['param_groups'], theirs.state_dict()['param_groups'])


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


def test_a_named_checkpoint_names_an_unnamed_optimizers_groups_each_at_its_own_offset() -> None:
    """Positions only (plain tensors) loading a named checkpoint adopt its names group by group, each group's slice
    starting where the last ended: three groups of 1, 2 and 3 params (unequal, so a wrong offset names wrong params)."""
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2), nn.Linear(2, 1))
    ps = list(m.parameters())
    groups = lambda: [{'params': ps[:1]}, {'params': ps[1:3]}, {'params': ps[3:]}]
    named = cbopt.Adam([{**g, 'params': [(n, p) for n, p in m.named_parameters() if any(p is q for q in g['params'])]}
                        for g in groups()], lr=1e-2)
    grads(ps, 0)
    named.step()
    unnamed = cbopt.Adam(groups(), lr=1e-2)
    unnamed.load_state_dict(named.state_dict())
    assert [g['param_names'] for g in unnamed.param_groups] == [g['param_names'] for g in named.param_groups]
    assert [g['param_names'] for g in unnamed.param_groups] == [['0.weight'], ['0.bias', '1.weight'],
                                                                ['1.bias', '2.weight', '2.bias']]


def test_a_torch_class_checkpoint_names_the_backend_that_ran_in_torchs_flags() -> None:
    """torch's `foreach` entry is True for the foreach backend, False for the loop, torch's default (None) otherwise;
    `fused` True for the fused backend only. (One test, no backend in its name: the mutation runs' loop-backend filter
    would leave it out.)"""
    for backend, foreach in (('foreach', True), ('loop', False), ('fused', None)):
        sd = adam(steps=0, backend=backend).state_dict(format=torch.optim.Adam)
        assert all(g['foreach'] is foreach for g in sd['param_groups']), backend
        assert all(g['fused'] is (True if backend == 'fused' else None) for g in sd['param_groups']), backend


def test_a_number_loaded_for_a_0d_tensor_state_goes_to_that_tensors_device() -> None:
    "A number saved for state kept as a 0-d tensor loads as a tensor of that state's dtype on that state's device."
    from cbopt.state.load import _load_value
    like = torch.zeros((), dtype=torch.float64, device='meta')
    out = _load_value("state 'sum' of param 'w'", 3, like)
    assert (out.dtype, out.device) == (torch.float64, torch.device('meta'))
