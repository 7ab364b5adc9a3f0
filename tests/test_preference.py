"""`shardrl dpo` and `shardrl rm`: preference rows load with the loss on the completions only; the DPO, IPO and
SimPO losses and metrics are the papers' formulas (and TRL's own code, where trl is installed); the engine's DPO and
reward-model steps give a plain loop's gradients on 1 and 2 processes, however the pairs are cut into
micro-batches, and with sequence parallelism."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from shardrl.algos.preference import PREFERENCE_LOSSES, PreferenceParams, bradley_terry_loss
from shardrl.data.chat import collate_pairs, load_preference_dataset
from shardrl.testing import TINY_MODELS, run_distributed
from shardrl.tokenizer import build_char_tokenizer


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def reference(mode: str, pc, pr, rc, rr, nc, nr, beta, eps, gamma):
    """One pair's loss, chosen and rejected rewards, and logged logps, from the papers' formulas."""
    if mode == "sigmoid":  # DPO eq. 7; cDPO's smoothing
        z = beta * ((pc - rc) - (pr - rr))
        return (-(1 - eps) * math.log(_sig(z)) - eps * math.log(_sig(-z)), beta * (pc - rc), beta * (pr - rr), pc, pr)
    if mode == "ipo":  # IPO eq. 17 on per-token log-ratios
        h = (pc - rc) / nc - (pr - rr) / nr
        return ((h - 1 / (2 * beta)) ** 2, beta * (pc - rc), beta * (pr - rr), pc, pr)
    if mode == "simpo":
        ac, ar = pc / nc, pr / nr  # SimPO eq. 6: length-normalized, a target margin gamma
        z = beta * (ac - ar) - gamma
        return (-(1 - eps) * math.log(_sig(z)) - eps * math.log(_sig(-z)), beta * ac, beta * ar, ac, ar)
    # TRL 1.x DPOTrainer._compute_loss's other loss types (f_divergence_type reverse_kl: scores are log-ratios)
    c, r = pc - rc, pr - rr
    d, ls = c - r, lambda x: math.log(_sig(x))
    loss = {
        "hinge": lambda: max(0.0, 1 - beta * d),
        "robust": lambda: (-(1 - eps) * ls(beta * d) + eps * ls(-beta * d)) / (1 - 2 * eps),
        "exo_pair": lambda: (_sig(beta * d) * (ls(beta * d) - math.log(1 - eps))
                             + _sig(-beta * d) * (ls(-beta * d) - math.log(eps))),
        "nca_pair": lambda: -ls(beta * c) - 0.5 * ls(-beta * c) - 0.5 * ls(-beta * r),
        "bco_pair": lambda: -ls(beta * c) - ls(-beta * r),
        "sppo_hard": lambda: (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2,
        "apo_zero": lambda: 1 - _sig(beta * c) + _sig(beta * r),
        "apo_down": lambda: _sig(beta * c) + 1 - _sig(beta * d),
        "sigmoid_norm": lambda: -ls(beta * (c / nc - r / nr)),
    }[mode]()
    return loss, beta * c, beta * r, pc, pr


# every pairwise loss of TRL 1.x's DPOTrainer but aot, aot_unpaired and discopop, and SimPO of its CPO trainer
LOSS_TYPES = ["sigmoid", "ipo", "hinge", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "apo_zero",
              "apo_down", "sigmoid_norm", "simpo"]


# (EXO's eps must be > 0: config.DPOSettings refuses 0, as TRL does)
@pytest.mark.parametrize("mode, eps", [(m, e) for m in LOSS_TYPES for e in (0.0, 0.1) if (m, e) != ("exo_pair", 0.0)])
def test_preference_losses_are_the_papers_formulas(mode, eps):
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (-torch.rand(6, generator=g, dtype=torch.float64) * 20 for _ in range(4))
    nc, nr = (torch.randint(1, 12, (6,), generator=g).double() for _ in range(2))
    params = PreferenceParams(beta=0.3, label_smoothing=eps if mode != "ipo" else 0.0, simpo_gamma=0.7)
    assert sorted(PREFERENCE_LOSSES) == sorted(LOSS_TYPES)
    out = PREFERENCE_LOSSES[mode].fn(pc, pr, rc, rr, nc, nr, params)
    for i in range(6):
        want = reference(mode, *(float(t[i]) for t in (pc, pr, rc, rr, nc, nr)), params.beta,
                         params.label_smoothing, params.simpo_gamma)
        assert [float(t[i]) for t in out] == pytest.approx(want, rel=1e-9)


def test_rpo_adds_the_token_mean_nll_of_the_global_batchs_chosen_tokens():
    """TRL's rpo_alpha (1.x: loss_type [..., "sft"] weighted alpha): loss + alpha * cross-entropy over the chosen
    completions' tokens, a token mean over the batch; the micro-batches' shares add up to it."""
    from shardrl.trainer.dpo import dpo_loss_fn

    g = torch.Generator().manual_seed(3)
    pairs, width = 5, 7
    mask = (torch.rand(2 * pairs, width, generator=g) < 0.6).long()
    mask[:, 0] = 1
    log_probs = -torch.rand(2 * pairs, width, generator=g, dtype=torch.float64) * 4
    ref = -torch.rand(2 * pairs, generator=g, dtype=torch.float64) * 10
    params, alpha = PreferenceParams(beta=0.2), 0.7
    logps = (log_probs * mask).sum(-1)
    pair_losses = [reference("sigmoid", float(logps[2 * i]), float(logps[2 * i + 1]), float(ref[2 * i]),
                             float(ref[2 * i + 1]), 0, 0, 0.2, 0.0, 0)[0] for i in range(pairs)]
    chosen_terms = [-float(log_probs[2 * i, t]) for i in range(pairs) for t in range(width) if mask[2 * i, t]]
    want = sum(pair_losses) / pairs + alpha * sum(chosen_terms) / len(chosen_terms)
    loss_fn = dpo_loss_fn("sigmoid", params, alpha, torch.tensor(float(len(chosen_terms)), dtype=torch.float64))
    total, nll = 0.0, []
    for rows in (slice(0, 4), slice(4, 10)):  # two micro-batches of 2 and 3 pairs
        mb = {"loss_mask": mask[rows], "ref_log_probs": ref[rows]}
        loss, metrics = loss_fn({"log_probs": log_probs[rows]}, mb, None, torch.tensor(2.0 * pairs))
        total, nll = total + float(loss), nll + [metrics["nll_loss"]]
    assert total == pytest.approx(want, rel=1e-12)
    assert float(sum(m.total for m in nll) / sum(m.count for m in nll)) == pytest.approx(
        sum(chosen_terms) / len(chosen_terms), rel=1e-12)


def test_dpo_settings_refuse_exo_without_eps_and_warn_of_unread_label_smoothing():
    from shardrl.config.load import ConfigError
    from shardrl.config.registry import TRAINERS, load_config

    with pytest.raises(ConfigError, match=r"dpo.label_smoothing=0.0: must be > 0 with loss_type=exo_pair"):
        load_config(None, ["dpo.loss_type=exo_pair"], TRAINERS["dpo"].config)
    cfg = load_config(None, ["dpo.loss_type=hinge", "dpo.label_smoothing=0.1"], TRAINERS["dpo"].config)
    assert any("dpo.label_smoothing=0.1 is never read: dpo.loss_type=hinge" in line for line in cfg.ignored_settings())
    assert not load_config(None, ["dpo.loss_type=robust", "dpo.label_smoothing=0.1"],
                           TRAINERS["dpo"].config).ignored_settings()


def test_dpo_simpo_gamma_outside_simpo_and_label_smoothing_under_ipo_are_warned_unread():
    """Was: dpo.simpo_gamma under sigmoid (or any loss but simpo) dropped without a word."""
    from shardrl.config.registry import TRAINERS, load_config

    def ignored(*overrides):
        return load_config(None, list(overrides), TRAINERS["dpo"].config).ignored_settings()

    assert ignored("dpo.simpo_gamma=2.0") == [
        "dpo.simpo_gamma=2.0 is never read: it is SimPO's margin, and dpo.loss_type=sigmoid has none; drop it, or "
        "set dpo.loss_type=simpo"]
    (line,) = ignored("dpo.loss_type=ipo", "dpo.label_smoothing=0.2")
    assert line.startswith("dpo.label_smoothing=0.2 is never read: dpo.loss_type=ipo has no label smoothing")
    assert ignored("dpo.loss_type=simpo", "dpo.simpo_gamma=2.0") == []


def test_bradley_terry_loss():
    chosen, rejected = torch.tensor([2.0, -1.0, 0.5]), torch.tensor([1.0, 1.0, 0.5])
    want = [-math.log(_sig(c - r)) + 0.1 * (c + r) ** 2 for c, r in zip(chosen.tolist(), rejected.tolist())]
    assert bradley_terry_loss(chosen, rejected, 0.1).tolist() == pytest.approx(want, rel=1e-6)


def test_a_reward_datasets_margin_column_is_in_the_loss(tmp_path):
    """TRL's RewardTrainer: loss = -log s(r_c - r_r - margin) with a `margin` column; a row without one has 0, a
    margin that is not a number is a bad row."""
    from shardrl.trainer.rm import rm_loss_fn

    rows = tmp_path / "pairs.jsonl"
    good = [{"prompt": "1+2=", "chosen": "3", "rejected": "4", "margin": 2.5},
            {"prompt": "1+3=", "chosen": "4", "rejected": "5"},
            {"prompt": [{"role": "user", "content": "2+2="}], "chosen": "4", "rejected": "1", "margin": -1}]
    rows.write_text("".join(json.dumps(r) + "\n" for r in good + [{**good[0], "margin": "big"}]))
    tok = build_char_tokenizer()
    with pytest.raises(ValueError, match=r"row 4: 'margin' must be a finite number, found 'big'"):
        load_preference_dataset([str(rows)], tok, 64)
    batch = collate_pairs(load_preference_dataset([str(rows)], tok, 64, skip_bad_rows=True).items, tok.pad_token_id)
    assert batch["margin"].tolist() == [2.5, 2.5, 0.0, 0.0, -1.0, -1.0]
    scores = torch.tensor([1.0, -0.5, 0.25, 0.75, 2.0, 1.5], dtype=torch.float64)
    loss, metrics = rm_loss_fn(0.0)({"scores": scores}, batch, None, torch.tensor(6.0))
    want = [-math.log(_sig(c - r - m)) for c, r, m in [(1.0, -0.5, 2.5), (0.25, 0.75, 0.0), (2.0, 1.5, -1.0)]]
    assert float(loss) == pytest.approx(sum(want) / 3, rel=1e-12)
    assert float(metrics["rm/margin"].total) == pytest.approx(1.5 - 0.5 + 0.5)  # r_c - r_r, as TRL logs it


def _trl_dpo_loss(loss_type, beta, log_probs, completion_mask, ref_chosen, ref_rejected):
    """TRL's own DPOTrainer._compute_loss on given per-token log-probs: a stand-in model returns them."""
    from collections import defaultdict

    from trl import DPOTrainer

    rows, width = log_probs.shape
    outputs = SimpleNamespace(log_probs=log_probs[:, 1:], entropy=torch.zeros(rows, width - 1),
                              mean_logits=torch.zeros(rows, width - 1),
                              is_top1=torch.zeros(rows, width - 1, dtype=torch.bool))
    accelerator = SimpleNamespace(device="cpu", gather=lambda x: x, gather_for_metrics=lambda x: x)
    trainer = SimpleNamespace(model=SimpleNamespace(training=True), accelerator=accelerator, aux_loss_enabled=False,
                              ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
                              loss_types=[loss_type], loss_weights=[1.0], beta=beta, use_weighting=False,
                              label_smoothing=0.0, _metrics=defaultdict(lambda: defaultdict(list)),
                              _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.ones(rows, width, dtype=torch.long), "attention_mask": torch.ones(rows, width),
              "completion_mask": completion_mask, "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
    loss = DPOTrainer._compute_loss(trainer, lambda **kw: outputs, inputs, False)
    return float(loss), {k: v[0] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "simpo"])
