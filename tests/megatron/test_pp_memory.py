"""lce_train.pp_memory (the per-stage memory model), lce_train.pp_split (the recommender) and
lce_train.pp_memory_balance, on the CPU in a few seconds: each term against a hand count, the
recommender against brute force on small cases, the script on every shipped config."""

import dataclasses
import importlib.util
import itertools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from lce_train import pp_memory as pm
from lce_train import pp_memory_balance, pp_split
from lce_train.configs import ModelConfig, known_models, load_model_config

DOCS = Path(__file__).resolve().parents[2] / "docs"

TINY = load_model_config("tiny")  # h 64, 4 heads x 16, 4 kv groups, ffn 256, vocab 1000, 2 layers
# ffn = 8h/3: a gated MLP that stores as much as the paper's 4h GeLU MLP (6 f / h = 16).
PAPER = ModelConfig(name="paper", vocab_size=1000, hidden_size=96, num_layers=4,
                    num_attention_heads=4, num_query_groups=4, kv_channels=24,
                    ffn_hidden_size=256)


def test_layer_params_by_hand():
    # attention 64*16*(4 + 2*4) + 4*16*64 = 16384, MLP 3*64*256 = 49152, norms 2*64.
    assert pm.layer_params(TINY, 1) == 16384 + 49152 + 128
    assert pm.layer_params(TINY, 2) == (16384 + 49152) / 2 + 128


def test_bytes_per_param():
    assert pm.bytes_per_param(pm.Layout()) == 18
    assert pm.bytes_per_param(pm.Layout(dp=4, distributed_optimizer=True)) == 6 + 3


def test_activations_match_korthikanti():
    # The paper's formulas, with 7 bytes per attention score (fp32 softmax) instead of its 5.
    s, b, h, a = 128, 2, 96, 4
    sbh = s * b * h
    lay = pm.Layout(seq_length=s, micro_batch=b, recompute="none")
    assert pm.SCORE_BYTES == 7
    assert pm.layer_activation_bytes(PAPER, lay) == pytest.approx(sbh * (34 + 7 * a * s / h))
    tp = lay.replace(tp=4)
    assert pm.layer_activation_bytes(PAPER, tp) == pytest.approx(
        sbh * (10 + 24 / 4 + 7 * a * s / (h * 4)))
    sp = tp.replace(sequence_parallel=True)
    assert pm.layer_activation_bytes(PAPER, sp) == pytest.approx(sbh * (34 + 7 * a * s / h) / 4)
    assert pm.layer_activation_bytes(PAPER, sp.replace(recompute="selective")) == \
        pytest.approx(sbh * 34 / 4)
    assert pm.layer_activation_bytes(PAPER, tp.replace(recompute="selective")) == \
        pytest.approx(sbh * (10 + 24 / 4))
    assert pm.layer_activation_bytes(PAPER, sp.replace(recompute="full")) == 2 * sbh / 4
    assert pm.layer_activation_bytes(PAPER, tp.replace(recompute="full")) == 2 * sbh


def test_activations_gated_mlp():
    # tiny: 6 f / h = 24, so 10 + 8 + 24 = 42 bytes per s b h, plus 7 a s / h = 56 for the scores.
    lay = pm.Layout(seq_length=128, micro_batch=2, recompute="none")
    assert pm.layer_activation_bytes(TINY, lay) == 128 * 2 * 64 * (42 + 56)


def test_backward_working_set():
    # local attention: fp32 softmax gradients, 8 bytes x heads x s^2 x b / t; else the MLP's.
    lay = pm.Layout(seq_length=128, micro_batch=2, tp=2, recompute="none")
    assert pm.layer_backward_bytes(TINY, lay) == 8 * 4 * 128 * 128 * 2 / 2
    assert pm.layer_backward_bytes(TINY, lay.replace(recompute="selective")) == \
        8 * 128 * 2 * 256 / 2


def test_inflight_1f1b():
    lay = pm.Layout(pp=4, num_microbatches=8)
    assert [len(pm.inflight_chunks(lay, r)) for r in range(4)] == [4, 3, 2, 1]
    few = lay.replace(num_microbatches=2)
    assert [len(pm.inflight_chunks(few, r)) for r in range(4)] == [2, 2, 2, 1]


