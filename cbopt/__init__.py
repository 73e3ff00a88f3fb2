"""cbopt: callback-composed optimizers for PyTorch, fastai-style, with named (FQN) state.

The public API is here (`cbopt.Adam`, `cbopt.Optimizer`, `cbopt.average_grad`, ...); torch.optim's drop-in classes
are `cbopt.optim`. The package, by role: `core` (the callback protocol, hypers, params, names), `callbacks`,
`recipes` (prebuilt optimizers), `optimizer` (the one generic `Optimizer`), `wrappers`, `engine` (how a step runs),
`state` (checkpoints), `functional` (pure init/update), `optim`, `integrations`, `testing`, `cli`.
"""
__version__ = "0.1.0"

from .core.chain import cb_defaults, chain_name, init_chain_state
from .core.hypers import Hypers, ParamGroup
from .core.tensorlist import BucketError, TensorList
from .callbacks import *
from .callbacks import __all__ as _callbacks_all
from .engine import BACKENDS, Backend
from .optimizer import Optimizer
from .recipes import *
from .recipes import __all__ as _recipes_all
from .wrappers import *
from .wrappers import __all__ as _wrappers_all
from . import functional
from .functional import FunctionalError, FunctionalOptimizer
from . import optim
from .integrations import fastai as _fastai_integration  # registers its hooks; imports fastai only if the user has
from .integrations import zero as _zero_integration  # registers its hook; imports nothing of torch.distributed
from ._compat import install_aliases as _install_aliases

__all__ = ['Optimizer', 'cb_defaults', 'chain_name', 'init_chain_state', 'Hypers', 'ParamGroup', 'BACKENDS', 'Backend',
           'TensorList', 'BucketError', *_callbacks_all, *_recipes_all, *_wrappers_all,
           'functional', 'FunctionalOptimizer', 'FunctionalError']

__getattr__, __dir__ = _install_aliases(__name__, globals())
