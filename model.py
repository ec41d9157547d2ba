"""
lex-gpt: one GPT in nanoGPT's layout with six position schemes, xPos, and blockwise causal attention (BCA), and the
inference-time alternatives people compare it with: a sliding window, attention sinks, and RoPE interpolation (PI,
NTK, dynamic NTK, YaRN).

Paper: "A Length-Extrapolatable Transformer" (Sun et al.). xPos is §3.2 (Eq. 10, Algorithm 1), BCA is §3.3.
Read top to bottom: config -> position schemes and RoPE interpolation -> attention rules (which keys a query sees)
-> PositionTable -> the one attention function -> windows (BCA, sliding, sinks) -> KV cache -> GPT.

Conventions used throughout:
- Attention tensors are (batch, n_head, time, head_dim).
- Positions are integer ranges in a frame: absolute (0 .. T-1), or a window's 0 .. 2b-1. Angles, xPos
  scales and masks are computed from them once per forward pass (PositionTable) and shared by all layers; nothing
  length-dependent lives in the state_dict or among the module buffers (checkpoints work at any length).
- Rotary pairs are interleaved, (x0, x1), (x2, x3), ..., as in the paper's Algorithm 1.
"""

import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

POSITION_SCHEMES = ("learned", "sinusoidal", "rope", "alibi", "xpos", "none")


@dataclass
class GPTConfig:
    block_size: int = 1024  # training length l; BCA's half-block is H = block_size // 2
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear layers and LayerNorms, as in GPT-2
    pos: str = "xpos"  # one of POSITION_SCHEMES; "none" is NoPE
    rope_base: float = 10000.0  # theta_j = rope_base^(-2j/d), shared by rope and xpos
    xpos_gamma: float = 0.4  # zeta_j = (2j + gamma*d) / ((1 + gamma)*d), paper Eq. 9
    xpos_scale_base: float = 512.0  # zeta^(n / scale_base) as in the official code; inf turns the decay off
    xpos_rotate: bool = True  # False is Table 4's "xPos without rotation": theta = 0, decay only

    def __post_init__(self):
        def require(ok, name, allowed):
            if not ok:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)!r} is not allowed: {allowed}")

        is_int = lambda x: isinstance(x, int) and not isinstance(x, bool)
        is_num = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)
        require(self.pos in POSITION_SCHEMES, "pos", f"must be one of {', '.join(POSITION_SCHEMES)}")
        for name in ("vocab_size", "n_layer", "n_head", "n_embd"):
            require(is_int(getattr(self, name)) and getattr(self, name) > 0, name, "must be a positive integer")
        require(is_int(self.block_size) and self.block_size >= 2 and self.block_size % 2 == 0, "block_size",
                "must be an even integer >= 2 (BCA works in half-blocks of block_size/2)")
        require(self.n_embd % self.n_head == 0, "n_embd", f"must be divisible by n_head={self.n_head}")
        require(self.pos not in ("rope", "xpos") or (self.n_embd // self.n_head) % 2 == 0, "n_head",
                f"rope and xpos rotate pairs, so the head dim n_embd/n_head={self.n_embd}/{self.n_head} must be even")
        require(is_num(self.dropout) and 0 <= self.dropout < 1, "dropout", "must be a number in [0, 1)")
        require(isinstance(self.bias, bool), "bias", "must be True or False")
        require(is_num(self.rope_base) and self.rope_base > 1, "rope_base", "must be a number > 1")
        require(is_num(self.xpos_gamma) and self.xpos_gamma > 0, "xpos_gamma", "must be a number > 0")
        require(is_num(self.xpos_scale_base) and self.xpos_scale_base > 0, "xpos_scale_base",
                "must be a number > 0 (inf turns the decay off)")
        require(isinstance(self.xpos_rotate, bool), "xpos_rotate", "must be True or False")


# ---------------------------------------------------------------------------------------------------------------
# Position schemes. Absolute ones (learned, sinusoidal) are added to the token embedding in GPT.hidden_states;
# relative ones (rope, xpos, alibi) act inside attention, through a PositionTable built once per forward pass.


def check_length(config, n_positions):
    """Learned absolute positions exist only for 0 .. block_size-1; every other scheme runs at any length."""
    if config.pos == "learned" and n_positions > config.block_size:
        raise ValueError(f"pos='learned' cannot go past block_size={config.block_size} (asked for {n_positions} "
                         "positions): learned absolute positions cannot extrapolate")


def sinusoidal_embedding(pos, dim):
    """Vaswani et al.'s table, PE[p, 2i] = sin(p / 10000^(2i/dim)), PE[p, 2i+1] = cos(...), at any position."""
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, device=pos.device, dtype=torch.float32) / dim)
    angle = pos.float()[:, None] * inv_freq
    return torch.stack((angle.sin(), angle.cos()), dim=-1).flatten(1)[:, :dim]


