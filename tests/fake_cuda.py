"""cbopt on *fake* CUDA tensors, on a CPU-only torch: host-device syncs, op counts and state devices, without a GPU.

The project's harness (the session tool `fake_cuda_sim.py`), kept here so CI runs its checks (`test_fake_cuda.py`).
torch's `FakeTensorMode` makes tensors with device 'cuda' (metadata only, no data) even in a CPU build, and checks
device propagation as CUDA would (a non-scalar CPU tensor meeting a CUDA one raises). `SyncLog`, a dispatch mode on
top, counts what would make the host wait for a real GPU: reads of a CUDA tensor's value (`.item()`, `bool()`) and
blocking host-to-device copies (`torch.tensor(x, device='cuda')`), each with the cbopt line that made it; and the ops
dispatched (a foreach op is one kernel launch for a whole bucket, a per-param op one per param).

Limits: no autograd (fake CUDA tensors cannot run backward in a CPU build: grads are set by hand); compiled chains do
not run; a CPU build has no fake kernel for `_fused_sgd_`, `_fused_adagrad_` and some view copies (`FakeKernels`
stands in for the kernels: it checks their arguments, as CUDA's kernels would read them, and counts the calls).
"""
from __future__ import annotations

import collections
import contextlib
import sys

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

A = torch.ops.aten
SYNC_READS = (A._local_scalar_dense.default, A.is_nonzero.default, A.item.default)
NOT_KERNELS = ('prim.', 'profiler.', 'aten.detach', 'aten.alias', 'aten.view', 'aten.lift_fresh')  # no kernel launch


class SyncLog(TorchDispatchMode):
    """Counts, while `on`: host-device syncs (`syncs`, by kind; `where`: by the innermost cbopt frame) and the ops
    that launch a kernel (`ops`, by name). A read of a value answers `value` (default 0: GradScaler's `found_inf`
    reads as no inf)."""

    def __init__(self, value: float = 0):
        super().__init__()
        self.syncs, self.where, self.ops = collections.Counter(), collections.Counter(), collections.Counter()
        self.on, self.value = False, value

    def clear(self) -> None:
        self.syncs.clear(), self.where.clear(), self.ops.clear()

    def _note(self, kind: str) -> None:
        self.syncs[kind] += 1
        f = sys._getframe(2)
        while f is not None and '/cbopt/' not in f.f_code.co_filename: f = f.f_back
        if f is not None: self.where[(kind, f.f_code.co_filename.split('/cbopt/')[-1], f.f_lineno)] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t0 = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if self.on and not str(func).startswith(NOT_KERNELS): self.ops[str(func)] += 1
        if func in SYNC_READS:
            if self.on and t0.device.type == 'cuda': self._note('D2H .item()/bool()')
            v = self.value  # (`bool(t)` reaches here as `_local_scalar_dense` too: one answer for every read)
            return bool(v) if t0.dtype == torch.bool else float(v) if t0.dtype.is_floating_point else int(v)
        if self.on and func is A._to_copy.default and t0 is not None:
            dst = torch.device(kwargs.get('device') or t0.device)
            if t0.device.type == 'cpu' and dst.type == 'cuda' and not kwargs.get('non_blocking'):
                self._note('H2D blocking copy')
            if t0.device.type == 'cuda' and dst.type == 'cpu': self._note('D2H copy')
        if self.on and func is A.copy_.default and args[0].device.type != args[1].device.type:
            self._note(f'copy_ {args[1].device.type}->{args[0].device.type}')
        return func(*args, **kwargs)


class FakeKernels:
    """Stand-ins for torch's fused optimizer kernels over fake CUDA tensors: each call checks what CUDA's kernel reads
    (every tensor on the params' device; the step counts float32, 0-d; a tensor lr on the device) and is counted in
    `calls`; where this build has a fake kernel (`_fused_adam(w)_`) the real one runs too (its device checks)."""
    NAMES = ('_fused_adamw_', '_fused_adam_', '_fused_sgd_', '_fused_adagrad_')

    def __init__(self):
        self.calls = collections.Counter()
        self.real = {n: getattr(torch, n) for n in self.NAMES}

    def _stand_in(self, name: str):
        real = self.real[name]

        def kernel(params, *lists, **kw):
            device = params[0].device
            tensors = [t for lst in lists for t in lst] + [v for v in kw.values() if isinstance(v, torch.Tensor)]
            bad = [t for t in tensors if t.device != device]
            assert not bad, f"{name}: tensors on {sorted({str(t.device) for t in bad})}, params on {device}"
            if name in ('_fused_adamw_', '_fused_adam_', '_fused_adagrad_'):
                steps = lists[-1]
                assert all(s.dtype == torch.float32 and s.dim() == 0 for s in steps), \
                    f"{name}: step counts {sorted({str(s.dtype) for s in steps})}: CUDA reads them as float32"
            self.calls[name] += 1
            if name in ('_fused_adamw_', '_fused_adam_') and not isinstance(kw.get('lr'), torch.Tensor):
                real(params, *lists, **kw)  # (a tensor lr: no fake CUDA kernel in a CPU build)
        return kernel

    @contextlib.contextmanager
    def installed(self):
        try:
            for n in self.NAMES: setattr(torch, n, self._stand_in(n))
            yield self
        finally:
            for n, k in self.real.items(): setattr(torch, n, k)


@contextlib.contextmanager
def fake_cuda(value: float = 0):
    """Fake CUDA tensors, a `SyncLog` (off until a check turns it on) and `FakeKernels`: yields `(log, kernels)`. The
    engine's kept step count tensors are dropped before and after (they would cross between real and fake modes)."""
    from cbopt.engine import kernels
    kernels._STEPS.clear()
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), FakeKernels().installed() as fk, SyncLog(value) as log:
            yield log, fk
    finally: kernels._STEPS.clear()


SHAPES = [('0.weight', (32, 16)), ('0.bias', (32,)), ('2.weight', (32, 32)), ('2.bias', (32,)), ('head.weight', (4, 32)),
          ('head.bias', (4,))]


def cuda_params(dtype: torch.dtype = torch.float32, shapes=SHAPES) -> list:
    "Named fake CUDA params (call inside `fake_cuda`)."
    return [(n, torch.nn.Parameter(torch.empty(s, device='cuda', dtype=dtype))) for n, s in shapes]


def set_grads(params: list) -> None:
    "Give every param a grad (ones: fake tensors have no values)."
    for _, p in params: p.grad = torch.ones_like(p)


def on_host(o):
    "A state_dict as `torch.load(map_location='cpu')` gives it."
    if isinstance(o, torch.Tensor): return o.to('cpu')
    if isinstance(o, dict): return {k: on_host(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)): return type(o)(on_host(v) for v in o)
    return o


def off_device(opt, device_type: str = 'cuda') -> list:
    "`(key, device)` of every state and group tensor of `opt` (lists too) that is not on `device_type`."
    def tensors(v):
        if isinstance(v, torch.Tensor): return [v]
        return [t for o in v for t in tensors(o)] if isinstance(v, (list, tuple)) else []
    out = [(k, str(t.device)) for st in opt.state.values() for k, v in st.items() for t in tensors(v)
           if t.device.type != device_type]
    return out + [(k, str(t.device)) for g in opt.param_groups for k, v in g.items() if k != 'params'
                  for t in tensors(v) if t.device.type != device_type]
