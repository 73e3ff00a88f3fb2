"""The registry of algorithm cases: one `Case` per algorithm config, which every conformance test iterates.

A case is a cbopt builder, the torch.optim and fastai references built with the same hypers (where the algorithm
exists there), and what the tests may expect of it. Adding a case here puts it through every backend test
(test_backends), both parity tests (test_parity_torch, test_parity_fastai) and the resume tests (test_resume: a
bit-exact resume, and torch.optim's and fastai's state_dicts continuing in cbopt). Hypers are chosen to make differences visible: nonzero wd, momentums away
from their defaults, `trust_coeff=1` so that LARC's clip bites.

Two more tables live here, configs of one library's optimizers against the package they follow, each run by its own
test file with more configs per algorithm than the registry-wide tests could afford: `TORCH_CONFIGS`
(test_torch_catalogue.py: torch.optim's classes) and `MODERN_CONFIGS` (test_modern.py: lion-pytorch,
pytorch-optimizer, torch-optimi, schedulefree).

Tolerances are relative to each tensor's own scale (`conftest.assert_rel_close`). An absolute floor is given only
where a case needs one, with its reason next to it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import optim

import cbopt
from cbopt.recipes.torch_optim import ASGD, Adadelta, Adafactor, Adagrad, Adamax, NAdam, Rprop


@dataclasses.dataclass(frozen=True)
class Tol:
    """A parity tolerance: `rtol` of each tensor's own largest magnitude, per dtype, and an absolute `floor` (fp32
    only) for a case whose tensors decay to ~0 under wd while the two sides round each step differently."""
    fp32: float = 1e-6
    fp64: float = 1e-12
    floor: float = 0.

    def of(self, dtype: torch.dtype) -> dict:
        "`rtol` and `atol` for `assert_rel_close` in `dtype`."
        return dict(rtol=self.fp64, atol=0.) if dtype == torch.float64 else dict(rtol=self.fp32, atol=self.floor)


@dataclasses.dataclass(frozen=True)
class Case:
    """One algorithm config.

    - `build(params, lr, backend)`: the cbopt optimizer (`params`: anything cbopt takes; `lr`: a number or a slice).
    - `fastai(params, lr)`, `torch(params, lr, **torch_kwargs)`: the same algorithm and hypers in fastai.optimizer /
      torch.optim (`fused=True`, `foreach=False`... passed on), or None.
    - `fastai_parity`, `torch_parity`: how close cbopt follows each reference (`Tol`); None where there is none.
    - `bit_exact_foreach`: the foreach backend gives the loop's result bit for bit (the README's claim).
    - `has_torch_kernel`: `auto` and `fused` run it as torch's fused kernel (on fp32/fp64 CPU params).
    - `compiles`: which torch.compile backends the quick suite checks its compiled (fused) chain with; every case is
      checked with both under `CBOPT_SLOW=1`. Compiling costs seconds per chain on CPU, hence a selection.
    - `inductor_graphs`: graphs inductor compiles for the 12-step check of `test_fused_inductor`, where known.
    - `tensor_scope`: a callback of its chain reduces over a whole param (a norm): `cb.scope == 'tensor'`.
    - `splits_groups`: it splits each given group in two (Muon's matrices, AdamW's rest): its param groups are not
      the given ones (`freeze_to` still counts the given ones: `opt.layers`).
    - `optim(params, lr, **torch_kwargs)`: the same config as cbopt.optim's drop-in class (torch's names and
      signature), or None; `torch_both` gives it and `torch` from one expression.
    - `needs_closure`: it steps only with a closure (L-BFGS). The registry-wide tests step without one: each of them
      reports such a case as skipped, with that reason (`conftest.pytest_collection_modifyitems`).
    - `per_param_python`: its chain runs Python per param on every step (a Python `if` on a tensor's value, or a
      whole-model callback): it never runs bucket-wise nor compiled.
    - `gaps`: {test function name: why that test cannot hold for this case}; that test reports the case as skipped
      with the reason. A known gap is written here, never left as a silent filter.
    """
    id: str
    build: Callable[..., cbopt.Optimizer]
    fastai: Callable[..., Any] | None = None
    torch: Callable[..., optim.Optimizer] | None = None
    fastai_parity: Tol | None = None
    torch_parity: Tol | None = None
    bit_exact_foreach: bool = True
    has_torch_kernel: bool = False
    compiles: tuple[str, ...] = ()
    inductor_graphs: int | None = None
    tensor_scope: bool = False
    splits_groups: bool = False
    optim: Callable[..., cbopt.Optimizer] | None = None
    needs_closure: bool = False
    per_param_python: bool = False
    gaps: dict[str, str] = dataclasses.field(default_factory=dict, compare=False)  # (hashable: `functools.cache`)

    def __post_init__(self):
        assert (self.fastai is None) == (self.fastai_parity is None), f"{self.id}: a fastai reference needs a Tol"
        assert (self.torch is None) == (self.torch_parity is None), f"{self.id}: a torch reference needs a Tol"
        assert self.optim is None or self.torch is not None, f"{self.id}: a drop-in is compared with torch's class"

    def gap(self, test: str) -> str | None:
        "Why `test` (a test function's name) cannot hold for this case, or None where it must."
        if test in self.gaps: return self.gaps[test]
        if self.needs_closure and test not in CLOSURE_AWARE:
            return "steps only with a closure, and this test steps without one (tests/test_lbfgs.py runs it with one)"
        return None

    def __str__(self): return self.id


def _fo():
    import fastai.optimizer as fo  # only the tests that use a fastai reference pay for importing fastai
    return fo


def both(make: Callable, tol: Tol = Tol()) -> dict:
    """`build`, `fastai` and `fastai_parity=tol` from one `make(module, params, lr)`, called with `cbopt` or
    `fastai.optimizer`: the two libraries share names, hyper names and signatures, so one expression gives both the
    same hypers."""
    def build(ps, lr, backend='auto'):
        opt = make(cbopt, ps, lr)
        opt.backend = backend
        return opt
    return dict(build=build, fastai=lambda ps, lr: make(_fo(), ps, lr), fastai_parity=tol)


def torch_both(make: Callable) -> dict:
    """`torch` and `optim` from one `make(module, params, lr, **kw)`, called with `torch.optim` or `cbopt.optim`: the
    drop-in classes take torch's names and signatures, so one expression gives both the same config."""
    import cbopt.optim as drop_in
    return dict(torch=lambda ps, lr, **kw: make(optim, ps, lr, **kw),
                optim=lambda ps, lr, **kw: make(drop_in, ps, lr, **kw))


