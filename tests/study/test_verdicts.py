"""Tests for study/verdicts.py: every verdict sentence of the pages is its computed row's, no
page states a qualifier outside a verdict, the qualifiers are counted and never rounded up, and
a predicate follows its numbers. Fast: the committed JSON only."""

import copy
import json
import math

import pytest

from study import verdicts as study_verdicts
from study.report import t_interval
from study.verdicts import ROOT

PAGES = study_verdicts.PAGES


@pytest.fixture(scope="module")
def table():
    return study_verdicts.verdicts()


@pytest.fixture(scope="module")
def by_key(table):
    return {v.key: v.sentence for v in table}


def test_every_page_sentence_is_its_computed_verdict(by_key):
    used = set()
    for page in PAGES:
        text = (ROOT / page).read_text()
        wrong = study_verdicts.mismatches(text, by_key)
        assert not wrong, (f"{page}: the sentence of verdict {wrong[0][0]!r} is not the computed "
                           f"one (run python study/verdicts.py):\n  page: {wrong[0][1]}\n  "
                           f"computed: {wrong[0][2]}")
        used |= {key for key, _ in study_verdicts.page_spans(text)}
    # every row of the table is stated somewhere: the pages are drawn from it
    assert used == set(by_key), f"verdicts no page states: {sorted(set(by_key) - used)}"


def test_no_page_states_a_qualifier_outside_a_verdict():
    for page, heading in study_verdicts.CHECKED:
        loose = study_verdicts.unmarked_qualifiers((ROOT / page).read_text(), heading)
        assert not loose, (f"{page}:{loose[0][0]}: \"{loose[0][1]}\" outside a verdict's "
                           "markers: no predicate stands behind it")


def test_the_committed_table_is_current(table):
    stale = [p for p, _ in study_verdicts.stale() if p.parent.name == "results"]
    assert not stale, f"{stale[0]} is stale: run python study/verdicts.py"
    rows = json.loads((ROOT / "results" / "verdicts.json").read_text())
    assert [r["key"] for r in rows] == [v.key for v in table]


@pytest.mark.parametrize("old, new", [
    ("in 2 of 3 seeds", "in every seed"),  # a count rounded up
    ("holds 0", "excludes 0"),  # an interval holding 0 stated as a difference
    ("is not an exception", "is the one exception"),
])
def test_a_hand_edited_overstatement_fails(by_key, old, new):
    """docs/results.md with one verdict's qualifier overstated by hand: the check names it."""
    text = (ROOT / "docs" / "results.md").read_text()
    assert not study_verdicts.mismatches(text, by_key)
    spans = [m for m in study_verdicts.MARK.finditer(text) if old in m.group(2)]
    assert spans, old
    m = spans[0]
    edited = text[:m.start(2)] + m.group(2).replace(old, new, 1) + text[m.end(2):]
    wrong = study_verdicts.mismatches(edited, by_key)
    assert [key for key, *_ in wrong] == [m.group(1)] and new in wrong[0][1]
    # and the same words outside a verdict's markers are caught by the qualifier check
    outside = text.replace("\n\n## The paper's claims", f"\n\nIt holds {new}.\n\n## The paper's "
                           "claims", 1)
    if study_verdicts.QUALIFIERS.search(new):
        assert study_verdicts.unmarked_qualifiers(outside)


def test_qualifiers_are_counted_never_rounded_up():
    seeds = study_verdicts.seeds_text
    assert seeds(3, 3) == "in every seed" and seeds(2, 3) == "in 2 of 3 seeds"
    assert seeds(0, 3) == "in no seed" and seeds(1, 1) == "in its one seed"
    assert seeds(0, 1) == "not in its one seed"  # one seed never reads as "every seed"
    excludes = study_verdicts.excludes
    assert excludes([0.1, 0.2]) == 1 and excludes([-0.2, -0.1]) == -1
    assert excludes([-0.0001, 0.0024]) == 0 and excludes(None) == 0
    assert excludes([0.03, 0.05], at=0.019) == 1
    assert study_verdicts.names_text(["a", "b", "c"]) == "a, b and c"


