"""Named state_dicts: keyed by FQN, readable with `weights_only=True`, loaded strictly and atomically (a bad checkpoint
names the culprit and changes nothing), cast to the params' dtype; torch.optim's and fastai's state_dicts load too."""
import copy

import pytest
import torch
from fastai.optimizer import Adam as FastaiAdam
from torch import nn

import cbopt
from cbopt.core.hypers import model_entries
from cbopt.core.flags import split_flags
from conftest import make_model, random_grads

NAMES = ['0.weight', '0.bias', '2.weight', '2.bias']  # make_model's
ADAM_KEYS = {'grad_avg', 'sqr_avg', 'step'}


def step_random(opt, steps, start=0):
    "`steps` steps of `opt` on seeded random grads (seeds `start`, `start+1`, ...)."
    for i in range(start, start + steps):
        random_grads(opt.params, i)
        opt.step()
    return opt


def adam(seed=0, lr=0.01, dtype=torch.float32, steps=3):
    return step_random(cbopt.Adam(make_model(seed, dtype).named_parameters(), lr=lr, wd=0.1), steps, start=seed * 10)


def snapshot(opt):
    "Everything a load may change: each param's state (deep-copied) and the hypers, by name."
    return ({n: copy.deepcopy(dict(opt.state[p])) for n, p in opt.named_params().items() if p in opt.state},
            [dict(h) for h in opt.hypers])


def assert_same(a, b):
    "Deep equality of snapshots, tensors compared exactly (dtype included)."
    (sa, ha), (sb, hb) = a, b
    assert ha == hb
    assert sa.keys() == sb.keys()
    for n in sa:
        assert sa[n].keys() == sb[n].keys(), n
        for k, v in sa[n].items():
            if torch.is_tensor(v): torch.testing.assert_close(v, sb[n][k], rtol=0, atol=0)
            else: assert v == sb[n][k], (n, k)


def assert_same_state(opt, ref):
    "Two optimizers over different params have equal state and params, param by param (by name)."
    assert_same(snapshot(opt), snapshot(ref))
    for p, q in zip(opt.params, ref.params): torch.testing.assert_close(p, q, rtol=0, atol=0)


# -- format ------------------------------------------------------------------------------------------------------
def test_format_and_weights_only(tmp_path):
    enc, head = make_model(), nn.Linear(2, 1)
    opt = cbopt.Adam({'enc': enc.named_parameters(), 'head': dict(head.named_parameters())}, lr=0.01)
    opt.add_param_group({'params': {'extra': torch.zeros(2, requires_grad=True)}, 'lr': 0.5})
    step_random(opt, 2)
    sd, tsd = opt.named_state_dict(), opt.state_dict()
    fqns = [f'enc.{n}' for n in NAMES] + ['head.weight', 'head.bias']
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
    opt = adam()
    sd = getattr(opt, layout)()
    sd['param_groups'][0]['lr'] = 123.
    sd['param_groups'][0]['params'].append('x')
    assert opt.hypers[0]['lr'] == 0.01 and opt.param_names == NAMES


# -- resume ------------------------------------------------------------------------------------------------------
def one_cycle(opt): return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=20)


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


def test_load_copies_tensors():
    a, b = adam(0), cbopt.Adam(make_model(0).named_parameters(), lr=0.01, wd=0.1)
    b.load_state_dict(a.state_dict())
    for p, q in zip(a.params, b.params):
        assert b.state[q]['grad_avg'].data_ptr() != a.state[p]['grad_avg'].data_ptr()


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


@pytest.mark.parametrize('fresh', [False, True], ids=['initialised', 'fresh'])
@pytest.mark.parametrize('kind', BAD)
def test_bad_load_names_culprit_and_changes_nothing(kind, fresh):
    if fresh and kind in ('missing-state', 'empty-state'): pytest.skip('a fresh optimizer may load no state')
    src = adam(0, lr=0.02)
    src.set_hyper('eps', 1e-3)  # hypers differ too: a partial load would show in them
    dst = adam(1, lr=0.01, steps=0 if fresh else 3)
    sd, culprit = _corrupt(kind, src.named_state_dict())
    before = snapshot(dst)
    with pytest.raises((KeyError, ValueError, TypeError)) as e: dst.load_state_dict(sd)
    assert culprit in str(e.value)
    assert_same(snapshot(dst), before)
    dst.load_state_dict(src.state_dict())  # and a good checkpoint still loads afterwards
    assert_same(snapshot(dst), snapshot(src))


