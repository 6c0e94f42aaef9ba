"""The seam's word rules: does a continuing tier's first text restart the answer?

A model asked to finish an answer in words (no prefill) often starts again instead:
the caller has "...who lived on a rocky island in the" and the next tier writes "In
the year 1850, there was a lighthouse keeper named Jameson who lived on a rocky
island in the Caribbean." Its bytes are not the caller's (a paraphrase, other
punctuation), so an exact-repeat rule misses it, and the restart is glued to the
cut word. :class:`Restart` judges the next tier's first text, as it comes, by words:

- **A restart** is a first sentence that begins with the first ``START_WORDS`` (3)
  words of one of the caller's sentences and whose word pairs are at least
  ``OVERLAP`` (60 %) found in the caller's text from that sentence on. It is cut:
  through the place where the caller's last words (``TAIL_WORDS``, 4, the last one
  perhaps cut mid-word) are found in it, so that what follows continues the
  caller's text ("...in the" + " Caribbean."); where they are not found, the whole
  restarted sentence, and the next one is judged the same way. A continuation that
  is all restart is all cut: the stream then ends as the next tier ends it.
- **A word cut at the break** is completed, not glued: when the next tier starts
  afresh (asked in words, or after a cut sentence), the caller's text ends in a
  word character and the new text starts with one, either the new text's first word
  completes the caller's last one ("Carib" + "Caribbean" is "Caribbean": its first
  letters are cut) or a space goes in between ("in the" + "Caribbean"). A
  continuation of a prefill is the model's own next token: it is never changed
  there ("Carib" + "bean" stays "Caribbean").

Anything else passes as it came. The first text is held only while it could still
be a restart: once its first three words begin none of the caller's sentences it is
released (a right continuation waits for three words); one that does is held to the
end of its first sentence, or ``HOLD_LIMIT`` (600) characters. A false cut (a right
continuation taken for a restart) is worse than a repeat, so the rule asks for both a
sentence's start and most of its word pairs; docs/continuation.md quotes how often it
misfires on a corpus of right continuations and restarts (tests/test_restart.py).
"""

from __future__ import annotations

import re
from itertools import pairwise

__all__ = ["HOLD_LIMIT", "MIN_PAIRS", "OVERLAP", "START_WORDS", "TAIL_WORDS", "Restart"]

START_WORDS = 3
OVERLAP = 0.75
MIN_PAIRS = 4
TAIL_WORDS = 4
HOLD_LIMIT = 600

_WORD = re.compile(r"\w+")
_SENTENCE_END = re.compile(r"[.!?]+[\"')\]]*(?=\s|$)|\n")
_SPLIT = re.compile(r"(?<=[.!?])[\"')\]]*\s+|\n+")
_OPENERS = "\"'(["


