"""
The inference-time alternatives to xPos + BCA that people compare it with, each in one place, outside the method's
path: attention sinks (StreamingLLM) and RoPE interpolation (PI, NTK, dynamic NTK, YaRN). model.py calls them at the
lines marked "alternatives:"; the sliding window needs nothing here, it is BCA's window mechanism with another width.

Nothing here imports model.py: the PositionTable model.py passes in is used for its fields only (rotation,
and factors() for the rotary factors at given positions; slopes: ALiBi's; rule).
"""

import math
from dataclasses import dataclass

import torch

# ---------------------------------------------------------------------------------------------------------------
# RoPE interpolation: changes to the rotary angles theta_j (of rope, and of xPos's rotation; xPos's decay zeta is left
# alone) so that a model trained at length l meets fewer angles it never saw. The factor s is L / l, with L the most
# positions one query sees in the pass (the sequence under causal attention, at most W under a window), or a factor
# given. Every method is the identity at s <= 1.

ROPE_SCALINGS = ("none", "pi", "ntk", "dynamic_ntk", "yarn")
YARN_ALPHA, YARN_BETA = 1.0, 32.0  # YaRN's ramp ends, in turns over the training length (its defaults for LLaMA)


@dataclass(frozen=True)
class RopeScaling:
    """One RoPE interpolation method, and its factor (None: s from the length, see factor_at).
      pi           Position Interpolation (Chen et al. 2023): position m -> m / s, i.e. theta_j -> theta_j / s.
      ntk          "NTK-aware" scaling (bloc97, 2023): base -> base * s^(d/(d-2)); the slowest pair is interpolated
                   by exactly s, the fastest (which carry local order) barely change.
      dynamic_ntk  ntk with s recomputed from the current length at every pass: a sequence runs unscaled up to l, and
                   a KV cache follows the length as it grows (GPT.hidden_states).
      yarn         YaRN (Peng et al. 2023): a ramp between pi and no change, pair by pair, and a sharper softmax; its
                   ramp is the official code's (and Hugging Face's), linear in the pair index.
    """
    method: str = "none"
    factor: float = None
    original_length: int = None  # the training length YaRN's ramp counts turns over (None: block_size)

    def __post_init__(self):
        if self.method not in ROPE_SCALINGS:
            raise ValueError(f"rope_scaling={self.method!r} is not allowed: must be one of {', '.join(ROPE_SCALINGS)}")
        length = self.original_length
        if length is not None and not (isinstance(length, int) and not isinstance(length, bool) and length > 0):
            raise ValueError(f"original_length={length!r} is not allowed: must be a positive integer")
        if self.factor is None:
            return
        number = isinstance(self.factor, (int, float)) and not isinstance(self.factor, bool)
        if not (number and 0 < self.factor < math.inf):
            raise ValueError(f"rope_factor={self.factor!r} is not allowed: must be a finite number > 0")
        if self.method in ("none", "dynamic_ntk"):
            raise ValueError(f"rope_factor={self.factor!r} does not apply to rope_scaling={self.method!r}: "
                             + ("it recomputes s from the current length" if self.method != "none" else
                                "choose pi, ntk or yarn"))

    def factor_at(self, n_keys, block_size):
        """s for a pass in which one query sees at most n_keys positions."""
        return float(self.factor) if self.factor is not None else n_keys / block_size


def check_trained_scaling(config, require, is_num):
    """GPTConfig's checks of the scaling a model is fine-tuned with: a fixed factor s > 1 (dynamic NTK has none), on
    rotary angles (rope, or xpos with its rotation)."""
    require(config.rope_scaling in ROPE_SCALINGS and config.rope_scaling != "dynamic_ntk", "rope_scaling",
            "must be one of none, pi, ntk, yarn")
    rotates = config.pos == "rope" or config.pos == "xpos" and config.xpos_rotate
    require(config.rope_scaling == "none" or rotates, "rope_scaling", f"it rescales rotary angles, and "
            f"pos={config.pos!r}" + (" without rotation" if config.pos == "xpos" else "") + " has none")
    require(is_num(config.rope_factor) and (1 < config.rope_factor < math.inf or config.rope_scaling == "none"),
            "rope_factor", f"must be a finite number > 1 with rope_scaling={config.rope_scaling!r}")
    require(is_num(config.rope_original_length, int) and config.rope_original_length >= 0, "rope_original_length",
            "must be an integer >= 0 (0: block_size)")


