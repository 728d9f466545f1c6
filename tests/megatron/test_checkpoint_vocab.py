"""A resume keeps the checkpoint's vocabulary, padding included, or is refused before any weight is
read (lce_train.checkpoint.check_vocab).

Megatron pads the vocabulary to a multiple of --make-vocab-size-divisible-by x TP, and every
padded row is a class of the softmax. 257 tokens pad to 512 rows at TP2 but to 384 at TP1 with the
default 128; dist_checkpointing then loads the first 384 of the 512 saved rows without a word and
the loss changes (a run resumed so at step 10: step 11 loss 3.790448 against 3.982181 unbroken).
On gloo, two CPU processes per run:

    TP2, 3 steps, saved at 2                  the unbroken run
    TP1 x PP2 from step 2, default padding    refused: pass --make-vocab-size-divisible-by 256
    TP1 x PP2 from step 2, divisible-by 256   step 3 as the unbroken run's (fp32 rounding)

The messages (changed true size, no divisible-by that fits, checkpoints saved before the record)
are checked without ranks.
"""

from __future__ import annotations

import shutil
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from test_dist_checkpoint import _assert_continues, _launch, _losses, two_ranks

from lce_train import checkpoint
from lce_train.arguments import padded_vocab_size

pytest.importorskip("megatron.core")

COMMON = ["--config", "tiny", "--num-layers", "2", "--hidden-size", "64", "--vocab-size", "257",
          "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
          "--cross-entropy-fusion-impl", "cce", "--lr", "3e-3", "--lr-decay-iters", "3",
          "--train-iters", "3", "--use-distributed-optimizer"]
TP1_PP2 = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"]


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    """The TP2 run (257 tokens padded to 512): its losses and checkpoint directory."""
    tmp = tmp_path_factory.mktemp("unbroken")
    _launch(tmp / "log.json", "--tensor-model-parallel-size", "2", "--save", str(tmp / "ckpt"),
            "--save-interval", "2", common=COMMON)
    return _losses(tmp / "log.json"), tmp / "ckpt"


@two_ranks
def test_the_checkpoint_records_its_vocabulary(unbroken):
    from megatron.core import dist_checkpointing

    _, ckpt = unbroken
    common = dist_checkpointing.load_common_state_dict(str(ckpt / "iter_0000002"))
    assert common["vocab"] == {"size": 257, "padded": 512, "divisible_by": 128, "tp": 2}


@two_ranks
def test_another_padding_is_refused_then_the_named_flag_resumes(unbroken, tmp_path):
    straight, ckpt = unbroken
    refused = _launch(tmp_path / "refused.json", *TP1_PP2, "--load", str(ckpt), "--ckpt-step",
                      "2", check=False, common=COMMON)
    out = refused.stdout + refused.stderr
    assert refused.returncode != 0
    assert (f"{ckpt / 'iter_0000002'} was saved with the vocabulary padded to 512 rows "
            "(--make-vocab-size-divisible-by 128 x TP 2), this run pads its 257 tokens to 384 "
            "rows (--make-vocab-size-divisible-by 128 x TP 1)") in out, out[-3000:]
    assert ("pass --make-vocab-size-divisible-by 256 so that the padded vocabulary is 512 as in "
            "the checkpoint") in out, out[-3000:]
    assert not (tmp_path / "refused.json").exists() or not _losses(tmp_path / "refused.json")

    _launch(tmp_path / "resumed.json", *TP1_PP2, "--make-vocab-size-divisible-by", "256",
            "--load", str(ckpt), "--ckpt-step", "2", common=COMMON)
    resumed = _losses(tmp_path / "resumed.json")
    assert sorted(resumed) == [3]
    _assert_continues(resumed, straight)


# ---------------------------------------------------------------------------------------------
# The messages, without ranks
# ---------------------------------------------------------------------------------------------


