"""`python -m cbopt bench --quick` runs end to end in a fresh process and writes its table, JSON and PNG (no timings
checked: they depend on the machine and its load). One torch thread: two stall on a busy 2-core machine."""
import copy
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import cbopt
from cbopt.cli import bench
from cbopt.cli.bench.report import report


# the catalogue's rows in the quick run: a torch.optim one with a fused kernel, a modern one, Muon (its matrices), a
# tensor-scope chain, and one whose fused backend does not compile (every optimizer: in the README's full run)
QUICK_CATALOGUE = ('AdamW', 'Lion', 'Muon', 'Adafactor', 'ScheduleFreeAdamW')


@pytest.fixture(scope='module')
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp('bench')
    env = {**os.environ, 'MPLBACKEND': 'Agg'}
    # every part but memory (tests/test_distributed.py checks the memory part's counts: 2 ranks cost minutes here) and
    # compile_step (test_compile_step_part runs it with aot_eager: inductor's codegen of 4 steps costs minutes here)
    parts = ','.join(p for p in bench.PARTS if p not in ('memory', 'compile_step'))
    cmd = [sys.executable, '-m', 'cbopt', 'bench', '--quick', '--threads', '1', '--only', parts, '--out', str(out),
           '--optimizers', ','.join(QUICK_CATALOGUE)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=out, env=env)  # (a loaded machine)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout, out


def test_table_json_png(quick_run):
    stdout, out = quick_run
    results = json.loads((out / 'bench.json').read_text())
    assert set(results['cases']) == {'gpt2', 'grid', 'groups', 'lion', 'train'}
    names = [f'cbopt {b}' for b in results['backends']]
    assert 'loop' in results['backends']
    for key in ('gpt2', 'grid', 'groups'):
        assert list(results['cases'][key]['results']) == [*names, 'torch fused', 'torch foreach', 'torch loop', 'fastai']
    assert list(results['cases']['lion']['results']) == names
    assert list(results['cases']['train']['results']) == [
        'eager: backward + Adam.step', 'backward + compiled Adam.step', 'torch: backward + AdamW.step',
        'torch: backward + compiled AdamW.step', 'functional, compiled', 'functional, eager']
    for case in results['cases'].values():
        for name, r in case['results'].items():
            assert 'error' not in r, (name, r)
            assert len(r['times']) == case.get('rounds', results['rounds']) and 'median_s' in r
            assert f'| {name} ' in stdout  # a row of the printed table
    assert set(results['peak_mem_pct']) == set(results['cases']['gpt2']['results'])
    assert (out / 'bench.md').read_text().strip() in stdout
    png = (out / 'bench.png').read_bytes()
    assert png[:8] == b'\x89PNG\r\n\x1a\n' and len(png) > 10_000


# The README: "the table warns when it exceeds 1e-6 (1e-5 for Lion)" (the largest param difference after 3 steps)
README_TOLERANCE = {'gpt2': 1e-6, 'grid': 1e-6, 'groups': 1e-6, 'lion': 1e-5, 'train': 1e-6}


def test_rows_compute_the_same_thing(quick_run):
    "Every row of a case matches its reference (torch's fused AdamW; Lion's loop) after 3 steps from the same start."
    stdout, out = quick_run
    results = json.loads((out / 'bench.json').read_text())
    for key, case in results['cases'].items():
        assert set(case['numerics_gap']) == set(case['results'])
        assert max(case['numerics_gap'].values()) <= README_TOLERANCE[key], (key, case['numerics_gap'])
    assert 'NUMERICS DIFFER' not in stdout


def test_table_warns_past_the_readmes_tolerance(quick_run):
    "The report warns for a gap past the README's tolerance of its case, and only then."
    results = json.loads((quick_run[1] / 'bench.json').read_text())
    for key, tol in README_TOLERANCE.items():
        for gap, warns in ((tol / 2, False), (tol * 2, True)):
            r = copy.deepcopy(results)
            r['cases'][key]['numerics_gap']['cbopt loop'] = gap
            assert ('NUMERICS DIFFER' in report(r)) == warns, (key, gap)


