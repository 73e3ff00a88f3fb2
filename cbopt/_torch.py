"""The one module that touches torch's private APIs: each is found here, lazily and by feature (`getattr`, a guarded
import), and where one is missing or renamed cbopt degrades to the fallback named below, with one warning per process,
never an import error or a crash in the middle of a step. `import cbopt` imports nothing here beyond `torch` itself:
`torch._dynamo` and `torch._inductor` (which would double the import time) load on cbopt's first compile, or when
the user's own `torch.compile` loads them.

Private APIs used (why; since which torch; the fallback). A version other than 2.13 is the release the API first
appeared in as torch's release notes give it, not re-checked against torch's git history here; "2.13" means at
least 2.13, the version tested. Every one is in 2.13 (`settings.ini`'s floor).

- `torch._foreach_<op>` (`foreach_op`): one kernel per op for a whole bucket, the `foreach` backend's ops
  (`TensorList`), grad scaling, grad norms, flat-run copies. Since 1.7 (most ops; `_foreach_lerp_`,
  `_foreach_pow`, `_foreach_copy_`, `_foreach_clone`: 2.13). Missing: the op runs once per tensor (what torch's own
  foreach "slow path" runs on CPU: the same values).
- `torch._fused_adamw_`, `_fused_adam_` (2.0; CPU from 2.4), `_fused_sgd_`, `_fused_adagrad_` (2.13)
  (`fused_kernel`): torch's fused optimizer kernels, for the chains registered with one (`engine/kernels.py`).
  Missing: the `fused` and `auto` backends step that chain compiled (or with foreach).
- The attribute `_dynamo_marked_constant` (`constant_result`; 2.0): what `torch.compiler.assume_constant_result`
  sets on a function (dynamo then calls it eagerly at trace time and keeps its answer), set here without importing
  `torch._dynamo`; where dynamo is loaded already, the public call. Used by the traced step's `prepare` and by the
  step's `_off_dynamo`, which marks the eager step with the public `torch.compiler.disable` once dynamo is loaded.
  Were the mark ignored, dynamo would trace into those functions: `_off_dynamo` still works, with one graph break
  more; `prepare` would not trace (the step under an outer `torch.compile` breaks its graph).
- `torch._dynamo.config` keys `force_parameter_static_shapes`, `assume_static_by_default`, and
  `torch.fx.experimental._config.use_duck_shape` (`chain_settings`; 2.13): the compiled chain's dynamic shapes
  (no recompile per param shape or flat-run size). Inductor's options `size_asserts` and
  `post_grad_custom_post_pass` (`inductor_options`; 2.13). An unknown key raises inside the compiled runner's
  fallback: that chain runs with foreach, with the runner's one-time warning. They are set around each compiled step
  with torch's `ConfigModule._make_closure_patcher` (`chain_settings`; 2.4): set and restored without a class made per
  use. Missing: the config's public `patch`, entered and exited (the same settings, more Python per step).
- `torch._inductor.custom_graph_pass.CustomGraphPass`, `get_hash_for_files`, and
  `torch._inductor.pattern_matcher.stable_topological_sort` (`inductor_pass_api`; 2.13): the `ScalarsOnce` graph
  pass (`engine/scalars.py`), which computes each per-step scalar once per graph. Missing: no `ScalarsOnce` (each
  param's scalars are computed in its own barrier: same values, more Python per call).
- `torch._ops.OpOverload`, `torch._ops.HigherOrderOperator` (`op_kinds`; 2.13): which graph nodes may write, for
  `ScalarsOnce` (found with the pass: missing, no pass).
- `torch._C._dynamo.guards.TensorGuards` (`metadata_guard`; 2.13): torch's C++ check of tensors' metadata, which
  makes a kept bucket plan cheap to check (`engine/buckets.py`). Missing: the plan is rebuilt at every step.
- `torch._utils._flatten_dense_tensors` (`flatten_dense`; before 1.0): the packed grads of small params. Missing:
  `torch.cat` of flat views (what it computes).
- `torch.utils._foreach_utils._group_tensors_by_device_and_dtype` (`device_dtype_groups`; 2.0): the order in which
  `clip_grad_norm_` stacks its per-(device, dtype) norms, so cbopt's sum is torch's bit for bit. Missing: the
  buckets' own order (the same norm, rounded in another order).
- `torch.utils._pytree.tree_leaves` (`tree_leaves`; 2.13): the tensors of a nested structure, for
  `cbopt.functional`. Missing: dicts, lists and tuples walked here.
- `torch.utils._pytree.tree_flatten_with_path`, `tree_unflatten` and its key entries `MappingKey`, `SequenceKey`,
  `GetAttrKey` (`tree_paths`; 2.2): the params of `cbopt.functional` as any pytree (nested dicts, lists, tuples,
  namedtuples), each leaf with its path (its FQN). Missing: dicts, lists, tuples and namedtuples walked here.
- `torch._C.TensorBase` (`data_getter`; 2.2, `torch._C._TensorBase` before): the `.data` getter, as a torch
  function mode sees it, for `cbopt.functional`.
- `torch._dynamo.utils.counters` (`dynamo_counters`; 2.0): what dynamo and inductor counted (graphs, FX-graph
  cache hits), for `python -m cbopt bench`'s first-compile report. Missing: empty counts.
- `torch._dynamo.mark_static_address(t, guard=True)` (`static_address`; 2.1): the traced step's params and state
  tensors kept in its graph with an identity guard each, as torch's compiled optimizers keep theirs
  (`engine/traced.py`): the compiled call then neither checks their metadata nor takes them as arguments. Missing:
  the same graph, its tensors guarded and passed as inputs (slower calls).
- dynamo's handling of a `torch.optim.Optimizer`'s `_init_group` (`GradReader`; not an API: a behaviour of
  `torch/_dynamo/variables/optimizer.py`, 2.1): dynamo runs the call eagerly, then gives each grad it appended to a
  list a `GradSource`, which it guards as present alone (`NOT_NONE`), where a grad read as `p.grad` is guarded by
  its metadata, five `hasattr`s and an aliasing check, at every call: the traced step reads its grads so
  (`engine/traced.py`), as torch's compiled optimizers read theirs. Changed or gone: dynamo traces `_init_group` as
  any method, and the grads are guarded by their metadata again (the same graph, slower calls).
- inductor's CPU heuristic `StorageBox.should_realize_on_reuse` (not an API: a behaviour; 2.13), which computes a
  value once, into a buffer, where it is broadcast or reused and its computation holds an `exp` (`computed_once`):
  the traced step's bias corrections (float64 `pow`s of a count), which inductor would otherwise inline into each
  param's loop and redo for each vector of elements. Changed: the same values, each computed per vector again.
- `torch.optim.lbfgs._strong_wolfe` (`strong_wolfe`; 1.2): torch's strong-Wolfe line search, which `lbfgs` reuses.
  Missing: `line_search_fn='strong_wolfe'` is refused with a clear error before the step changes anything; without
  a line search L-BFGS works as before.
- `torch.distributed.checkpoint.state_dict._init_optim_state` (`in_dcp_init_step`; 2.2): DCP's helper that creates
  an optimizer's state with a zero-grad, lr=0 `step()` (torchtitan's checkpoints go through it too); cbopt's `step`
  recognises that caller by its name and module on the stack and only creates the state (`Optimizer.init_state`).
  Renamed or gone: that step runs as a step (torch's optimizers' behaviour: the step count starts at 1).
"""
from __future__ import annotations

