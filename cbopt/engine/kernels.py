"""torch's fused kernels, used when one computes exactly what a chain computes.

A recipe registers its chain with the kernel that does the same math (`register_kernel(adam_chain(), fused_adamw)`
in `cbopt.optimizers`; `fused_adam` for the L2 chain, `fused_sgd` for SGD's chains; `fused_adagrad` in
`cbopt.torch_optimizers`), so the engine never imports recipes. A kernel adapter takes a bucket and its hypers and
returns a function stepping the whole bucket, or None when the bucket is outside what the kernel handles. It may be
asked for one of two grad factors (keywords; a step owes one at most: GradScaler's is paid before whole-model
callbacks run): `grad_scale`, a multiplier from a whole-model callback (`clip_grad_norm`),
which must leave the user's grads as they are, unless `scale_in_place` (`clip_grad_norm(in_place=True)`: then the
kernel writes the scaled grads into them, as `clip_grad_norm_` leaves them); and `loss_scale`, `torch.amp.GradScaler`'s scale, a divisor, which
torch's kernels take as their own `grad_scale` argument and divide the grads by in place (as torch's fused
optimizers under GradScaler, and `scaler.unscale_` for the others, leave them).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from .._torch import foreach_op, fused_kernel
from ..core.chain import chain_sig
from ..core.hypers import is_model_entry
from ..core.flags import FLAGS
from ..core.dtensor import is_dtensor, local
from .buckets import Bucket

__all__ = ['register_kernel', 'has_kernel', 'torch_kernel', 'kernel_step', 'fused_adamw', 'fused_adam', 'fused_sgd',
           'fused_adagrad']

Kernel = Callable[[Bucket, Mapping], 'Callable[[], None] | None']
KERNELS: dict[tuple, Kernel] = {}  # chain_sig -> kernel adapter


def register_kernel(cbs: Iterable[Callable], kernel: Kernel) -> None:
    "Use `kernel` for every bucket whose group runs exactly the chain `cbs`."
    KERNELS[chain_sig(cbs)] = kernel


def has_kernel(cbs: Iterable[Callable]) -> bool:
    "Whether a torch kernel is registered for the per-param chain `cbs` (it may still refuse a bucket: see adapters)."
    return chain_sig(cbs) in KERNELS


def torch_kernel(b: Bucket, hyper: Mapping, grad_scale: torch.Tensor | None = None,
                 loss_scale: torch.Tensor | None = None, scale_in_place: bool = False,
                 found_inf: torch.Tensor | None = None) -> Callable[[], None] | None:
    """A function stepping `b` with torch's fused kernel for its chain, or None if none applies. `grad_scale` (a 0-d
    tensor, from a whole-model callback such as `clip_grad_norm`) multiplies every grad the chain sees, never
    writing into the grads unless `scale_in_place`; `loss_scale` (GradScaler's) divides them, in place, inside the
    kernel's pass. `found_inf` (GradScaler's, on the device: never read on the host) makes the kernel skip the step
    where it is 1, and the step counts are then counted on the device (`_counted_on_device`)."""
    kernel = KERNELS.get(b.kept('sig', lambda: chain_sig(b.cbs)))
    if kernel is None: return None
    if found_inf is not None: found_inf = found_inf.to(device=b.params[0].device, dtype=torch.float32).reshape(())
    scales = {k: v for k, v in (('grad_scale', grad_scale), ('loss_scale', loss_scale), ('found_inf', found_inf))
              if v is not None}
    if grad_scale is not None and scale_in_place: scales['scale_in_place'] = True
    return kernel(b, hyper, **scales)


SCALE_CHUNK = 1 << 20  # elements of scaled grads made just before the kernel reads them: they stay in cache (4 MiB fp32)


def _scaled_slices(b: Bucket, scale: torch.Tensor, keys: tuple[str, ...]):
    """`b`'s params, grads times `scale` and state `keys`, as flat slices in runs of at most `SCALE_CHUNK` elements
    (a large param is cut, a small one joins others): each run's scaled grads are written into one reused buffer, so
    the kernel reads them from cache and the grads themselves are read once and never written (the grad contract).
    Params sharded as DTensors are sliced as this rank's shards, plain tensors: the kernel is elementwise."""
    p0 = b.params[0]
    sizes = [local(p).numel() for p in b.params]  # (of this rank's shards, for params sharded as DTensors)
    buf = torch.empty(min(SCALE_CHUNK, sum(sizes)), dtype=p0.dtype, device=p0.device)
    scale = scale.to(device=p0.device, dtype=p0.dtype)
    run, used = ([], [], *([] for _ in keys)), 0
    for p, st, size in zip(b.params, b.states, sizes):
        flats = tuple(local(t).view(-1) for t in (p, p.grad, *(st[k] for k in keys)))
        for a in range(0, size, SCALE_CHUNK):
            n = min(SCALE_CHUNK, size - a)
            if used + n > len(buf):
                yield run
                run, used = ([], [], *([] for _ in keys)), 0
            run[0].append(flats[0][a:a + n])
            run[1].append(torch.mul(flats[1][a:a + n], scale, out=buf[used:used + n]))
            for lst, f in zip(run[2:], flats[2:]): lst.append(f[a:a + n])
            used += n
    if run[0]: yield run


