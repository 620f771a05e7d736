"""Slow, obviously correct references for the sparse-table kernels: plain Python ints for hashing and
random numbers, numpy per row for optimizers, a dict of rows for the table semantics.

Float rounding mirrors the kernels where the kernels store intermediate state as float32 (optimizer
accumulators are stored, then re-read), so results agree to float32 precision.
"""
from __future__ import annotations

import math

import numpy as np

from sparse_tables.config import TableConfig, optimizer_state_width

M64 = (1 << 64) - 1
ADMIT_SALT = 0xA0761D6478BD642F


def splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def uniform01(seed: int, key: int, j: int) -> float:
    base = splitmix64(key ^ splitmix64(seed))
    return (splitmix64((base + j) & M64) >> 40) / 16777216.0


def initial_values(cfg: TableConfig, key: int) -> np.ndarray:
    out = np.zeros(cfg.dim, np.float32)
    seed = cfg.seed % (1 << 64)
    for j in range(cfg.dim):
        if cfg.initializer == "uniform":
            out[j] = (2.0 * uniform01(seed, key, j) - 1.0) * cfg.init_range
        elif cfg.initializer == "normal":
            u1 = uniform01(seed, key, 2 * j) + 1.0 / 33554432.0
            u2 = uniform01(seed, key, 2 * j + 1)
            out[j] = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2) * cfg.init_range
    return np.clip(out, cfg.min_bound, cfg.max_bound).astype(np.float32)   # created within the bounds


def initial_state(cfg: TableConfig) -> np.ndarray:
    s = np.zeros(optimizer_state_width(cfg.optimizer, cfg.dim), np.float32)
    if cfg.optimizer in ("adagrad", "std_adagrad"):
        s[:] = cfg.initial_accumulator
    elif cfg.optimizer == "adam":
        s[-2:] = 1.0
    return s


def f32(x) -> np.ndarray:
    return np.float32(x) if np.isscalar(x) else np.asarray(x, dtype=np.float32)


def optimizer_step(cfg: TableConfig, w: np.ndarray, s: np.ndarray, g32: np.ndarray, scale: float):
    """One update of row values w and state s (float32 arrays, returned as new arrays)."""
    g = g32.astype(np.float64) * scale
    lr, eps, d = cfg.learning_rate, cfg.epsilon, cfg.dim
    w64 = w.astype(np.float64)
    s = s.copy()
    if cfg.optimizer == "sgd":
        w64 = w64 - lr * g
    elif cfg.optimizer == "adagrad":
        s[0] = f32(float(s[0]) + float(np.sum(g * g)) / d)
        w64 = w64 - lr / (math.sqrt(float(s[0])) + eps) * g
    elif cfg.optimizer == "std_adagrad":
        s[:] = f32(s.astype(np.float64) + g * g)
        w64 = w64 - lr * g / (np.sqrt(s.astype(np.float64)) + eps)
    elif cfg.optimizer == "adam":
        b1, b2 = cfg.beta1, cfg.beta2
        s[2 * d] = f32(float(s[2 * d]) * b1)
        s[2 * d + 1] = f32(float(s[2 * d + 1]) * b2)
        step = lr * math.sqrt(1.0 - float(s[2 * d + 1])) / (1.0 - float(s[2 * d]))
        s[:d] = f32(b1 * s[:d].astype(np.float64) + (1 - b1) * g)
        s[d:2 * d] = f32(b2 * s[d:2 * d].astype(np.float64) + (1 - b2) * g * g)
        w64 = w64 - step * s[:d].astype(np.float64) / (np.sqrt(s[d:2 * d].astype(np.float64)) + eps)
    elif cfg.optimizer == "ftrl":
        z, n = s[:d].astype(np.float64), s[d:].astype(np.float64)
        sigma = (np.sqrt(n + g * g) - np.sqrt(n)) / lr
        s[:d] = f32(z + g - sigma * w64)
        s[d:] = f32(n + g * g)
        z, n = s[:d].astype(np.float64), s[d:].astype(np.float64)
        w64 = np.where(np.abs(z) <= cfg.ftrl_l1, 0.0,
                       -(z - np.sign(z) * cfg.ftrl_l1) / ((cfg.ftrl_beta + np.sqrt(n)) / lr + cfg.ftrl_l2))
    w64 = np.clip(w64, cfg.min_bound, cfg.max_bound)
    return f32(w64), s


