"""benchmarks/multi_vector.py in a quick mode: the MultiVectorEncoder it builds from MiniLM
loads in the server as a multi-vector model whose Rerank scores are MultiVectorEncoder's
MaxSim (the run raises otherwise), and its paragraphs are deterministic and of the length
it promises. The timings are only read, never judged."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import multi_vector


def test_paragraphs_are_deterministic_prose_of_about_100_to_200_tokens() -> None:
    texts = multi_vector.paragraphs(30, seed=1)
    assert texts == multi_vector.paragraphs(30, seed=1)
    assert texts != multi_vector.paragraphs(30, seed=2)
    assert len(set(texts)) == 30
    from transformers import AutoTokenizer

    from benchmarks.workload import _default_model_path

    tokenizer = AutoTokenizer.from_pretrained(str(_default_model_path()))
    lengths = [len(tokenizer(text)["input_ids"]) for text in texts]
    assert min(lengths) >= 90 and max(lengths) <= 210, lengths


def test_a_quick_run_serves_the_built_model_as_multi_vector(tmp_path: Path) -> None:
    args = argparse.Namespace(
        rounds=1, warmup=0, documents=6, folder=str(tmp_path), server_arg=[], output=None
    )
    result = multi_vector.run(args)
    assert result["documents"] == 6 and result["rounds"] == 1
    assert result["max_score_difference"] < 1e-2
    assert result["in_process_ms"]["median"] > 0 and result["server_ms"]["median"] > 0
    assert "server / in-process" in multi_vector.format_result(result)
    json.dumps(result)  # --output writes it as JSON
    config = json.loads((tmp_path / "model" / "config_sentence_transformers.json").read_text())
    assert config["model_type"] == "MultiVectorEncoder"
    assert config["prompts"] == multi_vector.MARKERS