# the param dtypes a kernel steps, by device: torch's CUDA kernels take 16-bit params (their math in float32, one rounding
# per value: within 16-bit tolerance of the chain, which rounds each op, as torch's fused and foreach paths differ); on
# the CPU 16-bit buckets run the chain, whose roundings the CPU tests hold to the loop backend's
_KERNEL_DTYPES = {'cpu': (torch.float32, torch.float64),
                  'cuda': (torch.float32, torch.float64, torch.bfloat16, torch.float16)}


def _is_float(*vs) -> bool: return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vs)


def _algo_keys(st: Mapping) -> set:
    "A param's state entries that the chain computes: not fastai's flags, not whole-model callbacks' buffers."
    return {k for k in st if not is_model_entry(k)} - set(FLAGS)


def _divisor(p0: torch.Tensor, grad_scale: torch.Tensor | None, loss_scale: torch.Tensor | None,
             scale_in_place: bool) -> torch.Tensor | None:
    """The kernel's own `grad_scale`: a float32 divisor, which it applies to the grads and stores into them (ATen's CPU
    and CUDA kernels alike). Right for GradScaler's scale (torch leaves the grads unscaled), and for a clip coefficient
    only in place (`1 / coefficient`, in float32 as the kernel reads it: within an ulp of `grad * coefficient`). A step
    owes one scale at most: GradScaler's is paid before any whole-model callback (a clip) runs."""
    if loss_scale is not None: return loss_scale.to(device=p0.device, dtype=torch.float32)
    if grad_scale is None or not scale_in_place: return None
    return grad_scale.to(device=p0.device, dtype=torch.float64).reciprocal().float()


def _laid_out_alike(b: Bucket, buffers: tuple[str, ...]) -> bool:
    """Whether every grad and state buffer of `b` has its param's dtype and strides: a kernel walks them all in the
    param's memory order, so a transposed param with a contiguous grad (or channels_last) would silently pair the
    wrong elements. One pass, each param's attributes read once: it runs every step, around the kernel."""
    dtype = b.params[0].dtype
    for p, st in zip(b.params, b.states):
        stride, g = p.stride(), p.grad
        if g.dtype != dtype or g.stride() != stride: return False
        for k in buffers:
            t = st[k]
            if t.dtype != dtype or t.stride() != stride: return False
    return True


