"""Several LoRA adapters over one base (`shardrl serve --lora-modules NAME=PATH`, issue 59 item 6): two PEFT adapters
(written by peft itself: different ranks, layers, and one rsLoRA) served beside the base, concurrent requests for
the base and each adapter through the real `openai` client, each reply's tokens and log-probs checked against a
plain forward of the merged model (W + scale * B @ A, computed here); `/v1/models` lists the adapters with the base
as parent (vLLM's cards); an unknown name is a 404; adapter folders the server cannot serve are refused by name."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch
import transformers

from shardrl.config.schema import load_config
from shardrl.rollout.lora_adapters import LoraModule, parse_lora_modules, read_adapter
from shardrl.rollout.serving.command import ServerProcess, ServerThread, build_engine, build_server
from shardrl.testing import save_char_model

peft = pytest.importorskip("peft")

ADAPTERS = {  # name -> (r, lora_alpha, use_rslora, target_modules)
    "math": (4, 8, False, ["q_proj", "v_proj", "down_proj"]),
    "code": (2, 3, True, ["k_proj", "o_proj", "gate_proj", "up_proj"]),
}
PROMPTS = ["1+2=", "hello world "]


def write_adapter(base: Path, folder: Path, r: int, alpha: float, rslora: bool, targets: list[str], seed: int,
                  **extra) -> None:
    """A PEFT LoRA folder over the model at `base`, its A and B random (peft starts B at zero: no effect)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora,
                                                      target_modules=targets, **extra))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
    lora.save_pretrained(folder)


def merged_model(base: Path, folder: Path | None):
    """The base with `folder`'s adapter merged by hand: W + scale * B @ A, scale from its adapter_config.json."""
    from safetensors.torch import load_file

    model = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    if folder is None:
        return model
    config = json.loads((folder / "adapter_config.json").read_text())
    r, alpha = config["r"], config["lora_alpha"]
    scale = alpha / math.sqrt(r) if config["use_rslora"] else alpha / r
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." in key:
                layer = key.removeprefix("base_model.model.").split(".lora_A.")[0]
                b = tensors[key.replace(".lora_A.", ".lora_B.")]
                params[f"{layer}.weight"] += scale * (b @ a)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    save_char_model(root / "base")
    for seed, (name, (r, alpha, rslora, targets)) in enumerate(ADAPTERS.items()):
        write_adapter(root / "base", root / name, r, alpha, rslora, targets, seed)
    return root


@pytest.fixture(scope="module", params=["fast", "hf", "fast_process"])
def server(request, folders):
    cfg = load_config(None, [f"model.path={folders / 'base'}", f"rollout.backend={request.param.split('_')[0]}"])
    modules = [LoraModule(name, str(folders / name)) for name in ADAPTERS]
    if request.param == "fast_process":
        srv = ServerProcess(*build_engine(cfg, served_name="tiny", max_batch=8, lora_modules=modules))
    else:
        srv = ServerThread(build_server(cfg, served_name="tiny", max_batch=8, lora_modules=modules))
    yield srv
    srv.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)


def test_models_lists_each_adapter_with_the_base_as_parent(server, folders):
    cards = {m.id: m for m in client(server).models.list().data}
    assert list(cards) == ["tiny", "math", "code"]
    assert cards["math"].model_extra["parent"] == "tiny" and cards["math"].model_extra["root"] == str(folders / "math")
    assert "parent" not in cards["tiny"].model_extra
    assert client(server).models.retrieve("code").model_extra["parent"] == "tiny"


def test_each_request_gets_its_adapter_in_mixed_concurrent_batches(server, folders):
    """Base, math and code requests at once: each reply's tokens are the merged model's greedy choice and its
    log-probs the merged model's own, and the adapters change the replies."""
    c = client(server)
    jobs = [(model, prompt) for _ in range(2) for model in ("tiny", "math", "code") for prompt in PROMPTS]
    with ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(pool.map(lambda job: c.completions.create(model=job[0], prompt=job[1], max_tokens=6,
                                                                 temperature=0, logprobs=0), jobs))
    references = {name: merged_model(folders / "base", None if name == "tiny" else folders / name)
                  for name in ("tiny", "math", "code")}
    seen = {}
    for (model, prompt), reply in zip(jobs, replies):
        assert reply.model == model
        choice = reply.choices[0]
        prompt_ids, ids = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
        with torch.no_grad():
            logits = references[model](torch.tensor([prompt_ids + ids])).logits[0].float()
        log_probs = torch.log_softmax(logits[len(prompt_ids) - 1:-1], -1)  # (the positions that predict `ids`)
        assert ids == log_probs.argmax(-1).tolist()[: len(ids)], (model, prompt)
        want = log_probs[torch.arange(len(ids)), torch.tensor(ids)].tolist()
        assert choice.logprobs.token_logprobs == pytest.approx(want, abs=2e-4), (model, prompt)
        seen.setdefault((model, prompt), []).append(choice.logprobs.token_logprobs)
    for prompt in PROMPTS:  # (the adapters are not no-ops: each model answers differently)
        first = [seen[(m, prompt)][0] for m in ("tiny", "math", "code")]
        assert first[0] != pytest.approx(first[1], abs=1e-3) and first[0] != pytest.approx(first[2], abs=1e-3)


