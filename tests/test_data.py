import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from shardrl.data.prompts import PromptLoader, collate_prompts, load_prompt_dataset
from shardrl.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


# ---------------------------------------------------------------- loading


def test_jsonl_plain_prompts(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "12+7=", "data_source": "arith", "ground_truth": "19"},
        {"prompt": "3+4=", "ground_truth": "7", "level": 2},
    ])
    ds = load_prompt_dataset([path], tokenizer)
    assert len(ds) == 2
    first, second = ds[0], ds[1]
    assert first["prompt_text"] == "12+7="
    assert first["prompt_ids"] == tokenizer.encode("12+7=")
    assert first["data_source"] == "arith" and first["extra"] == {"ground_truth": "19"}
    assert second["data_source"] == "default"
    assert second["extra"] == {"ground_truth": "7", "level": 2}
    assert (first["index"], second["index"]) == (0, 1)
    assert ds.stats == {"num_rows_read": 2, "num_skipped_bad": 0, "num_dropped_too_long": 0,
                        "num_truncated": 0, "num_rows": 2}


def test_parquet_chat_messages_verl_style(tokenizer, tmp_path):
    rows = [{
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
        "reward_model": {"style": "rule", "ground_truth": "4"},
        "extra_info": {"split": "train", "index": 7},
    }]
    ds = load_prompt_dataset([write_parquet(tmp_path / "p.parquet", rows)], tokenizer)
    item = ds[0]
    assert item["prompt_text"] == "system: be brief\nuser: 2+2?\nassistant: "
    assert tokenizer.decode(item["prompt_ids"]) == item["prompt_text"]
    assert item["data_source"] == "openai/gsm8k"
    assert item["extra"]["ground_truth"] == "4"
    assert item["extra"]["reward_model"] == {"style": "rule", "ground_truth": "4"}
    assert item["extra"]["extra_info"] == {"split": "train", "index": 7}


def test_json_array_file_and_several_files(tokenizer, tmp_path):
    array_path = tmp_path / "a.json"
    array_path.write_text(json.dumps([{"prompt": "1+1="}, {"prompt": "2+2="}]))
    jsonl_path = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "3+3="}])
    ds = load_prompt_dataset([str(array_path), jsonl_path], tokenizer, prompt_key="prompt")
    assert [ds[i]["prompt_text"] for i in range(3)] == ["1+1=", "2+2=", "3+3="]
    assert [ds[i]["index"] for i in range(3)] == [0, 1, 2]


def test_custom_prompt_key(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "5+5=", "prompt": "ignored"}])
    item = load_prompt_dataset([path], tokenizer, prompt_key="question")[0]
    assert item["prompt_text"] == "5+5=" and item["extra"] == {"prompt": "ignored"}


def test_chat_messages_without_template(tmp_path):
    tok = build_char_tokenizer()
    tok.chat_template = None
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": [{"role": "user", "content": "1+1="}]}])
    with pytest.raises(ValueError, match="row 1: .*no chat template"):
        load_prompt_dataset([path], tok)


# ---------------------------------------------------------------- truncation


@pytest.fixture
def lengths_file(tmp_path):
    # prompts of 4, 10 and 6 characters = tokens
    return write_jsonl(tmp_path / "len.jsonl", [{"prompt": "1+2="}, {"prompt": "123+456=?("}, {"prompt": "12+34="}])


def test_truncation_drop(tokenizer, lengths_file):
    ds = load_prompt_dataset([lengths_file], tokenizer, max_prompt_length=6, truncation="drop")
    assert [item["prompt_text"] for item in ds.items] == ["1+2=", "12+34="]
    assert [item["index"] for item in ds.items] == [0, 1]
    assert ds.stats["num_dropped_too_long"] == 1 and ds.stats["num_truncated"] == 0 and ds.stats["num_rows"] == 2


def test_truncation_error(tokenizer, lengths_file):
    with pytest.raises(ValueError, match=r"len\.jsonl: row 2: prompt is 10 tokens, longer than max_prompt_length=6"):
        load_prompt_dataset([lengths_file], tokenizer, max_prompt_length=6, truncation="error")


def test_truncation_left_and_right(tokenizer, lengths_file):
    left = load_prompt_dataset([lengths_file], tokenizer, max_prompt_length=6, truncation="left")
    assert left[1]["prompt_text"] == "+456=?("[-6:] == "456=?("
    assert left[1]["prompt_ids"] == tokenizer.encode("456=?(")
    right = load_prompt_dataset([lengths_file], tokenizer, max_prompt_length=6, truncation="right")
    assert right[1]["prompt_text"] == "123+45"
    assert right[1]["prompt_ids"] == tokenizer.encode("123+45")
    for ds in (left, right):
        assert len(ds) == 3 and ds.stats["num_truncated"] == 1 and ds.stats["num_dropped_too_long"] == 0
        assert ds[0]["prompt_text"] == "1+2=" and ds[2]["prompt_text"] == "12+34="


