"""``servicekit.gguf_cache``: a GGUF checkpoint converted once into a Hugging Face folder gives the
same tokenizer and weights as reading the file itself; later loads read the folder; a changed file
gets a new folder; an unwritable or disabled cache falls back to the file."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from servicekit import gguf_cache
from servicekit.gguf_cache import hf_folder
from servicekit.model_registry import ModelSource, resolve_model

TEXTS = ["the cat in a hat", " leading space, tabs\tand\nnewlines", "ünïcödé ✓ 漢字 🙂", "<|im_start|>x<|im_end|>", ""]


def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: one printable character per byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = dict(zip(printable, map(chr, printable)))
    extra = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_tiny_gguf(path, seed: int = 0) -> None:
    """A 2-layer Llama as GGUF: a byte-level BPE vocabulary with a few merges and a chat template,
    F32 tensors and Q8_0 ones (dequantized on load)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_chars(), *(m.replace(" ", "") for m in merges)]
    vocab, hidden, inter, heads, kv_heads = len(tokens), 64, 128, 4, 2
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(2)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

    def tensor(name: str, shape: tuple[int, ...], quantized: bool = False) -> None:
        values = (rng.standard_normal(shape) * 0.5).astype(np.float32)
        if quantized:
            writer.add_tensor(name, quantize(values, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, values)

    tensor("token_embd.weight", (vocab, hidden))
    tensor("output_norm.weight", (hidden,))
    tensor("output.weight", (vocab, hidden))
    kv = kv_heads * hidden // heads
    for i in range(2):
        tensor(f"blk.{i}.attn_norm.weight", (hidden,))
        tensor(f"blk.{i}.ffn_norm.weight", (hidden,))
        tensor(f"blk.{i}.attn_q.weight", (hidden, hidden), quantized=True)
        tensor(f"blk.{i}.attn_k.weight", (kv, hidden), quantized=True)
        tensor(f"blk.{i}.attn_v.weight", (kv, hidden))
        tensor(f"blk.{i}.attn_output.weight", (hidden, hidden))
        tensor(f"blk.{i}.ffn_gate.weight", (inter, hidden), quantized=True)
        tensor(f"blk.{i}.ffn_up.weight", (inter, hidden))
        tensor(f"blk.{i}.ffn_down.weight", (hidden, inter))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch) -> ModelSource:
    """The tiny GGUF file, and an empty model cache of this test's own."""
    pytest.importorskip("gguf")
    folder = tmp_path / "gguf"
    folder.mkdir()
    write_tiny_gguf(folder / "tiny.gguf")
    monkeypatch.setenv(gguf_cache.CACHE_ENV, str(tmp_path / "cache"))
    return resolve_model(str(folder / "tiny.gguf"))


