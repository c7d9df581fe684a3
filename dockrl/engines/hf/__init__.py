"""The Hugging Face engines: loading (``load.py``), log-probs (``logprobs.py``), LoRA (``lora.py``), the
rollout engine (``rollout.py``) and the training engine (``train.py``)."""
