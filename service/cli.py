"""`pooling-server`'s flags: the parser, group by group (a default that the config
dataclasses of service/ops/config.py hold is taken from them), the POOLING_ environment
variables that stand for flags, the flag types, and `config_from_args`: flags -> a
ServerConfig. service/launch.py starts the server they describe."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from pooling_server.engine.backends import BackendKind, BackendOptions, Quantize
from pooling_server.engine.caching.cache import CacheSettings
from pooling_server.engine.models.model_info import LongInput, PoolingType
from pooling_server.engine.models.model_spec import DEFAULT_MODEL, ModelSpec
from pooling_server.engine.requests.output_size import MIB, ResponseBudget
from pooling_server.engine.requests.resolved import Limits
from pooling_server.engine.scheduling.batch_queue import BatchConfig, default_client_cap
from pooling_server.engine.scheduling.remote_client import DEFAULT_STALL_S
from pooling_server.service.ops import event_loop
from pooling_server.service.ops.config import (
    BatchJobOptions,
    HttpLimits,
    RayJobOptions,
    ServerConfig,
    TlsConfig,
    TransportConfig,
    load_keys,
)
from pooling_server.service.split import layout

Group = argparse._ArgumentGroup  # what add_argument_group returns

PER_MODEL = "Give it once for every model, or once per --model in the same order."


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {value}")
    return value


def frontend_count(text: str) -> int | str:
    """`--frontends`: auto, or a whole number of zero or more."""
    if text == layout.AUTO:
        return text
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be auto, 0 (one process) or more, not {value}")
    return value


def engine_count(text: str) -> int | str:
    """`--engines-per-device`: auto, or a positive whole number."""
    return text if text == layout.AUTO else positive_int(text)


def fraction(text: str) -> float:
    """A number from 0 to 1."""
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be from 0 to 1, not {value}")
    return value


def count(text: str) -> int:
    """A whole number of zero or more (0 is "no limit" where a flag says so)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, not {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """Every flag of `pooling-server`, group by group; `pooling-server batch` adds its own."""
    parser = argparse.ArgumentParser(
        prog="pooling-server",
        description="Serve vLLM-style pooling (embed, classify, score, token_embed, "
        "token_classify, embed_sparse) for Hugging Face encoder models over gRPC.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Every flag can also come from the environment: POOLING_ and the flag's name in "
        "capitals with underscores (POOLING_MODEL, POOLING_PORT, POOLING_MAX_BATCH_SIZE). A "
        "flag given on the command line wins; a repeatable flag takes a comma-separated list; "
        "a switch is on for 1, true, yes or on.",
    )
    net = parser.add_argument_group("network")
    _listen_flags(net)
    _http_flags(net)
    _http_limit_flags(net)
    _transport_flags(net)
    _security_flags(parser.add_argument_group("security"))
    observe = parser.add_argument_group("observability")
    _observability_flags(observe)
    models = parser.add_argument_group("models")
    _model_flags(models)
    _model_config_flags(models)
    _device_flags(models)
    _backend_flags(models)
    _repository_flags(models)
    _batching_flags(parser.add_argument_group("limits and batching"))
    _cache_flags(parser.add_argument_group("result cache (docs/cache.md)"))
    life = parser.add_argument_group("lifecycle")
    _process_flags(life)
    _split_role_flags(life)
    _shutdown_flags(life)
    # Last, as it always was, so that the usage line keeps its order.
    observe.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    return parser


def _listen_flags(net: Group) -> None:
    """Where the gRPC and metrics ports listen, and gRPC's message cap."""
    net.add_argument(
        "--host", default=ServerConfig.host, help="address to listen on (0.0.0.0: all)"
    )
    net.add_argument(
        "--port", type=int, default=ServerConfig.port, help="gRPC port (0: any free port)"
    )
    net.add_argument(
        "--max-message-mb",
        type=positive_int,
        default=ServerConfig.max_message_bytes // MIB,
        help="largest request or response message, after decompression (default 16: a full "
        "request of --max-request-chars in any script fits)",
    )

    net.add_argument(
        "--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port"
    )
    net.add_argument(
        "--metrics-host", default=ServerConfig.metrics_host, help="address for the metrics port"
    )


def _http_flags(net: Group) -> None:
    """The HTTP door (OpenAI, TEI, Cohere routes): its port, Cohere's prompts, answer cap."""
    net.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="also serve the HTTP API on this port (--host): OpenAI /v1/embeddings, "
        "/v1/rerank, /v1/score, /pooling, /classify, /v1/models, /health; TEI's /embed, "
        "/rerank, /predict, /info ...; Cohere's /v2/embed and /v2/rerank",
    )
    net.add_argument(
        "--cohere-input-type-prompt",
        action="append",
        default=[],
        metavar="TYPE=PROMPT_NAME",
        type=type_equals_prompt,
        help="HTTP /v2/embed: the model prompt an input_type takes, tried before the defaults "
        "(search_query: query; search_document: document, passage; classification; "
        "clustering); repeatable, e.g. search_query=retrieval",
    )
    net.add_argument(
        "--max-http-response-mb",
        type=positive_int,
        default=ServerConfig.max_http_response_bytes // MIB,
        help="HTTP: largest response body; a request whose JSON answer would be larger is "
        "refused (400 OUTPUT_TOO_LARGE) before any work (default 64: JSON floats take about "
        "five times their protobuf size, so about what --max-message-mb allows over gRPC)",
    )


