"""Training and rollout engines behind two small interfaces (`rollout_engine.RolloutEngine`, `train_engine.TrainEngine`)."""
