"""The RL trainer: `RLTrainer` runs the step loop of DESIGN.md; `train_main` is `shardrl train`."""
