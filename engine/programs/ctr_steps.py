"""The CTR worker's step loops (a mixin of ``engine.programs.ctr.CTRTrainer``): one step after the other
(``_steps``), GEO's prefetching loop (``_prefetched_steps``) and the async/hybrid pipeline whose network
work runs beside the matrix products (``_pipelined_steps``; ``model.pipeline`` exact or stale). Each yields
(batch, StepResult) to ``CTRTrainer._train_epoch``, which counts, evaluates and checkpoints."""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np


class StepPipelines:
    """The step loops over the attributes ``CTRTrainer`` sets (``mode``, ``model``, ``cfg``, ``phases``, ...)
    and its per-step methods (``read``, ``dedup``, ``train_step``, ``forward_backward``, ``merge_dense``)."""

    def _steps(self, it, max_steps: int | None):
        """One step after the other: yields (batch, StepResult)."""
        steps = 0
        t_read = time.perf_counter()
        while max_steps is None or steps < max_steps:    # never read a batch past the limit
            rb = next(it, None)
            if rb is None:
                break
            batch = self.read(rb)
            self.phases["read"] += time.perf_counter() - t_read   # waiting for the batch + read
            res = self.train_step(batch)
            steps += 1
            yield batch, res
            t_read = time.perf_counter()
        self._flush_dense()                # a segment ends with every dense gradient sent

    def _batch_reader(self, it, max_steps: int | None):
        """A function that reads and dedups the next batch of ``it`` -> (CTRBatch, ``dedup``'s result),
        or None at its end or once ``max_steps`` batches were read (never reads past the limit); the
        pipelines call it on their communicator thread. Read and dedup time go to the profile."""
        clock, ph = time.perf_counter, self.phases
        count = 0

        def read_next():
            nonlocal count
            if max_steps is not None and count >= max_steps:
                return None
            t0 = clock()
            rb = next(it, None)
            if rb is None:
                return None
            count += 1
            batch = self.read(rb)
            t1 = clock()
            d = self.dedup(batch)
            ph["read"] += t1 - t0
            ph["dedup"] += clock() - t1
            return batch, d

        return read_next

    def _prefetched_steps(self, it, max_steps: int | None):
        """GEO mode with ``model.pipeline`` ``exact`` or ``stale``: yields (batch, StepResult) like
        ``_steps``. While step t computes, a communicator thread reads and dedups batch t+1 and fetches
        from the servers the rows of its keys missing from the local copy (``GeoMode.prefetch_sparse``);
        step t+1 then pulls from the local copy, taking the prefetched rows for what is still missing.
        The local copy is trained and synced on this thread only, and a row missing from it has no
        unsent delta of this worker, so with one worker every step sees the sequential loop's values;
        with several, a row entering the copy may carry the servers' value of one step earlier (other
        workers' deltas reach it a sync later anyway)."""
        clock, ph = time.perf_counter, self.phases
        table = self.cfg.sparse_table
        read = self._batch_reader(it, max_steps)

        def read_and_prefetch():
            item = read()
            if item is None:
                return None
            t0 = clock()
            pre = self.mode.prefetch_sparse(table, item[1][0])
            ph["prefetch"] += clock() - t0
            return item + (pre,)

        comm = ThreadPoolExecutor(1, thread_name_prefix=f"ctr-prefetch{self.rank}")
        try:
            nxt = comm.submit(read_and_prefetch)
            while True:
                t0 = clock()
                item = nxt.result()
                if item is None:
                    break
                nxt = comm.submit(read_and_prefetch)
                ph["wait"] += clock() - t0
                batch, deduped, pre = item
                yield batch, self.train_step(batch, deduped, pre)
        finally:
            comm.shutdown(wait=True, cancel_futures=True)   # before the caller closes the iterator

    def _pipelined_steps(self, it, max_steps: int | None):
        """Async mode with ``model.pipeline`` ``exact`` or ``stale``: yields (batch, StepResult) like
        ``_steps`` while the network works next to the matrix products (see ``engine.programs.ctr``'s docstring).

        One communicator thread does, in this order, every read, dedup and round trip. After step t
        computes it sends t's sparse and dense gradients with the keys of the next unread batch
        (``Mode.push_pull``: push, dense step, then pull, one Step request per server), which replies
        with that batch's rows and the fresh dense parameters. ``exact`` keeps one such request in
        flight: step t+1 starts with what t's request returned, so it sees every update of this worker
        (as the sequential loop). ``stale`` keeps two: batches 0 and 1 are pulled first, then step
        t+1 starts with what t-1's request returned while t's request runs beside it, so it sees this
        worker's own updates up to t-1 only (Paddle's async communicator does not wait for a step's
        own push either). Both apply the same updates in the same order run after run."""
        clock, ph = time.perf_counter, self.phases
        table, dense_table = self.cfg.sparse_table, self.cfg.dense_table
        depth = 2 if self.cfg.pipeline == "stale" else 1
        local_dense = self.mode.dense_on_workers     # hybrid: the dense step is an all-reduce, never stale
        # hybrid k = 1: all-reduced and stepped range by range during the backward pass, in the model's vector
        overlap = local_dense and self.mode.overlap_dense(dense_table, self.model.dense_params)
        if local_dense and not overlap and self.model.dense_params.dtype == np.float32:   # stepped in place
            self.mode.attach_dense(dense_table, self.model.dense_params)
        stepped = None                               # local_dense: the parameters the last dense step gave
        read_next = self._batch_reader(it, max_steps)

        def pull_first():
            """(item with its rows or None, None): the batches the pipeline starts with."""
            item = read_next()
            if item is None:
                return None, None
            t0 = clock()
            emb = self.mode.pull_sparse(table, item[1][0])
            ph["pull_sparse"] += clock() - t0
            return item + (emb,), None

        def push_then_pull(uniq, res, shows, clicks, size, read):
            """t's sparse and dense pushes and the next batch's pull, one Step request per server ->
            (that batch's item with its rows or None, the fresh dense parameters or None)."""
            item = read.result()             # read on this thread just before: already done
            t0 = clock()
            grads = res.grad_emb
            grads *= np.float32(size)
            pull_keys = item[1][0] if item is not None else np.empty(0, np.uint64)
            # exact: the last push flushes the merged dense gradients; stale: after the drain below;
            # a mode whose dense step runs on the workers takes it beside this request (loop below)
            dense_grad = (None if local_dense
                          else self.merge_dense(res.grad_dense, flush=item is None and depth == 1))
            emb, fresh = self.mode.push_pull(table, uniq, grads, shows, clicks, pull_keys,
                                             dense_table if dense_grad is not None else None, dense_grad)
            ph["push_pull"] += clock() - t0
            return (item + (emb,) if item is not None else None), fresh

        comm = ThreadPoolExecutor(1, thread_name_prefix=f"ctr-comm{self.rank}")
        inflight: deque = deque()
        try:
            t0 = clock()
            self.refresh_dense()
            ph["pull_dense"] += clock() - t0
            inflight.extend(comm.submit(pull_first) for _ in range(depth))
            while True:
                t0 = clock()
                item, fresh = inflight.popleft().result()
                if local_dense:
                    fresh, stepped = stepped, None
                if item is None:
                    while inflight:                  # stale: the last step's request is still out
                        last = inflight.popleft().result()[1]
                        fresh = last if last is not None else fresh
                    if fresh is not None:            # the last step's parameters, for evaluation
                        with self._dense_lock:
                            self._fresh_dense = fresh
                    break
                read = comm.submit(read_next)
                if fresh is not None:
                    self.model.set_dense(fresh)
                t1 = clock()
                batch, (uniq, rows, segments, shows, clicks), emb = item
                on_grad = self.mode.begin_dense_step(dense_table) if overlap else None
                res = self.forward_backward(emb, rows, segments, batch, on_grad)
                t2 = clock()
                inflight.append(comm.submit(push_then_pull, uniq, res, shows, clicks, batch.size, read))
                if overlap:           # the lowest layers' all-reduce and Adam, beside the sparse request
                    self.mode.finish_dense_step(dense_table)
                    self.dense_steps += 1
                    ph["push_dense"] += clock() - t2
                elif local_dense:     # beside the sparse request; t+1 computes with its result
                    stepped = self.mode.push_pull_dense(dense_table, self.merge_dense(res.grad_dense))
                    ph["push_dense"] += clock() - t2
                self.mode.end_step(batch.size)
                ph["wait"] += t1 - t0
                ph["compute"] += t2 - t1
                yield batch, res
            if depth > 1:
                self._flush_dense()
        finally:
            comm.shutdown(wait=True, cancel_futures=True)   # before the caller closes the iterator
