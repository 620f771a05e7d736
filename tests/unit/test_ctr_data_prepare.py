"""The launcher's data checks of the CTR programs (``ctr_data.prepare_data``, ``ctr.prepare``) on real
files: what a user set is what an error names, and every input is checked before any process starts."""
from __future__ import annotations

import pytest

from engine.errors import ConfigError
from engine.program_configs import DataConfig
from engine.programs.ctr_data import expected_schema, prepare_data
from streaming.criteo import convert_criteo, generate_criteo

SLOTS = ["C1", "C2"]
SCHEMA = expected_schema(SLOTS, 13)


@pytest.fixture(scope="module")
def criteo(tmp_path_factory):
    """A 40-line Criteo file and its two Arrow splits."""
    d = tmp_path_factory.mktemp("criteo")
    generate_criteo(d / "rows.txt", 40, 1)
    convert_criteo([d / "rows.txt"], d / "train", split="train", batch_size=8)
    convert_criteo([d / "rows.txt"], d / "test", split="test", batch_size=8)
    return d


@pytest.mark.parametrize("key", ["train_path", "test_path"])
def test_stdin_as_a_split_is_a_config_error_naming_the_key(criteo, key):
    """'-' (stdin) was resolved to ./- and ended in a launcher traceback, exit 1."""
    paths = {"train_path": str(criteo / "train"), "test_path": str(criteo / "test"), key: "-"}
    with pytest.raises(ConfigError, match=rf"^model\.data\.{key}: '-' \(stdin\) cannot be a split of a CTR job"):
        prepare_data(DataConfig(source="arrow", **paths), SCHEMA)


def test_a_criteo_file_without_test_rows_names_the_file_not_the_cache(tmp_path):
    """4 lines give no test row (line i is a test row when i % 5 == 4): the error named
    model.data.test_path and a directory under the cache, neither of which the user set."""
    text = tmp_path / "four.txt"
    generate_criteo(text, 4, 1)
    cfg = DataConfig(source="criteo", criteo_path=str(text), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError) as e:
        prepare_data(cfg, SCHEMA)
    assert str(e.value).startswith(f"model.data.criteo_path: {text} has no test row (the canonical split makes "
                                   f"line i a test row when i % 5 == 4"), str(e.value)
    assert "cache" not in str(e.value) and "test_path" not in str(e.value)
    generate_criteo(text, 5, 1)                                    # one test row: accepted
    out = prepare_data(cfg, SCHEMA)
    assert out.source == "arrow" and out.test_path.startswith(str(tmp_path / "cache"))
