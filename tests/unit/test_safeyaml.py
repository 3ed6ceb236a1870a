"""The config reader refuses hostile YAML with one message naming the file and the place, and fast.

Each case is one of issue 15's 17 malformed configs that crashed or hung the old loader (UnicodeDecodeError,
RecursionError, an alias bomb expanded into an error message, a duplicate section silently dropped).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rlslurm.config import load_config
from rlslurm.errors import ConfigError
from rlslurm.safeyaml import MAX_ALIASES, MAX_BYTES, MAX_DEPTH, MAX_NODES, excerpt, read_file, read_text


def _bomb(levels: int = 9) -> str:
    """The billion laughs: each level is nine aliases of the one before (9**9 values once expanded)."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + f"\ncluster: {{extra_sbatch: *a{levels - 1}}}\n"


HOSTILE = [
    # (name, file content, fragments of the one-line message)
    ("binary", b"\xff\xfe\x00job: x\n", ["not UTF-8 text: byte 0xff at offset 0 (line 1, column 1)"]),
    ("binary-later", "job: {name: x}\nrl: ".encode() + b"\x80\x81\n", ["byte 0x80 at offset 19 (line 2, column 5)"]),
    ("nul-byte", b"job: {name: a\x00b}\n", ["invalid YAML at line 1, column 14", "#x0000"]),
    ("deep-flow", ("a: " + "[" * 5000 + "]" * 5000 + "\n").encode(), ["at line 1", "nest"]),
    ("deep-block", "".join("  " * i + f"k{i}:\n" for i in range(100)).encode(),
     [f"nested deeper than {MAX_DEPTH} levels", "line 17"]),
    ("alias-bomb", _bomb().encode(), [f"more than {MAX_NODES:,} values once its aliases are expanded"]),
    ("many-aliases", ("a: &a 1\nb: [" + ", ".join(["*a"] * (MAX_ALIASES + 1)) + "]\n").encode(),
     [f"more than {MAX_ALIASES} aliases"]),
    ("recursive-alias", b"a: &a [1, *a]\n", ["alias *a refers to a value that contains it"]),
    ("duplicate-section", b"rl: {prompts_per_step: 4}\ntrain: {steps: 3}\nrl: {samples_per_prompt: 4}\n",
     ["rl is given twice (lines 1 and 3)"]),
    ("duplicate-nested", b"reward:\n  sandbox: {cpu_s: 1}\n  service: local\n  sandbox: {cpu_s: 2}\n",
     ["reward.sandbox is given twice (lines 2 and 4)"]),
    ("duplicate-field", b"train:\n  steps: 3\n  lr: 0.1\n  steps: 4\n", ["train.steps is given twice (lines 2 and 4)"]),
    ("duplicate-int-spellings", b"x: {1: a, 0x1: b}\n", ["x.1 is given twice"]),
    ("huge-int", ("hardware: {nodes: " + "9" * 5000 + "}\n").encode(), ["an integer of 5,000 characters"]),
    ("sexagesimal", ("hardware: {nodes: " + ":".join(["59"] * 40) + "}\n").encode(), ["beyond every range"]),
    ("too-big", b"# " + b"x" * MAX_BYTES + b"\n", [f"larger than {MAX_BYTES:,} bytes"]),
    ("many-values", ("a: [" + ", ".join(["1"] * (MAX_NODES + 10)) + "]\n").encode()[:MAX_BYTES],
     [f"more than {MAX_NODES:,} values"]),
    ("syntax", b"rl: {clip_eps: 0.2\n", ["invalid YAML at line"]),
    ("python-tag", b"job: !!python/object/apply:os.system ['true']\n",
     ["invalid YAML", "could not determine a constructor"]),
]


@pytest.mark.parametrize("name,content,fragments", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_file_is_refused_with_one_line(tmp_path: Path, name: str, content: bytes, fragments: list[str]):
    path = tmp_path / "job.yaml"
    path.write_bytes(content)
    started = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        load_config(path)
    elapsed = time.perf_counter() - started
    message = str(err.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    assert len(message) < 600, f"the message must quote a bounded excerpt: {len(message)} characters"
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert elapsed < 2.0, f"{name}: refused after {elapsed:.2f} s"


def test_a_file_that_cannot_be_read_is_refused(tmp_path: Path):
    for path, fragment in ((tmp_path / "nope.yaml", "No such file"), (tmp_path, "Is a directory"),
                           (Path("/dev/zero"), f"larger than {MAX_BYTES:,} bytes")):
        with pytest.raises(ConfigError, match=fragment):
            read_file(path)


def test_merge_keys_and_a_few_anchors_still_load():
    data = read_text("base: &b {steps: 3, lr: 0.1}\ntrain:\n  <<: *b\n  steps: 5\n", "x")
    assert data["train"] == {"steps": 5, "lr": 0.1}


def test_a_value_from_the_command_line_that_was_not_utf8_is_refused():
    # argv bytes that are not UTF-8 reach Python as lone surrogates (surrogateescape)
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        read_text("a\udcffb", "--set job.name")


def test_excerpt_is_bounded_and_never_converts_a_giant_int():
    nested: list = ["x" * 10_000]
    for _ in range(30):
        nested = [nested] * 9  # shared, like an alias: expanding it would never end
    assert len(excerpt(nested)) <= 160
    assert excerpt(10**5000) == "<an integer of about 5001 digits>"
    assert excerpt(-(10**5000)).startswith("-<an integer")
    assert excerpt(3) == "3" and excerpt("ab") == "'ab'"
