"""Param names as torch's distributed checkpoint helpers make them: without the prefixes that wrappers add.

`torch.compile(model)` names params `_orig_mod.<fqn>`, DDP `module.<fqn>`, activation checkpointing and FSDP1
`..._checkpoint_wrapped_module.<name>` / `_fsdp_wrapped_module.<name>`. torch's DCP (`_get_fqns` in
`torch/distributed/checkpoint/state_dict.py`) removes them, so a checkpoint does not depend on how the model was
wrapped when it was saved. cbopt removes them when it names params and when it reads a checkpoint's names.
"""
from __future__ import annotations

from collections.abc import Sequence

__all__ = ['WRAPPER_PREFIXES', 'canonical_names', 'is_positional']

WRAPPER_PREFIXES = ('_orig_mod.', '_checkpoint_wrapped_module.', '_fsdp_wrapped_module.')  # anywhere in a name
DDP_PREFIX = 'module.'  # DDP's: only when it starts every name (DDP wraps the whole model)


def _strip(name: str) -> str:
    parts = [p for p in name.split('.') if p + '.' not in WRAPPER_PREFIXES]
    return '.'.join(parts) or name


def canonical_names(names: Sequence[str]) -> list[str]:
    "`names` without wrapper prefixes (see the module docstring); a leading `module.` goes only if every name has it."
    out = [_strip(n) for n in names]
    if out and all(n.startswith(DDP_PREFIX) and len(n) > len(DDP_PREFIX) for n in out):
        out = [n[len(DDP_PREFIX):] for n in out]
    return out


def is_positional(names: Sequence) -> bool:
    "Names that are only positions (`'0', '1', ...`: cbopt's names for unnamed params), or no names at all."
    return all(n is None or str(n) == str(i) for i, n in enumerate(names))
