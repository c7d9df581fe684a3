"""Supervised fine-tuning on the actor's training engine, without stages or a dock (docs/sft.md).

``sft(cfg)`` (``loop``) runs ``dockrl sft``; ``load_examples`` (``data``) reads chat-format data into
``Example`` rows whose ``loss_mask`` is 1 on the assistant's tokens.
"""

from dockrl.sft.data import Example, load_examples
from dockrl.sft.loop import sft

__all__ = ["Example", "load_examples", "sft"]
