"""Resharding between the training layout (TP, PP, DP) and the rollout layout (TP') on the same devices.

* ``device``: device kinds (cpu, cuda, npu), their collective backends, process-group init.
* ``layout``: the frozen, validated parallel layout (the config's ``parallel`` section) and the model sizes it shards.
* ``spec``: which dim of each HF weight is split for TP and which PP stage holds it; cuts a
  full HF state dict into one rank's training shard.
* ``cpu_device``: the scoped CPU device layer megatron-core needs on CPU (gloo).
* ``allgather_swap``: the hybrid actor's weight sync (docs/design.md §3): host swap of optimizer
  state, gradients and training weights; bucketed all-gather into inference-layout buckets.
"""