import collections
import sys
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch

__all__ = ['in_dcp_init_step', 'warn_fallback', 'foreach_op', 'fused_kernel', 'constant_result', 'dynamo_loaded',
           'chain_settings', 'DYNAMO_CONFIG', 'SHAPE_CONFIG', 'INDUCTOR_OPTIONS', 'GPU_INDUCTOR_OPTIONS', 'UNCHECKED_GATHERS',
           'inductor_options',
           'inductor_pass_api', 'op_kinds', 'metadata_guard', 'flatten_dense', 'device_dtype_groups', 'tree_leaves',
           'tree_paths', 'tree_get',
           'data_getter', 'dynamo_counters', 'static_address', 'GradReader', 'computed_once', 'strong_wolfe']

_WARNED: set = set()


def warn_fallback(key: Any, msg: str) -> None:
    """Warn once per process and `key` that cbopt fell back from a private torch API that this torch lacks: the
    fallback is right, but slower or less exact, and the user should know why."""
    if key in _WARNED: return
    _WARNED.add(key)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


# -- foreach and fused kernels -------------------------------------------------------------------------------------
def foreach_op(name: str) -> Callable:
    """`torch._foreach_<name>`, looked up at each call (as torch's own code does; a test's spy on the op sees it),
    or, where this torch has no such op, the op once per tensor (`_per_tensor`), with one warning."""
    op = getattr(torch, '_foreach_' + name, None)
    return op if op is not None else _per_tensor(name)


