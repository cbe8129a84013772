"""OpenAI request bodies → the gateway's own request objects, checked field by field.

Every key of a body is either mapped onto :class:`~gateway_service.messages.GenerateInput` /
:class:`~servicekit.contract.sampling_params.SamplingParams` or refused with an
:class:`InvalidArgumentError` naming it: a parameter we would otherwise ignore (``tools``,
``suffix``) changes what the caller expects back, so it is a 400, never silently
dropped. ``null`` means "not given", as in OpenAI's API — for any key, also one we do not know
(clients that serialize every field of their model send ``"tools": null`` or ``"metadata": null``).
Range checks stay where they live
(``SamplingParams.__post_init__``, the gateway's prompt checks): this module only checks types and
shapes, and renames (``max_completion_tokens`` → ``max_tokens``, ``skip_special_tokens`` →
``include_special_tokens``).

Pure: no I/O, no Starlette, so the rules are tested without a server.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from gateway_service.messages import GenerateInput, checked_user
from servicekit.contract.chat import check_chat_message
from servicekit.contract.errors import InvalidArgumentError, PagedServeError
from servicekit.contract.sampling_params import MAX_LOGPROBS, SEED_RANGE, SamplingParams
from gateway_service.tool_calls import ToolChoice, constraint, parse_tools, render_turn, with_tools
from servicekit.contract.structured_output import StructuredOutput, schema_text, structured_output_of

INT32_MIN, INT32_MAX = -2**31, 2**31 - 1  # the integer fields of the records requests travel as (protos)
MAX_N = 16  # choices per request: each is one admitted request
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions; chat defaults to what the model has room for
MAX_TEMPLATE_KWARGS_BYTES = 64 << 10  # chat_template_kwargs as JSON (switches and short values, not documents)

# Keys accepted but without effect on generation, with the reason.
_INERT = {
    "stream": "read by the HTTP layer",
    "metadata": "OpenAI's tags for stored completions (nothing is stored)",
}
# Keys accepted only with the value that means "off", with that value.
_OFF_ONLY: dict[str, tuple[Any, ...]] = {
    "suffix": ("",), "functions": ([],), "function_call": ("none",),
    "best_of": (1,),
    "store": (False,), "service_tier": ("auto", "default"),
}

# vLLM's older structured-output keys → the key of its ``structured_outputs`` each stands for
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "min_tokens", "ignore_eos", "seed")
_COMMON_KEYS = {"model", "n", "stream", "stream_options", "stop", "stop_token_ids", "max_tokens", *_INERT, "logit_bias",
                "include_stop_str_in_output", "skip_special_tokens", "priority", "cache_salt", "request_id", "user",
                "truncate_prompt_tokens", "return_tokens_as_token_ids", "allowed_token_ids", "prompt_logprobs",
                "response_format", "structured_outputs", *_GUIDED, *_SAMPLING_KEYS, *_OFF_ONLY}
COMPLETION_KEYS = frozenset(_COMMON_KEYS | {"prompt", "logprobs", "echo", "add_special_tokens"})
CHAT_KEYS = frozenset(_COMMON_KEYS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "echo",
                                      "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                                      "tools", "tool_choice", "parallel_tool_calls"})
# chat_template_kwargs are variables of the template, never these: apply_chat_template's and its
# renderer's own arguments, the special tokens it passes (a caller would replace the model's BOS), the
# template helpers, and the tool lists (tools are refused)
_TEMPLATE_ARGS = frozenset({
    "conversation", "conversations", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
    "additional_special_tokens", "raise_exception", "strftime_now", "custom_tools", "builtin_tools"})


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """One completions or chat call: the inputs of its requests (one per prompt), and how to answer.

    Invariant: ``inputs`` is non-empty; choice ``i * n + j`` is sample ``j`` of ``inputs[i]``."""

    inputs: tuple[GenerateInput, ...]
    model: str
    n: int = 1
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: one last chunk with usage, no choices
    # stream_options.continuous_usage_stats (vLLM's, with include_usage): every chunk also carries its
    # choice's usage so far
    continuous_usage: bool = False
    echo: bool = False  # completions: the prompt's text before the completion
    logprobs: bool = False  # report logprobs (their count is in the sampling params)
    # vLLM's prompt_logprobs: report each prompt token's logprob and this many alternatives
    prompt_logprobs: int | None = None
    # completions' echo with max_tokens 0: the prompt alone (with its logprobs when asked), nothing
    # generated; the engine runs one token (max_tokens >= 1 there) that the answer leaves out
    echo_only: bool = False
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    fill_max_tokens: bool = False  # chat without max_tokens: the room the prompt leaves (see chat_max_tokens)
    max_tokens_field: str = "max_tokens"  # what the caller called it (chat: max_completion_tokens)

    structured_output_field: str = "structured_output"  # the key the output constraint came in
    tools: ToolChoice | None = None  # chat: the tools the model may call (None: plain chat)

    def as_sent(self, exc: PagedServeError) -> PagedServeError:
        """``exc`` naming the output length and the output constraint as the caller did (the gateway's
        checks say max_tokens and structured_output)."""
        return _renamed(exc, {"max_tokens": self.max_tokens_field, "structured_output": self.structured_output_field})

    @property
    def include_stop_str(self) -> bool:
        """include_stop_str_in_output: the inputs carry it (their text includes the stops)."""
        return self.inputs[0].include_stop_str

    def choice_inputs(self) -> list[GenerateInput]:
        """One input per choice. With a seed, sample ``j`` uses ``seed + j`` so the ``n`` samples
        differ yet the whole call reproduces; request ids get ``-j`` so they stay unique."""
        out = []
        for inp in self.inputs:
            for j in range(self.n):
                params = inp.sampling_params
                if params.seed is not None and j:
                    params = params.with_seed((params.seed + j) % SEED_RANGE)
                rid = f"{inp.request_id}-{j}" if inp.request_id and self.n > 1 else inp.request_id
                out.append(replace(inp, sampling_params=params, request_id=rid))
        return out


def _renamed(exc: PagedServeError, names: dict[str, str]) -> PagedServeError:
    """``exc`` naming its field (in the field and the message) as the caller sent it: ``names`` maps
    the gateway's names (SamplingParams') to the caller's."""
    name = names.get(getattr(exc, "field", ""))
    if not isinstance(exc, InvalidArgumentError) or name is None or name == exc.field:
        return exc
    return InvalidArgumentError(name, exc.message.replace(exc.field, name))


def _get(body: dict, key: str, kinds: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise InvalidArgumentError(key, f"must be {_kind_name(kinds)}, got {value!r}")
    if not isinstance(value, kinds):
        raise InvalidArgumentError(key, f"must be {_kind_name(kinds)}, got {type(value).__name__}")
    if kinds is int and key != "seed" and not INT32_MIN <= value <= INT32_MAX:  # seed: SamplingParams checks it
        raise InvalidArgumentError(key, f"out of range: {value}")
    return value


def _kind_name(kinds: type | tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "a list",
             dict: "an object"}
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    return " or ".join(dict.fromkeys(names.get(k, k.__name__) for k in kinds))


def check_keys(body: Any, allowed: frozenset[str]) -> dict:
    """``body`` as a dict whose keys are all ``allowed`` and whose off-only keys are off."""
    if not isinstance(body, dict):
        raise InvalidArgumentError("body", "must be a JSON object")
    for key, value in body.items():
        if key not in allowed and value is not None:
            raise InvalidArgumentError(key, "is not a supported parameter")
        off = _OFF_ONLY.get(key)
        # compared with their types: 0 is not False, True is not 1
        if off is not None and value is not None and not any(type(value) is type(v) and value == v for v in off):
            raise InvalidArgumentError(key, "is not supported" + (
                f" (only {' or '.join(map(repr, off))})" if off else ""))
    return body


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise InvalidArgumentError("stop", "must be a string or a list of strings")


def _ints(value: Any) -> bool:
    """Whether ``value`` is a list of integers (bools are not), token ids or not."""
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _token_ids(value: Any) -> bool:
    """Whether ``value`` is a list of token ids (non-negative integers that fit a record)."""
    return _ints(value) and all(0 <= t <= INT32_MAX for t in value)


def _int_list(body: dict, key: str) -> tuple[int, ...]:
    value = _get(body, key, list, [])
    if not _token_ids(value):
        raise InvalidArgumentError(key, "must be a list of token ids (integers >= 0)")
    return tuple(value)


def _logit_bias(body: dict) -> dict[int, Any]:
    """OpenAI's ``{"token id": bias}`` (JSON keys are strings) as ``{id: bias}``; ranges are checked
    by SamplingParams, ids against the vocabulary by the gateway."""
    value = _get(body, "logit_bias", dict, {})
    bad = [key for key in value if not (isinstance(key, str) and key.isdigit() and int(key) <= INT32_MAX)]
    if bad:
        shown = ", ".join(map(repr, bad[:10])) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
        raise InvalidArgumentError("logit_bias", f"keys must be token ids (integers >= 0 as strings), got {shown}")
    return {int(key): bias for key, bias in value.items()}


def _sampling(body: dict, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None, *,
              tool_constraint: StructuredOutput | None = None) -> SamplingParams:
    """``tool_constraint``: a required or named tool choice's, in place of the body's own."""
    number = (int, float)
    kwargs = {key: _get(body, key, number) for key in ("temperature", "top_p", "min_p", "repetition_penalty",
                                                        "presence_penalty", "frequency_penalty")}
    kwargs.update(top_k=_get(body, "top_k", int), min_tokens=_get(body, "min_tokens", int),
                  ignore_eos=_get(body, "ignore_eos", bool), seed=_seed(body))
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if kwargs.get("top_k") == 0:  # vLLM and HF treat 0 as "off", like -1
        kwargs["top_k"] = -1
    allowed = _int_list(body, "allowed_token_ids")
    if body.get("allowed_token_ids") is not None and not allowed:  # vLLM refuses an empty list too
        raise InvalidArgumentError("allowed_token_ids", "must not be empty (leave it out to allow every token)")
    constraint, field = (tool_constraint, "tools") if tool_constraint is not None else structured_output(body)
    try:
        return SamplingParams(max_tokens=max_tokens, stop=_stop(body), stop_token_ids=_int_list(body, "stop_token_ids"),
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs, logit_bias=_logit_bias(body),
                              allowed_token_ids=allowed, structured_output=constraint, **kwargs)
    except InvalidArgumentError as e:
        raise _renamed(e, {"structured_output": field}) from None


def _constraint_key(body: dict) -> str | None:
    """Which key of the body holds its output constraint: OpenAI's ``response_format``, vLLM's
    ``structured_outputs`` or one of its ``guided_*`` keys (at most one of them), or None."""
    given = [k for k in ("response_format", "structured_outputs", *_GUIDED) if body.get(k) is not None]
    if len(given) > 1:
        raise InvalidArgumentError(given[1], f"give one output constraint, not both {given[0]} and {given[1]}")
    return given[0] if given else None


def structured_output(body: dict) -> tuple[StructuredOutput | None, str]:
    """The body's output constraint and the key it came in (see :func:`_constraint_key`)."""
    key = _constraint_key(body)
    if key is None:
        return None, "structured_output"
    if key == "response_format":
        return _response_format(_get(body, key, dict))
    if key == "structured_outputs":
        return structured_output_of(_get(body, key, dict), key), key
    inner = _GUIDED[key]
    try:
        return structured_output_of({inner: body[key]}, key), key
    except InvalidArgumentError as e:  # named as sent: guided_choice, not guided_choice.choice
        raise InvalidArgumentError(key, e.message) if e.field == f"{key}.{inner}" else e from None


def _response_format(value: dict) -> tuple[StructuredOutput | None, str]:
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema`` (with its ``schema``)."""
    kind = value.get("type")
    if kind == "text":
        return None, "response_format"
    if kind == "json_object":
        return StructuredOutput("json_object"), "response_format"
    if kind != "json_schema":
        raise InvalidArgumentError("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidArgumentError("response_format.json_schema", "required: an object with name and schema")
    if not isinstance(spec.get("name", ""), str):
        raise InvalidArgumentError("response_format.json_schema.name", "must be a string")
    if spec.get("strict") is not None and not isinstance(spec.get("strict"), bool):
        raise InvalidArgumentError("response_format.json_schema.strict", "must be a boolean")
    field = "response_format.json_schema.schema"
    schema = spec.get("schema")
    if schema is None:
        raise InvalidArgumentError(field, "required: the JSON Schema the output must follow")
    return StructuredOutput("json_schema", schema_text(schema, field)), field


def _seed(body: dict) -> int | None:
    """OpenAI's and vLLM's seed is any 64-bit integer; a negative one maps into the sampler's
    [0, 2**63) (``seed mod 2**63``: still one fixed seed per value)."""
    seed = _get(body, "seed", int)
    if seed is not None and -SEED_RANGE <= seed < 0:
        seed %= SEED_RANGE
    return seed


def _common(body: dict) -> dict[str, Any]:
    """The GenerateInput fields every endpoint shares (prompt and sampling params aside)."""
    return dict(model=_get(body, "model", str, ""), request_id=_get(body, "request_id", str, ""),
                priority=_get(body, "priority", int, 0), cache_salt=_get(body, "cache_salt", str, ""),
                include_special_tokens=not _get(body, "skip_special_tokens", bool, True),
                include_stop_str=_get(body, "include_stop_str_in_output", bool, False),
                truncate_prompt_tokens=_get(body, "truncate_prompt_tokens", int), user=_user(body))


def _user(body: dict) -> str:
    """OpenAI's end-user id: the tenant of the request's fair share when the gateway has no API
    keys (with keys, the key is the tenant)."""
    return checked_user(_get(body, "user", str, ""))


def _request(body: dict, inputs: list[GenerateInput], *, logprobs: bool, echo: bool = False,
             prompt_logprobs: int | None = None) -> OpenAIRequest:
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise InvalidArgumentError("n", f"must be in [1, {MAX_N}], got {n}")
    stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict, {})
    if options and not stream:  # even {"include_usage": null}, as vLLM's tests want
        raise InvalidArgumentError("stream_options", "only allowed with stream: true")
    for key in options:
        if key not in ("include_usage", "continuous_usage_stats"):
            raise InvalidArgumentError(f"stream_options.{key}", "is not a supported option")
    include_usage, continuous = (_stream_option(options, key) for key in ("include_usage", "continuous_usage_stats"))
    return OpenAIRequest(tuple(inputs), model=_get(body, "model", str, ""), n=n, stream=stream,
                         include_usage=include_usage, continuous_usage=include_usage and continuous,
                         echo=echo, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                         tokens_as_ids=_get(body, "return_tokens_as_token_ids", bool, False),
                         structured_output_field=_constraint_field(body))


def _constraint_field(body: dict) -> str:
    """The name errors about the body's output constraint go by (the schema's, for response_format's)."""
    key = _constraint_key(body)
    if key is None:
        return "structured_output"
    value = body[key]
    json_schema = isinstance(value, dict) and value.get("type") == "json_schema"
    return "response_format.json_schema.schema" if key == "response_format" and json_schema else key


def _stream_option(options: dict, key: str) -> bool:
    value = options.get(key)
    if value is not None and not isinstance(value, bool):
        raise InvalidArgumentError(f"stream_options.{key}", "must be a boolean")
    return bool(value)


def parse_completion(body: Any) -> OpenAIRequest:
    """A ``POST /v1/completions`` body. ``prompt``: a string, a list of strings, a list of token ids
    or a list of such lists (one request per prompt)."""
    body = check_keys(body, COMPLETION_KEYS)
    prompt = body.get("prompt")
    if prompt is None:
        raise InvalidArgumentError("prompt", "required")
    prompts: list[str | list[int]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and _token_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _token_ids(p) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and (_ints(prompt) or all(p and _ints(p) for p in prompt)):
        raise InvalidArgumentError("prompt", f"token ids must be integers in [0, {INT32_MAX}]")
    else:
        raise InvalidArgumentError("prompt", "must be a string, a list of strings, a list of token ids or a "
                                             "list of lists of token ids (non-empty)")
    logprobs = _get(body, "logprobs", int)
    echo = _get(body, "echo", bool, False)
    if echo and body.get("truncate_prompt_tokens") is not None:
        raise InvalidArgumentError("truncate_prompt_tokens", "cannot be combined with echo (the echoed prompt "
                                                             "would not be the one generated from)")
    prompt_logprobs = _prompt_logprobs(body)
    # echo with logprobs: the echoed prompt's tokens carry logprobs too (lm-eval's loglikelihood)
    scored = logprobs if echo and logprobs is not None else None
    if prompt_logprobs is not None:
        scored = max(prompt_logprobs, scored or 0)
    max_tokens = _get(body, "max_tokens", int, DEFAULT_MAX_TOKENS)
    echo_only = echo and max_tokens == 0  # the prompt scored, nothing generated (OpenAI's legacy use)
    if max_tokens == 0 and not echo:
        raise InvalidArgumentError("max_tokens", "must be >= 1, got 0 (0 only with echo: the prompt alone)")
    if echo_only and body.get("min_tokens"):
        raise InvalidArgumentError("min_tokens", "must be 0 with max_tokens 0")
    params = _sampling(body, 1 if echo_only else max_tokens, logprobs, scored)
    common = _common(body)
    if len(prompts) > 1 and common["request_id"]:
        common["request_id"] = ""  # several prompts: ids are assigned (one id cannot name them all)
    common["add_special_tokens"] = _get(body, "add_special_tokens", bool, True)
    inputs = [GenerateInput(params, prompt=p, **common) if isinstance(p, str)
              else GenerateInput(params, prompt_token_ids=list(p), **common) for p in prompts]
    return replace(_request(body, inputs, logprobs=logprobs is not None, echo=echo, prompt_logprobs=prompt_logprobs),
                   echo_only=echo_only)


def _prompt_logprobs(body: dict) -> int | None:
    """vLLM's ``prompt_logprobs``: alternatives per prompt token (0..20; vLLM's -1, the whole
    vocabulary, is refused with the bound)."""
    value = _get(body, "prompt_logprobs", int)
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise InvalidArgumentError("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {value}")
    return value


def _content(index: int, role: Any, content: Any) -> Any:
    """A message's content: a string, or a list of text parts (joined by newlines, as vLLM does), as
    OpenAI's clients send; an assistant turn's ``null`` content (one that only called tools) is ""."""
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidArgumentError(f"messages[{index}].content[{k}]", "only text parts are supported")
            texts.append(part["text"])
        return "\n".join(texts)
    if content is None and role == "assistant":
        return ""
    return content


def parse_messages(messages: Any) -> list[dict[str, str]]:
    """``messages`` as the gateway's chat turns (role and text content only)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidArgumentError("messages", "required: a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidArgumentError(f"messages[{i}]", "must be an object")
        role = message.get("role")
        if role not in _ROLES:
            raise InvalidArgumentError(f"messages[{i}].role", f"must be one of {', '.join(_ROLES)}; got {role!r}")
        allowed = ("role", "content", "name", *_TOOL_KEYS.get(role, ()))
        for key, value in message.items():
            if key not in allowed and value is not None:  # "tool_calls": null, "refusal": null
                raise InvalidArgumentError(f"messages[{i}].{key}", "is not supported")
        content = _content(i, role, message.get("content"))
        if role in _TOOL_KEYS and not isinstance(content, str):
            raise InvalidArgumentError(f"messages[{i}].content", "required: a string" if role == "tool"
                                       else "must be a string or null")
        # OpenAI's "developer" turn is its newer name for the system turn; chat templates know "system".
        # A tool turn (a result) and an assistant turn's calls: as the model reads them (tool_calls).
        turn = render_turn(i, "system" if role == "developer" else role, content, message.get("tool_calls"))
        check_chat_message(i, turn["role"], turn["content"])
        out.append(turn)
    return out


# the roles a turn may have: developer is OpenAI's newer name for system, and a tool turn is a
# tool's result (both rendered as the turns chat templates know: gateway_service.tool_calls)
_ROLES = ("system", "developer", "user", "assistant", "tool")
# the keys a turn of these roles may have besides role, content and name
_TOOL_KEYS = {"assistant": ("tool_calls",), "tool": ("tool_call_id",)}


def parse_chat(body: Any) -> OpenAIRequest:
    """A ``POST /v1/chat/completions`` body. Without ``max_tokens`` / ``max_completion_tokens`` a
    chat reply may fill what the model has room for, as in vLLM (``fill_max_tokens``: the caller
    sets it with :func:`chat_max_tokens` once the prompt is tokenized)."""
    body = check_keys(body, CHAT_KEYS)
    if _get(body, "echo", bool, False):  # vLLM's chat echo repeats the last turn; only its off value here
        raise InvalidArgumentError("echo", "is not supported on chat (only false)")
    messages = parse_messages(body.get("messages"))
    tools = parse_tools(body)
    tool_constraint = None
    if tools is not None:
        messages = with_tools(messages, tools)
        tool_constraint = constraint(tools)  # required or named: the calls' JSON, by construction
        if tool_constraint is not None and _constraint_key(body) is not None:
            raise InvalidArgumentError("tool_choice", "a required or named tool choice constrains the output: "
                                                      "it cannot be combined with response_format")
    logprobs = _get(body, "logprobs", bool, False)
    top = _get(body, "top_logprobs", int)
    if top and not logprobs:  # vLLM, too, refuses only a positive count
        raise InvalidArgumentError("top_logprobs", "requires logprobs: true")
    max_tokens = _get(body, "max_completion_tokens", int)
    # errors name the field the caller sent (the sampling params know them as max_tokens, logprobs)
    names = {"max_tokens": "max_completion_tokens" if max_tokens is not None else "max_tokens",
             "logprobs": "top_logprobs"}
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int)
    placeholder = max(1, _get(body, "min_tokens", int, 0))  # replaced by chat_max_tokens
    prompt_logprobs = _prompt_logprobs(body)
    try:
        params = _sampling(body, max_tokens if max_tokens is not None else placeholder,
                           (top or 0) if logprobs else None, prompt_logprobs, tool_constraint=tool_constraint)
    except InvalidArgumentError as exc:
        raise _renamed(exc, names) from None
    inp = GenerateInput(params, messages=messages, **_common(body), **_template_options(body),
                        chat_template_kwargs=_template_kwargs(body), tools=tools)
    return replace(_request(body, [inp], logprobs=logprobs, prompt_logprobs=prompt_logprobs),
                   fill_max_tokens=max_tokens is None,
                   max_tokens_field=names["max_tokens"], tools=tools,
                   **({"structured_output_field": "tools"} if tools is not None and tools.constrained else {}))


def _template_options(body: dict) -> dict[str, bool]:
    """vLLM's chat-template switches: ``add_generation_prompt`` (default true) and
    ``continue_final_message`` (default false: true continues the last, assistant, turn)."""
    return dict(add_generation_prompt=_get(body, "add_generation_prompt", bool, True),
                continue_final_message=_get(body, "continue_final_message", bool, False))


def _template_kwargs(body: dict) -> dict[str, Any] | None:
    """vLLM's ``chat_template_kwargs``: extra variables for the chat template (``{"enable_thinking":
    false}`` for Qwen3's); none may be one of ``apply_chat_template``'s own arguments."""
    kwargs = _get(body, "chat_template_kwargs", dict)
    if not kwargs:
        return None
    size = len(json.dumps(kwargs))
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise InvalidArgumentError("chat_template_kwargs", f"{size} bytes as JSON; at most {MAX_TEMPLATE_KWARGS_BYTES}")
    for key in kwargs:
        if key in _TEMPLATE_ARGS:
            raise InvalidArgumentError(f"chat_template_kwargs.{key}", "is not a template variable (set it elsewhere)")
    return kwargs


def chat_max_tokens(inp: GenerateInput, prompt_token_ids: list[int], max_model_len: int) -> GenerateInput:
    """A chat request given no max_tokens, as tokens, with what the model has room for after its
    prompt (at least 1: a prompt that fills the model is refused by the gateway's own check)."""
    room = max(1, max_model_len - len(prompt_token_ids))
    params = replace(inp.sampling_params, max_tokens=room)  # min_tokens over it: refused, naming min_tokens
    return replace(inp, messages=None, prompt_token_ids=prompt_token_ids, sampling_params=params)


def parse_tokenize(body: Any) -> tuple[str, str | None, list[dict[str, str]] | None, dict[str, Any]]:
    """``POST /tokenize``: ``{"prompt": str}`` or ``{"messages": [...]}`` (vLLM's shape), plus
    ``model``, ``add_special_tokens`` (prompt; default true), ``add_generation_prompt``,
    ``continue_final_message`` and ``chat_template_kwargs`` (messages; as in chat). Returns (model,
    prompt, messages, the
    options as keyword arguments of ``GenerationService.tokenize``)."""
    body = check_keys(body, frozenset({"model", "prompt", "messages", "add_special_tokens",
                                       "add_generation_prompt", "continue_final_message", "chat_template_kwargs"}))
    model = _get(body, "model", str, "")
    options = dict(add_special_tokens=_get(body, "add_special_tokens", bool, True), **_template_options(body),
                   chat_template_kwargs=_template_kwargs(body))
    if (body.get("prompt") is None) == (body.get("messages") is None):
        raise InvalidArgumentError("prompt", "exactly one of prompt and messages is required")
    if body.get("messages") is not None:
        return model, None, parse_messages(body["messages"]), options
    return model, _get(body, "prompt", str), None, options


def parse_detokenize(body: Any) -> tuple[str, list[int]]:
    """``POST /detokenize``: ``{"tokens": [ids]}`` (vLLM's shape)."""
    body = check_keys(body, frozenset({"model", "tokens"}))
    if body.get("tokens") is None:
        raise InvalidArgumentError("tokens", "required: a list of token ids")
    return _get(body, "model", str, ""), list(_int_list(body, "tokens"))
