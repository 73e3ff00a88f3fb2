"""The bench's contenders: each a factory from named params to a step function (or an optimizer), cbopt's per backend
and the references a case times it against (torch.optim's modes, fastai, lion-pytorch, pytorch-optimizer,
torch-optimi, schedulefree). A reference's package is imported only when its factory is called, and a factory that
needs a package beyond torch declares it (`needs`): where that package is not installed, its rows are skipped with a
note (`installed`) instead of failing the run. Adding a contender is adding an entry to one of these tables."""
from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from functools import cache
from typing import Any

import torch

import cbopt
from .params import PLACEMENT, TOKENS, Named, gpt2_model

__all__ = ['BACKENDS', 'ADAM', 'LION', 'CLIP_NORM', 'STREAM_BYTES', 'PACKAGES', 'needs', 'missing', 'installed',
           'available_backends', 'backend_kw', 'one_group_each', 'adam_contenders', 'fastai_adam', 'lion_contenders',
           'train_contenders', 'stream_contenders', 'clip_contenders', 'unclipped_contenders', 'train_step', 'Entry',
           'catalogue', 'catalogue_contenders', 'entry_missing', 'select', 'TORCHAO_LOWBIT', 'cbopt_lowbit', 'torchao_lowbit',
           'lowbit_contenders', 'compile_step_contenders']

BACKENDS = ('fused', 'foreach', 'loop', 'auto')  # auto (the default) picks one of the others per bucket
ADAM = dict(lr=1e-3, mom=0.9, sqr_mom=0.99, eps=1e-5, wd=0.01)
LION = dict(lr=1e-4, mom=0.9, sqr_mom=0.99, wd=0.1)


# -- references from packages that may not be installed -----------------------------------------------------------
# the packages the references need beyond torch and cbopt: module -> the name pip installs it by
PACKAGES = {'fastai': 'fastai', 'lion_pytorch': 'lion-pytorch', 'pytorch_optimizer': 'pytorch_optimizer',
            'optimi': 'torch-optimi', 'schedulefree': 'schedulefree', 'torchao': 'torchao'}


def needs(module: str, factory: Callable) -> Callable:
    """Mark `factory` as building a reference from `module` (imported when the factory is called), so that a run where
    `module` is not installed skips its rows with a note instead of failing: the references are optional packages."""
    factory.needs = module
    return factory


def missing(factory: Callable) -> str | None:
    "Why `factory` cannot be built here (the package it `needs` is not installed), or None when it can."
    module = getattr(factory, 'needs', None)
    if module is None or importlib.util.find_spec(module) is not None: return None
    return f"{PACKAGES.get(module, module)} is not installed"


def installed(contenders: dict[str, Callable]) -> tuple[dict[str, Callable], dict[str, str]]:
    "`contenders` whose packages are installed, and a note for each of the others (`{name: why}`): those are skipped."
    notes = {name: why for name, f in contenders.items() if (why := missing(f))}
    return {name: f for name, f in contenders.items() if name not in notes}, notes


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


def backend_kw(b: str) -> dict:
    "The keywords that select backend `b` (none for a cbopt that has only the loop)."
    return {} if available_backends() == ('loop',) and b == 'loop' else {'backend': b}


def _bare(ps: Named) -> list: return [p for _, p in ps]


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
            'fastai': needs('fastai', lambda ps: fastai_adam(ps, grouped))}


def fastai_adam(ps: Named, grouped: bool = False) -> Callable[[], None]:
    "fastai's Adam with the same hypers (one group, or `grouped`, one per param): its step."
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
    from .. import demo
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
    "`dst.copy_(src)` and `dst.add_(src)` on fp32 tensors of `n` elements: the machine's (or the GPU's) streaming bandwidth."
    src, dst = torch.randn(n, device=PLACEMENT['device']), torch.zeros(n, device=PLACEMENT['device'])
    return {'copy_': lambda: dst.copy_(src), 'add_': lambda: dst.add_(src)}


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


# -- InBackward: the step of case 8 ------------------------------------------------------------------------------------
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


# -- the catalogue (case 10) ------------------------------------------------------------------------------------------
# For every optimizer of the catalogue, on the GPT-2 set at `--size` times its width: cbopt's fused and foreach steps
# against the fastest mode of the implementation its users run today (torch.optim's fused and foreach, lion-pytorch,
# pytorch-optimizer, torch-optimi, schedulefree, fastai), and each step against the memory-traffic floor: the bytes it
# must move (param read and write, grad read, each state buffer read and written) at the bandwidth of an in-place
# `add_` timed in the same rounds. Every row is first checked against the reference on a tiny GPT-2 (3 steps).
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
              {'lion-pytorch': needs('lion_pytorch', lambda ps: _lion_pytorch(ps, lr=1e-4, weight_decay=0.1))}),
        Entry('Adan', lambda ps: cbopt.Adan(ps, wd=0.02),
              {'pytorch-optimizer foreach': needs('pytorch_optimizer', lambda ps: _pytorch_optimizer('Adan', ps, weight_decay=0.02))}),
        Entry('AdEMAMix', lambda ps: cbopt.AdEMAMix(ps),
              {'pytorch-optimizer foreach': needs('pytorch_optimizer', lambda ps: _pytorch_optimizer('AdEMAMix', ps))}),
        Entry('StableAdamW', lambda ps: cbopt.StableAdamW(ps, lr=1e-3),
              {'optimi foreach': needs('optimi', lambda ps: _optimi(ps, lr=1e-3))}),
        Entry('ScheduleFreeSGD', lambda ps: cbopt.ScheduleFreeSGD(ps).train(),
              {'schedulefree foreach': needs('schedulefree', lambda ps: _schedulefree('SGDScheduleFree', ps))}),
        Entry('ScheduleFreeAdamW', lambda ps: cbopt.ScheduleFreeAdamW(ps).train(),
              {'schedulefree foreach': needs('schedulefree', lambda ps: _schedulefree('AdamWScheduleFree', ps))}),
        Entry('Lamb', lambda ps: cbopt.Lamb(ps, lr=1e-3, wd=0.01),
              {'fastai': needs('fastai', lambda ps: _fastai_lamb(ps, lr=1e-3, wd=0.01))}),
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


