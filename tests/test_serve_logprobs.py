"""Which log-probs the OpenAI-compatible server returns (issue 57): at temperature 0.7 and top-k 5, the sampled
distribution's (`processed_logprobs`, the default: what shardrl's trainer recomputes) or the model's own
(`raw_logprobs`, vLLM's default), each checked against a forward of the tiny model itself."""

from __future__ import annotations

import dataclasses

import openai
import pytest
import torch

from shardrl.config.schema import load_config
from shardrl.rollout import SamplingParams
from shardrl.rollout.serving.command import ServeOptions, ServerThread, build_server
from shardrl.testing import save_char_model

TEMPERATURE, TOP_K = 0.7, 5


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    save_char_model(folder)
    return folder


@pytest.fixture(scope="module", params=["hf", "fast"])
def server(request, folder):
    cfg = load_config(None, [f"model.path={folder}", f"rollout.backend={request.param}"])
    srv = ServerThread(build_server(cfg, served_name="tiny", max_batch=4,
                                    options=ServeOptions(logprobs_mode="raw_logprobs")))
    yield srv
    srv.stop()


def model_log_probs(folder, prompt: list[int], reply: list[int]) -> dict[str, torch.Tensor]:
    """Each reply token's log-prob from the model's logits: raw, at the temperature, and at the temperature over
    the top-k tokens only (vLLM's processed_logprobs)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + reply])).logits[0, len(prompt) - 1:-1].float()  # (R, V)
    at = torch.tensor(reply)[:, None]
    scaled = logits / TEMPERATURE
    kth = scaled.topk(TOP_K, -1).values[:, -1:]
    truncated = scaled.masked_fill(scaled < kth, float("-inf"))
    return {"raw": logits.log_softmax(-1).gather(-1, at)[:, 0],
            "processed": scaled.log_softmax(-1).gather(-1, at)[:, 0],
            "truncated": truncated.log_softmax(-1).gather(-1, at)[:, 0],
            "in_top_k": (scaled.gather(-1, at) >= kth)[:, 0]}


def ask(srv, mode: str, seed: int) -> tuple[list[int], list[int], list[float]]:
    srv.app.state.logprobs_mode = mode
    c = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0)
    res = c.completions.create(model="tiny", prompt="1+2=", max_tokens=12, temperature=TEMPERATURE, seed=seed,
                               logprobs=1, extra_body={"top_k": TOP_K})
    choice = res.choices[0]
    return choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"], choice.logprobs.token_logprobs


def test_raw_logprobs_are_the_models_own_and_processed_ones_the_sampled_temperatures(server, folder):
    for seed in (1, 2):
        prompt, raw_reply, raw = ask(server, "raw_logprobs", seed)
        _, reply, processed = ask(server, "processed_logprobs", seed)
        assert raw_reply == reply  # (the mode changes the numbers reported, not what is sampled)
        want = model_log_probs(folder, prompt, reply)
        assert bool(want["in_top_k"].all())  # (top-k applies in either mode)
        assert raw == pytest.approx(want["raw"].tolist(), abs=1e-4)
        assert processed == pytest.approx(want["processed"].tolist(), abs=1e-4)
        # (the two differ here: this checks which one came back; neither is vLLM's truncated processed_logprobs)
        assert (want["raw"] - want["processed"]).abs().max() > 0.05
        assert (want["truncated"] - want["processed"]).abs().max() > 1e-3


def test_an_rl_runs_endpoint_returns_the_trainers_log_probs_whatever_the_mode(server, folder):
    """The policy's sampler (an RL run's endpoint): the processed log-probs its trainer compares with its own."""
    server.app.state.policy = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, max_new_tokens=12, seed=3)
    try:
        prompt, reply, got = ask(server, "raw_logprobs", 0)
    finally:
        server.app.state.policy = None
    assert got == pytest.approx(model_log_probs(folder, prompt, reply)["processed"].tolist(), abs=1e-4)


def test_the_logprobs_mode_is_checked():
    with pytest.raises(ValueError, match="logprobs_mode='raw' must be one of processed_logprobs, raw_logprobs"):
        ServeOptions(logprobs_mode="raw")
    assert ServeOptions().logprobs_mode == "processed_logprobs"
    assert dataclasses.replace(SamplingParams(temperature=0.7), raw_log_probs=True).logprob_temperature == 1.0