_PER_TENSOR = {  # where the foreach op's arguments are not the tensor method's
    'norm': lambda t, ord=2, dtype=None: torch.linalg.vector_norm(t, ord, dtype=dtype),
    **{f'{op}{i}': (lambda m: lambda t, a, b, value=1: m(t, a, b, value=value))(getattr(torch.Tensor, op + i))
       for op in ('addcmul', 'addcdiv') for i in ('', '_')},  # (foreach takes `value` by position)
}


def _per_tensor(name: str) -> Callable:
    """The foreach op `name` as one call per tensor: the tensor method of that name (`add_`, `lerp`, `copy_`...), with
    every list argument picked per tensor and any other one passed whole; `pow` with a number first (`number **
    tensors`) too."""
    warn_fallback(('foreach', name), f"this torch has no torch._foreach_{name}: cbopt runs that op once per tensor "
                  "(the same values, more Python per step)")
    one = _PER_TENSOR.get(name) or getattr(torch.Tensor, name)

    def each(first, *args, **kwargs):
        if not isinstance(first, (list, tuple)):  # `_foreach_pow(number, tensors)`
            return [torch.pow(first, t) for t in args[0]]
        pick = lambda a, i: a[i] if isinstance(a, (list, tuple)) else a
        res = [one(t, *(pick(a, i) for a in args), **{k: pick(v, i) for k, v in kwargs.items()})
               for i, t in enumerate(first)]
        return None if name.endswith('_') else res
    return each


def fused_kernel(name: str) -> Callable | None:
    """torch's fused optimizer kernel `torch.<name>` (`'_fused_adamw_'`...), looked up at each step, or None where this
    torch has none (one warning): the caller's bucket then steps its chain compiled (or with foreach)."""
    kernel = getattr(torch, name, None)
    if kernel is None:
        warn_fallback(('fused', name), f"this torch has no torch.{name}: cbopt steps the chains registered with it "
                      "through the compiled chain (or foreach) instead")
    return kernel


# -- dynamo: eager-only functions and constant results, without importing it -----------------------------------------
def dynamo_loaded() -> bool:
    "Whether `torch._dynamo` is imported: no frame can be under dynamo's eval-frame hook before it is."
    return 'torch._dynamo' in sys.modules


def constant_result(fn: Callable) -> Callable:
    """`fn` marked as `torch.compiler.assume_constant_result` marks it (dynamo calls it eagerly at trace time and keeps
    its answer), without importing `torch._dynamo`: the attribute that call sets. Where dynamo is imported already,
    the public call itself."""
    if dynamo_loaded(): return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


# -- the compiled chain's settings -------------------------------------------------------------------------------------
DYNAMO_CONFIG = {'force_parameter_static_shapes': False, 'assume_static_by_default': False}  # dynamic shapes
SHAPE_CONFIG = 'use_duck_shape'  # torch.fx.experimental._config: False gives every size its own symbol
INDUCTOR_OPTIONS = {'size_asserts': False}  # inductor's size asserts repeat what dynamo's guards checked before the call


GPU_INDUCTOR_OPTIONS = {'combo_kernels': True}
"""On a GPU, one kernel for the chain over all the params of a compiled call (inductor's combo kernels) instead of one
per param: measured on an H200 (torch 2.11), Lion on GPT-2 small's params took 6.5 ms a step in 64 kernels, 3.4 ms in
15 with them, the kernels' own time at the copy bandwidth's floor (the rest is the calls' Python)."""


