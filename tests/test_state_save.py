"""Saving state: `state_dict()` and `named_state_dict()` (torch's layout, keyed by FQN, readable with
`weights_only=True`, snapshots that do not alias the optimizer), `init_state()`, resuming in a fresh optimizer, and
DCP's nested and flattened round trips (`cbopt/state/save.py`, `cbopt/core/initial.py`)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import cbopt
from cbopt.core.flags import split_flags
from cbopt.core.hypers import model_entries
from cbopt.state import named_state_dict
from conftest import (make_model, step_random, trained_adam, state_snapshot, assert_same_snapshot, assert_same_state,
                      small_adam, MODEL_NAMES, ADAM_KEYS)


# -- resume ------------------------------------------------------------------------------------------------------
def one_cycle(opt): return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=20)


def _accumulating_adam(model):
    "AdamW under a warmup and a 3-step accumulation: whole-model state in the group entries and per param."
    adam = cbopt.Adam(model.named_parameters(), lr=0.01, wd=0.1)
    warm = cbopt.WarmupOptimizer(adam, [cbopt.WarmupStage(cbopt.WarmupPolicy.LINEAR, max_iters=10, value=0.1)], lr=None)
    return cbopt.Accumulate(warm, every=3)


def _two_chains(model):
    "Momentum SGD on the matrices (torch's alias `momentum` in their group), AdamW on the rest: a chain per group."
    named = list(model.named_parameters())
    return cbopt.Optimizer([{'params': [(n, p) for n, p in named if p.ndim == 2],
                             'cbs': [cbopt.average_grad, cbopt.momentum_step], 'lr': 0.02, 'momentum': 0.8},
                            {'params': [(n, p) for n, p in named if p.ndim < 2]}], cbopt.adam_chain(), lr=3e-3)


DCP_FLAT_CASES = {'sgd': lambda m: cbopt.SGD(m.named_parameters(), lr=0.1, mom=0.9, wd=0.01),
                  'accumulate(warmup(adam))': _accumulating_adam, 'two chains': _two_chains}


# -- format ------------------------------------------------------------------------------------------------------
def test_format_and_weights_only(tmp_path):
    enc, head = make_model(), nn.Linear(2, 1)
    opt = cbopt.Adam({'enc': enc.named_parameters(), 'head': dict(head.named_parameters())}, lr=0.01)
    opt.add_param_group({'params': {'extra': torch.zeros(2, requires_grad=True)}, 'lr': 0.5})
    step_random(opt, 2)
    sd, tsd = opt.named_state_dict(), opt.state_dict()
    fqns = [f'enc.{n}' for n in MODEL_NAMES] + ['head.weight', 'head.bias']
    assert set(sd) == set(tsd) == {'state', 'param_groups'}
    # torch's layout: ids in param_groups order, each group naming its params, cbopt's state names and hypers
    assert list(tsd['state']) == list(range(7))
    assert [g['params'] for g in tsd['param_groups']] == [list(range(6)), [6]]
    assert [g['param_names'] for g in tsd['param_groups']] == [fqns, ['extra']]
    assert [{k: v for k, v in g.items() if k not in ('params', 'param_names')} for g in tsd['param_groups']] == \
        [{k: v for k, v in g.items() if k != 'params'} for g in sd['param_groups']]
    for i, n in enumerate(fqns + ['extra']):
        assert tsd['state'][i].keys() == sd['state'][n].keys()
        torch.testing.assert_close(tsd['state'][i]['grad_avg'], opt.state[opt.named_params()[n]]['grad_avg'], rtol=0, atol=0)
    # the named layout: the same, keyed by FQN
    assert list(sd['state']) == fqns + ['extra']
    assert all(set(s) == ADAM_KEYS for s in sd['state'].values())
    assert all(s['step'] == 2 and type(s['step']) is int for s in sd['state'].values())
    assert [g['params'] for g in sd['param_groups']] == [fqns, ['extra']]
    assert [g['lr'] for g in sd['param_groups']] == [0.01, 0.5]
    assert {k for k in sd['param_groups'][0] if k not in ('params', 'chain')} == set(opt.hypers[0])
    assert [g['chain'] for g in sd['param_groups']] == ['weight_decay,average_grad,average_sqr_grad,step_stat,adam_step'] * 2
    torch.save(sd, tmp_path / 'opt.pt')
    loaded = torch.load(tmp_path / 'opt.pt', weights_only=True)
    assert loaded['param_groups'] == sd['param_groups']
    for n, s in sd['state'].items():
        for k, v in s.items():
            if torch.is_tensor(v): torch.testing.assert_close(loaded['state'][n][k], v, rtol=0, atol=0)


@pytest.mark.parametrize('layout', ['state_dict', 'named_state_dict'])
def test_state_dict_does_not_alias_the_optimizer(layout):
    opt = trained_adam()
    sd = getattr(opt, layout)()
    sd['param_groups'][0]['lr'] = 123.
    sd['param_groups'][0]['params'].append('x')
    assert opt.hypers[0]['lr'] == 0.01 and opt.param_names == MODEL_NAMES


def test_resume_in_fresh_optimizer(tmp_path):
    "Save mid-way through a OneCycle schedule (lr and mom moving); a fresh optimizer and scheduler go on identically."
    a = cbopt.Adam(make_model(0).named_parameters(), lr=0.01, wd=0.1)
    a.state[a.params[1]]['do_wd'] = False
    sched_a = one_cycle(a)
    for i in range(4): step_random(a, 1, i), sched_a.step()
    torch.save({'opt': a.state_dict(), 'sched': sched_a.state_dict()}, tmp_path / 'ckpt.pt')
    m = make_model(7)  # another model, with a's weights loaded into it
    with torch.no_grad():
        for p, q in zip(m.parameters(), a.params): p.copy_(q)
    b = cbopt.Adam(m.named_parameters(), lr=0.5, wd=0.1)
    b.state[b.params[1]]['do_wd'] = False  # flags are the model's (fastai's Learner sets them), not the checkpoint's
    sched_b = one_cycle(b)
    ckpt = torch.load(tmp_path / 'ckpt.pt', weights_only=True)
    b.load_state_dict(ckpt['opt']), sched_b.load_state_dict(ckpt['sched'])
    assert b.hypers == a.hypers
    assert_same_state(b, a)
    for i in range(100, 104):
        step_random(a, 1, i), step_random(b, 1, i)
        sched_a.step(), sched_b.step()
        assert b.hypers == a.hypers
    assert_same_state(b, a)


# -- init_state --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('make', [lambda ps: cbopt.Adam(ps, lr=0.1, wd=0.1), lambda ps: cbopt.SGD(ps, lr=0.1, mom=0.9, wd=0.1),
                                  lambda ps: cbopt.RMSProp(ps, lr=0.1, mom=0.5), lambda ps: cbopt.ranger(ps, lr=0.1)],
                         ids=['adam', 'sgd', 'rmsprop', 'ranger'])
def test_init_state(make):
    "init_state creates the declared state as it is before a first step: no param changes, and training on is bit-exact."
    m = make_model()
    opt = make(m.named_parameters())
    opt.state[opt.params[0]]['do_wd'] = False
    before = [p.detach().clone() for p in m.parameters()]
    opt.init_state()
    for p, b in zip(m.parameters(), before): torch.testing.assert_close(p, b, rtol=0, atol=0)
    assert all(p.grad is None for p in m.parameters())
    assert all(split_flags(opt.state[p])[0] for p in opt.params)  # every param has its state
    for p in opt.params:
        for k, v in opt.state[p].items():
            if k == 'slow_p': torch.testing.assert_close(v, p, rtol=0, atol=0)  # Lookahead's slow weights: the params
            elif torch.is_tensor(v): assert v.shape == p.shape and not v.any(), k  # moments start at zero
            elif k in ('step', 'la_step'): assert v == 0, k
    ref_m = make_model()
    ref = make(ref_m.named_parameters())
    ref.state[ref.params[0]]['do_wd'] = False
    opt.backend = ref.backend = 'loop'  # (under auto, Adam's state-complete first step would take torch's fused kernel)
    step_random(opt, 3), step_random(ref, 3)  # the same as never calling init_state
    assert_same_state(opt, ref)
    assert opt.state[opt.params[0]]['do_wd'] is False
    snap = state_snapshot(opt)
    opt.init_state()  # existing state is kept
    assert_same_snapshot(state_snapshot(opt), snap)


def test_init_state_undeclared_chain_dry_runs():
    "A fastai-style callback that declares no state: init_state takes the state a first step with a zero grad leaves."
    def ema(p, grad_avg=None, **kwargs):
        if grad_avg is None: grad_avg = torch.ones_like(p.grad)
        grad_avg.mul_(0.5).add_(p.grad)
        return {'grad_avg': grad_avg}
    opt = cbopt.Optimizer(make_model().named_parameters(), [ema, cbopt.momentum_step], lr=0.1)
    opt.init_state()
    assert all(torch.equal(opt.state[p]['grad_avg'], torch.full_like(p, 0.5)) for p in opt.params)


def test_init_state_then_load():
    "An initialised optimizer (e.g. for a distributed checkpoint) loads a trained state_dict strictly."
    src, dst = trained_adam(0), cbopt.Adam(make_model(1).named_parameters(), lr=0.01, wd=0.1)
    dst.init_state()
    dst.load_state_dict(src.state_dict())
    assert_same_snapshot(state_snapshot(dst), state_snapshot(src))


def test_dcp_state_dict_is_keyed_by_model_names_and_loads_back():
    "torch's DCP helpers read cbopt's state_dict as a torch.optim one: the model's FQNs, cbopt's state and hypers."
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    m = make_model(0)
    opt = step_random(cbopt.Adam(m.parameters(), lr=0.01, wd=0.1), 3)  # positional names: DCP names them by the model
    osd = get_optimizer_state_dict(m, opt)
    assert list(osd['state']) == MODEL_NAMES and all(set(s) == ADAM_KEYS for s in osd['state'].values())
    assert osd['param_groups'][0]['params'] == MODEL_NAMES and osd['param_groups'][0]['wd'] == 0.1
    m2 = make_model(1)
    dst = cbopt.Adam(m2.named_parameters(), lr=0.5)
    set_optimizer_state_dict(m2, dst, osd)
    assert dst.hypers == opt.hypers
    for p, q in zip(opt.params, dst.params): torch.testing.assert_close(dst.state[q]['sqr_avg'], opt.state[p]['sqr_avg'], rtol=0, atol=0)


@pytest.mark.parametrize('case', DCP_FLAT_CASES)
@pytest.mark.filterwarnings('ignore:torch.distributed is disabled')
def test_dcp_flattened_state_dict_round_trips_bit_for_bit(case):
    """`get_state_dict(..., options=StateDictOptions(flatten_optimizer_state_dict=True))` (torchtitan's) flattens
    cbopt's checkpoint to `state.<fqn>.<key>` and `param_groups.<fqn>.<entry>`, and `set_state_dict` rebuilds each group
    from the entries of the live group: those are the checkpoint's (its `chain`, `mom` without torch's alias, the
    whole-model state), so another optimizer (of other params, stepped otherwise) loads it bit for bit, and both go
    on alike; a checkpoint of another chain is refused by name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    build = DCP_FLAT_CASES[case]
    src_model = make_model(0)
    src = step_random(build(src_model), 5)  # (mid-accumulation: 2 micro-batches summed)
    msd, osd = get_state_dict(src_model, src, options=flat)
    chains = [g['chain'] for g in src.state_dict()['param_groups']]
    assert {k for k in osd if k.endswith('.chain')} == {f'param_groups.{n}.chain' for n in MODEL_NAMES}
    assert sorted({osd[f'param_groups.{n}.chain'] for n in MODEL_NAMES}) == sorted(set(chains))
    assert not any(k.endswith(('.momentum', '.cbs')) for k in osd)
    dst_model = make_model(1)
    dst = step_random(build(dst_model), 2, start=50)
    set_state_dict(dst_model, dst, model_state_dict=msd, optim_state_dict=osd, options=flat)
    assert_same_snapshot(state_snapshot(dst), state_snapshot(src))
    assert [model_entries(g) for g in dst.state_dict()['param_groups']] == [model_entries(g) for g in src.state_dict()['param_groups']]
    for p, q in zip(dst_model.parameters(), src_model.parameters()): assert torch.equal(p, q)
    step_random(src, 4, start=5), step_random(dst, 4, start=5)
    assert_same_snapshot(state_snapshot(dst), state_snapshot(src))
    for p, q in zip(dst_model.parameters(), src_model.parameters()): assert torch.equal(p, q)
    if case == 'sgd':  # the same entries and state names, another chain: cbopt refuses it, naming the chain
        other_model = make_model(1)
        other = cbopt.Optimizer(other_model.named_parameters(), [cbopt.l2_reg, cbopt.average_grad, cbopt.momentum_step],
                                lr=0.1, mom=0.9, wd=0.01)
        with pytest.raises(ValueError, match=r"was saved by the chain \[weight_decay,average_grad,momentum_step\], but "
                                             r"runs \[l2_reg,average_grad,momentum_step\]"):
            set_state_dict(other_model, other, model_state_dict=msd, optim_state_dict=osd, options=flat)


def test_named_state_dict_is_a_plain_snapshot() -> None:
    opt = small_adam()
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
    fresh = small_adam(steps=0)
    assert named_state_dict(fresh)['state'] == {}