def kernel_step(b: Bucket, hyper: Mapping, buffers: tuple[str, ...], numbers: tuple[str, ...],
                call: Callable[..., None], on_dtensors: bool = False, grad_scale: torch.Tensor | None = None,
                loss_scale: torch.Tensor | None = None, scale_in_place: bool = False,
                found_inf: torch.Tensor | None = None) -> Callable[[], None] | None:
    """A function stepping `b` with one of torch's fused kernels, or None where the kernel does not apply: what every
    adapter shares. `buffers` are the param-shaped state entries the kernel updates (in its argument order), `numbers`
    the hypers it takes as Python floats; `on_dtensors`: whether DTensor has a rule for the kernel (torch's Adam
    kernels; not its SGD and Adagrad ones). `call(params, grads, [buffers of each key], grad_scale=divisor)` calls the
    kernel once (`found_inf`: GradScaler's flag, passed to it as it is); it is called on the bucket whole, or, for a
    `grad_scale` not written into the grads (the grad
    contract), with scaled copies of the grads: on the CPU on cache-sized runs of flat slices (`_scaled_slices`: each
    run's copies are read from cache), on a GPU once, with the whole bucket's copies (one foreach multiply: a launch
    per run would cost more than the copies' memory traffic)."""
    p0 = b.params[0]
    lr = hyper['lr']  # a number, or a tensor on the params' device (the kernels take either: a tensor lr is read in them)
    lr_ok = _is_float(lr) or (isinstance(lr, torch.Tensor) and lr.numel() == 1 and lr.device == p0.device)
    if not lr_ok or not _is_float(*(hyper[k] for k in numbers)) or is_dtensor(p0) and not on_dtensors: return None
    if p0.device.type not in ('cpu', 'cuda') or p0.dtype not in _KERNEL_DTYPES[p0.device.type]: return None
    if not b.kept(buffers, lambda: _laid_out_alike(b, buffers)): return None  # (the layout is the plan's)
    copies = grad_scale is not None and not scale_in_place  # scaled copies of the grads
    if copies and found_inf is not None: return None  # (never both: GradScaler's step has no whole-model callback)
    runs = copies and p0.device.type == 'cpu'  # ... in cache-sized runs (`_scaled_slices`): a CPU rule
    if runs and not all(p.is_contiguous() for p in b.params): return None  # (cut into flat slices)
    divisor = _divisor(p0, grad_scale, loss_scale, scale_in_place)

    def run():
        state = lambda: ([s[k] for s in b.states] for k in buffers)
        if not copies: call(b.params, [p.grad for p in b.params], *state(), grad_scale=divisor, found_inf=found_inf)
        elif not runs:  # on a GPU: one scaled copy of the bucket's grads (one foreach call), then one kernel call
            scale = grad_scale.to(device=p0.device, dtype=p0.dtype)
            call(b.params, foreach_op('mul')([p.grad for p in b.params], scale), *state(), grad_scale=None,
                 found_inf=None)
        else:
            for ps, gs, *bufs in _scaled_slices(b, grad_scale, buffers): call(ps, gs, *bufs, grad_scale=None, found_inf=None)
    return run


def fused_adamw(b: Bucket, hyper: Mapping, maximize: bool = False, amsgrad: bool = False,
                op: str = '_fused_adamw_', **scales) -> Callable[[], None] | None:
    """`torch._fused_adamw_` doing exactly what cbopt's AdamW chain does to `b` (with `maximize`: the chain after
    `negate_grad`; with `amsgrad`: the chain with `amsgrad_max`; `scales`: see `kernel_step`), or None if it does not
    apply (also where this torch has no such kernel: `cbopt._torch.fused_kernel`). `op` names the torch kernel,
    looked up at each step: `'_fused_adam_'` (`fused_adam`) adds the L2 term
    `weight_decay * p` to the grad (negated, divided) inside its pass where `_fused_adamw_` shrinks the param, so it
    steps the chain with `l2_reg` in place of `weight_decay`, all else the same."""
    st, p0 = b.states[0], b.params[0]
    moments = ('grad_avg', 'sqr_avg', 'max_sqr_avg') if amsgrad else ('grad_avg', 'sqr_avg')
    if _algo_keys(st) != {*moments, 'step'} or 'dampening' in hyper: return None
    kernel = fused_kernel(op)
    if kernel is None: return None
    step = _next_step(st)

    def call(ps, gs, *bufs, grad_scale, found_inf):
        no_max = [] if amsgrad else [[]]  # the kernel's max_exp_avg_sqs: empty without amsgrad
        kernel(ps, gs, *bufs, *no_max, _steps(b, ps, step), lr=hyper['lr'], beta1=hyper['mom'],
               beta2=hyper['sqr_mom'], eps=hyper['eps'], weight_decay=_wd(hyper, st), amsgrad=amsgrad,
               maximize=maximize, grad_scale=grad_scale, found_inf=found_inf)
    run = kernel_step(b, hyper, moments, ('mom', 'sqr_mom', 'eps', 'wd'), call, on_dtensors=True, **scales)
    return None if run is None else _counting_steps(run, b, step, scales.get('found_inf'))