def wilson_by_brute_force(right, n, z=1.959964):
    """The Wilson interval's bounds: the p whose normal test |p̂ - p| = z sqrt(p(1-p)/n) is met
    with equality, found by bisection on either side of p̂."""
    p_hat = right / n

    def gap(p):
        return abs(p_hat - p) - z * math.sqrt(p * (1 - p) / n)

    def root(low, high):  # gap(low) > 0 >= gap(high) or the reverse
        for _ in range(100):
            mid = (low + high) / 2
            if (gap(mid) > 0) == (gap(low) > 0):
                low = mid
            else:
                high = mid
        return (low + high) / 2

    return [root(0.0, p_hat) if right else 0.0, root(p_hat, 1.0) if right < n else 1.0]


@pytest.mark.parametrize("right, n", [(38, 102), (25, 787), (0, 40), (128, 128), (364, 4380)])
def test_wilson_interval_against_brute_force(right, n):
    assert study_verdicts.wilson(right, n) == pytest.approx(wilson_by_brute_force(right, n),
                                                            abs=1e-6)


def test_a_predicate_follows_its_numbers():
    """The same verdicts on edited results: the sentence changes with the numbers, never with
    the words."""
    results = study_verdicts.Results()
    # xpos_sb512 + BCA's gain made tight: its interval excludes 0, the one BCA row that does
    edited = copy.deepcopy(results)
    cell = edited.char["context"]["xpos_sb512 + BCA"]["gain"]
    cell["values"] = [0.0011, 0.0012, 0.0010]
    assert t_interval(cell["values"])[0] > 0
    sentence = study_verdicts.context_bins(edited).sentence
    assert sentence.startswith("**xpos_sb512 + BCA is the one BCA row whose gain is "
                               "distinguishable from 0**")
    assert "not an exception" in study_verdicts.context_bins(results).sentence
    # xPos above RoPE by the area in every seed on MQAR once seed 1339 is
    edited = copy.deepcopy(results)
    diff = edited.suite["area"]["xpos − rope"]["mqar"]
    diff["values"] = [abs(v) for v in diff["values"]]
    assert "in every seed on copy, MQAR" in study_verdicts.area_xpos_rope(edited).sentence
    assert "in 2 of 3 seeds on MQAR" in study_verdicts.area_xpos_rope(results).sentence
    # no relay answer above chance: "nothing relays"
    relay = {64: (40, 100), 72: (30, 100)}
    found = with_sweeps(study_verdicts.Results(), [sweep_file("xpos_s1337", relay, 128)])
    assert "above chance" in study_verdicts.sweep_relay(found).sentence
    relay = {d: (0, n) for d, (_, n) in relay.items()}
    found = with_sweeps(study_verdicts.Results(), [sweep_file("xpos_s1337", relay, 128)])
    assert study_verdicts.sweep_relay(found).sentence.startswith("nothing relays")


def sweep_file(run, relay, bound):
    """A sweep's raw result written by hand: copy under BCA, {d: (right, scored)} in the relay
    zone, nothing scored in the others."""
    ckpt = f"out/retrieval_rerun/{run}/ckpt.pt"
    return (f"{run}.sweep.json", {"rows": [
        dict(attention="bca", task="copy", d=d, ckpt=ckpt, accuracy=right / n, reach_bound=bound,
             reach_bound_max=bound + 63,
             zones={"direct": [0, 0], "relay": [right, n], "beyond": [0, 0]})
        for d, (right, n) in relay.items()]})


def with_sweeps(results, files):
    original = results.raw
    results.raw = lambda suite, pattern: (
        files if (suite, pattern) == (study_verdicts.SWEEP_SUITE, "*.sweep.json")
        else original(suite, pattern))
    return results


