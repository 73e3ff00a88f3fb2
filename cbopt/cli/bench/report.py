"""The bench's report: the tables of a run as markdown (one per case), the machine they ran on, bench.json, bench.md
and the bar charts of bench.png (matplotlib, imported only to draw them)."""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

import cbopt
from .contenders import CLIP_NORM
from .harness import paired
from .memory import memory_rows
from .params import TOKENS

__all__ = ['ADAM_BYTES', 'LION_BYTES', 'machine', 'fmt', 'table', 'adam_rows', 'lion_rows', 'train_rows', 'clip_rows',
           'in_backward_rows', 'CASE_TITLES', 'report', 'plot', 'write', 'fastest_ref', 'times_floor',
           'catalogue_rows', 'catalogue_report', 'compile_report', 'LOWBIT_GOALS', 'lowbit_report', 'compile_step_rows',
           'compile_step_report']

# fp32 bytes per element the algorithm must move: param read+write, grad read, and each state buffer read+write
ADAM_BYTES, LION_BYTES = 4 * (2 + 1 + 2 + 2), 4 * (2 + 1 + 2)


# -- the tables -------------------------------------------------------------------------------------------------------
def machine(device: str = 'cpu') -> dict:
    """What the timings ran on: the CPU, its cores, torch's threads, the GPU where `device` is 'cuda' (else None), and
    the versions (fastai's None when not installed)."""
    cpu = next((l.split(':', 1)[1].strip() for l in Path('/proc/cpuinfo').read_text().splitlines()
                if l.startswith('model name')), platform.processor())
    try: import fastai  # lazily, and optional: only the fastai rows need fastai
    except ImportError: fastai = None
    gpu = torch.cuda.get_device_name() if device == 'cuda' else None
    return dict(cpu=cpu, gpu=gpu, cores=os.cpu_count(), torch_threads=torch.get_num_threads(), torch=torch.__version__,
                fastai=fastai and fastai.__version__, cbopt=cbopt.__version__, python=platform.python_version(),
                date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()))


def fmt(v, spec: str = '.2f', suffix: str = '') -> str:
    "A number as `spec` with `suffix`, or '-' for a value that was not measured."
    return '-' if v is None else f'{v:{spec}}{suffix}'


def table(header: list[str], rows: list[list[str]]) -> str:
    "A markdown table (readable as it is in a terminal)."
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: '| ' + ' | '.join(str(c).ljust(w) for c, w in zip(cells, widths)) + ' |'
    return '\n'.join([line(header), '|' + '|'.join('-' * (w + 2) for w in widths) + '|', *map(line, rows)])


def _rows(case: dict, per_param_bytes: int, header: list[str], cells) -> tuple[list[str], list[list[str]]]:
    "One table row per contender: name, step times, then `cells(name, result, GB/s)`; errors as short messages."
    size = {'bfloat16': 2, 'float16': 2, 'float64': 8}.get(case.get('dtype'), 4)  # (the byte counts are fp32's)
    res, nbytes, rows = case['results'], case['numel'] * per_param_bytes * size // 4, []
    for name, r in res.items():
        if 'error' in r:
            rows.append([name, r['error'][:60]] + [''] * (len(header) - 2))
            continue
        rows.append([name, fmt(r['median_s'] * 1e3, '.1f'), fmt(min(r['times']) * 1e3, '.1f'),
                     *cells(name, r, nbytes / r['median_s'] / 1e9)])
    return header, rows


def adam_rows(case: dict, bw: float | None, mem: dict) -> tuple[list[str], list[list[str]]]:
    "Cases 1, 2, 4, 5, 12: each row against torch's three modes and fastai, its bandwidth, peak memory, first step."
    res = case['results']
    header = ['optimizer', 'step ms', 'best ms', '/ torch fused', '/ torch foreach', '/ torch loop', 'fastai speedup',
              'GB/s', '% of bw', 'peak mem % params', 'first step s']
    return _rows(case, ADAM_BYTES, header, lambda name, r, gbs: [
        *[fmt(paired(res, name, ref), '.2f', 'x') for ref in ('torch fused', 'torch foreach', 'torch loop')],
        fmt(paired(res, 'fastai', name), '.2f', 'x'), fmt(gbs, '.1f'), fmt(gbs / bw * 100 if bw else None, '.0f', '%'),
        fmt(mem.get(name), '.1f', '%'), fmt(r['first_s'], '.2f')])


def lion_rows(case: dict, bw: float | None) -> tuple[list[str], list[list[str]]]:
    "Case 3: each backend against the loop, its bandwidth, its first step and its warm-up's extra time."
    res = case['results']
    header = ['optimizer', 'step ms', 'best ms', 'speedup vs loop', 'GB/s', '% of bw', 'first step s', 'warm-up extra s']
    return _rows(case, LION_BYTES, header, lambda name, r, gbs: [
        fmt(paired(res, 'cbopt loop', name), '.2f', 'x'), fmt(gbs, '.1f'),
        fmt(gbs / bw * 100 if bw else None, '.0f', '%'), fmt(r['first_s'], '.2f'), fmt(r['warmup_extra_s'], '.2f')])