# a low-bit graph's gathers (a code's map value, a code table's bucket) index tables with indices clamped or bounded by
# construction (a uint8 code of a 256-value map, a clamped bucket): inductor's per-element bounds check, a vector mask
# test around each scalarised gather, halved the compiled 8-bit Adam step's speed on a CPU
UNCHECKED_GATHERS = {'assert_indirect_indexing': False}


def inductor_options(graph_pass: Any = None, device_type: str = 'cpu', gathers_checked: bool = True) -> dict:
    """Inductor's options for the compiled chain: `INDUCTOR_OPTIONS`, `GPU_INDUCTOR_OPTIONS` on any device but the
    CPU (whose C++ kernels have no combo kernels), and `graph_pass` as its post-grad pass if given;
    `gathers_checked=False`: `UNCHECKED_GATHERS` (the low-bit graph: `cbopt.engine.lowbit`)."""
    return {**INDUCTOR_OPTIONS, **(GPU_INDUCTOR_OPTIONS if device_type != 'cpu' else {}),
            **({'post_grad_custom_post_pass': graph_pass} if graph_pass is not None else {}),
            **({} if gathers_checked else UNCHECKED_GATHERS)}


def _patcher(config: Any, changes: Mapping[str, Any]) -> Callable[[], Callable[[], None]]:
    """`config`'s settings `changes` as an `enter()` that sets them and returns the function that restores them:
    torch's low-overhead closure patcher (`ConfigModule._make_closure_patcher`, what torch.compile's `dynamic=` uses
    at every call), made once; where this torch has none, its `patch` entered and exited (a class made per use). An
    unknown key raises KeyError or AttributeError on entry, before anything is set."""
    make = getattr(config, '_make_closure_patcher', None)
    if make is not None:
        change = make(**changes)
        def enter() -> Callable[[], None]:
            for k in changes: config._config[k]  # (an unknown key: KeyError, before any is set)
            return change()
        return enter
    def enter_patch() -> Callable[[], None]:
        ctx = config.patch(dict(changes))
        ctx.__enter__()
        return lambda: ctx.__exit__(None, None, None)
    return enter_patch


def _nothing() -> None: return None


def _isa_trust() -> Callable[[], Callable[[], None]]:
    """Inductor taking the CPU's vector ISA (AVX-512, AVX2...) from the flags the CPU reports (`cpp.vec_isa_ok`) instead
    of compiling and loading a test program per ISA: most of a cold compile's cost that is not the chain's own (Lion
    on GPT-2 small's params, 2-core EPYC: 8 of 18 CPU-s; the same ISA is picked). As an `enter()` returning its exit
    (`_patcher`'s form). Inductor keeps the list it makes for the process: where none was made before and one was
    made in between, it is dropped at the exit, so the process's other compiles probe as they would have. Entering
    does nothing where this torch lacks what it needs, or where the user set `cpp.vec_isa_ok`
    (`TORCHINDUCTOR_VEC_ISA_OK`)."""
    try:
        import torch._inductor.config as config
        from torch._inductor import cpu_vec_isa
        trust = _patcher(config, {'cpp.vec_isa_ok': True})
    except (ImportError, AttributeError): return lambda: _nothing

    def enter() -> Callable[[], None]:
        try:
            listed = cpu_vec_isa.valid_vec_isa_list
            if config.cpp.vec_isa_ok is not None: return _nothing  # (the user's)
            fresh = listed.cache_info().currsize == 0
        except AttributeError: return _nothing
        revert = trust()

        def leave() -> None:
            revert()
            if fresh and listed.cache_info().currsize:  # made in the block: dropped, with each ISA's own answer
                listed.cache_clear()  # (which its class keeps: `VecAVX512.__bool__`...)
                for cls in vars(cpu_vec_isa).values():
                    if isinstance(cls, type) and callable(clear := getattr(cls.__dict__.get('__bool__'), 'cache_clear', None)):
                        clear()
        return leave
    return enter


_CHAIN_SETTINGS: dict = {}  # (duck_shapes, inductor, cpu, the settings) -> `chain_settings`'s enter()