def test_inflight_interleaved_matches_paper():
    p, v = 4, 2
    lay = pm.Layout(pp=p, vpp=v, num_microbatches=8)
    # rank 0: (p - 1) * 2 + (v - 1) * p = 10 warm-up forwards + 1, p at a time per chunk.
    assert pm.inflight_chunks(lay, 0) == [0] * 4 + [1] * 4 + [0] * 3
    # with even chunks that is p (1 + (p - 1) / (p v)) stage-equivalents (Korthikanti et al.).
    assert len(pm.inflight_chunks(lay, 0)) / v == p * (1 + (p - 1) / (p * v))
    assert len(pm.inflight_chunks(lay, 3)) == 5
    assert len(pm.inflight_chunks(lay.replace(num_microbatches=1), 0)) == 2  # all m v of them


def test_loss_terms():
    lay = pm.Layout(seq_length=128, micro_batch=2, tp=2)
    assert pm.padded_vocab(TINY, lay) == 1024  # a multiple of 128 x TP
    assert pm.loss_bytes(TINY, lay) == 256 * 512 * 6
    big = dataclasses.replace(TINY, vocab_size=256000)
    cce = lay.replace(loss="cce", cce_backward="gemm")
    assert pm.loss_bytes(big, cce.replace(seq_length=4096)) == 512 * pm.MIB + 8192 * 16
    assert pm.loss_bytes(TINY, cce) == 256 * 512 * 4 + 256 * 16  # below the scratch bound


def test_loss_terms_of_the_gradient_in_forward_default():
    big = dataclasses.replace(TINY, vocab_size=256000)  # padded to 256000 at TP=2
    lay = pm.Layout(seq_length=4096, micro_batch=2, tp=2, loss="cce")
    d, vocab = big.hidden_size, 128000
    # 8192 tokens: two chunks of 4096 rows, fp32 input-gradient partials (TP=2), a 16-bit
    # weight gradient (two chunks sum in its own dtype).
    expected = 4096 * vocab * 2 + 8192 * d * 4 + vocab * d * 2 + 8192 * 16
    assert pm.loss_bytes(big, lay) == expected
    # A budget that cannot hold 1024 tokens' logits: the recomputing backward within it.
    assert pm.loss_bytes(big, lay.replace(scratch_mb=12.0)) == 12 * pm.MIB + 8192 * 16


def test_stage_memory_composition():
    lay = pm.Layout(pp=2, num_microbatches=4, seq_length=128)
    first, last = pm.stage_memory(TINY, lay, [1, 1])
    embed = 1024 * 64
    assert first.states == 18 * (pm.layer_params(TINY, 1) + embed)
    assert last.states == 18 * (pm.layer_params(TINY, 1) + embed + 64)
    act = pm.layer_activation_bytes(TINY, lay)
    assert (first.activations, last.activations) == (2 * act, act)
    assert (first.loss, last.loss) == (0, pm.loss_bytes(TINY, lay))
    working = pm.layer_backward_bytes(TINY, lay)
    assert (first.backward, last.backward) == (working, working)
    # the loss's transient and a layer's backward do not coincide: the larger one counts
    assert last.total == last.states + last.activations + max(last.loss, working)
    tied = dataclasses.replace(TINY, tie_embeddings=True)
    assert pm.stage_memory(tied, lay, [1, 1])[1].states == last.states  # a copy on the last
    (alone,) = pm.stage_memory(tied, lay.replace(pp=1), [2])
    assert alone.states == 18 * (2 * pm.layer_params(TINY, 1) + embed + 64)  # counted once
    with pytest.raises(ValueError, match=r"split \[2, 1\] must give 2 layers to 2 virtual stages"):
        pm.stage_memory(TINY, lay, [2, 1])


def test_full_recompute_adds_one_layer_back():
    lay = pm.Layout(pp=2, num_microbatches=4, seq_length=128, recompute="full")
    first = pm.stage_memory(TINY, lay, [1, 1])[0]
    assert first.activations == 2 * pm.layer_activation_bytes(TINY, lay) + \
        pm.layer_activation_bytes(TINY, lay, "selective")


def _compositions(n, k, low=1):
    for cuts in itertools.combinations(range(1, n - k * (low - 1)), k - 1):
        parts = [b - a for a, b in zip((0,) + cuts, cuts + (n - k * (low - 1),))]
        yield [x + low - 1 for x in parts]


