"""cbopt inside Lightning (issue #29): a Trainer run under bf16 mixed precision with `gradient_clip_val` (which
Lightning refuses for an optimizer that unscales inside its step), checkpointed by ModelCheckpoint and resumed with
`ckpt_path` bit for bit; `Tuner.lr_find` restoring its pre-step checkpoint (`cbopt.integrations.lightning.LRFindRestore`);
writes through `LightningOptimizer` (`self.optimizers()`) reaching the optimizer. Tiny model and data made here."""
import pytest
import torch
from torch import nn

import cbopt
from conftest import import_torchvision

import_torchvision()  # (Lightning imports torchvision: see conftest)
L = pytest.importorskip('lightning.pytorch')
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.core.optimizer import LightningOptimizer  # noqa: E402
from lightning.pytorch.tuner import Tuner  # noqa: E402

from cbopt.integrations.lightning import LRFindRestore  # noqa: E402


def _loader():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


class Net(L.LightningModule):
    def __init__(self, make=None, lr=1e-2):
        super().__init__()
        self.make, self.lr = make, lr
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.cross_entropy(self.body(x), y)

    def configure_optimizers(self):
        return (self.make or (lambda m: cbopt.optim.AdamW(m.named_parameters(), lr=m.lr, weight_decay=0.1)))(self)


def _trainer(root, **kw):
    return L.Trainer(default_root_dir=str(root), accelerator='cpu', devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, **kw)


def test_fit_bf16_clipping_and_resume_bit_for_bit(tmp_path):
    "2 epochs at once vs 1 epoch, ModelCheckpoint, a new Trainer resumed from it by `ckpt_path`: every param equal."
    kw = dict(precision='bf16-mixed', gradient_clip_val=0.5, max_epochs=2)
    torch.manual_seed(0)
    full = Net()
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / 'ck'), save_top_k=-1, every_n_epochs=1, filename='{epoch}')
    _trainer(tmp_path / 'a', callbacks=[ckpt], **kw).fit(full, _loader())
    assert isinstance(full.optimizers().optimizer, cbopt.optim.AdamW)
    assert not full.optimizers().optimizer._step_supports_amp_scaling  # (what lets Lightning clip: as torch's AdamW)
    torch.manual_seed(1)
    resumed = Net()  # other weights: every one must come from the checkpoint
    _trainer(tmp_path / 'b', **kw).fit(resumed, _loader(), ckpt_path=str(tmp_path / 'ck' / 'epoch=0.ckpt'))
    for (n, p), q in zip(full.named_parameters(), resumed.parameters()): assert torch.equal(p, q), n
    fused = cbopt.optim.AdamW(nn.Linear(2, 2).parameters(), fused=True)
    assert fused._step_supports_amp_scaling  # (as torch's fused AdamW, which Lightning refuses to clip)


def test_lr_find_restores_fresh_optimizer(tmp_path):
    "Tuner.lr_find steps, then restores its checkpoint of the fresh optimizer: with LRFindRestore, as torch's AdamW."
    torch.manual_seed(0)
    model = Net()
    trainer = _trainer(tmp_path, max_epochs=1, callbacks=[LRFindRestore()])
    before = [p.detach().clone() for p in model.parameters()]
    finder = Tuner(trainer).lr_find(model, _loader(), min_lr=1e-4, max_lr=1e-1, num_training=6, update_attr=False)
    assert len(finder.results['lr']) > 1
    opt = trainer.optimizers[0]
    assert isinstance(opt, cbopt.optim.AdamW) and not opt.state
    for p, q in zip(model.parameters(), before): assert torch.equal(p, q)
    torch.manual_seed(0)
    model = Net()  # without it, cbopt's strict load refuses to silently restart the stepped state
    with pytest.raises(ValueError, match=r"call clear_state\(\) first"):
        Tuner(_trainer(tmp_path, max_epochs=1)).lr_find(model, _loader(), num_training=3, update_attr=False)


@pytest.mark.parametrize('make', [lambda ps: cbopt.optim.AdamW(ps), lambda ps: cbopt.Adam(ps)], ids=['optim.AdamW', 'Adam'])
def test_lightning_optimizer_writes_reach_the_optimizer(make):
    "`self.optimizers().freeze_to(1)` and `.backend = 'loop'` on Lightning's wrapper change the optimizer itself."
    body = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    opt = make([{'params': body[0].parameters()}, {'params': body[1].parameters()}])
    wrapper = LightningOptimizer(opt)
    assert isinstance(wrapper, type(opt))
    wrapper.backend = 'loop'
    wrapper.freeze_to(1)
    assert opt.backend == 'loop' and opt.frozen_idx == 1
    assert [p.requires_grad for p in body.parameters()] == [False, False, True, True]
    wrapper.set_hyper('lr', 0.5)
    assert [g['lr'] for g in opt.param_groups] == [0.5, 0.5]
    assert sorted(vars(wrapper)) == ['_on_after_step', '_on_before_step', '_optimizer', '_strategy']  # (its own only)
