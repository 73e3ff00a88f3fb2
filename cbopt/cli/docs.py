"""`python -m cbopt docs`: build the documentation site and serve it locally; `--update` regenerates the pages made from
the code and the bench's JSON (the catalogue's table, the performance page, the README's benchmark table).

The generated parts of a page sit between `<!-- generated: NAME -->` and `<!-- end generated -->` markers, so the
prose around them is written by hand and the numbers never are. `tests/test_docs.py` checks every generated part
against what this module makes now.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / 'docs'
BENCH_FILES = {'bench': 'bench.json', 'memory': 'bench_memory.json', 'whole_model': 'bench_whole_model.json',
               'groups': 'bench_groups.json', 'catalogue': 'bench_catalogue.json', 'compile': 'bench_compile.json',
               'cuda': 'bench_cuda.json', 'compile_step': 'bench_compile_step.json',
               'compile_step_full': 'bench_compile_step_full.json', 'lowbit': 'bench_lowbit.json'}
MARK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", flags=re.S)

# The catalogue: each prebuilt optimizer, what it is checked against, and how it is built. Defaults and state names are
# read from the code by `catalogue_table`.
CATALOGUE = {
    'SGD': ("fastai's `SGD`; torch's `SGD` (`nesterov`, `dampening`)", 'tests/test_torch_catalogue.py'),
    'RMSProp': ("fastai's `RMSProp`", 'tests/test_parity_fastai.py'),
    'Adam': ("fastai's `Adam`; torch's `AdamW` (and `Adam` with `decouple_wd=False`)", 'tests/test_torch_catalogue.py'),
    'RAdam': ("fastai's `RAdam`", 'tests/test_parity_fastai.py'),
    'QHAdam': ("fastai's `QHAdam`", 'tests/test_parity_fastai.py'),
    'Larc': ("fastai's `Larc`", 'tests/test_parity_fastai.py'),
    'Lamb': ("fastai's `Lamb`", 'tests/test_parity_fastai.py'),
    'Lookahead': ("fastai's `Lookahead` (around any optimizer)", 'tests/test_parity_fastai.py'),
    'ranger': ("fastai's `ranger` (RAdam in Lookahead)", 'tests/test_parity_fastai.py'),
    'Adagrad': ("torch's `Adagrad`", 'tests/test_torch_catalogue.py'),
    'Adadelta': ("torch's `Adadelta`", 'tests/test_torch_catalogue.py'),
    'Adamax': ("torch's `Adamax`", 'tests/test_torch_catalogue.py'),
    'NAdam': ("torch's `NAdam`", 'tests/test_torch_catalogue.py'),
    'ASGD': ("torch's `ASGD`", 'tests/test_torch_catalogue.py'),
    'Rprop': ("torch's `Rprop`", 'tests/test_torch_catalogue.py'),
    'Adafactor': ("torch's `Adafactor`", 'tests/test_torch_catalogue.py'),
    'Muon': ("torch's `Muon` on the hidden matrices, AdamW on the rest", 'tests/test_torch_catalogue.py'),
    'LBFGS': ("torch's `LBFGS` (a closure each step)", 'tests/test_lbfgs.py'),
    'Lion': ("lion-pytorch's `Lion`", 'tests/test_modern.py'),
    'Adan': ("pytorch-optimizer's `Adan`", 'tests/test_modern.py'),
    'AdEMAMix': ("pytorch-optimizer's `AdEMAMix`", 'tests/test_modern.py'),
    'StableAdamW': ("torch-optimi's `StableAdamW`", 'tests/test_modern.py'),
    'ScheduleFreeSGD': ("schedulefree's `SGDScheduleFree`", 'tests/test_modern.py'),
    'ScheduleFreeAdamW': ("schedulefree's `AdamWScheduleFree`", 'tests/test_modern.py'),
    'DecoupledSGDW': ("Composer's `DecoupledSGDW` (its update written out)", 'tests/test_composer.py'),
    'DecoupledAdamW': ("Composer's `DecoupledAdamW` (its update written out); torch's `AdamW` at `weight_decay / initial_lr`",
                       'tests/test_composer.py'),
}


def _defaults(f) -> str:
    """A factory's hyper defaults as `name=value` (not params, flags, None, callables, the backend or how the state is
    stored: every factory takes `state_precision=`)."""
    out = []
    for p in inspect.signature(f).parameters.values():
        if p.name in ('self', 'params', 'opt', 'backend', 'kwargs', 'state_precision', 'min_quantize_size'): continue
        if p.default is inspect.Parameter.empty: continue
        if isinstance(p.default, bool) or p.default is None or callable(p.default): continue
        out.append(f'`{p.name}={p.default!r}`')
    return ', '.join(out)


def _state_names(name: str) -> tuple[str, str]:
    "The state keys a 2-D param has before its first step (per param), and the chain's name, from a real optimizer."
    import torch
    import cbopt
    p = torch.nn.Parameter(torch.zeros(4, 4))
    opt = (cbopt.Lookahead(cbopt.Adam([('w', p)])) if name == 'Lookahead' else
           getattr(cbopt, name)([('w', torch.nn.Parameter(torch.zeros(4, 4)))]) if name == 'Muon' else
           getattr(cbopt, name)([('w', p)], lr=1e-3) if name == 'DecoupledSGDW' else  # (Composer's: no default lr)
           getattr(cbopt, name)([('w', p)]))
    opt.init_state()
    state = opt.named_state_dict()['state'].get('w', {})
    group_state = sorted(k for k in opt.param_groups[0] if '.' in k and not k.startswith('_'))
    keys = [f'`{k}`' for k in sorted(state)] + [f'`{k}`' for k in group_state]
    return ', '.join(keys) or '-', opt.named_state_dict()['param_groups'][0]['chain'].replace(',', ', ')


def catalogue_table() -> str:
    "The catalogue page's table: each prebuilt optimizer, its reference, defaults, state names and chain."
    import cbopt
    rows = ['| optimizer | checked against | defaults | state (per param; group entries) | chain |', '|---|---|---|---|---|']
    for name, (ref, test) in CATALOGUE.items():
        state, chain = _state_names(name)
        rows.append(f"| `cbopt.{name}` | {ref} (`{test}`) | {_defaults(getattr(cbopt, name)) or '-'} | {state} | "
                    f"`{chain}` |")
    return '\n'.join(rows)


def _bench(name: str) -> dict:
    return json.loads((DOCS / BENCH_FILES[name]).read_text())


def readme_bench_table() -> str:
    "The README's benchmark table: Adam on the GPT-2 set from docs/bench.json, step ms and the ratio to torch fused."
    from .bench.harness import paired
    case = _bench('bench')['cases']['gpt2']['results']
    rows = ['| optimizer | step ms | / torch fused |', '|---|---|---|']
    for name in ('cbopt auto', 'cbopt fused', 'cbopt foreach', 'cbopt loop', 'torch fused', 'torch foreach',
                 'torch loop', 'fastai'):
        rows.append(f"| {name} | {case[name]['median_s'] * 1e3:.1f} | {paired(case, name, 'torch fused'):.2f}x |")
    return '\n'.join(rows)


def readme_compile_step_line() -> str:
    """The README's compiled-step line: `torch.compile(opt.step)` of cbopt's Adam and Lion against torch's compiled
    foreach AdamW and lion-pytorch's compiled step, from docs/bench_compile_step.json."""
    from .bench.report import fmt
    runs = [_bench(name) for name in ('compile_step', 'compile_step_full') if (DOCS / BENCH_FILES[name]).is_file()]
    if not runs: return "Compiled-step numbers pending (`--only compile_step`)."
    lines = []
    for r in runs:
        which = 'the quick GPT-2 set' if r['quick'] else "GPT-2 small's set"
        pairs = [f"{p['ours']} {fmt(p['step_ratio'])}x {p['ref']}'s step time, {fmt(p['compile_ratio'])}x its compile"
                 for p in r['compile_step']['pairs'].values() if 'skipped' not in p]
        lines.append(f"on {which}, " + ', '.join(pairs))
    return (f"`torch.compile(opt.step)` ({runs[0]['machine']['cpu']}, CPU, one thread): " + '; '.join(lines)
            + '.')


