"""The ``observability`` config section, read by every role (servers, workers, the launcher)::

    observability:
      prometheus_port: 9400     # unset (null): no metrics endpoint; 0: a free port; else this port
      pushgateway: ""           # e.g. http://pushgateway:9091: also push every role's metrics there
      push_interval_s: 15       # how often a role pushes to the Pushgateway (and once more at its end)
      tensorboard: true         # event files of train / eval metrics for TensorBoard
      tensorboard_dir: runs/tensorboard   # each run writes into tensorboard_dir/RUN_ID/

``prometheus_port`` (``engine.observability.prometheus``): every server and worker serves its metrics
over HTTP(S) at ``/metrics`` on its own address (``cluster.host``). The local launcher gives each role its
own port (server r: ``prometheus_port + r``, worker r: ``prometheus_port + cluster.servers + r``; with 0
each role picks a free port), logs them and writes them to ``prometheus.json`` in the run directory. A
role started with ``--role`` serves on ``prometheus_port`` itself (``ENGINE_PROMETHEUS_PORT`` overrides
it). With ``security.tls.cert`` set the endpoint serves HTTPS with that certificate, and with
``security.tls.ca`` it requires a client certificate signed by the CA (as the PS port does); off
loopback without TLS it refuses to start unless ``security.insecure: true``.

``pushgateway`` (a URL; "" = off): for short jobs that end before Prometheus scrapes them; every role
pushes (``prometheus_client.push_to_gateway``, job ``engine``, grouping key ``run``, ``role``, ``rank``)
every ``push_interval_s`` seconds and once when it ends. It works with ``prometheus_port`` unset.

``tensorboard`` / ``tensorboard_dir`` (``engine.observability.tensorboard``): RUN_ID is the stem of the
run's metrics file (``model.metrics_file``), shared by every process of the run; a relative directory is
taken from the launcher's working directory.
"""
from __future__ import annotations

from typing import Annotated

from pydantic import Field

from ..config_base import MAX_SECONDS, section
from ..errors import ConfigError

__all__ = ["ObservabilityConfig"]


@section
class ObservabilityConfig:
    """See the module docstring.

    Attributes
    ----------
    prometheus_port : int in [0, 65535] or None
        None: no endpoint; 0: a free port per role; else the (base) port.
    pushgateway : str
        Pushgateway URL (``http://host:9091`` or ``host:9091``); "" = off.
    push_interval_s : float, seconds, in (0, MAX_SECONDS]
    tensorboard : bool
    tensorboard_dir : str
        A directory (local path); RUN_ID subdirectories are made below it.
    """

    prometheus_port: Annotated[int, Field(ge=0, le=65535)] | None = None
    pushgateway: str = ""
    push_interval_s: Annotated[float, Field(gt=0, le=MAX_SECONDS)] = 15.0
    tensorboard: bool = True
    tensorboard_dir: str = "runs/tensorboard"

    def __post_init__(self) -> None:
        if self.tensorboard and not self.tensorboard_dir:
            raise ConfigError("observability.tensorboard_dir must name a directory when observability.tensorboard "
                              "is true, got ''")
        if self.pushgateway and any(c.isspace() for c in self.pushgateway):
            raise ConfigError(f"observability.pushgateway must be a URL like http://host:9091, got "
                              f"{self.pushgateway!r}")
