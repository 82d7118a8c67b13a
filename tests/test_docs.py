"""The README and docs/ against the tree: every relative link reaches its file and heading, every
file path and `module.name` they name in backticks exists, and the two front ends they show give
one Config."""

import ast
import collections
import functools
import glob
import os
import re
import shlex

import pytest
from conftest import REPO, run_cli

from t5x_like.cli.train import parse_args
from t5x_like.config import SECTIONS
from t5x_like.training import metrics

PAGES = ['README.md', 'CONTRIBUTING.md', *sorted(glob.glob('docs/*.md', root_dir=REPO))]

# A path as the docs name files of the tree: a top-level folder of the repository, then a file.
TREE_PATH = re.compile(
  r'`((?:t5x_like|kernels|configs|benchmarks|tests|launch|docs|\.ci)/[\w./-]*\.(?:py|md|gin|sh|gz|txt))`'
)


def prose_lines(path: str):
  """(line number, line) of a Markdown file outside its fenced code blocks."""
  fenced = False
  with open(os.path.join(REPO, path)) as f:
    for number, line in enumerate(f, 1):
      if line.lstrip().startswith('```'):
        fenced = not fenced
      elif not fenced:
        yield number, line


def heading_anchors(path: str) -> set[str]:
  """The anchors GitHub gives the headings of a Markdown file: the text of links and tags kept,
  lower case, punctuation but '-' and '_' dropped, spaces to '-', '-1', '-2' for repeats."""
  anchors: set[str] = set()
  seen: dict[str, int] = {}
  for _, line in prose_lines(path):
    heading = re.match(r'#{1,6}\s+(.*?)\s*#*\s*$', line)
    if not heading:
      continue
    text = re.sub(r'\[([^\]]*)\]\([^)]*\)', r'\1', heading.group(1))
    slug = re.sub(r'[^\w\- ]', '', re.sub(r'<[^>]+>', '', text).strip().lower()).replace(' ', '-')
    anchors.add(f'{slug}-{seen[slug]}' if slug in seen else slug)
    seen[slug] = seen.get(slug, 0) + 1
  return anchors


def broken_links(pages: list[str]) -> list[str]:
  """'page:line: target (why)' for each relative link whose file or heading is not there."""
  broken = []
  for page in pages:
    for number, line in prose_lines(page):
      for target in re.findall(r'\]\(([^)\s]+)\)', line):
        if re.match(r'[a-z]+:', target):
          continue  # https:, mailto:
        file, _, anchor = target.partition('#')
        linked = os.path.normpath(os.path.join(os.path.dirname(page), file)) if file else page
        if not os.path.exists(os.path.join(REPO, linked)):
          broken.append(f'{page}:{number}: {target} (no file {linked})')
        elif anchor and linked.endswith('.md') and anchor not in heading_anchors(linked):
          broken.append(f'{page}:{number}: {target} (no heading #{anchor} in {linked})')
  return broken


def test_every_link_of_the_docs_reaches_its_file_and_heading():
  broken = broken_links(PAGES)
  assert not broken, 'mend these links (a heading renamed, a file moved?):\n' + '\n'.join(broken)


def test_the_link_check_finds_a_renamed_heading_and_a_missing_file(tmp_path, monkeypatch):
  docs = tmp_path / 'docs'
  docs.mkdir()
  (docs / 'a.md').write_text(
    '# A page\n\n## Blend lookups (`benchmarks/blend_lookup.py`)\n\n## Notes\n\n## Notes\n\n'
    '```\n## not a heading\n```\n'
  )
  (docs / 'b.md').write_text(
    '[ok](a.md#blend-lookups-benchmarksblend_lookuppy) [ok](a.md#notes-1) [ok](#links)\n'
    '[renamed](a.md#blend-lookups) [fenced](a.md#not-a-heading) [gone](c.md)\n'
    '[web](https://example.com/#x)\n\n## Links\n'
  )
  monkeypatch.setattr(f'{__name__}.REPO', str(tmp_path))
  assert [b.partition(' (')[0] for b in broken_links(['docs/b.md'])] == [
    'docs/b.md:2: a.md#blend-lookups',
    'docs/b.md:2: a.md#not-a-heading',
    'docs/b.md:2: c.md',
  ]


