"""`python -m cbopt bench`: time cbopt's backends against torch.optim and fastai, on CPU in fp32.

Timings on a busy machine drift, so every row is timed in the same process as its references, interleaved: round
`r` times one step of every contender (in an order shuffled each round), and a ratio is the median of the per-round
ratios. The step time is the median over `--steps` rounds, after warm-up steps that create the state (and compile).

1. GPT-2-small's 148 params (124.4M): cbopt's Adam per backend vs torch AdamW (fused, foreach, for-loop) and fastai.
2. 1,000 params of 64x64, the same contenders: per-param overhead dominates.
3. `cbopt.Lion` (torch has no kernel for it) on the GPT-2 set: backends vs the loop, and the first step (state
   creation and compilation) on its own.
4. Peak memory a step adds beyond params, grads and state, each optimizer in a fresh subprocess.
5. Effective memory traffic: the bytes the algorithm must move per step / step time, next to the bandwidth of two
   streaming ops on large tensors timed in the same rounds (the physical limit): `copy_` and an in-place `add_`.
6. A whole train step on the demo's MLP: forward, `torch.func.grad` and `cbopt.functional(cbopt.Adam)`'s update,
   compiled with `fullgraph=True` (and eager), against eager `loss.backward()` + `cbopt.Adam.step()`.
7. Global-norm clipping on the GPT-2 set: cbopt's fused Adam under `GradientClippingOptimizer` (default, and
   `in_place=True`) against torch's fused AdamW after `clip_grad_norm_(foreach=True)`, and against cbopt's own fused
   step without clipping.
8. `InBackward` on a model of GPT-2-small's shapes (tied and untied embeddings): the peak memory of forward + backward
   + step against the normal step (each in a fresh subprocess), and the time of both, interleaved.
9. The optimizer state each rank holds under DDP, ZeRO and FSDP2, on 2 gloo processes, on the GPT-2 set
   (`cbopt/cli/bench_memory.py`; bytes, not timed).
10. The catalogue: every optimizer's fused and foreach steps against its reference's fastest mode, and against the
    memory-traffic floor, on the GPT-2 set at `--size` times its width.
11. Lion's first compile in a fresh process with an empty inductor cache, then with that cache filled.
12. The grid of case 2 with each tensor its own param group (per-layer lrs, as discriminative training sets them):
    the cost per group, the same contenders.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import torch

import cbopt
from .bench_memory import memory_rows, state_memory

__all__ = ['gpt2_shapes', 'grid_shapes', 'make_params', 'available_backends', 'measure', 'catalogue', 'main']

BACKENDS = ('fused', 'foreach', 'loop', 'auto')  # auto (the default) picks one of the others per bucket
ADAM = dict(lr=1e-3, mom=0.9, sqr_mom=0.99, eps=1e-5, wd=0.01)
LION = dict(lr=1e-4, mom=0.9, sqr_mom=0.99, wd=0.1)
# fp32 bytes per element the algorithm must move: param read+write, grad read, and each state buffer read+write
ADAM_BYTES, LION_BYTES = 4 * (2 + 1 + 2 + 2), 4 * (2 + 1 + 2)
Shapes = list[tuple[str, tuple[int, ...]]]


# -- parameter sets -------------------------------------------------------------------------------------------------
def gpt2_shapes(vocab: int = 50257, ctx: int = 1024, d: int = 768, layers: int = 12) -> Shapes:
    "GPT-2's params in model order (defaults: GPT-2 small, 148 tensors, 124.4M params; Linear-style weight shapes)."
    block = [('ln_1.weight', (d,)), ('ln_1.bias', (d,)), ('attn.c_attn.weight', (3 * d, d)), ('attn.c_attn.bias', (3 * d,)),
             ('attn.c_proj.weight', (d, d)), ('attn.c_proj.bias', (d,)), ('ln_2.weight', (d,)), ('ln_2.bias', (d,)),
             ('mlp.c_fc.weight', (4 * d, d)), ('mlp.c_fc.bias', (4 * d,)), ('mlp.c_proj.weight', (d, 4 * d)),
             ('mlp.c_proj.bias', (d,))]
    return [('wte.weight', (vocab, d)), ('wpe.weight', (ctx, d)),
            *[(f'h.{i}.{n}', s) for i in range(layers) for n, s in block], ('ln_f.weight', (d,)), ('ln_f.bias', (d,))]


def grid_shapes(n: int = 1000, size: int = 64) -> Shapes: return [(f'w{i}', (size, size)) for i in range(n)]


def param_sets(quick: bool) -> dict[str, Shapes]:
    """The param sets of the Adam cases and of Lion's. `quick` shrinks them so that a run takes seconds; its Lion set
    has 4 tensors, the numerics check's size, so that the compiled chain is compiled once."""
    if quick:
        gpt2 = gpt2_shapes(vocab=512, ctx=64, d=32, layers=2)
        return {'gpt2': gpt2, 'grid': grid_shapes(50, 16), 'lion': gpt2[:4]}
    return {'gpt2': gpt2_shapes(), 'grid': grid_shapes(), 'lion': gpt2_shapes()}


def make_params(shapes: Shapes, seed: int = 0) -> list[tuple[str, torch.nn.Parameter]]:
    "Named fp32 params with a fixed random grad each: the step needs no backward, and every step sees the same grads."
    g = torch.Generator().manual_seed(seed)
    res = []
    for name, shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=g) * 0.02)
        p.grad = torch.randn(shape, generator=g) * 1e-3
        res.append((name, p))
    return res


def numel(ps) -> int: return sum(p.numel() for _, p in ps)


# -- clipping: the contenders of case 7 --------------------------------------------------------------------------------
CLIP_NORM = 5e-3  # below the grads' norm on both the GPT-2 set and the numerics check's tiny set: every step clips


def clip_contenders() -> dict[str, Callable]:
    """cbopt's fused Adam clipped by its wrapper (the default, leaving the user's grads as they were, and `in_place`,
    clipping them as torch does), and torch's fused AdamW after torch's clip_grad_norm_ (foreach). The timed rounds
    share one set of grads, which torch's clip and the in-place one scale each step: every step still clips (the
    norm stays just above max_norm, see `CLIP_NORM`), and each contender runs the same ops whatever the values."""
    kw = dict(lr=ADAM['lr'], betas=(ADAM['mom'], ADAM['sqr_mom']), eps=ADAM['eps'], weight_decay=ADAM['wd'])
    def torch_clipped(ps):
        params = [p for _, p in ps]
        opt = torch.optim.AdamW(params, **kw, fused=True)
        def step():
            torch.nn.utils.clip_grad_norm_(params, CLIP_NORM, foreach=True)
            opt.step()
        return step
    def cbopt_clipped(ps, in_place=False):
        return cbopt.GradientClippingOptimizer(cbopt.Adam(ps, **ADAM, backend='fused'), cbopt.GradientClipping.NORM,
                                               max_gradient=CLIP_NORM, in_place=in_place).step
    return {'cbopt fused + clip': cbopt_clipped, 'cbopt fused + clip, in_place': lambda ps: cbopt_clipped(ps, True),
            'torch fused + clip_grad_norm_': torch_clipped}


def unclipped_contenders() -> dict[str, Callable]:
    "The same two fused steps without clipping (their numerics differ from the clipped ones: not checked against them)."
    adam = adam_contenders(['fused'])
    return {'cbopt fused': adam['cbopt fused'], 'torch fused': adam['torch fused']}


