"""GRPO with images end to end (issue 61): `shardrl train` on a tiny random Qwen2.5-VL folder (its processor saved
beside it) and image rows (verl's `images` column beside a chat prompt with `<image>`), on the CPU with the hf
rollout (and the fast one); each prompt's images go to the rollout and, repeated for its n samples, through the batch to the engine
(the sampler's and the trainer's log-probs agree); the first step's metrics do not depend on the micro-batch cut.
What is not built for images yet is refused by name before any model is built."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
from PIL import Image

from shardrl.testing import run_distributed, save_tiny_vl_model

pytestmark = pytest.mark.multiproc

COLORS = {"red": (220, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 230)}
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(ground_truth[0] in solution_str)
"""
# as tests/test_metrics_invariance.py: what describes the layout or the clock, not the batch
LAYOUT_KEYS = ("actor/num_micro_batches", "ref/num_micro_batches")
CLOCK_KEYS = ("perf/tokens_per_s_per_gpu", "perf/tflop_per_s_per_gpu", "perf/mfu_measured", "perf/mfu_spec")
ROUNDING_KEYS = ("rollout/logprob_abs_diff", "rollout/logprob_abs_diff_max", "rollout/kl", "rollout/k3_kl")


def png(color, size=(28, 28)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vl")
    save_tiny_vl_model(root / "model")
    rows = []
    for k, (name, rgb) in enumerate(list(COLORS.items()) * 2):
        image = {"bytes": png(rgb)} if k % 2 else {"path": f"{name}.png"}  # bytes, and paths beside the file
        (root / f"{name}.png").write_bytes(png(rgb))
        rows.append({"data_source": "colors", "prompt": [{"role": "user", "content": "<image>color?"}],
                     "images": [image], "reward_model": {"ground_truth": name}})
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), root / "train.parquet")
    (root / "reward.py").write_text(REWARD)
    return root


def overrides(assets: Path, run_dir: Path, *extra: str) -> list[str]:
    return [f"model.path={assets / 'model'}", f"data.train_files=[{assets / 'train.parquet'}]",
            f"reward.function_path={assets / 'reward.py'}", f"trainer.output_dir={run_dir}", "trainer.logger=[jsonl]",
            "trainer.val_freq=0", "trainer.export_hf=false", "data.max_prompt_length=32", "data.train_batch_size=4",
            "rollout.n=4", "rollout.max_new_tokens=4", "actor.ppo_mini_batch_size=2", "actor.engine.param_dtype=float32",
            "ref.engine.param_dtype=float32", "actor.use_kl_loss=true", "actor.optim.lr=1e-3",
            "actor.engine.use_dynamic_bsz=false", *extra]


def _train_runs(runs: list[list[str]]) -> list[list[dict]]:
    from shardrl.launch.rank import run

    records = []
    for args in runs:
        run_dir = run(None, args)
        records.append([json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()])
    return records


def test_grpo_with_images_runs_and_its_first_step_is_invariant_to_the_micro_batch_cut(assets, tmp_path):
    layouts = {"micro1": ["actor.engine.micro_batch_size_per_gpu=1", "ref.engine.micro_batch_size_per_gpu=1"],
               "micro4": ["actor.engine.micro_batch_size_per_gpu=4", "ref.engine.micro_batch_size_per_gpu=4"],
               "dynamic": [f"{role}.engine.{k}" for role in ("actor", "ref")
                           for k in ("use_dynamic_bsz=true", "max_token_len_per_gpu=40")]}
    runs = [overrides(assets, tmp_path / "micro1", "trainer.total_steps=2", *layouts["micro1"])]
    runs += [overrides(assets, tmp_path / name, "trainer.total_steps=1", *layout) for name, layout in layouts.items()
             if name != "micro1"]
    records = run_distributed(_train_runs, 1, runs)
    two_steps = records[0]
    assert [r["step"] for r in two_steps] == [1, 2]
    first = two_steps[0]
    # the images reached the engine: its log-probs are the sampler's (a forward without them is ~1 nat off)
    assert first["rollout/logprob_abs_diff_max"] < 1e-4
    assert first["prompt/length_mean"] > 8  # the image's placeholders are prompt tokens
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "reward/mean"):
        assert math.isfinite(first[key]) and first[key] != 0.0, key
    assert records[1][0]["actor/num_micro_batches"] != first["actor/num_micro_batches"]
    compared = sorted(k for k in first if k not in LAYOUT_KEYS + CLOCK_KEYS and not k.startswith("timing/"))
    for name, got in zip(["micro4", "dynamic"], records[1:]):
        for key in compared:
            tol = dict(abs=1e-5) if key in ROUNDING_KEYS else dict(rel=2e-5, abs=1e-6)
            assert got[0][key] == pytest.approx(first[key], **tol), (name, key)


