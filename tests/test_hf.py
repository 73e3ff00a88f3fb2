"""cbopt inside the Hugging Face Trainer (issue #29): a run checkpointed by `save_steps` and resumed with
`resume_from_checkpoint` bit for bit, with params named by FQN (`optimizers=` the recipe of docs/guides/huggingface.md);
and accelerate's detection of an fp16 overflow step (what the Trainer reads before stepping its LR scheduler) as with
torch's AdamW. Tiny model and data made here; no downloads (HF_HUB_OFFLINE)."""
import os

import pytest
import torch
from torch import nn

import cbopt
from conftest import import_torchvision

os.environ.setdefault('HF_HUB_OFFLINE', '1')
import_torchvision()  # (the Trainer imports torchvision: see conftest)
transformers = pytest.importorskip('transformers')
accelerate = pytest.importorskip('accelerate')
from transformers import Trainer, TrainingArguments  # noqa: E402


class Net(nn.Module):
    "A model as the Trainer takes one: keyword inputs, a dict with the loss."
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x, labels=None):
        out = self.body(x)
        return {'loss': nn.functional.cross_entropy(out, labels), 'logits': out}


class Data(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(48, 6, generator=g), torch.randint(0, 3, (48,), generator=g)

    def __len__(self): return len(self.x)
    def __getitem__(self, i): return {'x': self.x[i], 'labels': self.y[i]}


def _run(out, seed, resume=None):
    torch.manual_seed(seed)
    model = Net()
    opt = cbopt.optim.AdamW(cbopt.param_groups_weight_decay(model, 0.01), lr=1e-2)  # named by FQN
    args = TrainingArguments(str(out), max_steps=8, per_device_train_batch_size=4, save_strategy='steps', save_steps=4,
                             report_to=[], use_cpu=True, seed=0, learning_rate=1e-2, lr_scheduler_type='linear',
                             warmup_steps=2, gradient_accumulation_steps=2, remove_unused_columns=False,
                             disable_tqdm=True, logging_steps=100)
    trainer = Trainer(model=model, args=args, train_dataset=Data(), optimizers=(opt, None))
    trainer.train(resume_from_checkpoint=resume)
    return model, trainer


def test_trainer_resumes_bit_for_bit(tmp_path):
    "8 steps (grad accumulation 2) saving at step 4; a new model and optimizer resumed from checkpoint-4: equal params."
    full, _ = _run(tmp_path, seed=0)
    saved = torch.load(tmp_path / 'checkpoint-4' / 'optimizer.pt', weights_only=True)
    assert sorted(n for g in saved['param_groups'] for n in g['param_names']) == sorted(n for n, _ in full.named_parameters())
    resumed, trainer = _run(tmp_path, seed=3, resume=str(tmp_path / 'checkpoint-4'))
    assert isinstance(trainer.optimizer.optimizer, cbopt.optim.AdamW)
    for (n, p), q in zip(full.named_parameters(), resumed.parameters()): assert torch.equal(p, q), n


MAKERS = {
    'torch.optim.AdamW': lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-2, **kw),
    'cbopt.optim.AdamW': lambda ps, **kw: cbopt.optim.AdamW(ps, lr=1e-2, **kw),
    'cbopt.Adam': lambda ps, **kw: cbopt.Adam(ps, lr=1e-2, **({'backend': 'fused'} if kw else {})),
}


@pytest.mark.parametrize('fused', [False, True], ids=['default', 'fused'])
@pytest.mark.parametrize('name', MAKERS)
def test_accelerate_sees_overflow_steps_as_torch(name, fused):
    """accelerate's AcceleratedOptimizer under a GradScaler reports an inf step as skipped (`step_was_skipped`, which
    the HF Trainer reads to hold its LR scheduler) for cbopt's default backend, as for torch's AdamW; with the fused
    backend, as with torch's `fused=True`, the scaler hands the step its inf flag, and accelerate cannot see it."""
    from accelerate.optimizer import AcceleratedOptimizer
    model = nn.Linear(4, 3)
    opt = MAKERS[name](model.parameters(), **({'fused': True} if fused else {}))
    acc = AcceleratedOptimizer(opt, device_placement=False, scaler=torch.amp.GradScaler('cpu', init_scale=2. ** 8))
    skipped = []
    for i in range(4):
        loss = model(torch.randn(5, 4)).pow(2).mean() * (float('inf') if i == 2 else 1.)
        acc.scaler.scale(loss).backward()
        before = model.weight.detach().clone()
        acc.step()
        acc.zero_grad()
        skipped.append(acc.step_was_skipped)
        if i == 2: assert torch.equal(model.weight, before)  # (nothing stepped, in every case)
    assert skipped == [False, False, not fused, False]


def test_optimizer_cls_and_kwargs_then_named(tmp_path):
    """`optimizer_cls_and_kwargs` builds over the Trainer's own groups of plain tensors (names are positions);
    `trainer.create_optimizer()` then `opt.name_params(model)` keys it by FQN before training (docs/guides/huggingface.md)."""
    model = Net()
    args = TrainingArguments(str(tmp_path), max_steps=1, report_to=[], use_cpu=True, weight_decay=0.01,
                             remove_unused_columns=False, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Data(),
                      optimizer_cls_and_kwargs=(cbopt.optim.AdamW, {'lr': 1e-2}))
    opt = trainer.create_optimizer()
    assert isinstance(opt, cbopt.optim.AdamW) and [g['weight_decay'] for g in opt.param_groups] == [0.01, 0.0]
    assert sorted(opt.param_names) == ['0', '1', '2', '3']
    opt.name_params(model)
    assert sorted(opt.param_names) == sorted(n for n, _ in model.named_parameters())
