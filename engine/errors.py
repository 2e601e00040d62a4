"""The one error type the engine raises; `service/errors.py` maps it to gRPC statuses."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class ErrorKind(StrEnum):
    """What went wrong, independent of any transport."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    CANCELLED = "CANCELLED"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"
    UNAUTHENTICATED = "UNAUTHENTICATED"  # a door's refusal: no valid API key


@dataclass(frozen=True)
class FieldViolation:
    """One bad field, named by its path in the request (e.g. `embed.texts[3]`)."""

    field: str
    description: str
    reason: str


@dataclass
class PoolingError(Exception):
    """A request failed; `reason` is a stable UPPER_SNAKE_CASE code clients can switch on."""

    kind: ErrorKind
    reason: str
    message: str
    violations: tuple[FieldViolation, ...] = ()
    metadata: dict[str, str] = field(default_factory=dict)
    retry_after_s: float | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message

    @classmethod
    def invalid(cls, violations: list[FieldViolation]) -> PoolingError:
        """INVALID_ARGUMENT for one or more bad fields; the first sets the reason.

        The message names the first few; gRPC carries it in a header, which has a size limit.
        """
        shown = violations[:MESSAGE_VIOLATIONS]
        message = "; ".join(f"{v.field}: {v.description}" for v in shown)
        if len(violations) > len(shown):
            message += f" (and {len(violations) - len(shown)} more)"
        return cls(ErrorKind.INVALID_ARGUMENT, violations[0].reason, message, tuple(violations))


MESSAGE_VIOLATIONS = 3


def internal_error() -> PoolingError:
    """For unexpected exceptions: logged where they happen, never described to the client."""
    return PoolingError(ErrorKind.INTERNAL, "INTERNAL_ERROR", "internal server error")


def clip(text: str, limit: int = 128) -> str:
    """Echo client input in errors only this long: error details travel in size-limited headers."""
    return text if len(text) <= limit else f"{text[: limit - 3]}..."
