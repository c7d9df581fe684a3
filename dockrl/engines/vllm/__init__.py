"""The vLLM rollout engine (``engine.py``): its set-up (``setup.py``) and LoRA adapters (``lora.py``).
Whether a vLLM build can run here is ``dockrl.process.vllm_support`` (the config's ``auto`` asks it)."""
