"""The readers of user files (unitgraph/userfiles.py, the dataset's metadata and images): whatever the input,
a correct result or one UnitgraphError whose line names the file (docs/safety.md, 'Input files').

Most tests are properties over generated input: mutations of valid spec and plan files, random nesting
depths and integer sizes, random CSV grids with ragged rows, random bytes as metadata and image files.
"""

from __future__ import annotations

import csv
import io
import json
import os
import struct
import subprocess
import sys
import warnings
import zlib
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import unitgraph as ug
from unitgraph.errors import PlanFileError, SpecError, UnitgraphError
from unitgraph.planfile import read_plan_file
from unitgraph.spec import read_spec_file
from unitgraph.userfiles import (
    MAX_DEPTH,
    MAX_INT_DIGITS,
    parse_user_json,
    parse_user_jsonl,
    parse_user_yaml,
    read_user_text,
)

try:
    import numpy as np
    from PIL import Image

    from unitgraph.backends.diffusion.errors import BackendError
    from unitgraph.backends.diffusion.data.dataset import DiffusionDataset, SampleError, image_to_rgb, read_metadata
except ImportError:  # the planner core without the diffusion extra: only the core readers are tested
    Image = None

needs_backend = pytest.mark.skipif(Image is None, reason="the diffusion backend (PIL, numpy) is not installed")

# UNITGRAPH_FUZZ_EXAMPLES=5000 hunts longer; the default keeps the file well under a minute
FUZZ = settings(max_examples=int(os.environ.get("UNITGRAPH_FUZZ_EXAMPLES", "60")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

SPEC = {
    "name": "qwen_image",
    "units": [
        {"name": "ShapeChecker", "inputs": ["height", "width"], "outputs": ["height", "width"], "models": []},
        {"name": "PromptEmbedder", "inputs": ["prompt"], "outputs": ["prompt_emb", "prompt_emb_mask"], "models": ["text_encoder"]},
        {"name": "CaptionDropout", "inputs": ["prompt_emb"], "outputs": ["prompt_emb"], "models": [], "deterministic": False},
    ],
    "sink": {"inputs": ["input_latents", "prompt_emb", "prompt_emb_mask", "height", "width"], "models": ["dit"]},
}
SPEC_JSON = json.dumps(SPEC, indent=1)
SPEC_YAML = yaml.safe_dump(SPEC, sort_keys=False)
PLAN_JSON = ug.split(ug.spec.pipeline_from_dict(SPEC), lora_base_model="dit").to_json()


def outcome(call: Callable[[], Any], source: str | Path, kind: type[UnitgraphError] = UnitgraphError) -> Any:
    """call(), or the UnitgraphError it raised, checked to be one line naming the file."""
    try:
        return call()
    except kind as exc:
        line = exc.one_line()
        assert line and "\n" not in line and "\r" not in line, line
        assert str(source) in line, line
        assert "Traceback" not in line
        return exc


def apply_edits(text: str, edits: list[tuple[int, int, str]]) -> str:
    for position, deleted, inserted in edits:
        at = position % (len(text) + 1)
        text = text[:at] + inserted + text[at + deleted:]
    return text


# pieces that reach the readers' limits and the parsers' odd corners, mixed with arbitrary text
JSON_PIECES = ['"', "{", "}", "[", "]", ",", ":", "\\", "\\u", "\\ud800", "\\udc00", "NaN", "-Infinity", "1e999",
               "9" * (MAX_INT_DIGITS + 1), "[" * 5000, "{\"a\":" * 300, '"name"', '"units"', '"inputs"', "null",
               "true", "0", "-", "\x00", "\ufeff", "\u2028", '"name": "x", "name": "y"']
YAML_PIECES = ["&a ", "*a", "&b [*a, *a, *a]", "<<: ", "<<: *a", "!!int ", "!!timestamp ", "!!bool ", "!!float ",
               "!!binary ", "!!python/object:os.system ", "- ", ": ", "\n  ", "\n", "[", "]", "{", "}", ".nan", ".inf",
               "? ", "---", "\t", '"\\ud800"', "|", ">", "%YAML 1.1", "0x" + "f" * 5000, "1:" * 50, "[" * 3000,
               "2001-13-40", "~", "name: a\nname: b\n", "\x00", "\x85"]


def edits(pieces: list[str]) -> st.SearchStrategy:
    insert = st.one_of(st.sampled_from(pieces), st.text(max_size=6))
    return st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 6), insert), min_size=1, max_size=6)


