"""Shared helpers for the parity and resume tests: a tiny two-group MLP, real gradients that are the same for the
same params at the same step, and the prebuilt optimizers with hypers that make their differences visible."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn


@pytest.fixture
def one_thread():
    """Run a test on one intra-op thread: these tensors are tiny, and CPU kernels that go parallel (torch's fused
    AdamW) spin for milliseconds per call when the cores are shared. `pytestmark = pytest.mark.usefixtures(...)`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    "A tiny MLP, the same for the same `seed` whatever the global RNG (tanh is smooth: tiny differences stay tiny)."
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def two_groups(model: nn.Module, named: bool = False) -> list[list]:
    "fastai splitter style: body and head, as tensors or as (FQN, tensor) pairs."
    ps = list(model.named_parameters()) if named else list(model.parameters())
    return [ps[:2], ps[2:]]


def set_grads(model: nn.Module, step: int) -> None:
    "Set every `p.grad` from an MSE loss on batch `step` of a fixed synthetic data set: a real, param-dependent grad."
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
    x, y = x.to(model[0].weight), y.to(model[0].weight)
    for p in model.parameters(): p.grad = None
    with torch.enable_grad(): F.mse_loss(model(x), y).backward()


def train(opt, model: nn.Module, steps: int, start: int = 0) -> None:
    "Take `steps` optimizer steps on the batches `start`, `start+1`, ..."
    for i in range(start, start + steps):
        set_grads(model, i)
        opt.step()


def assert_rel_close(actual: nn.Module, expected: nn.Module, rtol: float = 1e-6, msg: str = '',
                     per_tensor: bool = False) -> None:
    """Every param of `actual` is within `rtol` of `expected`'s, relative to the model's largest param magnitude, or,
    with `per_tensor`, to each tensor's own largest magnitude (the strict reading, for implementations that do the
    same float ops). Why the model's scale otherwise: two correct implementations that order their float ops
    differently (torch's fused kernels, compiled chains) differ by the fp32 rounding of each *step* (~lr * 2**-24,
    whatever the param's size), so a tensor that shrinks towards 0 (a head bias under wd) would show a large relative
    error made of nothing but rounding."""
    model_scale = max(p.abs().max().item() for p in expected.parameters())
    for (n, a), b in zip(actual.named_parameters(), expected.parameters()):
        err, scale = (a - b).abs().max().item(), (b.abs().max().item() if per_tensor else model_scale)
        assert err <= rtol * scale, f"{msg} param {n}: max abs diff {err:.3g} > {rtol:g} * {scale:.3g}"


# Every prebuilt optimizer, as `build(module, params, lr)` for `module` cbopt or fastai.optimizer (same signatures).
# Nonzero wd, momentums away from their defaults, trust_coeff=1 so that LARC's clip bites: differences show.
# RMSProp keeps eps at its default 1e-8: fastai's RMSProp drops its `eps` (its step's default 1e-8 is used).
PREBUILT = {
    'sgd':            lambda m, ps, lr: m.SGD(ps, lr, wd=0.1),
    'sgd-l2':         lambda m, ps, lr: m.SGD(ps, lr, wd=0.1, decouple_wd=False),
    'sgd-mom':        lambda m, ps, lr: m.SGD(ps, lr, mom=0.9, wd=0.1),
    'sgd-mom-l2':     lambda m, ps, lr: m.SGD(ps, lr, mom=0.9, wd=0.1, decouple_wd=False),
    'rmsprop':        lambda m, ps, lr: m.RMSProp(ps, lr, sqr_mom=0.9, wd=0.1),
    'rmsprop-mom':    lambda m, ps, lr: m.RMSProp(ps, lr, mom=0.8, sqr_mom=0.9, wd=0.1, decouple_wd=False),
    'adam':           lambda m, ps, lr: m.Adam(ps, lr, mom=0.8, sqr_mom=0.95, eps=1e-6, wd=0.1),
    'adam-l2':        lambda m, ps, lr: m.Adam(ps, lr, mom=0.8, sqr_mom=0.95, eps=1e-6, wd=0.1, decouple_wd=False),
    'radam':          lambda m, ps, lr: m.RAdam(ps, lr, sqr_mom=0.95, wd=0.1),
    'radam-l2':       lambda m, ps, lr: m.RAdam(ps, lr, sqr_mom=0.95, wd=0.1, decouple_wd=False),
    'sadam':          lambda m, ps, lr: m.RAdam(ps, lr, sqr_mom=0.95, wd=0.1, beta=10.),
    'qhadam':         lambda m, ps, lr: m.QHAdam(ps, lr, mom=0.9, sqr_mom=0.99, nu_2=0.8, wd=0.1),
    'larc':           lambda m, ps, lr: m.Larc(ps, lr, clip=True, trust_coeff=1., wd=0.1),
    'lars':           lambda m, ps, lr: m.Larc(ps, lr, clip=False, trust_coeff=1., wd=0.1),
    'lamb':           lambda m, ps, lr: m.Lamb(ps, lr, sqr_mom=0.95, wd=0.1),
    'lookahead-sgd':  lambda m, ps, lr: m.Lookahead(m.SGD(ps, lr, mom=0.9, wd=0.1), k=5, alpha=0.6),
    'lookahead-adam': lambda m, ps, lr: m.Lookahead(m.Adam(ps, lr, eps=1e-6, wd=0.1), k=4, alpha=0.3),
    'ranger':         lambda m, ps, lr: m.ranger(ps, lr, sqr_mom=0.95),
}
