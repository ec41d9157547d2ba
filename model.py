"""
lex-gpt: a GPT in nanoGPT's layout with the LeX Transformer of "A Length-Extrapolatable
Transformer" (Sun et al.): xPos (§3.2, Eq. 10, Algorithm 1) and blockwise causal attention,
BCA (§3.3).

Read top to bottom: config -> position schemes -> attention rules -> AttentionPlan (xPos,
the rule's segments) -> attend (the mask) -> KV cache -> the modules (BCA's segment pass is
in CausalSelfAttention) -> GPT. The alternatives people compare with (attention sinks, RoPE
interpolation, ALiBi's and the windows' masks) live in alternatives.py and enter at the
lines marked "alternatives:", only when asked for. Rules and configs are checked where they
are made, not on each pass.

Conventions: attention tensors are (B, n_head, T, head_dim); rotary pairs are interleaved,
(x0, x1), (x2, x3), ..., as in Algorithm 1; positions are integer ranges in a frame,
absolute (0 .. T-1) or two segments' (0 .. 2w-1); nothing length-dependent lives in the
state_dict, so a checkpoint runs at any length.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn import functional as F
from torch.nn.attention.bias import causal_lower_right
from torch.utils.checkpoint import checkpoint

import alternatives
from alternatives import ROPE_SCALINGS, RopeScaling, alibi_slopes, is_number  # noqa: F401

POSITION_SCHEMES = ("learned", "sinusoidal", "rope", "alibi", "xpos", "none")


@dataclass
class GPTConfig:
    # the training length l (BCA's segments are l/2)
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linears and LayerNorms, as in GPT-2
    pos: str = "xpos"  # one of POSITION_SCHEMES; "none" is NoPE
    # theta_j = rope_base^(-2j/d), shared by rope and xpos
    rope_base: float = 10000.0
    # zeta_j = (2j + gamma*d) / ((1 + gamma)*d), paper Eq. 9
    xpos_gamma: float = 0.4
    # zeta^(n / scale_base) as in the official code; inf: no decay
    xpos_scale_base: float = 512.0
    # False is Table 4's "xPos without rotation": theta = 0, decay only
    xpos_rotate: bool = True
    # The RoPE interpolation the model was fine-tuned with (Hugging Face's rope_scaling;
    # alternatives.py), used unless a pass asks for another: none | pi | ntk | yarn, its
    # factor s > 1, and the length before it, which YaRN's ramp counts turns over (2 ..
    # block_size; 0: block_size); YaRN's ramp ends, in turns over that length.
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_original_length: int = 0
    yarn_alpha: float = 1.0
    yarn_beta: float = 32.0

    def __post_init__(self) -> None:
        def require(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                value = getattr(self, name)
                raise ValueError(f"GPTConfig.{name}={value!r} is not allowed: {allowed}")

        schemes = ", ".join(POSITION_SCHEMES)
        require(self.pos in POSITION_SCHEMES, "pos", f"must be one of {schemes}")
        for name in ("vocab_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            require(is_number(value, int) and value > 0, name, "must be a positive integer")
        l = self.block_size
        require(is_number(l, int) and l >= 2 and l % 2 == 0, "block_size",
                "must be an even integer >= 2 (BCA works in segments of block_size/2)")
        require(self.n_embd % self.n_head == 0, "n_embd",
                f"must be divisible by n_head={self.n_head}")
        odd = (self.n_embd // self.n_head) % 2
        require(self.pos not in ("rope", "xpos") or not odd, "n_head",
                "rope and xpos rotate pairs, so the head dim n_embd/n_head="
                f"{self.n_embd}/{self.n_head} must be even")
        require(is_number(self.dropout) and 0 <= self.dropout < 1, "dropout",
                "must be a number in [0, 1)")
        for name, low in (("rope_base", 1), ("xpos_gamma", 0)):
            value = getattr(self, name)
            require(is_number(value) and low < value < math.inf, name,
                    f"must be a finite number > {low}")
        value = self.xpos_scale_base  # inf turns the decay off
        require(is_number(value) and value > 0, "xpos_scale_base",
                "must be a finite number > 0 or inf (no decay)")
        for name in ("bias", "xpos_rotate"):
            require(isinstance(getattr(self, name), bool), name, "must be True or False")
        # alternatives: the RoPE scaling a model is fine-tuned with
        alternatives.check_trained_scaling(self, require)


# Position schemes: learned and sinusoidal add to the token embeddings (GPT.start_pass);
# rope, xpos and alibi (its slopes: alternatives.py) act inside attention.


def sinusoidal_embedding(pos: Tensor, dim: int) -> Tensor:
    """Vaswani et al.'s table at any position:
    PE[p, 2i] = sin(p / 10000^(2i/dim)), PE[p, 2i+1] = cos(p / 10000^(2i/dim))."""
    i = torch.arange(0, dim, 2, device=pos.device, dtype=torch.float32)
    angle = pos.float()[:, None] * 10000.0 ** (-i / dim)  # (T, dim/2)
    pe = torch.stack((angle.sin(), angle.cos()), dim=-1)  # (T, dim/2, 2)
    return pe.flatten(1)[:, :dim]


# Attention rules: which keys query t sees. All are for inference only (training is plain
# causal attention at the training length l = block_size).
#
#   rule     query t sees                 positions, for relative schemes
#   causal   0 .. t                       absolute
#   bca      (t//w - 1)*w .. t, w = l/2   in 0 .. l-1  (§3.3)
#   sliding  t-W+1 .. t                   no distance passes W-1
#   sinks    0 .. S-1, t-(W-S)+1 .. t     sinks at 0 .. S-1, query at W-1 (alternatives.py)
#
# A segment is w consecutive tokens, the paper's "block" (a Block here is a layer): w = l/2
# under BCA, w = W under sliding and sinks, whose window W bounds the keys a query sees.
# Under these segmented rules segment i attends to segments i-1 and i only, in their frame
# 0 .. 2w-1, past the first segment only to keys within reach (W under sliding, W-S recent
# keys under sinks, all under BCA): O(T * w). Under BCA no distance reaches l, and through
# n_layer layers information still travels n_layer * w tokens back. Up to T = w every rule
# is causal attention.

ATTENTION_RULES = ("auto", "causal", "bca", "sliding", "sinks")


@dataclass(frozen=True)
class AttentionRule:
    """One rule of the table above; auto is bca past block_size, causal up to it."""
    name: str = "auto"
    window: int = None  # W of sliding and sinks (None: block_size)
    sinks: int = 4  # S, the first tokens sinks keep (StreamingLLM's 4)

    def __post_init__(self) -> None:
        if self.name not in ATTENTION_RULES:
            rules = ", ".join(ATTENTION_RULES)
            raise ValueError(f"attention={self.name!r} is not allowed: must be one of {rules}")
        alternatives.check_window(self)  # alternatives: W and S of sliding and sinks

    def resolve(self, n_tokens: int, block_size: int) -> "AttentionRule":
        """The rule for n_tokens: auto decided, W filled in (BCA's is l, two segments); not
        checked again (this rule was), but for S < W where block_size gives sinks its W."""
        name = self.name
        if name == "auto":
            name = "bca" if n_tokens > block_size else "causal"
        window = {"causal": None, "bca": block_size}.get(name, self.window or block_size)
        if name == "sinks":  # alternatives: S < W
            alternatives.check_sinks(self.sinks, window)
        resolved = object.__new__(AttentionRule)  # no __post_init__: no checks again
        resolved.__dict__.update(name=name, window=window, sinks=self.sinks)
        return resolved


AUTO = AttentionRule()  # the default rule
RuleLike = AttentionRule | str | None  # a rule, its name, or None: auto
ScalingLike = RopeScaling | str | None  # a RoPE scaling, its name, or None: the model's own


class AttentionPlan:
    """What attention needs for one pass over n_tokens, made once and passed to every layer,
    as gpt-fast passes its rotary table (nothing here is in the state_dict): the rule and
    its segments, xPos's rotation and decay, ALiBi's slopes, and the masks made so far
    (alternatives.attention_mask).

    xPos (Eq. 10, Algorithm 1) multiplies pair j of a query at m by e^(i m theta_j)
    zeta_j^((m-c)/scale), and of a key at n by e^(i n theta_j) zeta_j^(-(n-c)/scale), with
    theta_j = rope_base^(-2j/d), zeta_j = (2j + gamma d)/((1 + gamma) d) (Eq. 9) and scale =
    xpos_scale_base. So q.k carries cos((m-n) theta_j) zeta_j^((m-n)/scale): relative, and
    decaying with distance. RoPE is xPos with zeta = 1. The centre c cancels in q.k; in the
    middle of the queries (as in the official code) it halves the largest factor."""

    def __init__(self, config: GPTConfig, n_tokens: int, attention: RuleLike = None,
                 rope_scaling: ScalingLike = None, device: torch.device | None = None):
        l = config.block_size
        if config.pos == "learned" and n_tokens > l:
            raise ValueError(f"pos='learned' cannot go past block_size={l} (asked for {n_tokens} "
                             "positions): learned absolute positions cannot extrapolate")
        if not isinstance(attention, AttentionRule):  # a name, or None: auto
            attention = AttentionRule(attention) if attention else AUTO
        self.rule = rule = attention.resolve(n_tokens, l)
        # w: l/2 under BCA, W under sliding and sinks, None under causal attention
        self.segment = rule.window // 2 if rule.name == "bca" else rule.window
        # alternatives: how far sliding and sinks see past the first segment (None: no limit)
        self.reach = alternatives.window_reach(rule) if rule.name in ("sliding", "sinks") else None
        self.frame = n_tokens  # positions: the sequence's, or two segments' 0 .. 2w-1
        if self.segment and n_tokens > self.segment:
            self.frame = 2 * self.segment
        self.masks = {}
        # alternatives: RoPE interpolation, asked for or fine-tuned with (s = 1: none)
        self.scaling, self.rope_factor = alternatives.NO_SCALING, 1.0
        if rope_scaling is not None or config.rope_scaling != "none":
            self.scaling = alternatives.scaling_of(config, rope_scaling)
        d = config.n_embd // config.n_head
        gamma = config.xpos_gamma
        j = torch.arange(d // 2, device=device, dtype=torch.float32)
        self.theta = config.rope_base ** (-2 * j / d)  # (d/2,)
        if config.pos == "xpos" and not config.xpos_rotate:
            self.theta = 0 * self.theta  # Table 4's xPos without rotation
        self.zeta = (2 * j + gamma * d) / ((1 + gamma) * d)  # (d/2,)
        self.rotation = self.decay = self.slopes = None
        self.span = self.frame  # the most queries attend takes at once (xPos: float16's)
        if config.pos in ("rope", "xpos"):
            theta, sharpen = self.theta, 1.0
            # alternatives: RoPE interpolation at s (none without rotation: no angle to scale)
            if self.scaling.method != "none" and (config.pos == "rope" or config.xpos_rotate):
                self.rope_factor = self.scaling.factor_at(min(n_tokens, rule.window or n_tokens), l)
                theta, sharpen = alternatives.interpolate(theta, self.scaling, self.rope_factor, l,
                                                          config.rope_base)
            angle = torch.arange(self.frame, device=device)[:, None] * theta  # (frame, d/2)
            self.rotation = sharpen * torch.stack((angle.cos(), angle.sin()), -1)
        if config.pos == "xpos":
            # Over n queries centred on c, q and k carry factors up to zeta_0^(-n/2/scale):
            # a span of at most n queries keeps them <= 2^8, within float16 at any T.
            scale = config.xpos_scale_base
            half = 8 * math.log(2) * scale / math.log(1 + 1 / gamma)  # n/2 where it is 2^8
            if 2 * half < self.frame:  # scale = inf: no decay, one span
                self.span = 2 * int(half) + 1
            # row i is zeta^(e/scale) at e = i - frame, for e = m - c or n - c
            e = torch.arange(-self.frame, self.frame, device=device, dtype=torch.float32)
            self.decay = self.zeta[:, None] ** (e[:, None, None] / scale)  # (2 frame, d/2, 1)
        if config.pos == "alibi":  # alternatives: ALiBi's slopes, (nh, 1, 1)
            self.slopes = alibi_slopes(config.n_head).to(device)[:, None, None]

    def rotate(self, q: Tensor, k: Tensor, queries: range, keys: range) -> tuple[Tensor, Tensor]:
        """q at frame positions `queries` and k at `keys`, in float32, rotated by Algorithm 1:
        each pair, a complex number, times e^(i m theta_j) and xPos's zeta^(+-(m-c)/scale),
        c in the middle of the queries."""
        if self.rotation is None:
            return q, k
        fq = self.rotation[queries.start : queries.stop]  # (Q, d/2, 2)
        fk = self.rotation[keys.start : keys.stop]  # (K, d/2, 2)
        if self.decay is not None:
            shift = self.frame - (queries.start + queries.stop - 1) // 2  # p's row: p + shift
            fq = fq * self.decay[queries.start + shift : queries.stop + shift]
            fk = fk / self.decay[keys.start + shift : keys.stop + shift]  # far keys: 1/inf = 0
        rotated = []
        for x, f in ((q, fq), (k, fk)):
            x = x.float().unflatten(-1, (-1, 2))  # (..., T, d/2, 2)
            if torch.compiler.is_compiling():  # real arithmetic, which Inductor fuses
                re, im = x.unbind(-1)
                cos, sin = f.unbind(-1)
                y = torch.stack((re * cos - im * sin, re * sin + im * cos), -1)
            else:  # the same product in complex numbers: one kernel in eager mode
                y = torch.view_as_real(torch.view_as_complex(x) * torch.view_as_complex(f))
            rotated.append(y.flatten(-2))  # (..., T, d)
        return tuple(rotated)

    def visible(self, queries: range, keys: range, device: torch.device | None = None) -> Tensor:
        """(Q, K) bool: query i sees key j <= i, and past the first segment only while
        i - j < reach (sliding, sinks)."""
        i = torch.arange(queries.start, queries.stop, device=device)[:, None]
        j = torch.arange(keys.start, keys.stop, device=device)
        seen = j <= i
        if self.reach is not None:
            seen &= (i - j < self.reach) | (i < self.segment)
        return seen


def attend(q: Tensor, k: Tensor, v: Tensor, plan: AttentionPlan, queries: range, keys: range,
           sink_kv: tuple[Tensor, Tensor] | None = None, dropout_p: float = 0.0) -> Tensor:
    """Causal attention of raw q at frame positions `queries` to raw k, v at `keys` (ranges that
    end together), rotated by the plan, plan.span queries at a time. Relative schemes use
    differences only, so the frame is the caller's: absolute, or two segments' 0 .. 2w-1. The
    causal mask is SDPA's is_causal where queries and keys start together (its fast kernels),
    else a lower-right one (none for one query): no tensor, and no additive -inf, which would
    turn an overflowed xPos score into NaN. ALiBi's, windows' masks: alternatives.attention_mask."""
    ys = []
    for start in range(queries.start, queries.stop, plan.span):  # xPos: spans of queries
        qs = range(start, min(start + plan.span, queries.stop))
        ks = range(keys.start, qs.stop)  # the keys up to the span's last query
        qi = q[:, :, start - queries.start : qs.stop - queries.start]
        ki, vi = k[:, :, : len(ks)], v[:, :, : len(ks)]
        if sink_kv is not None and start >= plan.segment:  # alternatives: StreamingLLM
            ys.append(alternatives.attention_with_sinks(qi, ki, vi, plan, qs, ks, sink_kv))
            continue
        qi, ki = plan.rotate(qi, ki, qs, ks)
        mask = None
        if plan.slopes is not None or plan.reach is not None:  # alternatives: ALiBi, windows
            mask = alternatives.attention_mask(plan, qs, ks, v.dtype, v.device)
        if mask is None and len(qs) > 1 and qs != ks:
            mask = causal_lower_right(len(qs), len(ks))
        ys.append(F.scaled_dot_product_attention(qi.to(v.dtype), ki.to(v.dtype), vi,
                                                 attn_mask=mask, dropout_p=dropout_p,
                                                 is_causal=mask is None and qs == ks))
    return torch.cat(ys, dim=2)


class KVCache:
    """One layer's keys and values for generation, chunked prefill and streaming evaluation,
    stored raw and rotated when read: neither a moving frame nor a growing interpolation
    factor re-positions what is stored. Under a segmented rule it holds at most two segments,
    so a token costs the same at any length (for BCA the paper's "recurrently reuses the
    overlapped key and value vectors"); under causal attention every key.

    Under dynamic NTK a pass rotates its queries and every key held at the factor of the
    length it brings the sequence to (as the YaRN paper recommends; Hugging Face's cache keeps
    each key at the angles it was stored with). What is held stays as it was made: above the
    first layer a key and value come from the hidden states of the pass that fed their token,
    at that pass's smaller factor. So from two layers on cached decoding is not a full pass
    over each prefix, which would recompute every token at the new factor."""

    def __init__(self, plan: AttentionPlan, max_tokens: int):
        self.plan = plan  # the plan of a pass over max_tokens
        self.max_tokens = max_tokens
        self.start = 0  # absolute position of the first key held
        self.held = 0  # keys held
        self.k = self.v = None  # (B, n_head, capacity, head_dim)
        self.sink_kv = None  # alternatives: the sinks rule's first S keys

    def end(self) -> int:
        """Absolute position of the next token."""
        return self.start + self.held

    def attend_new(self, q: Tensor, k: Tensor, v: Tensor, plan: AttentionPlan) -> Tensor:
        """Store the new tokens' keys and values and attend from their queries, in runs within
        one segment (under causal attention, all at once): before each run the frame moves
        on, dropping a segment."""
        w = plan.segment
        n = q.size(2)
        if self.k is None:
            capacity = min(2 * w, self.max_tokens) if w else self.max_tokens
            shape = (*k.shape[:2], capacity, k.size(3))
            self.k, self.v = k.new_empty(shape), v.new_empty(shape)
        elif k.size(0) != self.k.size(0) or v.dtype != self.v.dtype:
            raise ValueError(f"this KV cache holds a batch of {self.k.size(0)} in {self.v.dtype}, "
                             f"got {k.size(0)} in {v.dtype}: make a new one (new_cache) for "
                             "another batch size or precision")
        if plan.rule.name == "sinks" and self.sink_kv is None:  # alternatives: the first S
            self.sink_kv = alternatives.cached_sinks(self, k, v, plan.rule.sinks)
        ys = []
        i = 0
        while i < n:
            t = self.end()
            run = n - i
            if w:
                run = min(run, w - t % w)
                self.drop(max(0, (t // w - 1) * w) - self.start)  # the frame's first key
            self.k[:, :, self.held : self.held + run] = k[:, :, i : i + run]
            self.v[:, :, self.held : self.held + run] = v[:, :, i : i + run]
            self.held += run
            queries = range(t - self.start, t - self.start + run)
            keys = range(self.held)
            k_held, v_held = self.k[:, :, : self.held], self.v[:, :, : self.held]
            ys.append(attend(q[:, :, i : i + run], k_held, v_held, plan, queries, keys,
                             self.sink_kv))
            i += run
        return torch.cat(ys, dim=2)

    def drop(self, n: int) -> None:
        """Forget the first n keys held (at most w stay: no overlap)."""
        if n <= 0:
            return
        self.start += n
        self.held -= n
        for buf in (self.k, self.v):
            buf[:, :, : self.held] = buf[:, :, n : n + self.held]



class CausalSelfAttention(nn.Module):

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        C = config.n_embd
        self.c_attn = nn.Linear(C, 3 * C, bias=config.bias)
        self.c_proj = nn.Linear(C, C, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, plan: AttentionPlan, cache: KVCache | None = None) -> Tensor:
        B, T, C = x.size()
        nh = self.config.n_head
        hd = C // nh
        w = plan.segment
        qkv = self.c_attn(x).view(B, T, 3, nh, hd).permute(2, 0, 3, 1, 4)  # (3, B, nh, T, hd)
        q, k, v = qkv
        if cache is not None:
            y = cache.attend_new(q, k, v, plan)
        elif not w or T <= w:  # causal attention (training), or within one segment
            p = self.config.dropout if self.training else 0.0
            y = attend(q, k, v, plan, range(T), range(T), dropout_p=p)
        else:
            # BCA (§3.3) and the other segmented rules, all segments at once: segment i > 0
            # attends to segments i-1 and i in their frame 0 .. 2w-1 (queries at w .. 2w-1), so
            # under BCA no distance reaches l. The last segment's zero padding is the future.
            sink_kv = None  # alternatives: the sinks rule's S sinks, its first keys and values
            if plan.rule.name == "sinks":
                sink_kv = k[:, :, : plan.rule.sinks], v[:, :, : plan.rule.sinks]
            n = -(-T // w)  # segments, each qn, kn, vn: (B, n, nh, w, hd)
            qn, kn, vn = F.pad(qkv, (0, 0, 0, -T % w)).view(3, B, nh, n, w, hd).transpose(2, 3)
            kw = torch.cat((kn[:, :-1], kn[:, 1:]), dim=3).flatten(0, 1)  # (B*(n-1), nh, 2w, hd)
            vw = torch.cat((vn[:, :-1], vn[:, 1:]), dim=3).flatten(0, 1)
            # a copy at any B (at B = 1 a view): a sequence scores the same alone or in a batch
            qw = qn[:, 1:].flatten(0, 1).contiguous()  # (B*(n-1), nh, w, hd)
            y = attend(qw, kw, vw, plan, range(w, 2 * w), range(2 * w), sink_kv)
            first = attend(qn[:, 0], kn[:, 0], vn[:, 0], plan, range(w), range(w))  # (B, nh, w, hd)
            y = torch.cat((first[:, None], y.view(B, n - 1, nh, w, hd)), dim=1)
            y = y.transpose(1, 2).reshape(B, nh, n * w, hd)[:, :, :T]  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, config: GPTConfig):
        super().__init__()
        C = config.n_embd
        self.c_fc = nn.Linear(C, 4 * C, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * C, C, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = self.c_fc(x)
        x = self.gelu(x)
        x = self.c_proj(x)
        return self.dropout(x)


class Block(nn.Module):

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, plan: AttentionPlan, cache: KVCache | None = None) -> Tensor:
        x = x + self.attn(self.ln_1(x), plan, cache)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        C = config.n_embd
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, C),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(C, bias=config.bias),
        ))
        if config.pos == "learned":
            self.transformer.wpe = nn.Embedding(config.block_size, C)
        self.lm_head = nn.Linear(C, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        # training: recompute each block's activations in backward
        self.grad_checkpoint = False
        self.apply(self._init_weights)
        # GPT-2: scale residual projections by 1/sqrt(2 * n_layer)
        std = 0.02 / math.sqrt(2 * config.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=std)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def forward(self, idx: Tensor, targets: Tensor | None = None, *, attention: RuleLike = None,
                rope_scaling: ScalingLike = None,
                cache: list[KVCache] | None = None) -> tuple[Tensor, Tensor | None]:
        """(logits, loss) of idx, targets (B, T) (-1: ignored; None: the last logits only);
        attention by default BCA past block_size; a cache (new_cache's) fixes both options."""
        plan, x = self.start_pass(idx, attention, rope_scaling, cache)  # x: (B, T, n_embd)
        for i, block in enumerate(self.transformer.h):
            if self.grad_checkpoint and self.training:
                x = checkpoint(block, x, plan, use_reentrant=False)
            else:
                x = block(x, plan, cache[i] if cache else None)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.logits(x[:, [-1], :]), None
        logits = self.logits(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
        return logits, loss

    def start_pass(self, idx: Tensor, attention: RuleLike, rope_scaling: ScalingLike,
                   cache: list[KVCache] | None) -> tuple[AttentionPlan, Tensor]:
        """(plan, x): the pass's AttentionPlan (a cache's own), and the first block's input:
        the token embeddings, plus learned or sinusoidal positions."""
        T = idx.size(1)
        if cache:
            plan = self.cached_plan(cache, cache[0].end() + T, attention, rope_scaling, idx.device)
        else:
            plan = AttentionPlan(self.config, T, attention, rope_scaling, idx.device)
        x = self.transformer.wte(idx)  # (B, T, n_embd)
        if self.config.pos in ("learned", "sinusoidal"):  # absolute positions, added here
            start = cache[0].end() if cache else 0
            pos = torch.arange(start, start + T, device=idx.device)
            if self.config.pos == "learned":
                x = x + self.transformer.wpe(pos)
            else:  # tokens times sqrt(n_embd) (Vaswani et al. §3.4), or the table drowns them
                x = x * math.sqrt(self.config.n_embd)
                x = x + sinusoidal_embedding(pos, self.config.n_embd).to(x.dtype)
        return plan, self.transformer.drop(x)

    def hidden_states(self, idx: Tensor, attention: RuleLike = None,
                      rope_scaling: ScalingLike = None,
                      cache: list[KVCache] | None = None) -> Tensor:
        """forward's final hidden states (B, T, n_embd), before the output layer; for
        evaluation (no activation checkpointing)."""
        plan, x = self.start_pass(idx, attention, rope_scaling, cache)
        for i, block in enumerate(self.transformer.h):
            x = block(x, plan, cache[i] if cache else None)
        return self.transformer.ln_f(x)

    def cached_plan(self, cache: list[KVCache], end: int, attention: RuleLike,
                    rope_scaling: ScalingLike, device: torch.device) -> AttentionPlan:
        """The plan a KV cache was made with, checked against the pass."""
        if attention is not None or rope_scaling is not None:
            raise ValueError("attention and rope_scaling are fixed when the cache is made: "
                             "pass neither with it")
        if end > cache[0].max_tokens:
            raise ValueError(f"the KV cache was made for {cache[0].max_tokens} tokens, "
                             f"asked for {end}")
        plan = cache[0].plan
        if plan.scaling.method == "dynamic_ntk":  # alternatives: s follows the length
            plan = AttentionPlan(self.config, end, plan.rule, plan.scaling, device)
        return plan

    def new_cache(self, max_tokens: int, attention: RuleLike = None,
                  rope_scaling: ScalingLike = None) -> list[KVCache]:
        """An empty KV cache, one KVCache per layer, with the rule and the plan of a pass over
        max_tokens."""
        device = self.lm_head.weight.device
        plan = AttentionPlan(self.config, max_tokens, attention, rope_scaling, device)
        return [KVCache(plan, max_tokens) for _ in self.transformer.h]

    @torch.no_grad()
    def token_nll(self, idx: Tensor, targets: Tensor, *, attention: RuleLike = None,
                  rope_scaling: ScalingLike = None, chunk_tokens: int = 16384) -> Tensor:
        """(B, T) next-token NLL for evaluation, chunk_tokens / B positions at a time, equal to
        the one-piece pass. Under a segmented rule the sequence streams through a KV cache
        of two segments (memory flat at any T); under causal attention only the output layer goes
        chunk by chunk (bounding the logits). Dynamic NTK, where it scales anything, decodes
        token by token past block_size, as generation does: each token is predicted at the
        factor of its own length, through a KV cache whose earlier tokens were computed at
        their own, smaller factors (KVCache: from two layers on, not a full pass over each
        prefix)."""
        B, T = idx.size()
        step = max(1, chunk_tokens // B)
        plan = AttentionPlan(self.config, T, attention, rope_scaling)
        starts = None
        dynamic = plan.scaling.method == "dynamic_ntk"  # alternatives: token by token
        if dynamic and plan.rotation is not None and plan.rope_factor > 1:
            starts = [0, *range(self.config.block_size, T)]
        elif plan.segment and T > step:
            starts = list(range(0, T, step))
        if starts:
            cache = self.new_cache(T, plan.rule, plan.scaling)
            ends = starts[1:] + [T]
            pieces = ((i, self.hidden_states(idx[:, i:j], cache=cache))
                      for i, j in zip(starts, ends))
        else:
            x = self.hidden_states(idx, plan.rule, plan.scaling)
            pieces = ((i, x[:, i : i + step]) for i in range(0, T, step))
        nll = []
        for i, h in pieces:
            logits = self.logits(h).float().flatten(0, 1)
            y = targets[:, i : i + h.size(1)].flatten()
            loss = F.cross_entropy(logits, y, ignore_index=-1, reduction="none")
            nll.append(loss.view(B, -1))
        return torch.cat(nll, dim=1)

    def logits(self, x: Tensor) -> Tensor:
        """The output layer, in float32 outside training even under autocast: evaluation should
        not measure bfloat16's rounding of the logits (about +-0.06 at |logit| 20)."""
        if self.training:
            return self.lm_head(x)
        with torch.autocast(x.device.type, enabled=False):
            return self.lm_head(x.float())

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, *, attention: RuleLike = None,
                 rope_scaling: ScalingLike = None) -> Tensor:
        """Sample max_new_tokens tokens after idx (B, T) with a KV cache. The context is never
        cropped: past block_size every scheme but learned keeps going, by default with BCA,
        at a flat cost a token."""
        if not temperature > 0:
            raise ValueError(f"temperature={temperature!r} is not allowed: must be > 0 "
                             "(use top_k=1 for greedy)")
        if max_new_tokens < 1:
            return idx
        n = idx.size(1) + max_new_tokens - 1  # the last token is not fed back
        cache = self.new_cache(n, attention, rope_scaling)
        logits, _ = self(idx, cache=cache)
        for step in range(max_new_tokens):
            if step:
                logits, _ = self(idx[:, -1:], cache=cache)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                top = torch.topk(logits, min(top_k, logits.size(-1)))
                kth = top.values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx
