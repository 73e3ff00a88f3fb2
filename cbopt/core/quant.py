"""Low-bit number formats for optimizer state: the tensors-in, tensors-out math of `state_precision=`, with no
knowledge of optimizers (`cbopt.state.lowbit` decides what is stored how).

The recipes are the published ones that bitsandbytes and torchao share (Dettmers et al., "8-bit optimizers via
block-wise quantization", 2110.02861), so that cbopt's numbers can be checked against torchao's:
- `'8bit'`: the dynamic (tree) quantization map of 256 values, signed (for moving averages of any sign) or unsigned
  (non-negative ones); blocks of 256 elements, each scaled by its fp32 absmax into [-1, 1]; round to nearest code
  (torchao's binary search over the map, as two lookups in a table of the map's exact rounding thresholds:
  `code_table`, the same codes bit for bit, about 4x faster eagerly).
- `'4bit'`: torchao's 4-bit recipe: blocks of 128; a signed dynamic map of 16 values (3 exponent bits) and, unsigned,
  the linear map 1/16 .. 16/16 (no zero, as torchao's); two codes per byte, the first element in the high nibble.
- `'fp8'`: torchao's AdamWFp8 recipe: float8_e4m3fn codes, one fp32 scale (absmax / 448) per block of 256.
- `'bf16'`: bfloat16 with stochastic rounding (heavyball's and torchao's `bf16_stochastic_round`): unbiased, so a
  moving average does not stall when its updates are below bf16's resolution.
A tensor of any size is flattened and padded with zeros to whole blocks (torchao leaves a size that is not a multiple
of the block in fp32). Maps are made once per format, sign and device, and shared by every tensor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ['QuantFormat', 'FORMATS', 'dynamic_map', 'qmap', 'CodeTable', 'thresholds', 'order_key', 'code_table', 'nearest_codes', 'n_blocks', 'quantize', 'dequantize', 'bf16_stochastic']


@dataclass(frozen=True)
class QuantFormat:
    "A block-wise format: its block size, how many codes a byte holds, the codes' dtype and its scale's name."
    name: str
    block: int
    per_byte: int            # codes per stored element: 2 for 4-bit (packed), else 1
    codes_dtype: torch.dtype
    scale_key: str           # '<entry>.absmax' (8/4-bit: the block's absmax) or '<entry>.scale' (fp8: absmax / 448)

    def codes_numel(self, numel: int) -> int:
        "Stored codes for a tensor of `numel` elements (padded to whole blocks)."
        return n_blocks(numel, self.block) * self.block // self.per_byte


FORMATS: dict[str, QuantFormat] = {
    '8bit': QuantFormat('8bit', 256, 1, torch.uint8, 'absmax'),
    '4bit': QuantFormat('4bit', 128, 2, torch.uint8, 'absmax'),
    'fp8': QuantFormat('fp8', 256, 1, torch.float8_e4m3fn, 'scale'),
}
"""The block-wise formats by name; `'bf16'` (one bf16 tensor, no blocks) is not among them."""

_FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_TINY = 1e-12     # a block of zeros is scaled by this, not 0 (torchao's and bitsandbytes' clip)


def n_blocks(numel: int, block: int) -> int:
    """How many blocks of `block` elements hold `numel` elements, the last one padded. In integers (and `sym_max`),
    so that a compiled step keeps a symbolic size symbolic."""
    return torch.sym_max(1, (numel + block - 1) // block)


def dynamic_map(signed: bool, exponent_bits: int = 7, total_bits: int = 8) -> list[float]:
    """The dynamic quantization map (Dettmers 2015, 1511.04561), sorted, with 2**total_bits values in [-1, 1]
    ([0, 1] unsigned) that include 0 and 1: for each decade `10**-(exponent_bits - 1 - i)`, evenly spaced fractions
    (the midpoints of a linspace from 0.1 to 1), more of them for the larger decades; then whatever values remain in
    the last decade. The values are those of bitsandbytes' and torchao's maps (checked in the tests)."""
    values: list[float] = []
    rest = total_bits - 1  # bits besides the sign (the unsigned map uses that bit for one more fraction bit)
    extra = 2 ** (rest - exponent_bits) - 1

    def decade(scale: float, count: int) -> None:
        edges = torch.linspace(0.1, 1, count)
        mids = (edges[:-1] + edges[1:]) / 2.0  # (in fp32, as the published maps are computed)
        values.extend((scale * mids).tolist())
        if signed: values.extend((-scale * mids).tolist())

    for i in range(exponent_bits):
        decade(10 ** (-(exponent_bits - 1) + i), int(2 ** (i + rest - exponent_bits + (0 if signed else 1)) + 1))
    if extra > 0: decade(10 ** (-(exponent_bits - 1) + exponent_bits - 1), extra + 1)
    values += [0, 1.0]
    if len(values) != 2 ** total_bits: raise AssertionError(f"dynamic map of {len(values)} values, not {2 ** total_bits}")
    return sorted(values)


def _map_values(fmt: str, signed: bool) -> list[float]:
    if fmt == '8bit': return dynamic_map(signed)
    if fmt == '4bit': return dynamic_map(True, 3, 4) if signed else torch.linspace(0, 1, 17)[1:].tolist()
    raise ValueError(f"format {fmt!r} has no quantization map")


_MAPS: dict = {}  # (format, signed, device) -> fp32 map: one per format, shared by every tensor


def qmap(fmt: str, signed: bool, device: torch.device | str = 'cpu') -> torch.Tensor:
    "The quantization map of `fmt` ('8bit' or '4bit'), signed or not, on `device`: made once, shared."
    key = (fmt, signed, torch.device(device))
    if key not in _MAPS: _MAPS[key] = torch.tensor(_map_values(fmt, signed), dtype=torch.float32, device=device)
    return _MAPS[key]


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    "`x` flattened in fp32, padded with zeros to whole blocks, as a (blocks, block) matrix."
    flat = x.detach().reshape(-1).float()
    pad = n_blocks(flat.numel(), block) * block - flat.numel()
    if pad:  # (compiled: a guard, so at most two graphs; whole blocks, nearly every weight's, need no masked loads)
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, block)


class CodeTable(NamedTuple):
    """A sorted map's round-to-nearest as a table lookup (`code_table`): an element's code is `base[i] + (key >=
    next_key[i])`, where `key` is its fp32 bits as an ordered int32 (`order_key`) and `i = (key - lo) >> shift`, a
    bucket of keys that holds at most one of the map's rounding thresholds. `packed` holds both in one int32 per
    bucket, `base << 24 | off` with `off` the next threshold's distance from the bucket's first key (at most the
    bucket's width): one gather per element (`nearest_codes`), where a binary search over the map (torchao's, or
    `torch.bucketize`) takes 8 dependent steps per element."""
    shift: int
    lo: int
    base: torch.Tensor      # uint8: how many thresholds lie at or below the bucket's first key
    next_key: torch.Tensor  # int32: the key of the next threshold above the bucket's first key (int32 max if none)
    packed: torch.Tensor    # int32: base << 24 | min(next_key - the bucket's first key, 2**shift)


def thresholds(m: torch.Tensor) -> torch.Tensor:
    """For each two neighbours `lo < hi` of the sorted fp32 map `m`, the smallest fp32 `x` that torchao's (and
    bitsandbytes') round to nearest sends up to `hi`: `x - lo >= (hi - lo) * 0.5`, computed in fp32. As `x - lo` only
    grows with `x`, an element's code is the number of thresholds at or below it, the same bits as their search gives."""
    lo, hi = m[:-1], m[1:]
    half = (hi - lo) * 0.5
    goes_up = lambda x: (x - lo) >= half
    t = lo + half
    inf = torch.full_like(t, math.inf)
    for _ in range(64):  # a few ulps from `lo + half` at most: step to the first float that goes up
        down = torch.nextafter(t, -inf)
        ok = goes_up(t)
        lower, higher = ok & goes_up(down), ~ok
        if not (lower.any() or higher.any()): return t
        t = torch.where(lower, down, torch.where(higher, torch.nextafter(t, inf), t))
    raise AssertionError("thresholds of the map did not converge")


