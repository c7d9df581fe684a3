"""The vLLM rollout engine (``engine.py``): its set-up (``setup.py``), LoRA adapters (``lora.py``) and
whether a vLLM build can run here (``support.py``)."""
