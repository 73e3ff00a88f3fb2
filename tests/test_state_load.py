"""Loading state, one rule at a time (`cbopt/state/load.py`): strict and atomic (each way a state_dict can be wrong
gives its own whole message and changes nothing), cast to the params' dtype and device, matched by name across
groupings, named and positional, wrapper prefixes dropped."""
from __future__ import annotations

import copy
import re
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import cbopt
from cbopt.core.flags import split_flags
from cbopt.core.names import canonical_names
from cbopt.state import prepare_load, read_checkpoint
from conftest import (make_model, random_grads, step_random, trained_adam, state_snapshot, assert_same_snapshot,
                      small_model, seeded_grads, small_adam, assert_load_rejected, stepped_lbfgs, MODEL_NAMES)


# -- strict and atomic -------------------------------------------------------------------------------------------
def _sgd_state_dict():
    return step_random(cbopt.SGD(make_model(3).named_parameters(), lr=0.01, mom=0.9, wd=0.1), 2).named_state_dict()


def _corrupt(kind, sd):
    "A broken copy of `sd`, and the FQN its error must name. Breaks the last param where it can (catches partial loads)."
    sd = copy.deepcopy(sd)
    st, params = sd['state'], sd['param_groups'][0]['params']
    if kind == 'unknown-in-state': st['ghost.weight'] = copy.deepcopy(st['0.weight']); return sd, 'ghost.weight'
    if kind == 'unknown-in-groups':
        params.append('ghost.bias'); st['ghost.bias'] = copy.deepcopy(st['2.bias']); return sd, 'ghost.bias'
    if kind == 'missing': params.remove('2.bias'); del st['2.bias']; return sd, '2.bias'
    if kind == 'missing-state': del st['2.bias']; return sd, '2.bias'
    if kind == 'shape': st['2.bias']['grad_avg'] = torch.zeros(4); return sd, '2.bias'
    if kind == 'shape-same-numel':  # (3, 8) saved as (8, 3): as many elements, so only the shape can tell
        st['2.weight']['grad_avg'] = st['2.weight']['grad_avg'].t().contiguous(); return sd, '2.weight'
    if kind == 'dtype': st['2.bias']['sqr_avg'] = torch.ones(2, dtype=torch.int64); return sd, '2.bias'
    if kind == 'not-a-tensor': st['2.bias']['sqr_avg'] = [1., 2.]; return sd, '2.bias'
    if kind == 'other-algorithm': return _sgd_state_dict(), '0.weight'
    if kind == 'empty-state': return {'state': {}, 'param_groups': sd['param_groups']}, '0.weight'
    raise ValueError(kind)


BAD = ['unknown-in-state', 'unknown-in-groups', 'missing', 'missing-state', 'shape', 'shape-same-numel', 'dtype', 'not-a-tensor',
       'other-algorithm', 'empty-state']


def _tensors(v):
    if torch.is_tensor(v): return [v]
    return [t for o in v for t in _tensors(o)] if isinstance(v, (list, tuple)) else []


# -- matching by name, by position, and names without wrapper prefixes -------------------------------------------
def _groups_by(model, keys):
    "`model`'s named params in one group per key (a name ending), in that order: another grouping and order."
    return [{'params': [(n, p) for n, p in model.named_parameters() if n.endswith(k)]} for k in keys]


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
    named = dict(small_model().named_parameters())
    rest = [(n, p) for n, p in named.items() if n not in order]
    opt = cbopt.Optimizer([{'params': [(n, named[n]) for n in order], 'cbs': [last_flat_grads, cbopt.sgd_step]},
                           *([{'params': rest}] if rest else [])], [cbopt.sgd_step], lr=0.1)
    for i in range(steps):
        seeded_grads(named.values(), i)
        opt.step()
    return opt


def test_load_copies_tensors():
    a, b = trained_adam(0), cbopt.Adam(make_model(0).named_parameters(), lr=0.01, wd=0.1)
    b.load_state_dict(a.state_dict())
    for p, q in zip(a.params, b.params):
        assert b.state[q]['grad_avg'].data_ptr() != a.state[p]['grad_avg'].data_ptr()


