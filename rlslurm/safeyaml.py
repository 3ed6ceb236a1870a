"""A YAML reader for input that may be hostile: bounded size, UTF-8 only, bounded depth and aliases, no duplicate keys.

    data = read_file("job.yaml")            # ConfigError naming the file and the place, never a traceback
    value = read_text("[1, 2]", "--set x")  # the same rules for a value given on the command line

A job config is a few kilobytes, a handful of levels deep, with no need for aliases. The reader is PyYAML's
safe loader (libyaml's events, composed and constructed in Python, so its hooks see every node) with limits
added where PyYAML has none: its composer
recurses once per level (a file of 5,000 `[` ended in RecursionError), it shares an aliased node instead of
copying it, so an alias bomb is cheap to load but explodes in whatever walks it (an error message that
quoted the value ran for minutes), and a repeated key silently replaced the first one (a second `rl:`
section dropped the first). Each limit is refused while composing, before the next level or copy exists.
"""

from __future__ import annotations

import math
import reprlib
from pathlib import Path
from typing import Any

import yaml
from yaml.composer import Composer, ComposerError
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.reader import ReaderError
from yaml.resolver import Resolver

from rlslurm.errors import ConfigError

MAX_BYTES = 64 * 1024
"""Largest config file read, in bytes (the examples are 1-5 KB)."""
MAX_DEPTH = 16
"""Deepest nesting of mappings and lists (a job config needs 4: reward.sandbox.cpu_s = 3 levels + the top)."""
MAX_ALIASES = 64
"""Aliases (`*name`) one document may use."""
MAX_NODES = 5_000
"""Values a document may hold once every alias is expanded (the lecture's example holds ~200)."""
MAX_INT_CHARS = 64
"""Longest integer literal read: longer ones are beyond every range and slow to convert."""
MERGE_TAG = "tag:yaml.org,2002:merge"


class Refused(yaml.MarkedYAMLError):
    """A document this reader will not load (too deep, too many aliases, a duplicate key...)."""


def excerpt(value: Any, limit: int = 80) -> str:
    """repr() of a config value, bounded: no alias expansion, no giant string, no 4,300-digit int conversion."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        if value.bit_length() > 200:
            digits = int(value.bit_length() * math.log10(2)) + 1
            return f"{'-' if value < 0 else ''}<an integer of about {digits} digits>"
        return repr(value)
    return _EXCERPT.repr(value)[: limit * 2]


class _Excerpt(reprlib.Repr):
    def repr_int(self, x, level):  # reprlib would call repr() on it: ValueError past 4,300 digits
        return excerpt(x)


_EXCERPT = _Excerpt()
_EXCERPT.maxstring, _EXCERPT.maxother, _EXCERPT.maxlevel = 80, 80, 3
_EXCERPT.maxlist = _EXCERPT.maxtuple = _EXCERPT.maxdict = _EXCERPT.maxset = 6


def clip(text: str, limit: int = 240) -> str:
    """One line of at most `limit` characters (PyYAML problems can quote a whole line of the input)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


try:  # libyaml's event parser (PyYAML's wheels ship it) is ~20x faster; composing stays in Python, with the limits
    from yaml._yaml import CParser as _Parser
except ImportError:  # pragma: no cover - a PyYAML built without libyaml: the same events, in Python
    from yaml.parser import Parser
    from yaml.reader import Reader
    from yaml.scanner import Scanner

    class _Parser(Reader, Scanner, Parser):  # type: ignore[no-redef]
        def __init__(self, stream: str):
            Reader.__init__(self, stream)
            Scanner.__init__(self)
            Parser.__init__(self)


