"""The ``sft`` section's rules: each error names the field, the value and the rule."""

from __future__ import annotations

import pytest

from dockrl.config import ConfigError, SFTConfig, load_config


@pytest.mark.parametrize(("override", "says"), [
    ("sft.epochs=0", "sft.epochs: got 0; expected a positive integer"),
    ("sft.epochs=1001", "sft.epochs: got 1001; expected at most 1000 passes"),
    ("sft.batch_size=0", "sft.batch_size: got 0; expected a positive integer"),
    ("sft.max_length=-1", "sft.max_length: got -1; expected a positive integer"),
    ("sft.max_length=2000000", "sft.max_length: got 2000000; expected at most 1048576 tokens"),
    ("sft.format=chat", "sft.format: got 'chat'; expected one of 'auto', 'messages', 'prompt_completion', 'gsm8k'"),
    ("sft.messages_field= ", "sft.messages_field: got ' '; expected a field name"),
    ("sft.completion_field=prompt", "sft.completion_field: got 'prompt'; expected a field other than sft.prompt_field"),
])
def test_a_bad_sft_value_names_its_field(override, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [override])


def test_a_field_name_of_another_format_is_refused():
    with pytest.raises(ConfigError, match=r"sft.messages_field: got 'turns'; is set but sft.format='gsm8k' does not read it"):
        load_config(None, ["sft.format=gsm8k", "sft.messages_field=turns"])
    cfg = load_config(None, ["sft.format=messages", "sft.messages_field=turns", "sft.epochs=3"])
    assert cfg.sft == SFTConfig(format="messages", messages_field="turns", epochs=3)
