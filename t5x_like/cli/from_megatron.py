"""`python -m t5x_like.from_megatron`: a Megatron-DeepSpeed launch script becomes a config.

  python -m t5x_like.from_megatron SCRIPT [--out CONFIG.py [--overwrite]] [--set VAR=VALUE ...]

Reads a SLURM/bash launch script of Megatron-DeepSpeed's `pretrain_gpt.py` (the shape of the
BigScience tr1/tr8/tr8b/tr11 scripts), never running it, and writes an equivalent ml_collections
config file of ours (stdout without --out; an existing --out file is an error unless
--overwrite). Its report on stderr lists every flag mapped and to what, every flag that needs no
equivalent here and why, and every flag it could not map and why.

The shell it reads: assignments (`NHIDDEN=14336`, `VAR=${VAR:-default}`), `export`, quoted
argument groups expanded unquoted (`GPT_ARGS=" ... "` then `$GPT_ARGS`), line continuations,
comments, `$((...))` arithmetic, `cat <<EOT > $config_json` heredocs (the DeepSpeed config),
`bash -c "..."` and `#SBATCH --nodes/--gres` lines (the node and GPU counts). Command
substitutions (`$(...)`, backquotes) are never run: their value is unknown, as is an unset
variable's; a flag that needs one is reported with the `--set VAR=VALUE` that fixes it. A --set
variable wins over the script's own assignments to it.

Exit codes: 0 every flag mapped or explained, 1 something not mapped (the config is still written,
with the closest setting and a NOT MAPPED comment), 2 a script it cannot read or an --out that
exists (without --overwrite). docs/from_megatron.md has the full flag table and the differences
a user must know.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import operator
import os
import re
import shlex
import sys
import textwrap
from collections.abc import Callable
from typing import Any, NamedTuple

from t5x_like import config as config_lib


class ScriptError(Exception):
  """The script is outside the shell subset read here, or has no pretrain_gpt.py command."""


# --------------------------------------------------------------------------- the shell subset

# An unknown value (unset variable, command substitution) travels through expansion as this
# marker, so a flag built from one is reported with the variable that would fix it.
_MARK = '\x00'
_MARKER_RE = re.compile(f'{_MARK}([^{_MARK}]*){_MARK}')
_NAME_RE = re.compile(r'[A-Za-z_][A-Za-z0-9_]*')
_VARIABLE_RE = re.compile(r'\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?')
_ASSIGNMENT_RE = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\+?=')
_CONTROL_WORDS = {
  'if',
  'then',
  'elif',
  'else',
  'fi',
  'for',
  'while',
  'until',
  'do',
  'done',
  'case',
  'esac',
  'select',
  'function',
  '{',
  '}',
}
_NO_EFFECT_COMMANDS = {'echo', 'printf', ':', 'true'}


def unknown(description: str) -> str:
  return f'{_MARK}{description}{_MARK}'


def unknowns(text: str) -> list[str]:
  """The unknown values ('$six_ALL_CCFRWORK', '$(date)') a string was built from."""
  return _MARKER_RE.findall(text)


def readable(text: str) -> str:
  """A string with its unknown values shown as the shell text they came from."""
  return _MARKER_RE.sub(lambda m: m.group(1), text)


class _Word(NamedTuple):
  chunks: list[tuple[str, bool]]  # (text, split): unquoted expansions split on whitespace
  assignment: str  # 'NAME' when the word is NAME=value with NAME= unquoted, else ''


@dataclasses.dataclass
class Command:
  line: int
  words: list[str]


@dataclasses.dataclass
class Shell:
  """Variables, the files heredocs wrote and every command, from reading a script."""

  variables: dict[str, str] = dataclasses.field(default_factory=dict)
  pinned: dict[str, str] = dataclasses.field(default_factory=dict)  # --set: wins over the script
  files: dict[str, str] = dataclasses.field(default_factory=dict)
  commands: list[Command] = dataclasses.field(default_factory=list)
  overridden: list[str] = dataclasses.field(default_factory=list)  # '--set X over line N'

  def lookup(self, name: str) -> str | None:
    if name in self.pinned:
      return self.pinned[name]
    return self.variables.get(name)

  def assign(self, name: str, value: str, line: int) -> None:
    if name in self.pinned:
      self.overridden.append(f'--set {name} wins over the assignment on line {line}')
    else:
      self.variables[name] = value

  def run(self, text: str, first_line: int = 1) -> None:
    _Reader(text, self, first_line).run()


class _Reader:
  """Reads and expands one script (or a `bash -c` string) command by command."""

  def __init__(self, text: str, shell: Shell, first_line: int):
    self.text, self.shell, self.pos, self.line = text, shell, 0, first_line
    self.heredocs: list[tuple[str, bool, str | None]] = []  # (delimiter, expand, target)

  # ---- characters
  def peek(self, offset: int = 0) -> str:
    i = self.pos + offset
    return self.text[i] if i < len(self.text) else ''

  def next_in(self, chars: str, offset: int = 0) -> bool:
    c = self.peek(offset)
    return c != '' and c in chars  # '' (the end) is in every string

  def take(self) -> str:
    c = self.text[self.pos]
    self.pos += 1
    if c == '\n':
      self.line += 1
    return c

  def take_marker(self) -> str:
    """An unknown value already expanded (a `bash -c` string holds them): kept as it is."""
    end = self.text.index(_MARK, self.pos + 1)
    marker = self.text[self.pos : end + 1]
    while self.pos <= end:
      self.take()
    return marker

  def error(self, what: str) -> ScriptError:
    return ScriptError(f'line {self.line}: {what}')

  # ---- commands
  def run(self, at_line: int | None = None) -> None:
    """Every command in turn; `at_line`: all of them reported at that line (a `bash -c`)."""
    while self.pos < len(self.text):
      line = self.line if at_line is None else at_line
      words, redirects = self.read_command()
      self.read_heredoc_bodies(redirects)
      if words:
        self.execute(words, line)

  def read_command(self) -> tuple[list[_Word], list[tuple[str, str]]]:
    words: list[_Word] = []
    redirects: list[tuple[str, str]] = []
    while self.pos < len(self.text):
      c = self.peek()
      if c in ' \t':
        self.take()
      elif c == '\\' and self.peek(1) == '\n':
        self.take(), self.take()
      elif c == '#':
        while self.peek() not in ('\n', ''):
          self.take()
      elif c == '\n':
        self.take()
        return words, redirects
      elif c in ';&|':
        self.take()
        if self.peek() == c:
          self.take()
        return words, redirects
      elif c in '()':
        raise self.error(
          f'"{c}" (a subshell, array or function) is outside the shell subset '
          'read here; write the values as plain assignments, or pass them with '
          '--set VAR=VALUE'
        )
      elif c in '<>' or (c.isdigit() and self._redirect_after_digits()):
        redirects.append(self.read_redirect())
      else:
        words.append(self.read_word())
    return words, redirects

  def _redirect_after_digits(self) -> bool:
    i = self.pos
    while i < len(self.text) and self.text[i].isdigit():
      i += 1
    return i < len(self.text) and self.text[i] in '<>'

  def read_redirect(self) -> tuple[str, str]:
    while self.peek().isdigit():
      self.take()
    op = self.take()
    while self.next_in('<>&-'):
      op += self.take()
    if op.endswith('&') and (self.peek().isdigit() or self.peek() == '-'):
      while self.peek().isdigit() or self.peek() == '-':
        self.take()
      return op, ''
    while self.next_in(' \t'):
      self.take()
    if op in ('<<', '<<-'):
      raw = ''
      while self.peek() and self.peek() not in ' \t\n;&|<>':
        raw += self.take()
      delimiter = raw.strip('\'"')
      self.heredocs.append((delimiter, raw == delimiter and '\\' not in raw, None))
      return op, delimiter
    if not self.peek() or self.peek() in '\n;&|':
      raise self.error(f'the redirection {op!r} has no target')
    target = ''.join(self.fields(self.read_word()))
    if op in ('>', '>>') and self.heredocs and self.heredocs[-1][2] is None:
      delimiter, expand, _ = self.heredocs[-1]
      self.heredocs[-1] = (delimiter, expand, target)
    return op, target

  def read_heredoc_bodies(self, redirects: list[tuple[str, str]]) -> None:
    """After the command line that opened them: each heredoc body up to its delimiter line,
    stored as the file its command writes (`cat <<EOT > F` or `cat > F <<EOT`)."""
    written = [target for op, target in redirects if op in ('>', '>>')]
    while self.heredocs:
      delimiter, expand, target = self.heredocs.pop(0)
      target = target if target is not None else (written[-1] if written else None)
      start = self.line
      body = []
      while True:
        if self.pos >= len(self.text):
          raise ScriptError(
            f'line {start}: the heredoc <<{delimiter} never ends (no line "{delimiter}"); close it'
          )
        end = self.text.find('\n', self.pos)
        end = len(self.text) if end < 0 else end
        row = self.text[self.pos : end]
        self.pos = min(end + 1, len(self.text))
        self.line += 1
        if row.strip() == delimiter:
          break
        body.append(row)
      text = '\n'.join(body) + '\n'
      if expand:
        text = _Reader(text, self.shell, start + 1).expand_here(text)
      if target is not None:
        self.shell.files[target] = text

  def expand_here(self, text: str) -> str:
    """A heredoc body: $ expansions and backquotes, as inside double quotes, quotes kept."""
    out = []
    while self.pos < len(text):
      c = self.peek()
      if c == '\\' and self.next_in('$`\\', 1):
        self.take()
        out.append(self.take())
      elif c == '\\' and self.peek(1) == '\n':
        self.take(), self.take()
      else:
        out.append(self.read_expanded())
    return ''.join(out)

  # ---- words
  def read_word(self) -> _Word:
    chunks: list[tuple[str, bool]] = []
    literal = ''
    starts_literal = self.peek() not in '\'"$`'
    while self.pos < len(self.text):
      c = self.peek()
      if c in ' \t\n;&|<>()':
        break
      if c == '\\':
        self.take()
        nxt = self.take() if self.pos < len(self.text) else ''
        if nxt != '\n':
          literal += nxt
        continue
      if c == _MARK:
        literal += self.take_marker()
        continue
      if c in '\'"$`':
        if literal:
          chunks.append((literal, False))
          literal = ''
        if c == "'":
          chunks.append((self.read_single_quoted(), False))
        elif c == '"':
          chunks.append((self.read_double_quoted(), False))
        elif c == '$':
          chunks.append((self.read_dollar(), True))
        else:
          chunks.append((self.read_backquote(), True))
        continue
      literal += self.take()
    if literal:
      chunks.append((literal, False))
    # NAME= must be unquoted shell text: '"A=1"' is a word, not an assignment.
    match = _ASSIGNMENT_RE.match(chunks[0][0]) if chunks and starts_literal else None
    return _Word(chunks, match.group(1) if match else '')

  def read_enclosed(self, quote: str, what: str) -> str:
    """The text up to the closing `quote` (no escapes inside), which is consumed."""
    start = self.line
    self.take()
    end = self.text.find(quote, self.pos)
    if end < 0:
      raise ScriptError(f'line {start}: {what} is never closed; close it')
    value = self.text[self.pos : end]
    while self.pos <= end:
      self.take()
    return value

  def read_single_quoted(self) -> str:
    return self.read_enclosed("'", 'a single quote')

  def read_double_quoted(self) -> str:
    start = self.line
    self.take()
    out: list[str] = []
    while True:
      if self.pos >= len(self.text):
        raise ScriptError(f'line {start}: a double quote is never closed; close it')
      c = self.peek()
      if c == '"':
        self.take()
        return ''.join(out)
      if c == '\\':
        self.take()
        nxt = self.take() if self.pos < len(self.text) else ''
        if nxt and nxt in '$`"\\':
          out.append(nxt)
        elif nxt != '\n':
          out.append('\\' + nxt)
      else:
        out.append(self.read_expanded())

  def read_expanded(self) -> str:
    """What the text at the cursor expands to inside double quotes or a heredoc: a $ expansion,
    a backquote (unknown), a marker, or the character itself."""
    c = self.peek()
    if c == '$':
      return self.read_dollar()
    if c == '`':
      return self.read_backquote()
    if c == _MARK:
      return self.take_marker()
    return self.take()

  def read_backquote(self) -> str:
    return unknown(f'`{self.read_enclosed("`", "a backquote")}`')

  def read_balanced(self, open_: str, close: str) -> str:
    """Text up to the `close` matching an already consumed `open_` (quotes respected)."""
    start, depth, out = self.line, 1, []
    while self.pos < len(self.text):
      c = self.take()
      if c in '\'"':
        end = self.text.find(c, self.pos)
        if end < 0:
          break
        out.append(c + self.text[self.pos : end + 1])
        while self.pos <= end:
          self.take()
        continue
      if c == open_:
        depth += 1
      elif c == close:
        depth -= 1
        if depth == 0:
          return ''.join(out)
      out.append(c)
    raise ScriptError(f'line {start}: "{open_}" is never closed by "{close}"; close it')

  def read_dollar(self) -> str:
    self.take()  # $
    c = self.peek()
    if c == '(' and self.peek(1) == '(':
      self.take(), self.take()
      inner = self.read_balanced('(', ')')
      if self.peek() != ')':
        raise self.error('$((...)) is not closed by "))"; close it')
      self.take()
      return self.arithmetic(inner)
    if c == '(':
      self.take()
      return unknown(f'$({self.read_balanced("(", ")")})')
    if c == '{':
      self.take()
      return self.braced(self.read_balanced('{', '}'))
    name = _NAME_RE.match(self.text, self.pos)
    if name:
      for _ in name.group(0):
        self.take()
      value = self.shell.lookup(name.group(0))
      return unknown(f'${name.group(0)}') if value is None else value
    if c and (c.isdigit() or c in '@*#?$!-'):
      self.take()
      return unknown(f'${c}')
    return '$'

  def braced(self, inner: str) -> str:
    """${NAME}, ${NAME:-word}, ${NAME-word}, ${NAME:=word}, ${NAME:+word} and their kin."""
    match = re.fullmatch(r'([A-Za-z_][A-Za-z0-9_]*|[0-9]+)(?:(:?[-=+?])(.*))?', inner, re.S)
    if not match:
      raise self.error(
        f'${{{inner}}} is outside the shell subset read here (it reads '
        '${VAR}, ${VAR:-default}, ${VAR:=default}, ${VAR:+word}); pass the value '
        'with --set VAR=VALUE'
      )
    name, op, word = match.groups()
    value = self.shell.lookup(name)
    if not op:
      return unknown(f'${{{name}}}') if value is None else value
    empty = value is None or (op.startswith(':') and value == '')
    word_value = ''.join(t for t, _ in _Reader(word, self.shell, self.line).read_word_all().chunks)
    kind = op[-1]
    # `empty` holds where value is None; the checks below repeat that for the type checker.
    if kind == '-':
      return word_value if empty or value is None else value
    if kind == '=':
      if empty or value is None:
        self.shell.assign(name, word_value, self.line)
        assigned = self.shell.lookup(name)
        assert assigned is not None  # assign() set it, or --set pinned it
        return assigned
      return value
    if kind == '+':
      return '' if empty else word_value
    # '?': the script would stop
    return unknown(f'${{{inner}}}') if empty or value is None else value

  def read_word_all(self) -> _Word:
    """The whole text as one word (a ${VAR:-word} default), whitespace kept."""
    chunks = []
    while self.pos < len(self.text):
      c = self.peek()
      if c == "'":
        chunks.append((self.read_single_quoted(), False))
      elif c == '"':
        chunks.append((self.read_double_quoted(), False))
      elif c == '$':
        chunks.append((self.read_dollar(), False))
      elif c == '`':
        chunks.append((self.read_backquote(), False))
      elif c == _MARK:
        chunks.append((self.take_marker(), False))
      else:
        chunks.append((self.take(), False))
    return _Word(chunks, '')

  def arithmetic(self, expression: str) -> str:
    text = _Reader(expression, self.shell, self.line)
    expanded = ''.join(v for v, _ in text.read_word_all().chunks)
    if unknowns(expanded):
      return unknown(unknowns(expanded)[0])  # the value that would fix it, for --set
    try:
      return str(_evaluate(ast.parse(expanded.strip(), mode='eval').body, self.shell))
    except _Unknown as e:
      return unknown(str(e))
    except (SyntaxError, ValueError, KeyError, ZeroDivisionError, TypeError) as e:
      raise self.error(
        f'$(({expression})) is not integer arithmetic read here ({e}); write the '
        'number, or pass it with --set VAR=VALUE'
      ) from None

  # ---- expansion and execution
  @staticmethod
  def fields(word: _Word) -> list[str]:
    """Field splitting of unquoted expansions; quoted and literal text stays in one field."""
    fields, current = [], None
    for text, split in word.chunks:
      if not split:
        current = (current or '') + text
        continue
      for k, part in enumerate(re.split(r'[ \t\n]+', text)):
        if k > 0 and current is not None:
          fields.append(current)
          current = None
        if part:
          current = (current or '') + part
    if current is not None:
      fields.append(current)
    return fields

  def execute(self, words: list[_Word], line: int) -> None:
    assignments = []
    while words and words[0].assignment:
      assignments.append(words.pop(0))
    if not words:
      for word in assignments:
        self._assign(word, line)
      return
    first = ''.join(self.fields(words[0])) if words[0].chunks else ''
    if first in _CONTROL_WORDS or first.endswith('()'):
      raise ScriptError(
        f'line {line}: "{first}" blocks are outside the shell subset read here '
        '(assignments, export, heredocs, commands); write their values as plain '
        'assignments, or pass them with --set VAR=VALUE'
      )
    if first in ('export', 'declare', 'typeset', 'readonly', 'local'):
      for word in words[1:]:
        if word.assignment:
          self._assign(word, line)
      return
    if first == 'unset':
      for word in words[1:]:
        self.shell.variables.pop(''.join(self.fields(word)), None)
      return
    expanded = [field for word in words for field in self.fields(word)]
    self.shell.commands.append(Command(line, expanded))
    for i, arg in enumerate(expanded[:-2]):
      if os.path.basename(arg) in ('bash', 'sh') and expanded[i + 1] == '-c':
        _Reader(expanded[i + 2], self.shell, line).run(at_line=line)
        break

  def _assign(self, word: _Word, line: int) -> None:
    text = ''.join(t for t, _ in word.chunks)
    name_end = text.index('=') + 1
    append = text[name_end - 2] == '+'
    value = text[name_end:]
    if append:
      value = (self.shell.lookup(word.assignment) or '') + value
    self.shell.assign(word.assignment, value, line)


class _Unknown(Exception):
  pass


_ARITHMETIC = {
  ast.Add: operator.add,
  ast.Sub: operator.sub,
  ast.Mult: operator.mul,
  ast.Mod: operator.mod,
  ast.Pow: operator.pow,
  ast.LShift: operator.lshift,
  ast.RShift: operator.rshift,
  ast.BitAnd: operator.and_,
  ast.BitOr: operator.or_,
  ast.FloorDiv: operator.floordiv,
}


def _evaluate(node: ast.AST, shell: Shell) -> int:
  """Bash integer arithmetic: + - * / % ** << >> & |, names read as variables."""
  if isinstance(node, ast.Constant) and isinstance(node.value, int):
    return node.value
  if isinstance(node, ast.Name):
    value = shell.lookup(node.id)
    if value is None or unknowns(value):
      raise _Unknown(unknowns(value)[0] if value else f'${node.id}')
    return int(value.strip() or 0)
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
    operand = _evaluate(node.operand, shell)
    return -operand if isinstance(node.op, ast.USub) else operand
  if isinstance(node, ast.BinOp):
    left, right = _evaluate(node.left, shell), _evaluate(node.right, shell)
    if isinstance(node.op, ast.Div):  # bash truncates toward zero
      return int(left / right) if right else left // right
    if type(node.op) in _ARITHMETIC:
      return _ARITHMETIC[type(node.op)](left, right)
  raise ValueError(f'unsupported {type(node).__name__}')


def read_slurm_resources(text: str) -> dict[str, int]:
  """Nodes and GPUs per node of the `#SBATCH` lines: {'nodes': N, 'gpus_per_node': G}."""
  found = {}
  for line in text.splitlines():
    match = re.match(r'\s*#SBATCH\s+(.*)', line)
    if not match:
      continue
    directive = match.group(1).split('#')[0].strip()
    for pattern, key in (
      (r'(?:--nodes[= ]|-N\s*)(\d+)', 'nodes'),
      (r'--gres[= ]gpu:(?:\w+:)?(\d+)', 'gpus_per_node'),
      (r'--gpus-per-node[= ](\d+)', 'gpus_per_node'),
    ):
      value = re.match(pattern, directive)
      if value:
        found[key] = int(value.group(1))
  return found


def read_script(text: str, sets: dict[str, str]) -> Shell:
  """Runs the shell subset over the script (nothing is executed) and returns what it found."""
  shell = Shell(pinned=dict(sets))
  nodes = read_slurm_resources(text).get('nodes')
  if nodes is not None:
    for name in ('SLURM_NNODES', 'SLURM_JOB_NUM_NODES'):
      shell.variables[name] = str(nodes)
  shell.run(text)
  return shell


# --------------------------------------------------------------------------- the Megatron command

_PRETRAIN_RE = re.compile(r'(^|/)pretrain_gpt\w*\.py$')


@dataclasses.dataclass
class MegatronCommand:
  line: int
  launcher: list[str]  # words before pretrain_gpt.py (torch.distributed.run, deepspeed, srun)
  args: list[str]


def find_megatron_command(shell: Shell) -> MegatronCommand:
  """The last command that runs pretrain_gpt.py (echo lines are not runs)."""
  found = None
  for command in shell.commands:
    if not command.words or command.words[0] in _NO_EFFECT_COMMANDS:
      continue
    for i, word in enumerate(command.words):
      if _PRETRAIN_RE.search(readable(word)):
        found = MegatronCommand(command.line, command.words[:i], command.words[i + 1 :])
        break
  if found is None:
    # A script that builds the command in a variable and launches it in a way not read here.
    for value in shell.variables.values():
      try:
        words = shlex.split(value)
      except ValueError:
        continue
      for i, word in enumerate(words):
        if _PRETRAIN_RE.search(readable(word)):
          found = MegatronCommand(0, words[:i], words[i + 1 :])
  if found is None:
    raise ScriptError(
      'no command runs pretrain_gpt.py: this reads Megatron-DeepSpeed GPT '
      'launch scripts (python/torch.distributed.run/deepspeed ... '
      'pretrain_gpt.py --num-layers ...); pass such a script'
    )
  return found


def parse_flags(words: list[str]) -> tuple[dict[str, list[str]], list[str]]:
  """{'--flag': [values]} in order (argparse: the last of a repeated flag wins), and a note for
  each repeated flag."""
  flags: dict[str, list[str]] = {}
  repeated = []
  flag = None
  for word in words:
    is_flag = word.startswith('--') or (
      word.startswith('-') and len(word) > 1 and not re.match(r'-[\d.]', word)
    )
    if is_flag:
      flag, _, value = word.partition('=')
      if flag in flags:
        repeated.append(f'{flag} is given more than once: the last one wins, as in argparse')
        del flags[flag]
      flags[flag] = [value] if value else []
    elif flag is not None:
      flags[flag].append(word)
  return flags, repeated


# --------------------------------------------------------------------------- the flag table


class Rule(NamedTuple):
  key: str  # 'section.name' in our config
  convert: Callable[[list[str]], Any]
  note: str = ''


def _one(values: list[str]) -> str:
  if len(values) != 1:
    raise ValueError(f'expected one value, got {len(values)}')
  return values[0].strip('\'"')


def _int(values):
  return int(_one(values))


def _float(values):
  return float(_one(values))


def _str(values):
  return _one(values)


def _const(value):
  def convert(values):
    if values:
      raise ValueError(f'takes no value, got {values}')
    return value

  return convert


def _ints(count):
  def convert(values):
    numbers = tuple(int(v) for v in ' '.join(values).split())
    if len(numbers) != count:
      raise ValueError(f'expected {count} numbers')
    return numbers

  return convert


def _joined(values):
  if not values:
    raise ValueError('expected a value')
  return ' '.join(v.strip('\'"') for v in values)


def _split(values):
  # '969, 30, 1' may arrive as several words when the quotes stayed literal.
  if not values:
    raise ValueError('expected shares such as 969,30,1')
  return ''.join(values).strip('\'"').replace(' ', '')


def _choice(*allowed):
  def convert(values):
    value = _one(values)
    if value not in allowed:
      raise ValueError(f'{value!r} is not one of {list(allowed)} available here')
    return value

  return convert


def _ranges(values):
  if not values:
    raise ValueError('expected ranges such as 13251-14000')
  return tuple(v.strip('\'"') for v in values)


FLAGS: dict[str, Rule] = {
  # model shape
  '--num-layers': Rule('model.num_layers', _int),
  '--hidden-size': Rule('model.hidden_size', _int),
  '--num-attention-heads': Rule('model.num_heads', _int),
  '--ffn-hidden-size': Rule('model.ffn_hidden_size', _int),
  '--seq-length': Rule('train.seq_len', _int),
  '--max-position-embeddings': Rule(
    'model.max_position_embeddings', _int, 'used by the gpt2 architecture (learned positions) only'
  ),
  '--init-method-std': Rule(
    'model.init_std', _float, 'output projections use std / sqrt(2 * layers), as Megatron'
  ),
  '--pad-vocab-size-to': Rule('model.pad_vocab_size_to', _int),
  '--layernorm-epsilon': Rule('model.layernorm_epsilon', _float),
  '--hidden-dropout': Rule('model.hidden_dropout', _float),
  '--attention-dropout': Rule('model.attention_dropout', _float),
  '--checkpoint-activations': Rule(
    'model.remat_policy', _const('full'), 'each block recomputed in the backward pass'
  ),
  '--bf16': Rule(
    'model.dtype',
    _const('bfloat16'),
    'fp32 master weights and Adam moments, fp32 gradient accumulation',
  ),
  # parallelism
  '--tensor-model-parallel-size': Rule('mesh.tensor', _int),
  '--pipeline-model-parallel-size': Rule('mesh.pipeline', _int),
  # batch
  '--micro-batch-size': Rule('train.micro_batch_size', _int),
  '--global-batch-size': Rule('train.global_batch_size', _int),
  '--rampup-batch-size': Rule(
    'train.rampup_batch_size', _ints(3), 'START INCREMENT SAMPLES, the same ramp'
  ),
  '--train-samples': Rule('train.train_samples', _int),
  '--train-iters': Rule('train.steps', _int),
  '--seed': Rule('train.seed', _int),
  # optimizer and schedule
  '--lr': Rule('optimizer.lr', _float),
  '--min-lr': Rule('optimizer.min_lr', _float),
  '--lr-decay-style': Rule('optimizer.decay_style', _choice('cosine', 'linear', 'constant')),
  '--lr-decay-samples': Rule('optimizer.decay_samples', _int),
  '--lr-decay-tokens': Rule(
    'optimizer.decay_tokens', _int, 'counted from the tokens consumed when the warm-up ends'
  ),
  '--lr-warmup-samples': Rule('optimizer.warmup_samples', _int),
  '--clip-grad': Rule('optimizer.clip_grad', _float, 'global norm; 0 disables'),
  '--weight-decay': Rule(
    'optimizer.weight_decay',
    _float,
    'AdamW form; none on biases and LayerNorms (embedding LN included)',
  ),
  '--adam-beta1': Rule('optimizer.beta1', _float),
  '--adam-beta2': Rule('optimizer.beta2', _float),
  '--adam-eps': Rule('optimizer.eps', _float),
  # data
  '--data-path': Rule('data.train_path', _joined, "'PREFIX' or 'W1 PREFIX1 W2 PREFIX2 ...'"),
  '--split': Rule('data.split', _split, 'the split is cut by documents, as Megatron'),
  '--skip-train-iteration-range': Rule(
    'data.skip_train_iteration_range', _ranges, 'the skipped iterations still count here'
  ),
  # runs
  '--save-interval': Rule('checkpoint.save_interval', _int),
  '--eval-interval': Rule('eval.interval', _int),
  '--eval-iters': Rule('eval.iters', _int),
  '--exit-duration-in-mins': Rule('runtime.exit_duration_mins', _float, 'a save, then exit code 3'),
  '--kill-switch-path': Rule('runtime.kill_switch_path', _str),
  '--no-load-optim': Rule(
    'checkpoint.load_optimizer', _const(False), 'fresh Adam moments and step count 0'
  ),
  '--override-lr-scheduler': Rule('checkpoint.override_lr_scheduler', _const(True)),
  '--no-load-rng': Rule('checkpoint.load_rng', _const(False)),
}

# Flags whose value comes from several flags or the launch: read by the _derive_* functions.
DERIVED = {
  '--position-embedding-type': 'model.architecture (with --embed-layernorm)',
  '--embed-layernorm': 'model.architecture (with --position-embedding-type)',
  '--tokenizer-type': 'model.vocab_size',
  '--tokenizer-name-or-path': 'model.vocab_size',
  '--make-vocab-size-divisible-by': 'model.pad_vocab_size_to',
  '--lr-decay-iters': 'optimizer.decay_samples (iterations x global batch)',
  '--lr-warmup-iters': 'optimizer.warmup_samples (iterations x global batch)',
  '--lr-warmup-fraction': 'optimizer.warmup_samples (fraction of the decay)',
  '--deepspeed_config': 'the DeepSpeed JSON: clipping, precision, ZeRO, curriculum',
  '--deepspeed-config': 'the DeepSpeed JSON: clipping, precision, ZeRO, curriculum',
  '--train-weighted-split-paths': 'data.train_weighted_split_paths',
  '--valid-weighted-split-paths': 'data.valid_weighted_split_paths',
  '--test-weighted-split-paths': 'data.test_weighted_split_paths',
  '--train-weighted-split-paths-path': 'data.train_weighted_split_paths (the file)',
  '--valid-weighted-split-paths-path': 'data.valid_weighted_split_paths (the file)',
  '--test-weighted-split-paths-path': 'data.test_weighted_split_paths (the file)',
  '--use-bnb-optimizer': 'optimizer.name and model.stable_embedding',
}

_ZERO = (
  'the optimizer state (fp32 master weights, both Adam moments) is always split over '
  'mesh.data here (ZeRO-1, which bf16 runs with DeepSpeed stage 0 also had); for stage 3 set '
  'mesh.zero_stage=3'
)
_LOGGING = 'logging here is fixed: every iteration, TensorBoard under WORKDIR/tensorboard'
_FUSION = 'XLA fuses the kernels itself; the numbers are the same'

EXPLAINED: dict[str, str] = {
  '--distributed-backend': 'JAX picks the collectives (NCCL on GPUs)',
  '--DDP-impl': 'data parallelism is a mesh axis here',
  '--local_rank': 'set by the launcher',
  '--deepspeed': 'no DeepSpeed here; its JSON is read from --deepspeed_config',
  '--deepspeed-activation-checkpointing': 'recomputation is model.remat_policy '
  '(--checkpoint-activations)',
  '--partition-activations': 'memory layout only; model.sequence_parallel splits activations',
  '--zero-stage': _ZERO,
  '--optimizer': 'Adam in AdamW form is the optimizer here ("adam" only)',
  '--pp-partition-method': 'stages hold transformer layers only, with at most one padding '
  'slot; the embedding is split over tensor x pipeline',
  '--save': "checkpoints go to WORKDIR/checkpoints (the train command's --workdir)",
  '--load': 'a run resumes from WORKDIR/checkpoints; checkpoint.init_from starts from another',
  '--universal-checkpoint': 'checkpoints restore onto any mesh here without conversion',
  '--data-impl': "data is read in Megatron's mmap format (PREFIX.bin + PREFIX.idx)",
  '--vocab-file': 'data arrives tokenized (mmap); only the vocabulary size is needed',
  '--merge-file': 'data arrives tokenized (mmap); only the vocabulary size is needed',
  '--num-workers': 'the sampler is a pure function of consumed samples',
  '--log-interval': _LOGGING,
  '--tensorboard-dir': _LOGGING + ' (runtime.tensorboard_dir, relative to the workdir)',
  '--tensorboard-queue-size': _LOGGING,
  '--tensorboard-log-interval': _LOGGING,
  '--log-timers-to-tensorboard': _LOGGING,
  '--log-batch-size-to-tensorboard': _LOGGING,
  '--log-validation-ppl-to-tensorboard': 'validation loss and PPL are always logged',
  '--log-num-zeros-in-grad': 'num zeros is always logged',
  '--log-params-norm': _LOGGING,
  '--log-level': _LOGGING,
  '--log-level-replica': _LOGGING,
  '--log-path': _LOGGING,
  '--codecarbon-dir': 'no energy tracking here',
  '--sync-tp-duplicated-parameters': 'a replicated parameter is one array here; '
  'runtime.replica_check_interval compares its copies',
  '--abort-on-unmet-fused-kernel-constraints': 'model.attention_fallback=False (the default)'
  ' already makes an unmet constraint an error',
  '--no-masked-softmax-fusion': _FUSION,
  '--no-bias-gelu-fusion': _FUSION,
  '--no-bias-dropout-fusion': _FUSION,
  '--masked-softmax-fusion': _FUSION,
  '--use-contiguous-buffers-in-ddp': 'memory layout only',
  '--accumulate-allreduce-grads-in-fp32': 'gradients always accumulate in fp32 here',
  '--attention-softmax-in-fp32': 'attention scores and softmax are always fp32 here',
  '--use-cpu-initialization': 'initialisation is one jitted function, sharded',
  '--mmap-warmup': 'reading is lazy; no warm-up needed',
  '--dataloader-type': 'the sampler is a pure function of consumed samples',
}

NOT_AVAILABLE: dict[str, str] = {
  '--fp16': 'fp16 needs dynamic loss scaling, which t5x_like does not implement; the config '
  "uses bfloat16 (fp32's range, BLOOM's choice after tr8's fp16 divergences)",
  '--train-tokens': 'no token-based stop here: training stops at train.train_samples or '
  'train.steps; set one to the samples the tokens correspond to',
  '--loss-scale': 'fp16 loss scaling is not implemented (bf16 needs none)',
  '--initial-loss-scale': 'fp16 loss scaling is not implemented (bf16 needs none)',
  '--min-loss-scale': 'fp16 loss scaling is not implemented (bf16 needs none)',
  '--loss-scale-window': 'fp16 loss scaling is not implemented (bf16 needs none)',
  '--hysteresis': 'fp16 loss scaling is not implemented (bf16 needs none)',
  '--glu-activation': 'the MLP here is GeLU (no GLU variants)',
  '--reset-position-ids': 'samples here never reset at end-of-document',
  '--reset-attention-mask': 'samples here never reset at end-of-document',
  '--eod-mask-loss': 'the loss here covers every token, end-of-document included',
  '--num-layers-per-virtual-pipeline-stage': 'set pipeline.repeats (circular schedule) '
  'to layers / (pipeline x this)',
  '--finetune': 'start from weights with checkpoint.init_from',
}

# What the config holds in place of a flag not available here (the closest setting).
FALLBACKS: dict[str, tuple[str, Any]] = {'--fp16': ('model.dtype', 'bfloat16')}

# Megatron's default of each key the flags above set, applied when the flag is not in the script:
# several differ from ours (dropout 0.1, weight decay 0.01, beta2 0.999, linear decay, 100 eval
# iterations), and the run used Megatron's.
MEGATRON_DEFAULTS: dict[str, tuple[Any, str]] = {
  'model.ffn_hidden_size': (0, '--ffn-hidden-size: 4 x hidden'),
  'model.init_std': (0.02, '--init-method-std 0.02'),
  'model.pad_vocab_size_to': (0, '--make-vocab-size-divisible-by 128 (x tensor), as ours'),
  'model.layernorm_epsilon': (1e-5, '--layernorm-epsilon 1e-5'),
  'model.hidden_dropout': (0.1, '--hidden-dropout 0.1'),
  'model.attention_dropout': (0.1, '--attention-dropout 0.1'),
  'model.remat_policy': ('none', 'no --checkpoint-activations'),
  'model.dtype': ('float32', 'no --bf16/--fp16: fp32'),
  'mesh.tensor': (1, '--tensor-model-parallel-size 1'),
  'mesh.pipeline': (1, '--pipeline-model-parallel-size 1'),
  'train.rampup_batch_size': ((), 'no --rampup-batch-size'),
  'train.train_samples': (0, 'no --train-samples'),
  'train.steps': (0, 'no --train-iters'),
  'train.seed': (1234, '--seed 1234'),
  'optimizer.min_lr': (0.0, '--min-lr 0'),
  'optimizer.decay_style': ('linear', '--lr-decay-style linear'),
  'optimizer.warmup_samples': (0, '--lr-warmup-samples 0'),
  'optimizer.decay_tokens': (0, 'no --lr-decay-tokens'),
  'optimizer.clip_grad': (1.0, '--clip-grad 1.0'),
  'optimizer.weight_decay': (0.01, '--weight-decay 0.01'),
  'optimizer.beta1': (0.9, '--adam-beta1 0.9'),
  'optimizer.beta2': (0.999, '--adam-beta2 0.999'),
  'optimizer.eps': (1e-8, '--adam-eps 1e-8'),
  'data.skip_train_iteration_range': ((), 'no --skip-train-iteration-range'),
  'eval.interval': (1000, '--eval-interval 1000'),
  'eval.iters': (100, '--eval-iters 100'),
  'checkpoint.save_interval': (0, 'no --save-interval: a save at the end only'),
  'checkpoint.load_optimizer': (True, 'no --no-load-optim'),
  'checkpoint.override_lr_scheduler': (False, 'no --override-lr-scheduler'),
  'checkpoint.load_rng': (True, 'no --no-load-rng'),
  'runtime.exit_duration_mins': (0.0, 'no --exit-duration-in-mins'),
  'runtime.kill_switch_path': ('', 'no --kill-switch-path'),
}

# Flags Megatron needs (no default): without one the config would silently take ours.
REQUIRED = (
  '--num-layers',
  '--hidden-size',
  '--num-attention-heads',
  '--seq-length',
  '--micro-batch-size',
  '--lr',
)

# Vocabulary sizes (real tokens) of the tokenizers the chronicles' runs used.
KNOWN_TOKENIZERS = {
  'GPT2BPETokenizer': 50257,
  'gpt2': 50257,
  'bigscience/tokenizer': 250680,
  'bigscience/bloom': 250680,
  'bigscience-catalogue-data-dev/byte-level-bpe-tokenizer-no-norm-250k-whitespace-and-eos-'
  'regex-alpha-v3-dedup-lines-articles': 250680,
}

# The DeepSpeed JSON, key by flattened key.
DS_EXPLAINED = {
  'train_batch_size': 'duplicates --global-batch-size (checked equal)',
  'train_micro_batch_size_per_gpu': 'duplicates --micro-batch-size (checked equal)',
  'gradient_accumulation_steps': 'follows from the batch sizes and mesh.data',
  'zero_optimization.stage': _ZERO,
  'zero_allow_untested_optimizer': 'no DeepSpeed here',
  'steps_per_print': _LOGGING,
  'wall_clock_breakdown': _LOGGING,
  'prescale_gradients': 'gradients are averaged over mesh.data in fp32',
  'bf16.enabled': 'the precision is --bf16',
  'fp16.enabled': 'the precision is --fp16',
}


# --------------------------------------------------------------------------- the conversion


@dataclasses.dataclass
class Conversion:
  """The converted config (`raw`: section -> key -> value) and the three lists of the report."""

  raw: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
  sources: dict[str, str] = dataclasses.field(default_factory=dict)  # key -> where it came from
  mapped: list[str] = dataclasses.field(default_factory=list)
  explained: list[str] = dataclasses.field(default_factory=list)
  unmapped: list[str] = dataclasses.field(default_factory=list)
  notes: list[str] = dataclasses.field(default_factory=list)

  def set(self, key: str, value: Any, source: str, note: str = '') -> None:
    section, name = key.split('.')
    self.raw.setdefault(section, {})[name] = value
    self.sources[key] = source
    self.mapped.append(f'{source} -> {key} = {value!r}' + (f' ({note})' if note else ''))

  def get(self, key: str, default: Any = None) -> Any:
    section, name = key.split('.')
    return self.raw.get(section, {}).get(name, default)

  def has(self, key: str) -> bool:
    section, name = key.split('.')
    return name in self.raw.get(section, {})

  def miss(self, what: str, why: str, key: str = '') -> None:
    self.unmapped.append(f'{what}: {why}')
    if key:
      self.sources.setdefault(key, f'NOT MAPPED: {what}')

  @property
  def exit_code(self) -> int:
    return 1 if self.unmapped else 0


def _shown(flag: str, values: list[str]) -> str:
  return ' '.join([flag, *values])[:90]


def _needs_set(values: list[str]) -> str:
  names = sorted({u for v in values for u in unknowns(v)})
  variables = [m.group(1) for m in map(_VARIABLE_RE.fullmatch, names) if m]
  sets = ' '.join(f'--set {name}=VALUE' for name in variables)
  return f'built from {", ".join(names)}, which the script does not set' + (
    f'; pass {sets}' if sets else ' (a command, never run here)'
  )


def convert(text: str, sets: dict[str, str] | None = None, script_dir: str = '.') -> Conversion:
  """The conversion of a launch script's text; raises ScriptError on a script it cannot read."""
  shell = read_script(text, sets or {})
  command = find_megatron_command(shell)
  flags, repeated = parse_flags(command.args)
  out = Conversion()
  out.notes += repeated + shell.overridden
  for flag, values in flags.items():
    shown = readable(_shown(flag, values))
    if flag in FLAGS:
      rule = FLAGS[flag]
      if any(unknowns(v) for v in values):
        out.miss(shown, _needs_set(values), rule.key)
        continue
      try:
        value = rule.convert(values)
      except ValueError as e:
        out.miss(shown, f'cannot read the value: {e}', rule.key)
        continue
      out.set(rule.key, value, shown, rule.note)
    elif flag in EXPLAINED:
      out.explained.append(f'{shown}: {EXPLAINED[flag]}')
    elif flag in NOT_AVAILABLE:
      key, value = FALLBACKS.get(flag, ('', None))
      out.miss(shown, NOT_AVAILABLE[flag], key)
      if key:
        out.raw.setdefault(key.split('.')[0], {})[key.split('.')[1]] = value
    elif flag not in DERIVED:
      out.miss(shown, 'no rule for this flag here; check whether it changes the run')
  for flag in REQUIRED:
    if flag not in flags:
      key = FLAGS[flag].key
      out.miss(
        flag, f'Megatron requires it and the script does not give it; {key} keeps our default', key
      )
  _derive_architecture(out, flags)
  _derive_bnb(out, flags)
  _derive_vocabulary(out, flags)
  _derive_mesh_data(out, command, text)
  _derive_batch(out)
  _derive_deepspeed(out, flags, shell, script_dir)
  _derive_schedule_in_iterations(out, flags)
  _derive_weighted_splits(out, flags, shell, script_dir)
  _apply_defaults(out, flags)
  _check(out)
  return out


