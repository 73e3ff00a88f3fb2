"""`TensorList`: the tensors of a bucket seen as one value, so that a callback written for one param runs on many.

Every op spreads over the list: `torch._foreach_*` kernels where torch has one (arithmetic, `addcmul_`, `lerp_`,
`sqrt`, `norm`...), one call per tensor otherwise (`torch.where`, comparisons, `F.softplus`, `clone`...). Reductions
are per tensor (`x.pow(2).mean()` is one 0-d tensor per param), and a list of 0-d tensors broadcasts against the
full tensors, as a 0-d tensor would.

What has no one value for a whole bucket raises `BucketError` (a TypeError), which the engine catches, and only
it, to run that bucket param by param: Python control flow on a tensor value (`bool(tl)`), a Python number of it
(`float(tl)`, `int(tl)`, `math.sqrt(tl)`, `operator.index(tl)`), a method giving Python values per param
(`.item()`, `.tolist()`, `.size()`), and a tensor attribute that is not a method (`tl.shape`, `tl.ndim`): the last
raise `BucketAttributeError`, a BucketError that is also an AttributeError, so `hasattr(tl, 'shape')` is False.
Anything else a callback gets wrong (a shape mismatch, a name tensors do not have) raises as it would per param.
"""
from __future__ import annotations

import inspect
import operator
from numbers import Number
from typing import Any

import torch

from .._torch import foreach_op
from .dtensor import is_dtensor

__all__ = ['TensorList', 'BucketError']


class BucketError(TypeError):
    "A callback did something that has no meaning for a whole bucket at once (e.g. `if` on a tensor value)."


class BucketAttributeError(BucketError, AttributeError):
    "A tensor attribute that a whole bucket has no one value for (`tl.shape`); an AttributeError for `hasattr` too."


_fe = foreach_op  # `torch._foreach_<name>`, looked up at each call
_HALF = (torch.bfloat16, torch.float16)
_PLAIN_NUMBERS = (float, int)  # (bool is a Number too: `isinstance` finds it)
_MISSING = object()
_NO_BOUND = "torch.clamp: At least one of 'min' or 'max' must not be None"  # torch's words


def _same_length(n: int, tls) -> None:
    if any(len(o) != n for o in tls): raise BucketError("TensorLists of different lengths in one op")


def _buckets(args: tuple, kwargs: dict) -> list:
    "The TensorLists among the arguments, inside a list or tuple argument too (`torch.stack([a, b])`)."
    flat = [o for a in [*args, *kwargs.values()] for o in (a if type(a) in (list, tuple) else [a])]
    return [a for a in flat if isinstance(a, TensorList)]


def _plain(a: Any) -> Any:
    """Argument `a` with its TensorLists as plain lists, which `_pick` indexes (dynamo traces `list.__getitem__` of a
    plain list, not of a list subclass: an outer compiled step runs callbacks on TensorLists)."""
    if isinstance(a, TensorList): return _Each(a)
    if type(a) in (list, tuple) and any(isinstance(o, TensorList) for o in a): return type(a)(_plain(o) for o in a)
    return a


class _Each(list):
    "A TensorList's tensors as `_pick` hands them out, one per param."


def _pick(a: Any, i: int) -> Any:
    "Argument `a` (through `_plain`) as param `i` sees it."
    if type(a) is _Each: return a[i]
    if type(a) in (list, tuple) and any(type(o) is _Each for o in a): return type(a)(_pick(o, i) for o in a)
    return a


def _zip_call(fn, args: tuple, kwargs: dict):
    "Call `fn` once per tensor of the TensorLists among `args`/`kwargs`; other arguments are passed to every call."
    tls = _buckets(args, kwargs)
    if not tls: raise BucketError(f"{getattr(fn, '__name__', fn)} got TensorLists nested deeper than one list")
    n = len(tls[0])
    _same_length(n, tls)
    args, kwargs = [_plain(a) for a in args], {k: _plain(v) for k, v in kwargs.items()}
    res = [fn(*[_pick(a, i) for a in args], **{k: _pick(v, i) for k, v in kwargs.items()}) for i in range(n)]
    return _wrap(res)


