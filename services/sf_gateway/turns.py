"""A validated request as a turn: the policy its model picks, the engine budget that
fits the context, what every choice asks the engines for (``Plan``), the choices, and
the view that formats them for the agent.

Everything here is checked before anything is stored: a request that fails a check is
a 4xx and changes nothing. Running a turn and recording it are
``sf_gateway.turn_runner``'s; its engine calls are ``sf_gateway.engine_client``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from seamlessflow.protocol import SEEDS
from sf_gateway.choice import Choice
from sf_gateway.conversation import Conversation, NodeKey
from sf_gateway.openai_api import ApiError, ChatCompletionRequest, CompletionRequest
from sf_gateway.reasoning import ReasoningParser
from sf_gateway.responses import ChatFormat, CompletionFormat
from sf_gateway.sessions import GatewaySession
from sf_gateway.settings import GatewaySettings
from sf_gateway.templating import ChatTokenizer
from sf_gateway.tool_parsers import ToolParser


@dataclass(frozen=True)
class Plan:
    """What every choice of one request asks the engines for."""

    policy: str
    """Whose engines answer (the request's ``model``)."""
    prompt_ids: list[int]
    max_tokens: int
    n: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    top_logprobs: int
    stop: tuple[str, ...]
    hold_from: str
    """While streaming, text from this marker on (a tool call) is held until parsed."""
    engine_stream: bool
    """Engines stream chunks: for SSE, and to catch stop strings early."""
    include_usage: bool
    forced_text: str = ""
    """The opening of a forced tool call, whose ids end ``prompt_ids``: the start of
    every choice's text (the agent's answer), not of its engine-generated ids."""
    structured_output: str = ""
    """The engines' constraint for ``response_format`` (empty: none); its turns are
    recorded as ``constrained``."""

    def seed_for(self, index: int) -> int | None:
        """Choice i of a seeded request uses seed + i (modulo 2**64): n choices differ,
        and a repeat of the request (streamed or not) gives the same n answers."""
        if self.seed is None:
            return None
        seed = self.seed + index  # past the largest seed it wraps around
        return seed if seed in SEEDS else seed - 2**64


@dataclass
class Turn:
    """One request in flight: its session, plan, choices, and the tree node of each."""

    session: GatewaySession
    plan: Plan
    choices: list[Choice]
    node_of: Callable[[Choice], NodeKey | None]
    """The node of the session's tree a recorded choice becomes (None: no tree)."""
    span: str
    on_update: Callable[[], None] = lambda: None
    parent_digest: str = ""
    """The tree node whose messages this request continues (``Prompt.parent``)."""
    tool_call_errors: Callable[[Choice], list[str]] = lambda _: []
    """The kinds of the malformed tool calls in a choice's answer (recorded with it)."""


class TurnPlanner:
    """Builds turns from validated requests, for the served models (the run's
    policies) with one tokenizer, tool parser and reasoning parser."""

    def __init__(
        self,
        settings: GatewaySettings,
        tokenizer: ChatTokenizer,
        models: list[str],
        tool_parser: ToolParser | None,
        reasoning_parser: ReasoningParser | None,
    ) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.models = models
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser

    def check_model(self, model: str, param: str = "model") -> str:
        """The policy a model name picks (they are the same name)."""
        if model not in self.models:
            raise ApiError(
                404,
                f"model {model!r} does not exist; served: {self.models}",
                param=param,
                code="model_not_found",
            )
        return model

    def chat_turn(
        self, session: GatewaySession, body: ChatCompletionRequest, span: str
    ) -> tuple[Turn, ChatFormat]:
        """A validated chat request as a turn to run (templated on the session's tree,
        recorded as a chat turn) and the view of its choices. Checks everything before
        anything is stored; shared by chat completions and the Responses API."""
        policy = self.check_model(body.model)
        body.check()
        messages, tools = body.template_messages(), body.template_tools()
        opening = self._forced_call_opening(body)
        prompt = session.conversation.prompt_for(messages, tools)
        prompt_ids = prompt.ids
        if opening:  # inserted, not sampled: part of the prompt, never trained
            prompt_ids = prompt_ids + self.tokenizer.encode_text(opening)
        parser = self.tool_parser if body.parses_tool_calls else None
        # what may still become reasoning or a tool call is held back by the view
        plan = self._plan(
            body,
            policy,
            prompt_ids,
            hold_from="",
            forced_text=opening,
            structured_output=body.structured_output,
        )
        view = ChatFormat(
            model=body.model,
            token_text=self.tokenizer.token_text,
            token_bytes=self.tokenizer.token_bytes,
            include_usage=body.include_usage,
            parser=parser,
            reasoning=self.reasoning_parser,
            reasoning_opened=self._opens_reasoning(prompt_ids),
            logprobs=body.logprobs,
            tool_names=frozenset(t.function.name for t in body.tools or []) if parser else None,
            prompt_ids=list(plan.prompt_ids) if body.return_token_ids else None,
        )

        def node_of(choice: Choice) -> NodeKey:
            # each choice is a sibling node of the session's tree (same messages)
            return Conversation.node_key(messages, tools, view.message(choice))

        turn = Turn(session, plan, self._choices(plan), node_of, span)
        turn.tool_call_errors = lambda choice: [e.kind for e in view.parsed(choice).errors]
        turn.parent_digest = prompt.parent.digest if prompt.parent is not None else ""
        return turn, view

    def completion_turn(
        self, session: GatewaySession, body: CompletionRequest
    ) -> tuple[Turn, CompletionFormat]:
        """A validated completion request (a text or token-id prompt, no template) as a
        turn to run, recorded outside the session's tree, and the view of its choices."""
        policy = self.check_model(body.model)
        body.check()
        if isinstance(body.prompt, str):
            prompt_ids = self.tokenizer.encode_text(body.prompt)
        else:
            prompt_ids = list(body.prompt)
            bad = [t for t in prompt_ids if not 0 <= t < self.tokenizer.vocab_size]
            if bad:
                raise ApiError(
                    400, f"prompt has token ids outside the vocabulary: {bad[:5]}", param="prompt"
                )
        plan = self._plan(body, policy, prompt_ids, hold_from="")
        view = CompletionFormat(
            model=body.model,
            token_text=self.tokenizer.token_text,
            include_usage=body.include_usage,
            logprobs=body.logprobs,
            prompt_ids=list(plan.prompt_ids) if body.return_token_ids else None,
        )
        turn = Turn(session, plan, self._choices(plan), lambda _: None, "gateway.completion")
        return turn, view

    def _opens_reasoning(self, prompt_ids: list[int]) -> bool:
        """The prompt ends inside an opened reasoning block (a template that opens it in
        the generation prompt): the answer starts with reasoning."""
        parser = self.reasoning_parser
        if parser is None:
            return False
        return self.tokenizer.raw_text(prompt_ids[-8:]).rstrip().endswith(parser.start)

    def _forced_call_opening(self, body: ChatCompletionRequest) -> str:
        """For tool_choice 'required' or a named function: the opening of a call in the
        tool parser's format, which the gateway appends to the prompt so that the model
        continues it (a named one up to its arguments). Those ids are inserted, not
        sampled: they are recorded as prompt ids (never trained), and every completion
        id is the engine's own sample of the unconstrained distribution, so its
        recorded logprob is exactly what the trainer recomputes."""
        if not body.forces_tool_call:
            return ""
        opening = getattr(self.tool_parser, "call_opening", None)
        if opening is None:
            raise ApiError(
                400,
                f"tool_choice {body.tool_choice!r} is not supported with the tool parser "
                f"{self.settings.tool_parser!r} (it cannot open a call)",
                param="tool_choice",
            )
        text = str(opening(body.forced_tool_name))
        # stop strings are searched in the answer's text, which starts with the opening
        inside = [stop for stop in body.stop_strings if stop in text]
        if inside:
            raise ApiError(
                400,
                f"stop string {inside[0]!r} occurs in the forced tool call's opening {text!r}",
                param="stop",
            )
        return text

    def _plan(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        policy: str,
        prompt_ids: list[int],
        hold_from: str,
        forced_text: str = "",
        structured_output: str = "",
    ) -> Plan:
        stop = body.stop_strings
        return Plan(
            policy=policy,
            prompt_ids=prompt_ids,
            max_tokens=self._check_budget(
                prompt_ids, body.token_budget(self.settings.default_max_tokens), body.budget_param
            ),
            n=body.n,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            top_logprobs=body.k_top_logprobs,
            stop=stop,
            hold_from=hold_from if body.stream else "",
            engine_stream=body.stream or bool(stop),
            include_usage=body.include_usage,
            forced_text=forced_text,
            structured_output=structured_output,
        )

    def _choices(self, plan: Plan) -> list[Choice]:
        decode: Callable[[list[int]], str] = self.tokenizer.decode_completion
        if plan.forced_text:  # the agent's text: the inserted opening, then the samples
            decode = _after(plan.forced_text, decode)
        return [Choice(i, decode, plan.stop, plan.hold_from) for i in range(plan.n)]

    def _check_budget(self, prompt_ids: list[int], max_tokens: int, param: str | None) -> int:
        """The engine budget: the agent's (``param``), which must fit in the context
        with the prompt (a 400 naming it otherwise, as vLLM's server answers), or the
        default clipped to the room the prompt leaves."""
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        limit = self.settings.max_context
        if len(prompt_ids) >= limit:
            raise ApiError(
                400,
                f"prompt has {len(prompt_ids)} tokens; the context is {limit}",
                code="context_length_exceeded",
            )
        if param is not None and len(prompt_ids) + max_tokens > limit:
            raise ApiError(
                400,
                f"{param}: the context is {limit} tokens; the prompt has {len(prompt_ids)}, "
                f"so at most {limit - len(prompt_ids)} can be generated, not {max_tokens}",
                param=param,
                code="context_length_exceeded",
            )
        return min(max_tokens, limit - len(prompt_ids))


def _after(opening: str, decode: Callable[[list[int]], str]) -> Callable[[list[int]], str]:
    return lambda ids: opening + decode(ids)
