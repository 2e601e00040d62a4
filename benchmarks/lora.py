"""Mixed traffic over four LoRA adapters against one base model without adapters (issue
46's benchmark: at least 0.8x), side by side on one server in one run.

The server serves MiniLM three times: `plain` on torch with no adapter (the adapters'
model runs on torch, so this is the like-for-like baseline), `lora` on torch with four
random rank-8 adapters on its query and value projections (`--adapter l0..l3`), and
`default` on the backend the server picks (OpenVINO on a CPU), for reference. Each phase
sends the same requests from the same concurrent callers for a fixed time; the phases
alternate over --rounds, and each figure is its phases' median:

- plain: every call to `plain`;
- mixed adapters: each call to one of l0..l3 by name, in turn, so that every batch step
  finds all four queued (a batch mixes them, each row through its own);
- one adapter: every call to l0 (the side path alone);
- default backend: every call to `default`.

    python -m benchmarks.lora --rounds 3 --seconds 15 --concurrency 16 --batch 8
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from itertools import cycle
from pathlib import Path

from benchmarks.model_loading import serve, stop
from benchmarks.workload import _default_model_path, sentences
from pooling_client import AsyncPoolingClient

ADAPTERS = ("l0", "l1", "l2", "l3")


def build_adapters(root: Path, base: Path) -> dict[str, Path]:
    """Four random rank-8 LoRA adapters of MiniLM (both matrices random, so none is a
    no-op), made with PEFT and saved with save_pretrained."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import BertModel

    found = {}
    for seed, name in enumerate(ADAPTERS):
        torch.manual_seed(seed)
        config = LoraConfig(
            r=8, lora_alpha=16, target_modules=["query", "value"], init_lora_weights=False
        )
        get_peft_model(BertModel.from_pretrained(base), config).save_pretrained(root / name)
        found[name] = root / name
    return found


async def phase(address: str, models: list[str], args: argparse.Namespace) -> float:
    """Texts a second over `args.seconds` from `args.concurrency` callers, each sending
    requests of `args.batch` texts to the next model of `models` in turn."""
    texts = sentences(args.batch * 64, seed=1)
    chunks = [texts[k : k + args.batch] for k in range(0, len(texts), args.batch)]
    names = cycle(models)
    done = 0
    async with AsyncPoolingClient(address, timeout=600) as client:
        await client.embed(chunks[0], model=models[0])  # the channel up, not timed
        stop_at = time.perf_counter() + args.seconds

        async def caller(k: int) -> None:
            nonlocal done
            turn = k
            while time.perf_counter() < stop_at:
                await client.embed(chunks[turn % len(chunks)], model=next(names))
                done += args.batch
                turn += args.concurrency

        started = time.perf_counter()
        await asyncio.gather(*(caller(k) for k in range(args.concurrency)))
        return done / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8, help="texts per request")
    parser.add_argument("--frontends", default="1", help="the server's --frontends")
    args = parser.parse_args()
    base = _default_model_path()
    work = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    adapters = build_adapters(work, base)
    flags = ["--dtype", "float32", "--frontends", args.frontends]
    flags += ["--model", f"plain={base}", "--backend", "torch"]
    flags += ["--model", f"lora={base}", "--backend", "torch"]
    for name, folder in adapters.items():
        flags += ["--adapter", f"{name}={folder}"]
    flags += ["--model", f"default={base}", "--backend", "auto"]
    process, address, _ = serve(flags, work / "server.log")
    phases = {
        "plain (torch, no adapters)": ["plain"],
        "mixed adapters l0..l3 (torch)": list(ADAPTERS),
        "one adapter l0 (torch)": ["l0"],
        "default backend (no adapters)": ["default"],
    }
    found: dict[str, list[float]] = {name: [] for name in phases}
    try:
        asyncio.run(phase(address, ["plain"], argparse.Namespace(**{**vars(args), "seconds": 3})))
        for _ in range(args.rounds):
            for name, models in phases.items():
                found[name].append(asyncio.run(phase(address, models, args)))
    finally:
        stop(process)
    plain = statistics.median(found["plain (torch, no adapters)"])
    print(
        f"MiniLM, {args.concurrency} callers x {args.batch} texts a request, "
        f"{args.seconds:.0f} s a phase, median of {args.rounds} alternating rounds "
        f"(--frontends {args.frontends})"
    )
    print(f"{'traffic':34} {'texts/s':>9} {'vs plain':>9}   rounds")
    for name, values in found.items():
        median = statistics.median(values)
        rounds = ", ".join(f"{v:.0f}" for v in values)
        print(f"{name:34} {median:9.0f} {median / plain:8.2f}x   {rounds}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
