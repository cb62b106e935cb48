"""The suffix index: longest match, most frequent continuation, bounded memory, one copy per conversation."""

import numpy as np
import pytest

from runtime.drafters.prompt_lookup import PromptLookupDrafter, match_class
from runtime.drafters.suffix import EARLIER, SuffixDrafter, SuffixIndex, SuffixSettings


def test_longest_match_wins_over_more_frequent_shorter_ones():
    index = SuffixIndex()
    index.add([7, 8, 1, 2, 3, 40, 41])  # matches the context on 3 tokens
    for _ in range(3):
        index.add([9, 2, 3, 50, 51, int(np.random.default_rng(_).integers(100, 200))])  # on 2 only, three times
    drafted, matched = index.continuation([5, 1, 2, 3], 8)
    assert matched == 3 and drafted[:2] == [40, 41]


def test_most_frequent_continuation_of_equal_matches_until_they_disagree():
    index = SuffixIndex(SuffixSettings(min_support=0.5))
    index.add([1, 2, 10, 11, 12, 13])
    index.add([3, 2, 10, 11, 12, 14])
    index.add([4, 2, 10, 11, 99, 98])
    # Every hit matches on (2, 10) only; 11 is unanimous, 12 has 2 of 3, then 13 vs 14 is 1 of 3 each.
    drafted, matched = index.continuation([0, 2, 10], 8)
    assert matched == 2 and drafted == [11, 12]
    # By default it follows the most frequent, then the latest, while any match goes on.
    index.settings = SuffixSettings()
    assert index.continuation([0, 2, 10], 8) == ([11, 12, 14], 2)


def test_draft_length_grows_with_match_length():
    index = SuffixIndex(SuffixSettings(tokens_per_match=1.0))
    index.add(list(range(100)))
    assert index.continuation([0, 5, 6], 50) == ([7, 8], 2)
    drafted, matched = index.continuation(list(range(10, 20)), 50)
    assert matched == 10 and drafted == list(range(20, 30))


def test_the_current_sequence_is_searched_too():
    index = SuffixIndex()
    live = [1, 2, 3, 4, 9, 9, 2, 3]
    assert index.continuation(live, 4, live=live) == ([4, 9, 9, 2], 2)
    assert index.continuation(live, 4) == ([], 0)


def test_the_current_sequence_wins_over_earlier_ones_at_equal_match_length():
    index = SuffixIndex()
    for k in range(3):
        index.add([5, 2, 3, 70, 71, 100 + k])  # (2, 3) then 70, in three earlier requests
    live = [1, 2, 3, 40, 41, 9, 2, 3]  # (2, 3) then 40 once in this one
    assert index.continuation(live, 4, live=live) == ([40, 41, 9, 2], 2)
    index.add([7, 9, 2, 3, 80, 81])  # a longer match in an earlier request wins
    assert index.continuation(live, 4, live=live) == ([80, 81], 3)


def test_memory_is_bounded_and_the_oldest_goes_first():
    index = SuffixIndex(SuffixSettings(max_tokens=100, min_support=0.1))
    for i in range(30):
        index.add([1000 + i, 5, 6, 2000 + i, 7, 8, 9, 10, 11, 12])
    assert index.n_tokens <= 100 and len(index) == 10
    assert min(index.docs) == 20  # the ten newest
    keys = sum(len(hits) for hits in index._index.values())
    assert keys == 10 * 8  # no stale entries left behind for evicted sequences
    drafted, _ = index.continuation([3, 5, 6], 1)
    assert drafted == [2029]  # equal counts: the latest wins


def test_next_turn_of_a_conversation_replaces_the_previous_and_repeats_are_kept_once():
    index = SuffixIndex()
    turn1 = [1, 2, 3, 4, 5, 6]
    index.add(turn1)
    index.add(turn1)
    assert len(index) == 1 and index.n_tokens == 6
    index.add(turn1 + [7, 8, 9])
    assert len(index) == 1 and index.n_tokens == 9
    assert index.continuation([0, 3, 4], 3) == ([5, 6, 7], 2)


