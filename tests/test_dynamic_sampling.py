"""DAPO's dynamic sampling as verl's DAPO recipe runs it (recipe/dapo/dapo_ray_trainer.py): generation batches of
data.gen_batch_size prompts until data.train_batch_size groups differ in algorithm.filter_groups.metric (a group of
one response is kept too), the first train_batch_size of them trained on, an error past max_num_gen_batches (0: no
limit). Decided over every dp rank: 1 rank and 2 ranks keep the same groups, each rank trains on its even share.
Also the config, the verl keys and the trainer end to end on 2 gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardrl.algos.dapo import groups_to_keep
from shardrl.batch import Batch
from shardrl.metrics import Max, SumCount
from shardrl.trainer.sampling import concat_rollouts, draw_groups, filter_metric


def test_groups_to_keep_is_verls_rule():
    values = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.2, 0.0, 0.0, 3.0, float("nan"), 1.0])
    index = torch.tensor([0, 0, 1, 1, 7, 7, 3, 9, 9, 5, 4, 4])  # groups 0, 1, 7, 3 (one sample), 9, 5 (one), 4
    want = []
    for i in range(len(values)):  # verl: np.std(group) > 0 or len(group) == 1
        group = [float(v) for v, j in zip(values, index) if j == index[i]]
        mean = sum(group) / len(group)
        want.append(sum((v - mean) ** 2 for v in group) > 0 or len(group) == 1)
    assert groups_to_keep(values, index).tolist() == want == [False, False, True, True, False, False,
                                                              True, False, False, True, False, False]


N = 2  # responses per prompt


def fake_gen_batch(k: int, gen_batch_size: int, spread: set, rank: int = 0, num_ranks: int = 1):
    """This rank's share of generation batch k: prompts k * gen_batch_size + i (their id in "pid"), N responses
    each, widths that differ by batch and rank; a prompt's metric varies iff its id is in `spread`."""
    per_rank = gen_batch_size // num_ranks
    pids = [k * gen_batch_size + rank * per_rank + i for i in range(per_rank)]
    p, r = 2 + (k + rank) % 2, 3 + k % 2
    rows = len(pids) * N
    resp = torch.ones(rows, r, dtype=torch.long)
    pid = torch.tensor(pids).repeat_interleave(N)
    ids = torch.cat([pid[:, None].expand(rows, p), (pid[:, None] * 10 + torch.arange(r)).clone()], 1)
    tensors = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "response_mask": resp,
               "prompt_index": torch.arange(len(pids)).repeat_interleave(N), "pid": pid}
    metric = torch.tensor([[0.0, 1.0] if q in spread else [1.0, 1.0] for q in pids]).flatten()
    scores = pid.float() + metric / 4  # the reward (its prompt's id, whole); the metric decides
    batch = Batch(tensors, {"response_text": [f"{q}_{j}" for q in pids for j in range(N)]})
    return batch, scores, {"reward/num_errors": 0.0}, metric


def kept_pids(batch: Batch) -> list[int]:
    return list(dict.fromkeys(batch["pid"].tolist()))


def run_case(gen_batch_size: int, train_batch_size: int, spread: set, max_gen_batches: int,
             rank: int = 0, num_ranks: int = 1):
    """(kept prompt ids in order, samples, num_gen_batches, whether the scores and tokens travelled with their
    prompts) on this rank, or the error's message."""
    try:
        batch, scores, _, metrics = draw_groups(
            lambda k: fake_gen_batch(k, gen_batch_size, spread, rank, num_ranks), train_batch_size,
            max_gen_batches, None, "acc")
    except ValueError as e:
        return str(e)
    whole = all(batch["input_ids"][i][batch["attention_mask"][i].bool()][-1] // 10 == batch["pid"][i]
                for i in range(len(batch)))
    with_scores = torch.equal(scores.floor(), batch["pid"].float())
    return kept_pids(batch), len(batch), metrics["dynamic_sampling/num_gen_batches"], whole and with_scores


CASES = [  # (gen_batch_size, train_batch_size, spread prompts, max_num_gen_batches)
    (4, 4, {2, 3, 4, 7}, 3),  # 2 + 2 kept over two batches; on 2 ranks groups move between them
    (6, 2, {1, 3, 4, 5}, 3),  # a generation batch larger than the train batch: its first 2 kept groups
    (4, 2, {13, 14}, 0),  # no limit: four batches
    (4, 2, {5}, 2),  # past the limit
]
WANT = [([2, 3, 4, 7], 8, Max(2.0)), ([1, 3], 4, Max(1.0)), ([13, 14], 4, Max(4.0)), None]