# ------------------------------------------------------------------------------------------------
# spec and plan files


@FUZZ
@given(changes=edits(JSON_PIECES))
@example(changes=[(0, 10_000, "[" * 100_000)])
@example(changes=[(0, 10_000, '{"name": ' + "1" * 5000 + ', "units": []}')])
def test_a_mutated_json_spec_is_a_pipeline_or_one_line(tmp_path_factory, changes):
    path = tmp_path_factory.mktemp("spec") / "spec.json"
    path.write_text(apply_edits(SPEC_JSON, changes), encoding="utf-8", errors="surrogatepass")
    result = outcome(lambda: read_spec_file(path), path, SpecError)
    assert isinstance(result, (ug.Pipeline, SpecError))


@FUZZ
@given(changes=edits(YAML_PIECES))
@example(changes=[(0, 0, "a: &a [x,x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi")))])
def test_a_mutated_yaml_spec_is_a_pipeline_or_one_line(tmp_path_factory, changes):
    path = tmp_path_factory.mktemp("spec") / "spec.yaml"
    path.write_text(apply_edits(SPEC_YAML, changes), encoding="utf-8", errors="surrogatepass")
    result = outcome(lambda: read_spec_file(path), path, SpecError)
    assert isinstance(result, (ug.Pipeline, SpecError))


@FUZZ
@given(data=st.binary(max_size=400), suffix=st.sampled_from([".json", ".yaml"]))
def test_random_bytes_as_a_spec_file_are_one_line(tmp_path_factory, data, suffix):
    path = tmp_path_factory.mktemp("spec") / f"spec{suffix}"
    path.write_bytes(data)
    assert isinstance(outcome(lambda: read_spec_file(path), path, SpecError), (ug.Pipeline, SpecError))


@FUZZ
@given(changes=edits(JSON_PIECES))
def test_a_mutated_plan_file_is_a_plan_or_one_line(tmp_path_factory, changes):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(apply_edits(PLAN_JSON, changes), encoding="utf-8", errors="surrogatepass")
    result = outcome(lambda: read_plan_file(path), path, PlanFileError)
    assert isinstance(result, (ug.Plan, PlanFileError))


def test_valid_spec_and_plan_files_still_read(tmp_path):
    (tmp_path / "s.json").write_text(SPEC_JSON)
    (tmp_path / "s.yaml").write_text(SPEC_YAML)
    (tmp_path / "p.json").write_text(PLAN_JSON)
    assert read_spec_file(tmp_path / "s.json") == read_spec_file(tmp_path / "s.yaml") == ug.spec.pipeline_from_dict(SPEC)
    assert read_plan_file(tmp_path / "p.json").to_json() == PLAN_JSON
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + SPEC_JSON.encode())  # a byte-order mark is dropped
    assert read_spec_file(tmp_path / "bom.json").name == "qwen_image"


# ------------------------------------------------------------------------------------------------
# JSON


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=20,
)


@FUZZ
@given(value=json_values)
def test_json_of_plain_values_reads_back_equal(value):
    assert parse_user_json(json.dumps(value), "v.json", SpecError) == value
    assert parse_user_json(json.dumps(value, ensure_ascii=False, indent=2), "v.json", SpecError) == value


@FUZZ
@given(depth=st.integers(1, 100_000), opens=st.text(alphabet="[{", min_size=1, max_size=8))
@example(depth=MAX_DEPTH, opens="[")
@example(depth=MAX_DEPTH + 1, opens="[")
def test_json_nesting_past_the_limit_is_one_line_never_a_recursion_error(depth, opens):
    levels = [opens[i % len(opens)] for i in range(depth)]
    text = "".join('{"k":' if c == "{" else "[" for c in levels) + "0" + "".join("}" if c == "{" else "]" for c in reversed(levels))
    result = outcome(lambda: parse_user_json(text, "deep.json", SpecError), "deep.json", SpecError)
    if depth <= MAX_DEPTH:
        assert not isinstance(result, SpecError), result
        assert result == json.loads(text)
    else:
        assert isinstance(result, SpecError) and f"nested deeper than {MAX_DEPTH} levels" in result.one_line()


