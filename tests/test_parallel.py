"""Tensor/pipeline parallel building blocks, without starting ranks: layouts and their refusals,
checkpoint slicing, micro-batches, the step channel's packing, rank supervision, the settings."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import pytest
import torch

from pdserve.config import add_arguments, load_file, resolve
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.forward_batch import ForwardBatch, PrefillSegment
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel.driver import ParallelDriver
from pdserve.engine.parallel.layout import ParallelLayout, kv_heads_of
from pdserve.engine.parallel.pipeline import split_batch
from pdserve.engine.parallel.sharding import NEXT_STAGE_NORM, ModelShard
from pdserve.engine.parallel.step_channel import CARRIED_FIELDS, pack, unpack
from pdserve.engine.parallel.supervisor import POLL_S, RankSupervisor
from pdserve.launcher import Cluster
from pdserve.settings import ClusterSettings, RouterSettings, WorkerSettings


def llama(**kw) -> ModelConfig:
    cfg = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
    )  # SmolLM2-135M's shape
    return ModelConfig.from_dict({**cfg, **kw})


def test_layouts_that_cannot_split_the_model_are_refused_naming_the_numbers():
    smol = llama()
    for tp in (1, 3):
        ParallelLayout(tp).check(smol)
    ParallelLayout(9).check(llama(intermediate_size=1152))  # more ranks than KV heads: each head on 3 ranks
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size 2 does not divide the model's 9 query heads.*fit this model: 1, 3\)"
    ):
        ParallelLayout(2).check(smol)
    with pytest.raises(
        ValueError, match="tensor_parallel_size 3 is more than the model's 2 KV heads but not a multiple"
    ):
        ParallelLayout(3).check(
            llama(num_attention_heads=12, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=48)
        )
    with pytest.raises(ValueError, match="intermediate size 10"):
        ParallelLayout(4).check(llama(num_attention_heads=4, num_key_value_heads=2, intermediate_size=10))
    with pytest.raises(ValueError, match="pipeline_parallel_size 31 exceeds the model's 30 layers"):
        ParallelLayout(1, 31).check(smol)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        ParallelLayout(0)


def test_kv_heads_are_split_or_replicated_as_vllm_does():
    assert [list(kv_heads_of(r, 3, 3)) for r in range(3)] == [[0], [1], [2]]
    assert [kv_heads_of(r, 3, 9).start for r in range(9)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # each head on 3 ranks
    assert [list(kv_heads_of(r, 8, 2)) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    layout = ParallelLayout(1, 4)
    assert [len(layout.stage_layers(s, 30)) for s in range(4)] == [8, 8, 7, 7]
    assert [layout.stage_of_layer(i, 30) for i in (0, 7, 8, 16, 29)] == [0, 0, 1, 2, 3]


def tiny_state(config: ModelConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    h, d = config.hidden_size, config.head_dim
    qkv = (config.num_heads + 2 * config.num_kv_heads) * d
    state = {"model.embed_tokens.weight": torch.randn(config.vocab_size, h), "model.norm.weight": torch.randn(h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        state |= {
            p + "self_attn.qkv_proj.weight": torch.randn(qkv, h),
            p + "self_attn.o_proj.weight": torch.randn(h, config.num_heads * d),
            p + "self_attn.o_proj.bias": torch.randn(h),
            p + "mlp.gate_up_proj.weight": torch.randn(2 * config.intermediate_size, h),
            p + "mlp.down_proj.weight": torch.randn(h, config.intermediate_size),
            p + "input_layernorm.weight": torch.randn(h),
            p + "post_attention_layernorm.weight": torch.randn(h),
        }
    return state


def test_tensor_parallel_slices_compute_the_whole_layer():
    config = llama(
        vocab_size=10,
        hidden_size=16,
        intermediate_size=12,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=3,
        tie_word_embeddings=True,
        attention_bias=True,
    )
    state, tp = tiny_state(config), 3
    shards = [ModelShard(ParallelLayout(tp), r, config).shard_state(state) for r in range(tp)]
    w, d = "model.layers.0.", config.head_dim
    q, k, v = state[w + "self_attn.qkv_proj.weight"].split((6 * d, 3 * d, 3 * d))
    for r, shard in enumerate(shards):  # each rank holds the rows of its own heads: 2 query heads, 1 KV head
        q_r, k_r, v_r = shard[w + "self_attn.qkv_proj.weight"].split((2 * d, d, d))
        assert torch.equal(q_r, q[2 * r * d : 2 * (r + 1) * d]) and torch.equal(k_r, k[r * d : (r + 1) * d])
        assert torch.equal(v_r, v[r * d : (r + 1) * d])
    attn = torch.randn(5, 6 * d)  # row parallel: partial products (one bias) sum to the whole
    whole = attn @ state[w + "self_attn.o_proj.weight"].T + state[w + "self_attn.o_proj.bias"]
    parts = sum(
        attn[:, 2 * r * d : 2 * (r + 1) * d] @ s[w + "self_attn.o_proj.weight"].T + s[w + "self_attn.o_proj.bias"]
        for r, s in enumerate(shards)
    )
    torch.testing.assert_close(parts, whole)
    gate, up = state[w + "mlp.gate_up_proj.weight"].chunk(2)
    for r, s in enumerate(shards):
        g_r, u_r = s[w + "mlp.gate_up_proj.weight"].chunk(2)
        assert torch.equal(g_r, gate[4 * r : 4 * (r + 1)]) and torch.equal(u_r, up[4 * r : 4 * (r + 1)])
    rows = torch.cat([s["model.embed_tokens.weight"] for s in shards])  # 10 rows over 3 ranks: 4, 4, 2 + 2 padding
    assert rows.shape[0] == 12 and torch.equal(rows[:10], state["model.embed_tokens.weight"]) and not rows[10:].any()
    assert ModelShard(ParallelLayout(tp), 1, config).local_config().num_heads == 2


def test_pipeline_stages_take_their_layers_and_the_next_stage_norm():
    config = llama(
        vocab_size=10,
        hidden_size=16,
        intermediate_size=12,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    state = tiny_state(config)
    first, last = (ModelShard(ParallelLayout(1, 2), r, config).shard_state(state) for r in (0, 1))
    assert {k.split(".")[2] for k in first if k.startswith("model.layers.")} == {"0", "1", "2"}
    assert torch.equal(first["model.layers.2.input_layernorm.weight"], state["model.layers.2.input_layernorm.weight"])
    assert torch.equal(first[f"{NEXT_STAGE_NORM}.weight"], state["model.layers.3.input_layernorm.weight"])
    assert "model.norm.weight" not in first and "model.embed_tokens.weight" in first
    assert torch.equal(last["model.layers.0.input_layernorm.weight"], state["model.layers.3.input_layernorm.weight"])
    assert "model.norm.weight" in last and "model.embed_tokens.weight" not in last  # untied: the last stage has lm_head


def a_batch() -> ForwardBatch:
    """Two decodes, a whole 5-token prompt and a 4-token chunk after 6 cached tokens."""
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    return ForwardBatch(
        input_ids=t(range(100, 111)),
        positions=t([7, 3, 0, 1, 2, 3, 4, 6, 7, 8, 9]),
        slot_mapping=t(range(50, 61)),
        num_decode=2,
        decode_block_tables=t([[1, 2], [3, 0]]),
        decode_context_lens=t([8, 4]),
        prefills=[PrefillSegment(2, 5, 5, t([4])), PrefillSegment(7, 4, 10, t([5, 6]))],
        logits_indices=t([0, 1, 6, 10]),
    )


def test_micro_batches_cut_through_prompts_and_keep_the_logits_order():
    batch = a_batch()
    micro = split_batch(batch, 3)
    assert [m.batch.num_tokens for m in micro] == [4, 3, 4]
    assert torch.equal(torch.cat([m.batch.input_ids for m in micro]), batch.input_ids)
    first, second, third = (m.batch for m in micro)
    assert first.num_decode == 2 and first.decode_block_tables.shape == (2, 2)
    # The 5-token prompt is cut after 2 tokens: the second piece attends to the first through the cache.
    assert [(s.query_start, s.num_query, s.context_len, s.has_prior_context) for s in first.prefills] == [
        (2, 2, 2, False)
    ]
    assert [(s.query_start, s.num_query, s.context_len) for s in second.prefills] == [(0, 3, 5)]
    assert [(s.query_start, s.num_query, s.context_len) for s in third.prefills] == [(0, 4, 10)]
    assert [m.logits_rows for m in micro] == [[0, 1], [2], [3]]
    assert [m.batch.logits_indices.tolist() for m in micro] == [[0, 1], [2], [3]]
    assert len(split_batch(batch, 50)) == batch.num_tokens  # at most one micro-batch per token


def test_the_step_channel_carries_every_field_of_a_batch():
    assert set(CARRIED_FIELDS) == {f.name for f in dataclasses.fields(ForwardBatch)}, (
        "a ForwardBatch field is not broadcast to the other ranks: add it to step_channel.pack/unpack"
    )
    batch = a_batch()
    sizes, payload = pack(batch)
    back = unpack(sizes, payload.clone(), torch.device("cpu"))
    for name in CARRIED_FIELDS:
        mine, theirs = getattr(batch, name), getattr(back, name)
        if name == "prefills":
            assert [(s.query_start, s.num_query, s.context_len, s.block_table.tolist()) for s in theirs] == [
                (s.query_start, s.num_query, s.context_len, s.block_table.tolist()) for s in mine
            ]
        elif isinstance(mine, torch.Tensor):
            assert torch.equal(mine, theirs), name
        else:
            assert mine == theirs, name


def test_a_rank_that_dies_while_serving_is_reported_at_once():
    deaths = []
    supervisor = RankSupervisor(3, {}, None, on_death=lambda rank, code: deaths.append((rank, code)))
    supervisor.command = [
        sys.executable,
        "-c",
        "import os, sys, time; time.sleep(2 if os.environ['RANK'] == '2' else 30); sys.exit(3)",
    ]
    supervisor.start()
    supervisor.serving = True
    deadline = time.monotonic() + 20
    while not deaths and time.monotonic() < deadline:
        time.sleep(0.05)
    assert deaths == [(2, 3)]
    for process in supervisor.processes.values():  # the survivor goes with the supervisor's thread
        process.wait(10)


def test_a_failed_step_stops_the_worker_naming_the_rank_that_died():
    """Rank 0's collective fails first (the peer's socket closed): the worker stops as when the
    supervisor's poll sees the death, once, never failing its requests and going on."""
    deaths, broken = [], []
    supervisor = RankSupervisor(2, {}, None, on_death=lambda rank, code: deaths.append((rank, code)))
    supervisor.command = [sys.executable, "-c", "raise SystemExit(9)"]
    supervisor.start()
    supervisor.processes[1].wait(30)
    supervisor.serving = True
    driver = ParallelDriver.__new__(ParallelDriver)  # only its failure path, without ranks
    driver.supervisor, driver.on_broken = supervisor, broken.append
    driver._step_failed(RuntimeError("Connection reset by peer"))
    time.sleep(3 * POLL_S)  # the supervisor's own poll sees the same death: not reported twice
    assert deaths == [(1, 9)] and not broken
    driver.supervisor = None  # nothing died (say, torchrun started the ranks): the failure itself is named
    driver._step_failed(RuntimeError("boom"))
    assert broken == ["a step failed on rank 0 (RuntimeError: boom)"]


