"""Low-bit optimizer state (`state_precision=`): which state entries of a param are stored how, and the conversion
of a param's state dict between its stored form and the fp32 form its chain computes with.

A group's `state_precision` (`PRECISIONS`) and the kind each callback declares for its entries (`cb.state_kinds`:
`cbopt.core.spec.STATE_KINDS`) decide each entry's storage (`entry_format`): a signed moving average in the format's
signed map, a non-negative one in its unsigned map (fp8 and bf16 have one form for both), an accumulator in bf16
with stochastic rounding, an exact entry (a step count, a mask, slow weights, a Kahan buffer) never quantized; an entry
without a kind stays fp32. Only entries of the param's size are stored low-bit, and only for params of at least
`min_quantize_size` elements (bitsandbytes' `min_8bit_size`; decided on the whole param's size, so a shard of a
sharded param is stored as the whole param is), real ones (a complex param's state stays as it is).

A stored entry is plain named tensors in the param's state dict, what checkpoints hold (and `torch.load(...,
weights_only=True)` reads): `'<entry>.codes'` (uint8; 4-bit packs two codes per byte) and `'<entry>.absmax'` (fp32,
one per block) for 8-bit and 4-bit, `'<entry>.codes'` (float8_e4m3fn) and `'<entry>.scale'` for fp8, the entry itself
as a bf16 tensor for bf16. The engine turns a chunk's stored entries into fp32 tensors before the chain (`unpack`)
and stores them again after it (`pack`): `cbopt.engine.lowbit`. The number formats are `cbopt.core.quant`'s.

A param sharded by FSDP2 (a DTensor, `Shard(0)`): whether it is quantized is decided on the whole tensor's size; each
rank stores its own shard's entries in blocks of its own (plain tensors, no communication in a step), which are the
whole tensor's blocks, so the codes one process stores, wherever each shard starts on a block boundary
(`blocks_line_up`: always where a row is whole blocks); elsewhere each shard is quantized as a param of its own
would be. A checkpoint holds the whole tensor's parts, as one process stores them, as DTensors (`whole_parts`, a
collective), and a load takes this rank's blocks from them (`load_entry`): DCP reshards it to any number of ranks.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..core.chain import cached, param_chain
from ..core.dtensor import as_like, concat_shards, dim0_shards, global_value, is_dtensor, local, row_spans, shard_like
from ..core.quant import FORMATS, bf16_stochastic, dequantize, n_blocks, quantize
from ..core.runtime import param_states
from ..core.spec import spec

if TYPE_CHECKING: from ..optimizer import Optimizer

__all__ = ['PRECISIONS', 'MIN_QUANTIZE_SIZE', 'SETTINGS', 'group_settings', 'check_settings', 'precision', 'chain_kinds', 'unkinded',
           'entry_format', 'param_plan', 'pack', 'unpack', 'Packed', 'logical', 'load_entry', 'stored', 'state_bytes',
           'dequantized_state', 'stored_part', 'stored_base', 'torch_stored_name', 'blocks_line_up', 'whole_parts']

PRECISIONS = ('fp32', 'bf16', '8bit', '4bit', 'fp8')
"""The values of `state_precision=`: fp32 state (the default), bf16 with stochastic rounding, block-wise 8-bit,
4-bit or fp8 (`cbopt.core.quant`)."""
MIN_QUANTIZE_SIZE = 4096
"""Params with fewer elements keep fp32 state in every format (bitsandbytes' `min_8bit_size`): their state is
little memory, and a block's scale would cost as much as its codes."""
SETTINGS = ('state_precision', 'min_quantize_size')
"""The group entries of low-bit state: shown in `param_groups`, saved with each group, never hypers."""
_PARTS = ('codes', 'absmax', 'scale')


def group_settings(group: Mapping) -> dict:
    """The low-bit settings (`SETTINGS`) `group` holds: what a group made from it keeps (a wrapper's, a checkpoint's, a
    torch-format group's), so that its state is stored as it was."""
    return {k: group[k] for k in SETTINGS if k in group}


def check_settings(precision_: Any, min_size: Any, where: str = '', params: Iterable = ()) -> None:
    """Refuse an unknown `state_precision` or a `min_quantize_size` that is not an int >= 1, naming the group; and
    low-bit state for DTensor params sharded other than on dim 0 (FSDP2's `Shard(0)`, HSDP's): a rank must know where
    its shard lies in the whole tensor to save its blocks as one process's (`whole_parts`)."""
    if precision_ not in PRECISIONS:
        raise ValueError(f"state_precision={precision_!r}{where}: expected one of {PRECISIONS}")
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1:
        raise ValueError(f"min_quantize_size={min_size!r}{where}: expected an int >= 1")
    if precision_ != 'fp32':
        for i, p in enumerate(params):
            if not is_dtensor(p): continue
            try: dim0_shards(p)
            except ValueError as e:
                raise NotImplementedError(f"state_precision={precision_!r}{where}, param {i}: {e}; keep "
                                          "state_precision='fp32' for it") from None


def precision(group: Mapping) -> str:
    "The group's `state_precision` ('fp32' where it has none)."
    return group.get('state_precision', 'fp32')


@cached(maxsize=256)
def chain_kinds(cbs: tuple) -> dict[str, str]:
    "The kind of each per-param state entry its callbacks declare (`cb.state_kinds`), for the chain `cbs`."
    out: dict[str, str] = {}
    for cb in param_chain(cbs): out.update(spec(cb).state_kinds)
    return out


@cached(maxsize=256)
def unkinded(cbs: tuple) -> tuple[str, ...]:
    """The callbacks of a chain whose state low-bit storage cannot place: undeclared ones (fastai's style), and those
    declaring entries without a kind. Their entries stay fp32."""
    out = []
    for cb in param_chain(cbs):
        s = spec(cb)
        if s.state is None or any(k not in s.state_kinds for k in s.state): out.append(s.name)
    return tuple(out)


def entry_format(precision_: str, kind: str | None) -> str | None:
    """How an entry of kind `kind` is stored at `precision_`: a name in `cbopt.core.quant.FORMATS`, 'bf16', or None
    (as the chain made it: exact entries, entries without a kind, fp32)."""
    if precision_ == 'fp32' or kind in (None, 'exact'): return None
    if kind == 'accumulator': return 'bf16'
    return precision_


def _numel(p: torch.Tensor) -> int:
    "The whole param's size (a DTensor's `numel` is the global one): where a shard's storage is decided."
    return p.numel()


def param_plan(group: Mapping, p: torch.Tensor) -> dict[str, tuple[str, bool]]:
    """Which of `p`'s entries are stored low-bit in `group`, and how: entry -> (format, signed). Empty for an fp32
    group, a param under `min_quantize_size` elements, a complex or non-float param."""
    prec = precision(group)
    if prec == 'fp32' or not p.is_floating_point() or _numel(p) < group.get('min_quantize_size', MIN_QUANTIZE_SIZE):
        return {}
    return _plan(tuple(group['cbs']), prec, p.dtype == torch.bfloat16)


@cached(maxsize=256)
def _plan(cbs: tuple, prec: str, bf16_param: bool) -> dict:
    out = {}
    for k, kind in chain_kinds(cbs).items():
        fmt = entry_format(prec, kind)
        if fmt is None or (fmt == 'bf16' and bf16_param): continue  # (a bf16 param's state is bf16 already)
        out[k] = (fmt, kind != 'nonnegative')
    return out


def _is_entry(v: Any, p: torch.Tensor) -> bool:
    "Whether a state value is a tensor of the param's size, in floating point: what low-bit storage takes."
    return isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() == p.numel()


def pack(st: dict, p: torch.Tensor, plan: Mapping, stochastic: bool = True) -> None:
    """Store `p`'s fp32 entries of `st` (in place) as `plan` says: each replaced by its parts (at the end of the dict,
    so a step leaves the keys in one order). Entries already stored, or absent, are left. `stochastic=False`: bf16
    entries are rounded to nearest (a load's one conversion, which then draws nothing from torch's RNG: a bf16
    checkpoint loads exactly, and a resumed run draws what the uninterrupted one would)."""
    for k, (fmt, signed) in plan.items():
        v = st.get(k)
        if not _is_entry(v, p): continue
        if fmt == 'bf16':
            if v.dtype == torch.bfloat16: continue
            del st[k]
            lv = local(v)
            st[k] = as_like(bf16_stochastic(lv).view(lv.shape) if stochastic else lv.to(torch.bfloat16), v)
            continue
        codes, scale = quantize(local(v), fmt, signed)  # (a DTensor's: its shard's blocks, kept as plain tensors)
        del st[k]
        st[f'{k}.codes'], st[f'{k}.{FORMATS[fmt].scale_key}'] = codes, scale


def unpack(st: dict, p: torch.Tensor, plan: Mapping) -> None:
    "The inverse of `pack`, in place: each stored entry of `st` as a tensor of `p`'s shape and dtype."
    for k, (fmt, signed) in plan.items():
        if fmt == 'bf16':
            v = st.get(k)
            if isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16 and p.dtype != torch.bfloat16: st[k] = v.to(p.dtype)
            continue
        codes = st.pop(f'{k}.codes', None)
        if codes is None: continue
        scale = st.pop(f'{k}.{FORMATS[fmt].scale_key}')
        lp = local(p)
        st[k] = as_like(dequantize(codes, scale, fmt, signed, lp.numel(), p.dtype).view(lp.shape), p)


def state_bytes(opt: Optimizer) -> int:
    """The bytes of state tensors `opt` holds for its params (codes, scales, fp32 and bf16 entries alike; the shared
    quantization maps and Python numbers not counted; a sharded param's on this rank): what `state_precision=` saves."""
    seen, total = set(), 0
    for st in param_states(opt).values():
        if not isinstance(st, Mapping): continue
        for v in st.values():
            if isinstance(v, torch.Tensor) and id(v) not in seen:
                seen.add(id(v))
                total += local(v).numel() * v.element_size()  # (a DTensor's: this rank's shard)
    return total


# -- checkpoints --------------------------------------------------------------------------------------------------
class Packed(NamedTuple):
    "A stored entry read from a checkpoint: its format and parts (`codes`, and `absmax` or `scale`)."
    fmt: str
    codes: torch.Tensor
    scale: torch.Tensor

    def dequantized(self, signed: bool, p: torch.Tensor) -> torch.Tensor:
        "The whole entry in fp32 (`p`'s dtype), laid out as `p` is (a DTensor's parts gathered first: a collective)."
        codes, scale = _whole(self.codes), _whole(self.scale)
        whole = dequantize(codes.to(p.device), scale.to(p.device, torch.float32), self.fmt, signed, p.numel(), p.dtype)
        return shard_like(whole.view(p.shape), p)


def logical(st: Mapping, p: torch.Tensor, fmt: str, what: str, like: bool = False) -> dict:
    """A param's state (a checkpoint's, or this optimizer's own with `like`) by entry: the parts of each stored entry
    as one `Packed` (`fmt`: the precision of the group that stored it), or with `like` a stand-in of the entry's fp32
    shape, dtype and device (for the load's checks). Parts that do not make an entry (a missing absmax, codes of
    another size, an unknown format) are refused, naming the entry and `what` ("param 'w'")."""
    out, parts = {}, {}
    for key, v in st.items():
        base, _, part = key.rpartition('.') if isinstance(key, str) else ('', '', '')
        if base and part in _PARTS: parts.setdefault(base, {})[part] = v
        else: out[key] = v
    for base, got in parts.items():
        f = FORMATS.get(fmt)
        if f is None:
            raise ValueError(f"state {base!r} of {what} is stored as {sorted(got)}, but its group's state_precision is "
                             f"{fmt!r}, which has no such parts (expected one of {tuple(FORMATS)}): an unknown format")
        need = ('codes', f.scale_key)
        for k in need:
            if k not in got: raise ValueError(f"state {base!r} of {what} ({fmt}) has no {base + '.' + k!r} in the state_dict")
        for k in got:
            if k not in need:
                raise ValueError(f"state {base!r} of {what} ({fmt}) has {base + '.' + k!r}, which {fmt} does not store "
                                 f"(it stores {[base + '.' + n for n in need]})")
        codes, scale = got['codes'], got[f.scale_key]
        numel = local(p).numel() if like else p.numel()  # (a sharded param's own: its shard's; a checkpoint's: whole)
        if not isinstance(codes, torch.Tensor) or codes.dtype != f.codes_dtype or codes.shape != (f.codes_numel(numel),):
            raise ValueError(f"state {base!r} of {what} ({fmt}): {base + '.codes'!r} should be a {f.codes_dtype} tensor of "
                             f"shape ({f.codes_numel(numel)},) for {numel} elements, got "
                             f"{_describe(codes)}")
        nb = n_blocks(numel, f.block)
        if not isinstance(scale, torch.Tensor) or not scale.is_floating_point() or scale.shape != (nb,):
            raise ValueError(f"state {base!r} of {what} ({fmt}): {base + '.' + f.scale_key!r} should be a float tensor "
                             f"of shape ({nb},), got {_describe(scale)}")
        out[base] = torch.empty((), dtype=p.dtype, device=p.device).expand(p.shape) if like else Packed(fmt, codes, scale)
    if like:
        for key, v in out.items():
            if isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16 and p.dtype != torch.bfloat16 and v.shape == p.shape:
                out[key] = torch.empty((), dtype=p.dtype, device=p.device).expand(p.shape)  # a bf16-stored entry
    return out


def stored_part(key: str) -> str | None:
    "The part a state key names ('codes', 'absmax', 'scale' of `'grad_avg.codes'`), or None for a whole entry."
    base, _, part = key.rpartition('.')
    return part if base and part in _PARTS else None


def stored_base(key: str) -> str:
    "The entry a state key belongs to: `'grad_avg'` for `'grad_avg.codes'` and for `'grad_avg'`."
    return key.rpartition('.')[0] if stored_part(key) else key


def torch_stored_name(key: str, names: Mapping[str, str]) -> str:
    "A state key by torch's names (`names`: cbopt's -> torch's): `'grad_avg.codes'` -> `'exp_avg.codes'`."
    part = stored_part(key)
    if part is None: return names.get(key, key)
    base = stored_base(key)
    return f'{names.get(base, base)}.{part}'


def _describe(v: Any) -> str:
    return f"{v.dtype} of shape {tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__


def load_entry(value: Any, like: Any, p: torch.Tensor, plan: Mapping, key: str, kinds: Mapping,
               load_value: Callable[[Any], Any]) -> Any:
    """One entry of a checkpoint's state, as this optimizer stores it: a `Packed` entry in this optimizer's format for
    it is taken as it is (bit for bit), another is dequantized and then loaded as an fp32 entry is (`load_value`,
    checked against `like`). For a DTensor param: this rank's shard of a whole entry, whatever the world size that
    saved it (gathered where it is a DTensor: a collective); for a plain param, a DTensor entry whole."""
    if isinstance(value, Packed):
        mine = plan.get(key)
        if mine is not None and mine[0] == value.fmt:
            if is_dtensor(p): return value._replace(**dict(zip(('codes', 'scale'), _shard_parts(value, p, mine[1]))))
            return value._replace(codes=_whole(value.codes).to(p.device, copy=True),
                                  scale=_whole(value.scale).to(p.device, torch.float32, copy=True))
        if key not in kinds:
            raise ValueError(f"state {key!r} is stored quantized in the state_dict, but this chain declares no kind "
                             "for it (cb.state_kinds): cannot tell its map")
        value = value.dequantized(kinds[key] != 'nonnegative', p)
    elif is_dtensor(p) and isinstance(value, torch.Tensor) and not is_dtensor(value) and value.shape == p.shape:
        value = shard_like(value, p)  # (a whole entry, from one process's checkpoint: this rank's shard of it)
    elif is_dtensor(value) and not is_dtensor(p): value = global_value(value)  # (a sharded run's, into a plain param)
    return load_value(value)


def stored(st: dict, p: torch.Tensor, plan: Mapping) -> dict:
    "A loaded state (`load_entry`'s values) as the engine keeps it: `Packed` entries as their parts, fp32 ones packed."
    out = {}
    for k, v in st.items():
        if isinstance(v, Packed): out[f'{k}.codes'], out[f'{k}.{FORMATS[v.fmt].scale_key}'] = v.codes, v.scale
        else: out[k] = v
    pack(out, p, plan, stochastic=False)
    return out


# -- params sharded by FSDP2 ---------------------------------------------------------------------------------------
def _whole(t: Any) -> Any:
    """A checkpoint's part whole: a DTensor gathered (a collective), fp8 codes as their bytes (collectives have no
    float8 type: gloo refuses it); anything else as it is."""
    if not is_dtensor(t): return t
    if t.element_size() == 1 and t.dtype != torch.uint8:
        return as_like(t.to_local().view(torch.uint8), t).full_tensor().view(t.dtype)
    return t.full_tensor()


def _spans(p: torch.Tensor) -> tuple[list[tuple[int, int]], int]:
    """Where each shard of `p` (a DTensor sharded on dim 0) lies in the whole flattened tensor, `(offset, numel)` per
    shard, and which shard is this rank's."""
    n, me = dim0_shards(p)
    rows = p.shape[0] if p.ndim else 1
    row = p.numel() // rows if rows else 0
    spans = [(start * row, count * row) for start, count in row_spans(rows, n)]
    if spans[me][1] != local(p).numel():
        raise RuntimeError(f"a shard of {spans[me][1]} elements was expected on this rank, it holds {local(p).numel()}")
    return spans, me


def blocks_line_up(p: torch.Tensor, fmt: str) -> bool:
    """Whether every shard of `p` (a DTensor sharded on dim 0) starts on a block boundary of the whole tensor, so that
    the blocks each rank quantizes its shard in are the blocks one process quantizes the whole tensor in: always when
    each row of `p` is whole blocks (a multiple of 256 elements for 8-bit and fp8, 128 for 4-bit), else when the rows
    of a shard are (`ceil(rows / ranks) * row` elements). True for a plain tensor."""
    if not is_dtensor(p): return True
    return all(o % FORMATS[fmt].block == 0 for o, n in _spans(p)[0] if n)


def _shard_parts(value: Packed, p: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's parts of a checkpoint's entry, stored as the whole tensor's (`whole_parts`; plain or DTensor: it
    is gathered, a collective): its blocks where they line up (`blocks_line_up`: bit for bit), else its shard of the
    dequantized entry quantized anew in its own blocks."""
    f, (spans, me) = FORMATS[value.fmt], _spans(p)
    codes = _whole(value.codes).to(p.device)
    scale = _whole(value.scale).to(p.device, torch.float32)
    o, n = spans[me]
    if n and blocks_line_up(p, value.fmt):
        nb = n_blocks(n, f.block)
        return (codes[o // f.per_byte:(o + nb * f.block) // f.per_byte].clone(),
                scale[o // f.block:o // f.block + nb].clone())
    whole = dequantize(codes, scale, value.fmt, signed, p.numel())
    return quantize(whole[o:o + n], value.fmt, signed)


def whole_parts(st: Mapping, p: torch.Tensor, group: Mapping) -> Mapping:
    """`p`'s state as a checkpoint holds it. For a plain param, `st` itself. For a DTensor param (FSDP2), whose stored
    entries are this rank's shard's blocks (plain tensors), each entry's parts as one process stores the whole
    tensor's (`'<entry>.codes'` of `codes_numel(p.numel())`, a scale per block), laid out as DTensors sharded on dim 0:
    a checkpoint that does not depend on how many ranks saved it, so DCP loads it on any number (one process
    included). Where the blocks line up (`blocks_line_up`), the ranks' codes and scales end to end: exactly what one
    process holds after the same steps (`concat_shards`: gathered only where a rank's codes are not its
    `torch.chunk` share of the whole's); else quantized anew from the gathered fp32 entry in the whole tensor's
    blocks (a rounding of its own). A collective: every rank calls it, for the same params in the same order."""
    plan = param_plan(group, p)
    if not is_dtensor(p) or not plan: return st
    out = dict(st)
    (spans, me), lp = _spans(p), local(p)
    for k, (fmt, signed) in plan.items():
        if fmt == 'bf16' or f'{k}.codes' not in st: continue
        f = FORMATS[fmt]
        codes, scale = st[f'{k}.codes'], st[f'{k}.{f.scale_key}']
        if blocks_line_up(p, fmt):  # the whole tensor's parts are the ranks' put end to end
            mine = spans[me][1] > 0  # (an empty shard's one block of zeros is no part of the whole)
            codes, scale = (codes, scale) if mine else (codes[:0], scale[:0])
            out[f'{k}.codes'] = concat_shards(codes.view(torch.uint8), p, [f.codes_numel(n) if n else 0 for _, n in spans]
                                              ).view(f.codes_dtype)
            out[f'{k}.{f.scale_key}'] = concat_shards(scale, p, [n_blocks(n, f.block) if n else 0 for _, n in spans])
            continue
        entry = dequantize(codes, scale, fmt, signed, lp.numel()).view(lp.shape)
        whole_codes, whole_scale = quantize(as_like(entry, p).full_tensor(), fmt, signed)
        out[f'{k}.codes'], out[f'{k}.{f.scale_key}'] = shard_like(whole_codes, p), shard_like(whole_scale, p)
    return out


def dequantized_state(st: Mapping, p: torch.Tensor, group: Mapping) -> dict:
    "A copy of `p`'s state with every stored entry as an fp32 tensor (`state_dict(dequantize=True)`)."
    out = dict(st)
    unpack(out, p, param_plan(group, p))
    return out

