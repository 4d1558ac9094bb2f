"""A session as the gateway holds it: what opened it, its key digest, its conversation
tree of exact ids, how many turns it has recorded, and the lock its turns take.

The gateway's tables of open and finished sessions, and their rebuilding from the
trajectory stream after a restart, are in ``sf_gateway.session_table``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from seamlessflow.protocol import SessionOpened
from sf_gateway.conversation import Conversation, NodeKey
from sf_gateway.reasoning import ReasoningParser, reasoning_of
from sf_gateway.templating import ChatTokenizer


@dataclass
class GatewaySession:
    opened: SessionOpened
    key_sha256: str
    """Digest of the session's key: its routes take only that key."""
    conversation: Conversation
    finished: bool = False
    turns: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def new_session(
    opened: SessionOpened, tokenizer: ChatTokenizer, reasoning: ReasoningParser | None
) -> GatewaySession:
    """The session ``opened`` announces, with an empty conversation tree templated by
    ``tokenizer`` (``reasoning``: how the model's answers mark their reasoning)."""
    conversation = Conversation(
        render=tokenizer.render,
        encode=tokenizer.encode_text,
        end_of_turn=tokenizer.end_of_turn,
        reasoning=(lambda text: reasoning_of(reasoning, text)) if reasoning else None,
    )
    return GatewaySession(opened=opened, key_sha256=opened.key_sha256, conversation=conversation)


def add_node(
    session: GatewaySession,
    tokenizer: ChatTokenizer,
    node: NodeKey,
    prompt_ids: list[int],
    completion: list[int],
) -> None:
    """Put a recorded answer into the session's tree, with the exact ids recorded."""
    ids = [*prompt_ids, *completion]
    raw = tokenizer.raw_text(completion)
    session.conversation.restore(node, ids, raw, prompt_length=len(prompt_ids))
