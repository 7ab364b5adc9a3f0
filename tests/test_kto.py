"""`shardrl kto`: unpaired rows (TRL's prompt/completion/label) load with the loss on the completion and KL rows of
mismatched pairs; the loss is TRL's KTOTrainer formula; the step's gradients are the same however the batch is cut
into micro-batches; a tiny run ends with its summary."""

from __future__ import annotations

import json
import math

import pytest
import torch

from shardrl.data.chat import collate_unpaired, load_unpaired_dataset
from shardrl.testing import TINY_MODELS, run_distributed
from shardrl.tokenizer import build_char_tokenizer


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_kto_loss_is_trls_formula_on_fixed_log_probs():
    """TRL's KTOTrainer._compute_loss: kl = mean(KL_logps - ref_KL_logps) clamped at 0; a desirable row's loss
    desirable_weight * (1 - s(beta (z - kl))), an undesirable one's undesirable_weight * (1 - s(beta (kl - z))),
    z = logps - ref_logps; the loss their mean."""
    from shardrl.trainer.kto import kto_step

    g = torch.Generator().manual_seed(0)
    rows, width = 6, 5
    mask = torch.ones(rows, width, dtype=torch.long)
    mask[:, :2] = 0  # the prompt
    log_probs = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    ref = -torch.rand(rows, generator=g, dtype=torch.float64) * 9
    label = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    kl_policy, kl_ref = [-5.0, -4.0, -6.5, -3.0, -2.0, -7.0], [-5.5, -4.2, -6.0, -3.9, -2.1, -7.3]
    kl = max(0.0, sum(p - r for p, r in zip(kl_policy, kl_ref)) / rows)
    beta, wd, wu = 0.3, 1.5, 0.8
    want = []
    for i in range(rows):
        z = float(log_probs[i, 2:].sum()) - float(ref[i])
        want.append(wd * (1 - _sig(beta * (z - kl))) if label[i] else wu * (1 - _sig(beta * (kl - z))))
    losses, metrics = kto_step(log_probs, mask, ref, label, torch.full((rows,), kl, dtype=torch.float64), beta, wd, wu)
    assert losses.tolist() == pytest.approx(want, rel=1e-12)
    chosen = [beta * (float(log_probs[i, 2:].sum()) - float(ref[i])) for i in range(rows) if label[i]]
    assert float(metrics["rewards/chosen"].total / metrics["rewards/chosen"].count) == pytest.approx(
        sum(chosen) / len(chosen))
    assert float(metrics["kl"].total / metrics["kl"].count) == pytest.approx(kl)


def test_unpaired_rows_load_and_kl_rows_pair_each_prompt_with_the_previous_completion(tmp_path):
    tok = build_char_tokenizer()
    rows = [{"prompt": "1+2=", "completion": "3", "label": True},
            {"prompt": [{"role": "user", "content": "2+2="}], "completion": "5", "label": False},
            {"prompt": "3+3=", "completion": "66", "label": False}]
    path = _write(tmp_path / "kto.jsonl", rows + [{"prompt": "x", "completion": "1", "label": "yes"}])
    with pytest.raises(ValueError, match=r"row 4: 'label' must be true \(a desirable completion\) or false, "
                                         r"found 'yes'"):
        load_unpaired_dataset([path], tok, 64)
    data = load_unpaired_dataset([path], tok, 64, skip_bad_rows=True)
    batch = collate_unpaired(data.items, tok.pad_token_id, 64)
    assert batch["label"].tolist() == [1.0, 0.0, 0.0]

    def text(ids, mask, want):
        return "".join(tok.decode([int(i)]) for i, m in zip(ids, mask) if m == want and i != tok.pad_token_id)

    assert [text(batch["input_ids"][r], batch["loss_mask"][r], 1) for r in range(3)] == ["3<eos>", "5\n", "66<eos>"]
    # KL rows: row i's prompt, row i-1's completion (the first takes the last's), the mask on that completion
    kl = [(text(batch["kl_input_ids"][r], batch["kl_loss_mask"][r], 0),
           text(batch["kl_input_ids"][r], batch["kl_loss_mask"][r], 1)) for r in range(3)]
    assert kl == [("1+2=", "66<eos>"), ("user: 2+2=\nassistant: ", "3<eos>"), ("3+3=", "5\n")]
    with pytest.raises(ValueError, match=r"kto\.jsonl: no row has the columns for shardrl kto"):
        load_unpaired_dataset([_write(tmp_path / "kto.jsonl", [{"prompt": "a", "response": "b"}])], tok, 64)


