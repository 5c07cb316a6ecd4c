from hybridkv.eval.scoring import mrcr_score, string_match_all, string_match_part, word_match_all


def test_string_match_all_counts_fraction_case_insensitively():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert string_match_all("only 123 here", ["123", "456", "789", "000"]) == 0.25
    assert string_match_all("APPLE pie", ["apple"]) == 1.0
    assert string_match_all("nothing", []) == 0.0


def test_string_match_part_any_reference():
    assert string_match_part("Paris is the answer", ["paris", "lyon"]) == 1.0
    assert string_match_part("Berlin", ["paris", "lyon"]) == 0.0


def test_mrcr_requires_prefix_then_ratio():
    assert mrcr_score("abc a poem about cats", "abc a poem about cats", "abc") == 1.0
    assert mrcr_score("a poem about cats", "abc a poem about cats", "abc") == 0.0
    s = mrcr_score("abc a poem about dogs", "abc a poem about cats", "abc")
    assert 0.5 < s < 1.0


def test_word_match_all_wants_the_value_itself():
    assert string_match_all(" 9174779.", ["91747"]) == 1.0          # RULER's substring match
    assert word_match_all(" 9174779.", ["91747"]) == 0.0            # not the pass key: a longer number
    assert word_match_all(" 91747. it is", ["91747"]) == 1.0
    uuid = "21990108-59ed-4865-971b-9cdc8fcb1a6e"
    assert word_match_all(f" {uuid.upper()}.", [uuid]) == 1.0
    assert word_match_all(f" {uuid}0", [uuid]) == 0.0
    assert word_match_all("3, 7 and 12", ["3", "12", "5"]) == 2 / 3
