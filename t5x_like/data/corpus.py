"""The default training corpus: real English text that every Python install already has.

No download is needed, so tests, CI and air-gapped machines can train on the same text.  Sources:

* the Python language reference shipped as `pydoc_data.topics` (one document per topic, sorted by
  topic name);
* the standard library's own prose, read from its `.py` files with `ast` (nothing is imported):
  module, class and function docstrings, plus blocks of full-line `#` comments.  One document per
  source file, its pieces in source order.

The result is a pure function of the Python install (sorted walks, no clock, no randomness), so
`corpus_fingerprint` identifies it and keys the token cache in `dataset.py`. Building it parses
the whole library (seconds); `sources_fingerprint` identifies what it is built from by file
stamps alone, so that a process finds its cached tokens without building it.
"""

from __future__ import annotations

import ast
import functools
import gc
import hashlib
import importlib.util
import io
import os
import sys
import sysconfig
import tokenize
from collections.abc import Iterator, Sequence

# Directories whose text is not library prose (test fixtures, the IDE, third-party packages).
SKIPPED_DIRS = frozenset({'test', 'tests', 'idlelib', 'site-packages', '__pycache__'})

# Comment blocks shorter than this are mostly markers ('XXX', 'noqa', 'type: ignore') or code.
MIN_COMMENT_WORDS = 4
# Below this share of letters among non-space characters a comment block is commented-out code.
MIN_COMMENT_LETTER_RATIO = 0.6

_DEF_NODES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def stdlib_dir() -> str:
  return sysconfig.get_paths()['stdlib']


def topic_documents() -> list[str]:
  """The Python reference documentation topics, sorted by topic name."""
  # Imported lazily: the module is a 0.5 MB dict literal that only the corpus needs.
  from pydoc_data import topics  # pylint: disable=import-outside-toplevel

  return [topics.topics[name] for name in sorted(topics.topics)]


def source_files(root: str) -> list[str]:
  """All `.py` files under `root` in a sorted, platform-independent order."""
  paths: list[str] = []
  for directory, subdirs, files in os.walk(root):
    # Sorting in place fixes os.walk's descent order; the filter prunes the skipped subtrees.
    subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS)
    paths.extend(os.path.join(directory, f) for f in sorted(files) if f.endswith('.py'))
  return paths


def _definitions(
  body: list[ast.stmt],
) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef]:
  """Function and class definitions anywhere in a statement list (also inside if/try/with...).

  Walking statement lists only is several times cheaper than `ast.walk` over every expression,
  and definitions never live inside expressions.
  """
  for statement in body:
    if isinstance(statement, _DEF_NODES):
      yield statement
    for field in ('body', 'orelse', 'finalbody', 'handlers', 'cases'):
      children = getattr(statement, field, None)
      if not isinstance(children, list):
        continue
      for child in children:
        if isinstance(child, (ast.ExceptHandler, ast.match_case)):
          yield from _definitions(child.body)
        elif isinstance(child, ast.stmt):
          yield from _definitions([child])


def _docstrings(tree: ast.Module) -> Iterator[tuple[int, int, str]]:
  """(first line, last line, cleaned text) of every docstring in the module."""
  for node in (tree, *_definitions(tree.body)):
    text = ast.get_docstring(node, clean=True)
    if text and text.strip():
      literal = node.body[0]
      assert literal.end_lineno is not None  # ast.parse sets every statement's end
      yield literal.lineno, literal.end_lineno, text.strip()


def _is_prose(text: str) -> bool:
  non_space = [c for c in text if not c.isspace()]
  letters = sum(c.isalpha() for c in non_space)
  return len(text.split()) >= MIN_COMMENT_WORDS and letters >= MIN_COMMENT_LETTER_RATIO * len(
    non_space
  )


