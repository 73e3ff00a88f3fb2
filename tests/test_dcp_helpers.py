"""torch DCP's optimizer helpers as trainers call them (issue #29), single process: torchtitan's flattened state_dicts
(`StateDictOptions(flatten_optimizer_state_dict=True)`, what its `OptimizersContainer` saves) with `dcp.save`/`dcp.load`
resuming bit for bit, an optimizer named from an inner module checkpointed through the outer one (Composer keeps HF
models at `self.model`: `model.0.weight`), DCP's init step on an optimizer with no state, and group surgery.
torchtitan itself is not installed by the dev extra (see docs/guides/torchtitan.md): these are its calls."""
import pytest
import torch
from torch import nn

import cbopt

dcp = pytest.importorskip('torch.distributed.checkpoint')
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,  # noqa: E402
                                                     set_optimizer_state_dict)


class Outer(nn.Module):
    "A wrapper keeping the model at `self.model`, as Composer's HuggingFaceModel does."
    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))

    def forward(self, x): return self.model(x)


MAKERS = {
    'optim.AdamW': lambda m: cbopt.optim.AdamW(m.model.named_parameters(), lr=1e-2, weight_decay=0.1),
    'optim.AdamW-titan': lambda m: cbopt.optim.AdamW(m.model.named_parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                                                     weight_decay=0.1, fused=False, foreach=True),  # (torchtitan's kwargs)
    'Adam': lambda m: cbopt.Adam(m.model.named_parameters(), lr=1e-2),
    'Lion': lambda m: cbopt.Lion(m.model.named_parameters(), lr=1e-3),
    'ScheduleFreeAdamW': lambda m: cbopt.ScheduleFreeAdamW(m.model.named_parameters(), lr=1e-2),
}


def _train(m, opt, steps, start=0):
    opt.train()  # (schedule-free's mode; the others have one point)
    for i in range(start, start + steps):
        g = torch.Generator().manual_seed(i)
        m(torch.randn(5, 4, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    opt.eval()  # (schedule-free is saved in eval mode, as its docs say)


def _fresh(make, seed=0):
    torch.manual_seed(seed)
    m = Outer()
    return m, make(m)


@pytest.mark.parametrize('flatten', [False, True], ids=['nested', 'flattened'])
@pytest.mark.parametrize('name', MAKERS)
def test_dcp_save_load_resumes_bit_for_bit(tmp_path, name, flatten):
    """get_optimizer_state_dict(outer, opt) names params `model.0.weight`, the optimizer `0.weight`: saved with
    dcp.save, loaded into a new model and optimizer through set_optimizer_state_dict, trained on: bit for bit."""
    make, opts = MAKERS[name], StateDictOptions(flatten_optimizer_state_dict=flatten)
    ref_m, ref = _fresh(make)
    _train(ref_m, ref, 6)
    m, opt = _fresh(make)
    _train(m, opt, 3)
    osd = get_optimizer_state_dict(m, opt, options=opts)
    keys = list(osd) if flatten else list(osd['state'])
    assert any('model.0.weight' in k for k in keys)
    dcp.save({'model': m.state_dict(), 'optim': osd}, checkpoint_id=str(tmp_path))
    m2, opt2 = _fresh(make, seed=5)
    target = {'model': m2.state_dict(), 'optim': get_optimizer_state_dict(m2, opt2, options=opts)}
    dcp.load(target, checkpoint_id=str(tmp_path))
    m2.load_state_dict(target['model'])
    set_optimizer_state_dict(m2, opt2, target['optim'], options=opts)
    _train(m2, opt2, 3, start=3)
    for (n, p), q in zip(ref_m.named_parameters(), m2.parameters()): assert torch.equal(p, q), n


@pytest.mark.parametrize('name', MAKERS)
def test_dcp_init_step_creates_state_only(name):
    """DCP's `_init_optim_state` (a zero-grad, lr=0 step on an optimizer with no state) creates the state as
    `init_state()` does: no step counted, no param moved, and no error in schedule-free's eval mode."""
    m, opt = _fresh(MAKERS[name])
    opt.eval()
    before = [p.detach().clone() for p in m.parameters()]
    sd = get_optimizer_state_dict(m, opt)
    assert sd['state'] and all(p.grad is None for p in m.parameters())
    for p, q in zip(m.parameters(), before): assert torch.equal(p, q)
    twin = MAKERS[name](Outer())
    twin.init_state()
    for p, q in zip(m.model.parameters(), twin.param_groups[0]['params']):
        assert sorted(opt.state[p]) == sorted(twin.state[q])
        assert int(opt.state[p].get('step', 0)) == 0
    ref_m, ref = _fresh(MAKERS[name])  # and training on is exactly as after init_state() (with `auto`, the first
    ref.init_state()                    # step of a fresh AdamW runs the chain, which creates the state, not the kernel)
    _train(ref_m, ref, 2)
    _train(m, opt, 2)
    for p, q in zip(ref_m.parameters(), m.parameters()): assert torch.equal(p, q)


def test_lr_zero_step_with_real_grads_steps():
    "Only the init step's shape (no state, lr 0, zero grads) is taken for it: a warmup's lr=0 first step counts."
    m, opt = _fresh(MAKERS['optim.AdamW'])
    opt.param_groups[0]['lr'] = 0.0
    m(torch.randn(5, 4)).pow(2).mean().backward()
    opt.step()
    assert int(opt.state[m.model[0].weight]['step']) == 1


@pytest.mark.parametrize('name', ['optim.AdamW', 'Adam'])
def test_group_surgery(name):
    """`group['params'] = [flat]` (DeepSpeed-style) drops the names, and the optimizer then refuses to step or save,
    naming the group; a one-for-one swap (accelerate's, XLA's) keeps each param's name."""
    m, opt = _fresh(MAKERS[name])
    g = opt.param_groups[0]
    names = list(g['param_names'])
    g['params'] = [p.detach().clone().requires_grad_() for p in g['params']]
    assert g['param_names'] == names
    flat = torch.zeros(sum(p.numel() for p in g['params']), requires_grad=True)
    g['params'] = [flat]
    flat.grad = torch.ones_like(flat)
    for call in (opt.step, opt.state_dict):
        with pytest.raises(ValueError, match=r"param group 0's params were replaced by 1 other tensors.*"
                                             r"cbopt\.optim\.AdamW\(\[flat\]\)"):
            call()


def test_init_step_fallback_when_dcp_renames_it(monkeypatch):
    "Where torch renames DCP's `_init_optim_state` (cbopt._torch), its init step runs as a step, as torch's AdamW's."
    from cbopt import _torch
    monkeypatch.setattr(_torch, '_DCP_INIT', ('torch.distributed.checkpoint.state_dict', '_renamed'))
    m, opt = _fresh(MAKERS['optim.AdamW'])
    get_optimizer_state_dict(m, opt)
    assert int(opt.state[m.model[0].weight]['step']) == 1
