"""`python -m cbopt bench`: time cbopt's backends against torch.optim and fastai, on CPU in fp32 (or, with
`--device cuda`, on a GPU in fp32 and bf16: cases 1-5 and 7, timed with CUDA events, peak memory from torch's
allocator).

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
   (`cbopt/cli/bench/memory.py`; bytes, not timed).
10. The catalogue: every optimizer's fused and foreach steps against its reference's fastest mode, and against the
    memory-traffic floor, on the GPT-2 set at `--size` times its width.
11. Lion's first compile in a fresh process with an empty inductor cache, then with that cache filled.
12. The grid of case 2 with each tensor its own param group (per-layer lrs, as discriminative training sets them):
    the cost per group, the same contenders.
13. Low-bit state (`state_precision=`) on the GPT-2 set at `--size`: the state bytes per param of cbopt's Adam in
    fp32, bf16, 8bit, 4bit and fp8 next to torchao's AdamW8bit/AdamW4bit/AdamWFp8 on the same params; the step time
    of cbopt's 8-bit fused Adam over its fp32 fused Adam and over torchao's AdamW8bit, and the first steps (state
    creation and compilation) over torchao's, as ratios in one process.
14. `torch.compile(opt.step)` on the GPT-2 set: cbopt's Adam against torch's compiled foreach AdamW, cbopt's Lion
    against lion-pytorch's compiled step; the step time (interleaved, in one process) and the first calls' (the
    compile's, in fresh processes), as ratios.
"""
from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import cbopt
from .contenders import (TORCHAO_LOWBIT, Entry, adam_contenders, catalogue, catalogue_contenders, cbopt_lowbit,
                         compile_step_contenders, entry_missing, installed, lowbit_contenders, missing, select,
                         stream_contenders, torchao_lowbit, train_contenders, train_step)
from .harness import (Progress, cpu_s, cuda_peak_bytes, empty_inductor_cache, measure, numerics_gap, paired,
                      pin_mmap_threshold, state_bytes, status_kb, timed)
from .params import PLACEMENT, Shapes, gpt2_at, make_params, numel, param_sets, tiny_gpt2

__all__ = ['PARTS', 'CUDA_PARTS', 'run_case', 'TRAIN_ROWS', 'train_case', 'train_step_peak', 'in_backward_case',
           'step_peak_memory', 'cuda_peak_memory', 'peak_memory', 'catalogue_numerics', 'catalogue_case', 'cold_compile', 'compile_case',
           'tensor_bytes', 'lowbit_case', 'COMPILE_STEP_COMPILER', 'compile_step_case']

# the parts `--only` picks, in the order they run (adam: cases 1, 2, 4, 5; groups: 12; lion: 3; train: 6; clip: 7;
# in_backward: 8; memory: 9; catalogue: 10; compile: 11; lowbit: 13; compile_step: 14)
PARTS = ('adam', 'groups', 'lion', 'train', 'clip', 'in_backward', 'memory', 'catalogue', 'compile', 'lowbit',
         'compile_step')
# the parts `--device cuda` can run (the same contenders, params on the GPU; the catalogue when asked: its references,
# lion-pytorch, torch-optimi..., are timed against cbopt's rows there too): the others time CPU-only setups (the demo's
# MLP, subprocesses' RSS, gloo ranks, a fresh process's CPU compile); the first four are its default
CUDA_PARTS = ('adam', 'groups', 'lion', 'clip', 'catalogue')


# -- a case of contenders on one param set (cases 1, 2, 3, 7, 12), and the train step (case 6) -----------------------
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
    return {'numel': sum(math.prod(s) for _, s in shapes), 'tensors': len(shapes), 'results': res,
            'numerics_gap': gap, 'tolerance': tol, 'device': PLACEMENT['device'].type,
            'dtype': str(PLACEMENT['dtype']).removeprefix('torch.')}


TRAIN_ROWS = 6


def train_case(quick: bool, rounds: int, warmup: int, progress: Progress) -> dict:
    """The train step rows (`train_contenders`): 5x the rounds, as a step takes about a millisecond. A quick run
    compiles with aot_eager (dynamo's graph without inductor's C++ codegen, which takes a minute on a busy CPU)."""
    compiler = 'aot_eager' if quick else 'inductor'
    steps, gap = train_contenders(compiler)
    res = measure(steps, 5 * rounds, warmup, progress)
    from .. import demo
    model = demo.make_model()
    return {'numel': sum(p.numel() for p in model.parameters()), 'tensors': len(list(model.parameters())), 'batch': 64,
            'compiler': compiler, 'rounds': 5 * rounds, 'results': res, 'numerics_gap': gap(), 'tolerance': 1e-6}



