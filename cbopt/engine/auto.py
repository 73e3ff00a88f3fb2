"""The `auto` runner's policy, per bucket layout:
1. torch's fused kernel when one computes exactly this chain (cbopt's AdamW, L2 Adam, SGD, Adagrad on fp32/fp64,
   and on CUDA bf16/fp16 too): the fastest there is, so auto makes fused's very calls (the bench's Adam cases, 1
   thread: a 28-tensor tiny model 0.25x the loop's step, 1,000 one-param groups 0.5x torch's fused AdamW);
2. on an accelerator, foreach: one kernel launch per op for the bucket instead of one per param. Measured on an
   H200 (`bench --device cuda`, GPT-2 small's params, docs/guides/cuda.md): Lion's foreach step 3.0 ms, its compiled
   chain 3.1-4.5 (after a first compile of over a minute), its loop 9.7 (a chain with per-param Python, Rprop's or
   Lamb's, was not measured there);
3. on CPU, the fastest of foreach, loop and, for a large bucket of an elementwise chain (`may_compile`: at least
   `COMPILE_NUMEL` elements), the chain compiled as the fused runner compiles it, over `auto_trials` timed steps
   each of this bucket layout (the compiled chain's first call, its compile, is not timed). Measured here (1
   thread, README benchmark): on many small params foreach is ~1.9x faster than the loop (less Python per param);
   on GPT-2's large params the two are within ~10% either way, as both are memory-bound, and which wins depends on
   the chain. The compiled chain makes one pass over memory where foreach makes one per op: Lion on 4 params, one
   thread, loaded 2-core CPU, step ms foreach / loop / compiled: 0.26M elements 0.45 / 0.36 / 0.47, 1M 1.6 / 1.1 /
   0.8, 4M 6.3 / 6.5 / 3.3, 16.8M 30 / 28 / 9.5 (GPT-2 small's 124M: 180 / 170 / 66, docs/performance.md); its
   first compile costs 4-8 CPU-s (a warm / cold inductor cache), won back in about 200-400 steps at 16.8M elements
   (70 at 124M, thousands at 4M): hence the threshold, which keeps the test suite's models and the bench's tiny ones
   from compiling. All are exact or within the fused runner's tolerance of the loop, so trying each costs nothing in
   results. A chain that does not compile drops the candidate quietly, its untouched params stepped with foreach
   (`CompileFailed.rest`: none twice). Params sharded as DTensors (FSDP2) run foreach, as on an accelerator: a
   choice by timing could differ between ranks, and a chain reducing across ranks (a norm) must make its
   collectives in the same order on every rank.
"""
from __future__ import annotations

import time
from collections.abc import Mapping

from ..core.chain import chain_scope
from ..core.dtensor import is_dtensor
from .buckets import Bucket
from .compiled import CompileFailed, compiled_bucket
from .foreach import foreach_bucket, loop_bucket
from .kernels import torch_kernel
from ..core.runtime import runtime
from ..state.lowbit import precision

__all__ = ['COMPILE_NUMEL', 'auto_bucket', 'may_compile', 'choose']

RUNNERS = {'foreach': foreach_bucket, 'loop': loop_bucket}

COMPILE_NUMEL = 1 << 24
"""The fewest elements a CPU bucket of an elementwise chain must hold for `auto` to try its compiled chain (16.8M:
64 MB of fp32 params). Below it a first compile's seconds are not won back in a run's steps (the module docstring's
measurements); the test suite's models and the bench's `--quick` sets are far below it, so they never compile."""


def may_compile(opt, b: Bucket) -> bool:
    """Whether the compiled chain is one of `auto`'s candidates for `b` (on CPU, not sharded: the caller's): an
    elementwise chain (one flat graph for the whole bucket: `engine.flat`), fp32 state (low-bit state is stepped in
    chunks: `engine.lowbit`), at least `COMPILE_NUMEL` elements, a layout whose state a bucket-wise step has completed
    (`Runtime.seen`: a first step creates the state eagerly, as the fused runner's does) and that did not fail to
    compile or to run bucket-wise."""
    rt, layout = runtime(opt), b.layout
    return (layout in rt.seen and layout not in rt.no_compile and layout not in rt.per_param
            and precision(b.group) == 'fp32' and chain_scope(b.cbs) == 'element'
            and sum(p.numel() for p in b.params) >= COMPILE_NUMEL)


def choose(opt, b: Bucket) -> str:
    """The CPU runner for `b`'s layout: the one with fewer trials while trials remain, then the fastest one
    (candidates: foreach and loop; the compiled chain too where `may_compile`)."""
    times = runtime(opt).auto_times.setdefault(b.layout, {'foreach': [], 'loop': []})
    if min(len(t) for t in times.values()) < opt.backend_options.auto_trials:  # (asked while trials remain only:
        if 'compiled' not in times and may_compile(opt, b): times['compiled'] = []  # a settled step costs no more)
        return min(times, key=lambda k: len(times[k]))
    return min(times, key=lambda k: min(times[k]))


def _compiled(opt, b: Bucket, hyper: Mapping) -> bool:
    """Step `b` with its compiled chain; False where it did not compile: the candidate is dropped for this layout, and
    the part of `b` it left untouched (`CompileFailed.rest`: all of it, or the chunks after those that ran) steps with
    foreach, so that no param steps twice and none is missed. Quiet: `auto` was not asked to compile."""
    try: compiled_bucket(opt, b, hyper)
    except CompileFailed as e:
        rt = runtime(opt)
        rt.no_compile.add(b.layout)
        rt.auto_times.get(b.layout, {}).pop('compiled', None)
        foreach_bucket(opt, e.rest, hyper)
        return False
    return True


def auto_bucket(opt, b: Bucket, hyper: Mapping) -> None:
    "Step `b` with the runner the policy above picks, timing it while trials remain."
    if (kernel := torch_kernel(b, hyper)) is not None: return kernel()
    if b.params[0].device.type != 'cpu' or is_dtensor(b.params[0]): return foreach_bucket(opt, b, hyper)
    rt, layout, name = runtime(opt), b.layout, choose(opt, b)
    if name == 'compiled' and layout not in rt.compiled:  # the first call compiles (seconds): not a step's time
        if _compiled(opt, b, hyper): rt.compiled.add(layout)
        return
    runner, times = _compiled if name == 'compiled' else RUNNERS[name], rt.auto_times[layout][name]
    if len(times) >= opt.backend_options.auto_trials: return runner(opt, b, hyper)
    t = time.perf_counter()
    ran_bucketwise = runner(opt, b, hyper)  # (a compiled call that fails drops the candidate, as a first compile)
    times.append(time.perf_counter() - t)
    if name == 'foreach' and ran_bucketwise: rt.seen.add(b.layout)  # (the layout after the step: its state complete)