class NaiveTable:
    """The table's semantics over a dict: key -> [values, state, show, click, last_seen]."""

    def __init__(self, cfg: TableConfig, clock):
        self.cfg = cfg
        self.clock = clock
        self.rows: dict[int, list] = {}
        self.counts: dict[int, int] = {}

    def pull(self, keys, init_missing=False) -> np.ndarray:
        out = np.zeros((len(keys), self.cfg.dim), np.float32)
        admission = self.cfg.min_count > 1 or self.cfg.admit_probability < 1
        for i, k in enumerate(int(k) for k in keys):
            if k in self.rows:
                out[i] = self.rows[k][0]
            elif init_missing and not admission:
                out[i] = initial_values(self.cfg, k)
        return out

    def _admit(self, key: int, inc: int) -> bool:
        cfg = self.cfg
        if not (cfg.min_count > 1 or cfg.admit_probability < 1):
            return True
        c = min(self.counts.get(key, 0) + inc, 0xFFFFFFFF)
        self.counts[key] = c
        if c < cfg.min_count:
            return False
        return cfg.admit_probability >= 1 or uniform01((cfg.seed % (1 << 64)) ^ ADMIT_SALT, key, c) < cfg.admit_probability

    def push(self, keys, grads, shows=None, clicks=None, delta=False):
        combined: dict[int, list] = {}
        for i, k in enumerate(int(k) for k in keys):
            if k not in combined:
                combined[k] = [grads[i].astype(np.float32).copy(), 0, np.float32(0), np.float32(0)]
            else:
                combined[k][0] = combined[k][0] + grads[i]
            combined[k][1] += 1
            if shows is not None:
                combined[k][2] = np.float32(combined[k][2] + shows[i])
                combined[k][3] = np.float32(combined[k][3] + clicks[i])
        now = int(self.clock())
        for k, (g, count, show, click) in combined.items():
            if k not in self.rows:
                occurrences = int(np.float32(show) + np.float32(0.5)) if shows is not None and show >= 1 else count
                if not self._admit(k, occurrences):
                    continue
                self.rows[k] = [initial_values(self.cfg, k), initial_state(self.cfg), np.float32(0),
                                np.float32(0), now]
            row = self.rows[k]
            if delta:
                row[0] = np.clip(f32(row[0] + g), np.float32(self.cfg.min_bound), np.float32(self.cfg.max_bound))
            else:
                scale = 1.0 / float(show) if shows is not None and show > 0 else 1.0
                row[0], row[1] = optimizer_step(self.cfg, row[0], row[1], g, scale)
            if shows is not None:
                row[2] = np.float32(row[2] + show)
                row[3] = np.float32(row[3] + click)
            else:
                row[2] = np.float32(row[2] + np.float32(count))
            row[4] = now

    def shrink(self, now) -> int:
        cfg = self.cfg
        dead = []
        for k, row in self.rows.items():
            row[2] = np.float32(row[2] * np.float32(cfg.show_click_decay))
            row[3] = np.float32(row[3] * np.float32(cfg.show_click_decay))
            score = (float(row[2]) - float(row[3])) * cfg.nonclk_coeff + float(row[3]) * cfg.click_coeff
            expired = cfg.expire_after is not None and int(now) - row[4] > int(cfg.expire_after)
            if score < cfg.delete_threshold or expired:
                dead.append(k)
        for k in dead:
            del self.rows[k]
        self.counts = {k: c // 2 for k, c in self.counts.items()}
        return len(dead)