# -- InBackward: case 8 ---------------------------------------------------------------------------------------------
class GPT2(torch.nn.Module):
    """A GPT-2 with `gpt2_shapes`' params (and, untied, an `lm_head` of its own): causal self-attention, GELU MLP,
    pre-LayerNorm. Enough of the real forward and backward that grads arrive in backward's order, one by one."""
    def __init__(self, vocab: int = 50257, ctx: int = 1024, d: int = 768, layers: int = 12, heads: int = 12,
                 tied: bool = True):
        super().__init__()
        nn = torch.nn
        self.heads, self.wte, self.wpe = heads, nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.h = nn.ModuleList(nn.ModuleDict(dict(
            ln_1=nn.LayerNorm(d), c_attn=nn.Linear(d, 3 * d), attn_proj=nn.Linear(d, d), ln_2=nn.LayerNorm(d),
            c_fc=nn.Linear(d, 4 * d), mlp_proj=nn.Linear(4 * d, d))) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        if tied: self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        "The next-token cross-entropy of `idx` (batch, time)."
        F = torch.nn.functional
        b, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for blk in self.h:
            q, k, v = blk['c_attn'](blk['ln_1'](x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            x = x + blk['attn_proj'](F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))
            x = x + blk['mlp_proj'](F.gelu(blk['c_fc'](blk['ln_2'](x))))
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())


def gpt2_model(quick: bool, tied: bool, seed: int = 0) -> GPT2:
    torch.manual_seed(seed)
    return GPT2(vocab=512, ctx=64, d=32, layers=2, heads=2, tied=tied) if quick else GPT2(tied=tied)


TOKENS = 32  # one sequence of 32 tokens: activations stay small next to the params, as the grads are the question


def train_step(quick: bool, tied: bool, in_backward: bool) -> Callable[[], None]:
    "One forward + backward + step of a fresh GPT-2-shaped model with cbopt's Adam (torch's kernel), maybe in backward."
    model = gpt2_model(quick, tied)
    opt = cbopt.Adam(model.named_parameters(), **ADAM)
    if in_backward: opt = cbopt.InBackward(opt)
    idx = torch.randint(model.wte.num_embeddings, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    def step():
        opt.zero_grad(set_to_none=True)
        model(idx).backward()
        opt.step()
    step.grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    step.largest_grad_bytes = max(p.numel() * p.element_size() for p in model.parameters())  # always held whole
    step.zero_grad = lambda: opt.zero_grad(set_to_none=True)
    return step


def train_step_peak(quick: bool, tied: bool, in_backward: bool) -> dict:
    """The peak memory one training step adds (see `step_peak_memory`), after 2 steps that create the state; and the
    bytes of all grads (what stepping in backward can save at most)."""
    pin_mmap_threshold()
    step = train_step(quick, tied, in_backward)
    step(), step()
    step.zero_grad()  # the last step's grads are freed before the baseline: the measured step allocates its own
    gc.collect()
    Path('/proc/self/clear_refs').write_text('5')
    before = _status_kb('VmRSS')
    step()
    return {'peak_bytes': (_status_kb('VmHWM') - before) * 1024, 'grad_bytes': step.grad_bytes,
            'largest_grad_bytes': step.largest_grad_bytes}


def in_backward_case(quick: bool, rounds: int, warmup: int, progress: Progress | None = None) -> dict:
    "Case 8: peak memory of each variant in a fresh subprocess (in-process when quick), then both timed interleaved."
    res = {}
    for tied in (True, False):
        row = {}
        for inb in (False, True):
            if quick: row[inb] = train_step_peak(quick, tied, inb)
            else:
                code = (f'import json, torch, cbopt.cli.bench as b; torch.set_num_threads({torch.get_num_threads()}); '
                        f'print(json.dumps(b.train_step_peak(False, {tied}, {inb})))')
                run = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
                row[inb] = json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0 else None
            if progress: progress.update()
        key = 'tied' if tied else 'untied'
        normal, inb = row[False], row[True]
        saved = None if not (normal and inb) else (normal['peak_bytes'] - inb['peak_bytes']) / normal['grad_bytes']
        steps = {'normal': train_step(quick, tied, False), 'in backward': train_step(quick, tied, True)}
        timing = measure(steps, rounds, warmup, progress)
        del steps
        gc.collect()
        res[key] = dict(normal=normal, in_backward=inb, saved_of_grads=saved, results=timing,
                        time_ratio=paired(timing, 'in backward', 'normal'))
    return res


# -- contenders: name -> factory(named params) -> step function --------------------------------------------------------
@cache
def available_backends() -> tuple[str, ...]:
    "The backends this cbopt offers, tried on a one-param Adam; a cbopt without a `backend` argument has the loop only."
    ps = [torch.nn.Parameter(torch.zeros(2))]
    try: cbopt.Adam(ps, backend='loop')
    except TypeError: return ('loop',)
    res = []
    for b in BACKENDS:
        try: cbopt.Adam(ps, backend=b)
        except (TypeError, ValueError, NotImplementedError, RuntimeError): continue
        res.append(b)
    return tuple(res)


def backend_kw(b: str) -> dict: return {} if available_backends() == ('loop',) and b == 'loop' else {'backend': b}


def one_group_each(ps: Named) -> list[dict]:
    "Each param of `ps` its own param group (case 12)."
    return [{'params': [p]} for _, p in ps]


def adam_contenders(backends: list[str], grouped: bool = False) -> dict[str, Callable]:
    """cbopt's Adam per backend, torch's AdamW with the same numerics in its three modes, and fastai's Adam; each
    with one param group, or `grouped`, one per param."""
    kw = dict(lr=ADAM['lr'], betas=(ADAM['mom'], ADAM['sqr_mom']), eps=ADAM['eps'], weight_decay=ADAM['wd'])
    theirs = one_group_each if grouped else _bare
    torch_adamw = lambda **mode: lambda ps: torch.optim.AdamW(theirs(ps), **kw, **mode).step
    cb = lambda b: lambda ps: cbopt.Adam(one_group_each(ps) if grouped else ps, **ADAM, **backend_kw(b)).step
    return {**{f'cbopt {b}': cb(b) for b in backends}, 'torch fused': torch_adamw(fused=True),
            'torch foreach': torch_adamw(foreach=True), 'torch loop': torch_adamw(foreach=False),
            'fastai': lambda ps: fastai_adam(ps, grouped)}


def fastai_adam(ps, grouped: bool = False) -> Callable[[], None]:
    from fastai.optimizer import Adam  # lazily: only the fastai rows need it
    return Adam([[p] for _, p in ps] if grouped else _bare(ps), **ADAM).step


def lion_contenders(backends: list[str]) -> dict[str, Callable]:
    "`cbopt.Lion` per backend (torch has no kernel for it; the catalogue part has it against lion-pytorch)."
    return {f'cbopt {b}': (lambda b: lambda ps: cbopt.Lion(ps, **LION, **backend_kw(b)).step)(b) for b in backends}


def train_contenders(compiler: str, bs: int = 64) -> tuple[dict[str, Callable[[], None]], Callable]:
    """A train step on the demo's MLP (16-64-64-1) and one fixed batch: eager `loss.backward()` + `cbopt.Adam.step()`
    (the reference); the same with the step compiled by torch's compiled-optimizer recipe (`torch.compile(lambda:
    opt.step(), fullgraph=True)`: cbopt's step traced into one graph, `cbopt.engine.traced`), and torch's AdamW (same
    numerics) eager and compiled so; and forward + `torch.func.grad` + `cbopt.functional(cbopt.Adam)`'s update, eager
    and compiled whole with `fullgraph=True`. Also returns `gap(steps)`: the largest param difference from the
    reference after `steps` steps from the same start. (The compiled step is timed here, not on the GPT-2 set: traced
    once per param, its inductor compile takes many minutes for GPT-2's 148 tensors on a CPU.)"""
    from torch.func import functional_call, grad
    from . import demo
    x, y = demo.make_data()
    x, y = x[:bs], y[:bs]
    model0 = demo.make_model(x.shape[1])
    fopt = cbopt.functional(cbopt.Adam, **ADAM)
    mse = lambda params: torch.nn.functional.mse_loss(functional_call(model0, params, (x,)), y)
    def train_step(params, state):
        return fopt.update(params, grad(mse)(params), state)
    compiled = torch.compile(train_step, fullgraph=True, backend=compiler)

    def eager_optimizer(torch_adamw: bool = False, compile_step: bool = False):
        model = demo.make_model(x.shape[1])
        if torch_adamw:
            opt = torch.optim.AdamW(model.parameters(), lr=ADAM['lr'], betas=(ADAM['mom'], ADAM['sqr_mom']),
                                    eps=ADAM['eps'], weight_decay=ADAM['wd'], foreach=True)
        else: opt = cbopt.Adam(model.named_parameters(), **ADAM)
        # (torch's own step breaks the graph around itself, so only cbopt's is compiled with fullgraph)
        opt_step = torch.compile(lambda: opt.step(), fullgraph=not torch_adamw, backend=compiler) if compile_step else opt.step
        def step():
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt_step()
        return step, lambda: dict(model.named_parameters())

    def functional_step(fn):
        params = {k: v.detach().clone() for k, v in model0.named_parameters()}
        box = [params, fopt.init(params)]
        def step(): box[:] = fn(*box)
        return step, lambda: box[0]

    makers = {'eager: backward + Adam.step': eager_optimizer,
              'backward + compiled Adam.step': lambda: eager_optimizer(compile_step=True),
              'torch: backward + AdamW.step': lambda: eager_optimizer(torch_adamw=True),
              'torch: backward + compiled AdamW.step': lambda: eager_optimizer(torch_adamw=True, compile_step=True),
              'functional, compiled': lambda: functional_step(compiled), 'functional, eager': lambda: functional_step(train_step)}

    def gap(steps: int = 3) -> dict[str, float]:
        finals = {}
        for name, make in makers.items():
            step, params = make()
            for _ in range(steps): step()
            finals[name] = torch.cat([p.detach().flatten() for p in params().values()])
        ref = finals['eager: backward + Adam.step']
        return {n: (f - ref).abs().max().item() for n, f in finals.items()}
    return {name: make()[0] for name, make in makers.items()}, gap


# bytes per element of the bandwidth references; `copy_` also reads the lines it overwrites (write-allocate) without
# that being counted, while `add_` reads every line it writes, as an optimizer step does
STREAM_BYTES = {'copy_': 8, 'add_': 12}


def stream_contenders(n: int) -> dict[str, Callable[[], None]]:
    "`dst.copy_(src)` and `dst.add_(src)` on fp32 tensors of `n` elements: the machine's streaming bandwidth."
    src, dst = torch.randn(n), torch.zeros(n)
    return {'copy_': lambda: dst.copy_(src), 'add_': lambda: dst.add_(src)}


def numerics_gap(contenders: dict[str, Callable], ref: str, shapes: Shapes, steps: int = 3) -> dict[str, float]:
    """Largest |param - ref's param| after `steps` steps from the same start, per contender: the rows of a table only
    compare if they compute the same thing. Large sets are checked on four tiny tensors instead."""
    if sum(math.prod(s) for _, s in shapes) > 1_000_000: shapes = [('a', (7, 5)), ('b', (5,)), ('c', (3, 4, 2)), ('d', (9,))]
    finals = {}
    for name, factory in contenders.items():
        ps = make_params(shapes, seed=1)
        step = factory(ps)
        for _ in range(steps): step()
        finals[name] = torch.cat([p.detach().flatten() for _, p in ps])
    return {n: (f - finals[ref]).abs().max().item() for n, f in finals.items()}


# -- timing ---------------------------------------------------------------------------------------------------------
class Progress:
    "tqdm when it is installed, else a line every 10%."
    def __init__(self, total: int):
        try:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total, unit='step', file=sys.stderr, dynamic_ncols=True)
        except ImportError: self.bar, self.total, self.done, self.shown = None, total, 0, -1

    def set(self, desc: str) -> None:
        if self.bar is not None: self.bar.set_description(desc)
        else: print(f'[bench] {desc}', file=sys.stderr, flush=True)

    def update(self, n: int = 1) -> None:
        if self.bar is not None: return self.bar.update(n)
        self.done += n
        pct = 10 * self.done // max(self.total, 1)
        if pct != self.shown: print(f'[bench] {10 * pct}%', file=sys.stderr, flush=True)
        self.shown = pct

    def close(self) -> None:
        if self.bar is not None: self.bar.close()


def timed(f: Callable) -> float:
    start = time.perf_counter()
    f()
    return time.perf_counter() - start


def measure(steps: dict[str, Callable[[], None]], rounds: int, warmup: int, progress: Progress | None = None) -> dict:
    """Time each step function: `warmup` calls on their own (they create the state, and may compile), then `rounds`
    interleaved rounds of one call each, in an order shuffled every round (seeded: the same orders in every run), so
    that no contender always follows the same one: a step leaves the caches and the allocator in its own state, and
    with the order rotated (each contender after the same one every round but one) torch's fused SGD and cbopt's call
    of the same kernel differed by 2-4%, where alternating the two alone gave 0.99x. A step that raises is recorded
    as an error and dropped from the rounds."""
    res, live = {}, {}
    for name, step in steps.items():
        try:
            res[name] = {'warmup_s': [timed(step) for _ in range(warmup)], 'times': []}
            live[name] = step
        except Exception as e: res[name] = {'error': f'{type(e).__name__}: {e}'}
        if progress: progress.update(warmup if name in live else warmup + rounds)
    names, orders = list(live), random.Random(0)
    gc.disable()
    try:
        for _ in range(rounds):
            for name in orders.sample(names, len(names)): res[name]['times'].append(timed(live[name]))
            if progress: progress.update(len(names))
    finally: gc.enable()
    for name in names:
        r = res[name]
        r['median_s'] = statistics.median(r['times'])
        r['first_s'] = r['warmup_s'][0]
        r['warmup_extra_s'] = sum(r['warmup_s']) - warmup * r['median_s']  # state creation and compilation
    return res


def paired(res: dict, a: str, b: str) -> float | None:
    "Median over rounds of `a`'s step time / `b`'s in the same round (None when either failed)."
    if 'median_s' not in res.get(a, {}) or 'median_s' not in res.get(b, {}): return None
    return statistics.median(x / y for x, y in zip(res[a]['times'], res[b]['times']))


# -- peak memory (in a fresh subprocess per optimizer) -----------------------------------------------------------------
def _status_kb(key: str) -> int:
    for line in Path('/proc/self/status').read_text().splitlines():
        if line.startswith(key + ':'): return int(line.split()[1])
    raise KeyError(key)


def pin_mmap_threshold(nbytes: int = 1 << 16) -> None:
    """Make glibc serve every allocation of `nbytes` or more by mmap and unmap it on free (`mallopt(M_MMAP_THRESHOLD)`),
    so freed temporaries never stay in the heap, where a later step could reuse them unseen by the peak RSS."""
    import ctypes
    ctypes.CDLL(None).mallopt(-3, nbytes)  # M_MMAP_THRESHOLD; pinning it also stops glibc from raising it


def step_peak_memory(names: list[str], quick: bool, backends: list[str]) -> dict[str, float]:
    """For each optimizer: build the GPT-2 set and the optimizer, take 2 steps (the state now exists), reset the peak
    RSS (`5 > /proc/self/clear_refs`), take one step, and return the peak minus the RSS before it, in % of param bytes."""
    pin_mmap_threshold()
    out = {}
    for name in names:
        ps = make_params(param_sets(quick)['gpt2'])
        step = adam_contenders(backends)[name](ps)
        step(), step()
        gc.collect()
        Path('/proc/self/clear_refs').write_text('5')
        before = _status_kb('VmRSS')
        step()
        out[name] = (_status_kb('VmHWM') - before) * 1024 / (4 * numel(ps)) * 100
        del ps, step
        gc.collect()
    return out


def peak_memory(names: list[str], quick: bool, backends: list[str], progress: Progress | None = None) -> dict:
    "`step_peak_memory` of each optimizer in a fresh subprocess (all in this process in quick runs, to save time)."
    if quick:
        res = step_peak_memory(names, quick, backends)
        if progress: progress.update(len(names))
        return res
    res = {}
    for name in names:
        code = (f'import json, torch, cbopt.cli.bench as b; torch.set_num_threads({torch.get_num_threads()}); '
                f'print(json.dumps(b.step_peak_memory([{name!r}], False, {backends!r})))')
        run = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
        res[name] = json.loads(run.stdout.strip().splitlines()[-1])[name] if run.returncode == 0 else None
        if progress: progress.update()
    return res


# -- reporting ------------------------------------------------------------------------------------------------------
def machine() -> dict:
    cpu = next((l.split(':', 1)[1].strip() for l in Path('/proc/cpuinfo').read_text().splitlines()
                if l.startswith('model name')), platform.processor())
    import fastai
    return dict(cpu=cpu, cores=os.cpu_count(), torch_threads=torch.get_num_threads(), torch=torch.__version__,
                fastai=fastai.__version__, cbopt=cbopt.__version__, python=platform.python_version(),
                date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()))


def fmt(v, spec: str = '.2f', suffix: str = '') -> str: return '-' if v is None else f'{v:{spec}}{suffix}'


def table(header: list[str], rows: list[list[str]]) -> str:
    "A markdown table (readable as it is in a terminal)."
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: '| ' + ' | '.join(str(c).ljust(w) for c, w in zip(cells, widths)) + ' |'
    return '\n'.join([line(header), '|' + '|'.join('-' * (w + 2) for w in widths) + '|', *map(line, rows)])


def _rows(case: dict, per_param_bytes: int, header: list[str], cells) -> tuple[list[str], list[list[str]]]:
    "One table row per contender: name, step times, then `cells(name, result, GB/s)`; errors as short messages."
    res, nbytes, rows = case['results'], case['numel'] * per_param_bytes, []
    for name, r in res.items():
        if 'error' in r:
            rows.append([name, r['error'][:60]] + [''] * (len(header) - 2))
            continue
        rows.append([name, fmt(r['median_s'] * 1e3, '.1f'), fmt(min(r['times']) * 1e3, '.1f'),
                     *cells(name, r, nbytes / r['median_s'] / 1e9)])
    return header, rows


def adam_rows(case: dict, bw: float | None, mem: dict) -> tuple[list[str], list[list[str]]]:
    res = case['results']
    header = ['optimizer', 'step ms', 'best ms', '/ torch fused', '/ torch foreach', '/ torch loop', 'fastai speedup',
              'GB/s', '% of bw', 'peak mem % params', 'first step s']
    return _rows(case, ADAM_BYTES, header, lambda name, r, gbs: [
        *[fmt(paired(res, name, ref), '.2f', 'x') for ref in ('torch fused', 'torch foreach', 'torch loop')],
        fmt(paired(res, 'fastai', name), '.2f', 'x'), fmt(gbs, '.1f'), fmt(gbs / bw * 100 if bw else None, '.0f', '%'),
        fmt(mem.get(name), '.1f', '%'), fmt(r['first_s'], '.2f')])


