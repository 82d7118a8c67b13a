"""The package's layers: no import cycle (function-level imports included), no module that
imports a layer above its own, and config and errors as leaves that the rest builds on."""

import ast
import functools
import os

import pytest
from conftest import REPO

from t5x_like.data.corpus import parse_python

# Source directory of each top-level package of the distribution (setup.cfg's package_dir).
PACKAGE_ROOTS = {'t5x_like': 't5x_like', 't5x_like.kernels': 'kernels'}

# The layers, lowest first (t5x_like/__init__.py draws them): a module imports its own package
# and the layers below its own. Packages of one layer do not import each other, but for the
# leaves of layer 0.
LAYERS = {
  't5x_like.errors': 0,
  't5x_like.config': 0,
  't5x_like.files': 0,
  't5x_like.kernels': 0,
  't5x_like.mesh': 1,
  't5x_like.data': 1,
  't5x_like.model': 2,
  't5x_like.optim': 2,
  't5x_like.parallel': 3,
  't5x_like.checkpointing': 4,
  't5x_like.training': 5,
  't5x_like.inference': 6,
  't5x_like.planning': 6,
  't5x_like.cli': 7,
}
# `python -m t5x_like.<command>` runs these root modules: entry points of cli's layer, as is
# `python -m t5x_like.data` (data/__main__.py).
COMMANDS = (
  'train',
  'evaluate',
  'generate',
  'ckpt',
  'plan',
  'plot',
  'watch',
  'devices',
  'from_megatron',
  'harness',
)
ENTRY_POINTS = {f't5x_like.{c}' for c in COMMANDS} | {'t5x_like.data.__main__'}


def module_files() -> dict[str, str]:
  """{module: its file} for every module of the distribution, subpackages included."""
  modules = {}
  for package, directory in PACKAGE_ROOTS.items():
    base = os.path.join(REPO, directory)
    for root, dirs, files in os.walk(base):
      dirs[:] = sorted(d for d in dirs if d != '__pycache__')
      rel = os.path.relpath(root, base)
      prefix = '.'.join([package, *([] if rel == '.' else rel.split(os.sep))])
      for name in files:
        if name.endswith('.py'):
          module = prefix if name == '__init__.py' else f'{prefix}.{name[:-3]}'
          modules[module] = os.path.join(root, name)
  return modules


def unit_of(module: str) -> str | None:
  """The layer unit (a key of LAYERS) that `module` belongs to; None for the package's root
  __init__, which imports nothing."""
  if module in ENTRY_POINTS:
    return 't5x_like.cli'
  for unit in sorted(LAYERS, key=len, reverse=True):
    if module == unit or module.startswith(unit + '.'):
      return unit
  return None


def layer_violations(graph: dict[str, frozenset[str]]) -> list[str]:
  """'a -> b (layer i -> j)' for every import of a layer above a module's own, or of another
  package of its own layer (above 0)."""
  found = []
  for module, imports in sorted(graph.items()):
    unit = unit_of(module)
    if unit is None:
      continue
    for imported in sorted(imports):
      other = unit_of(imported)
      if other is None or other == unit:
        continue
      low, high = LAYERS[other], LAYERS[unit]
      if low > high or (low == high and high > 0):
        found.append(f'{module} -> {imported} (layer {high} -> {low})')
  return found


def parse(path: str) -> ast.Module:
  with open(path) as f:
    return parse_python(f.read(), path)


@functools.cache
def package_import_graph() -> dict[str, frozenset[str]]:
  return {m: frozenset(e) for m, e in import_graph(module_files()).items()}


