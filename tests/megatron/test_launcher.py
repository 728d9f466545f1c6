"""scripts/pretrain_gpt.py on real megatron-core over gloo: flags, plans, losses, resume.

Tiers: flags and --dry-run in this process (no ranks); the pipeline split against megatron's own
get_num_layers_to_build; lce_train.megatron_cpu's patches; then torchrun jobs of two CPU
processes each, which train the tiny model (2 layers, hidden 64, vocab 1000, sequence 32,
micro-batch 2) for a few steps:

    TP=2             cce, native and unfused megatron losses agree (one job, compare_losses)
    TP=2 + SP        the same with sequence parallelism
    PP=2 (TP=1)      the same with the loss on the last stage, loss counted in the split,
                     tied embeddings (tiny_tied)
    DP=2             distributed optimizer + bf16 (megatron's mixed-precision optimizer on CPU)
    resume           save at step 2, resume to 4 == an uninterrupted 4-step run, bitwise

About a minute and a half on two cores, mostly process start-up.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lce_train import arguments, evaluation, optimizer, training
from lce_train.configs import known_models
from lce_train.data import TokenWindows
from lce_train.pp_split import stage_layer_counts

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.filterwarnings("ignore:full scope is deprecated")

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"

TINY = ["--config", "tiny", "--num-layers", "2", "--hidden-size", "64", "--vocab-size", "1000",
        "--seq-length", "32", "--micro-batch-size", "2"]


_N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
two_ranks = pytest.mark.skipif(
    0 < _N_GPUS < 2, reason="the torchrun jobs need 2 GPUs on a CUDA machine (or none: gloo)")


def _run(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}")
    return proc


def _torchrun(script: str, *flags: str) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node=2", str(SCRIPTS / script), *flags])


def _compare(tmp_path, *flags: str, steps: int = 3) -> dict:
    out = tmp_path / "losses.json"
    proc = _run([sys.executable, "-m", "lce_train.compare_losses", "--steps", str(steps),
                 "--json", str(out), *TINY, *flags])
    result = json.loads(out.read_text())
    result["stdout"] = proc.stdout
    return result


def _assert_losses_agree(result: dict, tol: float = 1e-4) -> None:
    """Per-step losses and the norms of all parameter gradients (megatron's, before clipping)
    agree between cce and each other impl. megatron's fused ``native`` loss rounds the logit
    gradient to bf16 even in fp32 training, so its gradients are held to 5e-3 only."""
    for what in ("losses", "grad_norms"):
        ref = result[what]["cce"]
        assert all(v == v and 0 < v < 1e3 for v in ref), f"cce {what} not sane: {ref}"
        for impl, values in result[what].items():
            rel = [abs(a - b) / abs(b) for a, b in zip(ref, values)]
            tol = 5e-3 if (what, impl) == ("grad_norms", "native") else tol
            assert max(rel) <= tol, (
                f"cce vs {impl} {what}: worst relative difference {max(rel):.2e} > {tol:.0e}\n"
                + result["stdout"])


# ---------------------------------------------------------------------------------------------
# Flags and plans (no ranks)
# ---------------------------------------------------------------------------------------------


def test_help_lists_megatron_flags_and_cce(capsys):
    with pytest.raises(SystemExit) as exit_info:
        training.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                 "--sequence-parallel", "--context-parallel-size", "--micro-batch-size",
                 "--global-batch-size", "--cross-entropy-loss-fusion",
                 "--cross-entropy-fusion-impl", "--account-for-loss-in-pipeline-split",
                 "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                 "--untie-embeddings-and-output-weights", "--transformer-impl", "--dry-run",
                 "--save", "--load", "--mock-data", "--data-path"):
        assert flag in text, flag
    assert "cce" in text and "linear" in text


def test_help_as_a_script():
    proc = _run([sys.executable, str(SCRIPTS / "pretrain_gpt.py"), "--help"], timeout=120)
    assert "--cross-entropy-fusion-impl" in proc.stdout


@pytest.mark.parametrize("config", known_models())
def test_dry_run_each_config(config, capsys):
    training.main(["--config", config, "--dry-run", "--world-size", "8",
                       "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                       "2", "--sequence-parallel", "--cross-entropy-fusion-impl", "cce"])
    text = capsys.readouterr().out
    assert f"model       {config}:" in text
    assert "world 8 = TP 2 x PP 2 x CP 1 x DP 2" in text
    assert "stage 0   embedding" in text and "loss (cce)" in text


def test_dry_run_defaults_and_overrides(capsys):
    args = arguments.parse_args(["--config", "gemma2_2b", "--num-layers", "4",
                                    "--hidden-size", "128", "--vocab-size", "5000", "--dry-run"])
    assert args.model.num_layers == 4 and args.model.hidden_size == 128
    assert args.untie_embeddings_and_output_weights is False  # gemma2 ties
    assert args.padded_vocab_size == 5120
    args = arguments.parse_args(["--config", "llama3_8b", "--dry-run"])
    assert args.untie_embeddings_and_output_weights is True
    args = arguments.parse_args(["--cross-entropy-fusion-impl", "cce", "--dry-run"])
    assert args.cross_entropy_loss_fusion  # implied
    with pytest.raises(SystemExit, match="not divisible"):
        arguments.parse_args(["--pipeline-model-parallel-size", "2", "--num-layers", "2",
                                 "--account-for-loss-in-pipeline-split", "--dry-run"])


@pytest.mark.parametrize("case", [
    dict(num_layers=8, pp=2),
    dict(num_layers=7, pp=2, account_loss=True),
    dict(num_layers=6, pp=4, account_loss=True, account_embedding=True),
    dict(num_layers=10, pp=3, first=2, last=4),
    dict(num_layers=9, pp=4, last=3),
])
def test_stage_split_matches_megatron(case):
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    if "pp_rank" not in inspect.signature(get_num_layers_to_build).parameters:
        pytest.skip("this megatron-core's get_num_layers_to_build takes no pp_rank")
    ours = stage_layer_counts(
        case["num_layers"], case["pp"], case.get("first"), case.get("last"),
        case.get("account_embedding", False), case.get("account_loss", False))
    config = TransformerConfig(
        num_layers=case["num_layers"], hidden_size=64, num_attention_heads=4,
        pipeline_model_parallel_size=case["pp"], pipeline_dtype=torch.float32,
        num_layers_in_first_pipeline_stage=case.get("first"),
        num_layers_in_last_pipeline_stage=case.get("last"),
        account_for_embedding_in_pipeline_split=case.get("account_embedding", False),
        account_for_loss_in_pipeline_split=case.get("account_loss", False))
    theirs = [get_num_layers_to_build(config, pp_rank=r) for r in range(case["pp"])]
    assert ours == theirs


def test_heads_and_groups_must_split_over_tp(capsys):
    with pytest.raises(SystemExit, match=r"must divide the attention heads \(8\) and the "
                                         r"key/value groups \(4\)"):
        arguments.parse_args(["--config", "gemma2_like", "--tensor-model-parallel-size", "8",
                                 "--dry-run"])
    args = arguments.parse_args(["--config", "gemma2_like", "--tensor-model-parallel-size",
                                    "8", "--num-query-groups", "8", "--dry-run"])
    assert args.model.num_query_groups == 8


def test_local_attention_flag(monkeypatch):
    args = arguments.parse_args(["--local-attention", "sdpa", "--dry-run"])
    assert args.local_attention == "sdpa" and args.transformer_impl == "local"
    # With transformer-engine the layers bring their own attention: the flag is refused.
    monkeypatch.setattr(arguments, "_te_importable", lambda: True)
    with pytest.raises(SystemExit, match="--local-attention sdpa needs --transformer-impl local"):
        arguments.parse_args(["--local-attention", "sdpa", "--transformer-impl",
                                 "transformer_engine", "--dry-run"])


def test_learning_rate_schedule():
    args = arguments.parse_args(["--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters",
                                    "2", "--train-iters", "10", "--dry-run"])
    lrs = [optimizer.learning_rate(args, s) for s in range(1, 11)]
    assert lrs[0] == pytest.approx(5e-4) and lrs[1] == pytest.approx(1e-3)
    assert lrs[2] == pytest.approx(1e-3)  # first decay step runs at the peak
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:])) and lrs[-1] > 1e-4


def test_mock_data_is_seeded_and_step_addressed():
    args = arguments.parse_args([*TINY, "--global-batch-size", "4", "--dry-run"])
    data = TokenWindows(32, 1000, seed=7)
    a = [b["tokens"] for b in data.microbatches(3, args, 0, "cpu")]
    b = [b["tokens"] for b in TokenWindows(32, 1000, 7)
         .microbatches(3, args, 0, "cpu")]
    assert len(a) == 2 and all(torch.equal(x, y) for x, y in zip(a, b))
    other = next(data.microbatches(4, args, 0, "cpu"))["tokens"]
    assert not torch.equal(a[0], other)
    assert int(a[0].max()) < 1000 and a[0].shape == (2, 32)


def test_token_file_round_trip(tmp_path):
    from lce_train import build_token_file

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello world, hello again\n")
    (src / "b.md").write_text("# title\nworld\n")
    for tokenizer in ("byte", "word"):
        out = tmp_path / tokenizer
        build_token_file.main(["--source", str(src), "--out", str(out), "--tokenizer",
                               tokenizer, "--vocab-size", "300"])
        meta = json.loads(out.with_suffix(".json").read_text())
        tokens = np.fromfile(out.with_suffix(".bin"), dtype=meta["dtype"])
        assert int(tokens.max()) < meta["vocab_size"] and meta["num_tokens"] == len(tokens)
        text = build_token_file.decode(tokens.tolist(), meta)
        assert text == "hello world, hello again\n\n# title\nworld\n\n"


# ---------------------------------------------------------------------------------------------
# lce_train.megatron_cpu
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU mode applies only without CUDA")
def test_cpu_mode_patches_once():
    from megatron.core.pipeline_parallel import schedules

    from lce_train import megatron_cpu

    assert megatron_cpu.enable_cpu_mode() is True
    count = len(megatron_cpu.applied())
    assert megatron_cpu.enable_cpu_mode() is True and len(megatron_cpu.applied()) == count
    assert any("schedules" in line for line in megatron_cpu.applied())
    assert os.environ.get("TORCHDYNAMO_DISABLE") == "1"
    counter = schedules.torch.zeros([], dtype=torch.int, device="cuda")
    assert counter.device.type == "cpu"
    assert schedules.torch.cuda.current_device() == torch.device("cpu")
    assert schedules.torch.Tensor is torch.Tensor  # everything else is torch itself


# ---------------------------------------------------------------------------------------------
# Training jobs (torchrun, two ranks)
# ---------------------------------------------------------------------------------------------


@two_ranks
def test_tp2_cce_matches_megatron_losses(tmp_path):
    result = _compare(tmp_path, "--tensor-model-parallel-size", "2")
    _assert_losses_agree(result)
    # fp32 throughout: cce and megatron's unfused loss see the same math.
    assert result["losses"]["cce"] == pytest.approx(result["losses"]["unfused"], rel=1e-6)


@two_ranks
def test_tp2_sequence_parallel(tmp_path):
    result = _compare(tmp_path, "--tensor-model-parallel-size", "2", "--sequence-parallel")
    _assert_losses_agree(result)
    plain = _compare(tmp_path, "--tensor-model-parallel-size", "2", "--impls", "cce,unfused")
    # SP changes where the norms run, not the math.
    assert result["losses"]["cce"] == pytest.approx(plain["losses"]["cce"], rel=1e-5)


@two_ranks
def test_tp2_sequence_parallel_sdpa_attention(tmp_path):
    flags = ("--tensor-model-parallel-size", "2", "--sequence-parallel")
    result = _compare(tmp_path, *flags, "--local-attention", "sdpa")
    _assert_losses_agree(result)
    unfused = _compare(tmp_path, *flags, "--impls", "cce,unfused")
    # The same attention math (fp32 here) through another kernel.
    assert result["losses"]["cce"] == pytest.approx(unfused["losses"]["cce"], rel=1e-5)


@two_ranks
def test_pp2_cce_on_last_stage(tmp_path):
    # Tied embeddings: the last stage's output weight is a copy synced with the first stage's.
    result = _compare(tmp_path, "--config", "tiny_tied", "--tensor-model-parallel-size", "1",
                      "--pipeline-model-parallel-size", "2", "--num-layers", "3",
                      "--account-for-loss-in-pipeline-split", "--global-batch-size", "4")
    _assert_losses_agree(result)
    assert "PP 2" in result["stdout"] and "tied embeddings" in result["stdout"]


four_ranks = pytest.mark.skipif(
    0 < _N_GPUS < 4, reason="the torchrun job needs 4 GPUs on a CUDA machine (or none: gloo)")


@four_ranks
def test_tp2_pp2_tied_sequence_parallel(tmp_path):
    # The whole layout at once: vocab-parallel loss on the last of two stages, the tied output
    # weight a copy of the first stage's embedding, sequence-parallel norms.
    result = _compare(tmp_path, "--nproc", "4", "--config", "tiny_tied",
                      "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                      "--sequence-parallel", "--global-batch-size", "4",
                      "--impls", "cce,unfused")
    _assert_losses_agree(result)
    assert "PP 2" in result["stdout"] and "SP" in result["stdout"], result["stdout"]


@two_ranks
def test_dp2_distributed_optimizer_bf16(tmp_path):
    # megatron's distributed optimizer in bf16 (lce_train.optimizer raises rather than fall back
    # to AdamW when it is asked for), with cce and megatron's unfused loss as the reference.
    result = _compare(tmp_path, "--tensor-model-parallel-size", "1", "--global-batch-size", "4",
                      "--use-distributed-optimizer", "--bf16", "--impls", "cce,unfused", steps=2)
    assert "DP 2, gloo, bf16" in result["stdout"] and result["steps"] == [1, 2], result["stdout"]
    _assert_losses_agree(result)


@two_ranks
def test_resume_continues_bitwise(tmp_path):
    common = [*TINY, "--tensor-model-parallel-size", "2", "--cross-entropy-fusion-impl", "cce",
              "--lr", "3e-3", "--lr-decay-iters", "4"]
    ckpt = tmp_path / "ckpt"

    def losses(name: str, *flags: str) -> dict[int, float]:
        log = tmp_path / f"{name}.json"
        _torchrun("pretrain_gpt.py", *common, "--log-json", str(log), *flags)
        return {r["step"]: r["loss"] for r in map(json.loads, log.read_text().splitlines())}

    straight = losses("straight", "--train-iters", "4")
    first = losses("first", "--train-iters", "2", "--save", str(ckpt), "--save-interval", "2")
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    resumed = losses("resumed", "--train-iters", "4", "--load", str(ckpt))
    assert sorted(straight) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]
    assert first == {k: straight[k] for k in (1, 2)}
    assert resumed == {k: straight[k] for k in (3, 4)}, (straight, resumed)


def _fits_up_to(threshold: int):
    """(fits, calls): a ``fits`` that accepts sizes up to ``threshold`` and records each size."""
    calls = []

    def fits(size):
        calls.append(size)
        return size <= threshold

    return fits, calls


@pytest.mark.parametrize("limit", [1, 6, 32])
def test_max_micro_batch_search_finds_the_threshold(limit):
    from lce_train import max_micro_batch

    for threshold in range(0, 40):
        fits, calls = _fits_up_to(threshold)
        best, tried = max_micro_batch.sizes_to_try(fits, limit)
        assert best == min(threshold, limit), (threshold, tried)
        assert len(calls) == len(set(calls)) and max(calls) <= limit


@pytest.mark.parametrize("error", [-50, -3, 0, 1, 7, 1000])
def test_max_micro_batch_search_follows_a_prediction(error):
    """A prediction off by ``error`` still finds the threshold; an exact one costs one failure."""
    from lce_train import max_micro_batch

    for threshold in range(0, 80):
        fits, calls = _fits_up_to(threshold)
        best, tried = max_micro_batch.sizes_to_try(fits, 64, lambda good, t=threshold: t + error)
        assert best == min(threshold, 64), (threshold, tried)
        assert len(calls) == len(set(calls)) and max(calls) <= 64
        if error == 0 and 2 <= threshold < 64:
            assert sum(not ok for ok in tried.values()) == 1, tried


# ---------------------------------------------------------------------------------------------
# Evaluation, probes and the cce options (docs/training_equivalence.md)
# ---------------------------------------------------------------------------------------------


def test_cce_option_flags():
    args = arguments.parse_args(["--cross-entropy-fusion-impl", "cce", "--cce-backward",
                                    "tiles", "--cce-filter-eps", "paper", "--dry-run"])
    assert arguments.cce_options(args) == {"backward": "tiles", "filter_eps": "paper"}
    args = arguments.parse_args(["--cross-entropy-fusion-impl", "cce", "--cce-filter-eps",
                                    "none", "--dry-run"])
    assert arguments.cce_options(args) == {"filter_eps": None}  # off, not "the default"
    args = arguments.parse_args(["--cross-entropy-fusion-impl", "linear", "--cce-filter-eps",
                                    "1e-5", "--dry-run"])
    assert arguments.cce_options(args) == {"filter_eps": 1e-5}
    assert arguments.cce_options(arguments.parse_args(["--dry-run"])) == {}
    args = arguments.parse_args(["--cross-entropy-fusion-impl", "cce", "--cce-impl",
                                    "chunked", "--dry-run"])
    assert arguments.cce_options(args) == {"impl": "chunked"}
    args = arguments.parse_args(["--cross-entropy-fusion-impl", "cce", "--cce-round-logits",
                                    "--dry-run"])
    assert arguments.cce_options(args) == {"round_logits": True}
    args = arguments.parse_args(["--cross-entropy-fusion-impl", "cce", "--cce-keep-logits",
                                    "--dry-run"])
    assert arguments.cce_options(args) == {"keep_logits": True}
    with pytest.raises(SystemExit, match="--cce-keep-logits needs the gemm backward"):
        arguments.parse_args(["--cross-entropy-fusion-impl", "cce", "--cce-keep-logits",
                                 "--cce-backward", "tiles", "--dry-run"])
    for flags in (["--cce-backward", "tiles"], ["--cce-impl", "chunked"], ["--cce-round-logits"],
                  ["--cce-keep-logits"]):
        with pytest.raises(SystemExit, match="use them with --cross-entropy-fusion-impl cce"):
            arguments.parse_args([*flags, "--dry-run"])
    with pytest.raises(SystemExit):
        arguments.parse_args(["--cross-entropy-fusion-impl", "cce", "--cce-filter-eps",
                                 "tiny", "--dry-run"])


def test_eval_and_probe_flag_checks(tmp_path):
    with pytest.raises(SystemExit, match="needs --tensor-model-parallel-size 1"):
        arguments.parse_args(["--probe-interval", "5", "--tensor-model-parallel-size", "2",
                                 "--world-size", "2", "--dry-run"])
    with pytest.raises(SystemExit, match="data-parallel size 1"):
        arguments.parse_args(["--probe-interval", "5", "--world-size", "2", "--dry-run"])
    train, _ = _byte_token_files(tmp_path)
    with pytest.raises(SystemExit, match="needs --valid-data-path"):
        arguments.parse_args(["--data-path", str(train), "--vocab-size", "300",
                                 "--eval-interval", "5", "--dry-run"])
    with pytest.raises(SystemExit, match="must be > 0"):
        arguments.parse_args(["--eval-interval", "0", "--dry-run"])


def test_full_iteration_graph_flags():
    graphs = ["--cuda-graph-impl", "full_iteration", "--distributed-backend", "nccl"]
    args = arguments.parse_args([*graphs, "--cross-entropy-fusion-impl", "cce",
                                 "--cce-backward", "tiles", "--dry-run"])
    # The op's own graphs would never replay inside Megatron's.
    assert arguments.cce_options(args) == {"backward": "tiles", "cuda_graphs": False}
    assert "captured after 3 eager steps" in arguments.describe(args)
    assert "cuda graphs" not in arguments.describe(arguments.parse_args(["--dry-run"]))
    for flags, message in (
        (["--cuda-graph-warmup-steps", "0"], "--cuda-graph-warmup-steps must be >= 1"),
        (["--pipeline-model-parallel-size", "2", "--world-size", "2"],
         "needs --pipeline-model-parallel-size 1"),
        (["--probe-interval", "2"], "--probe-interval reads the output layer"),
        (["--distributed-backend", "gloo"], "needs CUDA GPUs and the nccl backend"),
    ):
        with pytest.raises(SystemExit, match=message):
            arguments.parse_args([*graphs, *flags, "--dry-run"])


@pytest.mark.parametrize("layout", [
    pytest.param(["--nproc", "1", "--tensor-model-parallel-size", "1"],
                 marks=pytest.mark.requires_cuda, id="tp1"),
    pytest.param(["--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16"],
                 marks=pytest.mark.requires_gpus(2), id="tp2_sp_bf16"),
])
def test_full_iteration_graphs_replay_the_eager_losses(tmp_path, layout):
    # Each loss is held to its own eager run here, not to the other loss.
    flags = [*layout, "--impls", "cce,native", "--tol", "1e-1"]
    eager = _compare(tmp_path, *flags, steps=6)
    graphed = _compare(tmp_path, *flags, "--cuda-graph-impl", "full_iteration",
                       "--cuda-graph-warmup-steps", "2", steps=6)
    for impl in ("cce", "native"):
        assert f"cuda graph  {impl}: captured at step 3" in graphed["stdout"], graphed["stdout"]
    for impl in ("cce", "native"):
        # Steps 4-6 are replays on new batches; the op runs without its own graphs there.
        assert graphed["losses"][impl] == pytest.approx(eager["losses"][impl], rel=1e-5), impl


def test_held_out_windows_are_fixed_and_separate():
    args = arguments.parse_args([*TINY, "--global-batch-size", "4", "--dry-run"])
    train = TokenWindows(32, 1000, seed=7)
    held_out = TokenWindows(32, 1000, seed=7, held_out=True)
    other_seed = TokenWindows(32, 1000, seed=8, held_out=True)
    assert torch.equal(held_out.zipf_ids, train.zipf_ids)  # the training distribution
    # The same draws for every seed (through each seed's permutation of the vocabulary).
    ranks = torch.argsort(held_out.zipf_ids)[held_out.sample(3)]
    assert torch.equal(ranks, torch.argsort(other_seed.zipf_ids)[other_seed.sample(3)])
    assert not torch.equal(held_out.sample(3), train.sample(3))
    first = [b["tokens"] for b in held_out.microbatches(1, args, 0, "cpu")]
    again = [b["tokens"] for b in held_out.microbatches(1, args, 0, "cpu")]
    assert all(torch.equal(a, b) for a, b in zip(first, again))


class _OutputLayer(torch.nn.Linear):
    def forward(self, input_, weight=None):
        return input_ @ (self.weight if weight is None else weight).t()


class _TinyGPT(torch.nn.Module):
    """The two pieces of a GPTModel the probe's tap hooks: a final norm, and an output layer
    called with the tied weight as a keyword, as megatron-core calls it; ``through_hooks=False``
    calls the layer's forward directly, as a megatron-core that bypassed hooks would."""

    def __init__(self, through_hooks: bool):
        super().__init__()
        self.decoder = torch.nn.Module()
        self.decoder.final_layernorm = torch.nn.LayerNorm(4)
        self.output_layer = _OutputLayer(4, 6, bias=False)
        self.embedding = torch.nn.Parameter(torch.randn(6, 4))
        self.share_embeddings_and_output_weights = True
        self.through_hooks = through_hooks

    def shared_embedding_or_output_weight(self):
        return self.embedding

    def forward(self, hidden):
        hidden = self.decoder.final_layernorm(hidden)
        layer = self.output_layer if self.through_hooks else self.output_layer.forward
        return layer(hidden, weight=self.embedding)


def test_output_layer_tap_copies_inputs_and_falls_back():
    for through_hooks, source in ((True, "output_layer"), (False, "final_norm")):
        gpt = _TinyGPT(through_hooks)
        tap = evaluation.OutputLayerTap(gpt)
        hidden = torch.randn(3, 2, 4)
        gpt(hidden)
        with pytest.raises(RuntimeError, match="saw no forward"):
            tap.take()  # not armed
        tap.arm()
        gpt(hidden)
        gpt(hidden + 1)  # later micro-batches are not kept
        expected = gpt.decoder.final_layernorm(hidden).reshape(-1, 4)
        weight_then = gpt.embedding.detach().clone()
        with torch.no_grad():
            gpt.embedding.add_(1.0)  # the optimizer step after the forward
        got_hidden, got_weight, got_source = tap.take()
        assert got_source == source
        assert torch.allclose(got_hidden, expected) and torch.equal(got_weight, weight_then)
        tap.remove()


def _byte_token_files(tmp_path) -> tuple[Path, Path]:
    """Tiny train/valid byte-token files (vocabulary 257) of generated text."""
    from lce_train import build_token_file

    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    words = ["tensor", "kernel", "vocab", "shard", "softmax", "gradient", "layer"]
    for i in range(24):
        (src / f"f{i}.txt").write_text(" ".join(rng.choice(words, 80)) + "\n")
    out = tmp_path / "tokens"
    build_token_file.main(["--source", str(src), "--out", str(out), "--valid-fraction", "0.3"])
    return tmp_path / "tokens_train", tmp_path / "tokens_valid"


def test_eval_and_probes_on_text_leave_training_unchanged(tmp_path):
    """One process, TP=1: validation every 2 steps and probes (step 1, 2, 3) land in the JSON
    records; the losses are bitwise those of the same run without them."""
    train, valid = _byte_token_files(tmp_path)
    common = [*TINY, "--vocab-size", "300", "--data-path", str(train), "--train-iters", "3",
              "--cross-entropy-fusion-impl", "cce", "--cce-backward", "tiles",
              "--cce-filter-eps", "paper", "--lr", "3e-3"]
    with_probes = tmp_path / "with.jsonl"
    plain = tmp_path / "plain.jsonl"
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
          str(SCRIPTS / "pretrain_gpt.py"), *common, "--valid-data-path", str(valid),
          "--eval-interval", "2", "--eval-iters", "2", "--probe-interval", "2",
          "--log-json", str(with_probes)])
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
          str(SCRIPTS / "pretrain_gpt.py"), *common, "--log-json", str(plain)])
    records = [json.loads(line) for line in with_probes.read_text().splitlines()]
    baseline = [json.loads(line) for line in plain.read_text().splitlines()]
    assert [r["loss"] for r in records] == [r["loss"] for r in baseline]

    assert [r["step"] for r in records if "valid_loss" in r] == [2, 3]
    for r in records:
        if "valid_loss" in r:
            assert 0 < r["valid_loss"] < 20 and r["valid_unseen_targets"] >= 0
    probes = {r["step"]: r["probe"] for r in records if "probe" in r}
    assert sorted(probes) == [1, 2, 3]
    counts = np.bincount(np.fromfile(f"{train}.bin", dtype=np.uint16), minlength=384)
    for step, probe in probes.items():
        assert set(probe["grad_rel_err"]) == {"in_forward", "gemm", "tiles_safe", "tiles_paper",
                                              "native"}
        for name, errors in probe["grad_rel_err"].items():
            assert max(errors.values()) < 1e-4, (step, name, errors)  # fp32: filters drop ~0
        # The training file fixes the unseen ids: the 384 padded classes minus those it holds.
        assert probe["unseen_ids"] == int((counts == 0).sum())
        assert 0 < probe["unseen_mass"] < 1 and probe["tokens"] == 64
    # The probe's loss is the training loss of its micro-batch (one micro-batch per step).
    assert probes[1]["loss"] == pytest.approx(records[0]["loss"], rel=1e-5)