def readme_gpu_line() -> str:
    "The README's GPU line: cbopt's Adam against torch's fused AdamW on the GPT-2 set, fp32 and bf16, from docs/bench_cuda.json."
    from .bench.harness import paired
    if not (DOCS / BENCH_FILES['cuda']).is_file(): return "GPU numbers pending (`tools/gpu_check.sh`)."
    r = _bench('cuda')
    ratios = {dt: {n: paired(r['cases'][case]['results'], n, 'torch fused') for n in ('cbopt auto', 'cbopt fused')}
              for dt, case in (('fp32', 'gpt2'), ('bf16', 'gpt2_bf16'))}
    return (f"On an {r['machine']['gpu']} (torch {r['machine']['torch']}), the same step over torch's fused AdamW's: "
            + '; '.join(f"{dt}, auto {v['cbopt auto']:.2f}x and fused {v['cbopt fused']:.2f}x" for dt, v in ratios.items())
            + '.')

def machine_line(results: dict) -> str:
    "The device a run was made on, without its date (the JSON keeps it)."
    m = results['machine']
    on_gpu = results.get('device') == 'cuda'
    return (f"{m['gpu'] + ' (CUDA events), host ' if on_gpu else ''}{m['cpu']}, {m['cores']} cores, torch threads: "
            f"{m['torch_threads']}; torch {m['torch']}, fastai {m['fastai']}, Python {m['python']}; "
            f"{'fp32 and bf16' if on_gpu else 'fp32'}, {results['rounds']} interleaved rounds after "
            f"{results['warmup']} warm-up steps.")