@FUZZ
@given(digits=st.integers(1, 3 * MAX_INT_DIGITS), sign=st.sampled_from(["", "-"]), lead=st.integers(1, 9))
@example(digits=MAX_INT_DIGITS, sign="", lead=9)
@example(digits=MAX_INT_DIGITS + 1, sign="-", lead=9)
def test_json_integers_past_the_digit_limit_are_one_line(digits, sign, lead):
    number = sign + str(lead) + "7" * (digits - 1)
    result = outcome(lambda: parse_user_json(f'{{"seed": {number}}}', "n.json", SpecError), "n.json", SpecError)
    if digits <= MAX_INT_DIGITS:
        assert result == {"seed": int(number)}
    else:
        assert isinstance(result, SpecError) and f"{digits} digits" in result.one_line()


@FUZZ
@given(keys=st.lists(st.sampled_from(["a", "b", "c", "name", "ü"]), min_size=1, max_size=6),
       nest=st.booleans())
def test_json_duplicate_keys_are_named(keys, nest):
    body = "{" + ", ".join(f"{json.dumps(k)}: {i}" for i, k in enumerate(keys)) + "}"
    text = f'{{"outer": [{body}]}}' if nest else body
    result = outcome(lambda: parse_user_json(text, "d.json", SpecError), "d.json", SpecError)
    duplicates = [k for i, k in enumerate(keys) if k in keys[:i]]
    if duplicates:
        assert isinstance(result, SpecError) and f"duplicate key {duplicates[0]!r}" in result.one_line()
    else:
        obj = {k: i for i, k in enumerate(keys)}
        assert result == ({"outer": [obj]} if nest else obj)


@pytest.mark.parametrize("literal, fragment", [
    ("NaN", "NaN is not a JSON number"), ("Infinity", "Infinity is not a JSON number"),
    ("-Infinity", "-Infinity is not a JSON number"), ("1e999", "too large for a float"),
    ("-2.5e400", "too large for a float"), ('"\\ud800"', "half a surrogate pair"),
    ('{"\\udc00": 1}', "half a surrogate pair"),
])
def test_json_refuses_what_is_not_plain_data(literal, fragment):
    with pytest.raises(SpecError) as err:
        parse_user_json(f'{{"a": [{literal}]}}', "x.json", SpecError)
    assert fragment in err.value.one_line() and err.value.one_line().startswith("x.json: ")
    assert parse_user_json('"\\ud83d\\ude00"', "x.json", SpecError) == "\U0001f600"  # a whole pair is a character


@FUZZ
@given(values=st.lists(json_values, max_size=6), blank=st.lists(st.booleans(), max_size=6))
def test_jsonl_lines_that_are_not_objects_are_named(values, blank):
    lines = []
    numbers = []
    for i, value in enumerate(values):
        if i < len(blank) and blank[i]:
            lines.append("   ")
        lines.append(json.dumps(value))
        numbers.append(len(lines))
    text = "\n".join(lines)
    result = outcome(lambda: parse_user_jsonl(text, "m.jsonl", SpecError), "m.jsonl", SpecError)
    wrong = [n for n, v in zip(numbers, values) if not isinstance(v, dict)]
    if wrong:
        assert isinstance(result, SpecError) and f"line {wrong[0]}: expected a JSON object" in result.one_line()
    else:
        assert result == values


# ------------------------------------------------------------------------------------------------
# YAML


yaml_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**30, 10**30) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc"))),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=20,
)


@FUZZ
@given(value=yaml_values, flow=st.booleans())
def test_yaml_of_plain_values_reads_back_equal(value, flow):
    text = yaml.safe_dump(value, default_flow_style=flow, allow_unicode=True)
    assert parse_user_yaml(text, "v.yaml", SpecError) == yaml.safe_load(text)  # (pyyaml's own round trip loses \x85)


@FUZZ
@given(depth=st.integers(1, 100_000), flow=st.booleans())
@example(depth=MAX_DEPTH, flow=True)
@example(depth=MAX_DEPTH + 1, flow=False)
def test_yaml_nesting_past_the_limit_is_one_line(depth, flow):
    if flow:
        text = "[" * depth + "]" * depth
    else:
        shown = min(depth, MAX_DEPTH + 2)  # block nesting: the error comes at the limit, no need to write more
        text = "".join("  " * i + "- \n" if i < shown - 1 else "  " * i + "- x\n" for i in range(shown))
        depth = shown
    result = outcome(lambda: parse_user_yaml(text, "deep.yaml", SpecError), "deep.yaml", SpecError)
    if depth <= MAX_DEPTH:
        assert not isinstance(result, SpecError), result
    else:
        assert isinstance(result, SpecError) and "nested deeper than" in result.one_line()


