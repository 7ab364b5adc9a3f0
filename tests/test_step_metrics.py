"""Per-step metrics users of verl expect: model FLOPs (checked against a hand count and torch's FLOP
counter), throughput, response and prompt lengths over all ranks, the sampling policy's entropy, and
sample generations per validation (file and console)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from shardrl.testing import TINY_MODELS, run_distributed, small_demo_run
from shardrl.plan.perf import (ModelShape, forward_flops, model_shape, rl_step_flops, throughput_metrics,
                                  H200_BF16_MEASURED_TFLOPS, H200_BF16_SPEC_TFLOPS)


def _hf_config(name: str):
    import transformers

    return _gpt2_config() if name == "gpt2" else transformers.AutoConfig.for_model(**TINY_MODELS[name])


def _gpt2_config():
    import transformers

    return transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=101, bos_token_id=0, eos_token_id=0)


def test_model_shape_counts_the_matmul_parameters_by_hand():
    # qwen2 tiny: hidden 32, 4 heads of 8, 2 kv heads, MLP 64, 2 layers, vocab 101
    attention = 32 * 32 + 32 * 16 + 32 * 16 + 32 * 32  # q, k, v (2 kv heads x 8), o
    mlp = 3 * 32 * 64  # gate, up, down
    assert model_shape(_hf_config("qwen2")) == ModelShape(2 * (attention + mlp) + 32 * 101, 2, 32, 32 * 101)
    assert model_shape(_hf_config("llama")).num_params == 2 * (attention + mlp) + 32 * 101  # tied head: a matmul
    assert model_shape(_hf_config("qwen2"), head_outputs=1).num_params == 2 * (attention + mlp) + 32  # value head
    # GPT-2: no GQA, a two-matrix MLP of 4 x hidden
    gpt2 = _gpt2_config()
    assert model_shape(gpt2) == ModelShape(2 * (4 * 32 * 32 + 2 * 32 * 128) + 32 * 101, 2, 32, 32 * 101)
    # MoE: the router (hidden x 8 experts) and the routed experts (top 2 of 8) of 3 matrices each
    moe = SimpleNamespace(model_type="mixtral", hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=4, intermediate_size=64, num_experts_per_tok=2, num_local_experts=8,
                          vocab_size=10)
    assert model_shape(moe).num_params == 4 * 32 * 32 + 32 * 8 + 2 * 3 * 32 * 64 + 32 * 10
    # Qwen2-1.5B: with its q/k/v biases and RMSNorm weights this is its published 1,543,714,304 parameters
    qwen15 = SimpleNamespace(model_type="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                             num_key_value_heads=2, intermediate_size=8960, vocab_size=151936)
    biases, norms = 28 * (1536 + 256 + 256), 28 * 2 * 1536 + 1536
    assert model_shape(qwen15).num_params + biases + norms == 1_543_714_304
    with pytest.raises(ValueError, match="hidden_size"):
        model_shape(SimpleNamespace(model_type="mystery"))


def test_forward_flops_by_hand_and_per_phase():
    shape = ModelShape(num_params=10, num_layers=2, attn_dim=4)
    lens = torch.tensor([3, 5])
    # 2 N per token; attention 4 L d (i + 1) per token i: sum_i (i + 1) = 6 and 15
    one = 2 * 10 * 8 + 4 * 2 * 4 * (6 + 15)
    assert forward_flops(shape, lens) == one == 832
    # generation, old log-probs and ref forwards, 2 epochs of training (3 forwards each)
    assert rl_step_flops(lens, shape, 2, 2) == one * (1 + 2 + 6)
    critic = ModelShape(num_params=7, num_layers=1, attn_dim=4)
    assert rl_step_flops(lens, shape, 1, 1, critic, 3) == one * 5 + forward_flops(critic, lens) * 10
    # the head (4 of the 10 parameters) only where a response token is scored: 1 and 2 of the 8 tokens
    headed = ModelShape(num_params=10, num_layers=2, attn_dim=4, head_params=4)
    scored = 2 * 6 * 8 + 2 * 4 * 3 + 4 * 2 * 4 * (6 + 15)
    assert forward_flops(headed, lens, torch.tensor([1, 2])) == scored == 792
    assert forward_flops(headed, lens) == one  # every token scored: as before
    assert rl_step_flops(lens, headed, 1, 1, response_lens=torch.tensor([1, 2])) == scored * 5


@pytest.mark.parametrize("name", ["qwen2", "llama", "gpt2"])
def test_forward_flops_match_torch_flop_counter(name):
    # torch counts every matmul of a real forward; the eager attention computes the whole s x s score
    # matrix (4 L d s^2), where the model FLOPs count the causal half (2 L d s (s + 1))
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    config = _hf_config(name)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    s = 11
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(torch.randint(0, 101, (1, s)))
    shape = model_shape(config)
    causal = forward_flops(shape, torch.tensor([s]))
    full_attention = 4 * shape.num_layers * shape.attn_dim * s * s
    assert counter.get_total_flops() == causal - 2 * shape.num_layers * shape.attn_dim * s * (s + 1) + full_attention


def test_throughput_and_mfu_from_the_reduced_metrics():
    reduced = {"timing/step_s": 2.0, "perf/total_num_tokens": 1000.0, "perf/step_tflop": 3.152}
    out = throughput_metrics(reduced, num_gpus=2, on_cuda=True)
    assert out["perf/tokens_per_s_per_gpu"] == 250.0
    assert out["perf/tflop_per_s_per_gpu"] == pytest.approx(0.788)
    assert out["perf/mfu_measured"] == pytest.approx(0.788 / H200_BF16_MEASURED_TFLOPS)
    assert out["perf/mfu_spec"] == pytest.approx(0.788 / H200_BF16_SPEC_TFLOPS)
    assert set(throughput_metrics(reduced, 2, on_cuda=False)) == {"perf/tokens_per_s_per_gpu",
                                                                   "perf/tflop_per_s_per_gpu"}


def test_log_generations_writes_lines_and_the_console(tmp_path, capsys):
    from shardrl.trainer.logger import MetricsLogger

    logger = MetricsLogger(tmp_path, ["jsonl"], total_steps=4)
    logger.log_generations(2, [])  # nothing to show (log_val_generations=0): no file
    assert not (tmp_path / "generations.jsonl").exists()
    sample = {"prompt": "1+2=", "response": "3", "reward": 1.0, "ground_truth": "3"}
    logger.log_generations(2, [sample])
    logger.log_generations(4, [dict(sample, response="x" * 1000, reward=0.0)])
    logger.close()
    lines = [json.loads(line) for line in open(tmp_path / "generations.jsonl")]
    assert lines[0] == {"step": 2, **sample} and lines[1]["step"] == 4 and len(lines[1]["response"]) == 1000
    out = capsys.readouterr().out
    assert "validation generations at step 2" in out and "'1+2='" in out and "1000 characters" in out
    MetricsLogger(tmp_path, ["jsonl"], total_steps=4, start_step=2).close()  # resumed at step 2
    assert [json.loads(line)["step"] for line in open(tmp_path / "generations.jsonl")] == [2]
    MetricsLogger(tmp_path, ["jsonl"], total_steps=4).close()  # a fresh run
    assert not (tmp_path / "generations.jsonl").exists()


# ---------------------------------------------------------------- the trainer, 2 processes

def _run_and_record(overrides: list[str]) -> dict:
    """A training run; every rank's step batches and the entropies its old-log-prob passes returned."""
    import torch.distributed as dist

    from shardrl.engine.base import Engine
    from shardrl.launch.rank import run
    from shardrl.trainer.rl import LocalBatches, RLTrainer

    batches, entropies, shapes = [], [], []
    generate, infer, init = LocalBatches.generate, Engine.infer_batch, RLTrainer.__init__

    def recording_generate(self, items, sampling):
        batch = generate(self, items, sampling)
        if sampling.n > 1:  # training, not validation (greedy, n=1)
            batches.append({k: batch[k].clone() for k in ("attention_mask", "response_mask", "loss_mask")})
        return batch

    def recording_infer(self, batch, *args, **kwargs):
        out = infer(self, batch, *args, **kwargs)
        if kwargs.get("with_entropy"):
            entropies.append(out["entropy"].cpu())
        return out

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        shapes.append(self.flop_shapes)

    LocalBatches.generate, Engine.infer_batch, RLTrainer.__init__ = recording_generate, recording_infer, recording_init
    try:
        run_dir = run(None, overrides)
    finally:
        LocalBatches.generate, Engine.infer_batch, RLTrainer.__init__ = generate, infer, init
    mine = {"batches": batches, "entropies": entropies}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"ranks": every, "run_dir": run_dir, "shapes": shapes[0]}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from shardrl.trainer.demo import prepare_demo_assets

    return prepare_demo_assets(tmp_path_factory.mktemp("demo") / "assets", warmup_steps=5)