def bench_tables(name: str) -> str:
    """The tables of one of the committed runs, as the bench prints them, under the device they ran on; a line saying
    how to make the run where its JSON is not in docs/ yet."""
    from .bench.report import report
    if not (DOCS / BENCH_FILES[name]).is_file():
        return (f"*No run committed yet:* `python -m cbopt bench --threads 1 --only {name} --out bench_results`, then copy "
                f"`bench_results/bench.json` to `docs/{BENCH_FILES[name]}` and run `python -m cbopt docs --update`.")
    results = _bench(name)
    text = report(results).split('\n\n', 1)[1]  # the bench's own first line is the machine, with the date
    return f"Device: {machine_line(results)}\n\n{text}"


def lowbit_line() -> str:
    """The low-bit numbers in one sentence, each against issue #33's goal (`LOWBIT_GOALS`, the step and first-steps
    ratios), from docs/bench_lowbit.json: the performance page's summary of the low-bit guide's tables."""
    from .bench.contenders import TORCHAO_LOWBIT
    from .bench.report import LOWBIT_GOALS, fmt
    if not (DOCS / BENCH_FILES['lowbit']).is_file(): return "Low-bit numbers pending (`--only lowbit`)."
    r = _bench('lowbit')
    case, where = r['lowbit'], "GPT-2 small's set" if r['lowbit']['size'] == 1 else \
        f"the GPT-2 set at {r['lowbit']['size']:g} of GPT-2 small's width"
    b, q = case['bytes_per_param'], case['ratios']
    mem = ', '.join(f"{prec} {fmt(b.get(f'cbopt {prec}'), '.2f')} (goal {LOWBIT_GOALS[prec]:.2f}, torchao "
                    f"{fmt(b.get(f'torchao {TORCHAO_LOWBIT[prec]}'), '.2f')})" for prec in LOWBIT_GOALS)
    return (f"On {where} ({case['numel']:,} params; {r['machine']['cpu']}, CPU, {r['machine']['torch_threads']} "
            f"thread{'s' * (r['machine']['torch_threads'] != 1)}, loaded): state bytes per param {mem}; the 8-bit fused "
            f"step {fmt(q['step_over_torchao'], '.2f', 'x')} torchao's AdamW8bit (goal < 1x) and "
            f"{fmt(q['step_over_fp32'], '.2f', 'x')} cbopt's fp32 fused step (goal <= 1.5x), its first steps "
            f"{fmt(q['first_steps_over_torchao'], '.2f', 'x')} torchao's (goal <= 0.5x).")


# The API page's sections: the package each of cbopt's public names comes from, in this order.
API_SECTIONS = {
    'cbopt.optimizer': 'The optimizer', 'cbopt.core': 'Chains, hypers and tensor lists', 'cbopt.engine': 'Backends',
    'cbopt.recipes': 'Prebuilt optimizers', 'cbopt.callbacks': 'Step callbacks', 'cbopt.wrappers': 'Wrappers',
    'cbopt.functional': 'The functional form', 'cbopt.state': 'Optimizer state',
}


def api_page() -> str:
    """The API page of `cbopt`: every name of `cbopt.__all__`, under the part of the package that defines it. A
    constant (no `__module__`) goes under the part whose `__all__` has it."""
    import importlib
    import cbopt
    sections = {title: [] for title in API_SECTIONS.values()}

    def home(name: str) -> str:
        obj = getattr(cbopt, name)
        mod = getattr(obj, '__module__', None) if not inspect.ismodule(obj) else obj.__name__
        for part in API_SECTIONS:
            if mod == part or (mod or '').startswith(part + '.'): return part
            if name in getattr(importlib.import_module(part), '__all__', ()): return part
        raise ValueError(f"cbopt.{name} comes from {mod}, which no section of the API page covers (cbopt/cli/docs.py)")
    for name in cbopt.__all__:
        if name == 'functional': continue  # the module has its own page
        sections[API_SECTIONS[home(name)]].append(name)
    out = []
    for title, names in sections.items():
        if not names: continue
        out.append(f"## {title}\n\n" + '\n\n'.join(f"::: cbopt.{n}" for n in names))
    return '\n\n'.join(out)