def test_the_sweep_on_several_seeds_is_judged_over_seeds():
    """A sweep of three seeds (raw/<run>.sweep.json, one file per checkpoint): the relay verdict
    counts the checkpoints by scheme and pools each zone with a t interval over seeds; the
    provenance counts the seeds swept against those the suite trains."""
    relay = {64: (40, 100), 72: (30, 100), 136: (2, 100)}  # chance on copy: 1/52
    results = with_sweeps(study_verdicts.Results(),
                          [sweep_file(f"xpos_s{seed}", relay, 128) for seed in (1337, 1338, 1339)])
    sentence = study_verdicts.sweep_relay(results).sentence
    assert "in the pooled answers of the sweep's 3 xpos checkpoints" in sentence
    assert "t interval over seeds" in sentence
    assert "the farthest at d = 72" in sentence
    assert "(BCA's reach bound: 128 to 191 tokens, with the phase)" in sentence
    provenance = study_verdicts.sweep_provenance(results).sentence
    assert provenance.endswith("(results/retrieval_rerun; none of them a model the suite's tables "
                               "measured): xpos seeds 1337, 1338 and 1339 (of 3).")
    assert provenance.startswith("Measured, on models")  # every seed the suite trains
    one = with_sweeps(study_verdicts.Results(), [sweep_file("xpos_s1337", relay, 128)])
    assert study_verdicts.sweep_provenance(one).sentence.startswith("Measured so far, on models")


def test_relay_pooled_over_seeds_counts_the_seeds_that_relay_on_their_own():
    """Pooled answers are above chance from two seeds alone when the third is at chance (2 of
    104 against a chance of 1/52): the sentence counts the seeds by their own answers."""
    relay = {1337: {64: (40, 100), 72: (30, 100)}, 1338: {64: (35, 100), 72: (25, 100)},
             1339: {64: (2, 100), 72: (2, 100)}}
    results = with_sweeps(study_verdicts.Results(), [sweep_file(f"xpos_s{seed}", r, 128)
                                                     for seed, r in relay.items()])
    long, short = (study_verdicts.sweep_relay(results, short=s).sentence for s in (False, True))
    assert "above it in 2 of 3 seeds by its own answers" in long
    assert "copy 0.223 against a chance of 0.019, above it in 2 of 3 seeds" in short
    assert "in every seed" not in long + short


def test_relay_with_depth_is_compared_from_the_answers():
    """xpos_4layer against xpos, one seed each: the farthest distance above chance per task,
    more than one grid step apart counting as further; the pooled relay over d <= l against two
    layers' range over seeds (here one seed: 0.4 of 200)."""
    two = sweep_file("xpos_s1337", {64: (40, 100), 72: (40, 100), 136: (2, 100)}, 128)
    four = sweep_file("xpos_4layer_s1337", {64: (60, 100), 72: (60, 100), 200: (30, 100)}, 256)
    results = with_sweeps(study_verdicts.Results(), [four, two])
    sentence = study_verdicts.sweep_depth(results).sentence
    assert "is further on copy (copy 200 against 72;" in sentence
    assert ("above two layers' range over seeds on copy (copy 0.600 against 0.400 to 0.400)"
            in sentence)
    assert ("(BCA's reach bound: 256 to 319 tokens, with the phase)"
            in study_verdicts.sweep_relay(results).sentence)
    close = sweep_file("xpos_4layer_s1337", {64: (45, 100), 72: (40, 100), 80: (10, 100)}, 256)
    sentence = study_verdicts.sweep_depth(with_sweeps(study_verdicts.Results(), [close, two]))
    assert "is as far on copy (copy 80 against 72;" in sentence.sentence
    provenance = study_verdicts.sweep_provenance(results).sentence
    assert provenance.endswith("measured): xpos_4layer seed 1337 (of 1); xpos seed 1337 (of 3).")


