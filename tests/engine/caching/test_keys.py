"""The result cache's key (engine/caching/key.py): each field docs/cache.md names changes
it, what applies after the look-up does not, and entries read back checked."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from pooling_server.engine.caching.entries import pack, unpack
from pooling_server.engine.caching.key import (
    folder_digest,
    item_key,
    model_identity,
    request_tag,
    scope_of,
)
from pooling_server.engine.caching.memory import ENTRY_OVERHEAD, MemoryTier
from pooling_server.engine.families.llm_reranker.score_template import ScoreTemplate
from pooling_server.engine.inputs.modality import Frame
from pooling_server.engine.inputs.tokenization import TokenSequence
from pooling_server.engine.models.model_info import LongInput, PoolingType
from pooling_server.engine.requests.params import Output, OutputEncoding, PoolingParams, Task
from pooling_server.engine.requests.request import ChunkRule, LateChunking, PoolRequest
from pooling_server.engine.requests.resolved import resolve
from tests.model_infos import embedder_info

INFO = embedder_info(prompts={"query": "query: "})


def _tag(scope: str = "", **fields: object) -> bytes:
    request = PoolRequest(task=Task.EMBED, texts=("a text",), **fields)  # type: ignore[arg-type]
    return request_tag(resolve(request, INFO), scope)


def test_each_request_field_changes_the_tag() -> None:
    base = _tag()
    assert _tag() == base  # the same request, the same tag
    variants = {
        "task": request_tag(resolve(PoolRequest(task=Task.TOKEN_EMBED, texts=("a",)), INFO)),
        "adapter": _tag(adapter="lora-a"),
        "prompt": _tag(prompt="search: "),
        "prompt_name": _tag(prompt_name="query"),
        "truncate_prompt_tokens": _tag(params=PoolingParams(truncate_prompt_tokens=8)),
        "truncation_side": _tag(truncation_side="left"),
        "max_tokens": _tag(max_tokens=64),
        "late_chunking": _tag(late_chunking=LateChunking(rule=ChunkRule.SENTENCES)),
        "outputs": _tag(outputs=frozenset({Output.DENSE})),
        "scope": _tag(scope=scope_of("key-a")),
    }
    tags = [base, *variants.values()]
    assert len(set(tags)) == len(tags), "two fields hashed alike"
    assert scope_of("key-a") != scope_of("key-b") and "key-a" not in scope_of("key-a")


def test_the_long_input_policy_changes_the_tag() -> None:
    request = PoolRequest(task=Task.EMBED, texts=("a",))
    chunked = resolve(request, dataclasses.replace(INFO, long_input=LongInput.CHUNK))
    assert request_tag(chunked) != request_tag(resolve(request, INFO))


def test_what_applies_after_the_lookup_shares_the_tag() -> None:
    """dimensions, normalisation (use_activation) and encodings share one entry."""
    base = _tag()
    assert _tag(params=PoolingParams(dimensions=16, use_activation=False)) == base
    assert _tag(encoding=OutputEncoding.INT8) == base
    assert _tag(sparse_top_k=4, sparse_tokens=True) == base


def _sequence(ids: list[int], types: list[int] | None = None) -> TokenSequence:
    return TokenSequence(ids, types, [], [])


def test_each_item_field_changes_the_key() -> None:
    model, tag = b"m" * 20, b"t" * 20
    base = item_key(model, tag, _sequence([101, 7, 102]), False)
    # Token ids as lists (a front end) or int32 arrays (an engine process) key alike.
    ids = np.array([101, 7, 102], dtype=np.int32)
    assert item_key(model, tag, _sequence(ids), False) == base  # type: ignore[arg-type]
    variants = [
        item_key(b"n" * 20, tag, _sequence([101, 7, 102]), False),  # model
        item_key(model, b"u" * 20, _sequence([101, 7, 102]), False),  # request tag
        item_key(model, tag, _sequence([101, 8, 102]), False),  # content
        item_key(model, tag, _sequence([101, 7, 102], [0, 0, 0]), False),  # token types
        item_key(model, tag, _sequence([101, 7, 102]), True),  # every token's row
        item_key(model, tag, _sequence([101, 7, 102]), (0, 2)),  # late chunking's ranges
    ]
    assert len({base, *variants}) == 1 + len(variants)


def test_two_images_of_one_size_do_not_collide() -> None:
    rng = np.random.default_rng(0)
    first = rng.random((3, 32, 32), dtype=np.float32)
    second = first.copy()
    second[0, 5, 5] += 0.25  # one pixel apart
    model, tag = b"m" * 20, b"t" * 20
    a = item_key(model, tag, Frame(first, 16), False)
    assert a == item_key(model, tag, Frame(first.copy(), 16), False)
    assert a != item_key(model, tag, Frame(second, 16), False)
    assert a != item_key(model, tag, Frame(first.reshape(3, 16, 64), 16), False)


def _template(true_token: str) -> ScoreTemplate:
    return ScoreTemplate("Q: ", "{query} D: {document}", "?", true_token, "no", 1, 2, "", "test")


def test_model_identity_fields_and_a_new_revision(tmp_path: os.PathLike[str]) -> None:
    folder = os.path.join(tmp_path, "model")
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        f.write('{"hidden_size": 32}')
    with open(os.path.join(folder, "model.safetensors"), "wb") as f:
        f.write(b"\0" * 64)
    base = model_identity(INFO, folder)
    assert model_identity(INFO, folder) == base
    changes: list[dict[str, object]] = [
        {"name": "other"},
        {"backend": "onnx"},
        {"backend_file": "model_int8.onnx"},
        {"precision": "int8"},  # quantization
        {"dtype": "float16"},
        {"family": "cross_encoder"},
        {"architecture": "RobertaModel"},
        {"pooling_type": PoolingType.CLS},
        {"projected": True},
        {"max_input_tokens": 64},
        {"include_prompt": False},
        {"settings": _template("yes")},  # a reranker's score template
    ]
    templated = dataclasses.replace(INFO, settings=_template("yes"))
    assert model_identity(templated, folder) != model_identity(
        dataclasses.replace(INFO, settings=_template("true")), folder
    )
    variants = [model_identity(dataclasses.replace(INFO, **c), folder) for c in changes]  # type: ignore[arg-type]
    assert len({base, *variants}) == 1 + len(variants)
    digest = folder_digest(folder)
    with open(os.path.join(folder, "model.safetensors"), "r+b") as f:
        f.write(b"\1")  # new weights, same size: a new revision
    os.utime(os.path.join(folder, "model.safetensors"), ns=(1, 1))
    assert folder_digest(folder) != digest
    assert model_identity(INFO, folder) != base


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_entries_read_back_checked(dtype: type) -> None:
    key = b"k" * 20
    values = np.arange(12, dtype=dtype).reshape(3, 4)
    data = pack(key, values)
    got = unpack(key, data)
    assert got is not None and got.dtype == values.dtype
    np.testing.assert_array_equal(got, values)
    assert not got.flags.writeable
    flipped = bytearray(data)
    flipped[20] ^= 1
    assert unpack(key, bytes(flipped)) is None  # corrupt
    assert unpack(key, data[:-5]) is None  # truncated
    assert unpack(key, data[: len(data) // 2]) is None
    assert unpack(b"j" * 20, data) is None  # stored under another key
    assert unpack(key, b"garbage") is None and unpack(key, None) is None


def test_memory_tier_evicts_least_recently_used_within_its_budget() -> None:
    vector = np.zeros(100, dtype=np.float32)  # 400 bytes
    size = vector.nbytes + ENTRY_OVERHEAD
    tier = MemoryTier(3 * size)
    for key in (b"a", b"b", b"c"):
        tier.put(key, vector)
    assert tier.get(b"a") is not None  # a is now the most recent
    tier.put(b"d", vector)
    assert tier.get(b"b") is None and tier.get(b"a") is not None
    assert tier.evictions == 1 and tier.bytes == 3 * size and len(tier) == 3
    tier.put(b"huge", np.zeros(10_000, dtype=np.float32))  # over the whole budget: not kept
    assert tier.get(b"huge") is None and len(tier) == 3


def test_an_adapters_folder_is_in_the_key(tmp_path: os.PathLike[str]) -> None:
    """Two adapters, and one adapter's weights changed under its name: three keys."""
    from types import SimpleNamespace

    from pooling_server.engine.caching.cache import CacheSettings, ResultCache
    from pooling_server.engine.caching.flights import ModelCache

    folders = {}
    for name in ("a", "b"):
        folders[name] = os.path.join(tmp_path, name)
        os.makedirs(folders[name])
        with open(os.path.join(folders[name], "adapter_model.safetensors"), "wb") as f:
            f.write(name.encode() * 32)
    runner = SimpleNamespace(adapters=SimpleNamespace(paths=folders))  # where LoRA keeps them
    cache = ModelCache(ResultCache(CacheSettings(memory_mb=1)), b"m" * 20, runner)
    work = [(_sequence([101, 7, 102]), False)]

    def key(adapter: str | None) -> bytes:
        return cache.keys(SimpleNamespace(cache=b"t" * 20, adapter=adapter, work=work))[0]

    base, a, b = key(None), key("a"), key("b")
    assert len({base, a, b}) == 3 and key("a") == a
    weights = os.path.join(folders["a"], "adapter_model.safetensors")
    with open(weights, "wb") as f:
        f.write(b"c" * 32)  # reloaded under its name with other weights
    os.utime(weights, ns=(2, 2))
    assert key("a") not in {base, a, b}