@pytest.mark.parametrize('fresh', [False, True], ids=['initialised', 'fresh'])
@pytest.mark.parametrize('kind', BAD)
def test_bad_load_names_culprit_and_changes_nothing(kind, fresh):
    if fresh and kind in ('missing-state', 'empty-state'): pytest.skip('a fresh optimizer may load no state')
    src = trained_adam(0, lr=0.02)
    src.set_hyper('eps', 1e-3)  # hypers differ too: a partial load would show in them
    dst = trained_adam(1, lr=0.01, steps=0 if fresh else 3)
    sd, culprit = _corrupt(kind, src.named_state_dict())
    before = state_snapshot(dst)
    with pytest.raises((KeyError, ValueError, TypeError)) as e: dst.load_state_dict(sd)
    assert culprit in str(e.value)
    assert_same_snapshot(state_snapshot(dst), before)
    dst.load_state_dict(src.state_dict())  # and a good checkpoint still loads afterwards
    assert_same_snapshot(state_snapshot(dst), state_snapshot(src))


def test_empty_state_loads_after_clear_state():
    "The documented way to restart on purpose: clear_state() first, then a state-less checkpoint is fine."
    dst = trained_adam(1)
    sd = {'state': {}, 'param_groups': trained_adam(0, lr=0.02).state_dict()['param_groups']}  # (torch's layout)
    dst.clear_state()
    dst.load_state_dict(sd)
    assert dst.hypers[0]['lr'] == 0.02 and all(not dst.state[p] for p in dst.params)


# -- dtype -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('dtype', [torch.float64, torch.bfloat16])
@pytest.mark.parametrize('initialised', [False, True], ids=['fresh', 'initialised'])
def test_load_casts_to_param_dtype(dtype, initialised):
    src = trained_adam(0)
    dst = trained_adam(1, dtype=dtype, steps=2 if initialised else 0)
    dst.load_state_dict(src.state_dict())
    for p, q in zip(src.params, dst.params):
        for k in ('grad_avg', 'sqr_avg'):
            v = dst.state[q][k]
            assert v.dtype == q.dtype == dtype and v.device == q.device
            torch.testing.assert_close(v, src.state[p][k].to(dtype), rtol=0, atol=0)
        assert dst.state[q]['step'] == 3 and type(dst.state[q]['step']) is int
    if dtype == torch.float64:  # and the run goes on as the fp32 one does, to fp32 precision
        with torch.no_grad():
            for p, q in zip(src.params, dst.params): q.copy_(p)
        step_random(src, 3, 100), step_random(dst, 3, 100)
        for p, q in zip(src.params, dst.params): torch.testing.assert_close(q, p.double(), rtol=1e-5, atol=1e-6)


def test_load_moves_to_param_device():
    "The only other device on a CPU-only machine is `meta`: a CPU checkpoint's tensors follow the params there."
    src = trained_adam(0)
    dst = cbopt.Adam(make_model(1).to('meta').named_parameters())
    dst.load_state_dict(src.state_dict())
    for p, q in zip(src.params, dst.params):
        assert {k: (v.device.type, v.shape) for k, v in dst.state[q].items() if torch.is_tensor(v)} == \
            {k: ('meta', p.shape) for k in ('grad_avg', 'sqr_avg')}
        assert dst.state[q]['step'] == 3


@pytest.mark.parametrize('where', ['meta', 'float64'])
def test_load_moves_whole_model_state_to_param_device(where):
    """L-BFGS's history (whole-model state, None or [] before a first step: no template to load it like) follows the
    params as torch's LBFGS's does (`_process_value_according_to_param_policy`: device, and floating dtype): a
    checkpoint read with `map_location='cpu'` must step on CUDA params (`meta` stands for the other device here)."""
    net, sd = stepped_lbfgs()
    dst_net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    dst_net = dst_net.to('meta') if where == 'meta' else dst_net.double()
    dst = cbopt.LBFGS(dst_net.named_parameters(), history_size=5)
    dst.load_state_dict(sd)
    ref = torch.optim.LBFGS(dst_net.parameters(), history_size=5)  # torch's own rule, on the same params
    src = cbopt.LBFGS(net.named_parameters(), history_size=5)
    src.load_state_dict(sd)
    ref.load_state_dict(src.state_dict(format=torch.optim.LBFGS))
    theirs = ref.state[next(iter(dst_net.parameters()))]
    g = dst.param_groups[0]
    for k in ('d', 'old_dirs', 'old_stps', 'prev_flat_grad'):
        ours, ref_ts = _tensors(g['lbfgs.' + k]), _tensors(theirs[k])
        assert ours and len(ours) == len(ref_ts), k
        assert [(t.device, t.dtype) for t in ours] == [(t.device, t.dtype) for t in ref_ts], k
        if where == 'float64':
            for a, b in zip(ours, ref_ts): torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_load_moves_tensor_lr_to_param_device():
    "A tensor lr saved on the CPU loads on the params' device (torch's fused kernels read it there), as a copy."
    src = cbopt.Adam(make_model(0).named_parameters(), lr=torch.tensor(0.01))
    sd = src.state_dict()
    dst = cbopt.Adam(make_model(1).to('meta').named_parameters(), lr=0.02)
    dst.load_state_dict(sd)
    lr = dst.param_groups[0]['lr']
    assert torch.is_tensor(lr) and lr.device.type == 'meta'
    cpu = cbopt.Adam(make_model(1).named_parameters(), lr=torch.tensor(0.02))
    cpu.load_state_dict(sd)
    assert cpu.param_groups[0]['lr'] == 0.01 and cpu.param_groups[0]['lr'] is not sd['param_groups'][0]['lr']


