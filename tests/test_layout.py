import re

import pytest
import transformers

from shardrl.config.schema import Config, load_config
from shardrl.plan.layout import GIB, derive_layout, format_layout
from shardrl.plan.memory import format_phase_ledger, phase_ledger

TINY = ("model.tiny={model_type: qwen2, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4, "
        "num_key_value_heads: 2, intermediate_size: 128, vocab_size: 1000, tie_word_embeddings: false}")


def cfg(*overrides):
    return load_config(None, list(overrides))


def raw_cfg(**fields):
    """A Config that skips `validate_config`, to reach the layout's own checks of what config validation also catches."""
    c = Config()
    for key, value in fields.items():
        section, name = key.split("__")
        setattr(getattr(c, section), name, value)
    return c


def test_one_gpu_defaults():
    L = derive_layout(cfg(), 1, 1)
    assert (L.world_size, L.sp, L.dp) == (1, 1, 1)
    assert (L.train_batch_size, L.n, L.prompts_per_rank, L.samples_per_rank) == (8, 4, 8, 32)
    a = L.actor
    assert a.sharding == "FSDP over 1" and a.shard_size == 1 and a.num_replicas == 1
    assert (a.mini_batch_samples_per_rank, a.num_mini_batches, a.num_updates) == (16, 2, 2)
    assert (a.num_micro_batches, a.num_infer_micro_batches) == (16, 32)
    assert L.max_seq_len == 256 + 32 and L.seq_tokens_per_rank == 288
    assert L.critic is None and L.ref is None  # grpo without KL needs neither


def test_two_nodes_of_four():
    L = derive_layout(cfg("data.train_batch_size=64", "rollout.n=8", "actor.ppo_mini_batch_size=16",
                          "actor.ppo_epochs=2", "actor.engine.micro_batch_size_per_gpu=4"), 2, 4)
    assert (L.world_size, L.dp, L.prompts_per_rank, L.samples_per_rank) == (8, 8, 8, 64)
    a = L.actor
    assert a.sharding == "FSDP over 8"
    assert (a.mini_batch_samples_per_rank, a.num_mini_batches, a.ppo_epochs, a.num_updates) == (16, 4, 2, 8)
    assert (a.micro_batch_size_per_gpu, a.num_micro_batches, a.num_infer_micro_batches) == (4, 4, 16)


def test_sequence_parallel_halves_dp_and_sequence():
    L = derive_layout(cfg("actor.engine.ulysses_sequence_parallel_size=2", "data.max_prompt_length=100",
                          "rollout.max_new_tokens=51", "actor.engine.use_dynamic_bsz=true",
                          "actor.engine.max_token_len_per_gpu=76"), 1, 4)
    assert (L.sp, L.dp, L.prompts_per_rank, L.samples_per_rank) == (2, 2, 4, 16)
    assert L.max_seq_len == 151 and L.seq_tokens_per_rank == 76
    assert L.actor.mini_batch_samples_per_rank == 8
    assert L.actor.num_micro_batches is None and L.actor.max_token_len_per_gpu == 76
    assert "dynamic, <= 76 tokens each" in L.actor.micro_batches
    text = re.sub(r" +", " ", format_layout(L))
    assert "tokens of one sequence per rank = ceil(151 / 2 (sp)) = 76" in text
    assert "samples per rank = 8 prompts x 4 (n) / 2 (dp) = 16" in text


def test_hsdp_and_fsdp_size_at_least_world():
    L = derive_layout(cfg("actor.engine.fsdp_size=4"), 2, 4)
    assert L.actor.sharding == "HSDP 2 x 4" and (L.actor.shard_size, L.actor.num_replicas) == (4, 2)
    L = derive_layout(cfg("actor.engine.fsdp_size=16"), 2, 4)  # >= world shards over all, as the mesh does
    assert L.actor.sharding == "FSDP over 8" and L.actor.shard_size == 8


