"""echo_ds.eval.peers: the peers' formats (round-trip error bounds derived from each grid, bits per value),
their all-reduces (two-shot = quantized twice, against a manual composition), and ``--peer`` in the CLI."""

import json
import math

import pytest
import torch

from echo_ds.eval import peers as PS
from echo_ds.eval.peers import PEERS

kFp16Rel = 2.0**-11     # fp16's unit roundoff
kFp8Rel = 2.0**-4       # e4m3's unit roundoff (3 mantissa bits)
kFp8Sub = 2.0**-10      # half e4m3's subnormal spacing 2^-9


def activations(shape, seed=0, outlier_channel=5):
    """Random partial sums with one outlier channel, as the sites' inputs have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 0.3
    x[..., outlier_channel] *= 25.0
    return x


def f16(t):
    return t.to(torch.float16).float()


# ----------------------------------------------------------------------------------------------------
# Bits per value, counted as ours: codes + every group's parameters
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, bits", [
    ("quickreduce_int4", 4 + 16 / 32), ("quickreduce_int6", 6 + 16 / 32), ("quickreduce_int8", 8 + 16 / 32),
    ("vllm_int8", 8 + 32 / 256), ("vllm_fp8", 8 + 32 / 256), ("flashinfer_fp8", 8 + 32 / 256),
    ("flashcomm_int4", 4 + 32 / 128), ("taco_fp8", 8 + 32 / 128),
    ("dong_int4_outliers", ((576 - 9) * 4 + 9 * 16 + 16) / 576)])
def test_bits_per_value(name, bits):
    fmt = PEERS[name]
    assert fmt.bits_per_value == pytest.approx(bits)
    assert fmt.wire_bits((512, 576)) / (512 * 576) == pytest.approx(bits)


def test_wire_bits_count_partial_groups_whole():
    # 100 values: QuickReduce pads to 128 = two 64-blocks of two groups; vLLM: one group of 256.
    assert PEERS["quickreduce_int4"].wire_bits((100,)) == 4 * (32 * 4 + 16)
    assert PEERS["vllm_int8"].wire_bits((100,)) == 256 * 8 + 32
    # Dong: per row of H = 64, ceil(64 / 64) = 1 channel at 16 bits and one fp16 scale
    assert PEERS["dong_int4_outliers"].wire_bits((3, 64)) == 3 * (63 * 4 + 16 + 16)


def test_the_cli_names_every_peer():
    assert set(PEERS) >= {"quickreduce_int4", "quickreduce_int6", "quickreduce_int8", "vllm_int8", "vllm_fp8",
                          "flashinfer_fp8", "flashcomm_int4", "taco_fp8", "dong_int4_outliers"}
    with pytest.raises(ValueError, match="unknown peer 'qr4'"):
        PS.get_peer("qr4")


# ----------------------------------------------------------------------------------------------------
# Round trips: the error bound of each grid
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 6, 8])
def test_quickreduce_round_trip_bound(bits):
    qmax = 2 ** (bits - 1)
    x = activations((3, 4096), seed=bits)
    y = PS.quickreduce_qdq(x, bits)
    # Groups: one parity of each 64-block. dec = -m / qmax, m the group's value of largest magnitude, signed.
    h = f16(x).view(3, -1, 32, 2)
    m = torch.where(h.amax(2, keepdim=True).abs() > h.amin(2, keepdim=True).abs(),
                    h.amax(2, keepdim=True), h.amin(2, keepdim=True))
    step = (m.abs() / qmax).expand_as(h).reshape(3, -1)
    err = (y - x).abs()
    # Half a step where the code is not clipped, a whole step for the other sign's values beyond
    # (qmax - 1/2) steps (code +qmax is missing); fp16 rounding of the input, the reciprocal and the products
    # adds at most qmax 2^-10 of a step and 2^-10 of the value.
    slack = step * qmax * 2 * kFp16Rel + 2 * kFp16Rel * x.abs() + 1e-12
    toward_max_sign = (x * m.expand_as(h).reshape(3, -1)) >= 0
    clipped = ~toward_max_sign & (x.abs() > (qmax - 0.5) * step)
    assert (err <= step * 0.5 + slack)[~clipped].all()
    assert (err <= step + slack).all()
    # the group's extreme (signed: a tie between +-|m| goes to the minimum) maps to code -qmax exactly:
    # reproduced up to fp16 rounding
    is_extreme = f16(x) == m.expand_as(h).reshape(3, -1)
    assert (err[is_extreme] <= kFp16Rel * x.abs()[is_extreme]).all()
    # the bound is nearly reached (the test can fail: a finer grid would not reach it)
    assert (err / step).max() > 0.45


@pytest.mark.parametrize("code", ["int8", "fp8"])
@pytest.mark.parametrize("inverse_scale", [False, True])
def test_kraken_round_trip_bound(code, inverse_scale):
    x = activations((2, 2048), seed=3)
    y = PS.kraken_qdq(x, code, inverse_scale)
    amax = x.view(2, -1, 256).abs().amax(-1, keepdim=True).expand(2, 8, 256).reshape(2, -1)
    err = (y - x).abs()
    if code == "int8":
        step = amax / 127
        # truncation toward zero: below one step, never away from zero, about half a step on average
        assert (err <= step * (1 + 1e-5)).all()
        assert (y.abs() <= x.abs() * (1 + 1e-6) + 1e-12).all()
        assert 0.4 < float((err / step).mean()) < 0.6
    else:
        # e4m3 after scaling to +-448: half an ulp (2^-4 relative) or half the subnormal spacing
        bound = torch.maximum(x.abs() * kFp8Rel, amax / 448 * kFp8Sub) * (1 + 1e-5)
        assert (err <= bound).all()
        assert (err / bound).max() > 0.5


def test_int8_rne_what_if_rounds_to_nearest():
    x = activations((1, 1024), seed=4)
    step = x.view(1, -1, 256).abs().amax(-1, keepdim=True).expand(1, 4, 256).reshape(1, -1) / 127
    err = (PS.kraken_qdq(x, "int8_rne", False) - x).abs()
    assert (err <= step * (0.5 + 1e-5)).all()


def test_asymmetric_int4_round_trip_bound():
    x = activations((2, 1024), seed=5)
    y = PS.asymmetric_int_qdq(x, 4, 128)
    g = x.view(2, -1, 128)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    s = f16((hi - lo) / 15)
    # half a step, plus the fp16 rounding of the minimum and of the scale over 15 steps
    bound = (s * (0.5 + 15 * kFp16Rel) + lo.abs() * kFp16Rel).expand_as(g).reshape(2, -1) + 1e-7
    err = (y - x).abs()
    assert (err <= bound).all()
    assert (err / bound).max() > 0.4


def test_hadamard_fp8_round_trip_bound():
    x = activations((2, 1024), seed=6)
    y = PS.hadamard_fp8_qdq(x, 128)
    # The rotation is orthonormal: per group, the L2 error is that of the e4m3 codes in the rotated domain.
    r = (x.view(-1, 128) @ PS._hadamard_matrix(128))
    inv = r.abs().amax(-1, keepdim=True) / 448
    elem = torch.maximum(r.abs() * kFp8Rel, inv * kFp8Sub)
    bound = elem.norm(dim=-1) * (1 + 1e-4) + 1e-6
    err = (y - x).view(-1, 128).norm(dim=-1)
    assert (err <= bound).all()
    # the rotation spreads the outlier channel: the error is far below e4m3's on the raw outlier group
    assert err.max() < (x.view(-1, 128).abs().amax(-1) * kFp8Rel).max()


def test_outlier_int4_round_trip_bound():
    x = activations((2, 16, 128), seed=7, outlier_channel=9)
    y = PS.outlier_int4_qdq(x, 2)
    # the outlier channel is kept (fp16 rounding only)
    assert torch.allclose(y[..., 9], x[..., 9], rtol=kFp16Rel, atol=0)
    top = x.abs().amax(1).topk(2, dim=-1).indices
    keep = torch.zeros(2, 1, 128, dtype=torch.bool)
    keep.scatter_(2, top[:, None, :], True)
    inl = torch.where(keep, 0.0, x)
    s = f16(inl.abs().amax(-1, keepdim=True) / 7)
    err = (y - x).abs()
    bound = s * (0.5 + 7 * kFp16Rel) + 1e-7
    assert (err <= bound)[~keep.expand_as(x)].all()
    assert (err / bound)[~keep.expand_as(x)].max() > 0.4


# ----------------------------------------------------------------------------------------------------
# The all-reduces: two-shot peers quantize every value twice
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("name", ["quickreduce_int4", "quickreduce_int8"])
def test_quickreduce_two_shot_is_the_manual_composition(name, P):
    fmt = PEERS[name]
    parts = activations((P, 8, 576), seed=P)
    y = fmt.all_reduce(parts)
    copies = PS.quickreduce_qdq(parts.reshape(P, -1), fmt.bits)  # every copy quantized, the own one too
    acc = torch.zeros_like(copies[0])
    for r in range(P):
        acc = f16(acc + copies[r])                                # fp16 sum from zero in rank order
    manual = PS.quickreduce_qdq(acc[None], fmt.bits)[0].view(8, 576)
    assert torch.equal(y, manual)
    # quantized twice: not the sum's single round trip, nor the sum of the first round trips
    assert not torch.equal(y, PS.quickreduce_qdq(parts.sum(0).reshape(1, -1), fmt.bits)[0].view(8, 576))
    assert not torch.equal(y, acc.view(8, 576))


@pytest.mark.parametrize("name", ["vllm_int8", "vllm_fp8", "flashinfer_fp8"])
def test_kraken_two_shot_and_the_owner_stripe(name):
    fmt, P = PEERS[name], 4
    parts = activations((P, 64, 576), seed=11)       # 36864 values: 9 stripes of 4096
    y = fmt.all_reduce(parts).reshape(-1)
    copies = fmt.qdq(parts.reshape(P, -1))
    acc = copies[0] + copies[1] + copies[2] + copies[3]
    twice = fmt.qdq(acc[None])[0]
    own = (torch.arange(acc.numel()) // 4096) % P == 0   # rank 0's stripes: its fp32 sum, not requantized
    assert own.sum() == 3 * 4096
    assert torch.equal(y[own], acc[own])
    assert torch.equal(y[~own], twice[~own])
    assert not torch.equal(twice[~own], acc[~own])


@pytest.mark.parametrize("name", ["flashcomm_int4", "taco_fp8"])
def test_echo_layout_two_shot_is_the_manual_composition(name):
    fmt, P = PEERS[name], 4
    parts = activations((P, 8, 576), seed=12)
    n = parts[0].numel()
    y = fmt.all_reduce(parts).reshape(-1)
    padded = -(-n // (P * fmt.group_size)) * P * fmt.group_size
    x = torch.nn.functional.pad(parts.reshape(P, -1), (0, padded - n))
    copies = fmt.qdq(x)
    seg = padded // P
    acc = torch.empty(padded)
    for j in range(P):  # the owner j keeps its own copy exact and sums in rank order
        terms = [x[r, j * seg:(j + 1) * seg] if r == j else copies[r, j * seg:(j + 1) * seg] for r in range(P)]
        total = terms[0]
        for t in terms[1:]:
            total = total + t
        acc[j * seg:(j + 1) * seg] = total
    manual = fmt.qdq(acc[None])[0][:n]
    assert torch.equal(y, manual)
    assert not torch.equal(y, acc[:n])


def test_dong_is_quantized_once():
    fmt, P = PEERS["dong_int4_outliers"], 4
    parts = activations((P, 8, 576), seed=13)
    y = fmt.all_reduce(parts)
    copies = fmt.qdq(parts)
    manual = parts[0] + copies[1] + copies[2] + copies[3]
    assert torch.equal(y, manual)
    assert not fmt.two_shot


@pytest.mark.parametrize("name", list(PEERS))
def test_all_reduce_error_is_bounded_and_nonzero(name):
    parts = activations((4, 8, 576), seed=14)
    exact = parts.sum(0)
    y = PEERS[name].all_reduce(parts)
    assert y.shape == exact.shape and y.dtype == parts.dtype
    rel = float((y - exact).norm() / exact.norm())
    assert 0 < rel < (0.5 if PEERS[name].bits == 4 else 0.1)
    assert torch.equal(PEERS[name].all_reduce(parts[:1]), parts[0])   # P = 1: nothing to reduce


# ----------------------------------------------------------------------------------------------------
# The CLI
# ----------------------------------------------------------------------------------------------------

def test_cli_help_lists_the_peers(capsys):
    from echo_ds.eval.__main__ import main
    with pytest.raises(SystemExit):
        main(["perplexity", "--help"])
    out = capsys.readouterr().out.replace("\n", " ")
    assert "--peer NAME" in out
    for name in PEERS:
        assert name in out


def test_cli_runs_peers_on_a_tiny_model(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from echo_ds.eval.__main__ import main

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    model_dir = tmp_path / "tiny"
    model.save_pretrained(model_dir)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(model_dir)
    text = tmp_path / "text.txt"
    text.write_text("Now is the winter of our discontent made glorious summer by this sun of York. " * 12)
    out_json = tmp_path / "r.json"
    rc = main(["perplexity", "--model", str(model_dir), "--text", str(text), "--tokens", "200", "--seq-len", "64",
               "--tp", "2", "--peer", "quickreduce_int4", "--peer", "vllm_fp8", "--peer", "dong_int4_outliers",
               "--json", str(out_json), "--no-progress"])
    assert rc == 0
    doc = json.loads(out_json.read_text())
    base, qr4, fp8, dong = doc["results"]
    assert [r["name"] for r in doc["results"]] == ["16bit", "quickreduce_int4", "vllm_fp8", "dong_int4_outliers"]
    assert qr4["wire_bits_per_element"] == pytest.approx(4.5)
    assert fp8["wire_bits_per_element"] == pytest.approx(8.125)
    assert dong["wire_bits_per_element"] == pytest.approx((63 * 4 + 16 + 16) / 64)
    for r in (qr4, fp8, dong):
        assert r["echo"] is None and r["peer"]["name"] == r["name"]
        assert math.isfinite(r["ppl"]) and r["kl"] > 0 and 0 < r["top1_agreement"] <= 1
    assert fp8["kl"] < qr4["kl"]
    assert base["kl"] == 0 and base["echo"] is None
    assert "| quickreduce_int4 | 4.50 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["perplexity", "--model", str(model_dir), "--peer", "no_such_peer"])
