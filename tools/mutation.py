"""Mutation testing of one cbopt module with mutmut 3, scoped to the tests that cover it (issue #14).

    python tools/mutation.py callbacks            # or tensorlist, state, hypers, params, engine
    python tools/mutation.py callbacks -j 2       # mutmut workers (default 1: the CPU is shared)
    python tools/mutation.py callbacks --show     # also print the diff of every surviving mutant

The repository is left untouched: the runner copies the library, the tests and the pytest/packaging config into a
scratch directory (default `/tmp/cbopt-mutation/<module>`, kept between runs so a rerun only retests what
changed; `--fresh` starts over), writes mutmut's config there as a `setup.cfg` with only a `[mutmut]` section, and
runs `mutmut run` in it. mutmut mutates only the module's files (`only_mutate`) and runs only its covering tests,
single-threaded (the copy's pytest.ini loads no xdist) with one intra-op thread per process. It prints killed / survived / timeout /
no-tests counts per file and the score = (killed + timeout) / (all mutants that ran).
"""
from __future__ import annotations

import argparse
import ast
import glob
import hashlib
import json
import re
import os
import random
import shutil
import subprocess
import sys
from collections import Counter
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# module -> (source files, relative to the repo; tests that cover them)
MODULES: dict[str, tuple[list[str], list[str]]] = {
    'callbacks': (['cbopt/callbacks/fastai.py'], ['tests/test_callbacks.py']),
    'tensorlist': (['cbopt/core/tensorlist.py'], ['tests/test_tensorlist.py']),
    'state': (['cbopt/state/*.py'], ['tests/test_state_load.py', 'tests/test_state_formats.py', 'tests/test_state_save.py',
                                     'tests/test_resume.py',
                                     # what torch.optim's own classes save and load (`torch_class_state_dict`,
                                     # `_torch_group`, `_check_flags`, LBFGS's history: `torch_model_state`/`_entries`)
                                     *[f'tests/test_optim.py::{t}' for t in (
                                         'test_loads_torchs_state_dict', 'test_torch_loads_cbopts_state_dict',
                                         'test_state_dict_for_a_torch_class_refuses_what_it_cannot_hold',
                                         'test_torch_checkpoint_with_another_weight_decay_is_rejected',
                                         'test_torch_checkpoint_of_an_l2_class_is_rejected_by_a_decoupled_chain',
                                         # the torch view of live state (`torch_view.py`)
                                         'test_live_state_is_torchs', 'test_live_state_writes_reach_the_step',
                                         'test_param_groups_and_state_dict_are_torchs')],
                                     'tests/test_lbfgs.py::test_torch_loads_its_state_dict_mid_run',
                                     'tests/test_lbfgs.py::test_loads_torchs_state_dict_mid_run',
                                     'tests/test_lbfgs.py::test_loads_torchs_state_dict_before_any_history']),
    'hypers': (['cbopt/core/hypers.py'], ['tests/test_hypers.py', 'tests/test_torch_names.py', 'tests/test_bad_input.py']),
    'params': (['cbopt/core/params.py'], ['tests/test_params.py', 'tests/test_bad_input.py']),
    # the engine's unit tests are tests/test_engine_<module>.py, one file per module of cbopt/engine/
    'engine': (['cbopt/engine/*.py'], ['tests/test_engine_backend.py', 'tests/test_engine_step.py',
                                       'tests/test_engine_model_stage.py', 'tests/test_engine_buckets.py',
                                       'tests/test_engine_foreach.py', 'tests/test_engine_auto.py',
                                       'tests/test_engine_compiled.py', 'tests/test_engine_flat.py',
                                       # torch's own kernels (`kernels.py`): its grad_scale / in-place clip paths
                                       'tests/test_engine_kernels.py', 'tests/test_engine_scaling.py',
                                       'tests/test_clip_in_place.py',
                                       'tests/test_chain.py', 'tests/test_backends.py',
                                       'tests/test_callbacks_whole_model.py',
                                       # the inductor pass on a hand-made graph, and the scalar rewrite eagerly
                                       *[f'tests/test_engine_scalars.py::{t}' for t in (
                                           'test_scalars_once_dedupes_drops_inputs_and_merges',
                                           'test_scalars_once_keeps_one_barrier_per_converted_value',
                                           'test_scalars_once_has_a_key_for_the_graph_cache',
                                           'test_scalar_args_as_tensors_computes_the_same')],
                                       # the traced step's parts (`traced.py`), eagerly and with dynamo's eager
                                       # backend (the rest of that file compiles with aot_eager: minutes)
                                       *[f'tests/test_engine_traced.py::{t}' for t in (
                                           'test_the_traced_step_run_eagerly_steps_as_torch',
                                           'test_can_trace_refuses_what_only_the_eager_step_does_and_changes_nothing',
                                           'test_number_tensor_is_a_float64_count_on_the_params_device',
                                           'test_an_outer_compiled_step_is_traced_whole_and_a_closure_runs_eagerly')],
                                       # `model_plan`'s refusal of flat whole-model state in several groups
                                       'tests/test_state_load.py::'
                                       'test_flat_whole_model_state_in_several_groups_is_rejected_before_anything_changes']),
}

