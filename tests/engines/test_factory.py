"""The rollout engines' registry (``dockrl.engines.factory.ROLLOUT_ENGINES``): its names are the config's."""

from __future__ import annotations

import typing

from dockrl.config import RolloutConfig
from dockrl.engines.factory import ROLLOUT_ENGINES


def test_the_literal_is_the_registry_and_auto():
    assert typing.get_args(typing.get_type_hints(RolloutConfig)["engine"]) == ("auto", *ROLLOUT_ENGINES)