def _http_limit_flags(net: Group) -> None:
    """The HTTP door's connection limits: slow headers and bodies, idle keep-alive, counts."""
    http = HttpLimits()
    net.add_argument(
        "--http-header-timeout-s",
        type=positive_float,
        default=http.header_timeout_s,
        help="HTTP: close a connection whose request headers are not complete this long after "
        "it opened, or after the first byte of a later request (answers 408)",
    )
    net.add_argument(
        "--http-body-timeout-s",
        type=positive_float,
        default=http.body_timeout_s,
        help="HTTP: every window this long must bring --http-body-min-bytes-per-s times as "
        "many body bytes until the body is complete, else 408 and close; also the longest "
        "wait for a turn to read (see --http-max-concurrent-bodies)",
    )
    net.add_argument(
        "--http-body-min-bytes-per-s",
        type=positive_int,
        default=http.body_min_bytes_per_s,
        help="HTTP: the slowest body accepted, in bytes per second",
    )
    net.add_argument(
        "--http-keepalive-timeout-s",
        type=positive_float,
        default=http.keepalive_timeout_s,
        help="HTTP: close a keep-alive connection idle this long (above the 60 s idle timeout "
        "of common load balancers, so they close first)",
    )
    net.add_argument(
        "--http-max-connections",
        type=positive_int,
        default=http.max_connections,
        help="HTTP: open connections per process; beyond, a new one is answered 503 and closed "
        "at once. Never more than half the open-file limit",
    )
    net.add_argument(
        "--http-max-connections-per-address",
        type=count,
        default=http.max_connections_per_address,
        help="HTTP: open connections one client address may hold, per process (0, the "
        "default: a quarter of --http-max-connections); beyond, answered 503 and closed",
    )
    net.add_argument(
        "--http-max-concurrent-bodies",
        type=positive_int,
        default=http.max_concurrent_bodies,
        help="HTTP: request bodies read at once per process (a partial body is memory held: "
        "at most this many times --max-message-mb); bodies already whole need no turn",
    )


def _transport_flags(net: Group) -> None:
    """gRPC connections: keepalive pings, streams per connection, age and compression."""
    net.add_argument(
        "--keepalive-time-s",
        type=float,
        default=TransportConfig.keepalive_time_s,
        help="server ping interval",
    )
    net.add_argument(
        "--keepalive-timeout-s",
        type=float,
        default=TransportConfig.keepalive_timeout_s,
        help="close if a ping is unanswered",
    )
    net.add_argument(
        "--no-keepalive-permit-without-calls",
        dest="keepalive_permit_without_calls",
        action="store_false",
        help="refuse client keepalive pings on connections with no active call",
    )
    net.add_argument(
        "--min-client-ping-interval-s",
        type=float,
        default=TransportConfig.min_client_ping_interval_s,
        help="accept client pings this often (mesh sidecars ping; too strict a value makes "
        "the server answer GOAWAY too_many_pings)",
    )
    net.add_argument(
        "--max-concurrent-streams",
        type=int,
        default=TransportConfig.max_concurrent_streams,
        help="concurrent calls per connection (0: unlimited; default 4096: above any real "
        "client's burst, below what lets one connection hold the server's memory)",
    )
    net.add_argument(
        "--max-open-calls",
        type=count,
        default=TransportConfig.max_open_calls,
        help="gRPC calls open at once per front end over all its connections, their requests "
        "arrived or not (0: no limit); past it a new call is RESOURCE_EXHAUSTED at once, so "
        "streams opened and never ended cannot hold the server's memory",
    )
    net.add_argument(
        "--max-connection-age-s",
        type=float,
        default=TransportConfig.max_connection_age_s,
        help="close connections after this long (with GOAWAY) so clients rebalance across "
        "replicas and no connection lives forever (0: never; default 1800)",
    )
    net.add_argument(
        "--max-connection-age-grace-s",
        type=float,
        default=TransportConfig.max_connection_age_grace_s,
        help="time given to calls on a connection closed for age",
    )
    net.add_argument(
        "--max-connections",
        type=positive_int,
        default=TransportConfig.max_connections,
        help="gRPC connections open at once, per front end, and never more than a quarter "
        "of the open-file limit; gRPC core closes new ones past it",
    )
    net.add_argument(
        "--max-connections-per-address",
        type=count,
        default=TransportConfig.max_connections_per_address,
        help="gRPC connections one client address may hold, per front end (0, the default: "
        "a quarter of --max-connections); past it a new one is closed as it is accepted. "
        "Node door only: gRPC core accepts grpcio's connections where Python cannot see them",
    )
    net.add_argument(
        "--max-unsent-answer-mb",
        type=positive_int,
        default=TransportConfig.max_unsent_answer_bytes >> 20,
        help="answers handed to HTTP/2 and not yet read by their clients, per front end over "
        "all gRPC connections (one connection: a quarter of it, at least twice "
        "--max-message-mb); past it a large answer is RESOURCE_EXHAUSTED rather than held",
    )
    net.add_argument(
        "--handshake-timeout-s",
        type=positive_float,
        default=TransportConfig.handshake_timeout_s,
        help="close a gRPC connection that has not begun HTTP/2 (and TLS) within this time; "
        "on the Node door also one that has opened no call this long after, and end a "
        "call whose request has not come (on grpcio too) DEADLINE_EXCEEDED",
    )
    net.add_argument(
        "--max-connection-idle-s",
        type=float,
        default=TransportConfig.max_connection_idle_s,
        help="send GOAWAY to a connection with no call for this long; clients reconnect "
        "on their next call (0: never; default 300)",
    )
    net.add_argument(
        "--max-concurrent-reads",
        type=count,
        default=TransportConfig.max_concurrent_reads,
        help="gRPC request messages read at once per front end (0: no limit); a read holds "
        "about three times its message, and a message waiting its turn at most 4 MiB",
    )
    net.add_argument(
        "--read-turn-s",
        type=positive_float,
        default=TransportConfig.read_turn_s,
        help="the longest a gRPC message read keeps its turn: a slower one reads on without "
        "it, so slow senders cannot hold up other calls",
    )
    net.add_argument(
        "--grpc-door",
        default="auto",
        choices=["auto", "grpcio", "node"],
        help="what serves gRPC's HTTP/2: Node.js's server (20 or newer on PATH) in a child "
        "process, which takes gRPC's per-call work off this process's GIL, or grpcio's "
        "asyncio server in this process; auto: node where Node.js is on PATH, else grpcio "
        "(README: the Node.js door)",
    )
    net.add_argument(
        "--gzip-responses",
        action="store_true",
        help="compress responses (gzip-compressed requests are always accepted)",
    )


