"""vLLM's token API on the gateway: ``return_token_ids`` gives a client the ids the engine
saw and produced, so an agent written against vLLM never retokenizes; prompts as token
ids (alone or as a batch of one) are used as given.

The ids returned are checked against what the trajectory recorded for training, not
against the gateway's own tokenizer: that is the promise a client relies on.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from seamlessflow.bus import Bus
from tests.support import recorded_turns

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


async def open_session(http: httpx.AsyncClient) -> dict[str, str]:
    response = await http.post("/sessions", json={})
    assert response.status_code == 201, response.text
    session = response.json()
    return {"authorization": f"Bearer {session['api_key']}", "base": session["base_url"]}


async def post(http: httpx.AsyncClient, session: dict[str, str], path: str, **body: Any) -> Any:
    response = await http.post(
        session["base"] + path,
        json={"model": "policy", "max_tokens": 6, **body},
        headers={"authorization": session["authorization"]},
    )
    return response


def events(response: httpx.Response) -> list[dict[str, Any]]:
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [orjson.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def streamed_ids(chunks: list[dict[str, Any]]) -> list[int]:
    """The ids of a one-choice stream, its chunks' ``token_ids`` in order."""
    return [token for chunk in chunks for token in chunk["choices"][0]["token_ids"]]


async def test_chat_returns_the_ids_the_turns_recorded_whole_and_streamed(
    gateway_url: str, bus: Bus
) -> None:
    async with httpx.AsyncClient(base_url=gateway_url, timeout=60) as http:
        session = await open_session(http)
        whole = await post(
            http, session, "/chat/completions", messages=MESSAGES, n=2, return_token_ids=True
        )
        assert whole.status_code == 200, whole.text
        plain = await post(http, session, "/chat/completions", messages=MESSAGES)
        streamed = await post(
            http,
            session,
            "/chat/completions",
            messages=MESSAGES,
            return_token_ids=True,
            stream=True,
            temperature=0.7,
        )
        assert streamed.status_code == 200, streamed.text
    turns = await recorded_turns(bus)
    assert len(turns) == 4  # two choices, the plain one, the streamed one

    body = whole.json()
    assert body["prompt_token_ids"] == turns[0].prompt_ids == turns[1].prompt_ids
    by_index = {choice["index"]: choice["token_ids"] for choice in body["choices"]}
    assert sorted(by_index.values()) == sorted([turns[0].completion_ids, turns[1].completion_ids])
    assert all(by_index.values()), "each choice generated ids"
    assert "prompt_token_ids" not in plain.json()
    assert "token_ids" not in plain.json()["choices"][0]

    chunks = events(streamed)
    assert chunks[0]["prompt_token_ids"] == turns[3].prompt_ids
    assert all("prompt_token_ids" not in chunk for chunk in chunks[1:])
    assert streamed_ids(chunks) == turns[3].completion_ids


async def test_completions_take_token_id_prompts_and_return_the_recorded_ids(
    gateway_url: str, bus: Bus
) -> None:
    prompt = [5, 9, 23, 7, 11]
    async with httpx.AsyncClient(base_url=gateway_url, timeout=60) as http:
        session = await open_session(http)
        as_ids = await post(http, session, "/completions", prompt=prompt, return_token_ids=True)
        assert as_ids.status_code == 200, as_ids.text
        batch_of_one = await post(
            http, session, "/completions", prompt=[prompt], return_token_ids=True, stream=True
        )
        assert batch_of_one.status_code == 200, batch_of_one.text
        text_batch = await post(http, session, "/completions", prompt=["2 + 2 ="])
        assert text_batch.status_code == 200, text_batch.text
        recorded_before = len(await recorded_turns(bus))
        for refused in ([prompt, prompt], ["a", "b"], []):
            response = await post(http, session, "/completions", prompt=refused)
            assert response.status_code == 400, (refused, response.text)
            error = response.json()["error"]
            assert error["param"] == "prompt" and error["type"] == "invalid_request_error"
    turns = await recorded_turns(bus)
    assert len(turns) == recorded_before == 3  # the refused prompts stored nothing

    (choice,) = as_ids.json()["choices"]
    assert choice["prompt_token_ids"] == prompt == turns[0].prompt_ids
    assert choice["token_ids"] == turns[0].completion_ids
    chunks = events(batch_of_one)
    assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt == turns[1].prompt_ids
    assert all("prompt_token_ids" not in chunk["choices"][0] for chunk in chunks[1:])
    assert streamed_ids(chunks) == turns[1].completion_ids
    assert "token_ids" not in text_batch.json()["choices"][0]
