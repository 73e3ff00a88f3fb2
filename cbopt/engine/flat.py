"""Flat runs for compiled elementwise chains: params as flat 1-D aliases in runs of `compile_chunk` (`flat_chunks`,
the last padded with scratch params: one graph whatever the shapes), small params packed into one (`Pack`), the
aliases kept between steps (`flat_inputs`); other chains in chunks of one shape (`shape_chunks`)."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from .._torch import flatten_dense, foreach_op
from ..core.chain import chain_scope
from ..state.lowbit import stored_base, stored_part
from .buckets import Bucket, give_grad

__all__ = ['shape_chunks', 'flat_chunks', 'padding', 'can_flatten', 'flat_alias', 'Pack', 'FlatInputs', 'flat_inputs',
           'release_grads']


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
        give_grad(q, scratch(p.grad))
        params.append(q)
        tstates.append({k: scratch(v) if stored_part(k) is None else _first_block(k, v, tstate) for k, v in tstate.items()})
    return params, tstates


def _first_block(key: str, v: torch.Tensor, tstate: Mapping) -> torch.Tensor:
    """A copy of the first `PAD_NUMEL` blocks of a low-bit entry's stored part (`cbopt.state.lowbit`): codes (as
    many per block as the entry's has) or scales. A block holds at least `PAD_NUMEL` elements; `PAD_NUMEL` blocks keep
    the number of blocks symbolic too."""
    if stored_part(key) != 'codes': return v[:PAD_NUMEL].clone()
    base = stored_base(key)
    scale = next(t for k, t in tstate.items() if k != key and stored_base(k) == base and stored_part(k))
    return v[:PAD_NUMEL * (v.numel() // scale.numel())].clone()


def can_flatten(b: Bucket) -> bool:
    """Whether `b`'s chain may step flat aliases of its params: it is elementwise (declared), and every param, grad and
    param-shaped state tensor is contiguous, so that a flat alias is all of its memory."""
    if chain_scope(b.cbs) != 'element': return False
    return all(p.is_contiguous() and p.grad.is_contiguous()
               and all(v.is_contiguous() for v in st.values() if isinstance(v, torch.Tensor) and v.shape == p.shape)
               for p, st in zip(b.params, b.states))


def flat_alias(t: torch.Tensor, start: int = 0, n: int | None = None) -> torch.Tensor:
    """`t`'s memory as a 1-D tensor (`n` elements of it from `start`: all of it by default). Not a view (`.view(-1)`
    is one): dynamo would guard on the shape of its base, and compile a graph per rank again."""
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset() + start, (t.numel() - start if n is None else n,))


def _same_memory(alias: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether `alias`, a flat alias kept from an earlier step, is still all of `t`'s memory. It holds its memory
    alive, so no other allocation can start at its address: the same address, size and dtype is the same memory."""
    return (alias.data_ptr() == t.data_ptr() and alias.numel() == t.numel() and alias.dtype == t.dtype
            and alias.device == t.device)


PACK_NUMEL = 1 << 14  # params of at most this many elements step packed together (`Pack`)