def _itself(tl: TensorList, res):
    """`tl` itself where an op gave back its own tensors, as torch returns the tensor itself: an in-place op per tensor
    (`tl.relu_()`, `torch.relu_(tl)`, as the foreach-backed in-place ops return the bucket), or an op that returns its
    input unchanged (`tl.contiguous()` of contiguous tensors, as `t.contiguous() is t`); else `res`."""
    if isinstance(res, TensorList) and len(res) == len(tl) and len(tl) and all(r is t for r, t in zip(res, tl)): return tl
    return res


def _wrap(res: list):
    "Per-tensor results as a TensorList (or a tuple of them, of torch's named type); anything else is no bucket value."
    if all(isinstance(r, torch.Tensor) for r in res): return TensorList(res)
    if res and all(isinstance(r, tuple) for r in res) and 0 < len(res[0]) == min(map(len, res)) == max(map(len, res)):
        parts, t = [_wrap(list(o)) for o in zip(*res)], type(res[0])
        return tuple(parts) if t is tuple else t(parts)  # torch.return_types (sort's values/indices) take a sequence
    raise BucketError(f"an op gave {type(res[0]).__name__} values per param, which a bucket cannot hold as one value")


def _half_on_cpu(tl: list) -> bool:
    """Whether a bucket's tensors are 16-bit floats on the CPU, read from its first (a bucket has one dtype and one
    device): a test per op, not per tensor."""
    first = list(tl)[0] if len(tl) else None  # (not list.__getitem__: see `TensorList.__getattr__`)
    return first is not None and first.dtype in _HALF and first.is_cpu


def _vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    "torch.linalg.vector_norm per tensor; one foreach kernel for the norm of all of each tensor's elements."
    if dim is None and not keepdim and isinstance(x, TensorList):
        return TensorList(_fe('norm')(list(x), ord, dtype=dtype))
    return _zip_call(torch.linalg.vector_norm, (x, ord, dim, keepdim), {'dtype': dtype})


