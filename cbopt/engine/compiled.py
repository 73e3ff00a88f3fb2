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

import types
from collections.abc import Callable, Iterable, Mapping

import torch

from .._torch import chain_settings, inductor_options
from ..core.chain import chain_scope, chain_sig, run_chain, transient_keys
from ..core.dtensor import as_like, is_dtensor, local, local_param
from ..core.runtime import runtime, warn_once
from ..core.quant import FORMATS, n_blocks
from ..state.lowbit import pack, stored_base, stored_part, unpack
from .buckets import Bucket, give_grad
from .flat import FlatInputs, flat_alias, flat_chunks, flat_inputs, release_grads, shape_chunks
from .foreach import foreach_bucket
from .scalars import ScalarArgsAsTensors, register_ops, scalars_once_pass

__all__ = ['is_float64_0d', 'float64_scalars_on_gpu', 'device_failed', 'CompileFailed', 'PartlyStepped', 'compiled_chain',
           'compiled_bucket', 'fused_bucket', 'float64_0d_copies']


_COMPILED: dict = {}  # (compiler, chain_sig, chunk layout) -> compiled function, shared by every optimizer in the process


def is_float64_0d(v) -> bool:
    "Whether `v` is a 0-d float64 tensor: a running number in state (schedule-free's sums, NAdam's `mu_product`)."
    return isinstance(v, torch.Tensor) and v.ndim == 0 and v.dtype == torch.float64


def float64_0d_copies(ts: Mapping, keys: Iterable | None = None) -> dict:
    """Copies, made in the graph, of a param's 0-d float64 state entries, which a compiled step hands the chain in
    their place. torch 2.13's AOT autograd drops every in-place update of a 0-d float64 graph input (as if it were one
    of dynamo's own tensorified Python floats: `m.mul_(x)`, `m.add_(x)`, `m.copy_(y)` alike, on CPU; NAdam's
    `mu_product` on float64 params), while a copy's update comes back as a new state entry, which the engine writes
    back as it does any rebound entry. `keys`: those entries only (a traced step's: known before it, so that dynamo
    does not guard every entry it would scan)."""
    if keys is None: return {k: v.clone() for k, v in ts.items() if is_float64_0d(v)}
    return {k: ts[k].clone() for k in keys if is_float64_0d(ts.get(k))}


def _fused_chain_fn(cbs, name: str, stored: Mapping | None = None) -> Callable:
    """The chain over a list of params as one function, under a code object of its own (torch.compile caches per
    code). `stored`: a low-bit plan (`cbopt.state.lowbit.param_plan`): the state holds those entries' stored parts,
    dequantized in the graph before the chain and quantized after it (new parts: the engine writes them back), outside
    the scalar barrier (their constants are the format's, never a hyper)."""
    transient = transient_keys(cbs)
    def fused_chain(params, tstates, pystate, hyper):
        new_t, new_py = [], None
        sts = [{**pystate, **ts, **float64_0d_copies(ts)} for ts in tstates]
        if stored:
            for p, st in zip(params, sts): unpack(st, p, stored)
        with ScalarArgsAsTensors(scalars_once=True):
            for p, st in zip(params, sts): run_chain(cbs, p, st, hyper)  # unrolled when compiled: one graph
        for p, ts, st in zip(params, tstates, sts):
            if stored: pack(st, p, stored, stochastic=False)  # (block formats only: no random draws in the graph)
            new_t.append({k: v for k, v in st.items()
                          if isinstance(v, torch.Tensor) and v is not ts.get(k) and k not in transient})
            if new_py is None:  # (the first param's: a run's padding, if any, comes last)
                new_py = {k: v for k, v in st.items() if not isinstance(v, torch.Tensor) and k not in transient}
        return new_t, new_py
    code = fused_chain.__code__.replace(co_name=name)
    return types.FunctionType(code, fused_chain.__globals__, name, None, fused_chain.__closure__)


def compiled_chain(cbs, compiler: str, b: Bucket, idx: list, flat_run: int | None = None,
                   stored: Mapping | None = None) -> Callable:
    """The chain compiled for the params `idx` of `b` (flat: for runs of `flat_run` flat params), with dynamic shapes
    and Python numbers: a change of lr or step does not recompile. Compiled once per chain and layout (device, dtype,
    ranks or run length, state keys) in this process. Raises (before anything is stepped) where torch refuses an
    option (`cbopt._torch.inductor_options`). `stored`: the low-bit plan of state kept stored (`_fused_chain_fn`)."""
    p0 = b.params[idx[0]]
    ranks = ('flat', flat_run) if flat_run else tuple(b.params[i].ndim for i in idx)
    plan = tuple(stored.items()) if stored else ()
    key = (compiler, chain_sig(cbs), p0.device, p0.dtype, ranks, tuple(b.states[idx[0]]), plan)
    if key not in _COMPILED:
        register_ops()
        fn = _fused_chain_fn(cbs, f'cbopt_fused_chain_{len(_COMPILED)}', stored)
        # dynamic shapes come from `compiled_bucket`'s config patch, once per bucket: `dynamic=True` would patch the
        # config again at every call
        # (`scalars_once_pass` is None where this torch cannot run it: then each scalar is computed in its own barrier)
        options = (inductor_options(scalars_once_pass(), p0.device.type, gathers_checked=not stored)
                   if compiler == 'inductor' else None)
        _COMPILED[key] = torch.compile(fn, backend=compiler, fullgraph=True, options=options)
    return _COMPILED[key]


def float64_scalars_on_gpu(b: Bucket) -> bool:
    """Whether `b`'s params are on an accelerator and their state holds 0-d float64 tensors (schedule-free's weight
    sums, NAdam's `mu_product`). An H200 run (torch 2.11) found the compiled schedule-free AdamW 0.05 off the CPU loop
    after 20 steps where foreach follows it to 1e-7: until a GPU run finds the cause, such chains run foreach there."""
    return b.params[0].device.type != 'cpu' and any(map(is_float64_0d, b.states[0].values()))


def device_failed(e: BaseException) -> bool:
    """Whether `e` is the device's failure (a CUDA launch or kernel error: `torch.AcceleratorError`, or a RuntimeError
    naming CUDA's error), not the compiler's. A compiled chunk that raises it may have run some of its kernels: handing
    its params to the foreach fallback would step them twice, so it propagates (the device is unusable anyway). A
    compiler's error (dynamo, inductor, a setting) comes before the chunk's graph runs anything."""
    if isinstance(e, getattr(torch, 'AcceleratorError', ())): return True
    return isinstance(e, RuntimeError) and any(w in str(e) for w in ('CUDA error', 'device-side assert', 'HIP error'))


class CompileFailed(Exception):
    "The chain did not compile; `rest` is the part of the bucket that was not touched."
    def __init__(self, err: Exception, rest: Bucket): self.err, self.rest = err, rest


def compiled_bucket(opt, b: Bucket, hyper: Mapping, stored: Mapping | None = None, run: int | None = None,
                    pieces: tuple[int, int] | None = None) -> None:
    """Step `b` with the compiled chain: flat params in runs of `compile_chunk` (`flat_chunks`, the last one padded:
    one graph) where `flat_inputs` gives them, else in chunks of params of the same shape (`shape_chunks`).
    Compilation traces the chain before running anything, so a chain that cannot compile raises before its first
    chunk is touched; so do dynamo's settings and inductor's options that this torch does not know (`CompileFailed`,
    with the whole bucket). `pieces` (the low-bit graph's, with `run=1`): `(size, above)`, a flat param of more than
    `above` elements steps in pieces of `size` (`_in_pieces`)."""
    on_shards = is_dtensor(b.params[0])  # (an elementwise chain: see `fused_bucket`; a shard's local tensors step by shape)
    pystate = {k: v for k, v in b.states[0].items() if not isinstance(v, torch.Tensor)}
    kept = runtime(opt).flat_aliases.setdefault(b.layout, {})
    flat = None if on_shards else flat_inputs(b, kept)
    try: _compiled_runs(opt, b, hyper, pystate, flat, on_shards, stored, run, pieces)
    finally:
        if flat is not None: release_grads(flat.params)  # (the pack's param too)


def _compiled_runs(opt, b: Bucket, hyper: Mapping, pystate: dict, flat: FlatInputs | None, on_shards: bool,
                   stored: Mapping | None = None, run: int | None = None,
                   pieces: tuple[int, int] | None = None) -> None:
    options = opt.backend_options
    run = run or options.compile_chunk  # flat: every run is padded to this length, so all call one graph
    if flat:
        params, tstates, members, pack = flat.params, flat.states, flat.members, flat.pack
        chunks = flat_chunks(len(params), run)
    else:
        members, pack = [[i] for i in range(len(b.params))], None
        chunks = shape_chunks([p.shape for p in b.params], run)
    hyper = dict(hyper)
    # dynamic shapes (flat: every size its own symbol); inductor: each 16-bit op rounds as in eager (16-bit params:
    # kahan_sum needs it; 16-bit math in fp32 chains: Muon's bf16 iteration), on the CPU without ISA test builds
    try: leave = chain_settings(not flat, options.compiler == 'inductor', b.params[0].device.type == 'cpu')()
    except Exception as e: raise CompileFailed(e, b) from e  # (an unknown setting: nothing touched, the whole bucket)
    try:
        try: fn = compiled_chain(b.cbs, options.compiler, b, chunks[0], run, stored) if flat else None  # (one graph)
        except Exception as e: raise CompileFailed(e, b) from e  # (an option this torch does not know, likewise)
        for j, idx in enumerate(chunks):
            if flat:
                ps, ts = [params[i] for i in idx], [tstates[i] for i in idx]
                if len(idx) < run:
                    pad_params, pad_states = flat.padding(run - len(idx))
                    ps, ts = ps + pad_params, ts + pad_states
            else:
                ts = [{k: local(v) for k, v in b.states[i].items() if isinstance(v, torch.Tensor)} for i in idx]
                ps = [local_param(b.params[i]) if on_shards else b.params[i] for i in idx]
            try:
                if not flat: fn = compiled_chain(b.cbs, options.compiler, b, idx, stored=stored)
                if pieces and flat and stored and len(ps) == 1 and _piecewise(ps[0], ts[0], stored, pieces[1]):
                    new_t, new_py = _in_pieces(fn, ps[0], ts[0], pystate, hyper, pieces[0], stored)
                else: new_t, new_py = fn(ps, ts, pystate, hyper)
            except Exception as e:  # nothing of this chunk ran: the rest of the bucket is handed back untouched
                if device_failed(e) or isinstance(e, PartlyStepped): raise  # (unless some of it ran: a kernel may
                # have run where the device failed, see `device_failed`; some pieces of a param, `_in_pieces`)
                rest = [i for c in chunks[j:] for s in c for i in members[s]]
                raise CompileFailed(e, Bucket(b.group, [b.params[i] for i in rest], [b.states[i] for i in rest])) from e
            for s, nt in zip(idx, new_t):
                if pack is not None and members[s] is pack.members: pack.scatter(b, nt)
                elif nt:  # a new flat entry gets its param's shape back; a rebound entry of a shard becomes a DTensor
                    i = members[s][0]  # again, as the entry was
                    p, st = b.params[i], b.states[i]
                    st.update({k: v.view(p.shape) if flat and v.shape == (p.numel(),) and stored_part(k) is None
                               else as_like(v, st.get(k, p)) for k, v in nt.items()})  # (stored parts stay 1-D)
            if new_py:
                for s in idx:
                    for i in members[s]: b.states[i].update(new_py)
    finally: leave()


class PartlyStepped(RuntimeError):
    "A param stepped in pieces (`_in_pieces`) failed after its first pieces stepped: never handed to a fallback."


def _piecewise(p: torch.Tensor, ts: Mapping, stored: Mapping, above: int) -> bool:
    """Whether the flat param `p` steps in pieces (`_in_pieces`): it has more than `above` elements, and its state
    tensors are all its size or stored parts of `stored`'s entries (elementwise: a piece's state is a piece of each)."""
    if p.numel() <= above: return False
    return all(v.numel() == p.numel() if stored_part(k) is None else stored_base(k) in stored for k, v in ts.items())


def _in_pieces(fn: Callable, p: torch.Tensor, ts: Mapping, pystate: Mapping, hyper: Mapping, piece: int,
               stored: Mapping) -> tuple[list, dict]:
    """The compiled chain `fn` on the flat param `p` in pieces of `piece` elements (a multiple of every block
    format's block), one call each, each with the matching piece of its grad, its state and its stored parts (codes
    and scales of the piece's blocks): as one call on `p` computes, for an elementwise chain. A large param's graph
    then holds the fp32 temporaries of one piece, which the allocator reuses from call to call and which stay in
    cache, where a whole param's are fresh memory at each call (the kernel's page faults: a quarter of GPT-2's
    embedding's step). Each piece's new values are written into the pieces of `p`'s state; what is new or of
    another size comes back whole, with the Python state of the last piece (each piece's is the same)."""
    new_py, rest, ran = None, {}, False
    for a in range(0, p.numel(), piece):
        n = min(piece, p.numel() - a)
        q = flat_alias(p, a, n)
        give_grad(q, flat_alias(p.grad, a, n))
        pts = {}
        for k, v in ts.items():
            f = FORMATS[stored[stored_base(k)][0]] if stored_part(k) else None
            if f is None: pts[k] = flat_alias(v, a, n)
            elif stored_part(k) == 'codes': pts[k] = flat_alias(v, a // f.per_byte, f.codes_numel(n))
            else: pts[k] = flat_alias(v, a // f.block, n_blocks(n, f.block))
        try:
            new_t, new_py = fn([q], [pts], pystate, hyper)
            ran = True
            for k, v in new_t[0].items():
                if k in pts and v.shape == pts[k].shape: pts[k].copy_(v)
                else: rest.setdefault(k, []).append(v)
        except Exception as e:
            if not ran: raise  # (nothing stepped yet: the caller may hand the param to a fallback)
            raise PartlyStepped(f"the compiled low-bit step of a param of {p.numel()} elements failed on its piece "
                                f"from element {a}, after its first pieces stepped: {type(e).__name__}: {e}") from e
    whole = lambda vs: torch.cat(vs) if sum(v.numel() for v in vs) == p.numel() and all(v.ndim for v in vs) else vs[-1]
    return [{k: whole(vs) for k, vs in rest.items()}], new_py


def fused_bucket(opt, b: Bucket, hyper: Mapping) -> None:
    """One pass over `b` with the compiled chain, once a first eager (foreach) step of this layout has created the
    state; foreach (warning once) if the chain does not compile, and (silently) where the grads are of another dtype
    than the params (torch's `grad_dtype`), which torch.compile does not trace."""
    rt, layout = runtime(opt), b.layout
    if is_dtensor(b.params[0]) and chain_scope(b.cbs) != 'element':
        return foreach_bucket(opt, b, hyper)  # (not compiled: see the module docstring)
    if float64_scalars_on_gpu(b):
        warn_once(opt, ('compile-f64', layout), "the compiled chain keeps 0-d float64 state on a GPU, which a GPU run "
                  "found it computes wrongly (schedule-free AdamW, docs/guides/cuda.md): running it with foreach")
        return foreach_bucket(opt, b, hyper)
    if layout in rt.no_compile or layout not in rt.seen:
        ran_bucketwise = foreach_bucket(opt, b, hyper)
        rt.seen.add(layout)
        if ran_bucketwise: rt.seen.add(b.layout)  # the layout after the step is state-complete: compile it next time
        else: rt.no_compile.add(layout)  # a chain that cannot run bucket-wise cannot compile either
        return
    try: compiled_bucket(opt, b, hyper)
    except CompileFailed as e:
        rt.no_compile.add(layout)
        # grads of another dtype than their params (`grad_dtype`: a bf16 param with fp32 grads), which dynamo does not
        # trace: such a bucket runs with foreach, the same numbers as the loop, as designed (no warning)
        if not any(p.grad is not None and p.grad.dtype != p.dtype for p in b.params):
            warn_once(opt, ('compile', layout), f"the callback chain could not be compiled ({type(e.err).__name__}: "
                      f"{e.err}); running it with the foreach backend")
        foreach_bucket(opt, e.rest, hyper)