# functions mutmut 3 cannot measure, left unmutated (docs/mutation.md says why): `_each_op`/`_each_op_` are called
# in the class body while TensorList is being built, where mutmut's trampoline for a method finds no mutant table
# yet (KeyError '_mutmut_orig': no test could even be collected); `_unary` (and hypers' `_is_in`) run only at
# import, which happens before mutmut selects a mutant, so none of their mutants could ever be active
# extra pytest arguments per module: params, hypers and state are checked before any backend runs (construction,
# set_hyper, load), so their tests run in the loop backend only (the fused cases alone cost seconds of compiling per
# mutant); the engine's leave out the long parity runs, which the engine's unit tests stand in for (see docs/mutation.md)
ONE_BACKEND = ['-k', 'not fused and not foreach and not auto']
PYTEST_ARGS: dict[str, list[str]] = {'state': ['-k', f'{ONE_BACKEND[1]} and not resume_is_exact'],
                                     'hypers': ONE_BACKEND, 'params': ONE_BACKEND,
                                     # (the kernel files run torch's fused kernels, which compile nothing, and
                                     # the unit tests compile with dynamo's eager backend: their `fused` cases stay)
                                     'engine': ['-k', 'not inductor and not foreach_is_loop and not interchange and '
                                                '(not fused or test_engine_ or test_clip_in_place)']}

NOT_MUTATED = {'tensorlist': ['TensorList._each_op', 'TensorList._each_op_', '_unary'],
               'hypers': ['_is_in', 'torch_keywords'],  # called only at import (HYPER_RULES, the recipes' decorator)
               # register_kernel: called only at import, by cbopt.optimizers; user_stacklevel counts the frames above
               # it, and mutmut's trampoline around it would be one more (every warning one line off)
               'engine': ['register_kernel', 'user_stacklevel']}

# what the tests need besides the library (mutmut copies `tests/` itself; the rest is copied here)
COPY = ['cbopt', 'tests', 'pytest.ini', 'settings.ini', 'setup.py', 'README.md', 'nbs', 'docs']

# mutmut's exit-code meaning (mutmut/stats.py): 1 and 3 are kills, 0 a survivor, 33/5 no covering test
KILLED, SURVIVED, NO_TESTS = {1, 3}, {0}, {5, 33}
TIMEOUT = {36, -24, 24, 152, 255}


def _list(values: list[str]) -> str:
    "A setup.cfg list for mutmut: one value a line (a single-line value is one item, spaces and all)."
    return ''.join(f'\n    {v}' for v in values)


