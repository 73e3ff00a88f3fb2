"""torchrec's warmup schedules (`WarmupPolicy`, `WarmupStage`) and clipping modes (`GradientClipping`), as pure logic.

Same names, enum values, fields and defaults as `torchrec.optim` 1.8/1.9, and the same lr sequence step for step, so
a torchrec config ports unchanged. A wrapper only has to do this (torchrec's iteration convention):

    sched = WarmupSchedule(stages)                 # validates: a bad stage fails here, not mid-training
    set_lr(lr * sched.multiplier(0))               # at construction: the first step already runs with t=0's lr
    def step():                                    # t is a global counter: 0 at construction, never reset
        inner.step()                               # the step runs with the lr set for the current t...
        t += 1                                     # ...then the counter advances...
        s, m = sched(t); set_lr(lr * m)            # ...and the lr for the next step is set (store (t, s) to resume)

So the k-th step (counting from 0) runs with `multiplier(k)`, and after k steps the counter is k. The lr is written
to every param group (torchrec overwrites per-group lr ratios too). Resuming only needs t: `sched(t)` re-derives the
stage, which equals the stage torchrec stores since stages switch once t passes a stage's `max_iters`.

Stage switching: `max_iters` are cumulative (each stage ends at the global t = its max_iters, inclusive), and after
the last stage a NONE stage (multiplier 1.0, lr_scale 1.0) runs forever; its index is `len(stages)`. Every formula
uses the *global* t, so e.g. a POLY stage after a LINEAR one does not start at 1.

Where torchrec is awkward this module does better (every schedule it accepts gives torchrec's lrs bit for bit):
- the stages you pass are never mutated (torchrec resolves `decay_iters <= 0` by writing into them);
- bad stages raise `TypeError`/`ValueError` naming `stages[i].field`, instead of `AssertionError` or a crash later
  (iteration fields must be ints: torchrec also runs float ones);
- INVSQRT as the first stage (1/sqrt(0) at t=0: torchrec's `ZeroDivisionError`) is a `ValueError` up front;
- POLY with `decay_iters < max_iters` (1 - t/D < 0 inside the stage: a negative or rising lr, or torchrec's
  `ValueError: math domain error` mid-training) and POLY with a negative power reaching 0**-v are rejected up front.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, unique
from numbers import Integral, Real

__all__ = ['WarmupPolicy', 'WarmupStage', 'GradientClipping', 'WarmupSchedule', 'warmup_multiplier', 'warmup']


@unique
class WarmupPolicy(Enum):
    "How a stage's lr multiplier m(t) moves with the global step count t (see `warmup_multiplier`)."
    NONE = "none"
    LINEAR = "linear"
    CONSTANT = "constant"
    POLY = "poly"
    STEP = "step"
    INVSQRT = "inv_sqrt"
    COSINE_ANNEALING_WARM_RESTARTS = "cosine_annealing_warm_restarts"
    INTERPOLATE = "interpolate"


@dataclass
class WarmupStage:
    """One stage of a warmup schedule, active up to the global step `max_iters` (inclusive); torchrec's fields.

    `value` is the policy's parameter (LINEAR's start, CONSTANT's level, POLY's power, STEP's factor, COSINE's eta_min,
    INTERPOLATE's value at `start_interpolating_iters`). `decay_iters <= 0` means 1 for STEP, `max_iters` otherwise.
    """
    policy: WarmupPolicy = WarmupPolicy.LINEAR
    max_iters: int = 1
    value: float = 1.0
    lr_scale: float = 1.0
    decay_iters: int = -1                           # POLY's horizon, STEP's step size
    sgdr_period: int = 1                            # COSINE_ANNEALING_WARM_RESTARTS's period (no T_mult)
    start_interpolating_iters: int | None = None    # INTERPOLATE only
    end_value: float | None = None                  # INTERPOLATE only: the multiplier at max_iters


@unique
class GradientClipping(Enum):
    """torchrec's clipping modes. NORM scales all grads by min(1, max_gradient / (total_norm + 1e-6)) (pre-clip norm
    over all params, `norm_type`); VALUE clamps each element to [-max_gradient, max_gradient]; NONE does nothing."""
    NORM = "norm"
    VALUE = "value"
    NONE = "none"


_FINAL = WarmupStage(policy=WarmupPolicy.NONE, max_iters=1 << 63, value=1.0)  # torchrec's stage after the last


def _is_int(x) -> bool: return isinstance(x, Integral) and not isinstance(x, bool)
def _is_real(x) -> bool: return isinstance(x, Real) and not isinstance(x, bool)


def _checked(stages: Sequence[WarmupStage]) -> list[WarmupStage]:
    "Validated copies of `stages` with `decay_iters` resolved, plus the final NONE stage."
    if isinstance(stages, WarmupStage):
        raise TypeError("warmup stages must be a list of WarmupStage, got one WarmupStage")
    out, prev = [], 0
    for i, st in enumerate(stages):
        def bad(field, msg, exc=ValueError):
            return exc(f"warmup stages[{i}].{field} {msg}" if field else f"warmup stages[{i}] {msg}")
        if not isinstance(st, WarmupStage): raise bad('', f"must be a WarmupStage, got {type(st).__name__}", TypeError)
        p = st.policy
        if not isinstance(p, WarmupPolicy): raise bad('policy', f"must be a WarmupPolicy, got {p!r}", TypeError)
        for f in ('max_iters', 'decay_iters', 'sgdr_period'):
            if not _is_int(getattr(st, f)): raise bad(f, f"must be an int, got {getattr(st, f)!r}", TypeError)
        for f in ('value', 'lr_scale'):
            if not _is_real(getattr(st, f)): raise bad(f, f"must be a real number, got {getattr(st, f)!r}", TypeError)
        M = st.max_iters
        if M <= prev:
            raise bad('max_iters', f"must be greater than {f'stages[{i-1}].max_iters ({prev})' if i else '0'} "
                                   f"(max_iters are cumulative step counts), got {M}")
        D = st.decay_iters if st.decay_iters > 0 else (1 if p is WarmupPolicy.STEP else M)
        if p is WarmupPolicy.INVSQRT and i == 0:
            raise bad('policy', "INVSQRT cannot be the first stage: its multiplier 1/sqrt(t) is infinite at t=0, the "
                                "lr of the first step (put e.g. a LINEAR warmup stage before it)")
        if p is WarmupPolicy.POLY:
            if D < M: raise bad('decay_iters', f"must be >= max_iters ({M}) for POLY, got {D}: (1 - t/decay_iters) "
                                               "would go negative inside the stage")
            if st.value < 0 and D == M:
                raise bad('value', f"must be >= 0 for POLY when decay_iters == max_iters, got {st.value}: the "
                                   "multiplier (1 - t/decay_iters)**value is 0**value at t=max_iters")
        if p is WarmupPolicy.COSINE_ANNEALING_WARM_RESTARTS and st.sgdr_period <= 0:
            raise bad('sgdr_period', f"must be > 0 for COSINE_ANNEALING_WARM_RESTARTS, got {st.sgdr_period}")
        if p is WarmupPolicy.INTERPOLATE:
            S, e = st.start_interpolating_iters, st.end_value
            if not _is_int(S):
                raise bad('start_interpolating_iters', f"must be an int for INTERPOLATE, got {S!r}", TypeError)
            if not _is_real(e): raise bad('end_value', f"must be a real number for INTERPOLATE, got {e!r}", TypeError)
            if S >= M: raise bad('start_interpolating_iters', f"must be < max_iters ({M}) for INTERPOLATE, got {S}")
        out.append(dataclasses.replace(st, decay_iters=D))
        prev = M
    return out + [dataclasses.replace(_FINAL)]


def _multiplier(st: WarmupStage, t: int) -> float:
    "torchrec's formula for stage `st` at global step t, times its lr_scale (decay_iters already resolved)."
    p, v = st.policy, st.value
    if p is WarmupPolicy.LINEAR: m = v + (1.0 - v) * t / st.max_iters               # v at t=0 -> 1 at max_iters
    elif p is WarmupPolicy.CONSTANT: m = v
    elif p is WarmupPolicy.POLY: m = math.pow(1 - t / st.decay_iters, v)
    elif p is WarmupPolicy.STEP: m = math.pow(v, t // st.decay_iters)                # times v every decay_iters
    elif p is WarmupPolicy.INVSQRT: m = 1.0 / math.sqrt(t)
    elif p is WarmupPolicy.COSINE_ANNEALING_WARM_RESTARTS:                            # SGDR, restarts every period
        P = st.sgdr_period
        m = v + (1.0 - v) * 0.5 * (1 + math.cos(math.pi * (t % P) / P))
    elif p is WarmupPolicy.INTERPOLATE:                                               # not clamped: extrapolates
        S = st.start_interpolating_iters
        m = v + (st.end_value - v) * (t - S) / (st.max_iters - S)
    else: m = 1.0                                                                     # NONE
    return m * st.lr_scale


class WarmupSchedule:
    """A validated list of stages, mapping the global step count t to (stage index, lr multiplier) as torchrec does.

    `stages` holds validated copies (decay_iters resolved) plus the final NONE stage, index `len(input stages)`.
    """
    def __init__(self, stages: Sequence[WarmupStage]):
        self.stages: list[WarmupStage] = _checked(stages)
        self._ends = [st.max_iters for st in self.stages]

    def stage(self, t: int) -> int:
        "The index of the stage active at step t: the first whose max_iters >= t."
        if not _is_int(t) or t < 0: raise ValueError(f"warmup step count must be an int >= 0, got {t!r}")
        return min(bisect.bisect_left(self._ends, t), len(self.stages) - 1)

    def multiplier(self, t: int) -> float:
        "The lr multiplier (lr_scale included) at step t: the wrapper sets lr = base_lr * multiplier(t)."
        return self(t)[1]

    def __call__(self, t: int) -> tuple[int, float]:
        s = self.stage(t)
        return s, _multiplier(self.stages[s], t)

    def __repr__(self) -> str: return f"WarmupSchedule({self.stages[:-1]!r})"


def warmup_multiplier(stages: Sequence[WarmupStage], t: int) -> float:
    "The lr multiplier of `stages` at global step t (validating the stages on every call; keep a `WarmupSchedule`)."
    return WarmupSchedule(stages).multiplier(t)


def warmup(params, groups, schedule: WarmupSchedule, lr_param='lr', iter=0, **kwargs):
    """torchrec's warmup: the step counted `iter` (0 first) runs with each group's `lr_param` times the schedule's
    multiplier at `iter`. The group's own value stays the base (what schedulers and fastai set), so they compose
    multiplicatively; the lr used is in `opt.step_stats['lr']`."""
    m = schedule.multiplier(iter)
    return {'hypers': [{lr_param: g[lr_param] * m} for g in groups], 'iter': iter + 1, 'lr_multiplier': m}
warmup.scope = 'model'
warmup.state = dict(iter=0)
warmup.transient = ('lr_multiplier',)