def test_stats_logged_once(tokenizer, lengths_file, caplog):
    with caplog.at_level(logging.INFO, logger="shardrl.data.prompts"):
        load_prompt_dataset([lengths_file], tokenizer, max_prompt_length=6)
    records = [r for r in caplog.records if r.name == "shardrl.data.prompts"]
    assert len(records) == 1
    assert "loaded 2 prompts" in records[0].getMessage() and "1 too long dropped" in records[0].getMessage()


def test_bad_truncation_mode(tokenizer, lengths_file):
    with pytest.raises(ValueError, match="truncation must be one of"):
        load_prompt_dataset([lengths_file], tokenizer, truncation="middle")


def test_all_rows_dropped(tokenizer, lengths_file):
    with pytest.raises(ValueError, match="no usable prompts"):
        load_prompt_dataset([lengths_file], tokenizer, max_prompt_length=2)


# ---------------------------------------------------------------- errors


def test_missing_file(tokenizer, tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompt_dataset([missing], tokenizer)


def test_unsupported_extension(tokenizer, tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("prompt\n1+1=\n")
    with pytest.raises(ValueError, match=r"unsupported data file type '\.csv'.*\.jsonl, \.json, \.parquet"):
        load_prompt_dataset([str(path)], tokenizer)


def test_missing_prompt_key_names_file_row_and_keys(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "1+1="}, {"prompt": "2+2="}, {"question": "3+3=", "answer": "6"}])
    with pytest.raises(ValueError) as info:
        load_prompt_dataset([path], tokenizer)
    message = str(info.value)
    assert path in message and "row 3" in message
    assert "no 'prompt' key" in message and "['answer', 'question']" in message


def test_wrong_prompt_type_names_what_was_found(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": 42, "data_source": "x"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl: row 1: 'prompt' must be a string .* found int 42; "
                                         r"available keys: \['data_source', 'prompt'\]"):
        load_prompt_dataset([path], tokenizer)
    messages_path = write_jsonl(tmp_path / "bad2.jsonl", [{"prompt": [{"role": "user"}]}])
    with pytest.raises(ValueError, match=r"row 1: prompt\[0\]: content must be a string .*it has none "
                                         r"\(keys: \['role'\]\)"):
        load_prompt_dataset([messages_path], tokenizer)


def test_parquet_row_number_in_error(tokenizer, tmp_path):
    path = write_parquet(tmp_path / "bad.parquet", [{"prompt": "1+1="}, {"prompt": None}])
    with pytest.raises(ValueError, match=r"bad\.parquet: row 2: .*found NoneType None"):
        load_prompt_dataset([path], tokenizer)


def test_invalid_json_line(tokenizer, tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "1+1="}\n\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"broken\.jsonl: row 3: not valid JSON \(Expecting value at column 12\)"):
        load_prompt_dataset([str(path)], tokenizer)


def test_skip_bad_rows_drops_and_counts_an_unparsable_line(tokenizer, tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "1+1="}\n{"prompt": \n{"prompt": "2+2="}\n')
    ds = load_prompt_dataset([str(path)], tokenizer, skip_bad_rows=True)
    assert [item["prompt_text"] for item in ds.items] == ["1+1=", "2+2="]
    assert (ds.stats["num_skipped_bad"], ds.stats["num_rows_read"]) == (1, 3)


def test_a_prompt_key_no_row_has_is_named_with_the_rows_keys_not_skip_bad_rows(tokenizer, tmp_path):
    """data.prompt_key=question on rows without it: skip_bad_rows would drop every row (and --verl refuses it)."""
    path = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "1+1=", "data_source": "x"}] * 2)
    for skip in (False, True):
        with pytest.raises(ValueError) as error:
            load_prompt_dataset([path], tokenizer, prompt_key="question", skip_bad_rows=skip)
        assert str(error.value) == (f"{path}: no row has the columns for shardrl train: the prompt under 'question' "
                                    "(data.prompt_key: set it to the key that holds the prompts); the rows' keys: "
                                    "['data_source', 'prompt']")
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"messages": [{"role": "user", "content": "1+1="}]}])
    with pytest.raises(ValueError, match=r"the rows' keys: \['messages'\]; this looks like an SFT file \(messages\), "
                                         r"a file for shardrl sft$"):
        load_prompt_dataset([sft], tokenizer)


