"""The protocol's ground: identifiers, the ``Message`` base, error replies, message ids.

Run ids, policy names and other tokens become parts of subjects, stream and bucket
names, so they are checked here (``check_run_id``, ``check_policy``, ``check_token``).
Every message on the wire is a ``Message``: a msgspec Struct with a type tag (``type``)
and a schema version (``schema``). ``MessageIds`` builds the JetStream message ids that
make durable publishes land once.
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec

SCHEMA_VERSION = 1

_RUN_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_POLICY = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")
_TOKEN = re.compile(r"^[a-z0-9][a-z0-9_-]{0,127}$")

DEFAULT_POLICY = "policy"
"""The policy of a single-policy run; also the model name agents ask for."""


class ProtocolError(ValueError):
    """A message or identifier that does not follow this protocol."""


def check_run_id(run_id: str) -> str:
    """Run ids become subject tokens, stream and bucket names, so the alphabet is narrow."""
    if not _RUN_ID.match(run_id):
        raise ProtocolError(f"run id {run_id!r} must match {_RUN_ID.pattern}")
    return run_id


def check_policy(name: str) -> str:
    """Policy names are model names agents send, subject tokens and part of stream and
    bucket names: lowercase letters, digits and ``-``."""
    if not _POLICY.match(name):
        raise ProtocolError(f"policy name {name!r} must match {_POLICY.pattern}")
    return name


def check_token(value: str, what: str = "identifier") -> str:
    if not _TOKEN.match(value):
        raise ProtocolError(f"{what} {value!r} must match {_TOKEN.pattern}")
    return value


class MessageIds:
    """JetStream message ids (``Nats-Msg-Id``), all built here.

    A durable publish carries the id of the fact it records, so a publish retried after
    a lost acknowledgement, or repeated by a restarted service, is stored once (the
    stream's duplicate window): part of exactly-once. An id names the kind of fact, the
    policy whose line it belongs to (where there is one) and its index or version: two
    different facts never share an id, the same fact always gets the same one."""

    @staticmethod
    def batch(policy: str, batch_index: int) -> str:
        """BatchReady of one batch (the trajectory service, also after a restart)."""
        return f"batch-{policy}-{batch_index}"

    @staticmethod
    def batch_chunk(batch_id: str, digest: str, number: int) -> str:
        """One chunk of a batch's payload; the payload's digest is in it, so a batch
        rebuilt differently under the same index never reuses stale chunks."""
        return f"{batch_id}.{digest[:16]}.{number}"

    @staticmethod
    def data_batch_report(policy: str, batch_index: int) -> str:
        return f"data-batch-{policy}-{batch_index}"

    @staticmethod
    def data_epoch_report(stage_index: int, epoch: int) -> str:
        return f"data-epoch-{stage_index}-{epoch}"

    @staticmethod
    def group_closed(group_id: str) -> str:
        return f"closed-{group_id}"

    # The trainer's facts are keyed by version: after a resume, step numbers repeat,
    # versions never do.
    @staticmethod
    def weights(policy: str, version: int) -> str:
        return f"weights-{policy}-v{version}"

    @staticmethod
    def weights_stored(policy: str, version: int) -> str:
        """The second announcement of a version first announced with its fallback store
        pending (``DevicePayload.fallback_pending``)."""
        return f"weights-{policy}-v{version}-stored"

    @staticmethod
    def train_metrics(policy: str, version: int) -> str:
        return f"metrics-{policy}-v{version}"

    @staticmethod
    def train_eval(policy: str, version: int) -> str:
        return f"eval-{policy}-v{version}"

    @staticmethod
    def train_finished(policy: str, version: int) -> str:
        return f"finished-{policy}-v{version}"

    @staticmethod
    def train_plan(policy: str, trainer_id: str) -> str:
        """One per trainer process (a restart announces again, perhaps another budget)."""
        return f"plan-{policy}-{trainer_id}"


POLICY_TAG_PREFIX = "policy:"


def policy_tag(policy: str) -> str:
    """The capability tag of a resource that serves or trains ``policy``."""
    return POLICY_TAG_PREFIX + check_policy(policy)


def policy_of_tags(tags: list[str] | frozenset[str]) -> str:
    """The policy a resource's tags name (``DEFAULT_POLICY`` without a policy tag)."""
    named = sorted(t[len(POLICY_TAG_PREFIX) :] for t in tags if t.startswith(POLICY_TAG_PREFIX))
    if len(named) > 1:
        raise ProtocolError(f"a resource belongs to one policy; its tags name {named}")
    return check_policy(named[0]) if named else DEFAULT_POLICY


ENGINE_QUEUE = "engines"
TRAJECTORY_QUEUE = "trajectory"
TRAINER_DURABLE = "trainer"
WEIGHT_SYNC_DURABLE = "weight-sync"
TRAJECTORY_DURABLE = "trajectory"


class Message(msgspec.Struct, tag_field="type", kw_only=True, forbid_unknown_fields=False):
    """Base of every message on the wire."""

    schema: int = SCHEMA_VERSION


class ErrorReply(Message, tag="error"):
    """Any service -> a requester: the request was refused. ``code`` is machine-readable."""

    code: Literal[
        "bad_request",
        "not_found",
        "conflict",
        "unavailable",
        "internal",
        "context_length_exceeded",
    ]
    """``context_length_exceeded``: a ``bad_request`` that the prompt and its budget do
    not fit the engine's context (the gateway answers it with OpenAI's code)."""
    message: str
