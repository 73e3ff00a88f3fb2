"""TensorList against torch: every op on a bucket must give what the same torch op gives on each of its tensors.

On CPU a `torch._foreach_*` kernel runs the same ATen op per tensor, so the comparisons are exact (`rtol=atol=0`,
plus the sign of zeros); the few that cannot be exact say why where they are made. The buckets mix shapes and hold
a 0-d tensor and an empty one (`SHAPES`); the numeric ops run in float32, float64 and bfloat16. The last section
checks the BucketError contract: what has no one value for a whole bucket raises it, nothing else does.
"""
from __future__ import annotations

import functools
import math
import operator

import pytest
import torch
import torch.nn.functional as F

from cbopt import tensorlist
from cbopt.core.tensorlist import BucketError, TensorList

DTYPES = [torch.float32, torch.float64, torch.bfloat16]
SHAPES = [(64,), (), (0,), (8, 16)]  # a vector, a 0-d tensor, an empty tensor, a matrix: one bucket of mixed shapes
FULL = (16,)                         # a full tensor operand: one tensor for every param...
BROADCAST = [(8, 16), (16,)]         # ...of a bucket it broadcasts against
INF = math.inf


def make(dtype: torch.dtype = torch.float32, seed: int = 0, shapes=SHAPES, positive: bool = False) -> TensorList:
    "A bucket of seeded normal values (`positive`: in [0.5, ~4], for pow, log, division)."
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    return TensorList([(t.abs() + 0.5 if positive else t).to(dtype) for t in ts])


def per_param(dtype: torch.dtype = torch.float32, seed: int = 1, n: int = len(SHAPES)) -> TensorList:
    "One 0-d tensor per param: a per-param value (a local lr, a clamp bound), as a bucket holds it."
    g = torch.Generator().manual_seed(seed)
    return TensorList([(torch.rand((), generator=g, dtype=torch.float64) + 0.1).to(dtype) for _ in range(n)])


def check(got, expected, tol: tuple | None = None) -> None:
    "`got` holds `expected`'s tensors: exactly (values, NaNs, signs of zeros, dtype, shape), or within `(rtol, atol)`."
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        rtol, atol = tol or (0, 0)
        torch.testing.assert_close(g, e, rtol=rtol, atol=atol, equal_nan=True)
        if tol is None and g.is_floating_point():
            assert torch.equal(g.signbit() & ~g.isnan(), e.signbit() & ~e.isnan()), (g, e)


def run(x: TensorList, fn, expected: list, inplace: bool, tol: tuple | None = None) -> None:
    """`fn(x)` gives `expected`. An in-place op returns `x` itself, its own tensors changed; any other op returns a
    new TensorList and leaves `x`'s tensors as they were."""
    ts, before = list(x), [t.clone() for t in x]
    got = fn(x)
    if inplace:
        assert got is x and all(a is b for a, b in zip(x, ts))
        check(ts, expected, tol)
    else:
        assert type(got) is TensorList and got is not x
        check(got, expected, tol)
        check(ts, before)


def operand(kind: str, dtype: torch.dtype, n: int, seed: int = 1, positive: bool = False, shapes=SHAPES):
    "The second operand of a binary op, and how each param sees it."
    if kind == 'scalar': o = 0.37
    elif kind == 'int': o = 2
    elif kind == '0d': o = torch.tensor(0.37, dtype=dtype)
    elif kind == 'full': o = make(dtype, seed, [FULL], positive)[0]
    elif kind == 'list': o = make(dtype, seed, shapes, positive)
    elif kind == 'list0d': o = per_param(dtype, seed, n)
    else: raise ValueError(kind)
    return o, (lambda i: o[i]) if isinstance(o, TensorList) else (lambda i: o)


# -- arithmetic ------------------------------------------------------------------------------------------------------
KINDS = ['scalar', 'int', '0d', 'full', 'list', 'list0d']


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('inplace', [False, True])
@pytest.mark.parametrize('kind', KINDS)
@pytest.mark.parametrize('name', ['add', 'sub', 'mul', 'div', 'pow'])
def test_binary(name: str, kind: str, inplace: bool, dtype: torch.dtype) -> None:
    "add/sub/mul/div/pow with every kind of operand, in place and not."
    shapes = BROADCAST if kind == 'full' else SHAPES
    x = make(dtype, 0, shapes, positive=name in ('pow', 'div'))
    o, at = operand(kind, dtype, len(x), positive=name in ('pow', 'div'), shapes=shapes)
    op = name + '_' * inplace
    run(x, lambda tl: getattr(tl, op)(o), [getattr(t.clone(), op)(at(i)) for i, t in enumerate(x)], inplace)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('inplace', [False, True])
@pytest.mark.parametrize('alpha', [0.3, -2, 'tensor'])
@pytest.mark.parametrize('kind', KINDS)
@pytest.mark.parametrize('name', ['add', 'sub'])
def test_add_sub_alpha(name: str, kind: str, alpha, inplace: bool, dtype: torch.dtype) -> None:
    "`alpha` scales the operand exactly as torch.add/sub do (one rounding, in torch's op), whatever the operand."
    if alpha == 'tensor': alpha = torch.tensor(0.3, dtype=dtype)  # a 0-d tensor hyper (an lr given as a tensor)
    shapes = BROADCAST if kind == 'full' else SHAPES
    x = make(dtype, 0, shapes)
    o, at = operand(kind, dtype, len(x), shapes=shapes)
    op = name + '_' * inplace
    run(x, lambda tl: getattr(tl, op)(o, alpha=alpha),
        [getattr(t.clone(), op)(at(i), alpha=alpha) for i, t in enumerate(x)], inplace)


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('inplace', [False, True])
@pytest.mark.parametrize('name, kw', [('add', {}), ('add', {'alpha': 0.3}), ('sub', {}), ('sub', {'alpha': 0.3}),
                                      ('mul', {}), ('div', {})], ids=['add', 'add-alpha', 'sub', 'sub-alpha', 'mul', 'div'])
