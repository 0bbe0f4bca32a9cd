"""A run's export is usable on its own: the tokenizer is saved beside the weights, `AutoTokenizer` loads it and
encodes exactly as training did, and `pipeline("text-generation")` generates from the directory."""

import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, pipeline

from pipelines.cli import main
from preinfer.run_dir import RunDir
from pipelines.data.tokenizers import ByteTokenizer, load_tokenizer

TEXTS = ["hello world", "Grüße, 日本語 and 🙂 emoji", "", "a<eos>b<pad>c", "  tabs\tand\nnewlines\r\n\x00",
         "\u2028\ufeff zero-width\u200b"]
TINY = ["--model", "tiny-llama", "--seq-len", "32", "--batch-size", "4", "--steps-per-visit", "2",
        "--eval-tokens", "128", "--lr", "1e-3", "--blocks", "2", "--seed", "0"]


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory, corpus) -> str:
    """A small BPE tokenizer trained here on the corpus (no downloads), saved as an HF tokenizer directory: the 256
    bytes and two special tokens, which fit the presets' 258-row embedding (byte-level, so it needs no <unk>)."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train([corpus], trainer)
    directory = tmp_path_factory.mktemp("hf-tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>",
                            eos_token="<eos>").save_pretrained(directory)
    return str(directory)


def assert_encodes_like(export, tokenizer) -> None:
    loaded = AutoTokenizer.from_pretrained(export)
    for text in [*TEXTS, "Paragraph 3: word7 word14"]:
        assert loaded.encode(text, add_special_tokens=False) == tokenizer.encode(text), text
    assert (loaded.eos_token_id, loaded.pad_token_id, len(loaded)) == (
        tokenizer.eos_id, tokenizer.pad_id, tokenizer.vocab_size)


def assert_generates(export, tokenizer, prompt: str = "Paragraph 1: word") -> None:
    """The pipeline's greedy continuation is the model's own from our tokenizer's ids."""
    generate = pipeline("text-generation", model=str(export), device="cpu")
    out = generate(prompt, max_new_tokens=4, do_sample=False, return_tensors=True)
    ids = torch.tensor([tokenizer.encode(prompt)])
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert list(out[0]["generated_token_ids"]) == expected[0].tolist()
    assert len(expected[0]) == len(ids[0]) + 4


def run_cli(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def test_the_byte_tokenizer_saved_for_hf_encodes_and_decodes_exactly(tmp_path):
    ours = ByteTokenizer()
    ours.save(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        ids = loaded.encode(text, add_special_tokens=False)
        assert ids == ours.encode(text) == list(text.encode("utf-8")), text
        assert loaded.decode(ids) == text
    assert loaded.encode("", add_special_tokens=False) == []
    assert (loaded.pad_token_id, loaded.eos_token_id, len(loaded)) == (ours.pad_id, ours.eos_id, ours.vocab_size)
    rng = random.Random(0)  # bad UTF-8 and special ids decode as our decode does
    for _ in range(300):
        ids = [rng.randrange(258) for _ in range(rng.randrange(10))]
        assert loaded.decode(ids, skip_special_tokens=True) == ours.decode(ids), ids


@pytest.mark.slow
def test_a_byte_tokenizer_run_exports_a_runnable_model(tmp_path, corpus):
    out = tmp_path / "run"
    assert run_cli(["bcd", *TINY, "--data", corpus, "--out", str(out)]) == 0
    export = RunDir(out).export
    assert_encodes_like(export, ByteTokenizer())
    assert_generates(export, ByteTokenizer())


@pytest.mark.slow
def test_an_hf_tokenizer_run_exports_its_tokenizer(tmp_path, corpus, hf_tokenizer_dir):
    out = tmp_path / "run"
    assert run_cli(["bcd", *TINY, "--data", corpus, "--tokenizer", hf_tokenizer_dir, "--out", str(out)]) == 0
    export = RunDir(out).export
    tokenizer = load_tokenizer(hf_tokenizer_dir)
    assert_encodes_like(export, tokenizer)
    assert_generates(export, tokenizer)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["byte", "hf"])
def test_train_from_a_store_exports_the_tokenizer_the_store_was_made_with(tmp_path, corpus, hf_tokenizer_dir, kind):
    from preinfer.presets import build_preset

    model_dir = tmp_path / "model"
    build_preset("tiny-llama", seed=3).save_pretrained(model_dir)
    spec = "byte" if kind == "byte" else hf_tokenizer_dir
    cache = tmp_path / "cache"
    assert run_cli(["cache", "--model", str(model_dir), "--data", corpus, "--boundary", "2", "--out", str(cache),
                    "--seq-len", "32", "--samples-per-shard", "8", "--tokenizer", spec, "--quiet"]) == 0
    train = ["train", "--store", str(cache), "--model", str(model_dir), "--batch-size", "4", "--steps-per-visit",
             "2", "--lr", "1e-3", "--blocks", "1"]
    assert run_cli([*train, "--tokenizer", spec, "--out", str(tmp_path / "run")]) == 0
    export = RunDir(tmp_path / "run").export
    assert_encodes_like(export, load_tokenizer(spec))
    assert_generates(export, load_tokenizer(spec))
    if kind == "hf":  # trained with another tokenizer than the store's: the export says what is missing
        assert run_cli([*train, "--out", str(tmp_path / "unnamed")]) == 2  # auto: the model directory has none
        assert run_cli([*train, "--tokenizer", "byte", "--out", str(tmp_path / "unnamed")]) == 0
        unnamed = RunDir(tmp_path / "unnamed").export
        assert (unnamed / "model.safetensors").is_file() and not (unnamed / "tokenizer.json").exists()
        assert "tokenizer" in (unnamed / "README.md").read_text()
