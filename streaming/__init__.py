"""Arrow sources, raw-format converters, feature hashing, batching, prefetch and hourly partitions.

Public entry points:

* ``streaming.keys`` — the feature-key layout (``HASH_VERSION``, ``hash_array``, ``make_keys``, ...).
* ``streaming.criteo`` — ``convert_criteo`` (Criteo TSV → Arrow IPC stream parts), ``generate_criteo``.
* ``streaming.source`` — ``ArrowSource`` (IPC/Parquet/stdin → fixed-size record batches).
* ``streaming.errors`` — ``DataFormatError``, ``SchemaError``.
"""
