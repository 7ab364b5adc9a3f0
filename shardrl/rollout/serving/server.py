"""An OpenAI-compatible HTTP endpoint on a rollout backend (`shardrl serve`, and the endpoint of an RL run's agent
episodes): `/v1/models`, `/v1/completions`,
`/v1/chat/completions` (FastAPI on uvicorn), for agents that call a chat-completions API.

Requests are batched (`Batcher`): on the fast backend continuously (a request's rows join the running
`generate_stream` at its next host sync and leave as they end), elsewhere one `generate` call at a time over the
requests that waited for it (those with equal sampling settings share a call; the longest `max_tokens` of a call
is generated and each response is cut at its own). Each choice carries the exact token ids and per-token
log-probs of the sampler (`token_ids`, `logprobs`) and the response the prompt's ids (`prompt_token_ids`), as
vLLM's token-in-token-out extension does, so an RL trainer can train on precisely what was sampled; where the
weights may change while a batch generates (an RL run's partial rollouts), also each token's policy version
(`token_versions`) and the first's (`policy_version`). A request whose
client went away before its batch started is dropped from the batch.

Errors are JSON `{"error": {"message", "type", "param", "code"}}`: 404 for an unknown model, 400 for a malformed
body, text that is not valid Unicode, a prompt plus `max_tokens` over the context length, or options this server
does not take (`stream`), 413 for a body over `ServeOptions.max_body_bytes`.

The stack, one module a job: the wire schema (`shardrl.rollout.serving.schema`), the batcher
(`shardrl.rollout.serving.batcher`), the app and its server (`shardrl.rollout.serving.app`); this module gathers
their public names.
"""

from shardrl.rollout.serving.app import EPISODE_HEADER, Routes, ServerThread, build_app, free_port, uvicorn_server
from shardrl.rollout.serving.batcher import (ALIVE_CHECKS, ALIVE_EVERY_S, STREAM_SEQ, SWITCH_INTERVAL_S, Batcher,
                                             Dropped, Pending, Stopped, due_for_check)
from shardrl.rollout.serving.schema import (GREEDY_BELOW, MAX_N, UNSUPPORTED, ChatRequest, CompletionRequest,
                                            Message, RequestError)

__all__ = ["ALIVE_CHECKS", "ALIVE_EVERY_S", "EPISODE_HEADER", "GREEDY_BELOW", "MAX_N", "STREAM_SEQ",
           "SWITCH_INTERVAL_S", "UNSUPPORTED", "Batcher", "ChatRequest", "CompletionRequest", "Dropped", "Message",
           "Pending", "RequestError", "Routes", "ServerThread", "Stopped", "build_app", "due_for_check", "free_port",
           "uvicorn_server"]
