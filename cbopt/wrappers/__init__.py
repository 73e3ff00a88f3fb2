"""Optimizers around optimizers: an optimizer's chains with a whole-model callback in front (`whole_model`:
torchrec's `GradientClippingOptimizer` and `WarmupOptimizer`, `SkipNonFinite`, `Accumulate`), several optimizers as
one (`combined`), and stepping each param in its backward hook (`in_backward`)."""
from .combined import CombinedOptimizer
from .in_backward import InBackward
from .whole_model import Accumulate, GradientClippingOptimizer, SkipNonFinite, WarmupOptimizer

__all__ = ['CombinedOptimizer', 'InBackward', 'Accumulate', 'GradientClippingOptimizer', 'SkipNonFinite',
           'WarmupOptimizer']

from .._compat import falls_back_to as _falls_back_to
__getattr__ = _falls_back_to(__name__, 'whole_model')  # the names of the module `cbopt.wrappers` was, for old pickles
