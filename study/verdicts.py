"""
The study's verdicts, computed: a table of (claim, measure, comparison, predicate, sentence),
each row's predicate computed from the committed results (results/*/summary.json and raw/) and
its sentence written from the predicate alone, so that a qualifier ("in every seed", "in k of n
seeds", "distinguishable from 0", "the only", "nothing") cannot say more than the numbers. The
pages carry each sentence between markers,

    <!-- verdict: <key> -->the sentence<!-- /verdict -->

and tests/study/test_verdicts.py fails where a page's sentence is not its row's (whitespace
aside), or where a page states a qualifier outside the markers.

    python study/verdicts.py           # results/verdicts.md and .json, and the pages' sentences
    python study/verdicts.py --check   # nothing written: exit 1 naming what is stale

The qualifiers: "in every seed" is k == n of the seeds compared (at least two); "distinguishable
from 0" is a 95% t interval over seeds (report.t_interval) that excludes 0, and a difference whose
interval holds 0 is stated as such, not as a difference; "the only"/"the one" is exactly one row
satisfying; "nothing"/"none" is no cell above chance (or 0) with an interval excluding it. A
single checkpoint has no interval over seeds: its counts of answers get a Wilson interval, and the
sentence says "one checkpoint".
"""

import argparse
import json
import math
import re
import sys
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import NormalDist

if __name__ == "__main__":  # run as a script: the repository's modules
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from lexgpt.retrieval_tasks import CHANCE  # noqa: E402
from study.jobs import SUITE_SCHEMES, read_result  # noqa: E402
from study.report import t_interval  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/results.md", "docs/retrieval.md")
MARK = re.compile(r"<!-- verdict: ([\w-]+) -->(.*?)<!-- /verdict -->", re.S)
WIDTH = 118  # the pages' prose
# The sweep's results: the task suite's rope, xpos and xpos_4layer, as they are trained again with
# the suite's recipe and seeds (docs/results.md, "Where the rules act"), as the models the suite's
# own tables measured were not kept
SWEEP_SUITE = "retrieval_rerun"
# YaRN's ramp bounds when results/extension was run (alternatives.py then): LLaMA's, not tuned
# for this head dimension and length; a summary that records its own ("yarn": {"alpha": ...,
# "beta": ...}) is read instead
YARN_AT_THE_TIME = {"alpha": 1, "beta": 32}
# The rows of a control fine-tuned at l with the fine-tune's tokens (claim 13), by prefix
CONTROL_AT_L = ("fine-tuned at l (control): ",)


@dataclass
class Verdict:
    key: str
    claim: str  # where it stands in docs/results.md
    measure: str
    comparison: str
    predicate: str  # the computed predicate, with its numbers
    sentence: str  # the page's words, written from the predicate

    def __post_init__(self):  # the tasks as the pages name them
        self.sentence = re.sub(r"\bflipflop\b", "flip-flop",
                               re.sub(r"\bmqar\b", "MQAR", self.sentence))


# ------------------------------------------------------------------------------------------
# Words from numbers


def minus(text):
    return text.replace("-", "−")


def num(x, digits=2, sign=False):
    return minus(f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}")


def interval_text(iv, digits=2):
    if iv is None:
        return "(one seed: no interval)"
    return "[" + ", ".join(num(v, digits) for v in iv) + "]"


def excludes(iv, at=0.0):
    """+1 where the interval lies above `at`, -1 below, 0 where it holds it (or is None)."""
    if iv is None:
        return 0
    return 1 if iv[0] > at else -1 if iv[1] < at else 0


def against_zero(iv):
    return {1: "above 0", -1: "below 0", 0: "holds 0"}[excludes(iv)]


def seeds_text(k, n):
    """The qualifier of k seeds out of n: counted, never rounded up."""
    if n == 1:
        return "in its one seed" if k else "not in its one seed"
    if k == n:
        return "in every seed"
    return "in no seed" if k == 0 else f"in {k} of {n} seeds"


def names_text(names):
    names = list(names)
    if len(names) <= 1:
        return "".join(names)
    return ", ".join(names[:-1]) + " and " + names[-1]


def wilson(right, n, z=NormalDist().inv_cdf(0.975)):
    """The 95% Wilson interval of a proportion right / n (one checkpoint's answers)."""
    p = right / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [centre - half, centre + half]


def binomial_tail(right, n, p):
    """P(X >= right) for X ~ Binomial(n, p): how often guessing at chance p scores right of n
    or more (exact, summed in log space)."""
    if right <= 0:
        return 1.0
    if p >= 1:
        return 1.0
    logs = [math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
            + k * math.log(p) + (n - k) * math.log1p(-p) for k in range(int(right), n + 1)]
    top = max(logs)
    return min(1.0, math.exp(top) * sum(math.exp(x - top) for x in logs))


def seed_values(cell):
    """Each seed's value of a summary cell, or None where some seed has none."""
    if not cell or cell["n"] != cell["of"] or not cell.get("values"):
        return None
    return cell["values"]


def paired(a, b):
    """Seed by seed a - b of two cells measured on the same seeds (None unless both complete)."""
    va, vb = seed_values(a), seed_values(b)
    if va is None or vb is None or len(va) != len(vb):
        return None
    return [x - y for x, y in zip(va, vb)]


def k_of(diffs, sign=1):
    return sum(1 for d in diffs if d * sign > 0)


# ------------------------------------------------------------------------------------------
# The committed results


class Results:
    """The summaries (and, where a verdict needs a count the summary pools, the raw rows) of
    results/<suite>/, read once."""

    def __init__(self, root=ROOT):
        self.root = Path(root)
        self.char = self.summary("char")
        self.suite = self.summary("retrieval")
        self.extension = self.summary("extension")
        self.control = self.summary("control")
        self.rerun = self.summary(SWEEP_SUITE)

    def summary(self, suite):
        path = self.root / "results" / suite / "summary.json"
        return json.loads(path.read_text()) if path.exists() else None

    def raw(self, suite, pattern):
        """[(file name, result)] of results/<suite>/raw/<pattern>, sorted."""
        return [(p.name, read_result(p))
                for p in sorted((self.root / "results" / suite / "raw").glob(pattern))]

    def timings(self, suite):
        path = self.root / "results" / suite / "timings.json"
        return json.loads(path.read_text()) if path.exists() else {}


def three_seed_schemes(results):
    """The study's schemes with more than one seed (their plain row at l has n > 1)."""
    l = str(results.char["recipe"]["block_size"])
    return [name for name, row in results.char["perplexity"].items()
            if " " not in name and row.get(l) and row[l]["n"] > 1]


# ------------------------------------------------------------------------------------------
# The study: seeds, the context probe, resolution, interpolation


def seed_counts(results):
    l = str(results.char["recipe"]["block_size"])
    plain = {n: r[l]["n"] for n, r in results.char["perplexity"].items()
             if " " not in n and r.get(l)}
    counts = sorted(set(plain.values()), reverse=True)
    many = [n for n in plain if plain[n] == counts[0]]
    words = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five"}
    sentence = f"{words.get(counts[0], counts[0])} seeds for {names_text(many)}"
    if len(counts) > 1:
        sentence += ", " + ("one for the rest" if counts[1:] == [1] else "fewer for the rest")
    return Verdict("seed-counts", "setting", "checkpoints per scheme in results/char",
                   "seeds of each scheme's plain row at l",
                   "; ".join(f"{n}: {k}" for n, k in plain.items()), sentence)


def context_cells(results, names):
    """{row: {column: (mean, t interval, values)}} of the context probe, for the gain over
    l .. T and by bin."""
    out = {}
    for name in names:
        row = results.char["context"].get(name, {})
        for column, cell in row.items():
            if column.startswith("gain") and isinstance(cell, dict) and cell.get("values"):
                out.setdefault(name, {})[column] = (cell["mean"], t_interval(cell["values"]),
                                                    cell["values"])
    return out


def bca_rows(results):
    return [f"{s} + BCA" for s in three_seed_schemes(results)
            if f"{s} + BCA" in results.char.get("context", {})]


def context_bca(results):
    """Item 4/5: is the gain from context beyond l under BCA distinguishable from 0?"""
    rows = bca_rows(results)
    cells = context_cells(results, rows)
    whole = {n: cells[n]["gain"] for n in rows}
    above = [n for n, (_, iv, _) in whole.items() if excludes(iv) > 0]
    below = [n for n, (_, iv, _) in whole.items() if excludes(iv) < 0]
    falls = {n: results.char["context"][n]["fall"]["mean"] for n in rows}
    detail = ", ".join(f"{n} {num(m, 4)} {interval_text(iv, 4)} of {num(falls[n], 4)}"
                       for n, (m, iv, _) in whole.items())
    if not above and not below:
        head = ("Under BCA the gain from context beyond l, over l .. 16l, is not "
                "distinguishable from 0 in any three-seed scheme")
    else:
        head = ("Under BCA the gain from context beyond l, over l .. 16l, is above 0 for "
                f"{names_text(above) or 'no row'}" + (f" and below 0 for {names_text(below)}"
                                                      if below else ""))
    sentence = (f"**{head}**: {detail} (nats a token, the gain with its 95% t interval over "
                "seeds, of the lex fall from l to 16l).")
    predicate = (f"rows whose t interval excludes 0: above {above or 'none'}, below "
                 f"{below or 'none'}, of {rows}")
    return Verdict("context-bca", "the context probe", "gain from context beyond l, l .. 16l, "
                   "64 spans, 3 seeds", "each three-seed BCA row against 0", predicate, sentence)