def _security_flags(security: Group) -> None:
    """TLS and the API keys every door checks."""
    security.add_argument("--tls-cert", help="PEM certificate chain: serve TLS")
    security.add_argument("--tls-key", help="PEM private key for --tls-cert")
    security.add_argument(
        "--tls-client-ca", help="PEM CA bundle: require client certificates (mutual TLS)"
    )
    security.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="accept `authorization: Bearer KEY` on PoolingService (repeatable); health and "
        "reflection stay open",
    )
    security.add_argument("--api-key-file", help="a file of accepted keys, one per line")
    security.add_argument(
        "--admin-key",
        action="append",
        default=[],
        help="accept `authorization: Bearer KEY` on the ModelRepository service and the "
        "/v2/repository routes, which load and unload models (repeatable; --api-key does not "
        "open them). Without one they are not served (docs/model-repository.md)",
    )


def _cache_flags(cache: Group) -> None:
    """The result cache: per-item outputs kept in memory and, optionally, a shared Redis."""
    cache.add_argument(
        "--cache-mb",
        type=count,
        default=0,
        help="keep computed outputs in an in-memory LRU of this many MiB per engine process; "
        "0: no memory tier",
    )
    cache.add_argument(
        "--cache-redis",
        default="",
        metavar="URL",
        help="share outputs through this Redis (redis://host:port/db, rediss:// for TLS); "
        "unreachable or slow, the server serves without it",
    )
    cache.add_argument(
        "--cache-redis-ttl-s", type=positive_int, default=86400, help="entries' TTL in Redis"
    )
    cache.add_argument(
        "--cache-redis-timeout-ms",
        type=positive_float,
        default=5.0,
        help="a Redis call past this is a miss (the tier is skipped for 1 s after a failure)",
    )
    cache.add_argument(
        "--cache-redis-mb",
        type=count,
        default=0,
        help="set Redis's maxmemory to this many MiB, evicting least recently used keys; "
        "0: leave the Redis server's own bound",
    )
    cache.add_argument(
        "--cache-scope",
        choices=["key", "shared"],
        default="key",
        help="with --api-key: each key reads only its own entries (key), or all keys share "
        "them (shared)",
    )


def _observability_flags(observe: Group) -> None:
    """Traces and log lines (--log-level is added last: see build_parser)."""
    observe.add_argument(
        "--otlp-endpoint", help="export OpenTelemetry traces over OTLP/gRPC to this endpoint"
    )
    observe.add_argument("--log-format", default="text", choices=["text", "json"])
    observe.add_argument(
        "--log-inputs", action="store_true", help="include input texts in request log lines"
    )
    observe.add_argument(
        "--log-requests",
        action="store_true",
        help="log one line per request at INFO (default: only failed requests, and every "
        "request at --log-level debug)",
    )


def _model_flags(models: Group) -> None:
    """Which models load, their pooling, and how each treats long inputs (per model)."""
    models.add_argument(
        "--model",
        action="append",
        metavar="[NAME=]PATH_OR_ID",
        help=f"a model folder or hub id, optionally served as NAME; repeat to serve several "
        f"(the first is the default). Default: {DEFAULT_MODEL}, embedded, offline",
    )
    models.add_argument(
        "--adapter",
        action=_AdapterAction,
        default=[],
        metavar="NAME=PATH",
        help="a PEFT LoRA adapter folder served on the --model given before it (before any "
        "--model: the default model); a request picks it by NAME, as its model or as "
        "params.adapter. Repeat for several. The model then runs on torch "
        "(docs/model-repository.md, LoRA adapters)",
    )
    models.add_argument(
        "--pooling-type",
        action="append",
        choices=["auto", PoolingType.MEAN, PoolingType.CLS, PoolingType.LAST, PoolingType.SPLADE],
        help="the pooling method for embed; auto: the sentence-transformers config, else CLS "
        "for encoders and LAST for decoders. splade: embed_sparse on a *ForMaskedLM model "
        "(max over tokens of log(1 + relu(logits))). " + PER_MODEL,
    )
    models.add_argument(
        "--truncation-side",
        action="append",
        choices=["left", "right"],
        help="which end truncation cuts, by truncate_prompt_tokens or --long-input truncate "
        "(default right). " + PER_MODEL,
    )
    models.add_argument(
        "--long-input",
        action="append",
        choices=[mode.value for mode in LongInput],
        help="texts over the maximum length when a request sets no truncate_prompt_tokens: "
        "reject them; split them into chunks pooled and averaged by token count; or truncate "
        "them to the maximum (at the --truncation-side end, as sentence-transformers does) "
        "(default reject). " + PER_MODEL,
    )
    models.add_argument(
        "--max-input-chars",
        action="append",
        type=positive_int,
        help="the most characters of one text, checked before tokenizing (default: 64 per "
        "token of the model's maximum length, 1024 per token where the text may be "
        "truncated or chunked). " + PER_MODEL,
    )


def _model_config_flags(models: Group) -> None:
    """How each model's folder is read: config overrides, default prompt, hub revision,
    and whether its own modeling code may run."""
    models.add_argument(
        "--hf-overrides",
        action="append",
        metavar="JSON",
        help="settings applied over the model config, e.g. '{\"is_matryoshka\": true}' or "
        "'{\"matryoshka_dimensions\": [128, 256]}'. " + PER_MODEL,
    )
    models.add_argument(
        "--default-prompt-name",
        action="append",
        metavar="NAME",
        help="the prompt prepended when a request names none: one of the model's prompts "
        "(config_sentence_transformers.json), overriding its default_prompt_name; '' for "
        "none, auto for the folder's own (the default). " + PER_MODEL,
    )
    models.add_argument(
        "--score-template",
        action="append",
        metavar="FILE_OR_TEMPLATE",
        help="serve a decoder LM (Qwen3, Gemma, Llama) as an LLM reranker: a template with "
        "{query}, {document} and optionally {instruction} (the request's prompt, Rerank's "
        "instruction), or a vLLM Jinja score template, inline or in a file (JSON as the "
        "folder's score_template.json: template, tokens, default_instruction); '' for the "
        "folder's own score_template.json or score chat template (the default). " + PER_MODEL,
    )
    models.add_argument(
        "--score-tokens",
        action="append",
        metavar="TRUE,FALSE",
        help="the LLM reranker's two tokens, true then false, each one token of the vocabulary "
        "(default: the template file's tokens, else yes,no); the score is sigmoid(logit(TRUE) "
        "- logit(FALSE)) at the last position. " + PER_MODEL,
    )
    models.add_argument(
        "--label-template",
        action="append",
        metavar="TEMPLATE",
        help="an image model's (CLIP, SigLIP) zero-shot prompt: each candidate label replaces "
        '"{label}" when a classify request gives no label_template (default "a photo of a '
        '{label}."); ignored by text models. ' + PER_MODEL,
    )
    models.add_argument(
        "--revision",
        action="append",
        help="the hub branch, tag or commit of a hub model ('' or unset: the default "
        "branch); ignored for local folders. " + PER_MODEL,
    )
    models.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let models run the modeling code they ship with (config.json auto_map), as "
        "nomic, jina and gte models need; only for models whose source you trust",
    )


def _device_flags(models: Group) -> None:
    """Where the forward runs: device, dtype, CUDA graphs and torch's threads."""
    models.add_argument("--device", default=ServerConfig.device, choices=["auto", "cpu", "cuda"])
    models.add_argument(
        "--dtype",
        default=ServerConfig.dtype,
        choices=["auto", "float32", "float16", "bfloat16"],
        help="auto: float32 on CPU, bfloat16 on a GPU that supports it, else float16",
    )
    models.add_argument(
        "--cuda-graphs",
        default="on",
        choices=["on", "off"],
        help="on: the torch forward is captured at start-up as CUDA graphs for bucketed "
        "shapes (batch sizes 1, 2, 4, ... x padded lengths 16, 32, ... 512) and replayed, "
        "other shapes run eagerly; capture time and memory are logged. Only on a CUDA "
        "device with the torch backend; off: always eager",
    )
    models.add_argument(
        "--torch-threads",
        type=positive_int,
        default=None,
        help="cores the forward passes may use (default: every CPU this process may run "
        "on; in a container give its CPU limit). On CPU a lone pass takes them all and "
        "concurrent passes share them",
    )


def _backend_flags(models: Group) -> None:
    """What runs the transformer's forward (torch, ONNX Runtime, OpenVINO) and its exports."""
    models.add_argument(
        "--backend",
        action="append",
        choices=[kind.value for kind in BackendKind],
        help="what runs the transformer's forward: torch; onnx (ONNX Runtime) or openvino, "
        "float32 on the CPU, exported at load and cached; auto (the default): openvino on "
        "the CPU when its outputs match torch within cosine 0.9999, else onnx, else torch "
        "(logged); torch on a GPU. " + PER_MODEL,
    )
    models.add_argument(
        "--backend-file",
        action="append",
        metavar="PATH",
        help="an export shipped in the model folder, relative to it, served as it is: "
        "onnx/model.onnx, onnx/model_qint8_avx512_vnni.onnx, openvino/openvino_model.xml "
        "(as sentence-transformers saves them); '' for none. " + PER_MODEL,
    )
    models.add_argument(
        "--quantize",
        action="append",
        choices=["none", Quantize.INT8.value],
        help="int8: on onnx, dynamic quantization (no data needed); on openvino, static "
        "quantization calibrated on --calibration-file. " + PER_MODEL,
    )
    models.add_argument(
        "--calibration-file",
        action="append",
        metavar="PATH",
        help="openvino --quantize int8: UTF-8 texts, one per line, to calibrate on (default: "
        "about 200 varied sentences shipped with the server). " + PER_MODEL,
    )
    models.add_argument(
        "--backend-cache-dir",
        default=None,
        help="where onnx and openvino exports are cached, keyed by the model's files, the "
        "backend's version and the settings (default: ~/.cache/pooling-server/backends, or "
        "under $XDG_CACHE_HOME)",
    )
    models.add_argument(
        "--intra-op-threads",
        type=positive_int,
        default=None,
        help="threads of the onnx and openvino forward (default: --torch-threads, else every "
        "CPU this process may use)",
    )
    models.add_argument(
        "--attn-implementation",
        default=None,
        help="transformers attention implementation (default: the fastest available, sdpa)",
    )


def _repository_flags(models: Group) -> None:
    """Models loaded and unloaded at run time (service/repository.py)."""
    models.add_argument(
        "--model-repository",
        metavar="DIR_OR_FILE",
        help="models that load on demand when a request names them: a folder of model "
        "folders (each served by its folder's name), or a JSON or YAML file mapping names to "
        "folders or hub ids (or to {source, options})",
    )
    models.add_argument(
        "--max-loaded-models",
        type=count,
        default=0,
        help="the most models loaded at once; loading one more evicts the least recently "
        "used model with no call in flight (--model models are never evicted). 0: no bound",
    )
    models.add_argument(
        "--model-memory-gb",
        type=positive_float,
        help="the memory the loaded models' weights may take, in GB; loading past it evicts "
        "as --max-loaded-models does. Unset: no bound",
    )
    models.add_argument(
        "--failed-load-ttl-s",
        type=positive_float,
        default=30.0,
        help="how long a model that failed to load is refused at once (MODEL_LOAD_FAILED) "
        "before a request may try it again",
    )


