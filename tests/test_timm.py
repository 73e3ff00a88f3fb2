"""cbopt inside timm (issue #29): `cbopt.integrations.timm.register()`, `create_optimizer_v2` with `layer_decay` and
Lookahead, timm's scheduler (its `lr_scale`), and timm's own checkpointing (`CheckpointSaver`, `resume_checkpoint`)
resuming bit for bit; each against torch's AdamW run through the same timm code.

timm imports torchvision at import (`timm.layers` takes its FrozenBatchNorm2d), whose PyPI wheel's C ops do not load
beside CPU torch: `conftest.import_torchvision` imports its Python package without them (no torchvision op runs here);
timm's optim, scheduler and checkpoint code under test is timm's own, unchanged."""
import pytest
import torch
from torch import nn

import cbopt
from conftest import import_torchvision


import_torchvision()
timm = pytest.importorskip('timm')
from timm.optim import create_optimizer_v2  # noqa: E402
from timm.optim._optim_factory import default_registry  # noqa: E402
from timm.scheduler import CosineLRScheduler  # noqa: E402
from timm.utils import CheckpointSaver  # noqa: E402
from timm.models import resume_checkpoint  # noqa: E402

from cbopt.integrations import timm as cbopt_timm  # noqa: E402

NAMES = cbopt_timm.register()


class Net(nn.Module):
    "Three layers and timm's `group_matcher`, so `layer_decay` gives each its own `lr_scale`."
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(6, 8)
        self.blocks = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, x): return self.head(self.blocks(torch.tanh(self.stem(x))))

    def group_matcher(self, coarse=False): return dict(stem=r'^stem', blocks=r'^blocks\.(\d+)')


def _data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)) for _ in range(4)]


def _build(name, seed=0, **kw):
    torch.manual_seed(seed)
    model = Net()
    opt = create_optimizer_v2(model, name, lr=1e-2, weight_decay=0.05, layer_decay=0.75, **kw)
    sched = CosineLRScheduler(opt, t_initial=3, warmup_t=1, warmup_lr_init=1e-3)
    return model, opt, sched


def _epochs(model, opt, sched, epochs):
    for epoch in epochs:
        for x, y in _data():
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        sched.step(epoch + 1)


def test_register_names_and_infos():
    assert 'cboptadamw' in NAMES and 'cboptlion' in NAMES and 'cboptdecoupledadamw' in NAMES
    assert all('_' not in n for n in NAMES)
    info = default_registry.get_optimizer_info('cboptadamw')
    assert info.opt_class is cbopt.optim.AdamW and info.has_betas and not info.has_momentum and info.has_eps
    sgd = default_registry.get_optimizer_info('cboptsgd')
    assert sgd.has_momentum and not sgd.has_betas
    lion = default_registry.get_optimizer_info('cboptlion')  # (a recipe: betas are its mom, sqr_mom)
    assert lion.has_betas and not lion.has_momentum and not lion.has_eps
    assert default_registry.get_optimizer_info('cboptmuon').opt_class is cbopt.Muon  # (hybrid, as timm's muon)
    assert 'cboptlbfgs' not in NAMES  # (timm always passes weight_decay, which torch's LBFGS does not take)
    x, y = _data()[0]
    for name in NAMES:  # every one builds over timm's layer-decay groups and steps
        model = Net()
        opt = create_optimizer_v2(model, name, lr=1e-3, weight_decay=0.01, layer_decay=0.75).train()  # (schedule-free)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        assert 'lr_scale' in opt.param_groups[0] and any(opt.state.values()), name


def test_underscore_names_refused():
    "timm reads 'cbopt_adamw' as 'adamw' (torch's AdamW), silently: refused at registration."
    with pytest.raises(ValueError, match=r"prefix 'cbopt_' has a '_': timm splits optimizer names on '_'.*'cbopt'"):
        cbopt_timm.register(prefix='cbopt_')
    assert type(create_optimizer_v2(Net(), 'cbopt_adamw')) is torch.optim.AdamW  # (what it would have meant)


@pytest.mark.parametrize('lookahead', [False, True])
def test_layer_decay_scheduler_as_torch(lookahead):
    "`lr_scale` groups under timm's scheduler (and Lookahead's slow weights) as torch's AdamW in the same timm code."
    pre = 'lookahead_' if lookahead else ''
    runs = {}
    for name in (f'{pre}cboptadamw', f'{pre}adamw'):
        model, opt, sched = _build(name)
        scales = [g['lr_scale'] for g in opt.param_groups]
        assert len(set(scales)) > 2  # (stem, two blocks, head: their own scales)
        _epochs(model, opt, sched, range(3))
        assert [g['lr'] for g in opt.param_groups] == pytest.approx([sched._get_lr(3)[0] * s for s in scales])
        runs[name] = model, opt
    (m, opt), (tm, topt) = runs.values()
    for p, q in zip(m.parameters(), tm.parameters()): torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    sd = opt.state_dict()
    if lookahead:
        assert all('lookahead_slow_buff' in s for s in sd['state'].values())
        assert sd['param_groups'][0]['lookahead_step'] == 12
    fresh = create_optimizer_v2(Net(), 'adamw', lr=1e-2, weight_decay=0.05, layer_decay=0.75)  # torch's loads it
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.state[fresh.param_groups[0]['params'][0]]['exp_avg'], sd['state'][0]['exp_avg'])


@pytest.mark.parametrize('name', ['cboptadamw', 'lookahead_cboptadamw'])
def test_checkpoint_saver_resumes_bit_for_bit(tmp_path, name):
    "timm's CheckpointSaver after epoch 1, resume_checkpoint (weights_only) into a new model and optimizer."
    model, opt, sched = _build(name)
    _epochs(model, opt, sched, range(3))
    model2, opt2, sched2 = _build(name)
    _epochs(model2, opt2, sched2, range(1))
    saver = CheckpointSaver(model2, opt2, checkpoint_dir=str(tmp_path), recovery_dir=str(tmp_path), max_history=1)
    saver.save_checkpoint(epoch=0)
    model3, opt3, sched3 = _build(name, seed=7)  # other weights: all must come from the checkpoint
    start = resume_checkpoint(model3, str(tmp_path / 'last.pth.tar'), optimizer=opt3, log_info=False)
    assert start == 1
    sched3.step(start)
    _epochs(model3, opt3, sched3, range(start, 3))
    for (n, p), q in zip(model.named_parameters(), model3.parameters()): assert torch.equal(p, q), n


def test_named_groups_and_fallback_keys():
    "`param_group_fn=cbopt.param_groups_weight_decay` keys the state by FQN; `fallback_list`'s `use_fallback` is carried."
    model = Net()
    opt = create_optimizer_v2(model, 'cboptadamw', lr=1e-3, param_group_fn=lambda m: cbopt.param_groups_weight_decay(m, 0.05))
    assert sorted(opt.param_names) == sorted(n for n, _ in model.named_parameters())
    assert [g['weight_decay'] for g in opt.param_groups] == [0.0, 0.05]
    opt = create_optimizer_v2(model, 'cboptadamw', lr=1e-3, weight_decay=0.05, fallback_list=['head.*'])
    ref = create_optimizer_v2(model, 'adamw', lr=1e-3, weight_decay=0.05, fallback_list=['head.*'])
    assert [g.get('use_fallback') for g in opt.param_groups] == [g.get('use_fallback') for g in ref.param_groups]
    assert [g.get('use_fallback') for g in opt.state_dict()['param_groups']] == [None, None, True, True]