def _comment_blocks(lines: Sequence[str], excluded: set[int]) -> Iterator[tuple[int, int, str]]:
  """(first line, last line, text) of each run of consecutive full-line comments.

  Lines are 1-based like `ast`.  `excluded` holds lines inside docstrings, where a leading '#' is
  text of the docstring, not a comment.  Comments after code on the same line are left out: they
  are usually terse annotations rather than sentences.  A '#' line inside some other multi-line
  string (rare: code templates) passes for a comment; finding those would need a full `tokenize`
  pass, which would more than double the build time.
  """
  block: list[str] = []
  start = 0
  for number, line in enumerate((*lines, ''), start=1):
    stripped = line.strip()
    if stripped.startswith('#') and number not in excluded:
      if not block:
        start = number
      block.append(stripped.lstrip('#').strip())
      continue
    text = ' '.join(part for part in block if part)
    if text and _is_prose(text):
      yield start, number - 1, text
    block = []


def parse_python(source: str | bytes, path: str) -> ast.Module:
  """`ast.parse` with the garbage collector held off.

  Python 3.11.7's AST conversion keeps one recursion counter per interpreter; a finalizer that
  runs during it and parses too (pytest's unraisable-exception hook formats tracebacks with
  `ast.parse`) leaves the counter off and the outer parse fails with "SystemError: AST
  constructor recursion depth mismatch".
  """
  gc.disable()
  try:
    return ast.parse(source, filename=path)
  finally:
    gc.enable()


def source_document(path: str) -> str | None:
  """The prose of one source file, or None when it has none or does not parse."""
  with open(path, 'rb') as f:
    source = f.read()
  try:
    tree = parse_python(source, path)
    # ast decoded the bytes with the file's coding cookie; decode the same way for comments.
    text = source.decode(_source_encoding(source))
  except (SyntaxError, ValueError, LookupError):  # ValueError includes UnicodeDecodeError.
    return None
  pieces = list(_docstrings(tree))
  docstring_lines = {n for first, last, _ in pieces for n in range(first, last + 1)}
  pieces.extend(_comment_blocks(text.splitlines(), docstring_lines))
  if not pieces:
    return None
  pieces.sort(key=lambda piece: (piece[0], piece[1]))
  return '\n\n'.join(piece_text for _, _, piece_text in pieces)


def _source_encoding(source: bytes) -> str:
  encoding, _ = tokenize.detect_encoding(io.BytesIO(source).readline)
  return encoding


def stdlib_documents(root: str | None = None) -> list[str]:
  """One document per standard library source file that has prose, in sorted path order."""
  documents = []
  for path in source_files(root or stdlib_dir()):
    document = source_document(path)
    if document:
      documents.append(document)
  return documents


@functools.cache
def _default_documents() -> tuple[str, ...]:
  return (*topic_documents(), *stdlib_documents())


def default_documents() -> list[str]:
  """The default corpus: reference topics, then standard library prose.  One string per document.

  Building it parses the whole standard library (seconds), so the result is memoized per process;
  each call returns a fresh list that the caller may modify.
  """
  return list(_default_documents())


def sources_fingerprint(root: str | None = None, length: int = 16) -> str:
  """A sha256 hex prefix of what `default_documents()` is built from, with `root` its standard
  library: the Python version, this module's source (the extraction rules), and the path, size
  and modification time of the reference topics and of each library source file. Python's own
  bytecode cache trusts the same file stamps; equal fingerprints mean equal documents.
  """
  digest = hashlib.sha256()
  root = root or stdlib_dir()
  digest.update(sys.version.encode('utf-8'))
  with open(__file__, 'rb') as f:
    digest.update(hashlib.sha256(f.read()).digest())
  spec = importlib.util.find_spec('pydoc_data.topics')
  topics_path = spec.origin if spec and spec.origin else ''
  for path in (topics_path, *source_files(root)):
    stat = os.stat(path) if path else None
    stamp = (os.path.relpath(path, root), stat.st_size, stat.st_mtime_ns) if stat else ()
    digest.update(repr(stamp).encode('utf-8'))
  return digest.hexdigest()[:length]


def corpus_fingerprint(documents: Sequence[str], length: int = 16) -> str:
  """A sha256 hex prefix identifying the exact documents, their order and their boundaries."""
  digest = hashlib.sha256()
  for document in documents:
    encoded = document.encode('utf-8')
    # Length-prefixing makes ['ab', 'c'] and ['a', 'bc'] hash differently.
    digest.update(len(encoded).to_bytes(8, 'little'))
    digest.update(encoded)
  return digest.hexdigest()[:length]