def test_depth_is_compared_at_the_same_seed_beside_two_layers_spread_over_seeds():
    """Four layers have one seed: their reach is compared with two layers' checkpoint of that
    seed (as many checkpoints each), not with all three pooled, whose answers alone would put
    more distances above chance; their strength against two layers' range over seeds."""
    relay = {1337: {64: (40, 100), 72: (40, 100)}, 1338: {64: (10, 100), 72: (10, 100)},
             1339: {64: (30, 100), 72: (30, 100), 200: (20, 100)}}
    two = [sweep_file(f"xpos_s{seed}", r, 128) for seed, r in relay.items()]
    four = sweep_file("xpos_4layer_s1337", {64: (60, 100), 72: (60, 100)}, 256)
    sentence = study_verdicts.sweep_depth(
        with_sweeps(study_verdicts.Results(), [four, *two])).sentence
    assert "(xpos_4layer, seed 1337) against two (xpos, 3 seeds)" in sentence
    assert "as far on copy (copy 72 against 72;" in sentence  # not seed 1339's d = 200
    assert ("above two layers' range over seeds on copy (copy 0.600 against 0.100 to 0.400)"
            in sentence)
    other = sweep_file("xpos_4layer_s1340", {64: (60, 100)}, 256)
    assert (study_verdicts.sweep_depth(with_sweeps(study_verdicts.Results(), [other, *two]))
            .sentence == "the sweep has not measured both depths on one seed yet")
def test_a_positive_control_is_read_when_it_exists():
    """results/control/summary.json (reproduce.py --suite control): its model trained at 4l
    decides whether the probe is shown able to see a gain."""
    results = study_verdicts.Results()
    committed = study_verdicts.context_control(results).sentence
    assert committed.startswith("**The probe sees a gain where one exists**")
    assert "long8: rope (trained at 8l) 0.0127 [0.0077, 0.0178]" in committed
    results.control = None  # before the control ran: only the fine-tunes inside 4l
    assert "has not been shown" in study_verdicts.context_control(results).sentence
    results.control = {"corpus": "numpy/**/*.py", "table": {
        "long: rope": {"gain": {"mean": 0.05}, "gain interval": [0.03, 0.07]},
        "xpos: xpos + BCA": {"gain": {"mean": 0.0004}, "gain interval": [-0.001, 0.002]}}}
    sentence = study_verdicts.context_control(results).sentence
    assert sentence.startswith("**The probe sees a gain where one exists**")
    assert "xpos: xpos + BCA 0.0004 [−0.0010, 0.0020] (holds 0)" in sentence
    results.control["table"]["long: rope"]["gain interval"] = [-0.01, 0.07]
    assert "has not been shown" in study_verdicts.context_control(results).sentence


def test_the_control_at_l_is_read_when_it_exists():
    """Claim 13's control (rows "fine-tuned at l (control): ..."): the fine-tune at 4l is judged
    against it, seed by seed, once it is in results/extension."""
    results = study_verdicts.Results()
    table = results.extension["table"]
    for label in ("xpos", "xpos + BCA"):  # as before the control ran
        del table[f"fine-tuned at l (control): {label}"]
    assert "no control fine-tuned at l" in study_verdicts.extension_at_l(results).sentence
    for label in ("xpos", "xpos + BCA"):
        control = copy.deepcopy(table[f"fine-tuned at 4l: {label}"])
        control["512"]["values"] = [v + 0.01 for v in control["512"]["values"]]
        table[f"fine-tuned at l (control): {label}"] = control
    sentence = study_verdicts.extension_at_l(results).sentence
    assert ("+0.010 [0.010, 0.010] for xpos (above 0; the fine-tune lower in every seed)"
            in sentence)