def test_binary_with_a_0d_tensor_of_another_dtype(name: str, kw: dict, inplace: bool, dtype: torch.dtype) -> None:
    """A 0-d tensor operand of a wider dtype (a float64 hyper) promotes as in torch: the 0-d param's result is
    float64 (a 0-d tensor and a 0-d tensor), the others keep the bucket's dtype; in place, the 0-d param's result
    is computed in float64 and rounded once to its dtype. (foreach's add takes a lone 0-d tensor without promoting.)"""
    x, o = make(dtype, 0, positive=name == 'div'), torch.tensor(0.37, dtype=torch.float64)
    op = name + '_' * inplace
    run(x, lambda tl: getattr(tl, op)(o, **kw), [getattr(t.clone(), op)(o, **kw) for t in x], inplace)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_mul_by_a_number_in_half_precision(dtype: torch.dtype) -> None:
    "torch's in-place foreach mul rounds a number to 16 bits first; `Tensor.mul_` does not, nor may the bucket."
    for v in (0.3, 1.7, -0.37, 1e-3):
        x = make(dtype)
        run(x, lambda tl: tl.mul_(v), [t.clone().mul_(v) for t in x], inplace=True)
        run(x, lambda tl: tl.__imul__(v), [t.clone().mul_(v) for t in x], inplace=True)


def test_binary_with_an_unsupported_operand_raises() -> None:
    "A method given an operand it cannot take raises TypeError as a tensor's does (it returned NotImplemented)."
    x = make()
    for op in ('add', 'add_', 'sub', 'sub_', 'mul', 'mul_', 'div', 'div_', 'pow', 'pow_', 'maximum', 'minimum',
               'clamp_min', 'clamp_max', 'clamp', 'clamp_'):
        with pytest.raises(TypeError): getattr(torch.ones(1), op)('a')
        with pytest.raises(TypeError): getattr(x, op)('a')
    for f in (operator.add, operator.iadd, operator.mul, operator.imul, operator.pow):
        with pytest.raises(TypeError): f(x, 'a')


LEFT = {'one': 1, 'int': 2, 'scalar': 0.37, '0d': torch.tensor(0.37), 'full': make(torch.float64, 5, [FULL])[0]}
REFLECTED = {'+': operator.add, '-': operator.sub, '*': operator.mul, '/': operator.truediv, '**': operator.pow,
             '//': operator.floordiv, '%': operator.mod}


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('left', LEFT)
@pytest.mark.parametrize('sym', REFLECTED)
def test_reflected_operators(sym: str, left: str, dtype: torch.dtype) -> None:
    "`2 - tl`, `1 / tl`, `2 ** tl`, `t - tl`: the number or tensor on the left, each param on the right."
    x = make(dtype, 0, BROADCAST if left == 'full' else SHAPES, positive=sym in ('**', '/', '//', '%'))
    o = LEFT[left].to(dtype) if isinstance(LEFT[left], torch.Tensor) else LEFT[left]
    fn = REFLECTED[sym]
    run(x, lambda tl: fn(o, tl), [fn(o, t) for t in x], inplace=False)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('kind', ['scalar', '0d', 'list'])
@pytest.mark.parametrize('sym', REFLECTED)
def test_operators(sym: str, kind: str, dtype: torch.dtype) -> None:
    "`tl + o`, ..., `tl // o`, `tl % o` per tensor."
    x = make(dtype, 0, positive=sym == '**')
    o, at = operand(kind, dtype, len(x), positive=sym in ('**', '/', '//', '%'))
    fn = REFLECTED[sym]
    run(x, lambda tl: fn(tl, o), [fn(t, at(i)) for i, t in enumerate(x)], inplace=False)


@pytest.mark.parametrize('dtype', DTYPES)
def test_matmul(dtype: torch.dtype) -> None:
    "`tl @ other`: each param's matrix product with its partner, or with one tensor on either side."
    x, o, m = make(dtype, 0, [(2, 3), (3,)]), make(dtype, 1, [(3, 2), (3,)]), make(dtype, 2, [(3,)])[0]
    run(x, lambda tl: tl @ o, [a @ b for a, b in zip(x, o)], inplace=False)
    run(x, lambda tl: tl @ m, [a @ m for a in x], inplace=False)
    run(o, lambda tl: m @ tl, [m @ b for b in o], inplace=False)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('sym', ['+=', '-=', '*=', '/=', '**=', '//=', '%='])
def test_inplace_operators(sym: str, dtype: torch.dtype) -> None:
    "`tl += o` changes the bucket's own tensors, as `t += o` changes a tensor, and `tl` stays the same object."
    fn = {'+=': operator.iadd, '-=': operator.isub, '*=': operator.imul, '/=': operator.itruediv,
          '**=': operator.ipow, '//=': operator.ifloordiv, '%=': operator.imod}[sym]
    for kind in ('scalar', 'list'):
        x = make(dtype, 0, positive=True)
        o, at = operand(kind, dtype, len(x), positive=True)
        run(x, lambda tl: fn(tl, o), [fn(t.clone(), at(i)) for i, t in enumerate(x)], inplace=True)


