"""The generic `Optimizer`: runs a list of step callbacks over (param, state, hypers), as fastai does,
while being a real `torch.optim.Optimizer` (schedulers, GradScaler, hooks, closures) with named state."""
from __future__ import annotations

import contextlib
import contextvars
import difflib
import functools
import inspect
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from fastcore.foundation import L

from . import engine
from ._torch import GradReader, in_dcp_init_step
from .core.chain import (around_params, cb_name, chain_defaults, chain_group_hypers, chain_reads, check_chain,
                         flat_model_keys, param_chain)
from .engine import Backend, as_backend
from .engine.own_step import OwnStep
from .core.hypers import (ALIASES, NOT_HYPERS, TORCH_HYPER_NAMES, Hypers, ParamGroup, check_hyper, expand_hyper,
                          from_torch_names, is_known_hyper, is_model_entry, model_entries)
from .core.params import check_params, distinct_names, is_group_dict, named_groups
from .core.flags import FLAGS, split_flags
from .core.initial import initial_state
from .core.names import canonical_names
from .core.runtime import param_states
from .core.spec import spec
from .state import named_state_dict, prepare_load, torch_class_state_dict, torch_state_dict
from .state.lowbit import MIN_QUANTIZE_SIZE, SETTINGS, check_settings, group_settings
from .state.lowbit import pack as lowbit_pack, param_plan as lowbit_plan, unpack as lowbit_unpack

__all__ = ['Optimizer', 'rechain', 'on_create', 'takes_state_precision']

# A neutral hook for integrations (`cbopt.integrations.fastai`): the core never learns who its caller is.
on_create: list[Callable[[Optimizer], None]] = []  # called with each new optimizer (may name its params)


def _as_chain(cbs: Callable | Iterable[Callable]) -> list:
    "A chain as a list of callbacks (one callable is a chain of one), checked (`cbopt.chain.check_chain`)."
    cbs = list(L(cbs))
    check_chain(cbs)
    return cbs


# fastai's hyper names: a fastai Learner sets `lr`, `wd` and (its schedules) `mom` on every optimizer, and `sqr_mom`
# and `eps` are every Adam-like's. An optimizer accepts them even where its chain does not read them.
STANDARD_HYPERS = ('lr', 'mom', 'sqr_mom', 'wd', 'eps')


def _check_read(names: Iterable[str], chains: Iterable, where: str, carry: bool = False) -> None:
    """Refuse hypers that no callback reads (and are not fastai's standard ones): they would be silently ignored.
    `carry` (a group dict's keys): a key no callback reads is a framework's own entry (timm's `lr_scale`, `use_fallback`),
    kept in the group, saved and loaded untouched as torch keeps it, unless it looks like a hyper: a name cbopt or
    torch.optim knows as one (`amsgrad`: it would change the math elsewhere, not here), or one within a letter or two
    of a name the chain reads (`wdd`, `weight_decy`: a misspelling; difflib's similarity of at least 0.8). The optimizer's own keywords are always checked."""
    reads = set(STANDARD_HYPERS).union(*(chain_reads(c) for c in chains))
    for k in names:
        if k in reads or k in NOT_HYPERS or k in ALIASES or is_model_entry(k): continue
        torch_names = {t for t, c in TORCH_HYPER_NAMES.items() if reads.issuperset(c if isinstance(c, tuple) else (c,))}
        close = difflib.get_close_matches(k, sorted(reads | torch_names), n=2)
        # (a misspelling is one or two letters off: `wdd`, `sqr_mon`, `weight_decy`; timm's `lr_scale` is not
        # Adagrad's `lr_decay`, at a similarity of 0.62)
        if carry and not difflib.get_close_matches(k, close, n=1, cutoff=0.8) and not is_known_hyper(k): continue
        hint = f"did you mean {' or '.join(map(repr, close))}?" if close else f"the callbacks read {sorted(reads)}"
        raise TypeError(f"hyper {k!r}{where} is read by no callback of this optimizer, so it would be ignored; {hint}")


def _zero(lr) -> bool:
    """Whether `lr` is 0, as DCP's init step sets it (0.0, or `torch.tensor(0.)` for a tensor lr: on the CPU). A tensor
    lr on a GPU is never that, and is not read (a read would wait for the GPU at every step)."""
    if isinstance(lr, torch.Tensor) and not lr.is_cpu: return False
    return lr == 0


def _run_hooks(hooks: Mapping, opt: Optimizer, *value):
    "Run one of torch's hook dicts (`_optimizer_*_hooks`) as torch does: a hook returning a value replaces `value`."
    for hook in hooks.values():
        out = hook(opt, *value)
        if value and out is not None: value = (out,)
    return value[0] if value else None


