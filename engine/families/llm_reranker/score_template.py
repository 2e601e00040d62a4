"""Score templates: how a decoder LLM reranker (Qwen3-Reranker and the like) reads a pair.

A template is one text with the placeholders `{query}`, `{document}` and optionally
`{instruction}`; every other brace is literal. It splits in three, tokenized apart and
joined, as the Qwen3-Reranker model card does:

- the prefix: everything before the line that holds the first placeholder (the system and
  user turn openers), never truncated;
- the body: from that line's start to the end of the last placeholder, the part truncated
  so that prefix and suffix always fit;
- the suffix: everything after the last placeholder (the assistant turn, the empty think
  block), never truncated, so that the last position is the one whose next token is judged.

The pair's score is sigmoid(logit(true) - logit(false)) at the last position, which is
also the softmax over the two logits' true entry: the same number either way.

Sources, first found wins: `--score-template` / `--score-tokens`, then the folder's
`score_template.json` ({"template", "tokens", "default_instruction"}), then the folder's
chat template where it is a score template in vLLM's manner: Jinja over `messages` with the
roles "query" and "document" (and "system", or the `instruction` variable, for the
instruction). A Jinja template (one with `{{`) given by flag or file is read the same way:
rendered once with marker texts standing for the three values, which become placeholders.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from pooling_server.engine.inputs.tokenization import PAIR_MARGIN, ModelTokenizer, TokenSequence

SCORE_TEMPLATE_FILE = "score_template.json"
PLACEHOLDERS = ("query", "document", "instruction")
_PLACEHOLDER = re.compile(r"\{(query|document|instruction)\}")
DEFAULT_TOKENS = ("yes", "no")


@dataclass(frozen=True)
class ScoreTemplate:
    """A template split as the module docstring says, with the true/false tokens' ids."""

    prefix: str
    body: str
    suffix: str
    true_token: str
    false_token: str
    true_id: int
    false_id: int
    default_instruction: str
    source: str  # "--score-template", "score_template.json" or "chat_template"
    # The fixed parts' tokens, found once at load: the tokenizer's leading special tokens
    # (a BOS, where it adds one; none for Qwen), the prefix's and the suffix's.
    lead_ids: tuple[int, ...] = ()
    prefix_ids: tuple[int, ...] = ()
    suffix_ids: tuple[int, ...] = ()
    # The body in runs: texts with placeholders, and the template's own special tokens
    # between them (text, id); empty: the body is one run.
    runs: tuple[tuple[str, int | None], ...] = ()

    @property
    def score_template_source(self) -> str:
        """ModelInfo.score_template_source, where this template is a model's settings."""
        return self.source

    @property
    def fixed_tokens(self) -> int:
        """The tokens every pair adds around its own."""
        return len(self.lead_ids) + len(self.prefix_ids) + len(self.suffix_ids)

    def pair_chars(self, query: int, document: int, instruction: int) -> int:
        """The characters of the body filled with values of these lengths, counted
        before any is built (engine/requests/validation.py bounds a request's pairs by them)."""
        counts, literal = self._shape
        return (
            literal
            + counts["query"] * query
            + counts["document"] * document
            + counts["instruction"] * instruction
        )

    @cached_property
    def _shape(self) -> tuple[dict[str, int], int]:
        """How often the body reads each placeholder, and its own characters."""
        counts = dict.fromkeys(PLACEHOLDERS, 0)
        for match in _PLACEHOLDER.finditer(self.body):
            counts[match.group(1)] += 1
        return counts, len(_PLACEHOLDER.sub("", self.body))

    def sequences(
        self,
        tokenizer: ModelTokenizer,
        pairs: list[tuple[str, str]],
        instruction: str | None,
        max_tokens: int,
        side: str = "right",
    ) -> list[TokenSequence]:
        """Each pair's tokens: prefix + body (truncated to what `max_tokens` leaves) +
        suffix, each tokenized alone without the tokenizer's own special tokens, as the
        model card's reference builds them; the tokenizer's leading special tokens go
        first. Offsets are into the filled body; the fixed parts' are (0, 0).

        The values are user text: a special token's text in a query, document or
        instruction is read as text (a document cannot close its turn and forge the
        answer's), while the template's own special tokens stay tokens. What the pairs
        share (the body before {document}: the instruction, a 1:N query) is tokenized once
        per request (_BodyTokens), not once per pair."""
        room = max_tokens - self.fixed_tokens
        if room < 1:
            raise ValueError(
                f"the score template's own parts take {self.fixed_tokens} tokens, leaving no "
                f"room for the pair within {max_tokens}"
            )
        told = self.default_instruction if instruction is None else instruction
        runs = self.runs or ((self.body, None),)
        bodies = _BodyTokens(tokenizer, runs, room, side).build(pairs, told)
        head = [*self.lead_ids, *self.prefix_ids]
        head_mask = [1] * len(self.lead_ids) + [0] * len(self.prefix_ids)
        tail = list(self.suffix_ids)
        return [
            TokenSequence(
                head + ids + tail,
                None,
                [(0, 0)] * len(head) + offsets + [(0, 0)] * len(tail),
                head_mask + [0] * (len(ids) + len(tail)),
            )
            for ids, offsets in bodies
        ]


