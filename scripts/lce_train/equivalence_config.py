"""The training-equivalence experiment's configuration: the file
configs/experiments/training_equivalence.yaml read into :class:`Experiment` (its launcher flags,
corpora, variants, seeds and :class:`Targets`), and the :class:`Job` of one run, named
``<corpus>_<variant>_s<seed>`` as its logs are.

The command line is :mod:`lce_train.training_equivalence`; the other modules of the experiment
(``equivalence_run``, ``equivalence_logs``, ``equivalence_report``, ``equivalence_plots``) all
read this one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from lce_train.configs import CONFIG_DIR

# The source checkout this module lies in (scripts/lce_train/ -> its root), None where it is
# installed from a wheel: the text corpus's default folder is then ./.data, not a folder inside
# site-packages, and the runs start in the current directory.
_HERE = Path(__file__).resolve().parent
CHECKOUT = (_HERE.parents[1] if _HERE.parent.name == "scripts"
            and (_HERE.parents[1] / "setup.py").is_file() else None)
DEFAULT_CONFIG = CONFIG_DIR / "experiments" / "training_equivalence.yaml"


@dataclass(frozen=True)
class Targets:
    reference: str
    """The variant others are compared with (megatron's loss)."""
    candidate: str
    """The variant that must match it (fused_lce's default op)."""
    loss_nats: float
    """Largest allowed |final loss difference|, means over seeds, train and validation."""
    probe: str
    """The probe variant whose gradient error is checked (the default op)."""
    grad_rel_err: float
    """Largest allowed relative gradient error at any probe."""


@dataclass(frozen=True)
class Experiment:
    """configs/experiments/training_equivalence.yaml, key for key (its comments explain them)."""

    launcher: dict
    steps: int
    seeds: list[int]
    corpora: dict[str, dict]
    variants: dict[str, dict]
    matrix_variants: list[str]
    targets: Targets
    cpu_smoke: dict

    def smoke(self) -> Experiment:
        """The tiny CPU version: ``cpu_smoke`` merged over the launcher flags and corpora."""
        smoke = self.cpu_smoke
        corpora = {name: {**flags, **smoke.get("corpora", {}).get(name, {})}
                   for name, flags in self.corpora.items()}
        return dataclasses.replace(self, launcher={**self.launcher, **smoke.get("launcher", {})},
                                   steps=smoke.get("steps", self.steps), corpora=corpora)


def load_experiment(path: str | Path) -> Experiment:
    import yaml

    raw = yaml.safe_load(Path(path).read_text())
    fields = {f.name for f in dataclasses.fields(Experiment)}
    unknown, missing = set(raw) - fields, fields - set(raw)
    if unknown or missing:
        raise SystemExit(f"{path}: unknown keys {sorted(unknown)}, missing {sorted(missing)}")
    exp = Experiment(**{**raw, "targets": Targets(**raw["targets"])})
    for kind, names in (("corpus", exp.corpora), ("variant", exp.variants)):
        bad = [n for n in names if "_" in n]
        if bad:
            raise SystemExit(f"{path}: {kind} names may not contain '_' (log names are "
                             f"<corpus>_<variant>_s<seed>): {bad}")
    unknown_variants = set(exp.matrix_variants) - set(exp.variants)
    if unknown_variants:
        raise SystemExit(f"{path}: matrix_variants names unknown variants {unknown_variants}")
    return exp


@dataclass(frozen=True)
class Job:
    corpus: str
    variant: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.corpus}_{self.variant}_s{self.seed}"


def parse_run_name(stem: str) -> Job | None:
    corpus, _, rest = stem.partition("_")
    variant, _, seed = rest.rpartition("_s")
    if not (corpus and variant and seed.isdigit()):
        return None
    return Job(corpus, variant, int(seed))
