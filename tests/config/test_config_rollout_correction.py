"""The masked corrections' config (``algorithm.rollout_correction``, ``rollout_ratio_high``/``_low``):
defaults, accepted settings and the errors naming the fields."""

import pytest

from dockrl.config import ConfigError, load_config


def test_defaults_are_off_and_tis_alone_still_loads():
    a = load_config().algorithm
    assert (a.rollout_correction, a.rollout_ratio_high, a.rollout_ratio_low, a.corrects_rollout) == ("none", 2.0, 0.5, False)
    assert load_config(None, ["algorithm.tis_cap=2"]).algorithm.corrects_rollout


@pytest.mark.parametrize(("overrides", "corrects"), [
    (["algorithm.rollout_correction=mis_token"], True),
    (["algorithm.rollout_correction=mis_sequence", "algorithm.rollout_ratio_high=10"], True),
    (["algorithm.rollout_correction=icepop", "algorithm.rollout_ratio_low=0.5", "algorithm.rollout_ratio_high=5"], True),
    (["algorithm.rollout_ratio_high=3"], False),  # no correction: the cap of actor/rollout_frac_beyond_cap
])
def test_accepted(overrides, corrects):
    assert load_config(None, overrides).algorithm.corrects_rollout is corrects


ERRORS = {
    "unknown correction": (["algorithm.rollout_correction=tis"], ["algorithm.rollout_correction: got 'tis'", "'mis_token'"]),
    "high below 1": (["algorithm.rollout_ratio_high=0.9"], ["algorithm.rollout_ratio_high: got 0.9", ">= 1"]),
    "high infinite": (["algorithm.rollout_ratio_high=.inf"], ["algorithm.rollout_ratio_high: got inf"]),
    "low of 0": (["algorithm.rollout_correction=icepop", "algorithm.rollout_ratio_low=0"], ["algorithm.rollout_ratio_low: got 0.0", "(0, 1]"]),
    "low above 1": (["algorithm.rollout_correction=icepop", "algorithm.rollout_ratio_low=1.5"], ["algorithm.rollout_ratio_low: got 1.5"]),
    "low without icepop": (["algorithm.rollout_correction=mis_token", "algorithm.rollout_ratio_low=0.2"],
                           ["algorithm.rollout_ratio_low: got 0.2", "'icepop'", "'mis_token'"]),
    "beside TIS": (["algorithm.rollout_correction=mis_sequence", "algorithm.tis_cap=2"],
                   ["algorithm.rollout_correction: got 'mis_sequence'", "algorithm.tis_cap=2.0", "choose one"]),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_errors_name_the_field(name):
    overrides, fragments = ERRORS[name]
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    for fragment in fragments:
        assert fragment in str(info.value)