def _fill(text: str, values: dict[str, str]) -> str:
    return _PLACEHOLDER.sub(lambda match: values[match.group(1)], text)


# A piece of one pair's body: (tokens' ids, their offsets, where its text starts in the
# filled body); or a key into the tokenized texts with that start.
_Piece = tuple[list[int], list[tuple[int, int]], int]


class _BodyTokens:
    """The bodies of one request's pairs, tokenized in two batches.

    A run of the body without {document} reads the same text in every pair of a query: it
    is tokenized once per distinct text. The run holding {document} is tokenized with its
    document, but its shared head (the text before {document}) once, where it is long:
    truncating on the right, a head of `room` tokens and PAIR_MARGIN more is all the pair
    keeps, whatever follows; on the left, only the head's last `room` + PAIR_MARGIN tokens
    can remain, so the head is cut to those, at a token's edge, before the document is
    joined. The margin keeps every kept token clear of the join, as ModelTokenizer's
    pair cutting does (engine/inputs/tokenization.py)."""

    def __init__(
        self,
        tokenizer: ModelTokenizer,
        runs: tuple[tuple[str, int | None], ...],
        room: int,
        side: str,
    ) -> None:
        self.tokenizer, self.runs, self.room, self.side = tokenizer, runs, room, side

    def _tokenize(self, texts: set[str]) -> dict[str, TokenSequence]:
        ordered = sorted(texts)
        found = self.tokenizer.tokenize(
            ordered, add_special_tokens=False, split_special_tokens=True
        )
        return dict(zip(ordered, found, strict=True))

    def build(
        self, pairs: list[tuple[str, str]], instruction: str
    ) -> list[tuple[list[int], list[tuple[int, int]]]]:
        # Each pair's runs filled: ("special", id, text), ("text", filled), or
        # ("document", head, rest).
        filled = []
        shared: set[str] = set()
        for query, document in pairs:
            values = {"query": query, "document": document, "instruction": instruction}
            runs: list[tuple[str, object, str]] = []
            for text, special in self.runs:
                if special is not None:
                    runs.append(("special", special, text))
                    continue
                at = text.find("{document}")
                if at < 0:
                    runs.append(("text", _fill(text, values), ""))
                    shared.add(runs[-1][1])  # type: ignore[arg-type]
                else:
                    head = _fill(text[:at], values)
                    runs.append(("document", head, _fill(text[at:], values)))
                    shared.add(head)
            filled.append(runs)
        once = self._tokenize(shared)
        margin = self.room + PAIR_MARGIN
        plans, joined = [], set()
        for runs in filled:
            pieces: list[tuple[str, object, int, int]] = []  # kind, value, start, shift
            start = 0
            count: int | None = 0  # tokens so far; None once a joined run's are unknown
            for kind, value, rest in runs:
                if self.side == "right" and count is not None and count >= self.room:
                    break  # what follows is truncated away
                if kind == "special":
                    pieces.append((kind, value, start, 0))
                    start += len(rest)
                    count = None if count is None else count + 1
                elif kind == "text":
                    tokens = once[value]  # type: ignore[index]
                    pieces.append((kind, tokens, start, 0))
                    start += len(value)  # type: ignore[arg-type]
                    count = None if count is None else count + len(tokens)
                else:
                    head = once[value]  # type: ignore[index]
                    enough = count is not None and len(head) >= self.room - count + PAIR_MARGIN
                    if self.side == "right" and enough:
                        pieces.append(("text", head, start, 0))
                        count = self.room
                        continue
                    cut = 0
                    if self.side != "right" and len(head) > margin:
                        cut = head.offsets[len(head) - margin][0]
                    text = value[cut:] + rest  # type: ignore[index]
                    joined.add(text)
                    pieces.append(("joined", text, start, cut))
                    start += len(value) + len(rest)  # type: ignore[arg-type]
                    count = None
            plans.append(pieces)
        each = self._tokenize(joined)
        return [self._assemble(pieces, each) for pieces in plans]

    def _assemble(
        self, pieces: list[tuple[str, object, int, int]], each: dict[str, TokenSequence]
    ) -> tuple[list[int], list[tuple[int, int]]]:
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        for kind, value, start, shift in pieces:
            if kind == "special":
                ids.append(value)  # type: ignore[arg-type]
                offsets.append((start, start))
                continue
            sequence = each[value] if kind == "joined" else value  # type: ignore[index]
            at = start + shift
            ids += sequence.input_ids  # type: ignore[union-attr]
            offsets += [(a + at, b + at) for a, b in sequence.offsets]  # type: ignore[union-attr]
        if len(ids) > self.room:
            keep = slice(None, self.room) if self.side == "right" else slice(-self.room, None)
            ids, offsets = ids[keep], offsets[keep]
        return ids, offsets


