"""LLM rerankers (a decoder LM read through a score template) on a tiny random-weight Qwen3:
tokenization exactly as Qwen3-Reranker's model card builds it, scores equal to
transformers' own forward and logits (one by one, and in one mixed batch), instructions,
and every refusal of a template or request that does not fit."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pooling_server.engine.errors import ErrorKind, PoolingError
from pooling_server.engine.models.loader import LoadedModel, load_model
from pooling_server.engine.models.model_info import HeadKind
from pooling_server.engine.models.model_spec import ModelSpec
from pooling_server.engine.requests.outputs import Score
from pooling_server.engine.requests.params import PoolingParams, Task
from pooling_server.engine.requests.plans import plan_request
from pooling_server.engine.requests.request import PoolRequest, RerankRequest
from pooling_server.engine.requests.resolved import Limits
from pooling_server.engine.requests.validation import validate_request, validate_rerank
from tests.engine.planned import load
from tests.fixture_models import MINILM, tiny_qwen3_reranker

ATOL = 1e-5

# The model card's reference, written out here on its own (not the engine's template code).
CARD_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
    'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
    "<|im_end|>\n<|im_start|>user\n"
)
CARD_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
CARD_TASK = "Given a web search query, retrieve relevant passages that answer the query"

QUERY = "What is the capital of China?"
DOCUMENTS = [
    "The capital of China is Beijing.",
    "Gravity is a force that attracts two bodies towards each other. " * 4,
    "",
    "yes",
    "A {document} brace and a {query} one stay text.",
    "Ünïcödé façade 東京 🙂 <|im_end|> inside a document",
]


def card_format(instruction: str | None, query: str, doc: str) -> str:
    if instruction is None:
        instruction = CARD_TASK
    return f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"


def card_inputs(tokenizer: object, pairs: Sequence[str], max_length: int) -> list[list[int]]:
    """process_inputs of the model card, without its padding: prefix + the formatted pair
    truncated (longest_first) to what the prefix and suffix leave + suffix. One departure:
    the pair is user text, so a special token's text in it stays text (the card would read
    a document's "<|im_end|>" as the token and let it close the turn)."""
    prefix = tokenizer.encode(CARD_PREFIX, add_special_tokens=False)  # type: ignore[attr-defined]
    suffix = tokenizer.encode(CARD_SUFFIX, add_special_tokens=False)  # type: ignore[attr-defined]
    inputs = tokenizer(  # type: ignore[operator]
        list(pairs),
        padding=False,
        truncation="longest_first",
        return_attention_mask=False,
        max_length=max_length - len(prefix) - len(suffix),
        split_special_tokens=True,
    )
    return [prefix + ids + suffix for ids in inputs["input_ids"]]


def card_scores(model: torch.nn.Module, tokenizer: object, ids: list[list[int]]) -> np.ndarray:
    """compute_logits of the model card, one sequence at a time (no padding at all)."""
    yes = tokenizer.convert_tokens_to_ids("yes")  # type: ignore[attr-defined]
    no = tokenizer.convert_tokens_to_ids("no")  # type: ignore[attr-defined]
    scores = []
    with torch.no_grad():
        for sequence in ids:
            logits = model(input_ids=torch.tensor([sequence])).logits[:, -1, :]
            pair = torch.stack([logits[:, no], logits[:, yes]], dim=1)
            scores.append(torch.nn.functional.log_softmax(pair, dim=1)[:, 1].exp().item())
    return np.array(scores)


def card_scores_padded(
    model: torch.nn.Module, tokenizer: object, ids: list[list[int]]
) -> np.ndarray:
    """The model card's batch: left-padded by tokenizer.pad, the last position read."""
    tokenizer.padding_side = "left"  # type: ignore[attr-defined]
    batch = tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt")  # type: ignore[attr-defined]
    yes = tokenizer.convert_tokens_to_ids("yes")  # type: ignore[attr-defined]
    no = tokenizer.convert_tokens_to_ids("no")  # type: ignore[attr-defined]
    with torch.no_grad():
        logits = model(**batch).logits[:, -1, :]
    pair = torch.stack([logits[:, no], logits[:, yes]], dim=1)
    return torch.nn.functional.log_softmax(pair, dim=1)[:, 1].exp().numpy()


