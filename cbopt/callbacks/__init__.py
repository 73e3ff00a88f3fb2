"""Every step callback cbopt ships, one small function each with its declarations: fastai's (`fastai`), those
torch.optim's other algorithms need (`torch_optim`), the modern optimizers' (`modern`), whole-model callbacks
(`whole_model`), torchrec's warmup schedules and their callback (`schedules`), Kahan-compensated updates
(`compensated`), L-BFGS (`quasi_newton`) and Composer's decay (`composer`)."""
from .fastai import *
from .fastai import __all__ as _fastai_all
from .compensated import kahan, kahan_chain
from .composer import fully_decoupled_wd
from .quasi_newton import lbfgs
from .modern import *
from .modern import __all__ as _modern_all
from .torch_optim import *
from .torch_optim import __all__ as _torch_all
from .schedules import GradientClipping, WarmupPolicy, WarmupStage, warmup
from .whole_model import *
from .whole_model import __all__ as _whole_model_all

__all__ = [*_fastai_all, *_torch_all, *_modern_all, *_whole_model_all, 'kahan', 'kahan_chain', 'fully_decoupled_wd', 'lbfgs', 'warmup',
           'GradientClipping', 'WarmupPolicy', 'WarmupStage']

from .._compat import falls_back_to as _falls_back_to
__getattr__ = _falls_back_to(__name__, 'fastai')  # the names of the module `cbopt.callbacks` was, for old pickles
