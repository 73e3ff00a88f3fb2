"""`check_callback`: run a callback or a chain through everything cbopt promises, and say in words what fails.

Write a callback, then `cbopt.testing.check_callback([weight_decay, my_step], lr=1e-2, wd=0.1)`: it runs the chain on a
few small params of mixed shapes in two groups, with deterministic grads, and checks that
- the `foreach` backend is bit-exact with the `loop` reference (or says which callback cannot run bucket-wise);
- the `fused` backend (the chain compiled) stays within `rtol` of the loop, relative to each tensor's own scale;
- each callback's declarations read (`cbopt.core.spec`): a misspelt or mistyped one is reported, naming it;
- the declared state (`cb.state`) is what the chain creates;
- the state_dict reads back with `torch.load(weights_only=True)` and loads into a fresh optimizer;
- a resume from that checkpoint continues bit-exact with the uninterrupted run.
cbopt's own conformance tests run every prebuilt optimizer through it (`opt_func=cbopt.Adam`).
"""
from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from .core.chain import init_chain_state, is_declared, transient_keys
from .engine import Backend
from .optimizer import Optimizer
from .core.flags import split_flags
from .core.spec import CallbackSpecError, spec

__all__ = ['check_callback', 'CheckReport']


@dataclass
class CheckReport:
    "What `check_callback` found: `failures` (broken promises) and `notes` (worth knowing, not wrong)."
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool: return not self.failures

    def __str__(self) -> str:
        lines = ['check_callback: ' + ('all checks passed' if self.ok else f'{len(self.failures)} check(s) failed')]
        lines += [f'  FAIL {m}' for m in self.failures] + [f'  note {m}' for m in self.notes]
        return '\n'.join(lines)


def _params(dtype: torch.dtype) -> list[list[torch.Tensor]]:
    "Small params in two groups: a bucket of two same-shape matrices, a vector and a 3-D tensor; a bias alone."
    g = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=dtype).requires_grad_()
    return [[mk(5, 3), mk(5, 3), mk(4), mk(2, 3, 2)], [mk(3)]]


def _set_grads(params: list[torch.Tensor], step: int) -> None:
    "Grads that depend on the params and the step (as real grads do), the same for the same values."
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = (torch.sin(p.detach() * (step + 1)) + 0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _flat(groups) -> list[torch.Tensor]: return [p for g in groups for p in g]


def _max_rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-12)).item() for x, y in zip(a, b))


def check_callback(cbs: Callable | Iterable[Callable] | None = None, *, opt_func: Callable | None = None,
                   steps: int = 8, backends: Iterable[str] = ('foreach', 'fused'), compiler: str = 'aot_eager',
                   rtol: float = 1e-6, dtype: torch.dtype = torch.float32, raise_on_failure: bool = True,
                   **hypers) -> CheckReport:
    """Check a callback or chain `cbs` (with `hypers`), or a prebuilt optimizer `opt_func(params, **hypers)`, in
    every backend, through a checkpoint and a resume. Returns a `CheckReport`; raises AssertionError with it if a
    check failed and `raise_on_failure`. `compiler` is the torch.compile backend of the fused check ('aot_eager'
    traces the chain as inductor would get it without generating code; 'inductor' also compiles it).

    ```python
    import cbopt
    from cbopt.testing import check_callback
    report = check_callback([cbopt.weight_decay, cbopt.average_grad, cbopt.momentum_step], lr=0.1, mom=0.9, wd=1e-4)
    assert report.ok, report
    ```
    """
    if (cbs is None) == (opt_func is None): raise TypeError("check_callback takes either callbacks or opt_func=")
    make = opt_func or (lambda ps, **kw: Optimizer(ps, cbs, **kw))
    report = CheckReport()
    for cb in [] if cbs is None else [cbs] if callable(cbs) else list(cbs):  # (nothing runs with a declaration unread)
        try: spec(cb)
        except CallbackSpecError as e: report.failures.append(f"a declaration cannot be read: {e}")
    if not report.ok:
        if raise_on_failure: raise AssertionError(str(report))
        return report

    def run(backend, groups=None, opt=None, start=0, n=steps):
        groups = groups if groups is not None else _params(dtype)
        opt = opt or make(groups, **hypers)
        opt.backend = backend
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always')
            for i in range(start, start + n):
                _set_grads(_flat(groups), i)
                opt.step()
        return groups, opt, [str(x.message) for x in w]

    ref_groups, ref, _ = run('loop')
    ref_ps = _flat(ref_groups)
    # declared state is what the chain creates (the first mismatch is reported)
    for g, p in [(g, p) for g in ref.param_groups if is_declared(g['cbs']) for p in g['params']]:
        declared = init_chain_state(g['cbs'], p, template=True)
        made = {k: v for k, v in split_flags(ref.state[p])[0].items() if k not in transient_keys(g['cbs'])}
        bad = [k for k, v in declared.items() if k in made and torch.is_tensor(v) and (v.shape, v.dtype) != (made[k].shape, made[k].dtype)]
        if set(declared) != set(made): report.failures.append(f"the chain declares the state {sorted(declared)} but creates {sorted(made)}")
        elif bad: report.failures.append(f"declared state {bad} has another shape or dtype than the state the chain creates")
        else: continue
        break
    # backends
    for backend in backends:
        be = Backend(backend, compiler=compiler)
        groups, _, msgs = run(be)
        for m in msgs:
            if 'cannot run on a whole bucket' in m or 'could not be compiled' in m: report.notes.append(f"{backend}: {m}")
        diff = _max_rel_diff(_flat(groups), ref_ps)
        tol = 0. if backend == 'foreach' else rtol
        if diff > tol:
            how = 'bit-exact with' if backend == 'foreach' else f'within {rtol:g} of'
            report.failures.append(f"the {backend} backend is not {how} the loop: max difference {diff:.3g} of a tensor's scale")
    # checkpoint: weights_only round trip, then a bit-exact resume
    half = steps // 2
    groups, opt, _ = run('loop', n=half)
    buf = io.BytesIO()
    try:
        torch.save(opt.state_dict(), buf)
        buf.seek(0)
        sd = torch.load(buf, weights_only=True)
    except Exception as e:
        report.failures.append(f"the state_dict does not read back with torch.load(weights_only=True): {type(e).__name__}: {e}")
        sd = None
    if sd is not None:
        copies = [[p.detach().clone().requires_grad_() for p in g] for g in groups]
        fresh = make(copies, **hypers)
        try: fresh.load_state_dict(sd)
        except Exception as e: report.failures.append(f"the state_dict does not load into a fresh optimizer: {type(e).__name__}: {e}")
        else:
            run('loop', groups, opt, start=half, n=steps - half)
            run('loop', copies, fresh, start=half, n=steps - half)
            if any(not torch.equal(a, b) for a, b in zip(_flat(copies), _flat(groups))):
                report.failures.append("a resume from the state_dict is not bit-exact with the uninterrupted run")
    if raise_on_failure and not report.ok: raise AssertionError(str(report))
    return report
