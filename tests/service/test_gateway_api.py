"""The gateway's HTTP API with the base model: on a live gateway its OpenAPI document
and /tokenize and /detokenize (every answer checked against the ``openai`` package's
types), and the logprob bytes of the base tokenizer's tokens that split a character.
Every family's token bytes and ids, and the answer checker itself, are
tests/unit/test_gateway_api_shapes.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openapi_spec_validator import validate
from starlette.routing import Route

from seamlessflow.bus import Bus
from seamlessflow.protocol import TopLogprob, TrajectoryEvent, TurnRecorded, decode
from sf_engine.service import EngineService
from sf_engine.settings import EngineSettings
from sf_gateway.choice import Choice
from sf_gateway.openapi import OPERATIONS
from sf_gateway.responses import ChatFormat
from sf_gateway.service import GatewayService
from sf_gateway.settings import GatewaySettings
from sf_gateway.templating import ChatTokenizer
from sf_tag_scheduler.service import TagSchedulerService
from sf_weight_sync.service import WeightSyncService
from tests.support import session_auth
from tests.support.openai_shapes import check_body, documented_paths, kinds_for
from tests.support.token_texts import SPLIT_TEXT

pytestmark = pytest.mark.usefixtures("openai_shapes")


@pytest.fixture
async def gateway(mesh) -> GatewayService:  # type: ignore[no-untyped-def]
    await mesh.start(TagSchedulerService())
    await mesh.start(WeightSyncService())
    await mesh.start(EngineService(EngineSettings(engine_id="engine-a", max_batch_size=8)))
    service = await mesh.start(GatewayService(GatewaySettings(port=0, max_context=128)))
    await asyncio.wait_for(service.ready.wait(), 30)
    return service  # type: ignore[no-any-return]


def url_of(service: GatewayService) -> str:
    return f"http://127.0.0.1:{service.bound_port}"


async def events_of(bus: Bus) -> list[Any]:
    s = bus.subjects
    return [
        decode(m.data, TrajectoryEvent)
        for m in await bus.read_all(s.stream_trajectory(), s.trajectory_events_all())
    ]


# ------------------------------------------------------------------ OpenAPI


async def test_the_openapi_document_is_valid_and_lists_every_route(
    gateway: GatewayService,
) -> None:
    async with httpx.AsyncClient(base_url=url_of(gateway)) as http:
        document = (await http.get("/openapi.json")).json()
    validate(document)  # raises on anything OpenAPI 3.1 does not allow
    app = gateway.gateway.app()
    app = getattr(app, "__wrapped__", app)  # the app itself, not the answer checker
    served = {
        (route.path, method.lower())
        for route in app.routes
        if isinstance(route, Route)
        for method in route.methods or ()
        if method != "HEAD"
    }
    documented = {(path, method) for path, ops in document["paths"].items() for method in ops}
    assert served == documented
    assert documented_paths() == {path for path, _ in served}
    # every documented answer is the type the answer checker validates that route with
    for op in OPERATIONS:
        kinds = kinds_for(op.path.replace("{session_id}", "sX"))
        assert kinds is not None and kinds[0] is op.answer, op.path
    chat = document["paths"]["/s/{session_id}/v1/chat/completions"]["post"]
    schemas = document["components"]["schemas"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ChatCompletionRequest"
    )
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    assert chat["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ChatCompletion"
    )


# ------------------------------------------------------------------ tokenize


async def test_tokenize_gives_the_ids_a_turn_records(gateway: GatewayService, bus: Bus) -> None:
    """In a session, /tokenize answers the prompt ids its next chat turn records: the
    first turn's template, and a follow-up's stored history ids plus its new messages."""
    async with httpx.AsyncClient(base_url=url_of(gateway)) as http:
        session = (await http.post("/sessions", json={})).json()
        sid, auth = session["session_id"], session_auth(session)
        async with AsyncOpenAI(
            base_url=session["base_url"], api_key=session["api_key"], max_retries=0
        ) as client:

            async def tokenize(**body: Any) -> dict[str, Any]:
                answer = await http.post(f"/s/{sid}/tokenize", json=body, headers=auth)
                assert answer.status_code == 200, answer.text
                return answer.json()  # type: ignore[no-any-return]

            first = [{"role": "user", "content": "What is 2 + 2? " + SPLIT_TEXT}]
            before = await tokenize(messages=first, model="policy")
            outside = await http.post("/tokenize", json={"messages": first})
            reply = await client.chat.completions.create(
                model="policy",
                messages=first,
                max_tokens=5,  # type: ignore[arg-type]
            )
            follow_up = [
                *first,
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": "Sure?"},
            ]
            second = await tokenize(messages=follow_up, return_token_strs=True)
            await client.chat.completions.create(model="policy", messages=follow_up, max_tokens=5)  # type: ignore[arg-type]
            text = await tokenize(prompt=SPLIT_TEXT)
            await client.completions.create(model="policy", prompt=SPLIT_TEXT, max_tokens=2)
            detok = await http.post(f"/s/{sid}/detokenize", json={"tokens": second["tokens"]},
                                    headers=auth)  # fmt: skip
    turns = [e for e in await events_of(bus) if isinstance(e, TurnRecorded)]
    assert [t.session_id for t in turns] == [sid] * 3
    assert before["tokens"] == turns[0].prompt_ids and before["count"] == len(turns[0].prompt_ids)
    assert before["max_model_len"] == 128
    assert outside.json()["tokens"] == turns[0].prompt_ids
    # the follow-up continues the first turn's exact ids (prompt + engine completion)
    assert second["tokens"] == turns[1].prompt_ids
    assert second["tokens"][: len(turns[0].prompt_ids) + len(turns[0].completion_ids)] == [
        *turns[0].prompt_ids,
        *turns[0].completion_ids,
    ]
    assert len(second["token_strs"]) == second["count"]
    assert any(s.startswith("bytes:\\x") for s in second["token_strs"])  # split characters
    assert text["tokens"] == turns[2].prompt_ids
    tokenizer = gateway.gateway.tokenizer
    assert detok.json() == {"prompt": tokenizer.raw_text(turns[1].prompt_ids)}
    assert gateway.gateway.sessions[sid].conversation.forks == 0  # a look is not a fork


async def test_tokenize_refuses_bad_input_and_stores_nothing(
    gateway: GatewayService, bus: Bus
) -> None:
    async with httpx.AsyncClient(base_url=url_of(gateway)) as http:
        session = (await http.post("/sessions", json={})).json()
        sid, auth = session["session_id"], session_auth(session)
        before = await events_of(bus)
        user = [{"role": "user", "content": "x"}]
        bad: list[tuple[str, Any, int, str | None]] = [
            ("tokenize", {}, 400, None),
            ("tokenize", {"messages": user, "prompt": "x"}, 400, None),
            ("tokenize", {"messages": []}, 400, "messages"),
            ("tokenize", {"prompt": "x", "add_special_tokens": True}, 400, "add_special_tokens"),
            ("tokenize", {"prompt": "x", "tools": []}, 400, None),
            ("tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
            ("tokenize", {"prompt": "x", "model": "nope"}, 404, "model"),
            ("detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
            ("detokenize", {"tokens": ["a"]}, 400, "tokens"),
            ("detokenize", {}, 400, "tokens"),
        ]
        for route, body, status, param in bad:
            for path in (f"/s/{sid}/{route}", f"/{route}"):
                answer = await http.post(path, json=body, headers=auth)
                assert answer.status_code == status, (path, body, answer.text)
                error = answer.json()["error"]
                assert error["type"] == "invalid_request_error" and error["message"]
                if param is not None:
                    assert param in (error["param"] or ""), (body, error)
        for route in ("tokenize", "detokenize"):  # the session's key only
            unauthorized = await http.post(f"/s/{sid}/{route}", json={"prompt": "x"})
            assert unauthorized.status_code == 401
        assert await events_of(bus) == before


# ------------------------------------------------------------------ logprob bytes


def _choice_of(tokenizer: ChatTokenizer, text: str) -> Choice:
    ids = [*tokenizer.encode_text(text), *tokenizer.stop_token_ids[-1:]]
    choice = Choice(0, tokenizer.decode_completion)
    tops = [[TopLogprob(token_id=t, logprob=-0.5), TopLogprob(token_id=3, logprob=-2.0)]
            for t in ids]  # fmt: skip
    for i, token in enumerate(ids):  # one token at a time, as an engine streams them
        choice.extend([token], [-0.5], [0], tops[i : i + 1])
    choice.finish_reason = "stop"
    return choice


def test_logprob_bytes_are_each_tokens_raw_bytes(base_model_dir: Path) -> None:
    """Tokens holding part of a multi-byte character carry their exact bytes (the old
    per-token decode gave U+FFFD's bytes), in the whole answer and in the stream, and
    their ``token`` is OpenAI's ``bytes:\\xNN`` spelling."""
    tokenizer = ChatTokenizer(base_model_dir)
    choice = _choice_of(tokenizer, SPLIT_TEXT)
    assert choice.text == SPLIT_TEXT
    assert any(tokenizer.token_text(t) == "\ufffd" for t in choice.token_ids)  # splits chars
    end = tokenizer.tokenizer.convert_ids_to_tokens(choice.token_ids[-1])

    def view() -> ChatFormat:
        return ChatFormat(model="policy", token_text=tokenizer.token_text,
                          token_bytes=tokenizer.token_bytes, logprobs=True)  # fmt: skip

    whole = view().response(3, [choice])
    assert check_body(ChatCompletion, json.dumps(whole).encode()) == []
    entries = whole["choices"][0]["logprobs"]["content"]
    assert b"".join(bytes(e["bytes"]) for e in entries) == (SPLIT_TEXT + end).encode()
    for entry in entries:
        for top in entry["top_logprobs"]:
            if top["bytes"] == entry["bytes"]:
                assert top["token"] == entry["token"]
    partial = [e for e in entries if e["token"].startswith("bytes:")]
    assert partial and all(
        e["token"] == "bytes:" + "".join(f"\\x{b:02x}" for b in e["bytes"]) for e in partial
    )
    assert [bytes(e["bytes"]).decode() for e in entries if e not in partial] == [
        e["token"] for e in entries if e not in partial
    ]

    streamed_choice = _choice_of(tokenizer, SPLIT_TEXT)
    stream = view()
    chunks = [*stream.opening([streamed_choice])]
    progress = stream.progress(streamed_choice)
    if progress is not None:
        chunks.append(progress)
    chunks += stream.closing(streamed_choice)
    streamed = []
    for chunk in chunks:
        assert check_body(ChatCompletionChunk, json.dumps(chunk).encode()) == []
        streamed += (chunk["choices"][0]["logprobs"] or {}).get("content") or []
    assert streamed == entries