@pytest.mark.parametrize("role, hint", [("robot", ""), (None, ""), ("User", "; roles are lower case: 'user'")])
def test_a_prompt_messages_role_is_checked(tokenizer, tmp_path, role, hint):
    path = write_jsonl(tmp_path / "r.jsonl", [{"prompt": [{"role": "system", "content": "add"},
                                                          {"role": role, "content": "1+1="}]}])
    with pytest.raises(ValueError) as error:
        load_prompt_dataset([path], tokenizer)
    assert str(error.value) == (f"{path}: row 1: prompt[1]: role {role!r} is not one of system, user, assistant, "
                                f"tool{hint} (set data.skip_bad_rows=true to skip and count such rows)")


def test_skip_bad_rows_counts(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [
        {"prompt": "1+1="}, {"question": "x"}, {"prompt": 3}, {"prompt": "2+2="}, {"prompt": []},
    ])
    ds = load_prompt_dataset([path], tokenizer, skip_bad_rows=True)
    assert [item["prompt_text"] for item in ds.items] == ["1+1=", "2+2="]
    assert ds.stats["num_skipped_bad"] == 3 and ds.stats["num_rows_read"] == 5 and ds.stats["num_rows"] == 2


# ---------------------------------------------------------------- loader


def fake_dataset(n):
    return [{"index": i} for i in range(n)]


def indices(batch):
    return [item["index"] for item in batch]


def test_loader_epoch_covers_each_prompt_once_and_reshuffles():
    loader = PromptLoader(fake_dataset(12), batch_size=4, seed=3)
    assert len(loader) == 3
    epoch0 = sum((indices(next(loader)) for _ in range(3)), [])
    epoch1 = sum((indices(next(loader)) for _ in range(3)), [])
    assert epoch0 == torch.randperm(12, generator=torch.Generator().manual_seed(3)).tolist()
    assert epoch1 == torch.randperm(12, generator=torch.Generator().manual_seed(4)).tolist()
    assert sorted(epoch0) == sorted(epoch1) == list(range(12)) and epoch0 != epoch1
    assert loader.epoch == 1


def test_loader_deterministic_and_seed_dependent():
    def first_batches(seed):
        loader = PromptLoader(fake_dataset(20), batch_size=5, seed=seed)
        return [indices(next(loader)) for _ in range(6)]

    assert first_batches(0) == first_batches(0)
    assert first_batches(0) != first_batches(1)


def test_loader_no_shuffle_drop_last():
    loader = PromptLoader(fake_dataset(10), batch_size=4, shuffle=False)
    assert [indices(next(loader)) for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]


def test_loader_keep_last_fills_short_batch():
    loader = PromptLoader(fake_dataset(10), batch_size=4, shuffle=False, drop_last=False)
    assert len(loader) == 3
    assert [indices(next(loader)) for _ in range(4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1], [0, 1, 2, 3]]


@pytest.mark.parametrize("consumed", [2, 3, 5])  # mid-epoch, exactly at the epoch boundary, into epoch 2
def test_loader_resume_matches_uninterrupted(consumed):
    # 11 prompts, batch 4, drop_last: 2 batches per epoch
    reference = PromptLoader(fake_dataset(11), batch_size=4, seed=7)
    expected = [indices(next(reference)) for _ in range(consumed + 6)]

    first = PromptLoader(fake_dataset(11), batch_size=4, seed=7)
    for _ in range(consumed):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # survives a round trip through a checkpoint file
    resumed = PromptLoader(fake_dataset(11), batch_size=4, seed=7)
    resumed.load_state_dict(state)
    assert [indices(next(resumed)) for _ in range(6)] == expected[consumed:]


def test_loader_state_values():
    loader = PromptLoader(fake_dataset(11), batch_size=4)
    for _ in range(3):
        next(loader)
    assert loader.state_dict() == {"epoch": 1, "position": 4, "seed": 0, "num_rows": 11}
    with pytest.raises(ValueError, match="saved over 11 prompts but this dataset has 12"):
        PromptLoader(fake_dataset(12), batch_size=4).load_state_dict(loader.state_dict())


