"""Retries with exponential backoff for transient storage errors.

Which errors are transient
--------------------------
pyarrow reports remote failures as ``OSError``. Retried:

* ``ConnectionError`` (reset/refused/aborted/broken pipe), ``TimeoutError``, ``InterruptedError``,
  ``BlockingIOError``;
* any ``OSError`` whose errno is a network/timeout errno (ECONNRESET, ETIMEDOUT, EAGAIN, ...);
* a plain ``OSError`` whose message carries an AWS/curl marker of a connection problem, a throttle or a
  5xx answer (``NETWORK_CONNECTION``, ``SLOW_DOWN``, ``SERVICE_UNAVAILABLE``, ``INTERNAL_FAILURE``,
  ``REQUEST_TIMEOUT``, ``HTTP response code: 50x``, ``curlCode``, ...).

Never retried: ``FileNotFoundError``, ``PermissionError``, ``FileExistsError``, ``IsADirectoryError``,
``NotADirectoryError``, every :class:`~hdfs_io.errors.StorageError`, non-``OSError`` exceptions, and any other
``OSError`` (access denied, no such bucket, bad credentials: retrying cannot fix them).
"""
from __future__ import annotations

import errno
import logging
import random
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from hdfs_io.errors import StorageError, StorageUnavailableError

__all__ = ["RetryPolicy", "RetryStats", "is_transient", "call_with_retry"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_PERMANENT = (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError, NotADirectoryError)
_TRANSIENT_TYPES = (ConnectionError, TimeoutError, InterruptedError, BlockingIOError)
_TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "ECONNRESET", "ECONNREFUSED", "ECONNABORTED", "ETIMEDOUT", "EAGAIN", "EPIPE", "EHOSTUNREACH",
        "ENETUNREACH", "ENETDOWN", "ENETRESET", "EHOSTDOWN", "EINTR", "EBUSY",
    )
    if hasattr(errno, name)
)
_PERMANENT_MARKERS = re.compile(
    r"ACCESS_DENIED|AccessDenied|NO_SUCH_BUCKET|NoSuchBucket|INVALID_ACCESS_KEY_ID|SIGNATURE_DOES_NOT_MATCH"
    r"|HTTP response code: 4\d\d"
)
_TRANSIENT_MARKERS = re.compile(
    r"NETWORK_CONNECTION|SLOW_DOWN|SlowDown|SERVICE_UNAVAILABLE|ServiceUnavailable|INTERNAL_FAILURE"
    r"|InternalError|REQUEST_TIMEOUT|RequestTimeout|THROTTLING|Throttling|REQUEST_TIME_TOO_SKEWED"
    r"|HTTP response code: 5\d\d|curlCode|Connection reset|Connection refused|timed out|Broken pipe"
)