def _flag_value(out: Conversion, flags, flag: str) -> str | None:
  values = flags.get(flag)
  if values is None:
    return None
  if any(unknowns(v) for v in values):
    out.miss(readable(_shown(flag, values)), _needs_set(values))
    return None
  return ' '.join(v.strip('\'"') for v in values)


def _derive_architecture(out: Conversion, flags) -> None:
  """bloom = ALiBi + embedding LayerNorm; gpt2 = learned positions, no embedding LayerNorm."""
  positions = _flag_value(out, flags, '--position-embedding-type') or 'absolute'
  embed_ln = '--embed-layernorm' in flags
  source = (
    ' '.join(
      f
      for f in ('--position-embedding-type ' + positions, '--embed-layernorm')
      if f.split()[0] in flags
    )
    or '(neither flag: absolute positions)'
  )
  if positions not in ('alibi', 'absolute'):
    out.miss(
      f'--position-embedding-type {positions}',
      'only alibi (bloom) and absolute (gpt2) positions exist here',
      'model.architecture',
    )
    return
  architecture = 'bloom' if positions == 'alibi' else 'gpt2'
  if embed_ln != (architecture == 'bloom'):
    out.miss(
      source,
      f'{"ALiBi without" if embed_ln is False else "learned positions with"} an '
      'embedding LayerNorm is not a model here (bloom: ALiBi + embedding LayerNorm, gpt2: '
      f'learned positions without); the config uses {architecture!r}',
      'model.architecture',
    )
    section = out.raw.setdefault('model', {})
    section['architecture'] = architecture
    return
  out.set(
    'model.architecture',
    architecture,
    source,
    'ALiBi + embedding LayerNorm'
    if architecture == 'bloom'
    else 'learned positions, no embedding LayerNorm',
  )


