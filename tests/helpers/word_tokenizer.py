"""A tiny Hugging Face tokenizer directory (WordLevel) and the sentences it is trained on."""

from pathlib import Path


def save_word_tokenizer(directory: Path, corpus: list[str], with_pad: bool = True) -> Path:
    """A tiny WordLevel tokenizer trained on `corpus`, saved as a Hugging Face tokenizer directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[UNK]", "[EOS]"] + (["[PAD]"] if with_pad else [])
    backend = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=specials))
    extra = {"pad_token": "[PAD]"} if with_pad else {}
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="[EOS]", **extra).save_pretrained(
        directory
    )
    return directory


CORPUS = ["the cat sat on the mat", "a dog ran in the park", "### Instruction : Response Input"]