def test_a_rank_that_dies_while_starting_is_a_startup_failure():
    supervisor = RankSupervisor(2, {}, None, on_death=lambda rank, code: pytest.fail("not serving yet"))
    supervisor.command = [sys.executable, "-c", "raise SystemExit(4)"]
    supervisor.start()
    deadline = time.monotonic() + 20
    while supervisor.failure is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert supervisor.failure == "rank 1 exited with code 4 while the worker was starting"
    supervisor.close()


def test_parallel_sizes_are_settings_of_the_roles_and_of_up(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineConfig)
    assert resolve(EngineConfig, parser.parse_args(["--tensor-parallel-size", "3"]), env={}).tensor_parallel_size == 3
    assert resolve(EngineConfig, None, env={"PDSERVE_PIPELINE_PARALLEL_SIZE": "2"}).pipeline_parallel_size == 2
    (tmp_path / "c.yaml").write_text("tensor_parallel_size: 9\n")
    assert resolve(EngineConfig, None, env={}, file=load_file(tmp_path / "c.yaml")).world_size == 9
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="preemption_mode swap"):
        EngineConfig(pipeline_parallel_size=2, preemption_mode="swap")
    with pytest.raises(ValueError, match="decode_tp must be >= 1"):
        ClusterSettings(decode_tp=0)
    cluster = Cluster(
        EngineConfig(tensor_parallel_size=3),
        WorkerSettings(),
        RouterSettings(),
        ClusterSettings(prefill=1, decode=1, prefill_tp=1, decode_pp=2),
    )
    flags = [dict(a.split("=", 1) for a in args if "=" in a) for _, args in cluster.worker_commands(num_gpus=0)]
    assert (
        "--tensor-parallel-size" not in flags[0] and "--pipeline-parallel-size" not in flags[0]
    )  # prefill: TP 1, PP 1
    assert flags[1]["--tensor-parallel-size"] == "3" and flags[1]["--pipeline-parallel-size"] == "2"
    # Speculation belongs to the decode pool: a tensor-parallel prefill pool beside it is fine.
    speculating = Cluster(
        EngineConfig(speculative="ngram"), WorkerSettings(), RouterSettings(), ClusterSettings(prefill_tp=2)
    )
    flags = [dict(a.split("=", 1) for a in args if "=" in a) for _, args in speculating.worker_commands(num_gpus=0)]
    assert "--speculative" not in flags[0] and flags[0]["--tensor-parallel-size"] == "2"
    assert flags[1]["--speculative"] == "ngram"