def matrices(ps):
    """The 2-D params of `ps` in the form given (tensors, (name, tensor) pairs, lists of either, group dicts): torch's
    Muon takes nothing else."""
    if isinstance(ps, dict): return {**ps, 'params': matrices(ps['params'])}
    if isinstance(ps, tuple) and len(ps) == 2 and isinstance(ps[0], str): return ps if ps[1].ndim == 2 else None
    if isinstance(ps, torch.Tensor): return ps if ps.ndim == 2 else None
    kept = [matrices(p) for p in ps]
    return [k for k in kept if k is not None]


def tenth(lr):
    "`lr / 10`, for a number or each end of a slice."
    return slice(*(v and v / 10 for v in (lr.start, lr.stop))) if isinstance(lr, slice) else lr / 10


# -- user-written chains (no library has them: the loop is their reference) ------------------------------------------
def lion(p, lr, mom, sqr_mom, wd, grad_avg=None, **kwargs):
    "A user-written Lion step (Chen et al. 2023), as one callback that declares nothing (fastai's contract only)."
    if grad_avg is None: grad_avg = torch.zeros_like(p.grad.data)
    p.data.mul_(1 - lr * wd)
    p.data.add_(torch.sign(grad_avg.lerp(p.grad.data, 1 - mom)), alpha=-lr)
    grad_avg.lerp_(p.grad.data, 1 - sqr_mom)
    return {'grad_avg': grad_avg}


def clip_by_norm(p, max_norm, **kwargs):
    "A user-written per-param grad clip: no Python `if` on a tensor, so it runs bucket-wise; it rebinds `p.grad`."
    n = torch.linalg.vector_norm(p.grad.data)
    p.grad = p.grad * torch.where(n > max_norm, max_norm / (n + 1e-12), 1.)


# fp32 over 100 steps at lr 3e-2, where the two sides order their float ops differently (torch's AdamW/RAdam against
# fastai's ops, or torch's fused AdamW kernel against either), the head bias decays under wd to ~7e-2 and differs by
# up to 9e-8 (1.2e-6 of its own size) in pure rounding; the same runs in fp64 agree to 1e-15. The floor is what one
# fp32 rounding per step can add up to: 100 steps x lr 3e-2 x 2**-24 = 1.8e-7.
ROUNDING_FLOOR = 2e-7

# torch keeps NAdam's `mu_product` and ASGD's `eta` and `mu` as float32 0-d tensors whatever the params' dtype, and
# steps fp64 params with them, where cbopt computes them in float64: over test_parity_torch's 100 fp64 steps the two
# part by up to 4e-9 (NAdam) and 3e-8 (ASGD, whose float32 `eta` compounds) of the params' scale
FP32_SCALARS = 1e-7

NO_COMPLEX = {'test_registry_on_complex_params_is_the_real_math': "refuses complex params, as torch's class does"}