def test_the_cached_tokenizer_is_the_files_own(tiny_gguf):
    from transformers import AutoTokenizer

    from gateway_service.text import load_tokenizer

    direct = AutoTokenizer.from_pretrained(tiny_gguf.path, **tiny_gguf.from_pretrained_kwargs())
    cached_source = hf_folder(tiny_gguf, weights=False)
    assert cached_source.gguf_file is None and cached_source.name == tiny_gguf.name
    assert os.path.dirname(cached_source.path).startswith(os.environ[gguf_cache.CACHE_ENV])
    cached = load_tokenizer(os.path.join(tiny_gguf.path, tiny_gguf.gguf_file))  # the gateway's way: the cache
    for text in TEXTS:
        ids = direct.encode(text)
        assert cached.encode(text) == ids, text
        assert cached.decode(ids) == direct.decode(ids)
        assert cached.decode(ids, skip_special_tokens=True) == direct.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "in a hat"}]
    assert (cached.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == direct.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(cached, name) == getattr(direct, name), name
    assert len(cached) == len(direct)


def test_the_cached_weights_are_the_files_dequantized_ones(tiny_gguf):
    from transformers import AutoModelForCausalLM

    from worker_service.loader import load_model

    direct = AutoModelForCausalLM.from_pretrained(tiny_gguf.path, dtype=torch.float32,
                                                  **tiny_gguf.from_pretrained_kwargs())
    loaded = load_model(tiny_gguf, dtype="float32")  # the worker's way: converted into the cache, read from it
    assert loaded.source.gguf_file is None and loaded.source.name == tiny_gguf.name
    cached = AutoModelForCausalLM.from_pretrained(loaded.source.path, dtype=torch.float32)
    want, got = direct.state_dict(), cached.state_dict()
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key
    assert loaded.eos_token_ids == (2,)
    ids = torch.tensor([[1, 86, 260, 223, 69]])
    assert torch.equal(direct(ids).logits, cached(ids).logits)


def test_later_loads_read_the_folder_and_a_changed_file_gets_its_own(tiny_gguf, monkeypatch):
    first = hf_folder(tiny_gguf, weights=False)
    monkeypatch.setattr(gguf_cache, "_convert", lambda *a, **k: pytest.fail("converted again"))
    assert hf_folder(tiny_gguf, weights=False) == first
    path = os.path.join(tiny_gguf.path, tiny_gguf.gguf_file)
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # the file replaced
    converted = []
    monkeypatch.setattr(gguf_cache, "_convert", lambda source, folder, weights: (converted.append(folder),
                                                                                 folder.mkdir()))
    again = hf_folder(tiny_gguf, weights=False)
    assert again.path != first.path and converted == [Path(again.path)]


def test_processes_asking_together_convert_once(tiny_gguf, monkeypatch):
    calls = []

    def slow_convert(source, folder, *, weights):
        calls.append(folder)
        time.sleep(0.3)
        folder.mkdir()

    monkeypatch.setattr(gguf_cache, "_convert", slow_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(hf_folder(tiny_gguf, weights=True))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len({r.path for r in results}) == 1 and len(results) == 3


def test_a_failed_conversion_leaves_nothing_half_written(tiny_gguf, monkeypatch):
    from transformers import AutoTokenizer

    def broken(*args, **kwargs):
        raise ValueError("not a tokenizer transformers knows")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", broken)
    with pytest.raises(ValueError, match="transformers knows"):
        hf_folder(tiny_gguf, weights=False)
    root = os.environ[gguf_cache.CACHE_ENV]
    leftovers = [name for _dir, dirs, _files in os.walk(root) for name in dirs]
    assert leftovers == [gguf_cache.cache_key(Path(tiny_gguf.path, tiny_gguf.gguf_file))]  # no part, no temporary


def test_an_unwritable_or_disabled_cache_loads_the_file_itself(tiny_gguf, monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(gguf_cache.CACHE_ENV, str(blocker / "cache"))  # under a file: cannot be made
    with caplog.at_level(logging.WARNING, logger="servicekit.gguf_cache"):
        assert hf_folder(tiny_gguf, weights=True) == tiny_gguf
    assert "cannot use the model cache" in caplog.text
    monkeypatch.setenv(gguf_cache.CACHE_ENV, "off")
    assert gguf_cache.cache_root() is None and hf_folder(tiny_gguf, weights=False) == tiny_gguf
    folder = ModelSource(name="hf", path=str(tmp_path))
    monkeypatch.delenv(gguf_cache.CACHE_ENV)
    assert hf_folder(folder, weights=True) is folder  # not a GGUF file: as it is


def test_the_command_converts_ahead_of_the_first_start(tiny_gguf, capsys, tmp_path):
    path = os.path.join(tiny_gguf.path, tiny_gguf.gguf_file)
    assert gguf_cache.main([path, "--tokenizer-only"]) == 0
    folder = capsys.readouterr().out.strip()
    assert folder == hf_folder(tiny_gguf, weights=False).path and os.path.isfile(os.path.join(folder, "tokenizer.json"))
    assert oct(os.stat(folder).st_mode & 0o777) == oct(0o755)  # others may read an image's cache made as root
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert gguf_cache.main([str(tmp_path / "hf")]) == 0
    assert "not a GGUF checkpoint" in capsys.readouterr().out