def test_preference_losses_and_metrics_match_trl(loss_type):
    pytest.importorskip("trl")
    from shardrl.trainer.dpo import preference_step

    g = torch.Generator().manual_seed(1)
    pairs, width = 5, 9
    mask = torch.zeros(2 * pairs, width, dtype=torch.long)  # completions of different lengths after a prompt
    for r in range(2 * pairs):
        mask[r, 3: 3 + int(torch.randint(1, width - 3, (1,), generator=g))] = 1
    log_probs = -torch.rand(2 * pairs, width, generator=g, dtype=torch.float64) * 3 * mask
    ref = -torch.rand(2 * pairs, generator=g, dtype=torch.float64) * 10
    params = PreferenceParams(beta=0.2, simpo_gamma=0.4)
    losses, metrics = preference_step(log_probs, mask, ref, loss_type, params)
    mine = {k: float(v.total / v.count) for k, v in metrics.items()}
    if loss_type == "simpo":  # TRL's CPO trainer, on the per-token mean log-probs it computes
        from trl.experimental.cpo import CPOTrainer

        avg = (log_probs * mask).sum(-1) / mask.sum(-1)
        trainer = SimpleNamespace(alpha=0.0, loss_type="simpo", beta=params.beta, simpo_gamma=params.simpo_gamma,
                                  label_smoothing=0.0, accelerator=SimpleNamespace(device="cpu"))
        trl_losses, chosen, rejected = CPOTrainer.cpo_loss(trainer, avg[0::2], avg[1::2])
        trl_loss = float(trl_losses.mean())
        trl = {"rewards/chosen": float(chosen.mean()), "rewards/rejected": float(rejected.mean()),
               "rewards/accuracies": float((chosen > rejected).double().mean()),
               "rewards/margins": float((chosen - rejected).mean()),
               "logps/chosen": float(avg[0::2].mean()), "logps/rejected": float(avg[1::2].mean())}
    else:
        # TRL lays a batch out [chosen..., rejected...]; ours interleaves pairs
        order = torch.cat([torch.arange(0, 2 * pairs, 2), torch.arange(1, 2 * pairs, 2)])
        trl_loss, trl = _trl_dpo_loss(loss_type, params.beta, log_probs[order], mask[order], ref[0::2], ref[1::2])
    assert float(losses.mean()) == pytest.approx(trl_loss, rel=1e-9)
    for key, value in mine.items():
        assert value == pytest.approx(trl[key], rel=1e-7, abs=1e-12), key  # TRL means accuracies in fp32


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _text(tok, ids, mask) -> str:
    return "".join(tok.decode([i]) for i, m in zip(ids, mask) if m)