def test_gpt2_small_shapes():
    "GPT-2 small as published: 148 tensors, 124,439,808 params, token embedding 50257x768 first."
    shapes = bench.gpt2_shapes()
    assert len(shapes) == 148 and shapes[0] == ('wte.weight', (50257, 768))
    assert sum(torch.Size(s).numel() for _, s in shapes) == 124_439_808


def test_lion_callbacks_follow_the_paper():
    "cbopt.Lion (the bench's Lion rows), step by step against the update written out directly (Chen et al. 2023, Algorithm 2)."
    ps = bench.make_params([('a', (6, 5)), ('b', (7,))], seed=3)
    ref = [p.detach().clone() for _, p in ps]
    avg = [torch.zeros_like(p) for p in ref]
    h = dict(lr=0.01, mom=0.8, sqr_mom=0.95, wd=0.5)
    opt = cbopt.Lion(ps, **h)
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        for (_, p), r, m in zip(ps, ref, avg):
            p.grad = torch.randn(p.shape, generator=g)
            update = torch.sign(h['mom'] * m + (1 - h['mom']) * p.grad)
            r -= h['lr'] * (update + h['wd'] * r)
            m.copy_(h['sqr_mom'] * m + (1 - h['sqr_mom']) * p.grad)
        opt.step()
        for (_, p), r in zip(ps, ref): torch.testing.assert_close(p.detach(), r, rtol=1e-6, atol=1e-7)


def test_clipping_and_in_backward_rows(quick_run):
    """Case 6: cbopt's clipped fused Adam matches torch's fused AdamW after clip_grad_norm_ (the README's 1e-6), next to
    both unclipped steps; case 7: both variants of both models were measured, and in backward holds fewer grads."""
    stdout, out = quick_run
    results = json.loads((out / 'bench.json').read_text())
    clip = results['clip']
    assert list(clip['results']) == ['cbopt fused + clip', 'cbopt fused + clip, in_place', 'torch fused + clip_grad_norm_',
                                     'cbopt fused', 'torch fused']
    assert set(clip['numerics_gap']) == {'cbopt fused + clip', 'cbopt fused + clip, in_place', 'torch fused + clip_grad_norm_'}
    assert max(clip['numerics_gap'].values()) <= 1e-6
    assert all('median_s' in r for r in clip['results'].values())
    for key in ('tied', 'untied'):
        case = results['in_backward'][key]
        assert case['normal']['grad_bytes'] == case['in_backward']['grad_bytes'] > 0
        assert case['time_ratio'] is not None and f'GPT-2 shapes, {key}' in stdout
        # the largest saving possible, 1 - largest grad / all grads, from the model's own params
        params = list(bench.gpt2_model(True, key == 'tied').parameters())
        assert case['in_backward']['largest_grad_bytes'] == max(p.numel() * p.element_size() for p in params)
    assert '| at most |' in stdout


def test_gpt2_model_has_the_gpt2_set():
    "The InBackward case's model has exactly `gpt2_shapes`' tensors when tied (the untied one adds lm_head)."
    tied = bench.GPT2(vocab=64, ctx=16, d=8, layers=2, heads=2)
    named = {n.replace('attn_proj', 'attn.c_proj').replace('mlp_proj', 'mlp.c_proj').replace('c_attn', 'attn.c_attn')
             .replace('c_fc', 'mlp.c_fc'): tuple(p.shape) for n, p in tied.named_parameters()}
    assert named == dict(bench.gpt2_shapes(vocab=64, ctx=16, d=8, layers=2))
    untied = bench.GPT2(vocab=64, ctx=16, d=8, layers=2, heads=2, tied=False)
    assert len(list(untied.parameters())) == len(named) + 1
    tied(torch.randint(64, (1, 5))).backward()
    assert all(p.grad is not None for p in tied.parameters())


def test_catalogue_has_every_optimizer():
    "The catalogue part covers the whole catalogue (the issue's list), each name once."
    names = [e.name for e in bench.catalogue()]
    assert len(names) == len(set(names)) and set(names) == {
        'SGD', 'Adam', 'AdamW', 'RAdam', 'NAdam', 'Adagrad', 'Adadelta', 'Adamax', 'ASGD', 'Rprop', 'RMSprop',
        'Adafactor', 'Muon', 'Lion', 'Adan', 'AdEMAMix', 'StableAdamW', 'ScheduleFreeSGD', 'ScheduleFreeAdamW', 'Lamb'}


def test_every_catalogue_row_builds_and_steps():
    """Every row of the whole catalogue (not only the quick run's) builds on a tiny GPT-2 set and takes a step: a
    reference whose constructor needs an argument the entry does not give fails here, not minutes into a real run.
    (cbopt's fused row builds but does not step here: it compiles, and the quick run covers it.)"""
    shapes = bench.gpt2_shapes(vocab=64, ctx=16, d=8, layers=2)
    for entry in bench.catalogue():
        for row, make in bench.catalogue_contenders(entry, 'eager').items():
            ps = [(n, torch.nn.Parameter(torch.randn(s))) for n, s in shapes
                  if entry.select is None or entry.select(n, tuple(s))]
            opt = make(ps)
            if row == 'cbopt fused': continue
            for _, p in ps: p.grad = torch.randn_like(p)
            opt.step()


def test_catalogue_rows(quick_run):
    """Case 9: each optimizer asked for has cbopt's fused row and foreach row next to each
    mode of its reference, all timed; every row computes what the reference computes (3 steps from one start,
    relative to the reference's largest param); the floor counts the param's read and write, the grad, the state."""
    stdout, out = quick_run
    cat = json.loads((out / 'bench.json').read_text())['catalogue']
    assert set(cat['cases']) == set(QUICK_CATALOGUE)
    for entry in [e for e in bench.catalogue() if e.name in QUICK_CATALOGUE]:
        case = cat['cases'][entry.name]
        rows = ['cbopt fused', 'cbopt foreach', *entry.refs, 'add_']
        assert list(case['results']) == rows
        for row, r in case['results'].items(): assert 'error' not in r and len(r['times']) == 3, (entry.name, row, r)
        assert set(case['numerics']) == set(rows) - {'add_'}
        assert max(case['numerics'].values()) <= case['tolerance'] == entry.tol, (entry.name, case['numerics'])
        assert case['bytes_per_param'] >= 12 and f'| {entry.name} ' in stdout
    assert cat['cases']['AdamW']['bytes_per_param'] == 28 and cat['cases']['Lion']['bytes_per_param'] == 20
    assert bench.fastest_ref(cat['cases']['AdamW']) in ('torch fused', 'torch foreach')


def test_compile_part(quick_run):
    """Case 10: Lion's first compile in a fresh process, with an empty inductor cache (a miss per graph: one graph for
    the 16 flat params of the quick set), then with that cache filled (hits, no miss)."""
    stdout, out = quick_run
    cases = json.loads((out / 'bench.json').read_text())['compile']['cases']
    cold, warm = cases['cold'], cases['warm cache']
    assert cold['tensors'] == warm['tensors'] == 16
    assert cold['graphs'] == warm['graphs'] == 1
    assert cold['fxgraph_cache_miss'] == 1 and cold['fxgraph_cache_hit'] == 0
    assert warm['fxgraph_cache_miss'] == 0 and warm['fxgraph_cache_hit'] == 1
    assert "Lion's first compile" in stdout


