"""``logreg``: logistic regression on generated data with a planted weight vector.

The smallest model that exercises every path of the parameter server: sparse keys → 1-dim embeddings
(the weights, sparse table ``model.table``) plus a dense bias (dense table ``model.dense_table``).
Every worker generates its own examples from the same planted model (seeded by ``seed`` and its
rank): ``keys_per_example`` feature ids drawn uniformly from ``num_features``, label ~
Bernoulli(sigmoid(sum of planted weights + planted bias)). After training (``mode.finish()``) each
worker pulls the final weights and reports their distance to the planted ones.

Step: ``read → dedup → pull → forward_backward → push``; gradients are of the mean log-loss over the
batch.

Checkpoints (``checkpoint.root``): the workers meet every ``checkpoint.align_steps`` steps and at every
epoch end, and rank 0 writes the checkpoint that is due with the data position ``(epoch, batch)``
(``ctr_positions.AlignedCheckpoints``), in the local launcher and in role mode alike; ``--resume``
continues at that position (each rank's data is a pure function of the seed, the rank and the batch).
"""
from __future__ import annotations

import logging
import time

import numpy as np

from ..program_configs import LogregConfig as Config
from .ctr_positions import AlignedCheckpoints, Position

log = logging.getLogger(__name__)

WRITES_CHECKPOINTS = True    # rank 0 writes them at aligned points with exact data positions

KEY_BASE = 1 << 40   # feature f has key KEY_BASE + f


def planted(cfg: Config) -> tuple[np.ndarray, float]:
    """The planted weights float32[num_features] and bias."""
    rng = np.random.default_rng(cfg.seed)
    return rng.normal(0.0, cfg.weight_scale, cfg.num_features).astype(np.float32), float(cfg.planted_bias)


def generate(cfg: Config, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's examples: keys uint64[N, keys_per_example], labels float32[N]."""
    w, b = planted(cfg)
    rng = np.random.default_rng([cfg.seed, rank + 1])
    feats = rng.integers(0, cfg.num_features, (cfg.examples_per_worker, cfg.keys_per_example))
    logits = w[feats].sum(axis=1) + b
    labels = (rng.random(cfg.examples_per_worker) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    return (feats.astype(np.uint64) + np.uint64(KEY_BASE)), labels


class _Loop:
    """What ``AlignedCheckpoints`` needs of a training loop."""

    def __init__(self, ctx):
        self.ctx, self.rank, self.num_workers = ctx, ctx.rank, ctx.num_workers
        self.client, self.mode = ctx.client, ctx.mode
        self.steps = 0

    def _drain(self) -> None:
        """Every update of this worker visible on the servers (GEO deltas, queued async pushes)."""
        self.mode.drain()


def run(ctx) -> dict:
    """Train on this rank's data through ``ctx.mode``; returns the summary of the final weights."""
    cfg: Config = ctx.config.model.params
    mode = ctx.mode
    keys, labels = generate(cfg, ctx.rank)
    mode.init_dense(cfg.dense_table, np.zeros(1, np.float32))
    n, bs = len(labels), cfg.batch_size
    batches = n // bs                              # equal step counts on every worker (sync needs it)
    loop = _Loop(ctx)
    ckpts = AlignedCheckpoints(loop, identity={"workers": ctx.num_workers, "batch_size": bs, "seed": cfg.seed,
                                               "examples_per_worker": n})
    start_pos, loop.steps = ckpts.restored()
    steps, loss_sum, t0 = 0, 0.0, time.time()
    for epoch in range(start_pos.epoch, cfg.epochs):
        skip = start_pos.batch if epoch == start_pos.epoch else 0
        meetings = set(ckpts.points(skip, batches))
        for b in range(skip, batches):
            start = b * bs
            kb, yb = keys[start:start + bs], labels[start:start + bs]
            uniq, inv = np.unique(kb.reshape(-1), return_inverse=True)            # dedup
            w = mode.pull_sparse(cfg.table, uniq)[:, 0]                            # pull
            bias = mode.pull_dense(cfg.dense_table)[0]
            z = w[inv].reshape(kb.shape).sum(axis=1) + bias                        # forward
            p = 1.0 / (1.0 + np.exp(-z))
            loss_sum += float(-np.mean(yb * np.log(p + 1e-7) + (1 - yb) * np.log(1 - p + 1e-7)))
            err = ((p - yb) / bs).astype(np.float32)                               # backward
            g = np.bincount(inv, weights=np.repeat(err, kb.shape[1]), minlength=len(uniq))
            mode.push_sparse_grads(cfg.table, uniq, g.astype(np.float32).reshape(-1, 1))   # push
            mode.push_dense_grads(cfg.dense_table, np.array([err.sum()], np.float32))
            mode.end_step(len(yb))
            steps += 1
            loop.steps += 1
            if b + 1 in meetings:
                ckpts.meet(Position(epoch, b + 1))
        ckpts.meet(Position(epoch + 1, 0))
        log.info("worker %d: epoch %d done, mean logloss %.4f", ctx.rank, epoch, loss_sum / max(1, steps))
    if ckpts.ck.final:
        ckpts.meet(Position(cfg.epochs, 0), force=True)
    mode.finish()
    w_true, b_true = planted(cfg)
    all_keys = np.arange(cfg.num_features, dtype=np.uint64) + np.uint64(KEY_BASE)
    w_final = ctx.client.pull(cfg.table, all_keys)[:, 0]
    b_final = float(ctx.client.pull_dense(cfg.dense_table)[0])
    err = w_final - w_true
    return {"rank": ctx.rank, "steps": steps, "examples": steps * bs, "checkpoint": ckpts.last_uri,
            "train_logloss": loss_sum / max(1, steps), "seconds": time.time() - t0,
            "weight_rmse": float(np.sqrt(np.mean(err ** 2))), "weight_max_abs_error": float(np.abs(err).max()),
            "bias_error": b_final - b_true}