def test_preference_rows_of_each_format_and_bad_rows_are_counted(tok, tmp_path):
    rows = tmp_path / "pairs.jsonl"
    conversation = [{"role": "user", "content": "1+1="}]
    good = [{"prompt": "1+2=", "chosen": "3", "rejected": "4"},  # plain strings
            {"prompt": conversation, "chosen": [{"role": "assistant", "content": "2"}],  # conversational
             "rejected": [{"role": "assistant", "content": "5"}]},
            {"chosen": conversation + [{"role": "assistant", "content": "2"}],  # the prompt implicit
             "rejected": conversation + [{"role": "assistant", "content": "11"}]}]
    bad = [{"prompt": "x", "chosen": "1", "rejected": "1"}, {"prompt": "x", "chosen": "1"},
           {"prompt": "x", "chosen": " ", "rejected": "2"}]
    rows.write_text("".join(json.dumps(r) + "\n" for r in good + bad))
    with pytest.raises(ValueError, match=r"pairs.jsonl: row 4: chosen and rejected are the same"):
        load_preference_dataset([str(rows)], tok, 64)
    data = load_preference_dataset([str(rows)], tok, 64, skip_bad_rows=True)
    assert len(data) == 3 and data.stats["bad"] == 3
    # the loss is on the completion (and its end) only; the prompt, its template and header are context. Plain
    # strings are plain text (the prompt as an RL run takes it, the completion ended by EOS); chats are templated
    assert [(_text(tok, it["chosen_ids"], it["chosen_mask"]), _text(tok, it["rejected_ids"], it["rejected_mask"]))
            for it in data.items] == [("3<eos>", "4<eos>"), ("2\n", "5\n"), ("2\n", "11\n")]
    assert tok.decode(data.items[0]["chosen_ids"]) == "1+2=3<eos>"
    assert tok.decode(data.items[1]["chosen_ids"]) == "user: 1+1=\nassistant: 2\n"
    batch = collate_pairs(data.items, tok.pad_token_id)
    assert batch["input_ids"].shape[0] == 6 and batch["loss_mask"][1].sum() == 2  # chosen, rejected, chosen, ...
    with pytest.raises(ValueError, match=r"row 2 has 24 tokens, more than data.max_length=10"):
        load_preference_dataset([str(rows)], tok, 10, skip_bad_rows=True)


def test_an_sft_file_given_to_dpo_says_what_dpo_reads_not_skip_bad_rows(tok, tmp_path):
    """skip_bad_rows would drop every row of it: the error says which columns the trainer reads and which the
    file has."""
    rows = tmp_path / "sft.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "1+1="},
                                             {"role": "assistant", "content": "2"}]}) + "\n")
    for skip in (False, True):
        with pytest.raises(ValueError) as error:
            load_preference_dataset([str(rows)], tok, 64, skip_bad_rows=skip)
        assert str(error.value) == (
            f"{rows}: no row has the columns for shardrl dpo and shardrl rm: 'chosen' and 'rejected' "
            "(data.chosen_key, data.rejected_key), 'prompt' (data.prompt_key) optional; the rows' keys: ['messages']; "
            "this looks like an SFT file (messages), a file for shardrl sft")


def test_chat_pairs_need_a_template_and_known_roles(tok, tmp_path):
    rows = tmp_path / "pairs.jsonl"
    prompt = [{"role": "user", "content": "1+1="}]
    rows.write_text(json.dumps({"chosen": prompt + [{"role": "assistant", "content": "2"}],
                                "rejected": prompt + [{"role": "Assistant", "content": "3"}]}) + "\n")
    with pytest.raises(ValueError, match=r"row 1: rejected\[1\]: role 'Assistant' is not one of system, user, "
                                         r"assistant, tool; roles are lower case: 'assistant'"):
        load_preference_dataset([str(rows)], tok, 64)
    rows.write_text(json.dumps({"prompt": prompt, "chosen": "2", "rejected": "3"}) + "\n")
    bare = build_char_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match=r"pairs\.jsonl: row 1: the row is chat messages but the tokenizer has no "
                                         r"chat template.*set model\.chat_template"):
        load_preference_dataset([str(rows)], bare, 64, skip_bad_rows=True)
    rows.write_text(json.dumps({"chosen": "2", "rejected": "3"}) + "\n")  # plain strings stay plain text
    assert bare.decode(load_preference_dataset([str(rows)], bare, 64).items[0]["chosen_ids"]) == "2"


