"""cbopt: callback-composed optimizers for PyTorch, fastai-style, with named (FQN) state."""
__version__ = "0.1.0"

from .callbacks import *
from .callbacks import __all__ as _callbacks_all
from .hypers import Hypers, ParamGroup
from .optimizer import Optimizer, cb_defaults
from .backends import BACKENDS
from .optimizers import *
from .optimizers import __all__ as _optimizers_all
from .tensorlist import BucketError, TensorList

__all__ = ['Optimizer', 'cb_defaults', 'Hypers', 'ParamGroup', 'BACKENDS', 'TensorList', 'BucketError',
           *_callbacks_all, *_optimizers_all]
