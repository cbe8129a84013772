"""The ``pagedserve`` command line (``pagedserve.cli``)."""

from __future__ import annotations


def test_client_commands_default_to_the_stack_pagedserve_serve_starts():
    from pagedserve.cli import build_parser

    parser = build_parser({})
    assert parser.parse_args(["stats"]).address == "127.0.0.1:50052"  # the scheduler's admin port
    assert parser.parse_args(["stats", "sched:6000"]).address == "sched:6000"
    assert parser.parse_args(["generate", "hi"]).address == "127.0.0.1:50051"  # the gateway
