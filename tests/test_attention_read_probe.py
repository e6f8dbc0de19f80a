"""The attention read probe: its bare read covers exactly the bytes of each sequence's tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.bench import attention_read_probe as probe


@pytest.fixture(scope="module")
def reader():
    return probe.build_reader()


@pytest.mark.parametrize("ahead", [0, 4])
def test_the_read_sums_the_words_of_every_token_in_the_tables(reader, ahead):
    generator = torch.Generator().manual_seed(0)
    block_size, num_blocks = 4, 12
    kv = torch.randint(0, 2**31, (num_blocks, block_size, 2, 3, 8), generator=generator, dtype=torch.int32)
    kv = kv.view(torch.float32)  # any bytes: the read adds them as 64-bit words
    tables = torch.tensor([[5, 2, 9], [0, 11, 7], [3, 3, 3]], dtype=torch.int32)
    lens = torch.tensor([10, 1, 12], dtype=torch.int32)
    words = kv.numpy().view(np.uint64).reshape(num_blocks, block_size, -1)
    expected = np.uint64(0)
    for table, n in zip(tables.tolist(), lens.tolist()):
        for i in range(n):
            expected += words[table[i // block_size], i % block_size].sum(dtype=np.uint64)
    # The reader returns the wrapped 64-bit total as a double: compare in that precision.
    assert reader.read_blocks(kv, tables, lens, ahead) == float(expected)


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--dtype", "float16"], ["--block-size", "0"]])
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as exited:
        probe.main(argv)
    assert exited.value.code == 2
