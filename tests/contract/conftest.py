"""Fixtures shared by the contract suites (one suite run against every implementation of an interface).

Storage backends (local, moto S3, HDFS) live in ``storage_fixtures``; add other suites' fixtures below.
"""
from tests.contract.storage_fixtures import (  # noqa: F401  (fixtures are found by name)
    moto_s3,
    s3_bucket,
    s3_root_uri,
    s3_storage_options,
    storage,
)