def context_bins(results):
    """Item 4: the bins of the BCA rows whose gain is distinguishable from 0, and whether the
    scale_base 512 row is "the one exception"."""
    rows = bca_rows(results)
    cells = context_cells(results, rows)
    bins = [(n, c, m, iv) for n in rows for c, (m, iv, _) in cells[n].items()
            if c != "gain" and excludes(iv) > 0]
    whole_above = [n for n in rows if excludes(cells[n]["gain"][1]) > 0]
    target = "xpos_sb512 + BCA"
    m, iv, values = cells[target]["gain"]
    k = sum(v > 0 for v in values)
    diffs = {}
    for other in rows:
        if other != target:
            d = paired(results.char["context"][target]["gain"],
                       results.char["context"][other]["gain"])
            diffs[other] = (sum(d) / len(d), t_interval(d))
    if len(whole_above) == 1:
        head = f"{whole_above[0]} is the one BCA row whose gain is distinguishable from 0"
    else:
        head = (f"{target} is not an exception: its gain is {num(m, 4)}, positive "
                f"{seeds_text(k, len(values))}, but its t interval {interval_text(iv, 4)} holds "
                "0")
    against = "seed by seed, its gain minus " + ", minus ".join(
        f"{o}'s is {num(dm, 4)} {interval_text(div, 4)}" for o, (dm, div) in diffs.items())
    signs = {against_zero(div) for _, div in diffs.values()}
    against += (f": each interval {signs.pop()}" if len(signs) == 1 else ": " + ", ".join(
        f"{o} {against_zero(div)}" for o, (_, div) in diffs.items()))
    if bins:
        by_bin = ("By bin, the gain is above 0 with an interval excluding 0 for "
                  + names_text(f"{n} at {c[5:]} ({num(bm, 4)} {interval_text(biv, 4)})"
                               for n, c, bm, biv in bins)
                  + ", and for no other BCA bin.")
    else:
        by_bin = "No BCA bin's gain is above 0 with an interval excluding 0."
    sentence = f"**{head}**: {against}. {by_bin}"
    predicate = (f"BCA rows above 0 over l .. T: {whole_above or 'none'}; bins above 0: "
                 f"{[(n, c) for n, c, _, _ in bins] or 'none'}; {target} positive in {k} of "
                 f"{len(values)} seeds")
    return Verdict("context-bins", "the context probe", "gain from context beyond l, over "
                   "l .. 16l and by bin, 3 seeds", "the BCA rows against 0 and against each "
                   "other, seed by seed", predicate, sentence)


def context_windows(results):
    names = [f"{s}{r}" for s in three_seed_schemes(results)
             for r in (" + sliding W=128", " + sinks S=4 W=128")]
    cells = context_cells(results, [n for n in names if n in results.char["context"]])
    means = {n: c["gain"][0] for n, c in cells.items()}
    bound = math.ceil(max(abs(m) for m in means.values()) * 1e4) / 1e4
    above = [(n, c) for n, row in cells.items() for c, (_, iv, _) in row.items()
             if excludes(iv) > 0]
    tail = ("none is above 0 with an interval excluding it, over l .. 16l or in any bin"
            if not above else "above 0 with an interval excluding it: "
            + names_text(f"{n} {c}" for n, c in above))
    sentence = (f"Every sliding-window and sinks row of the three-seed schemes is within "
                f"{num(bound, 4)} nats of 0 over l .. 16l; {tail}.")
    return Verdict("context-windows", "the context probe", "gain from context beyond l, 3 "
                   "seeds", "each window and sinks row of the three-seed schemes against 0",
                   f"max |mean| {bound}; cells above 0: {above or 'none'}", sentence)


def context_alibi(results):
    cells = context_cells(results, ["alibi", "alibi + BCA"])
    parts, signs = [], []
    for name, how in (("alibi", "causal"), ("alibi + BCA", "with BCA")):
        m, iv, _ = cells[name]["gain"]
        sd = results.char["context"][name]["gain"]["std"]
        parts.append(f"{num(m, 4)} ± {num(sd, 4)} nats {how} ({interval_text(iv, 4)})")
        signs.append(excludes(iv))
    if not any(signs):
        head = "ALiBi's gain from context beyond l is not distinguishable from 0, causal or " \
               "with BCA"
    else:
        head = "ALiBi's gain from context beyond l is " + " and ".join(
            f"{against_zero(cells[n]['gain'][1])} {h}"
            for n, h in (("alibi", "causal"), ("alibi + BCA", "with BCA")))
    return Verdict("context-alibi", "the context probe", "gain from context beyond l, 3 seeds",
                   "alibi and alibi + BCA against 0", f"t intervals exclude 0: {signs}",
                   f"**{head}**: {parts[0]}, {parts[1]}.")


def context_control(results):
    """Item 5: has the probe been shown able to see a gain where one exists? results/control
    (a model trained at 4l under causal attention, its "long: ..." rows); until then the only
    candidates are the fine-tunes at 4l, inside their own training length."""
    control = (results.control or {}).get("table", {})
    long_rows = {n: r for n, r in control.items() if n.split(": ")[0].startswith("long")}
    if long_rows:
        ivs = {n: r["gain interval"] for n, r in long_rows.items()}
        seen = [n for n, iv in ivs.items() if excludes(iv) > 0]
        trained = " and ".join(f"{n} (trained at {'8' if n.startswith('long8') else '4'}l) "
                               f"{num(r['gain']['mean'], 4)} {interval_text(ivs[n], 4)}"
                               for n, r in long_rows.items())
        bca = {n: r for n, r in control.items() if n.endswith(" + BCA")}
        against = "; ".join(
            f"{n} {num(r['gain']['mean'], 4)} {interval_text(r['gain interval'], 4)} "
            f"({against_zero(r['gain interval'])})"
            + (f", relay alone (against BCA's direct window) {num(r['matched gain']['mean'], 4)} "
               f"{interval_text(r['matched gain interval'], 4)} "
               f"({against_zero(r['matched gain interval'])})" if r.get("matched gain") else "")
            for n, r in bca.items())
        corpus = results.control.get("corpus", "the control corpus")
        l = (results.control.get("recipe") or {}).get("block_size", "l")
        if seen:
            sentence = (f"**The probe sees a gain where one exists**: on {corpus} at l = {l}, "
                        f"the models trained longer, under causal attention, gain from context "
                        f"beyond l (nats, t intervals over seeds): {trained}, above 0 for "
                        f"{names_text(seen)}. Against it, trained at l, past l: "
                        f"{against or 'no BCA row yet'}.")
        else:
            signs = names_text([f"{n} {against_zero(iv)}" for n, iv in ivs.items()])
            sentence = (f"**The probe has not been shown able to see a gain at this scale**: on "
                        f"{corpus} at l = {l} the models trained longer gain {trained} nats from "
                        f"context beyond l (t intervals over seeds: {signs}).")
        predicate = f"controls above 0: {seen or 'none'} of {list(ivs)}"
    else:
        found = []
        l = results.extension["recipe"]["block_size"] if results.extension else 128
        for _, result in results.raw("extension", "*.context.json"):
            by_label = {}
            for row in result["rows"]:
                if "/extension/" not in str(row["ckpt"]) or row["attention"] != "causal":
                    continue
                for b in row["by_bin"]:
                    if b["end"] <= 4 * l:  # inside the fine-tune's own length
                        key = (row["label"], f"{b['start']}..{b['end']}")
                        by_label.setdefault(key, []).append(b["gain"])
            for (label, span), gains in by_label.items():
                found.append((label.split(" s=")[0], span, sum(gains) / len(gains),
                              t_interval(gains)))
        seen = any(excludes(iv) > 0 for *_, iv in found)
        spans = list(dict.fromkeys(span for _, span, _, _ in found))
        by_model = {}
        for label, _, m, iv in found:
            by_model.setdefault(label, []).append(f"{num(m, 4)} {interval_text(iv, 4)}")
        listed = (", ".join(f"{label} " + " and ".join(v) for label, v in by_model.items())
                  + f" in the bins {names_text(spans)}")
        if seen:
            sentence = ("**Only the fine-tunes at 4l can serve as a control, inside their own "
                        f"length**: {listed}.")
        else:
            sentence = ("**The probe has not been shown able to see a gain at this scale**: no "
                        "model gains from context beyond l with an interval excluding 0, even "
                        "where it was trained to use it: the fine-tunes at 4l, inside their own "
                        f"4l, gain (nats) {listed}. So \"context beyond l is not used under BCA\" "
                        "cannot be told from \"the probe cannot see its use here\".")
        predicate = f"no control run; fine-tune bins inside 4l above 0: {seen}"
    return Verdict("context-control", "the context probe", "gain from context beyond l where a "
                   "model was trained to use it", "a positive control's t interval against 0",
                   predicate, sentence)


def context_readme(results):
    """The README's short form of the three above."""
    rows = bca_rows(results)
    cells = context_cells(results, rows)
    signs = [excludes(cells[n]["gain"][1]) for n in rows]
    bins = [n for n in rows for c, (_, iv, _) in cells[n].items()
            if c != "gain" and excludes(iv) > 0]
    control = context_control(results)
    seen = control.sentence.startswith("**The probe sees")
    means = ", ".join(num(cells[n]["gain"][0], 4) for n in rows)
    short = [s.split(" + ")[0] for s in rows]
    if not any(signs):
        text = (f"the context probe finds no gain from context beyond l distinguishable from 0 "
                f"over l .. 16l in any three-seed BCA row ({names_text(short)}: {means} nats, "
                "each t interval over seeds holding 0)")
    else:
        text = (f"the context probe's gain from context beyond l over l .. 16l is ({means} nats "
                f"for {names_text(short)}) distinguishable from 0 in "
                f"{sum(s != 0 for s in signs)} of {len(rows)} BCA rows")
    if bins:
        text += f", though {len(bins)} of their bins are above 0 with an interval excluding it"
    if seen:
        table = results.control["table"]
        best = max((n for n in table if n.split(": ")[0].startswith("long")),
                   key=lambda n: table[n]["gain"]["mean"])
        bca = [n for n in table if n.endswith(" + BCA")]
        text += (f"; a positive control shows the probe can see such a gain: on "
                 f"{results.control.get('corpus', 'the control corpus')} a model trained "
                 f"longer ({best}) gains {num(table[best]['gain']['mean'], 4)} "
                 f"{interval_text(table[best]['gain interval'], 4)} nats from context beyond l")
        if bca:
            text += ", where trained at l and past l under BCA " + ", ".join(
                f"{n.split(': ')[1]} gains {num(table[n]['gain']['mean'], 4)} "
                f"{interval_text(table[n]['gain interval'], 4)}"
                + (f" (relay alone, over BCA's direct window, "
                   f"{num(table[n]['matched gain']['mean'], 4)} "
                   f"{interval_text(table[n]['matched gain interval'], 4)})"
                   if table[n].get("matched gain") else "") for n in bca)
    else:
        text += ("; and no positive control has shown that the probe could see such a gain at "
                 "this scale, so whether context beyond l is used stays open")
    return Verdict("context-readme", "the context probe", "gain from context beyond l, "
                   "3 seeds", "the BCA rows against 0, and the control", control.predicate,
                   text + ".")