# A score template in vLLM's Jinja manner: the pair from the roles "query" and "document",
# the instruction from a "system" message, else a default.
JINJA_TEMPLATE = (
    CARD_PREFIX + "<Instruct>: {% set system = messages | selectattr('role', 'eq', 'system') "
    "| list %}{{ system[0].content if system else '" + CARD_TASK + "' }}\n"
    "<Query>: {{ (messages | selectattr('role', 'eq', 'query') | first).content }}\n"
    "<Document>: {{ (messages | selectattr('role', 'eq', 'document') | first).content }}"
    + CARD_SUFFIX
    + "\n"  # Jinja drops a template's last newline, as transformers renders chat templates
)
# An ordinary chat template (user and assistant turns): not a score template.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llm-rerankers")
    return {
        "reranker": tiny_qwen3_reranker(root / "qwen3-reranker"),
        "bare": tiny_qwen3_reranker(root / "qwen3-bare", template_file=False),
        "jinja": tiny_qwen3_reranker(
            root / "qwen3-jinja", template_file=False, chat_template=JINJA_TEMPLATE
        ),
        "chat": tiny_qwen3_reranker(
            root / "qwen3-chat", template_file=False, chat_template=CHAT_TEMPLATE
        ),
    }


@pytest.fixture(scope="module")
def reranker(folders: dict[str, Path]) -> LoadedModel:
    return load(folders["reranker"])


@pytest.fixture(scope="module")
def reference(folders: dict[str, Path]) -> tuple[torch.nn.Module, object]:
    folder = folders["reranker"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def run(model: LoadedModel, request: PoolRequest) -> tuple[list[list[int]], np.ndarray]:
    """The request planned and run as the engine does: every pair in one forward pass."""
    limits = Limits()
    plan = plan_request(validate_request(request, model.info, limits), model, limits)
    sequences = [sequence for sequence, _ in plan.work]
    raws = model.runner.forward(sequences, [keep for _, keep in plan.work])
    outputs = plan.finish(raws)
    assert all(isinstance(o, Score) for o in outputs)
    return [list(s.input_ids) for s in sequences], np.array([o.value for o in outputs])  # type: ignore[union-attr]


def score_request(
    query: str, documents: Sequence[str], prompt: str | None = None, **params: object
) -> PoolRequest:
    return PoolRequest(
        task=Task.SCORE,
        text_1=(query,),
        text_2=tuple(documents),
        prompt=prompt,
        params=PoolingParams(**params),  # type: ignore[arg-type]
    )


def test_loads_as_a_scorer(reranker: LoadedModel) -> None:
    info = reranker.info
    assert info.family == "llm_reranker" and info.head is HeadKind.SEQUENCE
    assert info.tasks == (Task.SCORE,)
    assert info.is_cross_encoder  # served as cross-encoders are: TEI's "reranker", etc.
    assert info.score_template_source == "score_template.json"
    assert info.architecture == "Qwen3ForCausalLM"
    assert info.backend == "torch"


def test_only_two_rows_of_the_head_are_kept(reranker: LoadedModel) -> None:
    """No module of the scorer maps onto the vocabulary: the pass never computes a full
    vocabulary of logits, at any position."""
    scorer = reranker.runner.module
    assert scorer is not None
    vocabulary = reranker.tokenizer.vocab_size
    assert scorer.rows.shape == (2, 64)  # type: ignore[union-attr]
    assert not [
        m
        for m in scorer.modules()
        if isinstance(m, torch.nn.Linear) and m.out_features >= vocabulary
    ]
    # The untied head's matrix is let go: the input embeddings are all that spans it.
    spanning = [n for n, p in scorer.named_parameters() if p.shape[0] == vocabulary]
    assert spanning == ["body.embed_tokens.weight"]


@pytest.mark.parametrize("instruction", [None, "Find the passage that names a city"])
def test_tokenization_is_the_model_cards(
    reranker: LoadedModel, reference: tuple[torch.nn.Module, object], instruction: str | None
) -> None:
    _, tokenizer = reference
    ids, _ = run(reranker, score_request(QUERY, DOCUMENTS, instruction))
    pairs = [card_format(instruction, QUERY, d) for d in DOCUMENTS]
    assert ids == card_inputs(tokenizer, pairs, reranker.info.max_input_tokens)


@pytest.mark.parametrize("side", ["right", "left"])
def test_truncation_keeps_the_prefix_and_suffix(
    reranker: LoadedModel, reference: tuple[torch.nn.Module, object], side: str
) -> None:
    """truncate_prompt_tokens cuts the pair part only, as the model card's max_length does."""
    _, tokenizer = reference
    long = "Beijing is the capital of China and a very large city. " * 40
    request = PoolRequest(
        task=Task.SCORE,
        text_1=(QUERY,),
        text_2=(long, "short"),
        params=PoolingParams(truncate_prompt_tokens=120),
        truncation_side=side,
    )
    ids, _ = run(reranker, request)
    tokenizer.truncation_side = side  # type: ignore[attr-defined]
    try:
        expected = card_inputs(
            tokenizer, [card_format(None, QUERY, long), card_format(None, QUERY, "short")], 120
        )
    finally:
        tokenizer.truncation_side = "right"  # type: ignore[attr-defined]
    assert ids == expected
    assert len(ids[0]) == 120


def test_a_long_pair_is_cut_to_the_maximum_length(
    reranker: LoadedModel, reference: tuple[torch.nn.Module, object]
) -> None:
    """Without truncate_prompt_tokens the pair part is still cut, to the model's maximum."""
    _, tokenizer = reference
    long = "Gravity pulls. " * 400
    ids, _ = run(reranker, score_request(QUERY, [long]))
    maximum = reranker.info.max_input_tokens
    assert ids == card_inputs(tokenizer, [card_format(None, QUERY, long)], maximum)
    assert len(ids[0]) == maximum


def test_scores_equal_transformers_one_by_one_and_in_a_mixed_batch(
    reranker: LoadedModel, reference: tuple[torch.nn.Module, object]
) -> None:
    model, tokenizer = reference
    expected = card_scores(
        model,
        tokenizer,
        card_inputs(tokenizer, [card_format(None, QUERY, d) for d in DOCUMENTS], 512),
    )
    _, batched = run(reranker, score_request(QUERY, DOCUMENTS))  # lengths 110 to 160 tokens
    alone = np.array([run(reranker, score_request(QUERY, [d]))[1][0] for d in DOCUMENTS])
    np.testing.assert_allclose(batched, expected, atol=ATOL, rtol=0)
    np.testing.assert_allclose(alone, expected, atol=ATOL, rtol=0)
    assert np.ptp(expected) > 0.05  # the random model tells the documents apart


def test_scores_equal_the_model_cards_left_padded_batch(
    reranker: LoadedModel, reference: tuple[torch.nn.Module, object]
) -> None:
    model, tokenizer = reference
    ids = card_inputs(tokenizer, [card_format(None, QUERY, d) for d in DOCUMENTS], 512)
    _, batched = run(reranker, score_request(QUERY, DOCUMENTS))
    np.testing.assert_allclose(batched, card_scores_padded(model, tokenizer, ids), atol=ATOL)


def test_sigmoid_of_the_difference_is_the_softmax_of_the_pair(
    reranker: LoadedModel, reference: tuple[torch.nn.Module, object]
) -> None:
    """use_activation false gives logit(yes) - logit(no); its sigmoid is the score."""
    model, tokenizer = reference
    _, raw = run(reranker, score_request(QUERY, DOCUMENTS[:3], use_activation=False))
    _, scores = run(reranker, score_request(QUERY, DOCUMENTS[:3]))
    ids = card_inputs(tokenizer, [card_format(None, QUERY, d) for d in DOCUMENTS[:3]], 512)
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")  # type: ignore[attr-defined]
    with torch.no_grad():
        logits = [model(input_ids=torch.tensor([s])).logits[0, -1] for s in ids]
    differences = np.array([float(row[yes] - row[no]) for row in logits])
    np.testing.assert_allclose(raw, differences, atol=ATOL)
    np.testing.assert_allclose(scores, 1 / (1 + np.exp(-raw)), atol=1e-6)


def test_an_instruction_reaches_the_template(
    reranker: LoadedModel, reference: tuple[torch.nn.Module, object]
) -> None:
    model, tokenizer = reference
    instruction = "Judge whether the passage names a city"
    _, scored = run(reranker, score_request(QUERY, DOCUMENTS, instruction))
    ids = card_inputs(tokenizer, [card_format(instruction, QUERY, d) for d in DOCUMENTS], 512)
    np.testing.assert_allclose(scored, card_scores(model, tokenizer, ids), atol=ATOL)
    _, default = run(reranker, score_request(QUERY, DOCUMENTS))
    assert not np.allclose(scored, default)


def test_rerank_carries_the_instruction(reranker: LoadedModel) -> None:
    instruction = "Judge whether the passage names a city"
    rerank = RerankRequest(query=QUERY, documents=tuple(DOCUMENTS), instruction=instruction)
    resolved = validate_rerank(rerank, reranker.info, Limits())
    plan = plan_request(resolved, reranker, Limits())
    raws = reranker.runner.forward([s for s, _ in plan.work], [k for _, k in plan.work])
    ranked = [o.value for o in plan.finish(raws)]  # type: ignore[union-attr]
    _, direct = run(reranker, score_request(QUERY, DOCUMENTS, instruction))
    np.testing.assert_allclose(ranked, direct, atol=1e-7)


def test_template_from_flags_inline_and_in_files(
    folders: dict[str, Path], reranker: LoadedModel, tmp_path: Path
) -> None:
    """--score-template inline, as a text file and as JSON give the folder file's scores
    (the same template; the instruction given, since only the JSON has a default)."""
    from tests.fixture_models import QWEN3_RERANKER_TEMPLATE

    text_file = tmp_path / "qwen3.txt"
    text_file.write_text(QWEN3_RERANKER_TEMPLATE)
    json_file = tmp_path / "qwen3.json"
    json_file.write_text(json.dumps({"template": QWEN3_RERANKER_TEMPLATE, "tokens": "yes,no"}))
    _, expected = run(reranker, score_request(QUERY, DOCUMENTS, CARD_TASK))
    for given in (QWEN3_RERANKER_TEMPLATE, str(text_file), str(json_file)):
        model = load(folders["bare"], score_template=given, score_tokens="yes,no")
        assert model.info.score_template_source == "--score-template"
        _, got = run(model, score_request(QUERY, DOCUMENTS, CARD_TASK))
        np.testing.assert_allclose(got, expected, atol=1e-7)


@pytest.mark.parametrize("instruction", [None, "Find the passage that names a city"])
def test_a_jinja_score_template_reads_as_vllms(
    folders: dict[str, Path],
    reranker: LoadedModel,
    tmp_path: Path,
    instruction: str | None,
) -> None:
    """vLLM's kind of score template, as the folder's chat template or a --score-template
    .jinja file: the same tokens and scores as the model card's, its default instruction
    included."""
    from_chat = load(folders["jinja"])
    assert from_chat.info.score_template_source == "chat_template"
    jinja_file = tmp_path / "qwen3.jinja"
    jinja_file.write_text(JINJA_TEMPLATE)
    from_file = load(folders["bare"], score_template=str(jinja_file))
    expected_ids, expected = run(reranker, score_request(QUERY, DOCUMENTS, instruction))
    for model in (from_chat, from_file):
        ids, got = run(model, score_request(QUERY, DOCUMENTS, instruction))
        assert ids == expected_ids
        np.testing.assert_allclose(got, expected, atol=1e-7)


def test_an_ordinary_chat_template_is_no_score_template(folders: dict[str, Path]) -> None:
    chat = load(folders["chat"])
    assert chat.info.head is HeadKind.HIDDEN and chat.info.settings.decoder_lm_without_template


def test_swapped_tokens_give_the_complementary_score(
    folders: dict[str, Path], reranker: LoadedModel
) -> None:
    swapped = load(folders["reranker"], score_tokens="no,yes")
    _, scores = run(reranker, score_request(QUERY, DOCUMENTS))
    _, complement = run(swapped, score_request(QUERY, DOCUMENTS))
    np.testing.assert_allclose(scores + complement, 1.0, atol=1e-6)


# ------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"score_template": "<Query>: {query}\n"}, "has no {document}"),
        (
            {"score_template": "{instruction}", "score_tokens": "yes,no"},
            "has no {query} and {document}",
        ),
        ({"score_template": "{query} {document}", "score_tokens": "zebra-crossing,no"}, "not one"),
        ({"score_template": "{query} {document}", "score_tokens": "yes,yes"}, "the same token"),
        ({"score_template": "{query} {document}", "score_tokens": "yes"}, "two tokens"),
        ({"score_tokens": "yes,no"}, "needs a score template"),
        ({"score_template": "{{ messages[0].content }}"}, "renders no query and document"),
        ({"score_template": "{query} {document}", "backend": "onnx"}, "--backend torch only"),
    ],
)
def test_templates_that_do_not_fit_are_refused(
    folders: dict[str, Path], options: dict[str, object], message: str
) -> None:
    from pooling_server.engine.backends import BackendKind, BackendOptions

    if "backend" in options:
        options = {**options, "backend": BackendOptions(BackendKind(options["backend"]))}
    with pytest.raises(ValueError, match=message.replace("{", r"\{").replace("}", r"\}")):
        load(folders["bare"], **options)


def test_a_template_on_an_encoder_is_refused() -> None:
    with pytest.raises(ValueError, match="needs a decoder LM"):
        load_model(
            ModelSpec(str(MINILM), name="minilm", score_template="{query} {document}"),
            device=torch.device("cpu"),
            dtype=torch.float32,
        )


def test_score_on_a_decoder_lm_without_a_template_is_refused(folders: dict[str, Path]) -> None:
    bare = load(folders["bare"])
    assert bare.info.head is HeadKind.HIDDEN  # it still embeds (last-token pooling)
    assert Task.SCORE not in bare.info.tasks and Task.EMBED in bare.info.tasks
    with pytest.raises(PoolingError) as caught:
        validate_request(score_request(QUERY, DOCUMENTS), bare.info, Limits())
    error = caught.value
    assert error.kind is ErrorKind.FAILED_PRECONDITION
    assert error.reason == "SCORE_TEMPLATE_MISSING"
    assert "--score-template" in error.message and "score_template.json" in error.message


def test_truncation_shorter_than_the_template_is_refused(reranker: LoadedModel) -> None:
    fixed = reranker.info.num_special_tokens
    with pytest.raises(PoolingError) as caught:
        validate_request(
            score_request(QUERY, ["a"], truncate_prompt_tokens=fixed - 1), reranker.info, Limits()
        )
    assert caught.value.reason == "TRUNCATE_PROMPT_TOKENS_INVALID"
    ids, _ = run(reranker, score_request(QUERY, ["a b c d"], truncate_prompt_tokens=fixed))
    assert len(ids[0]) == fixed  # one token of the pair part is left