def test_drafter_copies_across_requests_where_prompt_lookup_finds_nothing():
    index = SuffixIndex()
    index.add([11, 12, 13, 14, 15, 16, 17])
    tokens = np.array([20, 21, 13, 14])
    assert len(PromptLookupDrafter().find(tokens, 4)) == 0
    drafter = SuffixDrafter(index)
    assert drafter.find(tokens, 4).tolist() == [15, 16, 17]
    # A copy from an earlier request is its own evidence class, apart from the request's own copies.
    assert drafter.evidence(tokens) == match_class(2) + EARLIER
    own = np.array([13, 14, 90, 20, 13, 14])  # (13, 14) in the request itself, as long as in the index
    assert drafter.find(own, 2).tolist() == [90, 20] and drafter.evidence(own) == match_class(2)


def test_beside_prompt_lookup_it_drafts_only_where_an_earlier_request_matches_longer():
    """auto+suffix: prompt lookup copies the request's own text; the suffix part is a candidate
    only where an earlier request matches longer, so the policy weighs the two kinds of copy
    (and the model) each by its own α."""
    from runtime.drafters.mixed import MixedDrafter

    index = SuffixIndex()
    index.add([7, 9, 2, 3, 80, 81, 82])
    lookup, earlier = PromptLookupDrafter(), SuffixDrafter(index, own_text=False)
    mixed = MixedDrafter([lookup, earlier], model=None, name="auto+suffix")
    own = np.array([1, 2, 3, 40, 41, 5, 2, 3])  # (2, 3) in the request; (9, 2, 3) is only in the index
    assert len(earlier.find(own, 4)) == 0 and mixed.candidates(own) == [lookup]
    longer = np.array([1, 2, 3, 40, 41, 9, 2, 3])
    assert earlier.find(longer, 4).tolist() == [80, 81, 82] and earlier.evidence(longer) == EARLIER + match_class(3)
    assert mixed.candidates(longer) == [lookup, earlier]
    assert mixed.parts() == [lookup, earlier]


def test_settings_are_checked():
    with pytest.raises(ValueError, match="max_tokens=0"):
        SuffixSettings(max_tokens=0)
    with pytest.raises(ValueError, match="min_support=-0.1"):
        SuffixSettings(min_support=-0.1)


def test_a_sequence_enters_the_index_when_the_next_starts_and_forget_drops_all():
    drafter = SuffixDrafter(SuffixIndex())
    drafter.reset(np.array([1, 2]))
    drafter.accepted(np.array([1, 2, 30, 31, 32, 33]), 0)
    assert len(drafter.index) == 0
    drafter.reset(np.array([7, 30, 31]))
    assert len(drafter.index) == 1
    assert drafter.find(np.array([7, 30, 31]), 4).tolist() == [32, 33]
    drafter.forget()
    assert len(drafter.index) == 0 and len(drafter.find(np.array([7, 30, 31]), 4)) == 0


def test_an_engine_copies_from_an_earlier_request_until_it_forgets(llama_bundle):
    from runtime.engine import Engine, EngineConfig, GenerateConfig

    engine = Engine(llama_bundle, EngineConfig(drafter="suffix", gamma=4, threads=1))
    plain = Engine(llama_bundle, EngineConfig(drafter="none", threads=1))
    prompt = engine.encode(prompt="the quick brown fox jumps over the lazy dog and")
    first = engine.generate(prompt, GenerateConfig(24))
    again = engine.generate(prompt, GenerateConfig(24))
    expected = plain.generate(prompt, GenerateConfig(24)).token_ids
    assert first.token_ids == again.token_ids == expected
    # The repeat copies its whole answer from the first request.
    assert again.stats["accepted_tokens"] > first.stats["accepted_tokens"] and again.stats["target_passes"] <= 8
    engine.forget()
    assert engine.generate(prompt, GenerateConfig(24)).stats["accepted_tokens"] == first.stats["accepted_tokens"]


def test_evicting_a_sequence_that_repeats_an_ngram():
    index = SuffixIndex(SuffixSettings(max_tokens=12))
    index.add([1, 2, 3, 1, 2, 4, 1, 2, 5])  # (1, 2) three times in one sequence
    index.add([7, 8, 9, 10, 11, 12])  # evicts the first
    assert len(index) == 1 and (1, 2) not in index._index
    assert index.continuation([0, 1, 2], 3) == ([], 0)