def test_integer_operators() -> None:
    "Shifts, `//` and `%` on integer buckets, with a number or a bucket on either side, in place too."
    x = TensorList([torch.arange(1, 7), torch.tensor(5)])
    y = TensorList([torch.tensor([1, 2, 3, 1, 2, 3]), torch.tensor(2)])
    for fn in (operator.lshift, operator.rshift, operator.floordiv, operator.mod):
        run(x, lambda tl: fn(tl, y), [fn(a, b) for a, b in zip(x, y)], inplace=False)
        run(x, lambda tl: fn(tl, 2), [fn(a, 2) for a in x], inplace=False)
        run(x, lambda tl: fn(7, tl), [fn(7, a) for a in x], inplace=False)
    for fn in (operator.ilshift, operator.irshift, operator.ifloordiv, operator.imod):
        z = x.clone()
        run(z, lambda tl: fn(tl, y), [fn(a.clone(), b) for a, b in zip(z, y)], inplace=True)


@pytest.mark.parametrize('dtype', DTYPES)
def test_unary_operators(dtype: torch.dtype) -> None:
    "`-tl`, `+tl`, `abs(tl)`."
    x = make(dtype)
    run(x, lambda tl: -tl, [-t for t in x], inplace=False)
    run(x, abs, [abs(t) for t in x], inplace=False)
    got = +x
    assert type(got) is TensorList and all(a is b for a, b in zip(got, x))  # as `+t is t` for a tensor


# -- unary ops -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('inplace', [False, True])
@pytest.mark.parametrize('name', tensorlist.UNARY_OPS)
def test_unary(name: str, inplace: bool, dtype: torch.dtype) -> None:
    "Every foreach unary op (negative inputs included: NaNs where torch gives them), and its in-place form."
    x = make(dtype) * 3
    op = name + '_' * inplace
    try: expected = [getattr(t.clone(), op)() for t in x]
    except RuntimeError as e: pytest.skip(f"torch has no {op} for {dtype}: {e}")
    run(x, lambda tl: getattr(tl, op)(), expected, inplace)


def test_unary_ops_are_all_methods() -> None:
    "Every op of the unary loop is a method, and its in-place form too (torch has a foreach kernel for each)."
    for name in tensorlist.UNARY_OPS:
        assert callable(getattr(TensorList, name)) and callable(getattr(TensorList, name + '_'))
    assert TensorList.negative is TensorList.neg  # torch's alias


# -- lerp, addcmul, addcdiv ----------------------------------------------------------------------------------------
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('inplace', [False, True])
@pytest.mark.parametrize('end', ['list', '0d', 'full'])
@pytest.mark.parametrize('weight', ['scalar', '0d', 'list0d', 'list'])
def test_lerp(weight: str, end: str, inplace: bool, dtype: torch.dtype) -> None:
    "lerp/lerp_ with a number, a 0-d tensor, one 0-d weight per param or a full weight; the end a bucket or a tensor."
    shapes = BROADCAST if end == 'full' else SHAPES
    x = make(dtype, 0, shapes)
    e, e_at = operand(end, dtype, len(x), seed=1, shapes=shapes)
    w, w_at = operand(weight, dtype, len(x), seed=2, shapes=shapes)
    op = 'lerp' + '_' * inplace
    run(x, lambda tl: getattr(tl, op)(e, w), [getattr(t.clone(), op)(e_at(i), w_at(i)) for i, t in enumerate(x)],
        inplace)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('inplace', [False, True])
@pytest.mark.parametrize('value', ['default', 'scalar', '0d', 'list0d'])
@pytest.mark.parametrize('name', ['addcmul', 'addcdiv'])
def test_addcmul_addcdiv(name: str, value: str, inplace: bool, dtype: torch.dtype) -> None:
    """`x + value * t1 * t2` and `x + value * t1 / t2`, with `value` a number, a 0-d tensor (a tensor hyper) or one
    0-d tensor per param. A tensor value scales `t1` first (no device sync to read it): torch's kernel computes
    `x + value * t1 / t2` in that order, so float32/64 are exact. bfloat16 cannot be: torch keeps `value * t1` in
    float32, the bucket rounds it to bfloat16, so there it is compared within a bfloat16 rounding of that product."""
    x, t1, t2 = make(dtype, 0), make(dtype, 1), make(dtype, 2, positive=True)
    v, v_at = operand(value, dtype, len(x), seed=3) if value != 'default' else (None, None)
    kw, kw_at = ({}, lambda i: {}) if value == 'default' else ({'value': v}, lambda i: {'value': v_at(i)})
    op = name + '_' * inplace
    tol = (2 ** -7, 2 ** -6) if dtype == torch.bfloat16 and value in ('0d', 'list0d') else None
    run(x, lambda tl: getattr(tl, op)(t1, t2, **kw),
        [getattr(t.clone(), op)(t1[i], t2[i], **kw_at(i)) for i, t in enumerate(x)], inplace, tol)


def test_addcdiv_with_tensor_operands() -> None:
    "`t1`/`t2` given as one tensor for every param (a 0-d tensor) broadcast as they would against each param."
    x, t1, z = make(), make(seed=1), torch.tensor(2.5)
    run(x, lambda tl: tl.addcdiv(t1, z, value=0.5), [t.addcdiv(a, z, value=0.5) for t, a in zip(x, t1)], False)
    run(x, lambda tl: tl.addcmul(z, t1), [t.addcmul(z, a) for t, a in zip(x, t1)], False)


