"""Reading a config file as DeepSpeed reads one: JSON, or hjson where JSON
cannot read it (trailing commas, comments), repeated keys refused, and every
failure one ConfigError naming the file."""

from __future__ import annotations

import copy
import json
import os
import stat
from collections import Counter
from pathlib import Path
from typing import Any, Union

import hjson

from zcore.config.keys import show_value
from zcore.errors import ConfigError

_MAX_CONFIG_FILE = 1 << 20  # bytes; DeepSpeed configs are a few KB


def config_dict(config: Union[dict, str, os.PathLike, None]) -> dict:
    """A config as an integration receives it (a dict, copied so that the
    integration may complete it; a file's path; None: empty) as a dict."""
    if config is None:
        return {}
    if isinstance(config, dict):
        return copy.deepcopy(config)
    return read_config_file(Path(config))


def read_config_file(path: Path) -> dict:
    name = repr(str(path))
    try:
        # O_NONBLOCK: a FIFO given as the config must not block the open.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"config file {name} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {name}: {exc.strerror}") from None
    except ValueError as exc:  # a NUL byte, or a character the filesystem encoding lacks
        raise ConfigError(f"config file {name} is not a usable path: {exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"config file {name} is not a regular file; give the path of a JSON file")
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(_MAX_CONFIG_FILE + 1)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {name}: {exc.strerror}") from None
    if len(data) > _MAX_CONFIG_FILE:
        raise ConfigError(f"config file {name} is larger than {_MAX_CONFIG_FILE} bytes; is it a config?")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {name} is not UTF-8 text (byte {exc.start}); save it as UTF-8 JSON") from None
    # Every way json.loads can fail becomes one error naming the file: a
    # JSONDecodeError, a repeated key, a ValueError (an integer past Python's
    # int_max_str_digits), a RecursionError (values nested past the stack).
    try:
        raw = json.loads(text, object_pairs_hook=_refuse_duplicate_keys)
    except _DuplicateKeyError as exc:
        raise ConfigError(f"config file {name} {exc}") from None
    except RecursionError:
        raise ConfigError(f"config file {name} is not valid JSON: nested too deeply") from None
    except json.JSONDecodeError as exc:
        raw = _read_as_hjson(text, name, exc)
    except ValueError:
        raise ConfigError(f"config file {name} is not valid JSON: a number with too many digits") from None
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config file {name} holds a JSON {type(raw).__name__}; a zcore (DeepSpeed) config is a JSON object"
        )
    return raw


def _read_as_hjson(text: str, name: str, json_error: json.JSONDecodeError) -> Any:
    """A file JSON cannot read, read as DeepSpeed reads config files: with
    hjson, which takes trailing commas, missing commas at line ends and
    comments (as some frameworks' templates have them)."""
    try:
        return hjson.loads(text, object_pairs_hook=_refuse_duplicate_keys)
    except _DuplicateKeyError as exc:
        raise ConfigError(f"config file {name} {exc}") from None
    # hjson's parser fails on untrusted text in several ways (its decode
    # error, an overflow, a recursion past the stack): each is the same
    # verdict, reported with JSON's more precise position.
    except Exception:
        raise ConfigError(
            f"config file {name} is not valid JSON: {json_error} (nor hjson, which DeepSpeed also reads)"
        ) from None


class _DuplicateKeyError(ValueError):
    """A key repeated in one JSON object of a config file."""


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    # json keeps the last of repeated keys, which silently ignores a setting;
    # DeepSpeed's loader refuses them too (dict_raise_error_on_duplicate_keys).
    obj = dict(pairs)
    if len(obj) != len(pairs):
        repeated = [k for k, n in Counter(k for k, _ in pairs).items() if n > 1]
        raise _DuplicateKeyError(
            f"repeats the key(s) {show_value(repeated)} in one JSON object (keys there: "
            f"{show_value(list(obj))}); JSON would keep only the last value: keep one"
        )
    return obj