CASES: list[Case] = [
    # SGD: torch's `weight_decay` is L2 (cbopt's `decouple_wd=False`)
    Case('sgd', **both(lambda m, ps, lr: m.SGD(ps, lr, wd=0.1))),
    Case('sgd-l2', **both(lambda m, ps, lr: m.SGD(ps, lr, wd=0.1, decouple_wd=False)),
         **torch_both(lambda m, ps, lr, **kw: m.SGD(ps, lr=lr, weight_decay=0.1, **kw)), torch_parity=Tol(),
         has_torch_kernel=True),
    Case('sgd-mom', **both(lambda m, ps, lr: m.SGD(ps, lr, mom=0.9, wd=0.1)), compiles=('aot_eager',)),
    Case('sgd-mom-l2', **both(lambda m, ps, lr: m.SGD(ps, lr, mom=0.9, wd=0.1, decouple_wd=False)),
         **torch_both(lambda m, ps, lr, **kw: m.SGD(ps, lr=lr, momentum=0.9, weight_decay=0.1, **kw)),
         torch_parity=Tol(), has_torch_kernel=True),
    # torch's nesterov and dampening: fastai's SGD has neither
    Case('sgd-nesterov', build=lambda ps, lr, backend='auto': cbopt.SGD(ps, lr, mom=0.9, nesterov=True, wd=0.1,
                                                                        decouple_wd=False, backend=backend),
         **torch_both(lambda m, ps, lr, **kw: m.SGD(ps, lr=lr, momentum=0.9, nesterov=True, weight_decay=0.1, **kw)),
         torch_parity=Tol(), has_torch_kernel=True),
    Case('sgd-dampening', build=lambda ps, lr, backend='auto': cbopt.SGD(ps, lr, mom=0.9, dampening=0.5, wd=0.1,
                                                                         decouple_wd=False, backend=backend),
         **torch_both(lambda m, ps, lr, **kw: m.SGD(ps, lr=lr, momentum=0.9, dampening=0.5, weight_decay=0.1, **kw)),
         torch_parity=Tol(), has_torch_kernel=True),
    # RMSProp keeps eps at its default 1e-8: fastai's RMSProp drops its `eps` (its step's default 1e-8 is used).
    # torch's RMSprop momentum is another algorithm (it averages grad/sqrt(v), fastai the grads): no torch reference.
    Case('rmsprop', **both(lambda m, ps, lr: m.RMSProp(ps, lr, sqr_mom=0.9, wd=0.1)), compiles=('aot_eager',)),
    Case('rmsprop-l2', **both(lambda m, ps, lr: m.RMSProp(ps, lr, sqr_mom=0.9, wd=0.1, decouple_wd=False)),
         **torch_both(lambda m, ps, lr, **kw: m.RMSprop(ps, lr=lr, alpha=0.9, eps=1e-8, weight_decay=0.1, **kw)),
         torch_parity=Tol()),
    Case('rmsprop-mom', **both(lambda m, ps, lr: m.RMSProp(ps, lr, mom=0.8, sqr_mom=0.9, wd=0.1, decouple_wd=False))),
    # the default backend runs cbopt's AdamW as torch's fused kernel, whose float ops are neither fastai's nor torch's
    # for-loop's: hence the floor against both
    Case('adam', **both(lambda m, ps, lr: m.Adam(ps, lr, mom=0.8, sqr_mom=0.95, eps=1e-6, wd=0.1),
                        Tol(floor=ROUNDING_FLOOR)),
         **torch_both(lambda m, ps, lr, **kw: m.AdamW(ps, lr=lr, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, **kw)),
         torch_parity=Tol(floor=ROUNDING_FLOOR), has_torch_kernel=True),
    # with L2 the default backend runs torch's fused Adam kernel (`_fused_adam_`): the same floor
    Case('adam-l2', **both(lambda m, ps, lr: m.Adam(ps, lr, mom=0.8, sqr_mom=0.95, eps=1e-6, wd=0.1, decouple_wd=False),
                           Tol(floor=ROUNDING_FLOOR)),
         **torch_both(lambda m, ps, lr, **kw: m.Adam(ps, lr=lr, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, **kw)),
         torch_parity=Tol(floor=ROUNDING_FLOOR), has_torch_kernel=True),
    # torch's RAdam adds eps to sqrt(v) *before* dividing by sqrt(1 - beta2**t), fastai/cbopt to sqrt(v_hat) after:
    # the effective eps differs by a factor 1/sqrt(1 - beta2**t) (<= 4.1 once rectified at these betas). With eps=1e-8
    # that moves params by ~3e-8 relative over 100 steps: below fp32's 1e-6, but visible in fp64 (measured 3.6e-8).
    Case('radam', **both(lambda m, ps, lr: m.RAdam(ps, lr, mom=0.8, sqr_mom=0.95, eps=1e-8, wd=0.1)),
         **torch_both(lambda m, ps, lr, **kw: m.RAdam(ps, lr=lr, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.1,
                                                      decoupled_weight_decay=True, **kw)),
         torch_parity=Tol(fp64=1e-7), compiles=('inductor',), inductor_graphs=2),  # flat (elementwise); r > 5 flips once
    Case('radam-l2', **both(lambda m, ps, lr: m.RAdam(ps, lr, mom=0.8, sqr_mom=0.95, eps=1e-8, wd=0.1,
                                                      decouple_wd=False)),
         **torch_both(lambda m, ps, lr, **kw: m.RAdam(ps, lr=lr, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.1, **kw)),
         torch_parity=Tol(fp64=1e-7, floor=ROUNDING_FLOOR)),
    Case('sadam', **both(lambda m, ps, lr: m.RAdam(ps, lr, sqr_mom=0.95, wd=0.1, beta=10.))),
    Case('qhadam', **both(lambda m, ps, lr: m.QHAdam(ps, lr, mom=0.9, sqr_mom=0.99, nu_2=0.8, wd=0.1)),
         compiles=('aot_eager',)),
    Case('larc', **both(lambda m, ps, lr: m.Larc(ps, lr, clip=True, trust_coeff=1., wd=0.1)), compiles=('inductor',),
         tensor_scope=True),
    Case('lars', **both(lambda m, ps, lr: m.Larc(ps, lr, clip=False, trust_coeff=1., wd=0.1)), compiles=('aot_eager',),
         tensor_scope=True),
    Case('lamb', **both(lambda m, ps, lr: m.Lamb(ps, lr, sqr_mom=0.95, wd=0.1)), compiles=('aot_eager',),
         tensor_scope=True),
    Case('lookahead-sgd', **both(lambda m, ps, lr: m.Lookahead(m.SGD(ps, lr, mom=0.9, wd=0.1), k=5, alpha=0.6)),
         compiles=('aot_eager',)),
    Case('lookahead-adam', **both(lambda m, ps, lr: m.Lookahead(m.Adam(ps, lr, eps=1e-6, wd=0.1), k=4, alpha=0.3))),
    Case('ranger', **both(lambda m, ps, lr: m.ranger(ps, lr, sqr_mom=0.95))),
    # chains written by a user, here: the loop is their reference. Lion at lr/10: its sign step moves every element by lr
    Case('lion', build=lambda ps, lr, backend='auto': cbopt.Optimizer(ps, [cbopt.weight_decay, lion], backend=backend,
                                                                      lr=tenth(lr), mom=0.9, sqr_mom=0.99, wd=0.1),
         compiles=('aot_eager', 'inductor'), inductor_graphs=2),  # one graph per shape (bias, weight)
    # torch.optim's other algorithms (cbopt.torch_optimizers) and flags (tests/test_torch_catalogue.py has more configs)
    Case('adam-amsgrad', build=lambda ps, lr, backend='auto': cbopt.Adam(ps, lr, mom=0.8, sqr_mom=0.95, eps=1e-6, wd=0.1,
                                                                         amsgrad=True, backend=backend),
         **torch_both(lambda m, ps, lr, **kw: m.AdamW(ps, lr=lr, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1,
                                                      amsgrad=True, **kw)),
         torch_parity=Tol(floor=ROUNDING_FLOOR), has_torch_kernel=True),
    # maximizing: weight decay small enough that no param decays to ~0 (where the kernel's rounding is all there is)
    Case('adam-maximize', build=lambda ps, lr, backend='auto': cbopt.Adam(ps, lr, mom=0.8, sqr_mom=0.95, eps=1e-6,
                                                                          wd=0.01, maximize=True, backend=backend),
         **torch_both(lambda m, ps, lr, **kw: m.AdamW(ps, lr=lr, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.01,
                                                      maximize=True, **kw)),
         torch_parity=Tol(floor=ROUNDING_FLOOR), has_torch_kernel=True),
    Case('sgd-maximize', build=lambda ps, lr, backend='auto': cbopt.SGD(ps, lr, mom=0.9, wd=0.1, decouple_wd=False,
                                                                        maximize=True, backend=backend),
         **torch_both(lambda m, ps, lr, **kw: m.SGD(ps, lr=lr, momentum=0.9, weight_decay=0.1, maximize=True, **kw)),
         # the loss it climbs grows without bound, and rounding with it (no compiled check): torch's own fused SGD,
         # which the default backend runs, drifts 1.4e-6 from torch's for-loop here over 100 steps
         torch_parity=Tol(fp32=3e-6), has_torch_kernel=True),
    # torch.optim.Adagrad's L2 and lr decay, and its accumulator's initial value; the default backend runs torch's
    # fused Adagrad kernel (`_fused_adagrad_`), as every SGD chain above with L2 runs `_fused_sgd_`
    Case('adagrad-l2', build=lambda ps, lr, backend='auto': cbopt.Adagrad(ps, lr, lr_decay=0.01, eps=1e-8, wd=0.1,
                                                                         initial_accumulator_value=0.1, backend=backend),
         **torch_both(lambda m, ps, lr, **kw: m.Adagrad(ps, lr=lr, lr_decay=0.01, initial_accumulator_value=0.1,
                                                        eps=1e-8, weight_decay=0.1, **kw)),
         torch_parity=Tol(), has_torch_kernel=True),
    Case('adafactor', build=lambda ps, lr, backend='auto': cbopt.Adafactor(ps, lr, beta2_decay=-0.6, d=1.5, wd=0.1,
                                                                          backend=backend),
         **torch_both(lambda m, ps, lr, **kw: m.Adafactor(ps, lr=lr, beta2_decay=-0.6, d=1.5, weight_decay=0.1,
                                                          **kw)),
         torch_parity=Tol(), compiles=('aot_eager',), tensor_scope=True, gaps=NO_COMPLEX),
    # Muon on the matrices, AdamW on the biases (one optimizer, per-group chains); test_torch_catalogue checks each
    # half against torch.optim.Muon and AdamW: torch has no single optimizer to compare the whole with
    Case('muon', build=lambda ps, lr, backend='auto': cbopt.Muon(ps, lr, wd=0.05, adamw=dict(lr=3e-3, wd=0.1),
                                                                 backend=backend),
         tensor_scope=True, has_torch_kernel=True, splits_groups=True, gaps=NO_COMPLEX),  # AdamW's groups run torch's fused kernel
    Case('clip-adam', build=lambda ps, lr, backend='auto': cbopt.Optimizer(
        ps, [clip_by_norm, cbopt.average_grad, cbopt.average_sqr_grad, cbopt.step_stat, cbopt.adam_step],
        backend=backend, lr=lr, max_norm=0.05)),
    # the modern optimizers: their references are other packages (lion-pytorch, pytorch-optimizer, torch-optimi,
    # schedulefree), followed step by step in test_modern.py; here the loop is their reference
    Case('lion-prebuilt', build=lambda ps, lr, backend='auto': cbopt.Lion(ps, tenth(lr), mom=0.8, sqr_mom=0.95, wd=0.1,
                                                                          backend=backend),
         compiles=('aot_eager',)),
    Case('adan', build=lambda ps, lr, backend='auto': cbopt.Adan(ps, lr, mom=0.9, diff_mom=0.8, sqr_mom=0.95, wd=0.1,
                                                                 backend=backend), compiles=('aot_eager',)),
    Case('ademamix', build=lambda ps, lr, backend='auto': cbopt.AdEMAMix(ps, lr, mom=0.8, sqr_mom=0.95, slow_mom=0.99,
                                                                         t_alpha_beta3=20, wd=0.1, backend=backend),
         compiles=('aot_eager',)),
    Case('stableadamw', build=lambda ps, lr, backend='auto': cbopt.StableAdamW(ps, lr, mom=0.8, sqr_mom=0.95, eps=1e-3,
                                                                               wd=0.1, backend=backend),
         compiles=('aot_eager',), tensor_scope=True),
    # schedule-free: built in train mode (as schedulefree, they start in eval mode and refuse to step there); their
    # weight sums are 0-d tensors in state, so the compiled chain never recompiles (test_modern checks it)
    Case('sf-sgd', build=lambda ps, lr, backend='auto': cbopt.ScheduleFreeSGD(ps, lr, mom=0.8, wd=0.1, warmup_steps=5,
                                                                              backend=backend).train()),
    Case('sf-adamw', build=lambda ps, lr, backend='auto': cbopt.ScheduleFreeAdamW(ps, lr, mom=0.8, sqr_mom=0.95, wd=0.1,
                                                                                  warmup_steps=5, backend=backend).train(),
         compiles=('aot_eager',)),
    # kahan_sum (for bf16 params; here fp32, where it must still be the same algorithm): every backend runs the wrapper
    Case('adam-kahan', build=lambda ps, lr, backend='auto': cbopt.Adam(ps, lr, mom=0.8, sqr_mom=0.95, eps=1e-6, wd=0.1,
                                                                       kahan_sum=True, backend=backend),
         compiles=('aot_eager',)),
    Case('lion-kahan', build=lambda ps, lr, backend='auto': cbopt.Lion(ps, tenth(lr), wd=0.1, kahan_sum=True,
                                                                       backend=backend)),
    # torch.optim's other elementwise algorithms (cbopt.torch_optimizers), L2 as torch's `weight_decay`; hypers as
    # tests/test_torch_catalogue.py's second config of each. Adadelta with eps=1e-2: its
    # first steps are ~sqrt(eps) * lr, too small to see at these lrs with torch's eps
    Case('adadelta', build=lambda ps, lr, backend='auto': cbopt.Adadelta(ps, lr, sqr_mom=0.8, eps=1e-2,
                                                                          wd=0.1, backend=backend),
         **torch_both(lambda m, ps, lr, **kw: m.Adadelta(ps, lr=lr, rho=0.8, eps=1e-2, weight_decay=0.1,
                                                         **kw)), torch_parity=Tol()),
    Case('adamax', build=lambda ps, lr, backend='auto': cbopt.Adamax(ps, lr, mom=0.8, sqr_mom=0.95, eps=1e-6, wd=0.1,
                                                                      backend=backend),
         **torch_both(lambda m, ps, lr, **kw: m.Adamax(ps, lr=lr, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, **kw)),
         torch_parity=Tol()),
    Case('nadam', build=lambda ps, lr, backend='auto': cbopt.NAdam(ps, lr, mom=0.8, sqr_mom=0.95, momentum_decay=0.01,
                                                                    wd=0.1, backend=backend),
         **torch_both(lambda m, ps, lr, **kw: m.NAdam(ps, lr=lr, betas=(0.8, 0.95), momentum_decay=0.01,
                                                      weight_decay=0.1, **kw)), torch_parity=Tol(fp64=FP32_SCALARS)),
    Case('nadamw', build=lambda ps, lr, backend='auto': cbopt.NAdam(ps, lr, wd=0.1, decouple_wd=True, backend=backend),
         **torch_both(lambda m, ps, lr, **kw: m.NAdam(ps, lr=lr, weight_decay=0.1, decoupled_weight_decay=True, **kw)),
         torch_parity=Tol(fp64=FP32_SCALARS, floor=ROUNDING_FLOOR)),
    # t0=5: the average is taken from step 5 on
    Case('asgd', build=lambda ps, lr, backend='auto': cbopt.ASGD(ps, lr, lambd=1e-2, alpha=0.5, t0=5, wd=0.1,
                                                                  backend=backend),
         **torch_both(lambda m, ps, lr, **kw: m.ASGD(ps, lr=lr, lambd=1e-2, alpha=0.5, t0=5, weight_decay=0.1, **kw)),
         torch_parity=Tol(fp64=FP32_SCALARS)),
    # both clamps of the step sizes bite
    Case('rprop', build=lambda ps, lr, backend='auto': cbopt.Rprop(ps, lr, etas=(0.3, 1.5), step_sizes=(1e-4, 0.05),
                                                                    backend=backend),
         **torch_both(lambda m, ps, lr, **kw: m.Rprop(ps, lr=lr, etas=(0.3, 1.5), step_sizes=(1e-4, 0.05), **kw)),
         torch_parity=Tol()),
    # torch's Muon, as cbopt.optim's drop-in: the matrices only (torch's refuses any other param)
    Case('muon-torch', build=lambda ps, lr, backend='auto': cbopt.Muon(matrices(ps), lr, wd=0.05, mom=0.9,
                                                                       muon_params=lambda n, p: True, backend=backend),
         **torch_both(lambda m, ps, lr, **kw: m.Muon(matrices(ps), lr=lr, weight_decay=0.05, momentum=0.9, **kw)),
         torch_parity=Tol(), tensor_scope=True,
         gaps={'test_follows_torch': "the biases stay put (torch's Muon refuses them), which the test's last check "
                                     "(every param moved) fails: test_optim's test_registry_drop_in_follows_torch "
                                     "compares the same config with torch on the matrices alone",
               'test_resume_is_exact': "the test checks that the checkpoint names every param of the model: this case "
                                       "holds the matrices only (test_optim's state_dict tests resume torch's Muon)",
               **{t: "the test builds the case on a lone 1-D param, which torch's Muon refuses"
                  for t in ('test_update_is_the_optimizer', 'test_vmap_every_case', 'test_differentiable_every_case',
                            'test_edge_cases', 'test_mixed_dtypes')},
               **NO_COMPLEX}),
    # Composer's decoupled optimizers (decay by wd * lr / initial_lr); tests/test_composer.py follows Composer's update
    Case('composer-sgdw', build=lambda ps, lr, backend='auto': cbopt.DecoupledSGDW(ps, lr, momentum=0.9, weight_decay=0.1,
                                                                                   backend=backend)),
    # the default backend runs torch's fused AdamW kernel at wd / initial_lr
    Case('composer-adamw', build=lambda ps, lr, backend='auto': cbopt.DecoupledAdamW(
        ps, lr, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, backend=backend), has_torch_kernel=True),
    # L-BFGS steps only with a closure: every registry-wide test reports it skipped with that reason;
    # tests/test_lbfgs.py runs it through the same checks (every backend, bit-exact resume, torch's state_dict)
    Case('lbfgs', build=lambda ps, lr, backend='auto': cbopt.LBFGS(ps, lr, history_size=5, backend=backend),
         **torch_both(lambda m, ps, lr, **kw: m.LBFGS(ps, lr=lr, history_size=5, **kw)), torch_parity=Tol(),
         needs_closure=True),
]

