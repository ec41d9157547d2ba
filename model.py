"""
lex-gpt: a GPT in nanoGPT's layout with the LeX Transformer of "A Length-Extrapolatable Transformer" (Sun et al.):
xPos (§3.2, Eq. 10, Algorithm 1) and blockwise causal attention, BCA (§3.3). Read top to bottom: config -> position
schemes -> attention rules -> PositionTable (xPos) -> attention -> KV cache -> the modules (BCA's window pass is in
CausalSelfAttention) -> GPT. The alternatives people compare with (attention sinks, RoPE interpolation) live in
alternatives.py and enter at the lines marked "alternatives:"; a reader of the method may skip those lines.

Conventions: attention tensors are (batch, n_head, time, head_dim); rotary pairs are interleaved, (x0, x1), (x2, x3),
..., as in Algorithm 1; positions are integer ranges in a frame, absolute (0 .. T-1) or a window's (0 .. 2b-1);
nothing length-dependent lives in the state_dict, so a checkpoint runs at any length.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.attention.bias import causal_lower_right
from torch.utils.checkpoint import checkpoint

import alternatives
from alternatives import ROPE_SCALINGS, RopeScaling  # noqa: F401 (part of model.py's interface)

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
    # RoPE interpolation the model was fine-tuned with (alternatives.py; Hugging Face's rope_scaling), used by every
    # pass unless another is asked for: none | pi | ntk | yarn, s > 1, the length YaRN counts from (0: block_size)
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_original_length: int = 0

    def __post_init__(self):
        def require(ok, name, allowed):
            if not ok:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)!r} is not allowed: {allowed}")
        is_num = lambda x, kinds=(int, float): isinstance(x, kinds) and not isinstance(x, bool)
        require(self.pos in POSITION_SCHEMES, "pos", f"must be one of {', '.join(POSITION_SCHEMES)}")
        for name in ("vocab_size", "n_layer", "n_head", "n_embd"):
            require(is_num(getattr(self, name), int) and getattr(self, name) > 0, name, "must be a positive integer")
        require(is_num(self.block_size, int) and self.block_size >= 2 and self.block_size % 2 == 0, "block_size",
                "must be an even integer >= 2 (BCA works in half-blocks of block_size/2)")
        require(self.n_embd % self.n_head == 0, "n_embd", f"must be divisible by n_head={self.n_head}")
        require(self.pos not in ("rope", "xpos") or (self.n_embd // self.n_head) % 2 == 0, "n_head",
                f"rope and xpos rotate pairs, so the head dim n_embd/n_head={self.n_embd}/{self.n_head} must be even")
        require(is_num(self.dropout) and 0 <= self.dropout < 1, "dropout", "must be a number in [0, 1)")
        for name, low in (("rope_base", 1), ("xpos_gamma", 0), ("xpos_scale_base", 0)):  # inf: no decay, only here
            require(is_num(v := getattr(self, name)) and low < v and (v < math.inf or name == "xpos_scale_base"), name,
                    f"must be a finite number > {low}" + (" or inf (no decay)" if name == "xpos_scale_base" else ""))
        for name in ("bias", "xpos_rotate"):
            require(isinstance(getattr(self, name), bool), name, "must be True or False")
        alternatives.check_trained_scaling(self, require, is_num)  # alternatives: a fine-tune's RoPE scaling

    def trained_scaling(self):
        """The RopeScaling of rope_scaling, rope_factor and rope_original_length."""
        scaled = self.rope_scaling != "none"
        return RopeScaling(self.rope_scaling, *((self.rope_factor, self.rope_original_length or None) * scaled))


# Position schemes: learned and sinusoidal add to the token embeddings (GPT.hidden_states), rope, xpos and alibi act
# inside attention (PositionTable).


def sinusoidal_embedding(pos, dim):
    """Vaswani et al.'s table, PE[p, 2i] = sin(p / 10000^(2i/dim)), PE[p, 2i+1] = cos(...), at any position."""
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, device=pos.device, dtype=torch.float32) / dim)
    angle = pos.float()[:, None] * inv_freq
    return torch.stack((angle.sin(), angle.cos()), dim=-1).flatten(1)[:, :dim]