def test_draw_groups_on_one_rank_keeps_the_first_groups_with_spread():
    for case, want in zip(CASES, WANT):
        got = run_case(*case)
        if want is None:
            assert "drew 2 generation batches (algorithm.filter_groups.max_num_gen_batches=2) and kept 1 " \
                   "groups, fewer than data.train_batch_size=2" in got
        else:
            assert got == (*want, True), case
    # the reward metrics count every sample drawn, the informative share every group drawn
    _, _, rm, m = draw_groups(lambda k: fake_gen_batch(k, 4, {2, 3, 4, 7}), 4, 3, None)
    assert m["dynamic_sampling/informative_frac"] == SumCount(4.0, 8.0)
    assert m["dynamic_sampling/reward_mean_drawn"] == SumCount(2.0 * sum(range(8)) + (4 * 1 + 4 * 2) / 4, 16.0)


def _on_every_rank(cases):
    import torch.distributed as dist

    mine = [run_case(*case, rank=dist.get_rank(), num_ranks=dist.get_world_size()) for case in cases]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


@pytest.mark.multiproc
def test_two_ranks_keep_what_one_rank_keeps_balanced():
    from shardrl.testing import run_distributed

    ranks = run_distributed(_on_every_rank, 2, CASES)
    for i, (case, want) in enumerate(zip(CASES, WANT)):
        one, (r0, r1) = run_case(*case), (ranks[0][i], ranks[1][i])
        if want is None:  # every rank stops, with the same message
            assert isinstance(r0, str) and r0 == r1 == one
            continue
        assert r0[1] == r1[1] == want[1] // 2, case  # each rank its half of the train batch
        assert r0[0] + r1[0] == one[0] == want[0], case  # the same groups, in the global order
        assert r0[2] == r1[2] == want[2] and r0[3] and r1[3], case  # every rank drew alike; rows moved whole


def test_filter_metric_reads_verls_names():
    scores = torch.tensor([0.5, -0.5])
    values = {"score": torch.tensor([1.0, -1.0]), "acc": torch.tensor([1.0, 0.0])}
    assert filter_metric("seq_reward", scores, values) is scores
    assert filter_metric("seq_final_reward", scores, values) is scores
    assert filter_metric("acc", scores, values).tolist() == [1.0, 0.0]
    assert filter_metric("score", scores, values).tolist() == [1.0, -1.0]
    assert filter_metric("nope", scores, values).isnan().all()
    with pytest.raises(ValueError, match="filter_groups.metric='nope': no sample has it"):
        draw_groups(lambda k: (*fake_gen_batch(k, 2, {0})[:3], torch.full((4,), float("nan"))), 2, 3, None, "nope")