def test_every_file_the_docs_name_exists():
  missing = [
    f'{page}:{number}: {path}'
    for page in PAGES
    for number, line in prose_lines(page)
    for path in TREE_PATH.findall(line)
    if not glob.glob(path.replace('N', '*'), root_dir=REPO)  # 'checkpoints/N/...' style
    and not os.path.exists(os.path.join(REPO, path))
  ]
  assert not missing, 'these files are not in the tree:\n' + '\n'.join(missing)


# `module.name` as the docs write a name of the package: `watches.SpikeWatch`, `t5x_like.plan`.
MODULE_NAME = re.compile(r'`([a-z_][a-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)[`(\[ ]')
# Suffixes that make `metrics.jsonl` a file name, not a name in the metrics module.
FILE_SUFFIXES = {'py', 'json', 'jsonl', 'txt', 'gin', 'md', 'png', 'lock'}


@functools.cache
def package_modules() -> dict[str, list[str]]:
  """{a module's last name: its files} of t5x_like and kernels (a package's: its __init__.py,
  named __init__ but for kernels)."""
  modules = collections.defaultdict(list)
  for path in glob.glob('**/*.py', root_dir=os.path.join(REPO, 't5x_like'), recursive=True):
    modules[os.path.basename(path)[:-3]].append(os.path.join(REPO, 't5x_like', path))
  for path in glob.glob('*.py', root_dir=os.path.join(REPO, 'kernels')):
    name = 'kernels' if path == '__init__.py' else path[:-3]  # installed as t5x_like.kernels
    modules[name].append(os.path.join(REPO, 'kernels', path))
  return modules


