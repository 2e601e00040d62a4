"""CLAP (engine/families/clap) on tiny random-weight folders, with clips written by
soundfile in the tests: audio and text embeddings equal to transformers'
ClapModel.get_audio_features / get_text_features (the clip decoded whole by soundfile,
mixed to mono, resampled by soxr and cut to the extractor's length, then the folder's own
ClapFeatureExtractor), zero-shot probabilities equal to the zero-shot-audio-classification
pipeline's, text-audio scores, the fused model, and every bound refused by name."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import soundfile
import soxr
import torch
from transformers import AutoTokenizer, ClapFeatureExtractor, ClapModel, pipeline

from pooling_server.engine.errors import ErrorKind, PoolingError
from pooling_server.engine.families.clap.audio import AudioSettings, decode_audio
from pooling_server.engine.inputs.modality import Modality
from pooling_server.engine.models.loader import LoadedModel
from pooling_server.engine.requests.outputs import Classification, Embedding, ItemOutput, Score
from pooling_server.engine.requests.params import PoolingParams, Task
from pooling_server.engine.requests.plans import plan_request
from pooling_server.engine.requests.request import Audio, Image, Item, PoolRequest
from pooling_server.engine.requests.resolved import Limits
from pooling_server.engine.requests.validation import validate_request
from tests.audio_clips import clip, encode, tone
from tests.engine.planned import load, run_all
from tests.fixture_models import CLAP_PROJECTION, MINILM, tiny_clap, tiny_clip

ATOL = 1e-4
TEXTS = ["a dog barking", "rain on a roof at night, with thunder far away", "x"]
LABELS = ("dog", "rain", "siren")
# Each format at another rate and layout: resampled from 16 kHz, 44.1 kHz stereo, and
# 48 kHz (the model's own rate: not resampled); the second is longer than the clip.
CLIPS = [
    Audio(clip(0.6, 16_000, "WAV", frequency=300.0)),
    Audio(encode(tone(2.5, 44_100, 660.0, channels=2, seed=1), 44_100, "FLAC")),
    Audio(encode(tone(0.8, 48_000, 1000.0, seed=2), 48_000, "OGG")),
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("clap")
    return {"clap": tiny_clap(root / "clap"), "fused": tiny_clap(root / "fused", fusion=True)}


@pytest.fixture(scope="module")
def models(folders: dict[str, Path]) -> dict[str, LoadedModel]:
    return {name: load(folder, name) for name, folder in folders.items()}


def waveform(audio: Audio, rate: int = 48_000, seconds: float = 1.0) -> np.ndarray:
    """The reference's clip: the whole file decoded, mixed to mono, resampled, then cut."""
    import io

    samples, found = soundfile.read(io.BytesIO(audio.data), dtype="float32", always_2d=True)
    mono = samples.mean(axis=1)
    if found != rate:
        mono = soxr.resample(mono, found, rate, quality="HQ")
    return mono[: int(rate * seconds)].astype(np.float32)