def _derive_bnb(out: Conversion, flags) -> None:
  """Megatron-DeepSpeed's --use-bnb-optimizer: bitsandbytes' Adam8bit and its StableEmbedding
  (Xavier-uniform init, an embedding LayerNorm, fp32 optimizer state for the embedding)."""
  flag = '--use-bnb-optimizer'
  if flag not in flags:
    return
  out.set(
    'optimizer.name',
    'adamw_8bit',
    flag,
    "bitsandbytes' Adam8bit: 8-bit block-wise "
    'quantised moments, blocks of optimizer.quant_block_size=256 values',
  )
  out.set(
    'model.stable_embedding',
    True,
    flag,
    'StableEmbedding: Xavier-uniform embedding, '
    'the embedding LayerNorm (with gpt2: on the token lookup, before the positions), fp32 '
    'optimizer state for the embedding',
  )


def _derive_vocabulary(out: Conversion, flags) -> None:
  kind = _flag_value(out, flags, '--tokenizer-type')
  name = _flag_value(out, flags, '--tokenizer-name-or-path')
  if kind is None and '--vocab-file' in flags:
    kind = 'GPT2BPETokenizer'  # Megatron's GPT default with --vocab-file/--merge-file
  tokenizer = name if kind == 'PretrainedFromHF' else kind
  source = ' '.join(
    f'{f} {v}' for f, v in (('--tokenizer-type', kind), ('--tokenizer-name-or-path', name)) if v
  )
  size = KNOWN_TOKENIZERS.get(tokenizer or '')
  if size is None and tokenizer:
    size = KNOWN_TOKENIZERS.get(tokenizer.rstrip('/').split('/')[-1])
  if size is None:
    out.miss(
      source or '(no tokenizer flag)',
      'the vocabulary size of this tokenizer is not '
      'known here; set model.vocab_size (real tokens) in the written config',
      'model.vocab_size',
    )
  else:
    out.set('model.vocab_size', size, source, 'real tokens of this tokenizer')
  divisible = _flag_value(out, flags, '--make-vocab-size-divisible-by')
  if divisible is None:
    return
  source = f'--make-vocab-size-divisible-by {divisible}'
  if out.has('model.pad_vocab_size_to'):
    out.explained.append(f'{source}: --pad-vocab-size-to sets the padded size')
  elif int(divisible) == 128:
    out.explained.append(f'{source}: ours pads to a multiple of 128 x mesh.tensor too')
  elif size is not None:
    multiple = int(divisible) * out.get('mesh.tensor', 1)
    out.set(
      'model.pad_vocab_size_to',
      -(-size // multiple) * multiple,
      source,
      f'{size} padded to a multiple of {divisible} x tensor',
    )
  else:
    out.miss(source, 'the vocabulary size is unknown, so is its padding', 'model.pad_vocab_size_to')


def _launcher_option(words: list[str], *names: str) -> str | None:
  for i, word in enumerate(words):
    for name in names:
      if word == name and i + 1 < len(words):
        return words[i + 1]
      if word.startswith(name + '='):
        return word.split('=', 1)[1]
  return None


def _derive_mesh_data(out: Conversion, command: MegatronCommand, text: str) -> None:
  """mesh.data = nodes x GPUs per node / (tensor x pipeline), as Megatron's world size."""
  slurm = read_slurm_resources(text)
  nodes = _launcher_option(command.launcher, '--nnodes', '--num_nodes', '--num-nodes')
  gpus = _launcher_option(
    command.launcher, '--nproc_per_node', '--nproc-per-node', '--num_gpus', '--num-gpus'
  )
  nodes_from = "the launcher's node count" if nodes else '#SBATCH --nodes'
  gpus_from = "the launcher's processes per node" if gpus else '#SBATCH --gres=gpu:N'
  nodes = nodes if nodes is not None else str(slurm.get('nodes', ''))
  gpus = gpus if gpus is not None else str(slurm.get('gpus_per_node', ''))
  tensor, pipeline = out.get('mesh.tensor', 1), out.get('mesh.pipeline', 1)
  missing = [
    f'{what} ({readable(v) or "not found"})'
    for what, v in (('the node count', nodes), ('the GPUs per node', gpus))
    if not re.fullmatch(r'\d+', v)
  ]
  if missing:
    out.miss(
      'mesh.data',
      f'{" and ".join(missing)} unknown; give the launcher --nnodes and '
      '--nproc_per_node, #SBATCH --nodes and --gres=gpu:N, or --set the variables '
      'they use',
      'mesh.data',
    )
    return
  world = int(nodes) * int(gpus)
  if world % (tensor * pipeline):
    out.miss(
      'mesh.data',
      f'{nodes} nodes x {gpus} GPUs is not divisible by tensor x pipeline ({tensor} x {pipeline})',
      'mesh.data',
    )
    return
  out.set(
    'mesh.data',
    world // (tensor * pipeline),
    f'{nodes} nodes x {gpus} GPUs / ({tensor} x {pipeline})',
    f'{nodes_from}, {gpus_from}',
  )


def _derive_batch(out: Conversion) -> None:
  if not out.has('train.global_batch_size') and out.has('train.micro_batch_size'):
    gbs = out.get('train.micro_batch_size') * out.get('mesh.data', 1)
    out.set(
      'train.global_batch_size',
      gbs,
      '(no --global-batch-size)',
      "Megatron's default: micro-batch x data parallel",
    )


def _flatten(tree: dict, prefix: str = '') -> dict[str, Any]:
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict) and value:
      flat.update(_flatten(value, f'{prefix}{key}.'))
    else:
      flat[f'{prefix}{key}'] = value
  return flat