def resolution_shared(results):
    res = results.char["resolution"]
    worst = {}
    for s in three_seed_schemes(results):
        if f"{s} + BCA" in res and res[s].get("R_shared at 2l"):
            d = paired(res[s]["R_shared at 2l"], res[f"{s} + BCA"]["R_shared at 2l"])
            if d:
                worst[s] = max(abs(x) for x in d)
    bound = math.ceil(max(worst.values()) * 1e4) / 1e4
    sentence = (f"At 2l R_shared with and without BCA differ by at most {num(bound, 4)} in any "
                f"seed of {names_text(worst)}")
    return Verdict("resolution-shared", "claim 8", "R_shared at 2l, 3 seeds",
                   "each scheme with and without BCA, seed by seed",
                   f"max |difference| {worst}", sentence)


INTERPOLATIONS = ("yarn", "ntk", "dynamic_ntk", "pi")


def interpolation_ppl(results):
    """Claim 10: perplexity at 16l of each interpolation against the plain model on the same
    spans, seed by seed."""
    ppl, top = results.char["perplexity"], str(results.char["lengths"][-1])
    parts, predicate = [], {}
    for s in ("rope", "xpos", "xpos_sb512"):
        plain = ppl.get(f"{s} ({results.char['recipe'].get('scaled_spans', 16)} spans)") \
            or next((r for n, r in ppl.items() if n.startswith(f"{s} (") and "spans" in n), None)
        if not plain:
            continue
        vals = {m: seed_values(ppl.get(f"{s} + {m}", {}).get(top)) for m in INTERPOLATIONS}
        base = seed_values(plain.get(top))
        helps = {m: sum(v < b for v, b in zip(vals[m], base)) for m in INTERPOLATIONS if vals[m]}
        n = len(base)
        predicate[s] = helps
        # the order of the methods below the plain model, seed by seed
        order = sorted([m for m in helps if helps[m] == n], key=lambda m: sum(vals[m]))
        ordered = sum(all(vals[a][i] < vals[b][i] for a, b in zip(order, order[1:]))
                      and all(vals[order[-1]][i] < base[i] for _ in [0]) for i in range(n)) \
            if len(order) > 1 else None
        words = {"yarn": "YaRN", "ntk": "NTK", "dynamic_ntk": "dynamic NTK", "pi": "PI"}
        clauses = []
        if ordered is not None:
            clauses.append(" < ".join(words[m] for m in order) + " < plain "
                           + seeds_text(ordered, n))
        groups = {}
        for m in INTERPOLATIONS:
            if m in helps and not (ordered is not None and m in order):
                verb = "help" if helps[m] * 2 > n else "hurt"
                k = helps[m] if verb == "help" else n - helps[m]
                groups.setdefault((verb, seeds_text(k, n)), []).append(words[m])
        for (verb, q), ms in groups.items():
            clauses.append(f"{names_text(ms)} {verb + 's' * (len(ms) == 1)} {q}")
        parts.append(f"on {s} " + ", ".join(clauses))
    sentence = "At 16l, paired with the plain model on the same spans: " + "; ".join(parts)
    return Verdict("interpolation-ppl", "claim 10", "perplexity at 16l, 16 spans, 3 seeds",
                   "each interpolation against the plain model, seed by seed",
                   f"seeds where the interpolation is below plain: {predicate}", sentence)


# ------------------------------------------------------------------------------------------
# The task suite


def accuracy_past(results, name, task, beyond):
    """Each seed's mean accuracy over the distance grid past `beyond` (None if incomplete)."""
    row = results.suite["accuracy"].get(name, {})
    cells = [seed_values(v) for k, v in row.items()
             if k.startswith(f"{task} distance ") and int(k.split()[-1]) > beyond]
    if not cells or any(c is None for c in cells):
        return None
    return [sum(c[i] for c in cells) / len(cells) for i in range(len(cells[0]))]


def sweep_rows(results):
    """{(scheme, checkpoint): [rows]} of results/retrieval_rerun/raw/<run>.sweep.json, one
    file per checkpoint (the rerun was swept that way from its start)."""
    out = {}
    for name, result in results.raw(SWEEP_SUITE, "*.sweep.json"):
        scheme = name.split(".")[0].rpartition("_s")[0]
        for row in result["rows"]:
            out.setdefault((scheme, row["ckpt"]), []).append(row)
    return out


def seed_of(ckpt):
    """A run's seed from its directory's name (<scheme>_s<seed>/ckpt.pt)."""
    return Path(ckpt).parent.name.rpartition("_s")[2]


def sweep_provenance(results):
    """Item 2: which checkpoints the sweep measured, of the seeds the suite trains, and whether
    any is a model the suite's tables measured (by its checkpoint's path in their raw rows)."""
    planned = {name: n for name, _, n in SUITE_SCHEMES}
    seeds, swept = {}, sweep_rows(results)
    for scheme, ckpt in swept:
        seeds.setdefault(scheme, []).append(seed_of(ckpt))
    suite = {r["ckpt"] for _, res in results.raw("retrieval", "*.tasks.json") for r in res["rows"]}
    own = [c for _, c in swept if c in suite]
    parts = [f"{scheme} seed{'s' * (len(found) > 1)} {names_text(sorted(found))} (of "
             f"{planned.get(scheme, '?')})" for scheme, found in seeds.items()]
    machine = (results.rerun or {}).get("machine", "another machine")
    whose = ("the models the suite's tables measured" if own and len(own) == len(swept) else
             f"{len(own)} of them models the suite's tables measured" if own else
             "none of them a model the suite's tables measured")
    complete = all(len(found) == planned.get(scheme) for scheme, found in seeds.items())
    sentence = (f"Measured{'' if complete and seeds else ' so far'}, on models trained with "
                f"the suite's recipe and seeds on "
                f"{machine} (results/retrieval_rerun; {whose}): "
                + ("; ".join(parts) if parts else "nothing") + ".")
    return Verdict("sweep-provenance", "claim 9", "the sweep's checkpoints",
                   "each swept scheme's seeds against those the suite trains",
                   f"{ {s: sorted(f) for s, f in seeds.items()} } of {planned}; the suite's "
                   f"own: {own}", sentence)


def relay_cells(results):
    """{scheme: {checkpoint: {task: [(d, right, scored, chance)]}}} of BCA's relay zone in the
    sweep; a passkey's zone is its worst digit's, so its chance is that of guessing one digit
    (at most)."""
    cells = {}
    for (scheme, ckpt), rows in sweep_rows(results).items():
        for row in rows:
            right, scored = row["zones"]["relay"]
            if row["attention"] != "bca" or not scored:
                continue
            chance = 0.1 if row["task"].startswith("passkey") else CHANCE[row["task"]]
            by_task = cells.setdefault(scheme, {}).setdefault(ckpt, {})
            by_task.setdefault(row["task"], []).append((row["d"], right, scored, chance))
    order = [name for name, _, _ in SUITE_SCHEMES]  # the suite's order, not the files'
    return dict(sorted(cells.items(), key=lambda item: (
        order.index(item[0]) if item[0] in order else len(order), item[0])))


def relay_facts(by_ckpt, l):
    """One scheme's relay: {task: (distances above chance, distances, [(accuracy, sign against
    chance) over d <= l, over d > l], chance, (checkpoints above chance over d <= l,
    checkpoints))}. Each distance's answers, pooled over the checkpoints, against chance by an
    exact binomial test at 2.5%, Bonferroni over the distances tested (so that the farthest
    distance above chance is not one of many chances, and a distance with a handful of relay
    answers is not above chance by one); the zones pooled, by a Wilson interval for one
    checkpoint, a t interval over seeds of each seed's for several; and each checkpoint's own
    answers over d <= l by the exact test, Bonferroni over checkpoints and tasks (pooled
    answers can be above chance from some seeds alone)."""
    tasks = {}
    for by_task in by_ckpt.values():
        for task, found in by_task.items():
            tasks.setdefault(task, []).append(found)
    tested = sum(len({d for found in runs for d, *_ in found}) for runs in tasks.values())
    alpha = 0.025 / max(1, tested)
    facts = {}
    for task, runs in tasks.items():
        chance = runs[0][0][3]
        by_d = {}
        for found in runs:
            for d, right, n, _ in found:
                by_d[d] = [a + b for a, b in zip(by_d.get(d, [0, 0]), (right, n))]
        above = sorted(d for d, (right, n) in by_d.items()
                       if n and binomial_tail(right, n, chance) < alpha)
        pooled = []
        for near in (True, False):
            per_run = [[(r, n) for d, r, n, _ in found if (d <= l) == near] for found in runs]
            per_run = [(sum(r for r, _ in x), sum(n for _, n in x)) for x in per_run if x]
            if not per_run:
                pooled.append(None)
                continue
            right, n = sum(r for r, _ in per_run), sum(n for _, n in per_run)
            iv = (wilson(right, n) if len(per_run) == 1
                  else t_interval([r / m for r, m in per_run if m]))
            pooled.append((right / n, excludes(iv, chance)))
        own = [(sum(r for d, r, n, _ in found if d <= l), sum(n for d, r, n, _ in found if d <= l))
               for found in runs]
        own_alpha = 0.025 / max(1, len(runs) * len(tasks))
        seeds = (sum(1 for r, n in own if n and binomial_tail(r, n, chance) < own_alpha),
                 len(runs))
        facts[task] = (above, len(by_d), pooled, chance, seeds)
    return facts


def reach_text(bound):
    """BCA's reach bound, n_layer * l/2 + the query's phase in its segment: a range."""
    return f" (BCA's reach bound: {bound[0]} to {bound[1]} tokens, with the phase)"