def order_key(bits: torch.Tensor) -> torch.Tensor:
    "fp32 values viewed as int32 (`bits`) as int32 keys in the values' order (negative floats' bits count down)."
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


_TABLES: dict = {}  # (format, signed, device) -> CodeTable


def code_table(fmt: str, signed: bool, device: torch.device | str = 'cpu') -> CodeTable:
    """`qmap(fmt, signed)`'s rounding as a `CodeTable` on `device`, for inputs in [-1, 1] ([0, 1] unsigned): buckets
    as wide as the closest two thresholds allow (2**shift keys), about 16k of them for the 8-bit maps. Made once."""
    key = (fmt, signed, torch.device(device))
    if key not in _TABLES:
        m = qmap(fmt, signed)
        keys = order_key(thresholds(m).view(torch.int32))
        # a bucket is narrower than any two thresholds' distance, and its offsets fit `packed`'s 24 bits
        shift = min(int(keys.diff().min()).bit_length() - 1, 23)
        lo = int(order_key(torch.tensor([-1.0 if signed else 0.0]).view(torch.int32)))
        n = ((int(order_key(torch.tensor([1.0]).view(torch.int32))) - lo) >> shift) + 1
        starts = lo + (torch.arange(n, dtype=torch.int64) << shift)
        base = torch.searchsorted(keys.long(), starts, right=True)
        next_key = torch.cat([keys, torch.tensor([torch.iinfo(torch.int32).max], dtype=torch.int32)])[base]
        off = (next_key.long() - starts).clamp(max=1 << shift)
        packed = ((base << 24) | off).to(torch.int32)  # (base < 256: a negative int32 where base >= 128)
        _TABLES[key] = CodeTable(shift, lo, base.to(torch.uint8).to(device), next_key.to(device), packed.to(device))
    return _TABLES[key]


