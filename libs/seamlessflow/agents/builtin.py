"""Built-in agents."""

from __future__ import annotations

from openai import AsyncOpenAI, BaseModel

from seamlessflow.agents import AgentTask, register_agent
from seamlessflow.rewards import first_verdict, get_reward
from seamlessflow.tasks.verify import VERDICT_NO, VERDICT_YES, question_of, verifier_messages


@register_agent("single_turn")
async def single_turn(client: AsyncOpenAI, task: AgentTask) -> float | None:
    """Ask once; the task's verifier scores the answer."""
    await client.chat.completions.create(
        model=task.model,
        messages=task.messages,  # type: ignore[arg-type]
        max_tokens=task.max_tokens,
        temperature=task.temperature,
    )
    return None


@register_agent("token_ids")
async def token_ids(client: AsyncOpenAI, task: AgentTask) -> float | None:
    """Ask once as a client written against vLLM's token API does: the task's messages
    tokenized once (the session's ``/tokenize``, the chat prompt), then a completion
    whose prompt is those ids, with ``return_token_ids``. What it gets back are the ids
    the engine saw and produced (``prompt_token_ids``, ``token_ids``): a client that
    continues a conversation appends to them, never retokenizing its history. The
    task's verifier scores the answer."""
    tokenized = await client.post(
        session_url(client, "tokenize"),
        body={"messages": task.messages},
        cast_to=TokenizeAnswer,
    )
    answer = await client.completions.create(
        model=task.model,
        prompt=tokenized.tokens,
        max_tokens=task.max_tokens,
        temperature=task.temperature,
        extra_body={"return_token_ids": True},
    )
    (choice,) = answer.choices
    extra = choice.model_extra or {}
    if extra.get("prompt_token_ids") != tokenized.tokens or not extra.get("token_ids"):
        raise ValueError(f"the answer lacks the ids it was asked for: {sorted(extra)}")
    return None


class TokenizeAnswer(BaseModel):
    """The part of vLLM's ``/tokenize`` answer the agent reads."""

    tokens: list[int]


def session_url(client: AsyncOpenAI, path: str) -> str:
    """``path`` beside the session's ``/v1`` (where vLLM serves ``/tokenize``)."""
    return str(client.base_url).rstrip("/").removesuffix("/v1") + "/" + path


@register_agent("solve_and_verify")
async def solve_and_verify(client: AsyncOpenAI, task: AgentTask) -> dict[str, float]:
    """Two policies on one task (multi-policy): the first policy solves, the second judges
    the solver's answer. The solver earns the task's reward for its answer; the verifier
    earns 1 when its verdict (the first "yes" or "no" of its reply) matches
    what the task's reward function says about that answer, else 0."""
    if len(task.policies) < 2:
        raise ValueError(f"solve_and_verify needs two policies (solver, verifier); the run "
                         f"has {list(task.policies)}")  # fmt: skip
    if not task.reward_fn:
        raise ValueError(f"task {task.task_id} has no reward function to judge answers by")
    solver, verifier = task.policies[:2]
    solved = await client.chat.completions.create(
        model=solver,
        messages=task.messages,  # type: ignore[arg-type]
        max_tokens=task.max_tokens,
        temperature=task.temperature,
    )
    answer = solved.choices[0].message.content or ""
    correct = float(get_reward(task.reward_fn)(answer, task.reference))
    judged = await client.chat.completions.create(
        model=verifier,
        messages=verifier_messages(question_of(task.messages), answer),  # type: ignore[arg-type]
        max_tokens=task.max_tokens,
        temperature=task.temperature,
    )
    verdict = first_verdict(judged.choices[0].message.content or "")
    right = VERDICT_YES if correct >= 1.0 else VERDICT_NO
    return {solver: correct, verifier: 1.0 if verdict == right else 0.0}