def test_critic_with_gae_and_ref_with_kl():
    L = derive_layout(cfg("algorithm.adv_estimator=gae", "actor.use_kl_loss=true", "data.train_batch_size=6",
                          "rollout.n=2", "actor.ppo_mini_batch_size=3", "critic.ppo_mini_batch_size=6",
                          "critic.engine.micro_batch_size_per_gpu=2", "ref.engine.micro_batch_size_per_gpu=4",
                          "critic.engine.fsdp_size=1"), 1, 3)
    assert (L.dp, L.samples_per_rank) == (3, 4)
    assert (L.actor.mini_batch_samples_per_rank, L.actor.num_mini_batches) == (2, 2)
    c = L.critic
    assert (c.mini_batch_samples_per_rank, c.num_mini_batches, c.num_micro_batches) == (4, 1, 2)
    assert c.sharding == "HSDP 3 x 1"
    assert L.ref.num_infer_micro_batches == 1 and L.ref.ppo_mini_batch_size is None
    text = format_layout(L)
    assert "critic updates per step" in text and "ref forward micro-batches per step" in text
    assert L.to_dict()["critic"]["num_micro_batches"] == 2


@pytest.mark.parametrize("overrides, nnodes, nproc, expected", [
    (["data.train_batch_size=10", "actor.ppo_mini_batch_size=5"], 1, 4,
     ["data.train_batch_size=10 prompts cannot be split over dp=4 data-parallel ranks (world 4 / sp 1); "
      "nearest valid: 8 or 12"]),
    (["actor.engine.ulysses_sequence_parallel_size=3"], 2, 4,
     ["ulysses_sequence_parallel_size=3", "world size 8", "valid sp: [1, 2, 4, 8]"]),
    (["actor.use_kl_loss=true", "ref.engine.ulysses_sequence_parallel_size=2"], 1, 2,
     ["ref.engine.ulysses_sequence_parallel_size=2", "actor.engine.ulysses_sequence_parallel_size=1"]),
    (["actor.ppo_mini_batch_size=1", "rollout.n=2"], 1, 4,
     ["ppo_mini_batch_size=1 prompts x rollout.n=2 = 2 samples", "dp=4", "nearest valid actor.ppo_mini_batch_size: 2"]),
    (["actor.engine.micro_batch_size_per_gpu=3"], 1, 1,
     ["micro_batch_size_per_gpu=3", "per-rank mini-batch of 16 samples", "nearest valid: 2 or 4"]),
    (["actor.engine.micro_batch_size_per_gpu=32"], 1, 2,
     ["micro_batch_size_per_gpu=32 exceeds the per-rank mini-batch of 8 samples", "use at most 8", "[1, 2, 4, 8]"]),
    (["actor.engine.fsdp_size=3"], 2, 4,
     ["actor.engine.fsdp_size=3 does not divide the world size 8", "-1 (shard over all 8)", "[1, 2, 4, 8]"]),
    (["algorithm.adv_estimator=gae", "critic.engine.fsdp_size=3"], 1, 4, ["critic.engine.fsdp_size=3"]),
    (["algorithm.adv_estimator=gae", "critic.engine.micro_batch_size_per_gpu=3"], 1, 1,
     ["critic.engine.micro_batch_size_per_gpu=3", "nearest valid: 2 or 4"]),
    (["actor.engine.use_dynamic_bsz=true", "actor.engine.max_token_len_per_gpu=200"], 1, 1,
     ["max_token_len_per_gpu=200", "288 tokens", "sp=1", "at least 288"]),
    (["actor.engine.use_dynamic_bsz=true", "actor.engine.max_token_len_per_gpu=143",
      "actor.engine.ulysses_sequence_parallel_size=2"], 1, 2, ["sp=2", "at least 144"]),
    ([], 0, 1, ["nnodes=0"]),
])
def test_invalid_layouts_name_the_numbers_and_the_fix(overrides, nnodes, nproc, expected):
    with pytest.raises(ValueError) as e:
        derive_layout(cfg(*overrides), nnodes, nproc)
    for text in expected:
        assert text in str(e.value)


def test_mini_batch_that_does_not_divide_the_batch():
    # config validation rejects this too; the layout checks it for configs built in code
    with pytest.raises(ValueError, match=r"actor.ppo_mini_batch_size=5: must divide data.train_batch_size=12 .*nearest valid: 4 or 6"):
        derive_layout(raw_cfg(data__train_batch_size=12, actor__ppo_mini_batch_size=5), 1, 1)