# -- clamp, maximum, minimum -----------------------------------------------------------------------------------------
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('kind', ['scalar', '0d', 'list0d'])
@pytest.mark.parametrize('op', ['clamp', 'clamp_', 'clip', 'clip_'])
@pytest.mark.parametrize('bounds', ['min', 'max', 'both', 'crossed'])
def test_clamp(bounds: str, op: str, kind: str, dtype: torch.dtype) -> None:
    "clamp/clip (in place or not) with a min, a max, both, or min > max (torch then gives max everywhere)."
    x = make(dtype) * 2
    lo, lo_at = operand(kind, dtype, len(x), seed=1)
    hi = lo + 0.25 if bounds != 'crossed' else lo - 0.5
    hi_at = (lambda i: hi[i]) if isinstance(hi, TensorList) else (lambda i: hi)
    kw = lambda l, h: {'min': l} if bounds == 'min' else {'max': h} if bounds == 'max' else {'min': l, 'max': h}
    run(x, lambda tl: getattr(tl, op)(**kw(lo, hi)),
        [getattr(t.clone(), op)(**kw(lo_at(i), hi_at(i))) for i, t in enumerate(x)], inplace=op.endswith('_'))


def test_clamp_without_bounds_raises() -> None:
    "torch.clamp with neither bound is an error, not a copy."
    with pytest.raises(RuntimeError): torch.ones(2).clamp()
    with pytest.raises(RuntimeError): make().clamp()
    with pytest.raises(RuntimeError): make().clamp_()


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('kind', ['scalar', '0d', 'list0d'])
@pytest.mark.parametrize('op', ['clamp_min', 'clamp_max'])
def test_clamp_min_max(op: str, kind: str, dtype: torch.dtype) -> None:
    "clamp_min/clamp_max with a number, a 0-d tensor or one 0-d bound per param."
    x = make(dtype)
    v, at = operand(kind, dtype, len(x))
    run(x, lambda tl: getattr(tl, op)(v), [getattr(t, op)(at(i)) for i, t in enumerate(x)], inplace=False)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('kind', ['scalar', '0d', 'full', 'list', 'list0d'])
@pytest.mark.parametrize('op', ['maximum', 'minimum'])
def test_maximum_minimum(op: str, kind: str, dtype: torch.dtype) -> None:
    "Elementwise max/min with another bucket or a tensor; a number works as the 0-d tensor of it (torch needs one)."
    shapes = BROADCAST if kind == 'full' else SHAPES
    x = make(dtype, 0, shapes)
    x[0][0] = math.nan  # NaN propagates from either side
    v, at = operand(kind, dtype, len(x), shapes=shapes)
    ref = lambda i: torch.tensor(v, dtype=dtype) if kind == 'scalar' else at(i)
    run(x, lambda tl: getattr(tl, op)(v), [getattr(torch, op)(t, ref(i)) for i, t in enumerate(x)], inplace=False)


# -- copy_, zero_, fill_, clone, detach --------------------------------------------------------------------------------
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('kind', ['list', '0d', 'full', 'float64 list'])
def test_copy_(kind: str, dtype: torch.dtype) -> None:
    "copy_ from a bucket (of another dtype too: cast as copy_ does) or from one tensor broadcast to every param."
    shapes = BROADCAST if kind == 'full' else SHAPES
    x = make(dtype, 0, shapes)
    if kind == 'float64 list': src, at = make(torch.float64, 1, shapes), None
    else: src, at = operand(kind, dtype, len(x), shapes=shapes)
    at = at or (lambda i: src[i])
    run(x, lambda tl: tl.copy_(src), [t.clone().copy_(at(i)) for i, t in enumerate(x)], inplace=True)


def test_copy_into_dtensors(one_rank_mesh) -> None:
    """A bucket of DTensors (sharded params) copies per tensor: torch has no sharding rule for `_foreach_copy_`.
    From a bucket of DTensors and from one DTensor every param sees."""
    from torch.distributed.tensor import Shard, distribute_tensor
    shard = lambda t: distribute_tensor(t, one_rank_mesh, [Shard(0)])
    plain = make(shapes=[(3,), (2, 3)])
    for src, at in ((TensorList(shard(t) for t in make(seed=1, shapes=[(3,), (2, 3)])), lambda s, i: s[i]),
                    (shard(torch.tensor([1.5, -2., 3.])), lambda s, i: s)):
        x = TensorList(shard(t.clone()) for t in plain)
        ts = list(x)
        assert x.copy_(src) is x and all(a is b for a, b in zip(x, ts))
        check([t.full_tensor() for t in x], [t.clone().copy_(at(src, i).full_tensor()) for i, t in enumerate(plain)])


@pytest.mark.parametrize('dtype', DTYPES)
def test_zero_(dtype: torch.dtype) -> None:
    x = make(dtype)
    run(x, lambda tl: tl.zero_(), [t.clone().zero_() for t in x], inplace=True)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('value', [0.37, 0.1, -0.0, math.nan, -INF, '0d', 'list0d'])
def test_fill_(value, dtype: torch.dtype) -> None:
    "fill_ with a number (-0.0 keeps its sign, 0.1 rounds once to the dtype), a 0-d tensor, one 0-d tensor per param."
    x = make(dtype)
    x[0][0] = math.nan  # filled over like any value
    v, at = operand(value, dtype, len(x)) if isinstance(value, str) else (value, lambda i: value)
    run(x, lambda tl: tl.fill_(v), [t.clone().fill_(at(i)) for i, t in enumerate(x)], inplace=True)


@pytest.mark.parametrize('dtype', DTYPES)
def test_clone(dtype: torch.dtype) -> None:
    "A copy with its own storage: changing it leaves the bucket alone."
    x = make(dtype)
    run(x, lambda tl: tl.clone(), [t.clone() for t in x], inplace=False)
    y = x.clone(memory_format=torch.contiguous_format)
    y.add_(1)
    check(y, [t + 1 for t in x])
    assert not any(a.numel() and a.data_ptr() == b.data_ptr() for a, b in zip(x, y))


def test_clone_memory_format() -> None:
    "clone's `memory_format` reaches every tensor, as Tensor.clone's does: a transposed tensor cloned contiguous."
    t = torch.randn(3, 4).t()
    for fmt in (torch.contiguous_format, torch.preserve_format):
        got, ref = TensorList([t, t]).clone(memory_format=fmt), t.clone(memory_format=fmt)
        assert all(g.stride() == ref.stride() for g in got), (fmt, got[0].stride(), ref.stride())
    assert t.clone(memory_format=torch.contiguous_format).stride() != t.clone().stride()  # the two differ


def test_detach() -> None:
    "The same storage without the graph, as `t.detach()`."
    x = TensorList([t.requires_grad_() for t in make()])
    y = x.detach()
    assert type(y) is TensorList and not any(t.requires_grad for t in y) and all(t.requires_grad for t in x)
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(x, y))
    check(y, [t.detach() for t in x])


def test_data_dtype_device() -> None:
    "`.data` is the bucket itself (callbacks write `p.data.add_`); `.dtype`/`.device` are its params' one dtype/device."
    x = make(torch.float64)
    assert x.data is x and x.dtype == torch.float64 and x.device == torch.device('cpu')
    assert TensorList.grad is None
    for tl in (TensorList(), TensorList([torch.ones(2), torch.ones(2, dtype=torch.float64)])):  # none, or two dtypes
        with pytest.raises(BucketError): tl.dtype
        assert not hasattr(tl, 'dtype')
    with pytest.raises(BucketError): TensorList().device


# -- norms -----------------------------------------------------------------------------------------------------------
ORDS = [1, 2, INF, -INF, 0, 3, 0.5]


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('ord', ORDS)
def test_norm_and_vector_norm(ord, dtype: torch.dtype) -> None:
    "One 0-d norm per param, from `tl.norm(p)` and `torch.linalg.vector_norm(tl, ord)` (the foreach kernel)."
    shapes = SHAPES if abs(ord) != INF else [s for s in SHAPES if s != (0,)]  # an empty max is an error (below)
    x = make(dtype, 0, shapes)
    run(x, lambda tl: tl.norm(ord), [t.norm(ord) for t in x], inplace=False)
    run(x, lambda tl: torch.linalg.vector_norm(tl, ord), [torch.linalg.vector_norm(t, ord) for t in x], False)
    run(x, lambda tl: torch.linalg.vector_norm(tl, ord=ord), [torch.linalg.vector_norm(t, ord=ord) for t in x], False)


def test_norm_defaults_and_options() -> None:
    "The default order is 2; `dim`, `keepdim`, `dtype` and `p='fro'` are honoured as torch honours them."
    x = make()
    run(x, lambda tl: tl.norm(), [t.norm() for t in x], False)
    run(x, lambda tl: torch.linalg.vector_norm(tl), [torch.linalg.vector_norm(t) for t in x], False)
    run(x, lambda tl: tl.norm('fro'), [t.norm('fro') for t in x], False)
    run(x, lambda tl: tl.norm(keepdim=True), [t.norm(keepdim=True) for t in x], False)
    run(x, lambda tl: tl.norm(dtype=torch.float64), [t.norm(dtype=torch.float64) for t in x], False)
    run(x, lambda tl: torch.linalg.vector_norm(tl, dtype=torch.float64),
        [torch.linalg.vector_norm(t, dtype=torch.float64) for t in x], False)
    run(x, lambda tl: torch.linalg.vector_norm(tl, 2, keepdim=True),
        [torch.linalg.vector_norm(t, 2, keepdim=True) for t in x], False)
    m = make(shapes=[(2, 3), (4, 3)])
    for dim in (0, 1, -1, (0, 1)):
        run(m, lambda tl: torch.linalg.vector_norm(tl, dim=dim), [torch.linalg.vector_norm(t, dim=dim) for t in m],
            False)
        run(m, lambda tl: torch.linalg.vector_norm(tl, 1, dim), [torch.linalg.vector_norm(t, 1, dim) for t in m], False)
        run(m, lambda tl: tl.norm(2, dim), [t.norm(2, dim) for t in m], False)


def test_inf_norm_of_an_empty_tensor_raises() -> None:
    "The max of nothing is an error per tensor, and on a bucket holding an empty tensor too."
    with pytest.raises(RuntimeError): torch.linalg.vector_norm(torch.ones(0), INF)
    with pytest.raises(RuntimeError): torch.linalg.vector_norm(make(), INF)
    with pytest.raises(RuntimeError): make().norm(INF)


# -- comparisons and logic -------------------------------------------------------------------------------------------
@pytest.mark.parametrize('kind', ['scalar', '0d', 'list'])
@pytest.mark.parametrize('op', [operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge])
def test_comparisons(op, kind: str) -> None:
    "Comparisons give one bool tensor per param (never a Python bool, which a bucket cannot be)."
    x = make()
    o, at = operand(kind, torch.float32, len(x))
    if kind == 'list': o[0][1] = x[0][1]  # some equal elements
    run(x, lambda tl: op(tl, o), [op(t, at(i)) for i, t in enumerate(x)], inplace=False)


@pytest.mark.parametrize('op', [operator.and_, operator.or_, operator.xor])
def test_logical(op) -> None:
    "`& | ^` between masks and with a bool on either side, and `~`."
    x, y = make(seed=0) > 0, make(seed=1) > 0
    run(x, lambda m: op(m, y), [op(a, b) for a, b in zip(x, y)], False)
    for b in (True, False):
        run(x, lambda m: op(m, b), [op(a, b) for a in x], False)
        run(x, lambda m: op(b, m), [op(b, a) for a in x], False)
    run(x, lambda m: ~m, [~a for a in x], False)