def _words(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


def _pairs(words: list[str]) -> set[tuple[str, str]]:
    return set(pairwise(words))


def _common(a: list[str], b: list[str]) -> int:
    """The length of the longest common subsequence of two word lists."""
    row = [0] * (len(b) + 1)
    for x in a:
        diagonal = 0
        for j, y in enumerate(b, 1):
            above = row[j]
            row[j] = diagonal + 1 if x == y else max(row[j], row[j - 1])
            diagonal = above
    return row[-1]


class Restart:
    """The word rules for one seam: ``partial`` is the caller's answer text; ``fresh``:
    the next tier was asked in words (no prefill), so its first text starts afresh."""

    __slots__ = (
        "_follow",
        "_pairs_from",
        "_sentences",
        "_starts",
        "_tail",
        "_whole",
        "_words_from",
        "fresh",
        "partial",
    )

    def __init__(self, partial: str, *, fresh: bool) -> None:
        self.partial = partial
        self.fresh = fresh
        sentences = [s for s in _SPLIT.split(partial) if s and s.strip()]
        words = [_words(s) for s in sentences]
        self._sentences = words
        self._starts: list[tuple[str, ...]] = [tuple(w[:START_WORDS]) for w in words]
        # The words and word pairs of the caller's text from each sentence on.
        self._words_from: list[list[str]] = []
        self._pairs_from: list[set[tuple[str, str]]] = []
        for i in range(len(words)):
            joined = [w for sentence in words[i:] for w in sentence]
            self._words_from.append(joined)
            self._pairs_from.append(_pairs(joined))
        self._tail = words[-1][-TAIL_WORDS:] if words else []  # of its last sentence
        # A word the caller's text has whole before its last: not a cut word.
        self._whole = set(_words(partial)[:-1])
        stripped = partial.rstrip()
        # The punctuation after the caller's last word ("." of "Caribbean."): a restart
        # aligned on that word may repeat it too.
        self._follow = stripped[len(stripped) - len(re.search(r"\W*$", stripped)[0]) :]  # type: ignore[index]

    def judge(self, text: str, *, final: bool) -> tuple[int, str] | None:
        """What to do with the next tier's first ``text``: ``(cut, insert)``, its first
        ``cut`` characters left out and ``insert`` put before the rest; None: hold it
        and ask again with more (``final``: no more text is coming)."""
        pos = 0
        fresh = self.fresh
        while True:
            rest = text[pos:]
            found = list(_WORD.finditer(rest))
            enough = len(found) > START_WORDS or (
                len(found) == START_WORDS and found[-1].end() < len(rest)
            )
            if not enough and not final and len(rest) < HOLD_LIMIT:
                return None  # not yet three whole words
            start = tuple(m.group().lower() for m in found[:START_WORDS])
            begins = [i for i, s in enumerate(self._starts) if s == start]
            if len(start) < START_WORDS or not begins:
                return self._joined(pos, rest, fresh)
            end = _SENTENCE_END.search(rest, found[START_WORDS - 1].end())
            if end is None and not final and len(rest) < HOLD_LIMIT:
                return None  # it may be a restart: hold to the end of its first sentence
            upto = end.end() if end is not None else len(rest)
            at = self._aligned(rest, upto)
            if not self._restarts(rest[: upto if at is None else at], begins[0], at is not None):
                return self._joined(pos, rest, fresh)
            if at is not None:
                return pos + at, ""
            # A restarted sentence that never reaches the break: cut it whole, and judge
            # what follows it as a fresh start.
            upto += len(rest[upto:]) - len(rest[upto:].lstrip())
            pos += upto
            fresh = True
            if pos >= len(text):
                return (pos, "") if final or len(text) >= HOLD_LIMIT else None

    def _restarts(self, span: str, sentence: int, aligned: bool) -> bool:
        """True when ``span`` (the next tier's first sentence, or its text up to the
        caller's last words) says again what the caller has from ``sentence`` on: as a
        whole, the same words in the same order (``OVERLAP`` of its words in a common
        subsequence); else, a sentence of at least ``MIN_PAIRS`` word pairs, that share
        of them found in the caller's text, or the same words as that whole sentence."""
        words = _words(span)
        if aligned:
            theirs = self._words_from[sentence][: 2 * len(words) + TAIL_WORDS]
            return len(words) >= START_WORDS and _common(words, theirs) >= OVERLAP * len(words)
        if words == self._sentences[sentence] and sentence < len(self._sentences) - 1:
            return True  # a whole sentence of the caller's, word for word
        pairs = _pairs(words)
        known = self._pairs_from[sentence]
        return len(pairs) >= MIN_PAIRS and len(pairs & known) >= OVERLAP * len(pairs)

    def _aligned(self, rest: str, upto: int) -> int | None:
        """Where the caller's text goes on inside a restart ``rest``: just after its last
        words are found in its first sentence (``rest[:upto]``; None: they are not)."""
        tail = self._tail
        if not tail:
            return None
        found = [m for m in _WORD.finditer(rest) if m.start() < upto]
        words = [m.group().lower() for m in found]
        n = len(tail)
        for i in range(len(words) - n + 1):
            if words[i : i + n - 1] != tail[:-1]:
                continue
            last = words[i + n - 1]
            if last == tail[-1]:
                at = found[i + n - 1].end()
            elif last.startswith(tail[-1]) and not self.partial[-1:].isspace():
                at = found[i + n - 1].start() + len(tail[-1])  # the caller's cut word
            else:
                continue
            after = rest[at:]
            follow = self._follow
            if follow and after.startswith(follow):
                at += len(follow)
                after = rest[at:]
            if self.partial[-1:].isspace():
                at += len(after) - len(after.lstrip())
            return at
        return None

    def _joined(self, pos: int, rest: str, fresh: bool) -> tuple[int, str]:
        """``rest`` goes on from the caller's text: a fresh start's first word completes
        the caller's cut word, or a space goes in between (see the module docstring)."""
        partial = self.partial
        if not fresh or not rest or not partial or partial[-1].isspace() or rest[0].isspace():
            return pos, ""
        if not (partial[-1].isalnum() or partial[-1] in ".!?,;:"):
            return pos, ""
        cut = re.search(r"\w+$", partial)
        first = _WORD.match(rest)
        if cut is not None and first is not None and partial[-1].isalnum():
            fragment, word = cut.group().lower(), first.group().lower()
            if (
                len(word) > len(fragment)
                and word.startswith(fragment)
                and fragment not in self._whole
            ):
                return pos + len(fragment), ""  # the caller's cut word, completed
        if rest[0].isalnum() or rest[0] in _OPENERS:
            return pos, " "
        return pos, ""