class TensorList(list):
    "A list of tensors that behaves like one tensor: ops run over all of them (see the module docstring)."
    grad: TensorList | None = None  # set on a bucket's stand-in param

    # -- what a callback reads ---------------------------------------------------------------------------------
    @property
    def data(self) -> TensorList: return self
    @property
    def dtype(self) -> torch.dtype: return self._common('dtype')
    @property
    def device(self) -> torch.device: return self._common('device')
    def _common(self, name: str):
        "The params' one dtype or device (a bucket has one; an empty or mixed list has none)."
        vals = {getattr(t, name) for t in list(self)}
        if len(vals) != 1: raise BucketAttributeError(f"a TensorList of {len(vals)} {name}s has no one {name}")
        return vals.pop()

    def __bool__(self): raise BucketError("Python control flow on a tensor value cannot run on a whole bucket")
    def _no_number(self, *args): raise BucketError("a bucket has no Python number value (float(), int(), math.*)")
    __float__ = __int__ = __index__ = __complex__ = _no_number
    __hash__ = None

    def __repr__(self) -> str: return f"TensorList({list.__repr__(self)})"
    def sort(self, *args, **kwargs):
        "Tensor.sort per tensor (values and indices), not list.sort: the params of a bucket are not to be reordered."
        return _zip_call(torch.Tensor.sort, (self, *args), kwargs)

    def __getattr__(self, name: str):
        """Any other tensor method (no foreach kernel for it), called once per tensor. A tensor attribute that is not
        a method (`shape`) has a value per param: BucketAttributeError. A name tensors do not have is an AttributeError
        as on a tensor (so are Python's `__dunder__` lookups: copy, pickle, numpy)."""
        if name.startswith('__'): raise AttributeError(f"'TensorList' object has no attribute {name!r}")
        first = list(self)[0] if len(self) else None  # (not list.__getitem__(self, 0): dynamo traces neither of
        # list's unbound methods on a subclass, as a compiled step runs this)
        attr = inspect.getattr_static(torch.Tensor if first is None else first, name, _MISSING)  # no property runs
        if attr is _MISSING: raise AttributeError(f"'TensorList' object has no attribute {name!r}, nor has a tensor")
        if first is None or not callable(attr):
            raise BucketAttributeError(f"tensor attribute {name!r} has a value per param, none for a whole bucket")
        return lambda *args, **kwargs: _itself(self, _zip_call(lambda t, *a, **k: getattr(t, name)(*a, **k),
                                                                (self, *args), kwargs))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        "torch functions (`torch.zeros_like`, `torch.where`, `F.softplus`...) called with TensorLists."
        kwargs = kwargs or {}
        if func is torch.linalg.vector_norm: return _vector_norm(*args, **kwargs)
        name = getattr(func, '__name__', '')
        if name in _OPERATORS and len(args) == 2 and not kwargs and func is not getattr(torch, name, None):
            op, reflected = _OPERATORS[name]  # (one op per param, without `_zip_call`'s handling of any arguments)
            a, b = reversed(args) if reflected else args
            if isinstance(a, TensorList) and not isinstance(b, TensorList): return TensorList([op(t, b) for t in list(a)])
            if isinstance(b, TensorList) and not isinstance(a, TensorList): return TensorList([op(a, t) for t in list(b)])
        if args and isinstance(args[0], TensorList) and func is getattr(torch, name, None) \
                and getattr(cls, name, None) not in (None, getattr(list, name, None)):
            return getattr(args[0], name)(*args[1:], **kwargs)  # torch.sqrt(tl), torch.add(tl, 1)...: the method
        res = _zip_call(func, args, kwargs)
        return _itself(args[0], res) if args and isinstance(args[0], TensorList) else res

    # -- foreach-backed ops ------------------------------------------------------------------------------------
    def _binary(self, name: str, other: Any, inplace: bool, alpha: Any = 1):
        "`self <op> alpha*other`, in place or not, with `other` a scalar, a tensor or a TensorList."
        number = type(other) in _PLAIN_NUMBERS  # (the common case first: an op costs the kernel's time again in Python)
        if number: pass
        elif isinstance(other, TensorList):
            _same_length(len(self), [other])
            other = list(other)
        elif isinstance(other, torch.Tensor):  # one tensor for all: foreach takes a lone one if 0-d, in mul/div (its
            # add does too, but without torch's type promotion: a 0-d float32 param plus a 0-d float64 tensor would stay
            # float32, where torch.add gives float64)
            if other.dim() or name not in ('mul', 'div'): other = [other] * len(self)
        elif isinstance(other, Number): number = True
        else: return NotImplemented
        fn = _fe(name + '_' * inplace)
        scaled = name in ('add', 'sub') and not (isinstance(alpha, Number) and alpha == 1)
        kw = {'alpha': alpha} if scaled else {}
        # torch's op per param where foreach would differ: no kernel takes a number and an alpha, and on the CPU the
        # in-place mul by a number rounds the number to a 16-bit float dtype first (Tensor.mul_ multiplies in float32;
        # CUDA's foreach kernel does too, in its float32 opmath: one call for the bucket there)
        if number and (scaled or inplace and name == 'mul' and _half_on_cpu(self)):
            res = [getattr(t, name + '_' * inplace)(other, **kw) for t in self]
        elif scaled and isinstance(alpha, torch.Tensor) and alpha.numel() == 1 and not alpha.is_cpu \
                and type(other) is list:  # an alpha on a GPU (a tensor lr): `self + other * alpha` as one addcmul,
            a = [alpha.reshape(()) if name == 'add' else -alpha.reshape(())] * len(self)  # not read on the host
            res = _fe('addcmul' + '_' * inplace)(list(self), other, a)
        else: res = fn(list(self), other, **kw)
        return self if inplace else TensorList(res)

    def _op(self, name: str, other: Any, inplace: bool, alpha: Any = 1):
        "`_binary` as a method: an operand it cannot take is a TypeError, as for a tensor (operators: NotImplemented)."
        res = self._binary(name, other, inplace, alpha)
        if res is NotImplemented:
            raise TypeError(f"TensorList.{name}{'_' * inplace}() cannot take a {type(other).__name__}")
        return res

    def add(self, other, alpha=1): return self._op('add', other, False, alpha)
    def add_(self, other, alpha=1): return self._op('add', other, True, alpha)
    def sub(self, other, alpha=1): return self._op('sub', other, False, alpha)
    def sub_(self, other, alpha=1): return self._op('sub', other, True, alpha)
    def mul(self, other): return self._op('mul', other, False)
    def mul_(self, other): return self._op('mul', other, True)
    def div(self, other): return self._op('div', other, False)
    def div_(self, other): return self._op('div', other, True)
    def pow(self, other): return self._op('pow', other, False)
    def pow_(self, other): return self._op('pow', other, True)
    def maximum(self, other): return self._op('maximum', other, False)
    def minimum(self, other): return self._op('minimum', other, False)
    def _unary(self, name: str) -> TensorList: return TensorList(_fe(name)(list(self)))

    def _each(self, o: Any) -> list:
        "A tensor operand, one per param: a TensorList of as many tensors, or one tensor that every param sees."
        if isinstance(o, TensorList):
            _same_length(len(self), [o])
            return list(o)
        if isinstance(o, torch.Tensor): return [o] * len(self)
        raise TypeError(f"expected a tensor or a TensorList, got {type(o).__name__}")

    def lerp(self, end, weight):
        w = weight if isinstance(weight, Number) else self._each(weight)
        return TensorList(_fe('lerp')(list(self), self._each(end), w))
    def lerp_(self, end, weight):
        _fe('lerp_')(list(self), self._each(end), weight if isinstance(weight, Number) else self._each(weight))
        return self

    def _addc(self, name: str, t1, t2, value, inplace: bool):
        """addcmul/addcdiv. A tensor `value` (a 0-d tensor hyper, or a TensorList of one 0-d tensor per param) scales
        `t1` first, the order of torch's kernel (`self + value * t1 / t2`), without reading it back as a number."""
        if isinstance(value, (torch.Tensor, TensorList)): t1, value = t1 * value, 1
        res = _fe(name + '_' * inplace)(list(self), self._each(t1), self._each(t2), value)
        return self if inplace else TensorList(res)

    def addcmul(self, t1, t2, value=1): return self._addc('addcmul', t1, t2, value, False)
    def addcmul_(self, t1, t2, value=1): return self._addc('addcmul', t1, t2, value, True)
    def addcdiv(self, t1, t2, value=1): return self._addc('addcdiv', t1, t2, value, False)
    def addcdiv_(self, t1, t2, value=1): return self._addc('addcdiv', t1, t2, value, True)

    def clamp(self, min=None, max=None):
        "torch.clamp per tensor: min first, then max (so max wins where min > max, as in torch)."
        if min is None and max is None: raise RuntimeError(_NO_BOUND)
        res = self
        if min is not None: res = res._op('clamp_min', min, False)
        if max is not None: res = res._op('clamp_max', max, res is not self)
        return res
    def clamp_(self, min=None, max=None):
        if min is None and max is None: raise RuntimeError(_NO_BOUND)
        if min is not None: self._op('clamp_min', min, True)
        if max is not None: self._op('clamp_max', max, True)
        return self
    clip, clip_ = clamp, clamp_
    def clamp_min(self, v): return self._op('clamp_min', v, False)
    def clamp_max(self, v): return self._op('clamp_max', v, False)

    def copy_(self, src):
        "Tensor.copy_ of each; per tensor for DTensors (sharded params), which have no `_foreach_copy_`."
        if any(is_dtensor(t) for t in self): _zip_call(torch.Tensor.copy_, (self, src), {})
        else: _fe('copy_')(list(self), self._each(src))
        return self
    def zero_(self):
        _fe('zero_')(list(self))
        return self
    def fill_(self, v):
        "Tensor.fill_ per tensor: every value as it is, -0.0 too (zero_ then add_ would give 0.0)."
        _zip_call(torch.Tensor.fill_, (self, v), {})
        return self
    def clone(self, **kwargs): return TensorList(_fe('clone')(list(self), **kwargs))
    def detach(self): return TensorList(t.detach() for t in self)

    def norm(self, p='fro', dim=None, keepdim=False, dtype=None, out=None):
        "Tensor.norm per tensor (torch.norm too); one foreach kernel for the norm of all of each tensor's elements."
        if out is not None: raise TypeError("TensorList.norm() takes no 'out'")
        if dim is None and not keepdim and (p == 'fro' or isinstance(p, Number)):
            return TensorList(_fe('norm')(list(self), 2 if p == 'fro' else p, dtype=dtype))
        return _zip_call(torch.Tensor.norm, (self, p, dim, keepdim), {'dtype': dtype})

    # -- operators -----------------------------------------------------------------------------------------------
    def __add__(self, o): return self._binary('add', o, False)
    def __mul__(self, o): return self._binary('mul', o, False)
    def __sub__(self, o): return self._binary('sub', o, False)
    def __truediv__(self, o): return self._binary('div', o, False)
    def __pow__(self, o): return self._binary('pow', o, False)
    __radd__, __rmul__ = __add__, __mul__
    def __iadd__(self, o): return self.add_(o)
    def __isub__(self, o): return self.sub_(o)
    def __imul__(self, o): return self.mul_(o)
    def __itruediv__(self, o): return self.div_(o)
    def __ipow__(self, o): return self.pow_(o)
    def __rsub__(self, o): return self.neg().add_(o)
    def __rtruediv__(self, o): return self.reciprocal()._binary('mul', o, True)
    def __rpow__(self, o):
        if not isinstance(o, Number): return NotImplemented
        return TensorList(_fe('pow')(o, list(self)))
    def __neg__(self): return self.neg()
    def __abs__(self): return self.abs()
    def __getitem__(self, i):
        "An int picks one param's tensor (as a list does); anything else indexes inside every tensor."
        if isinstance(i, int): return super().__getitem__(i)
        return _zip_call(lambda t, i: t[i], (self, i), {})
    def __setitem__(self, i, v):
        "An int sets one param's tensor (as a list does); anything else writes inside every tensor (`tl[mask] = 0`)."
        if isinstance(i, int): return super().__setitem__(i, v)
        _same_length(len(self), _buckets((i, v), {}))
        i, v = _plain(i), _plain(v)
        for j, t in enumerate(list(self)): t[_pick(i, j)] = _pick(v, j)

    def _each_op(op):
        "A tensor operator with no foreach kernel, once per tensor."
        return lambda self, o: _zip_call(op, (self, o), {})
    def _each_op_(op):
        "An in-place operator per tensor: the bucket's own tensors change and it stays the same object, as a tensor."
        def iop(self, o):
            _zip_call(op, (self, o), {})
            return self
        return iop
    _T = torch.Tensor
    __eq__, __ne__ = _each_op(_T.__eq__), _each_op(_T.__ne__)
    __lt__, __le__ = _each_op(_T.__lt__), _each_op(_T.__le__)
    __gt__, __ge__ = _each_op(_T.__gt__), _each_op(_T.__ge__)
    __and__, __or__, __xor__ = _each_op(_T.__and__), _each_op(_T.__or__), _each_op(_T.__xor__)
    __rand__, __ror__, __rxor__ = __and__, __or__, __xor__
    __iand__, __ior__, __ixor__ = _each_op_(_T.__iand__), _each_op_(_T.__ior__), _each_op_(_T.__ixor__)
    __floordiv__, __rfloordiv__ = _each_op(_T.__floordiv__), _each_op(_T.__rfloordiv__)
    __ifloordiv__ = _each_op_(_T.__ifloordiv__)
    __mod__, __rmod__, __imod__ = _each_op(_T.__mod__), _each_op(_T.__rmod__), _each_op_(_T.__imod__)
    __lshift__, __rlshift__, __ilshift__ = _each_op(_T.__lshift__), _each_op(_T.__rlshift__), _each_op_(_T.__ilshift__)
    __rshift__, __rrshift__, __irshift__ = _each_op(_T.__rshift__), _each_op(_T.__rrshift__), _each_op_(_T.__irshift__)
    __matmul__, __rmatmul__ = _each_op(_T.__matmul__), _each_op(_T.__rmatmul__)
    del _T, _each_op, _each_op_
    def __pos__(self): return _zip_call(torch.Tensor.__pos__, (self,), {})
    def __invert__(self): return _zip_call(torch.Tensor.__invert__, (self,), {})


