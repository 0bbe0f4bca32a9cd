"""Fine-tuning a checkpoint the way its users do: the model's own tokenizer (`--tokenizer auto`), its special tokens,
chat data rendered by its chat template with the loss on the assistant turns only, and an export that chats."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, pipeline

from tests.helpers.chat_templates import CHATML, SPECIALS, TEMPLATES, save_tokenizer
from tests.helpers.cli_run import run_cli
from pipelines.data.chat import render_conversations
from pipelines.data.conversations import Conversation
from pipelines.data.sample_blocks import IGNORE_INDEX
from pipelines.data.samples import encode_chunk
from pipelines.data.in_memory import load_data
from pipelines.data.tokenizer_choice import choose_tokenizer
from pipelines.data.tokenizers import load_tokenizer
from preinfer.errors import UsageError
from preinfer.presets import PRESETS

CONVERSATION = Conversation((("system", "Be brief."), ("user", "Hi there"), ("assistant", " Hello! "),
                             ("user", "What is 2+2?"), ("assistant", "4")))
# (instruction, input, output): the Alpaca form of one user turn and one assistant turn
EXAMPLES = [(f"Say the number {i}", "in words" if i % 2 else "", f"number {i} it is") for i in range(40)]


def user_text(instruction: str, input_text: str) -> str:
    return f"{instruction}\n\n{input_text}" if input_text else instruction


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def masked_runs(tokens, backend) -> list[str]:
    """The text of each run of consecutive masked tokens."""
    runs, current = [], []
    for token, on in zip(tokens.ids.tolist(), tokens.mask.tolist()):
        if on:
            current.append(token)
        elif current:
            runs.append(backend.decode(current)), current.clear()
    return runs + ([backend.decode(current)] if current else [])


def one_line_refusal(err: str, words: str) -> bool:
    """The refusal is stderr's one line of our own (transformers' loading bars may come before it)."""
    ours = [line for line in err.strip().splitlines() if line.startswith("preinfer") or "Error" in line]
    return len(ours) == 1 and words in ours[0] and ours[0] == err.strip().splitlines()[-1]


# ---- assistant masks ----


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_the_published_templates_mask_exactly_the_assistant_turns_as_transformers_does(tmp_path, name):
    """Rendered turn by turn, each published template masks the tokens transformers' own
    `return_assistant_tokens_mask` masks on its {% generation %} twin, and those are each assistant turn's content
    and end-of-turn token: nothing of the system or user turns, the assistant header or the separator after."""
    template, marked, end_of_turn, trims = TEMPLATES[name]
    bos = "<|begin_of_text|>" if name == "llama3" else None
    tokenizer = load_tokenizer(str(save_tokenizer(tmp_path / name, template, bos=bos)))
    ours = render_conversations(tokenizer, [CONVERSATION])[0]
    twin = AutoTokenizer.from_pretrained(save_tokenizer(tmp_path / f"{name}-marked", marked, bos=bos))
    theirs = twin.apply_chat_template(CONVERSATION.messages(), tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
    assert ours.ids.tolist() == theirs["input_ids"]
    assert ours.mask.tolist() == theirs["assistant_masks"]
    replies = [content.strip() if trims else content for role, content in CONVERSATION.turns if role == "assistant"]
    assert masked_runs(ours, tokenizer.backend) == [reply + end_of_turn for reply in replies]
    mask = ours.mask.tolist()
    assert list(ours.ends) == [i + 1 for i, on in enumerate(mask) if on and (i + 1 == len(mask) or not mask[i + 1])]


def test_a_template_that_marks_generation_gets_transformers_own_mask(tmp_path):
    _, marked, _, _ = TEMPLATES["chatml"]
    directory = save_tokenizer(tmp_path / "marked", marked)
    ours = render_conversations(load_tokenizer(str(directory)), [CONVERSATION])[0]
    theirs = AutoTokenizer.from_pretrained(directory).apply_chat_template(
        CONVERSATION.messages(), return_dict=True, return_assistant_tokens_mask=True)
    assert (ours.ids.tolist(), ours.mask.tolist()) == (theirs["input_ids"], theirs["assistant_masks"])


def test_chat_template_file_overrides_the_tokenizer_s_own(tmp_path):
    directory = save_tokenizer(tmp_path / "tok", TEMPLATES["llama3"][0], bos="<|begin_of_text|>")
    (tmp_path / "chatml.jinja").write_text(CHATML)
    tokenizer = load_tokenizer(str(directory), str(tmp_path / "chatml.jinja"))
    assert tokenizer.chat_template == CHATML
    assert tokenizer.fingerprint() != load_tokenizer(str(directory)).fingerprint()
    tokens = render_conversations(tokenizer, [CONVERSATION])[0]
    assert masked_runs(tokens, tokenizer.backend) == [" Hello! <|im_end|>", "4<|im_end|>"]


# ---- records ----


def test_messages_sharegpt_and_alpaca_records_give_identical_samples(tmp_path):
    tokenizer = load_tokenizer(str(save_tokenizer(tmp_path / "tok", CHATML)))
    messages = write_jsonl(tmp_path / "messages.jsonl", [
        {"messages": [{"role": "user", "content": user_text(i, x)}, {"role": "assistant", "content": o}]}
        for i, x, o in EXAMPLES])
    sharegpt = write_jsonl(tmp_path / "sharegpt.jsonl", [
        {"conversations": [{"from": "human", "value": user_text(i, x)}, {"from": "gpt", "value": o}]}
        for i, x, o in EXAMPLES])
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": i, "input": x, "output": o}
                                                     for i, x, o in EXAMPLES])
    for split in ("train", "eval"):
        samples = [load_data(spec, tokenizer, 64, split, eval_fraction=0.25) for spec in (messages, sharegpt, alpaca)]
        for other in samples[1:]:
            for field in ("input_ids", "attention_mask", "labels"):
                assert torch.equal(samples[0][:][field], other[:][field]), (split, field)
    first = samples[0][0]
    supervised = first["labels"][first["labels"] != IGNORE_INDEX].tolist()
    text = tokenizer.backend.decode(first["input_ids"][0][first["attention_mask"][0]].tolist())
    assert tokenizer.backend.decode(supervised).endswith("<|im_end|>") and tokenizer.backend.decode(supervised) in text
    assert 0 < len(supervised) < int(first["attention_mask"].sum())


def test_multi_turn_messages_and_sharegpt_records_give_identical_samples(tmp_path):
    tokenizer = load_tokenizer(str(save_tokenizer(tmp_path / "tok", TEMPLATES["qwen2"][0])))
    sharegpt_role = {"system": "system", "user": "human", "assistant": "gpt"}
    messages = write_jsonl(tmp_path / "messages.jsonl", [{"messages": CONVERSATION.messages()}] * 3)
    sharegpt = write_jsonl(tmp_path / "sharegpt.jsonl", [
        {"conversations": [{"from": sharegpt_role[role], "value": content} for role, content in CONVERSATION.turns]}
    ] * 3)
    a, b = (load_data(spec, tokenizer, 160, "train", eval_fraction=0.0)[:] for spec in (messages, sharegpt))
    assert all(torch.equal(a[field], b[field]) for field in a)
    expected = render_conversations(tokenizer, [CONVERSATION])[0]
    length = len(expected.ids)
    assert a["input_ids"][0, :length].tolist() == expected.ids.tolist()
    assert (a["labels"][0, :length] != IGNORE_INDEX).tolist() == expected.mask.astype(bool).tolist()
    assert (a["input_ids"][0, length:] == tokenizer.pad_id).all() and not a["attention_mask"][0, length:].any()


@pytest.mark.parametrize("record, problem", [
    ({"messages": [{"role": "robot", "content": "x"}]}, "'role' must be one of system, user, assistant"),
    ({"messages": []}, "non-empty list"),
    ({"conversations": [{"from": "gpt", "value": 3}]}, "'value' must be a string"),
])
def test_a_bad_chat_record_is_refused_in_one_line_naming_its_line(tmp_path, record, problem):
    tokenizer = load_tokenizer(str(save_tokenizer(tmp_path / "tok", CHATML)))
    spec = write_jsonl(tmp_path / "bad.jsonl", [{"messages": CONVERSATION.messages()}, record])
    with pytest.raises(UsageError) as error:
        load_data(spec, tokenizer, 160, "train", eval_fraction=0.0)
    assert "bad.jsonl:2" in str(error.value) and problem in str(error.value) and "\n" not in str(error.value)


def test_without_a_template_alpaca_keeps_the_instruction_format_and_conversations_need_one(tmp_path):
    tokenizer = load_tokenizer("byte")
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": i, "input": x, "output": o}
                                                     for i, x, o in EXAMPLES])
    sample = load_data(alpaca, tokenizer, 96, "train", eval_fraction=0.0)[0]
    text = tokenizer.decode(sample["input_ids"][0].tolist())
    assert text.startswith("### Instruction:\nSay the number") and "### Response:\n" in text
    multi = write_jsonl(tmp_path / "multi.jsonl", [{"messages": CONVERSATION.messages()}])
    with pytest.raises(UsageError, match="needs a chat template"):
        load_data(multi, tokenizer, 96, "train", eval_fraction=0.0)


# ---- seq_len ----


def test_a_long_conversation_is_cut_after_its_last_fitting_assistant_turn_or_dropped(tmp_path):
    tokenizer = load_tokenizer(str(save_tokenizer(tmp_path / "tok", CHATML)))
    full = render_conversations(tokenizer, [CONVERSATION])[0]
    first_end = full.ends[0]
    late = Conversation((("user", "x" * 40), ("assistant", "late")))
    encoded = encode_chunk([CONVERSATION, late], tokenizer, first_end + 3, 0.0, ("train",))["train"]
    assert (encoded.documents, len(encoded.ids), encoded.truncated) == (2, 1, 1)
    assert encoded.lengths[0].tolist() == [0, first_end]
    assert encoded.ids[0, :first_end].tolist() == full.ids[:first_end].tolist()
    assert (encoded.ids[0, first_end:] == tokenizer.pad_id).all()
    assert tokenizer.backend.decode(encoded.ids[0][encoded.label_mask[0].astype(bool)].tolist()) == \
        " Hello! <|im_end|>"
    whole = encode_chunk([CONVERSATION], tokenizer, len(full.ids), 0.0, ("train",))["train"]
    assert (len(whole.ids), whole.truncated) == (1, 0)


# ---- special tokens ----


@pytest.mark.parametrize("bos", [None, "<s>"])
def test_bos_is_present_exactly_when_the_tokenizer_adds_it(tmp_path, bos):
    tokenizer = load_tokenizer(str(save_tokenizer(tmp_path / "tok", None, bos=bos, eos="</s>")))
    documents = ["first document", "second one", "third"]
    stream = encode_chunk(documents, tokenizer, 8, 0.0, ("train",))["train"].ids.tolist()
    prefix = [SPECIALS.index(bos)] if bos else []
    expected = [i for text in documents for i in (*prefix, *tokenizer.encode(text), tokenizer.eos_id)]
    assert stream == expected
    assert tokenizer.bos_ids == tuple(prefix)
    hf = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert hf.encode("first document") == [*prefix, *tokenizer.encode("first document")]


def test_a_template_that_writes_bos_gets_it_once(tmp_path):
    tokenizer = load_tokenizer(str(save_tokenizer(tmp_path / "tok", TEMPLATES["llama3"][0], bos="<|begin_of_text|>")))
    ids = encode_chunk([CONVERSATION], tokenizer, 128, 0.0, ("train",))["train"].ids[0].tolist()
    bos = SPECIALS.index("<|begin_of_text|>")
    assert ids[0] == bos and ids.count(bos) == 1


# ---- the tokenizer follows the model ----


def save_model(directory, tokenizer_dir=None, vocab_size: int | None = None, generation: dict | None = None):
    """A tiny Llama (the tiny-llama preset's shape) saved with save_pretrained, with the tokenizer of
    `tokenizer_dir` beside it when given."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir else None
    cls, kwargs = PRESETS["tiny-llama"]
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id) if tokenizer else {}
    config = cls(**{**kwargs, "vocab_size": vocab_size or len(tokenizer)}, **ids)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if generation:
        model.generation_config = GenerationConfig(**generation)
    model.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return str(directory)


