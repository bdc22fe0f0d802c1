"""The config file as untrusted input, fuzzed with hypothesis: arbitrary
bytes as the config file (near-valid ones among them), files that break JSON
readers, and arbitrary text as its path. A file JSON cannot read is read as
DeepSpeed reads config files, with hjson. Each either loads as the JSON object
it holds would or raises zcore's error naming the file; nothing else escapes.

What is accepted, and as what, is stated on its own in config_reference.py
and here (a file is at most 1 MiB of UTF-8 holding one JSON (or hjson) object
without repeated keys), not read from zcore.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import hjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from zcore.config.schema import load_config
from config_reference import BASE, FUZZ, JSON, REFUSED, assert_holds, expected_config, refusal


@st.composite
def mutated_base(draw: st.DrawFn) -> bytes:
    """The base config's text with a few bytes replaced: mostly near-valid."""
    text = json.dumps(BASE).encode()
    at = draw(st.integers(0, len(text)))
    cut = draw(st.integers(0, 4))
    return text[:at] + draw(st.binary(max_size=4)) + text[at + cut:]


def json_text(value: Any) -> bytes:
    try:
        return json.dumps(value).encode()
    except ValueError:  # 10**5000: json.dumps refuses ints past int_max_str_digits
        return b"9" * 5000


# Files that break readers, by name (their reprs are too long to report).
NASTY_FILES = {
    "deep array": b"[" * 100_000,
    "deep object": b'{"a":' * 100_000,
    "deep closed array": b"[" * 100_000 + b"]" * 100_000,
    "duplicate key": b'{"train_batch_size": 8, "train_batch_size": 16}',
    "duplicate nested key": b'{"zero_optimization": {"stage": 2, "stage": 3}, "train_batch_size": 8}',
    "5000-digit integer": b'{"train_batch_size": ' + b"9" * 5000 + b"}",
    "float overflow": b'{"train_batch_size": 1e400}',
    "NaN": b'{"train_batch_size": 8, "gradient_clipping": NaN}',
    "long string": b'{"train_batch_size": 8, "x": "' + b"y" * 500_000 + b'"}',
    "past 1 MiB": b'{"train_batch_size": 8, "x": "' + b"y" * (1 << 20) + b'"}',
    "UTF-8 BOM": b"\xef\xbb\xbf" + json.dumps(BASE).encode(),
    "UTF-16": json.dumps(BASE).encode("utf-16"),
    "encoded surrogate": b'{"train_batch_size": 8, "x": "\xed\xa0\x80"}',  # not UTF-8
    "empty": b"",
    "NULs": b"\x00" * 64,
}


def no_duplicates(pairs: list) -> dict:
    if len({k for k, _ in pairs}) != len(pairs):
        raise ValueError("duplicate key")
    return dict(pairs)


def expected_from_file(data: bytes) -> Any:
    """A config file is at most 1 MiB of UTF-8 holding one object without
    repeated keys, in JSON or, where JSON cannot read it, in hjson (as
    DeepSpeed reads config files); then it loads as that object would."""
    if len(data) > 1 << 20:
        return REFUSED
    try:
        text = data.decode("utf-8")
        raw = json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError:
        try:
            raw = hjson.loads(text, object_pairs_hook=no_duplicates)
        except Exception:  # hjson fails in many ways; each is a refusal
            return REFUSED
    except (ValueError, RecursionError):
        return REFUSED
    return expected_config(raw) if isinstance(raw, dict) else REFUSED


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("config-fuzz")


def check_config_file(content: bytes, path: Path) -> None:
    path.write_bytes(content)
    expected = expected_from_file(content)
    if expected is REFUSED:
        assert str(path) in refusal(path)
    else:
        assert_holds(expected, load_config(path))


@FUZZ
@given(content=st.binary(max_size=64) | JSON.map(json_text) | mutated_base())
def test_any_bytes_as_the_config_file_load_or_are_refused_naming_the_file(content, files):
    check_config_file(content, files / "ds_config.json")


@pytest.mark.parametrize("name", sorted(NASTY_FILES))
def test_files_that_break_json_readers_are_refused_naming_the_file(name, files):
    check_config_file(NASTY_FILES[name], files / "ds_config.json")


@FUZZ
@given(name=st.text(max_size=20) | st.sampled_from(["\x00", "a\x00b", "\ud800", "x" * 5000, "", ".", "..", "/"]))
def test_any_text_as_the_config_path_is_refused_naming_it(name, files):
    path = str(files / "missing") + "/" + name
    assert repr(str(Path(path)))[1:-1] in refusal(path)
