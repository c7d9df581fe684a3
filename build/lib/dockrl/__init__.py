"""dockrl: RL post-training of LLMs (GRPO) as a distributed dataflow through a transfer dock."""

__version__ = "0.1.0"
