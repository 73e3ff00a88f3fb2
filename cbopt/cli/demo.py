"""`python -m cbopt demo`: train one small MLP with optimizers listed from callbacks and with the prebuilt ones,
print a table (optimizer, first and final loss, steps/s) and write a plot of the loss curves.

Everything is seeded and runs on CPU in a few seconds, so the table doubles as a smoke test of the library."""
from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import nn

import cbopt


def centralize_grad(p, **kwargs):
    """Gradient centralisation (Yong et al. 2020), a callback written outside the library: remove the mean of the
    gradient over each output unit of a weight matrix (biases and other vectors are left as they are)."""
    g = p.grad.data
    if g.ndim > 1: g.sub_(g.mean(dim=tuple(range(1, g.ndim)), keepdim=True))


def make_data(n: int = 2048, n_in: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    "A seeded, smooth nonlinear regression problem (a random teacher net plus a little noise)."
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, n_in, generator=gen)
    w1, w2 = torch.randn(n_in, 32, generator=gen) / n_in ** 0.5, torch.randn(32, 1, generator=gen) / 32 ** 0.5
    y = torch.tanh(x @ w1) @ w2 + 0.05 * torch.randn(n, 1, generator=gen)
    return x, y


def make_model(n_in: int = 16, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(n_in, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def optimizers() -> dict[str, Callable]:
    "Name -> `opt_func(named_params)`: optimizers listed from callbacks first, then the prebuilt ones."
    listed_adam = [cbopt.weight_decay, partial(cbopt.average_grad, dampening=True), cbopt.average_sqr_grad,
                   cbopt.step_stat, cbopt.adam_step]
    return {
        'listed: wd+avg_grad+momentum': lambda ps: cbopt.Optimizer(
            ps, [cbopt.weight_decay, cbopt.average_grad, cbopt.momentum_step], lr=0.02, mom=0.9, wd=1e-4),
        # centralize_grad branches on each param's shape, so it runs param by param (the 'loop' backend), not bucket-wise
        'listed: centralize+Adam': lambda ps: cbopt.Optimizer(
            ps, [centralize_grad, *listed_adam], backend='loop', lr=3e-3, mom=0.9, sqr_mom=0.99, eps=1e-5, wd=0.01),
        'SGD': lambda ps: cbopt.SGD(ps, lr=0.02, mom=0.9, wd=1e-4),  # the same as the first row
        'Adam': lambda ps: cbopt.Adam(ps, lr=3e-3),
        'RAdam': lambda ps: cbopt.RAdam(ps, lr=3e-3),
        'Lamb': lambda ps: cbopt.Lamb(ps, lr=3e-3),
        'ranger': lambda ps: cbopt.ranger(ps, lr=3e-3),
    }


def train(opt_func: Callable, model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, bs: int = 64,
          seed: int = 0) -> tuple[list[float], float]:
    "Train `model` for `steps` minibatch steps (same batches for every optimizer); return the losses and steps/s."
    opt, gen, losses = opt_func(model.named_parameters()), torch.Generator().manual_seed(seed), []
    start = time.perf_counter()
    for _ in range(steps):
        idx = torch.randint(len(x), (bs,), generator=gen)
        loss = nn.functional.mse_loss(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, steps / (time.perf_counter() - start)


def smooth(xs: list[float], n: int = 20) -> list[float]:
    "Running mean over the last `n` values, so curves of noisy minibatch losses can be told apart."
    out, acc = [], 0.
    for i, v in enumerate(xs):
        acc += v - (xs[i - n] if i >= n else 0.)
        out.append(acc / min(i + 1, n))
    return out


def run_all(steps: int, seed: int) -> dict[str, list[float]]:
    "Train a copy of one model with every optimizer of `optimizers()`, printing the table; the loss curves by name."
    x, y = make_data(seed=seed)
    model0, curves = make_model(x.shape[1], seed=seed), {}
    print(f"MLP {x.shape[1]}-64-64-1 on {len(x)} synthetic samples, {steps} steps of batch 64 per optimizer\n")
    train(cbopt.SGD, copy.deepcopy(model0), x, y, 20)  # warm up torch's kernels so the first row's speed is fair
    header = f"{'optimizer':<30} {'first loss':>10} {'final loss':>10} {'steps/s':>8}"
    print(header + '\n' + '-' * len(header))
    for name, opt_func in optimizers().items():
        losses, speed = train(opt_func, copy.deepcopy(model0), x, y, steps, seed=seed)
        curves[name] = losses
        final = sum(losses[-20:]) / len(losses[-20:])  # mean of the last 20 minibatch losses
        print(f"{name:<30} {losses[0]:>10.4f} {final:>10.4f} {speed:>8.0f}", flush=True)
    return curves


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    "Run the demo; returns the loss curves by optimizer name."
    parser = argparse.ArgumentParser(prog='python -m cbopt demo', description=__doc__)
    parser.add_argument('--out', default='demo_out', help='directory for losses.png (default: demo_out)')
    parser.add_argument('--steps', type=int, default=400, help='training steps per optimizer (default: 400)')
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args(argv)
    import matplotlib  # lazily: `import cbopt` never needs matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small runs fastest on one thread (and does not fight other processes)
    try: curves = run_all(args.steps, args.seed)
    finally: torch.set_num_threads(threads)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, losses in curves.items(): ax.plot(smooth(losses), '--' if name.startswith('listed') else '-', label=name)
    ax.set(yscale='log', xlabel='step', ylabel='MSE loss (running mean of 20 batches)', title='cbopt demo: loss curves')
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / 'losses.png', dpi=100)
    plt.close(fig)
    print(f"\nwrote {out / 'losses.png'}")
    return curves
