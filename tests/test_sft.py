"""`shardrl sft`: conversations tokenized with the loss on the assistant's tokens only; the engine's SFT step
gives a plain HF loop's `labels=` loss and gradients, the same on 1 and 2 processes and however the batch is cut
into micro-batches; a run learns, checkpoints, resumes and exports."""

from __future__ import annotations

import json

import pytest
import torch

from shardrl.data.chat import collate_chats, load_chat_dataset, tokenize_chat
from shardrl.testing import TINY_MODELS, run_distributed
from shardrl.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def masked_text(tok, ids, mask, want: int) -> str:
    return "".join(tok.decode([i]) for i, m in zip(ids, mask) if m == want)


def test_only_the_assistants_turns_are_targets(tok):
    chat = [{"role": "system", "content": "add"}, {"role": "user", "content": "1+2="},
            {"role": "assistant", "content": "3"}, {"role": "tool", "content": "ok"},
            {"role": "assistant", "content": "done"}]
    ids, mask = tokenize_chat(tok, chat)
    assert tok.decode(ids) == tok.apply_chat_template(chat, tokenize=False)  # the whole chat, as rendered
    # each assistant reply and its end of turn (the template's newline); headers, system, user and tool are context
    assert masked_text(tok, ids, mask, 1) == "3\ndone\n"
    assert masked_text(tok, ids, mask, 0) == "system: add\nuser: 1+2=\nassistant: tool: ok\nassistant: "


def test_rows_of_either_format_and_bad_rows_are_counted(tok, tmp_path):
    rows = tmp_path / "rows.jsonl"
    good = [{"prompt": "1+2=", "response": "3"}, {"messages": [{"role": "user", "content": "2+2="},
                                                               {"role": "assistant", "content": "4"}]}]
    bad = [{"prompt": "1+1="}, {"prompt": "1+1=", "response": " "}, {"messages": [{"role": "user", "content": "x"}]}]
    rows.write_text("".join(json.dumps(r) + "\n" for r in good + bad))
    with pytest.raises(ValueError, match=r"rows.jsonl: row 3: the row has neither 'messages' nor \['response'\] "
                                         r"\(or 'completion'\); its columns: \['prompt'\]"):
        load_chat_dataset([str(rows)], tok, 64)
    data = load_chat_dataset([str(rows)], tok, 64, skip_bad_rows=True)
    assert len(data) == 2 and data.stats["bad"] == 3 and data.stats["rows"] == 5
    assert [masked_text(tok, it["input_ids"], it["loss_mask"], 1) for it in data.items] == ["3\n", "4\n"]
    with pytest.raises(ValueError, match=r"row 1 has 24 tokens, more than data.max_length=8"):
        load_chat_dataset([str(rows)], tok, 8, skip_bad_rows=True)
    cut = load_chat_dataset([str(rows)], tok, 23, truncation="right", skip_bad_rows=True)  # keeps each reply
    assert [len(it["input_ids"]) for it in cut.items] == [23, 23] and cut.stats["truncated"] == 2
    with pytest.raises(ValueError, match=r"no usable rows .*'too_long': 2"):  # both over 23 tokens: dropped
        load_chat_dataset([str(rows)], tok, 23, truncation="drop", skip_bad_rows=True)


def test_trls_prompt_completion_rows_train_their_completion_by_default(tok, tmp_path):
    """TRL's prompt-completion column is `completion`: read when a row has no `response` and data.response_key is
    unset; a row holding both trains on `response`; a response_key names the one column read."""
    rows = _write(tmp_path / "rows.jsonl", [{"prompt": "1+2=", "completion": "3"},
                                            {"prompt": "2+2=", "response": "4", "completion": "5"}])
    data = load_chat_dataset([rows], tok, 64)
    assert [masked_text(tok, it["input_ids"], it["loss_mask"], 1) for it in data.items] == ["3\n", "4\n"]
    named = load_chat_dataset([rows], tok, 64, response_key="completion")
    assert [masked_text(tok, it["input_ids"], it["loss_mask"], 1) for it in named.items] == ["3\n", "5\n"]
    with pytest.raises(ValueError, match=r"row 1: the row has neither 'messages' nor \['response'\]; its columns"):
        load_chat_dataset([rows], tok, 64, response_key="response")
    from shardrl.config.registry import TRAINERS, load_config

    assert load_config(None, (), TRAINERS["sft"].config).data.response_key is None