def function_patterns(work: Path, sources: list[str], names: list[str]) -> list[str]:
    """The exact text of each line of the bodies of the functions `names` (`f` or `Class.f`; lines found elsewhere
    in the file too, such as `return self`, are left out: mutmut mutates nothing on those)."""
    pats = []
    for src in sorted({f for s in sources for f in glob.glob(str(work / s))}):
        text = Path(src).read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        defs = [(n.name, n) for n in tree.body if isinstance(n, ast.FunctionDef)]
        defs += [(f'{c.name}.{n.name}', n) for c in tree.body if isinstance(c, ast.ClassDef)
                 for n in c.body if isinstance(n, ast.FunctionDef)]
        for name, node in defs:
            if name in names:
                for ln in lines[node.body[0].lineno - 1:node.end_lineno]:
                    if ln.strip() and lines.count(ln) == 1: pats.append('^' + re.escape(ln) + '$')
    return [p.replace('%', '%%') for p in pats]


def docstring_patterns(work: Path, sources: list[str]) -> list[str]:
    """One regex per docstring line of the module's functions and classes, the line's exact text: mutmut 3 would
    otherwise mutate docstrings (`"XX...XX"`, case changes), mutants no test can or should see. A pattern names a
    line; mutmut skips the whole statement starting there, so the first line of each docstring is enough."""
    pats = []
    for src in sorted({f for s in sources for f in glob.glob(str(work / s))}):
        text = Path(src).read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)): continue
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                pats.append('^' + re.escape(lines[body[0].lineno - 1]) + '$')
    return [p.replace('%', '%%') for p in pats]  # setup.cfg interpolates '%'


def write_config(work: Path, sources: list[str], tests: list[str], not_mutated: list[str],
                 pytest_args: list[str]) -> None:
    (work / 'setup.cfg').write_text(
        '[mutmut]\n'
        'source_paths = cbopt\n'                                     # copied whole, so every import works
        f'only_mutate ={_list(sources)}\n'
        f'pytest_add_cli_args_test_selection ={_list(tests)}\n'
        f'pytest_add_cli_args ={_list(["-p", "no:cacheprovider", "--hypothesis-seed=0", *pytest_args])}\n'
        f'do_not_mutate_patterns ={_list(docstring_patterns(work, sources) + function_patterns(work, sources, not_mutated))}\n'
        'process_isolation = forkserver\n'                           # the tests import torch: not fork-safe
        'timeout_constant = 10\n'                                    # the CPU is shared: wall time is no measure
        'timeout_multiplier = 10\n')


# mutmut's first pass ("stats": which tests reach which function) runs every test with the trampolines recording
# their calls (a context variable, a dict): torch.compile cannot trace that (a graph break), so under it a chain that
# compiles in any real run fell back to foreach, and what only compiled code reaches (the packed small params, the
# traced step) was never mapped ("no tests"). In that pass only, `torch.compile` gives back the function itself: the
# compiled code runs eagerly, its Python reaching the trampolines (`torch._dynamo.config.disable` is not enough:
# `fullgraph=True` then raises after the eager call, "found no compiled frames"). A test counting graphs fails
# there, which the hook below lets pass. A mutant's own run (where the trampoline only reads its name, which dynamo
# traces) compiles as always.
STATS_HOOK = """
import json as _json, pytest as _pytest, torch as _torch

_real_compile = _torch.compile


def _compile(model=None, **kwargs):
    # mutmut's first pass (below): the function as it is, run eagerly, so that every line of cbopt's compiled code
    # (the compiled chain, the packed params, the step an outer compile traces) reaches the trampolines and is mapped
    if _os.environ.get('MUTANT_UNDER_TEST') != 'stats': return _real_compile(model, **kwargs)
    return model if model is not None else (lambda fn: fn)


_torch.compile = _compile


@_pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if _os.environ.get('MUTANT_UNDER_TEST') == 'stats' and report.failed:
        report.outcome = 'passed'  # the test ran, so the functions it reached are recorded: enough for this pass


# the suite's own hook of this name (the registry's known gaps reported as skips) would be replaced by the one below,
# a module holding one function per name: it is kept and called first
_suite_modifyitems = globals().get('pytest_collection_modifyitems')


@_pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    if _suite_modifyitems is not None: _suite_modifyitems(config, items)
    # a mutant's tests fastest first, by the durations of mutmut's first pass: its run stops at the first failure
    # (`-x`), so a killed mutant costs its fastest failing test, not the files' order (a survivor runs them all anyway)
    if _os.environ.get('MUTANT_UNDER_TEST', 'stats') == 'stats': return
    try:
        with open('mutmut-stats.json') as f: durations = _json.load(f)['duration_by_test']
    except (OSError, ValueError, KeyError): return
    items.sort(key=lambda item: durations.get(item.nodeid, float('inf')))
"""


