"""cbopt: callback-composed optimizers for PyTorch, fastai-style, with named (FQN) state."""
__version__ = "0.1.0"

from .chain import cb_defaults, chain_name, init_chain_state
from .callbacks import *
from .callbacks import __all__ as _callbacks_all
from .hypers import Hypers, ParamGroup
from .engine import BACKENDS, Backend
from .optimizer import Optimizer
from .optimizers import *
from .optimizers import __all__ as _optimizers_all
from .torch_callbacks import *
from .torch_callbacks import __all__ as _torch_callbacks_all
from .torch_optimizers import *
from .torch_optimizers import __all__ as _torch_optimizers_all
from .modern_callbacks import *
from .modern_callbacks import __all__ as _modern_callbacks_all
from .modern_optimizers import *
from .modern_optimizers import __all__ as _modern_optimizers_all
from .kahan import kahan, kahan_chain
from .tensorlist import BucketError, TensorList
from .model_callbacks import *
from .model_callbacks import __all__ as _model_callbacks_all
from .warmup import GradientClipping, WarmupPolicy, WarmupStage
from .wrappers import Accumulate, GradientClippingOptimizer, SkipNonFinite, WarmupOptimizer
from .combined import CombinedOptimizer
from .lbfgs import LBFGS, lbfgs
from .in_backward import InBackward
from .pure import FunctionalError, FunctionalOptimizer, functional
from . import optim
from .integrations import fastai as _fastai_integration  # registers its hooks; imports fastai only if the user has
from .integrations import zero as _zero_integration  # registers its hook; imports nothing of torch.distributed

__all__ = ['Optimizer', 'cb_defaults', 'chain_name', 'init_chain_state', 'Hypers', 'ParamGroup', 'BACKENDS', 'Backend',
           'TensorList', 'BucketError', 'kahan', 'kahan_chain', 'CombinedOptimizer', 'LBFGS', 'lbfgs', 'InBackward', *_callbacks_all, *_optimizers_all,
           *_torch_callbacks_all, *_torch_optimizers_all, *_modern_callbacks_all, *_modern_optimizers_all,
           *_model_callbacks_all,
           'GradientClipping', 'WarmupPolicy', 'WarmupStage', 'GradientClippingOptimizer', 'WarmupOptimizer',
           'SkipNonFinite', 'Accumulate', 'functional', 'FunctionalOptimizer', 'FunctionalError']