def test_empty_state_loads_after_clear_state():
    "The documented way to restart on purpose: clear_state() first, then a state-less checkpoint is fine."
    dst = adam(1)
    sd = {'state': {}, 'param_groups': adam(0, lr=0.02).state_dict()['param_groups']}  # (torch's layout)
    dst.clear_state()
    dst.load_state_dict(sd)
    assert dst.hypers[0]['lr'] == 0.02 and all(not dst.state[p] for p in dst.params)


# -- dtype -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('dtype', [torch.float64, torch.bfloat16])
@pytest.mark.parametrize('initialised', [False, True], ids=['fresh', 'initialised'])
def test_load_casts_to_param_dtype(dtype, initialised):
    src = adam(0)
    dst = adam(1, dtype=dtype, steps=2 if initialised else 0)
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
    src = adam(0)
    dst = cbopt.Adam(make_model(1).to('meta').named_parameters())
    dst.load_state_dict(src.state_dict())
    for p, q in zip(src.params, dst.params):
        assert {k: (v.device.type, v.shape) for k, v in dst.state[q].items() if torch.is_tensor(v)} == \
            {k: ('meta', p.shape) for k in ('grad_avg', 'sqr_avg')}
        assert dst.state[q]['step'] == 3


def _lbfgs_state_dict(dtype=torch.float32):
    "An L-BFGS of 3 steps on a small regression: its history (`d`, `old_dirs`, `old_stps`, `prev_flat_grad`) filled."
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(dtype)
    xs = torch.randn(32, 4, dtype=dtype)
    opt = cbopt.LBFGS(net.named_parameters(), history_size=5)
    def closure():
        opt.zero_grad()
        loss = (net(xs) - xs.sum(1, keepdim=True).sin()).pow(2).mean()
        loss.backward()
        return loss
    for _ in range(3): opt.step(closure)
    return net, opt.state_dict()


def _tensors(v):
    if torch.is_tensor(v): return [v]
    return [t for o in v for t in _tensors(o)] if isinstance(v, (list, tuple)) else []


@pytest.mark.parametrize('where', ['meta', 'float64'])
def test_load_moves_whole_model_state_to_param_device(where):
    """L-BFGS's history (whole-model state, None or [] before a first step: no template to load it like) follows the
    params as torch's LBFGS's does (`_process_value_according_to_param_policy`: device, and floating dtype): a
    checkpoint read with `map_location='cpu'` must step on CUDA params (`meta` stands for the other device here)."""
    net, sd = _lbfgs_state_dict()
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
    snap = snapshot(opt)
    opt.init_state()  # existing state is kept
    assert_same(snapshot(opt), snap)


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
    src, dst = adam(0), cbopt.Adam(make_model(1).named_parameters(), lr=0.01, wd=0.1)
    dst.init_state()
    dst.load_state_dict(src.state_dict())
    assert_same(snapshot(dst), snapshot(src))


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
    assert opt.param_names == NAMES
    for p, tp in zip(opt.params, tm.parameters()):
        assert set(opt.state[p]) == ADAM_KEYS and opt.state[p]['step'] == 3
        torch.testing.assert_close(opt.state[p]['grad_avg'], topt.state[tp]['exp_avg'], rtol=0, atol=0)
        torch.testing.assert_close(opt.state[p]['sqr_avg'], topt.state[tp]['exp_avg_sq'], rtol=0, atol=0)
    h = opt.hypers[0]
    assert (h['lr'], h['mom'], h['sqr_mom'], h['wd'], h['eps']) == (0.02, 0.8, 0.95, 0.1, 1e-6)
    assert opt.named_state_dict()['param_groups'][0]['params'] == NAMES


def test_torch_param_names_must_match():
    tm = nn.Sequential(make_model(0))  # names '0.0.weight', ... do not match ours
    topt = torch.optim.AdamW(tm.named_parameters())
    random_grads(list(tm.parameters()), 0)
    topt.step()
    opt = cbopt.Adam(make_model(1).named_parameters())
    before = snapshot(opt)
    with pytest.raises(KeyError, match="unknown param '0.0.weight'.*'0.weight'"): opt.load_state_dict(topt.state_dict())
    assert_same(snapshot(opt), before)


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
    assert list(opt.named_state_dict()['state']) == NAMES