class Optimizer(torch.optim.Optimizer):
    """An optimizer made of step callbacks `cbs`; `defaults` (merged over the callbacks' own) are the hypers.
    A param group may carry its own chain under `cbs` (`[{'params': matrices, 'cbs': muon_cbs}, {'params': rest}]`);
    its hyper defaults then come from its own chain. `backend` is a name in `cbopt.BACKENDS` or a `cbopt.Backend`.

    ```python
    import torch, cbopt
    model = torch.nn.Linear(4, 2)
    opt = cbopt.Optimizer(model.named_parameters(), [cbopt.weight_decay, cbopt.average_grad, cbopt.momentum_step],
                          lr=0.1, mom=0.9, wd=1e-4)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    assert sorted(opt.named_state_dict()['state']) == ['bias', 'weight']
    ```
    """
    _keep_on_clear = FLAGS
    state_dict_format: str = 'cbopt'  # what `state_dict()` writes: cbopt.optim's classes write their torch class's
    torch_class: type | None = None   # the torch.optim class this optimizer is the twin of, if any (cbopt.optim's)

    def __init__(self, params: Any, cbs: Callable | Iterable[Callable], backend: str | Backend = 'auto',
                 state_precision: str = 'fp32', min_quantize_size: int = MIN_QUANTIZE_SIZE, **defaults):
        self.backend_options = as_backend(backend)  # how `step` runs the chains: see cbopt.engine
        if (given := _PREBUILT_LOWBIT.get()) is not None and (state_precision, min_quantize_size) == ('fp32', MIN_QUANTIZE_SIZE):
            state_precision, min_quantize_size = given  # (a prebuilt's `state_precision=`: `takes_state_precision`)
        check_settings(state_precision, min_quantize_size)
        # low-bit state (cbopt.state.lowbit): the group entries exist where some group asks for it, so an fp32
        # optimizer's groups and checkpoints are as they were
        lowbit = {'state_precision': state_precision, 'min_quantize_size': min_quantize_size}
        if 'train_bn' in defaults:
            defaults.pop('train_bn')
            warnings.warn('Setting `train_bn` in `Optimizer` has no effect. Set `train_bn` on `Learner` init instead')
        self.cbs = L(_as_chain(cbs))
        dicts = isinstance(params, (list, tuple)) and params and all(is_group_dict(o) for o in params)
        groups = named_groups(params)
        # torch's group dicts with no params are allowed, as torch allows them: ZeroRedundancyOptimizer gives a rank
        # that owns nothing one; other forms with no params are a slip (a spent generator, empty lists)
        if not dicts and not any(g['params'] for g in groups): raise ValueError("optimizer got an empty parameter list")
        distinct_names(groups)  # (names given in several groups: `<group>/<name>`, see cbopt.core.params)
        check_params(groups)
        for alias, canon in ALIASES.items():
            if alias in defaults and canon in defaults and defaults[alias] != defaults[canon]:
                raise ValueError(f"{alias}={defaults[alias]!r} and {canon}={defaults[canon]!r} name one hyper")
        defaults = {ALIASES.get(k, k): v for k, v in from_torch_names(defaults).items()}
        groups = [self._with_chain(g) for g in groups]
        if state_precision != 'fp32' or any(k in g for g in groups for k in SETTINGS):
            for i, g in enumerate(groups):
                for k, v in lowbit.items(): g.setdefault(k, v)
                check_settings(g['state_precision'], g['min_quantize_size'], f' (group {i})', g['params'])
            defaults.update(lowbit)  # (torch's `defaults`: `add_param_group` fills new groups from it)
        _check_read(defaults, [self.cbs, *(g['cbs'] for g in groups)], '')
        for i, g in enumerate(groups):  # a group dict's own hypers, against its own chain
            _check_read([k for k in g if k not in NOT_HYPERS], [g['cbs']], f' (group {i})', carry=True)
            for k, v in chain_defaults(g['cbs']).items():
                if k not in g: check_hyper(k, v, i)
        for k, v in defaults.items():  # group dicts win over defaults; slices and lists spread over the groups
            if k in SETTINGS: continue
            for g, v_ in zip(groups, expand_hyper(k, v, len(groups))): g.setdefault(k, v_)
        for g in groups:  # then each group's own chain's defaults
            for k, v in chain_defaults(g['cbs']).items(): g.setdefault(k, v)
        scalar_defaults = {**chain_defaults(self.cbs), **{k: v if k in SETTINGS else expand_hyper(k, v, len(groups))[-1]
                                                          for k, v in defaults.items()}}
        for alias, canon in ALIASES.items():  # e.g. OneCycleLR looks for 'momentum' in defaults
            if canon in scalar_defaults: scalar_defaults[alias] = scalar_defaults[canon]
        self.frozen_idx, self._given, self._building = 0, set(defaults), True
        self.group_layers: list[int] | None = None  # the user's group each param group came from, if a recipe split them
        self.step_stats: dict = {}  # what the last step used: see `engine.run_step` and the README
        super().__init__(groups, scalar_defaults)
        self.__dict__['_optimizer_grads'] = GradReader(self)  # (how a compiled step reads the grads: engine.traced)
        self._building = False
        engine.init_model_state(self)
        for hook in on_create: hook(self)

    def _with_chain(self, group: Mapping) -> ParamGroup:
        """`group` as a ParamGroup holding its chain (as `chain`, also read as `cbs`, the name group dicts give it by):
        its own, or the optimizer's `cbs` itself (so a callback appended to `opt.cbs` later, fastai-style, runs in every
        group without a chain of its own)."""
        g = ParamGroup(group)  # (a copy of a live group has `chain`, a group dict `cbs`: either is the chain here)
        own = g.get('cbs')
        g['cbs'] = self.cbs if own is None or own is self.cbs else L(_as_chain(own))
        return g

    @property
    def backend(self) -> str:
        "The backend's kind (`'auto'`, `'loop'`, `'foreach'`, `'fused'`); its settings are `backend_options`."
        return self.backend_options.kind

    @backend.setter
    def backend(self, backend: str | Backend) -> None: self.backend_options = as_backend(backend, self.backend_options)

    def group_backends(self) -> dict | None:
        """The groups that step with another runner than the optimizer's backend (`id(group)` -> its kind), read by
        the engine at each step; None (cbopt's optimizers): every group steps with `backend`. `cbopt.optim`'s classes
        answer with the groups whose own `foreach`/`fused` entries differ from the constructor's, as torch's do."""
        return None

    # -- params and groups ---------------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        "Add a group (any accepted params form under `params`); missing hypers come from `defaults`."
        if not isinstance(param_group, Mapping): raise TypeError(f"param_group must be a dict, not {type(param_group).__name__}")
        groups = named_groups([{**param_group}], start=sum(len(g['params']) for g in self.param_groups))
        names = [{'param_names': list(g['param_names'])} for g in self.param_groups] + groups
        distinct_names(names)  # (a name the groups have already: both keyed by their group; renamed once it joins)
        check_params(groups, known={n: p for g, mine in zip(names, self.param_groups)
                                    for n, p in zip(g['param_names'], mine['params'])})
        g = self._with_chain(groups[0])
        _check_complex(g, len(self.param_groups))
        if any(k in g for k in SETTINGS) or 'state_precision' in self.defaults:
            for k in SETTINGS: g.setdefault(k, self.defaults.get(k, {'state_precision': 'fp32'}.get(k, MIN_QUANTIZE_SIZE)))
            check_settings(g['state_precision'], g['min_quantize_size'], f' (group {len(self.param_groups)})', g['params'])
        if not self._building:  # (our own __init__ checked its groups before filling in the optimizer's hypers)
            _check_read([k for k in g if k not in NOT_HYPERS], [g['cbs']], f' (group {len(self.param_groups)})',
                        carry=True)
        fill = self.defaults
        if g['cbs'] is not self.cbs:  # its own chain: its defaults, and only the hypers the user gave the optimizer
            fill = {**chain_defaults(g['cbs']), **{k: v for k, v in self.defaults.items() if k in self._given}}
        for k, v in fill.items():
            if k not in ALIASES: g.setdefault(k, v)
        for k, src in chain_group_hypers(g['cbs']).items():  # (Composer's initial_lr: the group's lr as it joins)
            if g.get(k) is None and src in g: g[k] = g[src].clone() if isinstance(g[src], torch.Tensor) else g[src]
        if flat_model_keys(g['cbs']):  # a callback with flat state in another group too is refused, before it joins
            engine.model_plan([*self.param_groups, g])  # (only such a callback can make the groups conflict)
        for mine, renamed in zip(self.param_groups, names): mine['param_names'] = renamed['param_names']
        self.param_groups.append(g)
        if not self._building:
            if self.group_layers is not None:  # a layer group of its own
                self.group_layers.append(self._n_layers)
                self._n_layers += 1
            engine.init_model_state(self)

    @property
    def layers(self) -> list[int]:
        """The layer group (the user's group, as a splitter or group dicts gave it) of each param group: their own
        index, unless a recipe split the given groups (Muon: each into its matrices and the rest)."""
        return list(range(len(self.param_groups))) if self.group_layers is None else list(self.group_layers)

    @property
    def n_layers(self) -> int:
        "How many layer groups the user gave (`freeze_to` counts these)."
        return len(self.param_groups) if self.group_layers is None else self._n_layers

    def split_groups(self, layers: list[int], n_layers: int) -> None:
        """Record that param group `i` came from the user's group `layers[i]` of `n_layers` (a recipe that splits each
        given group, as Muon does), so that `freeze_to` counts the user's groups."""
        if len(layers) != len(self.param_groups) or any(not 0 <= l < n_layers for l in layers):
            raise ValueError(f"split_groups: {len(layers)} layer indices for {len(self.param_groups)} param groups, each "
                             f"in 0..{n_layers - 1}, got {layers}")
        self.group_layers, self._n_layers = list(layers), n_layers

    @property
    def params(self) -> list[torch.Tensor]: return [p for g in self.param_groups for p in g['params']]

    @property
    def param_names(self) -> list[str]: return [n for g in self.param_groups for n in g['param_names']]

    @property
    def param_lists(self) -> L:
        "The params of each group, as fastai names them."
        return L(L(g['params']) for g in self.param_groups)

    def named_params(self) -> dict[str, torch.Tensor]: return dict(zip(self.param_names, self.params))

    def name_params(self, model: torch.nn.Module) -> None:
        "Rename positionally named params by their FQNs in `model`, so state_dicts are keyed like `model.state_dict()`."
        fqn = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        if not all(id(p) in fqn for p in self.params): return
        names = canonical_names([fqn[id(p)] for p in self.params])
        for g in self.param_groups: g['param_names'], names = names[:len(g['params'])], names[len(g['params']):]

    def all_params(self, n: slice | int = slice(None), with_grad: bool = False) -> L:
        "(param, group, state, hypers) tuples for the groups `n`, optionally only those with a grad (as fastai's)."
        groups = self.param_groups[n] if isinstance(n, slice) else [self.param_groups[n]]
        res = L((p, g, param_states(self)[p], Hypers(g)) for g in groups for p in g['params'])
        return res.filter(lambda o: o[0].grad is not None) if with_grad else res

    # -- hypers --------------------------------------------------------------------------------------------------
    @property
    def hypers(self) -> L:
        "One live dict of hypers per group (fastai's view of `param_groups`): writes go to the groups."
        return L(Hypers(g) for g in self.param_groups)

    def set_hyper(self, k: str, v: Any) -> None:
        "Set hyper `k` in every group from a scalar, a list/tuple/array (one per group) or a slice (spread across)."
        for g, v_ in zip(self.param_groups, expand_hyper(k, v, len(self.param_groups))): g[k] = v_

    def set_hypers(self, **kwargs) -> None:
        "Set several hypers, all or none (every value is checked before any is written)."
        values = {k: expand_hyper(k, v, len(self.param_groups)) for k, v in kwargs.items()}
        for k, vs in values.items():
            for g, v in zip(self.param_groups, vs): g[k] = v

    # -- freezing ------------------------------------------------------------------------------------------------
    def freeze_to(self, n: int) -> None:
        """Train only the layer groups from `n` on; earlier ones keep training only params flagged `force_train`. `n`
        counts the user's groups (`n_layers`): a recipe that splits each given group (Muon) freezes both halves."""
        if isinstance(n, bool) or not isinstance(n, int): raise TypeError(f"freeze_to takes a group index (an int), got {n!r}")
        total = self.n_layers
        self.frozen_idx = n if n >= 0 else total + n
        if self.frozen_idx >= total:
            warnings.warn(f"Freezing {self.frozen_idx} groups; model has {total}; whole model is frozen.")
        for layer, g in zip(self.layers, self.param_groups):
            for p in g['params']:
                p.requires_grad_(layer >= self.frozen_idx or param_states(self)[p].get('force_train', False))

    def freeze(self) -> None:
        if self.n_layers < 2: raise ValueError("freeze() needs at least two param groups (use a splitter)")
        self.freeze_to(-1)

    def unfreeze(self) -> None: self.freeze_to(0)

    # -- state ---------------------------------------------------------------------------------------------------
    def clear_state(self) -> None:
        """Forget all algorithm state, keeping the per-param flags (`do_wd`, `force_train`); whole-model callbacks'
        state (in the group entries) restarts from its declared values."""
        for p in self.params:
            if p in (states := param_states(self)): states[p] = {k: v for k, v in states[p].items() if k in self._keep_on_clear}
        for g in self.param_groups:
            for k in [k for k in g if is_model_entry(k)]: del g[k]
        engine.forget_state(self)
        engine.init_model_state(self)

    def init_state(self) -> None:
        """Create the state of every param that has none, as it is before a first step (so training on is exactly as
        without this call), from the callbacks' declarations; an entry that a param's first step creates
        (`chain.at_first_step`: torch SGD's momentum buffer with dampening, a copy of the first grad) as its template,
        zeros, and a chain with an undeclared (fastai-style) callback as a first step with a zero grad leaves it,
        computed on a copy: the entries to load a checkpoint into, but not the values before a first step (training on
        counts such a buffer as started, as torch's SGD does after DCP's init step). No param changes."""
        for g in self.param_groups:
            for p in g['params']:
                if not split_flags(param_states(self).get(p, {}))[0]:
                    param_states(self)[p].update(initial_state(self, p, g, template=True))
                    lowbit_pack(param_states(self)[p], p, lowbit_plan(g, p), stochastic=False)  # (low-bit: as stored)
        engine.init_model_state(self)

    def set_state_precision(self, state_precision: str, min_quantize_size: int = MIN_QUANTIZE_SIZE) -> None:
        """Store the state of every group as `state_precision` says from now on (`PRECISIONS`; see
        `cbopt.state.lowbit`): the state kept so far is converted at once (dequantized, then stored anew), so a run can
        switch formats between steps. What the prebuilt optimizers' `state_precision=` calls."""
        check_settings(state_precision, min_quantize_size, params=self.params)
        states = param_states(self)
        for g in self.param_groups:
            old = [lowbit_plan(g, p) for p in g['params']]
            for p, plan in zip(g['params'], old):
                if p in states: lowbit_unpack(states[p], p, plan)
            g['state_precision'], g['min_quantize_size'] = state_precision, min_quantize_size
            for p in g['params']:
                if p in states: lowbit_pack(states[p], p, lowbit_plan(g, p), stochastic=False)
        self.defaults.update(state_precision=state_precision, min_quantize_size=min_quantize_size)
        engine.forget_state(self)

    # -- modes (schedule-free: train at one point, evaluate at another) ------------------------------------------
    @torch.no_grad()
    def train(self, mode: bool = True) -> Optimizer:
        """Put the params where the chains train (schedule-free's `y`); `mode=False` (`eval()`): where they are
        evaluated (its average `x`). In each group whose chain has a `train_mode` hyper and whose mode changes, the
        callbacks' `on_train` (`on_eval`) run on every param with state. A chain without modes has one point: nothing
        changes. A group in eval mode refuses to step. Returns the optimizer, as `nn.Module.train` does."""
        hook = 'on_train' if mode else 'on_eval'
        for g in self.param_groups:
            if g.get('train_mode', mode) == mode: continue
            fns = [f for cb in param_chain(g['cbs']) if (f := getattr(spec(cb), hook)) is not None]
            hyper = Hypers(g).snapshot()
            for p in g['params']:
                state = split_flags(param_states(self).get(p, {}))[0]
                if state:
                    for f in fns: f(p, **{**state, **hyper})
            g['train_mode'] = mode
        return self

    def eval(self) -> Optimizer:
        "`train(False)`: the params where they are evaluated (schedule-free's average); call `train()` before stepping."
        return self.train(False)

    # -- stepping ------------------------------------------------------------------------------------------------
    # what `step` runs after the closure: the engine; cbopt.optim's `differentiable=True` sets the recorded step
    # (`cbopt.functional.differentiable_step`) on its instance, so no other step pays for a check
    _run_step = staticmethod(engine.run_step)

    def _check_groups(self) -> None:
        """Refuse groups whose params were replaced by another number of tensors (`group['params'] = [flat]`, as
        DeepSpeed-style flattening does): their names, the checkpoint's keys, would name other params. Run by `step`,
        `state_dict` and `load_state_dict`; a one-for-one swap (accelerate's, XLA's) keeps the names and passes."""
        # (a plain read where it is one: dynamo, tracing a compiled step, handles torch.optim's `param_groups` as
        # lists of plain dicts, which cbopt's are not: see engine.traced.groups)
        groups = self.__dict__['param_groups'] if 'param_groups' in self.__dict__ else self.param_groups
        for i, g in enumerate(groups):
            if 'param_names' not in g:
                raise ValueError(f"param group {i}'s params were replaced by {len(g['params'])} other tensors "
                                 f"(group['params'] = ...): the names its params had would name other params in a "
                                 f"checkpoint. Swap params one for one, or build the optimizer over the new params "
                                 f"(e.g. cbopt.optim.AdamW([flat]) for a flattened buffer)")

    @OwnStep  # (a code object per optimizer: what dynamo compiles of one never makes another's recompile)
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """Run the callbacks on every param with a grad, with `self.backend`; `closure` re-evaluates the model and returns
        the loss: called once here, and again by whole-model callbacks that re-evaluate (`lbfgs`)."""
        self._check_groups()
        loss = None
        if closure is not None:
            with torch.enable_grad(): loss = closure()
        elif not torch.compiler.is_compiling() and self._is_init_step():  # (DCP's init step is never compiled)
            self.init_state()
            return None
        self._run_step(self, closure, loss)
        return loss

    def _is_init_step(self) -> bool:
        """Whether this step is torch DCP's way to create the state of an optimizer that has none (its
        `_init_optim_state`, also torchtitan's, before loading or saving: no state yet, every lr 0, every grad zero,
        called from there). Such a step only creates the state, as `init_state()` does: it does not count as a step (a
        checkpoint of a fresh optimizer then resumes as the fresh one would, where torch's AdamW counts it), it moves
        no param (Composer's decay at lr 0 would) and it runs in eval mode too (schedule-free's refuses to step there).
        A user's own step with lr 0 is a step."""
        if not all(_zero(g.get('lr', 0)) for g in self.param_groups): return False  # (first: cheap, and rarely true)
        if any(split_flags(s)[0] for s in param_states(self).values()): return False
        return in_dcp_init_step()

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """`torch.amp.GradScaler` asks this: when True it leaves the grads scaled and sets `opt.grad_scale` and
        `opt.found_inf` for the step, which then divides the grads by the scale inside torch's fused kernel (no pass of
        its own) and changes nothing when an inf was found, as torch's fused optimizers do. Claimed with backend
        `fused` (torch's `fused=True`) for a chain with such a kernel; the step unscales the grads no kernel takes.
        Not with `auto`, cbopt's default, which thus behaves as torch's default optimizers do: the scaler unscales and
        skips the step itself, so trainers that detect a skipped step by `step` not being called (accelerate's
        `step_was_skipped`, and so the HF Trainer's scheduler) see it, and Lightning's `gradient_clip_val` works under
        mixed precision (it refuses an optimizer that unscales inside its step, as it refuses torch's fused ones)."""
        return self.backend == 'fused' and any(engine.has_kernel(param_chain(g['cbs'])) for g in self.param_groups)

    @property
    def last_total_grad_norm(self) -> torch.Tensor | None:
        "The total grad norm before clipping at the last step (torchrec's name), if a `clip_grad_norm` ran."
        return self.step_stats.get('grad_norm')

    # -- state_dicts -----------------------------------------------------------------------------------------------
    def state_dict(self, format: str | type | None = None, dequantize: bool = False) -> dict:
        """torch's layout, so torch's tools (DCP, ZeroRedundancyOptimizer, ...) read it: `{'state': {id: {...}},
        'param_groups': [{hypers, 'chain': ..., 'param_names': [fqn, ...], 'params': [id, ...]}]}`, ids counting params
        in `param_groups` order; loadable with weights_only. `named_state_dict()` is the same keyed by names.
        `format`: `'cbopt'` (cbopt's state and hyper names), a torch.optim class (`torch.optim.AdamW`: what that class
        would save, with its names, so it loads there; see `cbopt.state.torch_class_state_dict`), or `'torch'` (the
        optimizer's own torch class: cbopt.optim's classes, whose default it is). Every format loads back here.
        Low-bit state (`state_precision`) is saved as stored (`'grad_avg.codes'`, `'grad_avg.absmax'`: see
        `cbopt.state.lowbit`); `dequantize=True` saves it as fp32 tensors, which an fp32 optimizer and, with
        `format=torch.optim.AdamW`, torch's class load."""
        fmt = self.state_dict_format if format is None else format
        if fmt == 'torch':
            if self.torch_class is None:
                raise ValueError("state_dict(format='torch'): this optimizer has no torch.optim class of its own; name "
                                 "one, e.g. format=torch.optim.AdamW")
            fmt = self.torch_class
        if fmt != 'cbopt' and not (isinstance(fmt, type) and issubclass(fmt, torch.optim.Optimizer)):
            raise ValueError(f"state_dict(format={fmt!r}): expected 'cbopt', 'torch' or a torch.optim class")
        self._check_groups()
        _run_hooks(self._optimizer_state_dict_pre_hooks, self)
        sd = torch_state_dict(self, dequantize) if fmt == 'cbopt' else torch_class_state_dict(self, fmt, dequantize)
        # entries of `self.state` that are no param's (a pre-hook's `opt.state['x'] = ...`) are saved as they are, as
        # torch saves them: its post-hooks and loaders see them
        sd['state'].update((k, v) for k, v in param_states(self).items() if not isinstance(k, torch.Tensor))
        return _run_hooks(self._optimizer_state_dict_post_hooks, self, sd)

    def named_state_dict(self, dequantize: bool = False) -> dict:
        """`{'state': {fqn: {...}}, 'param_groups': [{hypers, 'chain': ..., 'params': [fqn, ...]}]}` (torchrec's
        KeyedOptimizer layout): for people, diffs and saving with `dcp.save` directly. `load_state_dict` reads it."""
        return named_state_dict(self, dequantize)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a cbopt (either layout), torch.optim or fastai state_dict, matching params by name where both sides
        name them (another grouping or order loads), by position otherwise. Strict and atomic: any mismatch raises an
        error naming the param, and leaves this optimizer exactly as it was."""
        self.prepared_load(state_dict)()

    def prepared_load(self, state_dict: dict) -> Callable[[], None]:
        """Check `state_dict` as `load_state_dict` does and build what it loads, changing nothing; returns the commit
        that loads it (nothing in it can fail, the post-hooks aside). For loads that must be all or nothing across several optimizers (a ZeRO
        rank's part: `cbopt.integrations.zero`): check every part, then commit each."""
        self._check_groups()
        if isinstance(state_dict, dict): state_dict = state_dict.copy()  # shallow, as torch's: a hook may rebind its keys
        state_dict = _run_hooks(self._optimizer_load_state_dict_pre_hooks, self, state_dict)
        new_state, new_hypers = prepare_load(self, state_dict)
        def commit() -> None:
            states = param_states(self)
            for k in [k for k in states if not isinstance(k, torch.Tensor)]: del states[k]
            for k, v in new_state.items():  # the entries that are no param's: the checkpoint's, as torch loads them
                if not isinstance(k, torch.Tensor): states[k] = v
            for p in self.params: states[p] = {**new_state[p], **split_flags(states.get(p, {}))[1]}
            for g, h in zip(self.param_groups, new_hypers): g.update(h)
            engine.forget_state(self)
            _run_hooks(self._optimizer_load_state_dict_post_hooks, self)
        return commit

    # -- wrappers that are dynamic subclasses (Lightning's LightningOptimizer) ----------------------------------------
    def __setattr__(self, k: str, v: Any) -> None:
        """Writes to an attribute of the optimizer made through a wrapper that is a dynamic subclass of its class and
        holds it as `_optimizer` (Lightning's `LightningOptimizer`, what `self.optimizers()` returns; its reads
        already fall through to the optimizer) reach the optimizer: `self.optimizers().backend = 'loop'` and
        `.freeze_to(1)` (which writes `frozen_idx`) would otherwise land on the wrapper and change nothing. The
        wrapper's own attributes (those the optimizer does not have) stay the wrapper's."""
        real = self.__dict__.get('_optimizer')
        if (isinstance(real, Optimizer) and real is not self and not k.startswith('__')
                and (k in real.__dict__ or hasattr(type(real), k))):
            setattr(real, k, v)
            return
        super().__setattr__(k, v)

    # -- pickling (torch's __getstate__ keeps only defaults, state and param_groups) -------------------------------
    def __getstate__(self) -> dict:
        """Everything but the hooks, which torch does not pickle either (they are often lambdas), and the `step` an LR
        scheduler patches onto the instance (bound to this optimizer: a copy would step the original)."""
        return {k: v for k, v in self.__dict__.items() if not k.startswith('_optimizer_') and k != 'step'}

    def __setstate__(self, state: dict) -> None:
        "torch's, and a new grad reader for the compiled step (`GradReader`: pickles leave it out)."
        super().__setstate__(state)
        self.__dict__['_optimizer_grads'] = GradReader(self)

    def __repr__(self) -> str:
        cbs = ', '.join(cb_name(cb) for cb in self.cbs)
        return f"{type(self).__name__}([{cbs}], {len(self.param_groups)} groups, {len(self.params)} params)"


_COMPLEX_AT_STEP = contextvars.ContextVar('complex_at_step', default=False)


@contextlib.contextmanager
def complex_refused_at_step() -> Iterator[None]:
    """While building (or adding a group to) a `cbopt.optim` class, complex params that its chain does not support are
    taken: torch refuses them at the step (`refusing_complex`), and its drop-in does as torch's; cbopt's own classes
    refuse them when built (`_check_complex`), naming the param."""
    token = _COMPLEX_AT_STEP.set(True)
    try: yield
    finally: _COMPLEX_AT_STEP.reset(token)


def unsupported_complex(g: Mapping) -> Callable | None:
    "The callback of the group's chain that does not support complex params (`cb.supports_complex = False`), if any."
    return next((cb for cb in g['cbs'] if not spec(cb).supports_complex), None)


def _check_complex(g: Mapping, i: int) -> None:
    """Complex params step on their real views (`engine.buckets.as_real`), except in a chain with a callback declaring
    `cb.supports_complex = False` (Adafactor's factored moments, Muon's orthogonalisation: torch refuses them too)."""
    if _COMPLEX_AT_STEP.get(): return
    bad = unsupported_complex(g)
    if bad is None: return
    for name, p in zip(g['param_names'], g['params']):
        if p.is_complex():
            raise TypeError(f"param {name!r} (group {i}) is complex ({p.dtype}), which {cb_name(bad)!r} does not support "
                            f"(as torch's Adafactor and Muon do not): keep its real and imaginary parts as a real param "
                            f"of shape (..., 2) and use torch.view_as_complex(param) in the model")


def rechain(opt: Optimizer, transform: Callable[[list], list], **hypers) -> Optimizer:
    """A new Optimizer over `opt`'s params, names, groups, hypers, backend, state, whole-model state and freezing,
    whose chains are `transform(chain)`, with `hypers` set in every group: how wrappers (`Lookahead`, torchrec's
    clipping and warmup, `Accumulate`...) are built. `transform` sees the per-param callbacks only: the whole-model ones
    stay at the ends of the chain, so wrappers compose in any order (`cbopt.chain.around_params`). `opt`'s per-param
    state dicts are shared, not copied."""
    def new_chain(cbs) -> list: return around_params(cbs, transform)
    groups = [{'params': list(g['params']), 'param_names': list(g['param_names']), **opt.hypers[i], **hypers,  # names kept
               **group_settings(g),  # (low-bit state: stored as it was)
               'cbs': None if g['cbs'] is opt.cbs else new_chain(g['cbs'])} for i, g in enumerate(opt.param_groups)]
    res = Optimizer(groups, new_chain(opt.cbs), backend=opt.backend_options, **{**opt.defaults, **hypers})
    for g, mine in zip(opt.param_groups, res.param_groups): mine.update(model_entries(g))  # inner whole-model state
    for p in opt.params:
        if p in param_states(opt): param_states(res)[p] = param_states(opt)[p]
    res.frozen_idx = opt.frozen_idx
    if opt.group_layers is not None: res.split_groups(opt.group_layers, opt.n_layers)
    engine.init_model_state(res)
    return res


_PREBUILT_LOWBIT: contextvars.ContextVar = contextvars.ContextVar('cbopt_prebuilt_lowbit', default=None)


def takes_state_precision(factory: Callable) -> Callable:
    """A prebuilt optimizer's factory (or a `cbopt.optim` class's `__init__`) that also takes `state_precision=` and
    `min_quantize_size=` (keyword-only; see `Optimizer` and `cbopt.state.lowbit`), so every prebuilt offers low-bit
    state without repeating it in each signature. They are the defaults of the `Optimizer` the factory builds (read
    by its `__init__` while the factory runs), so a group dict's own `'state_precision'` or `'min_quantize_size'`
    overrides them there, as with `Optimizer(..., state_precision=)`."""
    sig = inspect.signature(factory)
    if 'state_precision' in sig.parameters: return factory
    @functools.wraps(factory)
    def with_state_precision(*args, state_precision: str = 'fp32', min_quantize_size: int = MIN_QUANTIZE_SIZE, **kwargs):
        check_settings(state_precision, min_quantize_size)
        given = (state_precision, min_quantize_size)
        if given == ('fp32', MIN_QUANTIZE_SIZE) and _PREBUILT_LOWBIT.get() is not None: return factory(*args, **kwargs)
        token = _PREBUILT_LOWBIT.set(given)  # (a prebuilt built by another, cbopt.optim's by fastai's: the outer's)
        try: return factory(*args, **kwargs)
        finally: _PREBUILT_LOWBIT.reset(token)
    params = list(sig.parameters.values())
    extra = [inspect.Parameter('state_precision', inspect.Parameter.KEYWORD_ONLY, default='fp32', annotation='str'),
             inspect.Parameter('min_quantize_size', inspect.Parameter.KEYWORD_ONLY, default=MIN_QUANTIZE_SIZE,
                               annotation='int')]
    at = next((i for i, q in enumerate(params) if q.kind == inspect.Parameter.VAR_KEYWORD), len(params))
    with_state_precision.__signature__ = sig.replace(parameters=params[:at] + extra + params[at:])
    return with_state_precision
