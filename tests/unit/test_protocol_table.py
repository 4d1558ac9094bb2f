"""The producer -> subject -> consumer table (docs/architecture.md, "How the parts talk")
is current, and what each route declares holds in the code: every concrete subject has a
route, a durable route is stored by the stream it names (and nothing else is stored),
the route is said once (the builder's docstring does not restate it), every message type
travels somewhere, and every producer and consumer a route names builds or follows that
subject.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from seamlessflow import protocol as p
from seamlessflow.protocol import table
from seamlessflow.protocol.routes import Route, route, routes_of
from tests.support import REPO_ROOT

ROOT = REPO_ROOT
ARCHITECTURE = ROOT / "docs" / "architecture.md"
ROUTES = routes_of(p.Subjects)

PARTY_CODE = {
    "gateway": ["services/sf_gateway"],
    "engine": [
        "services/sf_engine",
        "libs/seamlessflow/resources.py",
        "libs/seamlessflow/weights/group.py",
    ],
    "trainer": [
        "services/sf_trainer",
        "libs/seamlessflow/resources.py",
        "libs/seamlessflow/weights/group.py",
        "libs/seamlessflow/batches.py",
    ],
    "trajectory": ["services/sf_trajectory", "libs/seamlessflow/batches.py"],
    "weight-sync": ["services/sf_weight_sync"],
    "tag-scheduler": ["services/sf_tag_scheduler"],
    "agent runner": ["services/sf_agents"],
    "seamlessflow export": ["app/sf_app/cli.py"],
    "seamlessflow track": ["app/sf_app/tracking.py"],
    "embedded run": ["app/sf_app/run/embedded.py"],
}
"""Where each party that routes name lives: the service's package, and the library
modules that speak for it (``seamlessflow.resources`` registers engines and trainers)."""


def build(subjects: p.Subjects, method: str) -> str:
    """The subject ``method`` builds, with a sample value for each argument."""
    builder = getattr(subjects, method)
    arguments = [
        3 if parameter.annotation in (int, "int") else f"x-{parameter.name}"
        for parameter in inspect.signature(builder).parameters.values()
    ]
    return str(builder(*arguments))


def subject_builders() -> list[str]:
    """Every method of ``Subjects`` that builds a subject (not a stream or bucket name)."""
    names = []
    for name, function in inspect.getmembers(p.Subjects, inspect.isfunction):
        returns = inspect.signature(function).return_annotation
        if not name.startswith("_") and returns in (str, "str"):
            if build(p.Subjects("run-1"), name).startswith("sf."):
                names.append(name)
    return names


def is_wildcard(subject: str) -> bool:
    return any(token in ("*", ">") for token in subject.split("."))


def nats_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, a final ``>`` one or more."""
    wanted, tokens = pattern.split("."), subject.split(".")
    for index, token in enumerate(wanted):
        if token == ">":
            return len(tokens) > index
        if index >= len(tokens) or token not in ("*", tokens[index]):
            return False
    return len(tokens) == len(wanted)


def test_the_table_in_the_architecture_page_is_current() -> None:
    document = ARCHITECTURE.read_text()
    assert table.replace_block(document) == document, (
        "docs/architecture.md's subjects table is stale: run "
        "python -m seamlessflow.protocol.table --write docs/architecture.md"
    )
    block = document[document.index(table.BEGIN) : document.index(table.END)]
    assert "`sf.<run>.engine.<policy>.generate`" in block
    assert "`sf.<run>.traj.event.<session>`" in block
    assert "JetStream `SF_<RUN>_BATCH-<policy>`" in block


def test_every_concrete_subject_has_a_route_and_wildcards_have_none() -> None:
    concrete = [
        name for name in subject_builders() if not is_wildcard(build(p.Subjects("r"), name))
    ]
    assert sorted(concrete) == sorted(ROUTES)
    assert len(ROUTES) >= 25