def test_lowbit_part(quick_run):
    """Case 13 (`--only lowbit`): the state bytes per param of each format, counted here from the quick set's shapes
    (params of 4096 elements or more: codes padded to whole blocks and an fp32 scale per block; the others fp32), at
    most torchao's on the same params; the timed rows ran, their ratios are reported; 8-bit cbopt follows torchao's
    AdamW8bit (the quick set's quantized tensors are multiples of torchao's block, so both quantize the same ones)."""
    stdout, out = quick_run
    case = json.loads((out / 'bench.json').read_text())['lowbit']
    shapes = bench.params.param_sets(True)['gpt2']
    n = sum(math.prod(s) for _, s in shapes)
    def expected(codes_per_elem: float, block: int, scale_bytes: int = 4) -> float:
        total = 0
        for _, s in shapes:
            k = math.prod(s)
            blocks = -(-k // block)
            total += 2 * (blocks * block * codes_per_elem + scale_bytes * blocks) if k >= 4096 else 8 * k
        return total / n
    b = case['bytes_per_param']
    assert case['numel'] == n and b['cbopt fp32'] == 8
    assert b['cbopt bf16'] == pytest.approx(expected(2, 1, scale_bytes=0))  # (bf16: 2 bytes an element, no scale)
    assert b['cbopt 8bit'] == pytest.approx(expected(1, 256)) == b['cbopt fp8']
    assert b['cbopt 4bit'] == pytest.approx(expected(0.5, 128))
    for fmt, cls in (('8bit', 'AdamW8bit'), ('4bit', 'AdamW4bit'), ('fp8', 'AdamWFp8')):
        if f'torchao {cls}' in b: assert b[f'cbopt {fmt}'] <= b[f'torchao {cls}'] + 1e-9
    assert list(case['results']) == ['cbopt 8bit fused', 'cbopt fp32 fused', 'torchao AdamW8bit']
    assert all('median_s' in r for r in case['results'].values())
    assert all(v is not None and v > 0 for v in case['ratios'].values())  # (timings: present, not checked)
    assert case['numerics'] < 1e-5
    assert '**Low-bit state, Adam on the GPT-2 set**' in stdout


def test_compile_step_part(tmp_path, monkeypatch):
    """Case 14 (`--only compile_step`) end to end on the quick GPT-2 set, its steps compiled with aot_eager (inductor's
    graph without its codegen, minutes here; the bench's runs use inductor): both pairs' rows in the JSON and the
    table, a step ratio and a compile ratio each (each side's compile timed in a fresh process), cbopt's steps compiled
    in one graph, and cbopt's compiled Adam and Lion computing what torch's
    compiled AdamW and lion-pytorch's compiled Lion compute, within the pair's tolerance."""
    from cbopt.cli.bench import cases
    monkeypatch.setattr(cases, 'COMPILE_STEP_COMPILER', 'aot_eager')
    monkeypatch.setattr(cases, 'COMPILE_STEP_PROCESSES', 1)  # (a fresh process per side for its compile time)
    threads = torch.get_num_threads()
    try: bench.main(['--quick', '--threads', '1', '--only', 'compile_step', '--steps', '2', '--warmup', '1',
                     '--out', str(tmp_path)])
    finally: torch.set_num_threads(threads)
    part = json.loads((tmp_path / 'bench.json').read_text())['compile_step']
    assert (part['tensors'], part['compiler']) == (len(cases.param_sets(True)['gpt2']), 'aot_eager')
    assert list(part['pairs']) == ['adam', 'lion']
    for name, (ours, ref) in {'adam': ('cbopt Adam', 'torch AdamW foreach'), 'lion': ('cbopt Lion', 'lion-pytorch')}.items():
        pair = part['pairs'][name]
        assert (pair['ours'], pair['ref']) == (ours, ref)
        assert set(pair['results']) == {ours, ref} and all('median_s' in r for r in pair['results'].values())
        assert pair['step_ratio'] > 0 and pair['compile_ratio'] is not None
        assert pair['results'][ours]['graphs'] == 1  # (compiled once, its state made at trace time)
        for r in pair['results'].values():  # (each side's compile, in a fresh process of its own)
            assert r['compile_s'] > 0 and r['compile_cpu_s'] > 0 and len(r['compile_runs_s']) == 1, r
        assert set(pair['numerics_gap']) == {ours, ref}
        assert pair['numerics_gap'][ours] <= pair['tolerance'], pair['numerics_gap']
    text = (tmp_path / 'bench.md').read_text()
    assert '`torch.compile(opt.step)`' in text and 'NUMERICS DIFFER' not in text
    assert all(row in text for row in ('cbopt Adam', 'torch AdamW foreach', 'cbopt Lion', 'lion-pytorch'))


OPTIONAL = ('fastai', 'lion_pytorch', 'pytorch_optimizer', 'optimi', 'schedulefree', 'matplotlib')


def test_importing_the_bench_imports_no_reference():
    """The bench's package imports fastai, the other references and matplotlib only where a row or the plot needs
    them: importing it (every part of it) imports none, so a run without them installed starts."""
    code = ('import sys, pkgutil, importlib, cbopt.cli.bench as b; '
            '[importlib.import_module(f"cbopt.cli.bench.{m.name}") for m in pkgutil.iter_modules(b.__path__) '
            'if m.name != "__main__"]; '
            f'print(sorted(m for m in {OPTIONAL!r} if m in sys.modules))')
    res = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ['[]']


def test_help_lists_every_flag():
    "`python -m cbopt bench --help` (and `python -m cbopt.cli.bench`) list the command's flags and its parts."
    for cmd in (['-m', 'cbopt', 'bench', '--help'], ['-m', 'cbopt.cli.bench', '--help']):
        res = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        for flag in ('--out', '--steps', '--warmup', '--quick', '--threads', '--only', '--size', '--optimizers', '--device'):
            assert flag in res.stdout, flag
        assert all(part in res.stdout for part in bench.PARTS)


def test_a_reference_not_installed_is_skipped_with_a_note(monkeypatch):
    """A reference whose package is missing (here: hidden from imports) is dropped from its case with a note, and a
    catalogue entry whose reference is missing is skipped whole, instead of the run failing; the machine line says
    fastai is not installed."""
    for m in ('fastai', 'lion_pytorch'): monkeypatch.setitem(sys.modules, m, None)  # `import m` raises, find_spec: None
    kept, notes = bench.installed(bench.adam_contenders(['loop']))
    assert list(kept) == ['cbopt loop', 'torch fused', 'torch foreach', 'torch loop']
    assert notes == {'fastai': 'fastai is not installed'}
    skipped = {}
    assert bench.catalogue_case(bench.tiny_gpt2(1), 1, 1, True, only=['Lion', 'Lamb'], skipped=skipped) == {}
    assert skipped == {'catalogue Lion': 'lion-pytorch is not installed', 'catalogue Lamb': 'fastai is not installed'}
    assert bench.machine()['fastai'] is None
    monkeypatch.undo()
    assert bench.installed(bench.adam_contenders(['loop']))[1] == {}  # installed: nothing skipped
    assert bench.machine()['fastai'] is not None


def test_the_report_names_what_was_skipped(quick_run):
    "The report says which rows were skipped and why, and says nothing when none was."
    results = json.loads((quick_run[1] / 'bench.json').read_text())
    assert 'skipped' not in results and 'Skipped:' not in report(results)
    results['skipped'] = {'fastai': 'fastai is not installed'}
    assert 'Skipped: fastai (fastai is not installed).' in report(results)


def test_device_cuda_refuses_cpu_only_parts_and_a_missing_gpu(capsys):
    "`--device cuda` names the parts it cannot run on a GPU, and says so when this torch sees no GPU."
    with pytest.raises(SystemExit): bench.main(['--device', 'cuda', '--only', 'train,adam'])
    assert "['train'] run on the CPU only" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit): bench.main(['--device', 'cuda', '--quick'])
        assert 'sees no CUDA device' in capsys.readouterr().err