def test_auto_takes_the_model_directory_s_tokenizer_and_the_byte_one_for_a_preset(tmp_path):
    model = save_model(tmp_path / "model", save_tokenizer(tmp_path / "tok", CHATML))
    chosen = choose_tokenizer("auto", model)
    assert chosen.tokenizer.name == model and chosen.tokenizer.chat_template == CHATML
    assert "model directory's own" in chosen.lines()[0]
    assert choose_tokenizer("auto", "tiny-llama").tokenizer.name == "byte"
    assert choose_tokenizer("byte", model).tokenizer.name == "byte"


def test_a_model_directory_without_a_tokenizer_is_refused_in_one_line(tmp_path, capsys, corpus):
    model = save_model(tmp_path / "model", vocab_size=300)
    out = tmp_path / "run"
    capsys.readouterr()
    code, _, err = run_cli(["bcd", "--model", model, "--data", corpus, "--out", str(out)], capsys)
    assert code == 2 and one_line_refusal(err, "has no tokenizer files")
    assert not out.exists()
    code, _, _ = run_cli(["bcd", "--model", model, "--tokenizer", "byte", "--data", corpus, "--seq-len", "32",
                          "--steps-per-visit", "1", "--blocks", "1", "--eval-tokens", "64", "--out", str(out)], capsys)
    assert code == 0