def train_rows(case: dict) -> tuple[list[str], list[list[str]]]:
    "Case 6: each train step against the eager one."
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


CASE_TITLES = {'gpt2': 'Adam on the GPT-2 set', 'gpt2_bf16': 'Adam on the GPT-2 set, bf16',
               'lion_bf16': 'Lion (cbopt callbacks only) on the GPT-2 set, bf16', 'grid': 'Adam on the grid of small tensors',
               'groups': 'Adam on the grid, one param group per tensor',
               'lion': 'Lion (cbopt callbacks only) on the GPT-2 set',
               'train': "A train step on the demo's MLP (forward, grad, Adam update)"}


def report(results: dict) -> str:
    "The tables of a run, as markdown."
    m, cases, streams = results['machine'], results['cases'], results['bandwidth_GBps']
    bw = max((v for v in streams.values() if v), default=None)
    where = f"GPU {m['gpu']} (CUDA events; fp32 and bf16)" if m.get('gpu') else 'fp32'
    out = [f"Machine: {m['cpu']}, {m['cores']} cores (torch threads: {m['torch_threads']}), torch {m['torch']}, "
           f"fastai {m['fastai'] or 'not installed'}, Python {m['python']}; {m['date']}. {where}, median of "
           f"{results['rounds']} interleaved steps." + (" Bandwidth (`% of bw` is of the larger): " +
                        ', '.join(f"`{k}` {fmt(v, '.1f')} GB/s" for k, v in streams.items()) + '.' if streams else '')]
    if results.get('skipped'):  # references whose package is not installed (`contenders.installed`)
        out.append('Skipped: ' + '; '.join(f'{name} ({why})' for name, why in results['skipped'].items()) + '.')
    for key, case in cases.items():
        header, rows = (lion_rows(case, bw) if key.startswith('lion') else train_rows(case) if key == 'train' else
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
    if 'compile_step' in results: out.append(compile_step_report(results['compile_step'], results['quick']))
    if 'catalogue' in results or 'compile' in results:
        if 'catalogue' in results:
            c = results['catalogue']
            out.append(catalogue_report(c['cases'], c['numel'], c['tensors']))
        if 'compile' in results: out.append(compile_report(results['compile']['cases']))
    if 'lowbit' in results: out.append(lowbit_report(results['lowbit']))
    return '\n\n'.join(out)


# -- low-bit state (case 13) ------------------------------------------------------------------------------------------
LOWBIT_GOALS = {'8bit': 2.1, '4bit': 1.15, 'fp8': 2.1}  # issue 33's goals, in state bytes per param (and <= torchao's)


def lowbit_report(case: dict) -> str:
    "Case 13: state bytes per param per format next to torchao's, then the step times and their ratios."
    from .contenders import TORCHAO_LOWBIT
    b = case['bytes_per_param']
    rows = []
    for prec in ('fp32', 'bf16', '8bit', '4bit', 'fp8'):
        ao = b.get(f'torchao {TORCHAO_LOWBIT[prec]}') if prec in TORCHAO_LOWBIT else None
        rows.append([prec, fmt(b.get(f'cbopt {prec}'), '.3f'), '-' if prec not in TORCHAO_LOWBIT else
                     f"{TORCHAO_LOWBIT[prec]}: {fmt(ao, '.3f')}", fmt(LOWBIT_GOALS.get(prec), '.2f')])
    mem = table(['state_precision', 'cbopt bytes/param', 'torchao bytes/param', 'goal'], rows)
    res = case['results']
    times = table(['', 'step ms (median)', 'first step s', 'warm-up extra s (state, compile)'],
                  [[name, fmt(1e3 * r['median_s'], '.1f'), fmt(r['first_s']), fmt(r['warmup_extra_s'])]
                   if 'median_s' in r else [name, r.get('error', '-'), '-', '-'] for name, r in res.items()])
    q = case['ratios']
    where = 'torchao compiled' if case['torchao_compiled'] else 'torchao eager (quick run)'
    ratios = (f"8-bit fused step / fp32 fused step: {fmt(q['step_over_fp32'], '.2f', 'x')} (goal <= 1.5x); / torchao "
              f"AdamW8bit's: {fmt(q['step_over_torchao'], '.2f', 'x')} (goal < 1x); first steps (the warm-up's) / "
              f"torchao's: {fmt(q['first_steps_over_torchao'], '.2f', 'x')} (goal <= 0.5x). cbopt compiled with "
              f"{case['compiler']}, {where}; 8-bit params vs torchao's after 3 steps: {fmt(case['numerics'], '.1e')} of "
              "the largest |param|.")
    return (f"**Low-bit state, Adam on the GPT-2 set** ({case['tensors']:,} tensors, {case['numel']:,} params)\n\n"
            f"{mem}\n\n{times}\n\n{ratios}")


# -- the catalogue (case 10) and the cold first compile (case 11) ----------------------------------------------------
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
    "Case 10: the catalogue's table, and a warning naming the rows whose numerics differ from their reference's."
    bad = {n: {k: v for k, v in c['numerics'].items() if v > c['tolerance']} for n, c in cases.items()}
    bad = {n: v for n, v in bad.items() if v}
    note = f"\n\nNUMERICS DIFFER (max |diff| / max |param| after 3 steps): {bad}" if bad else ''
    return (f"**The catalogue on the GPT-2 set** ({tensors:,} tensors, {numel:,} params; Muon: its hidden matrices)"
            f"\n\n{table(*catalogue_rows(cases))}{note}")


def compile_report(case: dict) -> str:
    "Case 11: Lion's first compile with an empty inductor cache, then with it filled."
    header = ['inductor cache', 'tensors', 'first step s (eager)', 'second step s (compiles)', 'its CPU s',
              'third step s', 'graphs', 'FX graph cache misses', 'hits']
    rows = []
    for key, r in case.items():
        if 'error' in r: rows.append([key, r['error'][:60]] + [''] * (len(header) - 2))
        else: rows.append([key, r['tensors'], fmt(r['first_s']), fmt(r['compile_step_s']), fmt(r['compile_step_cpu_s']),
                           fmt(r['third_s']), r['graphs'],
                           r['fxgraph_cache_miss'], r['fxgraph_cache_hit']])
    return f"**Lion's first compile, fresh process** (`cbopt.Lion(..., backend='fused')`)\n\n{table(header, rows)}"


# -- torch.compile(opt.step) (case 14) ------------------------------------------------------------------------------
def compile_step_rows(part: dict) -> tuple[list[str], list[list[str]]]:
    "One row per pair: each side's step time and compile time (with its graphs), and cbopt's over the reference's."
    header = ['cbopt', 'reference', 'cbopt ms', 'reference ms', 'step ratio', 'cbopt compile s (graphs)',
              'reference compile s (graphs)', 'compile ratio']
    rows = []
    for name, pair in part['pairs'].items():
        if 'skipped' in pair:
            rows.append([name, 'skipped: ' + '; '.join(pair['skipped'].values())] + [''] * (len(header) - 2))
            continue
        res, ours, ref = pair['results'], pair['ours'], pair['ref']
        ms = [fmt(res[n].get('median_s') and res[n]['median_s'] * 1e3, '.3f') if 'error' not in res[n]
              else res[n]['error'][:40] for n in (ours, ref)]
        compiles = [f"{fmt(res[n].get('compile_s'), '.1f')} ({res[n].get('graphs', '-')})" for n in (ours, ref)]
        rows.append([ours, ref, *ms, fmt(pair['step_ratio'], '.2f', 'x'), *compiles,
                     fmt(pair['compile_ratio'], '.2f', 'x')])
    return header, rows


def compile_step_report(part: dict, quick: bool) -> str:
    "Case 14's table, with what it timed and the pairs whose numerics differ."
    gaps = {f"{n}: {row}": g for n, pair in part['pairs'].items() for row, g in pair.get('numerics_gap', {}).items()
            if g > pair['tolerance']}
    note = f"\n\nNUMERICS DIFFER (max |diff| after 3 steps): {gaps}" if gaps else ''
    which = 'the quick GPT-2 set' if quick else "GPT-2 small's set"
    return (f"**`torch.compile(opt.step)`** ({which}: {part['tensors']:,} tensors, {part['numel']:,} params; "
            f"`{part['compiler']}`, an empty inductor cache; ratios: cbopt's / the reference's, the step's the median "
            f"of per-round ratios; compile: the first calls' wall time beyond as many steady steps, the fastest of "
            f"{part.get('compile_processes', 1)} fresh processes per side, each with an empty inductor cache, with the "
            f"graphs dynamo compiled)\n\n"
            f"{table(*compile_step_rows(part))}{note}")


# -- the outputs ------------------------------------------------------------------------------------------------------
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
    fig.suptitle(f"cbopt bench{' (quick: tiny sizes)' if results['quick'] else ''}: "
                 f"{'GPU ' + m['gpu'] + ', ' if m.get('gpu') else ''}{m['cpu']}, {m['cores']} cores, "
                 f"torch {m['torch']}, torch threads: {m['torch_threads']}, fp32 (blue: cbopt)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(results: dict, out: Path) -> str:
    """Write bench.json (first: a long run's numbers are kept whatever follows), bench.md and, when the run timed a
    case, bench.png to `out`; print the report and the paths written. Returns the report."""
    out.mkdir(parents=True, exist_ok=True)
    (out / 'bench.json').write_text(json.dumps(results, indent=1))  # before the report: a long run's numbers are kept
    text = report(results)
    print('\n' + text, flush=True)
    (out / 'bench.md').write_text(text + '\n')
    if results['cases']: plot(results, out / 'bench.png')
    print(f"\nwrote {out / 'bench.json'}, {out / 'bench.md'}" + (f", {out / 'bench.png'}" if results['cases'] else ''))
    return text
