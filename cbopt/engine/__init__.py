"""The engine: how an `Optimizer`'s step runs each group's callback chain over its params, with the same math
(the callbacks') in every backend.

- `loop`: each callback once per param (fastai's way, and the reference the others are tested against).
- `foreach`: each callback once per bucket of params on `TensorList` stand-ins: `torch._foreach_*` kernels.
- `fused`: the whole chain in one pass per bucket: torch's fused kernel when one computes exactly the chain
  (`kernels`), otherwise the chain compiled with `torch.compile` (`compiled`).
- `auto`: torch's kernel if one matches, else foreach on accelerators, else the faster of foreach and loop as timed
  on the first steps (CPU); see `auto`.

Files: `buckets` (which params one call serves), `foreach` (loop and foreach runners, the probe), `compiled`,
`kernels`, `auto`, `runtime` (per-optimizer memory, warnings at the user's line).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from ..chain import chain_name
from ..hypers import Hypers
from .auto import auto_bucket
from . import buckets as bucketing
from .buckets import Bucket
from .compiled import fused_bucket
from .foreach import foreach_bucket, loop_bucket
from .kernels import register_kernel, torch_kernel

__all__ = ['BACKENDS', 'Backend', 'as_backend', 'run_step', 'register_kernel', 'Bucket']

BACKENDS = ('auto', 'loop', 'foreach', 'fused')


@dataclasses.dataclass(frozen=True)
class Backend:
    """How an optimizer runs its chains: `kind` (one of `BACKENDS`) and the settings of the runners.
    `Optimizer(..., backend='fused')` is `backend=Backend('fused')`; pass a `Backend` to change a setting."""
    kind: str = 'auto'
    compiler: str = 'inductor'        # torch.compile backend of the fused runner ('aot_eager': tracing without codegen)
    compile_chunk: int = 32           # params per compiled call: bounds compile time
    cpu_chunk_bytes: int = 4 << 20    # foreach on CPU: about what stays in cache between the chain's ops
    auto_trials: int = 2              # timed steps of each of foreach and loop before auto settles, per bucket layout

    def __post_init__(self):
        if self.kind not in BACKENDS: raise ValueError(f"unknown backend {self.kind!r}: expected one of {BACKENDS}")
        for f in ('compile_chunk', 'cpu_chunk_bytes', 'auto_trials'):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Backend.{f} must be a positive int, got {v!r}")


def as_backend(backend: str | Backend, current: Backend | None = None) -> Backend:
    "A `Backend` from a kind name (keeping `current`'s settings) or a `Backend`."
    if isinstance(backend, Backend): return backend
    if not isinstance(backend, str): raise TypeError(f"backend must be a str or a cbopt.Backend, not {type(backend).__name__}")
    return dataclasses.replace(current or Backend(), kind=backend)


def _fused(opt, b: Bucket, hyper: Mapping) -> None:
    if (kernel := torch_kernel(b, hyper)) is not None: return kernel()
    fused_bucket(opt, b, hyper)


RUNNERS: dict[str, Callable] = {'loop': loop_bucket, 'foreach': foreach_bucket, 'fused': _fused, 'auto': auto_bucket}


def check_grads(opt) -> None:
    """Before anything changes, refuse what no chain can step: a grad of another shape than its param, a grad that
    is not a floating-point tensor of the param's kind, a sparse grad (no cbopt callback supports one, as torch's Adam
    does not). The error names the param, and nothing is stepped: a step is all or nothing."""
    for g in opt.param_groups:
        for name, p in zip(g['param_names'], g['params']):
            grad = p.grad
            if grad is None: continue
            if grad.is_sparse:
                raise RuntimeError(f"param {name!r} has a sparse gradient, which the chain [{chain_name(g['cbs'])}] does "
                                   "not support (densify it with grad.to_dense(), or use torch.optim.SparseAdam)")
            if grad.shape != p.shape:
                raise RuntimeError(f"param {name!r} has shape {tuple(p.shape)} but its grad has shape {tuple(grad.shape)}")
            if grad.dtype.is_floating_point != p.dtype.is_floating_point or grad.is_complex() != p.is_complex():
                raise TypeError(f"param {name!r} has dtype {p.dtype} but its grad has dtype {grad.dtype}")


def run_step(opt) -> None:
    "Step every param of `opt` that has a grad, bucket by bucket, with `opt`'s backend."
    check_grads(opt)
    kind = opt.backend_options.kind
    if kind == 'loop':  # the reference needs no bucketing: one call per group
        for g in opt.param_groups:
            ps = [p for p in g['params'] if p.grad is not None]
            if ps: loop_bucket(opt, Bucket(g, ps, [opt.state[p] for p in ps]), Hypers(g).snapshot())
        return
    run, snapshots = RUNNERS[kind], {}
    for b in bucketing.buckets(opt):
        hyper = snapshots.get(id(b.group))
        if hyper is None: hyper = snapshots[id(b.group)] = Hypers(b.group).snapshot()
        run(opt, b, hyper)