def _read_local(path: str, script_dir: str) -> str | None:
  for candidate in (path, os.path.join(script_dir, path)):
    if candidate and not unknowns(candidate) and os.path.isfile(candidate):
      with open(candidate, encoding='utf-8') as f:
        return f.read()
  return None


def _derive_deepspeed(out: Conversion, flags, shell: Shell, script_dir: str) -> None:
  """The DeepSpeed JSON: a heredoc of the script, or a file here."""
  path = flags.get('--deepspeed_config', flags.get('--deepspeed-config'))
  if not path:
    return
  path = path[0]
  text = shell.files.get(path)
  if text is None:
    text = _read_local(path, script_dir)
  if text is None:
    out.miss(
      f'--deepspeed_config {readable(path)}',
      'no heredoc of the script writes it and no '
      'such file is here; its clipping, precision, ZeRO and curriculum are not read',
    )
    return
  try:
    ds = json.loads(text)
  except json.JSONDecodeError as e:
    names = unknowns(text)
    hint = (
      f'; it uses {", ".join(sorted(set(names)))}, unknown here: pass --set for them'
      if names
      else ''
    )
    raise ScriptError(f'the DeepSpeed config {readable(path)} is not JSON ({e}){hint}') from None
  curriculum = ds.pop('curriculum_learning', None)
  for key, value in _flatten(ds).items():
    shown = f'DeepSpeed {key}: {value!r}'
    if key == 'gradient_clipping':
      given = out.get('optimizer.clip_grad')
      if given is not None and float(value) != given:
        out.miss(
          shown,
          f'differs from --clip-grad {given}; DeepSpeed clips with this one: make them equal',
          'optimizer.clip_grad',
        )
      elif given is None:
        out.set('optimizer.clip_grad', float(value), shown, 'DeepSpeed clips with this')
      else:
        out.explained.append(f'{shown}: the same as --clip-grad')
    elif key in ('train_batch_size', 'train_micro_batch_size_per_gpu'):
      ours = out.get(
        'train.global_batch_size' if key == 'train_batch_size' else 'train.micro_batch_size'
      )
      if ours is not None and value != ours:
        out.miss(shown, f'differs from the Megatron flag ({ours}); make them equal')
      else:
        out.explained.append(f'{shown}: {DS_EXPLAINED[key]}')
    elif key == 'fp16.enabled' and value:
      if '--fp16' not in flags:
        out.miss(shown, NOT_AVAILABLE['--fp16'])
    elif key == 'bf16.enabled' and value and out.get('model.dtype') != 'bfloat16':
      out.miss(
        shown,
        'DeepSpeed runs bf16 but --bf16 is not given: give both, as Megatron needs',
        'model.dtype',
      )
    elif key in DS_EXPLAINED:
      out.explained.append(f'{shown}: {DS_EXPLAINED[key]}')
    elif key.startswith(('fp16.', 'bf16.')):
      out.explained.append(f'{shown}: fp16 loss-scaling settings; bf16 needs none')
    elif key.startswith(('zero_optimization.', 'flops_profiler.', 'tensorboard.', 'comms_logger.')):
      out.explained.append(f'{shown}: memory, communication or logging tuning of DeepSpeed')
    else:
      out.miss(shown, 'no rule for this DeepSpeed setting here; check whether it changes the run')
  if curriculum is not None:
    _derive_curriculum(out, curriculum)


