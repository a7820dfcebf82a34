"""``python -m echo_ds.eval perplexity``: configs, text handling, and the CLI end to end on a tiny model."""

import importlib.util
import json
import math
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from echo_ds.config import EchoConfig  # noqa: E402
from echo_ds.eval import perplexity as ppl  # noqa: E402
from echo_ds.eval.__main__ import main  # noqa: E402

kRepo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
kShippedConfigs = os.path.join(kRepo, "ds_configs", "eval")

# Table 8 of the paper: one shipped config per row, at 4 and at 8 bits.
kTable8Rows = ("full", "naive_zp", "symmetric", "symmetric_g256", "naive_zp_g256", "single_average", "no_comp",
               "gain0.7", "gain0.9", "blend0.25", "blend0.45", "decay0.8_0.2", "decay0.6_0.4")


def write_json(path, data):
    with open(path, "w") as f:
        json.dump(data, f)
    return str(path)


def byte_tokenizer():
    """A 256-token byte-level tokenizer (no merges), built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A random 2-layer Llama (4 heads) with a byte tokenizer, saved as a local HF directory."""
    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return str(path)


# ----------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------

def test_shipped_configs_load_and_cover_table_8():
    names = sorted(f[:-5] for f in os.listdir(kShippedConfigs) if f.endswith(".json"))
    for bits in (4, 8):
        for row in kTable8Rows:
            assert f"{bits}bit_{row}" in names
    assert "4bit_early8" in names
    for name in names:
        cfg, description = ppl.load_echo_config(os.path.join(kShippedConfigs, name + ".json"))
        assert cfg.enabled and description
        assert cfg.bits == int(name[0]), name
    full, _ = ppl.load_echo_config(os.path.join(kShippedConfigs, "4bit_full.json"))
    f = full.forward
    assert (full.quantizer, full.group_size, f.gain, f.blend, f.slow_decay, f.fast_decay, f.residual) == (
        "zero_aware", 128, 0.75, 0.35, 0.7, 0.3, "output")
    early, _ = ppl.load_echo_config(os.path.join(kShippedConfigs, "4bit_early8.json"))
    assert [early.bits_for_site(k, 60) for k in (0, 29, 30, 59)] == [8, 8, 4, 4]


def test_echo_config_files_are_read_as_deepspeed_reads_them(tmp_path):
    from echo_ds.config import EchoConfigError

    commented = tmp_path / "commented.json"
    commented.write_text('{\n  // a comment, as in the README\'s example\n  "echo": {"bits": 8},\n'
                         '  "description": "with a comment"\n}\n')
    cfg, description = ppl.load_echo_config(str(commented))
    assert cfg.bits == 8 and description == "with a comment"
    duplicated = tmp_path / "dup.json"
    duplicated.write_text('{"echo": {"bits": 4}, "echo": {"bits": 8}}')
    with pytest.raises(EchoConfigError, match="dup.json.*duplicate key 'echo'"):
        ppl.load_echo_config(str(duplicated))


def test_variant_specs(tmp_path):
    ds = write_json(tmp_path / "ds.json", {"train_batch_size": 8, "echo": {"bits": 8}})
    bare = write_json(tmp_path / "bare.json", {"bits": 4, "group_size": 64, "description": "bare section"})
    variants = ppl.parse_variant_specs([f"eight={ds}", bare])
    assert [v.name for v in variants] == ["eight", "bare"]
    assert variants[0].config.bits == 8 and variants[1].config.group_size == 64
    assert variants[1].description == "bare section"
    assert [v.name for v in ppl.parse_variant_specs([str(tmp_path)])] == ["bare", "ds"]
    with pytest.raises(ValueError, match="taken"):
        ppl.parse_variant_specs([f"16bit={ds}"])
    with pytest.raises(ValueError, match="taken"):
        ppl.parse_variant_specs([f"a={ds}", f"a={bare}"])
    with pytest.raises(ValueError, match="no \"echo\" section"):
        ppl.parse_variant_specs([write_json(tmp_path / "plain.json", {"train_batch_size": 8})])
    with pytest.raises(ValueError, match="bits"):
        ppl.parse_variant_specs([write_json(tmp_path / "bad.json", {"echo": {"bits": 3}})])