@pytest.mark.parametrize(
    "argv",
    [
        ["--tensor-parallel-size", "3", "--prefill-tp", "3", "--decode-tp", "1", "--speculative", "ngram"],
        ["--tensor-parallel-size", "2", "--prefill-tp", "1", "--decode-tp", "1", "--preemption-mode", "swap"],
    ],
)
def test_up_judges_each_pool_by_its_own_size_when_both_set_one(argv, monkeypatch):
    """The engine's own size is nobody's when both pools set theirs: it refuses nothing."""
    from pdserve import cli

    monkeypatch.delenv("PDSERVE_CONFIG", raising=False)
    cluster = cli.cluster_of(cli._parser().parse_args(["up", *argv]), {})
    flags = [dict(a.split("=", 1) for a in args if "=" in a) for _, args in cluster.worker_commands(num_gpus=0)]
    assert flags[1].get("--tensor-parallel-size", "1") == "1"  # the decode pool, where these settings go
    with pytest.raises(ValueError):  # a pool whose own size cannot take them still refuses
        cli.cluster_of(cli._parser().parse_args(["up", *argv[2:4], "--decode-tp", "2", *argv[6:]]), {}).worker_commands(
            0
        )


def test_the_paper_projection_counts_bytes_from_the_shapes():
    from pdserve.bench.parallel_bench import SHAPES, parse_layouts

    llama8b, llama70b = SHAPES
    assert llama8b.allreduce_payload_per_token() == (2 * 32 + 1) * 4096 * 2  # o and down per layer, the embedding
    assert llama8b.kv_bytes_per_token() == 128 * 1024  # K and V x 32 layers x 8 heads x 128 x bf16
    assert llama70b.kv_bytes_per_token() == 320 * 1024
    assert parse_layouts("1x1, 3x1,1x2,2") == [(1, 1), (3, 1), (1, 2), (2, 1)]


