"""
lex-gpt: one GPT in nanoGPT's layout with six position schemes, xPos, and blockwise causal attention (BCA).

Paper: "A Length-Extrapolatable Transformer" (Sun et al.). xPos is §3.2 (Eq. 10, Algorithm 1), BCA is §3.3.
Read top to bottom: config -> position schemes -> the one attention function -> BCA -> KV cache -> GPT.

Conventions used throughout:
- Attention tensors are (batch, n_head, time, head_dim).
- Positions are integer tensors; angles and xPos scales are computed from them in float32 on every call, so
  nothing length-dependent lives in the state_dict or among the module buffers (checkpoints work at any length).
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
# Position schemes. Absolute ones (learned, sinusoidal) are added to the token embedding in GPT.forward; relative
# ones (rope, xpos, alibi) act inside attention and only ever see the positions the attention call hands them.


def sinusoidal_embedding(pos, dim):
    """Vaswani et al.'s table, PE[p, 2i] = sin(p / 10000^(2i/dim)), PE[p, 2i+1] = cos(...), at any position."""
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, device=pos.device, dtype=torch.float32) / dim)
    angle = pos.float()[:, None] * inv_freq
    return torch.stack((angle.sin(), angle.cos()), dim=-1).flatten(1)[:, :dim]


def rotate_pairs(x):
    """Algorithm 1's rot(x) = [-x1, x0, -x3, x2, ...]: multiplies each complex pair x_2j + i*x_2j+1 by i."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def rotary_frequencies(head_dim, config, device=None):
    """theta_j = rope_base^(-2j/d) (RoPE's angles; 0 for "xpos without rotation") and xPos's per-pair decay base
    zeta_j = (2j + gamma*d) / ((1 + gamma)*d) (paper Eq. 9), j = 0 .. d/2-1, float32."""
    j = torch.arange(head_dim // 2, device=device, dtype=torch.float32)
    theta = config.rope_base ** (-2 * j / head_dim)
    if config.pos == "xpos" and not config.xpos_rotate:
        theta = torch.zeros_like(theta)
    return theta, (2 * j + config.xpos_gamma * head_dim) / ((1 + config.xpos_gamma) * head_dim)


def rotary(q, k, q_pos, k_pos, config):
    """RoPE and xPos, the one place they live (paper Eq. 10, Algorithm 1; RoPE is xPos with zeta = 1).

    Query at m: pair j rotated by m*theta_j and scaled by zeta_j^(m/scale_base); key at n: rotated by n*theta_j and
    scaled by zeta_j^(-n/scale_base). q.k then carries cos((m-n)theta_j) * zeta_j^((m-n)/scale_base): relative only.
    """
    theta, zeta = rotary_frequencies(q.size(-1), config, q.device)
    # The scale exponent is centred on the keys' middle position, as in the official code: the offset cancels
    # exactly in q.k and halves the largest factor, which float16 has to hold (REFERENCE.md, Numerics).
    centre = torch.div(k_pos[0] + k_pos[-1], 2, rounding_mode="floor")

    out_dtype = torch.float32 if q.dtype == torch.float16 and xpos_largest_scale(len(k_pos), config) > 2.0**8 \
        else q.dtype  # see xpos_largest_scale: float16 could not hold the scaled q and k

    def transform(x, pos, sign):
        pos = pos.float()[:, None]
        angle = (pos * theta).repeat_interleave(2, dim=-1)  # float32: fp16 angles are 0.6 rad off at 4k
        y = x.float() * angle.cos() + rotate_pairs(x.float()) * angle.sin()
        if config.pos == "xpos":
            y = y * zeta.pow(sign * (pos - centre) / config.xpos_scale_base).repeat_interleave(2, dim=-1)
        return y.to(out_dtype)

    return transform(q, q_pos, 1.0), transform(k, k_pos, -1.0)


def xpos_largest_scale(n_keys, config):
    """The largest factor xPos multiplies a q or k pair by, over n_keys consecutive positions (1 for RoPE).

    With the exponent centred it is zeta_0^(-(n_keys/2)/scale_base), zeta_0 = gamma/(1+gamma): 3.5^(T/1024) at the
    paper's defaults, 22,519 at T = 8192. Times |q| of about 20 that passes float16's largest value (65,504), and the
    scores turn to inf and NaN. No split of the exponent between q and k avoids it (keeping every factor <= 1 would
    need the centre both before the first and after the last position), so where this factor exceeds 2^8 rotary
    returns q and k in float32 and attention runs in float32: from about 4,500 tokens at the paper's defaults, and
    only without BCA, whose windows of block_size keys keep every factor at most 3.5 there.
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
# Attention: one function for every scheme, every mask and the cached path.


def alibi_bias(q_pos, k_pos, n_head):
    """ALiBi's additive score bias -slope_h * (m - n), (n_head, len(q_pos), len(k_pos)), float32."""
    distance = (q_pos[:, None] - k_pos[None, :]).float()
    return -alibi_slopes(n_head).to(distance.device)[:, None, None] * distance


def attention(q, k, v, q_pos, k_pos, config, dropout_p=0.0):
    """Causal attention of raw (pre-position) q, k, v at integer positions q_pos, k_pos.

    Query m sees key n iff n <= m. Positions may be absolute or rebased to a BCA window; relative schemes only use
    differences, so the frame is the caller's choice. Passing the same tensor as q_pos and k_pos means the plain
    square causal case, which takes SDPA's is_causal path (FlashAttention on GPU). Masks are boolean, never an
    additive -inf, because an overflowed (inf) masked score plus -inf is NaN (REFERENCE.md, Numerics); ALiBi's
    bias is the one float mask, and its scores are never amplified.
    """
    if config.pos in ("rope", "xpos"):
        q, k = rotary(q, k, q_pos, k_pos, config)
    is_causal = k_pos is q_pos
    mask = None if is_causal else k_pos[None, :] <= q_pos[:, None]
    if config.pos == "alibi":
        bias = alibi_bias(q_pos, k_pos, q.size(1))
        mask, is_causal = bias.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf")).to(q.dtype), False
    if q.dtype == v.dtype:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
    with torch.autocast(q.device.type, enabled=False):  # float32 xPos (see xpos_largest_scale); autocast would undo it
        y = F.scaled_dot_product_attention(q, k, v.float(), attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
    return y.to(v.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Blockwise causal attention (paper §3.3), the one place it lives. Inference-time only: training uses plain causal
# attention at length l = block_size. Queries are cut into half-blocks of H = l/2; query t sees exactly the keys
#     bca_window_start(t, H) <= n <= t,
# i.e. the whole previous half-block plus its own half-block causally (H+1 ... l keys). Every layer does this, so
# information still travels n_layer*H tokens back through depth. For T <= l it is plain causal attention.


def bca_window_start(t, half):
    """First key that query t sees under BCA (the closed form; the first author's fork is off by one here)."""
    return max(0, (t // half - 1) * half)


def blockwise_causal_attention(q, k, v, half, attend):
    """BCA vectorised over blocks: time and memory O(T * block_size), never a T x T score matrix.

    Half-block 0 is plain causal attention over its own keys. Every later half-block b attends to the window made of
    half-blocks b-1 and b, whose keys/values are computed once per layer and shared by the two windows holding them.
    Inside a window, positions are rebased to 0 .. 2H-1 (queries H .. 2H-1): relative schemes then never see a
    distance beyond l-1, and xPos scales stay bounded at any T.
    """
    B, nh, T, hd = q.shape
    pos = torch.arange(2 * half, device=q.device)
    first = pos[: min(T, half)]
    y_first = attend(q[:, :, :half], k[:, :, :half], v[:, :, :half], first, first)
    if T <= half:
        return y_first
    n_blocks = -(-T // half)
    pad = n_blocks * half - T  # padded queries are dropped below; padded keys lie in every real query's future

    def blocks(x):  # (B, nh, T, hd) -> (B, n_blocks, nh, H, hd)
        return F.pad(x, (0, 0, 0, pad)).view(B, nh, n_blocks, half, hd).transpose(1, 2)

    def windows(x):  # (B * (n_blocks-1), nh, 2H, hd): half-blocks b-1 and b side by side, for b = 1 .. n_blocks-1
        x = blocks(x)
        return torch.cat((x[:, :-1], x[:, 1:]), dim=3).flatten(0, 1)

    y = attend(blocks(q)[:, 1:].flatten(0, 1), windows(k), windows(v), pos[half:], pos)
    y = y.view(B, n_blocks - 1, nh, half, hd).transpose(1, 2).reshape(B, nh, -1, hd)[:, :, : T - half]
    return torch.cat((y_first, y), dim=2)


# ---------------------------------------------------------------------------------------------------------------
# KV cache for generation.


class KVCache:
    """One layer's keys/values as projected, before RoPE/xPos, and the absolute position of the first one kept.

    Keys are cached raw and positioned afresh on every step, in the same frame the full forward pass would use, so
    cached and uncached logits agree (a cache of post-xPos keys is tied to one frame and breaks under BCA's rebasing).
    """

    def __init__(self):
        self.k = self.v = None
        self.start = 0

    def end(self):
        """Absolute position of the next token."""
        return self.start + (0 if self.k is None else self.k.size(2))

    def decode(self, q, k, v, bca, half, attend):
        """Attend from one new token at position t = end() to the cache, then keep its key and value."""
        t = self.end()
        self.k, self.v = torch.cat((self.k, k), dim=2), torch.cat((self.v, v), dim=2)
        origin = 0
        if bca:  # drop the keys query t can no longer see, and rebase positions exactly as the full pass does
            origin = bca_window_start(t, half)
            self.k, self.v = self.k[:, :, origin - self.start :], self.v[:, :, origin - self.start :]
            self.start = origin
        k_pos = torch.arange(self.start, t + 1, device=q.device) - origin
        return attend(q, self.k, self.v, k_pos[-1:], k_pos)


# ---------------------------------------------------------------------------------------------------------------
# The transformer.


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, bca, cache=None):
        B, T, C = x.shape
        nh = self.config.n_head
        q, k, v = self.c_attn(x).view(B, T, 3, nh, C // nh).permute(2, 0, 3, 1, 4)
        dropout_p = self.config.dropout if self.training else 0.0
        attend = lambda *args: attention(*args, config=self.config, dropout_p=dropout_p)
        half = self.config.block_size // 2
        if cache is not None and cache.k is not None:
            y = cache.decode(q, k, v, bca, half, attend)
        else:
            if cache is not None:  # prefill: keep every raw key/value; decode trims them under BCA
                cache.k, cache.v = k, v
            if bca:
                y = blockwise_causal_attention(q, k, v, half, attend)
            else:
                pos = torch.arange(T, device=x.device)
                y = attend(q, k, v, pos, pos)
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

    def forward(self, x, bca, cache=None):
        x = x + self.attn(self.ln_1(x), bca, cache)
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
        force it on/off. cache: a list of KVCache, one per layer (see generate); once filled, idx is one token.
        """
        x = self.hidden_states(idx, bca, cache)
        if targets is None:
            return self.head(x[:, [-1], :]), None
        logits = self.head(x)
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)

    def token_nll(self, idx, targets, *, bca=None, chunk_tokens=16384):
        """(B, T) next-token NLL, for evaluation: the logits exist for at most chunk_tokens positions at a time, so
        their memory is bounded by chunk_tokens x vocab_size at any T (GPT-2's vocabulary would need 824 MB of
        float32 logits for one 4,096-token sequence)."""
        x = self.hidden_states(idx, bca)
        B, T, _ = x.shape
        step = max(1, chunk_tokens // B)
        nll = [F.cross_entropy(self.head(x[:, i : i + step]).float().flatten(0, 1),
                               targets[:, i : i + step].flatten(), ignore_index=-1, reduction="none").view(B, -1)
               for i in range(0, T, step)]
        return torch.cat(nll, dim=1)

    def head(self, x):
        """The output layer. Outside training it runs in float32 even under autocast: bfloat16 logits are rounded
        before the loss (about +-0.06 at |logit| 20), which evaluation should not measure."""
        if self.training:
            return self.lm_head(x)
        with torch.autocast(x.device.type, enabled=False):
            return self.lm_head(x.float())

    def hidden_states(self, idx, bca=None, cache=None):
        """Embeddings, the blocks and the final LayerNorm: (B, T, n_embd), before the output layer."""
        if bca not in (None, True, False):
            raise ValueError(f"bca={bca!r} is not allowed: must be None (auto), True or False")
        B, T = idx.shape
        start = cache[0].end() if cache else 0
        if start and T != 1:
            raise ValueError(f"a filled KV cache decodes one token at a time, got {T}")
        use_bca = start + T > self.config.block_size if bca is None else bca
        pos = torch.arange(start, start + T, device=idx.device)
        x = self.transformer.wte(idx)
        if self.config.pos == "learned":
            if start + T > self.config.block_size:
                raise ValueError(f"pos='learned' cannot go past block_size={self.config.block_size} (asked for "
                                 f"{start + T} positions): learned absolute positions cannot extrapolate")
            x = x + self.transformer.wpe(pos)
        elif self.config.pos == "sinusoidal":  # absolute positions at any length, with or without BCA
            # Token embeddings (std 0.02) are scaled by sqrt(n_embd), as in Vaswani et al. §3.4 and fairseq, so that
            # tokens and the table (RMS 0.71) enter at comparable scale: 1 : 3.1 at n_embd 128 and 1 : 1.1 at 1024,
            # instead of 1 : 35 unscaled, which would drown the tokens in position.
            x = x * math.sqrt(self.config.n_embd) + sinusoidal_embedding(pos, self.config.n_embd).to(x.dtype)
        x = self.transformer.drop(x)
        for i, block in enumerate(self.transformer.h):
            x = block(x, use_bca, cache[i] if cache else None)
        return self.transformer.ln_f(x)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, *, bca=None):
        """Sample max_new_tokens tokens after idx (B, T) with a per-layer KV cache.

        The context is never cropped: past block_size every scheme but learned keeps going, with BCA when bca is
        None or True (the cache then holds at most block_size keys per layer).
        """
        if not temperature > 0:
            raise ValueError(f"temperature={temperature!r} is not allowed: must be > 0 (use top_k=1 for greedy)")
        cache = [KVCache() for _ in self.transformer.h]
        for step in range(max_new_tokens):
            logits, _ = self(idx if step == 0 else idx[:, -1:], bca=bca, cache=cache)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx
