"""`python -m cbopt bench`'s command: its arguments, the parts asked for run in order (`cases`), then the report.

A part is a function of `cases` that returns its results, a branch of `run` that calls it, and its table in
`report`; a contender is an entry of a table in `contenders`."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from . import cases as _cases
from .cases import (CUDA_PARTS, PARTS, TRAIN_ROWS, catalogue_case, compile_case, compile_step_case, cuda_peak_memory,
                    in_backward_case, lowbit_case, peak_memory, run_case, train_case)
from .contenders import (STREAM_BYTES, adam_contenders, available_backends, catalogue, clip_contenders, installed,
                         lion_contenders, stream_contenders, unclipped_contenders)
from .harness import Progress, empty_inductor_cache
from .memory import state_memory
from .params import gpt2_at, param_sets, placed
from .report import machine, write

__all__ = ['main', 'run', 'BF16_TOL']

BF16_TOL = 2e-3  # bf16 rows: a few ulps of bf16 at the params' scale (about 0.1): each side rounds its own way


def main(argv: list[str] | None = None) -> dict:
    "Run the benchmark; print the tables, write bench.json and bench.png to `--out`; return the results."
    parser = argparse.ArgumentParser(prog='python -m cbopt bench', description=_cases.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--out', default='bench_results', help='directory for bench.json and bench.png')
    parser.add_argument('--steps', type=int, default=None, help='timed interleaved rounds (default 10; 3 with --quick)')
    parser.add_argument('--warmup', type=int, default=2, help='untimed steps before the rounds, the first included')
    parser.add_argument('--quick', action='store_true', help='tiny sizes: a smoke run of a few seconds')
    parser.add_argument('--threads', type=int, default=None, help="torch's CPU threads (default: torch's own choice)")
    parser.add_argument('--device', default='cpu', choices=('cpu', 'cuda'), help="where the params live: cuda runs "
                        f"the parts {','.join(CUDA_PARTS[:4])} (and {CUDA_PARTS[4]} when asked) on the GPU, adam and "
                        "lion in fp32 and bf16, timed with CUDA events")
    parser.add_argument('--only', default=None, help=f"comma-separated parts to run, of {','.join(PARTS)} "
                        "(adam: cases 1, 2, 4, 5; groups: 12; lion: 3; train: 6; clip: 7; in_backward: 8; memory: 9; catalogue: 10; compile: 11; "
                        "lowbit: 13; compile_step: 14)")
    parser.add_argument('--size', type=float, default=1.0, help="catalogue, compile and lowbit: the GPT-2 set's width and "
                        "vocabulary as a fraction of GPT-2 small's (0.5: a quarter of its 124M params)")
    parser.add_argument('--optimizers', default=None, help='catalogue: comma-separated names of the optimizers to run '
                        '(default: all)')
    args = parser.parse_args(argv)
    parts = CUDA_PARTS[:4] if args.device == 'cuda' else PARTS  # (the catalogue on a GPU when asked)
    args.only = [p.strip() for p in (args.only or ','.join(parts)).split(',') if p.strip()]
    if unknown := [p for p in args.only if p not in PARTS]: parser.error(f"unknown part(s) {unknown}: expected {PARTS}")
    if args.device == 'cuda':
        if off := [p for p in args.only if p not in CUDA_PARTS]:
            parser.error(f"part(s) {off} run on the CPU only: --device cuda runs {','.join(CUDA_PARTS)}")
        if not torch.cuda.is_available():
            parser.error("--device cuda: this torch sees no CUDA device (torch.cuda.is_available() is False)")
    if args.optimizers:
        args.optimizers = [n.strip() for n in args.optimizers.split(',') if n.strip()]
        if unknown := sorted(set(args.optimizers) - {e.name for e in catalogue()}):
            parser.error(f"unknown optimizer(s) {unknown} for --optimizers: expected names of the catalogue")
    if args.threads: torch.set_num_threads(args.threads)
    if args.quick: return run(args)
    with empty_inductor_cache('cbopt_bench_inductor_'): return run(args)  # compile times as a first run pays them


def run(args: argparse.Namespace) -> dict:
    """The cases, peak memory, report, JSON and plot (full runs compile with an empty cache, quick ones with the usual),
    with the params on `args.device` (default the CPU)."""
    device = getattr(args, 'device', 'cpu')
    with placed(device): return _run(args, device)


def _run(args: argparse.Namespace, device: str) -> dict:
    rounds = args.steps or (3 if args.quick else 10)
    warmup = max(args.warmup, 1)
    torch.manual_seed(0)
    sets, backends = param_sets(args.quick), list(available_backends())
    (adam, skipped), lion = installed(adam_contenders(backends)), lion_contenders(backends)
    todo = set(args.only)
    if not {'adam', 'groups'} & todo: skipped = {}  # the notes of the rows this run would have timed only
    stream_n = 1 << (20 if args.quick else 26)  # 4 MiB or 256 MiB per tensor: far beyond the caches in the full run
    per = warmup + rounds
    clip, unclipped = clip_contenders(), unclipped_contenders()
    progress = Progress(per * (('adam' in todo) * (2 * len(adam) + len(STREAM_BYTES)) + ('groups' in todo) * len(adam)
                               + ('lion' in todo) * len(lion)
                               + ('clip' in todo) * (len(clip) + len(unclipped)) + ('in_backward' in todo) * 4
                               + ('compile_step' in todo) * 4)
                        + ('adam' in todo) * len(adam) + ('in_backward' in todo) * 4
                        + ('train' in todo) * TRAIN_ROWS * (warmup + 5 * rounds)
                        + (device == 'cuda') * per * (('adam' in todo) * len(adam) + ('lion' in todo) * len(lion))
                        + ('lowbit' in todo) * (5 + 3 * (max(warmup, 2) + rounds)))
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
        cases['groups'] = run_case(installed(adam_contenders(backends, grouped=True))[0], sets['grid'], rounds,
                                   warmup, progress)
    if 'adam' in todo and device == 'cuda':  # bf16 params: torch's CUDA kernels and cbopt's take them
        progress.set('Adam, GPT-2 small, bf16')
        with placed(device, torch.bfloat16):
            cases['gpt2_bf16'] = run_case(adam, sets['gpt2'], rounds, warmup, progress, tol=BF16_TOL)
    if 'lion' in todo:
        progress.set('Lion, GPT-2 small')
        cases['lion'] = run_case(lion, sets['lion'], rounds, warmup, progress, ref='cbopt loop', tol=1e-5)
        if device == 'cuda':
            progress.set('Lion, GPT-2 small, bf16')
            with placed(device, torch.bfloat16):
                cases['lion_bf16'] = run_case(lion, sets['lion'], rounds, warmup, progress, ref='cbopt loop', tol=BF16_TOL)
    if 'train' in todo:
        progress.set("train step, demo's MLP")
        cases['train'] = train_case(args.quick, rounds, warmup, progress)
    if 'clip' in todo:
        progress.set('Adam + clipping, GPT-2 small')
        parts['clip'] = run_case(clip, sets['gpt2'], rounds, warmup, progress, ref='torch fused + clip_grad_norm_',
                                 unchecked=unclipped)
    if 'adam' in todo:
        progress.set('peak memory')
        mem = (cuda_peak_memory if device == 'cuda' else peak_memory)(list(adam), args.quick, backends, progress)
    if 'in_backward' in todo:
        progress.set('InBackward')
        parts['in_backward'] = in_backward_case(args.quick, rounds, warmup, progress)
    if 'memory' in todo:
        progress.set('state per rank: DDP, ZeRO, FSDP2')
        parts['memory'] = state_memory(sets['gpt2'])
    if 'catalogue' in todo:
        shapes = gpt2_at(args.size, args.quick)
        parts['catalogue'] = dict(size=args.size, numel=sum(math.prod(s) for _, s in shapes), tensors=len(shapes),
                                  cases=catalogue_case(shapes, rounds, warmup, args.quick, args.optimizers, progress,
                                                       skipped))
    if 'compile' in todo:
        progress.set('first compile, fresh processes')
        parts['compile'] = dict(size=args.size, cases=compile_case(args.size, args.quick))
    if 'lowbit' in todo:
        progress.set('low-bit state')
        shapes = sets['gpt2'] if args.quick else gpt2_at(args.size)  # (quick: the set whose tensors reach 4096 elements)
        parts['lowbit'] = dict(size=args.size, **lowbit_case(shapes, rounds, warmup, args.quick, progress, skipped))
    if 'compile_step' in todo:
        progress.set('torch.compile(opt.step)')
        parts['compile_step'] = compile_step_case(sets['gpt2'], rounds, warmup, progress)
    progress.close()
    results = dict(machine=machine(device), device=device, quick=args.quick, cold_compile_cache=not args.quick, rounds=rounds, warmup=warmup,
                   backends=backends, bandwidth_GBps=bandwidth, streams={'numel': stream_n, **streams},
                   peak_mem_pct=mem, cases=cases, **parts, **({'skipped': skipped} if skipped else {}))
    write(results, Path(args.out))
    return results