def import_graph(modules: dict[str, str]) -> dict[str, set[str]]:
  """{module: the package modules it imports anywhere in its text}."""
  graph = {}
  for module, path in modules.items():
    tree = parse(path)
    edges = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        edges.update(a.name for a in node.names if a.name in modules)
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        for alias in node.names:
          full = f'{node.module}.{alias.name}'
          edges.add(full if full in modules else node.module)
    graph[module] = {m for m in edges if m in modules and m != module}
  return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
  """One cycle as [a, b, ..., a], or [] when the graph has none (depth-first search)."""
  state, stack = {}, []

  def visit(node):
    state[node] = 'open'
    stack.append(node)
    for nxt in sorted(graph[node]):
      if state.get(nxt) == 'open':
        return stack[stack.index(nxt) :] + [nxt]
      if nxt not in state:
        cycle = visit(nxt)
        if cycle:
          return cycle
    stack.pop()
    state[node] = 'done'
    return []

  for node in sorted(graph):
    if node not in state:
      cycle = visit(node)
      if cycle:
        return cycle
  return []


def test_the_package_has_no_import_cycle():
  graph = package_import_graph()
  assert {
    't5x_like.config',
    't5x_like.training.trainer',
    't5x_like.kernels.flash_attention',
  } <= set(graph)
  assert 't5x_like.mesh.partitioning' in graph['t5x_like.training.trainer']
  cycle = find_cycle(graph)
  assert not cycle, ' -> '.join(cycle)


def test_the_cycle_finder_finds_the_cycle_config_once_had():
  graph = dict(package_import_graph())
  # config imported partitioning for its mesh check, and partitioning imported config for
  # ConfigError: both edges back.
  graph['t5x_like.config'] = graph['t5x_like.config'] | {'t5x_like.mesh.partitioning'}
  graph['t5x_like.mesh.partitioning'] = graph['t5x_like.mesh.partitioning'] | {'t5x_like.config'}
  cycle = find_cycle(graph)
  assert (
    cycle[0] == cycle[-1] and 't5x_like.config' in cycle and 't5x_like.mesh.partitioning' in cycle
  )


def test_every_module_is_in_a_layer_and_imports_only_below_it():
  graph = package_import_graph()
  unplaced = [m for m in graph if unit_of(m) is None and m != 't5x_like']
  assert not unplaced, f'add these to a layer of LAYERS: {unplaced}'
  violations = layer_violations(graph)
  assert not violations, 'imports against the layers:\n' + '\n'.join(violations)


@pytest.mark.parametrize(
  'module, imported',
  [
    ('t5x_like.model.transformer', 't5x_like.training.trainer'),  # up
    ('t5x_like.model.losses', 't5x_like.optim.adamw'),  # sideways, within layer 2
    ('t5x_like.data.sources', 't5x_like.training.batches'),  # the data layer's old leak
  ],
)
def test_the_layer_check_finds_an_import_against_the_layers(module, imported):
  graph = dict(package_import_graph())
  graph[module] = graph[module] | {imported}
  assert layer_violations(graph) == [
    f'{module} -> {imported} (layer {LAYERS[unit_of(module)]} -> {LAYERS[unit_of(imported)]})'
  ]


def test_each_layer_says_what_it_is_for_and_what_it_may_import():
  for unit, layer in LAYERS.items():
    path = module_files().get(unit)
    if path is None or not path.endswith('__init__.py') or unit == 't5x_like.kernels':
      continue
    doc = ast.get_docstring(parse(path)) or ''
    assert f'Layer {layer}:' in doc, f'{path}: its docstring names no "Layer {layer}:" rule'


def test_config_imports_no_package_module_but_errors():
  """config.py is a leaf that every module can import: the checks that need other modules
  (mesh, attention, schedule, data) live in those modules and run from startup.check_config."""
  assert package_import_graph()['t5x_like.config'] <= {'t5x_like.errors'}