class Pack:
    """Small params of a bucket stepped as one flat param: their params copied into a buffer of their total size
    (kept between steps while the same params are packed), their grads into one tensor, and the results copied back
    after the compiled call. Their param-shaped state lives in the pack's buffers: after the first packed step each
    member's entry is its part of the buffer (`adopt`), so a step copies no state in or out; an entry the user or a
    load replaces is copied in again and adopted, and a dropped pack gives each entry memory of its own (`release`). A
    compiled call costs dynamo, AOT and inductor about 0.3 ms of Python whatever its params' sizes, and a model's
    biases and norms are most of its tensors (98 of GPT-2's 148): packed, they fill one place of a run instead of 98,
    for about as many bytes copied as their params and grads hold. Elementwise, so each element's numbers are those of
    the param stepped alone."""
    def __init__(self, members: list[int], qs: list, tstates: list, shared: tuple = ()):
        self.members = members  # the bucket's indices of the packed params (`qs`: their flat aliases)
        self.sizes = [q.numel() for q in qs]
        self.shared = shared  # 0-d entries, one value for every member (`_one_value`): the pack's own 0-d entry
        self.keys = tuple(k for k in tstates[0] if k not in shared)
        self.param = qs[0].new_empty(sum(self.sizes))
        self.state = {k: tstates[0][k].new_empty(len(self.param)) for k in self.keys}
        self.views = {k: buf.split(self.sizes) for k, buf in (('param', self.param), *self.state.items())}
        self.stamp = None  # the shared 0-d entries as `scatter` left them (`written_since`)
        self.owned: set = set()  # keys whose members' entries are their parts of this pack's buffers (`adopt`)
        self.rebound: set = set()  # keys the chain rebinds (`scatter`): each member keeps a copy of its own
        self.adopted: list = []  # (state dict, key) of each entry `adopt` made a part of a buffer (`release`)

    def fits(self, members: list[int], qs: list, tstates: list, shared: tuple = ()) -> bool:
        "Whether this pack's buffers serve these small params (the same sizes, state keys and dtypes)."
        return (members == self.members and [q.numel() for q in qs] == self.sizes and shared == self.shared
                and tuple(k for k in tstates[0] if k not in shared) == self.keys
                and all(ts[k].dtype == v.dtype for ts in tstates for k, v in self.state.items()))

    def gather(self, qs: list, tstates: list, grads: list) -> tuple[torch.Tensor, dict]:
        "The packed param (its grad the packed grads) and state, filled from the params' flat aliases `qs`."
        self.qs, self.tstates = qs, tstates  # (where `scatter` writes back)
        torch.cat(qs, out=self.param)
        for k, buf in self.state.items():
            if k not in self.owned: torch.cat([ts[k] for ts in tstates], out=buf)  # (owned: the entries are `buf`)
        give_grad(self.param, flatten_dense(grads))
        self.values = {k: tstates[0][k].clone() for k in self.shared}
        return self.param, {**self.state, **self.values}

    def _stamp(self, b: Bucket) -> list:
        """Each member's shared 0-d entries: the tensor (held, so no other can take its id) and its version counter
        (any in-place write moves it)."""
        return [(t, t._version) for k in self.shared for t in (b.states[i][k] for i in self.members)]

    def written_since(self, b: Bucket) -> bool:
        """Whether a shared 0-d entry of a member is not the tensor `scatter` left, or was written since (the user, a
        load): only then can they hold different values, and only then are they read (`_one_value`, which on a GPU
        waits for it): a steady step reads no value."""
        now = self._stamp(b)
        return self.stamp is None or len(now) != len(self.stamp) or \
            not all(t is u and v == w for (t, v), (u, w) in zip(now, self.stamp))

    def scatter(self, b: Bucket, new_t: Mapping) -> None:
        """The results back into each param and its state; an entry the chain rebound (`new_t`) gives each param its
        own part of it (a copy: no param's state holds another's memory alive), a shared 0-d entry its value (an
        element each of one new buffer)."""
        foreach_op('copy_')(self.qs, self.views['param'])
        for k in self.keys:
            if k not in new_t and k not in self.owned: foreach_op('copy_')([ts[k] for ts in self.tstates], self.views[k])
        for k in self.shared:
            if k not in new_t: foreach_op('copy_')([ts[k] for ts in self.tstates], [self.values[k]] * len(self.members))
        for k, v in new_t.items():  # (a shared 0-d entry the chain made param-shaped is split as any other)
            if v.shape == self.param.shape:
                self.owned.discard(k)
                self.rebound.add(k)  # (never adopted again: the next step's entries are those copies)
                for i, part in zip(self.members, v.split(self.sizes)): b.states[i][k] = part.view(b.params[i].shape).clone()
            else:  # a 0-d value each, in one allocation (98 clones cost 3 times as much)
                for i, part in zip(self.members, v.expand(len(self.members)).clone().unbind()): b.states[i][k] = part
        if self.shared: self.stamp = self._stamp(b)  # (one value each, written by this pack)

    def claim(self, b: Bucket) -> None:
        """Before a step's flat aliases are made: the keys whose members' entries are all still their parts of this
        pack's buffers (`owned`: the same addresses; the buffers are alive, so no other memory can start there). A key
        only some of whose entries are (the others replaced: a load, the user) gives those memory of their own, as
        `gather` then copies every entry into the buffer."""
        self.owned = set()
        for k in self.keys:
            if k in self.rebound: continue
            mine = [b.states[i][k].data_ptr() == v.data_ptr() for i, v in zip(self.members, self.views[k])]
            if all(mine): self.owned.add(k)
            else:
                for i, m in zip(self.members, mine):
                    if m: b.states[i][k] = b.states[i][k].clone()

    def adopt(self, b: Bucket) -> bool:
        """After `gather` filled the buffers: each member's entry of a key not `owned` (nor `rebound`) becomes its part
        of the buffer (the same values; its flat alias too), so the step writes the state in place and no step copies
        it again. Returns whether any entry was adopted (the addresses `FlatInputs.current` checks changed)."""
        todo = [k for k in self.keys if k not in self.owned and k not in self.rebound]
        for k in todo:
            for i, ts, part in zip(self.members, self.tstates, self.views[k]):
                st = b.states[i]
                st[k] = part.view(b.params[i].shape)
                ts[k] = flat_alias(st[k])
                self.adopted.append((st, k))
            self.owned.add(k)
        return bool(todo)

    def release(self) -> None:
        """Give each entry still a part of this pack's buffers memory of its own (a copy), before the pack is dropped
        (other small params, another layout): no param's state then holds the other members' memory alive."""
        for st, k in self.adopted:
            v, buf = st.get(k), self.state.get(k)
            if isinstance(v, torch.Tensor) and buf is not None and \
                    v.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr():
                st[k] = v.clone()
        self.adopted, self.owned = [], set()


