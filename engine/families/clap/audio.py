"""Audio clips: the bytes a request carries decoded within bounds, mixed to mono,
resampled to the model's rate and cut to its clip length: the waveform that the model's
feature extractor (ClapFeatureExtractor, run beside the model) turns into mel features.

Front ends run this on their intake threads and hold neither torch nor transformers:
libsndfile decodes (soundfile; WAV, FLAC and OGG with Vorbis or Opus), libsoxr resamples
(soxr, its high-quality setting, as `datasets`' Audio feature resamples through librosa).

Decoding refuses before it spends: bytes over the limit before opening; a header claiming
more channels, a sample rate out of range or a longer duration than the limits before a
sample is decoded. Only the first clip length (plus the resampler's margin) is ever
decoded, a block at a time mixed to mono, so a long or many-channel file costs no more
memory than one clip. The extractor would take three random crops of a longer clip (its
"fusion") or one random crop ("rand_trunc"); serving cuts the head, so that an answer
depends on the request alone.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from pooling_server.engine.inputs.encoded import MediaKind, check_encoded, refuse
from pooling_server.engine.inputs.modality import Frame

if TYPE_CHECKING:
    from pooling_server.engine.requests.resolved import Limits


class EncodedAudio(Protocol):
    """An audio clip as a request carries it (engine.requests.request.Audio): encoded
    bytes, and the mime type the client gave ("" for none)."""

    @property
    def data(self) -> bytes: ...

    @property
    def mime_type(self) -> str: ...


# Our format name -> the mime types a client may name it by.
FORMATS: dict[str, tuple[str, ...]] = {
    "WAV": ("audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave"),
    "FLAC": ("audio/flac", "audio/x-flac"),
    "OGG": ("audio/ogg", "audio/opus", "audio/vorbis", "application/ogg"),
}
MIME_FORMATS = {mime: name for name, mimes in FORMATS.items() for mime in mimes}
SUPPORTED = "WAV, FLAC or OGG"
READS_AS = {"WAV": ("WAV", "WAVEX"), "FLAC": ("FLAC",), "OGG": ("OGG",)}  # libsndfile's names
MIN_SAMPLE_RATE = 1000  # below this no header is a real recording
BLOCK = 65_536  # frames decoded at a time: many channels never sit in memory at full length


def sniff(data: bytes) -> str | None:
    """The supported format the bytes begin as, from their signature; None: none of them."""
    if data[:4] in (b"RIFF", b"RIFX") and data[8:12] == b"WAVE":
        return "WAV"
    if data[:4] == b"fLaC":
        return "FLAC"
    if data[:4] == b"OggS":
        return "OGG"
    return None


def mime_type_of(format_name: str) -> str:
    """The mime type a door names a format by (OpenAI's input_audio `format`: "wav")."""
    name = format_name.strip().upper()
    return FORMATS[name][0] if name in FORMATS else f"audio/{format_name.strip().lower()}"


@dataclass(frozen=True)
class AudioSettings:
    """What the model's feature extractor expects, read from the folder's
    preprocessor_config.json: its sample rate and its clip length."""

    rate: int = 48_000
    clip_seconds: float = 10.0

    @property
    def samples(self) -> int:
        return int(self.rate * self.clip_seconds)


def read_settings(folder: Path) -> AudioSettings | None:
    """The feature extractor's rate and clip length; None where the folder has none."""
    config = _extractor_config(folder)
    if config is None:
        return None
    return AudioSettings(
        rate=int(config.get("sampling_rate", AudioSettings.rate)),
        clip_seconds=float(config.get("max_length_s", AudioSettings.clip_seconds)),
    )


def _extractor_config(folder: Path) -> dict[str, Any] | None:
    """transformers' preprocessor_config.json, or the "feature_extractor" entry of the
    processor_config.json that a ClapProcessor saves."""
    for name in ("preprocessor_config.json", "processor_config.json"):
        if (folder / name).is_file():
            config = json.loads((folder / name).read_text())
            nested = config.get("feature_extractor")
            return dict(nested if isinstance(nested, dict) else config)
    return None


def decode_audio(
    audio: EncodedAudio, limits: Limits, path: str, settings: AudioSettings
) -> np.ndarray:
    """The clip as float32 mono samples at `settings.rate`, at most `settings.samples` of
    them (its head).

    Refused (INVALID_ARGUMENT, the violation at `path`): AUDIO_TOO_LARGE for bytes over
    `limits.max_audio_bytes`; AUDIO_TOO_LONG for a duration over `limits.max_audio_seconds`,
    AUDIO_TOO_MANY_CHANNELS for more than `limits.max_audio_channels`,
    AUDIO_SAMPLE_RATE_UNSUPPORTED for a rate outside [1000, `limits.max_audio_sample_rate`]
    Hz, all read from the header before decoding; AUDIO_FORMAT_UNSUPPORTED for a format
    other than WAV, FLAC or OGG (by the bytes, or by the mime type given); AUDIO_INVALID
    for bytes that do not decode (corrupt, truncated, empty, no samples) or a mime type the
    bytes disagree with."""
    import soundfile  # libsndfile: loaded where audio is served

    data = audio.data
    found = check_encoded(AUDIO, data, audio.mime_type, path, limits.max_audio_bytes)
    try:
        opened = soundfile.SoundFile(io.BytesIO(data))
    except (soundfile.LibsndfileError, RuntimeError, ValueError, TypeError) as error:
        raise refuse(path, "AUDIO_INVALID", f"the {found} data does not decode") from error
    with opened:
        if opened.format not in READS_AS[found]:  # libsndfile read it as something else
            raise refuse(path, "AUDIO_INVALID", f"the {found} data does not decode")
        rate, channels, frames = opened.samplerate, opened.channels, opened.frames
        _check_header(path, limits, rate, channels, frames)
        # The head the clip needs, and a margin for the resampler's filter at its end.
        wanted = min(frames, math.ceil(settings.samples * rate / settings.rate) + 4096)
        try:
            mono = _read_mono(opened, wanted)
        except (soundfile.LibsndfileError, RuntimeError, ValueError) as error:
            raise refuse(
                path, "AUDIO_INVALID", f"the {found} data is corrupt or truncated"
            ) from error
    if not len(mono):
        raise refuse(path, "AUDIO_INVALID", "the audio has no samples")
    if not np.isfinite(mono).all():
        raise refuse(path, "AUDIO_INVALID", "the audio holds samples that are not finite")
    if rate != settings.rate:
        import soxr  # libsoxr: loaded where audio is served

        mono = soxr.resample(mono, rate, settings.rate, quality="HQ").astype(np.float32)
    return np.ascontiguousarray(mono[: settings.samples], dtype=np.float32)


def _check_header(path: str, limits: Limits, rate: int, channels: int, frames: int) -> None:
    if channels > limits.max_audio_channels:
        raise refuse(
            path,
            "AUDIO_TOO_MANY_CHANNELS",
            f"the audio has {channels} channels, more than {limits.max_audio_channels} "
            "(--max-audio-channels)",
        )
    if channels < 1:
        raise refuse(path, "AUDIO_INVALID", "the audio has no channels")
    if not MIN_SAMPLE_RATE <= rate <= limits.max_audio_sample_rate:
        raise refuse(
            path,
            "AUDIO_SAMPLE_RATE_UNSUPPORTED",
            f"the audio's sample rate is {rate} Hz; send {MIN_SAMPLE_RATE} to "
            f"{limits.max_audio_sample_rate} Hz (--max-audio-sample-rate)",
        )
    seconds = frames / rate
    if seconds > limits.max_audio_seconds:
        raise refuse(
            path,
            "AUDIO_TOO_LONG",
            f"the audio lasts {seconds:.1f} s, more than {limits.max_audio_seconds:g} s "
            "(--max-audio-seconds)",
        )


def _read_mono(opened: Any, wanted: int) -> np.ndarray:
    """The first `wanted` frames, each the mean of its channels (as ffmpeg's and librosa's
    downmix), decoded a block at a time."""
    mono = np.empty(wanted, dtype=np.float32)
    filled = 0
    while filled < wanted:
        block = opened.read(min(BLOCK, wanted - filled), dtype="float32", always_2d=True)
        if not len(block):
            break  # the header claimed more frames than the data holds
        mono[filled : filled + len(block)] = block.mean(axis=1)
        filled += len(block)
    return mono[:filled]


def _other_format(data: bytes) -> str | None:
    """The name of an audio format libsndfile knows but we do not serve (for the message)."""
    import soundfile

    try:
        return str(soundfile.info(io.BytesIO(data)).format)
    except Exception:  # anything unreadable is simply not a format libsndfile knows
        return None


AUDIO = MediaKind(
    noun="audio",
    reasons="AUDIO",
    flag="--max-audio-bytes",
    mime_formats=MIME_FORMATS,
    supported=SUPPORTED,
    sniff=sniff,
    other_format=_other_format,
    unserved="{format} audio is not supported",
    what="audio",
)


class AudioFrames:
    """A CLAP model's FrameMaker (engine/families/towers/towers.py): each clip decoded
    within the limits, one at a time, into a Frame of its samples that costs `cost` (the
    audio tower's patch count) in a batch."""

    def __init__(self, settings: AudioSettings, cost: int) -> None:
        self.settings = settings
        self.cost = cost

    def frames(self, items: list[tuple[int, Any]], limits: Limits, path: str) -> list[Frame]:
        return [
            Frame(decode_audio(audio, limits, f"{path}[{i}].audio", self.settings), self.cost)
            for i, audio in items
        ]

    def blank(self) -> Frame:
        """A clip of silence, for warming the audio tower up."""
        return Frame(np.zeros(self.settings.samples, dtype=np.float32), self.cost)
