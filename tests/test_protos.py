"""The generated code under protos/ is what the .proto produces (regenerate with scripts/gen_protos.sh),
and the Python client fills its messages as callers mean."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # runs the protobuf compiler
ROOT = Path(__file__).resolve().parents[1]
GENERATED = ("pdserve_pb2.py", "pdserve_pb2.pyi", "pdserve_pb2_grpc.py")


def test_generated_code_is_up_to_date(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run([str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)], check=True, cwd=ROOT, env=env)
    for name in GENERATED:
        fresh = (tmp_path / "pdserve" / "v1" / name).read_text()
        committed = (ROOT / "protos" / "pdserve" / "v1" / name).read_text()
        assert fresh == committed, f"protos/pdserve/v1/{name} is stale: run scripts/gen_protos.sh"


def test_the_client_takes_one_stop_string_or_a_list():
    from pdserve.client import build_request

    assert list(build_request("hi", stop="END").sampling.stop) == ["END"]
    assert list(build_request("hi", stop=["a", "bc"], stop_token_ids=[2, 3]).sampling.stop) == ["a", "bc"]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (dict(top_k=10**20), "sampling.top_k"),
        (dict(max_tokens=2**70), "sampling.max_tokens"),
        (dict(temperature="hot"), "sampling.temperature"),
        (dict(bogus=1), "sampling.bogus"),
        (dict(prompt="\udcff\udcfe"), "prompt"),  # argv bytes that are not UTF-8
        (dict(priority=2**40), "priority"),
    ],
)
def test_the_client_names_a_field_the_message_cannot_carry(fields, named):
    from pdserve.client import build_request

    prompt = fields.pop("prompt", "hi")
    with pytest.raises(ValueError, match=f"^{named.replace('.', '[.]')}: "):
        build_request(prompt, **fields)


def test_generate_returns_one_choice_and_refuses_several():
    from pdserve.client import Client

    with Client("127.0.0.1:1") as client, pytest.raises(ValueError, match="^n: .*stream"):
        client.generate("hi", n=2)  # refused before any call