# the critic's statistics of values and GAE returns (compared with an absolute tolerance too: a value near 0)
VALUE_KEYS = tuple(f"critic/{name}/{stat}" for name in ("values", "returns", "advantages")
                   for stat in ("mean", "max", "min")) + ("critic/vf_explained_var",)


def test_ppo_with_images_runs_and_its_first_step_is_invariant_to_the_micro_batch_cut(assets, tmp_path):
    """PPO (gae): a critic on the VL policy's folder (critic.model_path left to the policy's) runs the vision tower
    and its value head on the rows' images; its metrics are finite, and the first step (the critic's values and
    update too) does not depend on how the actor, reference and critic cut their micro-batches."""
    roles = ("actor", "ref", "critic")
    layouts = {"micro1": [f"{role}.engine.micro_batch_size_per_gpu=1" for role in roles],
               "micro4": [f"{role}.engine.micro_batch_size_per_gpu=4" for role in roles],
               "dynamic": [f"{role}.engine.{k}" for role in roles
                           for k in ("use_dynamic_bsz=true", "max_token_len_per_gpu=40")]}
    ppo = ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=2", "critic.optim.lr=1e-2",
           "critic.engine.param_dtype=float32", "critic.engine.use_dynamic_bsz=false"]
    runs = [overrides(assets, tmp_path / "micro1", "trainer.total_steps=2", *ppo, *layouts["micro1"])]
    runs += [overrides(assets, tmp_path / name, "trainer.total_steps=1", *ppo, *layout) for name, layout in
             layouts.items() if name != "micro1"]
    records = run_distributed(_train_runs, 1, runs)
    two_steps = records[0]
    assert [r["step"] for r in two_steps] == [1, 2]
    first = two_steps[0]
    assert first["rollout/logprob_abs_diff_max"] < 1e-4 and first["prompt/length_mean"] > 8
    for record in two_steps:
        for key in ("critic/vf_loss", "critic/grad_norm", "critic/values/mean", "critic/returns/mean",
                    "critic/vf_explained_var", "actor/pg_loss", "actor/grad_norm"):
            assert math.isfinite(record[key]) and record[key] != 0.0, (record["step"], key)
    assert two_steps[1]["critic/values/mean"] != first["critic/values/mean"]  # the critic's update moved it
    assert records[1][0]["critic/num_micro_batches"] != first["critic/num_micro_batches"]
    layout_keys = LAYOUT_KEYS + ("critic/num_micro_batches",)
    compared = sorted(k for k in first if k not in layout_keys + CLOCK_KEYS and not k.startswith("timing/"))
    assert set(VALUE_KEYS) <= set(compared)
    for name, got in zip(["micro4", "dynamic"], records[1:]):
        for key in compared:
            tol = dict(abs=1e-5) if key in ROUNDING_KEYS else dict(rel=2e-5, abs=1e-6)
            assert got[0][key] == pytest.approx(first[key], **tol), (name, key)


def test_grpo_with_images_under_ulysses_equals_one_process(assets, tmp_path):
    """sp=2 on 2 processes is one data-parallel rank: the same rollouts, so the same step as 1 process; the actor and
    the reference run at sp=2, with budgets of 20 tokens per rank, 40 a micro-batch as with 1 process (a row's pieces
    split its image placeholders)."""
    def layout(sp: int) -> list[str]:
        return [f"{role}.engine.{k}" for role in ("actor", "ref") for k in (
            "use_dynamic_bsz=true", f"max_token_len_per_gpu={40 // sp}", f"ulysses_sequence_parallel_size={sp}")]
    one, two = (run_distributed(_train_runs, sp, [overrides(assets, tmp_path / f"sp{sp}", "trainer.total_steps=1",
                                                           *layout(sp))])[0] for sp in (1, 2))
    assert one[0]["actor/grad_norm"] > 0 and one[0]["prompt/length_mean"] > 8
    compared = sorted(k for k in one[0] if k not in LAYOUT_KEYS + CLOCK_KEYS and not k.startswith("timing/"))
    for key in compared:
        tol = dict(abs=1e-5) if key in ROUNDING_KEYS else dict(rel=2e-5, abs=1e-6)
        assert two[0][key] == pytest.approx(one[0][key], **tol), key


