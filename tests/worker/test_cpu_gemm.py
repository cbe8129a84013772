"""bf16 linear weights laid out once for oneDNN (``worker_service.models.cpu_gemm``): the same tokens
as ``F.linear``, bit for bit, and nothing packed where it would change results (fp32) or cannot run;
with the small-batch AMX GEMM (``small_gemm``) beside it, steps of up to its row limit on its tiles
(the MLP's gate/up projection with SiLU * up in the same pass)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paged_kernels import small_gemm
from worker.factories import make_hf_model, make_runner, new_req, random_prompts, step
from worker_service.models import cpu_gemm
from worker_service.models.cpu_gemm import PackedLinear

pytestmark = pytest.mark.skipif(not cpu_gemm.supported(torch.bfloat16, torch.device("cpu")),
                                reason="oneDNN's packed bf16 GEMM does not run here (this torch build or this CPU)")


@pytest.fixture(scope="module", params=["llama-tied", "qwen2-untied"])
def hf(request):
    family, head = request.param.split("-")
    return make_hf_model(family, tie_word_embeddings=head == "tied")


def _greedy_tokens(runner, prompts, num_decodes=3):
    """Prefill all prompts in one step, then ``num_decodes`` decode steps: each request's tokens."""
    block_size, next_block, reqs = runner.block_size, 1, []
    for i, p in enumerate(prompts):
        n = -(-(len(p) + num_decodes + 1) // block_size)
        reqs.append(new_req(f"r{i}", p, list(range(next_block, next_block + n))))
        next_block += n
    out = runner.execute_model(step(reqs, num_scheduled={r.request_id: len(r.prompt_token_ids) for r in reqs}))
    tokens = {rid: list(t) for rid, t in out.sampled_token_ids.items()}
    for k in range(num_decodes):
        cached = [(r.request_id, [], len(r.prompt_token_ids) + k) for r in reqs]
        out = runner.execute_model(step([], cached, num_scheduled={r.request_id: 1 for r in reqs}))
        for rid, t in out.sampled_token_ids.items():
            tokens[rid] += t
    return tokens


def test_packed_bf16_linears_give_the_same_tokens_bit_for_bit(hf):
    plain = make_runner(hf, dtype="bfloat16", attention_backend="cpu", prepack_weights=False)
    packed = make_runner(hf, dtype="bfloat16", attention_backend="cpu", prepack_weights=True, small_gemm=False)
    assert plain.num_packed_linears == 0
    # qkv, o, gate_up, down per layer, and the LM head's packed copy (its plain weight stays)
    assert packed.num_packed_linears == 4 * len(packed.model.layers) + 1
    assert isinstance(packed.model.layers[0].attn.qkv, PackedLinear)
    assert isinstance(packed.model.head_gemm, PackedLinear) and plain.model.head_gemm is None

    x = torch.randn(5, packed.model.cfg.hidden_size).to(torch.bfloat16)
    with torch.inference_mode():
        for name in ("qkv", "o"):
            a, b = getattr(plain.model.layers[1].attn, name), getattr(packed.model.layers[1].attn, name)
            inp = x if name == "qkv" else torch.randn(5, a.in_features).to(torch.bfloat16)
            assert torch.equal(a(inp), b(inp))
        layer_in = torch.randn(7, packed.model.cfg.hidden_size).to(torch.bfloat16)
        assert torch.equal(plain.model.layers[0].mlp(layer_in), packed.model.layers[0].mlp(layer_in))
        hidden = torch.randn(4, packed.model.cfg.hidden_size).to(torch.bfloat16)
        assert torch.equal(plain.model.compute_logits(hidden), packed.model.compute_logits(hidden))

    prompts = random_prompts([9, 4, 17], seed=3)
    got, expected = _greedy_tokens(packed, prompts), _greedy_tokens(plain, prompts)
    assert got == expected and all(len(t) == 4 for t in got.values())


def test_fp32_is_never_packed(hf):
    runner = make_runner(hf, dtype="float32", attention_backend="cpu", prepack_weights=True)
    assert runner.num_packed_linears == 0
    assert isinstance(runner.model.layers[0].mlp.down, nn.Linear) and runner.model.head_gemm is None


def test_a_build_whose_packed_gemm_disagrees_keeps_f_linear(monkeypatch):
    layers = nn.ModuleList([nn.Linear(8, 8).to(torch.bfloat16)])
    monkeypatch.setattr(cpu_gemm, "_agrees", lambda linear, packed: False)
    assert cpu_gemm.prepack_linears(layers) == 0
    assert isinstance(layers[0], nn.Linear)


def test_row_counts_are_padded_to_few_buckets():
    """oneDNN keeps a compiled primitive per GEMM shape: rows go up to a bucket (8s up to 128, then
    an eighth of the power of two below), so a worker meets a few dozen shapes, not one per step's
    token count, and never computes more than 12.5 % extra rows past 128."""
    assert [cpu_gemm.padded_rows(n) for n in (0, 1, 8, 9, 128, 129, 300, 2000, 2048)] == [
        0, 8, 8, 16, 128, 144, 320, 2048, 2048]
    buckets = {cpu_gemm.padded_rows(n) for n in range(1, 2049)}
    assert len(buckets) <= 48
    assert all(cpu_gemm.padded_rows(n) <= max(n * 1.125, n + 7) for n in range(1, 4097))


def test_a_packed_model_pads_its_rows_and_the_tokens_stay_the_same(hf):
    """The padding rows of a forward pass are dead tokens: the same tokens come out as with a
    model that pads nothing (prefill chunks and decodes of a few rows, none a bucket's size)."""
    padded = make_runner(hf, dtype="bfloat16", attention_backend="cpu", prepack_weights=True, small_gemm=False)
    unpadded = make_runner(hf, dtype="bfloat16", attention_backend="cpu", prepack_weights=True, small_gemm=False)
    unpadded.model.pad_rows = None
    assert padded.model.pad_rows is cpu_gemm.padded_rows
    rows = []
    real = torch.ops.mkldnn._linear_pointwise
    prompts = random_prompts([9, 4, 18], seed=5)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda a, *r: rows.append(a.shape[0]) or real(a, *r))
        got = _greedy_tokens(padded, prompts)
    assert set(rows) == {32, 8}  # 31 prompt tokens, then 3 rows that sample or decode
    assert got == _greedy_tokens(unpadded, prompts)