@functools.cache
def defined_names(path: str) -> frozenset[str]:
  """What a module defines or imports at its top level, what its classes define, and the
  attributes they set on self (`trainer.checkpoints`: the Trainer's field). A function's local
  names are not the module's."""
  with open(path) as f:
    tree = ast.parse(f.read())
  names: set[str] = set()

  def define(statements, in_class: bool):
    for node in statements:
      if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        names.add(node.name)
      if isinstance(node, ast.ClassDef):
        define(node.body, in_class=True)
      elif isinstance(node, ast.Assign | ast.AnnAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
      elif isinstance(node, ast.Import | ast.ImportFrom) and not in_class:
        names.update((a.asname or a.name).split('.')[0] for a in node.names)
      elif isinstance(node, ast.If | ast.Try):  # a guarded import or definition
        define(ast.iter_child_nodes(node), in_class)

  define(tree.body, in_class=False)
  names.update(
    n.attr
    for n in ast.walk(tree)
    if isinstance(n, ast.Attribute) and getattr(n.value, 'id', None) == 'self'
  )
  return frozenset(names)


def unknown_names(pages: list[str]) -> list[str]:
  """'page:line: module.name' for each name the pages give a package module that it lacks (a
  config key such as `train.steps` and a file such as `metrics.jsonl` are not names)."""
  unknown = []
  for page in pages:
    for number, line in prose_lines(page):
      for module, name in MODULE_NAME.findall(line):
        if module in SECTIONS or name in FILE_SUFFIXES:
          continue
        if module == 't5x_like':
          known = name in package_modules() or os.path.isdir(os.path.join(REPO, 't5x_like', name))
        elif module in package_modules():
          known = any(name in defined_names(path) for path in package_modules()[module])
        else:
          continue  # not a module of the package: jax.jit, os.environ
        if not known:
          unknown.append(f'{page}:{number}: {module}.{name}')
  return unknown


def test_every_module_name_the_docs_give_exists():
  """docs/benchmarks.md is left out: its history names what the code had then."""
  unknown = unknown_names([p for p in PAGES if p != 'docs/benchmarks.md'])
  assert not unknown, 'the package has no such name (renamed? moved?):\n' + '\n'.join(unknown)


@pytest.mark.parametrize('page', ['README.md', 'docs/configs.md'])
def test_the_two_front_ends_shown_give_one_config(page):
  """The page's pair of train commands, one from configs/*.py with --config overrides and one
  from configs/*.gin with --gin_bindings, parse to equal Configs (so that their claim holds)."""
  with open(os.path.join(REPO, page)) as f:
    commands = re.findall(
      r'^python -m t5x_like\.train (.*(?:--config |--gin_file ).*)$', f.read(), re.M
    )
  py = [shlex.split(c) for c in commands if c.startswith('--config ')]
  gin = [shlex.split(c) for c in commands if c.startswith('--gin_file ')]
  assert len(py) == 1 and len(gin) == 1, commands
  cwd = os.getcwd()
  os.chdir(REPO)  # the commands name configs/ relative to the repository
  try:
    (py_config, _), (gin_config, _) = parse_args(py[0]), parse_args(gin[0])
  finally:
    os.chdir(cwd)
  assert py_config == gin_config


def test_the_hook_example_runs_as_shown(tmp_path):
  """docs/training_loop.md's example, run from the repository with a smaller model, a shorter run
  and its own workdir: each kind of hook is called where the page says."""
  with open(os.path.join(REPO, 'docs', 'training_loop.md')) as f:
    [example] = re.findall(r'## Adding a hook\n\n```python\n(.*?)```', f.read(), re.S)
  shown = ("{'train.steps': 20}", "'/tmp/t5x_like_hooks'")
  assert all(text in example for text in shown), example
  smaller = {
    'train.steps': 10,
    'model.num_layers': 2,
    'model.hidden_size': 64,
    'model.num_heads': 4,
    'train.seq_len': 32,
    'train.global_batch_size': 8,
    'train.micro_batch_size': 2,
    'eval.interval': 0,
    'runtime.tensorboard_dir': '',
  }
  example = example.replace(shown[0], repr(smaller))
  example = example.replace(shown[1], repr(str(tmp_path / 'run')))
  r = run_cli(['-c', example])
  assert r.returncode == 0, r.stderr[-3000:]
  printed = [line for line in r.stdout.splitlines() if not line.startswith(' iteration')]
  assert printed[printed.index('training from 0') + 1].startswith('10 ')  # iteration, grad norm
  assert any(line.startswith('> done') for line in printed[printed.index('training from 0') :])


def test_the_log_line_shown_is_the_one_the_trainer_prints():
  """docs/monitoring.md's iteration line, printed again by metrics.log_line from its own numbers."""
  with open(os.path.join(REPO, 'docs', 'monitoring.md')) as f:
    [shown] = re.findall(r'^ iteration .*$', f.read(), re.M)
  fields = dict(re.findall(r'([A-Za-z][A-Za-z ()]*?): +([-+.\dE]+) \|', shown))
  iteration, total = map(int, re.match(r' iteration +(\d+)/ *(\d+) \|', shown).groups())
  record = {
    'iteration': iteration,
    'consumed_samples': int(fields['consumed samples']),
    'consumed_tokens': int(fields['consumed tokens']),
    'step_time_s': float(fields['elapsed time per iteration (s)']),
    'learning_rate': float(fields['learning rate']),
    'global_batch_size': int(fields['global batch size']),
    'lm_loss': float(fields['lm loss']),
    'grad_norm': float(fields['grad norm']),
    'num_zeros': float(fields['num zeros']),
    'skipped_iterations': int(fields['number of skipped iterations']),
    'nan_iterations': int(fields['number of nan iterations']),
    'samples_per_sec': float(fields['samples per second']),
    'tflops': float(fields['TFLOPs']),
  }
  assert metrics.log_line(record, total) == shown


def test_the_planner_example_is_what_the_planner_prints():
  """docs/planner.md's `--estimate` of tr11's config, run again (the cost model only: a second)."""
  with open(os.path.join(REPO, 'docs', 'planner.md')) as f:
    [shown] = re.findall(r'on A100 80GB:\n\n```\n(.*?)```', f.read(), re.S)
  r = run_cli(
    ['-m', 't5x_like.plan', '--config', 'configs/bloom_176b.py', '--estimate', '--gpu', 'a100-80gb']
  )
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout == shown