@pytest.mark.parametrize("rollout", [[], ["rollout.backend=fast", "rollout.lora_sync=unmerged"],
                                     ["rollout.backend=fast", "rollout.lora_sync=merged"]],
                         ids=["hf", "fast-unmerged", "fast-merged"])
def test_grpo_with_images_and_lora_on_the_language_model_runs(assets, tmp_path, rollout):
    """LoRA on a VL policy (the language model's layers, `tests/test_vl_lora.py`): the hf rollout samples with the
    merged weights (the fast one with the adapters synced alone: added at run time to the trainer's base it reads,
    or merged into its own copy), the reference is the base (adapters off), and the engine's log-probs are the
    sampler's."""
    records = run_distributed(_train_runs, 1, [overrides(assets, tmp_path / "run", "trainer.total_steps=2",
                                                         "model.lora.rank=4", "actor.engine.micro_batch_size_per_gpu=4",
                                                         "ref.engine.micro_batch_size_per_gpu=4", *rollout)])[0]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["rollout/logprob_abs_diff_max"] < 1e-4 for r in records)  # the synced merge is what trains
    assert records[0]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-7)  # step 1: the adapters are 0, policy = base
    assert records[1]["actor/kl_loss"] > 0  # the adapters moved the policy off the reference


def test_validation_names_each_prompts_images_beside_its_generations(assets, tmp_path, capsys):
    """generations.jsonl and the console name a prompt's images: the path the row gives, `<image bytes #i>` for
    bytes (the assets alternate: paths on even rows, bytes on odd)."""
    from shardrl.launch.rank import run

    run_dir = tmp_path / "run"
    run(None, overrides(assets, run_dir, "trainer.total_steps=1", "trainer.val_before_train=true",
                        f"data.val_files=[{assets / 'train.parquet'}]", "trainer.log_val_generations=4",
                        "actor.engine.micro_batch_size_per_gpu=4", "ref.engine.micro_batch_size_per_gpu=4"))
    samples = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    first = [s for s in samples if s["step"] == 0]
    assert [s["images"] for s in first] == [["red.png"], ["<image bytes #1>"], ["blue.png"], ["<image bytes #1>"]]
    assert all(s["ground_truth"] in s["images"][0] for s in first[::2])  # each sample beside its own prompt's image
    assert "  images:   'red.png'\n  response:" in capsys.readouterr().out


def test_grpo_with_images_on_the_fast_rollout(assets, tmp_path):
    """The same run on the fast rollout (6 slots for 16 rows: a prompt's samples admitted apart): its log-probs, of
    prompts whose image features it spliced in and M-RoPE positions it decoded at, are the engine's
    recomputation's."""
    records = run_distributed(_train_runs, 1, [overrides(assets, tmp_path / "fast", "trainer.total_steps=2",
                                                         "rollout.backend=fast", "rollout.fast.max_batch=6")])
    steps = records[0]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        assert record["rollout/logprob_abs_diff_max"] < 1e-4
        for key in ("actor/pg_loss", "actor/grad_norm", "reward/mean"):
            assert math.isfinite(record[key]), key


@pytest.mark.parametrize("extra,message", [
    (["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]"], r"multi-turn and agent episodes with images are not built yet"),
])
def test_what_is_not_built_for_images_is_refused_by_name(assets, tmp_path, extra, message):
    from shardrl.launch.rank import run

    with pytest.raises(ValueError, match=message):
        run(None, overrides(assets, tmp_path / "run", "trainer.total_steps=1", *extra))


def test_verl_image_keys_map():
    from shardrl.compat.verl.translate import translate

    out = translate(["data.image_key=pictures", "data.image_patch_size=16", "data.video_key=videos"])
    assert 'data.image_key="pictures"' in out.overrides
    assert set(out.dropped) == {"data.image_patch_size", "data.video_key"}
    assert "patch size" in out.dropped["data.image_patch_size"] and "images only" in out.dropped["data.video_key"]
