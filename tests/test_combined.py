"""`cbopt.CombinedOptimizer`: several optimizers as one, with torchrec's key prefixing. The reference for its numbers
is each child stepping alone on its own copy of the model; for its keys, torchrec's rule (`prefix.name`, a bare
child's names unprefixed, a key two children would share refused)."""
import copy
import io

import pytest
import torch
from torch import nn

import cbopt
from conftest import assert_moved, assert_same_params, make_model, set_grads, train

pytestmark = pytest.mark.usefixtures('one_thread')
BACKENDS = ['loop', 'foreach', 'auto', cbopt.Backend('fused', compiler='aot_eager')]
IDS = ['loop', 'foreach', 'auto', 'fused']


def children(model: nn.Module, backend='loop') -> list[tuple[str, cbopt.Optimizer]]:
    "Adam on the body (`0.*`), momentum SGD on the head (`2.*`), each named by its submodule's own FQNs."
    return [('enc', cbopt.Adam(model[0].named_parameters(), lr=1e-2, wd=0.1, backend=backend)),
            ('head', cbopt.SGD(model[2].named_parameters(), lr=3e-2, mom=0.8, wd=0.05, backend=backend))]


def step_children(kids, model: nn.Module, steps: int, start: int = 0) -> None:
    "The reference: the same batches, each child stepping alone."
    for i in range(start, start + steps):
        set_grads(model, i)
        for _, opt in kids: opt.step()


def save_load(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_keys_are_prefixed_as_torchrec_does():
    "`prefix.name` for a (prefix, opt) pair; a bare optimizer's names as they are (torchrec's prefix '')."
    model = make_model()
    comb = cbopt.CombinedOptimizer(children(model))
    train(comb, model, 1)
    sd = comb.named_state_dict()
    expected = [f'enc.{n}' for n, _ in model[0].named_parameters()] + [f'head.{n}' for n, _ in model[2].named_parameters()]
    assert list(sd['state']) == expected == comb.param_names
    assert [g['params'] for g in sd['param_groups']] == [expected[:2], expected[2:]]
    assert [g['param_names'] for g in comb.state_dict()['param_groups']] == [expected[:2], expected[2:]]  # torch's layout
    bare = cbopt.CombinedOptimizer([cbopt.Adam(list(model.named_parameters())[:2]),
                                    cbopt.SGD(list(model.named_parameters())[2:])])
    assert bare.param_names == [n for n, _ in model.named_parameters()]
    mixed = cbopt.CombinedOptimizer([cbopt.Adam(list(model.named_parameters())[:2]), ('head', cbopt.SGD(model[2].named_parameters()))])
    assert mixed.param_names == ['0.weight', '0.bias', 'head.weight', 'head.bias']
    assert cbopt.wrappers.combined.prepend_opt_key('w', '') == 'w' and cbopt.wrappers.combined.prepend_opt_key('w', 'a.b') == 'a.b.w'


@pytest.mark.parametrize('backend', BACKENDS, ids=IDS)
def test_each_child_steps_as_alone(backend):
    "Every group keeps its own chain and hypers: the combined optimizer gives each child's numbers, bit for bit."
    ref, ours = make_model(), make_model()
    start = copy.deepcopy(ours)
    kids = children(ref, backend)
    comb = cbopt.CombinedOptimizer(children(ours, backend))
    assert comb.backend_options == kids[0][1].backend_options
    step_children(kids, ref, 6)
    train(comb, ours, 6)
    assert_same_params(ours, ref, str(backend))
    assert_moved(ours, start)
    ref_state = {f'{pre}.{n}': s for pre, opt in kids for n, s in opt.named_state_dict()['state'].items()}
    ours_state = comb.named_state_dict()['state']
    assert ours_state.keys() == ref_state.keys()
    for n in ours_state:
        for k, v in ref_state[n].items():
            assert torch.equal(torch.as_tensor(ours_state[n][k]), torch.as_tensor(v)), (n, k)


def test_children_state_is_carried_over():
    "Children stepped before combining continue where they were (their state moves into the combined optimizer)."
    ref, ours = make_model(), make_model()
    kids, mine = children(ref), children(ours)
    step_children(kids, ref, 3)
    step_children(mine, ours, 3)
    comb = cbopt.CombinedOptimizer(mine)
    step_children(kids, ref, 3, start=3)
    train(comb, ours, 3, start=3)
    assert_same_params(ours, ref)


@pytest.mark.parametrize('backend', ['loop', 'auto'])
def test_resume_is_bit_exact(backend):
    "A checkpoint (prefixed keys, weights_only) loaded into a fresh combined optimizer continues bit for bit."
    model = make_model()
    comb = cbopt.CombinedOptimizer(children(model, backend))
    train(comb, model, 3)
    sd = save_load(comb.state_dict())
    resumed = copy.deepcopy(model)
    comb2 = cbopt.CombinedOptimizer(children(resumed, backend))
    comb2.load_state_dict(sd)
    train(comb, model, 3, start=3)
    train(comb2, resumed, 3, start=3)
    assert_same_params(resumed, model)
    other = cbopt.CombinedOptimizer([('dec', o) for _, o in children(make_model())][:1] + children(make_model())[1:])
    with pytest.raises(KeyError, match="enc.weight"): other.load_state_dict(sd)


def test_lr_scheduler_drives_every_group():
    "One scheduler on the combined optimizer gives each child the lrs its own scheduler would."
    ref, ours = make_model(), make_model()
    kids = children(ref)
    comb = cbopt.CombinedOptimizer(children(ours))
    f = lambda s: 0.7 ** s
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, f) for _, o in kids]
    sched = torch.optim.lr_scheduler.LambdaLR(comb, f)
    for i in range(5):
        step_children(kids, ref, 1, start=i)
        train(comb, ours, 1, start=i)
        for s in [*scheds, sched]: s.step()
        assert [g['lr'] for g in comb.param_groups] == [o.param_groups[0]['lr'] for _, o in kids]
    assert_same_params(ours, ref)


