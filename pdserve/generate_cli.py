"""``pdserve generate``: stream one completion to the terminal (text, or JSON lines)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import grpc

from pdserve.client import Client, build_request
from pdserve.security import client_credentials


def run_generate(args: argparse.Namespace) -> int:
    try:
        request, credentials = _request_and_credentials(args)
    except (ValueError, OSError) as e:  # a seed past 64 bits, a missing TLS file
        print(f"pdserve generate: error: {e}", file=sys.stderr)
        return 2
    metadata = (("authorization", f"Bearer {args.api_token}"),) if args.api_token else ()
    with Client(args.addr, credentials=credentials, metadata=metadata) as client:
        try:
            for msg in client.stream(request, timeout=args.timeout):
                if args.json:
                    print(json.dumps(_as_json(msg)), flush=True)
                else:
                    sys.stdout.write(msg.text)
                    sys.stdout.flush()
                    if msg.finish_reason:
                        usage = msg.usage
                        print(
                            f"\n[finish_reason={msg.finish_reason} prompt_tokens={usage.prompt_tokens} "
                            f"completion_tokens={usage.completion_tokens} ttft_ms={usage.ttft_ms:.1f}]",
                            file=sys.stderr,
                        )
        except grpc.RpcError as e:
            print(f"pdserve generate: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # Ctrl-C: closing the channel cancels the request
            print(file=sys.stderr)
            return 130
        except BrokenPipeError:  # the reader left (`| head`): closing the channel cancels the request
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
            return 128 + signal.SIGPIPE
    return 0


def _request_and_credentials(args: argparse.Namespace):
    sampling = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
    )
    if args.chat:
        request = build_request(messages=[{"role": "user", "content": args.prompt}], **sampling)
    else:
        request = build_request(args.prompt, **sampling)
    return request, client_credentials(args)


def _as_json(msg) -> dict:
    out = {
        "request_id": msg.request_id,
        "token_ids": list(msg.token_ids),
        "text": msg.text,
        "finish_reason": msg.finish_reason or None,
    }
    if msg.finish_reason:
        u = msg.usage
        out["usage"] = {
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "cached_prompt_tokens": u.cached_prompt_tokens,
            "ttft_ms": round(u.ttft_ms, 3),
            "e2e_ms": round(u.e2e_ms, 3),
        }
    return out