def test_the_dynamic_and_tuned_yarn_rows_are_read_when_they_exist():
    """Claim 13's new rows: the YaRN fine-tune past 4l with s growing with the length against its
    fixed s = 4, and YaRN's tuned ends against LLaMA's, each seed by seed with a t interval."""
    results = study_verdicts.Results()
    table = results.extension["table"]
    for name in [n for n in table if " dynamic " in n or " a=" in n]:  # as before they ran
        del table[name]
    del results.extension["yarn"]
    assert study_verdicts.extension_dynamic(results).sentence.startswith("No YaRN fine-tune")
    assert "has not been scored" in study_verdicts.extension_tuned(results).sentence
    fixed = "fine-tuned at 4l: rope + yarn s=4 from 128"
    dynamic = copy.deepcopy(table[fixed])
    for column, step in (("1024", 0.2), ("2048", -0.1)):
        dynamic[column]["values"] = [v - step for v in dynamic[column]["values"]]
    table["fine-tuned at 4l: rope + yarn dynamic from 128"] = dynamic
    sentence = study_verdicts.extension_dynamic(results).sentence
    assert ("rope + yarn dynamic from 128 at 8l 0.200 [0.200, 0.200] (above 0, dynamic lower in "
            "every seed)") in sentence
    assert "at 16l −0.100 [−0.100, −0.100] (below 0, dynamic lower in no seed)" in sentence
    grid = {f"{a:g},{b:g}": {"mean": 20.0} for a, b in ((1, 32), (0.5, 8))}
    results.extension["yarn"] = {"alpha": 0.5, "beta": 8.0, "chosen": "chosen here", "grid": grid}
    tuned = copy.deepcopy(table[fixed])
    tuned["512"]["values"] = [v + 0.01 * i for i, v in enumerate(tuned["512"]["values"])]
    table[fixed + " a=0.5 b=8"] = tuned
    sentence = study_verdicts.extension_tuned(results).sentence
    assert "fine-tuned −0.010 [" in sentence and "tuned lower in no seed" in sentence
    assert "α = 0.5, β = 8" in study_verdicts.extension_yarn(results).sentence


def test_claim_13_retrieval_tells_apart_only_what_its_instances_can():
    """One seed: a fine-tune is above or below zero-shot xpos + BCA only where the Wilson
    intervals over the instances (32 per distance, 8 distances up to 4l: 256) do not overlap:
    0.60 against 0.40 is above ([0.539, 0.658] against [0.341, 0.462]), 0.43 is not told apart,
    0.20 is below."""
    distances = [32, 64, 96, 128, 192, 256, 384, 512, 768]  # the last past 4l: not counted

    def rows(ckpt, label, acc):
        return [dict(kind="distance", d=d, task="copy", label=label, ckpt=ckpt,
                     accuracy=acc if d <= 512 else 0.0) for d in distances]

    found = [("xpos.tasks.json", {"sequences": 32, "rows": rows(
                 "runs/xpos_s1337/ckpt.pt", "xpos + BCA", 0.40)})]
    table = {"zero-shot: xpos + BCA": {"copy": {"within": 0.40}}}
    for name, acc in (("up", 0.60), ("same", 0.43), ("down", 0.20)):
        found.append((f"{name}.tasks.json", {"sequences": 32, "rows": rows(
            f"runs/extension/xpos_{name}_s1337/ckpt.pt", name, acc)}))
        table[f"fine-tuned at 4l: {name}"] = {"copy": {"within": acc}}
    results = study_verdicts.Results()
    results.extension = {"task_suite": {"table": table, "seeds": [1337],
                                        "recipe": {"block_size": 128}}}
    original = results.raw
    results.raw = lambda suite, pattern: (found if suite == "extension" else
                                          original(suite, pattern))
    sentence = study_verdicts.extension_retrieval(results).sentence
    assert "up: above on copy (0.600 against 0.400)" in sentence
    assert "same: not told apart on copy (0.430 against 0.400)" in sentence
    assert "down: below on copy (0.200 against 0.400)" in sentence
    assert sentence.startswith("On retrieval (one seed; the zero-shot rows on the fine-tunes' "
                               "source checkpoints")


@pytest.mark.parametrize("right, n, p", [(1, 1, 0.038), (3, 10, 0.1), (0, 5, 0.2),
                                         (40, 100, 1 / 52), (7, 400, 0.019)])
