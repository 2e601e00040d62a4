"""Flag checks: counts and sizes must be positive, or the server refuses to start."""

from __future__ import annotations

import pytest

from service.cli import build_parser

COUNTS = [
    "--max-message-mb",
    "--torch-threads",
    "--max-client-batch-size",
    "--max-batch-tokens",
    "--max-batch-size",
    "--forward-workers",
    "--max-queued-items",
    "--max-stream-inflight",
    "--data-parallel",
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


def test_one_front_end_by_default() -> None:
    assert build_parser().parse_args([]).frontends == 1
