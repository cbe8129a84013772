"""The Redis records' conversions (``servicekit.proto.queue``), the one module the gateway and the
scheduler use: a RequestRecord and an OutputRecord (normal and refusal) come back as they went,
with a non-default value in every field, both ways; a scheduler's step output reads back as the
record a gateway gets; and what a taken-over request already delivered is read by index."""

from __future__ import annotations

from servicekit.contract.records import OutputRecord, RequestRecord, delivered_outputs
from servicekit.contract.sampling_params import SamplingParams
from servicekit.contract.step import EngineCoreOutput, FinishReason, TokenLogprobs
from servicekit.proto import queue
from servicekit.proto.pb import queue_pb2


def test_a_request_record_round_trips():
    record = RequestRecord("r1", [1, 2, 3], SamplingParams(max_tokens=7, temperature=0.5, seed=3, stop=("x",)),
                           arrival_time=12.5, deadline=99.0, priority=2, cache_salt="salt", tenant="team-a")
    data = queue.request_record_to_bytes(record)
    assert queue.request_record_from_bytes(data) == record
    assert queue.request_record_to_bytes(queue.request_record_from_bytes(data)) == data


def test_an_output_record_round_trips():
    record = OutputRecord([4, 5], 3, [TokenLogprobs(4, -0.5, [(4, -0.5)], 1), TokenLogprobs(5, -1.0, [], 2)],
                          FinishReason.LENGTH, 16, prompt_logprobs=[TokenLogprobs(2, -0.25, [(9, -0.125)], 3)])
    data = queue.output_record_to_bytes(record)
    assert queue.output_record_from_bytes(data) == record
    assert queue.output_record_to_bytes(queue.output_record_from_bytes(data)) == data


def test_a_refusal_carries_its_field_message_and_status():
    for record, code in [(OutputRecord.error("temperature", "too hot"), "INVALID_ARGUMENT"),
                         (OutputRecord.error("", "lost"), "ABORTED"),
                         (OutputRecord.error("", "late", "DEADLINE_EXCEEDED"), "DEADLINE_EXCEEDED")]:
        data = queue.output_record_to_bytes(record)
        back = queue.output_record_from_bytes(data)
        assert back == record and back.error_code == code and back.finish_reason is FinishReason.ABORT
        assert queue.output_record_to_bytes(back) == data
    late = queue.output_record_to_bytes(OutputRecord.error("", "x", "DEADLINE_EXCEEDED"))
    assert queue_pb2.EngineOutput.FromString(late).error_code == 4  # google.rpc.Code's number


def test_a_steps_output_reads_back_as_the_record_a_gateway_gets():
    out = EngineCoreOutput("r", [8, 9], 5, FinishReason.STOP, [TokenLogprobs(8, -0.5, [], 1)] * 2, 12,
                           prompt_logprobs=[TokenLogprobs(1, -0.25, [], 2)])
    data = queue.engine_output_to_bytes(out)
    assert queue.output_record_from_bytes(data) == OutputRecord(
        [8, 9], 5, out.new_logprobs, FinishReason.STOP, 12, prompt_logprobs=out.prompt_logprobs)
    assert data == queue.output_record_to_bytes(queue.output_record_from_bytes(data))


def record(first_index: int, tokens: list[int], finish: FinishReason | None = None) -> OutputRecord:
    out = EngineCoreOutput("r", tokens, first_index, finish)
    return queue.output_record_from_bytes(queue.engine_output_to_bytes(out))


def test_delivered_outputs_are_read_by_index_and_repeats_are_skipped():
    admission_marker = queue.output_record_from_bytes(b"")
    records = [admission_marker, record(0, [5, 6]), record(2, [7]), record(1, [6, 7]), record(3, [8])]
    assert delivered_outputs(records) == ([5, 6, 7, 8], False)
    assert delivered_outputs([*records, record(4, [9], FinishReason.LENGTH)]) == ([5, 6, 7, 8], True)
    assert delivered_outputs([*records, OutputRecord.error("", "given up")]) == ([5, 6, 7, 8], True)
