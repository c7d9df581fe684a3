"""The ground floor every process stands on: the driver's lifeline (``lifeline.py``), the process
environment (``env.py``), seeding (``seeding.py``), memory readings (``memory.py``) and whether vLLM can run here
(``vllm_support.py``, found without importing it)."""