@pytest.mark.parametrize('layout', ['state_dict', 'named_state_dict'])
def test_loads_across_groupings_by_name(layout):
    "Two groups into one with the params in another order, and back: each param gets its own state, runs go on alike."
    src = step_random(cbopt.Adam(_groups_by(make_model(0), ['bias', 'weight']), lr=0.02, wd=0.1), 3)
    one = cbopt.Adam(make_model(0).named_parameters(), lr=0.5)
    back = cbopt.Adam(_groups_by(make_model(0), ['weight', 'bias']), lr=0.5)
    with torch.no_grad():  # the models' weights as src's
        for o in (one, back):
            for n, p in o.named_params().items(): p.copy_(src.named_params()[n])
    one.load_state_dict(getattr(src, layout)())
    assert one.hypers[0]['lr'] == 0.02 and one.hypers[0]['wd'] == 0.1
    by_name = lambda o: {n: o.state[p] for n, p in o.named_params().items()}
    for n, s in by_name(src).items():
        for k, v in s.items(): assert torch.equal(v, by_name(one)[n][k]) if torch.is_tensor(v) else v == by_name(one)[n][k]
    back.load_state_dict(getattr(one, layout)())
    assert [h['lr'] for h in back.hypers] == [0.02, 0.02]
    for i in range(10, 14):  # the three go on alike, each param with its own state (grads by name)
        for o in (src, one, back):
            for n, p in sorted(o.named_params().items()): random_grads([p], hash((i, n)) % 1000)
            o.step()
    for n, p in src.named_params().items():
        torch.testing.assert_close(one.named_params()[n], p, rtol=0, atol=0)
        torch.testing.assert_close(back.named_params()[n], p, rtol=0, atol=0)


def test_regrouped_hypers_that_disagree_keep_ours_with_a_warning():
    src = step_random(cbopt.Adam([{**g, 'lr': lr} for g, lr in zip(_groups_by(make_model(0), ['bias', 'weight']), [0.1, 0.2])],
                                 wd=0.1), 1)
    one = cbopt.Adam(make_model(0).named_parameters(), lr=0.5, wd=0.3)
    with pytest.warns(UserWarning, match=r"'lr' the values \[0.1, 0.2\]: group 0 keeps its own lr=0.5") as seen:
        one.load_state_dict(src.state_dict())
    assert [w.filename for w in seen] == [__file__]  # the warning names the user's line, not cbopt's
    assert one.hypers[0]['lr'] == 0.5 and one.hypers[0]['wd'] == 0.1


@pytest.mark.parametrize('src_named,dst_named', [(False, True), (True, False), (False, False)],
                         ids=['positions-into-names', 'names-into-positions', 'positions'])
@pytest.mark.parametrize('layout', ['state_dict', 'named_state_dict'])
def test_positional_and_named_load_by_position(src_named, dst_named, layout):
    """As torch does: where either side has no names, params are matched by position; an optimizer without names
    takes the checkpoint's (torch's groups take a state_dict's `param_names`)."""
    params = lambda m, named: m.named_parameters() if named else m.parameters()
    src = step_random(cbopt.Adam(params(make_model(0), src_named), lr=0.01, wd=0.1), 3)
    dst = cbopt.Adam(params(make_model(1), dst_named))
    dst.load_state_dict(getattr(src, layout)())
    assert dst.param_names == (MODEL_NAMES if dst_named or src_named else ['0', '1', '2', '3'])
    for p, q in zip(src.params, dst.params):
        torch.testing.assert_close(dst.state[q]['grad_avg'], src.state[p]['grad_avg'], rtol=0, atol=0)
    assert dst.hypers == src.hypers


