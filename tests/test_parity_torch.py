"""Every registry case with a torch.optim reference (`cases.WITH_TORCH`) follows it step for step: same init, same
real gradients, two param groups with their own lr, params compared after every one of 100 steps, relative to each
tensor's own scale (`Case.torch_parity`: 1e-6 in fp32, where a case needs an absolute floor it says why). In fp64
the same runs agree to 1e-12 (RAdam: see its eps note in cases.py), so the fp32 differences are rounding, not
algorithm. Torch's `weight_decay` is L2 (cbopt's `decouple_wd=False`) except in AdamW and
RAdam(decoupled_weight_decay=True)."""
import pytest
import torch
from torch import optim

from cases import WITH_TORCH, Case, case
from conftest import assert_moved, assert_rel_close, make_model, train, two_groups

pytestmark = pytest.mark.usefixtures('one_thread')
STEPS = 100
LR = 3e-2


def groups(model) -> list[dict]:
    "torch-style group dicts: the body at a tenth of the head's lr."
    body, head = two_groups(model)
    return [{'params': body, 'lr': 3e-3}, {'params': head}]


@pytest.mark.parametrize('backend', ['auto', 'loop'])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64], ids=['fp32', 'fp64'])
@pytest.mark.parametrize('c', WITH_TORCH, ids=str)
def test_follows_torch(c: Case, dtype, backend):
    """Both the default backend and the per-param reference. cbopt does fastai's float ops (see test_parity_fastai),
    torch orders some differently (lerp_, sqrt(v)/sqrt(bc2)): the cases whose tensors decay to ~0 under wd carry a
    floor for that rounding in cases.py."""
    ours, theirs = make_model(dtype=dtype), make_model(dtype=dtype)
    opt, ref = c.build(groups(ours), LR, backend), c.torch(groups(theirs), LR)
    for i in range(STEPS):
        train(ref, theirs, 1, start=i)
        train(opt, ours, 1, start=i)
        assert_rel_close(ours, theirs, **c.torch_parity.of(dtype), msg=f"step {i}:")
    assert [g['lr'] for g in opt.param_groups] == [g['lr'] for g in ref.param_groups] == [3e-3, 3e-2]
    assert_moved(ours, make_model(dtype=dtype))


@pytest.mark.parametrize('c', [case('sgd-nesterov'), case('adam')], ids=str)
def test_follows_torch_lr_scheduler(c: Case):
    "A torch LR scheduler drives both the same way (it writes `group['lr']`, which cbopt's steps read)."
    ours, theirs = make_model(), make_model()
    opt, ref = c.build(groups(ours), LR), c.torch(groups(theirs), LR)
    scheds = [optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS) for o in (opt, ref)]
    for i in range(STEPS):
        train(ref, theirs, 1, start=i)
        train(opt, ours, 1, start=i)
        for s in scheds: s.step()
        assert_rel_close(ours, theirs, **c.torch_parity.of(torch.float32), msg=f"step {i}:")
    assert opt.param_groups[1]['lr'] == pytest.approx(ref.param_groups[1]['lr'])
