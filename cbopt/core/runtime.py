"""What the engine remembers about an optimizer between steps (kept off the optimizer, so that pickling and deepcopy
never see it), and warnings that point at the user's line."""
from __future__ import annotations

import os
import sys
import warnings
import weakref

import torch

__all__ = ['runtime', 'param_states', 'wrapped', 'forget_state', 'warn_once', 'user_stacklevel']


class Runtime:
    "An optimizer's engine memory: warnings given, layouts seen, runners chosen and timed."
    def __init__(self):
        self.warned: set = set()
        self.seen: set = set()        # layouts stepped once eagerly (the fused runner compiles from the next step)
        self.no_compile: set = set()  # layouts whose chain did not compile
        self.per_param: set = set()   # layouts whose chain failed the foreach probe: they run param by param
        self.checked: set = set()     # chains checked for two callbacks creating one state entry
        self.auto_times: dict = {}    # layout -> {'foreach': [s, ...], 'loop': [s, ...], 'compiled': [...] (large)}
        self.compiled: set = set()    # layouts whose compiled chain `auto` compiled (its first call, untimed)
        self.flat_aliases: dict = {}  # layout -> the compiled chain's flat aliases kept between steps (`engine.flat.flat_inputs`)
        self.bucket_plan = None       # the last step's buckets, checked at the next (`buckets.planned_buckets`)
        self.device_counts = False    # some step counts are tensors on the device (`engine.dispatch.kernel_step_on_device`)
        self.own_step = None          # (descriptor, the function `opt.step` is bound to: `engine.own_step`)


def param_states(opt) -> dict:
    """The optimizer's per-param state dicts as the engine keeps them, by cbopt's names (`grad_avg`, `step` a Python
    number): `opt.state` itself, but for `cbopt.optim`'s classes, whose `opt.state` shows each param's state as their
    torch class keeps it (`exp_avg`, `step` a tensor: `cbopt.state.torch_view`) over these same dicts. Every reader
    and writer inside cbopt goes through here, so the renaming costs the engine nothing."""
    opt = wrapped(opt)
    d = opt.__dict__.get('state')
    return opt.state if d is None else d


def wrapped(opt):
    """The optimizer behind a wrapper that is a dynamic subclass of its class and holds it as `_optimizer`
    (Lightning's `LightningOptimizer`: a cbopt method called through it runs with the wrapper as `self`), else `opt`."""
    inner = opt.__dict__.get('_optimizer') if hasattr(opt, '__dict__') else None
    return inner if isinstance(inner, torch.optim.Optimizer) and inner is not opt else opt


_RUNTIME: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def runtime(opt) -> Runtime:
    opt = wrapped(opt)
    if opt not in _RUNTIME: _RUNTIME[opt] = Runtime()
    return _RUNTIME[opt]


def forget_state(opt) -> None:
    """Drop what the engine holds of `opt`'s state between steps (the bucket plan's state dicts, the compiled chain's
    flat aliases of state tensors): once the state is loaded or cleared, they would keep the old tensors alive until
    the next step, twice the state's memory where a checkpoint is loaded to resume."""
    rt = _RUNTIME.get(wrapped(opt))
    if rt is not None:
        rt.bucket_plan = None
        rt.flat_aliases.clear()


_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (sys.modules['cbopt'], torch))


def user_stacklevel() -> int:
    "The `stacklevel` of the first caller outside cbopt and torch (an LR scheduler's or torch's hook wrappers)."
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def warn_once(opt, key, msg: str) -> None:
    "Warn once per optimizer and `key`, at the user's line."
    rt = runtime(opt)
    if key not in rt.warned:
        rt.warned.add(key)
        warnings.warn(msg, stacklevel=user_stacklevel())
