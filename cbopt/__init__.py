"""cbopt: callback-composed optimizers for PyTorch, fastai-style, with named (FQN) state.

The public API is here (`cbopt.Adam`, `cbopt.Optimizer`, `cbopt.average_grad`, ...); torch.optim's drop-in classes
are `cbopt.optim`. `cbopt.ZeroRedundancyOptimizer` (torch's ZeRO for cbopt optimizers) is imported on first use,
since it imports torch.distributed's optim; it is in `dir(cbopt)` but not in `__all__`, so that `from cbopt import *`
does not import it. The package, by role: `core` (the callback protocol, hypers, params, names), `callbacks`,
`recipes` (prebuilt optimizers), `optimizer` (the one generic `Optimizer`), `wrappers`, `engine` (how a step runs),
`state` (checkpoints), `functional` (pure init/update), `optim`, `integrations`, `testing`, `cli`.
"""
__version__ = "0.1.0"

from .core.chain import cb_defaults, chain_name, init_chain_state
from .core.grouping import param_groups_weight_decay
from .core.hypers import Hypers, ParamGroup
from .core.tensorlist import BucketError, TensorList
from .callbacks import *
from .callbacks import __all__ as _callbacks_all
from .engine import BACKENDS, Backend
from .optimizer import Optimizer
from .state import PRECISIONS, state_bytes
from .recipes import *
from .recipes import __all__ as _recipes_all
from .wrappers import *
from .wrappers import __all__ as _wrappers_all
from . import functional
from .functional import FunctionalError, FunctionalOptimizer
from . import optim
from .integrations import fastai as _fastai_integration  # registers its hooks; imports fastai only if the user has
from ._compat import install_aliases as _install_aliases

__all__ = ['Optimizer', 'cb_defaults', 'chain_name', 'init_chain_state', 'param_groups_weight_decay', 'Hypers', 'ParamGroup', 'BACKENDS', 'Backend',
           'TensorList', 'BucketError', *_callbacks_all, *_recipes_all, *_wrappers_all,
           'functional', 'FunctionalOptimizer', 'FunctionalError', 'PRECISIONS', 'state_bytes']

_old_path, _dir = _install_aliases(__name__, globals())
LAZY = ('ZeroRedundancyOptimizer',)  # public, but imported on first use: it imports torch.distributed's optim


def __getattr__(name: str):
    "`cbopt.ZeroRedundancyOptimizer` (imported on first use), or an old module path (`cbopt.hypers`: `_compat`)."
    if name == 'ZeroRedundancyOptimizer':
        from .integrations.zero import ZeroRedundancyOptimizer
        return ZeroRedundancyOptimizer
    return _old_path(name)


def __dir__() -> list[str]: return sorted({*_dir(), *LAZY})