ROPE_SCALINGS = ("none", "pi", "ntk", "dynamic_ntk", "yarn")
YARN_ALPHA, YARN_BETA = 1.0, 32.0  # YaRN's ramp ends, in turns over the training length (its defaults for LLaMA)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE interpolation: inference-time changes to the rotary angles theta_j (of rope, and of xpos's rotation;
    xPos's decay zeta is left alone) so that a model trained at length l meets fewer angles it never saw. The factor
    is s = L / l, where L is the most positions one query sees in the pass (the sequence length under causal
    attention, at most W under a window), or `factor` when given. Every method is the identity at s <= 1.
      pi           Position Interpolation (Chen et al. 2023): position m -> m / s, i.e. theta_j -> theta_j / s.
      ntk          "NTK-aware" scaling (bloc97, 2023): base -> base * s^(d/(d-2)). The slowest pair is interpolated
                   by exactly s, the fastest (which carry local order) barely change.
      dynamic_ntk  ntk with s recomputed from the current length at every pass, so a sequence runs unscaled up to
                   l. In one forward pass it equals ntk; it differs while a KV cache grows (KVCache.table).
      yarn         YaRN (Peng et al. 2023): a ramp between pi and no change, pair by pair (interpolated), and a
                   sharper softmax (PositionTable).
    """
    method: str = "none"
    factor: float = None  # s; None: from the length (see above)

    def __post_init__(self):
        if self.method not in ROPE_SCALINGS:
            raise ValueError(f"rope_scaling={self.method!r} is not allowed: must be one of {', '.join(ROPE_SCALINGS)}")
        if self.factor is None:
            return
        number = isinstance(self.factor, (int, float)) and not isinstance(self.factor, bool)
        if not (number and 0 < self.factor < math.inf):
            raise ValueError(f"rope_factor={self.factor!r} is not allowed: must be a finite number > 0")
        if self.method in ("none", "dynamic_ntk"):
            raise ValueError(f"rope_factor={self.factor!r} does not apply to rope_scaling={self.method!r}: "
                             + ("it recomputes s from the current length" if self.method != "none" else
                                "choose pi, ntk or yarn"))

    def s(self, length, block_size):
        return float(self.factor) if self.factor is not None else length / block_size


def rotary_frequencies(head_dim, config, device=None, scaling=None, s=1.0):
    """theta_j = rope_base^(-2j/d) (RoPE's angles; 0 for "xpos without rotation"), interpolated by `scaling` at
    factor s, and xPos's per-pair decay base zeta_j = (2j + gamma*d) / ((1 + gamma)*d) (paper Eq. 9), j = 0 .. d/2-1,
    float32."""
    j = torch.arange(head_dim // 2, device=device, dtype=torch.float32)
    theta = config.rope_base ** (-2 * j / head_dim)
    if config.pos == "xpos" and not config.xpos_rotate:
        theta = torch.zeros_like(theta)
    if scaling is not None and scaling.method != "none" and s > 1:
        theta = interpolated(theta, j, head_dim, scaling.method, s, config.block_size)
    return theta, (2 * j + config.xpos_gamma * head_dim) / ((1 + config.xpos_gamma) * head_dim)


def interpolated(theta, j, head_dim, method, s, block_size):
    """RoPE interpolation's theta'_j at factor s > 1 (see RopeScaling)."""
    if method == "pi":
        return theta / s
    if method in ("ntk", "dynamic_ntk"):  # base' = base * s^(d/(d-2)), i.e. theta'_j = theta_j * s^(-2j/(d-2))
        return theta * s ** (-2 * j / (head_dim - 2)) if head_dim > 2 else theta
    # yarn: pair j turns r_j = l / lambda_j times over the training length l (wavelength lambda_j = 2 pi / theta_j).
    # Below alpha turns, training never showed it a full turn: interpolate (theta_j / s). Above beta turns it saw
    # every angle: keep theta_j. In between, the paper's linear ramp gamma_j = (r_j - alpha) / (beta - alpha). (The
    # official code ramps linearly in the pair index instead, between the pairs where r_j = beta and r_j = alpha,
    # rounded outwards.) At a small l every pair may fall below beta: at l = 128 and d = 32 the fastest pair turns
    # 20 times and keeps 62% of its angle unscaled, and 10 of the 16 pairs are interpolated fully.
    ramp = ((block_size * theta / (2 * math.pi) - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA)).clamp(0, 1)
    return (1 - ramp) * theta / s + ramp * theta


def yarn_sharpening(s):
    """YaRN's attention temperature: softmax(q.k / (t sqrt(d))) with sqrt(1/t) = 0.1 ln s + 1, applied to q and k
    alike (so the scores grow by (0.1 ln s + 1)^2): longer contexts spread attention thinner, and this undoes it."""
    return 0.1 * math.log(s) + 1


def xpos_largest_scale(n_keys, config):
    """The largest factor xPos multiplies a q or k pair by, over a frame of n_keys consecutive positions (1 for RoPE).

    With the exponent centred it is zeta_0^(-(n_keys/2)/scale_base), zeta_0 = gamma/(1+gamma): 3.5^(T/1024) at the
    paper's defaults, 22,519 at T = 8192. Times |q| of about 20 that passes float16's largest value (65,504), and the
    scores turn to inf and NaN. No split of the exponent between q and k avoids it (keeping every factor <= 1 would
    need the centre both before the first and after the last position), so where this factor exceeds 2^8 q and k are
    positioned in float32 and attention runs in float32: from about 4,500 tokens at the paper's defaults, and only
    without BCA, whose windows of block_size keys keep every factor at most 3.5 there.
    """
    if config.pos != "xpos":
        return 1.0
    zeta_0 = config.xpos_gamma / (1 + config.xpos_gamma)
    return zeta_0 ** (-(n_keys // 2) / config.xpos_scale_base)


def alibi_slopes(n_head):
    """ALiBi's head slopes (Press et al. §3): 2^(-8i/n) for i = 1..n when n is a power of two; otherwise the slopes
    for the power of two p below n, then every other slope for 2p until there are n."""
    geometric = lambda n: [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]
    p = 2 ** int(math.log2(n_head))
    return torch.tensor(geometric(p) + geometric(2 * p)[0::2][: n_head - p])


# ---------------------------------------------------------------------------------------------------------------
# Attention rules: which keys query t sees, the one table of them. Each is inference-time only (training is plain
# causal attention at length l = block_size), and each window rule runs in O(T * W) time and memory.
#
#   rule     query t sees                            positions, for relative schemes
#   causal   0 .. t                                  absolute
#   bca      (t//H - 1)*H .. t, H = l/2              rebased into the window 0 .. l-1     (paper §3.3)
#   sliding  t-W+1 .. t                              rebased: no distance exceeds W-1
#   sinks    0 .. S-1, and t-(W-S)+1 .. t            the sinks at 0 .. S-1 and the recent keys right after them,
#                                                    the query at min(t, W-1)            (StreamingLLM, Xiao et al.)
#
# BCA (the LeX Transformer's): queries are cut into half-blocks, and a query sees the whole previous half-block
# plus its own causally, H+1 ... l keys; every layer does this, so information still travels n_layer*H tokens back
# through depth. StreamingLLM's sinks: the first tokens soak up attention a softmax must put somewhere, and dropping
# them is what breaks a plain sliding window; the re-indexing keeps every distance below W.
#
# All three windows are one mechanism (windowed_attention, KVCache): queries cut into blocks of b (H for bca, W for
# sliding and sinks); a query in block i sees keys of blocks i-1 and i only, positioned in the window frame
# 0 .. 2b-1 that every window shares; the rule's reach (W for sliding, W-S for the sinks' recent keys) trims the
# window past the first block, and the sinks join it. Up to T = b every rule is plain causal attention.

ATTENTION_RULES = ("auto", "causal", "bca", "sliding", "sinks")


@dataclass(frozen=True)
class AttentionRule:
    """One rule of the table above; auto is bca for a sequence longer than block_size, causal otherwise."""
    name: str = "auto"
    window: int = None  # W for sliding and sinks (None: block_size); bca's is always block_size
    sinks: int = 4  # S for sinks (StreamingLLM's default)

    def __post_init__(self):
        positive = lambda x: isinstance(x, int) and not isinstance(x, bool) and x > 0
        if self.name not in ATTENTION_RULES:
            raise ValueError(f"attention={self.name!r} is not allowed: must be one of {', '.join(ATTENTION_RULES)}")
        if self.window is not None and not positive(self.window):
            raise ValueError(f"window={self.window!r} is not allowed: must be a positive integer")
        if not positive(self.sinks):
            raise ValueError(f"sinks={self.sinks!r} is not allowed: must be a positive integer")

    def resolve(self, n_tokens, block_size):
        """The rule for a sequence of n_tokens: auto decided, W filled in."""
        name = self.name if self.name != "auto" else "bca" if n_tokens > block_size else "causal"
        window = {"bca": block_size, "sliding": self.window or block_size, "sinks": self.window or block_size}
        rule = AttentionRule(name, window.get(name), self.sinks)
        if name == "sinks" and rule.sinks >= rule.window:
            raise ValueError(f"sinks={rule.sinks} is not allowed with window={rule.window}: the window holds the "
                             "sinks and at least one recent key, so sinks must be < window")
        return rule

    @property
    def block(self):
        """b: a query in block i sees keys of blocks i-1 and i only (None under causal attention)."""
        return None if self.name == "causal" else self.window // 2 if self.name == "bca" else self.window

    @property
    def reach(self):
        """Past the first block, a query sees keys at distance < reach (None: every key of its window)."""
        return self.window if self.name == "sliding" else self.window - self.sinks if self.name == "sinks" else None

    @property
    def n_sinks(self):
        return self.sinks if self.name == "sinks" else 0

    def span(self, n_tokens):
        """The most positions one query sees in a sequence of n_tokens: what RoPE interpolation scales against."""
        return n_tokens if self.name == "causal" else min(n_tokens, self.window)


def options(attention, rope_scaling):
    """(AttentionRule, RopeScaling) from None (the defaults), a name, or one already made."""
    def made(value, kind, name):
        if value is None or isinstance(value, str):
            return kind() if value is None else kind(value)
        if not isinstance(value, kind):
            raise ValueError(f"{name}={value!r} is not allowed: must be None, a name or a {kind.__name__}")
        return value
    return made(attention, AttentionRule, "attention"), made(rope_scaling, RopeScaling, "rope_scaling")


# ---------------------------------------------------------------------------------------------------------------
# The position table: what attention needs of the scheme and of the rule, computed once per forward pass.


class PositionTable:
    """Everything position-dependent that attention needs, for one frame of integer positions and one attention
    rule, computed once per forward pass and shared by all layers (and by all windows, which share one frame).

    It is a plain object, never a module buffer: nothing length-dependent enters the state_dict, so a checkpoint
    runs at any length. `frame` is the frame's whole extent, which fixes xPos's centre; `rows` are the positions
    this pass needs factors for (all of the frame, except when a KV cache adds a few tokens to a long frame).
    `rule` is the resolved AttentionRule (causal when None); `scaling` and `s` the RoPE interpolation, if any.

    RoPE and xPos (paper Eq. 10, Algorithm 1; RoPE is xPos with zeta = 1) live here. Pairs are interleaved as in
    Algorithm 1, and pair j of a query at m is the complex number x_2j + i*x_2j+1 times
        e^(i*m*theta_j) * zeta_j^((m - c) / scale_base),
    and of a key at n times e^(i*n*theta_j) * zeta_j^(-(n - c) / scale_base). The real dot product of q and k is the
    real part of sum_j q_j conj(k_j), which then carries cos((m-n)theta_j) * zeta_j^((m-n)/scale_base): relative
    only. The centre c, the frame's middle as in the official code, cancels exactly in q.k; it halves the largest
    factor, which float16 has to hold (see xpos_largest_scale).
    """

    def __init__(self, config, frame, rows=None, device=None, rule=None, scaling=None, s=1.0):
        self.config, self.rows, self.device = config, rows or frame, device
        self.rule, self.s = rule or AttentionRule("causal"), s
        self.masks = {}  # (queries, keys, dtype, sinks) -> the mask attention uses, shared by every layer
        self.q_factor = self.k_factor = None
        if config.pos in ("rope", "xpos"):
            theta, zeta = rotary_frequencies(config.n_embd // config.n_head, config, device, scaling, s)
            pos = torch.arange(self.rows.start, self.rows.stop, device=device, dtype=torch.float32)[:, None]
            angle = pos * theta  # float32: in float16 the angles would be 0.6 rad off at position 4,096
            self.q_factor = self.k_factor = torch.polar(torch.ones_like(angle), angle)
            if config.pos == "xpos":
                centre = (frame.start + frame.stop - 1) // 2
                scale = zeta ** ((pos - centre) / config.xpos_scale_base)
                self.q_factor, self.k_factor = self.q_factor * scale, self.q_factor / scale
            if scaling is not None and scaling.method == "yarn" and s > 1:
                self.q_factor, self.k_factor = (f * yarn_sharpening(s) for f in (self.q_factor, self.k_factor))
        self.float16_overflows = xpos_largest_scale(len(frame), config) > 2.0**8

    def place(self, x, positions, key=False):
        """x (..., len(positions), head_dim) at the integer positions `positions` (a range, or one int for every
        row): rotated (and scaled) for rope and xpos, unchanged otherwise. float32 out where float16 could not hold
        xPos's factors."""
        if self.q_factor is None:
            return x
        if isinstance(positions, int):
            rows = slice(positions - self.rows.start, positions - self.rows.start + 1)
        else:
            rows = slice(positions.start - self.rows.start, positions.stop - self.rows.start)
        factor = (self.k_factor if key else self.q_factor)[rows]
        y = torch.view_as_real(torch.view_as_complex(x.float().unflatten(-1, (-1, 2))) * factor).flatten(-2)
        return y if x.dtype == torch.float16 and self.float16_overflows else y.to(x.dtype)

    def mask(self, queries, keys, dtype, sinks=False):
        """SDPA's mask for queries at frame positions `queries` and keys at `keys` (ranges), after the rule's S sinks
        when sinks is True (join_sinks). Query m sees key n iff n <= m, and under a rule with a reach (sliding,
        sinks) past its first block only while m - n < reach; it sees every sink, at distance W-1-j. "causal" for
        the square causal case (SDPA's is_causal path, FlashAttention on GPU), None when every key is visible, else
        boolean. Never an additive -inf, because an overflowed (inf) masked score plus -inf is NaN; ALiBi's bias,
        -slope_h * distance, is the one float mask, and its scores are never amplified."""
        if (queries, keys, dtype, sinks) in self.masks:
            return self.masks[queries, keys, dtype, sinks]
        rule = self.rule
        q_pos = torch.arange(queries.start, queries.stop, device=self.device)[:, None]
        k_pos = torch.arange(keys.start, keys.stop, device=self.device)[None, :]
        distance = q_pos - k_pos
        visible = distance >= 0
        band_hides = rule.reach is not None and queries.stop - 1 >= rule.block and queries.stop - 1 - keys.start >= \
            rule.reach  # whether the reach can hide any key here (the mask does it exactly)
        if band_hides:
            visible &= (distance < rule.reach) | (q_pos < rule.block)
        if sinks:
            j = torch.arange(rule.n_sinks, device=self.device)
            distance = torch.cat(((rule.window - 1 - j).expand(len(queries), -1), distance), dim=1)
            visible = torch.cat((torch.ones_like(visible[:, :1]).expand(-1, len(j)), visible), dim=1)
        if self.config.pos == "alibi":
            slopes = alibi_slopes(self.config.n_head).to(q_pos.device)[:, None, None]
            mask = (-slopes * distance).masked_fill(~visible, float("-inf")).to(dtype)
        elif queries == keys and not band_hides and not sinks:
            mask = "causal"
        elif keys.stop - 1 <= queries.start and not band_hides:
            mask = None
        else:
            mask = visible
        self.masks[queries, keys, dtype, sinks] = mask
        return mask


# ---------------------------------------------------------------------------------------------------------------
# Attention: one function for every scheme, every rule and the cached path.


def attention(q, k, v, table, queries, keys, dropout_p=0.0, sinks=False):
    """Causal attention of q at positions `queries` to k, v at `keys` (ranges in the frame of `table`), after the
    rule's sinks when sinks is True; q and k are positioned already (table.place, join_sinks). Relative schemes only
    use differences, so the frame is the caller's choice: absolute positions, or a window's 0 .. 2b-1."""
    mask = table.mask(queries, keys, q.dtype, sinks)
    causal = isinstance(mask, str)
    mask = None if causal else mask
    scale = None if q.size(-1) == v.size(-1) else v.size(-1) ** -0.5  # join_sinks doubles q's and k's head_dim
    if q.dtype == v.dtype:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal,
                                              scale=scale)
    with torch.autocast(q.device.type, enabled=False):  # float32 xPos (see xpos_largest_scale); autocast would undo it
        y = F.scaled_dot_product_attention(q, k, v.float(), attn_mask=mask, dropout_p=dropout_p, is_causal=causal,
                                           scale=scale)
    return y.to(v.dtype)