def sync(work: Path, fresh: bool) -> None:
    """Copy the repo's files into `work`. mutmut keeps the previous run's results in `work/mutants` and reruns
    only the functions whose source changed (and, with `--survivors`, the last survivors)."""
    if fresh and work.exists(): shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    for name in COPY:
        src, dst = ROOT / name, work / name
        if not src.exists(): continue
        if src.is_dir():
            if dst.exists(): shutil.rmtree(dst)
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns('__pycache__', '*.pyc', '.ipynb_checkpoints'))
        else:
            shutil.copy2(src, dst)
    # no xdist in the scratch copy: each mutant is one short pytest run in a forked process, where loading and
    # configuring xdist (pytest.ini's `-n 2`) costs more than the tests themselves
    ini = (work / 'pytest.ini').read_text()
    (work / 'pytest.ini').write_text(re.sub(r'(?m)^addopts *=.*$', 'addopts = -q -p no:xdist', ini))
    # mutmut 3.8's trampoline (`mutmut.mutation.trampoline`) wraps every mutated function, so a warning cbopt gives
    # "at the user's line" (`runtime.user_stacklevel`, skipping cbopt's and torch's frames) would point into mutmut:
    # the scratch copy's tests count mutmut's frames as the library's too
    with open(work / 'tests' / 'conftest.py', 'a') as f:
        f.write('\n\n# added by tools/mutation.py: the mutmut trampoline\'s frames are not the user\'s\n'
                'import os as _os, mutmut as _mutmut, cbopt.engine.runtime as _rt\n'
                '_rt._LIBRARY_DIRS += (_os.path.dirname(_mutmut.__file__) + _os.sep,)\n'
                + STATS_HOOK)
    # the tests changed: mutmut's copy of them in mutants/ must follow (it copies `tests/` only when absent)
    if (work / 'mutants' / 'tests').exists(): shutil.rmtree(work / 'mutants' / 'tests')
    # mutmut picks each mutant's tests from its map of which test reaches which function, and on a rerun it maps
    # only the tests it has not seen: a test extended since (more calls, more asserts) keeps its old reach, so the
    # mutants it now kills would never meet it and stay survivors. Tests or library changed: map every test again
    # (a scratch copy from before this check has no digest: its map is of unknown tests)
    stats, mapped, digest = work / 'mutants' / 'mutmut-stats.json', work / 'mapped.sha256', _digest(work, MAPPED)
    if stats.exists() and (not mapped.exists() or mapped.read_text() != digest):
        print('tests or library changed since the last run: mapping every test to the functions it reaches again',
              flush=True)
        stats.unlink()
    mapped.write_text(digest)


# the first steps of `mutmut run` (mutmut 3.8's `_run`): the mutated copies and their `.meta` files, each mutant
# unchecked; no test runs. `--sample` draws from them, so a fresh copy needs them before its first run
GENERATE = ('import os, mutmut.__main__ as m; m.set_mutant_under_test("mutant_generation"); '
            'os.makedirs("mutants", exist_ok=True); m.copy_src_dir(); m.copy_also_copy_files(); '
            'm.setup_source_paths(); m.store_lines_covered_by_tests(); m.create_mutants(1)')

