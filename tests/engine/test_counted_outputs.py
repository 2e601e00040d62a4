"""Outputs whose size follows from tokens or chunks, estimated before the work: late
chunks (spans, sentences, token windows), ColBERT matrices (embed_multi) and bge-m3's three
outputs (embed_outputs). Each estimate is at least the answer's real size, and a request
over the budget is refused before the forward pass (no forward call is made) and, where the
texts alone show it, before tokenizing (no tokenizer call is made)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest

from pooling_server.engine.errors import PoolingError
from pooling_server.engine.inputs.tokenization import ModelTokenizer
from pooling_server.engine.models.loader import LoadedModel
from pooling_server.engine.requests.late_chunking import (
    sentence_count,
    sentence_spans,
    token_window_spans,
)
from pooling_server.engine.requests.output_size import ResponseBudget, late_chunk_count
from pooling_server.engine.requests.outputs import LateChunks, MultiVector, TextOutputs
from pooling_server.engine.requests.params import Output, OutputEncoding, Task
from pooling_server.engine.requests.plans import plan_request
from pooling_server.engine.requests.request import ChunkRule, LateChunking, PoolRequest
from pooling_server.engine.requests.resolved import Limits
from pooling_server.engine.requests.size_rules import rows_bytes
from pooling_server.engine.requests.validation import validate_request
from pooling_server.service.grpc import convert
from tests.engine.planned import load
from tests.fixture_models import MINILM, tiny_bge_m3, tiny_colbert

SMALL = ResponseBudget(max_bytes=64 * 1024)


class Counting(ModelTokenizer):
    """The model's tokenizer, counting its calls."""

    def __init__(self, inner: ModelTokenizer) -> None:
        super().__init__(inner.spec, inner.max_input_tokens)
        self.calls = 0

    def tokenize(self, *args, **options):  # type: ignore[no-untyped-def]
        self.calls += 1
        return super().tokenize(*args, **options)


class Counted:
    """A loaded model whose tokenizer and forward calls are counted."""

    def __init__(self, model: LoadedModel) -> None:
        self.tokenizer = Counting(model.tokenizer)
        self.model = LoadedModel(model.info, self.tokenizer, model.runner, images=model.images)
        self.forwards = 0
        forward = model.runner.forward

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.forwards += 1
            return forward(*args, **kwargs)

        self.forward = counted

    def run(self, request: PoolRequest) -> list:  # type: ignore[type-arg]
        limits = Limits()
        plan = plan_request(validate_request(request, self.model.info, limits), self.model, limits)
        raws = self.forward([s for s, _ in plan.work], [k for _, k in plan.work])
        return plan.finish(raws)

    def refusal(self, request: PoolRequest) -> tuple[str, str, int, int]:
        """(field, reason, tokenizer calls, forward calls) of a refused request."""
        with pytest.raises(PoolingError) as caught:
            self.run(request)
        violation = caught.value.violations[0]
        return violation.field, violation.reason, self.tokenizer.calls, self.forwards


@pytest.fixture(scope="module")
def minilm() -> LoadedModel:
    return load(MINILM)