def attention_scores(q, k, table, queries, keys, sinks=False, head_dim=None):
    """The pre-softmax scores attention computes, written out: q.k / sqrt(head_dim), plus ALiBi's bias, -inf where
    masked, (..., len(queries), S + len(keys)) in float32. softmax(scores) @ v is attention's output (tests check
    it). head_dim: v's, when join_sinks made q and k twice as wide."""
    s = q.float() @ k.float().transpose(-1, -2) / math.sqrt(head_dim or q.size(-1))
    mask = table.mask(queries, keys, torch.float32, sinks)
    if isinstance(mask, str):
        mask = torch.ones(len(queries), len(keys), dtype=torch.bool, device=s.device).tril()
    if mask is None:
        return s
    return s + mask if mask.dtype == torch.float32 else s.masked_fill(~mask, float("-inf"))


# ---------------------------------------------------------------------------------------------------------------
# Windows: the vectorised pass every window rule shares (bca, sliding, sinks), and the sinks' join.


def window_start(t, block):
    """Absolute position of the first key in query t's window: the start of the previous block (under BCA the
    first key t sees: the closed form; the first author's fork is off by one here)."""
    return max(0, (t // block - 1) * block)


def windowed_attention(q, k, v, block, attend, sinks=None):
    """Any window rule, vectorised over blocks: time and memory O(T * block), never a T x T score matrix.

    q starts at a block boundary. k and v start with it (a whole sequence), or one block before it (a KV cache
    streaming a sequence hands over the previous block's keys). Without a previous block, the first is plain causal
    attention over its own keys. Every other block i attends to the window made of blocks i-1 and i, whose
    keys/values are shared by the two windows holding them, and the rule's mask (PositionTable.mask) does the rest.
    sinks: the raw keys and values of the sinks rule's first S tokens. attend(q, k, v, queries, keys, sinks)
    positions q and k in the window frame and attends.
    """
    B, nh, T, hd = q.shape
    y_first = None
    if k.size(2) == T:  # no previous block
        first = range(min(T, block))
        y_first = attend(q[:, :, :block], k[:, :, :block], v[:, :, :block], first, first)
        if T <= block:
            return y_first
        q, T = q[:, :, block:], T - block
    n_blocks = -(-T // block)
    pad = n_blocks * block - T  # padded queries are dropped below; padded keys lie in every real query's future

    def blocks(x, n):  # (B, nh, time, hd) -> (B, n, nh, b, hd)
        return F.pad(x, (0, 0, 0, n * block - x.size(2))).view(B, nh, n, block, hd).transpose(1, 2)

    def windows(x):  # (B * n_blocks, nh, 2b, hd): for each query block, the previous block and itself
        x = blocks(x, n_blocks + 1)
        return torch.cat((x[:, :-1], x[:, 1:]), dim=3).flatten(0, 1)

    if sinks is not None:  # the same sinks for every block
        sinks = [s[:, None].expand(-1, n_blocks, -1, -1, -1).flatten(0, 1) for s in sinks]
    y = attend(blocks(q, n_blocks).flatten(0, 1), windows(k), windows(v), range(block, 2 * block), range(2 * block),
               sinks)
    y = y.view(B, n_blocks, nh, block, hd).transpose(1, 2).reshape(B, nh, -1, hd)[:, :, : n_blocks * block - pad]
    return y if y_first is None else torch.cat((y_first, y), dim=2)


def join_sinks(q, q_placed, k_placed, v, sinks, table):
    """The sinks rule past its first block: q (raw, and placed in the window frame) against the S sinks followed by
    the window's keys; returns (q, k, v) for attention(..., sinks=True).

    StreamingLLM positions keys by their place in its cache, the sinks at 0 .. S-1 and the recent keys right after
    them, so a query past the first window stands at W-1 as seen from the sinks but at its true distance from the
    recent keys. One placement of q cannot give both under rope or xpos, so q is placed twice, in the window frame
    and at W-1, and the two copies are joined along head_dim; the window's keys get zeros in the second half and the
    sinks zeros in the first, so each q.k is the score of its own kind of key (attention scales by v's head_dim).
    ALiBi's bias lives in the mask, and the other schemes have no relative positions: they need no second copy.
    """
    sink_k, sink_v = sinks
    sink_k = table.place(sink_k, range(sink_k.size(2)), key=True)
    if table.q_factor is not None:
        hd = q.size(-1)
        q_placed = torch.cat((q_placed, table.place(q, table.rule.window - 1)), dim=-1)
        sink_k, k_placed = F.pad(sink_k, (hd, 0)), F.pad(k_placed, (0, hd))
    return q_placed, torch.cat((sink_k, k_placed), dim=2), torch.cat((sink_v, v), dim=2)


# ---------------------------------------------------------------------------------------------------------------
# KV cache: generation, chunked prefill and streaming evaluation.


class KVCache:
    """One layer's keys and values, preallocated, positioned as they are stored.

    Under a window rule (bca, sliding, sinks) it holds at most 2b keys, those of the current window, positioned in
    the window frame 0 .. 2b-1 that every window shares; for BCA this is the paper's "recurrently reuses the
    overlapped key and value vectors". When the window moves on (every b tokens) the b keys it keeps are moved to
    the front and positioned again from their raw copies, so the cost per token stays flat at any length. The sinks
    rule also keeps the raw keys and values of the first S tokens. Under causal attention it holds every key,
    positioned in the absolute frame 0 .. max_tokens-1.
    Any number of tokens may be added per call (prefill, one-token decode, chunks): the new tokens are split at
    block boundaries, and each piece attends to its window exactly as in the full forward pass.
    """

    def __init__(self, config, max_tokens, rule, scaling):
        self.config, self.max_tokens, self.rule, self.scaling = config, max_tokens, rule, scaling
        self.block = rule.block  # None under causal attention: every key is held
        self.start = 0  # absolute position of the first key held: the frame's origin
        self.n = 0  # keys held
        self.k = self.v = self.raw_k = None  # (B, n_head, capacity, head_dim), allocated on the first store
        self.sink_k = self.sink_v = None  # sinks: the first S tokens' raw keys and values
        self.placed_s = None  # the RoPE interpolation factor the held keys were positioned with
        self.observe = None  # observe(scores, queries, keys), absolute positions: see GPT.pre_softmax_scores

    def end(self):
        """Absolute position of the next token."""
        return self.start + self.n

    def table(self, n_new, device):
        """The PositionTable of a pass adding n_new tokens. Interpolation's s is fixed by max_tokens, as in a full
        pass over that many tokens, except for dynamic NTK, where it follows the current length. The keys already
        held are then positioned again from their raw copies whenever s changes (reposition), so decoding always
        equals a full forward pass over the prefix. (Hugging Face's dynamic NTK leaves cached keys at the angles they
        were given, so its cached and uncached outputs differ.)"""
        dynamic = self.scaling.method == "dynamic_ntk"
        s = self.scaling.s(self.rule.span(self.end() + n_new if dynamic else self.max_tokens), self.config.block_size)
        if self.block:  # (a sequence within one block never moves the window: the sequence is the frame)
            frame, rows = range(2 * self.block if self.max_tokens > self.block else self.max_tokens), None
        else:
            frame, rows = range(self.max_tokens), range(0 if dynamic else self.end(), self.end() + n_new)
        return PositionTable(self.config, frame, rows, device, self.rule, self.scaling, s)

    def pieces(self, n_new):
        """Absolute (first, stop) of the runs of new tokens that share one window."""
        t, stop = self.end(), self.end() + n_new
        while t < stop:
            piece_stop = min(stop, (t // self.block + 1) * self.block) if self.block else stop
            yield t, piece_stop
            t = piece_stop

    def attend(self, q, k, v, table, attend):
        """Add the new tokens' keys and values, and attend from their queries. attend is the no-cache rule
        (position q and k, then attention), which the vectorised window pass shares."""
        if self.k is not None and (k.size(0) != self.k.size(0) or v.dtype != self.v.dtype):
            raise ValueError(f"this KV cache holds a batch of {self.k.size(0)} in {self.v.dtype}, got {k.size(0)} in "
                             f"{v.dtype}: make a new one (new_cache) for another batch size or precision")
        self.reposition(table)
        t0, T = self.end(), q.size(2)
        if t0 < self.rule.n_sinks:
            self.keep_sinks(k, v, t0)
        bulk = 0  # under a window rule, the tokens from the first block boundary on, when a whole block or more
        if self.block and self.observe is None:
            to_boundary = min(T, -t0 % self.block)
            bulk = T - to_boundary if T - to_boundary >= self.block else 0
        head, tail = slice(0, T - bulk), slice(T - bulk, T)
        ys = [self.attend_pieces(q[:, :, head], k[:, :, head], v[:, :, head], table)] if T > bulk else []
        if bulk:
            ys.append(self.attend_bulk(q[:, :, tail], k[:, :, tail], v[:, :, tail], table, attend))
        return torch.cat(ys, dim=2)

    def attend_pieces(self, q, k, v, table):
        """Token runs that share one window (at most b tokens under a window rule), each against the keys held."""
        t0, ys = self.end(), []
        for first, stop in self.pieces(q.size(2)):
            if self.block:
                self.slide_to(window_start(first, self.block), table)
            new = slice(first - t0, stop - t0)
            queries, keys = range(first - self.start, stop - self.start), range(stop - self.start)
            self.store(k[:, :, new], v[:, :, new], table, queries)
            q_new, k_all, v_all = table.place(q[:, :, new], queries), self.k[:, :, : self.n], self.v[:, :, : self.n]
            sinks = self.rule.n_sinks > 0 and queries.start >= self.block
            if sinks:
                q_new, k_all, v_all = join_sinks(q[:, :, new], q_new, k_all, v_all, (self.sink_k, self.sink_v), table)
            if self.observe:
                self.report(attention_scores(q_new, k_all, table, queries, keys, sinks, v.size(-1)), queries, keys)
            ys.append(attention(q_new, k_all, v_all, table, queries, keys, sinks=sinks))
        return torch.cat(ys, dim=2)

    def report(self, scores, queries, keys):
        """Hand the scores to observe at absolute positions, the sinks (if any) apart from the window's keys."""
        shift = lambda r: range(r.start + self.start, r.stop + self.start)
        n_sinks = scores.size(-1) - len(keys)
        self.observe(scores[..., n_sinks:], shift(queries), shift(keys))
        if n_sinks:
            self.observe(scores[..., :n_sinks], shift(queries), range(n_sinks))

    def attend_bulk(self, q, k, v, table, attend):
        """Tokens from a block boundary on, in one vectorised window pass over the previous block's keys (the last b
        held) and the new ones; then the cache keeps the last window's keys."""
        held = min(self.n, self.block)
        raw = self.k if self.raw_k is None else self.raw_k
        k_all = torch.cat((raw[:, :, self.n - held : self.n], k), dim=2) if held else k
        v_all = torch.cat((self.v[:, :, self.n - held : self.n], v), dim=2) if held else v
        sinks = (self.sink_k, self.sink_v) if self.rule.n_sinks else None
        y = windowed_attention(q, k_all, v_all, self.block, attend, sinks)
        base, stop = self.end() - held, self.end() + q.size(2)
        self.start, self.n = window_start(stop - 1, self.block), 0
        keep = slice(self.start - base, None)
        self.store(k_all[:, :, keep], v_all[:, :, keep], table, range(stop - self.start))
        return y

    def store(self, k, v, table, positions):
        if self.k is None:
            B, nh, _, hd = k.shape
            capacity = min(2 * self.block, self.max_tokens) if self.block else self.max_tokens
            placed_dtype = torch.float32 if k.dtype == torch.float16 and table.float16_overflows else k.dtype
            self.k = k.new_empty(B, nh, capacity, hd, dtype=placed_dtype)
            self.v = v.new_empty(B, nh, capacity, hd)
            if self.config.pos in ("rope", "xpos") and (self.block or self.scaling.method == "dynamic_ntk"):
                self.raw_k = k.new_empty(B, nh, capacity, hd)
        n, m = self.n, k.size(2)
        self.k[:, :, n : n + m] = table.place(k, positions, key=True)
        self.v[:, :, n : n + m] = v
        if self.raw_k is not None:
            self.raw_k[:, :, n : n + m] = k
        self.n += m

    def keep_sinks(self, k, v, first):
        """Raw copies of the new tokens among the first S (k's first token is at absolute position `first`)."""
        S = self.rule.n_sinks
        if self.sink_k is None:
            self.sink_k, self.sink_v = k.new_empty(*k.shape[:2], S, k.size(3)), v.new_empty(*v.shape[:2], S, v.size(3))
        stop = min(S, first + k.size(2))
        self.sink_k[:, :, first:stop], self.sink_v[:, :, first:stop] = k[:, :, : stop - first], v[:, :, : stop - first]

    def reposition(self, table):
        """Position the held keys again from their raw copies when the interpolation factor s has changed (dynamic
        NTK, as the sequence grows)."""
        if self.raw_k is not None and self.n and table.s != self.placed_s:
            self.k[:, :, : self.n] = table.place(self.raw_k[:, :, : self.n], range(self.n), key=True)
        self.placed_s = table.s

    def slide_to(self, origin, table):
        """Move the window's origin on to `origin`: drop the keys before it, keep and re-position the rest."""
        drop = origin - self.start
        if drop <= 0:
            return
        keep = self.n - drop  # at most b: the window moves on only when it holds 2b keys
        for buf in (self.k, self.v, self.raw_k):
            if buf is not None:
                buf[:, :, :keep] = buf[:, :, drop : self.n]
        if self.raw_k is not None:
            self.k[:, :, :keep] = table.place(self.raw_k[:, :, :keep], range(keep), key=True)
        self.start, self.n = origin, keep


# ---------------------------------------------------------------------------------------------------------------
# The transformer.


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, table, cache=None):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).view(B, T, 3, self.config.n_head, C // self.config.n_head).permute(2, 0, 3, 1, 4)
        dropout_p = self.config.dropout if self.training else 0.0

        def attend(q, k, v, queries, keys, sinks=None):
            q_placed, k_placed = table.place(q, queries), table.place(k, keys, key=True)
            if sinks is not None:
                q_placed, k_placed, v = join_sinks(q, q_placed, k_placed, v, sinks, table)
            return attention(q_placed, k_placed, v, table, queries, keys, dropout_p, sinks is not None)

        rule = table.rule
        if cache is not None:
            y = cache.attend(q, k, v, table, attend)
        elif rule.block:
            sinks = (k[:, :, : rule.n_sinks], v[:, :, : rule.n_sinks]) if rule.n_sinks else None
            y = windowed_attention(q, k, v, rule.block, attend, sinks)
        else:
            y = attend(q, k, v, range(T), range(T))
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, C)))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, table, cache=None):
        x = x + self.attn(self.ln_1(x), table, cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        if config.pos == "learned":
            self.transformer.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by 1/sqrt(2 * n_layer)
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def get_num_params(self):
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx, targets=None, *, attention=None, rope_scaling=None, cache=None):
        """Returns (logits, loss).

        idx, targets: (B, T) token ids; targets of -1 are ignored. With targets, logits cover every position and
        loss is the mean next-token NLL (token_nll gives it per token). Without targets, only the last position's
        logits are computed and loss is None.
        attention: which keys a query sees, an AttentionRule or its name; None is auto, blockwise causal attention
        exactly when the sequence is longer than block_size. rope_scaling: RoPE interpolation, a RopeScaling or its
        name; None is none. cache: from new_cache, which fixes both; idx then continues the sequence.
        """
        x = self.hidden_states(idx, attention, rope_scaling, cache)
        if targets is None:
            return self.head(x[:, [-1], :]), None
        logits = self.head(x)
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)

    def attention_rule(self, n_tokens, attention=None):
        """The AttentionRule for a sequence of n_tokens (auto decided); attention is None (auto), a name or a rule."""
        return options(attention, None)[0].resolve(n_tokens, self.config.block_size)

    def position_table(self, n_tokens, attention=None, rope_scaling=None, device=None):
        """The PositionTable of a full forward pass over n_tokens: the absolute frame under causal attention, the
        window frame 0 .. 2b-1 under a window rule, and the interpolation factor for the positions a query sees."""
        rule, scaling = self.attention_rule(n_tokens, attention), options(None, rope_scaling)[1]
        frame = range(2 * rule.block) if rule.block and n_tokens > rule.block else range(n_tokens)
        s = scaling.s(rule.span(n_tokens), self.config.block_size)
        return PositionTable(self.config, frame, device=device, rule=rule, scaling=scaling, s=s)

    def new_cache(self, max_tokens, attention=None, rope_scaling=None):
        """An empty KV cache (one KVCache per layer) for a sequence of up to max_tokens tokens, with the attention
        rule for max_tokens (attention_rule); under a window rule it holds at most 2b keys per layer."""
        rule, scaling = self.attention_rule(max_tokens, attention), options(None, rope_scaling)[1]
        check_length(self.config, max_tokens)
        return [KVCache(self.config, max_tokens, rule, scaling) for _ in self.transformer.h]

    @torch.no_grad()
    def token_nll(self, idx, targets, *, attention=None, rope_scaling=None, chunk_tokens=16384):
        """(B, T) next-token NLL, for evaluation, chunk_tokens / B positions at a time. Under a window rule a longer
        sequence is streamed through a KV cache of one window, so memory stays flat at any T: O(window) for
        attention plus one chunk's activations and logits. Under causal attention the blocks run in one piece
        (every key is needed anyway) and only the output layer goes chunk by chunk, which still bounds the logits
        (GPT-2's vocabulary would need 824 MB of float32 logits for one 4,096-token sequence). Either way the result
        equals the one-piece forward pass. Dynamic NTK is the exception: where it scales anything (a query sees more
        than block_size positions) it decodes token by token past block_size, so that each token is predicted at the
        factor of its own length, as in generation (one pass per token)."""
        B, T = idx.shape
        step = max(1, chunk_tokens // B)
        rule, scaling = self.attention_rule(T, attention), options(None, rope_scaling)[1]
        sizes = None
        rotary = self.config.pos in ("rope", "xpos")
        if scaling.method == "dynamic_ntk" and rotary and rule.span(T) > self.config.block_size:
            sizes = [self.config.block_size] + [1] * (T - self.config.block_size)
        elif rule.block and T > step:
            sizes = [min(step, T - i) for i in range(0, T, step)]
        if sizes:
            cache = self.new_cache(T, rule, scaling)
            starts = itertools.accumulate(sizes[:-1], initial=0)
            pieces = ((i, self.hidden_states(idx[:, i : i + n], cache=cache)) for i, n in zip(starts, sizes))
        else:
            x = self.hidden_states(idx, rule, scaling)
            pieces = ((i, x[:, i : i + step]) for i in range(0, T, step))
        nll = [F.cross_entropy(self.head(h).float().flatten(0, 1), targets[:, i : i + h.size(1)].flatten(),
                               ignore_index=-1, reduction="none").view(B, -1) for i, h in pieces]
        return torch.cat(nll, dim=1)

    @torch.no_grad()
    def pre_softmax_scores(self, idx, observe, attention=None, rope_scaling=None, chunk=None):
        """Calls observe(layer, scores, queries, keys) with the pre-softmax scores (B, n_head, Q, K) of every layer,
        exactly as attention computes them (attention_scores), for chunks of queries at absolute positions
        `queries` against their visible keys `keys` (ranges; under the sinks rule, the sinks come in a call of
        their own). Streams through the KV cache in chunks of half a block (by default), so memory stays
        O(T * window) under a window rule."""
        T = idx.size(1)
        cache = self.new_cache(T, attention, rope_scaling)
        for layer, c in enumerate(cache):
            c.observe = lambda scores, queries, keys, layer=layer: observe(layer, scores, queries, keys)
        step = chunk or self.config.block_size // 2
        for i in range(0, T, step):
            self.hidden_states(idx[:, i : i + step], cache=cache)

    def head(self, x):
        """The output layer. Outside training it runs in float32 even under autocast: bfloat16 logits are rounded
        before the loss (about +-0.06 at |logit| 20), which evaluation should not measure."""
        if self.training:
            return self.lm_head(x)
        with torch.autocast(x.device.type, enabled=False):
            return self.lm_head(x.float())

    def hidden_states(self, idx, attention=None, rope_scaling=None, cache=None):
        """Embeddings, the blocks and the final LayerNorm: (B, T, n_embd), before the output layer."""
        B, T = idx.shape
        start = cache[0].end() if cache else 0
        if cache:
            if attention is not None or rope_scaling is not None:
                raise ValueError("attention and rope_scaling are fixed when the cache is made (new_cache); pass "
                                 "neither with a cache")
            if start + T > cache[0].max_tokens:
                raise ValueError(f"the KV cache was made for {cache[0].max_tokens} tokens, asked for {start + T}")
            table = cache[0].table(T, idx.device)
        else:
            check_length(self.config, T)
            table = self.position_table(T, attention, rope_scaling, idx.device)
        pos = torch.arange(start, start + T, device=idx.device)
        x = self.transformer.wte(idx)
        if self.config.pos == "learned":
            x = x + self.transformer.wpe(pos)
        elif self.config.pos == "sinusoidal":  # absolute positions at any length, under any attention rule
            # Token embeddings (std 0.02) are scaled by sqrt(n_embd), as in Vaswani et al. §3.4 and fairseq, so that
            # tokens and the table (RMS 0.71) enter at comparable scale: 1 : 3.1 at n_embd 128 and 1 : 1.1 at 1024,
            # instead of 1 : 35 unscaled, which would drown the tokens in position.
            x = x * math.sqrt(self.config.n_embd) + sinusoidal_embedding(pos, self.config.n_embd).to(x.dtype)
        x = self.transformer.drop(x)
        for i, block in enumerate(self.transformer.h):
            x = block(x, table, cache[i] if cache else None)
        return self.transformer.ln_f(x)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, *, attention=None, rope_scaling=None):
        """Sample max_new_tokens tokens after idx (B, T) with a KV cache.

        The context is never cropped: past block_size every scheme but learned keeps going, by default with BCA
        (attention=None; a window rule's cache holds at most 2b keys per layer, and each token costs the same).
        """
        if not temperature > 0:
            raise ValueError(f"temperature={temperature!r} is not allowed: must be > 0 (use top_k=1 for greedy)")
        if max_new_tokens < 1:
            return idx
        cache = self.new_cache(idx.size(1) + max_new_tokens - 1, attention, rope_scaling)  # last one not fed back
        logits, _ = self(idx, cache=cache)
        for step in range(max_new_tokens):
            if step:
                logits, _ = self(idx[:, -1:], cache=cache)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx
