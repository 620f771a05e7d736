"""A short in-process CTR trainer for the export tests: the "trainer side" whose forward pass a bundle
must reproduce. Generated Criteo rows (planted model) → Arrow → a few hundred SGD steps of CTR-DNN or
DeepFM against one in-process ``SparseTable`` (row-wise Adagrad, show-scaled gradients, as the PS
worker pushes them) and Adam on the dense parameters."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from engine.export import describe_model
from models import Adam, build_model
from sparse_tables import SparseTable, TableConfig
from streaming.criteo import SPARSE_COLUMNS, convert_criteo, generate_criteo
from streaming.source import ArrowSource

SLOTS = list(SPARSE_COLUMNS)


def make_data(tmp, rows=15000, seed=7):
    """Criteo text + its Arrow train/test conversion (canonical split). Returns (text, train, test)."""
    text = tmp / "criteo.txt"
    generate_criteo(text, rows=rows, seed=seed)
    train, test = tmp / "train", tmp / "test"
    convert_criteo(text, train, split="train", batch_size=256, progress=False)
    convert_criteo(text, test, split="test", batch_size=512, progress=False)
    return text, train, test


def arrays(rb: pa.RecordBatch):
    n = rb.num_rows
    labels = rb.column("label").to_numpy().astype(np.float32)
    dense = rb.column("dense").flatten().to_numpy().reshape(n, 13).astype(np.float32)
    keys = np.stack([rb.column(s).to_numpy() for s in SLOTS], axis=1)
    return labels, dense, keys


class Trainer:
    """The model object + its sparse table: what ``engine train`` workers hold, in one process."""

    def __init__(self, kind: str, dim: int = 4, hidden=(32, 16), seed: int = 0):
        self.model = build_model(kind, num_slots=len(SLOTS), dim=dim, dense_dim=13, hidden=hidden, seed=seed)
        self.table = SparseTable(TableConfig(dim=self.model.sparse_width, optimizer="adagrad",
                                             learning_rate=0.05, init_range=0.05, seed=seed))
        self.opt = Adam(self.model.dense_size, lr=3e-3)

    def train(self, path, epochs: int = 1, max_steps: int | None = None) -> None:
        steps = 0
        for epoch in range(epochs):
            for rb in ArrowSource(path, batch_size=256, prefetch=0).batches(epoch):
                labels, dense, keys = arrays(rb)
                flat = keys.reshape(-1)
                uniq, inv = np.unique(flat, return_inverse=True)
                rows = inv.astype(np.int32)
                segs = np.arange(len(flat), dtype=np.int32)
                emb = self.table.pull(uniq, init_missing=True)
                res = self.model.forward_backward(emb, rows, segs, dense, labels)
                shows = np.bincount(rows, minlength=len(uniq)).astype(np.float32)
                clicks = np.bincount(rows, weights=np.repeat(labels, len(SLOTS)),
                                     minlength=len(uniq)).astype(np.float32)
                self.table.push(uniq, res.grad_emb * np.float32(len(labels)), shows=shows, clicks=clicks)
                self.opt.step(self.model.dense_params, res.grad_dense)
                steps += 1
                if max_steps is not None and steps >= max_steps:
                    return

    def predict(self, rb: pa.RecordBatch) -> np.ndarray:
        """The trainer's own inference forward pass (unknown keys read zeros, as the PS eval pull)."""
        _, dense, keys = arrays(rb)
        flat = keys.reshape(-1)
        uniq, inv = np.unique(flat, return_inverse=True)
        emb = self.table.pull(uniq)
        return self.model.predict(emb, inv.astype(np.int32), np.arange(len(flat), dtype=np.int32), dense)

    def description(self) -> dict:
        return describe_model(self.model, SLOTS)

    def source(self):
        from engine.export import TableSource
        return TableSource(self.description(), self.model.get_dense(), [self.table])
