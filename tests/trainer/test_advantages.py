import math

import pytest

from prefixgym.trainer.advantages import group_advantages


def test_mean_centred():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert adv.advantages_G == [0.5, -0.5, -0.5, 0.5]
    assert not adv.skipped


def test_std_normalised():
    adv = group_advantages([3.0, 1.0], normalize_std=True)
    assert adv.advantages_G == pytest.approx([1.0, -1.0], abs=1e-5)


def test_equal_rewards_are_skipped():
    adv = group_advantages([0.7, 0.7, 0.7])
    assert adv.skipped and adv.advantages_G == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("bad", [[], [math.nan, 1.0], [math.inf, 0.0]])
def test_bad_rewards(bad):
    with pytest.raises(ValueError):
        group_advantages(bad)