def fused_adam(b: Bucket, hyper: Mapping, **kw) -> Callable[[], None] | None:
    "`torch._fused_adam_` for cbopt's Adam chain with L2 (`l2_reg`): `fused_adamw` with that kernel (see there)."
    return fused_adamw(b, hyper, **kw, op='_fused_adam_')


def fused_sgd(b: Bucket, hyper: Mapping, momentum: bool = False, dampened: bool = False, nesterov: bool = False,
              maximize: bool = False, decoupled: bool = False, **scales) -> Callable[[], None] | None:
    """`torch._fused_sgd_` doing exactly what cbopt's SGD chain does to `b`: `l2_reg` (or `weight_decay` at zero
    decay: the kernel has no decoupled decay), then `sgd_step`, or with `momentum` the momentum buffer `grad_avg`
    (`average_grad`, or `dampened_grad_avg` if `dampened`) and `momentum_step` (`nesterov_step` with `nesterov`);
    `maximize`: after `negate_grad`; `scales`: see `kernel_step`. A step with the buffer present, as the chain's
    callbacks take it (the first step, which creates it, runs the chain)."""
    st = b.states[0]
    buffers = ('grad_avg',) if momentum else ()
    if _algo_keys(st) != set(buffers): return None
    # a momentum chain at mom=0 still sets its buffer (to the grad), which the kernel would not touch; a nonzero
    # `dampening` is only `dampened_grad_avg`'s (`average_grad` would read it as its own flag: Adam's dampening)
    if momentum and hyper['mom'] == 0 or not dampened and hyper.get('dampening', 0): return None
    if decoupled and _wd(hyper, st) != 0: return None
    kernel = fused_kernel('_fused_sgd_')
    if kernel is None: return None

    def call(ps, gs, *bufs, grad_scale, found_inf):
        kernel(ps, gs, *(bufs or ([],)), weight_decay=0. if decoupled else _wd(hyper, st),
               momentum=hyper['mom'] if momentum else 0., lr=hyper['lr'],
               dampening=hyper['dampening'] if dampened else 0., nesterov=nesterov, maximize=maximize,
               is_first_step=False, grad_scale=grad_scale, found_inf=found_inf)
    numbers = ('wd',) + (('mom',) if momentum else ()) + (('dampening',) if dampened else ())
    return kernel_step(b, hyper, buffers, numbers, call, **scales)


def fused_adagrad(b: Bucket, hyper: Mapping, maximize: bool = False, decoupled: bool = False,
                  **scales) -> Callable[[], None] | None:
    """`torch._fused_adagrad_` doing exactly what cbopt's Adagrad chain does to `b` (`l2_reg`, or `weight_decay` at
    zero decay; `step_stat`, `sqr_grad_sum`, `adagrad_step`; `maximize`: after `negate_grad`; `scales`: see
    `kernel_step`). Its first step fills `sqr_sum` with `initial_accumulator_value`, as `sqr_grad_sum` does."""
    st, p0 = b.states[0], b.params[0]
    if _algo_keys(st) != {'sqr_sum', 'step'}: return None
    if decoupled and _wd(hyper, st) != 0: return None
    kernel = fused_kernel('_fused_adagrad_')
    if kernel is None: return None
    step = _next_step(st)

    def call(ps, gs, sums, grad_scale, found_inf):
        kernel(ps, gs, sums, _steps(b, ps, step), lr=hyper['lr'], lr_decay=hyper['lr_decay'],
               weight_decay=0. if decoupled else _wd(hyper, st), eps=hyper['eps'], maximize=maximize,
               grad_scale=grad_scale, found_inf=found_inf)
    run = kernel_step(b, hyper, ('sqr_sum',), ('lr_decay', 'wd', 'eps', 'initial_accumulator_value'), call, **scales)
    if run is None: return None

    def first_fills():
        if type(step) is int and step == 1:  # (a count on the device was a number at its first step, which filled them)
            for s in b.states: s['sqr_sum'].fill_(hyper['initial_accumulator_value'])
        run()
    return _counting_steps(first_fills, b, step, scales.get('found_inf'))