SMALL = [
    (dict(num_layers=7, vocab_size=50000), dict(pp=3, num_microbatches=6, seq_length=512)),
    (dict(num_layers=9, vocab_size=128000), dict(pp=4, num_microbatches=8, seq_length=1024)),
    (dict(num_layers=8, vocab_size=256000, tie_embeddings=True),
     dict(pp=2, num_microbatches=2, seq_length=2048, recompute="full")),
    (dict(num_layers=10, vocab_size=32000), dict(pp=5, num_microbatches=3, seq_length=256,
                                                tp=2, sequence_parallel=True)),
]


@pytest.mark.parametrize("loss", ["native", "cce"])
@pytest.mark.parametrize("shape,layout", SMALL)
def test_recommender_is_brute_force_optimal(shape, layout, loss):
    cfg = dataclasses.replace(TINY, **shape)
    lay = pm.Layout(loss=loss, **layout)
    every = list(_compositions(cfg.num_layers, lay.pp))
    best = min(pm.peak(cfg, lay, sp) for sp in every)
    assert pm.peak(cfg, lay, pp_split.best_any(cfg, lay)) == pytest.approx(best)
    family = [sp for sp in every if len(set(sp[1:-1])) <= 1]
    best_family = min(pm.peak(cfg, lay, sp) for sp in family)
    assert pm.peak(cfg, lay, pp_split.best_first_last(cfg, lay)) == pytest.approx(best_family)
    rec = pp_split.recommend(cfg, lay)
    assert rec.peak == pytest.approx(best)
    if cfg.num_layers % lay.pp == 0:
        assert rec.peak <= pm.peak(cfg, lay, [cfg.num_layers // lay.pp] * lay.pp)
    if rec.flags:
        first, last = rec.split[0], rec.split[-1]
        assert pp_split.stage_layer_counts(cfg.num_layers, lay.pp, first, last) == rec.split


def test_recommender_interleaved_brute_force():
    cfg = dataclasses.replace(TINY, num_layers=10, vocab_size=128000)
    lay = pm.Layout(pp=2, vpp=2, num_microbatches=4, seq_length=1024)
    family = [sp for sp in _compositions(10, 4) if sp[1] == sp[2]]
    best = min(pm.peak(cfg, lay, sp) for sp in family)
    rec = pp_split.recommend(cfg, lay)
    assert rec.peak == pytest.approx(best) and rec.flags is None
    assert rec.layout.count("|") == 3 and rec.layout.startswith("E") and rec.layout.endswith("L")


def test_layout_string():
    assert pp_split.layout_string([3, 4, 1]) == "Et*3|t*4|t,L"
    assert pp_split.layout_string([0, 2, 0]) == "E|t*2|L"


def test_cce_buys_brute_force():
    cfg = dataclasses.replace(TINY, num_layers=8, vocab_size=256000)
    lay = pm.Layout(pp=4, num_microbatches=8, seq_length=1024)
    budget = pp_split.rebalanced_peak(cfg, lay)
    cce = lay.replace(loss="cce")
    fits = lambda **kw: pp_split.rebalanced_peak(cfg, cce.replace(**kw)) <= budget
    pp = pp_split.fewest_stages(cfg, cce, budget)
    assert pp == min(p for p in range(1, 9) if fits(pp=p))
    seq = pp_split.largest(cfg, cce, "seq_length", budget, step=128)
    assert seq > 1024 and fits(seq_length=seq) and not fits(seq_length=seq + 128)
    mb = pp_split.largest(cfg, cce, "micro_batch", budget)
    assert fits(micro_batch=mb) and not fits(micro_batch=mb + 1)
    assert pp_split.largest(cfg, cce, "micro_batch", 1.0) is None


def test_layout_validation():
    with pytest.raises(ValueError, match="recompute must be none, selective or full, got 'some'"):
        pm.Layout(recompute="some")
    with pytest.raises(ValueError, match=r"virtual pipeline stages need pp > 1"):
        pm.Layout(vpp=2)
    assert not pm.Layout(sequence_parallel=True).sp


def test_script_help():
    proc = subprocess.run([sys.executable, "-m", "lce_train.pp_memory_balance", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--measure" in proc.stdout


@pytest.mark.parametrize("config", known_models())
def test_script_on_every_config(config, tmp_path, capsys):
    pp_memory_balance.main(["--config", config, "--csv", str(tmp_path / "t.csv")])
    out = capsys.readouterr().out
    assert "rebalanced" in out and "longest sequence" in out
    rows = (tmp_path / "t.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * 2 * 2  # header + (native, cce) x (given, rebalanced) x 2 stages


def test_script_png(tmp_path):
    pytest.importorskip("matplotlib")
    pp_memory_balance.main(["--config", "gemma2_2b", "--png", str(tmp_path / "g.png")])
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"


def test_measure_dry_run_and_parser(capsys):
    pp_memory_balance.main(["--config", "gemma2_2b", "--measure", "--dry-run"])
    commands = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("$ torchrun")]
    assert len(commands) >= 2 and all("--log-json" in c for c in commands)
    assert any("--cross-entropy-fusion-impl cce" in c for c in commands)
    assert all("--num-layers 26" in c for c in commands)
    log = ('{"step": 1, "peak_gib": [1.0, 2.5], "resident_gib": [0.5, 0.7]}\n'
           '{"step": 2, "peak_gib": [1.5, 2.0], "resident_gib": [0.6, 0.6]}\n')
    assert pp_memory_balance.parse_peaks(log) == [1.5, 2.5]
    assert pp_memory_balance.parse_peaks(log, "resident_gib") == [0.6, 0.7]


def test_measure_runs_torchrun_under_this_interpreter(monkeypatch):
    """--measure needs no torchrun on PATH: a venv used without activating it has none."""
    launched = []

    class Launched(Exception):
        pass

    def run(cmd, check):
        launched.append(cmd)
        raise Launched

    monkeypatch.setattr(pp_memory_balance.subprocess, "run", run)
    with pytest.raises(Launched):
        pp_memory_balance.main(["--config", "gemma2_2b", "--measure"])
    assert launched[0][:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "lce_train.training" in launched[0]


def test_measure_overrides_layers_and_predicts_the_launchers_attention(capsys):
    pp_memory_balance.main(["--config", "llama3_8b", "--num-layers", "8",
                            "--pipeline-model-parallel-size", "4", "--measure", "--dry-run"])
    out = capsys.readouterr().out
    assert "--num-layers 8" in out and "[2, 2, 2, 2]" in out
    if importlib.util.find_spec("transformer_engine") is None:  # local attention: scores kept
        assert "predicting the measured runs with --recompute none" in out


def test_cce_backward_is_checked():
    with pytest.raises(ValueError, match="cce_backward must be auto or gemm"):
        pm.Layout(loss="cce", cce_backward="tiles")
    with pytest.raises(ValueError, match="scratch_mb must be > 0 or None"):
        pm.Layout(loss="cce", scratch_mb=0.0)


def _documented_studies() -> list[tuple[str, str]]:
    """docs/pp_memory_balance.md's study commands, each with the output block printed under it."""
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", (DOCS / "pp_memory_balance.md").read_text(),
                        flags=re.S | re.M)
    return [(command, output) for (lang, command), (next_lang, output) in zip(blocks, blocks[1:])
            if lang == "bash" and next_lang == "" and command.startswith("lce-pp-memory-balance ")]


def test_the_doc_shows_what_its_commands_print(tmp_path, capsys):
    """Each worked study's table and verdicts are what its command prints today, and the CSV
    committed beside the doc is what it writes."""
    studies = _documented_studies()
    assert len(studies) == 2, studies
    for command, shown in studies:
        words = shlex.split(command.replace("\\\n", " "))
        assert words[0] == "lce-pp-memory-balance", words
        argv = words[1:]
        csv = argv.index("--csv") + 1
        assert not argv[csv].startswith("docs/"), "the doc's command must not write into docs/"
        name = Path(argv[csv]).name
        argv[csv] = str(tmp_path / name)
        del argv[argv.index("--png"):argv.index("--png") + 2]
        pp_memory_balance.main(argv)
        printed = [line for line in capsys.readouterr().out.splitlines()
                   if not line.startswith("wrote ")]
        assert printed == shown.rstrip("\n").splitlines(), command
        assert (tmp_path / name).read_text() == (DOCS / "pp_memory_balance" / name).read_text()