def lion_rows(case: dict, bw: float | None) -> tuple[list[str], list[list[str]]]:
    res = case['results']
    header = ['optimizer', 'step ms', 'best ms', 'speedup vs loop', 'GB/s', '% of bw', 'first step s', 'warm-up extra s']
    return _rows(case, LION_BYTES, header, lambda name, r, gbs: [
        fmt(paired(res, 'cbopt loop', name), '.2f', 'x'), fmt(gbs, '.1f'),
        fmt(gbs / bw * 100 if bw else None, '.0f', '%'), fmt(r['first_s'], '.2f'), fmt(r['warmup_extra_s'], '.2f')])


def train_rows(case: dict) -> tuple[list[str], list[list[str]]]:
    res, ref = case['results'], 'eager: backward + Adam.step'
    header = ['train step', 'step ms', 'best ms', '/ eager step', 'first step s', 'warm-up extra s']
    rows = []
    for name, r in res.items():
        if 'error' in r: rows.append([name, r['error'][:60]] + [''] * (len(header) - 2))
        else: rows.append([name, fmt(r['median_s'] * 1e3, '.2f'), fmt(min(r['times']) * 1e3, '.2f'),
                           fmt(paired(res, name, ref), '.2f', 'x'), fmt(r['first_s'], '.2f'), fmt(r['warmup_extra_s'], '.2f')])
    return header, rows


def clip_rows(case: dict) -> tuple[list[str], list[list[str]]]:
    "Case 7: each row against torch's clipped step and against cbopt's own unclipped fused step."
    res = case['results']
    header = ['optimizer', 'step ms', 'best ms', '/ torch fused + clip_grad_norm_', '/ cbopt fused', '/ torch fused',
              'GB/s (Adam 28 B + norm 4 B)']
    return _rows(case, ADAM_BYTES + 4, header, lambda name, r, gbs: [
        *[fmt(paired(res, name, ref), '.2f', 'x') for ref in ('torch fused + clip_grad_norm_', 'cbopt fused', 'torch fused')],
        fmt(gbs, '.1f')])


def in_backward_rows(case: dict) -> tuple[list[str], list[list[str]]]:
    "Case 8: peak memory a training step adds and its time, normal and in backward, tied and untied."
    header = ['model', 'step', 'grads MB', 'peak MB', 'grads saved', 'at most', 'step s', 'time / normal']
    rows = []
    for key, c in case.items():
        for name, mem in (('normal', c['normal']), ('in backward', c['in_backward'])):
            r, inb = c['results'].get(name, {}), name == 'in backward'
            # a grad arrives whole: the largest one is held at once in any case (1 - largest / all is the best saving)
            most = mem and mem.get('largest_grad_bytes') and 100 * (1 - mem['largest_grad_bytes'] / mem['grad_bytes'])
            rows.append([f'GPT-2 shapes, {key}', name, fmt(mem and mem['grad_bytes'] / 2**20, '.1f'),
                         fmt(mem and mem['peak_bytes'] / 2**20, '.1f'),
                         fmt(c['saved_of_grads'] * 100 if inb and c['saved_of_grads'] is not None else None, '.0f', '%'),
                         fmt(most if inb else None, '.0f', '%'),
                         fmt(r.get('median_s'), '.2f'),
                         fmt(c['time_ratio'] if name == 'in backward' else 1.0, '.2f', 'x')])
    return header, rows


CASE_TITLES = {'gpt2': 'Adam on the GPT-2 set', 'grid': 'Adam on the grid of small tensors',
               'groups': 'Adam on the grid, one param group per tensor',
               'lion': 'Lion (cbopt callbacks only) on the GPT-2 set',
               'train': "A train step on the demo's MLP (forward, grad, Adam update)"}


def report(results: dict) -> str:
    "The tables of a run, as markdown."
    m, cases, streams = results['machine'], results['cases'], results['bandwidth_GBps']
    bw = max((v for v in streams.values() if v), default=None)
    out = [f"Machine: {m['cpu']}, {m['cores']} cores (torch threads: {m['torch_threads']}), torch {m['torch']}, "
           f"fastai {m['fastai']}, Python {m['python']}; {m['date']}. fp32, median of {results['rounds']} interleaved "
           f"steps." + (" Bandwidth (`% of bw` is of the larger): " +
                        ', '.join(f"`{k}` {fmt(v, '.1f')} GB/s" for k, v in streams.items()) + '.' if streams else '')]
    for key, case in cases.items():
        header, rows = (lion_rows(case, bw) if key == 'lion' else train_rows(case) if key == 'train' else
                        adam_rows(case, bw, results['peak_mem_pct'] if key == 'gpt2' else {}))
        gaps = {n: g for n, g in case['numerics_gap'].items() if g > case['tolerance']}
        note = f"\n\nNUMERICS DIFFER (max |diff| after 3 steps): {gaps}" if gaps else ''
        shape = f"{case['tensors']:,} tensors, {case['numel']:,} params"
        if key == 'train': shape += f", batch {case['batch']}, compiled with {case['compiler']}"
        out.append(f"**{CASE_TITLES[key]}** ({shape})\n\n{table(header, rows)}{note}")
    if 'clip' in results:
        case = results['clip']
        gaps = {n: g for n, g in case['numerics_gap'].items() if g > case['tolerance']}
        note = f"\n\nNUMERICS DIFFER (max |diff| after 3 steps): {gaps}" if gaps else ''
        out.append(f"**Adam with global-norm clipping on the GPT-2 set** (max_norm {CLIP_NORM:g}: every step clips)"
                   f"\n\n{table(*clip_rows(case))}{note}")
    if 'in_backward' in results:
        out.append(f"**InBackward: forward + backward + step** (cbopt.Adam, torch's kernel; one sequence of {TOKENS} "
                   f"tokens)\n\n{table(*in_backward_rows(results['in_backward']))}")
    if 'memory' in results:
        res = results['memory']
        note = f"\n\nFAILED: {res['error']}" if res.get('error') else ''
        out.append(f"**Optimizer state per rank** (cbopt.Adam, {res['world']} gloo processes; {res['tensors']:,} tensors, "
                   f"{res['numel']:,} params, {res['param_bytes'] / 1e6:.1f} MB of fp32 params)\n\n"
                   f"{table(*memory_rows(res))}{note}")
    if 'catalogue' in results or 'compile' in results:
        if 'catalogue' in results:
            c = results['catalogue']
            out.append(catalogue_report(c['cases'], c['numel'], c['tensors']))
        if 'compile' in results: out.append(compile_report(results['compile']['cases']))
    return '\n\n'.join(out)


