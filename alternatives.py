"""The inference-time alternatives to xPos + BCA that people compare it with, each in one
place, outside the method's path: attention sinks (StreamingLLM), RoPE interpolation (PI,
NTK, dynamic NTK, YaRN), and the masks of ALiBi and of the sliding and sinks windows.
model.py calls them at the lines marked "alternatives:", and only when one is asked for;
the sliding window is otherwise BCA's segments with another width. Also the one number check
model.py and this file share (is_number).

Nothing here imports model.py: the AttentionPlan (and KVCache) model.py passes in is used for
its fields and methods (rule, segment, reach, slopes, masks; rotate and visible, the one
rotation and the one visibility mask)."""

import math
from dataclasses import dataclass

import torch

# ----------------------------------------------------------------------------
# RoPE interpolation: changes to the rotary angles theta_j (of rope, and of xPos's rotation;
# xPos's decay zeta is left alone) so that a model trained at length l meets fewer angles it
# never saw. The factor s is L / l, with L the most positions one query sees in the pass
# (the sequence under causal attention, at most W under a window), or a factor given. Every
# method is the identity at s <= 1.

ROPE_SCALINGS = ("none", "pi", "ntk", "dynamic_ntk", "yarn")
# those a model may be fine-tuned with: a fixed factor (dynamic NTK recomputes it each pass)
TRAINED_SCALINGS = tuple(m for m in ROPE_SCALINGS if m != "dynamic_ntk")
# YaRN's ramp ends, in turns over the training length: its LLaMA defaults (the official code's
# beta_slow and beta_fast), which a model of another head dimension and length may tune
YARN_ALPHA, YARN_BETA = 1.0, 32.0


def is_number(x: object, kinds: type | tuple[type, ...] = (int, float)) -> bool:
    """x is one of kinds (int and float: any real number), and not a bool."""
    return isinstance(x, kinds) and not isinstance(x, bool)


@dataclass(frozen=True)
class RopeScaling:
    """One RoPE interpolation method, and its factor s (None: s from the
    length, see factor_at).
      pi           Position Interpolation (Chen et al. 2023): position
                   m -> m / s, i.e. theta_j -> theta_j / s.
      ntk          "NTK-aware" scaling (bloc97, 2023): base -> base *
                   s^(d/(d-2)); the slowest pair is interpolated by exactly
                   s, the fastest (which carry local order) barely change.
      dynamic_ntk  ntk with s recomputed from the current length at every
                   pass (Hugging Face's "dynamic" at its factor 1): a
                   sequence runs unscaled up to l, and a KV cache follows
                   the length as it grows (GPT.cached_plan, KVCache).
      yarn         YaRN (Peng et al. 2023): a ramp between pi and no change,
                   pair by pair, and a sharper softmax; its ramp is the
                   official code's (and Hugging Face's), linear in the pair
                   index.
    """
    method: str = "none"
    factor: float = None
    # the training length YaRN's ramp counts turns over (None: block_size)
    original_length: int = None
    # YaRN's ramp ends alpha < beta, in turns (None: YARN_ALPHA, YARN_BETA)
    alpha: float = None
    beta: float = None

    def __post_init__(self):
        if self.method not in ROPE_SCALINGS:
            methods = ", ".join(ROPE_SCALINGS)
            raise ValueError(f"rope_scaling={self.method!r} is not allowed: "
                             f"must be one of {methods}")
        alpha, beta = self.alpha, self.beta
        if (alpha, beta) != (None, None):
            if self.method != "yarn":
                raise ValueError(f"yarn_alpha={alpha!r}, yarn_beta={beta!r} apply to "
                                 f"rope_scaling='yarn' only, not {self.method!r}")
            alpha = YARN_ALPHA if alpha is None else alpha
            beta = YARN_BETA if beta is None else beta
            if not yarn_ends_allowed(alpha, beta):
                raise ValueError(f"yarn_alpha={alpha!r}, yarn_beta={beta!r} are not allowed: "
                                 + YARN_ENDS_ALLOWED)
        length = self.original_length
        if length is not None and not (is_number(length, int) and length >= 2):
            raise ValueError(f"original_length={length!r} is not allowed: "
                             "must be an integer >= 2 (a training length)")
        s = self.factor
        if s is None:
            return
        if not (is_number(s) and 0 < s < math.inf):
            raise ValueError(f"rope_factor={s!r} is not allowed: "
                             "must be a finite number > 0")
        if self.method == "none":
            raise ValueError(f"rope_factor={s!r} does not apply to "
                             "rope_scaling='none': choose pi, ntk or yarn")
        if self.method == "dynamic_ntk":
            raise ValueError(f"rope_factor={s!r} does not apply to "
                             "rope_scaling='dynamic_ntk': it recomputes s "
                             "from the current length")

    def factor_at(self, n_keys: int, block_size: int) -> float:
        """s for a pass in which one query sees at most n_keys positions. Without a factor, s
        follows the length, as YaRN's dynamic scaling does (Peng et al. 2023, section 3.3; the
        official code's fine-tuned case): s = max(n_keys, block_size) / l, l the original length
        (block_size for a model never scaled: s = n_keys / l past l, the identity up to it)."""
        if self.factor is not None:
            return float(self.factor)
        return max(n_keys, block_size) / (self.original_length or block_size)


NO_SCALING = RopeScaling()  # RoPE as trained


def scaling_of(config, rope_scaling: RopeScaling | str | None = None) -> RopeScaling:
    """The RopeScaling of a pass: the one asked for (a RopeScaling or its name), or else the
    one the model was fine-tuned with (GPTConfig.rope_scaling: none for most models)."""
    if isinstance(rope_scaling, RopeScaling):
        return rope_scaling
    if rope_scaling is not None:
        return RopeScaling(rope_scaling)
    if config.rope_scaling == "none":
        return NO_SCALING
    length = config.rope_original_length or None
    ends = (config.yarn_alpha, config.yarn_beta)
    if config.rope_scaling != "yarn" or ends == (YARN_ALPHA, YARN_BETA):
        ends = (None, None)
    return RopeScaling(config.rope_scaling, config.rope_factor, length, *ends)


def yarn_ends_allowed(alpha: object, beta: object) -> bool:
    """YaRN's ramp ends: finite numbers 0 < alpha < beta (turns over the original length)."""
    return all(is_number(x) and 0 < x < math.inf for x in (alpha, beta)) and alpha < beta


YARN_ENDS_ALLOWED = "must be finite numbers 0 < yarn_alpha < yarn_beta (turns over l)"


def check_trained_scaling(config, require) -> None:
    """GPTConfig's checks of the scaling a model is fine-tuned with: a fixed factor s > 1
    (dynamic NTK has none), on rotary angles (rope, or xpos with its rotation)."""
    method = config.rope_scaling
    s = config.rope_factor
    require(method in TRAINED_SCALINGS, "rope_scaling",
            f"must be one of {', '.join(TRAINED_SCALINGS)}")
    rotates = config.pos == "rope"
    rotates = rotates or config.pos == "xpos" and config.xpos_rotate
    has_none = f"pos={config.pos!r}"
    if config.pos == "xpos":
        has_none += " without rotation"
    require(method == "none" or rotates, "rope_scaling",
            f"it rescales rotary angles, and {has_none} has none")
    scaled = 1 < s < math.inf if is_number(s) else False
    require(is_number(s) and (scaled or method == "none"), "rope_factor",
            f"must be a finite number > 1 with rope_scaling={method!r}")
    # the length before the scaling extended the model: at most the length it trains at now
    length, l = config.rope_original_length, config.block_size
    require(is_number(length, int) and (length == 0 or 2 <= length <= l), "rope_original_length",
            f"must be 0 (block_size) or an integer from 2 to block_size={l}, the length the "
            "model was trained at before its RoPE scaling")
    ends = (config.yarn_alpha, config.yarn_beta)
    require(method == "yarn" or ends == (YARN_ALPHA, YARN_BETA), "yarn_alpha",
            f"yarn_alpha and yarn_beta apply to rope_scaling='yarn' only (defaults {YARN_ALPHA:g} "
            f"and {YARN_BETA:g})")
    require(yarn_ends_allowed(*ends), "yarn_alpha",
            f"with yarn_beta={config.yarn_beta!r}: {YARN_ENDS_ALLOWED}")


