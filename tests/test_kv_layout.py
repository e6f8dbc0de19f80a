"""Token ranges to cache slots, staging buffers, and the checksums (the device one runs its
Triton kernel under the interpreter on CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.kvtransfer.integrity import CHUNK, checksum, chunk_digests, device_checksum, reference_chunk_digests
from pdserve.kvtransfer.layout import KVCacheView, StagingPool, slots_of


def test_slots_follow_the_block_table_and_know_when_they_are_contiguous():
    s = slots_of([7, 2, 9], 8, 5, 21)
    assert s.array.tolist() == [61, 62, 63, *range(16, 24), 72, 73, 74, 75, 76]
    assert not s.contiguous  # first and last slot 15 apart, but not one run
    s = slots_of([4, 5, 6], 8, 3, 20)
    assert s.contiguous and s.first == 35 and len(s) == 17
    assert slots_of([3], 16, 0, 16).contiguous
    with pytest.raises(ValueError, match="do not fit"):
        slots_of([1, 2], 8, 0, 17)
    with pytest.raises(ValueError, match="negative block id"):  # numpy would wrap it to the cache's end
        slots_of([3, -1], 8, 4, 12)


def test_a_view_reads_and_writes_whole_units_by_bytes_per_token():
    cache = torch.arange(2 * 4 * 4 * 6, dtype=torch.float32).reshape(2, 4, 4, 6)  # 2 layers, 4 blocks of 4 tokens
    view = KVCacheView(list(cache.unbind(0)), 4, 24)
    slots = view.slots([3, 0], 2, 7)  # tokens 2..6: block 3 slots 14, 15, block 0 slots 0, 1, 2
    data = view.read(1, slots)
    assert data.staged  # not contiguous: gathered
    expected = cache[1].reshape(16, 6)[[14, 15, 0, 1, 2]]
    assert np.array_equal(data.data, expected.numpy().view(np.uint8).reshape(-1))
    target = view.write_target(0, slots)
    target.data[:] = data.data
    target.commit()
    assert torch.equal(cache[0].reshape(16, 6)[[14, 15, 0, 1, 2]], expected)
    data.release()
    target.release()


def test_staging_buffers_are_reused():
    pool = StagingPool()
    a = pool.take(100_000)
    assert a.numel() >= 100_000
    pool.give(a)
    assert pool.take(70_000) is a  # same size class


@pytest.mark.parametrize("nbytes", [8, 1000, CHUNK, 3 * CHUNK + 40, 70_001])
def test_the_device_hash_kernel_is_xxh64_per_chunk(nbytes):
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    num_chunks = max(1, -(-nbytes // CHUNK))
    words = torch.frombuffer(bytearray(data.ljust(num_chunks * CHUNK, b"\0")), dtype=torch.int64)
    got = chunk_digests(words, num_chunks).numpy().view(np.uint64)
    assert np.array_equal(got, reference_chunk_digests(data))


def test_the_device_checksum_sees_every_byte():
    rows = torch.randn(40, 24)
    digest = device_checksum(rows)
    assert device_checksum(rows.clone()) == digest
    flipped = rows.clone()
    flipped.view(torch.uint8)[17, 3] ^= 1
    assert device_checksum(flipped) != digest
    assert device_checksum(rows[:39]) != digest  # the length counts
    assert checksum(rows.numpy()) == digest  # one function of the bytes, wherever they are


@pytest.mark.parametrize("block_ids", [[3, 4, 5, 6], [6, 1, 4, 0]], ids=["contiguous", "fragmented"])
@pytest.mark.parametrize(
    "start, end", [(0, 64), (16, 50), (5, 60)], ids=["whole-blocks", "aligned-with-tail", "unaligned"]
)
def test_block_rows_copy_and_hash_like_token_rows(block_ids, start, end):
    from pdserve.kvtransfer.integrity import checksum
    from pdserve.kvtransfer.layout import copy_and_hash, gather, hash_rows

    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, (128, 96), dtype=np.uint8)
    dst = np.zeros_like(src)
    src_slots, dst_slots = slots_of([2, 0, 1, 3], 16, start, end), slots_of(block_ids, 16, start, end)
    if start % 16 == 0:
        assert src_slots.runs[0][0] == 16  # whole blocks per row
    whole = checksum(src[src_slots.array])
    assert np.array_equal(gather(src, src_slots), src[src_slots.array])
    assert copy_and_hash(src, src_slots, dst, dst_slots) == whole
    assert np.array_equal(dst[dst_slots.array], src[src_slots.array])
    untouched = np.ones(len(dst), dtype=bool)
    untouched[dst_slots.array] = False
    assert not dst[untouched].any()
    assert hash_rows(dst, dst_slots) == whole


@pytest.mark.parametrize("stream", [False, True], ids=["cached", "streamed"])
@pytest.mark.parametrize("native", [True, False], ids=["c++", "numpy"])
@pytest.mark.parametrize(
    "token_bytes, tokens",
    # (1024, 100) and (3072, 40): every chunk lies in one token (hashed from registers);
    # (1536, 364): some windows do and some do not; the others: gathered windows only
    [(96, 42), (1536, 364), (1024, 100), (3072, 40), (100, 33), (8, 1), (64, 0)],
)
def test_host_chunk_digests_are_xxh64_per_chunk_and_copy_on_the_way(monkeypatch, native, stream, token_bytes, tokens):
    from pdserve.kvtransfer import integrity

    if native:
        assert integrity._native() is not None, (
            "the C++ kernels must build on this machine (gcc and ninja are installed)"
        )
    else:
        monkeypatch.setattr(integrity, "_native", lambda: None)
    rng = np.random.default_rng(token_bytes)
    src = rng.integers(0, 256, (400, token_bytes), dtype=np.uint8)
    dst = np.zeros_like(src)
    if stream:  # streaming stores need 64-byte aligned rows (else the kernel stores through the cache)
        spare = np.zeros(dst.size + 64, dtype=np.uint8)
        skip = -spare.ctypes.data % 64
        dst = spare[skip : skip + dst.size].reshape(dst.shape)
    src_slots, dst_slots = rng.permutation(400)[:tokens], rng.permutation(400)[:tokens]
    src_slots[: tokens // 2] = np.arange(tokens // 2) + 100  # runs consecutive on both sides, then scattered
    dst_slots[: tokens // 2] = np.arange(tokens // 2) + 7
    dst_slots[tokens // 2 :] = np.setdiff1d(np.arange(400), dst_slots[: tokens // 2])[: tokens - tokens // 2][::-1]
    expected = reference_chunk_digests(src[src_slots].tobytes())
    digests = integrity.host_chunk_digests(src, src_slots, dst, dst_slots, stream)
    assert np.array_equal(digests.view(np.uint64), expected)
    assert np.array_equal(dst[dst_slots], src[src_slots])
    assert not np.delete(dst, dst_slots, axis=0).any()  # nothing else written
    assert np.array_equal(integrity.host_chunk_digests(dst, dst_slots).view(np.uint64), expected)
    if tokens:  # a slot outside the rows is this unit's IndexError, as the senders expect
        with pytest.raises(IndexError):
            integrity.host_chunk_digests(src, src_slots, dst, np.where(dst_slots == dst_slots[0], 400, dst_slots))


def test_a_span_of_layers_refuses_slots_that_would_fall_in_another_layer():
    from pdserve.kvtransfer.layout import KVCacheView

    layers = torch.zeros(3, 4, 16, 8, dtype=torch.uint8)  # 3 layers of 4 blocks of 16 tokens
    view = KVCacheView(list(layers.unbind(0)), 16, 8)
    assert view.flat is not None and view.flat.shape == (3 * 64, 8)
    inside = view.slots([3, 0], 0, 32)
    assert list(view.span_rows(1, inside, 2)[:3]) == [64 + 48, 64 + 49, 64 + 50]
    with pytest.raises(IndexError, match="outside a layer"):
        view.span_rows(0, view.slots([4, 0], 0, 32), 2)  # block 4 is the next layer's block 0
    with pytest.raises(ValueError, match="outside the cache"):
        view.span_rows(2, inside, 2)
    assert KVCacheView([layers[0], layers[2]], 16, 8).flat is None  # not one after another