def plot(results: dict, path: Path) -> None:
    "Bar charts of the step times per case, and of the peak memory per optimizer."
    import matplotlib  # lazily: `import cbopt` never needs matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, axs = plt.subplots(2, (len(results['cases']) + 2) // 2, figsize=(6.5 * ((len(results['cases']) + 2) // 2), 8))
    for ax, (key, case) in zip(axs.flat, results['cases'].items()):
        ok = {n: r for n, r in case['results'].items() if 'median_s' in r}
        bars = ax.barh(list(ok), [r['median_s'] * 1e3 for r in ok.values()],
                       color=['tab:blue' if n.startswith('cbopt') else 'tab:gray' for n in ok])
        ax.bar_label(bars, fmt='%.1f', padding=2, fontsize=8)
        ax.invert_yaxis()
        ax.set(title=f"{CASE_TITLES[key]}: {case['tensors']:,} tensors, {case['numel'] / 1e6:.1f}M params",
               xlabel='ms per step (median)')
    mem = {n: v for n, v in results['peak_mem_pct'].items() if v is not None}
    ax = axs.flat[len(results['cases'])]
    bars = ax.barh(list(mem), list(mem.values()), color=['tab:blue' if n.startswith('cbopt') else 'tab:gray' for n in mem])
    ax.bar_label(bars, fmt='%.1f%%', padding=2, fontsize=8)
    ax.invert_yaxis()
    ax.set(title='Adam, GPT-2 set: peak memory a step adds', xlabel='% of param bytes')
    m = results['machine']
    fig.suptitle(f"cbopt bench{' (quick: tiny sizes)' if results['quick'] else ''}: {m['cpu']}, {m['cores']} cores, "
                 f"torch {m['torch']}, torch threads: {m['torch_threads']}, fp32 (blue: cbopt)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- the catalogue (case 9) and the cold first compile (case 10) ---------------------------------------------------
# For every optimizer of the catalogue, on the GPT-2 set at `--size` times its width: cbopt's fused and foreach steps
# against the fastest mode of the implementation its users run today (torch.optim's fused and foreach, lion-pytorch,
# pytorch-optimizer, torch-optimi, schedulefree, fastai), and each step against the memory-traffic floor: the bytes it
# must move (param read and write, grad read, each state buffer read and written) at the bandwidth of an in-place
# `add_` timed in the same rounds. Every row is first checked against the reference on a tiny GPT-2 (3 steps).
Named = list  # [(name, param)]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One optimizer of the catalogue: `ours(params)` builds cbopt's (its backend is set afterwards), `refs` maps each
    mode of the reference to a builder of it, both from named params with the same hypers; `select(name, shape)` picks
    the params it steps (Muon: the hidden matrices)."""
    name: str
    ours: Callable[[Named], cbopt.Optimizer]
    refs: dict[str, Callable[[Named], Any]]
    select: Callable[[str, tuple], bool] | None = None
    tol: float = 1e-5  # the numerics check's: relative to the reference's largest param, after 3 steps


def _bare(ps: Named) -> list: return [p for _, p in ps]


def _torch(name: str, **kw) -> Entry:
    "torch.optim's `name` in its fused (where torch has it) and foreach modes, against `cbopt.optim`'s twin."
    import inspect
    cls = getattr(torch.optim, name)
    modes = (['fused'] if 'fused' in inspect.signature(cls).parameters else []) + ['foreach']
    refs = {f'torch {m}': (lambda m: lambda ps: cls(_bare(ps), **kw, **{m: True}))(m) for m in modes}
    return Entry(name, lambda ps: getattr(cbopt.optim, name)(ps, **kw), refs)


def _lion_pytorch(ps, **kw):
    from lion_pytorch import Lion
    return Lion(_bare(ps), **kw)


def _pytorch_optimizer(name: str, ps, **kw):
    import pytorch_optimizer
    return getattr(pytorch_optimizer, name)(_bare(ps), foreach=True, **kw)


def _optimi(ps, **kw):
    import optimi
    return optimi.StableAdamW(_bare(ps), foreach=True, **kw)


def _schedulefree(name: str, ps, **kw):
    import schedulefree
    opt = getattr(schedulefree, name)(_bare(ps), foreach=True, **kw)
    opt.train()  # both start in eval mode (and schedulefree's train() returns None)
    return opt


def _fastai_lamb(ps, **kw):
    from fastai.optimizer import Lamb
    return Lamb(_bare(ps), **kw)


def _hidden_matrix(name: str, shape: tuple) -> bool: return cbopt.is_hidden_matrix(name, torch.empty(shape, device='meta'))


def catalogue() -> list[Entry]:
    "Every optimizer of the catalogue, each with the same hypers on both sides (the references' defaults, mostly)."
    muon = lambda ps: torch.optim.Muon(_bare(ps))
    return [
        _torch('SGD', lr=1e-3, momentum=0.9, weight_decay=1e-2),
        _torch('Adam'), _torch('AdamW'), _torch('RAdam'), _torch('NAdam'), _torch('Adagrad'), _torch('Adadelta'),
        _torch('Adamax'), _torch('ASGD'), _torch('Rprop'), _torch('RMSprop'), _torch('Adafactor'),
        # Newton-Schulz in bfloat16: compiled, its ops round otherwise than torch's eager ones
        Entry('Muon', lambda ps: cbopt.Muon(_bare(ps)), {'torch': muon}, select=_hidden_matrix, tol=1e-3),
        Entry('Lion', lambda ps: cbopt.Lion(ps, lr=1e-4, wd=0.1),
              {'lion-pytorch': lambda ps: _lion_pytorch(ps, lr=1e-4, weight_decay=0.1)}),
        Entry('Adan', lambda ps: cbopt.Adan(ps, wd=0.02),
              {'pytorch-optimizer foreach': lambda ps: _pytorch_optimizer('Adan', ps, weight_decay=0.02)}),
        Entry('AdEMAMix', lambda ps: cbopt.AdEMAMix(ps),
              {'pytorch-optimizer foreach': lambda ps: _pytorch_optimizer('AdEMAMix', ps)}),
        Entry('StableAdamW', lambda ps: cbopt.StableAdamW(ps, lr=1e-3),
              {'optimi foreach': lambda ps: _optimi(ps, lr=1e-3)}),
        Entry('ScheduleFreeSGD', lambda ps: cbopt.ScheduleFreeSGD(ps).train(),
              {'schedulefree foreach': lambda ps: _schedulefree('SGDScheduleFree', ps)}),
        Entry('ScheduleFreeAdamW', lambda ps: cbopt.ScheduleFreeAdamW(ps).train(),
              {'schedulefree foreach': lambda ps: _schedulefree('AdamWScheduleFree', ps)}),
        Entry('Lamb', lambda ps: cbopt.Lamb(ps, lr=1e-3, wd=0.01),
              {'fastai': lambda ps: _fastai_lamb(ps, lr=1e-3, wd=0.01)}),
    ]


def _ours(entry: Entry, backend: cbopt.Backend) -> Callable[[Named], cbopt.Optimizer]:
    def make(ps):
        opt = entry.ours(ps)
        opt.backend = backend
        return opt
    return make


def catalogue_contenders(entry: Entry, compiler: str) -> dict[str, Callable[[Named], Any]]:
    "cbopt's fused and foreach rows, then the reference's modes: name -> builder."
    rows = {}
    rows['cbopt fused'] = _ours(entry, cbopt.Backend('fused', compiler=compiler))
    rows['cbopt foreach'] = _ours(entry, cbopt.Backend('foreach'))
    return {**rows, **entry.refs}


def _select(entry: Entry, ps: Named) -> Named:
    return [(n, p) for n, p in ps if entry.select is None or entry.select(n, tuple(p.shape))]


def state_bytes(opt) -> int:
    "The bytes of the per-param tensor state of `opt` (0-d counters are left out: they are not streamed)."
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.ndim > 0)


def tiny_gpt2(layers: int = 12) -> list:
    """GPT-2's tensors at width 16 (148 with 12 layers): the numerics check's set. The same buckets and chunks as GPT-2
    small's, and no two sizes equal that differ there, so the fused rows reuse the graphs compiled for the timed set."""
    return gpt2_shapes(vocab=100, ctx=24, d=16, layers=layers)


def catalogue_numerics(entry: Entry, compiler: str, quick: bool, steps: int = 3) -> dict[str, float]:
    """The largest |param - reference's param| after `steps` steps from one start on `tiny_gpt2`, relative to the
    reference's largest |param|, per row (the first reference mode is the reference). Every step gets the same grads
    afresh: some references write into `p.grad` (schedulefree divides it in place), which cbopt never does."""
    finals = {}
    for name, make in catalogue_contenders(entry, compiler).items():
        ps = _select(entry, make_params(tiny_gpt2(1 if quick else 12), seed=1))
        grads = [p.grad.clone() for _, p in ps]
        step = make(ps).step
        for _ in range(steps):
            for (_, p), g in zip(ps, grads): p.grad = g.clone()
            step()
        finals[name] = torch.cat([p.detach().flatten() for _, p in ps])
    ref = finals[next(iter(entry.refs))]
    scale = ref.abs().max().item()
    return {n: (f - ref).abs().max().item() / scale for n, f in finals.items()}


def catalogue_case(shapes: list, rounds: int, warmup: int, quick: bool, only: list[str] | None = None,
                   progress=None) -> dict:
    """Each optimizer of the catalogue on `shapes`: its rows and the reference's, timed interleaved with an in-place
    `add_` on two tensors of 2**24 floats (the bandwidth of that round), one optimizer at a time (its state freed
    before the next). Quick runs compile with dynamo alone (the `eager` backend: no codegen)."""
    compiler = 'eager' if quick else 'inductor'
    stream_n = 1 << (18 if quick else 24)
    out = {}
    for entry in catalogue():
        if only and entry.name not in only: continue
        if progress: progress.set(f'catalogue: {entry.name}')
        ps = _select(entry, make_params(shapes))
        opts = {name: make(ps) for name, make in catalogue_contenders(entry, compiler).items()}
        steps = {**{n: o.step for n, o in opts.items()}, 'add_': stream_contenders(stream_n)['add_']}
        res = measure(steps, rounds, max(warmup, 2), progress)  # the fused backend compiles on its second step
        grads = sum(p.grad.numel() * p.grad.element_size() for _, p in ps)
        params = sum(p.numel() * p.element_size() for _, p in ps)
        floor = 2 * params + grads + 2 * state_bytes(opts['cbopt foreach'])
        nparams = sum(p.numel() for _, p in ps)
        del opts, steps, ps
        gc.collect()
        out[entry.name] = dict(results=res, refs=list(entry.refs), floor_bytes=floor, bytes_per_param=floor / nparams,
                               numel=nparams, stream_numel=stream_n, numerics=catalogue_numerics(entry, compiler, quick),
                               tolerance=entry.tol,
                               compiler=compiler)
    return out


def fastest_ref(case: dict) -> str | None:
    "The reference mode with the lowest median step time."
    ok = [r for r in case['refs'] if 'median_s' in case['results'].get(r, {})]
    return min(ok, key=lambda r: case['results'][r]['median_s']) if ok else None


def times_floor(case: dict, row: str) -> float | None:
    """Median over rounds of the row's time over the floor's in that round: `floor_bytes` at the bandwidth of that
    round's `add_` (12 bytes per element: two reads and a write)."""
    ratio = paired(case['results'], row, 'add_')
    return None if ratio is None else ratio * 12 * case['stream_numel'] / case['floor_bytes']


def catalogue_rows(cases: dict) -> tuple[list[str], list[list[str]]]:
    "One row per optimizer: its reference's fastest mode, the step times, the ratios, the floor, the numerics gap."
    header = ['optimizer', 'reference (fastest)', 'ref ms', 'fused ms', 'foreach ms', 'fused / ref', 'foreach / ref',
              'fused x floor', 'foreach x floor', 'ref x floor', 'B/param', 'fused warm-up extra s', 'max rel diff']
    rows = []
    for name, case in cases.items():
        res, ref = case['results'], fastest_ref(case)
        ms = lambda r: fmt(res[r]['median_s'] * 1e3, '.1f') if 'median_s' in res.get(r, {}) else (
            res[r]['error'][:40] if r in res else '-')
        rows.append([name, ref or '-', ms(ref) if ref else '-', ms('cbopt fused'), ms('cbopt foreach'),
                     fmt(paired(res, 'cbopt fused', ref) if ref else None, '.2f', 'x'),
                     fmt(paired(res, 'cbopt foreach', ref) if ref else None, '.2f', 'x'),
                     fmt(times_floor(case, 'cbopt fused'), '.2f', 'x'), fmt(times_floor(case, 'cbopt foreach'), '.2f', 'x'),
                     fmt(times_floor(case, ref) if ref else None, '.2f', 'x'),
                     fmt(case.get('bytes_per_param'), '.0f'),
                     fmt(res.get('cbopt fused', {}).get('warmup_extra_s'), '.1f'),
                     fmt(max(case['numerics'].values()), '.0e')])
    return header, rows


def catalogue_report(cases: dict, numel: int, tensors: int) -> str:
    bad = {n: {k: v for k, v in c['numerics'].items() if v > c['tolerance']} for n, c in cases.items()}
    bad = {n: v for n, v in bad.items() if v}
    note = f"\n\nNUMERICS DIFFER (max |diff| / max |param| after 3 steps): {bad}" if bad else ''
    return (f"**The catalogue on the GPT-2 set** ({tensors:,} tensors, {numel:,} params; Muon: its hidden matrices)"
            f"\n\n{table(*catalogue_rows(cases))}{note}")




def gpt2_at(width: float = 1., quick: bool = False) -> list:
    """The GPT-2 set at `width` times GPT-2 small's width and vocabulary (148 tensors at any width, so the same
    buckets and graphs; about width**2 of its 124.4M params); quick runs take a 1-layer `tiny_gpt2` (16 tensors)."""
    if quick: return tiny_gpt2(1)
    if width == 1: return gpt2_shapes()
    return gpt2_shapes(vocab=max(64, round(50257 * width)), ctx=max(16, round(1024 * width)),
                       d=max(64, 64 * round(12 * width)))


# -- the cold first compile (`--only compile`) ---------------------------------------------------------------------
def _cpu_s() -> float:
    "CPU seconds of this process and its finished children (gcc): a compile's cost that the machine's load does not inflate."
    import resource
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


def cold_compile(width: float, quick: bool) -> dict:
    """In this (fresh) process: Lion's fused steps on the GPT-2 set at `width`; the first runs eagerly (it creates the
    state), the second compiles. Returns their wall and CPU times and what dynamo and inductor counted."""
    from torch._dynamo.utils import counters
    ps = make_params(gpt2_at(width, quick))
    opt = cbopt.Lion(ps, lr=1e-4, wd=0.1, backend='fused')
    wall, cpu = [], []
    for _ in range(3):
        t, c = time.perf_counter(), _cpu_s()
        opt.step()
        wall.append(time.perf_counter() - t)
        cpu.append(_cpu_s() - c)
    return dict(first_s=wall[0], compile_step_s=wall[1], compile_step_cpu_s=cpu[1], third_s=wall[2], tensors=len(ps),
                graphs=counters['stats'].get('unique_graphs', 0),
                fxgraph_cache_miss=counters['inductor'].get('fxgraph_cache_miss', 0),
                fxgraph_cache_hit=counters['inductor'].get('fxgraph_cache_hit', 0))


def compile_case(width: float, quick: bool) -> dict:
    """`cold_compile` in a fresh subprocess with an empty inductor cache (a new `TORCHINDUCTOR_CACHE_DIR`), then again
    in another fresh process with that cache now filled (what a second run of the same script pays). Inductor compiles
    in the process itself (`TORCHINDUCTOR_COMPILE_THREADS=1`), so that its CPU time is counted."""
    res = {}
    with tempfile.TemporaryDirectory(prefix='cbopt_bench_cold_') as cache:
        env = {**os.environ, 'TORCHINDUCTOR_CACHE_DIR': cache, 'TORCHINDUCTOR_COMPILE_THREADS': '1'}
        code = (f'import json, torch, cbopt.cli.bench as c; torch.set_num_threads({torch.get_num_threads()}); '
                f'print(json.dumps(c.cold_compile({width!r}, {quick!r})))')
        for key in ('cold', 'warm cache'):
            run = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env)
            res[key] = (json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0
                        else {'error': run.stderr.strip().splitlines()[-1] if run.stderr.strip() else 'failed'})
    return res