def alibi_slopes(n_head):
    """ALiBi's head slopes (Press et al. §3): 2^(-8i/n) for i = 1..n when n is a power of two; otherwise the slopes
    for the power of two p below n, then every other slope for 2p until there are n."""
    geometric = lambda n: [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]
    p = 2 ** int(math.log2(n_head))
    return torch.tensor(geometric(p) + geometric(2 * p)[0::2][: n_head - p])


# Attention rules: which keys query t sees. All are inference-time only (training is plain causal attention at
# length l = block_size), and each window rule costs O(T * W) time and memory.
#
#   rule     query t sees                          positions, for relative schemes
#   causal   0 .. t                                absolute
#   bca      (t//H - 1)*H .. t, H = l/2            rebased into the window 0 .. l-1     (paper §3.3)
#   sliding  t-W+1 .. t                            rebased: no distance exceeds W-1
#   sinks    0 .. S-1, and t-(W-S)+1 .. t          the sinks at 0 .. S-1, the query at W-1   (alternatives.py)
#
# BCA: a query sees the whole previous half-block and its own causally, H+1 .. l keys, so no distance reaches the
# training length l; every layer does this, so information still travels n_layer * H tokens back through depth. The
# windows share one mechanism: queries are cut into blocks of b (H for bca, W for sliding and sinks); a query in block
# i sees keys of blocks i-1 and i only, in the frame 0 .. 2b-1, and past the first block only those within its reach
# (W for sliding, W-S for the sinks' recent keys). Up to T = b every rule is plain causal attention.

ATTENTION_RULES = ("auto", "causal", "bca", "sliding", "sinks")


@dataclass(frozen=True)
class AttentionRule:
    """One rule of the table above; auto is bca for a sequence longer than block_size, causal otherwise."""
    name: str = "auto"
    window: int = None  # W for sliding and sinks (None: block_size); bca's is always block_size
    sinks: int = 4  # S, the number of first tokens the sinks rule keeps (StreamingLLM's default)

    def __post_init__(self):
        positive = lambda x: isinstance(x, int) and not isinstance(x, bool) and x > 0
        if self.name not in ATTENTION_RULES:
            raise ValueError(f"attention={self.name!r} is not allowed: must be one of {', '.join(ATTENTION_RULES)}")
        for flag, value in (("window", 1 if self.window is None else self.window), ("sinks", self.sinks)):
            if not positive(value):
                raise ValueError(f"{flag}={value!r} is not allowed: must be a positive integer")
        if self.name == "sinks" and self.window is not None and self.sinks >= self.window:
            raise ValueError(f"sinks={self.sinks} is not allowed with window={self.window}: the window holds the "
                             "sinks and at least one recent key, so sinks must be < window")

    def resolve(self, n_tokens, block_size):
        """The rule for a sequence of n_tokens: auto decided, and W filled in (block_size unless given)."""
        name = self.name if self.name != "auto" else "bca" if n_tokens > block_size else "causal"
        window = None if name == "causal" else block_size if name == "bca" else self.window or block_size
        return AttentionRule(name, window, self.sinks)


