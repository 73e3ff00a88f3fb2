"""A framework's own keys in param groups and per-param state (issue #29's rule): carried through `state_dict()` and
`load_state_dict()` untouched, in every format, as torch.optim carries them; while a misspelt or foreign hyper and
another algorithm's state are still refused. Checked against torch's AdamW doing the same."""
import pytest
import torch
from torch import nn

import cbopt


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def _step(model, opt, n=2):
    for _ in range(n):
        model(torch.randn(5, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


MAKERS = {
    'cbopt.Adam': lambda params: cbopt.Adam(params, lr=1e-2),
    'cbopt.optim.AdamW': lambda params: cbopt.optim.AdamW(params, lr=1e-2),
    'torch.optim.AdamW': lambda params: torch.optim.AdamW(params, lr=1e-2),
}


@pytest.mark.parametrize('make', MAKERS.values(), ids=MAKERS)
def test_group_keys_carried(make):
    "timm's `lr_scale`/`use_fallback` in a group dict, and a key written into a live group (Lookahead's), round trip."
    model = _model()
    opt = make([{'params': list(model[0].parameters()), 'lr_scale': 0.5, 'use_fallback': False},
                {'params': list(model[1].parameters()), 'lr_scale': 1.0}])
    for g in opt.param_groups: g['lookahead_step'] = 0
    _step(model, opt)
    opt.param_groups[0]['lookahead_step'] = 7
    sd = opt.state_dict()
    assert [g['lr_scale'] for g in sd['param_groups']] == [0.5, 1.0]
    assert sd['param_groups'][0]['lookahead_step'] == 7 and sd['param_groups'][0]['use_fallback'] is False
    fresh = make([{'params': list(model[0].parameters()), 'lr_scale': 0.1}, {'params': list(model[1].parameters())}])
    fresh.load_state_dict(sd)
    assert [g['lr_scale'] for g in fresh.param_groups] == [0.5, 1.0]
    assert fresh.param_groups[0]['lookahead_step'] == 7


@pytest.mark.parametrize('make', MAKERS.values(), ids=MAKERS)
def test_foreign_state_carried(make):
    "timm Lookahead's `lookahead_slow_buff` in `opt.state[p]`: saved and loaded as it is, beside the algorithm's state."
    model = _model()
    opt = make(model.parameters())
    _step(model, opt)
    p = next(model.parameters())
    opt.state[p]['lookahead_slow_buff'] = p.detach().clone() + 1
    _step(model, opt)  # (the step runs beside it)
    sd = opt.state_dict()
    assert torch.equal(sd['state'][0]['lookahead_slow_buff'], p.detach() * 0 + opt.state[p]['lookahead_slow_buff'])
    twin = torch.optim.AdamW(_model().parameters(), lr=1e-2) if make is not MAKERS['cbopt.Adam'] else make(_model().parameters())
    for target in (make(model.parameters()), twin):
        target.load_state_dict(sd)
        q = target.param_groups[0]['params'][0]
        assert torch.equal(target.state[q]['lookahead_slow_buff'], opt.state[p]['lookahead_slow_buff'])
    target = make(model.parameters())  # a checkpoint without it into an optimizer with it: torch drops it, and so do we
    _step(model, target)
    target.state[next(model.parameters())]['lookahead_slow_buff'] = torch.zeros(3, 4)
    clean = make(model.parameters())
    _step(model, clean)
    target.load_state_dict(clean.state_dict())
    assert 'lookahead_slow_buff' not in target.state[next(model.parameters())]


def test_torch_state_with_foreign_entry_loads():
    "torch's AdamW state_dict with a framework's entry loads into cbopt.optim.AdamW, which saves it back for torch."
    model = _model()
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, ref)
    for p in model.parameters(): ref.state[p]['ema'] = p.detach().clone()
    ours = cbopt.optim.AdamW(model.parameters(), lr=1e-2)
    ours.load_state_dict(ref.state_dict())
    for p in model.parameters(): assert torch.equal(ours.state[p]['ema'], ref.state[p]['ema'])
    back = ours.state_dict()
    assert all(torch.equal(back['state'][i]['ema'], ref.state_dict()['state'][i]['ema']) for i in range(4))


def test_misspelt_and_foreign_hypers_refused():
    "What would silently change the math is still refused: the optimizer's keywords, misspelt or other hypers in groups."
    model = _model()
    with pytest.raises(TypeError, match=r"hyper 'lr_scale' is read by no callback"):
        cbopt.Optimizer(model.parameters(), [cbopt.sgd_step], lr=0.1, lr_scale=0.5)  # (keywords are the optimizer's: always checked)
    with pytest.raises(TypeError, match=r"hyper 'weight_decy' \(group 0\).*did you mean 'weight_decay'"):
        cbopt.optim.AdamW([{'params': model.parameters(), 'weight_decy': 0.1}])
    with pytest.raises(TypeError, match=r"hyper 'wdd' \(group 0\).*did you mean 'wd'"):
        cbopt.Adam([{'params': model.parameters(), 'wdd': 0.1}])
    with pytest.raises(TypeError, match=r"hyper 'momentum_decay' \(group 0\) is read by no callback"):
        cbopt.Adam([{'params': model.parameters(), 'momentum_decay': 0.1}])  # (NAdam's: would do nothing here)
    opt = cbopt.Adam(model[0].parameters())
    with pytest.raises(TypeError, match=r"hyper 'sqr_mon' \(group 1\).*did you mean 'sqr_mom'"):
        opt.add_param_group({'params': model[1].parameters(), 'sqr_mon': 0.9})
    opt.add_param_group({'params': model[1].parameters(), 'layer_id': 3})  # (a framework's: carried)
    assert opt.param_groups[1]['layer_id'] == 3
    ada = cbopt.optim.Adagrad([{'params': model.parameters(), 'lr_scale': 0.5}])  # (not a misspelt lr_decay)
    assert ada.state_dict()['param_groups'][0]['lr_scale'] == 0.5
    with pytest.raises(TypeError, match=r"hyper 'lr_decy' \(group 0\).*did you mean 'lr_decay'"):
        cbopt.optim.Adagrad([{'params': model.parameters(), 'lr_decy': 0.5}])


def test_other_algorithms_state_refused():
    "State of another algorithm (torch's SGD momentum in an Adam, in torch's format) is refused, not carried."
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, sgd)
    adam = cbopt.optim.Adam(model.parameters())
    with pytest.raises(ValueError, match=r"momentum_buffer|different algorithm|has state keys"):
        adam.load_state_dict(sgd.state_dict())
    ours = cbopt.Adam(model.parameters())
    _step(model, ours)
    sd = ours.state_dict()
    sd['state'][0]['momentum_buffer'] = torch.zeros(3, 4)
    with pytest.raises(ValueError, match=r"different algorithm"):
        cbopt.Adam(model.parameters()).load_state_dict(sd)
