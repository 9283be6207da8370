"""The Triton split-KV decode attention (strategies/attention/kernels/decode_triton.py).

Its kernels run here under Triton's CPU interpreter (tests/decode_triton_interpreted.py, in a
subprocess: the interpreter's switch must be set before Triton is imported): equal to a float64
reference and to ``split_decode_attention`` in float32 and with bf16 inputs, Qwen2.5-VL's 28
query over 4 KV heads, rows of different lengths in one batch (1, mid-block, the whole buffer),
N not a multiple of the block, one split or many, strided views of the cache, the LSE equal to
torch.logsumexp of the scaled scores, and torch.compile tracing through the operator. The rest
(the split count, the import without Triton, the operator's fake implementation) runs in this
process. Its speed on the GPU: benchmarks/attention/decode_attention.py.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from weft.strategies.attention.kernels import decode_triton
from weft.strategies.attention.kernels.decode_triton import num_splits, triton_decode_attention

HERE = pathlib.Path(__file__).parent


def test_kernels_under_the_interpreter():
    pytest.importorskip("triton", reason="Triton is a test dependency on Linux x86-64 (pyproject [test])")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(HERE / "decode_triton_interpreted.py")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count(" ok") == 18, done.stdout


@pytest.mark.quick
@pytest.mark.parametrize("batch_heads, rows", [(4, 131072), (4, 16384), (12, 333), (256, 131072), (1, 50), (4, 1)])
def test_the_split_count_covers_the_cache_in_whole_blocks(batch_heads, rows):
    """A function of the shapes and the SM count alone (lengths are not an argument): the
    splits cover the rows with whole blocks, none wholly past the buffer, and the grid has
    ~2 programs per SM where the cache has enough blocks."""
    block = decode_triton.CONFIG["BLOCK_N"]
    splits, per_split = num_splits(batch_heads, rows, sms=132)
    assert per_split % block == 0 and splits * per_split >= rows > (splits - 1) * per_split
    if -(-rows // block) >= 2 * 132 // batch_heads:
        assert batch_heads * splits >= 132 * 1.9
    if (batch_heads, rows) == (4, 131072):  # Qwen2.5-VL-7B at 128K: 64 splits of 2048 rows, 256 programs
        assert (splits, per_split) == (64, 2048)


@pytest.mark.quick
def test_imports_without_triton(monkeypatch):
    """The module imports Triton only inside functions (a CPU-only install has none), and says
    it is unavailable where Triton is missing or the device is no GPU."""
    tree = ast.parse(pathlib.Path(decode_triton.__file__).read_text(encoding="utf-8"))
    top = [a.name for node in tree.body if isinstance(node, ast.Import) for a in node.names]
    top += [node.module for node in tree.body if isinstance(node, ast.ImportFrom)]
    assert not [name for name in top if name.split(".")[0] == "triton"], top
    assert not decode_triton.triton_decode_available("cpu")
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    assert not decode_triton.triton_decode_available("cuda")


@pytest.mark.quick
def test_the_operator_on_the_meta_device():
    """The fake implementation (what torch.compile traces): shapes and dtypes, and nothing read
    from ``lengths`` on the host (the meta device raises on any such read)."""
    query = torch.empty(2, 28, 1, 128, device="meta", dtype=torch.bfloat16)
    key = torch.empty(2, 4, 4096, 128, device="meta", dtype=torch.bfloat16)
    out, lse = triton_decode_attention(query, key, key, lengths=torch.empty(2, device="meta", dtype=torch.long),
                                       scale=0.1, return_lse=True)
    assert out.shape == (2, 28, 1, 128) and out.dtype == torch.bfloat16 and out.device.type == "meta"
    assert lse.shape == (2, 28, 1) and lse.dtype == torch.float32


@pytest.mark.quick
def test_refuses_what_it_does_not_compute():
    query, key = torch.empty(1, 28, 2, 16), torch.empty(1, 4, 64, 16)
    with pytest.raises(ValueError, match="one query per row"):
        triton_decode_attention(query, key, key, lengths=None, scale=0.25)
    query, key = torch.empty(1, 28, 1, 16, dtype=torch.float64), torch.empty(1, 4, 64, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="bf16, fp16 or float32 cache"):
        triton_decode_attention(query, key, key, lengths=None, scale=0.25)
