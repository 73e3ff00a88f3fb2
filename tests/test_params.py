"""Every accepted form of `params` gives the same tensors, grouped the same way, with unique FQN names; bad input
fails with an error naming the culprit. Hypers given as defaults spread over groups as fastai's `set_hyper` does."""
import math

import pytest
import torch
from fastai.optimizer import Optimizer as FastaiOptimizer
from fastai.optimizer import average_grad as fai_average_grad
from fastai.optimizer import momentum_step as fai_momentum_step
from fastai.optimizer import weight_decay as fai_weight_decay
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import cbopt
from cbopt import Optimizer
from conftest import random_grads

CBS = [cbopt.weight_decay, cbopt.average_grad, cbopt.momentum_step]
FAI_CBS = [fai_weight_decay, fai_average_grad, fai_momentum_step]


def models():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)), nn.Linear(2, 1)


def step_n(opt, n=3):
    for i in range(n):
        random_grads(opt.params, i)
        opt.step()


# -- each form, alone and as the `params` of a group ---------------------------------------------------------------
def _forms():
    "(id, make params from (enc, head), expected names); names of unnamed params are their positions."
    enc_names = ['0.weight', '0.bias', '2.weight', '2.bias']
    return [
        ('tensors', lambda e, h: e.parameters(), ['0', '1', '2', '3']),
        ('tensor-list', lambda e, h: list(e.parameters()), ['0', '1', '2', '3']),
        ('named_parameters', lambda e, h: e.named_parameters(), enc_names),
        ('dict', lambda e, h: dict(e.named_parameters()), enc_names),
        ('nested', lambda e, h: {'enc': e.named_parameters(), 'head': dict(h.named_parameters())},
         [f'enc.{n}' for n in enc_names] + ['head.weight', 'head.bias']),
        ('nested-unnamed', lambda e, h: {'enc': e.parameters(), 'head': [h.weight]},
         ['enc.0', 'enc.1', 'enc.2', 'enc.3', 'head.0']),
        ('nested-deep', lambda e, h: {'m': {'enc': e.named_parameters(), 'head': h.named_parameters()}},
         [f'm.enc.{n}' for n in enc_names] + ['m.head.weight', 'm.head.bias']),
        ('nested-pairs', lambda e, h: [('enc', e.named_parameters()), ('head', h.named_parameters())],
         [f'enc.{n}' for n in enc_names] + ['head.weight', 'head.bias']),
        ('single-tensor', lambda e, h: e[0].weight, ['0']),
    ]


def _expected_tensors(form_id, enc, head):
    if form_id == 'single-tensor': return [enc[0].weight]
    if form_id == 'nested-unnamed': return [*enc.parameters(), head.weight]
    if form_id.startswith('nested'): return [*enc.parameters(), *head.parameters()]
    return list(enc.parameters())


@pytest.mark.parametrize('as_group', [False, True], ids=['plain', 'in-group-dict'])
@pytest.mark.parametrize('form_id,make,names', _forms(), ids=[f[0] for f in _forms()])
def test_param_forms(form_id, make, names, as_group):
    enc, head = models()
    params = make(enc, head)
    opt = Optimizer([{'params': params, 'lr': 0.3}] if as_group else params, CBS, lr=0.1, mom=0.9)
    expected = _expected_tensors(form_id, enc, head)
    assert len(opt.param_groups) == 1
    assert len(opt.params) == len(expected) and all(p is q for p, q in zip(opt.params, expected))
    assert opt.param_names == names
    assert opt.hypers[0]['lr'] == (0.3 if as_group else 0.1)
    if form_id.startswith('nested') and form_id != 'nested-unnamed':  # FQNs resolve in the combined model
        root = nn.ModuleDict({'enc': enc, 'head': head})
        if form_id == 'nested-deep': root = nn.ModuleDict({'m': root})
        assert all(root.get_parameter(n) is p for n, p in opt.named_params().items())


def test_unnamed_names_are_stable_positions():
    enc, head = models()
    groups = lambda: [list(enc.parameters()), list(head.parameters())]
    a, b = Optimizer(groups(), CBS), Optimizer(groups(), CBS)
    assert a.param_names == b.param_names == [str(i) for i in range(6)]
    assert [g['param_names'] for g in a.param_groups] == [['0', '1', '2', '3'], ['4', '5']]
    # named and unnamed groups mix; unnamed ones still count their position among all params
    opt = Optimizer([{'params': enc.named_parameters()}, {'params': head.parameters()}], CBS)
    assert opt.param_names == ['0.weight', '0.bias', '2.weight', '2.bias', '4', '5']


