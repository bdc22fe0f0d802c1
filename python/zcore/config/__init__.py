"""The configuration: DeepSpeed's JSON schema as zcore reads it, validated
(``Config``), and the policies the runtime takes from it."""

from zcore.config.schema import Config, load_config

__all__ = ["Config", "load_config"]

load_config.__module__ = __name__