_STEPS: dict = {}  # device -> [count, its float32 tensor]: the step count the kernels read, one per device


def _step_tensor(step: int, device: torch.device) -> torch.Tensor:
    """The step count as torch's kernels take it: a float32 0-d tensor on the params' device (their CUDA kernels read it
    as float32, whatever the default dtype; exact to 2**24 steps, as torch's), which they read and never write. One per
    device, shared by every bucket stepping with it, kept from step to step and counted in place (`add_(1)`, as torch
    counts its own; `fill_` where the count jumped: a load, another optimizer): a kernel launch, never a host-to-device
    copy, so a CUDA step does not wait for the GPU (`torch.tensor(x, device='cuda')` would). Kernels already launched
    with it read it first: a stream runs in order, and a CPU kernel has run when its call returns. Made at the kernel's
    call, not when its adapter is asked: another bucket at another count may move it in between."""
    kept = _STEPS.get(device)
    if kept is None:
        t = torch.full((), float(step), dtype=torch.float32, device=device)  # (a fill kernel: no copy from the host)
        _STEPS[device] = [step, t]
        return t
    if kept[0] != step:
        if step == kept[0] + 1: kept[1].add_(1)
        else: kept[1].fill_(float(step))
        kept[0] = step
    return kept[1]


_step_tensor.cache_clear = _STEPS.clear  # a fresh start (fake-CUDA checks): the name its lru_cache had


def _wd(hyper: Mapping, st: Mapping):
    "The group's weight decay, unless the bucket's params are flagged `do_wd=False` (fastai's flag)."
    return hyper['wd'] if st.get('do_wd', True) else 0.


def _next_step(st: Mapping) -> int | bool:
    """The count of the step a kernel is asked for: the state's count plus one, or True where the counts are on the
    device (`_counted_on_device` then counts them there: a step after GradScaler's, `InBackward`'s hook on state that
    stepped under GradScaler)."""
    return True if isinstance(st['step'], torch.Tensor) else st['step'] + 1


def _steps(b: Bucket, ps: list, step: int | bool) -> list:
    """The step counts the kernel reads for params `ps` of `b`: each param's own tensor where the counts are on the
    device (then `ps` is the whole bucket: `kernel_step` cuts no runs under GradScaler, and a step with a clip, which
    would, makes the counts numbers first: `dispatch.counts_as_numbers`), else the one kept tensor of the count
    `step` (`_step_tensor`), for every param."""
    if isinstance(b.states[0]['step'], torch.Tensor): return [s['step'] for s in b.states]
    return [_step_tensor(step, ps[0].device)] * len(ps)


def _counting_steps(run: Callable[[], None], b: Bucket, step: int | bool,
                    found_inf: torch.Tensor | None = None) -> Callable[[], None]:
    """`run`, then the bucket's step count `step`, as `step_stat` leaves it; with GradScaler's `found_inf`, counted on
    the device instead (`_counted_on_device`)."""
    if found_inf is not None or step is True: return _counted_on_device(run, b, found_inf)
    def counted():
        run()
        for s in b.states: s['step'] = step
    return counted


def _counted_on_device(run: Callable[[], None], b: Bucket, found_inf: torch.Tensor | None) -> Callable[[], None]:
    """`run` under GradScaler without reading its `found_inf` on the host, as torch's fused optimizers do: each param's
    step count becomes a float32 0-d tensor on its device (in its state, `step`: made by a fill, no copy from the host),
    which is counted in place before the kernel and uncounted by `found_inf` after it (the kernel skipped that step
    where it is 1; without it, counts already on the device are counted there). The engine makes them numbers again (one read) before a step that needs them as numbers
    (`counts_as_numbers`); checkpoints read them as numbers."""
    def counted():
        steps = []
        for s in b.states:
            if not isinstance(t := s['step'], torch.Tensor):
                s['step'] = t = torch.full((), float(t), dtype=torch.float32, device=b.params[0].device)
            steps.append(t)
        foreach_op('add_')(steps, 1.)
        run()
        if found_inf is not None: foreach_op('sub_')(steps, [found_inf] * len(steps))
    return counted
