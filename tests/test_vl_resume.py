"""Checkpoint, resume and HF export of a GRPO run with images (issue 61): a 2-process run stopped by Ctrl-C after
its first step (checkpoint step 1) and resumed logs the uninterrupted run's step 2 and ends with its weights; the
same checkpoint resumed on 1 process starts step 2 from those weights; the resumed run's HF export loads in
`AutoModelForImageTextToText` and gives the trained engine's log-probs with the images. Text runs:
tests/test_trainer_e2e.py (resume), tests/test_checkpoint.py (DCP at other world sizes)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from shardrl.testing import interrupt_after_first_step, random_vl_batch, run_distributed
from test_vl_train import assets, overrides  # noqa: F401 (the fixture)

pytestmark = pytest.mark.multiproc

# (text tokens, image grids (t, h, w) in patches, response tokens): the export's check (tests/test_vl.py's rows)
ROWS = [(3, [(1, 4, 6)], 5), (2, [], 4), (1, [(1, 2, 4), (1, 4, 4)], 6)]
# scores that differ within a group (a sum of character codes), so advantages and gradients are not zero
VARIED_REWARD = ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    return (sum(map(ord, solution_str)) % 7) / 6.0\n")
# as test_vl_train's: the layout and the clock, not the batch
SKIPPED = ("perf/tokens_per_s_per_gpu", "perf/tflop_per_s_per_gpu", "perf/mfu_measured", "perf/mfu_spec")


def run_recording(args: list[str]) -> dict:
    """`run` on this rank, recording the actor's whole weights before each step; then the trained actor's
    log-probs of `ROWS` with their images. Rank 0's record comes back."""
    from shardrl.launch.rank import run
    from shardrl.trainer import rl

    weights, trainers = {}, []
    train_step, fit = rl.RLTrainer.train_step, rl.RLTrainer.fit

    def recording_step(self):
        weights[self.state.step + 1] = {n: t.clone() for n, t in self.roles.actor.export_weights()}
        return train_step(self)

    def recording_fit(self):
        trainers.append(self)
        return fit(self)

    rl.RLTrainer.train_step, rl.RLTrainer.fit = recording_step, recording_fit
    try:
        run_dir = run(None, args)
    finally:
        rl.RLTrainer.train_step, rl.RLTrainer.fit = train_step, fit
    actor = trainers[0].roles.actor
    batch = random_vl_batch(actor.hf_config, ROWS)
    log_probs = actor.infer_batch(batch)["log_probs"]
    end = {n: t.clone() for n, t in actor.export_weights()}
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"metrics": metrics, "weights": weights, "end": end, "log_probs": log_probs, "batch": batch}


def hf_log_probs(model, batch) -> list[torch.Tensor]:
    """Per row: the HF model's log-probs of the row's response tokens (the row alone, with its images)."""
    out = []
    for i in range(len(batch)):
        ids = batch["input_ids"][i][batch["attention_mask"][i].bool()][None]  # (1, L)
        images = dict(batch["multi_modal_inputs"][i] or {})
        if images:  # transformers 5.2x reads the placeholders' modality from here
            images["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
        with torch.no_grad():
            logits = model(input_ids=ids, **images).logits[0].float()  # (L, V)
        logp = F.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        out.append(logp[-int(batch["response_mask"][i].sum()):])
    return out


def assert_same_weights(got: dict, want: dict, what: str):
    assert set(got) == set(want) and any(n.startswith("model.visual.") for n in want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=f"{what}: {name}")


def test_grpo_with_images_resumes_like_an_uninterrupted_run_and_exports(assets, tmp_path):  # noqa: F811
    import transformers

    reward = tmp_path / "varied_reward.py"
    reward.write_text(VARIED_REWARD)
    args = ["trainer.total_steps=2", "trainer.save_freq=1", f"reward.function_path={reward}",
            "actor.engine.micro_batch_size_per_gpu=2", "ref.engine.micro_batch_size_per_gpu=2"]
    full = run_distributed(run_recording, 2, overrides(assets, tmp_path / "full", *args))
    assert [r["step"] for r in full["metrics"]] == [1, 2]
    assert all(r["actor/grad_norm"] > 0 for r in full["metrics"])  # advantages are not zero: the weights move
    # Ctrl-C after step 1 (its checkpoint is complete before its line is logged), on 2 processes
    cut = tmp_path / "cut"
    code = interrupt_after_first_step(["train", *overrides(assets, cut, *args), "--nproc-per-node", "2"], cut,
                                      tmp_path / "stderr.txt")
    assert code == 130, (tmp_path / "stderr.txt").read_text()[-3000:]
    complete = sorted(p.name for p in (cut / "checkpoints").glob("step_*") if (p / "COMPLETE").exists())
    assert complete == ["step_000001"]
    other = tmp_path / "other"  # the same checkpoint, resumed on 1 process below
    shutil.copytree(cut / "checkpoints" / "step_000001", other / "checkpoints" / "step_000001")
    resumed = run_distributed(run_recording, 2, overrides(assets, cut, "trainer.resume=auto",
                                                          "trainer.export_hf=true", *args))
    assert [r["step"] for r in resumed["metrics"]] == [1, 2] and list(resumed["weights"]) == [2]
    want, got = full["metrics"][1], resumed["metrics"][1]
    compared = sorted(k for k in want if k not in SKIPPED and not k.startswith("timing/"))
    assert {"actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "reward/mean"} <= set(compared)
    for key in compared:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    assert_same_weights(resumed["weights"][2], full["weights"][2], "resumed at step 2")
    assert_same_weights(resumed["end"], full["end"], "resumed, after step 2")
    # at another world size: 2 processes' checkpoint, step 2 on 1, from the same weights
    one = run_distributed(run_recording, 1, overrides(assets, other, "trainer.resume=auto", *args))
    # (its folder had no metrics.jsonl: step 1's line is logged from the checkpoint)
    assert [r["step"] for r in one["metrics"]] == [1, 2] and list(one["weights"]) == [2]
    assert one["metrics"][0]["actor/pg_loss"] == full["metrics"][0]["actor/pg_loss"]
    assert_same_weights(one["weights"][2], full["weights"][2], "resumed on 1 process")
    assert one["metrics"][1]["rollout/logprob_abs_diff_max"] < 1e-4
    # the export: an image-text-to-text folder whose log-probs with the images are the trained actor's
    model = transformers.AutoModelForImageTextToText.from_pretrained(cut / "hf_model", dtype=torch.float32).eval()
    batch = resumed["batch"]
    width_p = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
    for i, ref in enumerate(hf_log_probs(model, batch)):
        torch.testing.assert_close(resumed["log_probs"][i, width_p:width_p + ref.numel()], ref, atol=2e-5, rtol=0)
    start = transformers.AutoModelForImageTextToText.from_pretrained(assets / "model", dtype=torch.float32).eval()
    assert (hf_log_probs(start, batch)[0] - hf_log_probs(model, batch)[0]).abs().max() > 1e-4  # it trained
