"""Tokenizers: the built-in byte-level one (no files) and a local Hugging Face tokenizer directory.

Special tokens are the tokenizer's own: `bos_ids` are what it puts before a text (`add_special_tokens=True`
semantics: Llama's and Mistral's BOS, nothing for GPT-2 or Qwen2), its eos ends each document and its pad token
pads (eos where it has none). Its chat template (or the one of `--chat-template FILE`) renders conversations
(`pipelines.data.chat`); of a tokenizer with named templates (tokenizer_config.json's list of {name, template}),
`default` (or the only one) unless `--chat-template-name` names another."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from preinfer.errors import UsageError
from preinfer.presets import BYTE_EOS_ID, BYTE_PAD_ID, BYTE_VOCAB_SIZE

MAX_TEMPLATE_BYTES = 256 * 1024  # the largest chat template compiled
MAX_TEMPLATE_JSON_BYTES = 64 << 20  # the largest JSON file a template is looked for in (a tokenizer_config.json)
NAME_FLAG = "--chat-template-name NAME"  # how the user names one of a tokenizer's own templates


class Tokenizer(Protocol):
    """What the data side needs from a tokenizer."""

    name: str
    vocab_size: int
    pad_id: int
    eos_id: int
    bos_ids: tuple[int, ...]  # the special tokens put before each text (empty when the tokenizer adds none)
    chat_template: str | None  # the Jinja chat template conversations are rendered with; None: no template
    chat_template_file: str | None  # the --chat-template file that overrides the tokenizer's own, if any
    chat_template_name: str | None  # the --chat-template-name of the tokenizer's named templates, if given

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without any special tokens."""
        ...

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """The ids of each text as an integer array (what `encode` gives, without a Python int per token)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens left out."""
        ...

    def fingerprint(self) -> str:
        """sha256 hex of everything that determines tokenisation."""
        ...

    def save(self, directory: Path) -> None:
        """Write Hugging Face tokenizer files into `directory`: `AutoTokenizer.from_pretrained(directory)` then
        encodes (without special tokens) exactly as `encode` does."""
        ...


def _sha256_json(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then <pad> (256) and <eos> (257); text never encodes to <pad> or <eos>."""

    name = "byte"
    vocab_size = BYTE_VOCAB_SIZE
    pad_id = BYTE_PAD_ID
    eos_id = BYTE_EOS_ID
    bos_ids: tuple[int, ...] = ()
    chat_template = None
    chat_template_file = None
    chat_template_name = None

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0].tolist()

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """The UTF-8 text of the byte ids; pad, eos and out-of-range ids are skipped, bad UTF-8 is replaced."""
        array = np.asarray(ids, dtype=np.int64).reshape(-1)
        return array[(array >= 0) & (array < 256)].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        return _sha256_json(
            {"kind": "byte", "encoding": "utf-8", "vocab_size": self.vocab_size, "pad": self.pad_id, "eos": self.eos_id}
        )

    def save(self, directory: Path) -> None:
        """The same tokenizer in Hugging Face's form: GPT-2's byte-to-character map without its splitting or
        prefix space, one token per byte (id = byte), no merges; <pad> and <eos> are special tokens that text
        never produces (`split_special_tokens`), and decoding replaces bad UTF-8 as `decode` does."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {char: byte for byte, char in enumerate(_byte_level_chars())}
        backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        specials = {self.pad_id: "<pad>", self.eos_id: "<eos>"}
        backend.add_special_tokens([AddedToken(specials[i], special=True) for i in sorted(specials)])
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=specials[self.pad_id],
                                            eos_token=specials[self.eos_id], split_special_tokens=True)
        tokenizer.save_pretrained(directory)