def tiny_hf_config():
    from shardrl.engine.model import load_hf_config

    c = cfg(TINY)
    return c, load_hf_config(c.model.path, c.model.tiny)


def test_memory_ledger_terms_are_the_arithmetic_of_the_config():
    c, hf = tiny_hf_config()  # 64 hidden, 2 layers, 4 heads (2 KV), MLP 128, vocab 1000
    num_params = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(hf).parameters())
    layout = derive_layout(c, 1, 4)
    ledger = phase_ledger(c, layout, hf)
    assert ledger["num_params"] == num_params
    gen = {i["name"]: i["gib"] * GIB for i in ledger["phases"]["gen"]["items"]}
    update = {i["name"]: i["gib"] * GIB for i in ledger["phases"]["update"]["items"]}
    assert gen["actor params"] == pytest.approx(num_params * 4 / 4)  # fp32 master / 4 shards
    assert gen["actor optimizer state"] == pytest.approx(2 * num_params * 4 / 4)
    assert gen["rollout weights"] == pytest.approx(num_params * 2)
    slots, positions = layout.samples_per_rank, 384  # 256 + 32 tokens -> the next multiple of 128
    assert gen["KV cache"] == pytest.approx(slots * positions * 2 * 2 * 2 * 16 * 2)
    assert update["actor grads"] == pytest.approx(num_params)
    # per token and layer: norms 2 x 6 B x 64, attention 2 B x (4 x 64 + 2 x 32), MLP 4 x 2 B x 128
    tokens = 288  # one sample per micro-batch
    assert update["activations"] == pytest.approx(tokens * 2 * (2 * 6 * 64 + 2 * (4 * 64 + 2 * 32) + 8 * 128))
    for phase in ledger["phases"].values():
        assert phase["total_gib"] == pytest.approx(sum(i["gib"] for i in phase["items"]))
    assert ledger["peak_gib"] == max(p["total_gib"] for p in ledger["phases"].values())
    assert "KV cache" in format_phase_ledger(ledger)
    budget = cfg(TINY, "rollout.fast.kv_cache_tokens=1000")  # a cache budget below slots x positions is what it holds
    kv = next(i for i in phase_ledger(budget, derive_layout(budget, 1, 4), hf)["phases"]["gen"]["items"]
              if i["name"] == "KV cache")
    assert kv["gib"] * GIB == pytest.approx(1000 * 2 * 2 * 2 * 16 * 2) and "kv_cache_tokens" in kv["how"]


def test_memory_ledger_offload_and_checkpointing():
    c, hf = tiny_hf_config()
    base = phase_ledger(c, derive_layout(c, 1, 1), hf)
    c2 = cfg(TINY, "actor.engine.offload_params=true", "actor.engine.offload_optimizer=true",
             "model.gradient_checkpointing=true")
    ledger = phase_ledger(c2, derive_layout(c2, 1, 1), hf)
    gen = {i["name"]: i for i in ledger["phases"]["gen"]["items"]}
    update = {i["name"]: i for i in ledger["phases"]["update"]["items"]}
    assert gen["actor params"]["gib"] == gen["actor optimizer state"]["gib"] == update["actor grads"]["gib"] == 0
    assert "offload" in gen["actor params"]["how"]
    # offloaded params keep their optimizer state on the CPU, where their step runs
    assert not any(i["name"] == "actor optimizer state" and i["gib"] > 0 for i in ledger["phases"]["update"]["items"])
    c3 = cfg(TINY, "actor.engine.offload_optimizer=true")
    update3 = {i["name"]: i for i in phase_ledger(c3, derive_layout(c3, 1, 1), hf)["phases"]["update"]["items"]
               if not i["resident"]}
    assert update3["actor optimizer state"]["gib"] * GIB == pytest.approx(2 * ledger["num_params"] * 4)  # back for the step
    act = update["activations"]["gib"] * GIB
    per_layer = 2 * 6 * 64 + 2 * (4 * 64 + 2 * 32) + 8 * 128
    assert act == pytest.approx(288 * (2 * 2 * 64 + per_layer))  # layer inputs kept, one layer recomputed
    assert act < {i["name"]: i["gib"] for i in base["phases"]["update"]["items"]}["activations"] * GIB


