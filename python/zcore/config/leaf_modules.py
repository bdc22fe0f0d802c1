"""The config section ``zero_optimization.leaf_module``: which modules ZeRO-3
gathers as one unit (zcore.zero3.leaf_modules), as DeepSpeed 0.19.8 reads it.

By default it names the sparse mixture-of-experts blocks of Hugging Face's
Mixtral, Qwen2-MoE and Qwen3-MoE, as DeepSpeed's does, so that those models
train at stage 3 without marking anything.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from zcore.config.section import Section

DEFAULT_LEAF_MODULE_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


class LeafModuleConfig(Section):
    classes: list[str] = Field(
        default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES),
        description=(
            "Stage 3: modules of these classes (a class's `__name__` or its `module.QualName`) are leaves, "
            "gathered whole when entered, so ranks may run different parts of them (mixture-of-experts "
            "routing). Default: the sparse MoE blocks of Mixtral, Qwen2-MoE and Qwen3-MoE."
        ),
    )
    names: list[str] = Field(
        default_factory=list,
        description="Stage 3: the modules with these names in `model.named_modules()` are leaves.",
    )
    name_suffixes: list[str] = Field(
        default_factory=list,
        description="Stage 3: the modules whose names in `model.named_modules()` end with one of these are leaves.",
    )

    @field_validator("classes", "names", "name_suffixes", mode="before")
    @classmethod
    def _one_as_a_list(cls, v: Any) -> Any:
        # DeepSpeed takes a single string for a list of one.
        return [v] if isinstance(v, str) else v

    @field_validator("classes", "names", "name_suffixes")
    @classmethod
    def _without_repeats(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(v))

    @property
    def customised(self) -> bool:
        """Whether any entry differs from DeepSpeed's defaults."""
        return list(self.classes) != list(DEFAULT_LEAF_MODULE_CLASSES) or bool(self.names or self.name_suffixes)