def _runs(body: str, specials: dict[str, int]) -> tuple[tuple[str, int | None], ...]:
    """The body split at the template's own special tokens (none of them inside a
    placeholder): text runs, each tokenized with its values, and the tokens between."""
    if not specials:
        return ((body, None),)
    pattern = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)))
    runs: list[tuple[str, int | None]] = []
    start = 0
    for match in pattern.finditer(body):
        if match.start() > start:
            runs.append((body[start : match.start()], None))
        runs.append((match.group(), specials[match.group()]))
        start = match.end()
    if start < len(body):
        runs.append((body[start:], None))
    return tuple(runs)


def _leading_specials(tokenizer: ModelTokenizer) -> list[int]:
    """The special tokens the tokenizer puts before a text (Llama's and Gemma's BOS;
    none for Qwen)."""
    probe = tokenizer.tokenize(["a"])[0]
    lead = []
    for token, special in zip(probe.input_ids, probe.special_mask, strict=True):
        if not special:
            break
        lead.append(token)
    return lead


def split_template(text: str, where: str) -> tuple[str, str, str]:
    """(prefix, body, suffix) of a template; ValueError naming `where` when {query} or
    {document} is missing."""
    found = {match.group(1) for match in _PLACEHOLDER.finditer(text)}
    missing = [name for name in ("query", "document") if name not in found]
    if missing:
        names = " and ".join("{" + name + "}" for name in missing)
        raise ValueError(
            f"{where}: the score template has no {names}; a template needs {{query}} and "
            "{document} (and may use {instruction})"
        )
    matches = list(_PLACEHOLDER.finditer(text))
    first, last = matches[0].start(), matches[-1].end()
    line_start = text.rfind("\n", 0, first) + 1
    return text[:line_start], text[line_start:last], text[last:]


def parse_tokens(value: str | list[str] | tuple[str, ...], where: str) -> tuple[str, str]:
    """`yes,no` (or a two-item list): the true token, then the false one."""
    items = value.split(",") if isinstance(value, str) else list(value)
    if len(items) != 2 or not all(isinstance(item, str) and item for item in items):
        raise ValueError(
            f"{where}: score tokens must be two tokens, true then false (e.g. yes,no); "
            f"got {value!r}"
        )
    return items[0], items[1]


@dataclass(frozen=True)
class TemplateText:
    """A template as given, before it meets a tokenizer."""

    text: str
    tokens: tuple[str, str]
    default_instruction: str
    source: str


# Marker texts that stand for the values while a Jinja score template renders: private-use
# characters, which no template text holds.
_MARKS = {name: f"\ue000{name}\ue001" for name in PLACEHOLDERS}


def from_jinja(text: str, where: str) -> tuple[str, str] | None:
    """A vLLM-style Jinja score template as (placeholder template, default instruction);
    None where it renders no query and document from `messages` (an ordinary chat
    template), or fails to render."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    pair = [
        {"role": "query", "content": _MARKS["query"]},
        {"role": "document", "content": _MARKS["document"]},
    ]
    system = [{"role": "system", "content": _MARKS["instruction"]}]
    try:
        template = env.from_string(text)
        marked = template.render(messages=system + pair, add_generation_prompt=False)
        bare = template.render(messages=pair, add_generation_prompt=False)
    except Exception:  # any chat template may refuse roles it does not know
        return None
    if _MARKS["query"] not in marked or _MARKS["document"] not in marked:
        return None
    default = ""
    if _MARKS["instruction"] in marked:
        before, _, after = marked.partition(_MARKS["instruction"])
        if bare.startswith(before) and bare.endswith(after):
            default = bare[len(before) : len(bare) - len(after)]
    for name, mark in _MARKS.items():
        marked = marked.replace(mark, "{" + name + "}")
    if "\ue000" in marked or "\ue000" in default:  # a value passed through a filter
        raise ValueError(f"{where}: the Jinja score template changes the values it renders")
    return marked, default


def read_template_arg(value: str) -> tuple[str, dict[str, object]]:
    """`--score-template`: a file (JSON as score_template.json, or the template's text)
    or the template inline. Returns (text, the JSON file's other settings)."""
    path = Path(value).expanduser()
    try:
        is_file = "\n" not in value and path.is_file()
    except OSError:  # no file has such a name (too long): the template itself
        is_file = False
    if not is_file:
        return value, {}
    if path.suffix == ".json":
        settings = _read_json(path)
        return str(settings.pop("template")), settings
    return path.read_text(encoding="utf-8"), {}


def _read_json(path: Path) -> dict[str, object]:
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(settings, dict) or not isinstance(settings.get("template"), str):
        raise ValueError(f'{path}: expected a JSON object with a "template" string')
    return settings


def find_template(
    folder: Path,
    template_arg: str | None,
    tokens_arg: str | None,
    chat_template: object = None,
) -> TemplateText | None:
    """The template a model is served with: the flags first, then the folder's file, then
    its chat template where that is a score template; None when there is none.
    `--score-tokens` alone overrides the folder's tokens."""
    settings: dict[str, object] = {}
    chat = from_jinja(chat_template, "chat template") if isinstance(chat_template, str) else None
    if template_arg:
        text, settings = read_template_arg(template_arg)
        source = "--score-template"
    elif (folder / SCORE_TEMPLATE_FILE).is_file():
        settings = _read_json(folder / SCORE_TEMPLATE_FILE)
        text, source = str(settings.pop("template")), SCORE_TEMPLATE_FILE
    elif chat is not None:
        text, source = chat[0], "chat_template"
        settings = {"default_instruction": chat[1]}
    elif tokens_arg:
        raise ValueError(
            f"--score-tokens {tokens_arg!r} needs a score template: --score-template, or a "
            f"{SCORE_TEMPLATE_FILE} in the model folder"
        )
    else:
        return None
    if tokens_arg:
        tokens = parse_tokens(tokens_arg, "--score-tokens")
    else:
        raw = settings.get("tokens", DEFAULT_TOKENS)
        tokens = parse_tokens(raw, f"{source} tokens")  # type: ignore[arg-type]
    instruction = settings.get("default_instruction", "")
    if not isinstance(instruction, str):
        raise ValueError(f"{source}: default_instruction must be a string")
    if "{{" in text:  # Jinja, as vLLM's score templates
        converted = from_jinja(text, source)
        if converted is None:
            raise ValueError(
                f"{source}: this Jinja template renders no query and document from messages "
                '(vLLM\'s score templates read the roles "query" and "document")'
            )
        text, instruction = converted[0], instruction or converted[1]
    return TemplateText(text, tokens, instruction, source)


def bind_template(given: TemplateText, tokenizer: ModelTokenizer) -> ScoreTemplate:
    """The template checked against the model's tokenizer: placeholders present, and each
    score token one token of the vocabulary (else its logit is not one row of the head)."""
    prefix, body, suffix = split_template(given.text, given.source)
    ids = []
    for token in given.tokens:
        sequence = tokenizer.tokenize([token], add_special_tokens=False)[0]
        if len(sequence) != 1:
            pieces = tokenizer.tokens(sequence.input_ids)
            raise ValueError(
                f"{given.source}: score token {token!r} is {len(sequence)} tokens in this "
                f"model's vocabulary ({pieces}), not one: pick tokens the tokenizer keeps whole"
            )
        ids.append(sequence.input_ids[0])
    if ids[0] == ids[1]:
        raise ValueError(f"{given.source}: the true and false score tokens are the same token")
    fixed = tokenizer.tokenize([prefix, suffix], add_special_tokens=False)
    return ScoreTemplate(
        prefix,
        body,
        suffix,
        given.tokens[0],
        given.tokens[1],
        ids[0],
        ids[1],
        given.default_instruction,
        given.source,
        tuple(_leading_specials(tokenizer)),
        tuple(fixed[0].input_ids),
        tuple(fixed[1].input_ids),
        _runs(body, tokenizer.special_tokens()),
    )
