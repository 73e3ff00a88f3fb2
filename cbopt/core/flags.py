"""fastai's per-param flags: settings that live in `opt.state[p]` (fastai's Learner writes them there) but are not
algorithm state: a step does not compute them, `clear_state` keeps them, and a load keeps the receiving optimizer's."""
from __future__ import annotations

from collections.abc import Mapping

__all__ = ['FLAGS', 'split_flags']

FLAGS = ('do_wd', 'force_train')


def split_flags(state: Mapping) -> tuple[dict, dict]:
    "A param's state as (algorithm state, flags)."
    algo, flags = {}, {}
    for k, v in state.items(): (flags if k in FLAGS else algo)[k] = v
    return algo, flags
