"""The habits CONTRIBUTING.md promises are wired up: the commit-message check, the tools' settings
and the constraints file that the README's commands install with."""

import importlib.util
import os

import pytest
from conftest import REPO


def commit_check():
  path = os.path.join(REPO, '.ci', 'check_commit_message.py')
  spec = importlib.util.spec_from_file_location('check_commit_message', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize(
  'message, problem',
  [
    ('Layered subpackages\n\nWhy they help.\n', None),
    ('A subject only\n', None),
    ('x' * 72 + '\n', None),
    ('x' * 73 + '\n', 'the subject is 73 characters; at most 72'),
    ('Subject\nbody without a blank line\n', 'the second line must be blank'),
    ('\nbody\n', 'the first line (the subject) is empty'),
    ('# a comment git strips\nSubject\n', None),
  ],
)
def test_commit_messages_have_a_short_subject_and_a_blank_line(message, problem):
  found = commit_check().problem(message)
  assert found == problem or (problem and found.startswith(problem)), found


def test_the_readme_commands_and_ci_install_with_the_constraints_file():
  with open(os.path.join(REPO, 'README.md')) as f:
    readme = f.read()
  with open(os.path.join(REPO, '.ci', 'run')) as f:
    ci = f.read()
  assert readme.count('pip install -c constraints.txt -e .') == 1
  assert "pip install -q -c constraints.txt -e '.[test]'" in readme
  assert "-c constraints.txt -e '.[test]'" in ci
  assert ci.index('ruff format --check') < ci.index('ruff check') < ci.index('mypy')
  assert ci.index('mypy') < ci.index('pytest')
  with open(os.path.join(REPO, 'constraints.txt')) as f:
    pins = dict(line.strip().split('==') for line in f if line.strip() and not line.startswith('#'))
  for package in (
    'jax',
    'jaxlib',
    'flax',
    'optax',
    'orbax-checkpoint',
    'tensorstore',
    'seqio',
    'clu',
    'torch',
    'ruff',
    'mypy',
  ):
    assert package in {name.replace('_', '-').lower() for name in pins}, package
