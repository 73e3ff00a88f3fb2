"""Old module paths, kept working: pickles of whole optimizers taken before the package was laid out by role name
the modules their classes and callbacks lived in (`cbopt.hypers.Hypers`, `cbopt.torch_callbacks.adagrad_step`), and
`cbopt.chain` / `cbopt.dtensor` are documented submodules. Each old name is an alias of the module that holds the
code now (the same module object, so `cbopt.chain.zeros is cbopt.core.chain.zeros`). Checkpoints (state_dicts) name
callbacks, not modules: they never needed this."""
from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable

__all__ = ['MOVED', 'install_aliases', 'falls_back_to']

MOVED = {  # old path -> where its code is now
    'chain': 'core.chain', 'hypers': 'core.hypers', 'params': 'core.params', 'tensorlist': 'core.tensorlist',
    'dtensor': 'core.dtensor', 'state.names': 'core.names', 'state.flags': 'core.flags',
    'engine.runtime': 'core.runtime', 'torch_callbacks': 'callbacks.torch_optim', 'modern_callbacks': 'callbacks.modern',
    'model_callbacks': ('callbacks.whole_model', 'callbacks.schedules'), 'warmup': 'callbacks.schedules', 'kahan': 'callbacks.compensated',
    'lbfgs': ('callbacks.quasi_newton', 'recipes.lbfgs'), 'optimizers': 'recipes.fastai', 'torch_optimizers': 'recipes.torch_optim',
    'modern_optimizers': 'recipes.modern', 'combined': 'wrappers.combined', 'in_backward': 'wrappers.in_backward',
    'pure': 'functional',
}
DOCUMENTED = ('chain', 'dtensor')  # old top-level names that stay in dir(cbopt)


def _module(name: str, homes: list[str]) -> types.ModuleType:
    "The module now at `homes[0]`, or, where an old module's code went to several, a module that looks in each."
    if len(homes) == 1: return importlib.import_module(homes[0])
    shim = types.ModuleType(name, f"Old path of {', '.join(homes)} (see cbopt._compat).")
    def __getattr__(attr: str):
        for home in homes:
            if hasattr(module := importlib.import_module(home), attr): return getattr(module, attr)
        raise AttributeError(f"module {name!r} has no attribute {attr!r}")
    shim.__getattr__ = __getattr__
    return shim


def install_aliases(package: str, namespace: dict) -> tuple[Callable, Callable]:
    """Register each old path in `sys.modules` (so `import cbopt.hypers` and unpickling find it) and return the
    package's `__getattr__` and `__dir__` (so `cbopt.hypers` resolves, while `dir(cbopt)` lists only the documented
    old names)."""
    for old, new in MOVED.items():
        sys.modules.setdefault(f"{package}.{old}", _module(f"{package}.{old}", [f"{package}.{n}" for n in
                                                                            ((new,) if isinstance(new, str) else new)]))
    top = {old: sys.modules[f"{package}.{old}"] for old in MOVED if '.' not in old}

    def __getattr__(name: str):
        if name in top: return top[name]
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]: return sorted({*namespace, *DOCUMENTED})
    return __getattr__, __dir__


def falls_back_to(package: str, module: str) -> Callable:
    """A package's `__getattr__` for the names (private ones too) of the module it replaced, now its submodule
    `module`: `cbopt.wrappers` was one module, whose helpers old pickles name (`cbopt.wrappers._no_clip`)."""
    def __getattr__(name: str):
        try: return getattr(importlib.import_module(f"{package}.{module}"), name)
        except AttributeError: raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
    return __getattr__
