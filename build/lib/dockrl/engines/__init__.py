"""Training and rollout engines behind small protocols (HF/torch reference engines first)."""