def test_loader_dp_slices_are_disjoint_and_cover_the_global_batch():
    full = PromptLoader(fake_dataset(24), batch_size=6, seed=1)
    ranks = [PromptLoader(fake_dataset(24), batch_size=6, seed=1, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(9):  # over two epoch boundaries
        global_batch = indices(next(full))
        slice0, slice1 = indices(next(ranks[0])), indices(next(ranks[1]))
        assert len(slice0) == len(slice1) == 3
        assert not set(slice0) & set(slice1)
        assert slice0 + slice1 == global_batch


def test_loader_dp_resume_at_another_dp_size():
    single = PromptLoader(fake_dataset(16), batch_size=4, seed=2)
    next(single)
    rank1 = PromptLoader(fake_dataset(16), batch_size=4, seed=2, dp_rank=1, dp_size=2)
    rank1.load_state_dict(single.state_dict())
    assert indices(next(rank1)) == indices(next(single))[2:]


def test_loader_errors():
    with pytest.raises(ValueError, match="batch_size=6 prompts does not divide over dp_size=4"):
        PromptLoader(fake_dataset(12), batch_size=6, dp_size=4)
    with pytest.raises(ValueError, match="has 3 prompts, fewer than one batch of 4"):
        PromptLoader(fake_dataset(3), batch_size=4)
    with pytest.raises(ValueError, match="dp_rank=2"):
        PromptLoader(fake_dataset(12), batch_size=4, dp_rank=2, dp_size=2)


# ---------------------------------------------------------------- collate and demo data


def test_collate_left_pads(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "1+2=", "data_source": "arith", "ground_truth": "3"}, {"prompt": "12+34=", "ground_truth": "46"},
    ])
    ds = load_prompt_dataset([path], tokenizer)
    batch = collate_prompts([ds[0], ds[1]], pad_id=tokenizer.pad_token_id)
    one, two, plus, equals = (tokenizer.convert_tokens_to_ids(c) for c in "12+=")
    assert batch["input_ids"].dtype == torch.long and batch["input_ids"].shape == (2, 6)
    assert batch["input_ids"][0].tolist() == [0, 0, one, plus, two, equals]
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]
    assert batch["data_source"] == ["arith", "default"]
    assert [e["ground_truth"] for e in batch["extra"]] == ["3", "46"]


# ---------------------------------------------------------------- bad bytes, empty and huge prompts


def test_non_utf8_bytes_name_file_and_line(tokenizer, tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "1+1="}\n{"prompt": "2+2="}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin1.jsonl: line 3 is not UTF-8 text \(byte b'\\xe9' at offset 53\); "
                                         r"save the file as UTF-8"):
        load_prompt_dataset([str(path)], tokenizer)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"prompt": "1+1="}\n')
    assert load_prompt_dataset([str(bom)], tokenizer)[0]["prompt_text"] == "1+1="


@pytest.mark.parametrize("prompt", ["", "  \n"])
def test_empty_prompt_is_refused_with_its_row(tokenizer, tmp_path, prompt):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1="}, {"prompt": prompt}])
    with pytest.raises(ValueError, match=r"p.jsonl: row 2: the 'prompt' string is empty; a prompt needs text "
                                         r"\(set data.skip_bad_rows=true"):
        load_prompt_dataset([path], tokenizer)
    ds = load_prompt_dataset([path], tokenizer, skip_bad_rows=True)
    assert len(ds) == 1 and ds.stats["num_skipped_bad"] == 1


class CountingTokenizer:
    """The char tokenizer, recording the longest text it was asked to tokenize."""

    def __init__(self, inner):
        self.inner, self.longest = inner, 0

    def __call__(self, texts, **kwargs):
        self.longest = max([self.longest, *map(len, texts)])
        return self.inner(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("truncation", ["drop", "error", "left", "right"])
def test_a_huge_prompt_is_never_tokenized_in_full(tokenizer, tmp_path, truncation):
    huge = "1+" * 10_000_000 + "1="  # 20 MB
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "2+2="}, {"prompt": huge}])
    spy = CountingTokenizer(tokenizer)
    if truncation == "error":
        with pytest.raises(ValueError, match=r"row 2: prompt is 20000002 characters, more than max_prompt_length=16"):
            load_prompt_dataset([path], spy, max_prompt_length=16, truncation=truncation)
        return
    ds = load_prompt_dataset([path], spy, max_prompt_length=16, truncation=truncation)
    # the char tokenizer's longest entry is "<unk>": no text of more than 2 * 16 * 5 characters is tokenized
    assert spy.longest <= 160
    if truncation == "drop":
        assert len(ds) == 1 and ds.stats["num_dropped_too_long"] == 1
    else:  # the same 16 tokens as cutting the fully tokenized prompt
        assert len(ds) == 2 and ds.stats["num_truncated"] == 1
        want = "1+" * 7 + "1=" if truncation == "left" else "1+" * 8
        assert ds[1]["prompt_text"] == want and ds[1]["prompt_ids"] == tokenizer.encode(want)


def test_a_prompt_that_tokenizes_to_nothing_is_refused(tokenizer, tmp_path):
    class DropsQuestionMarks(CountingTokenizer):  # as a normalizer that deletes characters would
        def __call__(self, texts, **kwargs):
            return self.inner([t.replace("?", "") for t in texts], **kwargs)

    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1="}, {"prompt": "??"}])
    with pytest.raises(ValueError, match=r"p.jsonl: row 2: the prompt '\?\?' tokenizes to nothing"):
        load_prompt_dataset([path], DropsQuestionMarks(tokenizer))
    ds = load_prompt_dataset([path], DropsQuestionMarks(tokenizer), skip_bad_rows=True)
    assert len(ds) == 1 and ds.stats["num_skipped_bad"] == 1
