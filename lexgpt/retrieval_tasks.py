"""
The long-range task suite: synthetic tasks, generated from a seed, on which small models do learn
to retrieve, so that retrieval beyond the training length can be measured for every position
scheme and inference-time rule (natural text at this scale gives almost no pressure to copy:
docs/retrieval.md).

    python prepare_data.py --dataset task --tasks all --block_size 128  # records, data/task_char
    python train.py config/retrieval.py --pos=xpos ...                   # as any dataset
    python study/eval_retrieval.py --ckpt CKPT --task copy [--attention ...] [--rope_scaling ...]

Every instance is text in one character vocabulary (CHARS), so a task dataset is an ordinary char
dataset. Each has answer characters, scored by whether the model's most likely next token is the
right one given the true text before it (teacher forcing; for the passkey, whether all five digits
are right), and a distance: how far the answer sits from what it must retrieve.

  copy           "<" a span of r letters, a gap of random digits, ">" the span again (answers:
                 the second span). Distance: from the span's first letter to its copy's.
  mqar           multi-query associative recall (Arora et al. 2023, Zoology): n key-value pairs
                 (upper-case key, lower-case value), a gap, "?", then every key again in a new
                 order, each followed by its value (answers: the values). Distance: from the
                 first pair to the first query.
  passkey        Mohtashami & Jaggi (2023): their repeated filler ("The grass is green. ..."), the
                 key sentence at some depth, the question; the answer is the five-digit key.
                 Distance: key to answer.
  passkey_noise  the same with random letters as filler.
  flipflop       flip-flop language modelling (Liu et al. 2023): instructions w (write), r (read),
                 i (ignore), each with a bit; after r the bit is the last one written (answers:
                 the bits read). Training draws FFL(0.8) (w and r with probability 0.1 each),
                 half the records ending in a long gap (below). Distance: from the last write to
                 the read.

Training records (prepare_data.py) are block_size + 1 characters each, with the distance drawn
uniformly over what fits. Evaluation builds instances at a given distance (a short noise prefix
first, so that no source sits among the first tokens that attention sinks keep) or at a given total
length (the instance at a distance of half the training length, after noise that fills the
length).
"""

import string

import numpy as np
import torch

from alternatives import RopeScaling
from lexgpt.data import PASSKEY_CHARS, PASSKEY_QUESTION, PASSKEY_SENTENCE

TASKS = ("copy", "mqar", "passkey", "passkey_noise", "flipflop")
CHARS = sorted(set(" .?<>" + string.digits + string.ascii_letters) | PASSKEY_CHARS)
LETTERS, DIGITS = string.ascii_letters, string.digits
SPANS = (4, 16)  # copy: span lengths drawn in training; evaluation uses SPAN
SPAN = 8
PAIRS = (2, 8)  # mqar: key-value pairs drawn in training; evaluation uses PAIR_COUNT
PAIR_COUNT = 6
KEY_DIGITS = 5
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")  # M&J's
P_WRITE = P_READ = 0.1  # flip-flop's FFL(0.8)
# flip-flop: the share of training records that end in a read at a drawn distance (FFL(0.8) alone
# almost never leaves a gap of 64; Liu et al. 2023 mix in sparse FFL(0.98) sequences to remove
# long-range glitches)
SPARSE = 0.5
PREFIX = 16  # noise before an instance evaluated at a given distance
# records of each task per turn: the two that match content with content learn slowest (copy
# alone: 0.95 after 64,000 records; in an even five-way mix, 0.5)
SHARE = dict(copy=2, mqar=2, passkey=1, passkey_noise=1, flipflop=1)
# accuracy of a uniform guess among the answers' own alphabet
CHANCE = dict(copy=1 / len(LETTERS), mqar=1 / 26, passkey=0.1 ** KEY_DIGITS,
              passkey_noise=0.1 ** KEY_DIGITS, flipflop=0.5)


def draw(rng, alphabet, n):
    return "".join(alphabet[i] for i in rng.integers(0, len(alphabet), size=n))


def noise(rng, n):
    return draw(rng, DIGITS, n)