def private_uses(modules: dict[str, str]) -> list[str]:
  """'path:line: module._name' for each use of another package module's private name: `m._name`
  (m an imported package module, by any alias or as a dotted path) and `from m import _name`.
  Private names of other libraries (`os._exit`) are not the package's concern."""
  found = []
  for module, path in sorted(modules.items()):
    tree = parse(path)
    package = module if path.endswith('__init__.py') else module.rpartition('.')[0]
    aliases = {}  # a name bound in this file -> the package module it stands for

    def absolute(node: ast.ImportFrom) -> str:
      if not node.level:
        return node.module or ''
      base = package.rsplit('.', node.level - 1)[0] if node.level > 1 else package
      return f'{base}.{node.module}' if node.module else base

    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        for a in node.names:
          top = a.name.split('.')[0]  # what `import a.b.c` binds
          if a.asname and a.name in modules:
            aliases[a.asname] = a.name
          elif not a.asname and any(m == top or m.startswith(f'{top}.') for m in modules):
            aliases[top] = top
      elif isinstance(node, ast.ImportFrom):
        source = absolute(node)
        for a in node.names:
          if f'{source}.{a.name}' in modules:
            aliases[a.asname or a.name] = f'{source}.{a.name}'
          elif (
            source in modules
            and source != module
            and a.name.startswith('_')
            and not a.name.startswith('__')
          ):
            found.append(f'{path}:{node.lineno}: from {source} import {a.name}')

    def module_of(node: ast.expr) -> str | None:
      """The package module an expression such as `checkpoints` or `t5x_like.data.sources`
      names, or None."""
      if isinstance(node, ast.Name):
        return aliases.get(node.id)
      if isinstance(node, ast.Attribute):
        outer = module_of(node.value)
        if outer and f'{outer}.{node.attr}' in modules:
          return f'{outer}.{node.attr}'
      return None

    for node in ast.walk(tree):
      if (
        isinstance(node, ast.Attribute)
        and node.attr.startswith('_')
        and not node.attr.startswith('__')
      ):
        owner = module_of(node.value)
        if owner and owner != module:
          found.append(f'{path}:{node.lineno}: {owner}.{node.attr}')
      elif (  # monkeypatch.setattr(module, '_name', ...), setattr(module, '_name', ...)
        isinstance(node, ast.Call)
        and getattr(node.func, 'attr', getattr(node.func, 'id', None)) == 'setattr'
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and str(node.args[1].value).startswith('_')
        and not str(node.args[1].value).startswith('__')
      ):
        owner = module_of(node.args[0])
        if owner and owner != module:
          found.append(f'{path}:{node.lineno}: {owner}.{node.args[1].value}')
  return found


def script_files() -> dict[str, str]:
  """{name: file} for the tests and benchmark scripts, named as they import each other (by the
  file's stem: pytest and the scripts put their own folder on sys.path)."""
  scripts = {}
  for directory in ('tests', 'benchmarks'):
    for root, dirs, files in os.walk(os.path.join(REPO, directory)):
      dirs[:] = sorted(d for d in dirs if d != '__pycache__')
      for name in sorted(files):
        if name.endswith('.py'):
          assert name[:-3] not in scripts, f'two scripts named {name}: they would shadow each other'
          scripts[name[:-3]] = os.path.join(root, name)
  return scripts


def test_no_module_uses_another_modules_private_names():
  """The package, its tests and its benchmarks: a test that needs a module's internal names has
  found a name that should be public."""
  uses = private_uses({**module_files(), **script_files()})
  assert not uses, (
    'make these public (a name without the underscore) in the module that owns '
    'them:\n' + '\n'.join(uses)
  )


def test_private_uses_finds_each_form(tmp_path):
  files = {
    't5x_like.lib': 'def _helper(): pass\ndef public(): return _helper()\n',
    't5x_like.data.__init__': '',
    't5x_like.data.reader': 'def _read(): pass\n',
    't5x_like.tool': (
      'import os\nfrom t5x_like import lib\nfrom t5x_like import lib as other\n'
      'import t5x_like.data.reader\nfrom t5x_like.lib import _helper\n'
      'def main():\n  lib._helper()\n  other._helper()\n'
      '  t5x_like.data.reader._read()\n  os._exit(0)\n  lib.public()\n'
      'def test_it(monkeypatch):\n  monkeypatch.setattr(lib, "_helper", None)\n'
      '  monkeypatch.setattr(lib, "public", None)\n  monkeypatch.setattr(os, "_exit", None)\n'
    ),
    't5x_like.data.user': 'from . import reader\nfrom .reader import _read\nreader._read()\n',
  }
  modules = {}
  for module, text in files.items():
    path = tmp_path / f'{module}.py'  # a package's file ends with __init__.py, as on disk
    path.write_text(text)
    modules[module.removesuffix('.__init__')] = str(path)
  uses = [use.rpartition(': ')[2] for use in private_uses(modules)]
  assert sorted(uses) == sorted(
    [
      'from t5x_like.lib import _helper',
      't5x_like.lib._helper',
      't5x_like.lib._helper',
      't5x_like.lib._helper',
      't5x_like.data.reader._read',
      'from t5x_like.data.reader import _read',
      't5x_like.data.reader._read',
    ]
  )


