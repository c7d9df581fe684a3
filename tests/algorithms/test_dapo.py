"""DAPO's data-side functions, computed by hand: the soft overlong punishment (eq. 13) and which
groups dynamic sampling keeps (eq. 11)."""

import pytest
import torch

from dockrl.algorithms.dapo import mixed_groups, overlong_penalty


def test_overlong_penalty_by_hand():
    # L_max = 20, L_cache = 4: no penalty up to 16 tokens, then -(|y| - 16) / 4 · f, down to -f at 20
    lengths = torch.tensor([0, 10, 16, 17, 18, 19, 20, 25])
    got = overlong_penalty(lengths, max_length=20, buffer_length=4, penalty_factor=1.0)
    assert got.tolist() == pytest.approx([0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0])
    half = overlong_penalty(lengths, max_length=20, buffer_length=4, penalty_factor=0.5)
    assert half.tolist() == pytest.approx([0.0, 0.0, 0.0, -0.125, -0.25, -0.375, -0.5, -0.5])
    assert got.dtype == torch.float32


def test_overlong_penalty_whole_response_as_buffer():
    # L_cache = L_max = 8: the penalty grows from the first token: -|y|/8
    got = overlong_penalty(torch.tensor([0, 2, 8]), max_length=8, buffer_length=8, penalty_factor=2.0)
    assert got.tolist() == pytest.approx([0.0, -0.5, -2.0])


@pytest.mark.parametrize(("buffer_length", "factor"), [(0, 1.0), (21, 1.0), (4, -1.0)])
def test_overlong_penalty_refuses_bad_settings(buffer_length, factor):
    with pytest.raises(ValueError, match="buffer_length|penalty_factor"):
        overlong_penalty(torch.tensor([1]), max_length=20, buffer_length=buffer_length, penalty_factor=factor)


def test_mixed_groups_by_hand():
    values = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.1, 0.1, 1.1])  # groups of 3: solved, unsolved, mixed
    assert mixed_groups(values, 3).tolist() == [False, False, True]
    assert mixed_groups(torch.tensor([True, False, True, True]).float(), 2).tolist() == [True, False]
    with pytest.raises(ValueError, match="group_size=4"):
        mixed_groups(values, 4)