# -- InBackward (case 8) ----------------------------------------------------------------------------------------------
def train_step_peak(quick: bool, tied: bool, in_backward: bool) -> dict:
    """The peak memory one training step adds (see `step_peak_memory`), after 2 steps that create the state; and the
    bytes of all grads (what stepping in backward can save at most)."""
    pin_mmap_threshold()
    step = train_step(quick, tied, in_backward)
    step(), step()
    step.zero_grad()  # the last step's grads are freed before the baseline: the measured step allocates its own
    gc.collect()
    Path('/proc/self/clear_refs').write_text('5')
    before = status_kb('VmRSS')
    step()
    return {'peak_bytes': (status_kb('VmHWM') - before) * 1024, 'grad_bytes': step.grad_bytes,
            'largest_grad_bytes': step.largest_grad_bytes}


def in_backward_case(quick: bool, rounds: int, warmup: int, progress: Progress | None = None) -> dict:
    "Case 8: peak memory of each variant in a fresh subprocess (in-process when quick), then both timed interleaved."
    res = {}
    for tied in (True, False):
        row = {}
        for inb in (False, True):
            if quick: row[inb] = train_step_peak(quick, tied, inb)
            else:
                code = (f'import json, torch, cbopt.cli.bench.cases as b; torch.set_num_threads({torch.get_num_threads()}); '
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


# -- the peak memory a step adds (case 4), each optimizer in a fresh subprocess ---------------------------------------
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
        before = status_kb('VmRSS')
        step()
        out[name] = (status_kb('VmHWM') - before) * 1024 / (4 * numel(ps)) * 100
        del ps, step
        gc.collect()
    return out


def cuda_peak_memory(names: list[str], quick: bool, backends: list[str], progress: Progress | None = None) -> dict:
    """On a GPU (`--device cuda`): for each optimizer, the GPT-2 set, 2 steps (the state now exists), then the peak
    bytes one step allocates beyond what was allocated before it (torch's allocator counts: `cuda_peak_bytes`), in %
    of param bytes. In this process: the allocator's counters are per device, and every optimizer is freed before the
    next."""
    out = {}
    for name in names:
        ps = make_params(param_sets(quick)['gpt2'])
        step = adam_contenders(backends)[name](ps)
        try:
            step(), step()
            out[name] = cuda_peak_bytes(step) / sum(p.numel() * p.element_size() for _, p in ps) * 100
        except Exception: out[name] = None  # (its timed row says why)
        del ps, step
        gc.collect()
        torch.cuda.empty_cache()
        if progress: progress.update()
    return out


def peak_memory(names: list[str], quick: bool, backends: list[str], progress: Progress | None = None) -> dict:
    "`step_peak_memory` of each optimizer in a fresh subprocess (all in this process in quick runs, to save time)."
    if quick:
        res = step_peak_memory(names, quick, backends)
        if progress: progress.update(len(names))
        return res
    res = {}
    for name in names:
        code = (f'import json, torch, cbopt.cli.bench.cases as b; torch.set_num_threads({torch.get_num_threads()}); '
                f'print(json.dumps(b.step_peak_memory([{name!r}], False, {backends!r})))')
        run = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
        res[name] = json.loads(run.stdout.strip().splitlines()[-1])[name] if run.returncode == 0 else None
        if progress: progress.update()
    return res


# -- the catalogue (case 10) ------------------------------------------------------------------------------------------
def catalogue_numerics(entry: Entry, compiler: str, quick: bool, steps: int = 3) -> dict[str, float]:
    """The largest |param - reference's param| after `steps` steps from one start on `tiny_gpt2`, relative to the
    reference's largest |param|, per row (the first reference mode is the reference). Every step gets the same grads
    afresh: some references write into `p.grad` (schedulefree divides it in place), which cbopt never does."""
    finals = {}
    for name, make in catalogue_contenders(entry, compiler).items():
        ps = select(entry, make_params(tiny_gpt2(1 if quick else 12), seed=1))
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
                   progress: Progress | None = None, skipped: dict[str, str] | None = None) -> dict:
    """Each optimizer of the catalogue on `shapes`: its rows and the reference's, timed interleaved with an in-place
    `add_` on two tensors of 2**24 floats (the bandwidth of that round), one optimizer at a time (its state freed
    before the next). Quick runs compile with dynamo alone (the `eager` backend: no codegen). An optimizer whose
    reference's package is not installed is skipped, with a note in `skipped` (nothing to check its rows against)."""
    compiler = 'eager' if quick else 'inductor'
    stream_n = 1 << (18 if quick else 24)
    out = {}
    for entry in catalogue():
        if only and entry.name not in only: continue
        if why := entry_missing(entry):
            if skipped is not None: skipped[f'catalogue {entry.name}'] = why
            continue
        if progress: progress.set(f'catalogue: {entry.name}')
        ps = select(entry, make_params(shapes))
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


