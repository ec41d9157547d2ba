r"""
Attention resolution (paper §3.1 Eq. 3, §4.3): the theory curves of Figure 2 and the measured
Table 3.

    python resolution.py --theory [--head_dim 64] [--gamma 0.4] [--scale_base 512] \
        [--max_dist 4096] [--json out.json] [--plot out.png]
    python resolution.py --ckpt CKPT --length T \
        [--bca on|off|both | --attention causal,bca,sliding,sinks [--window W] [--sinks S]] \
        [--rope_scaling none,pi,...] [--texts 8] [--json out.json]

Eq. 3 as printed, R(s) = sum_i e^s[i] (e^s[i] - e^s[i+1]) / (sum_i e^s[i])^2, leaves choices open;
made here:
- s is indexed by distance n = 0 .. N with N = max_dist (theory) or T-1 (measured); the numerator
  runs over the pairs (i, i+1) that exist (i = 0 .. N-1), the denominator over 0 .. N. Flat scores
  then give R = 0.
- Written with p = softmax(s), R = sum_i p_i (p_i - p_{i+1}) <= sum_i p_i^2 <= 1: the paper's 1.08
  (Table 3) cannot come from Eq. 3 as printed.
- Measured s-hat[n] (Eq. 11) is the mean pre-softmax score (with 1/sqrt(d) and ALiBi's bias, as the
  model computes it) over the visible query/key pairs at distance n, per layer and head, pooled over
  the texts (every text has the same pairs, so this is the average over texts of the per-text
  means). A distance that the attention rule hides entirely (BCA's, a window's) counts as e^s = 0;
  attention sinks count at their true distance. R is reported per layer two ways: heads averaged
  before R, and R per head then averaged; the headline is the layer average of each.
"""

import argparse
import math

import torch

from lexgpt.checkpoint import load_model
from lexgpt.cli import ArgumentParser, UserError, error_exit, exit_interrupted
from lexgpt.data import checked, checkpoint_dataset, documents, read_tokens
from lexgpt.inference_options import (
    Runtime,
    add_checkpoint_args,
    attention_options,
    check_rule,
    checkpoint_scaling,
    learned_length_check,
    pointless,
    rule_fields,
    rule_label,
    save_figure,
)
from lexgpt.outputs import distinct_outputs, output_path, pyplot, write_json
from model import AttentionPlan, GPTConfig


def resolution(curve):
    """Eq. 3 for one score curve s[0..N] (-inf = hidden distance, e^s = 0)."""
    p = torch.softmax(torch.as_tensor(curve, dtype=torch.float64), dim=-1)
    return (p[:-1] * (p[:-1] - p[1:])).sum().item()


# -------------------------------------------------------------------------------------------------
# Theory: Eq. 8, g_zeta[n] = sum_j cos(n theta_j) zeta_j^(n / scale_base), with model.py's theta
# and zeta.


# the theory's float64 tables, (max_dist + 1) x head_dim/2: at most 2^25 entries (256 MB each)
THEORY_ENTRIES = 2**25


def theory(head_dim, gamma, scale_base, max_dist):
    # block_size 2: the curves have no training length
    config = GPTConfig(block_size=2, n_head=1, n_embd=head_dim, pos="xpos", xpos_gamma=gamma,
                       xpos_scale_base=scale_base)
    plan = AttentionPlan(config, 1)
    theta = plan.theta.double()
    zeta = plan.zeta.double()
    n = torch.arange(max_dist + 1, dtype=torch.float64)[:, None]
    out = {}
    for name, decay in (("rope", torch.ones_like(zeta)), ("xpos", zeta)):
        g = (torch.cos(n * theta) * decay ** (n / scale_base)).sum(-1)
        out[name] = {"g": g.tolist(), "R": resolution(g)}
    return out | {"head_dim": head_dim, "gamma": gamma, "scale_base": scale_base}