# -- matching by name, by position, and names without wrapper prefixes -------------------------------------------
def _groups_by(model, keys):
    "`model`'s named params in one group per key (a name ending), in that order: another grouping and order."
    return [{'params': [(n, p) for n, p in model.named_parameters() if n.endswith(k)]} for k in keys]


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
    assert dst.param_names == (NAMES if dst_named or src_named else ['0', '1', '2', '3'])
    for p, q in zip(src.params, dst.params):
        torch.testing.assert_close(dst.state[q]['grad_avg'], src.state[p]['grad_avg'], rtol=0, atol=0)
    assert dst.hypers == src.hypers


def test_wrapper_prefixes_are_not_part_of_names():
    "torch.compile's `_orig_mod.`, DDP's `module.` and activation checkpointing's prefix go, as torch's DCP helpers do."
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    m = make_model(0)
    assert cbopt.Adam(torch.compile(m).named_parameters()).param_names == NAMES
    assert cbopt.Adam(m.named_parameters(prefix='module')).param_names == NAMES  # DDP's names
    wrapped = nn.Sequential(checkpoint_wrapper(m[0]), m[1], m[2])
    assert cbopt.Adam(wrapped.named_parameters()).param_names == NAMES
    some = cbopt.Adam({'module': dict(m[0].named_parameters()), 'head': dict(m[2].named_parameters())})  # 'module.' only when it starts every name
    assert some.param_names == ['module.weight', 'module.bias', 'head.weight', 'head.bias']
    # a checkpoint saved under a wrapper's names loads into the plain model's optimizer, and the reverse
    src = step_random(cbopt.Adam(m.named_parameters(), lr=0.01, wd=0.1), 2)
    sd = src.named_state_dict()
    sd['state'] = {f'module._orig_mod.{n}': s for n, s in sd['state'].items()}
    sd['param_groups'][0]['params'] = [f'module._orig_mod.{n}' for n in sd['param_groups'][0]['params']]
    dst = cbopt.Adam(make_model(1).named_parameters())
    dst.load_state_dict(sd)
    assert_same(snapshot(dst), snapshot(src))


def test_dcp_state_dict_is_keyed_by_model_names_and_loads_back():
    "torch's DCP helpers read cbopt's state_dict as a torch.optim one: the model's FQNs, cbopt's state and hypers."
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    m = make_model(0)
    opt = step_random(cbopt.Adam(m.parameters(), lr=0.01, wd=0.1), 3)  # positional names: DCP names them by the model
    osd = get_optimizer_state_dict(m, opt)
    assert list(osd['state']) == NAMES and all(set(s) == ADAM_KEYS for s in osd['state'].values())
    assert osd['param_groups'][0]['params'] == NAMES and osd['param_groups'][0]['wd'] == 0.1
    m2 = make_model(1)
    dst = cbopt.Adam(m2.named_parameters(), lr=0.5)
    set_optimizer_state_dict(m2, dst, osd)
    assert dst.hypers == opt.hypers
    for p, q in zip(opt.params, dst.params): torch.testing.assert_close(dst.state[q]['sqr_avg'], opt.state[p]['sqr_avg'], rtol=0, atol=0)


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
    assert {k for k in osd if k.endswith('.chain')} == {f'param_groups.{n}.chain' for n in NAMES}
    assert sorted({osd[f'param_groups.{n}.chain'] for n in NAMES}) == sorted(set(chains))
    assert not any(k.endswith(('.momentum', '.cbs')) for k in osd)
    dst_model = make_model(1)
    dst = step_random(build(dst_model), 2, start=50)
    set_state_dict(dst_model, dst, model_state_dict=msd, optim_state_dict=osd, options=flat)
    assert_same(snapshot(dst), snapshot(src))
    assert [model_entries(g) for g in dst.state_dict()['param_groups']] == [model_entries(g) for g in src.state_dict()['param_groups']]
    for p, q in zip(dst_model.parameters(), src_model.parameters()): assert torch.equal(p, q)
    step_random(src, 4, start=5), step_random(dst, 4, start=5)
    assert_same(snapshot(dst), snapshot(src))
    for p, q in zip(dst_model.parameters(), src_model.parameters()): assert torch.equal(p, q)
    if case == 'sgd':  # the same entries and state names, another chain: cbopt refuses it, naming the chain
        other_model = make_model(1)
        other = cbopt.Optimizer(other_model.named_parameters(), [cbopt.l2_reg, cbopt.average_grad, cbopt.momentum_step],
                                lr=0.1, mom=0.9, wd=0.01)
        with pytest.raises(ValueError, match=r"was saved by the chain \[weight_decay,average_grad,momentum_step\], but "
                                             r"runs \[l2_reg,average_grad,momentum_step\]"):
            set_state_dict(other_model, other, model_state_dict=msd, optim_state_dict=osd, options=flat)