def test_placed_params_follow_the_cpu_values():
    "`placed` puts the bench's params (and grads) where asked, in the dtype asked, with the CPU run's values."
    from cbopt.cli.bench.params import make_params, placed
    shapes = [('a', (3, 4)), ('b', (5,))]
    cpu = make_params(shapes)
    with placed('meta', torch.bfloat16): moved = make_params(shapes)
    assert [(p.device.type, p.dtype, p.grad.device.type) for _, p in moved] == [('meta', torch.bfloat16, 'meta')] * 2
    with placed('cpu', torch.bfloat16): same = make_params(shapes)
    for (_, a), (_, b) in zip(same, cpu):
        torch.testing.assert_close(a, b.bfloat16(), rtol=0, atol=0)
        torch.testing.assert_close(a.grad, b.grad.bfloat16(), rtol=0, atol=0)


def test_cuda_bench_times_fp32_and_bf16(tmp_path, device):
    "On a GPU, the quick bench runs its GPU parts in fp32 and bf16, names the GPU, and every row computes the same."
    if device.type == 'cpu': pytest.skip("on the CPU: quick_run checks the bench")
    results = bench.main(['--device', 'cuda', '--quick', '--out', str(tmp_path)])
    assert results['device'] == 'cuda' and results['machine']['gpu']
    assert {'gpt2', 'gpt2_bf16', 'lion', 'lion_bf16'} <= set(results['cases'])
    for key, case in results['cases'].items():
        assert all('median_s' in r for n, r in case['results'].items() if n.startswith(('cbopt', 'torch'))), key
        assert all(g <= case['tolerance'] for g in case['numerics_gap'].values()), (key, case['numerics_gap'])
    assert all(v is not None for v in results['peak_mem_pct'].values())