def test_a_worker_that_cannot_split_its_model_says_so_before_starting_ranks_and_leaves_the_process_as_it_was(
    model_dir, monkeypatch
):
    """The default model has 9 query heads and 30 layers: TP 2 and PP 31 are refused naming the
    setting, before any rank starts; a start that fails later gives back the cores and the
    process group, so a later engine in the same process starts."""
    cores, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    started = []
    monkeypatch.setattr(ParallelDriver, "_start_ranks", lambda *a: started.append(a))
    for sizes, words in (
        (dict(tensor_parallel_size=2), "tensor_parallel_size 2 does not divide the model's 9 query heads"),
        (dict(pipeline_parallel_size=31), "pipeline_parallel_size 31 exceeds the model's 30 layers"),
    ):
        with pytest.raises(ValueError, match=words):
            ParallelDriver(EngineConfig(**sizes), str(model_dir), torch.device("cpu"))
    assert not started
    monkeypatch.setattr(ParallelDriver, "_start_ranks", lambda self, config, device: _pin_and_fail(cores))
    with pytest.raises(RuntimeError, match="the ranks could not start"):
        ParallelDriver(EngineConfig(pipeline_parallel_size=2), str(model_dir), torch.device("cpu"))
    assert sorted(os.sched_getaffinity(0)) == cores and torch.get_num_threads() == threads
    assert not torch.distributed.is_initialized()


def _pin_and_fail(cores: list[int]):
    from pdserve.engine.parallel.groups import pin_process

    pin_process(cores[:1])
    torch.set_num_threads(1)
    raise RuntimeError("the ranks could not start")
