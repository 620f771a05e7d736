"""Arrow sources, raw-format converters, feature hashing, batching, prefetch and hourly partitions."""