def test_one_cycle_cycles_every_group():
    "OneCycleLR reads `defaults` (momentum) and writes lr and mom into every group, as into each child alone."
    ref, ours = make_model(), make_model()
    kids = children(ref)
    comb = cbopt.CombinedOptimizer(children(ours))
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=8) for _, o in kids]
    sched = torch.optim.lr_scheduler.OneCycleLR(comb, max_lr=0.05, total_steps=8)
    for i in range(6):
        step_children(kids, ref, 1, start=i)
        train(comb, ours, 1, start=i)
        for s in [*scheds, sched]: s.step()
    assert [(g['lr'], g['mom']) for g in comb.param_groups] == [(o.param_groups[0]['lr'], o.param_groups[0]['mom']) for _, o in kids]
    assert_same_params(ours, ref)


def test_refusals_name_the_culprit():
    model = make_model()
    with pytest.raises(ValueError, match="prefix 'enc' is given to optimizers 0 and 1"):
        cbopt.CombinedOptimizer([('enc', cbopt.Adam(model[0].named_parameters())), ('enc', cbopt.SGD(model[2].named_parameters()))])
    with pytest.raises(ValueError, match="param 'weight' of optimizer 'a' is also param 'weight' of optimizer 'b'"):
        cbopt.CombinedOptimizer([('a', cbopt.Adam(model[0].named_parameters())), ('b', cbopt.SGD(model[0].named_parameters()))])
    with pytest.raises(ValueError, match=r"Duplicate param key 'weight': optimizer 0 \(no prefix\) and optimizer 1 \(no prefix\)"):  # torchrec's message; bare children, same names
        cbopt.CombinedOptimizer([cbopt.Adam(model[0].named_parameters()), cbopt.SGD(model[2].named_parameters())])
    with pytest.raises(ValueError, match=r"Duplicate param key 'head.weight': optimizer 0 \(no prefix\) and optimizer 1 \('head'\)"):
        cbopt.CombinedOptimizer([cbopt.Adam([('head.weight', model[0].weight)]), ('head', cbopt.SGD([('weight', model[2].weight)]))])
    with pytest.raises(TypeError, match=r"torch\.optim\.sgd\.SGD, not a cbopt optimizer"):
        cbopt.CombinedOptimizer([('enc', cbopt.Adam(model[0].named_parameters())), ('head', torch.optim.SGD(model[2].parameters()))])
    with pytest.raises(TypeError, match="steps in backward"):
        cbopt.CombinedOptimizer([('enc', cbopt.InBackward(cbopt.Adam(make_model()[0].named_parameters())))])
    with pytest.raises(ValueError, match="no optimizers"): cbopt.CombinedOptimizer([])
    comb = cbopt.CombinedOptimizer(children(model))
    with pytest.raises(TypeError, match="no chain of its own"): comb.add_param_group({'params': [nn.Parameter(torch.ones(2))]})
    comb.add_param_group({'params': [('extra', nn.Parameter(torch.ones(2)))], 'cbs': [cbopt.sgd_step]})
    assert comb.param_names[-1] == 'extra' and comb.param_groups[-1]['lr'] == comb.param_groups[0]['lr']
    assert 'eps' not in comb.param_groups[-1]  # only the hypers its chain reads