def lazy_classes_page() -> str:
    """The entries of the fastai integration's callbacks, which the module builds on first use (so `import cbopt`
    never imports fastai) and a static reader of the source cannot see: their signatures and docstrings, read here."""
    from cbopt.integrations import fastai
    out = []
    for name in fastai._BUILDERS:
        cls = getattr(fastai, name)
        out.append(f"#### `{name}` {{ #cbopt.integrations.fastai.{name} }}\n\n`{name}()`: a fastai `Callback`.\n\n"
                   f"{inspect.cleandoc(cls.__doc__)}")
        for m in ('plot',):
            if m in vars(cls):
                out.append(f"`{name}.{m}{inspect.signature(vars(cls)[m])}`: {inspect.cleandoc(vars(cls)[m].__doc__)}"
                           .replace('(self, ', '(').replace('(self)', '()'))
    return '\n\n'.join(out)


GENERATED = {
    'api-cbopt': api_page,
    'api-fastai-callbacks': lazy_classes_page,
    'catalogue': catalogue_table,
    'readme-bench': readme_bench_table,
    'readme-gpu': readme_gpu_line,
    'bench': lambda: bench_tables('bench'),
    'bench-memory': lambda: bench_tables('memory'),
    'bench-whole-model': lambda: bench_tables('whole_model'),
    'bench-groups': lambda: bench_tables('groups'),
    'bench-catalogue': lambda: bench_tables('catalogue'),
    'bench-compile': lambda: bench_tables('compile'),
    'bench-cuda': lambda: bench_tables('cuda'),
    'readme-compile-step': readme_compile_step_line,
    'bench-compile-step': lambda: bench_tables('compile_step'),
    'bench-compile-step-full': lambda: bench_tables('compile_step_full'),
    'bench-lowbit': lambda: bench_tables('lowbit'),
    'lowbit-line': lowbit_line,
}


def generated_parts(text: str) -> dict[str, str]:
    "The generated parts of a page, by name."
    return {m['name']: m['body'].strip('\n') for m in MARK.finditer(text)}


def update(paths: list[Path] | None = None) -> list[Path]:
    "Rewrite every generated part of the README and the docs pages; returns the files that changed."
    changed = []
    for path in paths or [ROOT / 'README.md', *sorted(DOCS.rglob('*.md'))]:
        text = path.read_text()
        if 'generated:' not in text: continue
        new = MARK.sub(lambda m: f"{m[1]}{GENERATED[m['name']]()}\n{m[4]}", text)
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed


def mkdocs(*args: str) -> list[str]:
    "The mkdocs command of this interpreter's environment."
    exe = shutil.which('mkdocs', path=str(Path(sys.executable).parent)) or shutil.which('mkdocs')
    if exe is None:
        raise SystemExit("mkdocs is not installed: pip install -c constraints.txt -e \".[docs]\"")
    return [exe, *args, '--config-file', str(ROOT / 'mkdocs.yml')]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog='python -m cbopt docs', description=__doc__.split('\n\n')[0])
    parser.add_argument('--update', action='store_true', help='regenerate the generated parts of the pages, then stop')
    parser.add_argument('--build', metavar='DIR', help='build the site into DIR (strict), then stop')
    parser.add_argument('--addr', default='127.0.0.1:8000', help='where `serve` listens (default 127.0.0.1:8000; the site is under /cbopt/, as published)')
    args = parser.parse_args(argv)
    if args.update:
        for p in update(): print(f"updated {p.relative_to(ROOT)}")
        return
    cmd = mkdocs('build', '--strict', '--site-dir', args.build) if args.build else mkdocs('serve', '--dev-addr', args.addr)
    raise SystemExit(subprocess.call(cmd, cwd=ROOT, env=env()))


def env() -> dict:
    "The environment mkdocs runs in: this checkout's cbopt first on the path (mkdocstrings reads and imports it)."
    return {**os.environ, 'PYTHONPATH': os.pathsep.join(filter(None, [str(ROOT), os.environ.get('PYTHONPATH')])),
            'NO_MKDOCS_2_WARNING': '1'}
