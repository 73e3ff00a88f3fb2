"""Bucket dispatch: the per-param chains over every param with a grad, bucket by bucket, through the optimizer's
backend's runner (`RUNNERS`), with torch's fused kernel taking the grad scales where one steps the bucket; and the
grad checks that make a step all or nothing."""
from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ..core.chain import chain_counters, chain_name, param_chain
from ..core.hypers import Hypers
from ..core.spec import cb_name, spec
from . import buckets as bucketing
from .auto import auto_bucket
from .buckets import Bucket, as_real
from .compiled import fused_bucket
from .foreach import foreach_bucket, loop_bucket
from .kernels import torch_kernel
from .lowbit import chunks as lowbit_chunks, fused_stored
from .scaling import scale_grads, unscale_grads
from ..core.runtime import param_states, runtime

__all__ = ['RUNNERS', 'check_grads', 'sparse_refusal', 'run_buckets', 'HOST_READ_DEVICES', 'read_on_host',
           'kernel_step_on_device', 'counts_as_numbers']


def _fused(opt, b: Bucket, hyper: Mapping) -> None:
    if (kernel := torch_kernel(b, hyper)) is not None: return kernel()
    fused_bucket(opt, b, hyper)


RUNNERS: dict[str, Callable] = {'loop': loop_bucket, 'foreach': foreach_bucket, 'fused': _fused, 'auto': auto_bucket}


def sparse_refusal(g: Mapping) -> str | None:
    """Why the group's chain cannot step a param with a sparse grad (None: it can): a per-param callback that does not
    declare `sparse_grads` (`cbopt.core.spec`), or one whose declaration refuses these hypers (torch's words)."""
    hyper = None
    for cb in param_chain(g['cbs']):
        ok = spec(cb).sparse_grads
        if ok is True or ok == 'only': continue
        if callable(ok):
            if hyper is None: hyper = Hypers(g).snapshot()
            if why := ok(**hyper): return why
            continue
        return f"{cb_name(cb)!r} in the chain [{chain_name(g['cbs'])}] does not support sparse gradients"
    return None


def check_grads(opt) -> None:
    """Before anything changes, refuse what no chain can step: a grad of another shape than its param, a grad that
    is not a floating-point tensor of the param's kind, a sparse grad that the chain does not take (`sparse_refusal`;
    Adagrad's and plain SGD's take one, as torch's do, and the loop runner steps it; torch's fused kernels take none),
    a dense grad where the chain takes only sparse ones (SparseAdam). The error names the param, and nothing is
    stepped: a step is all or nothing. Without whole-model callbacks it is called only when bucketing (which reads every
    grad anyway) meets an odd grad, so that a normal step pays for one more test per param, not another pass."""
    for g in opt.param_groups:
        why, only = False, None
        for name, p in zip(g['param_names'], g['params']):
            grad = p.grad
            if grad is None: continue
            if grad.is_sparse:
                if opt.backend_options.kind == 'fused':  # torch's words (its Adagrad's), then which param
                    raise RuntimeError(f"`fused` does not support sparse grad: param {name!r} has a sparse gradient "
                                       "(use foreach=False, or another backend)")
                if why is False: why = sparse_refusal(g)
                if why is not None:
                    raise RuntimeError(f"param {name!r} has a sparse gradient: {why} (densify it with grad.to_dense(), "
                                       "or use torch.optim.SparseAdam)")
                if p.is_complex(): raise RuntimeError(f"param {name!r} is complex: its sparse gradient is not supported")
                if grad.shape != p.shape:
                    raise RuntimeError(f"param {name!r} has shape {tuple(p.shape)} but its grad has shape {tuple(grad.shape)}")
                continue
            if only is None: only = next((cb for cb in param_chain(g['cbs']) if spec(cb).sparse_grads == 'only'), False)
            if only:
                raise RuntimeError(f"param {name!r} has a dense gradient: {cb_name(only)!r} does not support dense "
                                   "gradients (as torch's SparseAdam does not), please consider Adam instead")
            if grad.shape != p.shape:
                raise RuntimeError(f"param {name!r} has shape {tuple(p.shape)} but its grad has shape {tuple(grad.shape)}")
            if grad.dtype.is_floating_point != p.dtype.is_floating_point or grad.is_complex() != p.is_complex():
                raise TypeError(f"param {name!r} has dtype {p.dtype} but its grad has dtype {grad.dtype}")


