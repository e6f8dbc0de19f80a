"""What the fuzz tests (tests/test_fuzz_*.py) share: bounded, reproducible hypothesis
settings, and the KV-transfer peer that the handshake and live-server fuzzers talk as (its
HELLO, and the HMAC challenge-response it answers with the cluster credential).

Every fuzz test runs on CPU with derandomized (reproducible) examples. Explore more:
``PDSERVE_FUZZ_RANDOM=1 PDSERVE_FUZZ_SCALE=10 pytest tests/test_fuzz_*.py``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from pdserve.kvtransfer.handshake import PeerInfo, host_id

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
UINT64_MAX, UINT32_MAX = 2**64 - 1, 2**32 - 1

_RANDOM = os.environ.get("PDSERVE_FUZZ_RANDOM") == "1"
_SCALE = float(os.environ.get("PDSERVE_FUZZ_SCALE", "1"))


def fuzz(max_examples: int, **kw) -> settings:
    """Bounded, reproducible (unless PDSERVE_FUZZ_RANDOM=1), no example database on disk, and no
    per-example deadline: a loaded machine must not fail a test (work is bounded by the
    examples' sizes instead)."""
    return settings(
        max_examples=max(1, int(max_examples * _SCALE)),
        deadline=None,
        derandomize=not _RANDOM,
        database=None,
        print_blob=_RANDOM,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        **kw,
    )


# -- the KV peer: a tiny cache geometry and the credential both sides hold -------------------------
LAYERS, HEADS, DIM, BLOCK, NUM_BLOCKS = 3, 2, 8, 8, 32
TOKEN_BYTES = 2 * HEADS * DIM * 4
MAX_PAYLOAD = NUM_BLOCKS * BLOCK * TOKEN_BYTES
CREDENTIAL = b"fuzz-credential"
WRONG_CREDENTIAL = b"not-the-fuzz-credential"
NONCE = bytes(range(32))  # the prefill side's nonce in ``peer_dict``'s HELLO (fresh per handshake in real workers)


def peer_dict(**changes) -> dict:
    base = dict(
        model_fingerprint="fuzz",
        dtype="float32",
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=DIM,
        block_size=BLOCK,
        transports=["tcp"],
        host_id=host_id(),
        role="prefill",
        extra={},
        token_bytes=TOKEN_BYTES,
        nonce=NONCE.hex(),
        proof="",
    )
    return {**base, **changes}


DECODE_INFO = PeerInfo(**{**peer_dict(role="decode", nonce=""), "transports": ("tcp",)})

json_scalars = (
    st.none() | st.booleans() | st.integers(INT64_MIN, INT64_MAX) | st.floats(allow_nan=False) | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=8,
)
PEER_FIELDS = list(peer_dict())


CHANGED_FIELDS = st.sets(st.sampled_from(PEER_FIELDS))
DROP_OR_RETYPE = st.sampled_from(["drop", "retype"])
ADDED_FIELDS = st.dictionaries(st.text(max_size=12), json_values, max_size=2)


@st.composite
def peer_json_objects(draw) -> dict:
    """JSON objects shaped like a PeerInfo, with fields dropped, retyped or added."""
    obj = peer_dict()
    for name in draw(CHANGED_FIELDS, label="changed"):
        if draw(DROP_OR_RETYPE) == "drop":
            obj.pop(name)
        else:
            obj[name] = draw(json_values)
    obj.update(draw(ADDED_FIELDS, label="added"))
    return obj


def encodings() -> st.SearchStrategy[str]:
    return st.sampled_from(["utf-8", "utf-16", "utf-32", "utf-16-le"])  # json.loads detects each from the first bytes


# -- the HMAC challenge-response, written from the protocol (kvtransfer/handshake.py's docstring) -------
# A test client of its own, so a change to what goes over the wire shows here.


def _hmac(credential: bytes, *parts: bytes) -> bytes:
    return hmac.new(credential, b"|".join(parts), hashlib.sha256).digest()


def hello_nonce(hello: bytes) -> bytes:
    """The prefill nonce the decode side reads from a HELLO payload: its hex ``nonce`` field (one
    that is missing or not hex counts as empty)."""
    try:
        return bytes.fromhex(json.loads(hello)["nonce"])
    except (ValueError, KeyError, TypeError, RecursionError):
        return b""


def auth_answer(challenge: bytes, hello: bytes, credential: bytes = CREDENTIAL) -> bytes:
    """The AUTH payload of a prefill worker holding ``credential``: HMAC-SHA256 over "client",
    the decode side's nonce, its own nonce and the hash of the HELLO it sent."""
    return _hmac(credential, b"client", challenge, hello_nonce(hello), hashlib.sha256(hello).digest())


def server_proof(nonce: bytes, challenge: bytes, credential: bytes = CREDENTIAL) -> str:
    """The ``proof`` a decode worker holding ``credential`` puts in HELLO_OK (hex)."""
    return _hmac(credential, b"server", nonce, challenge).hex()