def nearest_codes(x: torch.Tensor, fmt: str, signed: bool, in_place: bool = False) -> torch.Tensor:
    """The uint8 code of the value of `qmap(fmt, signed)` nearest to each element of the fp32 tensor `x` (in [-1, 1];
    a tie goes up, as torchao's), by `code_table`'s `packed` table: the key's distance from the table's first key,
    clamped to the table (a key below it is in the first bucket, one above in the last, where `base + (key >=
    next_key)` puts them too), gives the bucket (its high bits) and the offset compared with the bucket's next
    threshold (its low bits). `in_place`: `x` is scratch, and its memory is reused (eager: the fewest allocations);
    else only out-of-place ops, which `torch.compile` fuses into one loop, its gather in int32 (`_gather`)."""
    t = code_table(fmt, signed, x.device)
    top, low = (t.packed.numel() << t.shift) - 1, (1 << t.shift) - 1
    bits = x.view(torch.int32)
    if not in_place:
        d = (order_key(bits) - t.lo).clamp(0, top)
        e = _gather(t.packed, d >> t.shift)
        return (((e >> 24) & 0xFF) + ((d & low) >= (e & 0xFFFFFF)).int()).to(torch.uint8)
    s = bits >> 31
    d = bits.__ixor__(s.__iand__(0x7FFFFFFF)).sub_(t.lo).clamp_(0, top)
    e = t.packed.index_select(0, torch.bitwise_right_shift(d, t.shift, out=s).view(-1)).view(x.shape)
    codes = torch.ge(d.__iand__(low), e & 0xFFFFFF).view(torch.uint8)
    return codes.add_((e.__irshift__(24).__iand__(0xFF)).to(torch.uint8))


def _gather(table: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """`table[i]` for the int32 indices `i` (in range by construction). Compiled, as an embedding lookup, which
    inductor indexes with the int32 indices as they are (`table[i]` and `index_select` add a wrap of negative indices
    in int64 vectors: a third of the compiled low-bit step's time on a CPU); eagerly, `index_select`."""
    if torch.compiler.is_compiling():
        return torch.nn.functional.embedding(i, table[:, None]).view(i.shape)
    return table.index_select(0, i.reshape(-1)).view(i.shape)


def quantize(x: torch.Tensor, fmt: str, signed: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (any shape, any float dtype) in the block-wise format `fmt`: `(codes, scale)`, 1-D, padded to whole blocks
    (`FORMATS[fmt].codes_numel(x.numel())` codes, one fp32 scale per block: the block's absmax, or absmax / 448 for
    fp8). `signed`: the map for values of any sign, else for non-negative ones (8/4-bit). Traceable by
    `torch.compile` with dynamic sizes (the fused backend quantizes in its graph: `cbopt.engine.lowbit`)."""
    f = FORMATS[fmt]
    compiling = torch.compiler.is_compiling()  # (in a compiled step: out-of-place ops, fused by inductor)
    whole = x.numel() // f.block * f.block
    if compiling and 0 < whole < x.numel():  # (compiled, guards: a graph of its own for such sizes)
        # its whole blocks and its last, padded block apart: only the last block's loads are masked in the graph
        flat = x.reshape(-1)
        (c1, s1), (c2, s2) = quantize(flat[:whole], fmt, signed), quantize(flat[whole:], fmt, signed)
        return torch.cat([c1, c2]), torch.cat([s1, s2])
    blocks = _blocks(x, f.block)
    lo, hi = torch.aminmax(blocks, dim=1)  # (the absmax without a copy of the blocks' absolute values)
    absmax = torch.maximum(hi, lo.neg_()).clamp_(min=_TINY)
    if fmt == 'fp8':
        scale = absmax / _FP8_MAX
        return (blocks / scale[:, None]).to(f.codes_dtype).view(-1), scale
    codes = nearest_codes(blocks / absmax[:, None], fmt, signed, in_place=not compiling).view(-1)
    if fmt == '4bit': codes = (codes[::2] << 4) | codes[1::2]
    return codes, absmax


def dequantize(codes: torch.Tensor, scale: torch.Tensor, fmt: str, signed: bool, numel: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    "The 1-D tensor of `numel` elements that `quantize` gave `(codes, scale)` for, in `dtype`."
    f = FORMATS[fmt]
    if fmt == 'fp8': values = codes.float()
    else:
        if fmt == '4bit': codes = torch.stack([codes >> 4, codes & 0b1111], dim=-1).view(-1)
        values = _gather(qmap(fmt, signed, codes.device), codes.int())
    # (`scale.numel()` blocks, not -1: then a compiled graph knows both sides' sizes are one, and needs no broadcast)
    values = values.view(scale.numel(), f.block).mul_(scale[:, None]).view(-1)
    if values.numel() == numel: return values.to(dtype)  # (whole blocks: a guard in a compiled graph)
    values = values[:numel]  # compiled, a copy: a chain updating a slice of a larger tensor has its loops masked
    return values.clone() if torch.compiler.is_compiling() and dtype == values.dtype else values.to(dtype)


def bf16_stochastic(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """`x` in bfloat16, rounded stochastically: away from zero with probability (the 16 bits bf16 drops) / 2**16, so
    the rounding is unbiased. A value bf16 holds exactly is kept. Uses torch's RNG (`generator`, else the default)."""
    bits = x.detach().float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=generator)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)
