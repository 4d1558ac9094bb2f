"""Cost of one partial-rollout interruption: pause -> load -> resume, per engine mode.

For each mode the engine decodes a full batch of long requests; once every request has
produced some tokens, a new weight version is loaded:

- ``keep``: pause at a token boundary, swap the weights under the frozen batch, resume;
  nothing is recomputed.
- ``abort``: in-flight requests end with their partial tokens and are re-submitted as
  prompt + partial ids (what the gateway does); the engine re-prefills those tokens.
- ``wait``: no interruption: the load waits for the batch to finish (the baseline a
  framework without partial rollout pays: the update is delayed by the longest request).

Prints and writes (``--out``) JSON: the pause -> resume time, tokens recomputed, the
delay between "new version available" and "serving it", and the batch's total time.

    .venv/bin/python loadtests/interruption.py [--batch 16] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from pathlib import Path

import torch

from sf_app.base_model import ensure_base_model
from sf_engine.backends import GenerationResult, SamplingParams, TransformersEngine


async def run_mode(model_dir: Path, mode: str, batch: int, max_tokens: int) -> dict[str, float]:
    engine = TransformersEngine(model_dir, max_batch_size=batch, max_context=512)
    await engine.start()
    new_weights = {k: v.clone() for k, v in engine._model.state_dict().items()}  # type: ignore[union-attr]
    params = SamplingParams(max_tokens=max_tokens, seed=1, stop_token_ids=())
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11, 12] for i in range(batch)]
    started = time.perf_counter()
    streams = [engine.stream(f"r{i}", p, params) for i, p in enumerate(prompts)]
    while min(len(s.tokens) for s in streams) < max_tokens // 3:  # noqa: ASYNC110
        await asyncio.sleep(0.001)
    requested = time.perf_counter()
    if mode == "wait":
        await engine.load_weights(new_weights, 1)
        paused = resumed = time.perf_counter()
    else:
        await engine.pause(mode)  # type: ignore[arg-type]
        paused = time.perf_counter()
        await engine.load_weights(new_weights, 1)
        await engine.resume()
        resumed = time.perf_counter()
    serving_new = resumed
    results: list[GenerationResult] = [await s.result() for s in streams]
    recomputed = 0
    if mode == "abort":  # the gateway's transparent resume: prompt + partial ids
        resubmitted = []
        for i, result in enumerate(results):
            remaining = max_tokens - len(result.token_ids)
            if result.finish_reason == "abort" and remaining > 0:
                ids = prompts[i] + result.token_ids
                recomputed += len(ids)
                resubmitted.append(
                    engine.stream(
                        f"r{i}-resume",
                        ids,
                        SamplingParams(max_tokens=remaining, seed=2, stop_token_ids=()),
                    )
                )
        for stream in resubmitted:
            await stream.result()
    finished = time.perf_counter()
    await engine.close()
    return {
        "pause_to_resume_ms": round((resumed - requested) * 1000, 2),
        "pause_ms": round((paused - requested) * 1000, 2),
        "new_version_serving_after_ms": round((serving_new - requested) * 1000, 2),
        "tokens_recomputed": recomputed,
        "batch_total_ms": round((finished - started) * 1000, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("runs/bench/interruption.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    cache = Path(os.environ.get("SF_CACHE_DIR", "~/.cache/seamlessflow")).expanduser()
    model_dir = args.model_dir or ensure_base_model(cache / "models" / "base-arithmetic")
    figures = {
        mode: asyncio.run(run_mode(model_dir, mode, args.batch, args.max_tokens))
        for mode in ("keep", "abort", "wait")
    }
    report = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "modes": figures,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
