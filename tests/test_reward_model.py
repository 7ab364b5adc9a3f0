"""A reward model (a sequence classifier) scored through the engine's forward equals the plain HF
model's score, packed or padded, on 1 and 2 processes; the trainer uses it when reward.model_path is set."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from shardrl.config.schema import EngineConfig, ModelConfig
from shardrl.engine import build_engine
from shardrl.testing import TINY_MODELS, random_batch, run_distributed

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    kw = {k: v for k, v in TINY_MODELS["qwen2"].items() if k != "model_type"}
    config = transformers.Qwen2Config(num_labels=1, pad_token_id=0, **kw)
    torch.manual_seed(3)
    model = transformers.Qwen2ForSequenceClassification(config)
    path = tmp_path_factory.mktemp("rm") / "rm"
    model.save_pretrained(path)
    return path


def engine_scores(path: str, remove_padding: bool):
    engine = build_engine(ModelConfig(path=path, use_remove_padding=remove_padding),
                          EngineConfig(param_dtype="float32", micro_batch_size_per_gpu=3), head="score")
    batch = random_batch(8, 12, 101, seed=5).chunk(engine.mesh.dp_size)[engine.mesh.dp_rank]
    scores = engine.infer_batch(batch)["scores"]
    gathered = [torch.zeros_like(scores) for _ in range(engine.mesh.dp_size)]
    torch.distributed.all_gather(gathered, scores, group=engine.dp_group)
    return torch.cat(gathered)


def engine_scores_each(path: str, remove_padding: tuple[bool, ...]) -> dict[bool, torch.Tensor]:
    """`engine_scores` for each setting of `remove_padding`, one engine after the other on the same processes."""
    return {packed: engine_scores(path, packed) for packed in remove_padding}


def test_scores_equal_plain_hf_model(rm_dir):
    model = transformers.AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    batch = random_batch(8, 12, 101, seed=5)
    with torch.no_grad():
        want = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
    for world, settings in ((1, (True,)), (2, (True, False))):  # packed and padded on one pair of processes
        runs = run_distributed(engine_scores_each, world, str(rm_dir), settings)
        assert sorted(runs) == sorted(settings)
        for packed, got in runs.items():
            assert got.shape == (8,)
            assert (got - want).abs().max() < 1e-5, (world, packed)


def test_causal_lm_folder_is_not_a_reward_model(tmp_path):
    from shardrl.engine.model import load_hf_config

    transformers.AutoConfig.for_model(**TINY_MODELS["qwen2"], architectures=["Qwen2ForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a sequence classifier"):
        load_hf_config(str(tmp_path), None, task="seq_cls")


def test_trainer_scores_with_reward_model(tmp_path):
    from shardrl.tokenizer import build_char_tokenizer
    from shardrl.trainer.demo import demo_overrides, prepare_demo_assets
    from shardrl.launch.rank import run

    assets = prepare_demo_assets(tmp_path / "assets", warmup_steps=2)
    tok = build_char_tokenizer()
    config = transformers.Qwen2Config(num_labels=1, pad_token_id=tok.pad_token_id, vocab_size=len(tok), hidden_size=32,
                                      intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, architectures=["Qwen2ForSequenceClassification"])
    transformers.Qwen2ForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    run_dir = run(None, demo_overrides(assets) + [
        f"reward.model_path={tmp_path / 'rm'}", "reward.engine.param_dtype=float32", "trainer.total_steps=1",
        "trainer.val_freq=0", "trainer.logger=[jsonl]", f"trainer.output_dir={tmp_path / 'run'}"])
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    # a random reward model's scores are real numbers, not the 0/1 of the rule-based arithmetic reward
    assert record["reward/mean"] not in (0.0, 1.0) and record["reward/max"] != record["reward/min"]


def test_missing_eos_penalty_lowers_only_responses_cut_at_the_limit():
    """`reward.missing_eos_penalty`: a response that reached rollout.max_new_tokens (it never ended) loses the
    penalty; one that ended earlier keeps its score, and validation (shape=False) reports raw scores."""
    from shardrl.batch import Batch
    from shardrl.rewards.manager import RewardManager
    from shardrl.trainer.scoring import Scorer

    response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    batch = Batch({"input_ids": torch.zeros(3, 6, dtype=torch.long), "attention_mask": torch.ones(3, 6),
                   "response_mask": response_mask},
                  {"data_source": ["x"] * 3, "response_text": ["a", "b", "c"], "extra": [{}] * 3})
    scorer = Scorer(RewardManager(lambda data_source, solution_str, ground_truth, extra_info=None: 0.5),
                    length_limit=4, missing_eos_penalty=2.0)
    scores, metrics = scorer.score(batch)
    assert scores.tolist() == pytest.approx([-1.5, 0.5, 0.5]) and metrics["reward/missing_eos_frac"] == pytest.approx(1 / 3)
    assert scorer.score(batch, shape=False)[0].tolist() == pytest.approx([0.5, 0.5, 0.5])
