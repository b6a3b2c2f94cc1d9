"""TokenLogprobs: flat rows read as {token_id: logprob} dicts."""

import pickle
from array import array

import pytest

from chatengine.outputs import TokenLogprobs


def test_rows_read_as_dicts_best_first_then_the_token_and_views_stay_fixed():
    flat = array("f")
    flat.extend([7, -0.5, -0.25, -0.5, 3, 7])  # token 7 among the top 2 (ids 3, 7)
    flat.extend([9, -3.0, -0.125, -1.0, 4, 5])  # token 9 not among them: appended last
    first = TokenLogprobs(flat, 2, 1)
    both = TokenLogprobs(flat, 2, 2)
    assert first[0] == {3: -0.25, 7: -0.5} and list(first[0]) == [3, 7]
    assert both[-1] == {4: -0.125, 5: -1.0, 9: -3.0} and list(both[1]) == [4, 5, 9]
    assert both[1:] == [both[1]] and both[5:] == [] and len(both) == 2
    flat.extend([1, -0.75, -0.75, -1.5, 1, 2])  # a later token: the views keep their length
    assert len(first) == 1 and len(both) == 2
    assert both == [{3: -0.25, 7: -0.5}, {4: -0.125, 5: -1.0, 9: -3.0}] == list(both)
    assert both != first and both != [{}, {}]
    with pytest.raises(IndexError):
        first[1]
    with pytest.raises(IndexError):
        first[-2]


def test_no_candidates_is_the_token_alone_and_a_view_pickles_as_a_list():
    flat = array("d", [5, -1.25, 6, -0.5])
    view = TokenLogprobs(flat, 0, 2)
    assert list(view) == [{5: -1.25}, {6: -0.5}]
    back = pickle.loads(pickle.dumps(view))
    assert type(back) is list and back == view
    assert view + [{1: 0.0}] == [{5: -1.25}, {6: -0.5}, {1: 0.0}] and [None] + view == [None, {5: -1.25}, {6: -0.5}]
