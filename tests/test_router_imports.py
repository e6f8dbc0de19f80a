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
