"""async mode: each worker pushes after each batch and the servers apply immediately (Hogwild across
workers; each shard serializes its own updates). With ``client.async_queue > 0`` sparse pushes go
through the client's bounded background queue, where queued pushes are merged per key before sending
(Paddle's communicator); ``finish`` flushes it."""
from __future__ import annotations

import numpy as np

from .base import Mode


class AsyncMode(Mode):
    name = "async"
    pipelines_requests = True
    dense_step_replies_params = True

    def pull_sparse(self, table: str, keys: np.ndarray) -> np.ndarray:
        return self.client.pull(table, keys, init_missing=True)

    def push_sparse_grads(self, table, keys, grads, shows=None, clicks=None) -> None:
        self.client.push_async(table, keys, grads, shows=shows, clicks=clicks)

    def push_sparse_delta(self, table, keys, deltas) -> None:
        """Sent at once (``PSClient.push_delta``: the servers add it, no optimizer): Hogwild across workers."""
        self.client.push_delta(table, keys, deltas)

    def pull_dense(self, table: str) -> np.ndarray:
        return self.client.pull_dense(table)

    def push_dense_grads(self, table: str, grad: np.ndarray) -> None:
        self.client.push_dense(table, grad)

    def push_pull_dense(self, table: str, grad: np.ndarray) -> np.ndarray:
        """Adam step on the servers and the fresh parameters in one round trip (DENSE_STEP)."""
        return self.client.push_pull_dense(table, grad)

    def push_pull(self, table, keys, grads, shows, clicks, pull_keys, dense_table, dense_grad):
        """The sparse push, the dense step and the next pull in one Step request per server
        (``PSClient.push_pull``): the same updates and values as the three calls, in one round trip.
        With a background push queue the pushes go through it, and the calls are separate."""
        if self.client.queues_pushes:
            return super().push_pull(table, keys, grads, shows, clicks, pull_keys, dense_table, dense_grad)
        return self.client.push_pull(table, keys, grads, pull_keys, shows=shows, clicks=clicks,
                                     dense_table=dense_table, dense_grad=dense_grad)

    def drain(self) -> None:
        """Send what the background push queue holds (``client.async_queue``)."""
        self.client.flush()

    def finish(self) -> None:
        self.drain()
        super().finish()
