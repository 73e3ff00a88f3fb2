"""The engine: how an `Optimizer`'s step runs each group's callback chain over its params, with the same math
(the callbacks') in every backend.

- `loop`: each callback once per param (fastai's way, and the reference the others are tested against).
- `foreach`: each callback once per bucket of params on `TensorList` stand-ins: `torch._foreach_*` kernels.
- `fused`: the whole chain in one pass per bucket: torch's fused kernel when one computes exactly the chain
  (`kernels`), otherwise the chain compiled with `torch.compile` (`compiled`).
- `auto`: torch's kernel if one matches, else foreach on accelerators, else the fastest of foreach, loop and (a
  large bucket of an elementwise chain) the compiled chain, as timed on the first steps (CPU); see `auto`.

Files: `backend` (`Backend`), `step` (a step's entry, eager or traced), `model_stage` (the whole-model callbacks),
`dispatch` (buckets to runners, grad checks), `scaling`, `buckets` (which params one call serves), `foreach` (loop
and foreach runners, the probe), `compiled` (the chain through `torch.compile`), `scalars` (hypers as graph inputs),
`flat` (flat runs and packing), `kernels` (torch's fused kernels), `auto`, `traced`.

A step: `check_grads`; the whole-model callbacks listed at the start of the chains (each once, over the params of
every group listing it, with the hypers of the first such group); the buckets; the whole-model callbacks listed at
the end. A whole-model callback returning `skip=True` ends the step there: no per-param callback runs, and no state
changes but that callback's own (earlier ones' returned state is dropped). What the step used is `opt.step_stats`.
"""
from ..core.runtime import forget_state
from .backend import BACKENDS, Backend, as_backend
from .buckets import Bucket
from .dispatch import check_grads
from .kernels import has_kernel, register_kernel
from .model_stage import init_model_state, model_plan
from .step import run_step

__all__ = ['BACKENDS', 'Backend', 'as_backend', 'run_step', 'register_kernel', 'has_kernel', 'Bucket', 'model_plan',
           'init_model_state', 'check_grads', 'forget_state']
