"""Environments of multi-turn rollouts: the interface (``base``), the sandbox that runs model
code, and the built-in environments."""
