"""timm: `register()` puts every cbopt optimizer in timm's optimizer registry, so `timm.optim.create_optimizer_v2(model,
'cboptadamw', layer_decay=0.75)` (and `'lookahead_cboptadamw'`, timm's Lookahead around it) builds one. Imports timm
when called, never at `import cbopt`.

timm reads an optimizer's name by splitting it on `_` (`lookahead_adamw` is Lookahead around `adamw`), so a name with
`_` would silently be read as another optimizer (`cbopt_adamw` as torch's `adamw`): names are `cbopt` + the class
name in lower case, and a prefix or name with `_` is refused. What timm adds to the optimizer is carried as torch's
optimizers carry it: its group keys (`lr_scale` from `layer_decay`, which its schedulers multiply the lr by;
`use_fallback`; Lookahead's `lookahead_*`) and Lookahead's `lookahead_slow_buff` in `opt.state[p]`, saved and loaded
untouched (`cbopt.Optimizer`'s rule for a framework's own keys)."""
from __future__ import annotations

import inspect
from typing import Any

__all__ = ['register', 'timm_optimizers']


# cbopt's recipes preferred over their cbopt.optim twin: cbopt.Muon is hybrid (Muon for the hidden matrices, AdamW
# for the rest), as timm's own `muon` is; cbopt.optim.Muon, torch's, refuses the biases and norms timm's groups hold
_HYBRID = ('Muon',)


def timm_optimizers(prefix: str = 'cbopt') -> dict[str, type | Any]:
    """The optimizers `register` registers, by their timm name: `cbopt.optim`'s classes (torch's signatures, which are
    the keywords timm passes: `weight_decay`, `momentum`, `betas`, `eps`, `foreach`), then cbopt's own recipes that
    have no `cbopt.optim` twin (`cboptlion`, `cboptadan`, `cboptschedulefreeadamw`, Composer's `cboptdecoupledadamw`...),
    which take torch's names too (`weight_decay`, `betas`); `cboptmuon` is `cbopt.Muon`, hybrid as timm's `muon`. A
    name is `prefix` + the class name in lower case. Left out: what timm cannot build, since it always passes
    `weight_decay` and params: `cbopt.optim.Rprop` and `LBFGS` (torch's take no weight_decay; `cboptrprop` is cbopt's
    own Rprop recipe, which does), `cbopt.Lookahead` (it wraps an optimizer: timm's `lookahead_` prefix does that)."""
    import cbopt
    from cbopt import optim
    _check_name(prefix, 'prefix')
    candidates = [getattr(cbopt.recipes, n) for n in _HYBRID]
    candidates += [getattr(optim, n) for n in optim.__all__]
    candidates += [getattr(cbopt.recipes, n) for n in cbopt.recipes.__all__ if n[0].isupper()]  # (not chain builders)
    out: dict[str, Any] = {}
    for fn in candidates:
        if not callable(fn) or not _takes_timm_arguments(fn): continue
        out.setdefault(f"{prefix}{fn.__name__.lower()}", fn)  # (the first of a name wins: timm passes torch's keywords)
    return out


def _takes_timm_arguments(fn: Any) -> bool:
    "Whether `fn(params, weight_decay=...)` builds an optimizer (cbopt's recipes take torch's names beside their own)."
    sig = list(inspect.signature(fn).parameters)
    return bool(sig) and sig[0] == 'params' and ('weight_decay' in sig or 'wd' in sig)


def _check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or '_' in name:
        raise ValueError(f"timm optimizer {what} {name!r} has a '_': timm splits optimizer names on '_' ('lookahead_adamw' "
                         f"is Lookahead around 'adamw'), so it would read {name!r} as the optimizer "
                         f"{str(name).split('_')[-1]!r}, silently; use a name without '_' (e.g. {str(name).replace('_', '')!r})")


def _info(name: str, cls: Any):
    "timm's `OptimInfo` for `cls`, from the keywords it takes."
    from timm.optim import OptimInfo
    sig = inspect.signature(cls).parameters
    has_betas = 'betas' in sig or 'sqr_mom' in sig  # (cbopt's recipes take betas as (mom, sqr_mom))
    has_momentum = 'momentum' in sig or ('mom' in sig and not has_betas)  # (an Adam-like's mom is its betas[0])
    doc = (inspect.getdoc(cls) or '').split('\n')[0]
    return OptimInfo(name=name, opt_class=cls, description=f"cbopt: {doc}"[:200], has_eps='eps' in sig,
                     has_momentum=has_momentum, has_betas=has_betas, num_betas=2,
                     second_order=False)  # (timm's second order: a step that needs create_graph; none of cbopt's)


def register(prefix: str = 'cbopt', registry: Any = None) -> list[str]:
    """Register every cbopt optimizer (`timm_optimizers(prefix)`) in timm's registry (`registry`, timm's default one
    if None), with `OptimInfo` fields read from its signature (`has_betas`, `has_momentum`, `has_eps`); returns the
    names. Then `timm.optim.create_optimizer_v2(model, 'cboptadamw', lr=1e-3, weight_decay=0.05, layer_decay=0.75)`
    builds `cbopt.optim.AdamW` over timm's groups. A `prefix` with `_` is refused (see the module's docstring)."""
    if registry is None:
        from timm.optim._optim_factory import default_registry as registry
    names = []
    for name, cls in timm_optimizers(prefix).items():
        _check_name(name, 'name')
        registry.register(_info(name, cls))
        names.append(name)
    return names
