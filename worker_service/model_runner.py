"""The model runner: applies each step's diff to the persistent batch, runs one forward pass over
the scheduled tokens with paged attention, and samples.

This is the seam shared by the in-process engine (``pagedserve.LLM``) and the worker's gRPC
service: ``execute_model(SchedulerOutput) -> ModelRunnerOutput`` and ``info -> WorkerDescription``. It
knows nothing of gRPC, Redis or tokenizers.

Per step the CPU work is a handful of vectorised numpy operations over the scheduled requests
(positions, input ids, slot mapping, block tables); each resulting array is copied to the device
once. Logits are computed only for the rows that sample.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from paged_kernels import get_attention_ops, native
from servicekit.contract.errors import InvalidArgumentError
from servicekit.contract.step import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from servicekit.contract.worker import CPU_PREFILL_CHUNK_ATTENTION_LIMIT, WorkerDescription
from servicekit.gguf_cache import hf_folder
from servicekit.grammar import GrammarCompiler
from servicekit.model_registry import resolve_model
from worker_service import cpu_memory
from worker_service.config import ModelRunnerConfig
from worker_service.input_batch import InputBatch, ragged
from worker_service.kv_cache import activation_reserve, allocate_kv_caches, determine_num_blocks
from worker_service.loader import LoadedModel, load_model
from worker_service.models import cpu_gemm
from worker_service.models.layers import AttentionMetadata, ForwardContext
from worker_service.sampler import Sampler, SamplerOutput, SamplingMetadata
from worker_service.structured_output import StructuredRows

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepInputs:
    """One step's flattened inputs (device tensors) and the bookkeeping to read the results back."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [M] int64: the tokens whose logits sample (M = N + drafts)
    sample_req_ids: list[str]  # [N] request id of each sampling request
    sample_rows: np.ndarray  # [M] persistent-batch row of each sampling position
    prompt_logprobs: list[PromptLogprobsRows] = field(default_factory=list)  # requests that asked for them
    # with draft tokens: [N] drafts per sampling request (it samples at 1 + that many positions,
    # consecutive in the M rows) and [M] each position's offset after the request's known tokens
    num_drafts: np.ndarray | None = None
    sample_offsets: np.ndarray | None = None


@dataclass(slots=True)
class PromptLogprobsRows:
    """The rows of a step's hidden states whose logits score a request's prompt tokens."""

    request_id: str
    first_index: int  # prompt index of the token the first row scores (its position + 1)
    token_indices: np.ndarray  # [K] rows of the step's tokens
    target_ids: np.ndarray  # [K] the prompt token each row scores
    num_top: int  # alternatives per entry


