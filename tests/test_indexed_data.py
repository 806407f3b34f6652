"""Megatron's indexed dataset format: the bytes of .idx as Megatron lays them out, round trips,
`megart preprocess-data` (byte and Hugging Face tokenizers), training on --data-path, and the
errors for a wrong prefix, a corrupt file and token ids outside the vocabulary."""

import json
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import train_workers as tw
from megart import ConfigError
from megart.cli.main import main as megart_main
from megart.launcher import LaunchError, launch
from megart.training.data import TokenDataset, build_datasets
from megart.training.indexed import IndexedTokens, write_indexed


def test_index_bytes_follow_megatrons_layout(tmp_path):
    write_indexed(tmp_path / "d", [np.array([5, 6, 7]), np.array([8])], np.uint16)
    raw = (tmp_path / "d.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", raw[9:34])
    assert (version, code, n_seq, n_doc) == (1, 8, 2, 3)  # uint16 is code 8; doc bounds 0,1,2
    assert np.frombuffer(raw[34:42], np.int32).tolist() == [3, 1]  # tokens per sequence
    assert np.frombuffer(raw[42:58], np.int64).tolist() == [0, 6]  # byte offsets into .bin
    assert np.frombuffer(raw[58:82], np.int64).tolist() == [0, 1, 2]
    assert len(raw) == 82
    assert np.frombuffer((tmp_path / "d.bin").read_bytes(), np.uint16).tolist() == [5, 6, 7, 8]


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 65535), max_size=40), min_size=1, max_size=12),
    st.sampled_from([np.uint16, np.int32, np.int64]),
)
def test_round_trip(tmp_path_factory, docs, dtype):
    prefix = tmp_path_factory.mktemp("rt") / "d"
    total = write_indexed(prefix, [np.array(d, dtype=np.int64) for d in docs], dtype)
    ds = IndexedTokens(prefix)
    assert total == sum(map(len, docs)) and len(ds) == len(docs)
    assert [ds[i].tolist() for i in range(len(ds))] == docs
    assert ds.tokens.tolist() == [t for d in docs for t in d]


def test_bad_prefix_and_corrupt_files_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"nowhere.idx does not exist; give the prefix"):
        IndexedTokens(tmp_path / "nowhere")
    write_indexed(tmp_path / "d", [np.arange(10)], np.uint8)
    (tmp_path / "d.bin").write_bytes(b"\x00" * 7)
    with pytest.raises(ConfigError, match="has 7 bytes but its index describes 10 tokens"):
        IndexedTokens(tmp_path / "d")
    (tmp_path / "d.idx").write_bytes(b"not an index at all, not at all")
    with pytest.raises(ConfigError, match="bad magic"):
        IndexedTokens(tmp_path / "d")


def test_truncated_inflated_and_short_indexes_name_the_file(tmp_path):
    write_indexed(tmp_path / "d", [np.arange(10), np.arange(5)], np.uint8)
    idx = tmp_path / "d.idx"
    whole = idx.read_bytes()
    idx.write_bytes(whole[:-8])  # truncated
    with pytest.raises(ConfigError, match=rf"{idx} is {len(whole) - 8} bytes, but its header"):
        IndexedTokens(tmp_path / "d")
    inflated = bytearray(whole)
    inflated[18:26] = (1000).to_bytes(8, "little")  # the sequence count
    idx.write_bytes(bytes(inflated))
    with pytest.raises(ConfigError, match=rf"{idx} .*counts 1000 sequences"):
        IndexedTokens(tmp_path / "d")
    idx.write_bytes(whole[:20])  # the magic and part of the header
    with pytest.raises(ConfigError, match=rf"{idx} is 20 bytes, shorter than the 34-byte header"):
        IndexedTokens(tmp_path / "d")


def test_tokens_beyond_the_vocabulary_are_found_when_the_data_is_opened(tmp_path):
    write_indexed(tmp_path / "d", [np.arange(1000) % 700], np.uint16)
    with pytest.raises(ConfigError, match=rf"{tmp_path / 'd'}.bin holds token id 699, outside"):
        build_datasets(str(tmp_path / "d"), "100,0,0", 16, 512, evaluate=False)
    build_datasets(str(tmp_path / "d"), "100,0,0", 16, 700, evaluate=False)  # fits


def test_preprocess_data_creates_a_missing_output_folder(tmp_path, capsys):
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "hello world"}))
    prefix = tmp_path / "new" / "deeper" / "out"
    args = ["preprocess-data", "--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(prefix)]
    assert megart_main(args) == 0
    assert len(IndexedTokens(f"{prefix}_text_document")) == 1


def test_token_ids_outside_the_vocabulary_are_refused():
    ds = TokenDataset(np.arange(300, dtype=np.int64), 16, vocab_size=256)
    with pytest.raises(ConfigError, match=r"outside --vocab-size 256"):
        for it in range(20):
            ds.global_batch(seed=0, iteration=it, size=8)


def test_preprocess_data_bytes_then_train_on_it(tmp_path, capsys):
    docs = [{"text": "def f(x):\n    return x + 1\n" * 40, "id": i} for i in range(30)]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(d) for d in docs))
    prefix = tmp_path / "out"
    args = ["preprocess-data", "--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(prefix)]
    assert megart_main(args) == 0
    assert "out_text_document.bin / .idx" in capsys.readouterr().out
    ds = IndexedTokens(f"{prefix}_text_document")
    assert len(ds) == 30 and bytes(ds[3].tolist()).decode() == docs[3]["text"]
    history = launch(tw.train_on, 2, f"{prefix}_text_document", 256, timeout=300)[0]
    assert [h["iteration"] for h in history] == [1, 2]
    assert all(np.isfinite(h["loss"]) for h in history)


def test_preprocess_data_with_a_hugging_face_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>"
    )
    fast.save_pretrained(tmp_path / "tok")
    (tmp_path / "c.jsonl").write_text(
        json.dumps({"body": "hello world"}) + "\n" + json.dumps({"body": "world x"})
    )
    args = f"--input {tmp_path / 'c.jsonl'} --output-prefix {tmp_path / 'o'} --json-keys body "
    args += f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {tmp_path / 'tok'} "
    args = ["preprocess-data", *args.split(), "--append-eod"]
    assert megart_main(args) == 0
    ds = IndexedTokens(tmp_path / "o_body_document")
    assert [ds[0].tolist(), ds[1].tolist()] == [[2, 3, 1], [3, 0, 1]]
    assert ds.dtype == np.uint8


def test_preprocess_data_errors_say_what_to_change(tmp_path, capsys):
    (tmp_path / "c.jsonl").write_text(json.dumps({"content": "x"}))
    prefix = str(tmp_path / "o")
    base = ["preprocess-data", "--input", str(tmp_path / "c.jsonl"), "--output-prefix", prefix]
    assert megart_main(base) == 2
    assert "no 'text' key; set --json-keys" in capsys.readouterr().err
    assert megart_main([*base, "--append-eod"]) == 2
    assert "ByteTokenizer has no end-of-document token" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]  # no half-written files


def test_training_on_a_missing_dataset_fails_before_any_work(tmp_path):
    with pytest.raises(LaunchError, match="does not exist; give the prefix"):
        launch(tw.train_on, 1, str(tmp_path / "missing"), 256, timeout=120)