def test_is_a_torch_optimizer_with_hooks():
    "A real torch.optim.Optimizer: step hooks fire once per step, and zero_grad reaches every child's params."
    model = make_model()
    comb = cbopt.CombinedOptimizer(children(model))
    assert isinstance(comb, torch.optim.Optimizer)
    calls = []
    comb.register_step_post_hook(lambda opt, a, k: calls.append(opt))
    train(comb, model, 2)
    assert calls == [comb, comb]
    comb.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert cbopt.CombinedOptimizer(children(make_model()), backend='foreach').backend == 'foreach'
    assert 'enc: [weight_decay' in repr(comb) and 'head: [weight_decay,average_grad,momentum_step]' in repr(comb)


def test_fastai_opt_func(tmp_path):
    """As a fastai `opt_func` (one child per splitter group, here all Adam so that fastai's run with `cbopt.Adam` is the
    reference): fit_one_cycle gives the same losses, hypers and params bit for bit, and save/load(with_opt) resumes."""
    from test_fastai_learner import assert_same_training, make_learner, opt_states, assert_states_equal

    def combined_adam(params, lr, **kwargs):
        return cbopt.CombinedOptimizer([('body', cbopt.Adam(params[0], lr=lr)), ('rest', cbopt.Adam(params[1:], lr=lr))])

    ours, ref = make_learner(combined_adam, path=tmp_path), make_learner(cbopt.Adam, path=tmp_path)
    for learn in (ours, ref): learn.fit_one_cycle(2, lr_max=1e-2)
    assert isinstance(ours.opt, cbopt.CombinedOptimizer) and len(ours.opt.param_groups) == 3
    assert ours.opt.param_names == ref.opt.param_names == [n for n, _ in ours.model.named_parameters()]  # the Learner's FQNs
    assert_same_training(ours, ref, tol=0)
    ours.save('comb', with_opt=True)
    back = make_learner(combined_adam, path=tmp_path)
    back.create_opt()
    back.load('comb', with_opt=True)
    assert_states_equal(opt_states(back), opt_states(ours))


def test_fastai_scheduled_mom_on_a_chain_without_momentum():
    "fastai's schedules set `mom` on every group, even SGD(mom=0)'s: combining (and InBackward) carries it over as it is."
    model = make_model()
    plain = cbopt.SGD(model[2].named_parameters(), lr=0.1)
    plain.set_hyper('mom', 0.95)
    comb = cbopt.CombinedOptimizer([('enc', cbopt.Adam(model[0].named_parameters())), ('head', plain)])
    assert comb.param_groups[1]['mom'] == 0.95
    assert cbopt.InBackward(comb).param_groups[1]['mom'] == 0.95