class Reference:
    """transformers' ClapModel with the folder's tokenizer and feature extractor."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.model = ClapModel.from_pretrained(folder).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.extractor = ClapFeatureExtractor.from_pretrained(folder)

    @torch.inference_mode()
    def text(self, texts: Sequence[str]) -> np.ndarray:
        inputs = self.tokenizer(list(texts), padding=True, return_tensors="pt")
        return _rows(self.model.get_text_features(**inputs))

    @torch.inference_mode()
    def audio(self, clips: Sequence[Audio]) -> np.ndarray:
        rows = []
        for audio in clips:  # one clip a call, as the pipeline calls the extractor
            inputs = self.extractor(waveform(audio), sampling_rate=48_000, return_tensors="pt")
            rows.append(_rows(self.model.get_audio_features(**inputs))[0])
        return np.stack(rows)


def _rows(output: object) -> np.ndarray:
    tensor = output if isinstance(output, torch.Tensor) else output.pooler_output  # type: ignore[attr-defined]
    return tensor.float().numpy()


@pytest.fixture(scope="module")
def references(folders: dict[str, Path]) -> dict[str, Reference]:
    return {name: Reference(folder) for name, folder in folders.items()}


def embed(items: Sequence[Item]) -> PoolRequest:
    return PoolRequest(Task.EMBED, items=tuple(items))


def vectors(outputs: Sequence[ItemOutput]) -> np.ndarray:
    return np.stack([o.values for o in outputs if isinstance(o, Embedding)])


def refused(model: LoadedModel, request: PoolRequest, limits: Limits | None = None) -> PoolingError:
    limits = limits or Limits()
    with pytest.raises(PoolingError) as caught:
        plan_request(validate_request(request, model.info, limits), model, limits)
    return caught.value


def test_model_card(models: dict[str, LoadedModel]) -> None:
    info = models["clap"].info
    assert info.family == "clap"
    assert info.modalities == ("text", "audio")
    assert set(info.tasks) == {Task.EMBED, Task.SCORE, Task.CLASSIFY}
    assert info.hidden_size == CLAP_PROJECTION
    assert info.accepts_media and info.settings.family == "clap"
    assert info.settings.patches == (64 // 4) ** 2  # the audio tower's patches: a clip's cost
    assert info.settings.label_template == "This is a sound of {label}."
    assert not info.accepts_images and info.accepts_media


@pytest.mark.parametrize("name", ["clap", "fused"])
def test_embeddings_equal_the_towers_features(
    models: dict[str, LoadedModel], references: dict[str, Reference], name: str
) -> None:
    """Texts and clips of three formats mixed in one request and one forward pass: each
    row the tower's own (normalised) features, each saying what it embedded."""
    items: list[Item] = [TEXTS[0], CLIPS[0], CLIPS[1], TEXTS[1], CLIPS[2], TEXTS[2]]
    [out] = run_all(models[name], [embed(items)])
    texts, clips = references[name].text(TEXTS), references[name].audio(CLIPS)
    expected = np.stack([texts[0], clips[0], clips[1], texts[1], clips[2], texts[2]])
    np.testing.assert_allclose(vectors(out), expected, atol=ATOL)
    modalities = [o.modality for o in out]  # type: ignore[union-attr]
    text, audio = Modality.TEXT, Modality.AUDIO
    assert modalities == [text, audio, audio, text, audio, text]


def test_zero_shot_equals_the_pipeline(
    models: dict[str, LoadedModel], folders: dict[str, Path]
) -> None:
    """classify with candidate_labels: the zero-shot-audio-classification pipeline's scores
    (its default template, "This is a sound of {}."), label by label."""
    classifier = pipeline("zero-shot-audio-classification", model=str(folders["clap"]))
    request = PoolRequest(Task.CLASSIFY, items=tuple(CLIPS), candidate_labels=LABELS)
    [out] = run_all(models["clap"], [request])
    for audio, result in zip(CLIPS, out, strict=True):
        assert isinstance(result, Classification) and result.modality is Modality.AUDIO
        expected = {
            row["label"]: row["score"]
            for row in classifier(waveform(audio), candidate_labels=list(LABELS))
        }
        np.testing.assert_allclose(result.probs, [expected[label] for label in LABELS], atol=ATOL)
        assert result.label == max(expected, key=expected.__getitem__)


def test_text_audio_scores_are_cosines(
    models: dict[str, LoadedModel], references: dict[str, Reference]
) -> None:
    """score 1:N between a text and clips, and between a clip and texts."""
    reference = references["clap"]
    texts, clips = reference.text(TEXTS), reference.audio(CLIPS)
    request = PoolRequest(Task.SCORE, items_1=(TEXTS[0],), items_2=tuple(CLIPS))
    backwards = PoolRequest(Task.SCORE, items_1=(CLIPS[1],), items_2=tuple(TEXTS))
    forward, backward = run_all(models["clap"], [request, backwards])
    np.testing.assert_allclose(
        [o.value for o in forward if isinstance(o, Score)], clips @ texts[0], atol=ATOL
    )
    np.testing.assert_allclose(
        [o.value for o in backward if isinstance(o, Score)], texts @ clips[1], atol=ATOL
    )


def test_decoding_cuts_the_head_at_the_model_rate() -> None:
    """A long clip decodes only its head: as the whole file resampled, then cut."""
    audio = Audio(encode(tone(30.0, 22_050, channels=2), 22_050, "FLAC"))
    settings = AudioSettings(rate=48_000, clip_seconds=1.0)
    samples = decode_audio(audio, Limits(), "embed.items[0].audio", settings)
    assert samples.dtype == np.float32 and samples.shape == (48_000,)
    np.testing.assert_allclose(samples, waveform(audio), atol=1e-5)


def reason(error: PoolingError) -> tuple[str, str]:
    [violation] = error.violations
    return violation.field, violation.reason