def _derive_curriculum(out: Conversion, cl: dict) -> None:
  """DeepSpeed's curriculum_learning section: the sequence-length curriculum of tr8b."""
  shown = f'DeepSpeed curriculum_learning {json.dumps(cl)}'[:90]
  if not cl.get('enabled', False):
    out.explained.append(f'{shown}: disabled')
    return
  schedule = cl.get('schedule_config', {})
  problems = []
  if cl.get('curriculum_type') != 'seqlen':
    problems.append(f'curriculum_type {cl.get("curriculum_type")!r} (only "seqlen" here)')
  if cl.get('schedule_type') not in ('fixed_linear', 'fixed_root'):
    problems.append(f'schedule_type {cl.get("schedule_type")!r} (fixed_linear or fixed_root here)')
  if cl.get('max_difficulty') != out.get('train.seq_len'):
    problems.append(
      f'max_difficulty {cl.get("max_difficulty")} is not --seq-length '
      f'{out.get("train.seq_len")} (here the curriculum ends at train.seq_len)'
    )
  if problems:
    out.miss(shown, '; '.join(problems), 'curriculum.min_seq_len')
    return
  source = 'DeepSpeed curriculum_learning'
  out.set('curriculum.min_seq_len', int(cl['min_difficulty']), f'{source}.min_difficulty')
  out.set(
    'curriculum.total_iterations',
    int(schedule['total_curriculum_step']),
    f'{source}.schedule_config.total_curriculum_step',
  )
  out.set(
    'curriculum.difficulty_step',
    int(schedule.get('difficulty_step', 8)),
    f'{source}.schedule_config.difficulty_step',
  )
  out.set(
    'curriculum.schedule',
    cl['schedule_type'],
    f'{source}.schedule_type',
    'evaluation always uses the full length',
  )
  if cl['schedule_type'] == 'fixed_root':
    out.set(
      'curriculum.root_degree',
      int(schedule['root_degree']),
      f'{source}.schedule_config.root_degree',
    )


