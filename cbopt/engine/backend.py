"""`Backend`: which runner an optimizer's chains go through (`BACKENDS`) and the runners' settings."""
from __future__ import annotations

import dataclasses

__all__ = ['BACKENDS', 'Backend', 'as_backend']

BACKENDS = ('auto', 'loop', 'foreach', 'fused')
"""The runners a step can go through: `backend=` takes one of these names (or a `Backend`)."""


@dataclasses.dataclass(frozen=True)
class Backend:
    """How an optimizer runs its chains: `kind` (one of `BACKENDS`) and the settings of the runners.
    `Optimizer(..., backend='fused')` is `backend=Backend('fused')`; pass a `Backend` to change a setting."""
    kind: str = 'auto'
    compiler: str = 'inductor'        # torch.compile backend of the fused runner ('aot_eager': tracing without codegen)
    compile_chunk: int = 8            # params per compiled call: more compile per graph, fewer calls per step
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
