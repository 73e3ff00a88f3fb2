"""The engine's one hook for low-bit state (`state_precision=`, `cbopt.state.lowbit`): every runner steps a chunk of a
bucket whose stored entries were turned into fp32 tensors just before (`chunks`), and stored again just after, so the
whole chain (the param update included) computes with this step's fp32 state, as bitsandbytes and torchao do, and no
runner knows the state was ever low-bit. A bucket is taken in chunks of about `CHUNK_BYTES` of fp32 state, so a step
never holds more than one chunk's state in fp32 beside the stored state.
"""
from __future__ import annotations

from collections.abc import Iterator

from ..core.runtime import warn_once
from ..state.lowbit import pack, param_plan, precision, unkinded, unpack
from .buckets import Bucket

__all__ = ['CHUNK_BYTES', 'chunks']

CHUNK_BYTES = 64 << 20
"""About how many bytes of fp32 state a chunk of a low-bit bucket holds at once (a larger param alone)."""


def chunks(opt, b: Bucket) -> Iterator[Bucket]:
    """`b` as it is when its group keeps fp32 state; else in chunks, each given with its stored entries as fp32 tensors
    and stored again when the caller is done with it (also when the chain raised)."""
    if precision(b.group) == 'fp32':
        yield b
        return
    if bad := unkinded(tuple(b.group['cbs'])):
        warn_once(opt, ('lowbit', bad), f"state_precision={precision(b.group)!r}: the callback(s) {', '.join(bad)} "
                  "declare no kind for their state (cb.state_kinds, see cbopt.core.spec), which is kept in fp32")
    plans = [param_plan(b.group, p) for p in b.params]
    if not any(plans):
        yield b
        return
    start, size = 0, 0
    for i, (p, plan) in enumerate(zip(b.params, plans)):
        n = p.numel() * 4 * len(plan)
        if i > start and size + n > CHUNK_BYTES:
            yield from _unpacked(b, start, i, plans)
            start, size = i, 0
        size += n
    yield from _unpacked(b, start, len(b.params), plans)


def _unpacked(b: Bucket, start: int, stop: int, plans: list) -> Iterator[Bucket]:
    chunk = Bucket(b.group, b.params[start:stop], b.states[start:stop])
    for p, st, plan in zip(chunk.params, chunk.states, plans[start:stop]): unpack(st, p, plan)
    try: yield chunk
    finally:
        for p, st, plan in zip(chunk.params, chunk.states, plans[start:stop]): pack(st, p, plan)
