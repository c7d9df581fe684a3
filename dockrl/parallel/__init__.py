"""Where a process sits in the run's parallel layout and on which device.

* ``layout``: the frozen, validated parallel layout (the config's ``parallel`` section: TP, PP, DP
  for training, TP' for the rollout) and the model sizes it shards.
* ``ranks``: a process's ranks and the TP/PP/DP process groups it joins.
* ``device``: device kinds (cpu, cuda, npu), their collective backends, process-group init.
* ``cpu_device``: the scoped CPU device layer megatron-core needs on CPU (gloo).
"""
