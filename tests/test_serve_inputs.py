"""What the OpenAI-compatible server makes of hostile inputs (issue 57): text that is not valid Unicode, bodies too
large to hold, prompts too long to tokenize; the server keeps answering the others."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from shardrl.config.schema import load_config
from shardrl.rollout.serving.command import ServerThread, build_server
from shardrl.testing import save_char_model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    save_char_model(folder)
    srv = ServerThread(build_server(load_config(None, [f"model.path={folder}", "rollout.backend=hf"]),
                                    served_name="tiny"))
    yield srv
    srv.stop()


def post(server, path: str, body, timeout: float = 30, headers: dict | None = None) -> tuple[int, dict]:
    """(status, JSON body) of a POST of `body` (bytes, or an iterable of bytes: sent chunked)."""
    request = urllib.request.Request(f"{server.url}/{path}", data=body,
                                     headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def small_completion(server) -> None:
    status, body = post(server, "completions", json.dumps({"model": "tiny", "prompt": "1+2=", "max_tokens": 2,
                                                           "temperature": 0}).encode())
    assert status == 200 and body["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("route, body, where", [
    ("completions", {"prompt": "\ud800abc"}, "prompt"),
    ("completions", {"prompt": ["fine", "ab\udfffc"]}, "prompt[1]"),
    ("chat/completions", {"messages": [{"role": "user", "content": "\ud800abc"}]}, "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "system", "content": "ok"},
                                       {"role": "user", "content": [{"type": "text", "text": "xy\ud800"}]}]},
     "messages[1].content[0].text"),
])
def test_a_lone_surrogate_gets_a_400_naming_the_character_and_where_it_is(server, route, body, where):
    raw = json.dumps({"model": "tiny", "max_tokens": 2, **body})  # (ensure_ascii: the surrogate as JSON spells it)
    assert "\\ud800" in raw or "\\udfff" in raw
    status, answer = post(server, route, raw.encode())
    assert status == 400, answer
    error = answer["error"]
    char = "U+D800" if "\\ud800" in raw else "U+DFFF"
    position = 0 if where in ("prompt", "messages[0].content") else 2
    assert f"{where} holds an invalid character at position {position}: {char}" in error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == where.split("[")[0]
    assert "template" not in error["message"] and "TextEncodeInput" not in error["message"]
    small_completion(server)