BOUNDS = [
    (clip(), Limits(max_audio_bytes=1000), "AUDIO_TOO_LARGE"),
    (clip(2.0), Limits(max_audio_seconds=1.5), "AUDIO_TOO_LONG"),
    (clip(rate=44_100), Limits(max_audio_sample_rate=32_000), "AUDIO_SAMPLE_RATE_UNSUPPORTED"),
    (encode(tone(0.5, 500), 500, "WAV"), Limits(), "AUDIO_SAMPLE_RATE_UNSUPPORTED"),
    (clip(channels=3), Limits(max_audio_channels=2), "AUDIO_TOO_MANY_CHANNELS"),
    (encode(tone(0.5, 16_000), 16_000, "AIFF"), Limits(), "AUDIO_FORMAT_UNSUPPORTED"),
    (b"not audio at all", Limits(), "AUDIO_INVALID"),
    (b"", Limits(), "AUDIO_INVALID"),
    (clip()[:40], Limits(), "AUDIO_INVALID"),  # a WAV cut inside its header
]


@pytest.mark.parametrize(
    ("data", "limits", "expected"),
    BOUNDS,
    ids=lambda v: str(len(v)) if isinstance(v, bytes) else None,
)
def test_bounds_are_refused_by_name(
    models: dict[str, LoadedModel], data: bytes, limits: Limits, expected: str
) -> None:
    request = embed(["a text", Audio(data)])
    error = refused(models["clap"], request, limits)
    assert error.kind is ErrorKind.INVALID_ARGUMENT
    assert reason(error) == ("embed.items[1].audio", expected)


@pytest.mark.parametrize(
    ("mime", "expected"),
    [("audio/flac", "AUDIO_INVALID"), ("audio/mpeg", "AUDIO_FORMAT_UNSUPPORTED")],
)
def test_a_mime_type_must_agree(models: dict[str, LoadedModel], mime: str, expected: str) -> None:
    error = refused(models["clap"], embed([Audio(clip(), mime)]))
    assert reason(error) == ("embed.items[0].audio", expected)


def test_a_declared_format_that_agrees_is_served(models: dict[str, LoadedModel]) -> None:
    [out] = run_all(models["clap"], [embed([Audio(CLIPS[0].data, "audio/wav")])])
    [plain] = run_all(models["clap"], [embed([CLIPS[0]])])
    np.testing.assert_array_equal(vectors(out), vectors(plain))


def test_too_many_clips(models: dict[str, LoadedModel]) -> None:
    limits = replace(Limits(), max_audio_clips_per_request=2)
    error = refused(models["clap"], embed([CLIPS[0]] * 3), limits)
    assert reason(error) == ("embed.items", "TOO_MANY_AUDIO_CLIPS")


def test_each_modality_needs_a_model_that_takes_it(
    models: dict[str, LoadedModel], tmp_path: Path
) -> None:
    """A clip to a text model or an image model, an image to CLAP: FAILED_PRECONDITION at
    the item's path, before any decoding."""
    minilm, clip_model = load(MINILM, "minilm"), load(tiny_clip(tmp_path / "clip"), "clip")
    for model in (minilm, clip_model):
        error = refused(model, embed(["a text", Audio(b"never decoded")]))
        assert error.kind is ErrorKind.FAILED_PRECONDITION
        assert reason(error) == ("embed.items[1].audio", "MODALITY_NOT_SUPPORTED")
    error = refused(models["clap"], embed([Image(b"never decoded")]))
    assert reason(error) == ("embed.items[0].image", "MODALITY_NOT_SUPPORTED")


def test_zero_shot_needs_labels(models: dict[str, LoadedModel]) -> None:
    error = refused(models["clap"], PoolRequest(Task.CLASSIFY, items=(CLIPS[0],)))
    assert reason(error) == ("classify.candidate_labels", "CANDIDATE_LABELS_MISSING")
    assert "This is a sound of" in error.violations[0].description


def test_exports_are_refused(folders: dict[str, Path]) -> None:
    from pooling_server.engine.backends import BackendKind, BackendOptions

    with pytest.raises(ValueError, match="runs both towers on torch"):
        load(folders["clap"], backend=BackendOptions(kind=BackendKind.ONNX))


def test_modality_of_each_classification(models: dict[str, LoadedModel]) -> None:
    request = PoolRequest(
        Task.CLASSIFY, params=PoolingParams(), items=("a text", CLIPS[0]), candidate_labels=LABELS
    )
    [out] = run_all(models["clap"], [request])
    assert [o.modality for o in out] == [Modality.TEXT, Modality.AUDIO]  # type: ignore[union-attr]
