"""Flag checks: counts and sizes must be positive, or the server refuses to start."""

from __future__ import annotations

import pytest

from pooling_server.service.cli import build_parser

COUNTS = [
    "--max-message-mb",
    "--torch-threads",
    "--max-client-batch-size",
    "--max-batch-tokens",
    "--max-batch-size",
    "--forward-workers",
    "--max-queued-items",
    "--max-queued-items-per-client",
    "--max-stream-inflight",
    "--data-parallel",
    "--engines-per-device",
]


@pytest.mark.parametrize("flag", COUNTS)
@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_counts_must_be_positive(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([flag, value])
    assert exit_.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("flag", COUNTS)
def test_a_positive_count_is_taken(flag: str) -> None:
    args = build_parser().parse_args([flag, "3"])
    assert getattr(args, flag.removeprefix("--").replace("-", "_")) == 3


@pytest.mark.parametrize("flag", ["--frontends", "--processes"])
@pytest.mark.parametrize("value", [0, 3])
def test_frontends_may_be_zero_and_processes_is_its_former_name(flag: str, value: int) -> None:
    """0: the whole server in one process; N: N front ends (checked below 0 by main)."""
    assert build_parser().parse_args([flag, str(value)]).frontends == value


def test_one_front_end_and_engine_by_default_without_a_gpu() -> None:
    """auto, resolved for this host (service/split/layout.py; no GPU here)."""
    from pooling_server.service.cli import parse_args

    args = build_parser().parse_args([])
    assert (args.frontends, args.engines_per_device) == ("auto", "auto")
    args = parse_args(["--device", "cpu"], environ={})
    assert (args.frontends, args.engines_per_device) == (1, 1)


@pytest.mark.parametrize("value", ["-0.1", "1.5", "dense"])
def test_padding_efficiency_is_a_fraction(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--min-padding-efficiency", value])
    assert "--min-padding-efficiency" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--frontends", "0", "--engines-per-device", "2"], "needs --frontends 1 or more"),
        (["--engine-stall-s", "-1"], "--engine-stall-s must be"),
    ],
)
def test_layout_checks(argv: list[str], message: str) -> None:
    from pooling_server.service.cli import parse_args

    with pytest.raises(SystemExit, match=message):
        parse_args(argv, environ={})


def test_settings_come_from_the_environment_and_flags_win() -> None:
    from pooling_server.service.cli import config_from_args, parse_args

    environ = {
        "POOLING_PORT": "6001",
        "POOLING_MODEL": "a=/models/a, b=/models/b",
        "POOLING_MAX_BATCH_SIZE": "64",
        "POOLING_LOG_REQUESTS": "true",
        "POOLING_GZIP_RESPONSES": "no",
        "POOLING_HOST": "0.0.0.0",
        "UNRELATED": "1",
    }
    args = parse_args([], environ)
    assert (args.port, args.host, args.max_batch_size) == (6001, "0.0.0.0", 64)
    assert args.model == ["a=/models/a", "b=/models/b"]
    assert args.log_requests is True and args.gzip_responses is False
    assert [spec.served_name for spec in config_from_args(args).models] == ["a", "b"]
    flags = parse_args(["--port", "7000", "--model", "c=/models/c"], environ)
    assert (flags.port, flags.model) == (7000, ["c=/models/c"])
    assert parse_args(["--port=7001"], environ).port == 7001
    assert parse_args([], {}).port == 50051
    with pytest.raises(SystemExit):
        parse_args([], {"POOLING_PORT": "not-a-number"})


def test_every_documented_flag_has_its_variable_in_the_help() -> None:
    assert "POOLING_MODEL" in build_parser().format_help()


def test_flag_defaults_are_the_config_defaults() -> None:
    """A flag's default is its config dataclass's (service/ops/config.py, the engine's Limits and
    BatchConfig), so no flag says one default while the config says another."""
    from dataclasses import replace

    from pooling_server.engine.requests.resolved import Limits
    from pooling_server.engine.scheduling.batch_queue import BatchConfig
    from pooling_server.service.cli import config_from_args, parse_args
    from pooling_server.service.ops.config import HttpLimits, ServerConfig, TransportConfig

    config = config_from_args(parse_args([], environ={}))
    assert config.transport == replace(TransportConfig(), door="auto")  # launch resolves it
    assert config.http == HttpLimits()
    defaults = ServerConfig()
    for name in (
        "host",
        "port",
        "metrics_host",
        "device",
        "dtype",
        "tokenizer_threads",
        "max_stream_inflight",
        "drain_delay_s",
        "shutdown_grace_s",
        "max_message_bytes",
        "max_http_response_bytes",
        "engine_stall_s",
    ):
        assert getattr(config, name) == getattr(defaults, name), name
    for name in (
        "max_client_batch_size",
        "max_request_chars",
        "max_image_bytes",
        "max_image_pixels",
        "max_images_per_request",
    ):
        assert getattr(config.limits, name) == getattr(Limits(), name), name
    for name in ("max_batch_tokens", "max_queued_items", "min_padding_efficiency"):
        assert getattr(config.batch, name) == getattr(BatchConfig(), name), name


def test_python_m_service_cli_still_starts_the_server() -> None:
    """`python -m pooling_server.service.cli` (run by scripts and deployments) runs
    service/launch.py's main, which the flags module does not import: --help is the
    server's, a bad flag its refusal."""
    import subprocess
    import sys

    helped = subprocess.run(
        [sys.executable, "-m", "pooling_server.service.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: pooling-server")
    refused = subprocess.run(
        [sys.executable, "-m", "pooling_server.service.cli", "--port", "x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "--port" in refused.stderr


def test_the_flags_do_not_import_the_launch() -> None:
    """Imports point one way: service/launch.py takes the flags from service/cli.py."""
    import subprocess
    import sys

    code = "import sys, service.cli; print('pooling_server.service.launch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr
