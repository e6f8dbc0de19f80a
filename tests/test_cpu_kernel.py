"""The C++ CPU kernels (decode attention, quantized linears, fused layer ops) against torch references."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.quantization import (
    QuantFormat,
    QuantizedLinear,
    QuantizedWeight,
    quantize_int4_group,
    quantize_int8_channel,
)
from pdserve.engine.rope import RotaryEmbedding
from pdserve.kernels import TORCH_LAYER_OPS, KVFormat, reference, rope_then_write, select_backend, select_layer_ops
from pdserve.kernels.cpu_extension import cpu_flags, load


@pytest.fixture(scope="module")
def kernel():
    module = load()
    assert module is not None, "the C++ kernels must build on this machine (gcc and ninja are installed)"
    return module


def _filled_cache(fmt: KVFormat, num_blocks: int, block_size: int, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    kv = torch.zeros(num_blocks, block_size, *fmt.slot_shape(), dtype=fmt.storage_dtype)
    tokens = num_blocks * block_size
    k = torch.randn(tokens, fmt.num_kv_heads, fmt.head_dim, dtype=fmt.dtype)
    v = torch.randn(tokens, fmt.num_kv_heads, fmt.head_dim, dtype=fmt.dtype)
    reference.write_kv(kv, k, v, torch.arange(tokens), fmt)
    return kv


@pytest.mark.parametrize("cache_dtype", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim", [(9, 3, 64), (4, 4, 128), (8, 1, 64), (6, 2, 80)])
@pytest.mark.parametrize("block_size", [1, 5, 8, 16])  # 1 and 5: chunks of 16 tokens span many blocks
def test_decode_attention_matches_reference(
    kernel, cache_dtype, dtype, atol, num_q_heads, num_kv_heads, head_dim, block_size
):
    fmt = KVFormat(cache_dtype, num_kv_heads, head_dim, dtype)
    num_blocks, batch = 320, 5
    kv = _filled_cache(fmt, num_blocks, block_size, seed=block_size * 100 + num_q_heads)
    # One long context (split across threads and merged), short ones, block-boundary lengths.
    lens = torch.tensor([1, block_size, block_size + 3, 7 * block_size - 1, 60 * block_size])
    max_blocks = int(-(-lens.max() // block_size))
    # Shuffled, non-contiguous block tables; padding entries point at arbitrary valid blocks.
    tables = torch.randperm(num_blocks)[: batch * max_blocks].view(batch, max_blocks)
    q = torch.randn(batch, num_q_heads, head_dim, dtype=dtype)
    expected = reference.paged_decode_attention(q, kv, tables, lens, head_dim**-0.5, fmt)
    # The fastest path (the default), and every path compiled in here (portable, AVX2, AVX-512).
    for path in [-1, *kernel.attention_paths()]:
        got = kernel.paged_decode_attention(q, kv, tables, lens, head_dim**-0.5, fmt.kind, num_kv_heads, path)
        assert got.dtype == dtype and got.shape == expected.shape
        torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=0, msg=f"path {path}")


@pytest.mark.parametrize("cache_dtype", ["auto", "int8"])
def test_decode_attention_of_doubles_matches_reference_on_every_path(kernel, cache_dtype):
    """The vector paths read fp32 or bf16 rows: a plain cache of doubles goes to the portable one."""
    fmt = KVFormat(cache_dtype, 2, 64, torch.float64)
    kv = _filled_cache(fmt, 8, 4, seed=1)
    tables, lens = torch.arange(8).view(1, 8), torch.tensor([29])
    q = torch.randn(1, 4, 64, dtype=torch.float64)
    expected = reference.paged_decode_attention(q, kv, tables, lens, 0.125, fmt)
    for path in [-1, *kernel.attention_paths()]:
        got = kernel.paged_decode_attention(q, kv, tables, lens, 0.125, fmt.kind, 2, path)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0, msg=f"path {path}")


def test_decode_attention_has_a_vector_path_wherever_the_cpu_has_one(kernel):
    """CPUs without AVX-512 (most laptops) get the AVX2 path, not the portable loops; a path
    that is not compiled in is refused by name."""
    flags = set(cpu_flags().split())
    paths = kernel.attention_paths()
    assert paths[0] == 0
    assert (1 in paths) == ({"avx2", "fma", "f16c"} <= flags), paths
    assert (2 in paths) == ("avx512f" in flags), paths
    fmt = KVFormat("auto", 1, 64, torch.float32)
    kv = _filled_cache(fmt, 1, 4, seed=0)
    with pytest.raises(RuntimeError, match="attention path 7 is not compiled in"):
        kernel.paged_decode_attention(torch.randn(1, 1, 64), kv, torch.tensor([[0]]), torch.tensor([3]), 0.1, 0, 1, 7)


@pytest.mark.parametrize("threads", [1, 3, 8])
@pytest.mark.parametrize("lens", [[2000] + [20] * 15, [20] * 15 + [2000], [300], [5, 1, 7]])
def test_decode_attention_splits_work_by_tokens(kernel, threads, lens):
    """However the tokens fall (one long context among short ones, more threads than work),
    every split is computed once and merges to the reference."""
    fmt = KVFormat("auto", 3, 64, torch.float32)
    block_size, batch = 16, len(lens)
    max_blocks = max(1, -(-max(lens) // block_size))
    kv = _filled_cache(fmt, batch * max_blocks, block_size, seed=threads)
    tables = torch.randperm(batch * max_blocks).view(batch, max_blocks)
    q = torch.randn(batch, 9, 64)
    lens = torch.tensor(lens)
    expected = reference.paged_decode_attention(q, kv, tables, lens, 0.125, fmt)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernel.paged_decode_attention(q, kv, tables, lens, 0.125, fmt.kind, 3)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)


def test_decode_attention_refuses_bad_tables(kernel):
    fmt = KVFormat("auto", 2, 64, torch.float32)
    kv = _filled_cache(fmt, 4, 8, seed=0)
    q = torch.randn(1, 2, 64)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel.paged_decode_attention(q, kv, torch.tensor([[9]]), torch.tensor([5]), 0.1, 0, 2)
    with pytest.raises(RuntimeError, match="context length"):
        kernel.paged_decode_attention(q, kv, torch.tensor([[0]]), torch.tensor([9]), 0.1, 0, 2)


def test_ops_refuse_arguments_no_cache_or_weight_format_has(kernel):
    """Called directly, the ops refuse what the engine never passes, rather than crash or read
    past a buffer: unknown formats, no KV heads, RoPE tables of two shapes, a strided scale."""
    fmt = KVFormat("auto", 2, 64, torch.float32)
    kv, q = _filled_cache(fmt, 4, 8, seed=0), torch.randn(1, 2, 64)
    for kind in (3, -1):
        with pytest.raises(RuntimeError, match="kv_format must be"):
            kernel.paged_decode_attention(q, kv, torch.tensor([[0]]), torch.tensor([5]), 0.1, kind, 2)
    qkv, cache = torch.randn(1, 4 * 64), torch.zeros(4, 8, 2, 2, 64)
    cos = sin = torch.ones(16, 64)

    def rope(num_kv_heads=1, sin=sin, kv_format=0, positions=(0,)):
        heads = 4 - 2 * num_kv_heads
        kernel.rope_write_kv(
            qkv, torch.tensor(positions), cos, sin, heads, num_kv_heads, 64, cache, torch.tensor([0]), kv_format
        )

    rope()  # the arguments below change one thing each
    with pytest.raises(RuntimeError, match="kv heads and a head dim"):
        rope(num_kv_heads=0)
    with pytest.raises(RuntimeError, match="of one shape"):
        rope(sin=torch.ones(15, 64), positions=(15,))
    with pytest.raises(RuntimeError, match="kv_format must be"):
        rope(kv_format=3)
    codes, scales = torch.randint(0, 256, (16, 32), dtype=torch.uint8), torch.ones(16, 1)
    with pytest.raises(RuntimeError, match="format must be"):
        kernel.pack_weights(codes, scales, scales, 3)
    packed = kernel.pack_weights(codes, scales, scales, 0)
    with pytest.raises(RuntimeError, match="format must be"):
        kernel.quant_linear(torch.randn(1, 32), packed, torch.ones(16), torch.zeros(0), 16, 32, 3, -1, False)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        kernel.quant_linear(torch.randn(1, 32), packed, torch.ones(32)[::2], torch.zeros(0), 16, 32, 0, -1, False)


@pytest.mark.parametrize("heads", range(1, 9))
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_8bit_cache_slots_are_16_byte_aligned(heads, head_dim):
    """A GPU loads a slot's codes with 16-byte vector loads from the slot's start: every slot of
    an 8-bit cache starts on a 16-byte boundary, padded after its scales."""
    for cache_dtype in ("int8", "fp8"):
        fmt = KVFormat(cache_dtype, heads, head_dim, torch.bfloat16)
        fields = 2 * heads * head_dim + 2 * heads * 4
        assert fmt.token_bytes % 16 == 0 and 0 <= fmt.token_bytes - fields < 16
        slots = fmt.encode(torch.randn(4, heads, head_dim), torch.randn(4, heads, head_dim))
        assert slots.shape == (4, fmt.token_bytes) and not slots[:, fields:].any()


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8"])
def test_8bit_cache_round_trip_is_close(cache_dtype):
    fmt = KVFormat(cache_dtype, 3, 64, torch.float32)
    k, v = torch.randn(50, 3, 64), torch.randn(50, 3, 64) * 5
    slots = fmt.encode(k, v)
    assert slots.dtype == torch.uint8 and slots.shape == (50, fmt.token_bytes)
    assert fmt.token_bytes == 416  # one byte per value, fp32 scales (408), padded to 16 (GPU loads)
    k2, v2 = fmt.decode(slots)
    # int8: half a step of max/127; fp8 e4m3: 3 mantissa bits (relative 1/16).
    bound = (
        (lambda x: x.abs().amax(-1, keepdim=True) / 254 + 1e-6)
        if cache_dtype == "int8"
        else (lambda x: x.abs() / 15 + 1e-3)
    )
    assert ((k2 - k).abs() <= bound(k)).all() and ((v2 - v).abs() <= bound(v)).all()


def _dense(w: QuantizedWeight) -> torch.Tensor:
    return w.dequantize(torch.float32)


@pytest.mark.parametrize("fmt", list(QuantFormat))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 37])
@pytest.mark.parametrize("n, k", [(96, 64), (40, 96), (64, 1536)])
def test_quant_linear_matches_dequantized_matmul(kernel, fmt, rows, n, k):
    torch.manual_seed(rows * 7 + n)
    w = torch.randn(n, k) * 0.05
    if fmt is QuantFormat.INT8_CHANNEL:
        qw = quantize_int8_channel(w)
    elif fmt is QuantFormat.INT4_GROUP:
        qw = quantize_int4_group(w)
    else:  # Q8_0-style: symmetric int8 per group of 32
        scale = w.view(n, -1, 32).abs().amax(-1).clamp(min=1e-8) / 127
        codes = (torch.round(w.view(n, -1, 32) / scale[..., None]) + 128).to(torch.uint8).view(n, k)
        qw = QuantizedWeight(codes, scale.half().float(), (-128 * scale).half().float(), QuantFormat.INT8_GROUP)
    bias = torch.randn(n)
    x = torch.randn(rows, k)
    expected = x @ _dense(qw).T + bias
    layer = QuantizedLinear(qw, bias, torch.device("cpu"))
    fallback = QuantizedLinear(qw, bias, torch.device("cpu"), use_kernel=False)
    # Activations are quantized to int8 per group of 32 by the kernel: ~1% relative error.
    tol = 0.02 * expected.abs().max().item()
    for dtype in (torch.float32, torch.bfloat16):
        got = layer(x.to(dtype))
        assert got.dtype == dtype and got.shape == (rows, n)
        torch.testing.assert_close(got.float(), expected, atol=tol, rtol=0)
    # The fallback (what CUDA runs) is the plain matmul of the dequantized weight.
    torch.testing.assert_close(fallback(x), expected, atol=1e-4, rtol=1e-4)
    # Every path compiled in here (portable, AVX2, AVX512-VNNI) computes the same thing.
    paths = kernel.quant_paths()
    assert paths[0] == 0 and len(paths) > 1, paths
    portable = kernel.quant_linear(
        x, layer.packed, layer.col_scale, layer.bias, layer.padded_out, k, int(fmt), 0, False
    )
    for path in paths[1:]:
        torch.testing.assert_close(
            kernel.quant_linear(
                x, layer.packed, layer.col_scale, layer.bias, layer.padded_out, k, int(fmt), path, False
            ),
            portable,
            atol=1e-4,
            rtol=1e-5,
        )
    logits = QuantizedLinear(qw, None, torch.device("cpu"), float_out=True)(x.bfloat16())
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected - bias, atol=tol, rtol=0)


def test_quantizers_round_trip_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(32, 128)
    q8 = quantize_int8_channel(w)
    assert ((q8.dequantize() - w).abs() <= q8.scale[:, None] / 2 + 1e-6).all()
    q4 = quantize_int4_group(w)
    step = q4.scale.repeat_interleave(32, dim=1)
    assert ((q4.dequantize() - w).abs() <= step / 2 + 1e-3).all()
    assert q4.codes.max() <= 15


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_ops_match_torch(kernel, dtype):
    torch.manual_seed(1)
    cpu = select_layer_ops(torch.device("cpu"))
    assert cpu.name == "cpu"
    x, w = torch.randn(7, 576, dtype=dtype), torch.randn(576, dtype=dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-5), TORCH_LAYER_OPS.rms_norm(x, w, 1e-5), **tol)
    residual_a, residual_b = torch.randn(7, 576, dtype=dtype), None
    residual_b = residual_a.clone()
    out_a = cpu.add_rms_norm(x, residual_a, w, 1e-5)
    out_b = TORCH_LAYER_OPS.add_rms_norm(x, residual_b, w, 1e-5)
    torch.testing.assert_close(residual_a, residual_b, atol=0, rtol=0)  # the residual add is exact
    torch.testing.assert_close(out_a, out_b, **tol)
    gate_up = torch.randn(5, 2 * 1536, dtype=dtype)
    torch.testing.assert_close(cpu.silu_mul(gate_up), TORCH_LAYER_OPS.silu_mul(gate_up), **tol)


@pytest.mark.parametrize("cache_dtype", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_and_cache_write_match_reference(model_dir, cache_dtype, dtype):
    from pdserve.engine.model_config import ModelConfig

    config = ModelConfig.from_folder(model_dir)
    rope = RotaryEmbedding(config)
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    fmt = KVFormat(cache_dtype, kv_heads, dim, dtype)
    fused, ref = select_backend(torch.device("cpu"), "cpu", fmt), select_backend(torch.device("cpu"), "torch", fmt)
    assert fused.rope_write_kv is not None and ref.rope_write_kv is None
    torch.manual_seed(2)
    tokens = 11
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    positions = torch.tensor([0, 1, 2, 3, 500, 501, 17, 18, 19, 2000, 7])
    slots = torch.randperm(64)[:tokens]
    caches = [torch.zeros(8, 8, *fmt.slot_shape(), dtype=fmt.storage_dtype) for _ in range(2)]
    q1, k1, v1 = rope_then_write(fused, qkv.clone(), positions, rope, caches[0], slots, heads, kv_heads, dim)
    q2, k2, v2 = rope_then_write(ref, qkv.clone(), positions, rope, caches[1], slots, heads, kv_heads, dim)
    exact = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    for a, b in ((q1, q2), (k1, k2), (v1, v2)):
        torch.testing.assert_close(a, b, **exact)
    got_k, got_v = reference.gather_kv(caches[0], torch.arange(8), 64, fmt)
    want_k, want_v = reference.gather_kv(caches[1], torch.arange(8), 64, fmt)
    # Stored values agree up to one quantization step (a rounding tie may fall either way).
    step = {"auto": dict(atol=1e-2, rtol=1e-2), "int8": dict(atol=0.04, rtol=0), "fp8": dict(atol=1e-2, rtol=0.13)}
    torch.testing.assert_close(got_k.float(), want_k.float(), **step[cache_dtype])
    torch.testing.assert_close(got_v.float(), want_v.float(), **step[cache_dtype])


def test_auto_backend_on_cpu_uses_it(kernel):
    assert select_backend(torch.device("cpu"), "auto").name == "cpu"
    assert select_backend(torch.device("cpu"), "torch").name == "torch"
    assert select_backend(torch.device("cpu"), "auto", KVFormat("int8", 3, 64, torch.float32)).name == "cpu+int8"
    with pytest.raises(ValueError, match="attention backend"):
        select_backend(torch.device("cpu"), "magic")


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tokens, prior", [(1, 0), (5, 0), (37, 0), (129, 0), (40, 60), (1, 300)])
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim", [(9, 3, 64), (4, 4, 128), (8, 1, 128)])
def test_prefill_attention_matches_reference(kernel, dtype, atol, tokens, prior, num_q_heads, num_kv_heads, head_dim):
    if not kernel.has_prefill_attention(head_dim):
        pytest.skip(reason="the prefill attention kernel needs AVX2 + FMA or AVX-512; elsewhere the backend runs SDPA")
    torch.manual_seed(tokens + prior)
    # q as a strided view into a fused qkv tensor, as the model passes it.
    qkv = torch.randn(tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : num_q_heads * head_dim].view(tokens, num_q_heads, head_dim)
    k = torch.randn(prior + tokens, num_kv_heads, head_dim, dtype=dtype)
    v = torch.randn(prior + tokens, num_kv_heads, head_dim, dtype=dtype)
    scale = head_dim**-0.5
    got = kernel.prefill_attention(q, k, v, scale, prior)
    positions = torch.arange(prior, prior + tokens)
    mask = positions[:, None] >= torch.arange(prior + tokens)[None, :]
    expected = reference._attention(q.float(), k.float(), v.float(), scale, attn_mask=mask)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), expected, atol=atol, rtol=0)


def test_prefill_attention_refuses_what_it_cannot_do(kernel):
    q, k = torch.randn(4, 2, 64), torch.randn(3, 2, 64)
    # Without AVX2 the kernel is not built for any head_dim: that refusal comes first.
    with pytest.raises(RuntimeError, match="last positions" if kernel.has_prefill_attention(64) else "head_dim"):
        kernel.prefill_attention(q, k, k, 0.1, 0)
    with pytest.raises(RuntimeError, match="head_dim"):
        kernel.prefill_attention(torch.randn(4, 2, 80), torch.randn(4, 2, 80), torch.randn(4, 2, 80), 0.1, 0)


def test_the_shared_temp_folder_for_the_build_must_be_this_users_own(tmp_path, monkeypatch):
    import os
    import tempfile

    from pdserve.kernels import cpu_extension

    home = tmp_path / "home"
    home.write_text("not a folder: ~/.cache cannot be made")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv(cpu_extension.CACHE_ENV, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made = cpu_extension.cache_root()
    assert made == tmp_path / f"pdserve-kernels-{os.getuid()}" and made.stat().st_mode & 0o777 == 0o700
    made.chmod(0o777)  # as if another user had made it first, open to all
    with pytest.raises(OSError, match="not this user's own private folder"):
        cpu_extension.cache_root()


def test_a_failed_kernel_build_is_reported_by_its_cause_not_its_first_command():
    from pdserve.kernels.cpu_extension import _why

    ninja = RuntimeError(
        "Error building extension 'k': [1/3] c++ -MMD -MF a.o.d -O3 -c a.cpp -o a.o\n"
        "FAILED: b.o\nc++ -MMD -c b.cpp -o b.o\nb.cpp:3:1: error: expected ';' before '}' token\n"
        "ninja: build stopped: subcommand failed."
    )
    assert _why(ninja) == "FAILED: b.o | b.cpp:3:1: error: expected ';' before '}' token"
    assert "No space left" in _why(
        RuntimeError("Error building extension 'k'\nFatal error: a.o: No space left on device")
    )


def test_a_build_that_cannot_happen_here_fails_make_test_but_only_warns_the_demo(monkeypatch, capsys):
    from pdserve.kernels import cpu_extension

    monkeypatch.setattr(cpu_extension, "load", lambda: None)  # as with no C++ compiler
    assert cpu_extension.main([]) == 1
    assert cpu_extension.main(["--optional"]) == 0
    assert "will use its torch fallbacks" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", [QuantFormat.INT8_CHANNEL, QuantFormat.INT8_GROUP, QuantFormat.INT4_GROUP])
def test_every_quant_path_takes_the_full_code_range(kernel, fmt):
    """The extreme codes (int8 -128 and 127, int4 0 and 15) against full-scale activations: the
    AVX2 path's sign trick must not flip -128, and no 16-bit pair sum may saturate."""
    torch.manual_seed(3)
    n, k, rows = 32, 128, 3
    top = 15 if fmt is QuantFormat.INT4_GROUP else 255
    codes = torch.randint(0, top + 1, (n, k), dtype=torch.uint8)
    codes[:, :32] = top  # one whole group at the largest code ...
    codes[:, 32:96] = torch.tensor([0, top], dtype=torch.uint8).repeat(n, 32)  # ... and the extremes, side by side
    grouped = fmt is not QuantFormat.INT8_CHANNEL
    scale = torch.rand(n, k // 32) * 0.01 + 0.001 if grouped else torch.rand(n) * 0.01 + 0.001
    zero = -(top + 1) // 2 * scale
    qw = QuantizedWeight(codes, scale.half().float(), zero.half().float(), fmt)
    layer = QuantizedLinear(qw, None, torch.device("cpu"))
    x = torch.randn(rows, k) * 3
    x[:, :32] = 4.0  # ... times full-scale activations of one sign
    x[:, 32:96] = torch.tensor([-4.0, 4.0]).repeat(rows, 32)  # and of both signs
    expected = x @ qw.dequantize(torch.float32).T
    tol = 0.02 * expected.abs().max().item()
    for path in kernel.quant_paths():
        got = kernel.quant_linear(
            x, layer.packed, layer.col_scale, layer.bias, layer.padded_out, k, int(fmt), path, False
        )
        torch.testing.assert_close(got[:, :n], expected, atol=tol, rtol=0)


def test_fp32_activations_quantize_exactly_as_the_scalar_loop_does(kernel):
    """fp32 activations take a vector quantizer, other dtypes the scalar loop; a float64 copy of
    the same values (exact) must give bit-identical outputs, with groups of zeros, ties, one sign
    and values too small to scale."""
    torch.manual_seed(5)
    n, k, rows = 32, 256, 7
    qw = quantize_int4_group(torch.randn(n, k) * 0.05)
    layer = QuantizedLinear(qw, None, torch.device("cpu"))
    x = torch.randn(rows, k) * torch.logspace(-3, 3, rows)[:, None]
    x[0, :32] = 0.0  # an all-zero group: scale 0
    x[1, :32] = torch.arange(32) - 15.5  # scale 127 / 127 = 1: every value a round-to-even tie ...
    x[1, 0] = 127.0  # ... under this group maximum
    x[2, 32:64] = -x[2, 32:64].abs()  # one sign only
    x[3, 64:96] = torch.randn(32) * 1e-38  # 127 / max|x| overflows: zeros, not -128s
    for path in kernel.quant_paths():
        as_fp32, as_fp64 = (
            kernel.quant_linear(v, layer.packed, layer.col_scale, layer.bias, layer.padded_out, k, 2, path, True)
            for v in (x, x.double())
        )
        assert torch.equal(as_fp32, as_fp64), (path, (as_fp32 - as_fp64).abs().max())
    # The tiny group adds nothing: row 3 equals row 3 with that group zeroed.
    cleared = x.clone()
    cleared[3, 64:96] = 0.0
    zeroed = kernel.quant_linear(cleared, layer.packed, layer.col_scale, layer.bias, layer.padded_out, k, 2, -1, True)
    assert torch.equal(as_fp32[3], zeroed[3])