def test_wrapper_prefixes_are_not_part_of_names():
    "torch.compile's `_orig_mod.`, DDP's `module.` and activation checkpointing's prefix go, as torch's DCP helpers do."
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    m = make_model(0)
    assert cbopt.Adam(torch.compile(m).named_parameters()).param_names == MODEL_NAMES
    assert cbopt.Adam(m.named_parameters(prefix='module')).param_names == MODEL_NAMES  # DDP's names
    wrapped = nn.Sequential(checkpoint_wrapper(m[0]), m[1], m[2])
    assert cbopt.Adam(wrapped.named_parameters()).param_names == MODEL_NAMES
    some = cbopt.Adam({'module': dict(m[0].named_parameters()), 'head': dict(m[2].named_parameters())})  # 'module.' only when it starts every name
    assert some.param_names == ['module.weight', 'module.bias', 'head.weight', 'head.bias']
    # a checkpoint saved under a wrapper's names loads into the plain model's optimizer, and the reverse
    src = step_random(cbopt.Adam(m.named_parameters(), lr=0.01, wd=0.1), 2)
    sd = src.named_state_dict()
    sd['state'] = {f'module._orig_mod.{n}': s for n, s in sd['state'].items()}
    sd['param_groups'][0]['params'] = [f'module._orig_mod.{n}' for n in sd['param_groups'][0]['params']]
    dst = cbopt.Adam(make_model(1).named_parameters())
    dst.load_state_dict(sd)
    assert_same_snapshot(state_snapshot(dst), state_snapshot(src))


# -- what a state_dict is -----------------------------------------------------------------------------------------
def test_not_a_state_dict() -> None:
    opt = small_adam()
    assert_load_rejected(opt, [1, 2], TypeError, "expected a state_dict with a 'state' entry, got list")
    assert_load_rejected(opt, {'param_groups': []}, TypeError, "expected a state_dict with a 'state' entry, got dict")
    assert_load_rejected(opt, {'state': {}}, ValueError, "the state_dict has no 'param_groups'")
    assert_load_rejected(opt, {'state': [{}] * 4}, ValueError, "the state_dict has no 'param_groups'")  # fastai's state, no 'hypers'
    sd = opt.named_state_dict()
    sd['param_groups'][0]['params'][1] = 1.5
    assert_load_rejected(opt, sd, ValueError, "group 0 of the state_dict lists params that are neither names (str) nor torch ids (int)")
    assert read_checkpoint(opt.named_state_dict()).origin == read_checkpoint(opt.state_dict()).origin == 'cbopt'


# -- cbopt's own format -------------------------------------------------------------------------------------------
def test_group_errors() -> None:
    opt = small_adam(groups=True)
    sd = opt.named_state_dict()
    one = copy.deepcopy(sd)
    one['param_groups'] = one['param_groups'][:1]
    assert_load_rejected(opt, one, KeyError, "param '1.weight' (group 1) is missing from the state_dict")
    positional = copy.deepcopy(opt.state_dict())  # no names: matched by position, in the same groups
    for g in positional['param_groups']: del g['param_names']
    positional['param_groups'] = positional['param_groups'][:1]
    positional['state'] = {k: v for k, v in positional['state'].items() if k < 2}
    assert_load_rejected(opt, positional, ValueError, "the state_dict has 1 param groups, this optimizer 2 (its params have no names "
                                         "to match them by, so they are matched by position, in the same groups)")
    moved = copy.deepcopy(sd)  # another grouping loads by name
    moved['param_groups'][1]['params'].remove('1.bias')
    moved['param_groups'][0]['params'].append('1.bias')
    other = small_adam(groups=True)
    other.load_state_dict(moved)
    assert all(torch.equal(other.state[p]['sqr_avg'], opt.state[q]['sqr_avg']) for p, q in zip(other.params, opt.params))
    ghost = copy.deepcopy(sd)
    ghost['param_groups'][1]['params'].append('ghost')
    assert_load_rejected(opt, ghost, KeyError, "unknown param 'ghost' in the state_dict: this optimizer has no such param (it has "
                                  "'0.weight', '0.bias', '1.weight', '1.bias')")
    gone = copy.deepcopy(sd)
    gone['param_groups'][1]['params'].remove('1.bias')
    assert_load_rejected(opt, gone, KeyError, "param '1.bias' (group 1) is missing from the state_dict")
    twice = copy.deepcopy(opt.state_dict())
    twice['param_groups'][1]['params'].append(0)
    assert_load_rejected(opt, twice, ValueError, "param 0 is listed twice in the state_dict's groups")
    ghost_state = copy.deepcopy(sd)
    ghost_state['state']['ghost'] = {}
    assert_load_rejected(opt, ghost_state, KeyError, "unknown param 'ghost' in the state_dict's state: no group of the state_dict lists it")