def _write(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_a_prompt_holding_assistant_turns_trains_the_response_only(tok, tmp_path):
    """TRL trains a prompt/completion row's completion only; the prompt's earlier assistant turn is context. A
    `messages` row trains every assistant turn."""
    prompt = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
              {"role": "user", "content": "again"}]
    rows = _write(tmp_path / "rows.jsonl", [{"prompt": prompt, "response": "2 again"},
                                            {"messages": [*prompt, {"role": "assistant", "content": "2 again"}]}])
    data = load_chat_dataset([rows], tok, 64)
    assert [masked_text(tok, it["input_ids"], it["loss_mask"], 1) for it in data.items] == ["2 again\n",
                                                                                          "2\n2 again\n"]
    assert data.items[0]["input_ids"] == data.items[1]["input_ids"]  # the same text, only the mask differs


def test_chat_rows_without_a_chat_template_are_refused_naming_model_chat_template(tmp_path):
    """Without a template a chat trained as its contents run together ('1+1=2'): no roles, no end of turn. A row
    of plain strings stays plain text."""
    bare = build_char_tokenizer()
    bare.chat_template = None
    chat = {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}
    listed = {"prompt": [{"role": "user", "content": "1+1="}], "response": "2"}
    for row in (chat, listed):
        rows = _write(tmp_path / "chat.jsonl", [row])
        for skip in (False, True):  # a setting to fix, not a row to drop
            with pytest.raises(ValueError, match=r"chat\.jsonl: row 1: the row is chat messages but the tokenizer "
                                                 r"has no chat template.*set model\.chat_template"):
                load_chat_dataset([rows], bare, 64, skip_bad_rows=skip)
    plain = load_chat_dataset([_write(tmp_path / "plain.jsonl", [{"prompt": "1+1=", "response": "2"}])], bare, 64)
    assert bare.decode(plain.items[0]["input_ids"]) == "1+1=2<eos>"


def test_a_plain_row_starts_with_the_tokenizers_bos_and_ends_with_eos_as_trl_trains_it(tmp_path):
    """TRL tokenizes a plain prompt-completion row with the tokenizer's special tokens and appends EOS to the
    completion: without the EOS the model never learns to stop."""
    rows = _write(tmp_path / "plain.jsonl", [{"prompt": "1+1=", "completion": "2"}])
    for tok, bos in ((build_char_tokenizer(add_bos=True), "<bos>"), (build_char_tokenizer(), "")):
        tok.chat_template = None
        item = load_chat_dataset([rows], tok, 64).items[0]
        assert tok.decode(item["input_ids"]) == f"{bos}1+1=2<eos>"
        assert masked_text(tok, item["input_ids"], item["loss_mask"], 1) == "2<eos>"
        assert item["input_ids"][:2] == tok("1+1=")["input_ids"][:2]  # what TRL's tokenizer(prompt) starts with