def test_kernel_busy_time_is_the_union_of_kernel_intervals():
    from lce_train.step_profile import kernel_busy_ms

    events = [{"cat": "kernel", "ts": 0, "dur": 100}, {"cat": "kernel", "ts": 50, "dur": 100},
              {"cat": "kernel", "ts": 400, "dur": 100}, {"cat": "cpu_op", "ts": 0, "dur": 999},
              {"cat": "kernel", "ts": 140, "dur": 5}]
    assert kernel_busy_ms({"traceEvents": events}) == pytest.approx(0.25)  # 150 + 100 us
    assert kernel_busy_ms({"traceEvents": events[3:4]}) is None


@pytest.mark.parametrize("step", [0, 4])
def test_profile_step_must_be_a_step_of_the_run(step):
    with pytest.raises(SystemExit, match=f"--profile-step {step} must be a step of this run"):
        arguments.parse_args([*TINY, "--train-iters", "3", "--profile-step", str(step),
                              "--dry-run"])


@two_ranks
def test_profile_step_writes_each_ranks_trace_and_summary(tmp_path):
    out, log = tmp_path / "profile", tmp_path / "steps.jsonl"
    _torchrun("pretrain_gpt.py", *TINY, "--train-iters", "2", "--tensor-model-parallel-size", "2",
              "--cross-entropy-fusion-impl", "cce", "--profile-step", "2", "--profile-dir",
              str(out), "--log-json", str(log))
    for rank in (0, 1):
        summary = (out / f"step2_rank{rank}.txt").read_text()
        assert summary.startswith(f"# step 2, rank {rank}:") and "LCEFunction" in summary
        assert json.loads((out / f"step2_rank{rank}.json").read_text())["traceEvents"]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r.get("profiled", False) for r in records] == [False, True]
