"""The router owns the ids workers key on (no model, no processes)."""

from __future__ import annotations

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.dispatch import Attempt, _decode_request, _prefill_request
from pdserve.router.validation import ValidatedRequest
from pdserve.v1 import pdserve_pb2 as pb


def test_each_attempt_gets_its_own_key_and_the_client_id_is_only_passed_along():
    request = ValidatedRequest(
        request_id="client-id", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=4)
    )
    first, retry = Attempt(request, []), Attempt(request, [7])
    assert first.key != retry.key and len(first.key) == 32
    decode, prefill = _decode_request(first, prefill_locally=False), _prefill_request(first, pb.KvTarget())
    assert decode.request_id == prefill.request_id == first.key
    assert decode.client_request_id == prefill.client_request_id == "client-id"
    assert _decode_request(retry, prefill_locally=False).request_id == retry.key
