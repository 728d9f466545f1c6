"""TorchDynamo switched off only while the Megatron tests run.

lce_train.megatron_cpu's CPU mode switches TorchDynamo off for the whole process (megatron's
fused kernels would compile for ~22 s a rank on the CPU). Tests of folders collected after this
one (tests/op/test_compile.py) need it on, so each module here gives back the switch it found,
and a module that runs once CPU mode is on gets TorchDynamo off, as CPU mode promises.
"""

import os

import pytest
import torch._dynamo


@pytest.fixture(autouse=True, scope="module")
def dynamo_off_only_here():
    from lce_train import megatron_cpu

    saved = torch._dynamo.config.disable, os.environ.get("TORCHDYNAMO_DISABLE")
    if megatron_cpu._ENABLED:
        megatron_cpu._disable_dynamo()
    yield
    torch._dynamo.config.disable = saved[0]
    if saved[1] is None:
        os.environ.pop("TORCHDYNAMO_DISABLE", None)
    else:
        os.environ["TORCHDYNAMO_DISABLE"] = saved[1]