def is_transient(exc: BaseException) -> bool:
    """Tell whether retrying the failed storage call may succeed (see module docstring).

    Parameters
    ----------
    exc : BaseException
        The exception raised by a pyarrow filesystem or stream call.

    Returns
    -------
    bool
    """
    if not isinstance(exc, OSError) or isinstance(exc, (_PERMANENT, StorageError)):
        return False
    if isinstance(exc, _TRANSIENT_TYPES) or exc.errno in _TRANSIENT_ERRNOS:
        return True
    text = str(exc)
    if _PERMANENT_MARKERS.search(text):
        return False
    return bool(_TRANSIENT_MARKERS.search(text))


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff: attempt ``k`` (1-based) failing transiently waits
    ``min(max_delay_s, initial_delay_s * multiplier**(k-1))``, scaled by a random factor in
    ``[1 - jitter, 1]``, then tries again, up to ``max_attempts`` attempts in total.

    Parameters
    ----------
    max_attempts : int
        Total attempts including the first; 1 disables retries.
    initial_delay_s : float, seconds
    multiplier : float
    max_delay_s : float, seconds
    jitter : float in [0, 1]
        Fraction of each delay that is randomized, so many workers do not retry in lockstep.
    retry_on : callable(BaseException) -> bool
        Classifier; default :func:`is_transient`.
    sleep : callable(float) -> None
        Injected for tests; default ``time.sleep``.
    """

    max_attempts: int = 5
    initial_delay_s: float = 0.2
    multiplier: float = 2.0
    max_delay_s: float = 10.0
    jitter: float = 0.2
    retry_on: Callable[[BaseException], bool] = is_transient
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"retry.max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_delay_s < 0 or self.max_delay_s < 0:
            raise ValueError(
                f"retry delays must be >= 0 seconds, got initial_delay_s={self.initial_delay_s}, "
                f"max_delay_s={self.max_delay_s}"
            )
        if self.multiplier < 1:
            raise ValueError(f"retry.multiplier must be >= 1, got {self.multiplier}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"retry.jitter must be in [0, 1], got {self.jitter}")

    def delay_s(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        base = min(self.max_delay_s, self.initial_delay_s * self.multiplier ** (attempt - 1))
        return base * (1.0 - self.jitter * random.random())


class RetryStats:
    """Thread-safe counters of retries, shared by every call through one :class:`~hdfs_io.Storage`.

    Attributes
    ----------
    retries : int
        Failed attempts that were retried.
    gave_up : int
        Calls that still failed transiently after ``max_attempts``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.retries = 0
        self.gave_up = 0

    def _add(self, *, retries: int = 0, gave_up: int = 0) -> None:
        with self._lock:
            self.retries += retries
            self.gave_up += gave_up

    def as_dict(self) -> dict[str, int]:
        """Counters as a plain dict, for metrics."""
        with self._lock:
            return {"retries": self.retries, "gave_up": self.gave_up}

    def __repr__(self) -> str:
        return f"RetryStats(retries={self.retries}, gave_up={self.gave_up})"


def call_with_retry(
    fn: Callable[[], T],
    *,
    policy: RetryPolicy,
    what: str,
    stats: RetryStats | None = None,
    uri: str | None = None,
) -> T:
    """Call ``fn()`` and retry it on transient errors with exponential backoff.

    ``fn`` must be safe to repeat: it redoes the whole operation (open + write + close), never resumes a
    half-written stream.

    Parameters
    ----------
    fn : callable() -> T
    policy : RetryPolicy
    what : str
        Operation and URI for log lines, e.g. ``"write s3://bkt/x/manifest.json"``.
    stats : RetryStats or None
        Counters to update.
    uri : str or None
        URI attached to the error raised when retries run out.

    Returns
    -------
    T
        What ``fn`` returned.

    Raises
    ------
    StorageUnavailableError
        When the error is still transient after ``max_attempts`` attempts (the last error is chained as
        ``__cause__``).
    Exception
        Any non-transient error at once, unchanged but for a note (``add_note``) naming ``what``, so the
        message a server or CLI builds from it can say which operation and URI failed (pyarrow's
        ``OSError: [Errno 28] Error writing bytes to file`` names neither).
    """
    attempt = 1
    while True:
        try:
            return fn()
        except Exception as exc:
            if not policy.retry_on(exc):
                exc.add_note(what)
                raise
            if attempt >= policy.max_attempts:
                if stats is not None:
                    stats._add(gave_up=1)
                logger.error("%s failed after %d attempts: %s", what, attempt, exc)
                raise StorageUnavailableError(
                    f"{what} failed after {attempt} attempts (last error {type(exc).__name__}: {exc})",
                    uri=uri,
                ) from exc
            delay = policy.delay_s(attempt)
            if stats is not None:
                stats._add(retries=1)
            logger.warning(
                "%s failed (attempt %d/%d, transient %s: %s); retrying in %.3f s",
                what, attempt, policy.max_attempts, type(exc).__name__, exc, delay,
            )
            policy.sleep(delay)
            attempt += 1