def _byte_level_chars() -> list[str]:
    """GPT-2's printable stand-in character for each byte 0..255 (the `tokenizers` ByteLevel alphabet)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    shifted = iter(range(256, 512))
    return [chr(byte) if byte in printable else chr(next(shifted)) for byte in range(256)]


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local directory; `encode` gives a text's ids without special tokens,
    and `bos_ids` the ones the tokenizer puts before a text. `chat_template_file` replaces its chat template;
    `chat_template_name` chooses one of its named templates."""

    def __init__(self, directory: str, chat_template_file: str | None = None,
                 chat_template_name: str | None = None) -> None:
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as error:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise UsageError(f"no usable tokenizer in directory '{directory}': {first_line}") from None
        if not self._tokenizer_files(Path(directory)):
            raise UsageError(f"no tokenizer files (tokenizer.json or a vocabulary) in directory '{directory}'")
        if self._tok.eos_token_id is None:
            raise UsageError(f"tokenizer in '{directory}' has no eos token (needed to end documents and responses)")
        self.name = directory
        self.vocab_size = len(self._tok)
        self.eos_id = int(self._tok.eos_token_id)
        self.pad_id = int(self._tok.pad_token_id) if self._tok.pad_token_id is not None else self.eos_id
        self.bos_ids = _bos_ids(self._tok)
        self.chat_template_file, self.chat_template_name = chat_template_file, chat_template_name
        if chat_template_file is not None:
            self._tok.chat_template = read_chat_template(chat_template_file)
        template = getattr(self._tok, "chat_template", None)
        where = f"tokenizer '{directory}'"
        if isinstance(template, dict):  # named templates (tokenizer_config.json's list of them)
            template = self._tok.chat_template = named_template(template, chat_template_name, where, NAME_FLAG)
        elif chat_template_name is not None:
            held = "one chat template, not named ones" if template else "no chat template"
            raise UsageError(f"--chat-template-name {chat_template_name}: {where} has {held}; drop the flag")
        self.chat_template = template if isinstance(template, str) and template.strip() else None
        if self.chat_template is not None:
            check_template_size(self.chat_template, f"the chat template of tokenizer '{directory}'")

    @property
    def backend(self):
        """The transformers tokenizer itself (chat templates are rendered with it)."""
        return self._tok

    def _tokenizer_files(self, directory: Path) -> list[Path]:
        """The files in `directory` that define the tokenizer (transformers builds an empty one without them)."""
        names = {"tokenizer.json", *(name for name in self._tok.vocab_files_names.values() if isinstance(name, str))}
        return [directory / name for name in sorted(names) if (directory / name).is_file()]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False, verbose=False)

    def save(self, directory: Path) -> None:
        self._tok.save_pretrained(directory)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        if not texts:
            return []
        batch = self._tok(list(texts), add_special_tokens=False, verbose=False, return_attention_mask=False)
        return [np.asarray(ids, dtype=np.int64) for ids in batch["input_ids"]]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def _files_digest(self) -> dict[str, str]:
        """sha256 of each tokenizer file in the directory (for tokenizers without a `tokenizers` backend)."""
        directory = Path(self.name)
        configs = [directory / name for name in ("tokenizer_config.json", "special_tokens_map.json")]
        files = self._tokenizer_files(directory) + [file for file in configs if file.is_file()]
        return {file.name: hashlib.sha256(file.read_bytes()).hexdigest() for file in files}

    def fingerprint(self) -> str:
        """Hash of the backend's serialisation (normaliser, pre-tokeniser, model, added tokens) and pad/eos.

        The backend's truncation and padding settings are left out: they are per-call state, not tokenisation.
        """
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is None:
            description = self._files_digest()
        else:
            description = json.loads(backend.to_str())
            description.pop("truncation", None)
            description.pop("padding", None)
        return _sha256_json(
            {
                "kind": "hf",
                "class": type(self._tok).__name__,
                "backend": description,
                "vocab_size": self.vocab_size,
                "pad": self.pad_id,
                "eos": self.eos_id,
                "bos_ids": list(self.bos_ids),
                "chat_template": self.chat_template,
            }
        )


def _bos_ids(tok) -> tuple[int, ...]:
    """The special tokens `tok` puts before a text when asked to add special tokens (BOS), found by encoding a
    probe both ways."""
    plain = tok.encode("a", add_special_tokens=False, verbose=False)
    full = tok.encode("a", add_special_tokens=True, verbose=False)
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return tuple(int(i) for i in full[:start])
    return ()


