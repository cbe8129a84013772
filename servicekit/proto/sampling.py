"""The shared messages of sampling.proto as to/from pairs: SamplingParams, FinishReason,
TokenLogprobs. Every other protocol module (``step``, ``queue``, ``generation``) and the SDK build
on these; nothing outside ``servicekit.proto``, the services' ``grpc_server.py`` / ``convert.py`` and
the SDK's wire layer touches ``*_pb2``.
"""

from __future__ import annotations

from servicekit.contract.errors import InvalidArgumentError
from servicekit.contract.sampling_params import SamplingParams
from servicekit.contract.step import FinishReason, TokenLogprobs
from servicekit.contract.structured_output import StructuredOutput
from servicekit.proto.pb import sampling_pb2

# The SamplingParams fields the wire carries as optional scalars (unset: the dataclass default),
# and every field it carries (the SDK takes these as keyword arguments).
SCALAR_FIELDS = (
    "max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "ignore_eos",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs", "prompt_logprobs",
)
FIELDS = (*SCALAR_FIELDS, "stop", "stop_token_ids", "logit_bias", "allowed_token_ids", "structured_output")

FINISH_REASON_TO_PB = {
    None: sampling_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: sampling_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: sampling_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: sampling_pb2.FINISH_REASON_ABORT,
}
FINISH_REASON_FROM_PB = {v: k for k, v in FINISH_REASON_TO_PB.items()}


def sampling_params_from_pb(msg: sampling_pb2.SamplingParams, *, trusted: bool = False) -> SamplingParams:
    """Unset fields take SamplingParams' defaults. A client's message (``trusted=False``, the gateway)
    is validated: InvalidArgumentError names a bad field; a record an inner service decodes was
    validated where it entered and is taken as it is (``trusted=True``)."""
    kwargs = {name: getattr(msg, name) for name in SCALAR_FIELDS if msg.HasField(name)}
    if msg.HasField("structured_output"):
        kwargs["structured_output"] = structured_output_from_pb(msg.structured_output)
    make = SamplingParams.trusted if trusted else SamplingParams
    return make(stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids),
                logit_bias=tuple(sorted(msg.logit_bias.items())), allowed_token_ids=tuple(msg.allowed_token_ids),
                **kwargs)


def structured_output_from_pb(msg: sampling_pb2.StructuredOutput) -> StructuredOutput:
    kind = msg.WhichOneof("constraint")
    if kind is None:
        raise InvalidArgumentError("structured_output", "set one of json_schema, json_object, regex, choice, grammar")
    if kind == "json_object":
        if not msg.json_object:
            raise InvalidArgumentError("structured_output", "json_object must be true when set")
        return StructuredOutput("json_object")
    if kind == "choice":
        return StructuredOutput("choice", tuple(msg.choice.values))
    return StructuredOutput(kind, getattr(msg, kind))


def structured_output_to_pb(constraint: StructuredOutput, msg: sampling_pb2.StructuredOutput) -> None:
    if constraint.kind == "json_object":
        msg.json_object = True
    elif constraint.kind == "choice":
        msg.choice.values.extend(constraint.spec)
    else:
        setattr(msg, constraint.kind, constraint.spec)


def sampling_params_to_pb(params: SamplingParams, out: sampling_pb2.SamplingParams | None = None
                          ) -> sampling_pb2.SamplingParams:
    msg = out if out is not None else sampling_pb2.SamplingParams()
    for name in SCALAR_FIELDS:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    msg.stop.extend(params.stop)
    msg.stop_token_ids.extend(params.stop_token_ids)
    msg.logit_bias.update(params.logit_bias)
    msg.allowed_token_ids.extend(params.allowed_token_ids)
    if params.structured_output is not None:
        structured_output_to_pb(params.structured_output, msg.structured_output)
    return msg


def logprobs_to_pb(items: list[TokenLogprobs], out) -> None:
    """Append ``items`` to the repeated TokenLogprobs field ``out``."""
    for item in items:
        msg = out.add(token_id=item.token_id, logprob=item.logprob, rank=item.rank)
        for token_id, logprob in item.top:
            msg.top.add(token_id=token_id, logprob=logprob)


def logprobs_from_pb(items) -> list[TokenLogprobs]:
    return [TokenLogprobs(m.token_id, m.logprob, [(t.token_id, t.logprob) for t in m.top], m.rank) for m in items]


def sampling_params_to_bytes(params: SamplingParams) -> bytes:
    """``params``' deterministic wire form: equal parameters give equal bytes in any process (what
    a gateway hashes to check a resume against its admission)."""
    return sampling_params_to_pb(params).SerializeToString(deterministic=True)
