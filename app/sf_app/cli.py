"""The ``seamlessflow`` command line.

Heavy modules (torch, transformers, the services) are imported inside the commands,
so ``seamlessflow --help`` is instant.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import re
import shutil
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn, get_args, get_origin

import typer

from seamlessflow.protocol import DEFAULT_POLICY
from sf_app.service_table import SERVICE_NAMES, SETTINGS, settings_classes

app = typer.Typer(
    help="SeamlessFlow: server-based RL post-training for LLM agents, over NATS.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


UP_HIDDEN = ("run_file",)
"""``RunConfig`` fields that are not ``up`` options: the run file is ``--config``."""

UP_SHOWN_DEFAULTS = {
    "max_tokens": "the task's, else 6",
    "cache_dir": "$SF_CACHE_DIR or ~/.cache/seamlessflow",
    "run_id": "from the time",
}
"""What ``up --help`` shows as the default of fields whose default is computed."""


def _first_sentence(text: str | None) -> str:
    """A field docstring's first sentence, on one line, as plain text (an option's help)."""
    flat = " ".join((text or "").split()).replace("``", "")
    end = re.search(r"(?<!e\.g)(?<!i\.e)\.\s", flat)
    return flat if end is None else flat[: end.start() + 1]


def _up_parameters() -> list[inspect.Parameter]:
    """``up``'s options, one per ``RunConfig`` field: its name, type, default and the
    first sentence of its docstring. Each is None unless given, so a value not given on
    the command line comes from the run file or ``RunConfig``'s one default."""
    from sf_app.run.config import RunConfig

    keyword = inspect.Parameter.KEYWORD_ONLY
    params = [
        inspect.Parameter(
            "context", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context
        )
    ]
    for name, field in RunConfig.model_fields.items():
        if name in UP_HIDDEN:
            continue
        default = field.get_default(call_default_factory=True)
        shown: str | bool = UP_SHOWN_DEFAULTS.get(name, True)
        kind: Any = field.annotation
        if get_origin(kind) is list:
            kind, default = str, ",".join(map(str, default))
        elif get_origin(kind) is Literal:
            kind = str
        elif get_origin(kind) is not None:  # X | None
            kind = next(arg for arg in get_args(kind) if arg is not type(None)) | None
        option = typer.Option(help=_first_sentence(field.description), show_default=shown)
        params.append(
            inspect.Parameter(name, keyword, default=default, annotation=Annotated[kind, option])
        )
    config = typer.Option(
        "--config",
        envvar="SF_CONFIG",
        help="A run file (TOML): [run] takes these options, each other section one "
        "service's settings (examples/run_files/, docs/configuration.md). Options given "
        "here win over it.",
    )
    params.append(
        inspect.Parameter(
            "config_file", keyword, default=None, annotation=Annotated[Path | None, config]
        )
    )
    return params


def _run_config(context: typer.Context, config_file: Path | None, options: dict[str, Any]) -> Any:
    """The run's ``RunConfig``: the run file's ``[run]`` table, then the environment's
    shared variables (``SF_STEPS`` ...), then the options given on the command line
    (``sf_app.run.spec.run_values``); what none sets keeps RunConfig's default (which may
    depend on other fields: the task's completion budget, colocated's synchronous
    pacing). A bad file or value stops with one line."""
    from pydantic import ValidationError

    from seamlessflow.runfile import RunFileError
    from sf_app.run.config import RunConfig
    from sf_app.run.file import read_run_file
    from sf_app.run.spec import run_values

    run_table: dict[str, Any] = {}
    if config_file is not None:
        try:
            run_table = read_run_file(config_file, settings_classes())
        except RunFileError as exc:
            fail(str(exc))
        run_table["run_file"] = config_file
    command_line: dict[str, Any] = {}
    for name, value in options.items():
        source = context.get_parameter_source(name)
        if source is None or source.name != "COMMANDLINE":
            continue
        if get_origin(RunConfig.model_fields[name].annotation) is list:
            value = [part.strip() for part in str(value).split(",") if part.strip()]
        command_line[name] = value
    try:
        return RunConfig(**run_values(run_table, command_line))
    except ValidationError as exc:
        error = exc.errors()[0]
        # a field's error names the field; a check across fields (a model validator) has none
        where = f"{error['loc'][0]}: " if error["loc"] else ""
        fail(f"invalid run configuration: {where}{error['msg']}")