def test_name_errors_name_the_param_and_this_optimizers_first_four() -> None:
    """A name the checkpoint gives twice once wrapper prefixes are removed is refused; an unknown one is named with
    this optimizer's first four names, and '...' when it has more."""
    opt = small_adam()
    sd = opt.named_state_dict()
    sd['param_groups'][0]['params'][1] = '_orig_mod.0.weight'  # torch.compile's prefix: '0.weight' again
    assert_load_rejected(opt, sd, ValueError, "param '0.weight' appears twice in the state_dict")
    torch.manual_seed(0)
    big = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2), nn.Linear(2, 1, bias=False))  # 5 params: one more than shown
    opt = cbopt.Adam(list(big.named_parameters()), lr=0.01)
    seeded_grads(opt.params, 0)
    opt.step()
    sd = opt.named_state_dict()
    sd['param_groups'][0]['params'][4] = 'ghost'
    sd['state']['ghost'] = sd['state'].pop('2.weight')
    assert_load_rejected(opt, sd, KeyError, "unknown param 'ghost' in the state_dict: this optimizer has no such param (it has "
                               "'0.weight', '0.bias', '1.weight', '1.bias', ...)")


def test_a_regrouped_checkpoint_gives_each_group_the_hypers_of_its_params_groups() -> None:
    """Groups in another order and of other sizes than the checkpoint's: each group takes the hypers of the checkpoint
    group its params were in, whatever the order of the entries in the checkpoint's group dicts (a dict's order means
    nothing); a whole-model callback's state (kept in the first group listing it) is neither a hyper nor a
    disagreement to warn of when that group's params come from several checkpoint groups."""
    def opt(groups: list[list[str]], lrs: list[float]) -> cbopt.Optimizer:
        named = dict(small_model().named_parameters())
        return cbopt.SkipNonFinite(cbopt.Adam([{'params': [(n, named[n]) for n in g], 'lr': lr}
                                               for g, lr in zip(groups, lrs)]))
    src = opt([['0.weight'], ['0.bias', '1.weight'], ['1.bias']], [0.1, 0.2, 0.3])
    for seed, bad in ((0, False), (1, True), (2, False)):  # the step with a NaN grad is skipped and counted
        seeded_grads(src.params, seed)
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
        merged = opt([list(dict(small_model().named_parameters()))], [0.5])  # from checkpoint groups that agree on all hypers
        src.set_hyper('lr', 0.1)
        merged.load_state_dict(src.named_state_dict())
        assert merged.hypers[0]['lr'] == 0.1
    for o in (dst, merged):
        assert o.param_groups[0]['skip_nonfinite.skipped_total'] == 1
    twice = src.named_state_dict()
    twice['param_groups'][1]['skip_nonfinite.skipped_total'] = 0
    assert_load_rejected(dst, twice, ValueError, "whole-model callback state 'skip_nonfinite.skipped_total' is in several groups of "
                                    "the state_dict, which groups its params otherwise than this optimizer: cannot tell "
                                    "whose it is")
    unknown = src.named_state_dict()
    unknown['param_groups'][2]['accumulate_grads.micro_step'] = 1
    assert_load_rejected(dst, unknown, KeyError, "unknown whole-model callback state 'accumulate_grads.micro_step' in the state_dict's "
                                    "any group: this optimizer keeps ['skip_nonfinite.skipped_consecutive', "
                                    "'skip_nonfinite.skipped_total'] there")
    plain = small_adam(groups=True).named_state_dict()
    plain['param_groups'][0]['accumulate_grads.micro_step'] = 1
    assert_load_rejected(small_adam(groups=True), plain, KeyError, "unknown whole-model callback state 'accumulate_grads.micro_step' in "
                                                "the state_dict's group 0: this optimizer keeps none there")
    for o in (dst, merged):
        assert all(torch.equal(o.state[o.named_params()[n]]['grad_avg'], src.state[p]['grad_avg'])
                   for n, p in src.named_params().items())


