"""``pagedserve.LLM``: the offline engine — scheduler core + model runner in one process.

No gRPC, no Redis: each step is ``Scheduler.schedule()`` → ``ModelRunner.execute_model()`` →
``Scheduler.update_from_output()``, the same contract the services speak over the wire.

    llm = LLM("smollm2-135m")
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=32, temperature=0))
    print(outs[0].text)
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from gateway_service.text import OutputText, PromptTokenizer, load_tokenizer
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from servicekit import sampling_defaults
from servicekit.contract.errors import InvalidArgumentError
from servicekit.contract.prompt import check_allowed_token_ids, check_prompt, check_text, token_id_list
from servicekit.grammar import check_sampling
from servicekit.contract.sampling_params import SamplingParams
from servicekit.contract.scheduling import SchedulingConfig
from servicekit.contract.step import FinishReason, TokenLogprobs

Prompt = Union[str, Sequence[int]]
Message = dict[str, Any]

_TQDM_MIN_PROMPTS = 64  # use_tqdm=None shows a progress bar from this many prompts on


@dataclass(slots=True)
class RequestMetrics:
    """When a request's milestones happened, in ``time.monotonic()`` seconds (vLLM's
    ``RequestOutput.metrics``): time to first token is ``first_token_time - arrival_time``, time per
    output token after it ``(last_token_time - first_token_time) / (len(token_ids) - 1)``."""

    arrival_time: float  # added to the scheduler
    first_token_time: float | None = None  # the step that produced its first output token ended
    last_token_time: float | None = None  # ... its last output token
    finished_time: float | None = None  # it finished (or was aborted)


@dataclass(slots=True)
class RequestOutput:
    """The result of one prompt."""

    request_id: str
    prompt: str | None  # the prompt text when one was given
    prompt_token_ids: list[int]
    text: str  # the output decoded (special tokens skipped)
    token_ids: list[int]  # output token ids
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    logprobs: list[TokenLogprobs] | None = None  # one per output token when SamplingParams.logprobs is set
    stop_string: str = ""  # the stop string that ended the output, if one did (never in ``text``)
    # the stop_token_ids entry that ended the output, if one did (vLLM's integer stop_reason); the token
    # that ends an output as a stop token (this or EOS) is the last of token_ids, its text not in ``text``
    stop_token_id: int | None = None
    metrics: RequestMetrics | None = None  # timings (None only for outputs built elsewhere)
    # SamplingParams.prompt_logprobs: one per prompt token after the first (vLLM's prompt_logprobs
    # also holds None for the first token)
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class _Pending:
    prompt: str | None
    prompt_token_ids: list[int]
    text: OutputText | None  # None without a tokenizer
    token_ids: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    stop_string: str = ""
    stop_token_id: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    prompt_logprobs: list[TokenLogprobs] | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))

    def add(self, token_ids: list[int], logprobs: list[TokenLogprobs] | None, *, stopped: bool = False) -> bool:
        """Take one step's tokens; True when a stop string ended the output (the tokens after the one
        that completed it are dropped, as the gateway drops them). ``stopped``: the scheduler finished
        the output as "stop", so its last token is a stop token (EOS or a stop id), which adds no text."""
        for i, token in enumerate(token_ids):
            self.token_ids.append(token)
            if self.logprobs is not None and logprobs:
                self.logprobs.append(logprobs[i])
            ends_output = stopped and i == len(token_ids) - 1
            if ends_output:
                self.stop_token_id = token if token in self.stop_token_ids else None
            if self.text is not None:
                piece, stop = self.text.add(token, ends_output=ends_output)
                self.pieces.append(piece)
                if stop is not None:
                    self.stop_string = stop
                    return True
        return False

    def finish(self, reason: str) -> None:
        self.finish_reason = reason
        if self.text is not None and not self.stop_string:
            piece, stop = self.text.finish()
            self.pieces.append(piece)
            if stop is not None:
                self.stop_string, self.finish_reason = stop, "stop"


def engine_configs(model: str, settings: dict[str, Any]):
    """``(ModelRunnerConfig, SchedulingConfig)`` from ``LLM``'s keywords, each to the dataclass that
    declares it (the batch limits to both); a keyword neither declares is a TypeError, as for any
    function."""
    from worker_service.config import ModelRunnerConfig

    runner_fields = {f.name for f in dataclasses.fields(ModelRunnerConfig)}
    scheduling_fields = {f.name for f in dataclasses.fields(SchedulingConfig)}
    unknown = sorted(set(settings) - runner_fields - scheduling_fields)
    if unknown:
        raise TypeError(f"LLM() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}")
    scheduling = SchedulingConfig(**{k: v for k, v in settings.items() if k in scheduling_fields})
    runner = ModelRunnerConfig(model=model, **{k: v for k, v in settings.items() if k in runner_fields})
    return runner, scheduling


class LLM:
    """Generate text for a batch of prompts with continuous batching over a paged KV cache.

    ``LLM(model, **engine_settings)``: every keyword that names a field of the model runner's
    settings (``worker_service.config.ModelRunnerConfig``: ``dtype``, ``device``, ``block_size``,
    ``max_model_len``, ``kv_cache_memory`` ...) or of the scheduling settings
    (``servicekit.contract.scheduling.SchedulingConfig``: ``max_num_seqs``,
    ``max_num_batched_tokens``, ``enable_prefix_caching``, ``policy`` ...) goes to it: the same
    dataclasses, defaults and checks as ``pagedserve serve``'s flags of the same names
    (docs/configuration.md). Besides those: ``tokenizer`` (another name to load the tokenizer from),
    ``seed`` (draws the seeds of requests that come without one), ``skip_tokenizer_init`` (token-id
    prompts only; ``text`` stays empty) and ``hf_model`` (an already loaded transformers model of
    ``model``: its weights are reused instead of loaded again).
    """

    def __init__(self, model: str, *, tokenizer: str | None = None, seed: int = 0, hf_model: Any | None = None,
                 skip_tokenizer_init: bool = False, **engine_settings: Any) -> None:
        from worker_service.model_runner import ModelRunner

        runner_config, scheduling = engine_configs(model, engine_settings)  # validated before the model loads
        self.runner = ModelRunner(runner_config, hf_model=hf_model)
        self.scheduler = Scheduler(scheduling, self.runner.info, seed_rng=random.Random(seed))
        # the settings as the scheduler applies them: within the runner's limits, its attention cap
        self.scheduler_config = self.scheduler.config
        # without a tokenizer, prompts must be token ids and outputs carry no text
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(tokenizer or model)
        self._prompts = None if self.tokenizer is None else PromptTokenizer(self.tokenizer)
        self._ids = itertools.count()
        self._sampling_defaults, _ = sampling_defaults.for_model(sampling_defaults.AUTO, model)

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use when given no ``sampling_params``: the model's own
        sampling defaults (its generation_config.json or GGUF metadata, else pagedserve's for its
        short names), as a gateway's ``--sampling-defaults auto`` gives them; vLLM's method."""
        return SamplingParams(**sampling_defaults.unset_filled({}, self._sampling_defaults))

    @property
    def info(self):  # WorkerDescription of the model runner
        return self.runner.info

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """One :class:`RequestOutput` per prompt, in prompt order.

        ``prompts``: a string, a list of token ids, or a list of either. ``sampling_params``: one for
        all prompts or one per prompt (default :meth:`get_default_sampling_params`). Invalid input raises
        ``InvalidArgumentError`` naming the field before any request runs.
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]  # one prompt
        token_lists = [self._tokenize(p) for p in prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        return self._run(texts, token_lists, sampling_params, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of ``{"role", "content"}``)
        or to a list of conversations, and generate one output for each. ``continue_final_message``
        (with ``add_generation_prompt=False``): continue the last, assistant, turn as written."""
        prompts = self._require_tokenizer()
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        texts: list[str | None] = []
        token_lists: list[list[int]] = []
        for conversation in conversations:
            options = dict(add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, chat_template=chat_template)
            texts.append(prompts.chat_text(list(conversation), **options))
            token_lists.append(prompts.encode_chat(list(conversation), **options))
        return self._run(texts, token_lists, sampling_params, use_tqdm)

    # -- engine loop ----------------------------------------------------------------------------------

    def _require_tokenizer(self) -> PromptTokenizer:
        if self._prompts is None:
            raise InvalidArgumentError("prompt", "text prompts need a tokenizer (LLM was built with "
                                                 "skip_tokenizer_init=True)")
        return self._prompts

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            check_text("prompt", prompt)
            return self._require_tokenizer().encode_text(prompt)
        return token_id_list(prompt)

    def _run(self, texts: list[str | None], token_lists: list[list[int]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             use_tqdm: bool | None) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(token_lists)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(token_lists):
                raise ValueError(f"sampling_params: {len(params_list)} given for {len(token_lists)} prompts")
        info = self.runner.info
        for ids, params in zip(token_lists, params_list):  # every prompt is checked before any runs
            check_prompt(ids, params.max_tokens, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
                         logit_bias=params.logit_bias, allowed_token_ids=params.allowed_token_ids,
                         stop_token_ids=params.stop_token_ids)
            check_allowed_token_ids(params, info.eos_token_ids)
            check_sampling(params.structured_output)
        pending: dict[str, _Pending] = {}
        order: list[str] = []
        try:
            for text, ids, params in zip(texts, token_lists, params_list):
                rid = str(next(self._ids))
                self.scheduler.add_request(Request(rid, ids, params, arrival_time=float(len(order))))
                if params.stop and self.tokenizer is None:
                    raise InvalidArgumentError("stop", "stop strings need a tokenizer (skip_tokenizer_init=True)")
                output_text = None if self.tokenizer is None else OutputText(self.tokenizer, ids, params.stop)
                pending[rid] = _Pending(text, ids, output_text, logprobs=[] if params.logprobs is not None else None,
                                        stop_token_ids=frozenset(params.stop_token_ids))
                order.append(rid)
            self._loop(pending, use_tqdm if use_tqdm is not None else len(order) >= _TQDM_MIN_PROMPTS)
        finally:
            unfinished = [rid for rid in order if pending[rid].finish_reason is None]
            if unfinished:
                self.scheduler.abort(unfinished)
        return [self._output(rid, pending[rid]) for rid in order]

    def _loop(self, pending: dict[str, _Pending], use_tqdm: bool) -> None:
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(pending), desc="generate", unit="req")
        remaining = len(pending)
        try:
            while remaining:
                scheduler_output = self.scheduler.schedule()
                if scheduler_output.is_empty and not self.scheduler.has_unfinished_requests():
                    break
                runner_output = self.runner.execute_model(scheduler_output)
                now = time.monotonic()
                stopped: list[str] = []
                for out in self.scheduler.update_from_output(scheduler_output, runner_output):
                    state = pending.get(out.request_id)
                    if state is None or state.finish_reason is not None:
                        continue
                    state.num_cached_tokens = out.num_cached_tokens
                    if out.prompt_logprobs is not None:
                        state.prompt_logprobs = out.prompt_logprobs
                    if out.new_token_ids:
                        if state.metrics.first_token_time is None:
                            state.metrics.first_token_time = now
                        state.metrics.last_token_time = now
                    on_stop_token = out.finished and out.finish_reason is FinishReason.STOP
                    if state.add(out.new_token_ids, out.new_logprobs, stopped=on_stop_token):
                        state.finish("stop")
                        if not out.finished:
                            stopped.append(out.request_id)  # the scheduler does not know stop strings
                    elif out.finished:
                        state.finish(str(out.finish_reason))
                    if state.finish_reason is not None:
                        state.metrics.finished_time = now
                        remaining -= 1
                        if bar is not None:
                            bar.update(1)
                if stopped:
                    self.scheduler.abort(stopped)
                if scheduler_output.is_empty and remaining:
                    raise RuntimeError("the scheduler made no progress with requests outstanding")
        finally:
            if bar is not None:
                bar.close()

    def _output(self, rid: str, state: _Pending) -> RequestOutput:
        return RequestOutput(
            request_id=rid,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            text="".join(state.pieces),
            token_ids=state.token_ids,
            finish_reason=state.finish_reason,
            num_cached_tokens=state.num_cached_tokens,
            logprobs=state.logprobs,
            stop_string=state.stop_string,
            stop_token_id=state.stop_token_id,
            metrics=state.metrics,
            prompt_logprobs=state.prompt_logprobs,
        )