def test_plain_pairs_start_with_the_tokenizers_bos_as_trl_tokenizes_them(tmp_path):
    """TRL's DPO and reward trainers tokenize a plain prompt with the tokenizer's special tokens: a Llama or Gemma
    tokenizer's BOS comes first (a template's chat renders its own)."""
    rows = tmp_path / "pairs.jsonl"
    rows.write_text(json.dumps({"prompt": "1+2=", "chosen": "3", "rejected": "4"}) + "\n")
    tok = build_char_tokenizer(add_bos=True)
    assert tok("1")["input_ids"][0] == tok.bos_token_id
    item = load_preference_dataset([str(rows)], tok, 64).items[0]
    assert [tok.decode(item[k]) for k in ("chosen_ids", "rejected_ids")] == ["<bos>1+2=3<eos>", "<bos>1+2=4<eos>"]
    assert [_text(tok, item[f"{k}_ids"], item[f"{k}_mask"]) for k in ("chosen", "rejected")] == ["3<eos>", "4<eos>"]


PAIRS = [({"role": "user", "content": f"{a}+{b}="}, str(a + b), str(a + b + 1 + b) + "?" * (a % 3))
         for a in range(4) for b in range(2)]  # 8 pairs; completions of different lengths


def _pair_items(tok):
    from shardrl.data.chat import tokenize_chat

    items = []
    for prompt, chosen, rejected in PAIRS:
        item = {}
        for name, text in (("chosen", chosen), ("rejected", rejected)):
            item[f"{name}_ids"], item[f"{name}_mask"] = tokenize_chat(
                tok, [prompt, {"role": "assistant", "content": text}], train_from=1)
        items.append(item)
    return items


def _plain_log_probs(model, batch) -> torch.Tensor:
    """Each row's summed log-prob of its loss tokens under a plain HF forward (B,)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    token = torch.log_softmax(logits.float(), -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    return (token * batch["loss_mask"][:, 1:]).sum(-1)


def _preference_gradients(kind: str, layouts: dict, loss_type: str = "sigmoid") -> dict:
    """The DPO (`kind` "dpo", a reference other than the policy) or reward-model ("rm") step's loss, metrics and
    gradients per engine layout on this rank's share of PAIRS, and a plain loop's on all of them."""
    from shardrl.config.schema import EngineConfig, ModelConfig, OptimConfig
    from shardrl.engine import build_engine
    from shardrl.engine.model import build_causal_lm, load_hf_config
    from shardrl.testing import record_grads
    from shardrl.trainer.dpo import dpo_loss_fn
    from shardrl.trainer.rm import reward_pair_step, rm_loss_fn

    tok = build_char_tokenizer()
    items = _pair_items(tok)
    whole = collate_pairs(items, tok.pad_token_id)
    params = PreferenceParams(beta=0.5, simpo_gamma=0.3)
    tiny = TINY_MODELS["qwen2"]
    head = "score" if kind == "rm" else "lm"
    if kind == "dpo":  # the reference: another random model, so its log-probs do not cancel the policy's
        ref = build_causal_lm(load_hf_config(None, tiny), None, "cpu", torch.float32, seed=7)
        with torch.no_grad():
            whole["ref_log_probs"] = _plain_log_probs(ref, whole)
    out = {}
    for name, engine_kwargs in layouts.items():
        engine = build_engine(ModelConfig(tiny=tiny), EngineConfig(param_dtype="float32", **engine_kwargs),
                              OptimConfig(lr=1e-3, clip_grad=0.0), head=head)
        grads = record_grads(engine)
        mesh = engine.mesh
        mine = whole.index([r for p in range(mesh.dp_rank, len(items), mesh.dp_size) for r in (2 * p, 2 * p + 1)])
        loss_fn = dpo_loss_fn(loss_type, params) if kind == "dpo" else rm_loss_fn(0.05)
        metrics = engine.train_batch(mine, loss_fn, group_size=2)
        out[name] = {"metrics": metrics, "grads": grads[0]}
    # the plain loop: every pair at once, the loss's mean over pairs
    model = build_causal_lm(load_hf_config(None, tiny, task="seq_cls" if kind == "rm" else "causal_lm"), None,
                            "cpu", torch.float32, seed=0, sequence_classification=kind == "rm")
    if kind == "dpo":
        logps = _plain_log_probs(model, whole)
        losses, metrics = preference_step_from_sums(logps, whole, loss_type, params)
    else:
        hidden = model.model(input_ids=whole["input_ids"], attention_mask=whole["attention_mask"]).last_hidden_state
        last = whole["attention_mask"].sum(-1) - 1
        scores = model.score(hidden)[torch.arange(len(last)), last].squeeze(-1)
        losses, metrics = reward_pair_step(scores, 0.05)
        metrics = {f"rm/{k}" if "/" not in k else k: v for k, v in metrics.items()}
    losses.mean().backward()
    out["plain"] = {"metrics": {"loss": float(losses.mean().detach())} | {k: float(v.total / v.count) for k, v in metrics.items()},
                    "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
    return out


def preference_step_from_sums(logps, batch, loss_type, params):
    """The loss of summed log-probs `logps` (2P,), written out here (the engine's goes through preference_step)."""
    mode = PREFERENCE_LOSSES[loss_type]
    counts = batch["loss_mask"].sum(-1).double()
    ref = batch["ref_log_probs"]
    losses, cr, rj, lc, lr = mode.fn(logps[0::2], logps[1::2], ref[0::2], ref[1::2], counts[0::2], counts[1::2], params)
    n = torch.tensor(float(len(losses)))
    from shardrl.metrics import SumCount

    return losses, {"rewards/chosen": SumCount(cr.sum(), n), "rewards/rejected": SumCount(rj.sum(), n),
                    "rewards/accuracies": SumCount((cr > rj).double().sum(), n),
                    "rewards/margins": SumCount((cr - rj).sum(), n), "logps/chosen": SumCount(lc.detach().sum(), n),
                    "logps/rejected": SumCount(lr.detach().sum(), n)}


LAYOUTS = {"one": {"micro_batch_size_per_gpu": 8}, "pair_each": {"micro_batch_size_per_gpu": 1},
           "dynamic": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 110}}
