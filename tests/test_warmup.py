"""cbopt.warmup against torchrec 1.8's lr sequences (as run and recorded in shared/notes/wrappers-and-distributed.md,
section A.5) and against torchrec's formulas and stateful stage switching, written again here independently."""
import math

import pytest

from cbopt.callbacks.schedules import GradientClipping, WarmupPolicy, WarmupSchedule, WarmupStage, warmup_multiplier

P = WarmupPolicy


def torchrec_walk(stages, n_steps, lr=1.0, formula=None):
    """torchrec's WarmupOptimizer loop: lr set at init for (t=0, s=0); each step then does t += 1, advances s at most
    once when t > stages[s].max_iters, and sets the lr. Returns the lr after init and after each step, and the (t, s)."""
    stages = list(stages) + [WarmupStage(P.NONE, max_iters=1 << 63, value=1.0)]
    t, s = 0, 0
    lrs, ts = [lr * formula(stages[s], t)], [(t, s)]
    for _ in range(n_steps):
        t += 1
        if t > stages[s].max_iters and s + 1 < len(stages): s += 1
        lrs.append(lr * formula(stages[s], t)); ts.append((t, s))
    return lrs, ts


def reference_formula(st, t):
    "torchrec's multiplier for one stage, as the notes state it (A.5), with its decay_iters defaults."
    v, c, M = st.value, st.lr_scale, st.max_iters
    D = st.decay_iters if st.decay_iters > 0 else (1 if st.policy == P.STEP else M)
    return c * {
        P.NONE: lambda: 1.0,
        P.LINEAR: lambda: v + (1 - v) * t / M,
        P.CONSTANT: lambda: v,
        P.POLY: lambda: (1 - t / D) ** v,
        P.STEP: lambda: v ** (t // D),
        P.INVSQRT: lambda: t ** -0.5,
        P.COSINE_ANNEALING_WARM_RESTARTS: lambda: v + (1 - v) * (1 + math.cos(math.pi * (t % st.sgdr_period) / st.sgdr_period)) / 2,
        P.INTERPOLATE: lambda: v + (st.end_value - v) * (t - st.start_interpolating_iters) / (M - st.start_interpolating_iters),
    }[st.policy]()


def ours(stages, n_steps):
    sched = WarmupSchedule(stages)
    return [sched(t) for t in range(n_steps + 1)]


# --- the sequences torchrec 1.8 produced (notes A.5: the lr after init, then after each step) ---

NOTES_SEQUENCES = {
    'linear': (1.0, [WarmupStage(P.LINEAR, max_iters=10, value=0.1)],
               [0.1, 0.19, 0.28, 0.37, 0.46, 0.55, 0.64, 0.73, 0.82, 0.91, 1.0, 1.0, 1.0]),
    'linear-poly-step-none': (1.0, [WarmupStage(P.LINEAR, max_iters=4, value=0.0), WarmupStage(P.POLY, max_iters=10, value=2.0),
                                    WarmupStage(P.STEP, max_iters=16, value=0.5, decay_iters=3)],
                              [0, .25, .5, .75, 1.0, .25, .16, .09, .04, .01, 0, .125, .0625, .0625, .0625, .03125, .03125, 1.0, 1.0]),
    'cosine': (1.0, [WarmupStage(P.COSINE_ANNEALING_WARM_RESTARTS, max_iters=8, value=.1, sgdr_period=4)],
               [1.0, .8682, .55, .2318, 1.0, .8682, .55, .2318, 1.0, 1.0]),
    'interpolate': (1.0, [WarmupStage(P.INTERPOLATE, max_iters=10, value=1, end_value=0, start_interpolating_iters=5)],
                    [2.0, 1.8, 1.6, 1.4, 1.2, 1.0, 0.8, 0.6, 0.4, 0.2, 0.0, 1.0]),
    'constant-lr_scale': (0.1, [WarmupStage(P.CONSTANT, max_iters=3, value=.5, lr_scale=2)], [0.1] * 6),
}


@pytest.mark.parametrize('name', NOTES_SEQUENCES)
def test_torchrec_verified_sequences(name):
    lr, stages, expected = NOTES_SEQUENCES[name]
    got = [lr * m for _, m in ours(stages, len(expected) - 1)]
    assert got == pytest.approx(expected, abs=1e-4)   # the notes round the cosine values to 4 digits
    if name != 'cosine':
        assert got == pytest.approx(expected, abs=1e-12)


def test_verified_stage_ids():
    "Notes: LINEAR(max_iters=10) stores tensor([12, 1]) after 12 steps (the appended NONE stage); the 3-stage run switches after t=4, 10, 16."
    assert WarmupSchedule([WarmupStage(P.LINEAR, max_iters=10, value=0.1)])(12)[0] == 1
    _, stages, _ = NOTES_SEQUENCES['linear-poly-step-none']
    assert [s for s, _ in ours(stages, 18)] == [0] * 5 + [1] * 6 + [2] * 6 + [3] * 2


# --- every policy, and switching, against the independent formulas and torchrec's stateful walk ---

SCHEDULES = {
    'none': [WarmupStage(P.NONE, max_iters=5, lr_scale=3.0)],
    'linear-scaled': [WarmupStage(P.LINEAR, max_iters=7, value=0.25, lr_scale=0.5)],
    'poly-own-decay': [WarmupStage(P.LINEAR, max_iters=3, value=0.0), WarmupStage(P.POLY, max_iters=9, value=1.5, decay_iters=12)],
    'step-default-decay': [WarmupStage(P.STEP, max_iters=6, value=0.9, lr_scale=2.0)],
    'invsqrt-later': [WarmupStage(P.LINEAR, max_iters=4, value=0.5), WarmupStage(P.INVSQRT, max_iters=12, lr_scale=2.0)],
    'cosine-scaled': [WarmupStage(P.CONSTANT, max_iters=2, value=0.3),
                      WarmupStage(P.COSINE_ANNEALING_WARM_RESTARTS, max_iters=15, value=0.2, sgdr_period=5, lr_scale=0.7)],
    'cosine-default-period': [WarmupStage(P.COSINE_ANNEALING_WARM_RESTARTS, max_iters=4, value=0.2)],
    'interpolate-later': [WarmupStage(P.CONSTANT, max_iters=3, value=0.1),
                          WarmupStage(P.INTERPOLATE, max_iters=9, value=0.5, end_value=2.0, start_interpolating_iters=6, lr_scale=1.5)],
    'all-eight': [WarmupStage(P.LINEAR, max_iters=2, value=0.2), WarmupStage(P.CONSTANT, max_iters=4, value=0.6),
                  WarmupStage(P.INVSQRT, max_iters=6), WarmupStage(P.POLY, max_iters=9, value=0.5),
                  WarmupStage(P.STEP, max_iters=13, value=0.8, decay_iters=2),
                  WarmupStage(P.COSINE_ANNEALING_WARM_RESTARTS, max_iters=18, value=0.0, sgdr_period=3),
                  WarmupStage(P.INTERPOLATE, max_iters=22, value=1.0, end_value=0.0, start_interpolating_iters=18),
                  WarmupStage(P.NONE, max_iters=24, lr_scale=0.5)],
    'single-step-stages': [WarmupStage(P.CONSTANT, max_iters=1, value=0.1), WarmupStage(P.CONSTANT, max_iters=2, value=0.2),
                           WarmupStage(P.CONSTANT, max_iters=3, value=0.3)],
    'empty': [],
}


@pytest.mark.parametrize('name', SCHEDULES)
def test_matches_torchrec_walk(name):
    stages = SCHEDULES[name]
    n = stages[-1].max_iters + 5 if stages else 5
    lrs, ts = torchrec_walk(stages, n, lr=0.3, formula=reference_formula)
    got = ours(stages, n)
    assert [s for s, _ in got] == [s for _, s in ts]
    assert [0.3 * m for _, m in got] == pytest.approx(lrs, rel=1e-12, abs=1e-15)
    assert [warmup_multiplier(stages, t) for t in range(n + 1)] == [m for _, m in got]


def test_every_policy_is_covered():
    used = {st.policy for stages in SCHEDULES.values() for st in stages}
    assert used == set(WarmupPolicy)


def test_stage_boundaries_are_inclusive_and_global():
    "A stage includes t == max_iters; the next stage's formula sees the global t (POLY in stage 2 does not start at 1)."
    sched = WarmupSchedule([WarmupStage(P.LINEAR, max_iters=4, value=0.0), WarmupStage(P.POLY, max_iters=8, value=1.0)])
    assert sched(4) == (0, 1.0)
    assert sched(5) == (1, pytest.approx(1 - 5 / 8))
    assert sched(8) == (1, 0.0)
    assert sched(9) == (2, 1.0)
    assert sched(10**20) == (2, 1.0)


def test_policy_and_enum_values_are_torchrecs():
    assert {p.name: p.value for p in WarmupPolicy} == {
        'NONE': 'none', 'LINEAR': 'linear', 'CONSTANT': 'constant', 'POLY': 'poly', 'STEP': 'step', 'INVSQRT': 'inv_sqrt',
        'COSINE_ANNEALING_WARM_RESTARTS': 'cosine_annealing_warm_restarts', 'INTERPOLATE': 'interpolate'}
    assert {c.name: c.value for c in GradientClipping} == {'NORM': 'norm', 'VALUE': 'value', 'NONE': 'none'}
    assert WarmupStage() == WarmupStage(policy=P.LINEAR, max_iters=1, value=1.0, lr_scale=1.0, decay_iters=-1, sgdr_period=1,
                                        start_interpolating_iters=None, end_value=None)


def test_stages_are_not_mutated():
    "torchrec writes the resolved decay_iters into the stages you pass; we keep our own copies."
    stages = [WarmupStage(P.STEP, max_iters=3, value=0.5), WarmupStage(P.POLY, max_iters=6, value=2.0)]
    sched = WarmupSchedule(stages)
    assert [st.decay_iters for st in stages] == [-1, -1]
    assert [st.decay_iters for st in sched.stages] == [1, 6, -1]
    assert sched.stages[-1].policy is P.NONE


# --- errors: clear, naming the stage and the field, raised when the stages are built ---

@pytest.mark.parametrize('stages, exc, match', [
    ([WarmupStage(P.INVSQRT, max_iters=5)], ValueError, r'stages\[0\]\.policy.*INVSQRT.*first'),
    ([WarmupStage(max_iters=0)], ValueError, r'stages\[0\]\.max_iters.*greater than 0.*got 0'),
    ([WarmupStage(max_iters=-3)], ValueError, r'stages\[0\]\.max_iters'),
    ([WarmupStage(max_iters=5), WarmupStage(max_iters=5)], ValueError, r'stages\[1\]\.max_iters.*stages\[0\]\.max_iters \(5\).*got 5'),
    ([WarmupStage(max_iters=5), WarmupStage(max_iters=3)], ValueError, r'stages\[1\]\.max_iters.*cumulative'),
    ([WarmupStage(max_iters=2.5)], TypeError, r'stages\[0\]\.max_iters must be an int'),
    ([WarmupStage(max_iters=True)], TypeError, r'stages\[0\]\.max_iters must be an int'),
    ([WarmupStage(P.STEP, max_iters=4, decay_iters=1.5)], TypeError, r'stages\[0\]\.decay_iters must be an int'),
    ([WarmupStage(P.POLY, max_iters=10, value=2.0, decay_iters=5)], ValueError, r'stages\[0\]\.decay_iters must be >= max_iters \(10\)'),
    ([WarmupStage(P.POLY, max_iters=10, value=-1.0)], ValueError, r'stages\[0\]\.value must be >= 0 for POLY'),
    ([WarmupStage(max_iters=1), WarmupStage(P.COSINE_ANNEALING_WARM_RESTARTS, max_iters=4, sgdr_period=0)],
     ValueError, r'stages\[1\]\.sgdr_period must be > 0'),
    ([WarmupStage(P.INTERPOLATE, max_iters=4, end_value=0.0)], TypeError, r'stages\[0\]\.start_interpolating_iters'),
    ([WarmupStage(P.INTERPOLATE, max_iters=4, start_interpolating_iters=1)], TypeError, r'stages\[0\]\.end_value'),
    ([WarmupStage(P.INTERPOLATE, max_iters=4, start_interpolating_iters=4, end_value=0.0)], ValueError,
     r'stages\[0\]\.start_interpolating_iters must be < max_iters \(4\)'),
    ([WarmupStage(policy='linear')], TypeError, r'stages\[0\]\.policy must be a WarmupPolicy'),
    ([WarmupStage(value=None)], TypeError, r'stages\[0\]\.value'),
    ([WarmupStage(), {'policy': P.LINEAR}], TypeError, r'stages\[1\] must be a WarmupStage'),
    (WarmupStage(), TypeError, r'list of WarmupStage'),
])
def test_bad_stages_raise_clear_errors(stages, exc, match):
    with pytest.raises(exc, match=match): WarmupSchedule(stages)
    with pytest.raises(exc, match=match): warmup_multiplier(stages, 1)


def test_accepted_edge_cases():
    "What torchrec runs must still run: INVSQRT after another stage, POLY with a longer horizon or a negative power, sgdr_period 1."
    WarmupSchedule([WarmupStage(max_iters=1), WarmupStage(P.INVSQRT, max_iters=3)])
    WarmupSchedule([WarmupStage(P.POLY, max_iters=4, value=-1.0, decay_iters=8)])
    assert ours([WarmupStage(P.COSINE_ANNEALING_WARM_RESTARTS, max_iters=3, value=0.0)], 4) == [(0, 1.0)] * 4 + [(1, 1.0)]


@pytest.mark.parametrize('t', [-1, 1.0, True, None])
def test_bad_step_count(t):
    with pytest.raises(ValueError, match='step count'): WarmupSchedule([]).stage(t)
