"""The seam's word rules (tierchain.restart) on a corpus of right continuations and restarts.

A false cut (a right continuation taken for a restart, so the caller loses words) is worse
than a repeat, so the corpus leans on right continuations that look like restarts:
stories whose sentences begin alike ("The keeper ... The keeper ..."), lists, a
continuation that repeats a phrase of the answer on purpose. Every story is cut after
each of its words; at each cut the right continuation is the story's own rest (as a
prefill continues it, and as a fresh message writes it: without its leading space), and
the restart is the cut sentence written again from its start, then the rest.

``python -m pytest -s tests/test_restart.py -k rate`` prints the rates docs/continuation.md
quotes.
"""

from __future__ import annotations

import re

from tierchain.restart import Restart

STORIES = [
    "In the year 1850, there was a lighthouse keeper named Jameson who lived on a rocky "
    "island in the Caribbean. Every night he climbed the stairs to light the lamp before the "
    "storm came. The ships passed safely, and nobody ever knew his name.",
    "The keeper climbed the stairs. The keeper lit the lamp. The keeper watched the sea until "
    "dawn. Then the keeper climbed down the stairs and slept until noon.",
    "Once upon a time there was a small fox who lived at the edge of a wood. The fox was "
    "hungry, so the fox went to the farm. At the farm the fox found a hen, and the hen found "
    "the fox. They became friends, and the fox never went hungry again.",
    "To make bread, mix the flour with the water. Then mix the flour with the salt and the "
    "yeast. Knead the dough for ten minutes. Let the dough rise for an hour. Bake the bread "
    "at two hundred degrees for forty minutes.",
    "Python is a programming language. Python is easy to read, and Python is used for web "
    "servers, data science and scripting. Many people learn Python as their first language.",
    "She opened the door. She saw the garden, the old oak tree and the bench where her "
    "grandmother used to sit. She sat on the bench and she remembered the summers of her "
    "childhood, one after another.",
    "The first step is to check the cable. The second step is to check the router. The third "
    "step is to call the provider, who will check the line from their side.",
    "Rain fell on the city all night. In the morning the streets were wet and the air was "
    "cold. People walked to work under grey umbrellas, and the rain kept falling.",
]

# Right continuations written to look like restarts: same sentence starts, repeated phrases.
TRICKY = [
    ("The keeper climbed the stairs. The keeper lit the lamp.", " The keeper climbed down."),
    ("He said yes. He said", " yes again, and he meant it."),
    ("Step one: mix the flour. Step two:", " mix the flour with the water again."),
    ("I love the sea. I love the sea", " more than anything else in the world."),
    ("The fox ran. The fox ran and ran.", " The fox ran until the sun went down."),
    ("Once upon a time there was a fox.", " Once upon a time there was also a hen."),
]

# Restarts in other words than the caller's (partial, restart, what the caller should read).
PARAPHRASED = [
    (
        "In the year 1850, there was a lighthouse keeper named Jameson who lived on a rocky "
        "island in the",
        "In the year 1850 there was a lighthouse keeper called Jameson, who lived on a rocky "
        "island in the Caribbean. He was alone.",
        " Caribbean. He was alone.",
    ),
    (
        "Once upon a time there was a small fox who lived at the edge of a wood. The fox was",
        "Once upon a time, there was a little fox who lived at the edge of a wood. The fox was "
        "hungry.",
        " hungry.",
    ),
    (
        "To make bread, mix the flour with the water. Then mix",
        "To make bread, you mix the flour with water. Then mix the salt in.",
        " the salt in.",
    ),
    (
        "She opened the door. She saw the garden, the old oak tree and the",
        "She opened the door. She saw the garden, the big oak tree and the bench.",
        " bench.",
    ),
    (
        "Rain fell on the city all night. In the morning the streets were",
        "Rain fell on the whole city all night long. In the morning the streets were wet.",
        " wet.",
    ),
]

_SENTENCE = re.compile(r"(?<=[.!?])\s+")


def joined(partial: str, continuation: str, *, fresh: bool) -> str:
    judged = Restart(partial, fresh=fresh).judge(continuation, final=True)
    assert judged is not None
    cut, insert = judged
    return partial + insert + continuation[cut:]