def _one_value(ts: list) -> bool:
    """Whether the 0-d tensors `ts` hold one value, bit for bit: then one param stepped with it computes what each
    would alone. On a GPU the read waits for it: it is made when a pack is made (once per layout) and where the
    entries were written since the pack's last step (`Pack.written_since`), never on a steady step."""
    if any(t.dtype != ts[0].dtype or t.device != ts[0].device for t in ts): return False
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
            if not fresh and pack.shared and pack.written_since(b) \
                    and not all(_one_value([b.states[i][k] for i in pack.members]) for k in pack.shared): return None
            self.params[0], self.states[0] = pack.gather([self.qs[i] for i in pack.members],
                                                         [self.tstates[i] for i in pack.members],
                                                         [b.params[i].grad for i in pack.members])
        for i in self.rest: give_grad(self.qs[i], flat_alias(b.params[i].grad))
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
    # small params whose tensor state is param-shaped or 0-d with one value for all (`_shared_keys`), of one dtype a key
    tensors = lambda st: {k: v for k, v in st.items() if isinstance(v, torch.Tensor)}
    small = [i for i, p in enumerate(b.params) if p.numel() <= PACK_NUMEL]
    dtypes = {k: v.dtype for k, v in tensors(b.states[small[0]]).items()} if small else {}
    if any(b.states[i][k].dtype != d for i in small for k, d in dtypes.items()): small = []
    shared = _shared_keys(b, small) if len(small) > 1 else ()
    if shared is None or len(small) < 2: small = []
    pack = kept.get('pack')
    if pack is not None and not (small and pack.fits(small, [b.params[i] for i in small],
                                                      [tensors(b.states[i]) for i in small], shared)):
        pack.release()  # (before the aliases are made: its entries' copies are what they alias)
        pack = None
    if pack is not None: pack.claim(b)
    qs, tstates, now = [], [], {}
    for p, st in zip(b.params, b.states):
        q, old = kept.get(id(p), (None, {}))
        q = _kept_alias(q, p)
        ts = {k: _kept_alias(old.get(k), v) if v.shape == p.shape else v
              for k, v in st.items() if isinstance(v, torch.Tensor)}
        qs.append(q)
        tstates.append(ts)
        now[id(p)] = (q, ts)
    if small:
        if pack is None: pack = Pack(small, [qs[i] for i in small], [tstates[i] for i in small], shared)
        now['pack'] = pack
    kept.clear()  # (only this step's params: one that left the bucket is not held)
    kept.update(now)
    inputs = FlatInputs(b, qs, tstates, pack)
    if known is not None: known['flat_inputs'] = inputs
    stepped = inputs.for_step(b, fresh=True)
    if stepped is not None and pack is not None and pack.adopt(b): inputs.addresses = inputs._addresses(b)
    return stepped


def release_grads(params: list) -> None:
    "Drop the grad aliases of kept flat params (`flat_inputs`): they would keep the grads alive until the next step."
    for q in params: q.grad = None