def interpolate(theta, scaling, factor, block_size):
    """(theta'_j, sharpen): the angles interpolated at the given factor s, and the number q and k are each multiplied
    by (YaRN's temperature; 1 for the others)."""
    s = factor
    if scaling is None or scaling.method == "none" or s <= 1:
        return theta, 1.0
    d, j = 2 * len(theta), torch.arange(len(theta), device=theta.device, dtype=theta.dtype)
    if scaling.method == "pi":
        return theta / s, 1.0
    if scaling.method in ("ntk", "dynamic_ntk"):  # base' = base * s^(d/(d-2)), i.e. theta'_j = theta_j * s^(-2j/(d-2))
        return (theta * s ** (-2 * j / (d - 2)) if d > 2 else theta), 1.0
    # YaRN as its official code (jquesnelle/yarn) and Hugging Face compute it: pair j turns r_j = l / lambda_j times
    # over the training length (wavelength lambda_j = 2 pi / theta_j). Pairs below alpha turns never showed a full turn
    # in training: interpolate (theta_j / s); pairs above beta saw every angle: keep theta_j. In between the ramp is
    # linear in the pair index j, from the pair where r = beta (rounded down) to the one where r = alpha (rounded up).
    # (The paper writes a ramp linear in r_j, which keeps less of the fastest pairs at a small l.) Its temperature,
    # sqrt(1/t) = 0.1 ln s + 1 on q and k alike, undoes the thinner spread of attention over a longer context.
    if d == 2 or not theta.any():  # one pair is always kept (j = 0 is below any low); no rotation: nothing to scale
        return theta, 0.1 * math.log(s) + 1
    block_size = scaling.original_length or block_size  # a fine-tuned model's ramp: over the length before it
    t0, t1 = float(theta[0]), float(theta[1])  # theta_j is geometric in j: the pair where r_j = r, as a real index
    at = lambda r: math.log(block_size * t0 / (2 * math.pi * r)) / math.log(t0 / t1)  # = d ln(l / 2 pi r) / 2 ln base
    low, high = max(math.floor(at(YARN_BETA)), 0), min(math.ceil(at(YARN_ALPHA)), d - 1)
    ramp = ((j - low) / (high - low if high != low else 0.001)).clamp(0, 1)  # 0: keep theta_j, 1: theta_j / s
    return ramp * theta / s + (1 - ramp) * theta, 0.1 * math.log(s) + 1


# ---------------------------------------------------------------------------------------------------------------
# Attention sinks (StreamingLLM, Xiao et al. 2023): the sinks rule is a sliding window of W keys of which the first S
# tokens always stay. The first tokens soak up the attention a softmax must put somewhere; dropping them is what breaks
# a plain sliding window.


def attention_with_sinks(q, k, v, table, queries, keys, sink_kv):
    """The sinks rule past its first window, for raw q at window-frame positions `queries` and raw k, v at `keys`:
    every query sees the S sinks (sink_kv: their raw keys and values, batch B, for a batch of B * n windows) and the
    window's keys at distance < W - S.

    StreamingLLM positions keys by their place in its cache: the sinks at 0 .. S-1 and the recent keys right after
    them, so a query stands at W-1 as seen from the sinks but at its true distance from the recent keys. One rotation
    of q cannot give both, so the two kinds of scores are computed apart and share one softmax, in float32:
    softmax([q_(W-1) . sink_k | q . k] / sqrt(d) - slope * distance) @ [sink_v | v]. The sink keys take the query's
    rotation to W-1 instead (conjugated), which leaves q_(W-1) . sink_k unchanged and q itself raw."""
    rule, hd, dtype = table.rule, q.size(-1), v.dtype
    S, W = rule.sinks, rule.window
    sink_k, sink_v = (x.repeat_interleave(q.size(0) // x.size(0), dim=0).float() for x in sink_kv)
    with torch.autocast(q.device.type, enabled=False):  # float32 throughout, even under autocast
        q = q_window = q.float()
        k, v = k.float(), v.float()
        if table.rotation is not None:  # RoPE / xPos: pairs as complex numbers times their positions' factors
            pairs = lambda x: torch.view_as_complex(x.unflatten(-1, (-1, 2)))  # the table's factors: (..., d/2, 2)
            rotate = lambda x, f: torch.view_as_real(pairs(x) * f).flatten(-2)
            at_end, sinks = map(torch.view_as_complex, table.factors(range(W - 1, W), range(S)))
            sink_k = rotate(sink_k, sinks * at_end.conj())
            q_window, k = map(rotate, (q, k), map(torch.view_as_complex, table.factors(queries, keys)))
        distance = torch.arange(queries.start, queries.stop, device=q.device)[:, None] - \
            torch.arange(keys.start, keys.stop, device=q.device)
        scores, sink_scores = q_window @ k.mT / math.sqrt(hd), q @ sink_k.mT / math.sqrt(hd)
        if table.slopes is not None:  # ALiBi's bias, the sinks at distance W-1-j from the query
            scores -= table.slopes * distance
            sink_scores -= table.slopes * (W - 1 - torch.arange(S, device=q.device))
        scores.masked_fill_((distance < 0) | (distance >= W - S), float("-inf"))
        top = torch.maximum(scores.amax(-1, keepdim=True), sink_scores.amax(-1, keepdim=True))
        scores, sink_scores = scores.sub_(top).exp_(), sink_scores.sub_(top).exp_()  # one softmax over both, in place
        total = scores.sum(-1, keepdim=True) + sink_scores.sum(-1, keepdim=True)
        return ((scores @ v + sink_scores @ sink_v) / total).to(dtype)