PROMPT_LOGPROBS_ROWS = 256  # logits rows at a time: [256, V] fp32 (50 MB at a 49k vocabulary)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class ModelRunner:
    """Owns the weights, the KV cache and the persistent batch of one worker.

    ``loaded``: an already loaded model (dependency injection for tests); ``hf_model``: a loaded
    transformers model of ``config.model`` to take the weights from instead of reading them again.
    """

    def __init__(self, config: ModelRunnerConfig, *, loaded: LoadedModel | None = None,
                 hf_model: Any | None = None) -> None:
        self.config = config
        self.device = torch.device(config.device) if config.device else default_device()
        if loaded is None:
            loaded = load_model(config.model, dtype=config.dtype, device=self.device,
                                max_positions=config.max_model_len, hf_model=hf_model)
        self.loaded = loaded
        self.model = loaded.model
        cfg = self.model.cfg
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise InvalidArgumentError("max_model_len", f"{self.max_model_len} exceeds the model's "
                                                         f"max_position_embeddings ({cfg.max_position_embeddings})")
        self.block_size = config.block_size
        self.num_packed_linears = 0
        self.small_gemm = False  # whether steps of up to ~1,024 rows run the layers' GEMMs on AMX tiles
        malloc_tuned = False
        if self.device.type == "cpu":
            malloc_tuned = config.tune_malloc and cpu_memory.tune_malloc()
            # only a change from the defaults is passed on: the defaults leave the environment its say
            native.configure(enabled=None if config.native_kernels else False, cache_dir=config.kernel_cache or None)
            if config.prepack_weights:
                self.num_packed_linears = cpu_gemm.prepack(self.model, small=config.small_gemm)
                self.small_gemm = cpu_gemm.small_gemm_layers(self.model) > 0
                if self.num_packed_linears:
                    log.info("%d GEMM weights laid out for oneDNN (bf16, once at load)%s", self.num_packed_linears,
                             "; the layers' also for the AMX tile GEMM (paged_kernels.small_gemm)" if self.small_gemm else "")
        self.num_blocks = determine_num_blocks(config, cfg, loaded.dtype, self.device, self.max_model_len)
        self.kv_caches = allocate_kv_caches(cfg, self.num_blocks, self.block_size, loaded.dtype, self.device)
        if malloc_tuned:  # freed heap is kept: worth faulting the activation memory in now
            reserve = activation_reserve(config, cfg, loaded.dtype)
            log.info("heap: %d MiB of activation memory faulted in at start in %.1f s", reserve >> 20,
                     cpu_memory.warm_heap(reserve))
        self.max_blocks_per_req = -(-self.max_model_len // self.block_size)
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = loaded.eos_token_ids
        self.structured = StructuredRows(self.vocab_size, tuple(self.eos_token_ids), self._grammar_compiler)
        self.batch = InputBatch(config.max_num_seqs, self.max_model_len, self.max_blocks_per_req,
                                vocab_size=self.vocab_size, eos_token_ids=tuple(self.eos_token_ids),
                                structured=self.structured,
                                prompt_lookup=(config.prompt_lookup_min, config.prompt_lookup_max)
                                if config.num_speculative_tokens else None)
        self.sampler = Sampler()
        # The sampling rows' fp32 logits of a bf16 model on the CPU, kept between steps and grown
        # as needed (LlamaForCausalLM.compute_logits' ``out``): at 200 rows they are 39 MiB, which
        # glibc maps afresh for every step and the kernel faults in page by page (in a VM, 2.4 s
        # of kernel time over a served burst of 64 requests).
        self._logits_out = torch.empty((0, self.vocab_size), dtype=torch.float32) \
            if self.device.type == "cpu" and loaded.dtype == torch.bfloat16 else None
        # the drafts proposed with the latest step's answer, by request id, with the known-token
        # count they follow: a continuation's ``num_own_drafts`` are taken from here
        self._own_drafts: dict[str, tuple[int, list[int]]] = {}
        ops = get_attention_ops(config.attention_backend, self.device.type)
        self.reshape_and_cache, self.paged_attention = ops.reshape_and_cache, ops.paged_attention
        self.attention_backend = ops.backend

    def _grammar_compiler(self) -> GrammarCompiler:
        """The model's tokenizer as the grammar engine sees it (built once, on the first constrained
        request, off the step's thread)."""
        from transformers import AutoTokenizer

        source = hf_folder(resolve_model(self.config.model), weights=False)
        tokenizer = AutoTokenizer.from_pretrained(source.path, **source.from_pretrained_kwargs())
        return GrammarCompiler(tokenizer, self.vocab_size, tuple(self.eos_token_ids))

    @property
    def info(self) -> WorkerDescription:
        return WorkerDescription(
            model=self.loaded.source.name,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=tuple(self.eos_token_ids),
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            prefill_chunk_attention_limit=self.prefill_chunk_attention_limit,
        )

    @property
    def prefill_chunk_attention_limit(self) -> int:
        """What this worker states to schedulers: the configured value, or (auto) a CPU's limit on a
        CPU and none on a GPU (``servicekit.contract.worker.CPU_PREFILL_CHUNK_ATTENTION_LIMIT``)."""
        if self.config.prefill_chunk_attention_limit >= 0:
            return self.config.prefill_chunk_attention_limit
        return CPU_PREFILL_CHUNK_ATTENTION_LIMIT if self.device.type == "cpu" else 0

    # -- one step -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Apply the diff, run the scheduled tokens, return the tokens of the requests that sample.

        A request samples exactly when this step's tokens reach the end of its known token ids; the
        sampled token is appended to the worker's copy of them.
        """
        self._update_states(scheduler_output)
        if scheduler_output.continuation:
            scheduler_output = self._continue(scheduler_output)
        self._own_drafts = {}  # the proposals below, for this step's continuation only
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput()
        inputs = self._prepare_inputs(scheduler_output)
        ctx = ForwardContext(inputs.metadata, self.kv_caches, self.reshape_and_cache, self.paged_attention)
        hidden = self.model(inputs.input_ids, inputs.positions, ctx)  # [T, D]
        out = ModelRunnerOutput()
        if inputs.sample_req_ids:
            meta = self._sampling_metadata(inputs.sample_rows, inputs.sample_offsets)
            sample_hidden = hidden[inputs.logits_indices]  # [M, D]
            token_ids = self.model.greedy_token_ids(sample_hidden) if meta.plain_greedy else None
            if token_ids is not None:  # each row's argmax alone: no [M, V] fp32 logits made
                sampled = SamplerOutput(token_ids=token_ids)
            else:
                logits = self.model.compute_logits(sample_hidden, self._logits_buffer(len(inputs.logits_indices)))
                sampled = self.sampler(logits, meta)
            out = self._collect(inputs, sampled)
            if self.batch.prompt_lookup is not None:
                out.spec_token_ids = self._propose_drafts(out.sampled_token_ids)
        for rows in inputs.prompt_logprobs:
            out.prompt_logprobs[rows.request_id] = (rows.first_index, self._prompt_logprobs(hidden, rows))
        return out

    def _logits_buffer(self, rows: int) -> torch.Tensor | None:
        """The step's sampling-logits buffer, at least ``rows`` rows (None: not kept here)."""
        if self._logits_out is not None and self._logits_out.shape[0] < rows:
            self._logits_out = torch.empty((-(-rows // 64) * 64, self.vocab_size), dtype=torch.float32)
        return self._logits_out

    def _prompt_logprobs(self, hidden: torch.Tensor, rows: PromptLogprobsRows) -> list[TokenLogprobs]:
        """Each row's prompt token scored by the model's distribution at the row (a log-softmax of
        the logits, as sampled tokens' logprobs are), its rank and the top alternatives; a few
        hundred rows at a time so a long prompt never holds a [T, V] logits tensor."""
        out: list[TokenLogprobs] = []
        index = _to(rows.token_indices, self.device)
        targets = _to(rows.target_ids, self.device)
        for start in range(0, len(index), PROMPT_LOGPROBS_ROWS):
            part, target = index[start:start + PROMPT_LOGPROBS_ROWS], targets[start:start + PROMPT_LOGPROBS_ROWS]
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[part]).float(), dim=-1)  # [k, V]
            chosen = logprobs.gather(1, target[:, None])  # [k, 1]
            ranks = (logprobs > chosen).sum(dim=1).add_(1).tolist()
            best = logprobs.topk(rows.num_top, dim=-1)  # num_top 0: empty rows
            for token_id, logprob, rank, top_ids, top_lps in zip(target.tolist(), chosen[:, 0].tolist(), ranks,
                                                                 best.indices.tolist(), best.values.tolist()):
                out.append(TokenLogprobs(token_id, logprob, list(zip(top_ids, top_lps)), rank))
        return out

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.batch
        for rid in so.finished_req_ids:
            batch.remove(rid)
        for rid in so.preempted_req_ids:
            batch.remove(rid)
        for new in so.scheduled_new_reqs:
            batch.add(new)
        batch.update(so.scheduled_cached_reqs)

    def _continue(self, so: SchedulerOutput) -> SchedulerOutput:
        """A continuation as this worker runs it (``servicekit.contract.step``): each request
        decodes its last known token, then the drafts proposed for it with the previous step's
        answer, up to ``num_own_drafts`` (fewer when the previous step's tokens left fewer). A
        request that has all of its ``max_tokens`` (its drafts were accepted in the previous step)
        is skipped: it is finished, and a token computed for it would be dropped."""
        if so.scheduled_new_reqs or so.scheduled_spec_decode_tokens:
            raise ValueError("a continuation with new requests or scheduled draft tokens")
        batch = self.batch
        req_ids = so.scheduled_cached_reqs.req_ids
        if set(req_ids) != set(so.num_scheduled_tokens) or any(n != 1 for n in so.num_scheduled_tokens.values()):
            raise ValueError("a continuation schedules one token for each request it holds, and nothing else")
        rows = np.fromiter((batch.row_of(r) for r in req_ids), dtype=np.int64, count=len(req_ids))
        batch.num_computed_tokens[rows] = batch.num_tokens[rows] - 1
        row_list = rows.tolist()
        num_outputs = (batch.num_tokens[rows] - batch.num_prompt_tokens[rows]).tolist()
        ended = {rid for rid, row, n in zip(req_ids, row_list, num_outputs)
                 if n >= batch.sampling_params[row].max_tokens}
        spec: dict[str, list[int]] = {}
        if so.num_own_drafts:
            for rid, row in zip(req_ids, row_list):
                proposal = self._own_drafts.get(rid)
                if proposal is not None and proposal[0] == batch.num_tokens[row] and rid not in ended:
                    spec[rid] = proposal[1][:so.num_own_drafts]
        if not spec and not ended:
            return so
        num_scheduled = {rid: n for rid, n in so.num_scheduled_tokens.items() if rid not in ended}
        for rid, drafts in spec.items():
            num_scheduled[rid] += len(drafts)
        return replace(so, num_scheduled_tokens=num_scheduled, scheduled_spec_decode_tokens=spec,
                       total_num_scheduled_tokens=sum(num_scheduled.values()))

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        batch, bs = self.batch, self.block_size
        req_ids = list(so.num_scheduled_tokens)
        rows = np.fromiter((batch.row_of(r) for r in req_ids), dtype=np.int64, count=len(req_ids))  # [S]
        counts = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))  # [S]
        computed = batch.num_computed_tokens[rows].astype(np.int64)  # [S]
        seq_lens = computed + counts  # [S]
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start_loc[1:])
        # per token: its sequence, its row in the persistent batch, its position in that sequence
        token_seq, within = ragged(counts)  # [T], [T]
        token_rows = rows[token_seq]
        positions = computed[token_seq] + within
        known = batch.num_tokens[rows].astype(np.int64)  # [S] prompt + outputs (+ drafts below)
        num_drafts = self._place_drafts(so.scheduled_spec_decode_tokens, req_ids, rows, known) \
            if so.scheduled_spec_decode_tokens else None
        if int(seq_lens.max()) > batch.max_model_len or (seq_lens > known).any():
            raise ValueError("scheduler output schedules tokens past a request's known token ids")
        input_ids = batch.token_ids[token_rows, positions]
        block_ids = batch.block_table[token_rows, positions // bs].astype(np.int64)
        slot_mapping = block_ids * bs + positions % bs
        max_blocks = -(-int(seq_lens.max()) // bs)
        block_tables = batch.block_table[rows, :max_blocks]  # [S, max_blocks] int32
        samples = seq_lens == known  # [S] reaches the end of its known tokens
        logits_indices = query_start_loc[1:][samples] - 1
        sample_rows, offsets = rows[samples], None
        attention = (query_start_loc, seq_lens, block_tables, int(counts.max()))
        if num_drafts is not None:
            if (num_drafts[~samples] > 0).any() or (num_drafts >= counts).any():
                raise ValueError("scheduler output gives draft tokens to a request that does not decode them")
            attention = _drafts_as_decode_rows(num_drafts, counts, computed, seq_lens, block_tables)
            num_drafts = num_drafts[samples]
            per = num_drafts + 1  # positions each sampling request samples at: its last token's, its drafts'
            owner, offsets = ragged(per)  # [M], [M] 0 .. drafts
            logits_indices = logits_indices[owner] - num_drafts[owner] + offsets
            sample_rows = sample_rows[owner]
        prompt_logprobs = []
        for i in np.nonzero(batch.num_prompt_logprobs[rows] >= 0)[0].tolist():
            # position p's logits score prompt token p + 1: positions up to the prompt's second-to-last
            first, end = int(computed[i]), min(int(seq_lens[i]), int(batch.num_prompt_tokens[rows[i]]) - 1)
            if first < end:
                prompt_logprobs.append(PromptLogprobsRows(
                    req_ids[i], first + 1, np.arange(end - first) + query_start_loc[i],
                    batch.token_ids[rows[i], first + 1:end + 1].astype(np.int64),
                    int(batch.num_prompt_logprobs[rows[i]])))

        dev = self.device
        att_query_start_loc, att_seq_lens, att_block_tables, max_query_len = attention
        metadata = AttentionMetadata(
            slot_mapping=_to(slot_mapping, dev),
            block_tables=_to(att_block_tables, dev),
            query_start_loc=_to(att_query_start_loc.astype(np.int32), dev),
            seq_lens=_to(att_seq_lens.astype(np.int32), dev),
            max_query_len=max_query_len,
            max_seq_len=int(seq_lens.max()),
        )
        return StepInputs(
            input_ids=_to(input_ids.astype(np.int64), dev),
            positions=_to(positions, dev),
            metadata=metadata,
            logits_indices=_to(logits_indices, dev),
            sample_req_ids=[rid for rid, s in zip(req_ids, samples) if s],
            sample_rows=sample_rows,
            prompt_logprobs=prompt_logprobs,
            num_drafts=num_drafts,
            sample_offsets=offsets,
        )

    def _place_drafts(self, spec: dict[str, list[int]], req_ids: list[str], rows: np.ndarray,
                      known: np.ndarray) -> np.ndarray:
        """Write each request's draft tokens after its known tokens (this step's inputs) and count
        them into ``known``; returns [S] drafts per scheduled request."""
        index = {rid: i for i, rid in enumerate(req_ids)}
        num_drafts = np.zeros(len(req_ids), dtype=np.int64)
        for rid, drafts in spec.items():
            i = index.get(rid)
            if i is None:
                raise ValueError(f"scheduler output gives draft tokens to {rid}, which it does not schedule")
            self.batch.write_drafts(int(rows[i]), drafts)
            num_drafts[i] = len(drafts)
        known += num_drafts
        return num_drafts

    def _sampling_metadata(self, rows: np.ndarray, offsets: np.ndarray | None = None) -> SamplingMetadata:
        """Gather the sampling rows' settings; optional features only when some row uses them.
        ``offsets``: each row's position after its request's known tokens (a row of a draft),
        when some rows verify drafts (a request then has several rows)."""
        b, dev, vocab = self.batch, self.device, self.vocab_size
        num_prompt = b.num_prompt_tokens[rows].astype(np.int64)
        num_tokens = b.num_tokens[rows].astype(np.int64)
        out_index = num_tokens - num_prompt if offsets is None else num_tokens - num_prompt + offsets  # [M]
        meta = SamplingMetadata(
            temperature=_to(b.temperature[rows], dev),
            seeds=_to(b.seed[rows], dev),
            positions=_to(out_index, dev),
        )
        top_k = b.top_k[rows]
        if ((top_k > 0) & (top_k < vocab)).any():
            meta.top_k = _to(np.where(top_k > 0, np.minimum(top_k, vocab), vocab), dev)
        if (b.top_p[rows] < 1.0).any():
            meta.top_p = _to(b.top_p[rows], dev)
        if (b.min_p[rows] > 0.0).any():
            meta.min_p = _to(b.min_p[rows], dev)
        rep, pres, freq = b.repetition_penalty[rows], b.presence_penalty[rows], b.frequency_penalty[rows]
        if (rep != 1.0).any() or (pres != 0.0).any() or (freq != 0.0).any():
            meta.repetition_penalty = _to(rep, dev) if (rep != 1.0).any() else None
            meta.presence_penalty = _to(pres, dev) if (pres != 0.0).any() else None
            meta.frequency_penalty = _to(freq, dev) if (freq != 0.0).any() else None
            width = int(num_tokens.max())
            tokens = b.token_ids[rows, :width].astype(np.int64)  # [N, L]
            col = np.arange(width)[None, :]
            in_prompt = col < num_prompt[:, None]
            in_output = ~in_prompt & (col < num_tokens[:, None])
            meta.prompt_token_ids = _to(np.where(in_prompt, tokens, vocab), dev)
            meta.output_token_ids = _to(np.where(in_output, tokens, vocab), dev)
        # Per-row id lists are built once at admission (a step never rebuilds them) and sent as
        # (batch row of each id, the ids), only when some sampling row has one.
        short = np.nonzero(out_index < b.min_tokens[rows])[0]
        if len(short):  # before min_tokens, stop tokens (and EOS unless ignored) cannot be sampled
            banned = [(i, b.min_tokens_banned[int(rows[i])]) for i in short.tolist()]
            if any(len(ids) for _, ids in banned):
                meta.banned_tokens = tuple(_to(a, dev) for a in _per_row(banned))
        if b.num_biased:
            biased = [(i, b.logit_bias[row]) for i, row in enumerate(rows.tolist()) if b.logit_bias[row] is not None]
            if biased:
                meta.logit_bias = (*(_to(a, dev) for a in _per_row([(i, ids) for i, (ids, _) in biased])),
                                   _to(np.concatenate([bias for _, (_, bias) in biased]), dev))
        if b.num_restricted:
            restricted = [(i, b.allowed[row]) for i, row in enumerate(rows.tolist()) if b.allowed[row] is not None]
            if restricted:
                meta.allowed_tokens = tuple(_to(a, dev) for a in _per_row(restricted))
        if len(self.structured):
            grammar = self.structured.bitmask(rows)
            if grammar is not None:
                meta.grammar_mask = (_to(grammar[0], dev), grammar[1].to(dev))
        num_logprobs = b.num_logprobs[rows]
        if (num_logprobs >= 0).any():
            meta.max_num_logprobs = int(num_logprobs.max())
        return meta

    def _collect(self, inputs: StepInputs, sampled: SamplerOutput) -> ModelRunnerOutput:
        token_ids = sampled.token_ids.cpu().numpy()
        if inputs.num_drafts is None:
            first = np.arange(len(token_ids))  # one sampling row per request
            self.batch.append_tokens(inputs.sample_rows, token_ids.astype(np.int32))
            out = ModelRunnerOutput(
                sampled_token_ids={rid: [int(t)] for rid, t in zip(inputs.sample_req_ids, token_ids.tolist())}
            )
        else:
            first, counts, kept = self._verify_drafts(inputs, token_ids)
            self.batch.append_token_runs(inputs.sample_rows[first], counts, kept.astype(np.int32))
            flat, ends = kept.tolist(), np.cumsum(counts).tolist()
            out = ModelRunnerOutput(sampled_token_ids={
                rid: flat[end - n:end] for rid, n, end in zip(inputs.sample_req_ids, counts.tolist(), ends)})
        if sampled.logprobs is not None:  # requests with logprobs have no drafts: their one row is first[i]
            num_logprobs = self.batch.num_logprobs[inputs.sample_rows].tolist()
            logprobs = sampled.logprobs.cpu().tolist()
            top_ids = sampled.top_token_ids.cpu().tolist() if sampled.top_token_ids is not None else None
            top_lps = sampled.top_logprobs.cpu().tolist() if sampled.top_logprobs is not None else None
            for rid, i in zip(inputs.sample_req_ids, first.tolist()):
                n = num_logprobs[i]
                if n < 0:
                    continue
                top = list(zip(top_ids[i][:n], top_lps[i][:n])) if top_ids is not None else []
                out.logprobs[rid] = [TokenLogprobs(int(token_ids[i]), logprobs[i], top)]
        return out

    def _propose_drafts(self, sampled: dict[str, list[int]]) -> dict[str, list[int]]:
        """Drafts for the next step of each request that sampled (n-gram speculation), within
        ``SamplingParams.max_drafts`` and ``num_speculative_tokens``; only those with a match."""
        batch, k = self.batch, self.config.num_speculative_tokens
        drafts: dict[str, list[int]] = {}
        for rid, tokens in sampled.items():
            row = batch.rows[rid]
            index = batch.ngram[row]
            if index is None:
                continue
            index.extend(tokens)
            num_outputs = int(batch.num_tokens[row] - batch.num_prompt_tokens[row])
            proposal = index.propose(min(k, batch.sampling_params[row].max_drafts(num_outputs)))
            if proposal:
                drafts[rid] = proposal
                self._own_drafts[rid] = (int(batch.num_tokens[row]), proposal)
        return drafts

    def _verify_drafts(self, inputs: StepInputs, token_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Keep, per sampling request, the tokens sampled at its positions up to and including the
        first that differs from the draft in its input there (all of them when every draft
        matched): what sampling one position at a time would have produced, since a position's
        token depends only on its logits and its position. Returns ([N] each request's first row,
        [N] tokens kept, the kept tokens in order)."""
        per = inputs.num_drafts + 1
        first = np.cumsum(per) - per  # [N]
        offsets = inputs.sample_offsets  # [M]
        rows = inputs.sample_rows
        drafts = self.batch.token_ids[rows, self.batch.num_tokens[rows] + offsets]  # [M] the input after each
        owner, _ = ragged(per)
        ends_here = (token_ids != drafts) | (offsets == inputs.num_drafts[owner])  # a miss, or the last row
        stop = np.minimum.reduceat(np.where(ends_here, offsets, np.iinfo(np.int64).max), first)  # [N]
        kept = offsets <= stop[owner]
        return first, stop + 1, token_ids[kept]


def _drafts_as_decode_rows(num_drafts: np.ndarray, counts: np.ndarray, computed: np.ndarray, seq_lens: np.ndarray,
                           block_tables: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The attention's view of a step with draft tokens: each request with drafts as ``1 + k``
    sequences of one query token each (its last token, then each draft, over its causal prefix,
    the same block table), the others as scheduled. Every backend then computes a draft's position
    exactly as a decode step would compute that token alone, so verifying drafts samples what
    one-token steps sample (fp32: bit for bit), and the CPU kernel reads such a request's K/V once
    for all its rows (rows sharing a first block form one work item). Returns (query_start_loc,
    seq_lens, block_tables, max_query_len) over those sequences; the tokens keep their order."""
    split = num_drafts > 0  # [S]
    pieces = np.where(split, counts, 1)  # [S] attention sequences each request becomes
    owner, within = ragged(pieces)  # [S'] the request of each, 0 .. k for split ones
    query_lens = np.where(split[owner], 1, counts[owner])
    query_start_loc = np.zeros(len(owner) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    lens = np.where(split[owner], computed[owner] + within + 1, seq_lens[owner])
    return query_start_loc, lens, block_tables[owner], int(query_lens.max())


def _per_row(lists: list[tuple[int, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """(the batch row of each entry, the entries) of some rows' id arrays, concatenated."""
    counts = [len(ids) for _, ids in lists]
    return np.repeat(np.array([i for i, _ in lists], dtype=np.int64), counts), np.concatenate([ids for _, ids in lists])


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """One host→device copy (a zero-copy view on the CPU).

    Elsewhere the array is first copied into pinned (page-locked) host memory, so the device copy
    is a true asynchronous DMA on the current stream, ordered before the kernels that read it;
    torch's caching host allocator keeps the pinned block from reuse until that copy completes,
    and the numpy array may change at once (the pinned copy is what travels).
    """
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
