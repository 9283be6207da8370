"""The float32-accumulating ring backward (``backend = "triton"``).

Its kernels run here under Triton's CPU interpreter in float32 (indexing, masks,
GQA head groups, padded head_dim, strided operands, in-place accumulation, and
the ring schedule with it against full attention); their bf16 numerics and speed
on the GPU are in benchmarks/attention/kernels_check.py,
benchmarks/attention/ring_emulated.py and BENCHMARKS.md. The interpreter cannot run bf16 on CPU.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from weft.strategies.attention.kernels.blocks import select_kernel

HERE = pathlib.Path(__file__).parent


def test_kernels_under_the_interpreter():
    pytest.importorskip("triton", reason="Triton is a test dependency on Linux x86-64 (pyproject [test])")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, str(HERE / "triton_interpreted.py")], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count(" ok ") == 14, done.stdout


@pytest.mark.quick
@pytest.mark.parametrize("backend", ["triton", "cudnn", "torch_flash", "flash"])
def test_gpu_backends_refuse_cpu_with_a_message(backend):
    with pytest.raises(
        ValueError, match=f"attention backend '{backend}' runs on CUDA with bf16/fp16 inputs, got cpu torch.float32"
    ):

        select_kernel(backend, device=torch.device("cpu"), dtype=torch.float32, head_dim=64)