@pytest.mark.multiproc
def test_two_process_run_logs_global_lengths_throughput_entropy_and_generations(assets, tmp_path, capfd):
    from transformers import AutoConfig

    # a reward that differs between responses, so a reward shown beside the wrong response would be caught
    reward_file = tmp_path / "length_reward.py"
    reward_file.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                           "    return float(len(solution_str)) + (ground_truth == solution_str)\n")
    # 2 steps, validation after the second, all of rank 0's validation samples shown. Seed 2: in step 1
    # rank 1 holds the longest response and rank 0 the shortest (a rank-local extreme would be caught)
    out = run_distributed(_run_and_record, 2, small_demo_run(
        assets, tmp_path / "run", "trainer.logger=[jsonl]", "trainer.total_steps=2", "trainer.val_freq=2",
        "trainer.log_val_generations=100", "rollout.max_new_tokens=6", "actor.ppo_epochs=2", "rollout.seed=2",
        f"reward.function_path={reward_file}", "reward.function_name=score"))
    records = [json.loads(line) for line in open(out["run_dir"] / "metrics.jsonl")]
    policy, critic = out["shapes"]
    config = AutoConfig.from_pretrained(assets / "model")
    assert critic is None and policy == model_shape(config)
    for step, r in enumerate(records):
        per_rank = [rank["batches"][step] for rank in out["ranks"]]
        lengths = [b["response_mask"].sum(-1) for b in per_rank]
        seq_lens = torch.cat([b["attention_mask"].sum(-1) for b in per_rank])
        everything = torch.cat(lengths)
        assert r["response/length_max"] == float(everything.max())
        assert r["response/length_min"] == float(everything.min())
        assert r["response/length_mean"] == pytest.approx(float(everything.float().mean()))
        assert r["prompt/length_mean"] == pytest.approx(float((seq_lens.float().mean() - everything.float().mean())))
        assert r["perf/total_num_tokens"] == float(seq_lens.sum())
        # generation + old log-probs (no ref: no KL) + 2 epochs of training
        # the head at the response tokens only
        assert r["perf/step_tflop"] == pytest.approx(forward_flops(policy, seq_lens, everything) * (1 + 1 + 6) / 1e12,
                                                     rel=1e-9)
        assert forward_flops(policy, seq_lens, everything) < forward_flops(policy, seq_lens)
        assert r["perf/tokens_per_s_per_gpu"] == pytest.approx(r["perf/total_num_tokens"] / r["timing/step_s"] / 2)
        assert r["perf/tflop_per_s_per_gpu"] == pytest.approx(r["perf/step_tflop"] / r["timing/step_s"] / 2)
        assert not any(k.startswith("memory/") or k.startswith("perf/mfu") for k in r)  # GPU only
        # the token-mean entropy of the sampling policy over both ranks' response tokens
        ent = [(rank["entropies"][step] * b["loss_mask"]).sum() for rank, b in zip(out["ranks"], per_rank)]
        num = sum(float(b["loss_mask"].sum()) for b in per_rank)
        assert r["actor/entropy"] == pytest.approx(float(sum(ent)) / num, rel=1e-6)
        assert 0 < r["actor/entropy"] < math.log(config.vocab_size)
        assert "actor/entropy_loss" not in r  # entropy_coeff = 0: no loss term

    first = [rank["batches"][0]["response_mask"].sum(-1) for rank in out["ranks"]]
    assert first[1].max() > first[0].max() and first[0].min() < first[1].min(), \
        "the ranks' extremes no longer differ in step 1: pick another rollout.seed to keep this test sharp"

    # rank 0 holds validation prompts 0, 2, 4, ... of the 55; each line is one of them with its answer
    rows = [json.loads(line) for line in open(assets / "val.jsonl")][0::2]
    lines = [json.loads(line) for line in open(out["run_dir"] / "generations.jsonl")]
    assert [(g["step"], g["prompt"], g["ground_truth"]) for g in lines] == [(2, x["prompt"], x["ground_truth"])
                                                                           for x in rows]
    assert all(g["reward"] == len(g["response"]) + (g["ground_truth"] == g["response"]) for g in lines)
    assert len({g["reward"] for g in lines}) > 1
    console = capfd.readouterr()
    assert "validation generations at step 2" in console.out + console.err
    assert f"  prompt:   {rows[1]['prompt']!r}" in console.out + console.err



