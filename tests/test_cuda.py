"""CUDA-only tests (skipped, and reported as skipped, without a GPU; `make gpu-check` runs them on
one): mixed precision training, compile, the SDPA fast path, BCA in half precision, and cached
decoding on the GPU."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import model
import train
from model import GPT, AttentionPlan, GPTConfig
from test_train import read_log, tiny_args, words_dataset

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return words_dataset(tmp_path_factory.mktemp("data"))


def tiny(pos, **kw):
    torch.manual_seed(0)
    cfg = dict(block_size=64, vocab_size=101, n_layer=2, n_head=4, n_embd=128, pos=pos) | kw
    return GPT(GPTConfig(**cfg)).cuda()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mixed_precision_training(data_dir, tmp_path, dtype):
    train.main(tiny_args(data_dir, tmp_path / "run", device="cuda", dtype=dtype, max_iters=8))
    steps, evals = read_log(tmp_path / "run")
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    if dtype == "float16":  # the GradScaler is on, and says so in the log
        assert all("grad_scale" in r for r in steps)
    else:
        assert not any("grad_scale" in r for r in steps)


def test_compile_training(data_dir, tmp_path):
    train.main(tiny_args(data_dir, tmp_path / "run", device="cuda", dtype="bfloat16", compile=True,
                         max_iters=3))
    steps, _ = read_log(tmp_path / "run")
    assert len(steps) == 3 and all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)


@pytest.mark.parametrize("pos", ["learned", "rope", "xpos", "none"])
def test_plain_causal_training_takes_the_flash_path(pos):
    """Training attention is SDPA's is_causal path with no mask, which FlashAttention serves: with
    every other backend switched off, the step still runs (SDPA raises when no
    allowed backend fits)."""
    m = tiny(pos).train()
    idx = torch.randint(0, 101, (4, 64), device="cuda")
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = m(idx, idx)
    loss.backward()
    assert torch.isfinite(loss)


# None: auto, BCA past block_size
RULES = [None, "sliding", model.AttentionRule("sinks", window=48, sinks=4)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pos", ["xpos", "rope", "alibi"])
@pytest.mark.parametrize("rule", RULES)
def test_windows_at_16_blocks_in_half_precision(pos, dtype, rule):
    m = tiny(pos).eval()
    with torch.no_grad():
        m.transformer.h[0].attn.c_attn.weight.mul_(30)  # |q|, |k| as large as a trained model's
    idx = torch.randint(0, 101, (2, 16 * 64), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
        logits, loss = m(idx, idx, attention=rule)
        streamed = m.token_nll(idx, idx, attention=rule, chunk_tokens=300)
    assert torch.isfinite(logits).all() and torch.isfinite(loss) and torch.isfinite(streamed).all()
    full = F.cross_entropy(logits.flatten(0, 1), idx.flatten(), reduction="none").view(2, -1)
    torch.testing.assert_close(streamed, full, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("pos", ["xpos", "rope", "alibi", "sinusoidal"])
@pytest.mark.parametrize("rule", RULES)
def test_cached_decoding_matches_full_forward(pos, rule, monkeypatch):
    # train.py's runs above turn it on
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    m = tiny(pos).eval()
    seq = torch.randint(0, 101, (2, 200), device="cuda")
    cache = m.new_cache(199, rule)
    with torch.no_grad():
        cached = [m(seq[:, :37], cache=cache)[0][:, -1]]
        for t in range(37, 199):
            cached.append(m(seq[:, t : t + 1], cache=cache)[0][:, -1])
        full = m(seq[:, :199], seq[:, 1:200], attention=rule)[0]
    torch.testing.assert_close(torch.stack(cached, 1), full[:, 36:], rtol=1e-4, atol=1e-4)
    assert cache[0].held <= 2 * cache[0].plan.segment  # one window's keys held


@pytest.mark.parametrize("method", ["pi", "ntk", "yarn"])
def test_interpolation_in_half_precision(method):
    m = tiny("rope").eval()
    with torch.no_grad():
        m.transformer.h[0].attn.c_attn.weight.mul_(30)
    idx = torch.randint(0, 101, (1, 16 * 64), device="cuda")
    with torch.no_grad():
        want = m(idx, idx, attention="causal", rope_scaling=method)[1]
        with torch.autocast("cuda", dtype=torch.float16):
            loss = m(idx, idx, attention="causal", rope_scaling=method)[1]
    assert torch.isfinite(loss) and abs(loss.item() - want.item()) < 0.02


def test_xpos_float16_without_bca_stays_finite():
    m = tiny("xpos", block_size=1024, n_layer=1).eval()
    with torch.no_grad():
        m.transformer.h[0].attn.c_attn.weight.mul_(30)
    idx = torch.randint(0, 101, (1, 16384), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        logits, loss = m(idx, idx, attention="causal")
    assert torch.isfinite(logits).all() and torch.isfinite(loss)
    assert AttentionPlan(m.config, 16384, "causal").span < 16384  # the queries went in spans here
