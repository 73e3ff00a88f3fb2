"""The package's layout (issue #34): no import cycle, package `__init__`s included; every public name kept; old
module paths, pickles and checkpoints from before the move; the README's "How it is built" table as the tree; what
`import cbopt` imports."""
import ast
import json
import pickle
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import cbopt
import cbopt.optim

ROOT = Path(__file__).parents[1]
PKG = Path(cbopt.__file__).parent
DATA = Path(__file__).parent / 'data'


def module_name(path: Path) -> str:
    return '.'.join(('cbopt', *path.relative_to(PKG).with_suffix('').parts)).removesuffix('.__init__')


def ancestors(name: str) -> set:
    parts = name.split('.')
    return {'.'.join(parts[:i]) for i in range(1, len(parts))}


def import_graph() -> dict:
    """Module -> the cbopt modules importing it runs, at import or call time (every import statement but those under
    `if TYPE_CHECKING:`). Importing `a.b.c` runs the `__init__` of `a` and `a.b` too, unless the importer is inside
    them (Python has started those before it)."""
    modules = {module_name(p): p for p in PKG.rglob('*.py')}
    graph = {}
    for name, path in modules.items():
        pkg = name if path.name == '__init__.py' else name.rsplit('.', 1)[0]
        targets = set()

        def nodes(tree):
            for n in ast.iter_child_nodes(tree):
                if isinstance(n, ast.If) and getattr(n.test, 'id', None) == 'TYPE_CHECKING': continue
                yield n
                yield from nodes(n)
        for node in nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.rsplit('.', node.level - 1)[0] if node.level > 1 else pkg
                    target = f"{base}.{node.module}" if node.module else base
                elif (node.module or '').split('.')[0] == 'cbopt': target = node.module
                else: continue
                targets.add(target)
                targets.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.split('.')[0] == 'cbopt')
        deps = set()
        for t in targets:
            deps.update(m for m in {t, *ancestors(t)} if m in modules and m not in ancestors(name) and m != name)
        graph[name] = deps
    return graph


def test_import_graph_has_no_cycle():
    "No module imports (directly, or through a package `__init__` it runs) a module that imports it back."
    graph = import_graph()

    def reaches(a, b):
        seen, todo = set(), [a]
        while todo:
            for d in graph[todo.pop()]:
                if d == b: return True
                if d not in seen: seen.add(d); todo.append(d)
        return False
    cycles = sorted((a, b) for a in graph for b in graph[a] if reaches(b, a))
    assert not cycles, cycles


def test_the_graph_sees_package_inits():
    "The check would catch the cycle issue #34 found: a module importing another package runs that package's `__init__`."
    graph = import_graph()
    assert 'cbopt.state' in graph['cbopt.optimizer']  # `from .state import ...` runs state/__init__
    assert 'cbopt.core' in graph['cbopt.engine.buckets']  # `from ..core.chain import ...` runs core/__init__
    assert 'cbopt.engine' not in graph['cbopt.engine.dispatch']  # its own package has started before it


def test_core_imports_nothing_outside_core():
    "...but `cbopt._torch`, the private torch APIs, a leaf that imports no cbopt module."
    graph = import_graph()
    assert graph['cbopt._torch'] == set()
    for name, deps in graph.items():
        if name.startswith('cbopt.core'):
            assert {d for d in deps if not d.startswith('cbopt.core')} <= {'cbopt._torch'}, name


def test_import_cbopt_imports_no_inductor_fastai_or_matplotlib():
    """`import cbopt` (in a fresh interpreter) leaves out what only some users need and what doubles its time:
    torch's compiler stack (`torch._inductor`, `torch._dynamo`: loaded on the first compile), fastai and matplotlib
    (loaded by the integration and the bench that use them). It registers no `cbopt::` op either."""
    heavy = ['torch._inductor', 'torch._dynamo', 'fastai', 'matplotlib']
    code = ("import sys, torch, cbopt, cbopt.optim, cbopt.functional; "
            f"print([m for m in {heavy!r} if m in sys.modules]); print(hasattr(torch.ops.cbopt, 'scalar'))")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.split('\n')[:2] == ['[]', 'False'], out


def test_top_level_has_few_modules():
    assert len([p for p in PKG.glob('*.py')]) <= 12


def test_no_public_name_lost():
    "Every public name of `cbopt` and `cbopt.optim` from before the layout change is still there."
    before = json.loads((DATA / 'pre_layout_names.json').read_text())
    for mod in (cbopt, cbopt.optim):
        missing = [n for n in before[mod.__name__] if not hasattr(mod, n)]
        assert missing == [], (mod.__name__, missing)
    assert set(cbopt.__all__) <= set(dir(cbopt))