needs_amx = pytest.mark.skipif(not small_gemm.available(), reason="no AMX-BF16 tiles on this CPU")


@needs_amx
def test_steps_up_to_the_limit_run_on_the_tile_kernel_and_larger_ones_on_onednn(hf):
    runner = make_runner(hf, dtype="bfloat16", attention_backend="cpu", prepack_weights=True)
    assert runner.small_gemm
    assert cpu_gemm.small_gemm_layers(runner.model) == 4 * len(runner.model.layers)  # the LM head keeps oneDNN
    qkv = runner.model.layers[0].attn.qkv
    with torch.inference_mode():
        limit = small_gemm.max_rows(qkv.out_features)
        assert qkv.small_rows == limit
        for rows in (1, 8, 64, 65, limit, limit + 1):
            x = torch.randn(rows, qkv.in_features).to(torch.bfloat16)
            onednn = torch.ops.mkldnn._linear_pointwise(x, qkv.packed_weight, qkv.bias, "none", [], "")
            tiles = small_gemm.linear(x, qkv.small_weight, qkv.out_features, qkv.bias)  # Qwen2's qkv has a bias
            assert torch.equal(qkv(x), tiles if rows <= limit else onednn)
            torch.testing.assert_close(tiles.float(), onednn.float(), rtol=2**-8, atol=1e-6)


@needs_amx
def test_the_gate_up_projection_computes_silu_mul_on_the_tiles(hf):
    """The MLP's gate/up weight gets the gate/up tile layout: SiLU * up in the GEMM's pass, the
    same bits as the plain tile GEMM followed by cpu_fused.silu_mul, up to the kernel's rows; its
    plain forward (and larger steps) run on oneDNN."""
    from paged_kernels import cpu_fused

    runner = make_runner(hf, dtype="bfloat16", attention_backend="cpu", prepack_weights=True)
    gate_up = runner.model.layers[0].mlp.gate_up
    assert gate_up.fused_silu_mul and not runner.model.layers[0].attn.qkv.fused_silu_mul
    with torch.inference_mode():
        eye = torch.eye(gate_up.in_features).to(torch.bfloat16)  # the plain weight back from oneDNN's copy
        weight = torch.ops.mkldnn._linear_pointwise(eye, gate_up.packed_weight, None, "none", [], "").T.contiguous()
        plain = small_gemm.pack(weight)
        for rows in (1, 8, 64, 65, gate_up.small_rows, gate_up.small_rows + 1):
            x = torch.randn(rows, gate_up.in_features).to(torch.bfloat16)
            onednn = torch.ops.mkldnn._linear_pointwise(x, gate_up.packed_weight, None, "none", [], "")
            assert torch.equal(gate_up(x), onednn)
            fused = gate_up.silu_mul(x)
            if rows > gate_up.small_rows:
                assert fused is None
                continue
            expected = cpu_fused.silu_mul(small_gemm.linear(x, plain, gate_up.out_features))
            assert torch.equal(fused.view(torch.int16), expected.view(torch.int16))


@needs_amx
def test_with_the_tile_kernel_a_request_decodes_the_same_alone_and_in_a_batch(hf):
    """Every step here is within the kernel's rows: each row's GEMMs, norms and attention are its
    own, and greedy picks from logits whose top is recomputed in fp32; so a request's tokens do not
    depend on the batch it is in."""
    runner = make_runner(hf, dtype="bfloat16", attention_backend="cpu", prepack_weights=True)
    prompts = random_prompts([9, 4, 17], seed=3)
    together = _greedy_tokens(runner, prompts, num_decodes=6)
    for i, prompt in enumerate(prompts):
        assert _greedy_tokens(runner, [prompt], num_decodes=6)["r0"] == together[f"r{i}"]


def test_without_amx_the_layers_keep_onednn(hf, monkeypatch):
    monkeypatch.setattr(small_gemm, "available", lambda: False)
    runner = make_runner(hf, dtype="bfloat16", attention_backend="cpu", prepack_weights=True)
    assert runner.num_packed_linears and not runner.small_gemm
    assert cpu_gemm.small_gemm_layers(runner.model) == 0


def test_the_tile_kernel_can_be_turned_off(hf):
    runner = make_runner(hf, dtype="bfloat16", attention_backend="cpu", prepack_weights=True, small_gemm=False)
    assert runner.num_packed_linears and not runner.small_gemm


def test_no_tile_copy_where_it_would_crowd_memory(hf, monkeypatch, caplog):
    """The copy is made only while it takes at most SMALL_GEMM_MEMORY_SHARE of the memory available."""
    monkeypatch.setattr(small_gemm, "available", lambda: True)
    monkeypatch.setattr(cpu_gemm, "_available_bytes", lambda: 1000)  # far less than the weights
    with caplog.at_level("WARNING", logger=cpu_gemm.__name__):
        runner = make_runner(hf, dtype="bfloat16", attention_backend="cpu", prepack_weights=True)
    assert runner.num_packed_linears and not runner.small_gemm
    assert "keep oneDNN alone" in caplog.text