def _derive_schedule_in_iterations(out: Conversion, flags) -> None:
  """Iteration-based warm-up and decay: Megatron counts them as iterations x global batch."""
  gbs = out.get('train.global_batch_size')
  decay_iters = _flag_value(out, flags, '--lr-decay-iters')
  warmup_iters = _flag_value(out, flags, '--lr-warmup-iters')
  fraction = _flag_value(out, flags, '--lr-warmup-fraction')
  if (decay_iters or warmup_iters) and (gbs is None or out.get('train.rampup_batch_size')):
    out.miss(
      '--lr-decay-iters/--lr-warmup-iters',
      'needs a fixed --global-batch-size (Megatron allows no ramp-up with iterations)',
      'optimizer.decay_samples',
    )
    return
  if decay_iters:
    out.set(
      'optimizer.decay_samples',
      int(decay_iters) * gbs,
      f'--lr-decay-iters {decay_iters}',
      f'x global batch {gbs}',
    )
  elif out.get('train.steps') and not out.has('optimizer.decay_samples') and gbs:
    out.set(
      'optimizer.decay_samples',
      out.get('train.steps') * gbs,
      '(no --lr-decay-iters)',
      "Megatron's default: --train-iters x global batch",
    )
  if warmup_iters:
    out.set(
      'optimizer.warmup_samples',
      int(warmup_iters) * gbs,
      f'--lr-warmup-iters {warmup_iters}',
      f'x global batch {gbs}',
    )
  if fraction:
    decay = out.get('optimizer.decay_samples') or out.get('train.train_samples', 0)
    out.set(
      'optimizer.warmup_samples',
      int(float(fraction) * decay),
      f'--lr-warmup-fraction {fraction}',
      f'of the decay samples {decay}',
    )


