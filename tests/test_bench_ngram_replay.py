"""The n-gram replay's bookkeeping (benchmarks/bench_ngram_replay.py), on sequences worked out by hand."""

from __future__ import annotations

from benchmarks.bench_ngram_replay import chain, replay, tree


def test_a_chain_accepts_its_longest_agreeing_prefix_plus_one():
    # no earlier 8: a plain step (5); "5" recurs: drafts 6 8 5, accepts 6, emits 6 7; "5 6 7" recurs: drafts
    # 5 6 8 5, the output has one token left: emits 5
    assert replay([[5, 6, 7, 5, 6, 8]], [[5, 6, 7, 5]], chain(4, 0.0)) == (4, 3, 0 + 3 + 4)


def test_a_tree_accepts_the_best_branch_and_counts_its_distinct_rows():
    prompt, out = [1, 2, 1, 3, 1], [2, 0]
    # the most recent "1" was followed by 3, an older one by 2: the chain drafts 3 (rejected); the tree drafts both
    assert replay([prompt], [out], chain(1, 0.0)) == (2, 2, 2)
    assert replay([prompt], [out], tree(1, 2)) == (2, 1, 2)
    # depth 2: branches (3, 1) and (2, 1) share no prefix: 4 rows; the output agrees with (2, ...) for one token
    assert replay([prompt], [out], tree(2, 2)) == (2, 1, 4)


def test_the_best_branch_need_not_be_the_last_and_shared_prefixes_are_one_row():
    # "1" was followed by 3, 2 and 5 (most recent first): the middle branch is the one the output takes
    assert replay([[1, 5, 1, 2, 1, 3, 1]], [[2, 0]], tree(1, 3)) == (2, 1, 3)
    # "9 1" was followed by 3 1; "1" by 9 1, (3 1) and 3 2: branches (3, 1), (9, 1), (3, 2) are 5 distinct rows
    assert replay([[1, 3, 2, 9, 1, 3, 1, 9, 1]], [[3, 2]], tree(2, 3)) == (2, 1, 5)
