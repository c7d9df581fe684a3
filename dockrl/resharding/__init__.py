"""Resharding between the training layout (TP, PP, DP) and the rollout layout (TP') on the same devices.

* ``spec``: which dim of each HF weight is split for TP and which PP stage holds it; cuts a
  full HF state dict into one rank's training shard.
* ``buckets``: the all-gather buckets of one weight sync, in inference layout.
* ``host_swap``: training state (optimizer, gradients, weights) swapped to host memory and back.
* ``allgather_swap``: the hybrid actor's weight sync (docs/design.md §3): host swap of optimizer
  state, gradients and training weights; bucketed all-gather into inference-layout buckets.
* ``sync_results``: what a sync leaves on each rank: its report and the inference weights.

The layouts themselves, the process groups and the device kinds are ``dockrl.parallel``'s.
"""