@FUZZ
@given(width=st.integers(1, 12), levels=st.integers(1, 9))
@example(width=10, levels=9)  # the billion laughs
def test_yaml_alias_bombs_are_bounded(width, levels):
    lines = ["l0: &l0 [" + ", ".join(["lol"] * width) + "]"]
    for k in range(1, levels):
        lines.append(f"l{k}: &l{k} [" + ", ".join([f"*l{k - 1}"] * width) + "]")
    text = "\n".join(lines) + "\n"
    expanded = sum(width ** (k + 1) for k in range(levels))
    result = outcome(lambda: parse_user_yaml(text, "lol.yaml", SpecError), "lol.yaml", SpecError)
    if expanded > 1_000_000:
        assert isinstance(result, SpecError) and "aliases expand" in result.one_line()
    elif not isinstance(result, SpecError):
        assert result == yaml.safe_load(text)


@FUZZ
@given(chain=st.integers(1, 400))
def test_yaml_nesting_through_alias_chains_counts(chain):
    text = "a0: &a0 [x]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, chain))
    result = outcome(lambda: parse_user_yaml(text, "chain.yaml", SpecError), "chain.yaml", SpecError)
    assert isinstance(result, SpecError) == (chain + 1 > MAX_DEPTH)  # the chain, in the document's mapping


@pytest.mark.parametrize("text, fragment", [
    ("a: &a [*a]\n", "refers to a node that contains it"),
    ("name: a\nunits: []\nname: b\n", "line 3 column 1: found duplicate key 'name'"),
    ("a: {x: 1, x: 2}\n", "found duplicate key 'x'"),
    ("a: .nan\n", ".nan is not a finite number"),
    ("a: -.inf\n", "is not a finite number"),
    ("a: 1.0e+999\n", "is not a finite number"),
    ("a: " + "9" * (MAX_INT_DIGITS + 1) + "\n", f"{MAX_INT_DIGITS + 1} digits"),
    ("a: 0x" + "f" * 4000 + "\n", f"more than {MAX_INT_DIGITS} digits"),
    ("a: !!timestamp soon\n", "cannot read 'soon' as a timestamp"),
    ("a: 2001-13-01\n", "month must be in 1..12"),
    ("a: !!bool maybe\n", "as a bool"),
    ("a: !!python/object:os.system ls\n", "could not determine a constructor"),
    ('a: "\\ud800"\n', "half a surrogate pair"),
    ("a: [x\n", "malformed YAML"),
    ("a: b\x07\n", "unacceptable character #x0007"),
    ("a: 1\n---\nb: 2\n", "expected a single document in the stream, but found another document"),
])
def test_yaml_refuses_what_is_not_plain_data(text, fragment):
    with pytest.raises(SpecError) as err:
        parse_user_yaml(text, "x.yaml", SpecError)
    line = err.value.one_line()
    assert fragment in line and line.startswith("x.yaml: ") and "\n" not in line


def test_yaml_merge_keys_may_be_overridden_and_pairs_are_joined():
    text = "base: &b {x: 1, y: 2}\nm:\n  <<: *b\n  x: 3\n"
    assert parse_user_yaml(text, "m.yaml", SpecError) == yaml.safe_load(text) == {"base": {"x": 1, "y": 2}, "m": {"x": 3, "y": 2}}
    assert parse_user_yaml('a: "\\ud83d\\ude00"', "m.yaml", SpecError) == {"a": "\U0001f600"}
    assert parse_user_yaml("a: &a [1, 2]\nb: *a\n", "m.yaml", SpecError) == {"a": [1, 2], "b": [1, 2]}


# ------------------------------------------------------------------------------------------------
# files


