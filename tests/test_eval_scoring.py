from hybridkv.eval.scoring import leading_match_all, mrcr_score, string_match_all, string_match_part, word_match_all


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


def test_leading_match_all_scores_the_values_given_first():
    listed = " 6426141, 3838612, 1338612, 33183612."
    assert string_match_all(listed, ["1338612"]) == word_match_all(listed, ["1338612"]) == 1.0
    assert leading_match_all(listed, ["1338612"]) == 0.0           # named third, after a distractor
    assert leading_match_all(listed, ["6426141"]) == 1.0
    assert leading_match_all(" 91747.", ["91747"]) == 1.0
    assert leading_match_all(" 9174779.", ["91747"]) == 0.0         # a longer number is not the value
    assert leading_match_all(" 12, 3 and 7", ["3", "12", "5"]) == 2 / 3   # several answers: the first as many words
    assert leading_match_all("", ["1"]) == 0.0 and leading_match_all("1", []) == 0.0


def test_the_report_rescores_needle_answers_stricter_from_the_stored_outputs():
    """RULER's score counts a listed value; the whole-word and first-answer tables, redrawn from the
    stored outputs, tell a listing and a longer number apart from the value itself."""
    from hybridkv.eval.report import markdown
    from hybridkv.eval.runner import EvalRun, SampleResult

    def result(output, ref):
        return SampleResult("niah_multikey_1", 4096, 4096, 0.5, string_match_all(output, [ref]), output, [ref],
                            {"window": 1024})
    run = EvalRun("m", "full", ["niah_multikey_1"], [4096], 4, results=[
        result(" 1338612.", "1338612"), result(" 6426141, 1338612.", "1338612"),
        result(" 13386120.", "1338612"), result(" 2027392.", "1338612")])
    assert (run.accuracy("niah_multikey_1", 4096), run.word_accuracy("niah_multikey_1", 4096),
            run.leading_accuracy("niah_multikey_1", 4096)) == (75.0, 50.0, 25.0)
    table = markdown([run])
    assert "| niah_multikey_1 | 75.0 |" in table
    assert table.index("whole-word match") < table.index("| niah_multikey_1 | 50.0 |") < \
        table.index("first-answer match") < table.index("| niah_multikey_1 | 25.0 |")