def test_torch_group_dicts_with_per_group_hypers():
    enc, head = models()
    opt = Optimizer([{'params': enc.named_parameters(), 'lr': 0.01, 'wd': 0.1},
                     {'params': head.parameters(), 'mom': 0.5}], CBS, lr=0.1, mom=0.9, wd=0.)
    assert [h['lr'] for h in opt.hypers] == [0.01, 0.1]
    assert [h['wd'] for h in opt.hypers] == [0.1, 0.]
    assert [h['mom'] for h in opt.hypers] == [0.9, 0.5]
    # the per-group hypers are the ones used: compare with fastai, whose hypers we set to the same values
    ref_enc, ref_head = models()
    ref = FastaiOptimizer([list(ref_enc.parameters()), list(ref_head.parameters())], FAI_CBS, lr=0.1, mom=0.9, wd=0.)
    ref.hypers[0].update(lr=0.01, wd=0.1)
    ref.hypers[1].update(mom=0.5)
    for i in range(4):
        random_grads(opt.params, i)
        random_grads([p for pl in ref.param_lists for p in pl], i)
        opt.step(), ref.step()
    for p, q in zip(opt.params, [*ref_enc.parameters(), *ref_head.parameters()]): torch.testing.assert_close(p, q)


def test_list_of_lists_fastai_splitter():
    enc, head = models()
    split = [list(enc[0].parameters()), list(enc[2].parameters()), list(head.parameters())]
    opt = Optimizer(split, CBS, lr=slice(1e-3, 1e-1))
    assert [len(g['params']) for g in opt.param_groups] == [2, 2, 2]
    assert all(p is q for g, pl in zip(opt.param_groups, split) for p, q in zip(g['params'], pl))
    ref = FastaiOptimizer(split, FAI_CBS, lr=slice(1e-3, 1e-1))
    assert [h['lr'] for h in opt.hypers] == [h['lr'] for h in ref.hypers]
    # lists of named pairs are groups too, and keep their names
    opt = Optimizer([list(enc.named_parameters()), list(head.named_parameters())], CBS)
    assert [g['param_names'] for g in opt.param_groups] == [['0.weight', '0.bias', '2.weight', '2.bias'],
                                                           ['weight', 'bias']]


# -- errors that name the culprit --------------------------------------------------------------------------------
def test_empty_params():
    with pytest.raises(ValueError, match='empty'): Optimizer([], CBS)
    with pytest.raises(ValueError, match='empty'): Optimizer([[], []], CBS)
    with pytest.raises(ValueError, match='empty'): Optimizer({}, CBS)
    empty = Optimizer([{'params': []}], CBS, lr=0.1)  # torch's group dicts may be empty (ZeRO's rank that owns nothing)
    empty.step()
    assert empty.params == [] and empty.state_dict()['param_groups'][0]['params'] == []


def test_param_in_two_groups():
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match=r"'second'.*same tensor as 'first'"):
        Optimizer([{'params': {'first': a}}, {'params': {'second': a, 'b': b}}], CBS)
    with pytest.raises(ValueError, match="same tensor"): Optimizer([[a, b], [a]], CBS)
    with pytest.raises(ValueError, match="same tensor"): Optimizer([a, a], CBS)


def test_duplicate_name():
    "A name repeated within one group is refused; across groups see test_names_repeated_across_groups."
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match=r"duplicate param name 'w'"):
        Optimizer([{'params': [('w', a), ('w', b)]}], CBS)
    enc, head = models()  # two models whose own names collide, in one group
    with pytest.raises(ValueError, match=r"duplicate param name 'weight'"):
        Optimizer([*head.named_parameters(), *nn.Linear(2, 2).named_parameters()], CBS)


