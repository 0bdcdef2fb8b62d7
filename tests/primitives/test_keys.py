import pytest

from lightning_tfdebug.primitives.keys import Key, declared, render_key_table


def test_a_placeholder_matches_one_path_segment_and_a_path_placeholder_the_rest():
    group = Key("grad_norm/<group>", "one group's norm")
    assert group.matches("grad_norm/blocks.0") and not group.matches("grad_norm/a/b")
    assert not group.matches("grad_norm/") and not group.matches("update_ratio/blocks.0")
    path = Key("dead/<module_path>", "a module's share of dead units")
    assert path.matches("dead/blocks/0/mlp") and path.section == "dead"


def test_a_literal_declaration_wins_over_a_placeholder_one():
    group, total = Key("grad_norm/<group>", "a group"), Key("grad_norm/total", "all groups")
    assert declared([group, total], "grad_norm/total") is total
    assert declared([group, total], "grad_norm/head") is group
    assert declared([group, total], "loss/train") is None


def test_regex_characters_in_a_key_are_literal():
    key = Key("throughput/tokens_per_s.<rank>", "tokens per second")
    assert key.matches("throughput/tokens_per_s.3") and not key.matches("throughput/tokens_per_sx3")


@pytest.mark.parametrize(("name", "description"), [("no_section", "x"), ("", "x"), ("a/b", "  ")])
def test_a_key_without_a_section_or_a_meaning_is_refused(name, description):
    with pytest.raises(ValueError):
        Key(name, description)


def test_the_docs_table_escapes_pipes_and_marks_a_missing_unit():
    table = render_key_table([Key("a/b", "x | y", unit="ms"), Key("a/c", "count")])
    assert table.splitlines() == [
        "| key | unit | meaning |",
        "| --- | --- | --- |",
        "| `a/b` | ms | x \\| y |",
        "| `a/c` | - | count |",
    ]