def test_files_that_cannot_be_read_are_one_line(tmp_path, monkeypatch):
    def refused(path: Path, *fragments: str, **kwargs: Any) -> None:
        with pytest.raises(SpecError) as err:
            read_user_text(path, SpecError, "a spec file", **kwargs)
        line = err.value.one_line()
        assert line.startswith(f"{path}: ") and "\n" not in line
        for fragment in fragments:
            assert fragment in line, line

    refused(tmp_path / "nope.json", "no such file")
    refused(tmp_path, "is a directory, expected a spec file")
    (tmp_path / "file").write_text("x")
    refused(tmp_path / "file" / "below.json", "no such file")
    (tmp_path / "big.json").write_text("[" + "0," * 600 + "0]")
    refused(tmp_path / "big.json", "is 1.2 KiB, larger than the 1 KiB allowed for a spec file", max_bytes=1024)
    (tmp_path / "nul.json").write_bytes(b'{"a": "\x00"}')
    refused(tmp_path / "nul.json", "NUL byte at offset 7")
    (tmp_path / "latin1.json").write_bytes('{"a": "é"}'.encode("latin-1"))
    refused(tmp_path / "latin1.json", "is not UTF-8 text (byte 0xe9 at offset 7)")
    (tmp_path / "dangling.json").symlink_to(tmp_path / "gone.json")
    refused(tmp_path / "dangling.json", "no such file")
    (tmp_path / "loop.json").symlink_to(tmp_path / "loop.json")
    refused(tmp_path / "loop.json", "cannot read")
    (tmp_path / "link.json").symlink_to(tmp_path / "file")  # symlinks are followed
    assert read_user_text(tmp_path / "link.json", SpecError, "a spec file") == "x"
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo.json")  # refused without waiting for a writer
        refused(tmp_path / "fifo.json", "is not a regular file")
    if Path("/dev/zero").exists():
        refused(Path("/dev/zero"), "is not a regular file")
    refused(Path(str(tmp_path / "x") + "\0.json"), "is not a valid file name")
    refused(tmp_path / ("n" * 5000 + ".json"), "cannot read")


# ------------------------------------------------------------------------------------------------
# the command line, end to end


def _unitgraph() -> list[str]:
    script = Path(sys.executable).with_name("unitgraph")
    return [str(script)] if script.exists() else [sys.executable, "-m", "unitgraph.cli.app"]