def test_names_repeated_across_groups():
    """Groups built from submodules' `named_parameters()` (`weight`, `bias` in every group) are accepted, as torch
    accepts them; cbopt keys each such name `<group>/<name>`, and their checkpoints load by position both ways with
    torch's (whose param_names are the bare names, which name no param once: torch loads them by position too)."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    m, ref = model(), model()
    groups = lambda mod: [{'params': mod[0].named_parameters()}, {'params': mod[1].named_parameters(), 'lr': 0.1}]
    opt, torch_opt = cbopt.optim.Adam(groups(m), lr=0.01), torch.optim.Adam(groups(ref), lr=0.01)
    assert opt.param_names == ['0/weight', '0/bias', '1/weight', '1/bias']
    assert [g['param_names'] for g in torch_opt.param_groups] == [['weight', 'bias'], ['weight', 'bias']]
    for o, mod in ((opt, m), (torch_opt, ref)):
        for step in range(3):
            o.zero_grad()
            mod(torch.randn(5, 3, generator=torch.Generator().manual_seed(step))).pow(2).sum().backward()
            o.step()
    for p, q in zip(m.parameters(), ref.parameters()): torch.testing.assert_close(p, q)
    mine = cbopt.optim.Adam([{'params': m[0].parameters()}, {'params': m[1].parameters(), 'lr': 0.1}])
    mine.load_state_dict(torch_opt.state_dict())  # torch's bare names: by position
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(mine.state[p]['grad_avg'], torch_opt.state[q]['exp_avg'])
    assert mine.param_names == opt.param_names  # its unnamed params take the checkpoint's names, as torch's groups do
    theirs = torch.optim.Adam(groups(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))), lr=0.01)
    theirs.load_state_dict(opt.state_dict())
    assert [len(s) for s in theirs.state.values()] == [3] * 4
    with pytest.raises(ValueError, match=r"param group 1 has 2 params in the torch state_dict, 1 here"):
        cbopt.optim.Adam([{'params': m[0].parameters()}, {'params': [m[1].weight]}]).load_state_dict(torch_opt.state_dict())
    opt.add_param_group({'params': [('bias', nn.Parameter(torch.zeros(2)))]})  # a name the groups have: keyed by group
    assert opt.param_names[-1] == '2/bias' and opt.param_names[:2] == ['0/weight', '0/bias']
    assert torch.optim.Adam(groups(model())).param_groups  # (torch's accepts what was added too)


def test_param_in_two_groups_has_torchs_message():
    "torch's words (its test_errors matches them), for the constructor and add_param_group alike, as torch's."
    a = nn.Parameter(torch.zeros(2))
    for cls in (torch.optim.SGD, cbopt.optim.SGD):
        with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
            cls([{'params': a}, {'params': a}], lr=0.1)
        with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
            cls([a], lr=0.1).add_param_group({'params': [a]})


def test_non_leaf():
    a = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match=r"'doubled'.*not a leaf"): Optimizer({'ok': a, 'doubled': a * 2}, CBS)
    with pytest.raises(ValueError, match=r"'1'.*not a leaf"): Optimizer([a, a + 1], CBS)


def test_non_tensor():
    a = torch.zeros(2, requires_grad=True)
    with pytest.raises(TypeError, match=r"'x'.*float"): Optimizer({'ok': a, 'x': 3.0}, CBS)
    with pytest.raises(TypeError, match="str"): Optimizer([a, 'b'], CBS)
    with pytest.raises(TypeError, match="int"): Optimizer(3, CBS)
    with pytest.raises(TypeError, match="int"): Optimizer([{'params': [a, 7]}], CBS)


# -- property tests ------------------------------------------------------------------------------------------------
FORMS = ['tensors', 'named', 'dict', 'nested']
shapes = st.lists(st.integers(1, 3), min_size=1, max_size=2).map(tuple)
group_spec = st.tuples(st.lists(shapes, min_size=1, max_size=3), st.sampled_from(FORMS))


def hyper_value(lo, hi):
    "A hyper as a scalar, a list (filled per group later), a slice(a, b) or a slice(None, b)."
    return st.one_of(st.floats(lo, hi).map(lambda v: ('scalar', v)),
                     st.lists(st.floats(lo, hi), min_size=8, max_size=8).map(lambda v: ('list', v)),
                     st.tuples(st.floats(lo, hi), st.floats(lo, hi)).map(lambda v: ('slice', v)),
                     st.floats(lo, hi).map(lambda v: ('slice-none', v)))


def make_hyper(kind, v, n):
    if kind == 'scalar': return v
    if kind == 'list': return v[:n]
    if kind == 'slice': return slice(*v)
    return slice(None, v)


def build(spec, seed):
    "Params in the forms of `spec`, with the tensors of each group and their expected names."
    torch.manual_seed(seed)
    params, tensors, names, pos = [], [], [], 0
    for gi, (shps, form) in enumerate(spec):
        ts = [torch.randn(s, requires_grad=True) for s in shps]
        if form == 'tensors': ps, ns = list(ts), [str(pos + j) for j in range(len(ts))]
        elif form == 'named': ps, ns = [(f'g{gi}_{j}', t) for j, t in enumerate(ts)], [f'g{gi}_{j}' for j in range(len(ts))]
        elif form == 'dict': ps, ns = {f'g{gi}.w{j}': t for j, t in enumerate(ts)}, [f'g{gi}.w{j}' for j in range(len(ts))]
        else: ps, ns = {f'm{gi}': {f'l{j}': t for j, t in enumerate(ts)}}, [f'm{gi}.l{j}' for j in range(len(ts))]
        params.append(ps); tensors.append(ts); names.append(ns); pos += len(ts)
    return params, tensors, names


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=st.lists(group_spec, min_size=1, max_size=4), top=st.sampled_from(['group-dicts', 'lists', 'bare']),
       lr=hyper_value(1e-3, 0.1), mom=hyper_value(0.1, 0.9), wd=hyper_value(1e-4, 0.1))
def test_forms_property(spec, top, lr, mom, wd):
    if top == 'lists' and any(f in ('dict', 'nested') for _, f in spec): top = 'group-dicts'  # dicts are not lists
    if top == 'bare' and len(spec) > 1: top = 'group-dicts'
    params, tensors, names = build(spec, 0)
    n = len(spec)
    if top == 'group-dicts': params = [{'params': ps} for ps in params]
    elif top == 'bare': params = params[0]
    hypers = dict(lr=make_hyper(*lr, n), mom=make_hyper(*mom, n), wd=make_hyper(*wd, n))
    opt = Optimizer(params, CBS, **hypers)

    # the same tensors, in the same groups
    assert [len(g['params']) for g in opt.param_groups] == [len(ts) for ts in tensors]
    assert all(p is t for g, ts in zip(opt.param_groups, tensors) for p, t in zip(g['params'], ts))
    # unique, expected FQNs
    assert [g['param_names'] for g in opt.param_groups] == names
    assert len(set(opt.param_names)) == len(opt.param_names)
    # hypers spread over groups as fastai's set_hyper does
    fai = FastaiOptimizer([list(ts) for ts in tensors], FAI_CBS, **hypers)
    assert len(opt.hypers) == len(fai.hypers)
    for h, fh in zip(opt.hypers, fai.hypers):
        for k in ('lr', 'mom', 'wd'): assert math.isclose(h[k], fh[k], rel_tol=1e-12), (k, h[k], fh[k])

    # stepping equals an optimizer built from plain lists of (copied) tensors
    _, ref_tensors, _ = build(spec, 0)
    ref = Optimizer([list(ts) for ts in ref_tensors], CBS, **hypers)
    step_n(opt), step_n(ref)
    for p, q in zip(opt.params, ref.params): torch.testing.assert_close(p, q, rtol=0, atol=0)
    for p, q in zip(opt.params, ref.params): torch.testing.assert_close(opt.state[p]['grad_avg'], ref.state[q]['grad_avg'])


def test_list_of_named_dicts_is_a_list_of_groups():
    enc, head = models()
    opt = Optimizer([{'enc': enc.named_parameters()}, {'head': head.named_parameters()}], CBS, lr=slice(1e-3, 1e-1))
    assert [len(g['params']) for g in opt.param_groups] == [4, 2]
    assert opt.param_names == [f'enc.{n}' for n, _ in enc.named_parameters()] + [f'head.{n}' for n, _ in head.named_parameters()]
    assert [h['lr'] for h in opt.hypers] == pytest.approx([1e-3, 1e-1])
    gens = Optimizer([enc.named_parameters(), head.named_parameters()], CBS, lr=slice(1e-3, 1e-1))
    assert [len(g['params']) for g in gens.param_groups] == [4, 2]


# -- every refusal of a params form, in its words (issue #14: mutation testing of `cbopt/params.py`) -----------------
W, V = torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True)
PAIR = "not a Tensor or a (name, Tensor) pair"
BAD_FORMS = {  # params -> (error, the whole message)
    'group dict nested under a name': ({'enc': {'params': [W]}},
                                       (TypeError, "a param group dict cannot be nested inside params at 'enc'")),
    'int key': ({1: W}, (TypeError, "param names must be non-empty strings, got 1 (int)")),
    'int key under a name': ({'enc': {1: W}}, (TypeError, "param names must be non-empty strings, got 1 (int) at 'enc'")),
    'number under a name': ({'enc': 3}, (TypeError, "params at 'enc' is an int, not a Tensor, a dict or an iterable of "
                                                    "them")),
    'str under a hyper name': ({'lr': 'x'}, (TypeError, "params at 'lr' is a str, not a Tensor, a dict or an iterable "
                                                        "of them")),
    'hyper of a nested group dict without params': (
        {'body': {'lr': 0.1}}, (TypeError, "params at 'body.lr' is a float, not a Tensor, a dict or an iterable of them "
                                           "(is 'lr' a hyper of a group dict that has no 'params' entry?)")),
    'group dict whose params is a number': ([{'params': 3}], (TypeError, "params is an int, not a Tensor, a dict or an "
                                                                         "iterable of them")),
    'empty name in a pair': ([('', W)], (TypeError, "param names must be non-empty strings, got '' at position 0")),
    'empty name in a pair under a name': ({'enc': [('', W)]}, (TypeError, "param names must be non-empty strings, got "
                                                                          "'' at position 0 at 'enc'")),
    'int-named pair under a name': ({'enc': [(1, W)]}, (TypeError, "params at 'enc' holds a (name, Tensor) pair at "
                                                                   "position 0 whose name is an int (1): param names "
                                                                   "are strings")),
    'int in a list under a name': ({'enc': [W, 3]}, (TypeError, f"params at 'enc' holds an int at position 1, {PAIR}")),
    'set in a list': ([W, {V}], (TypeError, "params is a set: " + cbopt.core.params.SET_MSG)),
    'empty list': ([], (ValueError, "optimizer got an empty parameter list (a generator such as model.parameters() "
                                    "gives its params only once: was it used before?)")),
    'group dicts mixed with tensors': ([{'params': [W]}, V], (TypeError, "params mixes group dicts with other entries: "
                                                                         "give either all group dicts or none")),
    'mom and momentum differing in the second group': (
        [{'params': [W]}, {'params': [V], 'mom': 0.9, 'momentum': 0.8}],
        (ValueError, "param group 1 gives both 'mom' (0.9) and its torch name 'momentum' (0.8): give one")),
}


@pytest.mark.parametrize('form', BAD_FORMS)
def test_bad_forms_raise_these_words(form: str) -> None:
    "Each refusal of `named_groups` names the culprit, where it is (the dotted name, the position, the group), whole."
    params, (err, msg) = BAD_FORMS[form]
    with pytest.raises(err) as e: cbopt.core.params.named_groups(params)
    assert str(e.value) == msg


def test_dicts_in_a_list_are_flattened_in_place() -> None:
    "A name -> param dict among a list's tensors names its params under the list's own name, in order."
    a, b, c = (torch.zeros(i + 1, requires_grad=True) for i in range(3))
    (g,) = cbopt.core.params.named_groups({'enc': [a, {'w': b}, c]})
    assert g['param_names'] == ['enc.0', 'enc.w', 'enc.2'] and all(x is y for x, y in zip(g['params'], [a, b, c]))
    (g,) = cbopt.core.params.named_groups([a, {'w': b}])
    assert g['param_names'] == ['0', 'w'] and g['params'][1] is b


def test_a_lone_group_dict_is_one_group() -> None:
    "A group dict on its own (not in a list) is one group with its hypers, as if in a list."
    (g,) = cbopt.core.params.named_groups({'params': [W, V], 'lr': 0.1})
    assert g['lr'] == 0.1 and g['param_names'] == ['0', '1'] and g['params'][0] is W and g['params'][1] is V