_OPERATORS = {'__add__': (operator.add, False), '__radd__': (operator.add, True), 'add': (operator.add, False),
              '__mul__': (operator.mul, False), '__rmul__': (operator.mul, True), 'mul': (operator.mul, False),
              '__sub__': (operator.sub, False), '__rsub__': (operator.sub, True), 'sub': (operator.sub, False),
              '__truediv__': (operator.truediv, False), '__rtruediv__': (operator.truediv, True),
              '__rdiv__': (operator.truediv, True), 'div': (operator.truediv, False)}
"""The tensor operators `__torch_function__` gets with a tensor and a TensorList, by name -> (the operator, whether
it is reflected: `Tensor.__rsub__(a, b)` is `b - a`): `t * tl` (Python calls the tensor's operator first), and in a
compiled step `tl * t` and `tl / t` too (dynamo hands an operator with a tensor operand to `__torch_function__`, as
`Tensor.mul(t, tl)` or `Tensor.__rdiv__(t, tl)`, where Python calls `TensorList.__mul__`). Each runs as the operator
once per param, as `_zip_call` would run it, but without its handling of any arguments (which dynamo traced anew for
each param: a third of a compiled Adam step's traced instructions) and of `Tensor.__rdiv__`'s (a reciprocal, then a
product: `tl / t` is a division per param, as in eager mode). Per param, not a foreach kernel with the lone tensor:
inductor compiled Adam's step in about 20% more time with `_foreach_mul(list, t)`, and it ran slower."""