def test_model_chat_template_sets_the_tokenizers_template_from_text_or_a_file(tmp_path):
    from shardrl.config.schema import SFTConfig
    from shardrl.tokenizer import CHAT_TEMPLATE, load_tokenizer

    bare = build_char_tokenizer()
    bare.chat_template = None
    bare.save_pretrained(tmp_path / "tok")
    cfg = SFTConfig()
    cfg.model.tokenizer_path = str(tmp_path / "tok")
    assert not getattr(load_tokenizer(cfg), "chat_template", None)
    (tmp_path / "template.jinja").write_text(CHAT_TEMPLATE)
    for value in (CHAT_TEMPLATE, str(tmp_path / "template.jinja")):
        cfg.model.chat_template = value
        tokenizer = load_tokenizer(cfg)
        item = load_chat_dataset([_write(tmp_path / "c.jsonl", [{"messages": [
            {"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}])], tokenizer, 64).items[0]
        assert tokenizer.decode(item["input_ids"]) == "user: 1+1=\nassistant: 2\n"
    cfg.model.chat_template = str(tmp_path / "missing.jinja")
    with pytest.raises(ValueError, match=r"model\.chat_template='.*missing\.jinja' is neither a file nor a Jinja"):
        load_tokenizer(cfg)


def test_a_chat_template_with_a_syntax_error_or_failing_every_chat_is_the_templates_fault(tmp_path):
    """A Jinja syntax error in model.chat_template is refused when set, naming the key and the template's line (was:
    "row 1: the chat template fails ... (data.skip_bad_rows=true drops such rows)", advice that drops every row);
    a template that raises on every chat is the template's fault too, with or without skip_bad_rows."""
    from shardrl.config.schema import SFTConfig
    from shardrl.tokenizer import load_tokenizer

    build_char_tokenizer().save_pretrained(tmp_path / "tok")
    cfg = SFTConfig()
    cfg.model.tokenizer_path = str(tmp_path / "tok")
    cfg.model.chat_template = "{% for m in messages %}{{ m.content }}\n{% endfor\n"
    with pytest.raises(ValueError, match=r"^model\.chat_template is not a valid Jinja template: .* at line 2 of "
                                         r"the template; fix the template$"):
        load_tokenizer(cfg)
    (tmp_path / "bad.jinja").write_text(cfg.model.chat_template)
    cfg.model.chat_template = str(tmp_path / "bad.jinja")
    with pytest.raises(ValueError, match=r"^model\.chat_template='.*bad\.jinja' is not a valid Jinja template: "):
        load_tokenizer(cfg)
    cfg.model.chat_template = "{{ raise_exception('no system message') }}"  # compiles, fails on every chat
    tokenizer = load_tokenizer(cfg)
    rows = _write(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "1+1="},
                                                       {"role": "assistant", "content": "2"}]}] * 3)
    for skip in (False, True):
        with pytest.raises(ValueError) as e:
            load_chat_dataset([rows], tokenizer, 64, skip_bad_rows=skip)
        assert "the chat template fails on every chat, even a plain user/assistant exchange: " in str(e.value)
        assert "model.chat_template" in str(e.value) and "skip_bad_rows" not in str(e.value)


@pytest.mark.parametrize("role, message", [
    ("robot", r"row 1: messages\[1\]: role 'robot' is not one of system, user, assistant, tool \("),
    (None, r"row 1: messages\[1\]: role None is not one of system, user, assistant, tool \("),
    ("Assistant", r"row 1: messages\[1\]: role 'Assistant' is not one of system, user, assistant, tool; roles "
                  r"are lower case: 'assistant' \(")])
def test_an_unknown_role_is_refused_naming_row_and_message(tok, tmp_path, role, message):
    rows = _write(tmp_path / "rows.jsonl", [{"messages": [{"role": "user", "content": "1+1="},
                                                          {"role": role, "content": "2"}]},
                                            {"prompt": [{"role": role, "content": "x"}], "response": "2"},
                                            {"prompt": "1+1=", "response": "2"}])
    with pytest.raises(ValueError, match=message):
        load_chat_dataset([rows], tok, 64)
    data = load_chat_dataset([rows], tok, 64, skip_bad_rows=True)
    assert (len(data), data.stats["bad"]) == (1, 2)


# renders an assistant's tool calls as `call name(arguments)`, as a tool model's template does (the newline is an
# expression: one right after a block tag is trimmed, HF rendering with trim_blocks)
TOOL_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% if m.tool_calls %}{% for c in m.tool_calls %}call "
    "{{ c['function']['name'] }}({{ c['function']['arguments'] }}){% endfor %}{% else %}{{ m['content'] }}{% endif %}"
    "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


def test_an_assistant_turn_of_tool_calls_is_trained_on(tmp_path):
    """OpenAI's / TRL's tool-calling rows: an assistant turn whose content is null and whose tool_calls the template
    renders; a tool turn answers it."""
    tool_tok = build_char_tokenizer()
    tool_tok.chat_template = TOOL_TEMPLATE
    call = {"type": "function", "function": {"name": "add", "arguments": "1,1"}}
    chat = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "2", "tool_call_id": "c1"},
            {"role": "assistant", "content": "2", "tool_calls": []}]  # (an empty list, as some exports write: no calls)
    bad = [{"messages": [chat[0], {"role": "assistant", "content": None}]},
           {"messages": [chat[0], {"role": "user", "content": None, "tool_calls": [call]}]},
           {"messages": [chat[0], {"role": "assistant", "content": " "}]}]
    rows = _write(tmp_path / "tools.jsonl", [{"messages": chat}, *bad])
    data = load_chat_dataset([rows], tool_tok, 128, skip_bad_rows=True)
    item = data.items[0]
    assert tool_tok.decode(item["input_ids"]) == "user: 1+1=\nassistant: call add(1,1)\ntool: 2\nassistant: 2\n"
    assert masked_text(tool_tok, item["input_ids"], item["loss_mask"], 1) == "call add(1,1)\n2\n"
    assert data.stats["bad"] == 3
    for number, message in ((2, r"messages\[1\]: content must be a string \(null only on an assistant message "
                                 r"with tool_calls\); found None"),
                            (3, r"messages\[1\]: only an assistant message calls tools; this one's role is 'user'"),
                            (4, r"messages\[1\]: the assistant's reply is empty")):
        only = _write(tmp_path / "one.jsonl", [bad[number - 2]])
        with pytest.raises(ValueError, match=rf"one\.jsonl: row 1: {message}"):
            load_chat_dataset([only], tool_tok, 128)