def _check_fused_devices(buckets) -> None:
    """torch's fused optimizers refuse params on the 'meta' device (a model built there to be materialised later), where
    no kernel runs: torch's words (its test matches them), naming the param, before anything steps."""
    for b in buckets:
        if b.params and b.params[0].is_meta:
            name = b.group['param_names'][next(i for i, p in enumerate(b.group['params']) if p is b.params[0])]
            raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of supported devices "
                               f"(not 'meta'): param {name!r} is on the meta device; materialise the model first "
                               "(model.to_empty(device=...))")


def _sparse_aware(run: Callable) -> Callable:
    "`run`, but the loop runner for a bucket of params with sparse grads (torch's single-tensor path takes them)."
    def run_or_loop(opt, b: Bucket, hyper: Mapping) -> None:
        (loop_bucket if bucketing.is_sparse(b) else run)(opt, b, hyper)
    return run_or_loop


def run_buckets(opt, snapshots: Mapping, check: bool = False, scales: Mapping | None = None,
                 loss_scale: torch.Tensor | None = None) -> None:
    """The per-param chains over every param with a grad, with each group's hypers for this step (`check`: the grads).
    `scales` (id(group) -> (0-d tensor, in_place), from `clip_grad_norm`) multiply those groups' grads: inside torch's
    fused kernel where one steps the bucket (`fused`, `auto`; in place: the kernel's own `grad_scale`, which writes the
    clipped grads into them), on scaled copies of the bucket's grads otherwise (in place: one `_foreach_mul_`).
    `loss_scale` (GradScaler's) divides every grad, in place: inside torch's kernel, else just before the chain; it
    never reaches the loop backend, which does not claim GradScaler's protocol (`_step_supports_amp_scaling`)."""
    kind, scales = opt.backend_options.kind, scales or {}
    if not any(param_chain(g['cbs']) for g in opt.param_groups): return  # only whole-model callbacks (lbfgs)
    if (kinds := opt.group_backends()) is not None:
        return _run_group_backends(opt, snapshots, kinds, check, scales, loss_scale)
    if kind == 'loop':  # the reference needs no bucketing: one call per group
        todo = [(g, [p for p in g['params'] if p.grad is not None]) for g in opt.param_groups]
        if check and any(bucketing.grad_is_odd(p) for _, ps in todo for p in ps): check_grads(opt)
        for g, ps in todo:
            if not ps: continue
            if id(g) in scales: scale_grads(ps, *scales[id(g)])
            for c in lowbit_chunks(opt, Bucket(g, ps, [param_states(opt)[p] for p in ps])):  # (low-bit state: fp32 here)
                with as_real(c) as b: loop_bucket(opt, b, snapshots[id(g)])
        return
    run = RUNNERS[kind]
    buckets = bucketing.planned_buckets(opt, on_odd_grad=check_grads if check else None)
    if type(buckets) is bucketing.WithSparse: run = _sparse_aware(run)
    if kind == 'fused': _check_fused_devices(buckets)
    for whole in (q for b in buckets for q in bucketing.runs(b, snapshots, scales)):  # (a bucket of groups alike,
        hyper, (scale, in_place) = snapshots[id(whole.group)], scales.get(id(whole.group), (None, False))  # or theirs)
        if kind == 'fused' and fused_stored(opt, whole, hyper, scale, in_place, loss_scale): continue  # (low-bit)
        for c in lowbit_chunks(opt, whole):  # (low-bit state: each chunk's as fp32 tensors while it runs)
            with as_real(c) as b:  # complex params step as torch's do: on their real views
                if (scale is not None or loss_scale is not None) and kind in ('fused', 'auto') and not (
                        run is not RUNNERS[kind] and bucketing.is_sparse(b)):
                    if (kernel := torch_kernel(b, hyper, scale, loss_scale, scale_in_place=in_place)) is not None:
                        kernel()
                        continue
                if loss_scale is not None: unscale_grads(b.params, loss_scale)
                if scale is not None: scale_grads(b.params, scale, in_place)
                run(opt, b, hyper)