def test_rollouts_per_step_is_batch_times_n():
    L = derive_layout(cfg("data.train_batch_size=12", "rollout.n=5", "actor.ppo_mini_batch_size=6"), 1, 2)
    assert L.rollouts_per_step == 60 and L.to_dict()["rollouts_per_step"] == 60
    assert "rollouts per step = 12 (train_batch_size) x 5 (n) = 60" in re.sub(r" +", " ", format_layout(L))


def _hf(heads: int, kv_heads: int):
    return transformers.Qwen2Config(hidden_size=8 * heads, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                    num_hidden_layers=1, intermediate_size=16, vocab_size=100)


@pytest.mark.parametrize("heads, kv_heads, sp, world, nearest", [
    (6, 2, 4, 8, "2"),          # 4 does not divide 6 heads; valid sp on 8 ranks: 1, 2 (8 fails too)
    (12, 3, 2, 8, "1"),         # 12 heads split over 2, but 3 KV heads and 2 divide neither way (nor 4 or 8)
    (12, 4, 8, 8, "4"),         # 8 does not divide 12 heads; 2 and 4 do, and divide the 4 KV heads
    (12, 6, 4, 4, "2"),         # 6 KV heads vs 4
])
def test_heads_that_sp_cannot_split_name_the_full_key_and_the_nearest_sp(heads, kv_heads, sp, world, nearest):
    from shardrl.engine.ulysses import check_heads
    from shardrl.plan.layout import check_model_heads

    L = derive_layout(cfg(f"actor.engine.ulysses_sequence_parallel_size={sp}"), 1, world)
    with pytest.raises(ValueError) as info:
        check_heads(heads, kv_heads, sp)  # the engine refuses it too: plan and training agree
    with pytest.raises(ValueError) as info:
        check_model_heads(L, _hf(heads, kv_heads))
    text = str(info.value)
    assert text.startswith(f"actor.engine.ulysses_sequence_parallel_size={sp} does not fit the model's {heads} "
                           f"attention heads and {kv_heads} KV heads")
    assert text.endswith(f"nearest valid sp on a world of {world}: {nearest}")


def test_heads_that_fit_pass():
    from shardrl.plan.layout import check_model_heads

    for heads, kv_heads, sp in ((12, 2, 4), (12, 4, 2), (8, 8, 8), (4, 1, 2)):
        check_model_heads(derive_layout(cfg(f"actor.engine.ulysses_sequence_parallel_size={sp}"), 1, 8),
                          _hf(heads, kv_heads))


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # an untied lm_head, one tied to the embedding
def test_the_plans_critic_optimizer_state_counts_what_the_critic_engine_trains(family):
    """The critic never reads its lm_head: the engine does not train an untied one (no AdamW state a resumed
    optimizer would expect), and the plan counts the same parameters."""
    from shardrl.engine.model import load_hf_config
    from shardrl.testing import TINY_MODELS, run_distributed

    engine_trained = run_distributed(_critic_trained_count, 1, family)
    tiny = ", ".join(f"{k}: {str(v).lower()}" for k, v in TINY_MODELS[family].items())
    c = cfg(f"model.tiny={{{tiny}}}", "algorithm.adv_estimator=gae")
    hf = load_hf_config(c.model.path, c.model.tiny)
    ledger = phase_ledger(c, derive_layout(c, 1, 1), hf)
    gen = {i["name"]: i["gib"] * GIB for i in ledger["phases"]["gen"]["items"]}
    assert gen["critic optimizer state"] == pytest.approx(2 * engine_trained * 4)
    head = TINY_MODELS[family]["vocab_size"] * TINY_MODELS[family]["hidden_size"]
    untied = not TINY_MODELS[family]["tie_word_embeddings"]
    assert engine_trained == ledger["num_params"] + 33 - (head if untied else 0)  # + the value head (32 + 1)


def _critic_trained_count(family: str) -> int:
    from shardrl.config.schema import EngineConfig, ModelConfig, OptimConfig
    from shardrl.engine import build_engine
    from shardrl.testing import TINY_MODELS

    engine = build_engine(ModelConfig(tiny=TINY_MODELS[family]), EngineConfig(param_dtype="float32"),
                          OptimConfig(lr=1e-3), head="value")
    return sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"])
