"""Comparing token sequences."""

from forerun.protocol.token_sequences import common_prefix


def test_common_prefix_counts_the_shared_leading_tokens():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2 == common_prefix((1, 2, 3), [1, 2])
    assert common_prefix([7], [8]) == 0
    assert common_prefix([], [1]) == 0 == common_prefix([], [])
    assert common_prefix([4, 4, 4], [4, 4, 4]) == 3