def sweep_relay(results, short=False):
    """Item 1: does anything relay through the layers under BCA? Per swept scheme: the
    distances whose relay answers are above chance, and the relay zone pooled over d <= l and
    d > l (relay_facts)."""
    l = (results.rerun or results.suite)["recipe"]["block_size"]
    key = "sweep-relay" + "-short" * short
    measure, comparison = ("sweep accuracy in BCA's relay zone, by distance and pooled",
                           "relay answers against chance")
    words = {1: "above chance", 0: "not told from chance", -1: "below chance"}
    texts, predicates = [], []
    cells = relay_cells(results)
    bound = {}  # the reach bound's range over the phases, of each scheme's BCA rows
    for (scheme, _), rows in sweep_rows(results).items():
        for row in rows:
            if row["attention"] == "bca":
                least, most = bound.get(scheme, (row["reach_bound"], row["reach_bound_max"]))
                bound[scheme] = (min(least, row["reach_bound"]),
                                 max(most, row["reach_bound_max"]))
    for scheme, by_ckpt in cells.items():
        facts = relay_facts(by_ckpt, l)
        n = len(by_ckpt)
        who = ("in the sweep's one checkpoint" if n == 1 and len(cells) == 1 else
               f"in the sweep's one {scheme} checkpoint" if n == 1 else
               f"in the sweep's {n} {scheme} checkpoints")
        pooled_who = who.replace("in the sweep's", "in the pooled answers of the sweep's")
        how = ("an exact binomial test of its answers against chance, Bonferroni over the "
               "distances: one checkpoint has no interval over seeds" if n == 1 else "an exact "
               "binomial test of the seeds' answers, Bonferroni over the distances; pooled, a t "
               "interval over seeds")
        above_any = [d for above, *_ in facts.values() for d in above]
        predicates.append(f"{scheme} ({n}): " + "; ".join(
            f"{t}: above chance at d = {a or 'none'}, pooled d <= l {p[0]}, d > l {p[1]}"
            + f", checkpoints above chance over d <= l {k} of {m}"
            for t, (a, _, p, _, (k, m)) in facts.items()))
        if not above_any:
            texts.append(f"nothing relays through the layers {who}: no relay cell is above "
                         "chance")
            continue
        farthest = max(above_any)
        main = [t for t in facts if facts[t][0]]

        def zone_word(sign, task):
            # a passkey's chance is only bounded (one relayed digit): never at or below it
            word = ("above the bound on chance" if sign == 1 else "not above the bound on "
                    "chance") if task.startswith("passkey") else words[sign]
            return word if n == 1 else word + " by the t interval over seeds"

        def pooled_text(task):
            (near, sign), far, chance = facts[task][2][0], facts[task][2][1], facts[task][3]
            k, m = facts[task][4]
            text = f"{task} {num(near, 3)} over d ≤ {l} ({zone_word(sign, task)}"
            text += f"; above it {seeds_text(k, m)} by its own answers)" if m > 1 else ")"
            if far:
                text += f" and {num(far[0], 3)} past it ({zone_word(far[1], task)})"
            bound = "at most " if task.startswith("passkey") else ""
            return text + f", against a chance of {bound}{num(chance, 3)}"

        if short:
            near = ", ".join(f"{t} {num(facts[t][2][0][0], 3)} against a chance of "
                             f"{'at most ' * t.startswith('passkey')}{num(facts[t][3], 3)}"
                             + (f", above it {seeds_text(*facts[t][4])} by its own answers"
                                if facts[t][4][1] > 1
                                else f", {zone_word(facts[t][2][0][1], t)}")
                             for t in main)
            past = {facts[t][2][1][1] for t in main if facts[t][2][1]}
            past_above = [t for t in main if facts[t][2][1] and facts[t][2][1][1] == 1]
            texts.append(f"relay through the layers is above chance "
                         f"{pooled_who if n > 1 else who} up to d = "
                         f"{farthest} (pooled over d ≤ {l}: {near}), "
                         + ("not above chance past it" if past <= {0, -1} else "above chance "
                            f"past it on {names_text(past_above)}"))
        else:
            counted = ", ".join(f"{task} at {len(above)} of {m} distances"
                                + (f" (the farthest {max(above)})" if above else "")
                                for task, (above, m, *_) in facts.items())
            caveat = ""
            if "passkey" in facts and not facts["passkey"][0]:
                caveat = (" The passkey's relay answers are not above the one in ten of "
                          "guessing a relayed digit (its zone is its worst digit's).")
            texts.append(f"Under BCA, relay answers (only a path through two layers or more "
                         f"reaches their source) are above chance "
                         f"{pooled_who if n > 1 else who} ({how}) at {counted}, "
                         f"the farthest at d = {farthest} (d: the instance's distance; each "
                         "answer's zone is by its own source). Pooled: "
                         f"{'; '.join(pooled_text(t) for t in facts)}.{caveat} So something "
                         f"relays through the layers, up to d = {farthest}"
                         f"{reach_text(bound[scheme])}.")
    if short and texts:  # the reach bound once, where every scheme shares it
        bounds = {bound[scheme] for scheme in cells if scheme in bound}
        texts = ([*texts[:-1], texts[-1] + reach_text(bounds.pop())] if len(bounds) == 1
                 else [t + reach_text(bound[s]) for t, s in zip(texts, cells)])
    sentence = (" " if not short else "; ").join(texts) or "the sweep has measured nothing yet"
    return Verdict(key, "claim 9", measure, comparison, " | ".join(predicates), sentence)


def sweep_zones(results):
    """The sweep's accuracy by zone, pooled over its distances, seed-mean, per scheme: under
    BCA each zone; under a sliding window and sinks the range of direct and the most relay."""
    sweep = (results.rerun or {}).get("sweep") or {}
    parts = []
    schemes = dict.fromkeys(name.split(" + ")[0] for name in sweep)
    for scheme in schemes:
        bca = sweep.get(f"{scheme} + BCA")
        if not bca:
            continue
        n = next((v["n"] for v in bca.values() if isinstance(v, dict) and v.get("n")), 0)
        tasks = dict.fromkeys(k.split()[0] for k in bca if k.endswith(" direct"))
        zones = "; ".join(
            f"{t} " + ", ".join(f"{num(bca[f'{t} {z}']['mean'])} {z}"
                                 for z in ("direct", "relay", "beyond") if bca.get(f"{t} {z}"))
            for t in tasks)
        windows = [row for name, row in sweep.items()
                   if name.startswith(f"{scheme} + ") and name != f"{scheme} + BCA"]
        ranges = []
        for t in tasks:
            direct = [row[f"{t} direct"]["mean"] for row in windows if row.get(f"{t} direct")]
            relay = [row[f"{t} relay"]["mean"] for row in windows if row.get(f"{t} relay")]
            if direct and relay:
                span = (num(min(direct)) if num(min(direct)) == num(max(direct))
                        else f"{num(min(direct))} to {num(max(direct))}")
                ranges.append(f"{t} {span} direct, {num(max(relay))} relay or less")
        text = f"{scheme} ({'one seed' if n == 1 else f'{n} seeds'}): under BCA {zones}"
        if ranges:
            text += "; under a sliding window and sinks " + "; ".join(ranges)
        parts.append(text)
    sentence = ("Pooled over the sweep's distances, seed-mean: " + ". ".join(parts) if parts
                else "the sweep has measured nothing yet")
    return Verdict("sweep-zones", "claim 9", "sweep accuracy by zone, pooled over distances",
                   "each rule's zones", " | ".join(parts), sentence)


def sweep_depth(results):
    """Item 2's question: does relay grow with depth? xpos_4layer against xpos. Four layers
    have one seed, and two layers' relay varies more between seeds than one checkpoint's
    answers do, so the strength of relay (the relay zone pooled over d <= l) is placed against
    two layers' range over all their seeds (above, inside or below it); and its reach, each
    task's farthest distance whose relay answers are above chance (relay_facts), is compared
    with two layers' checkpoint of the same seed (one checkpoint each), more than one step of
    the distance grid apart counting as further or less far. Past l the two depths' relay
    zones hold different phases (two layers' ends at its reach bound), so reach is a one-pair
    reading, stated as one."""
    l = (results.rerun or results.suite)["recipe"]["block_size"]
    cells = relay_cells(results)
    if not {"xpos", "xpos_4layer"} <= set(cells):
        return Verdict("sweep-depth", "claim 9", "relay under BCA with 4 layers against 2",
                       "xpos_4layer against xpos", "not both swept",
                       "the sweep has not measured both depths yet")

    def near(by_task, task):
        found = [(r, n) for d, r, n, _ in by_task.get(task, []) if d <= l]
        return sum(r for r, _ in found), sum(n for _, n in found)

    deep = cells["xpos_4layer"]
    seeds = sorted({seed_of(c) for c in deep})
    paired = {c: v for c, v in cells["xpos"].items() if seed_of(c) in seeds}
    if not paired:
        return Verdict("sweep-depth", "claim 9", "relay under BCA with 4 layers against 2",
                       "xpos_4layer against xpos", "no seed swept at both depths",
                       "the sweep has not measured both depths on one seed yet")
    facts4, facts2 = relay_facts(deep, l), relay_facts(paired, l)
    grid = sorted({d for by in (deep, paired) for v in by.values() for found in v.values()
                   for d, *_ in found})
    step = min((b - a for a, b in zip(grid, grid[1:])), default=0)
    strength, reach, where_of, how_of = [], [], {}, {}
    for task in facts4:
        r4, n4 = map(sum, zip(*[near(v, task) for v in deep.values()]))
        spread = [r / n for r, n in (near(v, task) for v in cells["xpos"].values()) if n]
        if n4 and spread:
            lo, hi = min(spread), max(spread)
            where = "above" if r4 / n4 > hi else "below" if r4 / n4 < lo else "inside"
            where_of.setdefault(where, []).append(task)
            strength.append(f"{task} {num(r4 / n4, 3)} against {num(lo, 3)} to {num(hi, 3)}")
        if task.startswith("passkey"):  # its chance is only bounded (by a one-digit guess)
            continue
        a4 = max(facts4[task][0], default=None)
        a2 = max(facts2.get(task, ([],))[0], default=None)
        gap = (a4 or 0) - (a2 or 0)
        how = ("further" if gap > step else "less far" if gap < -step else "as far")
        how_of.setdefault(how, []).append(task)
        reach.append(f"{task} {a4 or 'none'} against {a2 or 'none'}")
    which = f"seed{'s' * (len(seeds) > 1)} {names_text(seeds)}"
    n2 = len(cells["xpos"])
    sentence = (f"With four layers (xpos_4layer, {which}) against two (xpos, {n2} seeds), the "
                f"relay zone under BCA pooled over d ≤ {l} is "
                + ", ".join(f"{w} two layers' range over seeds on {names_text(ts)}"
                            for w, ts in where_of.items())
                + f" ({'; '.join(strength)}); the farthest distance whose relay answers are "
                f"above chance, against two layers' seed {names_text(seeds)} alone, is "
                + ", ".join(f"{h} on {names_text(ts)}" for h, ts in how_of.items())
                + f" ({'; '.join(reach)}; one checkpoint each, within one step of the grid "
                "counted as as far; past l the two depths' relay zones hold different phases; "
                "the passkey left out, its chance only bounded)")
    return Verdict("sweep-depth", "claim 9", "relay under BCA with 4 layers against 2",
                   "xpos_4layer's pooled relay over d <= l against xpos's range over seeds; "
                   "each task's farthest relay above chance against xpos of the same seed",
                   "; ".join(f"{w}: {ts}" for w, ts in where_of.items()) + " | "
                   + "; ".join(f"{h}: {ts}" for h, ts in how_of.items()), sentence)