# ----------------------------------------------------------------------------------------------------
# Text
# ----------------------------------------------------------------------------------------------------

def test_default_text_is_shipped_and_small():
    assert os.path.isfile(ppl.kDefaultText)
    assert os.path.getsize(ppl.kDefaultText) < 300_000


def test_tokenize_sequences_cuts_the_first_tokens():
    tok = byte_tokenizer()
    text = "All the world's a stage, and all the men and women merely players. " * 20
    seqs = ppl.tokenize_sequences(tok, text, num_tokens=100, seq_len=32)
    assert [s.numel() for s in seqs] == [32, 32, 32, 4]
    assert tok.decode(torch.cat(seqs).tolist()) == text[:100]
    # A last sequence of one token predicts nothing and is dropped.
    assert [s.numel() for s in ppl.tokenize_sequences(tok, text, 65, 32)] == [32, 32]


def test_read_text_joins_a_directory(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "skip.md").write_text("not text")
    assert ppl.read_text(str(tmp_path)) == "first\n\nsecond"


# ----------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------

def test_cli_end_to_end_on_a_tiny_model(tiny_model_dir, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("Now is the winter of our discontent made glorious summer by this sun of York. " * 12)
    cfg_dir = tmp_path / "configs"
    cfg_dir.mkdir()
    write_json(cfg_dir / "e4.json", {"description": "4-bit", "echo": {"bits": 4, "group_size": 32}})
    write_json(cfg_dir / "e8.json", {"echo": {"bits": 8, "group_size": 32}})
    early = write_json(tmp_path / "early.json", {"echo": {"bits": 4, "group_size": 32,
                                                          "early_sites": {"bits": 8, "fraction": 0.5}}})
    out_json, out_png = tmp_path / "res" / "r.json", tmp_path / "r.png"
    # The plot needs matplotlib (the eval extra); the rest runs with the test extra alone.
    plot = ["--plot", str(out_png)] if importlib.util.find_spec("matplotlib") else []
    rc = main(["perplexity", "--model", tiny_model_dir, "--text", str(text), "--tokens", "200", "--seq-len", "64",
               "--tp", "2", "--echo-config", str(cfg_dir), "--echo-config", f"early={early}",
               "--json", str(out_json), "--no-progress"] + plot)
    assert rc == 0
    doc = json.loads(out_json.read_text())
    assert {"model", "text", "tokens", "tp", "results"} <= set(doc)
    assert doc["tokens"] == 200 and doc["tp"] == 2 and doc["num_sites"] == 4
    assert doc["command"].startswith("python -m echo_ds.eval perplexity --model")
    names = [r["name"] for r in doc["results"]]
    assert names == ["16bit", "e4", "e8", "early"]
    for r in doc["results"]:
        assert {"name", "ppl", "kl", "top1_agreement"} <= set(r)
        assert math.isfinite(r["ppl"]) and r["ppl"] > 1 and r["kl"] >= 0 and 0 <= r["top1_agreement"] <= 1
        assert r["positions"] == 3 * 63 + 7     # sequences of 64, 64, 64 and 8 tokens
    base, e4, e8, early = doc["results"]
    assert base["kl"] == 0 and base["top1_agreement"] == 1 and base["wire_bits_per_element"] == 16
    # the default quantizer packs each group's parameters into one 16-bit word: 16 / 32 bits per element
    assert e4["wire_bits_per_element"] == pytest.approx(4 + 16 / 32)
    assert e8["wire_bits_per_element"] == pytest.approx(8 + 16 / 32)
    assert early["wire_bits_per_element"] == pytest.approx(6 + 16 / 32)
    assert e8["kl"] < e4["kl"]
    assert EchoConfig(**e4["echo"]).bits == 4
    assert not plot or out_png.stat().st_size > 0
    stdout = capsys.readouterr().out
    assert "| config | wire bits/elem | ppl |" in stdout and "| e8 | 8.50 |" in stdout
    assert "by heads: 2 of 4 heads per GPU" in stdout


def test_cli_requires_a_subcommand(capsys):
    with pytest.raises(SystemExit):
        main([])
