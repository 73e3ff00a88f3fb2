"""The bench's harness: how a step is timed, compared and measured, whatever the case.

Timings on a busy machine drift, so every row is timed in the same process as its references, interleaved (`measure`):
round `r` times one step of every contender, in an order shuffled each round (seeded), and a ratio is the median of
the per-round ratios (`paired`). Rows only compare if they compute the same thing (`numerics_gap`). Memory is read
from the kernel's counters of this process (`status_kb`, with `pin_mmap_threshold` so that freed temporaries show),
on a GPU from torch's allocator (`cuda_peak_bytes`)."""
from __future__ import annotations

import contextlib
import gc
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from .params import PLACEMENT, Shapes, make_params

__all__ = ['empty_inductor_cache', 'Progress', 'timed', 'measure', 'paired', 'numerics_gap', 'status_kb', 'pin_mmap_threshold', 'state_bytes',
           'cuda_peak_bytes', 'cpu_s']


# -- timing ---------------------------------------------------------------------------------------------------------
class Progress:
    "tqdm when it is installed, else a line every 10%."
    def __init__(self, total: int):
        try:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total, unit='step', file=sys.stderr, dynamic_ncols=True)
        except ImportError: self.bar, self.total, self.done, self.shown = None, total, 0, -1

    def set(self, desc: str) -> None:
        "Name the part now running."
        if self.bar is not None: self.bar.set_description(desc)
        else: print(f'[bench] {desc}', file=sys.stderr, flush=True)

    def update(self, n: int = 1) -> None:
        "Count `n` more steps done."
        if self.bar is not None: return self.bar.update(n)
        self.done += n
        pct = 10 * self.done // max(self.total, 1)
        if pct != self.shown: print(f'[bench] {10 * pct}%', file=sys.stderr, flush=True)
        self.shown = pct

    def close(self) -> None:
        "End the bar."
        if self.bar is not None: self.bar.close()


@contextlib.contextmanager
def empty_inductor_cache(prefix: str) -> Iterator[str]:
    """An empty inductor cache (a temporary `TORCHINDUCTOR_CACHE_DIR`, named from `prefix`) for the block, so that its
    compile times are what a first run pays; the user's setting, if any, is restored after."""
    before = os.environ.get('TORCHINDUCTOR_CACHE_DIR')
    with tempfile.TemporaryDirectory(prefix=prefix) as cache:
        os.environ['TORCHINDUCTOR_CACHE_DIR'] = cache
        try: yield cache
        finally:
            if before is None: os.environ.pop('TORCHINDUCTOR_CACHE_DIR', None)
            else: os.environ['TORCHINDUCTOR_CACHE_DIR'] = before


def timed(f: Callable) -> float:
    """Seconds one call of `f` takes: a CPU step returns when its work is done; a CUDA step (params `placed` on a GPU)
    only queues it, so it is timed by CUDA events around it, after `torch.cuda.synchronize()` has drained what came
    before, and read once the end event is reached (the step's own host time, syncs included, is inside the events)."""
    if PLACEMENT['device'].type != 'cuda':
        start = time.perf_counter()
        f()
        return time.perf_counter() - start
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    f()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def measure(steps: dict[str, Callable[[], None]], rounds: int, warmup: int, progress: Progress | None = None) -> dict:
    """Time each step function: `warmup` calls on their own (they create the state, and may compile), then `rounds`
    interleaved rounds of one call each, in an order shuffled every round (seeded: the same orders in every run), so
    that no contender always follows the same one: a step leaves the caches and the allocator in its own state, and
    with the order rotated (each contender after the same one every round but one) torch's fused SGD and cbopt's call
    of the same kernel differed by 2-4%, where alternating the two alone gave 0.99x. A step that raises is recorded
    as an error and dropped from the rounds."""
    res, live = {}, {}
    for name, step in steps.items():
        try:
            res[name] = {'warmup_s': [timed(step) for _ in range(warmup)], 'times': []}
            live[name] = step
        except Exception as e: res[name] = {'error': f'{type(e).__name__}: {e}'}
        if progress: progress.update(warmup if name in live else warmup + rounds)
    names, orders = list(live), random.Random(0)
    gc.disable()
    try:
        for _ in range(rounds):
            for name in orders.sample(names, len(names)): res[name]['times'].append(timed(live[name]))
            if progress: progress.update(len(names))
    finally: gc.enable()
    for name in names:
        r = res[name]
        r['median_s'] = statistics.median(r['times'])
        r['first_s'] = r['warmup_s'][0]
        r['warmup_extra_s'] = sum(r['warmup_s']) - warmup * r['median_s']  # state creation and compilation
    return res


def paired(res: dict, a: str, b: str) -> float | None:
    "Median over rounds of `a`'s step time / `b`'s in the same round (None when either failed)."
    if 'median_s' not in res.get(a, {}) or 'median_s' not in res.get(b, {}): return None
    return statistics.median(x / y for x, y in zip(res[a]['times'], res[b]['times']))


# -- the rows compute the same thing ---------------------------------------------------------------------------
def numerics_gap(contenders: dict[str, Callable], ref: str, shapes: Shapes, steps: int = 3) -> dict[str, float]:
    """Largest |param - ref's param| after `steps` steps from the same start, per contender: the rows of a table only
    compare if they compute the same thing. Large sets are checked on four tiny tensors instead."""
    if sum(math.prod(s) for _, s in shapes) > 1_000_000: shapes = [('a', (7, 5)), ('b', (5,)), ('c', (3, 4, 2)), ('d', (9,))]
    finals = {}
    for name, factory in contenders.items():
        ps = make_params(shapes, seed=1)
        step = factory(ps)
        for _ in range(steps): step()
        finals[name] = torch.cat([p.detach().flatten() for _, p in ps])
    return {n: (f - finals[ref]).abs().max().item() for n, f in finals.items()}


# -- memory, and CPU time -----------------------------------------------------------------------------------------
def status_kb(key: str) -> int:
    "A field of this process's /proc/self/status in kB (`VmRSS`: resident now; `VmHWM`: its peak since the last reset)."
    for line in Path('/proc/self/status').read_text().splitlines():
        if line.startswith(key + ':'): return int(line.split()[1])
    raise KeyError(key)


def pin_mmap_threshold(nbytes: int = 1 << 16) -> None:
    """Make glibc serve every allocation of `nbytes` or more by mmap and unmap it on free (`mallopt(M_MMAP_THRESHOLD)`),
    so freed temporaries never stay in the heap, where a later step could reuse them unseen by the peak RSS."""
    import ctypes
    ctypes.CDLL(None).mallopt(-3, nbytes)  # M_MMAP_THRESHOLD; pinning it also stops glibc from raising it


def state_bytes(opt: torch.optim.Optimizer) -> int:
    "The bytes of the per-param tensor state of `opt` (0-d counters are left out: they are not streamed)."
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.ndim > 0)


def cuda_peak_bytes(step: Callable[[], None]) -> int:
    """The bytes one call of `step` allocates on the GPU beyond what was allocated before it, at its peak
    (`torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`): a step's temporaries, on a GPU."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def cpu_s() -> float:
    "CPU seconds of this process and its finished children (gcc): a compile's cost that the machine's load does not inflate."
    import resource
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime
