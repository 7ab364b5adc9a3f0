"""Engine start-up: time and peak host memory per rank to build an FSDP2 engine from a model folder, the old
way (`model.load_weights=rank0`: rank 0 builds the whole fp32 model on its CPU and broadcasts it) against
sharded loading (`sharded`: meta init, each rank reads only its slices of the safetensors files).

Shapes: Qwen2-1.5B (hidden 1536, 28 layers, 12 heads, 2 KV heads, MLP 8960, vocab 151936, tied head) and
Qwen2-7B (hidden 3584, 28 layers, 28 heads, 4 KV heads, MLP 18944, vocab 152064). Their random bf16 weights
are written first under --root (tensor by tensor: the writer never holds the whole model), so both modes
read files that sit in the page cache. fp32 master weights, bf16 compute, an AdamW (state made lazily).

    python bench/startup.py --cases 1.5b:1,1.5b:2,7b:2 [--modes rank0,sharded] [--out results.jsonl]

Prints one JSON line per (case, mode): build seconds (rank max), peak host RSS per rank (ru_maxrss, GiB,
the process's whole life: imports and CUDA context included, `rss_before_gib` is that part), GPU memory.
Each (case, mode) runs in fresh processes, so one mode's peak does not hide in the other's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

SHAPES = {
    "1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096,
                 tie_word_embeddings=True, rope_theta=1e6),
    "7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=4096,
               tie_word_embeddings=False, rope_theta=1e6),
    # a CPU smoke test of this script
    "tiny": dict(model_type="qwen2", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False),
}
SHARD_BYTES = 4 * 2**30


def write_random_folder(folder: Path, shape: dict) -> float:
    """A HF model folder of random bf16 weights (sharded safetensors + index + config); seconds taken.
    Skipped when the folder is complete already."""
    import transformers
    from safetensors.torch import save_file

    if (folder / "model.safetensors.index.json").is_file():
        return 0.0
    t0 = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    config = transformers.AutoConfig.for_model(**shape)
    config.dtype = torch.bfloat16
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    weight_map, pending, size, files = {}, {}, 0, 0

    def flush():
        nonlocal pending, size, files
        name = f"model-{files:05d}.safetensors"
        save_file(pending, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(pending, name))
        pending, size, files = {}, 0, files + 1

    for name, p in model.named_parameters():  # a tied head once, as save_pretrained writes it
        t = torch.empty(p.shape, dtype=torch.bfloat16)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.uniform_(-0.02, 0.02, generator=g)
        pending[name] = t
        size += t.numel() * 2
        if size >= SHARD_BYTES:
            flush()
    if pending:
        flush()
    index = {"metadata": {"total_size": sum((folder / f).stat().st_size for f in set(weight_map.values()))},
             "weight_map": weight_map}
    config.architectures = ["Qwen2ForCausalLM"]
    config.save_pretrained(folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))  # last: marks it complete
    return time.perf_counter() - t0


def _gib_rss() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def build_once(folder: str, mode: str) -> list[dict]:
    import torch.distributed as dist

    from shardrl.config.schema import EngineConfig, ModelConfig, OptimConfig
    from shardrl.engine import build_engine

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))  # the launcher's 1 is for tests
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    before = _gib_rss()
    t0 = time.perf_counter()
    engine = build_engine(ModelConfig(path=folder, load_weights=mode), EngineConfig(param_dtype="bfloat16"),
                          OptimConfig(lr=1e-5))
    if cuda:
        torch.cuda.synchronize()
    local_s = time.perf_counter() - t0
    dist.barrier()
    total_s = time.perf_counter() - t0
    mine = dict(rank=dist.get_rank(), build_s=round(local_s, 2), build_all_s=round(total_s, 2),
                rss_before_gib=round(before, 2), peak_rss_gib=round(_gib_rss(), 2),
                gpu_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else 0.0,
                sharded_load=engine.sharded_load,
                local_params=sum(getattr(p, "_local_tensor", p).numel() for p in engine.module.parameters()))
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return ranks


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="1.5b:1,1.5b:2,7b:2", help="shape:world, comma-separated")
    parser.add_argument("--modes", default="rank0,sharded")
    parser.add_argument("--root", default="/tmp/shardrl_startup")
    parser.add_argument("--out", default=None, help="append the JSON lines to this file")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from shardrl.testing import run_distributed

    torch.set_num_threads(min(16, os.cpu_count() or 1))
    results = []
    for case in args.cases.split(","):
        shape, world = case.split(":")
        folder = Path(args.root) / shape
        written = write_random_folder(folder, SHAPES[shape])
        if written:
            print(json.dumps({"wrote": str(folder), "seconds": round(written, 1)}), flush=True)
        for mode in args.modes.split(","):
            try:
                ranks = run_distributed(build_once, int(world), str(folder), mode)
                res = dict(shape=shape, world=int(world), mode=mode,
                           build_s=max(r["build_all_s"] for r in ranks),
                           peak_rss_gib=[r["peak_rss_gib"] for r in ranks],
                           rss_before_gib=[r["rss_before_gib"] for r in ranks],
                           gpu_gib=[r["gpu_gib"] for r in ranks], local_params=[r["local_params"] for r in ranks],
                           sharded_load=ranks[0]["sharded_load"])
            except Exception as e:  # a case that fails is reported, the others still run
                res = dict(shape=shape, world=int(world), mode=mode, error=f"{type(e).__name__}: {str(e)[:300]}")
            print(json.dumps(res), flush=True)
            results.append(res)
    from bench import append_jsonl

    append_jsonl(args.out, results)


if __name__ == "__main__":
    main()