def _per_tensor_method(name: str):
    "A tensor method without a foreach kernel, as a method of its own: dynamo traces it (not `__getattr__`'s lookup)."
    def method(self, *args, **kwargs):
        return _itself(self, _zip_call(lambda t, *a, **k: getattr(t, name)(*a, **k), (self, *args), kwargs))
    method.__name__ = name
    return method


PER_TENSOR_METHODS = ('mean', 'sum', 'square', 'square_', 'new_full', 'new_ones', 'new_zeros', 'masked_fill',
                      'masked_fill_', 'max', 'min', 'amax', 'amin', 'float', 'to', 'view_as', 'reshape_as', 'mul_add')
for _n in PER_TENSOR_METHODS:
    if hasattr(torch.Tensor, _n): setattr(TensorList, _n, _per_tensor_method(_n))


def _unary(name: str):
    def op(self): return self._unary(name)
    def op_(self):
        _fe(name + '_')(list(self))
        return self
    op.__name__, op_.__name__ = name, name + '_'
    return op, op_

UNARY_OPS = ('sqrt', 'rsqrt', 'exp', 'expm1', 'log', 'log1p', 'log2', 'log10', 'abs', 'neg', 'sign', 'reciprocal',
             'sigmoid', 'tanh', 'sin', 'cos', 'erf', 'floor', 'ceil', 'round', 'trunc', 'frac')  # foreach kernels
for _n in UNARY_OPS:
    _op, _op_ = _unary(_n)
    setattr(TensorList, _n, _op)
    if hasattr(torch, f'_foreach_{_n}_'): setattr(TensorList, _n + '_', _op_)
TensorList.negative = TensorList.neg
