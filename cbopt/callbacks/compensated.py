"""Kahan-compensated param updates for low-precision (bf16, fp16) params, for any chain, without rewriting its step.

A bf16 param has 8 bits of mantissa: an update smaller than half its last bit is lost, and a long run of small updates
drifts far from the fp32 run. Kahan summation keeps what each update lost in a buffer of the param's dtype,
`kahan_comp`, and adds it back with the next update (torch-optimi's `kahan_sum`, op for op: `comp += update; old = p;
p += comp; comp += old - p`).

How a chain gets it: a step callback whose only effect on the param is `p.data += update`, computed without reading
`p.data`, declares `additive = True` (`sgd_step`, `adam_step`, `lion_step`, ...). `kahan(step)` runs that same callback
on a stand-in param whose `data` is the compensation buffer, so its update lands there, with the very ops it would
apply to the param (optimi's `kahan_comp.addcdiv_(...)` where its plain step does `param.addcdiv_(...)`), then adds the
buffer to the param and keeps the rounding error. The algorithm's math is not written twice, and every backend runs
it (loop, foreach on buckets, compiled). Weight decay stays outside (`p *= 1 - lr*wd`), as in optimi.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..core.chain import cached, cb_name, unwrap, zeros
from ..core.spec import spec

__all__ = ['kahan', 'kahan_chain']


class _Target:
    "The param as an additive step callback sees it under `kahan`: `data` is the compensation buffer, `grad` the grad."
    __slots__ = ('data', 'grad')

    def __init__(self, data, grad): self.data, self.grad = data, grad


@cached()  # one wrapper per step callback: chains compare equal, compiled chains are reused
def kahan(step: Callable) -> Callable:
    "`step` (an `additive` callback) with Kahan-compensated summation into the param; its state gains `kahan_comp`."
    f = unwrap(step)
    if not spec(step).additive:
        raise ValueError(f"kahan() needs a callback whose only effect on the param is `p.data += update` (declared "
                         f"`additive = True`); {cb_name(step)!r} does not declare it")

    @functools.wraps(f)
    def kahan_step(p, kahan_comp=None, **kwargs):
        if kahan_comp is None: kahan_comp = torch.zeros_like(p.data)
        new = step(_Target(kahan_comp, p.grad), **kwargs)  # the update, added into the compensation
        before = p.data.clone()
        p.data.add_(kahan_comp)
        kahan_comp.add_(before.sub_(p.data))  # what the param could not hold
        return {**(new or {}), 'kahan_comp': kahan_comp}
    kahan_step.__name__ = kahan_step.__qualname__ = f'kahan_{cb_name(step)}'
    kahan_step.state = {**(spec(step).state or {}), 'kahan_comp': zeros}
    kahan_step.state_kinds = {**spec(step).state_kinds, 'kahan_comp': 'exact'}
    kahan_step.additive = False  # it writes the param itself
    return kahan_step


def kahan_chain(cbs: list, kahan_sum: bool = True) -> list:
    "The chain `cbs` with its additive step callbacks Kahan-compensated (`kahan_sum=False`: as it is)."
    if not kahan_sum: return list(cbs)
    out = [kahan(cb) if spec(cb).additive else cb for cb in cbs]
    if out == list(cbs): raise ValueError("kahan_sum: no callback of the chain declares `additive = True`")
    return out