def interpolate(theta, scaling, factor, block_size, base):
    """(theta'_j, sharpen): the angles theta_j = base^(-2j/d) interpolated at the factor s, and
    the number q and k are each multiplied by (YaRN's temperature; 1 for the others)."""
    s = factor
    if scaling is None or scaling.method == "none" or s <= 1:
        return theta, 1.0
    d = 2 * len(theta)
    j = torch.arange(len(theta), device=theta.device, dtype=theta.dtype)
    if scaling.method == "pi":
        return theta / s, 1.0
    if scaling.method in ("ntk", "dynamic_ntk"):
        # base' = base * s^(d/(d-2)), i.e. theta'_j = theta_j s^(-2j/(d-2))
        if d == 2:
            return theta, 1.0
        return theta * s ** (-2 * j / (d - 2)), 1.0
    # YaRN as its official code (jquesnelle/yarn) and Hugging Face compute it: pair j turns
    # r_j = l / lambda_j times over the training length (wavelength lambda_j = 2 pi /
    # theta_j). Pairs below alpha turns never showed a full turn in training: interpolate
    # (theta_j / s); pairs above beta saw every angle: keep theta_j. In between the ramp is
    # linear in the pair index j, from the pair where r = beta (rounded down) to the one
    # where r = alpha (rounded up). (The paper writes a ramp linear in r_j, which keeps less
    # of the fastest pairs at a small l.) Its temperature, sqrt(1/t) = 0.1 ln s + 1 on q and
    # k alike, undoes the thinner spread of attention over a longer context.
    sharpen = 0.1 * math.log(s) + 1
    if d == 2:  # one pair, always kept (j = 0 is below any low)
        return theta, sharpen
    # a fine-tuned model's ramp counts over the length before it
    l = scaling.original_length or block_size

    # The pair where r_j = r, as a real index: d ln(l / 2 pi r) / 2 ln base, in Python's float64
    # from the config's numbers, as the peers compute it (from float32 theta, the floor or ceil
    # flips in rare shapes; and no tensor is read back, which would break a compiled graph).
    def pair_at(r):
        return d * math.log(l / (r * 2 * math.pi)) / (2 * math.log(base))

    alpha = YARN_ALPHA if scaling.alpha is None else scaling.alpha
    beta = YARN_BETA if scaling.beta is None else scaling.beta
    low = max(math.floor(pair_at(beta)), 0)
    high = min(math.ceil(pair_at(alpha)), d - 1)
    width = high - low if high != low else 0.001
    ramp = ((j - low) / width).clamp(0, 1)  # 0: keep theta_j, 1: / s
    return ramp * theta / s + (1 - ramp) * theta, sharpen


# ----------------------------------------------------------------------------
# The sliding and sinks windows (model.py's rule table): AttentionRule's checks of W and S,
# where a rule is made, and how far a window sees.


def check_window(rule) -> None:
    """AttentionRule's checks of W and S, where the rule is made: positive integers, and
    check_sinks when W is given."""
    window = 1 if rule.window is None else rule.window
    for flag, value in (("window", window), ("sinks", rule.sinks)):
        if not (is_number(value, int) and value > 0):
            raise ValueError(f"{flag}={value!r} is not allowed: must be a positive integer")
    if rule.name == "sinks" and rule.window is not None:
        check_sinks(rule.sinks, rule.window)


def check_sinks(sinks: int, window: int) -> None:
    """S < W under sinks: the window holds the sinks and at least one recent key."""
    if sinks >= window:
        raise ValueError(f"sinks={sinks} is not allowed with window={window}: the window "
                         "holds the sinks and at least one recent key, so sinks must be < "
                         "window")


def window_reach(rule) -> int:
    """How far back a query sees past the first segment (AttentionPlan.reach) under a resolved
    sliding or sinks rule: W under sliding, the W - S recent keys under sinks."""
    return rule.window - rule.sinks if rule.name == "sinks" else rule.window


# ----------------------------------------------------------------------------
# Masks other than a causal one: ALiBi's bias (and its slopes), and the band of a window that
# ends before the first key (sliding, sinks).


def alibi_slopes(n_head: int) -> torch.Tensor:
    """ALiBi's head slopes (Press et al. §3): 2^(-8i/n) for i = 1..n when n is a power of two;
    otherwise the slopes for the power of two p below n, then every other slope for 2p until
    there are n."""
    def geometric(n):
        return [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]
    p = 2 ** int(math.log2(n_head))
    extra = geometric(2 * p)[0::2][: n_head - p]
    return torch.tensor(geometric(p) + extra)


