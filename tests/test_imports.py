"""The package's imports form no cycle (function-level imports included): config and errors are
leaves that the rest builds on."""

import ast
import functools
import os

from conftest import REPO

from t5x_like.data.corpus import parse_python

# Source directory of each package of the distribution (setup.cfg's package_dir).
PACKAGES = {'t5x_like': 't5x_like', 't5x_like.data': 't5x_like/data',
            't5x_like.kernels': 'kernels'}


def module_files() -> dict[str, str]:
  modules = {}
  for package, directory in PACKAGES.items():
    for name in os.listdir(os.path.join(REPO, directory)):
      if name.endswith('.py'):
        module = package if name == '__init__.py' else f'{package}.{name[:-3]}'
        modules[module] = os.path.join(REPO, directory, name)
  return modules


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
        return stack[stack.index(nxt):] + [nxt]
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
  assert {'t5x_like.config', 't5x_like.trainer', 't5x_like.kernels.flash_attention'} <= set(graph)
  assert 't5x_like.partitioning' in graph['t5x_like.trainer']
  cycle = find_cycle(graph)
  assert not cycle, ' -> '.join(cycle)


def test_the_cycle_finder_finds_the_cycle_config_once_had():
  graph = dict(package_import_graph())
  graph['t5x_like.partitioning'] = graph['t5x_like.partitioning'] | {'t5x_like.config'}
  cycle = find_cycle(graph)
  assert cycle[0] == cycle[-1] and 't5x_like.config' in cycle and 't5x_like.partitioning' in cycle

