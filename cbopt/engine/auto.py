"""The `auto` runner's policy, per bucket layout:
1. torch's fused kernel when one computes exactly this chain (cbopt's AdamW, L2 Adam, SGD, Adagrad on fp32/fp64,
   and on CUDA bf16/fp16 too): the fastest there is, so auto makes fused's very calls (the bench's Adam cases, 1
   thread: a 28-tensor tiny model 0.25x the loop's step, 1,000 one-param groups 0.5x torch's fused AdamW);
2. on an accelerator, foreach: one kernel launch per op for the bucket instead of one per param. Measured on an
   H200 (`bench --device cuda`, GPT-2 small's params, docs/guides/cuda.md): Lion's foreach step 3.0 ms, its compiled
   chain 3.1-4.5 (after a first compile of over a minute), its loop 9.7 (a chain with per-param Python, Rprop's or
   Lamb's, was not measured there);
3. on CPU, foreach or loop, whichever was faster over `auto_trials` timed steps each of this bucket layout.
   Measured here (1 thread, README benchmark): on many small params foreach is ~1.9x faster (less Python per
   param); on GPT-2's large params the two are within ~10% either way, as both are memory-bound, and which wins
   depends on the chain. Both are exact, so trying each costs nothing in results. Params sharded as DTensors
   (FSDP2) run foreach, as on an accelerator: a choice by timing could differ between ranks, and a chain reducing
   across ranks (a norm) must make its collectives in the same order on every rank.
The compiled chain is never picked: its first compile costs seconds to a minute; ask for `backend='fused'` (on an
elementwise chain without a kernel, Lion's, it steps GPT-2 small's params about 2.5x faster than foreach or loop).
"""
from __future__ import annotations

import time
from collections.abc import Mapping

from ..core.dtensor import is_dtensor
from .buckets import Bucket
from .foreach import foreach_bucket, loop_bucket
from .kernels import torch_kernel
from ..core.runtime import runtime

__all__ = ['auto_bucket', 'choose']

RUNNERS = {'foreach': foreach_bucket, 'loop': loop_bucket}


def choose(opt, b: Bucket) -> str:
    "The CPU runner for `b`'s layout: the one with fewer trials while trials remain, then the faster one."
    times = runtime(opt).auto_times.setdefault(b.layout, {'foreach': [], 'loop': []})
    if min(len(t) for t in times.values()) < opt.backend_options.auto_trials: return min(times, key=lambda k: len(times[k]))
    return min(times, key=lambda k: min(times[k]))


def auto_bucket(opt, b: Bucket, hyper: Mapping) -> None:
    "Step `b` with the runner the policy above picks, timing it while trials remain."
    if (kernel := torch_kernel(b, hyper)) is not None: return kernel()
    if b.params[0].device.type != 'cpu' or is_dtensor(b.params[0]): return foreach_bucket(opt, b, hyper)
    layout, name = b.layout, choose(opt, b)
    times = runtime(opt).auto_times[layout][name]
    if len(times) >= opt.backend_options.auto_trials: return RUNNERS[name](opt, b, hyper)
    t = time.perf_counter()
    RUNNERS[name](opt, b, hyper)
    times.append(time.perf_counter() - t)