def copy(rng, length, distance=None):
    """(text, answer positions): noise, "<" span, gap, ">" span, `length` characters in all."""
    if distance is None:
        r = int(rng.integers(SPANS[0], min(SPANS[1], (length - 2) // 2) + 1))
        distance = int(rng.integers(r + 1, length - r))
    else:
        r = SPAN
    if not r + 1 <= distance <= length - r - 1:
        raise ValueError(f"copy: distance {distance} does not fit a span of {r} in {length} "
                         "characters")
    span = draw(rng, LETTERS, r)
    gap = noise(rng, distance - r - 1)
    body = "<" + span + gap + ">" + span
    return noise(rng, length - len(body)) + body, list(range(length - r, length))


def mqar(rng, length, distance=None):
    """(text, answer positions): noise, n pairs, gap, "?", the n keys again each with its value."""
    n = int(rng.integers(PAIRS[0], PAIRS[1] + 1)) if distance is None else PAIR_COUNT
    n = min(n, (length - 1) // 4)
    if distance is None:
        distance = int(rng.integers(2 * n + 1, length - 2 * n + 1))
    keys = rng.choice(list(string.ascii_uppercase), size=n, replace=False)
    values = draw(rng, string.ascii_lowercase, n)
    pairs = "".join(k + v for k, v in zip(keys, values))
    order = rng.permutation(n)
    queries = "".join(keys[i] + values[i] for i in order)
    if not 2 * n + 1 <= distance <= length - 2 * n:
        raise ValueError(f"mqar: distance {distance} does not fit {n} pairs in {length} characters")
    body = pairs + noise(rng, distance - 2 * n - 1) + "?" + queries
    return noise(rng, length - len(body)) + body, [length - 2 * n + 2 * i + 1 for i in range(n)]


def filler(rng, n, repeated):
    if not repeated:
        return draw(rng, string.ascii_lowercase + " ", n)
    phase = int(rng.integers(0, len(FILLER)))
    return (FILLER * (n // len(FILLER) + 2))[phase : phase + n]


def passkey(rng, length, distance=None, repeated=True):
    """(text, answer positions): filler with the key sentence inside, then the question and the
    key."""
    key = draw(rng, DIGITS, KEY_DIGITS)
    sentence, question = PASSKEY_SENTENCE.format(key=key), PASSKEY_QUESTION + " "
    to_key = sentence.index(key)  # the key's place in its sentence
    fixed = len(sentence) + len(question) + KEY_DIGITS
    room = length - fixed  # filler characters in all
    shortest = len(sentence) - to_key + len(question)  # the key sentence right before the question
    if distance is None:
        distance = int(rng.integers(shortest, shortest + room + 1))
    before = room - (distance - shortest)  # filler before the key sentence
    if not 0 <= before <= room:
        raise ValueError(f"passkey: distance {distance} does not fit in {length} characters")
    text = filler(rng, before, repeated) + sentence
    text += filler(rng, room - before, repeated) + question + key
    return text, list(range(length - KEY_DIGITS, length))


def flipflop(rng, length, distance=None):
    """(text, answer positions): "." then instruction-bit pairs, answers the bits after each r.
    Training: FFL(0.8), and in a share SPARSE of the records then a w, ignores and an r at a
    distance drawn uniformly over the even ones up to length - 4 (every gap up to the record's
    length equally often, where FFL(0.98) would put most reads at its end).
    Evaluation: FFL(0.8), then w, ignores and one r at the given (even) distance from the w: that
    read alone is scored. Training records begin with one or two "." at random, so that the
    instructions sit at either parity of position (a model trained on one parity reads worse than
    chance at the other); an evaluation instance begins with as many as make its length come
    out."""
    scored = distance is not None
    if not scored and rng.random() < SPARSE:
        # room for two "." and the read's bit
        distance = 2 * int(rng.integers(1, (length - 4) // 2 + 1))
    elif scored and not (distance >= 2 and distance % 2 == 0 and distance + 3 <= length):
        raise ValueError(f"flipflop: distance {distance} must be even, >= 2, and fit in {length} "
                         "characters")
    tail = 0 if distance is None else distance + 2  # the w ... r at the distance, and the bit read
    pad = 1 + (length - 1 - tail) % 2 if scored else 1 + int(rng.integers(0, 2))
    p = [P_WRITE, P_READ, 1 - P_WRITE - P_READ]
    ops = list(rng.choice(["w", "r", "i"], size=(length - pad - tail) // 2, p=p))
    if distance is not None:
        ops += ["w"] + ["i"] * (distance // 2 - 1) + ["r"]
    ops[0] = "w"  # a read always has a write before it
    if "r" not in ops:  # every record has an answer
        ops[-1] = "r"
    text = "." * pad
    answers = []
    last = None
    for op in ops:
        if op == "w":
            last = str(rng.integers(0, 2))
        text += op + (last if op in "wr" else str(rng.integers(0, 2)))  # an ignored bit is noise
        if op == "r":
            answers.append(len(text) - 1)
    return text + "." * (length - len(text)), answers[-1:] if scored else answers


def passkey_noise(rng, length, distance=None):
    """The passkey with random letters as filler."""
    return passkey(rng, length, distance, repeated=False)


GENERATORS = dict(copy=copy, mqar=mqar, passkey=passkey, passkey_noise=passkey_noise,
                  flipflop=flipflop)


# evaluation instances: characters from the first answer to the end
ANSWER_FROM_END = dict(copy=SPAN, mqar=2 * PAIR_COUNT - 1, passkey=KEY_DIGITS,
                       passkey_noise=KEY_DIGITS, flipflop=1)


def layout(task):
    """(the shortest distance an instance of the task can have, the characters it needs beyond its
    distance)."""
    if task == "copy":
        return SPAN + 1, SPAN + 1
    if task == "mqar":
        return 2 * PAIR_COUNT + 1, 2 * PAIR_COUNT
    if task == "flipflop":
        return 2, 3  # and the "." it begins with
    sentence = PASSKEY_SENTENCE.format(key="0" * KEY_DIGITS)
    to_key = sentence.index("0" * KEY_DIGITS)
    return len(sentence) - to_key + len(PASSKEY_QUESTION) + 1, to_key + KEY_DIGITS


def shortest_record(task):
    """The fewest characters a training record of the task can have."""
    sentence = PASSKEY_SENTENCE.format(key="0" * KEY_DIGITS)
    shortest = dict(copy=2 * SPANS[0] + 2, mqar=4 * PAIRS[0] + 1, flipflop=6,
                    passkey=len(sentence) + len(PASSKEY_QUESTION) + 1 + KEY_DIGITS)
    return shortest[task.replace("_noise", "")]


def at_distance(task, rng, distance):
    """An evaluation instance whose answers sit `distance` from their source, after PREFIX
    characters of noise."""
    return GENERATORS[task](rng, PREFIX + distance + layout(task)[1], distance)


def at_length(task, rng, length, distance):
    """An evaluation instance of `length` characters in all: the task at `distance`, after noise
    that fills it."""
    return GENERATORS[task](rng, length, distance)


def at_phase(task, rng, distance, prefix, half, phase):
    """An evaluation instance where a window rule acts: the task at `distance`, after at least
    `prefix` characters of noise, its first answer predicted by a query (the token before it) at
    `phase` modulo `half` (BCA's segment), then digits up to a length that does not depend on the
    phase, so that instances of one distance batch together (what follows the answers cannot
    change their causal predictions)."""
    extra, to_end = layout(task)[1], ANSWER_FROM_END[task]
    length = prefix + distance + extra
    length += (phase - (length - to_end - 1)) % half
    text, answers = GENERATORS[task](rng, length, distance)
    return text + noise(rng, prefix + distance + extra + half - 1 - length), answers


def sources(task, text, answers, distance):
    """Where each answer's information sits in the text: copy's letter in the first span, MQAR's
    value in its pair, the passkey's digit in the key sentence, flip-flop's bit at its last write.
    An answer at p is predicted by the query at p - 1, which must see its source."""
    # keys are the only upper-case letters: a query's key first occurs in its pair
    if task == "mqar":
        return [text.index(text[p - 1]) + 1 for p in answers]
    if task.startswith("passkey"):  # digits occur only in the key sentence and the answer
        key = text.index(text[answers[0] : answers[0] + KEY_DIGITS])
        return [key + i for i in range(len(answers))]
    # copy and flip-flop: every answer `distance` after its source
    return [p - distance for p in answers]


def ids(text):
    """The token ids (uint16) of a text in CHARS, through a table of the ASCII codes."""
    lookup = np.zeros(128, dtype=np.uint16)
    lookup[[ord(c) for c in CHARS]] = np.arange(len(CHARS))
    return lookup[np.frombuffer(text.encode("ascii"), dtype=np.uint8)]


def parse_tasks(text, flag="--tasks"):
    """A comma-separated list of task names, or "all" (flag: the script's name for the list)."""
    names = list(TASKS) if text == "all" else text.split(",")
    unknown = [n for n in names if n not in TASKS]
    if unknown or not names:
        named = ", ".join(n or "an empty name" for n in unknown)
        raise ValueError(f"{flag} {text!r}: {named} not allowed: the tasks are "
                         f"{', '.join(TASKS)} (or all)")
    return list(dict.fromkeys(names))


def records(names, length, first, count, rng):
    """Training records first .. first + count - 1 of `length` characters, the tasks in turn (SHARE
    of each): token ids of CHARS (uint16), and a byte per token, 1 where it is an answer (the
    targets train.py's loss is on)."""
    turn = [name for name in names for _ in range(SHARE[name])]
    made = (GENERATORS[turn[i % len(turn)]](rng, length) for i in range(first, first + count))
    texts, answers = zip(*made)
    scored = np.zeros((count, length), dtype=np.uint8)
    for row, positions in enumerate(answers):
        scored[row, positions] = 1
    return ids("".join(texts)), scored.reshape(-1)


# -------------------------------------------------------------------------------------------------
# Scoring: accuracy at the answers, teacher-forced.


def encode(texts):
    """(B, T) token ids of equal-length texts."""
    return torch.from_numpy(ids("".join(texts)).astype(np.int64).reshape(len(texts), -1))


@torch.no_grad()
def predictions(model, idx, first, attention, rope_scaling):
    """The most likely token at every position from `first` on ((B, T - first)), given the true
    tokens before it: one pass over the inputs, as eval_extrapolate.py scores them. Under dynamic
    NTK as generation runs it: the text before `first` in one pass, then token by token through the
    KV cache, each at the factor of its own length."""
    if isinstance(rope_scaling, RopeScaling):
        scaling = rope_scaling
    else:
        scaling = RopeScaling(rope_scaling or "none")
    if scaling.method == "dynamic_ntk":  # alternatives: the factor follows the length
        cache = model.new_cache(idx.size(1) - 1, attention, rope_scaling)
        states = [model.hidden_states(idx[:, :first], cache=cache)[:, -1:]]
        states += [model.hidden_states(idx[:, t : t + 1], cache=cache)
                   for t in range(first, idx.size(1) - 1)]
        x = torch.cat(states, dim=1)
    else:
        x = model.hidden_states(idx[:, :-1], attention, rope_scaling)[:, first - 1 :]
    return model.logits(x).argmax(-1)


def right_answers(model, task, instances, attention, rope_scaling, device, ctx):
    """Per instance [(text, answer positions)] of one length, whether each answer is predicted
    right; for the passkey one entry, whether every digit of the key is."""
    texts, positions = zip(*instances)
    first = min(min(p) for p in positions)
    idx = encode(texts)
    with ctx:
        predicted = predictions(model, idx.to(device), first, attention, rope_scaling).cpu()
    right = [[bool(predicted[b, p - first] == idx[b, p]) for p in ps]
             for b, ps in enumerate(positions)]
    return [[all(r)] for r in right] if task.startswith("passkey") else right


def accuracy(model, task, instances, attention, rope_scaling, device, ctx):
    """(accuracy, answers scored, by place) over instances [(text, answer positions)] of one
    length: the share of answers predicted right, or for the passkey of keys with every digit
    right; by place, the answers right at each place in an instance (for MQAR the i-th query's),
    as a list of (right, scored)."""
    right = right_answers(model, task, instances, attention, rope_scaling, device, ctx)
    flat = [r for rs in right for r in rs]
    places = [[rs[i] for rs in right if i < len(rs)] for i in range(max(map(len, right)))]
    return sum(flat) / len(flat), len(flat), [(sum(p), len(p)) for p in places]


def by_elimination(n):
    """MQAR accuracy at each query of n when a model does not look the key up but picks one of the
    values not yet asked for: 1/(n - i) at the i-th query (from 0; the values taken as distinct).
    A model whose accuracy climbs this way across the queries has learned the elimination, not the
    association that Zoology's MQAR asks for."""
    return [1 / (n - i) for i in range(n)]
