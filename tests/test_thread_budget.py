"""A decode worker borrows an idle prefill worker's cores (engine/thread_budget.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS
from test_engine import GREEDY, MAX_NEW, LocalHandoff, assert_all_free, make_engine

from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.kv_connector import KVReceive, KVSend
from pdserve.engine.thread_budget import ThreadBudget

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_borrows_only_for_decode_steps_with_nothing_waiting_for_remote_kv():
    torch.set_num_threads(1)
    budget = ThreadBudget(3, CPU)
    assert budget.for_step(prefills_here=False, waiting_for_kv=False) == 3
    assert torch.get_num_threads() == 3
    assert budget.for_step(prefills_here=False, waiting_for_kv=True) == 1  # a prefill worker computes for us
    assert torch.get_num_threads() == 1
    assert budget.for_step(prefills_here=True, waiting_for_kv=False) == 1  # a prompt of our own
    assert budget.for_step(prefills_here=False, waiting_for_kv=False) == 3


@pytest.mark.parametrize(
    "borrow, device, world_size",
    [(None, CPU, 1), (1, CPU, 1), (4, torch.device("cuda"), 1), (4, CPU, 2)],
    ids=["not set", "not more than its own", "a GPU engine", "parallel ranks"],
)
def test_keeps_its_own_threads(borrow, device, world_size):
    torch.set_num_threads(2)
    budget = ThreadBudget(borrow, device, world_size)
    assert budget.for_step(prefills_here=False, waiting_for_kv=False) == 2
    assert torch.get_num_threads() == 2


def test_an_engine_whose_threads_fill_the_cores_sends_layers_after_the_forward(monkeypatch):
    """A sending thread beside a forward on every core would preempt a compute thread: the KV
    connector then sends a prompt's layers once its forward is done (kv_connector.pipelined)."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    torch.set_num_threads(2)
    assert ThreadBudget(None, CPU).fills_cores
    assert not ThreadBudget(None, torch.device("cuda")).fills_cores
    torch.set_num_threads(1)
    assert not ThreadBudget(4, CPU).fills_cores  # its own threads leave a core; borrowing is decode-only


def test_without_an_affinity_api_every_core_of_the_machine_counts(monkeypatch):
    """Where os.sched_getaffinity does not exist (macOS), the budget counts os.cpu_count()."""
    monkeypatch.delattr("os.sched_getaffinity")
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    torch.set_num_threads(2)
    assert not ThreadBudget(None, CPU).fills_cores
    torch.set_num_threads(4)
    assert ThreadBudget(None, CPU).fills_cores


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_borrow_threads_is_validated(value):
    with pytest.raises(ValueError, match="borrow_threads"):
        EngineConfig(borrow_threads=value)


@pytest.mark.e2e
def test_decode_engine_gives_cores_back_while_a_prefill_fills_its_cache(model_dir, hf_reference):
    """The real model: decode steps run on the prefill worker's share only while a prompt of
    the decode engine waits for remote KV, on the borrowed threads after, and the greedy
    tokens are transformers' either way."""
    prefill = make_engine(model_dir)
    decode = make_engine(model_dir, num_threads=1, borrow_threads=2)
    threads_per_forward: list[int] = []
    run = decode.runner.run
    decode.runner.run = lambda *a: (threads_per_forward.append(torch.get_num_threads()), run(*a))[1]
    local_ids, remote_ids = (hf_reference.tokenizer(p).input_ids for p in PROMPTS[:2])

    decode.add_request("local", local_ids, GREEDY)
    decode.add_request("remote", remote_ids, GREEDY, kv_receive=KVReceive(handoff := LocalHandoff(prefill, decode)))
    tokens = {"local": [], "remote": []}
    for _ in range(3):  # the local prompt's prefill, then decode steps while "remote" waits
        for out in decode.step():
            tokens[out.request_id] += out.new_token_ids
    assert threads_per_forward == [1, 1, 1]

    prefill.add_request("remote", remote_ids, GREEDY, kv_send=KVSend(handoff))
    while prefill.has_unfinished():
        prefill.step()
    while decode.has_unfinished():
        for out in decode.step():
            tokens[out.request_id] += out.new_token_ids
    assert threads_per_forward[3:] and set(threads_per_forward[3:]) == {2}  # nothing waits: borrowed
    assert tokens["local"] == hf_reference.greedy(local_ids, MAX_NEW)
    assert tokens["remote"] == hf_reference.greedy(remote_ids, MAX_NEW)[1:]  # the first came from the prefill
    assert_all_free(decode)
    assert_all_free(prefill)


@pytest.mark.e2e
def test_the_engine_pipelines_its_sends_only_with_a_core_to_spare(model_dir, monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert make_engine(model_dir, num_threads=2).connector.pipelined is False
    assert make_engine(model_dir, num_threads=1).connector.pipelined is True