@pytest.fixture(scope="module")
def colbert(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load(tiny_colbert(tmp_path_factory.mktemp("counted") / "colbert"))


@pytest.fixture(scope="module")
def bge_m3(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load(tiny_bge_m3(tmp_path_factory.mktemp("counted") / "bge-m3"))


def late(texts: Sequence[str], budget: ResponseBudget | None = None, **rule: object) -> PoolRequest:
    return PoolRequest(
        Task.EMBED,
        texts=tuple(texts),
        late_chunking=LateChunking(**rule),  # type: ignore[arg-type]
        response_budget=budget,
    )


# ------------------------------------------------------------------ late chunking


@pytest.mark.parametrize(
    "text",
    ["a. a. a.", "One. Two!  \n\n Three?", "no end", "", "  \n ", "x.\n\ny.", "a.\u3002b"],
)
def test_sentence_count_is_the_spans_count(text: str) -> None:
    assert sentence_count(text) == len(sentence_spans(text))
    assert sentence_count("a. " * 1000, 10) == 10  # stops at the bound


@pytest.mark.parametrize(
    ("tokens", "window", "overlap"),
    [(1, 1, 0), (10, 1, 0), (10, 3, 1), (10, 4, 3), (3, 8, 2), (0, 2, 0)],
)
def test_token_window_count_is_the_spans_count(tokens: int, window: int, overlap: int) -> None:
    offsets = [(i, i + 1) for i in range(tokens)]
    spans = token_window_spans(offsets, window, overlap) if tokens else []
    assert late_chunk_count(tokens, window, overlap) == len(spans)


@pytest.mark.parametrize(
    "rule",
    [dict(rule=ChunkRule.TOKENS, window=1), dict(rule=ChunkRule.SENTENCES)],
    ids=["tokens", "sentences"],
)
def test_late_chunks_over_the_budget_are_refused_before_tokenizing(
    minilm: LoadedModel, rule: dict
) -> None:
    counted = Counted(minilm)
    request = late(["a. " * 20_000] * 4, **rule)  # 80,000 chunks: 120 MB over gRPC
    assert counted.refusal(request) == ("embed.texts", "OUTPUT_TOO_LARGE", 0, 0)


def test_late_chunks_counted_on_tokens_are_refused_before_the_forward_pass(
    minilm: LoadedModel,
) -> None:
    """Few words of many tokens each: the words let it through, the tokens do not, and
    it is refused once tokenized, before any chunk is built or computed."""
    counted = Counted(minilm)
    text = " ".join(["Xylophonequartzjumbled"] * 10)  # 10 words, over 60 tokens
    request = late([text] * 2, SMALL, rule=ChunkRule.TOKENS, window=1)
    field, reason, tokenized, forwards = counted.refusal(request)
    assert (field, reason, forwards) == ("embed.texts", "OUTPUT_TOO_LARGE", 0)
    assert tokenized == 1


@pytest.mark.parametrize(
    "rule",
    [dict(rule=ChunkRule.TOKENS, window=3, overlap=1), dict(rule=ChunkRule.SENTENCES)],
    ids=["tokens", "sentences"],
)
def test_late_chunk_estimates_are_the_answers_count(minilm: LoadedModel, rule: dict) -> None:
    texts = ["Berlin is big. Paris is old! Rome? " * 6, "Short text here."]
    (first, second) = Counted(minilm).run(late(texts, **rule))
    assert isinstance(first, LateChunks) and isinstance(second, LateChunks)
    chunks = len(first.embeddings) + len(second.embeddings)
    if rule["rule"] is ChunkRule.SENTENCES:
        assert chunks == sum(sentence_count(t) for t in texts)
    else:
        contents = [len(minilm.tokenizer.tokenize([t])[0]) - 2 for t in texts]
        assert chunks == sum(late_chunk_count(n, 3, 1) for n in contents)


# ------------------------------------------------------------------ ColBERT, bge-m3


def _real_bytes(result: list, task: Task) -> int:  # type: ignore[type-arg]
    """The outputs' bytes in the gRPC answer (its envelope, the request id and model name
    around them, is bounded apart from the estimate)."""
    from pooling_server.engine.requests.outputs import PoolResult

    size = convert.response_to_proto(PoolResult("r", "m", task, 0, result)).ByteSize()
    return size - convert.response_to_proto(PoolResult("r", "m", task, 0, [])).ByteSize()


@pytest.mark.parametrize("mode", [None, "query"])
def test_colbert_estimate_is_at_least_the_answer(colbert: LoadedModel, mode: str | None) -> None:
    texts = ("a short text", "a longer text about ColBERT's late interaction, and more " * 3)
    request = PoolRequest(Task.EMBED_MULTI, texts=texts, prompt_name=mode)
    result = Counted(colbert).run(request)
    assert all(isinstance(o, MultiVector) for o in result)
    resolved = validate_request(request, colbert.info, Limits())
    settings = colbert.info.settings
    assert settings is not None
    prompt = settings.query_prefix if mode else settings.document_prefix
    cut = settings.query_length if mode else settings.document_length
    sequences = colbert.tokenizer.tokenize([prompt + t for t in texts], truncate=cut)
    counts = [len(s) for s in sequences]  # as the plan counts them: cut, before expansion
    estimate = rows_bytes(resolved, counts, Limits().response)
    real = _real_bytes(result, Task.EMBED_MULTI)
    assert real <= estimate <= real * 1.3 + 64


def test_colbert_over_the_budget_is_refused_before_the_forward_pass(colbert: LoadedModel) -> None:
    counted = Counted(colbert)
    few_words = " ".join(["Xylophonequartzjumbled"] * 3)  # 3 words, 20 tokens once cut
    request = PoolRequest(Task.EMBED_MULTI, texts=(few_words,) * 64, response_budget=SMALL)
    field, reason, tokenized, forwards = counted.refusal(request)
    assert (field, reason, forwards) == ("embed_multi.texts", "OUTPUT_TOO_LARGE", 0)
    assert tokenized == 1
    # Many words: refused before tokenizing.
    counted = Counted(colbert)
    request = replace(request, texts=("word " * 200,) * 64)
    assert counted.refusal(request) == ("embed_multi.texts", "OUTPUT_TOO_LARGE", 0, 0)


@pytest.mark.parametrize(
    "outputs",
    [frozenset(Output), frozenset({Output.MULTI}), frozenset({Output.SPARSE, Output.DENSE})],
    ids=["all", "multi", "sparse-dense"],
)
def test_bge_m3_estimate_is_at_least_the_answer(bge_m3: LoadedModel, outputs: frozenset) -> None:
    texts = ("a short text", "bge-m3 gives three outputs from one pass, " * 4)
    request = PoolRequest(Task.EMBED_OUTPUTS, texts=texts, outputs=outputs)
    result = Counted(bge_m3).run(request)
    assert all(isinstance(o, TextOutputs) for o in result)
    resolved = validate_request(request, bge_m3.info, Limits())
    counts = [len(s) for s in bge_m3.tokenizer.tokenize(texts, truncate=-1)]
    estimate = rows_bytes(resolved, counts, Limits().response)
    assert _real_bytes(result, Task.EMBED_OUTPUTS) <= estimate


def test_bge_m3_over_the_budget_is_refused_before_the_forward_pass(bge_m3: LoadedModel) -> None:
    request = PoolRequest(
        Task.EMBED_OUTPUTS,
        texts=("many words in a text " * 30,) * 64,
        outputs=frozenset(Output),
        response_budget=SMALL,
        encoding=OutputEncoding.FLOAT,
    )
    assert Counted(bge_m3).refusal(request) == ("embed_outputs.texts", "OUTPUT_TOO_LARGE", 0, 0)


# ------------------------------------------------------------------ TEI's entities


@pytest.fixture(scope="module")
def ner(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    from transformers import BertForTokenClassification

    from tests.fixture_models import NER_LABELS, _bert_config, _labels, _save

    folder = tmp_path_factory.mktemp("counted") / "ner"
    return load(_save(BertForTokenClassification(_bert_config(**_labels(NER_LABELS))), folder))


@pytest.mark.parametrize("aggregation", ["none", "simple", "first"])
def test_entity_estimate_is_at_least_the_answer(ner: LoadedModel, aggregation: str) -> None:
    """TEI's token classification answered as entities, no label ignored (the most it
    can hold): at most what entity_budget lets token_rows_bytes count from the tokens."""
    import msgspec

    from pooling_server.engine.requests.output_size import entity_budget, token_rows_bytes
    from pooling_server.engine.requests.params import PoolingParams
    from pooling_server.service.http.entities import entities

    texts = ("Angela Merkel visited Paris, Éire and 東京 in 2019!", "x" * 300, "短い")
    request = PoolRequest(
        Task.TOKEN_CLASSIFY, texts=texts, params=PoolingParams(use_activation=False)
    )
    rows = Counted(ner).run(request)
    labels = list(ner.info.labels)
    found = [
        msgspec.json.encode(entities(t, r, labels, ner.tokenizer, aggregation, ()))
        for t, r in zip(texts, rows, strict=True)
    ]
    real = len(b"[" + b",".join(found) + b"]")
    longest = max(map(len, labels))
    budget = entity_budget(1 << 30, "--max-http-response-mb", longest, max(map(len, texts)))
    counts = [len(r.token_ids) for r in rows]
    estimate = token_rows_bytes(
        Task.TOKEN_CLASSIFY, counts, ner.info, None, OutputEncoding.FLOAT, budget
    )
    assert real <= estimate <= 3 * real + 1024


def test_colbert_floor_counts_rows_as_the_mode_cuts_them(colbert: LoadedModel) -> None:
    """Documents past the document length keep that many rows: a request whose texts
    are long but whose matrices are small is served, not refused by its words."""
    settings = colbert.info.settings
    assert settings is not None and settings.document_length is not None
    width = settings.dimension * 4
    # Each text's words alone would be 64 KB of rows at the maximum length; cut, 1.3 KB.
    texts = ("word " * 1000,) * 2
    budget = ResponseBudget(max_bytes=4 * settings.document_length * width)
    request = PoolRequest(Task.EMBED_MULTI, texts=texts, response_budget=budget)
    result = Counted(colbert).run(request)
    assert [o.values.shape[0] for o in result] == [settings.document_length] * 2  # type: ignore[union-attr]


# ------------------------------------------------------------------ zero-shot labels


def test_zero_shot_labels_count_with_the_texts_as_their_template_reads_them(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Labels are texts read through their template: counted against the request bound,
    as often as the template places them, before any is tokenized."""
    from tests.fixture_models import tiny_clip

    clip = load(tiny_clip(tmp_path_factory.mktemp("counted") / "clip")).info
    limits = Limits(max_request_chars=10_000)
    labels = tuple(f"label {i} " + "x" * 90 for i in range(64))  # 6,400 characters
    request = PoolRequest(Task.CLASSIFY, texts=("a text",), candidate_labels=labels)
    validate_request(request, clip, limits)  # once each, with the default template
    twice = replace(request, label_template="{label} or {label}")
    with pytest.raises(PoolingError) as caught:
        validate_request(twice, clip, limits)
    found = [(v.field, v.reason) for v in caught.value.violations]
    assert found == [("classify.candidate_labels", "REQUEST_TOO_LARGE")]
