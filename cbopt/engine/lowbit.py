"""The engine's one hook for low-bit state (`state_precision=`, `cbopt.state.lowbit`): every runner steps a chunk of a
bucket whose stored entries were turned into fp32 tensors just before (`chunks`), and stored again just after, so the
whole chain (the param update included) computes with this step's fp32 state, as bitsandbytes and torchao do, and no
runner knows the state was ever low-bit. A bucket is taken in chunks of about `CHUNK_BYTES` of fp32 state, so a step
never holds more than one chunk's state in fp32 beside the stored state.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from ..core.quant import FORMATS, code_table
from ..core.runtime import runtime, warn_once
from ..state.lowbit import pack, param_plan, precision, unkinded, unpack
from .buckets import Bucket
from .compiled import CompileFailed, compiled_bucket
from .foreach import foreach_bucket
from .scaling import scale_grads, unscale_grads

__all__ = ['GRAPH_RUN', 'GRAPH_PIECES', 'CHUNK_BYTES', 'chunks', 'graph_plan', 'fused_stored']

GRAPH_RUN = 1
"""How many params one call of the low-bit graph steps (`fused_stored`): its dequantize and quantize ops make a
param's part of a graph several times the chain's, and compile time grows with the params a graph unrolls; one
param per call costs about 0.3 ms of Python each, small next to a param of `min_quantize_size` or more."""

GRAPH_PIECES = (1 << 18, 1 << 22)
"""`(size, above)`: a param of more than `above` elements steps in pieces of `size`, one call of the low-bit graph
each (a multiple of every format's block; `cbopt.engine.compiled`'s `_in_pieces`). The graph's fp32 temporaries (the
stepped moments before they are quantized) are then a piece's, 1 MiB each, which the allocator reuses and which stay
in cache, where a large param's are fresh pages at each call (over 32 MiB, glibc maps them anew: page faults were a
quarter of the step of GPT-2's 38.6M-element embedding). Measured on one thread of a loaded 2-core EPYC, one param,
in one process: its 8-bit step 14x -> 7.9x the fp32 fused step for the embedding, 10.4x -> 6.5x for 2048x4096; a
param of 4.2M elements or less steps faster whole (each call costs about 0.3 ms of Python: 5.5x whole, 7.1x in
pieces)."""

CHUNK_BYTES = 64 << 20
"""About how many bytes of fp32 state a chunk of a low-bit bucket holds at once (a larger param alone)."""


def chunks(opt, b: Bucket) -> Iterator[Bucket]:
    """`b` as it is when its group keeps fp32 state; else in chunks, each given with its stored entries as fp32 tensors
    and stored again when the caller is done with it (also when the chain raised)."""
    if precision(b.group) == 'fp32':
        yield b
        return
    _warn_unkinded(opt, b)
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


def _warn_unkinded(opt, b: Bucket) -> None:
    if bad := unkinded(tuple(b.group['cbs'])):
        warn_once(opt, ('lowbit', bad), f"state_precision={precision(b.group)!r}: the callback(s) {', '.join(bad)} "
                  "declare no kind for their state (cb.state_kinds, see cbopt.core.spec), which is kept in fp32")


def graph_plan(opt, b: Bucket) -> dict | None:
    """The low-bit plan (`param_plan`) that the fused runner's graph can take for `b` as it is stored, or None: a
    block format (8-bit, 4-bit, fp8: no random draws, which bf16's stochastic rounding would take from another
    generator in a graph) for every entry, the state already stored (the first step, which creates it, is eager, as
    the fused runner's always is), dense grads of the params' dtype (what dynamo traces), a chain not refused before.
    A DTensor shard's stored parts are its own blocks' (`cbopt.state.lowbit.pack`): its graph steps its local tensors."""
    if precision(b.group) not in FORMATS: return None
    p, st = b.params[0], b.states[0]
    plan = param_plan(b.group, p)
    if not plan or any(fmt not in FORMATS or f'{k}.codes' not in st for k, (fmt, _) in plan.items()): return None
    if any(q.grad is None or q.grad.is_sparse or q.grad.dtype != q.dtype for q in b.params): return None
    if ('lowbit', b.layout) in runtime(opt).no_compile: return None
    return plan


def fused_stored(opt, b: Bucket, hyper: Mapping, scale: torch.Tensor | None = None, in_place: bool = False,
                 loss_scale: torch.Tensor | None = None) -> bool:
    """Step `b` with the fused runner's compiled chain on its stored low-bit state (`graph_plan`), dequantized,
    stepped and quantized again in one graph (flat runs where the chain is elementwise: one graph for the sizes of
    whole blocks, one for the rest, whatever the shapes), so no fp32 copy of the state is ever in memory; the grad
    scales (clipping's `scale`, GradScaler's `loss_scale`) applied first, as `run_buckets` does where no kernel takes
    them. False (nothing done) where it cannot: then `chunks` and a runner step it. A chain that does not compile
    runs with foreach on `chunks`, warning once."""
    plan = graph_plan(opt, b)
    if plan is None: return False
    _warn_unkinded(opt, b)
    for fmt, signed in plan.values():  # (made here, eagerly: the graph reads them as constants)
        if fmt != 'fp8': code_table(fmt, signed, b.params[0].device)
    if loss_scale is not None: unscale_grads(b.params, loss_scale)
    if scale is not None: scale_grads(b.params, scale, in_place)
    try: compiled_bucket(opt, b, hyper, stored=plan, run=GRAPH_RUN, pieces=GRAPH_PIECES)
    except CompileFailed as e:
        runtime(opt).no_compile.add(('lowbit', b.layout))
        warn_once(opt, ('compile', 'lowbit', b.layout), "the callback chain could not be compiled with its low-bit "
                  f"state ({type(e.err).__name__}: {e.err}); running it with the foreach backend")
        for c in chunks(opt, e.rest): foreach_bucket(opt, c, hyper)
    return True
