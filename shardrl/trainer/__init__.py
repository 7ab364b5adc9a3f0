"""The trainers: one `Trainer` base (`base`) whose `fit` every trainer shares; `RLTrainer` (`rl`), the offline
trainers (`offline`: sft, dpo, rm). The launcher (`shardrl.launch`) starts them by their `config.registry` names."""