def test_an_unparsable_line_is_dropped_and_counted_with_skip_bad_rows(tok, tmp_path):
    good = json.dumps({"prompt": "1+1=", "response": "2"})
    rows = _write(tmp_path / "rows.jsonl", [good, '{"prompt": "2+2=", "response": ', good])
    with pytest.raises(ValueError, match=r"rows\.jsonl: row 2: not valid JSON \(Expecting value at column 32\) "
                                         r"\(data\.skip_bad_rows=true drops such rows\)"):
        load_chat_dataset([rows], tok, 64)
    data = load_chat_dataset([rows], tok, 64, skip_bad_rows=True)
    assert (len(data), data.stats["bad"], data.stats["rows"]) == (2, 1, 3)


def test_a_preference_file_given_to_sft_says_what_sft_reads(tok, tmp_path):
    rows = _write(tmp_path / "pairs.jsonl", [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}] * 2)
    with pytest.raises(ValueError, match=r"pairs\.jsonl: no row has the columns for shardrl sft: 'messages' "
                                         r"\(data\.messages_key\), or 'prompt' and 'response' .*; the rows' keys: "
                                         r"\['chosen', 'prompt', 'rejected'\]; this looks like a preference file "
                                         r"\(prompt/chosen/rejected\), a file for shardrl dpo and shardrl rm$"):
        load_chat_dataset([rows], tok, 64, skip_bad_rows=True)


CHATS = [[{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)},
          {"role": "user", "content": "again"}, {"role": "assistant", "content": f"{a + b} again" * (a % 3 + 1)}]
         for a in range(4) for b in range(2)]  # 8 chats, two assistant turns each, lengths vary


def _sft_gradients(layouts: dict) -> dict:
    """The SFT step's loss and gradients per engine layout on this rank's share of CHATS, and a plain HF loop's
    (rank 0 of the world only, on all of them)."""
    from shardrl.config.schema import EngineConfig, ModelConfig, OptimConfig
    from shardrl.engine import build_engine
    from shardrl.engine.model import build_causal_lm, load_hf_config
    from shardrl.testing import record_grads
    from shardrl.trainer.sft import sft_loss

    tok = build_char_tokenizer()
    items = [dict(zip(("input_ids", "loss_mask"), tokenize_chat(tok, chat))) for chat in CHATS]
    whole = collate_chats(items, tok.pad_token_id)
    out = {}
    for name, engine_kwargs in layouts.items():
        engine = build_engine(ModelConfig(tiny=TINY_MODELS["qwen2"]), EngineConfig(param_dtype="float32",
                              **engine_kwargs), OptimConfig(lr=1e-3, clip_grad=0.0))
        grads = record_grads(engine)
        mine = collate_chats(items[engine.mesh.dp_rank::engine.mesh.dp_size], tok.pad_token_id)
        metrics = engine.train_batch(mine, sft_loss)
        out[name] = {"loss": metrics["loss"], "grads": grads[0], "micro": metrics["num_micro_batches"]}
    # the plain loop: HF's own shifted cross-entropy over the labels of the assistant's tokens
    model = build_causal_lm(load_hf_config(None, TINY_MODELS["qwen2"]), None, "cpu", torch.float32, seed=0)
    labels = torch.where(whole["loss_mask"].bool(), whole["input_ids"], -100)
    loss = model(input_ids=whole["input_ids"], attention_mask=whole["attention_mask"], labels=labels).loss
    loss.backward()
    out["plain"] = {"loss": float(loss), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
    return out


LAYOUTS = {"one": {"micro_batch_size_per_gpu": 8}, "micro_1": {"micro_batch_size_per_gpu": 1},
           "dynamic": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 128}}


