"""Typed errors of the engine. Each is a ValueError or RuntimeError subclass, so callers that only know
the standard hierarchy still catch them; each message names what was wrong and where (key path, table,
server, shard, request id)."""
from __future__ import annotations

from hdfs_io.errors import StorageUnavailableError


class EngineError(Exception):
    """Base class of every error the engine raises."""


class ConfigError(EngineError, ValueError):
    """A config value is missing, unknown or out of range; the message names the key path."""


class TrainingDivergedError(ConfigError):
    """A training step's loss or sparse gradients are not finite (NaN or Inf): the model diverged, most
    often from a learning rate too high for the data. The message names the worker, the step, and the
    learning rates to lower. A ConfigError: the job ends with exit 2 and no restart, which would diverge
    again; the last checkpoint holds the last finite state (servers refuse non-finite updates)."""


class ProtocolError(EngineError, ValueError):
    """A PS message is malformed: wrong dtype or shape, truncated payload, bad field value."""


class ProtocolVersionError(ProtocolError):
    """A server speaks another PS protocol version than this client (``engine.ps.protocol``): the job
    runs roles of two engine versions. The message names the server, its endpoint and both versions."""


class UnknownTableError(EngineError, KeyError):
    """A request names a table the server does not host."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class RemoteError(EngineError, RuntimeError):
    """A PS call failed on the server or on the way; ``code`` is the gRPC status code name.

    Parameters
    ----------
    code : str
        ``INVALID_ARGUMENT``, ``NOT_FOUND``, ``FAILED_PRECONDITION``, ``UNAVAILABLE``,
        ``DEADLINE_EXCEEDED``, ``INTERNAL``, ...
    message : str
        The server's message (it names server, table, shard and request id) or the transport's.
    endpoint : str
        Where the call went (``host:port`` or ``inproc:N``).
    """

    def __init__(self, code: str, message: str, endpoint: str = ""):
        super().__init__(f"{code} from {endpoint}: {message}" if endpoint else f"{code}: {message}")
        self.code = code
        self.message = message
        self.endpoint = endpoint


class RequestRejectedError(RemoteError, ValueError):
    """The server rejected the request as invalid (INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION);
    its tables are unchanged. Retrying the same request will fail the same way."""


class AccessDeniedError(RequestRejectedError):
    """The server refused the caller (UNAUTHENTICATED: no or a wrong bearer token; PERMISSION_DENIED: an
    admin method with the worker token, or a checkpoint location outside ``checkpoint.root``). Nothing
    changed; never retried."""


class MessageTooLargeError(RequestRejectedError):
    """A request or its reply is over a gRPC message size limit (RESOURCE_EXHAUSTED "larger than max");
    the message names the limit and the size. Never retried: the same request fails the same way."""


class GenerationChangedError(RemoteError):
    """A server restarted, loaded a checkpoint or was fenced since this client met it (ABORTED "generation
    mismatch"); the request was not applied. The sender must roll back to the state the servers now
    hold: a worker exits (``engine.roles``) and resumes at the servers' restored checkpoint."""


class DeltaParentError(RequestRejectedError):
    """A server refused a delta Save: its changes are not counted from the checkpoint the delta names as
    parent (FAILED_PRECONDITION "delta parent mismatch"; ``engine.ps.delta_lineage``). That server
    wrote and cleared nothing; the coordinator writes a base instead."""

    #: what the refusal's message starts with (the server's ``HostError``; the client maps it to this class)
    MARKER = "delta parent mismatch"


class RestoreMismatchError(RequestRejectedError):
    """A server refused to load a checkpoint that does not fit its tables (FAILED_PRECONDITION "checkpoint
    does not fit": a missing or renamed table, another dim or optimizer, more rows than ``max_rows``;
    ``engine.checkpoint.reader.CheckpointMismatchError`` on the server). Nothing was loaded, and a
    restart fails the same way: the config or the checkpoint must change."""

    #: what the refusal's message starts with (the server's ``HostError``; the client maps it to this class)
    MARKER = "checkpoint does not fit"


#: ``engine train``'s exit code (a role's and the launcher's) when the checkpoint storage refuses a write for
#: good (``hdfs_io.permanent_failure``: read-only, access refused, full; sysexits' EX_IOERR): the job ends
#: at once with one resumable line; a launcher does not restart it, ``engine k8s`` fails the Job on it
EXIT_STORAGE_REFUSED = 74
#: what that line says after the storage's error (the launcher takes the error from its child's line by it)
REFUSED_ENDS = "no restart mends that, so the job ends here"


class CheckpointStorageError(RemoteError, StorageUnavailableError):
    """A server could not write or read a checkpoint's files: their storage failed (FAILED_PRECONDITION
    "checkpoint storage error": S3 or HDFS down or silent through ``hdfs_io``'s retries, a full or
    read-only disk, access refused). The message names the server, the operation (``save`` / ``load``)
    and the checkpoint, then the storage call and the file that failed. A Save published nothing and
    cleared the server's delta lineage (the next checkpoint is a base); a Load changed no table.

    Also an ``hdfs_io.StorageUnavailableError`` (an ``OSError``): ``engine train`` ends on it with one line
    saying how to continue once the storage answers, never a traceback, whichever role met it. Not
    retried by the client: the server already retried every storage call."""

    #: what the server's message starts with (its ``HostError``; the client maps it to this class)
    MARKER = "checkpoint storage error"

    def __init__(self, code: str, message: str, endpoint: str = ""):
        RemoteError.__init__(self, code, message, endpoint)
        self.uri = None

    def __reduce__(self):   # picklable across processes like the other RemoteErrors
        return (type(self), (self.code, self.message, self.endpoint))


class ShardUnavailableError(RemoteError):
    """A server stayed unreachable (UNAVAILABLE) through every retry."""


class PSTimeoutError(RemoteError, TimeoutError):
    """A call or a barrier did not complete within its timeout (DEADLINE_EXCEEDED)."""


class BarrierTimeoutError(PSTimeoutError):
    """Not every caller arrived at a barrier within its timeout: a peer's failure, or a wrong world size
    (``cluster.workers``), where a plain ``PSTimeoutError`` is a server that did not answer."""


class LaunchError(EngineError, RuntimeError):
    """A launched process failed, hung or did not become ready; the message names its role and rank
    and ends with its last log lines. ``role``, ``rank``, ``exit_code`` (None for a hang or a start-up
    timeout), ``reason`` and ``log_tail`` say the same for a supervisor (role is "" when no single
    process is to blame)."""

    def __init__(self, message: str, *, role: str = "", rank: int = -1, exit_code: int | None = None,
                 reason: str = "", log_tail: str = ""):
        super().__init__(message)
        self.role, self.rank, self.exit_code = role, rank, exit_code
        self.reason, self.log_tail = reason or message, log_tail


#: ``engine train``'s exit code when the Ray launcher cannot place the job's roles: no live Ray node
#: offers the resources a role needs (``cluster.server_resources``, ``cluster.worker_resources``), e.g.
#: the node that offered them was lost and none replaced it (sysexits' EX_UNAVAILABLE); the job's
#: checkpoints are kept, and the line says how to continue once a node offers them again
EXIT_NO_RESOURCES = 69


class PlacementError(LaunchError):
    """The Ray launcher's placement group was not placed within ``cluster.startup_timeout_s``: the message
    names each role whose resources no live node offers (or, when every resource exists, the ones
    taken), in one line. ``resume`` is what a later run resumes from (set by the supervisor: "" the
    newest checkpoint, a URI, or None: nothing, run the job again); ``engine train`` exits
    ``EXIT_NO_RESOURCES`` with the command that continues the job."""

    resume: str | None = None


class StoppedWhilePlacing(Exception):
    """The supervisor asked to stop (a preemption: SIGTERM to the driver) while the Ray launcher waited for
    its placement group (``engine.launch.ray.RayCluster``): nothing of the attempt started, so the job stops
    resumable at once (``engine train`` exits 75) instead of after ``cluster.startup_timeout_s``."""
