"""The records gateways and schedulers exchange through Redis (queue.proto), as dataclasses:
a request as a gateway admits it, and what a scheduler publishes for it, one record per step
that produced something (``servicekit.proto.queue`` converts both ways)."""

from __future__ import annotations

from dataclasses import dataclass, field

from servicekit.contract.sampling_params import SamplingParams
from servicekit.contract.step import FinishReason, TokenLogprobs


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """An EngineRequest: tokenized, validated and seeded by the gateway; trusted by the scheduler."""

    request_id: str  # names its output stream
    prompt_token_ids: list[int]  # after tokenization (and chat template)
    sampling_params: SamplingParams  # seed always set
    arrival_time: float  # wall-clock seconds when the gateway admitted it
    deadline: float = 0.0  # wall-clock seconds after which nobody waits for it; 0 = none
    priority: int = 0  # lower runs first under priority scheduling
    cache_salt: str = ""  # prefix-cache salt; "" = none
    tenant: str = ""  # whose fair share it counts against (scheduling policy "fair"); "" = the one default
    tenant_weight: float = 0.0  # the tenant's weight in fair shares; 0 = not given (1)


@dataclass(slots=True)
class OutputRecord:
    """An EngineOutput: one entry of a request's output stream. An empty record is the admission
    marker the gateway writes first; one with ``error_message`` is a request's last (refused or
    lost). Read, never changed (not frozen: a gateway makes one per record it reads, and a frozen
    dataclass's constructor costs twice as much)."""

    token_ids: list[int]  # new tokens, in order
    first_index: int  # output index of token_ids[0]
    logprobs: list[TokenLogprobs]  # one per token when asked for
    finish_reason: FinishReason | None  # on the request's last record
    num_cached_tokens: int  # prompt tokens served from the prefix cache (0 before the first schedule)
    error_field: str = ""  # the field at fault, when the request was refused for one
    error_message: str = ""  # why the request was refused or lost ("" for a normal record)
    error_code: str | None = None  # with error_message: the name of the status the client gets
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # with the first token, when asked for

    @classmethod
    def error(cls, field: str, message: str, code: str | None = None) -> OutputRecord:
        """The last record of a request the scheduler refused or lost (finish reason ABORT), with
        the status its client gets: ``code`` (a status name, as errors carry it), else
        INVALID_ARGUMENT when ``field`` is at fault, else ABORTED."""
        if code is None:
            code = "INVALID_ARGUMENT" if field else "ABORTED"
        return cls([], 0, [], FinishReason.ABORT, 0, error_field=field, error_message=message, error_code=code)

    @property
    def ends_stream(self) -> bool:
        """Whether this is a request's last record (a finish reason, or an error)."""
        return bool(self.error_message) or self.finish_reason is not None


def delivered_outputs(records: list[OutputRecord]) -> tuple[list[int], bool]:
    """The output tokens a request's output stream holds, by index (index i is the i-th token;
    repeats from a duplicated publish are skipped), and whether the stream already ended."""
    tokens: list[int] = []
    for record in records:
        if record.ends_stream:
            return tokens, True
        start = record.first_index
        if start > len(tokens):
            break  # a gap cannot happen (records are published in order); stop at it to be safe
        tokens.extend(record.token_ids[len(tokens) - start:])
    return tokens, False
