"""The scalar barrier of compiled chains: every Python number a callback passes to a torch op becomes a 0-d tensor
behind the opaque op `cbopt::scalar` (`ScalarArgsAsTensors`), so dynamo keeps it a graph input (a changed lr or step
never recompiles) and inductor cannot fold it into the code; `ScalarsOnce`, an inductor graph pass, computes each
distinct scalar once per graph (`cbopt::scalars`) instead of once per param the chain is unrolled over.

Both are made on first use (`register_ops`, `scalars_once_pass`: the compiled chain's first compile), so `import cbopt`
registers no op and imports no part of `torch._inductor`. Where this torch lacks what the pass needs
(`cbopt._torch.inductor_pass_api`), compiled chains run without it: the same values, more Python per call."""
from __future__ import annotations

import operator

import torch

from .._torch import inductor_pass_api

__all__ = ['scalar', 'register_ops', 'scalars_once_pass', 'ScalarArgsAsTensors', 'ScalarsOnce']


_LIB = None  # the `cbopt` op library, once `register_ops` made it


def register_ops() -> None:
    """Define `cbopt::scalar` and `cbopt::scalars` (with their fake kernels, for tracing), once per process: on the
    first compile, not at `import cbopt` (an import should not register ops nobody calls)."""
    global _LIB
    if _LIB is not None: return
    lib = torch.library.Library('cbopt', 'DEF')  # (a plain op: `torch.library.custom_op`'s wrapping costs 4x per call)
    lib.define('scalar(Tensor x) -> Tensor')
    lib.impl('scalar', lambda x: x.clone(), 'CompositeExplicitAutograd')
    torch.library.register_fake('cbopt::scalar', lambda x: torch.empty_like(x), lib=lib)
    lib.define('scalars(Tensor[] xs) -> Tensor[]')  # (several at once: `ScalarsOnce`)
    lib.impl('scalars', lambda xs: [x.clone() for x in xs], 'CompositeExplicitAutograd')
    torch.library.register_fake('cbopt::scalars', lambda xs: [torch.empty_like(x) for x in xs], lib=lib)
    _LIB = lib


def scalar(x: torch.Tensor) -> torch.Tensor:
    """`x`, a 0-d value, as a buffer of its own: opaque to inductor, which computes it before the loop that reads it.
    Inductor otherwise inlines a 0-d computation into every loop over a param that uses it, where it is redone for
    each vector of elements: a chain's per-step scalar math (`mom ** step`, NAdam's momentum schedule: `pow`s and
    divisions in double) made its compiled step several times slower than the memory traffic (README, catalogue)."""
    if _LIB is None: register_ops()
    return torch.ops.cbopt.scalar.default(x)