def _derive_weighted_splits(out: Conversion, flags, shell: Shell, script_dir: str) -> None:
  """--(train|valid|test)-weighted-split-paths[-path]: groups 'NAME: W START:END PREFIX, ...'."""
  for kind in ('train', 'valid', 'test'):
    flag = f'--{kind}-weighted-split-paths'
    key = f'data.{kind}_weighted_split_paths'
    for given in (flag, flag + '-path'):
      if given not in flags:
        continue
      values = flags[given]
      shown = readable(_shown(given, values))
      if any(unknowns(v) for v in values):
        out.miss(shown, _needs_set(values), key)
        continue
      if given.endswith('-path'):
        text = shell.files.get(values[0]) if values else None
        text = text if text is not None else _read_local(values[0] if values else '', script_dir)
        if text is None:
          out.miss(
            shown,
            'the file is not here (the script writes it on the cluster); copy it '
            'here and pass its path with --set',
            key,
          )
          continue
        # One group per line, each quoted (as the weighted-split arguments) or not.
        groups = (
          shlex.split(text)
          if '"' in text or "'" in text
          else [line.strip() for line in text.splitlines() if line.strip()]
        )
      else:
        groups = [v.strip('\'"') for v in values]
      bad = [g for g in groups if ':' not in g]
      if bad or not groups or (kind == 'train' and len(groups) != 1):
        out.miss(shown, 'groups must read "NAME: W START:END PREFIX, ..." (train: one group)', key)
        continue
      out.set(key, tuple(groups), shown, 'relative prefixes are read under data.root')