def select(entry: Entry, ps: Named) -> Named:
    "The params of `ps` that `entry` steps."
    return [(n, p) for n, p in ps if entry.select is None or entry.select(n, tuple(p.shape))]


def entry_missing(entry: Entry) -> str | None:
    "Why `entry`'s reference cannot be built here (its package is not installed), or None: the entry is then skipped."
    return next((why for f in entry.refs.values() if (why := missing(f))), None)


# -- low-bit state (`--only lowbit`): cbopt's Adam per `state_precision`, torchao's low-bit AdamW ----------------------
TORCHAO_LOWBIT = {'8bit': 'AdamW8bit', '4bit': 'AdamW4bit', 'fp8': 'AdamWFp8'}  # cbopt's format -> torchao's class


def cbopt_lowbit(precision: str, backend: cbopt.Backend | str = 'fused') -> Callable[[Named], cbopt.Optimizer]:
    "cbopt's Adam (decoupled weight decay, as AdamW's) with `state_precision=precision`: a builder of the optimizer."
    return lambda ps: cbopt.Adam(_bare(ps), **ADAM, backend=backend, state_precision=precision)


def torchao_lowbit(fmt: str) -> Callable[[Named], Any]:
    "torchao's low-bit AdamW for `fmt` ('8bit', '4bit', 'fp8') with `ADAM`'s numbers: a builder of the optimizer."
    def make(ps):
        import warnings
        with warnings.catch_warnings():  # (lazily, and quietly: torchao warns about its CUDA extensions on a CPU)
            warnings.simplefilter('ignore')
            import torchao.optim
        return getattr(torchao.optim, TORCHAO_LOWBIT[fmt])(_bare(ps), lr=ADAM['lr'], betas=(ADAM['mom'], ADAM['sqr_mom']),
                                                          eps=ADAM['eps'], weight_decay=ADAM['wd'])
    return needs('torchao', make)


def lowbit_contenders(compiler: str = 'inductor') -> dict[str, Callable[[Named], Any]]:
    """The timed rows of the low-bit part: cbopt's 8-bit and fp32 Adam on the fused backend (compiled with `compiler`),
    and torchao's AdamW8bit (which compiles its step per param shape)."""
    fused = cbopt.Backend('fused', compiler=compiler)
    return {'cbopt 8bit fused': cbopt_lowbit('8bit', fused), 'cbopt fp32 fused': cbopt_lowbit('fp32', fused),
            'torchao AdamW8bit': torchao_lowbit('8bit')}


# -- torch.compile(opt.step): the pairs of case 14 ---------------------------------------------------------------------
def compile_step_contenders(compiler: str) -> dict[str, tuple[dict[str, Callable], str, str]]:
    """Case 14's pairs, each step compiled by torch's compiled-optimizer recipe, `torch.compile(opt.step)` with
    `compiler` (cbopt's step traced whole, `cbopt.engine.traced`): pair -> ({row: factory from named params to the
    compiled step}, cbopt's row, the reference's row). cbopt's Adam against torch's AdamW in its foreach mode (the one
    torch's compiled optimizers trace), cbopt's Lion against lion-pytorch's; the same hypers on both sides."""
    kw = dict(lr=ADAM['lr'], betas=(ADAM['mom'], ADAM['sqr_mom']), eps=ADAM['eps'], weight_decay=ADAM['wd'])
    step = lambda opt: torch.compile(opt.step, backend=compiler)
    adam = {'cbopt Adam': lambda ps: step(cbopt.Adam(ps, **ADAM)),
            'torch AdamW foreach': lambda ps: step(torch.optim.AdamW(_bare(ps), **kw, foreach=True))}
    lion = {'cbopt Lion': lambda ps: step(cbopt.Lion(ps, **LION)),
            'lion-pytorch': needs('lion_pytorch', lambda ps: step(_lion_pytorch(
                ps, lr=LION['lr'], betas=(LION['mom'], LION['sqr_mom']), weight_decay=LION['wd'])))}
    return {'adam': (adam, 'cbopt Adam', 'torch AdamW foreach'), 'lion': (lion, 'cbopt Lion', 'lion-pytorch')}