def test_concat_keeps_prompt_indices_apart():
    a = fake_gen_batch(0, 2, set())[0]
    b = fake_gen_batch(1, 3, set())[0]
    assert concat_rollouts([a, b])["prompt_index"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


def test_scorer_gives_each_samples_function_values():
    from shardrl.rewards.manager import RewardManager

    def fn(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "boom":
            raise RuntimeError("boom")
        if solution_str == "plain":
            return 0.25
        return {"score": 1.0, "acc": solution_str == "right"}

    items = [{"data_source": "x", "response_text": t, "extra": {}} for t in ("right", "plain", "wrong", "boom")]
    scores, metrics, values = RewardManager(fn, on_error_score=-1.0).score_with_values(items)
    assert scores.tolist() == [1.0, 0.25, 1.0, -1.0]
    assert values["acc"].tolist()[0::2] == [1.0, 0.0] and values["acc"][[1, 3]].isnan().all()
    assert metrics["reward/acc"] == (1.0, 2.0)  # (sum, count) over the samples that have it


def test_config_of_dynamic_sampling():
    from shardrl.config.schema import ConfigError, load_config
    from shardrl.plan.layout import derive_layout

    base = ["algorithm.filter_groups.enable=true", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4"]
    cfg = load_config(None, base + ["data.gen_batch_size=12", "algorithm.filter_groups.metric=acc",
                                    "algorithm.filter_groups.max_num_gen_batches=0"])
    assert (cfg.data.gen_batch_size, cfg.algorithm.filter_groups.metric) == (12, "acc")
    assert cfg.algorithm.filter_groups.max_num_gen_batches == 0  # no limit, as verl's 0
    assert load_config(None, []).algorithm.filter_groups.metric == "seq_reward"
    with pytest.raises(ConfigError, match="data.gen_batch_size=12: differs from data.train_batch_size=4"):
        load_config(None, base[1:] + ["data.gen_batch_size=12"])
    with pytest.raises(ConfigError, match="seq_final_reward'?: with algorithm.use_kl_in_reward"):
        load_config(None, base + ["algorithm.filter_groups.metric=seq_final_reward", "algorithm.use_kl_in_reward=true"])
    with pytest.raises(ConfigError, match="max_num_gen_batches"):
        load_config(None, base + ["algorithm.filter_groups.max_num_gen_batches=-1"])
    with pytest.raises(ConfigError, match="filter_groups"):
        load_config(None, ["algorithm.filter_groups.enable=true", "algorithm.adv_estimator=gae"])
    with pytest.raises(ValueError, match="data.gen_batch_size=6 prompts cannot be split over dp=4"):
        derive_layout(load_config(None, base + ["data.gen_batch_size=6"]), 1, 4)


def test_verls_dapo_keys_translate():
    from shardrl.compat.verl.translate import translate

    got = dict(o.split("=", 1) for o in translate([
        "actor_rollout_ref.model.path=m", "data.train_batch_size=512", "data.gen_batch_size=1536",
        "algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=acc",
        "algorithm.filter_groups.max_num_gen_batches=-1"]).overrides)
    assert got["data.gen_batch_size"] == "1536" and got["algorithm.filter_groups.enable"] == "true"
    assert got["algorithm.filter_groups.metric"] == '"acc"'
    assert got["algorithm.filter_groups.max_num_gen_batches"] == "0"  # verl's non-positive: no limit


def test_verl_names_num_gen_batches():
    from shardrl.compat.verl.metric_names import with_verl_names

    assert with_verl_names({"dynamic_sampling/num_gen_batches": 3.0}, 1)["train/num_gen_batches"] == 3.0


REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    global calls
    calls = globals().get("calls", 0) + 1
    # a prompt's responses are scored one after another: alternate, so that each group's scores differ;
    # acc differs only for the rows marked spread (the filter reads acc)
    score = float(calls % 2)
    return {"score": score, "acc": score if extra_info["spread"] else 1.0}
'''


def _train_two_ranks(overrides):
    import torch.distributed as dist

    from shardrl.launch.rank import run

    run_dir = run(None, overrides)
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")] if dist.get_rank() == 0 else []


@pytest.mark.multiproc
def test_trainer_fills_the_train_batch_from_two_generation_batches_on_two_ranks(tmp_path):
    from shardrl.testing import run_distributed, save_char_model

    save_char_model(tmp_path / "model")
    spread = {2, 3, 4, 7}  # rank 0 draws 0, 1 then 4, 5; rank 1 draws 2, 3 then 6, 7: groups 2, 3 move to rank 0
    rows = [{"prompt": f"{i}+1=", "data_source": "t", "spread": i in spread} for i in range(8)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "reward.py").write_text(REWARD)
    records = run_distributed(_train_two_ranks, 2, [
        f"model.path={tmp_path / 'model'}", f"data.train_files=[{tmp_path / 'train.jsonl'}]",
        f"reward.function_path={tmp_path / 'reward.py'}", f"trainer.output_dir={tmp_path / 'run'}",
        "data.shuffle=false", "data.max_prompt_length=16", "data.train_batch_size=4", "data.gen_batch_size=4",
        f"rollout.n={N}", "rollout.max_new_tokens=3", "actor.ppo_mini_batch_size=4", "trainer.total_steps=1",
        "trainer.val_freq=0", "trainer.save_freq=0", "trainer.logger=[jsonl]", "trainer.verl_metric_names=true",
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
        "algorithm.filter_groups.max_num_gen_batches=2"])
    (step,) = records
    assert step["dynamic_sampling/num_gen_batches"] == step["train/num_gen_batches"] == 2
    assert step["dynamic_sampling/informative_frac"] == 0.5  # 4 of the 8 groups drawn
    # only the spread rows were trained on (each group a 0 and a 1); reward/acc is over every sample drawn
    assert step["reward/mean"] == 0.5 and step["reward/min"] == 0.0 and step["reward/max"] == 1.0
    assert step["reward/acc"] == 0.75
