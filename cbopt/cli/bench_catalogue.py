"""Two parts of `python -m cbopt bench`: the whole catalogue against its references (`--only catalogue`), and a user
chain's first compile with an empty inductor cache in a fresh process (`--only compile`).

catalogue: for every optimizer of the catalogue, on one set of GPT-2-shaped params (`--size` scales its width), cbopt's
`fused` and `foreach` steps against the fastest mode of the implementation its users run today (torch.optim's fused
and foreach, lion-pytorch, pytorch-optimizer, torch-optimi, schedulefree, fastai), timed interleaved in one process as
the other parts are, and each step's time against the memory-traffic floor: the bytes a step must move (param read and
write, grad read, each state buffer read and written) over the bandwidth of an in-place `add_` timed in the same
rounds. Before timing, every row is checked against the reference on a tiny GPT-2 (3 steps from one start).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import cbopt

__all__ = ['Entry', 'catalogue', 'gpt2_at', 'catalogue_case', 'catalogue_report', 'cold_compile', 'compile_case', 'compile_report']

Named = list  # [(name, param)]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One optimizer of the catalogue: `ours(params)` builds cbopt's (its backend is set afterwards), `refs` maps each
    mode of the reference to a builder of it, both from named params with the same hypers; `select(name, shape)` picks
    the params it steps (Muon: the hidden matrices); `compiles`: whether cbopt's fused backend compiles its chain."""
    name: str
    ours: Callable[[Named], cbopt.Optimizer]
    refs: dict[str, Callable[[Named], Any]]
    select: Callable[[str, tuple], bool] | None = None
    compiles: bool = True


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
    return getattr(schedulefree, name)(_bare(ps), foreach=True, **kw).train()  # both start in eval mode


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
        Entry('Muon', lambda ps: cbopt.Muon(_bare(ps)), {'torch': muon}, select=_hidden_matrix),
        Entry('Lion', lambda ps: cbopt.Lion(ps, lr=1e-4, wd=0.1),
              {'lion-pytorch': lambda ps: _lion_pytorch(ps, lr=1e-4, weight_decay=0.1)}),
        Entry('Adan', lambda ps: cbopt.Adan(ps, wd=0.02),
              {'pytorch-optimizer foreach': lambda ps: _pytorch_optimizer('Adan', ps, weight_decay=0.02)}),
        Entry('AdEMAMix', lambda ps: cbopt.AdEMAMix(ps),
              {'pytorch-optimizer foreach': lambda ps: _pytorch_optimizer('AdEMAMix', ps)}),
        Entry('StableAdamW', lambda ps: cbopt.StableAdamW(ps), {'optimi foreach': _optimi}),
        Entry('ScheduleFreeSGD', lambda ps: cbopt.ScheduleFreeSGD(ps).train(),
              {'schedulefree foreach': lambda ps: _schedulefree('SGDScheduleFree', ps)}, compiles=False),
        Entry('ScheduleFreeAdamW', lambda ps: cbopt.ScheduleFreeAdamW(ps).train(),
              {'schedulefree foreach': lambda ps: _schedulefree('AdamWScheduleFree', ps)}, compiles=False),
        Entry('Lamb', lambda ps: cbopt.Lamb(ps, wd=0.01), {'fastai': lambda ps: _fastai_lamb(ps, wd=0.01)}),
    ]


def _ours(entry: Entry, backend: cbopt.Backend) -> Callable[[Named], cbopt.Optimizer]:
    def make(ps):
        opt = entry.ours(ps)
        opt.backend = backend
        return opt
    return make


def contenders(entry: Entry, compiler: str) -> dict[str, Callable[[Named], Any]]:
    "cbopt's fused (when its chain compiles) and foreach rows, then the reference's modes: name -> builder."
    rows = {}
    if entry.compiles: rows['cbopt fused'] = _ours(entry, cbopt.Backend('fused', compiler=compiler))
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
    from .bench import gpt2_shapes
    return gpt2_shapes(vocab=100, ctx=24, d=16, layers=layers)


def numerics(entry: Entry, compiler: str, quick: bool, steps: int = 3) -> dict[str, float]:
    """The largest |param - reference's param| after `steps` steps from one start on `tiny_gpt2`, relative to the
    reference's largest |param|, per row (the first reference mode is the reference)."""
    from .bench import make_params
    finals = {}
    for name, make in contenders(entry, compiler).items():
        ps = _select(entry, make_params(tiny_gpt2(1 if quick else 12), seed=1))
        step = make(ps).step
        for _ in range(steps): step()
        finals[name] = torch.cat([p.detach().flatten() for _, p in ps])
    ref = finals[next(iter(entry.refs))]
    scale = ref.abs().max().item()
    return {n: (f - ref).abs().max().item() / scale for n, f in finals.items()}


def catalogue_case(shapes: list, rounds: int, warmup: int, quick: bool, only: list[str] | None = None,
                   progress=None) -> dict:
    """Each optimizer of the catalogue on `shapes`: its rows and the reference's, timed interleaved with an in-place
    `add_` on two tensors of 2**24 floats (the bandwidth of that round), one optimizer at a time (its state freed
    before the next). Quick runs compile with dynamo alone (the `eager` backend: no codegen)."""
    from .bench import make_params, measure, stream_contenders
    compiler = 'eager' if quick else 'inductor'
    stream_n = 1 << (18 if quick else 24)
    out = {}
    for entry in catalogue():
        if only and entry.name not in only: continue
        if progress: progress.set(f'catalogue: {entry.name}')
        ps = _select(entry, make_params(shapes))
        opts = {name: make(ps) for name, make in contenders(entry, compiler).items()}
        steps = {**{n: o.step for n, o in opts.items()}, 'add_': stream_contenders(stream_n)['add_']}
        res = measure(steps, rounds, max(warmup, 2), progress)  # the fused backend compiles on its second step
        grads = sum(p.grad.numel() * p.grad.element_size() for _, p in ps)
        params = sum(p.numel() * p.element_size() for _, p in ps)
        floor = 2 * params + grads + 2 * state_bytes(opts['cbopt foreach'])
        nparams = sum(p.numel() for _, p in ps)
        del opts, steps, ps
        gc.collect()
        out[entry.name] = dict(results=res, refs=list(entry.refs), floor_bytes=floor, bytes_per_param=floor / nparams,
                               numel=nparams, stream_numel=stream_n, numerics=numerics(entry, compiler, quick),
                               compiler=compiler)
    return out


def fastest_ref(case: dict) -> str | None:
    "The reference mode with the lowest median step time."
    ok = [r for r in case['refs'] if 'median_s' in case['results'].get(r, {})]
    return min(ok, key=lambda r: case['results'][r]['median_s']) if ok else None


def times_floor(case: dict, row: str) -> float | None:
    """Median over rounds of the row's time over the floor's in that round: `floor_bytes` at the bandwidth of that
    round's `add_` (12 bytes per element: two reads and a write)."""
    from .bench import paired
    ratio = paired(case['results'], row, 'add_')
    return None if ratio is None else ratio * 12 * case['stream_numel'] / case['floor_bytes']


def catalogue_rows(cases: dict) -> tuple[list[str], list[list[str]]]:
    "One row per optimizer: its reference's fastest mode, the step times, the ratios, the floor, the numerics gap."
    from .bench import fmt, paired
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
    from .bench import table
    bad = {n: {k: v for k, v in c['numerics'].items() if v > NUMERICS_TOL} for n, c in cases.items()}
    bad = {n: v for n, v in bad.items() if v}
    note = f"\n\nNUMERICS DIFFER (max |diff| / max |param| after 3 steps): {bad}" if bad else ''
    return (f"**The catalogue on the GPT-2 set** ({tensors:,} tensors, {numel:,} params; Muon: its hidden matrices)"
            f"\n\n{table(*catalogue_rows(cases))}{note}")


NUMERICS_TOL = 1e-5  # relative to the reference's largest param, after 3 steps


def gpt2_at(width: float = 1., quick: bool = False) -> list:
    """The GPT-2 set at `width` times GPT-2 small's width and vocabulary (148 tensors at any width, so the same
    buckets and graphs; about width**2 of its 124.4M params); quick runs take a 1-layer `tiny_gpt2` (16 tensors)."""
    from .bench import gpt2_shapes
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
    from .bench import make_params
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
        code = (f'import json, torch, cbopt.cli.bench_catalogue as c; torch.set_num_threads({torch.get_num_threads()}); '
                f'print(json.dumps(c.cold_compile({width!r}, {quick!r})))')
        for key in ('cold', 'warm cache'):
            run = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env)
            res[key] = (json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0
                        else {'error': run.stderr.strip().splitlines()[-1] if run.stderr.strip() else 'failed'})
    return res


def compile_report(case: dict) -> str:
    from .bench import fmt, table
    header = ['inductor cache', 'tensors', 'first step s (eager)', 'second step s (compiles)', 'its CPU s',
              'third step s', 'graphs', 'FX graph cache misses', 'hits']
    rows = []
    for key, r in case.items():
        if 'error' in r: rows.append([key, r['error'][:60]] + [''] * (len(header) - 2))
        else: rows.append([key, r['tensors'], fmt(r['first_s']), fmt(r['compile_step_s']), fmt(r['compile_step_cpu_s']),
                           fmt(r['third_s']), r['graphs'],
                           r['fxgraph_cache_miss'], r['fxgraph_cache_hit']])
    return f"**Lion's first compile, fresh process** (`cbopt.Lion(..., backend='fused')`)\n\n{table(header, rows)}"
