"""The ``pagedserve`` command.

    pagedserve serve [--model smollm2-135m]          the whole stack on loopback (Ctrl-C stops it)
    pagedserve gateway|scheduler|worker [flags]      one service (see each one's --help)
    pagedserve generate "prompt" [--stream]          one generation through a gateway
    pagedserve chat ["message"]                      a chat (interactive without a message)
    pagedserve health host:port [--service NAME]     exit 0 iff the server reports SERVING
    pagedserve stats host:port                       a scheduler's workers, block pools and counters
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from pagedserve.aio_client import DEFAULT_ADDRESS
from servicekit.flags import add_flag, add_setting_flags, settings_kwargs
from servicekit.ports import SCHEDULER_PORT

SERVICES = ("gateway", "scheduler", "worker")


def _service_main(name: str):
    if name == "gateway":
        from gateway_service.main import main
    elif name == "scheduler":
        from scheduler_service.main import main
    else:
        from worker_service.main import main
    return main


def _add_tls_flags(parser: argparse.ArgumentParser, env) -> None:
    """The TLS files a client uses (``TlsClientConfig``): the same PAGEDSERVE_TLS_* variables a
    service's container has, so its healthcheck needs no flags."""
    from servicekit.tls import TlsClientConfig

    add_setting_flags(parser, env, TlsClientConfig)


def _tls(args: argparse.Namespace):
    from servicekit.tls import TlsClientConfig

    return TlsClientConfig(**settings_kwargs(TlsClientConfig, args)).tls


def _add_sampling_flags(parser: argparse.ArgumentParser, env) -> None:
    add_flag(parser, env, "address", default=DEFAULT_ADDRESS,
             help="gateway address host:port; several, comma-separated, to fail over between them")
    add_flag(parser, env, "api-key", default="", secret=True, help="API key of the gateway (prefer the env var)")
    _add_tls_flags(parser, env)
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the served model's, as /v1/models shows)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--min-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: one is assigned)")
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    parser.add_argument("--stream", action="store_true", help="print tokens as they arrive")


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  min_p=args.min_p, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos or None)
    return {k: v for k, v in kwargs.items() if v is not None}


def build_parser(env) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve",
        description="LLM serving with PagedAttention and continuous batching, as gRPC microservices "
                    "(gateway -> Redis -> scheduler -> workers).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser("serve", add_help=False, help="run Redis + worker + scheduler + gateway on loopback "
                                                 "(pagedserve serve --help for its flags)")
    for name in SERVICES:
        sub.add_parser(name, add_help=False, help=f"run one {name} (pagedserve {name} --help for its flags)")

    generate = sub.add_parser("generate", help="generate text for one prompt through a gateway")
    generate.add_argument("prompt", help="the prompt text")
    _add_sampling_flags(generate, env)

    chat = sub.add_parser("chat", help="chat through a gateway (interactive when no message is given)")
    chat.add_argument("message", nargs="?", help="one user message; omit for an interactive session")
    chat.add_argument("--system", default=None, help="a system message")
    _add_sampling_flags(chat, env)
    health = sub.add_parser("health", help="check a service's grpc.health.v1 status (for container healthchecks)",
                            description="Exit 0 when the server at ADDRESS reports SERVING, 1 otherwise.")
    health.add_argument("address", help="host:port of any pagedserve service")
    health.add_argument("--service", default="", help="service name to check (default: the whole server)")
    health.add_argument("--timeout", type=float, default=3.0)
    _add_tls_flags(health, env)
    stats = sub.add_parser("stats", help="print a scheduler's stats (workers, KV block pools, failover counters)")
    stats.add_argument("address", nargs="?", default=f"127.0.0.1:{SCHEDULER_PORT}",
                       help="host:port of a scheduler's admin server (default: %(default)s, the scheduler "
                            "`pagedserve serve` starts)")
    stats.add_argument("--timeout", type=float, default=5.0)
    add_flag(stats, env, "internal-token", default="", secret=True, help="the services' shared internal token")
    _add_tls_flags(stats, env)
    return parser


def _run_stats(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from pagedserve.admin import scheduler_stats

    stats = scheduler_stats(args.address, timeout=args.timeout, token=args.internal_token, tls=_tls(args))
    print(json.dumps(dataclasses.asdict(stats), indent=2))
    return 0


def _run_health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from servicekit.tls import sync_channel

    with sync_channel(args.address, _tls(args)) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as exc:
            print(f"{args.address}: {exc.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _run_generate(args: argparse.Namespace) -> int:
    from pagedserve.client import Client

    with Client(args.address, timeout=args.timeout, api_key=args.api_key, tls=_tls(args)) as client:
        if args.stream:
            completion_end = None
            with client.stream(args.prompt, **_sampling_kwargs(args)) as stream:
                for chunk in stream:
                    print(chunk.text, end="", flush=True)
                    completion_end = chunk
            print()
            if completion_end is not None and completion_end.usage is not None:
                u = completion_end.usage
                print(f"[{completion_end.finish_reason}; {u.prompt_tokens} prompt + {u.completion_tokens} "
                      f"completion tokens]", file=sys.stderr)
        else:
            print(client.generate(args.prompt, **_sampling_kwargs(args)).text)
    return 0


def _chat_turn(client, messages: list[dict], args: argparse.Namespace) -> str:
    parts = []
    with client.stream(messages=messages, **_sampling_kwargs(args)) as stream:
        for chunk in stream:
            parts.append(chunk.text)
            if args.stream:
                print(chunk.text, end="", flush=True)
    reply = "".join(parts)
    print("" if args.stream else reply)
    return reply


def _run_chat(args: argparse.Namespace) -> int:
    from pagedserve.client import Client

    messages = [{"role": "system", "content": args.system}] if args.system else []
    with Client(args.address, timeout=args.timeout, api_key=args.api_key, tls=_tls(args)) as client:
        if args.message is not None:
            _chat_turn(client, messages + [{"role": "user", "content": args.message}], args)
            return 0
        print("chatting with the served model; an empty line or Ctrl-D ends", file=sys.stderr)
        while True:
            try:
                line = input("> ").strip()
            except (EOFError, KeyboardInterrupt):
                print()
                return 0
            if not line:
                return 0
            messages.append({"role": "user", "content": line})
            messages.append({"role": "assistant", "content": _chat_turn(client, messages, args)})


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SERVICES:  # each service owns its flags (and its --help)
        return _service_main(argv[0])(argv[1:])
    if argv and argv[0] == "serve":  # so does the launcher (it loads no model, but imports the services')
        from pagedserve.launcher import main as serve_main

        return serve_main(argv[1:])
    args = build_parser(os.environ).parse_args(argv)
    from pagedserve.errors import PagedServeError

    try:
        if args.command == "generate":
            return _run_generate(args)
        if args.command == "health":
            return _run_health(args)
        if args.command == "stats":
            return _run_stats(args)
        return _run_chat(args)
    except PagedServeError as exc:
        print(f"pagedserve: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