class _Loader(Composer, _Parser, SafeConstructor, Resolver):
    """PyYAML's safe loader, composing in Python with limits on depth, aliases and expanded size, and with
    duplicate keys refused."""

    def __init__(self, stream: str):
        _Parser.__init__(self, stream)
        SafeConstructor.__init__(self)
        Resolver.__init__(self)
        Composer.__init__(self)
        self._depth = 0
        self._aliases = 0
        self._expanded = 0
        self._open_anchors: set[str] = set()
        self._sizes: dict[int, int] = {}
        self._paths: dict[int, str] = {}
        self._path: list[str] = []

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise Refused(None, None, f"more than {MAX_ALIASES} aliases (*name); a job config needs none",
                              event.start_mark)
            if event.anchor in self._open_anchors:
                raise Refused(None, None, f"alias *{clip(event.anchor, 40)} refers to a value that contains it",
                              event.start_mark)
            node = super().compose_node(parent, index)
            self._grow(self._sizes.get(id(node), 1), event.start_mark)
            return node
        if self._depth >= MAX_DEPTH and not isinstance(event, yaml.ScalarEvent):
            raise Refused(None, None, f"nested deeper than {MAX_DEPTH} levels (a job config needs 4)",
                          event.start_mark)
        step = self._step(parent, index)
        self._depth += 1
        if step is not None:
            self._path.append(step)
        if event.anchor is not None:
            self._open_anchors.add(event.anchor)
        try:
            node = super().compose_node(parent, index)
            self._account(node)  # while its own key is still on the path
        finally:
            self._depth -= 1
            if step is not None:
                self._path.pop()
            self._open_anchors.discard(event.anchor)
        return node

    def _step(self, parent: Node | None, index: Any) -> str | None:
        if isinstance(parent, SequenceNode):
            return f"[{index}]"
        if isinstance(parent, MappingNode) and isinstance(index, ScalarNode):
            return clip(index.value, 60)
        return None

    def _account(self, node: Node) -> None:
        """Record the node's size with every alias under it expanded (for the aliases that follow)."""
        size = 1
        if isinstance(node, SequenceNode):
            size += sum(self._sizes.get(id(child), 1) for child in node.value)
        elif isinstance(node, MappingNode):
            size += sum(self._sizes.get(id(k), 1) + self._sizes.get(id(v), 1) for k, v in node.value)
            self._paths[id(node)] = ".".join(self._path).replace(".[", "[")
        self._sizes[id(node)] = size
        self._grow(1, node.start_mark)

    def _grow(self, values: int, mark: Any) -> None:
        """Count values of the expanded document as they are composed; refuse past MAX_NODES at once."""
        self._expanded += values
        if self._expanded > MAX_NODES:
            how = " once its aliases are expanded (an alias bomb?)" if self._aliases else ""
            raise Refused(None, None, f"more than {MAX_NODES:,} values{how}; a job config holds a few hundred",
                          mark)

    def construct_mapping(self, node: Node, deep: bool = False) -> dict:
        if isinstance(node, MappingNode):
            seen: dict[Any, Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == MERGE_TAG:  # `<<: *base` merges; keys given here override the base's
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:
                    continue  # an unhashable key: SafeConstructor refuses it below, with its place
                if first is not key_node:
                    where, name = self._paths.get(id(node), ""), key if isinstance(key, str) else excerpt(key)
                    path = f"{where}.{clip(name, 60)}" if where else clip(name, 60)
                    raise Refused(None, None, f"{path} is given twice (lines {first.start_mark.line + 1} and "
                                              f"{key_node.start_mark.line + 1}): the second would silently "
                                              "replace the first; keep one", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: Node) -> int:
        if isinstance(node, ScalarNode) and len(node.value) > MAX_INT_CHARS:
            raise Refused(None, None, f"an integer of {len(node.value):,} characters is beyond every range",
                          node.start_mark)
        return super().construct_yaml_int(node)


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)


def read_text(text: str, source: str) -> Any:
    """Parse one YAML document from `text` under the reader's limits; ConfigError names `source` and the place."""
    if len(text) > MAX_BYTES:
        raise ConfigError(f"{source}: {len(text):,} characters is more than the {MAX_BYTES:,} a config may have")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # argv that was not UTF-8 reaches Python as lone surrogates
        raise ConfigError(f"{source}: not UTF-8 text: an undecodable byte at character {e.start}") from None
    loader = None
    try:
        loader = _Loader(text)  # the reader checks every character here: a control character fails at once
        return loader.get_single_data()
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: {_describe(e, text)}") from None
    finally:
        if loader is not None:
            loader.dispose()


def read_file(path: str | Path) -> Any:
    """Read and parse the config file at `path`: bounded size, UTF-8, then read_text's rules."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)  # bounded even for /dev/zero or a growing file
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file ({e.strerror or e})") from None
    if len(data) > MAX_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_BYTES:,} bytes: not a job config (they are a few KB)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigError(f"{path}: not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start} (line {line}, "
                          f"column {column}); a job config is a UTF-8 YAML file") from None
    return read_text(text, str(path))


def _code(character: int | str | bytes) -> int:
    return character if isinstance(character, int) else ord(character)


def _describe(e: yaml.YAMLError, text: str) -> str:
    """`invalid YAML at line L, column C: problem` (PyYAML's own words), or the refusal and its place."""
    if isinstance(e, ReaderError):  # a control character: libyaml gives its offset in the UTF-8 bytes
        data = text.encode("utf-8", "surrogatepass")
        line = data.count(b"\n", 0, e.position) + 1
        column = len(data[data.rfind(b"\n", 0, e.position) + 1: e.position].decode("utf-8", "replace")) + 1
        return (f"invalid YAML at line {line}, column {column}: character #x{_code(e.character):04x} "
                "(a control character) is not allowed in YAML")
    mark = getattr(e, "problem_mark", None)
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = clip(getattr(e, "problem", None) or str(e))
    if isinstance(e, Refused):
        return f"refused{at}: {problem}"
    if isinstance(e, ConstructorError | ComposerError) and getattr(e, "context", None):
        problem = f"{clip(e.context, 80)}: {problem}"
    return f"invalid YAML{at}: {problem}"
