"""Each optimizer's `step` under a code object of its own, so that optimizers compiled in one process do not interfere.

dynamo keeps what it compiled per code object, for the whole process: its cache entries (at most
`torch._dynamo.config.recompile_limit`, 8, per code object; past that it runs the frame eagerly, or fails under
`fullgraph=True`) and its automatic-dynamic marks (a size seen to change becomes symbolic for every later compile of
that code). `torch.compile(opt.step)` starts at the frame of the function `opt.step` is, and for every
`torch.optim.Optimizer` that is torch's hook wrapper, one code object shared by every optimizer in the process: the
ninth optimizer compiled hits the limit, and one optimizer's sizes can make another's graph dynamic.

`OwnStep` gives each optimizer its own copy of a small trampoline's code (as `engine.compiled` gives each compiled
chain its own), which calls the step through torch's hook wrapper: its hooks, profiling and LR-scheduler tracking
run as before, inlined into the caller's graph by dynamo, and every optimizer compiles as it would alone. torch's
`_patch_step_function` sees the descriptor's `hooked` flag and leaves it alone. The copy is kept in the engine's
runtime memory of the optimizer, never in its `__dict__`: pickles and deep copies are unchanged, and a copy gets its
own. Where the user wraps the step (an LR scheduler sets `opt.step` on the instance; a compiled train step of their
own) the outermost frame is theirs, as with torch's optimizers.
"""
from __future__ import annotations

import functools
import itertools
import types
from collections.abc import Callable

import torch

from ..core.runtime import runtime

__all__ = ['OwnStep']

_COUNT = itertools.count()


def _trampoline(target: Callable) -> types.FunctionType:
    "A function calling `target` with its arguments, under a code object made for it alone."
    def step(self, *args, **kwargs): return target(self, *args, **kwargs)
    code = step.__code__.replace(co_name=f'cbopt_step_{next(_COUNT)}')
    fn = types.FunctionType(code, step.__globals__, 'step', None, step.__closure__)
    return functools.update_wrapper(fn, target)  # (name, docstring, and the signature of the step through __wrapped__)


class OwnStep:
    """A method descriptor for `Optimizer.step`: each optimizer's `opt.step` is bound to a function of its own code
    (see the module docstring), which runs `fn` under torch's step hooks."""
    hooked = True  # torch's `Optimizer._patch_step_function`: the hooks are already run (`self.hooked_fn`)

    def __init__(self, fn: Callable):
        self.fn = fn
        self.hooked_fn = torch.optim.Optimizer.profile_hook_step(fn)
        functools.update_wrapper(self, fn)

    def __get__(self, opt, cls=None):
        if opt is None: return self
        if torch.compiler.is_compiling(): return functools.partial(self.hooked_fn, opt)  # (inlined in the caller's frame)
        rt = runtime(opt)
        if rt.own_step is None or rt.own_step[0] is not self: rt.own_step = (self, _trampoline(self.hooked_fn))
        return types.MethodType(rt.own_step[1], opt)

    def __call__(self, opt, *args, **kwargs):
        "`Optimizer.step(opt, ...)`, as called on the class."
        return self.__get__(opt)(*args, **kwargs)