def _batching_flags(batching: Group) -> None:
    """Request limits and the batching queues' sizes and waits."""
    batching.add_argument(
        "--max-client-batch-size",
        type=positive_int,
        default=Limits.max_client_batch_size,
        help="most inputs in one request",
    )
    batching.add_argument(
        "--max-request-chars",
        type=positive_int,
        default=Limits.max_request_chars,
        help="the most characters of all texts in one request together (default %(default)s)",
    )
    batching.add_argument(
        "--max-image-bytes",
        type=positive_int,
        default=Limits.max_image_bytes,
        help="the most encoded bytes of one image (default %(default)s: 20 MiB); more is "
        "refused (IMAGE_TOO_LARGE) before decoding",
    )
    batching.add_argument(
        "--max-image-pixels",
        type=positive_int,
        default=Limits.max_image_pixels,
        help="the most pixels (width x height) of one image, read from its header: a larger "
        "one (a decompression bomb) is refused (IMAGE_TOO_LARGE) before it is decoded "
        "(default %(default)s)",
    )
    batching.add_argument(
        "--max-images-per-request",
        type=positive_int,
        default=Limits.max_images_per_request,
        help="the most images in one request (TOO_MANY_IMAGES; default %(default)s)",
    )
    # Audio clips (CLAP models): each bound read from the bytes or the header, before decoding.
    batching.add_argument(
        "--max-audio-bytes",
        type=positive_int,
        default=Limits.max_audio_bytes,
        help="the most encoded bytes of one audio clip (default %(default)s: 20 MiB); more is "
        "refused (AUDIO_TOO_LARGE) before decoding",
    )
    batching.add_argument(
        "--max-audio-seconds",
        type=positive_float,
        default=Limits.max_audio_seconds,
        help="the longest audio clip, by its header (AUDIO_TOO_LONG; default %(default)s); "
        "a clip longer than the model's (CLAP: 10 s) is cut to its head",
    )
    batching.add_argument(
        "--max-audio-sample-rate",
        type=positive_int,
        default=Limits.max_audio_sample_rate,
        help="the highest sample rate of an audio clip, in Hz (AUDIO_SAMPLE_RATE_UNSUPPORTED "
        "above it or under 1000; default %(default)s)",
    )
    batching.add_argument(
        "--max-audio-channels",
        type=positive_int,
        default=Limits.max_audio_channels,
        help="the most channels of an audio clip, mixed to mono (AUDIO_TOO_MANY_CHANNELS; "
        "default %(default)s)",
    )
    batching.add_argument(
        "--max-audio-clips-per-request",
        type=positive_int,
        default=Limits.max_audio_clips_per_request,
        help="the most audio clips in one request (TOO_MANY_AUDIO_CLIPS; default %(default)s)",
    )
    batching.add_argument(
        "--max-batch-tokens",
        type=positive_int,
        default=BatchConfig.max_batch_tokens,
        help="padded tokens per forward batch",
    )
    batching.add_argument(
        "--max-batch-size",
        type=positive_int,
        default=None,
        help="sequences per batch (default: 32 on CPU, where bigger batches gain nothing and "
        "keep clients in lockstep; 256 on a GPU)",
    )
    batching.add_argument(
        "--forward-workers",
        type=positive_int,
        default=None,
        help="threads running forward passes per model (default 2). Worker k runs only while "
        "workers 0..k-1 are busy and a full batch waits: on CPU a pass with nothing beside it "
        "and nothing waiting takes every core, and passes side by side share them; on a GPU "
        "one batch is prepared while the other runs",
    )
    batching.add_argument(
        "--tokenizer-threads",
        type=positive_int,
        default=ServerConfig.tokenizer_threads,
        help="threads that tokenize requests and queue them, each with its own tokenizer "
        "(default 1: each takes every request waiting at once)",
    )
    batching.add_argument(
        "--batch-wait-ms", type=float, default=0.0, help="wait this long for a batch to fill"
    )
    batching.add_argument(
        "--min-padding-efficiency",
        type=fraction,
        default=BatchConfig.min_padding_efficiency,
        help="a batch takes texts of similar length (around its oldest waiting one, so long "
        "texts are not starved) and grows only while real tokens / padded tokens stays at "
        "or above this (default 0.9)",
    )
    batching.add_argument(
        "--max-queued-items",
        type=positive_int,
        default=BatchConfig.max_queued_items,
        help="queue bound per model",
    )
    batching.add_argument(
        "--max-queued-items-per-client",
        type=positive_int,
        default=None,
        help="queued items per model one client may hold: a gRPC connection, or an HTTP client "
        "address; beyond it that client gets QUEUE_FULL while others go on (default: a quarter "
        "of --max-queued-items, but at least --max-client-batch-size, or the whole queue if "
        "smaller)",
    )
    batching.add_argument(
        "--max-stream-inflight",
        type=positive_int,
        default=ServerConfig.max_stream_inflight,
        help="unanswered inputs per stream",
    )


def _process_flags(life: Group) -> None:
    """How many front-end and engine processes the server runs."""
    life.add_argument(
        "--frontends",
        type=frontend_count,
        default=layout.AUTO,
        help="front-end processes sharing --port (SO_REUSEPORT), beside the engine processes "
        "that batch for all of them; each front end parses, validates, tokenizes and "
        "answers. 0: the whole server in this one process. auto (default): 1 on a host "
        "without a GPU (or with --port 0), else one per 4 cores, up to 4 per GPU and 8",
    )
    life.add_argument(
        "--processes",
        dest="frontends",
        type=frontend_count,
        help="the former name of --frontends (it used to start whole servers; now the models "
        "load once per engine whatever the count)",
    )
    life.add_argument(
        "--data-parallel",
        type=positive_int,
        default=1,
        help="devices, each served by --engines-per-device engine processes (cuda:0, cuda:1, "
        "...; on CPU each engine gets a share of the cores); each request goes to the engine "
        "with the least outstanding work",
    )
    life.add_argument(
        "--engines-per-device",
        type=engine_count,
        default=layout.AUTO,
        help="engine processes per device, each with its own copy of the weights, GIL and "
        "CUDA stream: one engine process cannot keep a fast GPU busy. auto (default): 1 on "
        "CPU and for models over 2 GiB of weights, else one per 6 of the device's cores, "
        "up to 4 (see service/split/layout.py)",
    )
    life.add_argument(
        "--engine-stall-s",
        type=float,
        default=DEFAULT_STALL_S,
        help="an engine process that leaves a front end's stall check unanswered this long "
        "is marked stalled: calls go to the other engines, health is NOT_SERVING while no "
        "engine can serve, and one stalled 6 times as long is killed and handled as dead. "
        "0: no check",
    )
    life.add_argument(
        "--event-loop",
        default="auto",
        choices=event_loop.CHOICES,
        help="the asyncio loop each server process runs: uvloop (auto: when installed, as it "
        "is by default) costs less per call than asyncio's own",
    )


