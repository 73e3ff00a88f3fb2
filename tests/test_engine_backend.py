"""`cbopt.engine.backend`: the `Backend` settings and `as_backend`, with hand-worked expectations."""
from __future__ import annotations

import pytest

from cbopt.engine import Backend, as_backend
from conftest import NO_COMPILE_FALLBACK

pytestmark = NO_COMPILE_FALLBACK


@pytest.mark.parametrize('field', ['compile_chunk', 'cpu_chunk_bytes', 'auto_trials'])
@pytest.mark.parametrize('bad', [0, -1, True, 1.5, '4'])
def test_backend_settings_are_positive_ints(field, bad) -> None:
    with pytest.raises(ValueError, match=rf"^Backend\.{field} must be a positive int, got {bad!r}$"):
        Backend('foreach', **{field: bad})
    assert getattr(Backend('foreach', **{field: 1}), field) == 1


def test_backend_kind_and_as_backend() -> None:
    with pytest.raises(ValueError, match=r"^unknown backend 'fast': expected one of \('auto', 'loop', 'foreach', 'fused'\)$"):
        Backend('fast')
    mine = Backend('foreach', compile_chunk=7, cpu_chunk_bytes=3, auto_trials=5)
    assert as_backend('loop', mine) == Backend('loop', compile_chunk=7, cpu_chunk_bytes=3, auto_trials=5)
    assert as_backend('fused') == Backend('fused')
    assert as_backend(mine, Backend()) is mine
    with pytest.raises(TypeError, match=r"^backend must be a str or a cbopt\.Backend, not int$"): as_backend(3)
    assert (Backend().kind, Backend().compiler, Backend().auto_trials) == ('auto', 'inductor', 2)
