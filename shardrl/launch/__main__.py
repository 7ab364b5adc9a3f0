"""`python -m shardrl.launch [--trainer NAME] [CONFIG | --no-config] key=value ...`: one rank, as torchrun starts it
(`torchrun --nproc-per-node 8 -m shardrl.launch run.yaml ...` on a cluster; NAME: train (default), sft, dpo, rm)."""

import sys

from shardrl.launch.rank import rank_main

if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1:]))
