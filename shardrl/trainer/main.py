"""`python -m shardrl.trainer.main [CONFIG | --no-config] key=value ...`: the RL trainer's rank as torchrun starts
it, kept for cluster scripts that name this module. The entry of every trainer is `python -m shardrl.launch`
(`--trainer NAME`, default train): this module only hands its arguments there. It imports nothing from the
launcher, which sits above the trainer (the module runs by name)."""

import runpy

if __name__ == "__main__":
    runpy.run_module("shardrl.launch", run_name="__main__", alter_sys=True)
