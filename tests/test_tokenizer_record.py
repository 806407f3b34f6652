"""Checkpoints record the tokenizer their model was trained with (as Megatron-LM's saved args
do), and export-hf saves it beside the weights without being told: a Hugging Face tokenizer
(--tokenizer-model), Megatron's GPT2BPETokenizer (--vocab-file, --merge-file; its ids are the
corpus's), and import-hf's directory's own. The reference for each is the tokenizer the model
was trained with, as the tokenizers library gives it."""

import json

import pytest

import megatron_workers as mw
from megart.cli.main import main as megart_main
from megart.launcher import launch
from megart.training import tokenizer_record
from test_export_hf import small_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors.torch")

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--train-iters", "1", "--lr", "1e-3", "--save-interval", "1"]  # fmt: skip
TEXT = "the quick brown fox jumps over the lazy dog; pack my box with five dozen jugs. "


def train(ckpt, *flags: str) -> None:
    status, out = launch(mw.run_cli, 1, [*TINY, "--save", str(ckpt), *flags], timeout=300)[0]
    assert status == 0, out


def export(ckpt, out, *flags: str) -> tuple[int, str]:
    return megart_main(["export-hf", "--load", str(ckpt), "--output", str(out), *flags])


def test_a_hugging_face_tokenizer_is_saved_with_the_weights_unasked(tmp_path, capsys):
    tokenizer = small_tokenizer(tmp_path / "tok")
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    train(ckpt, "--mock-data", "--tokenizer-type", "HuggingFaceTokenizer",
          "--tokenizer-model", str(tmp_path / "tok"))  # fmt: skip
    assert export(ckpt, out) == 0
    assert capsys.readouterr().out.endswith("; the tokenizer it was trained with\n")
    back = transformers.AutoTokenizer.from_pretrained(out)
    assert back("hello world held")["input_ids"] == tokenizer("hello world held")["input_ids"]
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)  # <s>, </s>
    # Through Megatron-LM's torch_dist store (its args record it) and back to Hugging Face.
    convert = ["convert-checkpoint", "--load"]
    assert (
        megart_main(
            [
                *convert,
                str(ckpt),
                "--save",
                str(tmp_path / "dist"),
                "--from",
                "megart",
                "--to",
                "megatron",
                "--ckpt-format",
                "torch_dist",
            ]
        )
        == 0
    )
    assert megart_main([*convert, str(tmp_path / "dist"), "--save", str(tmp_path / "back"),
                        "--from", "megatron", "--to", "hf"]) == 0  # fmt: skip
    assert capsys.readouterr().out.endswith("; the tokenizer it was trained with\n")
    back = transformers.AutoTokenizer.from_pretrained(tmp_path / "back")
    assert back("hello world held")["input_ids"] == tokenizer("hello world held")["input_ids"]
    # Gone from where it was recorded: refused, naming both ways on, and nothing written.
    (tmp_path / "tok").rename(tmp_path / "moved")
    assert export(ckpt, tmp_path / "hf2") == 2
    err = capsys.readouterr().err
    assert (
        f"records the tokenizer it was trained with (HuggingFaceTokenizer {tmp_path / 'tok'})"
        in err
    )
    assert "give --tokenizer-model NAME_OR_DIR, or --no-tokenizer" in err and err.count("\n") == 1
    assert not (tmp_path / "hf2").exists()
    assert export(ckpt, out, "--tokenizer-model", str(tmp_path / "moved")) == 0
    assert capsys.readouterr().out.endswith(f"; the tokenizer of {tmp_path / 'moved'}\n")
    # --no-tokenizer: the weights alone, an earlier export's tokenizer files removed.
    assert export(ckpt, out, "--no-tokenizer") == 0
    assert capsys.readouterr().out.endswith("(GPT-2)\n")
    assert not list(out.glob("tokenizer*"))
    with pytest.raises(SystemExit):
        export(ckpt, out, "--no-tokenizer", "--tokenizer-model", str(tmp_path / "moved"))


def test_megatrons_gpt2_bpe_files_are_saved_as_the_tokenizer_of_the_corpus(tmp_path, capsys):
    """Trained from relative --vocab-file/--merge-file paths, saved in Megatron's legacy
    format (the tokenizer read back from its args): the exported tokenizer gives the ids the
    byte-level BPE that wrote the files gives."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([TEXT] * 50, vocab_size=300, special_tokens=["<|endoftext|>"],
                            show_progress=False)  # fmt: skip
    bpe.save_model(str(tmp_path), "gpt2")
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    files = ["--vocab-file", "gpt2-vocab.json", "--merge-file", "gpt2-merges.txt"]
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)  # relative paths, recorded absolute for an export run elsewhere
        train(ckpt, "--mock-data", "--ckpt-format", "torch", *files)
        state = tokenizer_record.record(dict(vocab_file="gpt2-vocab.json"))
    assert state == {"tokenizer_type": "GPT2BPETokenizer",
                     "vocab_file": str(tmp_path / "gpt2-vocab.json")}  # fmt: skip
    assert export(ckpt, out) == 0
    assert capsys.readouterr().out.endswith("; the tokenizer it was trained with\n")
    back = transformers.AutoTokenizer.from_pretrained(out)
    assert back(TEXT)["input_ids"] == bpe.encode(TEXT).ids
    assert back.decode(bpe.encode(TEXT).ids) == TEXT
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == bpe.token_to_id("<|endoftext|>")


def test_import_hf_records_the_directorys_tokenizer_and_null_tokenizer_saves_none(tmp_path, capsys):
    model = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=256, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    ).save_pretrained(model)
    tokenizer = small_tokenizer(model)  # beside the weights, as save_pretrained leaves it
    assert megart_main(["import-hf", "--input", str(model), "--save", str(tmp_path / "c")]) == 0
    assert export(tmp_path / "c", tmp_path / "hf") == 0
    assert capsys.readouterr().out.endswith("; the tokenizer it was trained with\n")
    back = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert back("held a word")["input_ids"] == tokenizer("held a word")["input_ids"]
    ckpt = tmp_path / "null"
    train(ckpt, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100")
    assert export(ckpt, tmp_path / "hf3") == 0
    assert capsys.readouterr().out.endswith("(GPT-2)\n")
    assert not list((tmp_path / "hf3").glob("tokenizer*"))
