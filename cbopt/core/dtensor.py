"""Params sharded by FSDP2 (`fully_shard`): `DTensor`s, each rank holding a shard. What the rest of cbopt needs to know
about them, in one place.

Elementwise math on a DTensor is the same math on each shard, and DTensor's own ops run it. A reduction over a whole
tensor (a norm, a mean) gives a partial DTensor that the next tensor op reduces across ranks, but `.item()` and
`float()` read the local, rank-dependent part: so cbopt never reads a Python number of one. What needs the whole
tensor (Muon's Newton-Schulz) gathers it (`on_whole`). Where torch's kernels take plain tensors only (its fused AdamW
kernel in slices, a compiled elementwise chain), they run on each rank's shard (`local`).

This module imports only `cbopt.chain`, and imports `torch.distributed.tensor` only if the user has: without it no
DTensor exists.
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable

import torch

from .chain import cb_name, chain_scope, unwrap

__all__ = ['is_dtensor', 'local', 'local_param', 'layout_key', 'as_like', 'on_whole', 'global_value', 'across_shards', 'any_across_shards',
           'dim0_shards', 'row_spans', 'shard_like', 'concat_shards', 'PartialNumberError', 'refusing_partial_numbers']


def _dtensor_module():
    return sys.modules.get('torch.distributed.tensor')


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def is_dtensor(t) -> bool:
    "Whether `t` is a DTensor (a param sharded by FSDP2, its grad or its state)."
    if type(t) in _PLAIN: return False  # (the common case, asked per param and step: no module lookup)
    mod = _dtensor_module()
    return mod is not None and isinstance(t, mod.DTensor)


def local(t):
    "This rank's shard of a DTensor (sharing its memory: writes reach the DTensor); any other value as it is."
    return t.to_local() if is_dtensor(t) else t


def local_param(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of the DTensor param `p` as a plain tensor sharing its memory, with its grad's shard as
    `.grad`: a stand-in that an elementwise chain steps exactly as it would step `p`."""
    q = p.to_local().detach()
    q.grad = p.grad.to_local().detach()
    return q


def layout_key(t) -> tuple | None:
    """What tensors of one foreach call must share beside device and dtype: a DTensor's mesh and placements (foreach
    kernels refuse a list mixing DTensors with plain tensors); None for a plain tensor."""
    return (t.device_mesh, tuple(t.placements)) if is_dtensor(t) else None


def as_like(shard: torch.Tensor, like) -> torch.Tensor:
    "`shard` (a plain tensor of this rank) as a DTensor laid out as `like`; unchanged where `like` is not a DTensor."
    if not is_dtensor(like): return shard
    return _dtensor_module().DTensor.from_local(shard, like.device_mesh, like.placements, run_check=False,
                                                shape=like.shape, stride=like.stride())


def shard_like(whole: torch.Tensor, like) -> torch.Tensor:
    """`whole` (a plain tensor every rank holds, of any shape whose dim 0 may be sharded) laid out as `like` is: each
    rank keeps its own part of it, with no communication. `whole` itself where `like` is not a DTensor."""
    if not is_dtensor(like): return whole
    return _dtensor_module().distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None)


