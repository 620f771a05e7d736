"""Base + delta checkpoints of the parameter servers' tables on local disk, HDFS or S3.

* ``manifest``    layout ``{root}/{job}/{YYYYMMDD}/{HHMM}-{base|delta}[.N]/``, listing, chains
* ``writer``      server side: one server's part files (per vshard group) + its part report
* ``reader``      server side: one server loads the rows it owns (any N -> M servers)
* ``coordinator`` ``CheckpointManager``: name, publish (manifest + ``_SUCCESS`` last), restore with
                  fallback, retention
* ``schedule``    the ``checkpoint`` config section and when a delta / base is due
"""
from .coordinator import CheckpointManager, CheckpointNotFoundError, Cluster
from .manifest import (DEFAULT_GROUPS, FORMAT_VERSION, CheckpointRef, chain_of, list_checkpoints, parse_name,
                       ref_of_uri)
from .reader import CheckpointMismatchError, load_server_parts
from .schedule import CheckpointConfig, Schedule, parse_duration
from .writer import DenseBlockState, DenseState, save_server_parts

__all__ = ["CheckpointManager", "CheckpointNotFoundError", "Cluster", "DEFAULT_GROUPS", "FORMAT_VERSION",
           "CheckpointRef", "chain_of", "list_checkpoints", "parse_name", "ref_of_uri", "CheckpointMismatchError",
           "load_server_parts", "CheckpointConfig", "Schedule", "parse_duration", "DenseBlockState",
           "DenseState", "save_server_parts"]