def test_whole_model_state_is_checked_and_converted_entry_by_entry() -> None:
    """A whole-model callback's state in a checkpoint's group: a missing entry and one of another kind are refused by
    name; a count saved as a float or a 1-element tensor loads as the int the callback keeps."""
    def skipping() -> cbopt.Optimizer:
        opt = cbopt.SkipNonFinite(cbopt.Adam(list(small_model().named_parameters()), lr=0.01))
        for i, bad in enumerate((False, True)):
            seeded_grads(opt.params, i)
            if bad: opt.params[0].grad[0, 0] = float('inf')
            opt.step()
        return opt
    src, opt = skipping(), skipping()
    missing = src.named_state_dict()
    del missing['param_groups'][0]['skip_nonfinite.skipped_total']
    assert_load_rejected(opt, missing, KeyError, "whole-model callback state 'skip_nonfinite.skipped_total' (group 0) is missing "
                                    "from the state_dict")
    text = src.named_state_dict()
    text['param_groups'][0]['skip_nonfinite.skipped_total'] = 'one'
    assert_load_rejected(opt, text, TypeError, "whole-model callback state 'skip_nonfinite.skipped_total' (group 0) is a str in the state_dict, "
                                  "a number here")
    for saved in (4.0, torch.tensor(4)):
        sd = src.named_state_dict()
        sd['param_groups'][0]['skip_nonfinite.skipped_total'] = saved
        opt.load_state_dict(sd)
        total = opt.param_groups[0]['skip_nonfinite.skipped_total']
        assert type(total) is int and total == 4, saved


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
        assert_load_rejected(o, short, ValueError, f"whole-model callback state {FLAT[0]!r} (group 0) has shape (9,) in the "
                                      f"state_dict, but this group's params have 10 elements: it is the state of other params")
    numbers = copy.deepcopy(sd)
    numbers['param_groups'][0][FLAT[1]] = [1.0, 2.0]
    assert_load_rejected(opt, numbers, ValueError, f"whole-model callback state {FLAT[1]!r} (group 0) has shape () in the "
                                      f"state_dict, but this group's params have 10 elements: it is the state of other params")
    names = ['0.weight', '0.bias', '1.weight', '1.bias']
    regrouped = flat_opt(names, steps=2).named_state_dict()  # one group, its group split in two by hand:
    g = regrouped['param_groups'][0]                            # the entries stay in the first, flat over all four
    regrouped['param_groups'] = [{**g, 'params': names[:2]}, {k: v for k, v in g.items() if k not in FLAT} | {'params': names[2:]}]
    assert_load_rejected(flat_opt(names[::-1]), regrouped, ValueError,
            f"whole-model callback state {FLAT[1]!r} (group 0) is flat over the params of the state_dict's group 0, which "
            f"are not this group's: it cannot be put in their order")
    # first of one checkpoint group, then of another, at positions 0 and 1 of theirs: still other params than its own
    mixed = flat_opt(['0.bias', '1.weight'], steps=2).named_state_dict()  # its flat entries: of the right length
    entries = {k: mixed['param_groups'][0][k] for k in FLAT}
    mixed['param_groups'] = [{'lr': 0.1, 'params': names[:2], **entries}, {'lr': 0.1, 'params': names[2:]}]  # no chains
    assert_load_rejected(flat_opt(['0.bias', '1.weight']), mixed, ValueError,
            f"whole-model callback state {FLAT[1]!r} (group 0) is flat over the params of the state_dict's group 0, which "
            f"are not this group's: it cannot be put in their order")


def test_flat_whole_model_state_in_several_groups_is_rejected_before_anything_changes() -> None:
    """A callback with state flat over its group's params (`flat_state`) listed by two groups would keep one vector over
    both groups' params in the first's entries, which no checkpoint could load back (whose params, in what order):
    refused, naming the callback and the groups, when the optimizer is made, when a group listing it is added (the
    optimizer unchanged), and at the step when a shared chain gets it later (fastai-style), before anything changes."""
    named = list(small_model().named_parameters())
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
    seeded_grads([p for _, p in named], 0)
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
    opt = small_adam(groups=True)
    sd = cbopt.SGD(small_model().named_parameters(), lr=0.1, mom=0.9).named_state_dict()
    sd['param_groups'] = [{**sd['param_groups'][0], 'params': ['0.weight', '0.bias']},
                          {**sd['param_groups'][0], 'params': ['1.weight', '1.bias']}]
    chain = opt.named_state_dict()['param_groups'][0]['chain']
    theirs = sd['param_groups'][0]['chain']
    assert_load_rejected(opt, sd, ValueError, f"param group 0 ('0.weight', '0.bias') was saved by the chain [{theirs}], but runs "
                                 f"[{chain}] here: its state belongs to another algorithm")
    del sd['param_groups'][0]['chain'], sd['param_groups'][1]['chain']  # no chain named: the state keys tell
    sd['state'] = {'0.weight': {'grad_avg': torch.zeros(2, 3)}}
    assert_load_rejected(opt, sd, ValueError, "param '0.weight' has state keys ['grad_avg'] in the state_dict but "
                                 "['grad_avg', 'sqr_avg', 'step'] here: it was saved by a different algorithm")


def test_state_value_errors() -> None:
    opt = small_adam()
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
        assert_load_rejected(opt, bad, exc, message)


def test_a_number_saved_for_a_0d_tensor_state_loads_as_that_tensor() -> None:
    """Schedule-free's running sums are 0-d float64 tensors (older checkpoints saved Python floats): a number loads as
    such a tensor, of this optimizer's dtype; a bool is no number there. A 1-element state of another shape takes no
    number (`sqr_avg` of a (1,) bias in test_state_value_errors)."""
    def schedule_free() -> cbopt.Optimizer:
        opt = cbopt.ScheduleFreeSGD(list(small_model().named_parameters()), lr=0.1)
        opt.train()
        for i in range(2):
            seeded_grads(opt.params, i)
            opt.step()
        return opt
    src, opt = schedule_free(), schedule_free()
    sd = src.named_state_dict()
    sums = {n: s['weight_sum'].item() for n, s in sd['state'].items()}
    for s, v in zip(sd['state'].values(), sums.values()): s['weight_sum'] = v
    flagged = copy.deepcopy(sd)
    flagged['state']['0.bias']['weight_sum'] = True
    assert_load_rejected(opt, flagged, TypeError, "state 'weight_sum' of param '0.bias' is a bool in the state_dict, a Tensor here")
    opt.load_state_dict(sd)
    for n, p in opt.named_params().items():
        got = opt.state[p]['weight_sum']
        assert torch.is_tensor(got) and got.shape == () and got.dtype == torch.float64 and got.item() == sums[n]


def test_a_regrouped_checkpoint_is_checked_param_by_param_against_its_chains() -> None:
    """A checkpoint grouped otherwise, whose groups ran different chains: each param is checked against the chain
    its own checkpoint group ran, and the first saved by another chain than its group's here is named."""
    sd = small_adam(groups=True).named_state_dict()
    sd['param_groups'][1]['chain'] = cbopt.Lamb(list(small_model().named_parameters())).named_state_dict()['param_groups'][0]['chain']
    opt = small_adam()  # one group of the four params: '1.weight' and '1.bias' come from the Lamb group
    assert_load_rejected(opt, sd, ValueError, f"param '1.weight' (group 0) was saved by the chain [{sd['param_groups'][1]['chain']}], "
                                 f"but runs [{sd['param_groups'][0]['chain']}] here: its state belongs to another algorithm")


def test_a_transposed_state_of_as_many_elements_is_rejected() -> None:
    opt = small_adam()
    sd = opt.named_state_dict()
    sd['state']['0.weight']['grad_avg'] = sd['state']['0.weight']['grad_avg'].t().contiguous()
    assert_load_rejected(opt, sd, ValueError, "state 'grad_avg' of param '0.weight' has shape (3, 2) in the state_dict, (2, 3) here")


def test_numbers_load_as_the_type_the_optimizer_keeps() -> None:
    "A step count saved as a float, a 1-element tensor or a numpy number loads as the int this optimizer keeps."
    src = small_adam(steps=3)
    for saved in (3.0, torch.tensor(3.), torch.tensor([3]), np.int64(3)):
        sd = src.named_state_dict()
        for s in sd['state'].values(): s['step'] = saved
        opt = small_adam(steps=1)
        opt.load_state_dict(sd)
        assert all(type(opt.state[p]['step']) is int and opt.state[p]['step'] == 3 for p in opt.params), saved


def test_loaded_tensors_take_the_params_dtype_and_are_copies() -> None:
    src = small_adam()
    sd = src.named_state_dict()
    sd['state']['0.weight']['grad_avg'] = sd['state']['0.weight']['grad_avg'].double()
    opt = small_adam(steps=0)
    opt.load_state_dict(sd)
    got = opt.state[opt.params[0]]['grad_avg']
    assert got.dtype == torch.float32 and torch.equal(got, sd['state']['0.weight']['grad_avg'].float())
    sd['state']['0.weight']['grad_avg'].add_(1)          # the checkpoint changes after the load: the optimizer does not
    assert torch.equal(got, src.state[src.params[0]]['grad_avg'])