@pytest.mark.parametrize('op', [operator.iand, operator.ior, operator.ixor])
def test_logical_inplace(op) -> None:
    "`m &= other` changes the masks themselves, as on a tensor."
    x, y = make(seed=0) > 0, make(seed=1) > 0
    run(x, lambda m: op(m, y), [op(a.clone(), b) for a, b in zip(x, y)], inplace=True)


# -- indexing --------------------------------------------------------------------------------------------------------
def test_getitem() -> None:
    "An int picks one param's tensor (as a list does); a slice, `...`, `None` or a mask index inside every tensor."
    x = make()
    assert x[1] is list(x)[1] and x[-1] is list(x)[-1]
    y = make(shapes=[(3,), (0,), (2, 3)])
    for idx in (slice(1, None), slice(None, None, 2), (Ellipsis, slice(None, 1)), None, Ellipsis):
        run(y, lambda tl: tl[idx], [t[idx] for t in y], inplace=False)
    mask = y > 0
    run(y, lambda tl: tl[mask], [t[m] for t, m in zip(y, mask)], inplace=False)


def test_setitem() -> None:
    "`tl[mask] = v` writes inside every tensor (masks and values per param), as `t[mask] = v`; an int sets a param."
    x = make(shapes=[(3,), (0,), (2, 3)])
    ts, expected = list(x), [t.clone() for t in x]
    mask, v = x > 0, per_param(n=3)
    for t, m, w in zip(expected, mask, v): t[m] = w
    x[mask] = v
    assert all(a is b for a, b in zip(x, ts))
    check(ts, expected)
    for t in expected: t[..., :1] = 0.5
    x[..., :1] = 0.5
    check(ts, expected)
    with pytest.raises(BucketError): x[mask] = per_param(n=2)
    z = torch.zeros(3)
    x[0] = z
    assert x[0] is z


# -- torch functions -------------------------------------------------------------------------------------------------
FUNCS = {
    'zeros_like': (lambda x, y: torch.zeros_like(x), lambda a, b: torch.zeros_like(a)),
    'ones_like': (lambda x, y: torch.ones_like(x, dtype=torch.float64),
                  lambda a, b: torch.ones_like(a, dtype=torch.float64)),
    'full_like': (lambda x, y: torch.full_like(x, 2.5), lambda a, b: torch.full_like(a, 2.5)),
    'where': (lambda x, y: torch.where(x > 0, x, 0.), lambda a, b: torch.where(a > 0, a, 0.)),
    'where2': (lambda x, y: torch.where(x > y, x, y), lambda a, b: torch.where(a > b, a, b)),
    'sqrt': (lambda x, y: torch.sqrt(x), lambda a, b: torch.sqrt(a)),
    'add': (lambda x, y: torch.add(x, y, alpha=2), lambda a, b: torch.add(a, b, alpha=2)),
    'add kw': (lambda x, y: torch.add(input=x, other=y), lambda a, b: torch.add(input=a, other=b)),
    'mul left': (lambda x, y: torch.mul(2, x), lambda a, b: torch.mul(2, a)),
    'clamp': (lambda x, y: torch.clamp(x, max=0.5), lambda a, b: torch.clamp(a, max=0.5)),
    'lerp': (lambda x, y: torch.lerp(x, y, 0.3), lambda a, b: torch.lerp(a, b, 0.3)),
    'maximum': (lambda x, y: torch.maximum(x, y), torch.maximum),
    'abs': (lambda x, y: torch.abs(x), lambda a, b: torch.abs(a)),
    'sign': (lambda x, y: torch.sign(x), lambda a, b: torch.sign(a)),
    'norm': (lambda x, y: torch.norm(x), lambda a, b: torch.norm(a)),
    'softplus': (lambda x, y: F.softplus(x, 2.), lambda a, b: F.softplus(a, 2.)),
    'relu': (lambda x, y: F.relu(x), lambda a, b: F.relu(a)),
    'sort': (lambda x, y: torch.sort(x).values, lambda a, b: torch.sort(a).values),
    'tensor op bucket': (lambda x, y: torch.tensor(2.) * x - torch.tensor(1.),
                         lambda a, b: torch.tensor(2.) * a - torch.tensor(1.)),
}


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('name', FUNCS)
def test_torch_functions(name: str, dtype: torch.dtype) -> None:
    "torch functions on buckets, through `__torch_function__` (a foreach method where TensorList has one)."
    f_tl, f_t = FUNCS[name]
    x, y = make(dtype, 0), make(dtype, 1)
    run(x, lambda tl: f_tl(tl, y), [f_t(a, b) for a, b in zip(x, y)], inplace=False)


@pytest.mark.parametrize('name, args', [('sqrt_', ()), ('exp_', ()), ('clamp_', (0.6, 1.5))], ids=['sqrt_', 'exp_', 'clamp_'])
def test_inplace_torch_functions_return_the_bucket(name: str, args: tuple) -> None:
    """`torch.sqrt_(tl)` is the bucket's own in-place method (one foreach kernel): it returns the bucket itself, its
    tensors changed, as `torch.sqrt_(t)` returns `t`."""
    x = make(positive=True)
    run(x, lambda tl: getattr(torch, name)(tl, *args), [getattr(torch, name)(t.clone(), *args) for t in x],
        inplace=True)


def test_a_torch_function_without_a_name_runs_per_param() -> None:
    """What reaches `__torch_function__` need not have a `__name__` (any callable given to
    `torch.overrides.handle_torch_function`, such as a partial): it runs once per tensor."""
    x, fn = make(), functools.partial(torch.add, alpha=2)
    run(x, lambda tl: torch.overrides.handle_torch_function(fn, (tl,), tl, 1.5), [fn(t, 1.5) for t in x],
        inplace=False)


