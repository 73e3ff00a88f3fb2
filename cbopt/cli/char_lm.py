"""A small character-level language model on Python's standard library sources: a real task (text, a transformer,
a held-out loss) that trains in seconds on a CPU. Notebook 08 and the low-bit convergence tests (tests/test_lowbit.py)
train on it, so that the notebook shows the runs the tests check.

The model is the bench's `GPT2` (`cbopt.cli.bench.params`) at width 64, initialised as GPT-2 is (normal weights of std
0.02, zero biases; its default init gives logits too large for a short run). The text is a fixed list of stdlib
modules' sources as ASCII codes (any other character becomes '?'), the last tenth held out. Every batch is drawn from
a seeded generator, so every optimizer sees the same batches."""
from __future__ import annotations

import math
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .bench.params import GPT2

SOURCES = ('textwrap.py', 'functools.py', 'string.py', 'heapq.py', 'shlex.py', 'fnmatch.py')  # about 110k characters
VOCAB = 128  # ASCII


def stdlib_text(files: Sequence[str] = SOURCES) -> str:
    "The sources of the standard library's `files` (names under the stdlib directory), one after another."
    root = Path(sysconfig.get_paths()['stdlib'])
    return ''.join((root / f).read_text(encoding='utf-8') for f in files)


def char_data(files: Sequence[str] = SOURCES, eval_frac: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    "The text of `files` as ASCII codes (int64), split into the training part and the held-out last `eval_frac`."
    codes = torch.tensor(list(stdlib_text(files).encode('ascii', 'replace')), dtype=torch.long)
    n_eval = int(len(codes) * eval_frac)
    return codes[:-n_eval], codes[-n_eval:]


def make_model(ctx: int = 64, d: int = 64, layers: int = 2, heads: int = 4, seed: int = 0) -> GPT2:
    """A seeded `GPT2` over `VOCAB` characters (its head tied to the embedding), GPT-2's init. At the defaults its 110k
    params are nearly all in matrices of at least 4,096 elements, so low-bit state quantizes almost all of them."""
    torch.manual_seed(seed)
    model = GPT2(vocab=VOCAB, ctx=ctx, d=d, layers=layers, heads=heads, tied=True)
    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)): torch.nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, torch.nn.Linear) and m.bias is not None: torch.nn.init.zeros_(m.bias)
    return model


def batch(data: torch.Tensor, bs: int, ctx: int, gen: torch.Generator) -> torch.Tensor:
    "`bs` windows of `ctx` characters of `data` at random places drawn from `gen`: (bs, ctx)."
    starts = torch.randint(len(data) - ctx, (bs,), generator=gen)
    return torch.stack([data[s:s + ctx] for s in starts.tolist()])


@torch.no_grad()
def eval_loss(model: GPT2, data: torch.Tensor, ctx: int = 64) -> float:
    "The model's next-character cross-entropy over all of `data`, cut into consecutive windows of `ctx`."
    n = (len(data) // ctx) * ctx
    return model(data[:n].view(-1, ctx)).item()


def warmup_cosine(steps: int, warmup: int = 20) -> Callable[[int], float]:
    "The lr factor of step `i`: linear warm-up over `warmup` steps, then a cosine to 0 at `steps` (a `LambdaLR` lambda)."
    return lambda i: min((i + 1) / warmup, 0.5 * (1 + math.cos(math.pi * i / steps)))


@dataclass
class Run:
    "A training run: the loss of every step, the held-out loss at the end, the trained model and its optimizer."
    losses: list[float]
    eval_loss: float
    model: GPT2
    opt: torch.optim.Optimizer


def train(opt_func: Callable, steps: int = 200, bs: int = 16, ctx: int = 64, seed: int = 0,
          data: tuple[torch.Tensor, torch.Tensor] | None = None) -> Run:
    """Train `make_model(ctx, seed=seed)` with `opt_func(model.named_parameters())` for `steps` steps of `bs` windows, the lr
    warmed up and annealed by `warmup_cosine` (torch's `LambdaLR`), the batches drawn from `seed`: two optimizers see
    the same batches from the same start. `data` is `char_data()`'s pair (read once and passed, for several runs)."""
    train_data, eval_data = data if data is not None else char_data()
    model = make_model(ctx, seed=seed)
    opt = opt_func(model.named_parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(steps))
    gen, losses = torch.Generator().manual_seed(seed), []
    for _ in range(steps):
        loss = model(batch(train_data, bs, ctx, gen))
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return Run(losses, eval_loss(model, eval_data, ctx), model, opt)