class PositionTable:
    """The rule and xPos (paper Eq. 10, Algorithm 1; RoPE is xPos with zeta = 1) for the frame 0 .. n-1, computed once
    per forward pass and passed to every layer, as gpt-fast does its rotary table; never a buffer in the state_dict.

    Pair j of a query at m is the complex number x_2j + i*x_2j+1 times q[m, j] = e^(i m theta_j) zeta_j^((m-c)/scale),
    and of a key at n times k[n, j] = e^(i n theta_j) zeta_j^(-(n-c)/scale), with theta_j = rope_base^(-2j/d) and
    zeta_j = (2j + gamma d) / ((1 + gamma) d) (Eq. 9). So q.k = Re sum_j q_j conj(k_j) carries cos((m-n) theta_j)
    zeta_j^((m-n)/scale): relative only, decaying with distance. The centre c cancels in q.k; in the middle of the
    queries (the frame's in training, as in the official code) it halves the largest factor. Angles are float32
    (float16's are 0.6 rad off at 4,096).
    """

    def __init__(self, config, n_tokens, attention=None, rope_scaling=None, device=None):
        rule = attention if isinstance(attention, AttentionRule) else AttentionRule(attention or "auto")  # a name
        rule = rule.resolve(n_tokens, config.block_size)
        if config.pos == "learned" and n_tokens > config.block_size:  # every other scheme runs at any length
            raise ValueError(f"pos='learned' cannot go past block_size={config.block_size} (asked for {n_tokens} "
                             "positions): learned absolute positions cannot extrapolate")
        if rope_scaling is None:  # the model's own: none, unless it was fine-tuned with one
            rope_scaling = config.trained_scaling()
        scaling = rope_scaling if isinstance(rope_scaling, RopeScaling) else RopeScaling(rope_scaling)
        self.rule, self.scaling, self.masks = rule, scaling, {}
        W = rule.window  # query t sees keys of blocks t // b - 1 and t // b only, and past the first within its reach:
        self.b = None if rule.name == "causal" else W // 2 if rule.name == "bca" else W
        self.reach = W if rule.name == "sliding" else W - rule.sinks if rule.name == "sinks" else None
        self.frame = 2 * self.b if self.b and n_tokens > self.b else n_tokens  # a window's, or the sequence's
        span = min(n_tokens, W) if self.b else n_tokens  # the most positions one query sees
        self.factor = scaling.factor_at(span, config.block_size)
        d, l = config.n_embd // config.n_head, config.block_size
        j = torch.arange(d // 2, device=device, dtype=torch.float32)
        self.theta = config.rope_base ** (-2 * j / d) * (config.pos != "xpos" or config.xpos_rotate)  # or 0: no turn
        self.zeta = (2 * j + config.xpos_gamma * d) / ((1 + config.xpos_gamma) * d)
        self.rotation = self.slopes = None
        if config.pos in ("rope", "xpos"):
            theta, sharpen = self.theta, 1.0
            theta, sharpen = alternatives.interpolate(theta, scaling, self.factor, l)  # alternatives: RoPE interp.
            angle = torch.arange(self.frame, device=device, dtype=torch.float32)[:, None] * theta
            # e^(i m theta_j) as (real, imaginary), (frame, d/2, 2): no complex tensor for torch.compile
            self.rotation = torch.stack((angle.cos(), angle.sin()), -1) * sharpen
        if config.pos == "alibi":
            self.slopes = alibi_slopes(config.n_head).to(device)[:, None, None]
        # Over n queries centred on c, q and k carry factors up to F = zeta_0^(-(n/2)/scale) (3.5^(n/1024) at the
        # paper's defaults; a masked score F^2): attention takes at most `chunk` queries at a time, F <= 2^8 (4,531
        # queries at the paper's defaults), so that even float16 holds every factor at any length.
        scale_base = config.xpos_scale_base if config.pos == "xpos" else math.inf
        half = 8 * math.log(2) * scale_base / math.log(1 + 1 / config.xpos_gamma)  # the n/2 where F = 2^8
        self.chunk = self.frame if 2 * half >= self.frame else 2 * int(half) + 1
        e = torch.arange(-self.frame, self.frame, device=device, dtype=torch.float32)[:, None]  # e = m - c or n - c
        self.decay = (self.zeta ** (e / scale_base))[..., None] if config.pos == "xpos" else None  # row e + frame

    def factors(self, queries, keys):
        """The factors of q at frame positions `queries` and of k at `keys`, (n, d/2, 2): the rotation times xPos's
        zeta^((m-c)/scale) and zeta^(-(n-c)/scale). q.k carries zeta^((m-n)/scale) whatever the centre c; with c in the
        middle of at most `chunk` queries no factor passes 2^8, and far keys underflow to 0: they have decayed."""
        q, k = self.rotation[queries.start : queries.stop], self.rotation[keys.start : keys.stop]
        if self.decay is not None:
            c = (queries.start + queries.stop - 1) // 2 - self.frame  # row i of decay is zeta^((i - frame)/scale)
            # far keys divide by an overflowed (inf) decay: 0, what they have decayed to
            q, k = q * self.decay[queries.start - c : queries.stop - c], k / self.decay[keys.start - c : keys.stop - c]
        return q, k


def attend(q, k, v, table, queries, keys, sink_kv=None, dropout_p=0.0):
    """Causal attention of raw q at frame positions `queries` to raw k, v at `keys` (ranges that end together): q and
    k are rotated here for rope and xpos, and masked by the rule. Relative schemes use only differences, so the frame
    is the caller's: absolute positions, or a window's 0 .. 2b-1."""
    if len(queries) > table.chunk:  # xPos far past the training length: queries in chunks, each with the keys to it
        pieces = [(s - queries.start, range(s, min(s + table.chunk, queries.stop))) for s in queries[:: table.chunk]]
        return torch.cat([attend(q[:, :, i : i + len(r)], *(x[:, :, : r.stop - keys.start] for x in (k, v)), table, r,
                                 range(keys.start, r.stop), sink_kv, dropout_p) for i, r in pieces], dim=2)
    if sink_kv is not None and queries.start >= table.b:  # alternatives: StreamingLLM's sinks join each window
        return alternatives.attention_with_sinks(q, k, v, table, queries, keys, sink_kv)
    if table.rotation is not None:  # Algorithm 1: each pair as a complex number, times the factor of its position
        def rotate(x, f):  # compiled, in real arithmetic: Inductor fuses that, but leaves complex products to eager
            x = x.float().unflatten(-1, (-1, 2))
            if not torch.compiler.is_compiling():
                return torch.view_as_real(torch.view_as_complex(x) * torch.view_as_complex(f))
            (a, b), (c, s) = x.unbind(-1), f.unbind(-1)
            return torch.stack((a * c - b * s, a * s + b * c), -1)
        q, k = (rotate(x, f).flatten(-2).to(x.dtype) for x, f in zip((q, k), table.factors(queries, keys)))
    # The mask, shared by every layer: query i sees key j <= i, and past the first block only while i - j < reach. A
    # causal mask aligned to the last key needs no tensor (SDPA's fast kernels); otherwise boolean: an additive -inf
    # would turn an overflowed (inf) masked xPos score into NaN. ALiBi's bias, -slope_h * (i - j), is the one float
    # mask, with -inf where hidden: its scores are never amplified.
    if (queries, keys, q.dtype) not in table.masks:
        i = torch.arange(queries.start, queries.stop, device=q.device)[:, None]
        j = torch.arange(keys.start, keys.stop, device=q.device)
        band = table.reach is not None and queries.stop - 1 >= table.b and queries.stop - 1 - keys.start >= table.reach
        if table.slopes is None and not band:
            mask = "causal" if queries == keys else None if len(queries) == 1 else causal_lower_right(len(i), len(j))
        else:
            visible = (j <= i) & ((i - j < table.reach) | (i < table.b) if band else True)
            mask = visible if table.slopes is None else \
                (-table.slopes * (i - j)).masked_fill(~visible, float("-inf")).to(q.dtype)
        if len(table.masks) > 4:  # a KV cache asks for a new shape at every token: keep only the latest
            table.masks.clear()
        table.masks[queries, keys, q.dtype] = mask
    mask = table.masks[queries, keys, q.dtype]
    causal, mask = (True, None) if isinstance(mask, str) else (False, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal)


class KVCache:
    """One layer's keys and values for generation, chunked prefill and streaming evaluation, stored raw and rotated when
    read (attention): neither a moving window nor a growing interpolation factor re-positions what is stored. Under a
    window rule it holds the current window, at most 2b keys, so a token costs the same at any length (for BCA the
    paper's "recurrently reuses the overlapped key and value vectors"); under causal attention every key."""

    def __init__(self, table, max_tokens):
        self.table, self.max_tokens = table, max_tokens  # the table of a pass over max_tokens
        self.start = self.held = 0  # absolute position of the first key held (the window's origin), and keys held
        self.k = self.v = None  # (B, n_head, capacity, head_dim), allocated on the first call
        self.sink_kv = None  # alternatives: the sinks rule's first S keys and values, kept past every window

    def end(self):
        """Absolute position of the next token."""
        return self.start + self.held

    def attend_new(self, q, k, v, table):
        """Store the new tokens' keys and values and attend from their queries, in runs within one block (under
        causal attention, all at once): before each run the window moves on to the run's, dropping a block."""
        rule, b = table.rule, table.b
        if self.k is None:
            capacity = min(2 * b, self.max_tokens) if b else self.max_tokens
            self.k, self.v = (x.new_empty(*x.shape[:2], capacity, x.size(3)) for x in (k, v))
        elif k.size(0) != self.k.size(0) or v.dtype != self.v.dtype:
            raise ValueError(f"this KV cache holds a batch of {self.k.size(0)} in {self.v.dtype}, got {k.size(0)} in "
                             f"{v.dtype}: make a new one (new_cache) for another batch size or precision")
        S = rule.sinks
        if rule.name == "sinks" and self.sink_kv is None and self.end() + k.size(2) >= S:  # alternatives: keep S
            self.sink_kv = tuple(torch.cat((old[:, :, : self.held], new[:, :, :S]), 2)[:, :, :S].clone()
                                 for old, new in ((self.k, k), (self.v, v)))
        ys, i = [], 0
        while i < q.size(2):
            t = self.end()
            run = min(q.size(2) - i, b - t % b) if b else q.size(2) - i
            drop = max(0, (t // b - 1) * b) - self.start if b else 0  # (t // b - 1) * b: the window's first key
            if drop > 0:  # at most b keys stay, so the copy does not overlap
                self.start, self.held = self.start + drop, self.held - drop
                for buf in (self.k, self.v):
                    buf[:, :, : self.held] = buf[:, :, drop : drop + self.held]
            self.k[:, :, self.held : self.held + run] = k[:, :, i : i + run]
            self.v[:, :, self.held : self.held + run] = v[:, :, i : i + run]
            self.held, queries = self.held + run, range(t - self.start, t - self.start + run)
            ys.append(attend(q[:, :, i : i + run], self.k[:, :, : self.held], self.v[:, :, : self.held], table,
                             queries, range(self.held), self.sink_kv))
            i += run
        return torch.cat(ys, dim=2)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, table, cache=None):
        (B, T, C), nh, b = x.shape, self.config.n_head, table.b
        q, k, v = self.c_attn(x).view(B, T, 3, nh, C // nh).permute(2, 0, 3, 1, 4)
        if cache is not None:
            y = cache.attend_new(q, k, v, table)
        elif not b or T <= b:  # causal attention (training), or a sequence within one block
            y = attend(q, k, v, table, range(T), range(T), dropout_p=self.config.dropout if self.training else 0.0)
        else:  # BCA (paper §3.3) and the other windows, vectorised over blocks: O(T * b) time and memory, never T x T.
            # The first block is plain causal attention. Block i > 0 attends to the window of blocks i-1 and i in the
            # frame 0 .. 2b-1, its queries at b .. 2b-1, so that under BCA no distance exceeds l-1; each block's keys
            # serve the two windows holding them. Padded queries are dropped; padded keys lie in every query's future.
            n_blocks, hd = -(-(T - b) // b), C // nh
            blocks = lambda z, n: F.pad(z, (0, 0, 0, n * b - z.size(2))).view(B, nh, n, b, hd).transpose(1, 2)
            windows = lambda z: torch.cat((z[:, :-1], z[:, 1:]), dim=3).flatten(0, 1)  # (B * n_blocks, nh, 2b, hd)
            S = table.rule.sinks if table.rule.name == "sinks" else 0  # alternatives: StreamingLLM's first S tokens
            sink_kv = (k[:, :, :S], v[:, :, :S]) if S else None  # alternatives: (None but for the sinks rule)
            y = attend(blocks(q[:, :, b:], n_blocks).flatten(0, 1), windows(blocks(k, n_blocks + 1)),
                       windows(blocks(v, n_blocks + 1)), table, range(b, 2 * b), range(2 * b), sink_kv)
            y = y.view(B, n_blocks, nh, b, hd).transpose(1, 2).reshape(B, nh, n_blocks * b, hd)[:, :, : T - b]
            y = torch.cat((attend(q[:, :, :b], k[:, :, :b], v[:, :, :b], table, range(b), range(b)), y), dim=2)
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
        self.grad_checkpoint = False  # training: recompute each block's activations in backward, to save memory
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by 1/sqrt(2 * n_layer)
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None, *, attention=None, rope_scaling=None, cache=None):
        """(logits, loss). idx, targets: (B, T) token ids, -1 ignored. With targets, logits at every position and the
        mean next-token NLL; without, only the last position's logits. attention: an AttentionRule or its name; None is
        auto, BCA exactly when the sequence is longer than block_size. rope_scaling: a RopeScaling or its name. cache:
        from new_cache, which fixes both; idx then continues the sequence."""
        x = self.hidden_states(idx, attention, rope_scaling, cache)
        if targets is None:
            return self.head(x[:, [-1], :]), None
        logits = self.head(x)
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)

    def hidden_states(self, idx, attention=None, rope_scaling=None, cache=None):
        """Embeddings, the blocks and the final LayerNorm: (B, T, n_embd), before the output layer."""
        B, T = idx.shape
        start = cache[0].end() if cache else 0
        if cache:
            if attention is not None or rope_scaling is not None:
                raise ValueError("attention and rope_scaling are fixed when the cache is made: pass neither with it")
            if start + T > cache[0].max_tokens:
                raise ValueError(f"the KV cache was made for {cache[0].max_tokens} tokens, asked for {start + T}")
            table = cache[0].table
            if table.scaling.method == "dynamic_ntk":  # alternatives: its factor follows the length as it grows
                table = PositionTable(self.config, start + T, table.rule, table.scaling, idx.device)
        else:
            table = PositionTable(self.config, T, attention, rope_scaling, idx.device)
        pos = torch.arange(start, start + T, device=idx.device)
        x = self.transformer.wte(idx)
        if self.config.pos == "learned":
            x = x + self.transformer.wpe(pos)
        elif self.config.pos == "sinusoidal":  # absolute positions at any length, under any attention rule
            # Tokens times sqrt(n_embd) (Vaswani et al. §3.4, fairseq), or the table (RMS 0.71) would drown them.
            x = x * math.sqrt(self.config.n_embd) + sinusoidal_embedding(pos, self.config.n_embd).to(x.dtype)
        x = self.transformer.drop(x)
        for i, block in enumerate(self.transformer.h):
            if self.grad_checkpoint and self.training:
                x = checkpoint(block, x, table, use_reentrant=False)
            else:
                x = block(x, table, cache[i] if cache else None)
        return self.transformer.ln_f(x)

    def new_cache(self, max_tokens, attention=None, rope_scaling=None):
        """An empty KV cache, one KVCache per layer, with the rule and the table of a pass over max_tokens."""
        table = PositionTable(self.config, max_tokens, attention, rope_scaling, self.lm_head.weight.device)
        return [KVCache(table, max_tokens) for _ in self.transformer.h]

    @torch.no_grad()
    def token_nll(self, idx, targets, *, attention=None, rope_scaling=None, chunk_tokens=16384):
        """(B, T) next-token NLL for evaluation, chunk_tokens / B positions at a time, equal to the one-piece pass.
        Under a window rule the sequence streams through a KV cache of one window (memory flat at any T); under causal
        attention only the output layer goes chunk by chunk (bounding the logits). Dynamic NTK, where it scales
        anything, decodes token by token past block_size: each token at the factor of its own length."""
        B, T = idx.shape
        step, table, starts = max(1, chunk_tokens // B), PositionTable(self.config, T, attention, rope_scaling), None
        if table.scaling.method == "dynamic_ntk" and table.rotation is not None and table.factor > 1:  # alternatives
            starts = [0, *range(self.config.block_size, T)]
        elif table.b and T > step:
            starts = list(range(0, T, step))
        if starts:
            cache = self.new_cache(T, table.rule, table.scaling)
            pieces = ((i, self.hidden_states(idx[:, i:j], cache=cache)) for i, j in zip(starts, starts[1:] + [T]))
        else:
            x = self.hidden_states(idx, table.rule, table.scaling)
            pieces = ((i, x[:, i : i + step]) for i in range(0, T, step))
        nll = [F.cross_entropy(self.head(h).float().flatten(0, 1), targets[:, i : i + h.size(1)].flatten(),
                               ignore_index=-1, reduction="none").view(B, -1) for i, h in pieces]
        return torch.cat(nll, dim=1)

    def head(self, x):
        """The output layer, in float32 outside training even under autocast: evaluation should not measure bfloat16's
        rounding of the logits (about +-0.06 at |logit| 20)."""
        if self.training:
            return self.lm_head(x)
        with torch.autocast(x.device.type, enabled=False):
            return self.lm_head(x.float())

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, *, attention=None, rope_scaling=None):
        """Sample max_new_tokens tokens after idx (B, T) with a KV cache. The context is never cropped: past block_size
        every scheme but learned keeps going, by default with BCA, at a flat cost per token."""
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
