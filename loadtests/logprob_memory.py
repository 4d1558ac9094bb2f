"""Memory and time of one trainer step at a real vocabulary: logprobs from whole logits
versus chunk by chunk (``SF_TRAINER_LOGPROB_CHUNK_TOKENS``).

The model is a tiny Qwen2 backbone (2 layers, hidden 64) with Qwen2.5/Qwen3's
vocabulary of 151,936 and untied embeddings, so the head's [tokens, vocab] tensors
dominate everything else, as they do for a real model at a long micro-batch. Each
configuration (micro-batch tokens x chunk) runs in its own process: one
``train_step`` on one micro-batch of samples of 1024 tokens (a third prompt), float32,
one torch thread. Per configuration: the process's peak RSS growth during the step
(``ru_maxrss`` after the step minus before it: the model, AdamW's state and the batch
are built before) and the step's wall time.

A whole-logits step keeps several tokens x vocab float32 tensors (about 0.6 GB each per
1k tokens), so the default configurations run it only up to 4k tokens; each process
is capped (``--max-gb`` of address space) so that a configuration too big for the
machine fails alone instead of starving others.

    .venv/bin/python loadtests/logprob_memory.py [--configs 4096:0,4096:1024,16384:1024]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

VOCAB = 151_936
SAMPLE_TOKENS = 1024
DEFAULT_CONFIGS = "2048:0,4096:0,4096:256,4096:1024,4096:4096,8192:1024,16384:256,16384:1024"


def one(tokens: int, chunk: int, threads: int) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from seamlessflow.protocol import SampleGroup, TrainBatch, TrainSample
    from sf_trainer.settings import TrainerSettings
    from sf_trainer.step import train_step

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SAMPLE_TOKENS,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    rng = random.Random(0)
    prompt = SAMPLE_TOKENS // 3
    samples = [
        TrainSample(
            session_id=f"s{i}",
            token_ids=[rng.randrange(VOCAB) for _ in range(SAMPLE_TOKENS)],
            loss_mask=[0] * prompt + [1] * (SAMPLE_TOKENS - prompt),
            behaviour_logprobs=[0.0] * prompt
            + [-rng.uniform(8.0, 16.0) for _ in range(SAMPLE_TOKENS - prompt)],
            versions=[0] * SAMPLE_TOKENS,
            reward=float(i % 2),
        )
        for i in range(tokens // SAMPLE_TOKENS)
    ]
    group = SampleGroup(group_id="g", task_id="t", samples=samples)
    batch = TrainBatch(batch_index=0, groups=[group])
    settings = TrainerSettings(micro_batch_tokens=tokens, logprob_chunk_tokens=chunk)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    result = train_step(model, optimizer, batch, settings, current_version=0)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "tokens": tokens,
        "chunk": chunk,
        "step_s": round(seconds, 2),
        "peak_rss_growth_gb": round((after - before) / 2**20, 3),  # ru_maxrss is in KiB
        "peak_rss_gb": round(after / 2**20, 3),
        "loss": result.loss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="tokens:chunk,... (0 = whole)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-gb", type=float, default=14.0)
    parser.add_argument("--out", default="runs/load/logprob_memory.json")
    parser.add_argument("--one", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        limit = int(args.max_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        tokens, chunk = args.one
        print(json.dumps(one(tokens, chunk, threads=args.threads)))
        return
    rows = []
    for config in args.configs.split(","):
        tokens, chunk = (int(part) for part in config.split(":"))
        command = [sys.executable, __file__, "--one", str(tokens), str(chunk)]
        command += ["--threads", str(args.threads), "--max-gb", str(args.max_gb)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["?"])[-1]
            row = {"tokens": tokens, "chunk": chunk, "error": last[:200]}
        else:
            row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"vocab": VOCAB, "threads": args.threads, "rows": rows}, indent=2))
    print(f"{'tokens':>7} {'chunk':>6} {'step s':>7} {'peak RSS +GB':>13}")
    for row in rows:
        if "error" in row:
            print(f"{row['tokens']:>7} {row['chunk']:>6}  failed: {row['error']}")
        else:
            print(f"{row['tokens']:>7} {row['chunk'] or 'whole':>6} {row['step_s']:>7} "
                  f"{row['peak_rss_growth_gb']:>13}")  # fmt: skip


if __name__ == "__main__":
    main()
