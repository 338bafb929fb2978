"""The tool journal is verified like a checkpoint: a checksummed line is given back as written; a line that does not
parse, is not an entry or fails its checksum (foreign lines after a SIGKILL, an outcome changed by hand) is ignored
with one warning naming the file and its lines, never a traceback and never used; a legacy line without a checksum
is taken when it is an entry. A run whose journal was tampered with resumes bitwise equal to the uninterrupted run,
calling the changed turn's tool again."""

import hashlib
import json
import warnings

import pytest

from grpo_jax.tools.journal import CHECKSUM, Journal, checksum, read_entry
from grpo_jax.tools.toolbox import Results

CALLS = [{"type": "function", "function": {"name": "lookup", "arguments": {}}}]


def _results(content: str) -> Results:
    return Results([{"role": "tool", "name": "lookup", "content": content}], 1, 0, [["ok", content]])


def _written(path, rows=(0, 1, 2)):
    journal = Journal(path)
    for row in rows:
        journal.put(row, 0, CALLS, _results(str(123 + row)))
    return path.read_bytes().splitlines()


def test_a_checksummed_journal_is_given_back_as_written(tmp_path):
    path = tmp_path / "round-1-pass-0.jsonl"
    lines = _written(path)
    entry = json.loads(lines[0])
    # the checksum is SHA-256 of the entry's canonical JSON, computed here independently of `checksum`
    body = json.dumps({k: entry[k] for k in ("row", "round", "calls", "outcomes")}, sort_keys=True,
                      separators=(",", ":"))
    assert entry[CHECKSUM] == hashlib.sha256(body.encode()).hexdigest()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a sound journal warns of nothing
        again = Journal(path)
    assert [again.get(row, 0, CALLS) for row in range(3)] == [[["ok", "123"]], [["ok", "124"]], [["ok", "125"]]]
    assert again.get(0, 0, [{**CALLS[0], "function": {"name": "other", "arguments": {}}}]) is None


def test_a_legacy_line_without_a_checksum_is_taken_when_it_is_an_entry(tmp_path):
    """Journals written before checksums (a run in progress) resume: an entry's keys and types, no checksum."""
    path = tmp_path / "legacy.jsonl"
    legacy = {"row": 3, "round": 1, "calls": CALLS, "outcomes": [["ok", "7"]]}
    path.write_text(json.dumps(legacy) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Journal(path).get(3, 1, CALLS) == [["ok", "7"]]
    assert read_entry(json.dumps({**legacy, "row": "3"}).encode()) is None  # wrong type: not an entry
    assert read_entry(json.dumps({**legacy, "row": True}).encode()) is None
    assert read_entry(json.dumps({**legacy, "extra": 1}).encode()) is None


@pytest.mark.parametrize("damage", ["foreign", "altered", "cut"])
def test_a_damaged_journal_is_one_warning_naming_its_lines_and_those_calls_run_again(tmp_path, damage):
    """Old outcome: "KeyError: 'row'" on every rerun (foreign lines), or the altered outcome used silently. New:
    the bad lines are ignored with one RuntimeWarning naming the file and lines; the others are given back."""
    path = tmp_path / "round-1-pass-0.jsonl"
    lines = _written(path)
    if damage == "foreign":  # JSON without the expected keys, a JSON list, binary junk (no newline after it)
        path.write_bytes(path.read_bytes() + b'{"note": "hello"}\n[1, 2, 3]\n\xff\xfe\x00junk')
        bad, kept = "lines 4, 5, 6", [0, 1, 2]
    elif damage == "altered":  # '123' -> '923' in row 0's recorded outcome, its checksum left as it was
        path.write_bytes(b"\n".join([lines[0].replace(b'"123"', b'"923"'), *lines[1:]]) + b"\n")
        bad, kept = "line 1", [1, 2]
    else:  # the last line cut by a SIGKILL
        path.write_bytes(b"\n".join([*lines[:2], lines[2][:-9]]))
        bad, kept = "line 3", [0, 1]
    with pytest.warns(RuntimeWarning) as caught:
        journal = Journal(path)
    (warning,) = [w for w in caught if "tool journal" in str(w.message)]
    assert str(warning.message).startswith(f"tool journal {path}: {bad} did not parse as an entry or failed its "
                                           "checksum"), warning.message
    assert "\n" not in str(warning.message)
    # a turn a bad line still names is said again when its tool is called again: the row, the tool, the line
    again = {"altered": (0, 1), "cut": (2, 3)}.get(damage)
    if again is not None:
        with pytest.warns(RuntimeWarning, match=rf"tool journal {path}: line {again[1]} recorded row {again[0]}'s "
                                                r"tool round 0 but failed its checksum or did not parse: calling "
                                                r"lookup again"):
            assert journal.get(again[0], 0, CALLS) is None
    assert [row for row in range(3) if journal.get(row, 0, CALLS) is not None] == kept
    assert all(journal.get(row, 0, CALLS) == [["ok", str(123 + row)]] for row in kept)  # never '923'
    # the turns called again are journalled on lines of their own, read back sound
    for row in set(range(3)) - set(kept):
        journal.put(row, 0, CALLS, _results(str(123 + row)))
    with pytest.warns(RuntimeWarning, match=bad):  # the damaged lines stay, and stay ignored
        again = Journal(path)
    assert [again.get(row, 0, CALLS) for row in range(3)] == [[["ok", str(123 + row)]] for row in range(3)]


def test_the_checksum_covers_every_field():
    entry = {"row": 0, "round": 0, "calls": CALLS, "outcomes": [["ok", "1"]]}
    sums = {checksum(entry), *(checksum({**entry, k: v}) for k, v in
                               (("row", 1), ("round", 1), ("calls", []), ("outcomes", [["ok", "2"]])))}
    assert len(sums) == 5
    assert checksum({**entry, CHECKSUM: "x"}) == checksum(entry)