def _split_role_flags(life: Group) -> None:
    """The hidden flags the supervisor passes to the processes it starts (service/split/)."""
    life.add_argument("--role", choices=["engine", "frontend"], help=argparse.SUPPRESS)
    life.add_argument("--role-index", type=int, default=0, help=argparse.SUPPRESS)
    life.add_argument("--run-dir", help=argparse.SUPPRESS)
    life.add_argument("--alive-fds", default="", help=argparse.SUPPRESS)
    life.add_argument("--stop-fd", type=int, help=argparse.SUPPRESS)  # an engine's stop pipe


def _shutdown_flags(life: Group) -> None:
    """How SIGTERM drains the server."""
    life.add_argument(
        "--drain-delay-s",
        type=float,
        default=ServerConfig.drain_delay_s,
        help="after SIGTERM, report NOT_SERVING this long before refusing new calls",
    )
    life.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=ServerConfig.shutdown_grace_s,
        help="time to finish accepted calls",
    )


class _AdapterAction(argparse.Action):
    """--adapter NAME=PATH, kept with the --model before it on the command line (the
    count of --model given so far), as a per-model flag that may repeat."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: Any, value: Any, option: Any = None
    ) -> None:
        name, sep, path = str(value).partition("=")
        if not (sep and name and path):
            parser.error(f"--adapter takes NAME=PATH, not {value!r}")
        model = max(0, len(getattr(namespace, "model", None) or []) - 1)
        namespace.adapter = [*(namespace.adapter or []), (model, name, path)]


def _adapters_of(args: argparse.Namespace, count: int) -> list[tuple[tuple[str, str], ...]]:
    """Each model's --adapter pairs, in order; their names unique."""
    given = getattr(args, "adapter", None) or []
    names = [name for _, name, _ in given]
    if len(set(names)) != len(names):
        raise SystemExit(f"--adapter names must be unique: {names}")
    return [tuple((n, p) for m, n, p in given if m == k) for k in range(count)]


def _per_model(values: Sequence[Any] | None, count: int, flag: str) -> list[Any]:
    if not values:
        return [None] * count
    if len(values) == 1:
        return list(values) * count
    if len(values) == count:
        return list(values)
    raise SystemExit(f"{flag} was given {len(values)} times for {count} models; {PER_MODEL}")


def model_specs(args: argparse.Namespace) -> list[ModelSpec]:
    sources = args.model or [DEFAULT_MODEL]
    n = len(sources)
    specs = []
    backends = [
        BackendOptions(
            BackendKind(kind or BackendKind.AUTO),
            file or None,
            Quantize(quantize) if quantize not in (None, "none") else None,
            calibration or None,
        )
        for kind, file, quantize, calibration in zip(
            _per_model(args.backend, n, "--backend"),
            _per_model(args.backend_file, n, "--backend-file"),
            _per_model(args.quantize, n, "--quantize"),
            _per_model(args.calibration_file, n, "--calibration-file"),
            strict=True,
        )
    ]
    adapters = _adapters_of(args, n)
    for (
        adapter_pairs,
        backend,
        source,
        pooling,
        side,
        long_input,
        max_chars,
        overrides,
        prompt_name,
        revision,
        score_template,
        score_tokens,
        label_template,
    ) in zip(
        adapters,
        backends,
        sources,
        _per_model(args.pooling_type, n, "--pooling-type"),
        _per_model(args.truncation_side, n, "--truncation-side"),
        _per_model(args.long_input, n, "--long-input"),
        _per_model(args.max_input_chars, n, "--max-input-chars"),
        _per_model(args.hf_overrides, n, "--hf-overrides"),
        _per_model(args.default_prompt_name, n, "--default-prompt-name"),
        _per_model(args.revision, n, "--revision"),
        _per_model(args.score_template, n, "--score-template"),
        _per_model(args.score_tokens, n, "--score-tokens"),
        _per_model(args.label_template, n, "--label-template"),
        strict=True,
    ):
        try:
            parsed = json.loads(overrides) if overrides else {}
        except json.JSONDecodeError as exc:
            raise SystemExit(f"--hf-overrides is not valid JSON: {exc}") from exc
        if not isinstance(parsed, dict):
            raise SystemExit("--hf-overrides must be a JSON object")
        specs.append(
            ModelSpec.parse(
                source,
                pooling_type=PoolingType(pooling) if pooling not in (None, "auto") else None,
                truncation_side=side or "right",
                long_input=LongInput(long_input or LongInput.REJECT),
                max_input_chars=max_chars,
                hf_overrides=parsed,
                default_prompt_name=None if prompt_name in (None, "auto") else prompt_name,
                revision=revision or None,
                score_template=score_template or ModelSpec.score_template,
                score_tokens=score_tokens or ModelSpec.score_tokens,
                label_template=label_template or None,
                trust_remote_code=args.trust_remote_code,
                backend=backend,
                adapters=adapter_pairs,
            )
        )
    names = [spec.served_name for spec in specs]
    if len(set(names)) != len(names):
        raise SystemExit(f"served model names must be unique: {names}")
    clash = {name for spec in specs for name, _ in spec.adapters} & set(names)
    if clash:
        raise SystemExit(f"an --adapter may not take a served model's name: {sorted(clash)}")
    return specs


