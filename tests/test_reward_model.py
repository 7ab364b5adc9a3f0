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


# ---- a reward model with its own tokenizer (verl's reward_model.model.input_tokenizer) ----------------------------
RM_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }};{% endfor %}"
"""A chat template unlike the policy's ("role: content" lines): the reward model must read its own."""


def save_reward_model(folder, tokenizer, seed: int = 3):
    """A tiny random Qwen2 sequence classifier sized to `tokenizer`, saved with it."""
    config = transformers.Qwen2Config(num_labels=1, pad_token_id=tokenizer.pad_token_id, vocab_size=len(tokenizer),
                                      hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, architectures=["Qwen2ForSequenceClassification"])
    torch.manual_seed(seed)
    transformers.Qwen2ForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def policy_batch(tok, rows):
    """An RL batch as the rollout makes it: (prompt, response text, ended) rows -> left-padded prompts (a chat
    prompt rendered with the policy's template), right-padded responses (EOS when it ended)."""
    from shardrl.batch import Batch

    texts = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False) if isinstance(p, list) else p
             for p, _, _ in rows]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    responses = [tok(r, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if ended else [])
                 for _, r, ended in rows]
    width_p, width_r = max(map(len, prompts)), max(map(len, responses))
    ids = torch.full((len(rows), width_p + width_r), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, width_p - len(p):width_p], mask[i, width_p - len(p):width_p] = torch.tensor(p), 1
        ids[i, width_p:width_p + len(r)], mask[i, width_p:width_p + len(r)] = torch.tensor(r), 1
    return Batch({"input_ids": ids, "attention_mask": mask, "response_mask": mask[:, width_p:]},
                 {"prompt": [p for p, _, _ in rows], "data_source": ["x"] * len(rows),
                  "response_text": [r for _, r, _ in rows], "extra": [{}] * len(rows)})


