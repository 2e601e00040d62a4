"""SigLIP's slow SentencePiece tokenizer (SiglipTokenizer, shipped as `spiece.model`
alone) in a fast form, which transformers cannot convert: the towers family's converter
(Family.converters), checked against the slow one by models/model_folder.py's generic
conversion like any other. Its imports wait for the call: only a folder that needs it pays."""

from __future__ import annotations

from typing import Any


def convert_siglip(tokenizer: Any) -> Any:
    """A `tokenizers.Tokenizer` equal to the slow SiglipTokenizer `tokenizer`."""
    return siglip_converter()(tokenizer).converted()


def siglip_converter() -> type:
    """SiglipTokenizer as a fast tokenizer: its SentencePiece model (Unigram), after the
    canonicalisation SigLIP's slow tokenizer applies to every text (lower case when
    do_lower_case, ASCII punctuation removed, each run of white space one space, the ends
    stripped), each word marked with "▁", and "</s>" appended."""
    import string

    from tokenizers import Regex, normalizers, pre_tokenizers, processors
    from transformers.convert_slow_tokenizer import SpmConverter

    # Python's \s, which the slow tokenizer's re.sub(r"\s+", " ", text) matches.
    spaces = "".join(chr(c) for c in range(0x3001) if chr(c).isspace())
    space_class = "[" + "".join(f"\\x{{{ord(c):x}}}" for c in spaces) + "]+"
    punctuation = "[" + "".join(f"\\x{{{ord(c):x}}}" for c in string.punctuation) + "]"

    class SiglipConverter(SpmConverter):  # type: ignore[misc]
        def normalizer(self, proto: Any) -> Any:
            steps = [normalizers.Replace("\u2581", " ")]
            if getattr(self.original_tokenizer, "do_lower_case", True):
                steps.append(normalizers.Lowercase())
            steps += [
                normalizers.Replace(Regex(punctuation), ""),
                normalizers.Replace(Regex(space_class), " "),
                normalizers.Strip(),
            ]
            charsmap = proto.normalizer_spec.precompiled_charsmap
            if charsmap:
                steps.append(normalizers.Precompiled(charsmap))
            return normalizers.Sequence(steps)

        def pre_tokenizer(self, replacement: str, add_prefix_space: bool) -> Any:
            return pre_tokenizers.Metaspace(replacement=replacement, prepend_scheme="always")

        def post_processor(self) -> Any:
            eos = str(self.original_tokenizer.eos_token)
            eos_id = self.original_tokenizer.convert_tokens_to_ids(eos)
            return processors.TemplateProcessing(
                single=["$A", eos], pair=["$A", eos, "$B", eos], special_tokens=[(eos, eos_id)]
            )

    return SiglipConverter