@pytest.mark.parametrize("method", sorted(ROUTES))
def test_a_route_is_stored_by_the_stream_it_names_and_only_then(method: str) -> None:
    declared = ROUTES[method]
    for policy in (p.DEFAULT_POLICY, "solver"):
        subjects = p.Subjects("run-1", policy)
        subject = build(subjects, method)
        storing = [
            stream
            for stream, captured in subjects.streams().items()
            if any(nats_matches(pattern, subject) for pattern in captured)
        ]
        if declared.transport == "JetStream":
            assert storing == [getattr(subjects, declared.stream)()], subject
        else:
            assert storing == [], f"{subject} is {declared.transport} but stored"


@pytest.mark.parametrize("method", sorted(ROUTES))
def test_the_builders_docstring_leaves_the_route_to_its_declaration(method: str) -> None:
    """Who sends what to whom is in ``@route`` (and the generated table) only; a docstring
    that says it again in words (``A -> B: gateway -> engine``) drifts from it."""
    docstring = inspect.getdoc(getattr(p.Subjects, method)) or ""
    assert "->" not in docstring, method
    assert not docstring.startswith(ROUTES[method].sends[0].__name__), method


def test_every_message_type_travels_on_some_route() -> None:
    def subclasses(cls: type) -> set[type]:
        found: set[type] = set(cls.__subclasses__())
        for sub in list(found):
            found |= subclasses(sub)
        return found

    routed = {m for r in ROUTES.values() for m in (*r.sends, *r.replies)}
    every = subclasses(p.Message) - {p.ErrorReply}  # ErrorReply answers any request
    assert every - routed == set()
    assert set(p.MESSAGE_TYPES) - {p.ErrorReply} <= routed


def party_source(party: str) -> str:
    texts = []
    for relative in PARTY_CODE[party]:
        path = ROOT / relative
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            texts.append(file.read_text())
    return "\n".join(texts)


@pytest.mark.parametrize("method", sorted(ROUTES))
def test_each_producer_and_consumer_uses_the_subject(method: str) -> None:
    """A party named in a route builds the subject, or follows a wildcard that covers it
    (the gateway replays every trajectory event through ``trajectory_events_all``)."""
    subjects = p.Subjects("run-1")
    subject = build(subjects, method)
    covering = {method} | {
        name
        for name in subject_builders()
        if is_wildcard(pattern := build(subjects, name)) and nats_matches(pattern, subject)
    }
    declared = ROUTES[method]
    for party in (*declared.producers, *declared.consumers):
        name = Route.party_name(party)
        assert name in PARTY_CODE, f"{method}: unknown party {name!r}"
        source = party_source(name)
        assert any(f".{builder}(" in source for builder in covering), (
            f"{name} is named on {method} but its code never builds {sorted(covering)}"
        )


def test_the_table_command_prints_writes_and_checks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert table.main([]) == 0
    assert capsys.readouterr().out == table.render()
    document = tmp_path / "doc.md"
    document.write_text(f"# Doc\n\nbefore\n\n{table.BEGIN}\nold\n{table.END}\n\nafter\n")
    assert table.main(["--check", str(document)]) == 1
    assert table.main(["--write", str(document)]) == 0
    assert document.read_text() == f"# Doc\n\nbefore\n\n{table.render()}\nafter\n"
    assert table.main(["--check", str(document)]) == 0
    document.write_text("# no block here\n")
    assert table.main(["--check", str(document)]) == 2


def test_routes_refuse_inconsistent_declarations() -> None:
    with pytest.raises(ValueError, match="stream"):
        route(p.Heartbeat, by="engine", to="tag-scheduler", transport="JetStream")
    with pytest.raises(ValueError, match="stream"):
        route(p.Heartbeat, by="engine", to="tag-scheduler", transport="core", stream="x")
    with pytest.raises(ValueError, match="replies"):
        route(p.SlotsClaim, replies=p.SlotsGranted, by="trainer", to="x", transport="core")
    with pytest.raises(ValueError, match="producer"):
        route(p.Heartbeat, by=(), to="tag-scheduler", transport="core")