def _assert_like_plain(out: dict) -> None:
    plain = out["plain"]
    for name in set(out) - {"plain"}:
        assert out[name]["loss"] == pytest.approx(plain["loss"], rel=1e-5), name
        for key, grad in plain["grads"].items():
            mine = out[name]["grads"][key]
            torch.testing.assert_close(mine, grad, atol=1e-5 * float(grad.abs().max()) + 1e-7, rtol=1e-4,
                                       msg=f"{name}: {key}")


@pytest.mark.multiproc
def test_the_sft_step_is_a_plain_loops_labels_loss_on_one_process():
    out = run_distributed(_sft_gradients, 1, LAYOUTS)
    assert out["micro_1"]["micro"] == 8 and out["dynamic"]["micro"] > 1  # the cuts differ, the step does not
    _assert_like_plain(out)


@pytest.mark.multiproc
def test_the_sft_step_is_the_same_on_two_processes_and_with_sequence_parallelism():
    out = run_distributed(_sft_gradients, 2, LAYOUTS | {"sp2": {"micro_batch_size_per_gpu": 3,
                                                                "ulysses_sequence_parallel_size": 2}})
    assert set(out) == set(LAYOUTS) | {"sp2", "plain"}
    _assert_like_plain(out)


@pytest.mark.multiproc
def test_a_setting_sft_does_not_read_is_warned_about(tmp_path, caplog):
    """trainer.val_freq with no data.val_files validated nothing, silently (the files without val_freq warned)."""
    from shardrl.cli import main
    from shardrl.testing import save_char_model

    save_char_model(tmp_path / "model")
    with caplog.at_level("WARNING"):  # (no train_files: it stops right after the warnings, before any model loads)
        assert main(["sft", f"model.path={tmp_path / 'model'}", "trainer.val_freq=5", "trainer.device=cpu"]) == 2
    assert "trainer.val_freq=5 is never used: data.val_files is empty" in caplog.text


def test_sft_learns_checkpoints_resumes_and_exports(tmp_path):
    from shardrl.cli import main

    import transformers

    from shardrl.testing import save_char_model

    model_dir = tmp_path / "model"
    save_char_model(model_dir)
    rows = tmp_path / "sums.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "response": str(a + b)}) + "\n"
                            for a in range(10) for b in range(10) if a + b <= 9))
    run_dir = tmp_path / "run"
    common = [f"model.path={model_dir}", f"data.train_files=[{rows}]", f"data.val_files=[{rows}]",
              "data.batch_size=16", "engine.param_dtype=float32", "optim.lr=3e-3", "trainer.val_freq=10",
              "trainer.save_freq=10", "trainer.logger=[jsonl]", f"trainer.output_dir={run_dir}", "trainer.device=cpu"]
    assert main(["sft", *common, "trainer.total_steps=10"]) == 0
    assert main(["sft", *common, "trainer.total_steps=40", "trainer.resume=auto", "trainer.export_hf=true"]) == 0
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in records] == list(range(1, 41))  # resumed at 10, nothing repeated or lost
    val = [r["val/loss"] for r in records if "val/loss" in r]
    assert len(val) == 4 and val[0] > val[1] > val[-1]  # held-out loss falls at every validation
    # from a random model's ln(vocab) to well under half of it: the answers (and their end) got far likelier
    assert records[0]["sft/loss"] > 3.5 and records[-1]["sft/loss"] < 0.5 * records[0]["sft/loss"]
    assert main(["plot", str(run_dir)]) == 0 and (run_dir / "loss_curve.png").is_file()  # sft/loss: no reward
    hf = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf_model")
    assert sum(p.numel() for p in hf.parameters()) > 0


def test_an_sft_run_ends_with_the_summary_and_curve_train_gives(tmp_path):
    """sft/dpo/rm wrote summary.json as {"steps": N} and no curve (only `shardrl plot` drew one): the end of a run is
    the one `Trainer.fit` gives every trainer, with the loss where `shardrl train` has the reward."""
    from shardrl.cli import main
    from shardrl.testing import save_char_model

    save_char_model(tmp_path / "model")
    rows = tmp_path / "sums.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "response": str(a + b)}) + "\n"
                            for a in range(3) for b in range(3)))
    run_dir = tmp_path / "run"
    assert main(["sft", f"model.path={tmp_path / 'model'}", f"data.train_files=[{rows}]", f"data.val_files=[{rows}]",
                 "data.batch_size=4", "trainer.total_steps=2", "trainer.val_freq=2", "trainer.logger=[jsonl]",
                 f"trainer.output_dir={run_dir}", "trainer.device=cpu"]) == 0
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    summary = json.loads((run_dir / "summary.json").read_text())
    # the first and last step's loss (a quarter of 2 steps rounds up to one), the last validation loss
    assert summary == pytest.approx({"steps": 2, "loss_first": records[0]["sft/loss"], "first_last_window": 1,
                                     "loss_last": records[1]["sft/loss"], "val_loss_last": records[1]["val/loss"]})
    assert not (run_dir / "run.lock").exists()  # (released as `shardrl train` releases its folder)
    assert summary["loss_first"] != summary["loss_last"]
    assert (run_dir / "loss_curve.png").stat().st_size > 1000 and not (run_dir / "reward_curve.png").exists()