def _run_args(size: int, divisible_by: int, tp: int) -> Namespace:
    return Namespace(model=Namespace(vocab_size=size), make_vocab_size_divisible_by=divisible_by,
                     tensor_model_parallel_size=tp,
                     padded_vocab_size=padded_vocab_size(size, divisible_by, tp))


def _refusal(saved: dict, args: Namespace) -> str:
    with pytest.raises(SystemExit) as err:
        checkpoint.check_vocab(Path("ckpt/iter_0000010"), saved, args)
    return str(err.value)


SAVED_TP2 = {"size": 257, "padded": 512, "divisible_by": 128, "tp": 2}


def test_the_same_vocabulary_passes():
    checkpoint.check_vocab(Path("ckpt"), SAVED_TP2, _run_args(257, 128, 2))
    checkpoint.check_vocab(Path("ckpt"), SAVED_TP2, _run_args(257, 256, 1))
    checkpoint.check_vocab(Path("ckpt"), SAVED_TP2, _run_args(257, 64, 4))


def test_another_true_vocabulary_size_is_refused():
    # 258 tokens pad to 512 rows as 257 do: the rows fit, the vocabulary is another one.
    message = _refusal(SAVED_TP2, _run_args(258, 256, 1))
    assert "ckpt/iter_0000010 was saved with a vocabulary of 257 tokens, this run has 258: " \
           "pass --vocab-size 257" in message


@pytest.mark.parametrize("tp, divisible_by, flag", [(1, 128, 256), (4, 256, 64), (8, 128, 32)])
def test_the_flag_keeps_the_checkpoints_multiple(tp, divisible_by, flag):
    message = _refusal(SAVED_TP2, _run_args(257, divisible_by, tp))
    assert f"pass --make-vocab-size-divisible-by {flag} so that the padded vocabulary is 512" \
        in message
    assert padded_vocab_size(257, flag, tp) == 512


def test_no_flag_fits_names_the_rule():
    message = _refusal(SAVED_TP2, _run_args(257, 128, 3))
    assert "this run pads its 257 tokens to 384 rows (--make-vocab-size-divisible-by 128 x TP 3)" \
        in message
    assert "no --make-vocab-size-divisible-by N pads 257 tokens to 512 rows at TP 3 " \
           "(padded = ceil(257 / (N x TP)) x N x TP): resume at a TP size that divides 512" \
        in message


def test_the_smallest_flag_when_the_multiple_does_not_spread():
    # Saved at TP1 with divisible-by 128: 300 tokens in 384 rows. TP3 does not divide that
    # multiple of 128; the smallest N with 3N dividing 384 and N x 3 > 384 - 300 is 32.
    saved = {"size": 300, "padded": 384, "divisible_by": 128, "tp": 1}
    message = _refusal(saved, _run_args(300, 256, 3))
    assert "pass --make-vocab-size-divisible-by 32 so that the padded vocabulary is 384" \
        in message
    assert padded_vocab_size(300, 32, 3) == 384


@two_ranks
def test_a_checkpoint_saved_before_the_record_is_checked_by_its_rows(unbroken, tmp_path):
    """Checkpoints written before the launcher recorded the vocabulary: the embedding's rows in
    the checkpoint's metadata give the padded size."""
    _, ckpt = unbroken
    folder = tmp_path / "iter_0000002"
    shutil.copytree(ckpt / "iter_0000002", folder)
    common = torch.load(folder / "common.pt", weights_only=False)
    del common["vocab"]
    torch.save(common, folder / "common.pt")

    saved = checkpoint._saved_vocab(folder, checkpoint._load_common(folder))
    assert saved == {"size": None, "padded": 512, "divisible_by": None, "tp": 2}
    message = _refusal(saved, _run_args(257, 128, 1))
    assert "was saved with the vocabulary padded to 512 rows (TP 2), this run pads its 257 " \
           "tokens to 384 rows" in message
    assert "pass --make-vocab-size-divisible-by 256 so that" in message