SP2 = {"sp2": {"micro_batch_size_per_gpu": 3, "ulysses_sequence_parallel_size": 2}}


def _assert_like_plain(out: dict, names) -> None:
    plain = out["plain"]
    for name in names:
        metrics = out[name]["metrics"]
        for key, value in plain["metrics"].items():
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), f"{name}: {key}"
        grads = out[name]["grads"]
        for key, grad in plain["grads"].items():
            torch.testing.assert_close(grads[key], grad, atol=1e-5 * float(grad.abs().max()) + 1e-7, rtol=1e-4,
                                       msg=f"{name}: {key}")


PAIR_STEPS = {  # world size -> the (kind, layouts, loss type) cases the tests below compare with the plain loop
    1: [("dpo", "one process", "sigmoid"), ("rm", "one process", "sigmoid")],
    2: [("dpo", "two processes", "sigmoid"), ("rm", "two processes", "sigmoid"), ("dpo", "dynamic", "ipo"),
        ("dpo", "dynamic", "simpo")],
}
PAIR_LAYOUTS = {"one process": LAYOUTS, "two processes": LAYOUTS | SP2, "dynamic": {"dynamic": LAYOUTS["dynamic"]}}


def _each_preference_gradients(cases: list[tuple[str, str, str]]) -> dict:
    """`_preference_gradients` for each (kind, layouts' name, loss type), one after the other on the same processes."""
    return {case: _preference_gradients(case[0], PAIR_LAYOUTS[case[1]], case[2]) for case in cases}


@pytest.fixture(scope="module")
def pair_steps():
    """world size -> case -> `_preference_gradients`; each world is spawned once, on first use, for all its cases."""
    class Lazy(dict):
        def __missing__(self, world):
            self[world] = run_distributed(_each_preference_gradients, world, PAIR_STEPS[world])
            return self[world]
    return Lazy()


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", ["dpo", "rm"])
def test_the_pair_step_is_a_plain_loops_on_one_process(pair_steps, kind):
    out = pair_steps[1][kind, "one process", "sigmoid"]
    assert out["pair_each"]["metrics"]["num_micro_batches"] == 8  # a pair per micro-batch: both rows together
    assert 1 < out["dynamic"]["metrics"]["num_micro_batches"] < 8
    _assert_like_plain(out, LAYOUTS)


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", ["dpo", "rm"])
def test_the_pair_step_is_the_same_on_two_processes_and_with_sequence_parallelism(pair_steps, kind):
    out = pair_steps[2][kind, "two processes", "sigmoid"]
    _assert_like_plain(out, [*LAYOUTS, "sp2"])


@pytest.mark.multiproc
@pytest.mark.parametrize("loss_type", ["ipo", "simpo"])
def test_ipo_and_simpo_steps_are_a_plain_loops(pair_steps, loss_type):
    out = pair_steps[2]["dpo", "dynamic", loss_type]
    _assert_like_plain(out, ["dynamic"])


def _sum_pairs(folder) -> tuple:
    """Addition prompts whose answer is chosen over the answer followed by a stray digit (a preference a tiny model
    learns in a few steps, and one that holds on prompts it has not seen): 40 pairs to train on, 15 held out."""
    rows = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": f"{a + b}{(a * 7 + b) % 10}"}
            for a in range(10) for b in range(10 - a)]
    train, val = folder / "pairs.jsonl", folder / "held_out.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for i, r in enumerate(rows) if i % 11 not in (3, 7)))
    val.write_text("".join(json.dumps(r) + "\n" for i, r in enumerate(rows) if i % 11 in (3, 7)))
    return train, val