MAPPED = ('tests', 'cbopt')  # what decides which test reaches which mutated function


def _digest(work: Path, dirs: tuple[str, ...]) -> str:
    "One hash of the files under `work/<dirs>` (names and contents)."
    h = hashlib.sha256()
    for d in dirs:
        for f in sorted((work / d).rglob('*.py')):
            h.update(str(f.relative_to(work)).encode() + b'\0' + f.read_bytes())
    return h.hexdigest()


def check_selection(tests: list[str], pytest_args: list[str]) -> None:
    """pytest's `-k 'not fused'` matches any part of a name: `test_..._is_refused` would be left out of the module's
    tests without a word. Stop before running if a test function's name holds a left-out word inside another word
    (parametrized ids are not read here)."""
    if '-k' not in pytest_args: return
    words = re.findall(r'not (\w+)', pytest_args[pytest_args.index('-k') + 1])
    named = [(t, t.partition('::')[2]) if '::' in t else (t, None) for t in tests]  # a file, or one test of it
    names = [(t, n) for t, one in named
             for n in ([one] if one else re.findall(r'^def (test_\w+)', (ROOT / t).read_text(), re.M))]
    bad = [f'{t}::{n} ({w!r})' for t, n in names for w in words if w in n and f'_{w}_' not in f'_{n}_']
    if bad: raise SystemExit("these tests' names hold a word that -k leaves out, inside another word, so they would "
                             "not run: rename them\n  " + '\n  '.join(bad))


def results(work: Path) -> dict[str, int | None]:
    "Every mutant's exit code, from mutmut's `.meta` files."
    codes: dict[str, int | None] = {}
    for meta in sorted((work / 'mutants').rglob('*.py.meta')):
        codes.update(json.loads(meta.read_text())['exit_code_by_key'])
    return codes


def status(code: int | None) -> str:
    if code in KILLED: return 'killed'
    if code in SURVIVED: return 'survived'
    if code in TIMEOUT: return 'timeout'
    if code in NO_TESTS: return 'no tests'
    return 'not checked' if code is None else f'other ({code})'


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('module', choices=sorted(MODULES))
    ap.add_argument('-j', '--max-children', type=int, default=1, help='mutmut workers (default 1)')
    ap.add_argument('--work', type=Path, help='scratch directory (default /tmp/cbopt-mutation/<module>)')
    ap.add_argument('--fresh', action='store_true', help='forget the previous run of this module')
    ap.add_argument('--survivors', action='store_true',
                    help="rerun only the last run's survivors and untested mutants (after adding tests: mutmut keeps "
                         "other results)")
    ap.add_argument('--only', nargs='+', metavar='PATTERN', default=[],
                    help="run only the mutants matching these fnmatch patterns (mutmut's names, e.g. "
                         "'cbopt.engine.auto.*', or 'cbopt.engine.x*' for engine/__init__.py): whole files or functions")
    ap.add_argument('--sample', type=int, metavar='N',
                    help='run only N unchecked mutants drawn at random (those matching --only, if given): an estimate '
                         'of the score where the whole module would take hours')
    ap.add_argument('--seed', type=int, default=0, help="--sample's random seed (default 0)")
    ap.add_argument('--show', action='store_true', help="print every survivor's diff")
    ap.add_argument('--report-only', action='store_true', help='print the last run\'s results, run nothing')
    args = ap.parse_args(argv)

    sources, tests = MODULES[args.module]
    work = (args.work or Path('/tmp/cbopt-mutation') / args.module).resolve()
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'MKL_NUM_THREADS': '1', 'PYTHONDONTWRITEBYTECODE': '1'}
    mutmut = [sys.executable, '-c', 'import sys; from mutmut.__main__ import cli; sys.exit(cli())']
    if not args.report_only:
        check_selection(tests, PYTEST_ARGS.get(args.module, []))
        sync(work, args.fresh)
        write_config(work, sources, tests, NOT_MUTATED.get(args.module, []), PYTEST_ARGS.get(args.module, []))
        rev = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, capture_output=True, text=True)
        print(f'mutating {" ".join(sources)} against {" ".join(tests)} (repo at {rev.stdout.strip()}) in {work}',
              flush=True)
        if args.sample and not results(work):  # a fresh copy: mutmut has made no mutants yet, so none to draw from
            subprocess.run([sys.executable, '-c', GENERATE], cwd=work, env=env, check=True)
        # (a 'no tests' mutant may have tests now that every test is mapped again)
        names = [k for k, c in results(work).items() if status(c) in ('survived', 'no tests')] if args.survivors else []
        # (mutmut reruns every mutant it is given by name, checked or not: give it only the unchecked ones)
        unchecked = [k for k, c in results(work).items() if c is None
                     and (any(fnmatch(k, pat) for pat in args.only) or not args.only and args.sample)]
        if args.sample:
            unchecked = random.Random(args.seed).sample(sorted(unchecked), min(args.sample, len(unchecked)))
            drawn = work / 'sampled.json'  # every draw so far, for the report's estimate
            drawn.write_text(json.dumps(sorted({*unchecked, *(json.loads(drawn.read_text()) if drawn.exists() else [])})))
        names += unchecked
        if (args.only or args.sample) and not names:
            print('every mutant matching --only has been checked', file=sys.stderr)
            return report(args, work, env, mutmut)
        rc = subprocess.run([*mutmut, 'run', '--max-children', str(args.max_children), *names],
                            cwd=work, env=env).returncode
        if rc: print(f'mutmut run exited with {rc}', file=sys.stderr)
    return report(args, work, env, mutmut)