def cases() -> tuple[list[tuple[str, str, bool]], list[tuple[str, str, bool, str]]]:
    """(partial, continuation, fresh) right ones; (partial, restart, fresh, expected)."""
    right: list[tuple[str, str, bool]] = []
    restarts: list[tuple[str, str, bool, str]] = []
    for story in STORIES:
        words = story.split(" ")
        for n in range(1, len(words)):
            partial = " ".join(words[:n])
            rest = story[len(partial) :]  # " next words..."
            right.append((partial, rest, False))  # a prefill's continuation
            right.append((partial, rest[1:], True))  # a fresh message's
            starts = [m.end() for m in _SENTENCE.finditer(partial)]
            begin = starts[-1] if starts else 0
            restarted = partial[begin:] + rest
            if len(partial[begin:].split()) >= 3:
                restarts.append((partial, restarted, True, story))
                restarts.append((partial, restarted, False, story))
    for partial, restart, after in PARAPHRASED:
        restarts.append((partial, restart, True, partial + after))
    for partial, rest in TRICKY:
        right.append((partial, rest, False))
        right.append((partial, rest[1:], True))
    return right, restarts


def rates() -> tuple[int, int, int, int]:
    right, restarts = cases()
    false_cuts = sum(
        joined(p, c, fresh=f) != (p + c if not f else p + " " + c) for p, c, f in right
    )
    missed = sum(joined(p, c, fresh=f) != story for p, c, f, story in restarts)
    return false_cuts, len(right), missed, len(restarts)


def test_the_corpus_false_cut_and_missed_restart_rates(capsys):
    false_cuts, n_right, missed, n_restarts = rates()
    with capsys.disabled():
        print(
            f"\n[restart] right continuations: {n_right}, falsely cut: {false_cuts} "
            f"({100 * false_cuts / n_right:.1f} %); restarts: {n_restarts}, left in: "
            f"{missed} ({100 * missed / n_restarts:.1f} %)"
        )
    # The figures docs/continuation.md quotes.
    assert (false_cuts, n_right, missed, n_restarts) == (0, 586, 2, 467)


def test_the_issues_restart_is_cut_at_the_break_and_a_fresh_word_gets_its_space():
    partial = (
        "In the year 1850, there was a lighthouse keeper named Jameson who lived on a rocky "
        "island in the"
    )
    restart = partial + " Caribbean. Every night he climbed."
    assert joined(partial, restart, fresh=True) == partial + " Caribbean. Every night he climbed."
    assert joined(partial, "Caribbean.", fresh=True) == partial + " Caribbean."
    assert joined(partial + " Carib", "Caribbean.", fresh=True) == partial + " Caribbean."
    # A prefill's continuation is the model's own next token: never changed.
    assert joined(partial + " Carib", "bean.", fresh=False) == partial + " Caribbean."


def test_a_restart_that_never_reaches_the_break_is_cut_whole_then_the_rest_is_judged():
    partial = "The fox was hungry. The fox went to the farm"
    out = joined(
        partial, "The fox was hungry, the fox went to the barn. It found a hen.", fresh=True
    )
    assert out == partial + " It found a hen."


def test_text_is_held_only_while_it_may_still_be_a_restart():
    judge = Restart("The fox was hungry. The fox went", fresh=False).judge
    assert judge(" to the", final=False) is None  # not three whole words yet
    assert judge(" to the farm", final=False) is None  # the third word may go on
    assert judge(" to the farm and", final=False) == (0, "")  # begins no sentence: released
    assert judge("The fox was", final=False) is None
    assert judge("The fox was hungry", final=False) is None  # to its sentence's end
    assert judge("The fox was hungry. And", final=False) is None  # what follows: 3 words
    # The caller's first sentence word for word: cut; what follows starts afresh.
    assert judge("The fox was hungry. And then it ran", final=False) == (20, " ")
    # All restart, and the stream ended: all of it cut.
    assert judge("The fox was hungry.", final=True) == (len("The fox was hungry."), "")
