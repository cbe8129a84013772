"""The ``pagedserve`` command line (``pagedserve.cli``)."""

from __future__ import annotations

import asyncio

import pytest

from helpers.stack import in_process_stack


def test_client_commands_default_to_the_stack_pagedserve_serve_starts():
    from pagedserve.cli import build_parser

    parser = build_parser({})
    assert parser.parse_args(["stats"]).address == "127.0.0.1:50052"  # the scheduler's admin port
    assert parser.parse_args(["stats", "sched:6000"]).address == "sched:6000"
    assert parser.parse_args(["generate", "hi"]).address == "127.0.0.1:50051"  # the gateway


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.service
@pytest.mark.asyncio(loop_scope="session")
async def test_the_readme_s_first_chat_answers_the_question(smollm2, redis_server, capsys):
    """README's first call, ``pagedserve chat "What is the capital of France?"``, on the default
    model with no sampling flag: the gateway's defaults for it (greedy) answer "Paris"; sampled
    at temperature 1 it answered in French nonsense in about half of the seeds."""
    from pagedserve.cli import main

    async with in_process_stack("smollm2-135m", smollm2.hf, smollm2.tokenizer, redis_server.url,
                                key_prefix="cli-smol:") as served:
        code = await asyncio.to_thread(main, ["chat", "--address", served.gateway_address,
                                              "What is the capital of France?"])
    out = capsys.readouterr().out
    assert code == 0 and "Paris" in out, out