def chain_settings(duck_shapes: bool, inductor: bool = True, cpu: bool = True) -> Callable[[], Callable[[], None]]:
    """The compiled chain's settings around its calls, as one `enter()` that sets them all and returns the function
    that restores them: dynamo's dynamic shapes (`DYNAMO_CONFIG`), sizes shared by equal ones only with `duck_shapes`;
    with `inductor`, each op rounded to its dtype as eager does (`emulate_precision_casts`: on 16-bit params inductor
    would else fuse `p += u; comp += u - (p - before)` in fp32, and a Kahan compensation compensate nothing; an fp32
    chain's 16-bit math, Muon's bf16 iteration, would round otherwise than the loop; read where the graph is lowered,
    which a torch.compile option does not reach), and on the `cpu` the ISA taken from the CPU's flags (`_isa_trust`).
    Made once per combination from torch's closure patchers (`_patcher`): a step pays a few
    writes of settings, where entering the context managers cost a class made per setting and two `__setattr__`s each
    (GPT-2's 148 params, Lion, loaded 2-core CPU: about a tenth of the fused step's host time). Entered at each step,
    not only where a call compiles, because dynamo may recompile at any call (a param of one element, a guard that
    fails), and what it compiles then must be what it compiled first. A key this torch does not know raises on entry,
    before anything is compiled or stepped."""
    key = (duck_shapes, inductor, cpu, tuple(DYNAMO_CONFIG.items()), SHAPE_CONFIG)  # (as the settings are now)
    enter = _CHAIN_SETTINGS.get(key)
    if enter is None:
        import torch._dynamo
        import torch.fx.experimental._config as shape_config
        parts = [_patcher(torch._dynamo.config, DYNAMO_CONFIG), _patcher(shape_config, {SHAPE_CONFIG: duck_shapes})]
        if inductor:
            import torch._inductor.config as inductor_config
            parts.append(_patcher(inductor_config, {'emulate_precision_casts': True}))
            if cpu: parts.append(_isa_trust())

        def enter() -> Callable[[], None]:
            reverts: list = []
            def leave() -> None:
                for revert in reversed(reverts): revert()
            try:
                for part in parts: reverts.append(part())
            except BaseException:
                leave()
                raise
            return leave
        enter = _CHAIN_SETTINGS[key] = enter
    return enter


def inductor_pass_api() -> SimpleNamespace | None:
    """What an inductor graph pass needs (`CustomGraphPass`, the base class inductor caches passes by;
    `get_hash_for_files`, for its cache key; `stable_topological_sort`), imported now (it imports `torch._inductor`);
    None where this torch lacks one (one warning: no `ScalarsOnce`)."""
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
        from torch._inductor.pattern_matcher import stable_topological_sort
        kinds = op_kinds()
    except (ImportError, AttributeError) as e:
        warn_fallback('inductor_pass', f"this torch lacks what cbopt's ScalarsOnce graph pass needs ({e}): compiled "
                      "chains compute each param's scalars in their own barrier (the same values, more Python per call)")
        return None
    return SimpleNamespace(CustomGraphPass=CustomGraphPass, get_hash_for_files=get_hash_for_files,
                           stable_topological_sort=stable_topological_sort, op_kinds=kinds)


def op_kinds() -> tuple[type, type]:
    "torch's classes of graph-node targets that may write into their inputs: `HigherOrderOperator`, `OpOverload`."
    return torch._ops.HigherOrderOperator, torch._ops.OpOverload


# -- engine helpers --------------------------------------------------------------------------------------------------
def metadata_guard(tensors: Sequence[torch.Tensor]) -> Any:
    """torch's own check of tensors' metadata (dynamo's C++ `TensorGuards`: Python type, dispatch keys, dtype, device,
    requires_grad, sizes and strides): `guard.check(*tensors)` is whether each tensor still has what its counterpart
    had here. None where torch has no such check (the caller then checks another way)."""
    try:
        from torch._C._dynamo.guards import TensorGuards
        return TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)
    except (ImportError, TypeError, RuntimeError): return None


