"""Our model definitions against transformers: logits at every position, packing, errors."""

from __future__ import annotations

import pytest
import torch

from paged_kernels.reference import ref_paged_attention, ref_reshape_and_cache
from worker.factories import make_hf_config, make_hf_model, random_prompts, save_hf_model
from worker_service.kv_cache import allocate_kv_caches
from worker_service.loader import choose_dtype, describe_auto_dtype, load_model
from worker_service.models import UnsupportedModelError, model_class_for
from worker_service.models.layers import AttentionMetadata, ForwardContext

BLOCK_SIZE = 4


def forward_packed(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Prefill all prompts in one packed forward pass; logits at every position of each."""
    cfg = model.cfg
    kv = allocate_kv_caches(cfg, num_blocks=200, block_size=BLOCK_SIZE, dtype=torch.float32, device=torch.device("cpu"))
    max_blocks = max(-(-len(p) // BLOCK_SIZE) for p in prompts)
    block_tables = torch.zeros(len(prompts), max_blocks, dtype=torch.int32)
    slots, positions, next_block = [], [], 1
    for s, p in enumerate(prompts):
        n = -(-len(p) // BLOCK_SIZE)
        block_tables[s, :n] = torch.arange(next_block, next_block + n)
        next_block += n
        for pos in range(len(p)):
            slots.append(int(block_tables[s, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
            positions.append(pos)
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
    qsl = torch.zeros(len(prompts) + 1, dtype=torch.int32)
    qsl[1:] = lens.cumsum(0)
    meta = AttentionMetadata(torch.tensor(slots), block_tables, qsl, lens, int(lens.max()), int(lens.max()))
    ctx = ForwardContext(meta, kv, ref_reshape_and_cache, ref_paged_attention)
    with torch.inference_mode():
        hidden = model(torch.tensor([t for p in prompts for t in p]), torch.tensor(positions), ctx)
        logits = model.compute_logits(hidden)
    return list(logits.split(lens.tolist()))


def hf_logits(hf_model, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([prompt])).logits[0].float()


CASES = {
    "llama-untied": dict(family="llama"),
    "llama-tied": dict(family="llama", tie_word_embeddings=True),
    "llama-mha-headdim": dict(family="llama", num_key_value_heads=4, head_dim=32),
    "llama3-rope": dict(family="llama", rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 64}),
    "linear-rope": dict(family="llama", rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "qwen2-bias": dict(family="qwen2"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers_at_every_position(case):
    hf = make_hf_model(**CASES[case])
    ours = load_model("tiny", hf_model=hf, max_positions=256, dtype="float32").model
    prompts = random_prompts([1, 7, 33, 80])
    for prompt, logits in zip(prompts, forward_packed(ours, prompts)):
        expected = hf_logits(hf, prompt)
        assert torch.allclose(logits, expected, atol=1e-4, rtol=1e-4), (logits - expected).abs().max()
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_packing_does_not_change_a_sequence():
    ours = load_model("tiny", hf_model=make_hf_model(), max_positions=256, dtype="float32").model
    prompts = random_prompts([5, 40, 12], seed=3)
    together = forward_packed(ours, prompts)
    for prompt, logits in zip(prompts, together):
        assert torch.allclose(forward_packed(ours, [prompt])[0], logits, atol=1e-5)


def test_loads_a_saved_folder_and_reports_eos(tmp_path):
    path = save_hf_model(tmp_path / "tiny", "qwen2")
    loaded = load_model(str(path))
    assert type(loaded.model).__name__ == "Qwen2ForCausalLM"
    assert loaded.eos_token_ids == (2,)
    assert loaded.dtype == choose_dtype("auto", torch.device("cpu")).dtype
    assert loaded.model.embed.weight.dtype == loaded.dtype


@pytest.mark.parametrize("flags, dtype, reason", [
    ({"avx512f", "avx512_bf16"}, torch.bfloat16, "avx512_bf16"),
    ({"amx_tile", "amx_bf16"}, torch.bfloat16, "amx_bf16"),
    ({"avx2", "avx512f", "avx512_vnni"}, torch.float32, "neither amx_bf16 nor avx512_bf16"),
])
def test_auto_dtype_on_the_cpu_follows_its_bf16_flags(monkeypatch, flags, dtype, reason):
    from paged_kernels import native

    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset(flags))
    choice = choose_dtype("auto", torch.device("cpu"))
    assert choice.dtype == dtype and reason in choice.reason
    assert f"here: {choice.name}" in describe_auto_dtype(torch.device("cpu"))  # what --help says
    assert choose_dtype("float32", torch.device("cpu")).dtype == torch.float32  # named: taken as is


def test_worker_help_says_what_auto_picks_here():
    from worker_service.main import build_parser

    help_text = " ".join(build_parser({}).format_help().split())
    assert describe_auto_dtype() in help_text
    if not torch.cuda.is_available():
        assert f"here: {choose_dtype('auto', torch.device('cpu')).name}" in help_text


def test_unsupported_architecture_is_named(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model(str(tmp_path))


def test_unsupported_rope_type_is_named():
    config = make_hf_config(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        model_class_for(config).config_from_hf(config)


def test_sliding_window_qwen2_is_refused():
    config = make_hf_config("qwen2", use_sliding_window=True, sliding_window=16)
    with pytest.raises(UnsupportedModelError, match="sliding"):
        model_class_for(config).config_from_hf(config)


def test_checkpoint_with_unknown_tensors_is_refused():
    hf = make_hf_model()
    ours = load_model("tiny", hf_model=hf).model
    state = dict(hf.state_dict())
    state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    with pytest.raises(UnsupportedModelError, match="q_norm"):
        ours.load_hf_state_dict(state)
