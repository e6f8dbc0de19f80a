"""The router process never loads torch (nor the model code that needs it): it starts in about
a second and holds a fraction of a worker's memory. bench/startup.py measures both."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import pytest

import pdserve.router

pytestmark = pytest.mark.e2e  # starts a Python process

ROUTER_MODULES = sorted(
    [
        "pdserve.cli",
        "pdserve.client",
        "pdserve.launcher",
        "pdserve.settings",
        "pdserve.wire",
        "pdserve.request_rules",
        "pdserve.prefix_hash",
    ]
    + [f"pdserve.router.{m.name}" for m in pkgutil.iter_modules(pdserve.router.__path__)]
)

PROGRAM = """
import json, sys
modules = json.loads(sys.argv[1])
for name in modules:
    __import__(name)
from pdserve.router.request import ChatMessage, CompletionRequest
from pdserve.router.tokenizer import RouterTokenizer
from pdserve.router.validation import validate

tokenizer = RouterTokenizer(sys.argv[2])
validate(CompletionRequest(prompt="Hello"), tokenizer)
validate(CompletionRequest(messages=(ChatMessage("user", "Hi"),)), tokenizer)
print(json.dumps(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))))
"""


def test_router_modules_and_tokenizer_do_not_import_torch(model_dir):
    assert "pdserve.router.main" in ROUTER_MODULES and "pdserve.router.openai_api" in ROUTER_MODULES
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM, json.dumps(ROUTER_MODULES), str(model_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [], "the router imported torch"


def test_the_held_context_warns_only_below_the_routers_own(caplog):
    """A worker's smaller context is a misconfiguration worth a warning; workers that agree, or
    none reporting (all down), are not."""
    import logging
    from types import SimpleNamespace

    from pdserve.router.tokenizer import RouterTokenizer

    tokenizer = SimpleNamespace(configured_max_model_len=2048, max_model_len=2048)
    hold = lambda context: RouterTokenizer.hold_to(tokenizer, context)  # noqa: E731
    with caplog.at_level(logging.INFO, logger="pdserve.router.tokenizer"):
        for context in (2048, None, 4096):
            hold(context)
        assert tokenizer.max_model_len == 2048 and not caplog.records
        RouterTokenizer.hold_to(tokenizer, 1024, ["127.0.0.1:9001"])
        assert tokenizer.max_model_len == 1024 and caplog.records[-1].levelno == logging.WARNING
        assert "what 127.0.0.1:9001 report(s)" in caplog.records[-1].getMessage()  # names the worker
        hold(1024)
        hold(None)  # every worker down: the router's own again, said at INFO
        assert tokenizer.max_model_len == 2048 and len(caplog.records) == 2
        assert caplog.records[-1].levelno == logging.INFO
