"""Agents written with real agent frameworks train unchanged (issue 59 item 4): the examples in
examples/agent_frameworks/ (the OpenAI Agents SDK, LangGraph over LangChain's ChatOpenAI, pydantic-ai) run as
`rollout.agent.entrypoint` against the run's endpoint on the tiny model; their trajectories are token-exact (the
sampler's log-probs equal a plain forward of the assembled sequence at the trained positions), each episode is one
recorded call rendered from the framework's own messages, and the README's Agents SDK agent trains in a short RL
run. Each framework's tests skip where its package is not installed (the `agents` extra installs them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardrl.rollout import SamplingParams

EXAMPLES = Path(__file__).parent.parent / "examples" / "agent_frameworks"
FRAMEWORKS = {  # example file -> the package it needs
    "openai_agents_sdk.py": "agents", "langgraph_agent.py": "langgraph", "pydantic_ai_agent.py": "pydantic_ai"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import transformers

    from shardrl.testing import save_char_model

    folder = tmp_path_factory.mktemp("frameworks_model")
    tok = save_char_model(folder)
    return tok, transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


def run_example(setup, agent: str, prompts: list[str], n: int = 2, greedy: bool = False, seed: int = 0):
    from test_agent import agent_rollout

    tok, model = setup
    rollout = agent_rollout((tok, model, EXAMPLES / agent), failure_reward=-1.0)
    enc = tok(prompts, return_tensors="pt", padding=True)
    samples = [{"prompt": p, "data_source": "t", "extra": {"ground_truth": "3"}} for p in prompts]
    try:
        return rollout.generate(enc["input_ids"], enc["attention_mask"],
                                SamplingParams(n=n, temperature=1.0, greedy=greedy, max_new_tokens=8, seed=seed),
                                samples=samples)
    finally:
        rollout.server.stop()


@pytest.mark.parametrize("agent", list(FRAMEWORKS))
def test_a_framework_agents_trajectories_are_token_exact(setup, agent):
    from test_rollout_hf import recomputed_log_probs

    pytest.importorskip(FRAMEWORKS[agent])
    tok, model = setup
    prompts = ["1+2=", "what is 7*6? "]
    out = run_example(setup, agent, prompts)
    batch = out.to_batch()
    assert batch["agent_errors"].tolist() == [0] * 4, batch["agent_error"]
    calls = batch["agent_calls"].tolist()  # (each episode's calls, recorded under its episode)
    if agent == "pydantic_ai_agent.py":  # (pydantic-ai asks again after an empty reply, which the tiny model can give)
        assert all(c >= 1 for c in calls), calls
    else:
        assert calls == [1.0] * 4, calls
    assert set(batch["interaction_score"]) <= {0.0, 1.0}
    trained = batch["loss_mask"].bool()
    assert trained.sum() >= 4
    torch.testing.assert_close(batch["sampled_log_probs"][trained],
                               recomputed_log_probs(model, out, 1.0)[trained], atol=1e-4, rtol=0)
    for r in range(len(out)):  # the framework's messages, through the chat template: the prompt only
        prompt = tok.decode(out.prompt_ids[r][out.prompt_mask[r].bool()])
        if calls[r] == 1:
            assert prompt == f"user: {prompts[r // 2]}\nassistant: ", prompt
        else:  # (pydantic-ai drops the empty reply from its history when it asks again: the episode's calls do not
            # extend one another, and the one kept may be the second, its prompt the user's and pydantic-ai's retry)
            assert prompt.startswith(f"user: {prompts[r // 2]}\n"), prompt
        real = out.response_attention_mask[r].bool()
        if calls[r] == 1:
            assert out.response_mask[r][real].all()  # (one reply: all of it trained)
        else:  # (its replies trained; what its second request adds between them, if it extends the first, not)
            assert out.response_mask[r][real].any()


def test_the_readme_agents_sdk_agent_is_the_example_file():
    """The README's agent section shows examples/agent_frameworks/openai_agents_sdk.py as it is (the file the
    tests train)."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    code = (EXAMPLES / "openai_agents_sdk.py").read_text()
    body = code[code.index("from agents import"):]
    assert body in readme, "README.md's agent section must quote examples/agent_frameworks/openai_agents_sdk.py"
    assert len(code.splitlines()) <= 20


@pytest.fixture(scope="module")
def demo_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("frameworks_demo")  # (the demo's model and data, made once for every run)