def area_xpos_rope(results, short=False):
    """Item 3: xPos against RoPE by the area over all distances and by mean accuracy past l."""
    l = results.suite["recipe"]["block_size"]
    area = results.suite["area"]
    diff = area["xpos − rope"]
    by_area, by_past = {}, {}
    for task in results.suite["tasks"]:
        d = diff.get(task)
        if d:
            by_area[task] = (k_of(d["values"]), len(d["values"]), d["mean"], d["interval"])
        a, b = accuracy_past(results, "xpos", task, l), accuracy_past(results, "rope", task, l)
        if a and b:
            dd = [x - y for x, y in zip(a, b)]
            by_past[task] = (k_of(dd), len(dd), sum(dd) / len(dd), t_interval(dd), a, b)

    def grouped(table):
        groups = {}
        for task, (k, n, *_) in table.items():
            groups.setdefault(seeds_text(k, n), []).append(task)
        return ", ".join(f"{q} on {names_text(ts)}" for q, ts in groups.items())

    excl_area = [t for t, (*_, iv) in by_area.items() if excludes(iv) > 0]
    excl_past = [t for t, v in by_past.items() if excludes(v[3]) > 0]
    past_text = grouped({t: v[:2] for t, v in by_past.items()})
    area_text = grouped({t: v[:2] for t, v in by_area.items()})
    if short:
        sentence = (f"by mean accuracy past l, xPos is above RoPE {past_text}; by the area over "
                    f"all distances {area_text}, its t interval over seeds excluding 0 on "
                    f"{names_text(excl_area) or 'no task'}")
        key = "area-xpos-rope-short"
    else:
        worst = [(t, v) for t, v in by_area.items() if v[0] < v[1]]
        seeds = results.suite["seeds"]
        detail = ""
        if worst:
            t, _ = worst[0]
            xa, ra = (seed_values(area[n][t]) for n in ("xpos", "rope"))
            i = next(i for i, (x, r) in enumerate(zip(xa, ra)) if x <= r)
            detail = (f" (on {t} seed {seeds[i]}: {num(xa[i], 4)} against {num(ra[i], 4)})")
        ivs = ", ".join(f"{t} {num(m)} {interval_text(iv)}" for t, (_, _, m, iv) in by_area.items())
        past = ", ".join(f"{t} " + " / ".join(num(x) for x in a) + " against "
                         + " / ".join(num(x) for x in b)
                         for t, (_, _, _, _, a, b) in by_past.items() if t in ("copy", "mqar"))
        sentence = (f"**By mean accuracy past l (d > {l}), xPos is above RoPE {past_text}; by "
                    f"the area over all distances (¼l to 16l) {area_text}.** Past l: "
                    f"{past}. Area minus RoPE's, with its t interval over seeds: {ivs}"
                    f"{detail}: distinguishable from 0 on "
                    f"{names_text(excl_area) or 'no task'} by the area, on "
                    f"{names_text(excl_past) or 'no task'} past l.")
        key = "area-xpos-rope"
    predicate = (f"seeds xpos above rope, by area {({t: v[:2] for t, v in by_area.items()})}; "
                 f"past l {({t: v[:2] for t, v in by_past.items()})}")
    return Verdict(key, "claim 11", "area over all distances; mean accuracy past l",
                   "xpos against rope, seed by seed", predicate, sentence)


def reach_xpos_rope(results):
    """docs/retrieval.md: xPos's decay and the reach (not the area), seed by seed."""
    reach = results.suite["reach"]
    more = same = less = 0
    for task in results.suite["tasks"]:
        x, r = seed_values(reach["xpos"].get(task)), seed_values(reach["rope"].get(task))
        if x and r:
            for a, b in zip(x, r):
                more, same, less = more + (a > b), same + (a == b), less + (a < b)
    total = more + same + less
    sentence = (f"by the reach (the largest distance up to which accuracy stays ≥ 90% of that at "
                f"1 ×), xPos reaches further than RoPE in {more} of the {total} seed and task "
                f"pairs where both retrieve at 1 ×, as far in {same}, less far in "
                f"{less or 'none'}")
    return Verdict("reach-xpos-rope", "claim 11", "retrieval reach", "xpos against rope, seed "
                   "by seed and task by task", f"more {more}, same {same}, less {less}",
                   sentence)


def alibi_rope(results):
    area, reach = results.suite["area"], results.suite["reach"]
    d = area["alibi − rope"]
    parts = []
    for task in ("copy", "mqar"):
        k, n = k_of(d[task]["values"]), len(d[task]["values"])
        parts.append(f"{num(d[task]['mean'])} {interval_text(d[task]['interval'])} on {task} "
                     f"({against_zero(d[task]['interval'])}, {seeds_text(k, n)})")
    farthest = max(v for s in ("rope", "xpos") for t in results.suite["tasks"]
                   for v in (reach[s].get(t) or {}).get("values", []))
    sentence = (f"By the area ALiBi leads RoPE by {parts[0]} and {parts[1]}. RoPE's and xPos's "
                f"reach is at most {farthest} in any seed and task")
    return Verdict("alibi-rope", "claim 11", "area over all distances; reach", "alibi against "
                   "rope, seed by seed", f"{parts}; farthest rope/xpos reach {farthest}",
                   sentence)


def interpolation_retrieval(results, short=False):
    """Item 9 (claim 12): which inference-time methods retrieve past l, paired on the same
    checkpoints: by mean accuracy past l, and by the area over all distances."""
    l = results.suite["recipe"]["block_size"]
    words = {"yarn": "YaRN", "ntk": "NTK", "dynamic_ntk": "dynamic NTK", "pi": "PI"}
    area = results.suite["area"]
    past, by_area = [], []
    for m in INTERPOLATIONS:
        for task in ("copy", "mqar"):
            a = accuracy_past(results, f"rope + {m}", task, l)
            b = accuracy_past(results, "rope", task, l)
            if a and b:
                dd = [x - y for x, y in zip(a, b)]
                past.append((m, task, sum(dd) / len(dd), t_interval(dd), k_of(dd), len(dd)))
            cell = area.get(f"rope + {m}", {}).get(f"{task} paired")
            if cell:
                iv = area[f"rope + {m}"][f"{task} paired interval"]
                by_area.append((m, task, cell["mean"], iv, k_of(cell["values"]), cell["n"]))
    every = sorted({m for m, _, _, _, k, n in past if k == n}, key=INTERPOLATIONS.index)
    all_every = all(k == n for *_, k, n in past)
    excl_past = [(m, t) for m, t, _, iv, _, _ in past if excludes(iv) > 0]
    excl_area = [(m, t) for m, t, _, iv, _, _ in by_area if excludes(iv) > 0]

    def listed(found):
        return names_text(f"{words[m]}'s on {t}" for m, t in found) or "none"

    which = "every interpolation" if all_every else names_text(words[m] for m in every)
    excl = ("for no method" if not excl_past else f"only for {listed(excl_past)}"
            if len(excl_past) == 1 else f"for {listed(excl_past)}")
    head = (f"Claim 12, on RoPE: by mean accuracy past l, paired with the plain model on the "
            f"same checkpoints, {which} is above it on copy and MQAR "
            f"{'in every seed' if all_every else ''}; the t interval over seeds excludes 0 "
            f"{excl}")
    detail = "; ".join(f"{words[m]} {t} {num(mean, 2, sign=True)} {interval_text(iv)}"
                       for m, t, mean, iv, _, _ in past)
    areas = "; ".join(f"{words[m]} {t} {num(mean, 2, sign=True)} {interval_text(iv)}"
                      for m, t, mean, iv, _, _ in by_area)
    if short:
        yarn = next(f for f in past if f[:2] == ("yarn", "copy"))
        return Verdict("interpolation-retrieval-short", "claim 12", "mean accuracy past l, 3 "
                       "seeds", "each interpolation on rope minus plain rope",
                       f"every seed: {every}; interval above 0 {excl_past}",
                       f"by mean accuracy past l, paired with plain RoPE on the same models, "
                       f"{which} is above it on copy and MQAR "
                       f"{'in every seed' if all_every else ''}, and the t interval over seeds "
                       f"excludes 0 {excl} (YaRN on copy {num(yarn[2], 2, sign=True)} "
                       f"{interval_text(yarn[3])})")
    sentence = (f"**{normal(head)}**: {detail}. By the area over all distances, paired "
                f"the same way, the intervals exclude 0 for {listed(excl_area)}: {areas}.")
    return Verdict("interpolation-retrieval", "claim 12", "mean accuracy past l; area over all "
                   "distances, 3 seeds", "each interpolation on rope minus plain rope on the "
                   "same checkpoints", f"every seed: {every}; interval above 0 past l "
                   f"{excl_past}, by area {excl_area}", sentence)


def windows_past_bound(results):
    """Claim 12: windows and sinks past their reach bound: the most any seed scores there on
    the retrieval tasks (flip-flop left out: a constant answer scores its share of the
    instances, 0.62 of some)."""
    acc, reach = results.suite["accuracy"], results.suite["reach"]
    best = (0.0, None, None)
    for name, row in acc.items():
        if not (" + sliding" in name or " + sinks" in name):
            continue
        for key, cell in row.items():
            task, kind, d = key.split()
            bound = (reach.get(name, {}).get(f"{task} bound") or {}).get("mean")
            if kind == "distance" and task != "flipflop" and bound and int(d) > bound:
                best = max(best, (max(cell["values"]), name, key))
    sentence = (f"Past their reach bound, windows and sinks score at most {num(best[0])} on copy, "
                "MQAR and the passkeys in any seed of any scheme (chance: 0.02 copy, 0.04 MQAR)")
    return Verdict("windows-past-bound", "claim 12", "accuracy on the distance grid past the "
                   "rule's reach bound", "the most of any seed", f"most {best}", sentence)


def three_seed_schemes_suite(results):
    """The suite's schemes with more than one seed."""
    return [n for n, row in results.suite["reach"].items() if " " not in n
            and any((c or {}).get("of", 1) > 1 for k, c in row.items() if " " not in k)]