def test_missing_state_restarts_only_by_choice() -> None:
    """A param with state here and none in the checkpoint is an error naming it, even in a checkpoint of a fresh
    optimizer (no state at all, as fastai's lr_find saves); after `clear_state()` (the choice) it loads."""
    opt = small_adam()
    sd = opt.named_state_dict()
    del sd['state']['1.bias']
    assert_load_rejected(opt, sd, ValueError, "the state_dict has no state for param '1.bias', which has state here "
                                 "(['grad_avg', 'sqr_avg', 'step']): loading it would silently restart '1.bias'; "
                                 "call clear_state() first")
    fresh = small_adam(steps=0).named_state_dict()
    with pytest.raises(ValueError, match=r"^the state_dict has no state for param '0\.weight'"): prepare_load(opt, fresh)
    opt.clear_state()
    state, hypers = prepare_load(opt, fresh)
    assert all(s == {} for s in state.values()) and len(state) == 4 and hypers[0]['lr'] == 0.01


def test_state_for_a_param_that_keeps_none() -> None:
    opt = cbopt.SGD(small_model().named_parameters(), lr=0.1)  # plain SGD: no state
    sd = opt.named_state_dict()
    sd['state']['1.bias'] = {'grad_avg': torch.zeros(1)}
    assert_load_rejected(opt, sd, ValueError, "the state_dict has state ['grad_avg'] for param '1.bias', but this optimizer keeps "
                                 "no state for it")


def test_hypers_of_a_checkpoint_are_checked_initial_lr_too() -> None:
    """Every hyper of a checkpoint's groups is checked as construction checks it: a NaN lr is refused; the
    `initial_lr` torch's LR schedulers add is a hyper no callback has a rule for, so only its type is checked (a number
    loads as it is, a list is refused as it would be by `set_hyper`)."""
    opt = small_adam()
    sd = opt.named_state_dict()
    sd['param_groups'][0]['lr'] = float('nan')
    assert_load_rejected(opt, sd, ValueError, "Invalid learning rate: nan (group 0) (expected lr >= 0, finite)")
    sd['param_groups'][0]['lr'] = 0.5
    sd['param_groups'][0]['initial_lr'] = [0.25]
    assert_load_rejected(opt, sd, TypeError, "hyper 'initial_lr' (group 0) got a list: hypers are numbers (or 0-d tensors)")
    with pytest.raises(TypeError, match=re.escape("hyper 'initial_lr' got a list")): opt.set_hyper('initial_lr', [[0.25]])
    sd['param_groups'][0]['initial_lr'] = 0.25  # what torch's LR schedulers add: loaded as it is
    opt.load_state_dict(sd)
    assert opt.param_groups[0]['lr'] == 0.5 and opt.param_groups[0]['initial_lr'] == 0.25


def test_flags_stay_the_receiving_optimizers() -> None:
    "do_wd and force_train are the model's (fastai's Learner sets them): a load keeps this optimizer's."
    src, opt = small_adam(), small_adam()
    src.state[src.params[1]]['do_wd'] = False
    opt.state[opt.params[2]]['force_train'] = True
    opt.load_state_dict(src.named_state_dict())
    assert 'do_wd' not in opt.state[opt.params[1]] and opt.state[opt.params[2]]['force_train'] is True
    assert split_flags({'do_wd': False, 'step': 3, 'force_train': True}) == ({'step': 3}, {'do_wd': False, 'force_train': True})


def test_a_named_checkpoint_names_an_unnamed_optimizers_groups_each_at_its_own_offset() -> None:
    """Positions only (plain tensors) loading a named checkpoint adopt its names group by group, each group's slice
    starting where the last ended: three groups of 1, 2 and 3 params (unequal, so a wrong offset names wrong params)."""
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2), nn.Linear(2, 1))
    ps = list(m.parameters())
    groups = lambda: [{'params': ps[:1]}, {'params': ps[1:3]}, {'params': ps[3:]}]
    named = cbopt.Adam([{**g, 'params': [(n, p) for n, p in m.named_parameters() if any(p is q for q in g['params'])]}
                        for g in groups()], lr=1e-2)
    seeded_grads(ps, 0)
    named.step()
    unnamed = cbopt.Adam(groups(), lr=1e-2)
    unnamed.load_state_dict(named.state_dict())
    assert [g['param_names'] for g in unnamed.param_groups] == [g['param_names'] for g in named.param_groups]
    assert [g['param_names'] for g in unnamed.param_groups] == [['0.weight'], ['0.bias', '1.weight'],
                                                                ['1.bias', '2.weight', '2.bias']]


def test_a_number_loaded_for_a_0d_tensor_state_goes_to_that_tensors_device() -> None:
    "A number saved for state kept as a 0-d tensor loads as a tensor of that state's dtype on that state's device."
    from cbopt.state.load import _load_value
    like = torch.zeros((), dtype=torch.float64, device='meta')
    out = _load_value("state 'sum' of param 'w'", 3, like)
    assert (out.dtype, out.device) == (torch.float64, torch.device('meta'))