@pytest.mark.parametrize("agent", list(FRAMEWORKS))
def test_a_framework_agent_trains_in_an_rl_run(demo_folder, monkeypatch, agent):
    """The demo's task through the framework's agent, unchanged: the run's steps log the agent's counts (one call an
    episode, none failed), rewards and a policy loss."""
    from shardrl.launch.overrides import resolve_overrides
    from shardrl.launch.rank import run

    pytest.importorskip(FRAMEWORKS[agent])
    monkeypatch.chdir(demo_folder)
    overrides = resolve_overrides(None, ["trainer.logger=[jsonl]", "trainer.total_steps=2", "trainer.val_freq=0",
                                         "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4",
                                         f"trainer.output_dir={demo_folder / agent}",
                                         f"rollout.agent.entrypoint={EXAMPLES / agent}:run"])
    run_dir = run(None, overrides)
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert len(records) == 2
    assert all(r["agent/calls_mean"] == 1.0 and r["agent/errors_mean"] == 0.0 for r in records), records
    assert all(0.0 <= r["reward/mean"] <= 1.0 and "actor/pg_loss" in r for r in records)


# ---- function tools: a policy forced to call them (test_serve_tools' scripted replies) --------------------
TOOL_AGENTS = {"openai_agents_sdk_tools.py": "agents", "langgraph_tools_agent.py": "langgraph",
               "openai_agents_sdk_responses": "agents"}
RESPONSES_TOOLS_AGENT = '''
from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

set_tracing_disabled(True)


@function_tool
def add(a: int, b: int) -> int:
    """Adds two integers."""
    return a + b


async def run(sample, client):  # (the SDK's Responses model: /v1/responses with function tools)
    agent = Agent(name="calculator", tools=[add], model=OpenAIResponsesModel(model="policy", openai_client=client))
    result = await Runner.run(agent, sample["prompt"], max_turns=4)
    return float(result.final_output.strip() == str(sample["extra"]["ground_truth"]))
'''


@pytest.mark.parametrize("agent", list(TOOL_AGENTS))
def test_a_framework_agents_tool_calls_train_on_the_sampled_tokens(tmp_path, agent):
    """A policy whose first reply calls `add` (read into tool calls for the framework), which the framework runs and
    sends back, then answers from the tool's output: each trajectory is the sampled call (trained), the tool turn
    the template renders (not), the answer (trained), and the sampler's log-probs equal a plain forward's."""
    from shardrl.rollout.episodes.agent import AgentRollout
    from test_rollout_hf import recomputed_log_probs
    from test_serve_tools import CALL, ForcedRollout, char_model

    pytest.importorskip(TOOL_AGENTS[agent])
    tok, model = char_model(tmp_path)
    path = EXAMPLES / agent
    if agent == "openai_agents_sdk_responses":
        path = tmp_path / "responses_tools_agent.py"
        path.write_text(RESPONSES_TOOLS_AGENT)
    forced = ForcedRollout(tok, model, lambda prompt: "3" if "tool: " in prompt else CALL)
    rollout = AgentRollout(forced, tok, f"{path}:run", context=512, failure_reward=-1.0)
    enc = tok(["1+2?", "add 1 and 2"], return_tensors="pt", padding=True)
    samples = [{"prompt": p, "data_source": "t", "extra": {"ground_truth": "3"}} for p in ("1+2?", "add 1 and 2")]
    try:
        out = rollout.generate(enc["input_ids"], enc["attention_mask"],
                               SamplingParams(n=2, temperature=1.0, max_new_tokens=128, seed=0), samples=samples)
    finally:
        rollout.server.stop()
    batch = out.to_batch()
    assert batch["agent_errors"].tolist() == [0] * 4, batch["agent_error"]
    assert batch["interaction_score"] == [1.0] * 4  # (the framework ran the tool and the answer was read)
    assert batch["agent_calls"].tolist() == [2] * 4 and batch["agent_prefix_breaks"].tolist() == [0] * 4
    assert batch["agent_tool_parse_failures"].tolist() == [0] * 4
    for r in range(4):
        real = out.response_attention_mask[r].bool()
        ids, mask = out.response_ids[r][real].tolist(), out.response_mask[r][real].tolist()
        assert tok.decode(ids, skip_special_tokens=False) == f"{CALL}\ntool: 3\nassistant: 3<eos>"
        assert tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False) == f"{CALL}3<eos>"
    trained = batch["loss_mask"].bool()
    torch.testing.assert_close(batch["sampled_log_probs"][trained],
                               recomputed_log_probs(model, out, 1.0)[trained], atol=1e-4, rtol=0)