def test_an_unknown_model_is_an_openai_404_naming_the_served_ones(server):
    with pytest.raises(openai.NotFoundError) as e:
        client(server).completions.create(model="nope", prompt="hi", max_tokens=2)
    assert e.value.status_code == 404
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert e.value.body["message"] == "the model 'nope' does not exist; this server serves 'tiny', 'math', 'code'"
    with pytest.raises(openai.NotFoundError):
        client(server).models.retrieve("nope")


def test_streamed_adapter_replies_name_the_adapter(server):
    c = client(server)
    kwargs = dict(model="code", prompt="1+2=", max_tokens=5, temperature=0)
    plain = c.completions.create(**kwargs)
    chunks = list(c.completions.create(**kwargs, stream=True))
    assert {x.model for x in chunks} == {"code"}
    assert "".join(x.choices[0].text for x in chunks if x.choices) == plain.choices[0].text


# ---- what the server refuses ------------------------------------------------------------------------------
def linears_of(base: Path) -> dict[str, tuple[int, int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    return {n: tuple(m.weight.shape) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def test_an_adapter_reads_its_rank_and_scale(folders):
    adapter = read_adapter(LoraModule("code", str(folders / "code")), linears_of(folders / "base"))
    assert (adapter.rank, adapter.scale) == (2, pytest.approx(3 / math.sqrt(2)))
    assert sorted(adapter.weights)[:2] == ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]


@pytest.mark.parametrize("case, message", [
    ("dora", "DoRA (use_dora) adapters are not served"),
    ("modules_to_save", "modules_to_save (fully trained layers saved beside the adapters) is not served"),
    ("rank", "model.layers.0.mlp.down_proj's tensors have rank 4 (A) and 4 (B), but adapter_config.json says r=8"),
    ("model_folder", "not a PEFT adapter folder, it has no adapter_config.json (it holds a config.json: a full model"),
    ("other_shape", "model.layers.0.mlp.down_proj has A (4, 64), B (32, 4); the base's layer is 128 -> 64: an "
                    "adapter for another base shape"),
    ("missing", "no such folder"),
])
def test_adapters_the_server_cannot_serve_are_refused_by_name(folders, tmp_path, case, message):
    base, folder = folders / "base", tmp_path / "adapter"
    if case == "dora":
        write_adapter(base, folder, 2, 4, False, ["q_proj"], 0, use_dora=True)
    elif case == "modules_to_save":
        write_adapter(base, folder, 2, 4, False, ["q_proj"], 0, modules_to_save=["lm_head"])
    elif case == "rank":  # the config says 8, the tensors hold 4
        write_adapter(base, folder, 4, 8, False, ["down_proj"], 0)
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps(config | {"r": 8}))
    elif case == "model_folder":
        folder = base
    elif case == "other_shape":  # an adapter trained on a narrower model of the same layer names
        save_char_model(tmp_path / "narrow", hidden_size=32, intermediate_size=64)
        write_adapter(tmp_path / "narrow", folder, 4, 8, False, ["down_proj"], 0)
    with pytest.raises(ValueError, match="--lora-modules x=") as e:
        read_adapter(LoraModule("x", str(folder)), linears_of(base))
    assert message in str(e.value)


def test_lora_modules_take_vllms_forms():
    assert parse_lora_modules(["a=/p/a", ' {"name": "b", "path": "/p/b", "base_model_name": "tiny"}']) == [
        LoraModule("a", "/p/a"), LoraModule("b", "/p/b", "tiny")]
    for bad, why in [(["a"], "give NAME=PATH"), (["a=/x", "a=/y"], "the names ['a'] are given twice"),
                     (['{"name": "a"}'], 'a JSON entry is an object with "name" and "path"'),
                     (["{nope"], "not valid JSON")]:
        with pytest.raises(ValueError, match="--lora-modules") as e:
            parse_lora_modules(bad)
        assert why in str(e.value)


def test_the_serve_command_takes_lora_modules_repeated_or_space_separated():
    from shardrl.cli import build_parser

    args = build_parser().parse_args(["serve", "model.path=/m", "--lora-modules", "a=/x", "b=/y",
                                      "--lora-modules", "c=/z"])
    assert args.lora_modules == ["a=/x", "b=/y", "c=/z"]