def on_whole(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` for a function that needs all of `x` at once (Muon's orthogonalisation): for a DTensor, `fn` of the whole
    tensor, gathered on every rank, and the result laid out as `x` is (each rank keeping its own shard of it)."""
    if not is_dtensor(x): return fn(x)
    return shard_like(fn(x.full_tensor()), x)


def global_value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor holding the global value of `t`: a partial DTensor (a norm of a shard) reduced across ranks, so
    `.item()` is the same on every rank; a plain tensor as it is."""
    return t.full_tensor() if is_dtensor(t) else t


def across_shards(value: torch.Tensor, like, op: str) -> torch.Tensor:
    """`value` (a 0-d tensor computed from this rank's shard of `like`) reduced with `op` ('sum', 'max') over the ranks
    sharding `like`: one all-reduce, the same result on every rank; as it is where `like` is not a DTensor."""
    if not is_dtensor(like): return value
    from torch.distributed.tensor import Partial, Replicate
    placements = [Replicate() if p.is_replicate() else Partial(op) for p in like.placements]
    return _dtensor_module().DTensor.from_local(value, like.device_mesh, placements, run_check=False).full_tensor()


def any_across_shards(flag: torch.Tensor, like) -> torch.Tensor:
    """Whether `flag` (a 0-d bool tensor computed from this rank's shard of `like`) holds on any rank, so every rank
    decides the same. Counted as a sum: a max would let an all-reduce drop a NaN."""
    return across_shards(flag.to(torch.int32), like, 'sum') > 0


def dim0_shards(t) -> tuple[int, int]:
    """How many shards dim 0 of `t` is split into, and which of them this rank holds: `(1, 0)` for a plain or
    replicated tensor; FSDP2's `Shard(0)`, or HSDP's `(Replicate(), Shard(0))`, over its mesh dim. What a rank needs to
    know where its shard lies in the whole tensor (`row_spans`). Any other layout (TP's `Shard(1)`, dim 0 sharded on
    two mesh dims, a strided shard) raises ValueError, naming its placements."""
    if not is_dtensor(t): return 1, 0
    n, me = 1, 0
    for d, pl in enumerate(t.placements):
        if pl.is_replicate(): continue
        if type(pl).__name__ == 'Shard' and pl.is_shard(0) and n == 1:
            n, me = t.device_mesh.size(d), t.device_mesh.get_local_rank(d)
            continue
        raise ValueError(f"a DTensor with placements {tuple(t.placements)}: only dim 0 sharded over one mesh dim "
                         "(FSDP2's Shard(0)) is supported here")
    return n, me


def row_spans(rows: int, n: int) -> list[tuple[int, int]]:
    """Where each of `n` shards of `rows` rows lies: `(first row, rows)` per shard, by `torch.chunk`'s rule, which
    DTensor's `Shard` follows (shards of `ceil(rows / n)` rows, the last ones shorter or empty)."""
    size = -(-rows // n) if rows else 0
    return [(min(r * size, rows), max(0, min(rows, (r + 1) * size) - min(r * size, rows))) for r in range(n)]


def concat_shards(piece: torch.Tensor, like, sizes: list[int]) -> torch.Tensor:
    """The 1-D tensor whose part on shard `i` of dim 0 of the DTensor `like` is `sizes[i]` elements (this rank's:
    `piece`, 1-D), end to end, laid out as `like` is on dim 0 (a DTensor of `sum(sizes)` elements, each rank keeping
    its `torch.chunk` share). Where `sizes` are that share already, `piece` is it, with no communication; else the
    pieces are gathered and split anew (a collective: every rank calls it). For pieces whose sizes follow another rule
    than the chunk rule (low-bit state's codes of a shard: its own blocks)."""
    n, me = dim0_shards(like)
    total = sum(sizes)
    dt = _dtensor_module().DTensor
    if [c for _, c in row_spans(total, n)] == list(sizes):
        return dt.from_local(piece, like.device_mesh, like.placements, run_check=False, shape=(total,), stride=(1,))
    size = max(sizes)
    padded = torch.nn.functional.pad(piece, (0, size - piece.numel())) if piece.numel() < size else piece
    every = dt.from_local(padded, like.device_mesh, like.placements, run_check=False, shape=(n * size,), stride=(1,))
    every = every.full_tensor().view(n, size)
    return shard_like(torch.cat([every[r, :c] for r, c in enumerate(sizes)]), like)


class PartialNumberError(RuntimeError):
    "A callback read a Python number of a partial DTensor: this rank's part of a reduction, not its value."


class _RefusePartialNumbers(torch.overrides.TorchFunctionMode):
    "While a chain that may reduce steps DTensors: `.item()`, `float()`... of a partial DTensor is an error."
    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__bool__,
             torch.Tensor.__index__}

    def __init__(self, cbs: Iterable[Callable]):
        super().__init__()
        self.names = {getattr(unwrap(cb), '__code__', None): cb_name(cb) for cb in cbs}

    def _culprit(self) -> str:
        "The callback of the chain whose code is running (the innermost), from the Python stack."
        f = sys._getframe()
        while f is not None:
            if f.f_code in self.names: return f"callback {self.names[f.f_code]!r}"
            f = f.f_back
        return "a callback"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS and args and is_dtensor(args[0]) and any(p.is_partial() for p in args[0].placements):
            raise PartialNumberError(
                f"{self._culprit()} read a Python number ({func.__name__}) of a DTensor reduced over this rank's shard "
                f"only (placements {tuple(args[0].placements)}): on FSDP2's sharded params its value differs by rank. "
                "Keep it a tensor (torch.where, clamp): the next tensor op reduces it across ranks")
        return func(*args, **(kwargs or {}))


def refusing_partial_numbers(cbs: Iterable[Callable], p) -> contextlib.AbstractContextManager:
    """A context in which a chain stepping `p` (a param or a bucket's first) may not read a Python number of a partial
    DTensor (`PartialNumberError`, naming the callback): where `p` is a DTensor and the chain is not declared
    elementwise. Elsewhere it does nothing and costs nothing."""
    if not is_dtensor(p) or chain_scope(cbs) == 'element': return contextlib.nullcontext()
    return _RefusePartialNumbers(cbs)
