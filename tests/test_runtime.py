"""`cbopt.core.runtime`: `warn_once`."""
from __future__ import annotations

import warnings

import torch

import cbopt
from cbopt.core.runtime import warn_once
from conftest import NO_COMPILE_FALLBACK

pytestmark = NO_COMPILE_FALLBACK


def test_warn_once_per_key() -> None:
    opt = cbopt.SGD([torch.zeros(1, requires_grad=True)])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for _ in range(3): warn_once(opt, 'a', 'first')
        warn_once(opt, 'b', 'second')
        warn_once(cbopt.SGD([torch.zeros(1, requires_grad=True)]), 'a', 'other optimizer')
    assert [str(x.message) for x in w] == ['first', 'second', 'other optimizer']
    assert all(x.filename == __file__ for x in w)  # at the caller's line, not inside cbopt