def test_torch_function_with_tuple_results() -> None:
    "An op giving a tuple per param gives a tuple of buckets, of torch's type (`torch.sort`'s values and indices)."
    x = make()
    for got in (torch.sort(x), x.sort(), x.sort(descending=True)):
        assert type(got) is type(torch.sort(x[0]))
    check(torch.sort(x).values, [torch.sort(t).values for t in x])
    check(x.sort(descending=True).indices, [t.sort(descending=True).indices for t in x])
    s = TensorList([torch.tensor(3.), torch.tensor(1.)])
    ts = list(s)
    s.sort()  # inside each tensor: the params keep their order (list.sort would swap these two)
    assert all(a is b for a, b in zip(s, ts))
    parts = make(shapes=[(4,), (4, 2)]).split(2)
    assert type(parts) is tuple and len(parts) == 2 and all(type(p) is TensorList for p in parts)


def test_tuple_results_of_one_part_and_of_one_param() -> None:
    """Per-param tuples of one part (`split` into chunks as long as the tensors) are a tuple of one bucket, and a
    bucket of one param gives tuples too (of torch's type: sort's values/indices)."""
    x = make(shapes=[(2,), (4,)])
    got = x.split(4)
    assert type(got) is tuple and len(got) == 1
    check(got[0], [t.split(4)[0] for t in x])
    one = make(shapes=[(5,)])
    got, ref = one.sort(), one[0].sort()
    assert type(got) is type(ref)
    check(got.values, [ref.values])
    check(got.indices, [ref.indices])


def test_torch_function_with_buckets_in_a_list() -> None:
    "`torch.stack([a, b])`, buckets in a list argument: one call per param."
    x, y = make(), make(seed=1)
    run(x, lambda tl: torch.stack([tl, y]), [torch.stack([a, b]) for a, b in zip(x, y)], inplace=False)
    run(x, lambda tl: torch.stack((tl, y)).amax(0), [torch.stack((a, b)).amax(0) for a, b in zip(x, y)], inplace=False)


def test_empty_like() -> None:
    "`torch.empty_like` keeps each param's shape and dtype (its values are arbitrary)."
    x = make(torch.float64)
    y = torch.empty_like(x)
    assert [(t.shape, t.dtype) for t in y] == [(t.shape, t.dtype) for t in x]


# -- what a whole bucket has no value for: BucketError -----------------------------------------------------------------
def test_bucket_error_is_a_type_error() -> None:
    assert issubclass(BucketError, TypeError)


@pytest.mark.parametrize('name', ['shape', 'ndim', 'requires_grad', 'is_leaf', 'T', 'mT', 'layout', 'is_cuda',
                                  'itemsize'])
def test_tensor_attributes_raise_bucket_error(name: str) -> None:
    """A tensor attribute that is not a method (`tl.shape`) differs per param: a BucketError that is also an
    AttributeError, so `hasattr`/`getattr(x, name, default)` still read it as missing."""
    x = make()
    with pytest.raises(BucketError) as e: getattr(x, name)
    assert isinstance(e.value, AttributeError)
    assert not hasattr(x, name) and getattr(x, name, 'missing') == 'missing'
    with pytest.raises(BucketError): getattr(TensorList(), name)  # an empty bucket has none either


def test_real_errors_are_not_bucket_errors() -> None:
    "What would fail per param fails on the bucket with the same error, never a BucketError the engine would catch."
    x = make()
    for f, err in ((lambda: x + make(shapes=[(3,), (), (0,), (8, 16)]), RuntimeError),  # a shape mismatch
                   (lambda: x.add('a'), TypeError), (lambda: x.view(5), RuntimeError),
                   (lambda: x.clamp(), RuntimeError), (lambda: make(shapes=[(2,)]).item(), RuntimeError)):
        with pytest.raises(err) as e: f()
        assert not isinstance(e.value, BucketError)


def test_attributes_set_on_the_params_raise_bucket_error() -> None:
    "An attribute the params carry themselves (set on the tensor, not Tensor's) has a value per param too."
    x = make()
    for t in x: t.lr_mult = 2.0
    with pytest.raises(BucketError): x.lr_mult
    assert not hasattr(torch.Tensor, 'lr_mult')


def test_unknown_attribute_is_a_plain_attribute_error() -> None:
    "A name tensors do not have either is a bug in the callback, not a bucket limit: no BucketError."
    with pytest.raises(AttributeError) as e: make().not_a_tensor_attribute
    assert not isinstance(e.value, BucketError)
    with pytest.raises(AttributeError) as e: make().__array_struct__  # Python's and numpy's protocol lookups
    assert not isinstance(e.value, BucketError)


def test_methods_run_per_tensor() -> None:
    "A tensor method TensorList has no foreach kernel for runs once per tensor."
    x = make()
    run(x, lambda tl: tl.square(), [t.square() for t in x], inplace=False)
    run(x, lambda tl: tl.mul(2).sum(), [t.mul(2).sum() for t in x], inplace=False)
    run(x, lambda tl: tl.to(torch.float64), [t.to(torch.float64) for t in x], inplace=False)
    run(x, lambda tl: tl.to(dtype=torch.float64), [t.to(dtype=torch.float64) for t in x], inplace=False)  # keywords too


@pytest.mark.parametrize('convert', [float, int, complex, math.sqrt, math.floor, operator.index, range, bool,
                                     lambda x: 1 if x else 0, lambda x: not x, lambda x: x and 1])
def test_python_numbers_and_control_flow_raise_bucket_error(convert) -> None:
    "A Python number or truth value of a bucket does not exist: `float(tl)`, `if tl:`..."
    with pytest.raises(BucketError): convert(make(shapes=[(1,), ()]))