def _common(model_dir, pairs, run_dir) -> list[str]:
    train, val = pairs
    return [f"model.path={model_dir}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
            "data.batch_size=16", "engine.param_dtype=float32", "optim.lr=3e-3", "trainer.logger=[jsonl]",
            f"trainer.output_dir={run_dir}", "trainer.device=cpu"]


def test_a_bad_dpo_reference_or_rm_with_lora_is_one_error_line_before_any_model_loads(tmp_path, capsys, monkeypatch):
    """dpo.ref_model_path is checked as model.path is, under its own key: a missing folder, and a vocabulary smaller
    than the tokenizer's (was: "model.path=... is not a folder", and an IndexError mid-step). `shardrl rm` with
    model.lora is refused as `shardrl plan --trainer rm` refuses it (was: the plan passed it, the run failed on
    "this engine has a 'score' head")."""
    import transformers

    import shardrl.trainer.offline as offline
    from shardrl.cli import main
    from shardrl.testing import save_char_model

    monkeypatch.setattr(offline, "build_engine", lambda *a, **k: pytest.fail("a model was loaded"))
    save_char_model(tmp_path / "model")  # 53 tokens
    small_vocab = tmp_path / "small_vocab"
    config = transformers.AutoConfig.from_pretrained(tmp_path / "model")
    config.vocab_size = 20
    config.save_pretrained(small_vocab)
    common = _common(tmp_path / "model", _sum_pairs(tmp_path), tmp_path / "run") + ["trainer.total_steps=1"]

    def error_of(argv: list[str]) -> str:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return [line for line in err.splitlines() if line.startswith("error: ")][0]

    assert error_of(["dpo", *common, "dpo.ref_model_path=/nonexistent"]) == (
        "error: dpo.ref_model_path='/nonexistent' is not a folder; give a local Hugging Face model folder, or a hub "
        "id (org/name, e.g. Qwen/Qwen2.5-0.5B-Instruct)")
    resize = (f"has a vocabulary of 20 tokens, smaller than the tokenizer's 53 (from '{tmp_path / 'model'}'): ids >= "
              "20 have no embedding. Use the tokenizer made for this model (model.tokenizer_path), or grow the model's "
              "embeddings to match: model.resize_token_embeddings(53); model.save_pretrained(folder)")
    assert error_of(["dpo", *common, f"dpo.ref_model_path={small_vocab}"]) == (
        f"error: dpo.ref_model_path='{small_vocab}' {resize}")
    assert error_of(["dpo", *common, f"model.path={small_vocab}", f"model.tokenizer_path={tmp_path / 'model'}"]) == (
        f"error: model.path='{small_vocab}' {resize}")
    no_lora = ("error: model.lora.rank=4: the reward-model trainer (shardrl rm) does not support LoRA (it trains the "
               "whole model and its new score head); remove model.lora (set model.lora.rank=0 or drop it)")
    assert error_of(["plan", *common, "--trainer", "rm", "model.lora.rank=4"]) == no_lora
    assert error_of(["rm", *common, "model.lora.rank=4"]) == no_lora
    assert not (tmp_path / "run").exists()


@pytest.mark.multiproc
def test_dpo_learns_the_preferences_resumes_and_exports(tmp_path):
    import transformers

    from shardrl.cli import main
    from shardrl.testing import save_char_model

    save_char_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    common = _common(tmp_path / "model", _sum_pairs(tmp_path), run_dir) + [
        "trainer.val_freq=10", "trainer.save_freq=10"]
    assert main(["dpo", *common, "trainer.total_steps=10"]) == 0
    assert main(["dpo", *common, "trainer.total_steps=30", "trainer.resume=auto", "trainer.export_hf=true"]) == 0
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in records] == list(range(1, 31))  # resumed at 10, nothing repeated or lost
    # before the first update the policy is the reference: every implicit reward is 0 and the loss ln 2
    assert records[0]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert records[0]["rewards/margins"] == pytest.approx(0, abs=1e-6)
    val = [r for r in records if "val/loss" in r]
    assert [r["step"] for r in val] == [10, 20, 30]
    # on held-out prompts: the loss from ln 2 to under half of it, every pair ranked right
    assert val[0]["val/loss"] > val[1]["val/loss"] > val[2]["val/loss"]
    assert val[-1]["val/loss"] < 0.5 * math.log(2) and val[-1]["val/rewards/accuracies"] >= 0.9
    assert val[-1]["val/logps/chosen"] > val[-1]["val/logps/rejected"]
    assert records[-1]["rewards/margins"] > records[4]["rewards/margins"] > 0
    assert transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf_model").config.architectures == [
        "Qwen2ForCausalLM"]