def flipflop_sinks(results):
    """Item 10: flip-flop under sinks at every length, seed by seed."""
    acc = results.suite["accuracy"]
    parts, predicate = [], {}
    for s in three_seed_schemes_suite(results):
        row = acc.get(f"{s} + sinks S=4 W=128", {})
        cells = [seed_values(v) for k, v in row.items() if k.startswith("flipflop length ")]
        if not cells or any(c is None for c in cells):
            continue
        n = len(cells[0])
        kept = [all(round(c[i], 2) == 1 for c in cells) for i in range(n)]
        predicate[s] = sum(kept)
        parts.append((s, sum(kept), n, [min(c[i] for c in cells) for i in range(n)],
                      [max(c[i] for c in cells) for i in range(n)]))
    groups = {}
    for s, k, n, _, _ in parts:
        groups.setdefault(seeds_text(k, n), []).append(s)
    text = ", ".join(f"{q} of {names_text(v)}" for q, v in groups.items())
    seeds = results.suite["seeds"]
    lost = [f"{s} seed {seeds[i]} scores {num(lo[i])} to {num(hi[i])}"
            for s, k, n, lo, hi in parts for i in range(n) if round(lo[i], 2) < 1]
    sentence = (f"Sinks score 1.00 on flip-flop at every length of the long sequences {text}"
                + (f" ({'; '.join(lost)})" if lost else ""))
    return Verdict("flipflop-sinks", "claim 12", "flip-flop accuracy by length under sinks",
                   "each seed's every length against 1.00", f"seeds kept: {predicate}",
                   sentence)


def yarn_passkey_long(results):
    """Item 10: YaRN and the passkey in long sequences, seed by seed."""
    acc = results.suite["accuracy"]
    plain = seed_values(acc["rope"].get("passkey length 256"))
    yarn = seed_values(acc["rope + yarn"].get("passkey length 256"))
    k = sum(p > y for p, y in zip(plain, yarn))
    n = len(plain)
    sentence = (f"by length, at 256 tokens RoPE reads the passkey at "
                f"{' / '.join(num(v) for v in plain)} and RoPE + YaRN at "
                f"{' / '.join(num(v) for v in yarn)}: YaRN is lower {seeds_text(k, n)}")
    return Verdict("yarn-passkey-long", "claim 12", "passkey accuracy by length at 256 tokens",
                   "rope + yarn against rope, seed by seed", f"plain above yarn in {k} of {n}",
                   sentence)


def bca_grid(results):
    """Item 10: BCA on the distance grid past l + 1 tokens, where it is no longer causal
    attention: the most any seed scores there on the retrieval tasks."""
    l = results.suite["recipe"]["block_size"]
    lengths = {}
    for _, result in results.raw("retrieval", "*.tasks.json"):
        for row in result["rows"]:
            if row["kind"] == "distance":
                lengths[row["task"], row["d"]] = row["length"]
    best = (0.0, None, None)
    for name, row in results.suite["accuracy"].items():
        if not name.endswith(" + BCA"):
            continue
        for key, cell in row.items():
            task, kind, d = key.split()
            if kind == "distance" and task != "flipflop" and lengths[task, int(d)] > l + 1:
                best = max(best, (max(cell["values"]), name, key))
    sentence = (f"On the distance grid above, where an instance is longer than l + 1 tokens "
                f"(BCA is plain causal attention up to there), BCA scores at most "
                f"{num(best[0])} on copy, MQAR and the passkeys in any seed of any scheme")
    return Verdict("bca-grid", "claim 9", "accuracy on the distance grid under BCA",
                   "the most of any seed past l + 1 tokens", f"most {best}", sentence)


def bar_1x(results):
    reach = results.suite["reach"]
    groups = {}
    for s in three_seed_schemes_suite(results):
        cells = [seed_values(reach[s].get(f"{t} at 1x")) for t in results.suite["tasks"]]
        if any(c is None for c in cells):
            continue
        n = len(cells[0])
        k = sum(all(round(c[i], 2) >= 0.95 for c in cells) for i in range(n))
        groups.setdefault(seeds_text(k, n), []).append(s)
    text = "; ".join(f"{names_text(v)} {q}" for q, v in groups.items())
    sentence = f"**The 95% bar at 1 × on every task: {text}**"
    return Verdict("bar-1x", "claim 11", "accuracy at 1 ×, 3 seeds", "each seed's every task "
                   "against 0.95", str(groups), sentence)


def bca_long(results):
    """Claim 9: what BCA keeps in long sequences, by length, seed by seed."""
    acc = results.suite["accuracy"]
    top = max(int(k.split()[-1]) for k in acc["rope + BCA"] if " length " in k)
    parts = []
    for s in ("rope", "xpos"):
        cells = {t: seed_values(acc[f"{s} + BCA"].get(f"{t} length {top}"))
                 for t in ("copy", "passkey", "flipflop")}
        kept = {t: sum(round(v, 2) >= 0.95 for v in c) for t, c in cells.items() if c}
        n = len(next(iter(cells.values())))
        groups = {}
        for t, k in kept.items():
            groups.setdefault(seeds_text(k, n), []).append(t)
        parts.append(f"{s} + BCA " + ", ".join(f"{q} on {names_text(ts)}"
                                                 for q, ts in groups.items()))
    sentence = (f"By length ({top:,} tokens, the answers at distance "
                f"{results.suite['recipe']['block_size'] // 2}), accuracy stays at 0.95 or more: "
                + "; ".join(parts))
    return Verdict("bca-long", "claim 9", f"accuracy by length at {top}, 3 seeds",
                   "each seed against 0.95", "; ".join(parts), sentence)


# ------------------------------------------------------------------------------------------
# The context extension (claim 13)


def ext_cell(results, row, column):
    return results.extension["table"].get(row, {}).get(column)


def extension_vs_bca(results):
    l = results.extension["recipe"]["block_size"]
    at = str(4 * l)
    bca = "zero-shot: xpos + BCA"
    parts, predicate = [], {}
    rows = [n for n in results.extension["table"]
            if n.startswith("fine-tuned at 4l: rope + ") and f" s=4 from {l}" in n]
    for row in rows:
        d = paired(ext_cell(results, bca, at), ext_cell(results, row, at))
        if d:
            k = k_of(d, sign=-1)  # zero-shot below the fine-tune
            predicate[row] = k
            label = row.split(": ")[1].replace(f" s=4 from {l}", "")
            parts.append(f"the {label} fine-tune {seeds_text(k, len(d))}")
    sentence = ("At 4l zero-shot xpos + BCA is below " + " and ".join(parts))
    return Verdict("extension-vs-bca", "claim 13", "perplexity at 4l, 3 seeds",
                   "zero-shot xpos + BCA against each fine-tune, seed by seed",
                   f"seeds below: {predicate}", sentence)


def extension_gain(results):
    """Item 6: which scheme the fine-tune at 4l helps most, against its own zero-shot row."""
    l = results.extension["recipe"]["block_size"]
    at = str(4 * l)
    pairs = (("rope + yarn", "fine-tuned at 4l: rope + yarn s=4 from 128", "zero-shot: rope"),
             ("rope + yarn", "fine-tuned at 4l: rope + yarn s=4 from 128",
              "zero-shot: rope + yarn"),
             ("rope + pi", "fine-tuned at 4l: rope + pi s=4 from 128", "zero-shot: rope"),
             ("xpos", "fine-tuned at 4l: xpos", "zero-shot: xpos"),
             ("xpos + BCA", "fine-tuned at 4l: xpos + BCA", "zero-shot: xpos + BCA"))
    found = []
    for label, tuned, zero in pairs:
        d = paired(ext_cell(results, zero, at), ext_cell(results, tuned, at))
        if d:
            found.append((label, zero.split(": ")[1], sum(d) / len(d), k_of(d), len(d)))
    best = max(found, key=lambda f: f[2])
    parts = ", ".join(f"{label} {num(g, 3)} against zero-shot {zero}" for label, zero, g, _, _
                      in found)
    sentence = (f"Against the zero-shot rows, the fine-tune at 4l lowers perplexity at 4l most "
                f"for {best[0]} ({num(best[2], 3)} against zero-shot {best[1]}); seed-mean "
                f"falls (zero-shot minus fine-tuned): {parts}")
    return Verdict("extension-gain", "claim 13", "perplexity at 4l, zero-shot minus "
                   "fine-tuned, 3 seeds", "each fine-tune against its zero-shot rows",
                   f"largest fall: {best[0]} from {best[1]}", sentence)


def extension_at_l(results):
    """Item 6: the xPos fine-tune at l, where no length is new: extra training or length? With
    the control fine-tuned at l on the same tokens (rows "fine-tuned at l (control): ..."), the
    fine-tune at 4l against it at 4l, seed by seed."""
    l = results.extension["recipe"]["block_size"]
    at_l = paired(ext_cell(results, "zero-shot: xpos", str(l)),
                  ext_cell(results, "fine-tuned at 4l: xpos", str(l)))
    at_4l = paired(ext_cell(results, "zero-shot: xpos + BCA", str(4 * l)),
                   ext_cell(results, "fine-tuned at 4l: xpos + BCA", str(4 * l)))
    k = k_of(at_l)
    sentence = (f"The xPos fine-tune is lower at l too, where no length is new: by "
                f"{num(sum(at_l) / len(at_l), 3)} ({seeds_text(k, len(at_l))}), against "
                f"{num(sum(at_4l) / len(at_4l), 3)} at 4l over zero-shot xpos + BCA")
    found = []
    for label in ("xpos", "xpos + BCA"):
        control = ext_cell(results, CONTROL_AT_L[0] + label, str(4 * l))
        d = paired(control, ext_cell(results, f"fine-tuned at 4l: {label}", str(4 * l)))
        if d:
            found.append((label, sum(d) / len(d), t_interval(d), k_of(d), len(d)))
    if found:
        sentence += ("; against the control fine-tuned at l on the same tokens, perplexity at 4l "
                     "of the control minus the fine-tune at 4l (positive: the length helped "
                     "beyond the extra training): " + ", ".join(
                         f"{num(m, 3, sign=True)} {interval_text(iv, 3)} for {label} "
                         f"({against_zero(iv)}; the fine-tune lower {seeds_text(kk, n)})"
                         for label, m, iv, kk, n in found))
    else:
        sentence += (", so its gain may be the extra training, not the length: no control "
                     "fine-tuned at l with the same tokens has been run")
    return Verdict("extension-at-l", "claim 13", "perplexity at l and at 4l, 3 seeds",
                   "fine-tuned xPos against zero-shot and against the control at l, seed by "
                   "seed", f"lower at l in {k} of {len(at_l)}; against the control {found}",
                   sentence)