def tls_config(args: argparse.Namespace) -> TlsConfig | None:
    if not (args.tls_cert or args.tls_key or args.tls_client_ca):
        return None
    if not (args.tls_cert and args.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together (and --tls-client-ca needs both)")
    return TlsConfig(args.tls_cert, args.tls_key, args.tls_client_ca)


def api_keys(args: argparse.Namespace) -> list[str]:
    """Fail closed: asking for auth and giving no usable key must not leave the service open."""
    keys = load_keys(args.api_key, args.api_key_file)
    if (args.api_key or args.api_key_file) and not keys:
        raise SystemExit(
            "--api-key/--api-key-file were given but hold no usable key; refusing to serve "
            "without authentication"
        )
    return keys


def type_equals_prompt(value: str) -> str:
    """--cohere-input-type-prompt's TYPE=PROMPT_NAME, both sides given."""
    input_type, sep, prompt = value.partition("=")
    if not sep or not input_type.strip() or not prompt.strip():
        raise argparse.ArgumentTypeError(f"expected TYPE=PROMPT_NAME, got {value!r}")
    return value


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        models=model_specs(args),
        host=args.host,
        port=args.port,
        device=args.device,
        dtype=args.dtype,
        attn_implementation=args.attn_implementation,
        cuda_graphs=args.cuda_graphs == "on",
        torch_threads=args.torch_threads,
        intra_op_threads=args.intra_op_threads,
        backend_cache_dir=args.backend_cache_dir,
        tokenizer_threads=args.tokenizer_threads,
        limits=Limits(
            max_client_batch_size=args.max_client_batch_size,
            max_request_chars=args.max_request_chars,
            max_image_bytes=args.max_image_bytes,
            max_image_pixels=args.max_image_pixels,
            max_images_per_request=args.max_images_per_request,
            max_audio_bytes=args.max_audio_bytes,
            max_audio_seconds=args.max_audio_seconds,
            max_audio_sample_rate=args.max_audio_sample_rate,
            max_audio_channels=args.max_audio_channels,
            max_audio_clips_per_request=args.max_audio_clips_per_request,
            response=ResponseBudget(max_bytes=args.max_message_mb * MIB),
        ),
        batch=BatchConfig(
            max_batch_tokens=args.max_batch_tokens,
            max_batch_size=args.max_batch_size or 0,
            workers=args.forward_workers or 0,
            batch_wait_s=args.batch_wait_ms / 1000,
            min_padding_efficiency=args.min_padding_efficiency,
            max_queued_items=args.max_queued_items,
            max_queued_items_per_client=args.max_queued_items_per_client
            or default_client_cap(args.max_queued_items, args.max_client_batch_size),
        ),
        max_stream_inflight=args.max_stream_inflight,
        drain_delay_s=args.drain_delay_s,
        shutdown_grace_s=args.shutdown_grace_s,
        max_message_bytes=args.max_message_mb * 1024 * 1024,
        max_http_response_bytes=args.max_http_response_mb * MIB,
        metrics_host=args.metrics_host,
        metrics_port=None if args.role else args.metrics_port,  # a split server's: the parent's
        http_port=args.http_port,
        cohere_input_type_prompts=tuple(args.cohere_input_type_prompt),
        http=HttpLimits(
            header_timeout_s=args.http_header_timeout_s,
            body_timeout_s=args.http_body_timeout_s,
            body_min_bytes_per_s=args.http_body_min_bytes_per_s,
            keepalive_timeout_s=args.http_keepalive_timeout_s,
            max_connections=args.http_max_connections,
            max_connections_per_address=args.http_max_connections_per_address,
            max_concurrent_bodies=args.http_max_concurrent_bodies,
        ),
        transport=TransportConfig(
            keepalive_time_s=args.keepalive_time_s,
            keepalive_timeout_s=args.keepalive_timeout_s,
            keepalive_permit_without_calls=args.keepalive_permit_without_calls,
            min_client_ping_interval_s=args.min_client_ping_interval_s,
            max_concurrent_streams=args.max_concurrent_streams,
            max_open_calls=args.max_open_calls,
            max_connection_age_s=args.max_connection_age_s,
            max_connection_age_grace_s=args.max_connection_age_grace_s,
            max_connections=args.max_connections,
            max_connections_per_address=args.max_connections_per_address,
            max_unsent_answer_bytes=args.max_unsent_answer_mb * MIB,
            handshake_timeout_s=args.handshake_timeout_s,
            max_connection_idle_s=args.max_connection_idle_s,
            max_concurrent_reads=args.max_concurrent_reads,
            read_turn_s=args.read_turn_s,
            gzip_responses=args.gzip_responses,
            reuse_port=args.role == "frontend" and args.frontends > 1,
            door=args.grpc_door,
        ),
        tls=tls_config(args),
        api_keys=api_keys(args),
        cache=CacheSettings(
            memory_mb=args.cache_mb,
            redis_url=args.cache_redis,
            redis_ttl_s=args.cache_redis_ttl_s,
            redis_timeout_ms=args.cache_redis_timeout_ms,
            redis_mb=args.cache_redis_mb,
        ),
        cache_scope=args.cache_scope,
        otlp_endpoint=args.otlp_endpoint,
        log_inputs=args.log_inputs,
        log_requests=args.log_requests,
        frontends=args.frontends,
        data_parallel=args.data_parallel,
        engines_per_device=args.engines_per_device,
        engine_stall_s=args.engine_stall_s,
        admin_keys=[key for key in args.admin_key if key],
        model_repository=args.model_repository,
        max_loaded_models=args.max_loaded_models,
        model_memory_bytes=int((args.model_memory_gb or 0) * 1e9),
        failed_load_ttl_s=args.failed_load_ttl_s,
    )


ENV_PREFIX = "POOLING_"
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})