def compile_report(case: dict) -> str:
    header = ['inductor cache', 'tensors', 'first step s (eager)', 'second step s (compiles)', 'its CPU s',
              'third step s', 'graphs', 'FX graph cache misses', 'hits']
    rows = []
    for key, r in case.items():
        if 'error' in r: rows.append([key, r['error'][:60]] + [''] * (len(header) - 2))
        else: rows.append([key, r['tensors'], fmt(r['first_s']), fmt(r['compile_step_s']), fmt(r['compile_step_cpu_s']),
                           fmt(r['third_s']), r['graphs'],
                           r['fxgraph_cache_miss'], r['fxgraph_cache_hit']])
    return f"**Lion's first compile, fresh process** (`cbopt.Lion(..., backend='fused')`)\n\n{table(header, rows)}"


# -- main -----------------------------------------------------------------------------------------------------------
def run_case(contenders: dict[str, Callable], shapes: Shapes, rounds: int, warmup: int, progress: Progress,
             extra: dict[str, Callable[[], None]] | None = None, ref: str = 'torch fused', tol: float = 1e-6,
             unchecked: dict[str, Callable] | None = None) -> dict:
    """Time `contenders` on one shared set of params (each optimizer keeps its own state), plus `unchecked` ones (other
    numerics: timed only) and `extra` step functions; then check that `contenders` compute the same thing (after
    timing, so that a first compilation is timed as a user sees it)."""
    ps = make_params(shapes)
    steps = {**{n: f(ps) for n, f in {**contenders, **(unchecked or {})}.items()}, **(extra or {})}
    res = measure(steps, rounds, warmup, progress)
    del steps, ps
    gc.collect()
    gap = numerics_gap(contenders, ref, shapes)
    return {'numel': sum(math.prod(s) for _, s in shapes),
            'tensors': len(shapes), 'results': res, 'numerics_gap': gap, 'tolerance': tol}


TRAIN_ROWS = 6