def extension_equal_tokens(results):
    """Claim 13 at equal extra tokens: each control fine-tuned at l, under BCA, against each
    RoPE fine-tune at 4l with a fixed factor, at 4l, seed by seed."""
    l = results.extension["recipe"]["block_size"]
    table = results.extension["table"]
    controls = [n for n in table if n.startswith(CONTROL_AT_L[0]) and n.endswith(" + BCA")]
    tuned = [n for n in table if n.startswith("fine-tuned at 4l: rope + ")
             and f" s=4 from {l}" in n]
    parts, predicate = [], {}
    for c in controls:
        for t in tuned:
            d = paired(ext_cell(results, t, str(4 * l)), ext_cell(results, c, str(4 * l)))
            if d:
                k = k_of(d)
                predicate[(c, t)] = k
                iv = interval_text(t_interval(d), 3)
                parts.append(f"{c.split(': ')[1]} against {t.split(': ')[1]} "
                             f"{num(sum(d) / len(d), 3, sign=True)} {iv} "
                             f"(the control lower {seeds_text(k, len(d))})")
    if not parts:
        sentence = ("No control fine-tuned at l has been compared with the RoPE fine-tunes at 4l "
                    "on the same extra tokens")
    else:
        sentence = ("With the same extra tokens spent at l instead, BCA at 4l against the RoPE "
                    "fine-tunes at 4l, perplexity fine-tune minus control: " + "; ".join(parts))
    return Verdict("extension-equal-tokens", "claim 13", "perplexity at 4l, 3 seeds",
                   "each control at l under BCA against each RoPE fine-tune at 4l, seed by seed",
                   f"{predicate}", sentence)


def extension_context(results):
    table = results.extension["table"]
    rows = {n: r["context gain"] for n, r in table.items()
            if n.endswith("+ BCA") and r.get("context gain")}
    ivs = {n: t_interval(seed_values(c)) for n, c in rows.items()}
    above = [n for n, iv in ivs.items() if excludes(iv) > 0]
    detail = ", ".join(f"{n.split(': ')[1]} ({n.split(':')[0]}) {num(rows[n]['mean'], 4)} "
                       f"{interval_text(iv, 4)}" for n, iv in ivs.items())
    head = ("Under BCA no row's gain from context beyond l is distinguishable from 0"
            if not above else f"Under BCA the gain is above 0 for {names_text(above)}")
    return Verdict("extension-context", "claim 13", "gain from context beyond l at 16l, 3 seeds",
                   "each BCA row against 0", f"above 0: {above or 'none'}",
                   f"{head} (t intervals over seeds: {detail})")


def task_sources(results, n):
    """Which checkpoints claim 13's task rows measured, from their raw files: zero-shot rows
    copied from the suite's results, or measured on the checkpoints the fine-tunes started
    from (<task_runs>/<scheme>_s<seed> beside <task_runs>/extension/), and whether those are
    the sweep's models or the suite's tables'."""
    found = results.raw("extension", "*.tasks.json")
    zero = {r["ckpt"] for name, res in found for r in res["rows"]
            if "/extension/" not in r["ckpt"]}
    tuned = {r["ckpt"] for name, res in found for r in res["rows"] if "/extension/" in r["ckpt"]}
    seeds = "one seed" if n == 1 else f"{n} seeds"
    if any("copied_from" in res for _, res in found):
        retrained = [k.split()[-1] for k in results.timings("extension")
                     if k.startswith("train suite ")]
        return (f"{seeds}; the fine-tunes start from checkpoints trained again, "
                f"{names_text(retrained)}, not the suite's zero-shot models")
    schemes = sorted((name for name, _, _ in SUITE_SCHEMES), key=len, reverse=True)
    sources = set()
    for c in tuned:  # <task_runs>/extension/<source>_<fine-tune>_s<seed>: its source's path
        run, _, seed = Path(c).parent.name.rpartition("_s")
        source = next((x for x in schemes if run == x or run.startswith(x + "_")), run)
        sources.add(str(Path(c).parents[2] / f"{source}_s{seed}" / "ckpt.pt"))
    if not sources <= zero:
        return f"{seeds}; the fine-tunes' sources are not the zero-shot rows' checkpoints"
    text = f"{seeds}; the zero-shot rows on the fine-tunes' source checkpoints"
    suite = {r["ckpt"] for _, res in results.raw("retrieval", "*.tasks.json") for r in res["rows"]}
    if zero <= {c for _, c in sweep_rows(results)}:
        machine = (results.rerun or {}).get("machine", "another machine")
        text += f", the sweep's models, trained with the suite's recipe on {machine}"
    if not zero & suite:
        text += ", not the models of the suite's tables"
    return text


def task_instances(results, l):
    """{(table row, task): (right, instances)} of claim 13's task probe up to 4l: each
    distance's accuracy times its instances, summed over the distances (from raw/)."""
    pooled = {}
    for _, result in results.raw("extension", "*.tasks.json"):
        for row in result["rows"]:
            if row["kind"] != "distance" or row["d"] > 4 * l:
                continue
            prefix = "fine-tuned at 4l: " if "/extension/" in row["ckpt"] else "zero-shot: "
            key = (prefix + row["label"], row["task"])
            right, n = pooled.get(key, (0.0, 0))
            pooled[key] = (right + row["accuracy"] * result["sequences"], n + result["sequences"])
    return pooled


def extension_retrieval(results):
    """Item 8: the retrieval half of claim 13 (one seed): each fine-tune's mean accuracy up to
    4l against zero-shot xpos + BCA's, on the checkpoints task_sources names; told apart only
    where the Wilson intervals over their instances (each distance's 32, the answers of one
    instance counted as one) do not overlap."""
    suite = results.extension["task_suite"]
    table, n = suite["table"], len(suite["seeds"])
    base = "zero-shot: xpos + BCA"
    tasks = [t for t in ("copy", "mqar", "passkey") if t in table[base]]
    pooled = task_instances(results, suite["recipe"]["block_size"])
    parts, words, signs = [], {1: "above", -1: "below", 0: "not told apart"}, []
    for r in [r for r in table if r.startswith("fine-tuned at 4l: ")]:
        found = {}
        for t in tasks:
            if (r, t) not in pooled or (base, t) not in pooled:
                continue  # (a raw file missing: the table's cell alone cannot be tested)
            mine, theirs = wilson(*pooled[(r, t)]), wilson(*pooled[(base, t)])
            sign = 1 if mine[0] > theirs[1] else -1 if mine[1] < theirs[0] else 0
            signs.append(f"{r} {t}: {sign:+d} ({interval_text(mine, 3)} against "
                         f"{interval_text(theirs, 3)})")
            found.setdefault(sign, []).append(f"{t} ({num(table[r][t]['within'], 3)} against "
                                              f"{num(table[base][t]['within'], 3)})")
        parts.append(f"{r.split(': ')[1].split(' s=')[0]}: " + "; ".join(
            f"{words[sign]} on {names_text(found[sign])}" for sign in (1, 0, -1) if sign in found))
    sentence = (f"On retrieval ({task_sources(results, n)}), mean accuracy up to 4l against "
                "zero-shot xpos + BCA (told apart where Wilson intervals over the instances do "
                "not overlap): " + "; ".join(parts))
    return Verdict("extension-retrieval", "claim 13", "mean task accuracy up to 4l",
                   "each fine-tune against zero-shot xpos + BCA, Wilson intervals over "
                   "instances", f"seeds {n}; " + "; ".join(signs), sentence)


def extension_retrieval_past(results):
    """Claim 13's retrieval past 4l (one seed): per task the rows by mean accuracy past 4l,
    highest first, down to zero-shot xpos + BCA."""
    suite = results.extension["task_suite"]
    table, n = suite["table"], len(suite["seeds"])
    parts = []
    for task in ("copy", "mqar", "passkey"):
        past = {r.replace("zero-shot: ", "zero-shot ").replace("fine-tuned at 4l: ",
                                                                  "fine-tuned "): c[task]["past"]
                for r, c in table.items() if c.get(task, {}).get("past") is not None}
        if not past:
            continue
        base = past.get("zero-shot xpos + BCA")
        if base is None:
            continue
        # every row at or above the baseline, ties included, the baseline last among them
        ranked = sorted(((r, v) for r, v in past.items() if v >= base),
                        key=lambda kv: (-kv[1], kv[0] == "zero-shot xpos + BCA"))
        parts.append(f"{task}: " + ", ".join(f"{r} {num(v, 3)}" for r, v in ranked))
    seeds = "one seed" if n == 1 else f"{n} seeds"
    sentence = (f"Past 4l ({seeds}), mean accuracy of every row at or above zero-shot xpos + "
                "BCA, highest first: " + "; ".join(parts))
    return Verdict("extension-retrieval-past", "claim 13", "mean task accuracy past 4l",
                   "every row against zero-shot xpos + BCA, ranked", f"seeds {n}: "
                   + " | ".join(parts), sentence)


def extension_yarn(results):
    """Item 7: YaRN's alpha and beta: tuned here (summary["yarn"], from the sweep at 4l), or
    LLaMA's at the time."""
    record = results.extension.get("yarn")
    l = results.extension["recipe"]["block_size"]
    if record and record.get("grid"):
        grid = record["grid"]
        key = f"{record['alpha']:g},{record['beta']:g}"
        default = grid.get("1,32")
        recipe = results.extension["recipe"]
        d = recipe.get("n_embd", 0) // max(recipe.get("n_head", 1), 1)
        sentence = (f"YaRN's ramp ends were tuned here for l = {l} and head dimension {d}: α = "
                    f"{record['alpha']:g}, β = {record['beta']:g}, {record['chosen']} (zero-shot "
                    f"at 4l with s = 4: perplexity {num(grid[key]['mean'], 3)}, against "
                    f"{num(default['mean'], 3)} at LLaMA's α = 1, β = 32)")
        predicate = f"chosen {key} of {len(grid)} pairs"
    elif record:
        sentence = (f"YaRN's ramp uses α = {record['alpha']:g}, β = {record['beta']:g}, "
                    f"{record.get('chosen', 'as recorded')}")
        predicate = "recorded"
    else:
        turns = l / (2 * math.pi)  # the fastest pair turns once a 2 pi tokens (theta_0 = 1)
        sentence = (f"YaRN's ramp uses α = {YARN_AT_THE_TIME['alpha']}, β = "
                    f"{YARN_AT_THE_TIME['beta']}, LLaMA's values, not tuned for this length: "
                    f"at l = {l} the fastest pair turns {turns:.1f} times, fewer than β, so "
                    "every pair but the kept first is interpolated in part or whole, close to "
                    "PI")
        predicate = "not recorded: the defaults then"
    return Verdict("extension-yarn", "claim 13", "YaRN's settings", "recorded against tuned",
                   predicate, sentence)