def test_a_pathological_spec_file_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "deep.json"
    bad.write_text("[" * 100_000 + "]" * 100_000)
    result = subprocess.run([*_unitgraph(), "plan", str(bad), "--lora-base-model", "dit"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"unitgraph: error: {bad}: JSON nested deeper than {MAX_DEPTH} levels")
    assert result.stdout == ""


@pytest.mark.parametrize("name, text, fragment", [
    ("int.json", '{"name": ' + "1" * 5000 + ', "units": []}', "JSON integer with 5000 digits"),
    ("dup.json", '{"name": "a", "units": [], "name": "b"}', "duplicate key 'name'"),
    ("nan.json", '{"name": "a", "units": [NaN]}', "NaN is not a JSON number"),
    ("lol.yaml", "a: &a [x,x,x,x,x,x,x,x,x,x]\n" + "".join(
        f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi")), "aliases expand"),
    ("deep.yaml", "name: " + "[" * 50_000 + "]" * 50_000, "nested deeper than"),
    ("binary.json", "\x89PNG\r\n\x1a\n\x00\x00", "NUL byte"),
])
def test_pathological_spec_files_in_process(tmp_path, capsys, name, text, fragment):
    from unitgraph.cli.app import main

    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(SystemExit) as exited:
        main(["plan", str(path), "--lora-base-model", "dit"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"unitgraph: error: {path}: ") and fragment in err, err


# ------------------------------------------------------------------------------------------------
# dataset metadata


csv_values = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00\ufeff"), max_size=8)


@needs_backend
@FUZZ
@given(header=st.lists(st.text(alphabet="abcxyz_ ,\"'\n", min_size=1, max_size=5), min_size=1, max_size=4, unique=True),
       lengths=st.lists(st.integers(0, 6), max_size=6), data=st.data())
def test_random_csv_grids_with_ragged_rows(tmp_path_factory, header, lengths, data):
    grid = [[data.draw(csv_values) for _ in range(n)] for n in lengths]
    buffer = io.StringIO(newline="")
    writer = csv.writer(buffer)
    writer.writerow(header)
    writer.writerows(grid)
    path = tmp_path_factory.mktemp("csv") / "metadata.csv"
    path.write_text(buffer.getvalue(), encoding="utf-8", newline="")
    result = outcome(lambda: read_metadata(path), path, BackendError)
    rows = [r for r in grid if r]  # a row of no fields is a blank line, which readers skip
    long = [k for k, r in enumerate(rows, start=1) if len(r) > len(header)]
    if long:
        assert isinstance(result, BackendError) and f"row {long[0]} (line" in result.one_line(), result
        assert f"has {len(rows[long[0] - 1])} fields but the header has {len(header)} columns" in result.one_line()
    elif not rows:
        assert isinstance(result, BackendError) and "no rows" in result.one_line()
    else:  # short rows: the missing fields are None, as csv.DictReader gives them
        assert result == [dict(zip(header, r + [None] * (len(header) - len(r)))) for r in rows]


@needs_backend
def test_csv_headers_fields_and_limits(tmp_path):
    def read(text: str) -> Any:
        path = tmp_path / "m.csv"
        path.write_text(text, encoding="utf-8", newline="")
        return outcome(lambda: read_metadata(path), path, BackendError)

    assert read("image,prompt\na.png,x\nb.png\n") == [{"image": "a.png", "prompt": "x"}, {"image": "b.png", "prompt": None}]
    assert "row 2: empty value in required column 'prompt'" in outcome(
        lambda: DiffusionDataset(tmp_path, tmp_path / "m.csv", ["image", "prompt"]), tmp_path / "m.csv", BackendError).one_line()
    assert read("image,prompt,\na.png,x,\n") == [{"image": "a.png", "prompt": "x"}]  # an unnamed column is dropped
    assert read('image,prompt\na.png,"two\nlines\u2028and a separator"\n') == [
        {"image": "a.png", "prompt": "two\nlines\u2028and a separator"}]
    assert "row 1 (line 2) has a value in column 3, which the header does not name" in read("image,prompt,\na.png,x,y\n").one_line()
    assert "row 2 (line 3) has 3 fields" in read("image,prompt\na.png,x\nb.png,a cat, sitting\n").one_line()
    assert "the header names column 'image' twice" in read("image,prompt,image\na,b,c\n").one_line()
    assert "empty csv (no header row)" in read("\n\n").one_line()
    big = read("image,prompt\na.png," + "x" * (csv.field_size_limit() + 1) + "\n").one_line()
    assert "malformed CSV at line 2: a field is longer than csv's limit of" in big
    # rows as csv.DictReader read them before (sample ids hash the rows: caches stay valid)
    plain = 'image,prompt,seed\na.png,"a cat, sitting",1\nb.png,"say ""hi""",\n\nc.png,short\n'
    assert read(plain) == [dict(r) for r in csv.DictReader(plain.splitlines())]
    path = tmp_path / "nul.csv"
    path.write_bytes(b"image,prompt\na.png,\x00\x01\x02\n")
    assert "NUL byte" in outcome(lambda: read_metadata(path), path, BackendError).one_line()


@needs_backend
@FUZZ
@given(data=st.binary(max_size=300), suffix=st.sampled_from([".csv", ".json", ".jsonl"]))
@example(data=b"\xff\xfe\x00garbage", suffix=".csv")
@example(data=b"[" * 5000, suffix=".json")
@example(data=b'{"a": 1}\n[1]\n', suffix=".jsonl")
def test_random_bytes_as_metadata_are_rows_or_one_line(tmp_path_factory, data, suffix):
    path = tmp_path_factory.mktemp("meta") / f"metadata{suffix}"
    path.write_bytes(data)
    result = outcome(lambda: read_metadata(path), path, BackendError)
    if not isinstance(result, BackendError):
        assert result and all(isinstance(r, dict) and all(isinstance(k, str) for k in r) for r in result)


@needs_backend
def test_json_metadata_problems_name_the_row_or_line(tmp_path):
    cases = {
        "a.json": ('[{"image": "a.png", "prompt": "x"}, 3]', "row 2: expected an object"),
        "b.json": ('[{"image": "a.png", "image": "b.png"}]', "duplicate key 'image'"),
        "c.jsonl": ('{"image": "a.png"}\n\n[1, 2]\n', "line 3: expected a JSON object, got a list"),
        "d.jsonl": ('{"image": "a.png"}\n{"seed": ' + "9" * 5000 + "}\n", "line 2: JSON integer with 5000 digits"),
        "e.jsonl": ('{"image": "a.png"}\n{"image": \n', "line 2: malformed JSON at column 11"),
        "f.json": ('{"data": 3}', "metadata must be a list of objects"),
    }
    for name, (text, fragment) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        line = outcome(lambda: read_metadata(path), path, BackendError).one_line()
        assert fragment in line, line


# ------------------------------------------------------------------------------------------------
# images


def _dataset(folder: Path, names: list[str]) -> Any:
    (folder / "metadata.csv").write_text("image,prompt\n" + "".join(f"{n},a picture\n" for n in names))
    return DiffusionDataset(folder, folder / "metadata.csv", ["image", "prompt"])


@needs_backend
def test_16_bit_png_keeps_its_gradient_in_8_bits(tmp_path):
    gradient = np.arange(256, dtype=np.uint16) * 257  # 0, 257, ..., 65535: the 8-bit values 0..255 scaled up
    Image.fromarray(np.tile(gradient, (20, 1))).save(tmp_path / "g16.png")
    with Image.open(tmp_path / "g16.png") as img:
        assert img.mode.startswith("I")
    ds = _dataset(tmp_path, ["g16.png"])
    ds.check(0)
    rgb = np.asarray(ds.sample(0)["image"])
    assert rgb.shape == (20, 256, 3) and rgb.dtype == np.uint8
    assert (rgb == np.arange(256, dtype=np.uint8)[None, :, None]).all()  # not saturated to white
    # every 16-bit mode, and the 32-bit I of older PIL (clipped to 0..65535 first)
    big_endian = Image.frombytes("I;16B", (256, 1), gradient.astype(">u2").tobytes())
    as_int32 = Image.fromarray(np.concatenate([gradient, [-5, 70000]]).astype(np.int32)[None, :])
    assert np.asarray(image_to_rgb(big_endian))[0, :, 0].tolist() == list(range(256))
    assert np.asarray(image_to_rgb(as_int32))[0, :, 0].tolist() == list(range(256)) + [0, 255]
    half = np.asarray(image_to_rgb(Image.fromarray(np.array([[128, 32896, 65400, 65535]], dtype=np.uint16))))[0, :, 0]
    assert half.tolist() == [0, 128, 254, 255]  # rounded


@needs_backend
def test_float_tiff_is_taken_as_0_to_1(tmp_path):
    values = np.concatenate([np.arange(256, dtype=np.float32) / 255, [-0.5, 1.5]]).astype(np.float32)
    Image.fromarray(np.tile(values, (20, 1))).save(tmp_path / "f.tiff")
    with Image.open(tmp_path / "f.tiff") as img:
        assert img.mode == "F"
    ds = _dataset(tmp_path, ["f.tiff"])
    ds.check(0)
    rgb = np.asarray(ds.sample(0)["image"])
    assert rgb[:, :, 0].tolist() == [list(range(256)) + [0, 255]] * 20 and (rgb[:, :, 0] == rgb[:, :, 2]).all()
    nan = np.tile(values, (20, 1))
    nan[3, 3] = np.nan
    Image.fromarray(nan).save(tmp_path / "f.tiff")
    with pytest.raises(SampleError) as err:
        _dataset(tmp_path, ["f.tiff"]).sample(0)
    assert "row 1: image 'f.tiff' (column 'image') is a float image with NaN or infinite pixels" in err.value.one_line()


@needs_backend
@pytest.mark.parametrize("mode", ["P", "L", "LA", "RGBA", "CMYK", "1"])
def test_other_modes_convert_as_pil_does(tmp_path, mode):
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)).convert(mode)
    name = "x.tiff" if mode == "CMYK" else "x.png"
    img.save(tmp_path / name)
    with Image.open(tmp_path / name) as reopened:
        expected = np.asarray(reopened.convert("RGB"))
    assert (np.asarray(_dataset(tmp_path, [name]).sample(0)["image"]) == expected).all()


def _png_header(width: int, height: int) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


@needs_backend
def test_decompression_bombs_are_skipped_samples(tmp_path, monkeypatch):
    (tmp_path / "bomb.png").write_bytes(_png_header(100_000, 100_000))  # 10^10 pixels: PIL refuses to open it
    Image.fromarray(np.zeros((64, 64, 3), dtype=np.uint8)).save(tmp_path / "big.png")
    ds = _dataset(tmp_path, ["bomb.png", "big.png"])
    with pytest.raises(SampleError) as err:
        ds.check(0)
    assert err.value.index == 0 and "row 1: 'bomb.png' (column 'image') is too large to decode safely" in err.value.one_line()
    with pytest.raises(SampleError):
        ds.sample(0)
    ds.check(1)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 3000)  # 4096 pixels: over the limit, under twice it (PIL only warns)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(SampleError) as err:
            ds.check(1)
    assert not [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]
    assert "is 64x64 px (4096 pixels), more than the 3000 pixels PIL decodes safely" in err.value.one_line()
    with pytest.raises(SampleError) as err:
        ds.sample(1)
    assert "row 2: image 'big.png' (column 'image') is 64x64 px" in err.value.one_line()


@needs_backend
@pytest.mark.filterwarnings("ignore::UserWarning")  # PIL's notes on the damage it reads past
@FUZZ
@given(data=st.data())
def test_random_bytes_as_images_are_skipped_or_read(tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("img")
    kind = data.draw(st.sampled_from(["png", "gif", "tiff", "jpeg", "bmp", "random"]))
    if kind == "random":
        raw = data.draw(st.binary(max_size=500))
    else:
        buffer = io.BytesIO()
        Image.fromarray(np.full((20, 20, 3), 100, dtype=np.uint8)).save(buffer, format=kind)
        raw = bytearray(buffer.getvalue())
        for at, value in data.draw(st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(0, 255)), max_size=8)):
            raw[at] = value
        raw = bytes(raw[:data.draw(st.integers(0, len(raw)))])
    (folder / "x.img").write_bytes(raw)
    ds = _dataset(folder, ["x.img"])
    old = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = 1 << 20  # a mutated header may claim any size: keep what the test decodes small
    try:
        checked = outcome(lambda: ds.check(0), folder / "metadata.csv", SampleError)
        sampled = outcome(lambda: ds.sample(0), folder / "metadata.csv", SampleError)
    finally:
        Image.MAX_IMAGE_PIXELS = old
    if not isinstance(sampled, SampleError):
        assert sampled["image"].mode == "RGB" and sampled["prompt"] == "a picture"
    if isinstance(checked, SampleError):
        assert checked.index == 0


