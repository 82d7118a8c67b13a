"""Tests for the embedded default corpus."""

import ast
import os
import textwrap

import pytest

from t5x_like.data import corpus

COMMON_WORDS = frozenset(
  'the of and to a is in that for be it this are or if an as with not by'.split()
)


@pytest.fixture(scope='module')
def documents():
  return corpus.default_documents()


def test_default_corpus_is_a_few_megabytes_of_documents(documents):
  assert all(isinstance(d, str) and d.strip() for d in documents)
  assert len(documents) > 300
  assert sum(len(d.encode('utf-8')) for d in documents) > 2_000_000


def test_default_corpus_is_mostly_english_prose(documents):
  text = '\n'.join(documents)
  words = text.split()
  # Function words make up about a quarter of English running text; code has almost none.
  assert sum(w.lower() in COMMON_WORDS for w in words) / len(words) > 0.15
  assert sum(c.isalpha() or c.isspace() for c in text) / len(text) > 0.8


def test_default_corpus_starts_with_reference_topics_sorted_by_name(documents):
  from pydoc_data import topics  # pylint: disable=import-outside-toplevel

  names = sorted(topics.topics)
  assert documents[: len(names)] == [topics.topics[name] for name in names]


def test_default_documents_returns_fresh_equal_lists(documents):
  again = corpus.default_documents()
  assert again == documents and again is not documents
  assert corpus.corpus_fingerprint(again) == corpus.corpus_fingerprint(documents)


def test_stdlib_extraction_is_deterministic_and_part_of_the_corpus(documents):
  # A rebuild of the whole corpus takes seconds; one package exercises the same code path.
  json_dir = os.path.join(corpus.stdlib_dir(), 'json')
  first = corpus.stdlib_documents(json_dir)
  assert first and first == corpus.stdlib_documents(json_dir)
  start = documents.index(first[0])
  assert documents[start : start + len(first)] == first
  assert any('JSON' in d for d in first)


def test_source_files_are_sorted_and_skip_test_directories():
  paths = corpus.source_files(corpus.stdlib_dir())
  assert paths
  relative = [os.path.relpath(p, corpus.stdlib_dir()) for p in paths]
  for path in relative:
    assert not set(path.split(os.sep)[:-1]) & corpus.SKIPPED_DIRS, path
  # The walk visits each directory's files in sorted order.
  by_dir = {}
  for path in relative:
    by_dir.setdefault(os.path.dirname(path), []).append(path)
  assert all(files == sorted(files) for files in by_dir.values())


def test_sources_fingerprint_follows_each_files_stamp_and_the_file_list(tmp_path):
  (tmp_path / 'a.py').write_text('"""A module."""\n')
  (tmp_path / 'b.py').write_text('"""B module."""\n')
  first = corpus.sources_fingerprint(str(tmp_path))
  assert corpus.sources_fingerprint(str(tmp_path)) == first
  stat = os.stat(tmp_path / 'a.py')
  os.utime(tmp_path / 'a.py', ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
  touched = corpus.sources_fingerprint(str(tmp_path))
  assert touched != first
  (tmp_path / 'c.py').write_text('"""C module."""\n')
  assert corpus.sources_fingerprint(str(tmp_path)) not in (first, touched)
  # Files the corpus skips do not count.
  (tmp_path / 'tests').mkdir()
  with_c = corpus.sources_fingerprint(str(tmp_path))
  (tmp_path / 'tests' / 'd.py').write_text('"""D."""\n')
  (tmp_path / 'notes.txt').write_text('not a source')
  assert corpus.sources_fingerprint(str(tmp_path)) == with_c


def test_source_document_collects_docstrings_and_comment_prose_in_order(tmp_path):
  path = tmp_path / 'example.py'
  path.write_text(
    textwrap.dedent('''\
      """Module summary for the example.

      # Not a comment: this line belongs to the docstring.
      """

      # This comment block explains why the constant
      # has the value that it has.
      LIMIT = 3  # A trailing note that is left out.

      # x = 1

      class Widget:
        """A widget that holds things."""

        def size(self):
          """Return how many things the widget holds."""
          return LIMIT
      ''')
  )
  document = corpus.source_document(str(path))
  assert document == (
    'Module summary for the example.\n\n'
    '# Not a comment: this line belongs to the docstring.\n\n'
    'This comment block explains why the constant has the value that it has.\n\n'
    'A widget that holds things.\n\n'
    'Return how many things the widget holds.'
  )


def test_source_document_never_executes_the_module(tmp_path):
  marker = tmp_path / 'executed'
  path = tmp_path / 'side_effect.py'
  path.write_text(f'"""Writes a marker when run."""\nopen({str(marker)!r}, "w").close()\n')
  assert corpus.source_document(str(path)) == 'Writes a marker when run.'
  assert not marker.exists()


def test_source_document_skips_unparsable_and_prose_free_files(tmp_path):
  broken = tmp_path / 'broken.py'
  broken.write_text('"""Fine docstring."""\ndef broken(:\n')
  empty = tmp_path / 'code_only.py'
  empty.write_text('x = 1\n# y\n')
  assert corpus.source_document(str(broken)) is None
  assert corpus.source_document(str(empty)) is None


def test_fingerprint_depends_on_content_order_and_boundaries():
  fingerprint = corpus.corpus_fingerprint(['ab', 'c'])
  assert len(fingerprint) == 16 and int(fingerprint, 16) >= 0
  assert fingerprint == corpus.corpus_fingerprint(['ab', 'c'])
  assert fingerprint != corpus.corpus_fingerprint(['a', 'bc'])
  assert fingerprint != corpus.corpus_fingerprint(['c', 'ab'])
  assert fingerprint != corpus.corpus_fingerprint(['ab', 'd'])


class ParsingFinalizer:
  """Parses Python when collected, as pytest's unraisable-exception hook does when a finalizer
  reports an error."""

  def __init__(self):
    self.cycle = self

  def __del__(self):
    ast.parse('def f():\n  return [x for x in range(3)]\n')


def test_parsing_survives_a_finalizer_that_parses():
  path = corpus.__file__
  with open(path) as f:
    source = f.read()

  def parse_amid_garbage(parser):
    for _ in range(20):
      for _ in range(50):
        ParsingFinalizer()
      parser(source, path)

  try:
    parse_amid_garbage(lambda text, name: ast.parse(text, name))
  except SystemError as e:  # Python 3.11.7: the bug parse_python works around.
    assert 'recursion depth mismatch' in str(e)
  parse_amid_garbage(corpus.parse_python)