def _apply_defaults(out: Conversion, flags) -> None:
  weighted = any(f.endswith(('weighted-split-paths', 'weighted-split-paths-path')) for f in flags)
  defaults = dict(MEGATRON_DEFAULTS)
  if not weighted:
    defaults['data.split'] = ('969,30,1', "--split '969, 30, 1'")
  if not out.has('optimizer.decay_samples') and not out.get('train.steps'):
    # Megatron: --lr-decay-samples defaults to --train-samples.
    defaults['optimizer.decay_samples'] = (
      out.get('train.train_samples', 0),
      'no --lr-decay-samples: --train-samples',
    )
  for key, (value, megatron) in defaults.items():
    if not out.has(key) and key not in out.sources:
      out.set(key, value, f'(default) {megatron}')


def _check(out: Conversion) -> None:
  """The converted config must load and pass every start-up check of ours."""
  from t5x_like.training import startup  # imports JAX; no backend starts

  try:
    startup.check_config(config_lib.Config.from_dict(out.raw))
  except config_lib.ConfigError as e:
    out.miss('the converted config', f'does not validate here: {e}')


# --------------------------------------------------------------------------- output


def report(out: Conversion, script: str) -> str:
  lines = [
    f'{script}: {len(out.mapped)} mapped, {len(out.explained)} need no equivalent, '
    f'{len(out.unmapped)} not mapped'
  ]
  for title, items in (
    ('Mapped', out.mapped),
    ('No equivalent needed', out.explained),
    ('NOT MAPPED', out.unmapped),
    ('Notes', out.notes),
  ):
    if items:
      lines.append(f'{title} ({len(items)}):')
      lines += [f'  {item}' for item in items]
  return '\n'.join(lines) + '\n'


def _literal(value: Any) -> str:
  if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
    return f'{value:_}'
  if isinstance(value, tuple):
    return '(' + ', '.join(_literal(v) for v in value) + (',)' if len(value) == 1 else ')')
  return repr(value)


def config_text(out: Conversion, script: str) -> str:
  """The config file: one dict per section, each key with the flag it came from."""
  lines = [
    f'"""Converted from the Megatron-DeepSpeed launch script {os.path.basename(script)}',
    'by `python -m t5x_like.from_megatron` (see docs/from_megatron.md).',
    '"""',
    '',
  ]
  if out.unmapped:
    lines.insert(3, '')
    notes = [
      line
      for item in out.unmapped
      for line in textwrap.wrap(readable(item), 97, initial_indent='# - ', subsequent_indent='#   ')
    ]
    lines[4:4] = ["# NOT MAPPED (the converter's report has the whole list):"] + notes
  lines += [
    'import ml_collections',
    '',
    '',
    'def get_config() -> ml_collections.ConfigDict:',
    '  c = ml_collections.ConfigDict()',
  ]
  for section, section_cls in config_lib.SECTIONS.items():
    values = out.raw.get(section)
    if not values:
      continue
    lines.append(f'  c.{section} = dict(')
    for field in dataclasses.fields(section_cls):
      if field.name not in values:
        continue
      entry = f'      {field.name}={_literal(values[field.name])},'
      source = out.sources.get(f'{section}.{field.name}', '')
      comment = f'  # {source}' if source else ''
      if len(entry) + len(comment) > 100:
        comment = comment[: max(0, 97 - len(entry))] + '...' if len(entry) < 90 else ''
      lines.append(entry + comment)
    lines.append('  )')
  lines.append('  return c')
  return '\n'.join(lines) + '\n'


def _parse_sets(pairs: list[str]) -> dict[str, str]:
  sets = {}
  for pair in pairs:
    name, sep, value = pair.partition('=')
    if not sep or not _NAME_RE.fullmatch(name):
      raise ScriptError(
        f'--set {pair!r}: give VAR=VALUE with VAR a shell variable name, e.g. '
        '--set six_ALL_CCFRWORK=/data'
      )
    sets[name] = value
  return sets


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog='python -m t5x_like.from_megatron',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('script', help='the Megatron-DeepSpeed launch script (SLURM/bash)')
  parser.add_argument('--out', help='the config file to write (default: stdout)')
  parser.add_argument('--overwrite', action='store_true', help='replace an existing --out file')
  parser.add_argument(
    '--set',
    action='append',
    default=[],
    metavar='VAR=VALUE',
    help='a shell variable known only on the cluster (repeatable)',
  )
  args = parser.parse_args(sys.argv[1:] if argv is None else argv)
  # Before reading the script: a config edited since the last conversion is not lost.
  if args.out and os.path.exists(args.out) and not args.overwrite:
    print(
      f'error: --out {args.out} already exists; pass --overwrite to replace it or choose '
      'another --out',
      file=sys.stderr,
    )
    return 2
  try:
    sets = _parse_sets(args.set)
    try:
      with open(args.script, encoding='utf-8') as f:
        text = f.read()
    except (OSError, UnicodeDecodeError) as e:
      raise ScriptError(
        f'cannot read it ({getattr(e, "strerror", None) or e}); pass a readable launch script'
      ) from e
    out = convert(text, sets, os.path.dirname(os.path.abspath(args.script)))
  except ScriptError as e:
    print(f'error: {args.script}: {e}', file=sys.stderr)
    return 2
  text = config_text(out, args.script)
  if args.out:
    try:
      with open(args.out, 'w', encoding='utf-8') as f:
        f.write(text)
    except OSError as e:
      print(
        f'error: cannot write --out {args.out} ({e.strerror}); pass a path in an existing, '
        'writable directory',
        file=sys.stderr,
      )
      return 2
  else:
    sys.stdout.write(text)
  sys.stderr.write(report(out, args.script))
  return out.exit_code


if __name__ == '__main__':
  sys.exit(main())