# -- the cold first compile (case 11, `--only compile`) ---------------------------------------------------------------
def cold_compile(width: float, quick: bool) -> dict:
    """In this (fresh) process: Lion's fused steps on the GPT-2 set at `width`; the first runs eagerly (it creates the
    state), the second compiles. Returns their wall and CPU times and what dynamo and inductor counted."""
    from ..._torch import dynamo_counters
    counters = dynamo_counters()
    ps = make_params(gpt2_at(width, quick))
    opt = cbopt.Lion(ps, lr=1e-4, wd=0.1, backend='fused')
    wall, cpu = [], []
    for _ in range(3):
        t, c = time.perf_counter(), cpu_s()
        opt.step()
        wall.append(time.perf_counter() - t)
        cpu.append(cpu_s() - c)
    return dict(first_s=wall[0], compile_step_s=wall[1], compile_step_cpu_s=cpu[1], third_s=wall[2], tensors=len(ps),
                graphs=counters['stats'].get('unique_graphs', 0),
                fxgraph_cache_miss=counters['inductor'].get('fxgraph_cache_miss', 0),
                fxgraph_cache_hit=counters['inductor'].get('fxgraph_cache_hit', 0))


def compile_case(width: float, quick: bool) -> dict:
    """`cold_compile` in a fresh subprocess with an empty inductor cache (a new `TORCHINDUCTOR_CACHE_DIR`), then again
    in another fresh process with that cache now filled (what a second run of the same script pays). Inductor compiles
    in the process itself (`TORCHINDUCTOR_COMPILE_THREADS=1`), so that its CPU time is counted."""
    with tempfile.TemporaryDirectory(prefix='cbopt_bench_cold_') as cache:
        return {key: _in_fresh_process(f'c.cold_compile({width!r}, {quick!r})', cache) for key in ('cold', 'warm cache')}


def _in_fresh_process(call: str, cache: str) -> dict:
    """`call` (an expression of this module as `c`, giving a dict) run in a fresh Python process with this one's torch
    threads, `cache` as its inductor cache and inductor compiling in the process itself
    (`TORCHINDUCTOR_COMPILE_THREADS=1`, so that its CPU time is counted): its answer, or `{'error': ...}` with the last
    line the process wrote to stderr."""
    env = {**os.environ, 'TORCHINDUCTOR_CACHE_DIR': cache, 'TORCHINDUCTOR_COMPILE_THREADS': '1'}
    code = (f'import json, torch, cbopt.cli.bench.cases as c; torch.set_num_threads({torch.get_num_threads()}); '
            f'print(json.dumps({call}))')
    run = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env)
    if run.returncode == 0: return json.loads(run.stdout.strip().splitlines()[-1])
    return {'error': run.stderr.strip().splitlines()[-1] if run.stderr.strip() else 'failed'}