def _one_gpu_run(overrides: list[str]) -> list[dict]:
    from shardrl.launch.rank import run

    run_dir = run(None, overrides)
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


@pytest.mark.cuda
@pytest.mark.multiproc
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_run_logs_peak_memory_per_phase_and_mfu(assets, tmp_path):
    records = run_distributed(_one_gpu_run, 1, small_demo_run(
        assets, tmp_path / "gpu", "trainer.logger=[jsonl]", "trainer.total_steps=2"))
    for r in records:
        for phase in ("gen", "prep", "update"):
            # the actor's fp32 weights alone stay allocated through every phase
            assert 0 < r[f"memory/{phase}_peak_gib"] < 20, phase
        assert r["perf/mfu_measured"] == pytest.approx(r["perf/tflop_per_s_per_gpu"] / H200_BF16_MEASURED_TFLOPS)
        assert r["perf/mfu_spec"] == pytest.approx(r["perf/tflop_per_s_per_gpu"] / H200_BF16_SPEC_TFLOPS)
        assert 0 < r["perf/mfu_spec"] < r["perf/mfu_measured"] < 1


def test_a_weight_sync_before_the_step_is_not_counted_in_it(assets, tmp_path):
    """Validation before training syncs the weights; step 1 generates with them and syncs nothing, so its
    update_weights time is 0 (it was the validation's sync, and verl's timing_s/gen, which subtracts it from the
    step's generation time, went negative); step 2 syncs after step 1's update."""
    from shardrl.launch.rank import run

    run(None, small_demo_run(assets, tmp_path / "run", "trainer.logger=[jsonl]", "trainer.total_steps=2",
                             "trainer.val_before_train=true", "rollout.max_new_tokens=4"))
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    steps = [r for r in records if "timing/gen_s" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert steps[0]["timing/update_weights_s"] == 0.0
    assert 0.0 < steps[1]["timing/update_weights_s"] < steps[1]["timing/gen_s"]