def up(context: typer.Context, config_file: Path | None = None, **options: Any) -> None:
    """Embedded local run: NATS, every service as a process, agents, training."""
    from sf_app.run.embedded import run_embedded

    config = _run_config(context, config_file, options)
    summary = run_embedded(config)
    typer.echo(json.dumps({k: v for k, v in summary.__dict__.items() if k != "config"}, indent=2))
    several = len(config.policies) > 1
    for policy, record in summary.policies.items():
        first, last = record.get("eval_first"), record.get("eval_last")
        if first is None or last is None:
            continue
        typer.echo(
            f"{f'{policy}: ' if several else ''}held-out {first['task']} "
            f"({first['samples']} prompts, greedy): {first['mean_reward']:.3f} at step "
            f"{first['step']} -> {last['mean_reward']:.3f} at step {last['step']}"
        )
    if summary.mode_choice.get("requested") == "auto":
        from sf_tag_scheduler.when_pays import choice_in_words

        for switch in summary.lending_switches:
            before = switch["before"]
            typer.echo(
                f"{switch['policy']}: lending from version {switch['version']}: "
                f"{'unmeasured' if before is None else choice_in_words(before)} -> "
                f"{choice_in_words(switch['after'])} ({switch['why']})"
            )
    typer.echo(f"run directory: {(config.runs_dir / summary.run_id).resolve()}")
    if summary.status != "finished":
        raise typer.Exit(1 if summary.status.startswith("failed") else 130)


up.__signature__ = inspect.Signature(_up_parameters())  # type: ignore[attr-defined]
app.command()(up)


def resolve(
    context: typer.Context,
    config_file: Path | None = None,
    out: Path = Path("run.toml"),
    **options: Any,
) -> None:
    """Write the run's resolved specification (TOML) to --out: the values `up` would
    run with (its options, the environment's SF_<KEY> shared variables, the run file;
    the task's and the model's defaults), every section with the shared values copied
    in. Each process started with SF_CONFIG naming it reads its own section: compose
    does (the run volume's run.toml), and so can a service started alone."""
    from sf_app.run.spec import resolved_sections, write_resolved

    config = _run_config(context, config_file, options)
    path = write_resolved(out, resolved_sections(config, settings_classes()))
    model = config.model or config.model_dir or "built-in"
    typer.echo(f"wrote {path}: task {config.task}, steps {config.steps}, "
               f"max_tokens {config.max_tokens}, model {model}")  # fmt: skip


_out = typer.Option("--out", help="Where the resolved file is written.")
resolve.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [
        *_up_parameters(),
        inspect.Parameter(
            "out",
            inspect.Parameter.KEYWORD_ONLY,
            default=Path("run.toml"),
            annotation=Annotated[Path, _out],
        ),
    ]
)
app.command()(resolve)


@app.command()
def serve(
    service: Annotated[str, typer.Argument(help=f"One of: {', '.join(SERVICE_NAMES)}.")],
) -> None:
    """Run one service alone against SF_NATS_URL (settings from the environment)."""
    if service not in SERVICE_NAMES:
        raise typer.BadParameter(f"unknown service {service!r}; known: {', '.join(SERVICE_NAMES)}")
    from sf_app.service_table import serve as serve_process

    serve_process(service)


CLI_NATS_WAIT_S = 5.0
"""How long a CLI command waits for an unreachable NATS server before it says so."""

RunDirOption = Annotated[
    Path | None,
    typer.Option(
        help="A run directory of `seamlessflow up` (runs/<run-id>): its connection details "
        "replace --run-id, --nats-url and SF_NATS_TOKEN."
    ),
]


def fail(message: str, code: int = 2) -> NoReturn:
    """End a command with one line on stderr (no usage panel: it wraps the message)."""
    typer.echo(message, err=True)
    raise typer.Exit(code)


def mesh_address(run_dir: Path | None, run_id: str, nats_url: str) -> tuple[str, str, str]:
    """``(run_id, nats_url, nats_token)`` from a run directory or from the options (the
    token from ``SF_NATS_TOKEN``: tokens on command lines are visible to every user)."""
    from seamlessflow.connection import NoConnection, RunConnection
    from seamlessflow.settings import MeshSettings

    if run_dir is not None:
        try:
            connection = RunConnection.read(run_dir)
        except NoConnection as exc:
            fail(str(exc))
        return connection.run_id, connection.nats_url, connection.nats_token
    if not run_id:
        fail("give --run-id (or SF_RUN_ID) or --run-dir")
    return run_id, nats_url, MeshSettings().nats_token.get_secret_value()