def class_lengths(path: str) -> dict[str, int]:
  """Lines of each top-level class of the module at `path`, docstring and blank lines included."""
  with open(path) as f:
    tree = ast.parse(f.read())
  return {
    node.name: node.end_lineno - node.lineno + 1
    for node in tree.body
    if isinstance(node, ast.ClassDef) and node.end_lineno is not None
  }


def test_the_trainer_stays_a_slim_loop():
  """The Trainer wires a run's parts and runs the loop; the parts live in modules of their own
  (checkpoints, watches, start-up, one iteration). Under 200 lines keeps it readable in a sitting,
  as the layout issue asked."""
  lengths = class_lengths(os.path.join(REPO, 't5x_like', 'training', 'trainer.py'))
  assert 0 < lengths['Trainer'] < 200, lengths


def test_class_lengths_counts_a_class_to_its_last_line(tmp_path):
  path = tmp_path / 'm.py'
  path.write_text('x = 1\n\n\nclass A:\n  """Doc."""\n\n  def f(self):\n    return 1\n\n\ny = 2\n')
  assert class_lengths(str(path)) == {'A': 5}


# Where a class's fields are made: the constructor, a dataclass's __post_init__, a Flax module's
# setup (its constructor for submodules).
CONSTRUCTORS = ('__init__', '__post_init__', 'setup')


def fields_set_outside_constructors(path: str) -> list[str]:
  """'path:line: Class.field first set in method' for each attribute of `self` that a class's
  methods assign but neither its constructor nor its body declares."""
  found = []
  for cls in ast.walk(parse(path)):
    if not isinstance(cls, ast.ClassDef):
      continue
    declared = {
      target.id
      for statement in cls.body
      for target in (
        statement.targets
        if isinstance(statement, ast.Assign)
        else [getattr(statement, 'target', None)]
      )
      if isinstance(target, ast.Name)
    }
    elsewhere = {}
    for method in cls.body:
      if not isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef):
        continue
      for node in ast.walk(method):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AugAssign | ast.AnnAssign):
          targets = [node.target]
        names = [
          attribute.attr
          for target in targets
          for attribute in ast.walk(target)
          if isinstance(attribute, ast.Attribute)
          and isinstance(attribute.value, ast.Name)
          and attribute.value.id == 'self'
        ]
        if method.name in CONSTRUCTORS:
          declared.update(names)
        else:
          for name in names:
            elsewhere.setdefault(name, (method.name, node.lineno))
    for name, (method_name, line) in sorted(elsewhere.items()):
      if name not in declared:
        found.append(f'{path}:{line}: {cls.name}.{name} first set in {method_name}')
  return found


def test_each_class_sets_its_fields_in_its_constructor():
  """A reader learns every field a class has from its constructor."""
  files = [*module_files().values(), *script_files().values()]
  found = [line for path in files for line in fields_set_outside_constructors(path)]
  assert not found, 'set these in the constructor (None until known):\n' + '\n'.join(found)


def test_the_field_check_finds_a_field_set_in_a_method(tmp_path):
  path = tmp_path / 'cache.py'
  path.write_text(
    'class Cache:\n  size: int = 0\n\n  def __init__(self):\n    self.hits = 0\n\n'
    '  def get(self):\n    self.hits += 1\n    self.size = 2\n    if not hasattr(self, "_value"):\n'
    '      self._value = 3\n    return self._value\n'
  )
  assert fields_set_outside_constructors(str(path)) == [f'{path}:11: Cache._value first set in get']