def test_a_lora_adapter_export_loads_with_auto_peft(tmp_path, monkeypatch):
    """`trainer.export_lora_adapter` wrote task_type null and model.path as given (relative): peft's
    AutoPeftModelForCausalLM could not load the folder. It loads, from another folder, and gives the merged export's
    logits."""
    peft = pytest.importorskip("peft")
    import transformers

    from shardrl.cli import main
    from shardrl.testing import save_char_model

    monkeypatch.chdir(tmp_path)
    save_char_model(tmp_path / "model")
    rows = tmp_path / "sums.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "response": str(a + b)}) + "\n" for a in range(3)
                            for b in range(3)))
    assert main(["sft", "model.path=model", f"data.train_files=[{rows}]", "data.batch_size=4", "optim.lr=1e-2",
                 "model.lora.rank=4", "engine.param_dtype=float32", "trainer.total_steps=2", "trainer.logger=[]",
                 "trainer.output_dir=run", "trainer.export_hf=true", "trainer.export_lora_adapter=true",
                 "trainer.device=cpu"]) == 0
    saved = json.loads((tmp_path / "run" / "lora_adapter" / "adapter_config.json").read_text())
    assert saved["task_type"] == "CAUSAL_LM" and saved["base_model_name_or_path"] == str(tmp_path / "model")
    monkeypatch.chdir(tmp_path / "run")  # (the base is found from anywhere)
    adapted = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "run" / "lora_adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf_model").eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    ids = torch.tensor([[3, 5, 7, 9, 11, 13]])
    with torch.no_grad():
        logits = adapted(input_ids=ids).logits
        torch.testing.assert_close(logits, merged(input_ids=ids).logits, atol=1e-5, rtol=0)
        assert (logits - base(input_ids=ids).logits).abs().max() > 1e-3  # (the adapters moved it)


def test_a_merged_lora_export_of_an_fp32_base_keeps_the_base_exact(tmp_path):
    """With the base held in bf16 (engine.param_dtype's default), the merged export of an fp32 model folder wrote
    the frozen weights rounded to bf16 under a float32 config: its logits were 6e-3 off peft's on the adapter.
    Its frozen tensors are the folder's own, and its logits are AutoPeftModelForCausalLM's."""
    peft = pytest.importorskip("peft")
    import transformers
    from safetensors.torch import load_file

    from shardrl.cli import main
    from shardrl.testing import save_char_model

    save_char_model(tmp_path / "model")
    rows = tmp_path / "sums.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "response": str(a + b)}) + "\n" for a in range(3)
                            for b in range(3)))
    assert main(["sft", f"model.path={tmp_path / 'model'}", f"data.train_files=[{rows}]", "data.batch_size=4",
                 "optim.lr=1e-2", "model.lora.rank=4", "model.lora.target_modules=[q_proj,v_proj]",
                 "trainer.total_steps=2", "trainer.logger=[]", f"trainer.output_dir={tmp_path / 'run'}",
                 "trainer.export_hf=true", "trainer.export_lora_adapter=true", "trainer.device=cpu"]) == 0
    base = load_file(tmp_path / "model" / "model.safetensors")
    out = load_file(tmp_path / "run" / "hf_model" / "model.safetensors")
    frozen = [name for name in base if "q_proj.weight" not in name and "v_proj.weight" not in name]
    assert frozen and all(out[name].dtype == torch.float32 and torch.equal(out[name], base[name]) for name in frozen)
    assert not torch.equal(out["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    adapted = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "run" / "lora_adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf_model").eval()
    ids = torch.tensor([[3, 5, 7, 9, 11, 13]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-5, rtol=0)
