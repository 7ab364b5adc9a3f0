"""Launching a run, for every trainer: the `shardrl train|sft|dpo|rm` command (`command`), torchrun's spawn
(`torchrun`), stop signals and exit codes (`signals`), and the one per-rank entry (`rank`,
`python -m shardrl.launch`)."""