# --- cache locations (cache/location.py): a path, a file:// URL or s3://bucket/prefix; anything else is one line ---

@given(scheme=st.sampled_from(["", "file://", "s3://", "s3a://", "gs://", "http://", "s3://AKIA:Sup3rS3cret@"]),
       rest=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40))
@example(scheme="s3://AKIA:Sup3rS3cret@", rest="bucket/prefix")
@example(scheme="s3://", rest="")
@example(scheme="s3://", rest="bucket/a?versionId=1")
def test_a_cache_location_is_a_store_or_one_line_that_never_shows_a_secret(scheme, rest):
    from unitgraph.backends.diffusion.cache.store import LocalStore
    from unitgraph.backends.diffusion.cache.object_store import ObjectStore
    from unitgraph.backends.diffusion.cache.location import open_store

    text = scheme + rest
    try:
        store = open_store(text)
    except UnitgraphError as exc:
        line = exc.one_line()
        assert "\n" not in line.strip() and "Sup3rS3cret" not in line
        return
    if isinstance(store, ObjectStore):
        assert scheme in ("s3://", "s3a://") and store.bucket and "@" not in store.bucket
        assert store.describe("manifest.json").startswith(f"s3://{store.bucket}/") and "Sup3rS3cret" not in store.location
    else:
        assert isinstance(store, LocalStore) and scheme in ("", "file://") or "://" not in text