def plot_theory(result, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, label in (("rope", "RoPE (ζ = 1)"), ("xpos", f"xPos (γ = {result['gamma']})")):
        ax.plot(result[name]["g"], label=f"{label}, R = {result[name]['R']:.3f}", lw=1)
    ax.set_xlabel("relative distance n")
    ax.set_ylabel("g[n] (paper Eq. 8)")
    ax.set_title(f"expected attention score vs distance, head dim {result['head_dim']}")
    ax.legend()
    ax.grid(alpha=0.3)
    save_figure(fig, path)


# -------------------------------------------------------------------------------------------------
# Measured: per-distance sums of each layer's pre-softmax scores. The model is streamed through a KV
# cache one window's queries at a time (memory O(T * window)); a forward hook on each attention
# module hands over its input, and the scores are written out here from it, the way model.attend
# computes them (tests/test_resolution.py checks that their softmax gives the model's attention
# output).


def scores(q, k, plan, queries, keys):
    """Pre-softmax scores (B, n_head, Q, K) in float32 of raw q at frame positions `queries` against
    raw k at `keys`: rotated (rope, xpos), q.k / sqrt(head_dim), ALiBi's bias, -inf where the rule
    hides the key."""
    q, k = plan.rotate(q.float(), k.float(), queries, keys)
    m = torch.arange(queries.start, queries.stop, device=q.device)[:, None]
    distance = m - torch.arange(keys.start, keys.stop, device=q.device)
    dots = q @ k.mT / math.sqrt(q.size(-1))
    if plan.slopes is not None:
        dots = dots - plan.slopes * distance
    return dots.masked_fill(~plan.visible(queries, keys, q.device), float("-inf"))


def sink_scores(q, sink_k, plan):
    """The sinks rule past its first window: q stands at W-1 as seen from the S sinks at 0 .. S-1
    (StreamingLLM)."""
    S = sink_k.size(2)
    W = plan.rule.window
    q, sink_k = plan.rotate(q.float(), sink_k.float(), range(W - 1, W), range(S))
    dots = q @ sink_k.mT / math.sqrt(q.size(-1))
    if plan.slopes is None:
        return dots
    return dots - plan.slopes * (W - 1 - torch.arange(S, device=q.device))


@torch.no_grad()
def pre_softmax_scores(model, idx, observe, attention=None, rope_scaling=None):
    """Calls observe(layer, scores, queries, keys) with every layer's pre-softmax scores
    (B, n_head, Q, K) for each chunk of queries at absolute positions `queries` against the keys
    they see at `keys` (ranges); the sinks rule's sinks come in a call of their own."""
    nh = model.config.n_head
    T = idx.size(1)
    cache = model.new_cache(T, attention, rope_scaling)
    inputs = {}

    def keep_input(i):
        """A forward hook that keeps layer i's attention input in inputs."""

        def hook(module, args, out):
            inputs[i] = args

        return hook

    hooks = [block.attn.register_forward_hook(keep_input(i))
             for i, block in enumerate(model.transformer.h)]
    # window by window: the cache then holds its keys
    step = cache[0].plan.segment or model.config.block_size // 2
    try:
        for t0 in range(0, T, step):
            model.hidden_states(idx[:, t0 : t0 + step], cache=cache)
            for layer, (x, plan, c) in sorted(inputs.items()):
                B, n, C = x.shape
                q = model.transformer.h[layer].attn.c_attn(x)[..., :C]
                q = q.view(B, n, nh, C // nh).transpose(1, 2)
                queries = range(t0 - c.start, t0 - c.start + n)
                absolute = range(t0, t0 + n)
                window = scores(q, c.k[:, :, : c.held], plan, queries, range(c.held))
                observe(layer, window, absolute, range(c.start, c.end()))
                if c.sink_kv is not None and queries.start >= plan.segment:
                    sinks = sink_scores(q, c.sink_kv[0], plan)
                    observe(layer, sinks, absolute, range(c.sink_kv[0].size(2)))
    finally:
        for hook in hooks:
            hook.remove()


def accumulate(sums, counts, scores, q_pos, k_pos):
    """Add one text's scores (n_head, Q, K) at query/key positions into sums[head, distance]; count
    the visible pairs (finite scores: the rule's mask makes the others -inf) per distance into
    counts unless it is None."""
    distance = q_pos[:, None] - k_pos[None, :]
    visible = torch.isfinite(scores[0]) & (distance >= 0)
    index = distance[visible]
    sums.index_add_(1, index, scores[:, visible].double())
    if counts is not None:
        counts.index_add_(0, index, torch.ones(index.numel(), dtype=counts.dtype))


@torch.no_grad()
def layer_score_sums(model, idx, rule, scaling):
    """sums (n_layer, n_head, T) and counts (T) of the pre-softmax scores at each distance, for one
    text idx (1, T)."""
    cfg = model.config
    T = idx.size(1)
    sums = torch.zeros(cfg.n_layer, cfg.n_head, T, dtype=torch.float64)
    counts = torch.zeros(T, dtype=torch.float64)

    def as_tensor(r):
        return torch.arange(r.start, r.stop)

    def observe(layer, scores, queries, keys):
        layer_counts = counts if layer == 0 else None
        accumulate(sums[layer], layer_counts, scores[0].cpu(), as_tensor(queries),
                   as_tensor(keys))

    pre_softmax_scores(model, idx, observe, attention=rule, rope_scaling=scaling)
    return sums, counts


def texts_from(meta, data_dir, length, max_texts):
    """Consecutive length-token texts cut from the validation documents, taken round-robin over
    documents."""
    stream = read_tokens(data_dir, "val", meta)
    offsets = documents(data_dir, "val", meta)
    docs = [{"start": int(s), "end": int(e)} for s, e in offsets if e - s >= length]
    if not docs:
        longest = int((offsets[:, 1] - offsets[:, 0]).max())
        raise UserError(f"no validation document has {length} tokens "
                        f"(the longest has {longest}): lower --length")
    per_doc = [[d["start"] + i * length for i in range((d["end"] - d["start"]) // length)]
               for d in docs]
    starts = [s for i in range(max(map(len, per_doc)))
              for doc in per_doc if i < len(doc)
              for s in [doc[i]]]
    texts = []
    for s in starts[:max_texts]:
        text = checked(stream.tokens[s : s + length][None], stream, [s])[0]
        texts.append(torch.from_numpy(text.astype("int64")))
    return texts


def measure(model, texts, rule, scaling):
    cfg = model.config
    sums = torch.zeros(cfg.n_layer, cfg.n_head, len(texts[0]), dtype=torch.float64)
    counts = torch.zeros(len(texts[0]), dtype=torch.float64)
    device = next(model.parameters()).device
    for text in texts:
        s, c = layer_score_sums(model, text[None].to(device), rule, scaling)
        sums += s
        counts += c
    # hidden distances: e^s = 0
    s_hat = (sums / counts.clamp(min=1)).masked_fill(counts == 0, float("-inf"))

    def as_list(t):
        return [None if math.isinf(v) else v for v in t.tolist()]

    return {**rule_fields(rule, scaling, cfg.block_size, len(texts[0])),
            "label": rule_label(cfg.pos, rule, scaling, cfg.block_size),
            **layer_average(s_hat),
            **layer_average(s_hat[..., : cfg.block_size], "_shared"),
            "s_hat": [as_list(s_hat[layer].mean(0)) for layer in range(cfg.n_layer)],
            "s_hat_heads": [[as_list(h) for h in s_hat[layer]] for layer in range(cfg.n_layer)],
            "pairs": counts.tolist()}


def layer_average(s_hat, suffix=""):
    """R per layer two ways, heads averaged before R and R per head then averaged, and the layer
    average of each. suffix "_shared": s_hat cut to the distances 0 .. block_size-1, which causal
    attention and BCA both see. BCA hides the longer ones (e^s = 0), and hiding alone raises R even
    when no score changes, so R_shared compares them like for like. (A window narrower than
    block_size hides some of these distances too, and sinks fill the long distances with their
    scores alone: compare those with care.)"""
    n_layer, n_head = s_hat.shape[:2]
    heads_first = [resolution(s_hat[layer].mean(0)) for layer in range(n_layer)]
    per_head = [sum(resolution(h) for h in s_hat[layer]) / n_head for layer in range(n_layer)]
    return {f"R{suffix}": sum(heads_first) / n_layer,
            f"R{suffix}_per_head": sum(per_head) / n_layer,
            f"R{suffix}_layers": heads_first,
            f"R{suffix}_layers_per_head": per_head}


def run(args):
    json_path = output_path(args.json, "--json")
    plot_path = output_path(args.plot, "--plot", plot=True) if args.theory else None
    distinct_outputs([("--json", json_path), ("--plot", plot_path)])
    if args.theory:
        theirs = ("theory", "head_dim", "gamma", "scale_base", "max_dist", "json", "plot")
        defaults = vars(parse_args([]))
        measured = [f"--{k}" for k, v in defaults.items()
                    if k not in theirs and getattr(args, k) != v]
        if measured:
            raise UserError("--theory computes Eq. 8's curves from --head_dim, --gamma, "
                            f"--scale_base and --max_dist alone: {', '.join(measured)} would be "
                            "ignored (they measure a checkpoint, without --theory)")
        if args.head_dim < 2 or args.head_dim % 2 or args.max_dist < 1:
            raise UserError("--head_dim must be even and >= 2, --max_dist >= 1")
        if (args.max_dist + 1) * args.head_dim // 2 > THEORY_ENTRIES:
            raise UserError(f"--max_dist {args.max_dist} at --head_dim {args.head_dim} is too "
                            "large: the tables of (max_dist + 1) x head_dim/2 entries may hold "
                            f"at most {THEORY_ENTRIES:,} (max_dist up to "
                            f"{THEORY_ENTRIES // (args.head_dim // 2) - 1:,} here)")
        try:
            result = theory(args.head_dim, args.gamma, args.scale_base, args.max_dist)
        except ValueError as e:
            raise UserError(str(e)) from None
        print(f"theory (Eq. 8), head dim {args.head_dim}, gamma {args.gamma}, "
              f"scale_base {args.scale_base}, distances 0..{args.max_dist}")
        print(f"| | g[0] | g[{args.max_dist // 4}] | g[{args.max_dist}] | min g | R(g) |"
              "\n|---|---|---|---|---|---|")
        for name in ("rope", "xpos"):
            g = result[name]["g"]
            print(f"| {name} | {g[0]:.3f} | {g[args.max_dist // 4]:.3f} | {g[-1]:.3f} | "
                  f"{min(g):.3f} | {result[name]['R']:.4f} |")
        if plot_path:
            plot_theory(result, plot_path)
    else:
        if not args.ckpt or args.length is None:
            raise UserError("give --theory, or --ckpt CKPT --length T")
        if args.length < 2:
            raise UserError(f"--length {args.length} is not allowed: must be >= 2 "
                            "(a distance needs two positions)")
        if args.texts < 1:
            raise UserError(f"--texts {args.texts} is not allowed: must be >= 1")
        if args.plot:
            raise UserError("--plot draws the theory curves (--theory); "
                            "measured curves are in --json's s_hat")
        rules, scalings = attention_options(args, several=True)
        runtime = Runtime.local(args.device)  # float32: resolution.py has no --dtype
        model, ckpt = load_model(args.ckpt, runtime.device)
        cfg = model.config
        learned_length_check(cfg, args.length, args.ckpt)
        for rule in rules:
            check_rule(rule, args.length, cfg.block_size, args.ckpt)
        runs = [(rule, checkpoint_scaling(cfg, scaling)) for rule in rules for scaling in scalings]
        for rule, scaling in runs:
            why = pointless(cfg, rule, scaling)
            if why:
                label = rule_label(cfg.pos, rule, scaling, cfg.block_size)
                raise UserError(f"{args.ckpt}: {label}: {why}")
        data_dir, meta = checkpoint_dataset(ckpt, args.ckpt, args.data_dir)
        texts = texts_from(meta, data_dir, args.length, args.texts)
        modes = [measure(model, texts, rule, scaling) for rule, scaling in runs]
        headline = ("R", "R_per_head", "R_shared", "R_shared_per_head")
        for m in modes:
            if not all(math.isfinite(m[k]) for k in headline):
                raise UserError(f"non-finite scores for {args.ckpt} at length {args.length} "
                                f"(float32, {m['label']}): the checkpoint's weights may hold inf "
                                "or NaN (evaluate it with eval_extrapolate.py); "
                                "without BCA, try it (--attention bca)")
        result = {"ckpt": args.ckpt, "pos": cfg.pos, "length": args.length,
                  "block_size": cfg.block_size, "texts": len(texts), "modes": modes}
        print(f"resolution (Eq. 3 on Eq. 11) of {args.ckpt} ({cfg.pos}, "
              f"block_size {cfg.block_size}) at length {args.length}, {len(texts)} validation "
              f"texts; R_shared: distances 0..{cfg.block_size - 1} only, "
              "which causal attention and BCA both see")
        layers = " | ".join(f"layer {i}" for i in range(cfg.n_layer))
        print("| model | R (heads averaged first) | R (per head, averaged) | R_shared | "
              f"R_shared (per head) | {layers} |")
        print("|---" * (5 + cfg.n_layer) + "|")
        for m in modes:
            cells = " | ".join(f"{r:.3f}" for r in m["R_layers"])
            print(f"| {m['label']} | {m['R']:.3f} | {m['R_per_head']:.3f} | {m['R_shared']:.3f} | "
                  f"{m['R_shared_per_head']:.3f} | {cells} |")
    if json_path:
        write_json(json_path, result)
    return result


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--theory", action="store_true", help="Figure 2: g and R(g) for RoPE and xPos")
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--gamma", type=float, default=0.4)
    p.add_argument("--scale_base", type=float, default=512.0)
    p.add_argument("--max_dist", type=int, default=4096)
    p.add_argument("--ckpt")
    p.add_argument("--length", type=int)
    p.add_argument("--texts", type=int, default=8,
                   help="validation texts of --length tokens to average over")
    add_checkpoint_args(p, bca=("on", "off", "both"), bca_default="both", dtype=False,  # float32
                        several=True)
    p.add_argument("--json")
    p.add_argument("--plot", help="--theory: draw g for RoPE and xPos (needs matplotlib)")
    return p.parse_args(argv)


def interrupted():
    return "nothing was written (--json and --plot come at the end); run the command again"


def main(argv=None):
    try:
        return run(parse_args(argv))
    except UserError as e:
        error_exit("resolution.py", e)  # once under torchrun, from rank 0
    except KeyboardInterrupt:
        exit_interrupted("resolution.py", interrupted)


if __name__ == "__main__":
    main()
