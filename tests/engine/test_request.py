"""Request host state: the no-copy token view the scheduler reads every step."""

from __future__ import annotations

import pytest

from pjinfer import SamplingParams
from pjinfer.engine.request import Request


def test_token_ids_view_reads_like_the_concatenated_list():
    r = Request("a", "a", 0, [5, 6, 7], SamplingParams(), 0, None)
    r.output_token_ids += [8, 9]
    r.num_pending_tokens = 1  # a pending token is not a known one
    full = [5, 6, 7, 8, 9]
    view = r.all_token_ids
    assert len(view) == 5 and list(view) == full
    for sl in (slice(0, 2), slice(1, 4), slice(3, None), slice(None), slice(2, 2), slice(0, 9),
               slice(None, None, 2), slice(-2, None)):
        assert view[sl] == full[sl]
    assert view[-1] == 9 and view[3] == 8
    with pytest.raises(IndexError):
        view[5]
