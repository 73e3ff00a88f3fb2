"""Low-bit number formats for optimizer state: the tensors-in, tensors-out math of `state_precision=`, with no
knowledge of optimizers (`cbopt.state.lowbit` decides what is stored how).

The recipes are the published ones that bitsandbytes and torchao share (Dettmers et al., "8-bit optimizers via
block-wise quantization", 2110.02861), so that cbopt's numbers can be checked against torchao's:
- `'8bit'`: the dynamic (tree) quantization map of 256 values, signed (for moving averages of any sign) or unsigned
  (non-negative ones); blocks of 256 elements, each scaled by its fp32 absmax into [-1, 1]; round to nearest code.
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

import torch

__all__ = ['QuantFormat', 'FORMATS', 'dynamic_map', 'qmap', 'n_blocks', 'quantize', 'dequantize', 'bf16_stochastic']


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
    "How many blocks of `block` elements hold `numel` elements, the last one padded."
    return max(1, math.ceil(numel / block))


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
    if pad: flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, block)


def _nearest(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The index of the value of the sorted map `m` nearest to each element of `x` (a tie goes up; an element below
    the map's first value gets 0, above its last the last), as int64."""
    n = m.numel()
    down = (torch.bucketize(x, m, right=True) - 1).clamp_(0, n - 1)
    up = (down + 1).clamp_(max=n - 1)
    lo, hi = m[down], m[up]
    return torch.where(x - lo >= (hi - lo) * 0.5, up, down)


def quantize(x: torch.Tensor, fmt: str, signed: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (any shape, any float dtype) in the block-wise format `fmt`: `(codes, scale)`, 1-D, padded to whole blocks
    (`FORMATS[fmt].codes_numel(x.numel())` codes, one fp32 scale per block: the block's absmax, or absmax / 448 for
    fp8). `signed`: the map for values of any sign, else for non-negative ones (8/4-bit)."""
    f = FORMATS[fmt]
    blocks = _blocks(x, f.block)
    absmax = blocks.abs().amax(1).clamp_(min=_TINY)
    if fmt == 'fp8':
        scale = absmax / _FP8_MAX
        return (blocks / scale[:, None]).to(f.codes_dtype).view(-1), scale
    codes = _nearest(blocks / absmax[:, None], qmap(fmt, signed, x.device)).to(torch.uint8).view(-1)
    if fmt == '4bit': codes = (codes[::2] << 4) | codes[1::2]
    return codes, absmax


def dequantize(codes: torch.Tensor, scale: torch.Tensor, fmt: str, signed: bool, numel: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    "The 1-D tensor of `numel` elements that `quantize` gave `(codes, scale)` for, in `dtype`."
    f = FORMATS[fmt]
    if fmt == 'fp8': values = codes.float()
    else:
        if fmt == '4bit': codes = torch.stack([codes >> 4, codes & 0b1111], dim=-1).view(-1)
        values = qmap(fmt, signed, codes.device)[codes.int()]
    return (values.view(-1, f.block) * scale[:, None]).view(-1)[:numel].to(dtype)


def bf16_stochastic(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """`x` in bfloat16, rounded stochastically: away from zero with probability (the 16 bits bf16 drops) / 2**16, so
    the rounding is unbiased. A value bf16 holds exactly is kept. Uses torch's RNG (`generator`, else the default)."""
    bits = x.detach().float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=generator)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)
