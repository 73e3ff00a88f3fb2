"""The registry (`cases.py`) is complete: every optimizer that `cbopt` and `cbopt.optim` export is built by one of its
cases, so that every registry-wide test (backends, parity, resume, functional, complex, drop-in) builds it.

What counts as an optimizer: each prebuilt optimizer (`cbopt.recipes.__all__`), the generic `cbopt.Optimizer`, every
drop-in class of `cbopt.optim`. What does not, each with the reason and where it is tested instead: `NOT_CASES`. A
case covers an export when building the case calls it (checked by spying on the export, not declared)."""
import functools
import warnings

import pytest
import torch

import cbopt
import cbopt.optim
from cases import CASES
from conftest import make_model, train, two_groups

# exports that are not an algorithm config of their own: why, and where their tests are
NOT_CASES = {
    'adam_chain': "a chain builder (returns callbacks): every Adam-family case runs it",
    'sgd_chain': "a chain builder (returns callbacks): every SGD case runs it",
    'adagrad_chain': "a chain builder (returns callbacks): the Adagrad case runs it",
    'muon_chain': "a chain builder (returns callbacks): the Muon cases run it",
    'decoupled_adamw_chain': "a chain builder (returns callbacks): the composer-adamw case runs it",
    'lookahead': "a chain builder (wraps callbacks): the Lookahead and ranger cases run it",
    'maximizing': "a chain builder (wraps callbacks): the maximize cases run it",
    'is_hidden_matrix': "Muon's param filter, not an optimizer: the Muon case runs it",
    'CombinedOptimizer': "wraps optimizers (any cases'): tests/test_combined.py",
    'InBackward': "wraps an optimizer (any case's): tests/test_in_backward.py",
    'GradientClippingOptimizer': "wraps an optimizer (any case's): tests/test_wrappers.py",
    'WarmupOptimizer': "wraps an optimizer (any case's): tests/test_wrappers.py",
    'SkipNonFinite': "wraps an optimizer (any case's): tests/test_wrappers.py",
    'Accumulate': "wraps an optimizer (any case's): tests/test_wrappers.py",
    'FunctionalOptimizer': "a case's chain as pure functions: tests/test_functional.py runs every case through it",
    'SparseAdam': "steps sparse grads only, and the registry's tests give dense ones: tests/test_optim.py follows torch's "
                  "SparseAdam on sparse embedding grads",
}


def optimizer_exports() -> dict[str, list[str]]:
    "The names each module exports that the registry must cover or `NOT_CASES` must explain, by module."
    import cbopt.recipes
    import cbopt.wrappers
    ours = [*cbopt.recipes.__all__, *cbopt.wrappers.__all__]
    ours += [n for n in cbopt.__all__ if isinstance(getattr(cbopt, n), type)
             and issubclass(getattr(cbopt, n), (torch.optim.Optimizer, cbopt.FunctionalOptimizer))]
    return {'cbopt': sorted(set(ours)), 'cbopt.optim': sorted(cbopt.optim.__all__)}


def test_every_export_has_a_case(monkeypatch):
    """Build every case (and its drop-in twin) with each export spied on: every optimizer export is called by some
    case, or is in `NOT_CASES` with its reason (and then no case needs it)."""
    exports = optimizer_exports()
    called: set[tuple[str, str]] = set()

    def spy(module, name):
        real = getattr(module, name)

        @functools.wraps(real)
        def recorded(*args, **kwargs):
            called.add((module.__name__, name))
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, recorded)

    for mod, names in exports.items():
        for n in names:
            if n not in NOT_CASES: spy(cbopt if mod == 'cbopt' else cbopt.optim, n)
    for c in CASES:
        c.build(list(make_model().parameters()), 1e-2, 'loop')
        if c.optim is not None: c.optim(list(make_model().parameters()), 1e-2)
    missing = [f'{mod}.{n}' for mod, names in exports.items() for n in names
               if n not in NOT_CASES and (mod, n) not in called]
    assert not missing, f"no case in tests/cases.py builds {missing}: add one (or say why not in NOT_CASES)"
    stale = sorted(set(NOT_CASES) - set(exports['cbopt']) - set(exports['cbopt.optim']))
    assert not stale, f"NOT_CASES names {stale}, which are no longer exported"


def test_every_drop_in_twin_is_torchs_config():
    "A case's drop-in (`optim`) builds the same class as its torch reference, so the two compare like for like."
    for c in (c for c in CASES if c.optim is not None):
        ps = list(make_model().parameters())
        ours, theirs = c.optim(ps, 1e-2), c.torch(list(make_model().parameters()), 1e-2)
        assert type(ours).__name__ == type(theirs).__name__, c.id
        assert isinstance(ours, cbopt.Optimizer) and type(ours).__module__ == 'cbopt.optim', c.id


def test_gaps_name_real_tests():
    "Every gap names a test function that exists: a renamed test would otherwise run the case again, unseen."
    from pathlib import Path
    source = '\n'.join(f.read_text() for f in Path(__file__).parent.glob('test_*.py'))
    for c in CASES:
        unknown = sorted(n for n in c.gaps if f'def {n}(' not in source)
        assert not unknown, f"{c.id}: its gaps name no test function: {unknown}"


@pytest.mark.parametrize('c', CASES, ids=str)
def test_per_param_python_flag(c):
    """`Case.per_param_python` is what foreach does: a case without the flag steps whole buckets (no per-param
    fallback warning over 3 steps); one with it falls back, with the warning."""
    model = make_model()
    opt = c.build(two_groups(model), 1e-2, 'foreach')
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter('always')
        train(opt, model, 3)
    fell_back = any('cannot run on a whole bucket' in str(w.message) for w in seen)
    assert fell_back == c.per_param_python, f"{c.id}: foreach fell back param by param: {fell_back}"