def scores_both_ways(rm_path: str, policy_tok, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's scores of `batch` (re-tokenized as the run decides, the policy's ids as they are)."""
    from shardrl.rewards.manager import RewardManager
    from shardrl.rewards.model_inputs import reward_model_inputs
    from shardrl.trainer.scoring import Scorer

    engine = build_engine(ModelConfig(path=rm_path), EngineConfig(param_dtype="float32"), head="score")
    return tuple(Scorer(RewardManager(), engine, reward_inputs=inputs).score(batch, shape=False)[0]
                 for inputs in (reward_model_inputs(rm_path, policy_tok), None))


def test_reward_model_with_its_own_tokenizer_scores_its_own_encoding(tmp_path):
    """A reward model whose tokenizer (a larger, different vocabulary, another chat template) is not the policy's
    scores the conversation as its own tokenizer encodes it, as verl's `_switch_chat_template` does: the response
    decoded without its EOS, appended to the prompt's chat as the assistant's message, rendered with the reward
    model's template; not the policy's ids (which its larger vocabulary would take without an error)."""
    from shardrl.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer

    policy_tok = build_char_tokenizer()
    rm_tok = build_char_tokenizer(DEFAULT_ALPHABET[::-1] + "[];ABCDEFGH")  # every id differs, and more of them
    rm_tok.chat_template = RM_TEMPLATE
    assert len(rm_tok) > len(policy_tok)
    rm_path = str(save_reward_model(tmp_path / "rm", rm_tok))
    chat = [{"role": "system", "content": "add."}, {"role": "user", "content": "1+2="}]
    batch = policy_batch(policy_tok, [(chat, "3", True), ("3*4=", "12 or 13", False)])

    got, policy_ids = run_distributed(scores_both_ways, 1, rm_path, policy_tok, batch)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(rm_path).eval()
    want = []
    for messages in (chat + [{"role": "assistant", "content": "3"}],
                     [{"role": "user", "content": "3*4="}, {"role": "assistant", "content": "12 or 13"}]):
        text = rm_tok.apply_chat_template(messages, tokenize=False)
        assert text.startswith(("[system]add.;[user]1+2=;[assistant]3;", "[user]3*4=;[assistant]12 or 13;"))
        with torch.no_grad():
            want.append(float(model(**rm_tok(text, add_special_tokens=False, return_tensors="pt")).logits))
    assert got.tolist() == pytest.approx(want, abs=1e-5)
    assert (policy_ids - got).abs().min() > 1e-3  # the old path's number: the policy's ids read as the RM's


def test_reward_model_tokenizer_decides_the_fast_path(tmp_path):
    """The policy's ids go as they are to a reward model folder without a tokenizer or with one that encodes the
    same (saved again, other padding side: the same tokenizer); one of the same size but other ids re-tokenizes."""
    from shardrl.rewards.model_inputs import Retokenize, reward_model_inputs
    from shardrl.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer

    policy_tok = build_char_tokenizer()
    policy_tok.save_pretrained(tmp_path / "same")
    assert reward_model_inputs(str(tmp_path / "same"), policy_tok) is None
    (tmp_path / "none").mkdir()
    assert reward_model_inputs(str(tmp_path / "none"), policy_tok) is None
    swapped = build_char_tokenizer(DEFAULT_ALPHABET[1] + DEFAULT_ALPHABET[0] + DEFAULT_ALPHABET[2:])
    assert len(swapped) == len(policy_tok)
    swapped.save_pretrained(tmp_path / "swapped")
    assert isinstance(reward_model_inputs(str(tmp_path / "swapped"), policy_tok), Retokenize)


def test_trainer_reward_model_with_a_smaller_tokenizer_of_its_own(tmp_path):
    """The trainer re-tokenizes for a reward model with its own tokenizer: one smaller than the policy's (which
    the vocabulary check refused, the policy's ids being past its vocabulary) scores the demo's run."""
    from shardrl.launch.rank import run
    from shardrl.tokenizer import build_char_tokenizer
    from shardrl.trainer.demo import demo_overrides, prepare_demo_assets

    assets = prepare_demo_assets(tmp_path / "assets", warmup_steps=2)
    rm_tok = build_char_tokenizer("0123456789+=:[]; userasitn")  # what "[user]1+2=;[assistant]3;" needs
    rm_tok.chat_template = RM_TEMPLATE
    assert len(rm_tok) < len(build_char_tokenizer())
    save_reward_model(tmp_path / "rm", rm_tok)
    run_dir = run(None, demo_overrides(assets) + [
        f"reward.model_path={tmp_path / 'rm'}", "reward.engine.param_dtype=float32", "trainer.total_steps=1",
        "trainer.val_freq=0", "trainer.logger=[jsonl]", f"trainer.output_dir={tmp_path / 'run'}"])
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert record["reward/mean"] not in (0.0, 1.0) and record["reward/max"] != record["reward/min"]


def bf16_engine_scores(path: str) -> torch.Tensor:
    engine = build_engine(ModelConfig(path=path), EngineConfig(param_dtype="bfloat16", micro_batch_size_per_gpu=4),
                          head="score")
    return engine.infer_batch(random_batch(8, 12, 101, seed=5))["scores"]


def test_scores_of_a_bf16_engine_are_fp32_not_bf16_rounded(rm_dir):
    """The score head ran in bf16: `shardrl rm` logged rewards/chosen == rewards/rejected == -0.30029296875 and
    rm/margin 0.0 beside accuracy 0.25. The head runs in fp32: the scores are off bf16's grid, each pair's margin is
    their fp32 difference, and they stay within bf16 compute of the fp32 model's."""
    from shardrl.trainer.rm import reward_pair_step

    model = transformers.AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    batch = random_batch(8, 12, 101, seed=5)
    with torch.no_grad():
        want = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
    scores = run_distributed(bf16_engine_scores, 1, str(rm_dir))
    assert scores.dtype == torch.float32 and scores.shape == (8,)
    assert (scores.to(torch.bfloat16).float() != scores).sum() >= 6  # (was 0: every score on bf16's grid)
    assert (scores - want).abs().max() < 5e-2
    _, metrics = reward_pair_step(scores, 0.0)
    margins = scores[0::2] - scores[1::2]
    assert float(metrics["margin"].total) == pytest.approx(float(margins.sum()), abs=1e-6)


def test_a_reward_model_built_on_a_causal_lm_says_so_in_one_line_not_transformers_load_report(tmp_path, capfd):
    """A new score head on a causal LM is what `shardrl rm` does: transformers' LOAD REPORT (lm_head UNEXPECTED,
    score MISSING) would alarm on every start, so it is silenced and one line of ours says it."""
    import logging

    from shardrl.engine.model import build_causal_lm, load_hf_config

    kw = {k: v for k, v in TINY_MODELS["qwen2"].items() if k != "model_type"}
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw)).save_pretrained(tmp_path / "lm")
    config = load_hf_config(str(tmp_path / "lm"), None, task="seq_cls", new_head_ok=True)
    # shardrl's log and transformers' onto capfd's stderr, as a run prints them (transformers' own handler holds
    # the stream of whichever capture was on when it was made)
    handler = logging.StreamHandler()
    logger = logging.getLogger("shardrl")
    level = logger.level
    logger.addHandler(handler)
    transformers.logging.add_handler(handler)
    logger.setLevel(logging.INFO)
    try:
        model = build_causal_lm(config, str(tmp_path / "lm"), "cpu", torch.float32, sequence_classification=True)
    finally:
        logger.removeHandler(handler)
        transformers.logging.remove_handler(handler)
        logger.setLevel(level)
    err = capfd.readouterr().err
    assert type(model).__name__ == "Qwen2ForSequenceClassification" and model.score.weight.shape == (1, 32)
    assert "LOAD REPORT" not in err and "Consider training" not in err and "UNEXPECTED" not in err
    assert f"a new score head (32 -> 1) on {tmp_path / 'lm'}; its lm_head is not used" in err
    assert "not in its files" not in err  # no weight beyond the two heads is missing
