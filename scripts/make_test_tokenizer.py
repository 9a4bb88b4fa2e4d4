"""Writes test/data/bumblebee_tokenizer/tokenizer.json: a small real GPT-2-style tokenizer
(byte-level BPE, 300 tokens, "<|endoftext|>" = 0) for the Nx.Serving test of
ExlaRs.Bumblebee (test/bumblebee/serving_test.exs), made offline with Hugging Face's
`tokenizers` (scripts/setup.sh installs it in .venv/tokenizers). Deterministic: the same
corpus and settings give the same file, so the committed copy can be checked against it.

    .venv/tokenizers/bin/python scripts/make_test_tokenizer.py [--check]
"""
import pathlib
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

OUT = pathlib.Path(__file__).resolve().parent.parent / "test/data/bumblebee_tokenizer/tokenizer.json"

# A few sentences are enough for merges beyond the 256 byte tokens.
CORPUS = [
    "Flash attention computes softmax attention in tiles without materialising the scores.",
    "Elixir models load with Bumblebee and run their attention through exla_rs.",
    "The quick brown fox jumps over the lazy dog while the kernels run.",
    "Tokens attend to earlier tokens; padding hides the keys that are not real.",
] * 4


def build():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok.to_str(pretty=True) + "\n"


def main():
    text = build()
    if "--check" in sys.argv:
        if OUT.read_text() != text:
            sys.exit(f"{OUT} differs from what {__file__} makes: regenerate it")
        print(f"{OUT} is up to date")
        return
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(text)} bytes)")


if __name__ == "__main__":
    main()