@pytest.mark.multiproc
def test_a_dpo_run_with_another_loss_type_and_rpo_alpha_logs_its_nll(tmp_path):
    """At the first step the policy is the reference: hinge's loss is relu(1 - 0) = 1, plus rpo_alpha times the
    chosen tokens' NLL the step logs."""
    from shardrl.cli import main
    from shardrl.testing import save_char_model

    save_char_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    common = _common(tmp_path / "model", _sum_pairs(tmp_path), run_dir)
    assert main(["dpo", *common, "trainer.total_steps=2", "trainer.val_freq=2", "dpo.loss_type=hinge",
                 "dpo.rpo_alpha=0.5"]) == 0
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert records[0]["dpo/nll_loss"] > 1  # a random model's -log p per token (53 tokens: about ln 53)
    assert records[0]["dpo/loss"] == pytest.approx(1 + 0.5 * records[0]["dpo/nll_loss"], rel=1e-6)
    assert records[1]["val/nll_loss"] > 0 and "val/loss" in records[1]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2


@pytest.mark.multiproc
def test_a_reward_model_learns_and_scores_an_rl_run(tmp_path):
    import transformers

    from shardrl.cli import main
    from shardrl.testing import save_char_model, small_demo_run
    from shardrl.trainer.demo import prepare_demo_assets

    save_char_model(tmp_path / "model")
    run_dir = tmp_path / "rm_run"
    common = _common(tmp_path / "model", _sum_pairs(tmp_path), run_dir)
    assert main(["rm", *common, "trainer.total_steps=30", "trainer.val_freq=10", "trainer.export_hf=true"]) == 0
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    val = [r["val/accuracy"] for r in records if "val/accuracy" in r]
    assert len(val) == 3 and val[-1] >= 0.9 and records[-1]["rm/loss"] < 0.5 * records[0]["rm/loss"]
    exported = transformers.AutoConfig.from_pretrained(run_dir / "hf_model")
    assert exported.architectures == ["Qwen2ForSequenceClassification"] and exported.num_labels == 1
    # the folder is a reward model an RL run scores with
    assets = prepare_demo_assets(tmp_path / "demo")
    rl_dir = tmp_path / "rl"
    assert main(["train", *small_demo_run(assets, rl_dir, "trainer.total_steps=1", "trainer.logger=[jsonl]",
                                          f"reward.model_path={run_dir / 'hf_model'}", "trainer.device=cpu")]) == 0
    step = json.loads(open(rl_dir / "metrics.jsonl").readline())
    assert step["reward/max"] > step["reward/min"] and {step["reward/max"], step["reward/min"]} != {0.0, 1.0}


@pytest.mark.multiproc
@pytest.mark.parametrize("nproc", [1, 2])
def test_ctrl_c_stops_an_offline_trainer_as_it_stops_train(tmp_path, nproc):
    """`shardrl dpo` (any offline trainer: one loop) stopped by Ctrl-C: one line, exit status 130, the summary of
    the steps done; on two processes the launcher passes it on and the ranks stop quietly."""
    from shardrl.testing import interrupt_after_first_step, save_char_model

    save_char_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    args = _common(tmp_path / "model", _sum_pairs(tmp_path), run_dir) + ["trainer.total_steps=100000",
                                                                         "data.batch_size=4"]
    code = interrupt_after_first_step(["dpo", *args, "--nproc-per-node", str(nproc)], run_dir, tmp_path / "stderr.txt")
    metrics = run_dir / "metrics.jsonl"
    err = (tmp_path / "stderr.txt").read_text()
    assert code == 130, err[-3000:]
    steps = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert [line for line in err.splitlines() if "interrupted" in line.lower()] == [
        f"interrupted (Ctrl-C) after {steps} of 100000 steps; summary {run_dir / 'summary.json'}, "
        f"loss curve {run_dir / 'loss_curve.png'}; no checkpoint was saved (trainer.save_freq=0): these steps cannot "
        "be resumed"]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == steps >= 1


def test_an_implicit_prompt_pair_with_different_user_turns_is_a_bad_row(tok, tmp_path):
    """Without a prompt column the shared messages are the prompt: chosen and rejected answering different user
    turns compare answers to different questions, so the row is refused (counted with skip_bad_rows)."""
    rows = tmp_path / "pairs.jsonl"
    good = {"chosen": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}],
            "rejected": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "3"}]}
    bad = {"chosen": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}],
           "rejected": [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]}
    rows.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError) as error:
        load_preference_dataset([str(rows)], tok, 64)
    assert str(error.value) == (
        f"{rows}: row 2: without a 'prompt' column, 'chosen' and 'rejected' must share everything but the last "
        "assistant turn; they differ at message 0 (chosen[0] is a 'user' turn, rejected[0] a 'user' turn) "
        "(data.skip_bad_rows=true drops such rows)")
    data = load_preference_dataset([str(rows)], tok, 64, skip_bad_rows=True)
    assert len(data) == 1 and data.stats["bad"] == 1