# -- other tables: configs of one library's optimizers against the package they follow, which their own test files
# run (more configs per algorithm than the registry-wide tests could afford) -----------------------------------------
# torch.optim's other algorithms against torch's classes, config by config (test_torch_catalogue.py):
# id: (cbopt builder, torch builder), the same algorithm and hypers; the non-default hypers are far from the defaults
TORCH_CONFIGS = {
    'adagrad':           (Adagrad, optim.Adagrad),
    'adagrad-decay-l2':  (partial(Adagrad, lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1, eps=1e-8, wd=0.1),
                          partial(optim.Adagrad, lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1, eps=1e-8,
                                  weight_decay=0.1)),
    'adadelta':          (Adadelta, optim.Adadelta),
    'adadelta-rho-l2':   (partial(Adadelta, lr=0.5, sqr_mom=0.8, eps=1e-5, wd=0.1),
                          partial(optim.Adadelta, lr=0.5, rho=0.8, eps=1e-5, weight_decay=0.1)),
    'adamax':            (Adamax, optim.Adamax),
    'adamax-betas-l2':   (partial(Adamax, lr=0.01, mom=0.8, sqr_mom=0.95, eps=1e-6, wd=0.1),
                          partial(optim.Adamax, lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)),
    'nadam':             (NAdam, optim.NAdam),
    'nadam-l2':          (partial(NAdam, lr=0.01, mom=0.8, sqr_mom=0.95, momentum_decay=0.01, wd=0.1),
                          partial(optim.NAdam, lr=0.01, betas=(0.8, 0.95), momentum_decay=0.01, weight_decay=0.1)),
    'nadamw':            (partial(NAdam, lr=0.01, wd=0.1, decouple_wd=True),
                          partial(optim.NAdam, lr=0.01, weight_decay=0.1, decoupled_weight_decay=True)),
    'asgd':              (ASGD, optim.ASGD),
    'asgd-avg-l2':       (partial(ASGD, lr=0.05, lambd=1e-2, alpha=0.5, t0=5, wd=0.1),  # t0=5: the average is used
                          partial(optim.ASGD, lr=0.05, lambd=1e-2, alpha=0.5, t0=5, weight_decay=0.1)),
    'rprop':             (Rprop, optim.Rprop),
    'rprop-etas':        (partial(Rprop, lr=1e-3, etas=(0.3, 1.5), step_sizes=(1e-4, 0.01)),  # both clamps bite
                          partial(optim.Rprop, lr=1e-3, etas=(0.3, 1.5), step_sizes=(1e-4, 0.01))),
    'adam-amsgrad':      (partial(cbopt.Adam, lr=0.01, mom=0.8, sqr_mom=0.95, eps=1e-6, wd=0.1, decouple_wd=False,
                                  amsgrad=True),
                          partial(optim.Adam, lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, amsgrad=True)),
    'adamw-amsgrad':     (partial(cbopt.Adam, lr=0.01, mom=0.8, sqr_mom=0.95, eps=1e-6, wd=0.1, amsgrad=True),
                          partial(optim.AdamW, lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, amsgrad=True)),
    'adafactor':         (Adafactor, optim.Adafactor),
    'adafactor-all':     (partial(Adafactor, lr=0.05, beta2_decay=-0.5, eps=(1e-12, 1e-2), d=1.5, wd=0.1),
                          partial(optim.Adafactor, lr=0.05, beta2_decay=-0.5, eps=(1e-12, 1e-2), d=1.5, weight_decay=0.1)),
}