def test_prompt_names_are_still_refused_on_score(reranker: LoadedModel) -> None:
    request = PoolRequest(task=Task.SCORE, text_1=(QUERY,), text_2=("a",), prompt_name="query")
    with pytest.raises(PoolingError) as caught:
        validate_request(request, reranker.info, Limits())
    assert caught.value.reason == "PROMPT_NOT_SUPPORTED_FOR_TASK"


def test_graphed_forward_scores_as_eager(reranker: LoadedModel) -> None:
    """The forward replayed from (stand-in) CUDA graphs of bucketed shapes: each batch is
    padded to its bucket's rows and length, and every pair still reads its own last token."""
    from pooling_server.engine.models.cuda_graphs import Buckets, GraphedForward, eager_capture

    runner = reranker.runner
    assert runner.module is not None
    graphs = GraphedForward(
        runner.module,
        runner._output,
        Buckets.for_model(8, runner.info.max_input_tokens, 256),
        torch.device("cpu"),
        runner.pad_token_id,
        False,
        capture=eager_capture,
    )
    graphs.capture_all()
    _, eager = run(reranker, score_request(QUERY, DOCUMENTS))
    runner.graphs = graphs
    try:
        _, graphed = run(reranker, score_request(QUERY, DOCUMENTS))
    finally:
        runner.graphs = None
    assert graphs.replays == 1
    np.testing.assert_allclose(graphed, eager, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_other_decoder_families_score_as_transformers(tmp_path: Path, family: str) -> None:
    """Llama and Gemma 2 through the same path: the tokenizer's BOS first, then the
    template's parts; Gemma 2's logits soft-capped as its own head caps them."""
    from tests.fixture_models import PLAIN_TEMPLATE, tiny_decoder_reranker

    folder = tiny_decoder_reranker(tmp_path / family, family)
    model = load(folder)
    assert model.info.family == "llm_reranker" and model.info.head is HeadKind.SEQUENCE
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prefix, _, rest = PLAIN_TEMPLATE.partition("Query: ")
    body_end = rest.index("{document}") + len("{document}")
    suffix = rest[body_end:]
    ids, scores = run(model, score_request(QUERY, DOCUMENTS))
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    expected_ids, expected = [], []
    for document in DOCUMENTS:
        body = f"Query: {QUERY}\nDocument: {document}"
        sequence = [tokenizer.bos_token_id]
        for part, split in ((prefix, False), (body, True), (suffix, False)):  # the pair as text
            sequence += tokenizer.encode(part, add_special_tokens=False, split_special_tokens=split)
        expected_ids.append(sequence)
        with torch.no_grad():
            logits = reference(input_ids=torch.tensor([sequence])).logits[0, -1]
        expected.append(float(torch.sigmoid(logits[yes] - logits[no])))
    assert ids == expected_ids
    np.testing.assert_allclose(scores, expected, atol=ATOL)


def test_a_template_on_a_decoder_body_without_its_head_is_refused(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    """An embedding model's folder (the decoder body alone) has no LM head to read."""
    from transformers import AutoModel

    body = tmp_path / "qwen3-body"
    AutoModel.from_pretrained(folders["bare"]).save_pretrained(body)
    AutoTokenizer.from_pretrained(folders["bare"]).save_pretrained(body)
    with pytest.raises(ValueError, match="lacks 1 of the causal LM's weights"):
        load(body, score_template="{query} {document}")


def test_a_template_longer_than_the_model_is_refused(folders: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="leaving no room for a pair"):
        load(folders["bare"], score_template="{query} {document}" + " and" * 600)