@app.command()
def export(
    session: Annotated[str, typer.Argument(help="Session id.")],
    run_dir: RunDirOption = None,
    run_id: Annotated[str, typer.Option(envvar="SF_RUN_ID", help="Run id.")] = "",
    nats_url: Annotated[str, typer.Option(envvar="SF_NATS_URL", help="NATS URL.")] = (
        "nats://127.0.0.1:4222"
    ),
) -> None:
    """Print a session's training samples (every branch: ids, loss mask, behaviour
    logprobs, per-token versions, reward) as JSON, from the trajectory service.
    NATS's token comes from SF_NATS_TOKEN, or from --run-dir."""
    import asyncio

    from seamlessflow.bus import NoResponder, RemoteError, Unrecoverable, connect
    from seamlessflow.protocol import SessionExport, SessionExportQuery, Subjects, encode

    run_id, nats_url, token = mesh_address(run_dir, run_id, nats_url)

    async def fetch() -> bytes:
        bus = await connect(
            nats_url, Subjects(run_id), name="seamlessflow-export", token=token,
            wait_s=CLI_NATS_WAIT_S,
        )  # fmt: skip
        try:
            reply = await bus.request(
                bus.subjects.trajectory_export(),
                SessionExportQuery(session_id=session),
                SessionExport,
                timeout=30.0,
            )
            return encode(reply)
        finally:
            await bus.drain()

    try:
        typer.echo(asyncio.run(fetch()).decode())
    except (RemoteError, NoResponder, Unrecoverable) as exc:
        typer.echo(f"export failed: {exc}", err=True)
        raise typer.Exit(1) from None


@app.command()
def track(
    report_to: Annotated[
        str, typer.Option(help="tensorboard | wandb | all, or several comma-separated.")
    ],
    run_dir: RunDirOption = None,
    run_id: Annotated[str, typer.Option(envvar="SF_RUN_ID", help="Run id.")] = "",
    nats_url: Annotated[str, typer.Option(envvar="SF_NATS_URL", help="NATS URL.")] = (
        "nats://127.0.0.1:4222"
    ),
    policies: Annotated[
        str, typer.Option(envvar="SF_POLICIES", help="The run's policies, comma-separated.")
    ] = DEFAULT_POLICY,
    out_dir: Annotated[
        Path | None,
        typer.Option(help="Where the trackers write (default: runs/<run-id>)."),
    ] = None,
) -> None:
    """Experiment tracking beside a deployed mesh: follow the run's metrics stream from
    its start into TensorBoard / W&B until every policy finishes (Ctrl-C stops).
    NATS's token comes from SF_NATS_TOKEN, or from --run-dir."""
    import asyncio
    import signal

    from seamlessflow.bus import Unrecoverable, connect
    from seamlessflow.protocol import Subjects
    from sf_app.tracking import ReportToError, Tracker, parse_report_to, track_run

    run_id, nats_url, token = mesh_address(run_dir, run_id, nats_url)
    try:
        backends = parse_report_to(report_to)
    except ReportToError as exc:
        fail(str(exc))
    if not backends:
        fail("--report-to names no tracker: nothing to do")
    names = [name.strip() for name in policies.split(",") if name.strip()] or [DEFAULT_POLICY]
    directory = out_dir or Path("runs") / run_id

    async def follow() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        bus = await connect(
            nats_url, Subjects(run_id), name="seamlessflow-track", token=token,
            wait_s=CLI_NATS_WAIT_S,
        )  # fmt: skip
        config = {"run_id": run_id, "policies": names, "nats_url": nats_url}
        try:
            with Tracker(
                backends, run_dir=directory, run_id=run_id, policies=names, config=config
            ) as tracker:
                return await track_run(bus, tracker, names, stop)
        finally:
            await bus.close()

    directory.mkdir(parents=True, exist_ok=True)
    try:
        steps = asyncio.run(follow())
    except Unrecoverable as exc:
        fail(str(exc), code=1)
    typer.echo(f"tracked {steps} steps of run {run_id} into {directory}")


@app.command()
def attach(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (runs/<run-id>).")],
) -> None:
    """Print how an external agent joins a running `seamlessflow up` run (what `up`
    prints when it starts)."""
    from seamlessflow.connection import NoConnection, RunConnection

    try:
        typer.echo(RunConnection.read(run_dir).attach_instructions(run_dir))
    except NoConnection as exc:
        fail(str(exc))


COMPOSE_SECRETS = ("SF_NATS_TOKEN", "SF_GATEWAY_API_KEYS")
"""What compose refuses to start without (compose/README.md, Credentials)."""


@app.command("compose-env")
def compose_env(
    path: Annotated[Path, typer.Argument(help="The env file compose reads.")] = Path(
        "compose/.env"
    ),
) -> None:
    """Write compose's env file with fresh secrets (a NATS token, a gateway operator
    key), readable by you only, unless it exists; an existing one is kept as it is."""
    import os
    import secrets
    import stat

    if path.exists():
        mode = stat.S_IMODE(path.stat().st_mode)
        held = {line.split("=", 1)[0].strip() for line in path.read_text().splitlines()}
        missing = [name for name in COMPOSE_SECRETS if name not in held]
        if missing:
            fail(f"{path} exists without {', '.join(missing)}: add it, or move the file away")
        if mode & 0o077:
            typer.echo(f"warning: {path} is readable by others ({oct(mode)}): chmod 600 {path}")
        typer.echo(f"kept {path}")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    # token_urlsafe: A-Z a-z 0-9 - _ only, what a NATS token and a bearer key may hold
    lines = [f"{name}={secrets.token_urlsafe(24)}\n" for name in COMPOSE_SECRETS]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.writelines(lines)
    typer.echo(f"wrote {path} (0600): {', '.join(COMPOSE_SECRETS)}")