def _lion(ps, **kw):
    from lion_pytorch import Lion
    return Lion(ps, **kw)


def _pytorch_optimizer(name, ps, **kw):
    import pytorch_optimizer
    return getattr(pytorch_optimizer, name)(ps, **kw)


def _optimi(name, ps, lr=1e-3, **kw):
    import optimi
    return getattr(optimi, name)(ps, lr=lr, **kw)


def _schedulefree(name, ps, **kw):
    import schedulefree
    opt = getattr(schedulefree, name)(ps, **kw)
    opt.train()  # both start in eval mode, and refuse to step there
    return opt


def _train_mode(make):
    "A cbopt schedule-free optimizer, in train mode (as the reference is put)."
    return lambda ps, **kw: make(ps, **kw).train()


# the modern optimizers against the packages their users install, config by config (test_modern.py):
# id: (cbopt builder, reference builder, rtol), the same algorithm and hypers; non-default hypers far from the defaults
MODERN_CONFIGS = {
    'lion':    (cbopt.Lion, _lion, 1e-6),
    'lion-wd': (partial(cbopt.Lion, lr=3e-3, mom=0.8, sqr_mom=0.95, wd=0.5),
                partial(_lion, lr=3e-3, betas=(0.8, 0.95), weight_decay=0.5), 1e-6),
    'adan':    (cbopt.Adan, partial(_pytorch_optimizer, 'Adan'), 1e-6),
    'adan-wd': (partial(cbopt.Adan, lr=1e-2, mom=0.9, diff_mom=0.8, sqr_mom=0.95, eps=1e-6, wd=0.3),
                partial(_pytorch_optimizer, 'Adan', lr=1e-2, betas=(0.9, 0.8, 0.95), eps=1e-6, weight_decay=0.3,
                        foreach=False), 1e-6),
    'adan-decoupled': (partial(cbopt.Adan, lr=1e-2, wd=0.3, decouple_wd=True),
                       partial(_pytorch_optimizer, 'Adan', lr=1e-2, weight_decay=0.3, weight_decouple=True), 1e-6),
    # (Adan's maximize is not compared: pytorch-optimizer sets previous_grad from the grad before negating it, so its
    # first difference is -2*grad instead of 0; cbopt's maximize negates first, as torch does)
    'ademamix-maximize': (partial(cbopt.AdEMAMix, lr=1e-2, wd=0.3, maximize=True),
                          partial(_pytorch_optimizer, 'AdEMAMix', lr=1e-2, weight_decay=0.3, maximize=True), 1e-6),
    'ademamix': (cbopt.AdEMAMix, partial(_pytorch_optimizer, 'AdEMAMix'), 1e-6),
    'ademamix-warmup-l2': (partial(cbopt.AdEMAMix, lr=1e-2, mom=0.8, sqr_mom=0.95, slow_mom=0.99, slow_alpha=3.,
                                   t_alpha_beta3=30, wd=0.1),  # 30 < 50 steps: the warmup ends within the run
                           partial(_pytorch_optimizer, 'AdEMAMix', lr=1e-2, betas=(0.8, 0.95, 0.99), alpha=3.,
                                   t_alpha_beta3=30, weight_decay=0.1, foreach=False), 1e-6),
    'ademamix-decoupled': (partial(cbopt.AdEMAMix, lr=1e-2, wd=0.3, decouple_wd=True),
                           partial(_pytorch_optimizer, 'AdEMAMix', lr=1e-2, weight_decay=0.3, weight_decouple=True), 1e-6),
    'stableadamw': (cbopt.StableAdamW, partial(_optimi, 'StableAdamW'), 1e-6),
    'stableadamw-hypers': (partial(cbopt.StableAdamW, lr=3e-2, mom=0.8, sqr_mom=0.95, eps=1e-3, wd=0.3),  # clips 28 of 200
                           partial(_optimi, 'StableAdamW', lr=3e-2, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.3,
                                   foreach=False), 1e-6),
    'sf-sgd': (_train_mode(cbopt.ScheduleFreeSGD), partial(_schedulefree, 'SGDScheduleFree'), 0.),  # bit for bit
    'sf-sgd-hypers': (_train_mode(partial(cbopt.ScheduleFreeSGD, lr=0.3, mom=0.8, wd=0.1, warmup_steps=10, r=1.,
                                          weight_lr_power=1.)),
                      partial(_schedulefree, 'SGDScheduleFree', lr=0.3, momentum=0.8, weight_decay=0.1, warmup_steps=10,
                              r=1., weight_lr_power=1., foreach=False), 0.),
    'sf-adamw': (_train_mode(cbopt.ScheduleFreeAdamW), partial(_schedulefree, 'AdamWScheduleFree'), 0.),
    'sf-adamw-hypers': (_train_mode(partial(cbopt.ScheduleFreeAdamW, lr=1e-2, mom=0.8, sqr_mom=0.95, eps=1e-6, wd=0.1,
                                            warmup_steps=10, r=0.5)),
                        partial(_schedulefree, 'AdamWScheduleFree', lr=1e-2, betas=(0.8, 0.95), eps=1e-6,
                                weight_decay=0.1, warmup_steps=10, r=0.5, foreach=False), 0.),
}


BY_ID: dict[str, Case] = {c.id: c for c in CASES}
assert len(BY_ID) == len(CASES), "case ids must be unique"
WITH_FASTAI = [c for c in CASES if c.fastai is not None]
WITH_TORCH = [c for c in CASES if c.torch is not None]
WITH_OPTIM = [c for c in CASES if c.optim is not None]
# the tests written to step through a closure where a case needs one (none yet: L-BFGS's are in test_lbfgs.py)
CLOSURE_AWARE: set[str] = {'test_every_export_has_a_case'}


def case(case_id: str) -> Case:
    return BY_ID[case_id]