def report(args, work: Path, env: dict, mutmut: list[str]) -> int:
    "Print the counts per file, the score and the survivors of the run recorded in `work`."
    codes = results(work)
    if not codes:
        print('no mutants recorded', file=sys.stderr)
        return 1
    by_file: dict[str, Counter] = {}
    for key, code in codes.items():
        by_file.setdefault(key.split('.x_')[0].split('.xǁ')[0], Counter())[status(code)] += 1
    total = Counter(status(c) for c in codes.values())
    print()
    for f, c in sorted(by_file.items()): print(f'{f}: {dict(sorted(c.items()))}')
    ran = total['killed'] + total['timeout'] + total['survived']
    caught = total['killed'] + total['timeout']
    print(f'{args.module}: {len(codes)} mutants: killed {total["killed"]}, timeout {total["timeout"]}, '
          f'survived {total["survived"]}, no tests {total["no tests"]}, '
          f'other {len(codes) - ran - total["no tests"]}')
    if ran: print(f'{args.module}: score {caught}/{ran} = {100 * caught / ran:.1f}% (timeouts count as killed)')
    if (work / 'sampled.json').exists():  # the mutants drawn at random by --sample: an unbiased estimate
        drawn = Counter(status(codes.get(k)) for k in json.loads((work / 'sampled.json').read_text()))
        ran_s = drawn['killed'] + drawn['timeout'] + drawn['survived']
        if ran_s: print(f'{args.module}: of {sum(drawn.values())} mutants drawn at random (--sample), '
                        f'{ran_s} ran: score {ran_s - drawn["survived"]}/{ran_s} = '
                        f'{100 * (ran_s - drawn["survived"]) / ran_s:.1f}%; {dict(sorted(drawn.items()))}')
    survivors = sorted(k for k, c in codes.items() if status(c) in ('survived', 'no tests'))
    for k in survivors:
        print(f'{status(codes[k])}: {k}')
        if args.show:
            subprocess.run([*mutmut, 'show', k], cwd=work, env=env)
    return 0


if __name__ == '__main__':
    sys.exit(main())