@pytest.mark.parametrize('method', ['item', 'tolist', 'numel', 'dim', 'size', 'is_floating_point', 'data_ptr'])
def test_non_tensor_results_raise_bucket_error(method: str) -> None:
    """A method giving a Python value per param (`.item()`, `.size()`...) has no one value for a bucket.
    (`.item()` of a tensor of several elements is a RuntimeError per param already: one-element params here.)"""
    for shapes in ([(1,), ()], [(), ()], [(1, 1), (1, 1)]):  # `.size()` of 0-d tensors is (): no bucket either
        with pytest.raises(BucketError): getattr(make(shapes=shapes), method)()


def test_tuples_of_different_lengths_raise_bucket_error() -> None:
    "Per-param tuples of different lengths (`split` of tensors of different sizes) are no bucket of tuples."
    with pytest.raises(BucketError): make(shapes=[(2,), (4,)]).split(2)


def test_lists_of_different_lengths_raise_bucket_error() -> None:
    "Two buckets of different lengths in one op are not one bucket's values: BucketError, whichever op meets them."
    x, y = make(), make(shapes=[(64,)])
    for f in (lambda: x + y, lambda: x.add_(y), lambda: torch.where(x > 0, x, y), lambda: x.lerp(y, 0.5),
              lambda: x.lerp_(x, y), lambda: x.addcmul(y, x), lambda: x.addcdiv_(x, y), lambda: x.copy_(y)):
        with pytest.raises(BucketError): f()


def test_error_messages() -> None:
    """The errors say what went wrong in these words, whole (the engine's fallback reports them to a callback's
    author); clamp without bounds says what torch says."""
    x = make(shapes=[(1,), ()])
    with pytest.raises(RuntimeError) as torch_err: torch.ones(2).clamp()
    for f, err, msg in ((lambda: x + make(shapes=[(1,)]), BucketError, "TensorLists of different lengths in one op"),
                        (lambda: bool(x), BucketError,
                         "Python control flow on a tensor value cannot run on a whole bucket"),
                        (lambda: float(x), BucketError, "a bucket has no Python number value (float(), int(), math.*)"),
                        (lambda: x.norm(out=x), TypeError, "TensorList.norm() takes no 'out'"),
                        (lambda: x.clamp(), RuntimeError, str(torch_err.value)),
                        (lambda: x.clamp_(), RuntimeError, str(torch_err.value)),
                        (lambda: x.add('a'), TypeError, "TensorList.add() cannot take a str"),
                        (lambda: x.mul_('a'), TypeError, "TensorList.mul_() cannot take a str"),
                        (lambda: x.lerp('a', 0.5), TypeError, "expected a tensor or a TensorList, got str"),
                        (lambda: x.item(), BucketError,
                         "an op gave float values per param, which a bucket cannot hold as one value"),
                        # a property's AttributeError sends Python to __getattr__, whose message is the one seen
                        (lambda: TensorList().dtype, BucketError,
                         "tensor attribute 'dtype' has a value per param, none for a whole bucket"),
                        (lambda: TensorList([torch.ones(1), torch.ones(1, dtype=torch.float64)]).dtype, BucketError,
                         "tensor attribute 'dtype' has a value per param, none for a whole bucket"),
                        (lambda: x.shape, BucketError,
                         "tensor attribute 'shape' has a value per param, none for a whole bucket"),
                        (lambda: x.not_a_tensor_attribute, AttributeError,
                         "'TensorList' object has no attribute 'not_a_tensor_attribute', nor has a tensor"),
                        (lambda: x.__array_struct__, AttributeError,
                         "'TensorList' object has no attribute '__array_struct__'"),
                        (lambda: make(shapes=[(1,)]).item(), BucketError,  # a bucket of one param: one value, still per param
                         "an op gave float values per param, which a bucket cannot hold as one value"),
                        (lambda: tensorlist._zip_call(torch.add, ([[x]], 1), {}), BucketError,
                         "add got TensorLists nested deeper than one list"),
                        (lambda: tensorlist._zip_call(functools.partial(torch.add), ([[x]], 1), {}), BucketError,
                         f"{functools.partial(torch.add)} got TensorLists nested deeper than one list")):
        with pytest.raises(err) as e: f()
        assert str(e.value) == msg


def test_repr() -> None:
    "A TensorList shows as one, with its tensors as a list shows them."
    assert repr(TensorList([torch.tensor(1.), torch.tensor([2., 3.])])) == "TensorList([tensor(1.), tensor([2., 3.])])"


@pytest.mark.parametrize('op', ['method', 'torch'])
@pytest.mark.parametrize('name, args', [('relu_', ()), ('fill_', (0.25,)), ('clamp_min_', (0.5,))])
def test_inplace_ops_without_a_kernel_return_the_bucket(name: str, args: tuple, op: str) -> None:
    """An in-place op that runs per tensor (no foreach kernel: `tl.relu_()`, `torch.relu_(tl)`) returns the bucket
    itself, its tensors changed, as the foreach-backed ones do and as `t.relu_()` returns `t`."""
    x = make()
    if op == 'torch' and not hasattr(torch, name): pytest.skip(f'torch has no function {name}')
    fn = (lambda tl: getattr(tl, name)(*args)) if op == 'method' else (lambda tl: getattr(torch, name)(tl, *args))
    run(x, fn, [getattr(t.clone(), name)(*args) for t in x], inplace=True)


def test_an_op_giving_new_tensors_gives_a_new_bucket() -> None:
    "Not in place: a new TensorList, even of an op named like one (`tl.clone()`), and of an empty bucket."
    x = make()
    run(x, lambda tl: tl.clone(), [t.clone() for t in x], inplace=False)
    empty = TensorList([])
    assert torch.zeros_like(empty) is not empty
