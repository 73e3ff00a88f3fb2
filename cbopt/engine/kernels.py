"""torch's fused kernels, used when one computes exactly what a chain computes.

A recipe registers its chain with the kernel that does the same math (`register_kernel(adam_chain(), fused_adamw)`
in `cbopt.optimizers`), so the engine never imports recipes. A kernel adapter takes a bucket and its hypers and
returns a function stepping the whole bucket, or None when the bucket is outside what the kernel handles.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from ..chain import chain_sig
from ..hypers import is_model_entry
from .buckets import Bucket

__all__ = ['register_kernel', 'torch_kernel', 'fused_adamw']

Kernel = Callable[[Bucket, Mapping], 'Callable[[], None] | None']
KERNELS: dict[tuple, Kernel] = {}  # chain_sig -> kernel adapter


def register_kernel(cbs: Iterable[Callable], kernel: Kernel) -> None:
    "Use `kernel` for every bucket whose group runs exactly the chain `cbs`."
    KERNELS[chain_sig(cbs)] = kernel


def torch_kernel(b: Bucket, hyper: Mapping) -> Callable[[], None] | None:
    "A function stepping `b` with torch's fused kernel for its chain, or None if none applies."
    kernel = KERNELS.get(chain_sig(b.cbs))
    return None if kernel is None else kernel(b, hyper)


def _is_float(*vs) -> bool: return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vs)


def fused_adamw(b: Bucket, hyper: Mapping, maximize: bool = False) -> Callable[[], None] | None:
    """`torch._fused_adamw_` doing exactly what cbopt's AdamW chain does to `b` (with `maximize`: the chain after
    `negate_grad`), or None if it does not apply."""
    st, p0 = b.states[0], b.params[0]
    # whole-model callbacks' per-param buffers ('accumulate_grads.grad_sum') are theirs, not the chain's: ignored here
    if {k for k in st if not is_model_entry(k)} - {'do_wd', 'force_train'} != {'grad_avg', 'sqr_avg', 'step'}: return None
    if 'dampening' in hyper or not _is_float(hyper['lr'], hyper['mom'], hyper['sqr_mom'], hyper['eps'], hyper['wd']): return None
    if p0.device.type not in ('cpu', 'cuda') or p0.dtype not in (torch.float32, torch.float64): return None
    if any(s[k].dtype != p0.dtype for s in b.states for k in ('grad_avg', 'sqr_avg')): return None
    if any(p.grad.dtype != p0.dtype for p in b.params): return None
    # the kernel walks grads and state in the param's memory order: all strides must match (a transposed param with a
    # contiguous grad, channels_last) or it silently pairs the wrong elements
    if any(p.grad.stride() != p.stride() or s['grad_avg'].stride() != p.stride() or s['sqr_avg'].stride() != p.stride()
           for p, s in zip(b.params, b.states)): return None
    def run():
        step = st['step'] + 1
        steps = [torch.tensor(float(step), device=p0.device)] * len(b.params)
        torch._fused_adamw_(b.params, [p.grad for p in b.params], [s['grad_avg'] for s in b.states],
                            [s['sqr_avg'] for s in b.states], [], steps, lr=hyper['lr'], beta1=hyper['mom'],
                            beta2=hyper['sqr_mom'], weight_decay=hyper['wd'] if st.get('do_wd', True) else 0.,
                            eps=hyper['eps'], amsgrad=False, maximize=maximize)
        for s in b.states: s['step'] = step
    return run