def attention_mask(plan, queries, keys, dtype, device):
    """SDPA's attn_mask under ALiBi or a sliding or sinks window, made once per pass and shape.
    ALiBi's -slope * (i - j) is the one float mask (its scores are never amplified, so an
    additive -inf is safe); a window is a boolean band where some query sees less than all
    keys before it; None where the plain causal mask of model.attend will do."""
    key = (queries, keys, dtype)
    if key in plan.masks:
        return plan.masks[key]
    if len(plan.masks) > 4:  # a KV cache asks for a new shape at every token
        plan.masks.clear()
    mask = None
    last = queries.stop - 1
    if plan.slopes is not None:
        i = torch.arange(queries.start, queries.stop, device=device)[:, None]
        bias = -plan.slopes * (i - torch.arange(keys.start, keys.stop, device=device))
        mask = bias.masked_fill(~plan.visible(queries, keys, device), -math.inf).to(dtype)
    elif last >= plan.segment and last - keys.start >= plan.reach:
        mask = plan.visible(queries, keys, device)  # a band
    plan.masks[key] = mask
    return mask


# ----------------------------------------------------------------------------
# Attention sinks (StreamingLLM, Xiao et al. 2023): the sinks rule is a sliding window of W
# keys of which the first S tokens always stay. The first tokens soak up the attention a
# softmax must put somewhere; dropping them is what breaks a plain sliding window.


def cached_sinks(cache, k: torch.Tensor, v: torch.Tensor,
                 S: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The sinks a KV cache keeps past every segment: the first S raw keys and values, from
    those held and the new k, v; None while the sequence has fewer than S tokens."""
    if cache.end() + k.size(2) < S:
        return None
    old = slice(0, cache.held)
    sink_k = torch.cat((cache.k[:, :, old], k[:, :, :S]), dim=2)
    sink_v = torch.cat((cache.v[:, :, old], v[:, :, :S]), dim=2)
    return sink_k[:, :, :S].clone(), sink_v[:, :, :S].clone()


def attention_with_sinks(q, k, v, plan, queries, keys, sink_kv):
    """The sinks rule past its first segment, for raw q at frame positions `queries` and raw
    k, v at `keys`: every query sees the S sinks (sink_kv: their raw keys and values, batch B,
    for a batch of B * n frames) and the keys at distance < W - S.

    StreamingLLM positions keys by their place in its cache: the sinks at 0 .. S-1 and the
    recent keys right after them, so a query stands at W-1 as seen from the sinks but at its
    true distance from the recent keys. So the two kinds of scores are computed apart, with
    q rotated twice, and share one softmax, in float32: softmax([q_(W-1) . sink_k | q . k] /
    sqrt(d) - slope * distance) @ [sink_v | v]."""
    S = plan.rule.sinks
    W = plan.rule.window
    repeat = q.size(0) // sink_kv[0].size(0)  # frames per sequence
    sink_k, sink_v = (x.repeat_interleave(repeat, dim=0) for x in sink_kv)
    dtype = v.dtype
    device = v.device
    with torch.autocast(device.type, enabled=False):  # float32 throughout
        q, k, v = q.float(), k.float(), v.float()
        sink_k, sink_v = sink_k.float(), sink_v.float()
        q_end, sink_k = plan.rotate(q, sink_k, range(W - 1, W), range(S))
        q, k = plan.rotate(q, k, queries, keys)
        scale = 1 / math.sqrt(q.size(-1))
        scores = q @ k.mT * scale  # (n, nh, Q, K)
        sink_scores = q_end @ sink_k.mT * scale  # (n, nh, Q, S)
        if plan.slopes is not None:  # ALiBi: the sinks at distance W-1-j
            i = torch.arange(queries.start, queries.stop, device=device)
            j = torch.arange(keys.start, keys.stop, device=device)
            scores -= plan.slopes * (i[:, None] - j)
            to_sinks = W - 1 - torch.arange(S, device=device)
            sink_scores -= plan.slopes * to_sinks
        seen = plan.visible(queries, keys, device)
        scores.masked_fill_(~seen, float("-inf"))
        # one softmax over both, in place
        top = torch.maximum(scores.amax(-1, keepdim=True),
                            sink_scores.amax(-1, keepdim=True))
        scores = scores.sub_(top).exp_()
        sink_scores = sink_scores.sub_(top).exp_()
        total = scores.sum(-1, keepdim=True)
        total += sink_scores.sum(-1, keepdim=True)
        y = (scores @ v + sink_scores @ sink_v) / total
        return y.to(dtype)