# -- low-bit state (case 13, `--only lowbit`) -------------------------------------------------------------------------
def tensor_bytes(opt) -> int:
    """The bytes of `opt`'s per-param state tensors of one dimension or more (step counts left out), a tensor subclass
    (torchao's quantized state: codes and scales) counted by the plain tensors it holds."""
    def size(t: torch.Tensor) -> int:
        if type(t) is not torch.Tensor and hasattr(t, '__tensor_flatten__'):
            names, _ = t.__tensor_flatten__()
            return sum(size(getattr(t, n)) for n in names)
        return t.numel() * t.element_size()
    return sum(size(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.ndim > 0)


def lowbit_case(shapes: list, rounds: int, warmup: int, quick: bool, progress: Progress | None = None,
                skipped: dict[str, str] | None = None) -> dict:
    """Case 13. State bytes per param after one step, each optimizer on its own copy of the params: cbopt's Adam per
    `state_precision` and torchao's low-bit AdamWs (stepped eagerly here: the bytes do not depend on it). Then
    `lowbit_contenders` timed interleaved, with at least 2 warm-up steps (cbopt's fused backend compiles on its second,
    torchao on its first): the ratios of median steps and of the warm-up steps' total time (state creation and
    compilation: the first steps). Quick runs compile with aot_eager and run torchao eagerly (no codegen: a smoke run); torchao's rows
    are skipped, with a note in `skipped`, where it is not installed. `numerics`: the largest |param difference| of
    cbopt's 8-bit fused Adam from torchao's AdamW8bit after 3 steps from one start, relative to the largest |param|."""
    n = sum(math.prod(s) for _, s in shapes)
    ao_missing = missing(torchao_lowbit('8bit'))
    if ao_missing and skipped is not None: skipped['lowbit torchao'] = ao_missing
    bytes_per_param = {}
    for prec in ('fp32', 'bf16', '8bit', '4bit', 'fp8'):
        rows = {f'cbopt {prec}': cbopt_lowbit(prec, 'foreach')}
        if prec in TORCHAO_LOWBIT and not ao_missing: rows[f'torchao {TORCHAO_LOWBIT[prec]}'] = torchao_lowbit(prec)
        for name, make in rows.items():
            opt = make(make_params(shapes))
            with torch.compiler.set_stance('force_eager'): opt.step()
            bytes_per_param[name] = tensor_bytes(opt) / n
            del opt
            gc.collect()
        if progress: progress.update()
    compiler = 'aot_eager' if quick else 'inductor'
    contenders = lowbit_contenders(compiler)
    if ao_missing: contenders.pop('torchao AdamW8bit')
    ps = make_params(shapes)
    opts = {name: make(ps) for name, make in contenders.items()}
    with torch.compiler.set_stance('force_eager' if quick else 'default'):
        res = measure({name: o.step for name, o in opts.items()}, rounds, max(warmup, 2), progress)
    del opts, ps
    gc.collect()
    ours, fp32, ao = 'cbopt 8bit fused', 'cbopt fp32 fused', 'torchao AdamW8bit'
    first = lambda name: sum(res[name]['warmup_s']) if 'median_s' in res.get(name, {}) else None  # (same count each)
    ratios = dict(step_over_fp32=paired(res, ours, fp32), step_over_torchao=paired(res, ours, ao),
                  first_steps_over_torchao=None if not (first(ours) and first(ao)) else first(ours) / first(ao))
    numerics = None
    if not ao_missing:
        finals = []
        for make in (contenders[ours], contenders[ao]):
            small = make_params(tiny_gpt2(1 if quick else 12), seed=1)
            opt = make(small)
            with torch.compiler.set_stance('force_eager' if quick else 'default'):
                for _ in range(3): opt.step()
            finals.append(torch.cat([p.detach().flatten() for _, p in small]))
        numerics = ((finals[0] - finals[1]).abs().max() / finals[1].abs().max()).item()
    return dict(numel=n, tensors=len(shapes), compiler=compiler, torchao_compiled=not quick,
                bytes_per_param=bytes_per_param, results=res, ratios=ratios, numerics=numerics)


# -- torch.compile(opt.step) (case 14, `--only compile_step`) ---------------------------------------------------------
COMPILE_STEP_COMPILER = 'inductor'  # torch.compile's default, what a user's compiled step gets
NUMERICS_COMPILER = 'aot_eager'  # the numerics check's: inductor's graph, functionalized, without its codegen


def compile_step_case(shapes: list, rounds: int, warmup: int, progress: Progress | None = None,
                      compiler: str | None = None) -> dict:
    """Each pair of `compile_step_contenders` on `shapes` (one shared set of params, each optimizer its own state),
    timed interleaved in this process, after `max(warmup, 3)` calls each on its own (in an empty inductor cache).
    Each side's compile time is measured in fresh processes instead (`first_compile`, `COMPILE_STEP_PROCESSES` each,
    alternating sides; the fastest is kept): in one process the second of two large compiles took up to 20% longer or
    shorter than it did first, by the order alone (the quick GPT-2 set, torch's AdamW and cbopt's Adam compiled in
    either order). Each pair is then checked to compute the same thing, compiled with `NUMERICS_COMPILER`. A pair whose
    reference is not installed is skipped, with its note."""
    compiler = compiler or COMPILE_STEP_COMPILER
    out = {'numel': sum(math.prod(s) for _, s in shapes), 'tensors': len(shapes), 'compiler': compiler, 'pairs': {},
           'compile_processes': COMPILE_STEP_PROCESSES}
    with empty_inductor_cache('cbopt_bench_compile_step_'):
        torch.compile(lambda x: x * 2 + 1, backend=compiler)(torch.ones(4))  # (the compiler's one-time costs)
        for name, (contenders, ours, ref) in compile_step_contenders(compiler).items():
            contenders, skipped = installed(contenders)
            if skipped:
                out['pairs'][name] = {'skipped': skipped}
                continue
            if progress: progress.set(f'torch.compile(opt.step): {name}')
            ps = make_params(shapes)
            steps = {n: f(ps) for n, f in contenders.items()}
            firsts = {n: _first_calls(step, max(warmup, 3)) for n, step in steps.items()}
            if progress: progress.update(len(steps) * max(warmup, 3))
            res = measure(steps, rounds, 1, progress)
            del steps, ps
            gc.collect()
            fresh = _fresh_first_compiles(name, (ours, ref), shapes, max(warmup, 3), compiler)
            for n, r in res.items():
                r.update(firsts[n])
                r.update(fresh[n])
            compile_s = [res[n].get('compile_s') for n in (ours, ref)]
            out['pairs'][name] = dict(
                results=res, ours=ours, ref=ref, step_ratio=paired(res, ours, ref),
                compile_ratio=compile_s[0] / compile_s[1] if None not in compile_s else None,
                numerics_gap=numerics_gap(compile_step_contenders(NUMERICS_COMPILER)[name][0], ref, shapes),
                tolerance=1e-6 if name == 'adam' else 1e-5)
    return out


COMPILE_STEP_PROCESSES = 2  # fresh processes per side, for its compile time (the fastest is kept: noise only adds)


def first_compile(pair: str, name: str, shapes: list, calls: int, compiler: str, device: str, dtype: str) -> dict:
    """Run in a fresh process (`_fresh_first_compiles`): contender `name` of `compile_step_contenders(compiler)[pair]`
    on `shapes`, placed on `device` in `dtype` (the parent's `PLACEMENT`), its first `calls` calls timed after a tiny
    compile that pays the compiler's one-time costs (as in any process), then as many steady calls: its compile time
    is the first calls' wall time beyond the steady ones' median, with the graphs dynamo compiled and the process's CPU
    seconds over the first calls (inductor compiling in the process itself)."""
    PLACEMENT.update(device=torch.device(device), dtype=getattr(torch, dtype))
    torch.compile(lambda x: x * 2 + 1, backend=compiler)(torch.ones(4))
    step = compile_step_contenders(compiler)[pair][0][name](make_params(shapes))
    cpu = time.process_time()
    first = _first_calls(step, calls)
    cpu = time.process_time() - cpu
    steady = sorted(timed(step) for _ in range(calls))[calls // 2]
    return {'compile_s': sum(first['first_calls_s']) - calls * steady, 'compile_cpu_s': cpu, 'graphs': first['graphs']}


def _fresh_first_compiles(pair: str, names: tuple, shapes: list, calls: int, compiler: str) -> dict:
    """`first_compile` of each side of a pair, `COMPILE_STEP_PROCESSES` times, alternating sides, each in a fresh
    process with an empty inductor cache of its own (`_in_fresh_process`) and this process's placement; per side, its
    fastest run (noise only adds time), with all its runs' compile times, or the error of a failed run (as
    `compile_error`: `error` is the step's own, in the results)."""
    device, dtype = str(PLACEMENT['device']), str(PLACEMENT['dtype']).removeprefix('torch.')
    runs: dict = {n: [] for n in names}
    for _ in range(COMPILE_STEP_PROCESSES):
        for n in names:
            with tempfile.TemporaryDirectory(prefix='cbopt_bench_compile_step_') as cache:
                r = _in_fresh_process(f'c.first_compile({pair!r}, {n!r}, {list(shapes)!r}, {calls}, {compiler!r}, '
                                      f'{device!r}, {dtype!r})', cache)
            runs[n].append({'compile_error': r['error']} if 'error' in r else r)
    out = {}
    for n, rs in runs.items():
        ok = sorted((r for r in rs if 'compile_s' in r), key=lambda r: r['compile_s'])
        out[n] = {**ok[0], 'compile_runs_s': [r['compile_s'] for r in ok]} if ok else rs[-1]
    return out


def _first_calls(step: Callable[[], None], n: int) -> dict:
    "The wall times of `step`'s first `n` calls (the compiles among them), and the graphs dynamo compiled meanwhile."
    from ..._torch import dynamo_counters
    stats = dynamo_counters()['stats']
    before = stats.get('unique_graphs', 0)
    return {'first_calls_s': [timed(step) for _ in range(n)], 'graphs': stats.get('unique_graphs', 0) - before}