def flatten_dense(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    "The tensors' elements as one new flat tensor, in order (torch's `_flatten_dense_tensors`, or the same by `cat`)."
    flatten = getattr(getattr(torch, '_utils', None), '_flatten_dense_tensors', None)
    if flatten is not None: return flatten(tensors)
    return torch.cat([t.reshape(-1) for t in tensors])


def device_dtype_groups() -> Callable | None:
    """torch's `_group_tensors_by_device_and_dtype` (which orders `clip_grad_norm_`'s per-(device, dtype) norms), or
    None where this torch has none."""
    try: from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype
    except ImportError: return None
    return _group_tensors_by_device_and_dtype


def tree_leaves(tree: Any) -> list:
    "The leaves of a nested structure, as torch's pytree finds them (or, without it, of nested dicts, lists, tuples)."
    try: from torch.utils._pytree import tree_leaves as leaves
    except ImportError: leaves = None
    if leaves is not None: return leaves(tree)
    if isinstance(tree, dict): return [x for v in tree.values() for x in tree_leaves(v)]
    if isinstance(tree, (list, tuple)): return [x for v in tree for x in tree_leaves(v)]
    return [tree]


def tree_paths(tree: Any) -> tuple[list[tuple], list, Callable[[list], Any]]:
    """The leaves of a nested structure (dicts, lists, tuples, namedtuples, and any container torch's pytree knows),
    each with its path (a tuple of dict keys, sequence indices and namedtuple field names), and a function rebuilding
    the structure around new leaves given in that order."""
    try: from torch.utils._pytree import GetAttrKey, MappingKey, SequenceKey, tree_flatten_with_path, tree_unflatten
    except ImportError: tree_flatten_with_path = None
    if tree_flatten_with_path is not None:
        pairs, spec = tree_flatten_with_path(tree)
        def key(k):
            if isinstance(k, MappingKey): return k.key
            if isinstance(k, SequenceKey): return k.idx
            if isinstance(k, GetAttrKey): return k.name
            raise TypeError(f"a pytree key {k!r} that is not a dict key, an index or a field")
        return ([tuple(map(key, path)) for path, _ in pairs], [leaf for _, leaf in pairs],
                lambda leaves: tree_unflatten(list(leaves), spec))
    return _walk_paths(tree)


def _walk_paths(tree: Any) -> tuple[list[tuple], list, Callable[[list], Any]]:
    "`tree_paths` without torch's pytree: dicts, lists, tuples and namedtuples (anything else is a leaf)."
    if isinstance(tree, Mapping): keys, kids = list(tree), list(tree.values())
    elif isinstance(tree, (list, tuple)):
        keys, kids = (list(tree._fields) if hasattr(tree, '_fields') else list(range(len(tree)))), list(tree)
    else: return [()], [tree], lambda leaves: leaves[0]
    parts = [_walk_paths(kid) for kid in kids]
    paths = [(k, *p) for k, (ps, _, _) in zip(keys, parts) for p in ps]
    def rebuild(leaves: list) -> Any:
        out, i = [], 0
        for ps, _, re in parts:
            out.append(re(leaves[i:i + len(ps)]))
            i += len(ps)
        if isinstance(tree, Mapping): return dict(zip(keys, out))
        return type(tree)(*out) if hasattr(tree, '_fields') else type(tree)(out)
    return paths, [leaf for _, ls, _ in parts for leaf in ls], rebuild


def tree_get(tree: Any, path: tuple) -> Any:
    "The node of `tree` at `path` (as `tree_paths` gives it): a dict's key, a sequence's index, a namedtuple's field."
    for k in path: tree = tree[k] if isinstance(tree, Mapping) or isinstance(k, int) else getattr(tree, k)
    return tree


def data_getter() -> Any:
    "The `.data` getter of tensors, the object a torch function mode gets as `func` when a callback reads `p.data`."
    base = getattr(torch._C, 'TensorBase', None) or getattr(torch._C, '_TensorBase')
    return base.__dict__['data']


def static_address(t: torch.Tensor) -> None:
    """Mark `t` as `torch._dynamo.mark_static_address(t, guard=True)` does (what torch's compiled optimizers do to their
    params and state): dynamo keeps it in the graph it traces and guards its identity alone, not its metadata, and
    the compiled call takes no argument for it. Called while dynamo traces, so dynamo is loaded."""
    try: from torch._dynamo import mark_static_address
    except ImportError:
        warn_fallback('static_address', "this torch has no torch._dynamo.mark_static_address: a compiled step guards "
                      "each param's and state tensor's metadata at every call")
        return
    mark_static_address(t, guard=True)


class GradReader(torch.optim.Optimizer):
    """How a traced step reads its grads as torch's compiled optimizers read theirs: through `_init_group`, which
    dynamo runs eagerly when it traces a call of it on an optimizer (as torch's `_init_group`), then guards each grad
    the call appended as present alone (see the module docstring), instead of its metadata and more at every call.
    Its `param_groups` are plain dicts of the owner's groups' own `params` lists (dynamo's handling assumes plain
    dicts, which cbopt's `ParamGroup`s are not), read afresh each time, so they never go stale; it holds no state,
    hooks or defaults of its own (torch's `__init__` is not run). Kept in the owner's `__dict__`, where dynamo finds
    it by a source (`cbopt.Optimizer` makes one as it is built or unpickled; pickles leave it out)."""
    def __init__(self, owner: torch.optim.Optimizer):
        self._owner = weakref.ref(owner)
        self.defaults: dict = {}
        self.state: dict = {}  # (none: dynamo marks what is here static, and the owner's step marks its own)

    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        "The owner's groups as plain dicts of their params lists (the same lists), in order."
        owner = self._owner()
        return [] if owner is None else [{'params': dict.__getitem__(g, 'params')} for g in owner.__dict__['param_groups']]

    def _init_group(self, gi: int, params: list, grads: list) -> bool:
        """Append group `gi`'s params that have a grad to `params`, and their grads to `grads` (torch's signature's
        shape: lists filled in place, a constant returned: no complex params here, the caller sees them)."""
        for p in self.param_groups[gi]['params']:
            if p.grad is not None:
                params.append(p)
                grads.append(p.grad)
        return False


def computed_once(t: Any) -> Any:
    """`t` (a 0-d tensor) as a value inductor computes once, before the loops over the params' elements that read it:
    `where(t == t, t, exp(t))`, which is `t` bit for bit (NaN and inf too), holds an `exp`, for which inductor's CPU
    code generator realizes a broadcast value into a buffer rather than inline its computation into each loop (see the
    module docstring): the traced step's bias corrections, float64 `pow`s of its bucket's one count, which inductor
    would otherwise redo for each vector of each param's elements (Adam's compiled step took 1.3x torch's). Anything
    else (a TensorList, a tensor not on the CPU, an eager call, where the mark would cost kernels) is returned as it
    is."""
    if not (torch.compiler.is_compiling() and isinstance(t, torch.Tensor) and t.ndim == 0 and t.is_cpu): return t
    return torch.where(t == t, t, t.exp())


def dynamo_counters() -> Mapping:
    """dynamo's and inductor's counters (`counters['stats']['unique_graphs']`, `counters['inductor'][...]`), imported
    now; empty counts where this torch keeps none there."""
    try: from torch._dynamo.utils import counters
    except ImportError:
        warn_fallback('dynamo_counters', "this torch has no torch._dynamo.utils.counters: compile counts read 0")
        return collections.defaultdict(collections.Counter)
    return counters


def strong_wolfe() -> Callable:
    """torch's strong-Wolfe line search (`torch.optim.lbfgs._strong_wolfe`), or a ValueError naming what is missing:
    asked for before an L-BFGS step with `line_search_fn='strong_wolfe'` changes anything."""
    try: from torch.optim.lbfgs import _strong_wolfe
    except ImportError:
        raise ValueError(f"line_search_fn='strong_wolfe' needs torch.optim.lbfgs._strong_wolfe, which torch "
                         f"{torch.__version__} does not have: use line_search_fn=None") from None
    return _strong_wolfe


_DCP_INIT = ('torch.distributed.checkpoint.state_dict', '_init_optim_state')


def in_dcp_init_step(depth: int = 12) -> bool:
    """Whether the current call comes (within `depth` frames) from torch DCP's `_init_optim_state`, which steps an
    optimizer that has no state with zero grads at lr=0 to create its state (see the module's docstring)."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None: return False
        if frame.f_code.co_name == _DCP_INIT[1] and frame.f_globals.get('__name__') == _DCP_INIT[0]: return True
        frame = frame.f_back
    return False
