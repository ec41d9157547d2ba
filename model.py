"""
lex-gpt: one GPT in nanoGPT's layout with six position schemes, xPos, and blockwise causal attention (BCA).

Paper: "A Length-Extrapolatable Transformer" (Sun et al.). xPos is §3.2 (Eq. 10, Algorithm 1), BCA is §3.3.
Read top to bottom: config -> position schemes (PositionTable) -> the one attention function -> BCA -> KV cache
-> GPT.

Conventions used throughout:
- Attention tensors are (batch, n_head, time, head_dim).
- Positions are integer ranges in a frame: absolute (0 .. T-1), or a BCA window's 0 .. block_size-1. Angles, xPos
  scales and masks are computed from them once per forward pass (PositionTable) and shared by all layers; nothing
  length-dependent lives in the state_dict or among the module buffers (checkpoints work at any length).
- Rotary pairs are interleaved, (x0, x1), (x2, x3), ..., as in the paper's Algorithm 1.
"""

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


def rotary_frequencies(head_dim, config, device=None):
    """theta_j = rope_base^(-2j/d) (RoPE's angles; 0 for "xpos without rotation") and xPos's per-pair decay base
    zeta_j = (2j + gamma*d) / ((1 + gamma)*d) (paper Eq. 9), j = 0 .. d/2-1, float32."""
    j = torch.arange(head_dim // 2, device=device, dtype=torch.float32)
    theta = config.rope_base ** (-2 * j / head_dim)
    if config.pos == "xpos" and not config.xpos_rotate:
        theta = torch.zeros_like(theta)
    return theta, (2 * j + config.xpos_gamma * head_dim) / ((1 + config.xpos_gamma) * head_dim)


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


class PositionTable:
    """Everything position-dependent that attention needs, for one frame of integer positions, computed once per
    forward pass and shared by all layers (and by all BCA windows, which use the same frame 0 .. block_size-1).

    It is a plain object, never a module buffer: nothing length-dependent enters the state_dict, so a checkpoint
    runs at any length. `frame` is the frame's whole extent, which fixes xPos's centre; `rows` are the positions
    this pass needs factors for (all of the frame, except when a KV cache adds a few tokens to a long frame).

    RoPE and xPos (paper Eq. 10, Algorithm 1; RoPE is xPos with zeta = 1) live here. Pairs are interleaved as in
    Algorithm 1, and pair j of a query at m is the complex number x_2j + i*x_2j+1 times
        e^(i*m*theta_j) * zeta_j^((m - c) / scale_base),
    and of a key at n times e^(i*n*theta_j) * zeta_j^(-(n - c) / scale_base). The real dot product of q and k is the
    real part of sum_j q_j conj(k_j), which then carries cos((m-n)theta_j) * zeta_j^((m-n)/scale_base): relative
    only. The centre c, the frame's middle as in the official code, cancels exactly in q.k; it halves the largest
    factor, which float16 has to hold (see xpos_largest_scale).
    """

    def __init__(self, config, frame, rows=None, device=None):
        self.config, self.rows, self.device = config, rows or frame, device
        self.masks = {}  # (queries, keys, dtype) -> the mask attention uses, shared by every layer
        self.q_factor = self.k_factor = None
        if config.pos in ("rope", "xpos"):
            theta, zeta = rotary_frequencies(config.n_embd // config.n_head, config, device)
            pos = torch.arange(self.rows.start, self.rows.stop, device=device, dtype=torch.float32)[:, None]
            angle = pos * theta  # float32: in float16 the angles would be 0.6 rad off at position 4,096
            self.q_factor = self.k_factor = torch.polar(torch.ones_like(angle), angle)
            if config.pos == "xpos":
                centre = (frame.start + frame.stop - 1) // 2
                scale = zeta ** ((pos - centre) / config.xpos_scale_base)
                self.q_factor, self.k_factor = self.q_factor * scale, self.q_factor / scale
        self.float16_overflows = xpos_largest_scale(len(frame), config) > 2.0**8

    def place(self, x, positions, key=False):
        """x (..., len(positions), head_dim) at the integer positions `positions` (a range): rotated (and scaled)
        for rope and xpos, unchanged otherwise. float32 out where float16 could not hold xPos's factors."""
        if self.q_factor is None:
            return x
        rows = slice(positions.start - self.rows.start, positions.stop - self.rows.start)
        factor = (self.k_factor if key else self.q_factor)[rows]
        y = torch.view_as_real(torch.view_as_complex(x.float().unflatten(-1, (-1, 2))) * factor).flatten(-2)
        return y if x.dtype == torch.float16 and self.float16_overflows else y.to(x.dtype)

    def mask(self, queries, keys, dtype):
        """SDPA's mask for queries at positions `queries` and keys at `keys` (ranges), where query m sees key n iff
        n <= m: "causal" for the square case (SDPA's is_causal path, FlashAttention on GPU), None when every key is
        visible, else boolean. Never an additive -inf, because an overflowed (inf) masked score plus -inf is NaN;
        ALiBi's bias, -slope_h * (m - n), is the one float mask, and its scores are never amplified."""
        if (queries, keys, dtype) not in self.masks:
            q_pos = torch.arange(queries.start, queries.stop, device=self.device)[:, None]
            k_pos = torch.arange(keys.start, keys.stop, device=self.device)[None, :]
            if self.config.pos == "alibi":
                slopes = alibi_slopes(self.config.n_head).to(q_pos.device)[:, None, None]
                mask = (-slopes * (q_pos - k_pos)).masked_fill(k_pos > q_pos, float("-inf")).to(dtype)
            elif queries == keys:
                mask = "causal"
            elif keys.stop - 1 <= queries.start:
                mask = None
            else:
                mask = k_pos <= q_pos
            self.masks[queries, keys, dtype] = mask
        return self.masks[queries, keys, dtype]


# ---------------------------------------------------------------------------------------------------------------
# Attention: one function for every scheme, every mask and the cached path.


def attention(q, k, v, table, queries, keys, dropout_p=0.0):
    """Causal attention of q at positions `queries` to k, v at `keys` (ranges in the frame of `table`); q and k are
    positioned already (table.place). Relative schemes only use differences, so the frame is the caller's choice:
    absolute positions, or a BCA window's 0 .. block_size-1."""
    mask = table.mask(queries, keys, q.dtype)
    causal = isinstance(mask, str)
    mask = None if causal else mask
    if q.dtype == v.dtype:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal)
    with torch.autocast(q.device.type, enabled=False):  # float32 xPos (see xpos_largest_scale); autocast would undo it
        y = F.scaled_dot_product_attention(q, k, v.float(), attn_mask=mask, dropout_p=dropout_p, is_causal=causal)
    return y.to(v.dtype)


def attention_scores(q, k, table, queries, keys):
    """The pre-softmax scores attention computes, written out: q.k / sqrt(d), plus ALiBi's bias, -inf where masked,
    (..., len(queries), len(keys)) in float32. softmax(scores) @ v is attention's output (tests check it)."""
    s = q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.size(-1))
    mask = table.mask(queries, keys, torch.float32)
    if isinstance(mask, str):
        mask = torch.ones(len(queries), len(keys), dtype=torch.bool, device=s.device).tril()
    if mask is None:
        return s
    return s + mask if mask.dtype == torch.float32 else s.masked_fill(~mask, float("-inf"))


# ---------------------------------------------------------------------------------------------------------------
# Blockwise causal attention (paper §3.3), the one place it lives. Inference-time only: training uses plain causal
# attention at length l = block_size. Queries are cut into half-blocks of H = l/2; query t sees exactly the keys
#     bca_window_start(t, H) <= n <= t,
# i.e. the whole previous half-block plus its own half-block causally (H+1 ... l keys). Every layer does this, so
# information still travels n_layer*H tokens back through depth. For T <= l it is plain causal attention.
# Inside a window, positions are rebased to 0 .. 2H-1: relative schemes never see a distance beyond l-1, xPos
# scales stay bounded at any T, and one PositionTable serves every window.


def bca_window_start(t, half):
    """First key that query t sees under BCA (the closed form; the first author's fork is off by one here)."""
    return max(0, (t // half - 1) * half)


def blockwise_causal_attention(q, k, v, half, attend):
    """BCA vectorised over blocks: time and memory O(T * block_size), never a T x T score matrix.

    q starts at a half-block boundary. k and v start with it (a whole sequence), or one half-block before it (a KV
    cache streaming a sequence hands over the previous half-block's keys). Without a previous half-block, the first
    is plain causal attention over its own keys. Every other half-block b attends to the window made of half-blocks
    b-1 and b, whose keys/values are shared by the two windows holding them. attend(q, k, v, queries, keys)
    positions q and k in the window frame and attends.
    """
    B, nh, T, hd = q.shape
    y_first = None
    if k.size(2) == T:  # no previous half-block
        first = range(min(T, half))
        y_first = attend(q[:, :, :half], k[:, :, :half], v[:, :, :half], first, first)
        if T <= half:
            return y_first
        q, T = q[:, :, half:], T - half
    n_blocks = -(-T // half)
    pad = n_blocks * half - T  # padded queries are dropped below; padded keys lie in every real query's future

    def blocks(x, n):  # (B, nh, time, hd) -> (B, n, nh, H, hd)
        return F.pad(x, (0, 0, 0, n * half - x.size(2))).view(B, nh, n, half, hd).transpose(1, 2)

    def windows(x):  # (B * n_blocks, nh, 2H, hd): for each query half-block, its previous half-block and itself
        x = blocks(x, n_blocks + 1)
        return torch.cat((x[:, :-1], x[:, 1:]), dim=3).flatten(0, 1)

    y = attend(blocks(q, n_blocks).flatten(0, 1), windows(k), windows(v), range(half, 2 * half), range(2 * half))
    y = y.view(B, n_blocks, nh, half, hd).transpose(1, 2).reshape(B, nh, -1, hd)[:, :, : n_blocks * half - pad]
    return y if y_first is None else torch.cat((y_first, y), dim=2)


# ---------------------------------------------------------------------------------------------------------------
# KV cache: generation, chunked prefill and streaming evaluation.


class KVCache:
    """One layer's keys and values, preallocated, positioned as they are stored.

    Under BCA (window=True) it holds at most block_size keys, those of the current window, positioned in the window
    frame 0 .. 2H-1 that every window shares; this is the paper's "recurrently reuses the overlapped key and value
    vectors". When the window moves on (every H tokens) the H keys it keeps are moved to the front and positioned
    again from their raw copies, so the cost per token stays flat at any length. Without BCA it holds every key,
    positioned once in the absolute frame 0 .. max_tokens-1.
    Any number of tokens may be added per call (prefill, one-token decode, chunks): the new tokens are split at
    half-block boundaries, and each piece attends to its window exactly as in the full forward pass.
    """

    def __init__(self, config, max_tokens, window):
        self.config, self.max_tokens, self.window = config, max_tokens, window
        self.half = config.block_size // 2
        self.start = 0  # absolute position of the first key held: the frame's origin
        self.n = 0  # keys held
        self.k = self.v = self.raw_k = None  # (B, n_head, capacity, head_dim), allocated on the first store
        self.observe = None  # observe(scores, queries, keys), absolute positions: see GPT.pre_softmax_scores

    def end(self):
        """Absolute position of the next token."""
        return self.start + self.n

    def frame(self, n_new):
        """(frame, rows) of the PositionTable for a pass adding n_new tokens."""
        if self.window:
            return range(2 * self.half), None
        return range(self.max_tokens), range(self.end(), self.end() + n_new)

    def pieces(self, n_new):
        """Absolute (first, stop) of the runs of new tokens that share one window."""
        t, stop = self.end(), self.end() + n_new
        while t < stop:
            piece_stop = min(stop, (t // self.half + 1) * self.half) if self.window else stop
            yield t, piece_stop
            t = piece_stop

    def attend(self, q, k, v, table, attend):
        """Add the new tokens' keys and values, and attend from their queries. attend is the no-cache rule
        (position q and k, then attention), which the vectorised BCA pass shares."""
        t0, T = self.end(), q.size(2)
        bulk = 0  # under BCA, the tokens from the first half-block boundary on, when a whole half-block or more
        if self.window and self.observe is None:
            to_boundary = min(T, -t0 % self.half)
            bulk = T - to_boundary if T - to_boundary >= self.half else 0
        head, tail = slice(0, T - bulk), slice(T - bulk, T)
        ys = [self.attend_pieces(q[:, :, head], k[:, :, head], v[:, :, head], table)] if T > bulk else []
        if bulk:
            ys.append(self.attend_bulk(q[:, :, tail], k[:, :, tail], v[:, :, tail], table, attend))
        return torch.cat(ys, dim=2)

    def attend_pieces(self, q, k, v, table):
        """Token runs that share one window (at most H tokens under BCA), each against the keys held: decoding."""
        t0, ys = self.end(), []
        for first, stop in self.pieces(q.size(2)):
            if self.window:
                self.slide_to(bca_window_start(first, self.half), table)
            new = slice(first - t0, stop - t0)
            queries, keys = range(first - self.start, stop - self.start), range(stop - self.start)
            self.store(k[:, :, new], v[:, :, new], table, queries)
            q_new, k_all, v_all = table.place(q[:, :, new], queries), self.k[:, :, : self.n], self.v[:, :, : self.n]
            if self.observe:
                shift = lambda r: range(r.start + self.start, r.stop + self.start)
                self.observe(attention_scores(q_new, k_all, table, queries, keys), shift(queries), shift(keys))
            ys.append(attention(q_new, k_all, v_all, table, queries, keys))
        return torch.cat(ys, dim=2)

    def attend_bulk(self, q, k, v, table, attend):
        """Tokens from a half-block boundary on, in one vectorised BCA pass over the previous half-block's keys
        (the last H held) and the new ones; then the cache keeps the last window's keys."""
        held = min(self.n, self.half)
        raw = self.k if self.raw_k is None else self.raw_k
        k_all = torch.cat((raw[:, :, self.n - held : self.n], k), dim=2) if held else k
        v_all = torch.cat((self.v[:, :, self.n - held : self.n], v), dim=2) if held else v
        y = blockwise_causal_attention(q, k_all, v_all, self.half, attend)
        base, stop = self.end() - held, self.end() + q.size(2)
        self.start, self.n = bca_window_start(stop - 1, self.half), 0
        keep = slice(self.start - base, None)
        self.store(k_all[:, :, keep], v_all[:, :, keep], table, range(stop - self.start))
        return y

    def store(self, k, v, table, positions):
        if self.k is not None and (k.size(0) != self.k.size(0) or v.dtype != self.v.dtype):
            raise ValueError(f"this KV cache holds a batch of {self.k.size(0)} in {self.v.dtype}, got {k.size(0)} in "
                             f"{v.dtype}: make a new one (new_cache) for another batch size or precision")
        if self.k is None:
            B, nh, _, hd = k.shape
            capacity = 2 * self.half if self.window else self.max_tokens
            placed_dtype = torch.float32 if k.dtype == torch.float16 and table.float16_overflows else k.dtype
            self.k = k.new_empty(B, nh, capacity, hd, dtype=placed_dtype)
            self.v = v.new_empty(B, nh, capacity, hd)
            if self.window and self.config.pos in ("rope", "xpos"):
                self.raw_k = k.new_empty(B, nh, capacity, hd)
        n, m = self.n, k.size(2)
        self.k[:, :, n : n + m] = table.place(k, positions, key=True)
        self.v[:, :, n : n + m] = v
        if self.raw_k is not None:
            self.raw_k[:, :, n : n + m] = k
        self.n += m

    def slide_to(self, origin, table):
        """Move the window's origin on to `origin`: drop the keys before it, keep and re-position the rest."""
        drop = origin - self.start
        if drop <= 0:
            return
        keep = self.n - drop  # at most H: the window moves on only when it holds 2H keys
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

    def forward(self, x, table, bca, cache=None):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).view(B, T, 3, self.config.n_head, C // self.config.n_head).permute(2, 0, 3, 1, 4)
        dropout_p = self.config.dropout if self.training else 0.0

        def attend(q, k, v, queries, keys):
            return attention(table.place(q, queries), table.place(k, keys, key=True), v, table, queries, keys,
                             dropout_p)

        if cache is not None:
            y = cache.attend(q, k, v, table, attend)
        elif bca:
            y = blockwise_causal_attention(q, k, v, self.config.block_size // 2, attend)
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

    def forward(self, x, table, bca, cache=None):
        x = x + self.attn(self.ln_1(x), table, bca, cache)
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

    def forward(self, idx, targets=None, *, bca=None, cache=None):
        """Returns (logits, loss).

        idx, targets: (B, T) token ids; targets of -1 are ignored. With targets, logits cover every position and
        loss is the mean next-token NLL (token_nll gives it per token). Without targets, only the last position's
        logits are computed and loss is None.
        bca: None uses blockwise causal attention exactly when the sequence is longer than block_size; True/False
        force it on/off. cache: from new_cache, which fixes the attention rule; idx then continues the sequence.
        """
        x = self.hidden_states(idx, bca, cache)
        if targets is None:
            return self.head(x[:, [-1], :]), None
        logits = self.head(x)
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)

    def uses_bca(self, n_tokens, bca):
        """The attention rule for a sequence of n_tokens: bca=None (auto) uses BCA exactly when it is longer than
        block_size (for shorter ones BCA is plain causal attention anyway); True/False force it on/off."""
        if bca not in (None, True, False):
            raise ValueError(f"bca={bca!r} is not allowed: must be None (auto), True or False")
        return n_tokens > self.config.block_size if bca is None else bca

    def new_cache(self, max_tokens, bca=None):
        """An empty KV cache (one KVCache per layer) for a sequence of up to max_tokens tokens, with the attention
        rule of uses_bca(max_tokens, bca); under BCA it holds at most block_size keys."""
        window = self.uses_bca(max_tokens, bca)
        check_length(self.config, max_tokens)
        return [KVCache(self.config, max_tokens, window) for _ in self.transformer.h]

    @torch.no_grad()
    def token_nll(self, idx, targets, *, bca=None, chunk_tokens=16384):
        """(B, T) next-token NLL, for evaluation, chunk_tokens / B positions at a time. Under BCA a longer sequence
        is streamed through a KV cache of block_size keys, so memory stays flat at any T: O(block_size) for
        attention plus one chunk's activations and logits. Otherwise the blocks run in one piece (plain causal
        attention needs every key anyway) and only the output layer goes chunk by chunk, which still bounds the
        logits (GPT-2's vocabulary would need 824 MB of float32 logits for one 4,096-token sequence). Either way
        the result equals the one-piece forward pass."""
        B, T = idx.shape
        step = max(1, chunk_tokens // B)
        if self.uses_bca(T, bca) and T > step:
            cache = self.new_cache(T, bca=True)
            hidden = (self.hidden_states(idx[:, i : i + step], cache=cache) for i in range(0, T, step))
        else:
            x = self.hidden_states(idx, bca)
            hidden = (x[:, i : i + step] for i in range(0, T, step))
        nll = [F.cross_entropy(self.head(h).float().flatten(0, 1), targets[:, i : i + step].flatten(), ignore_index=-1,
                               reduction="none").view(B, -1) for i, h in zip(range(0, T, step), hidden)]
        return torch.cat(nll, dim=1)

    @torch.no_grad()
    def pre_softmax_scores(self, idx, observe, bca=None, chunk=None):
        """Calls observe(layer, scores, queries, keys) with the pre-softmax scores (B, n_head, Q, K) of every layer,
        exactly as attention computes them (attention_scores), for chunks of queries at absolute positions
        `queries` against their visible keys `keys` (ranges). Streams through the KV cache in chunks of half a block
        (by default), so memory stays O(T * block_size) with or without BCA."""
        T = idx.size(1)
        cache = self.new_cache(T, bca)
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

    def hidden_states(self, idx, bca=None, cache=None):
        """Embeddings, the blocks and the final LayerNorm: (B, T, n_embd), before the output layer."""
        B, T = idx.shape
        use_bca = self.uses_bca(T, bca)
        start = cache[0].end() if cache else 0
        if cache:
            if bca is not None:
                raise ValueError("bca is fixed when the cache is made (new_cache); pass bca=None with a cache")
            if start + T > cache[0].max_tokens:
                raise ValueError(f"the KV cache was made for {cache[0].max_tokens} tokens, asked for {start + T}")
            table = PositionTable(self.config, *cache[0].frame(T), device=idx.device)  # the cache's rule applies
        else:
            check_length(self.config, T)
            frame = range(self.config.block_size) if use_bca else range(T)
            table = PositionTable(self.config, frame, device=idx.device)
        pos = torch.arange(start, start + T, device=idx.device)
        x = self.transformer.wte(idx)
        if self.config.pos == "learned":
            x = x + self.transformer.wpe(pos)
        elif self.config.pos == "sinusoidal":  # absolute positions at any length, with or without BCA
            # Token embeddings (std 0.02) are scaled by sqrt(n_embd), as in Vaswani et al. §3.4 and fairseq, so that
            # tokens and the table (RMS 0.71) enter at comparable scale: 1 : 3.1 at n_embd 128 and 1 : 1.1 at 1024,
            # instead of 1 : 35 unscaled, which would drown the tokens in position.
            x = x * math.sqrt(self.config.n_embd) + sinusoidal_embedding(pos, self.config.n_embd).to(x.dtype)
        x = self.transformer.drop(x)
        for i, block in enumerate(self.transformer.h):
            x = block(x, table, use_bca, cache[i] if cache else None)
        return self.transformer.ln_f(x)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, *, bca=None):
        """Sample max_new_tokens tokens after idx (B, T) with a KV cache.

        The context is never cropped: past block_size every scheme but learned keeps going, with BCA when bca is
        None or True (the cache then holds at most block_size keys per layer, and each token costs the same).
        """
        if not temperature > 0:
            raise ValueError(f"temperature={temperature!r} is not allowed: must be > 0 (use top_k=1 for greedy)")
        if max_new_tokens < 1:
            return idx
        cache = self.new_cache(idx.size(1) + max_new_tokens - 1, bca)  # the last token sampled is not fed back
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
