"""The `fused` runner's general case: a bucket's whole chain compiled into one pass with `torch.compile`.

Compiled with dynamic shapes, and with every Python number turned into a tensor op (`ScalarArgsAsTensors`), so a
changed lr or step count never recompiles. Compiled once per chain and layout and kept in-process. The first step of
a layout, which creates the state, runs eagerly (foreach); a chain that does not compile runs with foreach, with a
one-time warning.

Few graphs, as each costs seconds of compilation with a cold cache (about 1 CPU-second per param it unrolls, plus a
fixed part): an elementwise chain (every callback declares scope 'element', so it does not care about a param's shape)
steps flat 1-D aliases of its params, in runs of `compile_chunk`, each size its own symbol (no duck shaping), the
last run padded with scratch params (`padding`): one graph, whatever the shapes. Each call costs about 0.3 ms of
Python (dynamo, AOT, inductor) whatever its size, so small params (biases, norms) are packed into one flat param
(`Pack`; a 0-d state entry per param, NAdam's `mu_product`, goes with them while it holds one value for all), and
the aliases are kept between steps (`flat_inputs`): GPT-2 small's 148 params are 50 matrices and one
pack of 98, 1 graph of 8, 7 calls a step (19 unpacked). Other chains step params of one shape per chunk
(`shape_chunks`).
"""
from __future__ import annotations

import operator
import types
from collections.abc import Callable, Mapping

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import stable_topological_sort

from ..chain import chain_scope, chain_sig, run_chain, transient_keys
from ..dtensor import as_like, is_dtensor, local, local_param
from .buckets import Bucket
from .foreach import foreach_bucket
from .runtime import runtime, warn_once

__all__ = ['ScalarArgsAsTensors', 'compiled_bucket', 'fused_bucket', 'float64_0d_copies']


_LIB = torch.library.Library('cbopt', 'DEF')  # (a plain op: `torch.library.custom_op`'s wrapping costs 4x per call)
_LIB.define('scalar(Tensor x) -> Tensor')
_LIB.impl('scalar', lambda x: x.clone(), 'CompositeExplicitAutograd')
torch.library.register_fake('cbopt::scalar', lambda x: torch.empty_like(x), lib=_LIB)


_LIB.define('scalars(Tensor[] xs) -> Tensor[]')  # (several at once: `ScalarsOnce`)
_LIB.impl('scalars', lambda xs: [x.clone() for x in xs], 'CompositeExplicitAutograd')
torch.library.register_fake('cbopt::scalars', lambda xs: [torch.empty_like(x) for x in xs], lib=_LIB)


def scalar(x: torch.Tensor) -> torch.Tensor:
    """`x`, a 0-d value, as a buffer of its own: opaque to inductor, which computes it before the loop that reads it.
    Inductor otherwise inlines a 0-d computation into every loop over a param that uses it, where it is redone for
    each vector of elements: a chain's per-step scalar math (`mom ** step`, NAdam's momentum schedule: `pow`s and
    divisions in double) made its compiled step several times slower than the memory traffic (README, catalogue)."""
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


class ScalarsOnce(CustomGraphPass):
    """Inductor pass (after autograd, before lowering): each step's `cbopt::scalar`s in as few calls as can be. The
    chain runs once per param of a compiled call, so each per-step number (`lr`, `1 - mom`) reaches `scalar` once per
    param, and each `scalar` is a call of a Python op at every step (Lion: 40 a graph, 19 graph calls a step, 15 ms of
    a 90 ms step on GPT-2 at half width). So: one `scalar` per value; none of a graph input (computed already); then
    the `scalar`s that do not depend on each other as one call of `cbopt::scalars`."""
    def __call__(self, graph: torch.fx.Graph) -> None:
        seen: dict = {}
        for node in [n for n in graph.nodes if _is_scalar(n)]:
            src = node.args[0]
            keep = seen.setdefault(_value_key(src), src if src.op == 'placeholder' and not _written(src) else node)
            if keep is not node:
                node.replace_all_uses_with(keep)
                graph.erase_node(node)
        _merge_scalars(graph)

    def uuid(self) -> bytes: return get_hash_for_files((__file__,))