class ScalarArgsAsTensors(torch.overrides.TorchFunctionMode):
    """Inside the compiled chain, turn `alpha=`/`value=`/`weight=`/clamp numbers into tensor ops: torch.compile keeps
    a Python number symbolic (no recompile when lr or step change) only where it meets a tensor, and would otherwise
    bake it into the graph and recompile at every new value. With `scalars_once` (the compiled chain's; not where a
    chain runs under autograd or vmap, which `scalar` does not support), the float numbers and 0-d tensors that
    arithmetic on a param-sized tensor reads go through `scalar` first: computed once per step, not per element."""
    ARITH = {torch.Tensor.mul, torch.Tensor.mul_, torch.Tensor.div, torch.Tensor.div_, torch.Tensor.add, torch.Tensor.add_,
             torch.Tensor.sub, torch.Tensor.sub_, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.Tensor.__truediv__,
             torch.Tensor.__rtruediv__, torch.Tensor.__add__, torch.Tensor.__radd__, torch.Tensor.__sub__,
             torch.Tensor.__rsub__, torch.mul, torch.div, torch.add, torch.sub}
    ALPHA = {torch.Tensor.add, torch.Tensor.add_, torch.Tensor.sub, torch.Tensor.sub_, torch.add, torch.sub}
    VALUE = {torch.Tensor.addcmul, torch.Tensor.addcmul_, torch.Tensor.addcdiv, torch.Tensor.addcdiv_, torch.addcmul,
             torch.addcdiv}
    LERP = {torch.Tensor.lerp: torch.Tensor.add, torch.Tensor.lerp_: torch.Tensor.add_, torch.lerp: torch.add}
    CLAMP = {torch.Tensor.clamp, torch.Tensor.clip, torch.clamp, torch.clip}
    CLAMP_ = {torch.Tensor.clamp_, torch.Tensor.clip_}

    def __init__(self, scalars_once: bool = False):
        super().__init__()
        self.scalars_once = scalars_once

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if self.scalars_once and any(isinstance(a, torch.Tensor) and a.dim() > 0 for a in (*args, *kwargs.values())):
            args, kwargs = self._scalars_once(func, args, kwargs)  # (an op over elements)
        if func in self.CLAMP or func in self.CLAMP_:  # as maximum/minimum with tensors (seen miscompiled otherwise)
            x, bounds = args[0], [*args[1:], None, None]
            lo, hi = kwargs.get('min', bounds[0]), kwargs.get('max', bounds[1])
            as_t = lambda v: v if isinstance(v, torch.Tensor) else torch.zeros_like(x) + v
            res = x if lo is None else torch.maximum(x, as_t(lo))
            res = res if hi is None else torch.minimum(res, as_t(hi))
            return x.copy_(res) if func in self.CLAMP_ else res
        if func in self.ALPHA and 'alpha' in kwargs: args = (args[0], args[1] * kwargs.pop('alpha'), *args[2:])
        elif func in self.VALUE and 'value' in kwargs: args = (args[0], args[1] * kwargs.pop('value'), *args[2:])
        elif func in self.LERP and len(args) == 3 and not isinstance(args[2], torch.Tensor):
            x, end, w = args  # x + w * (end - x)
            return self.LERP[func](x, (end - x) * w)
        return func(*args, **kwargs)

    def _scalars_once(self, func, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """`func`'s 0-d tensor args through `scalar`, whatever the op (schedule-free's `lerp_(z, ckp1)` and
        `addcmul_(grad, 0-d)` read a weight computed from `step ** r`); float args too where `func` is arithmetic, and
        `alpha=`/`value=` numbers. Not an `out=`, which is written (a 0-d tensor that an in-place op over elements
        would write into is an error anyway: a result over elements does not fit in it). For an op over float32
        tensors only, a float64 value is made float32 before its barrier (`_once`)."""
        floats = func in self.ARITH
        to = torch.float32 if all(a.dtype == torch.float32 for a in (*args, *kwargs.values())
                                  if isinstance(a, torch.Tensor) and a.dim() > 0) else None
        args = tuple(_once(a, floats, to) for a in args)
        numbers = ('alpha', 'value') if func in self.ALPHA or func in self.VALUE else ()
        return args, {k: v if k == 'out' else _once(v, k in numbers, to) for k, v in kwargs.items()}


def _once(v, floats: bool = True, to: torch.dtype | None = None):
    """A 0-d tensor, or a float if `floats`, through `scalar` (a float as a float64 tensor, Python's precision, made
    by adding it to one: a symbolic float meeting a tensor stays symbolic, where `torch.scalar_tensor` of it would
    recompile every step); anything else as it is. A float64 value is first made `to` (float32, for an op over float32
    tensors, which makes it float32 before its math anyway): inductor's loop reloads a 0-d buffer for every vector of
    elements (the C++ compiler cannot hoist the load past the loop's stores), and a float32 one is one load where a
    float64 one is a load and a conversion: Lion's loop on one tensor of 31M floats ran at 1.01x the memory-traffic
    floor against 1.14x."""
    if isinstance(v, float):
        if not floats: return v
        v = torch.zeros((), dtype=torch.float64) + v
    elif not (isinstance(v, torch.Tensor) and v.dim() == 0): return v
    return scalar(v.to(to) if to is not None and v.dtype == torch.float64 else v)


class _ScalarsOnce:
    """Inductor pass (after autograd, before lowering): each step's `cbopt::scalar`s in as few calls as can be. The
    chain runs once per param of a compiled call, so each per-step number (`lr`, `1 - mom`) reaches `scalar` once per
    param, and each `scalar` is a call of a Python op at every step (Lion: 40 a graph, 19 graph calls a step, 15 ms of
    a 90 ms step on GPT-2 at half width). So: one `scalar` per value; none of a graph input (computed already); then
    the `scalar`s that do not depend on each other as one call of `cbopt::scalars`. The class `ScalarsOnce` is this
    one on inductor's `CustomGraphPass` (made when first asked for: it imports `torch._inductor`)."""
    def __call__(self, graph: torch.fx.Graph) -> None:
        seen: dict = {}
        for node in [n for n in graph.nodes if _is_scalar(n)]:
            src = node.args[0]
            keep = seen.setdefault(_value_key(src), src if src.op == 'placeholder' and not _written(src) else node)
            if keep is not node:
                node.replace_all_uses_with(keep)
                graph.erase_node(node)
        _merge_scalars(graph)

    def uuid(self) -> bytes: return _CLASS['api'].get_hash_for_files((__file__,))


_CLASS: dict = {}  # 'ScalarsOnce' -> the class, once made; 'api' -> `cbopt._torch.inductor_pass_api()` it was made from


def _pass_class() -> type | None:
    "`ScalarsOnce`, made on inductor's `CustomGraphPass` the first time; None where this torch lacks the pass API."
    if 'ScalarsOnce' not in _CLASS:
        api = _CLASS['api'] = inductor_pass_api()  # (one dict: the class and the API it was made from go together)
        _CLASS['ScalarsOnce'] = None if api is None else \
            type('ScalarsOnce', (_ScalarsOnce, api.CustomGraphPass), {'__module__': __name__, '__doc__': _ScalarsOnce.__doc__})
    return _CLASS['ScalarsOnce']


def scalars_once_pass():
    "A `ScalarsOnce` pass for inductor's `post_grad_custom_post_pass` option, or None where this torch cannot run it."
    cls = _pass_class()
    return None if cls is None else cls()


def __getattr__(name: str):
    "`ScalarsOnce`, made when first asked for (it imports `torch._inductor`; `import cbopt` does not)."
    if name == 'ScalarsOnce':
        cls = _pass_class()
        if cls is not None: return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _value_key(node: torch.fx.Node):
    """`node`'s value, for `ScalarsOnce`: the node, or for a dtype conversion (`_once`'s float32, made once per param
    of the graph) the conversion of its input's value."""
    if node.op == 'call_function' and node.target in (torch.ops.prims.convert_element_type.default,
                                                       torch.ops.aten._to_copy.default):
        return node.target, _value_key(node.args[0]), node.args[1:], tuple(sorted(node.kwargs.items(), key=str))
    return node


def _is_scalar(node: torch.fx.Node) -> bool:
    return node.op == 'call_function' and node.target is torch.ops.cbopt.scalar.default


def _mutates(node: torch.fx.Node) -> bool:
    "Whether `node` writes into a tensor (torch's input-mutation epilogue, an in-place op), or may (another kind of op)."
    t = node.target
    higher_order, overload = _CLASS['api'].op_kinds
    return node.op == 'call_function' and (isinstance(t, higher_order) or isinstance(t, overload) and t._schema.is_mutable)


def _written(node: torch.fx.Node) -> bool:
    "Whether an op of the graph writes into `node` (a graph input that the step updates in place)."
    return any(_mutates(u) and u.args and u.args[0] is node for u in node.users)


def _merge_scalars(graph: torch.fx.Graph) -> None:
    """Replace the `scalar` nodes of each depth (the most `scalar`s on a path to them: none of a depth reads another)
    and device by one `scalars` node after the last of their inputs, then move their readers after it (a stable topological
    sort). Only `scalar`s whose input comes before the graph's first write: the readers that move then cross no write."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    first_write = min((order[n] for n in graph.nodes if _mutates(n)), default=len(order))
    depth: dict = {}
    groups: dict = {}
    for n in graph.nodes:
        d = max((depth[a] for a in n.all_input_nodes), default=0)
        if _is_scalar(n):
            d += 1  # (merged by device too: a CUDA graph's CPU scalars, the tensorified hypers, stay apart from its own)
            device = getattr(n.meta.get('val'), 'device', None)
            if order[n.args[0]] < first_write: groups.setdefault((d, device), []).append(n)
        depth[n] = d
    groups = [g for g in groups.values() if len(g) > 1]
    for members in groups:
        srcs = [m.args[0] for m in members]
        with graph.inserting_after(max(srcs, key=order.__getitem__)):
            many = graph.call_function(torch.ops.cbopt.scalars.default, (srcs,))
        many.meta['val'] = [m.meta.get('val') for m in members]
        for i, m in reversed(list(enumerate(members))):
            with graph.inserting_after(many): item = graph.call_function(operator.getitem, (many, i))
            item.meta.update(m.meta)
            m.replace_all_uses_with(item)
            graph.erase_node(m)
    if groups: _CLASS['api'].stable_topological_sort(graph)
