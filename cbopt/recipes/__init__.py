"""Prebuilt optimizers, each a short list of callbacks: fastai's (`fastai`), torch.optim's other algorithms with
torch's defaults (`torch_optim`), the modern ones with their reference packages' defaults (`modern`), L-BFGS
(`lbfgs`) and MosaicML Composer's decoupled-decay SGD and AdamW (`composer`)."""
from .composer import *
from .composer import __all__ as _composer_all
from .fastai import *
from .fastai import __all__ as _fastai_all
from .lbfgs import LBFGS
from .modern import *
from .modern import __all__ as _modern_all
from .torch_optim import *
from .torch_optim import __all__ as _torch_all

__all__ = [*_fastai_all, *_composer_all, *_torch_all, *_modern_all, 'LBFGS']