@pytest.mark.parametrize('old', ['chain', 'dtensor', 'hypers', 'params', 'tensorlist', 'torch_callbacks',
                                 'modern_callbacks', 'model_callbacks', 'optimizers', 'torch_optimizers',
                                 'modern_optimizers', 'combined', 'in_backward', 'pure', 'engine.runtime',
                                 'state.names', 'state.flags'])
def test_old_module_paths_import(old):
    mod = __import__(f'cbopt.{old}', fromlist=['_'])
    assert isinstance(mod, types.ModuleType)


def test_documented_submodules():
    import cbopt.chain, cbopt.dtensor, cbopt.callbacks, cbopt.testing, cbopt.functional
    assert cbopt.chain.zeros is cbopt.core.chain.zeros and cbopt.chain.per_tensor is cbopt.core.chain.per_tensor
    assert cbopt.callbacks.average_grad is cbopt.average_grad and cbopt.callbacks.lion_step is cbopt.lion_step
    assert isinstance(cbopt.functional, types.ModuleType) and callable(cbopt.functional)
    assert isinstance(cbopt.functional(cbopt.Adam, lr=0.1), cbopt.functional.FunctionalOptimizer)
    assert {'chain', 'dtensor'} <= set(dir(cbopt)) and 'torch_callbacks' not in dir(cbopt)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def _fresh(name, m):
    mk = {'Adam': lambda ps: cbopt.Adam(ps, lr=1e-2, wd=0.01), 'ranger': lambda ps: cbopt.ranger(ps, lr=1e-2),
          'optim.AdamW': lambda ps: cbopt.optim.AdamW(ps, lr=1e-2), 'optim.Adagrad': lambda ps: cbopt.optim.Adagrad(ps, lr=1e-2),
          'Lion': lambda ps: cbopt.Lion(ps, lr=1e-3),
          'clipped': lambda ps: cbopt.GradientClippingOptimizer(cbopt.SGD(ps, lr=1e-2, mom=0.9), max_gradient=1.0),
          'warmup': lambda ps: cbopt.WarmupOptimizer(cbopt.Adam(ps, lr=1e-2), stages=[
              cbopt.WarmupStage(cbopt.WarmupPolicy.LINEAR, max_iters=3, value=0.1)]),
          'LBFGS': lambda ps: cbopt.LBFGS(ps, lr=0.5)}
    return mk[name](m.named_parameters())


def _steps(name, m, opt, x, y, n):
    def closure():
        opt.zero_grad(); loss = ((m(x) - y) ** 2).mean(); loss.backward(); return loss
    for _ in range(n): opt.step(closure) if name == 'LBFGS' else (closure(), opt.step())


NAMES = ['Adam', 'ranger', 'optim.AdamW', 'optim.Adagrad', 'Lion', 'clipped', 'warmup', 'LBFGS']


@pytest.mark.parametrize('name', NAMES)
def test_checkpoint_saved_before_the_move_resumes(name):
    """A state_dict saved (with torch.save) before the layout change loads with weights_only and steps on exactly as
    the optimizer it was saved from (unpickled, also from before the move) does."""
    ck = torch.load(DATA / 'pre_layout_checkpoints.pt', weights_only=True)[name]
    m = _model(); m.load_state_dict(ck['model'])
    opt = _fresh(name, m)
    opt.load_state_dict(ck['opt'])
    old_m, old_opt = pickle.loads(pickle.load(open(DATA / 'pre_layout_optimizers.pkl', 'rb'))[name])
    for a, b in zip(m.parameters(), old_m.parameters()): assert torch.equal(a, b)
    _steps(name, m, opt, ck['x'], ck['y'], 3)
    _steps(name, old_m, old_opt, ck['x'], ck['y'], 3)
    for a, b in zip(m.parameters(), old_m.parameters()): assert torch.equal(a, b)


def test_readme_table_is_the_tree():
    "The README's 'How it is built' table names every module of the package, and only those, one row each."
    text = (ROOT / 'README.md').read_text()
    table = text[text.index('## How it is built'):]
    table = table[:table.index('\n\n', table.index('|'))]
    rows = re.findall(r"^\| `(cbopt/[\w/]+\.py)` \|", table, flags=re.M)
    files = sorted(str(p.relative_to(ROOT)) for p in PKG.rglob('*.py'))
    assert sorted(rows) == files
