"""Copying across requests: a bounded index of recent token sequences (prompts and outputs of
earlier requests) proposes the most frequent continuation of the longest match.

Agents, editors and chat sessions send the same code and text again and again; prompt lookup
only sees the current sequence. Proposals are verified like any copied tokens, so the cache
can only change speed, never output.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np

from runtime.drafters.base import Drafter, Proposal
from runtime.drafters.prompt_lookup import PromptLookupDrafter, match_class
from runtime.gamma import MAX_GAMMA


@dataclass(frozen=True)
class SuffixSettings:
    max_tokens: int = 1 << 16  # tokens kept, over all sequences
    key_len: int = 2  # the n-gram that finds candidate matches (prompt lookup's shortest)
    max_hits: int = 64  # most recent candidates looked at per lookup
    max_match: int = 32  # tokens a match is extended back at most
    # Share of the longest matches that must agree on each drafted token; 0: follow the most
    # frequent continuation while any match goes on (the policy's α per match length sets γ).
    min_support: float = 0.0
    # A longer match earns a longer draft (at the shortest match as many as prompt lookup drafts).
    tokens_per_match: float = 4.0

    def __post_init__(self):
        if (self.max_tokens < 1 or self.key_len < 1 or self.max_hits < 1 or self.max_match < self.key_len
                or not 0.0 <= self.min_support <= 1.0 or self.tokens_per_match <= 0):
            raise ValueError(f"bad suffix index settings: {self}")


class SuffixIndex:
    """Every key_len-gram of the kept sequences maps to the positions that follow it; a lookup
    extends each hit backwards to its match length, keeps the longest, and follows their
    continuations while enough of them agree. Holds at most max_tokens tokens: the oldest
    sequence is evicted first."""

    def __init__(self, settings: SuffixSettings = SuffixSettings()):
        self.settings = settings
        self.docs: OrderedDict[int, list[int]] = OrderedDict()
        self._digests: dict[bytes, int] = {}
        self._index: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # key -> (doc, start of continuation), oldest first
        self.n_tokens = 0
        self._next_doc = 0

    def __len__(self) -> int:
        return len(self.docs)

    def add(self, tokens) -> None:
        """Keep a finished sequence. One that extends a kept sequence (the next turn of a chat)
        replaces it, and an exact repeat only refreshes its age, so a conversation is held once."""
        tokens = [int(t) for t in tokens][-self.settings.max_tokens :]
        if len(tokens) <= self.settings.key_len:
            return
        digest = self._digest(tokens)
        if digest in self._digests:
            self.docs.move_to_end(self._digests[digest])
            return
        for doc in list(self.docs)[-8:]:  # a conversation's previous turn is among the latest
            kept = self.docs[doc]
            if len(kept) < len(tokens) and tokens[: len(kept)] == kept:
                self._remove(doc)
        doc, self._next_doc = self._next_doc, self._next_doc + 1
        self.docs[doc] = tokens
        self._digests[digest] = doc
        self.n_tokens += len(tokens)
        for start in range(self.settings.key_len, len(tokens)):
            self._index.setdefault(tuple(tokens[start - self.settings.key_len : start]), []).append((doc, start))
        while self.n_tokens > self.settings.max_tokens:
            self._remove(next(iter(self.docs)))

    def _digest(self, tokens: list[int]) -> bytes:
        return hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()

    def _remove(self, doc: int) -> None:
        tokens = self.docs.pop(doc)
        self.n_tokens -= len(tokens)
        self._digests.pop(self._digest(tokens), None)
        for key in {tuple(tokens[start - self.settings.key_len : start]) for start in range(self.settings.key_len, len(tokens))}:
            hits = [hit for hit in self._index[key] if hit[0] != doc]
            if hits:
                self._index[key] = hits
            else:
                del self._index[key]

    def continuation(self, context, limit: int, live=None) -> tuple[list[int], int]:
        """Up to `limit` tokens to follow `context`, and the match length they rest on (0: no
        match). `live`: the current sequence, searched too (as prompt lookup does) except for
        its own final suffix."""
        context = np.asarray(context, dtype=np.int64)
        if limit < 1 or len(context) < self.settings.key_len:
            return [], 0
        key = tuple(int(t) for t in context[-self.settings.key_len :])
        sources = [(self.docs[doc], start) for doc, start in self._index.get(key, ())[-self.settings.max_hits :]]
        live_list = None
        if live is not None:
            live = np.asarray(live, dtype=np.int64)
            n = self.settings.key_len
            if len(live) > n:
                windows = np.lib.stride_tricks.sliding_window_view(live[: len(live) - 1], n)
                starts = np.flatnonzero((windows == context[-n:]).all(axis=1)) + n
                live_list = live.tolist()
                sources += [(live_list, int(s)) for s in starts[-self.settings.max_hits :]]
        if not sources:
            return [], 0
        tail = context[-self.settings.max_match :][::-1].tolist()  # newest first
        lengths = [self._match_length(seq, start, tail) for seq, start in sources]
        best = max(lengths)
        # Most recent first: on equal counts the latest text wins, as in prompt lookup.
        runs = [(seq, start) for (seq, start), n in zip(reversed(sources), reversed(lengths)) if n == best]
        live_runs = [run for run in runs if run[0] is live_list]
        if live_runs:
            # The request at hand knows its own text best: where it matches as long as any earlier
            # one, copy its latest occurrence, as prompt lookup does; earlier requests add the rest.
            runs = live_runs[:1]
        out: list[int] = []
        n_runs = len(runs)
        for depth in range(min(limit, int(np.ceil(self.settings.tokens_per_match * best)))):
            counts = Counter(seq[start + depth] for seq, start in runs if start + depth < len(seq))
            if not counts:
                break
            token, count = max(counts.items(), key=lambda item: item[1])  # max keeps the first (latest) on ties
            # count / n_runs estimates how often the whole continuation so far came next.
            if count < self.settings.min_support * n_runs:
                break
            out.append(token)
            runs = [(seq, start) for seq, start in runs if start + depth < len(seq) and seq[start + depth] == token]
        return out, best

    def _match_length(self, seq: list[int], start: int, tail: list[int]) -> int:
        n = 0
        while n < len(tail) and start - 1 - n >= 0 and seq[start - 1 - n] == tail[n]:
            n += 1
        return n


EARLIER = 8  # evidence classes of copies from earlier requests start here (the request's own: 1–5)


class SuffixDrafter(Drafter):
    """Prompt lookup over this sequence and a suffix index of the sequences before it: each
    sequence goes into the index when the next one starts. With own_text False it drafts only
    where an earlier request matches longer than this one's own text, leaving the rest to a
    prompt lookup beside it (auto+suffix).

    Each client has an index of its own (`serve`): a request copies only from what its own
    client sent or received, so what it drafts says nothing about other clients' text. The
    indexes share one budget of settings.max_tokens; the least recently served client's oldest
    sequences go first."""

    name = "suffix"

    def __init__(self, index: SuffixIndex, own_text: bool = True):
        # Measures the request's own match, against which a copy from earlier requests must win.
        self.lookup = PromptLookupDrafter(min_ngram=index.settings.key_len)
        self.index = index  # the index of the client being served
        self.client: str | None = None  # None: the one anonymous client (and a shared cache)
        self._indexes: OrderedDict[str | None, SuffixIndex] = OrderedDict({None: index})  # least recently served first
        self.own_text = own_text
        self._seen: np.ndarray | None = None  # the committed tokens of the sequence under way
        self._copied: tuple[bytes, list[int], int] | None = None  # the last continuation asked for

    def serve(self, client: str | None) -> None:
        """The next sequence is `client`'s: it copies from that client's earlier sequences only."""
        self._keep()
        if client == self.client:
            return
        if not self.index.docs and self.client is not None:
            del self._indexes[self.client]  # a client with nothing kept holds no index
        self.client = client
        if client not in self._indexes:
            self._indexes[client] = SuffixIndex(self.index.settings)
        self._indexes.move_to_end(client)
        self.index = self._indexes[client]
        self._copied = None

    def _keep(self) -> None:
        """The sequence under way goes into its client's index, within the budget of all."""
        if self._seen is None:
            return
        self.index.add(self._seen)
        self._seen = None
        total = sum(index.n_tokens for index in self._indexes.values())
        for client, index in list(self._indexes.items()):
            if total <= self.index.settings.max_tokens:
                break
            if index is self.index:
                continue  # bounded by its own add
            while index.docs and total > self.index.settings.max_tokens:
                oldest = next(iter(index.docs))
                total -= len(index.docs[oldest])
                index._remove(oldest)
            if not index.docs:
                del self._indexes[client]

    def accepted(self, tokens, n_accepted):
        self._seen = tokens

    def reset(self, tokens=(), prefill=True):
        self._copied = None
        self._keep()

    def forget(self):
        self._seen = None
        self._copied = None
        self.index = SuffixIndex(self.index.settings)
        self._indexes = OrderedDict({self.client: self.index})

    def _continuation(self, tokens: np.ndarray) -> tuple[list[int], int]:
        """The continuation for `tokens` (up to MAX_GAMMA: any shorter one is its prefix) and its
        match length; a round asks up to three times, so the last answer is kept until the
        tokens or the index change."""
        key = tokens.tobytes()
        if self._copied is None or self._copied[0] != key:
            if self.own_text:
                self._copied = (key, *self.index.continuation(tokens, MAX_GAMMA, live=tokens))
            else:
                # Earlier requests alone: where they match no longer than this request's own
                # text, the round is the prompt lookup's beside it.
                drafted, matched = self.index.continuation(tokens, MAX_GAMMA)
                self._copied = (key, drafted, matched) if matched > self.lookup.match(tokens)[1] else (key, [], 0)
        return self._copied[1], self._copied[2]

    def find(self, tokens, gamma):
        tokens = np.asarray(tokens, dtype=np.int64)
        return np.asarray(self._continuation(tokens)[0][:gamma], dtype=np.int64)

    def evidence(self, tokens):
        """The match length class, offset by EARLIER when the copy comes from an earlier request
        (it matches longer than the request's own text): text from other requests is another
        kind of evidence, so the policy learns its α apart and drafts with the model instead
        where such copies fail."""
        tokens = np.asarray(tokens, dtype=np.int64)
        own = self.lookup.match(tokens)[1]
        best = self._continuation(tokens)[1]
        return match_class(best) + (EARLIER if best > own else 0)

    def propose(self, tokens, gamma, sampling, rng):
        continuation = self.find(tokens, gamma)
        return Proposal(continuation, None) if len(continuation) else None


def serve_client(drafter: Drafter | None, client: str | None) -> None:
    """Tell every suffix cache among the drafter's parts whose sequence comes next."""
    for part in [] if drafter is None else drafter.parts():
        if isinstance(part, SuffixDrafter):
            part.serve(client)
