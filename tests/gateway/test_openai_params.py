"""OpenAI request bodies → GenerateInput (no server), and the SSE stream's shape when a choice
fails after the stream began."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway_service.http_api import sse_events
from gateway_service.messages import GenerateChunk
from gateway_service.openai_params import chat_max_tokens, parse_chat, parse_completion
from gateway_service.openai_responses import ChoiceState, Responder, TokenText
from servicekit.contract.api import Usage
from servicekit.contract.errors import InvalidArgumentError, UnavailableError
from servicekit.contract.prompt import truncate_prompt
from servicekit.contract.step import FinishReason, TokenLogprobs


def test_openai_and_vllm_parameters_map_onto_sampling_params():
    req = parse_completion({
        "model": "m", "prompt": "Hi", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": "x",
        "presence_penalty": 0.1, "frequency_penalty": 0.2, "logprobs": 2, "user": "u", "top_k": 5, "min_p": 0.1,
        "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True, "stop_token_ids": [7],
        "skip_special_tokens": False, "priority": 4, "cache_salt": "s", "request_id": "r1", "logit_bias": {},
        "include_stop_str_in_output": True, "n": 1, "best_of": 1})
    (inp,) = req.inputs
    p = inp.sampling_params
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.stop, p.logprobs) == (7, 0.5, 0.9, 3, ("x",), 2)
    assert (p.presence_penalty, p.frequency_penalty, p.top_k, p.min_p) == (0.1, 0.2, 5, 0.1)
    assert (p.repetition_penalty, p.min_tokens, p.ignore_eos, p.stop_token_ids) == (1.1, 2, True, (7,))
    assert (inp.prompt, inp.model, inp.priority, inp.cache_salt, inp.request_id) == ("Hi", "m", 4, "s", "r1")
    assert inp.include_special_tokens and req.include_stop_str and req.logprobs and p.logit_bias == ()
    biased = parse_completion({"prompt": "a", "logit_bias": {"7": -100, "3": 2.5}}).inputs[0].sampling_params
    assert biased.logit_bias == ((3, 2.5), (7, -100.0))


def test_n_samples_get_successive_seeds_and_ids_and_prompts_fan_out():
    req = parse_completion({"prompt": ["a", [1, 2]], "n": 2, "seed": 10})
    inputs = req.choice_inputs()
    assert [i.sampling_params.seed for i in inputs] == [10, 11, 10, 11]
    assert [i.prompt for i in inputs] == ["a", "a", None, None]
    assert inputs[2].prompt_token_ids == [1, 2]
    named = parse_completion({"prompt": "a", "n": 2, "request_id": "r"}).choice_inputs()
    assert [i.request_id for i in named] == ["r-0", "r-1"]


@pytest.mark.parametrize(("body", "field"), [
    ({"prompt": "a", "bogus": 1}, "bogus"),
    ({"prompt": "a", "logit_bias": {"x": 2}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"-1": 2}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"1": 101}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": [1, 2]}, "logit_bias"),
    ({"prompt": "a", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "a", "max_tokens": True}, "max_tokens"),
    ({"prompt": "a", "top_k": 2**40}, "top_k"),
    ({"prompt": "a", "priority": 2**31}, "priority"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": [[1], "a", 3]}, "prompt"),
    ({"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "a", "prompt_logprobs": -1}, "prompt_logprobs"),  # vLLM's "the whole vocabulary"
    ({"prompt": "a", "prompt_logprobs": True}, "prompt_logprobs"),
    ({"prompt": "a", "store": True}, "store"),
    ({"prompt": "a", "seed": -2**63 - 1}, "seed"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "a", "stream": True, "stream_options": {"x": 1}}, "stream_options.x"),
    ({"prompt": "a", "n": 17}, "n"),
    ({"prompt": "a", "stop": [1]}, "stop"),
    ({}, "prompt"),
    ([], "body"),
])
def test_bad_completion_bodies_name_their_field(body, field):
    with pytest.raises(InvalidArgumentError) as caught:
        parse_completion(body)
    assert caught.value.field == field


def test_prompt_logprobs_are_asked_by_echo_with_logprobs_or_by_vllms_field():
    def scored(body: dict) -> int | None:
        return parse_completion({"prompt": "a", **body}).inputs[0].sampling_params.prompt_logprobs
    assert scored({"echo": True, "logprobs": 2}) == 2  # lm-eval's loglikelihood
    assert scored({"logprobs": 2}) is None and scored({"echo": True}) is None
    assert scored({"prompt_logprobs": 0}) == 0 and scored({"echo": True, "logprobs": 1, "prompt_logprobs": 3}) == 3
    req = parse_chat({"messages": [{"role": "user", "content": "a"}], "prompt_logprobs": 4})
    assert req.prompt_logprobs == 4 and req.inputs[0].sampling_params.prompt_logprobs == 4


def test_token_ids_out_of_range_are_named_as_such():
    for prompt in ([-1], [[1], [-5]], [2**40]):
        with pytest.raises(InvalidArgumentError, match="token ids must be integers in") as caught:
            parse_completion({"prompt": prompt})
        assert caught.value.field == "prompt"


def test_chat_without_max_tokens_gets_the_room_its_prompt_leaves():
    req = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "min_tokens": 3})
    assert req.fill_max_tokens and req.inputs[0].messages == [{"role": "user", "content": "Hi"}]
    filled = chat_max_tokens(req.inputs[0], [1, 2, 3, 4], max_model_len=10)
    assert filled.prompt_token_ids == [1, 2, 3, 4] and filled.messages is None
    assert filled.sampling_params.max_tokens == 6 and filled.sampling_params.min_tokens == 3
    given = parse_chat({"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 4, "max_tokens": 9})
    assert not given.fill_max_tokens and given.inputs[0].sampling_params.max_tokens == 4


def test_continuous_usage_stats_need_include_usage_as_in_vllm():
    def parsed(options: dict):
        return parse_completion({"prompt": "a", "stream": True, "stream_options": options})
    assert parsed({"include_usage": True, "continuous_usage_stats": True}).continuous_usage
    assert not parsed({"continuous_usage_stats": True}).continuous_usage  # vLLM: usage only with include_usage
    assert not parsed({"include_usage": True}).continuous_usage
    with pytest.raises(InvalidArgumentError) as caught:
        parsed({"include_usage": True, "continuous_usage_stats": "yes"})
    assert caught.value.field == "stream_options.continuous_usage_stats"


def test_chat_template_switches_reach_the_input():
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    (inp,) = parse_chat({"messages": messages, "add_generation_prompt": False,
                         "continue_final_message": True}).inputs
    assert not inp.add_generation_prompt and inp.continue_final_message
    (default,) = parse_chat({"messages": messages}).inputs
    assert default.add_generation_prompt and not default.continue_final_message
    with pytest.raises(InvalidArgumentError) as caught:
        parse_chat({"messages": messages, "continue_final_message": 1})
    assert caught.value.field == "continue_final_message"


def test_truncate_prompt_tokens_keeps_the_last_n_and_refuses_the_rest():
    (inp,) = parse_completion({"prompt": [5, 6, 7, 8], "truncate_prompt_tokens": 2}).inputs
    assert inp.truncate_prompt_tokens == 2
    assert truncate_prompt([5, 6, 7, 8], 2, 100) == [7, 8]
    assert truncate_prompt([5, 6, 7, 8], -1, 3) == [6, 7, 8]  # -1: the model's length
    assert truncate_prompt([5, 6, 7, 8], None, 3) == [5, 6, 7, 8]
    assert truncate_prompt([5, 6], 10, 100) == [5, 6]
    for bad in (0, -2, True):
        with pytest.raises(InvalidArgumentError) as caught:
            truncate_prompt([5, 6], bad, 100)
        assert caught.value.field == "truncate_prompt_tokens"
    with pytest.raises(InvalidArgumentError) as caught:
        parse_completion({"prompt": "a", "echo": True, "truncate_prompt_tokens": 2})
    assert caught.value.field == "truncate_prompt_tokens"


def test_a_developer_turn_is_a_system_turn():
    req = parse_chat({"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                      "max_tokens": 2})
    assert req.inputs[0].messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    with pytest.raises(InvalidArgumentError) as caught:
        parse_chat({"messages": [{"role": "wizard", "content": "x"}]})
    assert caught.value.field == "messages[0].role"


def test_chat_refuses_what_it_would_otherwise_ignore():
    for body, field in [({"messages": [{"role": "user", "content": "Hi", "tool_calls": []}]}, "messages[0].tool_calls"),
                        ({"messages": [{"role": "user", "content": "Hi"}], "tools": [{}]}, "tools[0].function"),
                        ({"messages": [{"role": "user", "content": "Hi"}], "response_format": {"type": "json"}},
                         "response_format.type")]:
        with pytest.raises(InvalidArgumentError) as caught:
            parse_chat(body)
        assert caught.value.field == field


def test_output_constraints_from_each_key_keep_the_schema_order():
    schema = {"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "string"}}}
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}}},
         ("json_schema", json.dumps(schema, separators=(",", ":")))),
        ({"response_format": {"type": "json_object"}}, ("json_object", "")),
        ({"response_format": {"type": "text"}}, None),
        ({"guided_json": json.dumps(schema)}, ("json_schema", json.dumps(schema, separators=(",", ":")))),
        ({"structured_outputs": {"choice": ["a", "b"]}}, ("choice", ("a", "b"))),
        ({"guided_regex": "[0-9]+"}, ("regex", "[0-9]+")),
        ({"structured_outputs": {"grammar": 'root ::= "x"'}}, ("grammar", 'root ::= "x"')),
    ]
    for extra, want in cases:
        (inp,) = parse_chat({**chat, **extra}).inputs
        got = inp.sampling_params.structured_output
        assert (got and (got.kind, got.spec)) == want, extra
    assert list(json.loads(cases[0][1][1])["properties"]) == ["z", "a"]  # generated in the order given


def test_null_means_not_given_for_any_key_and_openai_bookkeeping_is_accepted():
    """Clients that serialize every field of their model send nulls for what they do not use
    (``"tools": null``, an assistant turn's ``"tool_calls": null``); OpenAI's bookkeeping fields
    (``metadata``, ``store: false``, ``service_tier``) change nothing here."""
    (inp,) = parse_chat({"messages": [{"role": "system", "content": ""},
                                      {"role": "user", "content": "Hi", "name": None},
                                      {"role": "assistant", "content": None, "tool_calls": None, "refusal": None},
                                      {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                   {"type": "text", "text": "b"}]}],
                         "some_future_field": None, "tools": None, "metadata": {"k": "v"}, "store": False,
                         "service_tier": "auto", "prompt_logprobs": None}).inputs
    assert inp.messages == [{"role": "system", "content": ""}, {"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": ""}, {"role": "user", "content": "a\nb"}]  # vLLM's join
    with pytest.raises(InvalidArgumentError) as caught:
        parse_chat({"messages": [{"role": "user", "content": None}]})
    assert caught.value.field == "messages[0].content"


def test_chat_errors_name_the_field_the_caller_sent_and_seeds_take_int64():
    def field(body: dict) -> str:
        with pytest.raises(InvalidArgumentError) as caught:
            parse_chat({"messages": [{"role": "user", "content": "Hi"}], **body})
        return caught.value.field
    assert field({"max_completion_tokens": 0}) == "max_completion_tokens"
    assert field({"max_tokens": 0}) == "max_tokens"
    assert field({"logprobs": True, "top_logprobs": 21}) == "top_logprobs"
    assert field({"top_logprobs": 2}) == "top_logprobs"  # a count without logprobs: true
    # top_logprobs 0 without logprobs asks for nothing (vLLM refuses only a positive count)
    assert parse_chat({"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 0}).inputs
    seeds = [parse_completion({"prompt": "a", "seed": s}).inputs[0].sampling_params.seed for s in (-1, -2**63, 5)]
    assert seeds == [2**63 - 1, 0, 5]
    # off-only values compare with their types; the refusal names every accepted value
    for body in ({"store": 0}, {"best_of": True}):
        with pytest.raises(InvalidArgumentError):
            parse_completion({"prompt": "a", **body})
    with pytest.raises(InvalidArgumentError, match="'auto' or 'default'"):
        parse_completion({"prompt": "a", "service_tier": "priority"})


def test_a_chat_template_that_refuses_the_turns_is_a_400_naming_messages(hf_tokenizer):
    """Templates refuse turns they cannot render (Llama 2's and Mistral's raise_exception("Conversation
    roles must alternate ...")); that, an undefined variable or a template variable of the wrong
    kind from chat_template_kwargs is the caller's error (messages), never a 500."""
    from gateway_service.text import PromptTokenizer
    template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('roles must alternate') }}{% endif %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}{% if shout %}{{ shout.loud.louder }}{% endif %}")
    tok = PromptTokenizer(hf_tokenizer)
    for messages, kwargs, words in (([{"role": "system", "content": "s"}], None, "roles must alternate"),
                                    ([{"role": "system", "content": "s"}], {"raise_exception": 1}, "not callable"),
                                    ([{"role": "user", "content": "u"}], {"shout": 3}, "no attribute")):
        with pytest.raises(InvalidArgumentError, match=words) as caught:
            tok.chat_text(messages, chat_template=template, template_kwargs=kwargs, add_generation_prompt=False)
        assert caught.value.field == "messages"


def test_chat_template_kwargs_are_bounded_and_the_rendered_text_is_measured_before_tokenizing(hf_tokenizer):
    from gateway_service.text import PromptTokenizer
    with pytest.raises(InvalidArgumentError) as caught:
        parse_chat({"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"x": "y" * 70_000}})
    assert caught.value.field == "chat_template_kwargs"
    for key in ("bos_token", "custom_tools", "sanitize_control_tokens", "raise_exception"):
        with pytest.raises(InvalidArgumentError) as caught:
            parse_chat({"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {key: 1}})
        assert caught.value.field == f"chat_template_kwargs.{key}"
    # a template may render a variable per turn: the text's size is checked before it is tokenized
    # (GenerationService gives a bound of the model's length in bytes, 512 a turn and 128 KiB)
    template = "{% for m in messages %}{{ pad }}{{ m.content }}{% endfor %}"
    sizes = []
    def check(size: int) -> None:
        sizes.append(size)
        raise InvalidArgumentError("messages", "too long")
    with pytest.raises(InvalidArgumentError, match="too long"):
        PromptTokenizer(hf_tokenizer).encode_chat([{"role": "user", "content": "a"}] * 10, chat_template=template,
                                                  template_kwargs={"pad": "p" * 1000}, check_size=check,
                                                  add_generation_prompt=False)
    assert sizes == [10 * 1001]
    from gateway_service.generation import rendered_chat_limit
    limit = rendered_chat_limit(512 * 16, 1024)  # the tiny model's length in bytes, the most turns
    assert 30_840 < limit < 1024 * 64 << 10  # 1024 "hi" turns pass; a 64 KiB variable per turn does not


def test_chat_template_kwargs_and_add_special_tokens_reach_the_input(hf_tokenizer):
    from gateway_service.text import PromptTokenizer
    (inp,) = parse_chat({"messages": [{"role": "user", "content": "Hi"}],
                         "chat_template_kwargs": {"enable_thinking": False}}).inputs
    assert inp.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(InvalidArgumentError) as caught:
        parse_chat({"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"tokenize": True}})
    assert caught.value.field == "chat_template_kwargs.tokenize"
    template = "{% if shout %}!{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    tok = PromptTokenizer(hf_tokenizer)
    assert tok.chat_text([{"role": "user", "content": "Hi"}], chat_template=template, template_kwargs={"shout": True},
                         add_generation_prompt=False) == "!Hi"
    (plain,) = parse_completion({"prompt": "a", "add_special_tokens": False}).inputs
    assert not plain.add_special_tokens and parse_completion({"prompt": "a"}).inputs[0].add_special_tokens


def test_completion_logprobs_always_hold_the_sampled_token(hf_tokenizer):
    from gateway_service.openai_responses import completion_logprobs
    from servicekit.contract.step import TokenLogprobs
    text = TokenText(hf_tokenizer)
    lps = [TokenLogprobs(5, -2.0, []), TokenLogprobs(6, -0.5, [(6, -0.5), (7, -1.0)]),
           TokenLogprobs(8, -3.0, [(6, -0.1)])]
    out = completion_logprobs(lps, text, 0)
    assert [len(top) for top in out["top_logprobs"]] == [1, 2, 2]  # OpenAI: up to logprobs + 1
    assert out["top_logprobs"][0] == {text(5): -2.0} and out["top_logprobs"][2][text(8)] == -3.0


def test_logprob_tokens_keep_a_sentencepiece_tokens_leading_space():
    """A SentencePiece-style tokenizer (Metaspace: "▁the" decodes alone to "the") still names logprob
    tokens as they read in the text, so they join to it; a byte-level BPE one is unchanged."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "▁a": 2, "▁the": 3, "cat": 4, "▁sat": 5, ".": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    sp = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")
    assert sp.decode([3]) == "the"  # the loss TokenText avoids
    text = TokenText(sp)
    assert [text(t) for t in (3, 4, 5, 6, 1)] == [" the", "cat", " sat", ".", "</s>"]
    assert "".join(text(t) for t in (3, 4, 5, 6)) == sp.decode([2, 3, 4, 5, 6])[len("a"):]


def test_length_and_vocabulary_errors_read_as_clients_expect():
    """LiteLLM and agent frameworks recognise a context overflow by OpenAI's wording; vLLM's tests
    match "out of vocabulary"."""
    from servicekit.contract.prompt import check_prompt
    for prompt, max_tokens, field in (([1] * 10, 1, "prompt"), ([1] * 4, 7, "max_tokens")):
        with pytest.raises(InvalidArgumentError, match="This model's maximum context length is 10 tokens") as caught:
            check_prompt(prompt, max_tokens, max_model_len=10, vocab_size=50)
        assert caught.value.field == field
    with pytest.raises(InvalidArgumentError, match="token id 50 is out of vocabulary"):
        check_prompt([1, 50], 1, max_model_len=10, vocab_size=50)
    with pytest.raises(InvalidArgumentError, match=r"token id 77 is out of vocabulary \(ids must be in \[0, 50\)\)") as caught:
        check_prompt([1], 1, max_model_len=10, vocab_size=50, stop_token_ids=(3, 77))
    assert caught.value.field == "stop_token_ids"


async def test_an_error_after_the_stream_began_is_an_error_event_then_done(hf_tokenizer):
    req = parse_chat({"messages": [{"role": "user", "content": "Hi"}], "n": 2, "max_tokens": 4, "stream": True,
                      "stream_options": {"include_usage": True}})
    responder = Responder(req, chat=True, call_id="chatcmpl-1", model="m", token_text=TokenText(hf_tokenizer))
    choices = [ChoiceState(0), ChoiceState(1)]
    queue: asyncio.Queue = asyncio.Queue()
    queue.put_nowait((1, GenerateChunk("r1", text=" there", token_ids=[2], finish_reason=FinishReason.LENGTH,
                                       usage=Usage(3, 2, 0))))
    queue.put_nowait((1, None))
    queue.put_nowait((0, UnavailableError("Redis is unreachable")))
    first = (0, GenerateChunk("r0", text="Hello", token_ids=[1]))

    events = [e async for e in sse_events(first, queue, 2, choices, responder, [])]
    assert all(e.startswith(b"data: ") and e.endswith(b"\n\n") for e in events)
    *chunks, error, done = [e[len(b"data: "):-2] for e in events]
    assert done == b"[DONE]"
    assert json.loads(error)["error"] == {"message": "Redis is unreachable", "type": "ServiceUnavailableError",
                                          "param": None, "code": 503}
    parsed = [json.loads(c) for c in chunks]
    assert [c["object"] for c in parsed] == ["chat.completion.chunk"] * 2
    assert parsed[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hello"}
    assert parsed[1]["choices"][0]["finish_reason"] == "length" and parsed[1]["usage"] is None


async def test_streamed_text_offsets_count_tokens_whose_text_was_held_back(hf_tokenizer):
    """A possible stop string held the first token's text back: the next chunk's text is two
    tokens' text but its one token's offset still counts the first token (the whole answer's
    offsets, streamed; vLLM tests exactly this)."""
    ids = hf_tokenizer.encode("\nThe sea is", add_special_tokens=False)
    texts = [hf_tokenizer.decode([t]) for t in ids]
    req = parse_completion({"prompt": "x", "max_tokens": 4, "logprobs": 0, "stream": True, "stop": ["\n\n"]})
    responder = Responder(req, chat=False, call_id="cmpl-1", model="m", token_text=TokenText(hf_tokenizer))

    def chunk(text, token_ids, **last):
        return GenerateChunk("r", text=text, token_ids=token_ids, logprobs=[TokenLogprobs(t, -0.5, []) for t in token_ids],
                             **last)
    chunks = [chunk("", ids[:1]), chunk(texts[0] + texts[1], ids[1:2]),
              chunk("".join(texts[2:]), ids[2:], finish_reason=FinishReason.LENGTH, usage=Usage(1, len(ids), 0))]
    queue: asyncio.Queue = asyncio.Queue()
    for c in chunks[1:]:
        queue.put_nowait((0, c))
    queue.put_nowait((0, None))
    events = [e async for e in sse_events((0, chunks[0]), queue, 1, [ChoiceState(0)], responder, [])]
    streamed = [json.loads(e[len(b"data: "):-2]) for e in events[:-1]]
    offsets = [o for s in streamed for o in s["choices"][0]["logprobs"]["text_offset"]]

    whole = ChoiceState(0)
    for c in chunks:
        whole.add(c)
    want = responder.whole([whole])["choices"][0]["logprobs"]["text_offset"]
    assert offsets == want == [sum(len(t) for t in texts[:k]) for k in range(len(ids))]


def test_roles_echo_off_and_every_bad_logit_bias_key_are_said():
    with pytest.raises(InvalidArgumentError) as caught:
        parse_chat({"messages": [{"role": "my-custom-role", "content": "x"}]})
    assert caught.value.field == "messages[0].role"
    assert "system, developer, user, assistant, tool" in caught.value.message
    (inp,) = parse_chat({"messages": [{"role": "user", "content": "Hi"}], "echo": False}).inputs  # vLLM's off value
    assert inp.messages == [{"role": "user", "content": "Hi"}]
    with pytest.raises(InvalidArgumentError) as caught:
        parse_chat({"messages": [{"role": "user", "content": "Hi"}], "echo": True})
    assert caught.value.field == "echo"
    with pytest.raises(InvalidArgumentError) as caught:
        parse_completion({"prompt": "x", "logit_bias": {"5": 1, "x": 2, "-3": 1}})
    assert caught.value.field == "logit_bias" and "'x', '-3'" in caught.value.message