def extension_dynamic(results):
    """Claim 13: the YaRN fine-tunes past 4l with s that grows with the length (YaRN's dynamic
    rule, s = L / l) against their fixed s = 4, seed by seed (positive: dynamic is lower)."""
    l = results.extension["recipe"]["block_size"]
    table = results.extension["table"]
    found = []
    for row in [n for n in table if n.startswith("fine-tuned at 4l: rope + yarn dynamic")]:
        fixed = row.replace("dynamic", "s=4")
        for m in (8, 16):
            d = paired(ext_cell(results, fixed, str(m * l)), ext_cell(results, row, str(m * l)))
            if d:
                found.append((row.split(": ")[1], m, sum(d) / len(d), t_interval(d), k_of(d),
                              len(d)))
    if not found:
        sentence = ("No YaRN fine-tune has been scored past 4l with s that grows with the "
                    "length: only its fixed s = 4")
    else:
        sentence = ("Past 4l, s that grows with the length (YaRN's dynamic rule, s = L / l) "
                    "against the fine-tune's fixed s = 4, perplexity fixed minus dynamic: "
                    + "; ".join(f"{label} at {m}l {num(g, 3)} {interval_text(iv, 3)} "
                                f"({against_zero(iv)}, dynamic lower {seeds_text(k, n)})"
                                for label, m, g, iv, k, n in found))
    return Verdict("extension-dynamic", "claim 13", "perplexity at 8l and 16l, 3 seeds",
                   "dynamic against fixed s = 4, seed by seed",
                   f"{[(f[0], f[1], f[4]) for f in found]}", sentence)


def extension_tuned(results):
    """Claim 13: YaRN with the tuned ends against LLaMA's, zero-shot and fine-tuned, at 4l."""
    record = results.extension.get("yarn") or {}
    l = results.extension["recipe"]["block_size"]
    table = results.extension["table"]
    ends = f" a={record['alpha']:g} b={record['beta']:g}" if record.get("grid") else None
    pairs = []
    if ends:
        pairs = [("zero-shot", "zero-shot: rope + yarn", f"zero-shot: rope + yarn{ends}"),
                 ("fine-tuned", f"fine-tuned at 4l: rope + yarn s=4 from {l}",
                  f"fine-tuned at 4l: rope + yarn s=4 from {l}{ends}")]
    found = []
    for what, default, tuned in pairs:
        if tuned in table and default in table:
            d = paired(ext_cell(results, default, str(4 * l)), ext_cell(results, tuned,
                                                                         str(4 * l)))
            if d:
                found.append((what, sum(d) / len(d), t_interval(d), k_of(d), len(d)))
    if not found:
        sentence = "YaRN with tuned ends has not been scored against LLaMA's"
    else:
        sentence = ("At 4l, YaRN's tuned ends against LLaMA's, perplexity LLaMA's minus tuned: "
                    + "; ".join(f"{what} {num(g, 3)} {interval_text(iv, 3)} ({against_zero(iv)}, "
                                f"tuned lower {seeds_text(k, n)})" for what, g, iv, k, n in found)
                    + " (the ends were chosen on these seeds and much of this text, which favours "
                    "them)")
    return Verdict("extension-tuned-yarn", "claim 13", "perplexity at 4l, 3 seeds",
                   "tuned ends against LLaMA's, seed by seed",
                   f"{[(f[0], f[3]) for f in found]}", sentence)


VERDICTS = (seed_counts, context_bca, context_bins, context_windows, context_alibi,
            context_control, context_readme, resolution_shared, interpolation_ppl,
            sweep_provenance, sweep_relay, lambda r: sweep_relay(r, short=True), sweep_depth,
            sweep_zones,
            area_xpos_rope, lambda r: area_xpos_rope(r, short=True), reach_xpos_rope,
            alibi_rope, interpolation_retrieval,
            lambda r: interpolation_retrieval(r, short=True), windows_past_bound, flipflop_sinks,
            yarn_passkey_long, bca_grid, bar_1x, bca_long, extension_vs_bca, extension_gain,
            extension_at_l, extension_context, extension_retrieval, extension_retrieval_past,
            extension_yarn,
            extension_dynamic, extension_tuned, extension_equal_tokens)


def verdicts(root=ROOT):
    """The table: every verdict computed from root's results/."""
    results = Results(root)
    return [f(results) for f in VERDICTS]


# ------------------------------------------------------------------------------------------
# The table and the pages


def table_markdown(found):
    lines = ["# Verdicts, computed", "",
             "Written by `python study/verdicts.py` from results/*/summary.json and raw/; the "
             "pages state each sentence between `<!-- verdict: key -->` markers "
             "(tests/study/test_verdicts.py).", "",
             "| key | claim | measure | comparison | predicate | sentence |",
             "|---|---|---|---|---|---|"]
    for v in found:
        cells = [v.key, v.claim, v.measure, v.comparison, v.predicate, v.sentence]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def normal(text):
    return " ".join(text.split())


def page_spans(text):
    """[(key, content)] of a page's marked sentences."""
    return [(m.group(1), m.group(2)) for m in MARK.finditer(text)]


def refresh(text, by_key):
    """The page with each marked sentence replaced by its row's (unknown keys left as they are),
    and each paragraph or list item holding one wrapped again to the page's prose width."""
    text = MARK.sub(lambda m: (f"<!-- verdict: {m.group(1)} -->"
                               + normal(by_key.get(m.group(1), m.group(2)))
                               + "<!-- /verdict -->"), text)
    lines, out, block = text.split("\n"), [], []

    def flush():
        if block and MARK.search("\n".join(block)):
            out.extend(rewrap(block))
        else:
            out.extend(block)
        block.clear()

    fence = False
    for line in lines:
        if line.startswith("```"):
            fence = not fence
        starts = re.match(r"\s*(?:[-*]|\d+\.)\s", line)
        if fence or not line.strip() or line.startswith(("|", "#", "```")):
            flush()
            out.append(line)
        elif starts and block:
            flush()
            block.append(line)
        else:
            block.append(line)
    flush()
    return "\n".join(out)


def rewrap(block):
    """A paragraph or list item wrapped to WIDTH, its list marker kept and its markers whole."""
    lead = re.match(r"\s*(?:[-*]|\d+\.)?\s*", block[0]).group(0)
    body = [block[0][len(lead):]] + block[1:]
    words = re.split(r"(<!-- .*? -->)", " ".join(line.strip() for line in body))
    glued = "".join(w.replace(" ", "\0") if w.startswith("<!--") else w for w in words)
    wrapped = textwrap.wrap(glued, WIDTH, initial_indent=lead, subsequent_indent=" " * len(lead),
                            break_on_hyphens=False, break_long_words=False)
    return [line.replace("\0", " ") for line in wrapped]


# Qualifiers a page may state only inside a verdict's markers: where they stand, a predicate
# stands behind them
QUALIFIERS = re.compile(
    r"\b(every seed|all (?:three )?seeds|the only|one exception|nothing|not used|no model|never|"
    r"the most|helps? \w+ most|any scheme|far (?:beyond|past|more)|distinguishable|"
    r"(?:holds?|holding|excludes?|excluding) 0)\b", re.I)
# (page, the part of it the qualifier check reads: a heading it starts at, and the next
# heading of its level that ends it, or None for the whole page)
CHECKED = (("README.md", "## Results at small scale"), ("docs/results.md", None))


def mismatches(text, by_key):
    """[(key, the page's sentence, the computed one)] of a page's marked sentences that are not
    their rows' (whitespace aside), or whose key is not in the table."""
    return [(key, normal(content), by_key.get(key)) for key, content in page_spans(text)
            if key not in by_key or normal(content) != normal(by_key[key])]


def unmarked_qualifiers(text, heading=None):
    """[(line number, qualifier)] stated outside every verdict's markers, in the prose of the
    text (from `heading` to the next heading of its level, if given): tables, code and links
    aside."""
    lines = text.split("\n")
    first, last = 0, len(lines)
    if heading:
        first = lines.index(heading)
        level = heading.split()[0] + " "
        last = next((i for i in range(first + 1, len(lines)) if lines[i].startswith(level)),
                    len(lines))
    # the spans blanked, line breaks kept, so that line numbers stay the page's
    blanked = MARK.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text).split("\n")
    found, fence = [], False
    for i in range(first, last):
        line = blanked[i]
        if line.startswith("```"):
            fence = not fence
        if fence or line.startswith("|"):
            continue
        line = re.sub(r"\]\([^)]*\)|`[^`]*`", " ", line)  # link targets, code
        found += [(i + 1, m.group(0)) for m in QUALIFIERS.finditer(line)]
    return found


def stale(root=ROOT):
    """[(path, new text)] of what `python study/verdicts.py` would write: the table, and each
    page whose marked sentences are not their rows' (whitespace aside)."""
    found = verdicts(root)
    by_key = {v.key: v.sentence for v in found}
    out = []
    for path, text in ((root / "results" / "verdicts.md", table_markdown(found)),
                       (root / "results" / "verdicts.json",
                        json.dumps([asdict(v) for v in found], indent=1, ensure_ascii=False)
                        + "\n")):
        if not path.exists() or path.read_text() != text:
            out.append((path, text))
    for page in PAGES:
        path = root / page
        text = path.read_text()
        if any(key in by_key and normal(content) != normal(by_key[key])
               for key, content in page_spans(text)):
            out.append((path, refresh(text, by_key)))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming what is stale")
    args = parser.parse_args(argv)
    changed = stale()
    if args.check:
        for path, _ in changed:
            print(f"stale: {path.relative_to(ROOT)} (run python study/verdicts.py)")
        loose = [(page, n, q) for page, heading in CHECKED
                 for n, q in unmarked_qualifiers((ROOT / page).read_text(), heading)]
        for page, n, q in loose:
            print(f"{page}:{n}: \"{q}\" outside a verdict's markers: no predicate stands "
                  "behind it")
        return 1 if changed or loose else 0
    for path, text in changed:
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