@app.command()
def timeline(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (runs/<run-id>).")],
    chrome_trace: Annotated[
        Path | None,
        typer.Option(
            help="Also write the lanes as a Trace Event JSON file (Chrome/Perfetto "
            "format: one track per resource on each slot, the bubbles, the scheduler's "
            "lend/reclaim spans) to this path; open it in ui.perfetto.dev."
        ),
    ] = None,
) -> None:
    """Render a run's timeline (one lane per resource, bubbles marked) as HTML and PNG
    and print the bubble ratio (idle resource-time / total)."""
    from sf_app.run.report import merge_spans
    from sf_app.timeline import render_run, write_chrome_trace

    if not (run_dir / "spans.jsonl").exists() and not (run_dir / "spans").is_dir():
        raise typer.BadParameter(f"{run_dir} has neither spans.jsonl nor spans/")
    # a compose run's volume (or a run still going) has only the per-process files
    merge_spans(run_dir)
    result = render_run(run_dir)
    for resource in sorted(result.lanes):
        busy = result.busy(resource) / result.duration if result.duration else 0.0
        typer.echo(f"{resource:40s} busy {100 * busy:5.1f}%")
    typer.echo(f"bubble ratio {result.bubble_ratio:.3f} over {result.duration:.1f}s")
    typer.echo(f"wrote {run_dir / 'timeline.html'} and {run_dir / 'timeline.png'}")
    if chrome_trace is not None:
        slices = write_chrome_trace(run_dir / "spans.jsonl", chrome_trace)
        typer.echo(f"wrote {chrome_trace} ({slices} slices; open it in ui.perfetto.dev)")


@app.command()
def compare(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run directories (runs/<run-id>).")],
    out: Annotated[Path, typer.Option(help="Where the overlaid curves go (PNG).")] = Path(
        "compare.png"
    ),
) -> None:
    """Several runs side by side: a table of their figures and their reward and
    throughput curves overlaid (by step and by time)."""
    from sf_app.compare import NotARun, load_run, plot, table

    try:
        records = [load_run(run_dir) for run_dir in run_dirs]
    except NotARun as exc:
        fail(str(exc))
    typer.echo(table(records))
    plot(records, out)
    typer.echo(f"wrote {out}")


@app.command()
def plan(
    model: Annotated[
        str,
        typer.Argument(
            help="A model shape (qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b, qwen2.5-32b), a "
            "model directory or a config.json."
        ),
    ],
    gpus: Annotated[str, typer.Option(help="Rank counts, comma-separated.")] = "1,2,4,8",
    master_dtype: Annotated[
        str, typer.Option(help="float32 | bfloat16 (SF_TRAINER_MASTER_DTYPE).")
    ] = "float32",
    precision: Annotated[
        str, typer.Option(help="bf16-mixed | fp32: what forward and backward compute in.")
    ] = "bf16-mixed",
    gradient_checkpointing: Annotated[
        bool, typer.Option(help="SF_TRAINER_GRADIENT_CHECKPOINTING.")
    ] = False,
    cpu_offload: Annotated[bool, typer.Option(help="SF_TRAINER_CPU_OFFLOAD.")] = False,
    vocab_parallel: Annotated[
        bool, typer.Option(help="SF_TRAINER_VOCAB_PARALLEL: embeddings split by vocabulary rows.")
    ] = True,
    micro_batch_tokens: Annotated[int, typer.Option(help="SF_TRAINER_MICRO_BATCH_TOKENS.")] = 16384,
    logprob_chunk_tokens: Annotated[
        int, typer.Option(help="SF_TRAINER_LOGPROB_CHUNK_TOKENS.")
    ] = 1024,
    runtime_gb: Annotated[
        float, typer.Option(help="Held before the model (CUDA context, torch).")
    ] = 1.0,
) -> None:
    """Memory per rank of the trainer for a model on N ranks, from the model built on the
    meta device (sf_app.plan): sharded state, gathered units, activations, logits."""
    from seamlessflow.assets.shapes import shape_config
    from sf_app.plan import PlanSettings, model_sizes, plan_table

    if master_dtype not in ("float32", "bfloat16") or precision not in ("bf16-mixed", "fp32"):
        raise typer.BadParameter("--master-dtype float32|bfloat16, --precision bf16-mixed|fp32")
    try:
        config = shape_config(model)
        counts = [int(count) for count in gpus.split(",")]
    except ValueError as exc:
        fail(str(exc))
    settings = PlanSettings(
        master_dtype=master_dtype,
        compute_dtype="bfloat16" if precision == "bf16-mixed" else "float32",
        gradient_checkpointing=gradient_checkpointing,
        cpu_offload=cpu_offload,
        vocab_parallel=vocab_parallel,
        micro_batch_tokens=micro_batch_tokens,
        logprob_chunk_tokens=logprob_chunk_tokens,
        runtime_gb=runtime_gb,
    )
    typer.echo(plan_table(model, model_sizes(config), settings, counts))


