"""Tests for model.py: xPos against the paper's formula, BCA against its closed form,
causality, cached decoding."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias

import alternatives
import model
import read_path
import resolution
from model import GPT, POSITION_SCHEMES, AttentionPlan, GPTConfig, alibi_slopes

torch.set_num_threads(2)
# every scheme that may run past block_size
RELATIVE_OR_NONE = ("sinusoidal", "rope", "alibi", "xpos", "none")


def tiny(pos, **kw):
    cfg = dict(block_size=8, vocab_size=23, n_layer=2, n_head=2, n_embd=16, pos=pos)
    cfg.update(kw)
    torch.manual_seed(0)
    return GPT(GPTConfig(**cfg)).eval()


def tokens(T, vocab=23, seed=1, batch=2):
    return torch.randint(0, vocab, (batch, T), generator=torch.Generator().manual_seed(seed))


# --- xPos -----------------------------------------------------------------------------------------


def factors(plan, queries, keys):
    """The plan's factors of q at `queries` and k at `keys`, (n, d/2, 2): what its rotation makes
    of the pair 1 + 0i."""
    d = 2 * plan.rotation.size(1)
    def ones(n):
        return torch.zeros(n, d).index_fill_(1, torch.arange(0, d, 2), 1.0)
    q, k = plan.rotate(ones(len(queries)), ones(len(keys)), queries, keys)
    return q.unflatten(-1, (-1, 2)), k.unflatten(-1, (-1, 2))


def positioned(q, k, q_pos, k_pos, cfg):
    """q at the positions q_pos and k at k_pos (ranges), times model.py's AttentionPlan factors
    (Algorithm 1's pairs as complex numbers)."""
    table = AttentionPlan(cfg, max(q_pos.stop, k_pos.stop), "causal")
    def pairs(x):
        return torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    def turn(x, f):  # f: (T, d/2, 2)
        return torch.view_as_real(pairs(x) * torch.view_as_complex(f)).flatten(-2)
    q_factor, k_factor = factors(table, q_pos, k_pos)
    return turn(q, q_factor), turn(k, k_factor)


def scores(q, k, q_pos, k_pos, **kw):
    qr, kr = positioned(q, k, q_pos, k_pos, GPTConfig(n_head=1, n_embd=q.size(-1), **kw))
    return qr @ kr.transpose(-1, -2)


def test_xpos_without_decay_is_rope_exactly():
    rope, xpos = tiny("rope"), tiny("xpos", xpos_scale_base=float("inf"))
    xpos.load_state_dict(rope.state_dict())
    idx = tokens(29)
    for rule in ("causal", "bca", "sliding", "sinks"):
        assert torch.equal(rope(idx, idx, attention=rule)[0], xpos(idx, idx, attention=rule)[0])
    # and the decay really is on by default: the same q, k score differently at a distance
    torch.manual_seed(0)
    q, k, pos = torch.randn(1, 1, 600, 16), torch.randn(1, 1, 600, 16), range(600)
    assert not torch.allclose(scores(q, k, pos, pos, pos="rope"),
                              scores(q, k, pos, pos, pos="xpos"), atol=1e-2)


@pytest.mark.parametrize("rotate", [True, False])
def test_xpos_scores_depend_only_on_distance(rotate):
    torch.manual_seed(0)
    q, k = torch.randn(2, 1, 40, 32), torch.randn(2, 1, 40, 32)
    pos, far = range(40), range(1000, 1040)
    base = scores(q, k, pos, pos, pos="xpos", xpos_rotate=rotate)
    shifted = scores(q, k, far, far, pos="xpos", xpos_rotate=rotate)
    # float32 angles at 1000 rad: ~1e-4 off
    torch.testing.assert_close(shifted, base, rtol=1e-3, atol=1e-3)
    # a different total length moves the scale's centre; the scores of the shared
    # prefix must not move
    longer = scores(torch.cat([q, q], 2), torch.cat([k, k], 2), range(80), range(80), pos="xpos",
                    xpos_rotate=rotate)
    torch.testing.assert_close(longer[..., :40, :40], base, rtol=1e-4, atol=1e-4)
    # and a query/key pair at distance 5 scores the same wherever it sits
    one_q, one_k = q[:, :, :1], k[:, :, :1]
    def at(m, n):
        return scores(one_q, one_k, range(m, m + 1), range(n, n + 1), pos="xpos",
                      xpos_rotate=rotate)
    torch.testing.assert_close(at(7, 2), at(3007, 3002), rtol=1e-4, atol=1e-4)


def complex_reference(q, k, m, n, gamma=0.4, scale_base=512.0, rotate=True):
    """Paper §3.2 in complex numbers, float64: <q e^(xi m + i theta m), k e^(-xi n - i theta n)>
    with zeta^(1/512)."""
    d = q.size(-1)
    i = torch.arange(d // 2, dtype=torch.float64)
    theta = 1.0 / 10000 ** (2 * i / d) if rotate else torch.zeros(d // 2, dtype=torch.float64)
    zeta = (i / (d / 2) + gamma) / (1 + gamma)
    qc = torch.complex(q[..., 0::2].double(), q[..., 1::2].double())
    kc = torch.complex(k[..., 0::2].double(), k[..., 1::2].double())
    fq = qc * torch.exp(1j * m * theta) * zeta ** (m / scale_base)
    fk = kc * torch.exp(1j * n * theta) * zeta ** (-n / scale_base)
    return (fq * fk.conj()).real.sum(-1)  # the pseudo inner product sum Re(x_i y_i*)


@pytest.mark.parametrize("rotate", [True, False])
def test_xpos_matches_complex_reference(rotate):
    torch.manual_seed(0)
    d, T = 64, 300
    q, k = torch.randn(T, d), torch.randn(T, d)
    got = scores(q[None, None], k[None, None], range(T), range(T), pos="xpos",
                 xpos_rotate=rotate)[0, 0]
    for m, n in [(0, 0), (5, 0), (299, 0), (299, 298), (150, 17), (42, 42)]:
        want = complex_reference(q[m], k[n], m, n, rotate=rotate)
        assert abs(got[m, n].item() - want.item()) < 1e-4 * (1 + abs(want.item())), (m, n)


def test_rope_rotation_matches_complex_multiplication():
    torch.manual_seed(0)
    d = 16
    q = torch.randn(1, 1, 10, d)
    pos = range(363, 373)
    qr, _ = positioned(q, q, pos, pos, GPTConfig(n_head=1, n_embd=d, pos="rope"))
    theta = 1.0 / 10000 ** (torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    angle = torch.tensor(pos, dtype=torch.float64)[:, None] * theta
    qc = torch.complex(q[..., 0::2].double(), q[..., 1::2].double()) * torch.exp(1j * angle)
    want = torch.stack([qc.real, qc.imag], -1).flatten(-2)
    torch.testing.assert_close(qr.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("pos, attention", [("xpos", "causal"), ("xpos", "bca"),
                                            ("rope", "sliding")])
def test_compiled_rotation_is_real_arithmetic_and_equals_eager(pos, attention):
    """Under torch.compile the graph holds no complex tensor, neither the table nor q and k
    (Inductor generates no code for complex operations and leaves them to eager kernels), and the
    compiled loss and gradients equal eager ones."""
    # compiled GPT.forward of other tests count towards dynamo's recompile limit
    torch._dynamo.reset()
    graphs = []
    # a dynamo backend that keeps the traced graph and runs it as traced
    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    m, x = tiny(pos), tokens(24)
    # BCA's CausalBias mask breaks the graph, once
    torch.compile(m, backend=record)(x, x, attention=attention)
    values = [n.meta.get("example_value") for g in graphs for n in g.graph.nodes]
    assert graphs and not [v for v in values if isinstance(v, torch.Tensor) and v.is_complex()]
    losses, grads = [], []
    for forward in (m, torch.compile(m)):  # eager, then Inductor's C++ kernels
        m.zero_grad()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = forward(x, x, attention=attention)[1]
        assert not [w for w in caught if "complex" in str(w.message)]
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in m.parameters()])
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_compiled_passes_through_xpos_spans_and_the_kv_cache_equal_eager():
    """torch.compile where attend meets many ranges of positions: xPos's float16 spans (a scale base
    of 2 makes a span 17 queries) under causal attention, BCA and sinks, and decoding through the KV
    cache a token at a time. Dynamo compiles attend on its own at several ranges there; each pass
    must run and equal the eager one."""
    torch._dynamo.reset()
    m, x = tiny("xpos", block_size=32, xpos_scale_base=2.0), tokens(75)
    assert (AttentionPlan(m.config, 75, "causal").span < 75
            and AttentionPlan(m.config, 75, "bca").span < 32)
    compiled = torch.compile(m, backend="aot_eager")
    with torch.no_grad():
        for rule in ("causal", "bca", model.AttentionRule("sinks", 24, 3)):
            torch.testing.assert_close(compiled(x, x, attention=rule)[0],
                                       m(x, x, attention=rule)[0])
        want = m(x, x)[0]
        cache = m.new_cache(75)
        got = [compiled(x[:, :20], x[:, :20], cache=cache)[0]]
        got += [compiled(x[:, t : t + 1], x[:, t : t + 1], cache=cache)[0] for t in range(20, 75)]
    torch.testing.assert_close(torch.cat(got, dim=1), want, rtol=1e-5, atol=1e-5)


# --- attention rules: bca, sliding, sinks ---------------------------------------------------------
# Each rule is written out here from its definition (the paper §3.3 for BCA, StreamingLLM for
# sinks): which keys query t sees, and at what distance a relative scheme sees each of them. The
# model must match a brute-force T x T attention built from that alone.

SINKS_6_2 = model.AttentionRule("sinks", window=6, sinks=2)
SLIDING_5 = model.AttentionRule("sliding", window=5)


def rule_table(rule, T, block_size=8):
    """(visible, distance), both T x T, for `rule` (a name or an AttentionRule) written
    from its definition."""
    rule = rule if isinstance(rule, model.AttentionRule) else model.AttentionRule(rule)
    W, S, H = rule.window or block_size, rule.sinks, block_size // 2
    t, n = torch.arange(T)[:, None], torch.arange(T)[None, :]
    past = n <= t
    distance = (t - n).expand(T, T)
    if rule.name == "causal":
        return past, distance
    if rule.name == "bca":  # the whole previous segment and its own
        return past & (n >= ((t // H - 1) * H).clamp(min=0)), distance
    if rule.name == "sliding":
        return past & (t - n < W), distance
    # sinks: the first S tokens and the W-S most recent; the query stands at min(t, W-1)
    # as seen from the sinks
    sink = n < S
    return past & (sink | (t - n < W - S)), torch.where(sink, t.clamp(max=W - 1) - n, distance)


def reference_scores(q, k, distance, config, theta=None, sharpen=1.0):
    """Pre-softmax scores from the schemes' formulas at the given distances, float64: RoPE/xPos as
    complex numbers (pair j of q times conj(k) times e^(i*D*theta_j) * zeta_j^(D/scale_base)),
    ALiBi's bias -slope*D, else q.k."""
    d = q.size(-1)
    j = torch.arange(d // 2, dtype=torch.float64)
    D = distance.double()
    if config.pos in ("rope", "xpos"):
        theta = 1.0 / config.rope_base ** (2 * j / d) if theta is None else theta.double()
        zeta = ((2 * j + config.xpos_gamma * d) / ((1 + config.xpos_gamma) * d)
                if config.pos == "xpos" else j * 0 + 1)
        qc = torch.complex(q[..., 0::2].double(), q[..., 1::2].double())
        kc = torch.complex(k[..., 0::2].double(), k[..., 1::2].double())
        rel = torch.exp(1j * D[..., None] * theta) * zeta ** (D[..., None] / config.xpos_scale_base)
        s = (qc[..., :, None, :] * kc[..., None, :, :].conj() * rel).real.sum(-1) * sharpen**2
    else:
        s = q.double() @ k.double().transpose(-1, -2)
    s = s / math.sqrt(d)
    if config.pos == "alibi":
        s = s - alibi_slopes(q.size(1)).double()[:, None, None] * D
    return s


def brute_force_attention(rule, **reference):
    """A CausalSelfAttention.forward that attends through the T x T reference above."""
    def forward(self, x, table, cache=None):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).view(B, T, 3, self.config.n_head,
                                      C // self.config.n_head).permute(2, 0, 3, 1, 4)
        visible, distance = rule_table(rule, T, self.config.block_size)
        s = reference_scores(q, k, distance, self.config, **reference).masked_fill(~visible,
                                                                                   float("-inf"))
        y = (torch.softmax(s, dim=-1) @ v.double()).float()
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))
    return forward


@pytest.mark.parametrize("pos", POSITION_SCHEMES)
def test_every_rule_is_plain_causal_up_to_its_first_block(pos):
    m = tiny(pos)
    for rule, T_max in (("bca", 8), ("sliding", 8), ("sinks", 8), (SLIDING_5, 5), (SINKS_6_2, 6)):
        for T in (1, 3, T_max):
            idx = tokens(T)
            torch.testing.assert_close(m(idx, idx, attention=rule)[0],
                                       m(idx, idx, attention="causal")[0], rtol=1e-5, atol=1e-5)
    idx = tokens(8)
    # auto is causal at T = block_size
    assert torch.equal(m(idx, idx)[0], m(idx, idx, attention="causal")[0])


@pytest.mark.parametrize("pos", RELATIVE_OR_NONE)
@pytest.mark.parametrize("rule", ["bca", "sliding", "sinks", SLIDING_5, SINKS_6_2, None])
def test_rules_match_a_brute_force_mask(pos, rule, monkeypatch):
    m = tiny(pos)
    idx = tokens(5 * 4 + 3)  # not a multiple of any block here (4, 5, 6, 8)
    fast = m(idx, idx, attention=rule)[0]  # None: auto, BCA at T > block_size
    # the rule changes something
    assert (fast - m(idx, idx, attention="causal")[0]).abs().max() > 1e-4
    monkeypatch.setattr(model.CausalSelfAttention, "forward", brute_force_attention(rule or "bca"))
    torch.testing.assert_close(fast, m(idx, idx)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rule", [SLIDING_5, SINKS_6_2])
def test_rules_match_a_brute_force_mask_for_learned_positions(rule, monkeypatch):
    """learned stops at block_size = 8, so its windows must be shorter than that
    to change anything."""
    m = tiny("learned")
    idx = tokens(8)
    fast = m(idx, idx, attention=rule)[0]
    assert (fast - m(idx, idx, attention="causal")[0]).abs().max() > 1e-4
    monkeypatch.setattr(model.CausalSelfAttention, "forward", brute_force_attention(rule))
    torch.testing.assert_close(fast, m(idx, idx)[0], rtol=1e-5, atol=1e-5)


def test_causal_attention_matches_the_brute_force_too(monkeypatch):
    for pos in RELATIVE_OR_NONE:
        m = tiny(pos)
        idx = tokens(23)
        fast = m(idx, idx, attention="causal")[0]
        monkeypatch.setattr(model.CausalSelfAttention, "forward", brute_force_attention("causal"))
        torch.testing.assert_close(fast, m(idx, idx)[0], rtol=1e-5, atol=1e-5)
        monkeypatch.undo()


@pytest.mark.parametrize("pos", RELATIVE_OR_NONE)
@pytest.mark.parametrize("rule", ["bca", SLIDING_5, SINKS_6_2])
def test_rule_reach_in_one_layer(pos, rule):
    """With one layer, token s reaches position t exactly when the rule lets t see s."""
    m = tiny(pos, n_layer=1)
    idx = tokens(31, batch=1)
    base = m(idx, idx, attention=rule)[0]
    visible, _ = rule_table(rule, 31)
    for s in (0, 1, 3, 4, 9, 17):
        changed = idx.clone()
        changed[0, s] = (changed[0, s] + 1) % 23
        moved = (m(changed, changed, attention=rule)[0] - base).abs().amax(-1)[0] > 1e-6
        assert torch.equal(moved, visible[:, s]), s


@pytest.mark.parametrize("pos", RELATIVE_OR_NONE)
def test_bca_reach_through_the_layers_is_bounded_exactly(pos):
    """Information moves back at most one segment per layer under BCA: a token before (t//H -
    n_layer)*H cannot change the logits at t, bitwise; the token at that edge does."""
    m = tiny(pos, n_layer=3)  # H = 4
    with torch.no_grad():  # a trained model's attention passes more on than one at initialisation
        for block in m.transformer.h:
            block.attn.c_proj.weight.mul_(30)
    idx = tokens(45, batch=1)
    base = m(idx, idx, attention="bca")[0]
    for t in (23, 30, 37, 44):
        edge = (t // 4 - 3) * 4
        for s, moves in ((edge - 1, False), (edge, True)):
            changed = idx.clone()
            changed[0, s] = (changed[0, s] + 1) % 23
            logits = m(changed, changed, attention="bca")[0]
            assert torch.equal(logits[0, t], base[0, t]) != moves, (t, s)


@pytest.mark.parametrize("pos", ("rope", "xpos", "none"))
def test_bca_scores_a_sequence_the_same_alone_or_in_a_batch(pos):
    """Each row of a batch gets the logits it gets alone, bitwise, under BCA: a torchrun evaluation,
    a document a rank, then equals one process's (tests/test_eval_extrapolate.py). Fails on some
    CPUs (AVX-512) where q is strided at batch 1 alone."""
    m = tiny(pos)
    for seed in range(12):
        for T in (16, 27, 40):
            idx = tokens(T, seed=seed, batch=3)
            batched = m(idx, idx, attention="bca")[0]
            for row in range(3):
                alone = m(idx[row : row + 1], idx[row : row + 1], attention="bca")[0]
                assert torch.equal(alone[0], batched[row]), (seed, T, row)


@pytest.mark.parametrize("rule, most_keys", [("bca", 16), (model.AttentionRule("sliding", 12), 24),
                                             (model.AttentionRule("sinks", 12, 4), 28)])
def test_windows_never_build_a_t_by_t_matrix(rule, most_keys, monkeypatch):
    m = tiny("xpos", block_size=16)
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append(k.size(-2))
        return sdpa(q, k, v, **kw)

    # the sinks' own softmax: the window's keys and the sinks
    def sinks_spy(q, k, v, table, queries, keys, sink_kv):
        seen.append(k.size(-2) + sink_kv[0].size(-2))
        return with_sinks(q, k, v, table, queries, keys, sink_kv)

    with_sinks = alternatives.attention_with_sinks
    monkeypatch.setattr(model.F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(alternatives, "attention_with_sinks", sinks_spy)
    idx = tokens(64 * 16, batch=1)
    m(idx, attention=rule)
    assert seen and max(seen) == most_keys  # two blocks, and the sinks
    seen.clear()
    m.token_nll(idx, idx, attention=rule, chunk_tokens=50)  # streamed through a cache of one window
    assert seen and max(seen) == most_keys


def test_a_window_longer_than_the_sequence_costs_only_the_sequence():
    m = tiny("rope")
    huge = model.AttentionRule("sliding", 10**9)
    cache = m.new_cache(10, huge)
    m(tokens(3), cache=cache)
    assert cache[0].k.size(2) == 10 and AttentionPlan(m.config, 10, huge).frame == 10
    torch.testing.assert_close(m(tokens(10), attention=huge)[0],
                               m(tokens(10), attention="causal")[0])


def test_attention_rule_errors():
    with pytest.raises(ValueError,
                       match="attention='window' is not allowed: must be one of auto, causal, bca"):
        tiny("xpos")(tokens(4), attention="window")
    with pytest.raises(ValueError, match="window=0 is not allowed"):
        model.AttentionRule("sliding", 0)
    with pytest.raises(ValueError, match="sinks=8 is not allowed with window=8"):
        tiny("xpos")(tokens(4), attention=model.AttentionRule("sinks", sinks=8))
    with pytest.raises(ValueError, match="attention=True is not allowed"):
        tiny("xpos")(tokens(4), attention=True)


# --- RoPE interpolation: PI, NTK, dynamic NTK, YaRN -----------------------------------------------
# Each method's theta'_j written out here from its paper's formula, independently of model.py.


def paper_theta(method, s, d=64, base=10000.0, l=1024, alpha=1.0, beta=32.0):
    j = torch.arange(d // 2, dtype=torch.float64)
    theta = base ** (-2 * j / d)
    if method == "pi":  # Chen et al.: position m -> m / s
        return theta / s
    if method in ("ntk", "dynamic_ntk"):  # base -> base * s^(d/(d-2))
        return (base * s ** (d / (d - 2))) ** (-2 * j / d)
    # YaRN as the official jquesnelle/yarn and Hugging Face compute it (find_correction_range,
    # linear_ramp_mask): a ramp linear in the pair index between the pairs where the turns over l
    # are beta (beta_fast, 32) and alpha (beta_slow, 1), rounded out
    def dim(rotations):
        return d * math.log(l / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low, high = max(math.floor(dim(beta)), 0), min(math.ceil(dim(alpha)), d - 1)
    high = high + 0.001 if low == high else high
    extrapolate = 1 - ((j - low) / (high - low)).clamp(0, 1)
    return theta / s * (1 - extrapolate) + theta * extrapolate


SCALINGS = ("pi", "ntk", "dynamic_ntk", "yarn")


def sharpened(m):
    """Sharper attention than at initialisation, as after training, so that
    positions matter more."""
    with torch.no_grad():
        for block in m.transformer.h:
            block.attn.c_attn.weight.mul_(4)
    return m
BIG = dict(block_size=1024, n_head=1, n_embd=64, pos="rope")


@pytest.mark.parametrize("method", SCALINGS)
def test_interpolated_frequencies_match_the_papers_formulas(method):
    cfg = GPTConfig(**BIG)
    for s in (1.5, 4.0, 32.0):
        theta, _ = alternatives.interpolate(AttentionPlan(cfg, 1).theta, model.RopeScaling(method),
                                            s, 1024, cfg.rope_base)
        torch.testing.assert_close(theta.double(), paper_theta(method, s), rtol=1e-6, atol=0)
    # the three regimes are all there at these defaults: kept, ramped, interpolated
    if method == "yarn":
        theta, s = paper_theta("none", 1), 4.0
        kept = paper_theta("yarn", s) == theta
        interpolated = torch.isclose(paper_theta("yarn", s), theta / s, rtol=1e-12, atol=0)
        assert kept.any() and interpolated.any() and (~kept & ~interpolated).any()


@pytest.mark.parametrize("l, d", [(128, 32), (64, 16), (1024, 64), (4096, 128), (16, 8), (32, 2)])
def test_yarn_follows_the_official_ramp_at_the_studys_shapes(l, d):
    """At the study's l = 128, d = 32 the official ramp keeps the fastest pair wholly unscaled (the
    paper's continuous ramp in r_j would keep 0.625 of it); every shape against the official
    formula, written out above."""
    for s in (2.0, 16.0):
        cfg = GPTConfig(block_size=l, n_head=1, n_embd=d, pos="rope")
        theta, sharpen = alternatives.interpolate(AttentionPlan(cfg, 1).theta,
                                                  model.RopeScaling("yarn"), s, l, cfg.rope_base)
        torch.testing.assert_close(theta.double(), paper_theta("yarn", s, d=d, l=l), rtol=1e-6,
                                   atol=0)
        assert sharpen == pytest.approx(0.1 * math.log(s) + 1)
        assert theta[0] == 1.0  # the fastest pair is kept


def test_yarn_ramp_ends_use_ln_base_in_float64():
    """The ramp's ends come from ln(base) in float64, as Hugging Face's find_correction_range (the
    test's paper_theta) computes them: at base 1e4, d = 134, l = 886 the pair turning once over l is
    at j = 36.000002, so the ramp ends at 37 (float32 theta_1 would round it to exactly 36 and
    move 26 pairs' angles by up to 10%)."""
    l, d, s = 886, 134, 4.0
    edge = d * math.log(l / (2 * math.pi)) / (2 * math.log(1e4))
    assert 36 < edge < 36 + 1e-5  # the case: float64 puts it just above 36
    cfg = GPTConfig(block_size=l, n_head=1, n_embd=d, pos="rope")
    table = AttentionPlan(cfg, 2, "causal", model.RopeScaling("yarn", s)).rotation  # (2, d/2, 2)
    theta = torch.atan2(table[1, :, 1].double(), table[1, :, 0].double())  # angle at position 1
    torch.testing.assert_close(theta, paper_theta("yarn", s, d=d, l=l), rtol=1e-6, atol=0)


def angles_at_one(plan):
    """A plan's rotation at position 1: each pair's angle theta'_j and its magnitude."""
    table = plan.rotation[1].double()  # (d/2, 2)
    return torch.atan2(table[:, 1], table[:, 0]), table.norm(dim=-1)


@pytest.mark.parametrize("alpha, beta", [(0.25, 4.0), (0.5, 8.0), (2.0, 16.0), (1.0, 32.0)])
def test_yarn_ramp_ends_are_the_official_beta_slow_and_beta_fast(alpha, beta):
    """YaRN's ends, tuned for the study's head dimension 32 at l = 128: given to RopeScaling, or
    stored by a fine-tune in its config, they move the ramp as the official code's beta_slow
    (alpha) and beta_fast (beta) do."""
    l, d, s = 128, 32, 4.0
    want = paper_theta("yarn", s, d=d, l=l, alpha=alpha, beta=beta)
    cfg = GPTConfig(block_size=l, n_head=1, n_embd=d, pos="rope")
    asked = model.RopeScaling("yarn", s, alpha=alpha, beta=beta)
    theta, norm = angles_at_one(AttentionPlan(cfg, 2, "causal", asked))
    torch.testing.assert_close(theta, want, rtol=1e-6, atol=0)
    tuned = GPTConfig(block_size=4 * l, n_head=1, n_embd=d, pos="rope", rope_scaling="yarn",
                      rope_factor=s, rope_original_length=l, yarn_alpha=alpha, yarn_beta=beta)
    theta, norm = angles_at_one(AttentionPlan(tuned, 2, "causal"))
    torch.testing.assert_close(theta, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(norm, torch.full_like(norm, 0.1 * math.log(s) + 1))


def test_yarn_ramp_end_errors():
    with pytest.raises(ValueError, match="apply to rope_scaling='yarn' only, not 'pi'"):
        model.RopeScaling("pi", 2.0, alpha=2.0)
    with pytest.raises(ValueError, match="yarn_alpha=4.0, yarn_beta=2.0 are not allowed"):
        model.RopeScaling("yarn", 2.0, alpha=4.0, beta=2.0)
    with pytest.raises(ValueError, match="GPTConfig.yarn_alpha=2.0 is not allowed: yarn_alpha "
                                         "and yarn_beta apply to rope_scaling='yarn' only"):
        GPTConfig(pos="rope", rope_scaling="pi", rope_factor=2.0, yarn_alpha=2.0)
    with pytest.raises(ValueError, match="GPTConfig.yarn_alpha=0.0 is not allowed"):
        GPTConfig(pos="rope", rope_scaling="yarn", rope_factor=2.0, yarn_alpha=0.0)


@pytest.mark.parametrize("n", [16, 64, 128, 512])
def test_yarn_without_a_factor_is_the_official_dynamic_rule_on_a_fine_tune(n):
    """YaRN's dynamic scaling (Peng et al. 2023, section 3.3), as the official
    LlamaDynamicYaRNScaledRotaryEmbedding does it for a fine-tuned model: s = L' / L up to the
    fine-tuned length L' (max_position_embeddings), seq_len / L past it, the ramp counted over the
    original length L: here L = 16, L' = block_size = 64, so s = 4 up to 64 and n / 16 beyond."""
    l, d = 16, 16
    tuned = GPTConfig(block_size=4 * l, n_head=1, n_embd=d, pos="rope", rope_scaling="yarn",
                      rope_factor=4.0, rope_original_length=l)
    s = max(n, 4 * l) / l
    dynamic = model.RopeScaling("yarn", original_length=l)
    theta, norm = angles_at_one(AttentionPlan(tuned, n, "causal", dynamic))
    torch.testing.assert_close(theta, paper_theta("yarn", s, d=d, l=l), rtol=1e-6, atol=0)
    torch.testing.assert_close(norm, torch.full_like(norm, 0.1 * math.log(s) + 1))


@pytest.mark.parametrize("method", ["none", "pi", "ntk", "yarn"])
def test_a_scaling_in_the_config_compiles_to_one_graph(method):
    """YaRN's ramp is plain Python arithmetic on the config's numbers: torch.compile traces a
    model fine-tuned with it into one graph, as it does the others (no tensor read back)."""
    scaled = {} if method == "none" else dict(rope_scaling=method, rope_factor=4.0)
    m = tiny("rope", n_layer=1, **scaled)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(m)(tokens(8), tokens(8))
    torch._dynamo.reset()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
        [b.reason for b in explained.break_reasons]


@pytest.mark.parametrize("method", SCALINGS)
def test_no_scaling_changes_xpos_without_rotation(method):
    """Interpolation changes nothing where there is no rotation (docs/alternatives.md), YaRN's
    temperature included: through the Python API xPos without rotation gives the unscaled logits,
    bitwise, for every method and factor."""
    m = sharpened(tiny("xpos", xpos_rotate=False))
    idx = tokens(27)
    plain = m(idx, idx, attention="causal")[0]
    for factor in (None, 4.0) if method != "dynamic_ntk" else (None,):
        scaled = m(idx, idx, attention="causal", rope_scaling=model.RopeScaling(method, factor))[0]
        assert torch.equal(scaled, plain), (method, factor)
    assert torch.equal(m.token_nll(idx, idx, attention="causal", rope_scaling=method),
                       m.token_nll(idx, idx, attention="causal"))


@pytest.mark.parametrize("method", SCALINGS)
def test_the_pass_uses_the_factor_of_its_length(method):
    """s = T / block_size under causal attention (or the given factor): the table's angles are
    position * theta'_j, and YaRN's factors have modulus 0.1 ln s + 1 on q and k alike."""
    m = GPT(GPTConfig(**BIG, vocab_size=7, n_layer=1))
    for T, factor in ((4096, None), (2000, None), (1500, 3.0)):
        scaling = model.RopeScaling(method, factor if method != "dynamic_ntk" else None)
        table = AttentionPlan(m.config, T, "causal", scaling)
        s = factor if scaling.factor else T / 1024
        angle = torch.arange(T, dtype=torch.float64)[:, None] * paper_theta(method, s)
        q_factor, k_factor = (torch.view_as_complex(f) for f in factors(table, range(T), range(T)))
        got = q_factor.angle().double()
        torch.testing.assert_close(torch.remainder(got - angle + math.pi, 2 * math.pi) - math.pi,
                                   # float32 angles up to 4096 rad
                                   torch.zeros_like(angle), rtol=0, atol=2e-3)
        modulus = 0.1 * math.log(s) + 1 if method == "yarn" else 1.0
        torch.testing.assert_close(q_factor.abs(), torch.full_like(q_factor.abs(), modulus))
        torch.testing.assert_close(k_factor.abs(), torch.full_like(k_factor.abs(), modulus))


@pytest.mark.parametrize("method", SCALINGS)
@pytest.mark.parametrize("pos", ["rope", "xpos"])
def test_every_method_is_the_identity_at_s_at_most_one(method, pos):
    cfg = GPTConfig(**(BIG | dict(pos=pos)))
    plain = AttentionPlan(cfg, 1).theta
    for s in (1.0, 0.5, 1 / 3):
        got = alternatives.interpolate(plain, model.RopeScaling(method), s, 1024, cfg.rope_base)
        assert torch.equal(got[0], plain) and got[1] == 1.0
    m = tiny(pos)
    idx = tokens(8)  # T = block_size: s = 1
    base = m(idx, idx)[0]
    assert torch.equal(m(idx, idx, rope_scaling=method)[0], base)
    if method != "dynamic_ntk":
        for factor in (1.0, 0.25):
            assert torch.equal(m(idx, idx, rope_scaling=model.RopeScaling(method, factor))[0], base)


@pytest.mark.parametrize("pos", ["rope", "xpos"])
@pytest.mark.parametrize("method, factor", [("pi", 2.5), ("ntk", None), ("yarn", None),
                                            ("yarn", 3.0)])
@pytest.mark.parametrize("rule", ["causal", model.AttentionRule("sliding", 12),
                                  model.AttentionRule("sinks", 12, 3)])
def test_interpolated_model_matches_the_brute_force(pos, method, factor, rule, monkeypatch):
    """Under causal attention s = T / block_size; under a window of W > block_size,
    s = W / block_size."""
    m = sharpened(tiny(pos, block_size=8, n_embd=32))  # head_dim 16
    T = 23
    scaling = model.RopeScaling(method, factor)
    fast = m(tokens(T), tokens(T), attention=rule, rope_scaling=scaling)[0]
    # it changes something
    assert (fast - m(tokens(T), tokens(T), attention=rule)[0]).abs().max() > 1e-4
    s = factor or (T if rule == "causal" else 12) / 8
    theta = paper_theta(method, s, d=16, l=8)
    sharpen = 0.1 * math.log(s) + 1 if method == "yarn" else 1.0
    monkeypatch.setattr(model.CausalSelfAttention, "forward",
                        brute_force_attention(rule, theta=theta, sharpen=sharpen))
    torch.testing.assert_close(fast, m(tokens(T), tokens(T))[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pos", ["rope", "xpos"])
@pytest.mark.parametrize("method", ["pi", "ntk", "yarn"])
def test_a_model_with_a_scaling_in_its_config_uses_it_in_every_pass(pos, method, monkeypatch):
    """A model fine-tuned at 32 with scaling s = 4 from the original length 8
    (GPTConfig.rope_scaling): at T <= 32, the training pass and every default pass are the published
    formula at s = 4, YaRN's ramp counting turns over 8 (not 32) and its temperature on q and k; a
    scaling passed in replaces it (none: the plain angles)."""
    m = sharpened(tiny(pos, block_size=32, n_embd=32, rope_scaling=method, rope_factor=4.0,
                       rope_original_length=8))
    T = 27
    m.train()  # the training pass (dropout 0)
    got = m(tokens(T), tokens(T))[0]
    m.eval()
    plain = m(tokens(T), tokens(T), rope_scaling="none")[0]
    theta = paper_theta(method, 4.0, d=16, l=8)
    sharpen = 0.1 * math.log(4.0) + 1 if method == "yarn" else 1.0
    if method == "yarn":  # the ramp over 32 would differ: the original length matters
        assert not torch.allclose(theta, paper_theta(method, 4.0, d=16, l=32))
    with monkeypatch.context() as patch:
        patch.setattr(model.CausalSelfAttention, "forward",
                      brute_force_attention("causal", theta=theta, sharpen=sharpen))
        torch.testing.assert_close(got, m(tokens(T), tokens(T))[0], rtol=1e-5, atol=1e-5)
    with monkeypatch.context() as patch:
        patch.setattr(model.CausalSelfAttention, "forward", brute_force_attention("causal"))
        torch.testing.assert_close(plain, m(tokens(T), tokens(T))[0], rtol=1e-5, atol=1e-5)
    assert (got - plain).abs().max() > 1e-4
    # decoding with the cache, and token_nll, use it too
    torch.testing.assert_close(m.token_nll(tokens(T), tokens(T)),
                               F.cross_entropy(got.transpose(1, 2), tokens(T), reduction="none"),
                               rtol=1e-5, atol=1e-5)
    cache = m.new_cache(T)
    torch.testing.assert_close(m(tokens(T), cache=cache)[0][:, -1], got[:, -1], rtol=1e-5,
                               atol=1e-5)


def test_a_scaling_in_the_config_is_checked():
    base = dict(block_size=8, vocab_size=5, n_layer=1, n_head=1, n_embd=8)
    for kw, message in ((dict(pos="rope", rope_scaling="dynamic_ntk", rope_factor=2.0),
                         "must be one of none, pi"),
                        (dict(pos="alibi", rope_scaling="pi", rope_factor=2.0),
                         "pos='alibi' has none"),
                        (dict(pos="xpos", xpos_rotate=False, rope_scaling="yarn", rope_factor=2.0),
                         "without rotation"),
                        (dict(pos="rope", rope_scaling="pi", rope_factor=1.0),
                         "must be a finite number > 1"),
                        (dict(pos="rope", rope_scaling="pi", rope_factor=math.inf),
                         "must be a finite number > 1"),
                        (dict(pos="rope", rope_original_length=-8),
                         "rope_original_length=-8 is not allowed: must be 0 .block_size. or an "
                         "integer from 2 to block_size=8"),
                        # above block_size: a scaling extends a model past its original length
                        (dict(pos="rope", rope_scaling="yarn", rope_factor=2.0,
                              rope_original_length=16),
                         "rope_original_length=16 is not allowed: must be 0 .block_size. or an "
                         "integer from 2 to block_size=8"),
                        (dict(pos="rope", rope_original_length=9), "rope_original_length=9"),
                        (dict(pos="rope", rope_scaling="yarn", rope_factor=2.0,
                              rope_original_length=1), "rope_original_length=1 is not allowed")):
        with pytest.raises(ValueError, match=message):
            GPTConfig(**base, **kw)
    for length in (0, 2, 8):  # 0: block_size
        GPTConfig(**base, pos="rope", rope_scaling="yarn", rope_factor=2.0,
                  rope_original_length=length)
    with pytest.raises(ValueError, match="original_length=1 is not allowed: must be an integer "
                                         ">= 2"):
        model.RopeScaling("yarn", 2.0, 1)
    # a checkpoint from before: none
    assert alternatives.scaling_of(GPTConfig(**base)) == model.RopeScaling("none")
    assert (alternatives.scaling_of(GPTConfig(**base, pos="rope", rope_scaling="pi",
                                              rope_factor=2.0))
            == model.RopeScaling("pi", 2.0))


def decoded_by_the_cache_rule(m, seq, passes, rule):
    """Last logits of each pass (a, b) over seq[:, a:b] under dynamic NTK, by the rule the KV cache
    documents, step by step: every layer keeps the raw keys and values each token got in the pass
    that fed it; a pass that brings the sequence to length L rotates its queries and every held key
    at ntk's theta'(s), s = max(1, min(L, W) / l). A brute force over the model's own Linears and
    LayerNorms, attention in float64 through reference_scores."""
    cfg = m.config
    l, nh, C = cfg.block_size, cfg.n_head, cfg.n_embd
    d = C // nh
    held = [[None, None] for _ in m.transformer.h]
    rule = model.AttentionRule(rule) if isinstance(rule, str) else rule
    last = []
    for a, b in passes:
        s = max(1.0, min(b, rule.window or b) / l)
        theta = paper_theta("ntk", s, d=d, base=cfg.rope_base, l=l)
        visible, distance = rule_table(rule, b, l)
        x = m.transformer.wte(seq[:, a:b])
        for layer, block in zip(held, m.transformer.h):
            B, n, _ = x.shape
            q, k, v = block.attn.c_attn(block.ln_1(x)).view(B, n, 3, nh, d).permute(2, 0, 3, 1, 4)
            layer[0] = k if layer[0] is None else torch.cat((layer[0], k), dim=2)
            layer[1] = v if layer[1] is None else torch.cat((layer[1], v), dim=2)
            scores = reference_scores(q, layer[0], distance[a:b], cfg, theta=theta)
            scores = scores.masked_fill(~visible[a:b], float("-inf"))
            y = (torch.softmax(scores, dim=-1) @ layer[1].double()).float()
            x = x + block.attn.c_proj(y.transpose(1, 2).reshape(B, n, C))
            x = x + block.mlp(block.ln_2(x))
        last.append(m.lm_head(m.transformer.ln_f(x[:, -1])))
    return last


@pytest.mark.parametrize("pos", ["rope", "xpos"])
# sliding: s grows until 12 / 8
@pytest.mark.parametrize("rule", ["causal", model.AttentionRule("sliding", 12)])
def test_dynamic_ntk_decoding_follows_the_caches_rule(pos, rule):
    """s follows the current length while decoding: the cache's raw keys are rotated again at the
    current s (not left at their old angles, as Hugging Face's cache leaves them), but the keys and
    values of layers above the first come from hidden states of earlier, smaller s. So cached
    decoding is the step-by-step rule written out above, equal to a full pass over each prefix at
    one layer and not at two; at a sharpened initialisation (as after training), where the gap
    shows."""
    seq = tokens(27, batch=1)
    passes = [(0, 3)] + [(t, t + 1) for t in range(3, 27)]
    gap = {}
    for n_layer in (1, 2):
        m = sharpened(tiny(pos, n_layer=n_layer))
        cache = m.new_cache(27, rule, "dynamic_ntk")
        gap[n_layer] = 0.0
        with torch.no_grad():
            want = decoded_by_the_cache_rule(m, seq, passes, rule)
            for (a, b), by_rule in zip(passes, want):
                got = m(seq[:, a:b], cache=cache)[0][:, -1]
                torch.testing.assert_close(got, by_rule, rtol=0, atol=5e-7, msg=f"step {b}")
                full = m(seq[:, :b], attention=rule, rope_scaling="dynamic_ntk")[0][:, -1]
                gap[n_layer] = max(gap[n_layer], (got - full).abs().max().item())
            # and the factor did change: at full length s = 27/8 (causal) or 12/8 (sliding)
            assert (full - m(seq, attention=rule)[0][:, -1]).abs().max() > 1e-4
    assert gap[1] < 5e-7 and gap[2] > 5e-6, gap


def test_dynamic_ntk_token_nll_scores_each_token_as_cached_decoding_predicts_it():
    """Past block_size token_nll predicts each token through the cache, token by token, at the
    factor of its own length: the cache's rule, not a full pass over each prefix."""
    m = sharpened(tiny("rope", n_layer=4))
    seq = tokens(27, batch=1)
    got = m.token_nll(seq, seq, attention="causal", rope_scaling="dynamic_ntk")
    passes = [(0, 8)] + [(t, t + 1) for t in range(8, 27)]
    with torch.no_grad():
        logits = decoded_by_the_cache_rule(m, seq, passes, "causal")
        first, _ = m(seq[:, :8], seq[:, :8], attention="causal")  # s = 1 up to block_size
        by_prefix = torch.cat([m(seq[:, : t + 1], attention="causal",
                                 rope_scaling="dynamic_ntk")[0][:, -1] for t in range(8, 27)])
    want = torch.cat((F.cross_entropy(first[0], seq[0, :8], reduction="none"),
                      F.cross_entropy(torch.cat(logits[1:]), seq[0, 8:], reduction="none")))
    torch.testing.assert_close(got[0], want, rtol=0, atol=5e-7)
    # a full pass over each prefix would score them otherwise
    over_prefixes = F.cross_entropy(by_prefix, seq[0, 8:], reduction="none")
    assert (over_prefixes - got[0, 8:]).abs().max() > 5e-6


def test_rope_scaling_errors():
    with pytest.raises(ValueError,
                       match="rope_scaling='linear' is not allowed: must be one of none, pi, ntk"):
        tiny("rope")(tokens(4), rope_scaling="linear")
    with pytest.raises(ValueError,
                       match="rope_factor=0 is not allowed: must be a finite number > 0"):
        model.RopeScaling("pi", 0)
    with pytest.raises(ValueError, match="rope_factor=inf is not allowed"):
        model.RopeScaling("yarn", float("inf"))
    with pytest.raises(ValueError,
                       match="rope_factor=2.0 does not apply to rope_scaling='dynamic_ntk'"):
        model.RopeScaling("dynamic_ntk", 2.0)
    with pytest.raises(ValueError, match="rope_factor=2.0 does not apply to rope_scaling='none'"):
        model.RopeScaling("none", 2.0)


# --- precision ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale_base", [512.0, 16.0])
def test_xpos_low_precision_finite_at_64_blocks(dtype, scale_base):
    # scale_base 16 with block_size 32 has the paper's ratio (512 at l = 1024): T = 2048
    # stands for 64k tokens
    m = tiny("xpos", block_size=32, n_embd=32, n_head=2, xpos_scale_base=scale_base)
    idx = tokens(64 * 32, batch=1)
    # BCA by default past block_size; without it (float16: float32 attention)
    for rule in (None, "causal", "sinks"):
        with torch.autocast("cpu", dtype=dtype):
            logits, loss = m(idx, idx, attention=rule)
        assert torch.isfinite(logits).all() and torch.isfinite(loss)


def test_xpos_float16_without_bca_at_16k_with_the_papers_defaults(monkeypatch):
    """The paper's block_size 1024 and scale_base 512: factors reach 3.5^16 = 5e8 at 16,384
    tokens without BCA."""
    m = tiny("xpos", block_size=1024, n_layer=1, n_embd=16, n_head=2)
    assert (m.config.xpos_scale_base, m.config.xpos_gamma) == (512.0, 0.4)
    with torch.no_grad():
        # |q|, |k| of about 20, as in a trained model
        m.transformer.h[0].attn.c_attn.weight.mul_(1000)
    idx = tokens(16384, batch=1)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        logits, loss = m(idx, idx, attention="causal")
        assert torch.isfinite(logits).all() and torch.isfinite(loss)
        # all 16,384 queries in one call: it overflows
        monkeypatch.setattr(model, "AttentionPlan", one_span)
        assert not torch.isfinite(m(idx, idx, attention="causal")[0]).all()


class one_span(AttentionPlan):
    """The plan with xPos's spans of queries turned off: one attention call for every query."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.span = self.frame


def test_xpos_attends_in_spans_that_keep_every_factor_under_2_to_the_8(monkeypatch):
    cfg = GPTConfig(n_head=1, n_embd=16, pos="xpos")  # scale_base 512, gamma 0.4
    # over n queries centred on their middle the largest factor is zeta_0^(-(n//2)/512), zeta_0 =
    # 0.4/1.4 (Eq. 9): 3.5^8 in one call over 8,192 tokens; the span is the largest n whose factor
    # stays <= 2^8, found by search
    def largest(n):
        return (1.4 / 0.4) ** ((n // 2) / 512)
    assert largest(8192) == pytest.approx(3.5**8, rel=1e-12) and largest(8192) > 2**8
    table = AttentionPlan(cfg, 8192, "causal")
    assert table.span == max(n for n in range(1, 8192) if largest(n) <= 2**8)
    seen, sdpa = [], F.scaled_dot_product_attention

    # every call: its queries, their dtype, and the largest |q| it was given
    def spy(q, k, v, attn_mask=None, **kw):
        seen.append((q.size(2), q.dtype, q.abs().max().item()))
        # it recognises SDPA by name, which the spy replaces: as a tensor
        if isinstance(attn_mask, CausalBias):
            attn_mask = attn_mask._materialize(q.device)
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(model.F, "scaled_dot_product_attention", spy)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        q = k = v = torch.ones(1, 1, 8192, 16, dtype=dtype)
        assert model.attend(q, k, v, table, range(8192), range(8192)).dtype == dtype
        assert [n for n, _, _ in seen] == [table.span, 8192 - table.span]
        # pairs (1, 1) times F
        assert all(d == dtype and top <= 2**8 * math.sqrt(2) * 1.01 for _, d, top in seen)
        seen.clear()
    for queries, keys in ((range(0, table.span), range(0, table.span)),
                          (range(5000, 8192), range(0, 8192))):
        q_factor, k_factor = factors(table, queries, keys)
        assert (q_factor.norm(dim=-1).max() <= 2**8 * 1.001
                and k_factor.norm(dim=-1).max() <= 2**8 * 1.001)


def test_xpos_without_bca_far_past_float32s_range_matches_float64():
    """scale_base = l/2 (the study's setting) at 80 x l, where one factor centred on the sequence
    would be 3.5^80, past float32's 3.4e38: attention against float64 scores from the paper's
    formula (complex_reference; float64 holds 3.5^160); all queries in one call overflow."""
    torch.manual_seed(0)
    T, d = 2560, 16
    cfg = GPTConfig(n_head=1, n_embd=d, block_size=32, pos="xpos", xpos_scale_base=16.0)
    q, k, v = torch.randn(1, 1, T, d), torch.randn(1, 1, T, d), torch.randn(1, 1, T, d)
    y = model.attend(q, k, v, AttentionPlan(cfg, T, "causal"), range(T), range(T))
    pos, want = torch.arange(T, dtype=torch.float64), []
    # 256 queries against every key at a time, masked causally
    for rows in torch.arange(T).split(256):
        s = complex_reference(q[0, 0, rows, None], k[0, 0, None], pos[rows, None, None],
                              pos[None, :, None], scale_base=16.0) / math.sqrt(d)
        want.append(torch.softmax(s.masked_fill(pos[None] > pos[rows, None], -math.inf), -1)
                    @ v[0, 0].double())
    want = torch.cat(want)
    torch.testing.assert_close(y[0, 0].double(), want, rtol=1e-4, atol=1e-4)
    assert not torch.isfinite(model.attend(q, k, v, one_span(cfg, T, "causal"), range(T),
                                           range(T))).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# l/2, and l/32: 3.5^1280 over the whole sequence
@pytest.mark.parametrize("scale_base", [16.0, 1.0])
def test_xpos_model_without_bca_finite_at_80_blocks(dtype, scale_base):
    m = tiny("xpos", block_size=32, n_embd=32, n_head=2, xpos_scale_base=scale_base)
    idx = tokens(80 * 32, batch=1)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        for rule in ("causal", "sinks", None):
            logits, loss = m(idx, idx, attention=rule)
            assert torch.isfinite(logits).all() and torch.isfinite(loss), rule
        cache = m.new_cache(80 * 32 + 1, "causal")  # decoding past them, through the KV cache
        m(idx, cache=cache)
        assert torch.isfinite(m(idx[:, :1], cache=cache)[0]).all()


def test_sinks_attend_in_spans_like_the_other_rules(monkeypatch):
    """Under the sinks rule a window's W queries go through xPos's spans too: finite where one call
    would overflow (W = 128 at scale_base 0.5: factors up to 3.5^128), and the same as one call
    where that stays finite."""
    idx = tokens(300, batch=1, vocab=50)
    m = tiny("xpos", block_size=128, vocab_size=50, n_layer=1, n_embd=32, n_head=2,
             xpos_scale_base=0.5)
    with torch.no_grad():
        assert torch.isfinite(m.hidden_states(idx, "sinks")).all()
        m = tiny("xpos", block_size=128, vocab_size=50, n_layer=1, n_embd=32, n_head=2,
                 xpos_scale_base=4.0)
        spanned = m.hidden_states(idx, "sinks")
        # the window's queries do go in spans
        assert AttentionPlan(m.config, 300, "sinks").span < 128
        monkeypatch.setattr(model, "AttentionPlan", one_span)
        torch.testing.assert_close(spanned, m.hidden_states(idx, "sinks"), rtol=1e-4, atol=1e-5)
        m = tiny("xpos", block_size=128, vocab_size=50, n_layer=1, n_embd=32, n_head=2,
                 xpos_scale_base=0.5)
        # the overflow the spans avoid
        assert not torch.isfinite(m.hidden_states(idx, "sinks")).all()
        monkeypatch.undo()
        for scale_base in (0.5, 1e-30):  # and streamed through the KV cache, a few tokens at a time
            m = tiny("xpos", block_size=128, vocab_size=50, n_layer=1, n_embd=32, n_head=2,
                     xpos_scale_base=scale_base)
            assert torch.isfinite(m.token_nll(idx[:, :-1], idx[:, 1:], attention="sinks",
                                              chunk_tokens=64)).all()


def test_output_layer_in_float32_outside_training():
    m = tiny("xpos", vocab_size=101)
    idx = tokens(16, vocab=101)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = m(idx, idx)
        hidden = m.hidden_states(idx)
        m.train()
        train_logits, _ = m(idx, idx)
    want = hidden.float() @ m.lm_head.weight.T  # float32 by hand from the same hidden states
    assert logits.dtype == torch.float32 and torch.equal(logits, want)
    assert train_logits.dtype == torch.bfloat16  # training keeps autocast's speed


# --- causality and extrapolation ------------------------------------------------------------------


@pytest.mark.parametrize("pos", POSITION_SCHEMES)
@pytest.mark.parametrize("rule", ["causal", "bca", "sliding", SINKS_6_2])
def test_causality(pos, rule):
    m = tiny(pos)
    T = 8 if pos == "learned" else 21
    idx = tokens(T)
    base = m(idx, idx, attention=rule)[0]
    for t in (0, 5, T - 1):
        changed = idx.clone()
        changed[:, t] = (changed[:, t] + 1) % 23
        logits = m(changed, changed, attention=rule)[0]
        torch.testing.assert_close(logits[:, :t], base[:, :t], rtol=0, atol=1e-6)
        assert not torch.allclose(logits[:, t], base[:, t])


def test_learned_cannot_extrapolate():
    m = tiny("learned")
    with pytest.raises(ValueError, match="learned absolute positions cannot extrapolate"):
        m(tokens(9))
    with pytest.raises(ValueError, match="cannot extrapolate"):
        m.generate(tokens(6), 4)  # the 10th token needs a forward pass at position 8
    assert m.generate(tokens(6), 3).shape == (2, 9)  # the 9th is predicted from position 7: fine


def test_sinusoidal_embedding_formula():
    pe = model.sinusoidal_embedding(torch.tensor([0, 1, 5000]), 6)
    for row, p in enumerate([0, 1, 5000]):
        for i in range(3):
            assert pe[row, 2 * i].item() == pytest.approx(math.sin(p / 10000 ** (2 * i / 6)),
                                                          abs=1e-4)
            assert (pe[row, 2 * i + 1].item()
                    == pytest.approx(math.cos(p / 10000 ** (2 * i / 6)), abs=1e-4))


def test_nothing_length_dependent_in_state():
    for pos in POSITION_SCHEMES:
        m = tiny(pos)
        assert list(m.buffers()) == []
        assert set(m.state_dict()) == {n for n, _ in m.named_parameters(remove_duplicate=False)}


# --- cached decoding ------------------------------------------------------------------------------


RULES = [None, "causal", "bca", "sliding", "sinks", SLIDING_5, SINKS_6_2,  # None: auto
         # a block < T < two blocks
         model.AttentionRule("sliding", 20), model.AttentionRule("sinks", 20, 2)]


@pytest.mark.parametrize("pos", POSITION_SCHEMES)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("prompt", [3, 13])
def test_cached_decoding_matches_full_forward(pos, rule, prompt):
    m = tiny(pos)
    # blocks of 4, 5, 6 and 8: crosses several window moves for each
    total = 8 if pos == "learned" else 27
    if prompt >= total:
        return
    seq = tokens(total)
    cache = m.new_cache(total, rule)
    cached, _ = m(seq[:, :prompt], cache=cache)
    buffers = cache[0].k.data_ptr(), cache[0].v.data_ptr()
    table = AttentionPlan(m.config, total, rule)
    resolved, b = table.rule, table.segment
    for t in range(prompt, total + 1):
        full, _ = m(seq[:, :t], attention=resolved)
        torch.testing.assert_close(cached[:, -1], full[:, -1], rtol=1e-5, atol=1e-5,
                                   msg=f"step {t}")
        if b:  # bounded: one window's keys, and the sinks (kept once the first S tokens have come)
            assert cache[0].k.size(2) == min(2 * b, total) and cache[0].held <= 2 * b
            sink_kv = cache[0].sink_kv
            assert sink_kv is None if resolved.name != "sinks" or t < resolved.sinks else \
                sink_kv[0].size(2) == sink_kv[1].size(2) == resolved.sinks
        if t < total:
            cached, _ = m(seq[:, t : t + 1], cache=cache)
    # preallocated: nothing reallocated per token
    assert (cache[0].k.data_ptr(), cache[0].v.data_ptr()) == buffers


@pytest.mark.parametrize("pos", POSITION_SCHEMES)
@pytest.mark.parametrize("rule", RULES[1:])
def test_chunked_prefill_matches_full_forward(pos, rule):
    """A cache takes chunks of any size: within a segment, across one or several
    boundaries, after a decode."""
    m = tiny(pos)
    total = 8 if pos == "learned" else 37
    seq = tokens(total)
    full, _ = m(seq, seq, attention=rule)
    for chunks in ([1, 2, 5, 13], [7, 1, 9], [3, 3, 3, 3, 3, 3, 3, 3, 3, 3], [total]):
        cache, logits, t = m.new_cache(total, rule), [], 0
        for size in chunks:
            if t < total:
                logits.append(m.logits(m.hidden_states(seq[:, t : t + size], cache=cache)))
                t += size
        got = torch.cat(logits, dim=1)
        torch.testing.assert_close(got, full[:, : got.size(1)], rtol=1e-5, atol=1e-5,
                                   msg=str(chunks))


def test_cache_errors():
    m = tiny("xpos")
    cache = m.new_cache(10)
    m(tokens(6), cache=cache)
    with pytest.raises(ValueError, match="made for 10 tokens, asked for 11"):
        m(tokens(5), cache=cache)
    with pytest.raises(ValueError,
                       match="attention and rope_scaling are fixed when the cache is made"):
        m(tokens(1), attention="bca", cache=cache)
    with pytest.raises(ValueError,
                       match="attention and rope_scaling are fixed when the cache is made"):
        m(tokens(1), rope_scaling="yarn", cache=cache)
    with pytest.raises(ValueError, match="attention='yes'"):
        m.new_cache(10, attention="yes")
    with pytest.raises(ValueError, match="cannot extrapolate"):
        tiny("learned").new_cache(9)
    with pytest.raises(ValueError,
                       match="holds a batch of 2 in torch.float32, got 1 in torch.float32"):
        m(tokens(1, batch=1), cache=cache)


@pytest.mark.parametrize("pos", POSITION_SCHEMES)
@pytest.mark.parametrize("rule", ["causal", "bca", SLIDING_5, SINKS_6_2])
def test_attention_scores_are_what_attention_computes(pos, rule):
    """softmax of the scores resolution.py writes out (the sinks' included) times v equals the
    attention output of the model's own pass, for every scheme and rule."""
    m = tiny(pos, n_layer=1)
    T = 8 if pos == "learned" else 21
    idx = tokens(T, batch=1)
    seen = {}
    def keep(name, value):  # a hook that returns None changes nothing
        return [seen.setdefault(name, value), None][1]
    m.transformer.h[0].attn.register_forward_hook(lambda mod, args, out: keep("x", args[0]))
    m.transformer.h[0].attn.c_proj.register_forward_pre_hook(lambda mod, args: keep("y", args[0]))
    m(idx, attention=rule)
    full = torch.full((2, T, T), float("-inf"))

    def observe(layer, s, queries, keys):
        cells = full[:, queries.start : queries.stop, keys.start : keys.stop]
        cells.copy_(torch.where(torch.isfinite(s[0]), s[0], cells))

    resolution.pre_softmax_scores(m, idx, observe, attention=rule)
    v = m.transformer.h[0].attn.c_attn(seen["x"])[..., 32:].view(1, T, 2, 8).transpose(1, 2)
    want = seen["y"].view(1, T, 2, 8).transpose(1, 2)
    torch.testing.assert_close(torch.softmax(full, dim=-1) @ v[0], want[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rule", ["causal", "bca", SLIDING_5, SINKS_6_2])
def test_model_pre_softmax_scores_match_a_brute_force_score_matrix(rule):
    """resolution.pre_softmax_scores against scores written out from the hidden states with the
    schemes' formulas at the rule's distances (the sinks' re-indexed ones included), and its
    visible keys only."""
    for pos in ("xpos", "alibi"):
        m = tiny(pos, n_layer=1)
        T = 21
        idx = tokens(T, batch=1)
        got = torch.full((2, T, T), float("nan"))

        # hidden keys come as -inf (or not at all): keep NaN there
        def observe(layer, s, queries, keys):
            cells = got[:, queries.start : queries.stop, keys.start : keys.stop]
            cells.copy_(torch.where(torch.isfinite(s[0]), s[0], cells))

        resolution.pre_softmax_scores(m, idx, observe, attention=rule)
        x = m.transformer.h[0].ln_1(m.transformer.wte(idx))
        q, k, _ = m.transformer.h[0].attn.c_attn(x).view(1, T, 3, 2, 8).permute(2, 0, 3, 1, 4)
        visible, distance = rule_table(rule, T)
        want = reference_scores(q, k, distance, m.config)[0].float()
        torch.testing.assert_close(got[:, visible], want[:, visible], rtol=1e-4, atol=1e-4)
        # hidden keys: -inf, or never handed over (NaN)
        assert not torch.isfinite(got[:, ~visible]).any()


@pytest.mark.parametrize("pos", RELATIVE_OR_NONE)
def test_generate_uses_the_cache_and_goes_past_block_size(pos):
    m = tiny(pos)
    prompt = tokens(5)
    out = m.generate(prompt, 3 * m.config.block_size, top_k=1)
    assert out.shape == (2, 5 + 24) and torch.equal(out[:, :5], prompt)
    # greedy: each token is the argmax of a full, uncached forward pass
    for t in range(5, out.size(1)):
        assert torch.equal(out[:, t], m(out[:, :t])[0][:, -1].argmax(-1))


def test_generate_is_seeded_and_respects_top_k():
    m = tiny("xpos")
    torch.manual_seed(3)
    a = m.generate(tokens(4), 12, temperature=1.5, top_k=3)
    torch.manual_seed(3)
    assert torch.equal(a, m.generate(tokens(4), 12, temperature=1.5, top_k=3))
    with pytest.raises(ValueError, match="temperature"):
        m.generate(tokens(4), 2, temperature=0)


# --- training behaviour ---------------------------------------------------------------------------


@pytest.mark.parametrize("pos", POSITION_SCHEMES)
def test_initial_loss_and_per_token_losses(pos):
    m = tiny(pos, vocab_size=101)
    idx, targets = tokens(8, vocab=101, batch=8), tokens(8, vocab=101, seed=2, batch=8)
    logits, loss = m(idx, targets)
    assert logits.shape == (8, 8, 101)
    assert abs(loss.item() - math.log(101)) < 0.1
    per_token = m.token_nll(idx, targets)
    assert per_token.shape == (8, 8)
    torch.testing.assert_close(per_token.mean(), loss)
    want = -torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(per_token, want, rtol=1e-5, atol=1e-5)


def test_token_nll_in_chunks_bounds_the_logits(monkeypatch):
    m = tiny("xpos", vocab_size=101)
    idx, targets = tokens(29, vocab=101, batch=3), tokens(29, vocab=101, seed=2, batch=3)
    targets[0, 5] = -1  # ignored
    logits, _ = m(idx, targets)
    want = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1,
                           reduction="none").view(3, 29)
    sizes = []
    m.lm_head.register_forward_hook(lambda mod, args, out: sizes.append(out.shape[:2].numel()))
    for chunk in (1, 7, 12, 10**6):
        sizes.clear()
        torch.testing.assert_close(m.token_nll(idx, targets, chunk_tokens=chunk), want, rtol=1e-5,
                                   atol=1e-5)
        # at least one position of every sequence
        assert sum(sizes) == 3 * 29 and max(sizes) <= max(chunk, 3)
    assert m.token_nll(idx, targets)[0, 5] == 0


def test_sinusoidal_token_and_position_enter_at_comparable_scale():
    """Vaswani et al. §3.4: token embeddings times sqrt(n_embd) before the table is added."""
    for n_embd in (128, 1024):
        m = tiny("sinusoidal", n_embd=n_embd, n_head=2, vocab_size=101)
        T = 64
        idx = tokens(T, vocab=101, batch=4)
        inputs = []
        m.transformer.h[0].register_forward_pre_hook(lambda mod, args: inputs.append(args[0]))
        m(idx)
        p = torch.arange(T, dtype=torch.float64)[:, None]
        i = torch.arange(0, n_embd, 2, dtype=torch.float64)
        table = torch.zeros(T, n_embd, dtype=torch.float64)
        table[:, 0::2], table[:, 1::2] = (torch.sin(p / 10000 ** (i / n_embd)),
                                          torch.cos(p / 10000 ** (i / n_embd)))
        token_part = inputs[0].double() - table
        torch.testing.assert_close(token_part, m.transformer.wte(idx).double() * math.sqrt(n_embd),
                                   rtol=1e-5, atol=1e-5)
        ratio = (token_part.pow(2).mean().sqrt() / table.pow(2).mean().sqrt()).item()
        # init std 0.02 scaled, against the table's RMS
        want = 0.02 * math.sqrt(n_embd) / math.sqrt(0.5)
        # unscaled it would be 0.028 (1 : 35)
        assert ratio == pytest.approx(want, rel=0.1) and ratio > 0.3


@pytest.mark.parametrize("pos", POSITION_SCHEMES)
def test_can_overfit_one_batch(pos):
    m = tiny(pos, n_embd=32).train()
    idx = tokens(9, batch=4)
    x, y = idx[:, :-1], idx[:, 1:]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(150):
        _, loss = m(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1


# --- ALiBi and configuration ----------------------------------------------------------------------


def test_alibi_slopes():
    assert alibi_slopes(8).tolist() == [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128,
                                        1 / 256]
    # 12 heads: the 8-head slopes, then slopes 1, 3, 5, 7 of the 16-head sequence 2^(-k/2)
    want12 = [2 ** -k for k in range(1, 9)] + [2 ** -0.5, 2 ** -1.5, 2 ** -2.5, 2 ** -3.5]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(want12))
    torch.testing.assert_close(alibi_slopes(1), torch.tensor([2 ** -8.0]))


@pytest.mark.parametrize("field,value,message", [
    ("pos", "rotary", "must be one of learned, sinusoidal, rope, alibi, xpos, none"),
    ("block_size", 7, "even integer"),
    ("block_size", 0, "even integer"),
    ("n_embd", 15, "divisible by n_head=2"),
    ("n_layer", 0, "positive integer"),
    ("dropout", 1.0, r"\[0, 1\)"),
    ("xpos_gamma", 0.0, "> 0"),
    ("xpos_scale_base", -1, "> 0"),
    ("rope_base", 1, "> 1"),
    ("xpos_rotate", "no", "True or False"),
    ("bias", 1, "True or False"),
])
def test_config_errors_name_the_value(field, value, message):
    with pytest.raises(ValueError, match=f"{field}={value!r}.*{message}"):
        GPTConfig(**{"block_size": 8, "n_head": 2, "n_embd": 16, field: value})


def test_odd_head_dim_rejected_for_rotary_only():
    with pytest.raises(ValueError, match="head dim"):
        GPTConfig(n_head=4, n_embd=12, pos="xpos")
    GPTConfig(n_head=4, n_embd=12, pos="alibi")


def test_bad_bca_value():
    with pytest.raises(ValueError, match="attention='on'"):
        tiny("xpos")(tokens(4), attention="on")


# --- the method's path ---------------------------------------------------------------------


def test_the_read_path_to_the_first_attention_call_is_the_method():
    """The method's path, traced with sys.settrace over every file of the repository
    (read_path.py): from the entry into GPT.forward to the first F.scaled_dot_product_attention
    of an xPos pass past block_size (BCA), at most 100 unique lines in at most 12 definitions,
    at most 3 of them outside model.py. Over the whole pass no check runs (a rule and a config
    are checked where they are made) and nothing of alternatives.py (none was asked for)."""
    path = read_path.trace()
    outside = path.outside_model()
    print(f"read path: {len(path.lines)} lines, {len(path.definitions)} definitions, "
          f"{len(outside)} outside model.py {outside}, model.py depth {path.model_depth}; "
          f"whole pass: {len(path.pass_lines)} lines, {len(path.pass_definitions)} definitions")
    assert len(path.lines) <= 100 and len(path.definitions) <= 12 and len(outside) <= 3
    assert path.definitions[0] == ("model.py", "GPT.forward")
    assert ("model.py", "attend") in path.definitions
    assert not [d for d in path.pass_definitions if d[1].endswith("__post_init__")]
    assert [f for f, _ in path.pass_definitions] == ["model.py"] * len(path.pass_definitions)


def test_a_resolved_rule_is_the_rule_of_the_table():
    """resolve makes its rule without checking it again: it is still the AttentionRule the
    table gives (equal, same hash and repr as one made and checked by hand), and S < W is still
    checked where block_size gives sinks its W."""
    Rule = model.AttentionRule
    for rule, n_tokens, want in ((Rule(), 65, Rule("bca", 64)),
                                 (Rule(), 64, Rule("causal")),
                                 (Rule("causal", 5), 99, Rule("causal")),
                                 (Rule("sliding"), 10, Rule("sliding", 64)),
                                 (Rule("sinks", 9, 2), 10, Rule("sinks", 9, 2))):
        got = rule.resolve(n_tokens, 64)
        assert type(got) is Rule and got == want and hash(got) == hash(want)
        assert repr(got) == repr(want)
    with pytest.raises(ValueError, match="sinks=64 is not allowed with window=64"):
        Rule("sinks", sinks=64).resolve(10, 64)


def test_one_number_check():
    """alternatives.is_number, the one check behind GPTConfig's, AttentionRule's and
    RopeScaling's: a bool is no number."""
    is_number = alternatives.is_number
    assert model.is_number is is_number
    assert is_number(3) and is_number(2.5) and is_number(4, int)
    assert not is_number(True) and not is_number(2.5, int)
    assert not is_number("3") and not is_number(None)
    for make in (lambda: model.AttentionRule("sliding", True),
                 lambda: model.AttentionRule("sinks", 8, True),
                 lambda: model.RopeScaling("pi", True),
                 lambda: model.RopeScaling("yarn", 2.0, True),
                 lambda: GPTConfig(n_layer=True), lambda: GPTConfig(dropout=False),
                 lambda: GPTConfig(pos="rope", rope_scaling="pi", rope_factor=True)):
        with pytest.raises(ValueError, match="=True is not allowed|=False is not allowed"):
            make()
