"""Model shapes from configs/models/*.yaml, mapped one to one onto :class:`ModelConfig`.

The benchmarks, the launcher and the pipeline-memory study all read shapes from here, so a
model is described once. This folder is installed as ``lce_train.configs`` with its YAML files
as package data, so the loader sits beside the files it reads, in a checkout and in a wheel
alike. A name resolves to ``models/<name>.yaml`` here; a path is read as it is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer's shape."""

    name: str
    vocab_size: int
    """Classes of the output layer (the tokenizer's vocabulary, before any TP padding)."""
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    """Key/value heads (grouped-query attention); equal to the heads for plain attention."""
    kv_channels: int
    """Width of one attention head."""
    ffn_hidden_size: int
    tie_embeddings: bool = False
    """The output layer reuses the input embedding's weight."""
    logit_softcap: float | None = None
    """Final-logit soft-capping (Gemma-2), None for none."""

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                      "num_query_groups", "kv_channels", "ffn_hidden_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{self.name}: {field} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"{self.name}: num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_query_groups ({self.num_query_groups})"
            )


def config_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return path
    return CONFIG_DIR / "models" / f"{name_or_path}.yaml"


def load_model_config(name_or_path: str) -> ModelConfig:
    """Read a model shape by name (``gemma2_2b``) or by path."""
    import yaml

    path = config_path(name_or_path)
    if not path.exists():
        known = sorted(p.stem for p in (CONFIG_DIR / "models").glob("*.yaml"))
        raise ValueError(f"no model config {name_or_path!r}; known: {', '.join(known)}")
    raw = yaml.safe_load(path.read_text())
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = set(raw) - fields
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}; expected {sorted(fields)}")
    return ModelConfig(**raw)


def known_models() -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / "models").glob("*.yaml"))