def _run_group_backends(opt, snapshots: Mapping, kinds: Mapping, check: bool, scales: Mapping,
                        loss_scale: torch.Tensor | None) -> None:
    """`run_buckets` where some groups step with their own runner (`kinds`: `Optimizer.group_backends`, torch's
    per-group `foreach`/`fused`): each bucket (of one group) with its group's, the others with the optimizer's."""
    kind = opt.backend_options.kind
    buckets = bucketing.planned_buckets(opt, on_odd_grad=check_grads if check else None)
    sparse = type(buckets) is bucketing.WithSparse
    for whole in (q for b in buckets for q in (b.parts or (b,))):  # (each group's own bucket: each has its runner)
        own = 'loop' if sparse and bucketing.is_sparse(whole) else kinds.get(id(whole.group), kind)
        if own == 'fused': _check_fused_devices([whole])
        hyper, (scale, in_place) = snapshots[id(whole.group)], scales.get(id(whole.group), (None, False))
        if own == 'fused' and fused_stored(opt, whole, hyper, scale, in_place, loss_scale): continue  # (low-bit)
        for c in lowbit_chunks(opt, whole):  # (low-bit state: each chunk's as fp32 tensors while it runs)
            with as_real(c) as b:
                if (scale is not None or loss_scale is not None) and own in ('fused', 'auto'):
                    if (kernel := torch_kernel(b, hyper, scale, loss_scale, scale_in_place=in_place)) is not None:
                        kernel()
                        continue
                if loss_scale is not None: unscale_grads(b.params, loss_scale)
                if scale is not None: scale_grads(b.params, scale, in_place)
                RUNNERS[own](opt, b, hyper)


HOST_READ_DEVICES = ('cpu',)  # where GradScaler's `found_inf` is read on the host: free there (no device to wait for)


def read_on_host(found_inf: torch.Tensor) -> bool:
    "Whether a step reads GradScaler's `found_inf` on the host (`HOST_READ_DEVICES`) rather than in the kernels."
    return found_inf.device.type in HOST_READ_DEVICES


def kernel_step_on_device(opt, snapshots: Mapping, found_inf: torch.Tensor, loss_scale: torch.Tensor | None) -> bool:
    """Step every bucket with torch's kernel, GradScaler's `found_inf` passed to it and never read on the host (no sync:
    torch's fused optimizers' way), where each bucket has one (the `auto` and `fused` backends, no whole-model
    callbacks: the caller's), `found_inf` is on an accelerator (`HOST_READ_DEVICES`) and no param is complex. Returns
    whether it stepped; False: nothing was touched, and the step reads `found_inf` (chains need their counts as numbers,
    and skip the step on the host). The kernels count the steps on the device (`kernels._counted_on_device`)."""
    if opt.backend_options.kind not in ('auto', 'fused') or read_on_host(found_inf): return False
    if any(g.get('state_precision', 'fp32') != 'fp32' for g in opt.param_groups): return False  # (`engine.lowbit`)
    if opt.group_backends() is not None: return False  # (groups with runners of their own: the step reads found_inf)
    if not any(param_chain(g['cbs']) for g in opt.param_groups): return False
    buckets = bucketing.planned_buckets(opt, on_odd_grad=check_grads)
    if type(buckets) is bucketing.WithSparse: return False  # (sparse grads step in the loop runner)
    if opt.backend_options.kind == 'fused': _check_fused_devices(buckets)
    runs = []
    for b in (q for b in buckets for q in bucketing.runs(b, snapshots)):
        if b.params[0].is_complex(): return False  # (a bucket has one dtype)
        if (run := torch_kernel(b, snapshots[id(b.group)], loss_scale=loss_scale, found_inf=found_inf)) is None:
            return False
        runs.append(run)
    runtime(opt).device_counts = True
    for run in runs: run()
    return True


def counts_as_numbers(opt) -> None:
    """The step counts `kernel_step_on_device` left on the device, as Python numbers again (one read of each device's
    counts): before a step whose chains or skip read them. Free where none are."""
    rt = runtime(opt)
    if not rt.device_counts: return
    todo: dict = {}  # device -> [(state, key, type)]
    for g in opt.param_groups:
        counters = chain_counters(g['cbs'])
        for p in g['params']:
            st = param_states(opt).get(p)
            for k, kind in counters.items():
                if st and isinstance(v := st.get(k), torch.Tensor): todo.setdefault(v.device, []).append((st, k, kind))
    for entries in todo.values():
        values = torch.stack([st[k] for st, k, _ in entries]).tolist()
        for (st, k, kind), v in zip(entries, values): st[k] = kind(v)
    rt.device_counts = False