# --- cache entries (cache.parse_entry): stage 2 reads every entry at every step, with the C JSON parser on the
# safetensors header; a damaged entry is still its values or one line naming the file ---

@needs_backend
@FUZZ
@given(data=st.data())
def test_a_damaged_cache_entry_is_its_values_or_one_line(data):
    import torch

    from unitgraph.backends.diffusion.cache.entries import entry_bytes, parse_entry

    values = {"latent_mean": torch.arange(12, dtype=torch.float32).reshape(3, 4),
              "prompt_emb_mask": torch.ones(1, 5, dtype=torch.int64), "img_shapes": [[(1, 4, 4)]], "size": 7}
    raw = bytearray(entry_bytes(values, {"index": 0}))
    header_end = 8 + int.from_bytes(raw[:8], "little")
    # damage aimed at the header half the time (where parsing decides), anywhere otherwise
    limit = header_end - 1 if data.draw(st.booleans()) else len(raw) - 1
    for at, value in data.draw(st.lists(st.tuples(st.integers(0, limit), st.integers(0, 255)), max_size=6)):
        raw[at] = value
    raw = bytes(raw[:data.draw(st.integers(0, len(raw)))]) + data.draw(st.binary(max_size=8))
    try:
        got, meta = parse_entry(raw, "cache/entries/ab.safetensors")
    except BackendError as exc:
        line = exc.one_line()
        assert "\n" not in line.strip() and "cache/entries/ab.safetensors" in line
        return
    assert isinstance(got, dict) and isinstance(meta, dict)