ROWS = [{"prompt": f"{a}+{b}=", "completion": str(a + b) if (a + b) % 3 else f"{a + b}{a}", "label": (a + b) % 3 > 0}
        for a in range(5) for b in range(2)]  # 10 rows, desirable and not, completions of different lengths


def _kto_gradients(layouts: dict) -> dict:
    """The KTO step's loss and gradients per engine layout on all of ROWS (one process), the reference another
    random model."""
    from shardrl.config.schema import EngineConfig, ModelConfig, OptimConfig
    from shardrl.data.chat import _tokenize_unpaired
    from shardrl.engine import build_engine
    from shardrl.testing import record_grads
    from shardrl.trainer.kto import kto_loss_fn

    tok = build_char_tokenizer()
    items = [_tokenize_unpaired(tok, row, ("prompt", "completion", "label")) for row in ROWS]
    batch = collate_unpaired(items, tok.pad_token_id, 64).select(["input_ids", "attention_mask", "loss_mask", "label"])
    batch["ref_log_probs"] = -torch.arange(len(ROWS), dtype=torch.float64) - 5
    batch["kl"] = torch.full((len(ROWS),), 0.4, dtype=torch.float64)
    out = {}
    for name, engine_kwargs in layouts.items():
        engine = build_engine(ModelConfig(tiny=TINY_MODELS["qwen2"]),
                              EngineConfig(param_dtype="float32", **engine_kwargs), OptimConfig(lr=1e-3, clip_grad=0.0))
        grads = record_grads(engine)
        metrics = engine.train_batch(batch, kto_loss_fn(0.5, 1.2, 0.7))
        out[name] = {"loss": metrics["loss"], "grads": grads[0], "micro": metrics["num_micro_batches"]}
    return out


@pytest.mark.multiproc
def test_the_kto_step_is_the_same_on_one_and_two_micro_batches():
    out = run_distributed(_kto_gradients, 1, {"one": {"micro_batch_size_per_gpu": 10},
                                              "two": {"micro_batch_size_per_gpu": 5}})
    assert (out["one"]["micro"], out["two"]["micro"]) == (1, 2)
    assert out["two"]["loss"] == pytest.approx(out["one"]["loss"], rel=1e-6)
    for key, grad in out["one"]["grads"].items():
        torch.testing.assert_close(out["two"]["grads"][key], grad, atol=1e-6 * float(grad.abs().max()) + 1e-8,
                                   rtol=1e-5, msg=key)


@pytest.mark.multiproc
def test_a_tiny_kto_run_logs_trls_metrics_and_ends_with_its_summary(tmp_path):
    """Two steps of `shardrl kto` on CPU: at the first the policy is the reference, so every reward and the KL are
    0 and each row's loss is its weight times 1 - s(0) = 1/2."""
    from shardrl.cli import main
    from shardrl.testing import save_char_model

    save_char_model(tmp_path / "model")
    rows = _write(tmp_path / "rows.jsonl", ROWS)
    run_dir = tmp_path / "run"
    assert main(["kto", f"model.path={tmp_path / 'model'}", f"data.train_files=[{rows}]", f"data.val_files=[{rows}]",
                 "data.batch_size=10", "data.shuffle=false", "engine.param_dtype=float32", "optim.lr=1e-3",
                 "kto.desirable_weight=1.2", "kto.undesirable_weight=0.7", "trainer.logger=[jsonl]",
                 f"trainer.output_dir={run_dir}", "trainer.device=cpu", "trainer.total_steps=2",
                 "trainer.val_freq=2"]) == 0
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    desirable = sum(r["label"] for r in ROWS)
    assert records[0]["kto/loss"] == pytest.approx((1.2 * desirable + 0.7 * (10 - desirable)) / 2 / 10, rel=1e-6)
    assert records[0]["kto/kl"] == pytest.approx(0, abs=1e-6)
    assert records[0]["rewards/chosen"] == pytest.approx(0, abs=1e-6)
    assert records[0]["logps/chosen"] < 0 and records[0]["logps/rejected"] < 0
    assert "val/loss" in records[1] and "val/rewards/rejected" in records[1]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and "loss_first" in summary