def test_a_tokenizer_too_large_for_the_embedding_is_refused_before_the_run_directory_exists(tmp_path, capsys, corpus):
    big = save_tokenizer(tmp_path / "big", CHATML, extra=200)
    assert len(AutoTokenizer.from_pretrained(big)) > PRESETS["tiny-llama"][1]["vocab_size"]
    out, tokens = tmp_path / "run", tmp_path / "tokens"
    code, _, err = run_cli(["bcd", "--model", "tiny-llama", "--tokenizer", str(big), "--data", corpus,
                            "--token-store", str(tokens), "--out", str(out)], capsys)
    assert code == 2 and one_line_refusal(err, "embedding")
    assert not out.exists() and not tokens.exists()


# ---- the export chats ----


def test_a_chat_fine_tuned_export_answers_messages_through_pipeline(tmp_path, capsys):
    generation = dict(max_new_tokens=6, do_sample=False, eos_token_id=SPECIALS.index("<|im_end|>"))
    model = save_model(tmp_path / "model", save_tokenizer(tmp_path / "tok", CHATML), generation=generation)
    capsys.readouterr()
    data = write_jsonl(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "user", "content": user_text(i, x)}, {"role": "assistant", "content": o}]}
        for i, x, o in EXAMPLES])
    out = tmp_path / "run"
    code, stdout, err = run_cli(["bcd", "--model", model, "--data", data, "--seq-len", "64", "--batch-size", "4",
                                 "--steps-per-visit", "2", "--blocks", "2", "--eval-tokens", "256", "--lr", "1e-3",
                                 "--out", str(out)], capsys)
    assert code == 0, err
    first = stdout.splitlines()
    assert first[0].startswith(f"tokenizer: {model} (the model directory's own")
    assert first[1] == "chat and instruction data: rendered by the tokenizer's own chat template"
    assert any(line.startswith("train: ") and "conversations" in line for line in first[:4])
    export = out / "export"
    assert AutoTokenizer.from_pretrained(export).chat_template == CHATML
    assert json.loads((export / "generation_config.json").read_text())["max_new_tokens"] == 6
    chat = pipeline("text-generation", model=str(export), device="cpu")
    reply = chat([{"role": "user", "content": "Say the number 3"}])[0]["generated_text"]
    assert reply[0] == {"role": "user", "content": "Say the number 3"}
    assert reply[-1]["role"] == "assistant" and isinstance(reply[-1]["content"], str)
    assert choose_tokenizer("auto", str(out)).tokenizer.name == model