def test_binomial_tail_against_brute_force(right, n, p):
    """P(X >= right), X ~ Binomial(n, p), summed term by term with exact integers."""
    from fractions import Fraction
    q = Fraction(p)
    exact = sum(math.comb(n, k) * q ** k * (1 - q) ** (n - k) for k in range(right, n + 1))
    assert study_verdicts.binomial_tail(right, n, p) == pytest.approx(float(exact), rel=1e-9)


def test_one_right_answer_is_not_relay_above_chance():
    """One relay answer of one, right, at MQAR's chance 1/26: a Wilson interval's lower bound
    (0.085 at the Bonferroni z) would call it above chance; the exact test (p = 1/26, against
    0.025 over the distances tested) does not, so it cannot be the farthest distance."""
    relay = {64: (40, 100), 72: (30, 100), 200: (1, 1)}
    results = with_sweeps(study_verdicts.Results(), [sweep_file("xpos_s1337", relay, 128)])
    assert "the farthest at d = 72" in study_verdicts.sweep_relay(results).sentence


def test_the_short_relay_verdict_states_a_shared_bound_once():
    two = [sweep_file("xpos_s1337", {64: (40, 100)}, 128),
           sweep_file("rope_s1337", {64: (40, 100)}, 128)]
    sentence = study_verdicts.sweep_relay(with_sweeps(study_verdicts.Results(), two),
                                          short=True).sentence
    assert sentence.count("BCA's reach bound") == 1
    deeper = [two[0], sweep_file("xpos_4layer_s1337", {64: (40, 100)}, 256)]
    sentence = study_verdicts.sweep_relay(with_sweeps(study_verdicts.Results(), deeper),
                                          short=True).sentence
    assert "128 to 191 tokens" in sentence and "256 to 319 tokens" in sentence


def test_sweep_zones_read_the_summary_per_task():
    """Each zone's seed-mean under BCA, and under the windows each task's own range of direct
    and its most relay (tasks of different chance are not pooled into one range)."""
    def cell(mean):
        return {"mean": mean, "n": 1, "of": 1, "values": [mean]}

    results = study_verdicts.Results()
    results.rerun = {"sweep": {
        "xpos + BCA": {"copy direct": cell(0.9), "copy relay": cell(0.06),
                       "copy beyond": cell(0.02), "mqar direct": cell(1.0),
                       "mqar relay": cell(0.09), "mqar beyond": cell(0.03)},
        "xpos + sliding W=128": {"copy direct": cell(0.5), "copy relay": cell(0.01),
                                 "mqar direct": cell(0.97), "mqar relay": cell(0.05)},
        "xpos + sinks S=4 W=128": {"copy direct": cell(0.6), "copy relay": cell(0.02),
                                   "mqar direct": cell(0.99), "mqar relay": cell(0.04)}}}
    sentence = study_verdicts.sweep_zones(results).sentence
    assert "xpos (one seed): under BCA copy 0.90 direct, 0.06 relay, 0.02 beyond" in sentence
    assert "copy 0.50 to 0.60 direct, 0.02 relay or less" in sentence
    assert "MQAR 0.97 to 0.99 direct, 0.05 relay or less" in sentence


def test_past_4l_ranks_every_row_at_or_above_bca_ties_included():
    results = study_verdicts.Results()
    table = {"zero-shot: xpos + BCA": {"passkey": {"past": 0.0}},
             "zero-shot: rope + yarn": {"passkey": {"past": 0.0}},
             "fine-tuned at 4l: xpos": {"passkey": {"past": 0.1}},
             "fine-tuned at 4l: xpos + BCA": {"passkey": {"past": 0.0}}}
    results.extension = {"task_suite": {"table": table, "seeds": [1337]}}
    sentence = study_verdicts.extension_retrieval_past(results).sentence
    assert sentence.endswith("passkey: fine-tuned xpos 0.100, zero-shot rope + yarn 0.000, "
                             "fine-tuned xpos + BCA 0.000, zero-shot xpos + BCA 0.000")