def environment_arguments(
    parser: argparse.ArgumentParser, argv: Sequence[str], environ: Mapping[str, str]
) -> list[str]:
    """Flags from the environment, as TEI and Infinity read them: `--max-batch-size` from
    POOLING_MAX_BATCH_SIZE. A flag on the command line wins over its variable. A repeatable
    flag (`--model`) takes a comma-separated list; a switch is on for 1, true, yes or on."""
    given = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
    tokens: list[str] = []
    for action in parser._actions:
        flags = [flag for flag in action.option_strings if flag.startswith("--")]
        if not flags or action.help == argparse.SUPPRESS or action.dest == "help":
            continue
        if given & set(action.option_strings):
            continue
        flag = max(flags, key=len)
        value = environ.get(ENV_PREFIX + flag[2:].upper().replace("-", "_"))
        if value is None:
            continue
        if action.nargs == 0:  # a switch
            if value.strip().lower() in TRUE_WORDS:
                tokens.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for item in value.split(","):
                if item.strip():
                    tokens += [flag, item.strip()]
        else:
            tokens += [flag, value]
    return tokens


def parse_args(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    extra = environment_arguments(parser, argv, os.environ if environ is None else environ)
    args = parser.parse_args([*extra, *argv])
    resolve_layout(args)
    return args


def resolve_layout(args: argparse.Namespace) -> None:
    """`--frontends` and `--engines-per-device` as numbers, auto resolved for this host."""
    if args.engine_stall_s < 0:
        raise SystemExit("--engine-stall-s must be 0 (no check) or more")
    if args.frontends == 0 and args.engines_per_device not in (layout.AUTO, 1):
        raise SystemExit("--engines-per-device above 1 needs --frontends 1 or more")
    if layout.AUTO not in (args.frontends, args.engines_per_device):
        return
    chosen = layout.resolve(
        args.frontends,
        args.engines_per_device,
        gpus=layout.cuda_devices(args.device),
        cores=args.torch_threads or len(os.sched_getaffinity(0)),
        weights=layout.weight_bytes(
            [ModelSpec.parse(m).source for m in args.model or [DEFAULT_MODEL]]
        ),
        fixed_ports=args.port != 0 and args.http_port != 0,
    )
    args.frontends, args.engines_per_device = chosen.frontends, chosen.engines_per_device


def parse_batch_args(
    argv: Sequence[str], environ: Mapping[str, str] | None = None
) -> tuple[argparse.Namespace, BatchJobOptions]:
    """`pooling-server batch ...`: the server's model, device and batching flags, and the
    job's own."""
    parser = build_parser()
    parser.prog = "pooling-server batch"
    parser.description = "Answer a JSONL file of OpenAI batch lines with the models in-process."
    job = parser.add_argument_group("batch job")
    job.add_argument("--input", required=True, help="JSONL of OpenAI batch lines; - for stdin")
    job.add_argument("--output", required=True, help="JSONL of answers; - for stdout")
    job.add_argument(
        "--resume",
        action="store_true",
        help="append to --output, skipping the lines already answered there",
    )
    job.add_argument(
        "--batch-window",
        type=positive_int,
        default=BatchJobOptions.window,
        help="lines in flight at once: bounds memory; enough of them keep batches full",
    )
    bar = job.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None)
    bar.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    _ray_job_flags(parser.add_argument_group("batch job on Ray (the [ray] extra)"))
    extra = environment_arguments(parser, argv, os.environ if environ is None else environ)
    args = parser.parse_args([*extra, *argv])
    resolve_layout(args)  # unused in one process, but the config holds numbers
    if args.resume and args.output == "-":
        parser.error("--resume needs --output to be a file")
    if args.input_format != "batch" and args.ray is None:
        parser.error("--input-format jsonl or parquet runs on Ray: add --ray")
    ray = None
    if args.ray is not None:
        ray = RayJobOptions(
            address=args.ray,
            actors=args.ray_actors,
            cpus_per_actor=args.ray_cpus_per_actor,
            gpus_per_actor=args.ray_gpus_per_actor,
            in_flight_shards=args.ray_in_flight,
            shard_lines=args.ray_shard_lines,
            input_format=args.input_format,
            text_column=args.text_column,
            id_column=args.id_column,
            task=args.task,
            dimensions=args.dimensions,
        )
    options = BatchJobOptions(
        args.input, args.output, args.resume, args.batch_window, args.progress, ray
    )
    return args, options


def _ray_job_flags(job: Group) -> None:
    default = RayJobOptions()
    job.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="answer the job on a Ray cluster at ADDRESS (auto, ray://host:10001); "
        "without one, a local Ray",
    )
    job.add_argument(
        "--ray-actors",
        type=positive_int,
        default=default.actors,
        help="actors, each loading the models once",
    )
    job.add_argument("--ray-cpus-per-actor", type=positive_float, default=default.cpus_per_actor)
    job.add_argument("--ray-gpus-per-actor", type=float, default=default.gpus_per_actor)
    job.add_argument(
        "--ray-in-flight",
        type=positive_int,
        default=default.in_flight_shards,
        help="shards (or dataset batches) in flight per actor",
    )
    job.add_argument(
        "--ray-shard-lines",
        type=positive_int,
        default=default.shard_lines,
        help="batch lines a shard: the unit an actor answers and --resume skips",
    )
    job.add_argument(
        "--input-format",
        choices=["batch", "jsonl", "parquet"],
        default="batch",
        help="batch: OpenAI batch lines; jsonl or parquet: a dataset (with --ray), "
        "whose rows are embedded into Parquet files in the --output folder",
    )
    job.add_argument(
        "--text-column", default=default.text_column, help="a dataset's column of texts"
    )
    job.add_argument(
        "--id-column",
        default=None,
        help="a dataset's column of unique row ids: Ray Data checkpoints on it, "
        "so --resume skips the rows written",
    )
    job.add_argument(
        "--task",
        default=default.task,
        help="a dataset's task: embed, classify, embed_sparse, embed_multi, ...",
    )
    job.add_argument(
        "--dimensions",
        type=positive_int,
        default=None,
        help="a dataset's embed dimensions (matryoshka)",
    )


if __name__ == "__main__":
    # `python -m pooling_server.service.cli` starts the server, as it did before launching moved to
    # service/launch.py (scripts and deployments run it). The launch module is run by name
    # rather than imported: it imports the flags from here, and the flags import nothing
    # that launches.
    import runpy

    runpy.run_module("pooling_server.service.launch", run_name="__main__", alter_sys=True)