@app.command("build-model")
def build_model(
    out: Annotated[
        Path | None,
        typer.Option(help="Output directory (HF layout); with --from, default: the cache."),
    ] = None,
    from_pretrained: Annotated[
        str,
        typer.Option(
            "--from",
            help="Convert a pretrained model shipped in a package (smollm2-135m-instruct) "
            "instead of building the built-in one (empty or built-in: the built-in one).",
        ),
    ] = "",
    cache_dir: Annotated[
        Path, typer.Option(envvar="SF_CACHE_DIR", help="Model cache (for --from).")
    ] = Path("~/.cache/seamlessflow"),
    seed: Annotated[int, typer.Option(help="Seed.")] = 0,
    force: Annotated[bool, typer.Option(help="Rebuild even if up to date.")] = False,
    task: Annotated[str, typer.Option(help="Task to warm up on.")] = "arithmetic",
    size: Annotated[str, typer.Option(help="Model size: small | medium (~25M).")] = "small",
    sft_steps: Annotated[
        int | None,
        typer.Option(
            envvar="SF_BASE_MODEL_SFT_STEPS",
            min=0,
            help="Warm-up steps (default: the task's recipe; fewer build faster and learn "
            "less: the compose checks' plumbing runs use 30).",
        ),
    ] = None,
) -> None:
    """Build the base model and tokenizer, or convert a packaged pretrained model (no
    downloads); skip if up to date."""
    from seamlessflow.assets.pretrained import BUILT_IN
    from seamlessflow.bus import Unrecoverable

    if from_pretrained and from_pretrained != BUILT_IN:
        from seamlessflow.assets.pretrained import ensure_converted, ensure_pretrained

        try:
            if out is None:
                path = ensure_pretrained(from_pretrained, cache_dir, force=force)
            else:
                path = ensure_converted(from_pretrained, out, force=force)
        except Unrecoverable as exc:
            fail(str(exc))
        typer.echo(str(path))
        return
    if out is None:
        fail("--out is required to build the built-in model")
    from seamlessflow.assets.pretrained import BUILD_INFO
    from sf_app.base_model import build_base_model, ensure_base_model, sized_config

    info = out / BUILD_INFO
    if info.is_file() and "source_sha256" in json.loads(info.read_text()):
        # a converted pretrained model (compose's models volume after SF_MODEL changed):
        # the built-in build writes over a directory, and would keep the other's extra
        # files (its generation config, its chat template)
        shutil.rmtree(out)
    build = build_base_model if force else ensure_base_model
    config = sized_config(task, size)
    if sft_steps is not None:
        config = dataclasses.replace(config, sft_steps=sft_steps)
    path = build(out, seed=seed, task=task, config=config)
    typer.echo(str(path))


