"""The megatron-core training engine (``engine.py``): the model (``model.py``), the conversion from and to
HF weights (``convert.py``) and its state in a checkpoint (``state.py``)."""