def train_case(quick: bool, rounds: int, warmup: int, progress: Progress) -> dict:
    """The train step rows (`train_contenders`): 5x the rounds, as a step takes about a millisecond. A quick run
    compiles with aot_eager (dynamo's graph without inductor's C++ codegen, which takes a minute on a busy CPU)."""
    compiler = 'aot_eager' if quick else 'inductor'
    steps, gap = train_contenders(compiler)
    res = measure(steps, 5 * rounds, warmup, progress)
    from . import demo
    model = demo.make_model()
    return {'numel': sum(p.numel() for p in model.parameters()), 'tensors': len(list(model.parameters())), 'batch': 64,
            'compiler': compiler, 'rounds': 5 * rounds, 'results': res, 'numerics_gap': gap(), 'tolerance': 1e-6}


PARTS = ('adam', 'groups', 'lion', 'train', 'clip', 'in_backward', 'memory', 'catalogue', 'compile')


def main(argv: list[str] | None = None) -> dict:
    "Run the benchmark; print the tables, write bench.json and bench.png to `--out`; return the results."
    parser = argparse.ArgumentParser(prog='python -m cbopt bench', description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--out', default='bench_results', help='directory for bench.json and bench.png')
    parser.add_argument('--steps', type=int, default=None, help='timed interleaved rounds (default 10; 3 with --quick)')
    parser.add_argument('--warmup', type=int, default=2, help='untimed steps before the rounds, the first included')
    parser.add_argument('--quick', action='store_true', help='tiny sizes: a smoke run of a few seconds')
    parser.add_argument('--threads', type=int, default=None, help="torch's CPU threads (default: torch's own choice)")
    parser.add_argument('--only', default=','.join(PARTS), help=f"comma-separated parts to run, of {','.join(PARTS)} "
                        "(adam: cases 1, 2, 4, 5; groups: 12; lion: 3; train: 6; clip: 7; in_backward: 8; memory: 9; catalogue: 10; compile: 11)")
    parser.add_argument('--size', type=float, default=1.0, help="catalogue and compile: the GPT-2 set's width and "
                        "vocabulary as a fraction of GPT-2 small's (0.5: a quarter of its 124M params)")
    parser.add_argument('--optimizers', default=None, help='catalogue: comma-separated names of the optimizers to run '
                        '(default: all)')
    args = parser.parse_args(argv)
    args.only = [p.strip() for p in args.only.split(',') if p.strip()]
    if unknown := [p for p in args.only if p not in PARTS]: parser.error(f"unknown part(s) {unknown}: expected {PARTS}")
    if args.optimizers:
        args.optimizers = [n.strip() for n in args.optimizers.split(',') if n.strip()]
        if unknown := sorted(set(args.optimizers) - {e.name for e in catalogue()}):
            parser.error(f"unknown optimizer(s) {unknown} for --optimizers: expected names of the catalogue")
    if args.threads: torch.set_num_threads(args.threads)
    if args.quick: return run(args)
    before = os.environ.get('TORCHINDUCTOR_CACHE_DIR')
    with tempfile.TemporaryDirectory(prefix='cbopt_bench_inductor_') as cache:
        os.environ['TORCHINDUCTOR_CACHE_DIR'] = cache  # an empty compile cache: compile times as a first run pays them
        try: return run(args)
        finally:
            if before is None: os.environ.pop('TORCHINDUCTOR_CACHE_DIR', None)
            else: os.environ['TORCHINDUCTOR_CACHE_DIR'] = before


def run(args: argparse.Namespace) -> dict:
    "The cases, peak memory, report, JSON and plot (full runs compile with an empty cache, quick ones with the usual)."
    rounds = args.steps or (3 if args.quick else 10)
    warmup = max(args.warmup, 1)
    torch.manual_seed(0)
    sets, backends = param_sets(args.quick), list(available_backends())
    adam, lion = adam_contenders(backends), lion_contenders(backends)
    stream_n = 1 << (20 if args.quick else 26)  # 4 MiB or 256 MiB per tensor: far beyond the caches in the full run
    per = warmup + rounds
    clip, unclipped = clip_contenders(), unclipped_contenders()
    todo = set(args.only)
    progress = Progress(per * (('adam' in todo) * (2 * len(adam) + len(STREAM_BYTES)) + ('groups' in todo) * len(adam)
                               + ('lion' in todo) * len(lion)
                               + ('clip' in todo) * (len(clip) + len(unclipped)) + ('in_backward' in todo) * 4)
                        + ('adam' in todo) * len(adam) + ('in_backward' in todo) * 4
                        + ('train' in todo) * TRAIN_ROWS * (warmup + 5 * rounds))
    print(f"cbopt backends: {', '.join(backends)}", flush=True)
    cases, streams, bandwidth, mem, parts = {}, {}, {}, {}, {}
    if 'adam' in todo:
        progress.set('Adam, GPT-2 small')
        cases['gpt2'] = run_case(adam, sets['gpt2'], rounds, warmup, progress, extra=stream_contenders(stream_n))
        streams = {k: cases['gpt2']['results'].pop(k) for k in STREAM_BYTES}
        bandwidth = {k: STREAM_BYTES[k] * stream_n / r['median_s'] / 1e9 if 'median_s' in r else None
                     for k, r in streams.items()}
        progress.set('Adam, 64x64 grid')
        cases['grid'] = run_case(adam, sets['grid'], rounds, warmup, progress)
    if 'groups' in todo:
        progress.set('Adam, 64x64 grid, a group per tensor')
        cases['groups'] = run_case(adam_contenders(backends, grouped=True), sets['grid'], rounds, warmup, progress)
    if 'lion' in todo:
        progress.set('Lion, GPT-2 small')
        cases['lion'] = run_case(lion, sets['lion'], rounds, warmup, progress, ref='cbopt loop', tol=1e-5)
    if 'train' in todo:
        progress.set("train step, demo's MLP")
        cases['train'] = train_case(args.quick, rounds, warmup, progress)
    if 'clip' in todo:
        progress.set('Adam + clipping, GPT-2 small')
        parts['clip'] = run_case(clip, sets['gpt2'], rounds, warmup, progress, ref='torch fused + clip_grad_norm_',
                                 unchecked=unclipped)
    if 'adam' in todo:
        progress.set('peak memory')
        mem = peak_memory(list(adam), args.quick, backends, progress)
    if 'in_backward' in todo:
        progress.set('InBackward')
        parts['in_backward'] = in_backward_case(args.quick, rounds, warmup, progress)
    if 'memory' in todo:
        progress.set('state per rank: DDP, ZeRO, FSDP2')
        parts['memory'] = state_memory(sets['gpt2'])
    if 'catalogue' in todo:
        shapes = gpt2_at(args.size, args.quick)
        parts['catalogue'] = dict(size=args.size, numel=sum(math.prod(s) for _, s in shapes), tensors=len(shapes),
                                  cases=catalogue_case(shapes, rounds, warmup, args.quick,
                                                                       args.optimizers, progress))
    if 'compile' in todo:
        progress.set('first compile, fresh processes')
        parts['compile'] = dict(size=args.size, cases=compile_case(args.size, args.quick))
    progress.close()
    results = dict(machine=machine(), quick=args.quick, cold_compile_cache=not args.quick, rounds=rounds, warmup=warmup,
                   backends=backends, bandwidth_GBps=bandwidth, streams={'numel': stream_n, **streams},
                   peak_mem_pct=mem, cases=cases, **parts)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / 'bench.json').write_text(json.dumps(results, indent=1))  # before the report: a long run's numbers are kept
    text = report(results)
    print('\n' + text, flush=True)
    (out / 'bench.md').write_text(text + '\n')
    if cases: plot(results, out / 'bench.png')
    print(f"\nwrote {out / 'bench.json'}, {out / 'bench.md'}" + (f", {out / 'bench.png'}" if cases else ''))
    return results