_CONVERSIONS = (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)


def _value_key(node: torch.fx.Node):
    """`node`'s value, for `ScalarsOnce`: the node, or for a dtype conversion (`_once`'s float32, made once per param
    of the graph) the conversion of its input's value."""
    if node.op == 'call_function' and node.target in _CONVERSIONS:
        return node.target, _value_key(node.args[0]), node.args[1:], tuple(sorted(node.kwargs.items(), key=str))
    return node


def _is_scalar(node: torch.fx.Node) -> bool:
    return node.op == 'call_function' and node.target is torch.ops.cbopt.scalar.default


def _mutates(node: torch.fx.Node) -> bool:
    "Whether `node` writes into a tensor (torch's input-mutation epilogue, an in-place op), or may (another kind of op)."
    t = node.target
    return node.op == 'call_function' and (isinstance(t, torch._ops.HigherOrderOperator) or
                                           isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable)


def _written(node: torch.fx.Node) -> bool:
    "Whether an op of the graph writes into `node` (a graph input that the step updates in place)."
    return any(_mutates(u) and u.args and u.args[0] is node for u in node.users)


def _merge_scalars(graph: torch.fx.Graph) -> None:
    """Replace the `scalar` nodes of each depth (the most `scalar`s on a path to them: none of a depth reads another)
    by one `scalars` node after the last of their inputs, then move their readers after it (a stable topological
    sort). Only `scalar`s whose input comes before the graph's first write: the readers that move then cross no write."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    first_write = min((order[n] for n in graph.nodes if _mutates(n)), default=len(order))
    depth: dict = {}
    groups: dict = {}
    for n in graph.nodes:
        d = max((depth[a] for a in n.all_input_nodes), default=0)
        if _is_scalar(n):
            d += 1
            if order[n.args[0]] < first_write: groups.setdefault(d, []).append(n)
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
    if groups: stable_topological_sort(graph)


_COMPILED: dict = {}  # (compiler, chain_sig, chunk layout) -> compiled function, shared by every optimizer in the process


def float64_0d_copies(ts: Mapping) -> dict:
    """Copies, made in the graph, of a param's 0-d float64 state entries, which a compiled step hands the chain in
    their place. torch 2.13's AOT autograd drops every in-place update of a 0-d float64 graph input (as if it were one
    of dynamo's own tensorified Python floats: `m.mul_(x)`, `m.add_(x)`, `m.copy_(y)` alike, on CPU; NAdam's
    `mu_product` on float64 params), while a copy's update comes back as a new state entry, which the engine writes
    back as it does any rebound entry."""
    return {k: v.clone() for k, v in ts.items()
            if isinstance(v, torch.Tensor) and v.ndim == 0 and v.dtype == torch.float64}


def _fused_chain_fn(cbs, name: str) -> Callable:
    "The chain over a list of params as one function, under a code object of its own (torch.compile caches per code)."
    transient = transient_keys(cbs)
    def fused_chain(params, tstates, pystate, hyper):
        new_t, new_py = [], None
        with ScalarArgsAsTensors(scalars_once=True):
            for p, ts in zip(params, tstates):  # unrolled when compiled: one graph, fused by inductor
                st = {**pystate, **ts, **float64_0d_copies(ts)}
                run_chain(cbs, p, st, hyper)
                new_t.append({k: v for k, v in st.items()
                              if isinstance(v, torch.Tensor) and v is not ts.get(k) and k not in transient})
                if new_py is None:  # (the first param's: a run's padding, if any, comes last)
                    new_py = {k: v for k, v in st.items() if not isinstance(v, torch.Tensor) and k not in transient}
        return new_t, new_py
    code = fused_chain.__code__.replace(co_name=name)
    return types.FunctionType(code, fused_chain.__globals__, name, None, fused_chain.__closure__)


def compiled_chain(cbs, compiler: str, b: Bucket, idx: list, flat_run: int | None = None) -> Callable:
    """The chain compiled for the params `idx` of `b` (flat: for runs of `flat_run` flat params), with dynamic shapes
    and Python numbers: a change of lr or step does not recompile. Compiled once per chain and layout (device, dtype,
    ranks or run length, state keys) in this process."""
    p0 = b.params[idx[0]]
    ranks = ('flat', flat_run) if flat_run else tuple(b.params[i].ndim for i in idx)
    key = (compiler, chain_sig(cbs), p0.device, p0.dtype, ranks, tuple(b.states[idx[0]]))
    if key not in _COMPILED:
        fn = _fused_chain_fn(cbs, f'cbopt_fused_chain_{len(_COMPILED)}')
        # dynamic shapes come from `compiled_bucket`'s config patch, once per bucket: `dynamic=True` would patch the
        # config again at every call; inductor's size asserts repeat what dynamo's guards checked before the call
        options = {'size_asserts': False, 'post_grad_custom_post_pass': ScalarsOnce()} if compiler == 'inductor' else None
        _COMPILED[key] = torch.compile(fn, backend=compiler, fullgraph=True, options=options)
    return _COMPILED[key]


def shape_chunks(shapes: list[tuple], chunk: int) -> list[list[int]]:
    """Indices of same-shape params, in chunks of at most `chunk`. Same shapes let inductor step a whole chunk in one
    loop; a size from chunk/2 to chunk that divides a shape's count (1000 params: 40 chunks of 25) spares the compile
    of a remainder chunk. With dynamic shapes, chunks of the same rank and length share one compiled graph."""
    groups: dict = {}
    for i, s in enumerate(shapes): groups.setdefault(s, []).append(i)
    out = []
    for idx in groups.values():
        k = next((k for k in range(chunk, chunk // 2 - 1, -1) if len(idx) % k == 0), chunk)
        out += [idx[j:j + k] for j in range(0, len(idx), k)]
    return out


def flat_chunks(n: int, chunk: int) -> list[list[int]]:
    """Indices `0..n-1` in runs of `chunk`, the last one shorter (`compiled_bucket` pads it to the others' length):
    for flat params, whose sizes are all symbolic, one graph serves every run of a length."""
    return [list(range(j, min(j + chunk, n))) for j in range(0, n, chunk)]


PAD_NUMEL = 2  # the smallest size dynamo keeps symbolic (it specialises 0 and 1)


def padding(p: torch.Tensor, tstate: Mapping, n: int) -> tuple[list, list]:
    """`n` scratch stand-ins for the flat param `p` (with its grad) and its state `tstate`, of `PAD_NUMEL` elements
    each (an entry that is not param-shaped is cloned): they fill a short last run up to the length of the others, so
    that it calls their graph instead of compiling one more. What the chain computes on them is dropped."""
    scratch = lambda v: v.new_zeros(PAD_NUMEL) if v.shape == p.shape else v.clone()
    params, tstates = [], []
    for _ in range(n):
        q = scratch(p)
        q.grad = scratch(p.grad)
        params.append(q)
        tstates.append({k: scratch(v) for k, v in tstate.items()})
    return params, tstates


def can_flatten(b: Bucket) -> bool:
    """Whether `b`'s chain may step flat aliases of its params: it is elementwise (declared), and every param, grad and
    param-shaped state tensor is contiguous, so that a flat alias is all of its memory."""
    if chain_scope(b.cbs) != 'element': return False
    return all(p.is_contiguous() and p.grad.is_contiguous()
               and all(v.is_contiguous() for v in st.values() if isinstance(v, torch.Tensor) and v.shape == p.shape)
               for p, st in zip(b.params, b.states))


def flat_alias(t: torch.Tensor) -> torch.Tensor:
    """`t`'s memory as a 1-D tensor. Not a view (`.view(-1)` is one): dynamo would guard on the shape of its base, and
    compile a graph per rank again."""
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), (t.numel(),))


def _same_memory(alias: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether `alias`, a flat alias kept from an earlier step, is still all of `t`'s memory. It holds its memory
    alive, so no other allocation can start at its address: the same address, size and dtype is the same memory."""
    return (alias.data_ptr() == t.data_ptr() and alias.numel() == t.numel() and alias.dtype == t.dtype
            and alias.device == t.device)


PACK_NUMEL = 1 << 14  # params of at most this many elements step packed together (`Pack`)


class Pack:
    """Small params of a bucket stepped as one flat param: their params and param-shaped state copied into buffers
    of their total size (kept between steps while the same params are packed), their grads into one tensor, and the
    results copied back after the compiled call. A compiled call costs dynamo, AOT and inductor about 0.3 ms of
    Python whatever its params' sizes, and a model's biases and norms are most of its tensors (98 of GPT-2's 148):
    packed, they fill one place of a run instead of 98, for about as many bytes copied as they hold. Elementwise, so
    each element's numbers are those of the param stepped alone."""
    def __init__(self, members: list[int], qs: list, tstates: list, shared: tuple = ()):
        self.members = members  # the bucket's indices of the packed params (`qs`: their flat aliases)
        self.sizes = [q.numel() for q in qs]
        self.shared = shared  # 0-d entries, one value for every member (`_one_value`): the pack's own 0-d entry
        self.keys = tuple(k for k in tstates[0] if k not in shared)
        self.param = qs[0].new_empty(sum(self.sizes))
        self.state = {k: tstates[0][k].new_empty(len(self.param)) for k in self.keys}
        self.views = {k: buf.split(self.sizes) for k, buf in (('param', self.param), *self.state.items())}

    def fits(self, members: list[int], qs: list, tstates: list, shared: tuple = ()) -> bool:
        "Whether this pack's buffers serve these small params (the same sizes, state keys and dtypes)."
        return (members == self.members and [q.numel() for q in qs] == self.sizes and shared == self.shared
                and tuple(k for k in tstates[0] if k not in shared) == self.keys
                and all(ts[k].dtype == v.dtype for ts in tstates for k, v in self.state.items()))

    def gather(self, qs: list, tstates: list, grads: list) -> tuple[torch.Tensor, dict]:
        "The packed param (its grad the packed grads) and state, filled from the params' flat aliases `qs`."
        self.qs, self.tstates = qs, tstates  # (where `scatter` writes back)
        torch.cat(qs, out=self.param)
        for k, buf in self.state.items(): torch.cat([ts[k] for ts in tstates], out=buf)
        self.param.grad = torch._utils._flatten_dense_tensors(grads)
        self.values = {k: tstates[0][k].clone() for k in self.shared}
        return self.param, {**self.state, **self.values}

    def scatter(self, b: Bucket, new_t: Mapping) -> None:
        """The results back into each param and its state; an entry the chain rebound (`new_t`) gives each param its
        own part of it (a copy: no param's state holds another's memory alive), a shared 0-d entry its value (an
        element each of one new buffer)."""
        torch._foreach_copy_(self.qs, self.views['param'])
        for k in self.keys:
            if k not in new_t: torch._foreach_copy_([ts[k] for ts in self.tstates], self.views[k])
        for k in self.shared:
            if k not in new_t: torch._foreach_copy_([ts[k] for ts in self.tstates], [self.values[k]] * len(self.members))
        for k, v in new_t.items():  # (a shared 0-d entry the chain made param-shaped is split as any other)
            if v.shape == self.param.shape:
                for i, part in zip(self.members, v.split(self.sizes)): b.states[i][k] = part.view(b.params[i].shape).clone()
            else:  # a 0-d value each, in one allocation (98 clones cost 3 times as much)
                for i, part in zip(self.members, v.expand(len(self.members)).clone().unbind()): b.states[i][k] = part


def _one_value(ts: list) -> bool:
    """Whether the 0-d tensors `ts` hold one value, bit for bit: then one param stepped with it computes what each
    would alone. Read on CPU only (elsewhere the read would wait for the device)."""
    if ts[0].device.type != 'cpu' or any(t.dtype != ts[0].dtype for t in ts): return False
    bits = torch.stack(ts).view(torch.uint8).view(len(ts), -1)
    return bool((bits == bits[0]).all())


def _shared_keys(b: Bucket, small: list[int]) -> tuple | None:
    """The 0-d state entries of the small params `small` (NAdam's `mu_product`, schedule-free's `weight_sum`), if they
    can step packed: the same keys for each, each one value (`_one_value`); None if they cannot."""
    per = [tuple(k for k, v in b.states[i].items() if isinstance(v, torch.Tensor) and v.shape != b.params[i].shape)
           for i in small]
    if any(keys != per[0] for keys in per): return None
    ok = all(b.states[i][k].ndim == 0 for i in small for k in per[0])
    return per[0] if ok and all(_one_value([b.states[i][k] for i in small]) for k in per[0]) else None


def _kept_alias(old: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor:
    return old if old is not None and _same_memory(old, t) else flat_alias(t)


class FlatInputs:
    """`b`'s params as the compiled elementwise chain steps them (`flat_inputs`), made for a layout of memory:
    `params`, the flat params (flat aliases, new tensors that do not require grad whatever the params do, whose
    `.grad` is a flat alias of the grad, given at each step by `for_step`), `states`, their tensor state
    (param-shaped entries as flat aliases), `members`, the bucket indices each stands for, and `pack`, the `Pack` of
    the small params, if any (first). Kept in the bucket's plan (`Bucket.known`) while it holds, and used again while
    the params and their param-shaped state keep their memory (`current`: one list of addresses, where checking each
    kept alias cost about 3 ms a step on GPT-2's 148 params, 5 with NAdam's state)."""
    def __init__(self, b: Bucket, qs: list, tstates: list, pack: Pack | None):
        self.qs, self.tstates, self.pack = qs, tstates, pack
        packed = set(pack.members) if pack else set()
        self.rest = [i for i in range(len(qs)) if i not in packed]
        first = [(pack.param, None, pack.members)] if pack else []  # (the pack's state: `for_step`; its own members
        self.params = [q for q, _, _ in first] + [qs[i] for i in self.rest]  # list: `_compiled_runs` knows it by it)
        self.states = [s for _, s, _ in first] + [tstates[i] for i in self.rest]
        self.members = [m for _, _, m in first] + [[i] for i in self.rest]
        entries = [(st, k, ts, v.shape == p.shape) for p, st, ts in zip(b.params, b.states, tstates)
                   for k, v in st.items() if isinstance(v, torch.Tensor)]
        self.aliased = [st for st, _, _, flat in entries if flat], [k for _, k, _, flat in entries if flat]
        self.as_they_are = [(ts, st, k) for st, k, ts, flat in entries if not flat]  # (0-d entries: read at each step)
        self.addresses = self._addresses(b)
        self.scratch = None  # a short last run's padding (`padding`), made once

    def _addresses(self, b: Bucket) -> list[int]:
        "Where the params and their param-shaped state entries are now (under the plan: of the same metadata)."
        ptr = torch.Tensor.data_ptr
        return [*map(ptr, b.params), *map(ptr, map(dict.__getitem__, *self.aliased))]

    def current(self, b: Bucket) -> bool:
        """Whether the aliases are still all of the memory of `b`'s params and param-shaped state, with the plan
        holding (the same params, state dicts, keys, shapes, strides and dtypes): the same addresses. An alias holds
        its memory alive, so no other allocation can start at its address."""
        return self._addresses(b) == self.addresses

    def for_step(self, b: Bucket, fresh: bool = False) -> FlatInputs | None:
        """These inputs, with this step's grads and the state entries passed as they are (0-d) read again, the small
        params gathered into the pack; None if the pack's shared 0-d entries no longer hold one value each (the user
        changed one: `_one_value`), checked unless `fresh` (just checked)."""
        for ts, st, k in self.as_they_are: ts[k] = st[k]
        pack = self.pack
        if pack is not None:
            if not fresh and not all(_one_value([b.states[i][k] for i in pack.members]) for k in pack.shared): return None
            self.params[0], self.states[0] = pack.gather([self.qs[i] for i in pack.members],
                                                         [self.tstates[i] for i in pack.members],
                                                         [b.params[i].grad for i in pack.members])
        for i in self.rest: self.qs[i].grad = flat_alias(b.params[i].grad)
        return self

    def padding(self, n: int) -> tuple[list, list]:
        "`padding` for the last flat param, made once (what the chain computes on it is dropped)."
        if self.scratch is None or len(self.scratch[0]) != n: self.scratch = padding(self.params[-1], self.states[-1], n)
        return self.scratch


def flat_inputs(b: Bucket, kept: dict) -> FlatInputs | None:
    """`b`'s params as the compiled elementwise chain steps them, None if it cannot (`can_flatten`): the `FlatInputs`
    its plan kept (`Bucket.known`) if `current` (the plan holding, the layout `can_flatten` read holds), else made
    again. Making the aliases cost more than the compiled calls'
    own work on small params (about 6 us each, every step), so those of the params and their state are also kept in
    `kept` (id(param) -> (alias, state)) between steps and made again only for a tensor that is not the one aliased
    any more (`_same_memory`: after `p.data = ...`, a loaded state, an entry a callback rebound): a replaced tensor's
    memory is held until the next step of its bucket. Grads get fresh aliases every step, dropped after it
    (`release_grads`): zero_grad frees them, and a kept alias would keep them alive."""
    known = b.known  # (None for a bucket made for one step)
    kept_inputs = None if known is None else known.get('flat_inputs')
    if kept_inputs is not None and kept_inputs.current(b) and (inputs := kept_inputs.for_step(b)) is not None:
        return inputs
    if not can_flatten(b): return None
    qs, tstates, now = [], [], {}
    for p, st in zip(b.params, b.states):
        q, old = kept.get(id(p), (None, {}))
        q = _kept_alias(q, p)
        ts = {k: _kept_alias(old.get(k), v) if v.shape == p.shape else v
              for k, v in st.items() if isinstance(v, torch.Tensor)}
        qs.append(q)
        tstates.append(ts)
        now[id(p)] = (q, ts)
    # small params whose tensor state is param-shaped or 0-d with one value for all (`_shared_keys`), of one dtype a key
    small = [i for i, p in enumerate(b.params) if p.numel() <= PACK_NUMEL]
    dtypes = {k: v.dtype for k, v in tstates[small[0]].items()} if small else {}
    if any(tstates[i][k].dtype != d for i in small for k, d in dtypes.items()): small = []
    shared = _shared_keys(b, small) if len(small) > 1 else ()
    if shared is None: small = []
    pack = kept.get('pack')
    if len(small) > 1:
        sq, sts = [qs[i] for i in small], [tstates[i] for i in small]
        if pack is None or not pack.fits(small, sq, sts, shared): pack = Pack(small, sq, sts, shared)
        now['pack'] = pack
    else: pack = None
    kept.clear()  # (only this step's params: one that left the bucket is not held)
    kept.update(now)
    inputs = FlatInputs(b, qs, tstates, pack)
    if known is not None: known['flat_inputs'] = inputs
    return inputs.for_step(b, fresh=True)


def release_grads(params: list) -> None:
    "Drop the grad aliases of kept flat params (`flat_inputs`): they would keep the grads alive until the next step."
    for q in params: q.grad = None


class CompileFailed(Exception):
    "The chain did not compile; `rest` is the part of the bucket that was not touched."
    def __init__(self, err: Exception, rest: Bucket): self.err, self.rest = err, rest


def compiled_bucket(opt, b: Bucket, hyper: Mapping) -> None:
    """Step `b` with the compiled chain: flat params in runs of `compile_chunk` (`flat_chunks`, the last one padded:
    one graph) where `flat_inputs` gives them, else in chunks of params of the same shape (`shape_chunks`).
    Compilation traces the chain before running anything, so a chain that cannot compile raises before its first
    chunk is touched."""
    on_shards = is_dtensor(b.params[0])  # (an elementwise chain: see `fused_bucket`; a shard's local tensors step by shape)
    pystate = {k: v for k, v in b.states[0].items() if not isinstance(v, torch.Tensor)}
    kept = runtime(opt).flat_aliases.setdefault(b.layout, {})
    flat = None if on_shards else flat_inputs(b, kept)
    try: _compiled_runs(opt, b, hyper, pystate, flat, on_shards)
    finally:
        if flat is not None: release_grads(flat.params)  # (the pack's param too)


def _compiled_runs(opt, b: Bucket, hyper: Mapping, pystate: dict, flat: FlatInputs | None, on_shards: bool) -> None:
    options = opt.backend_options
    run = options.compile_chunk  # flat: every run is padded to this length, so all call one graph
    if flat:
        params, tstates, members, pack = flat.params, flat.states, flat.members, flat.pack
        chunks = flat_chunks(len(params), run)
    else:
        members, pack = [[i] for i in range(len(b.params))], None
        chunks = shape_chunks([p.shape for p in b.params], run)
    hyper = dict(hyper)
    fn = compiled_chain(b.cbs, options.compiler, b, chunks[0], run) if flat else None  # (one graph for every run)
    with torch._dynamo.config.patch(force_parameter_static_shapes=False, assume_static_by_default=False), \
            torch.fx.experimental._config.patch(use_duck_shape=not flat):  # flat: every size its own symbol
        for j, idx in enumerate(chunks):
            if flat:
                ps, ts = [params[i] for i in idx], [tstates[i] for i in idx]
                if len(idx) < run:
                    pad_params, pad_states = flat.padding(run - len(idx))
                    ps, ts = ps + pad_params, ts + pad_states
            else:
                ts = [{k: local(v) for k, v in b.states[i].items() if isinstance(v, torch.Tensor)} for i in idx]
                ps = [local_param(b.params[i]) if on_shards else b.params[i] for i in idx]
                fn = compiled_chain(b.cbs, options.compiler, b, idx)
            try: new_t, new_py = fn(ps, ts, pystate, hyper)
            except Exception as e:  # nothing of this chunk ran: the rest of the bucket is handed back untouched
                rest = [i for c in chunks[j:] for s in c for i in members[s]]
                raise CompileFailed(e, Bucket(b.group, [b.params[i] for i in rest], [b.states[i] for i in rest])) from e
            for s, nt in zip(idx, new_t):
                if pack is not None and members[s] is pack.members: pack.scatter(b, nt)
                elif nt:  # a new flat entry gets its param's shape back; a rebound entry of a shard becomes a DTensor
                    i = members[s][0]  # again, as the entry was
                    p, st = b.params[i], b.states[i]
                    st.update({k: v.view(p.shape) if flat and v.shape == (p.numel(),) else as_like(v, st.get(k, p))
                               for k, v in nt.items()})
            if new_py:
                for s in idx:
                    for i in members[s]: b.states[i].update(new_py)


def fused_bucket(opt, b: Bucket, hyper: Mapping) -> None:
    """One pass over `b` with the compiled chain, once a first eager (foreach) step of this layout has created the
    state; foreach (warning once) if the chain does not compile."""
    rt, layout = runtime(opt), b.layout
    if is_dtensor(b.params[0]) and chain_scope(b.cbs) != 'element':
        return foreach_bucket(opt, b, hyper)  # (not compiled: see the module docstring)
    if layout in rt.no_compile or layout not in rt.seen:
        ran_bucketwise = foreach_bucket(opt, b, hyper)
        rt.seen.add(layout)
        if ran_bucketwise: rt.seen.add(b.layout)  # the layout after the step is state-complete: compile it next time
        else: rt.no_compile.add(layout)  # a chain that cannot run bucket-wise cannot compile either
        return
    try: compiled_bucket(opt, b, hyper)
    except CompileFailed as e:
        rt.no_compile.add(layout)
        warn_once(opt, ('compile', layout), f"the callback chain could not be compiled ({type(e.err).__name__}: "
                  f"{e.err}); running it with the foreach backend")
        foreach_bucket(opt, e.rest, hyper)