@app.command()
def bench(
    steps: Annotated[int, typer.Option(help="Optimizer steps to measure.")] = 20,
    runs_dir: Annotated[Path, typer.Option(help="Where the bench runs are written.")] = Path(
        "runs"
    ),
    modes: Annotated[
        str, typer.Option(help="Comma-separated deployments to run one after the other.")
    ] = "disaggregated",
    max_tokens: Annotated[
        int | None, typer.Option(help="Completion budget per call (default: the task's).")
    ] = None,
    pin_slots: Annotated[
        bool, typer.Option(help="Pin engines and the trainer to their slot's core.")
    ] = False,
    task: Annotated[str, typer.Option(help="Task source (e.g. arithmetic, lookup).")] = (
        "arithmetic"
    ),
    agent: Annotated[str, typer.Option(help="Agent name or dotted path.")] = "single_turn",
    model_dir: Annotated[
        Path | None,
        typer.Option(help="Base model directory, used as is (default: the built-in model)."),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Also write the figures, the ratios and the machine as JSON here "
            "(checked against a baseline by loadtests/regression.py)."
        ),
    ] = None,
) -> None:
    """Run the built-in task for a fixed number of steps in each mode; print figures and,
    for several modes, each one's throughput relative to the first (same run)."""
    from seamlessflow.machine import machine_description
    from sf_app.run.config import RunConfig
    from sf_app.run.embedded import run_embedded

    mode_names = [m.strip() for m in modes.split(",") if m.strip()]
    machine = machine_description()  # before the runs: the load average at the start
    results: list[dict[str, Any]] = []
    for mode in mode_names:
        config = RunConfig(
            steps=steps,
            runs_dir=runs_dir,
            model_dir=model_dir,
            run_id="",
            live=False,
            mode=mode,  # type: ignore[arg-type]
            pin_slots=pin_slots,
            task=task,
            agent=agent,
            **({"max_tokens": max_tokens} if max_tokens is not None else {}),  # type: ignore[arg-type]
        )
        summary = run_embedded(config)
        results.append(
            {
                "mode": mode,
                "run_id": summary.run_id,
                "steps": summary.steps,
                "status": summary.status,
                "steady_generated_tokens_per_s": round(summary.steady_generated_tokens_per_s, 1),
                "steady_seconds_per_step": round(summary.steady_seconds_per_step, 3),
                "generated_tokens_per_s": round(summary.generated_tokens_per_s, 1),
                "trained_tokens_per_s": round(summary.trained_tokens_per_s, 1),
                "bubble_ratio": summary.bubble_ratio,
                "mean_train_step_s": round(summary.mean_step_s, 3),
                "mean_trainer_wait_for_batch_s": round(summary.mean_wait_s, 3),
                "mean_weight_publish_s": round(summary.mean_publish_s, 3),
                "layout": summary.mode_choice.get("layout", mode),
                "lending_switches": summary.lending_switches,
                "lends": summary.lends,
                "reclaims": summary.reclaims,
                "requests_handed_back": summary.requests_handed_back,
                "wall_s": summary.wall_s,
            }
        )
    # Steps/s is the ratio to compare: tokens per step vary with what the policy learned.
    baseline = results[0]["steady_seconds_per_step"] if results else 0
    ratio_name = f"steps_per_s_vs_{results[0]['mode']}" if results else ""
    for figures in results:
        per_step = figures["steady_seconds_per_step"]
        figures[ratio_name] = round(baseline / per_step, 3) if per_step else 0.0
    typer.echo(json.dumps(results[0] if len(results) == 1 else results, indent=2))
    if out is not None:
        report = {
            "machine": machine,
            "settings": {
                "steps": steps,
                "modes": mode_names,
                "task": task,
                "agent": agent,
                "pin_slots": pin_slots,
                "max_tokens": max_tokens,
                "model_dir": str(model_dir) if model_dir else None,
            },
            "modes": results,
            # Above 1: the mode makes more steps/s than the first one on this machine.
            "ratios": {f"{r['mode']}_{ratio_name}": r[ratio_name] for r in results[1:]},
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        typer.echo(f"wrote {out}", err=True)


@app.command()
def simulate(
    gpus: Annotated[str, typer.Option(help="Cluster sizes, comma-separated.")] = "8,64,512,1024",
    steps: Annotated[int, typer.Option(help="Optimizer steps per simulated run.")] = 20,
    task: Annotated[str, typer.Option(help="Workload: single-turn or agentic.")] = "single-turn",
    from_run: Annotated[
        Path | None,
        typer.Option(help="Calibrate rates from a run directory (runs/<id>/summary.json)."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed (same seed, same figures).")] = 0,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Also write every figure to this file.")
    ] = None,
    train_fractions: Annotated[
        str, typer.Option(help="Training-slot shares tried for the two split deployments.")
    ] = "0.25,0.5,0.75",
    max_staleness: Annotated[
        int, typer.Option(help="Drop samples more than this many versions old (-1: never).")
    ] = 4,
    rebalance_on_lend: Annotated[
        bool,
        typer.Option(
            help="Move in-flight requests onto a freshly lent engine, as the tag-scheduler "
            "does (--no-rebalance-on-lend: the comparison without it)."
        ),
    ] = True,
    max_batches_ahead: Annotated[
        int,
        typer.Option(help="Rollout lead over training of the two asynchronous deployments."),
    ] = 1,
    lend_shares: Annotated[
        str,
        typer.Option(
            help="Shares of the lendable engines a block of waits may lend, comma-separated "
            "(must include 1; e.g. 0.5,1: half or all)."
        ),
    ] = "1",
    reclaim_early_at: Annotated[
        float,
        typer.Option(
            help="Take lent engines back once this share of the next batch's groups is "
            "ready (1: at the trainer's claim)."
        ),
    ] = 1.0,
    overlap_weight_sync: Annotated[
        bool,
        typer.Option(
            help="Engines decode while new weights arrive and pause only for the swap, as "
            "the engine worker does (--no-overlap-weight-sync: pause for the whole sync)."
        ),
    ] = True,
) -> None:
    """Simulate colocated, disaggregated, multiplexed and auto on 8-1024 GPUs with
    the production scheduling policy on virtual time; print throughput, bubble ratio and
    speedup over colocated. Durations are modeled (or calibrated with --from-run)."""
    from sf_app.simulator import (
        TABLE_HEADER,
        WORKLOADS,
        SimConfig,
        calibrate_from_run,
        compare,
        format_row,
        rows_as_json,
    )

    if task not in WORKLOADS:
        raise typer.BadParameter(f"--task must be one of: {', '.join(WORKLOADS)}")
    try:
        sizes = [int(g) for g in gpus.split(",") if g.strip()]
        fractions = [float(f) for f in train_fractions.split(",") if f.strip()]
        shares = tuple(float(f) for f in lend_shares.split(",") if f.strip())
    except ValueError as exc:
        raise typer.BadParameter(f"expected comma-separated numbers: {exc}") from None
    if not sizes or min(sizes) < 2 or not fractions or not all(0 < f < 1 for f in fractions):
        raise typer.BadParameter("need --gpus >= 2 and --train-fractions in (0, 1)")
    if max_batches_ahead < 1:
        raise typer.BadParameter("--max-batches-ahead must be >= 1 (0: colocated, synchronous)")
    if not shares or 1.0 not in shares or not all(0 < f <= 1 for f in shares):
        raise typer.BadParameter("--lend-shares must be in (0, 1] and include 1")
    if not 0 < reclaim_early_at <= 1:
        raise typer.BadParameter("--reclaim-early-at must be in (0, 1]")
    base = SimConfig(
        steps=steps,
        seed=seed,
        workload=WORKLOADS[task],
        max_staleness=None if max_staleness < 0 else max_staleness,
        rebalance_on_lend=rebalance_on_lend,
        lend_shares=shares,
        reclaim_early_at=reclaim_early_at,
        overlap_weight_sync=overlap_weight_sync,
    )
    if from_run is not None:
        calibration = calibrate_from_run(from_run, base)
        base = calibration.config
        for note in calibration.notes:
            typer.echo(f"# {note}")
    engine, trainer, switch = base.engine, base.trainer, base.switch
    typer.echo(
        f"# {task}, {steps} steps, seed {seed}; modeled: {base.workload.samples_per_gpu} "
        f"samples/GPU/step, decode {engine.decode_tokens_per_s_alone:g}-"
        f"{engine.decode_tokens_per_s_full:g} tok/s/engine, train "
        f"{trainer.train_tokens_per_s_per_gpu:g} tok/s/GPU, sync {trainer.sync_s:.2f}s, "
        f"lend-in {switch.lend_in_s:g}s, reclaim {switch.reclaim_s:g}s"
    )
    typer.echo(
        "# disaggregated, multiplexed and auto: best training share of "
        f"{', '.join(f'{f:g}' for f in fractions)} (by trained tokens/s), "
        f"{max_batches_ahead} batch(es) ahead"
        + ("" if rebalance_on_lend else "; without rebalance on lend")
        + ("" if shares == (1.0,) else f"; lend shares {lend_shares}")
        + ("" if reclaim_early_at == 1 else f"; reclaim early at {reclaim_early_at:g}")
        + ("" if overlap_weight_sync else "; engines pause for the whole weight sync")
    )
    typer.echo(TABLE_HEADER)
    rows = []
    for size in sizes:  # one cluster size at a time: large ones take a while
        for row in compare([size], base, fractions, max_batches_ahead):
            typer.echo(format_row(row))
            rows.append(row)
    if json_out is not None:
        report = rows_as_json(rows, base)
        report["command"] = {"gpus": sizes, "task": task, "from_run": str(from_run or "")}
        json_out.write_text(json.dumps(report, indent=2) + "\n")
        typer.echo(f"wrote {json_out}")


def configuration_reference() -> str:
    """Markdown reference of every environment variable, from the settings classes."""
    from seamlessflow.plugins import ChosenFrom
    from seamlessflow.runfile import RunShared, section_of, shared_fields, shared_variable
    from sf_app.plugin_reference import chosen_from, plugins_section, registered_names

    users: dict[str, list[str]] = {key: [] for key in RunShared.model_fields}
    for cls in settings_classes():
        section = section_of(str(cls.model_config.get("env_prefix", "")))
        for field, key in shared_fields(cls).items():
            users[key].append(f"{section}.{field}")
    lines = [
        "# Configuration reference",
        "",
        "Generated by `seamlessflow config` from the settings classes. Every process reads",
        "its settings from environment variables, then from the run file `SF_CONFIG` names",
        "(a TOML file, `seamlessflow.runfile`: each class below reads the section named",
        "under its heading, its fields without the prefix, and the `[run]` keys that are",
        "its shared fields), then the defaults below. A `.env` file is not read. Examples:",
        "`examples/run_files/`. `seamlessflow resolve` writes a run's resolved file (every",
        "section, the shared values copied in), which `seamlessflow up` writes into its",
        "run directory as `run.toml` and compose into its run volume.",
        "",
        "The run's shared section: `[run]` in a run file, one variable each, one default",
        "(`seamlessflow.runfile.RunShared`), copied into every field that uses it:",
        "",
        "| `[run]` key | variable | default | used as |",
        "|---|---|---|---|",
        *(
            f"| `{key}` | `{shared_variable(key)}` | `{info.default!s}` | "
            f"{', '.join(f'`{use}`' for use in users[key])} |"
            for key, info in RunShared.model_fields.items()
        ),
    ]
    chosen: list[tuple[str, ChosenFrom]] = []  # (variable, the registry it names plug-ins of)
    for owner, path in SETTINGS.items():
        module_name, _, attr = path.partition(":")
        settings_class = getattr(importlib.import_module(module_name), attr)
        prefix = settings_class.model_config.get("env_prefix", "")
        section = section_of(prefix)
        lines += ["", f"## {owner} (`{attr}`, run file `[{section}]`)", "",
                  "| variable | default | meaning |", "|---|---|---|"]  # fmt: skip
        for name, info in settings_class.model_fields.items():
            alias = info.validation_alias
            if alias is not None:
                env = " / ".join(str(choice) for choice in alias.choices)
            else:
                env = f"{prefix}{name}".upper()
            default = info.get_default(call_default_factory=True)
            description = " ".join((info.description or "").split()).replace("|", "\\|")
            marker = chosen_from(info)
            if marker is not None:
                chosen.append((env, marker))
                description += " " + registered_names(marker)
            lines.append(f"| `{env}` | `{default!s}` | {description} |")
    lines += plugins_section(chosen)
    lines += ["", "## Command-line options read from the environment", "",
              "| variable | option | meaning |", "|---|---|---|"]  # fmt: skip
    group = typer.main.get_command(app)
    for command_name, command in sorted(getattr(group, "commands", {}).items()):
        for param in command.params:
            for env in [param.envvar] if isinstance(param.envvar, str) else param.envvar or ():
                option = f"seamlessflow {command_name} {param.opts[0]}"
                description = " ".join((getattr(param, "help", "") or "").split())
                lines.append(
                    f"| `{env}` | `{option}` | {description.replace('|', chr(92) + '|')} |"
                )
    return "\n".join(lines) + "\n"


@app.command()
def config() -> None:
    """Print the configuration reference (every environment variable of every service)."""
    typer.echo(configuration_reference(), nl=False)


@app.command()
def doctor(
    measure: Annotated[
        bool, typer.Option(help="Also time one matmul in float32 and under bf16 autocast.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object instead.")] = False,
) -> None:
    """Print this machine's capabilities (CPU kind, bf16, cores, GPUs, Docker, a compose
    CLI) and the defaults a run would choose on it."""
    from seamlessflow.machine import capabilities, engine_dtype, matmul_seconds, resolve_precision

    facts = capabilities()
    devices = ["cpu"] + (["cuda"] if facts["gpus"] else [])
    chosen = {}
    for device in devices:
        precision = resolve_precision("auto", device)
        chosen[device] = {
            "precision": precision.chosen,
            "why": precision.reason,
            "engine_dtype": engine_dtype("auto", device),
            "weights_dtype": "bfloat16" if precision.chosen == "bf16-mixed" else "float32",
        }
    report: dict[str, Any] = {"machine": facts, "defaults": chosen}
    if measure:
        fp32, bf16 = matmul_seconds("float32"), matmul_seconds("bfloat16")
        report["matmul_512x576x1536_one_thread_ms"] = {
            "float32": round(fp32 * 1e3, 2),
            "bf16_autocast": round(bf16 * 1e3, 2),
            "bf16_over_float32": round(bf16 / fp32, 2),
        }
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    gpus = ", ".join(
        f"{gpu['name']} ({gpu['memory_gib']} GiB, bf16 {gpu['bf16']})" for gpu in facts["gpus"]
    )
    docker = "no CLI"
    if facts["docker_cli"]:
        docker = "daemon answers" if facts["docker_daemon"] else "CLI only, no daemon answers"
        if not facts["docker_daemon"] and facts["dockerd_installed"]:
            docker += " (dockerd installed, not running)"
    lines = [
        f"cpu:        {facts['cpu']}, torch kernels {facts['cpu_isa']}, "
        f"bf16 {'native' if facts['cpu_bf16'] else 'not native'}, {facts['cores']} cores",
        f"gpu:        {gpus or 'none'}",
        f"docker:     {docker}",
        f"compose:    {facts['compose_cli'] or 'none'}",
        f"torch:      {facts['torch']}",
    ]
    for device, picked in chosen.items():
        lines.append(
            f"on {device + ':':<7} precision {picked['precision']}, engine "
            f"{picked['engine_dtype']}, weights travel as {picked['weights_dtype']} "
            f"({picked['why']})"
        )
    if measure:
        figures = report["matmul_512x576x1536_one_thread_ms"]
        lines.append(
            f"matmul:     float32 {figures['float32']} ms, bf16 autocast "
            f"{figures['bf16_autocast']} ms ({figures['bf16_over_float32']}x), one thread"
        )
    typer.echo("\n".join(lines))


def main() -> None:
    app()