def read_chat_template(spec: str) -> str:
    """The Jinja chat template of `--chat-template spec`: a .jinja file, or a JSON file with a `chat_template` field
    (a string, or Hugging Face's list of named templates: `default`, or the one `FILE#NAME` names; a bare list
    too). A template over MAX_TEMPLATE_BYTES is refused before it is read whole or compiled."""
    path, _, name = spec.rpartition("#") if "#" in spec and not Path(spec).exists() else (spec, "", None)
    limit = MAX_TEMPLATE_BYTES if not path.endswith(".json") else MAX_TEMPLATE_JSON_BYTES
    try:
        if Path(path).is_file() and Path(path).stat().st_size > limit:
            raise _too_large(f"--chat-template {spec}", Path(path).stat().st_size)
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"--chat-template {spec}: cannot read it ({type(error).__name__})") from None
    if path.endswith(".json"):
        text = _json_template(text, spec, name or None)
    elif name:
        raise UsageError(f"--chat-template {spec}: only a .json file holds named templates")
    if not isinstance(text, str) or not text.strip():
        raise UsageError(f"--chat-template {spec}: the template is empty")
    check_template_size(text, f"--chat-template {spec}")
    return text


def _json_template(text: str, spec: str, name: str | None) -> str:
    """The template of a JSON template file: its `chat_template` string, or one of its named templates."""
    try:
        found = json.loads(text)
        found = found["chat_template"] if isinstance(found, dict) else found
    except (json.JSONDecodeError, KeyError, TypeError):
        raise UsageError(f"--chat-template {spec}: expected a JSON object with a 'chat_template' string or list of "
                         f"named templates") from None
    if isinstance(found, list):
        try:
            found = {entry["name"]: entry["template"] for entry in found}
        except (KeyError, TypeError):
            raise UsageError(f"--chat-template {spec}: a list of named templates holds objects with 'name' and "
                             f"'template'") from None
    if isinstance(found, dict):
        return named_template(found, name, f"--chat-template {spec}", "--chat-template FILE#NAME")
    if name:
        raise UsageError(f"--chat-template {spec}: the file holds one template, not named ones")
    return found


def named_template(templates: dict, name: str | None, where: str, flag: str) -> str:
    """Template `name` of a set of named ones, or (no name) `default`, or the only one, as transformers picks;
    `flag` is how the user names one."""
    if name is None and len(templates) == 1:
        name = next(iter(templates))
    chosen = name or "default"
    if chosen not in templates:
        names = ", ".join(sorted(map(str, templates)))
        raise UsageError(f"{where}: no chat template named '{chosen}' (it has {names}); pass {flag} naming one")
    return templates[chosen]


def check_template_size(template: str, where: str) -> None:
    """Refuse a template over MAX_TEMPLATE_BYTES before it is compiled (a large literal template makes Jinja's
    compiler grow by thousands of times its size)."""
    size = len(template.encode("utf-8", errors="replace"))
    if size > MAX_TEMPLATE_BYTES:
        raise _too_large(where, size)


def _too_large(where: str, size: int) -> UsageError:
    return UsageError(f"{where}: {size} bytes, over the {MAX_TEMPLATE_BYTES // 1024} KiB a chat template may hold; "
                      f"it was not compiled")


def load_tokenizer(spec: str = "byte", chat_template_file: str | None = None,
                   chat_template_name: str | None = None) -> Tokenizer:
    """`byte` for the built-in byte-level tokenizer, or a local directory holding a Hugging Face tokenizer (its chat
    template replaced by the one in `chat_template_file`, if given, or chosen among its own by `chat_template_name`;
    not both: a file's named templates are chosen as FILE#NAME)."""
    if chat_template_file is not None and chat_template_name is not None:
        raise UsageError(f"--chat-template-name {chat_template_name} names one of the tokenizer's own templates, "
                         f"but --chat-template {chat_template_file} replaces them; name a template of that file as "
                         f"FILE#NAME")
    if spec == "byte":
        for flag, value in (("--chat-template", chat_template_file), (NAME_FLAG, chat_template_name)):
            if value is not None:
                raise UsageError(f"{flag} needs a Hugging Face tokenizer (--tokenizer DIR), not the byte tokenizer")
        return ByteTokenizer()
    if not Path(spec).is_dir():
        raise UsageError(f"tokenizer '{spec}' is neither 'byte' nor an existing local directory")
    return HFTokenizer(spec, chat_template_file, chat_template_name)
